//! ChangeTracker against upstream's ServiceChangeTracker / EndpointsChangeTracker /
//! EndpointSliceCache (pkg/proxy/servicechangetracker.go, endpointschangetracker.go,
//! endpointslicecache.go) and the stale-UDP-conntrack rules of the proxiers.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_model::{
    parse_rfc3339, ChangeSet, ChangeTracker, IpFamily, Protocol, ServicePortName, StaleConntrack,
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

fn t(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn service(name: &str, spec: Value) -> Service {
    serde_json::from_value(json!({
        "metadata": {"namespace": "ns1", "name": name},
        "spec": spec,
    }))
    .unwrap()
}

/// ClusterIP Service `name` with one TCP port p80.
fn simple_service(name: &str, cluster_ip: &str) -> Service {
    service(
        name,
        json!({"clusterIP": cluster_ip, "ports": [{"name": "p80", "port": 80}]}),
    )
}

fn spn(svc: &str, port: &str, proto: Protocol) -> ServicePortName {
    ServicePortName::new("ns1", svc, port, proto)
}

/// Slice `slice_name` of Service `svc`: endpoints as (ip, nodeName, ready), one port.
fn slice(
    svc: &str,
    slice_name: &str,
    port: (&str, i32, &str),
    endpoints: &[(&str, &str, bool)],
) -> EndpointSlice {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|(ip, node, ready)| {
            json!({"addresses": [ip], "nodeName": node, "conditions": {"ready": ready}})
        })
        .collect();
    serde_json::from_value(json!({
        "metadata": {"namespace": "ns1", "name": slice_name,
                     "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "endpoints": eps,
        "ports": [{"name": port.0, "port": port.1, "protocol": port.2}],
    }))
    .unwrap()
}

fn eps_of(tr: &ChangeTracker, name: &ServicePortName) -> Vec<String> {
    tr.state()
        .endpoints_of(name)
        .iter()
        .map(|e| e.addr_string())
        .collect()
}

fn changed(cs: &ChangeSet) -> Vec<String> {
    cs.changed.iter().map(|n| n.key()).collect()
}

#[test]
fn many_updates_collapse_into_one_change_set() {
    let mut tr = tracker();
    let v1 = simple_service("svc1", "172.30.0.41");
    let v2 = service(
        "svc1",
        json!({"clusterIP": "172.30.0.41",
               "ports": [{"name": "p80", "port": 80}, {"name": "p443", "port": 443}]}),
    );
    let v3 = service(
        "svc1",
        json!({"clusterIP": "172.30.0.41", "ports": [{"name": "p8080", "port": 8080}]}),
    );
    tr.update_service(&v1, t(1)).unwrap();
    tr.update_service(&v2, t(2)).unwrap();
    tr.update_service(&v3, t(3)).unwrap();
    assert_eq!(tr.pending(), 1);
    // Nothing reaches the state before the sync takes it.
    assert!(tr.state().services.is_empty());
    let cs = tr.take_changes();
    // Only the final version exists; the intermediate ports were never programmed.
    assert_eq!(changed(&cs), vec!["ns1/svc1:p8080/TCP"]);
    assert_eq!(cs.service_changes, 3);
    assert_eq!(cs.endpoint_changes, 0);
    assert_eq!(cs.trigger_times, vec![t(1), t(2), t(3)]);
    let names: Vec<_> = tr.state().services.keys().cloned().collect();
    assert_eq!(names, vec![spn("svc1", "p8080", Protocol::Tcp)]);
    assert_eq!(tr.state().services[&names[0]].port, 8080);
    // The next sync has nothing.
    let cs = tr.take_changes();
    assert!(cs.changed.is_empty() && cs.trigger_times.is_empty());
    assert_eq!((cs.service_changes, cs.endpoint_changes), (0, 0));

    // Added and deleted between two syncs: nothing to program.
    tr.update_service(&simple_service("svc2", "172.30.0.42"), t(4))
        .unwrap();
    tr.delete_service("ns1", "svc2", t(5));
    let cs = tr.take_changes();
    assert!(cs.changed.is_empty(), "{:?}", cs.changed);
    assert!(!tr
        .state()
        .services
        .contains_key(&spn("svc2", "p80", Protocol::Tcp)));
}

#[test]
fn no_op_update_produces_no_change() {
    let mut tr = tracker();
    let s = simple_service("svc1", "172.30.0.41");
    tr.update_service(&s, t(1)).unwrap();
    tr.take_changes();
    // Same spec, new resourceVersion and annotations: nothing the proxy uses.
    let mut s2 = s.clone();
    s2.metadata.resource_version = Some("42".into());
    s2.metadata.annotations = Some([("a".to_string(), "b".to_string())].into());
    tr.update_service(&s2, t(2)).unwrap();
    assert_eq!(tr.pending(), 0);
    let cs = tr.take_changes();
    assert!(cs.changed.is_empty());
    assert_eq!(cs.service_changes, 0);
    assert!(cs.trigger_times.is_empty());

    // Same for an identical slice.
    let sl = slice(
        "svc1",
        "svc1-a",
        ("p80", 8080, "TCP"),
        &[("10.0.0.1", "node2", true)],
    );
    tr.update_endpoint_slice(&sl, t(3)).unwrap();
    assert_eq!(tr.take_changes().endpoint_changes, 1);
    tr.update_endpoint_slice(&sl, t(4)).unwrap();
    let cs = tr.take_changes();
    assert!(cs.changed.is_empty());
    assert_eq!(cs.endpoint_changes, 0);
}

#[test]
fn deleting_a_service_reports_its_ports_and_removes_state() {
    let mut tr = tracker();
    let s = service(
        "svc1",
        json!({"clusterIP": "172.30.0.41",
               "ports": [{"name": "p80", "port": 80}, {"name": "dns", "port": 53, "protocol": "UDP"}]}),
    );
    tr.update_service(&s, t(1)).unwrap();
    tr.update_endpoint_slice(
        &slice(
            "svc1",
            "svc1-a",
            ("p80", 8080, "TCP"),
            &[("10.0.0.1", "node2", true)],
        ),
        t(1),
    )
    .unwrap();
    tr.take_changes();
    let p80 = spn("svc1", "p80", Protocol::Tcp);
    assert_eq!(eps_of(&tr, &p80), vec!["10.0.0.1:8080"]);

    tr.delete_service("ns1", "svc1", t(2));
    let cs = tr.take_changes();
    assert_eq!(changed(&cs), vec!["ns1/svc1:dns/UDP", "ns1/svc1:p80/TCP"]);
    assert_eq!(cs.service_changes, 1);
    assert_eq!(cs.trigger_times, vec![t(2)]);
    assert!(tr.state().services.is_empty());
    assert!(tr.state().endpoints.is_empty());
    // Deleting what is not there is not a change.
    tr.delete_service("ns1", "svc1", t(3));
    tr.delete_service("ns1", "never", t(3));
    assert_eq!(tr.take_changes().service_changes, 0);

    // The slices are still known: the Service coming back gets them at once.
    tr.update_service(&s, t(4)).unwrap();
    tr.take_changes();
    assert_eq!(eps_of(&tr, &p80), vec!["10.0.0.1:8080"]);
}

#[test]
fn removing_one_port_of_a_service() {
    let mut tr = tracker();
    let two = service(
        "svc1",
        json!({"clusterIP": "172.30.0.41",
               "ports": [{"name": "p80", "port": 80}, {"name": "p443", "port": 443}]}),
    );
    tr.update_service(&two, t(1)).unwrap();
    tr.take_changes();
    tr.update_service(&simple_service("svc1", "172.30.0.41"), t(2))
        .unwrap();
    let cs = tr.take_changes();
    assert_eq!(changed(&cs), vec!["ns1/svc1:p443/TCP"]);
    assert_eq!(tr.state().services.len(), 1);
}

#[test]
fn slices_of_one_service_merge_and_deduplicate() {
    let mut tr = tracker();
    tr.update_service(&simple_service("svc1", "172.30.0.41"), t(0))
        .unwrap();
    let a = slice(
        "svc1",
        "svc1-a",
        ("p80", 8080, "TCP"),
        &[("10.0.0.1", "node2", true), ("10.0.0.2", "node2", true)],
    );
    // 10.0.0.2 also in slice b, reported on our node: the local copy wins.
    let b = slice(
        "svc1",
        "svc1-b",
        ("p80", 8080, "TCP"),
        &[("10.0.0.2", "node1", true), ("10.0.0.3", "node3", true)],
    );
    tr.update_endpoint_slice(&a, t(1)).unwrap();
    tr.update_endpoint_slice(&b, t(2)).unwrap();
    let cs = tr.take_changes();
    assert_eq!(cs.endpoint_changes, 2);
    let p80 = spn("svc1", "p80", Protocol::Tcp);
    let eps = tr.state().endpoints_of(&p80);
    let mut addrs: Vec<String> = eps.iter().map(|e| e.addr_string()).collect();
    addrs.sort();
    assert_eq!(
        addrs,
        vec!["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"]
    );
    let dup = eps.iter().find(|e| e.ip == ip("10.0.0.2")).unwrap();
    assert!(dup.is_local);
    assert_eq!(dup.node_name(), Some("node1"));

    // Same port number under another port name is another service port.
    let c = slice(
        "svc1",
        "svc1-c",
        ("other", 8080, "TCP"),
        &[("10.0.0.9", "node2", true)],
    );
    tr.update_endpoint_slice(&c, t(3)).unwrap();
    tr.take_changes();
    assert_eq!(tr.state().endpoints_of(&p80).len(), 3);
}

#[test]
fn duplicate_endpoint_prefers_the_non_terminating_copy() {
    // Upstream (endpointslicecache.go addEndpoints): a pod IP reused while the old
    // pod terminates appears twice; the running pod wins whatever the slice order.
    for (term_slice, ready_slice) in [("svc1-a", "svc1-b"), ("svc1-b", "svc1-a")] {
        let mut tr = tracker();
        tr.update_service(&simple_service("svc1", "172.30.0.41"), t(0))
            .unwrap();
        let terminating: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"namespace": "ns1", "name": term_slice,
                         "labels": {"kubernetes.io/service-name": "svc1"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.5"], "nodeName": "node1",
                           "conditions": {"ready": false, "serving": true, "terminating": true}}],
            "ports": [{"name": "p80", "port": 8080}],
        }))
        .unwrap();
        let running = slice(
            "svc1",
            ready_slice,
            ("p80", 8080, "TCP"),
            &[("10.0.0.5", "node2", true)],
        );
        tr.update_endpoint_slice(&terminating, t(1)).unwrap();
        tr.update_endpoint_slice(&running, t(1)).unwrap();
        tr.take_changes();
        let eps = tr.state().endpoints_of(&spn("svc1", "p80", Protocol::Tcp));
        assert_eq!(eps.len(), 1);
        assert!(
            eps[0].ready && !eps[0].terminating,
            "{term_slice}: {:?}",
            eps[0]
        );
    }
}

