//! The proxy through real sockets on loopback (most need no privileges: the
//! Services' externalIPs are 127.0.0.x, already local addresses; the two
//! that put Service IPs on lo run in a network namespace of their own and
//! need root).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_model::{
    Dataplane, Endpoint, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName,
    SyncReport,
};
use kp_userspace::{NoMetrics, UserspaceConfig, UserspaceProxier, VipMode};

const PORT: u16 = 18080;

fn endpoint(addr: SocketAddr) -> Endpoint {
    Endpoint::ready(addr.ip(), addr.port(), true)
}

/// A state with one Service port on `vip`:PORT (an externalIP) sending to `eps`.
fn state(vip: &str, proto: Protocol, eps: &[SocketAddr]) -> ProxyState {
    let sp = ServicePort::builder("t", "svc")
        .port_name("p")
        .protocol(proto)
        .port(PORT)
        .external_ips(&[vip])
        .build();
    let name = sp.name.clone();
    let mut s = ProxyState::new(IpFamily::V4, NodeInfo::default());
    s.services.insert(name.clone(), Arc::new(sp));
    s.endpoints
        .insert(name, Arc::new(eps.iter().map(|a| endpoint(*a)).collect()));
    s
}

/// Greets each connection with its name and closes.
fn named_server(name: &'static str) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            let _ = s.write_all(name.as_bytes());
        }
    });
    a
}

fn hello(to: SocketAddr) -> String {
    let mut s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn proxier(f: impl FnOnce(&mut UserspaceConfig)) -> UserspaceProxier {
    let mut c = UserspaceConfig::new(IpFamily::V4);
    c.vip_mode = VipMode::None;
    f(&mut c);
    UserspaceProxier::new(c, Arc::new(NoMetrics), kp_userspace::runtime().unwrap()).unwrap()
}

fn sync(p: &mut UserspaceProxier, s: &ProxyState) {
    p.sync(s, &BTreeSet::new(), true).unwrap();
}

/// Reads until EOF, then answers "got N" and closes.
fn counting_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || {
                let mut s = s;
                let mut buf = vec![0u8; 65536];
                let mut n = 0usize;
                while let Ok(k) = s.read(&mut buf) {
                    if k == 0 {
                        break;
                    }
                    n += k;
                }
                let _ = s.write_all(format!("got {n}").as_bytes());
            });
        }
    });
    a
}

/// Echoes every read back.
fn echo_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || {
                let mut s = s;
                let mut buf = [0u8; 4096];
                while let Ok(k) = s.read(&mut buf) {
                    if k == 0 || s.write_all(&buf[..k]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    a
}

/// Answers each datagram with "NAME SRC_PORT" (the proxy's flow socket port).
fn udp_server(name: &'static str) -> SocketAddr {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    let a = s.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((_, from)) = s.recv_from(&mut buf) {
            let _ = s.send_to(format!("{name} {}", from.port()).as_bytes(), from);
        }
    });
    a
}

fn vip(ip: &str) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), PORT)
}

fn half_close(vip_ip: &str, splice: bool) {
    let server = counting_server();
    let mut p = proxier(|c| c.splice = splice);
    sync(&mut p, &state(vip_ip, Protocol::Tcp, &[server]));
    for size in [10usize, 3 << 20] {
        let mut s = TcpStream::connect(vip(vip_ip)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&vec![1u8; size]).unwrap();
        // Our half-close reaches the server, which still answers on the
        // other half.
        s.shutdown(Shutdown::Write).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert_eq!(answer, format!("got {size}"), "splice={splice}");
    }
}

#[test]
fn tcp_half_close_with_splice() {
    half_close("127.0.0.21", true);
}

#[test]
fn tcp_half_close_through_a_buffer() {
    half_close("127.0.0.22", false);
}

#[test]
fn tcp_idle_connections_are_closed() {
    let server = echo_server();
    let mut p = proxier(|c| c.tcp_idle_timeout = Duration::from_millis(300));
    sync(&mut p, &state("127.0.0.23", Protocol::Tcp, &[server]));
    let mut s = TcpStream::connect(vip("127.0.0.23")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // Traffic keeps it open past the timeout...
    for _ in 0..4 {
        s.write_all(b"ping").unwrap();
        let mut b = [0u8; 4];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"ping");
        std::thread::sleep(Duration::from_millis(150));
    }
    // ...silence closes it.
    let t0 = Instant::now();
    let mut b = [0u8; 4];
    let r = s.read(&mut b);
    assert!(
        matches!(r, Ok(0) | Err(_)),
        "idle connection still open: {r:?}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "closed only after {:?}",
        t0.elapsed()
    );
}

