//! The conformance suite with the tc programs for traffic from outside the
//! node (`--socket-lb --bpf-nodeport`): the external client's NodePort,
//! LoadBalancer and external IP traffic is translated at tc on each node's
//! eth0 (and its replies on the pods' veths); nftables keeps the rest.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

conformance_suite!("nftables-tc-socketlb");

use conformance::{ready, service, slice, Env, T};
use serde_json::json;

const MODE: &str = "nftables-tc-socketlb";

/// conntrack entries in node `node`'s namespace whose original destination
/// is `ip`.
fn conntrack_to(env: &Env, node: usize, ip: &str) -> Vec<String> {
    // conntrack lists IPv4 alone unless told the family.
    let family = if ip.contains(':') { "ipv6" } else { "ipv4" };
    env.on_node(node, &["conntrack", "-L", "-f", family, "-d", ip])
        .lines()
        .map(String::from)
        .collect()
}

/// Waits until a new connection from `client` to `addr` (entering node
/// `node`) leaves no conntrack entry there: the programs have the entry
/// (the dataplanes of the two families sync one after the other, and a
/// connection before then went through nftables). Entries of those earlier
/// connections are deleted, the held one's of t06 excepted (`keep`: a
/// client port).
fn wait_served_by_programs(
    env: &Env,
    node: usize,
    client: &str,
    addr: std::net::SocketAddr,
    keep: Option<u16>,
) {
    let ip = addr.ip().to_string();
    env.wait(&format!("the programs serving {addr}"), || {
        let Ok(r) = kp_netlab::tcp_hello(client, addr, T) else {
            return false;
        };
        let mine = format!("sport={} ", r.local.port());
        conntrack_to(env, node, &ip)
            .iter()
            .all(|l| !l.contains(&mine))
    });
    let family = if addr.is_ipv6() { "ipv6" } else { "ipv4" };
    let kept = keep.map(|p| format!("sport={p} "));
    for l in conntrack_to(env, node, &ip) {
        if kept.as_ref().is_some_and(|k| l.contains(k.as_str())) {
            continue;
        }
        // "... src=C dst=N sport=S dport=D ...": delete that one flow.
        let field = |name: &str| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .map(String::from)
        };
        if let (Some(sport), Some(proto)) = (field("sport="), l.split_whitespace().next()) {
            env.on_node(
                node,
                &[
                    "conntrack",
                    "-D",
                    "-f",
                    family,
                    "-p",
                    proto,
                    "-d",
                    &ip,
                    "--sport",
                    &sport,
                ],
            );
        }
    }
}

/// The external client's NodePort traffic is answered by endpoints on both
/// nodes, with no conntrack entry on the node it entered (the programs
/// translated it before netfilter), its source masqueraded for
/// externalTrafficPolicy Cluster; the programs sit on eth0 and on the pods'
/// veths, as the links pinned for them say.
#[test]
fn t01_nodeport_from_outside_bypasses_conntrack() {
    let mut env = Env::new("tcnp", MODE);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let mut svc = service("np", &["10.96.0.40"], json!({"type": "NodePort"}));
    svc["spec"]["ports"][0]["nodePort"] = json!(30400);
    env.put("svc", &svc);
    env.put("eps", &slice("np", "1", "IPv4", &ready(&[&a, &c])));
    env.start_all();
    let node1 = env.cluster.node_ip(1);
    let client = env.cluster.client_ns().to_string();
    let vip = std::net::SocketAddr::new(node1, 30400);
    env.wait_tcp(&client, vip);
    wait_served_by_programs(&env, 1, &client, vip, None);
    let replies = kp_netlab::tcp_hello_many(&client, vip, 40, T);
    let mut servers = std::collections::BTreeMap::<String, usize>::new();
    for r in replies.iter() {
        let r = r
            .as_ref()
            .expect("a NodePort connection from outside failed");
        // eTP=Cluster: the endpoint sees the node's address, never the client's.
        assert_ne!(
            r.peer.ip(),
            env.cluster.client_ip(),
            "not masqueraded: {r:?}"
        );
        *servers.entry(r.server.clone()).or_default() += 1;
    }
    assert_eq!(
        servers.keys().collect::<Vec<_>>(),
        vec!["a", "c"],
        "both endpoints, on both nodes: {servers:?}"
    );
    let ct = conntrack_to(&env, 1, &node1.to_string());
    assert!(
        ct.iter().all(|l| !l.contains("dport=30400")),
        "NodePort traffic went through conntrack on node1:\n{}",
        ct.join("\n")
    );
    // One pinned TCX link per interface: eth0's runs the external program,
    // each pod veth's the replies' one.
    let lb = env.socket_lb.as_ref().unwrap();
    let dir = lb.fs.path().join("node1/links/tc");
    let mut pins: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    pins.sort();
    assert!(pins.iter().any(|p| p.starts_with("ext-eth0@")), "{pins:?}");
    assert!(pins.iter().any(|p| p.starts_with("pod-kpv")), "{pins:?}");
    for p in &pins {
        let path = dir.join(p);
        let out = std::process::Command::new("bpftool")
            .args(["link", "show", "pinned"])
            .arg(&path)
            .output()
            .unwrap();
        // "N: type 11  prog ID" (11: BPF_LINK_TYPE_TCX; this bpftool
        // predates its name).
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let id = text
            .split_whitespace()
            .skip_while(|w| *w != "prog")
            .nth(1)
            .unwrap_or_else(|| panic!("{p}: no program in {text:?}"))
            .to_string();
        let prog = std::process::Command::new("bpftool")
            .args(["prog", "show", "id", &id])
            .output()
            .unwrap();
        let prog = String::from_utf8_lossy(&prog.stdout);
        let want = if p.starts_with("ext-") {
            "kp_np_external"
        } else {
            "kp_np_from_pod"
        };
        assert!(
            (text.contains("tcx") || text.contains("type 11")) && prog.contains(want),
            "{p}: {text} / {prog}"
        );
    }
}

