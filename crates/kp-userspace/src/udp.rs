//! UDP: one listening socket per Service address and port, a flow per
//! client address (its own connected socket towards the endpoint, so replies
//! find their way back), idle expiry, and flows that move when their endpoint
//! goes away or stops answering.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tokio::task::AbortHandle;

use crate::flows::{FlowTable, Lookup};
use crate::service::{Backend, ServiceRt};
use crate::tcp::ListenCtx;
use crate::Direction;

struct FlowIo {
    backend: Arc<Backend>,
    upstream: UdpSocket,
    /// The endpoint answered with an ICMP error: the next datagram picks again.
    dead: AtomicBool,
}

#[derive(Clone)]
struct FlowRef {
    io: Arc<FlowIo>,
    abort: AbortHandle,
}

type Table = Arc<Mutex<FlowTable<FlowRef>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Ends every flow when the listener stops (its task is aborted).
struct DrainOnDrop(Table);

impl Drop for DrainOnDrop {
    fn drop(&mut self) {
        for f in lock(&self.0).drain() {
            f.abort.abort();
        }
    }
}

/// Counts a flow as an open connection while its reply task lives.
struct FlowGuard {
    svc: Arc<ServiceRt>,
    backend: Arc<Backend>,
}

impl Drop for FlowGuard {
    fn drop(&mut self) {
        self.backend.active.fetch_sub(1, Ordering::Relaxed);
        self.svc.shared.metrics.connection_closed(&self.svc.label);
    }
}

/// UDP flows per Service port at most (each holds a socket: a file
/// descriptor); beyond it the least recently used flow is closed.
pub const MAX_FLOWS: usize = 4096;

pub(crate) async fn serve(sock: UdpSocket, svc: Arc<ServiceRt>, ctx: Arc<ListenCtx>) {
    let sock = Arc::new(sock);
    let idle = svc.shared.udp_idle_timeout.max(Duration::from_millis(1));
    let table: Table = Arc::new(Mutex::new(FlowTable::new(idle)));
    let _drain = DrainOnDrop(table.clone());
    let mut buf = vec![0u8; 65536];
    let mut sweep =
        tokio::time::interval((idle / 2).clamp(Duration::from_millis(50), Duration::from_secs(5)));
    loop {
        tokio::select! {
            r = sock.recv_from(&mut buf) => match r {
                Ok((n, client)) => {
                    if ctx.allows(client.ip()) {
                        forward(&buf[..n], client, &sock, &svc, &ctx, &table).await;
                    }
                }
                Err(e) => tracing::debug!(service = %svc.label, error = %e, "UDP receive failed"),
            },
            _ = sweep.tick() => {
                let gone = lock(&table).expire(Instant::now());
                for (_, f) in gone {
                    f.abort.abort();
                }
            }
        }
    }
}

fn unspecified(addr: &SocketAddr) -> SocketAddr {
    let ip = if addr.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    SocketAddr::new(ip, 0)
}

fn new_flow(
    client: SocketAddr,
    sock: &Arc<UdpSocket>,
    svc: &Arc<ServiceRt>,
    ctx: &ListenCtx,
    table: &Table,
) -> Option<FlowRef> {
    let backend = svc.choose(ctx.kind, client.ip(), &[])?;
    let up = std::net::UdpSocket::bind(unspecified(&backend.addr))
        .and_then(|s| s.connect(backend.addr).map(|_| s))
        .and_then(|s| s.set_nonblocking(true).map(|_| s))
        .and_then(UdpSocket::from_std);
    let upstream = match up {
        Ok(u) => u,
        Err(e) => {
            tracing::warn!(service = %svc.label, endpoint = %backend.addr, error = %e, "cannot open a UDP flow");
            return None;
        }
    };
    svc.record(client.ip(), backend.addr);
    backend.active.fetch_add(1, Ordering::Relaxed);
    svc.shared.metrics.connection_opened(&svc.label);
    let io = Arc::new(FlowIo {
        backend: backend.clone(),
        upstream,
        dead: AtomicBool::new(false),
    });
    let guard = FlowGuard {
        svc: svc.clone(),
        backend,
    };
    let task = tokio::spawn(replies(
        io.clone(),
        client,
        sock.clone(),
        table.clone(),
        guard,
    ));
    Some(FlowRef {
        io,
        abort: task.abort_handle(),
    })
}

async fn forward(
    data: &[u8],
    client: SocketAddr,
    sock: &Arc<UdpSocket>,
    svc: &Arc<ServiceRt>,
    ctx: &ListenCtx,
    table: &Table,
) {
    let now = Instant::now();
    let found = lock(table).lookup(client, now, |f| {
        !f.io.backend.is_removed() && !f.io.dead.load(Ordering::Relaxed)
    });
    let flow = match found {
        Lookup::Hit(f) => f,
        other => {
            if let Lookup::Stale(old) = other {
                old.abort.abort();
            }
            if let Some(old) = lock(table).make_room(MAX_FLOWS) {
                // Counted as an error of the Service: a table this full is
                // a client spraying source ports, or far too many clients.
                old.abort.abort();
                svc.error();
                tracing::debug!(service = %svc.label, max = MAX_FLOWS, "UDP flow table full; the least recent flow gave way");
            }
            let Some(f) = new_flow(client, sock, svc, ctx, table) else {
                svc.error();
                return;
            };
            if let Some(old) = lock(table).insert(client, f.clone(), now) {
                old.abort.abort();
            }
            f
        }
    };
    match flow.io.upstream.send(data).await {
        Ok(n) => svc
            .shared
            .metrics
            .bytes(&svc.label, Direction::In, n as u64),
        Err(e) => {
            tracing::debug!(service = %svc.label, endpoint = %flow.io.backend.addr, error = %e, "UDP send failed");
            flow.io.dead.store(true, Ordering::Relaxed);
            svc.error();
        }
    }
}

async fn replies(
    io: Arc<FlowIo>,
    client: SocketAddr,
    sock: Arc<UdpSocket>,
    table: Table,
    guard: FlowGuard,
) {
    let mut buf = vec![0u8; 65536];
    loop {
        match io.upstream.recv(&mut buf).await {
            Ok(n) => {
                if let Err(e) = sock.send_to(&buf[..n], client).await {
                    tracing::debug!(%client, error = %e, "UDP reply failed");
                    guard.svc.error();
                    continue;
                }
                lock(&table).touch(client, Instant::now());
                guard
                    .svc
                    .shared
                    .metrics
                    .bytes(&guard.svc.label, Direction::Out, n as u64);
            }
            Err(e) => {
                // ICMP port unreachable and friends: this endpoint does not
                // serve; the client's next datagram picks another one.
                tracing::debug!(service = %guard.svc.label, endpoint = %io.backend.addr, error = %e, "UDP endpoint error");
                guard.svc.error();
                io.dead.store(true, Ordering::Relaxed);
                lock(&table).remove_if(client, |f| Arc::ptr_eq(&f.io, &io));
                return;
            }
        }
    }
}