#[test]
fn slice_moving_to_another_service_and_deletion() {
    let mut tr = tracker();
    tr.update_service(&simple_service("svc1", "172.30.0.41"), t(0))
        .unwrap();
    tr.update_service(&simple_service("svc2", "172.30.0.42"), t(0))
        .unwrap();
    let s1 = slice(
        "svc1",
        "shared",
        ("p80", 8080, "TCP"),
        &[("10.0.0.1", "node2", true)],
    );
    tr.update_endpoint_slice(&s1, t(1)).unwrap();
    tr.take_changes();
    let p1 = spn("svc1", "p80", Protocol::Tcp);
    let p2 = spn("svc2", "p80", Protocol::Tcp);
    assert_eq!(eps_of(&tr, &p1), vec!["10.0.0.1:8080"]);

    // The label now names svc2.
    let s2 = slice(
        "svc2",
        "shared",
        ("p80", 8080, "TCP"),
        &[("10.0.0.1", "node2", true)],
    );
    tr.update_endpoint_slice(&s2, t(2)).unwrap();
    let cs = tr.take_changes();
    assert_eq!(changed(&cs), vec!["ns1/svc1:p80/TCP", "ns1/svc2:p80/TCP"]);
    assert!(eps_of(&tr, &p1).is_empty());
    assert_eq!(eps_of(&tr, &p2), vec!["10.0.0.1:8080"]);

    // The label is removed: the slice belongs to no Service.
    let mut orphan = s2.clone();
    orphan.metadata.labels = None;
    tr.update_endpoint_slice(&orphan, t(3)).unwrap();
    let cs = tr.take_changes();
    assert_eq!(changed(&cs), vec!["ns1/svc2:p80/TCP"]);
    assert!(eps_of(&tr, &p2).is_empty());

    // Back to svc2, then deleted.
    tr.update_endpoint_slice(&s2, t(4)).unwrap();
    tr.take_changes();
    assert_eq!(eps_of(&tr, &p2), vec!["10.0.0.1:8080"]);
    tr.delete_endpoint_slice("ns1", "shared", t(5));
    let cs = tr.take_changes();
    assert_eq!(changed(&cs), vec!["ns1/svc2:p80/TCP"]);
    assert_eq!(cs.endpoint_changes, 1);
    assert!(eps_of(&tr, &p2).is_empty());
    assert!(tr.state().endpoints.is_empty());
    // A second delete, or one of an unknown slice, changes nothing.
    tr.delete_endpoint_slice("ns1", "shared", t(6));
    tr.delete_endpoint_slice("ns2", "shared", t(6));
    let cs = tr.take_changes();
    assert_eq!(cs.endpoint_changes, 0);
    assert!(cs.changed.is_empty());
}

