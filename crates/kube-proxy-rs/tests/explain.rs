//! `kube-proxy-rs explain` and `status`, and the /debug endpoints behind
//! them: offline from a manifest directory (no kernel), and live against the
//! real binary in nftables mode in a throwaway network namespace (as root),
//! including drift after one of our chains is deleted behind its back; and
//! the same read-back in iptables mode (iptables-legacy).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use kp_netlab::{in_netns, wait_until, ScratchDir};

mod scratch;
use scratch::{http_get, Ns, Proc, TempFile};

const MANIFEST: &str = r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Node
  metadata: {name: node1, labels: {topology.kubernetes.io/zone: zone-a}}
  status: {addresses: [{type: InternalIP, address: 192.168.0.1}]}
- apiVersion: v1
  kind: Service
  metadata: {name: web, namespace: default}
  spec:
    type: NodePort
    clusterIP: 10.96.0.10
    ports: [{name: http, port: 80, nodePort: 30080, protocol: TCP}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: web-1
    namespace: default
    labels: {kubernetes.io/service-name: web}
  addressType: IPv4
  ports: [{name: http, port: 8080, protocol: TCP}]
  endpoints:
  - {addresses: [10.244.1.2], nodeName: node1, conditions: {ready: true}}
  - {addresses: [10.244.2.2], nodeName: node2, conditions: {ready: false, serving: true, terminating: true}}
- apiVersion: v1
  kind: Service
  metadata: {name: lb, namespace: default}
  spec:
    type: LoadBalancer
    clusterIP: 10.96.0.11
    externalTrafficPolicy: Local
    loadBalancerSourceRanges: [203.0.113.0/24]
    ports: [{port: 443, nodePort: 30443, protocol: TCP}]
  status: {loadBalancer: {ingress: [{ip: 198.51.100.9}]}}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: lb-1
    namespace: default
    labels: {kubernetes.io/service-name: lb}
  addressType: IPv4
  ports: [{port: 8443, protocol: TCP}]
  endpoints:
  - {addresses: [10.244.2.3], nodeName: node2, conditions: {ready: true}}
"#;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_kube-proxy-rs")
}

