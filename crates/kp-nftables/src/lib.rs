//! The nftables dataplane.
//!
//! [`render`] turns the model into [`ServiceObjects`] (chains, rules, map
//! elements) per service port; [`NftablesProxier`] remembers what it last
//! programmed and sends the kernel only the difference, as one transaction, through
//! an [`NftBackend`]. The layout is described in docs/nftables.md.

mod backend;
mod netlink;
mod proxier;
mod render;
mod rule;

pub use backend::{NftBackend, NftCli};
pub use netlink::{NftNetlink, ScriptError};
pub use proxier::NftablesProxier;
pub use render::{render_service, Element, ServiceObjects, Skeleton, TABLE_NAME};
pub use rule::{Rule, Verdict};
