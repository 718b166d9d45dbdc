//! Address ownership (kp_model::claims): who gets an IP:port claimed twice,
//! whatever the order of updates and syncs.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Service;
use kp_model::{
    AddressKey, ChangeSet, ChangeTracker, IpFamily, Protocol, ProxyState, ServicePortName,
    TrackerConfig,
};
use serde_json::{json, Value};

fn tracker() -> ChangeTracker {
    ChangeTracker::new(TrackerConfig {
        family: IpFamily::V4,
        node_name: "node1".into(),
        service_proxy_name: None,
    })
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn spn(svc: &str) -> ServicePortName {
    ServicePortName::new("ns1", svc, "p", Protocol::Tcp)
}

/// Service `name` with one TCP port `port`, created at `created` (None: no
/// timestamp, as in a manifest).
fn service(
    name: &str,
    created: Option<&str>,
    cluster_ip: &str,
    port: u16,
    extra: Value,
) -> Service {
    let mut spec = json!({"clusterIP": cluster_ip, "ports": [{"name": "p", "port": port}]});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        spec[k] = v;
    }
    let mut meta = json!({"namespace": "ns1", "name": name});
    if let Some(c) = created {
        meta["creationTimestamp"] = json!(c);
    }
    serde_json::from_value(json!({"metadata": meta, "spec": spec})).unwrap()
}

fn apply(t: &mut ChangeTracker, svcs: &[&Service]) -> ChangeSet {
    for s in svcs {
        t.update_service(s, SystemTime::now()).unwrap();
    }
    t.take_changes()
}

fn external_ips(st: &ProxyState, svc: &str) -> Vec<IpAddr> {
    st.services
        .get(&spn(svc))
        .map(|p| p.external_ips.clone())
        .unwrap_or_default()
}

/// B declares A's ClusterIP:port as an externalIP: A keeps it, in either
/// order of arrival and of syncs, and B answers on the rest.
#[test]
fn cluster_ip_beats_an_external_ip_in_any_order() {
    // B is older than A: age must not beat the ClusterIP rule.
    let a = service(
        "a",
        Some("2025-01-01T00:00:00Z"),
        "10.96.0.1",
        80,
        json!({}),
    );
    let b = service(
        "b",
        Some("2020-01-01T00:00:00Z"),
        "10.96.0.2",
        80,
        json!({"externalIPs": ["10.96.0.1", "203.0.113.5"]}),
    );
    for order in [[&a, &b], [&b, &a]] {
        // All at once, and one per sync.
        let mut together = tracker();
        apply(&mut together, &order);
        let mut apart = tracker();
        apply(&mut apart, &[order[0]]);
        let cs = apply(&mut apart, &[order[1]]);
        for t in [&together, &apart] {
            let st = t.state();
            assert_eq!(st.services[&spn("a")].cluster_ip, ip("10.96.0.1"));
            assert_eq!(external_ips(st, "b"), vec![ip("203.0.113.5")]);
        }
        assert_eq!(cs.refused.len(), 1, "{:?}", cs.refused);
        assert_eq!(cs.refused[0].service, spn("b"));
        assert_eq!(cs.refused[0].holder, Some(spn("a")));
        assert_eq!(
            cs.refused[0].address,
            AddressKey::Ip(ip("10.96.0.1"), Protocol::Tcp, 80)
        );
    }
}

/// When the owner goes, the next claimant gets the address in the same
/// sync (not at the next full rebuild).
#[test]
fn deleting_the_owner_hands_the_address_over_at_once() {
    let a = service("a", None, "10.96.0.1", 80, json!({}));
    let b = service(
        "b",
        None,
        "10.96.0.2",
        80,
        json!({"externalIPs": ["10.96.0.1"]}),
    );
    let mut t = tracker();
    apply(&mut t, &[&a, &b]);
    assert!(external_ips(t.state(), "b").is_empty());
    t.delete_service("ns1", "a", SystemTime::now());
    let cs = t.take_changes();
    assert!(cs.changed.contains(&spn("b")), "{:?}", cs.changed);
    assert_eq!(external_ips(t.state(), "b"), vec![ip("10.96.0.1")]);
    // And back when A returns.
    let cs = apply(&mut t, &[&a]);
    assert!(cs.changed.contains(&spn("b")));
    assert!(external_ips(t.state(), "b").is_empty());
}

