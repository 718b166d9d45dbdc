//! IPVS over generic netlink: the messages (hand-encoded, see
//! include/uapi/linux/ip_vs.h) and a small client that sends them.

use std::fmt;
use std::io;
use std::net::IpAddr;

use kp_model::Protocol;

use kp_netlink::{
    message, Attrs, ParsedAttrs, Protocol as NlProtocol, Socket, Until, NLM_F_ACK, NLM_F_DUMP,
    NLM_F_REQUEST,
};

pub const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
pub const IPVS_GENL_NAME: &str = "IPVS";
const IPVS_GENL_VERSION: u8 = 1;

pub const IPVS_CMD_NEW_SERVICE: u8 = 1;
pub const IPVS_CMD_SET_SERVICE: u8 = 2;
pub const IPVS_CMD_DEL_SERVICE: u8 = 3;
pub const IPVS_CMD_GET_SERVICE: u8 = 4;
pub const IPVS_CMD_NEW_DEST: u8 = 5;
pub const IPVS_CMD_SET_DEST: u8 = 6;
pub const IPVS_CMD_DEL_DEST: u8 = 7;
pub const IPVS_CMD_GET_DEST: u8 = 8;
pub const IPVS_CMD_SET_CONFIG: u8 = 12;

const IPVS_CMD_ATTR_SERVICE: u16 = 1;
const IPVS_CMD_ATTR_DEST: u16 = 2;
const IPVS_CMD_ATTR_TIMEOUT_TCP: u16 = 4;
const IPVS_CMD_ATTR_TIMEOUT_TCP_FIN: u16 = 5;
const IPVS_CMD_ATTR_TIMEOUT_UDP: u16 = 6;

const IPVS_SVC_ATTR_AF: u16 = 1;
const IPVS_SVC_ATTR_PROTOCOL: u16 = 2;
const IPVS_SVC_ATTR_ADDR: u16 = 3;
const IPVS_SVC_ATTR_PORT: u16 = 4;
const IPVS_SVC_ATTR_FWMARK: u16 = 5;
const IPVS_SVC_ATTR_SCHED_NAME: u16 = 6;
const IPVS_SVC_ATTR_FLAGS: u16 = 7;
const IPVS_SVC_ATTR_TIMEOUT: u16 = 8;
const IPVS_SVC_ATTR_NETMASK: u16 = 9;

const IPVS_DEST_ATTR_ADDR: u16 = 1;
const IPVS_DEST_ATTR_PORT: u16 = 2;
const IPVS_DEST_ATTR_FWD_METHOD: u16 = 3;
const IPVS_DEST_ATTR_WEIGHT: u16 = 4;
const IPVS_DEST_ATTR_U_THRESH: u16 = 5;
const IPVS_DEST_ATTR_L_THRESH: u16 = 6;
const IPVS_DEST_ATTR_ACTIVE_CONNS: u16 = 7;
const IPVS_DEST_ATTR_INACT_CONNS: u16 = 8;
const IPVS_DEST_ATTR_ADDR_FAMILY: u16 = 11;

/// Persistent service (sessionAffinity ClientIP).
pub const IP_VS_SVC_F_PERSISTENT: u32 = 0x1;
/// Masquerading (NAT) forwarding: the only method kube-proxy uses.
pub const IP_VS_CONN_F_MASQ: u32 = 0x0;

/// The schedulers --ipvs-scheduler accepts (kernel modules ip_vs_NAME).
pub const SCHEDULERS: &[&str] = &[
    "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh",
];

/// A virtual server: what IPVS matches packets on.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VsKey {
    pub addr: IpAddr,
    pub protocol: Protocol,
    pub port: u16,
}

impl fmt::Display for VsKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}",
            self.protocol.as_lower(),
            std::net::SocketAddr::new(self.addr, self.port)
        )
    }
}

/// How a virtual server balances.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VsSpec {
    pub scheduler: String,
    /// Persistence timeout in seconds (sessionAffinity ClientIP).
    pub persistence: Option<u32>,
}