#[test]
fn endpoints_without_a_service_wait_for_it() {
    let mut tr = tracker();
    tr.update_endpoint_slice(
        &slice(
            "svc1",
            "svc1-a",
            ("p80", 8080, "TCP"),
            &[("10.0.0.1", "node2", true)],
        ),
        t(1),
    )
    .unwrap();
    let cs = tr.take_changes();
    assert!(cs.changed.is_empty());
    assert_eq!(cs.endpoint_changes, 1);
    assert!(tr.state().endpoints.is_empty());
    tr.update_service(&simple_service("svc1", "172.30.0.41"), t(2))
        .unwrap();
    let cs = tr.take_changes();
    assert_eq!(changed(&cs), vec!["ns1/svc1:p80/TCP"]);
    assert_eq!(
        eps_of(&tr, &spn("svc1", "p80", Protocol::Tcp)),
        vec!["10.0.0.1:8080"]
    );
}

fn node(name: &str, zone: Option<&str>) -> Node {
    let mut labels = serde_json::Map::new();
    labels.insert("kubernetes.io/hostname".into(), json!(name));
    if let Some(z) = zone {
        labels.insert("topology.kubernetes.io/zone".into(), json!(z));
    }
    serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap()
}

#[test]
fn zone_change_on_our_node_marks_everything_changed() {
    let mut tr = tracker();
    tr.update_service(&simple_service("svc1", "172.30.0.41"), t(0))
        .unwrap();
    tr.update_service(&simple_service("svc2", "172.30.0.42"), t(0))
        .unwrap();
    tr.take_changes();
    assert_eq!(tr.state().node.zone, None);

    // Other nodes are none of our business.
    tr.update_node(&node("node2", Some("zone-a")));
    assert_eq!(tr.pending(), 0);
    assert!(tr.take_changes().changed.is_empty());
    assert_eq!(tr.state().node.zone, None);

    tr.update_node(&node("node1", Some("zone-a")));
    let cs = tr.take_changes();
    assert_eq!(changed(&cs), vec!["ns1/svc1:p80/TCP", "ns1/svc2:p80/TCP"]);
    assert_eq!(tr.state().node.zone.as_deref(), Some("zone-a"));
    assert_eq!(tr.state().node.name, "node1");

    // Same zone again: nothing.
    tr.update_node(&node("node1", Some("zone-a")));
    assert!(tr.take_changes().changed.is_empty());
    // Label removed: a change too.
    tr.update_node(&node("node1", None));
    assert_eq!(tr.take_changes().changed.len(), 2);
    assert_eq!(tr.state().node.zone, None);
}

