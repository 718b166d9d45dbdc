//! What the sync loop reports, as traits: the binary implements them with
//! its Prometheus registry and its health server, tests with recorders, and
//! this crate needs neither prometheus nor axum.

use kp_model::{IpFamily, SyncReport};

/// Metrics the sync loop feeds. Each call names an event; the implementation
/// decides which metric families it moves (see the binary's `metrics/mod.rs`).
pub trait SyncMetrics: Send {
    /// An object of `kind` ("Service", "EndpointSlice", "Manifest") was skipped.
    fn invalid_object(&self, kind: &str);
    /// A value in an object of `kind` was ignored (the rest of it is used).
    fn invalid_field(&self, kind: &str);
    /// A change for `family` was queued (a sync is requested).
    fn queued(&self, family: IpFamily);
    /// Changes seen and not yet taken for a sync (all families: the largest).
    fn pending_changes(&self, services: u64, endpoints: u64);
    /// Changes taken for a sync, added to the cumulative counters.
    fn changes(&self, services: u64, endpoints: u64);
    /// The canary found `family`'s rules gone.
    fn rules_lost(&self, family: IpFamily);
    /// Address claims refused this sync: lost to a host process listening
    /// there, or to another Service (kp_model::claims).
    fn claims_refused(&self, _family: IpFamily, _to_host: u64, _to_service: u64) {}
    /// `family` synced successfully in `secs`.
    fn synced(&self, family: IpFamily, report: &SyncReport, secs: f64);
    /// A change reached the kernel `secs` after its trigger time.
    fn programming_latency(&self, family: IpFamily, secs: f64);
    /// `family`'s sync failed in `mode`; `full`
    /// says whether a full sync was asked for (a partial one failed if not).
    /// A retry follows.
    fn sync_failed(&self, family: IpFamily, mode: kp_model::ProxyMode, full: bool);
    /// One stale-conntrack cleanup pass: its duration and deleted entries.
    fn conntrack_reconciled(&self, family: IpFamily, secs: f64, deleted: u64);
    /// The source lost (false) or regained (true) its connection.
    fn source_connected(&self, connected: bool);
}

/// Where each newly refused address claim goes (also counted in
/// [`SyncMetrics::claims_refused`]): the binary posts a Warning Event on the
/// Service, so its owner sees why the address does not answer.
pub trait ClaimEvents: Send {
    fn refused(&self, family: IpFamily, claim: &kp_model::RefusedClaim);
}

/// Health the sync loop reports (upstream's ProxyHealthServer updates).
pub trait SyncHealth: Send + Sync {
    /// A change for `family` arrived that is not programmed yet.
    fn queued_update(&self, family: IpFamily);
    /// `family`'s rules reflect every change queued so far.
    fn updated(&self, family: IpFamily);
    /// This node's Node is (not) eligible for load-balancer traffic.
    fn set_node_eligible(&self, eligible: bool);
    /// The source lost (false) or regained (true) its connection.
    fn set_source_connected(&self, connected: bool);
}

/// Reports nothing (for tools and tests that do not look).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoReport;

impl SyncMetrics for NoReport {
    fn invalid_object(&self, _: &str) {}
    fn invalid_field(&self, _: &str) {}
    fn queued(&self, _: IpFamily) {}
    fn pending_changes(&self, _: u64, _: u64) {}
    fn changes(&self, _: u64, _: u64) {}
    fn rules_lost(&self, _: IpFamily) {}
    fn synced(&self, _: IpFamily, _: &SyncReport, _: f64) {}
    fn programming_latency(&self, _: IpFamily, _: f64) {}
    fn sync_failed(&self, _: IpFamily, _: kp_model::ProxyMode, _: bool) {}
    fn conntrack_reconciled(&self, _: IpFamily, _: f64, _: u64) {}
    fn source_connected(&self, _: bool) {}
}

impl SyncHealth for NoReport {
    fn queued_update(&self, _: IpFamily) {}
    fn updated(&self, _: IpFamily) {}
    fn set_node_eligible(&self, _: bool) {}
    fn set_source_connected(&self, _: bool) {}
}

impl ClaimEvents for NoReport {
    fn refused(&self, _: IpFamily, _: &kp_model::RefusedClaim) {}
}
