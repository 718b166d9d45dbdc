//! The nftables dataplane.
//!
//! [`render_service`] turns the model into [`ServiceObjects`] (chains of typed
//! rules, map elements) per service port; [`NftablesProxier`] remembers what
//! it last programmed and sends the kernel only the difference, as one typed
//! [`Transaction`], through an [`NftBackend`]: netlink encodes the objects,
//! `nft -f` and --dry-run get them as nft text. The layout is described in
//! docs/nftables.md.

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod backend;
/// An nftables kernel in memory for tests: behind the `testing` feature,
/// which only dev-dependencies enable; not the product's API.
#[cfg(any(test, feature = "testing"))]
pub mod fake;
mod names;
mod netlink;
mod proxier;
mod render;
mod rule;
pub mod types;
mod view;

pub use backend::{NftBackend, NftCli};
pub use names::TABLE_NAME;
pub use netlink::{EncodeError, NftNetlink};
pub use proxier::{Adoption, NftablesProxier};
pub use render::{packet_chains, render_service, Element, ServiceObjects, Skeleton};
pub use types::{Rule, Transaction, Verdict};
