//! `kp-bench cluster`: K proxies against one API server, upstream's and
//! ours side by side in one run (issue 63 item 3).
//!
//! One real kube-apiserver v1.36 + etcd 3.5 (kp-testkit's control plane, in
//! the lab namespace of [`crate::lab::Lab`]) holds N Services x 10 endpoints
//! (kp-bench's mix). K node namespaces hang off the lab's bridge by one veth
//! each; each runs its own proxy (nftables mode, the same flags for both,
//! its own kubeconfig, `--hostname-override=nodeI`, a Node object each)
//! programming its own kernel. Upstream's K run first, then ours, on the
//! same control plane and nodes (rules flushed between). Scenarios:
//!
//! 1. `start`: all K started at once. The API server's CPU seconds and peak
//!    RSS, etcd list calls, LIST and watch bytes (its /metrics), and the time
//!    until every node's kernel serves the last Service's ClusterIP.
//! 2. `changes`: a steady stream of endpoint changes, then a burst. Each
//!    EndpointSlice is written with `endpoints.kubernetes.io/last-change-trigger-time`
//!    = the change's time (as the EndpointSlice controller does), so both
//!    proxies' `kubeproxy_network_programming_duration_seconds` measure it;
//!    beside it, p50/p99 from that time to each node's kernel notifying the
//!    new address (nf_tables' multicast group, see [`monitor`]).
//! 3. `restart`: the API server killed and started again under them, while
//!    a client on every node connects through a Service to a backend on its
//!    own node (internalTrafficPolicy Local): failed requests and nf_tables
//!    rules written per node in the window.
//! 4. `--fit`: K stepped up (`--fit-steps`) for each; a step fits when all
//!    K serve and MemAvailable stays above `--fit-reserve-mib` (a step is
//!    given up when it falls below half of that, before the OOM killer).
//!
//! `--repeat-start R` runs the start R more times, alternating which kind
//! goes first, for the control plane's CPU as a median. Each start prints
//! on stderr the API requests and etcd requests it caused.
//!
//! Run as root: `sudo target/release/kp-bench cluster --nodes 10 --services 2000`
//! (build first: `cargo build --release -p kube-proxy-rs -p kp-bench`;
//! UPSTREAM_KUBE_PROXY_BIN, KUBE_APISERVER_BIN, KUBECTL_BIN, ETCD_BIN as
//! for the tests: ETCD_BIN an etcd 3.5, as test.sh unpacks into
//! target/etcd-3.5; over Debian's 3.4 kube-apiserver v1.36 cannot stream
//! lists and both proxies list instead). Ctrl-C stops it and removes every
//! namespace and process.

mod monitor;
mod nodes;
mod scenarios;
mod server;
mod table;

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kp_netlab::ServeSpec;
use serde_json::json;

pub use scenarios::{ChangeFigures, FitStep, RestartFigures, StartFigures};
pub use server::ServerFigures;

/// The probe Service of the restart scenario.
pub const PROBE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 255, 200);
pub const PROBE_PORT: u16 = 80;
const PROBE_BACKEND_PORT: u16 = 8080;
/// kp-netlab's largest lab (a bridge's 1,024 ports).
pub const MAX_NODES: usize = 1000;

/// A scenario of [`ClusterArgs::scenarios`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// All K proxies started at once.
    Start,
    /// A steady stream of endpoint changes, then a burst.
    Changes,
    /// The API server restarted under them.
    Restart,
}

