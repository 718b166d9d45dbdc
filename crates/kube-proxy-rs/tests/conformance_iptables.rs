//! The conformance suite in iptables mode (real kernel, network namespaces):
//! iptables-nft, written over nf_tables netlink (the default).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("iptables");

#[test]
fn c08b_clusterip_masquerade() {
    conformance::clusterip_masquerade("iptables");
}
