//! `kp-bench compare --connect`: connect latency through a ClusterIP
//! programmed by kube-proxy-rs and by upstream kube-proxy, in one run,
//! against one real kube-apiserver.
//!
//! `kp-bench connect` drives our proxiers directly; this runs both proxy
//! binaries as operators do (compare's lab: etcd + kube-apiserver v1.36, two
//! node namespaces, N synthetic Services x 10 endpoints written through the
//! API), ours on node 1 and upstream's on node 2, at the same time and with
//! the same flags. One more Service, `zz-real` (ClusterIP 10.96.250.1:80,
//! internalTrafficPolicy Local), has one server pod on each node, so each
//! node's client pod reaches its own node's server through its own proxy's
//! rules. Floors: each client to its server's pod IP, no Service.
//!
//! Once both proxies hold the ruleset (and settled 5 s), connects are
//! measured in interleaved rounds (each round runs `connects / rounds`
//! connects against every row in turn), so background load hits all rows
//! alike. Both proxies stay running (idle) throughout.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::connect::probe::{connects, mean, us, Server};
use crate::lab::{check_binary, date_utc, has_ip, load_average, quantile, write_into, Lab};
use anyhow::{bail, Result};
use kp_netlab::Pod;
use serde_json::json;

const REAL_CLUSTER_IP: &str = "10.96.250.1";
const SERVICE_PORT: u16 = 80;
const POD_PORT: u16 = 8080;

/// What `compare --connect` takes (see `CompareArgs`).
pub(super) struct Opts {
    pub sizes: Vec<u32>,
    pub mode: String,
    pub connects: usize,
    pub rounds: usize,
    pub write: Option<PathBuf>,
    pub ours: PathBuf,
}

/// One row: who programmed the path, the client and the target.
struct Row {
    what: &'static str,
    client: Pod,
    target: SocketAddr,
    samples: Vec<Duration>,
    failures: usize,
}

/// The Service both clients connect to: one endpoint per node, each node
/// using only its own (internalTrafficPolicy Local).
fn create_real_service(lab: &Lab, servers: &[&Pod]) -> Result<()> {
    let endpoints: Vec<_> = servers
        .iter()
        .map(|p| {
            json!({"addresses": [p.ip().to_string()], "nodeName": format!("node{}", p.node()),
                   "conditions": {"ready": true}})
        })
        .collect();
    lab.create_service(
        json!({"metadata": {"name": "zz-real"},
            "spec": {"clusterIP": REAL_CLUSTER_IP, "internalTrafficPolicy": "Local",
                     "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": POD_PORT}]}}),
        json!({"metadata": {"name": "zz-real-x",
            "labels": {"kubernetes.io/service-name": "zz-real"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": POD_PORT, "protocol": "TCP"}],
            "endpoints": endpoints}),
    )
}

