//! The conformance suite in userspace mode: the shared cases that apply to a
//! proxy in userspace (real sockets in network namespaces), plus this mode's
//! own versions of the cases whose kernel-mode expectations cannot hold here
//! (the proxy's own address replaces the client's; connections live in the
//! proxy process) and its extra capabilities (retry on refusal, least
//! connections, grace period, unprivileged operation).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

use conformance::*;
use kp_netlab::{tcp_hello, tcp_hello_many, tcp_hold, udp_ask};
use serde_json::json;

const MODE: &str = "userspace";

#[test]
fn c02_nodeport() {
    conformance::nodeport(MODE);
}
#[test]
fn c03_external_and_lb() {
    conformance::external_and_lb(MODE);
}
#[test]
fn c04_session_affinity() {
    conformance::session_affinity(MODE);
}
#[test]
fn c05_no_endpoints() {
    conformance::no_endpoints(MODE);
}
#[test]
fn c07_internal_policy_local() {
    conformance::internal_policy_local(MODE);
}
#[test]
fn c08_masquerade_and_hairpin() {
    conformance::masquerade_and_hairpin(MODE);
}
#[test]
fn c09_terminating_fallback() {
    conformance::terminating_fallback(MODE);
}
#[test]
fn c10_endpoint_removal() {
    conformance::endpoint_removal(MODE);
}
#[test]
fn c13_ipv6_clusterip() {
    conformance::ipv6_clusterip(MODE);
}
#[test]
fn c14_localhost_nodeport() {
    conformance::localhost_nodeport(MODE);
}
#[test]
fn c15_udp_before_endpoints() {
    conformance::udp_before_endpoints(MODE);
}

// ---------------------------------------------------------------------------
// This mode's own cases
// ---------------------------------------------------------------------------

fn counts(
    replies: &[Result<kp_netlab::Reply, kp_netlab::ConnError>],
) -> std::collections::BTreeMap<String, usize> {
    let mut m = std::collections::BTreeMap::new();
    for r in replies.iter().flatten() {
        *m.entry(r.server.clone()).or_default() += 1;
    }
    m
}

fn lo_addrs(env: &Env, node: usize) -> String {
    env.on_node(node, &["ip", "addr", "show", "dev", "lo"])
}

/// Case 1 in this mode: ClusterIP TCP and UDP from a pod, the node and the
/// other node; round robin gives each of three endpoints exactly a third;
/// endpoints see the proxy's (node's) address; per-Service metrics count.
#[test]
fn u01_clusterip_round_robin_and_metrics() {
    let mut env = Env::new("us-clusterip", MODE);
    let a = env.pod(1, "a");
    let b = env.pod(1, "b");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    env.put("svc", &service("web", &["10.96.0.10"], json!({})));
    env.put("eps", &slice("web", "1", "IPv4", &ready(&[&a, &b, &c])));
    env.start_all();
    let vip = sa("10.96.0.10", 80);
    env.wait_tcp(client.ns(), vip);
    let replies = tcp_hello_many(client.ns(), vip, 300, T);
    assert!(
        replies.iter().all(|r| r.is_ok()),
        "failed connections: {:?}",
        replies.iter().find(|r| r.is_err())
    );
    let n = counts(&replies);
    assert_eq!(
        n.values().copied().collect::<Vec<_>>(),
        vec![100, 100, 100],
        "round robin is not exact: {n:?}"
    );
    // A proxy, not NAT: the endpoint sees node1's address.
    for r in replies.iter().flatten() {
        assert_eq!(r.peer.ip(), env.cluster.node_ip(1), "{r:?}");
    }
    env.wait_tcp(env.cluster.node_ns(1), vip);
    env.wait_tcp(env.cluster.node_ns(2), vip);
    let dns = sa("10.96.0.10", 53);
    env.wait("UDP from a pod", || udp_ask(client.ns(), dns, T).is_ok());
    env.wait("UDP from node2", || {
        udp_ask(env.cluster.node_ns(2), dns, T).is_ok()
    });
    assert!(lo_addrs(&env, 1).contains("10.96.0.10/32"));
    let want = [
        // The hello clients only read; the UDP ones send too.
        r#"kubeproxy_rs_userspace_bytes_total{service="default/web:dns",direction="in"}"#,
        r#"kubeproxy_rs_userspace_bytes_total{service="default/web:http",direction="out"}"#,
        r#"kubeproxy_rs_userspace_active_connections{service="default/web:http"} 0"#,
        r#"kubeproxy_rs_userspace_bytes_total{service="default/web:dns",direction="out"}"#,
    ];
    let ok = kp_netlab::wait_until(SYNC_WAIT, POLL, || {
        let m = env.metrics(1);
        want.iter().all(|w| m.contains(w))
    });
    let m = env.metrics(1);
    let ours: Vec<&str> = m.lines().filter(|l| l.contains("userspace")).collect();
    assert!(
        ok,
        "missing per-Service metrics; have:\n{}",
        ours.join("\n")
    );
}

