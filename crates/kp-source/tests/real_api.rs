//! The API source against a real kube-apiserver v1.36 and etcd
//! (kp_testkit::ControlPlane on loopback): it lists and watches all four
//! kinds over protobuf. With the WatchList feature on and etcd 3.5 (test.sh
//! fetches Debian trixie's), it starts with streaming lists: no LIST at
//! all. With the feature off (422), or over etcd 3.4 (no progress
//! notifications: v1.36 answers a streaming list with 200 and then a 500
//! ERROR event), its lists are served from the watch cache (no etcd list
//! for Services or EndpointSlices, which the server's own /metrics count).
//! The same objects read as JSON and as protobuf are the same k8s-openapi
//! objects.
//!
//! Skips loudly without the Kubernetes binaries (fails instead under
//! KP_REQUIRE_REAL_APISERVER=1).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::time::Duration;

use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kp_source::api::{run_api_source, ApiSourceOptions, DEFAULT_LABEL_SELECTOR};
use kp_source::codec::Format;
use kp_source::objects::WireObject;
use kp_source::SourceEvent;
use kp_testkit::{objects, prom, ControlPlane, ControlPlaneOpts, K8sBinaries};
use serde_json::{json, Value};
use tokio::sync::mpsc;

const NODE: &str = "node-a";

fn control_plane(test: &str, args: &[&str]) -> Option<(ControlPlane, K8sBinaries)> {
    let bins = K8sBinaries::for_test(test)?;
    let mut o = ControlPlaneOpts::on_loopback(test);
    o.apiserver_args = args.iter().map(|s| s.to_string()).collect();
    Some((ControlPlane::start(&bins, o).expect("control plane"), bins))
}

/// How the source is expected to start.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Start {
    /// Streaming lists: no LIST request at all.
    Streaming,
    /// Lists from the watch cache.
    CachedLists,
}

async fn client(cp: &ControlPlane) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(cp.admin_kubeconfig()).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    kube::Client::try_from(cfg).unwrap()
}

fn apply(cp: &ControlPlane, items: Vec<Value>) {
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    cp.kubectl_stdin(
        &[
            "apply",
            "--server-side",
            "--field-manager=kp-test",
            "-f",
            "-",
        ],
        Some(list.to_string().as_bytes()),
    )
    .unwrap();
}

fn service(i: usize) -> Value {
    objects::service("default", &format!("svc-{i}"))
        .port_json(json!({"name": "http", "port": 80, "targetPort": 8080}))
        .json()
}

fn slice(i: usize, ip: &str) -> Value {
    objects::slice("default", &format!("svc-{i}-1"), &format!("svc-{i}"))
        .endpoint_on(ip, NODE)
        .port("http", 8080, "TCP")
        .json()
}

/// etcd list calls (all kinds) and watch-cache lists for Services and
/// EndpointSlices.
fn list_counts(cp: &ControlPlane) -> [f64; 4] {
    let m = cp.kubectl(&["get", "--raw", "/metrics"]).unwrap();
    let etcd = |r: &str| {
        prom::total(
            &m,
            "etcd_requests_total",
            &["operation=\"list\"", &format!("resource=\"{r}\"")],
        )
    };
    let cache = |r: &str| {
        prom::total(
            &m,
            "apiserver_cache_list_total",
            &[&format!("resource=\"{r}\"")],
        )
    };
    [
        etcd("services"),
        etcd("endpointslices"),
        cache("services"),
        cache("endpointslices"),
    ]
}

struct Source {
    rx: mpsc::Receiver<SourceEvent>,
    task: tokio::task::JoinHandle<Result<(), kp_source::SourceError>>,
}

impl Drop for Source {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn start(client: kube::Client) -> Source {
    let (tx, rx) = mpsc::channel(4096);
    let opts = ApiSourceOptions {
        node_name: NODE.into(),
        label_selector: Some(DEFAULT_LABEL_SELECTOR.into()),
        encoding: Default::default(),
        streaming_lists: true,
    };
    Source {
        rx,
        task: tokio::spawn(run_api_source(client, opts, tx)),
    }
}

impl Source {
    /// Events until `done` holds for one (inclusive).
    async fn until(&mut self, what: &str, done: impl Fn(&SourceEvent) -> bool) -> Vec<SourceEvent> {
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let ev = tokio::time::timeout_at(deadline, self.rx.recv())
                .await
                .unwrap_or_else(|_| panic!("no {what} within 60 s; got {} events", got.len()))
                .expect("source running");
            let end = done(&ev);
            got.push(ev);
            if end {
                return got;
            }
        }
    }
}

