//! The one trait every proxy mode implements, and the settings they share.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;

use crate::tracker::ProxyState;
use crate::types::{IpFamily, ServicePortName};

/// How "traffic from inside the cluster" is recognised (--detect-local-mode).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum LocalDetector {
    /// Nothing is known to be local: no short-circuit for pods.
    #[default]
    None,
    /// Source inside these CIDRs (--cluster-cidr, or the node's podCIDR).
    Cidrs(Vec<IpNet>),
    /// Packets arriving on this bridge interface.
    BridgeInterface(String),
    /// Packets arriving on interfaces whose name starts with this.
    InterfaceNamePrefix(String),
}

/// Settings a dataplane needs beyond the model, for one IP family.
#[derive(Clone, Debug)]
pub struct ProxierConfig {
    pub family: IpFamily,
    pub masquerade_all: bool,
    /// Bit of the packet mark used to tag packets for SNAT (default 14 -> 0x4000).
    pub masquerade_bit: u8,
    pub local_detector: LocalDetector,
    /// --nodeport-addresses for this family; empty means every local address.
    pub nodeport_addresses: Vec<IpNet>,
    /// NodePorts answered on 127.0.0.1 too (upstream iptables "route_localnet"
    /// behaviour; off by default here as in nftables mode).
    pub localhost_nodeports: bool,
    /// This node's IPs of this family (for NodePorts when the address list is
    /// "primary", and for documentation in rules).
    pub node_ips: Vec<IpAddr>,
    /// Service CIDRs, when known: traffic to unallocated ClusterIPs there is dropped.
    pub service_cidrs: Vec<IpNet>,
}

impl ProxierConfig {
    pub fn new(family: IpFamily) -> Self {
        ProxierConfig {
            family,
            masquerade_all: false,
            masquerade_bit: 14,
            local_detector: LocalDetector::None,
            nodeport_addresses: Vec::new(),
            localhost_nodeports: false,
            node_ips: Vec::new(),
            service_cidrs: Vec::new(),
        }
    }
    pub fn masquerade_mark(&self) -> u32 {
        1u32 << self.masquerade_bit
    }

    /// Whether NodePorts are answered on `ip`, one of this node's addresses:
    /// see [`serves_nodeports`].
    pub fn serves_nodeports(&self, ip: &IpAddr) -> bool {
        serves_nodeports(&self.nodeport_addresses, ip)
    }
}

/// Whether NodePorts are answered on `ip`, one of this node's addresses, under
/// --nodeport-addresses `cidrs`: inside one of them, or, with none, any
/// address but loopback. The one filter every dataplane that lists
/// addresses applies (nftables' `nodeport-ips`, IPVS, userspace, socket
/// load balancing, `explain`); which addresses it is given, and what else
/// each excludes, is the dataplane's (docs/architecture.md, NodePorts).
/// iptables lists none: its `addrtype` match asks the kernel at packet time.
pub fn serves_nodeports(cidrs: &[IpNet], ip: &IpAddr) -> bool {
    if cidrs.is_empty() {
        !ip.is_loopback()
    } else {
        cidrs.iter().any(|n| n.contains(ip))
    }
}

/// What one sync did, for metrics and the benchmark.
#[derive(Clone, Debug, Default)]
pub struct SyncReport {
    /// The whole ruleset was rewritten (not only changed services).
    pub full: bool,
    /// Bytes handed to the kernel or the tool (script length, netlink batch size).
    pub bytes: usize,
    /// Commands / messages in the transaction.
    pub ops: usize,
    pub render: Duration,
    pub apply: Duration,
    /// Service ports that have no local endpoint although eTP/iTP=Local needs one
    /// (kubeproxy_sync_proxy_rules_no_local_endpoints_total), (internal, external).
    pub no_local_endpoints: (u64, u64),
    /// iptables mode, per table ("filter", "nat"): (rules kube-proxy owns
    /// there, rules this sync wrote there), builtin chains' jumps aside
    /// (kubeproxy_sync_proxy_rules_iptables_total / _last).
    pub iptables_rules: Vec<(&'static str, u64, u64)>,
}

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("{tool} failed: {message}")]
    Apply { tool: String, message: String },
    /// The kernel or the tool refused operations of a transaction (nothing
    /// of it applied), each named by its line in the transaction's text.
    #[error("{tool} refused the transaction: {}", RefusedList(refused))]
    Refused {
        tool: String,
        refused: Vec<RefusedOp>,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Unsupported(String),
}