/// Measures one size; the table rows for it.
fn measure(o: &Opts, n: u32) -> Result<Vec<(String, Row)>> {
    eprintln!("N = {n} ({} mode): starting the control plane", o.mode);
    let lab = Lab::new("conncmp", true)?;
    let t = Instant::now();
    lab.populate(n)?;
    eprintln!(
        "  {n} Services created in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let mut pods = Vec::new();
    for node in 1..=2 {
        pods.push((
            lab.cluster.add_pod(node, &format!("srv{node}"))?,
            lab.cluster.add_pod(node, &format!("cli{node}"))?,
        ));
    }
    let _servers: Vec<Server> = pods
        .iter()
        .map(|(srv, _)| Server::start(srv, POD_PORT))
        .collect::<Result<_>>()?;
    create_real_service(&lab, &[&pods[0].0, &pods[1].0])?;

    let spawn = |node: usize, upstream: bool, who: &str| {
        lab.spawn_proxy(
            node,
            &o.mode,
            upstream,
            &o.ours,
            &format!("{who}-connect-{n}"),
        )
    };
    let t0 = Instant::now();
    let proxies = [spawn(1, false, "ours")?, spawn(2, true, "upstream")?];
    for (p, who) in proxies.iter().zip(["ours", "upstream"]) {
        let d = p.wait_first_sync(n, t0, Duration::from_secs(3600))?;
        // Its first sync may predate the real Service: wait for its rules.
        let ip = pods[p.node - 1].0.ip().to_string();
        p.programmed(0.0, |r| has_ip(r, REAL_CLUSTER_IP) && has_ip(r, &ip))?;
        eprintln!(
            "  {who}: first sync {:.1} s after both started",
            d.as_secs_f64()
        );
    }
    std::thread::sleep(Duration::from_secs(5));

    let service = SocketAddr::new(REAL_CLUSTER_IP.parse::<IpAddr>()?, SERVICE_PORT);
    let mut rows = Vec::new();
    for (i, (srv, cli)) in pods.iter().enumerate() {
        let proxy = if i == 0 {
            "kube-proxy-rs"
        } else {
            "upstream kube-proxy"
        };
        rows.push((
            format!("none (pod IP), node {}", i + 1),
            Row {
                what: "floor",
                client: cli.clone(),
                target: srv.addr(POD_PORT),
                samples: Vec::new(),
                failures: 0,
            },
        ));
        rows.push((
            proxy.to_string(),
            Row {
                what: "service",
                client: cli.clone(),
                target: service,
                samples: Vec::new(),
                failures: 0,
            },
        ));
    }
    // Warm up (neighbour entries, first conntrack allocations) and check that
    // every path answers before measuring.
    for (name, r) in &rows {
        let (ok, fail) = connects(&r.client, r.target, 50)?;
        if ok.is_empty() {
            bail!(
                "{name}: no connect to {} succeeded ({fail} failures)",
                r.target
            );
        }
    }
    let per = o.connects.div_ceil(o.rounds);
    for round in 0..o.rounds {
        for (_, r) in rows.iter_mut() {
            let (ok, fail) = connects(&r.client, r.target, per)?;
            r.samples.extend(ok);
            r.failures += fail;
        }
        eprintln!("  round {}/{} done", round + 1, o.rounds);
    }
    for p in &proxies {
        if !p.guard.is_running() {
            bail!(
                "a proxy exited during the run; log: {}",
                p.guard.log_path().display()
            );
        }
    }
    Ok(rows)
}

pub(super) fn run(o: Opts) -> Result<()> {
    check_binary(&o.ours)?;
    let mut body = String::new();
    for &n in &o.sizes {
        let mut rows = measure(&o, n)?;
        let mut floor = Duration::ZERO;
        for (name, r) in rows.iter_mut() {
            r.samples.sort();
            let p50 = quantile(&r.samples, 0.5);
            let vs = if r.what == "floor" {
                floor = p50;
                "-".to_string()
            } else if floor.is_zero() {
                "-".to_string()
            } else {
                format!(
                    "{:+.1}%",
                    (p50.as_secs_f64() / floor.as_secs_f64() - 1.0) * 100.0
                )
            };
            body.push_str(&format!(
                "| {n} | {name} | {}{} | {} | {} | {} | {vs} |\n",
                r.samples.len(),
                if r.failures > 0 {
                    format!(" ({} failed)", r.failures)
                } else {
                    String::new()
                },
                us(p50),
                us(quantile(&r.samples, 0.99)),
                us(mean(&r.samples)),
            ));
        }
    }
    let out = format!(
        "Measured {} by `kp-bench compare --connect --sizes {} --mode {} --connects {} --rounds {}` \
         (load average at the end: {}). Both proxies ran at the same time, in the same run, \
         on this machine, each on its own node of one lab cluster; each row's samples are \
         interleaved with the others'.\n\n\
         | Services (x10 endpoints) | path | connects | p50 µs | p99 µs | mean µs | p50 vs its node's floor |\n\
         |---|---|---|---|---|---|---|\n{body}",
        date_utc(),
        o.sizes.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
        o.mode,
        o.connects,
        o.rounds,
        load_average(),
    );
    print!("{out}");
    if let Some(path) = &o.write {
        write_into(path, &format!("kp-connect-compare {}", o.mode), &out)?;
        eprintln!("wrote the table into {}", path.display());
    }
    Ok(())
}
