//! Deleting stale UDP conntrack entries after endpoints change: over netlink
//! ([`ConntrackNetlink`], the default) or with the `conntrack` program
//! ([`ConntrackCli`], `KUBE_PROXY_RS_CONNTRACK=cli`).

use std::net::IpAddr;
use std::process::Command;

use kp_model::{IpFamily, Protocol, StaleConntrack};

/// Deletes conntrack entries matching filters; returns how many went.
pub trait Conntrack: Send {
    fn delete(&mut self, family: IpFamily, filters: &[StaleConntrack]) -> u64;
}

/// The `conntrack` program (conntrack-tools): the fallback, same filters.
pub struct ConntrackCli;

impl Conntrack for ConntrackCli {
    fn delete(&mut self, family: IpFamily, filters: &[StaleConntrack]) -> u64 {
        let mut total = 0;
        for f in filters {
            let mut args: Vec<String> = vec![
                "-D".into(),
                "-f".into(),
                match family {
                    IpFamily::V4 => "ipv4".into(),
                    IpFamily::V6 => "ipv6".into(),
                },
                "-p".into(),
                f.protocol.as_lower().into(),
                "--orig-port-dst".into(),
                f.orig_dport.to_string(),
            ];
            if let Some(ip) = f.orig_dst {
                args.push("--orig-dst".into());
                args.push(ip.to_string());
            }
            if let Some(ip) = f.reply_src {
                args.push("--reply-src".into());
                args.push(ip.to_string());
            }
            match Command::new("conntrack").args(&args).output() {
                Ok(out) => {
                    // "conntrack v1.4.7 (conntrack-tools): 2 flow entries have been deleted."
                    let text = String::from_utf8_lossy(&out.stderr);
                    let n = text
                        .split_whitespace()
                        .collect::<Vec<_>>()
                        .windows(2)
                        .find(|w| w[1] == "flow")
                        .and_then(|w| w[0].parse::<u64>().ok())
                        .unwrap_or(0);
                    tracing::debug!(filter = ?f, deleted = n, "conntrack cleanup");
                    total += n;
                }
                Err(e) => tracing::warn!(error = %e, "running conntrack failed"),
            }
        }
        total
    }
}

/// Conntrack over netlink (NETLINK_NETFILTER, ctnetlink), as upstream does it:
/// dump the family's entries, delete each one a filter matches by its
/// original tuple. No program is run, so it works on nodes without
/// conntrack-tools and costs one socket per cleanup instead of one process
/// per filter. Messages are encoded with netlink-packet-netfilter and sent
/// over kp-netlink's socket.
#[derive(Default)]
pub struct ConntrackNetlink;

/// One conntrack entry as far as the filters look at it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flow {
    pub proto: u8,
    pub orig_src: IpAddr,
    pub orig_dst: IpAddr,
    pub orig_sport: u16,
    pub orig_dport: u16,
    pub reply_src: Option<IpAddr>,
}

fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

/// Whether `filter` selects `flow` (every set field must match).
pub fn matches(filter: &StaleConntrack, flow: &Flow) -> bool {
    flow.proto == proto_number(filter.protocol)
        && flow.orig_dport == filter.orig_dport
        && filter.orig_dst.is_none_or(|ip| ip == flow.orig_dst)
        && filter.reply_src.is_none_or(|ip| Some(ip) == flow.reply_src)
}

impl Conntrack for ConntrackNetlink {
    fn delete(&mut self, family: IpFamily, filters: &[StaleConntrack]) -> u64 {
        if filters.is_empty() {
            return 0;
        }
        match ctnetlink::delete_matching(family, filters) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "conntrack cleanup over netlink failed");
                0
            }
        }
    }
}

mod ctnetlink {
    use std::io;
    use std::net::IpAddr;
    use std::time::Duration;

    use kp_model::{IpFamily, StaleConntrack};
    use kp_netlink::{Protocol as NlProtocol, Socket, Until};
    use netlink_packet_core::{
        NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST,
    };
    use netlink_packet_netfilter::conntrack::{
        ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol as CtProto, Tuple,
    };
    use netlink_packet_netfilter::{
        NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
    };

