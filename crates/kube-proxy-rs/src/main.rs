//! kube-proxy-rs: the binary, as wiring. Load the configuration, build one
//! dataplane per family (`modes/`), then: `--cleanup`, `--dry-run`
//! (`cli/dryrun.rs`), or start the source, the HTTP servers and the sync loop
//! (kp-sync). `--init-only` is `host::init_only`; NodeCIDR waiting is
//! `kube/node.rs`.

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

use std::net::IpAddr;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use kp_model::{Dataplane, ProxierConfig};
use kp_sync::{
    Conntrack, ConntrackCli, ConntrackNetlink, FamilyProxier, ProgrammedState, Stop, SyncLoop,
    SystemClock,
};
use kube_proxy_rs::config::{self, ConfigError, DetectLocalMode, ProxyConfig, ProxyMode};
use kube_proxy_rs::http::debug::DebugState;
use kube_proxy_rs::http::health::ServiceHealthServer;
use kube_proxy_rs::http::server::{self, HealthState};
use kube_proxy_rs::kube::node::{self, HostIpsWatch, PodCidrWatch};
use kube_proxy_rs::kube::{events, source};
use kube_proxy_rs::metrics::Metrics;
use kube_proxy_rs::modes::{self, FAMILIES};
use kube_proxy_rs::{cli, host};

// mimalloc instead of glibc malloc: at 10k-50k Services a sync allocates and
// frees millions of small strings, and glibc's chunk consolidation was the
// largest item in the full-sync profile (BENCHMARKS.md).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc reads its options from the environment once, as the process
/// loads (before `main`), and two of its defaults hold memory that RSS, VmHWM
/// and the container's cgroup keep counting: arenas committed up front on
/// Linux (`arena_eager_commit`), whose freed pages are then only marked
/// MADV_FREE (reclaimed under memory pressure, not before), and a 1 s purge
/// delay. Measured per setting with kp-bench's soak and tables (BENCHMARKS.md,
/// "Steady state"): eager commit off with a 200 ms purge delay roughly
/// halves the peak at 1k Services for a slightly slower render.
///
/// So the process re-executes itself once with eager commit off and a 200 ms
/// purge delay, unless the operator set either; if that fails it runs with
/// the defaults.
#[cfg(feature = "mimalloc")]
fn tune_allocator() {
    use std::os::unix::process::CommandExt;
    const OPTIONS: [(&str, &str); 2] = [
        ("MIMALLOC_ARENA_EAGER_COMMIT", "0"),
        ("MIMALLOC_PURGE_DELAY", "200"),
    ];
    if OPTIONS.iter().any(|(k, _)| std::env::var_os(k).is_some()) {
        return;
    }
    // The binary's own path, not /proc/self/exe: the process name (comm,
    // what ps and pgrep show) comes from the path executed.
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_default();
    // Returns only if the exec failed.
    let err = std::process::Command::new(exe)
        .arg0(arg0)
        .args(args)
        .envs(OPTIONS)
        .exec();
    eprintln!("kube-proxy-rs: running with mimalloc's default options (re-exec: {err})");
}

fn main() {
    #[cfg(feature = "mimalloc")]
    tune_allocator();
    // `kube-proxy-rs explain|status ...` (cli/subcommands.rs); anything else is
    // upstream's flags, unchanged.
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(code) = kube_proxy_rs::cli::subcommands::dispatch(&args) {
        std::process::exit(code);
    }
    let cfg = match config::load(args) {
        Ok(c) => c,
        Err(ConfigError::Cli(e)) => e.exit(),
        Err(e) => {
            eprintln!("kube-proxy-rs: {e}");
            std::process::exit(1);
        }
    };
    init_logging(&cfg);
    if let Err(e) = run(cfg) {
        tracing::error!("{e:#}");
        eprintln!("kube-proxy-rs: {e:#}");
        std::process::exit(1);
    }
}

fn init_logging(cfg: &ProxyConfig) {
    kube_proxy_rs::logging::init(cfg.verbosity, cfg.log_json);
    for w in &cfg.load_warnings {
        tracing::warn!("{w}");
    }
}

