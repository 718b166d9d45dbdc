//! The conformance suite with socket load balancing (`--socket-lb`) against
//! a real kube-apiserver: the same cases as conformance_api_nftables.rs.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("api/nftables-socketlb", || conformance::binaries_for(
    "api/nftables-socketlb"
));
api_cases!("api/nftables-socketlb");

#[test]
fn a08_affinity_from_a_connect_before_the_service() {
    if conformance::binaries_for("api/nftables-socketlb") {
        conformance::affinity_from_a_connect_before_the_service("api/nftables-socketlb");
    }
}
