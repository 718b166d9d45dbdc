//! `kp-bench compare`: kube-proxy-rs and upstream kube-proxy side by side,
//! in one run, on this machine, against one real kube-apiserver.
//!
//! A ratio between two proxies only holds when both ran in the same run on
//! the same machine: the table subcommands drive the model directly and
//! figures taken on another day differ by 4x (docs/upstream-baseline.md).
//! So this starts the control plane of the tests (kp-testkit: etcd +
//! kube-apiserver v1.36 in a lab namespace), creates N Services x 10
//! endpoints through the API (the kp-bench mix: NodePorts, eTP=Local
//! LoadBalancers, 5% session affinity, UDP ports), and runs each proxy
//! binary in turn in its own node namespace with the same flags (defaults
//! otherwise, as operators run them), measuring only through what both
//! export and the kernel shows:
//!
//! * first sync: process start -> `kubeproxy_sync_proxy_rules_duration_seconds_count`
//!   >= 1 and the last Service's ClusterIP in the ruleset read back;
//! * one endpoint replaced through the API -> the proxy's
//!   `kubeproxy_sync_proxy_rules_last_timestamp_seconds` of the sync that put
//!   the new address in the kernel (p50/p99); a Service added / deleted the same way;
//! * a burst of endpoint changes -> all of them in the kernel;
//! * CPU seconds to the first sync and while idle, RSS at the end and peak (VmHWM).
//!
//! `--only-ours` runs ours alone (see [`CompareArgs`]); `--connect` times
//! connects through both proxies' rules instead (connect.rs). `--write`
//! replaces the table between the `kp-compare MODE` markers of that file
//! (`kp-compare-ours MODE` with `--only-ours`, `kp-compare-ours-etcd MODE`
//! with `--via-etcd`, `kp-compare-against MODE` with `--against`,
//! `kp-connect-compare MODE` with `--connect`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::lab::{
    beside_bench, check_binary, date_utc, has_ip, load_average, now_unix, pct, secs, status_mib,
    write_into, Lab, Populated, Proxy, ENDPOINTS, IN_FLIGHT,
};
use anyhow::Result;
use futures::{StreamExt, TryStreamExt};

mod connect;
use kp_testkit::ControlPlaneOpts;
use kube::api::DeleteParams;
use serde_json::json;

/// `kp-bench compare`.
#[derive(clap::Args, Debug, Clone)]
pub struct CompareArgs {
    /// Services per run, comma-separated: each size in a lab of its own
    /// [default: 1000; 100,10000 with --connect].
    #[arg(long, value_delimiter = ',')]
    pub sizes: Option<Vec<u32>>,
    /// The proxy mode both proxies run in.
    #[arg(long, default_value = "nftables", value_parser = ["nftables", "iptables"])]
    pub mode: String,
    /// Endpoint changes timed through the API, each into a quiet proxy.
    #[arg(long, default_value_t = 50)]
    pub changes: usize,
    /// Endpoint changes of the burst (each Service once, at most N).
    #[arg(long, default_value_t = 1000)]
    pub burst: usize,
    /// Seconds each proxy is left alone for its idle CPU.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub idle: u64,
    /// How long a proxy may take to its first sync (upstream's iptables-nft
    /// mode needs ~95 min at 10k).
    #[arg(long, value_name = "SECS", default_value_t = FIRST_SYNC_WITHIN.as_secs())]
    pub first_sync_within: u64,
    /// Replaces the table between this bench's markers in FILE (appended
    /// when missing), e.g. BENCHMARKS.md.
    #[arg(long, value_name = "FILE")]
    pub write: Option<PathBuf>,
    /// Our binary (build first: cargo build --release -p kube-proxy-rs -p
    /// kp-bench).
    #[arg(long, value_name = "PATH", default_value_os_t = beside_bench())]
    pub ours: PathBuf,
    /// Runs ours alone, for sizes upstream cannot sync in useful time (50k:
    /// hours): the same first sync, changes, idle CPU and memory (no Service
    /// added or deleted, no burst), the split of its first sync from its
    /// log, and the API server's side (the time to write the objects, the
    /// requests throttled or failed, kube-apiserver's and etcd's RSS and
    /// etcd's database). The lab's service CIDR and NodePort range are
    /// widened for it.
    #[arg(long)]
    pub only_ours: bool,
    /// With --only-ours: gives a size up after writing its objects for that
    /// long (writing slows down as they add up: kube-apiserver's ClusterIP
    /// allocator), as a row of the table.
    #[arg(
        long,
        value_name = "SECS",
        requires = "only_ours",
        conflicts_with = "via_etcd"
    )]
    pub populate_within: Option<u64>,
    /// With --only-ours: writes the objects into etcd, as the API server
    /// stores them, so 100k is populated in minutes; the proxy still lists
    /// and watches them through kube-apiserver, its changes go through the
    /// API as before.
    #[arg(long, requires = "only_ours")]
    pub via_etcd: bool,
    /// Puts an earlier kube-proxy-rs build in upstream's place (the same
    /// lab, the same run): a change of ours measured before and after, as a
    /// ratio that holds.
    #[arg(long, value_name = "PATH", conflicts_with = "only_ours")]
    pub against: Option<PathBuf>,
    /// Connect latency through a ClusterIP programmed by each proxy instead,
    /// both running at the same time on their own node of one lab, against
    /// each client's floor (its server's pod IP, no Service); connects in
    /// interleaved rounds so background load hits every row alike.
    #[arg(long, conflicts_with_all = ["only_ours", "against"])]
    pub connect: bool,
    /// With --connect: connects per row.
    #[arg(long, default_value_t = 2000)]
    pub connects: usize,
    /// With --connect: rounds the connects are spread over.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub rounds: u64,
}

