//! The effective settings: everything the binary needs, validated, in plain
//! Rust types, and what they mean for one IP family's dataplane. A file
//! section's plain fields reach the proxy as the struct its table generates
//! (`file.rs`: [`ConntrackSettings`], [`IpvsSettings`], [`ClientSettings`],
//! [`DetectLocalSettings`]); the fields here are what resolving decides
//! (the mode's periods, parsed addresses) and the flags without a file
//! field.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use kp_model::{IpFamily, LocalDetector, ProxierConfig};

use super::file::{
    ClientSettings, ConntrackSettings, DetectLocalSettings, IpvsSettings, KubeProxyConfiguration,
};
use super::flags::DetectLocalMode;
use super::ConfigError;
use kp_model::ProxyMode;

/// Everything the binary needs, validated, in plain Rust types.
#[derive(Clone, Debug, PartialEq)]
pub struct ProxyConfig {
    pub mode: ProxyMode,
    /// Node name: --hostname-override, else this machine's hostname; lowercased.
    pub hostname: String,
    pub bind_address: IpAddr,
    /// This, config_sync_period, oom_score_adj and feature_gates are the
    /// top-level file fields read here as they are in `configuration`
    /// (defaulted by their lines in `file.rs`); callers and tests read them
    /// as fields of ProxyConfig.
    pub bind_address_hard_fail: bool,
    /// None when disabled (`--healthz-bind-address=""`).
    pub healthz_bind_address: Option<SocketAddr>,
    pub metrics_bind_address: Option<SocketAddr>,
    /// At most one per IP family.
    pub cluster_cidrs: Vec<IpNet>,
    pub detect_local_mode: DetectLocalMode,
    pub detect_local: DetectLocalSettings,
    /// NodePort CIDRs (the `all` keyword gives 0.0.0.0/0 and ::/0, `localhost`
    /// 127.0.0.0/8 and ::1/128). Empty with `nodeport_primary` false: every
    /// local address.
    pub nodeport_addresses: Vec<IpNet>,
    /// The `primary` keyword: the Node's primary IPs (the default in
    /// nftables mode), [`ProxyConfig::node_primary_ips`].
    pub nodeport_primary: bool,
    /// The Node object's primary IPs (one per family, as upstream's
    /// GetNodeHostIPs, `--bind-address` overriding its family's), known once
    /// the Node was read at start; empty before that or when no Node said.
    pub node_primary_ips: Vec<IpAddr>,
    pub masquerade_all: bool,
    pub masquerade_bit: u8,
    /// Full-resync interval of the chosen mode.
    pub sync_period: Duration,
    pub min_sync_period: Duration,
    pub localhost_nodeports: bool,
    pub config_sync_period: Duration,
    pub kubeconfig: Option<PathBuf>,
    pub master: Option<String>,
    pub client: ClientSettings,
    pub manifests: Option<PathBuf>,
    pub cleanup: bool,
    pub dry_run: bool,
    /// --init-only: the privileged host setup, then exit.
    pub init_only: bool,
    pub verbosity: u8,
    pub log_json: bool,
    pub service_proxy_name: Option<String>,
    /// iptables backend (--iptables-backend); None: detect.
    pub iptables_backend: Option<kp_iptables::Variant>,
    /// --iptables-nft-restore: iptables-nft through its program, not netlink.
    pub iptables_nft_restore: bool,
    /// --userspace-* flags (userspace mode).
    pub userspace: super::UserspaceFlags,
    /// --socket-lb and its flags (nftables mode).
    pub socket_lb: super::SocketLbFlags,
    pub ipvs: IpvsSettings,
    pub conntrack: ConntrackSettings,
    pub oom_score_adj: i32,
    pub feature_gates: BTreeMap<String, bool>,
    pub config_file: Option<PathBuf>,
    /// A digest of the `--config` file's text as loaded: upstream exits when
    /// the file changes ([`crate::config::watch`]).
    pub config_file_digest: Option<u64>,
    pub write_config_to: Option<PathBuf>,
    /// The effective configuration in file form (defaults filled in), for
    /// --write-config-to and /configz.
    pub configuration: KubeProxyConfiguration,
    /// What loading the configuration has to say once logging is up (flags
    /// that `--config` overrides, unknown fields left out of the file).
    pub load_warnings: Vec<String>,
}

