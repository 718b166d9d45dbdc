//! The names of everything in our table: the table itself, the skeleton's
//! chains, sets and maps, and the chains of each service port. One room for
//! them so that the renderer, the rule shapes, the proxier and `explain`
//! spell them alike and none has to reach into another for a name. (The
//! endpoint-map shards and affinity sets are spelled by
//! [`MapName`](crate::types::MapName), whose `Display` is their name.)

use kp_model::{chain_hash, ServicePort};

use crate::types::MapName;

/// Our table, one per family (`ip` and `ip6`). Not upstream's `kube-proxy`, so
/// that the two never fight over one table during a migration.
pub const TABLE_NAME: &str = "kube-proxy-rs";

// Base chains, hooked into netfilter.
pub const FILTER_PREROUTING: &str = "filter-prerouting";
pub const FILTER_INPUT: &str = "filter-input";
pub const FILTER_FORWARD: &str = "filter-forward";
pub const FILTER_OUTPUT: &str = "filter-output";
pub const FILTER_OUTPUT_POST_DNAT: &str = "filter-output-post-dnat";
/// Always holds `jump services`: the canary of `rules_lost`.
pub const NAT_PREROUTING: &str = "nat-prerouting";
pub const NAT_OUTPUT: &str = "nat-output";
pub const NAT_POSTROUTING: &str = "nat-postrouting";

// Helper chains of the skeleton.
pub const MARK_MASQ_CHAIN: &str = "mark-for-masquerade";
pub const MASQUERADING: &str = "masquerading";
pub const SERVICES: &str = "services";
pub const FIREWALL_CHECK: &str = "firewall-check";
pub const REJECT_CHAIN: &str = "reject-chain";
pub const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
pub const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
pub const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";

// The skeleton's sets and maps, which the service ports fill.
pub const MAP_SERVICE_IPS: &str = "service-ips";
pub const MAP_SERVICE_NODEPORTS: &str = "service-nodeports";
pub const MAP_NO_EP_SERVICES: &str = "no-endpoint-services";
pub const MAP_NO_EP_NODEPORTS: &str = "no-endpoint-nodeports";
pub const MAP_FIREWALL_IPS: &str = "firewall-ips";
pub const SET_CLUSTER_IPS: &str = "cluster-ips";
pub const SET_NODEPORT_IPS: &str = "nodeport-ips";
pub const SET_HAIRPIN: &str = "hairpin";
/// The skeleton's sets and maps, as [`MapName::Fixed`] names them.
pub static FIXED_SETS: [&&str; 8] = [
    &MAP_SERVICE_IPS,
    &MAP_SERVICE_NODEPORTS,
    &MAP_NO_EP_SERVICES,
    &MAP_NO_EP_NODEPORTS,
    &MAP_FIREWALL_IPS,
    &SET_CLUSTER_IPS,
    &SET_NODEPORT_IPS,
    &SET_HAIRPIN,
];

/// The shared session-affinity set of one timeout. The timeout is in the
/// name: a set cannot change its timeout in place, and a new name lets one
/// transaction move a Service to another.
pub fn affinity_set_name(timeout: u32) -> String {
    MapName::Affinity(timeout).to_string()
}

/// The chains one service port may own (each only when it needs it).
pub struct ServiceChains {
    /// The selection among all usable endpoints.
    pub service: String,
    /// The selection among this node's endpoints (a Local traffic policy).
    pub local: String,
    /// Where traffic from outside goes first (externalIPs, LoadBalancer IPs,
    /// NodePorts).
    pub external: String,
    /// loadBalancerSourceRanges.
    pub firewall: String,
}

impl ServiceChains {
    pub fn of(sp: &ServicePort) -> ServiceChains {
        let base = chain_base(sp);
        ServiceChains {
            service: format!("service-{base}"),
            local: format!("local-{base}"),
            external: format!("external-{base}"),
            firewall: format!("firewall-{base}"),
        }
    }
}

/// Readable, unique, nft-safe chain suffix, upstream style:
/// `HASH8-namespace/name/proto/port`.
fn chain_base(sp: &ServicePort) -> String {
    let proto = sp.protocol.as_lower();
    let h = chain_hash(&format!("{}{proto}", sp.name));
    format!(
        "{}-{}/{}/{proto}/{}",
        &h[..8],
        sp.name.service.namespace,
        sp.name.service.name,
        sp.name.port
    )
}
