//! The nftables proxier: remembers what it programmed, sends the difference.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Instant;

use kp_model::{
    Dataplane, DataplaneError, ProxierConfig, ProxyState, RefusedOp, ServicePortName, SyncReport,
};

use crate::backend::NftBackend;
use crate::render::{
    affinity_set, render_service, shard_set, ElemKey, Element, MapName, Pool, PoolKind,
    ServiceObjects, Skeleton, SET_NODEPORT_IPS, TABLE_NAME,
};
use crate::types::{Chain, DnatTarget, ElemValue, Expr, Object, Op, Rule, Transaction, Verb};

/// A service port as programmed: its objects with the chains' rules taken
/// out (they went to the kernel) and a digest of each chain's rules kept to
/// tell a change. Keeping the rules themselves was 28 MB of the 104 MB live
/// heap at 10k Services. Two are equal when they program the same.
#[derive(PartialEq)]
struct Kept {
    /// `chains` holds the names only (empty rule lists).
    objs: ServiceObjects,
    /// One per chain, in `objs.chains`' order.
    digests: Vec<u64>,
}

fn digest(rules: &[Rule]) -> u64 {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: 64 bits, so two different rule lists look
    // alike with probability 2^-64 per comparison.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    rules.hash(&mut h);
    h.finish()
}

impl Kept {
    /// Keeps `objs`; returns its chains' rules, in `objs.chains`' order.
    fn new(mut objs: ServiceObjects) -> (Kept, Vec<Vec<Rule>>) {
        let rules: Vec<Vec<Rule>> = objs
            .chains
            .iter_mut()
            .map(|(_, r)| std::mem::take(r))
            .collect();
        let digests = rules.iter().map(|r| digest(r)).collect();
        // Kept for as long as the service port exists: no spare capacity
        // (the renderer grows these by pushing).
        objs.chains.shrink_to_fit();
        objs.elements.shrink_to_fit();
        objs.pools.shrink_to_fit();
        for p in &mut objs.pools {
            p.values.shrink_to_fit();
        }
        (Kept { objs, digests }, rules)
    }

    /// The digest of chain `name`'s rules, if it has that chain.
    fn digest_of(&self, name: &str) -> Option<u64> {
        self.objs
            .chains
            .iter()
            .zip(&self.digests)
            .find(|((c, _), _)| c == name)
            .map(|(_, d)| *d)
    }
}

/// Elements per `add element` operation: a netlink attribute's length is
/// 16 bits, and chain names make verdict elements long.
const ELEMENTS_PER_OP: usize = 128;

/// Who wants the elements in the kernel.
#[derive(Default)]
struct Claims {
    /// Set elements -> how many service ports want them.
    set_refs: HashMap<(MapName, ElemKey), usize>,
    /// Map keys -> the service port whose verdict is installed.
    map_owner: HashMap<(MapName, ElemKey), ServicePortName>,
}

/// What is in the kernel, as far as we know.
#[derive(Default)]
struct Programmed {
    services: HashMap<ServicePortName, Kept>,
    claims: Claims,
    slots: Slots,
    /// Shared affinity sets by timeout -> how many service ports use them.
    affinity: BTreeMap<u32, usize>,
}

/// Pools (selection rules) one endpoint-map shard serves. The kernel checks
/// each new element against every rule bound to its map, so this bounds the
/// cost of an element; more shards cost a little on set-name lookups.
const POOLS_PER_SHARD: u32 = 64;

#[derive(Default)]
struct Shard {
    next: u32,
    /// Freed ranges by size.
    free: HashMap<u32, Vec<u32>>,
    pools: u32,
}

/// Hands out slot ranges of the shared endpoint maps. Ranges are powers of
/// two, so a freed range fits the next Service of that size class and the
/// maps stay dense without moving anyone.
#[derive(Default)]
struct Slots {
    shards: HashMap<MapName, Shard>,
    /// Shard numbers per kind that can take another pool.
    room: HashMap<PoolKind, BTreeSet<u32>>,
    /// Shards made so far per kind.
    count: HashMap<PoolKind, u32>,
    /// Shard maps declared in the kernel (they stay until the table goes).
    declared: BTreeSet<MapName>,
}

impl Slots {
    fn alloc(&mut self, kind: PoolKind, cap: u32) -> (MapName, u32) {
        let room = self.room.entry(kind).or_default();
        let k = match room.first() {
            Some(k) => *k,
            None => {
                let c = self.count.entry(kind).or_default();
                let k = *c;
                *c += 1;
                room.insert(k);
                k
            }
        };
        let map = kind.shard(k);
        let sh = self.shards.entry(map).or_default();
        sh.pools += 1;
        if sh.pools >= POOLS_PER_SHARD {
            room.remove(&k);
        }
        if let Some(base) = sh.free.get_mut(&cap).and_then(Vec::pop) {
            return (map, base);
        }
        // Aligned to the size. The affinity rules needed it while they
        // added the base to an index with XOR; they now add it in the hash
        // (offset), so the alignment only keeps the layout as it was.
        let base = sh.next.div_ceil(cap).saturating_mul(cap);
        sh.next = base.saturating_add(cap);
        (map, base)
    }

