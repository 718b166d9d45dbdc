//! node_pod_cidrs: a Node's spec.podCIDRs as NodeCIDR local-traffic detection
//! uses them (upstream: MapCIDRsByIPFamily, then the first CIDR per family).

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kp_model::{node_pod_cidrs, PodCidrs};
use serde_json::{json, Value};

fn node(spec: Value) -> Node {
    serde_json::from_value(json!({"metadata": {"name": "node1"}, "spec": spec})).unwrap()
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
