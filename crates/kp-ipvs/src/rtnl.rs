//! rtnetlink for the kube-ipvs0 dummy interface: create it, bind and unbind
//! Service IPs, list addresses, delete it.

use std::io;
use std::net::IpAddr;

use ipnet::IpNet;

use kp_netlink::ifaddr::{
    self, addr_attrs, family, host_prefix, ifaddrmsg, IFA_FLAGS, IFA_F_NODAD, RT_SCOPE_HOST,
};
pub use kp_netlink::ifaddr::{RTM_DELADDR, RTM_GETADDR, RTM_NEWADDR};
use kp_netlink::{
    message, Attrs, Protocol, Socket, Until, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL,
    NLM_F_REQUEST,
};

pub const RTM_NEWLINK: u16 = 16;
pub const RTM_DELLINK: u16 = 17;
pub const RTM_GETLINK: u16 = 18;

const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFF_UP: u32 = 0x1;

/// struct ifinfomsg.
fn ifinfo(index: i32, flags: u32, change: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    // family AF_UNSPEC (0), pad, type 0
    b[4..8].copy_from_slice(&index.to_ne_bytes());
    b[8..12].copy_from_slice(&flags.to_ne_bytes());
    b[12..16].copy_from_slice(&change.to_ne_bytes());
    b
}

const REQ_ACK: u16 = NLM_F_REQUEST | NLM_F_ACK;
const NEW_EXCL: u16 = REQ_ACK | NLM_F_CREATE | NLM_F_EXCL;

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
        let mut a = addr_attrs(ip);
        a.u32(IFA_FLAGS, IFA_F_NODAD);
        let hdr = ifaddrmsg(family(ip), host_prefix(ip), RT_SCOPE_HOST, index);
        message(RTM_NEWADDR, NEW_EXCL, seq, &hdr, &a)
    }
    pub fn del_addr(seq: u32, index: u32, ip: &IpAddr) -> Vec<u8> {
        let hdr = ifaddrmsg(family(ip), host_prefix(ip), 0, index);
        message(RTM_DELADDR, REQ_ACK, seq, &hdr, &addr_attrs(ip))
    }
    /// Dumps every address of one family (0: all).
    pub fn get_addrs(seq: u32, fam: u8) -> Vec<u8> {
        let dump = NLM_F_REQUEST | NLM_F_DUMP;
        message(
            RTM_GETADDR,
            dump,
            seq,
            &ifaddrmsg(fam, 0, 0, 0),
            &Attrs::new(),
        )
    }
}

/// One address from a dump: interface index and the address with its prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddrInfo {
    pub index: u32,
    pub net: IpNet,
}

pub fn parse_addr(payload: &[u8]) -> Option<AddrInfo> {
    let a = ifaddr::parse(payload)?;
    Some(AddrInfo {
        index: a.index,
        net: IpNet::new(a.ip, a.prefix).ok()?,
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
