//! Upstream's defaulting and validation: the file schema (with the flags given
//! written into it) becomes [`ProxyConfig`]. The schema is updated in place
//! with every default, so that it can be written back out. The defaults are
//! the flags' ([`Cli::defaults`]), as upstream's flags and configuration
//! share theirs. A plain field's default and check are on its line in
//! `file.rs` (each section's `apply_defaults`, called here in a fixed
//! order, so the first error is always the same); what is here is the
//! logic: the mode, addresses in bindAddress's family, the detect-local and
//! NodePort rules, the sync periods and masquerading per mode (nftables
//! falling back to iptables), hostname and logging.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;

use super::field::cidr as parse_cidr;
use super::field::FileField;
use super::file::KubeProxyConfiguration;
use super::flags::{Cli, DetectLocalMode};
use super::settings::ProxyConfig;
use super::{invalid, ConfigError, API_VERSION, KIND};
use crate::config::duration::GoDuration;
use kp_model::ProxyMode;

/// A duration field: unset or zero takes `default` (upstream's defaulting).
fn duration_field(value: Option<GoDuration>, default: Duration) -> Duration {
    match value {
        Some(GoDuration(d)) if !d.is_zero() => d,
        _ => default,
    }
}

/// A duration field where zero is meaningful (kept as zero).
fn duration_field_keep_zero(value: Option<GoDuration>) -> Duration {
    value.map_or(Duration::ZERO, |g| g.0)
}

