//! The kernel side of stale UDP conntrack cleanup: listing a family's UDP
//! flows and deleting some, over netlink ([`ConntrackNetlink`], the
//! default) or with the `conntrack` program ([`ConntrackCli`],
//! `KUBE_PROXY_RS_CONNTRACK=cli`). Which flows are stale is decided in
//! [`crate::reconcile`], without I/O.

use std::net::IpAddr;
use std::process::Command;

use kp_model::{IpFamily, Protocol, StaleConntrack};

/// Why listing or deleting conntrack entries failed.
#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    /// A netlink or program step failed; `what` names the step.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The `conntrack` program ran but said no.
    #[error("{what}: {message}")]
    Refused { what: String, message: String },
}

impl ConntrackError {
    fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        ConntrackError::Io {
            what: what.into(),
            source,
        }
    }
}

/// What one [`Conntrack::delete_flows`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Deleted {
    /// Entries the kernel deleted.
    pub deleted: u64,
    /// Entries the kernel refused to delete, or that were not tried after an
    /// error: the reconciler tries again at the next sync. An entry already
    /// gone (expired meanwhile) is neither.
    pub failed: u64,
}

/// Lists and deletes conntrack entries of one IP family.
pub trait Conntrack: Send {
    /// Deletes the entries matching any of `filters`; returns how many went.
    fn delete(&mut self, family: IpFamily, filters: &[StaleConntrack]) -> u64 {
        if filters.is_empty() {
            return 0;
        }
        let flows = match self.list_udp(family) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(error = %e, "conntrack cleanup failed");
                return 0;
            }
        };
        let stale: Vec<Flow> = flows
            .into_iter()
            .filter(|fl| filters.iter().any(|f| matches(f, fl)))
            .collect();
        self.delete_flows(family, &stale).deleted
    }
    /// The family's UDP entries (others may be included where the kernel
    /// cannot filter; callers check `proto`).
    fn list_udp(&mut self, family: IpFamily) -> Result<Vec<Flow>, ConntrackError>;
    /// Deletes each flow by its original tuple.
    fn delete_flows(&mut self, family: IpFamily, flows: &[Flow]) -> Deleted;
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

    fn list_udp(&mut self, family: IpFamily) -> Result<Vec<Flow>, ConntrackError> {
        let fam = cli_family(family);
        let what = format!("running conntrack -L -f {fam} -p udp");
        let out = Command::new("conntrack")
            .args(["-L", "-f", fam, "-p", "udp"])
            .output()
            .map_err(|e| ConntrackError::io(what.as_str(), e))?;
        if !out.status.success() {
            return Err(ConntrackError::Refused {
                what,
                message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(parse_cli_line)
            .collect())
    }

    fn delete_flows(&mut self, family: IpFamily, flows: &[Flow]) -> Deleted {
        let mut done = Deleted::default();
        for f in flows {
            let args = [
                "-D".to_string(),
                "-f".into(),
                cli_family(family).into(),
                "-p".into(),
                f.proto.to_string(),
                "-s".into(),
                f.orig_src.to_string(),
                "-d".into(),
                f.orig_dst.to_string(),
                "--sport".into(),
                f.orig_sport.to_string(),
                "--dport".into(),
                f.orig_dport.to_string(),
            ];
            match Command::new("conntrack").args(&args).output() {
                Ok(out) if out.status.success() => done.deleted += 1,
                // "0 flow entries have been deleted": it expired meanwhile.
                Ok(out) if String::from_utf8_lossy(&out.stderr).contains(" 0 flow entries") => {}
                Ok(out) => {
                    tracing::warn!(?f, error = %String::from_utf8_lossy(&out.stderr).trim(), "deleting a conntrack entry failed");
                    done.failed += 1;
                }
                Err(e) => {
                    tracing::warn!(?f, error = %e, "running conntrack failed");
                    done.failed += 1;
                }
            }
        }
        done
    }
}

fn cli_family(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ipv4",
        IpFamily::V6 => "ipv6",
    }
}

