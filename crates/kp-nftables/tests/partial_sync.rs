//! Partial syncs equal full syncs, without a kernel.
//!
//! The property crates/kube-proxy-rs/tests/partial_sync.rs checks in network
//! namespaces, here on the in-memory [`Fake`]: fast enough for hundreds of
//! random sequences on every `cargo test`, no root. Random sequences of
//! Service and EndpointSlice updates (the same generators: added, changed,
//! deleted; types, ports, externalIPs and LoadBalancer IPs changed;
//! addresses that collide on purpose; session affinity on and off;
//! dual-stack) drive a `ChangeTracker` per family and an `NftablesProxier`
//! per family, both on one Fake, through partial syncs; now and then a full
//! sync over the table in place, or someone else flushing our table (the
//! canary sees it and the next sync rebuilds). After every round the Fake
//! must hold what a fresh full sync of the same state puts in a fresh Fake,
//! and a sync with nothing changed must send nothing.
//!
//! Compared as in the kernel test: the endpoint-map shards are where a
//! partial sync legitimately differs (which slots a Service got depends on
//! history), so every rule that indexes one is read as the endpoints it can
//! pick, and the endpoints of a session-affinity chain as a sorted list
//! (they keep their index across partial syncs). Beyond the kernel test,
//! a shard element no rule reaches is a difference too (a full sync leaves
//! none).
//!
//! `PROPTEST_CASES=N` sets the number of random sequences (default 256);
//! seeds of past failures are replayed from
//! `partial_sync.proptest-regressions` first.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeSet;

use kp_model::{ChangeTracker, Dataplane, IpFamily, LocalDetector, ProxierConfig, ProxyState};
use kp_nftables::fake::{Fake, FakeState, FakeTable};
use kp_nftables::types::{ElemKey, ElemValue, Expr, MapName, Object, Rule, Slots, Transaction};
use kp_nftables::{NftBackend, NftablesProxier, TABLE_NAME};
use kp_testkit::updates::{apply, step, tracker, Step};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use serde_json::json;

/// At most this many rounds a sequence (shrinking shortens a failing one).
const ROUNDS: usize = 50;

