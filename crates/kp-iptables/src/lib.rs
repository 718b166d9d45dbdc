//! The iptables dataplane.
//!
//! [`render_service`] turns one service port into upstream kube-proxy's chains
//! and rules (KUBE-SVC-*, KUBE-SEP-*, ... plus its lines in the shared
//! KUBE-SERVICES / KUBE-NODEPORTS / filter chains); [`IptablesProxier`]
//! remembers what it programmed and, after a first full sync, rewrites only
//! the chains of changed services (upstream's MinimizeIPTablesRestore), through
//! `iptables-restore --noflush`. The layout is described in docs/iptables.md.

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod backend;
pub mod leftovers;
pub mod nfacct;
mod nft;
mod proxier;
mod render;

pub use backend::select;
pub use kp_xtables::{
    chain_names, detect_variant, missing_jumps, with_jumps, IptablesBackend, IptablesCli, Jump,
    Variant,
};
pub use nft::IptablesNetlink;
pub use proxier::{init_host, IptablesProxier};
pub use render::{
    comment, is_our_chain, jumps, packet_chains, probability, render_service, render_service_with,
    sep_chain, svc_chain, HostRules, ServiceRules, Skeleton, CANARY_CHAIN, EXTERNAL_CHAIN,
    FIREWALL_CHAIN, FORWARD_CHAIN, MARK_MASQ_CHAIN, NODEPORTS_CHAIN, POSTROUTING_CHAIN,
    SERVICES_CHAIN,
};
