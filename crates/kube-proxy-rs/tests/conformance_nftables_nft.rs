//! The conformance suite in nftables mode with the `nft` program backend
//! (`KUBE_PROXY_RS_NFT_BACKEND=nft`): every transaction goes to `nft -f -`
//! as text, so a rule shape nft cannot read fails here.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!(conformance::NFT_PROGRAM_MODE);

#[test]
fn c04b_session_affinity_lifecycle() {
    conformance::session_affinity_lifecycle(conformance::NFT_PROGRAM_MODE);
}

#[test]
fn c08b_clusterip_masquerade() {
    conformance::clusterip_masquerade(conformance::NFT_PROGRAM_MODE);
}
