//! Thin libc wrappers: listening sockets (with IP_FREEBIND), local addresses,
//! splice pipes, socket options tokio does not expose.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub(crate) fn sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            let sin = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_scope_id = a.scope_id();
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn setsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    opt: libc::c_int,
    v: libc::c_int,
) -> io::Result<()> {
    // SAFETY: passes a pointer to a live c_int and its size.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            &v as *const libc::c_int as *const libc::c_void,
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// A non-blocking socket bound to `addr` (and listening, for TCP). With
/// `freebind` the address need not be configured yet (it is being added to
/// the loopback interface).
pub(crate) fn bind_socket(addr: &SocketAddr, tcp: bool, freebind: bool) -> io::Result<OwnedFd> {
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let ty = if tcp {
        libc::SOCK_STREAM
    } else {
        libc::SOCK_DGRAM
    };
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd =
        cvt(unsafe { libc::socket(domain, ty | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: fd was just returned by socket(2) and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let raw = fd.as_raw_fd();
    if tcp {
        // Restarts must not wait for TIME_WAIT sockets of the previous run.
        setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    }
    if addr.is_ipv6() {
        setsockopt_int(raw, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)?;
    }
    if freebind {
        if addr.is_ipv4() {
            setsockopt_int(raw, libc::IPPROTO_IP, libc::IP_FREEBIND, 1)?;
        } else {
            setsockopt_int(raw, libc::IPPROTO_IPV6, libc::IPV6_FREEBIND, 1)?;
        }
    }
    let (ss, len) = sockaddr(addr);
    // SAFETY: ss holds a valid sockaddr of length len.
    cvt(unsafe { libc::bind(raw, &ss as *const _ as *const libc::sockaddr, len) })?;
    if tcp {
        // SAFETY: listen(2) on our socket.
        cvt(unsafe { libc::listen(raw, 4096) })?;
    }
    Ok(fd)
}

/// Makes close() send a RST instead of a FIN (a refused or broken
/// connection is reported as such to the other side).
pub(crate) fn set_linger_zero(fd: RawFd) {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: passes a pointer to a live linger struct and its size.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &l as *const libc::linger as *const libc::c_void,
            size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// shutdown(SHUT_WR): passes a half-close on.
pub(crate) fn shutdown_write(fd: RawFd) {
    // SAFETY: shutdown(2) on a socket we hold; errors (not connected) ignored.
    unsafe {
        libc::shutdown(fd, libc::SHUT_WR);
    }
}

/// Every address configured on this host (this network namespace), with
/// whether it sits on a loopback interface. O(addresses), and with
/// `VipMode::Loopback` every Service IP is one: the proxier reads it on full
/// syncs only.
pub(crate) fn local_addresses() -> Vec<(IpAddr, bool)> {
    kp_netlink::ifaddr::interface_addresses()
}

/// A pipe for splice(2): socket -> pipe -> socket moves page references
/// instead of copying bytes through userspace.
#[cfg(target_os = "linux")]
pub(crate) struct Pipe {
    pub r: OwnedFd,
    pub w: OwnedFd,
    pub capacity: usize,
}

#[cfg(target_os = "linux")]
impl Pipe {
    pub fn new(size: usize) -> io::Result<Pipe> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 writes two fds into the array.
        cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) })?;
        // SAFETY: both fds are fresh and ours.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // A bigger pipe means fewer splice calls per byte; the kernel may cap
        // it (fs.pipe-max-size), in which case the default (64 KiB) stays.
        // SAFETY: fcntl on our own pipe.
        let got = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, size as libc::c_int) };
        let capacity = if got > 0 { got as usize } else { 65536 };
        Ok(Pipe { r, w, capacity })
    }
}

/// One non-blocking splice(2) call.
#[cfg(target_os = "linux")]
pub(crate) fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: splice between fds we hold, no offsets.
    let n = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// True when this process may add addresses and bind any IP
/// (CAP_NET_ADMIN in its effective set).
pub fn has_net_admin() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        // SAFETY: geteuid never fails.
        return unsafe { libc::geteuid() } == 0;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 12) != 0)
}
