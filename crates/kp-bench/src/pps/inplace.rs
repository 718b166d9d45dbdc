//! `kp-bench pps --in-place`: the node's CPU per packet, every configuration
//! alive at once and measured in alternation (issue 64 item 3(b)).
//!
//! Every configuration gets its node namespace, its pods and a NodePort
//! Service of its own (`pps-K`, nodePort 59990+K-1, endpoints the pods of
//! node K), and all run at the same time. The pods echo every datagram to
//! its sender, so each request crosses the node twice: in through its
//! eth0, out to a pod; the pod's answer in from the pod's veth and out to
//! the client (SNAT'ed rows un-SNAT it, the proxyless rows route it). The
//! client counts the echoes.
//!
//! Once every row serves, the bench attaches its two tracepoint programs
//! (bpf.rs `NetRxClock`: NET_RX time per CPU summed between softirq_entry
//! and softirq_exit) and sends `--fixed-rate` (default 30k) datagrams a
//! second for `--duration` to one row at a time: rows in order, then in
//! the reverse order (A B C, C B A, ...), `--rounds` times. A step is the
//! send and the wait for its echoes; its figure is CPU 1's NET_RX
//! nanoseconds over the requests sent. A step during which the hypervisor
//! stole time from CPU 0 or 1 (/proc/stat), or a backlog dropped or was
//! squeezed there (/proc/net/softnet_stat), is dropped and counted. Paired
//! differences: for each round, a row's figure less the baseline's of the
//! same round (both kept), over the rounds: median, quartiles, range.
//!
//! Then `--stats-rounds` more rounds of the rows with BPF programs, with
//! the kernel's run-time statistics on (BPF_ENABLE_STATS, a descriptor
//! held only for them): each packet program's runs per request and ns per
//! run in place, warm or cold as the traffic leaves it, where
//! BPF_PROG_TEST_RUN (`kp-bench prog`) runs one frame in a hot loop.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kp_netlab::Pod;
use serde_json::json;

use super::bpf::{NetRx, NetRxClock, NullTc};
use super::parts::{
    bpf_programs, check_interrupted, error_line, net_rx_per_cpu, pin_process, send_paced, set_rps,
    sleep_checked, softnet_stalls_per_cpu, thousands, udp_flows, wants_bpf, Binary, BpfStats,
    CpuTimes, ProgInfo, ProxyConfig, Sent, UdpSinks,
};
use super::{
    endpoints, kernel, settled_counts, ClientRoutes, Opts, CLIENT_CPU, NODE_CPU, UDP_PORT,
};
use crate::lab::{date_utc, load_average, write_into, Lab, ProxyCommand};

/// Default datagrams a second of a step.
pub const DEFAULT_RATE: f64 = 30_000.0;
/// The baselines of the paired differences, those of them that ran.
const BASELINES: &[&str] = &["upstream-nftables", "ours-nftables", "null-tc", "floor"];

fn node_port(k: usize) -> u16 {
    59990 + k as u16 - 1
}

/// One step of one row.
struct Step {
    round: usize,
    sent: Sent,
    requests: u64,
    echoes: u64,
    net_rx: NetRx,
    /// /proc/softirqs' NET_RX count over the step, per CPU: the passes the
    /// tracepoints saw should be these.
    raised: Vec<u64>,
    steal: u64,
    drops: u64,
    squeezes: u64,
    /// The sender fell more than 10% short of the step's count (CPU 0 taken
    /// by others): fewer packets a softirq pass, a figure of another rate.
    short: bool,
}

impl Step {
    fn kept(&self) -> bool {
        self.steal == 0 && self.drops == 0 && self.squeezes == 0 && !self.short
    }
    fn ns_per_request(&self, cpus: &[usize]) -> f64 {
        let ns: u64 = cpus
            .iter()
            .map(|&c| self.net_rx.ns.get(c).copied().unwrap_or(0))
            .sum();
        ns as f64 / self.sent.packets.max(1) as f64
    }
    /// The share of requests that reached no pod, and of echoes that did
    /// not come back.
    fn loss(&self) -> (f64, f64) {
        let sent = self.sent.packets.max(1) as f64;
        (
            1.0 - self.requests as f64 / sent,
            1.0 - self.echoes as f64 / sent,
        )
    }
}

/// One step with the BPF run-time statistics on: what each packet program
/// that ran for it did.
struct ProgStep {
    sent: u64,
    kept: bool,
    /// Program name, runs and run time (ns) over the step.
    runs: Vec<(String, u64, u64)>,
}

