//! client-go's rest_client_* series for our API client, under upstream's
//! names, labels and buckets (k8s.io/component-base/metrics/prometheus/restclient).
//!
//! As client-go's, they are process-wide: every client [`crate::kube::client`]
//! builds counts into the same families, which each [`crate::metrics::Metrics`]
//! registry exports. [`MetricsLayer`] sits directly above the connection, so
//! each attempt a retry makes is a request, as in client-go. Like client-go,
//! a watch counts in `rest_client_requests_total` (when its response
//! starts) but not in the latency and size histograms; a request's latency
//! runs until its response body has been read (or dropped).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::LazyLock;
use std::task::{Context, Poll};
use std::time::Instant;

use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;
type HistogramVec = Family<Labels, Histogram, fn() -> Histogram>;

/// client-go's latency buckets (seconds).
const LATENCY_BUCKETS: [f64; 12] = [
    0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0,
];
/// client-go's size buckets (bytes): 64 B to 16 MiB.
const SIZE_BUCKETS: [f64; 11] = [
    64.0, 256.0, 512.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0,
];
/// Exec plugin certificate lifetimes (seconds): 10 min to 4 years.
const ROTATION_BUCKETS: [f64; 11] = [
    600.0,
    1800.0,
    3600.0,
    14400.0,
    86400.0,
    604800.0,
    2592000.0,
    7776000.0,
    15552000.0,
    31104000.0,
    124416000.0,
];

fn latency() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}
fn size() -> Histogram {
    Histogram::new(SIZE_BUCKETS)
}

struct RestClient {
    requests: Family<Labels, Counter>,
    duration: HistogramVec,
    rate_limiter: HistogramVec,
    request_size: HistogramVec,
    response_size: HistogramVec,
    exec_rotation_age: Histogram,
    exec_ttl: Gauge<f64, AtomicU64>,
    transport_cache_entries: Gauge,
    transport_create_calls: Family<Labels, Counter>,
    cert_rotation_gc_calls: Counter,
}

static REST: LazyLock<RestClient> = LazyLock::new(|| {
    let exec_ttl = Gauge::<f64, AtomicU64>::default();
    // client-go's value while no exec plugin manages a certificate; ours
    // never reads an exec plugin's certificate expiry.
    exec_ttl.set(f64::INFINITY);
    RestClient {
        requests: Family::default(),
        duration: HistogramVec::new_with_constructor(latency),
        rate_limiter: HistogramVec::new_with_constructor(latency),
        request_size: HistogramVec::new_with_constructor(size),
        response_size: HistogramVec::new_with_constructor(size),
        exec_rotation_age: Histogram::new(ROTATION_BUCKETS),
        exec_ttl,
        transport_cache_entries: Gauge::default(),
        transport_create_calls: Family::default(),
        cert_rotation_gc_calls: Counter::default(),
    }
});

/// Registers the process-wide families in `r` (counters without `_total`:
/// prometheus-client appends it).
pub fn register(r: &mut Registry) {
    let m = &*REST;
    r.register(
        "rest_client_requests",
        "[ALPHA] Number of HTTP requests, partitioned by status code, method, and host.",
        m.requests.clone(),
    );
    r.register(
        "rest_client_request_duration_seconds",
        "[ALPHA] Request latency in seconds. Broken down by verb, and host.",
        m.duration.clone(),
    );
    r.register(
        "rest_client_rate_limiter_duration_seconds",
        "[ALPHA] Client side rate limiter latency in seconds. Broken down by verb, and host.",
        m.rate_limiter.clone(),
    );
    r.register(
        "rest_client_request_size_bytes",
        "[ALPHA] Request size in bytes. Broken down by verb and host.",
        m.request_size.clone(),
    );
    r.register(
        "rest_client_response_size_bytes",
        "[ALPHA] Response size in bytes. Broken down by verb and host.",
        m.response_size.clone(),
    );
    r.register(
        "rest_client_exec_plugin_certificate_rotation_age",
        "[ALPHA] Histogram of the number of seconds the last auth exec plugin client certificate lived before being rotated. If auth exec plugin client certificates are unused, histogram will contain no data.",
        m.exec_rotation_age.clone(),
    );
    r.register(
        "rest_client_exec_plugin_ttl_seconds",
        "[ALPHA] Gauge of the shortest TTL (time-to-live) of the client certificate(s) managed by the auth exec plugin. The value is in seconds until certificate expiry (negative if already expired). If auth exec plugins are unused or manage no TLS certificates, the value will be +INF.",
        m.exec_ttl.clone(),
    );
    r.register(
        "rest_client_transport_cache_entries",
        "[ALPHA] Number of transport entries in the internal cache.",
        m.transport_cache_entries.clone(),
    );
    r.register(
        "rest_client_transport_create_calls",
        "[ALPHA] Number of calls to get a new transport, partitioned by the result of the operation hit: obtained from the cache, miss: created and added to the cache, miss-gc: recreated and added back to the cache after being garbage collected, uncacheable: created and not cached",
        m.transport_create_calls.clone(),
    );
    r.register(
        "rest_client_transport_cert_rotation_gc_calls",
        "[ALPHA] Number of times a cert rotation goroutine cancel func is called via GC cleanup of the associated transport",
        m.cert_rotation_gc_calls.clone(),
    );
}

