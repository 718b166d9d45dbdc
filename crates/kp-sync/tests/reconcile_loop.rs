//! When the sync loop reconciles conntrack, with a fake kernel table: the
//! first sync repairs flows made behind the proxy's back, a failed delete
//! is tried again at the next sync even when nothing changed, and a sync
//! that touched no UDP Service lists nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use kp_testkit::objects;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_model::{
    ChangeTracker, Dataplane, DataplaneError, IpFamily, ProxyState, ServicePortName, SyncReport,
    TrackerConfig,
};
use kp_sync::{
    Conntrack, ConntrackError, Deleted, FamilyProxier, Flow, ManualClock, NoReport,
    ProgrammedState, SyncLoop, SyncMetrics,
};
use serde_json::json;

struct OkDataplane;
impl Dataplane for OkDataplane {
    fn mode(&self) -> kp_model::ProxyMode {
        kp_model::ProxyMode::Nftables
    }
    fn sync(
        &mut self,
        _: &ProxyState,
        _: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        Ok(SyncReport {
            full,
            ..Default::default()
        })
    }
    fn render(&self, _: &ProxyState) -> String {
        String::new()
    }
    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        Ok(())
    }
}

/// A conntrack table in memory.
#[derive(Clone, Default)]
struct Table {
    flows: Arc<Mutex<Vec<Flow>>>,
    lists: Arc<Mutex<u32>>,
    /// Refuse this many of the next deletes.
    refuse: Arc<Mutex<u32>>,
    /// Fail this many of the next dumps.
    fail_lists: Arc<Mutex<u32>>,
}

impl Conntrack for Table {
    fn list_udp(&mut self, _: IpFamily) -> Result<Vec<Flow>, ConntrackError> {
        *self.lists.lock().unwrap() += 1;
        let mut fail = self.fail_lists.lock().unwrap();
        if *fail > 0 {
            *fail -= 1;
            return Err(ConntrackError::Refused {
                what: "dumping".into(),
                message: "injected".into(),
            });
        }
        Ok(self.flows.lock().unwrap().clone())
    }
    fn delete_flows(&mut self, _: IpFamily, flows: &[Flow]) -> Deleted {
        let mut done = Deleted::default();
        let mut table = self.flows.lock().unwrap();
        for f in flows {
            let mut refuse = self.refuse.lock().unwrap();
            if *refuse > 0 {
                *refuse -= 1;
                done.failed += 1;
                continue;
            }
            if let Some(i) = table.iter().position(|t| t == f) {
                table.remove(i);
                done.deleted += 1;
            }
        }
        done
    }
}

#[derive(Clone, Default)]
struct Reconciled(Arc<Mutex<Vec<u64>>>);
impl SyncMetrics for Reconciled {
    fn invalid_object(&self, _: &str) {}
    fn invalid_field(&self, _: &str) {}
    fn queued(&self, _: IpFamily) {}
    fn pending_changes(&self, _: u64, _: u64) {}
    fn changes(&self, _: u64, _: u64) {}
    fn rules_lost(&self, _: IpFamily) {}
    fn synced(&self, _: IpFamily, _: &SyncReport, _: f64) {}
    fn programming_latency(&self, _: IpFamily, _: f64) {}
    fn sync_failed(&self, _: IpFamily, _: kp_model::ProxyMode, _: bool) {}
    fn conntrack_reconciled(&self, _: IpFamily, _: f64, deleted: u64) {
        self.0.lock().unwrap().push(deleted);
    }
    fn source_connected(&self, _: bool) {}
}

fn udp_flow(dst: &str, dport: u16, reply: &str, rport: u16) -> Flow {
    Flow {
        proto: 17,
        orig_src: "10.244.0.9".parse().unwrap(),
        orig_dst: dst.parse().unwrap(),
        orig_sport: 40000,
        orig_dport: dport,
        reply_src: Some(reply.parse().unwrap()),
        reply_sport: Some(rport),
    }
}

fn service(name: &str, ip: &str, protocol: &str) -> Service {
    objects::service("ns1", name)
        .cluster_ip(ip)
        .port_json(json!({"name": "p", "port": 53, "protocol": protocol, "targetPort": 8053}))
        .build()
}

fn slice(svc: &str, ip: &str, protocol: &str) -> EndpointSlice {
    objects::slice("ns1", &format!("{svc}-1"), svc)
        .endpoint_on(ip, "node2")
        .port("p", 8053, protocol)
        .build()
}