/// externalTrafficPolicy Local through the programs: TCP and UDP to a
/// LoadBalancer IP and to the NodePort of node1 reach node1's endpoint with
/// the client's own address, with no conntrack entry on node1 for either;
/// node2, without a local endpoint, has no entry for it, so nftables drops
/// there as upstream does.
#[test]
fn t02_local_policy_keeps_the_client_address_tcp_and_udp() {
    let mut env = Env::new("tclocal", MODE);
    let a = env.pod(1, "a");
    let mut svc = service(
        "loc",
        &["10.96.0.41"],
        json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local"}),
    );
    svc["spec"]["ports"][0]["nodePort"] = json!(30410);
    svc["spec"]["ports"][1]["nodePort"] = json!(30411);
    svc["spec"]["healthCheckNodePort"] = json!(30412);
    env.put("svc", &conformance::with_status(svc, &["192.168.77.41"]));
    env.put("eps", &slice("loc", "1", "IPv4", &ready(&[&a])));
    env.start_all();
    let client = env.cluster.client_ns().to_string();
    env.cluster
        .client_route_via("192.168.77.41/32".parse().unwrap(), 1)
        .unwrap();
    let node1 = env.cluster.node_ip(1);
    for tcp in [
        std::net::SocketAddr::new(node1, 30410),
        "192.168.77.41:80".parse().unwrap(),
    ] {
        env.wait_tcp(&client, tcp);
        wait_served_by_programs(&env, 1, &client, tcp, None);
        let r = kp_netlab::tcp_hello(&client, tcp, T).unwrap();
        assert_eq!(r.server, "a");
        assert_eq!(
            r.peer.ip(),
            env.cluster.client_ip(),
            "{tcp}: source not kept"
        );
    }
    for udp in [
        std::net::SocketAddr::new(node1, 30411),
        "192.168.77.41:53".parse().unwrap(),
    ] {
        let r = kp_netlab::udp_ask(&client, udp, T).unwrap_or_else(|e| panic!("{udp}: {e:?}"));
        assert_eq!(r.server, "a");
        assert_eq!(
            r.peer.ip(),
            env.cluster.client_ip(),
            "{udp}: source not kept"
        );
    }
    for ip in [node1.to_string(), "192.168.77.41".to_string()] {
        let ct = conntrack_to(&env, 1, &ip);
        assert!(
            ct.iter()
                .all(|l| !l.starts_with("tcp") && !l.starts_with("udp")),
            "traffic to {ip} went through conntrack on node1:\n{}",
            ct.join("\n")
        );
    }
    let node2 = std::net::SocketAddr::new(env.cluster.node_ip(2), 30410);
    let r = kp_netlab::tcp_hello(&client, node2, T);
    assert!(
        r.is_err(),
        "node2 has no local endpoint, yet answered: {r:?}"
    );
}

/// A proxy restarted with --socket-lb but without --bpf-nodeport detaches
/// the previous run's tc programs (their pins go) and nftables serves the
/// NodePort again, through conntrack.
#[test]
fn t03_starting_without_the_flag_detaches_the_programs() {
    let mut env = Env::new("tcoff", MODE);
    let a = env.pod(1, "a");
    let mut svc = service("off", &["10.96.0.42"], json!({"type": "NodePort"}));
    svc["spec"]["ports"][0]["nodePort"] = json!(30420);
    env.put("svc", &svc);
    env.put("eps", &slice("off", "1", "IPv4", &ready(&[&a])));
    env.start_all();
    let node1 = env.cluster.node_ip(1);
    let client = env.cluster.client_ns().to_string();
    let np = std::net::SocketAddr::new(node1, 30420);
    env.wait_tcp(&client, np);
    let dir = env.socket_lb.as_ref().unwrap().fs.path().join("node1");
    assert!(dir.join("links/tc").exists());
    env.kill(1);
    env.mode = "nftables-socketlb".into();
    env.start(1, &[]);
    env.wait_synced(1);
    assert!(!dir.join("links/tc").exists(), "tc links still pinned");
    assert!(!dir.join("kp_np_flows").exists(), "tc maps still pinned");
    let r = env.wait_tcp(&client, np);
    assert_eq!(r.server, "a");
    let ct = conntrack_to(&env, 1, &node1.to_string());
    assert!(
        ct.iter().any(|l| l.contains("dport=30420")),
        "nftables did not take the NodePort back: {ct:?}"
    );
}

/// IPv6 through the programs: the external client's TCP and UDP to node1's
/// IPv6 NodePort reach endpoints on both nodes, masqueraded (eTP=Cluster),
/// with no conntrack entry on node1.
#[test]
fn t04_ipv6_nodeport_from_outside() {
    let mut env = Env::new("tcv6", MODE);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let mut svc = service(
        "six",
        &["10.96.0.43", "fd00:96::43"],
        json!({"type": "NodePort", "ipFamilyPolicy": "PreferDualStack"}),
    );
    svc["spec"]["ports"][0]["nodePort"] = json!(30430);
    svc["spec"]["ports"][1]["nodePort"] = json!(30431);
    env.put("svc", &svc);
    env.put("eps4", &slice("six", "v4", "IPv4", &ready(&[&a, &c])));
    env.put("eps6", &slice("six", "v6", "IPv6", &ready(&[&a, &c])));
    env.start_all();
    let node1 = env.cluster.node_ip6(1);
    let client = env.cluster.client_ns().to_string();
    let tcp = std::net::SocketAddr::new(node1, 30430);
    env.wait_tcp(&client, tcp);
    wait_served_by_programs(&env, 1, &client, tcp, None);
    let mut servers = std::collections::BTreeSet::new();
    for r in kp_netlab::tcp_hello_many(&client, tcp, 30, T) {
        let r = r.expect("an IPv6 NodePort connection from outside failed");
        assert_ne!(
            r.peer.ip(),
            env.cluster.client_ip6(),
            "not masqueraded: {r:?}"
        );
        servers.insert(r.server);
    }
    assert_eq!(servers.len(), 2, "both endpoints: {servers:?}");
    let udp = std::net::SocketAddr::new(node1, 30431);
    let r = kp_netlab::udp_ask(&client, udp, T).expect("UDP over the IPv6 NodePort");
    assert_ne!(
        r.peer.ip(),
        env.cluster.client_ip6(),
        "not masqueraded: {r:?}"
    );
    let ct = conntrack_to(&env, 1, &node1.to_string());
    assert!(
        ct.iter()
            .all(|l| !l.starts_with("tcp") && !l.starts_with("udp")),
        "IPv6 NodePort traffic went through conntrack on node1:\n{}",
        ct.join("\n")
    );
}

