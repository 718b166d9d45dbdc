//! `kp-bench pps`: NodePort packet rate, upstream kube-proxy and kube-proxy-rs in
//! one run: how many packets a second a node forwards from an outside
//! client to endpoint pods through a NodePort without loss, what each costs
//! the node's CPU, and the new TCP connections per second and request
//! latency through the same NodePort (issue 54).
//!
//! The lab is `kp-bench compare`'s (etcd + kube-apiserver v1.36 in a namespace of
//! its own, `Lab`) with one node namespace per proxy configuration, and
//! the lab's external client namespace on the LAN bridge:
//!
//! ```text
//!  client ns (10.100.0.100)  --veth-- lan ns (bridge) --veth-- node K eth0 (10.100.0.1K)
//!    sender + TCP clients, CPU 0            CPU 0          |  proxy K, softirq on CPU 1 (RPS)
//!                                                          +--veth-- 4 pod namespaces on node K
//!                                                                    UDP sink + TCP echo, CPU 0
//! ```
//!
//! One NodePort Service `pps` (externalTrafficPolicy Cluster, UDP port
//! 9000 -> nodePort 59990, TCP port 9001 -> nodePort 59991) has the pods of
//! the node being measured as its endpoints; with `--services N` the other
//! N-1 Services are kp-bench's mix (x10 endpoints), written into etcd
//! (`Lab::populate_etcd`), so each proxy holds N Services. The proxies run
//! one after another, each on its own fresh node namespace (nothing to
//! clean between them), the slice pointed at that node's pods before it
//! starts; the order is reversed for every other Service count.
//!
//! For each configuration, once UDP and TCP pass through its NodePort:
//!
//! * UDP from `--flows` source ports (connected sockets, sendmmsg) to
//!   nodeIP:59990 from a thread pinned to CPU 0, paced, `--duration`
//!   seconds a step, from `--start-rate` up by `--step` until a step
//!   loses more than `--loss` (0.1%) of what it sent (loss = 1 - received
//!   / sent, counted by recvmmsg in the pods); a lossy step, or one where
//!   the sender fell short of the rate and gained nothing on the step
//!   before (CPU 0 full), is repeated once (twice per configuration at
//!   most) before it counts. The figure: the highest rate a lossless step
//!   actually sent.
//! * Node CPU per packet at that step: CPU 1's softirq time (/proc/stat,
//!   tick-sampled at HZ) over the packets sent, and CPU 1's and CPU 0's
//!   busy share; with tc/XDP programs attached in the node, their run time
//!   per run and runs per packet (`bpftool prog show`, with the kernel's
//!   BPF statistics enabled through BPF_ENABLE_STATS only while measuring).
//! * TCP: `--requests` requests over a fresh connection each, one after
//!   the other (p50/p99 of connect + request + answer), then
//!   `--tcp-threads` client threads for `--duration` (new connections per
//!   second). All client and pod threads run on CPU 0; the proxy is pinned
//!   to CPU 1 once it serves.
//!
//! `--endpoints remote` puts the endpoints on a node of their own (one
//! more node namespace, no proxy, its pods' sinks and echoes on CPU 0):
//! the measured node then forwards each request back out of the eth0 it
//! came in by and each reply the same way, which is what XDP can take (a
//! veth wakes its peer for XDP_TX frames only while the peer runs an XDP
//! program: the LAN ports get one that passes everything; and XDP takes
//! checksums to be complete, as a NIC's frames are: the client and the
//! endpoints turn their veth's checksum offload off, `ethtool`). There the LAN bridge's forwarding of the frames
//! the client and the endpoints' node send runs on CPU 1 as well (rps_cpus
//! 2 on those two ports), since native XDP on a veth runs where the frame
//! was sent into it: the bridge's cost is in every row alike.
//!
//! RPS puts the node's receive processing on CPU 1: `rps_cpus` is 2 on the
//! node namespaces' devices, 1 on the pods', the client's and the LAN
//! bridge's; each step prints NET_RX softirqs per CPU so that the split
//! can be checked. Nothing outside the lab's namespaces is changed (the
//! BPF statistics are machine-wide, and go off when their descriptor
//! closes, whatever ends the bench).
//!
//! `--fixed-rate R`: after its climb, every row sends at R for `--repeats`
//! more steps, and a table of their own gives CPU 1's softirq and busy
//! time per packet (medians and the softirq's range: the ticks are
//! sampled at HZ), and what each row adds to the `floor` row's.
//!
//! `--in-place` (inplace.rs, issue 64 item 3(b)): no climb and no TCP;
//! every row alive at once on its own node with its own NodePort Service,
//! the pods echoing each datagram, the node CPU's NET_RX time summed
//! exactly from the softirq_entry/exit tracepoints (bpf.rs `NetRxClock`,
//! attached only while the steps run), rows alternated in order then
//! reversed for `--rounds`, steps with steal, backlog stalls or a short
//! sender dropped and counted, and paired differences per round against
//! upstream-nftables, ours-nftables, null-tc and floor.
//!
//! Configurations (parts.rs, `builtin_configs`): upstream-nftables,
//! upstream-iptables (the host's iptables: iptables-nft here),
//! upstream-iptables-legacy, ours-nftables, ours-iptables,
//! ours-iptables-legacy, ours-tc (`--socket-lb --bpf-nodeport`), ours-xdp
//! (ours-tc plus `--bpf-lb-acceleration native`), and `floor`: no proxy,
//! the client sending to the pods' own addresses through the node (a route
//! of the client's via that node while the row runs), so that the node
//! forwards with no NAT and no conntrack: what the veths, the bridge and
//! routing cost every row, and where the client's CPU ends the climb;
//! `null-tc` is the floor with a tc program that returns TC_ACT_OK at once
//! on every interface of the node but lo (bpf.rs `NullTc`). Its
//! TCP requests go to one pod, and with `--endpoints remote` the pod's
//! answers go to the client straight from the endpoints' node (no SNAT
//! brings them back through the measured node). `--extra-args
//! 'ours-xdp=--bpf-lb-algorithm maglev'` appends flags to one;
//! `--define 'NAME=ours:nftables:--socket-lb ...'` adds one (BINARY: ours,
//! upstream, upstream-legacy, none, or `ours@PATH`: another build of ours,
//! to compare two builds in one run). A configuration that asks for BPF gets a
//! cgroup and a bpffs of the bench's own (`--cgroup-path`,
//! `--bpf-pin-path`). One whose proxy exits, or whose NodePort passes
//! nothing within `--first-sync-within`, is reported "not available" with
//! the proxy's error line. `--upstream` defaults to ../shared/k8s's
//! kube-proxy (unpacked into target/k8s-bin), `--binary` to the
//! kube-proxy-rs beside kp-bench. `--write` replaces the text between the
//! `kp-pps` markers of that file (`kp-pps remote` with `--endpoints
//! remote`; `kp-pps NAME` with `--section NAME`, for a run of another
//! shape beside those).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::lab::{
    check_binary, date_utc, load_average, quantile, write_into, Lab, Populated, ProxyCommand,
};
use anyhow::{bail, Context, Result};
use kp_netlab::{in_netns, Pod};
use kp_testkit::ControlPlaneOpts;
use kube::api::{Patch, PatchParams};
use parts::{
    backlog_drops_per_cpu, bpf_programs, bpf_runs, check_interrupted, deltas, error_line,
    net_rx_per_cpu, node_programs, pin_process, send_paced, set_rps, sleep_checked, tcp_latency,
    tcp_rate, tcp_request, thousands, udp_flows, udp_rcvbuf_errors, Binary, BpfStats, CpuTimes,
    ProxyConfig, Sent, TcpEchoes, UdpSinks,
};
use serde_json::json;

