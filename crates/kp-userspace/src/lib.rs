//! The userspace proxy mode: an L4 proxy in this process instead of kernel
//! NAT rules. Every Service address and port (ClusterIP, NodePort,
//! externalIP, LoadBalancer IP) gets a listening socket; connections and
//! datagrams are forwarded to an endpoint picked with the model's rules
//! (EndpointSelection: traffic policies, terminating fallback, topology),
//! round robin or least connections, with ClientIP affinity.
//!
//! With CAP_NET_ADMIN the Service IPs are added to the loopback interface
//! (marked as ours, see [`netlink`]) so the proxy can bind them; without it
//! only NodePorts and Service IPs that are already local are served.
//! docs/userspace.md describes the mode.

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod balancer;
pub mod flows;
pub mod netlink;
pub mod plan;
mod service;
mod sys;
mod tcp;
mod udp;

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::os::fd::OwnedFd;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use kp_model::{
    Dataplane, DataplaneError, IpFamily, Known, LocalDetector, Protocol, ProxierConfig, ProxyState,
    ServicePortName, Start, SyncReport,
};

pub use balancer::Algorithm;
use plan::{ListenKey, ListenSpec, PlanCtx, PlanIndex, PlanOpts};
use service::{Inside, ServiceRt, Shared};
pub use sys::has_net_admin;

/// Which way proxied bytes went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Client to endpoint.
    In,
    /// Endpoint to client.
    Out,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::In => "in",
            Direction::Out => "out",
        }
    }
}

/// Where per-Service figures go (the binary's Prometheus registry).
/// `service` is "namespace/name:port".
pub trait MetricsSink: Send + Sync + 'static {
    fn connection_opened(&self, service: &str);
    fn connection_closed(&self, service: &str);
    fn bytes(&self, service: &str, direction: Direction, n: u64);
    fn error(&self, service: &str);
    /// The Service port is gone and none of its connections is left: its
    /// series can go (a Service churned away must not leave series behind).
    fn service_gone(&self, service: &str);
}

/// Discards everything (tests, benchmarks).
pub struct NoMetrics;

impl MetricsSink for NoMetrics {
    fn connection_opened(&self, _: &str) {}
    fn connection_closed(&self, _: &str) {}
    fn bytes(&self, _: &str, _: Direction, _: u64) {}
    fn error(&self, _: &str) {}
    fn service_gone(&self, _: &str) {}
}

/// How Service IPs become addresses the proxy can listen on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VipMode {
    /// Add them to lo (needs CAP_NET_ADMIN).
    Loopback,
    /// Leave addresses alone: NodePorts, and Service IPs that are already
    /// local addresses.
    None,
}

/// Settings of one family's userspace proxier.
#[derive(Clone, Debug)]
pub struct UserspaceConfig {
    pub family: IpFamily,
    pub algorithm: Algorithm,
    pub vip_mode: VipMode,
    /// --nodeport-addresses of this family; empty: every non-loopback address.
    pub nodeport_addresses: Vec<IpNet>,
    /// Pod CIDRs (the local-traffic detector): with externalTrafficPolicy
    /// Local, their traffic to external addresses still uses every endpoint.
    pub cluster_cidrs: Vec<IpNet>,
    /// Per endpoint; the next endpoint is tried after it.
    pub connect_timeout: Duration,
    /// A TCP connection with no byte either way for this long is closed; zero: never.
    pub tcp_idle_timeout: Duration,
    /// A UDP flow with no datagram either way for this long is forgotten.
    pub udp_idle_timeout: Duration,
    /// Connections to a removed endpoint are closed this long after its removal.
    pub grace_period: Duration,
    /// Copy TCP with splice(2) (Linux); false copies through a buffer.
    pub splice: bool,
    /// Pipe size asked for splice.
    pub pipe_size: usize,
}

impl UserspaceConfig {
    pub fn new(family: IpFamily) -> Self {
        UserspaceConfig {
            family,
            algorithm: Algorithm::RoundRobin,
            vip_mode: VipMode::None,
            nodeport_addresses: Vec::new(),
            cluster_cidrs: Vec::new(),
            connect_timeout: Duration::from_secs(1),
            tcp_idle_timeout: Duration::from_secs(3600),
            udp_idle_timeout: Duration::from_secs(30),
            grace_period: Duration::from_secs(30),
            splice: cfg!(target_os = "linux"),
            pipe_size: 1 << 20,
        }
    }

