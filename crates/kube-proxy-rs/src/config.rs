//! Upstream kube-proxy's command-line flags and KubeProxyConfiguration file.
//!
//! [`load`] parses the flags, reads `--config` when given, lets flags that were
//! given on the command line override the file (as upstream does), applies
//! upstream's defaults and validates everything into one [`ProxyConfig`].

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};
use ipnet::IpNet;
use kp_model::{IpFamily, LocalDetector, ProxierConfig};
use serde::{Deserialize, Deserializer, Serialize};

/// `--version` prints "kube-proxy-rs VERSION"; the long form says what it
/// is compatible with.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "\nflags and config: upstream kube-proxy 1.3x, kubeproxy.config.k8s.io/v1alpha1",
    "\nmodes: nftables (default), iptables (nft and legacy backends), ipvs, userspace"
);

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

const DEFAULT_HEALTHZ_PORT: u16 = 10256;
const DEFAULT_METRICS_PORT: u16 = 10249;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Bad flags, or `--help` / `--version`: call `err.exit()` to print and exit
    /// with clap's status.
    #[error(transparent)]
    Cli(#[from] clap::Error),
    #[error("reading config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// YAML syntax errors and type errors; `message` names the field path.
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// A value that parsed but is not acceptable; `field` is the
    /// KubeProxyConfiguration path (e.g. `iptables.masqueradeBit`).
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    #[error("writing config to {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("serializing the configuration: {0}")]
    Serialize(String),
    #[error("cannot determine this machine's hostname: {0}")]
    Hostname(String),
}

fn invalid(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        message: message.into(),
    }
}

// ---------------------------------------------------------------------------
// Go durations
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("empty duration")]
    Empty,
    #[error("invalid duration {0:?}")]
    Syntax(String),
    #[error("missing unit in duration {0:?}")]
    MissingUnit(String),
    #[error("unknown unit {unit:?} in duration {input:?}")]
    UnknownUnit { unit: String, input: String },
    #[error("duration {0:?} is negative")]
    Negative(String),
    #[error("duration {0:?} is too large")]
    Overflow(String),
}

/// Parses Go's `time.ParseDuration` syntax ("30s", "1m0s", "1.5h", "500ms",
/// "1h2m3s", "0"). Negative durations are rejected: nothing here can use one.
pub fn parse_go_duration(input: &str) -> Result<Duration, DurationError> {
    let mut s = input;
    let mut negative = false;
    if let Some(rest) = s.strip_prefix('-') {
        negative = true;
        s = rest;
    } else if let Some(rest) = s.strip_prefix('+') {
        s = rest;
    }
    if s.is_empty() {
        return Err(if input.is_empty() {
            DurationError::Empty
        } else {
            DurationError::Syntax(input.to_string())
        });
    }
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    // Go's limit is i64 nanoseconds.
    const MAX: u128 = i64::MAX as u128;
    let mut total: u128 = 0;
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        let int_part = &s[start..i];
        let mut frac_part = "";
        if i < bytes.len() && bytes[i] == b'.' {
            i += 1;
            let fstart = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            frac_part = &s[fstart..i];
        }
        if int_part.is_empty() && frac_part.is_empty() {
            return Err(DurationError::Syntax(input.to_string()));
        }
        let ustart = i;
        while i < bytes.len() && !bytes[i].is_ascii_digit() && bytes[i] != b'.' {
            i += 1;
        }
        let unit = &s[ustart..i];
        if unit.is_empty() {
            return Err(DurationError::MissingUnit(input.to_string()));
        }
        let scale: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => {
                return Err(DurationError::UnknownUnit {
                    unit: unit.to_string(),
                    input: input.to_string(),
                })
            }
        };
        let overflow = || DurationError::Overflow(input.to_string());
        let int_val: u128 = if int_part.is_empty() {
            0
        } else {
            int_part.parse::<u128>().map_err(|_| overflow())?
        };
        let mut value = int_val.checked_mul(scale).ok_or_else(overflow)?;
        // Digits past nanosecond precision cannot change the result.
        let mut frac_scale = scale;
        for d in frac_part.bytes() {
            frac_scale /= 10;
            if frac_scale == 0 {
                break;
            }
            value += u128::from(d - b'0') * frac_scale;
        }
        total = total.checked_add(value).ok_or_else(overflow)?;
        if total > MAX {
            return Err(overflow());
        }
    }
    if negative && total != 0 {
        return Err(DurationError::Negative(input.to_string()));
    }
    let secs = (total / 1_000_000_000) as u64;
    let nanos = (total % 1_000_000_000) as u32;
    Ok(Duration::new(secs, nanos))
}

fn frac_string(mut frac: u128, mut digits: usize) -> String {
    // `digits` decimal places, trailing zeros dropped.
    while digits > 0 && frac.is_multiple_of(10) {
        frac /= 10;
        digits -= 1;
    }
    if digits == 0 {
        String::new()
    } else {
        format!(".{frac:0digits$}")
    }
}

/// Formats like Go's `time.Duration.String()`: "0s", "500ms", "1.5s", "1m0s",
/// "1h2m3s".
pub fn format_go_duration(d: Duration) -> String {
    let n = d.as_nanos();
    if n == 0 {
        return "0s".to_string();
    }
    if n < 1_000 {
        return format!("{n}ns");
    }
    if n < 1_000_000 {
        return format!("{}{}µs", n / 1_000, frac_string(n % 1_000, 3));
    }
    if n < 1_000_000_000 {
        return format!("{}{}ms", n / 1_000_000, frac_string(n % 1_000_000, 6));
    }
    let total_secs = n / 1_000_000_000;
    let sub = n % 1_000_000_000;
    let h = total_secs / 3600;
    let m = (total_secs / 60) % 60;
    let s = total_secs % 60;
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if h > 0 || m > 0 {
        out.push_str(&format!("{m}m"));
    }
    out.push_str(&format!("{s}{}s", frac_string(sub, 9)));
    out
}

