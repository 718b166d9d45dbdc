//! The API source against the in-process test API server (each test its own).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_source::api::{run_api_source, ApiSourceOptions, DEFAULT_LABEL_SELECTOR};
use kp_source::SourceEvent;
use kp_testkit::{objects, ApiServer};
use serde_json::json;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

const NODE: &str = "node-a";

fn service(ns: &str, name: &str, port: u16, labels: serde_json::Value) -> Service {
    objects::service(ns, name)
        .cluster_ip("10.96.0.10")
        .port("http", port, "TCP")
        .labels(labels)
        .build()
}

fn slice(ns: &str, name: &str, svc: &str, ip: &str) -> EndpointSlice {
    objects::slice(ns, name, svc)
        .endpoint(ip)
        .port("http", 8080, "TCP")
        .build()
}

fn node(name: &str, zone: &str) -> Node {
    objects::node(name).zone(zone).build()
}

/// A running source; aborted on drop so a failed test does not leak it.
struct Source {
    rx: mpsc::Receiver<SourceEvent>,
    task: JoinHandle<Result<(), kp_source::SourceError>>,
    seen: Vec<String>,
}

impl Drop for Source {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn start(server: &ApiServer) -> Source {
    let (tx, rx) = mpsc::channel(256);
    let opts = ApiSourceOptions {
        node_name: NODE.into(),
        label_selector: Some(DEFAULT_LABEL_SELECTOR.into()),
        encoding: Default::default(),
        streaming_lists: true,
    };
    let task = tokio::spawn(run_api_source(server.client(), opts, tx));
    Source {
        rx,
        task,
        seen: Vec::new(),
    }
}

fn describe(ev: &SourceEvent) -> String {
    let name = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        format!(
            "{}/{}",
            m.namespace.as_deref().unwrap_or(""),
            m.name.as_deref().unwrap_or("")
        )
    };
    match ev {
        SourceEvent::ServiceApplied(s) => {
            let port = s.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port;
            format!("svc+ {}:{port}", name(&s.metadata))
        }
        SourceEvent::ServiceDeleted { namespace, name } => format!("svc- {namespace}/{name}"),
        SourceEvent::SliceApplied(s) => format!(
            "slice+ {}={}",
            name(&s.metadata),
            s.endpoints[0].addresses[0]
        ),
        SourceEvent::SliceDeleted { namespace, name } => format!("slice- {namespace}/{name}"),
        SourceEvent::NodeApplied(n) => format!(
            "node+ {}@{}",
            n.metadata.name.as_deref().unwrap_or(""),
            n.metadata.labels.as_ref().unwrap()["topology.kubernetes.io/zone"]
        ),
        SourceEvent::Synced => "synced".into(),
        SourceEvent::Disconnected(_) => "disconnected".into(),
        SourceEvent::Reconnected => "reconnected".into(),
        SourceEvent::Invalid(m) => format!("invalid {m}"),
        SourceEvent::ServiceCidrApplied(c) => format!(
            "cidr+ {}={}",
            c.metadata.name.as_deref().unwrap_or(""),
            c.spec
                .as_ref()
                .and_then(|s| s.cidrs.clone())
                .unwrap_or_default()
                .join(",")
        ),
        SourceEvent::ServiceCidrDeleted { name } => format!("cidr- {name}"),
    }
}

impl Source {
    /// Receives until an event described as `want` arrives; returns everything
    /// received on the way (inclusive). Everything is also kept in `seen`.
    async fn until(&mut self, want: &str) -> Vec<String> {
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(25);
        loop {
            let ev = tokio::time::timeout_at(deadline, self.rx.recv())
                .await
                .unwrap_or_else(|_| panic!("no {want:?} within 25 s; got {got:?}"))
                .expect("source still running");
            let d = describe(&ev);
            self.seen.push(d.clone());
            got.push(d.clone());
            if d == want {
                return got;
            }
        }
    }
}

impl Source {
    /// Receives until every event in `wants` arrived (any order); returns all
    /// events received meanwhile.
    async fn until_all(&mut self, wants: &[&str]) -> Vec<String> {
        let mut got: Vec<String> = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(25);
        while !wants.iter().all(|w| got.iter().any(|g| g == w)) {
            let ev = tokio::time::timeout_at(deadline, self.rx.recv())
                .await
                .unwrap_or_else(|_| panic!("not all of {wants:?} within 25 s; got {got:?}"))
                .expect("source still running");
            let d = describe(&ev);
            self.seen.push(d.clone());
            got.push(d);
        }
        got
    }
}