    /// The parts of the shared dataplane settings this mode uses.
    pub fn from_proxier_config(pc: &ProxierConfig) -> Self {
        let mut c = UserspaceConfig::new(pc.family);
        c.nodeport_addresses = pc.nodeport_addresses.clone();
        if let LocalDetector::Cidrs(cidrs) = &pc.local_detector {
            c.cluster_cidrs = cidrs.clone();
        }
        c
    }
}

/// The proxy's own async runtime, shared by both families' proxiers.
pub fn runtime() -> Result<tokio::runtime::Handle, DataplaneError> {
    static RT: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    let rt = RT.get_or_init(|| {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .clamp(2, 8);
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("kp-userspace")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    });
    match rt {
        Ok(rt) => Ok(rt.handle().clone()),
        Err(e) => Err(DataplaneError::Unsupported(format!(
            "starting the userspace proxy runtime: {e}"
        ))),
    }
}

struct Listener {
    spec: ListenSpec,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Dropping the task drops the socket: the port stops accepting. Open
        // connections are tasks of their own and carry on.
        self.task.abort();
    }
}

/// A Service port we serve, and its share of `SyncReport::no_local_endpoints`
/// (kept so a sync need not ask every Service again).
struct Svc {
    rt: Arc<ServiceRt>,
    missing: (bool, bool),
}

/// One IP family's userspace proxy.
///
/// A full sync (the first, one the sync loop asks for, or one after a
/// failure) re-reads this node's addresses and our Service IPs on lo and
/// recomputes everything; a partial sync touches only the changed service
/// ports through a [`PlanIndex`], so it costs O(the change), not O(all
/// Services). The node's addresses come from the kernel's address
/// notifications: one that comes or goes makes the next sync a full one.
pub struct UserspaceProxier {
    cfg: UserspaceConfig,
    shared: Arc<Shared>,
    rt: tokio::runtime::Handle,
    services: HashMap<ServicePortName, Svc>,
    /// Sum of the `missing` of `services`.
    missing: (u64, u64),
    listeners: HashMap<ListenKey, Listener>,
    /// Service IPs of this family we hold on lo.
    vips: BTreeSet<IpAddr>,
    rtnl: Option<netlink::Rtnl>,
    /// What listeners and Service IPs `services` ask for; nothing known
    /// until a full sync built it (and after cleanup or a failed sync).
    index: Known<PlanIndex>,
    inside: Arc<Inside>,
    /// Listeners that failed to open and Service IPs that could not be added
    /// or removed: looked at again on every sync, whatever changed.
    retry_keys: BTreeSet<ListenKey>,
    retry_vips: BTreeSet<IpAddr>,
    /// The kernel's address notifications (None if they cannot be had:
    /// then every sync compares the node's addresses and `rules_lost`
    /// lists ours, as a full sync does).
    watch: Option<netlink::AddrWatch>,
    /// Notifications read but not yet looked at (read during a burst of our
    /// own address changes, so the socket's queue cannot overflow).
    pending: netlink::AddrEvents,
    /// Since the last full sync: a node address came or went (or
    /// notifications were lost): the next sync is a full one.
    addrs_changed: bool,
    /// One of our Service IPs was removed by someone else.
    vip_lost: bool,
    /// Notifications were lost since the last full sync: `rules_lost`
    /// lists our addresses instead of trusting them.
    watch_unsure: bool,
}

fn io_err(what: impl Into<String>, source: std::io::Error) -> DataplaneError {
    DataplaneError::Io {
        what: what.into(),
        source,
    }
}

