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

#[test]
fn c18_nodeport_default_addresses() {
    conformance::nodeport_default_addresses("iptables");
}

#[test]
fn c19_conntrack_timeouts_at_start() {
    conformance::conntrack_timeouts_at_start("iptables");
}

#[test]
fn c20_healthz_on_both_families() {
    conformance::healthz_on_both_families("iptables");
}