struct Opts {
    sizes: Vec<u32>,
    mode: String,
    changes: usize,
    burst: usize,
    idle: u64,
    write: Option<PathBuf>,
    ours: PathBuf,
    only_ours: bool,
    populate_within: Duration,
    via_etcd: bool,
    first_sync_within: Duration,
    /// `--against`: a kube-proxy-rs build in upstream's place.
    against: Option<PathBuf>,
}

/// How long a proxy may take to its first sync unless `--first-sync-within`
/// says otherwise.
const FIRST_SYNC_WITHIN: Duration = Duration::from_secs(3600);

/// What one proxy showed at one size.
#[derive(Default, Clone)]
struct Figures {
    first_sync: Duration,
    first_sync_cpu: f64,
    change: Vec<Duration>,
    add: Duration,
    delete: Duration,
    burst: Duration,
    idle_cpu: f64,
    rss_mib: f64,
    peak_mib: f64,
}

fn measure(lab: &Lab, o: &Opts, n: u32, upstream: bool, generation: &mut u32) -> Result<Figures> {
    let (p, mut f) = first_sync_and_changes(lab, o, n, upstream, generation)?;
    // A Service added, then deleted (each into a quiet proxy, as above).
    std::thread::sleep(Duration::from_millis(1500));
    let ip = "10.96.255.250";
    let t0 = now_unix();
    lab.create_service(
        json!({"metadata": {"name": "added"},
            "spec": {"clusterIP": ip, "ports": [{"port": 80, "targetPort": 8080}]}}),
        json!({"metadata": {"name": "added-x",
            "labels": {"kubernetes.io/service-name": "added"}},
            "addressType": "IPv4", "ports": [{"port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.250.0.1"], "conditions": {"ready": true}}]}),
    )?;
    f.add = p.programmed(t0, |r| has_ip(r, ip) && has_ip(r, "10.250.0.1"))?;
    std::thread::sleep(Duration::from_millis(1500));
    let t0 = now_unix();
    lab.rt.block_on(async {
        lab.services()
            .delete("added", &DeleteParams::default())
            .await?;
        lab.slices()
            .delete("added-x", &DeleteParams::default())
            .await?;
        anyhow::Ok(())
    })?;
    // Gone = no longer dispatched. Upstream leaves a deleted Service's
    // chain (iptables) or flushed chain (nftables) until its next full sync,
    // hourly in a cluster this size: in iptables mode only KUBE-SERVICES
    // tells.
    let dispatch = |l: &&str| o.mode != "iptables" || l.starts_with("-A KUBE-SERVICES ");
    f.delete = p.programmed(t0, |r| !r.lines().filter(dispatch).any(|l| has_ip(l, ip)))?;
    eprintln!(
        "  add {:.1} ms, delete {:.1} ms",
        secs(f.add) * 1e3,
        secs(f.delete) * 1e3
    );
    // A burst of endpoint changes, each Service once.
    std::thread::sleep(Duration::from_millis(1500));
    let burst = o.burst.min(n as usize);
    *generation += 1;
    let g = *generation;
    let t0 = now_unix();
    let wanted: Vec<String> = lab.rt.block_on(async {
        futures::stream::iter((0..burst as u32).map(|i| lab.patch_endpoints(i, g)))
            .buffer_unordered(32)
            .try_collect()
            .await
    })?;
    f.burst = p.programmed(t0, |r| wanted.iter().all(|a| has_ip(r, a)))?;
    eprintln!("  burst of {burst}: {:.2} s", secs(f.burst));
    idle_and_memory(&p, o, &mut f);
    p.guard.kill_hard();
    // The next proxy starts from a namespace of its own: nothing to clean.
    Ok(f)
}

