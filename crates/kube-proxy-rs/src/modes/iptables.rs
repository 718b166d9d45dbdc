//! iptables mode, in the backend `--iptables-backend` chooses (or the one the
//! host uses): iptables-nft written over nf_tables netlink (or with
//! `iptables-nft-restore` under `--iptables-nft-restore`), iptables-legacy
//! with `iptables-legacy-restore`.

use anyhow::Result;
use kp_model::{Dataplane, IpFamily, ProxierConfig};

use super::FAMILIES;
use crate::config::ProxyConfig;

pub fn dataplane(cfg: &ProxyConfig, family: IpFamily, pc: ProxierConfig) -> Box<dyn Dataplane> {
    Box::new(kp_iptables::IptablesProxier::new(
        pc,
        kp_iptables::select(family, cfg.iptables_backend, cfg.iptables_nft_restore),
    ))
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
