//! `--cleanup` and the start-up sweep remove upstream kube-proxy's leftovers of
//! every mode (nftables tables, iptables chains in both backends, ipvs mode's
//! link and ipsets) as well as ours, and nothing of anyone else. Real kernel,
//! in throwaway network namespaces.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use kp_netlab::ScratchNs;

struct Ns(ScratchNs);

impl Ns {
    fn new(tag: &str) -> Ns {
        let name = format!("kpclean-{}-{tag}", std::process::id());
        Ns(ScratchNs::create(&name).unwrap())
    }

    fn run(&self, argv: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", self.0.name()])
            .args(argv)
            .output()
            .unwrap()
    }

    /// Runs and requires success; stdout.
    fn ok(&self, argv: &[&str]) -> String {
        let o = self.run(argv);
        assert!(
            o.status.success(),
            "{argv:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn nft_script(&self, script: &str) {
        use std::io::Write;
        let mut child = Command::new("ip")
            .args(["netns", "exec", self.0.name(), "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        assert!(child.wait().unwrap().success(), "nft -f: {script}");
    }

    fn restore(&self, prog: &str, input: &str) {
        use std::io::Write;
        let mut child = Command::new("ip")
            .args(["netns", "exec", self.0.name(), prog, "--noflush"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{prog}: {}\n{input}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_kube-proxy-rs")
}

/// What upstream ipvs mode (plus an older iptables mode) leaves in one
/// iptables backend, next to kubelet's and a user's chains. The jump comments
/// are not ours on purpose.
const UPSTREAM_IPTABLES: &str = "\
*mangle
:KUBE-PROXY-CANARY - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
COMMIT
*filter
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SOURCE-RANGES-FIREWALL - [0:0]
:KUBE-IPVS-FILTER - [0:0]
:KUBE-IPVS-OUT-FILTER - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:USER-CHAIN - [0:0]
-A INPUT -j KUBE-FIREWALL
-A INPUT -m comment --comment \"kubernetes health check rules\" -j KUBE-NODE-PORT
-A INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER
-A INPUT -j USER-CHAIN
-A OUTPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-OUT-FILTER
-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD
-A KUBE-PROXY-FIREWALL -j KUBE-SOURCE-RANGES-FIREWALL
-A KUBE-FIREWALL -m mark --mark 0x8000/0x8000 -j DROP
-A USER-CHAIN -p tcp --dport 22 -j ACCEPT
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-LOAD-BALANCER - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-MARK-DROP - [0:0]
:KUBE-XLB-ABCDEFGHIJKLMNOP - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:USER-NAT - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING
-A PREROUTING -j USER-NAT
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT
-A KUBE-NODE-PORT -j KUBE-LOAD-BALANCER
-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ
-A KUBE-XLB-ABCDEFGHIJKLMNOP -j KUBE-MARK-MASQ
-A USER-NAT -d 198.51.100.1/32 -j RETURN
COMMIT
";

fn chains(save: &str) -> Vec<String> {
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect()
}

/// Sets up upstream leftovers of every mode (and others' objects) in `ns`.
fn plant(ns: &Ns) {
    // ipvs mode: its link (a bridge here: this kernel has no dummy devices;
    // the cleanup deletes by name) holding a Service IP, and its ipsets.
    ns.ok(&["ip", "link", "add", "kube-ipvs0", "type", "bridge"]);
    ns.ok(&["ip", "addr", "add", "10.96.0.1/32", "dev", "kube-ipvs0"]);
    ns.ok(&["ipset", "create", "KUBE-CLUSTER-IP", "hash:ip,port"]);
    ns.ok(&[
        "ipset",
        "create",
        "KUBE-6-CLUSTER-IP",
        "hash:ip,port",
        "family",
        "inet6",
    ]);
    ns.ok(&[
        "ipset",
        "create",
        "KUBE-NODE-PORT-TCP",
        "bitmap:port",
        "range",
        "0-65535",
    ]);
    ns.ok(&["ipset", "create", "USER-SET", "hash:ip"]);
    ns.ok(&["ipset", "create", "KUBE-SOMETHING-ELSE", "hash:ip"]);
    // Both iptables backends: upstream kube-proxy ran on one, then the other.
    ns.restore("iptables-legacy-restore", UPSTREAM_IPTABLES);
    ns.restore("iptables-nft-restore", UPSTREAM_IPTABLES);
    ns.restore(
        "ip6tables-legacy-restore",
        "*nat\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n",
    );
    // nftables: upstream's table, ours, and a user's.
    ns.nft_script(
        "add table ip kube-proxy
add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }
add table ip6 kube-proxy
add table ip kube-proxy-rs
add chain ip kube-proxy-rs services
add table ip user
add chain ip user input { type filter hook input priority 0 ; }
",
    );
}

/// Nothing of any kube-proxy is left; everything else is.
fn assert_only_others_left(ns: &Ns, stderr: &str) {
    let nft = ns.ok(&["nft", "list", "tables"]);
    assert!(!nft.contains("kube-proxy"), "{nft}\n{stderr}");
    assert!(nft.contains("table ip user"), "{nft}");
    for prog in ["iptables-legacy-save", "iptables-nft-save"] {
        let save = ns.ok(&[prog]);
        let left = chains(&save);
        for c in [
            "KUBE-SERVICES",
            "KUBE-POSTROUTING",
            "KUBE-NODE-PORT",
            "KUBE-LOAD-BALANCER",
            "KUBE-MARK-MASQ",
            "KUBE-XLB-ABCDEFGHIJKLMNOP",
            "KUBE-PROXY-CANARY",
            "KUBE-FORWARD",
            "KUBE-PROXY-FIREWALL",
            "KUBE-SOURCE-RANGES-FIREWALL",
            "KUBE-IPVS-FILTER",
            "KUBE-IPVS-OUT-FILTER",
        ] {
            assert!(
                !left.contains(&c.to_string()),
                "{prog}: {c} survived\n{save}\n{stderr}"
            );
        }
        // Kubelet's and the user's chains and rules stay, in every table.
        for c in [
            "KUBE-FIREWALL",
            "KUBE-MARK-DROP",
            "KUBE-KUBELET-CANARY",
            "USER-CHAIN",
            "USER-NAT",
        ] {
            assert!(
                left.contains(&c.to_string()),
                "{prog}: {c} was removed\n{save}"
            );
        }
        assert!(save.contains("-A INPUT -j KUBE-FIREWALL"), "{save}");
        assert!(save.contains("-A INPUT -j USER-CHAIN"), "{save}");
        assert!(save.contains("-A PREROUTING -j USER-NAT"), "{save}");
        assert!(
            save.contains("-A USER-CHAIN -p tcp -m tcp --dport 22 -j ACCEPT"),
            "{save}"
        );
        assert!(!save.contains("-j KUBE-SERVICES"), "{save}");
    }
    assert!(!ns.ok(&["ip6tables-legacy-save"]).contains("KUBE-"));
    let sets = ns.ok(&["ipset", "list", "-n"]);
    for s in ["KUBE-CLUSTER-IP", "KUBE-6-CLUSTER-IP", "KUBE-NODE-PORT-TCP"] {
        assert!(!sets.lines().any(|l| l == s), "ipset {s} survived: {sets}");
    }
    assert!(sets.lines().any(|l| l == "USER-SET"), "{sets}");
    assert!(sets.lines().any(|l| l == "KUBE-SOMETHING-ELSE"), "{sets}");
    let link = ns.run(&["ip", "link", "show", "kube-ipvs0"]);
    assert!(!link.status.success(), "kube-ipvs0 survived\n{stderr}");
}

#[test]
fn cleanup_removes_upstream_leftovers_of_every_mode() {
    let ns = Ns::new("all");
    plant(&ns);
    let out = ns.run(&[binary(), "--cleanup", "-v=4"]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "--cleanup failed:\n{stderr}");
    assert_only_others_left(&ns, &stderr);
    // Said what it did, and what it could not look at (no IPVS here).
    assert!(stderr.contains("nftables ip kube-proxy"), "{stderr}");
    assert!(
        stderr.contains("iptables-legacy IPv4 nat/KUBE-NODE-PORT"),
        "{stderr}"
    );
    assert!(stderr.contains("no IPVS in this kernel"), "{stderr}");
    // Twice is fine and removes nothing more.
    let again = ns.run(&[binary(), "--cleanup"]);
    assert!(again.status.success());
    assert_only_others_left(&ns, "");
}

#[test]
fn pinned_backend_cleanup_leaves_the_other_backend_alone() {
    let ns = Ns::new("pinned");
    plant(&ns);
    let out = ns.run(&[binary(), "--cleanup", "--iptables-backend=legacy"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The nft backend's rules still use upstream's KUBE-CLUSTER-IP set: it
    // cannot go, and cleanup says so (non-zero exit) instead of pretending.
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("cleanup failed: ipset KUBE-CLUSTER-IP"),
        "{stderr}"
    );
    assert!(!chains(&ns.ok(&["iptables-legacy-save"])).contains(&"KUBE-NODE-PORT".into()));
    assert!(chains(&ns.ok(&["iptables-nft-save"])).contains(&"KUBE-NODE-PORT".into()));
}

/// The proxy (nftables mode) running in a test namespace on a manifest
/// directory with one Service, 10.96.0.10:80.
struct Running {
    child: std::process::Child,
    dir: PathBuf,
    log: PathBuf,
}

impl Running {
    /// Its log so far.
    fn log_so_far(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Stops it, removes its files; its log.
    fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let stderr = std::fs::read_to_string(&self.log).unwrap_or_default();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.log);
        stderr
    }
}

fn start_with_one_service(ns: &Ns) -> Running {
    let dir: PathBuf = std::env::temp_dir().join(format!("{}-manifests", ns.0));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("svc.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\n\
         spec: {clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10], ports: [{name: http, port: 80, protocol: TCP}]}\n",
    )
    .unwrap();
    let log = std::env::temp_dir().join(format!("{}.log", ns.0));
    let child = Command::new("ip")
        .args(["netns", "exec", &ns.0, binary()])
        .arg(format!("--manifests={}", dir.display()))
        .args([
            "--proxy-mode=nftables",
            "--hostname-override=node1",
            "--healthz-bind-address=127.0.0.1:10256",
            "--metrics-bind-address=127.0.0.1:10249",
            "--iptables-min-sync-period=100ms",
        ])
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    Running { child, dir, log }
}

/// Starting in nftables mode removes the other modes' and upstream's objects
/// (as upstream does on a mode switch) and then programs its own table.
#[test]
fn starting_in_nftables_mode_removes_other_modes_leftovers() {
    let ns = Ns::new("start");
    plant(&ns);
    let proxy = start_with_one_service(&ns);
    // (upstream's nftables table goes right after our first sync)
    let ok = kp_netlab::wait_until(Duration::from_secs(20), Duration::from_millis(100), || {
        let t = ns.ok(&["nft", "list", "tables"]);
        t.contains("table ip kube-proxy-rs")
            && !t.contains("table ip kube-proxy\n")
            && !t.contains("table ip6 kube-proxy\n")
            && ns
                .ok(&["nft", "list", "table", "ip", "kube-proxy-rs"])
                .contains("10.96.0.10")
    });
    let stderr = proxy.stop();
    assert!(ok, "no first sync\n{stderr}");
    // kube-ipvs0's Service IP went before the node's addresses were read:
    // it is no NodePort address (nftables mode's default is `primary`).
    let ips = ns.ok(&["nft", "list", "set", "ip", "kube-proxy-rs", "nodeport-ips"]);
    assert!(!ips.contains("10.96.0.1"), "{ips}");
    let nft = ns.ok(&["nft", "list", "tables"]);
    assert!(!nft.contains("table ip kube-proxy\n"), "{nft}");
    assert!(!nft.contains("table ip6 kube-proxy\n"), "{nft}");
    assert!(nft.contains("table ip user"), "{nft}");
    for prog in ["iptables-legacy-save", "iptables-nft-save"] {
        let save = ns.ok(&[prog]);
        assert!(
            !chains(&save).contains(&"KUBE-SERVICES".into()),
            "{prog}\n{save}\n{stderr}"
        );
        assert!(chains(&save).contains(&"USER-CHAIN".into()), "{save}");
        assert!(chains(&save).contains(&"KUBE-FIREWALL".into()), "{save}");
    }
    assert!(!ns
        .run(&["ip", "link", "show", "kube-ipvs0"])
        .status
        .success());
    assert!(
        stderr.contains("removing other modes' leftovers"),
        "{stderr}"
    );
}

#[test]
fn ipvs_ipset_names() {
    use kube_proxy_rs::modes::ipvs::is_ipvs_ipset;
    for n in [
        "KUBE-CLUSTER-IP",
        "KUBE-6-CLUSTER-IP",
        "KUBE-LOOP-BACK",
        "KUBE-6-LOAD-BALANCER-SOURCE-CIDR",
        "KUBE-IPVS-IPS",
    ] {
        assert!(is_ipvs_ipset(n), "{n}");
    }
    for n in [
        "KUBE-6-",
        "KUBE-CLUSTER",
        "KUBE-6-KUBE-CLUSTER-IP",
        "USER",
        "",
    ] {
        assert!(!is_ipvs_ipset(n), "{n}");
    }
}

/// Starting in ipvs mode keeps what ipvs mode takes over (its chains, the
/// shared names, kube-ipvs0, the ipsets) and removes the rest. Called as a
/// library function: this kernel has no IPVS, so the mode itself cannot start.
#[test]
fn starting_in_ipvs_mode_keeps_ipvs_objects() {
    use kube_proxy_rs::config::ProxyMode;
    use kube_proxy_rs::modes::{remove_leftovers, Scope};
    let ns = Ns::new("ipvs");
    plant(&ns);
    ns.restore(
        "iptables-nft-restore",
        "*nat\n:KUBE-SVC-ABCDEFGHIJKLMNOP - [0:0]\n-A KUBE-SERVICES -j KUBE-SVC-ABCDEFGHIJKLMNOP\nCOMMIT\n",
    );
    let cfg =
        kube_proxy_rs::config::load(["kube-proxy-rs", "--proxy-mode", "ipvs"].map(Into::into))
            .unwrap();
    let out = kp_netlab::in_netns(&ns.0, || {
        remove_leftovers(Scope::StartingIn(ProxyMode::Ipvs), &cfg)
    })
    .unwrap();
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    let save = ns.ok(&["iptables-nft-save"]);
    let left = chains(&save);
    for c in [
        "KUBE-SERVICES",
        "KUBE-NODE-PORT",
        "KUBE-LOAD-BALANCER",
        "KUBE-IPVS-FILTER",
        "KUBE-FORWARD",
    ] {
        assert!(left.contains(&c.to_string()), "{c} removed\n{save}");
    }
    for c in [
        "KUBE-SVC-ABCDEFGHIJKLMNOP",
        "KUBE-XLB-ABCDEFGHIJKLMNOP",
        "KUBE-PROXY-CANARY",
    ] {
        assert!(!left.contains(&c.to_string()), "{c} survived\n{save}");
    }
    assert!(ns
        .run(&["ip", "link", "show", "kube-ipvs0"])
        .status
        .success());
    assert!(ns
        .ok(&["ipset", "list", "-n"])
        .lines()
        .any(|l| l == "KUBE-CLUSTER-IP"));
    assert!(!ns.ok(&["nft", "list", "tables"]).contains("kube-proxy"));
}

/// Replacing upstream kube-proxy in nftables mode drops nothing: neither the
/// privileged `--init-only` nor the start removes upstream's `kube-proxy`
/// table; it serves until our first sync is done, and goes right after it
/// (docs/migrate-from-kube-proxy.md; found by e2e.sh --migrate: a gap of
/// failed requests while the new pod started).
#[test]
fn upstreams_nftables_table_serves_until_our_first_sync() {
    let ns = Ns::new("handover");
    ns.nft_script(
        "add table ip kube-proxy
add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }
add table ip6 kube-proxy
",
    );
    let o = ns.run(&[
        binary(),
        "--init-only",
        "--proxy-mode=nftables",
        "--hostname-override=node1",
        // The machine-wide table size: not this namespace's to set.
        "--conntrack-max-per-core=0",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let nft = ns.ok(&["nft", "list", "tables"]);
    assert!(
        nft.contains("table ip kube-proxy\n"),
        "--init-only removed it:\n{nft}"
    );
    assert!(
        nft.contains("table ip6 kube-proxy\n"),
        "--init-only removed it:\n{nft}"
    );

    let proxy = start_with_one_service(&ns);
    // Gone, and the removal logged (it is logged after it is done).
    let gone = kp_netlab::wait_until(Duration::from_secs(20), Duration::from_millis(50), || {
        let t = ns.ok(&["nft", "list", "tables"]);
        !t.contains("table ip kube-proxy\n")
            && !t.contains("table ip6 kube-proxy\n")
            && ["ip", "ip6"].iter().all(|f| {
                let what = format!("nftables {f} kube-proxy");
                proxy
                    .log_so_far()
                    .lines()
                    .any(|l| l.contains("removing upstream's") && l.contains(&what))
            })
    });
    let stderr = proxy.stop();
    assert!(gone, "upstream's table never went\n{stderr}");
    assert!(
        ns.ok(&["nft", "list", "table", "ip", "kube-proxy-rs"])
            .contains("10.96.0.10"),
        "{stderr}"
    );
    // In that order: both families synced, then upstream's table removed.
    let line = |needle: &str| {
        stderr
            .lines()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no log line with {needle:?}\n{stderr}"))
    };
    let removed = stderr
        .lines()
        .position(|l| l.contains("removing upstream's") && l.contains("nftables ip kube-proxy"))
        .unwrap_or_else(|| panic!("no removal logged\n{stderr}"));
    let synced: Vec<usize> = ["IPv4", "IPv6"]
        .iter()
        .map(|f| {
            stderr
                .lines()
                .position(|l| l.contains("synced rules") && l.contains(f))
                .unwrap_or_else(|| panic!("no {f} sync\n{stderr}"))
        })
        .collect();
    assert!(synced.iter().all(|s| *s < removed), "{stderr}");
    assert!(line("kube-proxy-rs started") < removed, "{stderr}");
}