fn masquerade_bit(field: &str, v: i32) -> Result<u8, ConfigError> {
    if (0..=31).contains(&v) {
        Ok(v as u8)
    } else {
        Err(invalid(field, format!("{v} is not in 0..=31")))
    }
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

/// Applies the defaults `d` (every flag at its default) to `raw` (in place,
/// so it can be written back out) and builds the validated settings, one
/// section of the file at a time, with `cli`'s flags that have no file field.
pub(super) fn resolve(
    mut raw: KubeProxyConfiguration,
    cli: &Cli,
    d: &Cli,
) -> Result<ProxyConfig, ConfigError> {
    raw.api_version = Some(API_VERSION.to_string());
    raw.kind = Some(KIND.to_string());

    let mode = if raw.mode.is_empty() {
        d.proxy_mode
    } else {
        ProxyMode::from_str(&raw.mode).map_err(|e| invalid("mode", e))?
    };
    raw.mode = mode.as_str().to_string();
    let (bind_address, healthz, metrics) = listen_addresses(&mut raw, d)?;
    let cluster_cidrs = cluster_cidrs(&raw)?;
    let detect_local_mode = detect_local(&mut raw, d)?;
    let (nodeport_addresses, nodeport_primary) = nodeport_addresses(&raw, mode)?;
    let sync = sync_and_masquerade(&mut raw, mode, d)?;
    // The tables' defaults and checks (file.rs), section by section.
    raw.ipvs.apply_defaults(d)?;
    let ipvs = raw.ipvs.settings()?;
    raw.conntrack.apply_defaults(d)?;
    let conntrack = raw.conntrack.settings()?;
    raw.apply_defaults(d)?;
    raw.client_connection.apply_defaults(d)?;
    let client = raw.client_connection.settings()?;
    let kubeconfig = Some(&client.kubeconfig)
        .filter(|k| !k.is_empty())
        .map(PathBuf::from);
    let (log_json, verbosity) = logging(&raw)?;
    let hostname = if raw.hostname_override.trim().is_empty() {
        machine_hostname()?
    } else {
        raw.hostname_override.trim().to_lowercase()
    };
    let iptables_backend = kp_iptables::Variant::parse_choice(&cli.iptables_backend)
        .map_err(|e| invalid("--iptables-backend", e))?;
    let mut socket_lb = cli.socket_lb.clone();
    socket_lb.bpf_nodeport_devices.retain(|d| !d.is_empty());

    Ok(ProxyConfig {
        mode,
        hostname,
        bind_address,
        bind_address_hard_fail: raw.bind_address_hard_fail,
        healthz_bind_address: Some(healthz),
        metrics_bind_address: Some(metrics),
        cluster_cidrs,
        detect_local_mode,
        detect_local: raw.detect_local.settings()?,
        nodeport_addresses,
        nodeport_primary,
        node_primary_ips: Vec::new(),
        masquerade_all: sync.masquerade_all,
        masquerade_bit: sync.masquerade_bit,
        sync_period: sync.sync_period,
        min_sync_period: sync.min_sync_period,
        localhost_nodeports: sync.localhost_nodeports,
        config_sync_period: raw.config_sync_period.get(false).unwrap_or_default(),
        kubeconfig,
        master: cli.master.clone().filter(|m| !m.is_empty()),
        client,
        manifests: cli.manifests.clone(),
        cleanup: cli.cleanup,
        dry_run: cli.dry_run,
        init_only: cli.init_only,
        verbosity,
        log_json,
        service_proxy_name: cli.service_proxy_name.clone().filter(|s| !s.is_empty()),
        iptables_backend,
        iptables_nft_restore: cli.iptables_nft_restore,
        userspace: cli.userspace.clone(),
        socket_lb,
        ipvs,
        conntrack,
        oom_score_adj: raw.oom_score_adj.get(false).unwrap_or_default(),
        feature_gates: raw.feature_gates.clone(),
        config_file: cli.config.clone(),
        config_file_digest: None,
        write_config_to: cli.write_config_to.clone(),
        configuration: raw,
        load_warnings: Vec::new(),
    })
}

/// bindAddress, and the health and metrics listen addresses (their
/// defaults, the flags', in bindAddress's family).
fn listen_addresses(
    raw: &mut KubeProxyConfiguration,
    d: &Cli,
) -> Result<(IpAddr, SocketAddr, SocketAddr), ConfigError> {
    let bind_address = if raw.bind_address.trim().is_empty() {
        d.bind_address
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
    let healthz = listen_address(
        "healthzBindAddress",
        &mut raw.healthz_bind_address,
        &d.healthz_bind_address,
        v6,
    )?;
    let metrics = listen_address(
        "metricsBindAddress",
        &mut raw.metrics_bind_address,
        &d.metrics_bind_address,
        v6,
    )?;
    Ok((bind_address, healthz, metrics))
}

/// One server's address: unset takes the flag's default, moved to IPv6
/// (`::` or `::1`) when bindAddress is; a bare IP takes its port.
fn listen_address(
    field: &str,
    value: &mut String,
    default: &str,
    v6: bool,
) -> Result<SocketAddr, ConfigError> {
    let default = SocketAddr::from_str(default)
        .map_err(|_| invalid(field, format!("the default {default:?} is not IP:port")))?;
    if value.trim().is_empty() {
        let ip: IpAddr = match default.ip() {
            IpAddr::V4(ip) if v6 && ip.is_loopback() => Ipv6Addr::LOCALHOST.into(),
            IpAddr::V4(ip) if v6 && ip.is_unspecified() => Ipv6Addr::UNSPECIFIED.into(),
            ip => ip,
        };
        *value = SocketAddr::new(ip, default.port()).to_string();
    }
    parse_bind(field, value, default.port())
}

/// clusterCIDR: comma-separated, at most one per family.
fn cluster_cidrs(raw: &KubeProxyConfiguration) -> Result<Vec<IpNet>, ConfigError> {
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
    Ok(cluster_cidrs)
}

/// detectLocalMode, and the field its mode needs.
fn detect_local(raw: &mut KubeProxyConfiguration, d: &Cli) -> Result<DetectLocalMode, ConfigError> {
    let detect_local_mode = if raw.detect_local_mode.is_empty() {
        d.detect_local_mode
    } else {
        DetectLocalMode::from_str(&raw.detect_local_mode)
            .map_err(|e| invalid("detectLocalMode", e))?
    };
    raw.detect_local_mode = detect_local_mode.as_str().to_string();
    raw.detect_local.apply_defaults(d)?;
    match detect_local_mode {
        DetectLocalMode::BridgeInterface if raw.detect_local.bridge_interface.is_empty() => {
            Err(invalid(
                "detectLocal.bridgeInterface",
                "required when detectLocalMode is BridgeInterface",
            ))
        }
        DetectLocalMode::InterfaceNamePrefix
            if raw.detect_local.interface_name_prefix.is_empty() =>
        {
            Err(invalid(
                "detectLocal.interfaceNamePrefix",
                "required when detectLocalMode is InterfaceNamePrefix",
            ))
        }
        _ => Ok(detect_local_mode),
    }
}

/// nodePortAddresses as CIDRs, and whether `primary` was asked for: unset
/// means "primary" in nftables mode and "all" elsewhere, as upstream.
fn nodeport_addresses(
    raw: &KubeProxyConfiguration,
    mode: ProxyMode,
) -> Result<(Vec<IpNet>, bool), ConfigError> {
    let mut nodeport_addresses = Vec::new();
    let mut nodeport_primary = false;
    match &raw.node_port_addresses {
        // Upstream tests the length: an empty list is unset too.
        None => nodeport_primary = mode == ProxyMode::Nftables,
        Some(list) if list.iter().all(|s| s.trim().is_empty()) => {
            nodeport_primary = mode == ProxyMode::Nftables
        }
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
    Ok((nodeport_addresses, nodeport_primary))
}

/// What the running mode's section (and the mode-independent fields)
/// decide for masquerading and pacing.
struct SyncSettings {
    sync_period: Duration,
    min_sync_period: Duration,
    masquerade_all: bool,
    masquerade_bit: u8,
    localhost_nodeports: bool,
}

/// Masquerading and sync periods: the running mode's section wins; an unset
/// nftables field falls back to the iptables one (so an upstream config
/// written for the iptables default keeps its meaning here).
fn sync_and_masquerade(
    raw: &mut KubeProxyConfiguration,
    mode: ProxyMode,
    d: &Cli,
) -> Result<SyncSettings, ConfigError> {
    let ipt = raw.iptables.clone();
    let nft = raw.nftables.clone();
    let ipt_bit = masquerade_bit(
        "iptables.masqueradeBit",
        ipt.masquerade_bit.unwrap_or(d.iptables_masquerade_bit),
    )?;
    let nft_bit = match nft.masquerade_bit {
        Some(b) => masquerade_bit("nftables.masqueradeBit", b)?,
        None => ipt_bit,
    };
    let ipt_sync = duration_field(ipt.sync_period, d.iptables_sync_period);
    let ipt_min = duration_field(ipt.min_sync_period, d.iptables_min_sync_period);
    let nft_sync = duration_field(nft.sync_period, ipt_sync);
    let nft_min = duration_field(nft.min_sync_period, ipt_min);
    let ipvs_sync = duration_field(raw.ipvs.sync_period, d.ipvs_sync_period);
    // Unset is zero here, though --ipvs-min-sync-period shows 1s: what an
    // unset field has always meant (docs/architecture.md "The periods").
    let ipvs_min = duration_field_keep_zero(raw.ipvs.min_sync_period);
    raw.iptables.apply_defaults(d)?;
    let localhost_nodeports = raw.iptables.localhost_node_ports.unwrap_or_default();
    raw.iptables.masquerade_bit = Some(i32::from(ipt_bit));
    raw.iptables.sync_period = Some(GoDuration(ipt_sync));
    raw.iptables.min_sync_period = Some(GoDuration(ipt_min));
    raw.nftables.masquerade_bit = Some(i32::from(nft_bit));
    raw.nftables.sync_period = Some(GoDuration(nft_sync));
    raw.nftables.min_sync_period = Some(GoDuration(nft_min));
    raw.nftables.masquerade_all = nft.masquerade_all || ipt.masquerade_all;
    raw.ipvs.sync_period = Some(GoDuration(ipvs_sync));
    raw.ipvs.min_sync_period = Some(GoDuration(ipvs_min));

    let (mut sync_period, mut min_sync_period, masquerade_all, masquerade_bit) = match mode {
        ProxyMode::Nftables => (nft_sync, nft_min, raw.nftables.masquerade_all, nft_bit),
        ProxyMode::Ipvs => (ipvs_sync, ipvs_min, ipt.masquerade_all, ipt_bit),
        ProxyMode::Iptables | ProxyMode::Userspace => {
            (ipt_sync, ipt_min, ipt.masquerade_all, ipt_bit)
        }
    };
    if raw.sync_period.is_some() {
        sync_period = duration_field(raw.sync_period, sync_period);
        raw.sync_period = Some(GoDuration(sync_period));
    }
    if raw.min_sync_period.is_some() {
        min_sync_period = duration_field_keep_zero(raw.min_sync_period);
        raw.min_sync_period = Some(GoDuration(min_sync_period));
    }
    if min_sync_period > sync_period {
        return Err(invalid(
            "minSyncPeriod",
            format!(
                "{} is longer than syncPeriod {}",
                GoDuration(min_sync_period),
                GoDuration(sync_period)
            ),
        ));
    }
    Ok(SyncSettings {
        sync_period,
        min_sync_period,
        masquerade_all,
        masquerade_bit,
        localhost_nodeports,
    })
}

/// logging: JSON or text, and the verbosity.
fn logging(raw: &KubeProxyConfiguration) -> Result<(bool, u8), ConfigError> {
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
    Ok((log_json, verbosity))
}
