//! The HTTP servers over real loopback sockets: /healthz, /livez, /metrics,
//! /proxyMode, /configz and the per-Service health check ports.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kp_model::{IpFamily, ServiceName};
use kp_sync::{Clock, ManualClock};
use kube_proxy_rs::http::health::ServiceHealthServer;
use kube_proxy_rs::http::server::{serve_health_on, serve_metrics_on, HealthState};
use kube_proxy_rs::metrics::Metrics;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

struct Reply {
    status: u16,
    headers: HashMap<String, String>,
    body: String,
}

impl Reply {
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// One HTTP/1.0 GET; the server closes the connection after answering.
async fn get(addr: SocketAddr, path: &str, accept: Option<&str>) -> std::io::Result<Reply> {
    let mut s = TcpStream::connect(addr).await?;
    let mut req = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n");
    if let Some(a) = accept {
        req.push_str(&format!("Accept: {a}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut raw))
        .await
        .map_err(|_| std::io::Error::other("read timed out"))??;
    let text = String::from_utf8(raw).map_err(std::io::Error::other)?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no header end in {text:?}")))?;
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {status_line:?}")))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(Reply {
        status,
        headers,
        body: body.to_string(),
    })
}

async fn must_get(addr: SocketAddr, path: &str) -> Reply {
    get(addr, path, None).await.unwrap()
}

fn start_time() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000)
}

/// A virtual clock at [`start_time`], as a health state takes it.
fn manual_clock() -> (ManualClock, Arc<dyn Clock>) {
    let (clock, _events) = ManualClock::new();
    assert_eq!(clock.system_now(), start_time());
    (clock.clone(), Arc::new(clock))
}

