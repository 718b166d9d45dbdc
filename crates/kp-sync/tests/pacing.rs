//! The sync loop's pacing, upstream's BoundedFrequencyRunner rules, on a
//! virtual clock ([`ManualClock`]): no test sleeps, an hour of resyncs runs
//! in milliseconds. A fake dataplane records every sync: when, full or not,
//! how many service ports changed.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use kp_testkit::objects;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_model::{
    ChangeTracker, Dataplane, DataplaneError, IpFamily, ProxyMode, ProxyState, ServicePortName,
    StaleConntrack, SyncReport, TrackerConfig,
};
use kp_source::SourceEvent;
use kp_sync::{
    Conntrack, FamilyProxier, HealthCheckData, ManualClock, NoReport, ProgrammedState, SyncLoop,
    SyncMetrics, FULL_SYNC_PERIOD,
};
use serde_json::json;

#[derive(Clone, Debug, PartialEq)]
struct Call {
    at: Duration,
    full: bool,
    changed: usize,
    ok: bool,
}

#[derive(Clone, Default)]
struct Record {
    calls: Arc<Mutex<Vec<Call>>>,
    /// Fail this many of the next syncs.
    fail: Arc<AtomicU32>,
    /// The canary reports the rules gone (until the next sync).
    lost: Arc<AtomicBool>,
    /// The rules go right after this many syncs (0: never).
    lose_after: Arc<AtomicU32>,
    /// Canary checks so far.
    checks: Arc<AtomicU32>,
}

impl Record {
    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }
}

struct FakeDataplane {
    clock: ManualClock,
    rec: Record,
    mode: ProxyMode,
}

impl Dataplane for FakeDataplane {
    fn mode(&self) -> ProxyMode {
        self.mode
    }
    fn rules_lost(&mut self) -> bool {
        self.rec.checks.fetch_add(1, Ordering::SeqCst);
        self.rec.lost.load(Ordering::SeqCst)
    }
    fn sync(
        &mut self,
        _state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        let ok = self
            .rec
            .fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_err();
        self.rec.calls.lock().unwrap().push(Call {
            at: self.clock.elapsed(),
            full,
            changed: changed.len(),
            ok,
        });
        let n = self.rec.calls.lock().unwrap().len() as u32;
        let lose = self.rec.lose_after.load(Ordering::SeqCst) == n;
        if ok || lose {
            self.rec.lost.store(lose, Ordering::SeqCst);
        }
        if ok {
            Ok(SyncReport {
                full,
                ..Default::default()
            })
        } else {
            Err(DataplaneError::Unsupported("injected failure".into()))
        }
    }
    fn render(&self, _state: &ProxyState) -> String {
        String::new()
    }
    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        Ok(())
    }
}

struct NoConntrack;
impl Conntrack for NoConntrack {
    fn delete(&mut self, _: IpFamily, _: &[StaleConntrack]) -> u64 {
        0
    }
    fn list_udp(&mut self, _: IpFamily) -> Result<Vec<kp_sync::Flow>, kp_sync::ConntrackError> {
        Ok(Vec::new())
    }
    fn delete_flows(&mut self, _: IpFamily, _: &[kp_sync::Flow]) -> kp_sync::Deleted {
        kp_sync::Deleted::default()
    }
}

/// Records what the metrics side hears about failures and pending changes.
#[derive(Clone, Default)]
struct Metrics {
    invalid: Arc<Mutex<Vec<String>>>,
    failed: Arc<Mutex<Vec<(String, bool)>>>,
    pending: Arc<Mutex<Vec<(u64, u64)>>>,
    connected: Arc<Mutex<Vec<bool>>>,
}

impl SyncMetrics for Metrics {
    fn invalid_object(&self, kind: &str) {
        self.invalid.lock().unwrap().push(kind.to_string());
    }
    fn invalid_field(&self, _: &str) {}
    fn queued(&self, _: IpFamily) {}
    fn pending_changes(&self, s: u64, e: u64) {
        self.pending.lock().unwrap().push((s, e));
    }
    fn changes(&self, _: u64, _: u64) {}
    fn rules_lost(&self, _: IpFamily) {}
    fn synced(&self, _: IpFamily, _: &SyncReport, _: f64) {}
    fn programming_latency(&self, _: IpFamily, _: f64) {}
    fn sync_failed(&self, _: IpFamily, mode: kp_model::ProxyMode, full: bool) {
        self.failed.lock().unwrap().push((mode.to_string(), full));
    }
    fn conntrack_reconciled(&self, _: IpFamily, _: f64, _: u64) {}
    fn source_connected(&self, c: bool) {
        self.connected.lock().unwrap().push(c);
    }
}