/// The packet programs (tc, XDP) that ran for a step of `sent` requests,
/// from the statistics `before` and `after` it, summed by name: those that
/// ran at least once per 100 requests (the row's own; another row's
/// program passing a stray frame is not its traffic), held by `owner`
/// where bpftool names the processes holding a program, and not among
/// `older` (loaded before the lab: another lab's on a shared machine).
fn packet_runs(
    before: &BTreeMap<u64, ProgInfo>,
    after: &BTreeMap<u64, ProgInfo>,
    sent: u64,
    older: &BTreeSet<u64>,
    owner: u64,
) -> Vec<(String, u64, u64)> {
    let mut by_name: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (id, p) in after {
        if !matches!(p.kind.as_str(), "sched_cls" | "sched_act" | "xdp")
            || older.contains(id)
            || !(p.pids.is_empty() || p.pids.contains(&owner))
        {
            continue;
        }
        let Some(b) = before.get(id) else { continue };
        let runs = p.run_cnt.saturating_sub(b.run_cnt);
        if runs == 0 || runs * 100 < sent {
            continue;
        }
        let e = by_name.entry(p.name.clone()).or_default();
        e.0 += runs;
        e.1 += p.run_time_ns.saturating_sub(b.run_time_ns);
    }
    by_name
        .into_iter()
        .map(|(name, (runs, ns))| (name, runs, ns))
        .collect()
}

/// Whether a row puts BPF programs on the packets' path.
fn has_programs(cfg: &ProxyConfig) -> bool {
    cfg.binary == Binary::NullTc || (!cfg.binary.upstream() && wants_bpf(&cfg.args))
}

enum Row {
    Measured {
        ready: Duration,
        steps: Vec<Step>,
        prog_steps: Vec<ProgStep>,
        note: String,
    },
    NotAvailable(String),
}

/// A row while it lives. Fields drop in order: the proxy before its
/// cgroup and bpffs.
struct Live<'a> {
    proxy: Option<crate::lab::Proxy<'a>>,
    _bpf_dirs: Option<(kp_netlab::TestCgroup, kp_netlab::TestBpffs)>,
    null_tc: Option<NullTc>,
    _routes: Option<ClientRoutes<'a>>,
    echoes: UdpSinks,
    flows: Vec<UdpSocket>,
    sinks: UdpSinks,
    t0: Instant,
    ready: Option<Duration>,
    failed: Option<String>,
}

fn start_row<'a>(
    o: &Opts,
    lab: &'a Lab,
    cfg: &ProxyConfig,
    k: usize,
    pods: &[Pod],
    n: u32,
) -> Result<Live<'a>> {
    let cl = &lab.cluster;
    let client = cl.client_ns().to_string();
    let sinks = UdpSinks::start_echo(pods, UDP_PORT, CLIENT_CPU)?;
    let proxyless = cfg.binary.proxyless();
    let null_tc = if cfg.binary == Binary::NullTc {
        Some(NullTc::attach(cl.node_ns(k))?)
    } else {
        None
    };
    let (routes, targets) = if proxyless {
        (
            Some(ClientRoutes::via(lab, pods, k)?),
            pods.iter()
                .map(|p| SocketAddr::new(p.ip(), UDP_PORT))
                .collect::<Vec<_>>(),
        )
    } else {
        (None, vec![SocketAddr::new(cl.node_ip(k), node_port(k))])
    };
    let mut flows = Vec::with_capacity(o.flows);
    for (j, t) in targets.iter().enumerate() {
        let share = o.flows / targets.len() + usize::from(j < o.flows % targets.len());
        flows.extend(udp_flows(&client, *t, share)?);
    }
    let clones = flows
        .iter()
        .map(UdpSocket::try_clone)
        .collect::<std::io::Result<Vec<_>>>()
        .context("cloning the client's sockets")?;
    let echoes = UdpSinks::count_on(clones, CLIENT_CPU)?;
    let mut args = cfg.args.clone();
    let mut bpf_dirs = None;
    if super::parts::wants_bpf(&args) {
        let cg = kp_netlab::TestCgroup::new()?;
        let fs = kp_netlab::TestBpffs::new()?;
        args.push(format!("--cgroup-path={}", cg.path().display()));
        args.push(format!("--bpf-pin-path={}", fs.path().display()));
        bpf_dirs = Some((cg, fs));
    }
    let t0 = Instant::now();
    let proxy = if proxyless {
        None
    } else {
        let cmd = ProxyCommand {
            mode: &cfg.mode,
            upstream: cfg.binary.upstream(),
            ours: cfg.path.as_deref().unwrap_or(&o.binary),
            extra: &args,
            env: &[],
        };
        Some(lab.spawn_proxy_with(k, &cmd, &format!("inplace-{}-{n}", cfg.name))?)
    };
    Ok(Live {
        proxy,
        _bpf_dirs: bpf_dirs,
        null_tc,
        _routes: routes,
        echoes,
        flows,
        sinks,
        t0,
        ready: None,
        failed: None,
    })
}