/// Starts a proxy, waits for its first sync, times `o.changes` endpoint
/// changes; the proxy, still running.
fn first_sync_and_changes<'a>(
    lab: &'a Lab,
    o: &Opts,
    n: u32,
    upstream: bool,
    generation: &mut u32,
) -> Result<(Proxy<'a>, Figures)> {
    let node = if upstream { 2 } else { 1 };
    let who = if upstream { "upstream" } else { "ours" };
    let t_start = Instant::now();
    // --against: the earlier build runs where upstream would.
    let (is_upstream, binary) = match (&o.against, upstream) {
        (Some(earlier), true) => (false, earlier),
        _ => (upstream, &o.ours),
    };
    let p = lab.spawn_proxy(node, &o.mode, is_upstream, binary, &format!("{who}-{n}"))?;
    let first_sync = p.wait_first_sync(n, t_start, o.first_sync_within)?;
    let mut f = Figures {
        first_sync,
        first_sync_cpu: p.cpu_secs(),
        ..Figures::default()
    };
    eprintln!(
        "  first sync {:.2} s ({:.2} s CPU)",
        secs(f.first_sync),
        f.first_sync_cpu
    );
    // Let the proxy settle (its own follow-up syncs) before timing changes.
    std::thread::sleep(Duration::from_secs(2));
    for k in 0..o.changes {
        // One change into a quiet proxy: both pace syncs with a token bucket
        // (minSyncPeriod 1 s, burst 2); back-to-back changes would time the
        // pacing instead of the proxy.
        std::thread::sleep(Duration::from_millis(1500));
        *generation += 1;
        let i = (k as u32 * 7919) % n;
        let t0 = now_unix();
        let addr = lab.change(i, *generation)?;
        f.change.push(p.programmed(t0, |r| has_ip(r, &addr))?);
    }
    eprintln!(
        "  one change p50 {:.1} ms p99 {:.1} ms",
        secs(pct(&f.change, 0.5)) * 1e3,
        secs(pct(&f.change, 0.99)) * 1e3
    );
    Ok((p, f))
}

fn idle_and_memory(p: &Proxy, o: &Opts, f: &mut Figures) {
    std::thread::sleep(Duration::from_secs(2));
    let cpu0 = p.cpu_secs();
    std::thread::sleep(Duration::from_secs(o.idle));
    f.idle_cpu = p.cpu_secs() - cpu0;
    f.rss_mib = p.status_mib("VmRSS:");
    f.peak_mib = p.status_mib("VmHWM:");
}

/// What `--only-ours` saw at one size, beside ours' [`Figures`].
struct OursAlone {
    f: Figures,
    populate: Duration,
    written: Populated,
    /// From ours' log: process start -> "sources synced" (the lists from
    /// the API server, decoded), and the first sync's render and apply.
    listed: Option<f64>,
    render_apply_ms: Option<(f64, f64)>,
    /// One `nft list ruleset` (or iptables-save) at the end: MiB, seconds.
    readback: (f64, Duration),
    after_populate: Server,
    at_end: Server,
}