/// Two externalIP claims: the older Service wins, then the name; never the
/// first to arrive.
#[test]
fn oldest_then_name_wins_between_external_ips() {
    let shared = json!({"externalIPs": ["203.0.113.5"]});
    let young = service(
        "a-young",
        Some("2025-01-01T00:00:00Z"),
        "10.96.0.1",
        80,
        shared.clone(),
    );
    let old = service(
        "z-old",
        Some("2021-01-01T00:00:00Z"),
        "10.96.0.2",
        80,
        shared.clone(),
    );
    let untimed = service("b-untimed", None, "10.96.0.3", 80, shared.clone());
    for order in [
        [&young, &old, &untimed],
        [&untimed, &young, &old],
        [&old, &untimed, &young],
    ] {
        let mut t = tracker();
        for s in order {
            apply(&mut t, &[s]);
        }
        let st = t.state();
        let owners: Vec<&str> = ["a-young", "z-old", "b-untimed"]
            .into_iter()
            .filter(|s| !external_ips(st, s).is_empty())
            .collect();
        assert_eq!(owners, vec!["z-old"]);
        // The oldest leaves: the next by age (an unknown time counts as newest).
        t.delete_service("ns1", "z-old", SystemTime::now());
        t.take_changes();
        assert_eq!(external_ips(t.state(), "a-young"), vec![ip("203.0.113.5")]);
        assert!(external_ips(t.state(), "b-untimed").is_empty());
    }
    // Same time: the name decides.
    let x = service("x", None, "10.96.0.1", 80, shared.clone());
    let y = service("y", None, "10.96.0.2", 80, shared);
    for order in [[&x, &y], [&y, &x]] {
        let mut t = tracker();
        apply(&mut t, &[order[0]]);
        apply(&mut t, &[order[1]]);
        assert_eq!(external_ips(t.state(), "x"), vec![ip("203.0.113.5")]);
        assert!(external_ips(t.state(), "y").is_empty());
    }
}

/// A LoadBalancer ingress IP follows the same rule as an externalIP.
#[test]
fn load_balancer_ip_on_a_cluster_ip_is_refused() {
    let a = service("a", None, "10.96.0.1", 80, json!({}));
    let mut b: Service = service("b", None, "10.96.0.2", 80, json!({"type": "LoadBalancer"}));
    b.status = Some(
        serde_json::from_value(json!({"loadBalancer": {"ingress": [{"ip": "10.96.0.1"}]}}))
            .unwrap(),
    );
    let mut t = tracker();
    apply(&mut t, &[&b]);
    assert_eq!(
        t.state().services[&spn("b")].load_balancer_ips,
        vec![ip("10.96.0.1")]
    );
    let cs = apply(&mut t, &[&a]);
    assert!(t.state().services[&spn("b")].load_balancer_ips.is_empty());
    assert!(cs.changed.contains(&spn("b")));
    assert_eq!(t.state().services[&spn("a")].cluster_ip, ip("10.96.0.1"));
}

/// Two Services with one ClusterIP:port (an API server never allows it; a
/// manifest can): the older one is programmed, the other not at all until
/// the address is free.
#[test]
fn duplicate_cluster_ip_goes_to_the_oldest() {
    let a = service(
        "a",
        Some("2024-01-01T00:00:00Z"),
        "10.96.0.1",
        80,
        json!({}),
    );
    let b = service(
        "b",
        Some("2023-01-01T00:00:00Z"),
        "10.96.0.1",
        80,
        json!({}),
    );
    for order in [[&a, &b], [&b, &a]] {
        let mut t = tracker();
        apply(&mut t, &[order[0]]);
        apply(&mut t, &[order[1]]);
        let names: Vec<&ServicePortName> = t.state().services.keys().collect();
        assert_eq!(names, vec![&spn("b")]);
        t.delete_service("ns1", "b", SystemTime::now());
        let cs = t.take_changes();
        assert!(cs.changed.contains(&spn("a")));
        assert!(t.state().services.contains_key(&spn("a")));
    }
}

#[test]
fn duplicate_node_port_goes_to_the_oldest() {
    let np = |port: u16| json!({"type": "NodePort", "ports": [{"name": "p", "port": 80, "nodePort": port}]});
    let a = service(
        "a",
        Some("2024-01-01T00:00:00Z"),
        "10.96.0.1",
        80,
        np(30080),
    );
    let b = service(
        "b",
        Some("2023-01-01T00:00:00Z"),
        "10.96.0.2",
        80,
        np(30080),
    );
    let mut t = tracker();
    apply(&mut t, &[&a]);
    assert_eq!(t.state().services[&spn("a")].node_port, 30080);
    let cs = apply(&mut t, &[&b]);
    assert_eq!(t.state().services[&spn("a")].node_port, 0);
    assert_eq!(t.state().services[&spn("b")].node_port, 30080);
    assert!(cs.changed.contains(&spn("a")) && cs.changed.contains(&spn("b")));
}

