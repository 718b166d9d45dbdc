//! The real-kernel conformance suite, shared by every proxy mode.
//!
//! Each case builds a small cluster of network namespaces (kp-netlab), runs
//! kube-proxy-rs in each node namespace fed from a manifest directory, and
//! connects through the kernel. A mode's test file calls every case with its
//! mode name, so iptables (or ipvs) runs exactly the same checks.
//!
//! A mode name may carry a source: "api/nftables" writes every object
//! through a real kube-apiserver (kp_testkit::control_plane, in a LAN host
//! namespace of the lab) and runs kube-proxy-rs with deploy/'s ServiceAccount
//! and RBAC; "upstream/nftables" runs upstream kube-proxy the same way (with
//! the `system:node-proxier` binding kubeadm gives it), so every expectation
//! of the suite is checked against the reference implementation too.

#![allow(dead_code)]

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kp_netlab::{
    tcp_hello, tcp_hello_from, tcp_hello_many, tcp_hold, udp_ask, udp_session, wait_until, Cluster,
    ClusterOpts, ConnError, Pod, ProcGuard, Reply, ServeSpec, ServerGuard,
};
use kp_testkit::{objects, ControlPlane, ControlPlaneOpts, K8sBinaries};
use serde_json::{json, Value};

pub const T: Duration = Duration::from_secs(2);
/// How long a rule change may take to show (one sync, with slack for CI).
pub const SYNC_WAIT: Duration = Duration::from_secs(20);

/// [`SYNC_WAIT`], or KP_CONFORMANCE_SYNC_WAIT seconds (the IPVS test VM runs
/// under emulation, where every program run is far slower).
pub fn sync_wait() -> Duration {
    std::env::var("KP_CONFORMANCE_SYNC_WAIT")
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(SYNC_WAIT)
}
pub const POLL: Duration = Duration::from_millis(100);

/// Where the proxy's objects come from, and whose proxy runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// kube-proxy-rs reading a manifest directory.
    Manifests,
    /// kube-proxy-rs against a real kube-apiserver ("api/MODE").
    Api,
    /// Upstream kube-proxy against a real kube-apiserver ("upstream/MODE").
    Upstream,
}

/// "api/iptables" -> (Api, "iptables"); a plain mode reads manifests.
pub fn split_mode(mode: &str) -> (Source, &str) {
    match mode.split_once('/') {
        Some(("api", m)) => (Source::Api, m),
        Some(("upstream", m)) => (Source::Upstream, m),
        // Manifests, the proxy run as the DaemonSet's main container: see
        // [`Env::start`].
        Some(("caps", m)) => (Source::Manifests, m),
        _ => (Source::Manifests, mode),
    }
}

/// The conformance guard of the real-API flavours: whether the Kubernetes
/// binaries are here (skips loudly without them; fails under
/// KP_REQUIRE_REAL_APISERVER=1). Manifest modes always run.
pub fn binaries_for(mode: &str) -> bool {
    match split_mode(mode).0 {
        Source::Manifests => true,
        Source::Api => K8sBinaries::for_test(&format!("conformance {mode}")).is_some(),
        Source::Upstream => {
            K8sBinaries::for_test_with_upstream(&format!("conformance {mode}")).is_some()
        }
    }
}

/// The real control plane of an API-sourced [`Env`].
pub struct RealApi {
    pub cp: ControlPlane,
    /// The namespace of the control plane's LAN host (fault tests cut its
    /// network).
    pub ns: String,
    pub bins: K8sBinaries,
    /// The proxies' kubeconfig: a ServiceAccount token with the proxy's RBAC.
    pub kubeconfig: PathBuf,
    /// What each [`Env::put`] key last wrote, to delete it by name.
    objects: std::sync::Mutex<std::collections::HashMap<String, Value>>,
}

/// The control plane's LAN host: 10.100.0.5 (nodes are .11, .12, ...).
pub const CONTROL_PLANE_HOST: u8 = 5;

/// Zone label of node `i` in API mode (topology cases).
pub fn zone_of(node: usize) -> String {
    format!("zone-{node}")
}

/// A test cluster with kube-proxy-rs (or upstream kube-proxy) on every node.
pub struct Env {
    /// Declared first: the API server goes before the namespaces do.
    pub api: Option<RealApi>,
    pub cluster: Cluster,
    /// The dataplane mode ("nftables", "iptables-legacy" ...), source stripped.
    pub mode: String,
    pub source: Source,
    pub dir: PathBuf,
    pub logs: PathBuf,
    proxies: Vec<Option<ProcGuard>>,
    /// "synced rules" lines in each node's log when its proxy was last
    /// started (the log is appended to across restarts).
    syncs_at_start: Vec<usize>,
    servers: Vec<ServerGuard>,
    /// "caps/MODE": the proxy runs with deploy/'s privileges only.
    least_privilege: bool,
    /// "nftables-socketlb": each node's cgroup (its namespace's and its pods'
    /// client threads join it) and the bpffs the proxies pin in.
    pub socket_lb: Option<SocketLbLab>,
}

pub struct SocketLbLab {
    /// Index = node (0 unused): each node's proxy balances its own sockets
    /// only, as on a real node.
    pub cgroups: Vec<kp_netlab::TestCgroup>,
    pub fs: kp_netlab::TestBpffs,
}

/// True for the suite modes that run nftables with socket load balancing.
pub fn is_socket_lb(mode: &str) -> bool {
    split_mode(mode).1.ends_with("-socketlb")
}

/// True for "nftables-tc-socketlb": socket load balancing plus the tc
/// programs for traffic from outside the node (`--bpf-nodeport`).
pub fn is_bpf_nodeport(mode: &str) -> bool {
    split_mode(mode).1.contains("-tc-")
}

/// Runs the rest of its arguments as deploy/daemonset.yaml's main container
/// runs kube-proxy-rs: /proc/sys read-only (in a mount namespace of its
/// own), no capability but NET_ADMIN, no new privileges. Every step execs,
/// so the proxy keeps the spawned PID.
fn least_privilege(socket_lb: bool) -> String {
    // --socket-lb also loads and attaches BPF programs: CAP_BPF besides.
    let caps = if socket_lb {
        "+net_admin,+bpf"
    } else {
        "+net_admin"
    };
    format!(
        "mount --bind /proc/sys /proc/sys && \
    mount -o remount,bind,ro /proc/sys && \
    exec setpriv --bounding-set=-all,{caps} --inh-caps=-all --no-new-privs \"$@\""
    )
}

