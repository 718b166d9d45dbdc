//! The partial sync's transaction: only the changed service ports, as the
//! difference between what is programmed and what the model wants now.

use std::collections::{BTreeSet, HashSet};

use kp_model::{ProxyState, ServicePortName};

use super::affinity::keep_affinity_places;
use super::programmed::{all_elements, Kept, Programmed};
use super::tx::{chain, element_ops, op, Tx};
use super::NftablesProxier;
use crate::render::{affinity_set, render_service, shard_set, Element, MapName, ServiceObjects};
use crate::types::{Object, Verb};

impl NftablesProxier {
    /// The transaction that moves the kernel from `prog` to `state` for the
    /// `changed` service ports only, updating `prog` as it goes.
    pub(super) fn partial_tx(
        &self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        prog: &mut Programmed,
    ) -> Tx {
        let mut tx = Tx::default();
        self.rewrite_cluster_ips_check(&mut tx, prog);
        let mut del_elems: Vec<Element> = Vec::new();
        let mut add_elems: Vec<Element> = Vec::new();
        // Affinity sets whose last user went (deleted after the loop: another
        // service port of this sync may take them up again).
        let mut gone_sets: Vec<u32> = Vec::new();
        let mut updates: Vec<(ServicePortName, Option<Kept>, Option<Kept>)> = Vec::new();
        let picks_before = prog.pick_keys();
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
            prog.use_picks(n, 1);
            prog.use_picks(o, -1);
            tx.delete_stale(o, new.as_ref().map(|(k, _)| &k.objs));
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
                            tx.add_rules(name, rules);
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
        tx.move_picks(&picks_before, &prog.pick_keys(), false);
        for timeout in gone_sets {
            if !prog.affinity.contains_key(&timeout) {
                tx.delete_affinity_set(timeout);
            }
        }
        tx.ops += del_elems.len() + add_elems.len();
        element_ops(&mut tx.del_elements, Verb::Delete, del_elems);
        element_ops(&mut tx.add_elements, Verb::Add, add_elems);
        tx
    }
}