pub mod bpf;
mod inplace;
pub mod parts;

const CLIENT_CPU: usize = 0;
const NODE_CPU: usize = 1;
const UDP_PORT: u16 = 9000;
const TCP_PORT: u16 = 9001;
const UDP_NODE_PORT: u16 = 59990;
const TCP_NODE_PORT: u16 = 59991;
/// Above every ClusterIP of kp-bench's mix at 100k (10.96.0.10 + i).
const CLUSTER_IP: &str = "10.97.250.1";
/// The most steps of one configuration, whatever the rates say.
const MAX_STEPS: usize = 40;
/// Lossy steps repeated per configuration (a neighbour's burst on a shared
/// machine should not end the climb).
const RETRIES: usize = 2;

struct Opts {
    binary: PathBuf,
    upstream: Option<PathBuf>,
    sizes: Vec<u32>,
    configs: Vec<ProxyConfig>,
    duration: Duration,
    start_rate: f64,
    step: f64,
    max_rate: f64,
    flows: usize,
    pods: usize,
    /// `--endpoints remote`: the pods on a node of their own.
    remote: bool,
    tcp_threads: usize,
    requests: usize,
    loss: f64,
    first_sync_within: Duration,
    time_limit: Duration,
    write: Option<PathBuf>,
    section: Option<String>,
    command: String,
    /// `--fixed-rate R`: after the climb, `repeats` steps at R for every
    /// row.
    fixed_rate: Option<f64>,
    repeats: usize,
    /// `--in-place`: every row alive at once, echoes, NET_RX from the
    /// softirq tracepoints, rows alternated `rounds` times (inplace.rs).
    in_place: bool,
    rounds: usize,
    /// `--in-place`: rounds more, BPF run-time statistics on, for the
    /// programs' own time per run in place.
    stats_rounds: usize,
    /// `--in-place --pod-rx-on-node`: the pods' receive processing on the
    /// node's CPU (RPS), not the client's.
    pod_rx_on_node: bool,
}

/// A positive, finite number.
fn positive(v: &str) -> Result<f64, String> {
    v.parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && *x > 0.0)
        .ok_or_else(|| format!("a positive number, not {v:?}"))
}

/// Where the endpoint pods run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoints {
    /// On the measured node.
    Local,
    /// On a node of their own (one more node namespace, no proxy): the
    /// measured node forwards each request and reply back out of the eth0
    /// it came in by, which is what XDP can take.
    Remote,
}

/// `kp-bench pps`.
#[derive(clap::Args, Debug, Clone)]
pub struct PpsArgs {
    /// Our binary (build first: cargo build --release -p kube-proxy-rs -p
    /// kp-bench).
    #[arg(long = "binary", alias = "ours", value_name = "PATH", default_value_os_t = crate::lab::beside_bench())]
    binary: PathBuf,
    /// Upstream's kube-proxy [default: ../shared/k8s's, unpacked into
    /// target/k8s-bin].
    #[arg(long, value_name = "PATH")]
    upstream: Option<PathBuf>,
    /// Service counts, comma-separated (1 to 100000): the NodePort Service
    /// and N-1 of kp-bench's mix written into etcd; the proxies' order is
    /// reversed for every other count.
    #[arg(
        long = "services",
        alias = "sizes",
        value_name = "N,N",
        value_delimiter = ',',
        default_value = "1,10000"
    )]
    services: Vec<u32>,
    /// The configurations to measure, comma-separated, one after the other:
    /// upstream-nftables, upstream-iptables, upstream-iptables-legacy,
    /// ours-nftables, ours-iptables, ours-iptables-legacy, ours-tc, ours-xdp,
    /// floor (no proxy: forwarding alone), null-tc (the floor with a tc
    /// program that returns TC_ACT_OK at once where ours attaches), or one
    /// --define names [default: upstream-nftables,upstream-iptables-legacy,
    /// ours-nftables; with --in-place:
    /// ours-tc,ours-xdp,ours-nftables,upstream-nftables,null-tc,floor].
    #[arg(long, value_name = "NAMES")]
    proxies: Option<String>,
    /// NAME=FLAGS: appends flags to configuration NAME (e.g.
    /// 'ours-xdp=--bpf-lb-algorithm maglev'); repeatable.
    #[arg(long, value_name = "NAME=FLAGS")]
    extra_args: Vec<String>,
    /// NAME=BINARY:MODE[:FLAGS]: defines (or redefines) a configuration;
    /// BINARY is ours, upstream, upstream-legacy, none, or ours@PATH (another
    /// build of ours, to compare two builds in one run); repeatable.
    #[arg(long, value_name = "NAME=BINARY:MODE[:FLAGS]")]
    define: Vec<String>,
    /// Seconds a step of the climb sends (at most 30).
    #[arg(long, value_name = "SECS", default_value = "3", value_parser = positive)]
    duration: f64,
    /// Datagrams a second of the first step.
    #[arg(long, value_name = "RATE", default_value = "50000", value_parser = positive)]
    start_rate: f64,
    /// Factor from one step's rate to the next (1.01 to 4).
    #[arg(long, default_value = "1.25", value_parser = positive)]
    step: f64,
    /// The climb stops at this rate (at most 20M).
    #[arg(long, value_name = "RATE", default_value = "2000000", value_parser = positive)]
    max_rate: f64,
    /// UDP source ports (connected sockets, sendmmsg), 1 to 4096.
    #[arg(long, default_value = "256", value_parser = positive)]
    flows: f64,
    /// Endpoint pods (1 to 16), each with a UDP sink and a TCP echo.
    #[arg(long, default_value = "4", value_parser = positive)]
    pods: f64,
    /// Where the endpoint pods run.
    #[arg(long, value_enum, default_value_t = Endpoints::Local)]
    endpoints: Endpoints,
    /// TCP client threads for the connections-per-second figure (1 to 64).
    #[arg(long, default_value = "4", value_parser = positive)]
    tcp_threads: f64,
    /// Requests over a fresh connection each, one after the other, for the
    /// latency figure.
    #[arg(long, default_value = "2000", value_parser = positive)]
    requests: f64,
    /// The share of datagrams a step may lose and still count (at most 0.5).
    #[arg(long, default_value = "0.001", value_parser = positive)]
    loss: f64,
    /// Seconds a configuration's NodePort has to pass traffic before it is
    /// reported "not available".
    #[arg(long, value_name = "SECS", default_value = "300", value_parser = positive)]
    first_sync_within: f64,
    /// Seconds for the whole run: Service counts not started by then are
    /// left out.
    #[arg(long, value_name = "SECS", default_value = "3600", value_parser = positive)]
    time_limit: f64,
    /// After its climb, every row sends at R for --repeats more steps, and a
    /// table of their own gives CPU 1's softirq and busy time per packet and
    /// what each row adds to the floor row's.
    #[arg(long, value_name = "R", value_parser = positive)]
    fixed_rate: Option<f64>,
    /// Steps at --fixed-rate (1 to 100).
    #[arg(long, default_value = "8", value_parser = positive)]
    repeats: f64,
    /// The in-place measurement (issue 64 item 3(b)): every configuration
    /// alive at once on its own node, the pods echoing every datagram, the
    /// node CPU's NET_RX time summed from the softirq_entry/exit tracepoints
    /// (BPF programs attached only while measuring), the rows alternated
    /// (in order, then reversed) for --rounds rounds of one --duration step
    /// each at --fixed-rate (default 30000), steps with steal or backlog
    /// stalls dropped and counted, and the paired differences against
    /// upstream-nftables, ours-nftables, null-tc and floor. No climb, no TCP.
    #[arg(long)]
    in_place: bool,
    /// Rounds of --in-place (1 to 100).
    #[arg(long, default_value = "8", value_parser = positive)]
    rounds: f64,
    /// With --in-place: rounds after --rounds, of the rows with BPF programs only,
    /// with the kernel's BPF run-time statistics on (BPF_ENABLE_STATS, only
    /// for them: the statistics' clock reads would be in the NET_RX time):
    /// each packet program's runs per request and ns per run in place
    /// (0 to 100; 0: none).
    #[arg(long, default_value = "4", value_parser = clap::value_parser!(u8).range(0..=100))]
    stats_rounds: u8,
    /// With --in-place: the pods' receive processing (RPS on their eth0) on CPU
    /// 1 with the node's, so that CPU 1 is all the node does for a request
    /// and its echo but the echo's user-space copy, and CPU 0 the client's
    /// and the LAN bridge's alone [default: the pods' on CPU 0].
    #[arg(long, requires = "in_place")]
    pod_rx_on_node: bool,
    /// Replaces the text between the `kp-pps` markers of FILE (`kp-pps
    /// remote` with --endpoints remote, `kp-pps NAME` with --section NAME).
    #[arg(long, value_name = "FILE")]
    write: Option<PathBuf>,
    /// The markers' name for a run of another shape (letters, digits, '-').
    #[arg(long, value_name = "NAME", requires = "write")]
    section: Option<String>,
}