#[test]
fn trigger_time_annotation() {
    let mut tr = tracker();
    let mut sl = slice(
        "svc1",
        "svc1-a",
        ("p80", 8080, "TCP"),
        &[("10.0.0.1", "node2", true)],
    );
    sl.metadata.annotations = Some(
        [(
            "endpoints.kubernetes.io/last-change-trigger-time".to_string(),
            "2024-01-02T03:04:05.25Z".to_string(),
        )]
        .into(),
    );
    tr.update_endpoint_slice(&sl, t(10)).unwrap();
    let cs = tr.take_changes();
    assert_eq!(
        cs.trigger_times,
        vec![SystemTime::UNIX_EPOCH + Duration::new(1_704_164_645, 250_000_000)]
    );
    // Unparsable annotation: the time we saw the change.
    let mut sl2 = slice(
        "svc1",
        "svc1-a",
        ("p80", 8080, "TCP"),
        &[("10.0.0.2", "node2", true)],
    );
    sl2.metadata.annotations = Some(
        [(
            "endpoints.kubernetes.io/last-change-trigger-time".to_string(),
            "yesterday".to_string(),
        )]
        .into(),
    );
    tr.update_endpoint_slice(&sl2, t(11)).unwrap();
    assert_eq!(tr.take_changes().trigger_times, vec![t(11)]);
}

