//! The sync loop: source events -> change trackers -> dataplanes, with
//! upstream v1.36's pacing per mode (at most one sync per minSyncPeriod with
//! a burst of 2; with nothing changing, a sync hourly in iptables and
//! nftables mode and every syncPeriod in IPVS mode; full rebuilds hourly,
//! never in an iptables large cluster; a canary check every syncPeriod;
//! backoff after failures).
//!
//! Every pacing decision is [`crate::schedule::Schedule`]'s, a pure state
//! machine; time comes from the injected [`Clock`], so tests drive the
//! whole loop with a [`crate::ManualClock`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

pub use kp_model::TO_BE_DELETED_TAINT;
use kp_model::{
    convert_node, ChangeTracker, Dataplane, EndpointSelection, IpFamily, Protocol, ProxyMode,
    ServiceName, ServicePortName, StaleConntrack,
};
use kp_source::SourceEvent;

use crate::clock::Clock;
use crate::conntrack::Conntrack;
use crate::programmed::ProgrammedState;
use crate::queue::Events;
use crate::report::{ClaimEvents, SyncHealth, SyncMetrics};
use crate::schedule::{Due, Schedule};

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
    /// Refused claims go to [`SyncLoop::claim_events`] (false until the
    /// first sync has taken its changes).
    report_claims: bool,
    /// The last conntrack reconcile could not list or delete everything:
    /// the next sync reconciles whatever it changed.
    reconcile_retry: bool,
    /// Per Service port with a healthCheckNodePort: the port and its local
    /// ready endpoints, kept up to date from each sync's changes (a zone
    /// change marks every port changed), so a sync does not select the
    /// endpoints of every such Service again.
    health_checks: BTreeMap<ServicePortName, (u16, usize)>,
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
            report_claims: false,
            reconcile_retry: false,
            health_checks: BTreeMap::new(),
        }
    }
    pub fn family(&self) -> IpFamily {
        self.tracker.family()
    }

    /// Brings the health-check entries of the `changed` ports up to date
    /// with the tracker's state.
    fn update_health_checks(&mut self, changed: &BTreeSet<ServicePortName>) {
        let state = self.tracker.state();
        for name in changed {
            match state.services.get(name) {
                Some(sp) if sp.health_check_node_port != 0 => {
                    let sel = EndpointSelection::new(sp, state.endpoints_of(name), &state.node);
                    let ready = sel.local.iter().filter(|e| e.ready).count();
                    self.health_checks
                        .insert(name.clone(), (sp.health_check_node_port, ready));
                }
                _ => {
                    self.health_checks.remove(name);
                }
            }
        }
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
    /// Checks each version of this node's Node against what the rules were
    /// built from at start (its PodCIDRs, its addresses). A failed check
    /// stops the loop before the object is applied: the process exits, its
    /// rules stay, and the restart builds from the new values, as upstream.
    pub node_check: Option<NodeCheck>,
}

/// See [`SyncLoop::node_check`]: the error says what changed.
pub type NodeCheck = Box<dyn Fn(&k8s_openapi::api::core::v1::Node) -> Result<(), String> + Send>;

/// Why [`SyncLoop::run`] returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// Every source is gone (the queue closed).
    SourceClosed,
    /// [`SyncLoop::node_check`] refused this node's new Node.
    NodeChanged(String),
}

