//! An in-process Kubernetes API server for tests.
//!
//! It implements the parts of the API that kube-proxy-rs uses, with the real
//! wire protocol: typed lists carrying a collection `resourceVersion`, watches
//! streaming newline-delimited watch events from a resourceVersion, label and
//! field selectors, bookmarks, `410 Expired` after compaction, and Event
//! creation. It speaks JSON only, as a server without protobuf would: an
//! `Accept` header that allows no JSON is answered 406. Streaming lists
//! (`sendInitialEvents`) are refused with 422, as kube-apiserver v1.36
//! refuses them with its WatchList feature off, unless
//! [`ApiServer::set_watch_list`] turns them on. One global, monotonically increasing
//! resourceVersion covers every object, as with etcd.
//!
//! Control methods on [`ApiServer`] change objects (every change is seen by
//! open watches), forget history ([`ApiServer::compact`]), cut watch streams
//! ([`ApiServer::drop_watches`]) and simulate an outage
//! ([`ApiServer::set_down`]): while down, every connection is closed at once,
//! so clients see transport errors (not a 503, which kube's client would retry
//! for minutes by itself).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;
use tracing::{debug, warn};

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// How often an open watch that asked for bookmarks gets one.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);
/// Buffered changes per watch before a slow watcher is cut off (it resumes
/// from its last resourceVersion, as with a real server).
const CHANGE_BUFFER: usize = 4096;

/// The kinds of object the server stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    Service,
    EndpointSlice,
    Node,
    CoreEvent,
    EventV1,
    ServiceCidr,
}

impl Kind {
    fn api_version(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node | Kind::CoreEvent => "v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::EventV1 => "events.k8s.io/v1",
            Kind::ServiceCidr => "networking.k8s.io/v1",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::CoreEvent | Kind::EventV1 => "Event",
            Kind::ServiceCidr => "ServiceCIDR",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Kind::Service => "services",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "nodes",
            Kind::CoreEvent | Kind::EventV1 => "events",
            Kind::ServiceCidr => "servicecidrs",
        }
    }

    fn namespaced(self) -> bool {
        !matches!(self, Kind::Node | Kind::ServiceCidr)
    }

    /// The resource behind `/api/v1/<plural>` or `/apis/<group>/v1/<plural>`.
    fn from_path(group: &str, plural: &str) -> Option<Kind> {
        match (group, plural) {
            ("", "services") => Some(Kind::Service),
            ("", "nodes") => Some(Kind::Node),
            ("", "events") => Some(Kind::CoreEvent),
            ("discovery.k8s.io", "endpointslices") => Some(Kind::EndpointSlice),
            ("events.k8s.io", "events") => Some(Kind::EventV1),
            ("networking.k8s.io", "servicecidrs") => Some(Kind::ServiceCidr),
            _ => None,
        }
    }
}

type ObjKey = (String, String);

/// One kind of resource request: what an RBAC rule has to allow for it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ApiCall {
    /// API group ("" for core).
    pub group: String,
    /// Plural resource name.
    pub resource: String,
    /// get, list, watch, create, patch, update, delete.
    pub verb: String,
}

/// One watch served, as [`ApiServer::watches`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchLog {
    pub plural: String,
    /// The `resourceVersion` asked for ("" when none).
    pub resource_version: String,
    /// A streaming list (`sendInitialEvents=true`).
    pub streaming: bool,
}

/// One stored change, kept in history for watches that resume from an older
/// resourceVersion.
#[derive(Debug)]
struct Change {
    rv: u64,
    kind: Kind,
    /// State before the change (None for a creation).
    old: Option<Value>,
    /// State after the change (None for a deletion).
    new: Option<Value>,
    /// For a deletion: the last state stamped with the deletion's resourceVersion.
    deleted: Option<Value>,
}

#[derive(Default)]
struct Store {
    rv: u64,
    /// Watches from a resourceVersion below this get 410 Expired.
    compacted: u64,
    objects: HashMap<Kind, BTreeMap<ObjKey, Value>>,
    history: Vec<Arc<Change>>,
    events: Vec<Value>,
    uid_seq: u64,
}

/// Changes kept for watches that resume: a soak writes millions, and a real
/// API server forgets too (etcd compacts every 5 minutes). Past this, the
/// oldest half goes and resuming from before it answers 410 Expired.
const HISTORY_LIMIT: usize = 50_000;

impl Store {
    fn record(&mut self, change: Arc<Change>) {
        self.history.push(change);
        if self.history.len() > HISTORY_LIMIT {
            self.history.drain(..HISTORY_LIMIT / 2);
            if let Some(first) = self.history.first() {
                self.compacted = self.compacted.max(first.rv - 1);
            }
        }
    }
}

