//! The differential run: the same conformance cases with upstream
//! kube-proxy v1.36 (iptables mode) against the same kind of real control plane,
//! so no expectation of the suite holds for our proxy alone.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("upstream/iptables", || conformance::binaries_for(
    "upstream/iptables"
));
api_cases!("upstream/iptables");

#[test]
fn c08b_clusterip_masquerade() {
    if conformance::binaries_for("upstream/iptables") {
        conformance::clusterip_masquerade("upstream/iptables");
    }
}

#[test]
fn c18_nodeport_default_addresses() {
    if conformance::binaries_for("upstream/iptables") {
        conformance::nodeport_default_addresses("upstream/iptables");
    }
}

#[test]
fn c19_conntrack_timeouts_at_start() {
    if conformance::binaries_for("upstream/iptables") {
        conformance::conntrack_timeouts_at_start("upstream/iptables");
    }
}

#[test]
fn c20_healthz_on_both_families() {
    if conformance::binaries_for("upstream/iptables") {
        conformance::healthz_on_both_families("upstream/iptables");
    }
}

#[test]
fn c21_periodic_syncs() {
    if conformance::binaries_for("upstream/iptables") {
        conformance::periodic_syncs("upstream/iptables");
    }
}
