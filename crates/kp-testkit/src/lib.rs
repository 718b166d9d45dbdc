//! Test-only helpers for kube-proxy-rs. Nothing here is part of the product.
//!
//! [`apiserver`] is an in-process Kubernetes API server that speaks the real
//! list/watch protocol for Services, EndpointSlices, Nodes and Events, with
//! controls to compact history, cut watches and simulate an outage.

pub mod apiserver;

pub use apiserver::{ApiCall, ApiServer};
