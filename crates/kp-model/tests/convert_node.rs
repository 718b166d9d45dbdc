//! convert_node: what kube-proxy reads of a Node. Its spec.podCIDRs as
//! NodeCIDR local-traffic detection uses them (upstream: MapCIDRsByIPFamily,
//! then the first CIDR per family), its addresses, zone label and whether it
//! is going away.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kp_model::{convert_node, IpFamily, NodeDetails, NodeInfo, PodCidrs};
use serde_json::{json, Value};

fn node(spec: Value) -> Node {
    serde_json::from_value(json!({"metadata": {"name": "node1"}, "spec": spec})).unwrap()
}

fn node_pod_cidrs(n: &Node) -> PodCidrs {
    convert_node(n).pod_cidrs
}

fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

#[test]
fn dual_stack_pod_cidrs_in_order() {
    let got = node_pod_cidrs(&node(json!({
        "podCIDR": "10.244.1.0/24",
        "podCIDRs": ["10.244.1.0/24", "fd00:10:244:1::/64"],
    })));
    assert_eq!(got.cidrs, nets(&["10.244.1.0/24", "fd00:10:244:1::/64"]));
    assert_eq!(got.raw, ["10.244.1.0/24", "fd00:10:244:1::/64"]);
    assert!(got.invalid.is_empty());

    // IPv6 first stays first.
    let got = node_pod_cidrs(&node(json!({
        "podCIDRs": ["fd00:10:244:1::/64", "10.244.1.0/24"],
    })));
    assert_eq!(got.cidrs, nets(&["fd00:10:244:1::/64", "10.244.1.0/24"]));
}

#[test]
fn one_cidr_per_family_invalid_ones_skipped() {
    let got = node_pod_cidrs(&node(json!({
        "podCIDRs": ["garbage", "10.244.1.7/24", "10.9.0.0/16", "010.1.0.0/16"],
    })));
    // Host bits cleared (upstream's ParseCIDRSloppy gives the network); the
    // second IPv4 CIDR is not used.
    assert_eq!(got.cidrs, nets(&["10.244.1.0/24"]));
    assert_eq!(got.invalid, ["garbage"]);
    assert_eq!(got.raw.len(), 4);
}

#[test]
fn missing_pod_cidrs() {
    assert_eq!(node_pod_cidrs(&node(json!({}))), PodCidrs::default());
    assert_eq!(
        node_pod_cidrs(&node(json!({"podCIDRs": []}))),
        PodCidrs::default()
    );
    let no_spec: Node = serde_json::from_value(json!({"metadata": {"name": "n"}})).unwrap();
    assert_eq!(node_pod_cidrs(&no_spec), PodCidrs::default());
    // Only the old single field, as a hand-written manifest may have it.
    let got = node_pod_cidrs(&node(json!({"podCIDR": "10.244.3.0/24"})));
    assert_eq!(got.cidrs, nets(&["10.244.3.0/24"]));
    assert_eq!(got.raw, ["10.244.3.0/24"]);
}

fn from(v: Value) -> NodeDetails {
    convert_node(&serde_json::from_value(v).unwrap())
}

fn ips(list: &[&str]) -> Vec<std::net::IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

#[test]
fn name_zone_and_addresses() {
    let n = from(json!({
        "metadata": {"name": "node1", "labels": {
            "topology.kubernetes.io/zone": "zone-a",
            "topology.kubernetes.io/region": "r1",
        }},
        "spec": {"podCIDRs": ["10.244.1.0/24"]},
        "status": {"addresses": [
            {"type": "Hostname", "address": "node1"},
            {"type": "ExternalIP", "address": "203.0.113.7"},
            {"type": "InternalIP", "address": "192.168.0.11"},
            {"type": "InternalIP", "address": "fd00::11"},
            {"type": "InternalIP", "address": "not-an-ip"},
            {"type": "InternalIP", "address": "192.168.0.12"},
            {"type": "ExternalIP", "address": "2001:db8::7"},
            {"type": "InternalDNS", "address": "node1.cluster.local"},
        ]},
    }));
    assert_eq!(n.name, "node1");
    assert_eq!(n.zone.as_deref(), Some("zone-a"));
    // In the order listed, unparsable ones and other types skipped.
    assert_eq!(
        n.internal_ips,
        ips(&["192.168.0.11", "fd00::11", "192.168.0.12"])
    );
    assert_eq!(n.external_ips, ips(&["203.0.113.7", "2001:db8::7"]));
    assert_eq!(n.pod_cidrs.cidrs, nets(&["10.244.1.0/24"]));
    assert!(!n.to_be_deleted);
    assert_eq!(
        n.info(),
        NodeInfo {
            name: "node1".into(),
            zone: Some("zone-a".into())
        }
    );
    // Per family: InternalIPs before ExternalIPs, though listed after.
    assert_eq!(
        n.ips_of(IpFamily::V4),
        ips(&["192.168.0.11", "192.168.0.12", "203.0.113.7"])
    );
    assert_eq!(n.ips_of(IpFamily::V6), ips(&["fd00::11", "2001:db8::7"]));
    assert_eq!(n.primary_ip(IpFamily::V4), Some(ips(&["192.168.0.11"])[0]));
    assert_eq!(n.primary_ip(IpFamily::V6), Some(ips(&["fd00::11"])[0]));
}