/// Case 6 in this mode: externalTrafficPolicy=Local. External clients reach
/// only nodes with a local endpoint (the others refuse); pods still reach
/// the Service through any node (upstream's short-circuit); the health check
/// node port answers 200/503. The client IP is not preserved (a proxy).
#[test]
fn u06_external_policy_local() {
    let mut env = Env::new("us-etplocal", MODE);
    let a = env.pod(1, "a");
    let client2 = env.pod(2, "client2");
    let svc = service(
        "loc",
        &["10.96.0.60"],
        json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 32100,
               "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30060}]}),
    );
    env.put("svc", &svc);
    env.put("eps", &slice("loc", "1", "IPv4", &ready(&[&a])));
    env.start_all();
    let cl = env.cluster.client_ns().to_string();
    let r = env.wait_tcp(&cl, sa("10.100.0.11", 30060));
    assert_eq!(r.server, "a");
    assert_eq!(r.peer.ip(), env.cluster.node_ip(1));
    let r = env.wait_tcp(client2.ns(), sa("10.100.0.12", 30060));
    assert_eq!(r.server, "a", "a pod's traffic was not short-circuited");
    let r = tcp_hello(&cl, sa("10.100.0.12", 30060), T);
    assert!(r.is_err(), "node without local endpoint answered: {r:?}");
    env.wait("health check 200 on node1", || {
        http_get(&cl, sa("10.100.0.11", 32100), "/")
            .is_some_and(|(s, b)| s == 200 && b.contains("\"localEndpoints\":1"))
    });
    env.wait("health check 503 on node2", || {
        http_get(&cl, sa("10.100.0.12", 32100), "/").is_some_and(|(s, _)| s == 503)
    });
}

/// Case 11 in this mode: deleting a Service closes its port and removes its
/// IP from lo; `--cleanup` removes the addresses a killed proxy left, and
/// leaves an address someone else put on lo.
#[test]
fn u11_delete_and_cleanup() {
    let mut env = Env::new("us-cleanup", MODE);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    env.cluster
        .exec_ok(
            env.cluster.node_ns(1),
            &["ip", "addr", "add", "10.96.0.199/32", "dev", "lo"],
        )
        .unwrap();
    env.put("svc", &service("gone", &["10.96.0.110"], json!({})));
    env.put("eps", &slice("gone", "1", "IPv4", &ready(&[&a])));
    env.start(1, &[]);
    let vip = sa("10.96.0.110", 80);
    env.wait_tcp(client.ns(), vip);
    assert!(lo_addrs(&env, 1).contains("10.96.0.110/32"));
    env.remove("svc");
    env.remove("eps");
    env.wait("the Service IP to leave lo", || {
        !lo_addrs(&env, 1).contains("10.96.0.110/32")
    });
    assert!(tcp_hello(client.ns(), vip, T).is_err());
    env.put("svc", &service("gone", &["10.96.0.110"], json!({})));
    env.put("eps", &slice("gone", "1", "IPv4", &ready(&[&a])));
    env.wait_tcp(client.ns(), vip);
    env.kill(1);
    assert!(lo_addrs(&env, 1).contains("10.96.0.110/32"));
    env.run_cleanup(1);
    let lo = lo_addrs(&env, 1);
    assert!(
        !lo.contains("10.96.0.110"),
        "--cleanup left our address:\n{lo}"
    );
    assert!(
        lo.contains("10.96.0.199/32"),
        "--cleanup removed an address that was not ours:\n{lo}"
    );
    // Switching the node to another mode removes our addresses too.
    env.start(1, &[]);
    env.wait_tcp(client.ns(), vip);
    env.kill(1);
    assert!(lo_addrs(&env, 1).contains("10.96.0.110/32"));
    let args = replace_arg(
        env.proxy_args(1, &[]),
        "--proxy-mode=",
        "--proxy-mode=nftables",
    );
    let _nft = env.spawn(1, &Env::binary(), &args, "node1-nft.log");
    env.wait("nftables mode to remove userspace addresses", || {
        !lo_addrs(&env, 1).contains("10.96.0.110")
    });
    // ...and nftables mode now serves the Service.
    env.wait_tcp(client.ns(), vip);
    assert!(lo_addrs(&env, 1).contains("10.96.0.199/32"));
}

