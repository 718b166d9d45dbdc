//! Security properties, each against the real kernel in a namespace cluster:
//! the metrics server is loopback-only by default, our rules never let in
//! traffic the host's own firewall drops (except to Service addresses), and
//! `--cleanup` leaves other people's tables and chains alone. (NodePorts on
//! 127.0.0.1 from another host and loadBalancerSourceRanges are conformance
//! cases 14 and 3, run in every mode.)
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

mod conformance;

use std::net::SocketAddr;
use std::time::Duration;

use conformance::{http_get, metric_value, ready, sa, service, slice, Env, T};
use kp_netlab::{tcp_hello, ServeSpec};
use serde_json::json;

/// Without --metrics-bind-address the metrics server listens on 127.0.0.1
/// only (upstream's default): the node reaches it, another host does not.
/// /healthz (0.0.0.0:10256 by default) is reachable from outside, as it must
/// be for load balancers.
#[test]
fn metrics_are_loopback_only_by_default() {
    let mut env = Env::new("metricsbind", "nftables");
    let a = env.pod(1, "a");
    env.put("svc", &service("m", &["10.96.8.10"], json!({})));
    env.put("eps", &slice("m", "1", "IPv4", &ready(&[&a])));
    let args: Vec<String> = env
        .proxy_args(1, &[])
        .into_iter()
        .filter(|a| !a.starts_with("--metrics-bind-address") && !a.starts_with("--healthz-bind"))
        .collect();
    let _p = env.spawn(1, &Env::binary(), &args, "node1.log");
    let node = env.cluster.node_ns(1).to_string();
    env.wait("metrics on the node's loopback", || {
        http_get(&node, sa("127.0.0.1", 10249), "/metrics")
            .is_some_and(|(s, b)| s == 200 && b.contains("kubeproxy_"))
    });
    let cl = env.cluster.client_ns().to_string();
    assert!(
        http_get(&cl, sa("10.100.0.11", 10249), "/metrics").is_none(),
        "metrics answered another host"
    );
    assert!(
        http_get(&node, sa("10.100.0.11", 10249), "/metrics").is_none(),
        "metrics listen beyond loopback"
    );
    assert!(http_get(&cl, sa("10.100.0.11", 10256), "/healthz").is_some());
}

/// The host's own firewall, as its operator wrote it, in this mode's tool.
fn install_user_firewall(env: &Env, mode: &str) {
    let node = env.cluster.node_ns(1);
    match mode {
        "iptables" => {
            for rule in [
                vec!["-P", "FORWARD", "DROP"],
                vec![
                    "-A",
                    "FORWARD",
                    "-m",
                    "conntrack",
                    "--ctstate",
                    "ESTABLISHED,RELATED",
                    "-j",
                    "ACCEPT",
                ],
                vec!["-A", "INPUT", "-p", "tcp", "--dport", "9999", "-j", "DROP"],
            ] {
                let mut argv = vec!["iptables"];
                argv.extend(rule);
                env.cluster.exec_ok(node, &argv).unwrap();
            }
        }
        _ => {
            env.cluster
                .exec_ok(
                    node,
                    &[
                        "nft",
                        "add table inet userfw; \
                         add chain inet userfw userforward { type filter hook forward priority 0 ; policy drop ; }; \
                         add rule inet userfw userforward ct state established,related accept; \
                         add chain inet userfw userinput { type filter hook input priority 0 ; }; \
                         add rule inet userfw userinput tcp dport 9999 drop",
                    ],
                )
                .unwrap();
        }
    }
}

