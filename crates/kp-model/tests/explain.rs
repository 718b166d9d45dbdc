//! kp_model::explain: one test per reason the explanation gives (match kind,
//! no match, endpoint kept or left out, drop/reject, masquerade, affinity),
//! and kp_model::status's rows. Their text is the binary's (render/).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::sync::Arc;

use kp_model::explain::{explain, Action, Explanation, MatchKind, Packet, Tri};
use kp_model::status::service_ports;
use kp_model::{
    Endpoint, IpFamily, LocalDetector, NodeInfo, Protocol, ProxierConfig, ProxyState, ServicePort,
};

fn state(node: NodeInfo, ports: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
    let mut s = ProxyState::new(IpFamily::V4, node);
    for (sp, eps) in ports {
        if !eps.is_empty() {
            s.endpoints.insert(sp.name.clone(), Arc::new(eps));
        }
        s.services.insert(sp.name.clone(), Arc::new(sp));
    }
    s
}

fn cfg() -> ProxierConfig {
    let mut c = ProxierConfig::new(IpFamily::V4);
    c.local_detector = LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().unwrap()]);
    c.node_ips = vec!["192.168.0.1".parse().unwrap()];
    c
}

fn pkt(src: &str, dst: &str, port: u16) -> Packet {
    Packet {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        port,
        protocol: Protocol::Tcp,
    }
}

fn run(s: &ProxyState, c: &ProxierConfig, p: Packet) -> Explanation {
    explain(&[s], &[c], &p)
}

fn web() -> ServicePort {
    ServicePort::builder("default", "web")
        .port_name("http")
        .cluster_ip("10.96.0.10")
        .node_port(30080)
        .external_ips(&["203.0.113.7"])
        .load_balancer_ips(&["198.51.100.9"])
        .build()
}

fn two() -> Vec<Endpoint> {
    vec![
        Endpoint::at("10.244.1.5:8080").local(),
        Endpoint::at("10.244.2.6:8080"),
    ]
}

fn kept(ex: &Explanation) -> Vec<&str> {
    ex.endpoints
        .iter()
        .filter(|c| c.kept)
        .map(|c| c.endpoint.address.as_str())
        .collect()
}

fn why<'a>(ex: &'a Explanation, addr: &str) -> &'a str {
    &ex.endpoints
        .iter()
        .find(|c| c.endpoint.address == addr)
        .unwrap_or_else(|| panic!("no candidate {addr}: {ex:#?}"))
        .why
}

#[test]
fn cluster_ip_from_a_pod_dnats_without_masquerade() {
    let s = state(NodeInfo::named("node1"), vec![(web(), two())]);
    let ex = run(&s, &cfg(), pkt("10.244.1.9", "10.96.0.10", 80));
    let m = ex.matched.as_ref().unwrap();
    assert_eq!(m.kind, MatchKind::ClusterIP);
    assert_eq!(m.service_port, "default/web:http");
    assert_eq!(ex.verdict.action, Action::Dnat);
    assert_eq!(kept(&ex), ["10.244.1.5:8080", "10.244.2.6:8080"]);
    assert_eq!(ex.source_in_cluster, Tri::Yes);
    let masq = ex.masquerade.as_ref().unwrap();
    assert!(!masq.masquerade, "{masq:?}");
    assert!(masq.why.contains("in-cluster"), "{masq:?}");
    assert!(
        ex.local_detection.contains("10.244.0.0/16"),
        "{}",
        ex.local_detection
    );
}

#[test]
fn cluster_ip_from_outside_the_pod_cidr_is_masqueraded() {
    let s = state(NodeInfo::named("node1"), vec![(web(), two())]);
    let ex = run(&s, &cfg(), pkt("172.16.0.3", "10.96.0.10", 80));
    assert!(ex.local_detection.contains("outside the pod CIDRs"));
    let masq = ex.masquerade.unwrap();
    assert!(
        masq.masquerade && masq.why.contains("not in-cluster"),
        "{masq:?}"
    );
}

