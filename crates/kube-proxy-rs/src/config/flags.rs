//! Upstream kube-proxy's command-line flags (clap), and the proxy and
//! local-detection modes they name. A flag's name, help, parsing and
//! default are its clap attributes, and nothing else is here: a flag is
//! bound into the file schema on its file field's line in `file.rs` or, when
//! it has more to it, in `bind.rs`; the file's unset fields default to the
//! flag's default ([`Cli::defaults`]).

use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser};

use super::{ConfigError, LONG_VERSION};
use crate::config::duration::duration_arg;
use kp_model::ProxyMode;

impl Cli {
    /// Every flag at its default: what the file's unset fields default to
    /// (upstream's flags default to its configuration's defaults; here the
    /// flag's clap default is the one literal, and `resolve` reads it back).
    /// Environment variables are not read.
    pub(super) fn defaults() -> Result<Cli, ConfigError> {
        let cmd = Cli::command().mut_args(|a| a.env(None::<&'static str>));
        let m = cmd.try_get_matches_from(["kube-proxy"])?;
        Ok(Cli::from_arg_matches(&m)?)
    }
}

/// --detect-local-mode / detectLocalMode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DetectLocalMode {
    ClusterCidr,
    NodeCidr,
    BridgeInterface,
    InterfaceNamePrefix,
}

impl DetectLocalMode {
    pub fn as_str(self) -> &'static str {
        match self {
            DetectLocalMode::ClusterCidr => "ClusterCIDR",
            DetectLocalMode::NodeCidr => "NodeCIDR",
            DetectLocalMode::BridgeInterface => "BridgeInterface",
            DetectLocalMode::InterfaceNamePrefix => "InterfaceNamePrefix",
        }
    }
}

impl FromStr for DetectLocalMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" | "ClusterCIDR" => Ok(DetectLocalMode::ClusterCidr),
            "NodeCIDR" => Ok(DetectLocalMode::NodeCidr),
            "BridgeInterface" => Ok(DetectLocalMode::BridgeInterface),
            "InterfaceNamePrefix" => Ok(DetectLocalMode::InterfaceNamePrefix),
            other => Err(format!(
                "unknown mode {other:?} (expected ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix)"
            )),
        }
    }
}

