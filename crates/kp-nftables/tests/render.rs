//! Rendered rules for each kind of Service, checked against the layout in
//! docs/nftables.md and, where root is available, by `nft -c` in a throwaway
//! network namespace.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

mod common;

use std::collections::BTreeSet;

use common::*;
use kp_model::{Dataplane, IpFamily, LocalDetector, ProxierConfig};
use kp_nftables::{NftBackend, NftablesProxier, Transaction};
use serde_json::json;

/// Records scripts instead of applying them.
#[derive(Default, Clone)]
struct Recorder(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl NftBackend for Recorder {
    fn apply(&mut self, tx: &Transaction) -> Result<usize, kp_model::DataplaneError> {
        let script = tx.to_string();
        let n = script.len();
        self.0.lock().unwrap().push(script);
        Ok(n)
    }
    fn table_exists(&mut self, _: IpFamily, _: &str) -> Result<bool, kp_model::DataplaneError> {
        Ok(true)
    }
}

fn cfg() -> ProxierConfig {
    let mut c = ProxierConfig::new(IpFamily::V4);
    c.local_detector = LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().unwrap()]);
    c
}

fn all_kinds() -> Vec<serde_json::Value> {
    vec![
        service("plain", "10.96.0.10", json!({})),
        endpoints(
            "plain",
            &[ready("10.244.1.2", "node1"), ready("10.244.2.2", "node2")],
        ),
        service("noeps", "10.96.0.11", json!({})),
        service(
            "np",
            "10.96.0.12",
            json!({"type": "NodePort", "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}]}),
        ),
        endpoints("np", &[ready("10.244.2.3", "node2")]),
        service(
            "local",
            "10.96.0.13",
            json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 32000,
            "loadBalancerSourceRanges": ["203.0.113.0/24"],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30081}]}),
        ),
        endpoints(
            "local",
            &[ready("10.244.1.4", "node1"), ready("10.244.2.4", "node2")],
        ),
        service(
            "aff",
            "10.96.0.14",
            json!({"sessionAffinity": "ClientIP", "externalIPs": ["198.51.100.7"]}),
        ),
        endpoints(
            "aff",
            &[ready("10.244.1.5", "node1"), ready("10.244.2.5", "node2")],
        ),
        service(
            "itp",
            "10.96.0.15",
            json!({"internalTrafficPolicy": "Local"}),
        ),
        endpoints("itp", &[ready("10.244.2.6", "node2")]),
        // SCTP: this kernel has no SCTP sockets, so these rules are checked by
        // the kernel accepting them, not by traffic.
        service(
            "sctp",
            "10.96.0.16",
            json!({"ports": [{"name": "s", "port": 9000, "protocol": "SCTP"}]}),
        ),
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "default", "name": "sctp-abc",
                         "labels": {"kubernetes.io/service-name": "sctp"}},
            "addressType": "IPv4",
            "ports": [{"name": "s", "port": 9000, "protocol": "SCTP"}],
            "endpoints": [
                {"addresses": ["10.244.1.9"], "nodeName": "node1", "conditions": {"ready": true}},
                {"addresses": ["10.244.2.9"], "nodeName": "node2", "conditions": {"ready": true}}
            ]
        }),
    ]
}

/// Every element line of `map`, joined.
fn map_elements(text: &str, map: &str) -> String {
    let prefix = format!("add element ip kube-proxy-rs {map} {{");
    text.lines()
        .filter(|l| l.starts_with(&prefix))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The chain `ip`'s service-ips element goes to.
fn service_ips_target<'a>(text: &'a str, ip: &str) -> &'a str {
    let elem = format!("{ip} . ");
    let line = text
        .lines()
        .find(|l| l.contains("service-ips {") && l.contains(&elem))
        .unwrap_or_else(|| panic!("no service-ips element for {ip}: {text}"));
    let after = &line[line.find(&elem).unwrap_or(0)..];
    after
        .split(": goto ")
        .nth(1)
        .and_then(|r| r.split([',', ' ']).next())
        .unwrap_or_else(|| panic!("no chain for {ip}: {line}"))
}

