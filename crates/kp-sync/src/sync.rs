//! The sync loop: source events -> change trackers -> dataplanes, with
//! upstream's BoundedFrequencyRunner pacing (at most one sync per minSyncPeriod
//! with a burst of 2, a resync every syncPeriod that rebuilds everything in
//! small clusters and hourly in large ones, backoff after failures).
//!
//! Every pacing decision is in [`SyncLoop::run`] and [`Pacer`]; time comes
//! from the injected [`Clock`], so tests drive it with a [`crate::ManualClock`].

use std::collections::{BTreeSet, HashMap};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

pub use kp_model::TO_BE_DELETED_TAINT;
use kp_model::{
    convert_node, ChangeTracker, Dataplane, EndpointSelection, IpFamily, ServiceName,
    ServicePortName, StaleConntrack,
};
use kp_source::SourceEvent;

use crate::clock::Clock;
use crate::conntrack::Conntrack;
use crate::programmed::ProgrammedState;
use crate::report::{ClaimEvents, SyncHealth, SyncMetrics};

/// Token bucket of upstream's BoundedFrequencyRunner.
pub struct Pacer {
    min_interval: Duration,
    burst: u32,
    tokens: f64,
    last: Instant,
}

impl Pacer {
    /// A full bucket at `now`.
    pub fn new(min_interval: Duration, burst: u32, now: Instant) -> Self {
        Pacer {
            min_interval,
            burst: burst.max(1),
            tokens: burst.max(1) as f64,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        if self.min_interval.is_zero() {
            self.tokens = self.burst as f64;
        } else {
            let add = now.duration_since(self.last).as_secs_f64() / self.min_interval.as_secs_f64();
            self.tokens = (self.tokens + add).min(self.burst as f64);
        }
        self.last = now;
    }

    /// When a sync may run (now or later).
    pub fn ready_at(&mut self, now: Instant) -> Instant {
        self.refill(now);
        if self.tokens >= 1.0 {
            now
        } else {
            now + self.min_interval.mul_f64(1.0 - self.tokens)
        }
    }

    /// Takes a token for a sync that runs now.
    pub fn take(&mut self, now: Instant) {
        self.refill(now);
        self.tokens = (self.tokens - 1.0).max(0.0);
    }
}

/// Per-Service health-check data the sync loop publishes after each sync:
/// healthCheckNodePort per Service and its local ready endpoint count.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HealthCheckData {
    pub ports: HashMap<ServiceName, u16>,
    pub local_endpoints: HashMap<ServiceName, usize>,
}

/// One IP family: its tracker and its dataplane.
pub struct FamilyProxier {
    pub tracker: ChangeTracker,
    pub dataplane: Box<dyn Dataplane>,
    /// Service ports changed since the last successful sync.
    pending: BTreeSet<ServicePortName>,
    stale: BTreeSet<StaleConntrack>,
    triggers: Vec<SystemTime>,
    needs_full: bool,
}

impl FamilyProxier {
    pub fn new(tracker: ChangeTracker, dataplane: Box<dyn Dataplane>) -> Self {
        FamilyProxier {
            tracker,
            dataplane,
            pending: BTreeSet::new(),
            stale: BTreeSet::new(),
            triggers: Vec::new(),
            needs_full: true,
        }
    }
    pub fn family(&self) -> IpFamily {
        self.tracker.family()
    }
}

/// What the families' trackers said of one object: it is reported once,
/// whatever the number of families (a rejection each family repeats, or the
/// same warning from both, is one event).
#[derive(Default)]
struct Verdict {
    rejected: Option<String>,
    warnings: Vec<String>,
}

impl Verdict {
    fn add(&mut self, r: Result<Vec<String>, kp_model::ConvertError>) {
        match r {
            Ok(ws) => {
                for w in ws {
                    if !self.warnings.contains(&w) {
                        self.warnings.push(w);
                    }
                }
            }
            Err(e) => {
                self.rejected.get_or_insert_with(|| e.to_string());
            }
        }
    }

    fn report(self, kind: &str, metrics: &dyn SyncMetrics) {
        for w in &self.warnings {
            tracing::warn!("{w}");
            metrics.invalid_field(kind);
        }
        if let Some(e) = self.rejected {
            tracing::warn!(error = %e, "skipping invalid {kind}");
            metrics.invalid_object(kind);
        }
    }
}