#[tokio::test]
async fn initial_list_then_synced_after_both_kinds() {
    let server = ApiServer::start().await;
    server.apply_service(service("default", "a", 80, json!({})));
    server.apply_service(service("shop", "b", 443, json!({})));
    server.apply_endpoint_slice(slice("default", "a-1", "a", "10.0.0.1"));
    server.apply_endpoint_slice(slice("shop", "b-1", "b", "10.0.0.2"));
    server.apply_endpoint_slice(slice("shop", "b-2", "b", "10.0.0.3"));
    server.apply_node(node(NODE, "zone-1"));
    // EndpointSlices list late: Synced must wait for them.
    server.set_list_delay("endpointslices", Duration::from_millis(1500));
    let mut src = start(&server);

    let mut before = src.until("synced").await;
    before.pop();
    for want in [
        "svc+ default/a:80",
        "svc+ shop/b:443",
        "slice+ default/a-1=10.0.0.1",
        "slice+ shop/b-1=10.0.0.2",
        "slice+ shop/b-2=10.0.0.3",
    ] {
        assert!(
            before.iter().any(|e| e == want),
            "{want} missing before Synced: {before:?}"
        );
    }
    assert!(
        !before.iter().any(|e| e.starts_with("disconnected")),
        "{before:?}"
    );
    // The node arrives too (before or after Synced).
    if !before.iter().any(|e| e == "node+ node-a@zone-1") {
        src.until("node+ node-a@zone-1").await;
    }
    // Synced is sent once: a relist does not repeat it.
    server.compact();
    server.drop_watches();
    server.apply_service(service("default", "c", 8080, json!({})));
    src.until("svc+ default/c:8080").await;
    assert_eq!(src.seen.iter().filter(|e| *e == "synced").count(), 1);
}

#[tokio::test]
async fn additions_modifications_and_deletions_are_delivered() {
    let server = ApiServer::start().await;
    server.apply_service(service("default", "a", 80, json!({})));
    let mut src = start(&server);
    src.until("synced").await;

    server.apply_service(service("default", "new", 53, json!({})));
    src.until("svc+ default/new:53").await;
    server.apply_service(service("default", "new", 5353, json!({})));
    src.until("svc+ default/new:5353").await;
    server.apply_endpoint_slice(slice("default", "new-1", "new", "10.1.0.1"));
    src.until("slice+ default/new-1=10.1.0.1").await;
    server.apply_endpoint_slice(slice("default", "new-1", "new", "10.1.0.2"));
    src.until("slice+ default/new-1=10.1.0.2").await;
    server.delete_endpoint_slice("default", "new-1");
    src.until("slice- default/new-1").await;
    server.delete_service("default", "new");
    let got = src.until("svc- default/new").await;
    // Nothing else happened to the untouched service.
    assert!(
        !src.seen.iter().any(|e| e == "svc- default/a"),
        "{:?}",
        src.seen
    );
    assert!(
        !got.iter().any(|e| e.starts_with("disconnected")),
        "{got:?}"
    );
}

#[tokio::test]
async fn only_our_node_is_watched() {
    let server = ApiServer::start().await;
    server.apply_node(node("node-b", "zone-9"));
    server.apply_node(node(NODE, "zone-1"));
    let mut src = start(&server);
    src.until("synced").await;
    if !src.seen.iter().any(|e| e == "node+ node-a@zone-1") {
        src.until("node+ node-a@zone-1").await;
    }
    server.apply_node(node("node-b", "zone-8"));
    server.apply_node(node("node-c", "zone-7"));
    server.apply_node(node(NODE, "zone-2"));
    src.until("node+ node-a@zone-2").await;
    assert!(
        src.seen
            .iter()
            .all(|e| !e.starts_with("node+") || e.starts_with("node+ node-a@")),
        "{:?}",
        src.seen
    );
}

