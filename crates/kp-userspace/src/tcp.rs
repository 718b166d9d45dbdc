//! TCP: accept, pick an endpoint (retrying the next one when one refuses or
//! times out), then copy both ways with half-close, splice(2) on Linux, an
//! idle timeout and the removed-endpoint kill switch.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};

use crate::plan::Kind;
use crate::service::ServiceRt;
use crate::sys;
use crate::Direction;

/// What a listener serves.
#[derive(Clone, Debug)]
pub(crate) struct ListenCtx {
    pub kind: Kind,
    pub source_ranges: Vec<ipnet::IpNet>,
}

impl ListenCtx {
    pub fn allows(&self, ip: std::net::IpAddr) -> bool {
        self.source_ranges.is_empty() || self.source_ranges.iter().any(|r| r.contains(&ip))
    }
}

/// Milliseconds since the first call: a cheap shared "last activity" clock.
pub(crate) fn now_ms() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_millis() as u64
}

pub(crate) async fn serve(listener: TcpListener, svc: Arc<ServiceRt>, ctx: Arc<ListenCtx>) {
    // A failed accept (out of file descriptors, typically) comes back every
    // 50 ms while its cause lasts, and an accept storm alternates successes
    // and failures: every one is counted, but the log gets one warning a
    // minute with the number left unsaid.
    let mut warned: Option<Instant> = None;
    let mut unsaid: u64 = 0;
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                tokio::spawn(handle(stream, peer, svc.clone(), ctx.clone()));
            }
            Err(e) => {
                svc.error();
                if warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!(service = %svc.label, error = %e, since_last_warning = unsaid,
                        "accept failed; retrying every 50 ms");
                    warned = Some(Instant::now());
                    unsaid = 0;
                } else {
                    unsaid += 1;
                }
                // Back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn reset(s: TcpStream) {
    sys::set_linger_zero(s.as_raw_fd());
    drop(s);
}

async fn handle(client: TcpStream, peer: SocketAddr, svc: Arc<ServiceRt>, ctx: Arc<ListenCtx>) {
    if !ctx.allows(peer.ip()) {
        // loadBalancerSourceRanges: the kernel modes drop; once a socket has
        // accepted, the closest is a reset.
        tracing::debug!(service = %svc.label, %peer, "source outside loadBalancerSourceRanges");
        reset(client);
        return;
    }
    let _ = client.set_nodelay(true);
    let mut tried: Vec<SocketAddr> = Vec::new();
    let (backend, upstream) = loop {
        let Some(b) = svc.choose(ctx.kind, peer.ip(), &tried) else {
            if tried.is_empty() {
                // No endpoint for this client (e.g. eTP Local, none here).
                svc.error();
            }
            reset(client);
            return;
        };
        match tokio::time::timeout(svc.shared.connect_timeout, TcpStream::connect(b.addr)).await {
            Ok(Ok(s)) => break (b, s),
            Ok(Err(e)) => {
                tracing::debug!(service = %svc.label, endpoint = %b.addr, error = %e, "endpoint refused; trying the next one");
                svc.error();
            }
            Err(_) => {
                tracing::debug!(service = %svc.label, endpoint = %b.addr, "connect timed out; trying the next one");
                svc.error();
            }
        }
        tried.push(b.addr);
    };
    svc.record(peer.ip(), backend.addr);
    let _ = upstream.set_nodelay(true);
    backend.active.fetch_add(1, Ordering::Relaxed);
    let m = &svc.shared.metrics;
    m.connection_opened(&svc.label);
    let mut killed = backend.killed();
    let activity = AtomicU64::new(now_ms());
    let unreported = [AtomicU64::new(0), AtomicU64::new(0)];
    let outcome = {
        let copy_in = copy(
            &client,
            &upstream,
            &svc,
            Direction::In,
            &activity,
            &unreported[0],
        );
        let copy_out = copy(
            &upstream,
            &client,
            &svc,
            Direction::Out,
            &activity,
            &unreported[1],
        );
        tokio::select! {
            r = async { tokio::try_join!(copy_in, copy_out) } => match r {
                Ok(_) => "closed",
                Err(e) => {
                    tracing::debug!(service = %svc.label, %peer, error = %e, "connection broke");
                    "error"
                }
            },
            _ = async {
                if killed.wait_for(|k| *k).await.is_err() {
                    std::future::pending::<()>().await;
                }
            } => "endpoint removed",
            _ = idle(&activity, svc.shared.tcp_idle_timeout) => "idle",
        }
    };
    if outcome != "closed" {
        if outcome == "error" {
            svc.error();
        }
        // Both ends learn at once that the connection is gone.
        sys::set_linger_zero(client.as_raw_fd());
        sys::set_linger_zero(upstream.as_raw_fd());
    }
    for (dir, u) in [Direction::In, Direction::Out].into_iter().zip(&unreported) {
        let n = u.swap(0, Ordering::Relaxed);
        if n > 0 {
            m.bytes(&svc.label, dir, n);
        }
    }
    backend.active.fetch_sub(1, Ordering::Relaxed);
    m.connection_closed(&svc.label);
}

