//! What sets and maps hold: element keys and values, verdicts, and the
//! names of the table's sets and maps. Kept apart from the rule
//! expressions: the proxier keeps 300k+ of these at 50k Services, and their
//! sizes are watched (see the proxier's kept-state test).

use std::fmt::{self, Display, Formatter};
use std::net::{IpAddr, SocketAddr};

use kp_model::Protocol;

/// Where a rule or map element sends a packet. Chain names are boxed (16
/// bytes, no spare capacity): a verdict is in every kept map element.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Verdict {
    Goto(Box<str>),
    Jump(Box<str>),
    Drop,
    Return,
}

impl Display for Verdict {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Goto(c) => write!(f, "goto {c}"),
            Verdict::Jump(c) => write!(f, "jump {c}"),
            Verdict::Drop => f.write_str("drop"),
            Verdict::Return => f.write_str("return"),
        }
    }
}

/// Name of one of the table's sets or maps: a fixed one of the skeleton, or a
/// shard of the shared endpoint maps. 16 bytes (a fixed name is a thin
/// pointer to a `&'static str`, e.g. `&SET_HAIRPIN`): it is in every kept
/// element and claim, 300k+ of them at 50k Services.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MapName {
    Fixed(&'static &'static str),
    /// `endpoints-PROTO-N`: slot -> `address . port`, DNAT targets.
    Endpoints(Protocol, u32),
    /// `affinity-TIMEOUT`: the client records of every Service with that
    /// session-affinity timeout (`client . selection id . slot index`).
    Affinity(u32),
    /// `select-PROTO-K-S`: `address . port . index` -> `address . port`,
    /// the endpoints of the Services picked in the shared `pick-PROTO-N-S`
    /// chains; `K` groups endpoint counts by [`SELECT_COUNTS_PER_MAP`], `S`
    /// is the Services' shard ([`PickKey`]).
    Select(Protocol, u32, u16),
}

/// Endpoint counts (pick chains) one `select-PROTO-K-S` map serves: every
/// rule bound to a map is checked for every element added to it, so this
/// bounds an element's cost, as the endpoint-map shards do.
pub const SELECT_COUNTS_PER_MAP: u32 = 64;

/// Shards of the shared pick chains and select maps. The kernel dumps a
/// hashed set in pieces of 32 KiB and walks it from the start for each
/// piece, so reading a set back (a restart's adoption) costs the square
/// of its size: one select map for 100k Services of 10 endpoints took 35 s
/// to read. 256 shards keep a map at ~4k elements there.
pub const PICK_SHARDS: u32 = 256;

/// One shared pick chain: the Services of one protocol, endpoint count and
/// shard. The shard is a hash of the Service's address and port, so it
/// never depends on what was synced before.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PickKey {
    pub protocol: Protocol,
    pub count: u32,
    pub shard: u16,
}

impl PickKey {
    pub fn of(protocol: Protocol, count: u32, ip: IpAddr, port: u16) -> PickKey {
        // FNV-1a: stable across builds, so a restart finds the same shard.
        let mut h: u32 = 0x811c_9dc5;
        let mut eat = |bytes: &[u8]| {
            for b in bytes {
                h = (h ^ u32::from(*b)).wrapping_mul(0x0100_0193);
            }
        };
        match ip {
            IpAddr::V4(a) => eat(&a.octets()),
            IpAddr::V6(a) => eat(&a.octets()),
        }
        eat(&port.to_be_bytes());
        PickKey {
            protocol,
            count,
            shard: (h % PICK_SHARDS) as u16,
        }
    }

    /// `pick-PROTO-N-S`
    pub fn chain(&self) -> String {
        format!(
            "pick-{}-{}-{}",
            self.protocol.as_lower(),
            self.count,
            self.shard
        )
    }

    /// The select map its rule reads.
    pub fn map(&self) -> MapName {
        MapName::Select(
            self.protocol,
            self.count.saturating_sub(1) / SELECT_COUNTS_PER_MAP,
            self.shard,
        )
    }
}

