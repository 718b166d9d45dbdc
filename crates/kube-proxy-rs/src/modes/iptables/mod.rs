//! iptables mode, in the backend `--iptables-backend` chooses (or the one the
//! host uses): iptables-nft written over nf_tables netlink (or with
//! `iptables-nft-restore` under `--iptables-nft-restore`), iptables-legacy
//! with `iptables-legacy-restore`. Its leftovers, in each backend: our
//! chains, which are upstream iptables mode's, plus upstream ipvs mode's own
//! chains and old `KUBE-XLB-` chains, with every rule that jumps into them.

pub mod metrics;

use anyhow::Result;
use kp_iptables::leftovers::{is_ipvs_mode_chain, is_kube_proxy_chain, sweep};
use kp_iptables::{is_our_chain, IptablesCli, Variant};
use kp_model::{Dataplane, IpFamily, ProxierConfig};

use super::{Outcome, Scope, FAMILIES};
use crate::config::{ProxyConfig, ProxyMode};

pub fn dataplane(cfg: &ProxyConfig, family: IpFamily, pc: ProxierConfig) -> Box<dyn Dataplane> {
    Box::new(
        kp_iptables::IptablesProxier::new(
            pc,
            kp_iptables::select(family, cfg.iptables_backend, cfg.iptables_nft_restore),
        )
        .probing_host(),
    )
}

/// `--init-only`: route_localnet (for NodePorts on localhost).
pub fn init_host(cfg: &ProxyConfig, sysctl: &kp_netlink::Sysctl) -> Result<Vec<String>> {
    let mut changed = Vec::new();
    for f in FAMILIES {
        let pc = cfg.proxier_config(f, &[], &[]);
        if kp_iptables::init_host(&pc, sysctl)? {
            changed.push("net/ipv4/conf/all/route_localnet=1".into());
        }
    }
    Ok(changed)
}

/// The kube-proxy chains `scope` lets go, in the backend `--iptables-backend`
/// pins or in every backend that runs here.
pub fn remove_leftovers(scope: Scope, cfg: &ProxyConfig, out: &mut Outcome) {
    // In iptables mode our own sync takes over the shared names (and deletes
    // stale per-service chains); only what it never writes is removed.
    let doomed: &dyn Fn(&str, &str) -> bool = match scope {
        Scope::StartingIn(ProxyMode::Iptables) => {
            &|t: &str, c: &str| is_kube_proxy_chain(t, c) && !is_our_chain(t, c)
        }
        // ipvs mode owns its chains and the shared names; iptables mode's
        // per-service chains and canaries go.
        Scope::StartingIn(ProxyMode::Ipvs) => {
            &|t: &str, c: &str| is_kube_proxy_chain(t, c) && !is_ipvs_mode_chain(t, c)
        }
        _ => &is_kube_proxy_chain,
    };
    let variants: Vec<Variant> = match cfg.iptables_backend {
        Some(v) => vec![v],
        None => vec![Variant::Nft, Variant::Legacy],
    };
    for v in variants {
        for f in FAMILIES {
            let what = format!("iptables-{} {f}", v.as_str());
            if !v.available(f) {
                out.skipped.push(format!("{what}: not available here"));
                continue;
            }
            let mut cli = IptablesCli::variant(f, v);
            match sweep(&mut cli, doomed) {
                Ok(chains) => out
                    .removed
                    .extend(chains.into_iter().map(|c| format!("{what} {c}"))),
                Err(e) => out.failed.push(format!("{what}: {e}")),
            }
        }
    }
}
