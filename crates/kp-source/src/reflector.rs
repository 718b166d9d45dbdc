//! The loop that carries out listwatch.rs's decisions for one resource over
//! `kube::Client::send`: it builds each request, reads the answer (a list
//! body, or a watch's frames as they arrive), decodes it (objects.rs,
//! codec.rs) and feeds it back to the state machine, yielding what the API
//! source consumes: kube-runtime's watcher events (`Init`, `InitApply`,
//! `InitDone`, `Apply`, `Delete`) and the failures worth reporting.
//!
//! Protobuf is asked for first (`Accept`, as upstream's client); the answer
//! is decoded by its Content-Type, so a server that answers JSON is read as
//! JSON. A server that refuses the Accept header (406, 415) or answers a
//! media type we cannot read gets `application/json` from then on, for
//! that resource, said once in the log.
//!
//! Lists ask for gzip when the client's stack decompresses (the binary's
//! does); watches ask for none (`identity`): a gzipped watch stream is one
//! gzip member per event, which tower-http's decoder does not read past.

use std::collections::{BTreeMap, VecDeque};
use std::marker::PhantomData;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use http_body_util::BodyExt;
use kube::runtime::watcher::Event;
use kube::Client;
use tokio::time::Instant;
use tracing::{debug, info, trace, warn};

use crate::codec::{self, ApiStatus, CodecError, EventType, Format, Frames};
use crate::listwatch::{ListWatch, Next, Request, Role, Step};
use crate::objects::WireObject;

/// The `Accept` header upstream's client sends with its default content
/// type (`application/vnd.kubernetes.protobuf`).
pub const ACCEPT_PROTOBUF: &str = "application/vnd.kubernetes.protobuf, */*";

/// Which encodings to ask for: upstream's `clientConnection.contentType`
/// (`--kube-api-content-type`) and `acceptContentTypes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoding {
    /// The `Accept` header of lists and watches.
    pub accept: String,
}

impl Default for Encoding {
    fn default() -> Encoding {
        Encoding {
            accept: ACCEPT_PROTOBUF.to_string(),
        }
    }
}

impl Encoding {
    /// As client-go builds it: `acceptContentTypes` when set, else the
    /// content type followed by `*/*`.
    pub fn new(content_type: &str, accept_content_types: &str) -> Encoding {
        let accept = if !accept_content_types.trim().is_empty() {
            accept_content_types.trim().to_string()
        } else if !content_type.trim().is_empty() {
            format!("{}, */*", content_type.trim())
        } else {
            ACCEPT_PROTOBUF.to_string()
        };
        Encoding { accept }
    }

    /// JSON only.
    pub fn json() -> Encoding {
        Encoding {
            accept: codec::JSON.to_string(),
        }
    }
}

/// What one resource's loop watches.
#[derive(Clone, Debug)]
pub struct Params {
    pub labels: Option<String>,
    pub fields: Option<String>,
    pub encoding: Encoding,
    /// Try streaming lists first (as upstream's client).
    pub streaming: bool,
}

