//! A typed [`Transaction`] as one nf_tables netlink batch: one message per
//! operation (plus an anonymous set and its elements before a rule that needs
//! one), between BATCH_BEGIN and BATCH_END.
//!
//! Encodings follow what nft 1.0.6 sends for the same objects (checked with
//! `nft --debug=netlink,mnl`), so that `nft list` shows our rules exactly as
//! if nft had added them; tests/netlink.rs compares the two in the kernel.

use kp_model::Protocol;
use kp_netlink::{Attrs, NLM_F_APPEND, NLM_F_CREATE, NLM_F_EXCL};
use thiserror::Error;

use super::expr::{self, addr_bytes, encode_rule, put_elem_value, Family};
use crate::types::{
    clean, AddrValue, ChainType, DType, ElemKey, Expr, Hook, NumgenValue, Object, Op, Set, SetType,
    Transaction, Verb,
};
use kp_netlink::nftables::{self, msg, udata, NftAttrs};

/// An operation the encoder cannot turn into netlink (the transaction is not
/// sent). `line` is the operation's 1-based line in the transaction's nft text.
#[derive(Debug, Error)]
#[error("line {line}: {why}: `{text}`")]
pub struct EncodeError {
    pub line: usize,
    pub text: String,
    pub why: String,
}

/// One encoded transaction: the batch, whose operations are 1-based lines of
/// the transaction's nft text, and the anonymous set ids it used.
pub struct Batch {
    pub inner: nftables::Batch,
    set_id: u32,
}

impl Batch {
    fn new(seq0: u32, capacity: usize) -> Batch {
        Batch {
            inner: nftables::Batch::new(seq0, capacity),
            set_id: 0,
        }
    }

    /// The second half of a batch encoded on another thread: sequence
    /// numbers after `seq0`, anonymous set ids from `set_id0`.
    fn continuation(seq0: u32, set_id0: u32, capacity: usize) -> Batch {
        Batch {
            inner: nftables::Batch::continuation(seq0, capacity),
            set_id: set_id0,
        }
    }

    fn push(&mut self, line: usize, fam: Family, ty: u16, flags: u16, attrs: &Attrs) {
        self.inner.push(line, fam.nfproto(), ty, flags, attrs);
    }

    fn finish(self) -> Batch {
        Batch {
            inner: self.inner.finish(),
            set_id: self.set_id,
        }
    }

    /// A fresh set id for this batch (anonymous sets are found by id).
    fn next_set_id(&mut self) -> u32 {
        self.set_id += 1;
        self.set_id
    }

    /// Messages in the batch, BEGIN and END excluded.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }
}

/// How many messages `tx` can need at most: the sequence numbers to reserve.
pub fn max_messages(tx: &Transaction) -> usize {
    ops_messages(&tx.ops)
}

fn ops_messages(ops: &[Op]) -> usize {
    ops.iter()
        .map(|op| match &op.object {
            // An anonymous set is two more messages.
            Object::Rule { rule, .. } => {
                1 + 2 * rule
                    .exprs
                    .iter()
                    .filter(|e| {
                        matches!(
                            e,
                            Expr::AddrMatch {
                                value: AddrValue::Set(_),
                                ..
                            }
                        )
                    })
                    .count()
            }
            _ => 1,
        })
        .sum()
}

/// Operations from which a transaction is encoded on two threads: a full
/// sync at 50k Services is ~300k operations and ~0.3 s of encoding on one.
const SPLIT_AT_OPS: usize = 20_000;

/// Encodes the whole transaction into one batch starting at sequence `seq0`.
pub fn encode(tx: &Transaction, seq0: u32) -> Result<Batch, EncodeError> {
    let fam = Family::from(tx.family);
    in_halves(
        seq0,
        &tx.ops[..],
        |ops: &mut &[Op], mid| {
            let (first, second) = ops.split_at(mid);
            *ops = first;
            second
        },
        |b, start, ops| {
            for (i, op) in ops.iter().enumerate() {
                let line = start + i + 1;
                encode_op(b, line, fam, &tx.table, op).map_err(|why| EncodeError {
                    line,
                    text: tx.op_text(line - 1),
                    why,
                })?;
            }
            Ok(())
        },
        |line| tx.op_text(line - 1),
    )
}

