//! kp-compare: kube-proxy-rs and upstream kube-proxy side by side, in one
//! run, on this machine, against one real kube-apiserver.
//!
//! A ratio between two proxies only holds when both ran in the same run on
//! the same machine: kp-bench drives the model directly and figures taken on
//! another day differ by 4x (../shared/upstream-baseline.md). So this starts
//! the control plane of the tests (kp-testkit: etcd + kube-apiserver v1.36 in
//! a lab namespace), creates N Services x 10 endpoints through the API (the
//! kp-bench mix: NodePorts, eTP=Local LoadBalancers, 5% session affinity,
//! UDP ports), and runs each proxy binary in turn in its own node namespace
//! with the same flags (defaults otherwise, as operators run them), measuring
//! only through what both export and the kernel shows:
//!
//! * first sync: process start -> `kubeproxy_sync_proxy_rules_duration_seconds_count`
//!   >= 1 and the last Service's ClusterIP in the ruleset read back;
//! * one endpoint replaced through the API -> the proxy's
//!   `kubeproxy_sync_proxy_rules_last_timestamp_seconds` of the sync that put
//!   the new address in the kernel (p50/p99); a Service added / deleted the same way;
//! * a burst of endpoint changes -> all of them in the kernel;
//! * CPU seconds to the first sync and while idle, RSS at the end and peak (VmHWM).
//!
//! `sudo target/release/kp-compare [--sizes 1000] [--mode nftables|iptables]
//! [--changes 50] [--burst 1000] [--idle 60] [--write BENCHMARKS.md]
//! [--ours PATH]` (--ours defaults to the kube-proxy-rs beside kp-compare)
//! (build first: `cargo build --release -p kube-proxy-rs -p kp-bench`).
//! `--write` replaces the table between the `kp-compare` markers of that file.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::{StreamExt, TryStreamExt};
use kp_bench::lab::{
    check_binary, date_utc, has_ip, load_average, now_unix, parse_common, pct, secs, write_into,
    Lab, ENDPOINTS,
};
use kube::api::DeleteParams;
use serde_json::json;

struct Opts {
    sizes: Vec<u32>,
    mode: String,
    changes: usize,
    burst: usize,
    idle: u64,
    write: Option<PathBuf>,
    ours: PathBuf,
}

fn parse_opts() -> Result<Opts> {
    let (mut changes, mut burst, mut idle) = (50, 1000, 60);
    let c = parse_common(&[1000], |flag, v| {
        match flag {
            "--changes" => changes = v.parse().context("--changes")?,
            "--burst" => burst = v.parse().context("--burst")?,
            "--idle" => idle = v.parse().context("--idle")?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Opts {
        sizes: c.sizes,
        mode: c.mode,
        changes,
        burst,
        idle,
        write: c.write,
        ours: c.ours,
    })
}

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
    let node = if upstream { 2 } else { 1 };
    let who = if upstream { "upstream" } else { "ours" };
    let t_start = Instant::now();
    let p = lab.spawn_proxy(node, &o.mode, upstream, &o.ours, &format!("{who}-{n}"))?;
    let first_sync = p.wait_first_sync(n, t_start, Duration::from_secs(3600))?;
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
    std::thread::sleep(Duration::from_secs(2));
    let cpu0 = p.cpu_secs();
    std::thread::sleep(Duration::from_secs(o.idle));
    f.idle_cpu = p.cpu_secs() - cpu0;
    f.rss_mib = p.status_mib("VmRSS:");
    f.peak_mib = p.status_mib("VmHWM:");
    p.guard.kill_hard();
    // The next proxy starts from a namespace of its own: nothing to clean.
    Ok(f)
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
        "Measured {date} by `kp-compare --sizes {} --mode {} --changes {} --burst {} --idle {}` \
         ({} cores, load average {} at the end): both proxies in the same run, on the same \
         machine, against the same kube-apiserver v1.36.2, N Services x {ENDPOINTS} endpoints \
         (kp-bench's mix). Ratio = upstream / ours (above 1: ours is faster or smaller).\n\n\
         | N | mode | what | upstream kube-proxy | kube-proxy-rs | ratio |\n|---|---|---|---|---|---|\n",
        o.sizes
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .join(","),
        o.mode,
        o.changes,
        o.burst,
        o.idle,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load,
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

fn main() -> Result<()> {
    let o = parse_opts()?;
    check_binary(&o.ours)?;
    let mut results = BTreeMap::new();
    for &n in &o.sizes {
        eprintln!("N = {n} ({} mode): starting the control plane", o.mode);
        let lab = Lab::new("compare", true)?;
        let t = Instant::now();
        lab.populate(n)?;
        eprintln!("  {n} Services created in {:.1} s", secs(t.elapsed()));
        let mut generation = 0;
        eprintln!(" upstream kube-proxy:");
        let up = measure(&lab, &o, n, true, &mut generation)?;
        eprintln!(" kube-proxy-rs:");
        let ours = measure(&lab, &o, n, false, &mut generation)?;
        results.insert(n, (up, ours));
    }
    let text = table(&o, &results);
    print!("{text}");
    if let Some(path) = &o.write {
        write_into(path, &format!("kp-compare {}", o.mode), &text)?;
        eprintln!("wrote the table into {}", path.display());
    }
    Ok(())
}
