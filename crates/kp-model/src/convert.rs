//! Kubernetes objects -> model, for one IP family, with upstream's filtering.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use crate::names::{is_dns_label, is_dns_subdomain, is_port_name};
use crate::types::*;

/// The most ports a Service the API server accepts can have: its ports are
/// distinct (port, protocol) pairs, so 65,535 x 3. The API server sets no
/// smaller limit, so neither do we: a longer list must repeat a pair, and is
/// rejected here before it is walked.
pub const MAX_PORTS_PER_SERVICE: usize = 65_535 * 3;
/// Upper bounds that no real cluster reaches; past them an object is treated as
/// hostile and skipped rather than allowed to blow up rule sets.
pub const MAX_ENDPOINTS_PER_SLICE: usize = 10_000;
pub const MAX_PORTS_PER_SLICE: usize = 1000;
pub const MAX_IPS_PER_FIELD: usize = 1000;

/// Why an object was skipped. Names the object and the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
// Names are escaped: a newline in a rejected object's name must not forge
// log lines.
#[error("{kind} {}/{}: {reason}", .namespace.escape_debug(), .name.escape_debug())]
pub struct ConvertError {
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
    pub reason: String,
}

fn err(kind: &'static str, ns: &str, name: &str, reason: impl Into<String>) -> ConvertError {
    ConvertError {
        kind,
        namespace: ns.to_string(),
        name: name.to_string(),
        reason: reason.into(),
    }
}

/// Parses an IP as upstream's ParseIPSloppy: IPv4 octets with leading zeros
/// ("010.0.0.1") are read as decimal. API servers before 1.34 accept and store
/// such values, and upstream proxies them rather than ignoring the object.
fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse() {
        return Some(ip);
    }
    let mut octets = [0u8; 4];
    let mut parts = s.split('.');
    for o in octets.iter_mut() {
        let p = parts.next()?;
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *o = p.parse().ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(IpAddr::from(octets))
}

/// CIDR counterpart of [`parse_ip_sloppy`] (upstream's ParseCIDRSloppy).
fn parse_cidr_sloppy(s: &str) -> Option<IpNet> {
    if let Ok(net) = s.parse() {
        return Some(net);
    }
    let (addr, len) = s.split_once('/')?;
    if len.is_empty() || !len.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    IpNet::new(parse_ip_sloppy(addr)?, len.parse().ok()?).ok()
}

// The two labels that decide whether a Service is this proxy's, spelled
// once: macros, so that DEFAULT_LABEL_SELECTOR is made of the same
// literals (`concat!` takes only literals).
macro_rules! service_proxy_name_label {
    () => {
        "service.kubernetes.io/service-proxy-name"
    };
}
macro_rules! headless_label {
    () => {
        "service.kubernetes.io/headless"
    };
}

