//! Real-kernel tests of the lab itself (root required; no proxy involved).

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use kp_netlab::{
    in_netns, netns_exists, tcp_hello, tcp_hello_from, tcp_hello_many, tcp_hold, udp_ask,
    udp_session, wait_until, Cluster, ClusterOpts, ConnError, LabError, Pod, ServeSpec,
};

const T: Duration = Duration::from_secs(3);

fn two_by_two(test: &str) -> (Cluster, Vec<Pod>) {
    let c = Cluster::new(test, ClusterOpts::default()).unwrap();
    let pods = vec![
        c.add_pod(1, "a").unwrap(),
        c.add_pod(1, "b").unwrap(),
        c.add_pod(2, "c").unwrap(),
        c.add_pod(2, "d").unwrap(),
    ];
    (c, pods)
}

#[test]
fn addresses_follow_the_documented_plan() {
    let (c, p) = two_by_two("addresses");
    assert_eq!(c.node_ip(1), "10.100.0.11".parse::<IpAddr>().unwrap());
    assert_eq!(c.node_ip6(2), "fd00:100::12".parse::<IpAddr>().unwrap());
    assert_eq!(c.client_ip(), "10.100.0.100".parse::<IpAddr>().unwrap());
    assert_eq!(c.client_ip6(), "fd00:100::100".parse::<IpAddr>().unwrap());
    assert_eq!(p[0].ip(), "10.244.1.2".parse::<IpAddr>().unwrap());
    assert_eq!(p[1].ip(), "10.244.1.3".parse::<IpAddr>().unwrap());
    assert_eq!(p[2].ip6(), "fd00:244:2::2".parse::<IpAddr>().unwrap());
    assert_eq!(c.pod_cidr(2).to_string(), "10.244.2.0/24");
    assert_eq!(c.pod_cidr6(1).to_string(), "fd00:244:1::/64");
    for pod in &p {
        assert!(c.pod_cidr(pod.node()).contains(&pod.ip()));
        assert!(c.pod_cidr6(pod.node()).contains(&pod.ip6()));
    }
    // What the kernel really has, not just what the accessors claim.
    let addrs = c
        .exec_ok(p[2].ns(), &["ip", "-o", "addr", "show", "dev", "eth0"])
        .unwrap();
    assert!(addrs.contains("10.244.2.2/32"), "{addrs}");
    assert!(addrs.contains("fd00:244:2::2/128"), "{addrs}");
    let fwd = c
        .exec_ok(
            c.node_ns(1),
            &[
                "sysctl",
                "-n",
                "net.ipv4.ip_forward",
                "net.ipv6.conf.all.forwarding",
            ],
        )
        .unwrap();
    assert_eq!(fwd.split_whitespace().collect::<Vec<_>>(), ["1", "1"]);
    assert_eq!(c.all_namespaces().len(), 1 + 2 + 1 + 4);
    assert!(c
        .all_namespaces()
        .iter()
        .all(|n| n.starts_with(c.prefix()) && netns_exists(n)));
    // Nothing of ours may appear in the root namespace.
    let root_links = std::process::Command::new("ip")
        .args(["-o", "link"])
        .output()
        .unwrap();
    let root_links = String::from_utf8_lossy(&root_links.stdout);
    assert!(!root_links.contains("kpv"), "{root_links}");
}

