//! The conformance suite in nftables mode against a real kube-apiserver: every
//! object written through the API, kube-proxy-rs running with exactly
//! deploy/'s ServiceAccount and RBAC; plus the cases only the API path has.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("api/nftables", || conformance::binaries_for("api/nftables"));
api_cases!("api/nftables");

#[test]
fn a07_service_cidrs() {
    if conformance::binaries_for("api/nftables") {
        conformance::api_service_cidrs("api/nftables");
    }
}

#[test]
fn c21_periodic_syncs() {
    if conformance::binaries_for("api/nftables") {
        conformance::periodic_syncs("api/nftables");
    }
}

#[test]
fn a08_one_connection_to_the_api_server() {
    if conformance::binaries_for("api/nftables") {
        conformance::api_one_connection("api/nftables");
    }
}

#[test]
fn a09_watch_list_client_gate_off() {
    if conformance::binaries_for("api/nftables") {
        conformance::api_watch_list_gate_off("api/nftables");
    }
}