/// Upstream kube-proxy's flags (names and defaults), plus a few of ours.
/// Boolean flags accept `--flag`, `--flag=true` and `--flag=false` like Go's.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "kube-proxy",
    display_name = "kube-proxy-rs",
    version,
    long_version = LONG_VERSION,
    about = "The Kubernetes network proxy (kube-proxy-rs)"
)]
pub struct Cli {
    /// The path to the configuration file.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// If set, write the effective configuration to this file and exit.
    #[arg(long)]
    pub write_config_to: Option<PathBuf>,
    /// Path to kubeconfig file with authorization information.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The address of the Kubernetes API server (overrides any value in kubeconfig).
    #[arg(long)]
    pub master: Option<String>,
    /// Which proxy mode to use: iptables (default, as upstream's on Linux),
    /// nftables, ipvs or userspace.
    #[arg(long, default_value = "iptables", value_parser = ProxyMode::from_str)]
    pub proxy_mode: ProxyMode,
    /// If non-empty, will be used as the name of the Node kube-proxy is running on.
    #[arg(long, default_value = "")]
    pub hostname_override: String,
    /// Overrides kube-proxy's idea of what its node's primary IP is.
    #[arg(long, default_value = "0.0.0.0")]
    pub bind_address: IpAddr,
    /// If true, failure to bind a port is fatal.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub bind_address_hard_fail: bool,
    /// IP:port of the health check server; empty disables it.
    #[arg(long, default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: String,
    /// IP:port of the metrics server; empty disables it.
    #[arg(long, default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: String,
    /// The CIDR range(s) of pods in the cluster, comma-separated (one per family).
    #[arg(long, default_value = "")]
    pub cluster_cidr: String,
    /// How local traffic is detected: ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix.
    #[arg(long, default_value = "ClusterCIDR", value_parser = DetectLocalMode::from_str)]
    pub detect_local_mode: DetectLocalMode,
    /// Bridge interface name, with --detect-local-mode=BridgeInterface.
    #[arg(long, default_value = "")]
    pub pod_bridge_interface: String,
    /// Interface name prefix, with --detect-local-mode=InterfaceNamePrefix.
    #[arg(long, default_value = "")]
    pub pod_interface_name_prefix: String,
    /// CIDRs (comma-separated) or the keywords primary, all, localhost for NodePorts.
    #[arg(long, value_delimiter = ',')]
    pub nodeport_addresses: Vec<String>,
    /// SNAT all traffic sent via Service cluster IPs.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub masquerade_all: bool,
    /// The bit of the fwmark space to mark packets requiring SNAT (0..=31).
    #[arg(long, default_value_t = 14)]
    pub iptables_masquerade_bit: i32,
    /// How often rules are fully re-synced.
    #[arg(long, default_value = "30s", value_parser = duration_arg)]
    pub iptables_sync_period: Duration,
    /// The minimum period between rule re-syncs.
    #[arg(long, default_value = "1s", value_parser = duration_arg)]
    pub iptables_min_sync_period: Duration,
    /// Allow NodePorts on localhost (iptables mode, IPv4).
    #[arg(long, num_args = 0..=1, default_value = "true", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub iptables_localhost_nodeports: bool,
    /// How often configuration from the apiserver is refreshed.
    #[arg(long, default_value = "15m", value_parser = duration_arg)]
    pub config_sync_period: Duration,
    /// The ipvs scheduler type.
    #[arg(long, default_value = "")]
    pub ipvs_scheduler: String,
    #[arg(long, default_value = "30s", value_parser = duration_arg)]
    pub ipvs_sync_period: Duration,
    #[arg(long, default_value = "1s", value_parser = duration_arg)]
    pub ipvs_min_sync_period: Duration,
    /// CIDRs the ipvs proxier should not touch when cleaning up.
    #[arg(long, value_delimiter = ',')]
    pub ipvs_exclude_cidrs: Vec<String>,
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub ipvs_strict_arp: bool,
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    pub ipvs_tcp_timeout: Duration,
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    pub ipvs_tcpfin_timeout: Duration,
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    pub ipvs_udp_timeout: Duration,
    /// Maximum tracked NAT connections per CPU core (0 leaves the limit as is).
    #[arg(long, default_value_t = 32768)]
    pub conntrack_max_per_core: i32,
    #[arg(long, default_value_t = 131072)]
    pub conntrack_min: i32,
    #[arg(long, default_value = "24h0m0s", value_parser = duration_arg)]
    pub conntrack_tcp_timeout_established: Duration,
    #[arg(long, default_value = "1h0m0s", value_parser = duration_arg)]
    pub conntrack_tcp_timeout_close_wait: Duration,
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub conntrack_tcp_be_liberal: bool,
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    pub conntrack_udp_timeout: Duration,
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    pub conntrack_udp_timeout_stream: Duration,
    /// Remove our rules and exit.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub cleanup: bool,
    /// Log verbosity.
    #[arg(short = 'v', long = "v", default_value_t = 0)]
    pub verbosity: u8,
    /// Accepted for compatibility.
    #[arg(long, default_value_t = -999, allow_negative_numbers = true)]
    pub oom_score_adj: i32,
    /// key=value pairs, comma-separated.
    #[arg(long, default_value = "")]
    pub feature_gates: String,
    /// Accepted for compatibility.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub profiling: bool,
    /// Accepted for compatibility.
    #[arg(long, default_value = "")]
    pub show_hidden_metrics_for_version: String,
    #[arg(long, default_value_t = 5.0)]
    pub kube_api_qps: f32,
    #[arg(long, default_value_t = 10)]
    pub kube_api_burst: i32,
    #[arg(long, default_value = "application/vnd.kubernetes.protobuf")]
    pub kube_api_content_type: String,
    /// Accepted for compatibility.
    #[arg(long)]
    pub vmodule: Option<String>,
    /// Accepted for compatibility.
    #[arg(long, default_value = "5s")]
    pub log_flush_frequency: String,
    /// Accepted for compatibility (upstream's klog buffering and stream
    /// splitting; ours writes every line to stderr unbuffered).
    #[arg(long)]
    pub log_json_info_buffer_size: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub log_json_split_stream: Option<bool>,
    #[arg(long)]
    pub log_text_info_buffer_size: Option<String>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub log_text_split_stream: Option<bool>,
    /// Accepted for compatibility (upstream reads node identity files for
    /// its Events; ours does not need them).
    #[arg(long)]
    pub boot_id_file: Option<String>,
    #[arg(long)]
    pub machine_id_file: Option<String>,
    /// Deprecated upstream: 0 disables the health server; another port is
    /// used only when --healthz-bind-address has none. Ignored with --config.
    #[arg(long, hide = true)]
    pub healthz_port: Option<i32>,
    /// Deprecated upstream: 0 disables the metrics server; another port is
    /// used only when --metrics-bind-address has none. Ignored with --config.
    #[arg(long, hide = true)]
    pub metrics_port: Option<i32>,
    /// Perform the host setup that needs full root privileges (conntrack
    /// sysctls, the mode's sysctls), then exit; a later start then needs only
    /// CAP_NET_ADMIN.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub init_only: bool,

