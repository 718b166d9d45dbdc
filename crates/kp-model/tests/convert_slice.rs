//! convert_endpoint_slice against upstream's EndpointSliceCache.addEndpoints
//! (pkg/proxy/endpointslicecache.go) and the informer's label filters.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::net::IpAddr;

use k8s_openapi::api::discovery::v1::{Endpoint as K8sEndpoint, EndpointSlice};
use kp_model::{convert_endpoint_slice, Endpoint, IpFamily, Protocol, ServiceName, SliceEndpoints};
use serde_json::{json, Value};

const NODE: &str = "node1";

fn slice(v: Value) -> EndpointSlice {
    serde_json::from_value(v).unwrap()
}

/// Slice ns1/svc1-abcde of Service svc1.
fn svc1_slice(address_type: &str, endpoints: Value, ports: Value) -> EndpointSlice {
    slice(json!({
        "metadata": {"namespace": "ns1", "name": "svc1-abcde",
                     "labels": {"kubernetes.io/service-name": "svc1"}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": ports,
    }))
}

fn p80() -> Value {
    json!([{"name": "p80", "port": 8080, "protocol": "TCP"}])
}

fn conv(s: &EndpointSlice, family: IpFamily) -> (SliceEndpoints, Vec<String>) {
    let mut w = Vec::new();
    let r = convert_endpoint_slice(s, family, NODE, &mut w).unwrap();
    (r, w)
}

/// The endpoints of the only port.
fn only_port(r: &SliceEndpoints) -> &[Endpoint] {
    assert_eq!(r.ports.len(), 1, "{r:?}");
    &r.ports[0].1
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn ipv4_slice() {
    let s = svc1_slice(
        "IPv4",
        json!([
            {"addresses": ["10.180.0.1"], "nodeName": "node1", "zone": "zone-a",
             "conditions": {"ready": true}},
            {"addresses": ["10.180.0.2"], "nodeName": "node2", "zone": "zone-b"},
        ]),
        p80(),
    );
    let (r, w) = conv(&s, IpFamily::V4);
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(r.service, Some(ServiceName::new("ns1", "svc1")));
    assert_eq!(r.ports[0].0, ("p80".to_string(), Protocol::Tcp));
    let eps = only_port(&r);
    assert_eq!(eps.len(), 2);
    assert_eq!(eps[0].ip, ip("10.180.0.1"));
    assert_eq!(eps[0].port, 8080);
    assert_eq!(eps[0].addr_string(), "10.180.0.1:8080");
    assert!(eps[0].is_local);
    assert_eq!(eps[0].node_name(), Some("node1"));
    assert_eq!(eps[0].zone(), Some("zone-a"));
    assert!(!eps[1].is_local);
    assert_eq!(eps[1].zone(), Some("zone-b"));
}

#[test]
fn ipv6_slice_and_family_mismatch() {
    let s = svc1_slice("IPv6", json!([{"addresses": ["fd00:180::1"]}]), p80());
    let (r, _) = conv(&s, IpFamily::V6);
    let eps = only_port(&r);
    assert_eq!(eps[0].ip, ip("fd00:180::1"));
    assert_eq!(eps[0].addr_string(), "[fd00:180::1]:8080");
    // The IPv4 proxier knows which Service the slice belongs to but uses none of it.
    let (r, w) = conv(&s, IpFamily::V4);
    assert_eq!(r.service, Some(ServiceName::new("ns1", "svc1")));
    assert!(r.ports.is_empty());
    assert!(w.is_empty());
}

#[test]
fn fqdn_slices_are_not_proxied() {
    let s = svc1_slice("FQDN", json!([{"addresses": ["www.example.com"]}]), p80());
    for fam in [IpFamily::V4, IpFamily::V6] {
        let (r, w) = conv(&s, fam);
        assert!(r.ports.is_empty(), "{r:?}");
        assert!(w.is_empty());
    }
}

#[test]
fn missing_service_name_label_and_headless_label() {
    let s = slice(json!({
        "metadata": {"namespace": "ns1", "name": "orphan"},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.180.0.1"]}],
        "ports": p80(),
    }));
    assert_eq!(conv(&s, IpFamily::V4).0, SliceEndpoints::default());
    let s = slice(json!({
        "metadata": {"namespace": "ns1", "name": "svc1-abcde",
                     "labels": {"kubernetes.io/service-name": "svc1",
                                "service.kubernetes.io/headless": ""}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.180.0.1"]}],
        "ports": p80(),
    }));
    let (r, _) = conv(&s, IpFamily::V4);
    assert_eq!(r.service, None);
    assert!(r.ports.is_empty());
}

#[test]
fn condition_defaults() {
    // (conditions JSON, ready, serving, terminating)
    let cases = [
        (Value::Null, true, true, false),
        (json!({}), true, true, false),
        (json!({"ready": true}), true, true, false),
        (json!({"ready": false}), false, false, false),
        // serving unset follows ready (the API: "consumers should defer to ready").
        (
            json!({"ready": false, "terminating": true}),
            false,
            false,
            true,
        ),
        (
            json!({"ready": false, "serving": true, "terminating": true}),
            false,
            true,
            true,
        ),
        (
            json!({"ready": false, "serving": false, "terminating": true}),
            false,
            false,
            true,
        ),
        (json!({"serving": false}), true, false, false),
        (json!({"terminating": false}), true, true, false),
    ];
    for (cond, ready, serving, terminating) in cases {
        let mut ep = json!({"addresses": ["10.180.0.1"]});
        if !cond.is_null() {
            ep["conditions"] = cond.clone();
        }
        let s = svc1_slice("IPv4", json!([ep]), p80());
        let (r, _) = conv(&s, IpFamily::V4);
        let e = &only_port(&r)[0];
        assert_eq!(
            (e.ready, e.serving, e.terminating),
            (ready, serving, terminating),
            "{cond}"
        );
    }
}

#[test]
fn is_local_by_node_name() {
    let s = svc1_slice(
        "IPv4",
        json!([
            {"addresses": ["10.180.0.1"], "nodeName": "node1"},
            {"addresses": ["10.180.0.2"], "nodeName": "node10"},
            {"addresses": ["10.180.0.3"]},
            {"addresses": ["10.180.0.4"], "nodeName": ""},
        ]),
        p80(),
    );
    let (r, _) = conv(&s, IpFamily::V4);
    let local: Vec<bool> = only_port(&r).iter().map(|e| e.is_local).collect();
    assert_eq!(local, vec![true, false, false, false]);
    // An unknown own node name never matches an empty nodeName.
    let mut w = Vec::new();
    let r = convert_endpoint_slice(&s, IpFamily::V4, "", &mut w).unwrap();
    assert!(r.ports[0].1.iter().all(|e| !e.is_local));
}

#[test]
fn zone_and_node_hints() {
    let s = svc1_slice(
        "IPv4",
        json!([
            {"addresses": ["10.180.0.1"],
             "hints": {"forZones": [{"name": "zone-b"}, {"name": "zone-a"}, {"name": "zone-b"}],
                       "forNodes": [{"name": "node1"}]}},
            {"addresses": ["10.180.0.2"], "hints": {"forZones": [{"name": "zone-c"}]}},
            {"addresses": ["10.180.0.3"]},
        ]),
        p80(),
    );
    let (r, _) = conv(&s, IpFamily::V4);
    let eps = only_port(&r);
    assert_eq!(
        eps[0].zone_hints().iter().collect::<Vec<_>>(),
        ["zone-a", "zone-b"]
    );
    assert_eq!(eps[0].node_hints().iter().collect::<Vec<_>>(), ["node1"]);
    assert!(eps[0].zone_hints().contains("zone-b") && !eps[0].zone_hints().contains("zone-c"));
    assert_eq!(eps[1].zone_hints().iter().collect::<Vec<_>>(), ["zone-c"]);
    assert!(eps[1].node_hints().is_empty());
    assert!(eps[2].zone_hints().is_empty() && eps[2].node_hints().is_empty());
}

#[test]
fn bad_ports_skipped_with_warnings() {
    let s = svc1_slice(
        "IPv4",
        json!([{"addresses": ["10.180.0.1"]}]),
        json!([
            {"name": "noport", "protocol": "TCP"},
            {"name": "zero", "port": 0},
            {"name": "big", "port": 65536},
            {"name": "neg", "port": -1},
            {"name": "icmp", "port": 1, "protocol": "ICMP"},
            {"name": "good", "port": 443, "protocol": "TCP"},
            {"port": 53, "protocol": "UDP"},
            {"name": "sctp", "port": 9, "protocol": "SCTP"},
        ]),
    );
    let (r, w) = conv(&s, IpFamily::V4);
    let keys: Vec<(String, Protocol)> = r.ports.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(
        keys,
        vec![
            ("good".into(), Protocol::Tcp),
            // No name: the single unnamed port of the Service.
            ("".into(), Protocol::Udp),
            ("sctp".into(), Protocol::Sctp),
        ]
    );
    assert_eq!(w.len(), 5, "{w:?}");
    for (i, want) in ["ports[0]", "ports[1]", "ports[2]", "ports[3]", "ports[4]"]
        .iter()
        .enumerate()
    {
        assert!(w[i].contains(want), "{}: {}", want, w[i]);
        assert!(w[i].contains("ns1/svc1-abcde"), "{}", w[i]);
    }
    assert_eq!(r.ports[0].1[0].port, 443);
    assert_eq!(r.ports[1].1[0].port, 53);
}

#[test]
fn only_first_address_is_used_and_bad_addresses_dropped() {
    let s = svc1_slice(
        "IPv4",
        json!([
            {"addresses": ["10.180.0.1", "10.180.0.9"]},
            {"addresses": ["fd00::1"]},
            {"addresses": ["not-an-ip", "10.180.0.8"]},
            {"addresses": []},
            {"addresses": ["10.180.0.2"]},
        ]),
        p80(),
    );
    let (r, w) = conv(&s, IpFamily::V4);
    let ips: Vec<IpAddr> = only_port(&r).iter().map(|e| e.ip).collect();
    assert_eq!(ips, vec![ip("10.180.0.1"), ip("10.180.0.2")]);
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(
        w[0].contains("endpoints[1]") && w[0].contains("fd00::1"),
        "{w:?}"
    );
    assert!(
        w[1].contains("endpoints[2]") && w[1].contains("not-an-ip"),
        "{w:?}"
    );
}

#[test]
fn every_port_gets_every_endpoint() {
    let s = svc1_slice(
        "IPv4",
        json!([{"addresses": ["10.180.0.1"]}, {"addresses": ["10.180.0.2"]}]),
        json!([{"name": "http", "port": 80}, {"name": "https", "port": 443}]),
    );
    let (r, _) = conv(&s, IpFamily::V4);
    assert_eq!(r.ports.len(), 2);
    for (i, port) in [80, 443].into_iter().enumerate() {
        let addrs: Vec<String> = r.ports[i].1.iter().map(|e| e.addr_string()).collect();
        assert_eq!(
            addrs,
            vec![format!("10.180.0.1:{port}"), format!("10.180.0.2:{port}")]
        );
    }
}

#[test]
fn oversized_and_invalid_slices_rejected() {
    let mut s = svc1_slice("IPv4", json!([]), p80());
    s.endpoints = (0..100_000u32)
        .map(|i| K8sEndpoint {
            addresses: vec![format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255)],
            ..Default::default()
        })
        .collect();
    let mut w = Vec::new();
    let e = convert_endpoint_slice(&s, IpFamily::V4, NODE, &mut w).unwrap_err();
    assert_eq!(e.kind, "EndpointSlice");
    assert!(e.to_string().contains("100000"), "{e}");
    assert!(e.to_string().contains("ns1/svc1-abcde"), "{e}");

    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"namespace": "ns1", "name": "Bad_Name",
                   "labels": {"kubernetes.io/service-name": "svc1"}}),
            "name",
        ),
        (
            json!({"namespace": "ns1", "name": "a".repeat(254),
                   "labels": {"kubernetes.io/service-name": "svc1"}}),
            "name",
        ),
        (
            json!({"namespace": "NS", "name": "svc1-abcde",
                   "labels": {"kubernetes.io/service-name": "svc1"}}),
            "namespace",
        ),
        (
            json!({"namespace": "ns1", "name": "svc1-abcde",
                   "labels": {"kubernetes.io/service-name": "svc\"; drop"}}),
            "kubernetes.io/service-name",
        ),
    ];
    for (meta, want) in cases {
        let s = slice(json!({
            "metadata": meta, "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.180.0.1"]}], "ports": p80(),
        }));
        let e = convert_endpoint_slice(&s, IpFamily::V4, NODE, &mut w).unwrap_err();
        assert!(e.to_string().contains(want), "{meta}: {e}");
    }
    // A port name that could not come from a Service is rejected, not guessed at.
    let s = svc1_slice(
        "IPv4",
        json!([{"addresses": ["10.180.0.1"]}]),
        json!([{"name": "HTTP", "port": 80}]),
    );
    let e = convert_endpoint_slice(&s, IpFamily::V4, NODE, &mut w).unwrap_err();
    assert!(e.to_string().contains("ports[0].name"), "{e}");
    // The longest valid slice name (a DNS subdomain) is accepted.
    let s = slice(json!({
        "metadata": {"namespace": "ns1", "name": format!("{}.{}", "a".repeat(63), "b".repeat(63)),
                     "labels": {"kubernetes.io/service-name": "svc1"}},
        "addressType": "IPv4", "endpoints": [{"addresses": ["10.180.0.1"]}], "ports": p80(),
    }));
    assert!(convert_endpoint_slice(&s, IpFamily::V4, NODE, &mut w).is_ok());
}

#[test]
fn leading_zero_endpoint_address_is_read_as_decimal() {
    let s = svc1_slice("IPv4", json!([{"addresses": ["010.180.000.001"]}]), p80());
    let (r, w) = conv(&s, IpFamily::V4);
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(only_port(&r)[0].ip, ip("10.180.0.1"));
}
