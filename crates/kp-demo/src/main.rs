//! kp-demo: kube-proxy-rs end to end on a throwaway cluster of network
//! namespaces (kp-netlab). It builds two nodes and three echo pods, writes a
//! Service and its EndpointSlice into a manifest directory, runs the sibling
//! `kube-proxy-rs` binary in nftables mode in node1's namespace, connects to
//! the ClusterIP from a client pod, shows the ruleset and the sync metrics,
//! adds a fourth endpoint and shows it taking traffic, then prints
//! `kube-proxy-rs status` and `kube-proxy-rs explain` for one of the client's
//! connections (with the kernel read-back: no drift). Everything it creates
//! lives in fresh namespaces and a temp directory, removed on exit, on error
//! and on Ctrl-C (a signal handler turns SIGINT/SIGTERM into an error at the
//! next step, so the drop guards run).
//!
//! Needs root (it creates network namespaces) and `nft`, `ip` on the PATH.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kp_netlab::{
    tcp_hello, tcp_hello_many, wait_until, Cluster, ClusterOpts, Pod, ProcGuard, ServeSpec,
    ServerGuard,
};
use serde_json::{json, Value};

const CLUSTER_IP: &str = "10.96.0.10";
const CLUSTER_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const SERVICE_PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;
const CONNECTIONS: usize = 12;
const METRICS_ADDR: &str = "127.0.0.1:10249";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one rule change may take to show, with slack for a busy machine.
const SYNC_WAIT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(200);

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("\nkp-demo failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn heading(title: &str) -> Result<()> {
    check_interrupted()?;
    println!("\n== {title} ==");
    Ok(())
}

/// Removes the manifest directory on every exit path.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The lab plus what runs in it; dropping it stops the proxy and the echo
/// servers, then removes every namespace.
struct Demo {
    // Field order is drop order: processes first, then the namespaces.
    proxy: Option<ProcGuard>,
    servers: Vec<ServerGuard>,
    cluster: Cluster,
    manifests: TempDir,
    log: PathBuf,
}

fn check_prerequisites() -> Result<PathBuf> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("kp-demo must run as root: it creates network namespaces (run `./demo.sh` from a root shell, or as a user with sudo)");
    }
    for (tool, package) in [("nft", "nftables"), ("ip", "iproute2")] {
        let ok = Command::new(tool)
            .arg("-V")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !ok {
            bail!("`{tool}` is missing or does not run; install the {package} package (demo.sh does this with apt-get)");
        }
    }
    let exe = std::env::current_exe().context("locating kp-demo's own executable")?;
    let proxy = exe.with_file_name("kube-proxy-rs");
    if !proxy.is_file() {
        bail!(
            "{} not found; build both binaries with `cargo build --release -p kube-proxy-rs -p kp-demo`",
            proxy.display()
        );
    }
    Ok(proxy)
}

fn service() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "default", "name": "web"},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": CLUSTER_IP, "clusterIPs": [CLUSTER_IP],
            "ports": [{"name": "http", "port": SERVICE_PORT, "protocol": "TCP", "targetPort": TARGET_PORT}]
        }
    })
}

fn endpoint_slice(pods: &[&Pod]) -> Value {
    let endpoints: Vec<Value> = pods
        .iter()
        .map(|p| {
            json!({
                "addresses": [p.ip().to_string()],
                "nodeName": format!("node{}", p.node()),
                "targetRef": {"kind": "Pod", "namespace": "default", "name": p.name()},
                "conditions": {"ready": true, "serving": true, "terminating": false}
            })
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": "default", "name": "web-x1",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": TARGET_PORT, "protocol": "TCP"}],
        "endpoints": endpoints
    })
}