struct State {
    store: Mutex<Store>,
    changes: broadcast::Sender<Arc<Change>>,
    /// Bumped to end every open watch stream gracefully.
    watch_gen: watch::Sender<u64>,
    /// Bumped to drop every open connection abruptly.
    kill_gen: watch::Sender<u64>,
    /// Bumped to end every open watch in the middle of an event line.
    trunc_gen: watch::Sender<u64>,
    down: AtomicBool,
    requests: AtomicU64,
    /// Resource requests seen, as RBAC sees them.
    calls: Mutex<std::collections::BTreeSet<ApiCall>>,
    list_delays: Mutex<HashMap<String, Duration>>,
    /// Lists (not watches) of these plurals answer this HTTP status.
    list_errors: Mutex<HashMap<String, u16>>,
    /// When each list (not watch) arrived, by plural.
    list_log: Mutex<Vec<(String, std::time::Instant)>>,
    /// Watches served: plural, the resourceVersion asked for, streaming.
    watch_log: Mutex<Vec<WatchLog>>,
    /// Streaming lists served (the WatchList feature on).
    watch_list: AtomicBool,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock leaves consistent data (every mutation
        // is completed before anything can panic), so poisoning is ignored.
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn list_delay(&self, plural: &str) -> Option<Duration> {
        self.list_delays
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(plural)
            .copied()
    }

    /// Stores `obj` (create or replace) and notifies watches. Keeps uid and
    /// creationTimestamp of an existing object, like an update would.
    fn put(&self, kind: Kind, mut obj: Value) -> Result<Value, Status> {
        let mut store = self.lock();
        let meta = ensure_meta(&mut obj);
        let name = meta
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        if name.is_empty() {
            return Err(Status::invalid("metadata.name is required"));
        }
        let ns = if kind.namespaced() {
            let ns = meta
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .unwrap_or("default")
                .to_owned();
            meta.insert("namespace".into(), Value::String(ns.clone()));
            ns
        } else {
            meta.remove("namespace");
            String::new()
        };
        let key = (ns, name);
        let old = store.objects.get(&kind).and_then(|m| m.get(&key)).cloned();
        store.rv += 1;
        let rv = store.rv;
        let (uid, created) = match &old {
            Some(o) => (
                o["metadata"]["uid"].clone(),
                o["metadata"]["creationTimestamp"].clone(),
            ),
            None => {
                store.uid_seq += 1;
                (
                    Value::String(format!("00000000-0000-4000-8000-{:012x}", store.uid_seq)),
                    Value::String(rfc3339_now()),
                )
            }
        };
        let meta = ensure_meta(&mut obj);
        meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
        meta.insert("uid".into(), uid);
        meta.insert("creationTimestamp".into(), created);
        if let Some(o) = obj.as_object_mut() {
            o.insert("apiVersion".into(), kind.api_version().into());
            o.insert("kind".into(), kind.kind().into());
        }
        store
            .objects
            .entry(kind)
            .or_default()
            .insert(key, obj.clone());
        if matches!(kind, Kind::CoreEvent | Kind::EventV1) {
            store.events.push(obj.clone());
        }
        let change = Arc::new(Change {
            rv,
            kind,
            old,
            new: Some(obj.clone()),
            deleted: None,
        });
        store.record(change.clone());
        // No receivers is fine: nobody is watching.
        let _ = self.changes.send(change);
        Ok(obj)
    }

    fn delete(&self, kind: Kind, ns: &str, name: &str) -> Option<Value> {
        let mut store = self.lock();
        let key = (
            if kind.namespaced() { ns } else { "" }.to_owned(),
            name.to_owned(),
        );
        let old = store.objects.get_mut(&kind)?.remove(&key)?;
        store.rv += 1;
        let rv = store.rv;
        let mut deleted = old.clone();
        ensure_meta(&mut deleted).insert("resourceVersion".into(), rv.to_string().into());
        let change = Arc::new(Change {
            rv,
            kind,
            old: Some(old),
            new: None,
            deleted: Some(deleted.clone()),
        });
        store.record(change.clone());
        let _ = self.changes.send(change);
        Some(deleted)
    }
}

fn ensure_meta(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.is_object() {
        *obj = Value::Object(Map::new());
    }
    let o = match obj.as_object_mut() {
        Some(o) => o,
        None => unreachable!("just made an object"),
    };
    let meta = o
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if !meta.is_object() {
        *meta = Value::Object(Map::new());
    }
    match meta.as_object_mut() {
        Some(m) => m,
        None => unreachable!("just made an object"),
    }
}

/// The current time as the API server writes it: RFC 3339, whole seconds.
fn rfc3339_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    kp_model::format_rfc3339(UNIX_EPOCH + Duration::from_secs(secs))
}

/// A Kubernetes `Status` failure.
#[derive(Debug)]
struct Status {
    code: u16,
    reason: &'static str,
    message: String,
}

impl Status {
    fn invalid(msg: &str) -> Status {
        Status {
            code: 422,
            reason: "Invalid",
            message: msg.to_owned(),
        }
    }
    fn bad_request(msg: String) -> Status {
        Status {
            code: 400,
            reason: "BadRequest",
            message: msg,
        }
    }
    fn not_found(what: String) -> Status {
        Status {
            code: 404,
            reason: "NotFound",
            message: format!("{what} not found"),
        }
    }
    fn expired(rv: u64, compacted: u64) -> Status {
        Status {
            code: 410,
            reason: "Expired",
            message: format!("too old resource version: {rv} ({compacted})"),
        }
    }
    fn to_json(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        })
    }
    fn response(&self) -> Response<Body> {
        json_response(
            StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            &self.to_json(),
        )
    }
}

fn json_response(code: StatusCode, v: &Value) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::from(v.to_string())).boxed_unsync());
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// One `labelSelector` requirement.
#[derive(Debug, Clone)]
enum LabelReq {
    Eq(String, String),
    NotEq(String, String),
    Exists(String),
    NotExists(String),
}

