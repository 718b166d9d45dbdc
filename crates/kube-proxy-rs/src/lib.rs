//! The kube-proxy-rs binary's parts: flags and config, one module per mode
//! (`modes/`), the HTTP servers and metrics. `main.rs` wires them together;
//! the sync loop is kp-sync.

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod apiclient;
pub mod client_metrics;
pub mod component_metrics;
pub mod config;
pub mod configwatch;
pub mod debug;
pub mod docgen;
pub mod dryrun;
pub mod duration;
pub mod events;
pub mod healthcheck;
pub mod host;
pub mod iptables_metrics;
pub mod logging;
pub mod metrics;
pub mod modes;
pub mod nodecidr;
pub mod outcome;
pub mod process_metrics;
pub mod render;
pub mod server;
pub mod source;
pub mod subcommands;
pub mod zpages;
