//! Issue 51 items 4 and 6, through the kernel: iptables mode drops
//! `ctstate INVALID` in KUBE-FORWARD only while nf_conntrack_tcp_be_liberal
//! is 0 (set per node namespace here), counting the drops into an nfacct
//! counter that /metrics reads, as does the localhost NodePort rule; the
//! rule-count gauges match `iptables-save`; nftables mode has no INVALID
//! drop at all (upstream removed it, kubernetes#122663).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

use conformance::*;
use serde_json::json;

const INVALID_RULE: &str = "-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name  ct_state_invalid_dropped_pkts -j DROP";
const INVALID_METRIC: &str = "kubeproxy_iptables_ct_state_invalid_dropped_packets_total";
const LOCALHOST_METRIC: &str = "kubeproxy_iptables_localhost_nodeports_accepted_packets_total";

/// Sends `n` TCP segments with SYN and FIN both set (a flag combination
/// conntrack marks INVALID) from `ns` (source `src`) to `dst`:8080.
const INVALID_SENDER: &str = r#"
import socket, struct, sys
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
hdr = struct.pack('!HHIIBBHHH', 40000, 8080, 1, 0, 5 << 4, 0x03, 65535, 0, 0)
pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack('!BBH', 0, 6, len(hdr))
b = pseudo + hdr
t = sum(struct.unpack('!%dH' % (len(b) // 2), b))
while t >> 16:
    t = (t >> 16) + (t & 0xffff)
hdr = hdr[:16] + struct.pack('!H', ~t & 0xffff) + hdr[18:]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
for _ in range(n):
    s.sendto(hdr, (dst, 0))
"#;

fn sysctl(env: &Env, node: usize, key: &str, value: &str) {
    env.cluster
        .exec_ok(
            env.cluster.node_ns(node),
            &["sysctl", "-w", &format!("{key}={value}")],
        )
        .unwrap();
}

/// Our rules in `table` as the backend's save program lists them.
fn our_rules(env: &Env, node: usize, save: &str, table: &str) -> usize {
    env.on_node(node, &[save, "-t", table])
        .lines()
        .filter(|l| l.starts_with("-A KUBE-"))
        .count()
}

fn invalid_drop_counters_and_rule_counts(mode: &str) {
    let mut env = Env::new("ctinv", mode);
    let a = env.pod(1, "a");
    let svc = service(
        "np",
        &["10.96.0.150"],
        json!({"type": "NodePort", "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30150}]}),
    );
    env.put("svc", &svc);
    env.put("eps", &slice("np", "1", "IPv4", &ready(&[&a])));
    // The proxies read be_liberal at start: 0 on node1, 1 on node2.
    let liberal = "net.netfilter.nf_conntrack_tcp_be_liberal";
    sysctl(&env, 1, liberal, "0");
    sysctl(&env, 2, liberal, "1");
    env.start(1, &[]);
    env.start(2, &[]);
    let cl = env.cluster.client_ns().to_string();
    env.wait_tcp(&cl, sa("10.100.0.11", 30150));
    env.wait_tcp(&cl, sa("10.100.0.12", 30150));

    let r1 = env.ruleset(1);
    assert!(r1.contains(INVALID_RULE), "be_liberal=0, no drop:\n{r1}");
    let r2 = env.ruleset(2);
    assert!(
        !r2.contains("INVALID"),
        "be_liberal=1, yet an INVALID drop:\n{r2}"
    );
    assert!(r2.contains("-A KUBE-FORWARD "), "{r2}");

    // Both counters are exported from the start, at what the kernel holds.
    let m = env.metrics(1);
    let invalid0 = metric_value(&m, INVALID_METRIC).unwrap_or_else(|| panic!("{m}"));
    let local0 = metric_value(&m, LOCALHOST_METRIC).unwrap_or_else(|| panic!("{m}"));

    // Invalid segments forwarded through node1 (node2 routes node1's pod
    // CIDR to it) are dropped there, and counted.
    let src = env.cluster.node_ip(2).to_string();
    env.cluster
        .exec_ok(
            env.cluster.node_ns(2),
            &[
                "python3",
                "-c",
                INVALID_SENDER,
                &src,
                &a.ip().to_string(),
                "5",
            ],
        )
        .unwrap();
    env.wait("the INVALID drops counted", || {
        metric_value(&env.metrics(1), INVALID_METRIC).is_some_and(|v| v >= invalid0 + 5.0)
    });
    let saved = env.on_node(1, &["iptables-save", "-c", "-t", "filter"]);
    if iptables_backend(mode) == Some("nft") {
        assert!(
            saved
                .lines()
                .any(|l| l.contains("--ctstate INVALID") && !l.starts_with("[0:0]")),
            "{saved}"
        );
    }

    // A NodePort on 127.0.0.1 from the node itself is counted.
    env.wait_tcp(env.cluster.node_ns(1), sa("127.0.0.1", 30150));
    env.wait("the localhost NodePort counted", || {
        metric_value(&env.metrics(1), LOCALHOST_METRIC).is_some_and(|v| v > local0)
    });
    // ... and one on the node's address is not.
    let before = metric_value(&env.metrics(1), LOCALHOST_METRIC).unwrap();
    env.wait_tcp(env.cluster.node_ns(1), sa("10.100.0.11", 30150));
    let after = metric_value(&env.metrics(1), LOCALHOST_METRIC).unwrap();
    assert_eq!(
        before, after,
        "a NodePort on the node IP counted as localhost"
    );

    // The rule gauges are what the save programs list, per family and table.
    let save = match iptables_backend(mode) {
        Some("legacy") => ["iptables-legacy-save", "ip6tables-legacy-save"],
        _ => ["iptables-save", "ip6tables-save"],
    };
    for node in [1, 2] {
        for (fam, prog) in [("IPv4", save[0]), ("IPv6", save[1])] {
            for table in ["filter", "nat"] {
                let labels = format!("{{ip_family=\"{fam}\",table=\"{table}\"}}");
                let mut last = (None, 0);
                env.wait(&format!("node{node} {fam} {table} rule count"), || {
                    let m = env.metrics(node);
                    last = (
                        kp_testkit::prom::value(
                            &m,
                            "kubeproxy_sync_proxy_rules_iptables_total",
                            &labels,
                        ),
                        our_rules(&env, node, prog, table),
                    );
                    last.0 == Some(last.1 as f64)
                });
                let m = env.metrics(node);
                let written = kp_testkit::prom::value(
                    &m,
                    "kubeproxy_sync_proxy_rules_iptables_last",
                    &labels,
                )
                .unwrap_or_else(|| panic!("no _last{labels}:\n{m}"));
                assert!(
                    written <= last.1 as f64,
                    "{labels}: wrote {written} of {}",
                    last.1
                );
            }
        }
    }
    // A NodePort Service with an endpoint has rules in nat at least.
    let m = env.metrics(1);
    let nat = kp_testkit::prom::value(
        &m,
        "kubeproxy_sync_proxy_rules_iptables_total",
        "{ip_family=\"IPv4\",table=\"nat\"}",
    )
    .unwrap();
    assert!(nat >= 10.0, "{m}");
}

#[test]
fn iptables_invalid_drop_follows_be_liberal_and_counts() {
    invalid_drop_counters_and_rule_counts("iptables");
}

#[test]
fn iptables_legacy_invalid_drop_follows_be_liberal_and_counts() {
    invalid_drop_counters_and_rule_counts("iptables-legacy");
}

/// As deploy/daemonset.yaml runs it: CAP_NET_ADMIN only and a read-only
/// /proc/sys are enough to read be_liberal and create the counters.
#[test]
fn least_privilege_iptables_invalid_drop_follows_be_liberal_and_counts() {
    invalid_drop_counters_and_rule_counts("caps/iptables");
}

#[test]
fn nftables_has_no_invalid_drop() {
    let mut env = Env::new("ctinvnft", "nftables");
    let a = env.pod(1, "a");
    env.put("svc", &service("web", &["10.96.0.151"], json!({})));
    env.put("eps", &slice("web", "1", "IPv4", &ready(&[&a])));
    sysctl(&env, 1, "net.netfilter.nf_conntrack_tcp_be_liberal", "0");
    env.start(1, &[]);
    env.wait_synced(1);
    let rules = env.ruleset(1);
    assert!(rules.contains("chain filter-forward"), "{rules}");
    assert!(!rules.contains("ct state invalid"), "{rules}");
    // Nor the iptables mode's series.
    let m = env.metrics(1);
    assert!(!m.contains(INVALID_METRIC), "{m}");
    assert!(
        !m.contains("kubeproxy_sync_proxy_rules_iptables_total"),
        "{m}"
    );
}

/// The same expectations hold for upstream kube-proxy v1.36 (what they
/// were learnt from), when its binaries are here.
#[test]
fn upstream_iptables_invalid_drop_follows_be_liberal_and_counts() {
    if binaries_for("upstream/iptables") {
        invalid_drop_counters_and_rule_counts("upstream/iptables");
    }
}