/// Starts a source against a server with `args`, N Services and slices:
/// synced, a change arrives through the watch, every kind went over
/// protobuf, and no list reached etcd; started as `expect` says (None:
/// streaming where the server can, i.e. over etcd 3.5+).
async fn lists_over_protobuf(test: &str, args: &[&str], expect: Option<Start>) {
    let Some((cp, bins)) = control_plane(test, args) else {
        return;
    };
    let etcd = bins.etcd_version();
    let expect = expect.unwrap_or_else(|| match etcd {
        Some(v) if v >= (3, 5) => Start::Streaming,
        _ => {
            // CI runs test.sh, which provides etcd 3.5: there the streaming
            // path must be the one checked.
            assert!(
                std::env::var(kp_testkit::REQUIRE_ENV).ok().as_deref() != Some("1"),
                "{test}: etcd {etcd:?} at {} cannot serve streaming lists; test.sh fetches Debian trixie's etcd 3.5 (ETCD_BIN)",
                bins.etcd.display()
            );
            eprintln!("{test}: etcd {etcd:?} has no progress notifications: checking the fallback to cached lists");
            Start::CachedLists
        }
    });
    // The process-wide response counts: one such test at a time.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _one = ONE_AT_A_TIME.lock().await;
    let responses_before = kp_source::reflector::responses();
    const N: usize = 40;
    let mut objs: Vec<Value> = (0..N).map(service).collect();
    objs.extend((0..N).map(|i| slice(i, &format!("10.1.0.{}", i + 1))));
    // A headless Service: left out on the server, as upstream's informer
    // asks (spec.clusterIP!=None).
    objs.push(json!({"apiVersion": "v1", "kind": "Service",
                     "metadata": {"namespace": "default", "name": "headless"},
                     "spec": {"clusterIP": "None", "ports": [{"port": 80}]}}));
    objs.push(json!({"apiVersion": "v1", "kind": "Node",
                     "metadata": {"name": NODE, "labels": {"topology.kubernetes.io/zone": "z1"}}}));
    apply(&cp, objs);
    let client = client(&cp).await;

    // A list by another client of the server's may land in the window now
    // and then; lists of ours from etcd would land in every attempt.
    let mut deltas = Vec::new();
    for _ in 0..3 {
        let before = list_counts(&cp);
        let mut src = start(client.clone());
        let evs = src
            .until("Synced", |e| matches!(e, SourceEvent::Synced))
            .await;
        let after = list_counts(&cp);
        let svcs = evs
            .iter()
            .filter(|e| matches!(e, SourceEvent::ServiceApplied(_)))
            .count();
        let slices = evs
            .iter()
            .filter(|e| matches!(e, SourceEvent::SliceApplied(_)))
            .count();
        assert!(
            !evs.iter().any(|e| matches!(e, SourceEvent::ServiceApplied(s) if s.metadata.name.as_deref() == Some("headless"))),
            "the headless Service was listed"
        );
        // N and the `kubernetes` Service; N slices (the apiserver's own
        // has no EndpointSlice controller here).
        assert!(svcs > N && slices >= N, "{svcs} services, {slices} slices");
        assert!(
            evs.iter().any(|e| matches!(e, SourceEvent::NodeApplied(_))),
            "no Node"
        );
        assert!(
            evs.iter()
                .any(|e| matches!(e, SourceEvent::ServiceCidrApplied(_))),
            "no ServiceCIDR"
        );
        // The watches carry changes.
        apply(&cp, vec![slice(0, "10.9.9.9")]);
        src.until("the changed slice", |e| {
            matches!(e, SourceEvent::SliceApplied(s) if s.endpoints[0].addresses[0] == "10.9.9.9")
        })
        .await;
        apply(&cp, vec![slice(0, "10.1.0.1")]);
        let mut changed = service(0);
        changed["metadata"]["labels"] = json!({"kp-test": "changed"});
        apply(&cp, vec![changed]);
        src.until("the changed Service", |e| {
            matches!(e, SourceEvent::ServiceApplied(s) if s.metadata.labels.as_ref().is_some_and(|l| l.contains_key("kp-test")))
        })
        .await;
        apply(&cp, vec![service(0)]);
        let d: Vec<f64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
        eprintln!(
            "{test}: etcd lists services/endpointslices +{}/+{}, cache lists +{}/+{}",
            d[0], d[1], d[2], d[3]
        );
        match expect {
            // Served from the watch cache: counted there.
            Start::CachedLists => assert!(
                d[2] >= 1.0 && d[3] >= 1.0,
                "no list served from the watch cache: {d:?}"
            ),
            // No list at all: the watch cache streamed the initial state.
            Start::Streaming => assert!(
                d[2] == 0.0 && d[3] == 0.0,
                "lists served from the watch cache where a streaming list was expected: {d:?}"
            ),
        }
        deltas.push(d);
        if deltas.last().is_some_and(|d| d[0] == 0.0 && d[1] == 0.0) {
            break;
        }
    }
    assert!(
        deltas.iter().any(|d| d[0] == 0.0 && d[1] == 0.0),
        "etcd list calls for services/endpointslices grew in every start: {deltas:?}"
    );
    // This test's responses (other tests of the process count too).
    let mut r = kp_source::reflector::responses();
    for (k, n) in responses_before {
        if let Some(v) = r.get_mut(&k) {
            *v -= n;
        }
    }
    r.retain(|_, n| *n > 0);
    let verbs: &[&str] = match expect {
        Start::CachedLists => &["list", "watch"],
        Start::Streaming => &["watch"],
    };
    for kind in ["Service", "EndpointSlice", "Node", "ServiceCIDR"] {
        for verb in verbs {
            assert!(
                r.get(&(kind, *verb, "protobuf")).copied().unwrap_or(0) >= 1,
                "no protobuf {verb} of {kind}: {r:?}"
            );
        }
        if expect == Start::Streaming {
            assert!(
                !r.keys().any(|(k, v, _)| *k == kind && *v == "list"),
                "a list of {kind} where a streaming list was expected: {r:?}"
            );
        }
    }
    assert!(
        r.keys().all(|(_, _, f)| *f == "protobuf"),
        "a response in JSON: {r:?}"
    );
}