/// `--bpf-lb-algorithm maglev`: a flow to a LoadBalancer IP gets the same
/// endpoint whichever node it enters (the client's route moved from node1
/// to node2 mid-flow, eight flows over four endpoints: at random, all eight
/// would agree once in 65,536 runs).
#[test]
fn t05_maglev_sends_a_flow_to_the_same_endpoint_from_every_node() {
    let mut env = Env::new("tcmaglev", MODE);
    let pods = [
        env.pod(1, "a"),
        env.pod(1, "b"),
        env.pod(2, "c"),
        env.pod(2, "d"),
    ];
    let svc = service("mg", &["10.96.0.44"], json!({"type": "LoadBalancer"}));
    env.put("svc", &conformance::with_status(svc, &["192.168.77.44"]));
    let refs: Vec<&kp_netlab::Pod> = pods.iter().collect();
    env.put("eps", &slice("mg", "1", "IPv4", &ready(&refs)));
    for n in [1, 2] {
        env.start(n, &["--bpf-lb-algorithm=maglev"]);
    }
    env.wait_synced(1);
    env.wait_synced(2);
    let client = env.cluster.client_ns().to_string();
    let lb: std::net::SocketAddr = "192.168.77.44:53".parse().unwrap();
    let via = |node: usize| {
        env.cluster
            .client_route_via("192.168.77.44/32".parse().unwrap(), node)
            .unwrap()
    };
    via(1);
    env.wait("UDP to the LoadBalancer IP via node1", || {
        kp_netlab::udp_ask(&client, lb, T).is_ok()
    });
    let sessions: Vec<_> = (0..8)
        .map(|_| kp_netlab::udp_session(&client, lb).unwrap())
        .collect();
    let first: Vec<String> = sessions.iter().map(|s| s.ask(T).unwrap().server).collect();
    via(2);
    let second: Vec<String> = sessions
        .iter()
        .map(|s| s.ask(T).expect("the same flow via node2").server)
        .collect();
    assert_eq!(first, second, "node1 and node2 picked different endpoints");
    let distinct: std::collections::BTreeSet<_> = first.iter().collect();
    assert!(distinct.len() > 1, "eight flows all went to {distinct:?}");
}

/// Turning the programs on under a running connection: a NodePort
/// connection nftables translated before `--bpf-nodeport` was on goes on
/// working after the restart that turns it on (its packets are no SYN, so
/// the programs leave them to conntrack), while new ones are the programs'.
#[test]
fn t06_a_connection_from_before_the_programs_survives_them() {
    let mut env = Env::new("tcmigr", MODE);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let mut svc = service("mig", &["10.96.0.45"], json!({"type": "NodePort"}));
    svc["spec"]["ports"][0]["nodePort"] = json!(30450);
    env.put("svc", &svc);
    env.put("eps", &slice("mig", "1", "IPv4", &ready(&[&a, &c])));
    env.mode = "nftables-socketlb".into();
    env.start_all();
    let client = env.cluster.client_ns().to_string();
    let np = std::net::SocketAddr::new(env.cluster.node_ip(1), 30450);
    env.wait_tcp(&client, np);
    let mut held = kp_netlab::tcp_hold(&client, np, T).expect("a connection through nftables");
    env.kill(1);
    env.mode = MODE.into();
    env.start(1, &[]);
    env.wait_synced(1);
    let mine = held.greeting().local.port();
    wait_served_by_programs(&env, 1, &client, np, Some(mine));
    let server = held.greeting().server.clone();
    let answer = held
        .exchange("still there", T)
        .expect("the connection from before the programs broke");
    assert_eq!(answer, format!("{server} still there"));
}

/// A dual-stack NodePort Service `name` (ClusterIPs `ips`; UDP on
/// nodePort `udp_np`, TCP on `udp_np + 100`) whose one endpoint in both
/// families is `pod`, its UDP port `udp_port` where given (the echo's
/// otherwise).
fn dual_nodeport(
    env: &mut Env,
    name: &str,
    pod: &kp_netlab::Pod,
    udp_np: u16,
    ips: [&str; 2],
    udp_port: Option<u16>,
) {
    let mut svc = service(
        name,
        &ips,
        json!({"type": "NodePort", "ipFamilyPolicy": "PreferDualStack"}),
    );
    svc["spec"]["ports"][0]["nodePort"] = json!(udp_np + 100);
    svc["spec"]["ports"][1]["nodePort"] = json!(udp_np);
    env.put(&format!("svc-{name}"), &svc);
    for (fam, sfx) in [("IPv4", "v4"), ("IPv6", "v6")] {
        let mut s = slice(name, sfx, fam, &ready(&[pod]));
        if let Some(port) = udp_port {
            s["ports"][1]["port"] = json!(port);
        }
        env.put(&format!("eps-{name}-{sfx}"), &s);
    }
}

/// ICMP errors about translated flows go back to the client as conntrack
/// sends them: UDP from outside to a NodePort whose endpoint has nothing
/// listening on its port is refused (the endpoint's "port unreachable",
/// translated back), for an endpoint on the node the client entered (the
/// error comes from its veth) and on the other node (from eth0), in both
/// families.
#[test]
fn t07_port_unreachable_from_an_endpoint_reaches_the_client() {
    let mut env = Env::new("tcicmp", MODE);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    // Nothing listens on UDP 9999 in the pods.
    dual_nodeport(
        &mut env,
        "here",
        &a,
        30460,
        ["10.96.0.46", "fd00:96::46"],
        Some(9999),
    );
    dual_nodeport(
        &mut env,
        "there",
        &c,
        30461,
        ["10.96.0.47", "fd00:96::47"],
        Some(9999),
    );
    env.start_all();
    let client = env.cluster.client_ns().to_string();
    for node_ip in [env.cluster.node_ip(1), env.cluster.node_ip6(1)] {
        let tcp = std::net::SocketAddr::new(node_ip, 30560);
        env.wait_tcp(&client, tcp);
        wait_served_by_programs(&env, 1, &client, tcp, None);
        for np in [30460, 30461] {
            let udp = std::net::SocketAddr::new(node_ip, np);
            let r = kp_netlab::udp_ask(&client, udp, T);
            assert!(
                matches!(r, Err(kp_netlab::ConnError::Refused)),
                "{udp}: {r:?} (the endpoint's port unreachable did not come back)"
            );
        }
        let ct = conntrack_to(&env, 1, &node_ip.to_string());
        assert!(
            ct.iter().all(|l| !l.starts_with("udp")),
            "UDP to {node_ip} went through conntrack on node1:\n{}",
            ct.join("\n")
        );
    }
}

