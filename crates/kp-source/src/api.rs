//! The API source: list/watch loops (reflector.rs, deciding as client-go's
//! reflector does: streaming lists, lists from the watch cache, protobuf)
//! for Services, EndpointSlices and this node's Node, merged into one
//! channel of [`SourceEvent`]s; and one for the cluster's ServiceCIDRs,
//! which takes no part in the connection state (an older API server has no
//! such API: logged once, and the proxy carries on without it).
//!
//! Relists never flush: the keys seen during a relist are compared with the
//! keys known before, and only the missing ones are sent as deleted. A watcher
//! error is reported once as `Disconnected`; `Reconnected` follows when a
//! watcher that failed delivers data again or, if nothing changed meanwhile,
//! when a probe list of all three resources succeeds (a resumed watch that
//! has nothing to say produces no event at all). Data from a watcher that
//! did not fail proves nothing about the ones that did.

use std::collections::HashSet;
use std::time::Duration;

use futures::stream::{BoxStream, SelectAll};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::api::{Api, ListParams};
use kube::runtime::watcher::Event;
use kube::{Client, ResourceExt};
use tokio::sync::mpsc::{self, Sender};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::connection::{Connection, Watch};
use crate::reflector::{jitter, reflect, reflect_from, Encoding, Params, ReflectError};
use crate::{SourceError, SourceEvent};

pub use kp_model::DEFAULT_LABEL_SELECTOR;
use kp_model::{HEADLESS_LABEL, SERVICE_PROXY_NAME_LABEL};

/// The label selector for Services and EndpointSlices: upstream's
/// [`DEFAULT_LABEL_SELECTOR`] without a proxy name; with
/// `--service-proxy-name NAME`, only the non-headless objects labelled
/// `service.kubernetes.io/service-proxy-name=NAME` (the EndpointSlice
/// controller copies a Service's labels to its slices, so theirs match too).
/// An empty name is no name. Fails when `NAME` is not a label value, which
/// would otherwise corrupt the selector (a `,` adds a term) or be refused by
/// the API server on every list.
pub fn label_selector(service_proxy_name: Option<&str>) -> Result<String, SourceError> {
    match service_proxy_name.filter(|n| !n.is_empty()) {
        None => Ok(DEFAULT_LABEL_SELECTOR.to_string()),
        Some(name) if is_label_value(name) => Ok(format!(
            "{SERVICE_PROXY_NAME_LABEL}={name},!{HEADLESS_LABEL}"
        )),
        Some(name) => Err(SourceError::InvalidProxyName(name.to_string())),
    }
}

/// A Kubernetes label value: at most 63 characters, alphanumerics with `-`,
/// `_` or `.` inside.
fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b.first().is_none_or(u8::is_ascii_alphanumeric)
        && b.last().is_none_or(u8::is_ascii_alphanumeric)
}

/// How often a disconnected source checks whether the API answers again:
/// after 1 s, then 1.5 times longer each time up to 4 s, each wait varied by
/// ±20% so that the nodes of a cluster do not probe in step. An API server
/// answering errors for minutes sees one probe per node every ~4 s (two or
/// three small lists), not one a second; recovery is still noticed within
/// about 5 s (plus a probe's 5 s timeout through a partition; the outage
/// tests hold it to that).
fn probe_delay(attempt: u32, jitter: f64) -> Duration {
    const FIRST: f64 = 1.0;
    const MAX: f64 = 4.0;
    let base = (FIRST * 1.5f64.powi(attempt.min(16) as i32)).min(MAX);
    Duration::from_secs_f64(base * (0.8 + 0.4 * jitter.clamp(0.0, 1.0)))
}

/// How long one probe may take. Through a network partition a connection
/// attempt would otherwise wait out the client's connect timeout (30 s)
/// and the kernel's doubling SYN retransmissions, so a server reachable
/// again might be noticed only about 15 s later; a fresh attempt every few
/// seconds notices it within a few.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long `Synced` waits for the first ServiceCIDR list once the other
/// watches have listed.
const CIDR_HOLD: Duration = Duration::from_secs(5);

/// What to watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiSourceOptions {
    /// This node's name: only this Node is watched.
    pub node_name: String,
    /// Label selector for Services and EndpointSlices (the binary passes
    /// [`label_selector`]'s).
    pub label_selector: Option<String>,
    /// The encodings asked for (protobuf first by default, as upstream).
    pub encoding: Encoding,
    /// Relists as streaming lists first (client-go's WatchListClient
    /// feature, on by default); false lists from the watch cache.
    pub streaming_lists: bool,
}

