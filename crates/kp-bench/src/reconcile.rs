//! `kp-bench reconcile`: what one conntrack reconcile costs against the real kernel: a state of
//! SERVICES UDP Services (two endpoints each, every tenth with a NodePort)
//! and a table of UDP_FLOWS UDP flows to them (one in ten stale) plus
//! TCP_FLOWS TCP flows, written over ctnetlink in a throwaway namespace.
//! Prints the dump, the decision and the deletes, then a second reconcile
//! (nothing stale left: what a sync pays in steady state).
//! Needs root.

use std::net::{IpAddr, Ipv4Addr};
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

use anyhow::{bail, Context, Result};

use crate::netns;

/// `kp-bench reconcile`.
#[derive(clap::Args, Debug, Clone)]
pub struct ReconcileArgs {
    /// UDP Services in the state (two endpoints each, every tenth with a
    /// NodePort).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    services: u32,
    /// UDP flows to them in the conntrack table (one in ten to an endpoint
    /// that is gone: stale).
    #[arg(long, default_value_t = 3000)]
    udp_flows: u32,
    /// TCP flows beside them (never stale: a reconcile skips them).
    #[arg(long, default_value_t = 3000)]
    tcp_flows: u32,
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
fn create(flows: &[Flow]) -> Result<()> {
    let mut sock = Socket::open(NlProtocol::Netfilter).context("opening a netfilter socket")?;
    for f in flows {
        let (Some(reply_src), Some(reply_sport)) = (f.reply_src, f.reply_sport) else {
            bail!("{f:?}: no reply tuple");
        };
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
            .with_context(|| format!("creating {f:?}"))?;
    }
    Ok(())
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// `kp-bench reconcile`.
pub fn run(a: ReconcileArgs) -> Result<()> {
    let (services, udp_flows, tcp_flows) = (a.services, a.udp_flows, a.tcp_flows);

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
    let _g = netns::add(&ns)?;
    let nft = std::process::Command::new("ip")
        .args([
            "netns", "exec", &ns, "nft",
            "add table inet track; add chain inet track out { type filter hook output priority 0; }; add rule inet track out ct state new counter",
        ])
        .status()
        .context("running nft")?;
    if !nft.success() {
        bail!("nft could not add the counting table in {ns}");
    }

    let report = kp_netlab::in_netns(&ns, move || -> Result<Vec<String>> {
        let t = Instant::now();
        create(&flows)?;
        let created = t.elapsed();
        let mut ct = ConntrackNetlink;
        let mut lines = vec![format!(
            "{services} UDP Services, {udp_flows} UDP + {tcp_flows} TCP flows written in {}",
            ms(created)
        )];
        for round in ["first reconcile", "second reconcile (nothing stale)"] {
            let t = Instant::now();
            let listed = ct.list_udp(IpFamily::V4).context("listing UDP flows")?;
            let dumped = t.elapsed();
            let n = listed.len();
            let t = Instant::now();
            let stale = stale_flows(&st, &[], listed, false);
            let decided = t.elapsed();
            let t = Instant::now();
            let done = ct.delete_flows(IpFamily::V4, &stale);
            let deleted = t.elapsed();
            if done.failed > 0 {
                bail!("{round}: {} deletes failed", done.failed);
            }
            lines.push(format!(
                "{round}: dump {} ({n} UDP entries), decide {} (index of the state + verdicts), delete {} ({} entries); total {}",
                ms(dumped),
                ms(decided),
                ms(deleted),
                done.deleted,
                ms(dumped + decided + deleted)
            ));
        }
        Ok(lines)
    })??;
    for l in report {
        println!("{l}");
    }
    Ok(())
}
