//! The conformance suite in iptables mode against a real kube-apiserver: every
//! object written through the API, kube-proxy-rs running with exactly
//! deploy/'s ServiceAccount and RBAC; plus the cases only the API path has.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("api/iptables", || conformance::binaries_for("api/iptables"));
api_cases!("api/iptables");

#[test]
fn c21_periodic_syncs() {
    if conformance::binaries_for("api/iptables") {
        conformance::periodic_syncs("api/iptables");
    }
}
