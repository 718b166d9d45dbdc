//! A NETLINK_NETFILTER socket: send one batch, collect the kernel's answers.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const NETLINK_NETFILTER: libc::c_int = 12;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

/// One answer from the kernel: the sequence number it refers to, and the errno
/// (0 for a plain acknowledgement).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    pub seq: u32,
    pub errno: i32,
}

#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
}

fn last_err() -> io::Error {
    io::Error::last_os_error()
}

impl Socket {
    pub fn open() -> io::Result<Socket> {
        // SAFETY: plain socket(2) call; the result is checked before use.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                NETLINK_NETFILTER,
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
        // Error answers carry only the header of the failed message, not the
        // message itself: a failed 100 KiB element batch would not fit a read.
        let one: libc::c_int = 1;
        // SAFETY: setsockopt with a c_int value of the right size.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_NETLINK,
                libc::NETLINK_CAP_ACK,
                &one as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        Ok(Socket { fd })
    }

    /// Raises a buffer size; the FORCE variant (root) ignores rmem_max/wmem_max.
    pub fn set_buf(&self, force: libc::c_int, plain: libc::c_int, size: usize) {
        let v = size.min(i32::MAX as usize) as libc::c_int;
        for opt in [force, plain] {
            // SAFETY: setsockopt with a c_int value of the right size.
            let rc = unsafe {
                libc::setsockopt(
                    self.fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    &v as *const libc::c_int as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc == 0 {
                return;
            }
        }
    }

    pub fn send(&self, buf: &[u8]) -> io::Result<()> {
        // The whole batch must be one datagram: nfnetlink processes a batch per skb.
        self.set_buf(libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, buf.len() + 65536);
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
        if n as usize != buf.len() {
            return Err(io::Error::other(format!(
                "short netlink send: {n} of {} bytes",
                buf.len()
            )));
        }
        Ok(())
    }

    /// Reads answers until `done` says stop. `wait`: block for the first read
    /// (queries); batches are processed inside sendmsg, so their answers are
    /// already queued and are read without blocking.
    pub fn recv_answers(
        &self,
        wait: bool,
        mut done: impl FnMut(&Answer, u16) -> bool,
    ) -> io::Result<Vec<Answer>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let flags = if wait { 0 } else { libc::MSG_DONTWAIT };
            // SAFETY: buf is valid for its length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    flags,
                )
            };
            if n < 0 {
                let e = last_err();
                if e.kind() == io::ErrorKind::WouldBlock {
                    return Ok(out);
                }
                return Err(e);
            }
            let mut off = 0usize;
            let n = n as usize;
            while off + 16 <= n {
                let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
                    as usize;
                let ty = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
                let seq =
                    u32::from_ne_bytes([buf[off + 8], buf[off + 9], buf[off + 10], buf[off + 11]]);
                if len < 16 || off + len > n {
                    return Err(io::Error::other(
                        "truncated netlink message from the kernel",
                    ));
                }
                let errno = if ty == NLMSG_ERROR && len >= 20 {
                    -i32::from_ne_bytes([
                        buf[off + 16],
                        buf[off + 17],
                        buf[off + 18],
                        buf[off + 19],
                    ])
                } else {
                    0
                };
                let a = Answer { seq, errno };
                let stop = done(&a, ty);
                if ty == NLMSG_ERROR {
                    out.push(a);
                }
                if stop || ty == NLMSG_DONE {
                    return Ok(out);
                }
                off += (len + 3) & !3;
            }
        }
    }
}
