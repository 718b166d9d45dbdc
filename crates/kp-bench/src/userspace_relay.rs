//! `kp-bench userspace-relay`: userspace mode's data path on loopback: one
//! bulk TCP transfer and many short connections, each through the proxy
//! and direct, as a ratio.
//!
//! Needs no privileges: the proxy serves a Service whose externalIP is
//! 127.0.0.1 (an address that is already local), so nothing is configured.
//! `--congestion-control NAME` (root) runs everything in a fresh network
//! namespace whose default TCP congestion control is NAME: the figures
//! depend on it more than on anything in the proxy (BENCHMARKS.md), and the
//! host's own setting is left alone. A non-initial namespace may only pick
//! from `net.ipv4.tcp_allowed_congestion_control`.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_model::{
    Dataplane, Endpoint, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName,
};
use kp_userspace::{NoMetrics, UserspaceConfig, UserspaceProxier, VipMode};

// Samples sorted, the nearest rank, as every kp-bench table reports it.
use crate::lab::{load_average, quantile as pct};

/// `kp-bench userspace-relay`.
#[derive(clap::Args, Debug, Clone)]
pub struct RelayArgs {
    /// Bytes of each bulk transfer.
    #[arg(long, default_value_t = 1 << 30)]
    bytes: u64,
    /// Seconds of each short-connection run.
    #[arg(long, default_value_t = 3.0)]
    secs: f64,
    /// Concurrent clients of the short-connection run.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Bulk transfers each way (direct and proxied alternate).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// The proxy copies through a buffer instead of splice(2).
    #[arg(long)]
    no_splice: bool,
    /// Runs everything in a fresh network namespace whose default TCP
    /// congestion control is NAME (root; one of the host's
    /// net.ipv4.tcp_allowed_congestion_control): the figures depend on it
    /// more than on anything in the proxy, and the host's own setting is
    /// left alone.
    #[arg(long, value_name = "NAME")]
    congestion_control: Option<String>,
}

/// CPU nanoseconds the sink's connection threads used, added by each one
/// just before it answers (so the figure is complete when the client has
/// its answer).
static SINK_CPU_NS: AtomicU64 = AtomicU64::new(0);

/// Reads everything, then answers with the byte count.
fn sink_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind sink");
    let addr = l.local_addr().expect("sink addr");
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || {
                let mut s = s;
                let mut buf = vec![0u8; 1 << 20];
                let mut n = 0u64;
                loop {
                    match s.read(&mut buf) {
                        Ok(0) => break,
                        Ok(k) => n += k as u64,
                        Err(_) => return,
                    }
                }
                SINK_CPU_NS.fetch_add(thread_cpu_ns(), Ordering::Relaxed);
                let _ = s.write_all(&n.to_le_bytes());
            });
        }
    });
    addr
}

/// Answers each 64-byte request with 64 bytes and closes.
fn rr_server(threads: usize) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind rr");
    let addr = l.local_addr().expect("rr addr");
    let l = Arc::new(l);
    for _ in 0..threads {
        let l = l.clone();
        std::thread::spawn(move || loop {
            let Ok((mut s, _)) = l.accept() else { continue };
            let _ = s.set_nodelay(true);
            let mut req = [0u8; 64];
            if s.read_exact(&mut req).is_ok() {
                let _ = s.write_all(&[b'r'; 64]);
            }
        });
    }
    addr
}

fn service(name: &str, port: u16, ep: SocketAddr) -> (ServicePort, Vec<Endpoint>) {
    let spn = ServicePortName::new("bench", name, "p", Protocol::Tcp);
    // Not local: not served; the externalIP below is.
    let mut sp = ServicePort::new(spn, "10.96.0.1".parse().expect("ip"), port);
    sp.external_ips = vec!["127.0.0.1".parse().expect("ip")];
    let e = Endpoint::ready(ep.ip(), ep.port(), true);
    (sp, vec![e])
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn bulk_once(addr: SocketAddr, bytes: u64) -> f64 {
    let buf = vec![7u8; 1 << 20];
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).expect("connect");
    let mut left = bytes;
    while left > 0 {
        let k = left.min(buf.len() as u64) as usize;
        s.write_all(&buf[..k]).expect("write");
        left -= k as u64;
    }
    s.shutdown(Shutdown::Write).expect("shutdown");
    let mut ack = [0u8; 8];
    s.read_exact(&mut ack).expect("ack");
    assert_eq!(u64::from_le_bytes(ack), bytes, "bytes lost");
    bytes as f64 / t0.elapsed().as_secs_f64()
}