/// Past 89 nodes the LAN widens to 10.100.0.0/16 (nodes 90.. in
/// 10.100.1.0/24 and on), past 255 the pods leave 10.244.0.0/16; the first
/// nodes keep their addresses, and a pod on the last node reaches a pod on
/// the first and one on node 90 through the pod routes.
#[test]
fn wide_labs_number_past_89_and_255_nodes() {
    let c = Cluster::new("wide", ClusterOpts::with_nodes(300)).unwrap();
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    assert_eq!(c.node_ip(1), ip("10.100.0.11"));
    assert_eq!(c.node_ip(89), ip("10.100.0.99"));
    assert_eq!(c.node_ip(90), ip("10.100.1.1"));
    assert_eq!(c.node_ip(300), ip("10.100.1.211"));
    assert_eq!(c.node_ip6(89), ip("fd00:100::69"));
    assert_eq!(c.node_ip6(300), ip("fd00:100::1:12c"));
    assert_eq!(c.lan_cidr().to_string(), "10.100.0.0/16");
    assert_eq!(c.pod_cidr(255).to_string(), "10.244.255.0/24");
    assert_eq!(c.pod_cidr(300).to_string(), "10.245.44.0/24");
    assert_eq!(c.cluster_cidr().to_string(), "10.244.0.0/14");
    let mut all: Vec<IpAddr> = (1..=300)
        .flat_map(|i| [c.node_ip(i), c.node_ip6(i)])
        .collect();
    all.extend([c.client_ip(), c.client_ip6()]);
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!(
        all.len(),
        n,
        "two nodes (or a node and the client) share an address"
    );
    let addrs = c
        .exec_ok(c.node_ns(300), &["ip", "-o", "addr", "show", "dev", "eth0"])
        .unwrap();
    assert!(addrs.contains("10.100.1.211/16"), "{addrs}");
    let first = c.add_pod(1, "first").unwrap();
    let mid = c.add_pod(90, "mid").unwrap();
    let last = c.add_pod(300, "last").unwrap();
    assert_eq!(last.ip(), ip("10.245.44.2"));
    let _s1 = c
        .serve(first.ns(), "srv-first", ServeSpec::both(&[8080]))
        .unwrap();
    let _s2 = c
        .serve(mid.ns(), "srv-mid", ServeSpec::both(&[8080]))
        .unwrap();
    for (to, name) in [(&first, "srv-first"), (&mid, "srv-mid")] {
        for dst in [to.addr(8080), to.addr6(8080)] {
            let r = tcp_hello(last.ns(), dst, T).unwrap();
            assert_eq!(r.server, name);
            assert_eq!(
                r.peer.ip(),
                if dst.is_ipv4() { last.ip() } else { last.ip6() }
            );
        }
    }
    // A LAN host and every node know each other as permanent neighbours.
    let host = c.add_host("cp", 5).unwrap();
    let neigh = c
        .exec_ok(&host.ns, &["ip", "-4", "neigh", "show", "nud", "permanent"])
        .unwrap();
    assert_eq!(neigh.lines().count(), 300, "{neigh}");
    assert!(
        neigh.contains("10.100.1.211 dev eth0 lladdr 02:6b:0a:64:01:d3"),
        "{neigh}"
    );
    let neigh = c
        .exec_ok(
            c.node_ns(300),
            &["ip", "-4", "neigh", "show", "nud", "permanent"],
        )
        .unwrap();
    assert!(
        neigh.contains("10.100.0.5 dev eth0 lladdr 02:6b:0a:64:00:05"),
        "{neigh}"
    );
    let _sh = c
        .serve(&host.ns, "srv-host", ServeSpec::both(&[7070]))
        .unwrap();
    let r = tcp_hello(c.node_ns(300), SocketAddr::new(host.ip, 7070), T).unwrap();
    assert_eq!(r.server, "srv-host");
    // The client reaches the last node over the wide LAN.
    let _sn = c
        .serve(c.node_ns(300), "srv-node", ServeSpec::both(&[9090]))
        .unwrap();
    let r = tcp_hello(c.client_ns(), SocketAddr::new(c.node_ip(300), 9090), T).unwrap();
    assert_eq!(r.server, "srv-node");
}