/// A loop with one IPv4 family on a fake iptables-mode dataplane, its
/// virtual clock and the receiver it reads (events are scheduled on the
/// clock).
fn start(
    min_sync: Duration,
    sync: Duration,
) -> (SyncLoop, ManualClock, kp_sync::Events, Record, Metrics) {
    start_mode(ProxyMode::Iptables, min_sync, sync)
}

/// [`start`] with a dataplane of `mode`.
fn start_mode(
    mode: ProxyMode,
    min_sync: Duration,
    sync: Duration,
) -> (SyncLoop, ManualClock, kp_sync::Events, Record, Metrics) {
    let (clock, rx) = ManualClock::new();
    let rec = Record::default();
    let metrics = Metrics::default();
    let tracker = ChangeTracker::new(TrackerConfig {
        family: IpFamily::V4,
        node_name: "node1".into(),
        service_proxy_name: None,
    });
    let dp = FakeDataplane {
        clock: clock.clone(),
        rec: rec.clone(),
        mode,
    };
    let lp = SyncLoop {
        node_name: "node1".into(),
        families: vec![FamilyProxier::new(tracker, Box::new(dp))],
        min_sync_period: min_sync,
        sync_period: sync,
        metrics: Box::new(metrics.clone()),
        health: Arc::new(NoReport),
        claim_events: Box::new(NoReport),
        conntrack: Box::new(NoConntrack),
        clock: Box::new(clock.clone()),
        on_synced: Box::new(|_| {}),
        programmed: ProgrammedState::new(),
        node_check: None,
    };
    (lp, clock, rx, rec, metrics)
}

