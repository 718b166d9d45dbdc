//! The conformance suite in iptables mode with iptables-nft written by
//! `iptables-nft-restore` (`--iptables-nft-restore`, the fallback) instead of
//! over nf_tables netlink.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("iptables-restore");
