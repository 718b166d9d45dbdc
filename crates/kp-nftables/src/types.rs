//! One nftables transaction as typed objects (after sigs.k8s.io/knftables'
//! types.go and transaction.go): what the renderer builds, what the netlink
//! backend encodes directly and what `nft -f` / --dry-run get as text through
//! [`Display`]. Nothing on the sync path writes nft syntax only to parse it
//! back.
//!
//! The vocabulary is the proxier's, not all of nftables: every statement here
//! is one the layout in docs/nftables.md uses, with the spelling `nft -f`
//! accepts and `nft list` prints back.

use std::borrow::Cow;
use std::fmt::{self, Display, Formatter, Write};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use kp_model::{IpFamily, Protocol};

/// `ip` or `ip6`: the table family, and the payload keyword of its addresses.
pub fn family_kw(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// A comment or interface name with anything that could break an nft script
/// removed, at most 120 characters. Both backends send this same text, so
/// that the two list identically. Names reaching here are validated DNS
/// labels; this is defence in depth.
pub fn clean(s: &str) -> Cow<'_, str> {
    let ok = |c: char| {
        (c.is_ascii_graphic() || c == ' ') && !matches!(c, '"' | '\\' | ';' | '#' | '{' | '}')
    };
    if s.len() <= 120 && s.chars().all(ok) {
        return Cow::Borrowed(s);
    }
    Cow::Owned(s.chars().filter(|c| ok(*c)).take(120).collect())
}

/// Quoted nft string of [`clean`]ed `s`.
pub fn quote(s: &str) -> String {
    format!("\"{}\"", clean(s))
}

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
}

impl Display for MapName {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            MapName::Fixed(n) => f.write_str(n),
            MapName::Endpoints(p, k) => write!(f, "endpoints-{}-{k}", p.as_lower()),
            MapName::Affinity(t) => write!(f, "affinity-{t}"),
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
/// chain it goes in is the operation's (see [`Object::Rule`]).
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
    fn kw(self) -> &'static str {
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

    fn kw(self) -> &'static str {
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
    /// so that the rules' `numgen` constants (see [`Expr::AffinityHit`])
    /// match its key's type.
    Records { timeout: u32 },
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
            SetType::Numgen(_) => true,
            SetType::Records { .. } => false,
        }
    }

    fn kw(&self) -> &'static str {
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

/// What to do with an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verb {
    /// Create, or leave as is when it exists (rules and elements: append).
    Add,
    /// Create; an error when it exists.
    Create,
    Delete,
    /// Empty it: a table or chain of its rules, a set or map of its elements.
    Flush,
}

impl Verb {
    fn kw(self) -> &'static str {
        match self {
            Verb::Add => "add",
            Verb::Create => "create",
            Verb::Delete => "delete",
            Verb::Flush => "flush",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    pub verb: Verb,
    pub object: Object,
}

/// One atomic change to one table: its operations in order. The kernel
/// applies all of them or none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transaction {
    pub family: IpFamily,
    pub table: String,
    pub ops: Vec<Op>,
}

impl Transaction {
    pub fn new(family: IpFamily, table: impl Into<String>) -> Transaction {
        Transaction {
            family,
            table: table.into(),
            ops: Vec::new(),
        }
    }

    pub fn push(&mut self, verb: Verb, object: Object) -> &mut Self {
        self.ops.push(Op { verb, object });
        self
    }

    pub fn add(&mut self, object: Object) -> &mut Self {
        self.push(Verb::Add, object)
    }

    pub fn create(&mut self, object: Object) -> &mut Self {
        self.push(Verb::Create, object)
    }

    pub fn delete(&mut self, object: Object) -> &mut Self {
        self.push(Verb::Delete, object)
    }

    pub fn flush(&mut self, object: Object) -> &mut Self {
        self.push(Verb::Flush, object)
    }

