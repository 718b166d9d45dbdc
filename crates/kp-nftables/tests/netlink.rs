//! The netlink backend against the kernel, in throwaway network namespaces:
//! every line shape the proxier writes must list exactly as `nft -f` makes it.

mod common;

use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::process::Command;

use common::*;
use kp_model::{Dataplane, IpFamily, LocalDetector, ProxierConfig};
use kp_nftables::{NftBackend, NftCli, NftNetlink, NftablesProxier};
use serde_json::json;

/// A network namespace deleted on drop, even when the test fails.
struct Ns(String);

impl Ns {
    fn new(tag: &str) -> Ns {
        let name = format!("kpnl{tag}{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap()
            .success();
        assert!(ok, "creating namespace {name}");
        Ns(name)
    }

    /// Runs `f` on a thread that has entered the namespace (sockets it opens
    /// and processes it starts live there).
    fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = std::fs::File::open(format!("/var/run/netns/{}", self.0)).unwrap();
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0, "setns {}", self.0);
                f()
            })
            .join()
            .unwrap()
        })
    }

    fn nft_file(&self, script: &str) -> Result<(), String> {
        let path = format!("/tmp/{}-{}.nft", self.0, script.len());
        std::fs::write(&path, script).unwrap();
        let out = Command::new("ip")
            .args(["netns", "exec", &self.0, "nft", "-f", &path])
            .output()
            .unwrap();
        let _ = std::fs::remove_file(&path);
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).to_string())
        }
    }

    fn ruleset(&self) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.0, "nft", "list", "ruleset"])
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    fn netlink(&self, script: &str) -> Result<(), kp_model::DataplaneError> {
        self.run(|| NftNetlink::new().apply(script))
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Applies each script in turn through netlink in one namespace and through
/// `nft -f` in another; after each the two rulesets must list identically.
fn same_as_nft(tag: &str, scripts: &[&str]) {
    let a = Ns::new(&format!("{tag}a"));
    let b = Ns::new(&format!("{tag}b"));
    for (i, s) in scripts.iter().enumerate() {
        b.nft_file(s)
            .unwrap_or_else(|e| panic!("nft refused script {i}: {e}"));
        a.netlink(s)
            .unwrap_or_else(|e| panic!("netlink refused script {i}: {e}"));
        let (la, lb) = (a.ruleset(), b.ruleset());
        assert_eq!(la, lb, "script {i} lists differently via netlink");
        assert!(!la.is_empty() || s.contains("delete table"));
    }
}

const V4_SHAPES: &str = r#"add table ip t { comment "rules for kube-proxy-rs" ; }
add set ip t cluster-ips { type ipv4_addr ; }
add set ip t nodeport-ips { type ipv4_addr ; }
add set ip t hairpin { type ipv4_addr . ipv4_addr ; }
add map ip t service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }
add map ip t service-nodeports { type inet_proto . inet_service : verdict ; }
add set ip t affinity-10800-x { type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }
add map ip t endpoints-tcp { typeof numgen random mod 1 : ip daddr . tcp dport ; }
add map ip t endpoints-udp { typeof numgen random mod 1 : ip daddr . udp dport ; }
add map ip t endpoints-sctp { typeof numgen random mod 1 : ip daddr . sctp dport ; }
add map ip t endpoint-chains { typeof numgen random mod 1 : verdict ; }
add chain ip t filter-input { type filter hook input priority -110 ; policy accept ; }
add chain ip t filter-output-post-dnat { type filter hook output priority -90 ; policy accept ; }
add chain ip t nat-prerouting { type nat hook prerouting priority -100 ; policy accept ; }
add chain ip t nat-postrouting { type nat hook postrouting priority 100 ; policy accept ; }
add chain ip t mark-for-masquerade
add chain ip t masquerading
add chain ip t services
add chain ip t reject-chain
add chain ip t cluster-ips-check
add chain ip t service-AAAA-default/svc/tcp/http
add chain ip t endpoint-AAAA-default/svc/tcp/http__10.244.1.2/8080
add chain ip t ext
add chain ip t fw
add rule ip t filter-input ct state new jump cluster-ips-check
add rule ip t filter-input ct state invalid drop
add rule ip t filter-output-post-dnat ct state new jump cluster-ips-check
add rule ip t nat-prerouting jump services
add rule ip t nat-postrouting jump masquerading
add rule ip t mark-for-masquerade meta mark set meta mark or 0x4000
add rule ip t masquerading ip saddr . ip daddr @hairpin masquerade fully-random comment "hairpin: a pod reached itself through a Service"
add rule ip t masquerading meta mark and 0x4000 == 0 return
add rule ip t masquerading meta mark set meta mark xor 0x4000
add rule ip t masquerading masquerade fully-random
add rule ip t services ip daddr . meta l4proto . th dport vmap @service-ips
add rule ip t services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports
add rule ip t services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports
add rule ip t reject-chain reject
add rule ip t cluster-ips-check ip daddr @cluster-ips reject comment "reject traffic to invalid ports of ClusterIPs"
add rule ip t cluster-ips-check ip daddr 10.96.0.0/12 drop comment "drop traffic to unallocated ClusterIPs"
add rule ip t service-AAAA-default/svc/tcp/http ip daddr 10.96.0.10 tcp dport 80 ip saddr != 10.244.0.0/16 jump mark-for-masquerade
add rule ip t service-AAAA-default/svc/tcp/http ip daddr 10.96.0.10 udp dport 53 ip saddr != { 10.244.0.0/16, 10.245.0.0/16 } jump mark-for-masquerade
add rule ip t service-AAAA-default/svc/tcp/http ip daddr 10.96.0.10 sctp dport 9 iifname != "cbr0" jump mark-for-masquerade
add rule ip t service-AAAA-default/svc/tcp/http ip daddr 10.96.0.10 tcp dport 80 iifname != "veth*" jump mark-for-masquerade
add rule ip t service-AAAA-default/svc/tcp/http ip daddr 10.96.0.10 tcp dport 80 jump mark-for-masquerade
add rule ip t service-AAAA-default/svc/tcp/http ip saddr @affinity-10800-x goto endpoint-AAAA-default/svc/tcp/http__10.244.1.2/8080
add rule ip t service-AAAA-default/svc/tcp/http numgen random mod 2 vmap { 0 : goto endpoint-AAAA-default/svc/tcp/http__10.244.1.2/8080, 1 : goto fw }
add rule ip t service-AAAA-default/svc/tcp/http meta l4proto tcp dnat ip addr . port to numgen random mod 3 map { 0 : 10.244.1.2 . 8080, 1 : 10.244.2.2 . 8080, 2 : 10.244.3.2 . 8081 }
add rule ip t service-AAAA-default/svc/tcp/http meta l4proto tcp dnat ip addr . port to numgen random mod 3 offset 0 map @endpoints-tcp
add rule ip t service-AAAA-default/svc/tcp/http meta l4proto udp dnat ip addr . port to numgen random mod 2 offset 4 map @endpoints-udp
add rule ip t service-AAAA-default/svc/tcp/http numgen random mod 2 offset 0x10 vmap @endpoint-chains
add rule ip t endpoint-AAAA-default/svc/tcp/http__10.244.1.2/8080 update @affinity-10800-x { ip saddr }
add rule ip t endpoint-AAAA-default/svc/tcp/http__10.244.1.2/8080 meta l4proto udp dnat ip to 10.244.1.2:8080
add rule ip t ext jump mark-for-masquerade
add rule ip t ext ip saddr 10.244.0.0/16 goto service-AAAA-default/svc/tcp/http comment "short-circuit pod traffic"
add rule ip t ext ip saddr { 10.244.0.0/16, 10.250.0.0/15 } goto service-AAAA-default/svc/tcp/http comment "short-circuit pod traffic"
add rule ip t ext iifname "cbr0" goto service-AAAA-default/svc/tcp/http
add rule ip t ext iifname "veth*" goto service-AAAA-default/svc/tcp/http
add rule ip t ext fib saddr type local jump mark-for-masquerade comment "masquerade local traffic"
add rule ip t ext fib saddr type local goto service-AAAA-default/svc/tcp/http comment "short-circuit local traffic"
add rule ip t ext goto service-AAAA-default/svc/tcp/http comment "cluster endpoints"
add rule ip t fw ip saddr != { 203.0.113.0/24 } drop comment "source not in loadBalancerSourceRanges"
add rule ip t fw ip saddr != { 203.0.113.0/24, 198.51.100.0/25, 198.51.100.128/25, 0.0.0.0/8, 203.0.113.7/32 } drop comment "source not in loadBalancerSourceRanges"
add rule ip t fw return comment "x"
add rule ip t fw drop comment "y"
add element ip t service-ips { 10.96.0.10 . tcp . 80 : goto service-AAAA-default/svc/tcp/http, 10.96.0.11 . udp . 53 : drop, 10.96.0.12 . sctp . 9 : goto reject-chain, 10.96.0.13 . tcp . 443 : jump fw }
add element ip t service-nodeports { tcp . 30080 : goto ext }
add element ip t hairpin { 10.244.1.2 . 10.244.1.2 }
add element ip t cluster-ips { 10.96.0.10, 10.96.0.11 }
add element ip t nodeport-ips { 203.0.113.9 }
add element ip t endpoints-tcp { 0x0 : 10.244.1.2 . 8080, 0x1 : 10.244.2.2 . 8080, 0x2 : 10.244.3.2 . 8081 }
add element ip t endpoints-udp { 0x4 : 10.244.3.2 . 53, 0x5 : 10.244.1.2 . 53 }
add element ip t endpoint-chains { 0x10 : goto endpoint-AAAA-default/svc/tcp/http__10.244.1.2/8080, 0x11 : goto fw }
"#;