/// As [`encode`], consuming `tx`: each operation is dropped as soon as it
/// is encoded, so the typed transaction shrinks while the batch grows.
pub fn encode_owned(tx: Transaction, seq0: u32) -> Result<Batch, EncodeError> {
    let Transaction { family, table, ops } = tx;
    let fam = Family::from(family);
    in_halves(
        seq0,
        ops,
        |ops: &mut Vec<Op>, mid| {
            let second = ops.split_off(mid);
            ops.shrink_to_fit();
            second
        },
        |b, start, ops| {
            for (i, op) in ops.into_iter().enumerate() {
                let line = start + i + 1;
                encode_op(b, line, fam, &table, &op).map_err(|why| {
                    // The failing operation's text, from a transaction of
                    // its own.
                    let mut one = Transaction::new(family, table.as_str());
                    one.ops.push(op);
                    EncodeError {
                        line,
                        text: one.op_text(0),
                        why,
                    }
                })?;
            }
            Ok(())
        },
        |_| String::new(),
    )
}

/// Operations, borrowed or owned, that [`in_halves`] can split.
trait Ops: Send {
    fn ops(&self) -> &[Op];
}

impl Ops for &[Op] {
    fn ops(&self) -> &[Op] {
        self
    }
}

impl Ops for Vec<Op> {
    fn ops(&self) -> &[Op] {
        self
    }
}

/// Encodes `ops` with `encode(batch, first index, ops)`: at once, or, for a
/// large transaction on a machine with two cores, its two halves on two
/// threads (`split` keeps the first half in place and returns the second),
/// joined into one batch. `text` names a line if the second half panics.
fn in_halves<O: Ops>(
    seq0: u32,
    mut ops: O,
    split: impl FnOnce(&mut O, usize) -> O,
    encode: impl Fn(&mut Batch, usize, O) -> Result<(), EncodeError> + Sync,
    text: impl FnOnce(usize) -> String,
) -> Result<Batch, EncodeError> {
    let n = ops.ops().len();
    let two = n >= SPLIT_AT_OPS && std::thread::available_parallelism().is_ok_and(|c| c.get() > 1);
    if !two {
        let mut b = Batch::new(seq0, n * 128 + 64);
        encode(&mut b, 0, ops)?;
        return Ok(b.finish());
    }
    let mid = n / 2;
    let second = split(&mut ops, mid);
    // The second half numbers its messages after every number the first
    // can use, and its anonymous sets far above the first's ids.
    let seq1 = seq0.wrapping_add(ops_messages(ops.ops()) as u32);
    let encode = &encode;
    let (mut a, b) = kp_netlink::side_by_side(
        || {
            let mut a = Batch::new(seq0, mid * 128 + 64);
            encode(&mut a, 0, ops).map(|_| a)
        },
        move || {
            let mut b = Batch::continuation(seq1, 1 << 30, (n - mid) * 128);
            encode(&mut b, mid, second).map(|_| b)
        },
        // Encoding does not panic on any input (bad input is an error);
        // should it, say so rather than take the process down.
        || EncodeError {
            line: mid + 1,
            text: text(mid + 1),
            why: "the encoder panicked on this half of the transaction".into(),
        },
    )?;
    a.inner.append(b.inner);
    Ok(a.finish())
}

fn create_flags(verb: Verb) -> u16 {
    match verb {
        Verb::Create => NLM_F_CREATE | NLM_F_EXCL,
        _ => NLM_F_CREATE,
    }
}