/// Case 12 in this mode: endpoint changes keep established connections to
/// endpoints that stay; a removed endpoint's connections live through the
/// grace period and are then closed. (A SIGKILLed proxy takes its
/// connections with it: unlike the kernel modes, this one holds them.)
#[test]
fn u12_endpoint_changes_and_grace_period() {
    let mut env = Env::new("us-grace", MODE);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    env.put("svc", &service("keep", &["10.96.0.120"], json!({})));
    env.put("eps", &slice("keep", "1", "IPv4", &ready(&[&c])));
    env.start(1, &["--userspace-grace-period=6s"]);
    let vip = sa("10.96.0.120", 80);
    env.wait_tcp(client.ns(), vip);
    let mut held = tcp_hold(client.ns(), vip, T).unwrap();
    assert_eq!(held.exchange("one", T).unwrap(), "c one");
    // c stays, a joins: the connection to c is untouched.
    env.put("eps", &slice("keep", "1", "IPv4", &ready(&[&c, &a])));
    env.wait("a to get connections", || {
        tcp_hello(client.ns(), vip, T).is_ok_and(|r| r.server == "a")
    });
    assert_eq!(held.exchange("two", T).unwrap(), "c two");
    // c goes: new connections avoid it at once, the held one has its grace period.
    env.put("eps", &slice("keep", "1", "IPv4", &ready(&[&a])));
    env.wait("c to leave the Service", || {
        counts(&tcp_hello_many(client.ns(), vip, 6, T))
            .keys()
            .collect::<Vec<_>>()
            == vec!["a"]
    });
    let removed = std::time::Instant::now();
    assert_eq!(held.exchange("three", T).unwrap(), "c three");
    env.wait("the grace period to end the connection to c", || {
        held.exchange("ping", T).is_err()
    });
    assert!(
        removed.elapsed() >= std::time::Duration::from_secs(2),
        "closed after {:?}, before the grace period",
        removed.elapsed()
    );
    // A restarted proxy serves again (its old connections died with it).
    env.kill(1);
    assert!(tcp_hello(client.ns(), vip, T).is_err());
    env.start(1, &[]);
    env.wait_tcp(client.ns(), vip);
}

