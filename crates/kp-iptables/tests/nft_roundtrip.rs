//! iptables-nft over netlink against `iptables-nft-restore`, in the kernel.
//!
//! Every rule shape the renderer emits (every Service kind, TCP/UDP/SCTP,
//! both families, every local-traffic detector and NodePort address
//! setting) is synced through [`IptablesNetlink`] in one namespace and through
//! `iptables-nft-restore` in another, for a first sync, endpoint changes,
//! Service deletions and a forced full sync. After each step both kernels
//! must hold the same rules byte for byte (every expression of every rule,
//! counters aside) and `iptables-nft-save` must print the same text. A
//! shape encoded differently from iptables-nft fails here.
//!
//! Runs as root, only inside namespaces it creates.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;

use kp_iptables::{
    chain_names, IptablesCli, IptablesNetlink, IptablesProxier, Line, Match, Restore, Rule, Target,
    Writer,
};
use kp_model::{Dataplane, Endpoint, IpFamily, ProxyState, ServicePortName};
use kp_netlab::{in_netns, ScratchDir, ScratchNs};

mod common;
use common::{configs, every_kind, host_rules, state};

/// (table, chain, each rule's expressions).
type ChainRules = (String, String, Vec<Vec<Vec<u8>>>);

/// A network namespace and wrappers that run iptables-nft inside it; removed
/// on drop, also when the test fails.
struct Netns {
    name: String,
    dir: PathBuf,
    _guards: (ScratchNs, ScratchDir),
}

impl Netns {
    fn new(tag: &str) -> Netns {
        let name = format!("kpiptnl-{}-{tag}", std::process::id());
        // A leftover of a killed run with this pid goes first.
        let _ = Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
        let guards = (
            ScratchNs::create(&name).unwrap(),
            ScratchDir::at(std::env::temp_dir().join(&name)).unwrap(),
        );
        let dir = guards.1.path().to_path_buf();
        for b in ["iptables", "ip6tables"] {
            for suffix in ["", "-restore", "-save"] {
                let path = dir.join(format!("{b}{suffix}"));
                std::fs::write(
                    &path,
                    format!("#!/bin/sh\nexec ip netns exec {name} {b}-nft{suffix} \"$@\"\n"),
                )
                .unwrap();
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
        }
        Netns {
            name,
            dir,
            _guards: guards,
        }
    }

    fn cli(&self, family: IpFamily) -> IptablesCli {
        let b = base(family);
        let p = |s: &str| self.dir.join(format!("{b}{s}")).display().to_string();
        IptablesCli::with_programs(family, &p(""), &p("-restore"), &p("-save"))
    }

    fn run(&self, argv: &[&str]) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(argv)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{argv:?}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    }

    /// iptables-nft-save without its dated comment lines.
    fn save(&self, family: IpFamily) -> String {
        let text = self.run(&[&format!("{}-nft-save", base(family))]);
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| format!("{l}\n"))
            .collect()
    }

    /// Every rule of every table, as the kernel holds it.
    fn rules(&self, family: IpFamily) -> Vec<ChainRules> {
        let saved = self.save(family);
        let mut out = Vec::new();
        let mut table = String::new();
        let mut chains: Vec<(String, String)> = Vec::new();
        for l in saved.lines() {
            if let Some(t) = l.strip_prefix('*') {
                table = t.to_string();
            }
            for c in chain_names(&format!("{l}\n")) {
                chains.push((table.clone(), c.to_string()));
            }
        }
        in_netns(&self.name, || {
            let mut nl = IptablesNetlink::new(family);
            for (t, c) in chains {
                let r = nl.rule_expressions(&t, &c).unwrap();
                out.push((t, c, r));
            }
        })
        .unwrap();
        out
    }
}

fn base(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "iptables",
        IpFamily::V6 => "ip6tables",
    }
}

/// The lines of `a` (netlink) and `b` (iptables-nft-restore) that differ,
/// in place.
fn diff(a: &str, b: &str) -> String {
    let (la, lb): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    let mut out = String::new();
    for i in 0..la.len().max(lb.len()) {
        let (x, y) = (la.get(i), lb.get(i));
        if x != y {
            out += &format!("line {}:\n  netlink: {x:?}\n  restore: {y:?}\n", i + 1);
        }
    }
    out
}

fn changed(names: &[&ServicePortName]) -> BTreeSet<ServicePortName> {
    names.iter().map(|n| (*n).clone()).collect()
}

