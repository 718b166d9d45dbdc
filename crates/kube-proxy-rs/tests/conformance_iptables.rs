//! The conformance suite in iptables mode (real kernel, network namespaces).

#[macro_use]
mod conformance;

conformance_suite!("iptables");
