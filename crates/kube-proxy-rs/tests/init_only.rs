//! `--init-only`: the privileged host setup, then exit 0 without a source,
//! servers or rules. Runs the binary in a fresh network namespace (root
//! needed), where the conntrack timeouts and route_localnet are the
//! namespace's own; nf_conntrack_max is node-wide (read-only outside the
//! initial namespace), so these runs leave it alone with
//! --conntrack-max-per-core=0. The root namespace is only read.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kp_netlab::{ScratchDir, ScratchNs};

struct Ns(ScratchNs);

impl Ns {
    fn new(tag: &str) -> Ns {
        let name = format!("kpinit{tag}{}", std::process::id());
        Ns(ScratchNs::create(&name).unwrap())
    }

    fn sysctl(&self, name: &str) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", self.0.name(), "cat"])
            .arg(format!("/proc/sys/{name}"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{name}: {out:?}");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    /// Runs the binary with `args` in the namespace; it must exit within 20 s.
    fn run(&self, args: &[&str]) -> Output {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                self.0.name(),
                env!("CARGO_BIN_EXE_kube-proxy-rs"),
            ])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let out = child.wait_with_output().unwrap();
                panic!(
                    "{args:?} did not exit\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        child.wait_with_output().unwrap()
    }
}

fn root_sysctl(name: &str) -> String {
    std::fs::read_to_string(format!("/proc/sys/{name}"))
        .unwrap()
        .trim()
        .to_string()
}

fn logs(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout)
}

const ESTABLISHED: &str = "net/netfilter/nf_conntrack_tcp_timeout_established";
const CLOSE_WAIT: &str = "net/netfilter/nf_conntrack_tcp_timeout_close_wait";
const LIBERAL: &str = "net/netfilter/nf_conntrack_tcp_be_liberal";
const UDP: &str = "net/netfilter/nf_conntrack_udp_timeout";
const UDP_STREAM: &str = "net/netfilter/nf_conntrack_udp_timeout_stream";
const ROUTE_LOCALNET: &str = "net/ipv4/conf/all/route_localnet";

#[test]
fn iptables_mode_sets_conntrack_and_route_localnet_then_exits() {
    let root_before: Vec<String> = [ESTABLISHED, CLOSE_WAIT, LIBERAL, UDP, ROUTE_LOCALNET]
        .iter()
        .map(|n| root_sysctl(n))
        .collect();
    let ns = Ns::new("ipt");
    assert_eq!(ns.sysctl(ROUTE_LOCALNET), "0");
    // No --kubeconfig, --master or --manifests: nothing here needs the API.
    let args = [
        "--init-only",
        "--proxy-mode=iptables",
        "--hostname-override=node1",
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=1234s",
        "--conntrack-tcp-timeout-close-wait=5m21s",
        "--conntrack-tcp-be-liberal",
        "--conntrack-udp-timeout=45s",
        "--conntrack-udp-timeout-stream=150s",
    ];
    let t0 = Instant::now();
    let out = ns.run(&args);
    assert!(out.status.success(), "{}\n{}", out.status, logs(&out));
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    assert_eq!(ns.sysctl(ESTABLISHED), "1234");
    assert_eq!(ns.sysctl(CLOSE_WAIT), "321");
    assert_eq!(ns.sysctl(LIBERAL), "1");
    assert_eq!(ns.sysctl(UDP), "45");
    assert_eq!(ns.sysctl(UDP_STREAM), "150");
    assert_eq!(ns.sysctl(ROUTE_LOCALNET), "1");
    let text = logs(&out);
    assert!(
        text.contains("system initialized and --init-only specified")
            && text.contains("nf_conntrack_tcp_timeout_established=1234")
            && text.contains("route_localnet=1"),
        "{text}"
    );
    assert!(!text.contains("kube-proxy-rs started"), "{text}");

    // What the main container does after it: nothing left to write.
    let again = ns.run(&args);
    assert!(again.status.success(), "{}", logs(&again));
    assert!(logs(&again).contains("changed=[]"), "{}", logs(&again));

    let root_after: Vec<String> = [ESTABLISHED, CLOSE_WAIT, LIBERAL, UDP, ROUTE_LOCALNET]
        .iter()
        .map(|n| root_sysctl(n))
        .collect();
    assert_eq!(root_before, root_after, "the root namespace changed");
}

#[test]
fn nftables_mode_starts_no_source_and_programs_nothing() {
    let ns = Ns::new("nft");
    let dir = ScratchDir::unique("kpinit-manifests").unwrap();
    std::fs::write(
        dir.join("svc.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\n\
         spec: {clusterIP: 10.96.0.10, ports: [{port: 80, protocol: TCP}]}\n",
    )
    .unwrap();
    let manifests = format!("--manifests={}", dir.path().display());
    let out = ns.run(&[
        "--init-only",
        "--proxy-mode=nftables",
        "--hostname-override=node1",
        &manifests,
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=777s",
    ]);
    assert!(out.status.success(), "{}\n{}", out.status, logs(&out));
    assert_eq!(ns.sysctl(ESTABLISHED), "777");
    // route_localnet is iptables mode's only.
    assert_eq!(ns.sysctl(ROUTE_LOCALNET), "0");
    let table = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.0,
            "nft",
            "list",
            "table",
            "ip",
            "kube-proxy-rs",
        ])
        .output()
        .unwrap();
    assert!(
        !table.status.success(),
        "rules were programmed: {}",
        String::from_utf8_lossy(&table.stdout)
    );
    assert!(!logs(&out).contains("reading Services"), "{}", logs(&out));
}

#[test]
fn init_only_refuses_dry_run() {
    let out = Command::new(env!("CARGO_BIN_EXE_kube-proxy-rs"))
        .args(["--init-only", "--dry-run", "--hostname-override=node1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--init-only"),
        "{out:?}"
    );
}