/// The map and slot offset of the `numgen` DNAT rule in the chain that
/// `ip`'s service-ips element goes to, checking its modulus and map prefix.
fn slot_base(text: &str, ip: &str, map: &str, n: usize) -> (String, u32) {
    let chain = service_ips_target(text, ip);
    let prefix = format!("add rule ip kube-proxy-rs {chain} ");
    let rule = text
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .find(|l| l.contains("numgen"))
        .unwrap_or_else(|| panic!("no numgen rule in {chain}: {text}"));
    let want = format!("numgen random mod {n} offset ");
    let rest = rule
        .split(&want)
        .nth(1)
        .unwrap_or_else(|| panic!("{rule}: not {want}"));
    let mut words = rest.split(' ');
    let offset = words.next().and_then(|o| o.parse().ok()).expect("offset");
    let name = words
        .next_back()
        .and_then(|w| w.strip_prefix('@'))
        .expect("map");
    assert!(name.starts_with(map), "{rule}");
    (name.to_string(), offset)
}

#[test]
fn each_kind_of_service_renders_its_layout() {
    let mut t = tracker(IpFamily::V4);
    let mut objs = all_kinds();
    // LoadBalancer ingress lives in status.
    objs[5]["status"] = json!({"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}});
    apply(&mut t, &objs);
    let rec = Recorder::default();
    let p = NftablesProxier::new(cfg(), Box::new(rec.clone()));
    let text = p.render(t.state());

    // ClusterIP only, two endpoints: no chain of its own; the shared
    // chain for two TCP endpoints picks one of them under the ClusterIP
    // and port in its select map.
    let pick = service_ips_target(&text, "10.96.0.10");
    assert!(pick.starts_with("pick-tcp-2-"), "{text}");
    assert!(!text.contains("default/plain/"), "{text}");
    let select = text
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("add rule ip kube-proxy-rs {pick} meta l4proto tcp dnat ip addr . port to ip daddr . tcp dport . numgen random mod 2 map @"))
        })
        .unwrap_or_else(|| panic!("no rule in {pick}: {text}"));
    assert!(select.starts_with("select-tcp-0-"), "{select}");
    let elems = map_elements(&text, select);
    assert!(
        elems.contains("10.96.0.10 . 80 . 0 : 10.244.1.2 . 8080")
            && elems.contains("10.96.0.10 . 80 . 1 : 10.244.2.2 . 8080"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "add map ip kube-proxy-rs {select} {{ typeof ip daddr . tcp dport . numgen random mod 1 : ip daddr . tcp dport ; }}"
        )),
        "{text}"
    );
    // One rule before the dispatch marks off-cluster traffic to any
    // ClusterIP; no Service chain carries its own (upstream: one per chain).
    let masq_rules: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("jump mark-for-masquerade") && l.contains("10.244.0.0/16"))
        .collect();
    assert_eq!(
        masq_rules,
        [
            "add rule ip kube-proxy-rs services ip daddr @cluster-ips ip saddr != 10.244.0.0/16 jump mark-for-masquerade"
        ],
        "{text}"
    );
    let services_rules: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("add rule ip kube-proxy-rs services "))
        .collect();
    assert!(
        services_rules.len() == 3 && services_rules[0].contains("mark-for-masquerade"),
        "the masquerade mark comes before the dispatch: {services_rules:?}"
    );
    // A Service with a chain of its own (here the LoadBalancer's, for
    // cluster-wide traffic) picks one of two slots of the shared TCP
    // endpoint map, and those slots hold its two endpoints.
    let (map, base) = slot_base(&text, "10.96.0.13", "endpoints-tcp-", 2);
    let elems = map_elements(&text, &map);
    assert!(
        elems.contains(&format!("0x{:x} : 10.244.1.4 . 8080", base))
            && elems.contains(&format!("0x{:x} : 10.244.2.4 . 8080", base + 1)),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "add map ip kube-proxy-rs {map} {{ typeof numgen random mod 1 : ip daddr . tcp dport ; }}"
        )),
        "{text}"
    );
    // No endpoints: reject.
    assert!(text.contains("10.96.0.11 . tcp . 80 : goto reject-chain"));
    // NodePort: goes through the external chain, which masquerades.
    assert!(text.contains("tcp . 30080 : goto external-"));
    // eTP=Local LoadBalancer: local endpoint only, short-circuit for pods and the node, firewall.
    assert!(text.contains("local endpoints only"));
    assert!(text.contains("ip saddr 10.244.0.0/16 goto service-"));
    assert!(text.contains("dnat ip to 10.244.1.4:8080"));
    assert!(text.contains("198.51.100.1 . tcp . 80 : goto firewall-"));
    assert!(text.contains("ip saddr != { 203.0.113.0/24 } drop"));
    // Affinity: one set per timeout for every Service, records keyed by
    // client, selection and index; a rule per index, no chain per endpoint.
    assert!(text.contains(
        "add set ip kube-proxy-rs affinity-10800 { typeof ip saddr . numgen random mod 1 . numgen random mod 1 ; size 1048576 ; flags dynamic,timeout ; timeout 10800s ; }"
    ), "{text}");
    let aff: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("add rule") && l.contains("@affinity-10800"))
        .collect();
    assert_eq!(
        aff.len(),
        3,
        "two endpoints: two hit rules, one pick: {aff:?}"
    );
    assert!(
        aff[0].contains(" . numgen random mod 1 offset 0 @affinity-10800 update @affinity-10800"),
        "{aff:?}"
    );
    assert!(
        aff[1].contains(" . numgen random mod 1 offset 1 @affinity-10800 update @affinity-10800"),
        "{aff:?}"
    );
    assert!(
        aff[2].contains(" . jhash ip saddr . th sport mod 2 seed 0x") && !aff[2].contains("dnat"),
        "{aff:?}"
    );
    // The new client's DNAT is a rule of its own (a full set, where the
    // record fails, must not stop it), right after the record.
    let chain_rules: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with(aff[2].split(" meta ").next().unwrap_or_default()))
        .collect();
    assert_eq!(chain_rules.len(), 4, "{chain_rules:?}");
    assert!(
        chain_rules[3].contains(" dnat ip addr . port to jhash ip saddr . th sport mod 2 seed 0x")
            && !chain_rules[3].contains("@affinity"),
        "{aff:?}"
    );
    assert!(!text.contains("chain ip kube-proxy-rs endpoint-"), "{text}");
    assert!(text.contains("198.51.100.7 . tcp . 80 : goto external-"));
    // iTP=Local with no local endpoint: dropped, not rejected (endpoints exist elsewhere).
    assert!(text.contains("10.96.0.15 . tcp . 80 : drop"));
    // SCTP service ports are keyed and DNATed like TCP ones.
    assert!(
        text.contains("10.96.0.16 . sctp . 9000 : goto pick-sctp-2-"),
        "{text}"
    );
    assert!(text.contains(
        "meta l4proto sctp dnat ip addr . port to ip daddr . sctp dport . numgen random mod 2 map @select-sctp-0-"
    ));
    assert!(
        text.contains("10.96.0.16 . 9000 . 1 : 10.244.2.9 . 9000"),
        "{text}"
    );
    // No INVALID drop in the forward chain, as upstream's nftables mode
    // (kubernetes#122663): multi-homed nodes forward such packets.
    assert!(!text.contains("ct state invalid"), "{text}");
    assert!(text.contains(
        "add rule ip kube-proxy-rs filter-forward ct state new jump service-endpoints-check"
    ));
    // Hairpin set holds local endpoints.
    assert!(text.contains("10.244.1.2 . 10.244.1.2"));
}