    fn release(&mut self, p: &Pool) {
        if let Some(sh) = self.shards.get_mut(&p.map) {
            sh.free.entry(p.cap).or_default().push(p.base);
            sh.pools = sh.pools.saturating_sub(1);
            if let MapName::Endpoints(_, k) = p.map {
                self.room.entry(p.kind).or_default().insert(k);
            }
        }
    }

    /// Gives `new`'s pools their slots (keeping `old`'s range when the size
    /// still fits, so an endpoint change is only element updates) and fills in
    /// the selection rules' maps and offsets.
    fn assign(&mut self, new: &mut ServiceObjects, old: Option<&ServiceObjects>) {
        let old_pools = old.map(|o| o.pools.as_slice()).unwrap_or_default();
        let mut kept = vec![false; old_pools.len()];
        for (i, pool) in new.pools.iter_mut().enumerate() {
            let n = pool.values.len() as u32;
            let want = n.next_power_of_two();
            match old_pools.get(i) {
                Some(op) if op.kind == pool.kind && n <= op.cap && op.cap <= want * 4 => {
                    kept[i] = true;
                    pool.map = op.map;
                    pool.base = op.base;
                    pool.cap = op.cap;
                }
                _ => {
                    (pool.map, pool.base) = self.alloc(pool.kind, want);
                    pool.cap = want;
                }
            }
        }
        for (_, rules) in new.chains.iter_mut() {
            for e in rules.iter_mut().flat_map(|r| r.exprs.iter_mut()) {
                if let Expr::NumgenDnat { slots, .. }
                | Expr::AffinityHit { slots, .. }
                | Expr::HashDnat { slots, .. } = e
                {
                    if let Some(p) = new.pools.get(slots.pool) {
                        slots.map = p.map;
                        slots.offset = p.base;
                    }
                }
            }
        }
        for (op, k) in old_pools.iter().zip(kept) {
            if !k {
                self.release(op);
            }
        }
    }
}

/// What a sync does to the client records of one index of one
/// session-affinity selection: the endpoint there went (`to` None: its
/// clients are forgotten, as upstream deletes an endpoint's set), or moved
/// to index `to` (its clients follow it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Rekey {
    timeout: u32,
    id: u32,
    from: u32,
    to: Option<u32>,
}

/// Keeps every endpoint of `new`'s session-affinity pools at the index it
/// had in `old` (records name indexes), fills the free indexes with the
/// endpoints that are new or must move down (the count shrank), and says
/// what that does to the records.
fn keep_affinity_places(
    new: &mut ServiceObjects,
    old: Option<&ServiceObjects>,
    out: &mut Vec<Rekey>,
) {
    let Some(old) = old else {
        return;
    };
    for op in old.pools.iter() {
        let Some(aff) = op.affinity else {
            continue;
        };
        let np = new.pools.iter_mut().find(|p| p.affinity == Some(aff));
        let Some(np) = np else {
            // The selection went, or its affinity did: forget its records.
            out.extend((0..op.values.len() as u32).map(|from| Rekey {
                timeout: aff.timeout,
                id: aff.id,
                from,
                to: None,
            }));
            continue;
        };
        let n = np.values.len();
        let wanted: HashSet<&DnatTarget> = np.values.iter().collect();
        let mut placed: Vec<Option<DnatTarget>> = vec![None; n];
        for (j, v) in op.values.iter().enumerate().take(n) {
            if wanted.contains(v) {
                placed[j] = Some(*v);
            }
        }
        let taken: HashSet<DnatTarget> = placed.iter().flatten().copied().collect();
        let mut rest = np.values.iter().filter(|v| !taken.contains(*v)).copied();
        let values: Vec<DnatTarget> = placed
            .into_iter()
            .map(|p| p.or_else(|| rest.next()))
            .collect::<Option<Vec<_>>>()
            .unwrap_or_else(|| np.values.clone());
        let at: HashMap<&DnatTarget, u32> = values
            .iter()
            .enumerate()
            .map(|(k, v)| (v, k as u32))
            .collect();
        for (j, v) in op.values.iter().enumerate() {
            let j = j as u32;
            let to = at.get(v).copied();
            if to != Some(j) {
                out.push(Rekey {
                    timeout: aff.timeout,
                    id: aff.id,
                    from: j,
                    to,
                });
            }
        }
        np.values = values;
    }
}

/// Every element `objs` puts in the kernel: its own, then its pools' slots
/// (derived from the pools rather than stored twice: with 10 endpoints per
/// Service the slots are most of the elements).
fn all_elements(objs: &ServiceObjects) -> impl Iterator<Item = Element> + '_ {
    let slots = objs.pools.iter().flat_map(|pool| {
        pool.values.iter().enumerate().map(|(j, v)| Element {
            map: pool.map,
            key: ElemKey::Slot(pool.base + j as u32),
            value: Some(ElemValue::Endpoint(*v)),
        })
    });
    objs.elements.iter().cloned().chain(slots)
}

