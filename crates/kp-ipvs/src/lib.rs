//! The IPVS dataplane.
//!
//! Every Service address (ClusterIP, externalIPs, LoadBalancer IPs, and each
//! node address for NodePorts) and port becomes an IPVS virtual server whose
//! real servers are the endpoints; the Service IPs are bound to the
//! kube-ipvs0 dummy interface so that the node accepts their packets; ipsets
//! hold the per-Service data the small fixed iptables ruleset matches
//! (masquerade, NodePorts, source ranges, filtering). [`plan()`] computes the
//! whole layout from the model and [`diff`] the operations to get there (both
//! pure); [`IpvsProxier`] applies them over generic netlink (IPVS),
//! rtnetlink (kube-ipvs0), `ipset restore` and `iptables-restore`.
//! docs/ipvs.md describes the layout.

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod ipset;
mod ipvs;
mod kernel;
pub mod leftovers;
mod plan;
mod proxier;
mod rtnl;
mod rules;

pub use ipset::{IpsetBackend, IpsetCli, SetKind, SETS};
pub use ipvs::{msg as ipvs_msg, DestInfo, IpvsClient, RealServer, VsKey, VsSpec, SCHEDULERS};
pub use kernel::{check_kernel, conn_reuse_mode, kernel_version, ConnReuseMode};
pub use plan::{
    apply_to, diff, graceful, plan, ConfigError, IpvsConfig, Layout, Op, VirtualServer,
};
pub use proxier::{host_sysctls, init_host, IpvsProxier, DUMMY_DEV};
pub use rtnl::msg as rtnl_msg;
pub use rules::{jumps, restore_input, with_jumps};

/// Helpers for tests (byte-level message tests, VM harness): feature
/// `testing`, which only dev-dependencies enable; not the product's API.
#[cfg(any(test, feature = "testing"))]
pub mod internals {
    pub use crate::ipset::{add_line, create_lines, name as set_name, parse_save};
    pub use crate::ipvs::{parse_dest, parse_service};
    pub use crate::rtnl::parse_addr;
}