/// One line of `conntrack -L`: "udp 17 29 src=A dst=B sport=1 dport=2
/// [UNREPLIED] src=C dst=D sport=3 dport=4 mark=0 use=1"; the first
/// src/dst/sport/dport are the original tuple, the second the reply's.
fn parse_cli_line(line: &str) -> Option<Flow> {
    let mut words = line.split_whitespace();
    words.next()?;
    let proto: u8 = words.next()?.parse().ok()?;
    let (mut src, mut dst, mut sport, mut dport) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for w in words {
        let Some((k, v)) = w.split_once('=') else {
            continue;
        };
        match k {
            "src" => src.push(v),
            "dst" => dst.push(v),
            "sport" => sport.push(v),
            "dport" => dport.push(v),
            _ => {}
        }
    }
    Some(Flow {
        proto,
        orig_src: src.first()?.parse().ok()?,
        orig_dst: dst.first()?.parse().ok()?,
        orig_sport: sport.first()?.parse().ok()?,
        orig_dport: dport.first()?.parse().ok()?,
        reply_src: src.get(1).and_then(|s| s.parse().ok()),
        reply_sport: sport.get(1).and_then(|s| s.parse().ok()),
    })
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
    /// The reply's source port: the endpoint's port for a DNATed flow.
    pub reply_sport: Option<u16>,
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
    fn list_udp(&mut self, family: IpFamily) -> Result<Vec<Flow>, ConntrackError> {
        ctnetlink::list_udp(family)
    }
    fn delete_flows(&mut self, family: IpFamily, flows: &[Flow]) -> Deleted {
        if flows.is_empty() {
            return Deleted::default();
        }
        ctnetlink::delete_flows(family, flows)
    }
}

mod ctnetlink {
    use std::io;
    use std::net::IpAddr;
    use std::time::Duration;

    use kp_model::IpFamily;
    use kp_netlink::{Protocol as NlProtocol, Socket, Until};
    use netlink_packet_core::{
        DefaultNla, NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP,
        NLM_F_REQUEST,
    };
    use netlink_packet_netfilter::conntrack::{
        ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol as CtProto, Tuple,
    };
    use netlink_packet_netfilter::{
        NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
    };

    use super::{ConntrackError, Deleted, Flow};

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
            reply_sport: reply.and_then(|r| r.3),
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

    /// CTA_FILTER (Linux 5.8+): which fields of the request's tuple a
    /// dump must match.
    const CTA_FILTER: u16 = 25;
    const CTA_FILTER_ORIG_FLAGS: u16 = 1;
    /// CTA_FILTER_F_CTA_PROTO_NUM: the original tuple's protocol.
    const FILTER_PROTO_NUM: u32 = 1 << 3;
    const NLA_F_NESTED: u16 = 1 << 15;

    /// A dump request for the family's UDP entries: the kernel filters by
    /// the original tuple's protocol, so a node's TCP flows (most of its
    /// table) never cross into user space.
    fn udp_dump_request(family: IpFamily, seq: u32) -> Vec<u8> {
        let mut flags = Vec::with_capacity(8);
        flags.extend_from_slice(&8u16.to_ne_bytes());
        flags.extend_from_slice(&CTA_FILTER_ORIG_FLAGS.to_ne_bytes());
        flags.extend_from_slice(&FILTER_PROTO_NUM.to_ne_bytes());
        let mut msg = encode(
            family,
            NLM_F_REQUEST | NLM_F_DUMP,
            seq,
            ConntrackMessage::Get(vec![
                ConntrackAttribute::CtaTupleOrig(vec![Tuple::Proto(vec![ProtoTuple::Protocol(
                    CtProto::from(17u8),
                )])]),
                ConntrackAttribute::Other(DefaultNla::new(CTA_FILTER, flags)),
            ]),
        );
        mark_nested(&mut msg, CTA_FILTER);
        msg
    }

