//! The same objects, sent as JSON and as protobuf, make the same model.
//!
//! Arbitrary Services, EndpointSlices, Nodes and ServiceCIDRs (k8s-openapi
//! values as an API server's JSON can carry them: what Go omits when empty
//! is absent, never empty) are encoded twice: as JSON through serde, and as
//! protobuf through prost the way the API server's Go code writes them
//! (every non-pointer field present, even when empty or zero; the zero time
//! as 0 s 0 ns), each in a list body. Both go through the source's decoding
//! (objects.rs) and then through kp-model's conversion, which must give the
//! same result: the service ports, endpoints, node details and ranges for
//! both families, the same warnings, the same refusals.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_pb::api::core::v1 as pbcore;
use k8s_pb::api::discovery::v1 as pbdisc;
use k8s_pb::api::networking::v1 as pbnet;
use k8s_pb::apimachinery::pkg::apis::meta::v1 as pbmeta;
use k8s_pb::apimachinery::pkg::runtime::{TypeMeta, Unknown};
use kp_model::IpFamily;
use kp_source::codec::Format;
use kp_source::objects::WireObject;
use proptest::option::of;
use proptest::prelude::*;
use prost::Message;

// --- the API server's protobuf, as its Go code writes it ---

/// A non-pointer Go string: written even when empty.
fn gs(v: &Option<String>) -> Option<String> {
    Some(v.clone().unwrap_or_default())
}

fn gi<T: Copy + Default>(v: Option<T>) -> Option<T> {
    Some(v.unwrap_or_default())
}

/// Go's metav1.Time: the zero time is an empty message; otherwise both
/// fields (a writer other than Go may well send nanoseconds, which JSON
/// never carries: they are written here to be dropped).
fn gtime(t: &Option<meta::Time>) -> Option<pbmeta::Time> {
    Some(match t {
        Some(t) => pbmeta::Time {
            seconds: Some(t.0.as_second()),
            nanos: Some(t.0.subsec_nanosecond()),
        },
        None => pbmeta::Time::default(),
    })
}

fn gmeta(m: &meta::ObjectMeta) -> Option<pbmeta::ObjectMeta> {
    Some(pbmeta::ObjectMeta {
        name: gs(&m.name),
        generate_name: gs(&m.generate_name),
        namespace: gs(&m.namespace),
        self_link: gs(&m.self_link),
        uid: gs(&m.uid),
        resource_version: gs(&m.resource_version),
        generation: gi(m.generation),
        creation_timestamp: gtime(&m.creation_timestamp),
        deletion_timestamp: m
            .deletion_timestamp
            .as_ref()
            .and_then(|_| gtime(&m.deletion_timestamp)),
        deletion_grace_period_seconds: m.deletion_grace_period_seconds,
        labels: m.labels.clone().unwrap_or_default(),
        annotations: m.annotations.clone().unwrap_or_default(),
        owner_references: Vec::new(),
        finalizers: m.finalizers.clone().unwrap_or_default(),
        managed_fields: Vec::new(),
    })
}

