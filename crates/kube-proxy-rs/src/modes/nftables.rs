//! nftables mode (the default), and the nftables leftovers: our
//! `kube-proxy-rs` tables and upstream's `kube-proxy` tables (ip and ip6).

use kp_model::{Dataplane, ProxierConfig};
use kp_nftables::types::{family_kw, Object};
use kp_nftables::{NftBackend, NftNetlink, Transaction, TABLE_NAME};

use super::{Outcome, Scope, FAMILIES};
use crate::config::{ProxyConfig, ProxyMode};

/// Upstream kube-proxy's nftables table name (ip and ip6 families).
pub const UPSTREAM_NFT_TABLE: &str = "kube-proxy";

/// Transactions go to the kernel as nf_tables netlink batches: the `nft`
/// program re-reads the whole table on every run and is superlinear in
/// chain count (BENCHMARKS.md). `KUBE_PROXY_RS_NFT_BACKEND=nft` sends the
/// same transactions through the `nft` program instead (a fallback for
/// debugging).
const NFT_BACKEND_ENV: &str = "KUBE_PROXY_RS_NFT_BACKEND";

pub fn dataplane(pc: ProxierConfig) -> Box<dyn Dataplane> {
    let backend: Box<dyn kp_nftables::NftBackend> = match std::env::var(NFT_BACKEND_ENV).as_deref()
    {
        Ok("nft") => {
            tracing::info!(
                family = ?pc.family,
                "nftables: transactions go through the nft program ({NFT_BACKEND_ENV}=nft)"
            );
            Box::new(kp_nftables::NftCli::default())
        }
        _ => Box::new(kp_nftables::NftNetlink::new()),
    };
    Box::new(kp_nftables::NftablesProxier::new(pc, backend))
}

/// Starting in nftables mode, ours is what we start with and upstream's
/// table goes after our first sync ([`remove_superseded`]); otherwise both.
pub fn remove_leftovers(scope: Scope, _cfg: &ProxyConfig, out: &mut Outcome) {
    if !scope.starting_in(ProxyMode::Nftables) {
        remove_tables(&[UPSTREAM_NFT_TABLE, TABLE_NAME], out);
    }
}

/// Upstream's table, once ours serve.
pub fn remove_superseded(out: &mut Outcome) {
    remove_tables(&[UPSTREAM_NFT_TABLE], out);
}

fn remove_tables(tables: &[&str], out: &mut Outcome) {
    let mut nl = NftNetlink::new();
    for f in FAMILIES {
        for t in tables {
            match nl.table_exists(f, t) {
                Ok(false) => {}
                Ok(true) => {
                    let mut tx = Transaction::new(f, *t);
                    tx.delete(Object::Table { comment: None });
                    match nl.apply(&tx) {
                        Ok(_) => out.removed.push(format!("nftables {} {t}", family_kw(f))),
                        Err(e) => out
                            .failed
                            .push(format!("nftables {} {t}: {e}", family_kw(f))),
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