/// With deploy/'s privileges (CAP_NET_ADMIN and CAP_BPF, no
/// CAP_SYS_ADMIN, which listing the kernel's programs takes), the links
/// put on at the first sync are left alone by the next ones: no sync
/// "upgrades" a link that runs our program already (seen in the e2e lab:
/// every sync updated every link).
#[test]
fn t08_least_privilege_syncs_leave_the_links_alone() {
    let mut env = Env::new("tccaps", &format!("caps/{MODE}"));
    let a = env.pod(1, "a");
    let mut svc = service("cap", &["10.96.0.48"], json!({"type": "NodePort"}));
    svc["spec"]["ports"][0]["nodePort"] = json!(30480);
    env.put("svc", &svc);
    env.put("eps", &slice("cap", "1", "IPv4", &ready(&[&a])));
    // XDP too: its program passes the verifier such a proxy gets (no
    // CAP_PERFMON: no packet pointer plus register), and its link is
    // left alone as well.
    env.start(1, &["--bpf-lb-acceleration=native"]);
    env.wait_synced(1);
    let client = env.cluster.client_ns().to_string();
    let np = std::net::SocketAddr::new(env.cluster.node_ip(1), 30480);
    env.wait_tcp(&client, np);
    // More syncs: a new pod (a new interface) and its endpoint.
    let b = env.pod(1, "b");
    env.put("eps", &slice("cap", "1", "IPv4", &ready(&[&a, &b])));
    env.wait("both endpoints", || {
        let c: std::collections::BTreeSet<String> = kp_netlab::tcp_hello_many(&client, np, 20, T)
            .into_iter()
            .flatten()
            .map(|r| r.server)
            .collect();
        c.len() == 2
    });
    let log = env.log(1);
    let attached: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("tc programs attached"))
        .collect();
    assert!(!attached.is_empty(), "no attachment logged:\n{log}");
    assert!(
        attached.iter().any(|l| l.contains("xdp-eth0@")),
        "no XDP link attached:\n{}",
        attached.join("\n")
    );
    assert!(
        attached.iter().all(|l| l.contains("upgraded=[]")),
        "links updated that ran our program already:\n{}",
        attached.join("\n")
    );
}

/// Counters on the lab's LAN bridge (its own namespace) for the replies of
/// endpoint `pod_ip` (on node2) to node1's NodePort traffic at `node1`:
/// `via_node1` counts the endpoint's packets bridged from node2 to node1
/// (SNAT: the reply goes back through the node the request entered),
/// `direct` node2's packets to the client with node1's address as source
/// (DSR: the reply leaves node2 for the client as the Service). Per
/// protocol; the family the addresses'.
struct LanCounters<'a> {
    env: &'a Env,
}

impl<'a> LanCounters<'a> {
    fn new(env: &'a Env, pod_ip: &str, node1: std::net::IpAddr) -> Self {
        let ip = if node1.is_ipv6() { "ip6" } else { "ip" };
        let mut script = String::from("table bridge kpdsr {\n");
        for p in ["tcp", "udp"] {
            script += &format!("  counter via_node1_{p} {{}}\n  counter direct_{p} {{}}\n");
        }
        script +=
            "  chain count_replies {\n    type filter hook forward priority 0; policy accept;\n";
        for p in ["tcp", "udp"] {
            script += &format!(
                "    iifname \"n2\" oifname \"n1\" {ip} saddr {pod_ip} meta l4proto {p} counter name via_node1_{p}\n    iifname \"n2\" oifname \"c0\" {ip} saddr {node1} meta l4proto {p} counter name direct_{p}\n"
            );
        }
        script += "  }\n}\n";
        let path = env.logs.join("lan-counters.nft");
        std::fs::write(&path, script).unwrap();
        env.cluster
            .exec_ok(env.cluster.lan_ns(), &["nft", "-f", path.to_str().unwrap()])
            .unwrap();
        LanCounters { env }
    }

    fn packets(&self, name: &str) -> u64 {
        let out = self
            .env
            .cluster
            .exec_ok(
                self.env.cluster.lan_ns(),
                &["nft", "list", "counter", "bridge", "kpdsr", name],
            )
            .unwrap();
        out.split_whitespace()
            .skip_while(|w| *w != "packets")
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no packet count in {out:?}"))
    }
}

/// Starts both nodes with `mode`, a NodePort Service (TCP 30490, UDP
/// 30491, eTP=Cluster) whose only endpoint is on node2, and waits until
/// node1's programs serve it. The client's namespace, node1's TCP and UDP
/// NodePort addresses, the endpoint's address. `v6`: the Service is
/// dual-stack and the addresses are IPv6 ones.
fn dsr_env(
    name: &str,
    mode: &str,
    v6: bool,
) -> (
    Env,
    String,
    std::net::SocketAddr,
    std::net::SocketAddr,
    String,
) {
    let mut env = Env::new(name, MODE);
    let c = env.pod(2, "c");
    let (family, dual) = if v6 {
        (
            "IPv6",
            json!({"type": "NodePort", "ipFamilyPolicy": "PreferDualStack"}),
        )
    } else {
        ("IPv4", json!({"type": "NodePort"}))
    };
    let mut svc = service(
        "dsr",
        &["10.96.0.49", "fd00:96::49"][..1 + v6 as usize],
        dual.clone(),
    );
    svc["spec"]["ports"][0]["nodePort"] = json!(30490);
    svc["spec"]["ports"][1]["nodePort"] = json!(30491);
    env.put("svc", &svc);
    env.put("eps", &slice("dsr", "1", family, &ready(&[&c])));
    // Nothing listens on UDP 9999 in the pod: UDP 30492 is refused.
    let mut closed = service(
        "dsrx",
        &["10.96.0.50", "fd00:96::50"][..1 + v6 as usize],
        dual,
    );
    closed["spec"]["ports"][0]["nodePort"] = json!(30493);
    closed["spec"]["ports"][1]["nodePort"] = json!(30492);
    env.put("svc-closed", &closed);
    let mut s = slice("dsrx", "1", family, &ready(&[&c]));
    s["ports"][1]["port"] = json!(9999);
    env.put("eps-closed", &s);
    let flag = format!("--bpf-lb-mode={mode}");
    for n in [1, 2] {
        env.start(n, &[&flag]);
    }
    env.wait_synced(1);
    env.wait_synced(2);
    let client = env.cluster.client_ns().to_string();
    let node1 = if v6 {
        env.cluster.node_ip6(1)
    } else {
        env.cluster.node_ip(1)
    };
    let tcp = std::net::SocketAddr::new(node1, 30490);
    let udp = std::net::SocketAddr::new(node1, 30491);
    env.wait_tcp(&client, tcp);
    wait_served_by_programs(&env, 1, &client, tcp, None);
    let pod = if v6 { c.ip6() } else { c.ip() }.to_string();
    (env, client, tcp, udp, pod)
}

