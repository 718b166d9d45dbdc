//! The test API server speaks the list/watch protocol as kube-rs expects it.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_testkit::{objects, ApiServer};
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use kube::ResourceExt;
use serde_json::json;

fn service(ns: &str, name: &str, labels: serde_json::Value) -> Service {
    objects::service(ns, name)
        .cluster_ip("10.96.0.10")
        .port("http", 80, "TCP")
        .labels(labels)
        .build()
}

fn node(name: &str) -> Node {
    objects::node(name).build()
}

async fn next_event<K: Clone + std::fmt::Debug>(
    stream: &mut (impl futures::Stream<Item = kube::Result<WatchEvent<K>>> + Unpin),
) -> WatchEvent<K> {
    tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("watch event within 10 s")
        .expect("watch stream still open")
        .expect("watch event decodes")
}

/// The next event that is not a bookmark.
async fn next_change<K: Clone + std::fmt::Debug>(
    stream: &mut (impl futures::Stream<Item = kube::Result<WatchEvent<K>>> + Unpin),
) -> WatchEvent<K> {
    loop {
        match next_event(stream).await {
            WatchEvent::Bookmark(_) => continue,
            other => return other,
        }
    }
}

#[tokio::test]
async fn list_get_and_discovery() {
    let server = ApiServer::start().await;
    server.apply_service(service("default", "a", json!({})));
    server.apply_service(service("kube-system", "b", json!({})));
    let client = server.client();

    let v = client.apiserver_version().await.unwrap();
    assert_eq!((v.major.as_str(), v.minor.as_str()), ("1", "33"));

    let all: Api<Service> = Api::all(client.clone());
    let list = all.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 2);
    let rv: u64 = list.metadata.resource_version.unwrap().parse().unwrap();
    assert_eq!(rv, server.resource_version());
    for item in &list.items {
        assert!(item.metadata.uid.is_some());
        assert!(item.metadata.creation_timestamp.is_some());
        assert!(item.metadata.resource_version.is_some());
    }

    let ns: Api<Service> = Api::namespaced(client.clone(), "kube-system");
    let only = ns.list(&ListParams::default()).await.unwrap();
    assert_eq!(only.items.len(), 1);
    assert_eq!(only.items[0].name_any(), "b");
    assert_eq!(ns.get("b").await.unwrap().name_any(), "b");
    let missing = ns.get("nope").await.unwrap_err();
    assert!(matches!(missing, kube::Error::Api(s) if s.code == 404));

    // An update keeps uid and creationTimestamp and bumps resourceVersion.
    let before = ns.get("b").await.unwrap();
    server.apply_service(service("kube-system", "b", json!({"x": "y"})));
    let after = ns.get("b").await.unwrap();
    assert_eq!(before.metadata.uid, after.metadata.uid);
    assert_ne!(
        before.metadata.resource_version,
        after.metadata.resource_version
    );
    assert!(server.request_count() >= 6);
}

#[tokio::test]
async fn selectors_filter_lists_and_watches() {
    let server = ApiServer::start().await;
    server.apply_service(service("default", "plain", json!({})));
    server.apply_service(service(
        "default",
        "other-proxy",
        json!({"service.kubernetes.io/service-proxy-name": "x"}),
    ));
    server.apply_service(service("default", "web", json!({"app": "web"})));
    server.apply_node(node("n1"));
    server.apply_node(node("n2"));
    let client = server.client();
    let svcs: Api<Service> = Api::all(client.clone());

    let lp = ListParams::default().labels("!service.kubernetes.io/service-proxy-name");
    let mut names: Vec<String> = svcs
        .list(&lp)
        .await
        .unwrap()
        .items
        .iter()
        .map(|s| s.name_any())
        .collect();
    names.sort();
    assert_eq!(names, ["plain", "web"]);
    let web = svcs
        .list(&ListParams::default().labels("app=web"))
        .await
        .unwrap();
    assert_eq!(web.items.len(), 1);
    let not_web = svcs
        .list(&ListParams::default().labels("app!=web"))
        .await
        .unwrap();
    assert_eq!(not_web.items.len(), 2);

    let nodes: Api<Node> = Api::all(client.clone());
    let n = nodes
        .list(&ListParams::default().fields("metadata.name=n2"))
        .await
        .unwrap();
    assert_eq!(n.items.len(), 1);
    assert_eq!(n.items[0].name_any(), "n2");

    // A watch with a selector sees a label change that leaves the selection as DELETED.
    let rv = server.resource_version().to_string();
    let wp = WatchParams::default().labels("app=web");
    let mut stream = svcs.watch(&wp, &rv).await.unwrap().boxed();
    server.apply_service(service("default", "plain", json!({"app": "web"})));
    match next_change(&mut stream).await {
        WatchEvent::Added(s) => assert_eq!(s.name_any(), "plain"),
        other => panic!("expected ADDED plain, got {other:?}"),
    }
    server.apply_service(service("default", "web", json!({"app": "api"})));
    match next_change(&mut stream).await {
        WatchEvent::Deleted(s) => assert_eq!(s.name_any(), "web"),
        other => panic!("expected DELETED web, got {other:?}"),
    }
}

