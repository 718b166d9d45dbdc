//! kube-proxy-rs: the binary. Flags and config (upstream's), a source, one
//! proxier per IP family, the sync loop and the HTTP servers.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kp_model::{ChangeTracker, Dataplane, IpFamily, TrackerConfig};
use kp_source::SourceEvent;
use kube_proxy_rs::cleanup;
use kube_proxy_rs::config::{self, ConfigError, ProxyConfig, ProxyMode};
use kube_proxy_rs::conntrack::{Conntrack, ConntrackCli, ConntrackNetlink};
use kube_proxy_rs::healthcheck::ServiceHealthServer;
use kube_proxy_rs::metrics::Metrics;
use kube_proxy_rs::server::{self, HealthState};
use kube_proxy_rs::sync::{FamilyProxier, SyncLoop};

// mimalloc instead of glibc malloc: at 10k-50k Services a sync allocates and
// frees millions of small strings, and glibc's chunk consolidation was the
// largest item in the full-sync profile (full sync of 10k Services 4.1 s ->
// 2.2 s in kp-bench).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const FAMILIES: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

fn main() {
    let cfg = match config::load(std::env::args_os()) {
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
}

/// This host's addresses (no loopback, no link-local), for NodePorts and
/// health-check ports when the Node object does not tell.
fn local_addresses() -> Vec<IpAddr> {
    let mut out = Vec::new();
    // SAFETY: getifaddrs fills a linked list we walk read-only and free once.
    unsafe {
        let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut ifap) != 0 {
            return out;
        }
        let mut cur = ifap;
        while !cur.is_null() {
            let sa = (*cur).ifa_addr;
            if !sa.is_null() {
                match (*sa).sa_family as i32 {
                    libc::AF_INET => {
                        let sin = &*(sa as *const libc::sockaddr_in);
                        out.push(IpAddr::from(
                            u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                        ));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(sa as *const libc::sockaddr_in6);
                        out.push(IpAddr::from(sin6.sin6_addr.s6_addr));
                    }
                    _ => {}
                }
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(ifap);
    }
    out.retain(|ip| match ip {
        IpAddr::V4(v) => !v.is_loopback() && !v.is_link_local() && !v.is_unspecified(),
        IpAddr::V6(v) => {
            !v.is_loopback() && !v.is_unspecified() && (v.segments()[0] & 0xffc0) != 0xfe80
        }
    });
    out.sort();
    out.dedup();
    out
}

fn make_dataplane(
    cfg: &ProxyConfig,
    family: IpFamily,
    node_ips: &[IpAddr],
    metrics: &Metrics,
) -> Result<Box<dyn Dataplane>> {
    let pc = cfg.proxier_config(family, node_ips, &[]);
    match cfg.mode {
        // Transactions go to the kernel as nf_tables netlink batches: the `nft`
        // program re-reads the whole table on every run and is superlinear in
        // chain count (BENCHMARKS.md).
        // KUBE_PROXY_RS_NFT_BACKEND=nft sends the same transactions through the
        // `nft` program instead (a fallback for debugging).
        ProxyMode::Nftables => {
            let backend: Box<dyn kp_nftables::NftBackend> =
                match std::env::var("KUBE_PROXY_RS_NFT_BACKEND").as_deref() {
                    Ok("nft") => Box::new(kp_nftables::NftCli::default()),
                    _ => Box::new(kp_nftables::NftNetlink::new()),
                };
            Ok(Box::new(kp_nftables::NftablesProxier::new(pc, backend)))
        }
        ProxyMode::Iptables => Ok(Box::new(kp_iptables::IptablesProxier::new(
            pc,
            Box::new(kp_iptables::IptablesCli::choose(
                family,
                cfg.iptables_backend,
            )),
        ))),
        ProxyMode::Ipvs => make_ipvs(cfg, family, pc),
        ProxyMode::Userspace => {
            kube_proxy_rs::userspace::make_dataplane(&cfg.userspace, &pc, metrics)
        }
    }
}

/// IPVS mode: refuses to start (with the reason) when the kernel has no IPVS;
/// --dry-run and --cleanup work without it.
fn make_ipvs(
    cfg: &ProxyConfig,
    family: IpFamily,
    pc: kp_model::ProxierConfig,
) -> Result<Box<dyn Dataplane>> {
    let s = &cfg.ipvs;
    if !cfg.dry_run && !cfg.cleanup && family == IpFamily::V4 {
        kp_ipvs::check_kernel(&s.scheduler).map_err(anyhow::Error::msg)?;
    }
    let mut ic = kp_ipvs::IpvsConfig::new(pc);
    ic.scheduler = s.scheduler.clone();
    ic.exclude_cidrs = s.exclude_cidrs.clone();
    ic.strict_arp = s.strict_arp;
    ic.tcp_timeout = s.tcp_timeout.as_secs() as u32;
    ic.tcp_fin_timeout = s.tcp_fin_timeout.as_secs() as u32;
    ic.udp_timeout = s.udp_timeout.as_secs() as u32;
    ic.validate().context("--ipvs-scheduler")?;
    Ok(Box::new(kp_ipvs::IpvsProxier::new(ic)))
}

fn make_trackers(cfg: &ProxyConfig) -> Vec<ChangeTracker> {
    FAMILIES
        .iter()
        .map(|f| {
            ChangeTracker::new(TrackerConfig {
                family: *f,
                node_name: cfg.hostname.clone(),
                service_proxy_name: cfg.service_proxy_name.clone(),
            })
        })
        .collect()
}

async fn kube_client(cfg: &ProxyConfig) -> Result<kube::Client> {
    let kc = if let Some(path) = &cfg.kubeconfig {
        let kubeconfig = kube::config::Kubeconfig::read_from(path)
            .with_context(|| format!("reading kubeconfig {}", path.display()))?;
        let mut c = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .with_context(|| format!("loading kubeconfig {}", path.display()))?;
        if let Some(m) = &cfg.master {
            c.cluster_url = m.parse().with_context(|| format!("--master {m:?}"))?;
        }
        c
    } else if let Some(m) = &cfg.master {
        kube::Config::new(m.parse().with_context(|| format!("--master {m:?}"))?)
    } else {
        kube::Config::infer().await.context(
            "no --kubeconfig, --master or --manifests given, and not running in a cluster",
        )?
    };
    kube_proxy_rs::apiclient::client(kc)
}

/// Starts the configured source; events arrive on the returned channel.
async fn start_source(cfg: &ProxyConfig) -> Result<tokio::sync::mpsc::Receiver<SourceEvent>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4096);
    if let Some(dir) = cfg.manifests.clone() {
        if !dir.is_dir() {
            bail!("--manifests {}: not a directory", dir.display());
        }
        tracing::info!(dir = %dir.display(), "reading Services and EndpointSlices from manifests");
        tokio::spawn(async move {
            if let Err(e) =
                kp_source::manifest::run_manifest_source(dir, Duration::from_millis(250), tx).await
            {
                tracing::error!("manifest source stopped: {e}");
            }
        });
    } else {
        let client = kube_client(cfg).await?;
        if !cfg.dry_run {
            // Upstream's birth cry: a "Starting" Event on our Node (events.rs).
            tokio::spawn(kube_proxy_rs::events::birth_cry(
                client.clone(),
                cfg.hostname.clone(),
            ));
        }
        let opts = kp_source::api::ApiSourceOptions {
            node_name: cfg.hostname.clone(),
            label_selector: Some(kp_source::api::DEFAULT_LABEL_SELECTOR.to_string()),
        };
        tokio::spawn(async move {
            if let Err(e) = kp_source::api::run_api_source(client, opts, tx).await {
                tracing::error!("API source stopped: {e}");
            }
        });
    }
    Ok(rx)
}

