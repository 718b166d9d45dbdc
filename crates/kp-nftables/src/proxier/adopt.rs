//! A restart's first sync over the table a previous run left: what the
//! kernel already holds right is adopted, only the difference is sent.
//!
//! The result is what a full sync over the table would leave (same chains,
//! rules, sets and elements; the proxier's bookkeeping complete), except
//! where endpoints sit in the shared maps: each Service keeps the slots the
//! previous run gave it when they still fit, read from its selection rules,
//! so that an unchanged Service is not rewritten. A chain is only kept when
//! its rules reduce to the same fingerprints as ours (see
//! `netlink::readback`); anything else is rewritten.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use kp_model::ProxyState;

use super::affinity::keep_affinity_places;
use super::programmed::{all_elements, Kept, Programmed};
use super::tx::{chain, element_ops, op, Tx};
use super::NftablesProxier;
use crate::render::{
    affinity_set, pick_chain_rules, render_service, select_set, shard_set, ElemKey, Element,
    MapName, Pool, PoolKind, ServiceObjects,
};
use crate::types::{Chain, DnatTarget, ElemValue, Expr, Object, Rule, Set, Verb};
use crate::view::{ChainState, SetChanges, TableView};

/// What a restart found and did, for the log.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Adoption {
    /// Reading the table back.
    pub read: std::time::Duration,
    pub rules_read: usize,
    pub elements_read: usize,
    pub chains_kept: usize,
    pub chains_rewritten: usize,
    pub chains_added: usize,
    pub chains_deleted: usize,
    pub sets_kept: usize,
    /// Sets given only their differing elements.
    pub sets_changed: usize,
    /// Sets flushed and refilled (holding a key we could not name).
    pub sets_rewritten: usize,
    pub elements_changed: usize,
    pub pools_kept: usize,
    pub pools_moved: usize,
}

/// The endpoint-map shard named `name`, if it is one.
fn shard_of(name: &str) -> Option<MapName> {
    let rest = name.strip_prefix("endpoints-")?;
    let (proto, k) = rest.rsplit_once('-')?;
    let p = [
        kp_model::Protocol::Tcp,
        kp_model::Protocol::Udp,
        kp_model::Protocol::Sctp,
    ]
    .into_iter()
    .find(|p| p.as_lower() == proto)?;
    Some(MapName::Endpoints(p, k.parse().ok()?))
}

/// Which pool each slot reference of `rules` is, and the index added to
/// the pool's base there (an affinity hit names one index's slot).
fn pool_refs(rules: &[Rule]) -> Vec<(usize, Option<u32>)> {
    rules
        .iter()
        .flat_map(|r| r.exprs.iter())
        .filter_map(|e| match e {
            Expr::NumgenDnat { slots, .. } | Expr::HashDnat { slots, .. } => {
                Some((slots.pool, None))
            }
            Expr::AffinityHit { slots, index, .. } => Some((slots.pool, Some(*index))),
            _ => None,
        })
        .collect()
}

/// Where the kernel's selection rules of `objs`' chains put each pool:
/// (shard number, base, size, count) where every reference agrees and one
/// gives the count. `objs` is rendered, not yet placed.
fn placements(objs: &ServiceObjects, kt: &dyn TableView) -> Vec<Option<(u32, u32, u32, u32)>> {
    // (shard, base, count); count 0 until a reference gives it.
    let mut found: Vec<Option<(u32, u32, u32)>> = vec![None; objs.pools.len()];
    let mut bad = vec![false; objs.pools.len()];
    for (name, rules) in &objs.chains {
        let ours = pool_refs(rules);
        let theirs = kt.slot_refs(name);
        if ours.is_empty() {
            continue;
        }
        if ours.len() != theirs.len() {
            for (p, _) in ours {
                bad[p] = true;
            }
            continue;
        }
        for ((p, index), r) in ours.into_iter().zip(theirs) {
            let Some(pool) = objs.pools.get(p) else {
                continue;
            };
            let PoolKind::Endpoints(proto) = pool.kind;
            let k = match shard_of(&r.map) {
                Some(MapName::Endpoints(rp, k)) if rp == proto => k,
                _ => {
                    bad[p] = true;
                    continue;
                }
            };
            let base = match index {
                Some(i) => r.offset.checked_sub(i),
                None => Some(r.offset),
            };
            let Some(base) = base else {
                bad[p] = true;
                continue;
            };
            // An affinity hit's numgen counts 1; the selection's gives the count.
            let count = if index.is_none() { r.modulus } else { 0 };
            match &mut found[p] {
                slot @ None => *slot = Some((k, base, count)),
                Some((k0, b0, c0)) => {
                    if *k0 != k || *b0 != base {
                        bad[p] = true;
                    } else {
                        *c0 = (*c0).max(count);
                    }
                }
            }
        }
    }
    found
        .into_iter()
        .zip(bad)
        .map(|(f, bad)| match f {
            // Aligned to its size, as the allocator hands ranges out.
            Some((k, base, count)) if !bad && count > 0 => {
                let size = count.next_power_of_two();
                (base % size == 0).then_some((k, base, size, count))
            }
            _ => None,
        })
        .collect()
}

