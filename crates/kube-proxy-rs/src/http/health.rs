//! Per-Service health check node ports (upstream's service_health.go).
//!
//! A LoadBalancer Service with externalTrafficPolicy Local gets a
//! healthCheckNodePort; cloud load balancers probe it on every node and send
//! traffic only to nodes that answer 200, i.e. nodes with a local ready
//! endpoint and a healthy proxy.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use axum::Router;
use kp_model::ServiceName;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::http::server::HealthState;

struct Listening {
    port: u16,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        // Aborting the serve task drops its listener, which closes the port.
        for t in &self.tasks {
            t.abort();
        }
    }
}

#[derive(Default)]
struct Shared {
    services: HashMap<ServiceName, Listening>,
    /// Last known local endpoint counts, kept for services whose port opens
    /// later.
    endpoints: HashMap<ServiceName, usize>,
}

/// Opens and closes the health check node ports and answers on them.
pub struct ServiceHealthServer {
    bind_ips: Vec<IpAddr>,
    health: Arc<HealthState>,
    runtime: Handle,
    shared: Arc<Mutex<Shared>>,
}

impl std::fmt::Debug for ServiceHealthServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceHealthServer")
            .field("bind_ips", &self.bind_ips)
            .field("ports", &self.ports())
            .finish()
    }
}

#[derive(Clone)]
struct HandlerState {
    name: ServiceName,
    shared: Arc<Mutex<Shared>>,
    health: Arc<HealthState>,
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // The maps stay consistent even if a holder panicked.
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

async fn answer(State(st): State<HandlerState>) -> Response {
    let (count, open) = {
        let g = lock(&st.shared);
        (
            g.endpoints.get(&st.name).copied().unwrap_or(0),
            g.services.contains_key(&st.name),
        )
    };
    let count = if open { count } else { 0 };
    let proxy_healthy = st.health.is_healthy();
    let status = if count > 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "service": {"namespace": &*st.name.namespace, "name": &*st.name.name},
        "localEndpoints": count,
        "serviceProxyHealthy": proxy_healthy,
    });
    let mut resp = super::server::json_response(status, body);
    resp.headers_mut().insert(
        "X-Load-Balancing-Endpoint-Weight",
        HeaderValue::from(count as u64),
    );
    resp
}

impl ServiceHealthServer {
    /// `bind_ips`: addresses to listen on (empty: all addresses). Listeners run
    /// on `runtime`, so the sync methods can be called from any thread.
    pub fn new(bind_ips: Vec<IpAddr>, health: Arc<HealthState>, runtime: Handle) -> Self {
        ServiceHealthServer {
            bind_ips,
            health,
            runtime,
            shared: Arc::new(Mutex::new(Shared::default())),
        }
    }

    /// The services with an open port, and the port.
    pub fn ports(&self) -> HashMap<ServiceName, u16> {
        lock(&self.shared)
            .services
            .iter()
            .map(|(n, l)| (n.clone(), l.port))
            .collect()
    }

    /// Makes the open ports exactly `services` (name -> healthCheckNodePort).
    /// A port that cannot be opened is logged and retried on the next call.
    pub fn sync_services(&self, services: &HashMap<ServiceName, u16>) {
        let mut g = lock(&self.shared);
        g.services.retain(|name, l| {
            let keep = services.get(name) == Some(&l.port);
            if !keep {
                tracing::info!(service = %name, port = l.port, "closing health check port");
            }
            keep
        });
        for (name, &port) in services {
            if port == 0 || g.services.contains_key(name) {
                continue;
            }
            match self.listen(name, port) {
                Ok(tasks) => {
                    tracing::info!(service = %name, port, "opened health check port");
                    g.services.insert(name.clone(), Listening { port, tasks });
                }
                Err(e) => {
                    tracing::error!(service = %name, port, error = %e,
                        "cannot open health check port; will retry on the next sync");
                }
            }
        }
    }

    /// Sets each service's number of local ready endpoints (missing: 0).
    pub fn sync_endpoints(&self, endpoints: &HashMap<ServiceName, usize>) {
        lock(&self.shared).endpoints = endpoints.clone();
    }

    fn listen(&self, name: &ServiceName, port: u16) -> std::io::Result<Vec<JoinHandle<()>>> {
        let mut listeners = Vec::new();
        if self.bind_ips.is_empty() {
            // every address of both families
            listeners.push(crate::http::server::bind_std(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                port,
            ))?);
        } else {
            // All or nothing: a half-open service would answer on some IPs only.
            for ip in &self.bind_ips {
                listeners.push(std::net::TcpListener::bind(SocketAddr::new(*ip, port))?);
            }
        }
        let _guard = self.runtime.enter();
        let mut tasks = Vec::new();
        for l in listeners {
            l.set_nonblocking(true)?;
            let listener = tokio::net::TcpListener::from_std(l)?;
            let app = Router::new().fallback(answer).with_state(HandlerState {
                name: name.clone(),
                shared: self.shared.clone(),
                health: self.health.clone(),
            });
            let svc = name.clone();
            tasks.push(self.runtime.spawn(async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!(service = %svc, port, error = %e, "health check server stopped");
                }
            }));
        }
        Ok(tasks)
    }
}

impl Drop for ServiceHealthServer {
    fn drop(&mut self) {
        lock(&self.shared).services.clear();
    }
}