#[test]
fn pods_reach_pods_across_nodes_tcp_udp_v4_v6() {
    let (c, p) = two_by_two("pod_to_pod");
    let _sc = c
        .serve(p[2].ns(), "srv-c", ServeSpec::both(&[8080]))
        .unwrap();
    let _sb = c
        .serve(p[1].ns(), "srv-b", ServeSpec::both(&[8080]))
        .unwrap();
    let (a, b, pc) = (&p[0], &p[1], &p[2]);

    for dst in [pc.addr(8080), pc.addr6(8080)] {
        let src = if dst.is_ipv4() { a.ip() } else { a.ip6() };
        let r = tcp_hello(a.ns(), dst, T).unwrap();
        assert_eq!(r.server, "srv-c");
        assert_eq!(r.peer.ip(), src, "pod source must arrive unmodified");
        assert_eq!(r.peer, r.local);
        let r = udp_ask(a.ns(), dst, T).unwrap();
        assert_eq!(r.server, "srv-c");
        assert_eq!(r.peer.ip(), src);
        assert_eq!(r.peer, r.local);
    }
    // Same-node pod to pod, and node to a remote pod (source = node LAN IP).
    assert_eq!(tcp_hello(a.ns(), b.addr(8080), T).unwrap().server, "srv-b");
    assert_eq!(udp_ask(a.ns(), b.addr6(8080), T).unwrap().server, "srv-b");
    let r = tcp_hello(c.node_ns(1), pc.addr(8080), T).unwrap();
    assert_eq!(r.peer.ip(), c.node_ip(1));
    let r = tcp_hello(c.node_ns(2), pc.addr6(8080), T).unwrap();
    assert_eq!(
        r.peer.ip(),
        c.node_ip6(2),
        "local pod traffic must come from the node IP"
    );
}

#[test]
fn external_client_reaches_nodes_but_not_pods() {
    let (c, p) = two_by_two("client");
    let _node = c
        .serve(c.node_ns(1), "node1", ServeSpec::both(&[9000]))
        .unwrap();
    let _pod = c
        .serve(p[0].ns(), "pod-a", ServeSpec::both(&[9000]))
        .unwrap();

    let r = tcp_hello(c.client_ns(), SocketAddr::new(c.node_ip(1), 9000), T).unwrap();
    assert_eq!((r.server.as_str(), r.peer.ip()), ("node1", c.client_ip()));
    let r = udp_ask(c.client_ns(), SocketAddr::new(c.node_ip6(1), 9000), T).unwrap();
    assert_eq!((r.server.as_str(), r.peer.ip()), ("node1", c.client_ip6()));

    assert_eq!(
        tcp_hello(c.client_ns(), p[0].addr(9000), T),
        Err(ConnError::Refused)
    );
    assert!(udp_ask(c.client_ns(), p[0].addr6(9000), T).is_err());

    // An explicit route through node 1 makes the pod reachable.
    c.client_route_via(c.pod_cidr(1), 1).unwrap();
    c.client_route_via(c.pod_cidr6(1), 1).unwrap();
    let r = tcp_hello(c.client_ns(), p[0].addr(9000), T).unwrap();
    assert_eq!((r.server.as_str(), r.peer.ip()), ("pod-a", c.client_ip()));
    let r = udp_ask(c.client_ns(), p[0].addr6(9000), T).unwrap();
    assert_eq!((r.server.as_str(), r.peer.ip()), ("pod-a", c.client_ip6()));
    assert!(c.client_route_via(c.pod_cidr(1), 3).is_err());
}

#[test]
fn closed_ports_are_refused_and_stopped_servers_free_their_ports() {
    let (c, p) = two_by_two("refused");
    let from = p[0].ns();
    assert_eq!(tcp_hello(from, p[2].addr(7000), T), Err(ConnError::Refused));
    assert_eq!(
        tcp_hello(from, p[2].addr6(7000), T),
        Err(ConnError::Refused)
    );
    assert_eq!(udp_ask(from, p[2].addr(7000), T), Err(ConnError::Refused));
    assert_eq!(udp_ask(from, p[2].addr6(7000), T), Err(ConnError::Refused));

    // ICMP errors are not rate limited inside the lab, so every attempt
    // gets its reject.
    for _ in 0..20 {
        assert_eq!(udp_ask(from, p[3].addr(7001), T), Err(ConnError::Refused));
        assert_eq!(udp_ask(from, p[3].addr6(7001), T), Err(ConnError::Refused));
    }

    let srv = c.serve(p[2].ns(), "tmp", ServeSpec::both(&[7000])).unwrap();
    assert!(tcp_hello(from, p[2].addr(7000), T).is_ok());
    assert!(udp_ask(from, p[2].addr(7000), T).is_ok());
    assert_eq!((srv.connections(), srv.udp_requests()), (1, 1));
    drop(srv);
    assert_eq!(tcp_hello(from, p[2].addr(7000), T), Err(ConnError::Refused));
    assert_eq!(udp_ask(from, p[2].addr(7000), T), Err(ConnError::Refused));
}

