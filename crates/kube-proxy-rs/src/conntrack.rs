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
/// per filter. Messages are encoded with netlink-packet-netfilter.
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
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use kp_model::{IpFamily, StaleConntrack};
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

    const NETLINK_NETFILTER: libc::c_int = 12;

    struct Sock(OwnedFd);

    impl Sock {
        fn open() -> io::Result<Sock> {
            // SAFETY: plain socket(2); the result is checked before use.
            let fd = unsafe {
                libc::socket(
                    libc::AF_NETLINK,
                    libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                    NETLINK_NETFILTER,
                )
            };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: fd is a fresh descriptor we own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: sockaddr_nl is plain data; zeroed is valid.
            let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
            sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
            // SAFETY: sa is a valid sockaddr_nl of the given size.
            let rc = unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    &sa as *const libc::sockaddr_nl as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
                )
            };
            if rc < 0 {
                return Err(io::Error::last_os_error());
            }
            // A dump must never block forever if the kernel stops answering.
            let tv = libc::timeval {
                tv_sec: 5,
                tv_usec: 0,
            };
            // SAFETY: setsockopt with a timeval of the right size.
            unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    &tv as *const libc::timeval as *const libc::c_void,
                    std::mem::size_of::<libc::timeval>() as libc::socklen_t,
                );
            }
            Ok(Sock(fd))
        }

        fn send(&self, buf: &[u8]) -> io::Result<()> {
            // SAFETY: buf is valid for its length; the kernel copies it.
            let n = unsafe {
                libc::send(
                    self.0.as_raw_fd(),
                    buf.as_ptr() as *const libc::c_void,
                    buf.len(),
                    0,
                )
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        }

        fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
            // SAFETY: buf is valid and writable for its length.
            let n = unsafe {
                libc::recv(
                    self.0.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                )
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(n as usize)
        }
    }

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

    /// Walks every netlink message in `buf`; `f` gets conntrack payloads.
    /// Returns Some(errno) for an error/ack answer, and whether DONE was seen.
    fn walk(buf: &[u8], mut f: impl FnMut(&[ConntrackAttribute])) -> (Vec<(u32, i32)>, bool) {
        let mut off = 0;
        let mut acks = Vec::new();
        let mut done = false;
        while off + 16 <= buf.len() {
            let len =
                u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
            if len < 16 || off + len > buf.len() {
                break;
            }
            let one = &buf[off..off + len];
            match NetlinkMessage::<NetfilterMessage>::deserialize(one) {
                Ok(m) => match m.payload {
                    NetlinkPayload::InnerMessage(nf) => {
                        if let NetfilterMessageInner::Conntrack(
                            ConntrackMessage::New(attrs) | ConntrackMessage::Get(attrs),
                        ) = &nf.inner
                        {
                            f(attrs);
                        }
                    }
                    NetlinkPayload::Done(_) => done = true,
                    NetlinkPayload::Error(e) => {
                        let errno = e.code.map(|c| -c.get()).unwrap_or(0);
                        acks.push((m.header.sequence_number, errno));
                    }
                    _ => {}
                },
                Err(e) => tracing::debug!(error = %e, "skipping an undecodable conntrack message"),
            }
            off += (len + 3) & !3;
        }
        (acks, done)
    }

    fn dump(sock: &Sock, family: IpFamily) -> io::Result<Vec<Flow>> {
        sock.send(&encode(
            family,
            NLM_F_REQUEST | NLM_F_DUMP,
            1,
            ConntrackMessage::Get(vec![]),
        ))?;
        let mut flows = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = sock.recv(&mut buf)?;
            let (acks, done) = walk(&buf[..n], |attrs| {
                if let Some(f) = flow_of(attrs) {
                    flows.push(f);
                }
            });
            if let Some((_, errno)) = acks.iter().find(|(_, e)| *e != 0) {
                return Err(io::Error::from_raw_os_error(*errno));
            }
            if done || n == 0 {
                return Ok(flows);
            }
        }
    }

    pub(super) fn delete_matching(family: IpFamily, filters: &[StaleConntrack]) -> io::Result<u64> {
        let sock = Sock::open()?;
        let flows = dump(&sock, family)?;
        let mut deleted = 0;
        let mut seq = 2u32;
        let mut buf = vec![0u8; 8192];
        for flow in flows
            .iter()
            .filter(|fl| filters.iter().any(|f| matches(f, fl)))
        {
            seq += 1;
            sock.send(&encode(
                family,
                NLM_F_REQUEST | NLM_F_ACK,
                seq,
                ConntrackMessage::Delete(vec![orig_tuple(flow)]),
            ))?;
            // One ack per delete; ENOENT means it expired meanwhile.
            let n = sock.recv(&mut buf)?;
            let (acks, _) = walk(&buf[..n], |_| {});
            match acks.iter().find(|(s, _)| *s == seq) {
                Some((_, 0)) => {
                    deleted += 1;
                    tracing::debug!(?flow, "deleted a stale conntrack entry");
                }
                Some((_, e)) if *e == libc::ENOENT => {}
                Some((_, e)) => {
                    tracing::warn!(?flow, error = %io::Error::from_raw_os_error(*e), "deleting a conntrack entry failed")
                }
                None => {}
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