fn ask(c: &UdpSocket, to: SocketAddr) -> String {
    c.send_to(b"q", to).unwrap();
    let mut b = [0u8; 256];
    let (n, from) = c.recv_from(&mut b).unwrap();
    assert_eq!(from, to, "reply did not come from the Service address");
    String::from_utf8_lossy(&b[..n]).into_owned()
}

#[test]
fn udp_flows_stick_then_expire() {
    let (x, y) = (udp_server("x"), udp_server("y"));
    let mut p = proxier(|c| c.udp_idle_timeout = Duration::from_millis(400));
    sync(&mut p, &state("127.0.0.24", Protocol::Udp, &[x, y]));
    let to = vip("127.0.0.24");
    let c1 = UdpSocket::bind("127.0.0.1:0").unwrap();
    let c2 = UdpSocket::bind("127.0.0.1:0").unwrap();
    for c in [&c1, &c2] {
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    }
    let first = ask(&c1, to);
    // The same client keeps its flow: same endpoint, same proxy socket.
    for _ in 0..5 {
        assert_eq!(ask(&c1, to), first);
    }
    // Another client gets its own flow, on the other endpoint (round robin).
    let other = ask(&c2, to);
    assert_ne!(other.split(' ').next(), first.split(' ').next());
    // After the idle timeout the flow is gone: a new one (new socket).
    std::thread::sleep(Duration::from_millis(1200));
    let again = ask(&c1, to);
    assert_ne!(again, first, "flow outlived its idle timeout");
}

#[test]
fn udp_flows_move_when_their_endpoint_goes() {
    let (x, y) = (udp_server("x"), udp_server("y"));
    let mut p = proxier(|_| {});
    sync(&mut p, &state("127.0.0.25", Protocol::Udp, &[x]));
    let to = vip("127.0.0.25");
    let c = UdpSocket::bind("127.0.0.1:0").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(ask(&c, to).starts_with("x "));
    sync(&mut p, &state("127.0.0.25", Protocol::Udp, &[y]));
    assert!(
        ask(&c, to).starts_with("y "),
        "flow stayed on the removed endpoint"
    );
}

