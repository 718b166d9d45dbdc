//! The conformance suite in nftables mode (real kernel, network namespaces).

#[macro_use]
mod conformance;

conformance_suite!("nftables");