/// What happens between two comparisons: one to three updates, then a
/// sync of what they changed.
#[derive(Clone, Debug)]
struct Round {
    steps: Vec<Step>,
    how: Sync,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Sync {
    Partial,
    /// A full sync over the table in place (the periodic resync).
    Full,
    /// Someone flushed our table first: the canary must see it, and the
    /// sync then rebuilds from nothing.
    AfterFlush,
}

fn round() -> impl Strategy<Value = Round> {
    (
        proptest::collection::vec(step(), 1..=3),
        prop_oneof![
            16 => Just(Sync::Partial),
            2 => Just(Sync::Full),
            1 => Just(Sync::AfterFlush),
        ],
    )
        .prop_map(|(steps, how)| Round { steps, how })
}

// ---------------------------------------------------------------------------
// The proxiers and what they leave in the Fake
// ---------------------------------------------------------------------------

const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

fn proxier_config(family: IpFamily) -> ProxierConfig {
    let mut pc = ProxierConfig::new(family);
    let (node, pods) = match family {
        IpFamily::V4 => ("10.0.0.1", "10.1.0.0/16"),
        IpFamily::V6 => ("fd00::1", "fd00:1::/64"),
    };
    pc.node_ips = vec![node.parse().expect("ip")];
    pc.local_detector = LocalDetector::Cidrs(vec![pods.parse().expect("cidr")]);
    pc
}

fn is_shard(set: &str) -> bool {
    set.starts_with("endpoints-")
}

/// The state as facts, one a line, where only meaning is compared (see the
/// header): chains with their hooks, each chain's rules in order with the
/// shard slots they index read as the endpoints there, the declarations
/// and elements of every set and map but the shards, and the shard
/// elements no rule reaches.
fn facts(state: &FakeState) -> Vec<String> {
    let mut out = Vec::new();
    for ((family, name), t) in &state.tables {
        let tag = format!("{family:?} {name}");
        out.push(format!("{tag} table, comment {:?}", t.comment));
        let mut reached: BTreeSet<(String, u32)> = BTreeSet::new();
        for (c, chain) in &t.chains {
            out.push(format!("{tag} chain {c} {:?}", chain.base));
            let mut affinity_targets = Vec::new();
            for (k, r) in chain.rules.iter().enumerate() {
                let mut words = Vec::new();
                for e in &r.exprs {
                    let mut picks = |slots: &Slots, from: u32, count: u32| -> Vec<String> {
                        (from..from + count)
                            .map(|i| slot(t, slots.map, slots.offset + i, &mut reached))
                            .collect()
                    };
                    words.push(match e {
                        // Picks in slot order: the model's order, kept.
                        Expr::NumgenDnat { count, slots } => {
                            format!("numgen-dnat {:?}", picks(slots, 0, *count))
                        }
                        // A session-affinity selection: its endpoints keep
                        // their index across partial syncs.
                        Expr::HashDnat { seed, count, slots } => {
                            let mut p = picks(slots, 0, *count);
                            p.sort();
                            format!("hash-dnat seed {seed:x} {p:?}")
                        }
                        Expr::AffinityHit {
                            records,
                            id,
                            index,
                            slots,
                        } => {
                            affinity_targets.extend(picks(slots, *index, 1));
                            format!("affinity-hit @{records} {id:x} {index}")
                        }
                        other => Rule::new(vec![other.clone()]).display(*family).to_string(),
                    });
                }
                if let Some(comment) = &r.comment {
                    words.push(format!("comment {comment:?}"));
                }
                out.push(format!("{tag} rule {c} #{k}: {}", words.join(" ")));
            }
            if !affinity_targets.is_empty() {
                affinity_targets.sort();
                out.push(format!(
                    "{tag} affinity targets of {c}: {affinity_targets:?}"
                ));
            }
        }
        let mut stray = Vec::new();
        for (s, set) in &t.sets {
            if is_shard(s) {
                for k in set.elements.keys() {
                    let reachable =
                        matches!(k, ElemKey::Slot(n) if reached.contains(&(s.clone(), *n)));
                    if !reachable {
                        stray.push(format!("{s} {k}"));
                    }
                }
                continue;
            }
            out.push(format!("{tag} set {s} {:?}", set.decl));
            for (k, v) in &set.elements {
                out.push(format!("{tag} set {s} element {k} {}", value(v)));
            }
        }
        out.push(format!("{tag} shard elements no rule reaches: {stray:?}"));
    }
    out
}

fn value(v: &Option<ElemValue>) -> String {
    v.as_ref().map(|v| format!(": {v}")).unwrap_or_default()
}

/// What slot `n` of shard `map` holds, noting that a rule reaches it.
fn slot(t: &FakeTable, map: MapName, n: u32, reached: &mut BTreeSet<(String, u32)>) -> String {
    let name = map.to_string();
    let v = t
        .sets
        .get(&name)
        .and_then(|s| s.elements.get(&ElemKey::Slot(n)));
    reached.insert((name, n));
    match v {
        Some(v) => value(v),
        None => "(empty slot)".into(),
    }
}

/// What a fresh proxier per family puts in a fresh Fake for `states`.
fn fresh_full(states: &[&ProxyState]) -> Result<FakeState, String> {
    let fake = Fake::new();
    for st in states {
        let mut dp = NftablesProxier::new(proxier_config(st.family), Box::new(fake.clone()));
        dp.sync(st, &BTreeSet::new(), true)
            .map_err(|e| format!("fresh full sync ({}): {e}", st.family))?;
    }
    Ok(fake.state())
}

fn diff(partial: &[String], full: &[String]) -> String {
    let a: BTreeSet<&String> = partial.iter().collect();
    let b: BTreeSet<&String> = full.iter().collect();
    let mut out = String::new();
    for l in a.difference(&b).take(20) {
        out.push_str(&format!("  only after partial syncs: {l}\n"));
    }
    for l in b.difference(&a).take(20) {
        out.push_str(&format!("  only after a full sync:   {l}\n"));
    }
    if out.is_empty() {
        out.push_str("  (the same facts in another order)\n");
    }
    out
}

/// Someone else's `nft flush table` of our tables.
fn flush_our_tables(fake: &Fake) {
    let mut other = fake.clone();
    for family in FAMILIES {
        if other.table_exists(family, TABLE_NAME).unwrap() {
            let mut tx = Transaction::new(family, TABLE_NAME);
            tx.flush(Object::Table { comment: None });
            other.apply(&tx).unwrap();
        }
    }
}

/// One sequence: partial syncs on one Fake, each round compared with a
/// fresh full sync of the same state.
fn check_sequence(rounds: &[Round]) -> Result<(), String> {
    let fake = Fake::new();
    let mut trackers: Vec<ChangeTracker> = FAMILIES.iter().map(|&f| tracker(f)).collect();
    let mut dps: Vec<NftablesProxier> = FAMILIES
        .iter()
        .map(|&f| NftablesProxier::new(proxier_config(f), Box::new(fake.clone())))
        .collect();
    for (n, round) in rounds.iter().enumerate() {
        if round.how == Sync::AfterFlush && n > 0 {
            flush_our_tables(&fake);
            for dp in &mut dps {
                if !dp.rules_lost() {
                    return Err(format!("round {n}: the canary missed a flushed table"));
                }
            }
        }
        for (t, dp) in trackers.iter_mut().zip(dps.iter_mut()) {
            for step in &round.steps {
                apply(t, step);
            }
            let cs = t.take_changes();
            let full = round.how == Sync::Full;
            dp.sync(t.state(), &cs.changed, full)
                .map_err(|e| format!("round {n}: sync ({}): {e}", t.family()))?;
        }
        let partial = facts(&fake.state());
        let states: Vec<&ProxyState> = trackers.iter().map(|t| t.state()).collect();
        let full = facts(&fresh_full(&states)?);
        if partial != full {
            return Err(format!(
                "after round {n} ({round:?}) the Fake differs from a full sync:\n{}",
                diff(&partial, &full)
            ));
        }
        // Nothing changed: nothing to send.
        let applied = fake.applied();
        for (t, dp) in trackers.iter().zip(dps.iter_mut()) {
            dp.sync(t.state(), &BTreeSet::new(), false)
                .map_err(|e| format!("round {n}: idle sync ({}): {e}", t.family()))?;
        }
        if fake.applied() != applied {
            return Err(format!(
                "round {n}: a sync with nothing changed sent a transaction"
            ));
        }
    }
    Ok(())
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn partial_syncs_equal_full_syncs_on_the_fake() {
    let mut runner = TestRunner::new(Config {
        cases: cases(256),
        // Seeds of past failures, replayed first (then random ones).
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/partial_sync.proptest-regressions",
        ))),
        max_shrink_iters: 4096,
        ..Config::default()
    });
    let result = runner.run(&proptest::collection::vec(round(), 1..=ROUNDS), |rounds| {
        check_sequence(&rounds).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

// ---------------------------------------------------------------------------
// The comparison itself
// ---------------------------------------------------------------------------

/// A Service with three endpoints: ClusterIP only (picked in a shared
/// chain), with session affinity, or a NodePort (both with chains of
/// their own).
fn service_with_endpoints(name: &str, ip: &str, kind: &str) -> Vec<Step> {
    let mut spec = json!({"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                          "ipFamilies": ["IPv4"],
                          "ports": [{"name": "p0", "port": 80, "protocol": "TCP"}]});
    match kind {
        "affinity" => spec["sessionAffinity"] = json!("ClientIP"),
        "nodeport" => {
            spec["type"] = json!("NodePort");
            spec["ports"][0]["nodePort"] = json!(30080);
        }
        _ => {}
    }
    vec![
        Step::Apply(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "default", "name": name}, "spec": spec,
        })),
        Step::Apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "default", "name": format!("{name}-0"),
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "ports": [{"name": "p0", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.1.0.1"], "conditions": {"ready": true}},
                          {"addresses": ["10.1.0.2"], "conditions": {"ready": true}},
                          {"addresses": ["10.1.0.3"], "conditions": {"ready": true}}],
        })),
    ]
}

