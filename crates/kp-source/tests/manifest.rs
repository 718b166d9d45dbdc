//! The manifest source: file formats, invalid documents, and change detection.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::path::{Path, PathBuf};
use std::time::Duration;

use kp_netlab::ScratchDir;
use kp_source::manifest::{load_dir, run_manifest_source, ObjectKey};
use kp_source::SourceEvent;
use tokio::sync::mpsc;

/// A scratch directory removed on drop, even when the test fails.
struct TempDir(ScratchDir);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        TempDir(ScratchDir::unique(&format!("kp-source-{tag}")).unwrap())
    }

    /// Writes atomically (temp file + rename), as a careful operator would,
    /// so a poll never sees a half-written file.
    fn write(&self, name: &str, text: &str) {
        let tmp = self.0.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.0.join(name)).unwrap();
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

fn key(ns: &str, name: &str) -> ObjectKey {
    ObjectKey {
        namespace: ns.into(),
        name: name.into(),
    }
}

/// What `kubectl get svc,endpointslices -A -o yaml` prints (trimmed to three
/// objects), with managedFields, status and server-set metadata.
const KUBECTL_LIST: &str = r#"apiVersion: v1
items:
- apiVersion: v1
  kind: Service
  metadata:
    creationTimestamp: "2025-05-02T09:12:44Z"
    labels:
      component: apiserver
      provider: kubernetes
    name: kubernetes
    namespace: default
    resourceVersion: "229"
    uid: 5d4c1b0e-6d3b-4c3e-9f1e-1f0a7b2c3d4e
  spec:
    clusterIP: 10.96.0.1
    clusterIPs:
    - 10.96.0.1
    internalTrafficPolicy: Cluster
    ipFamilies:
    - IPv4
    ipFamilyPolicy: SingleStack
    ports:
    - name: https
      port: 443
      protocol: TCP
      targetPort: 6443
    sessionAffinity: None
    type: ClusterIP
  status:
    loadBalancer: {}
- apiVersion: v1
  kind: Service
  metadata:
    annotations:
      kubectl.kubernetes.io/last-applied-configuration: |
        {"apiVersion":"v1","kind":"Service","metadata":{"annotations":{},"name":"web","namespace":"shop"},"spec":{"ports":[{"port":80,"targetPort":"http"}],"selector":{"app":"web"},"type":"NodePort"}}
    creationTimestamp: "2025-05-03T10:00:00Z"
    managedFields:
    - apiVersion: v1
      fieldsType: FieldsV1
      fieldsV1:
        f:metadata:
          f:annotations:
            .: {}
            f:kubectl.kubernetes.io/last-applied-configuration: {}
        f:spec:
          f:externalTrafficPolicy: {}
          f:ports:
            .: {}
            k:{"port":80,"protocol":"TCP"}:
              .: {}
              f:port: {}
              f:protocol: {}
              f:targetPort: {}
          f:selector: {}
          f:type: {}
      manager: kubectl-client-side-apply
      operation: Update
      time: "2025-05-03T10:00:00Z"
    name: web
    namespace: shop
    resourceVersion: "4711"
    uid: 0f9e8d7c-6b5a-4f3e-8d2c-1b0a9f8e7d6c
  spec:
    clusterIP: 10.96.14.7
    clusterIPs:
    - 10.96.14.7
    externalTrafficPolicy: Cluster
    internalTrafficPolicy: Cluster
    ipFamilies:
    - IPv4
    ipFamilyPolicy: SingleStack
    ports:
    - nodePort: 30080
      port: 80
      protocol: TCP
      targetPort: http
    selector:
      app: web
    sessionAffinity: None
    type: NodePort
  status:
    loadBalancer: {}
- addressType: IPv4
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses:
    - 10.244.1.5
    conditions:
      ready: true
      serving: true
      terminating: false
    nodeName: node-a
    targetRef:
      kind: Pod
      name: web-7d4b9c8f6-abcde
      namespace: shop
      uid: 11111111-2222-3333-4444-555555555555
    zone: zone-1
  - addresses:
    - 10.244.2.9
    conditions:
      ready: false
      serving: true
      terminating: true
    nodeName: node-b
  kind: EndpointSlice
  metadata:
    annotations:
      endpoints.kubernetes.io/last-change-trigger-time: "2025-05-03T10:00:05Z"
    creationTimestamp: "2025-05-03T10:00:00Z"
    generateName: web-
    generation: 3
    labels:
      endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io
      kubernetes.io/service-name: web
    name: web-x7k2p
    namespace: shop
    ownerReferences:
    - apiVersion: v1
      blockOwnerDeletion: true
      controller: true
      kind: Service
      name: web
      uid: 0f9e8d7c-6b5a-4f3e-8d2c-1b0a9f8e7d6c
    resourceVersion: "4720"
    uid: 99999999-8888-7777-6666-555555555555
  ports:
  - name: ""
    port: 8080
    protocol: TCP
