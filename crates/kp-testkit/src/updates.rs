//! Random sequences of Service, EndpointSlice and ServiceCIDR updates for the "partial
//! syncs equal full syncs" property tests (the kernel's, in kube-proxy-rs,
//! and the in-memory one over kp-nftables' `Fake`): added, changed, deleted;
//! types, ports, externalIPs and LoadBalancer IPs changed; addresses that
//! collide on purpose; session affinity on and off; dual-stack. One copy, so
//! both properties explore the same space.

use std::time::SystemTime;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kp_model::{ChangeTracker, IpFamily, TrackerConfig};
use proptest::prelude::*;
use serde_json::{json, Value};

/// Services `s0`..`s4` in namespace `default`; slices `sI-0` and `sI-1`.
pub const SERVICES: usize = 5;
const V4_CLUSTER: [&str; 3] = ["10.96.0.1", "10.96.0.2", "10.96.0.3"];
const V6_CLUSTER: [&str; 2] = ["fd00:96::1", "fd00:96::2"];
/// Other Services' ClusterIPs, shared external addresses, the node's IP.
const EXTERNAL: [&str; 7] = [
    "10.96.0.1",
    "10.96.0.2",
    "203.0.113.1",
    "203.0.113.2",
    "10.0.0.1",
    "fd00:96::1",
    "2001:db8::1",
];
const LB: [&str; 4] = ["203.0.113.1", "10.96.0.2", "203.0.113.9", "fd00:96::2"];
const V4_PODS: [&str; 3] = ["10.1.0.1", "10.1.0.2", "10.1.0.3"];
const V6_PODS: [&str; 2] = ["fd00:1::1", "fd00:1::2"];
const CREATED: [&str; 3] = [
    "2024-01-01T00:00:00Z",
    "2024-06-01T00:00:00Z",
    "2025-01-01T00:00:00Z",
];

// ---------------------------------------------------------------------------
// Update sequences
// ---------------------------------------------------------------------------

/// One update of a sequence.
#[derive(Clone, Debug)]
pub enum Step {
    Apply(Value),
    DeleteService(usize),
    DeleteSlice(usize, usize),
    /// Deletes ServiceCIDR `cI`.
    DeleteServiceCidr(usize),
}

fn pick<T: Clone + std::fmt::Debug + 'static>(pool: &'static [T]) -> impl Strategy<Value = T> {
    proptest::sample::select(pool)
}

fn subset(pool: &'static [&'static str]) -> impl Strategy<Value = Vec<&'static str>> {
    proptest::sample::subsequence(pool, 0..=2)
}

fn service_port() -> impl Strategy<Value = (u16, &'static str, u16)> {
    (
        pick(&[80u16, 443, 53]),
        pick(&["TCP", "UDP"]),
        pick(&[30001u16, 30002, 30003]),
    )
}

/// A Service `sI` (any of its fields varied).
pub fn service() -> impl Strategy<Value = Value> {
    (
        (
            0..SERVICES,
            0..V4_CLUSTER.len(),
            0..V6_CLUSTER.len(),
            0..4u8,
        ),
        (
            pick(&["ClusterIP", "NodePort", "LoadBalancer"]),
            proptest::collection::vec(service_port(), 1..=2),
        ),
        (subset(&EXTERNAL), subset(&LB), any::<bool>()),
        (
            proptest::option::of(pick(&[10u32, 100])),
            any::<bool>(),
            any::<bool>(),
            pick(&CREATED),
        ),
    )
        .prop_map(
            |(
                (i, v4, v6, fams),
                (ty, ports),
                (ext, lb, ranges),
                (affinity, etp_local, itp_local, created),
            )| {
                let (v4, v6) = (V4_CLUSTER[v4], V6_CLUSTER[v6]);
                let (ips, families): (Vec<&str>, Vec<&str>) = match fams {
                    0 => (vec![v4], vec!["IPv4"]),
                    1 => (vec![v6], vec!["IPv6"]),
                    2 => (vec![v4, v6], vec!["IPv4", "IPv6"]),
                    _ => (vec![v6, v4], vec!["IPv6", "IPv4"]),
                };
                let ports: Vec<Value> = ports
                    .iter()
                    .enumerate()
                    .map(|(k, (port, proto, node_port))| {
                        let mut p =
                            json!({"name": format!("p{k}"), "port": port, "protocol": proto});
                        if ty != "ClusterIP" {
                            p["nodePort"] = json!(node_port);
                        }
                        p
                    })
                    .collect();
                let mut spec = json!({
                    "type": ty, "clusterIP": ips[0], "clusterIPs": ips,
                    "ipFamilies": families, "ports": ports, "externalIPs": ext,
                });
                if let Some(t) = affinity {
                    spec["sessionAffinity"] = json!("ClientIP");
                    spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": t}});
                }
                if itp_local {
                    spec["internalTrafficPolicy"] = json!("Local");
                }
                let mut status = json!({});
                if ty == "LoadBalancer" {
                    if etp_local {
                        spec["externalTrafficPolicy"] = json!("Local");
                        spec["healthCheckNodePort"] = json!(32000);
                    }
                    if ranges {
                        spec["loadBalancerSourceRanges"] = json!(["192.168.7.0/24", "fd00:7::/64"]);
                    }
                    let ingress: Vec<Value> = lb.iter().map(|ip| json!({"ip": ip})).collect();
                    status = json!({"loadBalancer": {"ingress": ingress}});
                }
                json!({
                    "apiVersion": "v1", "kind": "Service",
                    "metadata": {"namespace": "default", "name": format!("s{i}"),
                                 "creationTimestamp": created},
                    "spec": spec, "status": status,
                })
            },
        )
}

