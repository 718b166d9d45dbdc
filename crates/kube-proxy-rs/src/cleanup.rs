//! `--cleanup`, and what a start does when the node ran another mode or
//! upstream kube-proxy before: remove every kube-proxy's leftovers.
//!
//! Known objects, and nothing else:
//! - nftables: our `kube-proxy-rs` tables and upstream's `kube-proxy` tables
//!   (family ip and ip6);
//! - iptables, in each backend (nft and legacy): our chains, which are
//!   upstream iptables mode's, plus upstream ipvs mode's own chains and old
//!   `KUBE-XLB-` chains, with every rule that jumps into them;
//! - ipvs mode's leftovers: the `kube-ipvs0` link, upstream's ipsets (`KUBE-*`,
//!   `KUBE-6-*` by name), and the IPVS virtual servers (`ipvsadm --clear`,
//!   only where the kernel has IPVS).

use std::path::Path;
use std::process::Command;

use kp_iptables::leftovers::{is_ipvs_mode_chain, is_kube_proxy_chain, sweep};
use kp_iptables::{is_our_chain, IptablesCli, Variant};
use kp_model::IpFamily;
use kp_nftables::types::Object;
use kp_nftables::{NftBackend, NftNetlink, Transaction, TABLE_NAME};

use crate::config::ProxyMode;

/// Upstream kube-proxy's nftables table name (ip and ip6 families).
pub const UPSTREAM_NFT_TABLE: &str = "kube-proxy";
/// The dummy interface upstream's ipvs mode binds Service IPs to.
pub const IPVS_LINK: &str = "kube-ipvs0";
/// Upstream ipvs mode's ipsets (IPv4 names; IPv6 ones are `KUBE-6-` + the rest).
pub const IPVS_IPSETS: [&str; 17] = [
    "KUBE-LOOP-BACK",
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-LOAD-BALANCER-SOURCE-IP",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP",
    "KUBE-NODE-PORT-LOCAL-TCP",
    "KUBE-NODE-PORT-UDP",
    "KUBE-NODE-PORT-LOCAL-UDP",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    "KUBE-HEALTH-CHECK-NODE-PORT",
    "KUBE-IPVS-IPS",
];

/// Whether `name` is one of upstream ipvs mode's ipsets.
pub fn is_ipvs_ipset(name: &str) -> bool {
    IPVS_IPSETS.contains(&name)
        || name
            .strip_prefix("KUBE-6-")
            .is_some_and(|rest| IPVS_IPSETS.iter().any(|s| s[5..] == *rest))
}

/// What to remove.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// `--cleanup`: everything of every mode, ours and upstream's.
    Everything,
    /// Starting in this mode: everything that belongs to the other modes (as
    /// upstream does on a mode switch), and upstream's objects that ours
    /// do not replace by name. iptables and ipvs mode keep the chains (and
    /// ipvs mode the link and ipsets) they take over by name.
    StartingIn(ProxyMode),
}

/// What a cleanup did.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Objects removed, e.g. `nftables ip kube-proxy`, `iptables-legacy IPv4 nat/KUBE-SERVICES`.
    pub removed: Vec<String>,
    /// Removals that failed (the object is still there).
    pub failed: Vec<String>,
    /// Things not looked at, and why (a backend or tool missing).
    pub skipped: Vec<String>,
}

impl Outcome {
    /// Logs what was removed (info), skipped (debug) and failed (warn).
    pub fn log(&self, context: &str) {
        for r in &self.removed {
            tracing::info!(object = %r, "{context}: removed");
        }
        for s in &self.skipped {
            tracing::debug!(reason = %s, "{context}: skipped");
        }
        for f in &self.failed {
            tracing::warn!(error = %f, "{context}: could not remove");
        }
    }
}

const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