/// Which watcher an event came from.
enum Item {
    Service(Box<Result<Event<Service>, ReflectError>>),
    Slice(Box<Result<Event<EndpointSlice>, ReflectError>>),
    Node(Box<Result<Event<Node>, ReflectError>>),
    Cidr(Box<Result<Event<ServiceCIDR>, ReflectError>>),
}

/// Per-resource bookkeeping of the keys the consumer knows about.
#[derive(Default)]
struct Known {
    keys: HashSet<(String, String)>,
    /// Keys seen since the current relist began (None when not relisting).
    relist: Option<HashSet<(String, String)>>,
}

impl Known {
    fn key<K: ResourceExt>(obj: &K) -> (String, String) {
        (obj.namespace().unwrap_or_default(), obj.name_any())
    }

    fn init(&mut self) {
        self.relist = Some(HashSet::new());
    }

    fn applied(&mut self, key: (String, String)) {
        if let Some(seen) = &mut self.relist {
            seen.insert(key.clone());
        }
        self.keys.insert(key);
    }

    fn deleted(&mut self, key: &(String, String)) {
        self.keys.remove(key);
        if let Some(seen) = &mut self.relist {
            seen.remove(key);
        }
    }

    /// Ends a relist; returns the keys that went away meanwhile.
    fn init_done(&mut self) -> Vec<(String, String)> {
        let Some(seen) = self.relist.take() else {
            return Vec::new();
        };
        let mut gone: Vec<_> = self.keys.difference(&seen).cloned().collect();
        gone.sort();
        self.keys = seen;
        gone
    }
}

/// Turns one watcher event into source events, keeping `known` up to date.
fn translate<K: ResourceExt + Clone>(
    ev: Event<K>,
    known: &mut Known,
    applied: impl Fn(K) -> SourceEvent,
    deleted: impl Fn(String, String) -> Option<SourceEvent>,
) -> Vec<SourceEvent> {
    match ev {
        Event::Init => {
            known.init();
            Vec::new()
        }
        Event::InitApply(mut obj) | Event::Apply(mut obj) => {
            known.applied(Known::key(&obj));
            // Nothing downstream reads managedFields, often the larger part
            // of an object: a full queue of a streaming list's initial
            // events held them all (client-go's TransformStripManagedFields).
            *obj.managed_fields_mut() = Vec::new();
            vec![applied(obj)]
        }
        Event::Delete(obj) => {
            let key = Known::key(&obj);
            known.deleted(&key);
            deleted(key.0, key.1).into_iter().collect()
        }
        Event::InitDone => known
            .init_done()
            .into_iter()
            .filter_map(|(ns, name)| deleted(ns, name))
            .collect(),
    }
}

/// True for the end of a complete list.
fn is_list_end<K>(ev: &Event<K>) -> bool {
    matches!(ev, Event::InitDone)
}

/// True for events that prove the API server answered (Init is produced
/// locally before any request).
fn is_data<K>(ev: &Event<K>) -> bool {
    !matches!(ev, Event::Init)
}

/// The running probe (connection.rs decides when); aborted when dropped.
#[derive(Default)]
struct Probe(Option<JoinHandle<()>>);