fn encode_op(b: &mut Batch, line: usize, fam: Family, table: &str, op: &Op) -> Result<(), String> {
    let verb = op.verb;
    let mut a = Attrs::default();
    match (&op.object, verb) {
        (Object::Table { comment }, Verb::Add | Verb::Create) => {
            a.str(1, table).u32be(2, 0);
            if let Some(c) = comment {
                a.attr(6, &comment_udata(c)?);
            }
            b.push(line, fam, msg::NEWTABLE, create_flags(verb), &a);
        }
        (Object::Table { .. }, Verb::Delete) => {
            a.str(1, table);
            b.push(line, fam, msg::DELTABLE, 0, &a);
        }
        (Object::Table { .. }, Verb::Flush) => {
            // nft's `flush table`: delete every rule of the table (sets keep
            // their elements, chains stay).
            a.str(1, table);
            b.push(line, fam, msg::DELRULE, 0, &a);
        }
        (Object::Chain(c), Verb::Add | Verb::Create) => {
            a.str(1, table).str(3, &c.name);
            if let Some(base) = &c.base {
                let ty = match base.ty {
                    ChainType::Filter => "filter",
                    ChainType::Nat => "nat",
                };
                let hook = match base.hook {
                    Hook::Prerouting => 0u32,
                    Hook::Input => 1,
                    Hook::Forward => 2,
                    Hook::Output => 3,
                    Hook::Postrouting => 4,
                };
                // Policy accept (1).
                a.str(7, ty).u32be(5, 1);
                let h = a.begin_nest(4);
                a.u32be(1, hook).u32be(2, base.priority as u32);
                a.end_nest(h);
            }
            b.push(line, fam, msg::NEWCHAIN, create_flags(verb), &a);
        }
        (Object::Chain(c), Verb::Delete) => {
            a.str(1, table).str(3, &c.name);
            b.push(line, fam, msg::DELCHAIN, 0, &a);
        }
        (Object::Chain(c), Verb::Flush) => {
            a.str(1, table).str(2, &c.name);
            b.push(line, fam, msg::DELRULE, 0, &a);
        }
        (Object::Rule { chain, rule }, Verb::Add | Verb::Create) => {
            let enc = encode_rule(rule, fam, table, &mut || b.next_set_id())?;
            for anon in &enc.anon {
                b.push(line, fam, msg::NEWSET, NLM_F_CREATE, &anon.set);
                b.push(line, fam, msg::NEWSETELEM, NLM_F_CREATE, &anon.elems);
            }
            a.str(1, table).str(2, chain);
            let l = a.begin_nest(4);
            for e in &enc.exprs {
                a.extend(e);
            }
            a.end_nest(l);
            if let Some(text) = &rule.comment {
                a.attr(7, &comment_udata(text)?);
            }
            b.push(line, fam, msg::NEWRULE, NLM_F_CREATE | NLM_F_APPEND, &a);
        }
        (Object::Set(s), Verb::Add | Verb::Create) => {
            let id = b.next_set_id();
            let a = set_attrs(table, s, fam, id);
            b.push(line, fam, msg::NEWSET, create_flags(verb), &a);
        }
        (Object::Set(s), Verb::Delete) => {
            a.str(1, table).str(2, &s.name);
            b.push(line, fam, msg::DELSET, 0, &a);
        }
        (Object::Set(s), Verb::Flush) => {
            // DELSETELEM without elements empties the set.
            a.str(1, table).str(2, &s.name);
            b.push(line, fam, msg::DELSETELEM, 0, &a);
        }
        (Object::Elements { set, elems }, Verb::Add | Verb::Create | Verb::Delete) => {
            if elems.is_empty() {
                return Err("no elements".into());
            }
            a.str(1, table).str(2, &set.to_string());
            let list = a.begin_nest(3);
            for (key, value) in elems {
                let e = a.begin_nest(1);
                a.data_value(1, &key_bytes(key, fam)?);
                if let Some(v) = value {
                    let d = a.begin_nest(2);
                    put_elem_value(&mut a, v, fam)?;
                    a.end_nest(d);
                }
                a.end_nest(e);
            }
            a.end_nest(list);
            let (ty, flags) = match verb {
                Verb::Delete => (msg::DELSETELEM, 0),
                v => (msg::NEWSETELEM, create_flags(v)),
            };
            b.push(line, fam, ty, flags, &a);
        }
        (Object::Rule { .. }, _) => {
            return Err("rules can only be added (a chain is flushed instead)".into())
        }
        (Object::Elements { .. }, Verb::Flush) => {
            return Err("elements cannot be flushed (the set is)".into())
        }
    }
    Ok(())
}