/// Names the proxy that handles a Service (and its slices, which the
/// EndpointSlice controller labels alike): with it, a Service is another
/// proxy's unless `--service-proxy-name` names the same.
pub const SERVICE_PROXY_NAME_LABEL: &str = service_proxy_name_label!();
/// On headless Services' slices: no proxy handles them.
pub const HEADLESS_LABEL: &str = headless_label!();
/// The selector upstream kube-proxy lists Services and EndpointSlices with:
/// not another proxy's, not headless. For objects no selector filtered
/// (manifests), [`convert_service`] applies the proxy name and
/// [`convert_endpoint_slice`] skips headless slices.
pub const DEFAULT_LABEL_SELECTOR: &str =
    concat!("!", service_proxy_name_label!(), ",!", headless_label!());
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Converts one Service into its service ports for `family`.
///
/// `Ok(vec![])` means "ignored like upstream" (headless, ExternalName, no cluster
/// IP of this family, not owned by `service_proxy_name`: unlabelled without a
/// name, labelled `service.kubernetes.io/service-proxy-name=NAME` with one). `Err` means invalid: the
/// caller skips it, logs and counts it. `warnings` collects per-field problems
/// that only drop the bad value (an unparsable externalIP, say).
pub fn convert_service(
    svc: &Service,
    family: IpFamily,
    service_proxy_name: Option<&str>,
    warnings: &mut Vec<String>,
) -> Result<Vec<ServicePort>, ConvertError> {
    let ns = svc.metadata.namespace.as_deref().unwrap_or("default");
    let name = svc.metadata.name.as_deref().unwrap_or("");
    let e = |r: String| err("Service", ns, name, r);
    if !is_dns_label(ns) {
        return Err(e("namespace is not a valid DNS label".into()));
    }
    if !is_dns_label(name) {
        return Err(e("name is not a valid DNS label".into()));
    }
    // Ours are the unlabelled Services or, with a proxy name, only those
    // labelled with it: the API source's label selector, so that manifests
    // and the API select the same Services.
    let owner = svc
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL));
    if owner.map(String::as_str) != service_proxy_name {
        return Ok(vec![]);
    }
    let Some(spec) = &svc.spec else {
        return Ok(vec![]);
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Ok(vec![]);
    }
    let primary = spec.cluster_ip.as_deref().unwrap_or("");
    if primary.is_empty() || primary == "None" {
        return Ok(vec![]);
    }
    // clusterIPs holds both families on dual-stack Services; clusterIP is its first.
    let mut ips: Vec<&str> = spec
        .cluster_ips
        .as_ref()
        .map(|v| v.iter().map(|s| s.as_str()).collect())
        .unwrap_or_default();
    if ips.is_empty() {
        ips.push(primary);
    }
    let mut cluster_ip = None;
    for s in &ips {
        let ip: IpAddr = parse_ip_sloppy(s)
            .ok_or_else(|| e(format!("spec.clusterIPs: {s:?} is not an IP address")))?;
        if family.matches(&ip) && cluster_ip.is_none() {
            cluster_ip = Some(ip);
        }
    }
    let Some(cluster_ip) = cluster_ip else {
        return Ok(vec![]);
    };

    let ports = spec.ports.as_deref().unwrap_or(&[]);
    if ports.len() > MAX_PORTS_PER_SERVICE {
        return Err(e(format!(
            "spec.ports has {} entries, more than the {MAX_PORTS_PER_SERVICE} distinct port/protocol pairs there are",
            ports.len()
        )));
    }

    let parse_ips = |field: &str, list: &[String], warnings: &mut Vec<String>| -> Vec<IpAddr> {
        let mut out = Vec::new();
        for s in list.iter().take(MAX_IPS_PER_FIELD) {
            match parse_ip_sloppy(s.trim()).ok_or(()) {
                Ok(ip) if family.matches(&ip) => {
                    if !out.contains(&ip) {
                        out.push(ip)
                    }
                }
                Ok(_) => {}
                Err(_) => warnings.push(format!(
                    "Service {ns}/{name}: {field}: {s:?} is not an IP address, ignored"
                )),
            }
        }
        out
    };
    let external_ips = parse_ips(
        "spec.externalIPs",
        spec.external_ips.as_deref().unwrap_or(&[]),
        warnings,
    );
    let mut lb_strings = Vec::new();
    if spec.type_.as_deref() == Some("LoadBalancer") {
        if let Some(ingress) = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
        {
            for ing in ingress {
                let vip = ing.ip_mode.as_deref().is_none_or(|m| m == "VIP");
                if let (Some(ip), true) = (&ing.ip, vip) {
                    if !ip.is_empty() {
                        lb_strings.push(ip.clone());
                    }
                }
            }
        }
    }
    let load_balancer_ips = parse_ips("status.loadBalancer.ingress", &lb_strings, warnings);
    let mut load_balancer_source_ranges = Vec::new();
    for s in spec
        .load_balancer_source_ranges
        .as_deref()
        .unwrap_or(&[])
        .iter()
        .take(MAX_IPS_PER_FIELD)
    {
        match parse_cidr_sloppy(s.trim()).ok_or(()) {
            Ok(net) => {
                let fam_ok = match family {
                    IpFamily::V4 => matches!(net, IpNet::V4(_)),
                    IpFamily::V6 => matches!(net, IpNet::V6(_)),
                };
                if fam_ok {
                    load_balancer_source_ranges.push(net.trunc());
                }
            }
            Err(_) => warnings.push(format!(
                "Service {ns}/{name}: spec.loadBalancerSourceRanges: {s:?} is not a CIDR, ignored"
            )),
        }
    }
    if load_balancer_ips.is_empty() {
        // Source ranges only guard LoadBalancer IPs.
        load_balancer_source_ranges.clear();
    }

    let session_affinity_timeout = if spec.session_affinity.as_deref() == Some("ClientIP") {
        let t = spec
            .session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .unwrap_or(10800);
        if !(1..=86400).contains(&t) {
            return Err(e(format!(
                "spec.sessionAffinityConfig.clientIP.timeoutSeconds: {t} is outside 1..86400"
            )));
        }
        Some(t as u32)
    } else {
        None
    };
    let traffic_distribution = match spec.traffic_distribution.as_deref() {
        Some("PreferClose") => Some(TrafficDistribution::PreferClose),
        Some("PreferSameZone") => Some(TrafficDistribution::PreferSameZone),
        Some("PreferSameNode") => Some(TrafficDistribution::PreferSameNode),
        _ => None,
    };
    let is_lb = spec.type_.as_deref() == Some("LoadBalancer");
    let hc = spec.health_check_node_port.unwrap_or(0);
    if !(0..=65535).contains(&hc) {
        return Err(e(format!("spec.healthCheckNodePort: {hc} is out of range")));
    }

    let mut out = Vec::with_capacity(ports.len());
    let mut seen = BTreeSet::new();
    let mut seen_ports = BTreeSet::new();
    let mut seen_node_ports = BTreeSet::new();
    for (i, p) in ports.iter().enumerate() {
        let pname = p.name.as_deref().unwrap_or("");
        if !is_port_name(pname) {
            return Err(e(format!(
                "spec.ports[{i}].name {pname:?} is not a valid port name"
            )));
        }
        let protocol = Protocol::parse(p.protocol.as_deref()).ok_or_else(|| {
            e(format!(
                "spec.ports[{i}].protocol {:?} is not TCP, UDP or SCTP",
                p.protocol.as_deref().unwrap_or("")
            ))
        })?;
        if !(1..=65535).contains(&p.port) {
            return Err(e(format!(
                "spec.ports[{i}].port {} is out of range",
                p.port
            )));
        }
        let node_port = p.node_port.unwrap_or(0);
        if !(0..=65535).contains(&node_port) {
            return Err(e(format!(
                "spec.ports[{i}].nodePort {node_port} is out of range"
            )));
        }
        // Duplicate (name, protocol) would make two rules fight for one key.
        if !seen.insert((pname.to_string(), protocol)) {
            return Err(e(format!(
                "spec.ports[{i}]: duplicate port name {pname:?} for {protocol}"
            )));
        }
        // As the API server's validation: one port and one nodePort per
        // protocol, or two Services' rules would fight over one key.
        if !seen_ports.insert((p.port, protocol)) {
            return Err(e(format!(
                "spec.ports[{i}]: duplicate port {} for {protocol}",
                p.port
            )));
        }
        let node_port = if matches!(
            spec.type_.as_deref(),
            Some("NodePort") | Some("LoadBalancer")
        ) {
            node_port as u16
        } else {
            0
        };
        if node_port != 0 && !seen_node_ports.insert((node_port, protocol)) {
            return Err(e(format!(
                "spec.ports[{i}]: duplicate nodePort {node_port} for {protocol}"
            )));
        }
        let mut sp = ServicePort {
            name: ServicePortName::new(ns, name, pname, protocol),
            cluster_ip,
            port: p.port as u16,
            protocol,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ips: load_balancer_ips.clone(),
            load_balancer_source_ranges: load_balancer_source_ranges.clone(),
            session_affinity_timeout,
            external_policy_local: false,
            internal_policy_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            health_check_node_port: 0,
            traffic_distribution,
        };
        let etp_local = spec.external_traffic_policy.as_deref() == Some("Local");
        sp.external_policy_local = etp_local && sp.externally_accessible();
        // As upstream's NeedsHealthCheck: every LoadBalancer with eTP=Local, even
        // before it has an ingress IP (the cloud LB probes nodes while it is
        // being provisioned) and without allocated NodePorts.
        if is_lb && etp_local {
            sp.health_check_node_port = hc as u16;
        }
        out.push(sp);
    }
    Ok(out)
}