const V4_UPDATE: &str = r#"add table ip t { comment "rules for kube-proxy-rs" ; }
flush chain ip t service-AAAA-default/svc/tcp/http
add rule ip t service-AAAA-default/svc/tcp/http meta l4proto tcp dnat ip to 10.244.9.9:9090
delete element ip t service-ips { 10.96.0.11 . udp . 53 : drop, 10.96.0.13 . tcp . 443 : jump fw }
delete element ip t cluster-ips { 10.96.0.11 }
delete element ip t hairpin { 10.244.1.2 . 10.244.1.2 }
delete element ip t endpoints-tcp { 0x1 : 10.244.2.2 . 8080 }
delete element ip t endpoints-udp { 0x5 : 10.244.1.2 . 53 }
delete element ip t endpoint-chains { 0x10 : goto endpoint-AAAA-default/svc/tcp/http__10.244.1.2/8080, 0x11 : goto fw }
add element ip t endpoints-tcp { 0x1 : 10.244.9.9 . 9090 }
add element ip t endpoint-chains { 0x11 : goto ext }
add element ip t service-ips { 10.96.0.11 . udp . 53 : goto ext }
flush chain ip t fw
delete chain ip t fw
flush chain ip t endpoint-AAAA-default/svc/tcp/http__10.244.1.2/8080
delete chain ip t endpoint-AAAA-default/svc/tcp/http__10.244.1.2/8080
delete set ip t affinity-10800-x
flush map ip t service-nodeports
flush set ip t nodeport-ips
"#;

