//! Partial syncs equal full syncs.
//!
//! Random 50-step sequences of Service and EndpointSlice updates (added,
//! changed, deleted; types, ports, externalIPs and LoadBalancer IPs changed;
//! addresses that collide on purpose; session affinity on and off;
//! dual-stack) drive a `ChangeTracker` per family and a dataplane per family
//! through partial syncs, as the sync loop does. After every step the
//! kernel's table, read back and normalised, must equal what a fresh full
//! sync of the same state installs in a fresh network namespace. Any
//! difference is a bug in the partial path (or in a rule that depends on the
//! order of syncs).
//!
//! nftables and iptables-nft over netlink run restarts into the sequences:
//! new dataplanes over the same kernel, whose first sync adopts the table
//! or chains the previous ones left (with the step's change pending, and
//! with nothing changed, when it must send nothing at all).
//!
//! Each case runs in anonymous network namespaces (`unshare` on a thread of
//! its own): nothing is named, nothing outlives the thread, the root
//! namespace is never touched. `PROPTEST_CASES=N` sets the number of random
//! cases (default 20 for nftables, fewer for the iptables backends, whose
//! tools cost ~10 ms a call); the seeds of past failures are replayed from
//! `partial_sync.proptest-regressions` first.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use kp_iptables::{IptablesCli, IptablesNetlink, IptablesProxier, Variant};
use kp_model::{ChangeTracker, Dataplane, IpFamily, LocalDetector, ProxierConfig, ProxyState};
use kp_nftables::{NftNetlink, NftablesProxier};
use kp_testkit::updates::{apply, step, tracker, Step};
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use serde_json::{json, Value};

const STEPS: usize = 50;

// ---------------------------------------------------------------------------
// Dataplanes and their normalised listings
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Mode {
    Nftables,
    /// iptables through its programs (`iptables-{nft,legacy}-restore`).
    Iptables(Variant),
    /// iptables-nft written over netlink (the default for nft).
    IptablesNetlink,
}

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

fn dataplane(mode: Mode, family: IpFamily) -> Box<dyn Dataplane> {
    match mode {
        Mode::Nftables => Box::new(NftablesProxier::new(
            proxier_config(family),
            Box::new(NftNetlink::new()),
        )),
        Mode::Iptables(v) => Box::new(
            IptablesProxier::new(
                proxier_config(family),
                Box::new(IptablesCli::variant(family, v)),
            )
            .with_route_localnet(false),
        ),
        Mode::IptablesNetlink => Box::new(
            IptablesProxier::new(
                proxier_config(family),
                Box::new(IptablesNetlink::new(family)),
            )
            .with_route_localnet(false),
        ),
    }
}

/// Runs `f` on a new thread in a new, anonymous network namespace: sockets
/// it opens and programs it starts live there, and the namespace goes away
/// with the thread (and its programs).
fn in_fresh_netns<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: unshare affects only the calling thread's namespaces.
            let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            assert_eq!(
                rc,
                0,
                "unshare(CLONE_NEWNET): {} (run as root)",
                std::io::Error::last_os_error()
            );
            f()
        })
        .join()
        .expect("namespace thread")
    })
}

