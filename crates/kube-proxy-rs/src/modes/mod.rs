//! One module per proxy mode: how its dataplane is built from the
//! configuration (and its mode-specific flags and environment), and the host
//! setup `--init-only` does for it. Every mode's leftovers are swept by
//! `cleanup.rs` (userspace mode's own: [`userspace::remove_leftovers`];
//! socket load balancing's pins: [`socketlb::remove_leftovers`]).
//!
//! Adding a mode: a module here with `dataplane` (and `init_host` if the
//! host needs settings), an arm in [`make_dataplane`] and [`init_host`].

use std::net::IpAddr;

use anyhow::Result;
use ipnet::IpNet;
use kp_model::{ChangeTracker, Dataplane, IpFamily, TrackerConfig};

use crate::config::{ProxyConfig, ProxyMode};
use crate::metrics::Metrics;

pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod socketlb;
pub mod userspace;

/// The families every mode runs, one dataplane each.
pub const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

/// The configured mode's dataplane for `family`.
pub fn make_dataplane(
    cfg: &ProxyConfig,
    family: IpFamily,
    node_ips: &[IpAddr],
    pod_cidrs: &[IpNet],
    metrics: &Metrics,
) -> Result<Box<dyn Dataplane>> {
    let pc = cfg.proxier_config(family, node_ips, pod_cidrs);
    match cfg.mode {
        ProxyMode::Nftables if cfg.socket_lb.socket_lb => {
            // The kernel's maps only when rules are written (not for
            // --dry-run or --cleanup); main.rs attached the programs.
            let kernel = !cfg.dry_run && !cfg.cleanup;
            let nodeport_ips = socketlb::nodeport_ips(&pc);
            socketlb::wrap(
                nftables::dataplane(pc),
                &cfg.socket_lb,
                family,
                kernel,
                nodeport_ips,
            )
        }
        ProxyMode::Nftables => Ok(nftables::dataplane(pc)),
        ProxyMode::Iptables => Ok(iptables::dataplane(cfg, family, pc)),
        ProxyMode::Ipvs => ipvs::dataplane(cfg, family, pc),
        ProxyMode::Userspace => userspace::make_dataplane(&cfg.userspace, &pc, metrics),
    }
}

/// `--init-only`'s mode-specific host settings (after the conntrack
/// sysctls); returns the settings it changed.
pub fn init_host(cfg: &ProxyConfig, sysctl: &kp_netlink::Sysctl) -> Result<Vec<String>> {
    match cfg.mode {
        ProxyMode::Iptables => iptables::init_host(cfg, sysctl),
        ProxyMode::Ipvs => ipvs::init_host(cfg),
        // Nothing on the host beyond conntrack: their rules are all they need.
        ProxyMode::Nftables | ProxyMode::Userspace => Ok(Vec::new()),
    }
}

/// One change tracker per family, in [`FAMILIES`] order.
pub fn trackers(cfg: &ProxyConfig) -> Vec<ChangeTracker> {
    FAMILIES
        .iter()
        .map(|f| {
            ChangeTracker::new(TrackerConfig {
                family: *f,
                node_name: cfg.hostname.clone(),
                service_proxy_name: cfg.service_proxy_name.clone(),
            })
        })
        .collect()
}