/// A failure the loop reports.
#[derive(Debug, thiserror::Error)]
pub enum ReflectError {
    #[error("{verb} {path}: {status}")]
    Refused {
        verb: &'static str,
        path: &'static str,
        status: ApiStatus,
    },
    #[error("{verb} {path}: {source}")]
    Transport {
        verb: &'static str,
        path: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{verb} {path}: {source}")]
    Decode {
        verb: &'static str,
        path: &'static str,
        #[source]
        source: CodecError,
    },
    #[error("watch {path}: error event: {status}")]
    Event {
        path: &'static str,
        status: ApiStatus,
    },
}

impl ReflectError {
    /// The HTTP code the server answered, if it answered.
    pub fn code(&self) -> Option<u16> {
        match self {
            ReflectError::Refused { status, .. } | ReflectError::Event { status, .. } => {
                Some(status.code)
            }
            _ => None,
        }
    }
}

/// What a loop yields.
pub type Item<K> = Result<Event<K>, ReflectError>;

/// Responses read, by resource, verb and encoding: how the tests and the
/// measurements see which encoding the server answered in.
static RESPONSES: Mutex<BTreeMap<(&'static str, &'static str, &'static str), u64>> =
    Mutex::new(BTreeMap::new());

fn count(kind: &'static str, verb: &'static str, format: Format) {
    let f = match format {
        Format::Protobuf => "protobuf",
        Format::Json => "json",
    };
    if let Ok(mut m) = RESPONSES.lock() {
        *m.entry((kind, verb, f)).or_default() += 1;
    }
}

/// Successful responses this process read so far, as
/// (kind, "list" | "watch", "protobuf" | "json") -> count.
pub fn responses() -> BTreeMap<(&'static str, &'static str, &'static str), u64> {
    RESPONSES.lock().map(|m| m.clone()).unwrap_or_default()
}

/// The wait after the `failures`-th failure in a row: 0.8 s doubling up to
/// 30 s, times 0.5 to 1.5 (`jitter` in [0, 1)); kube-runtime's default
/// policy, which the API source used before this loop.
pub fn retry_delay(failures: u32, jitter: f64) -> Duration {
    let base = (0.8 * 2f64.powi(failures.saturating_sub(1).min(16) as i32)).min(30.0);
    Duration::from_secs_f64(base * (0.5 + jitter.clamp(0.0, 1.0)))
}

/// A number in [0, 1) that differs between processes and calls (jitter
/// needs no more than that).
pub fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// client-go's watch timeout: 5 minutes times 1 to 2, so that the watches
/// of a cluster's nodes do not all end together.
pub fn watch_timeout(jitter: f64) -> u32 {
    (300.0 * (1.0 + jitter.clamp(0.0, 1.0))).min(599.0) as u32
}

/// A watch may run this much past its timeout before the loop gives up on
/// the server closing it.
const WATCH_GRACE: Duration = Duration::from_secs(30);

struct Active {
    body: kube::client::Body,
    frames: Frames,
    deadline: Instant,
}

struct Loop<K: WireObject> {
    client: Client,
    params: Params,
    machine: ListWatch,
    /// The next request, and how long to wait before it.
    next: Option<(Option<Duration>, Request)>,
    active: Option<Active>,
    pending: VecDeque<Item<K>>,
    /// Fallen back to JSON (the server refused protobuf).
    json_only: bool,
    _k: PhantomData<K>,
}

/// Lists and watches `K` as `params` say, forever (until dropped).
pub fn reflect<K: WireObject>(client: Client, params: Params) -> BoxStream<'static, Item<K>> {
    reflect_from(client, params, None)
}

/// [`reflect`], where `listed` (items and the list's resourceVersion) was
/// already read by the caller: they are yielded as the initial list and
/// the loop starts with a watch from that version, so the start costs the
/// server one list, not two.
pub fn reflect_from<K: WireObject>(
    client: Client,
    params: Params,
    listed: Option<(Vec<K>, String)>,
) -> BoxStream<'static, Item<K>> {
    let mut machine = ListWatch::new(params.streaming);
    let mut pending = VecDeque::new();
    let first = match listed {
        Some((items, rv)) => {
            pending.push_back(Ok(Event::Init));
            pending.extend(items.into_iter().map(|o| Ok(Event::InitApply(o))));
            pending.push_back(Ok(Event::InitDone));
            machine.resume(&rv)
        }
        None => machine.start(),
    };
    let lp = Loop::<K> {
        client,
        params,
        machine,
        next: Some((None, first)),
        active: None,
        pending,
        json_only: false,
        _k: PhantomData,
    };
    futures::stream::unfold(lp, |mut lp| async move {
        let item = lp.next_item().await;
        Some((item, lp))
    })
    .boxed()
}

fn verb(r: &Request) -> &'static str {
    if r.is_watch() {
        "watch"
    } else {
        "list"
    }
}

impl<K: WireObject> Loop<K> {
    async fn next_item(&mut self) -> Item<K> {
        loop {
            if let Some(item) = self.pending.pop_front() {
                return item;
            }
            if self.active.is_some() {
                self.read().await;
                continue;
            }
            let (wait, request) = match self.next.take() {
                Some(n) => n,
                // Never left without a next step; should it happen, relist.
                None => (Some(retry_delay(1, jitter())), self.machine.start()),
            };
            if let Some(d) = wait {
                tokio::time::sleep(d).await;
            }
            self.send(request).await;
        }
    }