#[test]
fn masquerade_all_and_no_detector() {
    let s = state(NodeInfo::named("node1"), vec![(web(), two())]);
    let mut c = cfg();
    c.masquerade_all = true;
    let ex = run(&s, &c, pkt("10.244.1.9", "10.96.0.10", 80));
    let masq = ex.masquerade.unwrap();
    assert!(
        masq.masquerade && masq.why.contains("--masquerade-all"),
        "{masq:?}"
    );

    let mut c = cfg();
    c.local_detector = LocalDetector::None;
    let ex = run(&s, &c, pkt("172.16.0.3", "10.96.0.10", 80));
    let masq = ex.masquerade.unwrap();
    assert!(
        !masq.masquerade && masq.why.contains("no local-traffic detector"),
        "{masq:?}"
    );

    let mut c = cfg();
    c.local_detector = LocalDetector::InterfaceNamePrefix("veth".into());
    let ex = run(&s, &c, pkt("172.16.0.3", "10.96.0.10", 80));
    assert_eq!(ex.source_in_cluster, Tri::Unknown);
    assert!(ex.masquerade.unwrap().why.contains("veth*"));
}

#[test]
fn no_pod_cidr_of_the_family_masquerades_nothing() {
    // Only an IPv6 cluster CIDR: no IPv4 source is told apart, and no
    // renderer writes an IPv4 masquerade rule for cluster IPs.
    let s = state(NodeInfo::named("node1"), vec![(web(), two())]);
    let mut c = cfg();
    c.local_detector = LocalDetector::Cidrs(vec!["fd00:10::/64".parse().unwrap()]);
    let ex = run(&s, &c, pkt("172.16.0.3", "10.96.0.10", 80));
    let masq = ex.masquerade.unwrap();
    assert!(
        !masq.masquerade && masq.why.contains("not masqueraded"),
        "{masq:?}"
    );
}

#[test]
fn hairpin_is_masqueraded() {
    let s = state(NodeInfo::named("node1"), vec![(web(), two())]);
    let ex = run(&s, &cfg(), pkt("10.244.1.5", "10.96.0.10", 80));
    let masq = ex.masquerade.unwrap();
    assert!(masq.masquerade && masq.why.contains("hairpin"), "{masq:?}");
}

#[test]
fn nodeport_external_ip_and_load_balancer_matches() {
    let s = state(NodeInfo::named("node1"), vec![(web(), two())]);
    let c = cfg();
    let np = run(&s, &c, pkt("172.16.0.3", "192.168.0.1", 30080));
    assert_eq!(np.matched.as_ref().unwrap().kind, MatchKind::NodePort);
    let masq = np.masquerade.as_ref().unwrap();
    assert!(
        masq.masquerade && masq.why.contains("externalTrafficPolicy Cluster"),
        "{masq:?}"
    );
    let ext = run(&s, &c, pkt("172.16.0.3", "203.0.113.7", 80));
    assert_eq!(ext.matched.unwrap().kind, MatchKind::ExternalIP);
    let lb = run(&s, &c, pkt("172.16.0.3", "198.51.100.9", 80));
    assert_eq!(lb.matched.unwrap().kind, MatchKind::LoadBalancerIngress);
    assert_eq!(lb.verdict.action, Action::Dnat);
    // The NodePort on an address that is not this node's.
    let other = run(&s, &c, pkt("172.16.0.3", "192.168.0.2", 30080));
    assert!(other.matched.is_none());
    assert!(other
        .verdict
        .why
        .contains("not one of this node's NodePort addresses"));
}

#[test]
fn no_match_and_invalid_cluster_ip_port() {
    let s = state(NodeInfo::named("node1"), vec![(web(), two())]);
    let ex = run(&s, &cfg(), pkt("10.244.1.9", "8.8.8.8", 53));
    assert!(ex.matched.is_none());
    assert_eq!(ex.verdict.action, Action::Untouched);
    assert!(ex.verdict.why.contains("not touched"), "{}", ex.verdict.why);
    let ex = run(&s, &cfg(), pkt("10.244.1.9", "10.96.0.10", 81));
    assert_eq!(ex.verdict.action, Action::Reject);
    assert!(
        ex.verdict.why.contains("invalid port"),
        "{}",
        ex.verdict.why
    );
}

