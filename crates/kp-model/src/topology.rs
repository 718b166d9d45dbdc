//! Endpoint selection, as upstream's CategorizeEndpoints (pkg/proxy/topology.go).

use crate::types::{Endpoint, NodeInfo, ServicePort};

/// The endpoints a service port uses on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Categorized<'a> {
    /// Used for traffic with Cluster policy (after topology filtering and the
    /// terminating fallback).
    pub cluster: Vec<&'a Endpoint>,
    /// Used for traffic with Local policy.
    pub local: Vec<&'a Endpoint>,
    /// Union of both: every endpoint this node may send to (for conntrack cleanup
    /// and the userspace proxy).
    pub all_reachable: Vec<&'a Endpoint>,
    /// Any usable endpoint anywhere in the cluster: when false, traffic is
    /// rejected instead of dropped.
    pub has_any: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum TopologyMode {
    None,
    Node,
    Zone,
}

fn topology_mode(endpoints: &[Endpoint], node: &NodeInfo) -> TopologyMode {
    let mut has_for_node = false;
    let mut all_have_node_hints = true;
    let mut has_for_zone = false;
    let mut all_have_zone_hints = true;
    let zone = node.zone.as_deref().unwrap_or("");
    for ep in endpoints.iter().filter(|e| e.ready) {
        if ep.node_hints().is_empty() {
            all_have_node_hints = false;
        } else if ep.node_hints().contains(&node.name) {
            has_for_node = true;
        }
        if ep.zone_hints().is_empty() {
            all_have_zone_hints = false;
        } else if ep.zone_hints().contains(zone) {
            has_for_zone = true;
        }
    }
    if all_have_node_hints && has_for_node {
        return TopologyMode::Node;
    }
    if all_have_zone_hints && has_for_zone && !zone.is_empty() {
        return TopologyMode::Zone;
    }
    TopologyMode::None
}

fn available(ep: &Endpoint, mode: TopologyMode, node: &NodeInfo) -> bool {
    match mode {
        TopologyMode::None => true,
        TopologyMode::Node => ep.node_hints().contains(&node.name),
        TopologyMode::Zone => node
            .zone
            .as_deref()
            .is_some_and(|z| ep.zone_hints().contains(z)),
    }
}

/// Splits `endpoints` of `svc` into cluster and local endpoints for `node`:
/// ready endpoints, falling back to serving+terminating ones when none are ready;
/// topology hints (node hints for PreferSameNode, zone hints otherwise) honoured
/// when every ready endpoint carries them and one matches this node.
pub fn categorize_endpoints<'a>(
    endpoints: &'a [Endpoint],
    svc: &ServicePort,
    node: &NodeInfo,
) -> Categorized<'a> {
    let mut out = Categorized::default();
    if svc.uses_cluster_endpoints() {
        let mode = topology_mode(endpoints, node);
        out.cluster = endpoints
            .iter()
            .filter(|e| e.ready && available(e, mode, node))
            .collect();
        if out.cluster.is_empty() {
            out.cluster = endpoints
                .iter()
                .filter(|e| e.serving && e.terminating && available(e, mode, node))
                .collect();
        }
        out.has_any = !out.cluster.is_empty();
    }
    if !svc.uses_local_endpoints() {
        out.all_reachable = out.cluster.clone();
        return out;
    }
    let mut local_ready = false;
    let mut local_terminating = false;
    for ep in endpoints {
        if ep.ready {
            out.has_any = true;
            local_ready |= ep.is_local;
        } else if ep.serving && ep.terminating {
            out.has_any = true;
            local_terminating |= ep.is_local;
        }
    }
    let mut use_terminating = false;
    if local_ready {
        out.local = endpoints.iter().filter(|e| e.is_local && e.ready).collect();
    } else if local_terminating {
        use_terminating = true;
        out.local = endpoints
            .iter()
            .filter(|e| e.is_local && e.serving && e.terminating)
            .collect();
    }
    if !svc.uses_cluster_endpoints() {
        out.all_reachable = out.local.clone();
        return out;
    }
    out.all_reachable = out.cluster.clone();
    if use_terminating || !out.local.iter().all(|l| out.cluster.contains(l)) {
        for l in &out.local {
            if !out.all_reachable.contains(l) {
                out.all_reachable.push(l);
            }
        }
    }
    out
}
