//! Echo servers running as threads of the test process, with sockets that
//! live inside a lab namespace.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket,
};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::netns::in_netns;
use crate::sock;
use crate::LabError;

/// How often blocked server loops look at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

/// What an echo server listens on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServeSpec {
    /// TCP ports (bound on 0.0.0.0, and on `[::]` if `bind_v6`).
    pub tcp: Vec<u16>,
    /// UDP ports (bound on 0.0.0.0, and on `[::]` if `bind_v6`).
    pub udp: Vec<u16>,
    /// Also listen on IPv6 (separate `IPV6_V6ONLY` sockets).
    pub bind_v6: bool,
}

impl ServeSpec {
    /// TCP and UDP on the same ports, IPv4 and IPv6.
    pub fn both(ports: &[u16]) -> ServeSpec {
        ServeSpec {
            tcp: ports.to_vec(),
            udp: ports.to_vec(),
            bind_v6: true,
        }
    }

    /// TCP only, IPv4 and IPv6.
    pub fn tcp(ports: &[u16]) -> ServeSpec {
        ServeSpec {
            tcp: ports.to_vec(),
            udp: Vec::new(),
            bind_v6: true,
        }
    }

    /// UDP only, IPv4 and IPv6.
    pub fn udp(ports: &[u16]) -> ServeSpec {
        ServeSpec {
            tcp: Vec::new(),
            udp: ports.to_vec(),
            bind_v6: true,
        }
    }
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    tcp_conns: AtomicUsize,
    udp_requests: AtomicUsize,
    next_conn: AtomicU64,
    /// Clones of open connections, so drop can shut them down and unblock
    /// their handler threads.
    open: Mutex<HashMap<u64, TcpStream>>,
}

/// A running echo server; dropping it closes every socket and stops its threads.
pub struct ServerGuard {
    name: String,
    ns: String,
    shared: Arc<Shared>,
    loops: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ServerGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerGuard")
            .field("name", &self.name)
            .field("ns", &self.ns)
            .field("tcp_connections", &self.connections())
            .field("udp_requests", &self.udp_requests())
            .finish()
    }
}

impl ServerGuard {
    /// Name the server puts in its replies.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Namespace it listens in.
    pub fn ns(&self) -> &str {
        &self.ns
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.tcp_conns.load(Ordering::SeqCst)
    }

    /// UDP datagrams received (and answered) so far.
    pub fn udp_requests(&self) -> usize {
        self.shared.udp_requests.load(Ordering::SeqCst)
    }

    /// Stops the server now (same as dropping it).
    pub fn stop(self) {}
}

impl Drop for ServerGuard {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let open = std::mem::take(&mut *self.shared.open.lock().unwrap_or_else(|p| p.into_inner()));
        for s in open.values() {
            let _ = s.shutdown(Shutdown::Both);
        }
        // Listener/UDP loops notice the flag within STOP_POLL and close their
        // sockets; joining makes the ports free once drop returns.
        for h in self.loops.drain(..) {
            let _ = h.join();
        }
    }
}

fn validate_name(name: &str) -> Result<(), LabError> {
    if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(LabError::InvalidName {
            kind: "server",
            name: name.to_string(),
            why: "must be non-empty without whitespace (it is the first word of every reply)",
        });
    }
    Ok(())
}

fn io_err(what: String) -> impl FnOnce(std::io::Error) -> LabError {
    move |source| LabError::Io { what, source }
}

fn bind_sockets(
    ns: &str,
    spec: &ServeSpec,
) -> Result<(Vec<TcpListener>, Vec<UdpSocket>), LabError> {
    let mut addrs: Vec<IpAddr> = vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)];
    if spec.bind_v6 {
        addrs.push(IpAddr::V6(Ipv6Addr::UNSPECIFIED));
    }
    let mut tcp = Vec::new();
    let mut udp = Vec::new();
    for ip in &addrs {
        for &port in &spec.tcp {
            let addr = SocketAddr::new(*ip, port);
            let what = format!("TCP listener {addr} in {ns}");
            let fd = sock::socket_for(&addr, libc::SOCK_STREAM).map_err(io_err(what.clone()))?;
            sock::set_reuseaddr(&fd).map_err(io_err(what.clone()))?;
            if ip.is_ipv6() {
                sock::set_v6only(&fd).map_err(io_err(what.clone()))?;
            }
            sock::bind(&fd, &addr).map_err(io_err(what.clone()))?;
            sock::listen(&fd).map_err(io_err(what))?;
            tcp.push(TcpListener::from(fd));
        }
        for &port in &spec.udp {
            let addr = SocketAddr::new(*ip, port);
            let what = format!("UDP socket {addr} in {ns}");
            let fd = sock::socket_for(&addr, libc::SOCK_DGRAM).map_err(io_err(what.clone()))?;
            if ip.is_ipv6() {
                sock::set_v6only(&fd).map_err(io_err(what.clone()))?;
            }
            sock::enable_pktinfo(&fd, ip.is_ipv6()).map_err(io_err(what.clone()))?;
            sock::bind(&fd, &addr).map_err(io_err(what.clone()))?;
            let s = UdpSocket::from(fd);
            s.set_read_timeout(Some(STOP_POLL)).map_err(io_err(what))?;
            udp.push(s);
        }
    }
    Ok((tcp, udp))
}

