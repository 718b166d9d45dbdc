//! The conformance suite in nftables mode with socket load balancing
//! (`--socket-lb`): each node's namespace and pods are in that node's
//! cgroup, where its proxy's programs balance their sockets.

#[macro_use]
mod conformance;

conformance_suite!("nftables-socketlb");

#[test]
fn c04b_session_affinity_lifecycle() {
    conformance::session_affinity_lifecycle("nftables-socketlb");
}