/// Runs the loop on `clock`'s schedule until the channel closes at `end`.
fn run(lp: SyncLoop, clock: &ManualClock, rx: kp_sync::Events, end: Duration) {
    clock.end_at(end);
    assert_eq!(lp.run(rx), kp_sync::Stop::SourceClosed);
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn service(name: &str, n: u32) -> SourceEvent {
    let svc = objects::service("ns1", name)
        .cluster_ip(&format!("10.96.{}.{}", n / 250, n % 250 + 1))
        .port_json(json!({"name": "p80", "port": 80}))
        .build();
    SourceEvent::ServiceApplied(Box::new(svc))
}

/// Slice `name` of Service `svc` with `count` ready endpoints from 10.(first).x.y.
fn slice(svc: &str, name: &str, first: u32, count: u32) -> SourceEvent {
    let s = (0..count)
        .fold(objects::slice("ns1", name, svc), |b, i| {
            b.endpoint_on(
                &format!("10.{}.{}.{}", first, i / 250, i % 250 + 1),
                "node2",
            )
        })
        .port("p80", 80, "TCP")
        .build();
    SourceEvent::SliceApplied(Box::new(s))
}

fn times(calls: &[Call]) -> Vec<Duration> {
    calls.iter().map(|c| c.at).collect()
}

fn close(a: Duration, b: Duration) -> bool {
    a.abs_diff(b) <= ms(1)
}

#[test]
fn no_sync_before_synced() {
    let (lp, clock, rx, rec, _) = start(secs(1), secs(30));
    clock.at(ms(0), service("a", 1));
    clock.at(secs(10), service("b", 2));
    // Well past several sync periods: nothing is programmed without Synced.
    clock.at(secs(100), SourceEvent::Synced);
    run(lp, &clock, rx, secs(101));
    let calls = rec.calls();
    assert_eq!(
        calls,
        vec![Call {
            at: secs(100),
            full: true,
            changed: 2,
            ok: true
        }]
    );
}

#[test]
fn no_sync_at_all_without_synced() {
    let (lp, clock, rx, rec, _) = start(secs(1), secs(30));
    clock.at(ms(0), service("a", 1));
    run(lp, &clock, rx, secs(300));
    assert!(rec.calls().is_empty(), "{:?}", rec.calls());
}

#[test]
fn source_connection_is_reported_to_metrics() {
    let (lp, clock, rx, _, metrics) = start(secs(1), secs(30));
    clock.at(ms(0), SourceEvent::Synced);
    clock.at(secs(2), SourceEvent::Disconnected("refused".into()));
    clock.at(secs(9), SourceEvent::Reconnected);
    run(lp, &clock, rx, secs(10));
    assert_eq!(*metrics.connected.lock().unwrap(), vec![false, true]);
}

#[test]
fn events_queued_together_make_one_sync() {
    let (lp, clock, rx, rec, _) = start(secs(1), secs(30));
    clock.at(ms(0), SourceEvent::Synced);
    for i in 0..50 {
        clock.at(secs(5), service(&format!("s{i}"), i));
    }
    run(lp, &clock, rx, secs(6));
    let calls = rec.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!((calls[1].at, calls[1].changed), (secs(5), 50));
}

#[test]
fn a_flood_of_events_never_starves_syncs() {
    // The loop is far behind a flood: the queue is full (Synced and then
    // changes 1 ms apart) before it reads any, and a trickle follows. It
    // must not wait for the queue to empty before syncing.
    let (lp, clock, rx, rec, _) = start(secs(1), secs(3600));
    let tx = clock.sender().unwrap();
    let flood = kp_sync::EVENT_QUEUE - 1;
    tx.try_send(SourceEvent::Synced).unwrap();
    for i in 0..flood as u32 {
        clock.advance(ms(1));
        tx.try_send(service(&format!("s{i}"), i)).unwrap();
    }
    // Bounded: one more waits for the loop.
    assert!(tx.try_send(SourceEvent::Synced).is_err());
    drop(tx);
    let after = clock.elapsed();
    for j in 0..100u32 {
        let i = flood as u32 + j;
        clock.at(
            after + ms(10 * (j as u64 + 1)),
            service(&format!("s{i}"), i),
        );
    }
    run(lp, &clock, rx, secs(30));
    let calls = rec.calls();
    assert!(calls.len() >= 2, "{calls:?}");
    // The first sync ran after at most DRAIN_AT_MOST more events (without
    // the bound: one sync, after the whole queue).
    assert!(
        calls[0].changed <= kp_sync::DRAIN_AT_MOST + 1,
        "the first sync waited for the flood: {calls:?}"
    );
    assert_eq!(calls.iter().map(|c| c.changed).sum::<usize>(), flood + 100);
    // Paced all the same: a burst of two, then one per min sync period.
    assert!(
        calls.len() >= 3 && calls[2].at >= calls[1].at + secs(1),
        "{calls:?}"
    );
}

/// A change of this node's Node that the rules cannot follow (its
/// PodCIDRs, say) stops the loop before the object is applied: the process
/// exits and restarts with the new values, as upstream's does.
#[test]
fn a_refused_node_stops_the_loop_before_it_is_applied() {
    let (mut lp, clock, rx, rec, _) = start(secs(1), secs(3600));
    lp.node_check = Some(Box::new(|n: &k8s_openapi::api::core::v1::Node| {
        match n.spec.as_ref().and_then(|s| s.pod_cidr.as_deref()) {
            Some("10.244.9.0/24") => Err("node node1: podCIDR changed".to_string()),
            _ => Ok(()),
        }
    }));
    let node = |cidr: &str| {
        SourceEvent::NodeApplied(Box::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "node1"},
                "spec": {"podCIDR": cidr},
            }))
            .unwrap(),
        ))
    };
    clock.at(ms(0), SourceEvent::Synced);
    clock.at(ms(10), node("10.244.1.0/24"));
    clock.at(ms(5000), node("10.244.9.0/24"));
    clock.at(ms(5000), service("after", 1));
    clock.end_at(secs(60));
    let stop = lp.run(rx);
    assert_eq!(
        stop,
        kp_sync::Stop::NodeChanged("node node1: podCIDR changed".into())
    );
    // Stopped at the refused Node: nothing after it was synced, and the
    // clock did not run on to the end.
    assert!(clock.elapsed() < secs(6), "{:?}", clock.elapsed());
    assert!(
        rec.calls().iter().all(|c| c.at < ms(5000)),
        "{:?}",
        rec.calls()
    );
}

