//! Rule bodies: the typed expressions of types/expr.rs as nf_tables
//! expressions, with nft's register layout (so that `nft list` prints them
//! back as the same statements).

use std::net::IpAddr;

use ipnet::IpNet;
use kp_model::{IpFamily, Protocol};
use kp_netlink::{Attrs, Nest};

use crate::types::{
    clean, Addr, AddrValue, CtState, DnatTarget, ElemValue, Expr, KeyField, MapName, MarkOp, Rule,
    Verdict,
};
use kp_netlink::nftables::expr::{bitwise, cmp, ex, meta_load, payload};
use kp_netlink::nftables::{udata, NftAttrs};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl From<IpFamily> for Family {
    fn from(f: IpFamily) -> Family {
        match f {
            IpFamily::V4 => Family::V4,
            IpFamily::V6 => Family::V6,
        }
    }
}

impl Family {
    pub fn nfproto(self) -> u8 {
        match self {
            Family::V4 => 2,
            Family::V6 => 10,
        }
    }
    pub fn addr_len(self) -> usize {
        match self {
            Family::V4 => 4,
            Family::V6 => 16,
        }
    }
    pub fn addr_type(self) -> u32 {
        match self {
            Family::V4 => 7,
            Family::V6 => 8,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Family::V4 => "ip",
            Family::V6 => "ip6",
        }
    }
}

pub fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

pub fn addr_bytes(ip: IpAddr, fam: Family) -> Result<Vec<u8>, String> {
    match (ip, fam) {
        (IpAddr::V4(a), Family::V4) => Ok(a.octets().to_vec()),
        (IpAddr::V6(a), Family::V6) => Ok(a.octets().to_vec()),
        _ => Err(format!(
            "address {ip} is not of the table's family ({})",
            fam.name()
        )),
    }
}

/// A DNAT target as a map value: address, port, padded to 4 bytes.
pub fn endpoint_bytes(a: DnatTarget, fam: Family) -> Result<Vec<u8>, String> {
    let mut v = addr_bytes(a.ip, fam)?;
    v.extend_from_slice(&a.port.to_be_bytes());
    v.extend_from_slice(&[0, 0]);
    Ok(v)
}

/// NFTA_DATA_VERDICT { code, chain } inside an already opened data nest.
pub fn put_verdict(a: &mut Attrs, v: &Verdict) {
    let n = a.begin_nest(2);
    let (code, chain): (i32, Option<&str>) = match v {
        Verdict::Drop => (0, None),
        Verdict::Return => (-5, None),
        Verdict::Jump(c) => (-3, Some(c)),
        Verdict::Goto(c) => (-4, Some(c)),
    };
    a.u32be(1, code as u32);
    if let Some(c) = chain {
        a.str(2, c);
    }
    a.end_nest(n);
}

/// A map element's value inside an already opened NFTA_SET_ELEM_DATA nest.
pub fn put_elem_value(a: &mut Attrs, v: &ElemValue, fam: Family) -> Result<(), String> {
    match v {
        ElemValue::Verdict(v) => put_verdict(a, v),
        ElemValue::Endpoint(ep) => {
            a.attr(1, &endpoint_bytes(*ep, fam)?);
        }
    }
    Ok(())
}

/// nft numbers registers in 32-bit words and sends the legacy 128-bit number
/// when a word starts one.
fn reg(word: usize) -> u32 {
    if word.is_multiple_of(4) {
        1 + (word / 4) as u32
    } else {
        8 + word as u32
    }
}

fn lookup(sreg: u32, dreg: Option<u32>, set: &str, id: Option<u32>, inv: bool) -> Attrs {
    ex("lookup", |a| {
        a.u32be(2, sreg);
        if let Some(d) = dreg {
            a.u32be(3, d);
        }
        a.str(1, set);
        if let Some(id) = id {
            a.u32be(4, id);
        }
        if inv {
            a.u32be(5, 1);
        }
    })
}

fn immediate_verdict(v: &Verdict) -> Attrs {
    ex("immediate", |a| {
        a.u32be(1, 0);
        let d = a.begin_nest(2);
        put_verdict(a, v);
        a.end_nest(d);
    })
}

fn immediate_data(dreg: u32, data: &[u8]) -> Attrs {
    ex("immediate", |a| {
        a.u32be(1, dreg).data_value(2, data);
    })
}

