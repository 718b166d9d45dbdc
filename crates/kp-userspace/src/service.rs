//! One Service port at run time: its endpoints (shared with the listener
//! tasks), the balancer state and the endpoint lifecycle (grace period).

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use kp_model::{Endpoint, EndpointSelection, NodeInfo, ServicePort, ServicePortName};
use tokio::sync::watch;

use crate::balancer::{pick, AffinityTable, Algorithm};
use crate::plan::Kind;
use crate::MetricsSink;

/// Settings every Service shares.
pub(crate) struct Shared {
    pub algorithm: Algorithm,
    pub connect_timeout: Duration,
    pub tcp_idle_timeout: Duration,
    pub udp_idle_timeout: Duration,
    pub grace_period: Duration,
    pub splice: bool,
    pub pipe_size: usize,
    pub metrics: Arc<dyn MetricsSink>,
    /// Live [`ServiceRt`]s per metrics label: a deleted Service's series go
    /// when its last one (still serving its draining connections) goes, and
    /// not while a re-created Service of the same name uses them.
    pub live: Mutex<HashMap<String, usize>>,
}

/// One endpoint. The same object lives as long as the endpoint stays in the
/// Service, so connection counts (least connections) and the kill switch of
/// its open connections survive endpoint updates.
pub(crate) struct Backend {
    pub addr: SocketAddr,
    /// Open TCP connections and UDP flows.
    pub active: AtomicUsize,
    removed: AtomicBool,
    generation: AtomicU64,
    kill: watch::Sender<bool>,
}

impl Backend {
    fn new(addr: SocketAddr) -> Arc<Backend> {
        Arc::new(Backend {
            addr,
            active: AtomicUsize::new(0),
            removed: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            kill: watch::Sender::new(false),
        })
    }
    /// No longer an endpoint of its Service (new traffic avoids it; UDP
    /// flows move at their next datagram).
    pub fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }
    /// Resolves when the grace period after removal ran out.
    pub fn killed(&self) -> watch::Receiver<bool> {
        self.kill.subscribe()
    }
}

#[derive(Default)]
pub(crate) struct Pool {
    pub backends: Vec<Arc<Backend>>,
    cursor: AtomicUsize,
}

impl Pool {
    fn new(backends: Vec<Arc<Backend>>) -> Pool {
        Pool {
            backends,
            cursor: AtomicUsize::new(0),
        }
    }
}

/// The endpoints of each traffic policy, as [`EndpointSelection`] picks them.
#[derive(Default)]
pub(crate) struct Pools {
    cluster: Pool,
    local: Pool,
    internal_local: bool,
    external_local: bool,
    /// [`EndpointSelection::no_local`].
    no_local: (bool, bool),
    inside: Arc<Inside>,
}

/// Sources that count as "inside the cluster" (pod CIDRs, this node's
/// addresses): with externalTrafficPolicy Local their traffic to external
/// addresses still uses cluster endpoints, as upstream short-circuits it.
/// One per proxier, shared by its Services, so that an address change does
/// not have to visit every Service.
#[derive(Default)]
pub(crate) struct Inside {
    cidrs: Vec<IpNet>,
    /// This node's addresses as of the last full sync, plus the Service IPs
    /// added to lo since, minus the ones removed.
    addrs: RwLock<HashSet<IpAddr>>,
}

impl Inside {
    pub fn new(cidrs: Vec<IpNet>) -> Inside {
        Inside {
            cidrs,
            addrs: RwLock::default(),
        }
    }

    fn addrs(&self) -> std::sync::RwLockWriteGuard<'_, HashSet<IpAddr>> {
        self.addrs.write().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_addrs(&self, addrs: impl IntoIterator<Item = IpAddr>) {
        *self.addrs() = addrs.into_iter().collect();
    }

    pub fn add(&self, ip: IpAddr) {
        self.addrs().insert(ip);
    }

    pub fn remove(&self, ip: &IpAddr) {
        self.addrs().remove(ip);
    }