fn parse_opts(a: PpsArgs) -> Result<Opts> {
    if a.services.iter().any(|&n| n == 0 || n > 100_000) {
        bail!("--services: counts from 1 to 100000");
    }
    if let Some(v) = &a.section {
        if v.is_empty() || !v.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            bail!("--section: letters, digits and '-', not {v:?}");
        }
    }
    let mut o = Opts {
        binary: a.binary,
        upstream: a.upstream,
        sizes: a.services,
        configs: Vec::new(),
        duration: Duration::from_secs_f64(a.duration.min(30.0)),
        start_rate: a.start_rate,
        step: a.step.clamp(1.01, 4.0),
        max_rate: a.max_rate.min(20e6),
        flows: (a.flows as usize).clamp(1, 4096),
        pods: (a.pods as usize).clamp(1, 16),
        remote: a.endpoints == Endpoints::Remote,
        tcp_threads: (a.tcp_threads as usize).clamp(1, 64),
        requests: (a.requests as usize).min(1_000_000),
        loss: a.loss.min(0.5),
        first_sync_within: Duration::from_secs_f64(a.first_sync_within),
        time_limit: Duration::from_secs_f64(a.time_limit),
        write: a.write,
        section: a.section,
        command: String::new(),
        fixed_rate: a.fixed_rate.map(|r| r.min(20e6)),
        repeats: (a.repeats as usize).clamp(1, 100),
        in_place: a.in_place,
        rounds: (a.rounds as usize).clamp(1, 100),
        stats_rounds: usize::from(a.stats_rounds),
        pod_rx_on_node: a.pod_rx_on_node,
    };
    if o.in_place && o.remote {
        bail!("--in-place puts the endpoints on each row's node: no --endpoints remote");
    }
    let mut known = parts::builtin_configs();
    let wanted = a.proxies.unwrap_or_else(|| {
        if a.in_place {
            "ours-tc,ours-xdp,ours-nftables,upstream-nftables,null-tc,floor".into()
        } else {
            "upstream-nftables,upstream-iptables-legacy,ours-nftables".into()
        }
    });
    for v in &a.define {
        let c = parts::parse_define(v)?;
        known.retain(|k| k.name != c.name);
        known.push(c);
    }
    let mut extra: Vec<(String, String)> = Vec::new();
    for v in &a.extra_args {
        let (name, flags) = v
            .split_once('=')
            .with_context(|| format!("--extra-args {v:?}: NAME=FLAGS"))?;
        extra.push((name.to_string(), flags.to_string()));
    }
    // The command the table quotes: this one, as given.
    let mut shown = vec!["kp-bench".to_string()];
    shown.extend(std::env::args().skip(1).map(
        |v| {
            if v.contains(' ') {
                format!("'{v}'")
            } else {
                v
            }
        },
    ));
    for name in wanted.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let c = known.iter().find(|k| k.name == name).with_context(|| {
            let names: Vec<&str> = known.iter().map(|k| k.name.as_str()).collect();
            format!(
                "--proxies: no configuration {name:?} (known: {})",
                names.join(", ")
            )
        })?;
        if o.configs.iter().any(|x: &ProxyConfig| x.name == name) {
            bail!("--proxies names {name} twice");
        }
        o.configs.push(c.clone());
    }
    for (name, flags) in extra {
        let c = o
            .configs
            .iter_mut()
            .find(|c| c.name == name)
            .with_context(|| format!("--extra-args {name}: not among --proxies"))?;
        c.args.extend(flags.split_whitespace().map(str::to_string));
    }
    if o.configs.is_empty() {
        bail!("--proxies names no configuration");
    }
    o.command = shown.join(" ");
    Ok(o)
}

/// Where a configuration's climb stopped.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stop {
    /// The next step lost more than the threshold.
    Loss,
    /// The sender could not offer the step's rate (CPU 0 is full).
    Client,
    MaxRate,
    TimeLimit,
    Steps,
}

struct Step {
    offered: f64,
    sent: Sent,
    received: u64,
    per_pod: Vec<u64>,
    softirq_ns: [f64; 2],
    busy: [f64; 2],
    net_rx: Vec<u64>,
    backlog_drops: Vec<u64>,
    rcvbuf_errors: u64,
    bpf: (u64, u64),
}

impl Step {
    fn loss(&self) -> f64 {
        if self.sent.packets == 0 {
            return 1.0;
        }
        1.0 - self.received as f64 / self.sent.packets as f64
    }
}

struct Figures {
    ready: Duration,
    top: Option<Step>,
    stopped_at: Option<Step>,
    stop: Stop,
    programs: Vec<String>,
    latency: Vec<Duration>,
    latency_failed: u64,
    conns: (u64, u64, Duration),
    /// `--fixed-rate` steps.
    fixed: Vec<Step>,
}

enum Outcome {
    Measured(Box<Figures>),
    NotAvailable(String),
    NotMeasured(String),
}

/// The service CIDR and NodePort range of `compare --only-ours`, wide
/// enough for kp-bench's mix at 100k (its ClusterIPs run past 10.96/16,
/// its NodePorts past 32767); the same for every size, so every size's
/// lab is alike.
fn wide_ranges(o: &mut ControlPlaneOpts) {
    o.service_cidrs = "10.96.0.0/15,fd00:96::/108".into();
    o.node_port_range = "30000-59999".into();
}

