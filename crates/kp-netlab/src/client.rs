//! Clients that talk to the echo servers from inside a lab namespace.
//!
//! Every function takes the namespace to run in; the socket is created there
//! (via [`in_netns`]) and then used from the calling thread.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use crate::netns::in_netns;
use crate::{sock, ConnError};

/// What a server said about a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The name the answering server was started with.
    pub server: String,
    /// The client address as the server saw it (after any NAT).
    pub peer: SocketAddr,
    /// The client socket's own local address (before any NAT), so tests can
    /// tell whether the source was rewritten: `peer != local`.
    pub local: SocketAddr,
}

impl Reply {
    fn parse(text: &str, local: SocketAddr) -> Result<Reply, ConnError> {
        let bad = || ConnError::Other(format!("malformed server reply {text:?}"));
        let mut words = text.split_whitespace();
        let (Some(server), Some(ip), Some(port), None) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            return Err(bad());
        };
        let ip: IpAddr = ip.parse().map_err(|_| bad())?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        Ok(Reply {
            server: server.to_string(),
            peer: SocketAddr::new(ip, port),
            local,
        })
    }
}

fn lab_err(e: crate::LabError) -> ConnError {
    ConnError::Other(e.to_string())
}

fn unspecified_like(addr: &SocketAddr) -> IpAddr {
    if addr.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    }
}