#[test]
fn min_sync_period_allows_a_burst_of_two_then_one_per_period() {
    let (lp, clock, rx, rec, _) = start(secs(1), secs(30));
    clock.at(ms(0), SourceEvent::Synced);
    // A storm: a change every 100 ms for 3.5 s.
    for i in 1..=35u32 {
        clock.at(ms(100 * i as u64), service(&format!("s{i}"), i));
    }
    run(lp, &clock, rx, secs(5));
    let got = times(&rec.calls());
    // The first sync and the first change run at once (burst of 2); then
    // one sync per minSyncPeriod while the storm lasts, and the last change
    // is programmed one period after the previous sync.
    let want = [ms(0), ms(100), ms(1000), ms(2000), ms(3000), ms(4000)];
    assert_eq!(got.len(), want.len(), "{got:?}");
    for (g, w) in got.iter().zip(want) {
        assert!(close(*g, w), "{got:?}");
    }
    // Every change was programmed exactly once.
    let changed: usize = rec.calls().iter().skip(1).map(|c| c.changed).sum();
    assert_eq!(changed, 35);
    // After a quiet period the bucket is full again: two syncs at once.
    let (lp, clock, rx, rec, _) = start(secs(1), secs(30));
    clock.at(ms(0), SourceEvent::Synced);
    clock.at(secs(10), service("x", 1));
    clock.at(secs(10) + ms(1), service("y", 2));
    clock.at(secs(10) + ms(2), service("z", 3));
    run(lp, &clock, rx, secs(12));
    let got = times(&rec.calls());
    assert_eq!(got.len(), 4, "{got:?}");
    assert!(
        close(got[1], secs(10)) && close(got[2], secs(10) + ms(1)),
        "{got:?}"
    );
    assert!(close(got[3], secs(11)), "{got:?}");
}

#[test]
fn zero_min_sync_period_syncs_every_change() {
    let (lp, clock, rx, rec, _) = start(Duration::ZERO, secs(30));
    clock.at(ms(0), SourceEvent::Synced);
    for i in 1..=10u32 {
        clock.at(ms(10 * i as u64), service(&format!("s{i}"), i));
    }
    run(lp, &clock, rx, secs(1));
    assert_eq!(rec.calls().len(), 11, "{:?}", rec.calls());
}

/// (seconds, full) of each sync.
fn summary(rec: &Record) -> Vec<(u64, bool)> {
    rec.calls()
        .iter()
        .map(|c| (c.at.as_secs(), c.full))
        .collect()
}

/// Runs `mode` with one Service of `endpoints` endpoints (1,200: a large
/// cluster) and nothing changing for `end`.
fn idle(mode: ProxyMode, endpoints: u32, end: Duration) -> Record {
    let (lp, clock, rx, rec, _) = start_mode(mode, secs(1), secs(30));
    clock.at(ms(0), service("a", 1));
    let first = endpoints.min(600);
    clock.at(ms(0), slice("a", "a-1", 1, first));
    if endpoints > first {
        clock.at(ms(0), slice("a", "a-2", 2, endpoints - first));
    }
    clock.at(ms(0), SourceEvent::Synced);
    run(lp, &clock, rx, end);
    rec
}

/// Upstream v1.36.2's iptables mode with nothing changing: its runner's
/// longest interval is an hour, and the hourly sync is full in a small
/// cluster; every syncPeriod between, only the canary is checked.
#[test]
fn iptables_small_cluster_syncs_hourly_in_full_and_checks_every_period() {
    let end = FULL_SYNC_PERIOD * 2 + secs(65);
    let rec = idle(ProxyMode::Iptables, 10, end);
    assert_eq!(
        summary(&rec),
        vec![(0, true), (3600, true), (7200, true)],
        "{:?}",
        rec.calls()
    );
    assert!(rec.calls()[1..].iter().all(|c| c.changed == 0));
    // A check every 30 s: by itself between syncs, within the sync at the
    // hours (the first sync is full anyway).
    let checks = rec.checks.load(Ordering::SeqCst) as u64;
    assert_eq!(checks, end.as_secs() / 30, "canary checks");
}

