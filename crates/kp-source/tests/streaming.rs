//! The API source against the in-process test API server, on the paths the
//! real one here cannot take: streaming lists (the test server serves them
//! once told to; kube-apiserver v1.36 over this machine's etcd 3.4 cannot),
//! and a server that refuses protobuf outright (406).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_source::api::{run_api_source, ApiSourceOptions, DEFAULT_LABEL_SELECTOR};
use kp_source::{Encoding, SourceEvent};
use kp_testkit::{objects, ApiServer};
use serde_json::json;
use tokio::sync::mpsc;

fn service(name: &str, port: u16) -> Service {
    objects::service("default", name)
        .cluster_ip("10.96.0.10")
        .port("http", port, "TCP")
        .build()
}

fn slice(name: &str, svc: &str, ip: &str) -> EndpointSlice {
    objects::slice("default", name, svc)
        .endpoint(ip)
        .port("http", 8080, "TCP")
        .build()
}

struct Source {
    rx: mpsc::Receiver<SourceEvent>,
    task: tokio::task::JoinHandle<Result<(), kp_source::SourceError>>,
    seen: Vec<String>,
}

impl Drop for Source {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn start(server: &ApiServer, encoding: Encoding) -> Source {
    let (tx, rx) = mpsc::channel(256);
    let opts = ApiSourceOptions {
        node_name: "node-a".into(),
        label_selector: Some(DEFAULT_LABEL_SELECTOR.into()),
        encoding,
        streaming_lists: true,
    };
    Source {
        rx,
        task: tokio::spawn(run_api_source(server.client(), opts, tx)),
        seen: Vec::new(),
    }
}

fn describe(ev: &SourceEvent) -> String {
    match ev {
        SourceEvent::ServiceApplied(s) => format!(
            "svc+ {}:{}",
            s.metadata.name.as_deref().unwrap_or(""),
            s.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port
        ),
        SourceEvent::ServiceDeleted { name, .. } => format!("svc- {name}"),
        SourceEvent::SliceApplied(s) => format!(
            "slice+ {}={}",
            s.metadata.name.as_deref().unwrap_or(""),
            s.endpoints[0].addresses[0]
        ),
        SourceEvent::SliceDeleted { name, .. } => format!("slice- {name}"),
        SourceEvent::Synced => "synced".into(),
        SourceEvent::Disconnected(_) => "disconnected".into(),
        SourceEvent::Reconnected => "reconnected".into(),
        other => format!("{other:?}").chars().take(40).collect(),
    }
}

impl Source {
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

/// With streaming lists served, the source lists nothing: its initial
/// state arrives on the watch, the end bookmark syncs it, the same stream
/// carries changes, and a relist after compaction streams again and still
/// deletes only what went away (the outage's probe lists, one item each,
/// as before).
#[tokio::test]
async fn streaming_lists_when_the_server_serves_them() {
    let server = ApiServer::start().await;
    server.set_watch_list(true);
    server.apply_service(service("keep", 80));
    server.apply_service(service("gone", 80));
    server.apply_endpoint_slice(slice("keep-1", "keep", "10.0.0.1"));
    server.apply_endpoint_slice(slice("gone-1", "gone", "10.0.0.2"));
    let mut src = start(&server, Encoding::default());
    src.until_all(&[
        "svc+ keep:80",
        "svc+ gone:80",
        "slice+ keep-1=10.0.0.1",
        "slice+ gone-1=10.0.0.2",
        "synced",
    ])
    .await;
    server.apply_endpoint_slice(slice("keep-1", "keep", "10.0.0.9"));
    src.until_all(&["slice+ keep-1=10.0.0.9"]).await;
    for plural in ["services", "endpointslices", "nodes", "servicecidrs"] {
        assert_eq!(
            server.lists(plural).len(),
            0,
            "{plural} were listed although the server streams"
        );
    }

    // Deleted, history forgotten, watches cut: the resumed watches get
    // 410 and relist by streaming again.
    server.set_down(true);
    src.until_all(&["disconnected"]).await;
    server.delete_service("default", "gone");
    server.delete_endpoint_slice("default", "gone-1");
    server.compact();
    server.set_down(false);
    let after = src
        .until_all(&["svc- gone", "slice- gone-1", "svc+ keep:80"])
        .await;
    assert!(
        !after
            .iter()
            .any(|e| e == "svc- keep" || e == "slice- keep-1"),
        "{after:?}"
    );
    server.apply_service(service("late", 81));
    src.until_all(&["svc+ late:81"]).await;
}

/// A server without protobuf that refuses an Accept header without JSON
/// (acceptContentTypes set to protobuf only): 406, then JSON for good.
#[tokio::test]
async fn a_server_refusing_protobuf_is_read_as_json() {
    let server = ApiServer::start().await;
    server.apply_service(service("a", 80));
    let mut src = start(
        &server,
        Encoding::new("", "application/vnd.kubernetes.protobuf"),
    );
    src.until_all(&["svc+ a:80", "synced"]).await;
    server.apply_service(service("b", 80));
    src.until_all(&["svc+ b:80"]).await;
    assert!(
        !src.seen.iter().any(|e| e == "disconnected"),
        "{:?}",
        src.seen
    );
    // Refused (406), then listed: the streaming list refused (422) fell
    // back to a list.
    assert!(!server.lists("services").is_empty());
    let r = kp_source::reflector::responses();
    assert!(
        r.get(&("Service", "list", "json")).copied().unwrap_or(0) >= 1,
        "{r:?}"
    );
    assert!(
        r.get(&("Service", "watch", "json")).copied().unwrap_or(0) >= 1,
        "{r:?}"
    );
}

/// The start's wait for this node's addresses lists the Node once (a
/// streaming list here), and the source's Node watch goes on from that
/// list's version instead of listing again: one list of the Node per
/// start, as upstream's one Node informer. Served with streaming lists and
/// without (a list from the watch cache).
#[tokio::test]
async fn the_node_listed_at_start_is_not_listed_again() {
    for streaming in [true, false] {
        let server = ApiServer::start().await;
        server.set_watch_list(streaming);
        server.apply_node(
            serde_json::from_value(json!({"metadata": {"name": "node-a"},
                "status": {"addresses": [{"type": "InternalIP", "address": "10.1.0.1"}]}}))
            .unwrap(),
        );
        server.apply_service(service("web", 80));
        let listed = kp_source::list_node(&server.client(), "node-a", &Encoding::default(), true)
            .await
            .unwrap();
        assert_eq!(
            listed
                .node
                .as_ref()
                .and_then(|n| n.metadata.name.as_deref()),
            Some("node-a")
        );
        let (tx, mut rx) = mpsc::channel(256);
        let opts = ApiSourceOptions {
            node_name: "node-a".into(),
            label_selector: Some(DEFAULT_LABEL_SELECTOR.into()),
            encoding: Encoding::default(),
            streaming_lists: true,
        };
        let rv = listed.resource_version.clone();
        let task = tokio::spawn(kp_source::run_api_source_from(
            server.client(),
            opts,
            Some(listed),
            tx,
        ));
        let mut node_seen = false;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(25);
        loop {
            let ev = tokio::time::timeout_at(deadline, rx.recv())
                .await
                .expect("Synced within 25 s")
                .unwrap();
            node_seen |= matches!(ev, SourceEvent::NodeApplied(_));
            if matches!(ev, SourceEvent::Synced) {
                break;
            }
        }
        assert!(node_seen, "the listed Node was not passed on");
        // A change of the Node arrives through the resumed watch.
        server.apply_node(
            serde_json::from_value(
                json!({"metadata": {"name": "node-a", "labels": {"changed": "yes"}},
                "status": {"addresses": [{"type": "InternalIP", "address": "10.1.0.1"}]}}),
            )
            .unwrap(),
        );
        loop {
            let ev = tokio::time::timeout_at(deadline, rx.recv())
                .await
                .expect("the Node's change within 25 s")
                .unwrap();
            if let SourceEvent::NodeApplied(n) = ev {
                if n.metadata
                    .labels
                    .as_ref()
                    .is_some_and(|l| l.contains_key("changed"))
                {
                    break;
                }
            }
        }
        task.abort();
        let watches = server.watches("nodes");
        let initial = usize::from(streaming);
        assert_eq!(
            server.lists("nodes").len() + watches.iter().filter(|w| w.streaming).count(),
            1,
            "streaming={streaming}: the Node was listed more than once: lists {:?}, watches {watches:?}",
            server.lists("nodes")
        );
        assert_eq!(
            watches.iter().filter(|w| w.streaming).count(),
            initial,
            "{watches:?}"
        );
        let resumed: Vec<_> = watches.iter().filter(|w| !w.streaming).collect();
        assert!(
            resumed.first().is_some_and(|w| w.resource_version == rv),
            "the Node watch did not resume from the listed version {rv}: {watches:?}"
        );
    }
}