#[test]
fn every_rendered_shape_is_installed_as_iptables_nft_restore_installs_it() {
    for family in [IpFamily::V4, IpFamily::V6] {
        for (name, config) in configs(family) {
            let tag = format!("{}{name}", if family == IpFamily::V4 { 4 } else { 6 });
            let a = Netns::new(&format!("{tag}-nl"));
            let b = Netns::new(&format!("{tag}-rs"));
            // Another owner's chain and jump, which must survive every step.
            for ns in [&a, &b] {
                let ipt = format!("{}-nft", base(family));
                ns.run(&[&ipt, "-t", "nat", "-N", "USER-CHAIN"]);
                ns.run(&[&ipt, "-t", "nat", "-A", "PREROUTING", "-j", "USER-CHAIN"]);
            }
            // The INVALID drop with its nfacct counter, and the localhost
            // NodePort rules counting into theirs (configs with localhost
            // NodePorts); without a counter; and no drop (be_liberal set).
            let host = host_rules(name);
            if host.nfacct {
                // What a probing proxier creates in its own namespace.
                for ns in [&a, &b] {
                    assert!(in_netns(&ns.name, kp_iptables::nfacct::ensure_all).unwrap());
                }
            }
            let mut pa =
                IptablesProxier::new(config.clone(), Box::new(IptablesNetlink::new(family)))
                    .with_route_localnet(false)
                    .with_host_rules(host);
            let mut pb = IptablesProxier::new(config.clone(), Box::new(b.cli(family)))
                .with_route_localnet(false)
                .with_host_rules(host);
            let mut services = every_kind(family);
            let mut step = |what: &str,
                            st: &ProxyState,
                            changed: &BTreeSet<ServicePortName>,
                            full: bool| {
                let ctx = format!("{family:?} {name}: {what}");
                pb.sync(st, changed, full)
                    .unwrap_or_else(|e| panic!("{ctx}: iptables-nft-restore: {e}"));
                in_netns(&a.name, || pa.sync(st, changed, full))
                    .unwrap()
                    .unwrap_or_else(|e| panic!("{ctx}: netlink: {e}"));
                let (sa, sb) = (a.save(family), b.save(family));
                assert!(sa.contains("KUBE-SVC-"), "{ctx}: {sa}");
                assert_eq!(
                    sa.contains("--ctstate INVALID -m nfacct --nfacct-name  ct_state_invalid_dropped_pkts -j DROP"),
                    host.invalid_drop && host.nfacct,
                    "{ctx}: {sa}"
                );
                assert_eq!(
                    sa.contains("--ctstate INVALID -j DROP"),
                    host.invalid_drop && !host.nfacct,
                    "{ctx}: {sa}"
                );
                assert_eq!(
                    sa.contains(
                        "-m nfacct --nfacct-name  localhost_nps_accepted_pkts -j KUBE-EXT-"
                    ),
                    host.nfacct && family == IpFamily::V4,
                    "{ctx}: {sa}"
                );
                assert!(sa.contains("-A PREROUTING -j USER-CHAIN"), "{ctx}: {sa}");
                assert!(!sa.contains("incompatible"), "{ctx}: {sa}");
                assert!(
                    sa == sb,
                    "{ctx}: iptables-nft-save differs:\n{}",
                    diff(&sa, &sb)
                );
                let (ra, rb) = (a.rules(family), b.rules(family));
                for ((t, c, x), (_, _, y)) in ra.iter().zip(&rb) {
                    for (i, (ex, ey)) in x.iter().zip(y).enumerate() {
                        for (k, (bx, by)) in ex.iter().zip(ey).enumerate() {
                            let at: Vec<usize> = (0..bx.len().max(by.len()))
                                .filter(|j| bx.get(*j) != by.get(*j))
                                .collect();
                            assert!(
                                at.is_empty(),
                                "{ctx}: {t} {c} rule {} expression {k} ({}) differs at bytes {at:?}:\n  netlink: {bx:?}\n  restore: {by:?}",
                                i + 1,
                                String::from_utf8_lossy(&bx[4..bx.len().min(16)]),
                            );
                        }
                        assert_eq!(
                            ex.len(),
                            ey.len(),
                            "{ctx}: {t} {c} rule {}: expression count",
                            i + 1
                        );
                    }
                }
                assert_eq!(ra, rb, "{ctx}: kernel rules differ");
            };
            let st = state(family, &services);
            step("first sync", &st, &BTreeSet::new(), false);

            // Endpoint changes: one endpoint replaced, one Service loses all.
            let web = services[0].0.name.clone();
            let aff = services[7].0.name.clone();
            let mut eps = services[0].1.clone();
            eps[2] = Endpoint::at(if family == IpFamily::V6 {
                "[fd00:244::9]:8080"
            } else {
                "10.244.1.9:8080"
            });
            services[0].1 = eps;
            services[7].1.clear();
            let st = state(family, &services);
            step("endpoint changes", &st, &changed(&[&web, &aff]), false);

            // Service deletions.
            let np = services[1].0.name.clone();
            let lb = services[2].0.name.clone();
            services.retain(|(s, _)| s.name != np && s.name != lb);
            let st = state(family, &services);
            step("service deletions", &st, &changed(&[&np, &lb]), false);
            step("forced full sync", &st, &BTreeSet::new(), true);

            in_netns(&a.name, || pa.cleanup()).unwrap().unwrap();
            let left = a.save(family);
            assert!(
                !left.contains("KUBE-"),
                "{family:?} {name}: after cleanup: {left}"
            );
            assert!(left.contains("-A PREROUTING -j USER-CHAIN"), "{left}");
        }
    }
}