/// Waits until every row's echoes come back (or it fails, or
/// --first-sync-within passes), pinning each proxy to CPU 1 once it serves.
fn wait_ready(o: &Opts, live: &mut [Live<'_>]) -> Result<()> {
    loop {
        check_interrupted()?;
        let mut pending = 0;
        let mut probed = Vec::new();
        for (i, l) in live.iter_mut().enumerate() {
            if l.ready.is_some() || l.failed.is_some() {
                continue;
            }
            if let Some(p) = l.proxy.as_ref().filter(|p| !p.guard.is_running()) {
                std::thread::sleep(Duration::from_millis(100));
                l.failed = Some(error_line(&p.guard.log_contents()));
                continue;
            }
            if l.t0.elapsed() > o.first_sync_within {
                let log = l
                    .proxy
                    .as_ref()
                    .map(|p| p.guard.log_contents())
                    .unwrap_or_default();
                let last = log
                    .lines()
                    .rev()
                    .find(|x| !x.trim().is_empty())
                    .unwrap_or("");
                l.failed = Some(format!(
                    "no echo through its NodePort within {:.0} s of the start; the proxy's last log line: {}",
                    o.first_sync_within.as_secs_f64(),
                    last.trim().chars().take(160).collect::<String>()
                ));
                if let Some(p) = &l.proxy {
                    p.guard.kill_hard();
                }
                continue;
            }
            pending += 1;
            let synced = l.proxy.as_ref().is_none_or(|p| {
                p.samples("kubeproxy_sync_proxy_rules_duration_seconds_count")
                    .iter()
                    .sum::<f64>()
                    >= 1.0
            });
            if synced {
                let before = l.echoes.total();
                if let Some(s) = l.flows.first() {
                    let _ = s.send(b"probe");
                }
                probed.push((i, before));
            }
        }
        if pending == 0 {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(300));
        for (i, before) in probed {
            let l = &mut live[i];
            if l.echoes.total() > before {
                let ready = l.t0.elapsed();
                l.ready = Some(ready);
                if let Some(p) = &l.proxy {
                    pin_process(p.guard.pid(), NODE_CPU)?;
                }
                eprintln!(
                    "  row {i}: echoes come back {:.1} s after the start",
                    ready.as_secs_f64()
                );
            }
        }
        sleep_checked(Duration::from_millis(200))?;
    }
}

/// Ticks the hypervisor stole from CPU 0 or 1 between two readings.
fn stolen(before: &CpuTimes, after: &CpuTimes) -> u64 {
    [CLIENT_CPU, NODE_CPU]
        .iter()
        .map(|&c| before.steal_ticks(after, c))
        .sum()
}

/// The sender fell more than 10% short of a step's count.
fn short(o: &Opts, rate: f64, sent: &Sent) -> bool {
    (sent.packets as f64) < 0.9 * rate * o.duration.as_secs_f64()
}

/// Calls `each(round, row)` for `rounds` rounds over `rows`, in order,
/// then reversed, and so on, until the deadline (`what` names the rounds
/// in the message that says so).
fn alternated(
    rows: &[usize],
    rounds: usize,
    deadline: Instant,
    what: &str,
    mut each: impl FnMut(usize, usize) -> Result<()>,
) -> Result<()> {
    for r in 0..rounds {
        check_interrupted()?;
        if Instant::now() > deadline {
            eprintln!("  --time-limit: {r} {what}");
            break;
        }
        let mut order = rows.to_vec();
        if r % 2 == 1 {
            order.reverse();
        }
        for i in order {
            each(r, i)?;
        }
    }
    Ok(())
}

fn step(o: &Opts, clock: &NetRxClock, l: &Live<'_>, round: usize, rate: f64) -> Result<Step> {
    let (rx0, raised0, cpu0, st0) = (
        clock.read()?,
        net_rx_per_cpu(),
        CpuTimes::read()?,
        softnet_stalls_per_cpu(),
    );
    let (q0, e0) = (l.sinks.total(), l.echoes.total());
    let sent = send_paced(&l.flows, rate, o.duration, CLIENT_CPU)?;
    // The step's echoes all back (or lost): its softirq work is done.
    settled_counts(&l.echoes);
    let (rx1, raised1, cpu1, st1) = (
        clock.read()?,
        net_rx_per_cpu(),
        CpuTimes::read()?,
        softnet_stalls_per_cpu(),
    );
    let cpus = [CLIENT_CPU, NODE_CPU];
    let stall = |f: fn(&(u64, u64)) -> u64| -> u64 {
        cpus.iter()
            .map(|&c| {
                let a = st0.get(c).map_or(0, f);
                st1.get(c).map_or(0, f).saturating_sub(a)
            })
            .sum()
    };
    Ok(Step {
        round,
        sent,
        requests: l.sinks.total().saturating_sub(q0),
        echoes: l.echoes.total().saturating_sub(e0),
        net_rx: rx0.until(&rx1),
        raised: super::parts::deltas(&raised0, &raised1),
        steal: stolen(&cpu0, &cpu1),
        drops: stall(|x| x.0),
        squeezes: stall(|x| x.1),
        short: short(o, rate, &sent),
    })
}

fn measure_size(o: &Opts, n: u32, deadline: Instant) -> Result<Vec<Row>> {
    let k = o.configs.len();
    // Programs loaded before the lab are not its rows'.
    let older: BTreeSet<u64> = bpf_programs().into_keys().collect();
    eprintln!("{n} Services: starting the lab ({k} nodes, every row at once)");
    let lab = super::start_lab(o, "ppsip", k, n.saturating_sub(k as u32))?;
    let cl = &lab.cluster;
    set_rps(cl, cl.lan_ns(), "*", "1")?;
    set_rps(cl, cl.client_ns(), "*", "1")?;
    let mut pods = Vec::new();
    for node in 1..=k {
        let mine: Vec<Pod> = (0..o.pods)
            .map(|j| cl.add_pod(node, &format!("n{node}e{j}")))
            .collect::<Result<_, _>>()?;
        for p in &mine {
            set_rps(cl, p.ns(), "*", if o.pod_rx_on_node { "2" } else { "1" })?;
        }
        set_rps(cl, cl.node_ns(node), "*", "2")?;
        lab.create_service(
            json!({"metadata": {"name": format!("pps-{node}")},
                "spec": {"type": "NodePort", "externalTrafficPolicy": "Cluster",
                    "clusterIP": format!("10.97.250.{node}"),
                    "ports": [{"name": "udp", "protocol": "UDP", "port": UDP_PORT,
                        "targetPort": UDP_PORT, "nodePort": node_port(node)}]}}),
            json!({"metadata": {"name": format!("pps-{node}-x"),
                    "labels": {"kubernetes.io/service-name": format!("pps-{node}")}},
                "addressType": "IPv4",
                "ports": [{"name": "udp", "port": UDP_PORT, "protocol": "UDP"}],
                "endpoints": endpoints(&mine)}),
        )?;
        pods.push(mine);
    }
    let mut live = Vec::new();
    for (i, cfg) in o.configs.iter().enumerate() {
        live.push(start_row(o, &lab, cfg, i + 1, &pods[i], n).with_context(|| cfg.name.clone())?);
    }
    wait_ready(o, &mut live)?;
    // Whatever a proxy does after its first sync, out of the steps' way.
    sleep_checked(Duration::from_secs(3))?;
    let rate = o.fixed_rate.unwrap_or(DEFAULT_RATE);
    let ready: Vec<usize> = (0..k).filter(|&i| live[i].ready.is_some()).collect();
    let mut steps: Vec<Vec<Step>> = (0..k).map(|_| Vec::new()).collect();
    {
        let clock = NetRxClock::attach()?;
        eprintln!(
            "  NET_RX tracepoint programs attached; {} rounds at {} pps",
            o.rounds,
            thousands(rate as u64)
        );
        for &i in &ready {
            send_paced(&live[i].flows, rate, Duration::from_millis(500), CLIENT_CPU)?;
            settled_counts(&live[i].echoes);
        }
        alternated(&ready, o.rounds, deadline, "rounds", |r, i| {
            let s = step(o, &clock, &live[i], r, rate)?;
            eprintln!(
                    "    round {r} {:<18} sent {:>7} echoes {:>7} | CPU1 NET_RX {:>5.0} ns/req ({} passes, {} raised) CPU0 {:>5.0} | steal {} drops {} squeezes {}{}",
                    o.configs[i].name,
                    thousands(s.sent.packets),
                    thousands(s.echoes),
                    s.ns_per_request(&[NODE_CPU]),
                    s.net_rx.passes.get(NODE_CPU).copied().unwrap_or(0),
                    s.raised.get(NODE_CPU).copied().unwrap_or(0),
                    s.ns_per_request(&[CLIENT_CPU]),
                    s.steal,
                    s.drops,
                    s.squeezes,
                    match (s.kept(), s.short) {
                        (true, _) => "",
                        (false, true) => " (dropped; sender short)",
                        (false, false) => " (dropped)",
                    }
                );
            steps[i].push(s);
            Ok(())
        })?;
        // The clock drops here: the tracepoint programs detach.
    }
    let mut prog_steps: Vec<Vec<ProgStep>> = (0..k).map(|_| Vec::new()).collect();
    let with_programs: Vec<usize> = ready
        .iter()
        .copied()
        .filter(|&i| has_programs(&o.configs[i]))
        .collect();
    if o.stats_rounds > 0 && !with_programs.is_empty() {
        let _stats = BpfStats::enable()?;
        eprintln!(
            "  BPF run-time statistics on (BPF_ENABLE_STATS) for {} rounds of the rows with programs",
            o.stats_rounds
        );
        alternated(
            &with_programs,
            o.stats_rounds,
            deadline,
            "statistics rounds",
            |r, i| {
                let l = &live[i];
                let (before, cpu0) = (bpf_programs(), CpuTimes::read()?);
                let sent = send_paced(&l.flows, rate, o.duration, CLIENT_CPU)?;
                settled_counts(&l.echoes);
                let (after, cpu1) = (bpf_programs(), CpuTimes::read()?);
                let owner = l
                    .proxy
                    .as_ref()
                    .map_or(u64::from(std::process::id()), |p| u64::from(p.guard.pid()));
                let s = ProgStep {
                    sent: sent.packets,
                    kept: stolen(&cpu0, &cpu1) == 0 && !short(o, rate, &sent),
                    runs: packet_runs(&before, &after, sent.packets, &older, owner),
                };
                eprintln!(
                    "    statistics round {r} {:<18} {}{}",
                    o.configs[i].name,
                    s.runs
                        .iter()
                        .map(|(n, runs, ns)| format!(
                            "{n} {:.2} runs/req {:.0} ns/run",
                            *runs as f64 / s.sent.max(1) as f64,
                            *ns as f64 / (*runs).max(1) as f64
                        ))
                        .collect::<Vec<_>>()
                        .join(", "),
                    if s.kept { "" } else { " (dropped)" }
                );
                prog_steps[i].push(s);
                Ok(())
            },
        )?;
    }
    let mut rows = Vec::new();
    for ((l, s), ps) in live.iter().zip(steps).zip(prog_steps) {
        if let Some(why) = &l.failed {
            rows.push(Row::NotAvailable(why.clone()));
            continue;
        }
        if let Some(p) = l.proxy.as_ref().filter(|p| !p.guard.is_running()) {
            rows.push(Row::NotAvailable(format!(
                "the proxy exited during the run: {}",
                error_line(&p.guard.log_contents())
            )));
            continue;
        }
        let mut note = String::new();
        if let Some(t) = &l.null_tc {
            note = format!("null tc program on {}", t.interfaces.join(", "));
        }
        rows.push(Row::Measured {
            ready: l.ready.unwrap_or_default(),
            steps: s,
            prog_steps: ps,
            note,
        });
    }
    drop(live);
    Ok(rows)
}

fn q(mut xs: Vec<f64>) -> Option<(f64, f64, f64, f64, f64)> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let at = |p: f64| {
        let x = p * (xs.len() - 1) as f64;
        let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
        xs[lo] + (xs[hi] - xs[lo]) * (x - lo as f64)
    };
    Some((at(0.5), at(0.25), at(0.75), xs[0], xs[xs.len() - 1]))
}

