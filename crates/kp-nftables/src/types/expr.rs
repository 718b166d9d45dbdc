//! A rule's matches and statements ([`Expr`]) and the rule ([`Rule`]), with
//! the nft text each is written as: the vocabulary of the layout in
//! docs/nftables.md, no more.

use std::borrow::Cow;
use std::fmt::{self, Display, Formatter, Write};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use kp_model::{IpFamily, Protocol};

use super::elem::{MapName, Verdict};
use super::text::{clean, family_kw};

/// `saddr` or `daddr` of the table family's network header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Addr {
    Saddr,
    Daddr,
}

impl Addr {
    fn kw(self) -> &'static str {
        match self {
            Addr::Saddr => "saddr",
            Addr::Daddr => "daddr",
        }
    }
}

/// One field of a (possibly concatenated) set or map key in a rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyField {
    /// `ip saddr`, `ip6 daddr`, ...
    Addr(Addr),
    /// `meta l4proto`
    L4Proto,
    /// `th dport`
    ThDport,
}

/// What an address is compared with.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AddrValue {
    Ip(IpAddr),
    Net(IpNet),
    /// An anonymous interval set `{ a, b }` (nft sends one element as a plain
    /// match).
    Set(Vec<IpNet>),
}

/// `meta mark set meta mark OP VALUE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MarkOp {
    Or,
    Xor,
}

/// Conntrack states (`ct state ...`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CtState {
    New,
    Invalid,
}

/// Where a numgen rule's slots are: `offset` into `map`. `pool` is the
/// renderer's index into the Service's pools (see render.rs), never sent: the
/// proxier fills `map` and `offset` once it has placed the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slots {
    pub pool: usize,
    pub map: MapName,
    pub offset: u32,
}

/// One match or statement of a rule.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Expr {
    /// `ct state new`
    Ct(CtState),
    /// `ip saddr [!=] VALUE`
    AddrMatch {
        field: Addr,
        neg: bool,
        value: AddrValue,
    },
    /// `meta l4proto tcp`
    L4Proto(Protocol),
    /// `iifname [!=] "name"`, or `"name*"` with `wildcard` (a prefix match).
    Iifname {
        neg: bool,
        name: String,
        wildcard: bool,
    },
    /// `fib saddr type local`
    FibLocal(Addr),
    /// `KEY . KEY @set`
    Lookup {
        key: Vec<KeyField>,
        set: String,
    },
    /// `KEY . KEY vmap @map` (terminal).
    Vmap {
        key: Vec<KeyField>,
        map: String,
    },
    /// `meta mark and MASK ==|!= VALUE`
    MarkMatch {
        mask: u32,
        neg: bool,
        value: u32,
    },
    /// `meta mark set meta mark or|xor VALUE`
    MarkSet(MarkOp, u32),
    /// Session affinity, a client seen before: a record `ip saddr . ID .
    /// INDEX` in `records` restarts its timeout and sends the packet to the
    /// endpoint in slot `slots.offset + INDEX` (`ID`: the selection's). One
    /// such rule per slot: they name slots, not endpoints, so replacing an
    /// endpoint changes elements only.
    AffinityHit {
        records: MapName,
        id: u32,
        index: u32,
        slots: Slots,
    },
    /// Session affinity, a new client: its index below `count` (a hash of
    /// its address and source port, seeded with `id`) recorded. No verdict:
    /// the [`Expr::HashDnat`] rule that follows sends it to that index's
    /// slot, also when the set is full and the record could not be made.
    AffinityRecord {
        records: MapName,
        id: u32,
        count: u32,
    },
    /// `dnat ip addr . port to jhash ip saddr . th sport mod N seed S
    /// offset O map @map`: the slot of [`Expr::AffinityRecord`]'s index.
    HashDnat {
        seed: u32,
        count: u32,
        slots: Slots,
    },
    /// `dnat ip addr . port to ip daddr . tcp dport . numgen random mod N
    /// map @select-tcp-K-S`: the shared selection of the Services with N
    /// endpoints in shard S, keyed by the address and port the packet asked for (a
    /// `pick-PROTO-N-S` chain; the rule's `meta l4proto` comes before it).
    PickDnat {
        protocol: Protocol,
        count: u32,
        map: MapName,
    },
    /// `dnat ip addr . port to numgen random mod N offset O map @map`
    NumgenDnat {
        count: u32,
        slots: Slots,
    },
    /// `dnat ip to ADDR:PORT`
    Dnat(SocketAddr),
    /// `masquerade [fully-random]`
    Masquerade {
        fully_random: bool,
    },
    /// `reject` (ICMP port unreachable)
    Reject,
    Verdict(Verdict),
}