    // --- kube-proxy-rs additions ---
    /// Directory of Service/EndpointSlice/Node manifests to serve from, when no
    /// API server is configured.
    #[arg(long)]
    pub manifests: Option<PathBuf>,
    /// Print the rules that would be installed instead of installing them.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub dry_run: bool,
    /// Log format: text or json (upstream's --logging-format is an alias).
    #[arg(long, alias = "logging-format", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Only handle Services labelled service.kubernetes.io/service-proxy-name=NAME
    /// (instead of the unlabelled ones).
    #[arg(long)]
    pub service_proxy_name: Option<String>,
    /// iptables mode: which iptables backend to program: auto (detect like
    /// upstream: the one holding Kubernetes chains, else the one with more
    /// rules, else nft), nft or legacy.
    #[arg(long, env = "KUBE_PROXY_RS_IPTABLES_BACKEND", default_value = "auto", value_parser = ["auto", "nft", "legacy"])]
    pub iptables_backend: String,
    /// iptables-nft: write the rules with `iptables-nft-restore` instead of
    /// over nf_tables netlink (the same rules; the programs' speed, as
    /// upstream). A fallback, off by default.
    #[arg(long, env = "KUBE_PROXY_RS_IPTABLES_NFT_RESTORE")]
    pub iptables_nft_restore: bool,
    #[command(flatten)]
    pub userspace: UserspaceFlags,
    #[command(flatten)]
    pub socket_lb: SocketLbFlags,
}

/// Flags of `--proxy-mode=userspace` (ours; upstream removed the mode in 1.26).
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct UserspaceFlags {
    /// Userspace mode: how a new connection picks an endpoint:
    /// round-robin or least-connections.
    #[arg(long, default_value = "round-robin", value_parser = ["round-robin", "least-connections"])]
    pub userspace_balancer: String,
    /// Userspace mode: how Service IPs are taken over: loopback (add them to
    /// lo, needs CAP_NET_ADMIN), none (NodePorts and already-local IPs only),
    /// auto (loopback when permitted).
    #[arg(long, default_value = "auto", value_parser = ["auto", "loopback", "none"])]
    pub userspace_vip_mode: String,
    /// Userspace mode: TCP connect timeout per endpoint before the next is tried.
    #[arg(long, default_value = "1s", value_parser = duration_arg)]
    pub userspace_connect_timeout: Duration,
    /// Userspace mode: close TCP connections idle this long (0: never).
    #[arg(long, default_value = "1h", value_parser = duration_arg)]
    pub userspace_tcp_idle_timeout: Duration,
    /// Userspace mode: forget UDP flows idle this long (upstream's --udp-timeout).
    #[arg(long, alias = "udp-timeout", default_value = "30s", value_parser = duration_arg)]
    pub userspace_udp_idle_timeout: Duration,
    /// Userspace mode: connections to a removed endpoint are closed this long after.
    #[arg(long, default_value = "30s", value_parser = duration_arg)]
    pub userspace_grace_period: Duration,
    /// Userspace mode: copy TCP with splice(2) (zero copy) instead of a buffer.
    #[arg(long, num_args = 0..=1, default_value = "true", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub userspace_splice: bool,
}

