//! The KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1), field
//! for field, as serde types. Durations are typed ([`GoDuration`]), so a bad
//! one is reported with its field path when the file is read. A field's
//! flag, default and check are on its line ([`super::field`]).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};

use ipnet::IpNet;

use super::field::{cidrs, non_negative, oom_score_adj, section};
use super::flags::Cli;
use super::{invalid, ConfigError, API_VERSION, KIND};
use crate::config::duration::GoDuration;

/// `null` in the file means "unset", as in Go.
fn nullable<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

section! {
    #[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ClientConnection at "clientConnection"
        => /// clientConnection as the API client reads it.
        pub struct ClientSettings {
        /// Read by the binding of --kubeconfig (a path), `flags.rs`.
        #[serde(default, deserialize_with = "nullable")]
        kubeconfig: String;
        /// No flag; empty: the content type, then anything.
        #[serde(default, deserialize_with = "nullable")]
        accept_content_types: String;
        #[serde(default, deserialize_with = "nullable")]
        content_type: String = zero kube_api_content_type;
        #[serde(default, deserialize_with = "nullable")]
        qps: f32 = zero kube_api_qps, check non_negative;
        #[serde(default, deserialize_with = "nullable")]
        burst: i32 = zero kube_api_burst, check non_negative;
    }
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

section! {
    /// masqueradeBit, masqueradeAll and the sync periods are bound in
    /// `flags.rs` (into the nftables section too) and defaulted in
    /// `resolve.rs` (the nftables section falls back to this one).
    #[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct IptablesSection at "iptables" {
        #[serde(default)]
        masquerade_bit: Option<i32>;
        #[serde(default, deserialize_with = "nullable")]
        masquerade_all: bool;
        /// Upstream allows localhost NodePorts only in iptables mode, IPv4.
        #[serde(default)]
        localhost_node_ports: Option<bool> = unset iptables_localhost_nodeports;
        /// Accepted and ignored.
        #[serde(default)]
        snat_node_internal_ip as "snatNodeInternalIP": Option<bool>;
        #[serde(default)]
        sync_period: Option<GoDuration>;
        #[serde(default)]
        min_sync_period: Option<GoDuration>;
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NftablesSection {
    #[serde(default)]
    pub masquerade_bit: Option<i32>,
    #[serde(default, deserialize_with = "nullable")]
    pub masquerade_all: bool,
    #[serde(default)]
    pub sync_period: Option<GoDuration>,
    #[serde(default)]
    pub min_sync_period: Option<GoDuration>,
}

section! {
    #[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct IpvsSection at "ipvs"
        => /// The ipvs section as the ipvs mode reads it.
        pub struct IpvsSettings {
        /// Bound and defaulted with the other sync periods (`flags.rs`,
        /// `resolve.rs`).
        #[serde(default)]
        sync_period: Option<GoDuration>;
        /// Unset is zero here, though --ipvs-min-sync-period shows 1s
        /// (`resolve.rs`).
        #[serde(default)]
        min_sync_period: Option<GoDuration>;
        #[serde(default, deserialize_with = "nullable")]
        scheduler: String = flag ipvs_scheduler;
        /// CIDRs the ipvs proxier should not touch when cleaning up.
        #[serde(default)]
        exclude_cidrs as "excludeCIDRs": Option<Vec<String>> = flag ipvs_exclude_cidrs,
            into Vec<IpNet> = cidrs;
        #[serde(default, deserialize_with = "nullable")]
        strict_arp as "strictARP": bool = flag ipvs_strict_arp;
        /// Zero leaves the system's value (as do the other timeouts).
        #[serde(default)]
        tcp_timeout: Option<GoDuration> = unset ipvs_tcp_timeout;
        #[serde(default)]
        tcp_fin_timeout: Option<GoDuration> = unset ipvs_tcpfin_timeout;
        #[serde(default)]
        udp_timeout: Option<GoDuration> = unset ipvs_udp_timeout;
    }
}

section! {
    #[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct ConntrackSection at "conntrack"
        => /// The conntrack section, for `--init-only`'s sysctls.
        pub struct ConntrackSettings {
        /// 0 leaves nf_conntrack_max as is.
        #[serde(default)]
        max_per_core: Option<i32> = unset conntrack_max_per_core, check non_negative;
        #[serde(default)]
        min: Option<i32> = unset conntrack_min, check non_negative;
        /// Zero leaves the sysctl as is (as do the other timeouts).
        #[serde(default)]
        tcp_established_timeout: Option<GoDuration> = unset conntrack_tcp_timeout_established;
        #[serde(default)]
        tcp_close_wait_timeout: Option<GoDuration> = unset conntrack_tcp_timeout_close_wait;
        #[serde(default, deserialize_with = "nullable")]
        tcp_be_liberal: bool = flag conntrack_tcp_be_liberal;
        #[serde(default)]
        udp_timeout: Option<GoDuration> = unset conntrack_udp_timeout;
        #[serde(default)]
        udp_stream_timeout: Option<GoDuration> = unset conntrack_udp_timeout_stream;
    }
}

section! {
    /// The field detectLocalMode needs (checked in `resolve.rs`).
    #[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct DetectLocalSection at "detectLocal"
        => /// detectLocal as the local-traffic detector reads it.
        pub struct DetectLocalSettings {
        #[serde(default, deserialize_with = "nullable")]
        bridge_interface: String = flag pod_bridge_interface;
        #[serde(default, deserialize_with = "nullable")]
        interface_name_prefix: String = flag pod_interface_name_prefix;
    }
}

section! {
    /// The v1alpha1 KubeProxyConfiguration file, field for field. Unknown
    /// fields are errors. Fields without `=` are bound in `flags.rs` and
    /// resolved in `resolve.rs`.
    #[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct KubeProxyConfiguration at "" {
        #[serde(default)]
        api_version: Option<String>;
        #[serde(default)]
        kind: Option<String>;
        #[serde(
            default,
            deserialize_with = "nullable",
            skip_serializing_if = "BTreeMap::is_empty"
        )]
        feature_gates: BTreeMap<String, bool>;
        #[serde(default, deserialize_with = "nullable")]
        client_connection: ClientConnection;
        #[serde(default, deserialize_with = "nullable")]
        logging: Logging;
        #[serde(default, deserialize_with = "nullable")]
        hostname_override: String;
        #[serde(default, deserialize_with = "nullable")]
        bind_address: String;
        #[serde(default, deserialize_with = "nullable")]
        healthz_bind_address: String;
        #[serde(default, deserialize_with = "nullable")]
        metrics_bind_address: String;
        #[serde(default, deserialize_with = "nullable")]
        bind_address_hard_fail: bool = flag bind_address_hard_fail;
        /// Accepted for compatibility.
        #[serde(default, deserialize_with = "nullable")]
        enable_profiling: bool = flag profiling;
        /// Accepted for compatibility.
        #[serde(default, deserialize_with = "nullable")]
        show_hidden_metrics_for_version: String = flag show_hidden_metrics_for_version;
        #[serde(default, deserialize_with = "nullable")]
        mode: String;
        #[serde(default, deserialize_with = "nullable")]
        iptables: IptablesSection;
        #[serde(default, deserialize_with = "nullable")]
        ipvs: IpvsSection;
        #[serde(default, deserialize_with = "nullable")]
        nftables: NftablesSection;
        /// Windows settings: accepted and ignored.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        winkernel: Option<serde_json::Value>;
        #[serde(default, deserialize_with = "nullable")]
        detect_local_mode: String;
        #[serde(default, deserialize_with = "nullable")]
        detect_local: DetectLocalSection;
        /// The CIDR range(s) of pods, comma-separated (one per family).
        #[serde(default, deserialize_with = "nullable")]
        cluster_cidr as "clusterCIDR": String = flag cluster_cidr;
        #[serde(default)]
        node_port_addresses: Option<Vec<String>> = flag nodeport_addresses;
        #[serde(default)]
        oom_score_adj: Option<i32> = unset oom_score_adj, check oom_score_adj;
        #[serde(default, deserialize_with = "nullable")]
        conntrack: ConntrackSection;
        #[serde(default)]
        config_sync_period: Option<GoDuration> = zero config_sync_period;
        #[serde(default, deserialize_with = "nullable")]
        port_range: String;
        #[serde(
            default,
            deserialize_with = "nullable",
            skip_serializing_if = "is_false"
        )]
        windows_run_as_service: bool;
        /// Newer upstream's mode-independent periods; override the mode's
        /// section.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sync_period: Option<GoDuration>;
        #[serde(default, skip_serializing_if = "Option::is_none")]
        min_sync_period: Option<GoDuration>;
    }
}

