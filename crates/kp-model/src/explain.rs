//! `kube-proxy-rs explain`: what this node's proxy does with one packet, as a
//! person reads it. Pure: the same inputs the dataplanes get ([`ProxyState`],
//! [`ProxierConfig`]) plus the packet, and an [`Explanation`] out, data the
//! binary prints as text (its `render` module) or JSON (serde).
//!
//! The policy decisions are not made again here: [`EndpointSelection`] (the
//! one every dataplane reads) picks the endpoint sets and which traffic is
//! masqueraded ([`ClusterIpMasquerading`], [`ExternalMasquerading`]); this module only says
//! which set and which of those rules the packet meets, and why each
//! endpoint is in the set or not.

use std::net::{IpAddr, SocketAddr};

use serde::Serialize;

use crate::dataplane::{LocalDetector, ProxierConfig};
use crate::selection::{
    ClusterIpMasquerading, EndpointSelection, EndpointSet, ExternalMasquerading, NoEndpoints,
};
use crate::status::EndpointConditions;
use crate::tracker::ProxyState;
use crate::types::{Endpoint, IpFamily, NodeInfo, Protocol, ServicePort, ServicePortName};

/// The packet to explain: the first packet of a connection as it enters this
/// node (or leaves a process on it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Packet {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub port: u16,
    #[serde(serialize_with = "display")]
    pub protocol: Protocol,
}

fn display<T: std::fmt::Display, S: serde::Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// Which of a Service port's addresses the packet is addressed to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum MatchKind {
    ClusterIP,
    NodePort,
    ExternalIP,
    LoadBalancerIngress,
}

impl MatchKind {
    /// NodePort, external IP and load-balancer traffic: externalTrafficPolicy
    /// applies; only the cluster IP is internal.
    pub fn is_external(self) -> bool {
        self != MatchKind::ClusterIP
    }
}

/// The Service port that matched and how.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Matched {
    /// `namespace/name:port` (`namespace/name` for an unnamed port).
    pub service_port: String,
    pub namespace: String,
    pub name: String,
    pub port_name: String,
    pub kind: MatchKind,
    pub cluster_ip: IpAddr,
    pub port: u16,
    pub node_port: u16,
    pub internal_traffic_policy: &'static str,
    pub external_traffic_policy: &'static str,
    /// The name to look the port up by in a [`ProxyState`].
    #[serde(skip)]
    pub key: ServicePortName,
}

/// One endpoint of the matched Service port and whether this packet may go
/// to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Candidate {
    #[serde(flatten)]
    pub endpoint: EndpointConditions,
    /// In the set this packet is sent to.
    pub kept: bool,
    pub why: String,
    #[serde(skip)]
    pub socket: SocketAddr,
}

/// What the proxy does with the packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Action {
    /// Not a Service address and port this proxy handles: left alone.
    Untouched,
    /// DNAT to one of the kept endpoints.
    Dnat,
    /// Dropped silently.
    Drop,
    /// Refused (ICMP unreachable / TCP reset).
    Reject,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    pub action: Action,
    pub why: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Masquerade {
    pub masquerade: bool,
    pub why: String,
}

/// Whether a condition on the packet held, as far as addresses can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Tri {
    Yes,
    No,
    /// Interface-based local detection: the address does not say.
    Unknown,
}

/// One chain (or map) of the installed ruleset the packet traverses, and
/// whether it was found in the kernel. Filled by the binary from the kernel;
/// the model only carries it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChainCheck {
    /// `table chain` as the mode names them (`ip kube-proxy-rs services`,
    /// `nat KUBE-SVC-...`).
    pub table: String,
    pub chain: String,
    /// None when the kernel could not be read.
    pub present: Option<bool>,
}

/// What the kernel holds for the matched Service port.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DataplaneTrace {
    pub mode: String,
    pub chains: Vec<ChainCheck>,
    /// Differences between the model and the kernel (missing chains).
    pub drift: Vec<String>,
    /// Why the kernel could not be read, if it could not.
    pub error: Option<String>,
}

