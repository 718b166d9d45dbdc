//! The proxy's own HTTP servers: /healthz and /livez (default :10256), and
//! /metrics, /proxyMode, /configz, /healthz, /statusz, /flagz and
//! /debug/{services,explain} (default 127.0.0.1:10249; the debug endpoints
//! are `http/debug.rs`, the z-pages `http/zpages.rs`).
//!
//! [`HealthState`] follows upstream's ProxyHealthServer: each IP family's
//! proxier reports when an update was queued and when rules were last
//! programmed; the proxy is unhealthy while some family has had an update
//! pending for longer than the health timeout (2 × syncPeriod upstream).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use kp_model::IpFamily;
use kp_sync::{Clock, SystemClock};
use tokio::net::TcpListener;

use crate::metrics::{Metrics, OPENMETRICS_CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE};
use kp_model::format_rfc3339;

/// Taint the Cluster Autoscaler puts on a node it is about to delete.
pub use kp_sync::TO_BE_DELETED_TAINT;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} server stopped: {source}")]
    Serve {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Debug)]
struct HealthInner {
    last_updated: HashMap<IpFamily, SystemTime>,
    oldest_pending: HashMap<IpFamily, SystemTime>,
    node_eligible: bool,
    /// Since when the source (API server) has been unreachable, if it is.
    source_lost_since: Option<SystemTime>,
}

/// The proxy's health, shared between the sync loop and the HTTP servers.
pub struct HealthState {
    clock: Arc<dyn Clock>,
    health_timeout: Duration,
    inner: Mutex<HealthInner>,
}

impl std::fmt::Debug for HealthState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthState")
            .field("health_timeout", &self.health_timeout)
            .field("inner", &*self.lock())
            .finish()
    }
}

/// What /healthz or /livez reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthReport {
    pub healthy: bool,
    pub last_updated: SystemTime,
    pub current_time: SystemTime,
    pub node_eligible: bool,
}

impl HealthState {
    /// `families` are the proxiers that will run; each counts as updated now,
    /// as upstream's SyncLoop marks itself updated when it starts, so a proxier
    /// that never completes a sync turns unhealthy once an update has waited
    /// `health_timeout`.
    pub fn new(families: &[IpFamily], health_timeout: Duration) -> Self {
        Self::with_clock(families, health_timeout, Arc::new(SystemClock))
    }

