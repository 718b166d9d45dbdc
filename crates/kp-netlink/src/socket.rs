//! One netlink socket: netlink-sys's, plus the options it has no method for
//! and the receive loops every caller needs.

use std::fmt;
use std::io;
use std::mem::size_of;
use std::os::fd::AsRawFd;
use std::time::Duration;

use netlink_sys::{protocols, SocketAddr};

use crate::{messages, Answer, Message, Reply, Step, Until};

/// The netlink protocol (family) a socket talks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// rtnetlink: links, addresses.
    Route,
    /// nfnetlink: nf_tables, conntrack.
    Netfilter,
    /// Generic netlink: IPVS.
    Generic,
}

impl Protocol {
    fn number(self) -> isize {
        match self {
            Protocol::Route => protocols::NETLINK_ROUTE,
            Protocol::Netfilter => protocols::NETLINK_NETFILTER,
            Protocol::Generic => protocols::NETLINK_GENERIC,
        }
    }
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kernel answered with this errno.
    #[error("{}", io::Error::from_raw_os_error(*.0))]
    Kernel(i32),
    /// Sending, receiving, or the answer could not be read.
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl Error {
    /// The kernel's errno, when the kernel refused the request.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Kernel(e) => Some(*e),
            Error::Io(_) => None,
        }
    }
}

/// For callers that only speak io::Error: the kernel's refusal becomes the
/// errno as an OS error (so `raw_os_error()` still tells EEXIST from ENOENT).
impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        match e {
            Error::Kernel(errno) => io::Error::from_raw_os_error(errno),
            Error::Io(e) => e,
        }
    }
}

/// How [`Socket::recv_each`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Block for every datagram (up to the receive timeout, if one is set).
    Block,
    /// Read only what is queued already, then return.
    Drain,
}

/// Receive buffer. Dump datagrams are at most 32 KiB (the kernel sizes them
/// by the reader's buffer, capped there); anything larger is reported, not
/// cut (MSG_TRUNC).
const RECV_BUF: usize = 64 * 1024;

/// A netlink socket bound to a kernel-chosen port id, talking to the kernel.
pub struct Socket {
    sock: netlink_sys::Socket,
    protocol: Protocol,
    seq: u32,
    timeout: Option<Duration>,
    buf: Vec<u8>,
}

impl fmt::Debug for Socket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Socket")
            .field("protocol", &self.protocol)
            .field("fd", &self.sock.as_raw_fd())
            .field("seq", &self.seq)
            .finish()
    }
}

fn kernel() -> SocketAddr {
    SocketAddr::new(0, 0)
}

impl Socket {
    /// Opens and binds a socket of `protocol` in the calling thread's network
    /// namespace.
    pub fn open(protocol: Protocol) -> io::Result<Socket> {
        let mut sock = netlink_sys::Socket::new(protocol.number())?;
        // Port id 0: the kernel picks a unique one.
        sock.bind(&kernel())?;
        Ok(Socket {
            sock,
            protocol,
            seq: 1,
            timeout: None,
            buf: vec![0; RECV_BUF],
        })
    }

    /// A fresh sequence number for the next request.
    pub fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// NETLINK_CAP_ACK: error answers carry only the header of the failed
    /// message, not all of it (a failed 100 KiB batch message would not fit
    /// a read).
    pub fn set_cap_ack(&self) -> io::Result<()> {
        self.sock.set_cap_ack(true)
    }