/// Above this many endpoints (all families) a cluster is large: upstream's
/// "large cluster mode" threshold. In iptables mode a large cluster is never
/// rebuilt periodically (upstream's #138571, in v1.36.2).
pub const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// Upstream's FullSyncPeriod: a sync this long after the last full one is
/// full again (iptables mode: in small clusters only). Also its sync
/// runner's longest interval in iptables and nftables mode: with nothing
/// changing they sync hourly, and only check the rules every syncPeriod.
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

    /// The mode every family runs (they all run the same one).
    fn mode(&self) -> Option<ProxyMode> {
        self.families.first().map(|f| f.dataplane.mode())
    }

    /// The longest time between two syncs, as upstream's runner for the
    /// mode: an hour in iptables and nftables mode (syncPeriod only paces
    /// their checks), syncPeriod in IPVS mode; ours' userspace mode syncs
    /// every syncPeriod too.
    fn max_interval(&self) -> Duration {
        match self.mode() {
            Some(ProxyMode::Iptables | ProxyMode::Nftables) => {
                FULL_SYNC_PERIOD.max(self.sync_period)
            }
            _ => self.sync_period,
        }
    }

    /// How long after a full sync the next sync is full again, for the mode
    /// and the cluster's size now. Upstream's iptables mode rebuilds small
    /// clusters hourly and large ones never, nftables mode every cluster
    /// hourly; each IPVS sync is the whole state (here: the periodic ones).
    /// Userspace mode (ours alone) rebuilds every syncPeriod, hourly when
    /// large.
    fn full_rebuild_after(&self) -> Option<Duration> {
        let large = self.endpoint_count() > LARGE_CLUSTER_ENDPOINTS;
        let hourly = FULL_SYNC_PERIOD.max(self.sync_period);
        match self.mode() {
            Some(ProxyMode::Iptables) if large => None,
            Some(ProxyMode::Iptables | ProxyMode::Nftables) => Some(hourly),
            Some(ProxyMode::Ipvs) => Some(self.sync_period),
            _ if large => Some(hourly),
            _ => Some(self.sync_period),
        }
    }

    /// The canary check between syncs: true when some family's rules were
    /// removed behind our back (that family's next sync is full).
    fn check_rules(&mut self) -> bool {
        let mut lost = false;
        for f in &mut self.families {
            if !f.needs_full && f.dataplane.rules_lost() {
                let fam = f.family();
                tracing::warn!(family = %fam, "our rules were removed behind our back; full resync");
                self.metrics.rules_lost(fam);
                f.needs_full = true;
                lost = true;
            }
        }
        lost
    }

    /// Applies one event; true when it changed what the trackers hold. An
    /// error is a reason to stop (see [`SyncLoop::node_check`]).
    fn apply_event(&mut self, ev: SourceEvent) -> Result<bool, String> {
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
                    if let Some(check) = &self.node_check {
                        check(&node)?;
                    }
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
            SourceEvent::ServiceCidrApplied(obj) => {
                // A change of a family's Service ranges needs a sync (the
                // dataplane rewrites what it drops); the objects change rarely.
                let mut warnings = Vec::new();
                for f in &mut self.families {
                    let (c, ws) = f.tracker.update_service_cidr(&obj);
                    changed |= c;
                    for w in ws {
                        // Both families judge the same strings: once each.
                        if !warnings.contains(&w) {
                            warnings.push(w);
                        }
                    }
                }
                for w in warnings {
                    tracing::warn!("{w}");
                    self.metrics.invalid_field("ServiceCIDR");
                }
            }
            SourceEvent::ServiceCidrDeleted { name } => {
                for f in &mut self.families {
                    changed |= f.tracker.delete_service_cidr(&name);
                }
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
        Ok(changed)
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
                    if f.report_claims {
                        self.claim_events.refused(fam, r);
                    }
                }
                self.metrics
                    .claims_refused(fam, to_host, cs.refused.len() as u64 - to_host);
            }
            // Claims refused when the proxy starts were reported when they
            // arose; a rollout reporting them again would be an Event per
            // node per conflict on the API server.
            f.report_claims = true;
            f.update_health_checks(&cs.changed);
            f.pending.extend(cs.changed);
            f.stale.extend(cs.stale);
            f.triggers.extend(cs.trigger_times);
            if !f.needs_full && f.dataplane.rules_lost() {
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
                    let udp_changed = f.pending.iter().any(|n| n.protocol == Protocol::Udp);
                    f.pending.clear();
                    f.needs_full = false;
                    self.health.updated(fam);
                    let stale: Vec<StaleConntrack> =
                        std::mem::take(&mut f.stale).into_iter().collect();
                    let t = self.clock.now();
                    let deleted =
                        if report.full || udp_changed || !stale.is_empty() || f.reconcile_retry {
                            // Userspace mode answers on Service IPs itself:
                            // its own flows are not NATed.
                            let serves_locally = f.dataplane.mode() == ProxyMode::Userspace;
                            let (deleted, retry) = reconcile_conntrack(
                                self.conntrack.as_mut(),
                                fam,
                                state,
                                &stale,
                                serves_locally,
                            );
                            f.reconcile_retry = retry;
                            if retry {
                                // The tracker's filters (ports that went
                                // away) are tried again too.
                                f.stale.extend(stale);
                            }
                            deleted
                        } else {
                            None
                        };
                    if let Some(deleted) = deleted {
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
            for (name, (port, ready)) in &f.health_checks {
                hc.ports.insert(name.service.clone(), *port);
                hc.local_endpoints.insert(name.service.clone(), *ready);
            }
        }
        self.report_pending();
        (self.on_synced)(hc);
        ok
    }

    /// Runs until the event queue closes, or until [`SyncLoop::node_check`]
    /// refuses this node's Node. The first sync waits for `Synced`. Syncs
    /// are paced by the min sync period and never starved: however fast
    /// events arrive, a due sync runs after at most [`DRAIN_AT_MOST`] of
    /// them.
    pub fn run(mut self, mut rx: Events) -> Stop {
        let mut schedule = Schedule::new(
            self.min_sync_period,
            self.sync_period,
            self.max_interval(),
            self.clock.now(),
        );
        loop {
            let deadline = schedule.deadline(self.clock.now());
            match self.clock.recv_until(&mut rx, deadline) {
                Ok(ev) => {
                    let mut apply = |ev: SourceEvent| -> Result<(), String> {
                        let is_synced = matches!(ev, SourceEvent::Synced);
                        let changed = self.apply_event(ev)?;
                        if schedule.events(changed, is_synced) {
                            tracing::info!("sources synced; running the first sync");
                        }
                        Ok(())
                    };
                    let mut applied = apply(ev);
                    // Drain what is already queued before syncing, but not
                    // forever: a flood that never empties the queue must not
                    // hold syncs off (the tracker coalesces what waits).
                    for _ in 0..DRAIN_AT_MOST {
                        if applied.is_err() {
                            break;
                        }
                        match rx.try_recv() {
                            Ok(ev) => applied = apply(ev),
                            Err(_) => break,
                        }
                    }
                    if let Err(why) = applied {
                        tracing::warn!("{why}: stopping; the programmed rules stay");
                        return Stop::NodeChanged(why);
                    }
                    // A sync that is due runs now, events queued or not.
                    if !schedule.due(self.clock.now()) {
                        continue;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    tracing::info!("source closed; sync loop stops");
                    return Stop::SourceClosed;
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            match schedule.next(self.clock.now()) {
                None => {}
                Some(Due::Check) => {
                    let lost = self.check_rules();
                    schedule.checked(self.clock.now(), lost);
                }
                Some(Due::Sync(planned)) => {
                    let ok = self.sync_once(planned.rebuild);
                    schedule.finished(planned, ok, self.clock.now(), self.full_rebuild_after());
                }
            }
        }
    }
}

/// Deletes the UDP flows of `family` that are stale for `state` or selected
/// by `filters` (one dump, [`crate::reconcile`] decides). Returns how many
/// went (None when the dump failed: nothing to report, as upstream) and
/// whether the next sync must try again (the dump failed, or some delete
/// did).
fn reconcile_conntrack(
    ct: &mut dyn Conntrack,
    family: IpFamily,
    state: &kp_model::ProxyState,
    filters: &[StaleConntrack],
    serves_locally: bool,
) -> (Option<u64>, bool) {
    let flows = match ct.list_udp(family) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(family = %family, error = %e, "listing conntrack entries failed; the next sync tries again");
            return (None, true);
        }
    };
    let listed = flows.len();
    let stale = crate::reconcile::stale_flows(state, filters, flows, serves_locally);
    if stale.is_empty() {
        tracing::debug!(family = %family, listed, "conntrack reconciled: nothing stale");
        return (Some(0), false);
    }
    let done = ct.delete_flows(family, &stale);
    tracing::info!(family = %family, listed, stale = stale.len(), deleted = done.deleted, failed = done.failed, "conntrack reconciled");
    (Some(done.deleted), done.failed > 0)
}

/// Events applied in a row before the loop checks whether a sync is due.
pub const DRAIN_AT_MOST: usize = 4096;
