//! Upstream kube-proxy's command-line flags (clap), and the proxy and
//! local-detection modes they name.
//!
//! Upstream's `AddFlags` binds each flag to a field of its
//! KubeProxyConfiguration (`fs.BoolVar(&o.config.Conntrack.TCPBeLiberal,
//! "conntrack-tcp-be-liberal", ...)`). Here a flag's name, help, parsing and
//! default are its clap attributes, and the binding is written once, in one
//! of two places: a file field that takes the flag's value as it is names
//! the flag on its line in `file.rs` (`= flag conntrack_tcp_be_liberal`,
//! [`super::field`]); a flag with more to it (several fields, a conversion,
//! `--config`'s exceptions) names its fields after `=>` here, a closure
//! writing its value into the file schema. Either way the file's unset
//! fields default to the flag's default ([`Cli::defaults`]).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};

use super::file::KubeProxyConfiguration;
use super::{invalid, ConfigError, LONG_VERSION};
use crate::config::duration::{duration_arg, GoDuration};
use kp_model::ProxyMode;

/// True when the flag was set by the user (not clap's default).
pub(super) fn given(m: &ArgMatches, id: &str) -> bool {
    matches!(
        m.value_source(id),
        Some(ValueSource::CommandLine) | Some(ValueSource::EnvVariable)
    )
}

/// What a binding returns: nothing, or a refusal of the value.
pub(super) trait Bound {
    fn into_result(self) -> Result<(), ConfigError>;
}

impl Bound for () {
    fn into_result(self) -> Result<(), ConfigError> {
        Ok(())
    }
}

impl Bound for Result<(), ConfigError> {
    fn into_result(self) -> Result<(), ConfigError> {
        self
    }
}

/// Runs one flag's binding (the closure gets its argument types from here).
fn bind<T, R: Bound>(
    file: &mut Given,
    value: &T,
    binding: impl FnOnce(&mut Given, &T) -> R,
) -> Result<(), ConfigError> {
    binding(file, value).into_result()
}

/// What the flags given do: the file schema they are written into (a
/// binding reads and writes it as `f.field`), and what the file cannot say.
pub(super) struct Given<'a> {
    file: &'a mut KubeProxyConfiguration,
    /// --write-config-to is given: the deprecated ports stay out of the
    /// file it writes.
    writing_config: bool,
    /// The health and metrics servers a flag turned off (upstream: an empty
    /// address; here an empty address in the file takes the default).
    pub healthz_off: bool,
    pub metrics_off: bool,
}

impl<'a> Given<'a> {
    pub(super) fn new(file: &'a mut KubeProxyConfiguration, writing_config: bool) -> Self {
        Given {
            file,
            writing_config,
            healthz_off: false,
            metrics_off: false,
        }
    }

    /// Upstream's deprecated --healthz-port (`healthz`) or --metrics-port:
    /// 0 turns the server off, another port completes an address that has
    /// none.
    fn deprecated_port(&mut self, healthz: bool, port: Option<i32>) {
        if self.writing_config {
            return;
        }
        let (addr, off) = if healthz {
            (&mut self.file.healthz_bind_address, &mut self.healthz_off)
        } else {
            (&mut self.file.metrics_bind_address, &mut self.metrics_off)
        };
        match port {
            Some(0) => *off = true,
            Some(p) if addr_without_port(addr) => *addr = format!("{}:{p}", addr.trim()),
            _ => {}
        }
    }
}

impl std::ops::Deref for Given<'_> {
    type Target = KubeProxyConfiguration;
    fn deref(&self) -> &KubeProxyConfiguration {
        self.file
    }
}

impl std::ops::DerefMut for Given<'_> {
    fn deref_mut(&mut self) -> &mut KubeProxyConfiguration {
        self.file
    }
}

/// "0.0.0.0" or "[::]" (a bind address that names no port).
fn addr_without_port(addr: &str) -> bool {
    let a = addr.trim();
    !a.is_empty()
        && a.trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok()
}

