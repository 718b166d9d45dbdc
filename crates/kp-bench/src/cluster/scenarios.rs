//! The scenarios, each on a running [`Fleet`]: all K started at once, a
//! steady stream of endpoint changes then a burst, the API server restarted
//! under them, and the largest K that fits.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::jiff::Timestamp;
use kp_netlab::Cluster;
use kp_testkit::ControlPlane;
use kube::api::{Patch, PatchParams};
use serde_json::json;

use super::monitor::Monitor;
use super::nodes::Fleet;
use super::server::{self, ServerFigures};
use super::{interrupted, sleep, ClusterArgs, Kind, PROBE_IP, PROBE_PORT};
use crate::lab::{now_unix, Lab, ENDPOINTS};

/// The annotation the EndpointSlice controller writes on each change and
/// both proxies' `kubeproxy_network_programming_duration_seconds` measure from.
const TRIGGER: &str = "endpoints.kubernetes.io/last-change-trigger-time";
const PROGRAMMING: &str = "kubeproxy_network_programming_duration_seconds";

/// Scenario 1.
#[derive(Clone, Debug, Default)]
pub struct StartFigures {
    /// Per node: seconds from its proxy's start to its kernel serving the
    /// last Service.
    pub served: Vec<f64>,
    pub server: ServerFigures,
    /// Per proxy once all served: VmRSS (MiB) and CPU seconds.
    pub proxy_rss_mib: Vec<f64>,
    pub proxy_cpu: Vec<f64>,
}

pub fn start<'a>(
    cluster: &'a Cluster,
    lab: &Lab,
    mon: &Monitor,
    kind: Kind,
    args: &ClusterArgs,
    ours: &std::path::Path,
) -> Result<(Fleet<'a>, StartFigures)> {
    // The server's own controllers settle between runs.
    sleep(Duration::from_secs(3))?;
    let last_ip: Ipv4Addr = crate::cluster_ip(args.services - 1)
        .parse()
        .context("the last ClusterIP")?;
    let watch = mon.watch(last_ip);
    let before = server::read(lab)?;
    server::reset_peak(lab)?;
    let fleet = Fleet::start(cluster, lab, kind, ours, args.nodes, "start")?;
    let served = fleet.wait_served(
        mon,
        watch,
        last_ip,
        Duration::from_secs(args.start_within),
        0.0,
    )?;
    // Every list done and every watch open (a proxy's Node and ServiceCIDR
    // informers may finish after its first sync).
    sleep(Duration::from_secs(5))?;
    let after = server::read(lab)?;
    // On stderr, what the K proxies asked of the server and it of etcd.
    for name in ["apiserver_request_total", "etcd_requests_total"] {
        for (labels, d) in server::moved(&before, &after, name).iter().take(12) {
            eprintln!("    {} {name}{labels} +{d}", kind.label());
        }
    }
    let fig = StartFigures {
        served,
        server: server::delta(lab, &before, &after),
        proxy_rss_mib: fleet
            .proxies
            .iter()
            .map(|p| p.status_mib("VmRSS:"))
            .collect(),
        proxy_cpu: fleet.proxies.iter().map(|p| p.cpu_secs()).collect(),
    };
    Ok((fleet, fig))
}

/// Scenario 2: network programming latency, change -> each node's kernel.
#[derive(Clone, Debug, Default)]
pub struct ChangeFigures {
    /// Seconds, one per (change, node) seen.
    pub steady: Vec<f64>,
    pub burst: Vec<f64>,
    /// (change, node) pairs never seen within the wait.
    pub missed: usize,
    /// Per node: samples measured.
    pub per_node: Vec<usize>,
    /// First write of the burst -> its last change on the last node.
    pub burst_all: f64,
    /// The proxies' own histogram over the stream and over the burst,
    /// all nodes summed: (p50, p99, count).
    pub own_steady: (Option<f64>, Option<f64>, f64),
    pub own_burst: (Option<f64>, Option<f64>, f64),
}

/// Per-Service generation of its EndpointSlice (each change moves one
/// endpoint to an address the Service never had just before).
pub struct Generations(pub Vec<u32>);

struct Change {
    watch: usize,
    t0: f64,
}

async fn write_change(lab: &Lab, mon: &Monitor, i: u32, g: u32) -> Result<Change> {
    let s = crate::slice(i, ENDPOINTS, g, i % 10 == 3);
    let addr: Ipv4Addr = crate::moved_address(&s)
        .parse()
        .context("a moved address")?;
    let watch = mon.watch(addr);
    let now = Timestamp::now();
    let t0 = now.as_nanosecond() as f64 / 1e9;
    lab.slices()
        .patch(
            &format!("svc-{i}-x"),
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"annotations": {TRIGGER: now.to_string()}},
                "endpoints": s["endpoints"]})),
        )
        .await
        .with_context(|| format!("patching svc-{i}-x"))?;
    Ok(Change { watch, t0 })
}