/// A directory of `iptables*` links to xtables-legacy-multi (it picks its
/// command by the name it is called by).
fn legacy_shim(dir: &std::path::Path) -> Result<String> {
    let multi = [
        "/usr/sbin/xtables-legacy-multi",
        "/sbin/xtables-legacy-multi",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .context("xtables-legacy-multi not found (Debian: apt-get install iptables)")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for name in [
        "iptables",
        "iptables-save",
        "iptables-restore",
        "ip6tables",
        "ip6tables-save",
        "ip6tables-restore",
    ] {
        let link = dir.join(name);
        if !link.exists() {
            std::os::unix::fs::symlink(multi, &link)
                .with_context(|| format!("linking {}", link.display()))?;
        }
    }
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    Ok(format!("PATH={}:{path}", dir.display()))
}

fn endpoints(pods: &[Pod]) -> serde_json::Value {
    json!(pods
        .iter()
        .map(|p| json!({"addresses": [p.ip().to_string()],
            "nodeName": format!("node{}", p.node()), "conditions": {"ready": true}}))
        .collect::<Vec<_>>())
}

/// Waits for the sinks' total to pass `before` (at most `within`).
fn arrived(sinks: &UdpSinks, before: u64, within: Duration) -> bool {
    kp_netlab::wait_until(within, Duration::from_millis(10), || sinks.total() > before)
}

/// Waits until every datagram delivered to the pods is counted: the
/// sockets' queues empty and the counts holding still (at most 5 s; on a
/// busy machine the sink thread can wait for CPU 0 that long, and an
/// unread datagram is not a lost one).
fn settled_counts(sinks: &UdpSinks) -> Vec<u64> {
    let mut last = sinks.counts();
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(50));
        let now = sinks.counts();
        if now == last && sinks.queued() == 0 {
            break;
        }
        last = now;
    }
    last
}

/// The client's routes to pods' addresses through one node, for the
/// floor row; deleted again when it drops (the other rows' clients send
/// to node addresses only, but their lab is the same).
struct ClientRoutes<'a> {
    lab: &'a Lab,
    dests: Vec<String>,
}

impl<'a> ClientRoutes<'a> {
    fn via(lab: &'a Lab, pods: &[Pod], node: usize) -> Result<ClientRoutes<'a>> {
        let nodes: BTreeSet<usize> = pods.iter().map(|p| p.node()).collect();
        let mut routes = ClientRoutes {
            lab,
            dests: Vec::new(),
        };
        // The node forwards back out of the eth0 the packets came in by, to
        // a next hop on the client's own link: it sends ICMP redirects, and
        // a client that took them would send to the endpoints' node
        // directly, past the node measured. (The proxies' rows are
        // translated before routing; the client never sends to the
        // addresses those redirects name.)
        for key in [
            "net.ipv4.conf.all.accept_redirects",
            "net.ipv4.conf.eth0.accept_redirects",
        ] {
            lab.cluster
                .exec_ok(
                    lab.cluster.client_ns(),
                    &["sysctl", "-qw", &format!("{key}=0")],
                )
                .with_context(|| format!("{key}=0 in the client"))?;
        }
        for n in nodes {
            let cidr = lab.cluster.pod_cidr(n);
            lab.cluster
                .client_route_via(cidr, node)
                .with_context(|| format!("a route to {cidr} via node{node} in the client"))?;
            routes.dests.push(cidr.to_string());
        }
        Ok(routes)
    }
}

impl Drop for ClientRoutes<'_> {
    fn drop(&mut self) {
        for d in &self.dests {
            let _ = self
                .lab
                .cluster
                .exec(self.lab.cluster.client_ns(), &["ip", "route", "del", d]);
        }
    }
}

struct Ctx<'a> {
    o: &'a Opts,
    lab: &'a Lab,
    deadline: Instant,
    n: u32,
}

