//! IPVS mode: its `--ipvs-*` flags (`cfg.ipvs`) become an
//! [`kp_ipvs::IpvsConfig`].

use anyhow::{Context, Result};
use kp_model::{Dataplane, IpFamily, ProxierConfig};

use super::FAMILIES;
use crate::config::ProxyConfig;

/// Refuses to start (with the reason) when the kernel has no IPVS;
/// --dry-run and --cleanup work without it.
pub fn dataplane(
    cfg: &ProxyConfig,
    family: IpFamily,
    pc: ProxierConfig,
) -> Result<Box<dyn Dataplane>> {
    if !cfg.dry_run && !cfg.cleanup && family == IpFamily::V4 {
        kp_ipvs::check_kernel(&cfg.ipvs.scheduler).map_err(anyhow::Error::msg)?;
    }
    Ok(Box::new(kp_ipvs::IpvsProxier::new(config(cfg, pc)?)))
}

/// The mode's flags on top of the common proxier configuration.
pub fn config(cfg: &ProxyConfig, pc: ProxierConfig) -> Result<kp_ipvs::IpvsConfig> {
    let s = &cfg.ipvs;
    let mut ic = kp_ipvs::IpvsConfig::new(pc);
    ic.scheduler = s.scheduler.clone();
    ic.exclude_cidrs = s.exclude_cidrs.clone();
    ic.strict_arp = s.strict_arp;
    ic.tcp_timeout = s.tcp_timeout.as_secs() as u32;
    ic.tcp_fin_timeout = s.tcp_fin_timeout.as_secs() as u32;
    ic.udp_timeout = s.udp_timeout.as_secs() as u32;
    ic.validate().context("--ipvs-scheduler")?;
    Ok(ic)
}

/// `--init-only`: the kernel must have IPVS; then its sysctls and timeouts
/// (the same list its full syncs check).
pub fn init_host(cfg: &ProxyConfig) -> Result<Vec<String>> {
    kp_ipvs::check_kernel(&cfg.ipvs.scheduler).map_err(anyhow::Error::msg)?;
    let mut changed = Vec::new();
    for f in FAMILIES {
        let ic = config(cfg, cfg.proxier_config(f, &[], &[]))?;
        for (name, value) in kp_ipvs::init_host(&ic)? {
            tracing::info!(sysctl = name, value, "set");
            changed.push(format!("{name}={value}"));
        }
    }
    Ok(changed)
}
