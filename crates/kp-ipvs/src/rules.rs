//! The small fixed iptables ruleset of IPVS mode. It depends only on the
//! configuration: per-Service data lives in the ipsets it matches.

use kp_model::{ClusterIpMasquerading, LocalDetector, ProxierConfig};
use kp_xtables::Jump;

use crate::ipset::name;

pub const NAT_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-POSTROUTING",
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
    "KUBE-MARK-MASQ",
];
pub const FILTER_CHAINS: &[&str] = &[
    "KUBE-FORWARD",
    "KUBE-NODE-PORT",
    "KUBE-PROXY-FIREWALL",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
];

/// The `iptables-restore --noflush` input: our chains declared (which flushes
/// them) and filled.
pub fn restore_input(cfg: &ProxierConfig) -> String {
    let fam = cfg.family;
    let s = |n: &str| name(n, fam);
    let mark = format!("{:#x}/{:#x}", cfg.masquerade_mark(), cfg.masquerade_mark());
    let mut o = String::new();
    let mut l = |x: String| {
        o.push_str(&x);
        o.push('\n');
    };
    l("*nat".into());
    for c in NAT_CHAINS {
        l(format!(":{c} - [0:0]"));
    }
    // Cluster IP traffic kp-model says to masquerade.
    let cluster = format!("-m set --match-set {} dst,dst", s("KUBE-CLUSTER-IP"));
    let cmt = "-m comment --comment";
    match ClusterIpMasquerading::of(cfg) {
        ClusterIpMasquerading::All => {
            l(format!("-A KUBE-SERVICES {cmt} \"Kubernetes service cluster ip + port for masquerade purpose\" {cluster} -j KUBE-MARK-MASQ"));
        }
        ClusterIpMasquerading::Never => {}
        ClusterIpMasquerading::OffCluster => match &cfg.local_detector {
            LocalDetector::Cidrs(cidrs) => {
                for c in cidrs.iter().filter(|c| fam.matches(&c.addr())) {
                    l(format!("-A KUBE-SERVICES ! -s {c} {cmt} \"Kubernetes service cluster ip + port for masquerade purpose\" {cluster} -j KUBE-MARK-MASQ"));
                }
            }
            LocalDetector::BridgeInterface(i) => {
                l(format!("-A KUBE-SERVICES ! -i {i} {cmt} \"Kubernetes service cluster ip + port for masquerade purpose\" {cluster} -j KUBE-MARK-MASQ"));
            }
            LocalDetector::InterfaceNamePrefix(p) => {
                l(format!("-A KUBE-SERVICES ! -i {p}+ {cmt} \"Kubernetes service cluster ip + port for masquerade purpose\" {cluster} -j KUBE-MARK-MASQ"));
            }
            LocalDetector::None => {}
        },
    }
    l(format!("-A KUBE-SERVICES {cmt} \"Kubernetes service external ip + port for masquerade and filter purpose\" -m set --match-set {} dst,dst -j KUBE-MARK-MASQ", s("KUBE-EXTERNAL-IP")));
    l(format!("-A KUBE-SERVICES {cmt} \"Kubernetes service lb portal\" -m set --match-set {} dst,dst -j KUBE-LOAD-BALANCER", s("KUBE-LOAD-BALANCER")));
    l("-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT".into());
    l(format!(
        "-A KUBE-LOAD-BALANCER -m set --match-set {} dst,dst -j RETURN",
        s("KUBE-LOAD-BALANCER-LOCAL")
    ));
    l("-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ".into());
    for (p, up) in [("tcp", "TCP"), ("udp", "UDP")] {
        l(format!(
            "-A KUBE-NODE-PORT -p {p} -m set --match-set {} dst -j RETURN",
            s(&format!("KUBE-NODE-PORT-LOCAL-{up}"))
        ));
        l(format!(
            "-A KUBE-NODE-PORT -p {p} -m set --match-set {} dst -j KUBE-MARK-MASQ",
            s(&format!("KUBE-NODE-PORT-{up}"))
        ));
    }
    l(format!(
        "-A KUBE-NODE-PORT -p sctp -m set --match-set {} dst,dst -j RETURN",
        s("KUBE-NODE-PORT-LOCAL-SCTP-HASH")
    ));
    l(format!(
        "-A KUBE-NODE-PORT -p sctp -m set --match-set {} dst,dst -j KUBE-MARK-MASQ",
        s("KUBE-NODE-PORT-SCTP-HASH")
    ));
    l(format!(
        "-A KUBE-MARK-MASQ -j MARK --or-mark {:#x}",
        cfg.masquerade_mark()
    ));
    l(format!("-A KUBE-POSTROUTING {cmt} \"Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose\" -m set --match-set {} dst,dst,src -j MASQUERADE", s("KUBE-LOOP-BACK")));
    l(format!(
        "-A KUBE-POSTROUTING -m mark ! --mark {mark} -j RETURN"
    ));
    l(format!(
        "-A KUBE-POSTROUTING -j MARK --xor-mark {:#x}",
        cfg.masquerade_mark()
    ));
    l(format!("-A KUBE-POSTROUTING {cmt} \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"));
    l("COMMIT".into());

    l("*filter".into());
    for c in FILTER_CHAINS {
        l(format!(":{c} - [0:0]"));
    }
    l(format!(
        "-A KUBE-FORWARD {cmt} \"kubernetes forwarding rules\" -m mark --mark {mark} -j ACCEPT"
    ));
    l(format!("-A KUBE-FORWARD {cmt} \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"));
    l(format!("-A KUBE-NODE-PORT {cmt} \"Kubernetes health check node port\" -m set --match-set {} dst -j ACCEPT", s("KUBE-HEALTH-CHECK-NODE-PORT")));
    l(format!("-A KUBE-PROXY-FIREWALL {cmt} \"Kubernetes service load balancer ip + port for load balancer with sourceRange\" -m set --match-set {} dst,dst -j KUBE-SOURCE-RANGES-FIREWALL", s("KUBE-LOAD-BALANCER-FW")));
    l(format!(
        "-A KUBE-SOURCE-RANGES-FIREWALL -m set --match-set {} dst,dst,src -j RETURN",
        s("KUBE-LOAD-BALANCER-SOURCE-CIDR")
    ));
    l("-A KUBE-SOURCE-RANGES-FIREWALL -j DROP".into());
    // New connections to a Service IP on a port no Service uses are
    // rejected: kube-ipvs0 makes those IPs local, so any listener on the
    // node would otherwise answer there.
    for set in [
        "KUBE-LOAD-BALANCER",
        "KUBE-CLUSTER-IP",
        "KUBE-EXTERNAL-IP",
        "KUBE-EXTERNAL-IP-LOCAL",
    ] {
        l(format!(
            "-A KUBE-IPVS-FILTER -m set --match-set {} dst,dst -j RETURN",
            s(set)
        ));
    }
    l(format!(
        "-A KUBE-IPVS-FILTER -m set --match-set {} dst -j RETURN",
        s("KUBE-HEALTH-CHECK-NODE-PORT")
    ));
    l(format!(
        "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set {} dst -j REJECT",
        s("KUBE-IPVS-IPS")
    ));
    l("COMMIT".into());
    o
}