/// Declares [`Cli`] (the struct, with its clap attributes, as written) and
/// [`Cli::bind_given`], which writes each given flag bound to a file field
/// into the file schema: the flags with a closure (`=> |file, value| ...`)
/// here, the others through `file.rs`'s tables. `@over_config` marks the
/// flags upstream still honours when `--config` is given: its logging flags
/// (copied over the file's `logging`) and --hostname-override.
/// `@deprecated` marks upstream's deprecated flags that change what the
/// file cannot say (--healthz-port 0 turns the server off): bound and
/// ignored with `--config` like the others, but not among the file's flags
/// ([`Cli::bound_flags`]).
macro_rules! flags {
    (
        $(#[$cmeta:meta])*
        pub struct Cli {
            $(
                $(#[$fmeta:meta])*
                pub $name:ident : $ty:ty $(=> $(@$over:ident)? $binding:expr)? ;
            )*
        }
    ) => {
        $(#[$cmeta])*
        pub struct Cli {
            $( $(#[$fmeta])* pub $name: $ty, )*
        }

        impl Cli {
            /// Runs flag `id`'s closure, if it has one.
            fn bind_closure(
                &self,
                file: &mut Given,
                id: &str,
            ) -> Result<bool, ConfigError> {
                $($(
                    if id == stringify!($name) {
                        bind(file, &self.$name, $binding)?;
                        return Ok(true);
                    }
                )?)*
                Ok(false)
            }

            /// The flags with a closure, whether each applies over
            /// `--config`, and whether it is one of the file's flags.
            const CLOSURES: &'static [(&'static str, bool, bool)] = &[
                $($( flags!(@entry $name, $(@$over)? $binding), )?)*
            ];
        }
    };
    (@entry $name:ident, @over_config $binding:expr) => {
        (stringify!($name), true, true)
    };
    (@entry $name:ident, @deprecated $binding:expr) => {
        (stringify!($name), false, false)
    };
    (@entry $name:ident, $binding:expr) => {
        (stringify!($name), false, true)
    };
}

impl Cli {
    /// Writes the flags given on the command line (not clap's defaults)
    /// into `file`, in the flags' order. With a config file (`from_file`)
    /// only the `@over_config` ones apply, as upstream replaces its
    /// flag-built configuration with the file's; the others given are
    /// returned as `--flag` names, for a warning.
    pub(super) fn bind_given(
        &self,
        file: &mut Given,
        m: &ArgMatches,
        from_file: bool,
    ) -> Result<Vec<String>, ConfigError> {
        let mut ignored = Vec::new();
        for (id, over, _) in Self::bindings() {
            if !given(m, id) {
                continue;
            }
            if from_file && !over {
                ignored.push(format!("--{}", id.replace('_', "-")));
            } else if !self.bind_closure(file, id)? {
                let bound = file.file.bind_table_flag(self, id);
                debug_assert!(bound, "{id} is bound nowhere");
            }
        }
        Ok(ignored)
    }

    /// The clap ids of the flags bound into the file (by a closure or a
    /// file field), in the flags' order, and whether each applies over
    /// `--config`.
    pub fn bound_flags() -> Vec<(&'static str, bool)> {
        Self::bindings()
            .into_iter()
            .filter(|(_, _, file)| *file)
            .map(|(id, over, _)| (id, over))
            .collect()
    }

    /// Every flag with a binding, in the flags' order: its clap id,
    /// whether it applies over `--config`, and whether it is one of the
    /// file's flags (not `@deprecated`).
    fn bindings() -> Vec<(&'static str, bool, bool)> {
        let table: Vec<&'static str> = KubeProxyConfiguration::table_flags().collect();
        Cli::command()
            .get_arguments()
            .filter_map(|a| {
                let id = a.get_id().as_str();
                Self::CLOSURES
                    .iter()
                    .find(|(c, _, _)| *c == id)
                    .copied()
                    .or_else(|| table.iter().find(|t| **t == id).map(|t| (*t, false, true)))
            })
            .collect()
    }
}

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

fn dur(d: &Duration) -> Option<GoDuration> {
    Some(GoDuration(*d))
}

/// --feature-gates "A=true,B=false", merged into the file's gates.
fn merge_feature_gates(gates: &mut BTreeMap<String, bool>, s: &str) -> Result<(), ConfigError> {
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| invalid("featureGates", format!("{item:?} is not key=value")))?;
        let b = match v.trim() {
            "true" | "True" | "TRUE" | "1" | "t" | "T" => true,
            "false" | "False" | "FALSE" | "0" | "f" | "F" => false,
            other => {
                return Err(invalid(
                    &format!("featureGates.{}", k.trim()),
                    format!("{other:?} is not a boolean"),
                ))
            }
        };
        gates.insert(k.trim().to_string(), b);
    }
    Ok(())
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

flags! {
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
    pub config: Option<PathBuf>;
    /// If set, write the effective configuration to this file and exit.
    #[arg(long)]
    pub write_config_to: Option<PathBuf>;
    /// Path to kubeconfig file with authorization information.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>
        => |f, v| {
                f.client_connection.kubeconfig = v
                    .as_ref()
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_default()
            };
        /// The address of the Kubernetes API server (overrides any value in kubeconfig).
        #[arg(long)]
        pub master: Option<String>;
        /// Which proxy mode to use: iptables (default, as upstream's on Linux),
        /// nftables, ipvs or userspace.
        #[arg(long, default_value = "iptables", value_parser = ProxyMode::from_str)]
        pub proxy_mode: ProxyMode
            => |f, v| f.mode = v.as_str().to_string();
        /// If non-empty, will be used as the name of the Node kube-proxy is running on.
        #[arg(long, default_value = "")]
        pub hostname_override: String
            => @over_config |f, v| f.hostname_override = v.clone();
        /// Overrides kube-proxy's idea of what its node's primary IP is.
        #[arg(long, default_value = "0.0.0.0")]
        pub bind_address: IpAddr
            => |f, v| f.bind_address = v.to_string();
        /// If true, failure to bind a port is fatal.
        #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
        pub bind_address_hard_fail: bool;
        /// IP:port of the health check server; empty disables it.
        #[arg(long, default_value = "0.0.0.0:10256")]
        pub healthz_bind_address: String
            => |f, v| {
                f.healthz_bind_address = v.clone();
                f.healthz_off = v.trim().is_empty();
            };
        /// IP:port of the metrics server; empty disables it.
        #[arg(long, default_value = "127.0.0.1:10249")]
        pub metrics_bind_address: String
            => |f, v| {
                f.metrics_bind_address = v.clone();
                f.metrics_off = v.trim().is_empty();
            };
        /// The CIDR range(s) of pods in the cluster, comma-separated (one per family).
        #[arg(long, default_value = "")]
        pub cluster_cidr: String;
        /// How local traffic is detected: ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix.
        #[arg(long, default_value = "ClusterCIDR", value_parser = DetectLocalMode::from_str)]
        pub detect_local_mode: DetectLocalMode
            => |f, v| f.detect_local_mode = v.as_str().to_string();
        /// Bridge interface name, with --detect-local-mode=BridgeInterface.
        #[arg(long, default_value = "")]
        pub pod_bridge_interface: String;
        /// Interface name prefix, with --detect-local-mode=InterfaceNamePrefix.
        #[arg(long, default_value = "")]
        pub pod_interface_name_prefix: String;
        /// CIDRs (comma-separated) or the keywords primary, all, localhost for NodePorts.
        #[arg(long, value_delimiter = ',')]
        pub nodeport_addresses: Vec<String>;
        /// SNAT all traffic sent via Service cluster IPs.
        #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
        pub masquerade_all: bool
            => |f, v| {
            f.iptables.masquerade_all = *v;
            f.nftables.masquerade_all = *v;
        };
    /// The bit of the fwmark space to mark packets requiring SNAT (0..=31).
    #[arg(long, default_value_t = 14)]
    pub iptables_masquerade_bit: i32
        => |f, v| {
            f.iptables.masquerade_bit = Some(*v);
            f.nftables.masquerade_bit = Some(*v);
        };
    /// How often rules are fully re-synced.
    #[arg(long, default_value = "30s", value_parser = duration_arg)]
    pub iptables_sync_period: Duration
        => |f, v| {
            f.iptables.sync_period = dur(v);
            f.nftables.sync_period = dur(v);
            f.sync_period = None;
        };
    /// The minimum period between rule re-syncs.
    #[arg(long, default_value = "1s", value_parser = duration_arg)]
    pub iptables_min_sync_period: Duration
        => |f, v| {
            f.iptables.min_sync_period = dur(v);
            f.nftables.min_sync_period = dur(v);
            f.min_sync_period = None;
        };
    /// Allow NodePorts on localhost (iptables mode, IPv4).
    #[arg(long, num_args = 0..=1, default_value = "true", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub iptables_localhost_nodeports: bool;
    /// How often configuration from the apiserver is refreshed.
    #[arg(long, default_value = "15m", value_parser = duration_arg)]
    pub config_sync_period: Duration;
    /// The ipvs scheduler type.
    #[arg(long, default_value = "")]
    pub ipvs_scheduler: String;
    #[arg(long, default_value = "30s", value_parser = duration_arg)]
    pub ipvs_sync_period: Duration
        => |f, v| {
            f.ipvs.sync_period = dur(v);
            if f.mode == ProxyMode::Ipvs.as_str() {
                f.sync_period = None;
            }
        };
    #[arg(long, default_value = "1s", value_parser = duration_arg)]
    pub ipvs_min_sync_period: Duration
        => |f, v| {
            f.ipvs.min_sync_period = dur(v);
            if f.mode == ProxyMode::Ipvs.as_str() {
                f.min_sync_period = None;
            }
        };
    /// CIDRs the ipvs proxier should not touch when cleaning up.
    #[arg(long, value_delimiter = ',')]
    pub ipvs_exclude_cidrs: Vec<String>;
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub ipvs_strict_arp: bool;
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    pub ipvs_tcp_timeout: Duration;
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    pub ipvs_tcpfin_timeout: Duration;
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    pub ipvs_udp_timeout: Duration;
    /// Maximum tracked NAT connections per CPU core (0 leaves the limit as is).
    #[arg(long, default_value_t = 32768)]
    pub conntrack_max_per_core: i32;
    #[arg(long, default_value_t = 131072)]
    pub conntrack_min: i32;
    #[arg(long, default_value = "24h0m0s", value_parser = duration_arg)]
    pub conntrack_tcp_timeout_established: Duration;
    #[arg(long, default_value = "1h0m0s", value_parser = duration_arg)]
    pub conntrack_tcp_timeout_close_wait: Duration;
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub conntrack_tcp_be_liberal: bool;
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    pub conntrack_udp_timeout: Duration;
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
    pub conntrack_udp_timeout_stream: Duration;
    /// Remove our rules and exit.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub cleanup: bool;
    /// Log verbosity.
    #[arg(short = 'v', long = "v", default_value_t = 0)]
    pub verbosity: u8
        => @over_config |f, v| f.logging.verbosity = Some(u32::from(*v));
    /// Accepted for compatibility.
    #[arg(long, default_value_t = -999, allow_negative_numbers = true)]
    pub oom_score_adj: i32;
    /// key=value pairs, comma-separated.
    #[arg(long, default_value = "")]
    pub feature_gates: String
        => |f, v| merge_feature_gates(&mut f.feature_gates, v);
    /// Accepted for compatibility.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub profiling: bool;
    /// Accepted for compatibility.
    #[arg(long, default_value = "")]
    pub show_hidden_metrics_for_version: String;
    #[arg(long, default_value_t = 5.0)]
    pub kube_api_qps: f32;
    #[arg(long, default_value_t = 10)]
    pub kube_api_burst: i32;
    #[arg(long, default_value = "application/vnd.kubernetes.protobuf")]
    pub kube_api_content_type: String;
    /// Accepted for compatibility.
    #[arg(long)]
    pub vmodule: Option<String>;
    /// Accepted for compatibility.
    #[arg(long, default_value = "5s")]
    pub log_flush_frequency: String;
    /// Accepted for compatibility (upstream's klog buffering and stream
    /// splitting; ours writes every line to stderr unbuffered).
    #[arg(long)]
    pub log_json_info_buffer_size: Option<String>;
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub log_json_split_stream: Option<bool>;
    #[arg(long)]
    pub log_text_info_buffer_size: Option<String>;
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub log_text_split_stream: Option<bool>;
    /// Accepted for compatibility (upstream reads node identity files for
    /// its Events; ours does not need them).
    #[arg(long)]
    pub boot_id_file: Option<String>;
    #[arg(long)]
    pub machine_id_file: Option<String>;
    /// Deprecated upstream: 0 disables the health server; another port is
    /// used only when --healthz-bind-address has none. Ignored with --config.
    #[arg(long, hide = true)]
    pub healthz_port: Option<i32>
        => @deprecated |f, v| f.deprecated_port(true, *v);
    /// Deprecated upstream: 0 disables the metrics server; another port is
    /// used only when --metrics-bind-address has none. Ignored with --config.
    #[arg(long, hide = true)]
    pub metrics_port: Option<i32>
        => @deprecated |f, v| f.deprecated_port(false, *v);
    /// Perform the host setup that needs full root privileges (conntrack
    /// sysctls, the mode's sysctls), then exit; a later start then needs only
    /// CAP_NET_ADMIN.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub init_only: bool;

    // --- kube-proxy-rs additions ---
    /// Directory of Service/EndpointSlice/Node manifests to serve from, when no
    /// API server is configured.
    #[arg(long)]
    pub manifests: Option<PathBuf>;
    /// Print the rules that would be installed instead of installing them.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub dry_run: bool;
    /// Log format: text or json (upstream's --logging-format is an alias).
    #[arg(long, alias = "logging-format", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String
        => @over_config |f, v| f.logging.format = Some(v.clone());
    /// Only handle Services labelled service.kubernetes.io/service-proxy-name=NAME
    /// (instead of the unlabelled ones).
    #[arg(long)]
    pub service_proxy_name: Option<String>;
    /// iptables mode: which iptables backend to program: auto (detect like
    /// upstream: the one holding Kubernetes chains, else the one with more
    /// rules, else nft), nft or legacy.
    #[arg(long, env = "KUBE_PROXY_RS_IPTABLES_BACKEND", default_value = "auto", value_parser = ["auto", "nft", "legacy"])]
    pub iptables_backend: String;
    /// iptables-nft: write the rules with `iptables-nft-restore` instead of
    /// over nf_tables netlink (the same rules; the programs' speed, as
    /// upstream). A fallback, off by default.
    #[arg(long, env = "KUBE_PROXY_RS_IPTABLES_NFT_RESTORE")]
    pub iptables_nft_restore: bool;
    #[command(flatten)]
    pub userspace: UserspaceFlags;
    #[command(flatten)]
    pub socket_lb: SocketLbFlags;
}
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

    /// Issue 51's rule: with `--config`, upstream still honours its logging
    /// flags and --hostname-override, and only those.
    #[test]
    fn only_logging_and_hostname_apply_over_the_file() {
        let over: Vec<&str> = Cli::bound_flags()
            .into_iter()
            .filter(|(_, over)| *over)
            .map(|(id, _)| id)
            .collect();
        assert_eq!(over, ["hostname_override", "verbosity", "log_format"]);
    }

    /// Every bound flag is a flag with a long name, and none twice.
    #[test]
    fn every_binding_is_a_flag() {
        let cmd = Cli::command();
        let mut seen = std::collections::BTreeSet::new();
        let bound = Cli::bound_flags();
        assert!(bound.len() > 40, "{} bindings", bound.len());
        for (id, _) in bound {
            let arg = cmd.get_arguments().find(|a| a.get_id() == id);
            assert!(arg.and_then(|a| a.get_long()).is_some(), "no flag {id}");
            assert!(seen.insert(id), "{id} twice");
        }
    }

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