const V4_RESYNC: &str = r#"add table ip t { comment "rules for kube-proxy-rs" ; }
flush table ip t
add map ip t service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }
flush map ip t service-ips
add map ip t endpoints-tcp { typeof numgen random mod 1 : ip daddr . tcp dport ; }
flush map ip t endpoints-tcp
add chain ip t services
add rule ip t services ip daddr . meta l4proto . th dport vmap @service-ips
add element ip t service-ips { 10.96.0.11 . udp . 53 : goto ext }
"#;

const V4_CLEANUP: &str = "add table ip t\ndelete table ip t\n";

#[test]
fn v4_line_shapes_list_as_nft_writes_them() {
    same_as_nft("v4", &[V4_SHAPES, V4_UPDATE, V4_RESYNC, V4_CLEANUP]);
}

const V6_SHAPES: &str = r#"add table ip6 t { comment "rules for kube-proxy-rs" ; }
add set ip6 t cluster-ips { type ipv6_addr ; }
add set ip6 t hairpin { type ipv6_addr . ipv6_addr ; }
add map ip6 t service-ips { type ipv6_addr . inet_proto . inet_service : verdict ; }
add map ip6 t service-nodeports { type inet_proto . inet_service : verdict ; }
add set ip6 t aff { type ipv6_addr ; flags dynamic,timeout ; timeout 60s ; }
add map ip6 t endpoints-tcp { typeof numgen random mod 1 : ip6 daddr . tcp dport ; }
add map ip6 t endpoints-udp { typeof numgen random mod 1 : ip6 daddr . udp dport ; }
add map ip6 t endpoint-chains { typeof numgen random mod 1 : verdict ; }
add chain ip6 t nat-output { type nat hook output priority -100 ; policy accept ; }
add chain ip6 t filter-forward { type filter hook forward priority -110 ; policy accept ; }
add chain ip6 t x
add chain ip6 t y
add chain ip6 t reject-chain
add rule ip6 t filter-forward ct state invalid drop
add rule ip6 t nat-output meta l4proto tcp dnat ip6 to [fd00::1]:8080
add rule ip6 t reject-chain reject
add rule ip6 t x meta l4proto tcp dnat ip6 to [fd00::1]:8080
add rule ip6 t x meta l4proto udp dnat ip6 addr . port to numgen random mod 2 map { 0 : fd00::1 . 8080, 1 : fd00::2 . 53 }
add rule ip6 t x ip6 saddr != { 2001:db8::/64, 2001:db8:1::/48 } drop
add rule ip6 t x fib daddr type local ip6 daddr != ::1 meta l4proto . th dport vmap @service-nodeports
add rule ip6 t x ip6 daddr . meta l4proto . th dport vmap @service-ips
add rule ip6 t x ip6 saddr . ip6 daddr @hairpin masquerade fully-random
add rule ip6 t x ip6 saddr fd00::/60 goto y
add rule ip6 t x ip6 saddr fd00::/61 goto y
add rule ip6 t x ip6 daddr fd00::1 sctp dport 80 ip6 saddr != fd00::/64 jump y
add rule ip6 t x ip6 daddr @cluster-ips reject
add rule ip6 t x ip6 saddr @aff goto y
add rule ip6 t y update @aff { ip6 saddr }
add rule ip6 t x meta l4proto tcp dnat ip6 addr . port to numgen random mod 2 offset 8 map @endpoints-tcp
add rule ip6 t x numgen random mod 2 offset 0 vmap @endpoint-chains
add rule ip6 t y numgen random mod 3 vmap { 0 : goto x, 1 : jump reject-chain, 2 : drop }
add element ip6 t service-ips { fd00::1 . tcp . 80 : goto x, fd00::2 . udp . 53 : drop }
add element ip6 t service-nodeports { sctp . 30000 : goto reject-chain }
add element ip6 t hairpin { fd00::1 . fd00::1 }
add element ip6 t cluster-ips { fd00::10, fd00::11 }
add element ip6 t endpoints-tcp { 0x8 : fd00::1 . 8080, 0x9 : fd00::2 . 443 }
add element ip6 t endpoints-udp { 0x0 : fd00::1 . 53 }
add element ip6 t endpoint-chains { 0x0 : goto y, 0x1 : goto x }
"#;