/// Fills in each refused operation's owner (the Service port whose chain
/// or elements it holds, else the shared object) and its text where the
/// backend did not keep it.
fn name_owners(refused: &mut [RefusedOp], tx: &Transaction, prog: &Programmed) {
    let mut chains: HashMap<&str, &ServicePortName> = HashMap::new();
    for (name, kept) in &prog.services {
        for (c, _) in &kept.objs.chains {
            chains.insert(c.as_str(), name);
        }
    }
    let of_chain = |c: &str| match chains.get(c) {
        Some(n) => format!("Service port {n}, chain {c}"),
        None => format!("chain {c}"),
    };
    // Elements are indexed only when an element operation was refused.
    let mut elements: Option<HashMap<(MapName, ElemKey), &ServicePortName>> = None;
    for r in refused.iter_mut() {
        let Some(op) = r.line.checked_sub(1).and_then(|i| tx.ops.get(i)) else {
            continue;
        };
        if r.text.is_none() {
            r.text = Some(crate::backend::shorten(&tx.op_text(r.line - 1)));
        }
        r.owner = Some(match &op.object {
            Object::Rule { chain, .. } => of_chain(chain),
            Object::Chain(c) => of_chain(&c.name),
            Object::Set(s) => format!("shared set {}", s.name),
            Object::Table { .. } => "the table".to_string(),
            Object::Elements { set, elems } => {
                let index = elements.get_or_insert_with(|| {
                    let mut m = HashMap::new();
                    for (name, kept) in &prog.services {
                        for e in all_elements(&kept.objs) {
                            m.insert((e.map, e.key), name);
                        }
                    }
                    m
                });
                let owners: BTreeSet<String> = elems
                    .iter()
                    .filter_map(|(k, _)| index.get(&(*set, k.clone())))
                    .map(|n| n.to_string())
                    .collect();
                let mut names: Vec<String> = owners.iter().take(3).cloned().collect();
                if owners.len() > 3 {
                    names.push(format!("and {} more", owners.len() - 3));
                }
                match names.is_empty() {
                    true => format!("elements of {set}"),
                    false => format!("elements of {set} for Service port {}", names.join(", ")),
                }
            }
        });
    }
}

pub struct NftablesProxier {
    cfg: ProxierConfig,
    skeleton: Skeleton,
    backend: Box<dyn NftBackend>,
    table: String,
    /// None until the first successful sync, and after a failed one: the next
    /// sync is then a full one.
    programmed: Option<Programmed>,
}

/// Accumulates one transaction in the order the kernel needs: objects are
/// created before anything refers to them and deleted after nothing does.
#[derive(Default)]
struct Tx {
    head: Vec<Op>,
    add_objects: Vec<Op>,
    rules: Vec<Op>,
    del_elements: Vec<Op>,
    add_elements: Vec<Op>,
    /// Stale chains are all flushed before any is deleted: one may still jump
    /// to another (external- to service-) until it is emptied.
    flush_stale: Vec<Op>,
    del_objects: Vec<Op>,
    ops: usize,
    /// What this transaction does to session-affinity records: done once
    /// it applied.
    rekey: Vec<Rekey>,
}

fn op(verb: Verb, object: Object) -> Op {
    Op { verb, object }
}

fn add_rule(chain: &str, rule: Rule) -> Op {
    op(
        Verb::Add,
        Object::Rule {
            chain: chain.to_string(),
            rule,
        },
    )
}

fn chain(name: &str) -> Object {
    Object::Chain(Chain::regular(name))
}

const TABLE_COMMENT: &str = "rules for kube-proxy-rs";

impl Tx {
    fn finish(self, family: kp_model::IpFamily, table: &str) -> (Transaction, usize) {
        let mut t = Transaction::new(family, table);
        let n = self.head.len()
            + self.add_objects.len()
            + self.rules.len()
            + self.del_elements.len()
            + self.add_elements.len()
            + self.flush_stale.len()
            + self.del_objects.len();
        t.ops.reserve_exact(n);
        for part in [
            self.head,
            self.add_objects,
            self.rules,
            self.del_elements,
            self.add_elements,
            self.flush_stale,
            self.del_objects,
        ] {
            t.ops.extend(part);
        }
        (t, self.ops)
    }
}

impl NftablesProxier {
    pub fn new(cfg: ProxierConfig, backend: Box<dyn NftBackend>) -> Self {
        let skeleton = Skeleton::new(&cfg);
        NftablesProxier {
            cfg,
            skeleton,
            backend,
            table: TABLE_NAME.to_string(),
            programmed: None,
        }
    }

    /// The transaction a full sync of `state` would send to a kernel without
    /// our table: what --dry-run prints (as nft text), and what the tests
    /// hand to the encoders.
    pub fn full_transaction(&self, state: &ProxyState) -> Transaction {
        let (tx, _) = self.full_tx(state, true);
        tx.finish(self.cfg.family, &self.table).0
    }

