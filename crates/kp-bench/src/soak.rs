//! `kp-bench soak`: a proxy holding 10k Services under a steady stream of API
//! updates for 10 minutes, against the real kube-apiserver of the tests.
//!
//! A leak or a starved sync loop shows only over time and under load, never in
//! a one-shot benchmark: this writes `--rate` object updates per second
//! through the API (17 of 20 an EndpointSlice whose endpoint is replaced, 2 a
//! Service whose internalTrafficPolicy flips, 1 a Service created or deleted
//! with its slice, at most 50 of those alive) while sampling the proxy binary
//! every `--sample` seconds: RSS, open fds, CPU, syncs and the sync duration
//! histogram. At the end it checks that the last address written for 200
//! Services is in the kernel (nothing lost) and prints the curve and a
//! summary: the sync p99 over the soak (the histogram bucket that holds it,
//! upstream's buckets), and whether RSS and fds plateaued (their maximum
//! over the last third within 10% of the middle third's).
//!
//! `--write` replaces the text between the `kp-soak MODE API` markers of
//! that file. Fails (exit status 1) when an update was lost, the proxy
//! died, or p99/plateau missed (the figures are printed either way).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::lab::{
    beside_bench, check_binary, date_utc, has_ip, load_average, proxy_args, secs, write_into, Lab,
    Proxy, ENDPOINTS,
};
use anyhow::{bail, Result};
use futures::StreamExt;
use kp_testkit::NetnsApiServer;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

/// `kp-bench soak`.
#[derive(clap::Args, Debug, Clone)]
pub struct SoakArgs {
    /// Services the proxy holds (x10 endpoints, kp-bench's mix); at least 100.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(100..))]
    services: u32,
    /// API updates a second: 17 of 20 an endpoint replaced, 2 a Service's
    /// internalTrafficPolicy flipped, 1 a Service created or deleted.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..))]
    rate: u32,
    /// How long the updates go on.
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// The proxy mode.
    #[arg(long, default_value = "nftables", value_parser = ["nftables", "iptables"])]
    mode: String,
    /// Seconds between two looks at the proxy (RSS, fds, CPU, syncs, the
    /// sync duration histogram).
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    sample: u64,
    /// Replaces the text between the `kp-soak MODE API` markers of FILE
    /// (appended when missing), e.g. docs/reliability.md.
    #[arg(long, value_name = "FILE")]
    write: Option<PathBuf>,
    /// Our binary (build first: cargo build --release -p kube-proxy-rs -p
    /// kp-bench).
    #[arg(long, value_name = "PATH", default_value_os_t = beside_bench())]
    ours: PathBuf,
    /// `real`: the tests' kube-apiserver (etcd + kube-apiserver v1.36);
    /// `test`: kp-testkit's in-process one.
    #[arg(long, default_value = "real", value_parser = ["real", "test"])]
    api: String,
}

/// One look at the proxy.
#[derive(Clone, Debug)]
struct Sample {
    at: Duration,
    updates: u64,
    rss_mib: f64,
    fds: usize,
    cpu: f64,
    syncs: f64,
    /// Cumulative sync-duration histogram: (upper bound in seconds, count).
    buckets: Vec<(f64, f64)>,
}