/// kube-apiserver's and etcd's memory (VmRSS, VmHWM, MiB) and etcd's
/// database file (MiB).
#[derive(Default)]
struct Server {
    api: (f64, f64),
    etcd: (f64, f64),
    db_mib: f64,
}

fn server(lab: &Lab) -> Server {
    let (etcd, api) = lab.cp.pids();
    let mem = |pid: Option<u32>| {
        pid.map_or((0.0, 0.0), |p| {
            let p = p.to_string();
            (status_mib(&p, "VmRSS:"), status_mib(&p, "VmHWM:"))
        })
    };
    let db = std::fs::metadata(lab.cp.etcd_dir().join("member/snap/db"));
    Server {
        api: mem(api),
        etcd: mem(etcd),
        db_mib: db.map_or(0.0, |m| m.len() as f64 / 1048576.0),
    }
}

/// kp-bench's mix needs a NodePort for 15% of its Services and a health
/// check port for another 5%: the default range (2768 ports) holds ~13.8k
/// Services of it, the default /16 of ClusterIPs 65k (kp-bench numbers them
/// from 10.96.0.10). Widened for `--only-ours`, which runs 50k and 100k.
fn ours_room(o: &mut ControlPlaneOpts) {
    o.service_cidrs = "10.96.0.0/15,fd00:96::/108".into();
    o.node_port_range = "30000-59999".into();
}

/// Seconds of the UTC day of a log line (`2026-11-27T13:45:01.123456Z ...`,
/// tracing's format).
fn day_secs(line: &str) -> Option<f64> {
    let t = line.split_whitespace().next()?.split('T').nth(1)?;
    let mut hms = t.trim_end_matches('Z').split(':');
    let mut next = || hms.next()?.parse::<f64>().ok();
    Some(next()? * 3600.0 + next()? * 60.0 + next()?)
}

/// `key=VALUE` of a log line.
fn field(line: &str, key: &str) -> Option<f64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))?
        .parse()
        .ok()
}

/// Ours' log: seconds from `started` (unix) to the sources synced, and the
/// first sync's render and apply ms.
fn log_phases(log: &Path, started: f64) -> (Option<f64>, Option<(f64, f64)>) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let listed = text
        .lines()
        .find(|l| l.contains("sources synced"))
        .and_then(day_secs)
        .map(|t| (t - started.rem_euclid(86400.0)).rem_euclid(86400.0));
    let first = text.lines().find(|l| l.contains("synced rules"));
    let phases = first.and_then(|l| Some((field(l, "render_ms")?, field(l, "apply_ms")?)));
    (listed, phases)
}

fn measure_ours(o: &Opts, n: u32) -> Result<OursAlone> {
    let mut lab = Lab::start("compare", false, ours_room)?;
    let t = Instant::now();
    let written = Populated::default();
    if o.via_etcd {
        lab.populate_etcd(n, &written)?;
    } else {
        lab.populate_within(n, o.populate_within, &written)?;
    }
    let populate = t.elapsed();
    eprintln!(
        "  {} {} in {:.1} s ({} throttled, {} failed)",
        if o.via_etcd { "objects" } else { "requests" },
        written.ok.load(Ordering::Relaxed),
        secs(populate),
        written.throttled.load(Ordering::Relaxed),
        written.failed.load(Ordering::Relaxed)
    );
    let after_populate = server(&lab);
    let started = now_unix();
    let (p, mut f) = first_sync_and_changes(&lab, o, n, false, &mut 0)?;
    let (listed, render_apply_ms) = log_phases(p.guard.log_path(), started);
    idle_and_memory(&p, o, &mut f);
    let t = Instant::now();
    let mib = p.ruleset().len() as f64 / 1048576.0;
    let readback = (mib, t.elapsed());
    let at_end = server(&lab);
    p.guard.kill_hard();
    Ok(OursAlone {
        f,
        populate,
        written,
        listed,
        render_apply_ms,
        readback,
        after_populate,
        at_end,
    })
}