    fn contains(&self, ip: &IpAddr) -> bool {
        self.cidrs.iter().any(|n| n.contains(ip))
            || self
                .addrs
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .contains(ip)
    }
}

impl Pools {
    fn pool(&self, kind: Kind, client: IpAddr) -> &Pool {
        let local = match kind {
            Kind::Cluster => self.internal_local,
            Kind::External => self.external_local && !self.inside.contains(&client),
        };
        if local {
            &self.local
        } else {
            &self.cluster
        }
    }
}

pub(crate) struct ServiceRt {
    /// "ns/name:port", the metrics label.
    pub label: String,
    pub shared: Arc<Shared>,
    pools: RwLock<Arc<Pools>>,
    affinity: Mutex<Option<AffinityTable>>,
    registry: Mutex<HashMap<SocketAddr, Arc<Backend>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic elsewhere must not take the data plane down with it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for ServiceRt {
    fn drop(&mut self) {
        let mut live = lock(&self.shared.live);
        let gone = match live.get_mut(&self.label) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                live.remove(&self.label);
                true
            }
        };
        drop(live);
        if gone {
            self.shared.metrics.service_gone(&self.label);
        }
    }
}

impl ServiceRt {
    pub fn new(name: ServicePortName, shared: Arc<Shared>) -> Arc<ServiceRt> {
        let label = name.to_string();
        *lock(&shared.live).entry(label.clone()).or_default() += 1;
        Arc::new(ServiceRt {
            label,
            shared,
            pools: RwLock::new(Arc::new(Pools::default())),
            affinity: Mutex::new(None),
            registry: Mutex::new(HashMap::new()),
        })
    }