/// A real server of a virtual server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RealServer {
    pub addr: IpAddr,
    pub port: u16,
}

impl fmt::Display for RealServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::net::SocketAddr::new(self.addr, self.port))
    }
}

/// A real server as the kernel lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DestInfo {
    pub rs: RealServer,
    pub weight: u32,
    pub active: u32,
    pub inactive: u32,
}

fn af(ip: &IpAddr) -> u16 {
    match ip {
        IpAddr::V4(_) => libc::AF_INET as u16,
        IpAddr::V6(_) => libc::AF_INET6 as u16,
    }
}

/// union nf_inet_addr: 16 bytes, an IPv4 address in the first 4.
fn addr16(ip: &IpAddr) -> [u8; 16] {
    let mut b = [0u8; 16];
    match ip {
        IpAddr::V4(v) => b[..4].copy_from_slice(&v.octets()),
        IpAddr::V6(v) => b.copy_from_slice(&v.octets()),
    }
    b
}

fn parse_addr(family: u16, b: &[u8]) -> Option<IpAddr> {
    if family == libc::AF_INET as u16 {
        let o: [u8; 4] = b.get(..4)?.try_into().ok()?;
        Some(IpAddr::from(o))
    } else if family == libc::AF_INET6 as u16 {
        let o: [u8; 16] = b.get(..16)?.try_into().ok()?;
        Some(IpAddr::from(o))
    } else {
        None
    }
}

/// A generic netlink message: genlmsghdr (command, version), then `attrs`.
fn genl(family: u16, flags: u16, seq: u32, cmd: u8, version: u8, attrs: &Attrs) -> Vec<u8> {
    message(family, flags, seq, &[cmd, version, 0, 0], attrs)
}

/// The service identity (and with `spec`, the full entry NEW/SET need).
fn service_nest(m: &mut Attrs, key: &VsKey, spec: Option<&VsSpec>) {
    let nest = m.begin_nest(IPVS_CMD_ATTR_SERVICE);
    m.u16(IPVS_SVC_ATTR_AF, af(&key.addr));
    m.u16(IPVS_SVC_ATTR_PROTOCOL, key.protocol.number() as u16);
    m.attr(IPVS_SVC_ATTR_ADDR, &addr16(&key.addr));
    m.attr(IPVS_SVC_ATTR_PORT, &key.port.to_be_bytes());
    if let Some(spec) = spec {
        m.str(IPVS_SVC_ATTR_SCHED_NAME, &spec.scheduler);
        let flags = if spec.persistence.is_some() {
            IP_VS_SVC_F_PERSISTENT
        } else {
            0
        };
        // struct ip_vs_flags { flags, mask }: the mask says which bits to set.
        let mut f = [0u8; 8];
        f[..4].copy_from_slice(&flags.to_ne_bytes());
        f[4..].copy_from_slice(&u32::MAX.to_ne_bytes());
        m.attr(IPVS_SVC_ATTR_FLAGS, &f);
        m.u32(IPVS_SVC_ATTR_TIMEOUT, spec.persistence.unwrap_or(0));
        // Persistence granularity: one client address (a /32 mask for IPv4,
        // a prefix length for IPv6, as ipvsadm sends them).
        let mask = match key.addr {
            IpAddr::V4(_) => u32::MAX,
            IpAddr::V6(_) => 128,
        };
        m.u32(IPVS_SVC_ATTR_NETMASK, mask);
    }
    m.end_nest(nest);
}

fn dest_nest(m: &mut Attrs, rs: &RealServer, weight: Option<u32>) {
    let nest = m.begin_nest(IPVS_CMD_ATTR_DEST);
    m.attr(IPVS_DEST_ATTR_ADDR, &addr16(&rs.addr));
    m.attr(IPVS_DEST_ATTR_PORT, &rs.port.to_be_bytes());
    if let Some(w) = weight {
        m.u32(IPVS_DEST_ATTR_FWD_METHOD, IP_VS_CONN_F_MASQ);
        m.u32(IPVS_DEST_ATTR_WEIGHT, w);
        m.u32(IPVS_DEST_ATTR_U_THRESH, 0);
        m.u32(IPVS_DEST_ATTR_L_THRESH, 0);
    }
    m.u16(IPVS_DEST_ATTR_ADDR_FAMILY, af(&rs.addr));
    m.end_nest(nest);
}

