//! `kp-bench idle`: the real kube-proxy-rs binary's steady state with a big cluster.
//!
//! For each size: writes the synthetic cluster ([`crate::cluster`]) as JSON
//! `List` manifests into a directory under the binary's target dir, starts the
//! release kube-proxy-rs with `--manifests DIR` in a throwaway network
//! namespace, waits until its metrics report the first full sync, checks that
//! the last Service really is in the kernel, waits until the first periodic
//! sync (30 s after start) is over and the process is quiet, then leaves it
//! alone for `--idle` seconds and samples its RSS every second and its CPU time
//! (utime+stime from /proc/PID/stat) at both ends. Needs root.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use crate::lab::{samples, scrape, METRICS_ADDR};
use crate::netns;
use kp_netlab::ProcGuard;

/// Objects per manifest file: many moderate files, like a ConfigMap layout.
const PER_FILE: usize = 1000;

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_manifests(dir: &Path, n: u32, m: u32) -> Result<u64> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let syn = crate::cluster(n, m);
    let mut bytes = 0u64;
    let mut write = |name: String, items: &[Value]| -> Result<()> {
        let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
        let text = serde_json::to_vec(&list)?;
        bytes += text.len() as u64;
        std::fs::write(dir.join(name), text).context("writing a manifest")
    };
    for (i, c) in syn.services.chunks(PER_FILE).enumerate() {
        write(format!("services-{i:03}.json"), c)?;
    }
    for (i, c) in syn.slices.chunks(PER_FILE).enumerate() {
        write(format!("slices-{i:03}.json"), c)?;
    }
    Ok(bytes)
}

/// The first sample of metric `name`.
fn metric(text: &str, name: &str) -> Option<f64> {
    samples(text, name).first().copied()
}

fn status_kib(pid: u32, key: &str) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow!("{key} missing from /proc/{pid}/status"))
}

/// utime + stime of `pid`, in seconds.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = s
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| anyhow!("bad /proc/{pid}/stat"))?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); utime and stime are fields 14 and 15.
    let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(ticks as f64 / hz)
}

fn mib(kib: u64) -> String {
    format!("{:.0}", kib as f64 / 1024.0)
}

struct Row {
    n: u32,
    manifest_bytes: u64,
    first_sync: Duration,
    sync_cpu: f64,
    /// CPU seconds between the first sync and the start of the idle window,
    /// and how long that was.
    settle_cpu: f64,
    settle: Duration,
    /// (full, partial) syncs during the idle window.
    idle_syncs: (f64, f64),
    hwm: u64,
    rss_avg: u64,
    rss_max: u64,
    idle_cpu_pct: f64,
    restarts: Vec<Restart>,
}