fn measure_config(
    cx: &Ctx<'_>,
    cfg: &ProxyConfig,
    node: usize,
    pods: &[Pod],
    shim: &Option<String>,
) -> Result<Outcome> {
    let (o, lab) = (cx.o, cx.lab);
    if Instant::now() > cx.deadline {
        return Ok(Outcome::NotMeasured(
            "the run's --time-limit was reached".into(),
        ));
    }
    eprintln!("  {}: node{node}", cfg.name);
    // The Service's endpoints: this node's pods (eTP=Cluster would spread
    // over every node's pods otherwise).
    lab.rt.block_on(lab.slices().patch(
        "pps-x",
        &PatchParams::default(),
        &Patch::Merge(json!({"endpoints": endpoints(pods)})),
    ))?;
    let sinks = UdpSinks::start(pods, UDP_PORT, CLIENT_CPU)?;
    let _echoes = TcpEchoes::start(pods, TCP_PORT, CLIENT_CPU)?;

    let mut args = cfg.args.clone();
    // Dropped after the proxy (declared first): unmounting the bpffs
    // releases the pinned links and maps.
    let mut bpf_dirs = None;
    if parts::wants_bpf(&args) {
        let cg = kp_netlab::TestCgroup::new()?;
        let fs = kp_netlab::TestBpffs::new()?;
        args.push(format!("--cgroup-path={}", cg.path().display()));
        args.push(format!("--bpf-pin-path={}", fs.path().display()));
        bpf_dirs = Some((cg, fs));
    }
    let env: Vec<String> = match cfg.binary {
        Binary::UpstreamLegacy => vec![shim.clone().context("no iptables-legacy PATH")?],
        _ => Vec::new(),
    };
    let before = bpf_programs();
    let cmd = ProxyCommand {
        mode: &cfg.mode,
        upstream: cfg.binary.upstream(),
        ours: cfg.path.as_deref().unwrap_or(&o.binary),
        extra: &args,
        env: &env,
    };
    let label = format!("{}-{}", cfg.name, cx.n);
    let t0 = Instant::now();
    let client = lab.cluster.client_ns().to_string();
    let node_ip: IpAddr = lab.cluster.node_ip(node);
    // The floor row has no proxy: the client sends to the pods' own
    // addresses through this node (its routes to them taken out again
    // when the row ends).
    let floor = cfg.binary.proxyless();
    let _null_tc = if cfg.binary == Binary::NullTc {
        Some(bpf::NullTc::attach(lab.cluster.node_ns(node))?)
    } else {
        None
    };
    let (proxy, _routes, udp_targets, tcp_target) = if floor {
        let routes = ClientRoutes::via(lab, pods, node)?;
        (
            None,
            Some(routes),
            pods.iter()
                .map(|p| SocketAddr::new(p.ip(), UDP_PORT))
                .collect::<Vec<_>>(),
            SocketAddr::new(pods[0].ip(), TCP_PORT),
        )
    } else {
        (
            Some(lab.spawn_proxy_with(node, &cmd, &label)?),
            None,
            vec![SocketAddr::new(node_ip, UDP_NODE_PORT)],
            SocketAddr::new(node_ip, TCP_NODE_PORT),
        )
    };
    let probe = udp_flows(&client, udp_targets[0], 1)?;
    let mut synced_once = false;
    loop {
        check_interrupted()?;
        if let Some(proxy) = proxy.as_ref().filter(|p| !p.guard.is_running()) {
            std::thread::sleep(Duration::from_millis(100));
            return Ok(Outcome::NotAvailable(error_line(
                &proxy.guard.log_contents(),
            )));
        }
        if t0.elapsed() > o.first_sync_within {
            let Some(proxy) = &proxy else {
                return Ok(Outcome::NotAvailable(format!(
                    "nothing passed to the pods' addresses within {:.0} s",
                    o.first_sync_within.as_secs_f64()
                )));
            };
            // A proxy still running has logged no fatal error: its last
            // line says where it is.
            let log = proxy.guard.log_contents();
            let last = log
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            let what = if synced_once {
                "synced, but nothing passed the NodePort"
            } else {
                "no first sync"
            };
            return Ok(Outcome::NotAvailable(format!(
                "{what} within {:.0} s of the proxy's start; its log's last line: {}",
                o.first_sync_within.as_secs_f64(),
                last.trim().chars().take(200).collect::<String>()
            )));
        }
        let synced = proxy.as_ref().is_none_or(|p| {
            p.samples("kubeproxy_sync_proxy_rules_duration_seconds_count")
                .iter()
                .sum::<f64>()
                >= 1.0
        });
        synced_once |= synced;
        if synced {
            let before = sinks.total();
            let _ = probe.first().map(|s| s.send(b"probe"));
            let udp = arrived(&sinks, before, Duration::from_millis(300));
            let tcp = udp && in_netns(&client, || tcp_request(tcp_target).is_ok())?;
            if udp && tcp {
                break;
            }
        }
        sleep_checked(Duration::from_millis(250))?;
    }
    let ready = t0.elapsed();
    let mut ids = BTreeSet::new();
    if let Some(proxy) = &proxy {
        eprintln!(
            "    serving through the NodePort {:.1} s after its start",
            ready.as_secs_f64()
        );
        // From now on whatever the proxy does is the node's work: CPU 1.
        pin_process(proxy.guard.pid(), NODE_CPU)?;
        sleep_checked(Duration::from_secs(3))?;
        ids = node_programs(
            &lab.cluster,
            lab.cluster.node_ns(node),
            &before,
            proxy.guard.pid(),
        );
    }
    let all = bpf_programs();
    let programs: Vec<String> = ids
        .iter()
        .map(|id| {
            all.get(id).map_or(format!("{id}"), |p| {
                format!("{} {} ({})", id, p.name, p.kind)
            })
        })
        .collect();
    let _stats = if ids.is_empty() {
        None
    } else {
        eprintln!(
            "    BPF run-time statistics enabled (BPF_ENABLE_STATS, machine-wide) while {} is measured; programs {}",
            cfg.name,
            programs.join(", ")
        );
        Some(BpfStats::enable()?)
    };

    // UDP: the climb.
    // The flows spread over the targets (the pods, for the floor row).
    let mut flows = Vec::with_capacity(o.flows);
    for (k, t) in udp_targets.iter().enumerate() {
        let share = o.flows / udp_targets.len() + usize::from(k < o.flows % udp_targets.len());
        flows.extend(udp_flows(&client, *t, share)?);
    }
    let warm = sinks.total();
    send_paced(&flows, o.start_rate, Duration::from_millis(500), CLIENT_CPU)?;
    settled_counts(&sinks);
    if sinks.total() == warm {
        bail!("{}: no datagram of the warm-up arrived", cfg.name);
    }
    let pod_ns: Vec<String> = pods.iter().map(|p| p.ns().to_string()).collect();
    let rcvbuf = || pod_ns.iter().map(|ns| udp_rcvbuf_errors(ns)).sum::<u64>();
    let mut rate = o.start_rate.min(o.max_rate);
    let (mut top, mut stopped_at, mut stop) = (None, None, Stop::Steps);
    let mut retries = 0;
    // One step: `rate` for --duration, and what the node did meanwhile.
    let run_step = |rate: f64| -> Result<Step> {
        let c0 = sinks.counts();
        let (rx0, bd0, rb0, b0) = (
            net_rx_per_cpu(),
            backlog_drops_per_cpu(),
            rcvbuf(),
            bpf_runs(&ids),
        );
        let cpu0 = CpuTimes::read()?;
        let sent = send_paced(&flows, rate, o.duration, CLIENT_CPU)?;
        let cpu1 = CpuTimes::read()?;
        let (rx1, b1) = (net_rx_per_cpu(), bpf_runs(&ids));
        let c1 = settled_counts(&sinks);
        let per_pod = deltas(&c0, &c1);
        let s = Step {
            offered: rate,
            sent,
            received: per_pod.iter().sum(),
            per_pod,
            softirq_ns: [
                cpu0.softirq_ns(&cpu1, CLIENT_CPU),
                cpu0.softirq_ns(&cpu1, NODE_CPU),
            ],
            busy: [cpu0.busy(&cpu1, CLIENT_CPU), cpu0.busy(&cpu1, NODE_CPU)],
            net_rx: deltas(&rx0, &rx1),
            backlog_drops: deltas(&bd0, &backlog_drops_per_cpu()),
            rcvbuf_errors: rcvbuf().saturating_sub(rb0),
            bpf: (b1.0.saturating_sub(b0.0), b1.1.saturating_sub(b0.1)),
        };
        eprintln!(
            "    offered {:>9} sent {:>9}/s received {:>9}/s loss {:.3}% | CPU1 softirq {:.0} ns/pkt, busy CPU0 {:.0}% CPU1 {:.0}% | NET_RX {:?} | backlog drops {:?} rcvbuf {}{}",
            thousands(rate as u64),
            thousands(s.sent.rate() as u64),
            thousands((s.received as f64 / s.sent.elapsed.as_secs_f64().max(1e-9)) as u64),
            s.loss() * 100.0,
            s.softirq_ns[NODE_CPU] / s.sent.packets.max(1) as f64,
            s.busy[CLIENT_CPU] * 100.0,
            s.busy[NODE_CPU] * 100.0,
            s.net_rx,
            s.backlog_drops,
            s.rcvbuf_errors,
            if s.bpf.1 > 0 {
                format!(
                    " | BPF {:.0} ns/run, {:.2} runs/pkt",
                    s.bpf.0 as f64 / s.bpf.1 as f64,
                    s.bpf.1 as f64 / s.sent.packets.max(1) as f64
                )
            } else {
                String::new()
            }
        );
        Ok(s)
    };
    for _ in 0..MAX_STEPS {
        check_interrupted()?;
        if Instant::now() > cx.deadline {
            stop = Stop::TimeLimit;
            break;
        }
        let s = run_step(rate)?;
        let client_bound = s.sent.rate() < 0.95 * rate;
        if s.loss() > o.loss {
            if retries < RETRIES {
                retries += 1;
                eprintln!("    (lossy: once more at the same rate)");
                continue;
            }
            // Lost packets end the climb whatever the sender reached: the
            // details say where they were dropped.
            stopped_at = Some(s);
            stop = Stop::Loss;
            break;
        }
        // The sender fell short of the offered rate: CPU 0 is full. Going
        // on only helps while what it reaches still grows.
        let grew = top
            .as_ref()
            .is_none_or(|t: &Step| s.sent.rate() > 1.03 * t.sent.rate());
        if client_bound && !grew {
            if retries < RETRIES {
                retries += 1;
                eprintln!("    (the sender fell short: once more at the same rate)");
                continue;
            }
            stop = Stop::Client;
            stopped_at = Some(s);
            break;
        }
        top = Some(s);
        if rate >= o.max_rate {
            stop = Stop::MaxRate;
            break;
        }
        rate = (rate * o.step).min(o.max_rate);
    }
    // At one rate for every row: the node's CPU per packet where the
    // climbs' top steps (each at its own rate) cannot be compared.
    let mut fixed = Vec::new();
    if let Some(r) = o.fixed_rate {
        eprintln!("    at {} pps, {} steps:", thousands(r as u64), o.repeats);
        for _ in 0..o.repeats {
            check_interrupted()?;
            if Instant::now() > cx.deadline {
                break;
            }
            fixed.push(run_step(r)?);
        }
    }
    drop(flows);

    // TCP: latency one request at a time, then the connection rate.
    let (mut latency, latency_failed) =
        tcp_latency(&client, tcp_target, o.requests, o.duration * 2, CLIENT_CPU)?;
    latency.sort();
    check_interrupted()?;
    let conns = tcp_rate(&client, tcp_target, o.tcp_threads, o.duration, CLIENT_CPU)?;
    check_interrupted()?;
    eprintln!(
        "    TCP: request p50 {:.0} µs p99 {:.0} µs ({} failed); {:.0} connections/s ({} failed)",
        quantile(&latency, 0.5).as_secs_f64() * 1e6,
        quantile(&latency, 0.99).as_secs_f64() * 1e6,
        latency_failed,
        conns.0 as f64 / conns.2.as_secs_f64(),
        conns.1
    );
    if let Some(proxy) = &proxy {
        if !proxy.guard.is_running() {
            bail!(
                "{}: the proxy exited during the measurement; log {}",
                cfg.name,
                proxy.guard.log_path().display()
            );
        }
        proxy.guard.kill_hard();
    }
    // Its rules stay in its node's namespace (unused from now on); the
    // big ones go, so that the next proxies' kernel memory is not shared
    // with them. Best effort.
    let _ = lab.cluster.exec(
        lab.cluster.node_ns(node),
        &[
            "sh",
            "-c",
            "nft flush ruleset; for t in raw mangle nat filter; do iptables-legacy -t $t -F; iptables-legacy -t $t -X; done 2>/dev/null; true",
        ],
    );
    drop(bpf_dirs);
    Ok(Outcome::Measured(Box::new(Figures {
        ready,
        top,
        stopped_at,
        stop,
        programs,
        latency,
        latency_failed,
        conns,
        fixed,
    })))
}