#[test]
fn listener_follows_endpoints_and_established_connections_stay() {
    let (a, b) = (echo_server(), echo_server());
    let mut p = proxier(|c| c.grace_period = Duration::from_secs(60));
    let vip_ip = "127.0.0.26";
    sync(&mut p, &state(vip_ip, Protocol::Tcp, &[a]));
    assert_eq!(p.listening(), vec![(vip(vip_ip), Protocol::Tcp)]);
    let mut held = TcpStream::connect(vip(vip_ip)).unwrap();
    held.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let echo = |s: &mut TcpStream, m: &[u8]| {
        s.write_all(m).unwrap();
        let mut got = vec![0u8; m.len()];
        s.read_exact(&mut got).unwrap();
        assert_eq!(got, m);
    };
    echo(&mut held, b"one");
    // Endpoints change (a removed, b added): the held connection lives on
    // through the grace period.
    sync(&mut p, &state(vip_ip, Protocol::Tcp, &[b]));
    echo(&mut held, b"two");
    // No endpoints: the port closes and new clients are refused at once,
    // but the open connection still works.
    sync(&mut p, &state(vip_ip, Protocol::Tcp, &[]));
    assert!(p.listening().is_empty());
    std::thread::sleep(Duration::from_millis(100));
    let e = TcpStream::connect(vip(vip_ip)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    echo(&mut held, b"three");
}

#[test]
fn client_ip_affinity_sticks_until_its_timeout() {
    let (x, y) = (named_server("x"), named_server("y"));
    let mut p = proxier(|_| {});
    let vip_ip = "127.0.0.27";
    let mut st = state(vip_ip, Protocol::Tcp, &[x, y]);
    // Without affinity: round robin alternates.
    sync(&mut p, &st);
    let a = hello(vip(vip_ip));
    assert_ne!(hello(vip(vip_ip)), a);
    // sessionAffinity ClientIP, timeoutSeconds 1.
    let name = st.services.keys().next().unwrap().clone();
    let mut sp = (*st.services[&name]).clone();
    sp.session_affinity_timeout = Some(1);
    st.services.insert(name.clone(), Arc::new(sp));
    // A partial sync naming the changed Service port.
    p.sync(&st, &BTreeSet::from([name]), false)
        .unwrap_or_else(|e| panic!("{e}"));
    let first = hello(vip(vip_ip));
    for _ in 0..10 {
        assert_eq!(hello(vip(vip_ip)), first, "affinity not kept");
    }
    // Each connection refreshes the entry; after a quiet second it is gone
    // and round robin moves on to the other endpoint.
    std::thread::sleep(Duration::from_millis(1300));
    assert_ne!(hello(vip(vip_ip)), first, "affinity outlived its timeout");
}

/// A Service port named `name` on `vip`:PORT (an externalIP) sending to `eps`,
/// added to `st`.
fn put(st: &mut ProxyState, name: &str, vip: &str, eps: &[SocketAddr]) -> ServicePortName {
    let one = state(vip, Protocol::Tcp, eps);
    let old = ServicePortName::new("t", "svc", "p", Protocol::Tcp);
    let new = ServicePortName::new("t", name, "p", Protocol::Tcp);
    let mut sp = (*one.services[&old]).clone();
    sp.name = new.clone();
    st.services.insert(new.clone(), Arc::new(sp));
    st.endpoints
        .insert(new.clone(), one.endpoints[&old].clone());
    new
}

/// A partial sync naming `changed`; it must stay partial.
fn partial(p: &mut UserspaceProxier, st: &ProxyState, changed: &[&ServicePortName]) -> SyncReport {
    let changed: BTreeSet<ServicePortName> = changed.iter().map(|n| (*n).clone()).collect();
    let r = p
        .sync(st, &changed, false)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!r.full, "the partial sync fell back to a full one");
    r
}

#[test]
fn partial_sync_hands_a_contested_port_to_the_next_claimant() {
    let (x, y) = (named_server("a"), named_server("b"));
    let mut p = proxier(|_| {});
    let vip_ip = "127.0.0.28";
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::default());
    // Both claim vip_ip:PORT; "a" comes first in name order and wins.
    let a = put(&mut st, "a", vip_ip, &[x]);
    let b = put(&mut st, "b", vip_ip, &[y]);
    sync(&mut p, &st);
    assert_eq!(hello(vip(vip_ip)), "a");
    // The winner deleted: the loser gets the port at once.
    st.services.remove(&a);
    st.endpoints.remove(&a);
    partial(&mut p, &st, &[&a]);
    assert_eq!(p.listening(), vec![(vip(vip_ip), Protocol::Tcp)]);
    assert_eq!(hello(vip(vip_ip)), "b");
    // Back again: it wins again.
    let a = put(&mut st, "a", vip_ip, &[x]);
    partial(&mut p, &st, &[&a]);
    assert_eq!(hello(vip(vip_ip)), "a");
    // The loser going leaves the winner alone.
    st.services.remove(&b);
    st.endpoints.remove(&b);
    let r = partial(&mut p, &st, &[&b]);
    assert_eq!(r.ops, 1, "only the retired Service, no listener touched");
    assert_eq!(hello(vip(vip_ip)), "a");
}

#[test]
fn partial_syncs_close_and_reopen_a_listener_as_endpoints_go_and_come() {
    let x = named_server("x");
    let mut p = proxier(|_| {});
    let vip_ip = "127.0.0.29";
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::default());
    let s = put(&mut st, "s", vip_ip, &[x]);
    // An unrelated Service next to it, untouched by the changes below.
    let other = named_server("other");
    put(&mut st, "u", "127.0.0.30", &[other]);
    sync(&mut p, &st);
    assert_eq!(hello(vip(vip_ip)), "x");
    put(&mut st, "s", vip_ip, &[]);
    partial(&mut p, &st, &[&s]);
    assert_eq!(p.listening(), vec![(vip("127.0.0.30"), Protocol::Tcp)]);
    // The aborted listener task drops its socket on a runtime thread.
    std::thread::sleep(Duration::from_millis(100));
    let e = TcpStream::connect(vip(vip_ip)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    put(&mut st, "s", vip_ip, &[x]);
    partial(&mut p, &st, &[&s]);
    assert_eq!(hello(vip(vip_ip)), "x");
    assert_eq!(hello(vip("127.0.0.30")), "other");
}

