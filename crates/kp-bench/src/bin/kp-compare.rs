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
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_netlab::{Cluster, ClusterOpts, ProcGuard};
use kp_testkit::{ControlPlane, ControlPlaneOpts, K8sBinaries};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

const NS: &str = "bench";
const ENDPOINTS: u32 = 10;

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
    let exe = std::env::current_exe().context("locating kp-compare")?;
    let mut o = Opts {
        sizes: vec![1000],
        mode: "nftables".into(),
        changes: 50,
        burst: 1000,
        idle: 60,
        write: None,
        ours: exe.with_file_name("kube-proxy-rs"),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--sizes" => {
                o.sizes = val()?
                    .split(',')
                    .map(|s| s.trim().parse().context("--sizes"))
                    .collect::<Result<_>>()?
            }
            "--mode" => o.mode = val()?,
            "--changes" => o.changes = val()?.parse().context("--changes")?,
            "--burst" => o.burst = val()?.parse().context("--burst")?,
            "--idle" => o.idle = val()?.parse().context("--idle")?,
            "--write" => o.write = Some(PathBuf::from(val()?)),
            "--ours" => o.ours = PathBuf::from(val()?),
            other => bail!("unknown argument {other} (see the file header)"),
        }
    }
    if !["nftables", "iptables"].contains(&o.mode.as_str()) {
        bail!("--mode must be nftables or iptables");
    }
    Ok(o)
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

/// Whether `text` holds address `ip` as a whole (10.1.0.7 is not in 10.1.0.73).
fn has_ip(text: &str, ip: &str) -> bool {
    text.match_indices(ip).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + ip.len()..].chars().next();
        !before.is_some_and(|c| c.is_ascii_digit() || c == '.')
            && !after.is_some_and(|c| c.is_ascii_digit())
    })
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn pct(v: &[Duration], p: f64) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v.get(((v.len().max(1) - 1) as f64 * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The lab's node `i` as the kubelet would register it.
fn node(cluster: &Cluster, i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": format!("node{i}"), "labels": {"kubernetes.io/hostname": format!("node{i}")}},
        "spec": {"podCIDRs": [cluster.pod_cidr(i).to_string()]},
        "status": {"addresses": [{"type": "InternalIP", "address": cluster.node_ip(i).to_string()}]}})
}

/// kp-bench's Service, with the NodePorts left to the API server (it
/// refuses kp-bench's repeating ones) and the namespace of this run.
fn api_service(mut s: Value) -> (Value, Option<Value>) {
    let status = s.as_object_mut().and_then(|o| o.remove("status"));
    if let Some(ports) = s["spec"]["ports"].as_array_mut() {
        for p in ports {
            if let Some(p) = p.as_object_mut() {
                p.remove("nodePort");
            }
        }
    }
    if let Some(spec) = s["spec"].as_object_mut() {
        spec.remove("healthCheckNodePort");
    }
    let lb = status.filter(|st| st["loadBalancer"]["ingress"].is_array());
    (s, lb)
}

struct Lab {
    cluster: Cluster,
    cp: ControlPlane,
    bins: K8sBinaries,
    client: kube::Client,
    rt: tokio::runtime::Runtime,
    ours_kubeconfig: PathBuf,
    upstream_kubeconfig: PathBuf,
}