fn pb_service(s: &core::Service) -> pbcore::Service {
    let spec = s.spec.clone().unwrap_or_default();
    let st = s.status.clone().unwrap_or_default();
    pbcore::Service {
        metadata: gmeta(&s.metadata),
        spec: Some(pbcore::ServiceSpec {
            ports: spec
                .ports
                .unwrap_or_default()
                .into_iter()
                .map(|p| pbcore::ServicePort {
                    name: gs(&p.name),
                    protocol: gs(&p.protocol),
                    app_protocol: p.app_protocol,
                    port: Some(p.port),
                    target_port: Some(match p.target_port {
                        Some(IntOrString::String(s)) => {
                            k8s_pb::apimachinery::pkg::util::intstr::IntOrString {
                                r#type: Some(1),
                                int_val: Some(0),
                                str_val: Some(s),
                            }
                        }
                        Some(IntOrString::Int(i)) => {
                            k8s_pb::apimachinery::pkg::util::intstr::IntOrString {
                                r#type: Some(0),
                                int_val: Some(i),
                                str_val: Some(String::new()),
                            }
                        }
                        None => Default::default(),
                    }),
                    node_port: gi(p.node_port),
                })
                .collect(),
            selector: spec.selector.unwrap_or_default(),
            cluster_ip: gs(&spec.cluster_ip),
            cluster_ips: spec.cluster_ips.unwrap_or_default(),
            r#type: gs(&spec.type_),
            external_ips: spec.external_ips.unwrap_or_default(),
            session_affinity: gs(&spec.session_affinity),
            load_balancer_ip: gs(&spec.load_balancer_ip),
            load_balancer_source_ranges: spec.load_balancer_source_ranges.unwrap_or_default(),
            external_name: gs(&spec.external_name),
            external_traffic_policy: gs(&spec.external_traffic_policy),
            health_check_node_port: gi(spec.health_check_node_port),
            publish_not_ready_addresses: gi(spec.publish_not_ready_addresses),
            session_affinity_config: spec.session_affinity_config.map(|c| {
                pbcore::SessionAffinityConfig {
                    client_ip: c.client_ip.map(|ip| pbcore::ClientIpConfig {
                        timeout_seconds: ip.timeout_seconds,
                    }),
                }
            }),
            ip_families: spec.ip_families.unwrap_or_default(),
            ip_family_policy: spec.ip_family_policy,
            allocate_load_balancer_node_ports: spec.allocate_load_balancer_node_ports,
            load_balancer_class: spec.load_balancer_class,
            internal_traffic_policy: spec.internal_traffic_policy,
            traffic_distribution: spec.traffic_distribution,
        }),
        status: Some(pbcore::ServiceStatus {
            load_balancer: Some(pbcore::LoadBalancerStatus {
                ingress: st
                    .load_balancer
                    .and_then(|lb| lb.ingress)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|i| pbcore::LoadBalancerIngress {
                        ip: gs(&i.ip),
                        hostname: gs(&i.hostname),
                        ip_mode: i.ip_mode,
                        ports: Vec::new(),
                    })
                    .collect(),
            }),
            conditions: Vec::new(),
        }),
    }
}

fn pb_slice(s: &discovery::EndpointSlice) -> pbdisc::EndpointSlice {
    pbdisc::EndpointSlice {
        metadata: gmeta(&s.metadata),
        address_type: Some(s.address_type.clone()),
        endpoints: s
            .endpoints
            .iter()
            .map(|e| pbdisc::Endpoint {
                addresses: e.addresses.clone(),
                // A non-pointer struct: always there.
                conditions: Some(e.conditions.clone().map_or_else(Default::default, |c| {
                    pbdisc::EndpointConditions {
                        ready: c.ready,
                        serving: c.serving,
                        terminating: c.terminating,
                    }
                })),
                hostname: e.hostname.clone(),
                target_ref: None,
                deprecated_topology: e.deprecated_topology.clone().unwrap_or_default(),
                node_name: e.node_name.clone(),
                zone: e.zone.clone(),
                hints: e.hints.as_ref().map(|h| pbdisc::EndpointHints {
                    for_zones: h
                        .for_zones
                        .iter()
                        .flatten()
                        .map(|z| pbdisc::ForZone {
                            name: Some(z.name.clone()),
                        })
                        .collect(),
                    for_nodes: h
                        .for_nodes
                        .iter()
                        .flatten()
                        .map(|z| pbdisc::ForNode {
                            name: Some(z.name.clone()),
                        })
                        .collect(),
                }),
            })
            .collect(),
        ports: s
            .ports
            .iter()
            .flatten()
            .map(|p| pbdisc::EndpointPort {
                name: p.name.clone(),
                protocol: p.protocol.clone(),
                port: p.port,
                app_protocol: p.app_protocol.clone(),
            })
            .collect(),
    }
}