async fn idle(activity: &AtomicU64, timeout: Duration) {
    if timeout.is_zero() {
        return std::future::pending().await;
    }
    let t = timeout.as_millis() as u64;
    loop {
        let deadline = activity.load(Ordering::Relaxed).saturating_add(t);
        let now = now_ms();
        if now >= deadline {
            return;
        }
        tokio::time::sleep(Duration::from_millis(deadline - now)).await;
    }
}

/// Bytes are reported to the metrics sink in batches of this much (and at
/// the end), so a long transfer shows up while it runs.
const REPORT_EVERY: u64 = 4 << 20;

fn account(
    svc: &ServiceRt,
    dir: Direction,
    activity: &AtomicU64,
    unreported: &AtomicU64,
    n: usize,
) {
    activity.store(now_ms(), Ordering::Relaxed);
    let total = unreported.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
    if total >= REPORT_EVERY {
        let n = unreported.swap(0, Ordering::Relaxed);
        svc.shared.metrics.bytes(&svc.label, dir, n);
    }
}

/// A connection moves this much through a buffer before splice takes over:
/// request/response traffic never pays for the pipes, bulk transfers do
/// after their first chunk.
const SPLICE_AFTER: u64 = 64 * 1024;

/// Copies `src` to `dst` until EOF, then half-closes `dst`.
async fn copy(
    src: &TcpStream,
    dst: &TcpStream,
    svc: &ServiceRt,
    dir: Direction,
    activity: &AtomicU64,
    unreported: &AtomicU64,
) -> io::Result<()> {
    let mut buf = vec![0u8; 16 * 1024];
    let mut moved = 0u64;
    loop {
        #[cfg(target_os = "linux")]
        if svc.shared.splice && moved >= SPLICE_AFTER {
            match sys::Pipe::new(svc.shared.pipe_size) {
                Ok(pipe) => {
                    drop(buf);
                    return copy_splice(src, dst, &pipe, svc, dir, activity, unreported).await;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "no pipe for splice; copying through a buffer");
                    moved = 0;
                }
            }
        }
        src.readable().await?;
        let n = match src.try_read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            sys::shutdown_write(dst.as_raw_fd());
            return Ok(());
        }
        let mut off = 0;
        while off < n {
            dst.writable().await?;
            match dst.try_write(&buf[off..n]) {
                Ok(m) => off += m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        moved += n as u64;
        account(svc, dir, activity, unreported, n);
        if !svc.shared.splice && buf.len() < 64 * 1024 && moved >= SPLICE_AFTER {
            // Bulk without splice: a bigger buffer, fewer system calls.
            buf.resize(64 * 1024, 0);
        }
    }
}

/// socket -> pipe -> socket with splice(2): the bytes never enter userspace.
/// The pipe is always drained before it is refilled, so EAGAIN from the
/// first splice means "socket empty" and from the second "socket full".
#[cfg(target_os = "linux")]
async fn copy_splice(
    src: &TcpStream,
    dst: &TcpStream,
    pipe: &sys::Pipe,
    svc: &ServiceRt,
    dir: Direction,
    activity: &AtomicU64,
    unreported: &AtomicU64,
) -> io::Result<()> {
    let (sfd, dfd) = (src.as_raw_fd(), dst.as_raw_fd());
    let (pr, pw) = (pipe.r.as_raw_fd(), pipe.w.as_raw_fd());
    loop {
        let n = loop {
            src.readable().await?;
            match src.try_io(Interest::READABLE, || sys::splice(sfd, pw, pipe.capacity)) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        };
        if n == 0 {
            sys::shutdown_write(dfd);
            return Ok(());
        }
        let mut left = n;
        while left > 0 {
            dst.writable().await?;
            match dst.try_io(Interest::WRITABLE, || sys::splice(pr, dfd, left)) {
                Ok(m) => left -= m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        account(svc, dir, activity, unreported, n);
    }
}
