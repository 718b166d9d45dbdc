//! Thin libc helpers for what std sockets cannot do: binding a TCP client to
//! a source address before connecting, and `IPV6_V6ONLY` on listeners.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn raw_addr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// A new close-on-exec socket of the family of `addr`.
pub(crate) fn socket_for(addr: &SocketAddr, ty: libc::c_int) -> io::Result<OwnedFd> {
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain syscall; the returned fd is owned by the OwnedFd below.
    let fd = cvt(unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: fd is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn setsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    opt: libc::c_int,
    val: libc::c_int,
) -> io::Result<()> {
    // SAFETY: passes a pointer to a live c_int with its exact size.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&val as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

pub(crate) fn set_reuseaddr(fd: &OwnedFd) -> io::Result<()> {
    setsockopt_int(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)
}

pub(crate) fn set_v6only(fd: &OwnedFd) -> io::Result<()> {
    setsockopt_int(fd.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)
}

pub(crate) fn bind(fd: &OwnedFd, addr: &SocketAddr) -> io::Result<()> {
    let (storage, len) = raw_addr(addr);
    // SAFETY: storage holds a valid sockaddr of length len.
    cvt(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&storage as *const libc::sockaddr_storage).cast(),
            len,
        )
    })
    .map(|_| ())
}

pub(crate) fn listen(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: plain syscall on an owned fd.
    cvt(unsafe { libc::listen(fd.as_raw_fd(), 1024) }).map(|_| ())
}

fn set_nonblocking(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: fcntl on an fd we own.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    let flags = if on {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, flags) }).map(|_| ())
}

fn poll_ms(timeout: Duration) -> libc::c_int {
    timeout.as_millis().clamp(1, libc::c_int::MAX as u128) as libc::c_int
}

/// Waits until `fd` has one of `events` or the timeout passes; returns
/// whether it became ready.
pub(crate) fn poll_one(fd: RawFd, events: libc::c_short, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, poll_ms(timeout)) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(n > 0);
    }
}

/// Connects `fd` to `addr`, giving up after `timeout`; leaves the socket blocking.
pub(crate) fn connect_timeout(
    fd: &OwnedFd,
    addr: &SocketAddr,
    timeout: Duration,
) -> io::Result<()> {
    let raw = fd.as_raw_fd();
    set_nonblocking(raw, true)?;
    let (storage, len) = raw_addr(addr);
    // SAFETY: storage holds a valid sockaddr of length len.
    let ret =
        unsafe { libc::connect(raw, (&storage as *const libc::sockaddr_storage).cast(), len) };
    if ret < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
        if !poll_one(raw, libc::POLLOUT, timeout)? {
            return Err(io::Error::from(io::ErrorKind::TimedOut));
        }
        let mut err: libc::c_int = 0;
        let mut elen = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: err/elen are live and sized for SO_ERROR.
        cvt(unsafe {
            libc::getsockopt(
                raw,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&mut err as *mut libc::c_int).cast(),
                &mut elen,
            )
        })?;
        if err != 0 {
            return Err(io::Error::from_raw_os_error(err));
        }
    }
    set_nonblocking(raw, false)
}

/// Asks the kernel to report each datagram's destination address
/// (`IP_PKTINFO` / `IPV6_RECVPKTINFO`).
pub(crate) fn enable_pktinfo(fd: &OwnedFd, v6: bool) -> io::Result<()> {
    if v6 {
        setsockopt_int(
            fd.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_RECVPKTINFO,
            1,
        )
    } else {
        setsockopt_int(fd.as_raw_fd(), libc::IPPROTO_IP, libc::IP_PKTINFO, 1)
    }
}