/// A restore input of `rules` appended to their chains in nat, each chain
/// in `declared` declared first.
fn nat<'a>(declared: &[&'a str], rules: &[(&'a str, &'a Rule)]) -> Restore<'a> {
    let mut input = Restore::default();
    input.push(Line::Table("nat"));
    for c in declared {
        input.push(Line::Chain(c));
    }
    for (c, r) in rules {
        input.push(Line::Append(c, r));
    }
    input.push(Line::Commit);
    input
}

#[test]
fn a_refused_batch_names_the_line_and_changes_nothing() {
    let ns = Netns::new("refused");
    let ok = Rule::new(vec![Match::comment("ok")], Target::Return);
    let input = nat(&["KUBE-SERVICES"], &[("KUBE-SERVICES", &ok)]);
    in_netns(&ns.name, || {
        IptablesNetlink::new(IpFamily::V4).restore(&input)
    })
    .unwrap()
    .unwrap();
    let before = ns.save(IpFamily::V4);
    // A jump to a chain that does not exist: the kernel refuses that message,
    // and the flush before it must not happen either.
    let missing = Rule::new(Vec::new(), Target::Jump("KUBE-SVC-MISSING".into()));
    let bad = nat(&["KUBE-SERVICES"], &[("KUBE-SERVICES", &missing)]);
    let e = in_netns(&ns.name, || {
        IptablesNetlink::new(IpFamily::V4).restore(&bad)
    })
    .unwrap()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("line 3") && e.contains("KUBE-SVC-MISSING"),
        "{e}"
    );
    assert_eq!(ns.save(IpFamily::V4), before);
    // What iptables-nft cannot hold (an IPv6 source in an IPv4 table) is
    // refused before anything is sent.
    let v6 = Rule::new(
        vec![Match::src_host("fd00::1".parse().unwrap())],
        Target::Return,
    );
    let e = in_netns(&ns.name, || {
        IptablesNetlink::new(IpFamily::V4).restore(&nat(&[], &[("KUBE-SERVICES", &v6)]))
    })
    .unwrap()
    .unwrap_err()
    .to_string();
    assert!(e.contains("line 2") && e.contains("fd00::1"), "{e}");
    assert_eq!(ns.save(IpFamily::V4), before);
}

/// The first chain of `saved` named `prefix…` that has rules.
fn chain_with_rules(saved: &str, prefix: &str) -> String {
    saved
        .lines()
        .filter_map(|l| l.strip_prefix("-A "))
        .filter_map(|l| l.split(' ').next())
        .find(|c| c.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} chain with rules:\n{saved}"))
        .to_string()
}