#[test]
fn partial_sync_touches_only_the_changed_service() {
    let mut t = tracker(IpFamily::V4);
    apply(&mut t, &all_kinds());
    let rec = Recorder::default();
    let mut p = NftablesProxier::new(cfg(), Box::new(rec.clone()));
    let st = t.state().clone();
    let r = p.sync(&st, &BTreeSet::new(), false).unwrap();
    assert!(r.full);
    // Replace one endpoint of "plain".
    let cs = apply(
        &mut t,
        &[endpoints(
            "plain",
            &[ready("10.244.1.2", "node1"), ready("10.244.2.9", "node2")],
        )],
    );
    assert_eq!(cs.changed.len(), 1);
    let r = p.sync(t.state(), &cs.changed, false).unwrap();
    assert!(!r.full);
    let scripts = rec.0.lock().unwrap();
    let last = scripts.last().unwrap();
    // Same number of endpoints: no chain or rule, only the replaced
    // endpoint's select element changes.
    assert!(!last.contains("flush chain"), "{last}");
    assert!(!last.contains("add rule"), "{last}");
    assert!(!last.contains("service-ips"), "{last}");
    let lines: Vec<&str> = last.lines().collect();
    assert_eq!(lines.len(), 2, "{last}");
    assert!(
        lines[0].starts_with("delete element ip kube-proxy-rs select-tcp-0-")
            && lines[0].ends_with(" { 10.96.0.10 . 80 . 1 : 10.244.2.2 . 8080 }"),
        "{last}"
    );
    assert!(
        lines[1].starts_with("add element ip kube-proxy-rs select-tcp-0-")
            && lines[1].ends_with(" { 10.96.0.10 . 80 . 1 : 10.244.2.9 . 8080 }"),
        "{last}"
    );
    assert!(
        !last.contains("10.96.0.12"),
        "other services untouched: {last}"
    );
    assert!(!last.contains("flush table"));
    // Delete a service: its chain goes and its elements are removed.
    drop(scripts);
    let cs = {
        t.delete_service("default", "np", std::time::SystemTime::now());
        t.take_changes()
    };
    p.sync(t.state(), &cs.changed, false).unwrap();
    let scripts = rec.0.lock().unwrap();
    let last = scripts.last().unwrap();
    assert!(
        last.contains(
            "delete element ip kube-proxy-rs service-nodeports { tcp . 30080 : goto external-"
        ),
        "{last}"
    );
    assert!(last.contains("delete chain ip kube-proxy-rs external-"));
    assert!(last.contains("delete element ip kube-proxy-rs cluster-ips { 10.96.0.12 }"));
}

