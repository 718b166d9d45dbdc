//! Stale UDP conntrack: which flows a change leaves pointing where they no
//! longer belong, to be deleted once the new rules are in place.

use std::collections::{BTreeSet, HashSet};
use std::net::IpAddr;

use crate::topology::categorize_endpoints;
use crate::types::{Endpoint, NodeInfo, Protocol, ServicePort};

/// A filter for UDP conntrack entries that would keep sending packets to where
/// they no longer belong. Every set field must match.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StaleConntrack {
    pub protocol: Protocol,
    /// Original destination IP (a service IP); None for NodePorts (any node IP).
    pub orig_dst: Option<IpAddr>,
    pub orig_dport: u16,
    /// Reply source (the endpoint the entry was DNATed to); None for all.
    pub reply_src: Option<IpAddr>,
}

fn usable(e: &Endpoint) -> bool {
    e.ready || e.serving
}

pub(super) fn push_all_ips(
    sp: &ServicePort,
    reply_src: Option<IpAddr>,
    out: &mut BTreeSet<StaleConntrack>,
) {
    for ip in sp.all_ips() {
        out.insert(StaleConntrack {
            protocol: sp.protocol,
            orig_dst: Some(*ip),
            orig_dport: sp.port,
            reply_src,
        });
    }
    if sp.node_port != 0 {
        out.insert(StaleConntrack {
            protocol: sp.protocol,
            orig_dst: None,
            orig_dport: sp.node_port,
            reply_src,
        });
    }
}

pub(super) fn stale_for_removed_port(sp: &ServicePort, out: &mut BTreeSet<StaleConntrack>) {
    if sp.protocol == Protocol::Udp {
        push_all_ips(sp, None, out);
    }
}

/// A UDP port whose addresses changed: entries to addresses it no longer has are stale.
pub(super) fn stale_for_changed_port(
    old: &ServicePort,
    new: &ServicePort,
    out: &mut BTreeSet<StaleConntrack>,
) {
    let new_ips: HashSet<(IpAddr, u16)> = new.all_ips().map(|ip| (*ip, new.port)).collect();
    for ip in old.all_ips() {
        if !new_ips.contains(&(*ip, old.port)) {
            out.insert(StaleConntrack {
                protocol: old.protocol,
                orig_dst: Some(*ip),
                orig_dport: old.port,
                reply_src: None,
            });
        }
    }
    if old.node_port != 0 && old.node_port != new.node_port {
        out.insert(StaleConntrack {
            protocol: old.protocol,
            orig_dst: None,
            orig_dport: old.node_port,
            reply_src: None,
        });
    }
}

/// Endpoints that were usable and are no longer: flows DNATed to them are stale.
/// A port that goes from no usable endpoint to some: flows that were not NATed
/// (sent while it had none) are stale.
pub(super) fn stale_for_endpoints(
    old: &ServicePort,
    new: &ServicePort,
    old_eps: &[Endpoint],
    new_eps: &[Endpoint],
    node: &NodeInfo,
    out: &mut BTreeSet<StaleConntrack>,
) {
    let old_reach: Vec<&Endpoint> = categorize_endpoints(old_eps, old, node).all_reachable;
    let new_reach: Vec<&Endpoint> = categorize_endpoints(new_eps, new, node).all_reachable;
    let new_set: HashSet<(IpAddr, u16)> = new_reach
        .iter()
        .filter(|e| usable(e))
        .map(|e| (e.ip, e.port))
        .collect();
    for ep in old_reach.iter().filter(|e| usable(e)) {
        if !new_set.contains(&(ep.ip, ep.port)) {
            push_all_ips(old, Some(ep.ip), out);
        }
    }
    if old_reach.is_empty() && !new_reach.is_empty() {
        push_all_ips(new, None, out);
    }
}