#[test]
fn change_counts() {
    let mut tr = tracker();
    tr.update_service(&simple_service("svc1", "172.30.0.41"), t(0))
        .unwrap();
    tr.update_service(&simple_service("svc2", "172.30.0.42"), t(0))
        .unwrap();
    // Unchanged repeat: not counted.
    tr.update_service(&simple_service("svc2", "172.30.0.42"), t(0))
        .unwrap();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        let addr = format!("10.0.0.{}", i + 1);
        tr.update_endpoint_slice(
            &slice(
                "svc1",
                name,
                ("p80", 8080, "TCP"),
                &[(&addr, "node2", true)],
            ),
            t(1),
        )
        .unwrap();
    }
    let cs = tr.take_changes();
    assert_eq!(cs.service_changes, 2);
    assert_eq!(cs.endpoint_changes, 3);
    assert_eq!(cs.trigger_times.len(), 5);
    assert_eq!(changed(&cs), vec!["ns1/svc1:p80/TCP", "ns1/svc2:p80/TCP"]);
}

#[test]
fn invalid_objects_keep_the_previous_version() {
    let mut tr = tracker();
    let good = simple_service("svc1", "172.30.0.41");
    tr.update_service(&good, t(0)).unwrap();
    let sl = slice(
        "svc1",
        "svc1-a",
        ("p80", 8080, "TCP"),
        &[("10.0.0.1", "node2", true)],
    );
    tr.update_endpoint_slice(&sl, t(0)).unwrap();
    tr.take_changes();

    let bad = service(
        "svc1",
        json!({"clusterIP": "172.30.0.41", "ports": [{"name": "p80", "port": 0}]}),
    );
    let err = tr.update_service(&bad, t(1)).unwrap_err();
    assert!(
        err.0.to_string().contains("spec.ports[0].port"),
        "{}",
        err.0
    );
    assert_eq!(err.0.name, "svc1");
    let bad_slice = slice(
        "svc1",
        "svc1-a",
        ("BAD", 8080, "TCP"),
        &[("10.0.0.9", "node2", true)],
    );
    let err = tr.update_endpoint_slice(&bad_slice, t(1)).unwrap_err();
    assert_eq!(err.0.kind, "EndpointSlice");

    let cs = tr.take_changes();
    assert!(cs.changed.is_empty());
    assert_eq!((cs.service_changes, cs.endpoint_changes), (0, 0));
    let p80 = spn("svc1", "p80", Protocol::Tcp);
    assert_eq!(tr.state().services[&p80].port, 80);
    assert_eq!(eps_of(&tr, &p80), vec!["10.0.0.1:8080"]);
}

#[test]
fn other_family_objects_are_ignored() {
    let mut tr = tracker();
    tr.update_service(&simple_service("svc6", "fd00:30::41"), t(0))
        .unwrap();
    let cs = tr.take_changes();
    assert!(cs.changed.is_empty());
    assert_eq!(cs.service_changes, 0);
    assert_eq!(tr.family(), IpFamily::V4);
}

// --- stale UDP conntrack ---------------------------------------------------

fn udp_service(etp_local: bool) -> Service {
    let mut spec = json!({
        "type": "NodePort",
        "clusterIP": "172.30.0.10",
        "externalIPs": ["203.0.113.5"],
        "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053}],
    });
    if etp_local {
        spec["externalTrafficPolicy"] = json!("Local");
    }
    service("dns", spec)
}