/// Writes `obj` as `dir/file.json` atomically: the proxy polls the directory
/// and must never read a half-written file.
fn put(dir: &Path, file: &str, obj: &Value) -> Result<()> {
    let tmp = dir.join(format!(".{file}.tmp"));
    let body = serde_json::to_vec_pretty(obj).context("encoding a manifest")?;
    std::fs::write(&tmp, body).with_context(|| format!("writing {}", tmp.display()))?;
    let dst = dir.join(format!("{file}.json"));
    std::fs::rename(&tmp, &dst).with_context(|| format!("writing {}", dst.display()))?;
    Ok(())
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl Demo {
    fn add_pod(&mut self, node: usize, name: &str) -> Result<Pod> {
        let pod = self
            .cluster
            .add_pod(node, name)
            .with_context(|| format!("adding pod {name} on node{node}"))?;
        let server = self
            .cluster
            .serve(pod.ns(), name, ServeSpec::tcp(&[TARGET_PORT]))
            .with_context(|| format!("starting the echo server in pod {name}"))?;
        self.servers.push(server);
        println!(
            "  pod {:<7} node{}  {}:{}",
            name,
            node,
            pod.ip(),
            TARGET_PORT
        );
        Ok(pod)
    }

    fn proxy_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Fails with the proxy's log when it has exited.
    fn check_proxy(&self) -> Result<()> {
        if let Some(status) = self.proxy.as_ref().and_then(|p| p.try_wait()) {
            bail!(
                "kube-proxy-rs exited ({status}); its log:\n{}",
                tail(&self.proxy_log(), 30)
            );
        }
        Ok(())
    }

    /// Waits until a connection from `ns` to the Service is answered by a
    /// server that satisfies `ok`.
    fn wait_for(&self, what: &str, ns: &str, ok: impl Fn(&str) -> bool) -> Result<()> {
        let vip = vip();
        let reached = wait_until(SYNC_WAIT, POLL, || {
            if self.check_proxy().is_err() || INTERRUPTED.load(Ordering::SeqCst) {
                return true;
            }
            tcp_hello(ns, vip, CONNECT_TIMEOUT).is_ok_and(|r| ok(&r.server))
        });
        self.check_proxy()?;
        check_interrupted()?;
        if !reached {
            bail!(
                "timed out after {SYNC_WAIT:?} waiting for {what}; kube-proxy-rs log (tail):\n{}",
                tail(&self.proxy_log(), 30)
            );
        }
        Ok(())
    }

    /// `count` fresh connections to the Service, one line each, then a tally.
    fn connect_and_tally(&self, ns: &str, count: usize) -> Result<BTreeMap<String, usize>> {
        let mut tally: BTreeMap<String, usize> = BTreeMap::new();
        for (i, r) in tcp_hello_many(ns, vip(), count, CONNECT_TIMEOUT)
            .into_iter()
            .enumerate()
        {
            let r = r.with_context(|| format!("connection {} to {}", i + 1, vip()))?;
            println!(
                "  #{:<2} {} -> pod {:<6} (saw client {})",
                i + 1,
                vip(),
                r.server,
                r.peer.ip()
            );
            *tally.entry(r.server).or_default() += 1;
        }
        let summary: Vec<String> = tally.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("  tally: {}", summary.join("  "));
        Ok(tally)
    }
}

fn vip() -> SocketAddr {
    SocketAddr::new(CLUSTER_VIP.into(), SERVICE_PORT)
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Catches SIGINT and SIGTERM so the demo can unwind and remove its
/// namespaces instead of dying with them in place.
fn install_signal_handlers() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted; cleaning up");
    }
    Ok(())
}

/// Top-level blocks (`chain`, `map`, `set`) of `nft list table` output that
/// concern the demo Service, each cut to `max_lines`.
fn ruleset_summary(listing: &str, max_lines: usize, only_service: bool) -> String {
    let mut blocks: Vec<Vec<&str>> = Vec::new();
    let mut cur: Option<Vec<&str>> = None;
    for line in listing.lines() {
        let t = line.trim_start();
        let depth = line.len() - t.len();
        // `nft list` indents table members by one tab.
        if depth == 1 && (t.starts_with("chain ") || t.starts_with("map ") || t.starts_with("set "))
        {
            if let Some(b) = cur.take() {
                blocks.push(b);
            }
            cur = Some(vec![line]);
        } else if depth == 0 {
            // The table's own closing brace.
            if let Some(b) = cur.take() {
                blocks.push(b);
            }
        } else if let Some(b) = cur.as_mut() {
            b.push(line);
        }
    }
    if let Some(b) = cur.take() {
        blocks.push(b);
    }
    let wanted = |b: &Vec<&str>| {
        let head = b[0];
        let name = head.trim_start().split_once(' ').map_or("", |x| x.1);
        // A ClusterIP-only Service is picked in a shared chain, with its
        // endpoints in a select map (the demo's is the only Service).
        head.contains("default/web")
            || name.starts_with("pick-")
            || name.starts_with("select-")
            || !only_service
                && ["services ", "service-ips ", "cluster-ips ", "hairpin "]
                    .iter()
                    .any(|n| name.starts_with(n))
    };
    let mut out = String::new();
    for (i, b) in blocks.iter().filter(|b| wanted(b)).enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let shown = b.len().min(max_lines);
        for l in &b[..shown] {
            out.push_str(l);
            out.push('\n');
        }
        if b.len() > shown {
            out.push_str(&format!("\t\t... ({} more lines)\n", b.len() - shown));
        }
    }
    out
}