impl Env {
    /// `mode` may name a source ("api/nftables", "upstream/iptables"): see
    /// the module documentation. Callers check [`binaries_for`] first.
    pub fn new(test: &str, mode: &str) -> Env {
        let (source, dp_mode) = split_mode(mode);
        let cluster = Cluster::new(test, ClusterOpts::with_nodes(2)).expect("building the lab");
        let dir = std::env::temp_dir().join(format!("{}-manifests", cluster.prefix()));
        let logs = std::env::temp_dir().join(format!("{}-logs", cluster.prefix()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::create_dir_all(&logs).unwrap();
        let api = (source != Source::Manifests).then(|| RealApi::start(&cluster, source, &logs));
        let socket_lb = is_socket_lb(mode).then(|| {
            let mut cgroups = Vec::new();
            for node in 0..=cluster.nodes() {
                let mut cg = kp_netlab::TestCgroup::new().expect("a test cgroup");
                if node > 0 {
                    cg.adopt_namespace(cluster.node_ns(node));
                }
                cgroups.push(cg);
            }
            SocketLbLab {
                cgroups,
                fs: kp_netlab::TestBpffs::new().expect("a bpf filesystem"),
            }
        });
        Env {
            api,
            cluster,
            mode: dp_mode.to_string(),
            source,
            dir,
            logs,
            proxies: vec![None, None, None],
            syncs_at_start: vec![0, 0, 0],
            servers: Vec::new(),
            least_privilege: mode.starts_with("caps/"),
            socket_lb,
        }
    }

    pub fn binary() -> PathBuf {
        PathBuf::from(env!("CARGO_BIN_EXE_kube-proxy-rs"))
    }

    /// The proxy this environment runs: ours, or upstream kube-proxy.
    pub fn proxy_binary(&self) -> PathBuf {
        match (&self.api, self.source) {
            (Some(api), Source::Upstream) => api
                .bins
                .kube_proxy
                .clone()
                .expect("binaries_for checked upstream kube-proxy"),
            _ => Env::binary(),
        }
    }

    /// The real control plane (API-sourced environments only).
    pub fn api(&self) -> &RealApi {
        self.api
            .as_ref()
            .expect("this environment reads manifests, not an API server")
    }

    /// The real control plane, to stop and start its processes (fault tests).
    pub fn control_plane(&mut self) -> &mut ControlPlane {
        &mut self
            .api
            .as_mut()
            .expect("this environment reads manifests, not an API server")
            .cp
    }

    /// Writes an object: atomically into the manifest directory (the proxy
    /// polls it), or through the API server.
    pub fn put(&self, file: &str, obj: &Value) {
        if let Some(api) = &self.api {
            api.cp
                .apply(obj)
                .unwrap_or_else(|e| panic!("writing {file} through the API server: {e}"));
            api.objects
                .lock()
                .unwrap()
                .insert(file.to_string(), obj.clone());
            return;
        }
        let tmp = self.dir.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, serde_json::to_vec_pretty(obj).unwrap()).unwrap();
        std::fs::rename(&tmp, self.dir.join(format!("{file}.json"))).unwrap();
    }

    pub fn remove(&self, file: &str) {
        if let Some(api) = &self.api {
            let obj = api.objects.lock().unwrap().remove(file);
            if let Some(obj) = obj {
                api.cp
                    .delete(&obj)
                    .unwrap_or_else(|e| panic!("deleting {file} through the API server: {e}"));
            }
            return;
        }
        let _ = std::fs::remove_file(self.dir.join(format!("{file}.json")));
    }

    pub fn proxy_args(&self, node: usize, extra: &[&str]) -> Vec<String> {
        let source = match &self.api {
            Some(api) => format!("--kubeconfig={}", api.kubeconfig.display()),
            None => format!("--manifests={}", self.dir.display()),
        };
        let mut a: Vec<String> = vec![
            format!("--proxy-mode={}", proxy_mode(&self.mode)),
            source,
            format!("--hostname-override=node{node}"),
            format!(
                "--cluster-cidr={},{}",
                self.cluster.cluster_cidr(),
                self.cluster.cluster_cidr6()
            ),
            "--iptables-min-sync-period=100ms".into(),
            "--iptables-sync-period=10s".into(),
            "--metrics-bind-address=127.0.0.1:10249".into(),
            "--healthz-bind-address=0.0.0.0:10256".into(),
            "-v=4".into(),
        ];
        // Plain "iptables" leaves the backend to auto-detection (nft in a
        // fresh namespace); "iptables-legacy" pins it.
        if iptables_backend(&self.mode) == Some("legacy") {
            a.push("--iptables-backend=legacy".into());
        }
        // "iptables-restore": iptables-nft written by its program (the
        // fallback), not over netlink.
        if split_mode(&self.mode).1 == "iptables-restore" {
            a.push("--iptables-nft-restore".into());
        }
        // The lab's nodes share one L2 segment and route everything on-link,
        // so a node ARPs for a Service IP it has not bound yet. Without strict
        // ARP the other node answers for its kube-ipvs0 and its IPVS takes the
        // flow; that IPVS connection then rewrites the endpoint's later
        // replies to the Service IP, which the first node drops as a martian
        // (c15, docs/ipvs.md). Upstream's remedy on such networks.
        if self.mode == "ipvs" {
            a.push("--ipvs-strict-arp".into());
        }
        // The conntrack table's size is machine-wide: left as it is (both
        // proxies apply the per-namespace conntrack timeouts at start).
        a.push("--conntrack-max-per-core=0".to_string());
        if let Some(lb) = &self.socket_lb {
            a.extend([
                "--socket-lb".to_string(),
                // Under kp-netlab's own cgroup2 mount in /tmp, which `ip
                // netns exec` (a fresh /sys) keeps visible.
                format!("--cgroup-path={}", lb.cgroups[node].path().display()),
                format!(
                    "--bpf-pin-path={}",
                    lb.fs.path().join(format!("node{node}")).display()
                ),
            ]);
            if is_bpf_nodeport(&self.mode) {
                a.push("--bpf-nodeport".to_string());
            }
        }
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    /// Starts kube-proxy-rs in node `node`'s namespace (without waiting for
    /// its first sync: [`Env::wait_synced`]).
    pub fn start(&mut self, node: usize, extra: &[&str]) {
        let args = self.proxy_args(node, extra);
        self.syncs_at_start[node] = self.syncs(node);
        let log = format!("node{node}.log");
        let g = if self.least_privilege {
            // The DaemonSet's privileged init container first...
            let init: Vec<String> = std::iter::once(Env::binary().display().to_string())
                .chain(self.proxy_args(node, &["--init-only"]))
                .collect();
            let out = self
                .cluster
                .exec(self.cluster.node_ns(node), &init)
                .expect("running --init-only");
            assert!(out.status.success(), "--init-only failed: {out:?}");
            // ... then the main container.
            let mut wrapped: Vec<String> = [
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                &least_privilege(self.socket_lb.is_some()),
                "kube-proxy-rs",
            ]
            .map(String::from)
            .to_vec();
            wrapped.push(self.proxy_binary().display().to_string());
            wrapped.extend(args);
            let g = self.spawn(
                node,
                std::path::Path::new("/usr/bin/unshare"),
                &wrapped,
                &log,
            );
            assert_least_privilege(g.pid(), self.socket_lb.is_some());
            g
        } else if self.mode == NFT_PROGRAM_MODE {
            // The `nft` program backend, as an operator selects it.
            let wrapped: Vec<String> = [
                format!("{NFT_BACKEND_ENV}=nft"),
                self.proxy_binary().display().to_string(),
            ]
            .into_iter()
            .chain(args)
            .collect();
            self.spawn(node, std::path::Path::new("/usr/bin/env"), &wrapped, &log)
        } else {
            self.spawn(node, &self.proxy_binary(), &args, &log)
        };
        self.proxies[node] = Some(g);
    }

    /// Runs `program args` in node `node`'s namespace, logging to `log` in
    /// the test's log directory; it is killed when the guard is dropped.
    /// For proxies started some other way than [`Env::start`] (a wrapper
    /// program, edited arguments).
    pub fn spawn(
        &self,
        node: usize,
        program: &std::path::Path,
        args: &[String],
        log: &str,
    ) -> ProcGuard {
        self.cluster
            .spawn(
                self.cluster.node_ns(node),
                program,
                args,
                &self.logs.join(log),
            )
            .unwrap_or_else(|e| panic!("starting {} on node{node}: {e}", program.display()))
    }

    /// Runs `kube-proxy-rs --cleanup` with node `node`'s arguments and
    /// asserts it succeeded.
    pub fn run_cleanup(&self, node: usize) {
        let argv: Vec<String> = std::iter::once(self.proxy_binary().display().to_string())
            .chain(self.proxy_args(node, &["--cleanup"]))
            .collect();
        let out = self
            .cluster
            .exec(self.cluster.node_ns(node), &argv)
            .expect("running --cleanup");
        assert!(
            out.status.success(),
            "--cleanup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts kube-proxy-rs on both nodes and waits for both first syncs.
    ///
    /// Until a node's proxy has synced, its pods' packets to a Service IP
    /// leave the node with an ARP request for it (the lab's nodes route
    /// everything on-link). A case connecting then would see a timeout or
    /// "no route to host", or, in IPVS mode without strict ARP, the other
    /// node's answer ([`Env::proxy_args`]): none of it the local proxy's.
    pub fn start_all(&mut self) {
        self.start(1, &[]);
        self.start(2, &[]);
        self.wait_synced(1);
        self.wait_synced(2);
    }

    /// "synced rules" lines in node `node`'s log (ours); upstream logs no
    /// such line, so there it is the running proxy's count of syncs
    /// (kubeproxy_sync_proxy_rules_duration_seconds_count, zero before the
    /// process answers).
    pub fn syncs(&self, node: usize) -> usize {
        if self.source == Source::Upstream {
            return metric_value(
                &self.metrics(node),
                "kubeproxy_sync_proxy_rules_duration_seconds_count",
            )
            .unwrap_or(0.0) as usize;
        }
        self.log(node).matches("synced rules").count()
    }

    /// Waits until node `node`'s proxy, as last started, has synced once.
    pub fn wait_synced(&self, node: usize) {
        // Upstream's count starts at zero in every new process.
        let before = if self.source == Source::Upstream {
            0
        } else {
            self.syncs_at_start[node]
        };
        self.wait(&format!("node{node}'s first sync"), || {
            self.syncs(node) > before
        });
        if self.mode == NFT_PROGRAM_MODE {
            let log = self.log(node);
            assert!(
                log.contains("transactions go through the nft program"),
                "node{node} did not select the nft program backend:\n{log}"
            );
        }
    }

    pub fn kill(&mut self, node: usize) {
        if let Some(p) = self.proxies[node].take() {
            p.kill_hard();
        }
    }

    pub fn log(&self, node: usize) -> String {
        std::fs::read_to_string(self.logs.join(format!("node{node}.log"))).unwrap_or_default()
    }

    /// Runs a command in node `node`'s namespace; its stdout.
    pub fn on_node(&self, node: usize, argv: &[&str]) -> String {
        let out = self.cluster.exec(self.cluster.node_ns(node), argv).unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn pod(&mut self, node: usize, name: &str) -> Pod {
        let p = self.cluster.add_pod(node, name).expect("adding a pod");
        if let Some(lb) = &mut self.socket_lb {
            lb.cgroups[node].adopt_namespace(p.ns());
        }
        let s = self
            .cluster
            .serve(p.ns(), name, ServeSpec::both(&[8080]))
            .expect("starting the echo server");
        self.servers.push(s);
        p
    }

    /// Waits until `f` holds, or fails the test with the proxies' logs.
    pub fn wait(&self, what: &str, f: impl FnMut() -> bool) {
        self.wait_for(what, sync_wait(), f)
    }

    /// [`Env::wait`] with its own time limit.
    pub fn wait_for(&self, what: &str, limit: Duration, f: impl FnMut() -> bool) {
        if !wait_until(limit, POLL, f) {
            panic!(
                "timed out waiting for {what}\n--- node1 log (tail) ---\n{}\n--- node2 log (tail) ---\n{}\n--- node1 ruleset ---\n{}",
                tail(&self.log(1)),
                tail(&self.log(2)),
                self.ruleset(1)
            );
        }
    }

    /// [`Env::wait`] for something node `node`'s proxy does: on a timeout
    /// the message shows that node's lines matching `grep` (the tail alone
    /// may hold only the other family's sync), its ruleset, and `last()`
    /// (what the condition saw last).
    pub fn wait_on(
        &self,
        node: usize,
        what: &str,
        grep: &str,
        mut f: impl FnMut() -> bool,
        last: impl Fn() -> String,
    ) {
        self.wait_on_for(node, what, grep, sync_wait(), &mut f, last)
    }

    /// [`Env::wait_on`] with its own time limit.
    pub fn wait_on_for(
        &self,
        node: usize,
        what: &str,
        grep: &str,
        limit: Duration,
        mut f: impl FnMut() -> bool,
        last: impl Fn() -> String,
    ) {
        if !wait_until(limit, POLL, &mut f) {
            let log = self.log(node);
            let lines: Vec<&str> = log.lines().filter(|l| l.contains(grep)).collect();
            panic!(
                "timed out waiting for {what}; last seen: {}\n--- node{node} log lines with {grep:?} ---\n{}\n--- node{node} log (tail) ---\n{}\n--- node{node} ruleset ---\n{}",
                last(),
                lines.join("\n"),
                tail(&log),
                self.ruleset(node)
            );
        }
    }

    /// Waits until a TCP connection from `ns` to `addr` is answered.
    pub fn wait_tcp(&self, ns: &str, addr: SocketAddr) -> Reply {
        let mut last = None;
        self.wait(&format!("TCP {addr} from {ns}"), || {
            last = tcp_hello(ns, addr, T).ok();
            last.is_some()
        });
        last.unwrap()
    }

    /// Node `node`'s rules as this mode's tools list them: `nft list ruleset`,
    /// or `iptables-save` + `ip6tables-save` in iptables mode; in userspace
    /// mode the addresses on lo and the listening sockets.
    pub fn ruleset(&self, node: usize) -> String {
        if self.mode == "ipvs" {
            // The iptables rules, the ipsets (whose entries carry the Service
            // name as comment) and the virtual servers.
            return self.on_node(node, &["iptables-save"])
                + &self.on_node(node, &["ip6tables-save"])
                + &self.on_node(node, &["ipset", "save"])
                + &self.on_node(node, &["ipvsadm", "-S", "-n"]);
        }
        match iptables_backend(&self.mode) {
            Some("legacy") => {
                // Everything must be in the legacy tables: nothing of ours in
                // the nf_tables ones (a backend mix-up is upstream's classic).
                let nft = self.on_node(node, &["iptables-nft-save"])
                    + &self.on_node(node, &["ip6tables-nft-save"]);
                assert!(
                    !nft.contains(":KUBE-"),
                    "legacy backend requested, but KUBE- chains are in iptables-nft:\n{nft}"
                );
                self.on_node(node, &["iptables-legacy-save"])
                    + &self.on_node(node, &["ip6tables-legacy-save"])
            }
            Some(_) => {
                self.on_node(node, &["iptables-save"]) + &self.on_node(node, &["ip6tables-save"])
            }
            None if self.mode == "userspace" => {
                self.on_node(node, &["ip", "addr", "show", "dev", "lo"])
                    + &self.on_node(node, &["ss", "-lntup"])
            }
            None => self.on_node(node, &["nft", "list", "ruleset"]),
        }
    }

    /// A string present in [`Env::ruleset`] exactly while this mode's rules
    /// are installed (our table name, or our chains' prefix).
    pub fn rules_marker(&self) -> &'static str {
        if self.mode == "ipvs" {
            return "KUBE-";
        }
        match iptables_backend(&self.mode) {
            Some(_) => "KUBE-",
            None if self.source == Source::Upstream => "table ip kube-proxy {",
            None => "kube-proxy-rs",
        }
    }

    pub fn metrics(&self, node: usize) -> String {
        http_get(
            self.cluster.node_ns(node),
            "127.0.0.1:10249".parse().unwrap(),
            "/metrics",
        )
        .map(|(_, b)| b)
        .unwrap_or_default()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        for p in self.proxies.iter_mut().flatten() {
            p.kill_hard();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.logs);
        }
    }
}

/// Waits until `pid` runs kube-proxy-rs itself (past the wrapper's execs),
/// then checks that it holds exactly CAP_NET_ADMIN and sees /proc/sys
/// read-only.
fn assert_least_privilege(pid: u32, socket_lb: bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        if st
            .lines()
            .any(|l| l.starts_with("Name:") && l.contains("kube-proxy-rs"))
        {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "pid {pid} never became kube-proxy-rs: {st}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let cap = |field: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    // Bit 12: CAP_NET_ADMIN; bit 39: CAP_BPF.
    let want = if socket_lb {
        "0000008000001000"
    } else {
        "0000000000001000"
    };
    assert_eq!(cap("CapEff:"), want, "{status}");
    assert_eq!(cap("CapBnd:"), want, "{status}");
    assert_eq!(cap("NoNewPrivs:"), "1", "{status}");
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
    assert!(
        mounts.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(4) == Some(&"/proc/sys")
                && f.get(5).is_some_and(|o| o.split(',').any(|x| x == "ro"))
        }),
        "/proc/sys is not read-only for the proxy:\n{mounts}"
    );
}

/// The suite mode that runs nftables mode with its `nft` program backend
/// (every transaction as nft text through `nft -f -`).
pub const NFT_PROGRAM_MODE: &str = "nftables-nft";
const NFT_BACKEND_ENV: &str = "KUBE_PROXY_RS_NFT_BACKEND";

/// The --proxy-mode of a suite mode name: "iptables-legacy" runs iptables mode.
pub fn proxy_mode(mode: &str) -> &str {
    let mode = split_mode(mode).1;
    mode.split('-').next().unwrap_or(mode)
}

/// The iptables backend of a suite mode: "iptables" (over netlink) and
/// "iptables-restore" -> nft (what detection picks in a fresh namespace, and
/// what `iptables` is on this machine),
/// "iptables-legacy" -> legacy; None outside iptables mode.
pub fn iptables_backend(mode: &str) -> Option<&'static str> {
    match split_mode(mode).1 {
        "iptables" | "iptables-restore" => Some("nft"),
        "iptables-legacy" => Some("legacy"),
        _ => None,
    }
}

impl RealApi {
    /// Starts etcd and kube-apiserver on a LAN host of `cluster`, creates
    /// the Node objects (addresses, podCIDRs, zone labels) and the proxy's
    /// identity, and writes its kubeconfig into `logs`.
    fn start(cluster: &Cluster, source: Source, logs: &std::path::Path) -> RealApi {
        let bins = K8sBinaries::find().expect("binaries_for checked the Kubernetes binaries");
        let host = cluster
            .add_host("cp", CONTROL_PLANE_HOST)
            .expect("adding the control plane host");
        let cp = ControlPlane::start(
            &bins,
            ControlPlaneOpts::in_netns(cluster.test_name(), &host.ns, host.ip),
        )
        .unwrap_or_else(|e| panic!("starting the control plane: {e}"));
        for i in 1..=cluster.nodes() {
            cp.apply(&node_object(cluster, i, &[]))
                .unwrap_or_else(|e| panic!("creating Node node{i}: {e}"));
        }
        let kubeconfig = logs.join("proxy.kubeconfig");
        match source {
            Source::Upstream => {
                // As kubeadm deploys it: ServiceAccount kube-system/kube-proxy
                // bound to the bootstrap ClusterRole system:node-proxier.
                cp.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": {"namespace": "kube-system", "name": "kube-proxy"}}))
                    .unwrap();
                cp.apply(&json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                    "metadata": {"name": "kubeadm:node-proxier"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node-proxier"},
                    "subjects": [{"kind": "ServiceAccount", "namespace": "kube-system", "name": "kube-proxy"}]}))
                    .unwrap();
                cp.service_account_kubeconfig("kube-system", "kube-proxy", &kubeconfig)
            }
            _ => {
                // Exactly deploy/'s identity: a verb missing there fails a case.
                let deploy =
                    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
                for f in [
                    "serviceaccount.yaml",
                    "clusterrole.yaml",
                    "clusterrolebinding.yaml",
                ] {
                    cp.apply_file(&deploy.join(f))
                        .unwrap_or_else(|e| panic!("applying deploy/{f}: {e}"));
                }
                cp.service_account_kubeconfig("kube-system", "kube-proxy-rs", &kubeconfig)
            }
        }
        .unwrap_or_else(|e| panic!("creating the proxy's token: {e}"));
        RealApi {
            cp,
            ns: host.ns,
            bins,
            kubeconfig,
            objects: Default::default(),
        }
    }
}