#[test]
fn no_endpoints_rejects() {
    let s = state(NodeInfo::named("node1"), vec![(web(), vec![])]);
    let ex = run(&s, &cfg(), pkt("10.244.1.9", "10.96.0.10", 80));
    assert_eq!(ex.verdict.action, Action::Reject);
    assert!(ex.verdict.why.contains("no usable endpoint"));
    assert!(ex.masquerade.is_none());
    // Only unready ones: rejected too, each said why.
    let s = state(
        NodeInfo::named("node1"),
        vec![(web(), vec![Endpoint::at("10.244.2.6:8080").unready()])],
    );
    let ex = run(&s, &cfg(), pkt("10.244.1.9", "10.96.0.10", 80));
    assert_eq!(ex.verdict.action, Action::Reject);
    assert_eq!(why(&ex, "10.244.2.6:8080"), "not ready: never used");
}

#[test]
fn terminating_fallback() {
    let eps = vec![
        Endpoint::at("10.244.2.6:8080").serving_terminating(),
        Endpoint::at("10.244.2.7:8080").terminated(),
    ];
    let s = state(NodeInfo::named("node1"), vec![(web(), eps)]);
    let ex = run(&s, &cfg(), pkt("10.244.1.9", "10.96.0.10", 80));
    assert_eq!(ex.verdict.action, Action::Dnat);
    assert_eq!(kept(&ex), ["10.244.2.6:8080"]);
    assert!(ex.fallback.as_ref().unwrap().contains("terminating"));
    assert!(why(&ex, "10.244.2.6:8080").contains("fallback"));
    assert!(why(&ex, "10.244.2.7:8080").contains("never used"));
    // With a ready one, the terminating one is left out.
    let eps = vec![
        Endpoint::at("10.244.2.5:8080"),
        Endpoint::at("10.244.2.6:8080").serving_terminating(),
    ];
    let s = state(NodeInfo::named("node1"), vec![(web(), eps)]);
    let ex = run(&s, &cfg(), pkt("10.244.1.9", "10.96.0.10", 80));
    assert!(ex.fallback.is_none());
    assert!(why(&ex, "10.244.2.6:8080").contains("ready endpoints exist"));
}

#[test]
fn topology_hints_pick_this_zone() {
    let eps = vec![
        Endpoint::at("10.244.1.5:8080").with_zone_hints(&["zone-a"]),
        Endpoint::at("10.244.2.6:8080").with_zone_hints(&["zone-b"]),
    ];
    let s = state(
        NodeInfo::named("node1").in_zone("zone-a"),
        vec![(web(), eps)],
    );
    let ex = run(&s, &cfg(), pkt("10.244.1.9", "10.96.0.10", 80));
    assert_eq!(kept(&ex), ["10.244.1.5:8080"]);
    assert!(ex.topology.as_ref().unwrap().contains("zone-a"));
    assert!(why(&ex, "10.244.2.6:8080").contains("zone hints [zone-b]"));
    assert!(why(&ex, "10.244.1.5:8080").contains("topology hints match"));
}

#[test]
fn external_policy_local_without_local_endpoint_drops() {
    let sp = ServicePort::builder("default", "lb")
        .cluster_ip("10.96.0.11")
        .node_port(30081)
        .load_balancer_ips(&["198.51.100.10"])
        .local_external()
        .build();
    let s = state(
        NodeInfo::named("node1"),
        vec![(sp, vec![Endpoint::at("10.244.2.6:8080")])],
    );
    let ex = run(&s, &cfg(), pkt("172.16.0.3", "198.51.100.10", 80));
    assert_eq!(ex.verdict.action, Action::Drop);
    assert!(
        ex.verdict.why.contains("externalTrafficPolicy Local"),
        "{}",
        ex.verdict.why
    );
    assert!(why(&ex, "10.244.2.6:8080").contains("not on this node"));
    // A pod of the cluster is short-circuited to the cluster endpoints.
    let ex = run(&s, &cfg(), pkt("10.244.1.9", "198.51.100.10", 80));
    assert_eq!(ex.verdict.action, Action::Dnat);
    assert!(ex
        .endpoint_set
        .as_ref()
        .unwrap()
        .contains("short-circuited"));
    assert!(!ex.masquerade.unwrap().masquerade);
    // The node itself: short-circuited and masqueraded.
    let ex = run(&s, &cfg(), pkt("192.168.0.1", "198.51.100.10", 80));
    assert_eq!(ex.verdict.action, Action::Dnat);
    assert!(ex.masquerade.unwrap().why.contains("this node"));
}

