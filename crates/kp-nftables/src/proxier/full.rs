//! The full sync's transaction: the whole table from the model, either
//! from nothing (fresh) or over the table in place (keeping sets, chains
//! and the affinity records), and what it programs.

use std::collections::BTreeSet;

use kp_model::ProxyState;

use super::affinity::keep_affinity_places;
use super::programmed::{all_elements, Programmed};
use super::tx::{add_rule, element_ops, op, Tx};
use super::NftablesProxier;
use crate::names::SET_NODEPORT_IPS;
use crate::render::{
    affinity_set, render_service, shard_set, ElemKey, MapName, ServiceObjects, Skeleton,
};
use crate::types::{Chain, Object, Verb};

/// Written when the table is made (an update keeps the first comment), and
/// read back by a restart: the layout number changes whenever the sets'
/// declarations do, so that a table made by another layout is replaced
/// rather than adopted (`proxier::tests` holds the declarations' figure).
pub(super) const TABLE_COMMENT: &str = "rules for kube-proxy-rs (layout 2)";

impl NftablesProxier {
    fn skeleton_ops(&self, tx: &mut Tx, fresh: bool, skeleton: &Skeleton) {
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
        for set in &skeleton.sets {
            tx.head.push(op(Verb::Add, Object::Set(set.clone())));
            if !fresh {
                tx.head.push(op(Verb::Flush, Object::Set(set.clone())));
            }
            tx.ops += 1;
        }
        for (name, base, rules) in &skeleton.chains {
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
        if !skeleton.nodeport_ips.is_empty() {
            tx.add_elements.push(op(
                Verb::Add,
                Object::Elements {
                    set: MapName::Fixed(&SET_NODEPORT_IPS),
                    elems: skeleton
                        .nodeport_ips
                        .iter()
                        .map(|i| (ElemKey::Ip(*i), None))
                        .collect(),
                },
            ));
        }
    }

    /// The full transaction for `state`, and what it programs.
    /// `last`: what the previous successful sync programmed (None: a
    /// fresh table, everything declared from nothing).
    pub(super) fn full_tx(
        &self,
        state: &ProxyState,
        last: Option<&Programmed>,
    ) -> (Tx, Programmed) {
        let fresh = last.is_none();
        let mut tx = Tx::default();
        // The skeleton follows the state's Service ranges at each sync; a
        // dry run renders without syncing, so it may need its own.
        let (own, check_cidrs) = self.skeleton_for(state);
        self.skeleton_ops(&mut tx, fresh, own.as_ref().unwrap_or(&self.skeleton));
        let mut prog = Programmed {
            check_cidrs,
            ..Default::default()
        };
        // A full sync that keeps the table keeps the affinity records, so
        // each endpoint keeps its index.
        for (name, sp) in &state.services {
            let mut objs = render_service(sp, state.endpoints_of(name), &self.cfg, &state.node);
            let old = last.and_then(|p| p.services.get(name)).map(|k| &k.objs);
            keep_affinity_places(&mut objs, old, &mut tx.rekey);
            prog.slots.assign(&mut objs, None);
            prog.use_affinity(&objs, 1);
            prog.use_picks(&objs, 1);
            let kept = tx.add_service(objs);
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
        element_ops(
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
        if let Some(old) = last {
            declared.clone_from(&old.slots.declared);
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
        // Shared pick chains and their select maps: those of a table in
        // place that stay are refilled (the flush above emptied them).
        let picks_before = match last {
            Some(old) => old.pick_keys(),
            None => Default::default(),
        };
        tx.move_picks(&picks_before, &prog.pick_keys(), true);
        // Chains and affinity sets we had but no longer want.
        if let Some(old) = last {
            for (name, kept) in &old.services {
                let new = prog.services.get(name).map(|k| &k.objs);
                tx.delete_stale(&kept.objs, new);
                if new.is_none() {
                    let mut none = ServiceObjects::default();
                    keep_affinity_places(&mut none, Some(&kept.objs), &mut tx.rekey);
                }
            }
            for timeout in old.affinity.keys() {
                if !prog.affinity.contains_key(timeout) {
                    tx.delete_affinity_set(*timeout);
                }
            }
        }
        (tx, prog)
    }
}