fn parse_label_selector(s: &str) -> Result<Vec<LabelReq>, Status> {
    let mut out = Vec::new();
    for term in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let bad = || Status::bad_request(format!("unsupported label selector term {term:?}"));
        let req = if let Some((k, v)) = term.split_once("!=") {
            LabelReq::NotEq(k.trim().to_owned(), v.trim().to_owned())
        } else if let Some((k, v)) = term.split_once("==") {
            LabelReq::Eq(k.trim().to_owned(), v.trim().to_owned())
        } else if let Some((k, v)) = term.split_once('=') {
            LabelReq::Eq(k.trim().to_owned(), v.trim().to_owned())
        } else if let Some(k) = term.strip_prefix('!') {
            LabelReq::NotExists(k.trim().to_owned())
        } else {
            LabelReq::Exists(term.to_owned())
        };
        let key = match &req {
            LabelReq::Eq(k, _)
            | LabelReq::NotEq(k, _)
            | LabelReq::Exists(k)
            | LabelReq::NotExists(k) => k,
        };
        if key.is_empty() || key.contains([' ', '(', ')', '!']) {
            return Err(bad());
        }
        out.push(req);
    }
    Ok(out)
}

/// One `fieldSelector` requirement: metadata.name and metadata.namespace,
/// and spec.clusterIP (a Service's, as the real server has it).
#[derive(Debug, Clone)]
struct FieldReq {
    field: String,
    value: String,
    negate: bool,
}

fn parse_field_selector(s: &str) -> Result<Vec<FieldReq>, Status> {
    let mut out = Vec::new();
    for term in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (field, value, negate) = if let Some((k, v)) = term.split_once("!=") {
            (k, v, true)
        } else if let Some((k, v)) = term.split_once("==") {
            (k, v, false)
        } else if let Some((k, v)) = term.split_once('=') {
            (k, v, false)
        } else {
            return Err(Status::bad_request(format!(
                "invalid field selector term {term:?}"
            )));
        };
        if !matches!(
            field,
            "metadata.name" | "metadata.namespace" | "spec.clusterIP"
        ) {
            return Err(Status::bad_request(format!(
                "field label not supported: {field}"
            )));
        }
        out.push(FieldReq {
            field: field.to_owned(),
            value: value.to_owned(),
            negate,
        });
    }
    Ok(out)
}

/// Which objects a list or watch covers.
#[derive(Debug, Clone)]
struct Filter {
    kind: Kind,
    namespace: Option<String>,
    labels: Vec<LabelReq>,
    fields: Vec<FieldReq>,
}

impl Filter {
    fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        let ns = meta["namespace"].as_str().unwrap_or("");
        let name = meta["name"].as_str().unwrap_or("");
        if let Some(want) = &self.namespace {
            if ns != want {
                return false;
            }
        }
        let labels = meta["labels"].as_object();
        let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        let labels_ok = self.labels.iter().all(|r| match r {
            LabelReq::Eq(k, v) => label(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => label(k) != Some(v.as_str()),
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::NotExists(k) => label(k).is_none(),
        });
        let fields_ok = self.fields.iter().all(|r| {
            let actual = match r.field.as_str() {
                "metadata.name" => name,
                "metadata.namespace" => ns,
                // Only Services have the field; the real server refuses it
                // for other kinds, here it matches nothing else.
                _ if self.kind == Kind::Service => obj["spec"]["clusterIP"].as_str().unwrap_or(""),
                _ => return false,
            };
            (actual == r.value) != r.negate
        });
        labels_ok && fields_ok
    }

    /// The watch event a change means for this filter, if any. An object that
    /// stops matching is reported DELETED, as the real server does.
    fn event_for(&self, ch: &Change) -> Option<Value> {
        if ch.kind != self.kind {
            return None;
        }
        let was = ch.old.as_ref().is_some_and(|o| self.matches(o));
        match (&ch.new, &ch.deleted) {
            (Some(new), _) => {
                let is = self.matches(new);
                match (was, is) {
                    (false, true) => Some(watch_event("ADDED", new)),
                    (true, true) => Some(watch_event("MODIFIED", new)),
                    (true, false) => Some(watch_event("DELETED", new)),
                    (false, false) => None,
                }
            }
            (None, Some(del)) if was => Some(watch_event("DELETED", del)),
            _ => None,
        }
    }
}

fn watch_event(typ: &str, obj: &Value) -> Value {
    json!({ "type": typ, "object": obj })
}

fn line(v: &Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

/// Handle to a running test API server. Clones share the server; it shuts
/// down when the last clone is dropped or on [`ApiServer::shutdown`].
#[derive(Clone)]
pub struct ApiServer {
    inner: Arc<Inner>,
}

struct Inner {
    state: Arc<State>,
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        stop(&self.state, &self.shutdown);
    }
}

fn stop(state: &State, shutdown: &watch::Sender<bool>) {
    shutdown.send_replace(true);
    state.kill_gen.send_modify(|g| *g += 1);
}