- apiVersion: v1
  kind: ConfigMap
  metadata:
    name: not-for-us
    namespace: shop
  data:
    key: value
kind: List
metadata:
  resourceVersion: ""
"#;

#[test]
fn kubectl_list_with_mixed_kinds() {
    let dir = TempDir::new("list");
    dir.write("cluster.yaml", KUBECTL_LIST);
    let loaded = load_dir(dir.path()).unwrap();
    assert!(loaded.invalid.is_empty(), "{:?}", loaded.invalid);
    assert_eq!(
        loaded.services.keys().cloned().collect::<Vec<_>>(),
        [key("default", "kubernetes"), key("shop", "web")]
    );
    let web = &loaded.services[&key("shop", "web")];
    let spec = web.spec.as_ref().unwrap();
    assert_eq!(spec.type_.as_deref(), Some("NodePort"));
    assert_eq!(spec.ports.as_ref().unwrap()[0].node_port, Some(30080));
    assert_eq!(loaded.slices.len(), 1);
    let slice = &loaded.slices[&key("shop", "web-x7k2p")];
    assert_eq!(slice.endpoints.len(), 2);
    assert_eq!(
        slice.endpoints[1].conditions.as_ref().unwrap().terminating,
        Some(true)
    );
    assert_eq!(slice.ports.as_ref().unwrap()[0].port, Some(8080));
    assert!(loaded.nodes.is_empty());
}

#[test]
fn multi_document_yaml_json_and_defaults() {
    let dir = TempDir::new("multi");
    dir.write(
        "10-app.yaml",
        "# app manifests\n---\napiVersion: v1\nkind: Service\nmetadata:\n  name: api\nspec:\n  clusterIP: 10.96.0.20\n  ports:\n  - port: 8080\n---\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: api-1\n  labels:\n    kubernetes.io/service-name: api\naddressType: IPv4\nendpoints:\n- addresses: [\"10.0.0.7\"]\nports:\n- port: 8080\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: api\n---\napiVersion: serving.knative.dev/v1\nkind: Service\nmetadata:\n  name: knative-not-core\n...\n",
    );
    dir.write(
        "20-node.json",
        r#"{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "zone-1"}}}"#,
    );
    dir.write("README.md", "not a manifest: ignored\n");
    let loaded = load_dir(dir.path()).unwrap();
    assert!(loaded.invalid.is_empty(), "{:?}", loaded.invalid);
    assert_eq!(loaded.services.len(), 1);
    // A missing namespace means "default", in the key and in the object.
    let api = &loaded.services[&key("default", "api")];
    assert_eq!(api.metadata.namespace.as_deref(), Some("default"));
    assert_eq!(loaded.slices.len(), 1);
    assert!(loaded.slices.contains_key(&key("default", "api-1")));
    let node = &loaded.nodes["node-a"];
    assert_eq!(
        node.metadata.labels.as_ref().unwrap()["topology.kubernetes.io/zone"],
        "zone-1"
    );
}

#[test]
fn later_files_win_for_duplicates() {
    let dir = TempDir::new("dup");
    let svc = |ip: &str| {
        format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: s\n  namespace: ns\nspec:\n  clusterIP: {ip}\n")
    };
    dir.write("b.yaml", &svc("10.96.0.2"));
    dir.write("a.yaml", &svc("10.96.0.1"));
    let loaded = load_dir(dir.path()).unwrap();
    assert_eq!(loaded.services.len(), 1);
    let s = &loaded.services[&key("ns", "s")];
    assert_eq!(
        s.spec.as_ref().unwrap().cluster_ip.as_deref(),
        Some("10.96.0.2")
    );
}