/// Creates and connects a TCP socket; must run inside the namespace.
fn tcp_connect(
    src: Option<IpAddr>,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<TcpStream, ConnError> {
    let fd =
        sock::socket_for(&addr, libc::SOCK_STREAM).map_err(|e| ConnError::from_io("socket", &e))?;
    if let Some(src) = src {
        sock::bind(&fd, &SocketAddr::new(src, 0))
            .map_err(|e| ConnError::Other(format!("binding client to {src}: {e}")))?;
    }
    sock::connect_timeout(&fd, &addr, timeout).map_err(|e| {
        let err = ConnError::from_io(&format!("connecting to {addr}"), &e);
        tracing::debug!(%addr, error = %e, ?err, "TCP connect failed");
        err
    })?;
    Ok(TcpStream::from(fd))
}

fn read_line(
    reader: &mut BufReader<TcpStream>,
    timeout: Duration,
    what: &str,
) -> Result<String, ConnError> {
    reader
        .get_ref()
        .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
        .map_err(|e| ConnError::from_io(what, &e))?;
    let mut line = String::new();
    match reader.read_line(&mut line) {
        Ok(0) => Err(ConnError::Other(format!(
            "{what}: connection closed by peer"
        ))),
        Ok(_) => Ok(line.trim_end_matches(['\r', '\n']).to_string()),
        Err(e) => Err(ConnError::from_io(what, &e)),
    }
}

/// Connects and reads the greeting; returns the stream for further use.
fn hello_on(
    src: Option<IpAddr>,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<(Reply, BufReader<TcpStream>), ConnError> {
    let stream = tcp_connect(src, addr, timeout)?;
    let local = stream
        .local_addr()
        .map_err(|e| ConnError::from_io("local address", &e))?;
    let mut reader = BufReader::new(stream);
    let line = read_line(&mut reader, timeout, "reading greeting")?;
    Ok((Reply::parse(&line, local)?, reader))
}

/// Opens a TCP connection from namespace `ns` to `addr` and returns who
/// answered. `timeout` bounds the connect and, separately, the greeting.
pub fn tcp_hello(ns: &str, addr: SocketAddr, timeout: Duration) -> Result<Reply, ConnError> {
    tcp_hello_from(ns, None, addr, timeout)
}

/// [`tcp_hello`] with the client bound to source address `src` (when a
/// namespace has several addresses).
pub fn tcp_hello_from(
    ns: &str,
    src: Option<IpAddr>,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<Reply, ConnError> {
    in_netns(ns, || hello_on(src, addr, timeout).map(|(r, _)| r)).map_err(lab_err)?
}

/// `count` sequential fresh TCP connections (new source port each) from one
/// thread in `ns`; one result per attempt, in order.
pub fn tcp_hello_many(
    ns: &str,
    addr: SocketAddr,
    count: usize,
    timeout: Duration,
) -> Vec<Result<Reply, ConnError>> {
    tcp_hello_many_from(ns, None, addr, count, timeout)
}

/// [`tcp_hello_many`] with the client bound to source address `src`.
pub fn tcp_hello_many_from(
    ns: &str,
    src: Option<IpAddr>,
    addr: SocketAddr,
    count: usize,
    timeout: Duration,
) -> Vec<Result<Reply, ConnError>> {
    match in_netns(ns, || {
        (0..count)
            .map(|_| hello_on(src, addr, timeout).map(|(r, _)| r))
            .collect::<Vec<_>>()
    }) {
        Ok(v) => v,
        Err(e) => vec![Err(lab_err(e)); count],
    }
}

/// Sends one datagram from a fresh UDP socket in `ns` and waits for the reply.
pub fn udp_ask(ns: &str, addr: SocketAddr, timeout: Duration) -> Result<Reply, ConnError> {
    udp_ask_from(ns, None, addr, timeout)
}

/// [`udp_ask`] with the client bound to source address `src`.
pub fn udp_ask_from(
    ns: &str,
    src: Option<IpAddr>,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<Reply, ConnError> {
    udp_session_from(ns, src, addr)?.ask(timeout)
}

/// Opens a UDP "session" in `ns`: one connected socket (fixed source port)
/// for repeated [`UdpSession::ask`] calls, as conntrack tests need.
pub fn udp_session(ns: &str, addr: SocketAddr) -> Result<UdpSession, ConnError> {
    udp_session_from(ns, None, addr)
}

/// [`udp_session`] with the client bound to source address `src`.
pub fn udp_session_from(
    ns: &str,
    src: Option<IpAddr>,
    addr: SocketAddr,
) -> Result<UdpSession, ConnError> {
    let sock = in_netns(ns, || -> Result<UdpSocket, ConnError> {
        let bind_ip = src.unwrap_or_else(|| unspecified_like(&addr));
        let s = UdpSocket::bind(SocketAddr::new(bind_ip, 0))
            .map_err(|e| ConnError::Other(format!("binding UDP client to {bind_ip}: {e}")))?;
        // Connected, so the kernel only delivers replies whose source is
        // exactly `addr` (a broken reverse NAT shows up as a timeout) and
        // reports ICMP errors as ECONNREFUSED.
        s.connect(addr)
            .map_err(|e| ConnError::from_io(&format!("connecting UDP socket to {addr}"), &e))?;
        Ok(s)
    })
    .map_err(lab_err)??;
    let local = sock
        .local_addr()
        .map_err(|e| ConnError::from_io("local address", &e))?;
    Ok(UdpSession { sock, addr, local })
}

/// One UDP socket talking to one server address; see [`udp_session`].
#[derive(Debug)]
pub struct UdpSession {
    sock: UdpSocket,
    addr: SocketAddr,
    local: SocketAddr,
}

impl UdpSession {
    /// Local (pre-NAT) address of the socket; stays the same across asks.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The address asked.
    pub fn target(&self) -> SocketAddr {
        self.addr
    }

    /// Sends one datagram and waits up to `timeout` for the answer.
    pub fn ask(&self, timeout: Duration) -> Result<Reply, ConnError> {
        self.drain();
        let what = format!("UDP to {}", self.addr);
        self.sock
            .send(b"ping\n")
            .map_err(|e| ConnError::from_io(&what, &e))?;
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; 2048];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ConnError::Timeout);
            }
            self.sock
                .set_read_timeout(Some(left))
                .map_err(|e| ConnError::from_io(&what, &e))?;
            match self.sock.recv(&mut buf) {
                Ok(n) => {
                    let text = String::from_utf8_lossy(&buf[..n]);
                    return Reply::parse(&text, self.local);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(ConnError::from_io(&what, &e)),
            }
        }
    }

    /// Discards late replies and pending ICMP errors left over from earlier
    /// asks that timed out, so they are not mistaken for this ask's answer.
    fn drain(&self) {
        if self.sock.set_nonblocking(true).is_err() {
            return;
        }
        let mut buf = [0u8; 2048];
        for _ in 0..64 {
            match self.sock.recv(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                _ => continue,
            }
        }
        let _ = self.sock.set_nonblocking(false);
    }
}

/// Opens one TCP connection from `ns` to `addr` and keeps it open; see
/// [`HeldConn::exchange`].
pub fn tcp_hold(ns: &str, addr: SocketAddr, timeout: Duration) -> Result<HeldConn, ConnError> {
    tcp_hold_from(ns, None, addr, timeout)
}

/// [`tcp_hold`] with the client bound to source address `src`.
pub fn tcp_hold_from(
    ns: &str,
    src: Option<IpAddr>,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<HeldConn, ConnError> {
    let (greeting, reader) = in_netns(ns, || hello_on(src, addr, timeout)).map_err(lab_err)??;
    Ok(HeldConn { greeting, reader })
}

/// An open TCP connection to an echo server.
#[derive(Debug)]
pub struct HeldConn {
    greeting: Reply,
    reader: BufReader<TcpStream>,
}

impl HeldConn {
    /// The greeting received when the connection was opened.
    pub fn greeting(&self) -> &Reply {
        &self.greeting
    }

    /// Sends `line` (a newline is appended) and returns the server's answer
    /// line without its newline: `"<server name> <line>"`.
    pub fn exchange(&mut self, line: &str, timeout: Duration) -> Result<String, ConnError> {
        if line.contains('\n') {
            return Err(ConnError::Other(format!(
                "line {line:?} must not contain a newline"
            )));
        }
        self.reader
            .get_mut()
            .write_all(format!("{line}\n").as_bytes())
            .map_err(|e| ConnError::from_io("sending line", &e))?;
        read_line(&mut self.reader, timeout, "reading answer")
    }
}
