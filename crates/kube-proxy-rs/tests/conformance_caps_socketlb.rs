//! The conformance suite with socket load balancing and the proxy run with
//! the least privilege docs/ebpf.md asks of the DaemonSet: a privileged
//! `--init-only` first, then the proxy with only CAP_NET_ADMIN and CAP_BPF,
//! no new privileges and a read-only /proc/sys (checked on the running
//! process).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("caps/nftables-socketlb");
