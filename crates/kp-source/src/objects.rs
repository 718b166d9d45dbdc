//! The four kinds the API source reads, in both encodings: JSON through
//! serde into k8s-openapi's types (the rest of the proxy takes those), and
//! protobuf through k8s-pb's prost messages, converted field by field into
//! the same types.
//!
//! The conversion covers every field the proxy reads and the metadata
//! around them (not managedFields, not the Node's status beyond its
//! addresses, not a ServiceCIDR's status). Protobuf and JSON differ in how
//! they say "unset": the API server's protobuf writes every non-pointer
//! field of the Go type (an empty string, a zero, false, a zero time),
//! where its JSON omits them (`omitempty`). Those fields come out as `None`
//! here when empty, as JSON gives them; pointer fields (`nodeName`,
//! `zone`, `appProtocol`, conditions...) keep the difference between unset
//! and empty in both. tests/wire_model.rs holds the two paths to the same
//! model, and against a real API server to the same objects.

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
use prost::Message;
use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::codec::{self, CodecError, ListMeta, RawObject};
use crate::service::ProxiedService;

/// A kind the API source lists and watches.
pub trait WireObject: Sized + Clone + Send + Sync + 'static {
    /// The collection's path, e.g. `/api/v1/services`.
    const PATH: &'static str;
    /// The kind in envelopes and errors, e.g. `Service`.
    const KIND: &'static str;
    /// The list's kind, e.g. `ServiceList`.
    const LIST_KIND: &'static str;
    /// The JSON shape it is read through (ProxiedService for Services).
    type Json: DeserializeOwned + Into<Self>;
    type Pb: Message + Default;
    type PbList: Message + Default + PbList<Item = Self::Pb>;

    fn meta(&self) -> &meta::ObjectMeta;

    /// The protobuf message as k8s-openapi's type.
    fn from_pb(pb: Self::Pb) -> Self;

    /// One object from a watch event.
    fn from_raw(raw: &RawObject) -> Result<Self, CodecError> {
        match raw {
            RawObject::Protobuf(u) => {
                let msg = Self::Pb::decode(codec::payload(u, Self::KIND)?).map_err(|source| {
                    CodecError::Protobuf {
                        what: Self::KIND,
                        source,
                    }
                })?;
                Ok(Self::from_pb(msg))
            }
            RawObject::Json(v) => serde_json::from_str::<Self::Json>(v.get())
                .map(Into::into)
                .map_err(|source| CodecError::Json {
                    what: Self::KIND,
                    source,
                }),
        }
    }

    /// A list response's body.
    fn list(format: codec::Format, body: &[u8]) -> Result<(ListMeta, Vec<Self>), CodecError> {
        match format {
            codec::Format::Protobuf => {
                let u = codec::envelope(body)?;
                let list = Self::PbList::decode(codec::payload(&u, Self::LIST_KIND)?).map_err(
                    |source| CodecError::Protobuf {
                        what: Self::LIST_KIND,
                        source,
                    },
                )?;
                let (m, items) = list.parts();
                Ok((m, items.into_iter().map(Self::from_pb).collect()))
            }
            codec::Format::Json => {
                #[derive(Deserialize)]
                #[serde(bound = "T: DeserializeOwned")]
                struct JsonList<T> {
                    #[serde(default)]
                    metadata: JsonListMeta,
                    #[serde(default = "Vec::new", deserialize_with = "nullable_vec")]
                    items: Vec<T>,
                }
                #[derive(Deserialize, Default)]
                #[serde(rename_all = "camelCase")]
                struct JsonListMeta {
                    #[serde(default)]
                    resource_version: Option<String>,
                    #[serde(default, rename = "continue")]
                    continue_token: Option<String>,
                }
                fn nullable_vec<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
                where
                    D: serde::Deserializer<'de>,
                    T: Deserialize<'de>,
                {
                    Ok(Option::<Vec<T>>::deserialize(d)?.unwrap_or_default())
                }
                let l: JsonList<Self::Json> =
                    serde_json::from_slice(body).map_err(|source| CodecError::Json {
                        what: Self::LIST_KIND,
                        source,
                    })?;
                Ok((
                    ListMeta {
                        resource_version: l.metadata.resource_version.unwrap_or_default(),
                        continue_token: l.metadata.continue_token.unwrap_or_default(),
                    },
                    l.items.into_iter().map(Into::into).collect(),
                ))
            }
        }
    }
}

/// A protobuf list message: its metadata and items.
pub trait PbList {
    type Item;
    fn parts(self) -> (ListMeta, Vec<Self::Item>);
}