pub(super) fn comment_udata(text: &str) -> Result<Vec<u8>, String> {
    // Type 0 = comment, NUL included, as nft writes it (at most 255 bytes).
    let text = clean(text);
    if text.len() >= 255 {
        return Err("comment longer than 254 bytes".into());
    }
    let mut v = text.as_bytes().to_vec();
    v.push(0);
    let mut out = Vec::new();
    udata(&mut out, 0, &v);
    Ok(out)
}

/// nft's datatype id and length in bytes.
fn dtype(t: DType) -> (u32, u32) {
    match t {
        DType::Ipv4 => (7, 4),
        DType::Ipv6 => (8, 16),
        DType::InetProto => (12, 1),
        DType::InetService => (13, 2),
    }
}

/// nft's protocol description of a port's header (numgen map userdata).
fn l4_desc(p: Protocol) -> u32 {
    match p {
        Protocol::Tcp => 8,
        Protocol::Udp => 6,
        Protocol::Sctp => 10,
    }
}

/// nft's set userdata for one `typeof` expression: (expression type, its
/// attributes).
fn typeof_expr(ty: u32, attrs: &[(u8, u32)]) -> Vec<u8> {
    let mut inner = Vec::new();
    for (t, v) in attrs {
        udata(&mut inner, *t, &v.to_ne_bytes());
    }
    let mut e = Vec::new();
    udata(&mut e, 0, &ty.to_ne_bytes());
    udata(&mut e, 1, &inner);
    e
}

/// `numgen random mod 1` (type, modulus, offset).
fn typeof_numgen() -> Vec<u8> {
    typeof_expr(23, &[(0, 1), (1, 1), (2, 0)])
}

/// A payload field: (protocol description, field index).
fn typeof_payload(desc: u32, field: u32) -> Vec<u8> {
    typeof_expr(7, &[(0, desc), (1, field)])
}

/// A concatenation of `typeof` expressions.
fn typeof_concat(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut list = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        udata(&mut list, i as u8, p);
    }
    let mut c = Vec::new();
    udata(&mut c, 0, &13u32.to_ne_bytes());
    udata(&mut c, 1, &list);
    c
}

/// The address field of `ip[6] saddr`/`daddr` in nft's payload
/// descriptions: (description, field).
fn addr_field(fam: Family, daddr: bool) -> (u32, u32) {
    match (fam, daddr) {
        (Family::V4, false) => (12, 11),
        (Family::V4, true) => (12, 12),
        (Family::V6, false) => (13, 8),
        (Family::V6, true) => (13, 9),
    }
}

/// The `typeof` parts of `ip daddr . tcp dport`: the endpoint maps' value,
/// and the select maps' key and value.
fn addr_port_typeof(proto: Protocol, fam: Family) -> Vec<Vec<u8>> {
    let (desc, daddr) = addr_field(fam, true);
    vec![
        typeof_payload(desc, daddr),
        typeof_payload(l4_desc(proto), 2), // dport
    ]
}

/// A map's value type `address . port` (NFTA_SET_DATA_TYPE and _LEN; the
/// port padded to a register word).
fn addr_port_data(a: &mut Attrs, fam: Family) {
    a.u32be(6, (fam.addr_type() << 6) | dtype(DType::InetService).0);
    a.u32be(7, fam.addr_len() as u32 + 4);
}

/// Set userdata nft 1.0.6 writes for `typeof numgen random mod 1 : VALUE`
/// (read off `nft --debug=mnl`): key byte order host, data byte order none,
/// the key's typeof (numgen random mod 1), the value's typeof, and a zero
/// attribute 6 nft always adds to maps.
fn numgen_map_udata(kind: NumgenValue, fam: Family) -> Vec<u8> {
    let mut ud = Vec::new();
    udata(&mut ud, 0, &1u32.to_ne_bytes());
    udata(&mut ud, 1, &0u32.to_ne_bytes());
    udata(&mut ud, 3, &typeof_numgen());
    let data = match kind {
        NumgenValue::AddrPort(proto) => typeof_concat(&addr_port_typeof(proto, fam)),
    };
    udata(&mut ud, 4, &data);
    udata(&mut ud, 6, &0u32.to_ne_bytes());
    ud
}