/// A host process's address (the node's SSH) is never given to a Service;
/// when the process goes, the claim is granted.
#[test]
fn host_listeners_keep_their_address() {
    let b = service(
        "b",
        Some("2020-01-01T00:00:00Z"),
        "10.96.0.2",
        22,
        json!({"externalIPs": ["192.168.1.10"]}),
    );
    let ssh = AddressKey::Ip(ip("192.168.1.10"), Protocol::Tcp, 22);
    let mut t = tracker();
    apply(&mut t, &[&b]);
    assert_eq!(
        t.claimed_external_ips(),
        BTreeSet::from([ip("192.168.1.10")])
    );
    assert_eq!(external_ips(t.state(), "b"), vec![ip("192.168.1.10")]);
    t.set_host_reserved(BTreeSet::from([ssh]));
    let cs = t.take_changes();
    assert!(external_ips(t.state(), "b").is_empty());
    assert!(cs.changed.contains(&spn("b")));
    assert_eq!(cs.refused.len(), 1);
    assert_eq!(cs.refused[0].holder, None);
    assert!(
        cs.refused[0].to_string().contains("listens"),
        "{}",
        cs.refused[0]
    );
    // Reported once, not at every recomputation.
    t.update_service(
        &service(
            "b",
            Some("2020-01-01T00:00:00Z"),
            "10.96.0.2",
            22,
            json!({"externalIPs": ["192.168.1.10", "203.0.113.1"]}),
        ),
        SystemTime::now(),
    )
    .unwrap();
    assert!(t.take_changes().refused.is_empty());
    // Refused from the start too (a restart).
    let mut t2 = tracker();
    t2.set_host_reserved(BTreeSet::from([ssh]));
    let cs = apply(&mut t2, &[&b]);
    assert!(external_ips(t2.state(), "b").is_empty());
    assert_eq!(cs.refused.len(), 1);
    // The listener goes away.
    t.set_host_reserved(BTreeSet::new());
    t.take_changes();
    assert!(external_ips(t.state(), "b").contains(&ip("192.168.1.10")));
}

/// Services `a` and `b` (same age: `a` wins by name), both with externalIP
/// 203.0.113.5 on port 80.
fn both_claim_203_0_113_5() -> (Service, Service) {
    let ext = json!({"externalIPs": ["203.0.113.5"]});
    (
        service("a", None, "10.96.0.1", 80, ext.clone()),
        service("b", None, "10.96.0.2", 80, ext),
    )
}

/// Service `svc`'s slice `svc-1`: one ready endpoint `ip`, port `p` 8080.
fn one_endpoint(svc: &str, ip: &str) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    serde_json::from_value(json!({
        "metadata": {"namespace": "ns1", "name": format!("{svc}-1"),
                     "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": true}}],
        "ports": [{"name": "p", "port": 8080, "protocol": "TCP"}]
    }))
    .unwrap()
}

/// The owner's endpoints changing moves nothing: the other claimant stays
/// refused (and is not reported again), and a later change of the owner's
/// addresses still hands the address over in the same sync.
#[test]
fn an_owners_endpoint_change_keeps_every_claim_where_it_was() {
    let (a, b) = both_claim_203_0_113_5();
    let mut t = tracker();
    let cs = apply(&mut t, &[&a, &b]);
    assert_eq!(cs.refused.len(), 1, "{:?}", cs.refused);
    for ep in ["10.1.0.1", "10.1.0.2"] {
        t.update_endpoint_slice(&one_endpoint("a", ep), SystemTime::now())
            .unwrap();
        let cs = t.take_changes();
        assert_eq!(cs.changed, BTreeSet::from([spn("a")]));
        assert!(cs.refused.is_empty(), "{:?}", cs.refused);
        assert_eq!(external_ips(t.state(), "a"), vec![ip("203.0.113.5")]);
        assert!(external_ips(t.state(), "b").is_empty());
        assert_eq!(t.state().endpoints[&spn("a")][0].ip, ip(ep));
    }
    let a2 = service("a", None, "10.96.0.1", 80, json!({}));
    let cs = apply(&mut t, &[&a2]);
    assert!(cs.changed.contains(&spn("b")), "{:?}", cs.changed);
    assert_eq!(external_ips(t.state(), "b"), vec![ip("203.0.113.5")]);
}

/// The loser's endpoints change in the batch that deletes the owner: the
/// loser is worked out again from its object (not kept as it was because
/// only its endpoints changed) and takes the address in that sync.
#[test]
fn a_losers_endpoint_change_with_the_owners_deletion_hands_the_address_over() {
    let (a, b) = both_claim_203_0_113_5();
    let mut t = tracker();
    apply(&mut t, &[&a, &b]);
    assert!(external_ips(t.state(), "b").is_empty());
    t.update_endpoint_slice(&one_endpoint("b", "10.1.0.7"), SystemTime::now())
        .unwrap();
    t.delete_service("ns1", "a", SystemTime::now());
    let cs = t.take_changes();
    assert!(cs.changed.contains(&spn("b")), "{:?}", cs.changed);
    assert_eq!(external_ips(t.state(), "b"), vec![ip("203.0.113.5")]);
    assert_eq!(t.state().endpoints[&spn("b")][0].ip, ip("10.1.0.7"));
}
