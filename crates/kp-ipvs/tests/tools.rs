//! The ipset and iptables input of IPVS mode against the real `ipset` and
//! `iptables-restore`, in a throwaway network namespace (never the root
//! namespace's). The IPVS part needs a kernel with IPVS: see the VM test
//! (kube-proxy-rs/tests/conformance_ipvs.rs).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;

use kp_ipvs::{diff, plan, restore_input, IpvsConfig, Layout, Op};
use kp_model::{
    Endpoint, IpFamily, LocalDetector, NodeInfo, ProxierConfig, ProxyState, ServicePort,
};
use kp_netlab::ScratchNs;

struct Netns(ScratchNs);

impl Netns {
    fn new(test: &str) -> Netns {
        let name = format!("kpipvs-{}-{test}", std::process::id());
        Netns(ScratchNs::create(&name).unwrap())
    }
    fn run(&self, argv: &[&str], stdin: &str) -> (bool, String) {
        use std::io::Write;
        let mut c = Command::new("ip")
            .args(["netns", "exec", self.0.name()])
            .args(argv)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
        let out = c.wait_with_output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    }
}

fn service(family: IpFamily) -> (ServicePort, Vec<Endpoint>) {
    let (cip, lb, ep, src) = match family {
        IpFamily::V4 => ("10.96.0.10", "203.0.113.20", "10.244.1.2", "10.100.0.0/24"),
        IpFamily::V6 => (
            "fd00:96::10",
            "2001:db8::20",
            "fd00:244:1::2",
            "fd00:100::/64",
        ),
    };
    let sp = ServicePort::builder("default", "lb")
        .port_name("http")
        .cluster_ip(cip)
        .node_port(30080)
        .external_ips(&[lb])
        .load_balancer_ips(&[lb])
        .source_ranges(&[src])
        .local_external()
        .health_check_node_port(32100)
        .build();
    let e = Endpoint::ready(ep.parse().unwrap(), 8080, true);
    (sp, vec![e])
}

fn check_family(family: IpFamily) {
    let ns = Netns::new(match family {
        IpFamily::V4 => "v4",
        IpFamily::V6 => "v6",
    });
    let mut pc = ProxierConfig::new(family);
    pc.local_detector = LocalDetector::Cidrs(vec![match family {
        IpFamily::V4 => "10.244.0.0/16".parse().unwrap(),
        IpFamily::V6 => "fd00:244::/48".parse().unwrap(),
    }]);
    let cfg = IpvsConfig::new(pc.clone());
    let mut st = ProxyState::new(family, NodeInfo::named("node1"));
    let (sp, eps) = service(family);
    st.endpoints.insert(sp.name.clone(), Arc::new(eps));
    st.services.insert(sp.name.clone(), Arc::new(sp));
    let node: IpAddr = match family {
        IpFamily::V4 => "10.100.0.11".parse().unwrap(),
        IpFamily::V6 => "fd00:100::11".parse().unwrap(),
    };
    let want = plan(&st, &cfg, &[node]);
    let mut input = kp_ipvs::internals::create_lines(family);
    for op in diff(&Layout::default(), &want, &|_| false) {
        if let Op::SetAdd(s, e, c) = op {
            input.push_str(&kp_ipvs::internals::add_line(&s, &e, &c));
        }
    }
    let (ok, out) = ns.run(&["ipset", "restore", "-exist"], &input);
    assert!(ok, "ipset restore failed: {out}\n{input}");
    // Read back: every planned entry is there, as parse_save reads it.
    let (ok, saved) = ns.run(&["ipset", "save"], "");
    assert!(ok, "{saved}");
    let back = kp_ipvs::internals::parse_save(&saved, family);
    for (set, entries) in &want.sets {
        let got = back.get(set).unwrap_or_else(|| panic!("no set {set}"));
        for e in entries.keys() {
            assert!(got.contains_key(e), "{set} lacks {e}: {saved}");
        }
    }
    assert!(diff(
        &Layout {
            sets: back,
            ..want.clone()
        },
        &want,
        &|_| false
    )
    .is_empty());
    let prog = match family {
        IpFamily::V4 => "iptables-nft-restore",
        IpFamily::V6 => "ip6tables-nft-restore",
    };
    // The jumps go into the same restore input; a full sync adds the ones
    // whose `-A ...` line iptables-save does not list, so that line must be
    // exactly what iptables-save prints.
    let jumps = kp_ipvs::jumps();
    let all: Vec<_> = jumps.iter().collect();
    let rules = kp_ipvs::with_jumps(&restore_input(&pc), &all);
    let (ok, out) = ns.run(&[prog, "--noflush"], &rules);
    assert!(ok, "{prog} failed: {out}\n{rules}");
    let save = match family {
        IpFamily::V4 => "iptables-nft-save",
        IpFamily::V6 => "ip6tables-nft-save",
    };
    let (_, listed) = ns.run(&[save], "");
    for chain in ["KUBE-IPVS-FILTER", "KUBE-POSTROUTING", "KUBE-NODE-PORT"] {
        assert!(
            listed.contains(&format!(":{chain} ")),
            "{chain} missing:\n{listed}"
        );
    }
    assert!(listed.contains("--match-set"), "{listed}");
    for j in &jumps {
        let line = j.save_line();
        assert_eq!(
            listed.lines().filter(|l| *l == line).count(),
            1,
            "{line} not listed once:\n{listed}"
        );
    }
}

#[test]
fn ipv4_sets_and_rules_load() {
    check_family(IpFamily::V4);
}

#[test]
fn ipv6_sets_and_rules_load() {
    check_family(IpFamily::V6);
}