#[test]
fn unanswered_traffic_times_out() {
    let (c, p) = two_by_two("timeout");
    // Nobody owns ClusterIPs without a proxy: the node routes them out of
    // eth0 where no one answers ARP.
    let vip: SocketAddr = "10.96.0.10:80".parse().unwrap();
    let short = Duration::from_millis(500);
    assert_eq!(tcp_hello(p[0].ns(), vip, short), Err(ConnError::Timeout));
    assert!(c
        .exec_ok(c.node_ns(1), &["ip", "route", "get", "10.96.0.10"])
        .is_ok());
    assert!(c
        .exec_ok(c.node_ns(1), &["ip", "-6", "route", "get", "fd00:96::a"])
        .is_ok());
    assert!(c
        .exec_ok(p[0].ns(), &["ip", "-6", "route", "get", "fd00:96::a"])
        .is_ok());
}

#[test]
fn many_connections_and_sessions() {
    let (c, p) = two_by_two("many");
    let srv = c
        .serve(p[3].ns(), "srv-d", ServeSpec::both(&[8443]))
        .unwrap();
    let results = tcp_hello_many(p[0].ns(), p[3].addr(8443), 25, T);
    assert_eq!(results.len(), 25);
    let mut ports: Vec<u16> = results
        .iter()
        .map(|r| {
            let r = r.as_ref().unwrap();
            assert_eq!(r.server, "srv-d");
            r.peer.port()
        })
        .collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(
        ports.len(),
        25,
        "every connection needs its own source port"
    );
    assert!(wait_until(T, Duration::from_millis(10), || srv
        .connections()
        == 25));

    let s = udp_session(p[0].ns(), p[3].addr6(8443)).unwrap();
    let first = s.ask(T).unwrap();
    for _ in 0..5 {
        assert_eq!(
            s.ask(T).unwrap().peer,
            first.peer,
            "one session, one source port"
        );
    }
    assert_eq!(first.local, s.local_addr());

    let bad = tcp_hello_many("kp-no-such-namespace", p[3].addr(8443), 2, T);
    assert!(matches!(
        bad.as_slice(),
        [Err(ConnError::Other(_)), Err(ConnError::Other(_))]
    ));
}

#[test]
fn held_connection_exchanges_lines() {
    let (c, p) = two_by_two("held");
    let srv = c
        .serve(p[2].ns(), "srv-c", ServeSpec::tcp(&[5000]))
        .unwrap();
    let mut conn = tcp_hold(p[1].ns(), p[2].addr6(5000), T).unwrap();
    assert_eq!(conn.greeting().server, "srv-c");
    assert_eq!(conn.greeting().peer.ip(), p[1].ip6());
    for i in 0..5 {
        assert_eq!(
            conn.exchange(&format!("line {i}"), T).unwrap(),
            format!("srv-c line {i}")
        );
    }
    assert_eq!(srv.connections(), 1, "all lines on one connection");
    // Stopping the server closes the held connection too.
    drop(srv);
    assert!(conn.exchange("after", T).is_err());
}