/// The decision path for one packet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    pub packet: Packet,
    #[serde(serialize_with = "display")]
    pub family: IpFamily,
    pub node: String,
    pub node_zone: Option<String>,
    /// None: no Service port matched; `verdict` says why.
    pub matched: Option<Matched>,
    /// The source counts as in-cluster (detect-local-mode), which decides
    /// masquerading and the eTP=Local short-circuit.
    pub source_in_cluster: Tri,
    pub local_detection: String,
    /// The source is one of this node's addresses.
    pub source_is_node: bool,
    /// Which endpoint set serves the packet (Cluster or Local) and why.
    pub endpoint_set: Option<String>,
    pub endpoints: Vec<Candidate>,
    /// Serving-terminating endpoints are used because none is ready.
    pub fallback: Option<String>,
    /// Topology hints narrowed the Cluster set.
    pub topology: Option<String>,
    /// ClientIP session affinity timeout, seconds.
    pub session_affinity_seconds: Option<u32>,
    pub masquerade: Option<Masquerade>,
    pub verdict: Verdict,
    /// Filled by the binary in nftables and iptables modes.
    pub dataplane: Option<DataplaneTrace>,
    /// The endpoint set used, typed, for [`Explanation::route`].
    #[serde(skip)]
    pub set: Option<EndpointSet>,
    /// Dropped by loadBalancerSourceRanges (before any endpoint check).
    #[serde(skip)]
    pub source_ranges_drop: bool,
}

/// The path of a matched packet, typed, for the dataplanes to name the
/// chains it traverses (`kp_nftables::packet_chains`,
/// `kp_iptables::packet_chains`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub kind: MatchKind,
    pub set: EndpointSet,
    pub action: Action,
    /// From a process on this node (nat output instead of prerouting).
    pub from_node: bool,
    /// The endpoints the packet may be DNATed to.
    pub endpoints: Vec<SocketAddr>,
    /// Dropped by loadBalancerSourceRanges, not for want of endpoints.
    pub source_ranges_drop: bool,
}

impl Route {
    /// The endpoints of `all` this packet may be DNATed to.
    pub fn endpoints_in<'a>(&'a self, all: &'a [Endpoint]) -> impl Iterator<Item = &'a Endpoint> {
        all.iter()
            .filter(|e| self.endpoints.contains(&e.socket_addr()))
    }
}

impl Explanation {
    /// The typed path, when a Service port matched.
    pub fn route(&self) -> Option<Route> {
        Some(Route {
            kind: self.matched.as_ref()?.kind,
            set: self.set?,
            action: self.verdict.action,
            from_node: self.source_is_node,
            endpoints: self
                .endpoints
                .iter()
                .filter(|c| c.kept)
                .map(|c| c.socket)
                .collect(),
            source_ranges_drop: self.source_ranges_drop,
        })
    }
}

/// Explains `pkt` against the state of its family (`states` may hold both).
/// `cfgs` are the families' proxier settings; a family without state or
/// settings explains as "no Service".
pub fn explain(states: &[&ProxyState], cfgs: &[&ProxierConfig], pkt: &Packet) -> Explanation {
    let family = IpFamily::of(&pkt.dst);
    let state = states.iter().find(|s| s.family == family);
    let cfg = cfgs.iter().find(|c| c.family == family);
    match (state, cfg) {
        (Some(s), Some(c)) => explain_family(s, c, pkt),
        _ => {
            let empty = ProxyState::new(family, NodeInfo::default());
            explain_family(&empty, &ProxierConfig::new(family), pkt)
        }
    }
}

/// How the local detector classifies `src`, and its description.
fn source_in_cluster(cfg: &ProxierConfig, src: &IpAddr) -> (Tri, String) {
    match &cfg.local_detector {
        LocalDetector::None => (
            Tri::No,
            "no local-traffic detector (no --cluster-cidr): no source counts as in-cluster".into(),
        ),
        LocalDetector::Cidrs(nets) => {
            let fam: Vec<_> = nets
                .iter()
                .filter(|n| cfg.family.matches(&n.addr()))
                .collect();
            let list = fam
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            if fam.is_empty() {
                (
                    Tri::No,
                    format!(
                        "no {} pod CIDR configured: no source counts as in-cluster",
                        cfg.family
                    ),
                )
            } else if let Some(n) = fam.iter().find(|n| n.contains(src)) {
                (
                    Tri::Yes,
                    format!("source {src} is in pod CIDR {n} (detect-local by CIDR: {list})"),
                )
            } else {
                (
                    Tri::No,
                    format!("source {src} is outside the pod CIDRs {list}"),
                )
            }
        }
        LocalDetector::BridgeInterface(i) => (
            Tri::Unknown,
            format!("detect-local-mode BridgeInterface: in-cluster when the packet arrives on {i}"),
        ),
        LocalDetector::InterfaceNamePrefix(p) => (
            Tri::Unknown,
            format!(
                "detect-local-mode InterfaceNamePrefix: in-cluster when the packet arrives on {p}*"
            ),
        ),
    }
}