/// `--bpf-lb-mode dsr`, externalTrafficPolicy Cluster, the endpoint on the
/// other node: TCP and UDP from the external client reach it with the
/// client's own address, and the replies go from node2 straight to the
/// client with node1's address as source: none crosses node1 (counted on
/// the LAN bridge; in SNAT mode every reply does, t10's UDP); UDP to a
/// closed port is refused (the ICMP error translated on node2).
#[test]
fn t09_dsr_endpoint_on_another_node_sees_the_client_and_replies_directly() {
    dsr_sees_the_client_and_replies_directly("tcdsr", false);
}

/// t09 in IPv6: the Service address travels in a destination options
/// header instead of an IPv4 option, with the same results.
#[test]
fn t13_dsr_in_ipv6() {
    dsr_sees_the_client_and_replies_directly("tcdsr6", true);
}

fn dsr_sees_the_client_and_replies_directly(name: &str, v6: bool) {
    let (env, client, tcp, udp, pod) = dsr_env(name, "dsr", v6);
    let client_ip = if v6 {
        env.cluster.client_ip6()
    } else {
        env.cluster.client_ip()
    };
    let lan = LanCounters::new(&env, &pod, tcp.ip());
    for r in kp_netlab::tcp_hello_many(&client, tcp, 10, T) {
        let r = r.expect("a DSR TCP connection failed");
        assert_eq!(r.server, "c");
        assert_eq!(r.peer.ip(), client_ip, "TCP: source not kept: {r:?}");
    }
    // A longer conversation: packets after the SYN (without the option)
    // follow the flow on both nodes.
    let mut held = kp_netlab::tcp_hold(&client, tcp, T).expect("a held DSR connection");
    for i in 0..5 {
        let answer = held.exchange(&format!("line {i}"), T).expect("an exchange");
        assert_eq!(answer, format!("c line {i}"));
    }
    for _ in 0..5 {
        let r = kp_netlab::udp_ask(&client, udp, T).expect("UDP over DSR");
        assert_eq!(r.server, "c");
        assert_eq!(r.peer.ip(), client_ip, "UDP: source not kept: {r:?}");
    }
    let s = kp_netlab::udp_session(&client, udp).unwrap();
    for _ in 0..3 {
        let r = s.ask(T).expect("a UDP flow's later datagrams");
        assert_eq!(r.peer.ip(), client_ip);
    }
    // The endpoint's port unreachable goes from node2 to the client as
    // the Service's (a reply entry of kp_np_flows made from the option).
    let refused = std::net::SocketAddr::new(tcp.ip(), 30492);
    let r = kp_netlab::udp_ask(&client, refused, T);
    assert!(
        matches!(r, Err(kp_netlab::ConnError::Refused)),
        "{refused}: {r:?} (the endpoint's port unreachable did not come back)"
    );
    for p in ["tcp", "udp"] {
        assert_eq!(
            lan.packets(&format!("via_node1_{p}")),
            0,
            "{p} replies went back through node1"
        );
        assert!(
            lan.packets(&format!("direct_{p}")) > 0,
            "no {p} reply left node2 for the client as node1's address"
        );
    }
    let ct = conntrack_to(&env, 1, &tcp.ip().to_string());
    assert!(
        ct.iter()
            .all(|l| !l.starts_with("tcp") && !l.starts_with("udp")),
        "DSR traffic went through conntrack on node1:\n{}",
        ct.join("\n")
    );
}

/// `--bpf-lb-mode hybrid`: TCP is DSR (the client's address, the replies
/// straight from node2), UDP is SNAT (node1's address, the replies back
/// through node1).
#[test]
fn t10_hybrid_is_dsr_for_tcp_and_snat_for_udp() {
    let (env, client, tcp, udp, pod) = dsr_env("tchybrid", "hybrid", false);
    let lan = LanCounters::new(&env, &pod, tcp.ip());
    for r in kp_netlab::tcp_hello_many(&client, tcp, 5, T) {
        let r = r.expect("a DSR TCP connection failed");
        assert_eq!(
            r.peer.ip(),
            env.cluster.client_ip(),
            "TCP: source not kept: {r:?}"
        );
    }
    for _ in 0..5 {
        let r = kp_netlab::udp_ask(&client, udp, T).expect("UDP over SNAT");
        assert_eq!(r.server, "c");
        assert_eq!(r.peer.ip(), tcp.ip(), "UDP: not SNATed to node1: {r:?}");
    }
    assert_eq!(
        lan.packets("via_node1_tcp"),
        0,
        "TCP replies went through node1"
    );
    assert!(
        lan.packets("direct_tcp") > 0,
        "no TCP reply straight from node2"
    );
    assert!(
        lan.packets("via_node1_udp") > 0,
        "UDP replies did not go through node1"
    );
    assert_eq!(
        lan.packets("direct_udp"),
        0,
        "UDP replies straight from node2"
    );
}