#[test]
fn source_binding_and_in_netns() {
    let (c, p) = two_by_two("from");
    let _s = c
        .serve(p[2].ns(), "srv-c", ServeSpec::tcp(&[6000]))
        .unwrap();
    c.exec_ok(
        c.node_ns(1),
        &["ip", "addr", "add", "10.100.0.211/24", "dev", "eth0"],
    )
    .unwrap();
    let r = tcp_hello_from(
        c.node_ns(1),
        Some("10.100.0.211".parse().unwrap()),
        p[2].addr(6000),
        T,
    )
    .unwrap();
    assert_eq!(r.peer.ip(), "10.100.0.211".parse::<IpAddr>().unwrap());

    // A UDP server answers from the address it was asked on, even when that
    // is not the namespace's preferred source (the connected client would
    // drop anything else).
    let _n = c
        .serve(c.node_ns(1), "node1", ServeSpec::udp(&[6001]))
        .unwrap();
    let secondary: SocketAddr = "10.100.0.211:6001".parse().unwrap();
    let r = udp_ask(p[2].ns(), secondary, T).unwrap();
    assert_eq!(r.server, "node1");
    c.exec_ok(
        c.node_ns(1),
        &[
            "ip",
            "addr",
            "add",
            "fd00:100::211/64",
            "dev",
            "eth0",
            "nodad",
        ],
    )
    .unwrap();
    let r = udp_ask(c.client_ns(), "[fd00:100::211]:6001".parse().unwrap(), T).unwrap();
    assert_eq!(r.peer.ip(), c.client_ip6());

    // Binding a pod IP works only inside that pod's namespace.
    let pod_ip = p[0].ip();
    let inside = in_netns(p[0].ns(), || {
        std::net::TcpListener::bind((pod_ip, 0)).is_ok()
    })
    .unwrap();
    assert!(inside);
    let other = in_netns(p[1].ns(), || {
        std::net::TcpListener::bind((pod_ip, 0)).is_ok()
    })
    .unwrap();
    assert!(!other);
    assert!(matches!(
        in_netns("kp-no-such-namespace", || ()),
        Err(LabError::Netns { .. })
    ));
    assert!(matches!(
        c.add_pod(3, "x"),
        Err(LabError::NoSuchNode { node: 3, nodes: 2 })
    ));
    assert!(matches!(
        c.add_pod(1, "a"),
        Err(LabError::InvalidName { .. })
    ));
    let err = c
        .exec_ok(c.node_ns(1), &["ip", "link", "show", "nonexistent0"])
        .unwrap_err();
    assert!(matches!(err, LabError::Command { .. }), "{err}");
}

#[test]
fn handles_can_move_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Cluster>();
    send_sync::<kp_netlab::ServerGuard>();
    send_sync::<kp_netlab::ProcGuard>();
    send_sync::<kp_netlab::UdpSession>();
    send::<kp_netlab::HeldConn>();
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn spawned_processes_log_and_die() {
    let c = Cluster::new("spawn", ClusterOpts::with_nodes(1)).unwrap();
    let dir = std::env::temp_dir().join(format!("{}-spawn", c.prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("sh.log");
    let sh = Path::new("/bin/sh");
    let script = |s: &str| vec!["-c".to_string(), s.to_string()];
    let p = c
        .spawn(
            c.node_ns(1),
            sh,
            &script("ip -o addr show dev eth0; echo to-stderr >&2; exec sleep 300"),
            &log,
        )
        .unwrap();
    assert!(wait_until(T, Duration::from_millis(20), || p
        .log_contents()
        .contains("to-stderr")));
    assert!(
        p.log_contents().contains("10.100.0.11/24"),
        "ran in the node: {}",
        p.log_contents()
    );
    assert!(p.is_running());
    p.kill_hard();
    assert!(!p.is_running());
    assert!(!pid_alive(p.pid()));

    let p2 = c
        .spawn(c.node_ns(1), sh, &script("exec sleep 300"), &log)
        .unwrap();
    let pid2 = p2.pid();
    std::mem::forget(p2); // only the cluster can still kill it
    let p3 = c
        .spawn(
            c.node_ns(1),
            sh,
            &script("trap 'exit 7' TERM; while :; do sleep 0.05; done"),
            &log,
        )
        .unwrap();
    assert!(wait_until(T, Duration::from_millis(20), || pid_alive(
        p3.pid()
    )));
    std::thread::sleep(Duration::from_millis(100)); // let the shell install its trap
    let st = p3.terminate(T).unwrap().expect("exits on SIGTERM");
    assert_eq!(st.code(), Some(7));
    drop(c);
    assert!(wait_until(T, Duration::from_millis(20), || !pid_alive(
        pid2
    )));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn namespaces_are_removed_on_drop_and_on_panic() {
    let c = Cluster::new("drop", ClusterOpts::with_nodes(3)).unwrap();
    c.add_pod(3, "p").unwrap();
    let names = c.all_namespaces();
    assert_eq!(names.len(), 1 + 3 + 1 + 1);
    drop(c);
    assert!(
        names.iter().all(|n| !netns_exists(n)),
        "left over: {names:?}"
    );

    let seen = std::sync::Mutex::new(Vec::new());
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let c = Cluster::new("panic", ClusterOpts::default()).unwrap();
        c.add_pod(1, "p").unwrap();
        let _srv = c.serve(c.node_ns(1), "s", ServeSpec::both(&[80])).unwrap();
        *seen.lock().unwrap() = c.all_namespaces();
        panic!("test body failed");
    }));
    assert!(res.is_err());
    let names = seen.into_inner().unwrap();
    assert_eq!(names.len(), 5);
    assert!(
        names.iter().all(|n| !netns_exists(n)),
        "left over: {names:?}"
    );
}