#[test]
fn v6_line_shapes_list_as_nft_writes_them() {
    same_as_nft(
        "v6",
        &[
            V6_SHAPES,
            "delete element ip6 t cluster-ips { fd00::10 }\nflush table ip6 t\n",
            "add table ip6 t\ndelete table ip6 t\n",
        ],
    );
}

#[test]
fn unknown_shapes_are_refused_with_their_line() {
    for (bad, why) in [
        ("add rule ip t x counter", "counter"),
        ("add rule ip t x ip saddr 10.0.0.0/8 log", "log"),
        ("add set ip t s { type ether_addr ; }", "ether_addr"),
        ("insert rule ip t x drop", "insert"),
        ("add rule ip t x ip6 saddr ::1 drop", "ip6"),
        ("add rule ip t x drop drop", "after the rule's verdict"),
        (
            "add chain ip t c { type route hook output priority 0 ; policy accept ; }",
            "route",
        ),
    ] {
        let script = format!("add table ip t\n{bad}\n");
        let e = NftNetlink::check(&script).unwrap_err().to_string();
        assert!(
            e.contains("line 2") && e.contains(bad) && e.contains(why),
            "{bad}: {e}"
        );
    }
    assert!(NftNetlink::check(V4_SHAPES).is_ok());
}

#[test]
fn failing_transaction_names_the_line_and_changes_nothing() {
    let ns = Ns::new("fail");
    ns.netlink(V4_SHAPES).unwrap();
    let before = ns.ruleset();
    let bad = "add chain ip t brand-new\nadd element ip t cluster-ips { 10.96.9.9 }\nflush chain ip t services\ndelete chain ip t no-such-chain\nadd rule ip t services drop\n";
    let e = ns.netlink(bad).unwrap_err().to_string();
    assert!(e.contains("line 4"), "{e}");
    assert!(e.contains("delete chain ip t no-such-chain"), "{e}");
    assert_eq!(
        ns.ruleset(),
        before,
        "a failed transaction must change nothing"
    );
    // A rule jumping to a missing chain fails too, at its own line.
    let e = ns
        .netlink("add rule ip t services jump nowhere\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 1") && e.contains("jump nowhere"), "{e}");
    assert_eq!(ns.ruleset(), before);
}

