//! The differential run: the same conformance cases with upstream
//! kube-proxy v1.36 (nftables mode) against the same kind of real control plane,
//! so no expectation of the suite holds for our proxy alone.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("upstream/nftables", || conformance::binaries_for(
    "upstream/nftables"
));
api_cases!("upstream/nftables");

#[test]
fn a08_affinity_from_a_connect_before_the_service() {
    if conformance::binaries_for("upstream/nftables") {
        conformance::affinity_from_a_connect_before_the_service("upstream/nftables");
    }
}

#[test]
fn c04b_session_affinity_lifecycle() {
    if conformance::binaries_for("upstream/nftables") {
        conformance::session_affinity_lifecycle("upstream/nftables");
    }
}

#[test]
fn c08b_clusterip_masquerade() {
    if conformance::binaries_for("upstream/nftables") {
        conformance::clusterip_masquerade("upstream/nftables");
    }
}

#[test]
fn c18_nodeport_default_addresses() {
    if conformance::binaries_for("upstream/nftables") {
        conformance::nodeport_default_addresses("upstream/nftables");
    }
}

#[test]
fn c19_conntrack_timeouts_at_start() {
    if conformance::binaries_for("upstream/nftables") {
        conformance::conntrack_timeouts_at_start("upstream/nftables");
    }
}

#[test]
fn a07_service_cidrs() {
    if conformance::binaries_for("upstream/nftables") {
        conformance::api_service_cidrs("upstream/nftables");
    }
}

#[test]
fn c20_healthz_on_both_families() {
    if conformance::binaries_for("upstream/nftables") {
        conformance::healthz_on_both_families("upstream/nftables");
    }
}

#[test]
fn c21_periodic_syncs() {
    if conformance::binaries_for("upstream/nftables") {
        conformance::periodic_syncs("upstream/nftables");
    }
}
