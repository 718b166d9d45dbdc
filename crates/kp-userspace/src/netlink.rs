//! Service IPs on the loopback interface, over rtnetlink. Each address we add
//! carries IFA_PROTO = [`ADDR_PROTO`], so a later run (or `--cleanup`) finds
//! exactly ours and never touches an address someone else configured.

use std::io;
use std::net::IpAddr;

use kp_netlink::ifaddr::{
    self, addr_attrs, family, host_prefix, ifaddrmsg, IFA_FLAGS, IFA_F_NODAD, IFA_PROTO,
    RTM_DELADDR, RTM_GETADDR, RTM_NEWADDR, RT_SCOPE_HOST,
};
use kp_netlink::{
    message, Attrs, Protocol, Socket, Until, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_REPLACE,
    NLM_F_REQUEST,
};

/// IFA_PROTO value marking our addresses ("k"). Linux >= 6.1 keeps it.
pub const ADDR_PROTO: u8 = 0x6b;

/// An RTM_*ADDR message: header, ifaddrmsg, attributes.
pub(crate) fn addr_message(ty: u16, flags: u16, seq: u32, ifindex: u32, ip: &IpAddr) -> Vec<u8> {
    let hdr = ifaddrmsg(family(ip), host_prefix(ip), RT_SCOPE_HOST, ifindex);
    let mut a = addr_attrs(ip);
    if ty == RTM_NEWADDR {
        a.u32(IFA_FLAGS, IFA_F_NODAD);
        a.u8(IFA_PROTO, ADDR_PROTO);
    }
    message(ty, flags | NLM_F_REQUEST, seq, &hdr, &a)
}

/// One rtnetlink socket.
pub struct Rtnl {
    sock: Socket,
    lo: u32,
}

impl Rtnl {
    pub fn open() -> io::Result<Rtnl> {
        let sock = Socket::open(Protocol::Route)?;
        // SAFETY: if_nametoindex reads a NUL-terminated string.
        let lo = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
        if lo == 0 {
            return Err(io::Error::other("no loopback interface"));
        }
        Ok(Rtnl { sock, lo })
    }

    /// Sends one request and waits for its ack.
    fn request(&mut self, ty: u16, flags: u16, ip: &IpAddr) -> io::Result<()> {
        let seq = self.sock.next_seq();
        let msg = addr_message(ty, flags | NLM_F_ACK, seq, self.lo, ip);
        self.sock.request(&msg, seq, Until::Ack)?;
        Ok(())
    }

    /// Adds `ip` (host route, no DAD) to lo, marked as ours.
    pub fn add(&mut self, ip: &IpAddr) -> io::Result<()> {
        self.request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_REPLACE, ip)
    }

    /// Removes `ip` from lo; gone already is fine.
    pub fn del(&mut self, ip: &IpAddr) -> io::Result<()> {
        match self.request(RTM_DELADDR, 0, ip) {
            Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => Ok(()),
            other => other,
        }
    }

    /// Addresses on lo that carry our mark.
    pub fn list_ours(&mut self) -> io::Result<Vec<IpAddr>> {
        let seq = self.sock.next_seq();
        let hdr = ifaddrmsg(libc::AF_UNSPEC as u8, 0, 0, 0);
        let msg = message(
            RTM_GETADDR,
            NLM_F_REQUEST | NLM_F_DUMP,
            seq,
            &hdr,
            &Attrs::new(),
        );
        let replies = self.sock.request(&msg, seq, Until::Done)?;
        Ok(replies
            .iter()
            .filter(|r| r.ty == RTM_NEWADDR)
            .filter_map(|r| parse_ours(r.payload(), self.lo))
            .collect())
    }
}

/// The address of one RTM_NEWADDR payload when it is on `lo` and ours.
pub(crate) fn parse_ours(p: &[u8], lo: u32) -> Option<IpAddr> {
    parse_event(RTM_NEWADDR, p, lo)
        .filter(|e| e.ours)
        .map(|e| e.ip)
}

/// One address added to or removed from this namespace, as the kernel
/// announced it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddrEvent {
    pub ip: IpAddr,
    pub added: bool,
    /// On lo and carrying our mark.
    pub ours: bool,
    /// On lo (whoever added it).
    pub on_lo: bool,
}

/// What [`AddrWatch::drain`] read.
#[derive(Debug, Default)]
pub struct AddrEvents {
    pub events: Vec<AddrEvent>,
    /// Notifications were lost (the socket's queue overflowed) or could not
    /// be read: what changed is unknown.
    pub overflowed: bool,
}

impl AddrEvents {
    pub fn append(&mut self, other: AddrEvents) {
        self.events.extend(other.events);
        self.overflowed |= other.overflowed;
    }
}

/// The kernel's address notifications for one family, read between syncs,
/// so a sync learns that the node's addresses changed, or that one of ours
/// was removed, without listing every address (with Service IPs on lo that
/// is O(Services) per sync).
pub struct AddrWatch {
    sock: Socket,
    lo: u32,
}

const RTNLGRP_IPV4_IFADDR: u32 = 5;
const RTNLGRP_IPV6_IFADDR: u32 = 9;