impl ApiServer {
    /// Binds 127.0.0.1 on a free port and serves in the background on the
    /// current tokio runtime.
    ///
    /// # Panics
    /// If no loopback port can be bound (the test cannot run at all then).
    pub async fn start() -> ApiServer {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the test API server on 127.0.0.1");
        let addr = listener
            .local_addr()
            .expect("local address of the test API server");
        let (changes, _) = broadcast::channel(CHANGE_BUFFER);
        let state = Arc::new(State {
            store: Mutex::new(Store::default()),
            changes,
            watch_gen: watch::Sender::new(0),
            kill_gen: watch::Sender::new(0),
            trunc_gen: watch::Sender::new(0),
            down: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            calls: Mutex::default(),
            list_delays: Mutex::new(HashMap::new()),
            list_errors: Mutex::new(HashMap::new()),
            list_log: Mutex::new(Vec::new()),
            watch_log: Mutex::new(Vec::new()),
            watch_list: AtomicBool::new(false),
        });
        let (shutdown, shutdown_rx) = watch::channel(false);
        tokio::spawn(accept_loop(listener, state.clone(), shutdown_rx));
        debug!(%addr, "test API server listening");
        ApiServer {
            inner: Arc::new(Inner {
                state,
                addr,
                shutdown,
            }),
        }
    }

    fn state(&self) -> &State {
        &self.inner.state
    }

    /// `http://127.0.0.1:<port>`
    pub fn url(&self) -> String {
        format!("http://{}", self.inner.addr)
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// Creates or replaces a Service (namespace defaults to "default").
    pub fn apply_service(&self, svc: Service) {
        self.apply(Kind::Service, &svc);
    }

    /// Creates or replaces a Service given as JSON: what a real API server
    /// serves but k8s-openapi's `Service` cannot hold (a status condition
    /// without its `lastTransitionTime`, say).
    pub fn apply_service_json(&self, svc: Value) {
        self.apply(Kind::Service, &svc);
    }

    pub fn delete_service(&self, namespace: &str, name: &str) {
        self.state().delete(Kind::Service, namespace, name);
    }

    /// Creates or replaces an EndpointSlice (namespace defaults to "default").
    pub fn apply_endpoint_slice(&self, slice: EndpointSlice) {
        self.apply(Kind::EndpointSlice, &slice);
    }

    pub fn delete_endpoint_slice(&self, namespace: &str, name: &str) {
        self.state().delete(Kind::EndpointSlice, namespace, name);
    }

    pub fn apply_node(&self, node: Node) {
        self.apply(Kind::Node, &node);
    }

    pub fn delete_node(&self, name: &str) {
        self.state().delete(Kind::Node, "", name);
    }

    /// Creates or replaces a ServiceCIDR (networking.k8s.io/v1, cluster-scoped).
    pub fn apply_service_cidr(&self, obj: &serde_json::Value) {
        self.apply(Kind::ServiceCidr, obj);
    }

    pub fn delete_service_cidr(&self, name: &str) {
        self.state().delete(Kind::ServiceCidr, "", name);
    }

    fn apply<T: serde::Serialize>(&self, kind: Kind, obj: &T) {
        let value = match serde_json::to_value(obj) {
            Ok(v) => v,
            Err(e) => panic!(
                "test object of kind {} does not serialize: {e}",
                kind.kind()
            ),
        };
        if let Err(e) = self.state().put(kind, value) {
            panic!(
                "test object of kind {} rejected: {}",
                kind.kind(),
                e.message
            );
        }
    }

    /// Forgets all history: a watch, exact or paginated list from any resourceVersion
    /// handed out before this call gets 410 Expired (the resourceVersion is
    /// advanced past every earlier one, as other writes would in a real cluster).
    pub fn compact(&self) {
        let mut store = self.state().lock();
        store.rv += 1;
        store.compacted = store.rv;
        store.history.clear();
    }

    /// Ends every open watch stream cleanly (clients resume from their last
    /// resourceVersion).
    pub fn drop_watches(&self) {
        self.state().watch_gen.send_modify(|g| *g += 1);
    }

    /// Ends every open watch stream in the middle of an event: half a JSON
    /// line, then the end of the response (a proxy or server dying mid-write).
    pub fn truncate_watches(&self) {
        self.state().trunc_gen.send_modify(|g| *g += 1);
    }

    /// While down, every open connection (and so every watch) is cut and new
    /// connections are closed as soon as they are accepted.
    pub fn set_down(&self, down: bool) {
        self.state().down.store(down, Ordering::SeqCst);
        if down {
            self.state().kill_gen.send_modify(|g| *g += 1);
        }
    }

    /// Serves streaming lists (`sendInitialEvents=true` watches), as a
    /// server with the WatchList feature on; off, they are refused with
    /// v1.36's 422.
    pub fn set_watch_list(&self, on: bool) {
        self.state().watch_list.store(on, Ordering::SeqCst);
    }

    /// Delays every list (not watch) of `plural` ("services", "endpointslices",
    /// "nodes") by `delay`; `Duration::ZERO` removes the delay.
    pub fn set_list_delay(&self, plural: &str, delay: Duration) {
        let mut d = self
            .state()
            .list_delays
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if delay.is_zero() {
            d.remove(plural);
        } else {
            d.insert(plural.to_owned(), delay);
        }
    }

    /// Makes every list (not watch) of `plural` answer HTTP `code` (e.g. 500);
    /// `None` serves them again.
    pub fn set_list_error(&self, plural: &str, code: Option<u16>) {
        let mut e = self
            .state()
            .list_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match code {
            Some(c) => e.insert(plural.to_owned(), c),
            None => e.remove(plural),
        };
    }

    /// When each list (not watch) of `plural` arrived, in order.
    /// The watches of `plural` served so far, in order.
    pub fn watches(&self, plural: &str) -> Vec<WatchLog> {
        self.state()
            .watch_log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|w| w.plural == plural)
            .cloned()
            .collect()
    }