fn udp_slice(endpoints: &[(&str, &str, bool)]) -> EndpointSlice {
    slice("dns", "dns-a", ("dns", 5353, "UDP"), endpoints)
}

fn filter(dst: Option<&str>, dport: u16, reply: Option<&str>) -> StaleConntrack {
    StaleConntrack {
        protocol: Protocol::Udp,
        orig_dst: dst.map(ip),
        orig_dport: dport,
        reply_src: reply.map(ip),
    }
}

/// The filters for every address of the dns Service, with this reply source.
fn all_addresses(reply: Option<&str>) -> BTreeSet<StaleConntrack> {
    [
        filter(Some("172.30.0.10"), 53, reply),
        filter(Some("203.0.113.5"), 53, reply),
        filter(None, 30053, reply),
    ]
    .into()
}

#[test]
fn stale_udp_endpoint_removed() {
    let mut tr = tracker();
    tr.update_service(&udp_service(false), t(0)).unwrap();
    tr.update_endpoint_slice(
        &udp_slice(&[("10.0.0.1", "node2", true), ("10.0.0.2", "node2", true)]),
        t(0),
    )
    .unwrap();
    tr.take_changes();
    tr.update_endpoint_slice(&udp_slice(&[("10.0.0.1", "node2", true)]), t(1))
        .unwrap();
    let cs = tr.take_changes();
    assert_eq!(cs.stale, all_addresses(Some("10.0.0.2")));

    // Becoming unready (and not serving) counts as removed.
    tr.update_endpoint_slice(
        &udp_slice(&[("10.0.0.1", "node2", false), ("10.0.0.3", "node2", true)]),
        t(2),
    )
    .unwrap();
    let cs = tr.take_changes();
    assert_eq!(cs.stale, all_addresses(Some("10.0.0.1")));

    // Readiness flapping back: flows to a newly usable endpoint are not stale.
    tr.update_endpoint_slice(
        &udp_slice(&[("10.0.0.1", "node2", true), ("10.0.0.3", "node2", true)]),
        t(3),
    )
    .unwrap();
    assert!(tr.take_changes().stale.is_empty());
}

#[test]
fn stale_udp_service_port_deleted() {
    let mut tr = tracker();
    tr.update_service(&udp_service(false), t(0)).unwrap();
    tr.update_endpoint_slice(&udp_slice(&[("10.0.0.1", "node2", true)]), t(0))
        .unwrap();
    tr.take_changes();
    tr.delete_service("ns1", "dns", t(1));
    let cs = tr.take_changes();
    assert_eq!(cs.stale, all_addresses(None));
}

#[test]
fn stale_udp_zero_to_some_endpoints() {
    let mut tr = tracker();
    tr.update_service(&udp_service(false), t(0)).unwrap();
    let cs = tr.take_changes();
    assert!(cs.stale.is_empty());
    // Packets sent while there was no endpoint were rejected/untracked by NAT;
    // their entries must go so the next ones hit the new DNAT rules.
    tr.update_endpoint_slice(&udp_slice(&[("10.0.0.1", "node2", true)]), t(1))
        .unwrap();
    let cs = tr.take_changes();
    assert_eq!(cs.stale, all_addresses(None));
    // N -> M with M > 0: nothing (no endpoint went away).
    tr.update_endpoint_slice(
        &udp_slice(&[("10.0.0.1", "node2", true), ("10.0.0.2", "node2", true)]),
        t(2),
    )
    .unwrap();
    assert!(tr.take_changes().stale.is_empty());
}

#[test]
fn stale_udp_new_service_with_endpoints_in_one_sync() {
    // Service and slice arrive together (first sync after start, say): the
    // service became active, as upstream's "newly active UDP services".
    let mut tr = tracker();
    tr.update_service(&udp_service(false), t(0)).unwrap();
    tr.update_endpoint_slice(&udp_slice(&[("10.0.0.1", "node2", true)]), t(0))
        .unwrap();
    assert_eq!(tr.take_changes().stale, all_addresses(None));
    // Without endpoints there is nothing to flush.
    let mut tr = tracker();
    tr.update_service(&udp_service(false), t(0)).unwrap();
    assert!(tr.take_changes().stale.is_empty());
}