#[tokio::test]
async fn watch_list_on_streams_the_initial_state_over_protobuf() {
    lists_over_protobuf("wl-on", &[], None).await;
}

#[tokio::test]
async fn watch_list_off_falls_back_to_cached_lists_over_protobuf() {
    lists_over_protobuf(
        "wl-off",
        &["--feature-gates=WatchList=false"],
        Some(Start::CachedLists),
    )
    .await;
}

/// GETs `K`'s collection as `accept`; the body decoded by its Content-Type.
async fn fetch<K: WireObject>(client: &kube::Client, accept: &str) -> (Format, Vec<K>) {
    let req = http::Request::get(K::PATH)
        .header(http::header::ACCEPT, accept)
        .body(kube::client::Body::from(Vec::new()))
        .unwrap();
    let res = client.send(req).await.unwrap();
    assert!(res.status().is_success(), "{}", res.status());
    let ct = res
        .headers()
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_string());
    let format = Format::of(ct.as_deref()).unwrap();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let (_, items) = K::list(format, &body).unwrap();
    (format, items)
}

/// The objects the server sends as JSON and as protobuf, decoded, are the
/// same objects: what objects.rs makes of protobuf's "unset" matches JSON
/// for every field these objects set (and the fields the proxy reads).
#[tokio::test]
async fn the_same_objects_from_json_and_protobuf() {
    let Some((cp, _)) = control_plane("json-pb", &[]) else {
        return;
    };
    apply(
        &cp,
        vec![
            json!({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"namespace": "default", "name": "lb",
                                "labels": {"app": "web"}, "annotations": {"a": "b"}},
                   "spec": {"type": "LoadBalancer", "externalTrafficPolicy": "Local",
                            "ipFamilyPolicy": "PreferDualStack", "sessionAffinity": "ClientIP",
                            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
                            "externalIPs": ["192.0.2.77"], "loadBalancerSourceRanges": ["198.51.100.0/24"],
                            "trafficDistribution": "PreferClose", "internalTrafficPolicy": "Local",
                            "selector": {"app": "web"},
                            "ports": [{"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP",
                                       "appProtocol": "http"},
                                      {"name": "dns", "port": 53, "targetPort": 5353, "protocol": "UDP"}]}}),
            json!({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"namespace": "default", "name": "plain"},
                   "spec": {"ports": [{"port": 8080}]}}),
            json!({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"namespace": "default", "name": "headless"},
                   "spec": {"clusterIP": "None", "ports": [{"port": 8080}]}}),
            json!({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"namespace": "default", "name": "ext"},
                   "spec": {"type": "ExternalName", "externalName": "example.com"}}),
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"namespace": "default", "name": "lb-1",
                                "labels": {"kubernetes.io/service-name": "lb"},
                                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-01-02T03:04:05Z"}},
                   "addressType": "IPv4",
                   "endpoints": [
                       {"addresses": ["10.1.0.1"], "conditions": {"ready": true, "serving": true, "terminating": false},
                        "nodeName": NODE, "zone": "z1", "hostname": "pod-a",
                        "targetRef": {"kind": "Pod", "namespace": "default", "name": "pod-a", "uid": "1234"},
                        "hints": {"forZones": [{"name": "z1"}], "forNodes": [{"name": NODE}]}},
                       {"addresses": ["10.1.0.2"], "conditions": {"ready": false, "serving": true, "terminating": true}},
                       {"addresses": ["10.1.0.3"], "conditions": {}}],
                   "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"},
                             {"name": "", "port": 5353, "protocol": "UDP"}]}),
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"namespace": "default", "name": "empty-1",
                                "labels": {"kubernetes.io/service-name": "plain"}},
                   "addressType": "IPv6", "endpoints": []}),
            json!({"apiVersion": "v1", "kind": "Node",
                   "metadata": {"name": NODE, "labels": {"topology.kubernetes.io/zone": "z1"}},
                   "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:244:1::/64"],
                            "providerID": "kind://x", "unschedulable": true,
                            "taints": [{"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"}]}}),
            json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                   "metadata": {"name": "extra"}, "spec": {"cidrs": ["10.97.0.0/24"]}}),
        ],
    );
    cp.kubectl(&[
        "patch", "service", "lb", "--subresource=status", "--type=merge", "-p",
        r#"{"status":{"loadBalancer":{"ingress":[{"ip":"203.0.113.7","ipMode":"Proxy","ports":[{"port":80,"protocol":"TCP"}]},{"hostname":"lb.example.com"}]}}}"#,
    ])
    .unwrap();
    cp.kubectl(&[
        "patch", "node", NODE, "--subresource=status", "--type=merge", "-p",
        r#"{"status":{"addresses":[{"type":"InternalIP","address":"192.0.2.10"},{"type":"Hostname","address":"node-a"}]}}"#,
    ])
    .unwrap();
    let client = client(&cp).await;
    const PB: &str = "application/vnd.kubernetes.protobuf";

    async fn same<K: WireObject + PartialEq + std::fmt::Debug>(
        client: &kube::Client,
        normalize: impl Fn(&mut K),
    ) -> usize {
        let (f, mut from_json) = fetch::<K>(client, "application/json").await;
        assert_eq!(f, Format::Json);
        let (f, from_pb) = fetch::<K>(client, PB).await;
        assert_eq!(f, Format::Protobuf);
        from_json.iter_mut().for_each(normalize);
        assert_eq!(from_json.len(), from_pb.len());
        for (j, p) in from_json.iter().zip(&from_pb) {
            assert_eq!(j, p, "{} differs between JSON and protobuf", K::KIND);
        }
        from_pb.len()
    }
    let n = same::<Service>(&client, |s| s.metadata.managed_fields = None).await;
    assert!(n >= 5, "{n} services");
    same::<EndpointSlice>(&client, |s| s.metadata.managed_fields = None).await;
    same::<Node>(&client, |n| {
        n.metadata.managed_fields = None;
        // The proxy reads only the addresses of a Node's status.
        if let Some(st) = &mut n.status {
            *st = k8s_openapi::api::core::v1::NodeStatus {
                addresses: st.addresses.take(),
                ..Default::default()
            };
        }
    })
    .await;
    same::<ServiceCIDR>(&client, |c| {
        c.metadata.managed_fields = None;
        c.status = None;
    })
    .await;
}
