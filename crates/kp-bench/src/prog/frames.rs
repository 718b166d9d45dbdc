//! Crafted Ethernet frames for the programs, and reading their output.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "TCP",
            Proto::Udp => "UDP",
        }
    }
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => 6,
            Proto::Udp => 17,
        }
    }
}

/// The MACs of the external interface's far end and of the node.
pub const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x77, 0x02];
pub const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x77, 0x01];

/// Payload bytes after the TCP or UDP header.
const PAYLOAD: usize = 64;

#[derive(Clone, Debug)]
pub struct Frame {
    pub bytes: Vec<u8>,
    /// Where the source port is (to vary it for first packets).
    pub sport_off: usize,
    /// Where the source address's last 4 bytes are.
    pub saddr_tail_off: usize,
}

impl Frame {
    /// A frame from `src`:`sport` to `dst`:`dport` (TCP: a SYN when `syn`,
    /// else an ACK), with valid checksums.
    pub fn new(proto: Proto, src: IpAddr, sport: u16, dst: IpAddr, dport: u16, syn: bool) -> Frame {
        let l4len = match proto {
            Proto::Tcp => 20,
            Proto::Udp => 8,
        } + PAYLOAD;
        let mut l4 = vec![0u8; l4len];
        l4[0..2].copy_from_slice(&sport.to_be_bytes());
        l4[2..4].copy_from_slice(&dport.to_be_bytes());
        match proto {
            Proto::Tcp => {
                l4[4..8].copy_from_slice(&1000u32.to_be_bytes());
                if !syn {
                    l4[8..12].copy_from_slice(&2000u32.to_be_bytes());
                }
                l4[12] = 5 << 4;
                l4[13] = if syn { 0x02 } else { 0x10 };
                l4[14..16].copy_from_slice(&65535u16.to_be_bytes());
            }
            Proto::Udp => {
                l4[4..6].copy_from_slice(&(l4len as u16).to_be_bytes());
            }
        }
        for (i, b) in l4.iter_mut().enumerate().skip(l4len - PAYLOAD) {
            *b = i as u8;
        }
        let csum_at = match proto {
            Proto::Tcp => 16,
            Proto::Udp => 6,
        };
        let mut f = Vec::with_capacity(14 + 40 + l4len);
        f.extend_from_slice(&NODE_MAC);
        f.extend_from_slice(&PEER_MAC);
        let (sport_off, saddr_tail_off);
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                f.extend_from_slice(&0x0800u16.to_be_bytes());
                let mut ip = [0u8; 20];
                ip[0] = 0x45;
                ip[2..4].copy_from_slice(&((20 + l4len) as u16).to_be_bytes());
                ip[6] = 0x40; // DF
                ip[8] = 64;
                ip[9] = proto.number();
                ip[12..16].copy_from_slice(&s.octets());
                ip[16..20].copy_from_slice(&d.octets());
                let c = fold(sum(&ip, 0));
                ip[10..12].copy_from_slice(&c.to_be_bytes());
                let mut pseudo = Vec::new();
                pseudo.extend_from_slice(&s.octets());
                pseudo.extend_from_slice(&d.octets());
                pseudo.extend_from_slice(&[0, proto.number()]);
                pseudo.extend_from_slice(&(l4len as u16).to_be_bytes());
                let c = fold(sum(&l4, sum(&pseudo, 0)));
                l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
                saddr_tail_off = 14 + 12;
                sport_off = 14 + 20;
                f.extend_from_slice(&ip);
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                f.extend_from_slice(&0x86ddu16.to_be_bytes());
                let mut ip = [0u8; 40];
                ip[0] = 0x60;
                ip[4..6].copy_from_slice(&(l4len as u16).to_be_bytes());
                ip[6] = proto.number();
                ip[7] = 64;
                ip[8..24].copy_from_slice(&s.octets());
                ip[24..40].copy_from_slice(&d.octets());
                let mut pseudo = Vec::new();
                pseudo.extend_from_slice(&s.octets());
                pseudo.extend_from_slice(&d.octets());
                pseudo.extend_from_slice(&(l4len as u32).to_be_bytes());
                pseudo.extend_from_slice(&[0, 0, 0, proto.number()]);
                let c = fold(sum(&l4, sum(&pseudo, 0)));
                l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
                saddr_tail_off = 14 + 8 + 12;
                sport_off = 14 + 40;
                f.extend_from_slice(&ip);
            }
            _ => unreachable!("both addresses of one family"),
        }
        f.extend_from_slice(&l4);
        Frame {
            bytes: f,
            sport_off,
            saddr_tail_off,
        }
    }

    /// An ARP request: no IP, so the programs leave it at their first check.
    pub fn arp() -> Frame {
        let mut f = Vec::new();
        f.extend_from_slice(&[0xff; 6]);
        f.extend_from_slice(&PEER_MAC);
        f.extend_from_slice(&0x0806u16.to_be_bytes());
        f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
        f.extend_from_slice(&PEER_MAC);
        f.extend_from_slice(&[192, 168, 77, 2]);
        f.extend_from_slice(&[0; 6]);
        f.extend_from_slice(&[192, 168, 77, 1]);
        f.resize(60, 0);
        Frame {
            bytes: f,
            sport_off: 0,
            saddr_tail_off: 0,
        }
    }

    /// The frame of the `i`th new flow: another client port, and past
    /// 60,000 ports another client address.
    pub fn vary(&mut self, i: u64) {
        let port = 1024 + (i % 60_000) as u16;
        self.bytes[self.sport_off..self.sport_off + 2].copy_from_slice(&port.to_be_bytes());
        let hi = ((i / 60_000) as u32) & 0xffff;
        let off = self.saddr_tail_off + 2;
        self.bytes[off..off + 2].copy_from_slice(&(hi as u16).to_be_bytes());
    }
}

/// A run's result: the program's return value and the frame as it left.
pub struct Out {
    pub retval: u32,
    pub data: Vec<u8>,
}

impl Out {
    /// The frame's addresses and ports (IPv4 or IPv6, no options).
    pub fn tuple(&self) -> Option<(IpAddr, u16, IpAddr, u16)> {
        let d = &self.data;
        let et = u16::from_be_bytes([*d.get(12)?, *d.get(13)?]);
        let port =
            |o: usize| -> Option<u16> { Some(u16::from_be_bytes([*d.get(o)?, *d.get(o + 1)?])) };
        match et {
            0x0800 => {
                let ihl = usize::from(d.get(14)? & 0xf) * 4;
                let s: [u8; 4] = d.get(26..30)?.try_into().ok()?;
                let t: [u8; 4] = d.get(30..34)?.try_into().ok()?;
                let l4 = 14 + ihl;
                Some((
                    IpAddr::V4(Ipv4Addr::from(s)),
                    port(l4)?,
                    IpAddr::V4(Ipv4Addr::from(t)),
                    port(l4 + 2)?,
                ))
            }
            0x86dd => {
                let s: [u8; 16] = d.get(22..38)?.try_into().ok()?;
                let t: [u8; 16] = d.get(38..54)?.try_into().ok()?;
                Some((
                    IpAddr::V6(Ipv6Addr::from(s)),
                    port(54)?,
                    IpAddr::V6(Ipv6Addr::from(t)),
                    port(56)?,
                ))
            }
            _ => None,
        }
    }
}

fn sum(b: &[u8], mut acc: u32) -> u32 {
    for c in b.chunks(2) {
        let w = u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]);
        acc += u32::from(w);
    }
    acc
}

fn fold(mut s: u32) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}