    /// Adds `objs`' chains and rules; what is kept of it.
    fn add_service(&self, tx: &mut Tx, objs: ServiceObjects) -> Kept {
        let (kept, rules) = Kept::new(objs);
        for ((name, _), rules) in kept.objs.chains.iter().zip(rules) {
            tx.add_objects.push(op(Verb::Add, chain(name)));
            tx.ops += 1;
            self.add_rules(tx, name, rules);
        }
        kept
    }

    /// `add rule` for every rule of `chain`.
    fn add_rules(&self, tx: &mut Tx, chain: &str, rules: Vec<Rule>) {
        for r in rules {
            tx.rules.push(add_rule(chain, r));
            tx.ops += 1;
        }
    }

    fn elements(&self, out: &mut Vec<Op>, verb: Verb, elems: impl IntoIterator<Item = Element>) {
        // Grouped by map: one operation per map (and per ELEMENTS_PER_OP
        // elements) keeps the transaction short. Chunked as they come:
        // at 50k Services a full sync has 700k elements, and collecting them
        // before chunking held three copies (270 MB of a 745 MB peak).
        type Chunk = Vec<(ElemKey, Option<ElemValue>)>;
        let mut by_map: BTreeMap<MapName, Vec<Chunk>> = BTreeMap::new();
        for e in elems {
            let chunks = by_map.entry(e.map).or_default();
            match chunks.last_mut() {
                Some(c) if c.len() < ELEMENTS_PER_OP => c.push((e.key, e.value)),
                _ => {
                    let mut c = Vec::with_capacity(ELEMENTS_PER_OP);
                    c.push((e.key, e.value));
                    chunks.push(c);
                }
            }
        }
        for (map, chunks) in by_map {
            for mut chunk in chunks {
                chunk.shrink_to_fit();
                out.push(op(
                    verb,
                    Object::Elements {
                        set: map,
                        elems: chunk,
                    },
                ));
            }
        }
    }

    fn skeleton_ops(&self, tx: &mut Tx, fresh: bool) {
        let table = || Object::Table {
            comment: Some(TABLE_COMMENT.into()),
        };
        tx.head.push(op(Verb::Add, table()));
        if fresh {
            // Start from nothing: the delete and re-create are one transaction, so
            // packets see the old table or the new one, never neither.
            tx.head
                .push(op(Verb::Delete, Object::Table { comment: None }));
            tx.head.push(op(Verb::Add, table()));
        } else {
            // Keeps chains, sets and affinity state; drops every rule.
            tx.head
                .push(op(Verb::Flush, Object::Table { comment: None }));
        }
        tx.ops += 2;
        for set in &self.skeleton.sets {
            tx.head.push(op(Verb::Add, Object::Set(set.clone())));
            if !fresh {
                tx.head.push(op(Verb::Flush, Object::Set(set.clone())));
            }
            tx.ops += 1;
        }
        for (name, base, rules) in &self.skeleton.chains {
            tx.head.push(op(
                Verb::Add,
                Object::Chain(Chain {
                    name: name.to_string(),
                    base: *base,
                }),
            ));
            tx.ops += 1;
            for r in rules {
                tx.rules.push(add_rule(name, r.clone()));
                tx.ops += 1;
            }
        }
        if !self.skeleton.nodeport_ips.is_empty() {
            tx.add_elements.push(op(
                Verb::Add,
                Object::Elements {
                    set: MapName::Fixed(&SET_NODEPORT_IPS),
                    elems: self
                        .skeleton
                        .nodeport_ips
                        .iter()
                        .map(|i| (ElemKey::Ip(*i), None))
                        .collect(),
                },
            ));
        }
    }