fn run(argv: &[&str]) -> String {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    assert!(
        out.status.success(),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Everything of ours in this namespace, normalised so that only meaning is
/// compared: one line per fact, sorted where order means nothing.
fn listing(mode: Mode) -> Vec<String> {
    match mode {
        // One listing for both families' tables: a process less per step.
        Mode::Nftables => normalize_nft(&run(&["nft", "-j", "list", "ruleset"])),
        Mode::Iptables(_) | Mode::IptablesNetlink => ["iptables", "ip6tables"]
            .iter()
            .flat_map(|b| {
                let v = match mode {
                    Mode::Iptables(v) => v,
                    _ => Variant::Nft,
                };
                let text = run(&[&format!("{b}-{}-save", v.as_str())]);
                normalize_iptables(b, &text)
            })
            .collect(),
    }
}

/// iptables-save without counters and comments; chain declarations sorted,
/// each chain's rules kept in their order (it is meaningful) and the chains
/// sorted by name.
fn normalize_iptables(tag: &str, text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut table = String::new();
    let mut chains: BTreeSet<String> = BTreeSet::new();
    let mut rules: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let flush = |table: &str,
                 chains: &mut BTreeSet<String>,
                 rules: &mut BTreeMap<String, Vec<String>>,
                 out: &mut Vec<String>| {
        for c in std::mem::take(chains) {
            out.push(format!("{tag} {table} chain {c}"));
        }
        for (c, rs) in std::mem::take(rules) {
            for (k, r) in rs.into_iter().enumerate() {
                out.push(format!("{tag} {table} {c} #{k}: {r}"));
            }
        }
    };
    for l in text.lines() {
        if l.starts_with('#') || l.trim().is_empty() {
            continue;
        }
        if let Some(t) = l.strip_prefix('*') {
            table = t.to_string();
        } else if l == "COMMIT" {
            flush(&table, &mut chains, &mut rules, &mut out);
        } else if let Some(decl) = l.strip_prefix(':') {
            // ":NAME POLICY [packets:bytes]"
            let mut parts = decl.split_whitespace();
            let name = parts.next().unwrap_or_default();
            let policy = parts.next().unwrap_or_default();
            chains.insert(format!("{name} {policy}"));
        } else if let Some(rest) = l.strip_prefix("-A ") {
            let chain = rest.split_whitespace().next().unwrap_or_default();
            rules
                .entry(chain.to_string())
                .or_default()
                .push(l.to_string());
        } else {
            out.push(format!("{tag} {table} other: {l}"));
        }
    }
    out
}

/// `nft -j list table` as facts: chains (with their hooks), each chain's
/// rules in order, each set's or map's declaration and sorted elements.
/// Endpoint-map shards are where a partial sync legitimately differs (which
/// slots a Service got depends on history), so they are not compared as
/// maps: every rule that indexes one is rewritten to the list of values it
/// can pick.
fn normalize_nft(text: &str) -> Vec<String> {
    let doc: Value = serde_json::from_str(text).expect("nft -j output");
    let items = doc["nftables"].as_array().cloned().unwrap_or_default();
    // Keyed by family and name: each family's table has its own maps.
    let mut maps: BTreeMap<String, Vec<(i64, Value)>> = BTreeMap::new();
    for it in &items {
        if let Some(m) = it.get("map") {
            let name = format!(
                "{} {}",
                m["family"].as_str().unwrap_or_default(),
                m["name"].as_str().unwrap_or_default()
            );
            let elems = m["elem"].as_array().cloned().unwrap_or_default();
            let slots = elems
                .iter()
                .filter_map(|e| {
                    let pair = e.as_array()?;
                    Some((pair.first()?.as_i64()?, pair.get(1)?.clone()))
                })
                .collect();
            maps.insert(name, slots);
        }
    }
    let is_shard = |name: &str| name.starts_with("endpoints-");
    // Session-affinity rules name slots by index, and a partial sync keeps
    // each endpoint at the index it had (its clients' records name it)
    // where a fresh sync takes the model's order: which endpoint a chain's
    // rule for index k reaches is compared as the chain's set of them.
    let mut affinity_targets: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut facts = BTreeSet::new();
    let mut rules: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for it in items {
        let Some((kind, obj)) = it.as_object().and_then(|o| o.iter().next()) else {
            continue;
        };
        let mut obj = obj.clone();
        if let Some(o) = obj.as_object_mut() {
            o.remove("handle");
        }
        let fam = obj["family"].as_str().unwrap_or_default().to_string();
        match kind.as_str() {
            "metainfo" | "table" => {}
            "rule" => {
                let chain = obj["chain"].as_str().unwrap_or_default().to_string();
                let mut expr = obj["expr"].clone();
                // The affinity rules, and the new client's DNAT by hash:
                // told before the slots are resolved, which replaces the
                // jhash key by the picks. Their endpoints keep their index
                // across partial syncs (keep_affinity_places), where a
                // fresh full sync places them in the model's order.
                let text = expr.to_string();
                let affinity = text.contains("@affinity-") || text.contains("\"jhash\"");
                resolve_slots(&fam, &mut expr, &maps);
                if affinity {
                    let targets = affinity_targets
                        .entry(format!("{fam} {chain}"))
                        .or_default();
                    unorder_affinity(&mut expr, targets);
                }
                rules
                    .entry(format!("{fam} {chain}"))
                    .or_default()
                    .push(expr.to_string());
            }
            "map" | "set" => {
                let name = obj["name"].as_str().unwrap_or_default().to_string();
                if is_shard(&name) {
                    continue;
                }
                let mut elems: Vec<String> = obj["elem"]
                    .as_array()
                    .map(|a| a.iter().map(|e| e.to_string()).collect())
                    .unwrap_or_default();
                elems.sort();
                if let Some(o) = obj.as_object_mut() {
                    o.remove("elem");
                }
                facts.insert(format!("{fam} {kind} {obj}"));
                for e in elems {
                    facts.insert(format!("{fam} {kind} {name} element {e}"));
                }
            }
            _ => {
                facts.insert(format!("{fam} {kind} {obj}"));
            }
        }
    }
    for (chain, mut targets) in affinity_targets {
        targets.sort();
        facts.insert(format!("affinity targets of {chain}: {targets:?}"));
    }
    let mut out: Vec<String> = facts.into_iter().collect();
    for (chain, rs) in rules {
        for (k, r) in rs.into_iter().enumerate() {
            out.push(format!("rule {chain} #{k}: {r}"));
        }
    }
    out
}

/// An affinity rule as `expr` with the endpoints it reaches taken out into
/// `targets` (a hit rule's one endpoint, or the sorted picks of the random
/// choice).
fn unorder_affinity(v: &mut Value, targets: &mut Vec<String>) {
    match v {
        Value::Object(o) => {
            if let Some(t) = o.remove("slot-pick") {
                targets.push(t.to_string());
                return;
            }
            if let Some(Value::Array(picks)) = o.get_mut("numgen-picks") {
                picks.sort_by_key(|p| p.to_string());
                return;
            }
            for (_, x) in o.iter_mut() {
                unorder_affinity(x, targets);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| unorder_affinity(x, targets)),
        _ => {}
    }
}

/// Replaces `{"map"|"vmap": {"key": {"numgen": {mod, offset}}, "data": "@shard"}}`
/// with the values the numgen can pick (also the affinity pick's jhash).
fn resolve_slots(fam: &str, v: &mut Value, maps: &BTreeMap<String, Vec<(i64, Value)>>) {
    match v {
        Value::Object(o) => {
            for kw in ["map", "vmap"] {
                let Some(inner) = o.get(kw) else { continue };
                let Some(data) = inner["data"].as_str() else {
                    continue;
                };
                let Some(name) = data.strip_prefix('@') else {
                    continue;
                };
                let slots = maps
                    .get(&format!("{fam} {name}"))
                    .cloned()
                    .unwrap_or_default();
                let at = |k: i64| {
                    slots
                        .iter()
                        .find(|(s, _)| *s == k)
                        .map(|(_, v)| v.clone())
                        .unwrap_or(Value::Null)
                };
                // A numgen (random or, `mod 1`, one slot) or the affinity
                // pick's jhash: either picks among `offset .. offset + mod`.
                let key = &inner["key"];
                let Some(ng) = ["numgen", "jhash"].iter().find_map(|k| key.get(*k)) else {
                    continue;
                };
                let Some(m) = ng["mod"].as_i64() else {
                    continue;
                };
                let offset = ng["offset"].as_i64().unwrap_or(0);
                if m == 1 {
                    o.insert(kw.to_string(), json!({"slot-pick": at(offset)}));
                    return;
                }
                let picked: Vec<Value> = (offset..offset + m).map(at).collect();
                o.insert(kw.to_string(), json!({"numgen-picks": picked}));
                return;
            }
            for (_, x) in o.iter_mut() {
                resolve_slots(fam, x, maps);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| resolve_slots(fam, x, maps)),
        _ => {}
    }
}

/// What a fresh proxier installs for `states` in an empty namespace.
fn fresh_full(mode: Mode, states: &[&ProxyState]) -> Result<Vec<String>, String> {
    in_fresh_netns(|| {
        for st in states {
            let mut dp = dataplane(mode, st.family);
            dp.sync(st, &BTreeSet::new(), true)
                .map_err(|e| format!("fresh full sync ({}): {e}", st.family))?;
        }
        Ok(listing(mode))
    })
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
    out
}

/// One sequence: partial syncs in one namespace, each compared with a fresh
/// full sync of the same state.
fn check_sequence(mode: Mode, steps: &[Step]) -> Result<(), TestCaseError> {
    let result: Result<(), String> = in_fresh_netns(|| {
        let families = [IpFamily::V4, IpFamily::V6];
        let mut trackers: Vec<ChangeTracker> =
            families.iter().map(|&family| tracker(family)).collect();
        let mut dps: Vec<Box<dyn Dataplane>> =
            families.iter().map(|&f| dataplane(mode, f)).collect();
        // nftables and iptables-nft over netlink adopt what a previous run
        // left: restarts (new dataplanes over the same kernel) every few
        // steps, with the step's change pending (its first sync adopts and
        // changes), and with nothing changed (its first sync must send
        // nothing).
        let restarts = matches!(mode, Mode::Nftables | Mode::IptablesNetlink);
        for (n, step) in steps.iter().enumerate() {
            if restarts && n % 6 == 5 {
                dps = families.iter().map(|&f| dataplane(mode, f)).collect();
            }
            for (t, dp) in trackers.iter_mut().zip(dps.iter_mut()) {
                apply(t, step);
                let cs = t.take_changes();
                dp.sync(t.state(), &cs.changed, false)
                    .map_err(|e| format!("step {n}: partial sync ({}): {e}", t.family()))?;
            }
            if restarts && n % 6 == 2 {
                let before = listing(mode);
                dps = families.iter().map(|&f| dataplane(mode, f)).collect();
                for (t, dp) in trackers.iter().zip(dps.iter_mut()) {
                    let r = dp
                        .sync(t.state(), &BTreeSet::new(), false)
                        .map_err(|e| format!("step {n}: restart ({}): {e}", t.family()))?;
                    if r.ops != 0 {
                        return Err(format!(
                            "step {n}: a restart onto an unchanged cluster sent {} operations ({})",
                            r.ops,
                            t.family()
                        ));
                    }
                }
                let after = listing(mode);
                if before != after {
                    return Err(format!(
                        "step {n}: a restart changed the table:\n{}",
                        diff(&after, &before)
                    ));
                }
            }
            let partial = listing(mode);
            let states: Vec<&ProxyState> = trackers.iter().map(|t| t.state()).collect();
            let full = fresh_full(mode, &states)?;
            if partial != full {
                return Err(format!(
                    "{mode:?}: after step {n} ({step:?}) the kernel differs from a full sync:\n{}",
                    diff(&partial, &full)
                ));
            }
        }
        Ok(())
    });
    result.map_err(TestCaseError::fail)
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn property(mode: Mode, default_cases: u32) {
    let mut runner = TestRunner::new(Config {
        cases: cases(default_cases),
        // Seeds of past failures, replayed first (then random ones).
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "tests/partial_sync.proptest-regressions",
        ))),
        // A shrink step costs a whole sequence of kernel syncs.
        max_shrink_iters: 64,
        ..Config::default()
    });
    let result = runner.run(&proptest::collection::vec(step(), STEPS), |steps| {
        check_sequence(mode, &steps)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn partial_syncs_equal_full_syncs_nftables() {
    property(Mode::Nftables, 20);
}

#[test]
fn partial_syncs_equal_full_syncs_iptables_nft() {
    if !Variant::Nft.available(IpFamily::V4) {
        eprintln!("SKIPPED: no iptables-nft");
        return;
    }
    property(Mode::Iptables(Variant::Nft), 8);
}

#[test]
fn partial_syncs_equal_full_syncs_iptables_nft_netlink() {
    if !Variant::Nft.available(IpFamily::V4) {
        eprintln!("SKIPPED: no iptables-nft (to list the rules)");
        return;
    }
    property(Mode::IptablesNetlink, 12);
}

#[test]
fn partial_syncs_equal_full_syncs_iptables_legacy() {
    if !Variant::Legacy.available(IpFamily::V4) {
        eprintln!("SKIPPED: no iptables-legacy");
        return;
    }
    property(Mode::Iptables(Variant::Legacy), 8);
}

// ---------------------------------------------------------------------------
// A large but valid Service
// ---------------------------------------------------------------------------

const BIG_PORTS: u16 = 5000;

/// One Service with 5,000 TCP ports (80 + k -> 20000 + k) and one endpoint,
/// in slices of 100 ports as the API allows.
fn big_service(endpoint: &str) -> Vec<Step> {
    let ports: Vec<Value> = (0..BIG_PORTS)
        .map(|k| json!({"name": format!("p{k}"), "port": 80 + k, "protocol": "TCP"}))
        .collect();
    let mut steps = vec![Step::Apply(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "default", "name": "big"},
        "spec": {"clusterIP": "10.96.5.1", "clusterIPs": ["10.96.5.1"], "ports": ports},
    }))];
    for s in 0..BIG_PORTS / 100 {
        let ports: Vec<Value> = (s * 100..(s + 1) * 100)
            .map(|k| json!({"name": format!("p{k}"), "port": 20000 + k, "protocol": "TCP"}))
            .collect();
        steps.push(Step::Apply(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "default", "name": format!("big-{s}"),
                         "labels": {"kubernetes.io/service-name": "big"}},
            "addressType": "IPv4", "ports": ports,
            "endpoints": [{"addresses": [endpoint], "conditions": {"ready": true}}],
        })));
    }
    steps
}