/// Set userdata nft 1.0.6 writes for `typeof ip daddr . tcp dport .
/// numgen random mod 1 : ip daddr . tcp dport` (read off `nft
/// --debug=mnl`): both byte orders none, the key's typeof, the value's,
/// and the zero attribute 6 of maps.
fn select_map_udata(proto: Protocol, fam: Family) -> Vec<u8> {
    let mut ud = Vec::new();
    udata(&mut ud, 0, &0u32.to_ne_bytes());
    udata(&mut ud, 1, &0u32.to_ne_bytes());
    let mut key = addr_port_typeof(proto, fam);
    key.push(typeof_numgen());
    udata(&mut ud, 3, &typeof_concat(&key));
    udata(&mut ud, 4, &typeof_concat(&addr_port_typeof(proto, fam)));
    udata(&mut ud, 6, &0u32.to_ne_bytes());
    ud
}

/// Set userdata nft 1.0.6 writes for the affinity records, `typeof ip
/// saddr . numgen random mod 1 . numgen random mod 1` (read off `nft
/// --debug=mnl`): key byte order none, then the key's typeof.
fn records_udata(fam: Family) -> Vec<u8> {
    let (desc, saddr) = addr_field(fam, false);
    let mut ud = Vec::new();
    udata(&mut ud, 0, &0u32.to_ne_bytes());
    let key = typeof_concat(&[
        typeof_payload(desc, saddr),
        typeof_numgen(),
        typeof_numgen(),
    ]);
    udata(&mut ud, 3, &key);
    ud
}

fn set_attrs(table: &str, s: &Set, fam: Family, id: u32) -> Attrs {
    let mut a = Attrs::default();
    let (key, verdict_map, timeout) = match &s.ty {
        SetType::Numgen(kind) => {
            // NFT_SET_MAP; key: a 32-bit integer (nft's TYPE_INTEGER, 4).
            a.str(1, table).str(2, &s.name).u32be(3, 0x8);
            a.u32be(4, 4).u32be(5, 4);
            match kind {
                NumgenValue::AddrPort(_) => addr_port_data(&mut a, fam),
            }
            a.u32be(10, id);
            a.attr(13, &numgen_map_udata(*kind, fam));
            return a;
        }
        SetType::Select(proto) => {
            // NFT_SET_MAP; key: address . port . a 32-bit integer (nft's
            // TYPE_INTEGER, 4), the port padded to a register word.
            a.str(1, table).str(2, &s.name).u32be(3, 0x8);
            let port = dtype(DType::InetService).0;
            a.u32be(4, (fam.addr_type() << 12) | (port << 6) | 4);
            a.u32be(5, fam.addr_len() as u32 + 8);
            addr_port_data(&mut a, fam);
            a.u32be(10, id);
            a.attr(13, &select_map_udata(*proto, fam));
            return a;
        }
        SetType::Records { timeout } => {
            // NFT_SET_TIMEOUT | NFT_SET_EVAL; key: the address, then two
            // 32-bit integers (nft's TYPE_INTEGER, 4).
            a.str(1, table).str(2, &s.name).u32be(3, 0x10 | 0x20);
            a.u32be(4, (fam.addr_type() << 12) | (4 << 6) | 4);
            a.u32be(5, fam.addr_len() as u32 + 8);
            a.u32be(10, id);
            // NFTA_SET_DESC { NFTA_SET_DESC_SIZE }: without it the kernel
            // caps a set that packets fill at 65,535 elements.
            a.nest(9, |d| {
                d.u32be(1, crate::types::DYNAMIC_SET_SIZE);
            });
            a.u64be(11, u64::from(*timeout) * 1000);
            a.attr(13, &records_udata(fam));
            return a;
        }
        SetType::Typed {
            key,
            verdict_map,
            timeout,
        } => (key, *verdict_map, *timeout),
    };
    let concat = key.len() > 1;
    let key_type = key.iter().fold(0u32, |acc, t| (acc << 6) | dtype(*t).0);
    let key_len: u32 = if concat {
        key.iter().map(|t| dtype(*t).1.div_ceil(4) * 4).sum()
    } else {
        key.first().map(|t| dtype(*t).1).unwrap_or(0)
    };
    let mut flags = 0u32;
    if verdict_map {
        flags |= 0x8; // NFT_SET_MAP
    }
    if timeout.is_some() {
        flags |= 0x10 | 0x20; // NFT_SET_TIMEOUT | NFT_SET_EVAL
    }
    a.str(1, table).str(2, &s.name).u32be(3, flags);
    a.u32be(4, key_type).u32be(5, key_len);
    if verdict_map {
        a.u32be(6, 0xffff_ff00).u32be(7, 0);
    }
    a.u32be(10, id);
    if let Some(secs) = timeout {
        // NFTA_SET_DESC { NFTA_SET_DESC_SIZE }: without it the kernel caps a
        // set that packets fill at 65,535 elements.
        a.nest(9, |d| {
            d.u32be(1, crate::types::DYNAMIC_SET_SIZE);
        });
        a.u64be(11, secs as u64 * 1000);
    }
    // nft's set userdata: key byte order (big endian for a lone address, none
    // for a concatenation), then for concatenations a `typeof` stub that nft
    // itself writes for declared types.
    let mut u = Vec::new();
    udata(&mut u, 0, &(if concat { 0u32 } else { 2u32 }).to_ne_bytes());
    if verdict_map {
        udata(&mut u, 1, &0u32.to_ne_bytes());
    }
    if concat {
        let mut nest = Vec::new();
        udata(&mut nest, 0, &13u32.to_ne_bytes());
        udata(&mut nest, 1, &[]);
        udata(&mut u, 3, &nest);
    }
    if verdict_map {
        udata(&mut u, 6, &0u32.to_ne_bytes());
    }
    a.attr(13, &u);
    a
}

