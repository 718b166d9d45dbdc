//! The conformance suite in nftables mode (real kernel, network namespaces).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("nftables");

#[test]
fn c04b_session_affinity_lifecycle() {
    conformance::session_affinity_lifecycle("nftables");
}

#[test]
fn c08b_clusterip_masquerade() {
    conformance::clusterip_masquerade("nftables");
}

#[test]
fn c18_nodeport_default_addresses() {
    conformance::nodeport_default_addresses("nftables");
}

#[test]
fn c19_conntrack_timeouts_at_start() {
    conformance::conntrack_timeouts_at_start("nftables");
}

#[test]
fn c20_healthz_on_both_families() {
    conformance::healthz_on_both_families("nftables");
}
