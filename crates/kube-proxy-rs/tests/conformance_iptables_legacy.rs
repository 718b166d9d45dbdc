//! The conformance suite in iptables mode with the iptables-legacy backend
//! (`--iptables-backend=legacy`: x_tables in the kernel, not nf_tables).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("iptables-legacy");