impl KubeProxyConfiguration {
    /// Every flag bound by a section's table, by clap id.
    pub(super) fn table_flags() -> impl Iterator<Item = &'static str> {
        [
            Self::FLAGS,
            ClientConnection::FLAGS,
            IptablesSection::FLAGS,
            IpvsSection::FLAGS,
            ConntrackSection::FLAGS,
            DetectLocalSection::FLAGS,
        ]
        .into_iter()
        .flatten()
        .copied()
    }

    /// Writes `cli`'s flag `id` into the field a section's table binds it
    /// to; false when none does.
    pub(super) fn bind_table_flag(&mut self, cli: &Cli, id: &str) -> bool {
        self.bind_flag(cli, id)
            || self.client_connection.bind_flag(cli, id)
            || self.iptables.bind_flag(cli, id)
            || self.ipvs.bind_flag(cli, id)
            || self.conntrack.bind_flag(cli, id)
            || self.detect_local.bind_flag(cli, id)
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl KubeProxyConfiguration {
    /// Parses a KubeProxyConfiguration YAML (or JSON) document. Errors name the
    /// field path.
    pub fn from_yaml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let (cfg, unknown) = Self::from_yaml_lenient(text, path)?;
        match unknown.first() {
            Some(field) => Err(ConfigError::Parse {
                path: path.to_path_buf(),
                message: format!("{field}: unknown field"),
            }),
            None => Ok(cfg),
        }
    }

    /// As upstream reads `--config`: strictly first, and when only unknown
    /// fields stand in the way (a file written for a newer kube-proxy, a
    /// typo) once more without them. Returns the fields left out by path,
    /// for the caller to warn about; any other error is an error.
    pub fn from_yaml_lenient(text: &str, path: &Path) -> Result<(Self, Vec<String>), ConfigError> {
        let parse_err = |message: String| ConfigError::Parse {
            path: path.to_path_buf(),
            message,
        };
        // Two steps so that type and unknown-field errors carry the field path.
        let mut value: serde_json::Value =
            serde_saphyr::from_str(text).map_err(|e| parse_err(e.to_string()))?;
        if value.is_null() {
            return Err(parse_err("the file is empty".to_string()));
        }
        let mut unknown = Vec::new();
        let cfg: KubeProxyConfiguration = loop {
            match serde_path_to_error::deserialize(value.clone()) {
                Ok(cfg) => break cfg,
                Err(e) => {
                    let p = e.path().to_string();
                    let msg = e.inner().to_string();
                    if let Some(field) = unknown_field(&msg) {
                        if let Some(full) = remove_field(&mut value, &p, field) {
                            unknown.push(full);
                            continue;
                        }
                    }
                    return Err(if p == "." || p.is_empty() {
                        parse_err(msg)
                    } else {
                        parse_err(format!("{p}: {msg}"))
                    });
                }
            }
        };
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
        Ok((cfg, unknown))
    }
}

/// The field serde's derive refused: "unknown field `foo`, expected ...".
fn unknown_field(msg: &str) -> Option<&str> {
    let rest = msg.strip_prefix("unknown field `")?;
    rest.split_once('`').map(|(f, _)| f)
}

/// Removes `field` from the object at `path` (serde_path_to_error's form,
/// "." for the root; it may or may not end with the field itself) and
/// returns the field's full path; None when it is not there, so a message
/// that only looks like an unknown field can never loop.
fn remove_field(value: &mut serde_json::Value, path: &str, field: &str) -> Option<String> {
    let mut parts: Vec<&str> = path
        .split('.')
        .filter(|p| !p.is_empty() && *p != "?")
        .collect();
    if parts.last() == Some(&field) {
        parts.pop();
    }
    let mut at = &mut *value;
    for p in &parts {
        at = at.get_mut(*p)?;
    }
    at.as_object_mut()?.remove(field)?;
    parts.push(field);
    Some(parts.join("."))
}