    /// The full transaction for `state`, and what it programs.
    fn full_tx(&self, state: &ProxyState, fresh: bool) -> (Tx, Programmed) {
        let mut tx = Tx::default();
        self.skeleton_ops(&mut tx, fresh);
        let mut prog = Programmed::default();
        // A full sync that keeps the table keeps the affinity records, so
        // each endpoint keeps its index.
        let before = if fresh {
            None
        } else {
            self.programmed.as_ref()
        };
        for (name, sp) in &state.services {
            let mut objs = render_service(sp, state.endpoints_of(name), &self.cfg, &state.node);
            let old = before.and_then(|p| p.services.get(name)).map(|k| &k.objs);
            keep_affinity_places(&mut objs, old, &mut tx.rekey);
            prog.slots.assign(&mut objs, None);
            prog.use_affinity(&objs, 1);
            let kept = self.add_service(&mut tx, objs);
            prog.services.insert(name.clone(), kept);
        }
        // Claimed after rendering everything, from what is kept: the
        // elements stream into the transaction's chunks without a list of
        // their own.
        let Programmed {
            services, claims, ..
        } = &mut prog;
        let mut adds = 0;
        // In the model's order (sorted), as the services were rendered.
        let elements = state
            .services
            .keys()
            .filter_map(|name| services.get_key_value(name))
            .flat_map(|(name, kept)| all_elements(&kept.objs).map(move |e| (name, e)))
            .filter_map(|(name, e)| claims.claim(name, &e).then_some(e));
        self.elements(
            &mut tx.add_elements,
            Verb::Add,
            elements.inspect(|_| adds += 1),
        );
        tx.ops += adds;
        // Affinity sets: declared once each (the set and its clients stay in
        // the kernel across a non-fresh full sync), and before the shards:
        // the kernel finds a set a rule names by walking the table's sets in
        // the order they were made, and each affinity rule names its set
        // twice (lookup and update). Behind ~950 shards at 50k Services (5%
        // affinity) those walks were half of all the full sync's set-name
        // walks, ~1 s of its ~10 s kernel time on 2026-11-26.
        for timeout in prog.affinity.keys() {
            tx.head
                .push(op(Verb::Add, Object::Set(affinity_set(*timeout))));
            tx.ops += 1;
        }
        // Endpoint-map shards: those in the kernel are kept and emptied (the
        // elements above refill them), new ones declared.
        let mut declared = BTreeSet::new();
        if !fresh {
            if let Some(old) = &self.programmed {
                declared.clone_from(&old.slots.declared);
            }
        }
        for m in &declared {
            tx.head.push(op(Verb::Add, Object::Set(shard_set(*m))));
            tx.head.push(op(Verb::Flush, Object::Set(shard_set(*m))));
            tx.ops += 2;
        }
        // Sorted: the transaction is deterministic.
        let used: BTreeSet<MapName> = prog.slots.shards.keys().copied().collect();
        for m in used {
            if declared.insert(m) {
                tx.head.push(op(Verb::Add, Object::Set(shard_set(m))));
                tx.ops += 1;
            }
        }
        prog.slots.declared = declared;
        if !fresh {
            // Chains and affinity sets we had but no longer want.
            if let Some(old) = &self.programmed {
                for (name, kept) in &old.services {
                    let new = prog.services.get(name).map(|k| &k.objs);
                    self.delete_stale(&mut tx, &kept.objs, new);
                    if new.is_none() {
                        let mut none = ServiceObjects::default();
                        keep_affinity_places(&mut none, Some(&kept.objs), &mut tx.rekey);
                    }
                }
                for timeout in old.affinity.keys() {
                    if !prog.affinity.contains_key(timeout) {
                        self.delete_affinity_set(&mut tx, *timeout);
                    }
                }
            }
        }
        (tx, prog)
    }

    /// Brings the session-affinity records in line with what the sync
    /// did to the endpoints' indexes: the clients of an endpoint that went
    /// are forgotten, as upstream's deleting an endpoint's own set forgets
    /// them (a client of a removed endpoint must not end up on whatever
    /// takes its place); those of an endpoint that moved follow it. Lists
    /// the records after the transaction applied, then deletes and re-adds
    /// in a second one (a moved record gets the full timeout again). A
    /// failure is logged and leaves the records to expire with their
    /// timeout; one retry covers a record that expired between the listing
    /// and the deletion.
    fn rekey_clients(&mut self, rekeys: &[Rekey]) {
        let mut by_set: BTreeMap<u32, HashMap<(u32, u32), Option<u32>>> = BTreeMap::new();
        for r in rekeys {
            by_set
                .entry(r.timeout)
                .or_default()
                .insert((r.id, r.from), r.to);
        }
        for (timeout, moves) in by_set {
            let set = MapName::Affinity(timeout);
            let mut result = Ok(0);
            for _attempt in 0..2 {
                let records = match self.backend.affinity_records(
                    self.cfg.family,
                    &self.table,
                    &set.to_string(),
                ) {
                    Ok(r) => r,
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                };
                let element = |key| Element {
                    map: set,
                    key,
                    value: None,
                };
                let mut gone = Vec::new();
                let mut moved = Vec::new();
                for key in records {
                    let ElemKey::Affinity { client, id, index } = key else {
                        continue;
                    };
                    if let Some(to) = moves.get(&(id, index)) {
                        gone.push(element(key));
                        if let Some(to) = to {
                            moved.push(element(ElemKey::Affinity {
                                client,
                                id,
                                index: *to,
                            }));
                        }
                    }
                }
                if gone.is_empty() {
                    result = Ok(0);
                    break;
                }
                let n = gone.len();
                let mut tx = Tx::default();
                self.elements(&mut tx.del_elements, Verb::Delete, gone);
                self.elements(&mut tx.add_elements, Verb::Add, moved);
                let (txn, _) = tx.finish(self.cfg.family, &self.table);
                result = self.backend.apply(&txn).map(|_| n);
                if result.is_ok() {
                    break;
                }
            }
            match result {
                Ok(0) => {}
                Ok(n) => {
                    tracing::debug!(set = %set, records = n, "affinity records of removed or moved endpoints updated")
                }
                Err(e) => tracing::warn!(
                    set = %set, error = %e,
                    "could not update the affinity records of removed or moved endpoints; they expire with the timeout"
                ),
            }
        }
    }

