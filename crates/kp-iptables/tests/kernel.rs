//! The proxier against the real iptables, inside a throwaway network namespace
//! (never the root namespace's rules). Runs as root.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;

mod common;
use common::{every_kind, state};

use kp_iptables::{detect_variant, svc_chain, IptablesCli, IptablesProxier, Variant};
use kp_model::{Dataplane, IpFamily, LocalDetector, ProxierConfig, ServicePortName};
use kp_netlab::{ScratchDir, ScratchNs};

/// A network namespace and a directory of wrapper programs that run iptables
/// inside it; both removed on drop, also when the test fails.
struct Netns {
    name: String,
    dir: PathBuf,
    _guards: (ScratchNs, ScratchDir),
    /// "nft" or "legacy": which iptables the wrappers (and `save`) run.
    variant: &'static str,
}

impl Netns {
    fn new(test: &str, variant: Variant) -> Netns {
        let name = format!("kpipt-{}-{test}-{}", std::process::id(), variant.as_str());
        let guards = (
            ScratchNs::create(&name).unwrap(),
            ScratchDir::at(std::env::temp_dir().join(&name)).unwrap(),
        );
        let ns = Netns {
            dir: guards.1.path().to_path_buf(),
            name,
            _guards: guards,
            variant: variant.as_str(),
        };
        for b in ["iptables", "ip6tables"] {
            for suffix in ["", "-restore", "-save"] {
                let path = ns.dir.join(format!("{b}{suffix}"));
                std::fs::write(
                    &path,
                    format!(
                        "#!/bin/sh\nexec ip netns exec {} {b}-{}{suffix} \"$@\"\n",
                        ns.name, ns.variant
                    ),
                )
                .unwrap();
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
        }
        ns
    }

    fn cli(&self, family: IpFamily) -> IptablesCli {
        let b = match family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        let p = |s: &str| self.dir.join(format!("{b}{s}")).display().to_string();
        IptablesCli::with_programs(family, &p(""), &p("-restore"), &p("-save"))
    }

    fn run(&self, argv: &[&str]) -> (bool, String) {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(argv)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    }

    /// `iptables` / `ip6tables` of this namespace's variant.
    fn prog(&self, base: &str) -> String {
        format!("{base}-{}", self.variant)
    }

    /// `save("iptables")`: iptables-{variant}-save's output.
    fn save(&self, base: &str) -> String {
        let prog = format!("{base}-{}-save", self.variant);
        let (ok, out) = self.run(&[&prog]);
        assert!(ok, "{prog}: {out}");
        out
    }
}

fn cfg(family: IpFamily) -> ProxierConfig {
    let mut c = ProxierConfig::new(family);
    c.local_detector = LocalDetector::Cidrs(vec![
        "10.244.0.0/16".parse().unwrap(),
        "fd00:244::/48".parse().unwrap(),
    ]);
    c
}

fn rendered_rules_pass_iptables_restore_test(variant: Variant) {
    let ns = Netns::new("test", variant);
    for (family, base) in [(IpFamily::V4, "iptables"), (IpFamily::V6, "ip6tables")] {
        let prog = format!("{base}-{}-restore", ns.variant);
        let st = state(family, &every_kind(family));
        let mut c = cfg(family);
        c.localhost_nodeports = family == IpFamily::V4;
        let p = IptablesProxier::new(c, Box::new(ns.cli(family))).with_route_localnet(false);
        let input = p.render(&st);
        let path = ns.dir.join("input");
        std::fs::write(&path, &input).unwrap();
        let (ok, out) = ns.run(&[
            "sh",
            "-c",
            &format!("{prog} --test --noflush < {}", path.display()),
        ]);
        assert!(ok, "{prog} --test rejected the rules: {out}\n{input}");
    }
}

fn sync_partial_canary_and_cleanup_in_a_namespace(variant: Variant) {
    let ns = Netns::new("sync", variant);
    let ipt = ns.prog("iptables");
    // A user's own chain and rule, which cleanup must leave alone.
    let (ok, out) = ns.run(&[&ipt, "-t", "nat", "-N", "USER-CHAIN"]);
    assert!(ok, "{out}");
    let (ok, out) = ns.run(&[&ipt, "-t", "nat", "-A", "PREROUTING", "-j", "USER-CHAIN"]);
    assert!(ok, "{out}");

    let mut p = IptablesProxier::new(cfg(IpFamily::V4), Box::new(ns.cli(IpFamily::V4)));
    let svcs = every_kind(IpFamily::V4);
    let st = state(IpFamily::V4, &svcs);
    let r = p.sync(&st, &BTreeSet::new(), false).unwrap();
    assert!(r.full);
    let nat = ns.save("iptables");
    let web = svc_chain(&svcs[0].0);
    assert!(nat.contains(&format!(":{web} - ")), "{nat}");
    assert!(nat.contains(
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
    ));
    assert!(nat.contains("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000"));
    assert!(nat.contains("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP"));
    assert!(nat.contains("\"default/none:http has no endpoints\""));
    assert!(!p.rules_lost());

    // A second full sync changes nothing and does not duplicate the jumps.
    p.sync(&st, &BTreeSet::new(), true).unwrap();
    let again = ns.save("iptables");
    assert_eq!(
        again.matches("-j KUBE-SERVICES").count(),
        nat.matches("-j KUBE-SERVICES").count()
    );

    // Partial: web goes away; its chain is deleted, the others stay.
    let st2 = state(IpFamily::V4, &svcs[1..]);
    let changed: BTreeSet<ServicePortName> = [svcs[0].0.name.clone()].into();
    let r = p.sync(&st2, &changed, false).unwrap();
    assert!(!r.full);
    let after = ns.save("iptables");
    assert!(!after.contains(&web), "{after}");
    assert!(after.contains(&svc_chain(&svcs[1].0)));

    // Someone flushes everything: the canary says so.
    let (ok, out) = ns.run(&[&ipt, "-t", "mangle", "-X", "KUBE-PROXY-CANARY"]);
    assert!(ok, "{out}");
    assert!(p.rules_lost());
    assert!(p.sync(&st2, &BTreeSet::new(), false).unwrap().full);
    assert!(!p.rules_lost());
    // `iptables -t nat -F` keeps the chains (and the mangle canary) but
    // empties them: still detected, and the full sync puts the rules back.
    let (ok, out) = ns.run(&[&ipt, "-t", "nat", "-F"]);
    assert!(ok, "{out}");
    assert!(!ns.save("iptables").contains("-A PREROUTING -m comment"));
    // (the flush took the user's jump too; put it back for the cleanup check)
    let (ok, out) = ns.run(&[&ipt, "-t", "nat", "-A", "PREROUTING", "-j", "USER-CHAIN"]);
    assert!(ok, "{out}");
    assert!(p.rules_lost());
    assert!(p.sync(&st2, &BTreeSet::new(), false).unwrap().full);
    assert!(!p.rules_lost());
    assert!(ns.save("iptables").contains(
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
    ));

    p.cleanup().unwrap();
    let left = ns.save("iptables");
    assert!(
        !left.contains("KUBE-"),
        "cleanup left rules behind:\n{left}"
    );
    assert!(left.contains(":USER-CHAIN - "));
    assert!(left.contains("-A PREROUTING -j USER-CHAIN"));
    // Cleaning up twice is fine.
    p.cleanup().unwrap();
}

fn ipv6_sync_in_a_namespace(variant: Variant) {
    let ns = Netns::new("v6", variant);
    let mut p = IptablesProxier::new(cfg(IpFamily::V6), Box::new(ns.cli(IpFamily::V6)));
    let svcs = every_kind(IpFamily::V6);
    p.sync(&state(IpFamily::V6, &svcs), &BTreeSet::new(), false)
        .unwrap();
    let out = ns.save("ip6tables");
    assert!(out.contains(&svc_chain(&svcs[0].0)), "{out}");
    assert!(out.contains("--to-destination [fd00:244::5]:8080"), "{out}");
    // The IPv4 tables were not touched.
    assert!(!ns.save("iptables").contains("KUBE-"));
    p.cleanup().unwrap();
    assert!(!ns.save("ip6tables").contains("KUBE-"));
}

/// The rules land in the requested backend only: nothing of ours in the other.
fn only_in_backend(variant: Variant) {
    let ns = Netns::new("only", variant);
    let mut p = IptablesProxier::new(cfg(IpFamily::V4), Box::new(ns.cli(IpFamily::V4)));
    p.sync(
        &state(IpFamily::V4, &every_kind(IpFamily::V4)),
        &BTreeSet::new(),
        false,
    )
    .unwrap();
    let other = match variant {
        Variant::Nft => "iptables-legacy-save",
        Variant::Legacy => "iptables-nft-save",
    };
    let (ok, out) = ns.run(&[other]);
    assert!(ok, "{other}: {out}");
    assert!(!out.contains(":KUBE-"), "{other} shows our chains:\n{out}");
    assert!(ns.save("iptables").contains(":KUBE-SERVICES"));
}

#[test]
fn nft_rendered_rules_pass_iptables_restore_test() {
    rendered_rules_pass_iptables_restore_test(Variant::Nft);
}

#[test]
fn legacy_rendered_rules_pass_iptables_restore_test() {
    rendered_rules_pass_iptables_restore_test(Variant::Legacy);
}

#[test]
fn nft_sync_partial_canary_and_cleanup() {
    sync_partial_canary_and_cleanup_in_a_namespace(Variant::Nft);
}

#[test]
fn legacy_sync_partial_canary_and_cleanup() {
    sync_partial_canary_and_cleanup_in_a_namespace(Variant::Legacy);
}

#[test]
fn nft_ipv6_sync() {
    ipv6_sync_in_a_namespace(Variant::Nft);
}

#[test]
fn legacy_ipv6_sync() {
    ipv6_sync_in_a_namespace(Variant::Legacy);
}

#[test]
fn nft_rules_only_in_their_backend() {
    only_in_backend(Variant::Nft);
}

#[test]
fn legacy_rules_only_in_their_backend() {
    only_in_backend(Variant::Legacy);
}

/// Detection as upstream: the backend holding KUBE- chains wins, whichever
/// it is; with neither, nft.
#[test]
fn detection_follows_the_kubernetes_chains() {
    for variant in [Variant::Nft, Variant::Legacy] {
        let ns = Netns::new("detect", variant);
        let detect = || kp_netlab::in_netns(&ns.name, || detect_variant(IpFamily::V4)).unwrap();
        assert_eq!(detect(), Variant::Nft, "empty namespace");
        let ipt = ns.prog("iptables");
        let (ok, out) = ns.run(&[&ipt, "-t", "nat", "-N", "KUBE-SERVICES"]);
        assert!(ok, "{out}");
        assert_eq!(detect(), variant, "KUBE-SERVICES in {}", variant.as_str());
        // Only the IPv4 tables hold chains: IPv6 still detects the default.
        let v6 = kp_netlab::in_netns(&ns.name, || detect_variant(IpFamily::V6)).unwrap();
        assert_eq!(v6, Variant::Nft);
    }
}

/// The nfacct counters: created in the namespace of the calling thread,
/// counted into by `-m nfacct` rules of both backends, read back, and kept
/// (not reset) when a restarted proxier ensures them again.
#[test]
fn nfacct_counters_count_and_survive_a_second_ensure() {
    use kp_iptables::nfacct;
    for variant in [Variant::Nft, Variant::Legacy] {
        let ns = Netns::new("nfacct", variant);
        let read = |name: &'static str| {
            kp_netlab::in_netns(&ns.name, move || nfacct::packets(name))
                .unwrap()
                .unwrap()
        };
        assert!(kp_netlab::in_netns(&ns.name, nfacct::ensure_all).unwrap());
        assert_eq!(read(nfacct::CT_STATE_INVALID_DROPPED), 0);
        let (ok, out) = ns.run(&["ip", "link", "set", "lo", "up"]);
        assert!(ok, "{out}");
        let ipt = ns.prog("iptables");
        let (ok, out) = ns.run(&[
            &ipt,
            "-A",
            "OUTPUT",
            "-o",
            "lo",
            "-p",
            "tcp",
            "-m",
            "nfacct",
            "--nfacct-name",
            nfacct::LOCALHOST_NODEPORTS_ACCEPTED,
        ]);
        assert!(ok, "{ipt}: {out}");
        // Three refused connections: each a SYN and a RST out through lo.
        for _ in 0..3 {
            ns.run(&["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9"]);
        }
        let counted = read(nfacct::LOCALHOST_NODEPORTS_ACCEPTED);
        assert!(counted >= 3, "{variant:?}: {counted}");
        assert_eq!(read(nfacct::CT_STATE_INVALID_DROPPED), 0);
        // A restart ensures them again: the counts stay.
        assert!(kp_netlab::in_netns(&ns.name, nfacct::ensure_all).unwrap());
        assert_eq!(read(nfacct::LOCALHOST_NODEPORTS_ACCEPTED), counted);
        // An unknown counter is an error naming it, not a zero.
        let e = kp_netlab::in_netns(&ns.name, || nfacct::packets("kp_no_such_counter"))
            .unwrap()
            .unwrap_err();
        assert!(e.to_string().contains("kp_no_such_counter"), "{e}");
    }
}