#[test]
fn stale_udp_external_ip_removed() {
    let mut tr = tracker();
    tr.update_service(&udp_service(false), t(0)).unwrap();
    tr.update_endpoint_slice(&udp_slice(&[("10.0.0.1", "node2", true)]), t(0))
        .unwrap();
    tr.take_changes();
    let without = service(
        "dns",
        json!({"type": "NodePort", "clusterIP": "172.30.0.10",
               "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053}]}),
    );
    tr.update_service(&without, t(1)).unwrap();
    let cs = tr.take_changes();
    assert_eq!(
        cs.stale,
        [filter(Some("203.0.113.5"), 53, None)].into(),
        "only the address that went away"
    );
}

#[test]
fn tcp_produces_no_conntrack_filters() {
    let mut tr = tracker();
    let tcp = service(
        "web",
        json!({"type": "NodePort", "clusterIP": "172.30.0.11", "externalIPs": ["203.0.113.6"],
               "ports": [{"name": "http", "port": 80, "nodePort": 30080}]}),
    );
    tr.update_service(&tcp, t(0)).unwrap();
    let web = |eps: &[(&str, &str, bool)]| slice("web", "web-a", ("http", 8080, "TCP"), eps);
    tr.update_endpoint_slice(
        &web(&[("10.0.0.1", "node2", true), ("10.0.0.2", "node2", true)]),
        t(0),
    )
    .unwrap();
    assert!(tr.take_changes().stale.is_empty());
    tr.update_endpoint_slice(&web(&[("10.0.0.1", "node2", true)]), t(1))
        .unwrap();
    let cs = tr.take_changes();
    assert_eq!(cs.changed.len(), 1);
    assert!(cs.stale.is_empty());
    tr.delete_service("ns1", "web", t(2));
    let cs = tr.take_changes();
    assert_eq!(cs.changed.len(), 1);
    assert!(cs.stale.is_empty());
}

// --- parse_rfc3339 ----------------------------------------------------------

#[test]
fn rfc3339_parsing() {
    let at = |secs: u64, nanos: u32| Some(SystemTime::UNIX_EPOCH + Duration::new(secs, nanos));
    let cases: &[(&str, Option<SystemTime>)] = &[
        ("1970-01-01T00:00:00Z", at(0, 0)),
        ("2024-01-02T03:04:05Z", at(1_704_164_645, 0)),
        ("2024-01-02T03:04:05z", at(1_704_164_645, 0)),
        ("2024-01-02T03:04:05.5Z", at(1_704_164_645, 500_000_000)),
        (
            "2024-01-02T03:04:05.123456789Z",
            at(1_704_164_645, 123_456_789),
        ),
        // More than nanosecond precision is truncated.
        (
            "2024-01-02T03:04:05.1234567891Z",
            at(1_704_164_645, 123_456_789),
        ),
        ("2024-01-02T04:04:05+01:00", at(1_704_164_645, 0)),
        ("2024-01-01T22:34:05-04:30", at(1_704_164_645, 0)),
        ("2024-02-29T00:00:00Z", at(1_709_164_800, 0)),
        ("2000-03-01T00:00:00Z", at(951_868_800, 0)),
        ("2024-13-01T00:00:00Z", None),
        ("2024-00-01T00:00:00Z", None),
        ("2024-01-32T00:00:00Z", None),
        ("2024-01-02T24:00:00Z", None),
        ("2024-01-02T03:60:00Z", None),
        ("2024-01-02T03:04:05", None),
        ("2024-01-02 03:04:05Z", None),
        ("2024-01-02T03:04:05+0100", None),
        ("2024-01-02T03:04:05Zjunk", None),
        ("1969-12-31T23:59:59Z", None),
        ("", None),
        ("yesterday", None),
        ("2024-01-02T03:04:0éZ", None),
        ("2024-01-02T03:04:05.é", None),
        ("-001-01-01T00:00:00Z", None),
    ];
    for (s, want) in cases {
        assert_eq!(parse_rfc3339(s), *want, "{s:?}");
    }
}

#[test]
fn endpoints_on_one_node_share_one_placement_across_slices_and_services() {
    let mut tr = tracker();
    tr.update_service(&simple_service("svc1", "10.96.0.1"), t(0))
        .unwrap();
    tr.update_service(&simple_service("svc2", "10.96.0.2"), t(0))
        .unwrap();
    let a = slice(
        "svc1",
        "svc1-a",
        ("p80", 8080, "TCP"),
        &[("10.0.0.1", "node2", true), ("10.0.0.2", "node3", true)],
    );
    let b = slice(
        "svc2",
        "svc2-a",
        ("p80", 8080, "TCP"),
        &[("10.0.1.1", "node2", true)],
    );
    tr.update_endpoint_slice(&a, t(1)).unwrap();
    tr.update_endpoint_slice(&b, t(1)).unwrap();
    tr.take_changes();
    let st = tr.state();
    let one = st.endpoints_of(&spn("svc1", "p80", Protocol::Tcp));
    let two = st.endpoints_of(&spn("svc2", "p80", Protocol::Tcp));
    let at = |eps: &[kp_model::Endpoint], a: &str| {
        eps.iter()
            .find(|e| e.ip == ip(a))
            .and_then(|e| e.placement.clone())
            .unwrap()
    };
    let (n2a, n3, n2b) = (
        at(one, "10.0.0.1"),
        at(one, "10.0.0.2"),
        at(two, "10.0.1.1"),
    );
    assert!(
        std::sync::Arc::ptr_eq(&n2a, &n2b),
        "node2 shared by both Services"
    );
    assert!(!std::sync::Arc::ptr_eq(&n2a, &n3));
    assert_eq!(
        (n2a.node_name.as_deref(), n3.node_name.as_deref()),
        (Some("node2"), Some("node3"))
    );
}

fn service_cidr(name: &str, cidrs: &[&str]) -> k8s_openapi::api::networking::v1::ServiceCIDR {
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"cidrs": cidrs}})).unwrap()
}

