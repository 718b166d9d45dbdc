use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

/// IP family a proxier instance serves (upstream runs one proxier per family).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub fn of(ip: &IpAddr) -> IpFamily {
        match ip {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }
    pub fn matches(self, ip: &IpAddr) -> bool {
        IpFamily::of(ip) == self
    }
    /// The EndpointSlice addressType of this family.
    pub fn address_type(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    pub fn parse(s: Option<&str>) -> Option<Protocol> {
        match s.unwrap_or("TCP") {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }
    /// Kubernetes spelling ("TCP").
    pub fn as_k8s(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
    /// Lower-case spelling used by nft and iptables ("tcp").
    pub fn as_lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
    /// IANA protocol number.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_k8s())
    }
}

/// Namespace and name of a Service. Shared strings: a service port's name is
/// a key in a dozen maps across the model, the sync loop and the proxier,
/// and with owned strings each copy was three allocations (~50 MB at 50k
/// Services).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceName {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl ServiceName {
    pub fn new(namespace: impl Into<Arc<str>>, name: impl Into<Arc<str>>) -> Self {
        ServiceName {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One port of one Service: `namespace/name:portName` plus protocol, as upstream's
/// ServicePortName. Displayed as upstream does (`ns/name:port`, or `ns/name` for an
/// unnamed port); [`ServicePortName::key`] adds the protocol.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub service: ServiceName,
    pub port: Arc<str>,
    pub protocol: Protocol,
}

impl ServicePortName {
    /// The smallest port name of `service`: `range(first_of(s)..)` starts at
    /// its ports in any map ordered by ServicePortName.
    pub fn first_of(service: &ServiceName) -> Self {
        ServicePortName {
            service: service.clone(),
            port: "".into(),
            protocol: Protocol::Tcp,
        }
    }

    pub fn new(namespace: &str, name: &str, port: &str, protocol: Protocol) -> Self {
        ServicePortName {
            service: ServiceName::new(namespace, name),
            port: port.into(),
            protocol,
        }
    }
    /// `namespace/name:portName/PROTOCOL`.
    pub fn key(&self) -> String {
        format!("{}/{}", self, self.protocol)
    }
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}", self.service)
        } else {
            write!(f, "{}:{}", self.service, self.port)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TrafficDistribution {
    PreferClose,
    PreferSameZone,
    PreferSameNode,
}

/// Everything a dataplane needs to know about one port of one Service, for one
/// IP family. Built by [`crate::convert_service`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub name: ServicePortName,
    pub cluster_ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    /// 0 when the Service has no NodePort.
    pub node_port: u16,
    pub external_ips: Vec<IpAddr>,
    /// LoadBalancer ingress IPs with ipMode VIP (or unset); ipMode Proxy ones are
    /// left to the load balancer, as upstream does.
    pub load_balancer_ips: Vec<IpAddr>,
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// sessionAffinity ClientIP timeout in seconds; None when affinity is off.
    pub session_affinity_timeout: Option<u32>,
    /// externalTrafficPolicy Local (only set when the Service is reachable
    /// from outside, as upstream).
    pub external_policy_local: bool,
    pub internal_policy_local: bool,
    /// 0 when none.
    pub health_check_node_port: u16,
    pub traffic_distribution: Option<TrafficDistribution>,
}

impl ServicePort {
    /// A ClusterIP-only service port with every optional feature off (the
    /// protocol is the name's); callers set the fields they need.
    pub fn new(name: ServicePortName, cluster_ip: IpAddr, port: u16) -> Self {
        ServicePort {
            protocol: name.protocol,
            name,
            cluster_ip,
            port,
            node_port: 0,
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            load_balancer_source_ranges: Vec::new(),
            session_affinity_timeout: None,
            external_policy_local: false,
            internal_policy_local: false,
            health_check_node_port: 0,
            traffic_distribution: None,
        }
    }

    /// NodePort, externalIPs or LoadBalancer IPs present.
    pub fn externally_accessible(&self) -> bool {
        self.node_port != 0 || !self.external_ips.is_empty() || !self.load_balancer_ips.is_empty()
    }
    /// Cluster endpoints are needed for internal Cluster traffic, and for external
    /// traffic even with eTP=Local (short-circuit of pod and node traffic).
    pub fn uses_cluster_endpoints(&self) -> bool {
        !self.internal_policy_local || self.externally_accessible()
    }
    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || (self.external_policy_local && self.externally_accessible())
    }
    /// Every IP this service port answers on (cluster, external, LB).
    pub fn all_ips(&self) -> impl Iterator<Item = &IpAddr> {
        std::iter::once(&self.cluster_ip)
            .chain(self.external_ips.iter())
            .chain(self.load_balancer_ips.iter())
    }
}

/// Topology hints of an endpoint (zone or node names): sorted, without
/// duplicates, and no allocation when empty, as for nearly every endpoint.
/// 16 bytes where a BTreeSet took 24 (the endpoints are most of the model:
/// 500k of them at 50k Services).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Hints(Option<Box<[Arc<str>]>>);

impl Hints {
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.0
            .as_deref()
            .is_some_and(|v| v.binary_search_by(|h| (**h).cmp(name)).is_ok())
    }

    /// The names, sorted.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.as_deref().unwrap_or_default().iter().map(|h| &**h)
    }
}