fn run(mut cfg: ProxyConfig) -> Result<()> {
    if let Some(path) = &cfg.write_config_to {
        cfg.write_config(path)?;
        tracing::info!(path = %path.display(), "wrote the configuration");
        return Ok(());
    }
    // --cleanup wins over --init-only, as upstream checks it first.
    if cfg.init_only && !cfg.cleanup {
        return host::init_only(&cfg);
    }
    // One thread for all the async work (watches, servers, events): it
    // waits on sockets and decodes JSON, while the rules are computed and
    // written on the sync thread. Every thread that allocates holds its
    // own partly used mimalloc pages, so each thread is ~1-2 MiB of RSS at
    // 1k Services: peak through the API (kp-bench compare, 1k, three alternating
    // runs each) 40.1/38.6/42.5 MiB with two workers, 37.7/39.4/37.2 with
    // this. At 10k (kp-bench soak, one run each, 2,000 updates/s asked): first
    // sync 8.3 vs 8.6 s (runs vary by 1 s), peak 143 vs 134 MiB, CPU over
    // the soak 7 vs 6 s.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Upstream waits for the podCIDRs before it builds the proxier: the rules
    // that tell local traffic apart are written with them.
    // The Node as the last of those waits listed it: the source's Node
    // watch starts from that list.
    let mut node_listed = None;
    let pod_cidrs = if cfg.detect_local_mode == DetectLocalMode::NodeCidr && !cfg.cleanup {
        let (cidrs, listed) = rt.block_on(node::wait_for_node_pod_cidrs(&cfg))?;
        node_listed = listed;
        Some(cidrs)
    } else {
        None
    };
    let host_ips_watch = if cfg.nodeport_primary && !cfg.cleanup {
        let (ips, listed) = rt.block_on(primary_ips(&cfg))?;
        node_listed = listed.or(node_listed);
        cfg.node_primary_ips = node::with_bind_address(&ips, cfg.bind_address);
        tracing::info!(node_ips = ?cfg.node_primary_ips, "NodePorts are accepted on this node's primary IPs (nodePortAddresses primary)");
        // Nothing to compare with when no Node said (manifests without one).
        (!ips.is_empty()).then(|| HostIpsWatch::new(&cfg.hostname, &ips))
    } else {
        None
    };
    match cfg.mode {
        ProxyMode::Ipvs => {
            tracing::info!("Using ipvs Proxier");
            tracing::error!("{}", events::IPVS_DEPRECATION_NOTE);
        }
        m => tracing::info!("Using {m} Proxier"),
    }
    if !cfg.dry_run && !cfg.cleanup {
        // Like upstream on a mode switch: the other modes' rules (and
        // upstream kube-proxy's) would otherwise keep steering traffic.
        // Before the node's addresses are read: ipvs mode's kube-ipvs0
        // holds Service IPs, which are no NodePort addresses.
        modes::remove_leftovers(modes::Scope::StartingIn(cfg.mode), &cfg)
            .log("removing other modes' leftovers");
    }
    let node_ips = host::local_addresses();
    let metrics = Metrics::new();
    metrics.init_series(&FAMILIES);
    metrics.set_feature_gates(&cfg.feature_gates);
    if cfg.socket_lb.socket_lb && !cfg.dry_run && !cfg.cleanup {
        // Once for both families, before their dataplanes open the maps.
        modes::socketlb::install(&cfg.socket_lb)?;
    }
    let mut dataplanes = Vec::new();
    let cidrs = pod_cidrs.as_ref().map_or(&[][..], |p| &p.cidrs[..]);
    for f in FAMILIES {
        dataplanes.push(modes::make_dataplane(&cfg, f, &node_ips, cidrs, &metrics)?);
    }
    if !cfg.dry_run && !cfg.cleanup {
        // Once the mode's own checks passed (ipvs mode refuses a kernel
        // without ip_vs): a start that is refused leaves the host as it was.
        host::conntrack_at_start(&cfg);
    }
    if cfg.cleanup {
        // Every mode's objects, ours and upstream kube-proxy's (each mode's
        // sweep in modes/), then whatever the configured mode's own cleanup
        // still finds. In that order: upstream's ipvs leftovers jump to
        // chains iptables mode owns too, which could not go first.
        let out = modes::remove_leftovers(modes::Scope::Everything, &cfg);
        out.log("cleanup");
        let mut failed = out.failed.clone();
        for dp in &mut dataplanes {
            if let Err(e) = dp.cleanup() {
                failed.push(format!("{} mode: {e}", dp.mode()));
            }
        }
        if !failed.is_empty() {
            bail!("cleanup failed: {}", failed.join("; "));
        }
        tracing::info!(removed = out.removed.len(), "removed every kube-proxy rule");
        return Ok(());
    }
    // The settings the dataplanes were built with, for /debug/explain.
    let proxier_configs: Vec<ProxierConfig> = FAMILIES
        .iter()
        .map(|f| cfg.proxier_config(*f, &node_ips, cidrs))
        .collect();
    let watch = NodeWatch {
        pod_cidrs: pod_cidrs.map(|p| PodCidrWatch::new(&cfg.hostname, &p)),
        host_ips: host_ips_watch,
        listed: node_listed,
    };
    rt.block_on(serve(cfg, dataplanes, metrics, watch, proxier_configs))
}