/// Starts an echo server named `name` in namespace `ns`; see [`ServeSpec`]
/// and the crate docs for the reply protocol.
pub fn serve(ns: &str, name: &str, spec: ServeSpec) -> Result<ServerGuard, LabError> {
    validate_name(name)?;
    let (tcp, udp) = in_netns(ns, || bind_sockets(ns, &spec))??;
    let shared = Arc::new(Shared::default());
    let mut loops = Vec::new();
    for l in tcp {
        let (shared, name) = (shared.clone(), name.to_string());
        loops.push(std::thread::spawn(move || accept_loop(l, &name, &shared)));
    }
    for u in udp {
        let (shared, name) = (shared.clone(), name.to_string());
        loops.push(std::thread::spawn(move || udp_loop(u, &name, &shared)));
    }
    tracing::debug!(ns, name, ?spec, "echo server started");
    Ok(ServerGuard {
        name: name.to_string(),
        ns: ns.to_string(),
        shared,
        loops,
    })
}

fn accept_loop(listener: TcpListener, name: &str, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match sock::poll_one(listener.as_raw_fd(), libc::POLLIN, STOP_POLL) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => {
                tracing::warn!(error = %e, "echo server poll failed");
                return;
            }
        }
        let (stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "echo server accept failed");
                continue;
            }
        };
        shared.tcp_conns.fetch_add(1, Ordering::SeqCst);
        let id = shared.next_conn.fetch_add(1, Ordering::SeqCst);
        if let Ok(clone) = stream.try_clone() {
            shared
                .open
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id, clone);
        }
        // Drop may have emptied `open` just before the insert above.
        if shared.stop.load(Ordering::SeqCst) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        let (shared, name) = (shared.clone(), name.to_string());
        std::thread::spawn(move || {
            if let Err(e) = handle_conn(stream, peer, &name) {
                tracing::debug!(error = %e, %peer, "echo connection ended with error");
            }
            shared
                .open
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        });
    }
}

fn handle_conn(stream: TcpStream, peer: SocketAddr, name: &str) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    writer.write_all(format!("{name} {} {}\n", peer.ip(), peer.port()).as_bytes())?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let body = line.trim_end_matches(['\r', '\n']);
        writer.write_all(format!("{name} {body}\n").as_bytes())?;
    }
}

fn udp_loop(sock: UdpSocket, name: &str, shared: &Shared) {
    let mut buf = [0u8; 2048];
    while !shared.stop.load(Ordering::SeqCst) {
        match sock::recv_with_dst(sock.as_raw_fd(), &mut buf) {
            Ok((_, peer, dst)) => {
                // Count before answering so a client that got its reply
                // always sees itself counted.
                shared.udp_requests.fetch_add(1, Ordering::SeqCst);
                let reply = format!("{name} {} {}", peer.ip(), peer.port());
                if let Err(e) = udp_reply(&sock, reply.as_bytes(), &peer, dst) {
                    tracing::debug!(error = %e, %peer, "echo UDP reply failed");
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            // ICMP errors from earlier replies surface here; keep serving.
            Err(e) => tracing::debug!(error = %e, "echo UDP receive error"),
        }
    }
}

/// Answers from the address the request was sent to, like a well-behaved
/// UDP server on a multi-address host: a wildcard socket would otherwise
/// pick the route's preferred source, which a connected client drops.
fn udp_reply(
    sock: &UdpSocket,
    msg: &[u8],
    peer: &SocketAddr,
    dst: Option<IpAddr>,
) -> std::io::Result<usize> {
    match dst {
        Some(dst) if !dst.is_multicast() && dst != IpAddr::V4(Ipv4Addr::BROADCAST) => {
            match sock::send_from(sock.as_raw_fd(), msg, peer, dst) {
                Ok(n) => Ok(n),
                // e.g. a subnet broadcast address cannot be a source.
                Err(_) => sock.send_to(msg, peer),
            }
        }
        _ => sock.send_to(msg, peer),
    }
}