impl<S: Into<Arc<str>>> FromIterator<S> for Hints {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        let mut v: Vec<Arc<str>> = iter.into_iter().map(Into::into).collect();
        v.sort();
        v.dedup();
        Hints((!v.is_empty()).then(|| v.into_boxed_slice()))
    }
}

/// Where an endpoint runs and which topology hints it carries. A cluster has
/// few distinct values (its nodes, times their zones and hints), so endpoints
/// point at one shared copy (see [`Placements`]): 8 bytes per endpoint where
/// the four fields took 64 (500k endpoints at 50k Services).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Placement {
    pub node_name: Option<Arc<str>>,
    pub zone: Option<Arc<str>>,
    pub zone_hints: Hints,
    pub node_hints: Hints,
}

impl Placement {
    fn is_empty(&self) -> bool {
        self.node_name.is_none()
            && self.zone.is_none()
            && self.zone_hints.is_empty()
            && self.node_hints.is_empty()
    }
}

static NO_HINTS: Hints = Hints(None);

/// One shared copy of each [`Placement`] (and of each name in them). The
/// tracker keeps one for all slices; copies nobody else holds any more are
/// dropped once the table has doubled since the last sweep.
#[derive(Debug, Default)]
pub struct Placements {
    shared: std::collections::HashSet<Arc<Placement>>,
    names: std::collections::HashSet<Arc<str>>,
    swept_at: usize,
}

impl Placements {
    /// The shared name equal to `s`.
    pub fn name(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.names.get(s) {
            return a.clone();
        }
        let a: Arc<str> = s.into();
        self.names.insert(a.clone());
        a
    }

    /// The shared copy of `p`; None when it says nothing.
    pub fn share(&mut self, p: Placement) -> Option<Arc<Placement>> {
        if p.is_empty() {
            return None;
        }
        if let Some(a) = self.shared.get(&p) {
            return Some(a.clone());
        }
        if self.shared.len() >= 2 * self.swept_at.max(64) {
            self.sweep();
        }
        let a = Arc::new(p);
        self.shared.insert(a.clone());
        Some(a)
    }

    fn sweep(&mut self) {
        self.shared.retain(|p| Arc::strong_count(p) > 1);
        self.names.retain(|n| Arc::strong_count(n) > 1);
        self.swept_at = self.shared.len();
    }
}

/// One endpoint of one service port, as upstream's BaseEndpointInfo.
/// 32 bytes: there are ten times as many endpoints as Services.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub port: u16,
    pub is_local: bool,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// None: no node name, zone or hints.
    pub placement: Option<Arc<Placement>>,
}

impl Endpoint {
    /// A ready, serving, non-terminating endpoint without topology data.
    pub fn ready(ip: IpAddr, port: u16, is_local: bool) -> Self {
        Endpoint {
            ip,
            port,
            is_local,
            ready: true,
            serving: true,
            terminating: false,
            placement: None,
        }
    }

    pub fn node_name(&self) -> Option<&str> {
        self.placement.as_ref()?.node_name.as_deref()
    }
    pub fn zone(&self) -> Option<&str> {
        self.placement.as_ref()?.zone.as_deref()
    }
    pub fn zone_hints(&self) -> &Hints {
        self.placement.as_ref().map_or(&NO_HINTS, |p| &p.zone_hints)
    }
    pub fn node_hints(&self) -> &Hints {
        self.placement.as_ref().map_or(&NO_HINTS, |p| &p.node_hints)
    }

    /// `ip:port` (`[ip]:port` for IPv6), the identity used to de-duplicate.
    pub fn addr_string(&self) -> String {
        std::net::SocketAddr::new(self.ip, self.port).to_string()
    }
    pub fn socket_addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::new(self.ip, self.port)
    }
}

/// What this node looks like to the model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// topology.kubernetes.io/zone label.
    pub zone: Option<String>,
}

impl NodeInfo {
    /// A node whose zone is not known (yet).
    pub fn named(name: &str) -> NodeInfo {
        NodeInfo {
            name: name.to_string(),
            zone: None,
        }
    }
}

#[cfg(test)]
mod placement_tests {
    use super::*;

    fn on(node: &str, p: &mut Placements) -> Placement {
        Placement {
            node_name: Some(p.name(node)),
            ..Placement::default()
        }
    }

    #[test]
    fn an_endpoint_is_32_bytes() {
        assert_eq!(std::mem::size_of::<Endpoint>(), 32);
    }

    #[test]
    fn equal_placements_are_one_copy_and_unused_ones_are_swept() {
        let mut p = Placements::default();
        assert!(p.share(Placement::default()).is_none(), "empty: no copy");
        let a = on("node-a", &mut p);
        let a = p.share(a).unwrap();
        let again = on("node-a", &mut p);
        assert!(Arc::ptr_eq(&a, &p.share(again).unwrap()));
        // 200 placements nobody keeps: the table sweeps them as it grows
        // and never holds more than twice what is in use (or its floor).
        for i in 0..200 {
            let x = on(&format!("gone-{i}"), &mut p);
            drop(p.share(x));
        }
        assert!(p.shared.len() <= 128, "{} kept", p.shared.len());
        assert!(p.names.len() <= 129, "{} names kept", p.names.len());
        let again = on("node-a", &mut p);
        assert!(Arc::ptr_eq(&a, &p.share(again).unwrap()), "in use: kept");
    }
}