#[tokio::test]
async fn list_node_finds_only_ours_with_a_list() {
    let server = ApiServer::start().await;
    server.apply_node(node("node-b", "zone-9"));
    let client = server.client();
    assert_eq!(
        kp_source::list_node(&client, NODE, &Default::default(), true)
            .await
            .unwrap()
            .node,
        None
    );
    server.apply_node(node(NODE, "zone-1"));
    let got = kp_source::list_node(&client, NODE, &Default::default(), true)
        .await
        .unwrap()
        .node
        .unwrap();
    assert_eq!(got.metadata.name.as_deref(), Some(NODE));
    // A list or a streaming list (what the RBAC allows on Nodes: list and
    // watch), never a get.
    let calls = server.api_calls();
    assert!(
        calls
            .iter()
            .filter(|c| c.resource == "nodes")
            .all(|c| c.verb == "list" || c.verb == "watch"),
        "{calls:?}"
    );
    server.set_down(true);
    assert!(matches!(
        kp_source::list_node(&client, NODE, &Default::default(), true).await,
        Err(kp_source::SourceError::ListNode { .. })
    ));
}

#[tokio::test]
async fn label_selector_excludes_other_proxies_and_headless() {
    let server = ApiServer::start().await;
    server.apply_service(service("default", "mine", 80, json!({"app": "x"})));
    server.apply_service(service(
        "default",
        "theirs",
        80,
        json!({"service.kubernetes.io/service-proxy-name": "other-proxy"}),
    ));
    server.apply_service(service(
        "default",
        "headless",
        80,
        json!({"service.kubernetes.io/headless": ""}),
    ));
    let mut theirs_slice = slice("default", "theirs-1", "theirs", "10.0.0.9");
    theirs_slice.metadata.labels.as_mut().unwrap().insert(
        "service.kubernetes.io/service-proxy-name".into(),
        "other-proxy".into(),
    );
    server.apply_endpoint_slice(theirs_slice);
    server.apply_endpoint_slice(slice("default", "mine-1", "mine", "10.0.0.1"));
    let mut src = start(&server);
    let got = src.until("synced").await;
    assert!(got.contains(&"svc+ default/mine:80".to_owned()), "{got:?}");
    assert!(
        got.contains(&"slice+ default/mine-1=10.0.0.1".to_owned()),
        "{got:?}"
    );

    // A service that gains the label leaves the selection: deleted for us.
    server.apply_service(service(
        "default",
        "mine",
        80,
        json!({"service.kubernetes.io/service-proxy-name": "other-proxy"}),
    ));
    src.until("svc- default/mine").await;
    // Changes to excluded services are not delivered at all.
    server.apply_service(service(
        "default",
        "theirs",
        81,
        json!({"service.kubernetes.io/service-proxy-name": "other-proxy"}),
    ));
    server.apply_service(service("default", "marker", 1, json!({})));
    src.until("svc+ default/marker:1").await;
    assert!(
        src.seen
            .iter()
            .all(|e| !e.contains("theirs") && !e.contains("headless")),
        "{:?}",
        src.seen
    );
}

#[tokio::test]
async fn relist_after_compaction_deletes_only_what_went_away() {
    let server = ApiServer::start().await;
    server.apply_service(service("default", "keep", 80, json!({})));
    server.apply_service(service("default", "gone", 80, json!({})));
    server.apply_endpoint_slice(slice("default", "keep-1", "keep", "10.0.0.1"));
    server.apply_endpoint_slice(slice("default", "gone-1", "gone", "10.0.0.2"));
    let mut src = start(&server);
    src.until("synced").await;

    // History compacted and watches cut: the watchers get 410 and relist.
    let requests = server.request_count();
    server.compact();
    server.drop_watches();
    let relisted = src
        .until_all(&[
            "svc+ default/gone:80",
            "svc+ default/keep:80",
            "slice+ default/gone-1=10.0.0.2",
            "slice+ default/keep-1=10.0.0.1",
        ])
        .await;
    assert!(server.request_count() > requests);
    assert!(
        !relisted
            .iter()
            .any(|e| e.starts_with("svc-") || e.starts_with("slice-")),
        "a relist must not delete what still exists: {relisted:?}"
    );
    // 410 is routine, not a disconnection.
    assert!(
        !src.seen.iter().any(|e| e == "disconnected"),
        "{:?}",
        src.seen
    );

    // Objects removed (and changed) while the source cannot see the server,
    // then history compacted: the relist finds the difference.
    server.set_down(true);
    src.until("disconnected").await;
    server.delete_service("default", "gone");
    server.delete_endpoint_slice("default", "gone-1");
    server.apply_service(service("default", "keep", 8080, json!({})));
    server.compact();
    server.set_down(false);
    src.until_all(&[
        "svc- default/gone",
        "slice- default/gone-1",
        "svc+ default/keep:8080",
    ])
    .await;
    let all_after: Vec<&String> = src
        .seen
        .iter()
        .skip_while(|e| *e != "disconnected")
        .collect();
    assert!(
        !all_after
            .iter()
            .any(|e| *e == "svc- default/keep" || *e == "slice- default/keep-1"),
        "{all_after:?}"
    );
    assert_eq!(
        all_after
            .iter()
            .filter(|e| **e == "svc- default/gone")
            .count(),
        1,
        "{all_after:?}"
    );
}