    use super::{matches, Flow};

    fn nf_family(family: IpFamily) -> NetfilterProtoFamily {
        match family {
            IpFamily::V4 => NetfilterProtoFamily::IPv4,
            IpFamily::V6 => NetfilterProtoFamily::IPv6,
        }
    }

    fn encode(family: IpFamily, flags: u16, seq: u32, msg: ConntrackMessage) -> Vec<u8> {
        let mut hdr = NetlinkHeader::default();
        hdr.flags = flags;
        hdr.sequence_number = seq;
        let mut packet = NetlinkMessage::new(
            hdr,
            NetlinkPayload::from(NetfilterMessage::new(
                NetfilterHeader::new(nf_family(family), 0, 0),
                msg,
            )),
        );
        packet.finalize();
        let mut buf = vec![0; packet.buffer_len()];
        packet.serialize(&mut buf);
        buf
    }

    /// (src, dst, proto, sport, dport) of one tuple attribute.
    type Parts = (
        Option<IpAddr>,
        Option<IpAddr>,
        Option<u8>,
        Option<u16>,
        Option<u16>,
    );

    fn tuple_parts(tuple: &[Tuple]) -> Parts {
        let mut p: Parts = (None, None, None, None, None);
        for t in tuple {
            match t {
                Tuple::Ip(ips) => {
                    for ip in ips {
                        match ip {
                            IPTuple::SourceAddress(a) => p.0 = Some(*a),
                            IPTuple::DestinationAddress(a) => p.1 = Some(*a),
                            _ => {}
                        }
                    }
                }
                Tuple::Proto(ps) => {
                    for x in ps {
                        match x {
                            ProtoTuple::Protocol(n) => p.2 = Some(u8::from(*n)),
                            ProtoTuple::SourcePort(n) => p.3 = Some(*n),
                            ProtoTuple::DestinationPort(n) => p.4 = Some(*n),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        p
    }

    /// The flow an entry describes; None for entries without ports (ICMP...).
    pub(super) fn flow_of(attrs: &[ConntrackAttribute]) -> Option<Flow> {
        let mut orig = None;
        let mut reply = None;
        for a in attrs {
            match a {
                ConntrackAttribute::CtaTupleOrig(t) => orig = Some(tuple_parts(t)),
                ConntrackAttribute::CtaTupleReply(t) => reply = Some(tuple_parts(t)),
                _ => {}
            }
        }
        let (src, dst, proto, sport, dport) = orig?;
        Some(Flow {
            proto: proto?,
            orig_src: src?,
            orig_dst: dst?,
            orig_sport: sport?,
            orig_dport: dport?,
            reply_src: reply.and_then(|r| r.0),
        })
    }

    fn orig_tuple(f: &Flow) -> ConntrackAttribute {
        ConntrackAttribute::CtaTupleOrig(vec![
            Tuple::Ip(vec![
                IPTuple::SourceAddress(f.orig_src),
                IPTuple::DestinationAddress(f.orig_dst),
            ]),
            Tuple::Proto(vec![
                ProtoTuple::Protocol(CtProto::from(f.proto)),
                ProtoTuple::SourcePort(f.orig_sport),
                ProtoTuple::DestinationPort(f.orig_dport),
            ]),
        ])
    }

    /// The flow of one dump answer (a whole netlink message); None for
    /// entries without ports and messages that do not decode.
    fn flow_of_message(bytes: &[u8]) -> Option<Flow> {
        match NetlinkMessage::<NetfilterMessage>::deserialize(bytes) {
            Ok(NetlinkMessage {
                payload: NetlinkPayload::InnerMessage(nf),
                ..
            }) => match &nf.inner {
                NetfilterMessageInner::Conntrack(
                    ConntrackMessage::New(attrs) | ConntrackMessage::Get(attrs),
                ) => flow_of(attrs),
                _ => None,
            },
            Ok(_) => None,
            Err(e) => {
                tracing::debug!(error = %e, "skipping an undecodable conntrack message");
                None
            }
        }
    }

    fn dump(sock: &mut Socket, family: IpFamily) -> io::Result<Vec<Flow>> {
        let seq = sock.next_seq();
        let msg = encode(
            family,
            NLM_F_REQUEST | NLM_F_DUMP,
            seq,
            ConntrackMessage::Get(vec![]),
        );
        // Decoded as they arrive: a busy node's table is large.
        let mut flows = Vec::new();
        sock.request_each(&msg, seq, Until::Done, |m| {
            flows.extend(flow_of_message(m.bytes));
        })
        .map_err(|e| with_context("dumping the conntrack table", e.into()))?;
        Ok(flows)
    }

    fn with_context(what: &str, e: io::Error) -> io::Error {
        io::Error::new(e.kind(), format!("{what}: {e}"))
    }

    pub(super) fn delete_matching(family: IpFamily, filters: &[StaleConntrack]) -> io::Result<u64> {
        let mut sock = Socket::open(NlProtocol::Netfilter)
            .map_err(|e| with_context("opening a netfilter netlink socket", e))?;
        // A dump must never block forever if the kernel stops answering.
        sock.set_recv_timeout(Duration::from_secs(5))
            .map_err(|e| with_context("setting the netlink receive timeout", e))?;
        let flows = dump(&mut sock, family)?;
        let mut deleted = 0;
        for flow in flows
            .iter()
            .filter(|fl| filters.iter().any(|f| matches(f, fl)))
        {
            let seq = sock.next_seq();
            let msg = encode(
                family,
                NLM_F_REQUEST | NLM_F_ACK,
                seq,
                ConntrackMessage::Delete(vec![orig_tuple(flow)]),
            );
            // One ack per delete; ENOENT means it expired meanwhile.
            match sock.request(&msg, seq, Until::Ack) {
                Ok(_) => {
                    deleted += 1;
                    tracing::debug!(?flow, "deleted a stale conntrack entry");
                }
                Err(e) if e.errno() == Some(libc::ENOENT) => {}
                Err(kp_netlink::Error::Kernel(errno)) => {
                    tracing::warn!(?flow, error = %io::Error::from_raw_os_error(errno), "deleting a conntrack entry failed")
                }
                Err(kp_netlink::Error::Io(e)) => {
                    return Err(with_context("deleting a conntrack entry", e))
                }
            }
        }
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(dst: &str, dport: u16, reply: &str) -> Flow {
        Flow {
            proto: 17,
            orig_src: "10.0.0.1".parse().unwrap(),
            orig_dst: dst.parse().unwrap(),
            orig_sport: 40000,
            orig_dport: dport,
            reply_src: Some(reply.parse().unwrap()),
        }
    }

    #[test]
    fn filters_match_every_set_field() {
        let f = StaleConntrack {
            protocol: Protocol::Udp,
            orig_dst: Some("10.96.0.10".parse().unwrap()),
            orig_dport: 53,
            reply_src: Some("10.244.1.5".parse().unwrap()),
        };
        assert!(matches(&f, &flow("10.96.0.10", 53, "10.244.1.5")));
        assert!(!matches(&f, &flow("10.96.0.10", 53, "10.244.1.6")));
        assert!(!matches(&f, &flow("10.96.0.11", 53, "10.244.1.5")));
        assert!(!matches(&f, &flow("10.96.0.10", 54, "10.244.1.5")));
        let mut tcp = flow("10.96.0.10", 53, "10.244.1.5");
        tcp.proto = 6;
        assert!(!matches(&f, &tcp));
        // NodePort filters: any destination, any endpoint.
        let any = StaleConntrack {
            protocol: Protocol::Udp,
            orig_dst: None,
            orig_dport: 30053,
            reply_src: None,
        };
        assert!(matches(&any, &flow("192.168.1.1", 30053, "10.244.9.9")));
    }
}
