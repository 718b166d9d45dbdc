//! The nftables proxier: remembers what it programmed, sends the difference.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write;
use std::time::Instant;

use kp_model::{Dataplane, DataplaneError, ProxierConfig, ProxyState, ServicePortName, SyncReport};

use crate::backend::NftBackend;
use crate::render::{
    comment, family_kw, render_service, ElemKey, Element, MapName, Pool, PoolKind, ServiceObjects,
    Skeleton, SET_NODEPORT_IPS, TABLE_NAME,
};
use crate::rule::Rule;

/// What is in the kernel, as far as we know.
#[derive(Default)]
struct Programmed {
    services: HashMap<ServicePortName, ServiceObjects>,
    /// Set elements -> how many service ports want them.
    set_refs: HashMap<(MapName, ElemKey), usize>,
    /// Map keys -> the service port whose verdict is installed.
    map_owner: HashMap<(MapName, ElemKey), ServicePortName>,
    slots: Slots,
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
        let base = sh.next;
        sh.next = sh.next.saturating_add(cap);
        (map, base)
    }

    fn release(&mut self, p: &Pool) {
        if let Some(sh) = self.shards.get_mut(&p.map) {
            sh.free.entry(p.cap).or_default().push(p.base);
            sh.pools = sh.pools.saturating_sub(1);
            if let MapName::Endpoints(_, k) | MapName::EndpointChains(k) = p.map {
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
            for r in rules.iter_mut() {
                if let Rule::NumgenDnat {
                    pool, map, offset, ..
                }
                | Rule::NumgenGoto {
                    pool, map, offset, ..
                } = r
                {
                    if let Some(p) = new.pools.get(*pool) {
                        *map = p.map;
                        *offset = p.base;
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

/// Every element `objs` puts in the kernel: its own, then its pools' slots
/// (derived from the pools rather than stored twice: with 10 endpoints per
/// Service the slots are most of the elements).
fn all_elements(objs: &ServiceObjects) -> impl Iterator<Item = Element> + '_ {
    let slots = objs.pools.iter().flat_map(|pool| {
        pool.values.iter().enumerate().map(|(j, v)| Element {
            map: pool.map,
            key: ElemKey::Slot(pool.base + j as u32),
            value: Some(v.clone()),
        })
    });
    objs.elements.iter().cloned().chain(slots)
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
    head: String,
    add_objects: String,
    rules: String,
    del_elements: String,
    add_elements: String,
    /// Stale chains are all flushed before any is deleted: one may still jump
    /// to another (external- to service-) until it is emptied.
    flush_stale: String,
    del_objects: String,
    ops: usize,
}

impl Tx {
    fn finish(self) -> (String, usize) {
        let mut s = self.head;
        s.push_str(&self.add_objects);
        s.push_str(&self.rules);
        s.push_str(&self.del_elements);
        s.push_str(&self.add_elements);
        s.push_str(&self.flush_stale);
        s.push_str(&self.del_objects);
        (s, self.ops)
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

    /// Uses another table name (tests run several proxiers side by side).
    pub fn with_table(mut self, table: &str) -> Self {
        self.table = table.to_string();
        self
    }

    fn prefix(&self) -> String {
        format!("{} {}", family_kw(self.cfg.family), self.table)
    }

    fn add_service(&self, tx: &mut Tx, objs: &ServiceObjects) {
        let p = self.prefix();
        for (set, timeout) in &objs.affinity_sets {
            let _ = writeln!(tx.add_objects, "{}", self.affinity_set_decl(set, *timeout));
            tx.ops += 1;
        }
        for (chain, rules) in &objs.chains {
            let _ = writeln!(tx.add_objects, "add chain {p} {chain}");
            tx.ops += 1;
            self.add_rules(tx, chain, rules);
        }
    }

    /// `add rule` lines for every rule of `chain`.
    fn add_rules(&self, tx: &mut Tx, chain: &str, rules: &[Rule]) {
        let p = self.prefix();
        for r in rules {
            for line in r.text(self.cfg.family) {
                let _ = writeln!(tx.rules, "add rule {p} {chain} {line}");
                tx.ops += 1;
            }
        }
    }

    fn elements(&self, out: &mut String, verb: &str, elems: &[&Element]) {
        // Group by map: one command per map keeps the script short.
        let p = self.prefix();
        let mut by_map: BTreeMap<MapName, Vec<String>> = BTreeMap::new();
        for e in elems {
            by_map.entry(e.map).or_default().push(e.text());
        }
        for (map, items) in by_map {
            // A netlink attribute length is 16 bits: keep each element list
            // well under 64 KiB (chain names make verdict elements long).
            for chunk in items.chunks(128) {
                let _ = writeln!(out, "{verb} element {p} {map} {{ {} }}", chunk.join(", "));
            }
        }
    }

    fn skeleton_script(&self, tx: &mut Tx, fresh: bool) {
        let p = self.prefix();
        let _ = writeln!(
            tx.head,
            "add table {p} {{ comment {} ; }}",
            comment("rules for kube-proxy-rs")
        );
        if fresh {
            // Start from nothing: the delete and re-create are one transaction, so
            // packets see the old table or the new one, never neither.
            let _ = writeln!(tx.head, "delete table {p}");
            let _ = writeln!(
                tx.head,
                "add table {p} {{ comment {} ; }}",
                comment("rules for kube-proxy-rs")
            );
        } else {
            // Keeps chains, sets and affinity state; drops every rule.
            let _ = writeln!(tx.head, "flush table {p}");
        }
        tx.ops += 2;
        for (name, decl) in &self.skeleton.sets {
            let kind = if Skeleton::is_map(name) { "map" } else { "set" };
            let _ = writeln!(tx.head, "add {kind} {p} {name} {{ {decl} }}");
            if !fresh {
                let _ = writeln!(tx.head, "flush {kind} {p} {name}");
            }
            tx.ops += 1;
        }
        for (name, decl, rules) in &self.skeleton.chains {
            if decl.is_empty() {
                let _ = writeln!(tx.head, "add chain {p} {name}");
            } else {
                let _ = writeln!(tx.head, "add chain {p} {name} {{ {decl} }}");
            }
            tx.ops += 1;
            for r in rules {
                let _ = writeln!(tx.rules, "add rule {p} {name} {r}");
                tx.ops += 1;
            }
        }
        if !self.skeleton.nodeport_ips.is_empty() {
            let ips: Vec<String> = self
                .skeleton
                .nodeport_ips
                .iter()
                .map(|i| i.to_string())
                .collect();
            let _ = writeln!(
                tx.add_elements,
                "add element {p} {SET_NODEPORT_IPS} {{ {} }}",
                ips.join(", ")
            );
        }
    }

    /// The full transaction for `state`, and what it programs.
    fn full_tx(&self, state: &ProxyState, fresh: bool) -> (Tx, Programmed) {
        let mut tx = Tx::default();
        self.skeleton_script(&mut tx, fresh);
        let mut prog = Programmed::default();
        let mut adds: Vec<Element> = Vec::new();
        for (name, sp) in &state.services {
            let mut objs = render_service(sp, state.endpoints_of(name), &self.cfg, &state.node);
            prog.slots.assign(&mut objs, None);
            self.add_service(&mut tx, &objs);
            for e in all_elements(&objs) {
                if prog.claim(name, &e) {
                    adds.push(e);
                }
            }
            prog.services.insert(name.clone(), objs);
        }
        tx.ops += adds.len();
        let refs: Vec<&Element> = adds.iter().collect();
        let mut s = String::new();
        self.elements(&mut s, "add", &refs);
        tx.add_elements.push_str(&s);
        // Endpoint-map shards: those in the kernel are kept and emptied (the
        // elements above refill them), new ones declared.
        let mut declared = BTreeSet::new();
        if !fresh {
            if let Some(old) = &self.programmed {
                declared.clone_from(&old.slots.declared);
            }
        }
        for m in &declared {
            let _ = writeln!(tx.head, "{}", self.shard_decl(*m));
            let _ = writeln!(tx.head, "flush map {} {m}", self.prefix());
            tx.ops += 2;
        }
        // Sorted: the script is deterministic.
        let used: BTreeSet<MapName> = prog.slots.shards.keys().copied().collect();
        for m in used {
            if declared.insert(m) {
                let _ = writeln!(tx.head, "{}", self.shard_decl(m));
                tx.ops += 1;
            }
        }
        prog.slots.declared = declared;
        if !fresh {
            // Chains and affinity sets we had but no longer want.
            if let Some(old) = &self.programmed {
                for (name, objs) in &old.services {
                    let new = prog.services.get(name);
                    self.delete_stale(&mut tx, objs, new);
                }
            }
        }
        (tx, prog)
    }

    fn delete_stale(&self, tx: &mut Tx, old: &ServiceObjects, new: Option<&ServiceObjects>) {
        let p = self.prefix();
        let chains: HashSet<&str> = new
            .map(|n| n.chains.iter().map(|(c, _)| c.as_str()).collect())
            .unwrap_or_default();
        let sets: HashSet<&str> = new
            .map(|n| n.affinity_sets.iter().map(|(s, _)| s.as_str()).collect())
            .unwrap_or_default();
        for (chain, _) in &old.chains {
            if !chains.contains(chain.as_str()) {
                let _ = writeln!(tx.flush_stale, "flush chain {p} {chain}");
                let _ = writeln!(tx.del_objects, "delete chain {p} {chain}");
                tx.ops += 2;
            }
        }
        for (set, _) in &old.affinity_sets {
            if !sets.contains(set.as_str()) {
                let _ = writeln!(tx.del_objects, "delete set {p} {set}");
                tx.ops += 1;
            }
        }
    }

    /// `add map` for an endpoint-map shard.
    fn shard_decl(&self, m: MapName) -> String {
        let ip = family_kw(self.cfg.family);
        let value = match m {
            MapName::Endpoints(proto, _) => format!("{ip} daddr . {} dport", proto.as_lower()),
            _ => "verdict".to_string(),
        };
        format!(
            "add map {} {m} {{ typeof numgen random mod 1 : {value} ; }}",
            self.prefix()
        )
    }

    fn affinity_set_decl(&self, set: &str, timeout: u32) -> String {
        let addr_t = match self.cfg.family {
            kp_model::IpFamily::V4 => "ipv4_addr",
            kp_model::IpFamily::V6 => "ipv6_addr",
        };
        format!(
            "add set {} {set} {{ type {addr_t} ; flags dynamic,timeout ; timeout {timeout}s ; }}",
            self.prefix()
        )
    }

    /// The transaction that moves the kernel from `prog` to `state` for the
    /// `changed` service ports only, updating `prog` as it goes.
    fn partial_tx(
        &self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        prog: &mut Programmed,
    ) -> Tx {
        let p = self.prefix();
        let mut tx = Tx::default();
        let mut del_elems: Vec<Element> = Vec::new();
        let mut add_elems: Vec<Element> = Vec::new();
        let mut updates: Vec<(
            ServicePortName,
            Option<ServiceObjects>,
            Option<ServiceObjects>,
        )> = Vec::new();
        for name in changed {
            let mut new = state
                .services
                .get(name)
                .map(|sp| render_service(sp, state.endpoints_of(name), &self.cfg, &state.node));
            let old = prog.services.get(name);
            match new.as_mut() {
                Some(n) => prog.slots.assign(n, old),
                // Deleted: its slot ranges are free for others.
                None => {
                    if let Some(o) = old {
                        for p in &o.pools {
                            prog.slots.release(p);
                        }
                    }
                }
            }
            if old == new.as_ref() {
                continue;
            }
            let old = prog.services.remove(name);
            let empty = ServiceObjects::default();
            let o = old.as_ref().unwrap_or(&empty);
            let n = new.as_ref().unwrap_or(&empty);
            let old_sets: HashSet<&str> = o.affinity_sets.iter().map(|(s, _)| s.as_str()).collect();
            let old_chains: HashMap<&str, &Vec<Rule>> =
                o.chains.iter().map(|(c, r)| (c.as_str(), r)).collect();
            for (set, timeout) in &n.affinity_sets {
                if !old_sets.contains(set.as_str()) {
                    let _ = writeln!(tx.add_objects, "{}", self.affinity_set_decl(set, *timeout));
                    tx.ops += 1;
                }
            }
            for (chain, rules) in &n.chains {
                match old_chains.get(chain.as_str()) {
                    Some(old_rules) if *old_rules == rules => {}
                    found => {
                        if found.is_none() {
                            let _ = writeln!(tx.add_objects, "add chain {p} {chain}");
                        } else {
                            let _ = writeln!(tx.rules, "flush chain {p} {chain}");
                        }
                        tx.ops += 1;
                        self.add_rules(&mut tx, chain, rules);
                    }
                }
            }
            self.delete_stale(&mut tx, o, new.as_ref());
            updates.push((name.clone(), old, new));
        }
        // Elements are shared (a cluster IP by every port of a service, a hairpin
        // IP by every service of a pod): release all removals before claiming
        // additions so that a key moving between services ends up claimed.
        // Sets, not scans: a Service with thousands of endpoints has thousands
        // of elements.
        let elem_set = |o: &Option<ServiceObjects>| -> HashSet<Element> {
            o.as_ref()
                .map(|o| all_elements(o).collect())
                .unwrap_or_default()
        };
        for (name, old, new) in &updates {
            if let Some(o) = old {
                let keep = elem_set(new);
                for e in all_elements(o) {
                    if keep.contains(&e) {
                        continue;
                    }
                    if prog.release(name, &e) {
                        del_elems.push(e);
                    }
                }
            }
        }
        for (name, old, new) in updates {
            if let Some(n) = new {
                let had = elem_set(&old);
                for e in all_elements(&n) {
                    if had.contains(&e) {
                        continue;
                    }
                    if prog.claim(&name, &e) {
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
            let _ = writeln!(tx.add_objects, "{}", self.shard_decl(m));
            tx.ops += 1;
            prog.slots.declared.insert(m);
        }
        tx.ops += del_elems.len() + add_elems.len();
        let del: Vec<&Element> = del_elems.iter().collect();
        let add: Vec<&Element> = add_elems.iter().collect();
        let mut s = String::new();
        self.elements(&mut s, "delete", &del);
        tx.del_elements.push_str(&s);
        let mut s = String::new();
        self.elements(&mut s, "add", &add);
        tx.add_elements.push_str(&s);
        tx
    }
}

impl Programmed {
    /// Records that `owner` wants `e`; true when it must be added to the kernel.
    /// Set elements are reference counted; a map key belongs to its first claimant
    /// (two Services claiming one IP and port is a conflict: the other is logged).
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
                        service = %owner, holder = %o, element = %e.key.text(), map = %e.map,
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
    fn mode(&self) -> &'static str {
        "nftables"
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        let t0 = Instant::now();
        let is_full = full || self.programmed.is_none();
        let (tx, new_prog) = if is_full {
            let fresh = self.programmed.is_none();
            let (tx, prog) = self.full_tx(state, fresh);
            (tx, prog)
        } else {
            let mut prog = self.programmed.take().unwrap_or_default();
            let tx = self.partial_tx(state, changed, &mut prog);
            (tx, prog)
        };
        let (script, ops) = tx.finish();
        let render = t0.elapsed();
        let t1 = Instant::now();
        let mut report = SyncReport {
            full: is_full,
            bytes: script.len(),
            ops,
            render,
            ..Default::default()
        };
        if !script.is_empty() {
            if let Err(e) = self.backend.apply(&script) {
                // Nothing was applied (one transaction); forget what we think is
                // there so the retry is a full sync.
                self.programmed = None;
                return Err(e);
            }
        }
        report.apply = t1.elapsed();
        for objs in new_prog.services.values() {
            report.no_local_endpoints.0 += objs.no_local.0 as u64;
            report.no_local_endpoints.1 += objs.no_local.1 as u64;
        }
        self.programmed = Some(new_prog);
        Ok(report)
    }

    fn render(&self, state: &ProxyState) -> String {
        let (tx, _) = self.full_tx(state, true);
        tx.finish().0
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
        let p = self.prefix();
        // `add` first so that deleting a table that is not there is no error.
        let script = format!("add table {p}\ndelete table {p}\n");
        self.programmed = None;
        self.backend.apply(&script)
    }
}