#[test]
fn service_cidrs_follow_the_objects_per_family() {
    let net = |s: &str| s.parse::<ipnet::IpNet>().unwrap();
    let mut v4 = tracker();
    let mut v6 = ChangeTracker::new(TrackerConfig {
        family: IpFamily::V6,
        node_name: "node1".into(),
        service_proxy_name: None,
    });
    let k = service_cidr("kubernetes", &["10.96.0.0/16", "fd00:96::/108"]);
    assert_eq!(v4.update_service_cidr(&k), (true, vec![]));
    assert_eq!(v6.update_service_cidr(&k), (true, vec![]));
    assert_eq!(v4.state().service_cidrs, [net("10.96.0.0/16")]);
    assert_eq!(v6.state().service_cidrs, [net("fd00:96::/108")]);
    // The same object again changes nothing: no sync needed.
    assert_eq!(v4.update_service_cidr(&k), (false, vec![]));
    // A second object: added in order; one naming the same range as the
    // first keeps it when the first goes.
    let (changed, w) = v4.update_service_cidr(&service_cidr("more", &["10.1.0.0/24"]));
    assert!(changed && w.is_empty());
    assert_eq!(
        v4.state().service_cidrs,
        [net("10.1.0.0/24"), net("10.96.0.0/16")]
    );
    assert!(
        !v4.update_service_cidr(&service_cidr("dup", &["10.96.0.0/16"]))
            .0
    );
    assert!(!v4.delete_service_cidr("kubernetes"));
    assert!(v4.delete_service_cidr("dup"));
    assert_eq!(v4.state().service_cidrs, [net("10.1.0.0/24")]);
    // An IPv6-only object is nothing to the IPv4 tracker.
    assert!(
        !v4.update_service_cidr(&service_cidr("six", &["fd00:97::/112"]))
            .0
    );
    // Host bits are cleared; a string that is not a CIDR is skipped with a
    // warning naming the object and the field.
    let (changed, w) = v4.update_service_cidr(&service_cidr("more", &["10.1.0.9/24", "bogus"]));
    assert!(!changed);
    assert_eq!(w.len(), 1);
    assert!(
        w[0].contains("ServiceCIDR more") && w[0].contains("spec.cidrs[1]"),
        "{w:?}"
    );
    assert!(v4.delete_service_cidr("more"));
    assert!(v4.state().service_cidrs.is_empty());
}
