//! The objects an operation acts on: the table, chains (regular or hooked
//! into netfilter), declared sets and maps, rules and elements.

use std::borrow::Cow;

use kp_model::{IpFamily, Protocol};

use super::elem::{ElemKey, ElemValue, MapName};
use super::expr::Rule;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChainType {
    Filter,
    Nat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

impl Hook {
    pub(super) fn kw(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }
}

/// A base chain's hook (policy accept: ours never drop by default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BaseChain {
    pub ty: ChainType,
    pub hook: Hook,
    pub priority: i32,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Chain {
    pub name: String,
    /// None for a regular chain.
    pub base: Option<BaseChain>,
}

impl Chain {
    pub fn regular(name: impl Into<String>) -> Chain {
        Chain {
            name: name.into(),
            base: None,
        }
    }
}

/// nft datatypes of the key of a declared (`type ...`) set or map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Ipv4,
    Ipv6,
    InetProto,
    InetService,
}

impl DType {
    pub fn addr(f: IpFamily) -> DType {
        match f {
            IpFamily::V4 => DType::Ipv4,
            IpFamily::V6 => DType::Ipv6,
        }
    }

    pub(super) fn kw(self) -> &'static str {
        match self {
            DType::Ipv4 => "ipv4_addr",
            DType::Ipv6 => "ipv6_addr",
            DType::InetProto => "inet_proto",
            DType::InetService => "inet_service",
        }
    }
}

/// How many elements a set that packets fill (`flags dynamic,timeout`) may
/// hold. The kernel's default is 65,535, sized for upstream's one set per
/// endpoint; ours is one set per affinity timeout shared by every Service, so
/// it holds a client per (client, Service) pair of the whole cluster. When
/// full, new clients are still served, only without a remembered endpoint.
pub const DYNAMIC_SET_SIZE: u32 = 1 << 20;

/// How a set or map is declared.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SetType {
    /// `type K . K [: verdict] ;`, with `timeout` in seconds also
    /// `flags dynamic,timeout ; timeout Ns ;` (the affinity sets).
    Typed {
        key: Vec<DType>,
        verdict_map: bool,
        timeout: Option<u32>,
    },
    /// `typeof numgen random mod 1 : VALUE ;` (the shared endpoint maps).
    Numgen(NumgenValue),
    /// `typeof ip saddr . numgen random mod 1 . numgen random mod 1 ;` with
    /// `flags dynamic,timeout ; timeout Ns ;`: the session-affinity records
    /// (client . selection id . index), filled by packets. Typed by `typeof`
    /// so that the rules' `numgen` constants (see
    /// [`Expr::AffinityHit`](super::Expr::AffinityHit)) match its key's type.
    Records { timeout: u32 },
    /// `typeof ip daddr . tcp dport . numgen random mod 1 : ip daddr . tcp
    /// dport ;`: a `select-PROTO-K-S` map (Service address, port and
    /// endpoint index -> the endpoint).
    Select(Protocol),
}

/// The value of a numgen-keyed map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NumgenValue {
    /// `ip daddr . tcp dport` (the family's address, this protocol's port).
    AddrPort(Protocol),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Set {
    pub name: String,
    pub ty: SetType,
}

impl Set {
    /// A map (`add map`), as opposed to a set.
    pub fn is_map(&self) -> bool {
        match &self.ty {
            SetType::Typed { verdict_map, .. } => *verdict_map,
            SetType::Numgen(_) | SetType::Select(_) => true,
            SetType::Records { .. } => false,
        }
    }

    pub(super) fn kw(&self) -> &'static str {
        if self.is_map() {
            "map"
        } else {
            "set"
        }
    }
}

/// What an operation acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Object {
    /// The transaction's table, with an optional comment.
    Table {
        comment: Option<Cow<'static, str>>,
    },
    Chain(Chain),
    /// A rule appended to `chain`.
    Rule {
        chain: String,
        rule: Rule,
    },
    Set(Set),
    /// Elements of one set or map (value None for a set's).
    Elements {
        set: MapName,
        elems: Vec<(ElemKey, Option<ElemValue>)>,
    },
}
