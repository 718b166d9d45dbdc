//! The KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1), field
//! for field, as serde types. Durations are typed ([`GoDuration`]), so a bad
//! one is reported with its field path when the file is read.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};

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
    pub sync_period: Option<GoDuration>,
    #[serde(default)]
    pub min_sync_period: Option<GoDuration>,
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

#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IpvsSection {
    #[serde(default)]
    pub sync_period: Option<GoDuration>,
    #[serde(default)]
    pub min_sync_period: Option<GoDuration>,
    #[serde(default, deserialize_with = "nullable")]
    pub scheduler: String,
    #[serde(default, rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(default, rename = "strictARP", deserialize_with = "nullable")]
    pub strict_arp: bool,
    #[serde(default)]
    pub tcp_timeout: Option<GoDuration>,
    #[serde(default)]
    pub tcp_fin_timeout: Option<GoDuration>,
    #[serde(default)]
    pub udp_timeout: Option<GoDuration>,
}

#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConntrackSection {
    #[serde(default)]
    pub max_per_core: Option<i32>,
    #[serde(default)]
    pub min: Option<i32>,
    #[serde(default)]
    pub tcp_established_timeout: Option<GoDuration>,
    #[serde(default)]
    pub tcp_close_wait_timeout: Option<GoDuration>,
    #[serde(default, deserialize_with = "nullable")]
    pub tcp_be_liberal: bool,
    #[serde(default)]
    pub udp_timeout: Option<GoDuration>,
    #[serde(default)]
    pub udp_stream_timeout: Option<GoDuration>,
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
    pub config_sync_period: Option<GoDuration>,
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
    pub sync_period: Option<GoDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<GoDuration>,
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