/// In a large cluster upstream's iptables mode (#138571) never rebuilds
/// periodically: the hourly sync is partial.
#[test]
fn iptables_large_cluster_is_never_rebuilt_periodically() {
    let rec = idle(ProxyMode::Iptables, 1200, FULL_SYNC_PERIOD * 2 + secs(65));
    assert_eq!(summary(&rec), vec![(0, true), (3600, false), (7200, false)]);
}

/// nftables mode rebuilds hourly whatever the cluster's size.
#[test]
fn nftables_rebuilds_hourly_at_any_size() {
    for endpoints in [10, 1200] {
        let rec = idle(
            ProxyMode::Nftables,
            endpoints,
            FULL_SYNC_PERIOD * 2 + secs(65),
        );
        assert_eq!(
            summary(&rec),
            vec![(0, true), (3600, true), (7200, true)],
            "{endpoints} endpoints"
        );
    }
}

/// IPVS mode's runner syncs every syncPeriod, and each of its syncs is the
/// whole state: every periodic sync here is full, at any size.
#[test]
fn ipvs_syncs_every_period_in_full() {
    for endpoints in [10, 1200] {
        let rec = idle(ProxyMode::Ipvs, endpoints, secs(125));
        assert_eq!(
            summary(&rec),
            vec![(0, true), (30, true), (60, true), (90, true), (120, true)],
            "{endpoints} endpoints"
        );
    }
}

/// An iptables cluster that shrinks below the threshold is rebuilt again
/// once an hour has passed since its last full sync.
#[test]
fn a_cluster_that_shrinks_is_rebuilt_hourly_again() {
    let (lp, clock, rx, rec, _) = start(secs(1), secs(30));
    clock.at(ms(0), service("big", 1));
    clock.at(ms(0), slice("big", "big-1", 1, 600));
    clock.at(ms(0), slice("big", "big-2", 2, 600));
    clock.at(ms(0), SourceEvent::Synced);
    clock.at(
        secs(45),
        SourceEvent::SliceDeleted {
            namespace: "ns1".into(),
            name: "big-2".into(),
        },
    );
    run(lp, &clock, rx, FULL_SYNC_PERIOD + secs(100));
    // The change's sync is partial; the hourly sync after it (an hour after
    // the last sync) is full, the cluster being small now.
    assert_eq!(summary(&rec), vec![(0, true), (45, false), (3645, true)]);
}

/// Rules removed behind our back are found by the check every syncPeriod,
/// not an hour later: the next sync is full.
#[test]
fn lost_rules_are_found_between_syncs() {
    let (lp, clock, rx, rec, _) = start(secs(1), secs(30));
    clock.at(ms(0), service("a", 1));
    clock.at(ms(0), SourceEvent::Synced);
    // The rules go right after the sync for a change at 100 s (partial);
    // the check 30 s later finds it.
    rec.lose_after.store(2, Ordering::SeqCst);
    clock.at(secs(100), service("b", 2));
    run(lp, &clock, rx, secs(200));
    assert_eq!(summary(&rec), vec![(0, true), (100, false), (130, true)]);
}

#[test]
fn a_failed_sync_backs_off_then_syncs_in_full() {
    let (lp, clock, rx, rec, metrics) = start(secs(1), secs(30));
    rec.fail.store(3, Ordering::SeqCst);
    clock.at(ms(0), service("a", 1));
    clock.at(ms(0), SourceEvent::Synced);
    // A change once the rules are in place: partial; it fails once.
    clock.at(secs(20), service("b", 2));
    run(lp, &clock, rx, secs(25));
    let calls = rec.calls();
    let summary: Vec<(u64, bool, bool)> = calls
        .iter()
        .map(|c| (c.at.as_secs(), c.full, c.ok))
        .collect();
    assert_eq!(
        &summary[..4],
        // 2 s, 4 s, 8 s between attempts; every retry is full.
        [
            (0, true, false),
            (2, true, false),
            (6, true, false),
            (14, true, true)
        ]
    );
    assert_eq!(calls[3].changed, 1);
    // Then partial syncs again.
    assert_eq!(summary[4], (20, false, true));
    assert_eq!(
        *metrics.failed.lock().unwrap(),
        vec![
            ("iptables".to_string(), true),
            ("iptables".to_string(), true),
            ("iptables".to_string(), true)
        ]
    );
}