    /// `add rule` of `rule` to `chain`.
    pub fn add_rule(&mut self, chain: impl Into<String>, rule: Rule) -> &mut Self {
        self.add(Object::Rule {
            chain: chain.into(),
            rule,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Operation `i` as its line of nft text.
    pub fn op_text(&self, i: usize) -> String {
        match self.ops.get(i) {
            Some(op) => OpText(self, op).to_string(),
            None => String::new(),
        }
    }
}

struct OpText<'a>(&'a Transaction, &'a Op);

impl Display for OpText<'_> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let (tx, op) = (self.0, self.1);
        let fam = family_kw(tx.family);
        let t = &tx.table;
        let v = op.verb.kw();
        match &op.object {
            Object::Table { comment } => {
                write!(f, "{v} table {fam} {t}")?;
                if let (Some(c), Verb::Add | Verb::Create) = (comment, op.verb) {
                    write!(f, " {{ comment \"{}\" ; }}", clean(c))?;
                }
                Ok(())
            }
            Object::Chain(c) => {
                write!(f, "{v} chain {fam} {t} {}", c.name)?;
                if let (Some(b), Verb::Add | Verb::Create) = (&c.base, op.verb) {
                    let ty = match b.ty {
                        ChainType::Filter => "filter",
                        ChainType::Nat => "nat",
                    };
                    write!(
                        f,
                        " {{ type {ty} hook {} priority {} ; policy accept ; }}",
                        b.hook.kw(),
                        b.priority
                    )?;
                }
                Ok(())
            }
            Object::Rule { chain, rule } => {
                write!(f, "{v} rule {fam} {t} {chain} {}", rule.display(tx.family))
            }
            Object::Set(s) => {
                write!(f, "{v} {} {fam} {t} {}", s.kw(), s.name)?;
                if !matches!(op.verb, Verb::Add | Verb::Create) {
                    return Ok(());
                }
                match &s.ty {
                    SetType::Typed {
                        key,
                        verdict_map,
                        timeout,
                    } => {
                        f.write_str(" { type ")?;
                        for (i, k) in key.iter().enumerate() {
                            if i > 0 {
                                f.write_str(" . ")?;
                            }
                            f.write_str(k.kw())?;
                        }
                        if *verdict_map {
                            f.write_str(" : verdict")?;
                        }
                        f.write_str(" ;")?;
                        if let Some(secs) = timeout {
                            write!(
                                f,
                                " size {DYNAMIC_SET_SIZE} ; flags dynamic,timeout ; timeout {secs}s ;"
                            )?;
                        }
                        f.write_str(" }")
                    }
                    SetType::Numgen(v) => {
                        f.write_str(" { typeof numgen random mod 1 : ")?;
                        match v {
                            NumgenValue::AddrPort(p) => {
                                write!(f, "{fam} daddr . {} dport", p.as_lower())?
                            }
                        }
                        f.write_str(" ; }")
                    }
                    SetType::Records { timeout } => write!(
                        f,
                        " {{ typeof {fam} saddr . numgen random mod 1 . numgen random mod 1 ; \
                         size {DYNAMIC_SET_SIZE} ; flags dynamic,timeout ; timeout {timeout}s ; }}"
                    ),
                }
            }
            Object::Elements { set, elems } => {
                write!(f, "{v} element {fam} {t} {set} {{ ")?;
                for (i, (k, val)) in elems.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{k}")?;
                    if let Some(val) = val {
                        write!(f, " : {val}")?;
                    }
                }
                f.write_str(" }")
            }
        }
    }
}

/// The transaction as an nft script, one operation a line: what `nft -f`
/// applies and --dry-run prints.
impl Display for Transaction {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        for op in &self.ops {
            writeln!(f, "{}", OpText(self, op))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The proxier keeps 300k+ elements and claims at 50k Services: these
    /// sizes are what the kept state costs (docs/nftables.md, memory).
    #[test]
    fn kept_element_parts_stay_compact() {
        use std::mem::size_of;
        assert_eq!(size_of::<MapName>(), 16);
        assert_eq!(size_of::<ElemKey>(), 28);
        assert_eq!(size_of::<DnatTarget>(), 20);
        assert_eq!(size_of::<ElemValue>(), 32);
        assert_eq!(size_of::<Option<ElemValue>>(), 32);
        assert_eq!(size_of::<crate::render::Element>(), 80);
    }
}
