//! Rule bodies: the statement shapes of rule.rs and render.rs, as nf_tables
//! expressions with nft's register layout.

use std::net::IpAddr;

use kp_netlink::{Attrs, Nest};

use super::nla::{udata, NftAttrs};
use super::script::{AnonSet, Cur, Tok};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn nfproto(self) -> u8 {
        match self {
            Family::V4 => 2,
            Family::V6 => 10,
        }
    }
    fn kw(self) -> &'static str {
        match self {
            Family::V4 => "ip",
            Family::V6 => "ip6",
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
}

pub fn proto_number(w: &str) -> Option<u8> {
    match w {
        "tcp" => Some(6),
        "udp" => Some(17),
        "sctp" => Some(132),
        _ => None,
    }
}

pub fn addr_bytes(ip: IpAddr, fam: Family) -> Result<Vec<u8>, String> {
    match (ip, fam) {
        (IpAddr::V4(a), Family::V4) => Ok(a.octets().to_vec()),
        (IpAddr::V6(a), Family::V6) => Ok(a.octets().to_vec()),
        _ => Err(format!("address {ip} is not of the table's family")),
    }
}

pub enum Verdict {
    Accept,
    Drop,
    Return,
    Jump(String),
    Goto(String),
}

pub fn parse_verdict(c: &mut Cur) -> Result<Verdict, String> {
    match c.word("a verdict")? {
        "accept" => Ok(Verdict::Accept),
        "drop" => Ok(Verdict::Drop),
        "return" => Ok(Verdict::Return),
        "jump" => Ok(Verdict::Jump(c.word("a chain")?.to_string())),
        "goto" => Ok(Verdict::Goto(c.word("a chain")?.to_string())),
        v => Err(format!("verdict `{v}` not supported")),
    }
}

