//! Test-only helpers for kube-proxy-rs. Nothing here is part of the product.
//!
//! [`apiserver`] is an in-process Kubernetes API server that speaks the real
//! list/watch protocol for Services, EndpointSlices, Nodes and Events, with
//! controls to compact history, cut watches and simulate an outage.
//!
//! [`netns`] runs that server inside a network namespace of the lab.
//!
//! [`updates`]: random Service and EndpointSlice update sequences for the
//! partial = full property tests.
//!
//! [`control_plane`] runs the real thing: etcd and kube-apiserver v1.36 with
//! TLS, tokens and RBAC, for the tests that must hold against what clusters
//! run (and for the differential runs against upstream kube-proxy).

pub mod apiserver;
pub mod control_plane;
pub mod netns;
pub mod objects;
pub mod prom;
pub mod updates;

pub use apiserver::{ApiCall, ApiServer, WatchLog};
pub use control_plane::{
    ControlPlane, ControlPlaneError, ControlPlaneOpts, K8sBinaries, REQUIRE_ENV,
};
pub use netns::{NetnsApiError, NetnsApiServer};
