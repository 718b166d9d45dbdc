//! The maps' keys and values, byte for byte as bpf/lib/maps.h and bpf/sock.c declare them.
//!
//! Addresses are stored as the kernel hands them to the program (network byte
//! order in memory), ports likewise; an IPv4 address sits in `addr[0]` with
//! `family` 4.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use kp_model::Protocol;

/// Pinned map names (also the names in the BPF object).
pub const SERVICES: &str = "kp_services";
pub const BACKENDS: &str = "kp_backends";
pub const MEMBERS: &str = "kp_members";
pub const REVNAT: &str = "kp_revnat";
pub const UDP_FLOWS: &str = "kp_udp_flows";
pub const ALL_MAPS: [&str; 5] = [SERVICES, BACKENDS, MEMBERS, REVNAT, UDP_FLOWS];
/// The tc programs' own maps (bpf/lib/maps.h, `--bpf-nodeport`): their
/// flows both ways (one table, keyed by the tuple a packet arrives with),
/// the node's addresses.
pub const NP_FLOWS: &str = "kp_np_flows";
pub const NP_NODE: &str = "kp_np_node";
/// The generations the proxy bumps (`[route, members]`): a flow entry made
/// in another asks the FIB (or kp_members) again once.
pub const NP_GEN: &str = "kp_np_gen";
/// Per-CPU counts of the packets tc and XDP translated (bpf/tc.c).
pub const NP_STATS: &str = "kp_np_stats";
pub const NODEPORT_MAPS: [&str; 5] = [NP_FLOWS, NP_NODE, MAGLEV, NP_STATS, NP_GEN];
/// The tc programs' pins of earlier versions (the replies' own table, now
/// entries of kp_np_flows): removed at install and cleanup.
pub const RETIRED_NODEPORT_MAPS: [&str; 1] = ["kp_np_replies"];
/// The size of a kp_np_flows entry (struct nat): a pinned table of another
/// layout (an earlier version's) is replaced at install.
pub const NP_FLOW_VALUE_SIZE: u32 = 104;

/// `SvcKey::family` bit of the entries for traffic from outside the node,
/// which only the tc programs look up (bpf/lib/maps.h).
pub const OUTSIDE: u8 = 0x80;
/// `SvcVal::flags`: externalTrafficPolicy Local, the client's address is
/// kept (bpf/tc.c).
pub const FLAG_LOCAL: u32 = 1;
/// `SvcVal::flags`: the endpoint comes from the Service port's Maglev table
/// in `kp_maglev` (`--bpf-lb-algorithm maglev`), not at random.
pub const FLAG_MAGLEV: u32 = 2;
/// `SvcVal::flags`: direct server return (`--bpf-lb-mode dsr`, or `hybrid`
/// for a TCP port): a request for an endpoint on another node keeps the
/// client's address and carries the Service address to that node, which
/// sends the reply itself (IPv4; bpf/tc.c).
pub const FLAG_DSR: u32 = 4;

/// The Maglev lookup tables (`--bpf-lb-algorithm maglev`, maglev.rs),
/// declared by the tc programs' object (so one of [`NODEPORT_MAPS`]).
pub const MAGLEV: &str = "kp_maglev";
/// Pins earlier versions made and this one no longer uses (session affinity
/// records, now nftables' alone): removed at install and cleanup.
pub const RETIRED_MAPS: [&str; 1] = ["kp_affinity"];

/// An address as the program sees it: four 32-bit words in network order.
pub fn addr_words(ip: IpAddr) -> [u32; 4] {
    match ip {
        IpAddr::V4(v4) => [u32::from_ne_bytes(v4.octets()), 0, 0, 0],
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            [w(0), w(4), w(8), w(12)]
        }
    }
}

fn words_addr(words: [u32; 4], v4: bool) -> IpAddr {
    if v4 {
        IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))
    } else {
        let mut o = [0u8; 16];
        for (i, w) in words.iter().enumerate() {
            o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        IpAddr::V6(Ipv6Addr::from(o))
    }
}

/// A port as the program sees it (network order in memory).
pub fn port_net(port: u16) -> u16 {
    u16::from_ne_bytes(port.to_be_bytes())
}

fn net_port(port: u16) -> u16 {
    u16::from_be_bytes(port.to_ne_bytes())
}

fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => libc::IPPROTO_TCP as u8,
        Protocol::Udp => libc::IPPROTO_UDP as u8,
        Protocol::Sctp => libc::IPPROTO_SCTP as u8,
    }
}

/// A Service address: what a client connects to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SvcKey {
    pub addr: [u32; 4],
    pub port: u16,
    pub proto: u8,
    pub family: u8,
}