fn from_raw_addr(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match libc::c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin: libc::sockaddr_in =
                unsafe { std::ptr::read((storage as *const libc::sockaddr_storage).cast()) };
            let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6: libc::sockaddr_in6 =
                unsafe { std::ptr::read((storage as *const libc::sockaddr_storage).cast()) };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                ip,
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// Control-message buffer, u64-aligned as cmsghdr requires.
type CmsgBuf = [u64; 16];

/// Receives one datagram; returns its length, sender and (if pktinfo is
/// enabled) the destination address it was sent to.
pub(crate) fn recv_with_dst(
    fd: RawFd,
    buf: &mut [u8],
) -> io::Result<(usize, SocketAddr, Option<std::net::IpAddr>)> {
    // SAFETY: zeroed sockaddr_storage / msghdr are valid initial values.
    let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
    let mut control: CmsgBuf = [0; 16];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_name = (&mut storage as *mut libc::sockaddr_storage).cast();
    msg.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of::<CmsgBuf>() as _;
    // SAFETY: every pointer in msg refers to live buffers of the stated sizes.
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let peer = from_raw_addr(&storage).ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidData, "datagram without an IP sender")
    })?;
    let mut dst = None;
    // SAFETY: CMSG_* walk the control buffer the kernel just filled in,
    // bounded by msg_controllen; the payload types match level/type.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            let (level, ty) = ((*cmsg).cmsg_level, (*cmsg).cmsg_type);
            if level == libc::IPPROTO_IP && ty == libc::IP_PKTINFO {
                let info: libc::in_pktinfo = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast());
                dst = Some(std::net::Ipv4Addr::from(info.ipi_addr.s_addr.to_ne_bytes()).into());
            } else if level == libc::IPPROTO_IPV6 && ty == libc::IPV6_PKTINFO {
                let info: libc::in6_pktinfo =
                    std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast());
                dst = Some(std::net::Ipv6Addr::from(info.ipi6_addr.s6_addr).into());
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n as usize, peer, dst))
}

/// Sends `buf` to `peer` with source address `src` (via a pktinfo control
/// message), so a reply leaves from the address the request was sent to.
pub(crate) fn send_from(
    fd: RawFd,
    buf: &[u8],
    peer: &SocketAddr,
    src: std::net::IpAddr,
) -> io::Result<usize> {
    let (storage, len) = raw_addr(peer);
    let mut control: CmsgBuf = [0; 16];
    let mut iov = libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: zeroed msghdr is a valid initial value.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_name = (&storage as *const libc::sockaddr_storage) as *mut libc::c_void;
    msg.msg_namelen = len;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE/CMSG_LEN are pure size computations; the header and
    // payload are written inside `control`, which is larger than CMSG_SPACE
    // of either pktinfo struct.
    unsafe {
        let (level, ty, data_len) = match src {
            std::net::IpAddr::V4(_) => (
                libc::IPPROTO_IP,
                libc::IP_PKTINFO,
                size_of::<libc::in_pktinfo>(),
            ),
            std::net::IpAddr::V6(_) => (
                libc::IPPROTO_IPV6,
                libc::IPV6_PKTINFO,
                size_of::<libc::in6_pktinfo>(),
            ),
        };
        msg.msg_controllen = libc::CMSG_SPACE(data_len as u32) as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = level;
        (*cmsg).cmsg_type = ty;
        (*cmsg).cmsg_len = libc::CMSG_LEN(data_len as u32) as _;
        match src {
            std::net::IpAddr::V4(ip) => {
                let info = libc::in_pktinfo {
                    ipi_ifindex: 0,
                    ipi_spec_dst: libc::in_addr {
                        s_addr: u32::from_ne_bytes(ip.octets()),
                    },
                    ipi_addr: libc::in_addr { s_addr: 0 },
                };
                std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast(), info);
            }
            std::net::IpAddr::V6(ip) => {
                let info = libc::in6_pktinfo {
                    ipi6_addr: libc::in6_addr {
                        s6_addr: ip.octets(),
                    },
                    ipi6_ifindex: 0,
                };
                std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast(), info);
            }
        }
    }
    // SAFETY: msg points at live buffers of the stated sizes.
    let n = unsafe { libc::sendmsg(fd, &msg, 0) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}