fn duration_arg(s: &str) -> Result<Duration, String> {
    parse_go_duration(s).map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------
// Flags
// ---------------------------------------------------------------------------

/// Proxy mode. `userspace` is accepted for compatibility with old configs.
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

impl FromStr for ProxyMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            // Empty is upstream's "the platform default"; ours is nftables.
            "" | "nftables" => Ok(ProxyMode::Nftables),
            "iptables" => Ok(ProxyMode::Iptables),
            "ipvs" => Ok(ProxyMode::Ipvs),
            "userspace" => Ok(ProxyMode::Userspace),
            other => Err(format!(
                "unknown proxy mode {other:?} (expected nftables, iptables, ipvs or userspace)"
            )),
        }
    }
}

impl fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
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
    /// Which proxy mode to use: nftables (default), iptables, ipvs or userspace.
    #[arg(long, default_value = "nftables", value_parser = ProxyMode::from_str)]
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
    #[arg(long, default_value = "0s", value_parser = duration_arg)]
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
    #[arg(long)]
    pub log_flush_frequency: Option<String>,
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
    #[command(flatten)]
    pub userspace: crate::modes::userspace::UserspaceFlags,
}

// ---------------------------------------------------------------------------
// KubeProxyConfiguration (the file format)
// ---------------------------------------------------------------------------

/// `null` in the file means "unset", as in Go.
fn nullable<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientConnection {
    #[serde(default, deserialize_with = "nullable")]
    pub kubeconfig: String,
    #[serde(default, deserialize_with = "nullable")]
    pub accept_content_types: String,
    #[serde(default, deserialize_with = "nullable")]
    pub content_type: String,
    #[serde(default, deserialize_with = "nullable")]
    pub qps: f32,
    #[serde(default, deserialize_with = "nullable")]
    pub burst: i32,
}

#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Logging {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// A Go duration string or nanoseconds; accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_frequency: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmodule: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<serde_json::Value>,
}

#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IptablesSection {
    #[serde(default)]
    pub masquerade_bit: Option<i32>,
    #[serde(default, deserialize_with = "nullable")]
    pub masquerade_all: bool,
    #[serde(default)]
    pub localhost_node_ports: Option<bool>,
    #[serde(default, rename = "snatNodeInternalIP")]
    pub snat_node_internal_ip: Option<bool>,
    #[serde(default)]
    pub sync_period: Option<String>,
    #[serde(default)]
    pub min_sync_period: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NftablesSection {
    #[serde(default)]
    pub masquerade_bit: Option<i32>,
    #[serde(default, deserialize_with = "nullable")]
    pub masquerade_all: bool,
    #[serde(default)]
    pub sync_period: Option<String>,
    #[serde(default)]
    pub min_sync_period: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IpvsSection {
    #[serde(default)]
    pub sync_period: Option<String>,
    #[serde(default)]
    pub min_sync_period: Option<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub scheduler: String,
    #[serde(default, rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(default, rename = "strictARP", deserialize_with = "nullable")]
    pub strict_arp: bool,
    #[serde(default)]
    pub tcp_timeout: Option<String>,
    #[serde(default)]
    pub tcp_fin_timeout: Option<String>,
    #[serde(default)]
    pub udp_timeout: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConntrackSection {
    #[serde(default)]
    pub max_per_core: Option<i32>,
    #[serde(default)]
    pub min: Option<i32>,
    #[serde(default)]
    pub tcp_established_timeout: Option<String>,
    #[serde(default)]
    pub tcp_close_wait_timeout: Option<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub tcp_be_liberal: bool,
    #[serde(default)]
    pub udp_timeout: Option<String>,
    #[serde(default)]
    pub udp_stream_timeout: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DetectLocalSection {
    #[serde(default, deserialize_with = "nullable")]
    pub bridge_interface: String,
    #[serde(default, deserialize_with = "nullable")]
    pub interface_name_prefix: String,
}

/// The v1alpha1 KubeProxyConfiguration file, field for field. Unknown fields
/// are errors.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubeProxyConfiguration {
    #[serde(default)]
    pub api_version: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub feature_gates: BTreeMap<String, bool>,
    #[serde(default, deserialize_with = "nullable")]
    pub client_connection: ClientConnection,
    #[serde(default, deserialize_with = "nullable")]
    pub logging: Logging,
    #[serde(default, deserialize_with = "nullable")]
    pub hostname_override: String,
    #[serde(default, deserialize_with = "nullable")]
    pub bind_address: String,
    #[serde(default, deserialize_with = "nullable")]
    pub healthz_bind_address: String,
    #[serde(default, deserialize_with = "nullable")]
    pub metrics_bind_address: String,
    #[serde(default, deserialize_with = "nullable")]
    pub bind_address_hard_fail: bool,
    #[serde(default, deserialize_with = "nullable")]
    pub enable_profiling: bool,
    #[serde(default, deserialize_with = "nullable")]
    pub show_hidden_metrics_for_version: String,
    #[serde(default, deserialize_with = "nullable")]
    pub mode: String,
    #[serde(default, deserialize_with = "nullable")]
    pub iptables: IptablesSection,
    #[serde(default, deserialize_with = "nullable")]
    pub ipvs: IpvsSection,
    #[serde(default, deserialize_with = "nullable")]
    pub nftables: NftablesSection,
    /// Windows settings: accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub winkernel: Option<serde_json::Value>,
    #[serde(default, deserialize_with = "nullable")]
    pub detect_local_mode: String,
    #[serde(default, deserialize_with = "nullable")]
    pub detect_local: DetectLocalSection,
    #[serde(default, rename = "clusterCIDR", deserialize_with = "nullable")]
    pub cluster_cidr: String,
    #[serde(default)]
    pub node_port_addresses: Option<Vec<String>>,
    #[serde(default)]
    pub oom_score_adj: Option<i32>,
    #[serde(default, deserialize_with = "nullable")]
    pub conntrack: ConntrackSection,
    #[serde(default)]
    pub config_sync_period: Option<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub port_range: String,
    #[serde(
        default,
        deserialize_with = "nullable",
        skip_serializing_if = "is_false"
    )]
    pub windows_run_as_service: bool,
    /// Newer upstream's mode-independent periods; override the mode's section.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<String>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl KubeProxyConfiguration {
    /// Parses a KubeProxyConfiguration YAML (or JSON) document. Errors name the
    /// field path.
    pub fn from_yaml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let parse_err = |message: String| ConfigError::Parse {
            path: path.to_path_buf(),
            message,
        };
        // Two steps so that type and unknown-field errors carry the field path.
        let value: serde_json::Value =
            serde_saphyr::from_str(text).map_err(|e| parse_err(e.to_string()))?;
        if value.is_null() {
            return Err(parse_err("the file is empty".to_string()));
        }
        let cfg: KubeProxyConfiguration = serde_path_to_error::deserialize(value).map_err(|e| {
            let p = e.path().to_string();
            if p == "." || p.is_empty() {
                parse_err(e.inner().to_string())
            } else {
                parse_err(format!("{p}: {}", e.inner()))
            }
        })?;
        match cfg.api_version.as_deref() {
            Some(API_VERSION) => {}
            Some(other) => {
                return Err(invalid(
                    "apiVersion",
                    format!("{other:?} is not supported (expected {API_VERSION})"),
                ))
            }
            None => {
                return Err(invalid(
                    "apiVersion",
                    format!("missing (expected {API_VERSION})"),
                ))
            }
        }
        match cfg.kind.as_deref() {
            Some(KIND) => {}
            Some(other) => return Err(invalid("kind", format!("{other:?} is not {KIND}"))),
            None => return Err(invalid("kind", format!("missing (expected {KIND})"))),
        }
        Ok(cfg)
    }
}

