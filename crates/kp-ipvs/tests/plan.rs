//! The plan (model -> IPVS/ipset/address operations) for every kind of
//! Service, and the diff between two plans. Pure: no kernel.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::net::IpAddr;
use std::sync::Arc;

use kp_ipvs::{diff, plan, IpvsConfig, Layout, Op};
use kp_model::testing::ServicePortBuilder;
use kp_model::{
    Endpoint, IpFamily, LocalDetector, NodeInfo, Protocol, ProxierConfig, ProxyState, ServicePort,
};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn sp(name: &str, cip: &str) -> ServicePortBuilder {
    ServicePort::builder("default", name)
        .port_name("http")
        .cluster_ip(cip)
}

fn ep(addr: &str, local: bool) -> Endpoint {
    Endpoint::ready(ip(addr), 8080, local)
}

fn cfg(family: IpFamily) -> IpvsConfig {
    let mut c = ProxierConfig::new(family);
    c.local_detector = LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().unwrap()]);
    IpvsConfig::new(c)
}

fn state(family: IpFamily, svcs: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
    let mut st = ProxyState::new(family, NodeInfo::named("node1"));
    for (s, eps) in svcs {
        st.endpoints.insert(s.name.clone(), Arc::new(eps));
        st.services.insert(s.name.clone(), Arc::new(s));
    }
    st
}

const NODE_IPS: &[&str] = &["10.100.0.11", "fd00:100::11"];

/// Operations from an empty kernel, as text, without the empty-set noise.
fn ops_from_empty(st: &ProxyState, c: &IpvsConfig) -> Vec<String> {
    let ips: Vec<IpAddr> = NODE_IPS.iter().map(|s| ip(s)).collect();
    let want = plan(st, c, &ips);
    diff(&Layout::default(), &want, &|_| false)
        .iter()
        .map(|o| o.to_string())
        .collect()
}

#[test]
fn clusterip_service() {
    let st = state(
        IpFamily::V4,
        vec![(
            sp("web", "10.96.0.10").build(),
            vec![ep("10.244.1.2", true), ep("10.244.2.3", false)],
        )],
    );
    assert_eq!(
        ops_from_empty(&st, &cfg(IpFamily::V4)),
        vec![
            "add-service tcp 10.96.0.10:80 rr",
            "add-dest tcp 10.96.0.10:80 -> 10.244.1.2:8080 weight 1",
            "add-dest tcp 10.96.0.10:80 -> 10.244.2.3:8080 weight 1",
            "ipset add KUBE-CLUSTER-IP 10.96.0.10,tcp:80",
            "ipset add KUBE-IPVS-IPS 10.96.0.10",
            "ipset add KUBE-LOOP-BACK 10.244.1.2,tcp:8080,10.244.1.2",
            "bind 10.96.0.10",
        ]
    );
}

#[test]
fn nodeport_service_on_each_node_address() {
    let s = sp("np", "10.96.0.20").node_port(30080).build();
    let st = state(IpFamily::V4, vec![(s, vec![ep("10.244.2.3", false)])]);
    let ops = ops_from_empty(&st, &cfg(IpFamily::V4));
    assert_eq!(
        ops,
        vec![
            "add-service tcp 10.96.0.20:80 rr",
            "add-service tcp 10.100.0.11:30080 rr",
            "add-dest tcp 10.96.0.20:80 -> 10.244.2.3:8080 weight 1",
            "add-dest tcp 10.100.0.11:30080 -> 10.244.2.3:8080 weight 1",
            "ipset add KUBE-CLUSTER-IP 10.96.0.20,tcp:80",
            "ipset add KUBE-IPVS-IPS 10.96.0.20",
            "ipset add KUBE-NODE-PORT-TCP 30080",
            "bind 10.96.0.20",
        ]
    );
    // --nodeport-addresses outside every node address: no NodePort servers.
    let mut c = cfg(IpFamily::V4);
    c.proxier.nodeport_addresses = vec!["192.168.0.0/16".parse().unwrap()];
    let ops = ops_from_empty(&st, &c);
    assert!(!ops.iter().any(|o| o.contains(":30080 ")), "{ops:#?}");
}