fn table(o: &Opts, results: &[(u32, Vec<Row>)]) -> String {
    let mut t = String::new();
    for (n, rows) in results {
        t.push_str(&format!(
            "\n**{n} Service{}** ({} NodePort Services, one a row, + {} of kp-bench's mix x10 endpoints)\n\n",
            if *n == 1 { "" } else { "s" },
            o.configs.len(),
            n.saturating_sub(o.configs.len() as u32)
        ));
        t.push_str("| row | steps kept / run (dropped: steal, backlog, sender short) | most lost in a step: requests / echoes | CPU 1 NET_RX ns per request + echo, median (IQR; min-max) | CPUs 0+1 NET_RX ns, median | NET_RX passes per request, CPU 1, every step (tracepoints / /proc/softirqs) | CPU 0 NET_RX ns per request + echo, median; passes per request |\n");
        t.push_str("|---|---|---|---|---|---|---|\n");
        let mut notes = Vec::new();
        for (cfg, row) in o.configs.iter().zip(rows) {
            match row {
                Row::NotAvailable(why) => t.push_str(&format!(
                    "| {} | not available: {} | | | | | |\n",
                    cfg.name,
                    super::cell(why)
                )),
                Row::Measured {
                    ready, steps, note, ..
                } => {
                    let kept: Vec<&Step> = steps.iter().filter(|s| s.kept()).collect();
                    let steal = steps.iter().filter(|s| s.steal > 0).count();
                    let backlog = steps
                        .iter()
                        .filter(|s| s.steal == 0 && (s.drops > 0 || s.squeezes > 0))
                        .count();
                    let short = steps
                        .iter()
                        .filter(|s| s.short && s.steal == 0 && s.drops == 0 && s.squeezes == 0)
                        .count();
                    let lost = steps
                        .iter()
                        .map(Step::loss)
                        .fold((0.0, 0.0), |a, l| (f64::max(a.0, l.0), f64::max(a.1, l.1)));
                    let one = q(kept.iter().map(|s| s.ns_per_request(&[NODE_CPU])).collect());
                    let both = q(kept
                        .iter()
                        .map(|s| s.ns_per_request(&[CLIENT_CPU, NODE_CPU]))
                        .collect());
                    // Every step, kept or not: the tracepoints against the
                    // kernel's own count.
                    let sum = |f: &dyn Fn(&Step) -> u64| steps.iter().map(f).sum::<u64>();
                    let sent = sum(&|s| s.sent.packets).max(1) as f64;
                    let passes = sum(&|s| s.net_rx.passes.get(NODE_CPU).copied().unwrap_or(0));
                    let zero = q(kept
                        .iter()
                        .map(|s| s.ns_per_request(&[CLIENT_CPU]))
                        .collect());
                    let zero_passes =
                        sum(&|s| s.net_rx.passes.get(CLIENT_CPU).copied().unwrap_or(0));
                    let raised = sum(&|s| s.raised.get(NODE_CPU).copied().unwrap_or(0));
                    t.push_str(&format!(
                        "| {} | {} / {} ({steal}, {backlog}, {short}) | {:.2}% / {:.2}% | {} | {} | {:.3} / {:.3} | {}; {:.3} |\n",
                        cfg.name,
                        kept.len(),
                        steps.len(),
                        lost.0 * 100.0,
                        lost.1 * 100.0,
                        one.map_or("-".into(), |(m, a, b, lo, hi)| format!(
                            "{m:.0} ({a:.0}-{b:.0}; {lo:.0}-{hi:.0})"
                        )),
                        both.map_or("-".into(), |x| format!("{:.0}", x.0)),
                        passes as f64 / sent,
                        raised as f64 / sent,
                        zero.map_or("-".into(), |x| format!("{:.0}", x.0)),
                        zero_passes as f64 / sent,
                    ));
                    let mut s = format!(
                        "{}: echoes back {:.1} s after its start",
                        cfg.name,
                        ready.as_secs_f64()
                    );
                    if !note.is_empty() {
                        s.push_str(&format!("; {note}"));
                    }
                    notes.push(s);
                }
            }
        }
        t.push_str(&paired(o, rows, &[NODE_CPU], "CPU 1 (the node's)"));
        t.push_str(&paired(
            o,
            rows,
            &[CLIENT_CPU, NODE_CPU],
            if o.pod_rx_on_node {
                "CPUs 0+1 (the node's and its pods', and the client's and LAN bridge's, alike in every row)"
            } else {
                "CPUs 0+1 (the node's, and the client's, LAN bridge's and pods', alike in every row)"
            },
        ));
        t.push_str(&prog_table(o, rows));
        if !notes.is_empty() {
            t.push('\n');
            for s in notes {
                t.push_str(&format!("* {s}\n"));
            }
        }
    }
    t
}