/// Whether `dst` is an address NodePorts are answered on.
fn is_nodeport_address(cfg: &ProxierConfig, dst: &IpAddr) -> bool {
    // With no CIDRs, every local address: when the node's addresses are
    // unknown (offline), assume the packet was addressed to the node.
    cfg.serves_nodeports(dst)
        && (!cfg.nodeport_addresses.is_empty()
            || cfg.node_ips.is_empty()
            || cfg.node_ips.contains(dst))
}

fn find_match<'s>(
    state: &'s ProxyState,
    cfg: &ProxierConfig,
    pkt: &Packet,
) -> Result<(&'s ServicePort, MatchKind), String> {
    let services = state
        .services
        .values()
        .filter(|sp| sp.protocol == pkt.protocol);
    let mut nodeport_elsewhere = None;
    for sp in services {
        if sp.port == pkt.port {
            if sp.cluster_ip == pkt.dst {
                return Ok((sp, MatchKind::ClusterIP));
            }
            if sp.load_balancer_ips.contains(&pkt.dst) {
                return Ok((sp, MatchKind::LoadBalancerIngress));
            }
            if sp.external_ips.contains(&pkt.dst) {
                return Ok((sp, MatchKind::ExternalIP));
            }
        }
        if sp.node_port != 0 && sp.node_port == pkt.port {
            if is_nodeport_address(cfg, &pkt.dst) {
                return Ok((sp, MatchKind::NodePort));
            }
            nodeport_elsewhere = Some(sp.name.to_string());
        }
    }
    if let Some(name) = nodeport_elsewhere {
        return Err(format!(
            "port {} is the NodePort of {name}, but {} is not one of this node's NodePort addresses",
            pkt.port, pkt.dst
        ));
    }
    if let Some(sp) = state.services.values().find(|sp| sp.cluster_ip == pkt.dst) {
        return Err(format!(
            "{} is the cluster IP of {} but no port of it is {}/{}: rejected (invalid port of a ClusterIP)",
            pkt.dst, sp.name.service, pkt.port, pkt.protocol
        ));
    }
    Err(format!(
        "no Service port of {} has {}:{}/{} as cluster IP, NodePort, external IP or load-balancer ingress: not touched by kube-proxy-rs",
        state.family, pkt.dst, pkt.port, pkt.protocol
    ))
}

fn conditions(ep: &Endpoint) -> &'static str {
    match (ep.ready, ep.serving, ep.terminating) {
        (true, _, _) => "ready",
        (false, true, true) => "serving, terminating",
        (false, false, true) => "terminating, not serving",
        (false, true, false) => "serving, not ready",
        (false, false, false) => "not ready",
    }
}

/// Why a ready endpoint is not in the Cluster set: topology hints.
fn hint_reason(ep: &Endpoint, node: &NodeInfo) -> String {
    if !ep.node_hints().is_empty() && !ep.node_hints().contains(&node.name) {
        let hints: Vec<&str> = ep.node_hints().iter().collect();
        return format!(
            "topology: its node hints [{}] do not name node {}",
            hints.join(", "),
            node.name
        );
    }
    let hints: Vec<&str> = ep.zone_hints().iter().collect();
    format!(
        "topology: its zone hints [{}] do not include this node's zone {}",
        hints.join(", "),
        node.zone.as_deref().unwrap_or("(none)")
    )
}