/// This node's primary IPs for `nodePortAddresses: primary`: from the API
/// server, waited for as upstream's NodeManager waits (up to 5 minutes, then
/// the start fails); from a manifest directory, its Node if it has one, else
/// none (so every local address, as upstream's loopback fallback gives).
async fn primary_ips(cfg: &ProxyConfig) -> Result<(Vec<IpAddr>, Option<kp_source::NodeListed>)> {
    if let Some(dir) = &cfg.manifests {
        let node = kp_source::load_dir(dir)
            .ok()
            .and_then(|l| l.nodes.get(&cfg.hostname).cloned());
        let ips = node.map_or_else(Vec::new, |n| kp_model::convert_node(&n).host_ips());
        if ips.is_empty() {
            tracing::warn!(node = %cfg.hostname, dir = %dir.display(), "no Node with an address in the manifests: NodePorts are accepted on every local IP");
        }
        return Ok((ips, None));
    }
    node::wait_for_node(cfg, &node::HOST_IPS).await
}

/// What of this Node the rules were built with; a change exits, as upstream.
struct NodeWatch {
    pod_cidrs: Option<PodCidrWatch>,
    host_ips: Option<HostIpsWatch>,
    /// The start's list of this Node, for the source to resume from.
    listed: Option<kp_source::NodeListed>,
}

impl NodeWatch {
    fn check(&self, n: &k8s_openapi::api::core::v1::Node) -> Result<()> {
        if let Some(w) = &self.pod_cidrs {
            w.check(n)?;
        }
        if let Some(w) = &self.host_ips {
            w.check(n)?;
        }
        Ok(())
    }
}