fn service(key: &VsKey, spec: Option<&VsSpec>) -> Attrs {
    let mut a = Attrs::new();
    service_nest(&mut a, key, spec);
    a
}

fn service_dest(key: &VsKey, rs: &RealServer, weight: Option<u32>) -> Attrs {
    let mut a = service(key, None);
    dest_nest(&mut a, rs, weight);
    a
}

/// An IPVS command (the family id is the kernel's, resolved at open).
fn ipvs(fam: u16, flags: u16, seq: u32, cmd: u8, attrs: &Attrs) -> Vec<u8> {
    genl(fam, flags, seq, cmd, IPVS_GENL_VERSION, attrs)
}

const REQ_ACK: u16 = NLM_F_REQUEST | NLM_F_ACK;

/// The message encoders. Each returns one complete netlink message.
pub mod msg {
    use super::*;

    /// CTRL_CMD_GETFAMILY for "IPVS" (answers with the family id).
    pub fn resolve_family(seq: u32) -> Vec<u8> {
        // With an ACK: `Socket::request` reads up to the acknowledgement.
        let mut a = Attrs::new();
        a.str(CTRL_ATTR_FAMILY_NAME, IPVS_GENL_NAME);
        genl(GENL_ID_CTRL, REQ_ACK, seq, CTRL_CMD_GETFAMILY, 1, &a)
    }
    pub fn new_service(fam: u16, seq: u32, key: &VsKey, spec: &VsSpec) -> Vec<u8> {
        let a = service(key, Some(spec));
        ipvs(fam, REQ_ACK, seq, IPVS_CMD_NEW_SERVICE, &a)
    }
    pub fn set_service(fam: u16, seq: u32, key: &VsKey, spec: &VsSpec) -> Vec<u8> {
        let a = service(key, Some(spec));
        ipvs(fam, REQ_ACK, seq, IPVS_CMD_SET_SERVICE, &a)
    }
    pub fn del_service(fam: u16, seq: u32, key: &VsKey) -> Vec<u8> {
        ipvs(fam, REQ_ACK, seq, IPVS_CMD_DEL_SERVICE, &service(key, None))
    }
    pub fn get_services(fam: u16, seq: u32) -> Vec<u8> {
        let dump = NLM_F_REQUEST | NLM_F_DUMP;
        ipvs(fam, dump, seq, IPVS_CMD_GET_SERVICE, &Attrs::new())
    }
    pub fn new_dest(fam: u16, seq: u32, key: &VsKey, rs: &RealServer, weight: u32) -> Vec<u8> {
        let a = service_dest(key, rs, Some(weight));
        ipvs(fam, REQ_ACK, seq, IPVS_CMD_NEW_DEST, &a)
    }
    pub fn set_dest(fam: u16, seq: u32, key: &VsKey, rs: &RealServer, weight: u32) -> Vec<u8> {
        let a = service_dest(key, rs, Some(weight));
        ipvs(fam, REQ_ACK, seq, IPVS_CMD_SET_DEST, &a)
    }
    pub fn del_dest(fam: u16, seq: u32, key: &VsKey, rs: &RealServer) -> Vec<u8> {
        let a = service_dest(key, rs, None);
        ipvs(fam, REQ_ACK, seq, IPVS_CMD_DEL_DEST, &a)
    }
    pub fn get_dests(fam: u16, seq: u32, key: &VsKey) -> Vec<u8> {
        let dump = NLM_F_REQUEST | NLM_F_DUMP;
        ipvs(fam, dump, seq, IPVS_CMD_GET_DEST, &service(key, None))
    }
    /// Connection timeouts in seconds; 0 leaves one unchanged.
    pub fn set_timeouts(fam: u16, seq: u32, tcp: u32, tcp_fin: u32, udp: u32) -> Vec<u8> {
        let mut a = Attrs::new();
        a.u32(IPVS_CMD_ATTR_TIMEOUT_TCP, tcp);
        a.u32(IPVS_CMD_ATTR_TIMEOUT_TCP_FIN, tcp_fin);
        a.u32(IPVS_CMD_ATTR_TIMEOUT_UDP, udp);
        ipvs(fam, REQ_ACK, seq, IPVS_CMD_SET_CONFIG, &a)
    }
}