/// A size's lab: `nodes` node namespaces, upstream's binary when a row
/// runs it, and `extra` Services of kp-bench's mix written into etcd.
fn start_lab(o: &Opts, prefix: &str, nodes: usize, extra: u32) -> Result<Lab> {
    let mut lab = Lab::start_nodes(prefix, false, nodes, wide_ranges)?;
    if let Some(up) = &o.upstream {
        lab.bins.kube_proxy = Some(up.clone());
    }
    if o.configs.iter().any(|c| c.binary.upstream()) && lab.bins.kube_proxy.is_none() {
        bail!("upstream kube-proxy not found: pass --upstream PATH (or put ../shared/k8s beside the checkout)");
    }
    check_interrupted()?;
    if extra > 0 {
        let t = Instant::now();
        let tally = Populated::default();
        lab.populate_etcd(extra, &tally)?;
        eprintln!(
            "  {} objects of {extra} Services written into etcd in {:.1} s",
            tally.ok.load(Ordering::Relaxed),
            t.elapsed().as_secs_f64()
        );
    }
    check_interrupted()?;
    Ok(lab)
}

fn measure_size(o: &Opts, n: u32, reverse: bool, deadline: Instant) -> Result<Vec<Outcome>> {
    let nodes = o.configs.len() + usize::from(o.remote);
    eprintln!("{n} Services: starting the lab ({nodes} nodes)");
    let lab = start_lab(o, "pps", nodes, n - 1)?;
    let cl = &lab.cluster;
    // Everything but the nodes on CPU 0: the client, the LAN bridge's
    // ports, the pods (added below).
    set_rps(cl, cl.lan_ns(), "*", "1")?;
    set_rps(cl, cl.client_ns(), "*", "1")?;
    let mut pods = Vec::new();
    for i in 0..nodes {
        let node = i + 1;
        let mine: Vec<Pod> = (0..o.pods)
            .map(|j| cl.add_pod(node, &format!("n{node}e{j}")))
            .collect::<Result<_, _>>()?;
        for p in &mine {
            set_rps(cl, p.ns(), "*", "1")?;
        }
        let remote_node = o.remote && node == nodes;
        set_rps(
            cl,
            cl.node_ns(node),
            "*",
            if remote_node { "1" } else { "2" },
        )?;
        pods.push(mine);
    }
    if o.remote {
        // Every configuration's endpoints are the last node's pods.
        let theirs = pods.pop().context("no endpoints' node")?;
        pods = vec![theirs; o.configs.len()];
        set_rps(cl, cl.lan_ns(), "c0", "2")?;
        set_rps(cl, cl.lan_ns(), &format!("n{nodes}"), "2")?;
        cl.xdp_on_lan_ports(kp_ebpf::XDP_PASS_OBJECT)
            .context("an XDP program on the LAN's ports")?;
        // XDP takes checksums to be complete, as a NIC's frames are.
        cl.full_checksums(cl.client_ns())
            .context("checksum offload off in the client")?;
        for p in &pods[0] {
            cl.full_checksums(p.ns())
                .with_context(|| format!("checksum offload off in {}", p.ns()))?;
        }
    }
    lab.create_service(
        json!({"metadata": {"name": "pps"},
            "spec": {"type": "NodePort", "externalTrafficPolicy": "Cluster", "clusterIP": CLUSTER_IP,
                "ports": [
                    {"name": "udp", "protocol": "UDP", "port": UDP_PORT, "targetPort": UDP_PORT, "nodePort": UDP_NODE_PORT},
                    {"name": "tcp", "protocol": "TCP", "port": TCP_PORT, "targetPort": TCP_PORT, "nodePort": TCP_NODE_PORT}]}}),
        json!({"metadata": {"name": "pps-x", "labels": {"kubernetes.io/service-name": "pps"}},
            "addressType": "IPv4",
            "ports": [{"name": "udp", "port": UDP_PORT, "protocol": "UDP"},
                      {"name": "tcp", "port": TCP_PORT, "protocol": "TCP"}],
            "endpoints": endpoints(&pods[0])}),
    )?;
    let shim = if o.configs.iter().any(|c| c.binary == Binary::UpstreamLegacy) {
        Some(legacy_shim(&lab.cp.dir().join("legacy-iptables"))?)
    } else {
        None
    };
    let cx = Ctx {
        o,
        lab: &lab,
        deadline,
        n,
    };
    let mut order: Vec<usize> = (0..o.configs.len()).collect();
    if reverse {
        order.reverse();
    }
    let mut out: Vec<Option<Outcome>> = o.configs.iter().map(|_| None).collect();
    for i in order {
        let r = measure_config(&cx, &o.configs[i], i + 1, &pods[i], &shim);
        // An interruption ends the run; any other failure ends this row.
        check_interrupted()?;
        out[i] = Some(r.unwrap_or_else(|e| Outcome::NotMeasured(format!("failed: {e:#}"))));
    }
    Ok(out
        .into_iter()
        .map(|x| x.unwrap_or_else(|| Outcome::NotMeasured("not run".into())))
        .collect())
}