/// The 5,000-port Service is programmed: a full sync then a partial one
/// (all ports and endpoint unchanged but the last slice's), every port is
/// in the kernel and a connection to the last one reaches the endpoint.
fn big_service_is_programmed(mode: Mode) {
    in_fresh_netns(|| {
        for argv in [
            &["ip", "link", "set", "lo", "up"][..],
            &[
                "ip", "link", "add", "ep0", "type", "veth", "peer", "name", "ep1",
            ],
            &["ip", "link", "set", "ep0", "up"],
            &["ip", "link", "set", "ep1", "up"],
            &["ip", "addr", "add", "10.1.0.1/32", "dev", "ep0"],
            &["ip", "route", "add", "10.96.0.0/16", "dev", "ep0"],
        ] {
            run(argv);
        }
        let last = BIG_PORTS - 1;
        let listener = std::net::TcpListener::bind(("10.1.0.1", 20000 + last)).expect("listener");
        let mut t = tracker(IpFamily::V4);
        let mut dp = dataplane(mode, IpFamily::V4);
        for s in big_service("10.1.0.2") {
            apply(&mut t, &s);
        }
        let cs = t.take_changes();
        assert_eq!(t.state().services.len(), BIG_PORTS as usize);
        dp.sync(t.state(), &cs.changed, true).expect("full sync");
        // The endpoint moves to the listener's address: a partial sync.
        for s in big_service("10.1.0.1").into_iter().skip(1) {
            apply(&mut t, &s);
        }
        let cs = t.take_changes();
        assert_eq!(cs.changed.len(), BIG_PORTS as usize);
        let r = dp
            .sync(t.state(), &cs.changed, false)
            .expect("partial sync");
        assert!(!r.full);
        // Every port in the kernel.
        let programmed = match mode {
            Mode::Nftables => {
                let text = run(&[
                    "nft",
                    "-j",
                    "list",
                    "map",
                    "ip",
                    "kube-proxy-rs",
                    "service-ips",
                ]);
                text.matches("\"10.96.5.1\"").count()
            }
            Mode::Iptables(_) | Mode::IptablesNetlink => {
                let v = match mode {
                    Mode::Iptables(v) => v,
                    _ => Variant::Nft,
                };
                let text = run(&[&format!("iptables-{}-save", v.as_str()), "-t", "nat"]);
                text.lines()
                    .filter(|l| l.starts_with("-A KUBE-SERVICES") && l.contains("-d 10.96.5.1/32"))
                    .count()
            }
        };
        assert_eq!(programmed, BIG_PORTS as usize, "{mode:?}");
        // And the last one answers.
        let target = std::net::SocketAddr::from(([10, 96, 5, 1], 80 + last));
        let conn = std::net::TcpStream::connect_timeout(&target, std::time::Duration::from_secs(5));
        assert!(conn.is_ok(), "{mode:?}: connecting to {target}: {conn:?}");
        let (_, peer) = listener.accept().expect("accepted");
        assert_eq!(peer.ip(), std::net::IpAddr::from([10, 1, 0, 1]));
    });
}