/// One port's endpoints, shared between a slice and the tracker's merged list.
pub type PortEndpoints = ((String, Protocol), Arc<Vec<Endpoint>>);

/// Endpoints of one EndpointSlice, per (port name, protocol).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SliceEndpoints {
    pub service: Option<ServiceName>,
    /// Shared with the tracker's merged per-port lists when one slice is the
    /// only source of a port (the usual case): one copy of each endpoint.
    pub ports: Vec<PortEndpoints>,
}

/// Converts one EndpointSlice for `family`. Slices of other address types (and
/// FQDN) convert to no ports; a slice without the `kubernetes.io/service-name`
/// label has no service and is ignored, as upstream.
pub fn convert_endpoint_slice(
    slice: &EndpointSlice,
    family: IpFamily,
    node_name: &str,
    warnings: &mut Vec<String>,
) -> Result<SliceEndpoints, ConvertError> {
    let mut shared = Placements::default();
    convert_endpoint_slice_shared(slice, family, node_name, warnings, &mut shared)
}

/// [`convert_endpoint_slice`], the endpoints' placements shared through
/// `shared` (the tracker's, so that all slices share them).
pub fn convert_endpoint_slice_shared(
    slice: &EndpointSlice,
    family: IpFamily,
    node_name: &str,
    warnings: &mut Vec<String>,
    shared: &mut Placements,
) -> Result<SliceEndpoints, ConvertError> {
    let ns = slice.metadata.namespace.as_deref().unwrap_or("default");
    let name = slice.metadata.name.as_deref().unwrap_or("");
    let e = |r: String| err("EndpointSlice", ns, name, r);
    if !is_dns_label(ns) {
        return Err(e("namespace is not a valid DNS label".into()));
    }
    if !is_dns_subdomain(name) {
        return Err(e("name is not a valid DNS subdomain".into()));
    }
    let labels = slice.metadata.labels.as_ref();
    let Some(svc_name) = labels.and_then(|l| l.get(SERVICE_NAME_LABEL)) else {
        return Ok(SliceEndpoints::default());
    };
    if labels.is_some_and(|l| l.contains_key(HEADLESS_LABEL)) {
        return Ok(SliceEndpoints::default());
    }
    if !is_dns_label(svc_name) {
        return Err(e(format!(
            "label {SERVICE_NAME_LABEL}={svc_name:?} is not a valid Service name"
        )));
    }
    let service = Some(ServiceName::new(ns, svc_name.as_str()));
    if slice.address_type != family.address_type() {
        return Ok(SliceEndpoints {
            service,
            ports: vec![],
        });
    }
    if slice.endpoints.len() > MAX_ENDPOINTS_PER_SLICE {
        return Err(e(format!(
            "{} endpoints, more than the limit of {MAX_ENDPOINTS_PER_SLICE}",
            slice.endpoints.len()
        )));
    }
    let ports = slice.ports.as_deref().unwrap_or(&[]);
    if ports.len() > MAX_PORTS_PER_SLICE {
        return Err(e(format!(
            "{} ports, more than the limit of {MAX_PORTS_PER_SLICE}",
            ports.len()
        )));
    }

    // Parse the endpoints once; they are shared by every port of the slice.
    let mut parsed: Vec<(IpAddr, &k8s_openapi::api::discovery::v1::Endpoint)> = Vec::new();
    for (i, ep) in slice.endpoints.iter().enumerate() {
        // Upstream only uses the first address of an endpoint.
        let Some(addr) = ep.addresses.first() else {
            continue;
        };
        match parse_ip_sloppy(addr).ok_or(()) {
            Ok(ip) if family.matches(&ip) => parsed.push((ip, ep)),
            Ok(_) => warnings.push(format!(
                "EndpointSlice {ns}/{name}: endpoints[{i}]: {addr} is not {family}, ignored"
            )),
            Err(_) => warnings.push(format!(
                "EndpointSlice {ns}/{name}: endpoints[{i}]: {addr:?} is not an IP address, ignored"
            )),
        }
    }

    let mut out = Vec::new();
    for (i, p) in ports.iter().enumerate() {
        let Some(port) = p.port else {
            warnings.push(format!(
                "EndpointSlice {ns}/{name}: ports[{i}] has no port number, ignored"
            ));
            continue;
        };
        if !(1..=65535).contains(&port) {
            warnings.push(format!(
                "EndpointSlice {ns}/{name}: ports[{i}].port {port} is out of range, ignored"
            ));
            continue;
        }
        let pname = p.name.clone().unwrap_or_default();
        if !is_port_name(&pname) {
            return Err(e(format!(
                "ports[{i}].name {pname:?} is not a valid port name"
            )));
        }
        let Some(protocol) = Protocol::parse(p.protocol.as_deref()) else {
            warnings.push(format!(
                "EndpointSlice {ns}/{name}: ports[{i}].protocol {:?} is not supported, ignored",
                p.protocol
            ));
            continue;
        };
        let mut eps: Vec<Endpoint> = Vec::with_capacity(parsed.len());
        for (ip, ep) in &parsed {
            let cond = ep.conditions.as_ref();
            let ready = cond.and_then(|c| c.ready).unwrap_or(true);
            let serving = cond.and_then(|c| c.serving).unwrap_or(ready);
            let terminating = cond.and_then(|c| c.terminating).unwrap_or(false);
            let is_local = ep.node_name.as_deref() == Some(node_name) && !node_name.is_empty();
            let hints = ep.hints.as_ref();
            let zone_hints = hints
                .and_then(|h| h.for_zones.as_ref())
                .map(|z| z.iter().map(|z| shared.name(&z.name)).collect())
                .unwrap_or_default();
            let node_hints = hints
                .and_then(|h| h.for_nodes.as_ref())
                .map(|z| z.iter().map(|z| shared.name(&z.name)).collect())
                .unwrap_or_default();
            let placement = Placement {
                node_name: ep.node_name.as_deref().map(|s| shared.name(s)),
                zone: ep.zone.as_deref().map(|s| shared.name(s)),
                zone_hints,
                node_hints,
            };
            eps.push(Endpoint {
                ip: *ip,
                port: port as u16,
                is_local,
                ready,
                serving,
                terminating,
                placement: shared.share(placement),
            });
        }
        out.push(((pname, protocol), Arc::new(eps)));
    }
    Ok(SliceEndpoints {
        service,
        ports: out,
    })
}

