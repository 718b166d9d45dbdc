//! Socket-level load balancing (`--socket-lb`, docs/ebpf.md).
//!
//! cgroup BPF programs (bpf/socketlb.c) translate a connect() or sendmsg()
//! to a ClusterIP into one of its endpoints inside the socket call, so
//! traffic from this node's processes to a Service is never NATed per
//! packet. [`SocketLbProxier`] keeps the programs' maps in step with the
//! model; nftables keeps everything else (the binary runs both).

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod batch;
mod kernel;
pub mod maglev;
pub mod maps;
mod mem;
mod proxier;
mod slots;

pub use kernel::{install, remove, Capacity, Installed, KernelMaps, Placement, PROGRAMS};
#[doc(hidden)]
pub use kernel::{install_object, TEST_VARIANT_OBJECT};
pub use mem::{MemContent, MemMaps};
pub use proxier::{wanted, Dump, Maps, Refused, Scope, SocketLbProxier, Wanted};

#[derive(Debug, thiserror::Error)]
pub enum SocketLbError {
    #[error("socket load balancing cannot run here: {0}")]
    Unsupported(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {message}")]
    Bpf { what: String, message: String },
}
