//! The netlink conntrack cleaner against the real kernel, in a throwaway
//! network namespace: it deletes exactly the entries a filter selects, for
//! both families, and counts them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::net::{SocketAddr, UdpSocket};
use std::process::Command;

use kp_model::{IpFamily, Protocol, StaleConntrack};
use kp_netlab::ScratchNs;
use kp_sync::conntrack::{Conntrack, ConntrackNetlink};

fn in_ns(ns: &str, argv: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns])
        .args(argv)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{argv:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Sends one datagram from `from` to `to` (nothing listens: the entry stays
/// UNREPLIED, which is enough for conntrack to list it).
fn flow(ns: &str, from: SocketAddr, to: SocketAddr) {
    kp_netlab::in_netns(ns, move || {
        let s = UdpSocket::bind(from).unwrap();
        s.send_to(b"x", to).unwrap();
    })
    .unwrap();
}

fn listed(ns: &str, family: &str) -> String {
    // `conntrack -L` prints to stdout; an empty table is not an error.
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "conntrack", "-L", "-f", family])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn netlink_cleaner_deletes_only_matching_entries() {
    let scratch = ScratchNs::unique("kpct").unwrap();
    let ns = scratch.name().to_string();
    // Conntrack only tracks a namespace once some rule uses it.
    in_ns(
        &ns,
        &[
            "nft",
            "add table inet track; add chain inet track out { type filter hook output priority 0; }; add rule inet track out ct state new counter",
        ],
    );
    let a: SocketAddr = "127.0.0.1:40001".parse().unwrap();
    let b: SocketAddr = "127.0.0.1:40002".parse().unwrap();
    flow(&ns, a, "127.0.0.2:53".parse().unwrap());
    flow(&ns, b, "127.0.0.2:53".parse().unwrap());
    flow(&ns, a, "127.0.0.3:53".parse().unwrap());
    flow(&ns, a, "127.0.0.2:54".parse().unwrap());
    flow(
        &ns,
        "[::1]:40001".parse().unwrap(),
        "[::1]:53".parse().unwrap(),
    );
    let before = listed(&ns, "ipv4");
    assert_eq!(
        before.lines().filter(|l| l.contains(" dport=53 [")).count(),
        3,
        "{before}"
    );

    let filter = StaleConntrack {
        protocol: Protocol::Udp,
        orig_dst: Some("127.0.0.2".parse().unwrap()),
        orig_dport: 53,
        reply_src: None,
    };
    let deleted = kp_netlab::in_netns(&ns, move || {
        ConntrackNetlink.delete(IpFamily::V4, &[filter])
    })
    .unwrap();
    assert_eq!(deleted, 2);
    let after = listed(&ns, "ipv4");
    assert!(
        !after.contains("dst=127.0.0.2 sport=40001 dport=53 "),
        "{after}"
    );
    assert!(
        !after.contains("dst=127.0.0.2 sport=40002 dport=53 "),
        "{after}"
    );
    assert!(
        after.contains("dst=127.0.0.3"),
        "other service's entry went: {after}"
    );
    assert!(
        after.contains("dport=54"),
        "other port's entry went: {after}"
    );
    assert!(
        listed(&ns, "ipv6").contains("dport=53"),
        "the IPv6 entry went"
    );

    // A reply-source filter (the endpoint a flow was DNATed to): for these
    // un-NATed entries the reply source is the original destination.
    let by_reply = StaleConntrack {
        protocol: Protocol::Udp,
        orig_dst: None,
        orig_dport: 53,
        reply_src: Some("127.0.0.3".parse().unwrap()),
    };
    let n = kp_netlab::in_netns(&ns, move || {
        ConntrackNetlink.delete(IpFamily::V4, &[by_reply])
    })
    .unwrap();
    assert_eq!(n, 1);
    assert!(!listed(&ns, "ipv4").contains("dst=127.0.0.3"));

    // IPv6, and TCP filters never touch UDP entries.
    let tcp = StaleConntrack {
        protocol: Protocol::Tcp,
        orig_dst: None,
        orig_dport: 53,
        reply_src: None,
    };
    let n =
        kp_netlab::in_netns(&ns, move || ConntrackNetlink.delete(IpFamily::V6, &[tcp])).unwrap();
    assert_eq!(n, 0);
    let udp6 = StaleConntrack {
        protocol: Protocol::Udp,
        orig_dst: Some("::1".parse().unwrap()),
        orig_dport: 53,
        reply_src: None,
    };
    let n =
        kp_netlab::in_netns(&ns, move || ConntrackNetlink.delete(IpFamily::V6, &[udp6])).unwrap();
    assert_eq!(n, 1);
    assert!(!listed(&ns, "ipv6").contains("dport=53"));
}

/// The reconciler's I/O: the filtered dump lists the family's UDP entries
/// only (a TCP one stays out), with the reply tuple's address and port, the
/// `conntrack` program lists the same, and deleting flows by their original
/// tuple removes exactly those (an already gone one counts as neither
/// deleted nor failed).
#[test]
fn udp_listing_and_flow_deletes() {
    use kp_sync::conntrack::ConntrackCli;
    let scratch = ScratchNs::unique("kpctl").unwrap();
    let ns = scratch.name().to_string();
    in_ns(
        &ns,
        &[
            "nft",
            "add table inet track; add chain inet track out { type filter hook output priority 0; }; add rule inet track out ct state new counter",
        ],
    );
    flow(
        &ns,
        "127.0.0.1:41001".parse().unwrap(),
        "127.0.0.2:53".parse().unwrap(),
    );
    flow(
        &ns,
        "127.0.0.1:41002".parse().unwrap(),
        "127.0.0.3:54".parse().unwrap(),
    );
    flow(
        &ns,
        "[::1]:41003".parse().unwrap(),
        "[::1]:55".parse().unwrap(),
    );
    // An established TCP connection, held open until the end.
    let _tcp = kp_netlab::in_netns(&ns, || {
        let l = std::net::TcpListener::bind("127.0.0.4:80").unwrap();
        let c = std::net::TcpStream::connect("127.0.0.4:80").unwrap();
        let a = l.accept().unwrap();
        (l, c, a)
    })
    .unwrap();
    assert!(
        listed(&ns, "ipv4").contains("tcp "),
        "{}",
        listed(&ns, "ipv4")
    );

    let mut v4 = kp_netlab::in_netns(&ns, || ConntrackNetlink.list_udp(IpFamily::V4))
        .unwrap()
        .unwrap();
    v4.sort_by_key(|f| f.orig_sport);
    assert_eq!(v4.len(), 2, "{v4:?}");
    assert!(v4.iter().all(|f| f.proto == 17), "{v4:?}");
    assert_eq!(v4[0].orig_dst.to_string(), "127.0.0.2");
    assert_eq!(v4[0].orig_dport, 53);
    assert_eq!(v4[0].reply_src.unwrap().to_string(), "127.0.0.2");
    assert_eq!(v4[0].reply_sport, Some(53));
    let mut cli = kp_netlab::in_netns(&ns, || ConntrackCli.list_udp(IpFamily::V4))
        .unwrap()
        .unwrap();
    cli.sort_by_key(|f| f.orig_sport);
    assert_eq!(cli, v4, "the conntrack program lists what netlink does");
    let v6 = kp_netlab::in_netns(&ns, || ConntrackNetlink.list_udp(IpFamily::V6))
        .unwrap()
        .unwrap();
    assert_eq!(v6.len(), 1, "{v6:?}");
    assert_eq!(v6[0].orig_dport, 55);

    let first = v4[0].clone();
    let done = kp_netlab::in_netns(&ns, move || {
        ConntrackNetlink.delete_flows(IpFamily::V4, &[first])
    })
    .unwrap();
    assert_eq!((done.deleted, done.failed), (1, 0));
    let again = v4[0].clone();
    let done = kp_netlab::in_netns(&ns, move || {
        ConntrackNetlink.delete_flows(IpFamily::V4, &[again])
    })
    .unwrap();
    assert_eq!((done.deleted, done.failed), (0, 0), "already gone");
    let after = listed(&ns, "ipv4");
    assert!(!after.contains("dport=53 "), "{after}");
    assert!(after.contains("dport=54 "), "{after}");
    // The program's delete, the same way.
    let second = v4[1].clone();
    let done = kp_netlab::in_netns(&ns, move || {
        ConntrackCli.delete_flows(IpFamily::V4, &[second])
    })
    .unwrap();
    assert_eq!((done.deleted, done.failed), (1, 0));
    assert!(!listed(&ns, "ipv4").contains("dport=54 "));
}