    /// Deletes a shared affinity set no service port uses any more (after the
    /// rules that name it: deletions come last in the transaction).
    fn delete_affinity_set(&self, tx: &mut Tx, timeout: u32) {
        tx.del_objects
            .push(op(Verb::Delete, Object::Set(affinity_set(timeout))));
        tx.ops += 1;
    }

    fn delete_stale(&self, tx: &mut Tx, old: &ServiceObjects, new: Option<&ServiceObjects>) {
        let chains: HashSet<&str> = new
            .map(|n| n.chains.iter().map(|(c, _)| c.as_str()).collect())
            .unwrap_or_default();
        for (name, _) in &old.chains {
            if !chains.contains(name.as_str()) {
                tx.flush_stale.push(op(Verb::Flush, chain(name)));
                tx.del_objects.push(op(Verb::Delete, chain(name)));
                tx.ops += 2;
            }
        }
    }

    /// The transaction that moves the kernel from `prog` to `state` for the
    /// `changed` service ports only, updating `prog` as it goes.
    fn partial_tx(
        &self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        prog: &mut Programmed,
    ) -> Tx {
        let mut tx = Tx::default();
        let mut del_elems: Vec<Element> = Vec::new();
        let mut add_elems: Vec<Element> = Vec::new();
        // Affinity sets whose last user went (deleted after the loop: another
        // service port of this sync may take them up again).
        let mut gone_sets: Vec<u32> = Vec::new();
        let mut updates: Vec<(ServicePortName, Option<Kept>, Option<Kept>)> = Vec::new();
        for name in changed {
            let mut new = state
                .services
                .get(name)
                .map(|sp| render_service(sp, state.endpoints_of(name), &self.cfg, &state.node));
            let old = prog.services.get(name);
            match new.as_mut() {
                Some(n) => {
                    keep_affinity_places(n, old.map(|k| &k.objs), &mut tx.rekey);
                    prog.slots.assign(n, old.map(|k| &k.objs));
                }
                // Deleted: its slot ranges are free for others.
                None => {
                    if let Some(o) = old {
                        let mut none = ServiceObjects::default();
                        keep_affinity_places(&mut none, Some(&o.objs), &mut tx.rekey);
                        for p in &o.objs.pools {
                            prog.slots.release(p);
                        }
                    }
                }
            }
            // Kept from here on; the rules go to the transaction if
            // anything changed.
            let new = new.map(Kept::new);
            if old == new.as_ref().map(|(k, _)| k) {
                continue;
            }
            let old = prog.services.remove(name);
            let empty = ServiceObjects::default();
            let o = old.as_ref().map_or(&empty, |k| &k.objs);
            let n = new.as_ref().map_or(&empty, |(k, _)| &k.objs);
            for timeout in prog.use_affinity(n, 1) {
                tx.add_objects
                    .push(op(Verb::Add, Object::Set(affinity_set(timeout))));
                tx.ops += 1;
            }
            gone_sets.extend(prog.use_affinity(o, -1));
            self.delete_stale(&mut tx, o, new.as_ref().map(|(k, _)| &k.objs));
            let new = new.map(|(kept, rules)| {
                for (((name, _), rules), d) in kept.objs.chains.iter().zip(rules).zip(&kept.digests)
                {
                    match old.as_ref().and_then(|k| k.digest_of(name)) {
                        Some(old) if old == *d => {}
                        found => {
                            if found.is_none() {
                                tx.add_objects.push(op(Verb::Add, chain(name)));
                            } else {
                                tx.rules.push(op(Verb::Flush, chain(name)));
                            }
                            tx.ops += 1;
                            self.add_rules(&mut tx, name, rules);
                        }
                    }
                }
                kept
            });
            updates.push((name.clone(), old, new));
        }
        // Elements are shared (a cluster IP by every port of a service, a hairpin
        // IP by every service of a pod): release all removals before claiming
        // additions so that a key moving between services ends up claimed.
        // Sets, not scans: a Service with thousands of endpoints has thousands
        // of elements.
        let elem_set = |o: &Option<Kept>| -> HashSet<Element> {
            o.as_ref()
                .map(|o| all_elements(&o.objs).collect())
                .unwrap_or_default()
        };
        for (name, old, new) in &updates {
            if let Some(o) = old {
                let keep = elem_set(new);
                for e in all_elements(&o.objs) {
                    if keep.contains(&e) {
                        continue;
                    }
                    if prog.claims.release(name, &e) {
                        del_elems.push(e);
                    }
                }
            }
        }
        for (name, old, new) in updates {
            if let Some(n) = new {
                let had = elem_set(&old);
                for e in all_elements(&n.objs) {
                    if had.contains(&e) {
                        continue;
                    }
                    if prog.claims.claim(&name, &e) {
                        add_elems.push(e);
                    }
                }
                prog.services.insert(name, n);
            }
        }
        let new_shards: BTreeSet<MapName> = prog
            .slots
            .shards
            .keys()
            .filter(|m| !prog.slots.declared.contains(*m))
            .copied()
            .collect();
        for m in new_shards {
            tx.add_objects
                .push(op(Verb::Add, Object::Set(shard_set(m))));
            tx.ops += 1;
            prog.slots.declared.insert(m);
        }
        for timeout in gone_sets {
            if !prog.affinity.contains_key(&timeout) {
                self.delete_affinity_set(&mut tx, timeout);
            }
        }
        tx.ops += del_elems.len() + add_elems.len();
        self.elements(&mut tx.del_elements, Verb::Delete, del_elems);
        self.elements(&mut tx.add_elements, Verb::Add, add_elems);
        tx
    }
}

