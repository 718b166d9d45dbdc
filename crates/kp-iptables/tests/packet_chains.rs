//! packet_chains: the chains `kube-proxy-rs explain` looks up for a packet,
//! upstream's names, as render_service installs them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::sync::Arc;

use kp_iptables::{packet_chains, sep_chain, svc_chain};
use kp_model::explain::{explain, Packet};
use kp_model::{
    Endpoint, IpFamily, LocalDetector, NodeInfo, Protocol, ProxierConfig, ProxyState, ServicePort,
};

fn run(sp: ServicePort, eps: Vec<Endpoint>, src: &str, dst: &str, port: u16) -> Vec<String> {
    let mut s = ProxyState::new(IpFamily::V4, NodeInfo::named("node1"));
    s.endpoints.insert(sp.name.clone(), Arc::new(eps.clone()));
    s.services.insert(sp.name.clone(), Arc::new(sp.clone()));
    let mut c = ProxierConfig::new(IpFamily::V4);
    c.local_detector = LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().unwrap()]);
    let pkt = Packet {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        port,
        protocol: Protocol::Tcp,
    };
    let ex = explain(&[&s], &[&c], &pkt);
    packet_chains(&sp, &eps, &c, &s.node, &ex.route().unwrap())
        .into_iter()
        .map(|(t, c)| format!("{t} {c}"))
        .collect()
}

#[test]
fn cluster_ip_goes_through_svc_and_sep() {
    let sp = ServicePort::builder("default", "web")
        .cluster_ip("10.96.0.10")
        .build();
    let ep = Endpoint::at("10.244.1.5:8080");
    let got = run(sp.clone(), vec![ep.clone()], "10.244.1.9", "10.96.0.10", 80);
    assert_eq!(
        got,
        [
            "nat KUBE-SERVICES".to_string(),
            format!("nat {}", svc_chain(&sp)),
            format!("nat {}", sep_chain(&sp, &ep)),
        ]
    );
}

#[test]
fn nodeport_no_endpoints_and_firewall() {
    let sp = ServicePort::builder("default", "np")
        .cluster_ip("10.96.0.12")
        .node_port(30080)
        .build();
    let got = run(
        sp.clone(),
        vec![Endpoint::at("10.244.1.5:8080")],
        "172.16.0.3",
        "192.168.0.1",
        30080,
    );
    assert_eq!(&got[..2], ["nat KUBE-SERVICES", "nat KUBE-NODEPORTS"]);
    assert!(got[2].starts_with("nat KUBE-EXT-"), "{got:?}");
    let got = run(sp, vec![], "172.16.0.3", "192.168.0.1", 30080);
    assert_eq!(got, ["filter KUBE-EXTERNAL-SERVICES"]);
    let lb = ServicePort::builder("default", "lb")
        .cluster_ip("10.96.0.11")
        .load_balancer_ips(&["198.51.100.9"])
        .source_ranges(&["203.0.113.0/24"])
        .build();
    let got = run(
        lb,
        vec![Endpoint::at("10.244.1.5:8080")],
        "172.16.0.3",
        "198.51.100.9",
        80,
    );
    assert_eq!(got[0], "nat KUBE-SERVICES");
    assert!(got[1].starts_with("nat KUBE-FW-"), "{got:?}");
    assert_eq!(got[2], "filter KUBE-PROXY-FIREWALL");
}