/// GET /metrics from inside node1's namespace (the metrics server listens on
/// that namespace's loopback).
fn fetch_metrics(ns: &str) -> Result<String> {
    let addr: SocketAddr = METRICS_ADDR
        .parse()
        .context("parsing the metrics address")?;
    let got = kp_netlab::in_netns(ns, move || -> std::io::Result<String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
        s.set_read_timeout(Some(CONNECT_TIMEOUT))?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut buf = String::new();
        s.read_to_string(&mut buf)?;
        Ok(buf)
    })
    .context("entering node1's namespace")?
    .with_context(|| format!("fetching http://{METRICS_ADDR}/metrics in node1"))?;
    let (head, body) = got.split_once("\r\n\r\n").unwrap_or((&got, ""));
    let ok = head.starts_with("HTTP/1.") && head.split_whitespace().nth(1) == Some("200");
    if !ok {
        bail!(
            "metrics server answered {:?}",
            head.lines().next().unwrap_or("")
        );
    }
    Ok(body.to_string())
}

fn sync_figures(metrics: &str) -> Vec<&str> {
    const WANTED: [&str; 4] = [
        "kubeproxy_sync_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_duration_seconds_sum",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_network_programming_duration_seconds_count",
    ];
    metrics
        .lines()
        .filter(|l| WANTED.iter().any(|w| l.starts_with(w)))
        .collect()
}