fn numgen(dreg: u32, modulus: u32, offset: u32) -> Attrs {
    ex("numgen", |a| {
        a.u32be(1, dreg)
            .u32be(2, modulus)
            .u32be(3, 1)
            .u32be(4, offset);
    })
}

fn nat(fam: Family, proto_reg: u32, flags: Option<u32>) -> Attrs {
    ex("nat", |a| {
        a.u32be(1, 1)
            .u32be(2, fam.nfproto() as u32)
            .u32be(3, 1)
            .u32be(5, proto_reg);
        if let Some(f) = flags {
            a.u32be(7, f);
        }
    })
}

fn addr_offset(fam: Family, which: Addr) -> u32 {
    match (fam, which) {
        (Family::V4, Addr::Saddr) => 12,
        (Family::V4, Addr::Daddr) => 16,
        (Family::V6, Addr::Saddr) => 8,
        (Family::V6, Addr::Daddr) => 24,
    }
}

impl KeyField {
    fn len(self, fam: Family) -> usize {
        match self {
            KeyField::Addr(_) => fam.addr_len(),
            KeyField::L4Proto => 1,
            KeyField::ThDport => 2,
        }
    }
    fn load(self, fam: Family, dreg: u32) -> Result<Attrs, String> {
        Ok(match self {
            KeyField::Addr(a) => payload(1, addr_offset(fam, a), fam.addr_len() as u32, dreg),
            KeyField::L4Proto => meta_load(16, dreg),
            KeyField::ThDport => payload(2, 2, 2, dreg),
        })
    }
}

/// DNAT to the endpoint `map` holds under the key from register 1 on (a
/// slot, or a select key): the map writes address and port from register
/// 1 on.
fn map_dnat(out: &mut Vec<Attrs>, fam: Family, map: MapName) {
    out.push(lookup(1, Some(1), &map.to_string(), None, false));
    out.push(nat(fam, reg(fam.addr_len() / 4), None));
}

/// `jhash ip saddr . th sport mod COUNT seed SEED offset OFFSET` into
/// `dreg`, its input loaded from register word `word` on.
fn client_hash(
    out: &mut Vec<Attrs>,
    fam: Family,
    word: usize,
    dreg: u32,
    count: u32,
    seed: u32,
    offset: u32,
) {
    let a = fam.addr_len() / 4;
    out.push(payload(
        1,
        addr_offset(fam, Addr::Saddr),
        fam.addr_len() as u32,
        reg(word),
    ));
    out.push(payload(2, 0, 2, reg(word + a)));
    let len = fam.addr_len() as u32 + 4;
    out.push(ex("hash", |h| {
        h.u32be(1, reg(word))
            .u32be(2, dreg)
            .u32be(3, len)
            .u32be(4, count)
            .u32be(5, seed)
            .u32be(6, offset)
            .u32be(7, 0); // NFT_HASH_JENKINS
    }));
}

/// `update @set { KEY }` from the packet path, the key from `sreg` on.
fn dynset_update(set: &str, sreg: u32) -> Attrs {
    ex("dynset", |a| {
        a.str(1, set).u32be(3, 1).u32be(4, sreg);
    })
}

/// Loads a (concatenated) key into consecutive registers starting at 1.
fn load_key(out: &mut Vec<Attrs>, fam: Family, key: &[KeyField]) -> Result<(), String> {
    if key.is_empty() {
        return Err("empty lookup key".into());
    }
    let mut word = 0usize;
    for k in key {
        out.push(k.load(fam, reg(word))?);
        word += k.len(fam).div_ceil(4);
    }
    if word > 16 {
        return Err(format!("key of {word} words does not fit the registers"));
    }
    Ok(())
}

/// An address or prefix as (bytes, prefix length).
fn net_bytes(n: &IpNet, fam: Family) -> Result<(Vec<u8>, usize), String> {
    let bytes = addr_bytes(n.addr(), fam)?;
    Ok((bytes, n.prefix_len() as usize))
}

fn mask_bytes(len: usize, plen: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let bits = plen.saturating_sub(i * 8).min(8);
            if bits == 0 {
                0
            } else {
                0xffu8 << (8 - bits)
            }
        })
        .collect()
}

/// An anonymous set a rule needs, sent before the rule.
pub struct AnonSet {
    pub set: Attrs,
    pub elems: Attrs,
}

/// One encoded rule body.
pub struct EncodedRule {
    pub exprs: Vec<Attrs>,
    pub anon: Vec<AnonSet>,
}