#[test]
fn a_failed_partial_sync_is_reported_and_retried_in_full() {
    let (lp, clock, rx, rec, metrics) = start(secs(1), secs(30));
    clock.at(ms(0), service("a", 1));
    clock.at(ms(0), SourceEvent::Synced);
    clock.at(secs(10), service("b", 2));
    // The sync for the change at 10 s fails (the first one succeeds).
    let fail = rec.fail.clone();
    let calls = rec.calls.clone();
    run_with_failure_after(lp, &clock, rx, &rec, 1);
    let got: Vec<(u64, bool, bool, usize)> = calls
        .lock()
        .unwrap()
        .iter()
        .map(|c| (c.at.as_secs(), c.full, c.ok, c.changed))
        .collect();
    assert_eq!(
        &got[..3],
        [
            (0, true, true, 1),
            (10, false, false, 1),
            (12, true, true, 1)
        ]
    );
    assert_eq!(fail.load(Ordering::SeqCst), 0);
    assert_eq!(
        *metrics.failed.lock().unwrap(),
        vec![("iptables".to_string(), false)]
    );
}

/// Runs the loop; the dataplane fails once after `ok_first` successful syncs.
fn run_with_failure_after(
    lp: SyncLoop,
    clock: &ManualClock,
    rx: kp_sync::Events,
    rec: &Record,
    ok_first: usize,
) {
    // Arm the failure from inside the dataplane's recording: wrap the loop's
    // single family.
    let mut lp = lp;
    let f = lp.families.pop().unwrap();
    let inner = f.dataplane;
    let tracker = f.tracker;
    struct Arming {
        inner: Box<dyn Dataplane>,
        rec: Record,
        ok_first: usize,
    }
    impl Dataplane for Arming {
        fn mode(&self) -> kp_model::ProxyMode {
            self.inner.mode()
        }
        fn sync(
            &mut self,
            s: &ProxyState,
            c: &BTreeSet<ServicePortName>,
            full: bool,
        ) -> Result<SyncReport, DataplaneError> {
            if self.rec.calls().len() == self.ok_first {
                self.rec.fail.store(1, Ordering::SeqCst);
            }
            self.inner.sync(s, c, full)
        }
        fn render(&self, s: &ProxyState) -> String {
            self.inner.render(s)
        }
        fn cleanup(&mut self) -> Result<(), DataplaneError> {
            self.inner.cleanup()
        }
    }
    lp.families.push(FamilyProxier::new(
        tracker,
        Box::new(Arming {
            inner,
            rec: rec.clone(),
            ok_first,
        }),
    ));
    run(lp, clock, rx, secs(20));
}

#[test]
fn backoff_is_capped_at_the_sync_period() {
    let (lp, clock, rx, rec, _) = start(secs(1), secs(5));
    rec.fail.store(u32::MAX, Ordering::SeqCst);
    clock.at(ms(0), service("a", 1));
    clock.at(ms(0), SourceEvent::Synced);
    run(lp, &clock, rx, secs(30));
    let got: Vec<u64> = rec
        .calls()
        .iter()
        .map(|c| c.at.as_millis() as u64)
        .collect();
    // 2 s, 4 s, then never more than the 5 s sync period apart.
    assert_eq!(&got[..6], [0, 2000, 6000, 11000, 16000, 21000], "{got:?}");
}

#[test]
fn pending_changes_are_reported_until_taken() {
    let (lp, clock, rx, _, metrics) = start(secs(1), secs(30));
    clock.at(ms(0), SourceEvent::Synced);
    clock.at(secs(5), service("a", 1));
    clock.at(secs(5), slice("a", "a-1", 1, 3));
    run(lp, &clock, rx, secs(6));
    let p = metrics.pending.lock().unwrap().clone();
    assert!(p.contains(&(1, 0)) && p.contains(&(1, 1)), "{p:?}");
    assert_eq!(p.last(), Some(&(0, 0)), "{p:?}");
}

