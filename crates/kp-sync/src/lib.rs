//! The sync loop of kube-proxy-rs: source events -> change trackers ->
//! dataplanes, paced as upstream's BoundedFrequencyRunner, then the stale
//! UDP conntrack cleanup.
//!
//! * [`SyncLoop`] / [`FamilyProxier`]: `sync.rs`, the loop itself.
//! * [`Schedule`] / [`Pacer`]: `schedule.rs`, every pacing decision (when
//!   the next sync runs, whether it is full), a pure state machine.
//! * [`event_queue`]: the one bounded queue from the sources to the loop.
//! * [`Clock`]: where time comes from; [`ManualClock`] makes the pacing
//!   testable without sleeping.
//! * [`SyncMetrics`] / [`SyncHealth`]: what the loop reports; the binary
//!   implements them (Prometheus, the health server).
//! * [`ProgrammedState`]: what the last successful sync programmed, for
//!   the binary's debug endpoints.
//! * [`conntrack`]: listing and deleting UDP flows (ctnetlink, or `conntrack`);
//!   [`reconcile`]: which of them are stale (pure), run after each sync that
//!   touched a UDP Service, each full sync, and after a failed delete.
//!
//! No dataplane crate is a dependency: dataplanes come in as
//! `Box<dyn kp_model::Dataplane>`.

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod clock;
pub mod conntrack;
pub mod hostports;
pub mod programmed;
pub mod queue;
pub mod reconcile;
pub mod report;
pub mod schedule;
pub mod sync;

pub use clock::{Clock, ManualClock, SystemClock};
pub use conntrack::{Conntrack, ConntrackCli, ConntrackError, ConntrackNetlink, Deleted, Flow};
pub use programmed::{Programmed, ProgrammedFamily, ProgrammedState};
pub use queue::{event_queue, EventSender, Events, EVENT_QUEUE};
pub use report::{ClaimEvents, NoReport, SyncHealth, SyncMetrics};
pub use schedule::{Due, Pacer, Planned, Schedule};
pub use sync::{
    FamilyProxier, HealthCheckData, NodeCheck, Stop, SyncLoop, DRAIN_AT_MOST, FULL_SYNC_PERIOD,
    LARGE_CLUSTER_ENDPOINTS, TO_BE_DELETED_TAINT,
};