#[test]
fn a_listener_that_failed_to_open_is_retried_by_partial_syncs() {
    let x = named_server("x");
    let vip_ip = "127.0.0.31";
    // Another program holds the port.
    let squatter = TcpListener::bind(vip(vip_ip)).unwrap();
    let mut p = proxier(|_| {});
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::default());
    put(&mut st, "s", vip_ip, &[x]);
    sync(&mut p, &st);
    assert!(p.listening().is_empty());
    drop(squatter);
    // Nothing changed, yet the port is tried again.
    partial(&mut p, &st, &[]);
    assert_eq!(hello(vip(vip_ip)), "x");
}

#[test]
fn partial_syncs_keep_the_no_local_endpoints_count() {
    let x = named_server("x");
    let mut p = proxier(|_| {});
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::default());
    // internalTrafficPolicy Local and its only endpoint on another node.
    let s = put(&mut st, "s", "127.0.0.32", &[x]);
    let mut sp = (*st.services[&s]).clone();
    sp.internal_policy_local = true;
    st.services.insert(s.clone(), Arc::new(sp));
    let mut remote = endpoint(x);
    remote.is_local = false;
    st.endpoints.insert(s.clone(), Arc::new(vec![remote]));
    let u = put(&mut st, "u", "127.0.0.33", &[x]);
    let r = p.sync(&st, &BTreeSet::new(), true).unwrap();
    assert_eq!(r.no_local_endpoints, (1, 0));
    // Another Service changing keeps the count.
    put(&mut st, "u", "127.0.0.33", &[]);
    assert_eq!(partial(&mut p, &st, &[&u]).no_local_endpoints, (1, 0));
    // A local endpoint appearing clears it, going brings it back...
    st.endpoints.insert(s.clone(), Arc::new(vec![endpoint(x)]));
    assert_eq!(partial(&mut p, &st, &[&s]).no_local_endpoints, (0, 0));
    let mut remote = endpoint(x);
    remote.is_local = false;
    st.endpoints.insert(s.clone(), Arc::new(vec![remote]));
    assert_eq!(partial(&mut p, &st, &[&s]).no_local_endpoints, (1, 0));
    // ...and the Service going takes its share with it.
    st.services.remove(&s);
    st.endpoints.remove(&s);
    assert_eq!(partial(&mut p, &st, &[&s]).no_local_endpoints, (0, 0));
}

#[test]
fn a_change_the_caller_did_not_name_falls_back_to_a_full_sync() {
    let x = named_server("x");
    let mut p = proxier(|_| {});
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::default());
    put(&mut st, "s", "127.0.0.34", &[x]);
    sync(&mut p, &st);
    put(&mut st, "t", "127.0.0.35", &[x]);
    let r = p.sync(&st, &BTreeSet::new(), false).unwrap();
    assert!(r.full);
    assert_eq!(hello(vip("127.0.0.35")), "x");
}

/// Runs `f` on a thread of its own in a network namespace of its own (made
/// and gone with the thread), so Service IPs go to that namespace's lo.
/// Needs root, as ./test.sh runs; the proxy's runtime must be started
/// before, in the caller's namespace.
fn in_fresh_netns(f: impl FnOnce() + Send + 'static) {
    std::thread::spawn(move || {
        // SAFETY: unshare(2) with a namespace flag, for this thread only.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            panic!(
                "unshare(CLONE_NEWNET) (this test needs root): {}",
                std::io::Error::last_os_error()
            );
        }
        f()
    })
    .join()
    .unwrap_or_else(|e| std::panic::resume_unwind(e));
}

