//! The conformance suite in iptables mode with iptables-nft written by
//! `iptables-nft-restore` (`--iptables-nft-restore`, the fallback) instead of
//! over nf_tables netlink.

#[macro_use]
mod conformance;

conformance_suite!("iptables-restore");