#[test]
fn five_thousand_port_service_is_programmed_nftables() {
    big_service_is_programmed(Mode::Nftables);
}

#[test]
fn five_thousand_port_service_is_programmed_iptables_nft_netlink() {
    big_service_is_programmed(Mode::IptablesNetlink);
}

#[test]
fn five_thousand_port_service_is_programmed_iptables() {
    // iptables-nft takes minutes for rulesets this size (BENCHMARKS.md);
    // legacy when the host has it.
    let v = if Variant::Legacy.available(IpFamily::V4) {
        Variant::Legacy
    } else {
        Variant::Nft
    };
    big_service_is_programmed(Mode::Iptables(v));
}

/// A restart over a table someone changed behind the proxy's back (a
/// rule added to one of our chains, a chain and a set of their own in our
/// table, an element taken out of a set and another put in): the first
/// sync adopts what is still right, repairs the rest, and the table is
/// then what a fresh full sync installs.
#[test]
fn restart_repairs_what_was_changed_behind_its_back_nftables() {
    in_fresh_netns(|| {
        let mut t = tracker(IpFamily::V4);
        for s in [
            Step::Apply(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": "default", "name": "web"},
                "spec": {"clusterIP": "10.96.7.1", "clusterIPs": ["10.96.7.1"],
                         "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]},
            })),
            Step::Apply(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"namespace": "default", "name": "web-1",
                             "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                "endpoints": [{"addresses": ["10.1.0.5"], "conditions": {"ready": true}},
                              {"addresses": ["10.1.0.6"], "conditions": {"ready": true}}],
            })),
        ] {
            apply(&mut t, &s);
        }
        t.take_changes();
        let mut first =
            NftablesProxier::new(proxier_config(IpFamily::V4), Box::new(NftNetlink::new()));
        first
            .sync(t.state(), &BTreeSet::new(), true)
            .expect("first sync");
        let t4 = ["ip", "kube-proxy-rs"];
        for cmd in [
            vec!["add", "chain", t4[0], t4[1], "stray"],
            vec!["add", "rule", t4[0], t4[1], "stray", "counter"],
            vec!["add", "rule", t4[0], t4[1], "services", "accept"],
            vec![
                "add",
                "set",
                t4[0],
                t4[1],
                "strayset",
                "{ type ipv4_addr; }",
            ],
            vec![
                "delete",
                "element",
                t4[0],
                t4[1],
                "cluster-ips",
                "{ 10.96.7.1 }",
            ],
            vec![
                "add",
                "element",
                t4[0],
                t4[1],
                "cluster-ips",
                "{ 10.99.99.99 }",
            ],
        ] {
            let mut argv = vec!["nft"];
            argv.extend(cmd);
            run(&argv);
        }
        let mut second =
            NftablesProxier::new(proxier_config(IpFamily::V4), Box::new(NftNetlink::new()));
        let r = second
            .sync(t.state(), &BTreeSet::new(), true)
            .expect("restart");
        let a = second.adoption().expect("the restart adopted the table");
        assert_eq!(a.chains_rewritten, 1, "{a:?}");
        assert_eq!(a.chains_deleted, 1, "{a:?}");
        assert_eq!(a.sets_changed, 1, "{a:?}");
        assert_eq!(a.elements_changed, 2, "{a:?}");
        assert!(a.chains_kept > 0 && r.ops > 0, "{a:?}");
        let after = listing(Mode::Nftables);
        let full = fresh_full(Mode::Nftables, &[t.state()]).expect("fresh");
        assert!(
            after == full,
            "repaired table differs:\n{}",
            diff(&after, &full)
        );
        let text = run(&["nft", "list", "table", "ip", "kube-proxy-rs"]);
        assert!(!text.contains("stray"), "{text}");
    });
}

