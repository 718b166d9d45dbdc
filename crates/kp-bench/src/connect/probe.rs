//! Connect latency from a pod: the server and the timed `connect()` loop that
//! `kp-bench connect` (proxiers driven directly) and `kp-bench compare
//! --connect` (both proxy binaries through the API) share.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kp_netlab::{in_netns, Pod};

/// A listener in a pod that accepts and drops connections, so the accept
/// queue never fills. Stopped (and its thread joined) on drop.
pub struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    ns: String,
    addr: SocketAddr,
}

impl Server {
    pub fn start(pod: &Pod, port: u16) -> Result<Server> {
        Server::listen(pod, port, false)
    }

    /// A server for [`bulk`]: reads each connection to its end, then
    /// answers one byte.
    pub fn start_sink(pod: &Pod, port: u16) -> Result<Server> {
        Server::listen(pod, port, true)
    }

    fn listen(pod: &Pod, port: u16, sink: bool) -> Result<Server> {
        let addr = pod.addr(port);
        let listener = in_netns(pod.ns(), || TcpListener::bind(addr))?
            .with_context(|| format!("listening on {addr}"))?;
        // std listens with a backlog of 128; the accept thread can be starved
        // for longer than that on a busy machine, and an overflow drops a SYN
        // (a 1 s retransmission in the figures). Re-listening raises it.
        {
            use std::os::fd::AsRawFd;
            // SAFETY: listen(2) on a listening socket we own.
            if unsafe { libc::listen(listener.as_raw_fd(), 4096) } != 0 {
                return Err(std::io::Error::last_os_error()).context("listen backlog");
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if flag.load(Ordering::Relaxed) {
                    break;
                }
                if sink {
                    if let Ok(mut c) = conn {
                        let _ = std::io::copy(&mut c, &mut std::io::sink());
                        let _ = c.write_all(b"k");
                    }
                } else {
                    drop(conn);
                }
            }
        });
        Ok(Server {
            stop,
            thread: Some(thread),
            ns: pod.ns().to_string(),
            addr,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the blocked accept() with one last connection from the pod itself.
        let addr = self.addr;
        let _ = in_netns(&self.ns, || {
            TcpStream::connect_timeout(&addr, Duration::from_secs(1))
        });
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `k` connects from `client` to `target`: the times of those that
/// succeeded and the number that failed. One sample = SYN out, through the
/// node's netfilter hooks (a fresh conntrack entry each time: the source
/// port is new), to the pod and back.
pub fn connects(client: &Pod, target: SocketAddr, k: usize) -> Result<(Vec<Duration>, usize)> {
    let (ok, fail, _) = connect_batch(client, target, k)?;
    Ok((ok, fail))
}

/// [`connects`], plus the wall time of the loop itself (connect and close,
/// one after the other, on a thread already in the pod's namespace).
pub fn connect_batch(
    client: &Pod,
    target: SocketAddr,
    k: usize,
) -> Result<(Vec<Duration>, usize, Duration)> {
    Ok(in_netns(client.ns(), move || {
        let mut ok = Vec::with_capacity(k);
        let mut fail = 0;
        let start = Instant::now();
        for _ in 0..k {
            let t = Instant::now();
            match TcpStream::connect_timeout(&target, Duration::from_secs(2)) {
                Ok(c) => {
                    ok.push(t.elapsed());
                    abort(c);
                }
                Err(_) => fail += 1,
            }
        }
        (ok, fail, start.elapsed())
    })?)
}

/// Sends `bytes` over one TCP connection from `client` to `target` (a
/// [`Server::start_sink`]) and waits for its one-byte answer: the time from
/// connect to answer.
pub fn bulk(client: &Pod, target: SocketAddr, bytes: usize) -> Result<Duration> {
    in_netns(client.ns(), move || -> Result<Duration> {
        let buf = vec![0x5au8; 1 << 16];
        let t = Instant::now();
        let mut c = TcpStream::connect_timeout(&target, Duration::from_secs(2))
            .with_context(|| format!("bulk connect to {target}"))?;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(buf.len());
            c.write_all(&buf[..n]).context("bulk write")?;
            left -= n;
        }
        c.shutdown(std::net::Shutdown::Write)
            .context("bulk shutdown")?;
        let mut ack = [0u8; 1];
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        c.read_exact(&mut ack).context("bulk answer")?;
        Ok(t.elapsed())
    })?
}

/// Closes with a RST (SO_LINGER 0): no TIME_WAIT socket on either side, so
/// a later connect reusing the source port is not answered by a stale
/// TIME_WAIT socket (which costs a 1 s SYN retransmission).
pub(crate) fn abort(c: TcpStream) {
    use std::os::fd::AsRawFd;
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt on a socket we own with a correctly sized option.
    unsafe {
        libc::setsockopt(
            c.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    drop(c);
}

/// Microseconds, rounded.
pub fn us(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1e6)
}

/// The mean of samples (zero when there are none).
pub fn mean(v: &[Duration]) -> Duration {
    if v.is_empty() {
        Duration::ZERO
    } else {
        v.iter().sum::<Duration>() / v.len() as u32
    }
}