/// Service IPs on lo follow partial syncs (root: in a network namespace of
/// its own).
#[test]
fn service_ips_follow_partial_syncs_in_a_network_namespace() {
    // The shared runtime's threads must start in this namespace, not the new one.
    let rt = kp_userspace::runtime().unwrap();
    in_fresh_netns(move || {
        let mut c = UserspaceConfig::new(IpFamily::V4);
        c.vip_mode = VipMode::Loopback;
        let mut p = UserspaceProxier::new(c, Arc::new(NoMetrics), rt).unwrap();
        let mut rtnl = kp_userspace::netlink::Rtnl::open().unwrap();
        let mut st = ProxyState::new(IpFamily::V4, NodeInfo::default());
        let ep: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let add = |st: &mut ProxyState, name: &str, ip: &str, port: u16| {
            let sp = ServicePort::builder("t", name)
                .port_name("p")
                .cluster_ip(ip)
                .port(port)
                .build();
            let n = sp.name.clone();
            st.services.insert(n.clone(), Arc::new(sp));
            st.endpoints.insert(n.clone(), Arc::new(vec![endpoint(ep)]));
            n
        };
        let a = add(&mut st, "a", "10.96.0.50", 80);
        let b = add(&mut st, "b", "10.96.0.50", 81);
        let c = add(&mut st, "c", "10.96.0.51", 80);
        let d = add(&mut st, "d", "10.96.0.51", 80);
        let mut check = |p: &UserspaceProxier, vips: &[&str], listening: &[&str]| {
            let mut ours: Vec<String> = rtnl
                .list_ours()
                .unwrap()
                .iter()
                .map(|i| i.to_string())
                .collect();
            ours.sort();
            assert_eq!(ours, vips);
            let l: Vec<String> = p.listening().iter().map(|(a, _)| a.to_string()).collect();
            assert_eq!(l, listening);
        };
        sync(&mut p, &st);
        let all = ["10.96.0.50:80", "10.96.0.50:81", "10.96.0.51:80"];
        check(&p, &["10.96.0.50", "10.96.0.51"], &all);
        let drop_port = |st: &mut ProxyState, n: &ServicePortName| {
            st.services.remove(n);
            st.endpoints.remove(n);
        };
        // An address two ports use stays until both are gone.
        drop_port(&mut st, &a);
        partial(&mut p, &st, &[&a]);
        check(&p, &["10.96.0.50", "10.96.0.51"], &all[1..]);
        drop_port(&mut st, &b);
        partial(&mut p, &st, &[&b]);
        check(&p, &["10.96.0.51"], &all[2..]);
        // The winner of 10.96.0.51:80 going: the other claimant takes over.
        drop_port(&mut st, &c);
        partial(&mut p, &st, &[&c]);
        check(&p, &["10.96.0.51"], &all[2..]);
        // No endpoints: no listener, the address stays.
        st.endpoints.remove(&d);
        partial(&mut p, &st, &[&d]);
        check(&p, &["10.96.0.51"], &[]);
        let e = add(&mut st, "e", "10.96.0.52", 80);
        partial(&mut p, &st, &[&e]);
        check(&p, &["10.96.0.51", "10.96.0.52"], &["10.96.0.52:80"]);
        drop_port(&mut st, &d);
        partial(&mut p, &st, &[&d]);
        check(&p, &["10.96.0.52"], &["10.96.0.52:80"]);
        // A full sync finds nothing to fix: only the Services are updated.
        let r = p.sync(&st, &BTreeSet::new(), true).unwrap();
        assert_eq!(r.ops, st.services.len());
        p.cleanup().unwrap();
        check(&p, &[], &[]);
    });
}

