//! What the proxier believes is in the kernel: each service port's objects
//! as programmed (rules reduced to digests), who claims which shared
//! element, and the slot allocator's state. Also the naming of whose
//! objects a refused transaction held.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kp_model::{RefusedOp, ServicePortName};

use super::slots::Slots;
use crate::render::{ElemKey, Element, MapName, ServiceObjects};
use crate::types::{ElemValue, Object, PickKey, Rule, Transaction};

/// A service port as programmed: its objects with the chains' rules taken
/// out (they went to the kernel) and a digest of each chain's rules kept to
/// tell a change. Keeping the rules themselves was 28 MB of the 104 MB live
/// heap at 10k Services. Two are equal when they program the same.
#[derive(PartialEq)]
pub(super) struct Kept {
    /// `chains` holds the names only (empty rule lists).
    pub(super) objs: ServiceObjects,
    /// One per chain, in `objs.chains`' order.
    pub(super) digests: Vec<u64>,
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
    pub(super) fn new(mut objs: ServiceObjects) -> (Kept, Vec<Vec<Rule>>) {
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
        objs.picks.shrink_to_fit();
        for p in &mut objs.picks {
            p.values.shrink_to_fit();
        }
        (Kept { objs, digests }, rules)
    }

    /// The digest of chain `name`'s rules, if it has that chain.
    pub(super) fn digest_of(&self, name: &str) -> Option<u64> {
        self.objs
            .chains
            .iter()
            .zip(&self.digests)
            .find(|((c, _), _)| c == name)
            .map(|(_, d)| *d)
    }
}

/// Who wants the elements in the kernel.
#[derive(Default)]
pub(super) struct Claims {
    /// Set elements -> how many service ports want them.
    set_refs: HashMap<(MapName, ElemKey), usize>,
    /// Map keys -> the service port whose verdict is installed.
    map_owner: HashMap<(MapName, ElemKey), ServicePortName>,
}

/// What is in the kernel, as far as we know.
#[derive(Default)]
pub(super) struct Programmed {
    pub(super) services: HashMap<ServicePortName, Kept>,
    pub(super) claims: Claims,
    pub(super) slots: Slots,
    /// Shared affinity sets by timeout -> how many service ports use them.
    pub(super) affinity: BTreeMap<u32, usize>,
    /// Shared pick chains (protocol, endpoint count, shard) -> how many
    /// service ports go to them.
    pub(super) picks: BTreeMap<PickKey, usize>,
    /// The Service ranges `cluster-ips-check` drops (see
    /// `NftablesProxier::follow_service_cidrs`).
    pub(super) check_cidrs: Vec<ipnet::IpNet>,
}

impl Programmed {
    /// Service ports with a Local traffic policy and no local endpoint
    /// (internal, external), for the sync's report.
    pub(super) fn no_local_endpoints(&self) -> (u64, u64) {
        self.services.values().fold((0, 0), |(i, e), k| {
            (i + k.objs.no_local.0 as u64, e + k.objs.no_local.1 as u64)
        })
    }

    /// Counts `objs`' shared pick chains in (`by` 1) or out (-1).
    pub(super) fn use_picks(&mut self, objs: &ServiceObjects, by: i32) {
        for p in &objs.picks {
            let k = p.key();
            if by > 0 {
                *self.picks.entry(k).or_insert(0) += 1;
            } else if let Some(users) = self.picks.get_mut(&k) {
                *users = users.saturating_sub(1);
                if *users == 0 {
                    self.picks.remove(&k);
                }
            }
        }
    }

    /// The shared pick chains in use.
    pub(super) fn pick_keys(&self) -> BTreeSet<PickKey> {
        self.picks.keys().copied().collect()
    }

    /// Counts `objs`' affinity sets in (`by` 1) or out (-1). Returns the
    /// timeouts whose set went from unused to used (in) or from used to
    /// unused (out).
    pub(super) fn use_affinity(&mut self, objs: &ServiceObjects, by: i32) -> Vec<u32> {
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
    pub(super) fn claim(&mut self, owner: &ServicePortName, e: &Element) -> bool {
        // Endpoint-map slots belong to the one Service the allocator gave
        // them to: no owner to record (they are most of the elements, and
        // recording them was the proxier's largest item of memory).
        // So do the select maps' (one Service per address and port).
        if matches!(e.key, ElemKey::Slot(_) | ElemKey::Select { .. }) {
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
    pub(super) fn release(&mut self, owner: &ServicePortName, e: &Element) -> bool {
        if matches!(e.key, ElemKey::Slot(_) | ElemKey::Select { .. }) {
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

/// Every element `objs` puts in the kernel: its own, then its pools' slots
/// and its picks' endpoints (derived rather than stored twice: with 10
/// endpoints per Service they are most of the elements).
pub(super) fn all_elements(objs: &ServiceObjects) -> impl Iterator<Item = Element> + '_ {
    let slots = objs.pools.iter().flat_map(|pool| {
        pool.values.iter().enumerate().map(|(j, v)| Element {
            map: pool.map,
            key: ElemKey::Slot(pool.base + j as u32),
            value: Some(ElemValue::Endpoint(*v)),
        })
    });
    let picks = objs.picks.iter().flat_map(|p| p.elements());
    objs.elements.iter().cloned().chain(slots).chain(picks)
}

/// Fills in each refused operation's owner (the Service port whose chain
/// or elements it holds, else the shared object) and its text where the
/// backend did not keep it.
pub(super) fn name_owners(refused: &mut [RefusedOp], tx: &Transaction, prog: &Programmed) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::DnatTarget;

    /// The proxier keeps 300k+ elements and claims at 50k Services: these
    /// sizes are what the kept state costs (docs/nftables.md, memory).
    #[test]
    fn kept_element_parts_stay_compact() {
        use std::mem::size_of;
        assert_eq!(size_of::<MapName>(), 16);
        assert_eq!(size_of::<ElemKey>(), 28);
        assert_eq!(size_of::<DnatTarget>(), 20);
        assert_eq!(size_of::<ElemValue>(), 32);
        assert_eq!(size_of::<Option<ElemValue>>(), 32);
        assert_eq!(size_of::<Element>(), 80);
    }
}
