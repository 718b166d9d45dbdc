//! What `/debug/services` and `kube-proxy-rs status` show: the programmed
//! state per Service port and family, with each endpoint's conditions and
//! which traffic uses it (from [`EndpointSelection`]), as serde data (the
//! binary draws it as a table like `kubectl get`).

use std::net::IpAddr;

use serde::Serialize;

use crate::selection::EndpointSelection;
use crate::tracker::ProxyState;
use crate::types::{Endpoint, ServicePort};

/// An endpoint and its conditions, as `/debug/services` and `explain`
/// show them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointConditions {
    /// `ip:port`.
    pub address: String,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// On this node.
    pub local: bool,
    pub node: Option<String>,
    pub zone: Option<String>,
}

impl From<&Endpoint> for EndpointConditions {
    fn from(ep: &Endpoint) -> Self {
        EndpointConditions {
            address: ep.addr_string(),
            ready: ep.ready,
            serving: ep.serving,
            terminating: ep.terminating,
            local: ep.is_local,
            node: ep.node_name().map(String::from),
            zone: ep.zone().map(String::from),
        }
    }
}

/// One endpoint of a Service port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointStatus {
    #[serde(flatten)]
    pub endpoint: EndpointConditions,
    /// Cluster-IP traffic may go to it.
    pub internal: bool,
    /// NodePort / external / LB traffic from outside may go to it.
    pub external: bool,
}

/// One Service port of one family, as programmed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicePortStatus {
    /// `namespace/name:port`.
    pub service_port: String,
    pub protocol: String,
    pub cluster_ip: IpAddr,
    pub port: u16,
    pub node_port: u16,
    pub external_ips: Vec<IpAddr>,
    pub load_balancer_ips: Vec<IpAddr>,
    pub load_balancer_source_ranges: Vec<String>,
    pub session_affinity_seconds: Option<u32>,
    pub internal_traffic_policy: &'static str,
    pub external_traffic_policy: &'static str,
    pub health_check_node_port: u16,
    pub endpoints: Vec<EndpointStatus>,
}

/// One family's programmed state and its last successful sync.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FamilyStatus {
    pub family: String,
    pub node: String,
    pub zone: Option<String>,
    /// RFC 3339; None before the first successful sync.
    pub last_sync: Option<String>,
    /// "full" or "partial".
    pub last_sync_kind: Option<String>,
    pub service_ports: Vec<ServicePortStatus>,
}

fn port_status(sp: &ServicePort, endpoints: &[Endpoint], state: &ProxyState) -> ServicePortStatus {
    let sel = EndpointSelection::new(sp, endpoints, &state.node);
    let contains = |set: &[&Endpoint], ep: &Endpoint| set.iter().any(|e| std::ptr::eq(*e, ep));
    let policy = |local: bool| if local { "Local" } else { "Cluster" };
    ServicePortStatus {
        service_port: sp.name.to_string(),
        protocol: sp.protocol.to_string(),
        cluster_ip: sp.cluster_ip,
        port: sp.port,
        node_port: sp.node_port,
        external_ips: sp.external_ips.clone(),
        load_balancer_ips: sp.load_balancer_ips.clone(),
        load_balancer_source_ranges: sp
            .load_balancer_source_ranges
            .iter()
            .map(|n| n.to_string())
            .collect(),
        session_affinity_seconds: sp.session_affinity_timeout,
        internal_traffic_policy: policy(sp.internal_policy_local),
        external_traffic_policy: policy(sp.external_policy_local),
        health_check_node_port: sp.health_check_node_port,
        endpoints: endpoints
            .iter()
            .map(|ep| EndpointStatus {
                endpoint: ep.into(),
                internal: contains(sel.internal_endpoints(), ep),
                external: contains(sel.external_endpoints(), ep),
            })
            .collect(),
    }
}

/// The Service ports of `state` whose `namespace/name:port` starts with
/// `filter` (all when None), in name order.
pub fn service_ports(state: &ProxyState, filter: Option<&str>) -> Vec<ServicePortStatus> {
    state
        .services
        .iter()
        .filter(|(name, _)| filter.is_none_or(|f| name.to_string().starts_with(f)))
        .map(|(name, sp)| port_status(sp, state.endpoints_of(name), state))
        .collect()
}