fn run() -> Result<()> {
    let proxy_bin = check_prerequisites()?;
    install_signal_handlers();

    heading("1. A two-node cluster made of network namespaces")?;
    let cluster = Cluster::new("kp-demo", ClusterOpts::with_nodes(2))
        .context("building the namespace cluster")?;
    let dir = std::env::temp_dir().join(format!("{}-demo-manifests", cluster.prefix()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let log = std::env::temp_dir().join(format!("{}-kube-proxy-rs.log", cluster.prefix()));
    println!(
        "  namespaces {}-*: node1 {} and node2 {} on a LAN bridge",
        cluster.prefix(),
        cluster.node_ip(1),
        cluster.node_ip(2)
    );
    let mut demo = Demo {
        proxy: None,
        servers: Vec::new(),
        cluster,
        manifests: TempDir(dir),
        log,
    };
    let a = demo.add_pod(1, "web-a")?;
    let b = demo.add_pod(1, "web-b")?;
    let c = demo.add_pod(2, "web-c")?;
    let client = demo
        .cluster
        .add_pod(1, "client")
        .context("adding the client pod")?;
    println!("  pod client  node1  {} (no server)", client.ip());

    heading("2. The Service and its EndpointSlice (manifest directory)")?;
    let dir = demo.manifests.0.clone();
    put(&dir, "service", &service())?;
    put(&dir, "endpoints", &endpoint_slice(&[&a, &b, &c]))?;
    println!(
        "  default/web  ClusterIP {CLUSTER_IP}:{SERVICE_PORT} -> {TARGET_PORT}, endpoints {}, {}, {}",
        a.ip(),
        b.ip(),
        c.ip()
    );
    println!("  written to {}", dir.display());

    heading("3. kube-proxy-rs (nftables mode) in node1's namespace")?;
    let args: Vec<String> = vec![
        "--proxy-mode=nftables".into(),
        format!("--manifests={}", dir.display()),
        "--hostname-override=node1".into(),
        format!("--cluster-cidr={}", demo.cluster.cluster_cidr()),
        "--iptables-min-sync-period=200ms".into(),
        format!("--metrics-bind-address={METRICS_ADDR}"),
        "--healthz-bind-address=127.0.0.1:10256".into(),
    ];
    println!("  {} {}", proxy_bin.display(), args.join(" "));
    let node1 = demo.cluster.node_ns(1).to_string();
    demo.proxy = Some(
        demo.cluster
            .spawn(&node1, &proxy_bin, &args, &demo.log)
            .context("starting kube-proxy-rs in node1")?,
    );
    println!("  log: {}", demo.log.display());
    demo.wait_for(
        &format!("{CLUSTER_IP}:{SERVICE_PORT} to answer"),
        client.ns(),
        |_| true,
    )?;
    println!("  {CLUSTER_IP}:{SERVICE_PORT} answers");

    heading(&format!(
        "4. {CONNECTIONS} connections from pod client to {CLUSTER_IP}:{SERVICE_PORT}"
    ))?;
    demo.connect_and_tally(client.ns(), CONNECTIONS)?;

    heading("5. The ruleset for the Service (nft list table ip kube-proxy-rs, trimmed)")?;
    let listing = demo
        .cluster
        .exec_ok(&node1, &["nft", "list", "table", "ip", "kube-proxy-rs"])
        .context("listing the nftables table in node1")?;
    print!("{}", ruleset_summary(&listing, 12, false));

    heading(&format!(
        "6. Sync metrics (http://{METRICS_ADDR}/metrics in node1)"
    ))?;
    let metrics = fetch_metrics(&node1)?;
    let figures = sync_figures(&metrics);
    if figures.is_empty() {
        bail!("the metrics page has none of the kubeproxy_sync_* figures");
    }
    for l in figures {
        println!("  {l}");
    }

    heading("7. Scaling out: a fourth endpoint, web-d on node2")?;
    let d = demo.add_pod(2, "web-d")?;
    put(&dir, "endpoints", &endpoint_slice(&[&a, &b, &c, &d]))?;
    println!("  EndpointSlice rewritten with 4 endpoints; waiting for web-d to get traffic");
    demo.wait_for("pod web-d to receive traffic", client.ns(), |s| {
        s == "web-d"
    })?;
    let tally = demo.connect_and_tally(client.ns(), CONNECTIONS)?;
    if !tally.contains_key("web-d") {
        // Random choice may skip one endpoint in 12 tries; the wait above
        // already proved web-d is reachable.
        println!(
            "  (web-d happened to get none of these {CONNECTIONS}; it answered during the wait)"
        );
    }
    let listing = demo
        .cluster
        .exec_ok(&node1, &["nft", "list", "table", "ip", "kube-proxy-rs"])
        .context("listing the nftables table in node1")?;
    println!("  the Service is now picked in the shared chain for 4 endpoints:");
    print!("{}", ruleset_summary(&listing, 12, true));
    let after = fetch_metrics(&node1)?;
    for l in sync_figures(&after)
        .into_iter()
        .filter(|l| l.starts_with("kubeproxy_sync_proxy_rules_duration_seconds_count"))
    {
        println!("  {l}");
    }

    heading("8. What kube-proxy-rs programmed (kube-proxy-rs status in node1)")?;
    let bin = proxy_bin.to_string_lossy().into_owned();
    let status = demo
        .cluster
        .exec_ok(&node1, &[&bin, "status"])
        .context("running kube-proxy-rs status in node1")?;
    print!("{}", indent(&status));

    let (src, dst) = (client.ip().to_string(), vip().to_string());
    heading(&format!(
        "9. Why a connection from pod client went where it did (kube-proxy-rs explain {src} {dst})"
    ))?;
    let explained = demo
        .cluster
        .exec_ok(&node1, &[&bin, "explain", &src, &dst])
        .context("running kube-proxy-rs explain in node1")?;
    print!("{}", indent(&explained));
    if !explained.contains("verdict  Dnat") || !explained.contains("drift    none") {
        bail!("explain did not find the DNAT path in the kernel:\n{explained}");
    }

    heading("10. Teardown")?;
    let prefix = demo.cluster.prefix().to_string();
    let log = demo.log.clone();
    drop(demo);
    // The log is only kept when something failed.
    let _ = std::fs::remove_file(&log);
    println!("  stopped kube-proxy-rs and the echo servers, removed namespaces {prefix}-*");
    println!("\nDone.");
    Ok(())
}