#[test]
fn table_exists_follows_the_kernel() {
    let ns = Ns::new("tex");
    ns.run(|| {
        let mut b = NftNetlink::new();
        assert!(!b.table_exists(IpFamily::V4, "t").unwrap());
        b.apply("add table ip t\n").unwrap();
        assert!(b.table_exists(IpFamily::V4, "t").unwrap());
        assert!(!b.table_exists(IpFamily::V6, "t").unwrap());
        b.apply("delete table ip t\n").unwrap();
        assert!(!b.table_exists(IpFamily::V4, "t").unwrap());
    });
}

/// The canary chain check sees a missing table, a missing chain and an emptied
/// table (`nft flush table`), through netlink and through the `nft` program.
#[test]
fn canary_chain_check_sees_flushed_and_missing_rules() {
    let ns = Ns::new("cny");
    ns.run(|| {
        let mut backends: Vec<Box<dyn NftBackend>> =
            vec![Box::new(NftNetlink::new()), Box::new(NftCli::default())];
        for b in backends.iter_mut() {
            assert!(!b.chain_has_rules(IpFamily::V4, "t", "nat").unwrap());
            b.apply(
                "add table ip t
add chain ip t nat
add chain ip t services
",
            )
            .unwrap();
            assert!(!b.chain_has_rules(IpFamily::V4, "t", "nat").unwrap());
            b.apply(
                "add rule ip t nat jump services
",
            )
            .unwrap();
            assert!(b.chain_has_rules(IpFamily::V4, "t", "nat").unwrap());
            assert!(!b.chain_has_rules(IpFamily::V4, "t", "other").unwrap());
            assert!(!b.chain_has_rules(IpFamily::V6, "t", "nat").unwrap());
            b.apply(
                "flush table ip t
",
            )
            .unwrap();
            assert!(!b.chain_has_rules(IpFamily::V4, "t", "nat").unwrap());
            b.apply(
                "delete table ip t
",
            )
            .unwrap();
        }
    });
}

fn cfg(family: IpFamily) -> ProxierConfig {
    let mut c = ProxierConfig::new(family);
    c.local_detector = match family {
        IpFamily::V4 => LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().unwrap()]),
        IpFamily::V6 => LocalDetector::Cidrs(vec!["fd00:244::/64".parse().unwrap()]),
    };
    c.service_cidrs = vec![
        "10.96.0.0/12".parse().unwrap(),
        "fd00:96::/108".parse().unwrap(),
    ];
    c
}