    fn follow(&mut self, step: Step, error: Option<ReflectError>) {
        if step.init_done {
            self.pending.push_back(Ok(Event::InitDone));
        }
        if step.report {
            if let Some(e) = error {
                self.pending.push_back(Err(e));
            }
        }
        self.next = match step.next {
            Next::Read => None,
            Next::Send(r) => Some((None, r)),
            Next::After { failures, request } => {
                Some((Some(retry_delay(failures, jitter())), request))
            }
        };
    }

    fn accept(&self) -> &str {
        if self.json_only {
            codec::JSON
        } else {
            &self.params.encoding.accept
        }
    }

    /// Switches this resource to JSON; true if it was not already.
    fn fall_back_to_json(&mut self, why: &str) -> bool {
        if self.json_only || self.accept() == codec::JSON {
            return false;
        }
        self.json_only = true;
        warn!(
            resource = K::PATH,
            "the API server {why}; reading this resource as JSON from now on"
        );
        true
    }

    async fn send(&mut self, request: Request) {
        if request.starts_relist() {
            self.pending.push_back(Ok(Event::Init));
        }
        let timeout = watch_timeout(jitter());
        let query = request.query(
            self.params.labels.as_deref(),
            self.params.fields.as_deref(),
            timeout,
        );
        let verb = verb(&request);
        let mut builder = http::Request::get(format!("{}?{query}", K::PATH))
            .header(http::header::ACCEPT, self.accept());
        if request.is_watch() {
            builder = builder.header(http::header::ACCEPT_ENCODING, "identity");
        }
        let req = match builder.body(kube::client::Body::from(Vec::new())) {
            Ok(r) => r,
            Err(e) => {
                // Only a selector that is not a header or URI value gets
                // here; nothing a retry fixes, but retried all the same.
                let step = self.machine.unreachable();
                self.follow(
                    step,
                    Some(ReflectError::Transport {
                        verb,
                        path: K::PATH,
                        source: Box::new(e),
                    }),
                );
                return;
            }
        };
        debug!(resource = K::PATH, %query, "API request");
        let res = match self.client.send(req).await {
            Ok(res) => res,
            Err(e) => {
                let step = self.machine.unreachable();
                self.follow(
                    step,
                    Some(ReflectError::Transport {
                        verb,
                        path: K::PATH,
                        source: Box::new(e),
                    }),
                );
                return;
            }
        };
        let code = res.status().as_u16();
        // -v=9 shows every answer's headers (the server's audit-id among
        // them), as client-go's round trippers do at high verbosity; the
        // request's credentials are added below this layer, never here.
        trace!(resource = K::PATH, %query, status = code, headers = ?res.headers(), "API response");
        let content_type = res
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let format = Format::of(content_type.as_deref());
        if matches!(code, 406 | 415)
            && self.fall_back_to_json(&format!("refuses {:?} ({code})", self.accept()))
        {
            self.next = Some((None, request));
            return;
        }
        if !res.status().is_success() {
            let body = match res.into_body().collect().await {
                Ok(b) => b.to_bytes(),
                Err(_) => Bytes::new(),
            };
            let status = ApiStatus::from_body(code, format, &body);
            debug!(resource = K::PATH, %status, "API request refused");
            let step = self.machine.refused(&status);
            self.follow(
                step,
                Some(ReflectError::Refused {
                    verb,
                    path: K::PATH,
                    status,
                }),
            );
            return;
        }
        let Some(format) = format else {
            let ct = content_type.unwrap_or_default();
            if self.fall_back_to_json(&format!("answers {ct:?}, which the proxy cannot read")) {
                self.next = Some((None, request));
                return;
            }
            let step = self.machine.stream_failed();
            self.follow(
                step,
                Some(ReflectError::Decode {
                    verb,
                    path: K::PATH,
                    source: CodecError::Kind {
                        want: "protobuf or JSON body",
                        got: ct,
                    },
                }),
            );
            return;
        };
        count(K::KIND, verb, format);
        if request.is_watch() {
            self.active = Some(Active {
                body: res.into_body(),
                frames: Frames::new(format),
                deadline: Instant::now() + Duration::from_secs(u64::from(timeout)) + WATCH_GRACE,
            });
            return;
        }
        let body = match res.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => {
                let step = self.machine.stream_failed();
                self.follow(
                    step,
                    Some(ReflectError::Transport {
                        verb,
                        path: K::PATH,
                        source: Box::new(e),
                    }),
                );
                return;
            }
        };
        match K::list(format, &body) {
            Ok((meta, items)) => {
                for obj in items {
                    let rv = obj.meta().resource_version.clone().unwrap_or_default();
                    self.machine.object(&rv);
                    self.pending.push_back(Ok(Event::InitApply(obj)));
                }
                let step = self.machine.page(&meta);
                self.follow(step, None);
            }
            Err(source) => {
                let step = self.machine.stream_failed();
                self.follow(
                    step,
                    Some(ReflectError::Decode {
                        verb,
                        path: K::PATH,
                        source,
                    }),
                );
            }
        }
    }

    /// Reads the active watch until it yields something to act on.
    async fn read(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let frame = match active.frames.next_frame() {
            Ok(Some(f)) => f,
            Ok(None) => {
                match tokio::time::timeout_at(active.deadline, active.body.frame()).await {
                    Ok(Some(Ok(frame))) => {
                        if let Ok(data) = frame.into_data() {
                            active.frames.push(&data);
                        }
                    }
                    // The end (a frame cut off at the end is dropped, as
                    // the server ends streams mid-event when it goes away).
                    Ok(None) | Err(_) => {
                        if active.frames.pending() > 0 {
                            debug!(resource = K::PATH, "watch ended inside an event");
                        }
                        self.active = None;
                        let step = self.machine.stream_ended();
                        self.follow(step, None);
                    }
                    Ok(Some(Err(e))) => {
                        self.active = None;
                        let step = self.machine.stream_failed();
                        self.follow(
                            step,
                            Some(ReflectError::Transport {
                                verb: "watch",
                                path: K::PATH,
                                source: Box::new(e),
                            }),
                        );
                    }
                }
                return;
            }
            Err(e) => return self.broken(e),
        };
        let format = active.frames.format();
        let event = match format {
            Format::Protobuf => codec::pb_event(&frame),
            Format::Json => codec::json_event(&frame),
        };
        let event = match event {
            Ok(ev) => ev,
            Err(e) => return self.broken(e),
        };
        match event.kind {
            EventType::Added | EventType::Modified | EventType::Deleted => {
                let obj = match K::from_raw(&event.object) {
                    Ok(o) => o,
                    Err(e) => return self.broken(e),
                };
                let rv = obj.meta().resource_version.clone().unwrap_or_default();
                let ev = match (self.machine.object(&rv), event.kind) {
                    (_, EventType::Deleted) => Event::Delete(obj),
                    (Role::Initial, _) => Event::InitApply(obj),
                    (Role::Change, _) => Event::Apply(obj),
                };
                self.pending.push_back(Ok(ev));
            }
            EventType::Bookmark => match event.object.bookmark() {
                Ok(b) => {
                    let step = self
                        .machine
                        .bookmark(&b.resource_version, b.initial_events_end);
                    if b.initial_events_end {
                        info!(
                            resource = K::PATH,
                            rv = %b.resource_version,
                            "streaming list complete"
                        );
                    }
                    self.follow(step, None);
                }
                Err(e) => self.broken(e),
            },
            EventType::Error => {
                self.active = None;
                let status = event.object.status().unwrap_or_else(|e| ApiStatus {
                    code: 0,
                    reason: String::new(),
                    message: e.to_string(),
                });
                debug!(resource = K::PATH, %status, "watch error event");
                let step = self.machine.stream_error(&status);
                self.follow(
                    step,
                    Some(ReflectError::Event {
                        path: K::PATH,
                        status,
                    }),
                );
            }
        }
    }

    /// Bytes that do not decode: the stream is dropped and resumed.
    fn broken(&mut self, e: CodecError) {
        self.active = None;
        let step = self.machine.stream_failed();
        self.follow(
            step,
            Some(ReflectError::Decode {
                verb: "watch",
                path: K::PATH,
                source: e,
            }),
        );
    }
}