/// `--first-sync-within` as given, for the command a table quotes.
fn first_sync_arg(o: &Opts) -> String {
    if o.first_sync_within == FIRST_SYNC_WITHIN {
        String::new()
    } else {
        format!(" --first-sync-within {}", o.first_sync_within.as_secs())
    }
}

/// `--sizes` as given: `1000,10000`.
fn sizes_arg(sizes: &[u32]) -> String {
    sizes
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn table_ours(o: &Opts, results: &BTreeMap<u32, Result<OursAlone>>) -> String {
    let mut out = format!(
        "Measured {} by `kp-bench compare --only-ours{} --sizes {} --mode {} --changes {} --idle {}{}{}` \
         ({} cores, load average {} at the end): kube-proxy-rs alone against kube-apiserver \
         v1.36.2 + etcd, N Services x {ENDPOINTS} endpoints (kp-bench's mix) {}, service \
         CIDR 10.96.0.0/15 and NodePorts \
         30000-59999 (the defaults hold ~13.8k Services of this mix). A change is timed to \
         the end of the sync that put it in the kernel, read back once per sync after it.\n\n\
         | N | what | figure |\n|---|---|---|\n",
        date_utc(),
        if o.via_etcd { " --via-etcd" } else { "" },
        sizes_arg(&o.sizes),
        o.mode,
        o.changes,
        o.idle,
        if o.populate_within < Duration::MAX {
            format!(" --populate-within {}", o.populate_within.as_secs())
        } else {
            String::new()
        },
        first_sync_arg(o),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average(),
        if o.via_etcd {
            "written into etcd first with the API server stopped, as it stores them (JSON), \
             with an IPAddress object per ClusterIP, NodePorts numbered from 30000 and their \
             bitmap, then listed through the restarted API server until all are there (its create path is quadratic in Services on 1.36)"
                .to_string()
        } else {
            format!(
                "written through the API first ({IN_FLIGHT} requests in flight, no rate limit of \
                 the client's; a 429 or a server error retried after 1 s)"
            )
        },
    );
    let mib = |(rss, peak): (f64, f64)| format!("{rss:.0} ({peak:.0}) MiB");
    for (n, r) in results {
        let a = match r {
            Ok(a) => a,
            Err(e) => {
                out.push_str(&format!("| {n} | failed | {e:#} |\n"));
                continue;
            }
        };
        let f = &a.f;
        let ok = a.written.ok.load(Ordering::Relaxed);
        let populated = if o.via_etcd {
            (
                "etcd written directly (Services, EndpointSlices, IPAddresses), then listed through the API server".to_string(),
                format!(
                    "{ok} objects in {:.1} s; transactions retried {}",
                    secs(a.populate),
                    a.written.failed.load(Ordering::Relaxed)
                ),
            )
        } else {
            (
                "API server populated (Services, LB status patches, EndpointSlices)".to_string(),
                format!(
                    "{ok} requests in {:.1} s ({:.0}/s); throttled (429) {}, failed {}",
                    secs(a.populate),
                    ok as f64 / secs(a.populate).max(1e-9),
                    a.written.throttled.load(Ordering::Relaxed),
                    a.written.failed.load(Ordering::Relaxed)
                ),
            )
        };
        let mut rows = vec![
            populated,
            (
                "first sync (start -> ruleset in the kernel)".into(),
                format!("{:.2} s", secs(f.first_sync)),
            ),
            (
                "of which start -> lists done (log); first sync render, apply".into(),
                format!(
                    "{}; {}",
                    a.listed.map_or("-".into(), |s| format!("{s:.2} s")),
                    a.render_apply_ms
                        .map_or("-".into(), |(r, w)| format!("{r:.0} ms, {w:.0} ms"))
                ),
            ),
            (
                "CPU to first sync".into(),
                format!("{:.2} s", f.first_sync_cpu),
            ),
        ];
        if !f.change.is_empty() {
            rows.push((
                "one endpoint change p50 / p99".into(),
                format!(
                    "{:.1} / {:.1} ms",
                    secs(pct(&f.change, 0.5)) * 1e3,
                    secs(pct(&f.change, 0.99)) * 1e3
                ),
            ));
        }
        rows.extend([
            (
                format!("CPU while idle {} s", o.idle),
                format!("{:.2} s", f.idle_cpu),
            ),
            (
                "kube-proxy-rs RSS at the end (peak)".into(),
                mib((f.rss_mib, f.peak_mib)),
            ),
            (
                "ruleset read back once at the end".into(),
                format!("{:.0} MiB in {:.2} s", a.readback.0, secs(a.readback.1)),
            ),
            (
                "kube-apiserver RSS (peak): after populating / at the end".into(),
                format!("{} / {}", mib(a.after_populate.api), mib(a.at_end.api)),
            ),
            (
                "etcd RSS (peak): after populating / at the end".into(),
                format!("{} / {}", mib(a.after_populate.etcd), mib(a.at_end.etcd)),
            ),
            (
                "etcd database file: after populating / at the end".into(),
                format!(
                    "{:.0} / {:.0} MiB",
                    a.after_populate.db_mib, a.at_end.db_mib
                ),
            ),
        ]);
        for (what, v) in rows {
            out.push_str(&format!("| {n} | {what} | {v} |\n"));
        }
    }
    out
}

/// `--only-ours`: each size in a lab of its own; a size that fails (the
/// API server or etcd giving up is a finding too) is a row of the table.
fn main_ours(o: &Opts) -> Result<()> {
    let mut results = BTreeMap::new();
    for &n in &o.sizes {
        eprintln!(
            "N = {n} ({} mode, ours alone): starting the control plane",
            o.mode
        );
        let r = measure_ours(o, n);
        if let Err(e) = &r {
            eprintln!("  failed: {e:#}");
        }
        results.insert(n, r);
        // After each size: a later one may take hours (see populate_within).
        let text = table_ours(o, &results);
        eprint!("{text}");
        if let Some(path) = &o.write {
            let marker = if o.via_etcd {
                "kp-compare-ours-etcd"
            } else {
                "kp-compare-ours"
            };
            write_into(path, &format!("{marker} {}", o.mode), &text)?;
            eprintln!("wrote the table into {}", path.display());
        }
    }
    Ok(())
}

fn row(out: &mut String, n: u32, mode: &str, what: &str, up: String, ours: String, ratio: f64) {
    let ratio = if ratio > 0.0 {
        format!("{ratio:.1}x")
    } else {
        "-".into()
    };
    out.push_str(&format!(
        "| {n} | {mode} | {what} | {up} | {ours} | {ratio} |\n"
    ));
}

fn table(o: &Opts, results: &BTreeMap<u32, (Figures, Figures)>) -> String {
    let (date, load) = (date_utc(), load_average());
    let mut out = format!(
        "Measured {date} by `kp-bench compare --sizes {} --mode {} --changes {} --burst {} --idle {}{}{}` \
         ({} cores, load average {} at the end): both proxies in the same run, on the same \
         machine, against the same kube-apiserver v1.36.2, N Services x {ENDPOINTS} endpoints \
         (kp-bench's mix). Ratio = {} / ours (above 1: ours is faster or smaller).\n\n\
         | N | mode | what | {} | kube-proxy-rs | ratio |\n|---|---|---|---|---|---|\n",
        sizes_arg(&o.sizes),
        o.mode,
        o.changes,
        o.burst,
        o.idle,
        first_sync_arg(o),
        o.against
            .as_ref()
            .map_or(String::new(), |p| format!(" --against {}", p.display())),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load,
        if o.against.is_some() {
            "the earlier build"
        } else {
            "upstream"
        },
        o.against.as_ref().map_or("upstream kube-proxy".to_string(), |p| {
            format!("kube-proxy-rs {}", p.display())
        }),
    );
    let ms = |d: Duration| format!("{:.1} ms", secs(d) * 1e3);
    let s = |d: Duration| format!("{:.2} s", secs(d));
    let r = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    for (n, (u, w)) in results {
        let m = o.mode.as_str();
        row(
            &mut out,
            *n,
            m,
            "first sync (start -> ruleset in the kernel)",
            s(u.first_sync),
            s(w.first_sync),
            r(secs(u.first_sync), secs(w.first_sync)),
        );
        row(
            &mut out,
            *n,
            m,
            "CPU to first sync",
            format!("{:.2} s", u.first_sync_cpu),
            format!("{:.2} s", w.first_sync_cpu),
            r(u.first_sync_cpu, w.first_sync_cpu),
        );
        for (label, p) in [
            ("one endpoint change p50", 0.5),
            ("one endpoint change p99", 0.99),
        ] {
            let (a, b) = (pct(&u.change, p), pct(&w.change, p));
            row(&mut out, *n, m, label, ms(a), ms(b), r(secs(a), secs(b)));
        }
        row(
            &mut out,
            *n,
            m,
            "Service added -> in the kernel",
            ms(u.add),
            ms(w.add),
            r(secs(u.add), secs(w.add)),
        );
        row(
            &mut out,
            *n,
            m,
            "Service deleted -> gone",
            ms(u.delete),
            ms(w.delete),
            r(secs(u.delete), secs(w.delete)),
        );
        row(
            &mut out,
            *n,
            m,
            &format!(
                "burst of {} changes -> all in the kernel",
                o.burst.min(*n as usize)
            ),
            s(u.burst),
            s(w.burst),
            r(secs(u.burst), secs(w.burst)),
        );
        row(
            &mut out,
            *n,
            m,
            &format!("CPU while idle {} s", o.idle),
            format!("{:.2} s", u.idle_cpu),
            format!("{:.2} s", w.idle_cpu),
            r(u.idle_cpu, w.idle_cpu),
        );
        row(
            &mut out,
            *n,
            m,
            "RSS at the end (peak)",
            format!("{:.0} ({:.0}) MiB", u.rss_mib, u.peak_mib),
            format!("{:.0} ({:.0}) MiB", w.rss_mib, w.peak_mib),
            r(u.peak_mib, w.peak_mib),
        );
    }
    out
}

/// `kp-bench compare`.
pub fn run(a: CompareArgs) -> Result<()> {
    if a.connect {
        return connect::run(connect::Opts {
            sizes: a.sizes.unwrap_or_else(|| vec![100, 10000]),
            mode: a.mode,
            connects: a.connects,
            rounds: a.rounds as usize,
            write: a.write,
            ours: a.ours,
        });
    }
    let o = Opts {
        sizes: a.sizes.unwrap_or_else(|| vec![1000]),
        mode: a.mode,
        changes: a.changes,
        burst: a.burst,
        idle: a.idle,
        write: a.write,
        ours: a.ours,
        only_ours: a.only_ours,
        populate_within: a.populate_within.map_or(Duration::MAX, Duration::from_secs),
        via_etcd: a.via_etcd,
        first_sync_within: Duration::from_secs(a.first_sync_within),
        against: a.against,
    };
    check_binary(&o.ours)?;
    if let Some(earlier) = &o.against {
        check_binary(earlier)?;
    }
    if o.only_ours {
        return main_ours(&o);
    }
    let mut results = BTreeMap::new();
    for &n in &o.sizes {
        eprintln!("N = {n} ({} mode): starting the control plane", o.mode);
        let lab = Lab::new("compare", true)?;
        let t = Instant::now();
        lab.populate(n)?;
        eprintln!("  {n} Services created in {:.1} s", secs(t.elapsed()));
        let mut generation = 0;
        eprintln!(
            " {}:",
            o.against
                .as_ref()
                .map_or("upstream kube-proxy".to_string(), |p| p
                    .display()
                    .to_string())
        );
        let up = measure(&lab, &o, n, true, &mut generation)?;
        eprintln!(" kube-proxy-rs:");
        let ours = measure(&lab, &o, n, false, &mut generation)?;
        results.insert(n, (up, ours));
    }
    let text = table(&o, &results);
    print!("{text}");
    if let Some(path) = &o.write {
        let marker = if o.against.is_some() {
            format!("kp-compare-against {}", o.mode)
        } else {
            format!("kp-compare {}", o.mode)
        };
        write_into(path, &marker, &text)?;
        eprintln!("wrote the table into {}", path.display());
    }
    Ok(())
}