struct RrResult {
    rps: f64,
    lat: Vec<Duration>,
    errors: usize,
}

fn rr_run(addr: SocketAddr, secs: f64, clients: usize) -> RrResult {
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (0..clients)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut lat = Vec::new();
                let mut errors = 0;
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let ok = (|| -> std::io::Result<()> {
                        let mut s = TcpStream::connect(addr)?;
                        s.set_nodelay(true)?;
                        s.write_all(&[b'q'; 64])?;
                        let mut r = [0u8; 64];
                        s.read_exact(&mut r)?;
                        Ok(())
                    })();
                    match ok {
                        Ok(()) => lat.push(t.elapsed()),
                        Err(_) => errors += 1,
                    }
                }
                (lat, errors)
            })
        })
        .collect();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    let mut lat = Vec::new();
    let mut errors = 0;
    for h in handles {
        let (l, e) = h.join().expect("client thread");
        lat.extend(l);
        errors += e;
    }
    let el = t0.elapsed().as_secs_f64();
    lat.sort();
    RrResult {
        rps: lat.len() as f64 / el,
        lat,
        errors,
    }
}

/// CPU nanoseconds (user + system) the calling thread has used.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPU seconds of one bulk transfer, by party.
#[derive(Default, Clone, Copy)]
struct Cpu {
    /// This (the client's) thread: write(2) and the send half of its hop.
    client: f64,
    /// The sink's connection thread: read(2) and ACKs.
    server: f64,
    /// Everything else in the process: the proxy's runtime and any thread it
    /// starts (zero, up to timer noise, for direct transfers).
    proxy: f64,
}

impl std::ops::AddAssign for Cpu {
    fn add_assign(&mut self, o: Cpu) {
        self.client += o.client;
        self.server += o.server;
        self.proxy += o.proxy;
    }
}

impl Cpu {
    fn total(&self) -> f64 {
        self.client + self.server + self.proxy
    }
}

/// One bulk transfer: its throughput (bytes/s) and who spent how much CPU.
fn bulk_measured(addr: SocketAddr, bytes: u64) -> (f64, Cpu) {
    let (p0, c0, s0) = (
        cpu_of_process(),
        thread_cpu_ns(),
        SINK_CPU_NS.load(Ordering::Relaxed),
    );
    let rate = bulk_once(addr, bytes);
    let client = (thread_cpu_ns() - c0) as f64 / 1e9;
    let server = (SINK_CPU_NS.load(Ordering::Relaxed) - s0) as f64 / 1e9;
    let all = cpu_of_process() - p0;
    let cpu = Cpu {
        client,
        server,
        proxy: (all - client - server).max(0.0),
    };
    (rate, cpu)
}

/// A sysctl's value as text (for the header: the figures depend on them).
fn sysctl(path: &str) -> String {
    std::fs::read_to_string(format!("/proc/sys/{path}"))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// CPU seconds (user + system) of the whole process so far.
fn cpu_of_process() -> f64 {
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Moves this process into a new network namespace with lo up and `cc`
/// as its TCP congestion control. Must run before any thread starts
/// (unshare applies to the calling thread; later threads inherit it).
fn fresh_netns(cc: &str) -> Result<(), String> {
    let os = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
    // SAFETY: unshare(2) with a namespace flag; no pointers.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(os("unshare(CLONE_NEWNET) (needs root)"));
    }
    // SAFETY: a plain socket for the interface ioctls, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(os("socket"));
    }
    // SAFETY: ifreq is plain old data; the name is NUL-terminated ("lo").
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    ifr.ifr_name[0] = b'l' as libc::c_char;
    ifr.ifr_name[1] = b'o' as libc::c_char;
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we own.
    let r = unsafe {
        if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut ifr) == 0 {
            ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            libc::ioctl(fd, libc::SIOCSIFFLAGS, &ifr)
        } else {
            -1
        }
    };
    let err = (r != 0).then(|| os("setting lo up"));
    // SAFETY: closes the socket opened above.
    unsafe { libc::close(fd) };
    if let Some(e) = err {
        return Err(e);
    }
    // /proc/sys/net is the opener's namespace: this writes the new one's.
    std::fs::write("/proc/sys/net/ipv4/tcp_congestion_control", cc).map_err(|e| {
        format!(
            "setting tcp_congestion_control to {cc:?} (allowed here: {}): {e}",
            sysctl("net/ipv4/tcp_allowed_congestion_control")
        )
    })
}

