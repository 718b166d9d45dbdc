//! nftables mode (the default).

use kp_model::{Dataplane, ProxierConfig};

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