impl UserspaceProxier {
    pub fn new(
        cfg: UserspaceConfig,
        metrics: Arc<dyn MetricsSink>,
        rt: tokio::runtime::Handle,
    ) -> Result<Self, DataplaneError> {
        let rtnl = match cfg.vip_mode {
            VipMode::Loopback => {
                Some(netlink::Rtnl::open().map_err(|e| io_err("opening rtnetlink", e))?)
            }
            VipMode::None => None,
        };
        let shared = Arc::new(Shared {
            algorithm: cfg.algorithm,
            connect_timeout: cfg.connect_timeout,
            tcp_idle_timeout: cfg.tcp_idle_timeout,
            udp_idle_timeout: cfg.udp_idle_timeout,
            grace_period: cfg.grace_period,
            splice: cfg.splice,
            pipe_size: cfg.pipe_size,
            metrics,
            live: Default::default(),
        });
        let inside = Arc::new(Inside::new(cfg.cluster_cidrs.clone()));
        let watch = match netlink::AddrWatch::open(cfg.family == IpFamily::V6) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "no address notifications; every sync re-reads the node's addresses");
                None
            }
        };
        Ok(UserspaceProxier {
            cfg,
            shared,
            rt,
            services: HashMap::new(),
            missing: (0, 0),
            listeners: HashMap::new(),
            vips: BTreeSet::new(),
            rtnl,
            index: Known::default(),
            inside,
            retry_keys: BTreeSet::new(),
            retry_vips: BTreeSet::new(),
            watch,
            pending: netlink::AddrEvents::default(),
            addrs_changed: false,
            vip_lost: false,
            watch_unsure: false,
        })
    }

    /// The address/protocol pairs listening now (tests, logs).
    pub fn listening(&self) -> Vec<(std::net::SocketAddr, Protocol)> {
        let mut v: Vec<_> = self
            .listeners
            .keys()
            .map(|k| (k.addr, k.protocol))
            .collect();
        v.sort();
        v
    }

    fn local_addresses(&self) -> Vec<(IpAddr, bool)> {
        sys::local_addresses()
            .into_iter()
            .filter(|(ip, _)| self.cfg.family.matches(ip))
            .collect()
    }

    /// Reads the address notifications queued since the last call: a node
    /// address that came or went asks for a full sync, one of our Service
    /// IPs removed by someone else is remembered for `rules_lost`.
    fn poll_addrs(&mut self) {
        // What the last full sync planned with (None: the next sync is a
        // full one anyway).
        let Some(index) = self.index.get() else {
            return;
        };
        let Some(w) = self.watch.as_mut() else {
            let now: std::collections::HashSet<IpAddr> = self
                .local_addresses()
                .into_iter()
                .map(|(ip, _)| ip)
                .filter(|ip| !self.vips.contains(ip))
                .collect();
            if &now != index.foreign() {
                self.addrs_changed = true;
            }
            return;
        };
        let mut got = std::mem::take(&mut self.pending);
        got.append(w.drain());
        if got.overflowed {
            self.addrs_changed = true;
            self.watch_unsure = true;
        }
        // Ours: only the last word on each address counts (we may have
        // removed and added one again since the last read).
        let mut ours: HashMap<IpAddr, bool> = HashMap::new();
        for e in got.events {
            if !self.cfg.family.matches(&e.ip) {
                continue;
            }
            if e.ours {
                // Only removals can mean a loss; an addition matters only
                // after one (a first sync announces thousands of them).
                if !e.added {
                    ours.insert(e.ip, false);
                } else if let Some(last) = ours.get_mut(&e.ip) {
                    *last = true;
                }
            } else if e.added != index.is_foreign(&e.ip) {
                self.addrs_changed = true;
            }
        }
        if ours
            .iter()
            .any(|(ip, added)| !added && self.vips.contains(ip))
        {
            self.vip_lost = true;
        }
    }

    fn plan_opts(&self) -> PlanOpts {
        PlanOpts {
            take_over_vips: self.cfg.vip_mode == VipMode::Loopback,
            nodeport_addresses: self.cfg.nodeport_addresses.clone(),
        }
    }

    fn ours_on_lo(&self, rtnl: &mut netlink::Rtnl) -> Result<Vec<IpAddr>, DataplaneError> {
        let fam = self.cfg.family;
        Ok(rtnl
            .list_ours()
            .map_err(|e| io_err("listing our addresses on lo", e))?
            .into_iter()
            .filter(|ip| fam.matches(ip))
            .collect())
    }

    fn open(
        &self,
        key: &ListenKey,
        spec: &ListenSpec,
        svc: &Arc<ServiceRt>,
    ) -> std::io::Result<Listener> {
        let freebind = self.vips.contains(&key.addr.ip());
        let ctx = Arc::new(tcp::ListenCtx {
            kind: spec.kind,
            source_ranges: spec.source_ranges.clone(),
        });
        let _enter = self.rt.enter();
        let task = match key.protocol {
            Protocol::Tcp => {
                let fd: OwnedFd = sys::bind_socket(&key.addr, true, freebind)?;
                let l = tokio::net::TcpListener::from_std(std::net::TcpListener::from(fd))?;
                self.rt.spawn(tcp::serve(l, svc.clone(), ctx))
            }
            Protocol::Udp => {
                let fd: OwnedFd = sys::bind_socket(&key.addr, false, freebind)?;
                let s = tokio::net::UdpSocket::from_std(std::net::UdpSocket::from(fd))?;
                self.rt.spawn(udp::serve(s, svc.clone(), ctx))
            }
            Protocol::Sctp => {
                return Err(std::io::Error::other(
                    "SCTP is not proxied in userspace mode",
                ))
            }
        };
        Ok(Listener {
            spec: spec.clone(),
            task,
        })
    }

    /// Whether `changed` accounts for every service port added or removed
    /// since the last sync, as the tracker's change sets do (deleted ports
    /// are among the changed names). A caller that did not say falls back
    /// to a full sync instead of leaving a Service behind. O(changed).
    fn covers(&self, state: &ProxyState, changed: &BTreeSet<ServicePortName>) -> bool {
        let mut n = self.services.len();
        for name in changed {
            match (
                self.services.contains_key(name),
                state.services.contains_key(name),
            ) {
                (false, true) => n += 1,
                (true, false) => n -= 1,
                _ => {}
            }
        }
        n == state.services.len()
    }

    /// Applies a new version of one service port (added or changed).
    fn update_service(&mut self, state: &ProxyState, name: &ServicePortName) {
        let Some(sp) = state.services.get(name) else {
            return;
        };
        let svc = self.services.entry(name.clone()).or_insert_with(|| Svc {
            rt: ServiceRt::new(name.clone(), self.shared.clone()),
            missing: (false, false),
        });
        svc.rt.update(
            sp,
            state.endpoints_of(name),
            &state.node,
            self.inside.clone(),
            &self.rt,
        );
        let (i, e) = svc.rt.missing_local();
        let (oi, oe) = std::mem::replace(&mut svc.missing, (i, e));
        self.missing.0 = (self.missing.0 + u64::from(i)).saturating_sub(u64::from(oi));
        self.missing.1 = (self.missing.1 + u64::from(e)).saturating_sub(u64::from(oe));
    }

    fn retire_service(&mut self, name: &ServicePortName) -> bool {
        let Some(svc) = self.services.remove(name) else {
            return false;
        };
        svc.rt.retire(&self.rt);
        self.missing.0 = self.missing.0.saturating_sub(u64::from(svc.missing.0));
        self.missing.1 = self.missing.1.saturating_sub(u64::from(svc.missing.1));
        true
    }

    /// Everything again: our addresses on lo and the node's addresses
    /// re-read, every Service updated, the index rebuilt. Returns every
    /// listen key and Service IP to reconcile.
    fn prepare_full(
        &mut self,
        state: &ProxyState,
        report: &mut SyncReport,
    ) -> Result<(BTreeSet<ListenKey>, BTreeSet<IpAddr>), DataplaneError> {
        // What was announced before the re-read below is in it.
        if let Some(w) = self.watch.as_mut() {
            let _ = w.drain();
            self.pending = netlink::AddrEvents::default();
        }
        if let Some(mut rtnl) = self.rtnl.take() {
            // First sync: addresses left by a previous run are adopted (kept
            // while still wanted). Full syncs re-read what the kernel has,
            // so an address someone removed is added back.
            let r = self.ours_on_lo(&mut rtnl);
            self.rtnl = Some(rtnl);
            self.vips = r?.into_iter().collect();
        }
        let local = self.local_addresses();
        self.inside.set_addrs(local.iter().map(|(ip, _)| *ip));
        self.addrs_changed = false;
        self.vip_lost = false;
        self.watch_unsure = false;

        // Services and their endpoints.
        for name in state.services.keys() {
            self.update_service(state, name);
            report.ops += 1;
        }
        let gone: Vec<ServicePortName> = self
            .services
            .keys()
            .filter(|n| !state.services.contains_key(*n))
            .cloned()
            .collect();
        for n in gone {
            if self.retire_service(&n) {
                report.ops += 1;
            }
        }
        // Recounted from scratch, so a full sync never carries a drift on.
        self.missing = (0, 0);
        for svc in self.services.values() {
            self.missing.0 += u64::from(svc.missing.0);
            self.missing.1 += u64::from(svc.missing.1);
        }

        // Our own VIPs among the local addresses are not node addresses.
        // Partial syncs reuse this context (see PlanCtx) until the next
        // full sync.
        let ctx = PlanCtx::new(state.family, &self.plan_opts(), &local, &self.vips);
        let index = PlanIndex::build(ctx, state);
        for s in index.skipped() {
            tracing::warn!("userspace: {s}");
        }
        let keys: BTreeSet<ListenKey> = index
            .listeners()
            .map(|(k, _)| *k)
            .chain(self.listeners.keys().copied())
            .chain(self.retry_keys.iter().copied())
            .collect();
        let vips: BTreeSet<IpAddr> = index
            .vips()
            .chain(self.vips.iter())
            .chain(self.retry_vips.iter())
            .copied()
            .collect();
        self.index.done(index);
        Ok((keys, vips))
    }

    /// Only the changed service ports: returns the listen keys and Service
    /// IPs whose wanted state may differ from what is in place.
    fn prepare_partial(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        mut index: PlanIndex,
        report: &mut SyncReport,
    ) -> (BTreeSet<ListenKey>, BTreeSet<IpAddr>) {
        let mut keys = self.retry_keys.clone();
        let mut vips = self.retry_vips.clone();
        // Service ports whose skip messages may have changed.
        let mut warn: BTreeSet<ServicePortName> = BTreeSet::new();
        for name in changed {
            let d = match state.services.get(name) {
                Some(sp) => {
                    self.update_service(state, name);
                    report.ops += 1;
                    let d = index.update(name, sp);
                    // Endpoints appearing or going open or close the
                    // listeners it wins, whether or not its claims changed.
                    if let Some(c) = index.claims_of(name) {
                        keys.extend(c.listeners.iter().map(|(k, _)| *k));
                    }
                    warn.insert(name.clone());
                    d
                }
                None => {
                    if self.retire_service(name) {
                        report.ops += 1;
                    }
                    index.remove(name)
                }
            };
            for k in &d.listeners {
                warn.extend(index.losers(k).cloned());
            }
            keys.extend(d.listeners);
            vips.extend(d.vips_added);
            vips.extend(d.vips_removed);
        }
        for name in &warn {
            for s in index.skipped_of(name) {
                tracing::warn!("userspace: {s}");
            }
        }
        self.index.done(index);
        (keys, vips)
    }

    /// Service IPs on lo: each of `check` added or removed as the index
    /// wants.
    fn apply_vips(&mut self, check: BTreeSet<IpAddr>, report: &mut SyncReport) {
        let (Some(rtnl), Some(index)) = (self.rtnl.as_mut(), self.index.get()) else {
            return;
        };
        let (mut add, mut del) = (Vec::new(), Vec::new());
        for ip in check {
            match (index.has_vip(&ip), self.vips.contains(&ip)) {
                (true, false) => add.push(ip),
                (false, true) => del.push(ip),
                _ => {
                    self.retry_vips.remove(&ip);
                }
            }
        }
        // Each change is announced to our own watch too: read them every
        // so often, so a burst (a first sync adding thousands) cannot
        // overflow its queue; they are looked at after the sync.
        let mut done = 0usize;
        let mut read_announcements =
            |watch: &mut Option<netlink::AddrWatch>, pending: &mut netlink::AddrEvents| {
                done += 1;
                if done.is_multiple_of(512) {
                    if let Some(w) = watch.as_mut() {
                        pending.append(w.drain());
                    }
                }
            };
        // Additions first, then removals (as before the index).
        for ip in add {
            read_announcements(&mut self.watch, &mut self.pending);
            match rtnl.add(&ip) {
                Ok(()) => {
                    self.vips.insert(ip);
                    self.inside.add(ip);
                    self.retry_vips.remove(&ip);
                    report.ops += 1;
                }
                Err(e) => {
                    tracing::warn!(%ip, error = %e, "cannot add a Service IP to lo");
                    self.retry_vips.insert(ip);
                }
            }
        }
        for ip in del {
            read_announcements(&mut self.watch, &mut self.pending);
            match rtnl.del(&ip) {
                Ok(()) => {
                    self.vips.remove(&ip);
                    self.inside.remove(&ip);
                    self.retry_vips.remove(&ip);
                    report.ops += 1;
                }
                Err(e) => {
                    tracing::warn!(%ip, error = %e, "cannot remove a Service IP from lo");
                    self.retry_vips.insert(ip);
                }
            }
        }
    }

    /// Listeners: open where a Service has somewhere to send, closed
    /// otherwise (so clients are refused at once, as the kernel modes do).
    /// Each of `check` is made to match the index.
    fn apply_listeners(&mut self, check: BTreeSet<ListenKey>, report: &mut SyncReport) {
        let Some(index) = self.index.get() else {
            return;
        };
        let mut open: Vec<(ListenKey, ListenSpec, Arc<ServiceRt>)> = Vec::new();
        let mut closed: BTreeSet<ListenKey> = BTreeSet::new();
        // Every close before any open, as a full recomputation does.
        for k in check {
            let want = index.winner(&k).and_then(|spec| {
                let svc = self.services.get(&spec.service)?;
                svc.rt.can_serve(spec.kind).then_some((spec, &svc.rt))
            });
            if let Some(l) = self.listeners.get(&k) {
                if want.is_some_and(|(spec, _)| *spec == l.spec) {
                    self.retry_keys.remove(&k);
                    continue;
                }
                self.listeners.remove(&k);
                closed.insert(k);
                report.ops += 1;
            }
            match want {
                Some((spec, svc)) => open.push((k, spec.clone(), svc.clone())),
                None => {
                    self.retry_keys.remove(&k);
                }
            }
        }
        for (k, spec, svc) in open {
            let r = if closed.contains(&k) {
                self.reopen(&k, &spec, &svc)
            } else {
                self.open(&k, &spec, &svc)
            };
            match r {
                Ok(l) => {
                    self.listeners.insert(k, l);
                    self.retry_keys.remove(&k);
                    report.ops += 1;
                }
                Err(e) => {
                    // Another program holds the port, or the address is not
                    // ours: the rest of the Services still work; retried on
                    // the next sync.
                    tracing::warn!(service = %svc.label, addr = %k.addr, protocol = %k.protocol, error = %e, "cannot listen");
                    svc.error();
                    self.retry_keys.insert(k);
                }
            }
        }
    }

    /// Opens `key` again for another service port or spec, right after
    /// closing its listener: the old socket is released by its task as the
    /// runtime gets to the abort (and, for UDP, by the flows it ends), so a
    /// bind that finds the port still in use is tried again for a moment
    /// instead of waiting for the next sync.
    fn reopen(
        &self,
        key: &ListenKey,
        spec: &ListenSpec,
        svc: &Arc<ServiceRt>,
    ) -> std::io::Result<Listener> {
        let deadline = Instant::now() + Duration::from_millis(200);
        loop {
            match self.open(key, spec, svc) {
                Err(e)
                    if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(2));
                }
                r => return r,
            }
        }
    }
}

