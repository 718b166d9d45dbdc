//! What one proxy's start costs the API server, from the server's own
//! /metrics: one kube-apiserver v1.36 + etcd holding N Services with E
//! endpoints each, then each proxy given on the command line started in
//! turn (same flags, same kubeconfig, in the control plane's network
//! namespace, so its rules go nowhere else), the server's counters read
//! before it starts and after it has synced; a table of the deltas.
//!
//! Run as root (a network namespace):
//!   cargo run --release -p kp-source --example list_load -- \
//!     --services 2000 --endpoints 10 \
//!     ours-before=/path/to/old/kube-proxy-rs ours=target/release/kube-proxy-rs \
//!     upstream=/work/k8s-bin/kube-proxy
#![allow(clippy::unwrap_used, clippy::expect_used)] // a measurement tool

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kp_testkit::{prom, ControlPlane, ControlPlaneOpts, K8sBinaries};
use serde_json::{json, Value};

const NODE: &str = "node-1";

fn sh(ns: &str, argv: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns])
        .args(argv)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

const OURS: &[&str] = &["services", "endpointslices", "nodes", "servicecidrs"];

/// The figures of one reading of the server's /metrics.
fn figures(m: &str) -> Vec<f64> {
    let by_res = |name: &str, extra: &[&str]| -> f64 {
        OURS.iter()
            .map(|r| {
                let res = format!("resource=\"{r}\"");
                let mut l: Vec<&str> = vec![&res];
                l.extend(extra);
                prom::total(m, name, &l)
            })
            .sum()
    };
    vec![
        by_res(
            "apiserver_request_total",
            &["verb=\"LIST\"", "system_client=\"\""],
        ),
        prom::total(
            m,
            "apiserver_request_total",
            &[
                "verb=\"LIST\"",
                "resource=\"endpointslices\"",
                "system_client=\"\"",
            ],
        ),
        by_res(
            "apiserver_request_total",
            &["verb=\"WATCH\"", "system_client=\"\""],
        ),
        prom::total(m, "etcd_requests_total", &["operation=\"list\""]),
        prom::total(
            m,
            "etcd_requests_total",
            &["operation=\"list\"", "resource=\"services\""],
        ),
        prom::total(
            m,
            "etcd_requests_total",
            &["operation=\"list\"", "resource=\"endpointslices\""],
        ),
        by_res("apiserver_response_sizes_sum", &["verb=\"LIST\""]),
        by_res("apiserver_watch_events_sizes_sum", &[]),
    ]
}

/// Every series of `names` in a reading, by its full line name.
fn series(m: &str, names: &[&str]) -> std::collections::BTreeMap<String, f64> {
    m.lines()
        .filter(|l| names.iter().any(|n| l.starts_with(&format!("{n}{{"))))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

const DETAIL: &[&str] = &["etcd_requests_total", "apiserver_response_sizes_sum"];

const COLUMNS: &[&str] = &[
    "LIST requests",
    "LIST endpointslices",
    "WATCH requests ended (refused streaming lists)",
    "etcd list calls (all)",
    "etcd list services",
    "etcd list endpointslices",
    "LIST response bytes",
    "watch event bytes",
];

fn main() {
    let mut services = 2000usize;
    let mut endpoints = 10usize;
    let mut proxies: Vec<(String, String)> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--services" => services = args.next().unwrap().parse().unwrap(),
            "--endpoints" => endpoints = args.next().unwrap().parse().unwrap(),
            other => {
                let (label, path) = other.split_once('=').expect("LABEL=PATH");
                proxies.push((label.into(), path.into()));
            }
        }
    }
    let ns = format!("kp-listload-{}", std::process::id());
    assert!(Command::new("ip")
        .args(["netns", "add", &ns])
        .status()
        .unwrap()
        .success());
    sh(&ns, &["ip", "link", "set", "lo", "up"]);
    let result = std::panic::catch_unwind(|| run(&ns, services, endpoints, &proxies));
    let _ = Command::new("ip").args(["netns", "del", &ns]).status();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