#[test]
fn loadbalancer_with_source_ranges_and_local_policy() {
    let s = sp("lb", "10.96.0.30")
        .node_port(30081)
        .load_balancer_ips(&["203.0.113.20"])
        .source_ranges(&["10.100.0.100/32"])
        .local_external()
        .health_check_node_port(32100)
        .build();
    let st = state(
        IpFamily::V4,
        vec![(s, vec![ep("10.244.1.2", true), ep("10.244.2.3", false)])],
    );
    let ops = ops_from_empty(&st, &cfg(IpFamily::V4));
    assert_eq!(
        ops,
        vec![
            "add-service tcp 10.96.0.30:80 rr",
            "add-service tcp 10.100.0.11:30081 rr",
            "add-service tcp 203.0.113.20:80 rr",
            // Cluster traffic uses every endpoint, external only the local one.
            "add-dest tcp 10.96.0.30:80 -> 10.244.1.2:8080 weight 1",
            "add-dest tcp 10.96.0.30:80 -> 10.244.2.3:8080 weight 1",
            "add-dest tcp 10.100.0.11:30081 -> 10.244.1.2:8080 weight 1",
            "add-dest tcp 203.0.113.20:80 -> 10.244.1.2:8080 weight 1",
            "ipset add KUBE-CLUSTER-IP 10.96.0.30,tcp:80",
            "ipset add KUBE-HEALTH-CHECK-NODE-PORT 32100",
            "ipset add KUBE-IPVS-IPS 10.96.0.30",
            "ipset add KUBE-IPVS-IPS 203.0.113.20",
            "ipset add KUBE-LOAD-BALANCER 203.0.113.20,tcp:80",
            "ipset add KUBE-LOAD-BALANCER-FW 203.0.113.20,tcp:80",
            "ipset add KUBE-LOAD-BALANCER-LOCAL 203.0.113.20,tcp:80",
            "ipset add KUBE-LOAD-BALANCER-SOURCE-CIDR 203.0.113.20,tcp:80,10.100.0.100",
            "ipset add KUBE-LOOP-BACK 10.244.1.2,tcp:8080,10.244.1.2",
            "ipset add KUBE-NODE-PORT-LOCAL-TCP 30081",
            "ipset add KUBE-NODE-PORT-TCP 30081",
            "bind 10.96.0.30",
            "bind 203.0.113.20",
        ]
    );
}

#[test]
fn external_ips_by_policy() {
    let s = sp("ext", "10.96.0.40")
        .external_ips(&["203.0.113.10"])
        .build();
    let l = sp("extl", "10.96.0.41")
        .external_ips(&["203.0.113.11"])
        .local_external()
        .build();
    let st = state(
        IpFamily::V4,
        vec![
            (s, vec![ep("10.244.2.3", false)]),
            (l, vec![ep("10.244.2.3", false)]),
        ],
    );
    let ops = ops_from_empty(&st, &cfg(IpFamily::V4));
    assert!(ops.contains(&"ipset add KUBE-EXTERNAL-IP 203.0.113.10,tcp:80".to_string()));
    assert!(ops.contains(&"ipset add KUBE-EXTERNAL-IP-LOCAL 203.0.113.11,tcp:80".to_string()));
    assert!(ops.contains(&"bind 203.0.113.10".to_string()));
    assert!(ops.contains(&"add-dest tcp 203.0.113.10:80 -> 10.244.2.3:8080 weight 1".to_string()));
    // Local policy and no local endpoint: the virtual server has no real server.
    assert!(ops.contains(&"add-service tcp 203.0.113.11:80 rr".to_string()));
    assert!(
        !ops.iter()
            .any(|o| o.starts_with("add-dest tcp 203.0.113.11:80")),
        "{ops:#?}"
    );
}