/// Node `i` as the kubelet and node IPAM would have it: InternalIPs (both
/// families), podCIDRs, hostname and zone labels, plus `labels`.
pub fn node_object(cluster: &Cluster, i: usize, labels: &[(&str, &str)]) -> Value {
    let mut l = serde_json::Map::new();
    l.insert("kubernetes.io/hostname".into(), json!(format!("node{i}")));
    l.insert("topology.kubernetes.io/zone".into(), json!(zone_of(i)));
    for (k, v) in labels {
        l.insert(k.to_string(), json!(v));
    }
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": format!("node{i}"), "labels": l},
        "spec": {
            "podCIDR": cluster.pod_cidr(i).to_string(),
            "podCIDRs": [cluster.pod_cidr(i).to_string(), cluster.pod_cidr6(i).to_string()]
        },
        "status": {"addresses": [
            {"type": "InternalIP", "address": cluster.node_ip(i).to_string()},
            {"type": "InternalIP", "address": cluster.node_ip6(i).to_string()},
            {"type": "Hostname", "address": format!("node{i}")}
        ]}
    })
}

/// The sum of Prometheus samples `name` in `text` over all label sets
/// (upstream labels some per IP family); `None` when there is none.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    kp_testkit::prom::sum(text, name, &[])
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Minimal HTTP/1.0 GET from inside a namespace: (status, body).
pub fn http_get(ns: &str, addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let path = path.to_string();
    kp_netlab::in_netns(ns, move || -> Option<(u16, String)> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect_timeout(&addr, T).ok()?;
        s.set_read_timeout(Some(T)).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).ok()?;
        let status = buf.split_whitespace().nth(1)?.parse().ok()?;
        let body = buf.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
        Some((status, body))
    })
    .ok()
    .flatten()
}

/// `args` with the argument starting with `prefix` (e.g. "--proxy-mode=")
/// replaced by `with`.
pub fn replace_arg(args: Vec<String>, prefix: &str, with: &str) -> Vec<String> {
    args.into_iter()
        .map(|a| {
            if a.starts_with(prefix) {
                with.to_string()
            } else {
                a
            }
        })
        .collect()
}

pub fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