impl Probe {
    fn stop(&mut self) {
        if let Some(p) = self.0.take() {
            p.abort();
        }
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The API server answered a list or watch with 404: it has no such
/// resource (ServiceCIDR before Kubernetes 1.33 without the beta API on).
fn is_missing_api(err: &ReflectError) -> bool {
    matches!(err, ReflectError::Refused { status, .. } if status.code == 404)
}

/// The API server refused us the resource (403: RBAC without it).
fn is_forbidden(err: &ReflectError) -> bool {
    err.code() == Some(403)
}

/// Upstream's Service informer leaves headless Services out on the server
/// (the proxy has nothing to program for them): fewer bytes to list and
/// watch.
pub const SERVICE_FIELD_SELECTOR: &str = "spec.clusterIP!=None";

/// What the three watches and the ServiceCIDR one ask for.
#[derive(Clone)]
struct Watches {
    client: Client,
    /// Services: the label selector and [`SERVICE_FIELD_SELECTOR`].
    services: Params,
    /// EndpointSlices: the label selector.
    selected: Params,
    node: Params,
    all: Params,
}

/// The ServiceCIDR watcher (cluster-scoped, every object). It ends after
/// a 404, which it yields: retrying an API the server does not have would
/// only load it.
fn service_cidr_stream(w: &Watches) -> BoxStream<'static, Item> {
    let w = reflect::<ServiceCIDR>(w.client.clone(), w.all.clone());
    futures::stream::unfold(Some(w), |w| async move {
        let mut w = w?;
        let item = w.next().await?;
        let next = match &item {
            Err(e) if is_missing_api(e) => None,
            _ => Some(w),
        };
        Some((Item::Cidr(Box::new(item)), next))
    })
    .boxed()
}

/// The three watchers, merged, and the ServiceCIDR one while `cidrs`.
/// JSON Services are read through ProxiedService (service.rs): one Service
/// that k8s-openapi's type cannot decode must not stop the Service watch.
fn watch_streams(
    w: &Watches,
    cidrs: bool,
    node_listed: Option<NodeListed>,
) -> SelectAll<BoxStream<'static, Item>> {
    let services = reflect::<Service>(w.client.clone(), w.services.clone())
        .map(|r| Item::Service(Box::new(r)))
        .boxed();
    let slices = reflect::<EndpointSlice>(w.client.clone(), w.selected.clone())
        .map(|r| Item::Slice(Box::new(r)))
        .boxed();
    let listed = node_listed.map(|l| (l.node.into_iter().collect(), l.resource_version));
    let nodes = reflect_from::<Node>(w.client.clone(), w.node.clone(), listed)
        .map(|r| Item::Node(Box::new(r)))
        .boxed();
    let mut all = futures::stream::select_all([services, slices, nodes]);
    if cidrs {
        all.push(service_cidr_stream(w));
    }
    all
}

/// Lists each watched resource (one item) until all three answer.
async fn probe(client: Client, opts: ApiSourceOptions, ok: Sender<()>) {
    let mut lp = ListParams::default().limit(1);
    if let Some(sel) = &opts.label_selector {
        lp = lp.labels(sel);
    }
    let node_lp = ListParams::default()
        .fields(&format!("metadata.name={}", opts.node_name))
        .limit(1);
    let services: Api<Service> = Api::all(client.clone());
    let slices: Api<EndpointSlice> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client);
    for attempt in 0u32.. {
        tokio::time::sleep(probe_delay(attempt, jitter())).await;
        let result = tokio::time::timeout(PROBE_TIMEOUT, async {
            services.list_metadata(&lp).await?;
            slices.list_metadata(&lp).await?;
            nodes.list_metadata(&node_lp).await?;
            Ok::<_, kube::Error>(())
        })
        .await;
        match result {
            Ok(Ok(())) => {
                let _ = ok.send(()).await;
                return;
            }
            Ok(Err(e)) => debug!("API probe failed: {e}"),
            Err(_) => debug!("API probe got no answer within {PROBE_TIMEOUT:?}"),
        }
    }
}

/// This node's Node as listed once, and the list's resourceVersion: what
/// [`run_api_source_from`] resumes its Node watch from.
#[derive(Debug, Clone)]
pub struct NodeListed {
    /// None when there is no such Node.
    pub node: Option<Node>,
    pub resource_version: String,
}

/// Lists the Node named `node_name` with the field selector
/// `metadata.name=NAME`, as the Node watcher does (kube-proxy's RBAC grants
/// list and watch on Nodes, not get): a streaming list, or a list from the
/// API server's watch cache (`streaming_lists` false), in `encoding`.
pub async fn list_node(
    client: &Client,
    node_name: &str,
    encoding: &Encoding,
    streaming_lists: bool,
) -> Result<NodeListed, SourceError> {
    let params = Params {
        labels: None,
        fields: Some(format!("metadata.name={node_name}")),
        encoding: encoding.clone(),
        streaming: streaming_lists,
    };
    let (items, resource_version) = crate::reflector::initial_list::<Node>(client, &params)
        .await
        .map_err(|source| SourceError::ListNode {
            node: node_name.to_string(),
            source: Box::new(source),
        })?;
    // The field selector already matched the name; checked again so that a
    // server ignoring it cannot hand us another node's CIDRs.
    let node = items
        .into_iter()
        .find(|n| n.metadata.name.as_deref() == Some(node_name));
    Ok(NodeListed {
        node,
        resource_version,
    })
}