    pub fn with_clock(
        families: &[IpFamily],
        health_timeout: Duration,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let now = clock.system_now();
        HealthState {
            clock,
            health_timeout,
            inner: Mutex::new(HealthInner {
                last_updated: families.iter().map(|f| (*f, now)).collect(),
                oldest_pending: HashMap::new(),
                // Eligible until a Node event says otherwise, as upstream.
                node_eligible: true,
                source_lost_since: None,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HealthInner> {
        // A panic while holding this lock cannot leave the maps inconsistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn health_timeout(&self) -> Duration {
        self.health_timeout
    }

    /// A change for `family` arrived that is not programmed yet. Only the
    /// oldest pending one counts.
    pub fn queued_update(&self, family: IpFamily) {
        let now = self.clock.system_now();
        self.lock().oldest_pending.entry(family).or_insert(now);
    }

    /// `family`'s rules now reflect every change queued so far.
    pub fn updated(&self, family: IpFamily) {
        let now = self.clock.system_now();
        let mut g = self.lock();
        g.oldest_pending.remove(&family);
        g.last_updated.insert(family, now);
    }

    /// False when the Node is being deleted or carries [`TO_BE_DELETED_TAINT`];
    /// only /healthz looks at it.
    pub fn set_node_eligible(&self, eligible: bool) {
        self.lock().node_eligible = eligible;
    }

    /// The source lost (false) or regained (true) the API server. Reported in
    /// the /healthz body only: rules programmed from the last known state are
    /// still right for traffic, and failing every node's health check during
    /// an API outage would make load balancers drop the whole cluster.
    pub fn set_source_connected(&self, connected: bool) {
        let now = self.clock.system_now();
        let mut g = self.lock();
        if connected {
            g.source_lost_since = None;
        } else if g.source_lost_since.is_none() {
            g.source_lost_since = Some(now);
        }
    }

    /// Since when the source has been disconnected, if it is.
    pub fn source_lost_since(&self) -> Option<SystemTime> {
        self.lock().source_lost_since
    }

    pub fn node_eligible(&self) -> bool {
        self.lock().node_eligible
    }

    /// The proxy's own health, ignoring the Node (upstream's IsHealthy; what
    /// /livez and the service health checks use).
    pub fn is_healthy(&self) -> bool {
        self.check().0
    }

    /// (healthy, lastUpdated, now), upstream's isHealthy.
    fn check(&self) -> (bool, SystemTime, SystemTime) {
        let g = self.lock();
        let now = self.clock.system_now();
        let mut last = UNIX_EPOCH;
        let mut families: Vec<_> = g.last_updated.iter().collect();
        families.sort_by_key(|(f, _)| **f);
        for (family, updated) in families {
            if *updated > last {
                last = *updated;
            }
            let Some(pending) = g.oldest_pending.get(family) else {
                continue;
            };
            let waited = now.duration_since(*pending).unwrap_or(Duration::ZERO);
            if waited < self.health_timeout {
                continue;
            }
            return (false, *updated, now);
        }
        (true, last, now)
    }

    /// What /healthz answers: the proxy is healthy and the Node eligible.
    pub fn healthz(&self) -> HealthReport {
        let node_eligible = self.node_eligible();
        let (healthy, last, now) = self.check();
        let healthy = healthy && node_eligible;
        HealthReport {
            healthy,
            // Upstream reports "now" while healthy, for compatibility.
            last_updated: if healthy { now } else { last },
            current_time: now,
            node_eligible,
        }
    }

    /// What /livez answers: the proxy's health only.
    pub fn livez(&self) -> HealthReport {
        let node_eligible = self.node_eligible();
        let (healthy, last, now) = self.check();
        HealthReport {
            healthy,
            last_updated: if healthy { now } else { last },
            current_time: now,
            node_eligible,
        }
    }
}

/// The sync loop's health updates land here.
impl kp_sync::SyncHealth for HealthState {
    fn queued_update(&self, family: IpFamily) {
        HealthState::queued_update(self, family);
    }
    fn updated(&self, family: IpFamily) {
        HealthState::updated(self, family);
    }
    fn set_node_eligible(&self, eligible: bool) {
        HealthState::set_node_eligible(self, eligible);
    }
    fn set_source_connected(&self, connected: bool) {
        HealthState::set_source_connected(self, connected);
    }
}

/// JSON with nosniff, as upstream's health servers answer.
pub(crate) fn json_response(status: StatusCode, body: serde_json::Value) -> Response {
    let mut resp = (status, body.to_string()).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    resp
}

#[derive(Clone)]
struct HealthApp {
    state: Arc<HealthState>,
    metrics: Metrics,
}

async fn healthz_handler(State(app): State<HealthApp>) -> Response {
    let r = app.state.healthz();
    let status = if r.healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    app.metrics.inc_healthz(status.as_u16());
    let mut body = serde_json::json!({
        "lastUpdated": format_rfc3339(r.last_updated),
        "currentTime": format_rfc3339(r.current_time),
        "nodeEligible": r.node_eligible,
        "sourceConnected": true,
    });
    // Ours: how stale our view of the cluster may be.
    if let Some(since) = app.state.source_lost_since() {
        body["sourceConnected"] = serde_json::json!(false);
        body["sourceDisconnectedSince"] = serde_json::json!(format_rfc3339(since));
    }
    json_response(status, body)
}

async fn livez_handler(State(app): State<HealthApp>) -> Response {
    let r = app.state.livez();
    let status = if r.healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    app.metrics.inc_livez(status.as_u16());
    json_response(
        status,
        serde_json::json!({
            "lastUpdated": format_rfc3339(r.last_updated),
            "currentTime": format_rfc3339(r.current_time),
        }),
    )
}

/// The /healthz + /livez router.
pub fn health_router(state: Arc<HealthState>, metrics: Metrics) -> Router {
    Router::new()
        .route("/healthz", get(healthz_handler))
        .route("/livez", get(livez_handler))
        .with_state(HealthApp { state, metrics })
}

#[derive(Clone)]
struct MetricsApp {
    metrics: Metrics,
    mode: &'static str,
    configz: Arc<String>,
}

async fn metrics_handler(State(app): State<MetricsApp>, headers: HeaderMap) -> Response {
    let openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    let (body, ctype) = if openmetrics {
        (app.metrics.encode_openmetrics(), OPENMETRICS_CONTENT_TYPE)
    } else {
        (app.metrics.encode(), PROMETHEUS_CONTENT_TYPE)
    };
    ([(header::CONTENT_TYPE, ctype)], body).into_response()
}

async fn proxy_mode_handler(State(app): State<MetricsApp>) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        app.mode,
    )
        .into_response()
}

async fn configz_handler(State(app): State<MetricsApp>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        app.configz.as_str().to_string(),
    )
        .into_response()
}

async fn ping_handler() -> Response {
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], "ok").into_response()
}