macro_rules! pb_list {
    ($list:ty, $item:ty) => {
        impl PbList for $list {
            type Item = $item;
            fn parts(self) -> (ListMeta, Vec<$item>) {
                (self.metadata.unwrap_or_default().into(), self.items)
            }
        }
    };
}
pb_list!(pbcore::ServiceList, pbcore::Service);
pb_list!(pbdisc::EndpointSliceList, pbdisc::EndpointSlice);
pb_list!(pbcore::NodeList, pbcore::Node);
pb_list!(pbnet::ServiceCIDRList, pbnet::ServiceCIDR);

impl WireObject for core::Service {
    const PATH: &'static str = "/api/v1/services";
    const KIND: &'static str = "Service";
    const LIST_KIND: &'static str = "ServiceList";
    type Json = ProxiedService;
    type Pb = pbcore::Service;
    type PbList = pbcore::ServiceList;
    fn meta(&self) -> &meta::ObjectMeta {
        &self.metadata
    }
    fn from_pb(pb: Self::Pb) -> Self {
        service(pb)
    }
}

impl WireObject for discovery::EndpointSlice {
    const PATH: &'static str = "/apis/discovery.k8s.io/v1/endpointslices";
    const KIND: &'static str = "EndpointSlice";
    const LIST_KIND: &'static str = "EndpointSliceList";
    type Json = discovery::EndpointSlice;
    type Pb = pbdisc::EndpointSlice;
    type PbList = pbdisc::EndpointSliceList;
    fn meta(&self) -> &meta::ObjectMeta {
        &self.metadata
    }
    fn from_pb(pb: Self::Pb) -> Self {
        endpoint_slice(pb)
    }
}

impl WireObject for core::Node {
    const PATH: &'static str = "/api/v1/nodes";
    const KIND: &'static str = "Node";
    const LIST_KIND: &'static str = "NodeList";
    type Json = core::Node;
    type Pb = pbcore::Node;
    type PbList = pbcore::NodeList;
    fn meta(&self) -> &meta::ObjectMeta {
        &self.metadata
    }
    fn from_pb(pb: Self::Pb) -> Self {
        node(pb)
    }
}

impl WireObject for networking::ServiceCIDR {
    const PATH: &'static str = "/apis/networking.k8s.io/v1/servicecidrs";
    const KIND: &'static str = "ServiceCIDR";
    const LIST_KIND: &'static str = "ServiceCIDRList";
    type Json = networking::ServiceCIDR;
    type Pb = pbnet::ServiceCIDR;
    type PbList = pbnet::ServiceCIDRList;
    fn meta(&self) -> &meta::ObjectMeta {
        &self.metadata
    }
    fn from_pb(pb: Self::Pb) -> Self {
        service_cidr(pb)
    }
}

// --- protobuf -> k8s-openapi, field by field ---

/// A non-pointer Go string: empty is unset.
fn s(v: Option<String>) -> Option<String> {
    v.filter(|s| !s.is_empty())
}

/// A required string (k8s-openapi's `String`).
fn req(v: Option<String>) -> String {
    v.unwrap_or_default()
}

/// A non-pointer Go integer: zero is unset.
fn n<T: Default + PartialEq>(v: Option<T>) -> Option<T> {
    v.filter(|x| *x != T::default())
}

/// A non-pointer Go bool: false is unset.
fn b(v: Option<bool>) -> Option<bool> {
    v.filter(|x| *x)
}

/// A list: empty is unset (`omitempty`).
fn list<T, U>(v: Vec<T>, f: impl Fn(T) -> U) -> Option<Vec<U>> {
    (!v.is_empty()).then(|| v.into_iter().map(f).collect())
}

fn strings(v: Vec<String>) -> Option<Vec<String>> {
    list(v, |x| x)
}

fn map(m: BTreeMap<String, String>) -> Option<BTreeMap<String, String>> {
    (!m.is_empty()).then_some(m)
}

/// A time. Go's metav1.Time writes its zero value as an empty message
/// (unset) and keeps whole seconds only, in protobuf as in JSON (its
/// Unmarshal drops the nanoseconds): so do we. A time out of range is
/// dropped, not a failure.
fn time(t: Option<pbmeta::Time>) -> Option<meta::Time> {
    let t = t?;
    if t.seconds.is_none() && t.nanos.is_none() {
        return None;
    }
    k8s_openapi::jiff::Timestamp::new(t.seconds.unwrap_or(0), 0)
        .ok()
        .map(meta::Time)
}