/// `kp-bench userspace-relay`.
pub fn run(o: RelayArgs) -> anyhow::Result<()> {
    let splice = !o.no_splice;
    // Read in the host's namespace: the new one has no such entry.
    let qdisc = sysctl("net/core/default_qdisc");
    if let Some(cc) = &o.congestion_control {
        fresh_netns(cc).map_err(|e| anyhow::anyhow!("userspace-relay: {e}"))?;
    }
    let rt = kp_userspace::runtime().expect("runtime");
    let mut cfg = UserspaceConfig::new(IpFamily::V4);
    cfg.vip_mode = VipMode::None;
    cfg.splice = splice;
    let mut proxy = UserspaceProxier::new(cfg, Arc::new(NoMetrics), rt).expect("proxier");

    let sink = sink_server();
    let rr = rr_server(o.clients.max(2));
    let (p_bulk, p_rr) = (free_port(), free_port());
    let mut state = ProxyState::new(IpFamily::V4, NodeInfo::default());
    for (name, port, ep) in [("bulk", p_bulk, sink), ("rr", p_rr, rr)] {
        let (sp, eps) = service(name, port, ep);
        state.endpoints.insert(sp.name.clone(), Arc::new(eps));
        state.services.insert(sp.name.clone(), Arc::new(sp));
    }
    proxy
        .sync(&state, &BTreeSet::new(), true)
        .expect("programming the proxy");
    let via_bulk: SocketAddr = SocketAddr::from(([127, 0, 0, 1], p_bulk));
    let via_rr: SocketAddr = SocketAddr::from(([127, 0, 0, 1], p_rr));
    println!(
        "userspace-relay: {} cpus, copy = {}, {}, tcp_congestion_control = {}, default_qdisc = {}, pipe-max-size = {}, load average {}",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        if splice { "splice" } else { "buffer" },
        if o.congestion_control.is_some() {
            "network namespace: a fresh one"
        } else {
            "network namespace: the caller's"
        },
        sysctl("net/ipv4/tcp_congestion_control"),
        qdisc,
        sysctl("fs/pipe-max-size"),
        load_average(),
    );

    // Bulk: alternate direct and proxied runs so machine noise hits both.
    let (mut d, mut p) = (Vec::new(), Vec::new());
    bulk_once(sink, o.bytes.min(64 << 20));
    bulk_once(via_bulk, o.bytes.min(64 << 20));
    let (mut dcpu, mut pcpu) = (Cpu::default(), Cpu::default());
    let mut paired = Vec::new();
    for _ in 0..o.runs {
        let (rate, cpu) = bulk_measured(sink, o.bytes);
        d.push(rate);
        dcpu += cpu;
        let (rate, cpu) = bulk_measured(via_bulk, o.bytes);
        p.push(rate);
        pcpu += cpu;
        paired.push(p[p.len() - 1] / d[d.len() - 1]);
    }
    let (dm, pm) = (median(d.clone()), median(p.clone()));
    let gib = |x: f64| x / (1u64 << 30) as f64;
    let (dbest, pbest) = (
        gib(d.iter().copied().fold(0.0, f64::max)),
        gib(p.iter().copied().fold(0.0, f64::max)),
    );
    let paired_median = median(paired.clone());
    println!(
        "bulk {} MiB x {}: direct {:.2} GiB/s (best {:.2}), proxied {:.2} GiB/s (best {:.2}), ratio {:.2}",
        o.bytes >> 20,
        o.runs,
        gib(dm),
        dbest,
        gib(pm),
        pbest,
        pm / dm
    );
    let gibs = o.runs as f64 * o.bytes as f64 / (1u64 << 30) as f64;
    let per = |c: Cpu| {
        (
            c.client / gibs,
            c.server / gibs,
            c.proxy / gibs,
            c.total() / gibs,
        )
    };
    let (dc, ds, drest, dt) = per(dcpu);
    let (pc, ps, pp, pt) = per(pcpu);
    let mut sorted = paired.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    println!(
        "bulk: paired ratios (sorted) {}; median {:.2}",
        sorted
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" "),
        paired_median
    );
    println!(
        "bulk: CPU s per GiB: direct client {dc:.3} + server {ds:.3} = {dt:.3} (rest of the process {drest:.3}); proxied client {pc:.3} + server {ps:.3} + proxy {pp:.3} = {pt:.3}"
    );
    // The same figures as table rows (BENCHMARKS.md, userspace section).
    println!(
        "| bulk {} MiB, median of {} | {:.2} GiB/s | {:.2} GiB/s | **{:.2}**; median of paired ratios **{:.2}** |",
        o.bytes >> 20,
        o.runs,
        gib(dm),
        gib(pm),
        pm / dm,
        paired_median
    );
    println!(
        "| CPU s per GiB (client + server [+ proxy]) | {dc:.2} + {ds:.2} = {dt:.2} | {pc:.2} + {ps:.2} + **{pp:.2}** = {pt:.2} | {:.1}x |",
        pt / dt
    );

    // Short connections.
    let direct = rr_run(rr, o.secs, o.clients);
    let proxied = rr_run(via_rr, o.secs, o.clients);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "short connections ({} clients, {} s): direct {:.0}/s p50 {:.0} us p99 {:.0} us ({} errors); proxied {:.0}/s p50 {:.0} us p99 {:.0} us ({} errors); ratio {:.2}; added p50 {:.0} us, p99 {:.0} us",
        o.clients,
        o.secs,
        direct.rps,
        us(pct(&direct.lat, 0.5)),
        us(pct(&direct.lat, 0.99)),
        direct.errors,
        proxied.rps,
        us(pct(&proxied.lat, 0.5)),
        us(pct(&proxied.lat, 0.99)),
        proxied.errors,
        proxied.rps / direct.rps,
        us(pct(&proxied.lat, 0.5)) - us(pct(&direct.lat, 0.5)),
        us(pct(&proxied.lat, 0.99)) - us(pct(&direct.lat, 0.99)),
    );
    // Sequential (one client): the latency one connection adds, without queueing.
    let direct1 = rr_run(rr, o.secs.min(2.0), 1);
    let proxied1 = rr_run(via_rr, o.secs.min(2.0), 1);
    println!(
        "one client: direct p50 {:.0} us p99 {:.0} us; proxied p50 {:.0} us p99 {:.0} us; added p99 {:.0} us",
        us(pct(&direct1.lat, 0.5)),
        us(pct(&direct1.lat, 0.99)),
        us(pct(&proxied1.lat, 0.5)),
        us(pct(&proxied1.lat, 0.99)),
        us(pct(&proxied1.lat, 0.99)) - us(pct(&direct1.lat, 0.99)),
    );
    let ms = |d: Duration| {
        let v = us(d);
        if v >= 1000.0 {
            format!("{:.1} ms", v / 1000.0)
        } else {
            format!("{v:.0} µs")
        }
    };
    println!(
        "| short connections, {} clients | {:.0} /s, p50 {}, p99 {} | {:.0} /s, p50 {}, p99 {} | {:.2} |",
        o.clients,
        direct.rps,
        ms(pct(&direct.lat, 0.5)),
        ms(pct(&direct.lat, 0.99)),
        proxied.rps,
        ms(pct(&proxied.lat, 0.5)),
        ms(pct(&proxied.lat, 0.99)),
        proxied.rps / direct.rps,
    );
    println!(
        "| added latency per connection | | p50 +{:.0} µs, p99 +{:.0} µs ({} clients); one client alone: p50 {:.0} → {:.0} µs | |",
        us(pct(&proxied.lat, 0.5)) - us(pct(&direct.lat, 0.5)),
        us(pct(&proxied.lat, 0.99)) - us(pct(&direct.lat, 0.99)),
        o.clients,
        us(pct(&direct1.lat, 0.5)),
        us(pct(&proxied1.lat, 0.5)),
    );
    println!("load average at the end {}", load_average());
    Ok(())
}