    /// Sets NLA_F_NESTED on the top-level attribute `kind` of an encoded
    /// message: the kernel parses CTA_FILTER strictly, and the encoder
    /// drops the flag from an opaque attribute.
    fn mark_nested(msg: &mut [u8], kind: u16) {
        // nlmsghdr (16 bytes) + nfgenmsg (4), then the attributes.
        let mut at = 20;
        while at + 4 <= msg.len() {
            let len = u16::from_ne_bytes([msg[at], msg[at + 1]]) as usize;
            let ty = u16::from_ne_bytes([msg[at + 2], msg[at + 3]]);
            if ty & !NLA_F_NESTED == kind {
                msg[at + 2..at + 4].copy_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
                return;
            }
            if len < 4 {
                return;
            }
            at += (len + 3) & !3;
        }
    }

    fn dump(sock: &mut Socket, msg: &[u8], seq: u32) -> Result<Vec<Flow>, kp_netlink::Error> {
        // Decoded as they arrive: a busy node's table is large.
        let mut flows = Vec::new();
        sock.request_each(msg, seq, Until::Done, |m| {
            flows.extend(flow_of_message(m.bytes));
        })?;
        Ok(flows)
    }

    fn open() -> Result<Socket, ConntrackError> {
        let mut sock = Socket::open(NlProtocol::Netfilter)
            .map_err(|e| ConntrackError::io("opening a netfilter netlink socket", e))?;
        // A dump must never block forever if the kernel stops answering.
        sock.set_recv_timeout(Duration::from_secs(5))
            .map_err(|e| ConntrackError::io("setting the netlink receive timeout", e))?;
        Ok(sock)
    }

    fn nl_error(what: &str, e: kp_netlink::Error) -> ConntrackError {
        let source = match e {
            kp_netlink::Error::Kernel(errno) => io::Error::from_raw_os_error(errno),
            kp_netlink::Error::Io(e) => e,
        };
        ConntrackError::io(what, source)
    }

    pub(super) fn list_udp(family: IpFamily) -> Result<Vec<Flow>, ConntrackError> {
        let mut sock = open()?;
        let seq = sock.next_seq();
        match dump(&mut sock, &udp_dump_request(family, seq), seq) {
            Ok(flows) => Ok(flows),
            // A kernel without dump filters refuses them: dump everything
            // (the caller keeps UDP entries only).
            Err(kp_netlink::Error::Kernel(errno))
                if errno == libc::EINVAL || errno == libc::EOPNOTSUPP =>
            {
                tracing::debug!(errno, "conntrack dump filter refused; dumping every entry");
                let seq = sock.next_seq();
                let msg = encode(
                    family,
                    NLM_F_REQUEST | NLM_F_DUMP,
                    seq,
                    ConntrackMessage::Get(vec![]),
                );
                dump(&mut sock, &msg, seq).map_err(|e| nl_error("dumping the conntrack table", e))
            }
            Err(e) => Err(nl_error("dumping the conntrack table's UDP entries", e)),
        }
    }

    pub(super) fn delete_flows(family: IpFamily, flows: &[Flow]) -> Deleted {
        let mut done = Deleted::default();
        let mut sock = match open() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "conntrack cleanup over netlink failed");
                done.failed = flows.len() as u64;
                return done;
            }
        };
        for (i, flow) in flows.iter().enumerate() {
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
                    done.deleted += 1;
                    tracing::debug!(?flow, "deleted a stale conntrack entry");
                }
                Err(e) if e.errno() == Some(libc::ENOENT) => {}
                Err(kp_netlink::Error::Kernel(errno)) => {
                    tracing::warn!(?flow, error = %io::Error::from_raw_os_error(errno), "deleting a conntrack entry failed");
                    done.failed += 1;
                }
                Err(kp_netlink::Error::Io(e)) => {
                    // The socket is in an unknown state: the rest wait for
                    // the next sync.
                    tracing::warn!(error = %e, "deleting conntrack entries over netlink failed");
                    done.failed += (flows.len() - i) as u64;
                    return done;
                }
            }
        }
        done
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
            reply_sport: Some(8080),
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