async fn start_health(
    families: &[IpFamily],
    timeout: Duration,
) -> (SocketAddr, Arc<HealthState>, ManualClock, Metrics) {
    let (clock, shared) = manual_clock();
    let state = Arc::new(HealthState::with_clock(families, timeout, shared));
    let metrics = Metrics::new();
    let listener = TcpListener::bind((LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve_health_on(listener, state.clone(), metrics.clone()));
    (addr, state, clock, metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_is_ok_after_an_update() {
    let (addr, state, clock, metrics) =
        start_health(&[IpFamily::V4, IpFamily::V6], Duration::from_secs(60)).await;
    state.queued_update(IpFamily::V4);
    clock.advance(Duration::from_secs(5));
    state.updated(IpFamily::V4);

    let r = must_get(addr, "/healthz").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["content-type"], "application/json");
    assert_eq!(r.headers["x-content-type-options"], "nosniff");
    let j = r.json();
    assert_eq!(j["nodeEligible"], true);
    assert_eq!(j["currentTime"], "2023-11-14T22:13:25Z");
    // Healthy: lastUpdated is reported as now, as upstream.
    assert_eq!(j["lastUpdated"], j["currentTime"]);

    let r = must_get(addr, "/livez").await;
    assert_eq!(r.status, 200);
    assert!(r.json().get("nodeEligible").is_none());

    let text = metrics.encode();
    assert!(
        text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_livez_total{code=\"200\"} 1\n"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_fails_when_a_queued_update_is_older_than_the_timeout() {
    let (addr, state, clock, metrics) =
        start_health(&[IpFamily::V4, IpFamily::V6], Duration::from_secs(60)).await;
    clock.advance(Duration::from_secs(10));
    state.queued_update(IpFamily::V6);
    clock.advance(Duration::from_secs(30));
    // A later queued update does not reset the oldest one.
    state.queued_update(IpFamily::V6);
    clock.advance(Duration::from_secs(29));
    assert_eq!(must_get(addr, "/healthz").await.status, 200, "59s < 60s");

    clock.advance(Duration::from_secs(1));
    let r = must_get(addr, "/healthz").await;
    assert_eq!(r.status, 503, "{}", r.body);
    let j = r.json();
    // Unhealthy: lastUpdated is the stuck family's last update (the start).
    assert_eq!(j["lastUpdated"], "2023-11-14T22:13:20Z");
    assert_eq!(j["currentTime"], "2023-11-14T22:14:30Z");
    assert_eq!(must_get(addr, "/livez").await.status, 503);
    assert!(!state.is_healthy());

    // The other family being fine does not help; syncing the stuck one does.
    state.updated(IpFamily::V4);
    assert_eq!(must_get(addr, "/healthz").await.status, 503);
    state.updated(IpFamily::V6);
    assert_eq!(must_get(addr, "/healthz").await.status, 200);
    assert_eq!(must_get(addr, "/livez").await.status, 200);

    let text = metrics.encode();
    assert!(
        text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 2\n"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 2\n"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_livez_total{code=\"503\"} 1\n"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_synced_proxier_turns_unhealthy() {
    let (addr, state, clock, _m) = start_health(&[IpFamily::V4], Duration::from_secs(60)).await;
    assert_eq!(must_get(addr, "/healthz").await.status, 200, "starting up");
    state.queued_update(IpFamily::V4);
    clock.advance(Duration::from_secs(61));
    assert_eq!(must_get(addr, "/healthz").await.status, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn livez_ignores_node_eligibility() {
    let (addr, state, _clock, _m) = start_health(&[IpFamily::V4], Duration::from_secs(60)).await;
    state.set_node_eligible(false);
    let r = must_get(addr, "/healthz").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["nodeEligible"], false);
    assert_eq!(must_get(addr, "/livez").await.status, 200);
    state.set_node_eligible(true);
    assert_eq!(must_get(addr, "/healthz").await.status, 200);
}

async fn start_metrics(metrics: Metrics) -> SocketAddr {
    let listener = TcpListener::bind((LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let configz = serde_json::json!({"mode": "nftables", "bindAddress": "0.0.0.0"});
    tokio::spawn(serve_metrics_on(
        listener, metrics, "nftables", configz, None,
    ));
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_use_upstream_names() {
    let m = Metrics::new();
    m.observe_sync(IpFamily::V4, true, 0.003);
    m.observe_sync(IpFamily::V4, false, 0.0005);
    m.observe_programming_latency(IpFamily::V4, 1.5);
    m.set_queued(IpFamily::V4);
    m.add_changes(3, 7);
    m.set_pending(1, 2);
    m.set_no_local_endpoints(IpFamily::V4, 4, 5);
    m.inc_sync_failure(IpFamily::V4, kp_model::ProxyMode::Nftables);
    m.inc_sync_failure(IpFamily::V6, kp_model::ProxyMode::Iptables);
    m.inc_partial_restore_failure(IpFamily::V4);
    m.observe_conntrack_reconcile(IpFamily::V4, 0.01, 6);
    m.inc_invalid("Service");
    m.inc_rules_lost(IpFamily::V4);
    m.set_sync_bytes(IpFamily::V4, 4096);
    m.inc_sync_retry(IpFamily::V4);
    m.userspace_connection_opened("default/web:http");
    m.add_userspace_bytes("default/web:http", "in", 100);
    m.inc_userspace_error("default/web:http");

    let addr = start_metrics(m.clone()).await;
    let r = must_get(addr, "/metrics").await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.headers["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let text = r.body;
    let expect = [
        "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
        "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 2",
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.001\",ip_family=\"IPv4\"} 1",
        "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
        "kubeproxy_network_programming_duration_seconds_bucket{le=\"2.0\",ip_family=\"IPv4\"} 1",
        "kubeproxy_network_programming_duration_seconds_bucket{le=\"300.0\",ip_family=\"IPv4\"} 1",
        "# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} ",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv4\"} ",
        "# TYPE kubeproxy_sync_proxy_rules_service_changes_total counter",
        "kubeproxy_sync_proxy_rules_service_changes_total 3\n",
        "kubeproxy_sync_proxy_rules_endpoint_changes_total 7\n",
        "kubeproxy_sync_proxy_rules_service_changes_pending 1\n",
        "kubeproxy_sync_proxy_rules_endpoint_changes_pending 2\n",
        "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 4",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"external\"} 5",
        "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv4\"} 1",
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv6\"} 1",
        "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total{ip_family=\"IPv4\"} 1",
        "kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv4\"} 6",
        "kubeproxy_conntrack_reconciler_sync_duration_seconds_count{ip_family=\"IPv4\"} 1",
        "kubeproxy_rs_invalid_objects_total{kind=\"Service\"} 1",
        "kubeproxy_rs_rules_lost_total{ip_family=\"IPv4\"} 1",
        "kubeproxy_rs_sync_bytes{ip_family=\"IPv4\"} 4096",
        "kubeproxy_rs_sync_retries_total{ip_family=\"IPv4\"} 1",
        "kubeproxy_rs_userspace_active_connections{service=\"default/web:http\"} 1",
        "kubeproxy_rs_userspace_bytes_total{service=\"default/web:http\",direction=\"in\"} 100",
        "kubeproxy_rs_userspace_errors_total{service=\"default/web:http\"} 1",
    ];
    for e in expect {
        assert!(text.contains(e), "missing {e:?} in:\n{text}");
    }
    // Dropped: never fed (nftables deletes stale chains in the sync's own
    // transaction); iptables rule counts come only with an iptables sync's
    // report, none here.
    for gone in [
        "nftables_cleanup_failures",
        "sync_proxy_rules_iptables_total",
        "sync_proxy_rules_iptables_last",
    ] {
        assert!(!text.contains(gone), "{gone} in:\n{text}");
    }
    assert!(!text.contains("_total_total"), "{text}");
    assert!(!text.contains("# EOF"), "{text}");
    // Every TYPE'd name is one the samples use.
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = line.split_whitespace().nth(2).unwrap();
        let typ = line.split_whitespace().nth(3).unwrap();
        if typ == "counter" {
            assert!(name.ends_with("_total"), "{line}");
        }
    }

    // OpenMetrics on request.
    let r = get(
        addr,
        "/metrics",
        Some("application/openmetrics-text; version=1.0.0"),
    )
    .await
    .unwrap();
    assert!(r.headers["content-type"].starts_with("application/openmetrics-text"));
    assert!(r.body.ends_with("# EOF\n"));
    assert!(r
        .body
        .contains("# TYPE kubeproxy_sync_proxy_rules_service_changes counter"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_mode_configz_and_ping() {
    let addr = start_metrics(Metrics::new()).await;
    let r = must_get(addr, "/proxyMode").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body, "nftables");
    let r = must_get(addr, "/configz").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], "application/json");
    assert_eq!(r.json()["kubeproxy.config.k8s.io"]["mode"], "nftables");
    let r = must_get(addr, "/healthz").await;
    assert_eq!((r.status, r.body.as_str()), (200, "ok"));
    assert_eq!(must_get(addr, "/nope").await.status, 404);
}

/// A port that was free a moment ago.
fn free_port() -> u16 {
    std::net::TcpListener::bind((LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn wait_closed(addr: SocketAddr) {
    // Closing happens on the runtime after the task is aborted; bounded wait.
    for _ in 0..200 {
        if TcpStream::connect(addr).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{addr} still accepts connections");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_health_ports_follow_services_and_endpoints() {
    let (clock, shared) = manual_clock();
    let health = Arc::new(HealthState::with_clock(
        &[IpFamily::V4],
        Duration::from_secs(60),
        shared,
    ));
    let hcs = ServiceHealthServer::new(
        vec![LOCALHOST],
        health.clone(),
        tokio::runtime::Handle::current(),
    );
    let a = ServiceName::new("ns", "a");
    let b = ServiceName::new("ns", "b");
    let (pa, pb) = (free_port(), free_port());
    hcs.sync_services(&HashMap::from([(a.clone(), pa), (b.clone(), pb)]));
    hcs.sync_endpoints(&HashMap::from([(a.clone(), 2)]));
    assert_eq!(hcs.ports().len(), 2);
    let addr_a = SocketAddr::new(LOCALHOST, pa);
    let addr_b = SocketAddr::new(LOCALHOST, pb);

    let r = must_get(addr_a, "/").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.headers["content-type"], "application/json");
    assert_eq!(r.headers["x-content-type-options"], "nosniff");
    assert_eq!(r.headers["x-load-balancing-endpoint-weight"], "2");
    assert_eq!(
        r.json(),
        serde_json::json!({
            "service": {"namespace": "ns", "name": "a"},
            "localEndpoints": 2,
            "serviceProxyHealthy": true,
        })
    );
    let r = must_get(addr_b, "/any/path").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["localEndpoints"], 0);
    assert_eq!(r.json()["service"]["name"], "b");
    assert_eq!(r.headers["x-load-balancing-endpoint-weight"], "0");

    // Endpoints move from a to b.
    hcs.sync_endpoints(&HashMap::from([(b.clone(), 1)]));
    assert_eq!(must_get(addr_a, "/").await.status, 503);
    assert_eq!(must_get(addr_b, "/").await.status, 200);

    // An unhealthy proxy fails every service.
    health.queued_update(IpFamily::V4);
    clock.advance(Duration::from_secs(120));
    let r = must_get(addr_b, "/").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["serviceProxyHealthy"], false);
    assert_eq!(r.json()["localEndpoints"], 1);
    health.updated(IpFamily::V4);
    assert_eq!(must_get(addr_b, "/").await.status, 200);

    // Removing a service closes its port and leaves the other.
    hcs.sync_services(&HashMap::from([(b.clone(), pb)]));
    wait_closed(addr_a).await;
    assert_eq!(must_get(addr_b, "/").await.status, 200);

    // Moving a service to another port closes the old one.
    let pb2 = free_port();
    hcs.sync_services(&HashMap::from([(b.clone(), pb2)]));
    wait_closed(addr_b).await;
    assert_eq!(
        must_get(SocketAddr::new(LOCALHOST, pb2), "/").await.status,
        200
    );
    drop(hcs);
    wait_closed(SocketAddr::new(LOCALHOST, pb2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_health_port_is_retried_on_next_sync() {
    let health = Arc::new(HealthState::new(&[IpFamily::V4], Duration::from_secs(60)));
    let hcs = ServiceHealthServer::new(vec![LOCALHOST], health, tokio::runtime::Handle::current());
    let blocker = std::net::TcpListener::bind((LOCALHOST, 0)).unwrap();
    let port = blocker.local_addr().unwrap().port();
    let svc = ServiceName::new("ns", "busy");
    let want = HashMap::from([(svc.clone(), port)]);
    hcs.sync_services(&want);
    assert!(
        hcs.ports().is_empty(),
        "bind must fail while the port is taken"
    );
    drop(blocker);
    hcs.sync_services(&want);
    assert_eq!(hcs.ports().get(&svc), Some(&port));
    hcs.sync_endpoints(&HashMap::from([(svc, 1)]));
    assert_eq!(
        must_get(SocketAddr::new(LOCALHOST, port), "/").await.status,
        200
    );
}

/// A server whose task panics, or that cannot bind its port, is started
/// again (and counted) until it serves: /healthz never stays dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_or_panicked_server_is_started_again() {
    use kube_proxy_rs::http::server::{serve_health, supervise};
    use std::sync::atomic::{AtomicUsize, Ordering};

    let metrics = Metrics::new();
    let state = Arc::new(HealthState::new(&[IpFamily::V4], Duration::from_secs(60)));
    // The port is taken at first: binding fails until it is freed.
    let blocker = std::net::TcpListener::bind((LOCALHOST, 0)).unwrap();
    let addr = blocker.local_addr().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let (m, c) = (metrics.clone(), calls.clone());
    let task = tokio::spawn(supervise(
        "healthz",
        metrics.clone(),
        Duration::from_millis(50),
        move || {
            let n = c.fetch_add(1, Ordering::SeqCst);
            let (st, m) = (state.clone(), m.clone());
            async move {
                if n == 0 {
                    panic!("injected: the server task panics once");
                }
                serve_health(addr, st, m).await
            }
        },
    ));
    // A panic, then bind failures while the port is taken. The deadlines are
    // generous: with RUST_BACKTRACE set the injected panic symbolizes this
    // large test binary first, which takes seconds on a loaded machine.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while calls.load(Ordering::SeqCst) < 3 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        calls.load(Ordering::SeqCst) >= 3,
        "started {} times in 60 s",
        calls.load(Ordering::SeqCst)
    );
    drop(blocker);
    let mut answered = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        if let Ok(r) = get(addr, "/healthz", None).await {
            answered = Some(r.status);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(answered, Some(200), "the restarted server never answered");
    let restarts = metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix("kubeproxy_rs_server_restarts_total{server=\"healthz\"} "))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(restarts >= 2.0, "restarts counted: {restarts}");
    task.abort();
}