    pub fn lists(&self, plural: &str) -> Vec<std::time::Instant> {
        self.state()
            .list_log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(p, _)| p == plural)
            .map(|(_, t)| *t)
            .collect()
    }

    /// Every distinct resource request served so far, as an RBAC rule would
    /// name it (API group, resource, verb), sorted. Discovery paths (`/api`,
    /// `/apis`, `/version`) are not resource requests and are not listed.
    pub fn api_calls(&self) -> Vec<ApiCall> {
        self.state()
            .calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// HTTP requests served so far (connections closed while down not included).
    pub fn request_count(&self) -> u64 {
        self.state().requests.load(Ordering::SeqCst)
    }

    /// Every Event created through the API (core/v1 and events.k8s.io/v1), in order.
    pub fn events(&self) -> Vec<Value> {
        self.state().lock().events.clone()
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.state().lock().rv
    }

    /// Writes a kubeconfig pointing at this server (plain HTTP, no auth).
    pub fn write_kubeconfig(&self, path: &Path) -> io::Result<()> {
        let text = format!(
            "apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: testkit\n  cluster:\n    server: {url}\n\
             contexts:\n\
             - name: testkit\n  context:\n    cluster: testkit\n    user: testkit\n    namespace: default\n\
             current-context: testkit\n\
             users:\n\
             - name: testkit\n  user: {{}}\n",
            url = self.url()
        );
        std::fs::write(path, text)
    }

    /// A kube client for this server.
    ///
    /// # Panics
    /// If kube cannot build a client for a plain loopback URL (a kube bug).
    pub fn client(&self) -> kube::Client {
        let uri = self
            .url()
            .parse()
            .expect("the test API server URL is a valid URI");
        kube::Client::try_from(kube::Config::new(uri)).expect("kube client for the test API server")
    }

    /// Stops accepting connections and cuts every open one. Also happens when
    /// the last handle is dropped.
    pub fn shutdown(&self) {
        stop(&self.inner.state, &self.inner.shutdown);
    }
}

async fn accept_loop(
    listener: TcpListener,
    state: Arc<State>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|s| *s) => break,
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors and the like: back off briefly.
                warn!("test API server accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // Subscribe before checking `down` so a concurrent set_down(true)
        // cannot be missed.
        let mut kill = state.kill_gen.subscribe();
        kill.borrow_and_update();
        if state.down.load(Ordering::SeqCst) || *shutdown.borrow() {
            drop(stream);
            continue;
        }
        let st = state.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let st = st.clone();
                async move { Ok::<_, Infallible>(handle(st, req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                r = conn => if let Err(e) = r { debug!("test API server connection: {e}") },
                _ = kill.changed() => {}
            }
        });
    }
}

fn query_map(req: &Request<Incoming>) -> HashMap<String, String> {
    req.uri()
        .query()
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

fn is_true(q: &HashMap<String, String>, k: &str) -> bool {
    matches!(q.get(k).map(String::as_str), Some("1" | "true"))
}

/// Whether an `Accept` header admits JSON, the only encoding served.
fn accepts_json(req: &Request<Incoming>) -> bool {
    let Some(accept) = req.headers().get(hyper::header::ACCEPT) else {
        return true;
    };
    accept.to_str().unwrap_or("").split(',').any(|t| {
        let media = t.split(';').next().unwrap_or("").trim();
        matches!(media, "application/json" | "application/*" | "*/*" | "")
    })
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    state.requests.fetch_add(1, Ordering::SeqCst);
    if !accepts_json(&req) {
        return Status {
            code: 406,
            reason: "NotAcceptable",
            message:
                "the server was unable to respond with a content type that the client supports"
                    .into(),
        }
        .response();
    }
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    debug!(%method, uri = %req.uri(), "test API server request");
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let result = match (method.clone(), segs.as_slice()) {
        (Method::GET, ["version"]) => Ok(json_response(StatusCode::OK, &version())),
        (Method::GET, ["api"]) => Ok(json_response(StatusCode::OK, &api_versions())),
        (Method::GET, ["apis"]) => Ok(json_response(StatusCode::OK, &api_groups())),
        (Method::GET, ["api", "v1"]) => Ok(json_response(StatusCode::OK, &resources("v1"))),
        (Method::GET, ["apis", group, "v1"]) if !resources_of(group).is_empty() => Ok(
            json_response(StatusCode::OK, &resources(&format!("{group}/v1"))),
        ),
        _ => match resolve(&segs) {
            Some((kind, ns, name)) => {
                let verb = match (&method, name) {
                    (&Method::GET, Some(_)) => "get",
                    (&Method::GET, None) if is_true(&query_map(&req), "watch") => "watch",
                    (&Method::GET, None) => "list",
                    (&Method::POST, _) => "create",
                    (&Method::PATCH, _) => "patch",
                    (&Method::PUT, _) => "update",
                    (&Method::DELETE, _) => "delete",
                    _ => "other",
                };
                let group = kind.api_version().rsplit_once('/').map_or("", |(g, _)| g);
                state
                    .calls
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(ApiCall {
                        group: group.to_owned(),
                        resource: kind.plural().to_owned(),
                        verb: verb.to_owned(),
                    });
                route(&state, method, req, kind, ns.map(str::to_owned), name).await
            }
            None => Err(Status::not_found(format!("path {path}"))),
        },
    };
    result.unwrap_or_else(|s| s.response())
}

/// Maps a resource path to (kind, namespace, name).
fn resolve<'a>(segs: &[&'a str]) -> Option<(Kind, Option<&'a str>, Option<&'a str>)> {
    let (group, rest) = match segs {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", group, "v1", rest @ ..] => (*group, rest),
        _ => return None,
    };
    let (ns, plural, name) = match rest {
        ["namespaces", ns, plural] => (Some(*ns), *plural, None),
        ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name)),
        [plural] => (None, *plural, None),
        [plural, name] => (None, *plural, Some(*name)),
        _ => return None,
    };
    let kind = Kind::from_path(group, plural)?;
    if ns.is_some() && !kind.namespaced() {
        return None;
    }
    if !kind.namespaced() && name.is_none() && ns.is_none() {
        return Some((kind, None, None));
    }
    if kind.namespaced() && ns.is_none() && name.is_some() {
        return None;
    }
    Some((kind, ns, name))
}

