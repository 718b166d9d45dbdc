//! The API client: kube's stack (base URI, retries of 429/503/504,
//! authentication, extra headers) over a connector with TCP keepalive that
//! speaks HTTP/2 over TLS, as client-go does.
//!
//! Why HTTP/2: over HTTP/1.1 every watch holds a connection of its own, so
//! a proxy opens one TLS connection per resource it watches, where
//! client-go multiplexes them all over one. Each handshake is CPU on the API
//! server, times every node on every rollout. HTTP/2 is negotiated by ALPN,
//! so a server that speaks only HTTP/1.1 (or plain http) still gets it.
//! Its health pings are client-go's: one after 30 s without a frame, the
//! connection failed when it is not answered within 15 s.
//!
//! Why not `kube::Client::try_from(config)`: its connector has no keepalive,
//! and a watch is a long response the client never writes to. An API server
//! that goes away without a FIN or RST (a network partition, a dead node or
//! load balancer) then leaves the watches waiting for kube-runtime's idle
//! timeout, 295 s, while /healthz says the source is connected and changes
//! pile up unseen; after the partition the stalled connections resume only
//! at the next TCP retransmission (measured: nothing noticed in 150 s, the
//! change programmed 28 s after the network came back). client-go has the
//! same need and answers it with HTTP/2 health pings (30 s idle, 15 s
//! timeout). With keepalive the kernel probes a connection that has been
//! silent for [`KEEPALIVE_IDLE`] and fails it after [`KEEPALIVE_RETRIES`]
//! unanswered probes: about 30 s. A healthy quiet watch costs one empty
//! segment each way per probe.
//!
//! Responses may come gzip-compressed (`Accept-Encoding: gzip`, as client-go
//! asks; the API server compresses lists over 128 KiB): the layer under
//! the metrics decompresses them, so the metrics count the bytes the client
//! reads, as client-go's do. kp-source asks watches for `identity`.

use std::time::Duration;

use anyhow::{Context, Result};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::ConfigExt;
use tower::{BoxError, ServiceBuilder};

/// Silence before the first keepalive probe.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
/// Between unanswered probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes before the kernel fails the connection.
pub const KEEPALIVE_RETRIES: u32 = 3;
/// client-go's HTTP/2 ReadIdleTimeout: a ping after this long without a frame.
pub const H2_PING_IDLE: Duration = Duration::from_secs(30);
/// client-go's HTTP/2 PingTimeout: the connection fails when a ping is not
/// answered this soon.
pub const H2_PING_TIMEOUT: Duration = Duration::from_secs(15);

/// A client for `config` whose connections use TCP keepalive (see the
/// module documentation). A proxy URL in `config` goes through kube's own
/// builder, which implements proxies (without keepalive).
pub fn client(config: kube::Config) -> Result<kube::Client> {
    if config.proxy_url.is_some() {
        return kube::Client::try_from(config).context("building the API client");
    }
    let mut http = HttpConnector::new();
    // The TLS layer above carries https.
    http.enforce_http(false);
    http.set_connect_timeout(config.connect_timeout);
    http.set_keepalive(Some(KEEPALIVE_IDLE));
    http.set_keepalive_interval(Some(KEEPALIVE_INTERVAL));
    http.set_keepalive_retries(Some(KEEPALIVE_RETRIES));
    let https = https_connector(&config, http)?;
    let hyper = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .http2_keep_alive_interval(H2_PING_IDLE)
        .http2_keep_alive_timeout(H2_PING_TIMEOUT)
        .http2_keep_alive_while_idle(true)
        .build(https);
    // The layers, and their order, of kube's own builder.
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.default_retry.then(|| {
            tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry())
        }))
        .option_layer(config.auth_layer().context("API credentials")?)
        .layer(config.extra_headers_layer().context("API headers")?)
        .map_err(BoxError::from)
        // Innermost, so each attempt of a retried request counts.
        .layer(crate::metrics::client::MetricsLayer)
        .layer(
            tower_http::decompression::DecompressionLayer::new()
                .no_br()
                .no_deflate()
                .no_zstd(),
        )
        .service(hyper);
    crate::metrics::client::transport_created();
    Ok(kube::Client::new(service, config.default_namespace))
}

/// kube's rustls connector (its TLS settings, CA, client identity and
/// server name) with HTTP/2 offered beside HTTP/1.1.
fn https_connector(
    config: &kube::Config,
    http: HttpConnector,
) -> Result<hyper_rustls::HttpsConnector<HttpConnector>> {
    let tls = config
        .rustls_client_config()
        .context("setting up TLS for the API server")?;
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    let builder = match &config.tls_server_name {
        Some(name) => {
            let name = rustls::pki_types::ServerName::try_from(name.clone())
                .with_context(|| format!("tls-server-name {name:?} is not a server name"))?;
            builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
        }
        None => builder,
    };
    Ok(builder.enable_http1().enable_http2().wrap_connector(http))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `tr` (timer) and `tm->when` (clock ticks) fields of the TCP socket
    /// from local port `local` to remote port `remote` in /proc/net/tcp.
    fn timer(local: u16, remote: u16) -> Option<(u8, u64)> {
        let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
        table.lines().skip(1).find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let port = |a: &str| u16::from_str_radix(a.rsplit(':').next()?, 16).ok();
            if port(f[1])? != local || port(f[2])? != remote {
                return None;
            }
            let (tr, when) = f[5].split_once(':')?;
            Some((tr.parse().ok()?, u64::from_str_radix(when, 16).ok()?))
        })
    }

    /// A request the server never answers leaves the client's connection
    /// silent: the kernel's keepalive timer (tr 2) is what runs on it, due
    /// within KEEPALIVE_IDLE. Without SO_KEEPALIVE no timer runs at all.
    #[tokio::test]
    async fn connections_use_tcp_keepalive() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        let c = client(config).unwrap();
        let request = tokio::spawn(async move {
            kube::Api::<k8s_openapi::api::core::v1::Node>::all(c)
                .get("node1")
                .await
        });
        let (_held, peer) = listener.accept().await.unwrap();
        let mut seen = None;
        for _ in 0..50 {
            seen = timer(peer.port(), port);
            if seen.is_some_and(|(tr, _)| tr == 2) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        request.abort();
        let (tr, when) = seen.expect("the client's socket is in /proc/net/tcp");
        assert_eq!(tr, 2, "no keepalive timer on the client's connection");
        // In clock ticks (USER_HZ, 100 per second on Linux); the system
        // default would be 7200 s.
        assert!(
            when <= KEEPALIVE_IDLE.as_secs() * 100,
            "keepalive due in {when} ticks"
        );
    }
}