/// A client built its own connection pool: ours are never cached or
/// shared, client-go's "uncacheable".
pub fn transport_created() {
    REST.transport_create_calls
        .get_or_create(&vec![("result", "uncacheable".to_string())])
        .inc();
}

/// client-go's `watch` query parameter: a watch's response never ends.
fn is_watch(query: Option<&str>) -> bool {
    query.is_some_and(|q| {
        q.split('&')
            .any(|kv| matches!(kv, "watch=true" | "watch=1" | "watch=True"))
    })
}

fn host_verb(host: &str, verb: &str) -> Labels {
    vec![("host", host.to_string()), ("verb", verb.to_string())]
}

/// The tower layer that counts and times each request.
#[derive(Clone, Copy, Debug, Default)]
pub struct MetricsLayer;

impl<S> tower::Layer<S> for MetricsLayer {
    type Service = MetricsService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        MetricsService { inner }
    }
}

#[derive(Clone, Debug)]
pub struct MetricsService<S> {
    inner: S,
}

impl<S, ReqB, ResB> tower::Service<Request<ReqB>> for MetricsService<S>
where
    S: tower::Service<Request<ReqB>, Response = Response<ResB>>,
    S::Future: Send + 'static,
    ReqB: Body,
{
    type Response = Response<Counted<ResB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let method = req.method().as_str().to_string();
        // url.Host in client-go: host and port as the base URL spells them.
        let host = req
            .uri()
            .authority()
            .map(|a| a.as_str().to_string())
            .unwrap_or_default();
        let pending = (!is_watch(req.uri().query())).then(|| {
            let l = host_verb(&host, &method);
            let sent = req.body().size_hint().exact().unwrap_or(0);
            REST.request_size.get_or_create(&l).observe(sent as f64);
            // client-go waits here for its token bucket; our client has
            // none, so every request waited no time.
            REST.rate_limiter.get_or_create(&l).observe(0.0);
            Pending {
                labels: l,
                start: Instant::now(),
                received: 0,
            }
        });
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await;
            let code = match &res {
                Ok(r) => r.status().as_u16().to_string(),
                Err(_) => "<error>".to_string(),
            };
            REST.requests
                .get_or_create(&vec![("code", code), ("host", host), ("method", method)])
                .inc();
            // On an error `pending` is dropped here and observes.
            let resp = res?;
            Ok(resp.map(|inner| Counted { inner, pending }))
        })
    }
}

/// A request whose latency and response size are observed when its
/// response body ends or is dropped.
#[derive(Debug)]
struct Pending {
    labels: Labels,
    start: Instant,
    received: u64,
}

impl Drop for Pending {
    fn drop(&mut self) {
        REST.duration
            .get_or_create(&self.labels)
            .observe(self.start.elapsed().as_secs_f64());
        REST.response_size
            .get_or_create(&self.labels)
            .observe(self.received as f64);
    }
}

/// A response body that counts what it yields.
#[derive(Debug)]
pub struct Counted<B> {
    inner: B,
    pending: Option<Pending>,
}

impl<B> Body for Counted<B>
where
    B: Body + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(p), Some(data)) = (this.pending.as_mut(), frame.data_ref()) {
                    p.received += bytes::Buf::remaining(data) as u64;
                }
            }
            // The end, or a broken body: observe now, not when dropped.
            Poll::Ready(_) => drop(this.pending.take()),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watches_are_told_apart() {
        assert!(is_watch(Some("labelSelector=a&watch=true")));
        assert!(is_watch(Some("watch=1")));
        assert!(!is_watch(Some("watch=false")));
        assert!(!is_watch(Some("resourceVersion=0")));
        assert!(!is_watch(None));
    }
}