#[tokio::test]
async fn watch_resumes_from_resource_version_and_expires_after_compaction() {
    let server = ApiServer::start().await;
    let client = server.client();
    let slices: Api<EndpointSlice> = Api::all(client.clone());
    server.apply_node(node("n1"));
    let rv0 = server.resource_version().to_string();
    let slice: EndpointSlice = serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"namespace": "default", "name": "web-abc", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.0.0.1"]}],
    }))
    .unwrap();
    server.apply_endpoint_slice(slice);
    server.delete_endpoint_slice("default", "web-abc");

    // History replays both changes to a watch from before them.
    let mut stream = slices
        .watch(&WatchParams::default(), &rv0)
        .await
        .unwrap()
        .boxed();
    assert!(
        matches!(next_change(&mut stream).await, WatchEvent::Added(s) if s.name_any() == "web-abc")
    );
    match next_change(&mut stream).await {
        WatchEvent::Deleted(s) => {
            let rv: u64 = s.resource_version().unwrap().parse().unwrap();
            assert_eq!(rv, server.resource_version());
        }
        other => panic!("expected DELETED, got {other:?}"),
    }

    // drop_watches ends the stream cleanly.
    server.drop_watches();
    let end = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .unwrap();
    assert!(end.is_none(), "stream should end, got {end:?}");

    // After compaction, a watch from the old version gets 410 Expired in-stream.
    server.compact();
    let mut stream = slices
        .watch(&WatchParams::default(), &rv0)
        .await
        .unwrap()
        .boxed();
    match next_change(&mut stream).await {
        WatchEvent::Error(e) => {
            assert_eq!(e.code, 410);
            assert_eq!(e.reason, "Expired");
        }
        other => panic!("expected ERROR 410, got {other:?}"),
    }
    // An exact list at the old version is 410 as an HTTP status.
    let err = slices
        .list(
            &ListParams::default()
                .at(&rv0)
                .matching(kube::api::VersionMatch::Exact),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 410),
        "{err:?}"
    );
}

#[tokio::test]
async fn bookmarks_and_streaming_initial_events() {
    let server = ApiServer::start().await;
    server.apply_service(service("default", "a", json!({})));
    let svcs: Api<Service> = Api::all(server.client());
    let wp = WatchParams::streaming_lists();
    // Refused as by kube-apiserver with the WatchList feature off (422)...
    let refused = svcs.watch(&wp, "0").await.err();
    assert!(
        matches!(&refused, Some(kube::Error::Api(s)) if s.code == 422),
        "{refused:?}"
    );
    // ... and served once on.
    server.set_watch_list(true);
    let mut stream = svcs.watch(&wp, "0").await.unwrap().boxed();
    assert!(matches!(next_event(&mut stream).await, WatchEvent::Added(s) if s.name_any() == "a"));
    match next_event(&mut stream).await {
        WatchEvent::Bookmark(b) => {
            assert_eq!(
                b.metadata
                    .annotations
                    .get("k8s.io/initial-events-end")
                    .map(String::as_str),
                Some("true")
            );
            assert_eq!(
                b.metadata.resource_version,
                server.resource_version().to_string()
            );
        }
        other => panic!("expected initial-events-end bookmark, got {other:?}"),
    }
    // Periodic bookmarks follow.
    assert!(matches!(
        next_event(&mut stream).await,
        WatchEvent::Bookmark(_)
    ));
}