/// A table made by another layout (an older build: its comment names no
/// layout) is replaced whole, not adopted.
#[test]
fn restart_replaces_a_table_of_another_layout_nftables() {
    in_fresh_netns(|| {
        run(&[
            "nft",
            "add table ip kube-proxy-rs { comment \"rules for kube-proxy-rs\" ; }",
        ]);
        run(&["nft", "add chain ip kube-proxy-rs stray"]);
        let t = tracker(IpFamily::V4);
        let mut dp =
            NftablesProxier::new(proxier_config(IpFamily::V4), Box::new(NftNetlink::new()));
        dp.sync(t.state(), &BTreeSet::new(), true)
            .expect("first sync");
        assert!(dp.adoption().is_none(), "adopted another layout's table");
        let text = run(&["nft", "list", "table", "ip", "kube-proxy-rs"]);
        assert!(!text.contains("stray"), "{text}");
        assert!(text.contains("(layout "), "{text}");
    });
}

/// A restart keeps `cluster-ips-check` when the Service ranges (the
/// cluster's ServiceCIDRs) are those the table drops, and rewrites it
/// alone when they changed meanwhile.
#[test]
fn restart_adopts_or_rewrites_the_service_ranges_nftables() {
    in_fresh_netns(|| {
        let cidr = |cidrs: &[&str]| {
            Step::Apply(json!({
                "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                "metadata": {"name": "kubernetes"}, "spec": {"cidrs": cidrs},
            }))
        };
        let mut t = tracker(IpFamily::V4);
        apply(
            &mut t,
            &Step::Apply(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": "default", "name": "web"},
                "spec": {"clusterIP": "10.96.7.1", "clusterIPs": ["10.96.7.1"],
                         "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]},
            })),
        );
        apply(&mut t, &cidr(&["10.96.0.0/16"]));
        t.take_changes();
        let start =
            || NftablesProxier::new(proxier_config(IpFamily::V4), Box::new(NftNetlink::new()));
        start()
            .sync(t.state(), &BTreeSet::new(), true)
            .expect("first sync");
        let text = run(&[
            "nft",
            "list",
            "chain",
            "ip",
            "kube-proxy-rs",
            "cluster-ips-check",
        ]);
        assert!(text.contains("ip daddr 10.96.0.0/16 drop"), "{text}");

        let mut same = start();
        same.sync(t.state(), &BTreeSet::new(), true)
            .expect("restart");
        let a = same.adoption().expect("adopted");
        assert_eq!(a.chains_rewritten, 0, "{a:?}");

        apply(&mut t, &cidr(&["10.96.0.0/16", "fd00:96::/108"]));
        apply(
            &mut t,
            &Step::Apply(json!({
                "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                "metadata": {"name": "second"}, "spec": {"cidrs": ["10.98.0.0/24"]},
            })),
        );
        t.take_changes();
        let mut changed = start();
        changed
            .sync(t.state(), &BTreeSet::new(), true)
            .expect("restart");
        let a = changed.adoption().expect("adopted");
        assert_eq!(a.chains_rewritten, 1, "{a:?}");
        let after = listing(Mode::Nftables);
        let full = fresh_full(Mode::Nftables, &[t.state()]).expect("fresh");
        assert!(
            after == full,
            "adopted table differs:\n{}",
            diff(&after, &full)
        );
        let text = run(&[
            "nft",
            "list",
            "chain",
            "ip",
            "kube-proxy-rs",
            "cluster-ips-check",
        ]);
        assert!(
            text.contains("ip daddr 10.96.0.0/16 drop")
                && text.contains("ip daddr 10.98.0.0/24 drop"),
            "{text}"
        );
    });
}