fn run(ns: &str, services: usize, endpoints: usize, proxies: &[(String, String)]) {
    let bins = K8sBinaries::find().unwrap();
    let cp = ControlPlane::start(
        &bins,
        ControlPlaneOpts::in_netns("listload", ns, "127.0.0.1".parse().unwrap()),
    )
    .unwrap();
    let kc = cp.admin_kubeconfig().display().to_string();
    // The node, with an address and a podCIDR (upstream waits for them).
    let node = json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"topology.kubernetes.io/zone": "z1"}},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]}});
    cp.kubectl_stdin(&["create", "-f", "-"], Some(node.to_string().as_bytes()))
        .unwrap();
    cp.kubectl(&[
        "patch",
        "node",
        NODE,
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"addresses":[{"type":"InternalIP","address":"127.0.0.1"}]}}"#,
    ])
    .unwrap();
    let t0 = Instant::now();
    for chunk in (0..services).collect::<Vec<_>>().chunks(500) {
        let mut items: Vec<Value> = Vec::new();
        for &i in chunk {
            items.push(json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": "default", "name": format!("svc-{i}")},
                "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}));
            let eps: Vec<Value> = (0..endpoints)
                .map(|e| {
                    json!({"addresses": [format!("10.{}.{}.{}", 100 + i / 250, i % 250, e + 1)],
                           "conditions": {"ready": true}, "nodeName": NODE, "zone": "z1"})
                })
                .collect();
            items.push(
                json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"namespace": "default", "name": format!("svc-{i}-1"),
                             "labels": {"kubernetes.io/service-name": format!("svc-{i}"),
                                        "endpointslice.kubernetes.io/managed-by": "kp-listload"}},
                "addressType": "IPv4", "endpoints": eps,
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}),
            );
        }
        let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
        cp.kubectl_stdin(&["create", "-f", "-"], Some(list.to_string().as_bytes()))
            .unwrap();
    }
    eprintln!(
        "{services} Services x {endpoints} endpoints created in {:.0?}",
        t0.elapsed()
    );
    let mut rows = Vec::new();
    for (label, path) in proxies {
        // Quiet a moment: the server's own controllers settle.
        std::thread::sleep(Duration::from_secs(3));
        let m0 = cp.kubectl(&["get", "--raw", "/metrics"]).unwrap();
        let before = figures(&m0);
        let log = cp.dir().join(format!("{label}.log"));
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, path])
            .args([
                "--proxy-mode=nftables",
                &format!("--kubeconfig={kc}"),
                &format!("--hostname-override={NODE}"),
                "--cluster-cidr=10.244.0.0/16",
                "--metrics-bind-address=127.0.0.1:10249",
                "--healthz-bind-address=127.0.0.1:10256",
                "--conntrack-max-per-core=0",
                "--conntrack-tcp-timeout-established=0",
                "--conntrack-tcp-timeout-close-wait=0",
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let started = Instant::now();
        let synced = loop {
            let m = sh(
                ns,
                &[
                    "curl",
                    "-s",
                    "--max-time",
                    "2",
                    "http://127.0.0.1:10249/metrics",
                ],
            );
            if prom::total(&m, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", &[]) > 0.0
                || m.lines().any(|l| {
                    l.starts_with("kubeproxy_sync_proxy_rules_last_timestamp_seconds ")
                        && !l.ends_with(" 0")
                })
            {
                break started.elapsed();
            }
            if started.elapsed() > Duration::from_secs(300) {
                panic!("{label} did not sync in 300 s; log {}", log.display());
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        // Every list done and every watch open.
        std::thread::sleep(Duration::from_secs(5));
        let m1 = cp.kubectl(&["get", "--raw", "/metrics"]).unwrap();
        let after = figures(&m1);
        let (s0, s1) = (series(&m0, DETAIL), series(&m1, DETAIL));
        for (k, v) in &s1 {
            let d = v - s0.get(k).copied().unwrap_or(0.0);
            let interesting =
                (k.contains("operation=\"list\"") || k.contains("verb=\"LIST\"")) && d != 0.0;
            if interesting {
                eprintln!("  {label}: {k} +{d}");
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        sh(ns, &["nft", "flush", "ruleset"]);
        let d: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        eprintln!("{label}: synced after {synced:.1?}: {d:?}");
        rows.push((label.clone(), synced, d));
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "\n{services} Services x {endpoints} endpoints, one proxy started (deltas of kube-apiserver v1.36.2's /metrics, resources services/endpointslices/nodes/servicecidrs)\n"
    )
    .unwrap();
    write!(out, "| |").unwrap();
    for (label, _, _) in &rows {
        write!(out, " {label} |").unwrap();
    }
    writeln!(out).unwrap();
    writeln!(out, "|---|{}", "---|".repeat(rows.len())).unwrap();
    for (i, c) in COLUMNS.iter().enumerate() {
        write!(out, "| {c} |").unwrap();
        for (_, _, d) in &rows {
            if c.contains("bytes") {
                write!(out, " {:.2} MiB |", d[i] / 1048576.0).unwrap();
            } else {
                write!(out, " {} |", d[i]).unwrap();
            }
        }
        writeln!(out).unwrap();
    }
    write!(out, "| time to first sync |").unwrap();
    for (_, s, _) in &rows {
        write!(out, " {:.1} s |", s.as_secs_f64()).unwrap();
    }
    writeln!(out).unwrap();
}