/// One refused operation of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefusedOp {
    /// Its line in the transaction's text (one operation a line, from 1;
    /// what --dry-run prints).
    pub line: usize,
    /// Why, as the kernel or the tool said it.
    pub reason: String,
    /// Whose object it is: the Service (and chain) or the shared object.
    pub owner: Option<String>,
    /// The operation's text, shortened, when known.
    pub text: Option<String>,
}

impl std::fmt::Display for RefusedOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}", self.line)?;
        if let Some(o) = &self.owner {
            write!(f, " ({o})")?;
        }
        write!(f, ": {}", self.reason)?;
        if let Some(t) = &self.text {
            write!(f, ": `{t}`")?;
        }
        Ok(())
    }
}

struct RefusedList<'a>(&'a [RefusedOp]);

impl std::fmt::Display for RefusedList<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" | ")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

/// The proxy mode (`--proxy-mode`, `mode:`), and which mode a [`Dataplane`]
/// serves: its name in logs, and which of upstream's failure counters its
/// failed syncs count in. `--socket-lb` is nftables mode with an option, so
/// its dataplanes say `Nftables`. `userspace` is accepted for compatibility
/// with old configs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProxyMode {
    Nftables,
    Iptables,
    Ipvs,
    Userspace,
}

impl ProxyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Nftables => "nftables",
            ProxyMode::Iptables => "iptables",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Userspace => "userspace",
        }
    }
}

impl std::str::FromStr for ProxyMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            // Empty is upstream's "the platform default": iptables on Linux
            // (kubeadm's ConfigMap says `mode: ""`). nftables is asked for.
            "nftables" => Ok(ProxyMode::Nftables),
            "" | "iptables" => Ok(ProxyMode::Iptables),
            "ipvs" => Ok(ProxyMode::Ipvs),
            "userspace" => Ok(ProxyMode::Userspace),
            other => Err(format!(
                "unknown proxy mode {other:?} (expected nftables, iptables, ipvs or userspace)"
            )),
        }
    }
}

impl std::fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A proxy mode. The sync loop owns one per IP family and calls it from one
/// thread; implementations keep whatever they last programmed so that a partial
/// sync sends only the difference.
pub trait Dataplane: Send {
    /// Which dataplane this is.
    fn mode(&self) -> ProxyMode;

    /// Programs `state`. `changed` lists the service ports whose service or
    /// endpoints changed since the previous call; with `full` (or when the previous
    /// sync failed) everything is rewritten. On error the rules in force must be
    /// the previous ones: the sync loop retries with `full` set.
    fn sync(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError>;

    /// The exact ruleset a full sync of `state` would install (--dry-run).
    fn render(&self, state: &ProxyState) -> String;

    /// True when our rules are missing or were flushed by someone else since the
    /// last sync (the canary). Cheap: must not list the whole ruleset.
    fn rules_lost(&mut self) -> bool {
        false
    }

    /// Removes everything this mode installed, and nothing else.
    fn cleanup(&mut self) -> Result<(), DataplaneError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn nodeports_are_served_inside_the_cidrs_or_everywhere_but_loopback() {
        let every: [IpNet; 0] = [];
        assert!(serves_nodeports(&every, &ip("10.0.0.1")));
        assert!(serves_nodeports(&every, &ip("fd00::1")));
        assert!(!serves_nodeports(&every, &ip("127.0.0.1")));
        assert!(!serves_nodeports(&every, &ip("::1")));
        let some: Vec<IpNet> = vec![
            "10.0.0.0/24".parse().unwrap(),
            "127.0.0.0/8".parse().unwrap(),
        ];
        assert!(serves_nodeports(&some, &ip("10.0.0.7")));
        assert!(!serves_nodeports(&some, &ip("10.0.1.7")));
        assert!(
            serves_nodeports(&some, &ip("127.0.0.1")),
            "localhost asked for"
        );
        let mut pc = ProxierConfig::new(IpFamily::V4);
        pc.nodeport_addresses = some;
        assert!(pc.serves_nodeports(&ip("10.0.0.7")) && !pc.serves_nodeports(&ip("192.0.2.1")));
    }
}