async fn serve(
    cfg: ProxyConfig,
    dataplanes: Vec<Box<dyn Dataplane>>,
    metrics: Metrics,
    mut node_watch: NodeWatch,
    proxier_configs: Vec<ProxierConfig>,
) -> Result<()> {
    // Refused address claims: counted by the sync loop, posted as Events on
    // their Services by the API source side (kube/events.rs).
    let (claim_tx, claim_rx) = tokio::sync::mpsc::unbounded_channel();
    // One bounded queue from the source to the sync loop (kp_sync::queue).
    let (tx, events) =
        kp_sync::event_queue(kp_sync::EVENT_QUEUE).context("the sync loop's event queue")?;
    source::start_source(&cfg, node_watch.listed.take(), claim_rx, tx).await?;

    if cfg.dry_run {
        cli::dryrun::dry_run(&cfg, events.into_receiver(), &dataplanes).await;
        return Ok(());
    }

    let health = Arc::new(HealthState::new(&FAMILIES, cfg.sync_period * 2));
    let programmed = ProgrammedState::new();
    if let Some(addr) = cfg.healthz_bind_address {
        let (h, m) = (health.clone(), metrics.clone());
        tokio::spawn(server::supervise(
            "healthz",
            metrics.clone(),
            server::SERVER_RESTART_DELAY,
            move || server::serve_health(addr, h.clone(), m.clone()),
        ));
    }
    if let Some(addr) = cfg.metrics_bind_address {
        let m = metrics.clone();
        let mode = cfg.mode.as_str();
        let configz = cfg.to_configuration_json();
        let debug = DebugState {
            programmed: programmed.clone(),
            configs: Arc::new(proxier_configs),
            mode: cfg.mode,
            node: cfg.hostname.clone(),
            iptables_backend: cfg.iptables_backend,
        };
        tokio::spawn(server::supervise(
            "metrics",
            metrics.clone(),
            server::SERVER_RESTART_DELAY,
            move || {
                let (m, configz, debug) = (m.clone(), configz.clone(), debug.clone());
                server::serve_metrics(addr, m, mode, configz, Some(debug))
            },
        ));
    }
    let hc_ips: Vec<IpAddr> = if cfg.bind_address.is_unspecified() {
        Vec::new()
    } else {
        vec![cfg.bind_address]
    };
    let hcs = ServiceHealthServer::new(hc_ips, health.clone(), tokio::runtime::Handle::current());

    let mut superseded = Superseded {
        mode: Some(cfg.mode),
        programmed: programmed.clone(),
    };
    let families: Vec<FamilyProxier> = modes::trackers(&cfg)
        .into_iter()
        .zip(dataplanes)
        .map(|(t, d)| FamilyProxier::new(t, d))
        .collect();
    let sync = SyncLoop {
        node_name: cfg.hostname.clone(),
        families,
        min_sync_period: cfg.min_sync_period,
        sync_period: cfg.sync_period,
        metrics: Box::new(metrics),
        health,
        claim_events: Box::new(events::ClaimEventQueue(claim_tx)),
        // Netlink by default (no program needed); KUBE_PROXY_RS_CONNTRACK=cli
        // runs conntrack-tools instead.
        conntrack: match std::env::var("KUBE_PROXY_RS_CONNTRACK").as_deref() {
            Ok("cli") => Box::new(ConntrackCli) as Box<dyn Conntrack>,
            _ => Box::new(ConntrackNetlink),
        },
        clock: Box::new(SystemClock),
        on_synced: Box::new(move |d| {
            hcs.sync_services(&d.ports);
            hcs.sync_endpoints(&d.local_endpoints);
            superseded.check();
        }),
        programmed,
        // The local-traffic rules hold the podCIDRs (and addresses) we
        // started with: like upstream, exit when they change (the rules
        // stay) and let the restart use the new ones.
        node_check: Some(Box::new(move |n| {
            node_watch.check(n).map_err(|e| format!("{e:#}"))
        })),
    };
    let (stopped_tx, stopped) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("sync".into())
        .spawn(move || {
            let _ = stopped_tx.send(sync.run(events));
        })
        .context("starting the sync thread")?;
    tracing::info!(mode = cfg.mode.as_str(), node = %cfg.hostname, "kube-proxy-rs started");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let config_changed = async {
        match (&cfg.config_file, cfg.config_file_digest) {
            (Some(path), Some(d)) => config::watch::changed(path.clone(), d).await,
            _ => std::future::pending().await,
        }
    };
    tokio::select! {
        // The rules stay, as on any exit: the restart takes them over.
        changed = config_changed => return Err(changed.into()),
        stop = stopped => match stop {
            Ok(Stop::NodeChanged(why)) => bail!("{why}"),
            Ok(Stop::SourceClosed) => bail!("the source stopped"),
            Err(_) => bail!("the sync loop stopped"),
        },
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    // Rules stay in place on exit, as upstream: traffic keeps flowing while we
    // restart.
    tracing::info!("shutting down; programmed rules stay in place");
    Ok(())
}

/// Upstream's rules that ours replace go once every family has synced
/// (modes::remove_superseded): until then they keep serving.
struct Superseded {
    /// None once done.
    mode: Option<ProxyMode>,
    /// Where the sync loop records each family's successful syncs.
    programmed: ProgrammedState,
}

impl Superseded {
    fn check(&mut self) {
        if let Some(mode) = self.mode {
            let synced = {
                let p = self.programmed.read();
                FAMILIES
                    .iter()
                    .all(|f| p.family(*f).is_some_and(|f| f.last_sync.is_some()))
            };
            if synced {
                self.mode = None;
                modes::remove_superseded(mode).log("our rules are in place; removing upstream's");
            }
        }
    }
}