#[test]
fn external_policy_local_keeps_the_client_address() {
    let sp = ServicePort::builder("default", "lb")
        .cluster_ip("10.96.0.11")
        .node_port(30081)
        .local_external()
        .build();
    let s = state(NodeInfo::named("node1"), vec![(sp, two())]);
    let ex = run(&s, &cfg(), pkt("172.16.0.3", "192.168.0.1", 30081));
    assert_eq!(kept(&ex), ["10.244.1.5:8080"]);
    let masq = ex.masquerade.unwrap();
    assert!(
        !masq.masquerade && masq.why.contains("keeps the client"),
        "{masq:?}"
    );
}

#[test]
fn internal_policy_local_without_local_endpoint_drops() {
    let sp = ServicePort::builder("default", "itp")
        .cluster_ip("10.96.0.12")
        .local_internal()
        .build();
    let s = state(
        NodeInfo::named("node1"),
        vec![(sp, vec![Endpoint::at("10.244.2.6:8080")])],
    );
    let ex = run(&s, &cfg(), pkt("10.244.1.9", "10.96.0.12", 80));
    assert_eq!(ex.verdict.action, Action::Drop);
    assert!(ex.verdict.why.contains("internalTrafficPolicy Local"));
}

#[test]
fn load_balancer_source_ranges_drop() {
    let sp = ServicePort::builder("default", "fw")
        .cluster_ip("10.96.0.13")
        .load_balancer_ips(&["198.51.100.11"])
        .source_ranges(&["203.0.113.0/24"])
        .build();
    let s = state(NodeInfo::named("node1"), vec![(sp, two())]);
    let ex = run(&s, &cfg(), pkt("172.16.0.3", "198.51.100.11", 80));
    assert_eq!(ex.verdict.action, Action::Drop);
    assert!(ex
        .verdict
        .why
        .contains("loadBalancerSourceRanges [203.0.113.0/24]"));
    let ex = run(&s, &cfg(), pkt("203.0.113.4", "198.51.100.11", 80));
    assert_eq!(ex.verdict.action, Action::Dnat);
}

#[test]
fn session_affinity() {
    let sp = ServicePort::builder("default", "sticky")
        .cluster_ip("10.96.0.14")
        .affinity(600)
        .build();
    let s = state(NodeInfo::named("node1"), vec![(sp, two())]);
    let ex = run(&s, &cfg(), pkt("10.244.1.9", "10.96.0.14", 80));
    assert_eq!(ex.session_affinity_seconds, Some(600));
    assert!(ex.verdict.why.contains("600s"));
    let json = serde_json::to_value(&ex).unwrap();
    assert_eq!(json["sessionAffinitySeconds"], 600);
    assert_eq!(json["matched"]["kind"], "ClusterIP");
    assert_eq!(json["verdict"]["action"], "Dnat");
    assert_eq!(json["packet"]["protocol"], "TCP");
}

#[test]
fn other_family_has_no_service() {
    let s = state(NodeInfo::named("node1"), vec![(web(), two())]);
    let p = Packet {
        src: "fd00::1".parse().unwrap(),
        dst: "fd00::10".parse().unwrap(),
        port: 80,
        protocol: Protocol::Tcp,
    };
    let ex = explain(&[&s], &[&cfg()], &p);
    assert!(ex.matched.is_none());
    assert_eq!(ex.family, IpFamily::V6);
}

#[test]
fn status_rows() {
    let eps = vec![
        Endpoint::at("10.244.1.5:8080").local(),
        Endpoint::at("10.244.2.6:8080").serving_terminating(),
    ];
    let s = state(NodeInfo::named("node1"), vec![(web(), eps)]);
    let rows = service_ports(&s, None);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].endpoints.len(), 2);
    assert!(rows[0].endpoints[0].internal && rows[0].endpoints[0].external);
    assert!(
        !rows[0].endpoints[1].internal,
        "terminating, a ready one exists"
    );
    assert!(service_ports(&s, Some("kube-system/")).is_empty());
    assert_eq!(service_ports(&s, Some("default/web")).len(), 1);
}
