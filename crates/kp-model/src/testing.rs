//! Builders for tests: a [`ServicePort`], [`Endpoint`] or [`NodeInfo`] in
//! one line, naming only what a test is about, instead of whole struct
//! literals. Plain values, no I/O; addresses are parsed from strings and a
//! bad one panics (they are written by the test).
//!
//! (`builders_in_one_line` below shows each in use.)

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;

use crate::types::{
    Endpoint, NodeInfo, Placement, Protocol, ServicePort, ServicePortName, TrafficDistribution,
};

fn ip(s: &str) -> IpAddr {
    s.parse()
        .unwrap_or_else(|e| panic!("test address {s:?}: {e}"))
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap_or_else(|e| panic!("test CIDR {s:?}: {e}"))
}

/// Builds a [`ServicePort`]; start with [`ServicePort::builder`]. Defaults:
/// unnamed TCP port 80 on cluster IP 10.96.0.1, every optional feature off.
#[derive(Clone, Debug)]
#[must_use]
pub struct ServicePortBuilder {
    sp: ServicePort,
}

impl ServicePort {
    /// A builder for a port of Service `namespace/name`.
    pub fn builder(namespace: &str, name: &str) -> ServicePortBuilder {
        ServicePortBuilder {
            sp: ServicePort::new(
                ServicePortName::new(namespace, name, "", Protocol::Tcp),
                IpAddr::from([10, 96, 0, 1]),
                80,
            ),
        }
    }
}

impl ServicePortBuilder {
    /// The port's name (`ns/name:port_name`).
    pub fn port_name(mut self, port_name: &str) -> Self {
        self.sp.name.port = port_name.into();
        self
    }
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.sp.name.protocol = protocol;
        self.sp.protocol = protocol;
        self
    }
    pub fn cluster_ip(mut self, addr: &str) -> Self {
        self.sp.cluster_ip = ip(addr);
        self
    }
    pub fn port(mut self, port: u16) -> Self {
        self.sp.port = port;
        self
    }
    pub fn node_port(mut self, port: u16) -> Self {
        self.sp.node_port = port;
        self
    }
    pub fn external_ips(mut self, addrs: &[&str]) -> Self {
        self.sp.external_ips = addrs.iter().map(|a| ip(a)).collect();
        self
    }
    pub fn load_balancer_ips(mut self, addrs: &[&str]) -> Self {
        self.sp.load_balancer_ips = addrs.iter().map(|a| ip(a)).collect();
        self
    }
    pub fn source_ranges(mut self, cidrs: &[&str]) -> Self {
        self.sp.load_balancer_source_ranges = cidrs.iter().map(|c| net(c)).collect();
        self
    }
    /// sessionAffinity ClientIP with this timeout (seconds).
    pub fn affinity(mut self, timeout: u32) -> Self {
        self.sp.session_affinity_timeout = Some(timeout);
        self
    }
    /// externalTrafficPolicy Local. Set as given: unlike
    /// [`crate::convert_service`], not cleared on a port without external
    /// destinations, so tests can check that case is ignored.
    pub fn local_external(mut self) -> Self {
        self.sp.external_policy_local = true;
        self
    }
    /// internalTrafficPolicy Local.
    pub fn local_internal(mut self) -> Self {
        self.sp.internal_policy_local = true;
        self
    }
    pub fn health_check_node_port(mut self, port: u16) -> Self {
        self.sp.health_check_node_port = port;
        self
    }
    pub fn traffic_distribution(mut self, td: TrafficDistribution) -> Self {
        self.sp.traffic_distribution = Some(td);
        self
    }
    pub fn build(self) -> ServicePort {
        self.sp
    }
}

impl From<ServicePortBuilder> for ServicePort {
    fn from(b: ServicePortBuilder) -> ServicePort {
        b.build()
    }
}

/// Chainable changes to an [`Endpoint`], from [`Endpoint::ready`] or
/// [`Endpoint::at`].
impl Endpoint {
    /// A ready, serving, remote endpoint at `addr` (`"10.0.0.1:80"`,
    /// `"[fd00::1]:80"`).
    pub fn at(addr: &str) -> Endpoint {
        let sa: SocketAddr = addr
            .parse()
            .unwrap_or_else(|e| panic!("test endpoint {addr:?}: {e}"));
        Endpoint::ready(sa.ip(), sa.port(), false)
    }
    /// On this node.
    #[must_use]
    pub fn local(mut self) -> Endpoint {
        self.is_local = true;
        self
    }
    /// Neither ready, serving nor terminating.
    #[must_use]
    pub fn unready(mut self) -> Endpoint {
        self.ready = false;
        self.serving = false;
        self.terminating = false;
        self
    }
    /// Terminating but still serving (used when nothing is ready).
    #[must_use]
    pub fn serving_terminating(mut self) -> Endpoint {
        self.ready = false;
        self.serving = true;
        self.terminating = true;
        self
    }
    /// Terminating and no longer serving (never used).
    #[must_use]
    pub fn terminated(mut self) -> Endpoint {
        self.ready = false;
        self.serving = false;
        self.terminating = true;
        self
    }
    #[must_use]
    pub fn with_zone_hints(self, zones: &[&str]) -> Endpoint {
        self.place(|p| p.zone_hints = zones.iter().map(|z| z.to_string()).collect())
    }
    #[must_use]
    pub fn with_node_hints(self, nodes: &[&str]) -> Endpoint {
        self.place(|p| p.node_hints = nodes.iter().map(|n| n.to_string()).collect())
    }
    /// `nodeName` and `zone` of the endpoint.
    #[must_use]
    pub fn on_node(self, node: &str, zone: Option<&str>) -> Endpoint {
        self.place(|p| {
            p.node_name = Some(node.into());
            p.zone = zone.map(Into::into);
        })
    }
    fn place(mut self, f: impl FnOnce(&mut Placement)) -> Endpoint {
        let mut p = self.placement.as_deref().cloned().unwrap_or_default();
        f(&mut p);
        self.placement = Some(Arc::new(p));
        self
    }
}

impl NodeInfo {
    /// With topology.kubernetes.io/zone `zone`.
    #[must_use]
    pub fn in_zone(mut self, zone: &str) -> NodeInfo {
        self.zone = Some(zone.to_string());
        self
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn builders_in_one_line() {
        use crate::{Endpoint, NodeInfo, ServicePort};
        let sp = ServicePort::builder("default", "web")
            .port_name("http")
            .cluster_ip("10.96.0.10")
            .node_port(30080)
            .local_external()
            .build();
        let eps = [
            Endpoint::at("10.244.1.5:8080").local(),
            Endpoint::at("10.244.2.6:8080").serving_terminating(),
        ];
        let node = NodeInfo::named("node1").in_zone("zone-a");
        assert!(sp.external_policy_local && eps[0].is_local && node.zone.is_some());
    }
}