async fn route(
    state: &Arc<State>,
    method: Method,
    req: Request<Incoming>,
    kind: Kind,
    ns: Option<String>,
    name: Option<&str>,
) -> Result<Response<Body>, Status> {
    let q = query_map(&req);
    match (method, name) {
        (Method::GET, Some(name)) => {
            let key = (ns.clone().unwrap_or_default(), name.to_owned());
            let store = state.lock();
            match store.objects.get(&kind).and_then(|m| m.get(&key)) {
                Some(obj) => Ok(json_response(StatusCode::OK, obj)),
                None => Err(Status::not_found(format!("{} {name:?}", kind.plural()))),
            }
        }
        (Method::GET, None) => {
            let filter = Filter {
                kind,
                namespace: ns,
                labels: parse_label_selector(q.get("labelSelector").map_or("", String::as_str))?,
                fields: parse_field_selector(q.get("fieldSelector").map_or("", String::as_str))?,
            };
            if is_true(&q, "watch") {
                start_watch(state, filter, &q)
            } else {
                let plural = kind.plural();
                state
                    .list_log
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((plural.to_owned(), std::time::Instant::now()));
                if let Some(d) = state.list_delay(plural) {
                    tokio::time::sleep(d).await;
                }
                let failing = state
                    .list_errors
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(plural)
                    .copied();
                if let Some(code) = failing {
                    return Err(Status {
                        code,
                        reason: "InternalError",
                        message: format!("injected failure listing {plural}"),
                    });
                }
                list(state, &filter, &q)
            }
        }
        (Method::POST, None) => {
            let Some(ns) = ns.filter(|_| kind.namespaced()) else {
                return Err(Status {
                    code: 405,
                    reason: "MethodNotAllowed",
                    message: "create is only served on namespaced collections".into(),
                });
            };
            let body = req
                .into_body()
                .collect()
                .await
                .map_err(|e| Status::bad_request(format!("reading request body: {e}")))?
                .to_bytes();
            let mut obj: Value = serde_json::from_slice(&body)
                .map_err(|e| Status::bad_request(format!("request body is not JSON: {e}")))?;
            let meta = ensure_meta(&mut obj);
            meta.insert("namespace".into(), Value::String(ns.clone()));
            let has_name = meta
                .get("name")
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty());
            if !has_name {
                let prefix = meta
                    .get("generateName")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                if prefix.is_empty() {
                    return Err(Status::invalid("metadata.name or generateName is required"));
                }
                let suffix = state.lock().rv + 1;
                meta.insert(
                    "name".into(),
                    Value::String(format!("{prefix}{suffix:05x}")),
                );
            }
            let name = meta
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let exists = state
                .lock()
                .objects
                .get(&kind)
                .is_some_and(|m| m.contains_key(&(ns.clone(), name.clone())));
            if exists {
                return Err(Status {
                    code: 409,
                    reason: "AlreadyExists",
                    message: format!("{} {name:?} already exists", kind.plural()),
                });
            }
            let stored = state.put(kind, obj)?;
            Ok(json_response(StatusCode::CREATED, &stored))
        }
        (m, _) => Err(Status {
            code: 405,
            reason: "MethodNotAllowed",
            message: format!("{m} is not served by the test API server"),
        }),
    }
}

fn parse_rv(q: &HashMap<String, String>) -> Result<Option<u64>, Status> {
    match q.get("resourceVersion").map(String::as_str) {
        None | Some("") => Ok(None),
        Some(s) => s
            .parse::<u64>()
            .map(Some)
            .map_err(|_| Status::bad_request(format!("invalid resourceVersion {s:?}"))),
    }
}