fn explain_family(state: &ProxyState, cfg: &ProxierConfig, pkt: &Packet) -> Explanation {
    let (in_cluster, local_detection) = source_in_cluster(cfg, &pkt.src);
    let source_is_node = cfg.node_ips.contains(&pkt.src);
    let mut ex = Explanation {
        packet: pkt.clone(),
        family: state.family,
        node: state.node.name.clone(),
        node_zone: state.node.zone.clone(),
        matched: None,
        source_in_cluster: in_cluster,
        local_detection,
        source_is_node,
        endpoint_set: None,
        endpoints: Vec::new(),
        fallback: None,
        topology: None,
        session_affinity_seconds: None,
        masquerade: None,
        verdict: Verdict {
            action: Action::Untouched,
            why: String::new(),
        },
        dataplane: None,
        set: None,
        source_ranges_drop: false,
    };
    let (sp, kind) = match find_match(state, cfg, pkt) {
        Ok(m) => m,
        Err(why) => {
            if state.services.values().any(|sp| sp.cluster_ip == pkt.dst) {
                ex.verdict.action = Action::Reject;
            }
            ex.verdict.why = why;
            return ex;
        }
    };
    let policy = |local: bool| if local { "Local" } else { "Cluster" };
    ex.matched = Some(Matched {
        service_port: sp.name.to_string(),
        namespace: sp.name.service.namespace.to_string(),
        name: sp.name.service.name.to_string(),
        port_name: sp.name.port.to_string(),
        kind,
        cluster_ip: sp.cluster_ip,
        port: sp.port,
        node_port: sp.node_port,
        internal_traffic_policy: policy(sp.internal_policy_local),
        external_traffic_policy: policy(sp.external_policy_local),
        key: sp.name.clone(),
    });
    ex.session_affinity_seconds = sp.session_affinity_timeout;

    let endpoints = state.endpoints_of(&sp.name);
    let sel = EndpointSelection::new(sp, endpoints, &state.node);
    let external = kind.is_external();

    // Which set serves this packet. External traffic with eTP=Local from a
    // pod or from the node itself short-circuits to the Cluster set (as the
    // renderers do, when that set has endpoints), so in-cluster clients of an
    // external address are not dropped.
    let short_circuit = external
        && sel.external.is_local()
        && sel.has_cluster()
        && (in_cluster == Tri::Yes || source_is_node);
    let (set, set_why) = if !external {
        (
            sel.internal,
            format!(
                "cluster IP traffic: internalTrafficPolicy {}",
                policy(sel.internal.is_local())
            ),
        )
    } else if short_circuit {
        let who = if source_is_node {
            "the source is this node"
        } else {
            "the source is in-cluster"
        };
        (
            EndpointSet::Cluster,
            format!(
                "externalTrafficPolicy Local, but {who}: short-circuited to the Cluster endpoints"
            ),
        )
    } else {
        let mut why = format!(
            "external traffic ({kind:?}): externalTrafficPolicy {}",
            policy(sel.external.is_local())
        );
        if in_cluster == Tri::Unknown && sel.external.is_local() {
            why.push_str(" (a packet arriving on a pod interface would use the Cluster endpoints)");
        }
        (sel.external, why)
    };
    ex.endpoint_set = Some(format!("{set:?}: {set_why}"));
    ex.set = Some(set);
    let chosen = sel.endpoints(set);
    let is_chosen = |ep: &Endpoint| chosen.iter().any(|c| std::ptr::eq(*c, ep));

    // Ready endpoints left out of the Cluster set can only have been left out
    // by topology hints (categorize_endpoints keeps every ready one
    // otherwise).
    let any_ready = endpoints.iter().any(|e| e.ready);
    let topology_cut = set == EndpointSet::Cluster
        && endpoints.iter().any(|e| e.ready && !is_chosen(e))
        && !chosen.is_empty();
    if topology_cut {
        ex.topology = Some(match state.node.zone.as_deref() {
            Some(z) => format!(
                "topology hints in use: only endpoints hinted for node {} or zone {z} are used",
                state.node.name
            ),
            None => format!(
                "topology hints in use: only endpoints hinted for node {} are used",
                state.node.name
            ),
        });
    }
    if chosen.iter().any(|e| !e.ready) {
        ex.fallback = Some(if set.is_local() {
            "no ready local endpoint: falling back to serving terminating local endpoints".into()
        } else {
            "no ready endpoint: falling back to serving terminating endpoints".into()
        });
    }

    for ep in endpoints {
        let kept = is_chosen(ep);
        let why = if kept {
            let mut w = match (ep.ready, set) {
                (true, EndpointSet::Cluster) => "ready".to_string(),
                (true, EndpointSet::Local) => "ready and on this node".to_string(),
                (false, _) => "serving and terminating, used as fallback".to_string(),
            };
            if topology_cut {
                w.push_str("; topology hints match this node");
            }
            w
        } else if !(ep.ready || ep.serving && ep.terminating) {
            // Neither ready nor a serving-terminating fallback candidate.
            format!("{}: never used", conditions(ep))
        } else if set.is_local() && !ep.is_local {
            "not on this node: traffic policy Local".to_string()
        } else if set.is_local() {
            // Local, serving and terminating: ready local ones exist.
            "serving but terminating: ready local endpoints exist".to_string()
        } else if ep.ready {
            hint_reason(ep, &state.node)
        } else if any_ready {
            "serving but terminating: ready endpoints exist".to_string()
        } else {
            // A serving-terminating endpoint cut by the hints of the fallback.
            "serving but terminating, and not selected by topology hints".to_string()
        };
        ex.endpoints.push(Candidate {
            endpoint: ep.into(),
            kept,
            why,
            socket: ep.socket_addr(),
        });
    }

    // loadBalancerSourceRanges are checked before anything else (the
    // firewall chain of filter prerouting).
    if kind == MatchKind::LoadBalancerIngress
        && !sp.load_balancer_source_ranges.is_empty()
        && !sp
            .load_balancer_source_ranges
            .iter()
            .any(|n| n.contains(&pkt.src))
    {
        let ranges: Vec<String> = sp
            .load_balancer_source_ranges
            .iter()
            .map(|n| n.to_string())
            .collect();
        ex.source_ranges_drop = true;
        ex.verdict = Verdict {
            action: Action::Drop,
            why: format!(
                "source {} is not in loadBalancerSourceRanges [{}]",
                pkt.src,
                ranges.join(", ")
            ),
        };
        return ex;
    }

    if chosen.is_empty() {
        ex.verdict = match sel.no_endpoints() {
            NoEndpoints::Reject => Verdict {
                action: Action::Reject,
                why: format!("{} has no usable endpoint", sp.name),
            },
            NoEndpoints::Drop => Verdict {
                action: Action::Drop,
                why: format!(
                    "{}TrafficPolicy Local and node {} has no local endpoint (the Service has endpoints elsewhere)",
                    if external { "external" } else { "internal" },
                    state.node.name
                ),
            },
        };
        return ex;
    }

    ex.verdict = Verdict {
        action: Action::Dnat,
        why: match (chosen.len(), sp.session_affinity_timeout) {
            (1, _) => format!("DNAT to {}", chosen[0].addr_string()),
            (n, None) => format!("DNAT to one of {n} endpoints, picked at random"),
            (n, Some(t)) => format!(
                "DNAT to one of {n} endpoints; ClientIP session affinity: a client returning within {t}s gets its previous endpoint"
            ),
        },
    };
    let hairpin = sel.hairpin().any(|e| e.ip == pkt.src && is_chosen(e));
    ex.masquerade = Some(masquerade(
        cfg,
        sp,
        &sel,
        kind,
        short_circuit,
        in_cluster,
        source_is_node,
        &ex.local_detection,
        hairpin,
    ));
    ex
}

