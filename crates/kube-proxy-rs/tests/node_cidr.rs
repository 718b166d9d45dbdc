//! `--detect-local-mode=NodeCIDR`: the binary takes this node's podCIDRs from
//! its Node (here from `--manifests`) for the local-traffic rules, waits for
//! them at start, and exits when they change. The `--dry-run` tests need
//! nothing; the change test runs the real proxy in a throwaway network
//! namespace (root).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kp_netlab::{wait_until, ScratchDir};

mod scratch;
use scratch::{ruleset, Ns, Proc, TempFile};

const SERVICES: &str = r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: web, namespace: default}
  spec:
    type: ClusterIP
    clusterIP: 10.96.0.10
    clusterIPs: [10.96.0.10, "fd00:96::10"]
    ipFamilies: [IPv4, IPv6]
    ports: [{name: http, port: 80, protocol: TCP}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: web-v4
    namespace: default
    labels: {kubernetes.io/service-name: web}
  addressType: IPv4
  ports: [{name: http, port: 8080, protocol: TCP}]
  endpoints:
  - {addresses: [10.244.1.2], nodeName: node1, conditions: {ready: true}}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: web-v6
    namespace: default
    labels: {kubernetes.io/service-name: web}
  addressType: IPv6
  ports: [{name: http, port: 8080, protocol: TCP}]
  endpoints:
  - {addresses: ["fd00:10:244:1::2"], nodeName: node1, conditions: {ready: true}}
"#;

fn node_yaml(cidrs: &[&str]) -> String {
    let list: Vec<String> = cidrs.iter().map(|c| format!("\"{c}\"")).collect();
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: node1}}\nspec:\n  podCIDRs: [{}]\n",
        list.join(", ")
    )
}

/// A manifest directory removed on drop.
struct Dir(ScratchDir);

impl Dir {
    fn new(tag: &str) -> Self {
        let d = ScratchDir::unique(&format!("kpr-nodecidr-{tag}")).unwrap();
        std::fs::write(d.join("services.yaml"), SERVICES).unwrap();
        Dir(d)
    }
    fn write_node(&self, cidrs: &[&str]) {
        // Written aside and renamed: the source never reads half a file.
        let tmp = self.0.join(".node.yaml.tmp");
        std::fs::write(&tmp, node_yaml(cidrs)).unwrap();
        std::fs::rename(&tmp, self.0.join("node.yaml")).unwrap();
    }
    fn path(&self) -> &Path {
        self.0.path()
    }
}

fn dry_run(dir: &Dir, extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kube-proxy-rs"))
        .arg(format!("--manifests={}", dir.path().display()))
        .args(["--hostname-override=node1", "--dry-run"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits (at most `limit`) for `child` to exit and returns its output.
fn finish(mut child: Child, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "did not exit within {limit:?}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn stdout_ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn local_traffic_rules_use_the_nodes_pod_cidrs() {
    let dir = Dir::new("rules");
    dir.write_node(&["10.244.1.0/24", "fd00:10:244:1::/64"]);
    let out = stdout_ok(&finish(
        dry_run(
            &dir,
            &["--detect-local-mode=NodeCIDR", "--proxy-mode=nftables"],
        ),
        Duration::from_secs(30),
    ));
    // Traffic from outside this node's pod CIDR is masqueraded, per family.
    assert!(
        out.contains("ip daddr @cluster-ips ip saddr != 10.244.1.0/24 jump mark-for-masquerade"),
        "{out}"
    );
    assert!(
        out.contains(
            "ip6 daddr @cluster-ips ip6 saddr != fd00:10:244:1::/64 jump mark-for-masquerade"
        ),
        "{out}"
    );

    // iptables mode gets them too.
    let out = stdout_ok(&finish(
        dry_run(
            &dir,
            &["--detect-local-mode=NodeCIDR", "--proxy-mode=iptables"],
        ),
        Duration::from_secs(30),
    ));
    assert!(
        out.contains("--dport 80 ! -s 10.244.1.0/24 -j KUBE-MARK-MASQ"),
        "{out}"
    );
    assert!(
        out.contains("--dport 80 ! -s fd00:10:244:1::/64 -j KUBE-MARK-MASQ"),
        "{out}"
    );
}

#[test]
fn waits_for_the_pod_cidrs() {
    let dir = Dir::new("wait");
    dir.write_node(&[]);
    let mut child = dry_run(
        &dir,
        &["--detect-local-mode=NodeCIDR", "--proxy-mode=nftables"],
    );
    // Upstream polls for up to five minutes: nothing is rendered meanwhile.
    std::thread::sleep(Duration::from_millis(1500));
    if child.try_wait().unwrap().is_some() {
        let out = child.wait_with_output().unwrap();
        panic!(
            "exited without the Node's podCIDRs\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    dir.write_node(&["10.244.7.0/24"]);
    let out = finish(child, Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        stderr.contains("waiting for this node's podCIDRs")
            && stderr.contains("Node node1 has no spec.podCIDRs yet"),
        "{stderr}"
    );
    let out = stdout_ok(&out);
    assert!(
        out.contains("ip saddr != 10.244.7.0/24 jump mark-for-masquerade"),
        "{out}"
    );
}

/// Upstream exits when its podCIDRs change (the DaemonSet restarts it with the
/// new ones); the rules stay meanwhile.
#[test]
fn exits_when_the_pod_cidrs_change() {
    let ns = format!("kpncidr{}", std::process::id());
    let _ns = Ns::create(&ns);
    let dir = Dir::new("change");
    dir.write_node(&["10.244.1.0/24"]);
    let log = std::env::temp_dir().join(format!("{ns}.log"));
    let _log = TempFile(log.clone());
    let child = Command::new("ip")
        .args(["netns", "exec", &ns, env!("CARGO_BIN_EXE_kube-proxy-rs")])
        .arg(format!("--manifests={}", dir.path().display()))
        .args([
            "--proxy-mode=nftables",
            "--hostname-override=node1",
            "--detect-local-mode=NodeCIDR",
            "--healthz-bind-address=",
            "--metrics-bind-address=",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut proc = Proc(child);
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        wait_until(Duration::from_secs(30), Duration::from_millis(100), || {
            ruleset(&ns).contains("ip saddr != 10.244.1.0/24")
        }),
        "first sync\n{}",
        logs()
    );
    // Another node's change is not ours.
    std::fs::write(
        dir.path().join("other.yaml"),
        node_yaml(&["10.9.0.0/24"]).replace("node1", "node2"),
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    assert!(proc.0.try_wait().unwrap().is_none(), "{}", logs());

    dir.write_node(&["10.244.2.0/24"]);
    let mut status = None;
    assert!(
        wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
            status = proc.0.try_wait().unwrap();
            status.is_some()
        }),
        "still running after the podCIDRs changed\n{}",
        logs()
    );
    let status = status.unwrap();
    assert!(!status.success(), "{status}");
    let text = logs();
    assert!(
        text.contains("podCIDRs changed from [\"10.244.1.0/24\"] to [\"10.244.2.0/24\"]"),
        "{text}"
    );
    assert!(
        ruleset(&ns).contains("ip saddr != 10.244.1.0/24"),
        "the rules were removed on exit"
    );
}