fn jump(table: &'static str, from: &'static str, to: &'static str, comment: &'static str) -> Jump {
    Jump {
        table,
        from,
        to,
        comment,
        new_only: false,
    }
}

/// The jumps from builtin chains into ours.
pub fn jumps() -> Vec<Jump> {
    vec![
        jump(
            "nat",
            "PREROUTING",
            "KUBE-SERVICES",
            "kubernetes service portals",
        ),
        jump(
            "nat",
            "OUTPUT",
            "KUBE-SERVICES",
            "kubernetes service portals",
        ),
        jump(
            "nat",
            "POSTROUTING",
            "KUBE-POSTROUTING",
            "kubernetes postrouting rules",
        ),
        jump(
            "filter",
            "INPUT",
            "KUBE-IPVS-FILTER",
            "kubernetes ipvs access filter",
        ),
        jump(
            "filter",
            "INPUT",
            "KUBE-PROXY-FIREWALL",
            "kube-proxy firewall rules",
        ),
        jump(
            "filter",
            "INPUT",
            "KUBE-NODE-PORT",
            "kubernetes health check rules",
        ),
        jump(
            "filter",
            "FORWARD",
            "KUBE-FORWARD",
            "kubernetes forwarding rules",
        ),
    ]
}

pub use kp_xtables::with_jumps;

/// Whether `chain` in `table` is one of ours (for --cleanup).
pub fn is_our_chain(table: &str, chain: &str) -> bool {
    match table {
        "nat" => NAT_CHAINS.contains(&chain),
        "filter" => FILTER_CHAINS.contains(&chain),
        _ => false,
    }
}