fn nft_family(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// Removes leftovers for `scope`. `iptables` is --iptables-backend: a pinned
/// backend limits the iptables sweep to it; auto sweeps every backend that
/// runs here.
pub fn remove_leftovers(scope: Scope, iptables: Option<Variant>) -> Outcome {
    let mut out = Outcome::default();
    nftables(scope, &mut out);
    iptables_chains(scope, iptables, &mut out);
    // ipvs mode keeps its link, sets and virtual servers across restarts.
    if scope != Scope::StartingIn(ProxyMode::Ipvs) {
        ipvs(scope, &mut out);
    }
    if scope != Scope::StartingIn(ProxyMode::Userspace) {
        crate::modes::userspace::remove_leftovers(&mut out);
    }
    out
}

fn nftables(scope: Scope, out: &mut Outcome) {
    let mut tables = vec![UPSTREAM_NFT_TABLE];
    if scope != Scope::StartingIn(ProxyMode::Nftables) {
        tables.push(TABLE_NAME);
    }
    let mut nl = NftNetlink::new();
    for f in FAMILIES {
        for t in &tables {
            match nl.table_exists(f, t) {
                Ok(false) => {}
                Ok(true) => {
                    let mut tx = Transaction::new(f, *t);
                    tx.delete(Object::Table { comment: None });
                    match nl.apply(&tx) {
                        Ok(_) => out.removed.push(format!("nftables {} {t}", nft_family(f))),
                        Err(e) => out
                            .failed
                            .push(format!("nftables {} {t}: {e}", nft_family(f))),
                    }
                }
                Err(e) => {
                    out.skipped.push(format!("nftables: {e}"));
                    return;
                }
            }
        }
    }
}

fn iptables_chains(scope: Scope, choice: Option<Variant>, out: &mut Outcome) {
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
    let variants: Vec<Variant> = match choice {
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

fn run(argv: &[&str]) -> Option<std::process::Output> {
    Command::new(argv[0]).args(&argv[1..]).output().ok()
}

fn ipvs(scope: Scope, out: &mut Outcome) {
    // The link first: while it holds the Service IPs they are local addresses.
    match run(&["ip", "-o", "link", "show", "dev", IPVS_LINK]) {
        Some(o) if o.status.success() => match run(&["ip", "link", "del", IPVS_LINK]) {
            Some(d) if d.status.success() => out.removed.push(format!("link {IPVS_LINK}")),
            Some(d) => out.failed.push(format!(
                "link {IPVS_LINK}: {}",
                String::from_utf8_lossy(&d.stderr).trim()
            )),
            None => out.failed.push(format!("link {IPVS_LINK}: cannot run ip")),
        },
        Some(_) => {}
        None => out.skipped.push("links: the ip program is missing".into()),
    }

    // Virtual servers: only a kernel with IPVS has any.
    if Path::new("/proc/net/ip_vs").exists() {
        match run(&["ipvsadm", "--clear"]) {
            Some(o) if o.status.success() => out.removed.push("ipvs virtual servers".into()),
            Some(o) => out.failed.push(format!(
                "ipvs virtual servers: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            None => out
                .skipped
                .push("ipvs virtual servers: ipvsadm is missing".into()),
        }
    } else {
        out.skipped
            .push("ipvs virtual servers: no IPVS in this kernel".into());
    }

    // ipsets last: a set is busy while an iptables rule uses it.
    let list = match run(&["ipset", "list", "-n"]) {
        Some(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        Some(_) | None => {
            out.skipped
                .push("ipsets: the ipset program is missing or failed".into());
            return;
        }
    };
    for name in list.lines().map(str::trim).filter(|n| is_ipvs_ipset(n)) {
        match run(&["ipset", "destroy", name]) {
            Some(o) if o.status.success() => out.removed.push(format!("ipset {name}")),
            Some(o) => {
                let msg = format!(
                    "ipset {name}: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                // Starting in iptables mode, upstream's ipvs rules in the
                // shared KUBE-SERVICES chain still use the sets until our
                // first sync rewrites it; `--cleanup` removes them.
                if scope == Scope::StartingIn(ProxyMode::Iptables) {
                    out.skipped.push(msg);
                } else {
                    out.failed.push(msg);
                }
            }
            None => out.failed.push(format!("ipset {name}: cannot run ipset")),
        }
    }
}
