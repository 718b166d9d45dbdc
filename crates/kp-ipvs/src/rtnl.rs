//! rtnetlink for the kube-ipvs0 dummy interface: create it, bind and unbind
//! Service IPs, list addresses, delete it.

use std::io;
use std::net::IpAddr;

use ipnet::IpNet;

use kp_netlink::{
    message, Attrs, ParsedAttrs, Protocol, Socket, Until, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP,
    NLM_F_EXCL, NLM_F_REQUEST,
};

pub const RTM_NEWLINK: u16 = 16;
pub const RTM_DELLINK: u16 = 17;
pub const RTM_GETLINK: u16 = 18;
pub const RTM_NEWADDR: u16 = 20;
pub const RTM_DELADDR: u16 = 21;
pub const RTM_GETADDR: u16 = 22;

const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_FLAGS: u16 = 8;
const IFA_F_NODAD: u32 = 0x02;
const IFF_UP: u32 = 0x1;
const RT_SCOPE_HOST: u8 = 254;

fn family(ip: &IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => libc::AF_INET as u8,
        IpAddr::V6(_) => libc::AF_INET6 as u8,
    }
}

fn octets(ip: &IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v) => v.octets().to_vec(),
        IpAddr::V6(v) => v.octets().to_vec(),
    }
}

/// struct ifinfomsg.
fn ifinfo(index: i32, flags: u32, change: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    // family AF_UNSPEC (0), pad, type 0
    b[4..8].copy_from_slice(&index.to_ne_bytes());
    b[8..12].copy_from_slice(&flags.to_ne_bytes());
    b[12..16].copy_from_slice(&change.to_ne_bytes());
    b
}

/// struct ifaddrmsg.
fn ifaddr(fam: u8, prefix: u8, scope: u8, index: u32) -> [u8; 8] {
    let mut b = [fam, prefix, 0, scope, 0, 0, 0, 0];
    b[4..8].copy_from_slice(&index.to_ne_bytes());
    b
}

const REQ_ACK: u16 = NLM_F_REQUEST | NLM_F_ACK;
const NEW_EXCL: u16 = REQ_ACK | NLM_F_CREATE | NLM_F_EXCL;

fn addr_attrs(ip: &IpAddr) -> Attrs {
    let mut a = Attrs::new();
    a.attr(IFA_LOCAL, &octets(ip));
    a.attr(IFA_ADDRESS, &octets(ip));
    a
}

pub mod msg {
    use super::*;

    /// Creates a dummy link named `name`, up (NLM_F_EXCL: fails if it exists).
    pub fn new_dummy(seq: u32, name: &str) -> Vec<u8> {
        let mut a = Attrs::new();
        a.str(IFLA_IFNAME, name);
        a.nest(IFLA_LINKINFO, |a| {
            a.attr(IFLA_INFO_KIND, b"dummy");
        });
        message(RTM_NEWLINK, NEW_EXCL, seq, &ifinfo(0, IFF_UP, IFF_UP), &a)
    }
    /// Sets a link up.
    pub fn link_up(seq: u32, index: i32) -> Vec<u8> {
        let up = ifinfo(index, IFF_UP, IFF_UP);
        message(RTM_NEWLINK, REQ_ACK, seq, &up, &Attrs::new())
    }
    pub fn get_link(seq: u32, name: &str) -> Vec<u8> {
        let mut a = Attrs::new();
        a.str(IFLA_IFNAME, name);
        message(RTM_GETLINK, REQ_ACK, seq, &ifinfo(0, 0, 0), &a)
    }
    pub fn del_link(seq: u32, index: i32) -> Vec<u8> {
        message(
            RTM_DELLINK,
            REQ_ACK,
            seq,
            &ifinfo(index, 0, 0),
            &Attrs::new(),
        )
    }
    /// Binds `ip` (host prefix, host scope, no duplicate address detection).
    pub fn add_addr(seq: u32, index: u32, ip: &IpAddr) -> Vec<u8> {
        let prefix = if ip.is_ipv4() { 32 } else { 128 };
        let mut a = addr_attrs(ip);
        a.u32(IFA_FLAGS, IFA_F_NODAD);
        let hdr = ifaddr(family(ip), prefix, RT_SCOPE_HOST, index);
        message(RTM_NEWADDR, NEW_EXCL, seq, &hdr, &a)
    }
    pub fn del_addr(seq: u32, index: u32, ip: &IpAddr) -> Vec<u8> {
        let prefix = if ip.is_ipv4() { 32 } else { 128 };
        let hdr = ifaddr(family(ip), prefix, 0, index);
        message(RTM_DELADDR, REQ_ACK, seq, &hdr, &addr_attrs(ip))
    }
    /// Dumps every address of one family (0: all).
    pub fn get_addrs(seq: u32, fam: u8) -> Vec<u8> {
        let dump = NLM_F_REQUEST | NLM_F_DUMP;
        message(RTM_GETADDR, dump, seq, &ifaddr(fam, 0, 0, 0), &Attrs::new())
    }
}

