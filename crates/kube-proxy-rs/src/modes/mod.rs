//! One module per proxy mode, each the whole of what the binary does for it:
//! its flags, how its dataplane is built from the configuration, the host
//! setup `--init-only` does for it, and its leftovers, which `--cleanup`
//! and every start sweep by looping over the modes ([`remove_leftovers`]).
//!
//! Leftovers are known objects and nothing else, ours and upstream
//! kube-proxy's: nftables tables `kube-proxy-rs` and `kube-proxy`; the
//! iptables chains of upstream's iptables and ipvs modes in each backend;
//! ipvs mode's `kube-ipvs0` link, `KUBE-*` ipsets and virtual servers;
//! userspace mode's marked addresses on lo; socket load balancing's pins.
//!
//! Adding a mode: a module here with `dataplane`, `remove_leftovers` (and
//! `init_host` if the host needs settings), an arm in [`make_dataplane`]
//! and [`init_host`], and its sweep in [`SWEEPS`].

use std::net::IpAddr;

use anyhow::Result;
use ipnet::IpNet;
use kp_model::{ChangeTracker, Dataplane, IpFamily, TrackerConfig};

use crate::config::{ProxyConfig, ProxyMode};
use crate::metrics::Metrics;
pub use crate::modes::outcome::Outcome;

pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod outcome;
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

/// What a sweep of leftovers removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// `--cleanup`: everything of every mode, ours and upstream's.
    Everything,
    /// Starting in this mode: everything that belongs to the other modes (as
    /// upstream does on a mode switch), and upstream's objects that ours
    /// do not replace by name. iptables and ipvs mode keep the chains (and
    /// ipvs mode the link and ipsets) they take over by name. Starting in
    /// nftables mode, upstream's nftables table is not removed here: it
    /// keeps serving until our first sync, then [`remove_superseded`] takes
    /// it away (a replacement of upstream nftables mode drops nothing).
    StartingIn(ProxyMode),
}

impl Scope {
    /// Whether this sweep runs for a start in `mode`.
    pub fn starting_in(self, mode: ProxyMode) -> bool {
        self == Scope::StartingIn(mode)
    }
}

/// One mode's sweep: removes what it owns that `scope` lets go.
type Sweep = fn(Scope, &ProxyConfig, &mut Outcome);

/// Every mode's sweep, in order: socket load balancing's programs before
/// the rules under them; ipvs mode's link before anything reads the node's
/// addresses (it holds Service IPs).
pub const SWEEPS: [Sweep; 5] = [
    socketlb::remove_leftovers,
    nftables::remove_leftovers,
    iptables::remove_leftovers,
    ipvs::remove_leftovers,
    userspace::remove_leftovers,
];

/// Removes every mode's leftovers for `scope`. `--iptables-backend` limits
/// the iptables sweep to a pinned backend (auto sweeps every backend that
/// runs here); `--bpf-pin-path` is where socket load balancing's pins
/// would be.
pub fn remove_leftovers(scope: Scope, cfg: &ProxyConfig) -> Outcome {
    let mut out = Outcome::default();
    for sweep in SWEEPS {
        sweep(scope, cfg, &mut out);
    }
    out
}

/// After the first sync of every family in `mode`: upstream's rules that
/// ours now replace. Starting in nftables mode over upstream's nftables mode,
/// both tables serve the same Services for a moment (the first to translate
/// a connection wins); until then, upstream's alone did. Other modes take
/// upstream's objects over by name or remove them at start (`--init-only`).
pub fn remove_superseded(mode: ProxyMode) -> Outcome {
    let mut out = Outcome::default();
    if mode == ProxyMode::Nftables {
        nftables::remove_superseded(&mut out);
    }
    out
}
