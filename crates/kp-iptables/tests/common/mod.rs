//! Shared by the kernel tests: model state with one Service of every kind
//! the renderer distinguishes.
#![allow(dead_code)]

use std::sync::Arc;

use kp_model::testing::ServicePortBuilder;
use kp_model::{Endpoint, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort};

pub fn service(name: &str, cip: &str) -> ServicePortBuilder {
    ServicePort::builder("default", name)
        .port_name("http")
        .cluster_ip(cip)
}

pub fn state(family: IpFamily, services: &[(ServicePort, Vec<Endpoint>)]) -> ProxyState {
    let mut st = ProxyState::new(family, NodeInfo::named("node1"));
    for (s, eps) in services {
        st.endpoints.insert(s.name.clone(), Arc::new(eps.clone()));
        st.services.insert(s.name.clone(), Arc::new(s.clone()));
    }
    st
}

/// One Service of every kind the renderer distinguishes.
pub fn every_kind(family: IpFamily) -> Vec<(ServicePort, Vec<Endpoint>)> {
    let v6 = family == IpFamily::V6;
    let (c, x) = if v6 {
        ("fd00:96::", "2001:db8::")
    } else {
        ("10.96.0.", "203.0.113.")
    };
    let e = |n: u8, local: bool| {
        let ip = if v6 {
            format!("[fd00:244::{n}]:8080")
        } else {
            format!("10.244.1.{n}:8080")
        };
        let ep = Endpoint::at(&ip);
        if local {
            ep.local()
        } else {
            ep
        }
    };
    let eps = || vec![e(5, true), e(6, false), e(7, false)];
    let ip = |s: &str| format!("{x}{s}");
    let range = if v6 {
        "2001:db8:1::/64"
    } else {
        "10.100.0.0/24"
    };
    let node_range = if v6 {
        "fd00:10::/64"
    } else {
        "192.168.10.0/24"
    };
    let svc = |name: &str, n: u8| service(name, &format!("{c}{n}"));
    vec![
        (svc("web", 1), eps()),
        (svc("np", 2).node_port(30080), eps()),
        (
            svc("lb", 3)
                .node_port(30081)
                .load_balancer_ips(&[&ip("20")])
                .source_ranges(&[range, node_range])
                .external_ips(&[&ip("10")]),
            eps(),
        ),
        (
            svc("etp", 4)
                .node_port(30082)
                .load_balancer_ips(&[&ip("21")])
                .local_external()
                .health_check_node_port(32100),
            eps(),
        ),
        (
            svc("etpnone", 9).node_port(30084).local_external(),
            vec![e(6, false)],
        ),
        (svc("itp", 5).local_internal(), eps()),
        (svc("itpnone", 10).local_internal(), vec![e(6, false)]),
        (svc("aff", 6).affinity(600).node_port(30085), eps()),
        (
            svc("none", 7)
                .node_port(30083)
                .external_ips(&[&ip("11")])
                .load_balancer_ips(&[&ip("22")]),
            vec![],
        ),
        (
            svc("dns", 11)
                .protocol(Protocol::Udp)
                .port(53)
                .node_port(30086),
            eps(),
        ),
        (
            svc("sctp", 12)
                .protocol(Protocol::Sctp)
                .port(9)
                .node_port(30087),
            eps(),
        ),
        (svc("sctpnone", 13).protocol(Protocol::Sctp).port(9), vec![]),
    ]
    .into_iter()
    .map(|(s, eps)| (s.build(), eps))
    .collect()
}