/// The kernel of a private namespace accepts the rendered ruleset, a partial
/// update, a deletion and a full resync (through netlink, the product's
/// path: nft 1.0.6 cannot parse the affinity checks, see tests/netlink.rs).
#[test]
fn kernel_accepts_full_and_partial_ruleset() {
    let ns = Ns::new("kacc");
    let mut t = tracker(IpFamily::V4);
    let mut objs = all_kinds();
    objs[5]["status"] = json!({"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}});
    apply(&mut t, &objs);
    let mut p = NftablesProxier::new(cfg(), Box::new(kp_nftables::NftNetlink::new()));
    let st = t.state().clone();
    ns.run(|| p.sync(&st, &BTreeSet::new(), false))
        .expect("full sync");
    let cs = apply(
        &mut t,
        &[
            endpoints("plain", &[ready("10.244.2.9", "node2")]),
            endpoints("aff", &[ready("10.244.1.5", "node1")]),
        ],
    );
    let st = t.state().clone();
    ns.run(|| p.sync(&st, &cs.changed, false))
        .expect("partial sync");
    // Deleting a Service whose external chain jumps to its service chain.
    t.delete_service("default", "np", std::time::SystemTime::now());
    let cs = t.take_changes();
    let st = t.state().clone();
    ns.run(|| p.sync(&st, &cs.changed, false))
        .expect("partial sync deleting a NodePort service");
    // Full resync over an existing table keeps working.
    ns.run(|| p.sync(&st, &BTreeSet::new(), true))
        .expect("full resync");
    let listing = ns.nft(&["list", "table", "ip", "kube-proxy-rs"]).unwrap();
    assert!(
        listing.contains("10.244.2.9 . 8080") || listing.contains("10.244.2.9:8080"),
        "{listing}"
    );
    assert!(!listing.contains("10.244.2.2"), "{listing}");
    ns.run(|| p.cleanup()).unwrap();
    assert!(ns.ruleset().trim().is_empty());
}

/// A Service keeps its slot range while its endpoint count fits, moves to a
/// bigger range when it grows, and the range it left goes to the next Service
/// of that size.
#[test]
fn endpoint_slots_are_kept_grown_and_reused() {
    let mut t = tracker(IpFamily::V4);
    let two = |a: &'static str, b: &'static str| [ready(a, "node1"), ready(b, "node2")];
    // NodePorts: chains of their own (a ClusterIP-only Service is picked
    // in a shared chain, without slots).
    let np = |port: u16| json!({"type": "NodePort", "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": port}]});
    apply(
        &mut t,
        &[
            service("a", "10.96.0.20", np(30020)),
            endpoints("a", &two("10.244.1.2", "10.244.2.2")),
            service("b", "10.96.0.21", np(30021)),
            endpoints("b", &two("10.244.1.3", "10.244.2.3")),
        ],
    );
    let rec = Recorder::default();
    let mut p = NftablesProxier::new(cfg(), Box::new(rec.clone()));
    p.sync(t.state(), &BTreeSet::new(), false).unwrap();
    let last = || rec.0.lock().unwrap().last().cloned().unwrap_or_default();
    let full = last();
    let (map, a0) = slot_base(&full, "10.96.0.20", "endpoints-tcp-", 2);
    let (_, b0) = slot_base(&full, "10.96.0.21", "endpoints-tcp-", 2);
    assert!(a0.abs_diff(b0) >= 2, "ranges overlap: {full}");

    // Same count, new address: only the slot changes.
    let cs = apply(&mut t, &[endpoints("a", &two("10.244.1.2", "10.244.2.9"))]);
    p.sync(t.state(), &cs.changed, false).unwrap();
    let s = last();
    assert!(!s.contains("add rule"), "{s}");
    assert!(
        s.contains(&format!(
            "add element ip kube-proxy-rs {map} {{ 0x{:x} : 10.244.2.9 . 8080 }}",
            a0 + 1
        )),
        "{s}"
    );

    // Three endpoints need a range of four: the rule moves, the old slots go.
    let cs = apply(
        &mut t,
        &[endpoints(
            "a",
            &[
                ready("10.244.1.2", "node1"),
                ready("10.244.2.9", "node2"),
                ready("10.244.2.8", "node2"),
            ],
        )],
    );
    p.sync(t.state(), &cs.changed, false).unwrap();
    let s = last();
    let grown = s
        .lines()
        .find_map(|l| l.split("numgen random mod 3 offset ").nth(1))
        .and_then(|r| r.split(' ').next())
        .and_then(|o| o.parse::<u32>().ok())
        .unwrap_or_else(|| panic!("no new rule: {s}"));
    assert!(grown != a0 && grown.abs_diff(b0) >= 2, "{s}");
    assert!(
        s.contains(&format!("0x{a0:x} : 10.244.1.2 . 8080")) && s.contains("delete element"),
        "{s}"
    );

    // A new two-endpoint Service takes the range "a" left.
    let cs = apply(
        &mut t,
        &[
            service("c", "10.96.0.22", np(30022)),
            endpoints("c", &two("10.244.1.5", "10.244.2.5")),
        ],
    );
    p.sync(t.state(), &cs.changed, false).unwrap();
    let s = last();
    assert!(
        s.contains(&format!("numgen random mod 2 offset {a0} map @{map}")),
        "{s}"
    );
}