#[tokio::test]
async fn down_server_refuses_requests_and_cuts_watches() {
    let server = ApiServer::start().await;
    server.apply_node(node("n1"));
    let nodes: Api<Node> = Api::all(server.client());
    let rv = server.resource_version().to_string();
    let mut stream = nodes
        .watch(&WatchParams::default().disable_bookmarks(), &rv)
        .await
        .unwrap()
        .boxed();
    server.set_down(true);
    // The cut connection ends the stream, with or without an error first.
    let cut = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(item) = stream.next().await {
            if item.is_err() {
                break;
            }
        }
    })
    .await;
    assert!(cut.is_ok(), "watch should end when the server goes down");
    assert!(nodes.list(&ListParams::default()).await.is_err());
    server.set_down(false);
    assert_eq!(
        nodes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );
}

#[tokio::test]
async fn events_are_stored_and_listed() {
    let server = ApiServer::start().await;
    let client = server.client();
    let events: Api<CoreEvent> = Api::namespaced(client.clone(), "default");
    let ev: CoreEvent = serde_json::from_value(json!({
        "metadata": {"generateName": "node-a.", "namespace": "default"},
        "involvedObject": {"kind": "Node", "name": "node-a"},
        "reason": "Starting",
        "message": "Starting kube-proxy-rs.",
        "type": "Normal",
        "source": {"component": "kube-proxy"},
    }))
    .unwrap();
    let created = events.create(&PostParams::default(), &ev).await.unwrap();
    assert!(created.name_any().starts_with("node-a."));
    assert_eq!(created.reason.as_deref(), Some("Starting"));

    let v1: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), "default");
    let ev1: k8s_openapi::api::events::v1::Event = serde_json::from_value(json!({
        "metadata": {"name": "node-a.start", "namespace": "default"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reason": "Starting",
        "action": "StartKubeProxy",
        "reportingController": "kube-proxy",
        "reportingInstance": "kube-proxy-node-a",
        "regarding": {"kind": "Node", "name": "node-a"},
        "type": "Normal",
    }))
    .unwrap();
    v1.create(&PostParams::default(), &ev1).await.unwrap();
    let dup = v1.create(&PostParams::default(), &ev1).await.unwrap_err();
    assert!(matches!(dup, kube::Error::Api(s) if s.code == 409));

    let stored = server.events();
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[0]["reason"], "Starting");
    assert_eq!(stored[1]["apiVersion"], "events.k8s.io/v1");
    assert_eq!(
        events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    assert_eq!(
        v1.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
}

#[tokio::test]
async fn kubeconfig_points_at_the_server() {
    let server = ApiServer::start().await;
    server.apply_node(node("n1"));
    let dir = std::env::temp_dir().join(format!("kp-testkit-kubeconfig-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config");
    server.write_kubeconfig(&path).unwrap();
    let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let client = kube::Client::try_from(config).unwrap();
    let nodes: Api<Node> = Api::all(client);
    let list = nodes.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items[0].name_any(), "n1");
}

#[tokio::test]
async fn shutdown_stops_serving() {
    let server = ApiServer::start().await;
    let client = server.client();
    let nodes: Api<Node> = Api::all(client);
    nodes.list(&ListParams::default()).await.unwrap();
    server.shutdown();
    let err = nodes.list(&ListParams::default()).await;
    assert!(err.is_err(), "a shut-down server must not answer: {err:?}");
}

#[tokio::test]
async fn resource_requests_are_recorded_as_rbac_sees_them() {
    let server = ApiServer::start().await;
    let client = server.client();
    assert!(server.api_calls().is_empty());
    let svcs: Api<Service> = Api::all(client.clone());
    svcs.list(&ListParams::default()).await.unwrap();
    let mut w = svcs
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    server.apply_service(service("default", "a", json!({})));
    let _ = next_change(&mut w).await;
    let nodes: Api<Node> = Api::all(client.clone());
    server.apply_node(node("n1"));
    nodes.get("n1").await.unwrap();
    let v1: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client, "default");
    let ev: k8s_openapi::api::events::v1::Event = serde_json::from_value(json!({
        "metadata": {"name": "e1"}, "eventTime": "2024-01-01T00:00:00.000000Z",
        "reportingController": "x", "reportingInstance": "y", "action": "A", "reason": "R"
    }))
    .unwrap();
    v1.create(&PostParams::default(), &ev).await.unwrap();
    let calls: Vec<(String, String, String)> = server
        .api_calls()
        .into_iter()
        .map(|c| (c.group, c.resource, c.verb))
        .collect();
    let s = |g: &str, r: &str, v: &str| (g.to_string(), r.to_string(), v.to_string());
    assert_eq!(
        calls,
        vec![
            s("", "nodes", "get"),
            s("", "services", "list"),
            s("", "services", "watch"),
            s("events.k8s.io", "events", "create"),
        ]
    );
}