/// Each packet program's runs per request and ns per run in place, from
/// the statistics rounds.
fn prog_table(o: &Opts, rows: &[Row]) -> String {
    let mut t = String::new();
    for (cfg, row) in o.configs.iter().zip(rows) {
        let Row::Measured { prog_steps, .. } = row else {
            continue;
        };
        if prog_steps.is_empty() {
            continue;
        }
        if t.is_empty() {
            t.push_str(&format!(
                "\nPrograms in place: {} more rounds of the rows with BPF programs, the kernel's run-time statistics on (BPF_ENABLE_STATS; a run's time includes the statistics' two clock reads, as the null tc program's shows); every packet program that ran at least once per 100 requests, by name: runs per request (median), ns per run, median of the kept steps (min-max):\n\n| row | program | steps kept / run | runs per request | ns per run |\n|---|---|---|---|---|\n",
                o.stats_rounds
            ));
        }
        let kept: Vec<&ProgStep> = prog_steps.iter().filter(|s| s.kept).collect();
        let mut names: Vec<&str> = prog_steps
            .iter()
            .flat_map(|s| s.runs.iter().map(|r| r.0.as_str()))
            .collect();
        names.sort_unstable();
        names.dedup();
        if names.is_empty() {
            t.push_str(&format!(
                "| {} | none ran | {} / {} | | |\n",
                cfg.name,
                kept.len(),
                prog_steps.len()
            ));
        }
        for name in names {
            let of = |s: &ProgStep| s.runs.iter().find(|r| r.0 == name).map(|r| (r.1, r.2));
            let per_req = q(kept
                .iter()
                .filter_map(|s| of(s).map(|(runs, _)| runs as f64 / s.sent.max(1) as f64))
                .collect());
            let ns = q(kept
                .iter()
                .filter_map(|s| of(s).map(|(runs, ns)| ns as f64 / runs.max(1) as f64))
                .collect());
            t.push_str(&format!(
                "| {} | {name} | {} / {} | {} | {} |\n",
                cfg.name,
                kept.len(),
                prog_steps.len(),
                per_req.map_or("-".into(), |x| format!("{:.2}", x.0)),
                ns.map_or("-".into(), |(m, _, _, lo, hi)| format!(
                    "{m:.0} ({lo:.0}-{hi:.0})"
                )),
            ));
        }
    }
    t
}