fn run(cfg: ProxyConfig) -> Result<()> {
    if let Some(path) = &cfg.write_config_to {
        cfg.write_config(path)?;
        tracing::info!(path = %path.display(), "wrote the configuration");
        return Ok(());
    }
    let node_ips = local_addresses();
    let metrics = Metrics::new();
    let mut dataplanes = Vec::new();
    for f in FAMILIES {
        dataplanes.push(make_dataplane(&cfg, f, &node_ips, &metrics)?);
    }
    if cfg.cleanup {
        // The configured mode's own objects, then every mode's, ours and
        // upstream kube-proxy's (cleanup.rs).
        let mut failed = Vec::new();
        for dp in &mut dataplanes {
            if let Err(e) = dp.cleanup() {
                failed.push(format!("{} mode: {e}", dp.mode()));
            }
        }
        let out = cleanup::remove_leftovers(cleanup::Scope::Everything, cfg.iptables_backend);
        out.log("cleanup");
        failed.extend(out.failed);
        if !failed.is_empty() {
            bail!("cleanup failed: {}", failed.join("; "));
        }
        tracing::info!(removed = out.removed.len(), "removed every kube-proxy rule");
        return Ok(());
    }
    if !cfg.dry_run {
        // Like upstream on a mode switch: the other modes' rules (and
        // upstream kube-proxy's) would otherwise keep steering traffic.
        cleanup::remove_leftovers(cleanup::Scope::StartingIn(cfg.mode), cfg.iptables_backend)
            .log("removing other modes' leftovers");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(cfg, dataplanes, metrics))
}