fn buckets(metrics: &str) -> Vec<(f64, f64)> {
    // The IPv4 family's (the Services' family; the empty IPv6 one syncs too,
    // in no time), whatever the label order.
    let mut out: Vec<(f64, f64)> = Vec::new();
    for l in metrics.lines().filter(|l| l.contains("IPv4")) {
        let Some(rest) = l.strip_prefix("kubeproxy_sync_proxy_rules_duration_seconds_bucket{")
        else {
            continue;
        };
        let Some((_, after)) = rest.split_once("le=\"") else {
            continue;
        };
        let Some((le, _)) = after.split_once('"') else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            match le.parse() {
                Ok(v) => v,
                Err(_) => continue,
            }
        };
        let Some(n) = l
            .rsplit(' ')
            .next()
            .and_then(|v| v.trim().parse::<f64>().ok())
        else {
            continue;
        };
        match out.iter_mut().find(|(b, _)| *b == le) {
            Some(e) => e.1 += n,
            None => out.push((le, n)),
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

fn sample(p: &Proxy, started: Instant, updates: u64) -> Sample {
    let m = p.metrics();
    let syncs = m
        .lines()
        .filter(|l| l.contains("IPv4"))
        .filter_map(|l| l.strip_prefix("kubeproxy_sync_proxy_rules_duration_seconds_count"))
        .filter_map(|r| r.rsplit(' ').next()?.trim().parse::<f64>().ok())
        .sum();
    Sample {
        at: started.elapsed(),
        updates,
        rss_mib: p.status_mib("VmRSS:"),
        fds: p.fds(),
        cpu: p.cpu_secs(),
        syncs,
        buckets: buckets(&m),
    }
}

/// The upper bound of the bucket holding quantile `q` of the syncs between
/// two samples (cumulative histograms subtract bucket by bucket).
fn quantile_bound(a: &Sample, b: &Sample, q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> = b
        .buckets
        .iter()
        .map(|(le, n)| {
            let before = a
                .buckets
                .iter()
                .find(|(l, _)| l == le)
                .map_or(0.0, |(_, c)| *c);
            (*le, n - before)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    delta
        .iter()
        .find(|(_, n)| *n >= q * total)
        .map(|(le, _)| *le)
}

/// What the updater did.
#[derive(Default)]
struct Written {
    done: AtomicU64,
    errors: AtomicU64,
    /// Last endpoint address written per Service (index), for the final check.
    last: Mutex<std::collections::HashMap<u32, String>>,
    /// Churn Services alive, oldest first.
    churn: Mutex<std::collections::VecDeque<u64>>,
}

/// The Service the k-th update touches: a multiplicative hash spreads
/// consecutive updates over all of them.
fn target(k: u64, n: u32) -> u32 {
    ((k.wrapping_mul(2_654_435_761)) % n as u64) as u32
}

/// The generation of its Service's slice the k-th update writes.
fn generation(k: u64, n: u32) -> u32 {
    (k / n as u64 + 1) as u32 * 7 + (k % 5) as u32
}

fn itp(k: u64) -> &'static str {
    if (k / 20).is_multiple_of(2) {
        "Local"
    } else {
        "Cluster"
    }
}

/// Churn Service `c` and its slice.
fn churn_objects(c: u64) -> (serde_json::Value, serde_json::Value) {
    let ip = format!("10.97.{}.{}", (c / 250) % 250, c % 250 + 1);
    (
        json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": crate::lab::NS, "name": format!("churn-{c}")},
            "spec": {"clusterIP": ip, "clusterIPs": [ip], "ports": [{"port": 80, "targetPort": 8080}]}}),
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": crate::lab::NS, "name": format!("churn-{c}-x"),
                "labels": {"kubernetes.io/service-name": format!("churn-{c}")}},
            "addressType": "IPv4", "ports": [{"port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [format!("10.250.{}.{}", (c / 250) % 250, c % 250 + 1)],
                           "conditions": {"ready": true}}]}),
    )
}

/// The k-th update through the real API server (see the file header for the
/// mix).
async fn update(lab: &Lab, n: u32, k: u64, written: &Written) -> Result<u64> {
    let i = target(k, n);
    match k % 20 {
        0..=16 => {
            let addr = lab.patch_endpoints(i, generation(k, n)).await?;
            if let Ok(mut last) = written.last.lock() {
                last.insert(i, addr);
            }
            Ok(1)
        }
        17 | 18 => {
            lab.services()
                .patch(
                    &format!("svc-{i}"),
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"internalTrafficPolicy": itp(k)}})),
                )
                .await?;
            Ok(1)
        }
        _ => {
            // Churn: create Service c with its slice; once 50 are alive,
            // delete the oldest one created (not c - 50: updates complete
            // out of order).
            let c = k / 20;
            let (mut svc, slice) = churn_objects(c);
            // The real API server allocates the address (its range is not
            // kp-bench's).
            if let Some(spec) = svc["spec"].as_object_mut() {
                spec.remove("clusterIP");
                spec.remove("clusterIPs");
            }
            lab.services()
                .create(&PostParams::default(), &serde_json::from_value(svc)?)
                .await?;
            lab.slices()
                .create(&PostParams::default(), &serde_json::from_value(slice)?)
                .await?;
            let old = written.churn.lock().ok().and_then(|mut q| {
                q.push_back(c);
                (q.len() > 50).then(|| q.pop_front()).flatten()
            });
            let Some(old) = old else {
                return Ok(2);
            };
            lab.slices()
                .delete(&format!("churn-{old}-x"), &DeleteParams::default())
                .await?;
            lab.services()
                .delete(&format!("churn-{old}"), &DeleteParams::default())
                .await?;
            Ok(4)
        }
    }
}