fn us(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1e6)
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

fn table(o: &Opts, results: &[(u32, Vec<Outcome>)]) -> String {
    let mut t = String::new();
    for (n, outcomes) in results {
        t.push_str(&format!(
            "\n**{n} Service{}** (the NodePort's 1 + {} of kp-bench's mix x10 endpoints)\n\n",
            if *n == 1 { "" } else { "s" },
            n - 1
        ));
        t.push_str("| proxy | highest rate without loss (pps) | what ended the climb | node CPU 1 softirq ns/pkt | CPU 1 / CPU 0 busy | BPF programs ns/run, runs/pkt | new TCP conn/s | request over a fresh connection p50 / p99 µs |\n");
        t.push_str("|---|---|---|---|---|---|---|---|\n");
        let mut notes = Vec::new();
        for (cfg, out) in o.configs.iter().zip(outcomes) {
            match out {
                Outcome::NotAvailable(why) => t.push_str(&format!(
                    "| {} | not available: {} | | | | | | |\n",
                    cfg.name,
                    cell(why)
                )),
                Outcome::NotMeasured(why) => t.push_str(&format!(
                    "| {} | not measured: {} | | | | | | |\n",
                    cfg.name,
                    cell(why)
                )),
                Outcome::Measured(f) => {
                    let (rate, cpu, busy, bpf) = match &f.top {
                        Some(s) => {
                            let pk = s.sent.packets.max(1) as f64;
                            (
                                thousands(s.sent.rate() as u64),
                                format!("{:.0}", s.softirq_ns[NODE_CPU] / pk),
                                format!(
                                    "{:.0}% / {:.0}%",
                                    s.busy[NODE_CPU] * 100.0,
                                    s.busy[CLIENT_CPU] * 100.0
                                ),
                                if f.programs.is_empty() {
                                    "none attached".to_string()
                                } else if s.bpf.1 == 0 {
                                    "attached, never run".to_string()
                                } else {
                                    format!(
                                        "{:.0}, {:.2}",
                                        s.bpf.0 as f64 / s.bpf.1 as f64,
                                        s.bpf.1 as f64 / pk
                                    )
                                },
                            )
                        }
                        None => (
                            format!("below {}", thousands(o.start_rate as u64)),
                            "-".into(),
                            "-".into(),
                            "-".into(),
                        ),
                    };
                    let ended = match (f.stop, &f.stopped_at) {
                        (Stop::Loss, Some(s)) => format!(
                            "{:.2}% lost at {} sent ({} offered){}",
                            s.loss() * 100.0,
                            thousands(s.sent.rate() as u64),
                            thousands(s.offered as u64),
                            match s.backlog_drops.get(NODE_CPU) {
                                Some(&d) if d > 0 => {
                                    format!(", {} dropped by CPU 1's backlog", thousands(d))
                                }
                                _ => String::new(),
                            }
                        ),
                        (Stop::Client, Some(s)) => format!(
                            "sender reached {} of {} (CPU 0 full), {:.2}% lost",
                            thousands(s.sent.rate() as u64),
                            thousands(s.offered as u64),
                            s.loss() * 100.0
                        ),
                        (Stop::Client, None) => match &f.top {
                            Some(s) => format!(
                                "sender reached {} of {} (CPU 0 full), no loss",
                                thousands(s.sent.rate() as u64),
                                thousands(s.offered as u64)
                            ),
                            None => "sender could not keep up".into(),
                        },
                        (Stop::MaxRate, _) => "--max-rate, no loss".into(),
                        (Stop::TimeLimit, _) => "--time-limit".into(),
                        _ => format!("{MAX_STEPS} steps"),
                    };
                    let conn_rate = f.conns.0 as f64 / f.conns.2.as_secs_f64().max(1e-9);
                    let failed = f.conns.1 + f.latency_failed;
                    t.push_str(&format!(
                        "| {} | {rate} | {ended} | {cpu} | {busy} | {bpf} | {}{} | {} / {} |\n",
                        cfg.name,
                        thousands(conn_rate as u64),
                        if failed > 0 {
                            format!(" ({failed} failed)")
                        } else {
                            String::new()
                        },
                        us(quantile(&f.latency, 0.5)),
                        us(quantile(&f.latency, 0.99)),
                    ));
                    let mut note = format!(
                        "{}: served {:.1} s after its start",
                        cfg.name,
                        f.ready.as_secs_f64()
                    );
                    if let Some(s) = &f.top {
                        note.push_str(&format!(
                            "; at the top step {} sent, {} received (per pod {:?}), NET_RX softirqs per CPU {:?}, softirq time CPU 0 / CPU 1 {:.2} / {:.2} s, backlog drops per CPU {:?}, pods' receive-buffer drops {}",
                            thousands(s.sent.packets),
                            thousands(s.received),
                            s.per_pod,
                            s.net_rx,
                            s.softirq_ns[CLIENT_CPU] / 1e9,
                            s.softirq_ns[NODE_CPU] / 1e9,
                            s.backlog_drops,
                            s.rcvbuf_errors
                        ));
                    }
                    if let Some(s) = &f.stopped_at {
                        note.push_str(&format!(
                            "; the step that ended the climb: {} sent, {} received, backlog drops per CPU {:?}, pods' receive-buffer drops {}, CPU 1 busy {:.0}%",
                            thousands(s.sent.packets),
                            thousands(s.received),
                            s.backlog_drops,
                            s.rcvbuf_errors,
                            s.busy[NODE_CPU] * 100.0
                        ));
                    }
                    if !f.programs.is_empty() {
                        note.push_str(&format!("; BPF programs {}", f.programs.join(", ")));
                    }
                    notes.push(note);
                }
            }
        }
        if !notes.is_empty() {
            t.push('\n');
            for n in notes {
                t.push_str(&format!("* {n}\n"));
            }
        }
        if let Some(rate) = o.fixed_rate {
            t.push_str(&fixed_table(o, rate, outcomes));
        }
    }
    t
}

/// The median, lowest and highest of `xs` (NaN for none).
fn spread(mut xs: Vec<f64>) -> (f64, f64, f64) {
    if xs.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    let mid = if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    };
    (mid, xs[0], xs[n - 1])
}

/// CPU 1's time per packet over `--fixed-rate` steps: softirq (median,
/// lowest, highest) and busy (median).
struct FixedCost {
    softirq: (f64, f64, f64),
    busy: f64,
}

fn fixed_cost(steps: &[Step]) -> FixedCost {
    let per = |f: &dyn Fn(&Step) -> f64| -> Vec<f64> {
        steps
            .iter()
            .filter(|s| s.sent.packets > 0)
            .map(|s| f(s) / s.sent.packets as f64)
            .collect()
    };
    FixedCost {
        softirq: spread(per(&|s| s.softirq_ns[NODE_CPU])),
        busy: spread(per(&|s| {
            s.busy[NODE_CPU] * s.sent.elapsed.as_secs_f64() * 1e9
        }))
        .0,
    }
}