    fn setsockopt<T>(&self, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
        // SAFETY: `value` is a live T and the length given is its size; the
        // descriptor stays open while `self` lives.
        let rc = unsafe {
            libc::setsockopt(
                self.sock.as_raw_fd(),
                level,
                name,
                value as *const T as *const libc::c_void,
                size_of::<T>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Sets a buffer size with the FORCE option (root: ignores
    /// rmem_max/wmem_max), falling back to the plain one.
    fn set_buffer(&self, force: libc::c_int, plain: libc::c_int, bytes: usize) -> io::Result<()> {
        let v = bytes.min(i32::MAX as usize) as libc::c_int;
        self.setsockopt(libc::SOL_SOCKET, force, &v)
            .or_else(|_| self.setsockopt(libc::SOL_SOCKET, plain, &v))
    }

    /// SO_SNDBUFFORCE (else SO_SNDBUF): a message larger than the send
    /// buffer cannot be sent as one datagram.
    pub fn set_send_buffer(&self, bytes: usize) -> io::Result<()> {
        self.set_buffer(libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, bytes)
    }

    /// SO_RCVBUFFORCE (else SO_RCVBUF): room for answers the kernel queues
    /// before we read them.
    pub fn set_recv_buffer(&self, bytes: usize) -> io::Result<()> {
        self.set_buffer(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, bytes)
    }

    /// SO_RCVTIMEO: a blocking read gives up after `timeout` (an error of
    /// kind TimedOut) instead of waiting forever for a silent kernel.
    pub fn set_recv_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        let tv = libc::timeval {
            tv_sec: timeout.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        self.setsockopt(libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv)?;
        self.timeout = Some(timeout);
        Ok(())
    }

    /// Joins multicast group `group` (e.g. RTNLGRP_IPV4_IFADDR): the kernel
    /// then queues its notifications on this socket. Needs no privilege for
    /// rtnetlink.
    pub fn join_group(&self, group: u32) -> io::Result<()> {
        self.sock.add_membership(group)
    }

    /// Sends `buf` (one message or a batch) to the kernel as one datagram.
    pub fn send(&self, buf: &[u8]) -> io::Result<()> {
        let n = self.sock.send_to(buf, &kernel(), 0)?;
        if n != buf.len() {
            return Err(io::Error::other(format!(
                "short netlink send: {n} of {} bytes",
                buf.len()
            )));
        }
        Ok(())
    }

    /// Sends the concatenation of `bufs` to the kernel as one datagram
    /// (sendmsg with an iovec: a large batch needs no contiguous copy).
    pub fn send_vectored(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<()> {
        // The kernel takes at most IOV_MAX (1024) pieces per call.
        if bufs.len() > 1024 {
            return Err(io::Error::other(format!(
                "{} pieces in one netlink send (at most 1024)",
                bufs.len()
            )));
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        // SAFETY: a zeroed sockaddr_nl is the kernel's address (pid 0,
        // groups 0); the iovec array and the buffers it points to outlive the
        // call; IoSlice is ABI-compatible with iovec.
        let n = unsafe {
            let mut addr: libc::sockaddr_nl = std::mem::zeroed();
            addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_name = (&mut addr as *mut libc::sockaddr_nl).cast();
            msg.msg_namelen = size_of::<libc::sockaddr_nl>() as libc::socklen_t;
            msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
            msg.msg_iovlen = bufs.len() as _;
            libc::sendmsg(self.sock.as_raw_fd(), &msg, 0)
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != total {
            return Err(io::Error::other(format!(
                "short netlink send: {n} of {total} bytes"
            )));
        }
        Ok(())
    }

    /// Reads datagrams and hands `f` each message until `f` returns true
    /// (`Ok(true)`), or, with [`Wait::Drain`], until nothing is queued
    /// (`Ok(false)`).
    pub fn recv_each(
        &mut self,
        wait: Wait,
        mut f: impl FnMut(&Message<'_>) -> bool,
    ) -> io::Result<bool> {
        let mut flags = libc::MSG_TRUNC;
        if wait == Wait::Drain {
            flags |= libc::MSG_DONTWAIT;
        }
        loop {
            let n = match self.sock.recv(&mut &mut self.buf[..], flags) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if wait == Wait::Drain {
                        return Ok(false);
                    }
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "no netlink answer from the kernel within {:?}",
                            self.timeout.unwrap_or_default()
                        ),
                    ));
                }
                Err(e) => return Err(e),
            };
            if n > self.buf.len() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "a netlink answer of {n} bytes did not fit the {}-byte receive buffer",
                        self.buf.len()
                    ),
                ));
            }
            for m in messages(&self.buf[..n]) {
                if f(&m?) {
                    return Ok(true);
                }
            }
        }
    }

    /// Sends one request carrying `seq` and hands `f` each data message of
    /// its answer (see [`Answer`]) as it arrives; an error answer is
    /// [`Error::Kernel`].
    pub fn request_each(
        &mut self,
        msg: &[u8],
        seq: u32,
        until: Until,
        mut f: impl FnMut(&Message<'_>),
    ) -> Result<(), Error> {
        self.send(msg)?;
        let answer = Answer { seq, until };
        let mut refused = None;
        self.recv_each(Wait::Block, |m| match answer.step(m) {
            Step::Skip => false,
            Step::Data => {
                f(m);
                false
            }
            Step::End => true,
            Step::Refused(errno) => {
                refused = Some(errno);
                true
            }
        })?;
        match refused {
            Some(errno) => Err(Error::Kernel(errno)),
            None => Ok(()),
        }
    }

    /// [`Socket::request_each`], collecting the data messages.
    pub fn request(&mut self, msg: &[u8], seq: u32, until: Until) -> Result<Vec<Reply>, Error> {
        let mut out = Vec::new();
        self.request_each(msg, seq, until, |m| {
            out.push(Reply {
                ty: m.ty,
                bytes: m.bytes.to_vec(),
            })
        })?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    //! Against the kernel, read-only: rtnetlink questions about links.

    use super::*;
    use crate::{message, Attrs, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};

    const RTM_NEWLINK: u16 = 16;
    const RTM_GETLINK: u16 = 18;
    const IFLA_IFNAME: u16 = 3;

    fn get_link(seq: u32, flags: u16, name: Option<&str>) -> Vec<u8> {
        let mut a = Attrs::new();
        if let Some(n) = name {
            a.str(IFLA_IFNAME, n);
        }
        message(RTM_GETLINK, NLM_F_REQUEST | flags, seq, &[0u8; 16], &a)
    }

    #[test]
    fn requests_get_answers_errors_and_dumps() {
        let mut s = Socket::open(Protocol::Route).expect("opening NETLINK_ROUTE");
        assert!(format!("{s:?}").contains("Route"));
        // Nothing queued: a drain returns at once.
        assert!(!s.recv_each(Wait::Drain, |_| true).unwrap());

        let seq = s.next_seq();
        let r = s
            .request(&get_link(seq, NLM_F_ACK, Some("lo")), seq, Until::Ack)
            .expect("lo exists");
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].ty, RTM_NEWLINK);
        let attrs = crate::ParsedAttrs::parse(&r[0].payload()[16..]);
        assert_eq!(attrs.get(IFLA_IFNAME), Some(&b"lo\0"[..]));

        let seq = s.next_seq();
        let e = s
            .request(
                &get_link(seq, NLM_F_ACK, Some("kp-no-such0")),
                seq,
                Until::Ack,
            )
            .expect_err("no such link");
        assert_eq!(e.errno(), Some(libc::ENODEV));
        assert_eq!(io::Error::from(e).raw_os_error(), Some(libc::ENODEV));

        let seq = s.next_seq();
        let all = s
            .request(&get_link(seq, NLM_F_DUMP, None), seq, Until::Done)
            .expect("link dump");
        assert!(all.iter().all(|m| m.ty == RTM_NEWLINK));
        assert!(!all.is_empty());
    }

    #[test]
    fn a_silent_kernel_times_out() {
        let mut s = Socket::open(Protocol::Netfilter).expect("opening NETLINK_NETFILTER");
        s.set_cap_ack().unwrap();
        s.set_send_buffer(1 << 20).unwrap();
        s.set_recv_buffer(1 << 20).unwrap();
        s.set_recv_timeout(Duration::from_millis(20)).unwrap();
        let e = s.recv_each(Wait::Block, |_| true).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("20ms"), "{e}");
    }
}