/// A Service with TCP port 80 "http" and UDP port 53 "dns", both to 8080.
pub fn service(name: &str, cluster_ips: &[&str], spec: Value) -> Value {
    objects::service("default", name)
        .spec(json!({"type": "ClusterIP"}))
        .cluster_ips(cluster_ips)
        .port_json(json!({"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}))
        .port_json(json!({"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8080}))
        .spec(spec)
        .json()
}

pub fn with_status(mut svc: Value, lb_ips: &[&str]) -> Value {
    svc["status"] = json!({"loadBalancer": {"ingress": lb_ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}});
    svc
}

/// Endpoint conditions.
#[derive(Clone, Copy)]
pub enum Cond {
    Ready,
    Terminating,
    NotReady,
}

/// An EndpointSlice for `svc` listing `pods` (with conditions).
pub fn slice(svc: &str, suffix: &str, family: &str, pods: &[(&Pod, Cond)]) -> Value {
    pods.iter()
        .fold(
            objects::slice("default", &format!("{svc}-{suffix}"), svc)
                .address_type(family)
                .port("http", 8080, "TCP")
                .port("dns", 8080, "UDP"),
            |b, (p, c)| {
                let ip: IpAddr = if family == "IPv6" { p.ip6() } else { p.ip() };
                let (r, s, t) = match c {
                    Cond::Ready => (true, true, false),
                    Cond::Terminating => (false, true, true),
                    Cond::NotReady => (false, false, false),
                };
                b.endpoint_json(json!({
                    "addresses": [ip.to_string()],
                    "nodeName": format!("node{}", p.node()),
                    "conditions": {"ready": r, "serving": s, "terminating": t}
                }))
            },
        )
        .json()
}

pub fn ready<'a>(pods: &[&'a Pod]) -> Vec<(&'a Pod, Cond)> {
    pods.iter().map(|p| (*p, Cond::Ready)).collect()
}

fn count_by_server(
    replies: &[Result<Reply, ConnError>],
) -> std::collections::BTreeMap<String, usize> {
    let mut m = std::collections::BTreeMap::new();
    for r in replies.iter().flatten() {
        *m.entry(r.server.clone()).or_default() += 1;
    }
    m
}

// ---------------------------------------------------------------------------
// The cases
// ---------------------------------------------------------------------------

/// Case 1: ClusterIP TCP and UDP from a pod, from the node itself and from another
/// node; three endpoints share 300 connections fairly.
pub fn clusterip(mode: &str) {
    let mut env = Env::new("clusterip", mode);
    let a = env.pod(1, "a");
    let b = env.pod(1, "b");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    env.put("svc", &service("web", &["10.96.0.10"], json!({})));
    env.put("eps", &slice("web", "1", "IPv4", &ready(&[&a, &b, &c])));
    env.start_all();
    let vip = sa("10.96.0.10", 80);
    env.wait_tcp(client.ns(), vip);
    let replies = tcp_hello_many(client.ns(), vip, 300, T);
    let failed = replies.iter().filter(|r| r.is_err()).count();
    assert_eq!(
        failed,
        0,
        "failed connections: {:?}",
        replies.iter().find(|r| r.is_err())
    );
    let counts = count_by_server(&replies);
    for name in ["a", "b", "c"] {
        let n = counts.get(name).copied().unwrap_or(0);
        assert!(
            n >= 60,
            "endpoint {name} got {n} of 300 connections: {counts:?}"
        );
    }
    // The client pod's own IP is seen (pod-to-service traffic is not SNATed).
    let r = tcp_hello(client.ns(), vip, T).unwrap();
    assert_eq!(r.peer.ip(), client.ip());
    // From the node itself and from the other node.
    env.wait_tcp(env.cluster.node_ns(1), vip);
    env.wait_tcp(env.cluster.node_ns(2), vip);
    // UDP from a pod and from the other node.
    let dns = sa("10.96.0.10", 53);
    env.wait("UDP from a pod", || udp_ask(client.ns(), dns, T).is_ok());
    env.wait("UDP from node2", || {
        udp_ask(env.cluster.node_ns(2), dns, T).is_ok()
    });
}

/// Case 2: NodePort from the external client to each node; --nodeport-addresses
/// limits which addresses answer.
pub fn nodeport(mode: &str) {
    let mut env = Env::new("nodeport", mode);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let svc = service(
        "np",
        &["10.96.0.20"],
        json!({"type": "NodePort", "ports": [
            {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30080},
            {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8080, "nodePort": 30053}]}),
    );
    env.put("svc", &svc);
    env.put("eps", &slice("np", "1", "IPv4", &ready(&[&a, &c])));
    // A second address on node1 that NodePorts must not answer on.
    env.cluster
        .exec_ok(
            env.cluster.node_ns(1),
            &["ip", "addr", "add", "10.100.0.51/24", "dev", "eth0"],
        )
        .unwrap();
    env.start(1, &["--nodeport-addresses=10.100.0.11/32"]);
    env.start(2, &[]);
    let cl = env.cluster.client_ns().to_string();
    env.wait_tcp(&cl, sa("10.100.0.11", 30080));
    env.wait_tcp(&cl, sa("10.100.0.12", 30080));
    env.wait("UDP NodePort", || {
        udp_ask(&cl, sa("10.100.0.12", 30053), T).is_ok()
    });
    let denied = tcp_hello(&cl, sa("10.100.0.51", 30080), T);
    assert!(
        denied.is_err(),
        "NodePort answered on an address outside --nodeport-addresses: {denied:?}"
    );
}

/// Case 3: externalIPs and a LoadBalancer IP; loadBalancerSourceRanges lets the
/// allowed client in and keeps the other out.
pub fn external_and_lb(mode: &str) {
    let mut env = Env::new("extlb", mode);
    let a = env.pod(1, "a");
    let svc = with_status(
        service(
            "lb",
            &["10.96.0.30"],
            json!({"type": "LoadBalancer", "externalIPs": ["203.0.113.10"],
                   "loadBalancerSourceRanges": ["10.100.0.100/32"],
                   "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30081}]}),
        ),
        &["203.0.113.20"],
    );
    env.put("svc", &svc);
    env.put("eps", &slice("lb", "1", "IPv4", &ready(&[&a])));
    let cl = env.cluster.client_ns().to_string();
    env.cluster
        .exec_ok(
            &cl,
            &["ip", "addr", "add", "10.100.0.101/24", "dev", "eth0"],
        )
        .unwrap();
    env.cluster
        .client_route_via("203.0.113.0/24".parse().unwrap(), 1)
        .unwrap();
    env.start_all();
    env.wait_tcp(&cl, sa("203.0.113.10", 80));
    let allowed: IpAddr = "10.100.0.100".parse().unwrap();
    let denied: IpAddr = "10.100.0.101".parse().unwrap();
    env.wait("allowed client through the LB IP", || {
        tcp_hello_from(&cl, Some(allowed), sa("203.0.113.20", 80), T).is_ok()
    });
    let r = tcp_hello_from(&cl, Some(denied), sa("203.0.113.20", 80), T);
    assert!(
        r.is_err(),
        "a source outside loadBalancerSourceRanges got in: {r:?}"
    );
    // The external IP has no source ranges: the second client may use it.
    assert!(tcp_hello_from(&cl, Some(denied), sa("203.0.113.10", 80), T).is_ok());
}

/// Case 4: sessionAffinity ClientIP: a client sticks to one endpoint.
pub fn session_affinity(mode: &str) {
    let mut env = Env::new("affinity", mode);
    let a = env.pod(1, "a");
    let b = env.pod(1, "b");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    let client2 = env.pod(2, "client2");
    env.put(
        "svc",
        &service(
            "aff",
            &["10.96.0.40"],
            json!({"sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}}}),
        ),
    );
    env.put("eps", &slice("aff", "1", "IPv4", &ready(&[&a, &b, &c])));
    env.start_all();
    let vip = sa("10.96.0.40", 80);
    env.wait_tcp(client.ns(), vip);
    for ns in [client.ns(), client2.ns()] {
        let replies = tcp_hello_many(ns, vip, 50, T);
        let counts = count_by_server(&replies);
        assert_eq!(counts.len(), 1, "client {ns} was spread over {counts:?}");
        let failed: Vec<(usize, &ConnError)> = replies
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().err().map(|e| (i, e)))
            .collect();
        assert!(
            failed.is_empty(),
            "client {ns}: {} of 50 connections failed (attempt, error): {failed:?}",
            failed.len()
        );
    }
}

/// Session affinity for a client whose first connect() came before the
/// Service did (e2e's "Granular Checks: Services should function for client
/// IP based session affinity": its first request can race the Service's
/// first sync). The first SYN meets "drop traffic to unallocated ClusterIPs";
/// its retransmit, after the sync, is DNATed by the rules; every later
/// connection of that client must reach the same endpoint, as with upstream,
/// whatever layer picks it. Several clients: one that keeps its endpoint by
/// chance (one in three) does not hide a second store of records.
pub fn affinity_from_a_connect_before_the_service(mode: &str) {
    let mut env = Env::new("affearly", mode);
    let pods = [env.pod(2, "a"), env.pod(2, "b"), env.pod(2, "c")];
    let clients: Vec<Pod> = (0..4).map(|i| env.pod(1, &format!("cl{i}"))).collect();
    // Another Service, so that the rules (and the Service range's drop) are
    // in place before the clients connect.
    env.put("svc0", &service("other", &["10.96.0.48"], json!({})));
    env.put("eps0", &slice("other", "1", "IPv4", &ready(&[&pods[0]])));
    env.start_all();
    env.wait_tcp(clients[0].ns(), sa("10.96.0.48", 80));
    let vip = sa("10.96.0.47", 80);
    // Retransmits at 1, 3 and 7 s after the connect: well within 15 s of a
    // Service written right after.
    let early: Vec<_> = clients
        .iter()
        .map(|c| {
            let ns = c.ns().to_string();
            std::thread::spawn(move || tcp_hello(&ns, vip, Duration::from_secs(15)))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // Endpoints first: a sync between the two writes would otherwise reject
    // a retransmit (no endpoints), which is right but not this case.
    let all: Vec<&Pod> = pods.iter().collect();
    env.put("eps", &slice("early", "1", "IPv4", &ready(&all)));
    env.put(
        "svc",
        &service(
            "early",
            &["10.96.0.47"],
            json!({"sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}}}),
        ),
    );
    for (c, h) in clients.iter().zip(early) {
        let first = match h.join().expect("the early client's thread") {
            Ok(r) => r.server,
            Err(e) => panic!(
                "client {}: the connect made before the Service: {e:?}",
                c.ns()
            ),
        };
        let later = tcp_hello_many(c.ns(), vip, 10, T);
        let counts = count_by_server(&later);
        assert_eq!(
            counts,
            std::collections::BTreeMap::from([(first.clone(), 10)]),
            "client {}: first connection (made before the Service existed) reached {first}, the next ten {counts:?}",
            c.ns()
        );
    }
}

/// Session affinity over time, upstream's semantics: each new connection
/// restarts the client's timeout; removing an endpoint forgets only the
/// clients bound to it, and they stay with the endpoint they got next when
/// the removed one comes back. Not in the shared list: it checks what the
/// nftables layout (one set for every Service's records) must get right,
/// and runs for upstream's nftables mode too.
pub fn session_affinity_lifecycle(mode: &str) {
    let mut env = Env::new("afflife", mode);
    let pods = [env.pod(1, "a"), env.pod(1, "b"), env.pod(2, "c")];
    let clients = [
        env.pod(1, "client"),
        env.pod(2, "client2"),
        env.pod(1, "client3"),
    ];
    let timeout = 4u64;
    env.put(
        "svc",
        &service(
            "afl",
            &["10.96.0.45"],
            json!({"sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": timeout}}}),
        ),
    );
    let all: Vec<&Pod> = pods.iter().collect();
    env.put("eps", &slice("afl", "1", "IPv4", &ready(&all)));
    env.start_all();
    let vip = sa("10.96.0.45", 80);
    for c in &clients {
        env.wait_tcp(c.ns(), vip);
    }
    let server = |c: &Pod| -> String {
        match tcp_hello(c.ns(), vip, T) {
            Ok(r) => r.server,
            Err(e) => panic!("client {}: {e:?}", c.ns()),
        }
    };
    // One connection a second for twice the timeout: only a refreshed
    // record keeps every client on one endpoint (an expired one re-draws
    // among three).
    let first: Vec<String> = clients.iter().map(&server).collect();
    for _ in 0..2 * timeout {
        std::thread::sleep(Duration::from_secs(1));
        for (c, s) in clients.iter().zip(&first) {
            assert_eq!(&server(c), s, "client {} moved while active", c.ns());
        }
    }
    // Remove the first client's endpoint.
    let gone = first[0].clone();
    let gone_pod = pods.iter().find(|p| p.name() == gone).expect("gone pod");
    // A DNAT rule to it (upstream's chain per endpoint) or an element of
    // an endpoint map (ours).
    let dnat = format!("{}:8080", gone_pod.ip());
    let element = format!("{} . 8080", gone_pod.ip());
    let in_rules = |node: usize| {
        env.ruleset(node)
            .lines()
            .any(|l| (l.contains("dnat") && l.contains(&dnat)) || l.contains(&element))
    };
    let kept: Vec<&Pod> = pods.iter().filter(|p| p.name() != gone).collect();
    env.put("eps", &slice("afl", "1", "IPv4", &ready(&kept)));
    // Each node's proxy reads the change on its own poll: both must have
    // it before the clients on either node are asked.
    for node in [1, 2] {
        env.wait(&format!("{gone} gone from node{node}'s rules"), || {
            !in_rules(node)
        });
    }
    env.wait(&format!("client to leave {gone}"), || {
        server(&clients[0]) != gone
    });
    let moved = server(&clients[0]);
    for (c, s) in clients.iter().zip(&first).skip(1) {
        let now = server(c);
        if *s == gone {
            assert_ne!(now, gone, "client {} still reaches {gone}", c.ns());
        } else {
            assert_eq!(&now, s, "client {} lost its endpoint", c.ns());
        }
    }
    assert_eq!(server(&clients[0]), moved, "client did not stay on {moved}");
    // The removed endpoint returns: its former clients stay where they are.
    env.put("eps", &slice("afl", "1", "IPv4", &ready(&all)));
    for node in [1, 2] {
        env.wait(&format!("{gone} back in node{node}'s rules"), || {
            in_rules(node)
        });
    }
    for _ in 0..5 {
        assert_eq!(
            server(&clients[0]),
            moved,
            "client went back to {gone}: its record for the removed endpoint outlived it"
        );
    }
}

/// Case 5: No endpoints: refused at once; an endpoint makes it work within a sync.
pub fn no_endpoints(mode: &str) {
    let mut env = Env::new("noeps", mode);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    env.put("svc", &service("empty", &["10.96.0.50"], json!({})));
    // Both nodes synced first (start_all): before that the refusal can be
    // the node's own "no route to host" after three seconds of unanswered
    // ARP for the ClusterIP (the lab routes everything on-link), which
    // ConnError counts as Refused too, and the timed attempt below would
    // then wait out the same ARP resolution.
    env.start_all();
    let vip = sa("10.96.0.50", 80);
    env.wait("the service to be rejected", || {
        matches!(tcp_hello(client.ns(), vip, T), Err(ConnError::Refused))
    });
    let t0 = std::time::Instant::now();
    let r = tcp_hello(client.ns(), vip, Duration::from_secs(5));
    let took = t0.elapsed();
    assert!(matches!(r, Err(ConnError::Refused)), "{r:?} after {took:?}");
    assert!(
        took < Duration::from_secs(2),
        "refusal was not immediate: {took:?}"
    );
    env.put("eps", &slice("empty", "1", "IPv4", &ready(&[&a])));
    env.wait_tcp(client.ns(), vip);
}

/// Case 6: externalTrafficPolicy=Local: client IP preserved, no local endpoint =>
/// dropped, health check node port 200/503.
pub fn external_policy_local(mode: &str) {
    let mut env = Env::new("etplocal", mode);
    let a = env.pod(1, "a");
    let svc = service(
        "loc",
        &["10.96.0.60"],
        json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 32100,
               "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30060}]}),
    );
    env.put("svc", &svc);
    env.put("eps", &slice("loc", "1", "IPv4", &ready(&[&a])));
    env.start_all();
    let cl = env.cluster.client_ns().to_string();
    let r = env.wait_tcp(&cl, sa("10.100.0.11", 30060));
    assert_eq!(r.server, "a");
    assert_eq!(
        r.peer.ip(),
        env.cluster.client_ip(),
        "source IP was not preserved"
    );
    let r = tcp_hello(&cl, sa("10.100.0.12", 30060), T);
    assert!(r.is_err(), "node without local endpoint answered: {r:?}");
    // Parsed, not matched as text: upstream indents its JSON.
    env.wait("health check 200 on node1", || {
        http_get(&cl, sa("10.100.0.11", 32100), "/").is_some_and(|(s, b)| {
            s == 200 && serde_json::from_str::<Value>(&b).is_ok_and(|v| v["localEndpoints"] == 1)
        })
    });
    env.wait("health check 503 on node2", || {
        http_get(&cl, sa("10.100.0.12", 32100), "/").is_some_and(|(s, _)| s == 503)
    });
    // The node without an endpoint itself, and a pod on it, are
    // short-circuited to the cluster's endpoints (e2e "should implement
    // NodePort and HealthCheckNodePort correctly when ExternalTrafficPolicy
    // changes": a hostNetwork pod on a node without an endpoint calls its
    // node's own NodePort). Not in IPVS mode: a virtual server has one set of real
    // servers whoever the client is, upstream's IPVS mode has no
    // short-circuit either (docs/ipvs.md).
    if proxy_mode(&env.mode) == "ipvs" {
        return;
    }
    let node2 = env.cluster.node_ns(2).to_string();
    let r = env.wait_tcp(&node2, sa("10.100.0.12", 30060));
    assert_eq!(r.server, "a", "node2 calling its own NodePort");
    let b = env.pod(2, "b");
    let r = env.wait_tcp(b.ns(), sa("10.100.0.12", 30060));
    assert_eq!(r.server, "a", "a pod on node2 calling node2's NodePort");
}

/// Case 7: internalTrafficPolicy=Local: pods reach only endpoints on their node.
pub fn internal_policy_local(mode: &str) {
    let mut env = Env::new("itplocal", mode);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client1 = env.pod(1, "client1");
    let client2 = env.pod(2, "client2");
    env.put(
        "svc",
        &service(
            "itp",
            &["10.96.0.70"],
            json!({"internalTrafficPolicy": "Local"}),
        ),
    );
    env.put("eps", &slice("itp", "1", "IPv4", &ready(&[&a, &c])));
    // start_all waits for both nodes' first sync: until then a pod's packets
    // to the ClusterIP may be served by the other node's rules.
    env.start_all();
    let vip = sa("10.96.0.70", 80);
    env.wait_tcp(client1.ns(), vip);
    env.wait_tcp(client2.ns(), vip);
    let c1 = count_by_server(&tcp_hello_many(client1.ns(), vip, 30, T));
    let c2 = count_by_server(&tcp_hello_many(client2.ns(), vip, 30, T));
    assert_eq!(c1.keys().collect::<Vec<_>>(), vec!["a"], "{c1:?}");
    assert_eq!(c2.keys().collect::<Vec<_>>(), vec!["c"], "{c2:?}");
}

/// Case 8: Masquerade for external traffic to an endpoint on another node, and
/// hairpin: a pod reaching itself through its Service.
pub fn masquerade_and_hairpin(mode: &str) {
    let mut env = Env::new("masq", mode);
    let c = env.pod(2, "c");
    let a = env.pod(1, "a");
    let svc = service(
        "m",
        &["10.96.0.80"],
        json!({"type": "NodePort", "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30070}]}),
    );
    env.put("svc", &svc);
    env.put("eps", &slice("m", "1", "IPv4", &ready(&[&c])));
    env.put("svc2", &service("self", &["10.96.0.81"], json!({})));
    env.put("eps2", &slice("self", "1", "IPv4", &ready(&[&a])));
    env.start_all();
    let cl = env.cluster.client_ns().to_string();
    let r = env.wait_tcp(&cl, sa("10.100.0.11", 30070));
    assert_eq!(r.server, "c");
    assert_ne!(
        r.peer.ip(),
        env.cluster.client_ip(),
        "external traffic to another node was not SNATed"
    );
    let r = env.wait_tcp(a.ns(), sa("10.96.0.81", 80));
    assert_eq!(r.server, "a", "hairpin reached the wrong pod");
}

/// Case 8b: which traffic to a ClusterIP is masqueraded: what does not come
/// from the cluster CIDR (internalTrafficPolicy Cluster and Local alike), and
/// with --masquerade-all everything, pods included. Node1 runs with
/// --masquerade-all, node2 without; the external client is routed to the
/// ClusterIPs through one node or the other.
pub fn clusterip_masquerade(mode: &str) {
    let mut env = Env::new("cipmasq", mode);
    let c = env.pod(2, "c");
    let client1 = env.pod(1, "client1");
    let client2 = env.pod(2, "client2");
    env.put("svc", &service("cm", &["10.96.0.84"], json!({})));
    env.put("eps", &slice("cm", "1", "IPv4", &ready(&[&c])));
    env.put(
        "svc2",
        &service(
            "cml",
            &["10.96.0.85"],
            json!({"internalTrafficPolicy": "Local"}),
        ),
    );
    env.put("eps2", &slice("cml", "1", "IPv4", &ready(&[&c])));
    env.start(1, &["--masquerade-all"]);
    env.start(2, &[]);
    env.wait_synced(1);
    env.wait_synced(2);
    let vip = sa("10.96.0.84", 80);
    let vip_local = sa("10.96.0.85", 80);
    // Pods: kept on node2, masqueraded on node1 (--masquerade-all).
    let r = env.wait_tcp(client2.ns(), vip);
    assert_eq!(r.peer.ip(), client2.ip(), "a pod was masqueraded on node2");
    let r = env.wait_tcp(client2.ns(), vip_local);
    assert_eq!(
        r.peer.ip(),
        client2.ip(),
        "a pod was masqueraded (iTP=Local)"
    );
    let r = env.wait_tcp(client1.ns(), vip);
    assert_eq!(
        r.peer.ip(),
        env.cluster.node_ip(1),
        "--masquerade-all left a pod's connection unmasqueraded"
    );
    // From outside the cluster CIDR through node2: masqueraded, both policies.
    let cl = env.cluster.client_ns().to_string();
    env.cluster
        .client_route_via("10.96.0.84/32".parse().unwrap(), 2)
        .unwrap();
    env.cluster
        .client_route_via("10.96.0.85/32".parse().unwrap(), 2)
        .unwrap();
    for (what, addr) in [("iTP=Cluster", vip), ("iTP=Local", vip_local)] {
        let r = env.wait_tcp(&cl, addr);
        assert_eq!(r.server, "c");
        assert_ne!(
            r.peer.ip(),
            env.cluster.client_ip(),
            "off-cluster traffic to a ClusterIP ({what}) was not masqueraded"
        );
    }
    // Through node1 (--masquerade-all) to the endpoint on node2.
    env.cluster
        .client_route_via("10.96.0.84/32".parse().unwrap(), 1)
        .unwrap();
    let r = env.wait_tcp(&cl, vip);
    assert_eq!(r.peer.ip(), env.cluster.node_ip(1));
}

/// Case 9: Terminating endpoints are used only when no endpoint is ready.
pub fn terminating_fallback(mode: &str) {
    let mut env = Env::new("terminating", mode);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    env.put("svc", &service("t", &["10.96.0.90"], json!({})));
    env.put(
        "eps",
        &slice(
            "t",
            "1",
            "IPv4",
            &[(&a, Cond::Terminating), (&c, Cond::Ready)],
        ),
    );
    env.start_all();
    let vip = sa("10.96.0.90", 80);
    env.wait_tcp(client.ns(), vip);
    let counts = count_by_server(&tcp_hello_many(client.ns(), vip, 30, T));
    assert_eq!(counts.keys().collect::<Vec<_>>(), vec!["c"], "{counts:?}");
    env.put(
        "eps",
        &slice(
            "t",
            "1",
            "IPv4",
            &[(&a, Cond::Terminating), (&c, Cond::NotReady)],
        ),
    );
    env.wait("the terminating endpoint to take over", || {
        tcp_hello(client.ns(), vip, T).is_ok_and(|r| r.server == "a")
    });
}

/// Case 10: Removing an endpoint: new connections never reach it, and a UDP flow
/// moves to the new endpoint (stale conntrack entries deleted).
pub fn endpoint_removal(mode: &str) {
    let mut env = Env::new("removal", mode);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    env.put("svc", &service("r", &["10.96.0.100"], json!({})));
    env.put("eps", &slice("r", "1", "IPv4", &ready(&[&a])));
    env.start_all();
    let dns = sa("10.96.0.100", 53);
    env.wait("UDP to a", || udp_ask(client.ns(), dns, T).is_ok());
    let session = udp_session(client.ns(), dns).unwrap();
    assert_eq!(session.ask(T).unwrap().server, "a");
    env.put("eps", &slice("r", "1", "IPv4", &ready(&[&c])));
    env.wait("the UDP flow to move to c", || {
        session.ask(T).is_ok_and(|r| r.server == "c")
    });
    let counts = count_by_server(&tcp_hello_many(client.ns(), sa("10.96.0.100", 80), 30, T));
    assert_eq!(counts.keys().collect::<Vec<_>>(), vec!["c"], "{counts:?}");
}

/// Case 11: Deleting a Service removes its rules; --cleanup removes the table.
pub fn delete_and_cleanup(mode: &str) {
    let mut env = Env::new("cleanup", mode);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    env.put("svc", &service("gone", &["10.96.0.110"], json!({})));
    env.put("eps", &slice("gone", "1", "IPv4", &ready(&[&a])));
    env.start(1, &[]);
    env.wait_tcp(client.ns(), sa("10.96.0.110", 80));
    // The Service's rules are those that name it; one that has no chain
    // of its own (ours in nftables mode picks a ClusterIP-only Service in
    // a shared chain) is found by its address.
    let before = env.ruleset(1);
    let marker = if before.contains("default/gone") {
        "default/gone"
    } else {
        "10.96.0.110"
    };
    assert!(before.contains(marker), "{before}");
    env.remove("svc");
    env.remove("eps");
    // Upstream's nftables mode flushes a deleted Service's chains at once but
    // deletes the empty chains only in its next full sync (before Linux 6.2 a
    // chain cannot be deleted right after the map element that jumped to
    // it), over a minute later here: for upstream an empty chain declaration
    // is not a rule. Ours deletes them in the same transaction.
    let upstream_nft = env.source == Source::Upstream && env.mode == "nftables";
    env.wait("the service's rules to go", || {
        !env.ruleset(1)
            .lines()
            .any(|l| l.contains(marker) && !(upstream_nft && l.trim_start().starts_with("chain ")))
    });
    assert!(tcp_hello(client.ns(), sa("10.96.0.110", 80), T).is_err());
    env.kill(1);
    env.run_cleanup(1);
    let mut rules = env.ruleset(1);
    if env.source == Source::Upstream {
        // Upstream's --cleanup keeps KUBE-FIREWALL and the jumps to it: the
        // chain is shared with the kubelet, which has created it since
        // before kube-proxy did. Ours removes it with the rest (deploy/
        // replaces kube-proxy on the node; the kubelet of 1.28+ no longer
        // creates it).
        rules = rules
            .lines()
            .filter(|l| !l.contains("KUBE-FIREWALL"))
            .collect::<Vec<_>>()
            .join("\n");
    }
    assert!(
        !rules.contains(env.rules_marker()),
        "--cleanup left rules behind:\n{rules}"
    );
    if env.mode == "ipvs" {
        assert!(
            !rules.contains("-A -t") && !rules.contains("-A -u"),
            "--cleanup left virtual servers behind:\n{rules}"
        );
        let link = env.on_node(1, &["ip", "link", "show"]);
        assert!(
            !link.contains("kube-ipvs0"),
            "--cleanup left kube-ipvs0:\n{link}"
        );
    }
}

/// Case 12: SIGKILL and restart keep an open connection through a ClusterIP.
pub fn restart_keeps_connections(mode: &str) {
    let mut env = Env::new("restart", mode);
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    env.put("svc", &service("keep", &["10.96.0.120"], json!({})));
    env.put("eps", &slice("keep", "1", "IPv4", &ready(&[&c])));
    env.start_all();
    let vip = sa("10.96.0.120", 80);
    env.wait_tcp(client.ns(), vip);
    let mut held = tcp_hold(client.ns(), vip, T).unwrap();
    assert_eq!(held.exchange("one", T).unwrap(), "c one");
    env.kill(1);
    assert_eq!(held.exchange("two", T).unwrap(), "c two");
    env.start(1, &[]);
    env.wait_synced(1);
    assert_eq!(held.exchange("three", T).unwrap(), "c three");
    assert!(tcp_hello(client.ns(), vip, T).is_ok());
}

/// Case 13: IPv6 ClusterIP on a dual-stack Service.
pub fn ipv6_clusterip(mode: &str) {
    let mut env = Env::new("ipv6", mode);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    env.put(
        "svc",
        &service(
            "v6",
            &["10.96.0.130", "fd00:96::130"],
            json!({"ipFamilyPolicy": "PreferDualStack"}),
        ),
    );
    env.put("eps4", &slice("v6", "v4", "IPv4", &ready(&[&a, &c])));
    env.put("eps6", &slice("v6", "v6", "IPv6", &ready(&[&a, &c])));
    env.start_all();
    let r = env.wait_tcp(client.ns(), sa("fd00:96::130", 80));
    assert!(r.server == "a" || r.server == "c");
    env.wait("both endpoints over IPv6", || {
        let counts = count_by_server(&tcp_hello_many(client.ns(), sa("fd00:96::130", 80), 20, T));
        counts.len() == 2
    });
    env.wait_tcp(client.ns(), sa("10.96.0.130", 80));
    env.wait("UDP over IPv6", || {
        udp_ask(client.ns(), sa("fd00:96::130", 53), T).is_ok()
    });
}

/// Case 14: A NodePort is never reachable on 127.0.0.1 from another host
/// (CVE-2020-8558), and not on the node's own loopback in this mode.
pub fn localhost_nodeport(mode: &str) {
    let mut env = Env::new("localhost", mode);
    let a = env.pod(1, "a");
    let svc = service(
        "lo",
        &["10.96.0.140"],
        json!({"type": "NodePort", "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30140}]}),
    );
    env.put("svc", &svc);
    env.put("eps", &slice("lo", "1", "IPv4", &ready(&[&a])));
    env.start(1, &[]);
    let cl = env.cluster.client_ns().to_string();
    env.wait_tcp(&cl, sa("10.100.0.11", 30140));
    // The attacker routes 127.0.0.1 to node1: drop its own loopback route for it.
    let _ = env.cluster.exec(
        &cl,
        &[
            "ip",
            "route",
            "del",
            "127.0.0.0/8",
            "dev",
            "lo",
            "table",
            "local",
        ],
    );
    let _ = env.cluster.exec(
        &cl,
        &[
            "ip",
            "route",
            "del",
            "local",
            "127.0.0.1",
            "dev",
            "lo",
            "table",
            "local",
        ],
    );
    env.cluster
        .exec_ok(
            &cl,
            &["ip", "route", "add", "127.0.0.1/32", "via", "10.100.0.11"],
        )
        .unwrap();
    let r = tcp_hello(&cl, sa("127.0.0.1", 30140), T);
    assert!(
        r.is_err(),
        "NodePort reached on 127.0.0.1 from another host: {r:?}"
    );
    if proxy_mode(mode) == "iptables" {
        // Upstream's iptables default (--iptables-localhost-nodeports): the node
        // itself may use 127.0.0.1 (route_localnet set in its namespace only).
        env.wait_tcp(env.cluster.node_ns(1), sa("127.0.0.1", 30140));
    }
    if proxy_mode(&env.mode) == "nftables" {
        let r = tcp_hello(env.cluster.node_ns(1), sa("127.0.0.1", 30140), T);
        assert!(
            r.is_err(),
            "nftables mode answered a NodePort on localhost: {r:?}"
        );
    }
}

/// Case 15: UDP clients that keep one socket (a fixed source port) sending to
/// a ClusterIP and a NodePort while the Service has no endpoints, or does not
/// exist yet, get answers within one sync plus 1 s once an endpoint is
/// ready; the same when an endpoint goes from unready to ready. A conntrack
/// entry made while nothing NATed the flow must not outlive that state
/// (upstream #105657), or the flow stays blackholed for as long as the client
/// keeps sending.
pub fn udp_before_endpoints(mode: &str) {
    let mut env = Env::new("udpfirst", mode);
    let a = env.pod(2, "a");
    let b = env.pod(2, "b");
    let client = env.pod(1, "client");
    let udp = |node_port: Option<u16>| {
        let mut port = json!({"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8080});
        let mut spec = json!({"ports": [port.clone()]});
        if let Some(np) = node_port {
            port["nodePort"] = json!(np);
            spec = json!({"type": "NodePort", "ports": [port]});
        }
        spec
    };
    // u1 exists without endpoints; u2 does not exist yet.
    env.put("svc1", &service("u1", &["10.96.0.150"], udp(Some(30153))));
    env.start_all();
    let cl = env.cluster.client_ns().to_string();
    let s1 = udp_session(client.ns(), sa("10.96.0.150", 53)).unwrap();
    let n1 = udp_session(&cl, sa("10.100.0.11", 30153)).unwrap();
    let s2 = udp_session(client.ns(), sa("10.96.0.151", 53)).unwrap();
    // Keep the three flows alive unanswered (each ask leaves or refreshes a
    // conntrack entry for the same source port).
    for _ in 0..5 {
        for s in [&s1, &n1, &s2] {
            assert!(s.ask(Duration::from_millis(200)).is_err());
        }
    }
    // "Programmed": node1's rules name the endpoint (userspace mode keeps no
    // per-flow kernel state; there a sync after the change is enough).
    let before = env.syncs(1);
    let programmed = |env: &Env, pod: &Pod| {
        if env.mode == "userspace" {
            return env.syncs(1) > before;
        }
        let rules = env.ruleset(1);
        let ip = pod.ip();
        rules.contains(&format!("{ip}:8080")) || rules.contains(&format!("{ip} . 8080"))
    };
    // 1 s, as the issue asks. Under emulation (the IPVS test VM raises
    // sync_wait) a sync takes seconds after its first objects show up in the
    // kernel, so "programmed" is seen well before the sync (and its conntrack
    // cleanup) ends: 15 s there, still well short of forever, which is what a
    // stale entry means for a client that keeps sending.
    let bound = if sync_wait() > SYNC_WAIT {
        Duration::from_secs(15)
    } else {
        Duration::from_secs(1)
    };
    let answered_within_1s = |sessions: &[&kp_netlab::UdpSession], server: &str| {
        let deadline = std::time::Instant::now() + bound;
        for s in sessions {
            loop {
                match s.ask(Duration::from_millis(200)) {
                    Ok(r) => {
                        assert_eq!(r.server, server, "{}", s.target());
                        break;
                    }
                    Err(e) => assert!(
                        std::time::Instant::now() < deadline,
                        "{} (from {}) still unanswered {bound:?} after the endpoint was programmed: {e}",
                        s.target(),
                        s.local_addr()
                    ),
                }
            }
        }
    };
    env.put("eps1", &slice("u1", "1", "IPv4", &ready(&[&a])));
    env.put("svc2", &service("u2", &["10.96.0.151"], udp(None)));
    env.put("eps2", &slice("u2", "1", "IPv4", &ready(&[&b])));
    // s2's client keeps sending while the Service is programmed (a resolver
    // retrying): datagrams that leave node1 before it serves 10.96.0.151
    // must not end up anywhere that outlives the new rules. In IPVS mode
    // without strict ARP they reached node2's IPVS, whose connection entry
    // then broke the flow for good (docs/ipvs.md); sending here is what
    // makes such a leak show up reliably.
    env.wait("u2's endpoint programmed while its client sends", || {
        for _ in 0..5 {
            let _ = s2.ask(Duration::from_millis(100));
        }
        programmed(&env, &b)
    });
    env.wait("u1's endpoint programmed", || programmed(&env, &a));
    answered_within_1s(&[&s1, &n1], "a");
    env.wait("u2's endpoint programmed", || programmed(&env, &b));
    answered_within_1s(&[&s2], "b");

    // Unready, then ready again. Ours ends the UDP flows to an endpoint that
    // is no longer serving (its conntrack entries go), so they fail until it
    // is ready; upstream iptables mode keeps an established flow going to
    // the unready endpoint (docs/migrate-from-kube-proxy.md). Either way the
    // flows must answer within 1 s of the endpoint being programmed again.
    env.put("eps1", &slice("u1", "1", "IPv4", &[(&a, Cond::NotReady)]));
    if env.source != Source::Upstream {
        env.wait("u1 without a ready endpoint", || {
            s1.ask(Duration::from_millis(200)).is_err()
        });
    } else {
        std::thread::sleep(Duration::from_secs(2));
    }
    for _ in 0..5 {
        let _ = s1.ask(Duration::from_millis(200));
        let _ = n1.ask(Duration::from_millis(200));
    }
    env.put("eps1", &slice("u1", "1", "IPv4", &ready(&[&a])));
    env.wait("u1's endpoint programmed again", || programmed(&env, &a));
    answered_within_1s(&[&s1, &n1], "a");
}

/// Case 16: the conntrack reconciler (upstream #127318). UDP flows made or
/// left stale while the proxy was down are repaired by its first sync: a
/// client's flow DNATed to an endpoint that went meanwhile, and entries
/// written behind its back (`conntrack -I`) pointing a ClusterIP and a
/// NodePort at an address that is no endpoint. An entry that reaches the
/// serving endpoint stays. Each deletion is counted in
/// kubeproxy_conntrack_reconciler_deleted_entries_total.
///
/// A Service port without endpoints: ours deletes its entries too (a flow
/// DNATed to a pod that is gone would otherwise stay blackholed instead of
/// meeting the port's reject); upstream leaves them, which is checked too.
pub fn conntrack_reconciler(mode: &str) {
    let mut env = Env::new("ctrecon", mode);
    let a = env.pod(2, "a");
    let b = env.pod(2, "b");
    let client = env.pod(1, "client");
    let udp = |node_port: Option<u16>| {
        let mut port = json!({"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8080});
        match node_port {
            Some(np) => {
                port["nodePort"] = json!(np);
                json!({"type": "NodePort", "ports": [port]})
            }
            None => json!({"ports": [port]}),
        }
    };
    env.put("svc", &service("ct", &["10.96.0.160"], udp(Some(30160))));
    env.put("svc0", &service("ct0", &["10.96.0.161"], udp(None)));
    env.put("eps", &slice("ct", "1", "IPv4", &ready(&[&a])));
    env.start(1, &[]);
    env.wait_synced(1);
    let vip = sa("10.96.0.160", 53);
    env.wait("UDP to a", || udp_ask(client.ns(), vip, T).is_ok());
    let session = udp_session(client.ns(), vip).unwrap();
    assert_eq!(session.ask(T).unwrap().server, "a");

    // The proxy goes down; meanwhile a is replaced by b and entries appear.
    env.kill(1);
    env.put("eps", &slice("ct", "1", "IPv4", &ready(&[&b])));
    let cip = client.ip().to_string();
    let node_ip = env.cluster.node_ip(1).to_string();
    let nowhere = "10.99.0.99";
    let b_ip = b.ip().to_string();
    // (destination, port, client port, reply source)
    let entries = [
        ("10.96.0.160", "53", "42001", nowhere),
        ("10.96.0.160", "53", "42002", b_ip.as_str()),
        (node_ip.as_str(), "30160", "42003", nowhere),
        ("10.96.0.161", "53", "42004", nowhere),
    ];
    for (dst, dport, sport, reply) in entries {
        let out = env
            .cluster
            .exec(
                env.cluster.node_ns(1),
                &[
                    "conntrack",
                    "-I",
                    "-p",
                    "udp",
                    "-s",
                    &cip,
                    "-d",
                    dst,
                    "--sport",
                    sport,
                    "--dport",
                    dport,
                    "--reply-src",
                    reply,
                    "--reply-dst",
                    &cip,
                    "--reply-port-src",
                    "8080",
                    "--reply-port-dst",
                    sport,
                    "--timeout",
                    "300",
                ],
            )
            .unwrap();
        assert!(
            out.status.success(),
            "conntrack -I {dst}:{dport}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let listed = |env: &Env| env.on_node(1, &["conntrack", "-L", "-p", "udp"]);
    let has = |table: &str, sport: &str| table.contains(&format!("sport={sport} "));
    let before = listed(&env);
    for (_, _, sport, _) in entries {
        assert!(has(&before, sport), "entry {sport} missing:\n{before}");
    }

    env.start(1, &[]);
    env.wait_synced(1);
    let upstream = env.source == Source::Upstream;
    // Within the first sync (the next periodic one is 10 s away).
    env.wait_for("the stale entries to go", Duration::from_secs(3), || {
        let t = listed(&env);
        !has(&t, "42001") && !has(&t, "42003") && (upstream || !has(&t, "42004"))
    });
    let after = listed(&env);
    assert!(has(&after, "42002"), "the entry to b went:\n{after}");
    if upstream {
        assert!(
            has(&after, "42004"),
            "upstream deleted an entry of a port without endpoints:\n{after}"
        );
    }
    // Every entry that went is counted: the three stale ones written above
    // (less what upstream keeps), plus the client's flows DNATed to a (the
    // session's, and those of the probes before it).
    let gone = orig_tuples(&before)
        .difference(&orig_tuples(&after))
        .count();
    assert!(gone >= if upstream { 2 } else { 3 }, "{before}\n{after}");
    let expected = gone as f64;
    // The client's flow now reaches b. With socket load balancing the
    // client's connected socket was translated at connect(), not by a
    // conntrack entry: moving it is not the reconciler's business.
    if env.socket_lb.is_none() {
        assert_eq!(session.ask(T).unwrap().server, "b");
    }
    let metrics = env.metrics(1);
    let shown = || {
        metrics
            .lines()
            .filter(|l| l.contains("conntrack"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let deleted = metric_value(
        &metrics,
        "kubeproxy_conntrack_reconciler_deleted_entries_total",
    );
    if env.mode == "ipvs" {
        // More entries go in ipvs mode than the reconciler deletes (the IPVS
        // VM: 5 gone, 3 by it): the kernel's IPVS connections own part of
        // these flows. It must still delete at least the three the other
        // modes' count shows, and never more than went.
        let d = deleted.unwrap_or_else(|| panic!("no reconciler metric\n{}", shown()));
        assert!(
            (3.0..=expected).contains(&d),
            "{d} of {expected}\n{}",
            shown()
        );
    } else {
        assert_eq!(deleted, Some(expected), "{}", shown());
    }
}

/// The original tuples (src, dst, sport, dport) of `conntrack -L` lines.
fn orig_tuples(table: &str) -> std::collections::BTreeSet<String> {
    table
        .lines()
        .map(|l| {
            let mut seen = Vec::new();
            for w in l.split_whitespace() {
                let key = w.split('=').next().unwrap_or("");
                if ["src", "dst", "sport", "dport"].contains(&key)
                    && !seen
                        .iter()
                        .any(|s: &&str| s.starts_with(&format!("{key}=")))
                {
                    seen.push(w);
                }
            }
            seen.join(" ")
        })
        .filter(|t| !t.is_empty())
        .collect()
}

// ---------------------------------------------------------------------------
// Cases only the API path has (api/MODE and upstream/MODE)
// ---------------------------------------------------------------------------

/// API case 6: a Service whose externalIP is another Service's ClusterIP and
/// port (the CVE-2020-8554 shape) does not get the address with ours: the
/// ClusterIP keeps answering from its own endpoint, and a Warning Event
/// (AddressClaimRefused) is posted on the refused Service. Upstream has no
/// ownership rule (its nftables mode gives the address to the later
/// Service), so for upstream the case only reports what happened.
pub fn api_refused_claim_event(mode: &str) {
    let mut env = Env::new("apiclaim", mode);
    let a = env.pod(2, "a");
    let b = env.pod(2, "b");
    let client = env.pod(1, "client");
    env.put("svc-a", &service("owner", &["10.96.0.160"], json!({})));
    env.put("eps-a", &slice("owner", "1", "IPv4", &ready(&[&a])));
    env.start_all();
    let vip = sa("10.96.0.160", 80);
    env.wait_tcp(client.ns(), vip);
    env.put(
        "svc-b",
        &service(
            "squatter",
            &["10.96.0.161"],
            json!({"externalIPs": ["10.96.0.160"]}),
        ),
    );
    env.put("eps-b", &slice("squatter", "1", "IPv4", &ready(&[&b])));
    env.wait_tcp(client.ns(), sa("10.96.0.161", 80));
    let counts = count_by_server(&tcp_hello_many(client.ns(), vip, 20, T));
    if env.source == Source::Upstream {
        // Upstream has no ownership rule: in iptables mode the first
        // matching rule wins (the ClusterIP), in nftables mode the later
        // map element (the squatter's externalIP) replaces the ClusterIP's.
        // It posts no Event. docs/migrate-from-kube-proxy.md lists this.
        eprintln!("upstream: {vip} answered by {counts:?}; no Event check (upstream posts none)");
        return;
    }
    // Ours: the ClusterIP still reaches only its own Service's endpoint.
    assert_eq!(counts.keys().collect::<Vec<_>>(), vec!["a"], "{counts:?}");
    env.wait("the AddressClaimRefused Event on the squatter", || {
        let Ok(out) = env
            .api()
            .cp
            .kubectl(&["get", "events", "-n", "default", "-o", "json"])
        else {
            return false;
        };
        let v: Value = serde_json::from_str(&out).unwrap_or_default();
        v["items"].as_array().is_some_and(|items| {
            items.iter().any(|e| {
                e["reason"] == "AddressClaimRefused"
                    && e["type"] == "Warning"
                    && e["involvedObject"]["kind"] == "Service"
                    && e["involvedObject"]["name"] == "squatter"
                    && e["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("default/owner"))
            })
        })
    });
}

/// API case 1: each proxy posts its "Starting" Event about its Node, visible
/// with `kubectl get events` (our identity may create Events: deploy/).
pub fn api_starting_event(mode: &str) {
    let mut env = Env::new("apievent", mode);
    env.start_all();
    env.wait("both nodes' Starting Events", || {
        let Ok(out) = env.api().cp.kubectl(&["get", "events", "-A", "-o", "json"]) else {
            return false;
        };
        let v: Value = serde_json::from_str(&out).unwrap_or_default();
        let items = v["items"].as_array().cloned().unwrap_or_default();
        ["node1", "node2"].iter().all(|n| {
            items.iter().any(|e| {
                e["reason"] == "Starting"
                    && e["involvedObject"]["kind"] == "Node"
                    && e["involvedObject"]["name"] == *n
            })
        })
    });
}

/// The proxy speaks HTTP/2 to the API server, as client-go does: its
/// watches (Services, EndpointSlices, its Node, ServiceCIDRs) and requests
/// share one TLS connection instead of one each, so a rollout costs the
/// API server one handshake per node.
pub fn api_one_connection(mode: &str) {
    let mut env = Env::new("apiconn", mode);
    env.start(1, &[]);
    env.wait_synced(1);
    let server = env.api().cp.url();
    let peer = server.trim_start_matches("https://").to_string();
    let ns = env.cluster.node_ns(1).to_string();
    let open = || -> Vec<String> {
        let out = env
            .cluster
            .exec_ok(&ns, &["ss", "-Htn", "state", "established"])
            .unwrap_or_default();
        out.lines()
            .filter(|l| l.split_whitespace().nth(3) == Some(peer.as_str()))
            .map(str::to_string)
            .collect()
    };
    // Connections of the start that are done (the Starting Event's) close.
    env.wait(
        "node1's proxy holding one connection to the API server",
        || open().len() == 1,
    );
    std::thread::sleep(Duration::from_secs(2));
    let now = open();
    assert_eq!(
        now.len(),
        1,
        "node1 holds {} connections to {peer}:\n{}\n--- node1 log ---\n{}",
        now.len(),
        now.join("\n"),
        env.log(1)
    );
}

/// With client-go's WatchListClient gate off (`--feature-gates`, as
/// upstream), relists are lists from the watch cache (resourceVersion=0,
/// pages of 500) instead of streaming lists, and the proxy still serves.
pub fn api_watch_list_gate_off(mode: &str) {
    let mut env = Env::new("apiwlc", mode);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    env.put("svc", &service("web", &["10.96.0.170"], json!({})));
    env.put("eps", &slice("web", "1", "IPv4", &ready(&[&a])));
    env.start(1, &["--feature-gates=WatchListClient=false"]);
    env.wait_synced(1);
    assert_eq!(env.wait_tcp(client.ns(), sa("10.96.0.170", 80)).server, "a");
    let log = env.log(1);
    let requests: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("API request") && l.contains("discovery.k8s.io/v1/endpointslices"))
        .collect();
    assert!(
        requests
            .iter()
            .any(|l| l.contains("limit=500") && l.contains("resourceVersion=0")),
        "no list from the watch cache:\n{}",
        requests.join("\n")
    );
    assert!(
        !requests.iter().any(|l| l.contains("sendInitialEvents")),
        "a streaming list with the gate off:\n{}",
        requests.join("\n")
    );
}

/// API case 2: Services labelled service.kubernetes.io/service-proxy-name
/// belong to another proxy and are never programmed by default (both
/// proxies). With `--service-proxy-name NAME` kube-proxy-rs serves exactly
/// the Services labelled NAME. Upstream has no such flag (it always ignores
/// labelled Services), so that half runs for ours only.
pub fn api_service_proxy_name(mode: &str) {
    let mut env = Env::new("apiproxyname", mode);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    let mut mine = service("mine", &["10.96.0.160"], json!({}));
    mine["metadata"]["labels"] = json!({"service.kubernetes.io/service-proxy-name": "kp-test"});
    env.put("svc-mine", &mine);
    // The EndpointSlice controller copies the Service's labels onto its
    // slices, and both proxies select slices by the same label selector.
    let mut eps = slice("mine", "1", "IPv4", &ready(&[&a]));
    eps["metadata"]["labels"]["service.kubernetes.io/service-proxy-name"] = json!("kp-test");
    env.put("eps-mine", &eps);
    env.put("svc-plain", &service("plain", &["10.96.0.161"], json!({})));
    env.put("eps-plain", &slice("plain", "1", "IPv4", &ready(&[&a])));
    let (vmine, vplain) = (sa("10.96.0.160", 80), sa("10.96.0.161", 80));
    env.start(1, &[]);
    env.wait_synced(1);
    env.wait_tcp(client.ns(), vplain);
    let r = tcp_hello(client.ns(), vmine, T);
    assert!(
        r.is_err(),
        "a Service of another proxy was programmed: {r:?}"
    );
    if env.source == Source::Upstream {
        return;
    }
    env.kill(1);
    env.run_cleanup(1);
    env.start(1, &["--service-proxy-name=kp-test"]);
    env.wait_synced(1);
    env.wait_tcp(client.ns(), vmine);
    let r = tcp_hello(client.ns(), vplain, T);
    assert!(
        r.is_err(),
        "--service-proxy-name kp-test programmed an unlabelled Service: {r:?}"
    );
}

/// API case 3: --detect-local-mode=NodeCIDR takes the local pod range from
/// the Node object's spec.podCIDRs: a local pod reaching a ClusterIP keeps
/// its source address, while the external client (routed to the ClusterIP
/// through node1, outside node1's pod CIDR) is masqueraded; without
/// masquerade its reply from the other node would never find its way back.
pub fn api_node_cidr(mode: &str) {
    let mut env = Env::new("apinodecidr", mode);
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    env.put("svc", &service("nc", &["10.96.0.170"], json!({})));
    env.put("eps", &slice("nc", "1", "IPv4", &ready(&[&c])));
    env.start(1, &["--detect-local-mode=NodeCIDR"]);
    env.start(2, &["--detect-local-mode=NodeCIDR"]);
    env.wait_synced(1);
    env.wait_synced(2);
    let vip = sa("10.96.0.170", 80);
    let r = env.wait_tcp(client.ns(), vip);
    assert_eq!(r.peer.ip(), client.ip(), "a local pod was masqueraded");
    let cl = env.cluster.client_ns().to_string();
    env.cluster
        .client_route_via("10.96.0.0/16".parse().unwrap(), 1)
        .unwrap();
    let r = env.wait_tcp(&cl, vip);
    assert_eq!(
        r.peer.ip(),
        env.cluster.node_ip(1),
        "traffic from outside node1's podCIDR was not masqueraded"
    );
}

/// API case 4: topology hints: with every endpoint hinted to a zone and the
/// Nodes labelled topology.kubernetes.io/zone, each node's pods reach only
/// the endpoint hinted for its zone.
pub fn api_topology_hints(mode: &str) {
    let mut env = Env::new("apitopology", mode);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client1 = env.pod(1, "client1");
    let client2 = env.pod(2, "client2");
    env.put(
        "svc",
        &service(
            "topo",
            &["10.96.0.180"],
            json!({"trafficDistribution": "PreferClose"}),
        ),
    );
    let mut eps = slice("topo", "1", "IPv4", &ready(&[&a, &c]));
    for (ep, node) in eps["endpoints"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .zip([1, 2])
    {
        ep["zone"] = json!(zone_of(node));
        ep["hints"] = json!({"forZones": [{"name": zone_of(node)}]});
    }
    env.put("eps", &eps);
    env.start_all();
    let vip = sa("10.96.0.180", 80);
    env.wait_tcp(client1.ns(), vip);
    env.wait_tcp(client2.ns(), vip);
    // A proxy may program the Service before it has read its Node's zone
    // (seen with upstream's under load in CI: both endpoints at first, and
    // once still after 20 s): wait until each node has taken the hints into
    // account, then count. The final counts below are what is asserted.
    for (node, client, want) in [(1, &client1, "a"), (2, &client2, "c")] {
        let seen = std::cell::RefCell::new(String::new());
        env.wait_on_for(
            node,
            &format!("{} reaching only {want}", client.ns()),
            "opolog",
            sync_wait() * 3,
            || {
                let r = tcp_hello_many(client.ns(), vip, 10, T);
                let c = count_by_server(&r);
                let errors: Vec<String> = r
                    .iter()
                    .filter_map(|r| r.as_ref().err().map(|e| format!("{e:?}")))
                    .collect();
                *seen.borrow_mut() = format!("{c:?}, errors {errors:?}");
                c.keys().collect::<Vec<_>>() == vec![want]
            },
            || seen.borrow().clone(),
        );
    }
    let c1 = count_by_server(&tcp_hello_many(client1.ns(), vip, 30, T));
    let c2 = count_by_server(&tcp_hello_many(client2.ns(), vip, 30, T));
    assert_eq!(c1.keys().collect::<Vec<_>>(), vec!["a"], "zone-1: {c1:?}");
    assert_eq!(c2.keys().collect::<Vec<_>>(), vec!["c"], "zone-2: {c2:?}");
}

/// API case 5: a NodePort Service whose ClusterIP and NodePort the API
/// server allocates (nothing fixed by the test): reachable on both.
pub fn api_allocated(mode: &str) {
    let mut env = Env::new("apialloc", mode);
    let a = env.pod(2, "a");
    let client = env.pod(1, "client");
    env.put(
        "svc",
        &json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "default", "name": "alloc"},
            "spec": {"type": "NodePort", "ports": [
                {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}}),
    );
    env.put("eps", &slice("alloc", "1", "IPv4", &ready(&[&a])));
    let got: Value = serde_json::from_str(
        &env.api()
            .cp
            .kubectl(&["get", "svc", "alloc", "-o", "json"])
            .expect("reading the Service back"),
    )
    .unwrap();
    let ip = got["spec"]["clusterIP"]
        .as_str()
        .expect("allocated ClusterIP");
    let node_port = got["spec"]["ports"][0]["nodePort"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .expect("allocated NodePort");
    env.start_all();
    assert_eq!(env.wait_tcp(client.ns(), sa(ip, 80)).server, "a");
    let cl = env.cluster.client_ns().to_string();
    assert_eq!(env.wait_tcp(&cl, sa("10.100.0.11", node_port)).server, "a");
}

/// API case (nftables mode only, ours and upstream's): traffic to an
/// address of a Service range (ServiceCIDR) that no Service holds is
/// dropped, where it would otherwise follow the node's default route
/// (upstream #122692). Here that route reaches a LAN host, "sink", which
/// holds such addresses and answers on them, so "dropped" is told from
/// "nobody there". The API server's --service-cluster-ip-range makes the
/// default ServiceCIDR "kubernetes" (10.96.0.0/16, fd00:96::/108); a
/// second one created later is dropped without a restart, and no longer
/// once it is deleted. Upstream reads the ranges only when it rewrites its
/// whole table (OnServiceCIDRsChanged stores them, its full sync writes
/// them: at start, after a failure, hourly): its node1 is restarted after
/// each change instead.
pub fn api_service_cidrs(mode: &str) {
    let mut env = Env::new("apicidr", mode);
    let a = env.pod(2, "a");
    let client = env.pod(1, "client");
    let sink = env
        .cluster
        .add_host("sink", 7)
        .expect("adding the sink host");
    for argv in [
        &["ip", "addr", "add", "10.96.0.200/32", "dev", "eth0"][..],
        &["ip", "addr", "add", "10.98.0.200/32", "dev", "eth0"],
        &["ip", "-6", "addr", "add", "fd00:96::200/128", "dev", "eth0"],
        // Replies to node1's pods go back through node1.
        &["ip", "route", "add", "10.244.1.0/24", "via", "10.100.0.11"],
    ] {
        env.cluster
            .exec_ok(&sink.ns, argv)
            .expect("setting up the sink");
    }
    let _sink = env
        .cluster
        .serve(&sink.ns, "sink", ServeSpec::tcp(&[80]))
        .expect("the sink's server");
    let node1 = env.cluster.node_ns(1).to_string();
    let unallocated = sa("10.96.0.200", 80);
    let unallocated6: SocketAddr = "[fd00:96::200]:80".parse().unwrap();
    let later = sa("10.98.0.200", 80);
    let reach = |ns: &str, to: SocketAddr| tcp_hello(ns, to, T).map(|r| r.server);
    // Without a proxy the default route takes them to the sink.
    for (ns, to) in [
        (node1.as_str(), unallocated),
        (client.ns(), unallocated),
        (node1.as_str(), unallocated6),
        (node1.as_str(), later),
    ] {
        assert_eq!(reach(ns, to).ok().as_deref(), Some("sink"), "{ns} -> {to}");
    }

    env.put("svc", &service("real", &["10.96.0.170"], json!({})));
    env.put("eps", &slice("real", "1", "IPv4", &ready(&[&a])));
    env.start_all();
    assert_eq!(env.wait_tcp(client.ns(), sa("10.96.0.170", 80)).server, "a");
    let dropped = |ns: &str, to: SocketAddr| matches!(reach(ns, to), Err(ConnError::Timeout));
    // Dropped from the node itself (output) and from its pods (forward).
    env.wait("unallocated ClusterIPs dropped", || {
        dropped(&node1, unallocated) && dropped(client.ns(), unallocated)
    });
    env.wait("unallocated IPv6 ClusterIPs dropped", || {
        dropped(&node1, unallocated6)
    });
    // Outside every Service range: the default route, as before.
    assert_eq!(reach(&node1, later).ok().as_deref(), Some("sink"));

    // A second range, created while the proxies run.
    let second = json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": "second"}, "spec": {"cidrs": ["10.98.0.0/24"]}});
    env.put("cidr2", &second);
    let upstream_full_sync = |env: &mut Env| {
        if env.source == Source::Upstream {
            // Its informer sees the change at once; give it a moment.
            std::thread::sleep(Duration::from_secs(2));
            env.kill(1);
            env.start(1, &[]);
            env.wait_synced(1);
        }
    };
    upstream_full_sync(&mut env);
    env.wait("the second range dropped", || {
        dropped(&node1, later) && dropped(client.ns(), later)
    });
    assert_eq!(env.wait_tcp(client.ns(), sa("10.96.0.170", 80)).server, "a");

    // Deleted. Should a finalizer hold it, lift it as the ServiceCIDR
    // controller (kube-controller-manager, not run here) would for a range
    // no Service uses.
    env.remove("cidr2");
    let cp = &env.api().cp;
    let left = cp
        .kubectl(&[
            "get",
            "servicecidr",
            "second",
            "--ignore-not-found",
            "-o",
            "name",
        ])
        .expect("looking the ServiceCIDR up");
    if !left.trim().is_empty() {
        cp.kubectl(&[
            "patch",
            "servicecidr",
            "second",
            "--type=merge",
            "-p",
            r#"{"metadata":{"finalizers":null}}"#,
        ])
        .expect("lifting the ServiceCIDR's finalizer");
    }
    upstream_full_sync(&mut env);
    env.wait("the deleted range no longer dropped", || {
        reach(&node1, later).ok().as_deref() == Some("sink")
            && reach(client.ns(), later).ok().as_deref() == Some("sink")
    });
    assert!(
        dropped(&node1, unallocated),
        "the default range is still dropped"
    );
    assert_eq!(env.wait_tcp(client.ns(), sa("10.96.0.170", 80)).server, "a");
}

/// Declares the API-only cases for one "api/MODE" or "upstream/MODE".
#[allow(unused_macros)]
macro_rules! api_cases {
    ($mode:expr) => {
        #[test]
        fn a01_starting_event() {
            if conformance::binaries_for($mode) {
                conformance::api_starting_event($mode);
            }
        }
        #[test]
        fn a02_service_proxy_name() {
            if conformance::binaries_for($mode) {
                conformance::api_service_proxy_name($mode);
            }
        }
        #[test]
        fn a03_node_cidr() {
            if conformance::binaries_for($mode) {
                conformance::api_node_cidr($mode);
            }
        }
        #[test]
        fn a05_allocated_addresses() {
            if conformance::binaries_for($mode) {
                conformance::api_allocated($mode);
            }
        }
        #[test]
        fn a04_topology_hints() {
            if conformance::binaries_for($mode) {
                conformance::api_topology_hints($mode);
            }
        }
        #[test]
        fn a06_refused_claim_event() {
            if conformance::binaries_for($mode) {
                conformance::api_refused_claim_event($mode);
            }
        }
    };
}

/// The guard of modes every kernel here can run.
pub fn always() -> bool {
    true
}

/// Declares every case above as a `#[test]` for one mode, so each mode's test
/// file runs exactly the same list: `conformance_suite!("nftables");`.
#[allow(unused_macros)]
macro_rules! conformance_suite {
    ($mode:expr) => {
        conformance_suite!($mode, conformance::always);
    };
    // `$guard` says whether this kernel can run the mode (IPVS mode skips
    // with a printed reason where the kernel has no IPVS: the VM test runs
    // the same cases inside a VM whose kernel has it).
    ($mode:expr, $guard:expr) => {
        #[test]
        fn c01_clusterip() {
            if !$guard() {
                return;
            }
            conformance::clusterip($mode);
        }
        #[test]
        fn c02_nodeport() {
            if !$guard() {
                return;
            }
            conformance::nodeport($mode);
        }
        #[test]
        fn c03_external_and_lb() {
            if !$guard() {
                return;
            }
            conformance::external_and_lb($mode);
        }
        #[test]
        fn c04_session_affinity() {
            if !$guard() {
                return;
            }
            conformance::session_affinity($mode);
        }
        #[test]
        fn c05_no_endpoints() {
            if !$guard() {
                return;
            }
            conformance::no_endpoints($mode);
        }
        #[test]
        fn c06_external_policy_local() {
            if !$guard() {
                return;
            }
            conformance::external_policy_local($mode);
        }
        #[test]
        fn c07_internal_policy_local() {
            if !$guard() {
                return;
            }
            conformance::internal_policy_local($mode);
        }
        #[test]
        fn c08_masquerade_and_hairpin() {
            if !$guard() {
                return;
            }
            conformance::masquerade_and_hairpin($mode);
        }
        #[test]
        fn c09_terminating_fallback() {
            if !$guard() {
                return;
            }
            conformance::terminating_fallback($mode);
        }
        #[test]
        fn c10_endpoint_removal() {
            if !$guard() {
                return;
            }
            conformance::endpoint_removal($mode);
        }
        #[test]
        fn c11_delete_and_cleanup() {
            if !$guard() {
                return;
            }
            conformance::delete_and_cleanup($mode);
        }
        #[test]
        fn c12_restart_keeps_connections() {
            if !$guard() {
                return;
            }
            conformance::restart_keeps_connections($mode);
        }
        #[test]
        fn c13_ipv6_clusterip() {
            if !$guard() {
                return;
            }
            conformance::ipv6_clusterip($mode);
        }
        #[test]
        fn c14_localhost_nodeport() {
            if !$guard() {
                return;
            }
            conformance::localhost_nodeport($mode);
        }
        #[test]
        fn c15_udp_before_endpoints() {
            if !$guard() {
                return;
            }
            conformance::udp_before_endpoints($mode);
        }
        #[test]
        fn c16_conntrack_reconciler() {
            if !$guard() {
                return;
            }
            conformance::conntrack_reconciler($mode);
        }
    };
}

/// kubeadm's ConfigMap leaves nodePortAddresses unset: iptables mode then
/// answers NodePorts on every local address (a docker0-like bridge too), as
/// upstream does, and nftables mode only on the Node's primary IP (its
/// InternalIP), as upstream's `primary` default does.
pub fn nodeport_default_addresses(mode: &str) {
    let mut env = Env::new("npdefault", mode);
    let a = env.pod(1, "a");
    let svc = service(
        "npd",
        &["10.96.0.21"],
        json!({"type": "NodePort", "ports": [
            {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30090}]}),
    );
    env.put("svc", &svc);
    env.put("eps", &slice("npd", "1", "IPv4", &ready(&[&a])));
    if env.api.is_none() {
        // The Nodes a real cluster has (the API flavours created them).
        for i in 1..=env.cluster.nodes() {
            env.put(&format!("node{i}"), &node_object(&env.cluster, i, &[]));
        }
    }
    let n1 = env.cluster.node_ns(1).to_string();
    for cmd in [
        &["ip", "link", "add", "kpbr0", "type", "bridge"][..],
        &["ip", "addr", "add", "172.17.0.1/16", "dev", "kpbr0"],
        &["ip", "link", "set", "kpbr0", "up"],
    ] {
        env.cluster.exec_ok(&n1, cmd).unwrap();
    }
    env.cluster
        .client_route_via("172.17.0.0/16".parse().unwrap(), 1)
        .unwrap();
    env.start_all();
    let cl = env.cluster.client_ns().to_string();
    assert_eq!(env.wait_tcp(&cl, sa("10.100.0.11", 30090)).server, "a");
    let on_bridge = sa("172.17.0.1", 30090);
    if proxy_mode(mode) == "nftables" {
        // Give a wrong rule the time of a sync to show, then insist.
        std::thread::sleep(Duration::from_secs(1));
        let got = tcp_hello(&cl, on_bridge, T);
        assert!(
            got.is_err(),
            "nftables mode answered a NodePort on a bridge address: {got:?}"
        );
    } else {
        assert_eq!(env.wait_tcp(&cl, on_bridge).server, "a");
    }
}

/// The conntrack settings are applied at every start, without --init-only
/// (kubeadm's DaemonSet has no init container): the TCP timeouts, which
/// are per network namespace, hold upstream's defaults in the node's
/// namespace once the proxy runs.
pub fn conntrack_timeouts_at_start(mode: &str) {
    let mut env = Env::new("cttimeouts", mode);
    let n1 = env.cluster.node_ns(1).to_string();
    let read = |env: &Env, name: &str| -> String {
        env.cluster
            .exec_ok(&n1, &["cat", &format!("/proc/sys/net/netfilter/{name}")])
            .unwrap()
            .trim()
            .to_string()
    };
    const EST: &str = "nf_conntrack_tcp_timeout_established";
    const CLOSE_WAIT: &str = "nf_conntrack_tcp_timeout_close_wait";
    // Values the proxy must change (the kernel's defaults are 432000 and 60).
    env.cluster
        .exec_ok(
            &n1,
            &[
                "sh",
                "-c",
                &format!(
                    "echo 1234 > /proc/sys/net/netfilter/{EST}; echo 61 > /proc/sys/net/netfilter/{CLOSE_WAIT}"
                ),
            ],
        )
        .unwrap();
    assert_eq!(read(&env, EST), "1234");
    env.start(1, &[]);
    env.wait_synced(1);
    assert_eq!(read(&env, EST), "86400", "24h, upstream's default");
    assert_eq!(read(&env, CLOSE_WAIT), "3600", "1h, upstream's default");
}

/// `healthzBindAddress: 0.0.0.0:10256` (upstream's default, and the
/// harness's flag) answers on the node's IPv6 address too, as upstream's Go
/// server does (Go listens on a dual-stack socket for 0.0.0.0): an IPv6 or
/// dual-stack cluster's health checks reach it.
pub fn healthz_on_both_families(mode: &str) {
    let mut env = Env::new("hzfamilies", mode);
    env.start(1, &[]);
    env.wait_synced(1);
    let cl = env.cluster.client_ns().to_string();
    for ip in [env.cluster.node_ip(1), env.cluster.node_ip6(1)] {
        let addr = SocketAddr::new(ip, 10256);
        let mut got = None;
        for _ in 0..50 {
            got = http_get(&cl, addr, "/healthz");
            if matches!(got, Some((200, _))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        assert!(
            matches!(got, Some((200, _))),
            "GET http://{addr}/healthz from the client: {got:?}"
        );
    }
}

/// Periodic syncs: what a proxy does every syncPeriod with nothing changed,
/// read from the metrics both proxies expose (every sync's duration, and
/// the full ones'). Upstream v1.36.2 in iptables and nftables mode syncs
/// then at most hourly (its runner's longest interval; syncPeriod only
/// paces iptables mode's canary check), so with a 2 s syncPeriod no sync at
/// all runs in 12 s once the start is over. (The hour itself is
/// kp-sync's pacing tests'.)
pub fn periodic_syncs(mode: &str) {
    let mut env = Env::new("periodic", mode);
    let a = env.pod(1, "a");
    env.put("svc", &service("per", &["10.96.0.180"], json!({})));
    env.put("eps", &slice("per", "1", "IPv4", &ready(&[&a])));
    let args = replace_arg(
        env.proxy_args(1, &[]),
        "--iptables-sync-period=",
        "--iptables-sync-period=2s",
    );
    let program = env.proxy_binary();
    let g = env.spawn(1, &program, &args, "node1.log");
    env.proxies[1] = Some(g);
    env.wait_synced(1);
    let vip = sa("10.96.0.180", 80);
    env.wait_tcp(env.cluster.node_ns(1), vip);
    let counts = |env: &Env| {
        let m = env.metrics(1);
        let count = |name: &str| metric_value(&m, name).unwrap_or(0.0) as u64;
        (
            count("kubeproxy_sync_proxy_rules_duration_seconds_count"),
            count("kubeproxy_sync_full_proxy_rules_duration_seconds_count"),
        )
    };
    // Past the start's own syncs (both families, the ServiceCIDR list).
    std::thread::sleep(Duration::from_secs(3));
    let before = counts(&env);
    assert!(before.1 >= 1, "no full sync counted at start: {before:?}");
    std::thread::sleep(Duration::from_secs(12));
    let after = counts(&env);
    assert_eq!(
        after,
        before,
        "(syncs, full syncs) grew with nothing changed over six 2 s sync periods\n{}",
        tail(&env.log(1))
    );
    // The rules are still in place and serving.
    assert_eq!(env.wait_tcp(env.cluster.node_ns(1), vip).server, "a");
}
