//! The conformance suite in iptables mode with the proxy run as
//! deploy/daemonset.yaml runs it: a privileged `--init-only` first (the init
//! container), then the proxy with only CAP_NET_ADMIN, no new privileges and a
//! read-only /proc/sys (checked on the running process).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("caps/iptables");
