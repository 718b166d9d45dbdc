//! Shared by the kernel tests: model state with one Service of every kind
//! the renderer distinguishes.
#![allow(dead_code)]

use std::sync::Arc;

use kp_model::testing::ServicePortBuilder;
use kp_model::{
    Endpoint, IpFamily, LocalDetector, NodeInfo, Protocol, ProxierConfig, ProxyState, ServicePort,
};

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

/// Every local-traffic detector and NodePort address setting.
pub fn configs(family: IpFamily) -> Vec<(&'static str, ProxierConfig)> {
    let v6 = family == IpFamily::V6;
    let mut out = Vec::new();
    let mut c = ProxierConfig::new(family);
    c.local_detector = LocalDetector::Cidrs(vec![
        "10.244.0.0/16".parse().unwrap(),
        "fd00:244::/48".parse().unwrap(),
    ]);
    c.localhost_nodeports = !v6;
    c.node_ips = vec![if v6 { "fd00:10::1" } else { "192.168.10.1" }
        .parse()
        .unwrap()];
    out.push(("cidr", c));
    let mut c = ProxierConfig::new(family);
    // A prefix that is not whole bytes: masked, not shortened.
    c.local_detector = LocalDetector::Cidrs(vec![
        "10.240.0.0/12".parse().unwrap(),
        "fd00:240::/29".parse().unwrap(),
    ]);
    c.nodeport_addresses = vec![
        if v6 {
            "fd00:10::/64"
        } else {
            "192.168.10.0/24"
        }
        .parse()
        .unwrap(),
        if v6 { "::1/128" } else { "127.0.0.0/8" }.parse().unwrap(),
    ];
    c.localhost_nodeports = !v6;
    out.push(("nodeport-cidrs", c));
    let mut c = ProxierConfig::new(family);
    c.local_detector = LocalDetector::BridgeInterface("cbr0".into());
    out.push(("bridge", c));
    let mut c = ProxierConfig::new(family);
    c.local_detector = LocalDetector::InterfaceNamePrefix("veth".into());
    out.push(("prefix", c));
    let mut c = ProxierConfig::new(family);
    c.masquerade_all = true;
    c.masquerade_bit = 9;
    out.push(("masq-all", c));
    out
}

/// What the node decides for each of [`configs`]: the INVALID drop with
/// its nfacct counter, and the localhost NodePort rules counting into
/// theirs (configs with localhost NodePorts); without a counter; and no
/// drop (be_liberal set).
pub fn host_rules(config: &str) -> kp_iptables::HostRules {
    match config {
        "cidr" | "nodeport-cidrs" => kp_iptables::HostRules {
            invalid_drop: true,
            nfacct: true,
        },
        "bridge" => kp_iptables::HostRules::default(),
        _ => kp_iptables::HostRules {
            invalid_drop: false,
            nfacct: false,
        },
    }
}

/// `rules` as the restore input's lines appending them to `chain`.
pub fn text(chain: &str, rules: &[kp_iptables::Rule]) -> Vec<String> {
    rules.iter().map(|r| format!("-A {chain} {r}")).collect()
}