/// An element key; each field of a concatenation padded to 4 bytes.
pub(super) fn key_bytes(k: &ElemKey, fam: Family) -> Result<Vec<u8>, String> {
    let pad = |v: &mut Vec<u8>| {
        while !v.len().is_multiple_of(4) {
            v.push(0);
        }
    };
    Ok(match k {
        ElemKey::IpProtoPort(ip, p, port) => {
            let mut v = addr_bytes(*ip, fam)?;
            v.extend_from_slice(&[expr::proto_number(*p), 0, 0, 0]);
            v.extend_from_slice(&port.to_be_bytes());
            pad(&mut v);
            v
        }
        ElemKey::ProtoPort(p, port) => {
            let mut v = vec![expr::proto_number(*p), 0, 0, 0];
            v.extend_from_slice(&port.to_be_bytes());
            pad(&mut v);
            v
        }
        ElemKey::Ip(ip) => addr_bytes(*ip, fam)?,
        ElemKey::IpPair(ip) => {
            let mut v = addr_bytes(*ip, fam)?;
            v.extend_from_slice(&addr_bytes(*ip, fam)?);
            v
        }
        // A slot of a numgen-keyed map: numgen writes host-endian integers.
        ElemKey::Slot(n) => n.to_ne_bytes().to_vec(),
        // Port padded to a register word; the index is a numgen value.
        ElemKey::Select { ip, port, index } => {
            let mut v = addr_bytes(*ip, fam)?;
            v.extend_from_slice(&port.to_be_bytes());
            pad(&mut v);
            v.extend_from_slice(&index.to_ne_bytes());
            v
        }
        // The id and index are numgen values: host-endian integers.
        ElemKey::Affinity { client, id, index } => {
            let mut v = addr_bytes(*client, fam)?;
            v.extend_from_slice(&id.to_ne_bytes());
            v.extend_from_slice(&index.to_ne_bytes());
            v
        }
    })
}

/// Reads an affinity record's key back (the layout [`key_bytes`] writes).
pub fn affinity_key(b: &[u8], fam: Family) -> Option<ElemKey> {
    let n = fam.addr_len();
    if b.len() != n + 8 {
        return None;
    }
    let client = match n {
        4 => std::net::IpAddr::from(<[u8; 4]>::try_from(&b[..n]).ok()?),
        _ => std::net::IpAddr::from(<[u8; 16]>::try_from(&b[..n]).ok()?),
    };
    let word = |i: usize| Some(u32::from_ne_bytes(b.get(i..i + 4)?.try_into().ok()?));
    Some(ElemKey::Affinity {
        client,
        id: word(n)?,
        index: word(n + 4)?,
    })
}