/// One address from a dump: interface index and the address with its prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddrInfo {
    pub index: u32,
    pub net: IpNet,
}

pub fn parse_addr(payload: &[u8]) -> Option<AddrInfo> {
    let hdr = payload.get(..8)?;
    let fam = hdr[0];
    let prefix = hdr[1];
    let index = u32::from_ne_bytes(hdr[4..8].try_into().ok()?);
    let attrs = ParsedAttrs::parse(payload.get(8..)?);
    let raw = attrs.get(IFA_LOCAL).or_else(|| attrs.get(IFA_ADDRESS))?;
    let ip = if fam == libc::AF_INET as u8 {
        IpAddr::from(<[u8; 4]>::try_from(raw.get(..4)?).ok()?)
    } else if fam == libc::AF_INET6 as u8 {
        IpAddr::from(<[u8; 16]>::try_from(raw.get(..16)?).ok()?)
    } else {
        return None;
    };
    Some(AddrInfo {
        index,
        net: IpNet::new(ip, prefix).ok()?,
    })
}

/// A NETLINK_ROUTE socket.
pub struct Rtnl {
    sock: Socket,
}

impl Rtnl {
    pub fn open() -> io::Result<Rtnl> {
        Ok(Rtnl {
            sock: Socket::open(Protocol::Route)?,
        })
    }

    fn ack(&mut self, m: impl FnOnce(u32) -> Vec<u8>) -> io::Result<()> {
        let seq = self.sock.next_seq();
        let buf = m(seq);
        self.sock.request(&buf, seq, Until::Ack)?;
        Ok(())
    }

    /// Index of link `name`, None when it does not exist.
    pub fn link_index(&mut self, name: &str) -> io::Result<Option<i32>> {
        let seq = self.sock.next_seq();
        match self
            .sock
            .request(&msg::get_link(seq, name), seq, Until::Ack)
        {
            Ok(r) => Ok(r
                .iter()
                .filter(|m| m.ty == RTM_NEWLINK)
                .filter_map(|m| m.payload().get(4..8)?.try_into().ok())
                .map(i32::from_ne_bytes)
                .next()),
            Err(e) if e.errno() == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The index of dummy link `name`, created (and set up) if missing.
    pub fn ensure_dummy(&mut self, name: &str) -> io::Result<i32> {
        if let Some(i) = self.link_index(name)? {
            self.ack(|s| msg::link_up(s, i))?;
            return Ok(i);
        }
        match self.ack(|s| msg::new_dummy(s, name)) {
            Ok(()) => {}
            // Created meanwhile by the other family's proxier.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(e),
        }
        self.link_index(name)?
            .ok_or_else(|| io::Error::other(format!("{name} vanished after creation")))
    }

    pub fn delete_link(&mut self, index: i32) -> io::Result<()> {
        self.ack(|s| msg::del_link(s, index))
    }

    pub fn addrs(&mut self, fam: u8) -> io::Result<Vec<AddrInfo>> {
        let seq = self.sock.next_seq();
        let r = self
            .sock
            .request(&msg::get_addrs(seq, fam), seq, Until::Done)?;
        Ok(r.iter()
            .filter(|m| m.ty == RTM_NEWADDR)
            .filter_map(|m| parse_addr(m.payload()))
            .collect())
    }

    /// Binds `ip` to the link; already bound is fine.
    pub fn add_addr(&mut self, index: i32, ip: &IpAddr) -> io::Result<()> {
        match self.ack(|s| msg::add_addr(s, index as u32, ip)) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            r => r,
        }
    }

    /// Unbinds `ip`; already gone is fine.
    pub fn del_addr(&mut self, index: i32, ip: &IpAddr) -> io::Result<()> {
        match self.ack(|s| msg::del_addr(s, index as u32, ip)) {
            Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => Ok(()),
            r => r,
        }
    }
}
