//! The service model shared by every dataplane.
//!
//! Kubernetes objects (k8s-openapi types) are converted into [`ServicePort`]s and
//! [`Endpoint`]s per IP family, endpoints are picked per traffic policy by
//! [`categorize_endpoints`], and [`ChangeTracker`] collapses any number of object
//! updates into one [`ChangeSet`] per sync. Nothing in this crate does I/O, so
//! it is tested fast and fuzzed.

mod convert;
mod dataplane;
mod names;
mod topology;
mod tracker;
mod types;

pub use convert::{
    convert_endpoint_slice, convert_service, node_pod_cidrs, ConvertError, PodCidrs, SliceEndpoints,
};
pub use dataplane::{Dataplane, DataplaneError, LocalDetector, ProxierConfig, SyncReport};
pub use names::{chain_hash, is_dns_label, is_port_name};
pub use topology::{categorize_endpoints, Categorized};
pub use tracker::{
    parse_rfc3339, ChangeSet, ChangeTracker, ProxyState, Rejected, StaleConntrack, TrackerConfig,
};
pub use types::*;
