//! Flags given on the command line are written into the file's schema before
//! defaults apply, so `--write-config-to` and /configz show the effective
//! values. With `--config`, upstream uses the file and ignores its flags but
//! the logging ones and --hostname-override: so do we, and say which.

use std::collections::BTreeMap;

use clap::parser::ValueSource;
use clap::ArgMatches;

use super::file::KubeProxyConfiguration;
use super::flags::Cli;
use super::{invalid, ConfigError};
use crate::config::duration::GoDuration;
use kp_model::ProxyMode;

/// True when the flag was set by the user (not clap's default).
pub(super) fn given(m: &ArgMatches, id: &str) -> bool {
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

/// Writes one flag's value into the file's schema.
type Overlay = fn(&mut KubeProxyConfiguration, &Cli);

fn dur(d: std::time::Duration) -> Option<GoDuration> {
    Some(GoDuration(d))
}

fn list(items: &[String]) -> Vec<String> {
    items
        .iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Every flag that has a field in the file, by clap id, with where it goes.
/// Upstream's masquerade and sync flags apply to whichever mode runs, so
/// they set the iptables and the nftables section (and a sync period flag
/// clears the mode-independent one, which would otherwise win).
pub(super) const OVERLAYS: &[(&str, Overlay)] = &[
    ("kubeconfig", |r, c| {
        r.client_connection.kubeconfig = c
            .kubeconfig
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default()
    }),
    ("kube_api_qps", |r, c| {
        r.client_connection.qps = c.kube_api_qps
    }),
    ("kube_api_burst", |r, c| {
        r.client_connection.burst = c.kube_api_burst
    }),
    ("kube_api_content_type", |r, c| {
        r.client_connection.content_type = c.kube_api_content_type.clone()
    }),
    ("proxy_mode", |r, c| {
        r.mode = c.proxy_mode.as_str().to_string()
    }),
    ("hostname_override", |r, c| {
        r.hostname_override = c.hostname_override.clone()
    }),
    ("bind_address", |r, c| {
        r.bind_address = c.bind_address.to_string()
    }),
    ("bind_address_hard_fail", |r, c| {
        r.bind_address_hard_fail = c.bind_address_hard_fail
    }),
    ("healthz_bind_address", |r, c| {
        r.healthz_bind_address = c.healthz_bind_address.clone()
    }),
    ("metrics_bind_address", |r, c| {
        r.metrics_bind_address = c.metrics_bind_address.clone()
    }),
    ("cluster_cidr", |r, c| {
        r.cluster_cidr = c.cluster_cidr.clone()
    }),
    ("detect_local_mode", |r, c| {
        r.detect_local_mode = c.detect_local_mode.as_str().to_string()
    }),
    ("pod_bridge_interface", |r, c| {
        r.detect_local.bridge_interface = c.pod_bridge_interface.clone()
    }),
    ("pod_interface_name_prefix", |r, c| {
        r.detect_local.interface_name_prefix = c.pod_interface_name_prefix.clone()
    }),
    ("nodeport_addresses", |r, c| {
        r.node_port_addresses = Some(list(&c.nodeport_addresses))
    }),
    ("masquerade_all", |r, c| {
        r.iptables.masquerade_all = c.masquerade_all;
        r.nftables.masquerade_all = c.masquerade_all;
    }),
    ("iptables_masquerade_bit", |r, c| {
        r.iptables.masquerade_bit = Some(c.iptables_masquerade_bit);
        r.nftables.masquerade_bit = Some(c.iptables_masquerade_bit);
    }),
    ("iptables_sync_period", |r, c| {
        r.iptables.sync_period = dur(c.iptables_sync_period);
        r.nftables.sync_period = dur(c.iptables_sync_period);
        r.sync_period = None;
    }),
    ("iptables_min_sync_period", |r, c| {
        r.iptables.min_sync_period = dur(c.iptables_min_sync_period);
        r.nftables.min_sync_period = dur(c.iptables_min_sync_period);
        r.min_sync_period = None;
    }),
    ("iptables_localhost_nodeports", |r, c| {
        r.iptables.localhost_node_ports = Some(c.iptables_localhost_nodeports)
    }),
    ("config_sync_period", |r, c| {
        r.config_sync_period = dur(c.config_sync_period)
    }),
    ("ipvs_scheduler", |r, c| {
        r.ipvs.scheduler = c.ipvs_scheduler.clone()
    }),
    ("ipvs_sync_period", |r, c| {
        r.ipvs.sync_period = dur(c.ipvs_sync_period);
        if c.proxy_mode == ProxyMode::Ipvs {
            r.sync_period = None;
        }
    }),
    ("ipvs_min_sync_period", |r, c| {
        r.ipvs.min_sync_period = dur(c.ipvs_min_sync_period);
        if c.proxy_mode == ProxyMode::Ipvs {
            r.min_sync_period = None;
        }
    }),
    ("ipvs_exclude_cidrs", |r, c| {
        r.ipvs.exclude_cidrs = Some(list(&c.ipvs_exclude_cidrs))
    }),
    ("ipvs_strict_arp", |r, c| {
        r.ipvs.strict_arp = c.ipvs_strict_arp
    }),
    ("ipvs_tcp_timeout", |r, c| {
        r.ipvs.tcp_timeout = dur(c.ipvs_tcp_timeout)
    }),
    ("ipvs_tcpfin_timeout", |r, c| {
        r.ipvs.tcp_fin_timeout = dur(c.ipvs_tcpfin_timeout)
    }),
    ("ipvs_udp_timeout", |r, c| {
        r.ipvs.udp_timeout = dur(c.ipvs_udp_timeout)
    }),
    ("conntrack_max_per_core", |r, c| {
        r.conntrack.max_per_core = Some(c.conntrack_max_per_core)
    }),
    ("conntrack_min", |r, c| {
        r.conntrack.min = Some(c.conntrack_min)
    }),
    ("conntrack_tcp_timeout_established", |r, c| {
        r.conntrack.tcp_established_timeout = dur(c.conntrack_tcp_timeout_established)
    }),
    ("conntrack_tcp_timeout_close_wait", |r, c| {
        r.conntrack.tcp_close_wait_timeout = dur(c.conntrack_tcp_timeout_close_wait)
    }),
    ("conntrack_tcp_be_liberal", |r, c| {
        r.conntrack.tcp_be_liberal = c.conntrack_tcp_be_liberal
    }),
    ("conntrack_udp_timeout", |r, c| {
        r.conntrack.udp_timeout = dur(c.conntrack_udp_timeout)
    }),
    ("conntrack_udp_timeout_stream", |r, c| {
        r.conntrack.udp_stream_timeout = dur(c.conntrack_udp_timeout_stream)
    }),
    ("verbosity", |r, c| {
        r.logging.verbosity = Some(u32::from(c.verbosity))
    }),
    ("log_format", |r, c| {
        r.logging.format = Some(c.log_format.clone())
    }),
    ("oom_score_adj", |r, c| {
        r.oom_score_adj = Some(c.oom_score_adj)
    }),
    ("profiling", |r, c| r.enable_profiling = c.profiling),
    ("show_hidden_metrics_for_version", |r, c| {
        r.show_hidden_metrics_for_version = c.show_hidden_metrics_for_version.clone()
    }),
];

/// The flags upstream still honours when `--config` is given: its logging
/// flags (copied over the file's `logging`) and --hostname-override.
pub(super) const OVER_THE_FILE: &[&str] = &["verbosity", "log_format", "hostname_override"];

/// Writes the flags given on the command line into `raw`. With a config file
/// (`from_file`) only [`OVER_THE_FILE`] apply, as upstream replaces its
/// flag-built configuration with the file's; the others given are returned
/// as `--flag` names, for a warning.
pub(super) fn overlay_flags(
    raw: &mut KubeProxyConfiguration,
    cli: &Cli,
    m: &ArgMatches,
    from_file: bool,
) -> Result<Vec<String>, ConfigError> {
    let mut ignored = Vec::new();
    let flag = |id: &str| format!("--{}", id.replace('_', "-"));
    for (id, overlay) in OVERLAYS {
        if given(m, id) {
            if from_file && !OVER_THE_FILE.contains(id) {
                ignored.push(flag(id));
            } else {
                overlay(raw, cli);
            }
        }
    }
    // Merged into the file's gates, and may be refused.
    if given(m, "feature_gates") {
        if from_file {
            ignored.push(flag("feature_gates"));
        } else {
            for (k, v) in parse_feature_gates(&cli.feature_gates)? {
                raw.feature_gates.insert(k, v);
            }
        }
    }
    for id in ["healthz_port", "metrics_port"] {
        if from_file && given(m, id) {
            ignored.push(flag(id));
        }
    }
    Ok(ignored)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// A misspelt id would never count as given: the flag would be ignored.
    #[test]
    fn every_overlay_names_a_flag() {
        let cmd = Cli::command();
        let ids: Vec<&str> = cmd.get_arguments().map(|a| a.get_id().as_str()).collect();
        for (id, _) in OVERLAYS {
            assert!(ids.contains(id), "no flag with id {id}");
        }
        for id in OVER_THE_FILE {
            assert!(OVERLAYS.iter().any(|(o, _)| o == id), "{id} has no overlay");
        }
        let mut seen = std::collections::BTreeSet::new();
        assert!(
            OVERLAYS.iter().all(|(id, _)| seen.insert(*id)),
            "an id twice"
        );
    }
}