/// A Node's pod CIDRs, as `--detect-local-mode=NodeCIDR` uses them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodCidrs {
    /// `spec.podCIDRs` as written (`spec.podCIDR` when the list is empty,
    /// as a hand-written manifest may have it): what a change is noticed on,
    /// as upstream compares them.
    pub raw: Vec<String>,
    /// The first valid CIDR of each family, in the order given, host bits
    /// cleared (upstream's MapCIDRsByIPFamily, then the first of each).
    pub cidrs: Vec<IpNet>,
    /// Entries that are not CIDRs: skipped, as upstream does.
    pub invalid: Vec<String>,
}

/// The label upstream reads this node's zone from (topology hints).
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// The taint the cluster autoscaler puts on a node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// What kube-proxy reads of a Node, built by [`convert_node`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeDetails {
    /// `metadata.name` ("" when missing).
    pub name: String,
    /// The topology.kubernetes.io/zone label, as written.
    pub zone: Option<String>,
    /// `status.addresses` of type InternalIP that parse, in order, both
    /// families.
    pub internal_ips: Vec<IpAddr>,
    /// `status.addresses` of type ExternalIP that parse, in order, both
    /// families.
    pub external_ips: Vec<IpAddr>,
    /// `spec.podCIDRs`, for `--detect-local-mode=NodeCIDR`.
    pub pod_cidrs: PodCidrs,
    /// Being deleted (deletionTimestamp set) or tainted
    /// [`TO_BE_DELETED_TAINT`]: load balancers should go elsewhere.
    pub to_be_deleted: bool,
}