#[test]
fn session_affinity_is_persistence_and_scheduler_is_configurable() {
    let s = sp("aff", "10.96.0.50").affinity(600).build();
    let st = state(IpFamily::V4, vec![(s, vec![ep("10.244.1.2", true)])]);
    let mut c = cfg(IpFamily::V4);
    c.scheduler = "wlc".into();
    let ops = ops_from_empty(&st, &c);
    assert_eq!(ops[0], "add-service tcp 10.96.0.50:80 wlc persistent 600");
    c.scheduler = "bogus".into();
    assert!(c.validate().unwrap_err().to_string().contains("bogus"));
    c.scheduler = String::new();
    c.validate().unwrap();
    assert_eq!(c.scheduler, "rr");
}

#[test]
fn internal_policy_local_and_no_endpoints() {
    let s = sp("itp", "10.96.0.60").local_internal().build();
    let st = state(
        IpFamily::V4,
        vec![
            (s, vec![ep("10.244.1.2", true), ep("10.244.2.3", false)]),
            (sp("empty", "10.96.0.61").build(), vec![]),
        ],
    );
    let ops = ops_from_empty(&st, &cfg(IpFamily::V4));
    assert!(ops.contains(&"add-dest tcp 10.96.0.60:80 -> 10.244.1.2:8080 weight 1".to_string()));
    assert!(!ops.iter().any(|o| o.contains("10.244.2.3")), "{ops:#?}");
    // No endpoints: the virtual server exists (IPVS answers with ICMP
    // unreachable) and its IP is bound.
    assert!(ops.contains(&"add-service tcp 10.96.0.61:80 rr".to_string()));
    assert!(ops.contains(&"bind 10.96.0.61".to_string()));
}

#[test]
fn udp_sctp_and_ipv6() {
    let u = sp("dns", "fd00:96::10")
        .port_name("dns")
        .protocol(Protocol::Udp)
        .port(53)
        .node_port(30053)
        .build();
    let sc = sp("sctp", "fd00:96::11")
        .protocol(Protocol::Sctp)
        .node_port(30132)
        .build();
    let st = state(
        IpFamily::V6,
        vec![(u, vec![ep("fd00:244:1::2", true)]), (sc, vec![])],
    );
    let ops = ops_from_empty(&st, &cfg(IpFamily::V6));
    for want in [
        "add-service udp [fd00:96::10]:53 rr",
        "add-service udp [fd00:100::11]:30053 rr",
        "add-dest udp [fd00:96::10]:53 -> [fd00:244:1::2]:8080 weight 1",
        "ipset add KUBE-6-CLUSTER-IP fd00:96::10,udp:53",
        "ipset add KUBE-6-NODE-PORT-UDP 30053",
        "ipset add KUBE-6-NODE-PORT-SCTP-HASH fd00:100::11,sctp:30132",
        "add-service sctp [fd00:96::11]:80 rr",
        "bind fd00:96::10",
    ] {
        assert!(ops.contains(&want.to_string()), "missing {want}: {ops:#?}");
    }
    assert!(!ops.iter().any(|o| o.contains("10.100.0.11")), "{ops:#?}");
}

#[test]
fn terminating_endpoints_are_a_fallback() {
    let term = |a: &str| ep(a, true).serving_terminating();
    let st = state(
        IpFamily::V4,
        vec![(
            sp("t", "10.96.0.90").build(),
            vec![term("10.244.1.2"), ep("10.244.2.3", false)],
        )],
    );
    let ops = ops_from_empty(&st, &cfg(IpFamily::V4));
    assert!(!ops.iter().any(|o| o.contains("-> 10.244.1.2")), "{ops:#?}");
    let st = state(
        IpFamily::V4,
        vec![(sp("t", "10.96.0.90").build(), vec![term("10.244.1.2")])],
    );
    let ops = ops_from_empty(&st, &cfg(IpFamily::V4));
    assert!(ops.contains(&"add-dest tcp 10.96.0.90:80 -> 10.244.1.2:8080 weight 1".to_string()));
}

