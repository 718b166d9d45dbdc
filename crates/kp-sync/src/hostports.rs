//! The node addresses and ports that host processes listen on, so that the
//! model refuses a Service's externalIP or LoadBalancer IP there (a Service
//! must not take over the node's SSH or kubelet: CVE-2020-8554's shape).
//!
//! Read from `/proc/thread-self/net/{tcp,tcp6,udp,udp6}` (the sync thread's
//! network namespace) and the node's addresses (getifaddrs), and only when
//! some Service claims a node address: otherwise nothing is read, so a
//! busy node's socket tables are not walked at every sync.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use kp_model::{AddressKey, IpFamily, Protocol};

/// TCP_LISTEN in /proc/net/tcp.
const TCP_LISTEN: &str = "0A";
/// TCP_CLOSE: how an unconnected (listening) UDP socket shows.
const UDP_UNCONNECTED: &str = "07";

/// The reserved addresses among `claimed` (the externalIPs and LoadBalancer
/// IPs Services claim) for `family`.
pub fn reserved(family: IpFamily, claimed: &BTreeSet<IpAddr>) -> BTreeSet<AddressKey> {
    let local: BTreeSet<IpAddr> = local_addresses()
        .into_iter()
        .filter(|ip| family.matches(ip) && claimed.contains(ip))
        .collect();
    if local.is_empty() {
        return BTreeSet::new();
    }
    let mut out = BTreeSet::new();
    for (file, proto, state) in [
        ("tcp", Protocol::Tcp, TCP_LISTEN),
        ("tcp6", Protocol::Tcp, TCP_LISTEN),
        ("udp", Protocol::Udp, UDP_UNCONNECTED),
        ("udp6", Protocol::Udp, UDP_UNCONNECTED),
    ] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/thread-self/net/{file}")) else {
            continue;
        };
        for (addr, port) in listeners(&text, state) {
            // A wildcard socket listens on every address; an IPv6 one
            // (`::`) usually on IPv4 ones too (IPV6_V6ONLY off).
            if addr.is_unspecified() {
                out.extend(local.iter().map(|ip| AddressKey::Ip(*ip, proto, port)));
            } else if local.contains(&addr) {
                out.insert(AddressKey::Ip(addr, proto, port));
            }
        }
    }
    out
}

/// (local address, port) of the sockets in `state` in a /proc/net/{tcp,udp}[6]
/// table. Lines that do not parse are skipped.
pub fn listeners(text: &str, state: &str) -> Vec<(IpAddr, u16)> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (local, remote, st) = (f.get(1)?, f.get(2)?, f.get(3)?);
            if *st != state {
                return None;
            }
            // A connected UDP socket (remote set) is a client, not a listener.
            let (raddr, _) = remote.split_once(':')?;
            if raddr.bytes().any(|b| b != b'0') {
                return None;
            }
            let (addr, port) = local.split_once(':')?;
            Some((parse_hex_addr(addr)?, u16::from_str_radix(port, 16).ok()?))
        })
        .collect()
}

/// The kernel prints addresses as 32-bit words in host byte order.
fn parse_hex_addr(s: &str) -> Option<IpAddr> {
    let word = |i: usize| -> Option<[u8; 4]> {
        let w = u32::from_str_radix(s.get(i * 8..i * 8 + 8)?, 16).ok()?;
        Some(w.to_ne_bytes())
    };
    match s.len() {
        8 => Some(IpAddr::V4(Ipv4Addr::from(word(0)?))),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            Some(IpAddr::V6(Ipv6Addr::from(b)))
        }
        _ => None,
    }
}

/// Every address of this network namespace's interfaces.
fn local_addresses() -> Vec<IpAddr> {
    kp_netlink::ifaddr::interface_addresses()
        .into_iter()
        .map(|(ip, _)| ip)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // The tables are in host byte order; these samples are a little-endian
    // host's.
    #[cfg(target_endian = "little")]
    #[test]
    fn parses_proc_net_tables() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0\n\
   1: 0A00000A:D431 0B00000A:0016 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0 100 0 0 10 0\n";
        assert_eq!(
            listeners(tcp, TCP_LISTEN),
            vec![("127.0.0.1".parse().unwrap(), 22)]
        );
        let tcp6 = "header\n   0: 00000000000000000000000000000000:2A3A 00000000000000000000000000000000:0000 0A 0 0 0 0 0 0 0\n";
        assert_eq!(
            listeners(tcp6, TCP_LISTEN),
            vec![("::".parse().unwrap(), 10810)]
        );
        assert_eq!(
            parse_hex_addr("0000FDFE000000000000000001000000"),
            Some("fefd::1".parse().unwrap())
        );
    }
}