#[test]
fn service_traffic_reaches_node_netfilter_hooks() {
    // A hand-written DNAT + masquerade ruleset stands in for a proxy: it
    // proves that pod and node traffic to ClusterIPs passes the node's
    // prerouting/output hooks and that masquerading picks the node IP (not
    // the link-local pod gateway).
    let (c, p) = two_by_two("hooks");
    let _b = c
        .serve(p[1].ns(), "srv-b", ServeSpec::both(&[8080]))
        .unwrap();
    let rules = format!(
        "table inet lab {{
           chain pre {{ type nat hook prerouting priority dstnat; policy accept;
             ip daddr 10.96.0.10 tcp dport 80 dnat ip to {b4}:8080
             ip6 daddr fd00:96::a udp dport 80 dnat ip6 to [{b6}]:8080
           }}
           chain out {{ type nat hook output priority -100; policy accept;
             ip daddr 10.96.0.10 tcp dport 80 dnat ip to {b4}:8080
           }}
           chain post {{ type nat hook postrouting priority srcnat; policy accept;
             ip daddr {b4} masquerade
             ip6 daddr {b6} masquerade
           }}
         }}",
        b4 = p[1].ip(),
        b6 = p[1].ip6()
    );
    let file = std::env::temp_dir().join(format!("{}-hooks.nft", c.prefix()));
    std::fs::write(&file, rules).unwrap();
    c.exec_ok(c.node_ns(1), &["nft", "-f", file.to_str().unwrap()])
        .unwrap();
    std::fs::remove_file(&file).unwrap();

    let vip4: SocketAddr = "10.96.0.10:80".parse().unwrap();
    let vip6: SocketAddr = "[fd00:96::a]:80".parse().unwrap();
    // Hairpin-like: pod a (node 1) -> VIP -> pod b (node 1), masqueraded.
    let r = tcp_hello(p[0].ns(), vip4, T).unwrap();
    assert_eq!((r.server.as_str(), r.peer.ip()), ("srv-b", c.node_ip(1)));
    let r = udp_ask(p[0].ns(), vip6, T).unwrap();
    assert_eq!((r.server.as_str(), r.peer.ip()), ("srv-b", c.node_ip6(1)));
    // Remote pod c (node 2) -> VIP is handled by node 2, which has no rules.
    assert_eq!(
        tcp_hello(p[2].ns(), vip4, Duration::from_millis(500)),
        Err(ConnError::Timeout)
    );
    // The node itself (output hook).
    let r = tcp_hello(c.node_ns(1), vip4, T).unwrap();
    assert_eq!((r.server.as_str(), r.peer.ip()), ("srv-b", c.node_ip(1)));
}
