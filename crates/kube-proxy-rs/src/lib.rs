//! The kube-proxy-rs binary's parts: flags and config, one module per mode
//! (`modes/`), the HTTP servers and metrics. `main.rs` wires them together;
//! the sync loop is kp-sync.

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod cli;
pub mod config;
pub mod host;
pub mod http;
pub mod kube;
pub mod logging;
pub mod metrics;
pub mod modes;
pub mod render;