/// A hostNetwork endpoint of the node the request enters (its address is
/// the node's own): the programs leave that flow to nftables (DNAT to a
/// local process, whose replies conntrack translates), in both families;
/// the other node's hostNetwork endpoint is translated as usual. Seen in
/// the dual-stack e2e lab ("should function for service endpoints using
/// hostNetwork", Secondary IP Family): node1's own endpoint never answered.
#[test]
fn t11_a_host_network_endpoint_of_the_node_itself() {
    let mut env = Env::new("tchost", MODE);
    let mut servers = Vec::new();
    for n in [1, 2] {
        let ns = env.cluster.node_ns(n).to_string();
        servers.push(
            env.cluster
                .serve(
                    &ns,
                    &format!("host{n}"),
                    kp_netlab::ServeSpec::both(&[8089]),
                )
                .unwrap(),
        );
    }
    let mut svc = service(
        "hostnet",
        &["10.96.0.49", "fd00:96::49"],
        json!({"type": "NodePort", "ipFamilyPolicy": "PreferDualStack"}),
    );
    svc["spec"]["ports"][0]["nodePort"] = json!(30490);
    svc["spec"]["ports"][1]["nodePort"] = json!(30491);
    env.put("svc", &svc);
    for (fam, sfx) in [("IPv4", "v4"), ("IPv6", "v6")] {
        let ip = |n: usize| {
            if fam == "IPv4" {
                env.cluster.node_ip(n)
            } else {
                env.cluster.node_ip6(n)
            }
        };
        let endpoints: Vec<serde_json::Value> = [1, 2]
            .iter()
            .map(|n| {
                json!({
                    "addresses": [ip(*n).to_string()], "nodeName": format!("node{n}"),
                    "conditions": {"ready": true, "serving": true, "terminating": false}
                })
            })
            .collect();
        env.put(
            &format!("eps-{sfx}"),
            &json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"namespace": "default", "name": format!("hostnet-{sfx}"),
                             "labels": {"kubernetes.io/service-name": "hostnet"}},
                "addressType": fam,
                "ports": [{"name": "http", "port": 8089, "protocol": "TCP"},
                          {"name": "dns", "port": 8089, "protocol": "UDP"}],
                "endpoints": endpoints
            }),
        );
    }
    env.start_all();
    let client = env.cluster.client_ns().to_string();
    for node_ip in [env.cluster.node_ip(1), env.cluster.node_ip6(1)] {
        let np = std::net::SocketAddr::new(node_ip, 30490);
        env.wait_tcp(&client, np);
        wait_served_by_programs(&env, 1, &client, np, None);
        env.wait(&format!("both hostNetwork endpoints through {np}"), || {
            let seen: std::collections::BTreeSet<String> =
                kp_netlab::tcp_hello_many(&client, np, 20, T)
                    .into_iter()
                    .flatten()
                    .map(|r| r.server)
                    .collect();
            seen.len() == 2
        });
        let udp = std::net::SocketAddr::new(node_ip, 30491);
        env.wait(
            &format!("both hostNetwork endpoints through UDP {udp}"),
            || {
                let seen: std::collections::BTreeSet<String> = (0..20)
                    .filter_map(|_| kp_netlab::udp_ask(&client, udp, T).ok())
                    .map(|r| r.server)
                    .collect();
                seen.len() == 2
            },
        );
    }
    drop(servers);
}

/// What node `node`'s programs translated (kp_np_stats, summed over the
/// CPUs): (by tc, by XDP).
fn np_stats(env: &Env, node: usize) -> (u64, u64) {
    let lb = env.socket_lb.as_ref().unwrap();
    let pin = lb.fs.path().join(format!("node{node}/kp_np_stats"));
    let out = std::process::Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&pin)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bpftool map dump {}: {e}: {out:?}", pin.display()));
    let mut counts = [0u64; 2];
    for entry in v.as_array().expect("a list of entries") {
        let key = entry["key"]
            .as_u64()
            .or_else(|| entry["formatted"]["key"].as_u64());
        let values = entry["formatted"]["values"]
            .as_array()
            .or_else(|| entry["values"].as_array())
            .unwrap_or_else(|| panic!("no per-CPU values in {entry}"));
        let sum: u64 = values.iter().filter_map(|c| c["value"].as_u64()).sum();
        match key {
            Some(0) => counts[0] = sum,
            Some(1) => counts[1] = sum,
            _ => panic!("unexpected entry {entry}"),
        }
    }
    (counts[0], counts[1])
}