fn proto_of(n: u16) -> Option<Protocol> {
    match n {
        6 => Some(Protocol::Tcp),
        17 => Some(Protocol::Udp),
        132 => Some(Protocol::Sctp),
        _ => None,
    }
}

/// One answer of a service dump (after the netlink header). None for
/// firewall-mark services and protocols we do not program.
pub fn parse_service(payload: &[u8]) -> Option<(VsKey, VsSpec)> {
    let top = ParsedAttrs::parse(payload.get(4..)?);
    let svc = top.nested(IPVS_CMD_ATTR_SERVICE)?;
    if svc.u32(IPVS_SVC_ATTR_FWMARK).unwrap_or(0) != 0 {
        return None;
    }
    let family = svc.u16(IPVS_SVC_ATTR_AF)?;
    let addr = parse_addr(family, svc.get(IPVS_SVC_ATTR_ADDR)?)?;
    let protocol = proto_of(svc.u16(IPVS_SVC_ATTR_PROTOCOL)?)?;
    let pb = svc.get(IPVS_SVC_ATTR_PORT)?;
    let port = u16::from_be_bytes(pb.get(..2)?.try_into().ok()?);
    let sched = svc.get(IPVS_SVC_ATTR_SCHED_NAME).unwrap_or_default();
    let scheduler = String::from_utf8_lossy(sched)
        .trim_end_matches('\0')
        .to_string();
    let flags = svc
        .get(IPVS_SVC_ATTR_FLAGS)
        .and_then(|b| b.get(..4))
        .and_then(|b| b.try_into().ok())
        .map(u32::from_ne_bytes)
        .unwrap_or(0);
    let persistence =
        (flags & IP_VS_SVC_F_PERSISTENT != 0).then(|| svc.u32(IPVS_SVC_ATTR_TIMEOUT).unwrap_or(0));
    Some((
        VsKey {
            addr,
            protocol,
            port,
        },
        VsSpec {
            scheduler,
            persistence,
        },
    ))
}

/// One answer of a destination dump. `svc_af` is used when the kernel does
/// not say the destination's family (kernels before 4.13).
pub fn parse_dest(payload: &[u8], svc_af: u16) -> Option<DestInfo> {
    let top = ParsedAttrs::parse(payload.get(4..)?);
    let d = top.nested(IPVS_CMD_ATTR_DEST)?;
    let family = d.u16(IPVS_DEST_ATTR_ADDR_FAMILY).unwrap_or(svc_af);
    let addr = parse_addr(family, d.get(IPVS_DEST_ATTR_ADDR)?)?;
    let pb = d.get(IPVS_DEST_ATTR_PORT)?;
    let port = u16::from_be_bytes(pb.get(..2)?.try_into().ok()?);
    Some(DestInfo {
        rs: RealServer { addr, port },
        weight: d.u32(IPVS_DEST_ATTR_WEIGHT).unwrap_or(0),
        active: d.u32(IPVS_DEST_ATTR_ACTIVE_CONNS).unwrap_or(0),
        inactive: d.u32(IPVS_DEST_ATTR_INACT_CONNS).unwrap_or(0),
    })
}

/// A generic netlink socket talking to the IPVS family.
pub struct IpvsClient {
    sock: Socket,
    family: u16,
}

