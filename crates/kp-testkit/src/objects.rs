//! Builders of the API objects tests and benches write: Services,
//! EndpointSlices and Nodes as JSON (what a manifest or a POST holds) or
//! typed (what a source hands on). Each starts from the smallest valid
//! object and adds what a test names, so a test states only what matters
//! to it.

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{json, Value};

/// The label tying an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

fn merge(into: &mut Value, from: Value) {
    if let (Some(a), Value::Object(b)) = (into.as_object_mut(), from) {
        a.extend(b);
    }
}

fn typed<T: serde::de::DeserializeOwned>(v: Value, what: &str) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{what} {v}: {e}"))
}

/// A Service: `service("default", "web").cluster_ip("10.96.0.10").port("http", 80, "TCP")`.
#[derive(Clone, Debug)]
pub struct ServiceBuilder(Value);

/// A Service `ns/name` with no ports yet.
pub fn service(ns: &str, name: &str) -> ServiceBuilder {
    ServiceBuilder(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": ns, "name": name},
        "spec": {"ports": []},
    }))
}

impl ServiceBuilder {
    pub fn cluster_ip(mut self, ip: &str) -> Self {
        self.0["spec"]["clusterIP"] = json!(ip);
        self
    }
    /// `clusterIP` and `clusterIPs` (one per family, the first primary), as
    /// the API server writes them.
    pub fn cluster_ips(mut self, ips: &[&str]) -> Self {
        if let Some(first) = ips.first() {
            self.0["spec"]["clusterIP"] = json!(first);
        }
        self.0["spec"]["clusterIPs"] = json!(ips);
        self
    }
    /// A port with a name, number and protocol.
    pub fn port(self, name: &str, port: u16, protocol: &str) -> Self {
        self.port_json(json!({"name": name, "port": port, "protocol": protocol}))
    }
    /// A port as written (targetPort, nodePort, appProtocol...).
    pub fn port_json(mut self, port: Value) -> Self {
        if let Some(ports) = self.0["spec"]["ports"].as_array_mut() {
            ports.push(port);
        }
        self
    }
    pub fn labels(mut self, labels: Value) -> Self {
        self.0["metadata"]["labels"] = labels;
        self
    }
    /// Fields set in `spec` as given (type, selector, policies...).
    pub fn spec(mut self, fields: Value) -> Self {
        merge(&mut self.0["spec"], fields);
        self
    }
    pub fn json(self) -> Value {
        self.0
    }
    pub fn build(self) -> Service {
        typed(self.0, "Service")
    }
}

/// An EndpointSlice: `slice("default", "web-1", "web").endpoint("10.244.1.2").port("http", 8080, "TCP")`.
#[derive(Clone, Debug)]
pub struct SliceBuilder(Value);

/// An IPv4 EndpointSlice `ns/name` of Service `svc`, with no endpoints or ports yet.
pub fn slice(ns: &str, name: &str, svc: &str) -> SliceBuilder {
    SliceBuilder(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": ns, "name": name, "labels": {SERVICE_NAME_LABEL: svc}},
        "addressType": "IPv4",
        "endpoints": [],
        "ports": [],
    }))
}