/// A pool's range as the kernel has it, and how many endpoints it held.
#[derive(Clone, Copy)]
struct Placed {
    map: MapName,
    base: u32,
    cap: u32,
    count: u32,
}

/// More endpoints than this in one session-affinity selection and their
/// places are not looked for (each is one lookup per place): they get
/// new ones, and their clients new endpoints.
const AFFINITY_PLACES_UP_TO: usize = 256;

/// The session-affinity pools of `objs` as the kernel holds them: which of
/// the wanted endpoints sits at each index of the range it had (an
/// endpoint that is gone leaves an unspecified address there).
fn affinity_places(
    objs: &ServiceObjects,
    taken: &[Option<Placed>],
    kt: &dyn TableView,
) -> ServiceObjects {
    let gone = DnatTarget {
        ip: std::net::Ipv4Addr::UNSPECIFIED.into(),
        port: 0,
    };
    let mut old = ServiceObjects::default();
    for (pool, t) in objs.pools.iter().zip(taken) {
        let (Some(aff), Some(t)) = (pool.affinity, t) else {
            continue;
        };
        if pool.values.len() > AFFINITY_PLACES_UP_TO || t.count as usize > AFFINITY_PLACES_UP_TO {
            continue;
        }
        let name = t.map.to_string();
        let values = (0..t.count)
            .map(|j| {
                let key = ElemKey::Slot(t.base + j);
                pool.values
                    .iter()
                    .find(|v| kt.has_element(&name, &key, Some(&ElemValue::Endpoint(**v))))
                    .copied()
                    .unwrap_or(gone)
            })
            .collect();
        old.pools.push(Pool {
            kind: pool.kind,
            values,
            map: t.map,
            base: t.base,
            cap: t.cap,
            affinity: Some(aff),
        });
    }
    old
}

impl NftablesProxier {
    /// The set `m` is, as declared.
    fn set_of(&self, m: MapName) -> Option<Set> {
        match m {
            MapName::Fixed(n) => self.skeleton.sets.iter().find(|s| s.name == **n).cloned(),
            MapName::Endpoints(..) => Some(shard_set(m)),
            MapName::Affinity(t) => Some(affinity_set(t)),
            MapName::Select(..) => Some(select_set(m)),
        }
    }