impl Dataplane for UserspaceProxier {
    fn mode(&self) -> kp_model::ProxyMode {
        kp_model::ProxyMode::Userspace
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        let t0 = Instant::now();
        self.poll_addrs();
        let start = self
            .index
            .begin(full || self.addrs_changed || !self.covers(state, changed));
        let mut report = SyncReport {
            full: start.is_full(),
            ..Default::default()
        };
        let (keys, vips) = match start {
            Start::Full { .. } => self.prepare_full(state, &mut report)?,
            Start::Partial { prev } => self.prepare_partial(state, changed, prev, &mut report),
        };
        report.no_local_endpoints = self.missing;
        report.render = t0.elapsed();
        let t1 = Instant::now();
        self.apply_vips(vips, &mut report);
        self.apply_listeners(keys, &mut report);
        // Our own address changes were announced too: read them now, while
        // the queue has room.
        if let Some(w) = self.watch.as_mut() {
            self.pending.append(w.drain());
        }
        report.apply = t1.elapsed();
        Ok(report)
    }

    /// One of our Service IPs vanished from lo (someone ran `ip addr del`
    /// or flushed lo): the sync loop counts it and runs a full sync, which
    /// re-reads the addresses and adds the missing ones back. Known from
    /// the kernel's address notifications; a dump of the addresses only when
    /// those were lost or cannot be had. Listeners cannot be taken from us.
    fn rules_lost(&mut self) -> bool {
        self.poll_addrs();
        if self.vips.is_empty() {
            return false;
        }
        if self.watch.is_some() && !self.watch_unsure {
            return std::mem::take(&mut self.vip_lost);
        }
        let Some(mut rtnl) = self.rtnl.take() else {
            return false;
        };
        let have = self.ours_on_lo(&mut rtnl);
        self.rtnl = Some(rtnl);
        match have {
            Ok(have) => self.vips.iter().any(|ip| !have.contains(ip)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot check our Service IPs on lo");
                false
            }
        }
    }