/// The first list of `K` as the loop makes it (a streaming list where the
/// server streams, else a list from the watch cache; the configured
/// encoding, JSON when refused) and the resourceVersion a watch would go
/// on from: for a caller that needs the objects before the loop runs, and
/// then hands them to [`reflect_from`], so that the server is asked once.
/// The first failure the loop would report is returned instead.
pub async fn initial_list<K: WireObject>(
    client: &Client,
    params: &Params,
) -> Result<(Vec<K>, String), ReflectError> {
    let mut machine = ListWatch::new(params.streaming);
    let first = machine.start();
    let mut lp = Loop::<K> {
        client: client.clone(),
        params: params.clone(),
        machine,
        next: Some((None, first)),
        active: None,
        pending: VecDeque::new(),
        json_only: false,
        _k: PhantomData,
    };
    let mut items = Vec::new();
    loop {
        match lp.next_item().await? {
            Event::Init => items.clear(),
            Event::InitApply(obj) => items.push(obj),
            Event::InitDone => return Ok((items, lp.machine.resource_version().to_string())),
            // Not before the list is complete.
            Event::Apply(_) | Event::Delete(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_headers_as_client_go_builds_them() {
        assert_eq!(Encoding::default().accept, ACCEPT_PROTOBUF);
        assert_eq!(
            Encoding::new("application/vnd.kubernetes.protobuf", "").accept,
            "application/vnd.kubernetes.protobuf, */*"
        );
        assert_eq!(
            Encoding::new("application/json", "").accept,
            "application/json, */*"
        );
        assert_eq!(
            Encoding::new("application/json", "application/vnd.kubernetes.protobuf").accept,
            "application/vnd.kubernetes.protobuf"
        );
        assert_eq!(Encoding::new("", "").accept, ACCEPT_PROTOBUF);
    }

    #[test]
    fn watch_retries_double_to_30_s() {
        let d: Vec<f64> = (1..=8).map(|f| retry_delay(f, 0.5).as_secs_f64()).collect();
        assert_eq!(d, [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]);
        assert_eq!(retry_delay(3, 0.0), Duration::from_secs_f64(1.6));
        assert_eq!(retry_delay(3, 1.0), Duration::from_secs_f64(4.8));
    }

    /// A server failing every request (500): the streaming list falls
    /// back to a list, which fails and is reported; the relists back off
    /// (0.8 s doubling to 30 s) instead of retrying at once, and Init
    /// before each one does not reset the backoff.
    #[tokio::test(start_paused = true)]
    async fn a_failing_list_is_retried_with_backoff() {
        use std::sync::atomic::{AtomicU32, Ordering};
        use std::sync::Arc;
        let requests = Arc::new(AtomicU32::new(0));
        let r = requests.clone();
        let svc = tower::service_fn(move |_req: http::Request<kube::client::Body>| {
            r.fetch_add(1, Ordering::SeqCst);
            async {
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder()
                        .status(500)
                        .header("content-type", "application/json")
                        .body(kube::client::Body::from(
                            br#"{"kind":"Status","code":500,"reason":"InternalError","message":"boom"}"#
                                .to_vec(),
                        ))
                        .unwrap(),
                )
            }
        });
        let client = Client::new(svc, "default");
        let params = Params {
            labels: None,
            fields: None,
            encoding: Encoding::default(),
            streaming: true,
        };
        let mut s = reflect::<k8s_openapi::api::core::v1::Service>(client, params);
        let t0 = Instant::now();
        let mut errors = 0;
        while t0.elapsed() < Duration::from_secs(120) {
            match s.next().await {
                Some(Err(ReflectError::Refused {
                    verb: "list",
                    status,
                    ..
                })) => {
                    assert_eq!(status.code, 500);
                    errors += 1;
                }
                Some(Ok(Event::Init)) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        // 0.8 + 1.6 + ... then 30 s apart (x0.5-1.5): about 8 in 2 minutes;
        // at once after each failure it would be thousands.
        assert!(
            (5..=15).contains(&errors),
            "{errors} failed lists in 2 minutes"
        );
        // Each relist: the streaming list and the list it fell back to.
        let n = requests.load(Ordering::SeqCst);
        assert!(
            (2 * errors..=2 * errors + 2).contains(&n),
            "{n} requests, {errors} errors"
        );
    }

    #[test]
    fn watch_timeouts_spread_over_five_to_ten_minutes() {
        assert_eq!(watch_timeout(0.0), 300);
        assert_eq!(watch_timeout(0.5), 450);
        assert_eq!(watch_timeout(1.0), 599);
        let j: Vec<f64> = (0..64).map(|_| jitter()).collect();
        assert!(j.iter().all(|x| (0.0..1.0).contains(x)));
        assert!(j.iter().any(|x| *x != j[0]), "jitter does not vary: {j:?}");
    }
}