    /// The transaction that brings the table `kt` read back to `state`,
    /// what it programs, and what was kept.
    pub(super) fn adopt_tx(
        &self,
        state: &ProxyState,
        kt: &dyn TableView,
    ) -> (Tx, Programmed, Adoption) {
        let mut tx = Tx::default();
        // sync() brought the skeleton to the state's Service ranges.
        let mut prog = Programmed {
            check_cidrs: self.check_cidrs.clone(),
            ..Default::default()
        };
        let (rules_read, elements_read) = kt.counts();
        let mut st = Adoption {
            rules_read,
            elements_read,
            ..Default::default()
        };
        let mut wanted_chains: HashSet<String> = HashSet::new();
        let mut put_chain = |tx: &mut Tx, st: &mut Adoption, c: Chain, rules: Vec<Rule>| {
            wanted_chains.insert(c.name.clone());
            match kt.chain_state(&c.name, &rules) {
                ChainState::Same => {
                    st.chains_kept += 1;
                    return;
                }
                ChainState::Missing => {
                    st.chains_added += 1;
                    tx.add_objects.push(op(Verb::Add, Object::Chain(c.clone())));
                }
                ChainState::Differs => {
                    st.chains_rewritten += 1;
                    tx.rules.push(op(Verb::Flush, Object::Chain(c.clone())));
                }
            }
            tx.ops += 1;
            tx.add_rules(&c.name, rules);
        };
        // The skeleton. A set that is there keeps its declaration (one
        // declared otherwise makes the elements below fail, and the
        // restart falls back to rewriting everything).
        for set in &self.skeleton.sets {
            if !kt.has_set(&set.name) {
                tx.head.push(op(Verb::Add, Object::Set(set.clone())));
                tx.ops += 1;
            }
        }
        for (name, base, rules) in &self.skeleton.chains {
            let c = Chain {
                name: name.to_string(),
                base: *base,
            };
            put_chain(&mut tx, &mut st, c, rules.clone());
        }
        // Every Service's slots as the kernel has them, taken over before
        // any new range is handed out. Rendered twice rather than kept
        // between the passes: all Services' rules at once would be the
        // restart's largest transient.
        let mut taken_all: Vec<Vec<Option<Placed>>> = Vec::with_capacity(state.services.len());
        for (name, sp) in &state.services {
            let objs = render_service(sp, state.endpoints_of(name), &self.cfg, &state.node);
            let taken = placements(&objs, kt)
                .into_iter()
                .zip(&objs.pools)
                .map(|(p, pool)| {
                    let (k, base, cap, count) = p?;
                    prog.slots.adopt(pool.kind, k, base, cap).then_some(Placed {
                        map: pool.kind.shard(k),
                        base,
                        cap,
                        count,
                    })
                })
                .collect();
            taken_all.push(taken);
        }
        prog.slots.adopted();
        for ((name, sp), taken) in state.services.iter().zip(taken_all) {
            let mut objs = render_service(sp, state.endpoints_of(name), &self.cfg, &state.node);
            // Session-affinity clients stay on their endpoints: each keeps
            // the index the kernel has it at.
            let old = affinity_places(&objs, &taken, kt);
            keep_affinity_places(&mut objs, Some(&old), &mut tx.rekey);
            let ranges: Vec<Option<(MapName, u32, u32)>> = taken
                .iter()
                .map(|t| t.map(|t| (t.map, t.base, t.cap)))
                .collect();
            prog.slots.assign_adopted(&mut objs, &ranges);
            for (pool, t) in objs.pools.iter().zip(&taken) {
                match t {
                    Some(t) if pool.map == t.map && pool.base == t.base => st.pools_kept += 1,
                    _ => st.pools_moved += 1,
                }
            }
            prog.use_affinity(&objs, 1);
            prog.use_picks(&objs, 1);
            let (kept, rules) = Kept::new(objs);
            for ((c, _), rules) in kept.objs.chains.iter().zip(rules) {
                put_chain(&mut tx, &mut st, Chain::regular(c), rules);
            }
            prog.services.insert(name.clone(), kept);
        }
        // The shared pick chains in use, and the select maps they read.
        let select_maps: BTreeSet<MapName> = prog.picks.keys().map(|k| k.map()).collect();
        for m in &select_maps {
            if !kt.has_set(&m.to_string()) {
                tx.head.push(op(Verb::Add, Object::Set(select_set(*m))));
                tx.ops += 1;
            }
        }
        for k in prog.picks.keys() {
            let (name, rules) = pick_chain_rules(*k);
            put_chain(&mut tx, &mut st, Chain::regular(&name), rules);
        }
        // Elements, set by set, claimed as a full sync claims them.
        let mut by_set: BTreeMap<MapName, Vec<Element>> = BTreeMap::new();
        let nodeport_ips = MapName::Fixed(&crate::names::SET_NODEPORT_IPS);
        for ip in &self.skeleton.nodeport_ips {
            by_set.entry(nodeport_ips).or_default().push(Element {
                map: nodeport_ips,
                key: ElemKey::Ip(*ip),
                value: None,
            });
        }
        {
            let Programmed {
                services, claims, ..
            } = &mut prog;
            for (name, kept) in state
                .services
                .keys()
                .filter_map(|n| services.get_key_value(n))
            {
                for e in all_elements(&kept.objs) {
                    if claims.claim(name, &e) {
                        by_set.entry(e.map).or_default().push(e);
                    }
                }
            }
        }
        // The shard maps in the kernel stay declared (empty ones too).
        let mut declared: BTreeSet<MapName> =
            kt.set_names().into_iter().filter_map(shard_of).collect();
        for m in &declared {
            by_set.entry(*m).or_default();
        }
        for set in &self.skeleton.sets {
            if let Some(m) = self.skeleton_map(&set.name) {
                by_set.entry(m).or_default();
            }
        }
        for (m, elems) in by_set {
            let name = m.to_string();
            if let MapName::Endpoints(..) = m {
                if declared.insert(m) {
                    tx.head.push(op(Verb::Add, Object::Set(shard_set(m))));
                    tx.ops += 1;
                }
            }
            let changes = if kt.has_set(&name) {
                kt.set_changes(&name, &mut elems.iter().map(|e| (&e.key, e.value.as_ref())))
            } else {
                Some(SetChanges {
                    add: (0..elems.len()).collect(),
                    ..Default::default()
                })
            };
            match changes {
                Some(ch) if ch.is_empty() => st.sets_kept += 1,
                Some(ch) => {
                    st.sets_changed += 1;
                    st.elements_changed += ch.add.len() + ch.replace.len() + ch.delete.len();
                    let gone =
                        ch.delete
                            .into_iter()
                            .map(|key| Element {
                                map: m,
                                key,
                                value: None,
                            })
                            .chain(ch.replace.iter().filter_map(|i| elems.get(*i)).map(|e| {
                                Element {
                                    value: None,
                                    ..e.clone()
                                }
                            }));
                    let before = tx.del_elements.len();
                    element_ops(&mut tx.del_elements, Verb::Delete, gone);
                    tx.ops += tx.del_elements.len() - before;
                    let mut adds: Vec<usize> = ch.add.into_iter().chain(ch.replace).collect();
                    adds.sort_unstable();
                    let adds: Vec<Element> = adds
                        .into_iter()
                        .filter_map(|i| elems.get(i).cloned())
                        .collect();
                    tx.ops += adds.len();
                    element_ops(&mut tx.add_elements, Verb::Add, adds);
                }
                None => {
                    st.sets_rewritten += 1;
                    if let Some(set) = self.set_of(m) {
                        tx.del_elements.push(op(Verb::Flush, Object::Set(set)));
                        tx.ops += 1;
                    }
                    st.elements_changed += elems.len();
                    tx.ops += elems.len();
                    element_ops(&mut tx.add_elements, Verb::Add, elems);
                }
            }
        }
        prog.slots.declared = declared;
        // Affinity sets: their records are kept; those no Service uses go,
        // and anything else of ours the kernel has that we no longer want.
        for timeout in prog.affinity.keys() {
            let set = affinity_set(*timeout);
            if !kt.has_set(&set.name) {
                tx.head.push(op(Verb::Add, Object::Set(set)));
                tx.ops += 1;
            }
        }
        let wanted_sets: HashSet<String> = self
            .skeleton
            .sets
            .iter()
            .map(|s| s.name.clone())
            .chain(prog.affinity.keys().map(|t| affinity_set(*t).name))
            .chain(prog.slots.declared.iter().map(|m| m.to_string()))
            .chain(select_maps.iter().map(|m| m.to_string()))
            .collect();
        for c in kt
            .chain_names()
            .into_iter()
            .filter(|c| !wanted_chains.contains(*c))
        {
            st.chains_deleted += 1;
            tx.flush_stale.push(op(Verb::Flush, chain(c)));
            tx.del_objects.push(op(Verb::Delete, chain(c)));
            tx.ops += 2;
        }
        for s in kt
            .set_names()
            .into_iter()
            .filter(|s| !wanted_sets.contains(*s))
        {
            tx.del_objects.push(op(
                Verb::Delete,
                Object::Set(Set {
                    name: s.to_string(),
                    ty: crate::types::SetType::Records { timeout: 0 },
                }),
            ));
            tx.ops += 1;
        }
        (tx, prog, st)
    }