/// The paired differences, row less baseline, of `cpus`' NET_RX time per
/// request + echo, over the rounds where both steps were kept.
fn paired(o: &Opts, rows: &[Row], cpus: &[usize], what: &str) -> String {
    let mut t = String::new();
    let idx = |name: &str| o.configs.iter().position(|c| c.name == name);
    let per_round = |i: usize| -> Vec<Option<f64>> {
        let Some(Row::Measured { steps, .. }) = rows.get(i) else {
            return Vec::new();
        };
        let mut v = vec![None; o.rounds];
        for s in steps.iter().filter(|s| s.kept()) {
            if let Some(slot) = v.get_mut(s.round) {
                *slot = Some(s.ns_per_request(cpus));
            }
        }
        v
    };
    let bases: Vec<(usize, &str)> = BASELINES
        .iter()
        .filter_map(|b| idx(b).map(|i| (i, *b)))
        .filter(|(i, _)| matches!(rows.get(*i), Some(Row::Measured { .. })))
        .collect();
    if bases.is_empty() {
        return t;
    }
    t.push_str(&format!("\nPaired differences, row less column, {what} NET_RX ns per request + echo, over the rounds where both steps were kept: median (IQR; min-max, pairs):\n\n| row |"));
    for (_, b) in &bases {
        t.push_str(&format!(" − {b} |"));
    }
    t.push_str("\n|---|");
    t.push_str(&"---|".repeat(bases.len()));
    t.push('\n');
    for (i, cfg) in o.configs.iter().enumerate() {
        if !matches!(rows.get(i), Some(Row::Measured { .. })) {
            continue;
        }
        let a = per_round(i);
        t.push_str(&format!("| {} |", cfg.name));
        for (j, _) in &bases {
            if *j == i {
                t.push_str(" |");
                continue;
            }
            let b = per_round(*j);
            let d: Vec<f64> = a
                .iter()
                .zip(&b)
                .filter_map(|(x, y)| Some((*x)? - (*y)?))
                .collect();
            let k = d.len();
            t.push_str(&match q(d) {
                Some((m, lo, hi, mn, mx)) => {
                    format!(" {m:+.0} ({lo:+.0} to {hi:+.0}; {mn:+.0} to {mx:+.0}, {k}) |")
                }
                None => " no kept pair |".into(),
            });
        }
        t.push('\n');
    }
    t
}