// ---------------------------------------------------------------------------
// The effective settings
// ---------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq)]
pub struct IpvsSettings {
    pub scheduler: String,
    pub sync_period: Duration,
    pub min_sync_period: Duration,
    pub exclude_cidrs: Vec<IpNet>,
    pub strict_arp: bool,
    /// Zero leaves the system's value.
    pub tcp_timeout: Duration,
    pub tcp_fin_timeout: Duration,
    pub udp_timeout: Duration,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ConntrackSettings {
    /// 0 leaves nf_conntrack_max as is.
    pub max_per_core: i32,
    pub min: i32,
    /// Zero leaves the sysctl as is (as do the other timeouts).
    pub tcp_established_timeout: Duration,
    pub tcp_close_wait_timeout: Duration,
    pub tcp_be_liberal: bool,
    pub udp_timeout: Duration,
    pub udp_stream_timeout: Duration,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ClientSettings {
    pub qps: f32,
    pub burst: i32,
    pub content_type: String,
}

/// Everything the binary needs, validated, in plain Rust types.
#[derive(Clone, Debug, PartialEq)]
pub struct ProxyConfig {
    pub mode: ProxyMode,
    /// Node name: --hostname-override, else this machine's hostname; lowercased.
    pub hostname: String,
    pub bind_address: IpAddr,
    pub bind_address_hard_fail: bool,
    /// None when disabled (`--healthz-bind-address=""`).
    pub healthz_bind_address: Option<SocketAddr>,
    pub metrics_bind_address: Option<SocketAddr>,
    /// At most one per IP family.
    pub cluster_cidrs: Vec<IpNet>,
    pub detect_local_mode: DetectLocalMode,
    pub pod_bridge_interface: String,
    pub pod_interface_name_prefix: String,
    /// NodePort CIDRs (the `all` keyword gives 0.0.0.0/0 and ::/0, `localhost`
    /// 127.0.0.0/8 and ::1/128). Empty with `nodeport_primary` false: every
    /// local address.
    pub nodeport_addresses: Vec<IpNet>,
    /// The `primary` keyword: the Node's own IPs (the default in nftables mode).
    pub nodeport_primary: bool,
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
    /// --userspace-* flags (userspace mode).
    pub userspace: crate::modes::userspace::UserspaceFlags,
    pub ipvs: IpvsSettings,
    pub conntrack: ConntrackSettings,
    pub oom_score_adj: i32,
    pub feature_gates: BTreeMap<String, bool>,
    pub config_file: Option<PathBuf>,
    pub write_config_to: Option<PathBuf>,
    /// The effective configuration in file form (defaults filled in), for
    /// --write-config-to and /configz.
    pub configuration: KubeProxyConfiguration,
}

/// Parses flags (`args[0]` is the program name), reads `--config`, lets flags
/// given on the command line override it, applies upstream's defaults and
/// validates. `--write-config-to` is left to the caller (see
/// [`ProxyConfig::write_config`]) so that it can exit afterwards.
pub fn load(cli_args: impl IntoIterator<Item = OsString>) -> Result<ProxyConfig, ConfigError> {
    let matches = Cli::command().try_get_matches_from(cli_args)?;
    let cli = Cli::from_arg_matches(&matches)?;
    let mut raw = match &cli.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.clone(),
                source,
            })?;
            KubeProxyConfiguration::from_yaml(&text, path)?
        }
        None => KubeProxyConfiguration::default(),
    };
    overlay_flags(&mut raw, &cli, &matches)?;
    let healthz_disabled =
        given(&matches, "healthz_bind_address") && cli.healthz_bind_address.trim().is_empty();
    let metrics_disabled =
        given(&matches, "metrics_bind_address") && cli.metrics_bind_address.trim().is_empty();
    let mut pc = resolve(raw)?;
    if healthz_disabled {
        pc.healthz_bind_address = None;
    }
    if metrics_disabled {
        pc.metrics_bind_address = None;
    }
    pc.master = cli.master.clone().filter(|m| !m.is_empty());
    pc.manifests = cli.manifests.clone();
    pc.cleanup = cli.cleanup;
    pc.dry_run = cli.dry_run;
    pc.init_only = cli.init_only;
    if pc.init_only && pc.dry_run {
        // --dry-run promises that nothing touches the kernel.
        return Err(invalid("--init-only", "cannot be combined with --dry-run"));
    }
    pc.service_proxy_name = cli.service_proxy_name.clone().filter(|s| !s.is_empty());
    // Refused here rather than by the API server on every list (it becomes
    // part of the label selector).
    kp_source::label_selector(pc.service_proxy_name.as_deref())
        .map_err(|e| invalid("--service-proxy-name", e.to_string()))?;
    pc.iptables_backend = kp_iptables::Variant::parse_choice(&cli.iptables_backend)
        .map_err(|e| invalid("--iptables-backend", e))?;
    pc.userspace = cli.userspace.clone();
    pc.config_file = cli.config.clone();
    pc.write_config_to = cli.write_config_to.clone();
    Ok(pc)
}