/// A manifest directory holding [`MANIFEST`], removed on drop.
struct Dir(PathBuf, #[allow(dead_code)] ScratchDir);

fn manifests(tag: &str) -> Dir {
    let dir = ScratchDir::unique(&format!("kpexplain-{tag}")).unwrap();
    std::fs::write(dir.join("cluster.yaml"), MANIFEST).unwrap();
    Dir(dir.path().to_path_buf(), dir)
}

fn ok(out: Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}\n{text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn offline(dir: &Path, args: &[&str]) -> Output {
    Command::new(bin())
        .arg("explain")
        .arg(format!("--manifests={}", dir.display()))
        .args(["--hostname-override=node1", "--cluster-cidr=10.244.0.0/16"])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn offline_explain_text() {
    let d = manifests("text");
    let text = ok(offline(&d.0, &["10.244.1.9", "10.96.0.10:80"]));
    for want in [
        "default/web:http matched as ClusterIP",
        "(zone zone-a)",
        "+ 10.244.1.2:8080",
        "- 10.244.2.2:8080",
        "serving but terminating: ready endpoints exist",
        "masquerade no",
        "verdict  Dnat: DNAT to 10.244.1.2:8080",
    ] {
        assert!(text.contains(want), "{want:?} missing:\n{text}");
    }
    // The NodePort on the Node manifest's address, from outside: masqueraded.
    let text = ok(offline(&d.0, &["172.16.0.3", "192.168.0.1:30080", "tcp"]));
    assert!(text.contains("matched as NodePort"), "{text}");
    assert!(text.contains("masquerade yes"), "{text}");
    // Nothing there.
    let text = ok(offline(&d.0, &["10.244.1.9", "8.8.8.8:53", "udp"]));
    assert!(text.contains("service  none matched"), "{text}");
    assert!(text.contains("verdict  Untouched"), "{text}");
}

#[test]
fn offline_explain_json() {
    let d = manifests("json");
    let json = |args: &[&str]| -> serde_json::Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&ok(offline(&d.0, &a))).unwrap()
    };
    // eTP=Local without a local endpoint, from an allowed source: dropped.
    let v = json(&["203.0.113.5", "198.51.100.9:443"]);
    assert_eq!(v["matched"]["kind"], "LoadBalancerIngress");
    assert_eq!(v["matched"]["externalTrafficPolicy"], "Local");
    assert_eq!(v["verdict"]["action"], "Drop");
    let why = v["verdict"]["why"].as_str().unwrap();
    assert!(why.contains("externalTrafficPolicy Local"), "{why}");
    assert_eq!(v["endpoints"][0]["kept"], false);
    // From outside loadBalancerSourceRanges: dropped by the firewall.
    let v = json(&["172.16.0.3", "198.51.100.9:443"]);
    assert_eq!(v["verdict"]["action"], "Drop");
    assert!(v["verdict"]["why"]
        .as_str()
        .unwrap()
        .contains("loadBalancerSourceRanges"));
    // A pod reaching the NodePort: short-circuited to the cluster endpoints
    // (the LB IP itself would be dropped: pods are not in the source ranges).
    let v = json(&["10.244.1.9", "192.168.0.1:30443"]);
    assert_eq!(v["verdict"]["action"], "Dnat");
    assert_eq!(v["endpoints"][0]["kept"], true);
    assert!(v["dataplane"].is_null(), "offline never reads a kernel");
}

#[test]
fn explain_usage_errors() {
    let out = Command::new(bin())
        .args(["explain", "10.0.0.1", "not-an-address"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    // No proxy listening: a clear error, not a panic.
    let out = Command::new(bin())
        .args(["status", "--metrics-address=127.0.0.1:9"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("connecting to kube-proxy-rs"));
}

fn in_ns(ns: &str, args: &[&str]) -> Output {
    Command::new("ip")
        .args(["netns", "exec", ns])
        .args(args)
        .output()
        .unwrap()
}

/// The proxy in namespace `ns` reading `dir`, with `extra` flags; its stderr
/// goes to `log`. Every test's proxy: node1, the pod CIDR, metrics on the
/// namespace's loopback, and no resync repairing drift while a test looks.
fn spawn_proxy(ns: &str, dir: &Path, log: &Path, extra: &[&str]) -> Proc {
    let child = Command::new("ip")
        .args(["netns", "exec", ns, bin()])
        .arg(format!("--manifests={}", dir.display()))
        .args(extra)
        // nftables unless the test names another mode.
        .args(
            (!extra.iter().any(|a| a.starts_with("--proxy-mode")))
                .then_some("--proxy-mode=nftables"),
        )
        .args([
            "--hostname-override=node1",
            "--cluster-cidr=10.244.0.0/16",
            "--healthz-bind-address=",
            "--metrics-bind-address=127.0.0.1:10249",
            "--iptables-sync-period=1h",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    Proc(child)
}

#[test]
fn live_debug_endpoints_status_explain_and_drift() {
    let ns = format!("kpexp{}", std::process::id());
    let _ns = Ns::create(&ns);
    let d = manifests("live");
    let log = TempFile(std::env::temp_dir().join(format!("{ns}.log")));
    let _proc = spawn_proxy(&ns, &d.0, &log.0, &[]);
    let get = |path: &str| {
        in_netns(&ns, || http_get("127.0.0.1:10249", path))
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default()
    };
    let logs = || std::fs::read_to_string(&log.0).unwrap_or_default();

    // /debug/services, JSON: after the first sync, both Services.
    let mut services = serde_json::Value::Null;
    assert!(
        wait_until(Duration::from_secs(30), Duration::from_millis(200), || {
            let (code, body) = get("/debug/services");
            services = serde_json::from_str(&body).unwrap_or_default();
            code == 200 && services["families"][0]["lastSync"].is_string()
        }),
        "no sync on /debug/services: {services}\nlog:\n{}",
        logs()
    );
    let v4 = &services["families"][0];
    assert_eq!(v4["family"], "IPv4");
    assert_eq!(v4["lastSyncKind"], "full");
    assert_eq!(v4["zone"], "zone-a");
    let ports = v4["servicePorts"].as_array().unwrap();
    let web = ports
        .iter()
        .find(|p| p["servicePort"] == "default/web:http")
        .unwrap_or_else(|| panic!("{services}"));
    assert_eq!(web["nodePort"], 30080);
    let eps = web["endpoints"].as_array().unwrap();
    assert_eq!(eps.len(), 2);
    assert_eq!(eps[0]["ready"], true);
    assert_eq!(eps[1]["terminating"], true);
    assert_eq!(services["families"][1]["family"], "IPv6");

    // The table, from the endpoint and from `kube-proxy-rs status`.
    let (code, table) = get("/debug/services?format=text");
    assert_eq!(code, 200);
    assert!(table.contains("SERVICE"), "{table}");
    let status = ok(in_ns(&ns, &[bin(), "status"]));
    assert!(status.contains("default/web:http"), "{status}");
    assert!(status.contains("10.244.1.2:8080(ready,local)"), "{status}");
    assert!(status.contains("(full)"), "{status}");
    let only = ok(in_ns(&ns, &[bin(), "status", "default/lb", "-o", "json"]));
    let only: serde_json::Value = serde_json::from_str(&only).unwrap();
    assert_eq!(
        only["families"][0]["servicePorts"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    // /debug/explain: the chains it traverses are all in the kernel.
    let (code, body) = get("/debug/explain?src=10.244.1.9&dst=10.96.0.10&port=80&protocol=tcp");
    assert_eq!(code, 200, "{body}");
    let ex: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(ex["matched"]["kind"], "ClusterIP");
    assert_eq!(ex["dataplane"]["mode"], "nftables");
    let chains = ex["dataplane"]["chains"].as_array().unwrap();
    let names: Vec<&str> = chains
        .iter()
        .map(|c| c["chain"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"services"), "{names:?}");
    assert!(
        chains.iter().all(|c| c["present"] == true),
        "{body}\nlog:\n{}",
        logs()
    );
    assert_eq!(ex["dataplane"]["drift"].as_array().unwrap().len(), 0);
    let svc_chain = names
        .iter()
        .find(|n| n.starts_with("service-"))
        .unwrap_or_else(|| panic!("no service chain in {names:?}"))
        .to_string();
    // Another node's packet is refused with a reason.
    let (code, body) = get("/debug/explain?src=10.244.1.9&dst=10.96.0.10&port=80&node=node7");
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("node1"), "{body}");

    // `kube-proxy-rs explain` against it, text.
    let text = ok(in_ns(
        &ns,
        &[bin(), "explain", "10.244.1.9", "10.96.0.10:80"],
    ));
    assert!(text.contains("matched as ClusterIP"), "{text}");
    assert!(text.contains("drift    none"), "{text}");
    assert!(text.contains(&svc_chain), "{text}");

    // Remove the Service's rules behind the proxy's back. `nft flush chain`,
    // not `delete chain`: the kernel refuses to delete a chain that a map
    // element or another chain (the NodePort's external chain) jumps to, and
    // an emptied chain of ours is as broken as a missing one.
    let out = in_ns(
        &ns,
        &["nft", &format!("flush chain ip kube-proxy-rs {svc_chain}")],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = ok(in_ns(
        &ns,
        &[bin(), "explain", "10.244.1.9", "10.96.0.10:80"],
    ));
    assert!(
        text.contains(&format!("MISSING  ip kube-proxy-rs {svc_chain}")),
        "{text}"
    );
    assert!(text.contains("DRIFT"), "{text}");
    let json = ok(in_ns(
        &ns,
        &[
            bin(),
            "explain",
            "10.244.1.9",
            "10.96.0.10:80",
            "-o",
            "json",
        ],
    ));
    let ex: serde_json::Value = serde_json::from_str(&json).unwrap();
    let drift = ex["dataplane"]["drift"].as_array().unwrap();
    assert_eq!(drift.len(), 1, "{json}");
    assert!(drift[0].as_str().unwrap().contains(&svc_chain));
}

/// iptables mode: explain names the KUBE- chains the packet traverses, finds
/// them in the kernel (`iptables -S` on the configured backend), and reports
/// the one removed behind the proxy's back as drift.
#[test]
fn live_explain_reads_back_iptables_chains() {
    let ns = format!("kpexpi{}", std::process::id());
    let _ns = Ns::create(&ns);
    let d = manifests("live-ipt");
    let log = TempFile(std::env::temp_dir().join(format!("{ns}.log")));
    let _proc = spawn_proxy(
        &ns,
        &d.0,
        &log.0,
        &["--proxy-mode=iptables", "--iptables-backend=legacy"],
    );
    let logs = || std::fs::read_to_string(&log.0).unwrap_or_default();
    let explain = || -> serde_json::Value {
        let out = in_ns(
            &ns,
            &[
                bin(),
                "explain",
                "10.244.1.9",
                "10.96.0.10:80",
                "-o",
                "json",
            ],
        );
        serde_json::from_slice(&out.stdout).unwrap_or_default()
    };
    let mut ex = serde_json::Value::Null;
    assert!(
        wait_until(Duration::from_secs(30), Duration::from_millis(300), || {
            ex = explain();
            ex["dataplane"]["chains"]
                .as_array()
                .is_some_and(|c| !c.is_empty() && c.iter().all(|c| c["present"] == true))
        }),
        "explain never found every chain in the kernel: {ex}\nlog:\n{}",
        logs()
    );
    assert_eq!(ex["matched"]["kind"], "ClusterIP");
    assert_eq!(ex["dataplane"]["mode"], "iptables");
    assert_eq!(
        ex["dataplane"]["drift"].as_array().unwrap().len(),
        0,
        "{ex}"
    );
    let names: Vec<String> = ex["dataplane"]["chains"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["chain"].as_str().unwrap().to_string())
        .collect();
    assert!(names.iter().any(|n| n == "KUBE-SERVICES"), "{names:?}");
    let svc = names
        .iter()
        .find(|n| n.starts_with("KUBE-SVC-"))
        .unwrap_or_else(|| panic!("no KUBE-SVC- chain in {names:?}"));
    let sep = names
        .iter()
        .find(|n| n.starts_with("KUBE-SEP-"))
        .unwrap_or_else(|| panic!("no KUBE-SEP- chain in {names:?}"));
    // Empty every chain that jumps to the endpoint chain, then delete it, as
    // a stray firewall tool would.
    let ipt = |args: &[&str]| {
        let mut argv = vec!["iptables-legacy", "-t", "nat"];
        argv.extend(args);
        let out = in_ns(&ns, &argv);
        assert!(
            out.status.success(),
            "{argv:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let rules = ipt(&["-S"]);
    let jump = format!("-j {sep}");
    let referrers: std::collections::BTreeSet<String> = rules
        .lines()
        .filter(|l| l.starts_with("-A ") && l.contains(&jump))
        .filter_map(|l| l.split_whitespace().nth(1).map(str::to_string))
        .collect();
    assert!(referrers.contains(svc.as_str()), "{rules}");
    for chain in &referrers {
        ipt(&["-F", chain]);
    }
    ipt(&["-F", sep]);
    ipt(&["-X", sep]);
    let ex = explain();
    let drift: Vec<&str> = ex["dataplane"]["drift"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d.as_str())
        .collect();
    assert!(drift.iter().any(|d| d.contains(sep.as_str())), "{ex}");
}