impl Lab {
    fn new() -> Result<Lab> {
        let bins = K8sBinaries::find().context("finding the Kubernetes binaries")?;
        if bins.kube_proxy.is_none() {
            bail!("upstream kube-proxy not found (UPSTREAM_KUBE_PROXY_BIN or ../shared/k8s)");
        }
        let cluster = Cluster::new("compare", ClusterOpts::with_nodes(2))?;
        let host = cluster.add_host("cp", 5)?;
        let cp = ControlPlane::start(
            &bins,
            ControlPlaneOpts::in_netns("compare", &host.ns, host.ip),
        )?;
        for i in 1..=2 {
            cp.apply(&node(&cluster, i))?;
        }
        let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
        for f in [
            "serviceaccount.yaml",
            "clusterrole.yaml",
            "clusterrolebinding.yaml",
        ] {
            cp.apply_file(&deploy.join(f))?;
        }
        cp.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"namespace": "kube-system", "name": "kube-proxy"}}))?;
        cp.apply(&json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "kubeadm:node-proxier"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node-proxier"},
            "subjects": [{"kind": "ServiceAccount", "namespace": "kube-system", "name": "kube-proxy"}]}))?;
        let ours_kubeconfig = cp.dir().join("ours.kubeconfig");
        let upstream_kubeconfig = cp.dir().join("upstream.kubeconfig");
        cp.service_account_kubeconfig("kube-system", "kube-proxy-rs", &ours_kubeconfig)?;
        cp.service_account_kubeconfig("kube-system", "kube-proxy", &upstream_kubeconfig)?;
        // The API server listens inside the control plane's namespace: this
        // (single) thread moves there, so the client's sockets and the
        // runtime (current-thread) live where the server is reachable.
        let f = std::fs::File::open(format!("/run/netns/{}", host.ns))?;
        // SAFETY: setns on a namespace fd we own; affects this thread only.
        if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&f), libc::CLONE_NEWNET) } != 0 {
            bail!("setns: {}", std::io::Error::last_os_error());
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let client = rt.block_on(async {
            let kc = kube::config::Kubeconfig::read_from(cp.admin_kubeconfig())?;
            let c = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
            anyhow::Ok(kube::Client::try_from(c)?)
        })?;
        rt.block_on(Api::<Namespace>::all(client.clone()).create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}}))?,
        ))?;
        Ok(Lab {
            cluster,
            cp,
            bins,
            client,
            rt,
            ours_kubeconfig,
            upstream_kubeconfig,
        })
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), NS)
    }

    fn slices(&self) -> Api<EndpointSlice> {
        Api::namespaced(self.client.clone(), NS)
    }

    /// Creates Services and slices, 32 requests in flight.
    fn populate(&self, n: u32) -> Result<()> {
        let syn = kp_bench::cluster(n, ENDPOINTS);
        let (svcs, slices) = (self.services(), self.slices());
        self.rt.block_on(async {
            futures::stream::iter(syn.services.into_iter().map(|s| {
                let svcs = svcs.clone();
                async move {
                    let (s, lb) = api_service(s);
                    let name = s["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    svcs.create(&PostParams::default(), &serde_json::from_value(s)?)
                        .await?;
                    if let Some(lb) = lb {
                        svcs.patch_status(
                            &name,
                            &PatchParams::default(),
                            &Patch::Merge(json!({"status": lb})),
                        )
                        .await?;
                    }
                    anyhow::Ok(())
                }
            }))
            .buffer_unordered(32)
            .try_collect::<Vec<()>>()
            .await?;
            futures::stream::iter(syn.slices.into_iter().map(|s| {
                let slices = slices.clone();
                async move {
                    slices
                        .create(&PostParams::default(), &serde_json::from_value(s)?)
                        .await?;
                    anyhow::Ok(())
                }
            }))
            .buffer_unordered(32)
            .try_collect::<Vec<()>>()
            .await
        })?;
        Ok(())
    }

    /// Replaces the last endpoint of Service `i` (generation `g`); the new
    /// address.
    fn change(&self, i: u32, g: u32) -> Result<String> {
        let s = kp_bench::slice(i, ENDPOINTS, g, i % 10 == 3);
        let addr = s["endpoints"][ENDPOINTS as usize - 1]["addresses"][0]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let name = format!("svc-{i}-x");
        self.rt.block_on(self.slices().patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"endpoints": s["endpoints"]})),
        ))?;
        Ok(addr)
    }
}

/// A running proxy in a node namespace.
struct Proxy<'a> {
    lab: &'a Lab,
    node: usize,
    guard: ProcGuard,
    mode: String,
}

impl Proxy<'_> {
    fn metrics(&self) -> String {
        let ns = self.lab.cluster.node_ns(self.node).to_string();
        kp_netlab::in_netns(&ns, || {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect_timeout(
                &"127.0.0.1:10249".parse().ok()?,
                Duration::from_secs(2),
            )
            .ok()?;
            s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
            let mut b = String::new();
            s.read_to_string(&mut b).ok()?;
            Some(b)
        })
        .ok()
        .flatten()
        .unwrap_or_default()
    }

    /// Samples of `name` over all label sets.
    fn samples(&self, name: &str) -> Vec<f64> {
        self.metrics()
            .lines()
            .filter_map(|l| l.strip_prefix(name))
            .filter(|r| r.starts_with([' ', '{']))
            .filter_map(|r| r.rsplit(' ').next()?.trim().parse().ok())
            .collect()
    }

    fn ruleset(&self) -> String {
        let ns = self.lab.cluster.node_ns(self.node);
        let argv: &[&str] = if self.mode == "nftables" {
            &["nft", "list", "ruleset"]
        } else {
            &["iptables-save", "-t", "nat"]
        };
        self.lab
            .cluster
            .exec(ns, argv)
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// Waits for a sync that finished after `t0` (unix seconds) and after
    /// which `holds(ruleset)`; the time from `t0` to that sync's end.
    fn programmed(&self, t0: f64, holds: impl Fn(&str) -> bool) -> Result<Duration> {
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut checked = t0;
        while Instant::now() < deadline {
            let last = self
                .samples("kubeproxy_sync_proxy_rules_last_timestamp_seconds")
                .into_iter()
                .fold(0.0, f64::max);
            if last > checked {
                if holds(&self.ruleset()) {
                    return Ok(Duration::from_secs_f64((last - t0).max(0.0)));
                }
                checked = last;
            }
            // Every poll costs the proxy a /metrics render: 10 ms keeps that
            // under 1% of a core while resolving 8 ms changes.
            std::thread::sleep(Duration::from_millis(10));
        }
        bail!("not programmed within 600 s")
    }

    fn cpu_secs(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.guard.pid())).unwrap_or_default();
        // Fields after the parenthesised name: utime, stime, cutime, cstime
        // are the 14th to 17th. Children count: upstream runs `nft` (and
        // both proxies `iptables-restore`) as programs it waits for.
        let rest = stat.rsplit(')').next().unwrap_or("");
        let f: Vec<&str> = rest.split_whitespace().collect();
        let tick = 100.0; // USER_HZ on Linux
        let get = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (get(11) + get(12) + get(13) + get(14)) / tick
    }

    fn status_mib(&self, field: &str) -> f64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.guard.pid()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with(field))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse::<f64>().ok())
            })
            .map(|kb| kb / 1024.0)
            .unwrap_or(0.0)
    }
}