impl SvcKey {
    pub fn new(ip: IpAddr, port: u16, proto: Protocol) -> Self {
        SvcKey {
            addr: addr_words(ip),
            port: port_net(port),
            proto: proto_number(proto),
            family: if ip.is_ipv4() { 4 } else { 6 },
        }
    }
    /// The same address as the tc programs look it up for traffic from
    /// outside the node.
    pub fn outside(mut self) -> Self {
        self.family |= OUTSIDE;
        self
    }
    /// Whether only the tc programs look this key up.
    pub fn is_outside(&self) -> bool {
        self.family & OUTSIDE != 0
    }
    pub fn ip(&self) -> IpAddr {
        words_addr(self.addr, self.family & !OUTSIDE == 4)
    }
    pub fn port(&self) -> u16 {
        net_port(self.port)
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SvcVal {
    pub id: u32,
    /// Endpoint slots 0..count; never 0 in the map.
    pub count: u32,
    /// The Maglev table's size for [`FLAG_MAGLEV`] entries, else 0 (the
    /// field held a session affinity timeout in earlier versions, 0 since:
    /// pinned maps keep their layout across an upgrade).
    pub maglev_size: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendKey {
    pub svc_id: u32,
    pub slot: u32,
}

/// An endpoint address and port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendVal {
    pub addr: [u32; 4],
    pub port: u16,
    pub pad: u16,
}

impl BackendVal {
    pub fn new(ip: IpAddr, port: u16) -> Self {
        BackendVal {
            addr: addr_words(ip),
            port: port_net(port),
            pad: 0,
        }
    }
    /// The endpoint's address, given its family.
    pub fn ip(&self, v4: bool) -> IpAddr {
        words_addr(self.addr, v4)
    }
    pub fn port(&self) -> u16 {
        net_port(self.port)
    }
}

/// "This endpoint is one of this Service port's now" (value: its slot).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemberKey {
    pub svc_id: u32,
    pub backend: BackendVal,
}

/// Maglev slots per map entry (`MAGLEV_CHUNK` in bpf/lib/maglev.h).
pub const MAGLEV_CHUNK: usize = 64;

/// One chunk of a Service's Maglev table: slots `chunk * MAGLEV_CHUNK ..`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MaglevKey {
    pub svc_id: u32,
    pub chunk: u32,
}

/// Each Maglev slot's endpoint, as its slot in `kp_backends` (key
/// `{svc_id, slot}`). Slots past the table's size (the last chunk's tail)
/// are 0 and never read.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MaglevVal {
    pub slot: [u32; MAGLEV_CHUNK],
}

// Arrays longer than 32 have no Default of their own.
impl Default for MaglevVal {
    fn default() -> Self {
        MaglevVal {
            slot: [0; MAGLEV_CHUNK],
        }
    }
}

// SAFETY: plain #[repr(C)] structs of integers whose padding is explicit
// fields (checked against the C sizes by the layout test), so every byte
// pattern is a valid value and none is uninitialised.
unsafe impl aya::Pod for SvcKey {}
unsafe impl aya::Pod for SvcVal {}
unsafe impl aya::Pod for BackendKey {}
unsafe impl aya::Pod for BackendVal {}
unsafe impl aya::Pod for MemberKey {}
unsafe impl aya::Pod for MaglevKey {}
unsafe impl aya::Pod for MaglevVal {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_the_c_structs() {
        // The C compiler's sizes (clang -target bpf): svc_key 20, svc_val 16,
        // backend_key 8, backend_val 20, member_key 24, maglev_key 8,
        // maglev_val 256 (maglev.rs checks the last two against bpf/lib/maglev.h
        // compiled). A mismatch would make every lookup miss.
        assert_eq!(std::mem::size_of::<SvcKey>(), 20);
        assert_eq!(std::mem::size_of::<SvcVal>(), 16);
        assert_eq!(std::mem::size_of::<BackendKey>(), 8);
        assert_eq!(std::mem::size_of::<BackendVal>(), 20);
        assert_eq!(std::mem::size_of::<MemberKey>(), 24);
        assert_eq!(std::mem::size_of::<MaglevKey>(), 8);
        assert_eq!(std::mem::size_of::<MaglevVal>(), 4 * MAGLEV_CHUNK);
        assert_eq!(std::mem::size_of::<MaglevVal>(), 256);
    }

    #[test]
    fn addresses_and_ports_are_in_network_order_in_memory() {
        let k = SvcKey::new("10.96.0.1".parse().unwrap(), 443, Protocol::Tcp);
        let bytes: Vec<u8> = k.addr[0].to_ne_bytes().to_vec();
        assert_eq!(bytes, vec![10, 96, 0, 1]);
        assert_eq!(k.port.to_ne_bytes(), [1, 187]);
        assert_eq!((k.family, k.proto), (4, 6));
        assert_eq!(k.ip(), "10.96.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(k.port(), 443);
        let v6: IpAddr = "fd00::1:2".parse().unwrap();
        let b = BackendVal::new(v6, 8080);
        assert_eq!(b.ip(false), v6);
        assert_eq!(b.port(), 8080);
    }
}
