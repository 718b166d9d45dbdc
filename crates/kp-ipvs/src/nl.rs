//! Netlink framing shared by the IPVS (generic netlink) and rtnetlink code:
//! a message builder with nested attributes, an attribute parser, and a
//! socket that sends one request and collects its answers.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_DUMP: u16 = 0x300;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLA_F_NESTED: u16 = 0x8000;

/// One netlink message being built: header, fixed family header, attributes.
#[derive(Debug, Clone)]
pub struct Msg {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

impl Msg {
    /// Header with length 0 (filled in by [`Msg::finish`]) and pid 0.
    pub fn new(ty: u16, flags: u16, seq: u32) -> Msg {
        let mut buf = Vec::with_capacity(128);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&ty.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        Msg {
            buf,
            nests: Vec::new(),
        }
    }

    /// Raw bytes of a fixed header (genlmsghdr, ifinfomsg, ...).
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self.pad();
        self
    }

    fn pad(&mut self) {
        let n = align4(self.buf.len());
        self.buf.resize(n, 0);
    }

    pub fn attr(&mut self, ty: u16, data: &[u8]) -> &mut Self {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.pad();
        self
    }

    pub fn u16(&mut self, ty: u16, v: u16) -> &mut Self {
        self.attr(ty, &v.to_ne_bytes())
    }
    pub fn u32(&mut self, ty: u16, v: u32) -> &mut Self {
        self.attr(ty, &v.to_ne_bytes())
    }
    /// NUL-terminated string.
    pub fn str(&mut self, ty: u16, s: &str) -> &mut Self {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.attr(ty, &v)
    }

    pub fn begin_nest(&mut self, ty: u16) -> &mut Self {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        self
    }

    pub fn end_nest(&mut self) -> &mut Self {
        if let Some(start) = self.nests.pop() {
            let len = (self.buf.len() - start) as u16;
            self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        }
        self
    }

    /// The finished message with its length set.
    pub fn finish(mut self) -> Vec<u8> {
        while !self.nests.is_empty() {
            self.end_nest();
        }
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf
    }
}

/// Attributes of one level: (type without flags, payload).
pub fn parse_attrs(mut b: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while b.len() >= 4 {
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let ty = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        if len < 4 || len > b.len() {
            break;
        }
        out.push((ty, &b[4..len]));
        b = &b[align4(len).min(b.len())..];
    }
    out
}

pub fn get<'a>(attrs: &[(u16, &'a [u8])], ty: u16) -> Option<&'a [u8]> {
    attrs.iter().find(|(t, _)| *t == ty).map(|(_, d)| *d)
}

pub fn get_u32(attrs: &[(u16, &[u8])], ty: u16) -> Option<u32> {
    let d = get(attrs, ty)?;
    Some(u32::from_ne_bytes(d.get(..4)?.try_into().ok()?))
}

pub fn get_u16(attrs: &[(u16, &[u8])], ty: u16) -> Option<u16> {
    let d = get(attrs, ty)?;
    Some(u16::from_ne_bytes(d.get(..2)?.try_into().ok()?))
}

/// One message of an answer: type and the bytes after the netlink header.
#[derive(Debug, Clone)]
pub struct Reply {
    pub ty: u16,
    pub payload: Vec<u8>,
}

/// A netlink socket of one protocol (NETLINK_GENERIC, NETLINK_ROUTE).
pub struct Socket {
    fd: OwnedFd,
    seq: u32,
}

fn last_err() -> io::Error {
    io::Error::last_os_error()
}

impl Socket {
    pub fn open(protocol: libc::c_int) -> io::Result<Socket> {
        // SAFETY: plain socket(2) call; the result is checked before use.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                protocol,
            )
        };
        if fd < 0 {
            return Err(last_err());
        }
        // SAFETY: fd is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_nl is plain data; zeroed is a valid value.
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
            return Err(last_err());
        }
        Ok(Socket { fd, seq: 1 })
    }

    pub fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    fn send(&self, buf: &[u8]) -> io::Result<()> {
        // SAFETY: sockaddr_nl zeroed = the kernel (pid 0).
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: buf and sa are valid for the lengths given.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                buf.as_ptr() as *const libc::c_void,
                buf.len(),
                0,
                &sa as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(last_err());
        }
        Ok(())
    }

    /// Sends one request (which must carry `seq`) and returns the messages of
    /// its answer: for a dump every message up to NLMSG_DONE, otherwise the
    /// data messages before the acknowledgement (so non-dump requests must
    /// ask for one: NLM_F_ACK). An error answer becomes an
    /// io::Error with the kernel's errno.
    pub fn request(&mut self, msg: &[u8], seq: u32, dump: bool) -> io::Result<Vec<Reply>> {
        self.send(msg)?;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: buf is valid for its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                )
            };
            if n < 0 {
                let e = last_err();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let n = n as usize;
            let mut off = 0usize;
            while off + 16 <= n {
                let len =
                    u32::from_ne_bytes(buf[off..off + 4].try_into().unwrap_or([0; 4])) as usize;
                let ty = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
                let mseq = u32::from_ne_bytes(buf[off + 8..off + 12].try_into().unwrap_or([0; 4]));
                if len < 16 || off + len > n {
                    return Err(io::Error::other(
                        "truncated netlink message from the kernel",
                    ));
                }
                let payload = &buf[off + 16..off + len];
                off += align4(len);
                if mseq != seq {
                    continue;
                }
                match ty {
                    NLMSG_ERROR => {
                        let errno = payload
                            .get(..4)
                            .and_then(|b| b.try_into().ok())
                            .map(i32::from_ne_bytes)
                            .unwrap_or(0);
                        if errno != 0 {
                            return Err(io::Error::from_raw_os_error(-errno));
                        }
                        if !dump {
                            return Ok(out);
                        }
                    }
                    NLMSG_DONE => return Ok(out),
                    _ => out.push(Reply {
                        ty,
                        payload: payload.to_vec(),
                    }),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_are_framed_and_padded() {
        let mut m = Msg::new(0x10, NLM_F_REQUEST | NLM_F_ACK, 7);
        m.raw(&[3, 1, 0, 0]);
        m.begin_nest(1).u16(1, 2).str(6, "rr").end_nest();
        let b = m.finish();
        let want: Vec<u8> = [
            &40u32.to_ne_bytes()[..],
            &0x10u16.to_ne_bytes(),
            &5u16.to_ne_bytes(),
            &7u32.to_ne_bytes(),
            &0u32.to_ne_bytes(),
            &[3, 1, 0, 0],
            // nest: len 20, type 1|NESTED
            &20u16.to_ne_bytes(),
            &0x8001u16.to_ne_bytes(),
            &6u16.to_ne_bytes(),
            &1u16.to_ne_bytes(),
            &2u16.to_ne_bytes(),
            &[0, 0],
            &7u16.to_ne_bytes(),
            &6u16.to_ne_bytes(),
            b"rr\0",
            &[0],
        ]
        .concat();
        assert_eq!(b, want);
        let top = parse_attrs(&b[20..]);
        assert_eq!(top.len(), 1);
        assert_eq!(top[0].0, 1);
        let inner = parse_attrs(top[0].1);
        assert_eq!(get_u16(&inner, 1), Some(2));
        assert_eq!(get(&inner, 6), Some(&b"rr\0"[..]));
    }

    #[test]
    fn truncated_attributes_stop_parsing() {
        // Length field larger than the buffer: ignored, not a panic.
        let b = [200u8, 0, 1, 0, 1, 2];
        assert!(parse_attrs(&b).is_empty());
        assert!(parse_attrs(&[1, 0]).is_empty());
    }
}