/// The facts are blind to slot placement and affinity order only: a lost
/// element, a stray slot, another endpoint in a slot and rules in another
/// order are all seen.
#[test]
fn the_comparison_sees_what_matters() {
    let mut t = tracker(IpFamily::V4);
    for s in service_with_endpoints("s0", "10.96.0.1", "nodeport")
        .iter()
        .chain(&service_with_endpoints("s1", "10.96.0.2", "affinity"))
        .chain(&service_with_endpoints("s2", "10.96.0.3", "clusterip"))
    {
        apply(&mut t, s);
    }
    t.take_changes();
    assert_eq!(t.state().services.len(), 3);
    let state = fresh_full(&[t.state()]).unwrap();
    let want = facts(&state);
    assert_eq!(want, facts(&fresh_full(&[t.state()]).unwrap()));
    let table = (IpFamily::V4, TABLE_NAME.to_string());
    let shard = MapName::Endpoints(kp_model::Protocol::Tcp, 0).to_string();
    let changed = |f: &dyn Fn(&mut FakeTable)| {
        let mut s = state.clone();
        f(s.tables.get_mut(&table).unwrap());
        facts(&s)
    };
    // Where the slots are is not compared...
    let moved = changed(&|t| {
        let set = t.sets.get_mut(&shard).unwrap();
        let elems: Vec<_> = std::mem::take(&mut set.elements).into_iter().collect();
        for (k, v) in elems {
            let ElemKey::Slot(n) = k else { panic!("{k}") };
            set.elements.insert(ElemKey::Slot(n + 64), v);
        }
        for chain in t.chains.values_mut() {
            for e in chain.rules.iter_mut().flat_map(|r| r.exprs.iter_mut()) {
                if let Expr::NumgenDnat { slots, .. }
                | Expr::HashDnat { slots, .. }
                | Expr::AffinityHit { slots, .. } = e
                {
                    slots.offset += 64;
                }
            }
        }
    });
    assert_eq!(moved, want);
    // ...what they hold is.
    let lost = changed(&|t| {
        let set = t.sets.get_mut("service-ips").unwrap();
        let k = set.elements.keys().next().unwrap().clone();
        set.elements.remove(&k);
    });
    assert_ne!(lost, want);
    let stray = changed(&|t| {
        let set = t.sets.get_mut(&shard).unwrap();
        let v = set.elements.values().next().unwrap().clone();
        set.elements.insert(ElemKey::Slot(999), v);
    });
    assert_ne!(stray, want);
    let swapped = changed(&|t| {
        let set = t.sets.get_mut(&shard).unwrap();
        let v0 = set.elements.get(&ElemKey::Slot(0)).unwrap().clone();
        let v1 = set.elements.get(&ElemKey::Slot(1)).unwrap().clone();
        set.elements.insert(ElemKey::Slot(0), v1);
        set.elements.insert(ElemKey::Slot(1), v0);
    });
    assert_ne!(
        swapped, want,
        "the endpoints of a numgen DNAT keep their order"
    );
    // The shared pick chains' endpoints are compared as they are.
    let picked = changed(&|t| {
        let (_, set) = t
            .sets
            .iter_mut()
            .find(|(name, _)| name.starts_with("select-tcp-0-"))
            .unwrap();
        let (k, v) = set.elements.pop_first().unwrap();
        set.elements.insert(k, v.clone());
        let (k, _) = set.elements.pop_last().unwrap();
        set.elements.insert(k, v);
    });
    assert_ne!(picked, want, "the endpoints of a shared pick stay in place");
    let reordered = changed(&|t| {
        let chain = t.chains.get_mut("services").unwrap();
        chain.rules.reverse();
    });
    assert_ne!(reordered, want);
}
