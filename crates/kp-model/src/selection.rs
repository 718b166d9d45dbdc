//! Which endpoints serve which traffic of one service port on this node: the
//! per-Service policy decision every dataplane makes the same way (upstream
//! makes it once per service port at the top of each proxier's
//! syncProxyRules loop).
//!
//! [`EndpointSelection::new`] runs [`categorize_endpoints`] (traffic
//! policies, terminating fallback, topology hints) and then decides, for
//! internal traffic (to the cluster IP) and external traffic (to NodePorts,
//! external IPs and load-balancer IPs), which of the two endpoint sets
//! serves it, whether it has endpoints at all, and what happens to it when
//! it has none; and which of that traffic is masqueraded
//! ([`ClusterIpMasquerading`], [`ExternalMasquerading`], hairpin). Dataplanes only turn that into their own objects (chain
//! names, rules, virtual servers, listener pools), and `explain` reads the
//! same decisions for one packet.

use crate::dataplane::{LocalDetector, ProxierConfig};
use crate::topology::categorize_endpoints;
use crate::types::{Endpoint, NodeInfo, ServicePort};

/// One of the two endpoint sets a service port has on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndpointSet {
    /// Every usable endpoint in the cluster (topology-filtered): traffic
    /// policy Cluster.
    Cluster,
    /// The usable endpoints on this node: traffic policy Local.
    Local,
}

impl EndpointSet {
    pub fn is_local(self) -> bool {
        self == EndpointSet::Local
    }
}

/// What becomes of traffic that has no endpoint to go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NoEndpoints {
    /// The Service has no usable endpoint anywhere: refuse the connection
    /// (ICMP unreachable / TCP reset), as upstream does.
    Reject,
    /// The Service has endpoints, only none this traffic's Local policy may
    /// use ("has no local endpoints"): drop silently, as upstream does.
    Drop,
}

/// Which cluster IP traffic is masqueraded (SNATed to this node's address,
/// so that replies come back through it to be un-NATed). With
/// [`ExternalMasquerading`] and [`EndpointSelection::hairpin`], the
/// masquerade decision, made here once for every renderer and for
/// `explain`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClusterIpMasquerading {
    /// Every packet (--masquerade-all).
    All,
    /// Packets the local-traffic detector does not count as from the
    /// cluster: they may have been routed here from outside and leave for
    /// another node.
    OffCluster,
    /// None: the detector knows no cluster source of the family (no
    /// detector, or no CIDR of the family), so none is told apart.
    Never,
}

impl ClusterIpMasquerading {
    /// The rule under `cfg`, for its family.
    pub fn of(cfg: &ProxierConfig) -> ClusterIpMasquerading {
        if cfg.masquerade_all {
            return ClusterIpMasquerading::All;
        }
        let detects = match &cfg.local_detector {
            LocalDetector::None => false,
            LocalDetector::Cidrs(nets) => nets.iter().any(|n| cfg.family.matches(&n.addr())),
            LocalDetector::BridgeInterface(_) | LocalDetector::InterfaceNamePrefix(_) => true,
        };
        if detects {
            ClusterIpMasquerading::OffCluster
        } else {
            ClusterIpMasquerading::Never
        }
    }
}

/// Which external traffic of a service port (NodePorts, external and LB
/// IPs) is masqueraded: [`EndpointSelection::external_masquerading`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExternalMasquerading {
    /// Every packet (externalTrafficPolicy Cluster: an endpoint on another
    /// node must reply through this node).
    All,
    /// Only packets from this node itself, which takes the Service's
    /// address as its source; pods' packets are short-circuited to the
    /// Cluster endpoints with their own address, and the rest keep the
    /// client's (externalTrafficPolicy Local, when the Cluster set has
    /// endpoints to short-circuit to).
    FromNode,
    /// None: the client's address is kept (externalTrafficPolicy Local,
    /// no endpoint in the cluster to short-circuit to).
    Never,
}

/// The endpoints one service port uses on this node and which traffic each
/// set serves. Computed once per service port per sync by
/// [`EndpointSelection::new`]; every dataplane reads it instead of deciding
/// again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointSelection<'a> {
    /// Endpoints for Cluster-policy traffic (topology filtered, terminating
    /// fallback); empty when no traffic of the port uses Cluster policy.
    pub cluster: Vec<&'a Endpoint>,
    /// Endpoints for Local-policy traffic (this node's, terminating
    /// fallback); empty when no traffic of the port uses Local policy.
    pub local: Vec<&'a Endpoint>,
    /// Union of both, each endpoint once: every endpoint this node may send
    /// to (per-endpoint chains, conntrack cleanup, hairpin, userspace
    /// connection draining).
    pub all_reachable: Vec<&'a Endpoint>,
    /// Any usable endpoint anywhere in the cluster: when false, traffic
    /// without endpoints is rejected instead of dropped.
    pub has_any: bool,
    /// The set serving internal traffic (cluster IP): Local with
    /// internalTrafficPolicy Local.
    pub internal: EndpointSet,
    /// The set serving external traffic (NodePort, external and LB IPs):
    /// Local with externalTrafficPolicy Local on an externally accessible
    /// service. In-cluster clients of external addresses still use
    /// [`EndpointSelection::cluster`] (upstream's short-circuit); that
    /// routing is the dataplane's.
    pub external: EndpointSet,
    /// The service port has NodePort, external IPs or LB IPs.
    pub externally_accessible: bool,
}