pub struct SyncLoop {
    /// This node's name: its Node object decides /healthz eligibility.
    pub node_name: String,
    pub families: Vec<FamilyProxier>,
    pub min_sync_period: Duration,
    pub sync_period: Duration,
    pub metrics: Box<dyn SyncMetrics>,
    pub health: Arc<dyn SyncHealth>,
    pub conntrack: Box<dyn Conntrack>,
    /// Where time comes from ([`crate::SystemClock`] outside tests).
    pub clock: Box<dyn Clock>,
    /// Receives each newly refused address claim.
    pub claim_events: Box<dyn ClaimEvents>,
    /// Receives health-check data after every sync.
    pub on_synced: Box<dyn FnMut(HealthCheckData) + Send>,
    /// Updated after each successful sync of a family with the ports it
    /// programmed (`/debug/services`, `/debug/explain`).
    pub programmed: ProgrammedState,
}

/// Above this many endpoints (all families), periodic resyncs stop rebuilding
/// the whole ruleset every syncPeriod: upstream's "large cluster mode"
/// threshold.
pub const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// How often a large cluster's ruleset is rebuilt anyway (upstream's
/// FullSyncPeriod). Between rebuilds each syncPeriod still runs a sync: the
/// canary check and any pending change.
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

impl SyncLoop {
    /// Endpoints across families, as upstream counts for large cluster mode.
    fn endpoint_count(&self) -> usize {
        self.families
            .iter()
            .map(|f| {
                f.tracker
                    .state()
                    .endpoints
                    .values()
                    .map(|e| e.len())
                    .sum::<usize>()
            })
            .sum()
    }

    /// When the next periodic full rebuild is due, counted from `now`.
    fn full_rebuild_after(&self) -> Duration {
        if self.endpoint_count() > LARGE_CLUSTER_ENDPOINTS {
            FULL_SYNC_PERIOD.max(self.sync_period)
        } else {
            self.sync_period
        }
    }

    fn apply_event(&mut self, ev: SourceEvent) -> bool {
        let now = self.clock.system_now();
        let mut changed = false;
        match ev {
            SourceEvent::ServiceApplied(svc) => {
                // Each family's tracker judges the object; it is reported
                // (logged and counted) once, not once per family.
                let mut verdict = Verdict::default();
                for f in &mut self.families {
                    let before = f.tracker.pending();
                    verdict.add(f.tracker.update_service(&svc, now).map_err(|r| r.0));
                    changed |= f.tracker.pending() != before;
                }
                verdict.report("Service", self.metrics.as_ref());
            }
            SourceEvent::ServiceDeleted { namespace, name } => {
                for f in &mut self.families {
                    f.tracker.delete_service(&namespace, &name, now);
                }
                changed = true;
            }
            SourceEvent::SliceApplied(slice) => {
                let mut verdict = Verdict::default();
                for f in &mut self.families {
                    let before = f.tracker.pending();
                    verdict.add(
                        f.tracker
                            .update_endpoint_slice(&slice, now)
                            .map_err(|r| r.0),
                    );
                    changed |= f.tracker.pending() != before;
                }
                verdict.report("EndpointSlice", self.metrics.as_ref());
            }
            SourceEvent::SliceDeleted { namespace, name } => {
                for f in &mut self.families {
                    f.tracker.delete_endpoint_slice(&namespace, &name, now);
                }
                changed = true;
            }
            SourceEvent::NodeApplied(node) => {
                if node.metadata.name.as_deref() == Some(self.node_name.as_str()) {
                    // A node being deleted or drained by the autoscaler tells load
                    // balancers to go elsewhere via /healthz, as upstream.
                    self.health
                        .set_node_eligible(!convert_node(&node).to_be_deleted);
                }
                for f in &mut self.families {
                    f.tracker.update_node(&node);
                }
                changed = true;
            }
            SourceEvent::Invalid(msg) => {
                tracing::warn!("skipping invalid object: {msg}");
                self.metrics.invalid_object("Manifest");
            }
            SourceEvent::Disconnected(why) => {
                tracing::warn!("source disconnected, keeping the programmed rules: {why}");
                self.health.set_source_connected(false);
                self.metrics.source_connected(false);
            }
            SourceEvent::Reconnected => {
                tracing::info!("source reconnected");
                self.health.set_source_connected(true);
                self.metrics.source_connected(true);
            }
            SourceEvent::Synced => {}
        }
        if changed {
            for f in &self.families {
                self.health.queued_update(f.family());
                self.metrics.queued(f.family());
            }
        }
        self.report_pending();
        changed
    }

