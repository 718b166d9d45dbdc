//! The conformance suite in nftables mode with socket load balancing
//! (`--socket-lb`): each node's namespace and pods are in that node's
//! cgroup, where its proxy's programs balance their sockets.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("nftables-socketlb");

#[test]
fn c04b_session_affinity_lifecycle() {
    conformance::session_affinity_lifecycle("nftables-socketlb");
}

// Cases only this mode has.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use conformance::{ready, sa, service, slice, Env, T};
use kp_netlab::TestCgroup;

const MODE: &str = "nftables-socketlb";

/// Runs `f` in namespace `ns` on a thread outside every test cgroup (what a
/// process the programs do not see does).
fn outside<R: Send>(ns: &str, f: impl FnOnce() -> R + Send) -> R {
    TestCgroup::new()
        .expect("a cgroup without programs")
        .run_in_netns(ns, f)
        .expect("a thread outside the test cgroups")
}

/// conntrack entries in node `node`'s namespace whose original destination
/// is `ip` (stdout only: the count goes to stderr).
fn conntrack_to(env: &Env, node: usize, ip: &str) -> Vec<String> {
    env.on_node(node, &["conntrack", "-L", "-d", ip])
        .lines()
        .map(String::from)
        .collect()
}

fn tcp_connect(ns: &str, to: SocketAddr) -> TcpStream {
    kp_netlab::in_netns(ns, || TcpStream::connect_timeout(&to, T))
        .expect("entering the namespace")
        .unwrap_or_else(|e| panic!("connecting to {to}: {e}"))
}

fn first_line(s: &TcpStream) -> String {
    s.set_read_timeout(Some(T)).unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    line
}

#[test]
fn s01_clusterip_traffic_makes_no_conntrack_entry_and_names_the_service() {
    let mut env = Env::new("socklb-ct", MODE);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    env.put(
        "svc",
        &service("web", &["10.96.0.10"], serde_json::json!({})),
    );
    env.put("eps", &slice("web", "1", "IPv4", &ready(&[&a])));
    env.start_all();
    let vip = sa("10.96.0.10", 80);
    env.wait_tcp(client.ns(), vip);
    env.on_node(1, &["conntrack", "-F"]);

    // TCP: getpeername says the Service; the node tracked the flow to the
    // pod (so conntrack is on there), and nothing to the Service address.
    let s = tcp_connect(client.ns(), vip);
    assert!(first_line(&s).starts_with("a "));
    assert_eq!(s.peer_addr().unwrap(), vip, "getpeername");
    assert!(
        !conntrack_to(&env, 1, &a.ip().to_string()).is_empty(),
        "no flow to the pod was tracked"
    );
    assert_eq!(conntrack_to(&env, 1, "10.96.0.10"), Vec::<String>::new());

    // UDP on an unconnected socket: the reply comes from the Service address.
    let dns = sa("10.96.0.10", 53);
    let u = kp_netlab::in_netns(client.ns(), || UdpSocket::bind("0.0.0.0:0"))
        .unwrap()
        .unwrap();
    u.set_read_timeout(Some(T)).unwrap();
    u.send_to(b"hi", dns).unwrap();
    let mut buf = [0u8; 256];
    let (n, from) = u.recv_from(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("a "));
    assert_eq!(from, dns, "UDP reply source");
    assert_eq!(conntrack_to(&env, 1, "10.96.0.10"), Vec::<String>::new());

    // A process outside the cgroup is not balanced by the programs: it
    // still reaches the Service, through nftables (and its DNAT entry).
    let r = outside(client.ns(), || TcpStream::connect_timeout(&vip, T));
    let s2 = r.expect("TCP from outside the cgroup, through nftables");
    assert!(first_line(&s2).starts_with("a "));
    assert!(
        !conntrack_to(&env, 1, "10.96.0.10").is_empty(),
        "the connection from outside the cgroup did not go through nftables"
    );
    drop((s, s2));
}