/// `--bpf-lb-acceleration native`: each node's eth0 runs the XDP program
/// in the driver beside tc's. Flows from the external client to an
/// endpoint on the other node, and their replies, both leave node1 by the
/// eth0 they came in by: XDP translates them (TCP and UDP, IPv4 and IPv6,
/// masqueraded, no conntrack entry) and tc on node1 sees none; a flow to
/// node1's own endpoint is passed on to tc, which serves it as before.
/// Started again without the flag, the program leaves eth0 and tc serves
/// everything.
/// veth delivers XDP_TX frames to its peer only while the peer runs an
/// XDP program, so the LAN ports get one that passes everything, and the
/// senders send full checksums (a NIC needs neither).
#[test]
fn t12_xdp_serves_endpoints_on_other_nodes_and_passes_the_rest_to_tc() {
    let mut env = Env::new("tcxdp", MODE);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let mut svc = service(
        "far",
        &["10.96.0.52", "fd00:96::52"],
        json!({"type": "NodePort", "ipFamilyPolicy": "PreferDualStack"}),
    );
    svc["spec"]["ports"][0]["nodePort"] = json!(30520);
    svc["spec"]["ports"][1]["nodePort"] = json!(30521);
    env.put("svc-far", &svc);
    env.put("eps-far4", &slice("far", "v4", "IPv4", &ready(&[&c])));
    env.put("eps-far6", &slice("far", "v6", "IPv6", &ready(&[&c])));
    let mut near = service("near", &["10.96.0.53"], json!({"type": "NodePort"}));
    near["spec"]["ports"][0]["nodePort"] = json!(30530);
    near["spec"]["ports"][1]["nodePort"] = json!(30531);
    env.put("svc-near", &near);
    env.put("eps-near", &slice("near", "v4", "IPv4", &ready(&[&a])));
    let bpf_mounts = || {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.contains(" /sys/fs/bpf "))
            .count()
    };
    let host_bpf_mounts = bpf_mounts();
    env.cluster
        .xdp_on_lan_ports(kp_ebpf::XDP_PASS_OBJECT)
        .unwrap();
    // Loading the LAN's program mounts nothing on the host.
    assert_eq!(
        bpf_mounts(),
        host_bpf_mounts,
        "a bpffs left on the host's /sys/fs/bpf"
    );
    // XDP updates checksums incrementally, taking them to be complete as
    // a NIC's frames are: the senders whose frames node1's XDP reads turn
    // their veth's offload off.
    env.cluster.full_checksums(env.cluster.client_ns()).unwrap();
    env.cluster.full_checksums(c.ns()).unwrap();
    for n in [1, 2] {
        env.start(n, &["--bpf-lb-acceleration=native"]);
    }
    env.wait_synced(1);
    env.wait_synced(2);
    let client = env.cluster.client_ns().to_string();
    // The program in the driver (xdpgeneric would be the skb path).
    let link = env.on_node(1, &["ip", "-d", "link", "show", "eth0"]);
    assert!(
        link.contains("prog/xdp") && !link.contains("xdpgeneric"),
        "no native XDP program on node1's eth0:\n{link}"
    );
    let lb = env.socket_lb.as_ref().unwrap();
    let pins: Vec<String> = std::fs::read_dir(lb.fs.path().join("node1/links/tc"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(pins.iter().any(|p| p.starts_with("xdp-eth0@")), "{pins:?}");

    for node_ip in [env.cluster.node_ip(1), env.cluster.node_ip6(1)] {
        let tcp = std::net::SocketAddr::new(node_ip, 30520);
        env.wait_tcp(&client, tcp);
        wait_served_by_programs(&env, 1, &client, tcp, None);
        let (tc0, xdp0) = np_stats(&env, 1);
        for r in kp_netlab::tcp_hello_many(&client, tcp, 20, T) {
            let r = r.expect("a NodePort connection through XDP failed");
            assert_eq!(r.server, "c");
            assert_ne!(r.peer.ip(), env.cluster.client_ip(), "not masqueraded");
            assert_ne!(r.peer.ip(), env.cluster.client_ip6(), "not masqueraded");
        }
        let udp = std::net::SocketAddr::new(node_ip, 30521);
        for _ in 0..5 {
            let r = kp_netlab::udp_ask(&client, udp, T).expect("UDP through XDP");
            assert_eq!(r.server, "c");
        }
        let (tc1, xdp1) = np_stats(&env, 1);
        // 20 connections of at least 3 packets each way, 5 UDP exchanges.
        assert!(
            xdp1 - xdp0 >= 20 * 3 * 2 + 10,
            "{tcp}: XDP translated {} packets",
            xdp1 - xdp0
        );
        assert_eq!(
            tc1,
            tc0,
            "{tcp}: tc translated {} packets of node2's flows (XDP {})",
            tc1 - tc0,
            xdp1 - xdp0
        );
        let ct = conntrack_to(&env, 1, &node_ip.to_string());
        assert!(
            ct.iter()
                .all(|l| !l.starts_with("tcp") && !l.starts_with("udp")),
            "{tcp}: traffic went through conntrack on node1:\n{}",
            ct.join("\n")
        );
    }

    let near = std::net::SocketAddr::new(env.cluster.node_ip(1), 30530);
    env.wait_tcp(&client, near);
    wait_served_by_programs(&env, 1, &client, near, None);
    let (tc0, xdp0) = np_stats(&env, 1);
    for r in kp_netlab::tcp_hello_many(&client, near, 10, T) {
        assert_eq!(r.expect("node1's own endpoint behind XDP").server, "a");
    }
    let (tc1, xdp1) = np_stats(&env, 1);
    assert!(tc1 - tc0 >= 10 * 3, "tc translated {} packets", tc1 - tc0);
    assert_eq!(xdp1, xdp0, "XDP took a flow to node1's own endpoint");

    // Started again without the flag: the XDP link is unpinned (the
    // program leaves eth0's driver) and tc serves the far endpoint alone.
    env.kill(1);
    env.start(1, &[]);
    env.wait_synced(1);
    let link = env.on_node(1, &["ip", "-d", "link", "show", "eth0"]);
    assert!(!link.contains("prog/xdp"), "XDP still on eth0:\n{link}");
    // The client and c send complete checksums (offload off, above), which
    // the receiving stacks check: tc's translation must keep them right,
    // in both families, for TCP and UDP, both ways.
    for node_ip in [env.cluster.node_ip(1), env.cluster.node_ip6(1)] {
        let far = std::net::SocketAddr::new(node_ip, 30520);
        let (tc0, xdp0) = np_stats(&env, 1);
        assert_eq!(env.wait_tcp(&client, far).server, "c");
        for r in kp_netlab::tcp_hello_many(&client, far, 5, T) {
            assert_eq!(r.expect("TCP through tc").server, "c");
        }
        let udp = std::net::SocketAddr::new(node_ip, 30521);
        for _ in 0..3 {
            let r = kp_netlab::udp_ask(&client, udp, T).expect("UDP through tc");
            assert_eq!(r.server, "c");
        }
        let (tc1, xdp1) = np_stats(&env, 1);
        assert!(
            tc1 >= tc0 + 6 * 3 * 2 + 6,
            "{far}: tc translated {} packets",
            tc1 - tc0
        );
        assert_eq!(xdp1, xdp0, "XDP ran after it was turned off");
    }
}

/// A counter of `/proc/net/snmp` (IPv4's ICMP: `Icmp` NAME) or
/// `/proc/net/snmp6` (`Icmp6`NAME) in namespace `ns`.
fn icmp_stat(env: &Env, ns: &str, v6: bool, name: &str) -> u64 {
    if v6 {
        let out = env
            .cluster
            .exec_ok(ns, &["cat", "/proc/net/snmp6"])
            .unwrap();
        let key = format!("Icmp6{name}");
        return out
            .lines()
            .find_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some(key.as_str())).then(|| w.next()?.parse().ok())?
            })
            .unwrap_or_else(|| panic!("no {key} in {ns}'s /proc/net/snmp6"));
    }
    let out = env.cluster.exec_ok(ns, &["cat", "/proc/net/snmp"]).unwrap();
    let mut rows = out.lines().filter(|l| l.starts_with("Icmp: "));
    let (names, values) = (rows.next().unwrap(), rows.next().unwrap());
    let i = names
        .split_whitespace()
        .position(|w| w == name)
        .unwrap_or_else(|| panic!("no Icmp {name} in {ns}'s /proc/net/snmp"));
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}

