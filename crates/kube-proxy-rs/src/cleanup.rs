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
//!   `KUBE-6-*` by name), and the IPVS virtual servers (all of them, as
//!   `ipvsadm --clear`, only where the kernel has IPVS), removed over netlink
//!   by kp-ipvs's own code (`kp_ipvs::leftovers`), which also owns the names.

use kp_iptables::leftovers::{is_ipvs_mode_chain, is_kube_proxy_chain, sweep};
use kp_iptables::{is_our_chain, IptablesCli, Variant};
use kp_ipvs::leftovers as ipvs_leftovers;
use kp_model::IpFamily;
use kp_nftables::types::Object;
use kp_nftables::{NftBackend, NftNetlink, Transaction, TABLE_NAME};

use crate::config::{ProxyConfig, ProxyMode};
pub use crate::outcome::Outcome;

/// Upstream kube-proxy's nftables table name (ip and ip6 families).
pub const UPSTREAM_NFT_TABLE: &str = "kube-proxy";
/// The dummy interface upstream's ipvs mode binds Service IPs to.
pub const IPVS_LINK: &str = kp_ipvs::DUMMY_DEV;

/// Whether `name` is one of upstream ipvs mode's ipsets (kp-ipvs knows them).
pub fn is_ipvs_ipset(name: &str) -> bool {
    ipvs_leftovers::is_ipvs_set(name)
}

/// What to remove.
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

/// After the first sync of every family in `mode`: upstream's rules that
/// ours now replace. Starting in nftables mode over upstream's nftables mode,
/// both tables serve the same Services for a moment (the first to translate
/// a connection wins); until then, upstream's alone did. Other modes take
/// upstream's objects over by name or remove them at start (`--init-only`).
pub fn remove_superseded(mode: ProxyMode) -> Outcome {
    let mut out = Outcome::default();
    if mode == ProxyMode::Nftables {
        remove_nft_tables(&[UPSTREAM_NFT_TABLE], &mut out);
    }
    out
}

const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

fn nft_family(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// Removes leftovers for `scope`. --iptables-backend limits the iptables
/// sweep to a pinned backend (auto sweeps every backend that runs here);
/// --bpf-pin-path is where socket load balancing's pins would be.
pub fn remove_leftovers(scope: Scope, cfg: &ProxyConfig) -> Outcome {
    let iptables = cfg.iptables_backend;
    let mut out = Outcome::default();
    // Socket load balancing stays (and is adopted) only when starting with it.
    if !(cfg.socket_lb.socket_lb && scope == Scope::StartingIn(ProxyMode::Nftables)) {
        crate::modes::socketlb::remove_leftovers(&cfg.socket_lb, &mut out);
    }
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
    // Starting in nftables mode, upstream's table goes after our first sync
    // (remove_superseded), and ours is what we start with.
    if scope != Scope::StartingIn(ProxyMode::Nftables) {
        remove_nft_tables(&[UPSTREAM_NFT_TABLE, TABLE_NAME], out);
    }
}

fn remove_nft_tables(tables: &[&str], out: &mut Outcome) {
    let mut nl = NftNetlink::new();
    for f in FAMILIES {
        for t in tables {
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

fn ipvs(scope: Scope, out: &mut Outcome) {
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
                if scope == Scope::StartingIn(ProxyMode::Iptables) {
                    out.skipped.push(msg);
                } else {
                    out.failed.push(msg);
                }
            }
        }
    }
}
