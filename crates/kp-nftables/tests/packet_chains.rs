//! packet_chains: the chains `kube-proxy-rs explain` looks up for a packet
//! are the ones render_service installs, in traversal order.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::sync::Arc;

use kp_model::explain::{explain, Packet};
use kp_model::{
    Endpoint, IpFamily, LocalDetector, NodeInfo, Protocol, ProxierConfig, ProxyState, ServicePort,
};
use kp_nftables::{packet_chains, render_service};

fn setup(sp: ServicePort, eps: Vec<Endpoint>) -> (ProxyState, ProxierConfig) {
    let mut s = ProxyState::new(IpFamily::V4, NodeInfo::named("node1"));
    s.endpoints.insert(sp.name.clone(), Arc::new(eps));
    s.services.insert(sp.name.clone(), Arc::new(sp));
    let mut c = ProxierConfig::new(IpFamily::V4);
    c.local_detector = LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().unwrap()]);
    (s, c)
}

fn chains(s: &ProxyState, c: &ProxierConfig, src: &str, dst: &str, port: u16) -> Vec<String> {
    let pkt = Packet {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        port,
        protocol: Protocol::Tcp,
    };
    let ex = explain(&[s], &[c], &pkt);
    let route = ex.route().expect("a matched packet has a route");
    let (name, sp) = s.services.iter().next().unwrap();
    packet_chains(sp, s.endpoints_of(name), c, &s.node, &route)
}

#[test]
fn cluster_ip_nodeport_and_affinity_paths() {
    let sp = ServicePort::builder("default", "web")
        .cluster_ip("10.96.0.10")
        .node_port(30080)
        .affinity(60)
        .build();
    let eps = vec![
        Endpoint::at("10.244.1.5:8080"),
        Endpoint::at("10.244.2.6:8080"),
    ];
    let (s, c) = setup(sp.clone(), eps.clone());
    let installed: Vec<String> = render_service(&sp, &eps, &c, &s.node)
        .chains
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let cip = chains(&s, &c, "10.244.1.9", "10.96.0.10", 80);
    assert_eq!(&cip[..2], ["nat-prerouting", "services"]);
    assert!(cip[2].starts_with("service-"), "{cip:?}");
    // Session affinity has no chain per endpoint: its rules are in the
    // service chain.
    assert_eq!(cip.len(), 3, "{cip:?}");
    let np = chains(&s, &c, "172.16.0.3", "192.168.0.1", 30080);
    assert!(np[2].starts_with("external-"), "{np:?}");
    for c in cip.iter().chain(&np).skip(2) {
        if !["nat-prerouting", "services"].contains(&c.as_str()) {
            assert!(installed.contains(c), "{c} not rendered: {installed:?}");
        }
    }
}

#[test]
fn no_endpoints_and_source_ranges() {
    let sp = ServicePort::builder("default", "lb")
        .cluster_ip("10.96.0.11")
        .load_balancer_ips(&["198.51.100.9"])
        .source_ranges(&["203.0.113.0/24"])
        .build();
    let (s, c) = setup(sp.clone(), vec![]);
    assert_eq!(
        chains(&s, &c, "10.244.1.9", "10.96.0.11", 80),
        ["filter-input", "service-endpoints-check", "reject-chain"]
    );
    let (s, c) = setup(sp, vec![Endpoint::at("10.244.2.6:8080")]);
    let fw = chains(&s, &c, "172.16.0.3", "198.51.100.9", 80);
    assert_eq!(&fw[..2], ["filter-prerouting", "firewall-check"]);
    assert!(fw[2].starts_with("firewall-"), "{fw:?}");
    assert_eq!(fw.len(), 3, "dropped by the source ranges: {fw:?}");
    // Allowed by the ranges but eTP=Local without a local endpoint: the
    // firewall, then the no-endpoint check drops it.
    let etp = ServicePort::builder("default", "lb")
        .cluster_ip("10.96.0.11")
        .load_balancer_ips(&["198.51.100.9"])
        .source_ranges(&["203.0.113.0/24"])
        .local_external()
        .build();
    let (s, c) = setup(etp, vec![Endpoint::at("10.244.2.6:8080")]);
    let got = chains(&s, &c, "203.0.113.5", "198.51.100.9", 80);
    assert_eq!(got[..2], ["filter-prerouting", "firewall-check"]);
    assert_eq!(got[3..], ["filter-input", "service-endpoints-check"]);
}

/// A Service reached only at its ClusterIP is picked in the shared chain
/// for its endpoint count, which the sync installs for it.
#[test]
fn cluster_ip_only_goes_through_the_shared_pick_chain() {
    let sp = ServicePort::builder("default", "db")
        .cluster_ip("10.96.0.12")
        .build();
    let eps = vec![
        Endpoint::at("10.244.1.5:5432"),
        Endpoint::at("10.244.2.6:5432"),
        Endpoint::at("10.244.2.7:5432"),
    ];
    let (s, c) = setup(sp.clone(), eps.clone());
    let objs = render_service(&sp, &eps, &c, &s.node);
    assert!(objs.chains.is_empty(), "no chain of its own: {objs:?}");
    assert_eq!(objs.picks.len(), 1);
    assert_eq!(objs.picks[0].count(), 3);
    let shared = objs.picks[0].key().chain();
    assert!(shared.starts_with("pick-tcp-3-"), "{shared}");
    assert_eq!(
        chains(&s, &c, "10.244.1.9", "10.96.0.12", 80),
        ["nat-prerouting", "services", shared.as_str()]
    );
}