/// Writes `rate` updates per second for `dur`, at most 128 in flight (the
/// API server answers 429 above its 200 mutating requests in flight); when
/// the API server falls behind, the pace drops (the achieved rate is what the
/// samples show), never the updates.
fn run_updates(lab: &Lab, o: &SoakArgs, dur: Duration, written: &Written) -> Result<()> {
    let (n, rate) = (o.services, o.rate as f64);
    let start = tokio::time::Instant::now();
    // The k-th update is due at k / rate; a stream pulled only when fewer than
    // 128 are in flight.
    let due = futures::stream::unfold(0u64, move |k| async move {
        let at = start + Duration::from_secs_f64(k as f64 / rate);
        if start.elapsed() >= dur {
            return None;
        }
        tokio::time::sleep_until(at).await;
        Some((k, k + 1))
    });
    lab.rt.block_on(
        due.map(|k| update(lab, n, k, written))
            .buffer_unordered(128)
            .for_each(|r| {
                match r {
                    Ok(c) => written.done.fetch_add(c, Ordering::Relaxed),
                    Err(e) => {
                        if written.errors.fetch_add(1, Ordering::Relaxed) < 5 {
                            eprintln!("  update refused: {e:#}");
                        }
                        0
                    }
                };
                futures::future::ready(())
            }),
    );
    Ok(())
}

/// The same mix as [`update`], written straight into the test API server's
/// store, paced from this thread (one writer: nothing completes out of order).
fn run_updates_test(
    api: &NetnsApiServer,
    services: &[serde_json::Value],
    o: &SoakArgs,
    dur: Duration,
    written: &Written,
) -> Result<()> {
    let n = o.services;
    let start = Instant::now();
    let mut churn = std::collections::VecDeque::new();
    for k in 0u64.. {
        let at = start + Duration::from_secs_f64(k as f64 / o.rate as f64);
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        if start.elapsed() >= dur {
            break;
        }
        let i = target(k, n);
        let count = match k % 20 {
            0..=16 => {
                let slice = crate::slice(i, ENDPOINTS, generation(k, n), i % 10 == 3);
                api.apply(&slice)?;
                if let Ok(mut last) = written.last.lock() {
                    last.insert(i, crate::moved_address(&slice));
                }
                1
            }
            17 | 18 => {
                let mut svc = services[i as usize].clone();
                svc["spec"]["internalTrafficPolicy"] = json!(itp(k));
                api.apply(&svc)?;
                1
            }
            _ => {
                let c = k / 20;
                let (svc, slice) = churn_objects(c);
                api.apply(&svc)?;
                api.apply(&slice)?;
                churn.push_back(c);
                if churn.len() > 50 {
                    if let Some(old) = churn.pop_front() {
                        api.srv
                            .delete_endpoint_slice(crate::lab::NS, &format!("churn-{old}-x"));
                        api.srv
                            .delete_service(crate::lab::NS, &format!("churn-{old}"));
                    }
                    4
                } else {
                    2
                }
            }
        };
        written.done.fetch_add(count, Ordering::Relaxed);
    }
    Ok(())
}