/// True when the flag was set by the user (not clap's default).
fn given(m: &ArgMatches, id: &str) -> bool {
    matches!(
        m.value_source(id),
        Some(ValueSource::CommandLine) | Some(ValueSource::EnvVariable)
    )
}

fn parse_feature_gates(s: &str) -> Result<BTreeMap<String, bool>, ConfigError> {
    let mut out = BTreeMap::new();
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
        out.insert(k.trim().to_string(), b);
    }
    Ok(out)
}

fn overlay_flags(
    raw: &mut KubeProxyConfiguration,
    cli: &Cli,
    m: &ArgMatches,
) -> Result<(), ConfigError> {
    let dur = |d: Duration| Some(format_go_duration(d));
    if given(m, "kubeconfig") {
        raw.client_connection.kubeconfig = cli
            .kubeconfig
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
    }
    if given(m, "kube_api_qps") {
        raw.client_connection.qps = cli.kube_api_qps;
    }
    if given(m, "kube_api_burst") {
        raw.client_connection.burst = cli.kube_api_burst;
    }
    if given(m, "kube_api_content_type") {
        raw.client_connection.content_type = cli.kube_api_content_type.clone();
    }
    if given(m, "proxy_mode") {
        raw.mode = cli.proxy_mode.as_str().to_string();
    }
    if given(m, "hostname_override") {
        raw.hostname_override = cli.hostname_override.clone();
    }
    if given(m, "bind_address") {
        raw.bind_address = cli.bind_address.to_string();
    }
    if given(m, "bind_address_hard_fail") {
        raw.bind_address_hard_fail = cli.bind_address_hard_fail;
    }
    if given(m, "healthz_bind_address") {
        raw.healthz_bind_address = cli.healthz_bind_address.clone();
    }
    if given(m, "metrics_bind_address") {
        raw.metrics_bind_address = cli.metrics_bind_address.clone();
    }
    if given(m, "cluster_cidr") {
        raw.cluster_cidr = cli.cluster_cidr.clone();
    }
    if given(m, "detect_local_mode") {
        raw.detect_local_mode = cli.detect_local_mode.as_str().to_string();
    }
    if given(m, "pod_bridge_interface") {
        raw.detect_local.bridge_interface = cli.pod_bridge_interface.clone();
    }
    if given(m, "pod_interface_name_prefix") {
        raw.detect_local.interface_name_prefix = cli.pod_interface_name_prefix.clone();
    }
    if given(m, "nodeport_addresses") {
        let list: Vec<String> = cli
            .nodeport_addresses
            .iter()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        raw.node_port_addresses = Some(list);
    }
    // Upstream's masquerade and sync flags apply to whichever mode runs.
    if given(m, "masquerade_all") {
        raw.iptables.masquerade_all = cli.masquerade_all;
        raw.nftables.masquerade_all = cli.masquerade_all;
    }
    if given(m, "iptables_masquerade_bit") {
        raw.iptables.masquerade_bit = Some(cli.iptables_masquerade_bit);
        raw.nftables.masquerade_bit = Some(cli.iptables_masquerade_bit);
    }
    if given(m, "iptables_sync_period") {
        raw.iptables.sync_period = dur(cli.iptables_sync_period);
        raw.nftables.sync_period = dur(cli.iptables_sync_period);
        raw.sync_period = None;
    }
    if given(m, "iptables_min_sync_period") {
        raw.iptables.min_sync_period = dur(cli.iptables_min_sync_period);
        raw.nftables.min_sync_period = dur(cli.iptables_min_sync_period);
        raw.min_sync_period = None;
    }
    if given(m, "iptables_localhost_nodeports") {
        raw.iptables.localhost_node_ports = Some(cli.iptables_localhost_nodeports);
    }
    if given(m, "config_sync_period") {
        raw.config_sync_period = dur(cli.config_sync_period);
    }
    if given(m, "ipvs_scheduler") {
        raw.ipvs.scheduler = cli.ipvs_scheduler.clone();
    }
    if given(m, "ipvs_sync_period") {
        raw.ipvs.sync_period = dur(cli.ipvs_sync_period);
        if cli.proxy_mode == ProxyMode::Ipvs {
            raw.sync_period = None;
        }
    }
    if given(m, "ipvs_min_sync_period") {
        raw.ipvs.min_sync_period = dur(cli.ipvs_min_sync_period);
        if cli.proxy_mode == ProxyMode::Ipvs {
            raw.min_sync_period = None;
        }
    }
    if given(m, "ipvs_exclude_cidrs") {
        raw.ipvs.exclude_cidrs = Some(
            cli.ipvs_exclude_cidrs
                .iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
        );
    }
    if given(m, "ipvs_strict_arp") {
        raw.ipvs.strict_arp = cli.ipvs_strict_arp;
    }
    if given(m, "ipvs_tcp_timeout") {
        raw.ipvs.tcp_timeout = dur(cli.ipvs_tcp_timeout);
    }
    if given(m, "ipvs_tcpfin_timeout") {
        raw.ipvs.tcp_fin_timeout = dur(cli.ipvs_tcpfin_timeout);
    }
    if given(m, "ipvs_udp_timeout") {
        raw.ipvs.udp_timeout = dur(cli.ipvs_udp_timeout);
    }
    if given(m, "conntrack_max_per_core") {
        raw.conntrack.max_per_core = Some(cli.conntrack_max_per_core);
    }
    if given(m, "conntrack_min") {
        raw.conntrack.min = Some(cli.conntrack_min);
    }
    if given(m, "conntrack_tcp_timeout_established") {
        raw.conntrack.tcp_established_timeout = dur(cli.conntrack_tcp_timeout_established);
    }
    if given(m, "conntrack_tcp_timeout_close_wait") {
        raw.conntrack.tcp_close_wait_timeout = dur(cli.conntrack_tcp_timeout_close_wait);
    }
    if given(m, "conntrack_tcp_be_liberal") {
        raw.conntrack.tcp_be_liberal = cli.conntrack_tcp_be_liberal;
    }
    if given(m, "conntrack_udp_timeout") {
        raw.conntrack.udp_timeout = dur(cli.conntrack_udp_timeout);
    }
    if given(m, "conntrack_udp_timeout_stream") {
        raw.conntrack.udp_stream_timeout = dur(cli.conntrack_udp_timeout_stream);
    }
    if given(m, "verbosity") {
        raw.logging.verbosity = Some(u32::from(cli.verbosity));
    }
    if given(m, "log_format") {
        raw.logging.format = Some(cli.log_format.clone());
    }
    if given(m, "oom_score_adj") {
        raw.oom_score_adj = Some(cli.oom_score_adj);
    }
    if given(m, "feature_gates") {
        for (k, v) in parse_feature_gates(&cli.feature_gates)? {
            raw.feature_gates.insert(k, v);
        }
    }
    if given(m, "profiling") {
        raw.enable_profiling = cli.profiling;
    }
    if given(m, "show_hidden_metrics_for_version") {
        raw.show_hidden_metrics_for_version = cli.show_hidden_metrics_for_version.clone();
    }
    Ok(())
}

