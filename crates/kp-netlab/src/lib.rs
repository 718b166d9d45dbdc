//! `kp-netlab`: a real-kernel test lab of network namespaces for the
//! kube-proxy-rs conformance tests (every proxy mode) and the demo.
//!
//! [`Cluster::new`] builds, under a fresh unique prefix `kpXXXXXX`, a small
//! cluster made only of namespaces (nothing is created in the root
//! namespace), and tears everything down on drop — including when the test
//! panics, since `Drop` runs during unwinding:
//!
//! ```text
//!                     external client  ns kpXXXXXX-client
//!                     eth0 10.100.0.100/24  fd00:100::100/64
//!                     (routes: LAN only, plus Cluster::client_route_via)
//!                          |
//!                          | veth c0
//!  ns kpXXXXXX-lan  ===[ br0 bridge, no IPs, no forwarding ]======== LAN
//!                          | veth n1                 | veth n2       10.100.0.0/24
//!                          |                         |               fd00:100::/64
//!  ns kpXXXXXX-node1  eth0 10.100.0.11   kpXXXXXX-node2  eth0 10.100.0.12
//!                          fd00:100::11                   fd00:100::12
//!    ip_forward=1, IPv6 forwarding=1, default route dev eth0 (v4 and v6),
//!    10.244.2.0/24 via 10.100.0.12,   10.244.1.0/24 via 10.100.0.11,
//!    fd00:244:2::/64 via fd00:100::12 fd00:244:1::/64 via fd00:100::11
//!          |kpv2          |kpv3              |kpv2
//!          | 169.254.1.1 scope link, fe80::1 (node side of every pod veth)
//!          |              |                  |
//!  pod a: eth0      pod b: eth0        pod c: eth0        ns kpXXXXXX-pod-NAME
//!   10.244.1.2/32    10.244.1.3/32      10.244.2.2/32
//!   fd00:244:1::2    fd00:244:1::3      fd00:244:2::2     (/128)
//!   default via 169.254.1.1 onlink, default via fe80::1
//! ```
//!
//! * Node `i` (1-based) has LAN address 10.100.0.(10+i) / fd00:100::(0x10+i),
//!   pod CIDR 10.244.i.0/24 / fd00:244:i::/64 and a /32 + /128 route per
//!   local pod through its veth (`src` = the node's LAN address). A lab of
//!   more than 89 nodes (up to 1,000) widens the LAN to 10.100.0.0/16:
//!   nodes 90.. are 10.100.1.1.. / fd00:100::1:i, pods past node 255 are in
//!   10.245.x.0/24, and LAN hosts and nodes know each other as permanent
//!   neighbours.
//! * ClusterIPs ([`SERVICE_CIDR_V4`] 10.96.0.0/16, [`SERVICE_CIDR_V6`]
//!   fd00:96::/108) are routable everywhere: pods send everything to their
//!   node, and nodes have a default route out of `eth0`, so the proxy's
//!   netfilter hooks see the packets. Nothing answers them unless a proxy
//!   translates them.
//! * IPv6 duplicate address detection is off in every namespace, so all
//!   addresses work immediately.
//!
//! Besides the topology the crate offers [`Cluster::spawn`] (programs in a
//! namespace, killed on drop), [`in_netns`] (run a closure in a namespace),
//! echo servers ([`Cluster::serve`]) and matching clients ([`tcp_hello`],
//! [`tcp_hello_many`], [`udp_ask`], [`udp_session`], [`tcp_hold`]).
//!
//! Echo protocol: on TCP accept the server writes `"<name> <peer_ip>
//! <peer_port>\n"`, then answers each line `L` the client sends with
//! `"<name> L\n"` until EOF. Each UDP datagram is answered with `"<name>
//! <peer_ip> <peer_port>"`. The client functions turn those into a
//! [`Reply`].
//!
//! Everything here needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN).

mod bpffs;
mod cgroup;
mod client;
mod cluster;
mod error;
mod mounts;
mod netns;
mod process;
mod scratch;
mod server;
mod sock;

use std::time::{Duration, Instant};

pub use bpffs::TestBpffs;
pub use cgroup::TestCgroup;
pub use client::{
    tcp_hello, tcp_hello_from, tcp_hello_many, tcp_hello_many_from, tcp_hold, tcp_hold_from,
    udp_ask, udp_ask_from, udp_session, udp_session_from, HeldConn, Reply, UdpSession,
};
pub use cluster::{
    Cluster, ClusterOpts, LanHost, Pod, LAN_IFACE, POD_GATEWAY_V4, POD_GATEWAY_V6, POD_VETH_PREFIX,
    SERVICE_CIDR_V4, SERVICE_CIDR_V6,
};
pub use error::{ConnError, LabError};
pub use netns::{in_netns, netns_exists, NETNS_DIR};
pub use process::ProcGuard;
pub use scratch::{unique_name, ScratchDir, ScratchNs};
pub use server::{serve, ServeSpec, ServerGuard};

/// Polls `cond` every `interval` until it returns true (then returns true)
/// or `timeout` has passed (then returns false, after one last check).
pub fn wait_until(timeout: Duration, interval: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(interval.min(deadline - now));
    }
}