/// With a default-drop forward policy and a blocked local port on the node,
/// flows that are not Service traffic (an external host straight to a pod,
/// a pod to a pod on another node, anyone to the blocked port) are dropped
/// before kube-proxy-rs runs and still dropped while it runs with Services
/// of every kind programmed.
fn no_rule_opens_what_the_host_drops(mode: &str) {
    let mut env = Env::new("noopen", mode);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    let node = env.cluster.node_ns(1).to_string();
    let _blocked = env
        .cluster
        .serve(&node, "node", ServeSpec::tcp(&[9999]))
        .unwrap();
    let cl = env.cluster.client_ns().to_string();
    env.cluster
        .client_route_via("10.244.1.0/24".parse().unwrap(), 1)
        .unwrap();
    // Everything open before the firewall: the probes below can succeed.
    assert!(tcp_hello(&cl, a.addr(8080), T).is_ok());
    assert!(tcp_hello(&cl, sa("10.100.0.11", 9999), T).is_ok());
    assert!(tcp_hello(client.ns(), c.addr(8080), T).is_ok());
    install_user_firewall(&env, mode);
    let probes = || {
        let short = Duration::from_millis(700);
        [
            (
                "client -> pod a directly",
                tcp_hello(&cl, a.addr(8080), short),
            ),
            (
                "client -> node port 9999",
                tcp_hello(&cl, sa("10.100.0.11", 9999), short),
            ),
            (
                "pod -> pod on node2",
                tcp_hello(client.ns(), c.addr(8080), short),
            ),
        ]
        .into_iter()
        .filter(|(_, r)| r.is_ok())
        .map(|(what, _)| what)
        .collect::<Vec<_>>()
        .join(", ")
    };
    assert_eq!(probes(), "", "the user firewall is not effective");

    let svc = conformance::with_status(
        service(
            "all",
            &["10.96.8.20"],
            json!({"type": "LoadBalancer", "externalIPs": ["203.0.113.30"],
                   "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30820}]}),
        ),
        &["203.0.113.31"],
    );
    env.put("svc", &svc);
    env.put("eps", &slice("all", "1", "IPv4", &ready(&[&a, &c])));
    env.start(1, &[]);
    env.wait("the Service rules", || {
        env.ruleset(1).contains("10.96.8.20")
    });
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        probes(),
        "",
        "kube-proxy-rs opened flows the host firewall drops"
    );
}

#[test]
fn no_rule_opens_what_the_host_drops_nftables() {
    no_rule_opens_what_the_host_drops("nftables");
}

#[test]
fn no_rule_opens_what_the_host_drops_iptables() {
    no_rule_opens_what_the_host_drops("iptables");
}

/// `--cleanup` after a run removes our table / chains and nothing of the
/// user's: an nftables table with a chain and rule, and iptables chains and
/// jumps in nat and filter, all created before kube-proxy-rs started.
fn cleanup_keeps_user_objects(mode: &str) {
    let mut env = Env::new("usercleanup", mode);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    let node = env.cluster.node_ns(1).to_string();
    env.cluster
        .exec_ok(
            &node,
            &[
                "nft",
                "add table ip userstuff; add chain ip userstuff keep { type filter hook input priority 10 ; }; \
                 add rule ip userstuff keep tcp dport 7777 counter comment \"user rule\"",
            ],
        )
        .unwrap();
    for argv in [
        vec!["iptables", "-t", "nat", "-N", "USER-NAT"],
        vec![
            "iptables", "-t", "nat", "-A", "USER-NAT", "-p", "tcp", "--dport", "7777", "-j",
            "RETURN",
        ],
        vec![
            "iptables",
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-j",
            "USER-NAT",
        ],
        vec!["iptables", "-N", "USER-FILTER"],
        vec![
            "iptables",
            "-A",
            "USER-FILTER",
            "-p",
            "tcp",
            "--dport",
            "7777",
            "-j",
            "RETURN",
        ],
        vec!["iptables", "-A", "INPUT", "-j", "USER-FILTER"],
    ] {
        env.cluster.exec_ok(&node, &argv).unwrap();
    }
    let user_iptables = |env: &Env| {
        let s = env.on_node(1, &["iptables-save"]);
        s.lines()
            .filter(|l| l.contains("USER-"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let before = user_iptables(&env);
    assert_eq!(before.len(), 6, "{before:?}");

    env.put("svc", &service("c", &["10.96.8.30"], json!({})));
    env.put("eps", &slice("c", "1", "IPv4", &ready(&[&a])));
    env.start(1, &[]);
    env.wait_tcp(client.ns(), sa("10.96.8.30", 80));
    env.kill(1);
    let mut argv = vec![Env::binary().display().to_string()];
    argv.extend(env.proxy_args(1, &["--cleanup"]));
    let out = env.cluster.exec(&node, &argv).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let rules = env.ruleset(1);
    assert!(
        !rules.contains(env.rules_marker()),
        "--cleanup left our rules:\n{rules}"
    );
    let user_nft = env.on_node(1, &["nft", "list", "table", "ip", "userstuff"]);
    assert!(
        user_nft.contains("chain keep") && user_nft.contains("\"user rule\""),
        "the user's nftables table was touched:\n{user_nft}"
    );
    assert_eq!(
        user_iptables(&env),
        before,
        "the user's iptables chains changed"
    );
}

#[test]
fn cleanup_keeps_user_objects_nftables() {
    cleanup_keeps_user_objects("nftables");
}

#[test]
fn cleanup_keeps_user_objects_iptables() {
    cleanup_keeps_user_objects("iptables");
}

/// A Service declaring the node's own address and SSH port as an externalIP
/// (CVE-2020-8554's shape): the claim is refused, logged and counted, the
/// node's listener stays reachable on that address and port, and the
/// Service still answers on its ClusterIP.
fn node_ssh_survives_an_external_ip_claim(mode: &str) {
    let mut env = Env::new("sshclaim", mode);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    let node_ip = env.cluster.node_ip(1);
    // sshd's stand-in: an echo server in the node's namespace on port 22.
    let _sshd = env
        .cluster
        .serve(env.cluster.node_ns(1), "sshd", ServeSpec::tcp(&[22]))
        .expect("listener on the node");
    let ssh = SocketAddr::new(node_ip, 22);
    assert_eq!(
        tcp_hello(env.cluster.client_ns(), ssh, T)
            .expect("ssh before")
            .server,
        "sshd"
    );
    env.put(
        "svc",
        &service(
            "grab",
            &["10.96.8.22"],
            json!({
                "externalIPs": [node_ip.to_string()],
                "ports": [{"name": "http", "port": 22, "protocol": "TCP", "targetPort": 8080}],
            }),
        ),
    );
    env.put("eps", &slice("grab", "1", "IPv4", &ready(&[&a])));
    env.start(1, &[]);
    assert_eq!(env.wait_tcp(client.ns(), sa("10.96.8.22", 22)).server, "a");
    for _ in 0..5 {
        let r = tcp_hello(env.cluster.client_ns(), ssh, T).expect("ssh after the claim");
        assert_eq!(r.server, "sshd", "the Service took the node's SSH");
    }
    let log = env.log(1);
    assert!(
        log.contains("address claim refused") && log.contains("listens"),
        "no warning in the log:\n{log}"
    );
    let m = env.metrics(1);
    let refused = metric_value(&m, "kubeproxy_rs_refused_claims_total").unwrap_or(0.0);
    assert!(
        refused >= 1.0,
        "kubeproxy_rs_refused_claims_total = {refused}\n{m}"
    );
}

#[test]
fn node_ssh_survives_an_external_ip_claim_nftables() {
    node_ssh_survives_an_external_ip_claim("nftables");
}

#[test]
fn node_ssh_survives_an_external_ip_claim_iptables() {
    node_ssh_survives_an_external_ip_claim("iptables");
}

/// At `-v=9` (everything at trace, HTTP and TLS libraries included) against
/// the real kube-apiserver over TLS, the proxy's bearer token appears
/// nowhere in its logs, while they do show its API traffic.
#[test]
fn bearer_token_is_never_logged() {
    let mode = "api/nftables";
    if !conformance::binaries_for(mode) {
        return;
    }
    let mut env = Env::new("tokenlog", mode);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    env.put("svc", &service("t", &["10.96.8.30"], json!({})));
    env.put("eps", &slice("t", "1", "IPv4", &ready(&[&a])));
    let args: Vec<String> = env
        .proxy_args(1, &[])
        .into_iter()
        .map(|a| {
            if a.starts_with("-v=") {
                "-v=9".into()
            } else {
                a
            }
        })
        .collect();
    assert!(args.iter().any(|a| a == "-v=9"), "{args:?}");
    let _proxy = env.spawn(1, &Env::binary(), &args, "node1.log");
    env.wait_tcp(client.ns(), sa("10.96.8.30", 80));
    let kubeconfig = std::fs::read_to_string(&env.api().kubeconfig).unwrap();
    let token = kubeconfig
        .lines()
        .find_map(|l| l.trim().strip_prefix("token:"))
        .map(|t| t.trim().trim_matches('"').to_string())
        .expect("the proxy's kubeconfig holds a bearer token");
    assert!(token.len() > 20, "{token}");
    assert!(env.api().kubeconfig.exists());
    let log = env.log(1);
    assert!(
        log.lines().count() > 200,
        "only {} log lines",
        log.lines().count()
    );
    // Verbose for real: the source traces every response's headers
    // (kube-apiserver's audit-id), the TLS library its handshakes.
    assert!(
        log.contains("TRACE kp_source") && log.contains("audit-id") && log.contains("rustls"),
        "no trace of the API traffic at -v=9"
    );
    for (what, needle) in [
        ("the token", token.as_str()),
        ("the token's first 16 characters", &token[..16]),
        ("its last 16", &token[token.len() - 16..]),
    ] {
        assert!(
            !log.contains(needle),
            "{what} appears in the proxy's log at -v=9"
        );
    }
}