/// A refusing endpoint, or one that does not answer within the connect
/// timeout, costs the client nothing: the proxy tries the next one (kernel
/// modes would fail every connection sent there). Errors are counted per
/// Service.
#[test]
fn u15_retry_on_refusal() {
    let mut env = Env::new("us-retry", MODE);
    let a = env.pod(1, "a");
    // A pod with no server: connections to it are refused.
    let dead = env.cluster.add_pod(1, "dead").unwrap();
    let client = env.pod(1, "client");
    env.put("svc", &service("retry", &["10.96.0.150"], json!({})));
    let mut eps = slice("retry", "1", "IPv4", &ready(&[&a, &dead]));
    // And an address nobody has: its connects time out.
    eps["endpoints"].as_array_mut().unwrap().push(json!({
        "addresses": ["10.244.1.250"], "nodeName": "node1",
        "conditions": {"ready": true, "serving": true, "terminating": false}
    }));
    env.put("eps", &eps);
    env.start(1, &["--userspace-connect-timeout=300ms"]);
    let vip = sa("10.96.0.150", 80);
    env.wait_tcp(client.ns(), vip);
    let replies = tcp_hello_many(client.ns(), vip, 30, T);
    assert!(
        replies
            .iter()
            .all(|r| r.as_ref().is_ok_and(|r| r.server == "a")),
        "{replies:?}"
    );
    env.wait("errors counted", || {
        env.metrics(1).lines().any(|l| {
            l.starts_with(r#"kubeproxy_rs_userspace_errors_total{service="default/retry:http"}"#)
                && l.rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .is_some_and(|v| v >= 10.0)
        })
    });
}

/// --userspace-balancer=least-connections: while one connection is held
/// open to an endpoint, every new connection goes to the idle one.
#[test]
fn u16_least_connections() {
    let mut env = Env::new("us-lc", MODE);
    let a = env.pod(1, "a");
    let b = env.pod(1, "b");
    let client = env.pod(1, "client");
    env.put("svc", &service("lc", &["10.96.0.160"], json!({})));
    env.put("eps", &slice("lc", "1", "IPv4", &ready(&[&a, &b])));
    env.start(1, &["--userspace-balancer=least-connections"]);
    let vip = sa("10.96.0.160", 80);
    env.wait_tcp(client.ns(), vip);
    let held = tcp_hold(client.ns(), vip, T).unwrap();
    let busy = held.greeting().server.clone();
    let one_open = r#"kubeproxy_rs_userspace_active_connections{service="default/lc:http"} 1"#;
    for i in 0..8 {
        // The previous short connection has finished in the proxy: only the
        // held one is open.
        env.wait("one open connection", || env.metrics(1).contains(one_open));
        let r = tcp_hello(client.ns(), vip, T).unwrap();
        assert_ne!(r.server, busy, "connection {i} went to the busy endpoint");
    }
    drop(held);
}

/// Without CAP_NET_ADMIN (run as nobody) the proxy adds no address: NodePorts
/// work, ClusterIPs are not taken over.
#[test]
fn u17_unprivileged_nodeports_only() {
    let mut env = Env::new("us-nobody", MODE);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    let svc = service(
        "np",
        &["10.96.0.170"],
        json!({"type": "NodePort", "ports": [
            {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30170},
            {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8080, "nodePort": 30171}]}),
    );
    env.put("svc", &svc);
    env.put("eps", &slice("np", "1", "IPv4", &ready(&[&a])));
    let mut args: Vec<String> = vec![
        "--reuid=65534".into(),
        "--regid=65534".into(),
        "--clear-groups".into(),
        Env::binary().display().to_string(),
    ];
    args.extend(env.proxy_args(1, &[]));
    let _proxy = env.spawn(
        1,
        std::path::Path::new("/usr/bin/setpriv"),
        &args,
        "node1.log",
    );
    let cl = env.cluster.client_ns().to_string();
    let r = env.wait_tcp(&cl, sa("10.100.0.11", 30170));
    assert_eq!(r.server, "a");
    env.wait("UDP NodePort", || {
        udp_ask(&cl, sa("10.100.0.11", 30171), T).is_ok()
    });
    assert!(tcp_hello(client.ns(), sa("10.96.0.170", 80), T).is_err());
    assert!(!lo_addrs(&env, 1).contains("10.96.0.170"));
    assert!(env.log(1).contains("not taken over"), "{}", env.log(1));
}

/// Someone deletes our Service IP from lo: detected at the next sync,
/// counted (kubeproxy_rs_rules_lost_total) and put back.
#[test]
fn u18_lost_address_repaired() {
    let mut env = Env::new("us-lost", MODE);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    env.put("svc", &service("lost", &["10.96.0.180"], json!({})));
    env.put("eps", &slice("lost", "1", "IPv4", &ready(&[&a])));
    // The default test sync period (10 s) bounds the repair time.
    env.start(1, &[]);
    let vip = sa("10.96.0.180", 80);
    env.wait_tcp(client.ns(), vip);
    env.cluster
        .exec_ok(
            env.cluster.node_ns(1),
            &["ip", "addr", "del", "10.96.0.180/32", "dev", "lo"],
        )
        .unwrap();
    assert!(!lo_addrs(&env, 1).contains("10.96.0.180/32"));
    env.wait("the address to be put back", || {
        lo_addrs(&env, 1).contains("10.96.0.180/32")
    });
    env.wait_tcp(client.ns(), vip);
    env.wait("the loss to be counted", || {
        env.metrics(1)
            .contains(r#"kubeproxy_rs_rules_lost_total{ip_family="IPv4"} 1"#)
    });
}

/// The descriptor numbers process `pid` holds.
fn fds(pid: u32) -> Vec<usize> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Fd exhaustion (an accept storm past RLIMIT_NOFILE): the running proxy's
/// limit is lowered to 24 above its highest descriptor, then 300 clients connect and
/// stay (the kernel completes their handshakes in the listen backlog), so
/// `accept` fails with EMFILE. The proxy survives, counts the failures in
/// kubeproxy_rs_userspace_errors at the pace of its 50 ms back-off (not a
/// spinning loop), warns without flooding its log, and serves again once the
/// clients leave.
#[test]
fn u19_accept_storm_past_rlimit_nofile() {
    let mut env = Env::new("us-fdstorm", MODE);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    env.put("svc", &service("storm", &["10.96.0.190"], json!({})));
    env.put("eps", &slice("storm", "1", "IPv4", &ready(&[&a])));
    let proxy = env.spawn(1, &Env::binary(), &env.proxy_args(1, &[]), "node1.log");
    let vip = sa("10.96.0.190", 80);
    assert_eq!(env.wait_tcp(client.ns(), vip).server, "a");
    // The limit bounds numbers, not the count: one set from the count alone
    // can sit below a descriptor opened earlier, and the storm then fills
    // every free number under it.
    let limit = fds(proxy.pid()).into_iter().max().unwrap_or(0) + 1 + 24;
    let out = std::process::Command::new("prlimit")
        .args([
            "--pid",
            &proxy.pid().to_string(),
            &format!("--nofile={limit}:{limit}"),
        ])
        .output()
        .expect("running prlimit");
    assert!(out.status.success(), "prlimit: {out:?}");

    let storm_started = std::time::Instant::now();
    let held: Vec<std::net::TcpStream> = kp_netlab::in_netns(client.ns(), || {
        (0..300)
            .filter_map(|_| std::net::TcpStream::connect_timeout(&vip, T).ok())
            .collect()
    })
    .unwrap();
    assert!(held.len() >= 250, "only {} connections opened", held.len());
    env.wait("accept to fail for want of descriptors", || {
        env.log(1).contains("Too many open files")
    });
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert!(proxy.is_running(), "the proxy died in the storm");
    assert!(
        fds(proxy.pid()).len() <= limit,
        "more descriptors than the limit"
    );
    drop(held);

    // Served again, and the failures were counted.
    assert_eq!(env.wait_tcp(client.ns(), vip).server, "a");
    let errors = || {
        env.metrics(1)
            .lines()
            .find(|l| {
                l.starts_with(
                    r#"kubeproxy_rs_userspace_errors_total{service="default/storm:http"}"#,
                )
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    env.wait("the failed accepts counted", || errors() >= 1.0);
    // At most one failed accept per 50 ms back-off, plus at most one failed
    // endpoint connect per client (accepted, then no descriptor left for
    // the connection to the endpoint); a spinning loop would count
    // thousands a second.
    let (count, elapsed) = (errors(), storm_started.elapsed());
    let bound = 300.0 + elapsed.as_secs_f64() * 20.0 * 2.0 + 50.0;
    assert!(
        count <= bound,
        "{count} errors in {elapsed:?}: the accept loop is not backing off"
    );
    let warned = env.log(1).matches("accept failed").count();
    assert!(
        warned <= 10,
        "{warned} 'accept failed' warnings in {elapsed:?}: the log is flooded"
    );
    drop(proxy);
}
