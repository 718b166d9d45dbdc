//! The kube-proxy-rs binary's parts: flags and config, the sync loop, the HTTP
//! servers and metrics. `main.rs` wires them together.

pub mod apiclient;
pub mod cleanup;
pub mod config;
pub mod conntrack;
pub mod docgen;
pub mod events;
pub mod healthcheck;
pub mod logging;
pub mod metrics;
pub mod server;
pub mod sync;
pub mod userspace;