fn list(
    state: &State,
    filter: &Filter,
    q: &HashMap<String, String>,
) -> Result<Response<Body>, Status> {
    let rv = parse_rv(q)?;
    let store = state.lock();
    // A list that must be served at exactly that version needs history: an
    // Exact match, or a paginated list (the real server reads etcd at that
    // revision then). "Not older than" and "any" (0) are served from now.
    if let Some(rv) = rv {
        let exact = q.get("resourceVersionMatch").map(String::as_str) == Some("Exact");
        let paged = q.get("limit").is_some_and(|l| l != "0");
        if (exact || paged) && rv != 0 && rv < store.compacted {
            return Err(Status::expired(rv, store.compacted));
        }
    }
    let items: Vec<Value> = store
        .objects
        .get(&filter.kind)
        .map(|m| m.values().filter(|o| filter.matches(o)).cloned().collect())
        .unwrap_or_default();
    let body = json!({
        "kind": format!("{}List", filter.kind.kind()),
        "apiVersion": filter.kind.api_version(),
        "metadata": { "resourceVersion": store.rv.to_string() },
        "items": items,
    });
    Ok(json_response(StatusCode::OK, &body))
}

struct WatchCtx {
    state: Arc<State>,
    filter: Filter,
    pending: VecDeque<Bytes>,
    rx: broadcast::Receiver<Arc<Change>>,
    gen: watch::Receiver<u64>,
    trunc: watch::Receiver<u64>,
    deadline: Instant,
    bookmarks: bool,
    tick: tokio::time::Interval,
    done: bool,
}

fn bookmark(kind: Kind, rv: u64, initial_end: bool) -> Value {
    let mut meta = json!({ "resourceVersion": rv.to_string() });
    if initial_end {
        meta["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
    }
    watch_event(
        "BOOKMARK",
        &json!({ "kind": kind.kind(), "apiVersion": kind.api_version(), "metadata": meta }),
    )
}

fn start_watch(
    state: &Arc<State>,
    filter: Filter,
    q: &HashMap<String, String>,
) -> Result<Response<Body>, Status> {
    let rv = parse_rv(q)?;
    let send_initial = is_true(q, "sendInitialEvents");
    if send_initial && !state.watch_list.load(Ordering::SeqCst) {
        // kube-apiserver v1.36 with --feature-gates=WatchList=false, word
        // for word.
        return Err(Status::invalid(
            "ListOptions.meta.k8s.io \"\" is invalid: sendInitialEvents: Forbidden: sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled",
        ));
    }
    if send_initial && q.get("resourceVersionMatch").map(String::as_str) != Some("NotOlderThan") {
        return Err(Status::invalid(
            "ListOptions.meta.k8s.io \"\" is invalid: resourceVersionMatch: Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
        ));
    }
    state
        .watch_log
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(WatchLog {
            plural: filter.kind.plural().to_owned(),
            resource_version: q.get("resourceVersion").cloned().unwrap_or_default(),
            streaming: send_initial,
        });
    let bookmarks = is_true(q, "allowWatchBookmarks");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(1800);
    let mut pending = VecDeque::new();
    let mut done = false;
    let mut gen = state.watch_gen.subscribe();
    gen.borrow_and_update();
    let mut trunc = state.trunc_gen.subscribe();
    trunc.borrow_and_update();
    let rx = {
        let store = state.lock();
        // Subscribing under the lock: every change after the backlog below is
        // delivered through `rx`, with no gap and no duplicate.
        let rx = state.changes.subscribe();
        let current = || -> Vec<Value> {
            store
                .objects
                .get(&filter.kind)
                .map(|m| m.values().filter(|o| filter.matches(o)).cloned().collect())
                .unwrap_or_default()
        };
        match (rv, send_initial) {
            (_, true) => {
                for obj in current() {
                    pending.push_back(line(&watch_event("ADDED", &obj)));
                }
                pending.push_back(line(&bookmark(filter.kind, store.rv, true)));
            }
            // Unset or 0: the current state as ADDED events, then changes.
            (None | Some(0), false) => {
                for obj in current() {
                    pending.push_back(line(&watch_event("ADDED", &obj)));
                }
            }
            (Some(rv), false) if rv < store.compacted => {
                pending.push_back(line(&watch_event(
                    "ERROR",
                    &Status::expired(rv, store.compacted).to_json(),
                )));
                done = true;
            }
            (Some(rv), false) => {
                for ch in store.history.iter().filter(|c| c.rv > rv) {
                    if let Some(ev) = filter.event_for(ch) {
                        pending.push_back(line(&ev));
                    }
                }
            }
        }
        rx
    };
    let mut tick = tokio::time::interval_at(Instant::now() + BOOKMARK_INTERVAL, BOOKMARK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ctx = WatchCtx {
        state: state.clone(),
        filter,
        pending,
        rx,
        gen,
        trunc,
        deadline: Instant::now() + Duration::from_secs(timeout),
        bookmarks,
        tick,
        done,
    };
    let stream = futures::stream::unfold(ctx, |mut ctx| async move {
        loop {
            if let Some(b) = ctx.pending.pop_front() {
                return Some((Ok::<_, Infallible>(Frame::data(b)), ctx));
            }
            if ctx.done {
                return None;
            }
            tokio::select! {
                _ = ctx.gen.changed() => ctx.done = true,
                _ = ctx.trunc.changed() => {
                    ctx.pending.push_back(Bytes::from_static(b"{\"type\":\"MODIFIED\",\"object\":{\"apiVersion\":\"v1\",\"kind\":"));
                    ctx.done = true;
                }
                _ = tokio::time::sleep_until(ctx.deadline) => ctx.done = true,
                r = ctx.rx.recv() => match r {
                    Ok(ch) => {
                        if let Some(ev) = ctx.filter.event_for(&ch) {
                            ctx.pending.push_back(line(&ev));
                        }
                    }
                    // Lagged or closed: end the stream; the client resumes
                    // from its last resourceVersion (history still has it).
                    Err(_) => ctx.done = true,
                },
                _ = ctx.tick.tick(), if ctx.bookmarks => {
                    let store = ctx.state.lock();
                    // Changes are broadcast under the lock, so an empty
                    // receiver means every change up to store.rv was seen.
                    if ctx.rx.is_empty() {
                        ctx.pending.push_back(line(&bookmark(ctx.filter.kind, store.rv, false)));
                    }
                }
            }
        }
    });
    let body = StreamBody::new(stream.boxed()).boxed_unsync();
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

fn version() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": "v1.33.0",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-04-23T00:00:00Z",
        "goVersion": "go1.24.2",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

fn api_versions() -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{ "clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1" }],
    })
}