/// Where the maps and links are pinned on a node by default.
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/kube-proxy-rs";

#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct SocketLbFlags {
    /// nftables mode: also balance ClusterIP connections of this node's
    /// processes at the socket (cgroup BPF connect/sendmsg hooks), with no
    /// per-packet NAT (docs/ebpf.md).
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub socket_lb: bool,
    /// --socket-lb: the cgroup v2 directory the programs attach to; every
    /// process in it and below is balanced. Empty: the root of the cgroup v2
    /// hierarchy (every process on the node).
    #[arg(long, default_value = "")]
    pub cgroup_path: String,
    /// --socket-lb: the bpffs directory for the programs' links and maps
    /// (kept across restarts, removed by --cleanup).
    #[arg(long, default_value = DEFAULT_PIN_PATH)]
    pub bpf_pin_path: PathBuf,
    /// --socket-lb: also serve NodePorts, LoadBalancer IPs and external IPs
    /// for traffic from outside the node with tc programs on the node's
    /// interfaces, before netfilter and conntrack (docs/ebpf.md); nftables
    /// keeps what they do not take.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub bpf_nodeport: bool,
    /// --bpf-nodeport: the node's external interfaces, comma-separated
    /// (Cilium's --devices). Empty: those a default route leaves by.
    #[arg(long, value_delimiter = ',', default_value = "")]
    pub bpf_nodeport_devices: Vec<String>,
    /// --bpf-nodeport: how a new connection from outside gets its endpoint:
    /// `random`, or `maglev` (consistent hashing: every node picks the
    /// same endpoint for the same flow, and one endpoint leaving moves few
    /// others' flows).
    #[arg(long, default_value = "random", value_parser = ["random", "maglev"])]
    pub bpf_lb_algorithm: String,
    /// --bpf-nodeport: how externalTrafficPolicy Cluster traffic reaches an
    /// endpoint on another node (Cilium's flag): `snat` (the node's address
    /// as source, the reply back through this node), `dsr` (direct server
    /// return: the client's address kept, the Service address carried to
    /// the endpoint's node in an IPv4 option or an IPv6 destination
    /// options header, the reply sent from there; every node must run the
    /// programs), or
    /// `hybrid` (DSR for TCP, SNAT for UDP).
    #[arg(long, default_value = "snat", value_parser = ["snat", "dsr", "hybrid"])]
    pub bpf_lb_mode: String,
    /// --bpf-nodeport: also serve traffic at XDP on the external interfaces
    /// (Cilium's flag): `disabled`, `native` (in the driver; one without
    /// native XDP is an error), `best-effort` (native where the driver has
    /// it). XDP takes the flows to and from endpoints on other nodes; tc
    /// the rest. On a veth, the peer needs an XDP program of its own for
    /// the frames XDP sends back (docs/ebpf.md).
    #[arg(long, default_value = "disabled", value_parser = ["disabled", "native", "best-effort"])]
    pub bpf_lb_acceleration: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults the file takes are the flags', parsed as typed:
    /// `--config-sync-period`'s "15m" is the file's 15m0s.
    #[test]
    fn defaults_are_the_flags() {
        let d = Cli::defaults().unwrap();
        assert_eq!(d.config_sync_period, Duration::from_secs(15 * 60));
        assert_eq!(d.conntrack_min, 131072);
        assert_eq!(d.proxy_mode, ProxyMode::Iptables);
        assert!(d.userspace.userspace_splice);
        assert_eq!(d.socket_lb.bpf_pin_path, PathBuf::from(DEFAULT_PIN_PATH));
    }

    /// The environment does not change the defaults (it is the flags'
    /// source only for the flags given).
    #[test]
    fn defaults_ignore_the_environment() {
        let cmd = Cli::command().mut_args(|a| a.env(None::<&'static str>));
        assert!(cmd.get_arguments().all(|a| a.get_env().is_none()));
        assert!(Cli::command()
            .get_arguments()
            .any(|a| a.get_env().is_some()));
    }
}