#[derive(clap::Args, Clone, Debug)]
pub struct ClusterArgs {
    /// Node namespaces, each with its own proxy (K).
    #[arg(long, default_value_t = 10)]
    pub nodes: usize,
    /// Services in the API server, 10 endpoints each (N; kp-bench's mix).
    #[arg(long, default_value_t = 2000)]
    pub services: u32,
    /// kube-proxy-rs binary [default: kube-proxy-rs beside this binary].
    #[arg(long)]
    pub ours: Option<PathBuf>,
    /// Scenarios to run on each kind of proxy, in this order (`start` always runs).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "start,changes,restart"
    )]
    pub scenarios: Vec<Scenario>,
    /// Endpoint changes in the steady stream.
    #[arg(long, default_value_t = 30)]
    pub changes: usize,
    /// Milliseconds between two changes of the steady stream.
    #[arg(long, default_value_t = 1000)]
    pub change_every_ms: u64,
    /// Endpoint changes written at once after the stream (at most N).
    #[arg(long, default_value_t = 200)]
    pub burst: usize,
    /// Seconds the API server stays down in the restart scenario.
    #[arg(long, default_value_t = 10)]
    pub down_secs: u64,
    /// Seconds after the API server is ready again that the restart window lasts.
    #[arg(long, default_value_t = 20)]
    pub after_restart_secs: u64,
    /// Seconds the stream's changes, then the burst's, may take to reach every node.
    #[arg(long, default_value_t = 300)]
    pub seen_within: u64,
    /// Seconds all K proxies may take to serve the last Service.
    #[arg(long, default_value_t = 900)]
    pub start_within: u64,
    /// Also find the largest K that fits this machine's memory, for each kind.
    #[arg(long)]
    pub fit: bool,
    /// K values --fit tries, ascending (the lab holds at most 1,000 nodes).
    #[arg(long, value_delimiter = ',', default_value = "10,20,40,60,89")]
    pub fit_steps: Vec<usize>,
    /// With --fit: stop when MemAvailable falls below this many MiB with all K running.
    #[arg(long, default_value_t = 4096.0)]
    pub fit_reserve_mib: f64,
    /// Runs the start scenario this many more times after the others,
    /// alternating which kind goes first, for the API server's CPU as a
    /// median instead of one reading.
    #[arg(long, default_value_t = 0)]
    pub repeat_start: usize,
    /// Replace the tables between the `kp-cluster` markers of this file.
    #[arg(long)]
    pub write: Option<PathBuf>,
}

/// Which proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Upstream,
    Ours,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Upstream => "upstream",
            Kind::Ours => "ours",
        }
    }
}