/// `kp-bench soak`.
pub fn run(o: SoakArgs) -> Result<()> {
    check_binary(&o.ours)?;
    let n = o.services;
    eprintln!(
        "kp-bench soak: {n} Services, {} updates/s for {} min ({} mode)",
        o.rate, o.minutes, o.mode
    );
    // One of the two API servers, the cluster the proxy runs in, its
    // kubeconfig and a directory for logs.
    let real = o.api == "real";
    let t = Instant::now();
    let lab = if real {
        Some(Lab::new("soak", false)?)
    } else {
        None
    };
    let test_cluster = if real {
        None
    } else {
        Some(kp_netlab::Cluster::new(
            "soakt",
            kp_netlab::ClusterOpts::with_nodes(2),
        )?)
    };
    let test_api = match &test_cluster {
        Some(tc) => Some(NetnsApiServer::start(tc.node_ns(1))?),
        None => None,
    };
    let (cluster, kubeconfig, dir, syn) = match (&lab, &test_cluster, &test_api) {
        (Some(l), _, _) => {
            l.populate(n)?;
            (
                &l.cluster,
                l.ours_kubeconfig.clone(),
                l.cp.dir().to_path_buf(),
                Vec::new(),
            )
        }
        (_, Some(tc), Some(api)) => {
            let dir = std::env::temp_dir().join(format!("kp-soak-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let kubeconfig = dir.join("kubeconfig");
            api.srv.write_kubeconfig(&kubeconfig)?;
            api.apply(&crate::lab::node(tc, 1))?;
            let c = crate::cluster(n, ENDPOINTS);
            for v in c.services.iter().chain(&c.slices) {
                api.apply(v)?;
            }
            (tc, kubeconfig, dir, c.services)
        }
        _ => bail!("no API server"),
    };
    eprintln!("  {n} Services created in {:.1} s", secs(t.elapsed()));
    let log = dir.join("soak-proxy.log");
    let guard = cluster.spawn(
        cluster.node_ns(1),
        &o.ours,
        &proxy_args(&o.mode, &kubeconfig, 1),
        &log,
    )?;
    let p = Proxy {
        cluster,
        node: 1,
        guard,
        mode: o.mode.clone(),
    };
    let first = p.wait_first_sync(n, Instant::now(), Duration::from_secs(1800))?;
    eprintln!("  first sync after {:.1} s; soaking", secs(first));
    std::thread::sleep(Duration::from_secs(5));

    let written = Written::default();
    let dur = Duration::from_secs_f64(o.minutes * 60.0);
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let samples: Vec<Sample> = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut out = vec![sample(&p, started, 0)];
            let mut next = Duration::from_secs(o.sample);
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                if started.elapsed() >= next {
                    let x = sample(&p, started, written.done.load(Ordering::Relaxed));
                    eprintln!(
                        "  {:>5.0} s: {} updates, RSS {:.0} MiB, {} fds, {:.0} syncs",
                        secs(x.at),
                        x.updates,
                        x.rss_mib,
                        x.fds,
                        x.syncs
                    );
                    out.push(x);
                    next += Duration::from_secs(o.sample);
                }
            }
            out.push(sample(&p, started, written.done.load(Ordering::Relaxed)));
            out
        });
        let r = match (&lab, &test_api) {
            (Some(lab), _) => run_updates(lab, &o, dur, &written),
            (_, Some(api)) => run_updates_test(api, &syn, &o, dur, &written),
            _ => Err(anyhow::anyhow!("no API server")),
        };
        stop.store(true, Ordering::Relaxed);
        let out = sampler.join().unwrap_or_default();
        r.map(|_| out)
    })?;
    let soak = started.elapsed();
    let running = p.guard.is_running();
    let peak = p.status_mib("VmHWM:");

    // Nothing lost: the last address written for 200 Services is in the
    // kernel within a minute of the last update.
    let last: Vec<String> = written
        .last
        .lock()
        .map(|m| m.values().take(200).cloned().collect())
        .unwrap_or_default();
    let t = Instant::now();
    let mut missing = last.len();
    while running && t.elapsed() < Duration::from_secs(60) {
        let r = p.ruleset();
        missing = last.iter().filter(|a| !has_ip(&r, a)).count();
        if missing == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let settled = t.elapsed();

    let (first, end) = (&samples[0], &samples[samples.len() - 1]);
    let p99 = quantile_bound(first, end, 0.99);
    let p50 = quantile_bound(first, end, 0.5);
    let third = samples.len() / 3;
    let max_rss = |s: &[Sample]| s.iter().map(|x| x.rss_mib).fold(0.0, f64::max);
    let max_fds = |s: &[Sample]| s.iter().map(|x| x.fds).max().unwrap_or(0);
    let (mid, tail) = (&samples[third..2 * third], &samples[2 * third..]);
    let rss_plateau = max_rss(tail) <= max_rss(mid) * 1.10;
    let fds_plateau = max_fds(tail) as f64 <= max_fds(mid) as f64 * 1.10;
    let rate = end.updates as f64 / secs(soak);
    let errors = written.errors.load(Ordering::Relaxed);
    let fmt_bound = |b: Option<f64>| b.map_or("-".to_string(), |v| format!("<= {:.3} s", v));

    let mut text = format!(
        "Measured {} by `kp-bench soak --services {n} --rate {} --minutes {} --mode {} --sample {} \
         --api {}` ({} cores, load average {} at the end): kube-proxy-rs alone against {}, \
         {n} Services x {ENDPOINTS} endpoints; syncs and their durations are the IPv4 family's.\n\n",
        date_utc(),
        o.rate,
        o.minutes,
        o.mode,
        o.sample,
        o.api,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average(),
        if real {
            "the tests' kube-apiserver v1.36.2 (etcd on the same machine, both sharing its cores)"
        } else {
            "kp-testkit's in-process API server (objects written straight into its store and \
             watched over HTTP: the real one cannot take this rate here)"
        },
    );
    text.push_str(&format!(
        "- updates written: {} in {:.0} s = **{rate:.0}/s** (asked {}/s; a churn update writes 2-4 objects; {errors} refused by the API server)\n\
         - syncs: {:.0} ({:.1}/min); duration p50 {}, **p99 {}** (bucket bounds)\n\
         - RSS: start {:.0} MiB, max of middle third {:.0}, max of last third {:.0}: {}; peak (VmHWM, incl. the first sync) {peak:.0} MiB\n\
         - open fds: start {}, max of middle third {}, max of last third {}: {}\n\
         - CPU: {:.0} s over the soak ({:.0}% of one core)\n\
         - last address of {} Services in the kernel {:.1} s after the last update; missing: {missing}\n\n",
        end.updates,
        secs(soak),
        o.rate,
        end.syncs - first.syncs,
        (end.syncs - first.syncs) / secs(soak) * 60.0,
        fmt_bound(p50),
        fmt_bound(p99),
        first.rss_mib,
        max_rss(mid),
        max_rss(tail),
        if rss_plateau { "plateau" } else { "STILL GROWING" },
        first.fds,
        max_fds(mid),
        max_fds(tail),
        if fds_plateau { "plateau" } else { "STILL GROWING" },
        end.cpu - first.cpu,
        (end.cpu - first.cpu) / secs(soak) * 100.0,
        last.len(),
        secs(settled),
    ));
    text.push_str("| t | updates/s | RSS MiB | open fds | syncs/min | sync p99 (interval) |\n|---|---|---|---|---|---|\n");
    let step = (samples.len() / 20).max(1);
    let mut prev = first;
    for x in samples.iter().skip(step).step_by(step) {
        let dt = secs(x.at - prev.at).max(1e-9);
        text.push_str(&format!(
            "| {:.0} s | {:.0} | {:.0} | {} | {:.1} | {} |\n",
            secs(x.at),
            (x.updates - prev.updates) as f64 / dt,
            x.rss_mib,
            x.fds,
            (x.syncs - prev.syncs) / dt * 60.0,
            fmt_bound(quantile_bound(prev, x, 0.99)),
        ));
        prev = x;
    }
    print!("{text}");
    if let Some(path) = &o.write {
        write_into(path, &format!("kp-soak {} {}", o.mode, o.api), &text)?;
        eprintln!("wrote the figures into {}", path.display());
    }
    p.guard.kill_hard();
    if !running {
        bail!("the proxy died during the soak; log: {}", log.display());
    }
    if missing > 0 || !rss_plateau || !fds_plateau || p99.is_none_or(|v| v > 2.0) {
        bail!(
            "the soak missed: see the figures above (log: {})",
            log.display()
        );
    }
    Ok(())
}