/// The /metrics, /proxyMode, /configz, /healthz router. `configz` is the
/// effective KubeProxyConfiguration (see
/// [`crate::config::ProxyConfig::to_configuration_json`]); it is served as
/// `{"kubeproxy.config.k8s.io": configz}` like upstream.
pub fn metrics_router(metrics: Metrics, mode: &'static str, configz: serde_json::Value) -> Router {
    let body = serde_json::json!({ "kubeproxy.config.k8s.io": configz }).to_string();
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/proxyMode", get(proxy_mode_handler))
        .route("/configz", get(configz_handler))
        // Like upstream's metrics server: a plain liveness ping.
        .route("/healthz", get(ping_handler))
        .with_state(MetricsApp {
            metrics,
            mode,
            configz: Arc::new(body),
        })
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, ServerError> {
    bind_std(addr)
        .and_then(|l| {
            l.set_nonblocking(true)?;
            TcpListener::from_std(l)
        })
        .map_err(|source| ServerError::Bind { addr, source })
}

/// Binds `addr`. `0.0.0.0` means every address of both families, as it does
/// for upstream's Go servers (Go listens on a dual-stack socket for an
/// unspecified IPv4 address): `[::]`, which takes IPv4 too on Linux, and
/// `0.0.0.0` as written where the host has no IPv6. So on an IPv6 or
/// dual-stack node `healthzBindAddress: 0.0.0.0:10256` answers on the
/// node's IPv6 addresses too.
pub fn bind_std(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    if let IpAddr::V4(ip) = addr.ip() {
        if ip.is_unspecified() {
            let any6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), addr.port());
            if let Ok(l) = std::net::TcpListener::bind(any6) {
                return Ok(l);
            }
        }
    }
    std::net::TcpListener::bind(addr)
}

/// How long a stopped server waits before it is started again (upstream
/// restarts its health and metrics servers every 5 s the same way).
pub const SERVER_RESTART_DELAY: Duration = Duration::from_secs(5);

/// Keeps a server running for the life of the process: when it stops (the
/// port cannot be bound, serving fails) or its task panics, the reason is
/// logged, counted in `kubeproxy_rs_server_restarts_total{server}`, and the
/// server started again after `delay`, so a dead /healthz or /metrics never
/// goes unnoticed. Returns only when the runtime cancels it (shutdown).
pub async fn supervise<F, Fut>(what: &'static str, metrics: Metrics, delay: Duration, mut start: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), ServerError>> + Send + 'static,
{
    loop {
        match tokio::spawn(start()).await {
            Ok(Ok(())) => tracing::warn!(server = what, "server stopped; restarting"),
            Ok(Err(e)) => {
                tracing::error!(server = what, error = %e, ?delay, "server failed; restarting")
            }
            Err(e) if e.is_panic() => {
                tracing::error!(server = what, ?delay, "server task panicked; restarting")
            }
            // Cancelled: the runtime is shutting down.
            Err(_) => return,
        }
        metrics.inc_server_restart(what);
        tokio::time::sleep(delay).await;
    }
}

/// Serves /healthz and /livez on `addr` until the task is dropped.
pub async fn serve_health(
    addr: SocketAddr,
    state: Arc<HealthState>,
    metrics: Metrics,
) -> Result<(), ServerError> {
    let listener = bind(addr).await?;
    serve_health_on(listener, state, metrics).await
}

/// As [`serve_health`], on a listener the caller bound (tests bind port 0).
pub async fn serve_health_on(
    listener: TcpListener,
    state: Arc<HealthState>,
    metrics: Metrics,
) -> Result<(), ServerError> {
    if let Ok(a) = listener.local_addr() {
        tracing::info!(address = %a, "serving /healthz and /livez");
    }
    axum::serve(listener, health_router(state, metrics))
        .await
        .map_err(|source| ServerError::Serve {
            what: "healthz",
            source,
        })
}

/// Serves /metrics, /proxyMode, /configz, /healthz, /statusz and /flagz on `addr`, and with
/// `debug` /debug/services and /debug/explain.
pub async fn serve_metrics(
    addr: SocketAddr,
    metrics: Metrics,
    mode: &'static str,
    configz: serde_json::Value,
    debug: Option<crate::http::debug::DebugState>,
) -> Result<(), ServerError> {
    let listener = bind(addr).await?;
    serve_metrics_on(listener, metrics, mode, configz, debug).await
}

/// As [`serve_metrics`], on a listener the caller bound.
pub async fn serve_metrics_on(
    listener: TcpListener,
    metrics: Metrics,
    mode: &'static str,
    configz: serde_json::Value,
    debug: Option<crate::http::debug::DebugState>,
) -> Result<(), ServerError> {
    if let Ok(a) = listener.local_addr() {
        tracing::info!(address = %a, "serving /metrics, /proxyMode, /configz, /statusz, /flagz, /debug");
    }
    let pages = crate::http::zpages::for_process(debug.is_some()).with_gates(
        metrics.feature_enabled("ComponentStatusz"),
        metrics.feature_enabled("ComponentFlagz"),
    );
    let mut router =
        metrics_router(metrics, mode, configz).merge(crate::http::zpages::router(pages));
    if let Some(d) = debug {
        router = router.merge(crate::http::debug::debug_router(d));
    }
    axum::serve(listener, router)
        .await
        .map_err(|source| ServerError::Serve {
            what: "metrics",
            source,
        })
}