impl Programmed {
    /// Counts `objs`' affinity sets in (`by` 1) or out (-1). Returns the
    /// timeouts whose set went from unused to used (in) or from used to
    /// unused (out).
    fn use_affinity(&mut self, objs: &ServiceObjects, by: i32) -> Vec<u32> {
        let mut changed = Vec::new();
        for &timeout in &objs.affinity_sets {
            if by > 0 {
                let users = self.affinity.entry(timeout).or_insert(0);
                *users += 1;
                if *users == 1 {
                    changed.push(timeout);
                }
            } else if let Some(users) = self.affinity.get_mut(&timeout) {
                *users = users.saturating_sub(1);
                if *users == 0 {
                    self.affinity.remove(&timeout);
                    changed.push(timeout);
                }
            }
        }
        changed
    }
}

impl Claims {
    /// Records that `owner` wants `e`; true when it must be added to the kernel.
    /// Set elements are reference counted. Which Service owns a contested
    /// address is decided in the model (kp_model::claims), so two service
    /// ports never bring the same map key; should one, the first keeps it
    /// and the other is logged.
    fn claim(&mut self, owner: &ServicePortName, e: &Element) -> bool {
        // Endpoint-map slots belong to the one Service the allocator gave
        // them to: no owner to record (they are most of the elements, and
        // recording them was the proxier's largest item of memory).
        if matches!(e.key, ElemKey::Slot(_)) {
            return true;
        }
        let k = (e.map, e.key.clone());
        if e.value.is_none() {
            let c = self.set_refs.entry(k).or_default();
            *c += 1;
            *c == 1
        } else {
            match self.map_owner.get(&k) {
                Some(o) if o != owner => {
                    tracing::warn!(
                        service = %owner, holder = %o, element = %e.key, map = %e.map,
                        "address and port already used by another Service; ignored"
                    );
                    false
                }
                Some(_) => false,
                None => {
                    self.map_owner.insert(k, owner.clone());
                    true
                }
            }
        }
    }

    /// Reverse of [`Self::claim`]; true when the element must leave the kernel.
    fn release(&mut self, owner: &ServicePortName, e: &Element) -> bool {
        if matches!(e.key, ElemKey::Slot(_)) {
            return true;
        }
        let k = (e.map, e.key.clone());
        if e.value.is_none() {
            match self.set_refs.get_mut(&k) {
                Some(c) if *c > 1 => {
                    *c -= 1;
                    false
                }
                Some(_) => {
                    self.set_refs.remove(&k);
                    true
                }
                None => false,
            }
        } else if self.map_owner.get(&k) == Some(owner) {
            self.map_owner.remove(&k);
            true
        } else {
            false
        }
    }
}

impl Dataplane for NftablesProxier {
    fn mode(&self) -> kp_model::DataplaneKind {
        kp_model::DataplaneKind::Nftables
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        let t0 = Instant::now();
        let is_full = full || self.programmed.is_none();
        let fresh = self.programmed.is_none();
        let (mut tx, new_prog) = if is_full {
            let (tx, prog) = self.full_tx(state, fresh);
            (tx, prog)
        } else {
            let mut prog = self.programmed.take().unwrap_or_default();
            let tx = self.partial_tx(state, changed, &mut prog);
            (tx, prog)
        };
        let rekey = std::mem::take(&mut tx.rekey);
        let (txn, ops) = tx.finish(self.cfg.family, &self.table);
        let render = t0.elapsed();
        let t1 = Instant::now();
        let mut report = SyncReport {
            full: is_full,
            ops,
            render,
            ..Default::default()
        };
        if !txn.is_empty() {
            // A full sync's operations are freed as they are encoded (the
            // largest transient of the process: at 50k Services the typed
            // operations and the batch were ~175 MB together); a kernel
            // refusal then names lines without text, and the retry is a
            // full sync anyway. A partial sync keeps its text for errors.
            let (applied, kept_tx) = if is_full {
                (self.backend.apply_owned(txn), None)
            } else {
                (self.backend.apply(&txn), Some(txn))
            };
            match applied {
                Ok(bytes) => report.bytes = bytes,
                Err(DataplaneError::Refused { tool, mut refused }) => {
                    // Name whose objects were refused; a full sync's text
                    // was freed as it was encoded, so render it again (the
                    // transaction is deterministic).
                    let tx = kept_tx.unwrap_or_else(|| {
                        let (tx, _) = self.full_tx(state, fresh);
                        tx.finish(self.cfg.family, &self.table).0
                    });
                    name_owners(&mut refused, &tx, &new_prog);
                    // Nothing was applied (one transaction); forget what we
                    // think is there so the retry is a full sync.
                    self.programmed = None;
                    return Err(DataplaneError::Refused { tool, refused });
                }
                Err(e) => {
                    self.programmed = None;
                    return Err(e);
                }
            }
        }
        if !rekey.is_empty() {
            self.rekey_clients(&rekey);
        }
        report.apply = t1.elapsed();
        for kept in new_prog.services.values() {
            report.no_local_endpoints.0 += kept.objs.no_local.0 as u64;
            report.no_local_endpoints.1 += kept.objs.no_local.1 as u64;
        }
        self.programmed = Some(new_prog);
        Ok(report)
    }