impl Expr {
    /// A name per kind of expression, for tests that check coverage.
    pub fn kind(&self) -> &'static str {
        match self {
            Expr::Ct(_) => "ct",
            Expr::AddrMatch { value, .. } => match value {
                AddrValue::Ip(_) => "addr",
                AddrValue::Net(_) => "prefix",
                AddrValue::Set(s) if s.len() == 1 => "set-of-one",
                AddrValue::Set(_) => "interval-set",
            },
            Expr::L4Proto(_) => "l4proto",
            Expr::Iifname {
                wildcard: false, ..
            } => "iifname",
            Expr::Iifname { wildcard: true, .. } => "iifname-wildcard",
            Expr::FibLocal(_) => "fib",
            Expr::Lookup { .. } => "lookup",
            Expr::Vmap { .. } => "vmap",
            Expr::MarkMatch { .. } => "mark-match",
            Expr::MarkSet(..) => "mark-set",
            Expr::AffinityHit { .. } => "affinity-hit",
            Expr::AffinityRecord { .. } => "affinity-record",
            Expr::HashDnat { .. } => "hash-dnat",
            Expr::NumgenDnat { .. } => "numgen-dnat",
            Expr::PickDnat { .. } => "pick-dnat",
            Expr::Dnat(_) => "dnat",
            Expr::Masquerade { .. } => "masquerade",
            Expr::Reject => "reject",
            Expr::Verdict(_) => "verdict",
        }
    }

    fn write(&self, fam: IpFamily, f: &mut Formatter<'_>) -> fmt::Result {
        let ip = family_kw(fam);
        let not = |neg: bool| if neg { "!= " } else { "" };
        match self {
            Expr::Ct(CtState::New) => f.write_str("ct state new"),
            Expr::Ct(CtState::Invalid) => f.write_str("ct state invalid"),
            Expr::AddrMatch { field, neg, value } => {
                write!(f, "{ip} {} {}", field.kw(), not(*neg))?;
                match value {
                    AddrValue::Ip(a) => write!(f, "{a}"),
                    AddrValue::Net(n) => write!(f, "{n}"),
                    AddrValue::Set(s) => {
                        f.write_str("{ ")?;
                        for (i, n) in s.iter().enumerate() {
                            if i > 0 {
                                f.write_str(", ")?;
                            }
                            write!(f, "{n}")?;
                        }
                        f.write_str(" }")
                    }
                }
            }
            Expr::L4Proto(p) => write!(f, "meta l4proto {}", p.as_lower()),
            Expr::Iifname {
                neg,
                name,
                wildcard,
            } => {
                let star = if *wildcard { "*" } else { "" };
                write!(f, "iifname {}\"{}{star}\"", not(*neg), clean(name))
            }
            Expr::FibLocal(a) => write!(f, "fib {} type local", a.kw()),
            Expr::Lookup { key, set } => {
                write_key(f, fam, key)?;
                write!(f, " @{set}")
            }
            Expr::Vmap { key, map } => {
                write_key(f, fam, key)?;
                write!(f, " vmap @{map}")
            }
            Expr::MarkMatch { mask, neg, value } => {
                let op = if *neg { "!=" } else { "==" };
                write!(f, "meta mark and 0x{mask:x} {op} {value}")
            }
            Expr::MarkSet(op, v) => {
                let op = match op {
                    MarkOp::Or => "or",
                    MarkOp::Xor => "xor",
                };
                write!(f, "meta mark set meta mark {op} 0x{v:x}")
            }
            // Constants in a lookup key or a map's key are written as
            // `numgen random mod 1 offset N` (always N), the one typed form
            // of a number nft 1.0.6 both lists and parses back there.
            Expr::AffinityHit {
                records,
                id,
                index,
                slots,
            } => {
                let (id, index) = (Const(*id), Const(*index));
                write!(
                    f,
                    "{ip} saddr . {id} . {index} @{records} \
                     update @{records} {{ {ip} saddr . {id} . {index} }} \
                     dnat {ip} addr . port to {} map @{}",
                    Const(slots.offset.saturating_add(index.0)),
                    slots.map
                )
            }
            // The index is a hash of the client's address and port: the
            // record and the DNAT compute it alike, and a new connection's
            // source port makes the first choice as spread as upstream's
            // random one; its seed, the selection's id, keeps Services apart.
            Expr::AffinityRecord { records, id, count } => write!(
                f,
                "update @{records} {{ {ip} saddr . {} . jhash {ip} saddr . th sport mod {count} seed 0x{id:x} }}",
                Const(*id),
            ),
            Expr::HashDnat { seed, count, slots } => write!(
                f,
                "dnat {ip} addr . port to jhash {ip} saddr . th sport mod {count} seed 0x{seed:x} offset {} map @{}",
                slots.offset, slots.map
            ),
            Expr::PickDnat {
                protocol,
                count,
                map,
            } => write!(
                f,
                "dnat {ip} addr . port to {ip} daddr . {} dport . numgen random mod {count} map @{map}",
                protocol.as_lower()
            ),
            Expr::NumgenDnat { count, slots } => write!(
                f,
                "dnat {ip} addr . port to numgen random mod {count} offset {} map @{}",
                slots.offset, slots.map
            ),
            Expr::Dnat(a) => match a {
                SocketAddr::V4(v) => write!(f, "dnat {ip} to {}:{}", v.ip(), v.port()),
                SocketAddr::V6(v) => write!(f, "dnat {ip} to [{}]:{}", v.ip(), v.port()),
            },
            Expr::Masquerade { fully_random } => f.write_str(if *fully_random {
                "masquerade fully-random"
            } else {
                "masquerade"
            }),
            Expr::Reject => f.write_str("reject"),
            Expr::Verdict(v) => write!(f, "{v}"),
        }
    }
}

