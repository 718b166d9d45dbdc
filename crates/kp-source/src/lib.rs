//! Sources of Services, EndpointSlices, this node's Node object and the
//! cluster's ServiceCIDRs.
//!
//! Every source sends [`SourceEvent`]s on a tokio mpsc channel; the sync loop
//! feeds them to the model's change tracker. A source never flushes anything by
//! itself: after a relist it sends deletions only for objects that really went away.

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;

pub mod api;
pub mod codec;
pub mod connection;
pub mod listwatch;
pub mod manifest;
pub mod objects;
pub mod reflector;
pub mod service;

pub use api::{
    label_selector, list_node, run_api_source, run_api_source_from, ApiSourceOptions, NodeListed,
    DEFAULT_LABEL_SELECTOR,
};
pub use manifest::{load_dir, run_manifest_source, Loaded, ObjectKey};
pub use reflector::Encoding;

/// Why a source could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The manifest directory could not be listed.
    #[error("cannot read manifest directory {path}: {source}")]
    ReadDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A manifest file could not be read.
    #[error("cannot read manifest file {path}: {source}")]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The merged API watch streams ended, which they never do on their own.
    #[error("API watch streams ended unexpectedly")]
    WatchEnded,
    /// Listing this node's Node failed.
    #[error("listing Node {node}: {source}")]
    ListNode {
        node: String,
        #[source]
        source: Box<reflector::ReflectError>,
    },
    /// A service proxy name that is not a label value (`--service-proxy-name`).
    #[error("{0:?} is not a valid label value (at most 63 characters: letters, digits, '-', '_', '.', starting and ending with a letter or digit)")]
    InvalidProxyName(String),
}

/// One change seen by a source.
#[derive(Debug, Clone)]
pub enum SourceEvent {
    ServiceApplied(Box<Service>),
    ServiceDeleted {
        namespace: String,
        name: String,
    },
    SliceApplied(Box<EndpointSlice>),
    SliceDeleted {
        namespace: String,
        name: String,
    },
    NodeApplied(Box<Node>),
    /// A ServiceCIDR (networking.k8s.io/v1): the cluster's Service ranges.
    ServiceCidrApplied(Box<ServiceCIDR>),
    ServiceCidrDeleted {
        name: String,
    },
    /// Services and EndpointSlices have both been listed once: the first sync may
    /// run (upstream waits for both informers to sync).
    Synced,
    /// The source lost its connection (API server unreachable, watch error);
    /// the last programmed rules stay in place.
    Disconnected(String),
    /// The source is connected again.
    Reconnected,
    /// A manifest document or object that could not be parsed: skipped.
    Invalid(String),
}