impl NodeDetails {
    /// The node's primary IPs as upstream's GetNodeHostIPs picks them: the
    /// first InternalIP (else ExternalIP) of any family, then the first
    /// address of the other family, InternalIPs again first. Empty when the
    /// Node has neither.
    pub fn host_ips(&self) -> Vec<IpAddr> {
        let mut all = self.internal_ips.iter().chain(&self.external_ips);
        let Some(first) = all.next().copied() else {
            return Vec::new();
        };
        let mut out = vec![first];
        if let Some(other) = all.find(|ip| ip.is_ipv6() != first.is_ipv6()) {
            out.push(*other);
        }
        out
    }

    /// What endpoint selection needs of the node (name, zone).
    pub fn info(&self) -> NodeInfo {
        NodeInfo {
            name: self.name.clone(),
            zone: self.zone.clone(),
        }
    }
    /// The node's addresses of `family`: InternalIPs first, then
    /// ExternalIPs, each in the order the Node lists them.
    pub fn ips_of(&self, family: IpFamily) -> Vec<IpAddr> {
        self.internal_ips
            .iter()
            .chain(self.external_ips.iter())
            .filter(|ip| family.matches(ip))
            .copied()
            .collect()
    }
    /// The node's primary address of `family` (its first InternalIP of the
    /// family, else its first ExternalIP), as upstream's GetNodeHostIPs.
    pub fn primary_ip(&self, family: IpFamily) -> Option<IpAddr> {
        self.ips_of(family).first().copied()
    }
}

