//! Service IPs on the loopback interface, over rtnetlink. Each address we add
//! carries IFA_PROTO = [`ADDR_PROTO`], so a later run (or `--cleanup`) finds
//! exactly ours and never touches an address someone else configured.

use std::io;
use std::mem::size_of;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// IFA_PROTO value marking our addresses ("k"). Linux >= 6.1 keeps it.
pub const ADDR_PROTO: u8 = 0x6b;

const RTM_NEWADDR: u16 = 20;
const RTM_DELADDR: u16 = 21;
const RTM_GETADDR: u16 = 22;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_REPLACE: u16 = 0x100;
const NLM_F_CREATE: u16 = 0x400;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_FLAGS: u16 = 8;
const IFA_PROTO: u16 = 11;
const IFA_F_NODAD: u32 = 0x02;
const RT_SCOPE_HOST: u8 = 254;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn push_attr(buf: &mut Vec<u8>, ty: u16, data: &[u8]) {
    let len = 4 + data.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(data);
    buf.resize(align4(buf.len()), 0);
}

fn ip_bytes(ip: &IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v) => v.octets().to_vec(),
        IpAddr::V6(v) => v.octets().to_vec(),
    }
}

fn family(ip: &IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => libc::AF_INET as u8,
        IpAddr::V6(_) => libc::AF_INET6 as u8,
    }
}

/// An RTM_*ADDR message: header, ifaddrmsg, attributes.
pub(crate) fn addr_message(ty: u16, flags: u16, seq: u32, ifindex: u32, ip: &IpAddr) -> Vec<u8> {
    let mut b = vec![0u8; 16];
    b.push(family(ip));
    b.push(if ip.is_ipv4() { 32 } else { 128 });
    b.push(0); // ifa_flags (the 32-bit IFA_FLAGS attribute carries them)
    b.push(RT_SCOPE_HOST);
    b.extend_from_slice(&ifindex.to_ne_bytes());
    let bytes = ip_bytes(ip);
    push_attr(&mut b, IFA_LOCAL, &bytes);
    push_attr(&mut b, IFA_ADDRESS, &bytes);
    if ty == RTM_NEWADDR {
        push_attr(&mut b, IFA_FLAGS, &IFA_F_NODAD.to_ne_bytes());
        push_attr(&mut b, IFA_PROTO, &[ADDR_PROTO]);
    }
    let len = b.len() as u32;
    b[0..4].copy_from_slice(&len.to_ne_bytes());
    b[4..6].copy_from_slice(&ty.to_ne_bytes());
    b[6..8].copy_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    b
}

/// One rtnetlink socket.
pub struct Rtnl {
    fd: OwnedFd,
    seq: u32,
    lo: u32,
}

impl Rtnl {
    pub fn open() -> io::Result<Rtnl> {
        // SAFETY: plain socket(2), owned right away.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is fresh and ours.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: if_nametoindex reads a NUL-terminated string.
        let lo = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
        if lo == 0 {
            return Err(io::Error::other("no loopback interface"));
        }
        Ok(Rtnl { fd, seq: 1, lo })
    }

    fn send(&mut self, msg: &[u8]) -> io::Result<()> {
        // SAFETY: sends our buffer to the kernel (default netlink address).
        let n = unsafe {
            libc::send(
                self.fd.as_raw_fd(),
                msg.as_ptr() as *const libc::c_void,
                msg.len(),
                0,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: receives into our buffer.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
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

    /// Sends one request and waits for its ack.
    fn request(&mut self, ty: u16, flags: u16, ip: &IpAddr) -> io::Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let msg = addr_message(ty, flags | NLM_F_ACK, seq, self.lo, ip);
        self.send(&msg)?;
        let mut buf = vec![0u8; 8192];
        loop {
            let n = self.recv(&mut buf)?;
            let mut off = 0;
            while off + 16 <= n {
                let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
                    as usize;
                let mty = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
                let mseq =
                    u32::from_ne_bytes([buf[off + 8], buf[off + 9], buf[off + 10], buf[off + 11]]);
                if len < 16 || off + len > n {
                    return Err(io::Error::other("truncated netlink answer"));
                }
                if mty == NLMSG_ERROR && mseq == seq && len >= 20 {
                    let code = i32::from_ne_bytes([
                        buf[off + 16],
                        buf[off + 17],
                        buf[off + 18],
                        buf[off + 19],
                    ]);
                    return if code == 0 {
                        Ok(())
                    } else {
                        Err(io::Error::from_raw_os_error(-code))
                    };
                }
                off += align4(len);
            }
        }
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
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let mut msg = vec![0u8; 16];
        msg.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
        msg.extend_from_slice(&0u32.to_ne_bytes());
        let len = msg.len() as u32;
        msg[0..4].copy_from_slice(&len.to_ne_bytes());
        msg[4..6].copy_from_slice(&RTM_GETADDR.to_ne_bytes());
        msg[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
        msg[8..12].copy_from_slice(&seq.to_ne_bytes());
        self.send(&msg)?;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 65536];
        loop {
            let n = self.recv(&mut buf)?;
            let mut off = 0;
            while off + 16 <= n {
                let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
                    as usize;
                let mty = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
                if len < 16 || off + len > n {
                    return Err(io::Error::other("truncated netlink dump"));
                }
                match mty {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let code = if len >= 20 {
                            i32::from_ne_bytes([
                                buf[off + 16],
                                buf[off + 17],
                                buf[off + 18],
                                buf[off + 19],
                            ])
                        } else {
                            0
                        };
                        if code != 0 {
                            return Err(io::Error::from_raw_os_error(-code));
                        }
                    }
                    RTM_NEWADDR => {
                        if let Some(ip) = parse_ours(&buf[off + 16..off + len], self.lo) {
                            out.push(ip);
                        }
                    }
                    _ => {}
                }
                off += align4(len);
            }
        }
    }
}

/// The address of one RTM_NEWADDR payload when it is on `lo` and ours.
pub(crate) fn parse_ours(p: &[u8], lo: u32) -> Option<IpAddr> {
    if p.len() < 8 {
        return None;
    }
    let fam = p[0];
    let index = u32::from_ne_bytes([p[4], p[5], p[6], p[7]]);
    if index != lo {
        return None;
    }
    let mut off = 8;
    let mut addr = None;
    let mut proto = None;
    while off + 4 <= p.len() {
        let alen = u16::from_ne_bytes([p[off], p[off + 1]]) as usize;
        let aty = u16::from_ne_bytes([p[off + 2], p[off + 3]]);
        if alen < 4 || off + alen > p.len() {
            break;
        }
        let data = &p[off + 4..off + alen];
        match aty {
            IFA_LOCAL | IFA_ADDRESS if addr.is_none() || aty == IFA_LOCAL => {
                addr = match (fam as i32, data.len()) {
                    (libc::AF_INET, 4) => Some(IpAddr::from([data[0], data[1], data[2], data[3]])),
                    (libc::AF_INET6, 16) => {
                        let mut a = [0u8; 16];
                        a.copy_from_slice(data);
                        Some(IpAddr::from(a))
                    }
                    _ => addr,
                }
            }
            IFA_PROTO if !data.is_empty() => proto = Some(data[0]),
            _ => {}
        }
        off += align4(alen);
    }
    (proto == Some(ADDR_PROTO)).then_some(addr).flatten()
}

const _: () = assert!(size_of::<u32>() == 4);

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
