//! What one conntrack reconcile costs against the real kernel: a state of
//! SERVICES UDP Services (two endpoints each, every tenth with a NodePort)
//! and a table of UDP_FLOWS UDP flows to them (one in ten stale) plus
//! TCP_FLOWS TCP flows, written over ctnetlink in a throwaway namespace.
//! Prints the dump, the decision and the deletes, then a second reconcile
//! (nothing stale left: what a sync pays in steady state).
//!
//! As root: `cargo run --release -p kp-sync --example reconcile_bench --
//! [SERVICES] [UDP_FLOWS] [TCP_FLOWS]` (defaults 10000 3000 3000).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: a panic is its failure

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_model::{Endpoint, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName};
use kp_netlink::{Protocol as NlProtocol, Socket, Until};
use kp_sync::conntrack::{Conntrack, ConntrackNetlink, Flow};
use kp_sync::reconcile::stale_flows;
use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol as CtProto, Tuple,
};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};

struct Ns(String);
impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn cluster_ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 96, (i / 250) as u8, (i % 250 + 1) as u8))
}

fn endpoint_ip(i: u32, k: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(
        10,
        (100 + k) as u8,
        (i / 250) as u8,
        (i % 250 + 1) as u8,
    ))
}

fn state(services: u32) -> ProxyState {
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::default());
    for i in 0..services {
        let name = ServicePortName::new("bench", &format!("s{i}"), "dns", Protocol::Udp);
        let mut sp = ServicePort::new(name.clone(), cluster_ip(i), 53);
        if i % 10 == 0 {
            sp.node_port = 30000 + (i / 10 % 2700) as u16;
        }
        st.services.insert(name.clone(), Arc::new(sp));
        st.endpoints.insert(
            name,
            Arc::new(
                (0..2)
                    .map(|k| Endpoint::ready(endpoint_ip(i, k), 8053, false))
                    .collect(),
            ),
        );
    }
    st
}

fn tuple(src: IpAddr, dst: IpAddr, proto: u8, sport: u16, dport: u16) -> Vec<Tuple> {
    vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(src),
            IPTuple::DestinationAddress(dst),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(CtProto::from(proto)),
            ProtoTuple::SourcePort(sport),
            ProtoTuple::DestinationPort(dport),
        ]),
    ]
}

/// Writes `flows` (DNATed as their reply source says) into the current
/// namespace's table.
fn create(flows: &[Flow]) {
    let mut sock = Socket::open(NlProtocol::Netfilter).unwrap();
    for f in flows {
        let reply_src = f.reply_src.unwrap();
        let reply_sport = f.reply_sport.unwrap();
        let mut attrs = vec![
            ConntrackAttribute::CtaTupleOrig(tuple(
                f.orig_src,
                f.orig_dst,
                f.proto,
                f.orig_sport,
                f.orig_dport,
            )),
            ConntrackAttribute::CtaTupleReply(tuple(
                reply_src,
                f.orig_src,
                f.proto,
                reply_sport,
                f.orig_sport,
            )),
            ConntrackAttribute::CtaTimeout(600),
        ];
        if f.proto == 6 {
            // TCP entries need a state: CTA_PROTOINFO { CTA_PROTOINFO_TCP {
            // CTA_PROTOINFO_TCP_STATE = ESTABLISHED } }.
            let state = [5u8, 0, 1, 0, 3, 0, 0, 0];
            let mut tcp = Vec::new();
            tcp.extend_from_slice(&12u16.to_ne_bytes());
            tcp.extend_from_slice(&(1u16 | 1 << 15).to_ne_bytes());
            tcp.extend_from_slice(&state);
            attrs.push(ConntrackAttribute::Other(
                netlink_packet_core::DefaultNla::new(4, tcp),
            ));
        }
        let seq = sock.next_seq();
        let mut hdr = NetlinkHeader::default();
        hdr.flags = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK;
        hdr.sequence_number = seq;
        let mut packet = NetlinkMessage::new(
            hdr,
            NetlinkPayload::from(NetfilterMessage::new(
                NetfilterHeader::new(NetfilterProtoFamily::IPv4, 0, 0),
                ConntrackMessage::New(attrs),
            )),
        );
        packet.finalize();
        let mut buf = vec![0; packet.buffer_len()];
        packet.serialize(&mut buf);
        sock.request(&buf, seq, Until::Ack)
            .unwrap_or_else(|e| panic!("creating {f:?}: {e}"));
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn main() {
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: SERVICES UDP_FLOWS TCP_FLOWS"))
        .collect();
    let services = args.first().copied().unwrap_or(10_000);
    let udp_flows = args.get(1).copied().unwrap_or(3000);
    let tcp_flows = args.get(2).copied().unwrap_or(3000);

    let st = state(services);
    let client = |n: u32| IpAddr::V4(Ipv4Addr::new(10, 244, (n / 250) as u8, (n % 250 + 1) as u8));
    let mut flows = Vec::new();
    for n in 0..udp_flows {
        let svc = n * 7 % services;
        // One in ten went to an endpoint that is gone.
        let reply = if n % 10 == 0 {
            endpoint_ip(svc, 7)
        } else {
            endpoint_ip(svc, n % 2)
        };
        flows.push(Flow {
            proto: 17,
            orig_src: client(n),
            orig_dst: cluster_ip(svc),
            orig_sport: 20000 + (n % 40000) as u16,
            orig_dport: 53,
            reply_src: Some(reply),
            reply_sport: Some(8053),
        });
    }
    for n in 0..tcp_flows {
        let svc = n * 11 % services;
        flows.push(Flow {
            proto: 6,
            orig_src: client(n),
            orig_dst: cluster_ip(svc),
            orig_sport: 20000 + (n % 40000) as u16,
            orig_dport: 80,
            reply_src: Some(endpoint_ip(svc, 0)),
            reply_sport: Some(8080),
        });
    }

    let ns = format!("kprcb{}", std::process::id());
    assert!(Command::new("ip")
        .args(["netns", "add", &ns])
        .status()
        .unwrap()
        .success());
    let _g = Ns(ns.clone());
    let nft = Command::new("ip")
        .args([
            "netns", "exec", &ns, "nft",
            "add table inet track; add chain inet track out { type filter hook output priority 0; }; add rule inet track out ct state new counter",
        ])
        .status()
        .unwrap();
    assert!(nft.success());

    let report = kp_netlab::in_netns(&ns, move || {
        let t = Instant::now();
        create(&flows);
        let created = t.elapsed();
        let mut ct = ConntrackNetlink;
        let mut lines = vec![format!(
            "{services} UDP Services, {udp_flows} UDP + {tcp_flows} TCP flows written in {}",
            ms(created)
        )];
        for round in ["first reconcile", "second reconcile (nothing stale)"] {
            let t = Instant::now();
            let listed = ct.list_udp(IpFamily::V4).unwrap();
            let dumped = t.elapsed();
            let n = listed.len();
            let t = Instant::now();
            let stale = stale_flows(&st, &[], listed, false);
            let decided = t.elapsed();
            let t = Instant::now();
            let done = ct.delete_flows(IpFamily::V4, &stale);
            let deleted = t.elapsed();
            assert_eq!(done.failed, 0);
            lines.push(format!(
                "{round}: dump {} ({n} UDP entries), decide {} (index of the state + verdicts), delete {} ({} entries); total {}",
                ms(dumped),
                ms(decided),
                ms(deleted),
                done.deleted,
                ms(dumped + decided + deleted)
            ));
        }
        lines
    })
    .unwrap();
    for l in report {
        println!("{l}");
    }
}