/// The snapshot the debug endpoints read holds what the last successful
/// sync programmed: nothing while syncs fail, then each port as it is
/// programmed, with the kind of the last sync.
#[test]
fn programmed_snapshot_follows_successful_syncs_only() {
    let names = |p: &ProgrammedState| -> Vec<String> {
        p.read()
            .family(IpFamily::V4)
            .map(|f| f.state.services.keys().map(|k| k.to_string()).collect())
            .unwrap_or_default()
    };
    // Service a with 2 endpoints; the first 3 syncs fail (at 0, 2 and 6 s),
    // the retry at 14 s succeeds; Service b arrives at 20 s (when the run
    // lasts that long).
    let scenario = |end: u64| {
        let (lp, clock, rx, rec, _) = start(secs(1), secs(30));
        let programmed = lp.programmed.clone();
        rec.fail.store(3, Ordering::SeqCst);
        clock.at(ms(0), service("a", 1));
        clock.at(ms(0), slice("a", "a-1", 1, 2));
        clock.at(ms(0), SourceEvent::Synced);
        if end > 20 {
            // Scheduled events are all delivered before the end.
            clock.at(secs(20), service("b", 2));
        }
        run(lp, &clock, rx, secs(end));
        programmed
    };
    let programmed = scenario(10);
    assert!(names(&programmed).is_empty(), "{:?}", names(&programmed));
    let programmed = scenario(25);
    assert_eq!(names(&programmed), ["ns1/a:p80", "ns1/b:p80"]);
    let g = programmed.read();
    let f = g.family(IpFamily::V4).unwrap();
    assert!(f.last_sync.is_some());
    assert!(!f.last_full, "the sync at 20 s was partial");
    let a = f.state.services.keys().next().unwrap();
    assert_eq!(f.state.endpoints_of(a).len(), 2);
}

/// An object both families reject is one invalid object, not one per
/// family (kubeproxy_rs_invalid_objects_total).
#[test]
fn an_invalid_object_counts_once_in_a_dual_stack_loop() {
    let (mut lp, clock, rx, _rec, metrics) = start(secs(1), secs(30));
    let tracker = ChangeTracker::new(TrackerConfig {
        family: IpFamily::V6,
        node_name: "node1".into(),
        service_proxy_name: None,
    });
    let dp = FakeDataplane {
        clock: clock.clone(),
        rec: Record::default(),
        mode: ProxyMode::Iptables,
    };
    lp.families.push(FamilyProxier::new(tracker, Box::new(dp)));
    assert_eq!(lp.families.len(), 2);
    let bad: Service = serde_json::from_value(json!({
        "metadata": {"namespace": "Not_A_Label", "name": "web"},
        "spec": {"clusterIP": "10.96.0.9", "ports": [{"name": "p80", "port": 80}]},
    }))
    .unwrap();
    clock.at(ms(0), SourceEvent::ServiceApplied(Box::new(bad)));
    let bad_slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"namespace": "Not_A_Label", "name": "web-1",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4", "endpoints": [],
    }))
    .unwrap();
    clock.at(ms(1), SourceEvent::SliceApplied(Box::new(bad_slice)));
    clock.at(ms(2), service("good", 1));
    clock.at(ms(3), SourceEvent::Synced);
    run(lp, &clock, rx, secs(2));
    assert_eq!(
        *metrics.invalid.lock().unwrap(),
        vec!["Service".to_string(), "EndpointSlice".to_string()]
    );
}