#[cfg(test)]
mod metrics_tests {
    use super::*;
    use crate::metrics::Metrics;

    /// A real request through the client shows in client-go's series with
    /// client-go's labels: the answer's code, the server's host:port, the
    /// method; latency and sizes for a request, not for a watch.
    #[tokio::test]
    async fn requests_are_counted_and_timed() {
        let app = axum::Router::new().route(
            "/api/v1/nodes/{name}",
            axum::routing::get(|| async {
                (
                    [("content-type", "application/json")],
                    r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"n1"}}"#,
                )
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        let c = client(config).unwrap();
        let nodes = kube::Api::<k8s_openapi::api::core::v1::Node>::all(c);
        nodes.get("n1").await.unwrap();
        // No route: the answer's code is the label.
        assert!(nodes.get("a/b").await.is_err());
        server.abort();
        let text = Metrics::new().encode();
        let host = format!("127.0.0.1:{port}");
        for want in [
            format!("rest_client_requests_total{{code=\"200\",host=\"{host}\",method=\"GET\"}} 1\n"),
            format!("rest_client_requests_total{{code=\"404\",host=\"{host}\",method=\"GET\"}} 1\n"),
            format!("rest_client_request_duration_seconds_count{{host=\"{host}\",verb=\"GET\"}} "),
            format!("rest_client_response_size_bytes_count{{host=\"{host}\",verb=\"GET\"}} "),
            format!("rest_client_request_size_bytes_bucket{{le=\"64.0\",host=\"{host}\",verb=\"GET\"}} "),
            "rest_client_transport_create_calls_total{result=\"uncacheable\"} ".to_string(),
            "rest_client_exec_plugin_ttl_seconds +Inf\n".to_string(),
            "# TYPE rest_client_requests_total counter\n".to_string(),
        ] {
            assert!(text.contains(&want), "no `{want}` in:\n{text}");
        }
        // The response body the client read was counted.
        let size_sum: f64 = text
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "rest_client_response_size_bytes_sum{{host=\"{host}\",verb=\"GET\"}} "
                ))
            })
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        assert!(size_sum >= 50.0, "response bytes {size_sum}");
    }
}

#[cfg(test)]
mod gzip_tests {
    use super::*;
    use crate::metrics::Metrics;
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    /// Lists ask for gzip and read a compressed answer; a request that
    /// names its encoding (kp-source's watches: identity) keeps it; the
    /// metrics count the bytes as read, decompressed.
    #[tokio::test]
    async fn lists_are_gzipped_and_counted_as_read() {
        let nodes: Vec<serde_json::Value> = (0..200)
            .map(|i| serde_json::json!({"metadata": {"name": format!("node-{i}"), "labels": {"zone": "z1"}}}))
            .collect();
        let body = serde_json::json!({"apiVersion": "v1", "kind": "NodeList",
            "metadata": {"resourceVersion": "5"}, "items": nodes})
        .to_string();
        let plain_len = body.len();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(body.as_bytes()).unwrap();
        let compressed = gz.finish().unwrap();
        assert!(compressed.len() * 4 < plain_len);
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let s2 = seen.clone();
        let app = axum::Router::new().route(
            "/api/v1/nodes",
            axum::routing::get(move |headers: axum::http::HeaderMap| {
                let seen = s2.clone();
                let (body, compressed) = (body.clone(), compressed.clone());
                async move {
                    let ae = headers
                        .get("accept-encoding")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_string();
                    seen.lock().unwrap().push(ae.clone());
                    if ae.contains("gzip") {
                        axum::response::Response::builder()
                            .header("content-type", "application/json")
                            .header("content-encoding", "gzip")
                            .body(axum::body::Body::from(compressed))
                            .unwrap()
                    } else {
                        axum::response::Response::builder()
                            .header("content-type", "application/json")
                            .body(axum::body::Body::from(body))
                            .unwrap()
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        let c = client(config).unwrap();
        let list = kube::Api::<k8s_openapi::api::core::v1::Node>::all(c.clone())
            .list(&Default::default())
            .await
            .unwrap();
        assert_eq!(list.items.len(), 200);
        let req = http::Request::get("/api/v1/nodes?watch=true")
            .header("accept-encoding", "identity")
            .body(kube::client::Body::from(Vec::new()))
            .unwrap();
        let res = c.send(req).await.unwrap();
        assert!(res.headers().get("content-encoding").is_none());
        server.abort();
        assert_eq!(*seen.lock().unwrap(), ["gzip", "identity"]);
        let text = Metrics::new().encode();
        let size_sum: f64 = text
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "rest_client_response_size_bytes_sum{{host=\"127.0.0.1:{port}\",verb=\"GET\"}} "
                ))
            })
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        assert_eq!(size_sum, plain_len as f64, "bytes counted");
    }
}