/// A duration field: unset or zero takes `default` (upstream's defaulting).
fn duration_field(
    field: &str,
    value: &Option<String>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match value {
        None => Ok(default),
        Some(s) => {
            let d = parse_go_duration(s).map_err(|e| invalid(field, e.to_string()))?;
            Ok(if d.is_zero() { default } else { d })
        }
    }
}

/// A duration field where zero is meaningful (kept as zero).
fn duration_field_keep_zero(field: &str, value: &Option<String>) -> Result<Duration, ConfigError> {
    match value {
        None => Ok(Duration::ZERO),
        Some(s) => parse_go_duration(s).map_err(|e| invalid(field, e.to_string())),
    }
}

fn masquerade_bit(field: &str, v: i32) -> Result<u8, ConfigError> {
    if (0..=31).contains(&v) {
        Ok(v as u8)
    } else {
        Err(invalid(field, format!("{v} is not in 0..=31")))
    }
}

fn parse_cidr(field: &str, s: &str) -> Result<IpNet, ConfigError> {
    let s = s.trim();
    // Upstream accepts a bare IP in a few places; a CIDR is required here.
    IpNet::from_str(s)
        .map(|n| n.trunc())
        .map_err(|_| invalid(field, format!("{s:?} is not a valid CIDR")))
}

/// "ip:port", "[v6]:port", or a bare IP (which takes `default_port`).
fn parse_bind(field: &str, s: &str, default_port: u16) -> Result<SocketAddr, ConfigError> {
    let s = s.trim();
    if let Ok(sa) = SocketAddr::from_str(s) {
        return Ok(sa);
    }
    let bare = s.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = IpAddr::from_str(bare) {
        return Ok(SocketAddr::new(ip, default_port));
    }
    Err(invalid(
        field,
        format!("{s:?} is not an IP:port address (e.g. 0.0.0.0:{default_port})"),
    ))
}

/// This machine's hostname, lowercased.
fn machine_hostname() -> Result<String, ConfigError> {
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        let s = s.trim();
        if !s.is_empty() {
            return Ok(s.to_lowercase());
        }
    }
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates
    // when the name fits, and we bound the read by the buffer length anyway.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return Err(ConfigError::Hostname(
            std::io::Error::last_os_error().to_string(),
        ));
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).trim().to_lowercase();
    if name.is_empty() {
        return Err(ConfigError::Hostname("the hostname is empty".to_string()));
    }
    Ok(name)
}