/// One kind's figures; a scenario not run (or failed: `errors`) is None.
#[derive(Clone, Debug, Default)]
pub struct Side {
    pub start: Option<StartFigures>,
    pub changes: Option<ChangeFigures>,
    pub restart: Option<RestartFigures>,
    pub errors: Vec<String>,
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct Report {
    pub args: ClusterArgs,
    pub upstream: Side,
    pub ours: Side,
    pub fit: Vec<FitStep>,
    /// `--repeat-start`: each start's kind, the control plane's figures and
    /// the slowest node, in the order run.
    pub repeats: Vec<(Kind, ServerFigures, f64)>,
    /// Seconds to write the N Services.
    pub populate: f64,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// SIGINT and SIGTERM end the run through an error: the lab's guards then
/// drop (processes killed, namespaces removed) as on any failure.
fn install_interrupt_handler() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

pub(crate) fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// Sleeps `d`, or fails early when interrupted.
pub(crate) fn sleep(d: Duration) -> Result<()> {
    let end = std::time::Instant::now() + d;
    loop {
        if interrupted() {
            bail!("interrupted");
        }
        let left = end.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        std::thread::sleep(left.min(Duration::from_millis(100)));
    }
}

/// Runs the bench, prints its tables (stdout) and writes them with `--write`.
pub fn run(args: ClusterArgs) -> Result<()> {
    let report = measure(args)?;
    let text = table::render(&report);
    print!("{text}");
    if let Some(path) = &report.args.write {
        crate::lab::write_into(path, "kp-cluster", &text)?;
        eprintln!("wrote the tables into {}", path.display());
    }
    Ok(())
}

/// The probe Service (internalTrafficPolicy Local) with one endpoint per
/// node: the node's own address, where a backend listens.
fn probe_objects(lab: &crate::lab::Lab, nodes: usize) -> (serde_json::Value, serde_json::Value) {
    let endpoints: Vec<serde_json::Value> = (1..=nodes)
        .map(|i| {
            json!({"addresses": [lab.cluster.node_ip(i).to_string()],
                   "nodeName": format!("node{i}"), "conditions": {"ready": true}})
        })
        .collect();
    (
        json!({"metadata": {"name": "probe"},
            "spec": {"clusterIP": PROBE_IP.to_string(), "internalTrafficPolicy": "Local",
                     "ports": [{"name": "http", "port": PROBE_PORT, "targetPort": PROBE_BACKEND_PORT}]}}),
        json!({"metadata": {"name": "probe-x", "labels": {"kubernetes.io/service-name": "probe"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": PROBE_BACKEND_PORT, "protocol": "TCP"}],
            "endpoints": endpoints}),
    )
}

/// Runs every scenario asked for on one kind; a failure ends that kind's
/// scenarios (its error reported), not the run.
fn side(
    lab: &mut crate::lab::Lab,
    mon: &monitor::Monitor,
    kind: Kind,
    args: &ClusterArgs,
    ours: &std::path::Path,
    gens: &mut scenarios::Generations,
) -> Side {
    let mut s = Side::default();
    eprintln!("{}: starting {} proxies", kind.label(), args.nodes);
    let lab = &mut *lab;
    let cluster = &lab.cluster;
    let started = scenarios::start(cluster, lab, mon, kind, args, ours);
    let fleet = match started {
        Ok((fleet, f)) => {
            eprintln!(
                "  all {} served after {:.1} s; API server CPU {:.1} s",
                args.nodes,
                f.served.iter().copied().fold(0.0, f64::max),
                f.server.api_cpu
            );
            s.start = Some(f);
            fleet
        }
        Err(e) => {
            eprintln!("  start failed: {e:#}");
            s.errors.push(format!("start: {e:#}"));
            mon.clear();
            return s;
        }
    };
    if args.scenarios.contains(&Scenario::Changes) {
        match scenarios::changes(lab, mon, &fleet, args, gens) {
            Ok(f) => {
                eprintln!(
                    "  changes: {} + {} samples, {} missed",
                    f.steady.len(),
                    f.burst.len(),
                    f.missed
                );
                s.changes = Some(f);
            }
            Err(e) => {
                eprintln!("  changes failed: {e:#}");
                s.errors.push(format!("changes: {e:#}"));
            }
        }
    }
    if args.scenarios.contains(&Scenario::Restart) {
        match scenarios::restart(cluster, &mut lab.cp, mon, &fleet, args) {
            Ok(f) => {
                eprintln!(
                    "  restart: {} of {} requests failed, rules written {:?}",
                    f.failed, f.requests, f.rule_changes
                );
                s.restart = Some(f);
            }
            Err(e) => {
                eprintln!("  restart failed: {e:#}");
                s.errors.push(format!("restart: {e:#}"));
            }
        }
    }
    mon.clear();
    if let Err(e) = fleet.stop() {
        s.errors.push(format!("stopping: {e:#}"));
    }
    s
}

/// `--repeat-start`: round r starts ours first when r is odd, upstream
/// first when even (the run's first round was upstream's), each fleet
/// stopped before the next.
fn repeat_start(
    lab: &crate::lab::Lab,
    mon: &monitor::Monitor,
    args: &ClusterArgs,
    ours: &std::path::Path,
) -> Result<Vec<(Kind, ServerFigures, f64)>> {
    let mut out = Vec::new();
    for round in 1..=args.repeat_start {
        let order = if round % 2 == 1 {
            [Kind::Ours, Kind::Upstream]
        } else {
            [Kind::Upstream, Kind::Ours]
        };
        for kind in order {
            let (fleet, f) = scenarios::start(&lab.cluster, lab, mon, kind, args, ours)
                .with_context(|| format!("start {round} of {}", kind.label()))?;
            let slowest = f.served.iter().copied().fold(0.0, f64::max);
            eprintln!(
                "repeat {round}: {} served after {slowest:.1} s; API server CPU {:.2} s, etcd {:.2} s",
                kind.label(),
                f.server.api_cpu,
                f.server.etcd_cpu
            );
            out.push((kind, f.server, slowest));
            mon.clear();
            fleet.stop()?;
        }
    }
    Ok(out)
}

/// `--fit`: each kind at each K of `--fit-steps` until one does not fit.
fn fit(
    lab: &crate::lab::Lab,
    mon: &monitor::Monitor,
    args: &ClusterArgs,
    ours: &std::path::Path,
) -> Result<Vec<FitStep>> {
    let mut steps = Vec::new();
    for kind in [Kind::Upstream, Kind::Ours] {
        for &k in &args.fit_steps {
            eprintln!("fit: {} x {k}", kind.label());
            let step = scenarios::fit_step(&lab.cluster, lab, mon, kind, k, args, ours)?;
            let fits = step.served && step.avail_after >= args.fit_reserve_mib;
            eprintln!(
                "  served {} (slowest {:.1} s), MemAvailable {:.0} -> {:.0} MiB, proxies {:.0} MiB",
                step.served, step.slowest, step.avail_before, step.avail_after, step.proxies_rss
            );
            steps.push(step);
            if !fits {
                break;
            }
        }
    }
    Ok(steps)
}

/// Builds the lab, runs the scenarios on upstream's proxies then ours, and
/// `--fit`; the figures.
pub fn measure(args: ClusterArgs) -> Result<Report> {
    install_interrupt_handler();
    let ours = match &args.ours {
        Some(p) => p.clone(),
        None => nodes::default_ours()?,
    };
    nodes::check_ours(&ours)?;
    if args.services == 0 || args.nodes == 0 {
        bail!("--nodes and --services must be at least 1");
    }
    let fit_max = if args.fit {
        args.fit_steps.iter().copied().max().unwrap_or(0)
    } else {
        0
    };
    let lab_nodes = args.nodes.max(fit_max);
    if lab_nodes > MAX_NODES {
        bail!("the lab holds at most {MAX_NODES} nodes (a bridge's ports), {lab_nodes} asked");
    }
    eprintln!(
        "starting the control plane and {lab_nodes} node namespaces ({} Services)",
        args.services
    );
    let mut lab = crate::lab::Lab::start_nodes("cluster", true, lab_nodes, |_| {})?;
    // Ctrl-C while the lab was built: its guards clean up from here.
    sleep(Duration::ZERO)?;
    let t = std::time::Instant::now();
    lab.populate(args.services)?;
    sleep(Duration::ZERO)?;
    let populate = t.elapsed().as_secs_f64();
    eprintln!("  {} Services written in {populate:.1} s", args.services);
    let (svc, slice) = probe_objects(&lab, lab_nodes);
    lab.create_service(svc, slice)
        .context("creating the probe Service")?;
    let _backends: Vec<kp_netlab::ServerGuard> = (1..=lab_nodes)
        .map(|i| {
            lab.cluster.serve(
                lab.cluster.node_ns(i),
                &format!("node{i}"),
                ServeSpec::tcp(&[PROBE_BACKEND_PORT]),
            )
        })
        .collect::<Result<_, _>>()
        .context("starting the probe's backends")?;
    let nss: Vec<String> = (1..=lab_nodes)
        .map(|i| lab.cluster.node_ns(i).to_string())
        .collect();
    let mon = monitor::Monitor::start(&nss)?;
    let mut gens = scenarios::Generations(vec![0; args.services as usize]);
    let upstream = side(&mut lab, &mon, Kind::Upstream, &args, &ours, &mut gens);
    // Ctrl-C ends the run (the guards clean up), not just a scenario.
    sleep(Duration::ZERO)?;
    let ours_side = side(&mut lab, &mon, Kind::Ours, &args, &ours, &mut gens);
    sleep(Duration::ZERO)?;
    let repeats = repeat_start(&lab, &mon, &args, &ours)?;
    sleep(Duration::ZERO)?;
    let fit = if args.fit {
        fit(&lab, &mon, &args, &ours)?
    } else {
        Vec::new()
    };
    Ok(Report {
        args,
        upstream,
        ours: ours_side,
        fit,
        repeats,
        populate,
    })
}