    fn pools(&self) -> Arc<Pools> {
        self.pools.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether a listener of `kind` has anything to send to: without
    /// endpoints the listener is closed so clients are refused at once.
    pub fn can_serve(&self, kind: Kind) -> bool {
        let p = self.pools();
        match kind {
            Kind::Cluster => !p.pool(kind, IpAddr::from([0, 0, 0, 0])).backends.is_empty(),
            // Local policy keeps the listener while cluster endpoints exist:
            // in-cluster clients may still use them (short-circuit).
            Kind::External => !p.cluster.backends.is_empty() || !p.local.backends.is_empty(),
        }
    }

    /// (has a Local internal policy without local endpoints, same for external).
    pub fn missing_local(&self) -> (bool, bool) {
        self.pools().no_local
    }

    /// Picks an endpoint for a new connection or flow from `client`,
    /// skipping `tried` (endpoints that already refused this connection).
    /// Affinity wins while its endpoint is still in the pool.
    pub fn choose(&self, kind: Kind, client: IpAddr, tried: &[SocketAddr]) -> Option<Arc<Backend>> {
        let pools = self.pools();
        let pool = pools.pool(kind, client);
        if tried.is_empty() {
            let mut aff = lock(&self.affinity);
            if let Some(t) = aff.as_mut() {
                if let Some(ep) = t.lookup(client, Instant::now()) {
                    if let Some(b) = pool.backends.iter().find(|b| b.addr == ep) {
                        return Some(b.clone());
                    }
                }
            }
        }
        let cursor = pool.cursor.fetch_add(1, Ordering::Relaxed);
        let i = pick(
            pool.backends.len(),
            cursor,
            self.shared.algorithm,
            |i| pool.backends[i].active.load(Ordering::Relaxed),
            |i| tried.contains(&pool.backends[i].addr),
        )?;
        Some(pool.backends[i].clone())
    }

    /// A connection from `client` went to `ep`: keep it there (affinity).
    pub fn record(&self, client: IpAddr, ep: SocketAddr) {
        if let Some(t) = lock(&self.affinity).as_mut() {
            t.record(client, ep, Instant::now());
        }
    }

    pub fn error(&self) {
        self.shared.metrics.error(&self.label);
    }

    /// Applies a new version of the Service and its endpoints. Endpoints
    /// that stay keep their connections; removed ones get no new traffic and
    /// their connections are closed after the grace period.
    pub fn update(
        self: &Arc<Self>,
        sp: &ServicePort,
        endpoints: &[Endpoint],
        node: &NodeInfo,
        inside: Arc<Inside>,
        rt: &tokio::runtime::Handle,
    ) {
        let sel = EndpointSelection::new(sp, endpoints, node);
        let mut reg = lock(&self.registry);
        let mut get = |e: &Endpoint| -> Arc<Backend> {
            let addr = e.socket_addr();
            let b = reg
                .entry(addr)
                .or_insert_with(|| Backend::new(addr))
                .clone();
            if b.removed.swap(false, Ordering::AcqRel) {
                // Back before its grace period ran out: cancel the kill.
                b.generation.fetch_add(1, Ordering::AcqRel);
            }
            b
        };
        let cluster: Vec<Arc<Backend>> = sel.cluster.iter().map(|e| get(e)).collect();
        let local: Vec<Arc<Backend>> = sel.local.iter().map(|e| get(e)).collect();
        let keep: Vec<SocketAddr> = sel.all_reachable.iter().map(|e| e.socket_addr()).collect();
        let mut gone = Vec::new();
        for (addr, b) in reg.iter() {
            if !keep.contains(addr) && !b.removed.swap(true, Ordering::AcqRel) {
                let g = b.generation.fetch_add(1, Ordering::AcqRel) + 1;
                gone.push((b.clone(), g));
            }
        }
        drop(reg);
        {
            let mut aff = lock(&self.affinity);
            let want = sp
                .session_affinity_timeout
                .map(|s| Duration::from_secs(u64::from(s)));
            match (aff.as_ref().map(|t| t.timeout()), want) {
                (_, None) => *aff = None,
                (Some(t), Some(w)) if t == w => {}
                (_, Some(w)) => *aff = Some(AffinityTable::new(w)),
            }
            if let Some(t) = aff.as_mut() {
                for (b, _) in &gone {
                    t.forget_endpoint(b.addr);
                }
            }
        }
        let pools = Pools {
            cluster: Pool::new(cluster),
            local: Pool::new(local),
            internal_local: sel.internal.is_local(),
            external_local: sel.external.is_local(),
            no_local: sel.no_local(),
            inside,
        };
        *self.pools.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(pools);
        for (b, g) in gone {
            self.schedule_kill(b, g, rt);
        }
    }

    /// The Service went away: every endpoint is removed.
    pub fn retire(self: &Arc<Self>, rt: &tokio::runtime::Handle) {
        *self.pools.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(Pools::default());
        let reg = lock(&self.registry);
        let gone: Vec<(Arc<Backend>, u64)> = reg
            .values()
            .filter(|b| !b.removed.swap(true, Ordering::AcqRel))
            .map(|b| (b.clone(), b.generation.fetch_add(1, Ordering::AcqRel) + 1))
            .collect();
        drop(reg);
        for (b, g) in gone {
            self.schedule_kill(b, g, rt);
        }
    }

    fn schedule_kill(
        self: &Arc<Self>,
        b: Arc<Backend>,
        generation: u64,
        rt: &tokio::runtime::Handle,
    ) {
        let svc = self.clone();
        let grace = self.shared.grace_period;
        rt.spawn(async move {
            tokio::time::sleep(grace).await;
            if b.is_removed() && b.generation.load(Ordering::Acquire) == generation {
                let open = b.active.load(Ordering::Relaxed);
                if open > 0 {
                    tracing::info!(service = %svc.label, endpoint = %b.addr, open,
                        "closing connections to a removed endpoint after the grace period");
                }
                b.kill.send_replace(true);
                let mut reg = lock(&svc.registry);
                if reg.get(&b.addr).is_some_and(|x| Arc::ptr_eq(x, &b)) {
                    reg.remove(&b.addr);
                }
            }
        });
    }
}