impl ProxyConfig {
    /// The local-traffic detector for `family` (ClusterCIDR mode: the cluster
    /// CIDR of that family, or none). In NodeCIDR mode this knows no podCIDRs:
    /// use [`ProxyConfig::local_detector_with_pod_cidrs`] once the Node is known.
    pub fn local_detector(&self, family: IpFamily) -> LocalDetector {
        self.local_detector_with_pod_cidrs(family, &[])
    }

    /// As [`ProxyConfig::local_detector`], with the Node's spec.podCIDRs for
    /// NodeCIDR mode.
    pub fn local_detector_with_pod_cidrs(
        &self,
        family: IpFamily,
        pod_cidrs: &[IpNet],
    ) -> LocalDetector {
        let of_family = |cidrs: &[IpNet]| -> Vec<IpNet> {
            cidrs
                .iter()
                .filter(|c| family.matches(&c.addr()))
                .copied()
                .collect()
        };
        match self.detect_local_mode {
            DetectLocalMode::ClusterCidr | DetectLocalMode::NodeCidr => {
                let src = if self.detect_local_mode == DetectLocalMode::ClusterCidr {
                    of_family(&self.cluster_cidrs)
                } else {
                    of_family(pod_cidrs)
                };
                if src.is_empty() {
                    LocalDetector::None
                } else {
                    LocalDetector::Cidrs(src)
                }
            }
            DetectLocalMode::BridgeInterface => {
                LocalDetector::BridgeInterface(self.detect_local.bridge_interface.clone())
            }
            DetectLocalMode::InterfaceNamePrefix => {
                LocalDetector::InterfaceNamePrefix(self.detect_local.interface_name_prefix.clone())
            }
        }
    }

    /// NodePort CIDRs for `family`, as upstream's NodePortAddresses: `primary`
    /// is the Node's primary IP of this family as a host route (loopback
    /// left out, as upstream); no CIDR of this family, or a /0, means every
    /// local address (returned as an empty list).
    pub fn nodeport_addresses_for(&self, family: IpFamily) -> Vec<IpNet> {
        let mut out: Vec<IpNet> = self
            .nodeport_addresses
            .iter()
            .filter(|c| family.matches(&c.addr()))
            .copied()
            .collect();
        if self.nodeport_primary {
            out.extend(
                self.node_primary_ips
                    .iter()
                    .filter(|ip| family.matches(ip) && !ip.is_loopback())
                    .map(|ip| IpNet::from(*ip)),
            );
        }
        if out.iter().any(|c| c.prefix_len() == 0) {
            return Vec::new();
        }
        out.sort();
        out.dedup();
        out
    }

    /// The dataplane settings for one family.
    pub fn proxier_config(
        &self,
        family: IpFamily,
        node_ips: &[IpAddr],
        pod_cidrs: &[IpNet],
    ) -> ProxierConfig {
        let mut pc = ProxierConfig::new(family);
        pc.masquerade_all = self.masquerade_all;
        pc.masquerade_bit = self.masquerade_bit;
        pc.local_detector = self.local_detector_with_pod_cidrs(family, pod_cidrs);
        pc.nodeport_addresses = self.nodeport_addresses_for(family);
        // Upstream allows localhost NodePorts only in iptables mode, IPv4.
        pc.localhost_nodeports = self.localhost_nodeports
            && family == IpFamily::V4
            && matches!(self.mode, ProxyMode::Iptables);
        pc.node_ips = node_ips
            .iter()
            .filter(|ip| family.matches(ip))
            .copied()
            .collect();
        pc
    }

    /// The effective configuration as KubeProxyConfiguration YAML.
    pub fn to_configuration_yaml(&self) -> Result<String, ConfigError> {
        let value = self.to_configuration_json();
        serde_saphyr::to_string(&value).map_err(|e| ConfigError::Serialize(e.to_string()))
    }

    /// The effective configuration as JSON (what /configz serves under
    /// `kubeproxy.config.k8s.io`).
    pub fn to_configuration_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.configuration).unwrap_or_else(|e| {
            // Only reachable if a map key were not a string; ours all are.
            tracing::error!(error = %e, "cannot serialize the configuration");
            serde_json::Value::Null
        })
    }

    /// Writes [`ProxyConfig::to_configuration_yaml`] to `path`
    /// (--write-config-to).
    pub fn write_config(&self, path: &Path) -> Result<(), ConfigError> {
        let yaml = self.to_configuration_yaml()?;
        std::fs::write(path, yaml).map_err(|source| ConfigError::Write {
            path: path.to_path_buf(),
            source,
        })
    }
}