/// `kp-bench pps --in-place`.
pub(super) fn run(o: &Opts) -> Result<()> {
    if let Some(c) = o
        .configs
        .iter()
        .find(|c| c.binary == Binary::UpstreamLegacy)
    {
        bail!(
            "--in-place does not run {} (iptables-legacy's PATH is per row in the climb only)",
            c.name
        );
    }
    let started = Instant::now();
    let deadline = started + o.time_limit;
    let (date, load_before) = (date_utc(), load_average());
    let rate = o.fixed_rate.unwrap_or(DEFAULT_RATE);
    let mut results = Vec::new();
    for &n in &o.sizes {
        check_interrupted()?;
        if Instant::now() > deadline {
            eprintln!("--time-limit reached: {n} Services not measured");
            break;
        }
        results.push((n, measure_size(o, n, deadline)?));
        // Each size's table as soon as it is measured: a run stopped later
        // keeps it.
        eprintln!("{}", table(o, &results[results.len() - 1..]));
    }
    let cpus = std::thread::available_parallelism().map_or(0, |c| c.get());
    let xdp = if o.configs.iter().any(|c| {
        c.args
            .iter()
            .any(|a| a.starts_with("--bpf-lb-acceleration"))
    }) {
        " XDP on veth is not a NIC's: with the endpoints on the node, the program runs in the NAPI of the node's eth0 veth on the CPU that transmits into it (the LAN bridge's, CPU 0: the CPUs 0+1 column) and passes the frame up, where the rest runs on CPU 1; a NIC would run it on the receiving CPU, before any skb is built."
    } else {
        ""
    };
    let text = format!(
        "Measured {date} by `{}` ({:.0} min; {cpus} CPUs, kernel {}; load average {} at the start, {} at the end). \
         Every row alive at once, each on a node namespace of its own with its own NodePort Service and pods (on the node); \
         {} pps of 64-byte UDP datagrams from {} flows for {:.0} s a step, one row at a time, rows in order then reversed, {} rounds; the pods echo every datagram, so a request crosses the node twice. \
         NET_RX time is summed exactly per CPU between the softirq_entry and softirq_exit tracepoints (vec NET_RX_SOFTIRQ; the bench's raw tracepoint programs, attached only while the steps ran) and divided by the requests sent. \
         {} \
         A step is dropped when /proc/stat shows steal on CPU 0 or 1, or softnet_stat a backlog drop or time squeeze there, or the sender fell more than 10% short of the step's count.{xdp}\n{}",
        o.command,
        started.elapsed().as_secs_f64() / 60.0,
        kernel(),
        load_before,
        load_average(),
        thousands(rate as u64),
        o.flows,
        o.duration.as_secs_f64(),
        o.rounds,
        if o.pod_rx_on_node {
            "Client, LAN bridge and the pods' echo threads on CPU 0; the nodes' and their pods' receive processing (RPS) and the proxies on CPU 1."
        } else {
            "Client, LAN bridge and pods on CPU 0, the nodes' receive processing (RPS) and the proxies on CPU 1."
        },
        table(o, &results),
    );
    println!("{text}");
    if let Some(path) = &o.write {
        let marker = format!("kp-pps {}", o.section.as_deref().unwrap_or("in-place"));
        write_into(path, &marker, &text)?;
        eprintln!("wrote the table into {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prog(id: u64, kind: &str, name: &str, ns: u64, runs: u64) -> (u64, ProgInfo) {
        (
            id,
            ProgInfo {
                id,
                kind: kind.into(),
                name: name.into(),
                run_time_ns: ns,
                run_cnt: runs,
                pids: Vec::new(),
            },
        )
    }

    #[test]
    fn a_steps_programs_are_the_packet_programs_that_ran_for_it_summed_by_name() {
        let before: BTreeMap<u64, ProgInfo> = [
            prog(1, "sched_cls", "kp_np_external", 1_000, 10),
            prog(2, "sched_cls", "kp_np_from_pod", 0, 0),
            prog(3, "sched_cls", "kp_np_from_pod", 500, 5),
            prog(4, "raw_tracepoint", "kpb_sirq_exit", 0, 0),
            prog(5, "sched_cls", "kp_np_external", 0, 0),
        ]
        .into_iter()
        .collect();
        let after: BTreeMap<u64, ProgInfo> = [
            // 1,000 requests: 1,000 runs at 150 ns.
            prog(1, "sched_cls", "kp_np_external", 151_000, 1_010),
            // Two pods' veths share the echoes.
            prog(2, "sched_cls", "kp_np_from_pod", 60_000, 600),
            prog(3, "sched_cls", "kp_np_from_pod", 40_500, 405),
            // Not a packet program.
            prog(4, "raw_tracepoint", "kpb_sirq_exit", 9_000, 900),
            // Another row's program passing a stray frame.
            prog(5, "sched_cls", "kp_np_external", 400, 2),
            // Loaded during the step: no figure before it.
            prog(6, "xdp", "kp_np_xdp", 100, 1_000),
        ]
        .into_iter()
        .collect();
        let none = BTreeSet::new();
        assert_eq!(
            packet_runs(&before, &after, 1_000, &none, 7),
            vec![
                ("kp_np_external".to_string(), 1_000, 150_000),
                ("kp_np_from_pod".to_string(), 1_000, 100_000),
            ]
        );
        assert!(packet_runs(&before, &before, 1_000, &none, 7).is_empty());
        // Loaded before the lab, or held by another process: not the row's.
        let older: BTreeSet<u64> = [1].into_iter().collect();
        assert_eq!(
            packet_runs(&before, &after, 1_000, &older, 7),
            vec![("kp_np_from_pod".to_string(), 1_000, 100_000)]
        );
        let mut held = after.clone();
        if let Some(p) = held.get_mut(&2) {
            p.pids = vec![8];
        }
        assert_eq!(
            packet_runs(&before, &held, 1_000, &none, 7),
            vec![
                ("kp_np_external".to_string(), 1_000, 150_000),
                ("kp_np_from_pod".to_string(), 400, 40_000),
            ]
        );
    }
}