    /// Changes not yet taken (kubeproxy_sync_proxy_rules_*_changes_pending).
    /// Every family's tracker sees every object, so the largest count is the
    /// one to show (upstream's per-family trackers set the same gauge).
    fn report_pending(&self) {
        let (mut services, mut endpoints) = (0, 0);
        for f in &self.families {
            let (s, e) = f.tracker.pending_changes();
            services = services.max(s);
            endpoints = endpoints.max(e);
        }
        self.metrics.pending_changes(services, endpoints);
    }

    /// Takes changes from every tracker and programs them. Returns false if
    /// any family failed (the caller retries with backoff).
    pub fn sync_once(&mut self, force_full: bool) -> bool {
        let mut ok = true;
        let mut hc = HealthCheckData::default();
        for f in &mut self.families {
            let fam = f.family();
            // Node addresses a host process listens on are not given to
            // Services (checked only when a Service claims one).
            let claimed = f.tracker.claimed_external_ips();
            f.tracker
                .set_host_reserved(crate::hostports::reserved(fam, &claimed));
            let cs = f.tracker.take_changes();
            self.metrics
                .changes(cs.service_changes, cs.endpoint_changes);
            if !cs.refused.is_empty() {
                let mut to_host = 0;
                for r in &cs.refused {
                    if r.holder.is_none() {
                        to_host += 1;
                    }
                    tracing::warn!(family = %fam, claim = %r, "address claim refused; the address keeps its owner");
                    self.claim_events.refused(fam, r);
                }
                self.metrics
                    .claims_refused(fam, to_host, cs.refused.len() as u64 - to_host);
            }
            f.pending.extend(cs.changed);
            f.stale.extend(cs.stale);
            f.triggers.extend(cs.trigger_times);
            if f.dataplane.rules_lost() {
                tracing::warn!(family = %fam, "our rules were removed behind our back; full resync");
                self.metrics.rules_lost(fam);
                f.needs_full = true;
            }
            let full = force_full || f.needs_full;
            let t0 = self.clock.now();
            let state = f.tracker.state();
            match f.dataplane.sync(state, &f.pending, full) {
                Ok(report) => {
                    let secs = self.clock.now().duration_since(t0).as_secs_f64();
                    tracing::info!(
                        family = %fam, full = report.full, services = state.services.len(),
                        changed = f.pending.len(), ops = report.ops, bytes = report.bytes,
                        render_ms = report.render.as_millis() as u64, apply_ms = report.apply.as_millis() as u64,
                        "synced rules"
                    );
                    self.metrics.synced(fam, &report, secs);
                    let now = self.clock.system_now();
                    for t in f.triggers.drain(..) {
                        if let Ok(d) = now.duration_since(t) {
                            self.metrics.programming_latency(fam, d.as_secs_f64());
                        }
                    }
                    self.programmed.record(state, &f.pending, report.full, now);
                    f.pending.clear();
                    f.needs_full = false;
                    self.health.updated(fam);
                    if !f.stale.is_empty() {
                        let t = self.clock.now();
                        let stale: Vec<StaleConntrack> =
                            std::mem::take(&mut f.stale).into_iter().collect();
                        let deleted = self.conntrack.delete(fam, &stale);
                        self.metrics.conntrack_reconciled(
                            fam,
                            self.clock.now().duration_since(t).as_secs_f64(),
                            deleted,
                        );
                    }
                }
                Err(e) => {
                    tracing::error!(family = %fam, error = %e, "sync failed; previous rules stay in place, retrying");
                    self.metrics.sync_failed(fam, f.dataplane.mode(), full);
                    f.needs_full = true;
                    ok = false;
                }
            }
            let state = f.tracker.state();
            for (name, sp) in &state.services {
                if sp.health_check_node_port != 0 {
                    hc.ports
                        .insert(name.service.clone(), sp.health_check_node_port);
                    let eps = state.endpoints_of(name);
                    let sel = EndpointSelection::new(sp, eps, &state.node);
                    let n = sel.local.iter().filter(|e| e.ready).count();
                    hc.local_endpoints.insert(name.service.clone(), n);
                }
            }
        }
        self.report_pending();
        (self.on_synced)(hc);
        ok
    }