/// A restart (a new proxier over the rules a previous process left)
/// reads every chain back and sends nothing when nothing changed, for
/// every rendered shape; chains changed behind its back are rewritten,
/// exactly those, and the result is what a fresh full sync installs.
#[test]
fn a_restart_adopts_the_rules_a_previous_run_left() {
    for family in [IpFamily::V4, IpFamily::V6] {
        for (name, config) in configs(family) {
            let tag = format!("{}{name}", if family == IpFamily::V4 { 4 } else { 6 });
            let ctx = format!("{family:?} {name}");
            let ipt = format!("{}-nft", base(family));
            // A namespace holding another owner's chain and jump.
            let lab = |suffix: &str| {
                let ns = Netns::new(&format!("{tag}-{suffix}"));
                ns.run(&[&ipt, "-t", "nat", "-N", "USER-CHAIN"]);
                ns.run(&[&ipt, "-t", "nat", "-A", "PREROUTING", "-j", "USER-CHAIN"]);
                ns
            };
            let a = lab("ad");
            // Probing its namespace as the binary's does: the INVALID drop
            // and localhost NodePort rules with their nfacct matches too.
            let proxier = || {
                IptablesProxier::new(config.clone(), Box::new(IptablesNetlink::new(family)))
                    .with_route_localnet(false)
                    .probing_host()
            };
            // A new proxier's first sync of `st` in `a`: operations sent, and
            // what it found.
            let start = |st: &ProxyState| {
                in_netns(&a.name, || {
                    let mut p = proxier();
                    let r = p.sync(st, &BTreeSet::new(), false).unwrap();
                    (r.ops, p.adoption().cloned().expect("netlink reads back"))
                })
                .unwrap()
            };
            // What a fresh full sync of `st` installs, in a namespace of its own.
            let fresh = |st: &ProxyState| {
                let b = lab("fr");
                in_netns(&b.name, || proxier().sync(st, &BTreeSet::new(), false))
                    .unwrap()
                    .unwrap();
                (b.save(family), b.rules(family))
            };
            let mut services = every_kind(family);
            let st = state(family, &services);
            let (ops, found) = start(&st);
            assert_eq!(found.chains_kept, 0, "{ctx}: a fresh namespace: {found:?}");
            assert!(found.chains_added > 10 && ops > 0, "{ctx}: {found:?}");
            let before = a.save(family);
            assert!(
                before.contains("-m nfacct --nfacct-name  ct_state_invalid_dropped_pkts"),
                "{ctx}: {before}"
            );

            // Restarted onto the same cluster: every chain kept, nothing sent.
            let (ops, found) = start(&st);
            assert_eq!(
                (ops, found.chains_rewritten, found.chains_added),
                (0, 0, 0),
                "{ctx}: a restart onto an unchanged cluster: {found:?}"
            );
            assert!(
                found.chains_kept > 10 && found.rules_read > 10,
                "{ctx}: {found:?}"
            );
            assert_eq!(a.save(family), before, "{ctx}: the restart changed rules");

            // Changed behind its back: a rule added to an endpoint's chain,
            // the first rule of a Service's chain deleted, a stale chain of
            // ours. Exactly the two chains are rewritten, the stale one goes.
            let sep = chain_with_rules(&before, "KUBE-SEP-");
            let svc = chain_with_rules(&before, "KUBE-SVC-");
            a.run(&[&ipt, "-t", "nat", "-A", &sep, "-j", "RETURN"]);
            a.run(&[&ipt, "-t", "nat", "-D", &svc, "1"]);
            a.run(&[&ipt, "-t", "nat", "-N", "KUBE-SEP-STALESTALESTALE"]);
            let (_, found) = start(&st);
            assert_eq!(
                (found.chains_rewritten, found.chains_added),
                (2, 0),
                "{ctx}: {sep} and {svc} changed: {found:?}"
            );
            let (save, rules) = fresh(&st);
            assert_eq!(a.save(family), save, "{ctx}: after the repair");
            assert_eq!(a.rules(family), rules, "{ctx}: after the repair");
            assert_eq!(a.save(family), before, "{ctx}: after the repair");

            // The cluster changed while it was down: one endpoint replaced,
            // a Service gone.
            services[0].1[0] = Endpoint::at(if family == IpFamily::V6 {
                "[fd00:244::77]:8080"
            } else {
                "10.244.1.77:8080"
            });
            services.remove(1);
            let st = state(family, &services);
            let (_, found) = start(&st);
            assert!(
                found.chains_added >= 1 && found.chains_kept > 10,
                "{ctx}: {found:?}"
            );
            let (save, rules) = fresh(&st);
            assert_eq!(a.save(family), save, "{ctx}: after changes while down");
            assert_eq!(a.rules(family), rules, "{ctx}: after changes while down");
        }
    }
}

/// A rule appended before its chain is declared keeps the chain out of
/// adoption: the input is restored as it says (one rule, not two).
#[test]
fn adoption_keeps_a_chain_appended_before_its_declaration() {
    let ns = Netns::new("adorder");
    let ret = Rule::new(Vec::new(), Target::Return);
    let first = nat(&["KUBE-X"], &[("KUBE-X", &ret)]);
    let mut again = nat(&["KUBE-X"], &[("KUBE-X", &ret)]);
    again.lines.insert(1, Line::Append("KUBE-X", &ret));
    assert_eq!(
        again.to_string(),
        "*nat\n-A KUBE-X -j RETURN\n:KUBE-X - [0:0]\n-A KUBE-X -j RETURN\nCOMMIT\n"
    );
    let found = in_netns(&ns.name, || {
        let mut nl = IptablesNetlink::new(IpFamily::V4);
        nl.restore(&first).unwrap();
        nl.restore_adopting(&again).unwrap().1.unwrap()
    })
    .unwrap();
    assert_eq!(found.chains_kept, 0, "{found:?}");
    let save = ns.save(IpFamily::V4);
    assert_eq!(save.matches("-A KUBE-X -j RETURN").count(), 1, "{save}");
}