    fn render(&self, state: &ProxyState) -> String {
        let local = self.local_addresses();
        let plan = plan::plan(state, &self.plan_opts(), &local, &self.vips);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# kube-proxy-rs userspace mode ({}), balancer {}",
            self.cfg.family, self.cfg.algorithm
        );
        for ip in &plan.vips {
            let _ = writeln!(out, "address {ip} dev lo");
        }
        for (k, spec) in &plan.listeners {
            let sp = state.services.get(&spec.service);
            let eps = state.endpoints_of(&spec.service);
            let sel = sp.map(|sp| kp_model::EndpointSelection::new(sp, eps, &state.node));
            let addrs = |eps: &[&kp_model::Endpoint]| -> Vec<String> {
                eps.iter().map(|e| e.addr_string()).collect()
            };
            let cluster = sel.as_ref().map(|s| addrs(&s.cluster)).unwrap_or_default();
            let kind = match spec.kind {
                plan::Kind::Cluster => "cluster",
                plan::Kind::External => "external",
            };
            let _ = write!(
                out,
                "listen {} {} service {} {kind} endpoints [{}]",
                k.protocol.as_lower(),
                k.addr,
                spec.service,
                cluster.join(" ")
            );
            if let Some(s) = sel.filter(|s| s.internal.is_local() || s.external.is_local()) {
                let _ = write!(out, " local [{}]", addrs(&s.local).join(" "));
            }
            if !spec.source_ranges.is_empty() {
                let r: Vec<String> = spec.source_ranges.iter().map(|n| n.to_string()).collect();
                let _ = write!(out, " from [{}]", r.join(" "));
            }
            out.push('\n');
        }
        for s in &plan.skipped {
            let _ = writeln!(out, "# skipped: {s}");
        }
        out
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        self.listeners.clear();
        // Whatever comes next starts from a full sync.
        self.index.forget();
        self.retry_keys.clear();
        self.retry_vips.clear();
        let mut rtnl = match self.rtnl.take() {
            Some(r) => r,
            None => netlink::Rtnl::open().map_err(|e| io_err("opening rtnetlink", e))?,
        };
        let ours = self.ours_on_lo(&mut rtnl)?;
        for ip in &ours {
            rtnl.del(ip)
                .map_err(|e| io_err(format!("removing {ip} from lo"), e))?;
        }
        if !ours.is_empty() {
            tracing::info!(family = %self.cfg.family, removed = ours.len(), "removed our Service IPs from lo");
        }
        self.vips.clear();
        self.rtnl = Some(rtnl);
        Ok(())
    }
}