fn kinds() -> Vec<serde_json::Value> {
    let mut v = vec![
        service("plain", "10.96.0.10", json!({})),
        endpoints(
            "plain",
            &[ready("10.244.1.2", "node1"), ready("10.244.2.2", "node2")],
        ),
        service("noeps", "10.96.0.11", json!({})),
        service(
            "np",
            "10.96.0.12",
            json!({"type": "NodePort", "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}]}),
        ),
        endpoints("np", &[ready("10.244.2.3", "node2")]),
        service(
            "local",
            "10.96.0.13",
            json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 32000,
            "loadBalancerSourceRanges": ["203.0.113.0/24", "198.51.100.0/25"],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30081}]}),
        ),
        endpoints(
            "local",
            &[ready("10.244.1.4", "node1"), ready("10.244.2.4", "node2")],
        ),
        service(
            "aff",
            "10.96.0.14",
            json!({"sessionAffinity": "ClientIP", "externalIPs": ["198.51.100.7"]}),
        ),
        endpoints(
            "aff",
            &[ready("10.244.1.5", "node1"), ready("10.244.2.5", "node2")],
        ),
        service(
            "itp",
            "10.96.0.15",
            json!({"internalTrafficPolicy": "Local"}),
        ),
        endpoints("itp", &[ready("10.244.2.6", "node2")]),
    ];
    v[5]["status"] = json!({"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}});
    v
}

/// The proxier's own transactions (full, partial, deletion, forced full
/// resync) through netlink and through `nft` list the same after each step.
#[test]
fn proxier_syncs_through_netlink_as_through_nft() {
    let a = Ns::new("pxa");
    let b = Ns::new("pxb");
    let mut t = tracker(IpFamily::V4);
    apply(&mut t, &kinds());
    let mut pa = NftablesProxier::new(cfg(IpFamily::V4), Box::new(NftNetlink::new()));
    let mut pb = NftablesProxier::new(cfg(IpFamily::V4), Box::new(NftCli::default()));
    let mut step = |name: &str, st: &kp_model::ProxyState, changed: &BTreeSet<_>, full: bool| {
        let rb = b
            .run(|| pb.sync(st, changed, full))
            .unwrap_or_else(|e| panic!("{name}: nft: {e}"));
        let ra = a
            .run(|| pa.sync(st, changed, full))
            .unwrap_or_else(|e| panic!("{name}: netlink: {e}"));
        assert_eq!(ra.full, rb.full);
        let (la, lb) = (a.ruleset(), b.ruleset());
        assert!(la.contains("table ip kube-proxy-rs"), "{name}: {la}");
        assert_eq!(la, lb, "{name}: netlink and nft rulesets differ");
        la
    };
    let st = t.state().clone();
    let first = step("first full sync", &st, &BTreeSet::new(), false);
    assert!(first.contains("numgen random mod 2 map"), "{first}");

    let cs = apply(
        &mut t,
        &[endpoints(
            "plain",
            &[ready("10.244.1.2", "node1"), ready("10.244.2.9", "node2")],
        )],
    );
    let st = t.state().clone();
    let l = step("endpoint change", &st, &cs.changed, false);
    assert!(l.contains("10.244.2.9 . 8080"), "{l}");

    // Deleting a Service without an external chain (one with an external chain
    // trips a proxier ordering bug that `nft -f` rejects as well).
    t.delete_service("default", "plain", std::time::SystemTime::now());
    let cs = t.take_changes();
    let st = t.state().clone();
    let l = step("service deletion", &st, &cs.changed, false);
    assert!(!l.contains("10.96.0.10"), "{l}");

    let st = t.state().clone();
    step("forced full resync", &st, &BTreeSet::new(), true);

    a.run(|| pa.cleanup()).unwrap();
    assert!(!a.ruleset().contains("kube-proxy-rs"));
}

#[test]
fn v6_proxier_syncs_through_netlink_as_through_nft() {
    let a = Ns::new("p6a");
    let b = Ns::new("p6b");
    let mut t = tracker(IpFamily::V6);
    apply(
        &mut t,
        &[
            service(
                "plain",
                "fd00:96::10",
                json!({"sessionAffinity": "ClientIP", "ipFamilies": ["IPv6"]}),
            ),
            endpoints(
                "plain",
                &[ready("fd00:244::2", "node1"), ready("fd00:245::2", "node2")],
            ),
            service(
                "lb",
                "fd00:96::11",
                json!({"type": "LoadBalancer", "ipFamilies": ["IPv6"], "loadBalancerSourceRanges": ["2001:db8::/64"],
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30081}]}),
            ),
            endpoints(
                "lb",
                &[ready("fd00:244::3", "node1"), ready("fd00:245::3", "node2")],
            ),
        ],
    );
    let st = t.state().clone();
    let mut pa = NftablesProxier::new(cfg(IpFamily::V6), Box::new(NftNetlink::new()));
    let mut pb = NftablesProxier::new(cfg(IpFamily::V6), Box::new(NftCli::default()));
    a.run(|| pa.sync(&st, &BTreeSet::new(), false)).unwrap();
    b.run(|| pb.sync(&st, &BTreeSet::new(), false)).unwrap();
    let (la, lb) = (a.ruleset(), b.ruleset());
    assert!(la.contains("table ip6 kube-proxy-rs"), "{la}");
    assert!(la.contains("fd00:244::2"), "{la}");
    assert_eq!(la, lb);
}
