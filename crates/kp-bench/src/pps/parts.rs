//! The pieces of `kp-bench pps` (NodePort packet rate, mod.rs): the table of
//! proxy configurations, the UDP sender and sinks, the TCP client and echo
//! servers, CPU pinning and RPS, and the kernel's counters it reads (/proc/stat,
//! /proc/softirqs, softnet_stat, `bpftool`).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kp_netlab::{in_netns, Cluster, Pod};
use serde_json::Value;

/// Which binary a configuration runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binary {
    Ours,
    Upstream,
    /// Upstream's binary with `iptables` meaning iptables-legacy (a PATH of
    /// symlinks to xtables-legacy-multi, as the kube-proxy image's wrapper
    /// would pick on a legacy host).
    UpstreamLegacy,
    /// No proxy at all: the client sends to the endpoints' own addresses,
    /// routed through the node (the `floor` row: what forwarding alone
    /// costs, on the same veths and bridge as every other row).
    NoProxy,
    /// No proxy, as `none`, and a tc program that returns TC_ACT_OK at
    /// once on the ingress of every interface of the node but lo (where
    /// ours attaches): what a tc hook costs at all (`null-tc`).
    NullTc,
}

impl Binary {
    fn parse(s: &str) -> Result<Binary> {
        Ok(match s {
            "ours" => Binary::Ours,
            "upstream" => Binary::Upstream,
            "upstream-legacy" => Binary::UpstreamLegacy,
            "none" => Binary::NoProxy,
            "null-tc" => Binary::NullTc,
            other => bail!("binary {other:?}: ours, upstream, upstream-legacy, none or null-tc"),
        })
    }

    pub fn upstream(self) -> bool {
        matches!(self, Binary::Upstream | Binary::UpstreamLegacy)
    }

    /// No proxy runs: the client sends to the pods' own addresses.
    pub fn proxyless(self) -> bool {
        matches!(self, Binary::NoProxy | Binary::NullTc)
    }
}

/// One row of the table: a name, a binary, its `--proxy-mode` and the flags
/// after the lab's common ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyConfig {
    pub name: String,
    pub binary: Binary,
    /// Another build of ours than `--binary` (`ours@PATH` in `--define`):
    /// two builds compared in one run.
    pub path: Option<std::path::PathBuf>,
    pub mode: String,
    pub args: Vec<String>,
}

/// Every configuration `kp-bench pps` knows by name. New flags need no code: add
/// them with `--extra-args NAME=FLAGS`, or define a row with `--define`.
const CONFIGS: &[(&str, Binary, &str, &[&str])] = &[
    // No proxy: plain forwarding to the pods' addresses, no NAT, and no
    // conntrack (a namespace without rules registers no hooks).
    ("floor", Binary::NoProxy, "none", &[]),
    // The floor with a null tc program where ours attaches.
    ("null-tc", Binary::NullTc, "none", &[]),
    ("upstream-nftables", Binary::Upstream, "nftables", &[]),
    // The host's `iptables`: iptables-nft on this machine kind. Its first
    // sync takes ~95 minutes at 10k Services (BENCHMARKS.md, `kp-bench compare`).
    ("upstream-iptables", Binary::Upstream, "iptables", &[]),
    (
        "upstream-iptables-legacy",
        Binary::UpstreamLegacy,
        "iptables",
        &[],
    ),
    ("ours-nftables", Binary::Ours, "nftables", &[]),
    ("ours-iptables", Binary::Ours, "iptables", &[]),
    (
        "ours-iptables-legacy",
        Binary::Ours,
        "iptables",
        &["--iptables-backend=legacy"],
    ),
    (
        "ours-tc",
        Binary::Ours,
        "nftables",
        &["--socket-lb", "--bpf-nodeport"],
    ),
    (
        "ours-xdp",
        Binary::Ours,
        "nftables",
        &[
            "--socket-lb",
            "--bpf-nodeport",
            "--bpf-lb-acceleration",
            "native",
        ],
    ),
];

/// The built-in configurations.
pub fn builtin_configs() -> Vec<ProxyConfig> {
    CONFIGS
        .iter()
        .map(|(name, binary, mode, args)| ProxyConfig {
            name: name.to_string(),
            binary: *binary,
            path: None,
            mode: mode.to_string(),
            args: args.iter().map(|a| a.to_string()).collect(),
        })
        .collect()
}