const WITH_BROKEN: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: good\nspec:\n  clusterIP: 10.96.0.5\n---\napiVersion: v1\nkind: Service\nmetadata: {name: [unclosed\n---\napiVersion: v1\nkind: Service\nmetadata:\n  name: bad-ports\nspec:\n  ports: not-a-list\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: good-1\naddressType: IPv4\nendpoints: []\n";

#[test]
fn invalid_documents_are_reported_and_skipped() {
    let dir = TempDir::new("invalid");
    dir.write("mixed.yaml", WITH_BROKEN);
    dir.write("broken.json", "{\"apiVersion\": \"v1\", ");
    let loaded = load_dir(dir.path()).unwrap();
    assert_eq!(
        loaded.services.keys().cloned().collect::<Vec<_>>(),
        [key("default", "good")]
    );
    assert!(loaded.slices.contains_key(&key("default", "good-1")));
    assert_eq!(loaded.invalid.len(), 3, "{:?}", loaded.invalid);
    let msg = |needle: &str| {
        loaded
            .invalid
            .iter()
            .find(|m| m.contains(needle))
            .unwrap_or_else(|| panic!("no message with {needle:?} in {:?}", loaded.invalid))
    };
    assert!(msg("mixed.yaml document 2").contains("(starting at line 8)"));
    assert!(!msg("mixed.yaml document 2").contains('\n'));
    assert!(msg("mixed.yaml document 3").contains("Service"));
    assert!(msg("broken.json document 1").contains("EOF"));
}

#[test]
fn unreadable_directory_is_an_error() {
    let err = load_dir(Path::new("/nonexistent/kp-source-manifests")).unwrap_err();
    assert!(
        err.to_string().contains("/nonexistent/kp-source-manifests"),
        "{err}"
    );
}

/// Events received until `Synced` (inclusive).
async fn until_synced(rx: &mut mpsc::Receiver<SourceEvent>) -> Vec<SourceEvent> {
    let mut out = Vec::new();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("Synced within 10 s")
            .expect("source still running");
        let done = matches!(ev, SourceEvent::Synced);
        out.push(ev);
        if done {
            return out;
        }
    }
}

/// Events received until nothing arrives for a while (after at least one).
async fn next_batch(rx: &mut mpsc::Receiver<SourceEvent>) -> Vec<String> {
    let first = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a change within 10 s")
        .expect("source still running");
    let mut out = vec![describe(&first)];
    while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_millis(700), rx.recv()).await {
        out.push(describe(&ev));
    }
    out.sort();
    out
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
        SourceEvent::ServiceApplied(s) => format!("svc+ {}", name(&s.metadata)),
        SourceEvent::ServiceDeleted { namespace, name } => format!("svc- {namespace}/{name}"),
        SourceEvent::SliceApplied(s) => format!("slice+ {}", name(&s.metadata)),
        SourceEvent::SliceDeleted { namespace, name } => format!("slice- {namespace}/{name}"),
        SourceEvent::NodeApplied(n) => format!("node+ {}", name(&n.metadata)),
        SourceEvent::Synced => "synced".into(),
        SourceEvent::Disconnected(r) => format!("disconnected {r}"),
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

fn svc_yaml(ns: &str, name: &str, port: u16) -> String {
    format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n  clusterIP: 10.96.1.1\n  ports:\n  - port: {port}\n")
}

fn slice_yaml(ns: &str, name: &str, ip: &str) -> String {
    format!("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels:\n    kubernetes.io/service-name: x\naddressType: IPv4\nendpoints:\n- addresses: [\"{ip}\"]\n")
}

#[tokio::test]
async fn edits_additions_and_removals_send_exact_differences() {
    let dir = TempDir::new("watch");
    dir.write(
        "a.yaml",
        &format!(
            "{}---\n{}---\n{}",
            svc_yaml("ns", "one", 80),
            svc_yaml("ns", "two", 80),
            slice_yaml("ns", "one-1", "10.0.0.1")
        ),
    );
    dir.write("b.yaml", WITH_BROKEN);
    let (tx, mut rx) = mpsc::channel(64);
    let task = tokio::spawn(run_manifest_source(
        dir.path().to_owned(),
        Duration::from_millis(100),
        tx,
    ));

    let mut initial: Vec<String> = until_synced(&mut rx).await.iter().map(describe).collect();
    assert_eq!(initial.pop().as_deref(), Some("synced"));
    let invalid = initial.iter().filter(|e| e.starts_with("invalid ")).count();
    assert_eq!(invalid, 2, "{initial:?}");
    initial.retain(|e| !e.starts_with("invalid "));
    initial.sort();
    assert_eq!(
        initial,
        [
            "slice+ default/good-1",
            "slice+ ns/one-1",
            "svc+ default/good",
            "svc+ ns/one",
            "svc+ ns/two",
        ]
    );

    // Edit: only the changed Service is sent; the unchanged ones are not, and
    // known invalid documents are not reported again.
    dir.write(
        "a.yaml",
        &format!(
            "{}---\n{}---\n{}",
            svc_yaml("ns", "one", 8080),
            svc_yaml("ns", "two", 80),
            slice_yaml("ns", "one-1", "10.0.0.1")
        ),
    );
    assert_eq!(next_batch(&mut rx).await, ["svc+ ns/one"]);

    // Add a file.
    dir.write(
        "c.yaml",
        &format!(
            "{}---\n{}",
            svc_yaml("other", "three", 53),
            slice_yaml("other", "three-1", "10.0.0.3")
        ),
    );
    assert_eq!(
        next_batch(&mut rx).await,
        ["slice+ other/three-1", "svc+ other/three"]
    );

    // Remove a document from a file and a whole file.
    dir.write(
        "a.yaml",
        &format!(
            "{}---\n{}",
            svc_yaml("ns", "one", 8080),
            slice_yaml("ns", "one-1", "10.0.0.1")
        ),
    );
    assert_eq!(next_batch(&mut rx).await, ["svc- ns/two"]);
    std::fs::remove_file(dir.path().join("c.yaml")).unwrap();
    assert_eq!(
        next_batch(&mut rx).await,
        ["slice- other/three-1", "svc- other/three"]
    );

    // The source ends when the receiver goes away.
    drop(rx);
    let res = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("source returns after the channel closes")
        .unwrap();
    assert!(res.is_ok(), "{res:?}");
}

#[tokio::test]
async fn missing_directory_fails_at_start() {
    let (tx, _rx) = mpsc::channel(4);
    let res = run_manifest_source(
        PathBuf::from("/nonexistent/kp-source-manifests"),
        Duration::from_millis(100),
        tx,
    )
    .await;
    assert!(res.is_err());
}

#[tokio::test]
async fn transient_read_errors_keep_the_last_state() {
    let dir = TempDir::new("transient");
    dir.write("a.yaml", &svc_yaml("ns", "one", 80));
    let (tx, mut rx) = mpsc::channel(64);
    let task = tokio::spawn(run_manifest_source(
        dir.path().to_owned(),
        Duration::from_millis(100),
        tx,
    ));
    until_synced(&mut rx).await;
    // The directory disappears (e.g. a ConfigMap volume being swapped), then returns changed.
    let moved = dir.path().with_extension("moved");
    std::fs::rename(dir.path(), &moved).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    std::fs::rename(&moved, dir.path()).unwrap();
    dir.write("a.yaml", &svc_yaml("ns", "one", 443));
    // No deletion happened during the outage; just the edit arrives.
    assert_eq!(next_batch(&mut rx).await, ["svc+ ns/one"]);
    task.abort();
}

async fn next_event(rx: &mut mpsc::Receiver<SourceEvent>) -> SourceEvent {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a change within 10 s")
        .expect("source still running")
}

/// Nothing arrives for 800 ms (the source polls every 100 ms).
async fn assert_quiet(rx: &mut mpsc::Receiver<SourceEvent>) {
    let ev = tokio::time::timeout(Duration::from_millis(800), rx.recv()).await;
    assert!(
        ev.is_err(),
        "unexpected {:?}",
        ev.map(|e| e.as_ref().map(describe))
    );
}

/// The directory is read file by file (one file's objects in memory at a
/// time), yet an object defined in two files still ends as the later file's,
/// and once known as a duplicate the earlier version is never sent again:
/// a re-read sends only the winner, and only when it changed.
#[tokio::test]
async fn a_duplicate_across_files_ends_as_the_later_one_without_flipping() {
    let dir = TempDir::new("dups");
    dir.write("a.yaml", &svc_yaml("ns", "one", 80));
    dir.write("b.yaml", &svc_yaml("ns", "one", 443));
    dir.write("c.yaml", &svc_yaml("ns", "other", 53));
    let (tx, mut rx) = mpsc::channel(64);
    let task = tokio::spawn(run_manifest_source(
        dir.path().to_owned(),
        Duration::from_millis(100),
        tx,
    ));
    let port = |ev: &SourceEvent| match ev {
        SourceEvent::ServiceApplied(s) if s.metadata.name.as_deref() == Some("one") => s
            .spec
            .as_ref()
            .and_then(|sp| sp.ports.as_ref())
            .map(|p| p[0].port),
        _ => None,
    };
    let initial = until_synced(&mut rx).await;
    let ports: Vec<i32> = initial.iter().filter_map(port).collect();
    // The first read cannot know about the duplicate before it meets it.
    assert_eq!(
        ports,
        [80, 443],
        "{:?}",
        initial.iter().map(describe).collect::<Vec<_>>()
    );

    // Another file changes: the duplicate is not sent at all.
    dir.write("c.yaml", &svc_yaml("ns", "other", 5353));
    assert_eq!(next_batch(&mut rx).await, ["svc+ ns/other"]);

    // The earlier copy changes: still nothing for the consumer (the later wins).
    dir.write("a.yaml", &svc_yaml("ns", "one", 8080));
    assert_quiet(&mut rx).await;

    // The later copy changes: exactly the new winner, once.
    dir.write("b.yaml", &svc_yaml("ns", "one", 8443));
    let ev = next_event(&mut rx).await;
    assert_eq!(port(&ev), Some(8443));
    assert_quiet(&mut rx).await;

    // The later copy goes: the earlier one is what is left, nothing deleted.
    std::fs::remove_file(dir.path().join("b.yaml")).unwrap();
    let ev = next_event(&mut rx).await;
    assert_eq!(port(&ev), Some(8080));
    assert_quiet(&mut rx).await;
    task.abort();
}

fn cidr_yaml(name: &str, cidrs: &str) -> String {
    format!("apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata:\n  name: {name}\nspec:\n  cidrs: [{cidrs}]\n")
}

#[tokio::test]
async fn service_cidrs_are_read_changed_and_deleted() {
    let dir = TempDir::new("cidrs");
    dir.write(
        "cidrs.yaml",
        &format!(
            "{}---\n{}---\n{}",
            cidr_yaml("kubernetes", "10.96.0.0/16, fd00:96::/108"),
            // No name: reported, the rest still loads.
            "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nspec:\n  cidrs: [10.1.0.0/16]\n",
            // Another group's kind of the same name is not ours.
            "apiVersion: example.com/v1\nkind: ServiceCIDR\nmetadata:\n  name: other\n",
        ),
    );
    // A list, as `kubectl get servicecidrs -o yaml` writes it.
    dir.write(
        "list.yaml",
        &format!(
            "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDRList\nitems:\n- {}",
            cidr_yaml("extra", "10.97.0.0/24").replace('\n', "\n  ")
        ),
    );
    let (tx, mut rx) = mpsc::channel(64);
    let task = tokio::spawn(run_manifest_source(
        dir.path().to_owned(),
        Duration::from_millis(100),
        tx,
    ));
    let mut initial: Vec<String> = until_synced(&mut rx).await.iter().map(describe).collect();
    assert_eq!(initial.pop().as_deref(), Some("synced"));
    initial.sort();
    assert_eq!(initial.len(), 3, "{initial:?}");
    assert_eq!(initial[0], "cidr+ extra=10.97.0.0/24");
    assert_eq!(initial[1], "cidr+ kubernetes=10.96.0.0/16,fd00:96::/108");
    assert!(
        initial[2].starts_with("invalid ")
            && initial[2].contains("ServiceCIDR has no metadata.name"),
        "{initial:?}"
    );

    // A second range added to the object: sent again; the list file's
    // object is gone: deleted.
    dir.write(
        "cidrs.yaml",
        &cidr_yaml("kubernetes", "10.96.0.0/16, 10.98.0.0/16"),
    );
    std::fs::remove_file(dir.path().join("list.yaml")).unwrap();
    assert_eq!(
        next_batch(&mut rx).await,
        ["cidr+ kubernetes=10.96.0.0/16,10.98.0.0/16", "cidr- extra"]
    );
    drop(rx);
    let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
}