#[tokio::test]
async fn outage_reports_disconnected_then_reconnected_with_missed_changes() {
    let server = ApiServer::start().await;
    server.apply_service(service("default", "a", 80, json!({})));
    let mut src = start(&server);
    src.until("synced").await;

    server.set_down(true);
    src.until("disconnected").await;
    server.apply_service(service("default", "during-outage", 9090, json!({})));
    // Stay down long enough for several failed retries.
    tokio::time::sleep(Duration::from_secs(5)).await;
    server.set_down(false);
    let got = src.until("svc+ default/during-outage:9090").await;
    let reconnected = src.seen.iter().position(|e| e == "reconnected");
    let change = src
        .seen
        .iter()
        .position(|e| e == "svc+ default/during-outage:9090");
    assert!(
        reconnected.is_some() && reconnected < change,
        "Reconnected must precede the missed change: {:?}",
        src.seen
    );
    // Disconnected is reported once per outage, not per retry.
    assert_eq!(
        src.seen.iter().filter(|e| *e == "disconnected").count(),
        1,
        "{:?}",
        src.seen
    );
    assert!(!got.iter().any(|e| e.starts_with("svc- ")), "{got:?}");
}

#[tokio::test]
async fn reconnected_without_changes_during_the_outage() {
    let server = ApiServer::start().await;
    let mut src = start(&server);
    src.until("synced").await;
    server.set_down(true);
    src.until("disconnected").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.set_down(false);
    // Nothing changed, so no watch event will come: the probe reports it.
    src.until("reconnected").await;
}

#[tokio::test]
async fn source_returns_when_the_channel_closes() {
    let server = ApiServer::start().await;
    let (tx, rx) = mpsc::channel(4);
    let opts = ApiSourceOptions {
        node_name: NODE.into(),
        label_selector: None,
        encoding: Default::default(),
        streaming_lists: true,
    };
    let task = tokio::spawn(run_api_source(server.client(), opts, tx));
    drop(rx);
    let res = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("returns after the receiver is dropped")
        .unwrap();
    assert!(res.is_ok(), "{res:?}");
}

/// A Service k8s-openapi's type cannot decode (e2e's "should complete a
/// service status lifecycle" writes a status condition without
/// lastTransitionTime; the API server keeps it as null) is delivered, and
/// the Service watch goes on: it used to fail every list and watch event
/// while such a Service existed.
#[tokio::test]
async fn a_service_with_a_condition_without_time_does_not_stop_the_watch() {
    let server = ApiServer::start().await;
    let mut src = start(&server);
    src.until("synced").await;
    server.apply_service_json(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "default", "name": "status"},
        "spec": {"clusterIP": "10.96.0.11", "ports": [{"name": "http", "port": 81, "protocol": "TCP"}]},
        "status": {
            "loadBalancer": {"ingress": [{"ip": "203.0.113.1"}]},
            "conditions": [{"type": "StatusUpdate", "status": "True", "reason": "E2E",
                            "message": "Set from e2e test", "lastTransitionTime": null}]
        }
    }));
    src.until("svc+ default/status:81").await;
    server.apply_service(service("default", "after", 82, json!({})));
    let got = src.until("svc+ default/after:82").await;
    assert!(
        !got.iter().any(|e| e.starts_with("disconnected")),
        "{got:?}"
    );
    // A relist (what a restart or an expired watch does) reads it too.
    server.compact();
    server.drop_watches();
    server.apply_service(service("default", "later", 83, json!({})));
    let got = src.until("svc+ default/later:83").await;
    assert!(
        !got.iter().any(|e| e.starts_with("disconnected")),
        "{got:?}"
    );
}