fn object_meta(m: Option<pbmeta::ObjectMeta>) -> meta::ObjectMeta {
    let m = m.unwrap_or_default();
    meta::ObjectMeta {
        annotations: map(m.annotations),
        creation_timestamp: time(m.creation_timestamp),
        deletion_grace_period_seconds: m.deletion_grace_period_seconds,
        deletion_timestamp: time(m.deletion_timestamp),
        finalizers: strings(m.finalizers),
        generate_name: s(m.generate_name),
        generation: n(m.generation),
        labels: map(m.labels),
        managed_fields: None,
        name: s(m.name),
        namespace: s(m.namespace),
        owner_references: list(m.owner_references, |o| meta::OwnerReference {
            api_version: req(o.api_version),
            block_owner_deletion: o.block_owner_deletion,
            controller: o.controller,
            kind: req(o.kind),
            name: req(o.name),
            uid: req(o.uid),
        }),
        resource_version: s(m.resource_version),
        self_link: s(m.self_link),
        uid: s(m.uid),
    }
}

fn object_reference(r: pbcore::ObjectReference) -> core::ObjectReference {
    core::ObjectReference {
        api_version: s(r.api_version),
        field_path: s(r.field_path),
        kind: s(r.kind),
        name: s(r.name),
        namespace: s(r.namespace),
        resource_version: s(r.resource_version),
        uid: s(r.uid),
    }
}

fn int_or_string(v: k8s_pb::apimachinery::pkg::util::intstr::IntOrString) -> IntOrString {
    // Type 1 is a string, anything else the integer (0 is the Go zero value).
    match v.r#type {
        Some(1) => IntOrString::String(v.str_val.unwrap_or_default()),
        _ => IntOrString::Int(v.int_val.unwrap_or(0)),
    }
}

fn service(v: pbcore::Service) -> core::Service {
    core::Service {
        metadata: object_meta(v.metadata),
        spec: v.spec.map(service_spec),
        // As the JSON path reads it: the load balancer's status only
        // (see service.rs for why not the conditions).
        status: v.status.map(|st| core::ServiceStatus {
            conditions: None,
            load_balancer: st.load_balancer.map(|lb| core::LoadBalancerStatus {
                ingress: list(lb.ingress, |i| core::LoadBalancerIngress {
                    hostname: s(i.hostname),
                    ip: s(i.ip),
                    ip_mode: i.ip_mode,
                    ports: list(i.ports, |p| core::PortStatus {
                        error: p.error,
                        port: p.port.unwrap_or(0),
                        protocol: req(p.protocol),
                    }),
                }),
            }),
        }),
    }
}