/// Watches Services and EndpointSlices (with `opts.label_selector`) and the
/// Node named `opts.node_name`, sending [`SourceEvent`]s on `tx`: every object
/// as applied, `Synced` once Services, EndpointSlices and the Node were
/// listed (the Node may be absent),
/// deletions (including those found by relists), and `Disconnected` /
/// `Reconnected` around outages. Retries with kube-runtime's default backoff
/// (reflector.rs) and relists after 410 Gone. Returns `Ok(())` when `tx` is
/// closed.
pub async fn run_api_source(
    client: Client,
    opts: ApiSourceOptions,
    tx: Sender<SourceEvent>,
) -> Result<(), SourceError> {
    run_api_source_from(client, opts, None, tx).await
}

/// [`run_api_source`], where this node's Node was already listed (by the
/// start's wait for its addresses or podCIDRs, [`list_node`]): the Node
/// watch starts from that list instead of listing again, so a start lists
/// the Node once, as upstream's one Node informer does.
pub async fn run_api_source_from(
    client: Client,
    opts: ApiSourceOptions,
    node_listed: Option<NodeListed>,
    tx: Sender<SourceEvent>,
) -> Result<(), SourceError> {
    let all = Params {
        labels: None,
        fields: None,
        encoding: opts.encoding.clone(),
        streaming: opts.streaming_lists,
    };
    let selected = Params {
        labels: opts.label_selector.clone(),
        ..all.clone()
    };
    let watches = Watches {
        client: client.clone(),
        services: Params {
            fields: Some(SERVICE_FIELD_SELECTOR.to_string()),
            ..selected.clone()
        },
        selected,
        node: Params {
            fields: Some(format!("metadata.name={}", opts.node_name)),
            ..all.clone()
        },
        all,
    };

    // ServiceCIDRs: whether the server has the API (until it says 404).
    let mut cidr_api = true;
    let mut merged = watch_streams(&watches, cidr_api, node_listed);

    let mut svc_known = Known::default();
    let mut slice_known = Known::default();
    let mut node_known = Known::default();
    // Whether the ServiceCIDR watch failed since it last delivered (its
    // failures are logged, not reported as outages: the other watches do).
    let mut cidr_known = Known::default();
    let mut cidr_failing = false;
    // `Synced` waits for the first ServiceCIDR list too (or its failure), so
    // that the first sync, which a restart's adoption compares the table
    // with, already drops the ranges: no moment of letting them through.
    let mut cidr_settled = false;
    let mut synced_held = false;
    let mut held_since = tokio::time::Instant::now();
    let mut conn = Connection::new();
    let mut probe_task = Probe::default();
    let (probe_tx, mut probe_rx) = mpsc::channel::<()>(1);

    info!(node = %opts.node_name, selector = ?opts.label_selector, accept = %opts.encoding.accept, "watching the API server");
    loop {
        let item = tokio::select! {
            _ = tx.closed() => return Ok(()),
            // A ServiceCIDR list that neither ends nor fails holds the first
            // sync no longer than this.
            _ = tokio::time::sleep_until(held_since + CIDR_HOLD), if synced_held => {
                synced_held = false;
                cidr_settled = true;
                warn!("no ServiceCIDR list within {CIDR_HOLD:?}; syncing without it");
                if tx.send(SourceEvent::Synced).await.is_err() {
                    return Ok(());
                }
                continue;
            }
            Some(()) = probe_rx.recv() => {
                probe_task.0 = None;
                if conn.probe_answered() {
                    // The watchers may sit in their backoff (up to 30 s)
                    // although the server answers again: start fresh ones,
                    // which relist (without flushing, see Known) at once, so
                    // changes made during the outage arrive now.
                    merged = watch_streams(&watches, cidr_api, None);
                    info!("API server reachable again; watches restarted");
                    if tx.send(SourceEvent::Reconnected).await.is_err() {
                        return Ok(());
                    }
                }
                continue;
            }
            item = merged.next() => match item {
                Some(item) => item,
                None => return Err(SourceError::WatchEnded),
            },
        };
        let (watch, outcome) = match item {
            Item::Cidr(r) => {
                let mut events = match *r {
                    Ok(ev) => {
                        if std::mem::take(&mut cidr_failing) {
                            info!("ServiceCIDR watch delivering again");
                        }
                        cidr_settled |= is_list_end(&ev);
                        translate(
                            ev,
                            &mut cidr_known,
                            |c| SourceEvent::ServiceCidrApplied(Box::new(c)),
                            |_, name| Some(SourceEvent::ServiceCidrDeleted { name }),
                        )
                    }
                    Err(e) if is_missing_api(&e) => {
                        // The stream has ended; restarted watches leave it out.
                        cidr_api = false;
                        cidr_settled = true;
                        warn!("the API server has no ServiceCIDR API (networking.k8s.io/v1); carrying on without it: traffic to unallocated Service addresses is not dropped");
                        Vec::new()
                    }
                    Err(e) => {
                        // Not worth holding the first sync for.
                        cidr_settled = true;
                        if !std::mem::replace(&mut cidr_failing, true) {
                            if is_forbidden(&e) {
                                warn!("cannot watch ServiceCIDRs (give the proxy list and watch on servicecidrs.networking.k8s.io); retrying: {e}");
                            } else {
                                warn!("ServiceCIDR watch failed; retrying: {e}");
                            }
                        } else {
                            debug!("ServiceCIDR watch still failing: {e}");
                        }
                        Vec::new()
                    }
                };
                if cidr_settled && std::mem::take(&mut synced_held) {
                    events.push(SourceEvent::Synced);
                }
                for e in events {
                    if tx.send(e).await.is_err() {
                        return Ok(());
                    }
                }
                continue;
            }
            Item::Service(r) => (
                Watch::Services,
                (*r).map(|ev| {
                    let data = (is_data(&ev), is_list_end(&ev));
                    let out = translate(
                        ev,
                        &mut svc_known,
                        |s| SourceEvent::ServiceApplied(Box::new(s)),
                        |namespace, name| Some(SourceEvent::ServiceDeleted { namespace, name }),
                    );
                    (data, out)
                }),
            ),
            Item::Slice(r) => (
                Watch::EndpointSlices,
                (*r).map(|ev| {
                    let data = (is_data(&ev), is_list_end(&ev));
                    let out = translate(
                        ev,
                        &mut slice_known,
                        |s| SourceEvent::SliceApplied(Box::new(s)),
                        |namespace, name| Some(SourceEvent::SliceDeleted { namespace, name }),
                    );
                    (data, out)
                }),
            ),
            Item::Node(r) => (
                Watch::Nodes,
                (*r).map(|ev| {
                    let data = (is_data(&ev), is_list_end(&ev));
                    // SourceEvent has no node deletion: the model keeps the
                    // last labels it saw, as upstream does when its Node goes.
                    let out = translate(
                        ev,
                        &mut node_known,
                        |n| SourceEvent::NodeApplied(Box::new(n)),
                        |_, name| {
                            warn!(node = %name, "this node's Node object was deleted");
                            None
                        },
                    );
                    (data, out)
                }),
            ),
        };
        let resource = watch.as_str();
        let mut out = Vec::new();
        let mut restart = false;
        match outcome {
            Ok(((data, listed), events)) => {
                let step = conn.delivered(watch, data, listed);
                if step.stop_probe {
                    probe_task.stop();
                }
                if step.reconnected {
                    info!(resource, "API watch delivering again");
                    out.push(SourceEvent::Reconnected);
                }
                restart = step.restart_watches;
                out.extend(events);
                if step.synced && !cidr_settled {
                    synced_held = true;
                    held_since = tokio::time::Instant::now();
                } else if step.synced {
                    out.push(SourceEvent::Synced);
                }
            }
            Err(err) => {
                let step = conn.failed(watch);
                if step.disconnected {
                    warn!(
                        resource,
                        "API watch failed, keeping the current rules: {err}"
                    );
                    out.push(SourceEvent::Disconnected(format!("{resource}: {err}")));
                } else {
                    debug!(resource, "API watch still failing: {err}");
                }
                if step.start_probe {
                    probe_task.0 = Some(tokio::spawn(probe(
                        client.clone(),
                        opts.clone(),
                        probe_tx.clone(),
                    )));
                }
            }
        }
        for e in out {
            if tx.send(e).await.is_err() {
                return Ok(());
            }
        }
        if restart {
            merged = watch_streams(&watches, cidr_api, None);
            info!("API server reachable again; watches restarted");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_back_off_with_jitter_to_a_bounded_rate() {
        // Without jitter: 1 s, 1.5 s, 2.25 s ... then 4 s for good.
        let plain: Vec<f64> = (0..8).map(|a| probe_delay(a, 0.5).as_secs_f64()).collect();
        assert_eq!(plain[..3], [1.0, 1.5, 2.25]);
        assert!(plain.windows(2).all(|w| w[0] <= w[1]), "{plain:?}");
        assert_eq!(probe_delay(1000, 0.5), Duration::from_secs(4));
        // Jitter stays within ±20%.
        assert_eq!(probe_delay(10, 0.0), Duration::from_secs_f64(3.2));
        assert_eq!(probe_delay(10, 1.0), Duration::from_secs_f64(4.8));
        // Two minutes of failures cost ~32 probes, not 120.
        let mut t = 0.0;
        let mut n = 0;
        while t < 120.0 {
            t += probe_delay(n, 0.5).as_secs_f64();
            n += 1;
        }
        assert!((25..=40).contains(&n), "{n} probes in 2 minutes");
        let j: Vec<f64> = (0..64).map(|_| jitter()).collect();
        assert!(j.iter().all(|x| (0.0..1.0).contains(x)));
        assert!(j.iter().any(|x| *x != j[0]), "jitter does not vary: {j:?}");
    }

    fn svc(ns: &str, name: &str) -> Service {
        let mut s = Service::default();
        s.metadata.namespace = Some(ns.into());
        s.metadata.name = Some(name.into());
        s
    }

    fn names(evs: &[SourceEvent]) -> Vec<String> {
        evs.iter()
            .map(|e| match e {
                SourceEvent::ServiceApplied(s) => format!("+{}", s.name_any()),
                SourceEvent::ServiceDeleted { name, .. } => format!("-{name}"),
                other => format!("{other:?}"),
            })
            .collect()
    }

    fn run(known: &mut Known, ev: Event<Service>) -> Vec<String> {
        names(&translate(
            ev,
            known,
            |s| SourceEvent::ServiceApplied(Box::new(s)),
            |namespace, name| Some(SourceEvent::ServiceDeleted { namespace, name }),
        ))
    }

    #[test]
    fn label_selector_follows_the_proxy_name() {
        assert_eq!(label_selector(None).unwrap(), DEFAULT_LABEL_SELECTOR);
        assert_eq!(label_selector(Some("")).unwrap(), DEFAULT_LABEL_SELECTOR);
        assert_eq!(
            label_selector(Some("my-proxy")).unwrap(),
            "service.kubernetes.io/service-proxy-name=my-proxy,!service.kubernetes.io/headless"
        );
        assert_eq!(
            label_selector(Some("a.b_c-9")).unwrap(),
            "service.kubernetes.io/service-proxy-name=a.b_c-9,!service.kubernetes.io/headless"
        );
        assert!(label_selector(Some(&"x".repeat(63))).is_ok());
        for bad in ["a,b", "a=b", "-a", "a-", "a b", "ä", &"x".repeat(64)] {
            assert!(
                matches!(label_selector(Some(bad)), Err(SourceError::InvalidProxyName(n)) if n == bad),
                "{bad:?} should be refused"
            );
        }
    }

    #[test]
    fn relist_deletes_only_missing_keys() {
        let mut k = Known::default();
        assert!(run(&mut k, Event::Init).is_empty());
        assert_eq!(run(&mut k, Event::InitApply(svc("a", "x"))), ["+x"]);
        assert_eq!(run(&mut k, Event::InitApply(svc("a", "y"))), ["+y"]);
        assert!(run(&mut k, Event::InitDone).is_empty());
        assert_eq!(run(&mut k, Event::Apply(svc("a", "z"))), ["+z"]);
        // Relist: y is gone, x and z remain.
        run(&mut k, Event::Init);
        run(&mut k, Event::InitApply(svc("a", "x")));
        run(&mut k, Event::InitApply(svc("a", "z")));
        assert_eq!(run(&mut k, Event::InitDone), ["-y"]);
        assert_eq!(run(&mut k, Event::Delete(svc("a", "x"))), ["-x"]);
        assert_eq!(k.keys.len(), 1);
    }
}