impl Display for MapName {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            MapName::Fixed(n) => f.write_str(n),
            MapName::Endpoints(p, k) => write!(f, "endpoints-{}-{k}", p.as_lower()),
            MapName::Affinity(t) => write!(f, "affinity-{t}"),
            MapName::Select(p, k, s) => write!(f, "select-{}-{k}-{s}", p.as_lower()),
        }
    }
}

/// Key of a map or set element.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ElemKey {
    IpProtoPort(IpAddr, Protocol, u16),
    ProtoPort(Protocol, u16),
    Ip(IpAddr),
    /// `saddr . daddr` of the hairpin set: both the endpoint's IP.
    IpPair(IpAddr),
    /// A slot of the shared endpoint maps (a 32-bit integer, the numgen
    /// value; written in hex as nft lists it).
    Slot(u32),
    /// A client's record in an affinity set: `client . selection id .
    /// index` (the endpoint's place in its selection's slots).
    Affinity {
        client: IpAddr,
        id: u32,
        index: u32,
    },
    /// An endpoint of a Service picked in a shared chain: the Service's
    /// address and port, and the endpoint's index (a numgen value).
    Select {
        ip: IpAddr,
        port: u16,
        index: u32,
    },
}

impl Display for ElemKey {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            ElemKey::IpProtoPort(ip, p, port) => write!(f, "{ip} . {} . {port}", p.as_lower()),
            ElemKey::ProtoPort(p, port) => write!(f, "{} . {port}", p.as_lower()),
            ElemKey::Ip(ip) => write!(f, "{ip}"),
            ElemKey::IpPair(ip) => write!(f, "{ip} . {ip}"),
            ElemKey::Slot(n) => write!(f, "0x{n:x}"),
            ElemKey::Affinity { client, id, index } => write!(f, "{client} . {id} . {index}"),
            ElemKey::Select { ip, port, index } => write!(f, "{ip} . {port} . {index}"),
        }
    }
}

/// What a map element maps its key to. 32 bytes (24 if rustc put a
/// `DnatTarget` beside a verdict's tag; it does not).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ElemValue {
    Verdict(Verdict),
    /// DNAT target in the endpoint map.
    Endpoint(DnatTarget),
}

/// An endpoint's address and port: 20 bytes where a `SocketAddr` takes 32
/// (IPv6 flow info and scope). Ten of them per Service in the kept pools,
/// which hold targets only (an `ElemValue` is 32 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DnatTarget {
    pub ip: IpAddr,
    pub port: u16,
}

impl Display for DnatTarget {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "{} . {}", self.ip, self.port)
    }
}

impl From<SocketAddr> for DnatTarget {
    fn from(a: SocketAddr) -> Self {
        DnatTarget {
            ip: a.ip(),
            port: a.port(),
        }
    }
}

impl Display for ElemValue {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            ElemValue::Verdict(v) => write!(f, "{v}"),
            ElemValue::Endpoint(a) => write!(f, "{a}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restart finds each Service in the shard the previous build put it
    /// in only if the hash never changes: these are the shards the
    /// examples in docs/nftables.md show.
    #[test]
    fn pick_shards_are_pinned() {
        let shard = |ip: &str, port| PickKey::of(Protocol::Tcp, 3, ip.parse().unwrap(), port).shard;
        assert_eq!(shard("10.96.0.10", 80), 213);
        assert_eq!(shard("10.96.0.50", 80), 141);
        let k = PickKey::of(Protocol::Udp, 65, "fd00::a".parse().unwrap(), 53);
        assert!(u32::from(k.shard) < PICK_SHARDS);
        assert_eq!(k.map(), MapName::Select(Protocol::Udp, 1, k.shard));
        assert_eq!(k.chain(), format!("pick-udp-65-{}", k.shard));
    }
}