fn service_spec(sp: pbcore::ServiceSpec) -> core::ServiceSpec {
    core::ServiceSpec {
        allocate_load_balancer_node_ports: sp.allocate_load_balancer_node_ports,
        cluster_ip: s(sp.cluster_ip),
        cluster_ips: strings(sp.cluster_ips),
        external_ips: strings(sp.external_ips),
        external_name: s(sp.external_name),
        external_traffic_policy: s(sp.external_traffic_policy),
        health_check_node_port: n(sp.health_check_node_port),
        internal_traffic_policy: sp.internal_traffic_policy,
        ip_families: strings(sp.ip_families),
        ip_family_policy: sp.ip_family_policy,
        load_balancer_class: sp.load_balancer_class,
        load_balancer_ip: s(sp.load_balancer_ip),
        load_balancer_source_ranges: strings(sp.load_balancer_source_ranges),
        ports: list(sp.ports, |p| core::ServicePort {
            app_protocol: p.app_protocol,
            name: s(p.name),
            node_port: n(p.node_port),
            port: p.port.unwrap_or(0),
            protocol: s(p.protocol),
            target_port: p.target_port.map(int_or_string),
        }),
        publish_not_ready_addresses: b(sp.publish_not_ready_addresses),
        selector: map(sp.selector),
        session_affinity: s(sp.session_affinity),
        session_affinity_config: sp
            .session_affinity_config
            .map(|c| core::SessionAffinityConfig {
                client_ip: c.client_ip.map(|ip| core::ClientIPConfig {
                    timeout_seconds: ip.timeout_seconds,
                }),
            }),
        traffic_distribution: sp.traffic_distribution,
        type_: s(sp.r#type),
    }
}

fn endpoint_slice(v: pbdisc::EndpointSlice) -> discovery::EndpointSlice {
    discovery::EndpointSlice {
        address_type: req(v.address_type),
        endpoints: v
            .endpoints
            .into_iter()
            .map(|e| discovery::Endpoint {
                addresses: e.addresses,
                conditions: e.conditions.map(|c| discovery::EndpointConditions {
                    ready: c.ready,
                    serving: c.serving,
                    terminating: c.terminating,
                }),
                deprecated_topology: map(e.deprecated_topology),
                hints: e.hints.map(|h| discovery::EndpointHints {
                    for_nodes: list(h.for_nodes, |z| discovery::ForNode { name: req(z.name) }),
                    for_zones: list(h.for_zones, |z| discovery::ForZone { name: req(z.name) }),
                }),
                hostname: e.hostname,
                node_name: e.node_name,
                target_ref: e.target_ref.map(object_reference),
                zone: e.zone,
            })
            .collect(),
        metadata: object_meta(v.metadata),
        ports: list(v.ports, |p| discovery::EndpointPort {
            app_protocol: p.app_protocol,
            name: p.name,
            port: p.port,
            protocol: p.protocol,
        }),
    }
}

fn node(v: pbcore::Node) -> core::Node {
    core::Node {
        metadata: object_meta(v.metadata),
        spec: v.spec.map(|sp| core::NodeSpec {
            config_source: None,
            external_id: s(sp.external_id),
            pod_cidr: s(sp.pod_cidr),
            pod_cidrs: strings(sp.pod_cid_rs),
            provider_id: s(sp.provider_id),
            taints: list(sp.taints, |t| core::Taint {
                effect: req(t.effect),
                key: req(t.key),
                time_added: time(t.time_added),
                value: s(t.value),
            }),
            unschedulable: b(sp.unschedulable),
        }),
        // Only the addresses: the proxy reads nothing else of the
        // status, and images and volumes are most of a Node.
        status: v.status.map(|st| core::NodeStatus {
            addresses: list(st.addresses, |a| core::NodeAddress {
                address: req(a.address),
                type_: req(a.r#type),
            }),
            ..Default::default()
        }),
    }
}

fn service_cidr(v: pbnet::ServiceCIDR) -> networking::ServiceCIDR {
    networking::ServiceCIDR {
        metadata: object_meta(v.metadata),
        spec: v.spec.map(|sp| networking::ServiceCIDRSpec {
            cidrs: strings(sp.cidrs),
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_is_unset_in_both_encodings() {
        // What the server's protobuf writes for a Service with little set.
        let pb = pbcore::Service {
            metadata: Some(pbmeta::ObjectMeta {
                name: Some("web".into()),
                namespace: Some("ns".into()),
                generate_name: Some(String::new()),
                generation: Some(0),
                // Go's zero time: an empty message.
                creation_timestamp: Some(pbmeta::Time {
                    seconds: None,
                    nanos: None,
                }),
                ..Default::default()
            }),
            spec: Some(pbcore::ServiceSpec {
                ports: vec![pbcore::ServicePort {
                    name: Some(String::new()),
                    protocol: Some("TCP".into()),
                    port: Some(80),
                    target_port: Some(k8s_pb::apimachinery::pkg::util::intstr::IntOrString {
                        r#type: Some(1),
                        int_val: Some(0),
                        str_val: Some("http".into()),
                    }),
                    node_port: Some(0),
                    app_protocol: None,
                }],
                cluster_ip: Some("10.0.0.1".into()),
                load_balancer_ip: Some(String::new()),
                publish_not_ready_addresses: Some(false),
                health_check_node_port: Some(0),
                traffic_distribution: Some(String::new()),
                ..Default::default()
            }),
            status: None,
        };
        let svc = service(pb);
        let m = &svc.metadata;
        assert_eq!(m.name.as_deref(), Some("web"));
        assert_eq!((&m.generate_name, m.generation), (&None, None));
        assert!(m.creation_timestamp.is_none());
        let sp = svc.spec.unwrap();
        let p = &sp.ports.as_ref().unwrap()[0];
        assert_eq!((&p.name, p.node_port, p.port), (&None, None, 80));
        assert_eq!(p.target_port, Some(IntOrString::String("http".into())));
        assert_eq!(sp.load_balancer_ip, None);
        assert_eq!(sp.publish_not_ready_addresses, None);
        assert_eq!(sp.health_check_node_port, None);
        // A pointer field keeps "set to empty".
        assert_eq!(sp.traffic_distribution.as_deref(), Some(""));
    }

    #[test]
    fn times_as_go_reads_them() {
        let t = |seconds, nanos| time(Some(pbmeta::Time { seconds, nanos }));
        assert!(t(Some(i64::MAX), Some(0)).is_none());
        assert!(t(None, None).is_none());
        // The epoch is a time (Go writes its seconds, 0); nanoseconds go.
        assert_eq!(t(Some(0), Some(0)).map(|t| t.0.as_second()), Some(0));
        let x = t(Some(1_700_000_000), Some(5)).unwrap();
        assert_eq!(
            (x.0.as_second(), x.0.subsec_nanosecond()),
            (1_700_000_000, 0)
        );
    }
}