/// A 32-bit constant where nft wants an expression (a lookup key or a map
/// key): `numgen random mod 1 offset N`, whose value is always N.
struct Const(u32);

impl Display for Const {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "numgen random mod 1 offset {}", self.0)
    }
}

fn write_key(f: &mut Formatter<'_>, fam: IpFamily, key: &[KeyField]) -> fmt::Result {
    for (i, k) in key.iter().enumerate() {
        if i > 0 {
            f.write_str(" . ")?;
        }
        match k {
            KeyField::Addr(a) => write!(f, "{} {}", family_kw(fam), a.kw())?,
            KeyField::L4Proto => f.write_str("meta l4proto")?,
            KeyField::ThDport => f.write_str("th dport")?,
        }
    }
    Ok(())
}

/// A rule's body: its expressions in order and an optional comment. The
/// chain it goes in is the operation's (see [`Object::Rule`](super::Object::Rule)).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    pub exprs: Vec<Expr>,
    pub comment: Option<Cow<'static, str>>,
}

impl Rule {
    pub fn new(exprs: Vec<Expr>) -> Rule {
        Rule {
            exprs,
            comment: None,
        }
    }

    pub fn comment(mut self, c: impl Into<Cow<'static, str>>) -> Rule {
        self.comment = Some(c.into());
        self
    }

    /// The rule body as nft writes it (what follows `add rule FAMILY TABLE CHAIN `).
    pub fn display(&self, family: IpFamily) -> impl Display + '_ {
        RuleText(self, family)
    }
}

struct RuleText<'a>(&'a Rule, IpFamily);

impl Display for RuleText<'_> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.exprs.iter().enumerate() {
            if i > 0 {
                f.write_char(' ')?;
            }
            e.write(self.1, f)?;
        }
        if let Some(c) = &self.0.comment {
            write!(f, " comment \"{}\"", clean(c))?;
        }
        Ok(())
    }
}