fn ctx(what: String, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl IpvsClient {
    /// Opens the socket and resolves the IPVS family; fails (ENOENT) when the
    /// kernel has no IPVS.
    pub fn open() -> io::Result<IpvsClient> {
        let mut sock = Socket::open(NlProtocol::Generic)?;
        let seq = sock.next_seq();
        let replies = sock
            .request(&msg::resolve_family(seq), seq, Until::Ack)
            .map_err(|e| ctx("resolving the IPVS generic netlink family".into(), e.into()))?;
        let family = replies
            .iter()
            .filter_map(|r| ParsedAttrs::parse(r.payload().get(4..)?).u16(CTRL_ATTR_FAMILY_ID))
            .next()
            .ok_or_else(|| io::Error::other("no IPVS family id in the answer"))?;
        Ok(IpvsClient { sock, family })
    }

    fn ack(
        &mut self,
        what: impl FnOnce() -> String,
        m: impl FnOnce(u16, u32) -> Vec<u8>,
    ) -> io::Result<()> {
        let seq = self.sock.next_seq();
        let buf = m(self.family, seq);
        self.sock
            .request(&buf, seq, Until::Ack)
            .map(|_| ())
            .map_err(|e| ctx(what(), e.into()))
    }

    pub fn services(&mut self) -> io::Result<Vec<(VsKey, VsSpec)>> {
        let seq = self.sock.next_seq();
        let r = self
            .sock
            .request(&msg::get_services(self.family, seq), seq, Until::Done)
            .map_err(|e| ctx("listing IPVS services".into(), e.into()))?;
        Ok(r.iter()
            .filter_map(|m| parse_service(m.payload()))
            .collect())
    }

    pub fn dests(&mut self, key: &VsKey) -> io::Result<Vec<DestInfo>> {
        let seq = self.sock.next_seq();
        let r = self
            .sock
            .request(&msg::get_dests(self.family, seq, key), seq, Until::Done)
            .map_err(|e| ctx(format!("listing real servers of {key}"), e.into()))?;
        Ok(r.iter()
            .filter_map(|m| parse_dest(m.payload(), af(&key.addr)))
            .collect())
    }

    pub fn add_service(&mut self, key: &VsKey, spec: &VsSpec) -> io::Result<()> {
        self.ack(
            || format!("adding virtual server {key}"),
            |f, s| msg::new_service(f, s, key, spec),
        )
    }
    pub fn update_service(&mut self, key: &VsKey, spec: &VsSpec) -> io::Result<()> {
        self.ack(
            || format!("updating virtual server {key}"),
            |f, s| msg::set_service(f, s, key, spec),
        )
    }
    pub fn del_service(&mut self, key: &VsKey) -> io::Result<()> {
        self.ack(
            || format!("deleting virtual server {key}"),
            |f, s| msg::del_service(f, s, key),
        )
    }
    pub fn add_dest(&mut self, key: &VsKey, rs: &RealServer, weight: u32) -> io::Result<()> {
        self.ack(
            || format!("adding real server {rs} to {key}"),
            |f, s| msg::new_dest(f, s, key, rs, weight),
        )
    }
    pub fn set_dest(&mut self, key: &VsKey, rs: &RealServer, weight: u32) -> io::Result<()> {
        self.ack(
            || format!("setting weight {weight} of {rs} in {key}"),
            |f, s| msg::set_dest(f, s, key, rs, weight),
        )
    }
    pub fn del_dest(&mut self, key: &VsKey, rs: &RealServer) -> io::Result<()> {
        self.ack(
            || format!("deleting real server {rs} from {key}"),
            |f, s| msg::del_dest(f, s, key, rs),
        )
    }
    pub fn set_timeouts(&mut self, tcp: u32, tcp_fin: u32, udp: u32) -> io::Result<()> {
        self.ack(
            || "setting IPVS timeouts".into(),
            |f, s| msg::set_timeouts(f, s, tcp, tcp_fin, udp),
        )
    }
}
