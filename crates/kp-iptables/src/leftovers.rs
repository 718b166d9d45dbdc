//! Removing what any kube-proxy left in iptables: ours, upstream's iptables
//! mode (the same names) and upstream's ipvs mode (a few chains of its own).
//!
//! Unlike [`crate::IptablesProxier::cleanup`], which deletes the jumps it
//! knows by their exact text, the sweep reads each table and deletes every
//! rule outside the doomed chains that jumps into one of them, whatever its
//! comment: upstream versions worded their jump comments differently.

use std::fmt::Write;

use kp_model::DataplaneError;

use crate::render::{is_our_chain, CANARY_CHAIN};
use kp_xtables::IptablesBackend;

/// Chains only upstream's ipvs mode creates (pkg/proxy/ipvs), per table. The
/// rest of its chains (KUBE-SERVICES, KUBE-POSTROUTING, KUBE-MARK-MASQ,
/// KUBE-FORWARD, KUBE-PROXY-FIREWALL) share our names.
pub const IPVS_NAT_CHAINS: [&str; 2] = ["KUBE-NODE-PORT", "KUBE-LOAD-BALANCER"];
pub const IPVS_FILTER_CHAINS: [&str; 4] = [
    "KUBE-NODE-PORT",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];

/// Chains ipvs mode shares with iptables mode by name.
const IPVS_SHARED_NAT: [&str; 3] = ["KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"];
const IPVS_SHARED_FILTER: [&str; 2] = ["KUBE-FORWARD", "KUBE-PROXY-FIREWALL"];

/// Every chain ipvs mode (upstream's, and kp-ipvs which copies it) writes.
pub fn is_ipvs_mode_chain(table: &str, chain: &str) -> bool {
    is_ipvs_chain(table, chain)
        || match table {
            "nat" => IPVS_SHARED_NAT.contains(&chain),
            "filter" => IPVS_SHARED_FILTER.contains(&chain),
            _ => false,
        }
}

/// Upstream iptables mode's per-service chains from before KUBE-EXT-/KUBE-SVL-
/// (eTP Local, up to 1.23): still found on long-lived nodes.
const OLD_SERVICE_PREFIXES: [&str; 1] = ["KUBE-XLB-"];

/// Chains upstream's ipvs mode owns in `table` and we never create.
pub fn is_ipvs_chain(table: &str, chain: &str) -> bool {
    match table {
        "nat" => IPVS_NAT_CHAINS.contains(&chain),
        "filter" => IPVS_FILTER_CHAINS.contains(&chain),
        _ => false,
    }
}

/// Any chain a kube-proxy (ours, upstream's iptables or ipvs mode) creates in
/// `table`. Kubelet's chains (KUBE-FIREWALL, KUBE-MARK-DROP,
/// KUBE-KUBELET-CANARY) and anything else are not.
pub fn is_kube_proxy_chain(table: &str, chain: &str) -> bool {
    is_our_chain(table, chain)
        || is_ipvs_chain(table, chain)
        // Upstream puts its canary in mangle, nat and filter; we use mangle.
        || (chain == CANARY_CHAIN && matches!(table, "mangle" | "nat" | "filter"))
        || (table == "nat" && OLD_SERVICE_PREFIXES.iter().any(|p| chain.starts_with(p)))
}

/// The tables a kube-proxy writes to, in the order they are swept.
pub const TABLES: [&str; 3] = ["mangle", "filter", "nat"];

/// The `iptables-restore --noflush` input that removes every chain of `save`
/// (one table's `iptables-save` output) for which `doomed(table, chain)` is
/// true, with every rule elsewhere that jumps (`-j`/`-g`) into one; None when
/// there is nothing to remove. Pure: the sweep's logic, tested on text.
pub fn sweep_script(
    table: &str,
    save: &str,
    doomed: &dyn Fn(&str, &str) -> bool,
) -> Option<(String, Vec<String>)> {
    let chains: Vec<&str> = save
        .lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| doomed(table, c))
        .collect();
    if chains.is_empty() {
        return None;
    }
    let mut out = String::new();
    let _ = writeln!(out, "*{table}");
    for line in save.lines() {
        let Some(rest) = line.strip_prefix("-A ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let Some(chain) = words.next() else { continue };
        if chains.contains(&chain) {
            continue; // flushed below
        }
        let mut prev = "";
        let jumps_in = words.any(|w| {
            let hit = (prev == "-j" || prev == "-g") && chains.contains(&w);
            prev = w;
            hit
        });
        if jumps_in {
            let _ = writeln!(out, "-D {rest}");
        }
    }
    for c in &chains {
        let _ = writeln!(out, ":{c} - [0:0]");
    }
    for c in &chains {
        let _ = writeln!(out, "-X {c}");
    }
    let _ = writeln!(out, "COMMIT");
    Some((out, chains.iter().map(|c| format!("{table}/{c}")).collect()))
}

/// Removes, in every table, the chains `doomed` selects and the rules that
/// jump into them, one `iptables-restore` per table. Returns what was removed
/// (`table/chain`).
pub fn sweep(
    backend: &mut dyn IptablesBackend,
    doomed: &dyn Fn(&str, &str) -> bool,
) -> Result<Vec<String>, DataplaneError> {
    let mut removed = Vec::new();
    for table in TABLES {
        let save = backend.save_table(table)?;
        if let Some((script, chains)) = sweep_script(table, &save, doomed) {
            backend.restore(&script)?;
            removed.extend(chains);
        }
    }
    Ok(removed)
}
