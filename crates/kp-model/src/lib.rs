//! The service model shared by every dataplane.
//!
//! Kubernetes objects (k8s-openapi types) are converted into [`ServicePort`]s and
//! [`Endpoint`]s per IP family (and a Node into [`NodeDetails`]), each service
//! port's endpoints are picked per traffic policy, once for every dataplane, by
//! [`EndpointSelection`], and [`ChangeTracker`] collapses any number of object
//! updates into one [`ChangeSet`] per sync. Nothing in this crate does I/O, so
//! it is tested fast and fuzzed. `testing` (feature `testing`) has builders
//! for tests; it is not part of the product's API.

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod claims;
mod convert;
mod dataplane;
pub mod explain;
mod known;
mod names;
mod rfc3339;
mod selection;
pub mod status;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod topology;
mod tracker;
mod types;

pub use claims::{AddressKey, RefusedClaim};
pub use convert::{
    convert_endpoint_slice, convert_endpoint_slice_shared, convert_node, convert_service,
    convert_service_cidr, ConvertError, NodeDetails, PodCidrs, SliceEndpoints,
    DEFAULT_LABEL_SELECTOR, HEADLESS_LABEL, SERVICE_PROXY_NAME_LABEL, TO_BE_DELETED_TAINT,
    ZONE_LABEL,
};
pub use dataplane::{
    serves_nodeports, Dataplane, DataplaneError, LocalDetector, ProxierConfig, ProxyMode,
    RefusedOp, SyncReport,
};
pub use known::{Known, Start};
pub use names::{chain_hash, is_dns_label, is_port_name};
pub use rfc3339::{format_rfc3339, parse_rfc3339};
pub use selection::{
    ClusterIpMasquerading, EndpointSelection, EndpointSet, ExternalMasquerading, NoEndpoints,
};
pub use topology::{categorize_endpoints, Categorized};
pub use tracker::{ChangeSet, ChangeTracker, ProxyState, Rejected, StaleConntrack, TrackerConfig};
pub use types::*;
