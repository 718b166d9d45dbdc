//! rtnetlink interface addresses (RTM_*ADDR): the fixed header, the address
//! attributes and their parsing, shared by IPVS mode (kube-ipvs0) and
//! userspace mode (Service IPs on lo). Each caller keeps its own messages.
//! Also [`interface_addresses`], the one getifaddrs(3) walk of the project.

use std::net::IpAddr;

use crate::{Attrs, ParsedAttrs};

pub const RTM_NEWADDR: u16 = 20;
pub const RTM_DELADDR: u16 = 21;
pub const RTM_GETADDR: u16 = 22;
pub const IFA_ADDRESS: u16 = 1;
pub const IFA_LOCAL: u16 = 2;
pub const IFA_FLAGS: u16 = 8;
pub const IFA_PROTO: u16 = 11;
pub const IFA_F_NODAD: u32 = 0x02;
pub const RT_SCOPE_HOST: u8 = 254;

/// AF_INET or AF_INET6, as ifaddrmsg's family byte.
pub fn family(ip: &IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => libc::AF_INET as u8,
        IpAddr::V6(_) => libc::AF_INET6 as u8,
    }
}

/// 32 or 128: a single address.
pub fn host_prefix(ip: &IpAddr) -> u8 {
    if ip.is_ipv4() {
        32
    } else {
        128
    }
}

/// struct ifaddrmsg. ifa_flags stays 0: the 32-bit IFA_FLAGS attribute
/// carries them.
pub fn ifaddrmsg(family: u8, prefix: u8, scope: u8, index: u32) -> [u8; 8] {
    let i = index.to_ne_bytes();
    [family, prefix, 0, scope, i[0], i[1], i[2], i[3]]
}

/// IFA_LOCAL and IFA_ADDRESS, both `ip` (a point-to-point peer is not used).
pub fn addr_attrs(ip: &IpAddr) -> Attrs {
    let bytes = match ip {
        IpAddr::V4(v) => v.octets().to_vec(),
        IpAddr::V6(v) => v.octets().to_vec(),
    };
    let mut a = Attrs::new();
    a.attr(IFA_LOCAL, &bytes);
    a.attr(IFA_ADDRESS, &bytes);
    a
}

/// One RTM_NEWADDR/RTM_DELADDR payload (ifaddrmsg and attributes), read back.
#[derive(Debug)]
pub struct IfAddr<'a> {
    pub index: u32,
    pub prefix: u8,
    pub ip: IpAddr,
    pub attrs: ParsedAttrs<'a>,
}

/// None for a payload that is too short, of another family, or without an
/// address of the family's length.
pub fn parse(payload: &[u8]) -> Option<IfAddr<'_>> {
    let hdr = payload.get(..8)?;
    let index = u32::from_ne_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]);
    let attrs = ParsedAttrs::parse(&payload[8..]);
    let data = attrs.get(IFA_LOCAL).or_else(|| attrs.get(IFA_ADDRESS))?;
    let ip = match (hdr[0] as i32, data.len()) {
        (libc::AF_INET, 4) => IpAddr::from([data[0], data[1], data[2], data[3]]),
        (libc::AF_INET6, 16) => IpAddr::from(<[u8; 16]>::try_from(data).ok()?),
        _ => return None,
    };
    Some(IfAddr {
        index,
        prefix: hdr[1],
        ip,
        attrs,
    })
}

/// Every address on this network namespace's interfaces, with whether its
/// interface is a loopback one; sorted, without duplicates. Empty if the
/// kernel cannot be asked (each caller treats that as "no address known").
pub fn interface_addresses() -> Vec<(IpAddr, bool)> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a linked list that we walk read-only and free
    // once; each sockaddr is read as the type its family says.
    unsafe {
        if libc::getifaddrs(&mut ifap) != 0 {
            return out;
        }
        let mut cur = ifap;
        while !cur.is_null() {
            let sa = (*cur).ifa_addr;
            let lo = ((*cur).ifa_flags & libc::IFF_LOOPBACK as libc::c_uint) != 0;
            if !sa.is_null() {
                match i32::from((*sa).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(sa as *const libc::sockaddr_in);
                        out.push((IpAddr::from(sin.sin_addr.s_addr.to_ne_bytes()), lo));
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(sa as *const libc::sockaddr_in6);
                        out.push((IpAddr::from(sin6.sin6_addr.s6_addr), lo));
                    }
                    _ => {}
                }
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(ifap);
    }
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn interface_addresses_see_loopback_as_loopback() {
        let all = super::interface_addresses();
        assert!(
            all.contains(&("127.0.0.1".parse().unwrap(), true)),
            "{all:?}"
        );
        let mut sorted = all.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(all, sorted);
    }

    use super::*;

    #[test]
    fn header_attributes_and_parse_back() {
        let ip: IpAddr = "10.96.0.10".parse().unwrap();
        let hdr = ifaddrmsg(family(&ip), host_prefix(&ip), RT_SCOPE_HOST, 7);
        assert_eq!(hdr, [libc::AF_INET as u8, 32, 0, 254, 7, 0, 0, 0]);
        let mut payload = hdr.to_vec();
        payload.extend_from_slice(addr_attrs(&ip).as_bytes());
        let a = parse(&payload).unwrap();
        assert_eq!((a.index, a.prefix, a.ip), (7, 32, ip));
        let ip6: IpAddr = "fd00::1".parse().unwrap();
        let mut p6 = ifaddrmsg(family(&ip6), 128, 0, 1).to_vec();
        p6.extend_from_slice(addr_attrs(&ip6).as_bytes());
        assert_eq!(parse(&p6).unwrap().ip, ip6);
        // An IPv4 header with an IPv6 address, truncations, garbage: None,
        // never a panic.
        let mut mixed = ifaddrmsg(libc::AF_INET as u8, 32, 0, 1).to_vec();
        mixed.extend_from_slice(addr_attrs(&ip6).as_bytes());
        assert!(parse(&mixed).is_none());
        for cut in 0..payload.len() {
            let _ = parse(&payload[..cut]);
        }
        assert!(parse(&[0xff; 40]).is_none());
    }
}