fn pb_node(n: &core::Node) -> pbcore::Node {
    let spec = n.spec.clone().unwrap_or_default();
    let st = n.status.clone().unwrap_or_default();
    pbcore::Node {
        metadata: gmeta(&n.metadata),
        spec: Some(pbcore::NodeSpec {
            pod_cidr: gs(&spec.pod_cidr),
            pod_cid_rs: spec.pod_cidrs.unwrap_or_default(),
            provider_id: gs(&spec.provider_id),
            unschedulable: gi(spec.unschedulable),
            taints: spec
                .taints
                .unwrap_or_default()
                .into_iter()
                .map(|t| pbcore::Taint {
                    key: Some(t.key),
                    value: gs(&t.value),
                    effect: Some(t.effect),
                    time_added: t.time_added.as_ref().and_then(|_| gtime(&t.time_added)),
                })
                .collect(),
            config_source: None,
            external_id: gs(&spec.external_id),
        }),
        status: Some(pbcore::NodeStatus {
            addresses: st
                .addresses
                .unwrap_or_default()
                .into_iter()
                .map(|a| pbcore::NodeAddress {
                    r#type: Some(a.type_),
                    address: Some(a.address),
                })
                .collect(),
            ..Default::default()
        }),
    }
}

fn pb_cidr(c: &networking::ServiceCIDR) -> pbnet::ServiceCIDR {
    pbnet::ServiceCIDR {
        metadata: gmeta(&c.metadata),
        spec: Some(pbnet::ServiceCIDRSpec {
            cidrs: c.spec.clone().and_then(|s| s.cidrs).unwrap_or_default(),
        }),
        status: Some(Default::default()),
    }
}

/// `list` (a list message) enveloped as the server sends it.
fn pb_body(kind: &str, list: &impl Message) -> Vec<u8> {
    let u = Unknown {
        type_meta: Some(TypeMeta {
            api_version: Some("v1".into()),
            kind: Some(kind.into()),
        }),
        raw: Some(list.encode_to_vec()),
        content_encoding: Some(String::new()),
        content_type: Some(String::new()),
    };
    let mut out = b"k8s\0".to_vec();
    out.extend(u.encode_to_vec());
    out
}

fn json_body<T: serde::Serialize>(items: &[T]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "kind": "List", "apiVersion": "v1",
        "metadata": {"resourceVersion": "9"},
        "items": items,
    }))
    .unwrap()
}

/// Both encodings of `items`, decoded by the source.
fn both<K: WireObject + serde::Serialize>(items: &[K], pb: Vec<u8>) -> (Vec<K>, Vec<K>) {
    let (jm, from_json) = K::list(Format::Json, &json_body(items)).unwrap();
    let (pm, from_pb) = K::list(Format::Protobuf, &pb).unwrap();
    assert_eq!(jm.resource_version, "9");
    assert_eq!(pm.resource_version, "9");
    (from_json, from_pb)
}

fn pb_list_meta() -> Option<pbmeta::ListMeta> {
    Some(pbmeta::ListMeta {
        resource_version: Some("9".into()),
        ..Default::default()
    })
}

// --- arbitrary objects ---

fn word(words: &'static [&'static str]) -> impl Strategy<Value = String> {
    proptest::sample::select(words).prop_map(str::to_string)
}

fn opt_word(words: &'static [&'static str]) -> impl Strategy<Value = Option<String>> {
    of(word(words))
}

const IPS: &[&str] = &[
    "10.0.0.1",
    "10.96.0.10",
    "192.0.2.5",
    "010.1.2.3",
    "fd00::1",
    "2001:db8::7",
    "bogus",
    "None",
];
const CIDRS: &[&str] = &[
    "10.96.0.0/16",
    "fd00:96::/108",
    "10.0.0.1/24",
    "bad/33",
    "192.0.2.0/24",
];
const NAMES: &[&str] = &["web", "a", "x-1", "Bad_Name", "node-a"];