/// Whether the packet is masqueraded, by the rules the renderers write
/// ([`ClusterIpMasquerading`], [`ExternalMasquerading`],
/// [`EndpointSelection::hairpin`]), and why.
#[allow(clippy::too_many_arguments)]
fn masquerade(
    cfg: &ProxierConfig,
    sp: &ServicePort,
    sel: &EndpointSelection,
    kind: MatchKind,
    short_circuit: bool,
    in_cluster: Tri,
    source_is_node: bool,
    detection: &str,
    hairpin: bool,
) -> Masquerade {
    let m = |masquerade: bool, why: String| Masquerade { masquerade, why };
    if hairpin {
        return m(
            true,
            format!("hairpin: the source {} is itself an endpoint; when it is picked, the packet is masqueraded so the reply comes back through the Service", sp.name),
        );
    }
    if kind.is_external() {
        return match sel.external_masquerading() {
            ExternalMasquerading::All => m(
                true,
                "external traffic with externalTrafficPolicy Cluster is masqueraded, so replies return through this node".into(),
            ),
            ExternalMasquerading::FromNode if source_is_node => {
                m(true, "traffic from this node itself is masqueraded".into())
            }
            _ if short_circuit => m(
                false,
                "in-cluster source short-circuited to the Cluster endpoints keeps its address"
                    .into(),
            ),
            _ => m(
                false,
                "externalTrafficPolicy Local keeps the client's source address".into(),
            ),
        };
    }
    match ClusterIpMasquerading::of(cfg) {
        ClusterIpMasquerading::All => m(true, "--masquerade-all is set".into()),
        ClusterIpMasquerading::Never if matches!(cfg.local_detector, LocalDetector::None) => m(
            false,
            "no local-traffic detector: cluster IP traffic is not masqueraded".into(),
        ),
        ClusterIpMasquerading::Never => m(
            false,
            format!("{detection}; cluster IP traffic is not masqueraded"),
        ),
        ClusterIpMasquerading::OffCluster => match in_cluster {
            Tri::Yes => m(
                false,
                "the source is in-cluster: it keeps its address".into(),
            ),
            Tri::No => m(
                true,
                "the source is not in-cluster: off-cluster traffic to a cluster IP is masqueraded"
                    .into(),
            ),
            Tri::Unknown => m(true, format!("{detection}; masqueraded unless it does")),
        },
    }
}