/// Reads a Node: name, zone label, addresses, podCIDRs and whether it is
/// going away. Addresses that do not parse are skipped.
pub fn convert_node(node: &Node) -> NodeDetails {
    let mut out = NodeDetails {
        name: node.metadata.name.clone().unwrap_or_default(),
        zone: node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(ZONE_LABEL))
            .cloned(),
        pod_cidrs: node_pod_cidrs(node),
        ..Default::default()
    };
    let addresses = node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_deref())
        .unwrap_or_default();
    for a in addresses.iter().take(MAX_IPS_PER_FIELD) {
        let list = match a.type_.as_str() {
            "InternalIP" => &mut out.internal_ips,
            "ExternalIP" => &mut out.external_ips,
            _ => continue,
        };
        if let Some(ip) = parse_ip_sloppy(a.address.trim()) {
            list.push(ip);
        }
    }
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    out.to_be_deleted = node.metadata.deletion_timestamp.is_some() || tainted;
    out
}

/// The pod CIDRs allocated to `node` (its `spec.podCIDRs`).
fn node_pod_cidrs(node: &Node) -> PodCidrs {
    let spec = node.spec.as_ref();
    let mut raw: Vec<String> = spec
        .and_then(|s| s.pod_cidrs.clone())
        .unwrap_or_default()
        .into_iter()
        .take(MAX_IPS_PER_FIELD)
        .collect();
    if raw.is_empty() {
        raw.extend(
            spec.and_then(|s| s.pod_cidr.clone())
                .filter(|c| !c.is_empty()),
        );
    }
    let mut out = PodCidrs::default();
    for c in &raw {
        match parse_cidr_sloppy(c.trim()) {
            Some(net) => {
                let net = net.trunc();
                let family = IpFamily::of(&net.addr());
                if !out.cidrs.iter().any(|n| family.matches(&n.addr())) {
                    out.cidrs.push(net);
                }
            }
            None => out.invalid.push(c.clone()),
        }
    }
    out.raw = raw;
    out
}

/// The ranges of a ServiceCIDR object (`spec.cidrs`, at most one per
/// family), normalised to their network address. A string that is not a
/// CIDR is skipped with a warning naming the object and the value: the API
/// server validates them, but a manifest may hold anything.
pub fn convert_service_cidr(obj: &ServiceCIDR, warnings: &mut Vec<String>) -> Vec<IpNet> {
    let name = obj.metadata.name.as_deref().unwrap_or("");
    let mut out = Vec::new();
    let cidrs = obj.spec.as_ref().and_then(|s| s.cidrs.as_ref());
    for (i, s) in cidrs.into_iter().flatten().enumerate() {
        match s.trim().parse::<IpNet>() {
            Ok(n) => out.push(n.trunc()),
            Err(_) => warnings.push(format!(
                "ServiceCIDR {name}: spec.cidrs[{i}]: {s:?} is not a CIDR; skipped"
            )),
        }
    }
    out
}