/// Starts kube-proxy-rs in `ns` on the manifests in `dir` and waits for
/// its first full sync: the process, and the time from spawn to that.
fn start(
    bin: &Path,
    mode: &str,
    ns: &str,
    dir: &Path,
    log_path: &Path,
) -> Result<(ProcGuard, Duration)> {
    // Each start's log alone: a restart's adoption is read from it.
    std::fs::File::create(log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let t0 = Instant::now();
    let args = vec![
        format!("--proxy-mode={mode}"),
        format!("--manifests={}", dir.display()),
        "--hostname-override=node1".to_string(),
        "--healthz-bind-address=127.0.0.1:10256".to_string(),
        format!("--metrics-bind-address={METRICS_ADDR}"),
    ];
    let p = ProcGuard::start(ns, bin, &args, log_path)
        .with_context(|| format!("starting {}", bin.display()))?;
    let count = "kubeproxy_sync_full_proxy_rules_duration_seconds_count";
    loop {
        if let Some(st) = p.try_wait() {
            bail!(
                "kube-proxy-rs exited ({st}) before its first sync:\n{}",
                std::fs::read_to_string(log_path).unwrap_or_default()
            );
        }
        if let Ok(text) = scrape(ns, "/metrics") {
            if metric(&text, count).unwrap_or(0.0) >= 1.0 {
                return Ok((p, t0.elapsed()));
            }
        }
        if t0.elapsed() > Duration::from_secs(1800) {
            bail!("no full sync after 30 minutes");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One restart after a SIGKILL: time to the first sync, its CPU, the new
/// process's peak RSS, and what its log says it adopted.
struct Restart {
    first_sync: Duration,
    cpu: f64,
    hwm: u64,
    adopted: String,
}

/// `key=value` of the log's adoption lines (one per family), joined.
fn adopted(log: &str, key: &str) -> String {
    log.lines()
        .filter(|l| l.contains("adopted the table a previous run left"))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{key}=")))
                .map(str::to_string)
        })
        .collect::<Vec<_>>()
        .join(" + ")
}

fn measure(
    bin: &Path,
    mode: &str,
    (n, m): (u32, u32),
    idle: u64,
    work: &Path,
    perf_out: Option<&Path>,
    restarts: usize,
) -> Result<Row> {
    let dir = Dir(work.join(format!("kp-idle-{}-{n}", std::process::id())));
    let manifest_bytes = write_manifests(&dir.0, n, m)?;
    let ns = format!("kpidle{}x{n}", std::process::id());
    let _ns = netns::add(&ns)?;
    Command::new("ip")
        .args(["netns", "exec", &ns, "ip", "link", "set", "lo", "up"])
        .status()?;
    let log_path = dir.0.with_extension("log");
    let (p, first_sync) = start(bin, mode, &ns, &dir.0, &log_path)?;
    let pid = p.pid();
    let sync_cpu = cpu_seconds(pid)?;
    // The settle phase counts from here (the check below can take minutes at
    // 50k: nft reads the whole table to answer one element).
    let settle_from = Instant::now();
    // The first sync must have carried the whole cluster: the last Service's
    // ClusterIP (10.96.0.10 + n - 1) is in the kernel.
    let last = 0x0a60_0000u32 + 10 + n - 1;
    let ip = std::net::Ipv4Addr::from(last);
    let check = if mode == "nftables" {
        Command::new("ip")
            .args(["netns", "exec", &ns, "nft", "get", "element", "ip"])
            .args([kp_nftables::TABLE_NAME, "service-ips"])
            .arg(format!("{{ {ip} . tcp . 80 }}"))
            .output()?
    } else {
        Command::new("ip")
            .args(["netns", "exec", &ns, "sh", "-c"])
            .arg(format!(
                "iptables-save -t nat 2>/dev/null | grep -q -- '-d {ip}/32'; s1=$?; \
                 iptables-legacy-save -t nat 2>/dev/null | grep -q -- '-d {ip}/32'; s2=$?; \
                 [ $s1 = 0 ] || [ $s2 = 0 ]"
            ))
            .output()?
    };
    if !check.status.success() {
        bail!(
            "after the first sync the last Service ({ip}) is not programmed: {}",
            String::from_utf8_lossy(&check.stderr)
        );
    }
    // Settle: the first periodic sync (--iptables-sync-period, 30 s after
    // start) is not steady state; wait until it has passed and the process
    // has been quiet (< 5% CPU) for a whole second, at most 3 minutes.
    let mut prev = cpu_seconds(pid)?;
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let c = cpu_seconds(pid)?;
        let quiet = c - prev < 0.05;
        prev = c;
        if (settle_from.elapsed() + first_sync > Duration::from_secs(32) && quiet)
            || settle_from.elapsed() > Duration::from_secs(180)
        {
            break;
        }
    }
    let settle_cpu = cpu_seconds(pid)? - sync_cpu;
    let syncs = |text: &str| {
        (
            metric(
                text,
                "kubeproxy_sync_full_proxy_rules_duration_seconds_count",
            )
            .unwrap_or(0.0),
            metric(
                text,
                "kubeproxy_sync_partial_proxy_rules_duration_seconds_count",
            )
            .unwrap_or(0.0),
        )
    };
    let (full0, part0) = syncs(&scrape(&ns, "/metrics")?);
    // Optional profile of the idle window (perf's cpu-clock: no hardware
    // counters needed).
    let perf = match perf_out {
        Some(out) => {
            let args: Vec<String> = ["record", "-q", "-e", "cpu-clock", "-g", "-p"]
                .iter()
                .map(|a| a.to_string())
                .chain([
                    pid.to_string(),
                    "-o".to_string(),
                    out.with_extension(format!("{n}.data"))
                        .display()
                        .to_string(),
                ])
                .collect();
            let perf = ProcGuard::start(&ns, Path::new("perf"), &args, Path::new("/dev/null"))
                .context("starting perf record")?;
            Some(perf)
        }
        None => None,
    };
    let c0 = cpu_seconds(pid)?;
    let w0 = Instant::now();
    let mut rss = Vec::new();
    for _ in 0..idle {
        std::thread::sleep(Duration::from_secs(1));
        rss.push(status_kib(pid, "VmRSS:")?);
    }
    let idle_cpu_pct = (cpu_seconds(pid)? - c0) / w0.elapsed().as_secs_f64() * 100.0;
    if let Some(p) = perf {
        // SIGINT makes perf write its file and exit.
        p.signal(libc::SIGINT).context("stopping perf record")?;
        p.wait_exit(Duration::from_secs(120));
    }
    let (full1, part1) = syncs(&scrape(&ns, "/metrics")?);
    let rss_avg = rss.iter().sum::<u64>() / rss.len().max(1) as u64;
    let rss_max = rss.iter().copied().max().unwrap_or(0);
    // The high-water mark over the whole life: the first sync is the peak.
    let hwm = status_kib(pid, "VmHWM:")?;
    if p.try_wait().is_some() {
        bail!("kube-proxy-rs exited during the idle window");
    }
    // SIGKILL and start again over the table it left, `restarts` times.
    let mut again = Vec::new();
    drop(p);
    for _ in 0..restarts {
        let (p, first_sync) = start(bin, mode, &ns, &dir.0, &log_path)?;
        let cpu = cpu_seconds(p.pid())?;
        let hwm = status_kib(p.pid(), "VmHWM:")?;
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        again.push(Restart {
            first_sync,
            cpu,
            hwm,
            adopted: format!(
                "read {} ms, {} operations sent",
                adopted(&log, "read_ms"),
                adopted(&log, "operations_sent")
            ),
        });
        drop(p);
    }
    let _ = std::fs::remove_file(&log_path);
    Ok(Row {
        restarts: again,
        n,
        manifest_bytes,
        first_sync,
        sync_cpu,
        hwm,
        settle_cpu,
        settle: settle_from.elapsed().saturating_sub(w0.elapsed()),
        idle_syncs: (full1 - full0, part1 - part0),
        rss_avg,
        rss_max,
        idle_cpu_pct,
    })
}

/// `kp-bench idle`.
#[derive(clap::Args, Debug, Clone)]
pub struct IdleArgs {
    /// Services per row, comma-separated (kp-bench's mix).
    #[arg(long, value_delimiter = ',', default_value = "10000,50000")]
    sizes: Vec<u32>,
    /// Endpoints of each Service.
    #[arg(long, default_value_t = 10)]
    endpoints: u32,
    /// Seconds the settled proxy is left alone, its RSS sampled every
    /// second and its CPU time read at both ends.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    idle: u64,
    /// The proxy mode.
    #[arg(long, default_value = "nftables", value_parser = ["nftables", "iptables"])]
    mode: String,
    /// The kube-proxy-rs binary (build first: cargo build --release -p
    /// kube-proxy-rs -p kp-bench).
    #[arg(long, value_name = "PATH", default_value_os_t = crate::lab::beside_bench())]
    bin: PathBuf,
    /// Records the idle window with `perf record -e cpu-clock -g` into
    /// FILE.N.data (N: the size).
    #[arg(long, value_name = "FILE")]
    perf: Option<PathBuf>,
    /// Then SIGKILLs the proxy and starts it again over the table it left,
    /// N times, each timed to its first sync (a second table).
    #[arg(long, value_name = "N", default_value_t = 0)]
    restarts: usize,
}

/// `kp-bench idle`.
pub fn run(a: IdleArgs) -> Result<()> {
    let IdleArgs {
        sizes,
        endpoints: m,
        idle,
        mode,
        bin,
        perf,
        restarts,
    } = a;
    let exe = std::env::current_exe()?;
    let here = exe
        .parent()
        .ok_or_else(|| anyhow!("no directory for {}", exe.display()))?;
    if !bin.exists() {
        bail!(
            "{} not found: cargo build --release -p kube-proxy-rs",
            bin.display()
        );
    }
    println!("| Services (x{m} endpoints) | mode | manifests | time to first full sync | CPU to first sync | peak RSS (VmHWM) | after the first sync: CPU (over) | idle RSS avg / max | idle CPU ({idle} s) | syncs while idle (full / partial) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut again = Vec::new();
    for &n in &sizes {
        let r = measure(&bin, &mode, (n, m), idle, here, perf.as_deref(), restarts)?;
        println!(
            "| {} | {mode} | {:.1} MiB JSON | {:.2} s | {:.2} s | {} MiB | {:.2} s ({:.0} s) | {} / {} MiB | {:.2}% | {} / {} |",
            r.n,
            r.manifest_bytes as f64 / 1048576.0,
            r.first_sync.as_secs_f64(),
            r.sync_cpu,
            mib(r.hwm),
            r.settle_cpu,
            r.settle.as_secs_f64(),
            mib(r.rss_avg),
            mib(r.rss_max),
            r.idle_cpu_pct,
            r.idle_syncs.0,
            r.idle_syncs.1,
        );
        again.push((r.n, r.restarts));
    }
    if restarts > 0 {
        println!();
        println!("| Services | restart after SIGKILL | time to first full sync | CPU to first sync | peak RSS (VmHWM) | adoption (per family, from the log) |");
        println!("|---|---|---|---|---|---|");
        for (n, rs) in again {
            for (i, r) in rs.iter().enumerate() {
                println!(
                    "| {n} | {} | {:.2} s | {:.2} s | {} MiB | {} |",
                    i + 1,
                    r.first_sync.as_secs_f64(),
                    r.cpu,
                    mib(r.hwm),
                    r.adopted
                );
            }
        }
    }
    Ok(())
}
