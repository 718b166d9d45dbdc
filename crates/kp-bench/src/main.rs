//! kp-bench: control-plane and dataplane timings at scale.
//!
//! `cargo run --release -p kp-bench -- [--sizes 1000,10000] [--endpoints 10]
//! [--changes 20] [--backend netlink|nft] [--no-apply]`. Needs root for the apply columns: each size
//! is programmed into a fresh network namespace (never the host's ruleset).

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_model::{ChangeTracker, Dataplane, IpFamily, LocalDetector, ProxierConfig, TrackerConfig};
use kp_nftables::{NftBackend, NftCli, NftNetlink, NftablesProxier};

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    if v.is_empty() {
        return Duration::ZERO;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

struct Netns(String);
impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        let _ = std::fs::remove_file(format!("/tmp/{}-nft", self.0));
    }
}

/// Moves this (single-threaded) process into network namespace `ns`, so the
/// netlink socket the backend opens talks to that namespace's kernel tables.
fn enter_netns(path: &str) -> Result<()> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {path}"))?;
    enter_netns_file(&f).with_context(|| format!("entering {path}"))
}

fn enter_netns_file(f: &std::fs::File) -> Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: setns on a namespace file descriptor we own; affects this thread only.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("setns: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let sizes: Vec<u32> = get("--sizes")
        .unwrap_or_else(|| "1000,10000".into())
        .split(',')
        .map(|s| s.parse().context("--sizes"))
        .collect::<Result<_>>()?;
    let m: u32 = get("--endpoints").unwrap_or_else(|| "10".into()).parse()?;
    let changes: usize = get("--changes").unwrap_or_else(|| "20".into()).parse()?;
    let apply = !args.iter().any(|a| a == "--no-apply");
    let netlink = get("--backend").as_deref() != Some("nft");
    println!(
        "backend: {}",
        if netlink { "netlink" } else { "nft program" }
    );
    // Where to come back to after each size's namespace.
    let home = std::fs::File::open("/proc/self/ns/net").context("opening our network namespace")?;

    println!("| Services | endpoints | model (convert+track) | render full | script | full sync (apply) | 1 endpoint change p50 / p99 (bytes) | add 1 Service | delete 1 Service | peak RSS |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for &n in &sizes {
        let syn = kp_bench::cluster(n, m);
        let svcs: Vec<Service> = syn
            .services
            .iter()
            .map(|v| serde_json::from_value(v.clone()))
            .collect::<Result<_, _>>()?;
        let slices: Vec<EndpointSlice> = syn
            .slices
            .iter()
            .map(|v| serde_json::from_value(v.clone()))
            .collect::<Result<_, _>>()?;
        let t0 = Instant::now();
        let mut tr = ChangeTracker::new(TrackerConfig {
            family: IpFamily::V4,
            node_name: "node1".into(),
            service_proxy_name: None,
        });
        let now = SystemTime::now();
        for s in &svcs {
            let _ = tr.update_service(s, now);
        }
        for s in &slices {
            let _ = tr.update_endpoint_slice(s, now);
        }
        tr.take_changes();
        let model = t0.elapsed();

        let mut pc = ProxierConfig::new(IpFamily::V4);
        pc.local_detector = LocalDetector::Cidrs(vec!["10.128.0.0/9".parse()?]);
        let ns = format!("kpbench{}x{n}", std::process::id());
        let wrapper = format!("/tmp/{ns}-nft");
        let mut guard = None;
        if apply {
            if !Command::new("ip")
                .args(["netns", "add", &ns])
                .status()?
                .success()
            {
                bail!("ip netns add failed (run as root)");
            }
            guard = Some(Netns(ns.clone()));
            std::fs::write(
                &wrapper,
                format!("#!/bin/sh\nexec ip netns exec {ns} nft \"$@\"\n"),
            )?;
            Command::new("chmod").args(["+x", &wrapper]).status()?;
        }
        if apply && netlink {
            enter_netns(&format!("/run/netns/{ns}"))?;
        }
        let backend: Box<dyn NftBackend> = if netlink {
            Box::new(NftNetlink::new())
        } else {
            Box::new(NftCli {
                program: wrapper.clone(),
            })
        };
        let mut dp = NftablesProxier::new(pc, backend);
        let t1 = Instant::now();
        let script = dp.render(tr.state());
        let render = t1.elapsed();
        let (mut full, mut p50, mut p99, mut add, mut del, mut bytes) = (
            "-".to_string(),
            "-".to_string(),
            "-".to_string(),
            "-".to_string(),
            "-".to_string(),
            0usize,
        );
        if apply {
            let t2 = Instant::now();
            let r = dp.sync(tr.state(), &BTreeSet::new(), true)?;
            full = format!("{} ms (render {} ms)", ms(t2.elapsed()), ms(r.render));
            let mut lat = Vec::new();
            for g in 1..=changes as u32 {
                let i = (g * 7919) % n;
                let s: EndpointSlice =
                    serde_json::from_value(kp_bench::slice(i, m, g, i % 10 == 3))?;
                let t = Instant::now();
                let _ = tr.update_endpoint_slice(&s, SystemTime::now());
                let cs = tr.take_changes();
                let r = dp.sync(tr.state(), &cs.changed, false)?;
                lat.push(t.elapsed());
                bytes = r.bytes;
            }
            p50 = ms(pct(&mut lat, 0.5));
            p99 = ms(pct(&mut lat, 0.99));
            let extra = kp_bench::cluster(n + 1, m);
            let s: Service = serde_json::from_value(extra.services[n as usize].clone())?;
            let sl: EndpointSlice = serde_json::from_value(extra.slices[n as usize].clone())?;
            let t = Instant::now();
            let _ = tr.update_service(&s, SystemTime::now());
            let _ = tr.update_endpoint_slice(&sl, SystemTime::now());
            let cs = tr.take_changes();
            dp.sync(tr.state(), &cs.changed, false)?;
            add = ms(t.elapsed());
            let t = Instant::now();
            tr.delete_service("bench", &format!("svc-{n}"), SystemTime::now());
            let cs = tr.take_changes();
            dp.sync(tr.state(), &cs.changed, false)?;
            del = ms(t.elapsed());
        }
        println!(
            "| {n} | {m} | {} ms | {} ms | {:.1} MiB, {} lines | {full} | {p50} / {p99} ms ({bytes} B) | {add} ms | {del} ms | {:.0} MiB |",
            ms(model),
            ms(render),
            script.len() as f64 / 1048576.0,
            script.lines().count(),
            peak_rss_mib()
        );
        drop(dp);
        if apply && netlink {
            enter_netns_file(&home)?;
        }
        drop(guard);
    }
    Ok(())
}