/// NFTA_DATA_VERDICT { code, chain } inside an already opened data nest.
pub fn put_verdict(a: &mut Attrs, v: &Verdict) {
    let n = a.begin_nest(2);
    let (code, chain): (i32, Option<&str>) = match v {
        Verdict::Accept => (1, None),
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

/// nft numbers registers in 32-bit words and sends the legacy 128-bit number
/// when a word starts one.
fn reg(word: usize) -> u32 {
    if word.is_multiple_of(4) {
        1 + (word / 4) as u32
    } else {
        8 + word as u32
    }
}

fn ex(name: &str, f: impl FnOnce(&mut Attrs)) -> Attrs {
    let mut a = Attrs::default();
    let e = a.begin_nest(1);
    a.str(1, name);
    let d = a.begin_nest(2);
    f(&mut a);
    a.end_nest(d);
    a.end_nest(e);
    a
}

fn payload(base: u32, offset: u32, len: u32, dreg: u32) -> Attrs {
    ex("payload", |a| {
        a.u32be(1, dreg)
            .u32be(2, base)
            .u32be(3, offset)
            .u32be(4, len);
    })
}

fn meta_load(key: u32, dreg: u32) -> Attrs {
    ex("meta", |a| {
        a.u32be(2, key).u32be(1, dreg);
    })
}

fn cmp(sreg: u32, neq: bool, data: &[u8]) -> Attrs {
    ex("cmp", |a| {
        a.u32be(1, sreg).u32be(2, neq as u32).data_value(3, data);
    })
}

fn bitwise(reg: u32, mask: &[u8], xor: &[u8]) -> Attrs {
    ex("bitwise", |a| {
        a.u32be(1, reg).u32be(2, reg).u32be(3, mask.len() as u32);
        a.data_value(4, mask).data_value(5, xor);
    })
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

fn numgen(modulus: u32, offset: u32) -> Attrs {
    ex("numgen", |a| {
        a.u32be(1, 1).u32be(2, modulus).u32be(3, 1).u32be(4, offset);
    })
}

fn addr_offset(fam: Family, which: &str) -> Result<u32, String> {
    match (fam, which) {
        (Family::V4, "saddr") => Ok(12),
        (Family::V4, "daddr") => Ok(16),
        (Family::V6, "saddr") => Ok(8),
        (Family::V6, "daddr") => Ok(24),
        (_, w) => Err(format!("`{w}` not supported (saddr, daddr)")),
    }
}

/// One field of a match or key.
#[derive(Clone, Copy)]
enum Sel {
    Addr(u32),
    L4Proto,
    Dport,
}

impl Sel {
    fn len(self, fam: Family) -> usize {
        match self {
            Sel::Addr(_) => fam.addr_len(),
            Sel::L4Proto => 1,
            Sel::Dport => 2,
        }
    }
    fn load(self, fam: Family, dreg: u32) -> Attrs {
        match self {
            Sel::Addr(off) => payload(1, off, fam.addr_len() as u32, dreg),
            Sel::L4Proto => meta_load(16, dreg),
            Sel::Dport => payload(2, 2, 2, dreg),
        }
    }
}

fn parse_sel(c: &mut Cur, fam: Family) -> Result<Sel, String> {
    let w = c.word("a selector")?;
    match w {
        "ip" | "ip6" => {
            if w != fam.kw() {
                return Err(format!("`{w}` in a table of family {}", fam.kw()));
            }
            Ok(Sel::Addr(addr_offset(fam, c.word("saddr or daddr")?)?))
        }
        "meta" => {
            c.expect_word("l4proto")?;
            Ok(Sel::L4Proto)
        }
        "th" => {
            c.expect_word("dport")?;
            Ok(Sel::Dport)
        }
        w => Err(format!("selector `{w}` not supported")),
    }
}

/// An address or prefix as (bytes, prefix length).
fn parse_net(w: &str, fam: Family) -> Result<(Vec<u8>, usize), String> {
    let (a, p) = match w.split_once('/') {
        Some((a, p)) => (
            a,
            Some(
                p.parse::<usize>()
                    .map_err(|_| format!("bad prefix length in `{w}`"))?,
            ),
        ),
        None => (w, None),
    };
    let ip: IpAddr = a.parse().map_err(|_| format!("`{w}` is not an address"))?;
    let bytes = addr_bytes(ip, fam)?;
    let plen = p.unwrap_or(bytes.len() * 8);
    if plen == 0 || plen > bytes.len() * 8 {
        return Err(format!("prefix length of `{w}` not supported"));
    }
    Ok((bytes, plen))
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

pub struct CompiledRule {
    pub exprs: Vec<Attrs>,
    pub anon: Vec<AnonSet>,
    pub comment: Option<String>,
}

#[allow(clippy::too_many_arguments)] // one call per anonymous set kind; a struct adds nothing
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
fn interval_set(c: &mut Cur, fam: Family, table: &str, id: u32) -> Result<AnonSet, String> {
    let mut ranges: Vec<(u128, u128)> = Vec::new();
    let bits = fam.addr_len() * 8;
    loop {
        let w = c.word("an address or prefix")?;
        let (bytes, plen) = parse_net(w, fam)?;
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
        if c.eat(&Tok::Comma) {
            continue;
        }
        c.expect(Tok::RBrace)?;
        break;
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

/// `numgen random mod N vmap|map { 0 : X, 1 : Y }`: the anonymous map, with
/// values from `value` (verdict or concatenated data).
fn numgen_map(
    c: &mut Cur,
    table: &str,
    id: u32,
    data: Option<(u32, u32)>,
    mut value: impl FnMut(&mut Cur, &mut Attrs) -> Result<(), String>,
) -> Result<(AnonSet, u32), String> {
    c.expect(Tok::LBrace)?;
    let (mut ea, l) = elems_head(table, "__map%d", id);
    let mut n = 0u32;
    loop {
        let k = c.word("a numgen key")?;
        let k: u32 = k.parse().map_err(|_| format!("`{k}` is not a number"))?;
        if k != n {
            return Err(format!("numgen map keys must be 0..N in order, found {k}"));
        }
        c.expect_word(":")?;
        let e = ea.begin_nest(1);
        ea.data_value(1, &k.to_ne_bytes());
        let d = ea.begin_nest(2);
        value(c, &mut ea)?;
        ea.end_nest(d);
        ea.end_nest(e);
        n += 1;
        if c.eat(&Tok::Comma) {
            continue;
        }
        c.expect(Tok::RBrace)?;
        break;
    }
    ea.end_nest(l);
    let mut ud = Vec::new();
    udata(&mut ud, 0, &1u32.to_ne_bytes());
    udata(&mut ud, 1, &0u32.to_ne_bytes());
    let verdict = data.is_none();
    if verdict {
        let mut nest = Vec::new();
        udata(&mut nest, 0, &1u32.to_ne_bytes());
        udata(&mut nest, 1, &[]);
        udata(&mut ud, 4, &nest);
    }
    udata(&mut ud, 6, &0u32.to_ne_bytes());
    let set = anon_set_head(
        table,
        "__map%d",
        0xb,
        (4, 4),
        Some(data.unwrap_or((0xffff_ff00, 0))),
        id,
        n,
        &ud,
    );
    Ok((AnonSet { set, elems: ea }, n))
}

/// `numgen random mod N [offset B]`.
fn parse_numgen_head(c: &mut Cur) -> Result<(u32, u32), String> {
    c.expect_word("numgen")?;
    c.expect_word("random")?;
    c.expect_word("mod")?;
    let m = c.word("a modulus")?;
    let m = m
        .parse::<u32>()
        .ok()
        .filter(|m| *m > 0)
        .ok_or_else(|| format!("bad modulus `{m}`"))?;
    let offset = if c.eat_word("offset") {
        parse_hex_or_dec(c.word("an offset")?)?
    } else {
        0
    };
    Ok((m, offset))
}

/// `@name` after `map`/`vmap`: a lookup in a named map (None: an anonymous
/// `{ ... }` map follows).
fn named_map(c: &mut Cur) -> Result<Option<String>, String> {
    match c.peek_word() {
        Some(w) => match w.strip_prefix('@') {
            Some(n) => {
                c.next();
                Ok(Some(n.to_string()))
            }
            None => Err(format!("expected @map or {{, found `{w}`")),
        },
        None => Ok(None),
    }
}

fn parse_hex_or_dec(w: &str) -> Result<u32, String> {
    let r = match w.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16),
        None => w.parse(),
    };
    r.map_err(|_| format!("`{w}` is not a number"))
}

/// Compiles the body of `add rule <fam> <table> <chain> BODY`.
pub fn compile_rule(
    c: &mut Cur,
    fam: Family,
    table: &str,
    next_id: &mut dyn FnMut() -> u32,
) -> Result<CompiledRule, String> {
    let mut r = CompiledRule {
        exprs: Vec::new(),
        anon: Vec::new(),
        comment: None,
    };
    let mut terminal = false;
    while let Some(tok) = c.peek() {
        let w = match tok {
            Tok::Word(w) => w.as_str(),
            t => return Err(format!("unexpected {t:?}")),
        };
        if terminal && w != "comment" {
            return Err(format!("`{w}` after the rule's verdict"));
        }
        match w {
            "comment" => {
                c.next();
                r.comment = Some(c.string("comment")?.to_string());
                c.end()?;
                break;
            }
            "ct" => {
                c.next();
                c.expect_word("state")?;
                let mut bits = 0u32;
                loop {
                    bits |= match c.word("a ct state")? {
                        "invalid" => 1,
                        "established" => 2,
                        "related" => 4,
                        "new" => 8,
                        "untracked" => 64,
                        s => return Err(format!("ct state `{s}` not supported")),
                    };
                    if !c.eat(&Tok::Comma) {
                        break;
                    }
                }
                r.exprs.push(ex("ct", |a| {
                    a.u32be(2, 0).u32be(1, 1);
                }));
                r.exprs.push(bitwise(1, &bits.to_ne_bytes(), &[0; 4]));
                r.exprs.push(cmp(1, true, &[0; 4]));
            }
            "tcp" | "udp" | "sctp" => {
                let p = proto_number(w).unwrap_or(0);
                c.next();
                c.expect_word("dport")?;
                let port = c.word("a port")?;
                let port: u16 = port.parse().map_err(|_| format!("bad port `{port}`"))?;
                r.exprs.push(meta_load(16, 1));
                r.exprs.push(cmp(1, false, &[p]));
                r.exprs.push(payload(2, 2, 2, 1));
                r.exprs.push(cmp(1, false, &port.to_be_bytes()));
            }
            "meta" if c.peek_word_at(1) == Some("mark") => {
                c.next();
                c.next();
                if c.eat_word("set") {
                    c.expect_word("meta")?;
                    c.expect_word("mark")?;
                    let op = c.word("or or xor")?;
                    let v = parse_hex_or_dec(c.word("a mark")?)?;
                    let (mask, xor) = match op {
                        "or" => (!v, v),
                        "xor" => (u32::MAX, v),
                        o => return Err(format!("mark operation `{o}` not supported")),
                    };
                    r.exprs.push(meta_load(3, 1));
                    r.exprs
                        .push(bitwise(1, &mask.to_ne_bytes(), &xor.to_ne_bytes()));
                    r.exprs.push(ex("meta", |a| {
                        a.u32be(2, 3).u32be(3, 1);
                    }));
                } else {
                    c.expect_word("and")?;
                    let v = parse_hex_or_dec(c.word("a mask")?)?;
                    let neq = match c.word("== or !=")? {
                        "==" => false,
                        "!=" => true,
                        o => return Err(format!("operator `{o}` not supported")),
                    };
                    let want = parse_hex_or_dec(c.word("a value")?)?;
                    r.exprs.push(meta_load(3, 1));
                    r.exprs.push(bitwise(1, &v.to_ne_bytes(), &[0; 4]));
                    r.exprs.push(cmp(1, neq, &want.to_ne_bytes()));
                }
            }
            "meta" if c.peek_word_at(2) != Some(".") => {
                // meta l4proto tcp
                c.next();
                c.expect_word("l4proto")?;
                let p = c.word("a protocol")?;
                let p = proto_number(p).ok_or_else(|| format!("protocol `{p}` not supported"))?;
                r.exprs.push(meta_load(16, 1));
                r.exprs.push(cmp(1, false, &[p]));
            }
            "ip" | "ip6" | "meta" | "th" => {
                let mut sels = vec![parse_sel(c, fam)?];
                while c.eat_word(".") {
                    sels.push(parse_sel(c, fam)?);
                }
                if sels.len() > 1
                    || c.peek_word()
                        .is_some_and(|w| w.starts_with('@') || w == "vmap")
                {
                    // Concatenated (or single) key looked up in a named set/map.
                    let mut word = 0usize;
                    for s in &sels {
                        r.exprs.push(s.load(fam, reg(word)));
                        word += s.len(fam).div_ceil(4);
                    }
                    let vmap = c.eat_word("vmap");
                    let set = c.word("@set")?;
                    let set = set
                        .strip_prefix('@')
                        .ok_or_else(|| format!("expected @set, found `{set}`"))?;
                    r.exprs.push(lookup(1, vmap.then_some(0), set, None, false));
                    if vmap {
                        terminal = true;
                    }
                    continue;
                }
                let off = match sels[0] {
                    Sel::Addr(off) => off,
                    _ => return Err("only address matches may compare a value".into()),
                };
                let neq = c.eat_word("!=");
                // nft turns a one-element anonymous set into a plain match.
                let single = c.peek() == Some(&Tok::LBrace)
                    && matches!(c.peek_at(1), Some(Tok::Word(_)))
                    && c.peek_at(2) == Some(&Tok::RBrace);
                if single {
                    c.next();
                }
                if !single && c.eat(&Tok::LBrace) {
                    let id = next_id();
                    let anon = interval_set(c, fam, table, id)?;
                    r.anon.push(anon);
                    r.exprs.push(payload(1, off, fam.addr_len() as u32, 1));
                    r.exprs.push(lookup(1, None, "__set%d", Some(id), neq));
                    continue;
                }
                let (bytes, plen) = parse_net(c.word("an address")?, fam)?;
                if single {
                    c.expect(Tok::RBrace)?;
                }
                let full = bytes.len() * 8;
                if plen == full {
                    r.exprs.push(payload(1, off, bytes.len() as u32, 1));
                    r.exprs.push(cmp(1, neq, &bytes));
                } else if plen % 8 == 0 {
                    let n = plen / 8;
                    r.exprs.push(payload(1, off, n as u32, 1));
                    r.exprs.push(cmp(1, neq, &bytes[..n]));
                } else {
                    let mask = mask_bytes(bytes.len(), plen);
                    let masked: Vec<u8> = bytes.iter().zip(&mask).map(|(b, m)| b & m).collect();
                    r.exprs.push(payload(1, off, bytes.len() as u32, 1));
                    r.exprs.push(bitwise(1, &mask, &vec![0; bytes.len()]));
                    r.exprs.push(cmp(1, neq, &masked));
                }
            }
            "fib" => {
                c.next();
                let flags = match c.word("saddr or daddr")? {
                    "saddr" => 1u32,
                    "daddr" => 2,
                    x => return Err(format!("fib `{x}` not supported")),
                };
                c.expect_word("type")?;
                c.expect_word("local")?;
                r.exprs.push(ex("fib", |a| {
                    a.u32be(1, 1).u32be(2, 3).u32be(3, flags);
                }));
                r.exprs.push(cmp(1, false, &2u32.to_ne_bytes()));
            }
            "iifname" => {
                c.next();
                let neq = c.eat_word("!=");
                let name = c.string("interface name")?;
                let data = match name.strip_suffix('*') {
                    Some(prefix) => prefix.as_bytes().to_vec(),
                    None => {
                        if name.len() >= 16 {
                            return Err(format!("interface name `{name}` too long"));
                        }
                        let mut v = name.as_bytes().to_vec();
                        v.resize(16, 0);
                        v
                    }
                };
                if data.is_empty() {
                    return Err("empty interface name".into());
                }
                r.exprs.push(meta_load(6, 1));
                r.exprs.push(cmp(1, neq, &data));
            }
            "numgen" => {
                let (m, offset) = parse_numgen_head(c)?;
                c.expect_word("vmap")?;
                if let Some(map) = named_map(c)? {
                    r.exprs.push(numgen(m, offset));
                    r.exprs.push(lookup(1, Some(0), &map, None, false));
                    terminal = true;
                    continue;
                }
                if offset != 0 {
                    return Err("an anonymous numgen map cannot have an offset".into());
                }
                let id = next_id();
                let (anon, n) = numgen_map(c, table, id, None, |c, a| {
                    let v = parse_verdict(c)?;
                    put_verdict(a, &v);
                    Ok(())
                })?;
                if n != m {
                    return Err(format!("numgen mod {m} with {n} map entries"));
                }
                r.anon.push(anon);
                r.exprs.push(numgen(m, 0));
                r.exprs.push(lookup(1, Some(0), "__map%d", Some(id), false));
                terminal = true;
            }
            "dnat" => {
                c.next();
                let kw = c.word("ip or ip6")?;
                if kw != fam.kw() {
                    return Err(format!("dnat `{kw}` in a table of family {}", fam.kw()));
                }
                if c.eat_word("addr") {
                    c.expect_word(".")?;
                    c.expect_word("port")?;
                    c.expect_word("to")?;
                    let (m, offset) = parse_numgen_head(c)?;
                    c.expect_word("map")?;
                    let preg = reg(fam.addr_len() / 4);
                    if let Some(map) = named_map(c)? {
                        r.exprs.push(numgen(m, offset));
                        r.exprs.push(lookup(1, Some(1), &map, None, false));
                        r.exprs.push(nat(fam, preg, None));
                        terminal = true;
                        continue;
                    }
                    if offset != 0 {
                        return Err("an anonymous numgen map cannot have an offset".into());
                    }
                    let id = next_id();
                    let data_type = (fam.addr_type() << 6) | 13;
                    let data_len = fam.addr_len() as u32 + 4;
                    let (anon, n) =
                        numgen_map(c, table, id, Some((data_type, data_len)), |c, a| {
                            let ip: IpAddr = c
                                .word("an address")?
                                .parse()
                                .map_err(|_| "endpoint is not an address".to_string())?;
                            c.expect_word(".")?;
                            let p = c.word("a port")?;
                            let port: u16 = p.parse().map_err(|_| format!("bad port `{p}`"))?;
                            let mut v = addr_bytes(ip, fam)?;
                            v.extend_from_slice(&port.to_be_bytes());
                            v.extend_from_slice(&[0, 0]);
                            a.attr(1, &v);
                            Ok(())
                        })?;
                    if n != m {
                        return Err(format!("numgen mod {m} with {n} map entries"));
                    }
                    r.anon.push(anon);
                    r.exprs.push(numgen(m, 0));
                    r.exprs.push(lookup(1, Some(1), "__map%d", Some(id), false));
                    r.exprs.push(nat(fam, preg, None));
                } else {
                    c.expect_word("to")?;
                    let t = c.word("address:port")?;
                    let sa: std::net::SocketAddr = t
                        .parse()
                        .map_err(|_| format!("`{t}` is not address:port"))?;
                    r.exprs.push(immediate_data(1, &addr_bytes(sa.ip(), fam)?));
                    r.exprs.push(immediate_data(2, &sa.port().to_be_bytes()));
                    // NF_NAT_RANGE_PROTO_SPECIFIED, as nft sets for an explicit port.
                    r.exprs.push(nat(fam, 2, Some(2)));
                }
                terminal = true;
            }
            "masquerade" => {
                c.next();
                let random = c.eat_word("fully-random");
                r.exprs.push(ex("masq", |a| {
                    if random {
                        a.u32be(1, 0x10);
                    }
                }));
                terminal = true;
            }
            "reject" => {
                c.next();
                let code = match fam {
                    Family::V4 => 3u8, // ICMP port unreachable
                    Family::V6 => 4,   // ICMPv6 port unreachable
                };
                r.exprs.push(ex("reject", |a| {
                    a.u32be(1, 0).u8(2, code);
                }));
                terminal = true;
            }
            "update" => {
                c.next();
                let set = c.word("@set")?;
                let set = set
                    .strip_prefix('@')
                    .ok_or_else(|| format!("expected @set, found `{set}`"))?
                    .to_string();
                c.expect(Tok::LBrace)?;
                let sel = parse_sel(c, fam)?;
                c.expect(Tok::RBrace)?;
                let Sel::Addr(off) = sel else {
                    return Err("update key must be an address".into());
                };
                r.exprs.push(payload(1, off, fam.addr_len() as u32, 1));
                r.exprs.push(ex("dynset", |a| {
                    a.str(1, &set).u32be(3, 1).u32be(4, 1);
                }));
            }
            "jump" | "goto" | "drop" | "return" | "accept" => {
                let v = parse_verdict(c)?;
                r.exprs.push(immediate_verdict(&v));
                terminal = true;
            }
            w => return Err(format!("statement `{w}` not supported")),
        }
    }
    if r.exprs.is_empty() {
        return Err("empty rule".into());
    }
    Ok(r)
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
