//! Flags given on the command line override the config file, as upstream's
//! do: each one is written into the file's schema before defaults apply, so
//! `--write-config-to` and /configz show the effective values.

use std::collections::BTreeMap;

use clap::parser::ValueSource;
use clap::ArgMatches;

use super::file::KubeProxyConfiguration;
use super::flags::{Cli, ProxyMode};
use super::{invalid, ConfigError};
use crate::duration::GoDuration;

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

pub(super) fn overlay_flags(
    raw: &mut KubeProxyConfiguration,
    cli: &Cli,
    m: &ArgMatches,
) -> Result<(), ConfigError> {
    let dur = |d| Some(GoDuration(d));
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