async fn serve(
    cfg: ProxyConfig,
    dataplanes: Vec<Box<dyn Dataplane>>,
    metrics: Metrics,
) -> Result<()> {
    let mut rx = start_source(&cfg).await?;

    if cfg.dry_run {
        let mut trackers = make_trackers(&cfg);
        let now = std::time::SystemTime::now();
        while let Some(ev) = rx.recv().await {
            match ev {
                SourceEvent::Synced => break,
                SourceEvent::ServiceApplied(s) => trackers.iter_mut().for_each(|t| {
                    if let Err(e) = t.update_service(&s, now) {
                        tracing::warn!("skipping invalid Service: {}", e.0);
                    }
                }),
                SourceEvent::SliceApplied(s) => trackers.iter_mut().for_each(|t| {
                    if let Err(e) = t.update_endpoint_slice(&s, now) {
                        tracing::warn!("skipping invalid EndpointSlice: {}", e.0);
                    }
                }),
                SourceEvent::NodeApplied(n) => trackers.iter_mut().for_each(|t| t.update_node(&n)),
                SourceEvent::Invalid(m) => tracing::warn!("skipping invalid object: {m}"),
                _ => {}
            }
        }
        for (t, dp) in trackers.iter_mut().zip(dataplanes.iter()) {
            t.take_changes();
            if t.state().services.is_empty() {
                continue;
            }
            print!("{}", dp.render(t.state()));
        }
        return Ok(());
    }

    let health = Arc::new(HealthState::new(&FAMILIES, cfg.sync_period * 2));
    if let Some(addr) = cfg.healthz_bind_address {
        let (h, m) = (health.clone(), metrics.clone());
        tokio::spawn(async move {
            if let Err(e) = server::serve_health(addr, h, m).await {
                tracing::error!("healthz server: {e}");
            }
        });
    }
    if let Some(addr) = cfg.metrics_bind_address {
        let m = metrics.clone();
        let mode = cfg.mode.as_str();
        let configz = cfg.to_configuration_json();
        tokio::spawn(async move {
            if let Err(e) = server::serve_metrics(addr, m, mode, configz).await {
                tracing::error!("metrics server: {e}");
            }
        });
    }
    let hc_ips: Vec<IpAddr> = if cfg.bind_address.is_unspecified() {
        Vec::new()
    } else {
        vec![cfg.bind_address]
    };
    let hcs = ServiceHealthServer::new(hc_ips, health.clone(), tokio::runtime::Handle::current());

    let families: Vec<FamilyProxier> = make_trackers(&cfg)
        .into_iter()
        .zip(dataplanes)
        .map(|(t, d)| FamilyProxier::new(t, d))
        .collect();
    let sync = SyncLoop {
        node_name: cfg.hostname.clone(),
        families,
        min_sync_period: cfg.min_sync_period,
        sync_period: cfg.sync_period,
        metrics,
        health,
        // Netlink by default (no program needed); KUBE_PROXY_RS_CONNTRACK=cli
        // runs conntrack-tools instead.
        conntrack: match std::env::var("KUBE_PROXY_RS_CONNTRACK").as_deref() {
            Ok("cli") => Box::new(ConntrackCli) as Box<dyn Conntrack>,
            _ => Box::new(ConntrackNetlink),
        },
        on_synced: Box::new(move |d| {
            hcs.sync_services(&d.ports);
            hcs.sync_endpoints(&d.local_endpoints);
        }),
    };
    let (std_tx, std_rx) = std::sync::mpsc::channel();
    let sync_thread = std::thread::Builder::new()
        .name("sync".into())
        .spawn(move || sync.run(std_rx))
        .context("starting the sync thread")?;
    tracing::info!(mode = cfg.mode.as_str(), node = %cfg.hostname, "kube-proxy-rs started");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    loop {
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => {
                    if std_tx.send(ev).is_err() {
                        bail!("the sync loop stopped");
                    }
                }
                None => {
                    drop(std_tx);
                    let _ = sync_thread.join();
                    bail!("the source stopped");
                }
            },
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
        }
    }
    // Rules stay in place on exit, as upstream: traffic keeps flowing while we
    // restart.
    tracing::info!("shutting down; programmed rules stay in place");
    Ok(())
}