/// The `--fixed-rate` table of one Service count: every row at the same
/// offered rate, so that CPU 1's time per packet compares (the climb's top
/// steps are at different rates, and a softirq pass costs less per packet
/// the more packets it finds). "Above floor": the row's median less the
/// floor row's, when the floor ran: what the proxy adds to forwarding.
fn fixed_table(o: &Opts, rate: f64, outcomes: &[Outcome]) -> String {
    let floor = o
        .configs
        .iter()
        .zip(outcomes)
        .find_map(|(c, out)| match out {
            Outcome::Measured(f) if c.binary == Binary::NoProxy && !f.fixed.is_empty() => {
                Some(fixed_cost(&f.fixed))
            }
            _ => None,
        });
    let mut t = format!(
        "\nAt {} pps offered, {} steps of {:.0} s per row (CPU 1's time over the packets sent; tick-sampled at HZ, so the steps' spread is shown):\n\n",
        thousands(rate as u64),
        o.repeats,
        o.duration.as_secs_f64()
    );
    t.push_str("| proxy | sent pps (median) | most lost in a step | CPU 1 softirq ns/pkt, median (lowest-highest) | above the floor | CPU 1 busy ns/pkt, median | BPF programs ns/run, runs/pkt |\n");
    t.push_str("|---|---|---|---|---|---|---|\n");
    for (cfg, out) in o.configs.iter().zip(outcomes) {
        let Outcome::Measured(f) = out else {
            continue;
        };
        if f.fixed.is_empty() {
            t.push_str(&format!("| {} | not measured | | | | | |\n", cfg.name));
            continue;
        }
        let c = fixed_cost(&f.fixed);
        let (sent, _, _) = spread(f.fixed.iter().map(|s| s.sent.rate()).collect());
        let lost = f.fixed.iter().map(Step::loss).fold(0.0, f64::max);
        let above = match &floor {
            Some(fl) if cfg.binary != Binary::NoProxy => {
                format!("{:+.0}", c.softirq.0 - fl.softirq.0)
            }
            _ => "-".into(),
        };
        let (time, runs) = f
            .fixed
            .iter()
            .fold((0u64, 0u64), |(t, r), s| (t + s.bpf.0, r + s.bpf.1));
        let pk: u64 = f.fixed.iter().map(|s| s.sent.packets).sum();
        let bpf = if runs == 0 {
            "-".to_string()
        } else {
            format!(
                "{:.0}, {:.2}",
                time as f64 / runs as f64,
                runs as f64 / pk.max(1) as f64
            )
        };
        t.push_str(&format!(
            "| {} | {} | {:.2}% | {:.0} ({:.0}-{:.0}) | {above} | {:.0} | {bpf} |\n",
            cfg.name,
            thousands(sent as u64),
            lost * 100.0,
            c.softirq.0,
            c.softirq.1,
            c.softirq.2,
            c.busy,
        ));
    }
    t
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// `kp-bench pps`.
pub fn run(a: PpsArgs) -> Result<()> {
    let o = parse_opts(a)?;
    parts::install_signal_handlers();
    if o.configs
        .iter()
        .any(|c| c.binary == Binary::Ours && c.path.is_none())
    {
        check_binary(&o.binary)?;
    }
    for p in o.configs.iter().filter_map(|c| c.path.as_deref()) {
        check_binary(p)?;
    }
    if let Some(up) = &o.upstream {
        if !up.is_file() {
            bail!("--upstream {}: no such file", up.display());
        }
    }
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    if cpus < 2 {
        bail!("kp-bench pps needs CPUs 0 and 1 (this process may use {cpus})");
    }
    if o.in_place {
        return inplace::run(&o);
    }
    let started = Instant::now();
    let deadline = started + o.time_limit;
    let (date, load_before) = (date_utc(), load_average());
    let mut results = Vec::new();
    for (k, &n) in o.sizes.iter().enumerate() {
        check_interrupted()?;
        if Instant::now() > deadline {
            eprintln!("--time-limit reached: {n} Services not measured");
            break;
        }
        results.push((n, measure_size(&o, n, k % 2 == 1, deadline)?));
    }
    let bpf_note = if o.configs.iter().any(|c| parts::wants_bpf(&c.args)) {
        " BPF run-time statistics were on (BPF_ENABLE_STATS, machine-wide) only while a configuration with programs in its node was measured."
    } else {
        ""
    };
    let xdp_note = if o.configs.iter().any(|c| {
        c.args
            .iter()
            .any(|a| a.starts_with("--bpf-lb-acceleration"))
    }) {
        if o.remote {
            " Native XDP on veth is not a NIC's: the program runs in the veth's NAPI on the CPU that transmits into the node's eth0 (here CPU 1, where the LAN bridge forwards to the node), on frames its peer built as skbs, and its XDP_TX goes back into a veth; compare the ratios, not the absolute figures, with a NIC."
        } else {
            " Native XDP on veth is not a NIC's: the program runs in the veth's NAPI on the CPU that transmits into the node's eth0 (the LAN bridge's, CPU 0), on frames its peer built as skbs, so its cost shows in the BPF column and on CPU 0, not in CPU 1's softirq time; compare the ratios, not the absolute figures, with a NIC."
        }
    } else {
        ""
    };
    let placement = if o.remote {
        "The endpoints on a node of their own (`--endpoints remote`: the measured node sends requests and replies back out of its eth0). Client, endpoints' node and pods on CPU 0 (the bench's threads there at nice {nice}); the measured node's receive processing, the proxy and the LAN bridge's forwarding of the client's and the endpoints' frames on CPU 1 (RPS, affinity);"
    } else {
        "Client, LAN bridge and pods on CPU 0 (the bench's threads there at nice {nice}), the node's receive processing and the proxy on CPU 1 (RPS, affinity);"
    }
    .replace("{nice}", &parts::CLIENT_NICE.to_string());
    let text = format!(
        "Measured {date} by `{}` ({:.0} min; {cpus} CPUs, kernel {}; load average {} at the start, {} at the end). \
         Every configuration ran in this run, one after the other, each on a node namespace of its own; \
         \"without loss\": at most {:.1}% of the datagrams sent in a {:.0} s step lost. \
         {placement} \
         CPU 1 softirq time is tick-sampled at the kernel's HZ.{bpf_note}{xdp_note}\n{}",
        o.command,
        started.elapsed().as_secs_f64() / 60.0,
        kernel(),
        load_before,
        load_average(),
        o.loss * 100.0,
        o.duration.as_secs_f64(),
        table(&o, &results),
    );
    println!("{text}");
    if let Some(path) = &o.write {
        let marker = match (&o.section, o.remote) {
            (Some(name), _) => format!("kp-pps {name}"),
            (None, true) => "kp-pps remote".to_string(),
            (None, false) => "kp-pps".to_string(),
        };
        write_into(path, &marker, &text)?;
        eprintln!("wrote the table into {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::spread;

    #[test]
    fn spread_is_median_and_range() {
        assert_eq!(spread(vec![3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        assert_eq!(spread(vec![4.0, 1.0, 2.0, 8.0]), (3.0, 1.0, 8.0));
        assert!(spread(Vec::new()).0.is_nan());
    }
}
