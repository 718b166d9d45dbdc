//! `--dry-run` in nftables mode prints the exact ruleset a sync installs:
//! an operator must be able to check it with `nft -c -f -` and load it with
//! `nft -f -`. Services of every kind, session affinity among them, in both
//! families; the load happens in a throwaway network namespace (root).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::io::Write;
use std::process::{Command, Stdio};

mod scratch;
use kp_netlab::ScratchDir;
use scratch::Ns;

const SERVICES: &str = r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: sticky, namespace: default}
  spec:
    type: NodePort
    clusterIP: 10.96.0.10
    clusterIPs: [10.96.0.10, "fd00:96::10"]
    ipFamilies: [IPv4, IPv6]
    ipFamilyPolicy: PreferDualStack
    sessionAffinity: ClientIP
    sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}
    externalIPs: [198.51.100.7]
    ports:
    - {name: http, port: 80, protocol: TCP, nodePort: 30080}
    - {name: dns, port: 53, protocol: UDP, nodePort: 30053}
- apiVersion: v1
  kind: Service
  metadata: {name: lb, namespace: default}
  spec:
    type: LoadBalancer
    clusterIP: 10.96.0.11
    clusterIPs: [10.96.0.11]
    externalTrafficPolicy: Local
    healthCheckNodePort: 32000
    loadBalancerSourceRanges: [203.0.113.0/24]
    ports: [{name: http, port: 80, protocol: TCP, nodePort: 30081}]
  status: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}
- apiVersion: v1
  kind: Service
  metadata: {name: empty, namespace: default}
  spec:
    type: ClusterIP
    clusterIP: 10.96.0.12
    clusterIPs: [10.96.0.12]
    sessionAffinity: ClientIP
    ports: [{name: http, port: 80, protocol: TCP}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: sticky-v4
    namespace: default
    labels: {kubernetes.io/service-name: sticky}
  addressType: IPv4
  ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]
  endpoints:
  - {addresses: [10.244.1.2], nodeName: node1, conditions: {ready: true}}
  - {addresses: [10.244.2.2], nodeName: node2, conditions: {ready: true}}
  - {addresses: [10.244.2.3], nodeName: node2, conditions: {ready: true}}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: sticky-v6
    namespace: default
    labels: {kubernetes.io/service-name: sticky}
  addressType: IPv6
  ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]
  endpoints:
  - {addresses: ["fd00:10:244:1::2"], nodeName: node1, conditions: {ready: true}}
  - {addresses: ["fd00:10:244:2::2"], nodeName: node2, conditions: {ready: true}}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: lb
    namespace: default
    labels: {kubernetes.io/service-name: lb}
  addressType: IPv4
  ports: [{name: http, port: 8080, protocol: TCP}]
  endpoints:
  - {addresses: [10.244.1.4], nodeName: node1, conditions: {ready: true}}
  - {addresses: [10.244.2.4], nodeName: node2, conditions: {ready: true}}
"#;

fn nft_in(ns: &str, args: &[&str], stdin: &str) -> std::process::Output {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "nft"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running nft");
    child
        .stdin
        .take()
        .expect("nft's stdin")
        .write_all(stdin.as_bytes())
        .expect("writing to nft");
    child.wait_with_output().expect("waiting for nft")
}

#[test]
fn dry_run_output_loads_with_nft() {
    let scratch = ScratchDir::unique("kpr-dryrun").unwrap();
    let dir = scratch.path();
    std::fs::write(dir.join("services.yaml"), SERVICES).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kube-proxy-rs"))
        .arg(format!("--manifests={}", dir.display()))
        .args([
            "--proxy-mode=nftables",
            "--hostname-override=node1",
            "--cluster-cidr=10.244.0.0/16,fd00:10:244::/56",
            "--dry-run",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let script = String::from_utf8(out.stdout).unwrap();
    for want in [
        "add set ip kube-proxy-rs affinity-600 ",
        "add set ip6 kube-proxy-rs affinity-600 ",
        " . jhash ip saddr . th sport mod 3 seed ",
        " . jhash ip6 saddr . th sport mod 2 seed ",
    ] {
        assert!(script.contains(want), "no `{want}` in:\n{script}");
    }
    let ns = Ns::create(&format!("kprdry{}", std::process::id()));
    let check = nft_in(&ns.0, &["-c", "-f", "-"], &script);
    assert!(
        check.status.success(),
        "nft -c refused the --dry-run output: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    let load = nft_in(&ns.0, &["-f", "-"], &script);
    assert!(
        load.status.success(),
        "nft -f refused the --dry-run output: {}",
        String::from_utf8_lossy(&load.stderr)
    );
    let listed = nft_in(&ns.0, &["list", "ruleset"], "");
    let listing = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listing.contains("update @affinity-600 { ip saddr . numgen random mod 1 offset "),
        "{listing}"
    );
    assert!(
        listing.contains("update @affinity-600 { ip6 saddr . numgen random mod 1 offset "),
        "{listing}"
    );
}

/// The Service ranges of the cluster's ServiceCIDR objects (here from the
/// manifests) are in the ruleset a dry run prints: traffic to their
/// unallocated addresses is dropped, per family.
#[test]
fn dry_run_drops_the_service_cidrs() {
    let scratch = ScratchDir::unique("kpr-dryrun-cidr").unwrap();
    let dir = scratch.path();
    std::fs::write(
        dir.join("objects.yaml"),
        r#"
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec: {cidrs: [10.96.0.0/16, "fd00:96::/108"]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  ports: [{name: http, port: 80, protocol: TCP}]
"#,
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kube-proxy-rs"))
        .arg(format!("--manifests={}", dir.display()))
        .args([
            "--proxy-mode=nftables",
            "--hostname-override=node1",
            "--cluster-cidr=10.244.0.0/16",
            "--dry-run",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let script = String::from_utf8(out.stdout).unwrap();
    assert!(
        script.contains("cluster-ips-check ip daddr 10.96.0.0/16 drop"),
        "{script}"
    );
    let ns = Ns::create(&format!("kprdryc{}", std::process::id()));
    let check = nft_in(&ns.0, &["-c", "-f", "-"], &script);
    assert!(
        check.status.success(),
        "nft -c refused the --dry-run output: {}",
        String::from_utf8_lossy(&check.stderr)
    );
}