impl<'a> EndpointSelection<'a> {
    /// Selects the endpoints of `sp` among `endpoints` for `node`.
    pub fn new(sp: &ServicePort, endpoints: &'a [Endpoint], node: &NodeInfo) -> Self {
        let cat = categorize_endpoints(endpoints, sp, node);
        let externally_accessible = sp.externally_accessible();
        let set = |local: bool| {
            if local {
                EndpointSet::Local
            } else {
                EndpointSet::Cluster
            }
        };
        EndpointSelection {
            cluster: cat.cluster,
            local: cat.local,
            all_reachable: cat.all_reachable,
            has_any: cat.has_any,
            internal: set(sp.internal_policy_local),
            external: set(sp.external_policy_local && externally_accessible),
            externally_accessible,
        }
    }

    /// The endpoints of `set`.
    pub fn endpoints(&self, set: EndpointSet) -> &[&'a Endpoint] {
        match set {
            EndpointSet::Cluster => &self.cluster,
            EndpointSet::Local => &self.local,
        }
    }

    /// The endpoints internal traffic (to the cluster IP) goes to.
    pub fn internal_endpoints(&self) -> &[&'a Endpoint] {
        self.endpoints(self.internal)
    }

    /// The endpoints external traffic from outside the cluster goes to
    /// (empty when the service port is not externally accessible).
    pub fn external_endpoints(&self) -> &[&'a Endpoint] {
        if self.externally_accessible {
            self.endpoints(self.external)
        } else {
            &[]
        }
    }

    /// Internal traffic has an endpoint to go to.
    pub fn has_internal(&self) -> bool {
        !self.internal_endpoints().is_empty()
    }

    /// External traffic has an endpoint to go to (false when the service
    /// port has no external destination at all).
    pub fn has_external(&self) -> bool {
        !self.external_endpoints().is_empty()
    }

    /// Whether the rules need an external chain (upstream's
    /// usesExternalChain): when external traffic has endpoints, and also
    /// with externalTrafficPolicy Local and no endpoint on this node as long
    /// as the cluster has some, so that pods and the node itself are still
    /// short-circuited to them (other external traffic falls through it and
    /// is dropped where the Service has no endpoints for it).
    pub fn uses_external_chain(&self) -> bool {
        self.has_external()
            || (self.external.is_local() && self.externally_accessible && self.has_cluster())
    }

    /// Whether the Local set is served at all: some traffic uses Local
    /// policy and this node has endpoints for it (upstream's SVL / local-
    /// chain condition).
    pub fn has_local(&self) -> bool {
        !self.local.is_empty()
    }

    /// Whether the Cluster set is served at all (upstream's SVC chain).
    pub fn has_cluster(&self) -> bool {
        !self.cluster.is_empty()
    }

    /// (internal, external) traffic uses Local policy and this node has no
    /// local endpoint for it: upstream's
    /// sync_proxy_rules_no_local_endpoints_total{traffic_policy}.
    pub fn no_local(&self) -> (bool, bool) {
        let none = self.local.is_empty();
        (
            self.internal.is_local() && none,
            self.external.is_local() && none,
        )
    }

    /// Which external traffic is masqueraded: all with
    /// externalTrafficPolicy Cluster; with Local, this node's own when the
    /// Cluster set has endpoints to short-circuit it to, else none.
    pub fn external_masquerading(&self) -> ExternalMasquerading {
        if !self.external.is_local() {
            ExternalMasquerading::All
        } else if self.has_cluster() {
            ExternalMasquerading::FromNode
        } else {
            ExternalMasquerading::Never
        }
    }

    /// The endpoints masqueraded when they reach themselves through the
    /// Service (hairpin: without it the reply would go from the endpoint
    /// straight to itself, never un-NATed): this node's, whose packets pass
    /// its postrouting.
    pub fn hairpin(&self) -> impl Iterator<Item = &'a Endpoint> + '_ {
        self.all_reachable.iter().copied().filter(|e| e.is_local)
    }

    /// What becomes of traffic with no endpoint: dropped when the Service
    /// has endpoints elsewhere (a Local policy without local ones), rejected
    /// when it has none. The same for internal and external traffic: with
    /// Cluster policy, no endpoint for this node means none anywhere.
    pub fn no_endpoints(&self) -> NoEndpoints {
        if self.has_any {
            NoEndpoints::Drop
        } else {
            NoEndpoints::Reject
        }
    }
}