/// Applies defaults to `raw` (in place, so it can be written back out) and
/// builds the validated settings.
fn resolve(mut raw: KubeProxyConfiguration) -> Result<ProxyConfig, ConfigError> {
    raw.api_version = Some(API_VERSION.to_string());
    raw.kind = Some(KIND.to_string());

    let mode = ProxyMode::from_str(&raw.mode).map_err(|e| invalid("mode", e))?;
    raw.mode = mode.as_str().to_string();

    // bindAddress and the listen addresses.
    let bind_address = if raw.bind_address.trim().is_empty() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::from_str(raw.bind_address.trim()).map_err(|_| {
            invalid(
                "bindAddress",
                format!("{:?} is not a valid IP address", raw.bind_address),
            )
        })?
    };
    raw.bind_address = bind_address.to_string();
    let v6 = bind_address.is_ipv6();
    if raw.healthz_bind_address.trim().is_empty() {
        let ip: IpAddr = if v6 {
            Ipv6Addr::UNSPECIFIED.into()
        } else {
            Ipv4Addr::UNSPECIFIED.into()
        };
        raw.healthz_bind_address = SocketAddr::new(ip, DEFAULT_HEALTHZ_PORT).to_string();
    }
    if raw.metrics_bind_address.trim().is_empty() {
        let ip: IpAddr = if v6 {
            Ipv6Addr::LOCALHOST.into()
        } else {
            Ipv4Addr::LOCALHOST.into()
        };
        raw.metrics_bind_address = SocketAddr::new(ip, DEFAULT_METRICS_PORT).to_string();
    }
    let healthz = parse_bind(
        "healthzBindAddress",
        &raw.healthz_bind_address,
        DEFAULT_HEALTHZ_PORT,
    )?;
    let metrics = parse_bind(
        "metricsBindAddress",
        &raw.metrics_bind_address,
        DEFAULT_METRICS_PORT,
    )?;

    // clusterCIDR: comma-separated, at most one per family.
    let mut cluster_cidrs = Vec::new();
    for part in raw
        .cluster_cidr
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        cluster_cidrs.push(parse_cidr("clusterCIDR", part)?);
    }
    let v4 = cluster_cidrs
        .iter()
        .filter(|c| matches!(c, IpNet::V4(_)))
        .count();
    if cluster_cidrs.len() > 2 || v4 > 1 || cluster_cidrs.len() - v4 > 1 {
        return Err(invalid(
            "clusterCIDR",
            format!(
                "{:?}: at most one CIDR per IP family is allowed",
                raw.cluster_cidr
            ),
        ));
    }

    let detect_local_mode = DetectLocalMode::from_str(&raw.detect_local_mode)
        .map_err(|e| invalid("detectLocalMode", e))?;
    raw.detect_local_mode = detect_local_mode.as_str().to_string();
    match detect_local_mode {
        DetectLocalMode::BridgeInterface if raw.detect_local.bridge_interface.is_empty() => {
            return Err(invalid(
                "detectLocal.bridgeInterface",
                "required when detectLocalMode is BridgeInterface",
            ))
        }
        DetectLocalMode::InterfaceNamePrefix
            if raw.detect_local.interface_name_prefix.is_empty() =>
        {
            return Err(invalid(
                "detectLocal.interfaceNamePrefix",
                "required when detectLocalMode is InterfaceNamePrefix",
            ))
        }
        _ => {}
    }

    // nodePortAddresses: unset means "primary" in nftables mode and "all"
    // elsewhere, as upstream.
    let mut nodeport_addresses = Vec::new();
    let mut nodeport_primary = false;
    match &raw.node_port_addresses {
        None => nodeport_primary = mode == ProxyMode::Nftables,
        Some(list) => {
            for (i, item) in list.iter().enumerate() {
                let field = format!("nodePortAddresses[{i}]");
                match item.trim() {
                    "primary" => nodeport_primary = true,
                    "all" => {
                        nodeport_addresses.push(parse_cidr(&field, "0.0.0.0/0")?);
                        nodeport_addresses.push(parse_cidr(&field, "::/0")?);
                    }
                    "localhost" => {
                        nodeport_addresses.push(parse_cidr(&field, "127.0.0.0/8")?);
                        nodeport_addresses.push(parse_cidr(&field, "::1/128")?);
                    }
                    other => nodeport_addresses.push(parse_cidr(&field, other)?),
                }
            }
        }
    }

    // Masquerading and sync periods: the running mode's section wins; an unset
    // nftables field falls back to the iptables one (so an upstream config
    // written for the iptables default keeps its meaning here).
    let ipt = raw.iptables.clone();
    let nft = raw.nftables.clone();
    let ipt_bit = masquerade_bit("iptables.masqueradeBit", ipt.masquerade_bit.unwrap_or(14))?;
    let nft_bit = match nft.masquerade_bit {
        Some(b) => masquerade_bit("nftables.masqueradeBit", b)?,
        None => ipt_bit,
    };
    let ipt_sync = duration_field(
        "iptables.syncPeriod",
        &ipt.sync_period,
        Duration::from_secs(30),
    )?;
    let ipt_min = duration_field(
        "iptables.minSyncPeriod",
        &ipt.min_sync_period,
        Duration::from_secs(1),
    )?;
    let nft_sync = duration_field("nftables.syncPeriod", &nft.sync_period, ipt_sync)?;
    let nft_min = duration_field("nftables.minSyncPeriod", &nft.min_sync_period, ipt_min)?;
    let ipvs_sync = duration_field(
        "ipvs.syncPeriod",
        &raw.ipvs.sync_period,
        Duration::from_secs(30),
    )?;
    let ipvs_min = duration_field_keep_zero("ipvs.minSyncPeriod", &raw.ipvs.min_sync_period)?;
    let localhost_nodeports = ipt.localhost_node_ports.unwrap_or(true);
    raw.iptables.masquerade_bit = Some(i32::from(ipt_bit));
    raw.iptables.sync_period = Some(format_go_duration(ipt_sync));
    raw.iptables.min_sync_period = Some(format_go_duration(ipt_min));
    raw.iptables.localhost_node_ports = Some(localhost_nodeports);
    raw.nftables.masquerade_bit = Some(i32::from(nft_bit));
    raw.nftables.sync_period = Some(format_go_duration(nft_sync));
    raw.nftables.min_sync_period = Some(format_go_duration(nft_min));
    raw.nftables.masquerade_all = nft.masquerade_all || ipt.masquerade_all;
    raw.ipvs.sync_period = Some(format_go_duration(ipvs_sync));
    raw.ipvs.min_sync_period = Some(format_go_duration(ipvs_min));

    let (mut sync_period, mut min_sync_period, masquerade_all, masquerade_bit) = match mode {
        ProxyMode::Nftables => (nft_sync, nft_min, raw.nftables.masquerade_all, nft_bit),
        ProxyMode::Ipvs => (ipvs_sync, ipvs_min, ipt.masquerade_all, ipt_bit),
        ProxyMode::Iptables | ProxyMode::Userspace => {
            (ipt_sync, ipt_min, ipt.masquerade_all, ipt_bit)
        }
    };
    if raw.sync_period.is_some() {
        sync_period = duration_field("syncPeriod", &raw.sync_period, sync_period)?;
        raw.sync_period = Some(format_go_duration(sync_period));
    }
    if raw.min_sync_period.is_some() {
        min_sync_period = duration_field_keep_zero("minSyncPeriod", &raw.min_sync_period)?;
        raw.min_sync_period = Some(format_go_duration(min_sync_period));
    }
    if min_sync_period > sync_period {
        return Err(invalid(
            "minSyncPeriod",
            format!(
                "{} is longer than syncPeriod {}",
                format_go_duration(min_sync_period),
                format_go_duration(sync_period)
            ),
        ));
    }

    let mut exclude_cidrs = Vec::new();
    for (i, c) in raw.ipvs.exclude_cidrs.iter().flatten().enumerate() {
        exclude_cidrs.push(parse_cidr(&format!("ipvs.excludeCIDRs[{i}]"), c)?);
    }
    let ipvs = IpvsSettings {
        scheduler: raw.ipvs.scheduler.clone(),
        sync_period: ipvs_sync,
        min_sync_period: ipvs_min,
        exclude_cidrs,
        strict_arp: raw.ipvs.strict_arp,
        tcp_timeout: duration_field_keep_zero("ipvs.tcpTimeout", &raw.ipvs.tcp_timeout)?,
        tcp_fin_timeout: duration_field_keep_zero("ipvs.tcpFinTimeout", &raw.ipvs.tcp_fin_timeout)?,
        udp_timeout: duration_field_keep_zero("ipvs.udpTimeout", &raw.ipvs.udp_timeout)?,
    };
    raw.ipvs.tcp_timeout = Some(format_go_duration(ipvs.tcp_timeout));
    raw.ipvs.tcp_fin_timeout = Some(format_go_duration(ipvs.tcp_fin_timeout));
    raw.ipvs.udp_timeout = Some(format_go_duration(ipvs.udp_timeout));

    let ct = &raw.conntrack;
    let conntrack = ConntrackSettings {
        max_per_core: ct.max_per_core.unwrap_or(32768),
        min: ct.min.unwrap_or(131072),
        tcp_established_timeout: duration_field(
            "conntrack.tcpEstablishedTimeout",
            &ct.tcp_established_timeout,
            Duration::from_secs(24 * 3600),
        )?,
        tcp_close_wait_timeout: duration_field(
            "conntrack.tcpCloseWaitTimeout",
            &ct.tcp_close_wait_timeout,
            Duration::from_secs(3600),
        )?,
        tcp_be_liberal: ct.tcp_be_liberal,
        udp_timeout: duration_field_keep_zero("conntrack.udpTimeout", &ct.udp_timeout)?,
        udp_stream_timeout: duration_field_keep_zero(
            "conntrack.udpStreamTimeout",
            &ct.udp_stream_timeout,
        )?,
    };
    if conntrack.max_per_core < 0 {
        return Err(invalid(
            "conntrack.maxPerCore",
            format!("{} must be >= 0", conntrack.max_per_core),
        ));
    }
    if conntrack.min < 0 {
        return Err(invalid(
            "conntrack.min",
            format!("{} must be >= 0", conntrack.min),
        ));
    }
    raw.conntrack.max_per_core = Some(conntrack.max_per_core);
    raw.conntrack.min = Some(conntrack.min);
    raw.conntrack.tcp_established_timeout =
        Some(format_go_duration(conntrack.tcp_established_timeout));
    raw.conntrack.tcp_close_wait_timeout =
        Some(format_go_duration(conntrack.tcp_close_wait_timeout));
    raw.conntrack.udp_timeout = Some(format_go_duration(conntrack.udp_timeout));
    raw.conntrack.udp_stream_timeout = Some(format_go_duration(conntrack.udp_stream_timeout));

    let config_sync_period = duration_field(
        "configSyncPeriod",
        &raw.config_sync_period,
        Duration::from_secs(15 * 60),
    )?;
    raw.config_sync_period = Some(format_go_duration(config_sync_period));

    let oom_score_adj = raw.oom_score_adj.unwrap_or(-999);
    if !(-1000..=1000).contains(&oom_score_adj) {
        return Err(invalid(
            "oomScoreAdj",
            format!("{oom_score_adj} is not in -1000..=1000"),
        ));
    }
    raw.oom_score_adj = Some(oom_score_adj);

    // clientConnection defaults.
    let cc = &mut raw.client_connection;
    if cc.content_type.is_empty() {
        cc.content_type = "application/vnd.kubernetes.protobuf".to_string();
    }
    if cc.qps == 0.0 {
        cc.qps = 5.0;
    }
    if cc.burst == 0 {
        cc.burst = 10;
    }
    if cc.qps < 0.0 {
        return Err(invalid(
            "clientConnection.qps",
            format!("{} must be >= 0", cc.qps),
        ));
    }
    if cc.burst < 0 {
        return Err(invalid(
            "clientConnection.burst",
            format!("{} must be >= 0", cc.burst),
        ));
    }
    let client = ClientSettings {
        qps: cc.qps,
        burst: cc.burst,
        content_type: cc.content_type.clone(),
    };
    let kubeconfig = if cc.kubeconfig.is_empty() {
        None
    } else {
        Some(PathBuf::from(&cc.kubeconfig))
    };

    let log_json = match raw.logging.format.as_deref() {
        None | Some("") | Some("text") => false,
        Some("json") => true,
        Some(other) => {
            return Err(invalid(
                "logging.format",
                format!("{other:?} is not text or json"),
            ))
        }
    };
    let verbosity = raw.logging.verbosity.unwrap_or(0);
    let verbosity = u8::try_from(verbosity)
        .map_err(|_| invalid("logging.verbosity", format!("{verbosity} is too large")))?;

    let hostname = if raw.hostname_override.trim().is_empty() {
        machine_hostname()?
    } else {
        raw.hostname_override.trim().to_lowercase()
    };

    Ok(ProxyConfig {
        mode,
        hostname,
        bind_address,
        bind_address_hard_fail: raw.bind_address_hard_fail,
        healthz_bind_address: Some(healthz),
        metrics_bind_address: Some(metrics),
        cluster_cidrs,
        detect_local_mode,
        pod_bridge_interface: raw.detect_local.bridge_interface.clone(),
        pod_interface_name_prefix: raw.detect_local.interface_name_prefix.clone(),
        nodeport_addresses,
        nodeport_primary,
        masquerade_all,
        masquerade_bit,
        sync_period,
        min_sync_period,
        localhost_nodeports,
        config_sync_period,
        kubeconfig,
        master: None,
        client,
        manifests: None,
        cleanup: false,
        dry_run: false,
        init_only: false,
        verbosity,
        log_json,
        service_proxy_name: None,
        iptables_backend: None,
        userspace: Default::default(),
        ipvs,
        conntrack,
        oom_score_adj,
        feature_gates: raw.feature_gates.clone(),
        config_file: None,
        write_config_to: None,
        configuration: raw,
    })
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
                LocalDetector::BridgeInterface(self.pod_bridge_interface.clone())
            }
            DetectLocalMode::InterfaceNamePrefix => {
                LocalDetector::InterfaceNamePrefix(self.pod_interface_name_prefix.clone())
            }
        }
    }

    /// NodePort CIDRs for `family`, as upstream's NodePortAddresses: `primary`
    /// adds the node IPs of this family as host routes; no CIDR of this family,
    /// or a /0, means every local address (returned as an empty list).
    pub fn nodeport_addresses_for(&self, family: IpFamily, node_ips: &[IpAddr]) -> Vec<IpNet> {
        let mut out: Vec<IpNet> = self
            .nodeport_addresses
            .iter()
            .filter(|c| family.matches(&c.addr()))
            .copied()
            .collect();
        if self.nodeport_primary {
            out.extend(
                node_ips
                    .iter()
                    .filter(|ip| family.matches(ip))
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
        pc.nodeport_addresses = self.nodeport_addresses_for(family, node_ips);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse() {
        let ok = [
            ("0", 0),
            ("0s", 0),
            ("30s", 30_000_000_000),
            ("1m0s", 60_000_000_000),
            ("15m", 900_000_000_000),
            ("500ms", 500_000_000),
            ("1h2m3s", 3_723_000_000_000),
            ("1.5h", 5_400_000_000_000),
            ("2.5s", 2_500_000_000),
            (".5s", 500_000_000),
            ("1us", 1_000),
            ("1µs", 1_000),
            ("7ns", 7),
            ("+5s", 5_000_000_000),
            ("24h0m0s", 86_400_000_000_000),
        ];
        for (s, n) in ok {
            assert_eq!(parse_go_duration(s).unwrap().as_nanos(), n, "{s}");
        }
        for bad in ["", "5", "s", "1x", "1.s5", "-1s", "1h-2m", "abc", "."] {
            assert!(parse_go_duration(bad).is_err(), "{bad} should fail");
        }
        assert!(matches!(
            parse_go_duration("99999999999999h"),
            Err(DurationError::Overflow(_))
        ));
    }

    #[test]
    fn go_durations_format() {
        let cases = [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_secs(60), "1m0s"),
            (Duration::from_secs(900), "15m0s"),
            (Duration::from_secs(3723), "1h2m3s"),
            (Duration::from_millis(500), "500ms"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_micros(1), "1µs"),
            (Duration::from_nanos(1_500), "1.5µs"),
            (Duration::from_secs(86400), "24h0m0s"),
        ];
        for (d, s) in cases {
            assert_eq!(format_go_duration(d), s);
            assert_eq!(parse_go_duration(s).unwrap(), d, "{s} round trip");
        }
    }
}