    fn render(&self, state: &ProxyState) -> String {
        self.full_transaction(state).to_string()
    }

    fn rules_lost(&mut self) -> bool {
        if self.programmed.is_none() {
            return false;
        }
        // nat-prerouting always holds `jump services`: an empty or missing
        // chain means someone flushed or deleted our rules.
        match self
            .backend
            .chain_has_rules(self.cfg.family, &self.table, "nat-prerouting")
        {
            Ok(true) => false,
            Ok(false) => {
                self.programmed = None;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "nftables canary check failed");
                false
            }
        }
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        // `add` first so that deleting a table that is not there is no error.
        let mut tx = Transaction::new(self.cfg.family, &self.table);
        tx.add(Object::Table { comment: None })
            .delete(Object::Table { comment: None });
        self.programmed = None;
        self.backend.apply(&tx).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::PoolAffinity;
    use kp_model::Protocol;

    const AFF: PoolAffinity = PoolAffinity { timeout: 60, id: 7 };

    fn objs(eps: &[&str]) -> ServiceObjects {
        let kind = PoolKind::Endpoints(Protocol::Tcp);
        ServiceObjects {
            pools: vec![Pool {
                kind,
                values: eps
                    .iter()
                    .map(|e| e.parse::<std::net::SocketAddr>().unwrap().into())
                    .collect(),
                map: kind.shard(0),
                base: 0,
                cap: 0,
                affinity: Some(AFF),
            }],
            ..Default::default()
        }
    }

    fn order(o: &ServiceObjects) -> Vec<String> {
        o.pools[0].values.iter().map(|v| v.to_string()).collect()
    }

    fn rekey(from: u32, to: Option<u32>) -> Rekey {
        Rekey {
            timeout: AFF.timeout,
            id: AFF.id,
            from,
            to,
        }
    }

    /// Endpoints keep their index while they stay: a replaced one's
    /// successor takes its index (its clients are forgotten), one that must
    /// move down when the count shrinks takes a freed index (its clients
    /// follow), a new one takes a free index.
    #[test]
    fn affinity_endpoints_keep_their_index() {
        let old = objs(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        // The model sorts: the replacement would land elsewhere.
        let mut new = objs(&["10.0.0.1:80", "10.0.0.3:80", "10.0.0.9:80"]);
        let mut out = Vec::new();
        keep_affinity_places(&mut new, Some(&old), &mut out);
        assert_eq!(
            order(&new),
            ["10.0.0.1 . 80", "10.0.0.9 . 80", "10.0.0.3 . 80"]
        );
        assert_eq!(out, [rekey(1, None)]);

        let mut fewer = objs(&["10.0.0.3:80", "10.0.0.9:80"]);
        let mut out = Vec::new();
        keep_affinity_places(&mut fewer, Some(&new), &mut out);
        assert_eq!(order(&fewer), ["10.0.0.3 . 80", "10.0.0.9 . 80"]);
        assert_eq!(out, [rekey(0, None), rekey(2, Some(0))]);

        let mut more = objs(&["10.0.0.3:80", "10.0.0.4:80", "10.0.0.9:80"]);
        let mut out = Vec::new();
        keep_affinity_places(&mut more, Some(&fewer), &mut out);
        assert_eq!(
            order(&more),
            ["10.0.0.3 . 80", "10.0.0.9 . 80", "10.0.0.4 . 80"]
        );
        assert!(out.is_empty(), "{out:?}");

        // The selection goes (no endpoints, or affinity turned off).
        let mut out = Vec::new();
        keep_affinity_places(&mut ServiceObjects::default(), Some(&more), &mut out);
        assert_eq!(out, [rekey(0, None), rekey(1, None), rekey(2, None)]);
    }

    /// Pools start at a multiple of their size (the layout the affinity
    /// rules' former XOR needed; kept as it was).
    #[test]
    fn slot_ranges_are_aligned_to_their_size() {
        let mut s = Slots::default();
        let kind = PoolKind::Endpoints(Protocol::Tcp);
        for cap in [1, 4, 2, 8, 1, 16, 4] {
            let (_, base) = s.alloc(kind, cap);
            assert_eq!(base % cap, 0, "cap {cap} at {base}");
        }
    }
}