#[test]
fn diff_touches_only_what_changed_and_drains_tcp() {
    let c = cfg(IpFamily::V4);
    let ips = vec![ip("10.100.0.11")];
    let dns = sp("dns", "10.96.0.11")
        .port_name("dns")
        .protocol(Protocol::Udp)
        .port(53)
        .build();
    let before = plan(
        &state(
            IpFamily::V4,
            vec![
                (
                    sp("web", "10.96.0.10").build(),
                    vec![ep("10.244.1.2", true), ep("10.244.2.3", false)],
                ),
                (dns.clone(), vec![ep("10.244.1.2", true)]),
                (
                    sp("gone", "10.96.0.12").build(),
                    vec![ep("10.244.1.5", true)],
                ),
            ],
        ),
        &c,
        &ips,
    );
    let after = plan(
        &state(
            IpFamily::V4,
            vec![
                (
                    sp("web", "10.96.0.10").build(),
                    vec![ep("10.244.2.3", false), ep("10.244.2.4", false)],
                ),
                (dns, vec![ep("10.244.2.9", false)]),
            ],
        ),
        &c,
        &ips,
    );
    let ops: Vec<String> = diff(&before, &after, &|_| false)
        .iter()
        .map(|o| o.to_string())
        .collect();
    assert_eq!(
        ops,
        vec![
            "add-dest tcp 10.96.0.10:80 -> 10.244.2.4:8080 weight 1",
            // TCP: drained, deleted later when its connections are gone.
            "set-weight tcp 10.96.0.10:80 -> 10.244.1.2:8080 weight 0",
            "add-dest udp 10.96.0.11:53 -> 10.244.2.9:8080 weight 1",
            "unbind 10.96.0.12",
            "ipset del KUBE-CLUSTER-IP 10.96.0.12,tcp:80",
            "ipset del KUBE-IPVS-IPS 10.96.0.12",
            "ipset del KUBE-LOOP-BACK 10.244.1.2,tcp:8080,10.244.1.2",
            "ipset del KUBE-LOOP-BACK 10.244.1.2,udp:8080,10.244.1.2",
            "ipset del KUBE-LOOP-BACK 10.244.1.5,tcp:8080,10.244.1.5",
            // UDP: no connection end to wait for.
            "del-dest udp 10.96.0.11:53 -> 10.244.1.2:8080",
            "del-service tcp 10.96.0.12:80",
        ]
    );
    // A drained real server stays drained; nothing to do on the next sync.
    let mut drained = before.clone();
    kp_ipvs::apply_to(&mut drained, &diff(&before, &after, &|_| false), &after);
    assert!(diff(&drained, &after, &|_| false).is_empty());
    // Excluded virtual servers (--ipvs-exclude-cidrs) are never deleted.
    let keep = |k: &kp_ipvs::VsKey| k.addr == ip("10.96.0.12");
    assert!(!diff(&before, &after, &keep)
        .iter()
        .any(|o| matches!(o, Op::DelService(_))));
}

#[test]
fn dry_run_render_has_every_part() {
    use kp_model::Dataplane;
    let s = sp("web", "10.96.0.10").affinity(10800).build();
    let st = state(IpFamily::V4, vec![(s, vec![ep("10.244.1.2", true)])]);
    let p = kp_ipvs::IpvsProxier::new(cfg(IpFamily::V4));
    let out = p.render(&st);
    for want in [
        "-A -t 10.96.0.10:80 -s rr -p 10800  # default/web:http",
        "-a -t 10.96.0.10:80 -r 10.244.1.2:8080 -m -w 1",
        "10.96.0.10/32",
        "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536 comment",
        "add KUBE-CLUSTER-IP 10.96.0.10,tcp:80 comment \"default/web:http\"",
        "-A KUBE-SERVICES ! -s 10.244.0.0/16 -m comment",
        "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
        "# -t nat -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
}