/// ICMP errors about a reply the programs translated reach the endpoint
/// that sent it, as conntrack would send them: the client refuses the
/// replies (an nftables reject in its namespace, so its kernel sends "port
/// unreachable" to the NodePort's address, quoting the reply as it got
/// it), and each endpoint, on the node the client entered and on the other
/// node, in both families, receives those errors with the quote as it sent
/// the reply: its kernel counts them as destination unreachable and finds
/// the echo server's socket for them (a quote it cannot match, or a bad
/// checksum, would count as an ICMP input error). Without the translation
/// the errors end on node1, which has no conntrack entry for the flows.
#[test]
fn t14_icmp_errors_about_replies_reach_the_endpoint() {
    let mut env = Env::new("tcicmpr", MODE);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    dual_nodeport(
        &mut env,
        "here",
        &a,
        30470,
        ["10.96.0.56", "fd00:96::56"],
        None,
    );
    dual_nodeport(
        &mut env,
        "there",
        &c,
        30471,
        ["10.96.0.57", "fd00:96::57"],
        None,
    );
    env.start_all();
    let client = env.cluster.client_ns().to_string();
    for node_ip in [env.cluster.node_ip(1), env.cluster.node_ip6(1)] {
        let tcp = std::net::SocketAddr::new(node_ip, 30570);
        env.wait_tcp(&client, tcp);
        wait_served_by_programs(&env, 1, &client, tcp, None);
        for np in [30470, 30471] {
            let udp = std::net::SocketAddr::new(node_ip, np);
            kp_netlab::udp_ask(&client, udp, T).expect("UDP before the client refuses replies");
        }
    }
    let rules = "table inet kp_refuse {\n  chain input {\n    type filter hook input priority 0; policy accept;\n    udp sport { 30470, 30471 } reject\n  }\n}\n";
    let path = env.logs.join("refuse.nft");
    std::fs::write(&path, rules).unwrap();
    env.cluster
        .exec_ok(&client, &["nft", "-f", path.to_str().unwrap()])
        .unwrap();
    for (v6, node_ip) in [
        (false, env.cluster.node_ip(1)),
        (true, env.cluster.node_ip6(1)),
    ] {
        for (pod, np) in [(&a, 30470), (&c, 30471)] {
            let before = (
                icmp_stat(&env, pod.ns(), v6, "InDestUnreachs"),
                icmp_stat(&env, pod.ns(), v6, "InErrors"),
            );
            let udp = std::net::SocketAddr::new(node_ip, np);
            for _ in 0..3 {
                let r = kp_netlab::udp_ask(&client, udp, std::time::Duration::from_millis(300));
                assert!(
                    r.is_err(),
                    "{udp}: a reply passed the client's reject: {r:?}"
                );
            }
            let what = format!("{udp} -> {}: the client's port unreachable", pod.name());
            env.wait(&what, || {
                icmp_stat(&env, pod.ns(), v6, "InDestUnreachs") >= before.0 + 3
            });
            assert_eq!(
                icmp_stat(&env, pod.ns(), v6, "InErrors"),
                before.1,
                "{what}: counted as an ICMP input error in the pod (a quote no socket matches, or a bad checksum)"
            );
        }
    }
}

/// DSR, and a UDP datagram that fills the lab's 1,500-byte MTU: with the
/// carrier it would not fit, so node1 answers as a router would, "fragmentation
/// needed" (ICMPv6 "packet too big") with the MTU less the carrier, from
/// the Service address about the datagram as the client sent it. The
/// client's connected socket reports EMSGSIZE and learns that MTU, and the
/// same datagram sent again (fragmented by the client now; the programs
/// leave fragments to the stack) is answered. Without the answer the
/// node's stack fails the translated packet with an error the client
/// cannot match, and every such datagram is lost.
#[test]
fn t15_dsr_too_big_for_the_carrier_is_answered_with_the_mtu() {
    for v6 in [false, true] {
        dsr_too_big(if v6 { "tcbig6" } else { "tcbig" }, v6);
    }
}

fn dsr_too_big(name: &str, v6: bool) {
    use std::os::fd::AsRawFd;
    let (_env, client, _tcp, udp, _pod) = dsr_env(name, "dsr", v6);
    kp_netlab::udp_ask(&client, udp, T).expect("a small datagram over DSR");
    let sock = kp_netlab::in_netns(&client, || {
        let any: std::net::IpAddr = if v6 {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        };
        let s = std::net::UdpSocket::bind((any, 0)).unwrap();
        s.connect(udp).unwrap();
        s
    })
    .unwrap();
    sock.set_read_timeout(Some(T)).unwrap();
    // IP and UDP headers: 28 bytes, 48 in IPv6; the carrier: 8, 24.
    let (headers, carrier) = if v6 { (48, 24) } else { (28, 8) };
    let datagram = vec![b'x'; 1500 - headers];
    let mut buf = [0u8; 2048];
    sock.send(&datagram).unwrap();
    let first = sock.recv(&mut buf);
    assert_eq!(
        first.as_ref().map_err(|e| e.raw_os_error()),
        Err(Some(libc::EMSGSIZE)),
        "{name}: the too big datagram: {first:?} (no ICMP error the socket matched)"
    );
    let (level, opt) = if v6 {
        (libc::IPPROTO_IPV6, libc::IPV6_MTU)
    } else {
        (libc::IPPROTO_IP, libc::IP_MTU)
    };
    let mut mtu: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a c_int and its length, for the duration of the call.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            level,
            opt,
            (&mut mtu as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "{name}: getsockopt MTU");
    assert_eq!(
        mtu,
        1500 - carrier,
        "{name}: the path MTU the client learnt"
    );
    sock.send(&datagram).unwrap();
    let n = sock
        .recv(&mut buf)
        .unwrap_or_else(|e| panic!("{name}: the datagram sent again, fragmented: {e}"));
    let answer = String::from_utf8_lossy(&buf[..n]);
    assert!(answer.starts_with("c "), "{name}: answered by {answer:?}");
}