impl AddrWatch {
    pub fn open(ipv6: bool) -> io::Result<AddrWatch> {
        let sock = Socket::open(Protocol::Route)?;
        // Room for a burst (a first sync adding thousands of Service IPs
        // announces each); an overflow is detected and handled as "unknown".
        let _ = sock.set_recv_buffer(4 << 20);
        sock.join_group(if ipv6 {
            RTNLGRP_IPV6_IFADDR
        } else {
            RTNLGRP_IPV4_IFADDR
        })?;
        // SAFETY: if_nametoindex reads a NUL-terminated string.
        let lo = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
        Ok(AddrWatch { sock, lo })
    }

    /// Everything announced since the last call, without blocking.
    pub fn drain(&mut self) -> AddrEvents {
        let mut out = AddrEvents::default();
        let lo = self.lo;
        let r = self.sock.recv_each(kp_netlink::Wait::Drain, |m| {
            if let Some(e) = parse_event(m.ty, m.payload(), lo) {
                out.events.push(e);
            }
            false
        });
        if let Err(e) = r {
            // ENOBUFS: the queue overflowed and notifications were dropped.
            tracing::debug!(error = %e, "address notifications lost");
            out.overflowed = true;
            // What is still queued is read next time; the caller re-reads
            // everything anyway.
        }
        out
    }
}

/// An RTM_NEWADDR/RTM_DELADDR notification.
pub(crate) fn parse_event(ty: u16, p: &[u8], lo: u32) -> Option<AddrEvent> {
    let added = match ty {
        RTM_NEWADDR => true,
        RTM_DELADDR => false,
        _ => return None,
    };
    let a = ifaddr::parse(p)?;
    let on_lo = a.index == lo;
    Some(AddrEvent {
        ip: a.ip,
        added,
        ours: on_lo && a.attrs.u8(IFA_PROTO) == Some(ADDR_PROTO),
        on_lo,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_address_message_layout() {
        let ip: IpAddr = "10.96.0.10".parse().unwrap();
        let m = addr_message(RTM_NEWADDR, NLM_F_CREATE | NLM_F_ACK, 7, 1, &ip);
        // header 16 + ifaddrmsg 8 + LOCAL 8 + ADDRESS 8 + FLAGS 8 + PROTO 8
        assert_eq!(m.len(), 56);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 56);
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), RTM_NEWADDR);
        assert_eq!(
            u16::from_ne_bytes(m[6..8].try_into().unwrap()),
            NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK
        );
        assert_eq!(u32::from_ne_bytes(m[8..12].try_into().unwrap()), 7);
        assert_eq!(&m[16..20], &[libc::AF_INET as u8, 32, 0, RT_SCOPE_HOST]);
        assert_eq!(&m[24..32], &[8, 0, 2, 0, 10, 96, 0, 10]);
        // IFA_PROTO attribute: len 5, type 11, our mark, padding.
        assert_eq!(&m[48..56], &[5, 0, 11, 0, ADDR_PROTO, 0, 0, 0]);
        // The payload parses back as ours on ifindex 1 only.
        assert_eq!(parse_ours(&m[16..], 1), Some(ip));
        assert_eq!(parse_ours(&m[16..], 2), None);
        // A delete carries no mark: it would not parse as ours.
        let d = addr_message(RTM_DELADDR, 0, 8, 1, &ip);
        assert_eq!(d.len(), 40);
        assert_eq!(parse_ours(&d[16..], 1), None);
    }

    #[test]
    fn address_notifications_parse() {
        let ip: IpAddr = "10.96.0.10".parse().unwrap();
        // A notification has the layout of a request (ifaddrmsg + attributes).
        let m = addr_message(RTM_NEWADDR, 0, 0, 1, &ip);
        let e = parse_event(RTM_NEWADDR, &m[16..], 1).unwrap();
        assert_eq!(
            e,
            AddrEvent {
                ip,
                added: true,
                ours: true,
                on_lo: true
            }
        );
        // The same address on another interface is not ours, mark or not.
        let e = parse_event(RTM_NEWADDR, &m[16..], 2).unwrap();
        assert!(!e.ours && !e.on_lo);
        // Unmarked, on lo: someone else's.
        let d = addr_message(RTM_DELADDR, 0, 0, 1, &ip);
        let e = parse_event(RTM_DELADDR, &d[16..], 1).unwrap();
        assert!(!e.added && !e.ours && e.on_lo);
        // Other message types and garbage are ignored without panicking.
        assert_eq!(parse_event(RTM_GETADDR, &m[16..], 1), None);
        for cut in 0..m.len() - 16 {
            let _ = parse_event(RTM_NEWADDR, &m[16..16 + cut], 1);
        }
    }

    #[test]
    fn ipv6_message_and_garbage() {
        let ip: IpAddr = "fd00:96::130".parse().unwrap();
        let m = addr_message(RTM_NEWADDR, 0, 1, 1, &ip);
        assert_eq!(m[16], libc::AF_INET6 as u8);
        assert_eq!(m[17], 128);
        assert_eq!(parse_ours(&m[16..], 1), Some(ip));
        // Truncated or nonsense payloads never panic.
        for cut in 0..m.len() - 16 {
            let _ = parse_ours(&m[16..16 + cut], 1);
        }
        assert_eq!(parse_ours(&[0xff; 40], 1), None);
    }
}