    fn skeleton_map(&self, name: &str) -> Option<MapName> {
        crate::names::FIXED_SETS
            .iter()
            .find(|n| ***n == name)
            .map(|n| MapName::Fixed(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::TABLE_NAME;
    use crate::render::Skeleton;
    use crate::types::Transaction;
    use kp_model::{IpFamily, Protocol, ProxierConfig};

    /// A restart adopts a table only when its comment names this layout,
    /// and adopting never declares a set or base chain again: the figure
    /// of every declaration is pinned to the layout's number. If this
    /// fails, a table made by the previous build would be kept with the
    /// old declarations: change the layout number in `TABLE_COMMENT` and
    /// the figure together.
    #[test]
    fn declarations_are_the_layouts() {
        let mut text = String::new();
        for fam in [IpFamily::V4, IpFamily::V6] {
            let sk = Skeleton::new(&ProxierConfig::new(fam));
            let mut tx = Transaction::new(fam, TABLE_NAME);
            for s in &sk.sets {
                tx.add(Object::Set(s.clone()));
            }
            for (name, base, _) in &sk.chains {
                tx.add(Object::Chain(Chain {
                    name: name.to_string(),
                    base: *base,
                }));
            }
            for p in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
                tx.add(Object::Set(shard_set(MapName::Endpoints(p, 0))));
                tx.add(Object::Set(select_set(MapName::Select(p, 0, 0))));
            }
            tx.add(Object::Set(affinity_set(10800)));
            text += &tx.to_string();
        }
        // FNV-1a: stable across builds and toolchains.
        let figure = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
        assert_eq!(
            (super::super::full::TABLE_COMMENT, format!("{figure:#x}")),
            (
                "rules for kube-proxy-rs (layout 2)",
                "0x5c26147b09f6b907".to_string()
            ),
            "{text}"
        );
    }
}