fn endpoint() -> impl Strategy<Value = (usize, &'static str, u8)> {
    (0..3usize, pick(&["node1", "node2"]), 0..4u8)
}

/// An EndpointSlice `sI-J` of Service `sI`.
pub fn slice() -> impl Strategy<Value = Value> {
    (
        (0..SERVICES, 0..2usize, any::<bool>()),
        proptest::collection::vec((0..2usize, pick(&[8080u16, 8443]), pick(&["TCP", "UDP"])), 0..=2),
        proptest::collection::vec(endpoint(), 0..=3),
    )
        .prop_map(|((i, j, v6), ports, eps)| {
            let ports: Vec<Value> = ports
                .iter()
                .map(|(k, port, proto)| json!({"name": format!("p{k}"), "port": port, "protocol": proto}))
                .collect();
            let eps: Vec<Value> = eps
                .iter()
                .map(|(ip, node, cond)| {
                    let addr = if v6 { V6_PODS[ip % V6_PODS.len()] } else { V4_PODS[*ip] };
                    // ready; not ready; terminating but serving; terminating.
                    let (ready, serving, terminating) = match cond {
                        0 => (true, true, false),
                        1 => (false, false, false),
                        2 => (false, true, true),
                        _ => (false, false, true),
                    };
                    json!({"addresses": [addr], "nodeName": node,
                           "conditions": {"ready": ready, "serving": serving, "terminating": terminating}})
                })
                .collect();
            json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"namespace": "default", "name": format!("s{i}-{j}"),
                             "labels": {"kubernetes.io/service-name": format!("s{i}")}},
                "addressType": if v6 { "IPv6" } else { "IPv4" },
                "ports": ports, "endpoints": eps,
            })
        })
}

/// One update: a Service or a slice applied (5 each in 12), or deleted.
pub fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => service().prop_map(Step::Apply),
        5 => slice().prop_map(Step::Apply),
        1 => (0..SERVICES).prop_map(Step::DeleteService),
        1 => (0..SERVICES, 0..2usize).prop_map(|(i, j)| Step::DeleteSlice(i, j)),
        1 => service_cidr().prop_map(Step::Apply),
        1 => (0..2usize).prop_map(Step::DeleteServiceCidr),
    ]
}

/// A ServiceCIDR `c0` or `c1`: at most one range per family, as the API
/// server allows; the two may name the same range.
pub fn service_cidr() -> impl Strategy<Value = Value> {
    (
        0..2usize,
        proptest::option::of(pick(&["10.96.0.0/16", "10.97.0.0/24"])),
        proptest::option::of(pick(&["fd00:96::/108", "fd00:97::/112"])),
    )
        .prop_map(|(i, v4, v6)| {
            let cidrs: Vec<&str> = v4.into_iter().chain(v6).collect();
            json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                "metadata": {"name": format!("c{i}")}, "spec": {"cidrs": cidrs}})
        })
}

/// A tracker of `family` on node1, the node the sequences' local
/// endpoints are on.
pub fn tracker(family: IpFamily) -> ChangeTracker {
    ChangeTracker::new(TrackerConfig {
        family,
        node_name: "node1".into(),
        service_proxy_name: None,
    })
}

/// Feeds `step` to a tracker as the binary would.
pub fn apply(t: &mut ChangeTracker, step: &Step) {
    let now = SystemTime::now();
    match step {
        // Objects the model rejects (a duplicate port, say) leave the
        // previous version in place, as in the binary.
        Step::Apply(v) if v["kind"] == "Service" => {
            let s: Service = serde_json::from_value(v.clone()).expect("generated Service");
            let _ = t.update_service(&s, now);
        }
        Step::Apply(v) if v["kind"] == "ServiceCIDR" => {
            let c: ServiceCIDR = serde_json::from_value(v.clone()).expect("generated ServiceCIDR");
            let _ = t.update_service_cidr(&c);
        }
        Step::Apply(v) => {
            let s: EndpointSlice =
                serde_json::from_value(v.clone()).expect("generated EndpointSlice");
            let _ = t.update_endpoint_slice(&s, now);
        }
        Step::DeleteService(i) => t.delete_service("default", &format!("s{i}"), now),
        Step::DeleteSlice(i, j) => t.delete_endpoint_slice("default", &format!("s{i}-{j}"), now),
        Step::DeleteServiceCidr(i) => {
            let _ = t.delete_service_cidr(&format!("c{i}"));
        }
    }
}