fn measure(lab: &Lab, o: &Opts, n: u32, upstream: bool, generation: &mut u32) -> Result<Figures> {
    let node = if upstream { 2 } else { 1 };
    let (bin, kc) = if upstream {
        (
            lab.bins.kube_proxy.clone().context("upstream kube-proxy")?,
            &lab.upstream_kubeconfig,
        )
    } else {
        (o.ours.clone(), &lab.ours_kubeconfig)
    };
    let args: Vec<String> = vec![
        format!("--proxy-mode={}", o.mode),
        format!("--kubeconfig={}", kc.display()),
        format!("--hostname-override=node{node}"),
        "--cluster-cidr=10.244.0.0/16".into(),
        "--metrics-bind-address=127.0.0.1:10249".into(),
        "--conntrack-max-per-core=0".into(),
        "--conntrack-tcp-timeout-established=0".into(),
        "--conntrack-tcp-timeout-close-wait=0".into(),
    ];
    let log = lab.cp.dir().join(format!(
        "{}-{n}.log",
        if upstream { "upstream" } else { "ours" }
    ));
    let t_start = Instant::now();
    let guard = lab
        .cluster
        .spawn(lab.cluster.node_ns(node), &bin, &args, &log)?;
    let p = Proxy {
        lab,
        node,
        guard,
        mode: o.mode.clone(),
    };
    let mut f = Figures::default();
    let last_ip = kp_bench::cluster(n, 1).services[n as usize - 1]["spec"]["clusterIP"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    loop {
        if !p.guard.is_running() {
            bail!("the proxy exited; log: {}", log.display());
        }
        if p.samples("kubeproxy_sync_proxy_rules_duration_seconds_count")
            .iter()
            .sum::<f64>()
            >= 1.0
            && has_ip(&p.ruleset(), &last_ip)
        {
            break;
        }
        if t_start.elapsed() > Duration::from_secs(3600) {
            bail!("no first sync within an hour");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f.first_sync = t_start.elapsed();
    f.first_sync_cpu = p.cpu_secs();
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
    lab.rt.block_on(async {
        lab.services()
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": "added"},
                    "spec": {"clusterIP": ip, "ports": [{"port": 80, "targetPort": 8080}]}}))?,
            )
            .await?;
        lab.slices()
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": "added-x",
                    "labels": {"kubernetes.io/service-name": "added"}},
                    "addressType": "IPv4", "ports": [{"port": 8080, "protocol": "TCP"}],
                    "endpoints": [{"addresses": ["10.250.0.1"], "conditions": {"ready": true}}]}))?,
            )
            .await?;
        anyhow::Ok(())
    })?;
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
        futures::stream::iter((0..burst as u32).map(|i| {
            let slices = lab.slices();
            async move {
                let s = kp_bench::slice(i, ENDPOINTS, g, i % 10 == 3);
                let addr = s["endpoints"][ENDPOINTS as usize - 1]["addresses"][0]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                slices
                    .patch(
                        &format!("svc-{i}-x"),
                        &PatchParams::default(),
                        &Patch::Merge(json!({"endpoints": s["endpoints"]})),
                    )
                    .await?;
                anyhow::Ok(addr)
            }
        }))
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
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
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
        load.join(" "),
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

/// Replaces the text between `<!-- kp-compare MODE begin -->` and its end
/// marker in `path` (appending the section when it is missing).
fn write_into(path: &std::path::Path, mode: &str, text: &str) -> Result<()> {
    let begin = format!("<!-- kp-compare {mode} begin -->");
    let end = format!("<!-- kp-compare {mode} end -->");
    let doc =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let block = format!("{begin}\n{text}{end}");
    let new = match (doc.find(&begin), doc.find(&end)) {
        (Some(a), Some(b)) if b > a => format!("{}{block}{}", &doc[..a], &doc[b + end.len()..]),
        _ => format!("{doc}\n{block}\n"),
    };
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

fn main() -> Result<()> {
    let o = parse_opts()?;
    if !o.ours.is_file() {
        bail!(
            "{} not found: build it (cargo build --release -p kube-proxy-rs) or pass --ours",
            o.ours.display()
        );
    }
    let mut results = BTreeMap::new();
    for &n in &o.sizes {
        eprintln!("N = {n} ({} mode): starting the control plane", o.mode);
        let lab = Lab::new()?;
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
        write_into(path, &o.mode, &text)?;
        eprintln!("wrote the table into {}", path.display());
    }
    Ok(())
}