fn service_cidr(name: &str, cidrs: &[&str]) -> serde_json::Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": name}, "spec": {"cidrs": cidrs}})
}

#[tokio::test]
async fn service_cidrs_are_watched_without_holding_up_the_rest() {
    let server = ApiServer::start().await;
    server.apply_service_cidr(&service_cidr("kubernetes", &["10.96.0.0/16"]));
    server.apply_node(node(NODE, "zone-1"));
    let mut src = start(&server);
    src.until_all(&["synced", "cidr+ kubernetes=10.96.0.0/16"])
        .await;
    // Added, changed and deleted later, without a restart.
    server.apply_service_cidr(&service_cidr("second", &["10.97.0.0/24"]));
    src.until("cidr+ second=10.97.0.0/24").await;
    server.delete_service_cidr("second");
    src.until("cidr- second").await;
    // A relist finds a deletion it missed.
    server.drop_watches();
    server.compact();
    server.delete_service_cidr("kubernetes");
    src.until("cidr- kubernetes").await;
    assert!(
        !src.seen.iter().any(|e| e.starts_with("disconnected")),
        "{:?}",
        src.seen
    );
}

#[tokio::test]
async fn a_server_without_service_cidrs_is_asked_once() {
    let server = ApiServer::start().await;
    // An API server before ServiceCIDRs (or with the API off) answers 404.
    server.set_list_error("servicecidrs", Some(404));
    server.apply_service(service("default", "a", 80, json!({})));
    server.apply_node(node(NODE, "zone-1"));
    let mut src = start(&server);
    src.until_all(&["synced", "svc+ default/a:80"]).await;
    // The rest goes on; the missing API is not asked again (a watch
    // retrying would list again within its 0.8 s first backoff).
    server.apply_service(service("default", "b", 81, json!({})));
    src.until("svc+ default/b:81").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(server.lists("servicecidrs").len(), 1);
    assert!(
        !src.seen.iter().any(|e| e.starts_with("disconnected")),
        "{:?}",
        src.seen
    );
}

#[tokio::test]
async fn a_forbidden_service_cidr_watch_is_retried_until_allowed() {
    let server = ApiServer::start().await;
    // RBAC without servicecidrs (an older ClusterRole): 403.
    server.set_list_error("servicecidrs", Some(403));
    server.apply_service_cidr(&service_cidr("kubernetes", &["10.96.0.0/16"]));
    server.apply_node(node(NODE, "zone-1"));
    let mut src = start(&server);
    src.until("synced").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(server.lists("servicecidrs").len() >= 2);
    server.set_list_error("servicecidrs", None);
    src.until("cidr+ kubernetes=10.96.0.0/16").await;
    assert!(
        !src.seen.iter().any(|e| e.starts_with("disconnected")),
        "{:?}",
        src.seen
    );
}

#[tokio::test]
async fn synced_waits_for_the_service_cidrs_a_while() {
    let server = ApiServer::start().await;
    server.apply_service_cidr(&service_cidr("kubernetes", &["10.96.0.0/16"]));
    server.apply_node(node(NODE, "zone-1"));
    // A slow list: the first sync waits for it, so it already drops the
    // ranges (a restart never lets them through meanwhile).
    server.set_list_delay("servicecidrs", Duration::from_millis(1500));
    let mut src = start(&server);
    let got = src.until("synced").await;
    assert!(
        got.iter().any(|e| e == "cidr+ kubernetes=10.96.0.0/16"),
        "{got:?}"
    );

    // One that does not answer holds it no longer than 5 s.
    let server = ApiServer::start().await;
    server.apply_node(node(NODE, "zone-1"));
    server.set_list_delay("servicecidrs", Duration::from_secs(60));
    let t0 = std::time::Instant::now();
    let mut src = start(&server);
    src.until("synced").await;
    let waited = t0.elapsed();
    assert!(
        (Duration::from_secs(4)..Duration::from_secs(10)).contains(&waited),
        "{waited:?}"
    );
}