fn time() -> impl Strategy<Value = Option<meta::Time>> {
    of((0i64..4_000_000_000, 0i32..1_000_000_000)
        .prop_map(|(s, n)| meta::Time(k8s_openapi::jiff::Timestamp::new(s, n).unwrap())))
}

fn labels() -> impl Strategy<Value = Option<BTreeMap<String, String>>> {
    of(proptest::collection::btree_map(
        word(&[
            "service.kubernetes.io/service-proxy-name",
            "service.kubernetes.io/headless",
            "kubernetes.io/service-name",
            "topology.kubernetes.io/zone",
            "app",
        ]),
        word(&["web", "p", "z1", ""]),
        1..4,
    ))
}

fn object_meta(namespaced: bool) -> impl Strategy<Value = meta::ObjectMeta> {
    (
        opt_word(NAMES),
        if namespaced {
            opt_word(&["default", "ns-1", "Bad_NS"]).boxed()
        } else {
            Just(None).boxed()
        },
        labels(),
        of(proptest::collection::btree_map(
            word(&["endpoints.kubernetes.io/last-change-trigger-time", "a"]),
            word(&[
                "2026-01-02T03:04:05Z",
                "2026-01-02T03:04:05.123456789Z",
                "garbage",
            ]),
            1..3,
        )),
        time(),
        time(),
        of(1i64..100),
        opt_word(&["123", "456"]),
    )
        .prop_map(
            |(name, namespace, labels, annotations, created, deleted, generation, rv)| {
                meta::ObjectMeta {
                    name,
                    namespace,
                    labels,
                    annotations,
                    creation_timestamp: created,
                    deletion_timestamp: deleted,
                    generation,
                    resource_version: rv,
                    uid: Some("u-1".into()),
                    ..Default::default()
                }
            },
        )
}

fn service_port() -> impl Strategy<Value = core::ServicePort> {
    (
        opt_word(&["http", "dns", "Bad_"]),
        prop_oneof![1i32..70000, Just(0), Just(80), Just(53)],
        opt_word(&["TCP", "UDP", "SCTP", "ICMP"]),
        of(prop_oneof![30000i32..30010, 1i32..70000]),
        of(prop_oneof![
            (1i32..70000).prop_map(IntOrString::Int),
            word(&["web", "http"]).prop_map(IntOrString::String)
        ]),
        of(word(&["http", ""])),
    )
        .prop_map(
            |(name, port, protocol, node_port, target_port, app_protocol)| core::ServicePort {
                name,
                port,
                protocol,
                node_port,
                target_port,
                app_protocol,
            },
        )
}