/// `NAME=BINARY:MODE[:FLAGS]` (FLAGS split at whitespace): a configuration
/// given on the command line.
pub fn parse_define(spec: &str) -> Result<ProxyConfig> {
    let (name, rest) = spec
        .split_once('=')
        .with_context(|| format!("--define {spec:?}: NAME=BINARY:MODE[:FLAGS]"))?;
    let mut parts = rest.splitn(3, ':');
    let (binary, path) = match parts.next().unwrap_or_default().split_once('@') {
        Some(("ours", p)) if !p.is_empty() => (Binary::Ours, Some(std::path::PathBuf::from(p))),
        Some(_) => bail!("--define {spec:?}: only ours@PATH names a path"),
        None => (
            Binary::parse(rest.split(':').next().unwrap_or_default())?,
            None,
        ),
    };
    let mode = parts
        .next()
        .filter(|m| !m.is_empty())
        .with_context(|| format!("--define {spec:?}: no mode"))?;
    Ok(ProxyConfig {
        name: name.to_string(),
        binary,
        path,
        mode: mode.to_string(),
        args: parts
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect(),
    })
}

/// Whether `args` ask for BPF programs (`--socket-lb` and what builds on
/// it): the bench then gives the proxy a cgroup and a bpffs of its own.
pub fn wants_bpf(args: &[String]) -> bool {
    args.iter()
        .any(|a| a == "--socket-lb" || a.starts_with("--socket-lb=") || a.starts_with("--bpf-"))
}

// ---------------------------------------------------------------------------
// Interruption

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT and SIGTERM only set a flag: the bench stops at its next check
/// and returns an error, so every guard (proxies, namespaces, mounts, the
/// BPF statistics) is dropped as on any error.
pub fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGTERM,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// An error when the run was interrupted.
pub fn check_interrupted() -> Result<()> {
    if interrupted() {
        bail!("interrupted (SIGINT/SIGTERM)");
    }
    Ok(())
}

/// Sleeps `d`, in slices, returning early (with an error) when interrupted.
pub fn sleep_checked(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    loop {
        check_interrupted()?;
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        std::thread::sleep((end - now).min(Duration::from_millis(100)));
    }
}

// ---------------------------------------------------------------------------
// CPUs

fn cpu_set(cpus: &[usize]) -> libc::cpu_set_t {
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: CPU_SET on a set we own, with an index below CPU_SETSIZE
        // (the machine's CPUs).
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    set
}

/// Nice value of the bench's own threads on the client's CPU: they share
/// it with whatever else the machine runs, and at the default weight a
/// neighbour's compiler took most of it (the sender then could not offer
/// the rate asked for). Softirqs, the node's work included, still preempt
/// them.
pub const CLIENT_NICE: libc::c_int = -10;

/// Pins the calling thread to `cpu` and gives it [`CLIENT_NICE`] (Linux
/// keeps a nice value per thread).
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    pin_task(0, cpu)?;
    // SAFETY: gettid has no arguments and cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    // SAFETY: setpriority on this very thread.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, CLIENT_NICE) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn pin_task(tid: libc::pid_t, cpu: usize) -> io::Result<()> {
    let set = cpu_set(&[cpu]);
    // SAFETY: sched_setaffinity with a correctly sized set.
    if unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Pins every thread of process `pid` (and so whatever it starts later)
/// to `cpu`.
pub fn pin_process(pid: u32, cpu: usize) -> Result<()> {
    let dir = format!("/proc/{pid}/task");
    for t in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let tid = t?.file_name().to_string_lossy().parse::<libc::pid_t>();
        if let Ok(tid) = tid {
            // A thread may have exited since the listing.
            let _ = pin_task(tid, cpu);
        }
    }
    Ok(())
}

/// Sets `rps_cpus` to `mask` on the devices of namespace `ns` that
/// `which` (a shell glob over /sys/class/net inside `ns`) names, loopback
/// excepted: packets a device receives are then processed on those CPUs.
/// Only that namespace's devices change (`ip netns exec` mounts its /sys).
pub fn set_rps(cluster: &Cluster, ns: &str, which: &str, mask: &str) -> Result<()> {
    let script = format!(
        "for d in /sys/class/net/{which}; do n=${{d##*/}}; [ \"$n\" = lo ] && continue; \
         for q in \"$d\"/queues/rx-*/rps_cpus; do [ -e \"$q\" ] && echo {mask} > \"$q\"; done; done; true"
    );
    cluster
        .exec_ok(ns, &["sh", "-c", &script])
        .with_context(|| format!("setting rps_cpus={mask} on {which} in {ns}"))?;
    Ok(())
}

/// Per-CPU times of /proc/stat, in USER_HZ ticks: user nice system idle
/// iowait irq softirq steal.
#[derive(Clone, Debug, Default)]
pub struct CpuTimes(pub Vec<[u64; 8]>);

/// USER_HZ on Linux: /proc/stat's unit.
pub const TICK_NS: f64 = 1e7;

