//! The eBPF datapath (`--socket-lb`, `--bpf-nodeport`, docs/ebpf.md), laid
//! out as Cilium's: one entry file per attach point over code by concern.
//!
//! - bpf/sock.c: cgroup programs translate a connect() or sendmsg() to a
//!   ClusterIP into one of its endpoints inside the socket call, so traffic
//!   from this node's processes to a Service is never NATed per packet
//!   ([`install`] attaches them to the cgroup, or adopts a previous run's).
//! - bpf/tc.c, bpf/xdp.c: traffic from outside the node to NodePorts,
//!   LoadBalancer and external IPs, with SNAT or DSR ([`NodePort`]); the
//!   code they share is under bpf/lib/ (maps, parse, csum, nat, route,
//!   dsr, icmp, maglev).
//!
//! [`SocketLbProxier`] is the Dataplane: it reads the model's
//! `EndpointSelection`, writes the maps as differences, and keeps its tc
//! and XDP links on the node's interfaces. [`maglev`] builds the Maglev
//! tables (pure). nftables keeps everything else (the binary runs both).

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod batch;
mod kernel;
pub mod maglev;
pub mod maps;
mod mem;
mod nodeport;
mod proxier;
mod slots;

pub use kernel::{install, Capacity, Installed, KernelMaps, Placement, PROGRAMS};
#[doc(hidden)]
pub use kernel::{install_object, TEST_VARIANT_OBJECT};
pub use mem::{MemContent, MemMaps};
pub use nodeport::{
    default_route_devices, interfaces, remove_nodeport, set_node_v6, Acceleration, Attached,
    Interface, NodePort, Role, NODEPORT_PROGRAMS, XDP_PROGRAM,
};
#[doc(hidden)]
pub use nodeport::{TC_OBJECT, XDP_OBJECT, XDP_PASS_OBJECT};
pub use proxier::{
    wanted, wanted_outside, Attach, Dump, LbMode, Maps, Refused, Scope, SocketLbProxier, Wanted,
};

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

/// Removes every pin under `pin_dir` this mode made, the tc programs' links
/// and maps first: unpinning a link detaches its program, unpinning a map
/// frees it. Missing pins are fine; true when something was there.
pub fn remove(pin_dir: &std::path::Path) -> Result<bool, SocketLbError> {
    let tc = nodeport::remove_nodeport(pin_dir)?;
    Ok(kernel::remove_socket(pin_dir)? | tc)
}
