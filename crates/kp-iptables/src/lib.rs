//! The iptables dataplane.
//!
//! [`render_service`] turns one service port into upstream kube-proxy's chains
//! and rules (KUBE-SVC-*, KUBE-SEP-*, ... plus its rules in the shared
//! KUBE-SERVICES / KUBE-NODEPORTS / filter chains), typed ([`Rule`]: the
//! iptables-restore text is its `Display`); [`IptablesProxier`] remembers
//! what it programmed and, after a first full sync, rewrites only the chains
//! of changed services (upstream's MinimizeIPTablesRestore), as one restore
//! input ([`Restore`]) given to a [`Writer`]: nf_tables netlink for
//! iptables-nft ([`IptablesNetlink`], which encodes the typed rules), or
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
mod types;
mod writer;

pub use backend::select;
pub use kp_xtables::{
    chain_names, detect_variant, Adopted, IptablesBackend, IptablesCli, Jump, Variant,
};
pub use nft::{EncodeError, IptablesNetlink};
pub use proxier::{init_host, IptablesProxier};
pub use render::{
    is_our_chain, jumps, packet_chains, render_service, render_service_with, sep_chain, svc_chain,
    HostRules, ServiceRules, Skeleton, CANARY_CHAIN, EXTERNAL_CHAIN, FIREWALL_CHAIN, FORWARD_CHAIN,
    MARK_MASQ_CHAIN, NODEPORTS_CHAIN, POSTROUTING_CHAIN, SERVICES_CHAIN,
};
pub use types::{
    probability, Addr, Iface, Line, Match, Recent, Restore, Rule, Target, CT_DNAT, CT_ESTABLISHED,
    CT_INVALID, CT_NEW, CT_RELATED,
};
pub use writer::Writer;