/// The kernel's address notifications, not a listing per sync: a node
/// address added by someone else makes the next sync a full one (a new
/// NodePort address gets its listener), and one of our Service IPs removed
/// by someone else is reported lost once, then put back by a full sync.
/// Root: in a network namespace of its own.
#[test]
fn address_changes_are_noticed_from_notifications_in_a_network_namespace() {
    let rt = kp_userspace::runtime().unwrap();
    in_fresh_netns(move || {
        // `ip` runs in this thread's namespace (a child inherits it).
        let ip = |args: &[&str]| {
            let out = std::process::Command::new("ip")
                .args(args)
                .output()
                .unwrap();
            assert!(out.status.success(), "ip {args:?}: {out:?}");
        };
        let mut c = UserspaceConfig::new(IpFamily::V4);
        c.vip_mode = VipMode::Loopback;
        c.nodeport_addresses = vec!["10.200.0.0/16".parse().unwrap()];
        let mut p = UserspaceProxier::new(c, Arc::new(NoMetrics), rt).unwrap();
        let mut st = ProxyState::new(IpFamily::V4, NodeInfo::default());
        let sp = ServicePort::builder("t", "np")
            .port_name("p")
            .cluster_ip("10.96.0.60")
            .node_port(30080)
            .build();
        let n = sp.name.clone();
        st.services.insert(n.clone(), Arc::new(sp));
        st.endpoints.insert(
            n.clone(),
            Arc::new(vec![endpoint("127.0.0.1:9".parse().unwrap())]),
        );
        let listening = |p: &UserspaceProxier| -> Vec<String> {
            p.listening().iter().map(|(a, _)| a.to_string()).collect()
        };
        sync(&mut p, &st);
        assert_eq!(listening(&p), ["10.96.0.60:80"]);
        assert!(!p.rules_lost());
        // Nothing happened: a sync naming nothing stays partial.
        partial(&mut p, &st, &[]);

        // A node address in --nodeport-addresses appears.
        ip(&["addr", "add", "10.200.0.1/32", "dev", "lo"]);
        let r = p.sync(&st, &BTreeSet::new(), false).unwrap();
        assert!(r.full, "a new node address must make the sync a full one");
        assert_eq!(listening(&p), ["10.96.0.60:80", "10.200.0.1:30080"]);
        assert!(!p.rules_lost(), "a foreign address is not one of ours");
        partial(&mut p, &st, &[]);
        // ...and goes.
        ip(&["addr", "del", "10.200.0.1/32", "dev", "lo"]);
        let r = p.sync(&st, &BTreeSet::new(), false).unwrap();
        assert!(r.full);
        assert_eq!(listening(&p), ["10.96.0.60:80"]);

        // Our Service IP removed behind our back: lost, once.
        ip(&["addr", "del", "10.96.0.60/32", "dev", "lo"]);
        assert!(p.rules_lost());
        p.sync(&st, &BTreeSet::new(), true).unwrap();
        assert!(!p.rules_lost(), "the full sync put it back");
        let ours = kp_userspace::netlink::Rtnl::open()
            .unwrap()
            .list_ours()
            .unwrap();
        assert_eq!(ours, ["10.96.0.60".parse::<std::net::IpAddr>().unwrap()]);
        // Our own removal (the Service going) is not a loss.
        st.services.remove(&n);
        st.endpoints.remove(&n);
        partial(&mut p, &st, &[&n]);
        assert!(!p.rules_lost());
        assert!(listening(&p).is_empty());
    });
}

/// Records which Services' series are dropped.
#[derive(Default)]
struct GoneSink(std::sync::Mutex<Vec<String>>);

impl kp_userspace::MetricsSink for GoneSink {
    fn connection_opened(&self, _: &str) {}
    fn connection_closed(&self, _: &str) {}
    fn bytes(&self, _: &str, _: kp_userspace::Direction, _: u64) {}
    fn error(&self, _: &str) {}
    fn service_gone(&self, service: &str) {
        self.0.lock().unwrap().push(service.to_string());
    }
}

/// A deleted Service's series go (once its listeners and connections are
/// gone, after the grace period), so Services churned away leave no series behind; a Service that
/// stays keeps them.
#[test]
fn a_deleted_services_metrics_go() {
    let sink = Arc::new(GoneSink::default());
    let mut c = UserspaceConfig::new(IpFamily::V4);
    c.vip_mode = VipMode::None;
    // A removed endpoint's connections are closed after this grace.
    c.grace_period = Duration::from_millis(200);
    let mut p = UserspaceProxier::new(c, sink.clone(), kp_userspace::runtime().unwrap()).unwrap();
    let ep = named_server("gone");
    let s = state("127.0.0.71", Protocol::Tcp, &[ep]);
    sync(&mut p, &s);
    assert_eq!(hello(vip("127.0.0.71")), "gone");
    sync(&mut p, &s);
    assert!(
        sink.0.lock().unwrap().is_empty(),
        "a live Service's series went"
    );
    sync(&mut p, &ProxyState::new(IpFamily::V4, NodeInfo::default()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while sink.0.lock().unwrap().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(*sink.0.lock().unwrap(), vec!["t/svc:p".to_string()]);
}