fn api_groups() -> Value {
    let group = |name: &str| {
        let gv = format!("{name}/v1");
        json!({
            "name": name,
            "versions": [{ "groupVersion": gv, "version": "v1" }],
            "preferredVersion": { "groupVersion": gv, "version": "v1" },
        })
    };
    json!({
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [group("discovery.k8s.io"), group("events.k8s.io"), group("networking.k8s.io")],
    })
}

fn resources_of(group: &str) -> Vec<Kind> {
    match group {
        "" | "v1" => vec![Kind::Service, Kind::Node, Kind::CoreEvent],
        "discovery.k8s.io" | "discovery.k8s.io/v1" => vec![Kind::EndpointSlice],
        "events.k8s.io" | "events.k8s.io/v1" => vec![Kind::EventV1],
        "networking.k8s.io" | "networking.k8s.io/v1" => vec![Kind::ServiceCidr],
        _ => Vec::new(),
    }
}

fn resources(group_version: &str) -> Value {
    let list: Vec<Value> = resources_of(group_version)
        .into_iter()
        .map(|k| {
            let verbs: &[&str] = if matches!(k, Kind::CoreEvent | Kind::EventV1) {
                &["create", "get", "list", "watch"]
            } else {
                &["get", "list", "watch"]
            };
            json!({
                "name": k.plural(),
                "singularName": k.kind().to_lowercase(),
                "namespaced": k.namespaced(),
                "kind": k.kind(),
                "verbs": verbs,
            })
        })
        .collect();
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": list,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_selector_parsing_and_matching() {
        let f = Filter {
            kind: Kind::Service,
            namespace: None,
            labels: parse_label_selector(
                "!service.kubernetes.io/service-proxy-name,app=web,tier!=db,zone",
            )
            .unwrap(),
            fields: Vec::new(),
        };
        let obj =
            |labels: Value| json!({"metadata": {"name": "a", "namespace": "ns", "labels": labels}});
        assert!(f.matches(&obj(json!({"app": "web", "zone": "z"}))));
        assert!(!f.matches(&obj(json!({"app": "web"}))));
        assert!(!f.matches(&obj(json!({"app": "web", "zone": "z", "tier": "db"}))));
        assert!(!f.matches(&obj(
            json!({"app": "web", "zone": "z", "service.kubernetes.io/service-proxy-name": "x"})
        )));
        assert!(parse_label_selector("app in (a,b)").is_err());
    }

    #[test]
    fn field_selector_by_name() {
        let f = Filter {
            kind: Kind::Node,
            namespace: None,
            labels: Vec::new(),
            fields: parse_field_selector("metadata.name=node-a").unwrap(),
        };
        assert!(f.matches(&json!({"metadata": {"name": "node-a"}})));
        assert!(!f.matches(&json!({"metadata": {"name": "node-b"}})));
        assert!(parse_field_selector("spec.nodeName=x").is_err());
    }

    #[test]
    fn rfc3339_has_the_right_shape() {
        let s = rfc3339_now();
        assert_eq!(s.len(), 20, "{s}");
        assert!(s.ends_with('Z') && s.as_bytes()[10] == b'T', "{s}");
        assert!(s.starts_with("20"), "{s}");
    }

    #[test]
    fn paths_resolve() {
        let r = |p: &str| {
            let segs: Vec<&str> = p.trim_matches('/').split('/').collect();
            resolve(&segs).map(|(k, ns, n)| (k, ns.map(str::to_owned), n.map(str::to_owned)))
        };
        assert_eq!(r("/api/v1/services"), Some((Kind::Service, None, None)));
        assert_eq!(
            r("/api/v1/namespaces/a/services/b"),
            Some((Kind::Service, Some("a".into()), Some("b".into())))
        );
        assert_eq!(
            r("/apis/discovery.k8s.io/v1/namespaces/a/endpointslices"),
            Some((Kind::EndpointSlice, Some("a".into()), None))
        );
        assert_eq!(
            r("/api/v1/nodes/n1"),
            Some((Kind::Node, None, Some("n1".into())))
        );
        assert_eq!(r("/api/v1/namespaces/a/nodes"), None);
        assert_eq!(r("/api/v1/services/x"), None);
        assert_eq!(
            r("/apis/events.k8s.io/v1/namespaces/default/events"),
            Some((Kind::EventV1, Some("default".into()), None))
        );
    }
}