fn service() -> impl Strategy<Value = core::Service> {
    let spec = (
        opt_word(&["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]),
        opt_word(IPS),
        of(proptest::collection::vec(word(IPS), 1..3)),
        of(proptest::collection::vec(service_port(), 1..4)),
        of(proptest::collection::vec(word(IPS), 1..3)),
        of(proptest::collection::vec(word(CIDRS), 1..3)),
        opt_word(&["ClientIP", "None"]),
        of(of(1i32..90000)),
        (
            opt_word(&["Local", "Cluster"]),
            of(word(&["Local", "Cluster", ""])),
            of(30000i32..30010),
            of(word(&["PreferClose", "PreferSameNode", ""])),
        ),
    )
        .prop_map(
            |(ty, cip, cips, ports, eips, ranges, aff, aff_to, (etp, itp, hc, td))| {
                core::ServiceSpec {
                    type_: ty,
                    cluster_ip: cip,
                    cluster_ips: cips,
                    ports,
                    external_ips: eips,
                    load_balancer_source_ranges: ranges,
                    session_affinity: aff,
                    session_affinity_config: aff_to.map(|t| core::SessionAffinityConfig {
                        client_ip: Some(core::ClientIPConfig { timeout_seconds: t }),
                    }),
                    external_traffic_policy: etp,
                    internal_traffic_policy: itp,
                    health_check_node_port: hc,
                    traffic_distribution: td,
                    ..Default::default()
                }
            },
        );
    let ingress = proptest::collection::vec(
        (
            opt_word(IPS),
            opt_word(&["lb.example.com"]),
            of(word(&["VIP", "Proxy", ""])),
        )
            .prop_map(|(ip, hostname, ip_mode)| core::LoadBalancerIngress {
                ip,
                hostname,
                ip_mode,
                ports: None,
            }),
        1..3,
    );
    (object_meta(true), spec, of(ingress)).prop_map(|(metadata, spec, ingress)| core::Service {
        metadata,
        // The server always sends a spec and a status.
        spec: Some(spec),
        status: Some(core::ServiceStatus {
            load_balancer: Some(core::LoadBalancerStatus { ingress }),
            conditions: None,
        }),
    })
}

fn endpoint() -> impl Strategy<Value = discovery::Endpoint> {
    (
        proptest::collection::vec(word(IPS), 1..3),
        (of(any::<bool>()), of(any::<bool>()), of(any::<bool>())),
        of(word(&["node-a", "node-b", ""])),
        of(word(&["z1", "z2", ""])),
        of((
            of(proptest::collection::vec(word(&["z1", "z2"]), 0..3)),
            of(proptest::collection::vec(word(&["node-a", "node-b"]), 0..3)),
        )),
        of(word(&["pod-a"])),
    )
        .prop_map(
            |(addresses, (ready, serving, terminating), node_name, zone, hints, hostname)| {
                discovery::Endpoint {
                    addresses,
                    // A non-pointer struct: the server always sends it.
                    conditions: Some(discovery::EndpointConditions {
                        ready,
                        serving,
                        terminating,
                    }),
                    node_name,
                    zone,
                    hostname,
                    hints: hints.map(|(z, n)| discovery::EndpointHints {
                        // omitempty: an empty list is not sent.
                        for_zones: z.filter(|v| !v.is_empty()).map(|v| {
                            v.into_iter()
                                .map(|name| discovery::ForZone { name })
                                .collect()
                        }),
                        for_nodes: n.filter(|v| !v.is_empty()).map(|v| {
                            v.into_iter()
                                .map(|name| discovery::ForNode { name })
                                .collect()
                        }),
                    }),
                    ..Default::default()
                }
            },
        )
}

fn slice() -> impl Strategy<Value = discovery::EndpointSlice> {
    (
        object_meta(true),
        word(&["IPv4", "IPv6", "FQDN"]),
        proptest::collection::vec(endpoint(), 0..5),
        of(proptest::collection::vec(
            (
                of(word(&["http", "dns", "", "Bad_"])),
                of(prop_oneof![1i32..70000, Just(0)]),
                of(word(&["TCP", "UDP", "SCTP", "ICMP", ""])),
            )
                .prop_map(|(name, port, protocol)| discovery::EndpointPort {
                    name,
                    port,
                    protocol,
                    app_protocol: None,
                }),
            1..3,
        )),
    )
        .prop_map(
            |(metadata, address_type, endpoints, ports)| discovery::EndpointSlice {
                metadata,
                address_type,
                endpoints,
                ports,
            },
        )
}

fn node() -> impl Strategy<Value = core::Node> {
    (
        object_meta(false),
        opt_word(CIDRS),
        of(proptest::collection::vec(word(CIDRS), 1..3)),
        of(proptest::collection::vec(
            (
                word(&["ToBeDeletedByClusterAutoscaler", "other"]),
                word(&["NoSchedule", "NoExecute"]),
            )
                .prop_map(|(key, effect)| core::Taint {
                    key,
                    effect,
                    ..Default::default()
                }),
            1..3,
        )),
        of(proptest::collection::vec(
            (word(&["InternalIP", "ExternalIP", "Hostname"]), word(IPS))
                .prop_map(|(type_, address)| core::NodeAddress { type_, address }),
            1..4,
        )),
    )
        .prop_map(
            |(metadata, pod_cidr, pod_cidrs, taints, addresses)| core::Node {
                metadata,
                spec: Some(core::NodeSpec {
                    pod_cidr,
                    pod_cidrs,
                    taints,
                    ..Default::default()
                }),
                status: Some(core::NodeStatus {
                    addresses,
                    ..Default::default()
                }),
            },
        )
}

fn cidr() -> impl Strategy<Value = networking::ServiceCIDR> {
    (
        object_meta(false),
        of(proptest::collection::vec(word(CIDRS), 1..3)),
    )
        .prop_map(|(metadata, cidrs)| networking::ServiceCIDR {
            metadata,
            spec: Some(networking::ServiceCIDRSpec { cidrs }),
            status: None,
        })
}

// --- the model from both ---

fn service_model(s: &core::Service) -> impl PartialEq + std::fmt::Debug {
    let mut out = Vec::new();
    for family in [IpFamily::V4, IpFamily::V6] {
        for owner in [None, Some("p")] {
            let mut w = Vec::new();
            let r = kp_model::convert_service(s, family, owner, &mut w);
            out.push((r, w));
        }
    }
    // What the tracker reads besides: the creation time.
    (out, s.metadata.creation_timestamp.clone())
}

fn slice_model(s: &discovery::EndpointSlice) -> impl PartialEq + std::fmt::Debug {
    let mut out = Vec::new();
    for family in [IpFamily::V4, IpFamily::V6] {
        for node in ["node-a", ""] {
            let mut w = Vec::new();
            let r = kp_model::convert_endpoint_slice(s, family, node, &mut w);
            out.push((r, w));
        }
    }
    // The tracker's trigger time comes from the annotations.
    (out, s.metadata.annotations.clone())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn services_decode_to_the_same_model(items in proptest::collection::vec(service(), 1..4)) {
        let pb = pb_body("ServiceList", &pbcore::ServiceList {
            metadata: pb_list_meta(),
            items: items.iter().map(pb_service).collect(),
        });
        let (j, p) = both(&items, pb);
        prop_assert_eq!(j.len(), items.len());
        for (j, p) in j.iter().zip(&p) {
            prop_assert_eq!(service_model(j), service_model(p));
        }
    }

    #[test]
    fn slices_decode_to_the_same_model(items in proptest::collection::vec(slice(), 1..4)) {
        let pb = pb_body("EndpointSliceList", &pbdisc::EndpointSliceList {
            metadata: pb_list_meta(),
            items: items.iter().map(pb_slice).collect(),
        });
        let (j, p) = both(&items, pb);
        prop_assert_eq!(j.len(), items.len());
        for (j, p) in j.iter().zip(&p) {
            prop_assert_eq!(slice_model(j), slice_model(p));
        }
    }

    #[test]
    fn nodes_decode_to_the_same_model(items in proptest::collection::vec(node(), 1..3)) {
        let pb = pb_body("NodeList", &pbcore::NodeList {
            metadata: pb_list_meta(),
            items: items.iter().map(pb_node).collect(),
        });
        let (j, p) = both(&items, pb);
        for (j, p) in j.iter().zip(&p) {
            prop_assert_eq!(kp_model::convert_node(j), kp_model::convert_node(p));
        }
    }

    #[test]
    fn service_cidrs_decode_to_the_same_model(items in proptest::collection::vec(cidr(), 1..3)) {
        let pb = pb_body("ServiceCIDRList", &pbnet::ServiceCIDRList {
            metadata: pb_list_meta(),
            items: items.iter().map(pb_cidr).collect(),
        });
        let (j, p) = both(&items, pb);
        for (j, p) in j.iter().zip(&p) {
            let (mut wj, mut wp) = (Vec::new(), Vec::new());
            prop_assert_eq!(
                (kp_model::convert_service_cidr(j, &mut wj), wj, &j.metadata.name),
                (kp_model::convert_service_cidr(p, &mut wp), wp, &p.metadata.name)
            );
        }
    }
}