    /// Runs until the event channel closes. The first sync waits for `Synced`.
    /// Syncs are paced by the min sync period and never starved: however
    /// fast events arrive, a due sync runs after at most [`DRAIN_AT_MOST`]
    /// of them.
    pub fn run(mut self, rx: Receiver<SourceEvent>) {
        let mut pacer = Pacer::new(self.min_sync_period, 2, self.clock.now());
        let mut synced = false;
        let mut dirty = false;
        // The periodic sync (canary check, pending changes) and the periodic
        // full rebuild: the same in small clusters, hourly in large ones.
        let mut next_full = self.clock.now() + self.sync_period;
        let mut next_rebuild = next_full;
        let mut retry_at: Option<Instant> = None;
        let mut synced_once = false;
        let mut failures: u32 = 0;
        loop {
            let now = self.clock.now();
            // When the next sync may run.
            let mut deadline = next_full;
            if synced && (dirty || retry_at.is_some()) {
                let mut at = pacer.ready_at(now);
                if let Some(r) = retry_at {
                    at = at.max(r);
                }
                deadline = deadline.min(at);
            }
            match self.clock.recv_until(&rx, deadline) {
                Ok(ev) => {
                    let mut apply = |ev: SourceEvent| {
                        let is_synced = matches!(ev, SourceEvent::Synced);
                        dirty |= self.apply_event(ev);
                        if is_synced && !synced {
                            synced = true;
                            dirty = true;
                            tracing::info!("sources synced; running the first sync");
                        }
                    };
                    apply(ev);
                    // Drain what is already queued before syncing, but not
                    // forever: a flood that never empties the queue must not
                    // hold syncs off (the tracker coalesces what waits).
                    for _ in 0..DRAIN_AT_MOST {
                        match rx.try_recv() {
                            Ok(ev) => apply(ev),
                            Err(_) => break,
                        }
                    }
                    // A sync that is due runs now, events queued or not.
                    let now = self.clock.now();
                    let paced = pacer.ready_at(now) <= now && retry_at.is_none_or(|r| now >= r);
                    if !(synced && (now >= next_full || (dirty && paced))) {
                        continue;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    tracing::info!("source closed; sync loop stops");
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            if !synced {
                next_full = self.clock.now() + self.sync_period;
                next_rebuild = next_full;
                continue;
            }
            let now = self.clock.now();
            let periodic = now >= next_full;
            if !(periodic || dirty || retry_at.is_some_and(|r| now >= r)) {
                continue;
            }
            let rebuild = periodic && now >= next_rebuild;
            pacer.take(now);
            let first = !synced_once;
            if self.sync_once(rebuild) {
                if first {
                    // The first sync was a full one: count the rebuild period
                    // from it, as upstream counts from its last full sync.
                    synced_once = true;
                    next_rebuild = self.clock.now() + self.full_rebuild_after();
                }
                failures = 0;
                retry_at = None;
            } else {
                failures += 1;
                // 2s, 4s, 8s ... (64s at most), capped at the sync period.
                let backoff = Duration::from_secs(1u64 << failures.min(6)).min(self.sync_period);
                retry_at = Some(self.clock.now() + backoff);
            }
            dirty = false;
            if periodic {
                next_full = self.clock.now() + self.sync_period;
            }
            if rebuild {
                next_rebuild = self.clock.now() + self.full_rebuild_after();
            } else if periodic {
                // A cluster that shrank below the threshold rebuilds on schedule again.
                next_rebuild = next_rebuild.min(self.clock.now() + self.full_rebuild_after());
            }
        }
    }
}

/// Events applied in a row before the loop checks whether a sync is due.
pub const DRAIN_AT_MOST: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pacer_allows_a_burst_of_two_then_one_per_interval() {
        let t0 = Instant::now();
        let mut p = Pacer::new(Duration::from_secs(1), 2, t0);
        assert_eq!(p.ready_at(t0), t0);
        p.take(t0);
        assert_eq!(p.ready_at(t0), t0);
        p.take(t0);
        // Bucket empty: the next sync waits one full interval.
        let next = p.ready_at(t0);
        assert!(next >= t0 + Duration::from_millis(990), "{:?}", next - t0);
        // Half an interval later, half a token: wait the other half.
        let half = t0 + Duration::from_millis(500);
        let at = p.ready_at(half);
        assert!(at > half && at <= t0 + Duration::from_millis(1010));
        // Long idle refills to the burst, not beyond.
        let later = t0 + Duration::from_secs(10);
        p.take(later);
        p.take(later);
        assert!(p.ready_at(later) > later);
    }

    #[test]
    fn zero_interval_never_waits() {
        let t0 = Instant::now();
        let mut p = Pacer::new(Duration::ZERO, 2, t0);
        for _ in 0..5 {
            p.take(t0);
            assert_eq!(p.ready_at(t0), t0);
        }
    }
}