/// The health-check data published after each sync follow the changes: a
/// Service's local ready endpoints as its slices change, kept while other
/// Services change, gone when it no longer has a healthCheckNodePort.
#[test]
fn health_check_data_follow_the_changes() {
    let lb = |local: bool| -> SourceEvent {
        let mut spec = json!({"type": "LoadBalancer", "clusterIP": "10.96.5.1",
            "ports": [{"name": "p80", "port": 80, "nodePort": 31000}]});
        if local {
            spec["externalTrafficPolicy"] = json!("Local");
            spec["healthCheckNodePort"] = json!(30000);
        }
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"namespace": "ns1", "name": "lb"}, "spec": spec}))
        .unwrap();
        SourceEvent::ServiceApplied(Box::new(svc))
    };
    // `local` ready endpoints on this node, one on another node, one not ready here.
    let lb_slice = |local: u32| -> SourceEvent {
        let mut eps: Vec<_> = (0..local)
            .map(|i| {
                json!({"addresses": [format!("10.1.0.{}", i + 1)], "nodeName": "node1",
                            "conditions": {"ready": true}})
            })
            .collect();
        eps.push(
            json!({"addresses": ["10.2.0.1"], "nodeName": "node2", "conditions": {"ready": true}}),
        );
        eps.push(
            json!({"addresses": ["10.1.0.9"], "nodeName": "node1", "conditions": {"ready": false}}),
        );
        let s: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"namespace": "ns1", "name": "lb-1",
                         "labels": {"kubernetes.io/service-name": "lb"}},
            "addressType": "IPv4", "endpoints": eps,
            "ports": [{"name": "p80", "port": 80, "protocol": "TCP"}]}))
        .unwrap();
        SourceEvent::SliceApplied(Box::new(s))
    };
    let (mut lp, clock, rx, _, _) = start(Duration::ZERO, secs(30));
    let seen: Arc<Mutex<Vec<(Duration, HealthCheckData)>>> = Arc::default();
    let (c, s) = (clock.clone(), seen.clone());
    lp.on_synced = Box::new(move |hc| s.lock().unwrap().push((c.elapsed(), hc)));
    clock.at(ms(0), lb(true));
    clock.at(ms(0), lb_slice(2));
    clock.at(ms(0), SourceEvent::Synced);
    clock.at(secs(1), service("other", 7));
    clock.at(secs(2), lb_slice(1));
    clock.at(secs(3), lb(false));
    run(lp, &clock, rx, secs(4));
    let at = |t: Duration| -> (Option<u16>, Option<usize>) {
        let seen = seen.lock().unwrap();
        let (_, hc) = seen.iter().rev().find(|(when, _)| *when <= t).unwrap();
        let name = kp_model::ServiceName::new("ns1", "lb");
        (
            hc.ports.get(&name).copied(),
            hc.local_endpoints.get(&name).copied(),
        )
    };
    assert_eq!(at(ms(500)), (Some(30000), Some(2)));
    assert_eq!(
        at(secs(1) + ms(500)),
        (Some(30000), Some(2)),
        "another Service changed"
    );
    assert_eq!(at(secs(2) + ms(500)), (Some(30000), Some(1)));
    assert_eq!(at(secs(3) + ms(500)), (None, None));
}

#[derive(Clone, Default)]
struct Claims(Arc<Mutex<Vec<String>>>);

impl kp_sync::ClaimEvents for Claims {
    fn refused(&self, _: IpFamily, claim: &kp_model::RefusedClaim) {
        self.0
            .lock()
            .unwrap()
            .push(claim.service.service.name.to_string());
    }
}

/// Service `name` (ClusterIP 10.96.0.n) also claiming `external` as an
/// externalIP on port 80.
fn squatter(name: &str, n: u32, external: &str) -> SourceEvent {
    let svc = objects::service("ns1", name)
        .cluster_ip(&format!("10.96.0.{n}"))
        .port_json(json!({"name": "p80", "port": 80}))
        .spec(json!({"externalIPs": [external]}))
        .build();
    SourceEvent::ServiceApplied(Box::new(svc))
}

/// A claim already refused at the first sync is logged and counted, not
/// handed to claim_events (the Event was posted when the conflict arose;
/// a rollout would post it again from every node); one refused later is.
#[test]
fn only_claims_refused_after_the_first_sync_are_reported() {
    let (mut lp, clock, rx, _, _) = start(secs(1), secs(30));
    let claims = Claims::default();
    lp.claim_events = Box::new(claims.clone());
    clock.at(ms(0), service("owner", 0));
    clock.at(ms(0), squatter("early", 2, "10.96.0.1"));
    clock.at(ms(0), SourceEvent::Synced);
    clock.at(secs(10), squatter("late", 3, "10.96.0.1"));
    run(lp, &clock, rx, secs(12));
    assert_eq!(*claims.0.lock().unwrap(), vec!["late".to_string()]);
}
