//! The nftables proxier: remembers what it programmed, sends the difference.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write;
use std::time::Instant;

use kp_model::{Dataplane, DataplaneError, ProxierConfig, ProxyState, ServicePortName, SyncReport};

use crate::backend::NftBackend;
use crate::render::{
    comment, family_kw, render_service, ElemKey, Element, ServiceObjects, Skeleton,
    SET_NODEPORT_IPS, TABLE_NAME,
};
use crate::rule::Rule;

/// What is in the kernel, as far as we know.
#[derive(Default)]
struct Programmed {
    services: HashMap<ServicePortName, ServiceObjects>,
    /// Set elements -> how many service ports want them.
    set_refs: HashMap<(&'static str, ElemKey), usize>,
    /// Map keys -> the service port whose verdict is installed.
    map_owner: HashMap<(&'static str, ElemKey), ServicePortName>,
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
        let mut by_map: Vec<(&str, Vec<String>)> = Vec::new();
        for e in elems {
            match by_map.iter_mut().find(|(m, _)| *m == e.map) {
                Some((_, v)) => v.push(e.text()),
                None => by_map.push((e.map, vec![e.text()])),
            }
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
            let objs = render_service(sp, state.endpoints_of(name), &self.cfg, &state.node);
            self.add_service(&mut tx, &objs);
            for e in &objs.elements {
                if prog.claim(name, e) {
                    adds.push(e.clone());
                }
            }
            prog.services.insert(name.clone(), objs);
        }
        tx.ops += adds.len();
        let refs: Vec<&Element> = adds.iter().collect();
        let mut s = String::new();
        self.elements(&mut s, "add", &refs);
        tx.add_elements.push_str(&s);
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
        for (chain, _) in &old.chains {
            if !new.is_some_and(|n| n.chains.iter().any(|(c, _)| c == chain)) {
                let _ = writeln!(tx.flush_stale, "flush chain {p} {chain}");
                let _ = writeln!(tx.del_objects, "delete chain {p} {chain}");
                tx.ops += 2;
            }
        }
        for (set, _) in &old.affinity_sets {
            if !new.is_some_and(|n| n.affinity_sets.iter().any(|(s, _)| s == set)) {
                let _ = writeln!(tx.del_objects, "delete set {p} {set}");
                tx.ops += 1;
            }
        }
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
            let new = state
                .services
                .get(name)
                .map(|sp| render_service(sp, state.endpoints_of(name), &self.cfg, &state.node));
            let old = prog.services.get(name);
            if old == new.as_ref() {
                continue;
            }
            let old = prog.services.remove(name);
            let empty = ServiceObjects::default();
            let o = old.as_ref().unwrap_or(&empty);
            let n = new.as_ref().unwrap_or(&empty);
            for (set, timeout) in &n.affinity_sets {
                if !o.affinity_sets.iter().any(|(s, _)| s == set) {
                    let _ = writeln!(tx.add_objects, "{}", self.affinity_set_decl(set, *timeout));
                    tx.ops += 1;
                }
            }
            for (chain, rules) in &n.chains {
                match o.chains.iter().find(|(c, _)| c == chain) {
                    Some((_, old_rules)) if old_rules == rules => {}
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
        for (name, old, new) in &updates {
            if let Some(o) = old {
                for e in &o.elements {
                    if new.as_ref().is_some_and(|n| n.elements.contains(e)) {
                        continue;
                    }
                    if prog.release(name, e) {
                        del_elems.push(e.clone());
                    }
                }
            }
        }
        for (name, old, new) in updates {
            if let Some(n) = new {
                for e in &n.elements {
                    if old.as_ref().is_some_and(|o| o.elements.contains(e)) {
                        continue;
                    }
                    if prog.claim(&name, e) {
                        add_elems.push(e.clone());
                    }
                }
                prog.services.insert(name, n);
            }
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
        let k = (e.map, e.key.clone());
        if e.verdict.is_none() {
            let c = self.set_refs.entry(k).or_default();
            *c += 1;
            *c == 1
        } else {
            match self.map_owner.get(&k) {
                Some(o) if o != owner => {
                    tracing::warn!(
                        service = %owner, holder = %o, element = %e.key.text(), map = e.map,
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
        let k = (e.map, e.key.clone());
        if e.verdict.is_none() {
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
        match self.backend.table_exists(self.cfg.family, &self.table) {
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