#[test]
fn only_external_ips_and_sloppy_ipv4() {
    let n = from(json!({
        "metadata": {"name": "n2"},
        "status": {"addresses": [
            {"type": "ExternalIP", "address": "010.001.002.003"},
        ]},
    }));
    assert!(n.internal_ips.is_empty());
    // Leading zeros read as decimal, as upstream's ParseIPSloppy.
    assert_eq!(n.external_ips, ips(&["10.1.2.3"]));
    assert_eq!(n.primary_ip(IpFamily::V4), Some(ips(&["10.1.2.3"])[0]));
    assert_eq!(n.primary_ip(IpFamily::V6), None);
    assert_eq!(n.zone, None);
}

#[test]
fn bare_node() {
    let n = from(json!({}));
    assert_eq!(n, NodeDetails::default());
    assert_eq!(n.info(), NodeInfo::default());
    // An empty zone label is kept as written (topology treats it as none).
    let n = from(json!({"metadata": {"name": "n", "labels": {"topology.kubernetes.io/zone": ""}}}));
    assert_eq!(n.zone.as_deref(), Some(""));
}

#[test]
fn going_away() {
    let deleting = from(json!({
        "metadata": {"name": "n", "deletionTimestamp": "2024-01-01T00:00:00Z"},
    }));
    assert!(deleting.to_be_deleted);
    let tainted = from(json!({
        "metadata": {"name": "n"},
        "spec": {"taints": [
            {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
            {"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000", "effect": "NoSchedule"},
        ]},
    }));
    assert!(tainted.to_be_deleted);
    let other_taint = from(json!({
        "metadata": {"name": "n"},
        "spec": {"taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]},
    }));
    assert!(!other_taint.to_be_deleted);
}

fn addressed(addresses: Value) -> NodeDetails {
    convert_node(
        &serde_json::from_value(json!({
            "metadata": {"name": "node1"},
            "status": {"addresses": addresses},
        }))
        .unwrap(),
    )
}

/// `nodePortAddresses: primary` takes these (upstream's GetNodeHostIPs):
/// InternalIPs before ExternalIPs, the first address of each family, the
/// family of the first one first.
#[test]
fn host_ips_are_the_first_internal_then_external_address_per_family() {
    let n = addressed(json!([
        {"type": "Hostname", "address": "node1"},
        {"type": "ExternalIP", "address": "203.0.113.7"},
        {"type": "InternalIP", "address": "10.0.0.5"},
        {"type": "InternalIP", "address": "10.0.0.6"},
        {"type": "ExternalIP", "address": "2001:db8::7"},
    ]));
    assert_eq!(n.host_ips(), ips(&["10.0.0.5", "2001:db8::7"]));

    let n = addressed(json!([
        {"type": "InternalIP", "address": "fd00::5"},
        {"type": "InternalIP", "address": "10.0.0.5"},
    ]));
    assert_eq!(n.host_ips(), ips(&["fd00::5", "10.0.0.5"]));

    let n = addressed(json!([{"type": "ExternalIP", "address": "203.0.113.7"}]));
    assert_eq!(n.host_ips(), ips(&["203.0.113.7"]));

    let n = addressed(json!([{"type": "Hostname", "address": "node1"}]));
    assert!(n.host_ips().is_empty());
}