/// Waits (at most `limit`) until every change is seen on every node; the
/// latencies, the per-node counts, the latest arrival, and how many were missed.
fn collect(
    mon: &Monitor,
    k: usize,
    changes: &[Change],
    limit: Duration,
) -> Result<(Vec<f64>, Vec<usize>, f64, usize)> {
    let t = Instant::now();
    loop {
        let all = changes
            .iter()
            .all(|c| (1..=k).all(|n| mon.seen(n, c.watch).is_some()));
        if all || t.elapsed() > limit {
            break;
        }
        if interrupted() {
            bail!("interrupted");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (mut lat, mut per_node, mut last, mut missed) = (Vec::new(), vec![0; k], 0.0f64, 0);
    for c in changes {
        for n in 1..=k {
            match mon.seen(n, c.watch) {
                Some(at) => {
                    lat.push((at - c.t0).max(0.0));
                    per_node[n - 1] += 1;
                    last = last.max(at);
                }
                None => missed += 1,
            }
        }
    }
    mon.clear();
    Ok((lat, per_node, last, missed))
}

fn own_histogram(fleet: &Fleet) -> Vec<(f64, f64)> {
    let mut sum: Vec<(f64, f64)> = Vec::new();
    for m in fleet.metrics() {
        for (le, c) in server::buckets(&m, PROGRAMMING) {
            match sum.iter_mut().find(|(l, _)| *l == le) {
                Some(e) => e.1 += c,
                None => sum.push((le, c)),
            }
        }
    }
    sum.sort_by(|a, b| a.0.total_cmp(&b.0));
    sum
}

fn own(after: &[(f64, f64)], before: &[(f64, f64)]) -> (Option<f64>, Option<f64>, f64) {
    let d = server::bucket_delta(after, before);
    (
        server::quantile(&d, 0.5),
        server::quantile(&d, 0.99),
        d.last().map_or(0.0, |b| b.1),
    )
}

pub fn changes(
    lab: &Lab,
    mon: &Monitor,
    fleet: &Fleet,
    args: &ClusterArgs,
    gens: &mut Generations,
) -> Result<ChangeFigures> {
    let (n, k) = (args.services, args.nodes);
    // Follow-up syncs of the start are over.
    sleep(Duration::from_secs(3))?;
    fleet.check_running()?;
    let h0 = own_histogram(fleet);
    let mut steady = Vec::new();
    let every = Duration::from_millis(args.change_every_ms);
    let t = Instant::now();
    for c in 0..args.changes {
        // On a schedule, not after the previous one is seen: a stream.
        let due = every * c as u32;
        if let Some(wait) = due.checked_sub(t.elapsed()) {
            sleep(wait)?;
        }
        let i = (c as u32 * 7919) % n;
        gens.0[i as usize] += 1;
        steady.push(
            lab.rt
                .block_on(write_change(lab, mon, i, gens.0[i as usize]))?,
        );
    }
    let (steady_lat, per_node, _, missed_steady) =
        collect(mon, k, &steady, Duration::from_secs(args.seen_within))?;
    // Let the proxies' metrics catch up with the kernels.
    sleep(Duration::from_secs(2))?;
    let h1 = own_histogram(fleet);
    sleep(Duration::from_secs(2))?;
    let burst_n = args.burst.min(n as usize) as u32;
    let ids: Vec<(u32, u32)> = (0..burst_n)
        .map(|b| {
            let i = (b * 31 + 17) % n;
            gens.0[i as usize] += 1;
            (i, gens.0[i as usize])
        })
        .collect();
    let t_burst = now_unix();
    let burst: Vec<Change> = lab.rt.block_on(async {
        futures::stream::iter(ids.iter().map(|&(i, g)| write_change(lab, mon, i, g)))
            .buffer_unordered(crate::lab::IN_FLIGHT)
            .try_collect()
            .await
    })?;
    let (burst_lat, per_node_b, last, missed_burst) =
        collect(mon, k, &burst, Duration::from_secs(args.seen_within))?;
    sleep(Duration::from_secs(2))?;
    let h2 = own_histogram(fleet);
    Ok(ChangeFigures {
        steady: steady_lat,
        burst: burst_lat,
        missed: missed_steady + missed_burst,
        per_node: per_node
            .iter()
            .zip(&per_node_b)
            .map(|(a, b)| a + b)
            .collect(),
        burst_all: (last - t_burst).max(0.0),
        own_steady: own(&h1, &h0),
        own_burst: own(&h2, &h1),
    })
}

/// Scenario 3.
#[derive(Clone, Debug, Default)]
pub struct RestartFigures {
    pub requests: u64,
    pub failed: u64,
    /// Nodes with at least one failed request.
    pub failed_nodes: usize,
    /// Per node: nf_tables rules and set elements written in the window.
    pub rule_changes: Vec<u64>,
    /// Per node: transactions committed in the window.
    pub commits: Vec<u64>,
    /// The API server down -> ready again, seconds.
    pub down: f64,
    /// The window: API server stopped -> counting ended, seconds.
    pub window: f64,
}

fn probe(ns: &str) -> bool {
    let addr = SocketAddr::new(PROBE_IP.into(), PROBE_PORT);
    kp_netlab::tcp_hello(ns, addr, Duration::from_secs(2)).is_ok()
}

pub fn restart(
    cluster: &Cluster,
    cp: &mut ControlPlane,
    mon: &Monitor,
    fleet: &Fleet,
    args: &ClusterArgs,
) -> Result<RestartFigures> {
    let k = args.nodes;
    let nss: Vec<String> = (1..=k).map(|i| cluster.node_ns(i).to_string()).collect();
    // The probe Service answers on every node before the window opens.
    let t = Instant::now();
    while !nss.iter().all(|ns| probe(ns)) {
        if t.elapsed() > Duration::from_secs(60) {
            bail!("the probe Service {PROBE_IP}:{PROBE_PORT} does not answer on every node");
        }
        sleep(Duration::from_millis(500))?;
    }
    sleep(Duration::from_secs(2))?;
    let stop = AtomicBool::new(false);
    let (requests, failed) = (AtomicU64::new(0), AtomicU64::new(0));
    let failed_per_node: Vec<AtomicU64> = (0..k).map(|_| AtomicU64::new(0)).collect();
    let before: Vec<_> = (1..=k).map(|i| mon.counts(i)).collect();
    let t0 = Instant::now();
    let result = std::thread::scope(|s| {
        for (ns, f) in nss.iter().zip(&failed_per_node) {
            let (stop, requests, failed) = (&stop, &requests, &failed);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    requests.fetch_add(1, Ordering::Relaxed);
                    if !probe(ns) {
                        failed.fetch_add(1, Ordering::Relaxed);
                        f.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
        }
        let r = (|| {
            sleep(Duration::from_secs(2))?;
            let down = Instant::now();
            cp.stop_apiserver();
            sleep(Duration::from_secs(args.down_secs))?;
            cp.start_apiserver()
                .context("starting the API server again")?;
            let down = down.elapsed();
            sleep(Duration::from_secs(args.after_restart_secs))?;
            anyhow::Ok(down)
        })();
        stop.store(true, Ordering::Relaxed);
        r
    });
    let window = t0.elapsed();
    let down = result?;
    fleet.check_running()?;
    let after: Vec<_> = (1..=k).map(|i| mon.counts(i)).collect();
    Ok(RestartFigures {
        requests: requests.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        failed_nodes: failed_per_node
            .iter()
            .filter(|f| f.load(Ordering::Relaxed) > 0)
            .count(),
        rule_changes: after
            .iter()
            .zip(&before)
            .map(|(a, b)| a.rule_changes - b.rule_changes)
            .collect(),
        commits: after
            .iter()
            .zip(&before)
            .map(|(a, b)| a.commits - b.commits)
            .collect(),
        down: down.as_secs_f64(),
        window: window.as_secs_f64(),
    })
}

/// Scenario 4: one step of `--fit`.
#[derive(Clone, Debug)]
pub struct FitStep {
    pub kind: Kind,
    pub k: usize,
    /// All K served within `--start-within`.
    pub served: bool,
    /// Slowest node's start -> served, seconds.
    pub slowest: f64,
    /// MemAvailable before the start and once all served, MiB.
    pub avail_before: f64,
    pub avail_after: f64,
    /// The K proxies' VmRSS summed, MiB.
    pub proxies_rss: f64,
    pub note: String,
}

/// MemAvailable, MiB.
pub fn mem_available() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))?
                .split_whitespace()
                .nth(1)?
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

pub fn fit_step(
    cluster: &Cluster,
    lab: &Lab,
    mon: &Monitor,
    kind: Kind,
    k: usize,
    args: &ClusterArgs,
    ours: &std::path::Path,
) -> Result<FitStep> {
    sleep(Duration::from_secs(3))?;
    let last_ip: Ipv4Addr = crate::cluster_ip(args.services - 1)
        .parse()
        .context("the last ClusterIP")?;
    let watch = mon.watch(last_ip);
    let avail_before = mem_available();
    let fleet = Fleet::start(cluster, lab, kind, ours, k, &format!("fit{k}"))?;
    // Half the reserve: a step that eats into it has not fitted, and
    // stopping there keeps the kernel's OOM killer away.
    let r = fleet.wait_served(
        mon,
        watch,
        last_ip,
        Duration::from_secs(args.start_within),
        args.fit_reserve_mib / 2.0,
    );
    let step = FitStep {
        kind,
        k,
        served: r.is_ok(),
        slowest: r
            .as_ref()
            .map_or(0.0, |s| s.iter().copied().fold(0.0, f64::max)),
        avail_before,
        avail_after: mem_available(),
        proxies_rss: fleet.proxies.iter().map(|p| p.status_mib("VmRSS:")).sum(),
        note: r.err().map_or(String::new(), |e| format!("{e:#}")),
    };
    mon.clear();
    fleet.stop()?;
    Ok(step)
}