#[allow(clippy::too_many_arguments)] // the set's attributes, one each; a struct adds nothing
fn anon_set_head(
    table: &str,
    name: &str,
    flags: u32,
    key: (u32, u32),
    data: Option<(u32, u32)>,
    id: u32,
    size: u32,
    ud: &[u8],
) -> Attrs {
    let mut a = Attrs::default();
    a.str(1, table).str(2, name).u32be(3, flags);
    a.u32be(4, key.0).u32be(5, key.1);
    if let Some((t, l)) = data {
        a.u32be(6, t).u32be(7, l);
    }
    a.u32be(10, id);
    let d = a.begin_nest(9);
    a.u32be(1, size);
    a.end_nest(d);
    a.attr(13, ud);
    a
}

fn elems_head(table: &str, name: &str, id: u32) -> (Attrs, Nest) {
    let mut a = Attrs::default();
    a.str(1, table).str(2, name).u32be(4, id);
    let l = a.begin_nest(3);
    (a, l)
}

/// `{ 10.0.0.0/8, 192.168.0.0/16 }` as an anonymous interval set, encoded as
/// nft does: sorted, merged, each range a start element and an end element one
/// past its last address, and an end marker at zero when nothing starts there.
fn interval_set(nets: &[IpNet], fam: Family, table: &str, id: u32) -> Result<AnonSet, String> {
    let mut ranges: Vec<(u128, u128)> = Vec::new();
    let bits = fam.addr_len() * 8;
    for n in nets {
        let (bytes, plen) = net_bytes(n, fam)?;
        let mut v: u128 = 0;
        for b in &bytes {
            v = (v << 8) | *b as u128;
        }
        let host = if plen >= bits {
            0
        } else if bits - plen >= 128 {
            u128::MAX
        } else {
            (1u128 << (bits - plen)) - 1
        };
        let start = v & !host;
        ranges.push((start, start | host));
    }
    ranges.sort();
    let mut merged: Vec<(u128, u128)> = Vec::new();
    for (s, e) in ranges {
        match merged.last_mut() {
            Some(last) if s <= last.1.saturating_add(1) => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    let max: u128 = if bits == 128 {
        u128::MAX
    } else {
        (1u128 << bits) - 1
    };
    let to_bytes = |v: u128| -> Vec<u8> {
        let all = v.to_be_bytes();
        all[16 - fam.addr_len()..].to_vec()
    };
    let mut elems: Vec<(Vec<u8>, bool)> = Vec::new();
    if merged.first().is_some_and(|r| r.0 != 0) {
        elems.push((to_bytes(0), true));
    }
    for (s, e) in &merged {
        elems.push((to_bytes(*s), false));
        if *e < max {
            elems.push((to_bytes(e + 1), true));
        }
    }
    let (mut ea, l) = elems_head(table, "__set%d", id);
    for (k, end) in &elems {
        let e = ea.begin_nest(1);
        if *end {
            ea.u32be(3, 1); // NFT_SET_ELEM_INTERVAL_END
        }
        ea.data_value(1, k);
        ea.end_nest(e);
    }
    ea.end_nest(l);
    // Userdata as nft writes for `ip saddr { ... }`: big-endian key, merge
    // flag, and `typeof` naming the payload field.
    let (desc, field) = match fam {
        Family::V4 => (12u32, 11u32),
        Family::V6 => (13, 8),
    };
    let mut inner = Vec::new();
    udata(&mut inner, 0, &desc.to_ne_bytes());
    udata(&mut inner, 1, &field.to_ne_bytes());
    let mut nest = Vec::new();
    udata(&mut nest, 0, &7u32.to_ne_bytes());
    udata(&mut nest, 1, &inner);
    let mut ud = Vec::new();
    udata(&mut ud, 0, &2u32.to_ne_bytes());
    udata(&mut ud, 2, &1u32.to_ne_bytes());
    udata(&mut ud, 3, &nest);
    let set = anon_set_head(
        table,
        "__set%d",
        0x7,
        (fam.addr_type(), fam.addr_len() as u32),
        None,
        id,
        elems.len() as u32,
        &ud,
    );
    Ok(AnonSet { set, elems: ea })
}

/// An address compared with one address or prefix, as nft encodes it: the
/// whole address, the whole bytes of a byte-aligned prefix, or masked.
fn addr_cmp(out: &mut Vec<Attrs>, fam: Family, off: u32, neg: bool, bytes: &[u8], plen: usize) {
    let full = bytes.len() * 8;
    if plen >= full {
        out.push(payload(1, off, bytes.len() as u32, 1));
        out.push(cmp(1, neg, bytes));
    } else if plen.is_multiple_of(8) && plen > 0 {
        let n = plen / 8;
        out.push(payload(1, off, n as u32, 1));
        out.push(cmp(1, neg, &bytes[..n]));
    } else {
        // Also a /0 (`loadBalancerSourceRanges: [0.0.0.0/0]`): an all-zero
        // mask, as nft encodes it.
        let mask = mask_bytes(bytes.len(), plen);
        let masked: Vec<u8> = bytes.iter().zip(&mask).map(|(b, m)| b & m).collect();
        out.push(payload(1, off, fam.addr_len() as u32, 1));
        out.push(bitwise(1, &mask, &vec![0; bytes.len()]));
        out.push(cmp(1, neg, &masked));
    }
}

/// Encodes one rule body; `next_id` hands out the batch's anonymous set ids.
pub fn encode_rule(
    rule: &Rule,
    fam: Family,
    table: &str,
    next_id: &mut dyn FnMut() -> u32,
) -> Result<EncodedRule, String> {
    let mut r = EncodedRule {
        exprs: Vec::with_capacity(rule.exprs.len() * 2),
        anon: Vec::new(),
    };
    let out = &mut r.exprs;
    for e in &rule.exprs {
        match e {
            Expr::Ct(state) => {
                let bits: u32 = match state {
                    CtState::Invalid => 1,
                    CtState::New => 8,
                };
                out.push(ex("ct", |a| {
                    a.u32be(2, 0).u32be(1, 1);
                }));
                out.push(bitwise(1, &bits.to_ne_bytes(), &[0; 4]));
                out.push(cmp(1, true, &[0; 4]));
            }
            Expr::AddrMatch { field, neg, value } => {
                let off = addr_offset(fam, *field);
                match value {
                    AddrValue::Ip(ip) => {
                        let b = addr_bytes(*ip, fam)?;
                        let plen = b.len() * 8;
                        addr_cmp(out, fam, off, *neg, &b, plen);
                    }
                    // nft turns a one-element anonymous set into a plain match.
                    AddrValue::Net(n) => {
                        let (b, plen) = net_bytes(n, fam)?;
                        addr_cmp(out, fam, off, *neg, &b, plen);
                    }
                    AddrValue::Set(nets) if nets.len() == 1 => {
                        let (b, plen) = net_bytes(&nets[0], fam)?;
                        addr_cmp(out, fam, off, *neg, &b, plen);
                    }
                    AddrValue::Set(nets) => {
                        if nets.is_empty() {
                            return Err("empty address set".into());
                        }
                        let id = next_id();
                        r.anon.push(interval_set(nets, fam, table, id)?);
                        out.push(payload(1, off, fam.addr_len() as u32, 1));
                        out.push(lookup(1, None, "__set%d", Some(id), *neg));
                    }
                }
            }
            Expr::L4Proto(p) => {
                out.push(meta_load(16, 1));
                out.push(cmp(1, false, &[proto_number(*p)]));
            }
            Expr::Iifname {
                neg,
                name,
                wildcard,
            } => {
                let name = clean(name);
                let data = if *wildcard {
                    name.as_bytes().to_vec()
                } else {
                    if name.len() >= 16 {
                        return Err(format!("interface name `{name}` too long"));
                    }
                    let mut v = name.as_bytes().to_vec();
                    v.resize(16, 0);
                    v
                };
                if name.is_empty() {
                    return Err("empty interface name".into());
                }
                if data.len() > 16 {
                    return Err(format!("interface name `{name}` too long"));
                }
                out.push(meta_load(6, 1));
                out.push(cmp(1, *neg, &data));
            }
            Expr::FibLocal(a) => {
                let flags = match a {
                    Addr::Saddr => 1u32,
                    Addr::Daddr => 2,
                };
                out.push(ex("fib", |a| {
                    a.u32be(1, 1).u32be(2, 3).u32be(3, flags);
                }));
                out.push(cmp(1, false, &2u32.to_ne_bytes()));
            }
            Expr::Lookup { key, set } => {
                load_key(out, fam, key)?;
                out.push(lookup(1, None, set, None, false));
            }
            Expr::Vmap { key, map } => {
                load_key(out, fam, key)?;
                out.push(lookup(1, Some(0), map, None, false));
            }
            Expr::MarkMatch { mask, neg, value } => {
                out.push(meta_load(3, 1));
                out.push(bitwise(1, &mask.to_ne_bytes(), &[0; 4]));
                out.push(cmp(1, *neg, &value.to_ne_bytes()));
            }
            Expr::MarkSet(op, v) => {
                let (mask, xor) = match op {
                    MarkOp::Or => (!v, *v),
                    MarkOp::Xor => (u32::MAX, *v),
                };
                out.push(meta_load(3, 1));
                out.push(bitwise(1, &mask.to_ne_bytes(), &xor.to_ne_bytes()));
                out.push(ex("meta", |a| {
                    a.u32be(2, 3).u32be(3, 1);
                }));
            }
            // The record's key, `client . id . index`, is loaded from word
            // 0 on: the address, then the id and the index from `numgen
            // random mod 1 offset N` (N, host-endian), as nft encodes the
            // rule's text. The update reuses the lookup's key registers
            // (nft reloads them; it lists both alike). A lookup's result
            // only feeds the nat: nft 1.0.6 cannot list a rule where one
            // feeds another lookup or a set update (it aborts).
            Expr::AffinityHit {
                records,
                id,
                index,
                slots,
            } => {
                let a = fam.addr_len() / 4;
                let records = records.to_string();
                out.push(KeyField::Addr(Addr::Saddr).load(fam, 1)?);
                out.push(numgen(reg(a), 1, *id));
                out.push(numgen(reg(a + 1), 1, *index));
                out.push(lookup(1, None, &records, None, false));
                out.push(dynset_update(&records, 1));
                let slot = slots
                    .offset
                    .checked_add(*index)
                    .ok_or("slot out of range")?;
                out.push(numgen(1, 1, slot));
                map_dnat(out, fam, slots.map);
            }
            // nft's layout for the rule's text: the key at word 0 with the
            // index hashed into its last word from a copy of `saddr .
            // sport` just behind it.
            Expr::AffinityRecord { records, id, count } => {
                if *count == 0 {
                    return Err("jhash modulus 0".into());
                }
                let a = fam.addr_len() / 4;
                out.push(KeyField::Addr(Addr::Saddr).load(fam, 1)?);
                out.push(numgen(reg(a), 1, *id));
                client_hash(out, fam, a + 2, reg(a + 1), *count, *id, 0);
                out.push(dynset_update(&records.to_string(), 1));
            }
            // nft's layout: the hash's input from register 2 on.
            Expr::HashDnat { seed, count, slots } => {
                if *count == 0 {
                    return Err("jhash modulus 0".into());
                }
                client_hash(out, fam, 4, 1, *count, *seed, slots.offset);
                map_dnat(out, fam, slots.map);
            }
            // nft's layout: address, port and index from register 1 on,
            // the endpoint written back from register 1.
            Expr::PickDnat { count, map, .. } => {
                if *count == 0 {
                    return Err("numgen modulus 0".into());
                }
                let a = fam.addr_len() / 4;
                out.push(KeyField::Addr(Addr::Daddr).load(fam, 1)?);
                out.push(KeyField::ThDport.load(fam, reg(a))?);
                out.push(numgen(reg(a + 1), *count, 0));
                map_dnat(out, fam, *map);
            }
            Expr::NumgenDnat { count, slots } => {
                if *count == 0 {
                    return Err("numgen modulus 0".into());
                }
                out.push(numgen(1, *count, slots.offset));
                map_dnat(out, fam, slots.map);
            }
            Expr::Dnat(to) => {
                out.push(immediate_data(1, &addr_bytes(to.ip(), fam)?));
                out.push(immediate_data(2, &to.port().to_be_bytes()));
                // NF_NAT_RANGE_PROTO_SPECIFIED, as nft sets for an explicit port.
                out.push(nat(fam, 2, Some(2)));
            }
            Expr::Masquerade { fully_random } => {
                let random = *fully_random;
                out.push(ex("masq", |a| {
                    if random {
                        a.u32be(1, 0x10);
                    }
                }));
            }
            Expr::Reject => {
                let code = match fam {
                    Family::V4 => 3u8, // ICMP port unreachable
                    Family::V6 => 4,   // ICMPv6 port unreachable
                };
                out.push(ex("reject", |a| {
                    a.u32be(1, 0).u8(2, code);
                }));
            }
            Expr::Verdict(v) => out.push(immediate_verdict(v)),
        }
    }
    if r.exprs.is_empty() {
        return Err("empty rule".into());
    }
    Ok(r)
}
