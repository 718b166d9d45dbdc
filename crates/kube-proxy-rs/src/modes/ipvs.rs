//! IPVS mode: its `--ipvs-*` flags (`cfg.ipvs`) become an
//! [`kp_ipvs::IpvsConfig`]. Its leftovers: the `kube-ipvs0` link, upstream's
//! ipsets (`KUBE-*`, `KUBE-6-*` by name), and the IPVS virtual servers (all
//! of them, as `ipvsadm --clear`, only where the kernel has IPVS), removed
//! over netlink by kp-ipvs's own code (`kp_ipvs::leftovers`), which also
//! owns the names.

use anyhow::{Context, Result};
use kp_ipvs::leftovers as ipvs_leftovers;
use kp_model::{Dataplane, IpFamily, ProxierConfig};

use super::{Outcome, Scope, FAMILIES};
use crate::config::{ProxyConfig, ProxyMode};

/// The dummy interface upstream's ipvs mode binds Service IPs to.
pub const IPVS_LINK: &str = kp_ipvs::DUMMY_DEV;

/// Whether `name` is one of upstream ipvs mode's ipsets (kp-ipvs knows them).
pub fn is_ipvs_ipset(name: &str) -> bool {
    ipvs_leftovers::is_ipvs_set(name)
}

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

/// Everything of ipvs mode, except when starting in it: it keeps its link,
/// sets and virtual servers across restarts.
pub fn remove_leftovers(scope: Scope, _cfg: &ProxyConfig, out: &mut Outcome) {
    if scope.starting_in(ProxyMode::Ipvs) {
        return;
    }
    // The link first: while it holds the Service IPs they are local addresses.
    match ipvs_leftovers::remove_link() {
        Ok(true) => out.removed.push(format!("link {IPVS_LINK}")),
        Ok(false) => {}
        Err(e) => out.failed.push(format!("link {IPVS_LINK}: {e}")),
    }

    // Virtual servers: only a kernel with IPVS has any.
    match ipvs_leftovers::clear_virtual_servers() {
        Ok(Some(n)) => out.removed.push(format!("ipvs virtual servers ({n})")),
        Ok(None) => out
            .skipped
            .push("ipvs virtual servers: no IPVS in this kernel".into()),
        Err(e) => out.failed.push(format!("ipvs virtual servers: {e}")),
    }

    // ipsets last: a set is busy while an iptables rule uses it.
    let listed = ipvs_leftovers::Ipsets::open().and_then(|mut s| Ok((s.names()?, s)));
    let (names, mut sets) = match listed {
        Ok(l) => l,
        Err(e) => {
            out.skipped.push(format!("ipsets: {e}"));
            return;
        }
    };
    for name in names.into_iter().filter(|n| is_ipvs_ipset(n)) {
        match sets.destroy(&name) {
            Ok(()) => out.removed.push(format!("ipset {name}")),
            Err(e) => {
                let msg = e.to_string();
                // Starting in iptables mode, upstream's ipvs rules in the
                // shared KUBE-SERVICES chain still use the sets until our
                // first sync rewrites it; `--cleanup` removes them.
                if scope.starting_in(ProxyMode::Iptables) {
                    out.skipped.push(msg);
                } else {
                    out.failed.push(msg);
                }
            }
        }
    }
}