#[test]
fn s02_a_killed_proxy_leaves_balancing_in_place_and_its_successor_adopts_it() {
    let mut env = Env::new("socklb-kill", MODE);
    let a = env.pod(1, "a");
    let b = env.pod(2, "b");
    let client = env.pod(1, "client");
    env.put(
        "svc",
        &service("web", &["10.96.0.20"], serde_json::json!({})),
    );
    env.put("eps", &slice("web", "1", "IPv4", &ready(&[&a])));
    env.start_all();
    let vip = sa("10.96.0.20", 80);
    env.wait_tcp(client.ns(), vip);

    // Connections go on, one every 20 ms, through the kill and the restart.
    let stop = AtomicBool::new(false);
    let (ok, failed) = (AtomicUsize::new(0), AtomicUsize::new(0));
    std::thread::scope(|sc| {
        sc.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                match kp_netlab::tcp_hello(client.ns(), vip, T) {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        });
        env.kill(1);
        env.on_node(1, &["conntrack", "-F"]);
        std::thread::sleep(std::time::Duration::from_millis(500));
        // No proxy runs: the pinned programs and maps still balance.
        assert_eq!(conntrack_to(&env, 1, "10.96.0.20"), Vec::<String>::new());
        env.start(1, &[]);
        env.wait_synced(1);
        std::thread::sleep(std::time::Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
    });
    assert!(
        env.log(1).contains("adopted=true"),
        "the restarted proxy did not adopt the pinned programs"
    );
    let (ok, failed) = (ok.into_inner(), failed.into_inner());
    assert!(ok > 20, "only {ok} connections");
    assert_eq!(failed, 0, "{failed} of {} connections failed", ok + failed);
    assert_eq!(conntrack_to(&env, 1, "10.96.0.20"), Vec::<String>::new());

    // The adopted maps are kept up to date: b replaces a.
    env.put("eps", &slice("web", "1", "IPv4", &ready(&[&b])));
    env.wait("the socket balancer to send to b", || {
        kp_netlab::tcp_hello(client.ns(), vip, T).is_ok_and(|r| r.server == "b")
    });
    assert_eq!(conntrack_to(&env, 1, "10.96.0.20"), Vec::<String>::new());

    // --cleanup detaches the programs: the Service goes through nftables
    // again until the proxy... is gone too, with its rules.
    env.kill(1);
    env.run_cleanup(1);
    let pins = env.socket_lb.as_ref().unwrap().fs.path().join("node1");
    assert!(
        !pins.exists(),
        "pins left after --cleanup: {}",
        pins.display()
    );
    assert!(kp_netlab::tcp_hello(client.ns(), vip, T).is_err());
}

/// Runs the binary in a network namespace of its own (`unshare -n`): a
/// mistake here must not reach the host's firewall.
fn run_binary(args: &[&str]) -> std::process::Output {
    std::process::Command::new("unshare")
        .arg("-n")
        .arg(Env::binary())
        .args(args)
        .output()
        .expect("running kube-proxy-rs")
}