fn setup(table: &Table, metrics: &Reconciled) -> SyncLoop {
    let (clock, _rx) = ManualClock::new();
    let mut tracker = ChangeTracker::new(TrackerConfig {
        family: IpFamily::V4,
        node_name: "node1".into(),
        service_proxy_name: None,
    });
    let now = SystemTime::now();
    tracker
        .update_service(&service("dns", "10.96.0.10", "UDP"), now)
        .unwrap();
    tracker
        .update_endpoint_slice(&slice("dns", "10.244.1.5", "UDP"), now)
        .unwrap();
    SyncLoop {
        node_name: "node1".into(),
        families: vec![FamilyProxier::new(tracker, Box::new(OkDataplane))],
        min_sync_period: std::time::Duration::from_secs(1),
        sync_period: std::time::Duration::from_secs(30),
        metrics: Box::new(metrics.clone()),
        health: Arc::new(NoReport),
        claim_events: Box::new(NoReport),
        conntrack: Box::new(table.clone()),
        clock: Box::new(clock),
        on_synced: Box::new(|_| {}),
        programmed: ProgrammedState::new(),
        node_check: None,
    }
}

#[test]
fn first_sync_repairs_and_failed_deletes_are_retried() {
    let table = Table::default();
    let good = udp_flow("10.96.0.10", 53, "10.244.1.5", 8053);
    // Made while the proxy was down: DNATed to a pod that is gone, and one
    // sent before any rule existed (not NATed).
    let gone = udp_flow("10.96.0.10", 53, "10.244.1.77", 8053);
    let bare = udp_flow("10.96.0.10", 53, "10.96.0.10", 53);
    let other = udp_flow("10.96.0.99", 53, "10.96.0.99", 53);
    *table.flows.lock().unwrap() = vec![good.clone(), gone, bare, other.clone()];
    *table.refuse.lock().unwrap() = 1;
    let metrics = Reconciled::default();
    let mut lp = setup(&table, &metrics);

    assert!(lp.sync_once(false));
    assert_eq!(*table.lists.lock().unwrap(), 1);
    assert_eq!(*metrics.0.lock().unwrap(), vec![1], "one of two refused");
    assert_eq!(table.flows.lock().unwrap().len(), 3);

    // Nothing changed, but a delete failed: this sync tries again.
    assert!(lp.sync_once(false));
    assert_eq!(*table.lists.lock().unwrap(), 2);
    assert_eq!(*metrics.0.lock().unwrap(), vec![1, 1]);
    assert_eq!(
        *table.flows.lock().unwrap(),
        vec![good.clone(), other.clone()]
    );

    // All done: a sync with no change lists nothing.
    assert!(lp.sync_once(false));
    assert_eq!(*table.lists.lock().unwrap(), 2);

    // A TCP Service's change does not list either; a UDP one does.
    let now = SystemTime::now();
    lp.families[0]
        .tracker
        .update_service(&service("web", "10.96.0.20", "TCP"), now)
        .unwrap();
    assert!(lp.sync_once(false));
    assert_eq!(*table.lists.lock().unwrap(), 2);
    let moved = udp_flow("10.96.0.10", 53, "10.244.1.5", 8053);
    lp.families[0]
        .tracker
        .update_endpoint_slice(&slice("dns", "10.244.1.6", "UDP"), now)
        .unwrap();
    assert!(lp.sync_once(false));
    assert_eq!(*table.lists.lock().unwrap(), 3);
    assert!(
        !table.flows.lock().unwrap().contains(&moved),
        "the flow to the replaced endpoint went"
    );
    assert_eq!(*table.flows.lock().unwrap(), vec![other]);

    // A forced full sync (a periodic rebuild) reconciles too.
    assert!(lp.sync_once(true));
    assert_eq!(*table.lists.lock().unwrap(), 4);
}

/// A dump that fails keeps everything for the next sync, the tracker's
/// filters included: the flows of a Service deleted meanwhile (no longer a
/// frontend, so only its filter selects them) go at the next sync, which
/// has nothing else to do. A failed dump reports no reconcile.
#[test]
fn a_failed_dump_keeps_the_trackers_filters() {
    let table = Table::default();
    let metrics = Reconciled::default();
    let mut lp = setup(&table, &metrics);
    assert!(lp.sync_once(false));
    assert_eq!(*metrics.0.lock().unwrap(), vec![0]);
    let to_gone = udp_flow("10.96.0.10", 53, "10.244.1.5", 8053);
    table.flows.lock().unwrap().push(to_gone);
    *table.fail_lists.lock().unwrap() = 1;
    lp.families[0]
        .tracker
        .delete_service("ns1", "dns", SystemTime::now());
    assert!(lp.sync_once(false));
    assert_eq!(
        *metrics.0.lock().unwrap(),
        vec![0],
        "no report without a dump"
    );
    assert_eq!(table.flows.lock().unwrap().len(), 1);
    assert!(lp.sync_once(false));
    assert_eq!(*metrics.0.lock().unwrap(), vec![0, 1]);
    assert!(table.flows.lock().unwrap().is_empty());
}
