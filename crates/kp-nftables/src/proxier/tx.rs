//! The transaction builder: operations gathered in the order the kernel
//! needs them, and the few shapes of operation a sync is made of.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use super::affinity::Rekey;
use super::programmed::Kept;
use crate::render::{
    affinity_set, pick_chain_rules, select_set, ElemKey, Element, MapName, ServiceObjects,
};
use crate::types::{Chain, ElemValue, Object, Op, Rule, Transaction, Verb};

/// Elements per `add element` operation: a netlink attribute's length is
/// 16 bits, and chain names make verdict elements long.
const ELEMENTS_PER_OP: usize = 128;

/// Accumulates one transaction in the order the kernel needs: objects are
/// created before anything refers to them and deleted after nothing does.
#[derive(Default)]
pub(super) struct Tx {
    pub(super) head: Vec<Op>,
    pub(super) add_objects: Vec<Op>,
    pub(super) rules: Vec<Op>,
    pub(super) del_elements: Vec<Op>,
    pub(super) add_elements: Vec<Op>,
    /// Stale chains are all flushed before any is deleted: one may still jump
    /// to another (external- to service-) until it is emptied.
    pub(super) flush_stale: Vec<Op>,
    pub(super) del_objects: Vec<Op>,
    pub(super) ops: usize,
    /// What this transaction does to session-affinity records: done once
    /// it applied.
    pub(super) rekey: Vec<Rekey>,
}

/// Shared pick chains.
pub(super) type PickSet = BTreeSet<crate::types::PickKey>;

pub(super) fn op(verb: Verb, object: Object) -> Op {
    Op { verb, object }
}

pub(super) fn add_rule(chain: &str, rule: Rule) -> Op {
    op(
        Verb::Add,
        Object::Rule {
            chain: chain.to_string(),
            rule,
        },
    )
}

pub(super) fn chain(name: &str) -> Object {
    Object::Chain(Chain::regular(name))
}

impl Tx {
    pub(super) fn finish(self, family: kp_model::IpFamily, table: &str) -> (Transaction, usize) {
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

    /// Adds `objs`' chains and rules; what is kept of it.
    pub(super) fn add_service(&mut self, objs: ServiceObjects) -> Kept {
        let (kept, rules) = Kept::new(objs);
        for ((name, _), rules) in kept.objs.chains.iter().zip(rules) {
            self.add_objects.push(op(Verb::Add, chain(name)));
            self.ops += 1;
            self.add_rules(name, rules);
        }
        kept
    }

    /// `add rule` for every rule of `chain`.
    pub(super) fn add_rules(&mut self, chain: &str, rules: Vec<Rule>) {
        for r in rules {
            self.rules.push(add_rule(chain, r));
            self.ops += 1;
        }
    }

    /// Deletes a shared affinity set no service port uses any more (after the
    /// rules that name it: deletions come last in the transaction).
    pub(super) fn delete_affinity_set(&mut self, timeout: u32) {
        self.del_objects
            .push(op(Verb::Delete, Object::Set(affinity_set(timeout))));
        self.ops += 1;
    }

    /// Moves the shared pick chains, and the select maps they read, from
    /// those in use `before` to those in use `after`. With `refill` (a
    /// full sync over the table in place, which flushed every rule) the
    /// chains that stay get their rule again and the maps that stay are
    /// emptied for the sync's elements.
    pub(super) fn move_picks(&mut self, before: &PickSet, after: &PickSet, refill: bool) {
        let maps = |s: &PickSet| -> BTreeSet<MapName> { s.iter().map(|k| k.map()).collect() };
        let (maps_before, maps_after) = (maps(before), maps(after));
        for m in &maps_after {
            if !maps_before.contains(m) {
                self.add_objects
                    .push(op(Verb::Add, Object::Set(select_set(*m))));
                self.ops += 1;
            } else if refill {
                self.add_objects
                    .push(op(Verb::Flush, Object::Set(select_set(*m))));
                self.ops += 1;
            }
        }
        for k in after {
            let stays = before.contains(k);
            if stays && !refill {
                continue;
            }
            let (name, rules) = pick_chain_rules(*k);
            if !stays {
                self.add_objects.push(op(Verb::Add, chain(&name)));
                self.ops += 1;
            }
            self.add_rules(&name, rules);
        }
        for k in before.difference(after) {
            let name = k.chain();
            self.flush_stale.push(op(Verb::Flush, chain(&name)));
            self.del_objects.push(op(Verb::Delete, chain(&name)));
            self.ops += 2;
        }
        for m in maps_before.difference(&maps_after) {
            self.del_objects
                .push(op(Verb::Delete, Object::Set(select_set(*m))));
            self.ops += 1;
        }
    }

    /// Flushes and deletes the chains of `old` that `new` no longer has.
    pub(super) fn delete_stale(&mut self, old: &ServiceObjects, new: Option<&ServiceObjects>) {
        let chains: HashSet<&str> = new
            .map(|n| n.chains.iter().map(|(c, _)| c.as_str()).collect())
            .unwrap_or_default();
        for (name, _) in &old.chains {
            if !chains.contains(name.as_str()) {
                self.flush_stale.push(op(Verb::Flush, chain(name)));
                self.del_objects.push(op(Verb::Delete, chain(name)));
                self.ops += 2;
            }
        }
    }
}

/// `verb` operations on `elems`, appended to `out`.
pub(super) fn element_ops(out: &mut Vec<Op>, verb: Verb, elems: impl IntoIterator<Item = Element>) {
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