#[test]
fn s03_dry_run_prints_the_maps_and_bad_setups_are_refused_with_the_reason() {
    let dir = std::env::temp_dir().join(format!("kp-socklb-dry-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svc = service("web", &["10.96.0.30"], serde_json::json!({}));
    // ClientIP affinity is left to nftables: no entry in the maps.
    let sticky = service(
        "sticky",
        &["10.96.0.31"],
        serde_json::json!({"sessionAffinity": "ClientIP"}),
    );
    std::fs::write(
        dir.join("sticky.json"),
        serde_json::to_vec(&sticky).unwrap(),
    )
    .unwrap();
    std::fs::write(dir.join("svc.json"), serde_json::to_vec(&svc).unwrap()).unwrap();
    let eps = serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "web-1", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["10.244.1.2"], "conditions": {"ready": true}}]
    });
    std::fs::write(dir.join("eps.json"), serde_json::to_vec(&eps).unwrap()).unwrap();
    let mut sticky_eps = eps.clone();
    sticky_eps["metadata"]["name"] = "sticky-1".into();
    sticky_eps["metadata"]["labels"]["kubernetes.io/service-name"] = "sticky".into();
    std::fs::write(
        dir.join("sticky-eps.json"),
        serde_json::to_vec(&sticky_eps).unwrap(),
    )
    .unwrap();
    let manifests = format!("--manifests={}", dir.display());
    let out = run_binary(&[
        &manifests,
        "--proxy-mode=nftables",
        "--hostname-override=node1",
        "--dry-run",
        "--socket-lb",
    ]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("table ip kube-proxy-rs"),
        "no nftables rules:\n{text}"
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("10.96.0.30:80/TCP"))
        .unwrap_or_else(|| panic!("no socket balancing entry:\n{text}"));
    assert!(line.contains("-> 10.244.1.2:8080"), "{line}");
    assert!(
        !text.lines().any(|l| l.starts_with("10.96.0.31:")),
        "a Service with session affinity in the maps:\n{text}"
    );
    assert!(
        text.contains("10.96.0.31"),
        "the Service with session affinity is not in the nftables rules:\n{text}"
    );

    let out = run_binary(&["--proxy-mode=iptables", "--socket-lb", &manifests]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--socket-lb"));

    // Not a cgroup v2 directory: refused before anything is attached.
    let out = run_binary(&[
        &manifests,
        "--proxy-mode=nftables",
        "--socket-lb",
        "--cgroup-path=/tmp",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a cgroup v2 directory"), "{err}");
}

#[test]
fn s04_external_addresses_and_local_nodeports_are_balanced_at_the_socket_too() {
    let mut env = Env::new("socklb-ext", MODE);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    let spec = |ranges: serde_json::Value| {
        serde_json::json!({"type": "LoadBalancer", "externalIPs": ["203.0.113.10"],
            "externalTrafficPolicy": "Local", "loadBalancerSourceRanges": ranges,
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30081}]})
    };
    let with_lb = |svc: serde_json::Value, ip: &str| {
        let mut svc = svc;
        svc["status"] = serde_json::json!({"loadBalancer": {"ingress": [{"ip": ip}]}});
        svc
    };
    env.put(
        "svc",
        &with_lb(
            service("ext", &["10.96.0.40"], spec(serde_json::json!([]))),
            "203.0.113.20",
        ),
    );
    // The endpoint is on node 2: with eTP=Local, node 1 has none for
    // outside clients, but a client on node 1 is short-circuited to the
    // cluster endpoints, as upstream does.
    let b = env.pod(2, "b");
    env.put("eps", &slice("ext", "1", "IPv4", &ready(&[&b])));
    let _ = a;
    env.start_all();
    let node1 = env.cluster.node_ip(1).to_string();
    let targets = [
        sa("203.0.113.10", 80),
        sa("203.0.113.20", 80),
        sa(&node1, 30081),
    ];
    for t in targets {
        env.wait_tcp(client.ns(), t);
    }
    env.on_node(1, &["conntrack", "-F"]);
    for t in targets {
        let r = kp_netlab::tcp_hello(client.ns(), t, T).unwrap_or_else(|e| panic!("{t}: {e}"));
        assert_eq!(r.server, "b", "{t}");
        let entries = conntrack_to(&env, 1, &t.ip().to_string());
        assert_eq!(entries, Vec::<String>::new(), "{t} went through NAT");
    }
    // With loadBalancerSourceRanges the LB IP stays with nftables, which
    // checks the source: this pod is not in the ranges, so it is dropped
    // there (a socket hook would have let it through). The externalIP is
    // still balanced at the socket.
    env.put(
        "svc",
        &with_lb(
            service(
                "ext",
                &["10.96.0.40"],
                spec(serde_json::json!(["10.100.0.100/32"])),
            ),
            "203.0.113.20",
        ),
    );
    env.wait(
        "the LB IP to refuse a pod outside its source ranges",
        || kp_netlab::tcp_hello(client.ns(), sa("203.0.113.20", 80), T).is_err(),
    );
    env.on_node(1, &["conntrack", "-F"]);
    kp_netlab::tcp_hello(client.ns(), sa("203.0.113.10", 80), T).unwrap();
    assert_eq!(conntrack_to(&env, 1, "203.0.113.10"), Vec::<String>::new());
}