impl SliceBuilder {
    /// A ready endpoint on no particular node.
    pub fn endpoint(self, ip: &str) -> Self {
        self.endpoint_json(json!({"addresses": [ip], "conditions": {"ready": true}}))
    }
    /// A ready endpoint on `node`.
    pub fn endpoint_on(self, ip: &str, node: &str) -> Self {
        self.endpoint_json(
            json!({"addresses": [ip], "nodeName": node, "conditions": {"ready": true}}),
        )
    }
    /// An endpoint as written (conditions, zone, hints...).
    pub fn endpoint_json(mut self, ep: Value) -> Self {
        if let Some(eps) = self.0["endpoints"].as_array_mut() {
            eps.push(ep);
        }
        self
    }
    pub fn port(mut self, name: &str, port: u16, protocol: &str) -> Self {
        if let Some(ports) = self.0["ports"].as_array_mut() {
            ports.push(json!({"name": name, "port": port, "protocol": protocol}));
        }
        self
    }
    /// Labels besides the Service's name (the EndpointSlice controller
    /// copies the Service's own).
    pub fn labels(mut self, labels: Value) -> Self {
        merge(&mut self.0["metadata"]["labels"], labels);
        self
    }
    /// "IPv4", "IPv6" or "FQDN".
    pub fn address_type(mut self, t: &str) -> Self {
        self.0["addressType"] = json!(t);
        self
    }
    pub fn json(self) -> Value {
        self.0
    }
    pub fn build(self) -> EndpointSlice {
        typed(self.0, "EndpointSlice")
    }
}

/// A Node: `node("node-a").zone("z1")`.
#[derive(Clone, Debug)]
pub struct NodeBuilder(Value);

pub fn node(name: &str) -> NodeBuilder {
    NodeBuilder(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}))
}

impl NodeBuilder {
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.0["metadata"]["labels"][key] = json!(value);
        self
    }
    /// The `topology.kubernetes.io/zone` label.
    pub fn zone(self, zone: &str) -> Self {
        self.label("topology.kubernetes.io/zone", zone)
    }
    /// Fields set in `spec` as given (podCIDRs...).
    pub fn spec(mut self, fields: Value) -> Self {
        if self.0.get("spec").is_none() {
            self.0["spec"] = json!({});
        }
        merge(&mut self.0["spec"], fields);
        self
    }
    /// An InternalIP in `status.addresses`.
    pub fn internal_ip(mut self, ip: &str) -> Self {
        let addr = json!({"type": "InternalIP", "address": ip});
        match self.0["status"]["addresses"].as_array_mut() {
            Some(a) => a.push(addr),
            None => self.0["status"]["addresses"] = json!([addr]),
        }
        self
    }
    pub fn json(self) -> Value {
        self.0
    }
    pub fn build(self) -> Node {
        typed(self.0, "Node")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builders_make_valid_objects_with_what_was_named() {
        let s = service("ns1", "web")
            .cluster_ip("10.96.0.10")
            .port("http", 80, "TCP")
            .spec(json!({"type": "NodePort"}))
            .labels(json!({"a": "b"}))
            .build();
        let spec = s.spec.unwrap();
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.10"));
        assert_eq!(spec.type_.as_deref(), Some("NodePort"));
        assert_eq!(spec.ports.unwrap()[0].port, 80);
        let sl = slice("ns1", "web-1", "web")
            .endpoint_on("10.244.1.2", "n1")
            .port("http", 8080, "TCP")
            .build();
        assert_eq!(
            sl.metadata.labels.unwrap()[SERVICE_NAME_LABEL],
            "web".to_string()
        );
        assert_eq!(sl.endpoints[0].node_name.as_deref(), Some("n1"));
        let labelled = slice("ns1", "web-1", "web")
            .labels(json!({"a": "b"}))
            .build();
        let labels = labelled.metadata.labels.unwrap();
        assert_eq!(
            (labels["a"].as_str(), labels[SERVICE_NAME_LABEL].as_str()),
            ("b", "web")
        );
        let with_ip = node("n1")
            .internal_ip("10.0.0.1")
            .internal_ip("fd00::1")
            .build();
        let addrs = with_ip.status.unwrap().addresses.unwrap();
        assert_eq!(
            (addrs[0].address.as_str(), addrs[1].type_.as_str()),
            ("10.0.0.1", "InternalIP")
        );
        let n = node("n1")
            .zone("z")
            .spec(json!({"podCIDRs": ["10.244.1.0/24"]}))
            .build();
        assert_eq!(n.spec.unwrap().pod_cidrs.unwrap(), ["10.244.1.0/24"]);
    }
}