impl CpuTimes {
    pub fn read() -> Result<CpuTimes> {
        let text = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
        let mut v = Vec::new();
        for line in text.lines() {
            let mut f = line.split_whitespace();
            let Some(name) = f.next() else { continue };
            if !name.starts_with("cpu") || name == "cpu" {
                continue;
            }
            let mut row = [0u64; 8];
            for slot in row.iter_mut() {
                *slot = f.next().and_then(|x| x.parse().ok()).unwrap_or(0);
            }
            v.push(row);
        }
        Ok(CpuTimes(v))
    }

    fn delta(&self, later: &CpuTimes, cpu: usize, col: usize) -> u64 {
        let get = |t: &CpuTimes| t.0.get(cpu).map_or(0, |r| r[col]);
        get(later).saturating_sub(get(self))
    }

    /// Ticks the hypervisor stole from `cpu` from `self` to `later`.
    pub fn steal_ticks(&self, later: &CpuTimes, cpu: usize) -> u64 {
        self.delta(later, cpu, 7)
    }

    /// Softirq nanoseconds of `cpu` from `self` to `later`.
    pub fn softirq_ns(&self, later: &CpuTimes, cpu: usize) -> f64 {
        self.delta(later, cpu, 6) as f64 * TICK_NS
    }

    /// The share of `cpu`'s time spent running something (user, system,
    /// interrupts): neither idle nor iowait, nor stolen by the hypervisor.
    pub fn busy(&self, later: &CpuTimes, cpu: usize) -> f64 {
        let all: u64 = (0..8).map(|c| self.delta(later, cpu, c)).sum();
        let not = self.delta(later, cpu, 3) + self.delta(later, cpu, 4) + self.delta(later, cpu, 7);
        if all == 0 {
            0.0
        } else {
            1.0 - not as f64 / all as f64
        }
    }
}

/// NET_RX softirqs raised per CPU so far (/proc/softirqs).
pub fn net_rx_per_cpu() -> Vec<u64> {
    std::fs::read_to_string("/proc/softirqs")
        .unwrap_or_default()
        .lines()
        .find(|l| l.trim_start().starts_with("NET_RX:"))
        .map(|l| {
            l.split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Packets each CPU's backlog dropped so far (softnet_stat's second
/// column): netif_rx found the queue full.
pub fn backlog_drops_per_cpu() -> Vec<u64> {
    std::fs::read_to_string("/proc/net/softnet_stat")
        .unwrap_or_default()
        .lines()
        .map(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|x| u64::from_str_radix(x, 16).ok())
                .unwrap_or(0)
        })
        .collect()
}

/// Per CPU so far, from softnet_stat: packets its backlog dropped and
/// times net_rx_action ran out of budget or time with work left
/// (time_squeeze): both mean a stalled backlog.
pub fn softnet_stalls_per_cpu() -> Vec<(u64, u64)> {
    std::fs::read_to_string("/proc/net/softnet_stat")
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let col = |i: usize| {
                l.split_whitespace()
                    .nth(i)
                    .and_then(|x| u64::from_str_radix(x, 16).ok())
                    .unwrap_or(0)
            };
            (col(1), col(2))
        })
        .collect()
}

/// `later - earlier`, element by element.
pub fn deltas(earlier: &[u64], later: &[u64]) -> Vec<u64> {
    later
        .iter()
        .enumerate()
        .map(|(i, l)| l.saturating_sub(earlier.get(i).copied().unwrap_or(0)))
        .collect()
}

/// UDP datagrams a namespace dropped for a full socket buffer so far
/// (`Udp: RcvbufErrors`), read from a thread inside it.
pub fn udp_rcvbuf_errors(ns: &str) -> u64 {
    in_netns(ns, || {
        // thread-self: /proc/self/net would show the main thread's namespace.
        let text = std::fs::read_to_string("/proc/thread-self/net/snmp").ok()?;
        let mut udp = text.lines().filter(|l| l.starts_with("Udp: "));
        let (head, vals) = (udp.next()?, udp.next()?);
        let i = head.split_whitespace().position(|h| h == "RcvbufErrors")?;
        vals.split_whitespace().nth(i)?.parse().ok()
    })
    .ok()
    .flatten()
    .unwrap_or(0)
}

// ---------------------------------------------------------------------------
// BPF

/// BPF run-time statistics on while this lives: BPF_ENABLE_STATS hands out
/// a file descriptor and the kernel counts only while one is open, so the
/// statistics go off again when this is dropped, or when the process dies
/// however it dies. kernel.bpf_stats_enabled, the sysctl, is never written.
pub struct BpfStats {
    _fd: OwnedFd,
}

impl BpfStats {
    pub fn enable() -> Result<BpfStats> {
        const BPF_ENABLE_STATS: libc::c_long = 32;
        #[repr(C)]
        struct Attr {
            kind: u32, // BPF_STATS_RUN_TIME = 0
        }
        let attr = Attr { kind: 0 };
        // SAFETY: the bpf syscall reads `size` bytes of a live struct.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_ENABLE_STATS,
                &attr as *const Attr,
                std::mem::size_of::<Attr>() as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("bpf(BPF_ENABLE_STATS)");
        }
        // SAFETY: the kernel just returned this descriptor to us.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        Ok(BpfStats { _fd: fd })
    }
}

/// A BPF program as `bpftool prog show` describes it.
#[derive(Clone, Debug, Default)]
pub struct ProgInfo {
    pub id: u64,
    pub kind: String,
    pub name: String,
    pub run_time_ns: u64,
    pub run_cnt: u64,
    pub pids: Vec<u64>,
}

/// Every BPF program loaded on the machine (empty when bpftool is missing).
pub fn bpf_programs() -> BTreeMap<u64, ProgInfo> {
    let out = std::process::Command::new("bpftool")
        .args(["prog", "show", "-j"])
        .output();
    let Ok(out) = out else {
        return BTreeMap::new();
    };
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|p| {
                    let n = |k: &str| p[k].as_u64().unwrap_or(0);
                    let info = ProgInfo {
                        id: n("id"),
                        kind: p["type"].as_str().unwrap_or_default().to_string(),
                        name: p["name"].as_str().unwrap_or_default().to_string(),
                        run_time_ns: n("run_time_ns"),
                        run_cnt: n("run_cnt"),
                        pids: p["pids"]
                            .as_array()
                            .map(|ps| ps.iter().filter_map(|x| x["pid"].as_u64()).collect())
                            .unwrap_or_default(),
                    };
                    (info.id, info)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Program ids `bpftool net show` finds attached to the devices of `ns`
/// (XDP and tc; bpftool 7.1 does not list tcx links: see
/// [`node_programs`]).
pub fn attached_in(cluster: &Cluster, ns: &str) -> BTreeSet<u64> {
    fn collect(v: &Value, out: &mut BTreeSet<u64>) {
        match v {
            Value::Object(o) => {
                for (k, x) in o {
                    if k == "id" || k == "prog_id" {
                        if let Some(id) = x.as_u64() {
                            out.insert(id);
                        }
                    } else {
                        collect(x, out);
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|x| collect(x, out)),
            _ => {}
        }
    }
    let mut ids = BTreeSet::new();
    if let Ok(text) = cluster.exec_ok(ns, &["bpftool", "net", "show", "-j"]) {
        if let Ok(v) = serde_json::from_str::<Value>(&text) {
            collect(&v, &mut ids);
        }
    }
    ids
}

/// The packet programs of a configuration: those attached in the node's
/// namespace, and the tc and XDP programs loaded since `before` by the
/// proxy `pid` (tcx links, which bpftool 7.1 does not list per device;
/// the socket balancer's cgroup programs are not on the NodePort path).
pub fn node_programs(
    cluster: &Cluster,
    ns: &str,
    before: &BTreeMap<u64, ProgInfo>,
    pid: u32,
) -> BTreeSet<u64> {
    let mut ids = attached_in(cluster, ns);
    for (id, p) in bpf_programs() {
        let packet = matches!(p.kind.as_str(), "sched_cls" | "sched_act" | "xdp");
        let mine = p.pids.is_empty() || p.pids.contains(&u64::from(pid));
        if packet && mine && !before.contains_key(&id) {
            ids.insert(id);
        }
    }
    ids
}

/// Summed run time (ns) and runs of the programs `ids`.
pub fn bpf_runs(ids: &BTreeSet<u64>) -> (u64, u64) {
    if ids.is_empty() {
        return (0, 0);
    }
    bpf_programs()
        .into_iter()
        .filter(|(id, _)| ids.contains(id))
        .fold((0, 0), |(t, c), (_, p)| (t + p.run_time_ns, c + p.run_cnt))
}

// ---------------------------------------------------------------------------
// Endpoints: UDP sinks and TCP echo servers in the pods

/// One UDP socket per pod, all drained by one thread pinned to `cpu` with
/// recvmmsg, counting datagrams per pod.
pub struct UdpSinks {
    /// The sockets' descriptors, for [`UdpSinks::queued`] (the thread
    /// owns the sockets and outlives every use of these).
    fds: Vec<RawFd>,
    counts: Arc<Vec<AtomicU64>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

const RECV_BATCH: usize = 64;

impl UdpSinks {
    pub fn start(pods: &[Pod], port: u16, cpu: usize) -> Result<UdpSinks> {
        UdpSinks::start_with(pods, port, cpu, false)
    }

    /// [`UdpSinks::start`] whose pods answer every datagram with itself, to
    /// its sender (the `--in-place` echo: the replies cross the node too).
    pub fn start_echo(pods: &[Pod], port: u16, cpu: usize) -> Result<UdpSinks> {
        UdpSinks::start_with(pods, port, cpu, true)
    }

    /// Counts what arrives on sockets of the caller's (the client's flows,
    /// cloned: the echoes coming back), one count per socket.
    pub fn count_on(socks: Vec<UdpSocket>, cpu: usize) -> Result<UdpSinks> {
        for s in &socks {
            s.set_nonblocking(true)?;
            set_int_opt(s.as_raw_fd(), libc::SO_RCVBUFFORCE, 4 << 20).context("SO_RCVBUFFORCE")?;
        }
        UdpSinks::spawn(socks, cpu, false)
    }

    fn start_with(pods: &[Pod], port: u16, cpu: usize, echo: bool) -> Result<UdpSinks> {
        let mut socks = Vec::new();
        for p in pods {
            let addr = p.addr(port);
            let s = in_netns(p.ns(), || UdpSocket::bind(addr))?
                .with_context(|| format!("binding UDP {addr} in {}", p.ns()))?;
            s.set_nonblocking(true)?;
            // Past rmem_max without touching the sysctl: room for bursts
            // while the thread waits for the CPU it shares with the sender.
            set_int_opt(s.as_raw_fd(), libc::SO_RCVBUFFORCE, 32 << 20).context("SO_RCVBUFFORCE")?;
            socks.push(s);
        }
        UdpSinks::spawn(socks, cpu, echo)
    }

    fn spawn(socks: Vec<UdpSocket>, cpu: usize, echo: bool) -> Result<UdpSinks> {
        let fds = socks.iter().map(|s| s.as_raw_fd()).collect();
        let counts: Arc<Vec<AtomicU64>> =
            Arc::new(socks.iter().map(|_| AtomicU64::new(0)).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let (c, st) = (counts.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("pps-sink".into())
            .spawn(move || {
                let _ = pin_current_thread(cpu);
                sink_loop(&socks, &c, &st, echo);
            })
            .context("starting the UDP sink thread")?;
        Ok(UdpSinks {
            fds,
            counts,
            stop,
            thread: Some(thread),
        })
    }

    /// Datagrams received so far, per pod.
    pub fn counts(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }

    pub fn total(&self) -> u64 {
        self.counts().iter().sum()
    }

    /// Bytes waiting in the sockets' receive queues (SO_MEMINFO's
    /// rmem_alloc): datagrams delivered but not counted yet, because the
    /// sink thread has not had the CPU since.
    pub fn queued(&self) -> u64 {
        const SO_MEMINFO: libc::c_int = 55;
        self.fds
            .iter()
            .map(|&fd| {
                let mut info = [0u32; 9];
                let mut len = std::mem::size_of_val(&info) as libc::socklen_t;
                // SAFETY: getsockopt into a buffer of `len` bytes; the
                // descriptor stays open while `self` lives (the thread
                // holding the sockets is joined in drop).
                let rc = unsafe {
                    libc::getsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        SO_MEMINFO,
                        info.as_mut_ptr().cast(),
                        &mut len,
                    )
                };
                if rc == 0 {
                    u64::from(info[0])
                } else {
                    0
                }
            })
            .sum()
    }
}

fn sink_loop(socks: &[UdpSocket], counts: &[AtomicU64], stop: &AtomicBool, echo: bool) {
    let mut bufs = vec![[0u8; 128]; RECV_BATCH];
    // SAFETY: sockaddr_storage is plain data.
    let mut names: Vec<libc::sockaddr_storage> = (0..RECV_BATCH)
        .map(|_| unsafe { std::mem::zeroed() })
        .collect();
    let mut iovs: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: mmsghdr is plain data; zeroed is "no name, no control".
    let mut msgs: Vec<libc::mmsghdr> = (0..RECV_BATCH)
        .map(|_| unsafe { std::mem::zeroed() })
        .collect();
    for ((m, iov), name) in msgs.iter_mut().zip(iovs.iter_mut()).zip(names.iter_mut()) {
        m.msg_hdr.msg_iov = iov;
        m.msg_hdr.msg_iovlen = 1;
        if echo {
            m.msg_hdr.msg_name = (name as *mut libc::sockaddr_storage).cast();
        }
    }
    let name_len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let mut pfds: Vec<libc::pollfd> = socks
        .iter()
        .map(|s| libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    while !stop.load(Ordering::Relaxed) {
        let mut got = 0;
        for (s, count) in socks.iter().zip(counts) {
            loop {
                if echo {
                    for m in msgs.iter_mut() {
                        m.msg_hdr.msg_namelen = name_len;
                    }
                }
                // SAFETY: msgs and their iovecs point into `bufs`, alive and
                // unmoved for the call; the socket is ours.
                let n = unsafe {
                    libc::recvmmsg(
                        s.as_raw_fd(),
                        msgs.as_mut_ptr(),
                        RECV_BATCH as libc::c_uint,
                        libc::MSG_DONTWAIT,
                        std::ptr::null_mut(),
                    )
                };
                if n <= 0 {
                    break;
                }
                count.fetch_add(n as u64, Ordering::Relaxed);
                got += n;
                if echo {
                    echo_back(s.as_raw_fd(), &mut msgs[..n as usize], &mut iovs);
                }
                if (n as usize) < RECV_BATCH {
                    break;
                }
            }
        }
        if got == 0 {
            // SAFETY: poll over descriptors we own.
            unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 20) };
        } else {
            // Traffic is flowing: let a millisecond of it queue up (the
            // buffers hold far more) and take it in full batches, instead
            // of a wakeup and a syscall for every few datagrams on the CPU
            // the sender needs.
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Sends each datagram `msgs` received back to its sender, as it came (a
/// full socket buffer on the way back loses the rest: the client counts
/// the echoes it gets).
fn echo_back(fd: RawFd, msgs: &mut [libc::mmsghdr], iovs: &mut [libc::iovec]) {
    for (m, iov) in msgs.iter_mut().zip(iovs.iter_mut()) {
        iov.iov_len = m.msg_len as usize;
    }
    let mut off = 0;
    while off < msgs.len() {
        // SAFETY: the headers point at the iovecs, buffers and names
        // recvmmsg filled, alive for the call.
        let sent = unsafe {
            libc::sendmmsg(
                fd,
                msgs[off..].as_mut_ptr(),
                (msgs.len() - off) as libc::c_uint,
                0,
            )
        };
        if sent <= 0 {
            break;
        }
        off += sent as usize;
    }
    for iov in iovs.iter_mut() {
        iov.iov_len = 128;
    }
}

impl Drop for UdpSinks {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn set_int_opt(fd: RawFd, opt: libc::c_int, v: libc::c_int) -> io::Result<()> {
    // SAFETY: setsockopt with an int option of the right size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A TCP echo server per pod, one thread each pinned to `cpu`: reads one
/// line, answers `pong NAME\n` and closes.
pub struct TcpEchoes {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl TcpEchoes {
    pub fn start(pods: &[Pod], port: u16, cpu: usize) -> Result<TcpEchoes> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for p in pods {
            let addr = p.addr(port);
            let l = in_netns(p.ns(), || TcpListener::bind(addr))?
                .with_context(|| format!("listening on TCP {addr} in {}", p.ns()))?;
            // SAFETY: listen(2) on a listening socket we own: a backlog
            // deeper than std's 128 for the connection-rate phase.
            if unsafe { libc::listen(l.as_raw_fd(), 4096) } != 0 {
                return Err(io::Error::last_os_error()).context("listen backlog");
            }
            // accept() honours SO_RCVTIMEO: the thread sees `stop` in time.
            set_timeval_opt(l.as_raw_fd(), libc::SO_RCVTIMEO, Duration::from_millis(100))?;
            let reply = format!("pong {}\n", p.name()).into_bytes();
            let st = stop.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("pps-echo".into())
                    .spawn(move || {
                        let _ = pin_current_thread(cpu);
                        while !st.load(Ordering::Relaxed) {
                            if let Ok((c, _)) = l.accept() {
                                let _ = answer(c, &reply);
                            }
                        }
                    })
                    .context("starting an echo thread")?,
            );
        }
        Ok(TcpEchoes { stop, threads })
    }
}

fn answer(mut c: TcpStream, reply: &[u8]) -> io::Result<()> {
    c.set_read_timeout(Some(Duration::from_secs(1)))?;
    let mut buf = [0u8; 64];
    let mut got = 0;
    while got < buf.len() {
        let n = c.read(&mut buf[got..])?;
        if n == 0 {
            break;
        }
        got += n;
        if buf[..got].contains(&b'\n') {
            break;
        }
    }
    // A plain close after the answer (FIN): the client resets its side.
    c.write_all(reply)
}

impl Drop for TcpEchoes {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn set_timeval_opt(fd: RawFd, opt: libc::c_int, d: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: d.as_secs() as libc::time_t,
        tv_usec: d.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: setsockopt with a timeval of the right size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The client

/// `flows` connected UDP sockets in `ns` towards `target`, each on its own
/// source port: the sender's flows.
pub fn udp_flows(ns: &str, target: SocketAddr, flows: usize) -> Result<Vec<UdpSocket>> {
    in_netns(ns, || -> Result<Vec<UdpSocket>> {
        (0..flows)
            .map(|_| {
                let s = UdpSocket::bind("0.0.0.0:0").context("binding a client UDP socket")?;
                s.connect(target)
                    .with_context(|| format!("connecting UDP to {target}"))?;
                set_int_opt(s.as_raw_fd(), libc::SO_SNDBUFFORCE, 4 << 20)
                    .context("SO_SNDBUFFORCE")?;
                Ok(s)
            })
            .collect()
    })?
}

/// What one paced send did.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sent {
    pub packets: u64,
    pub elapsed: Duration,
    /// Times the sender fell more than [`MAX_LAG`] behind its schedule and
    /// skipped ahead instead of bursting to catch up.
    pub resets: u64,
}

impl Sent {
    pub fn rate(&self) -> f64 {
        self.packets as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// How far behind its schedule the sender may fall before it gives up the
/// missed packets: catching up later would be a burst bigger than a
/// backlog queue (1000 packets), lost for burstiness, not for rate.
pub const MAX_LAG: Duration = Duration::from_millis(2);

/// Payload of each datagram: small packets, so the rate is per packet.
pub const PAYLOAD: usize = 64;

/// Sends at `rate` packets/s for `dur` from a thread pinned to `cpu`,
/// round-robin over `socks` in sendmmsg batches.
pub fn send_paced(socks: &[UdpSocket], rate: f64, dur: Duration, cpu: usize) -> Result<Sent> {
    let fds: Vec<RawFd> = socks.iter().map(|s| s.as_raw_fd()).collect();
    std::thread::scope(|s| {
        s.spawn(move || {
            let _ = pin_current_thread(cpu);
            paced_loop(&fds, rate, dur)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the sender thread panicked"))
    })
}

fn paced_loop(fds: &[RawFd], rate: f64, dur: Duration) -> Sent {
    // About 4000 batches a second: pacing smooth enough for a 1000-packet
    // backlog, few enough syscalls at a million packets a second.
    let batch = ((rate / 4000.0) as usize).clamp(1, 64);
    let mut payload = [0x5au8; PAYLOAD];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: PAYLOAD,
    };
    // SAFETY: mmsghdr is plain data; zeroed is "no name, no control".
    let mut msgs: Vec<libc::mmsghdr> = (0..batch).map(|_| unsafe { std::mem::zeroed() }).collect();
    for m in &mut msgs {
        m.msg_hdr.msg_iov = &mut iov;
        m.msg_hdr.msg_iovlen = 1;
    }
    let interval = Duration::from_secs_f64(batch as f64 / rate);
    let start = Instant::now();
    let end = start + dur;
    let mut next = start;
    let mut out = Sent::default();
    let mut k = 0usize;
    while next < end {
        let now = Instant::now();
        if now < next {
            let wait = next - now;
            if wait > Duration::from_micros(80) {
                std::thread::sleep(wait - Duration::from_micros(50));
            }
            while Instant::now() < next {
                std::hint::spin_loop();
            }
        } else if now - next > MAX_LAG {
            out.resets += 1;
            next = now;
        }
        let fd = fds[k % fds.len()];
        k += 1;
        // SAFETY: every header points at `iov`, which points at `payload`;
        // both outlive the call. The socket is connected: no address.
        let n = unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr(), batch as libc::c_uint, 0) };
        if n > 0 {
            out.packets += n as u64;
        }
        next += interval;
    }
    out.elapsed = start.elapsed();
    out
}

/// One request over a fresh connection: connect, send a line, read the
/// answer, then reset (no TIME_WAIT, so ports recycle at high rates).
pub fn tcp_request(target: SocketAddr) -> io::Result<Duration> {
    let t = Instant::now();
    let mut c = TcpStream::connect_timeout(&target, Duration::from_secs(1))?;
    c.set_nodelay(true)?;
    c.set_read_timeout(Some(Duration::from_secs(1)))?;
    c.write_all(b"ping\n")?;
    let mut buf = [0u8; 64];
    let mut got = 0;
    loop {
        let n = c.read(&mut buf[got..])?;
        if n == 0 || buf[..got + n].contains(&b'\n') {
            got += n;
            break;
        }
        got += n;
        if got == buf.len() {
            break;
        }
    }
    if !buf[..got].starts_with(b"pong ") {
        return Err(io::Error::other("no answer"));
    }
    let d = t.elapsed();
    crate::connect::probe::abort(c);
    Ok(d)
}

/// Request latency: one thread in `ns` pinned to `cpu`, one request after
/// the other, `count` of them or until `limit`: (samples, failures).
pub fn tcp_latency(
    ns: &str,
    target: SocketAddr,
    count: usize,
    limit: Duration,
    cpu: usize,
) -> Result<(Vec<Duration>, u64)> {
    Ok(in_netns(ns, move || {
        let _ = pin_current_thread(cpu);
        let end = Instant::now() + limit;
        let (mut ok, mut fail) = (Vec::with_capacity(count), 0);
        while ok.len() < count && Instant::now() < end && !interrupted() {
            match tcp_request(target) {
                Ok(d) => ok.push(d),
                Err(_) => fail += 1,
            }
        }
        (ok, fail)
    })?)
}

/// New connections per second: `threads` client threads in `ns`, all
/// pinned to `cpu`, each making requests over fresh connections for `dur`:
/// (completed, failed, elapsed).
pub fn tcp_rate(
    ns: &str,
    target: SocketAddr,
    threads: usize,
    dur: Duration,
    cpu: usize,
) -> Result<(u64, u64, Duration)> {
    let t0 = Instant::now();
    let results: Vec<Result<(u64, u64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || -> Result<(u64, u64)> {
                    Ok(in_netns(ns, move || {
                        let _ = pin_current_thread(cpu);
                        let end = t0 + dur;
                        let (mut ok, mut fail) = (0u64, 0u64);
                        while Instant::now() < end && !interrupted() {
                            match tcp_request(target) {
                                Ok(_) => ok += 1,
                                Err(_) => fail += 1,
                            }
                        }
                        (ok, fail)
                    })?)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a client thread panicked"))?
            })
            .collect()
    });
    let elapsed = t0.elapsed();
    let (mut ok, mut fail) = (0, 0);
    for r in results {
        let (o, f) = r?;
        ok += o;
        fail += f;
    }
    Ok((ok, fail, elapsed))
}

/// The line of a failed proxy's log that says why: the first naming an
/// error, else its last line.
pub fn error_line(log: &str) -> String {
    let lines: Vec<&str> = log
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines
        .iter()
        .find(|l| {
            // klog's error lines start "E" and the date (E0101 ...).
            let klog = l.starts_with('E')
                && l.get(1..5)
                    .is_some_and(|d| d.chars().all(|c| c.is_ascii_digit()));
            let lower = l.to_ascii_lowercase();
            klog || lower.starts_with("error") || lower.contains("error:")
        })
        .or(lines.last())
        .map(|l| l.chars().take(240).collect())
        .unwrap_or_else(|| "(empty log)".to_string())
}

/// `n` with thousands separated by commas.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defines_and_builtins() {
        let c = parse_define("x=ours:nftables:--socket-lb --bpf-lb-algorithm maglev").unwrap();
        assert_eq!(c.binary, Binary::Ours);
        assert_eq!(c.mode, "nftables");
        assert_eq!(c.args, ["--socket-lb", "--bpf-lb-algorithm", "maglev"]);
        assert!(wants_bpf(&c.args));
        assert!(parse_define("x=other:nftables").is_err());
        assert!(parse_define("x=ours").is_err());
        let old = parse_define("old=ours@/tmp/kp-old:nftables:--socket-lb").unwrap();
        assert_eq!(
            (old.binary, old.path.as_deref()),
            (Binary::Ours, Some(std::path::Path::new("/tmp/kp-old")))
        );
        assert!(parse_define("x=upstream@/tmp/x:nftables").is_err());
        assert!(parse_define("x=ours@:nftables").is_err());
        let names: Vec<String> = builtin_configs().into_iter().map(|c| c.name).collect();
        for n in [
            "upstream-nftables",
            "upstream-iptables",
            "ours-nftables",
            "ours-tc",
            "ours-xdp",
            "floor",
        ] {
            assert!(names.iter().any(|x| x == n), "{n}");
        }
        let floor = builtin_configs().into_iter().find(|c| c.name == "floor");
        assert_eq!(floor.map(|c| c.binary), Some(Binary::NoProxy));
        assert!(!Binary::NoProxy.upstream() && Binary::UpstreamLegacy.upstream());
        assert_eq!(
            parse_define("f=none:none").map(|c| c.binary).ok(),
            Some(Binary::NoProxy)
        );
    }

    #[test]
    fn error_lines() {
        let clap =
            "error: unexpected argument '--bpf-nodeport' found\n\nUsage: kube-proxy-rs [OPTIONS]\n";
        assert_eq!(
            error_line(clap),
            "error: unexpected argument '--bpf-nodeport' found"
        );
        let klog = "I0101 00:00:00.000 1 server.go:1] starting\nE0101 00:00:01.000 1 run.go:72] \"command failed\" err=\"unknown flag: --bpf-nodeport\"\n";
        assert!(error_line(klog).contains("unknown flag"));
        assert_eq!(error_line("a\nb\n"), "b");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(thousands(999), "999");
    }
}
