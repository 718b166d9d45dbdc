//! The nft script subset the proxier writes, compiled to nf_tables messages.
//!
//! Every line shape comes from proxier.rs, render.rs and rule.rs; anything else
//! is refused with the line, never guessed at. Encodings follow what nft 1.0.6
//! sends for the same text (checked with `nft --debug=netlink,mnl`), so that
//! `nft list` shows our rules exactly as if nft had added them.

use std::net::IpAddr;

use thiserror::Error;

use kp_netlink::{Attrs, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST};

use super::expr::{self, Family};
use super::nla::{msg, put_msg, udata, NftAttrs};

/// A line the encoder cannot turn into netlink.
#[derive(Debug, Error)]
#[error("line {line}: {why}: `{text}`")]
pub struct ScriptError {
    pub line: usize,
    pub text: String,
    pub why: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tok {
    Word(String),
    Str(String),
    LBrace,
    RBrace,
    Comma,
    Semi,
}

pub fn tokenize(s: &str) -> Result<Vec<Tok>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars();
    let flush = |cur: &mut String, out: &mut Vec<Tok>| {
        if !cur.is_empty() {
            out.push(Tok::Word(std::mem::take(cur)));
        }
    };
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => flush(&mut cur, &mut out),
            '{' | '}' | ',' | ';' => {
                flush(&mut cur, &mut out);
                out.push(match c {
                    '{' => Tok::LBrace,
                    '}' => Tok::RBrace,
                    ',' => Tok::Comma,
                    _ => Tok::Semi,
                });
            }
            '"' => {
                if !cur.is_empty() {
                    return Err("quote inside a word".into());
                }
                let mut s = String::new();
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some(c) => s.push(c),
                        None => return Err("unterminated string".into()),
                    }
                }
                out.push(Tok::Str(s));
            }
            c => cur.push(c),
        }
    }
    flush(&mut cur, &mut out);
    Ok(out)
}

/// Token cursor with error messages that say what was expected.
pub struct Cur<'a> {
    toks: &'a [Tok],
    pos: usize,
}

impl<'a> Cur<'a> {
    pub fn new(toks: &'a [Tok]) -> Self {
        Cur { toks, pos: 0 }
    }
    pub fn peek(&self) -> Option<&'a Tok> {
        self.toks.get(self.pos)
    }
    pub fn peek_at(&self, k: usize) -> Option<&'a Tok> {
        self.toks.get(self.pos + k)
    }
    pub fn peek_word(&self) -> Option<&'a str> {
        match self.toks.get(self.pos) {
            Some(Tok::Word(w)) => Some(w),
            _ => None,
        }
    }
    pub fn peek_word_at(&self, k: usize) -> Option<&'a str> {
        match self.toks.get(self.pos + k) {
            Some(Tok::Word(w)) => Some(w),
            _ => None,
        }
    }
    pub fn next(&mut self) -> Option<&'a Tok> {
        let t = self.toks.get(self.pos);
        self.pos += 1;
        t
    }
    pub fn word(&mut self, what: &str) -> Result<&'a str, String> {
        match self.next() {
            Some(Tok::Word(w)) => Ok(w),
            other => Err(format!("expected {what}, found {other:?}")),
        }
    }
    pub fn string(&mut self, what: &str) -> Result<&'a str, String> {
        match self.next() {
            Some(Tok::Str(w)) => Ok(w),
            other => Err(format!("expected quoted {what}, found {other:?}")),
        }
    }
    pub fn expect_word(&mut self, w: &str) -> Result<(), String> {
        match self.next() {
            Some(Tok::Word(x)) if x == w => Ok(()),
            other => Err(format!("expected `{w}`, found {other:?}")),
        }
    }
    pub fn expect(&mut self, t: Tok) -> Result<(), String> {
        match self.next() {
            Some(x) if *x == t => Ok(()),
            other => Err(format!("expected {t:?}, found {other:?}")),
        }
    }
    pub fn eat(&mut self, t: &Tok) -> bool {
        if self.peek() == Some(t) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    pub fn eat_word(&mut self, w: &str) -> bool {
        if self.peek_word() == Some(w) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    pub fn end(&self) -> Result<(), String> {
        match self.peek() {
            None => Ok(()),
            Some(t) => Err(format!("unexpected {t:?}")),
        }
    }
}

/// One compiled transaction: the batch bytes and which script line each
/// message came from.
pub struct Batch {
    pub buf: Vec<u8>,
    /// (sequence number, 1-based line) for every message between BEGIN and END.
    pub lines: Vec<(u32, usize)>,
    pub begin_seq: u32,
    seq: u32,
    set_id: u32,
}

/// An anonymous set or map a rule needs, sent before the rule.
pub struct AnonSet {
    pub set: Attrs,
    pub elems: Attrs,
}

impl Batch {
    fn new(seq0: u32) -> Batch {
        let mut b = Batch {
            buf: Vec::new(),
            lines: Vec::new(),
            begin_seq: seq0,
            seq: seq0,
            set_id: 0,
        };
        put_msg(
            &mut b.buf,
            super::nla::NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            seq0,
            0,
            super::nla::NFNL_SUBSYS_NFTABLES,
            &[],
        );
        b
    }

    fn push(&mut self, line: usize, fam: Family, ty: u16, flags: u16, attrs: &Attrs) {
        self.seq = self.seq.wrapping_add(1);
        put_msg(
            &mut self.buf,
            (super::nla::NFNL_SUBSYS_NFTABLES << 8) | ty,
            NLM_F_REQUEST | NLM_F_ACK | flags,
            self.seq,
            fam.nfproto(),
            0,
            attrs.as_bytes(),
        );
        self.lines.push((self.seq, line));
    }

    fn finish(mut self) -> Batch {
        self.seq = self.seq.wrapping_add(1);
        put_msg(
            &mut self.buf,
            super::nla::NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            self.seq,
            0,
            super::nla::NFNL_SUBSYS_NFTABLES,
            &[],
        );
        self
    }

    /// A fresh set id for this batch (anonymous sets are found by id).
    pub fn next_set_id(&mut self) -> u32 {
        self.set_id += 1;
        self.set_id
    }

    /// Messages in the batch, BEGIN and END excluded.
    pub fn len(&self) -> usize {
        self.lines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }
}

/// Compiles a whole script into one batch starting at sequence `seq0`.
pub fn compile(script: &str, seq0: u32) -> Result<Batch, ScriptError> {
    let mut b = Batch::new(seq0);
    for (i, line) in script.lines().enumerate() {
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        let err = |why: String| ScriptError {
            line: i + 1,
            text: t.to_string(),
            why,
        };
        let toks = tokenize(t).map_err(err)?;
        compile_line(&mut b, i + 1, &toks).map_err(err)?;
    }
    Ok(b.finish())
}

fn family(w: &str) -> Result<Family, String> {
    match w {
        "ip" => Ok(Family::V4),
        "ip6" => Ok(Family::V6),
        other => Err(format!("family `{other}` not supported (ip, ip6)")),
    }
}

fn table_chain(a: &mut Attrs, table: &str, chain: &str) {
    a.str(1, table);
    a.str(2, chain);
}

fn compile_line(b: &mut Batch, line: usize, toks: &[Tok]) -> Result<(), String> {
    let mut c = Cur::new(toks);
    let verb = c.word("add, delete or flush")?;
    let obj = c.word("an object kind")?;
    let fam = family(c.word("a family")?)?;
    let table = c.word("a table name")?;
    match (verb, obj) {
        ("add", "table") => {
            let mut a = Attrs::default();
            a.str(1, table).u32be(2, 0);
            if c.eat(&Tok::LBrace) {
                c.expect_word("comment")?;
                let text = c.string("comment")?;
                c.expect(Tok::Semi)?;
                c.expect(Tok::RBrace)?;
                a.attr(6, &comment_udata(text)?);
            }
            c.end()?;
            b.push(line, fam, msg::NEWTABLE, NLM_F_CREATE, &a);
        }
        ("delete", "table") => {
            c.end()?;
            let mut a = Attrs::default();
            a.str(1, table);
            b.push(line, fam, msg::DELTABLE, 0, &a);
        }
        ("flush", "table") => {
            // nft's `flush table`: delete every rule of the table (sets keep
            // their elements, chains stay).
            c.end()?;
            let mut a = Attrs::default();
            a.str(1, table);
            b.push(line, fam, msg::DELRULE, 0, &a);
        }
        ("add", "chain") => {
            let name = c.word("a chain name")?;
            let mut a = Attrs::default();
            a.str(1, table).str(3, name);
            if c.eat(&Tok::LBrace) {
                c.expect_word("type")?;
                let ty = c.word("a chain type")?;
                if !matches!(ty, "filter" | "nat") {
                    return Err(format!("chain type `{ty}` not supported"));
                }
                c.expect_word("hook")?;
                let hook = match c.word("a hook")? {
                    "prerouting" => 0u32,
                    "input" => 1,
                    "forward" => 2,
                    "output" => 3,
                    "postrouting" => 4,
                    h => return Err(format!("hook `{h}` not supported")),
                };
                c.expect_word("priority")?;
                let p = c.word("a priority")?;
                let prio: i32 = p
                    .parse()
                    .map_err(|_| format!("priority `{p}` is not a number"))?;
                c.expect(Tok::Semi)?;
                c.expect_word("policy")?;
                let policy = match c.word("a policy")? {
                    "accept" => 1u32,
                    "drop" => 0,
                    x => return Err(format!("policy `{x}` not supported")),
                };
                c.expect(Tok::Semi)?;
                c.expect(Tok::RBrace)?;
                a.str(7, ty).u32be(5, policy);
                let h = a.begin_nest(4);
                a.u32be(1, hook).u32be(2, prio as u32);
                a.end_nest(h);
            }
            c.end()?;
            b.push(line, fam, msg::NEWCHAIN, NLM_F_CREATE, &a);
        }
        ("flush", "chain") | ("delete", "chain") => {
            let name = c.word("a chain name")?;
            c.end()?;
            let mut a = Attrs::default();
            if verb == "flush" {
                table_chain(&mut a, table, name);
                b.push(line, fam, msg::DELRULE, 0, &a);
            } else {
                a.str(1, table).str(3, name);
                b.push(line, fam, msg::DELCHAIN, 0, &a);
            }
        }
        ("add", "set") | ("add", "map") => {
            let name = c.word("a set name")?;
            let decl = parse_set_decl(&mut c, obj == "map")?;
            c.end()?;
            let id = b.next_set_id();
            let a = set_attrs(table, name, &decl, id);
            b.push(line, fam, msg::NEWSET, NLM_F_CREATE, &a);
        }
        ("flush", "set") | ("flush", "map") | ("delete", "set") | ("delete", "map") => {
            let name = c.word("a set name")?;
            c.end()?;
            let mut a = Attrs::default();
            if verb == "flush" {
                // DELSETELEM without elements empties the set.
                a.str(1, table).str(2, name);
                b.push(line, fam, msg::DELSETELEM, 0, &a);
            } else {
                a.str(1, table).str(2, name);
                b.push(line, fam, msg::DELSET, 0, &a);
            }
        }
        ("add", "element") | ("delete", "element") => {
            let name = c.word("a set name")?;
            c.expect(Tok::LBrace)?;
            let mut a = Attrs::default();
            a.str(1, table).str(2, name);
            let list = a.begin_nest(3);
            loop {
                let key = parse_key(&mut c, fam)?;
                let e = a.begin_nest(1);
                a.data_value(1, &key);
                if c.eat_word(":") {
                    let d = a.begin_nest(2);
                    if c.peek_word().is_some_and(|w| w.parse::<IpAddr>().is_ok()) {
                        // `address . port`: a DNAT target of the endpoint map.
                        let mut v = key_part(c.word("an address")?, fam)?;
                        c.expect_word(".")?;
                        let p = c.word("a port")?;
                        let port: u16 = p.parse().map_err(|_| format!("bad port `{p}`"))?;
                        v.extend_from_slice(&port.to_be_bytes());
                        v.extend_from_slice(&[0, 0]);
                        a.attr(1, &v);
                    } else {
                        let v = expr::parse_verdict(&mut c)?;
                        expr::put_verdict(&mut a, &v);
                    }
                    a.end_nest(d);
                }
                a.end_nest(e);
                if c.eat(&Tok::Comma) {
                    continue;
                }
                c.expect(Tok::RBrace)?;
                break;
            }
            a.end_nest(list);
            c.end()?;
            let ty = if verb == "add" {
                msg::NEWSETELEM
            } else {
                msg::DELSETELEM
            };
            let flags = if verb == "add" { NLM_F_CREATE } else { 0 };
            b.push(line, fam, ty, flags, &a);
        }
        ("add", "rule") => {
            let chain = c.word("a chain name")?;
            let rule = expr::compile_rule(&mut c, fam, table, &mut || b_next_id(b))?;
            for anon in &rule.anon {
                b.push(line, fam, msg::NEWSET, NLM_F_CREATE, &anon.set);
                b.push(line, fam, msg::NEWSETELEM, NLM_F_CREATE, &anon.elems);
            }
            let mut a = Attrs::default();
            table_chain(&mut a, table, chain);
            let l = a.begin_nest(4);
            for e in &rule.exprs {
                a.extend(e);
            }
            a.end_nest(l);
            if let Some(text) = &rule.comment {
                a.attr(7, &comment_udata(text)?);
            }
            b.push(line, fam, msg::NEWRULE, NLM_F_CREATE | NLM_F_APPEND, &a);
        }
        (v, o) => return Err(format!("`{v} {o}` not supported")),
    }
    Ok(())
}

fn b_next_id(b: &mut Batch) -> u32 {
    b.next_set_id()
}

fn comment_udata(text: &str) -> Result<Vec<u8>, String> {
    // Type 0 = comment, NUL included, as nft writes it (at most 255 bytes).
    if text.len() >= 255 {
        return Err("comment longer than 254 bytes".into());
    }
    let mut v = text.as_bytes().to_vec();
    v.push(0);
    let mut out = Vec::new();
    udata(&mut out, 0, &v);
    Ok(out)
}

/// nft datatypes our sets use: (id, length in bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    Ipv4,
    Ipv6,
    InetProto,
    InetService,
}

impl DType {
    fn id(self) -> u32 {
        match self {
            DType::Ipv4 => 7,
            DType::Ipv6 => 8,
            DType::InetProto => 12,
            DType::InetService => 13,
        }
    }
    fn len(self) -> u32 {
        match self {
            DType::Ipv4 => 4,
            DType::Ipv6 => 16,
            DType::InetProto => 1,
            DType::InetService => 2,
        }
    }
}

pub struct SetDecl {
    key: Vec<DType>,
    verdict_map: bool,
    timeout_flags: bool,
    timeout_ms: Option<u64>,
    /// `typeof numgen random mod 1 : ...`: the shared endpoint maps.
    numgen: Option<NumgenMap>,
}

/// What a numgen-keyed map holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumgenMap {
    /// `ip daddr . tcp dport` (or ip6, udp, sctp): DNAT targets; the number
    /// is nft's protocol description of the port's header.
    AddrPort(Family, u32),
    Verdict,
}

/// `typeof numgen random mod 1 : VALUE ;` (after `typeof`).
fn parse_numgen_typeof(c: &mut Cur) -> Result<NumgenMap, String> {
    for w in ["numgen", "random", "mod", "1", ":"] {
        c.expect_word(w)?;
    }
    let v = if c.eat_word("verdict") {
        NumgenMap::Verdict
    } else {
        let fam = family(c.word("ip, ip6 or verdict")?)?;
        c.expect_word("daddr")?;
        c.expect_word(".")?;
        let l4 = match c.word("tcp, udp or sctp")? {
            "tcp" => 8,
            "udp" => 6,
            "sctp" => 10,
            p => return Err(format!("protocol `{p}` not supported in a numgen map")),
        };
        c.expect_word("dport")?;
        NumgenMap::AddrPort(fam, l4)
    };
    c.expect(Tok::Semi)?;
    c.expect(Tok::RBrace)?;
    Ok(v)
}

fn parse_set_decl(c: &mut Cur, is_map: bool) -> Result<SetDecl, String> {
    c.expect(Tok::LBrace)?;
    if c.eat_word("typeof") {
        if !is_map {
            return Err("only maps may be declared with typeof".into());
        }
        return Ok(SetDecl {
            key: Vec::new(),
            verdict_map: false,
            timeout_flags: false,
            timeout_ms: None,
            numgen: Some(parse_numgen_typeof(c)?),
        });
    }
    c.expect_word("type")?;
    let mut key = Vec::new();
    let mut verdict_map = false;
    loop {
        key.push(match c.word("a datatype")? {
            "ipv4_addr" => DType::Ipv4,
            "ipv6_addr" => DType::Ipv6,
            "inet_proto" => DType::InetProto,
            "inet_service" => DType::InetService,
            t => return Err(format!("datatype `{t}` not supported")),
        });
        if c.eat_word(".") {
            continue;
        }
        if c.eat_word(":") {
            c.expect_word("verdict")?;
            verdict_map = true;
        }
        c.expect(Tok::Semi)?;
        break;
    }
    if verdict_map != is_map {
        return Err("maps (and only maps) need `: verdict`".into());
    }
    let mut timeout_flags = false;
    let mut timeout_ms = None;
    loop {
        if c.eat_word("flags") {
            let mut fl = Vec::new();
            loop {
                fl.push(c.word("a set flag")?);
                if !c.eat(&Tok::Comma) {
                    break;
                }
            }
            fl.sort();
            if fl != ["dynamic", "timeout"] {
                return Err(format!("set flags {fl:?} not supported"));
            }
            timeout_flags = true;
            c.expect(Tok::Semi)?;
        } else if c.eat_word("timeout") {
            let t = c.word("a timeout")?;
            let secs: u64 = t
                .strip_suffix('s')
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("timeout `{t}` not in seconds"))?;
            timeout_ms = Some(secs * 1000);
            c.expect(Tok::Semi)?;
        } else {
            break;
        }
    }
    c.expect(Tok::RBrace)?;
    if timeout_ms.is_some() && !timeout_flags {
        return Err("a timeout needs `flags dynamic,timeout`".into());
    }
    Ok(SetDecl {
        key,
        verdict_map,
        timeout_flags,
        timeout_ms,
        numgen: None,
    })
}

/// Set userdata nft 1.0.6 writes for `typeof numgen random mod 1 : VALUE`
/// (read off `nft --debug=mnl`): key byte order host, data byte order none,
/// the key's typeof (numgen random mod 1), the value's typeof, and a zero
/// attribute 6 nft always adds to maps.
fn numgen_map_udata(kind: NumgenMap) -> Vec<u8> {
    let u32s = |v: u32| v.to_ne_bytes();
    let mut ud = Vec::new();
    udata(&mut ud, 0, &u32s(1));
    udata(&mut ud, 1, &u32s(0));
    let mut ng = Vec::new();
    udata(&mut ng, 0, &u32s(1)); // random
    udata(&mut ng, 1, &u32s(1)); // mod 1
    udata(&mut ng, 2, &u32s(0)); // offset 0
    let mut key = Vec::new();
    udata(&mut key, 0, &u32s(23)); // numgen expression
    udata(&mut key, 1, &ng);
    udata(&mut ud, 3, &key);
    let mut data = Vec::new();
    match kind {
        NumgenMap::AddrPort(fam, l4) => {
            // Payload fields: (protocol description, field index).
            let (addr_desc, daddr) = match fam {
                Family::V4 => (12u32, 12u32),
                Family::V6 => (13, 9),
            };
            let payload = |desc: u32, field: u32| {
                let mut f = Vec::new();
                udata(&mut f, 0, &u32s(desc));
                udata(&mut f, 1, &u32s(field));
                let mut p = Vec::new();
                udata(&mut p, 0, &u32s(7)); // payload expression
                udata(&mut p, 1, &f);
                p
            };
            let mut parts = Vec::new();
            udata(&mut parts, 0, &payload(addr_desc, daddr));
            udata(&mut parts, 1, &payload(l4, 2)); // dport
            udata(&mut data, 0, &u32s(13)); // concatenation
            udata(&mut data, 1, &parts);
        }
        NumgenMap::Verdict => {
            udata(&mut data, 0, &u32s(1)); // verdict
            udata(&mut data, 1, &[]);
        }
    }
    udata(&mut ud, 4, &data);
    udata(&mut ud, 6, &u32s(0));
    ud
}

fn numgen_map_attrs(table: &str, name: &str, kind: NumgenMap, id: u32) -> Attrs {
    let mut a = Attrs::default();
    // NFT_SET_MAP; key: a 32-bit integer (nft's TYPE_INTEGER, 4).
    a.str(1, table).str(2, name).u32be(3, 0x8);
    a.u32be(4, 4).u32be(5, 4);
    match kind {
        NumgenMap::AddrPort(fam, _) => {
            a.u32be(6, (fam.addr_type() << 6) | DType::InetService.id());
            a.u32be(7, fam.addr_len() as u32 + 4);
        }
        NumgenMap::Verdict => {
            a.u32be(6, 0xffff_ff00).u32be(7, 0);
        }
    }
    a.u32be(10, id);
    a.attr(13, &numgen_map_udata(kind));
    a
}

fn set_attrs(table: &str, name: &str, d: &SetDecl, id: u32) -> Attrs {
    if let Some(kind) = d.numgen {
        return numgen_map_attrs(table, name, kind, id);
    }
    let concat = d.key.len() > 1;
    let key_type = d.key.iter().fold(0u32, |acc, t| (acc << 6) | t.id());
    let key_len: u32 = if concat {
        d.key.iter().map(|t| t.len().div_ceil(4) * 4).sum()
    } else {
        d.key[0].len()
    };
    let mut flags = 0u32;
    if d.verdict_map {
        flags |= 0x8; // NFT_SET_MAP
    }
    if d.timeout_flags {
        flags |= 0x10 | 0x20; // NFT_SET_TIMEOUT | NFT_SET_EVAL
    }
    let mut a = Attrs::default();
    a.str(1, table).str(2, name).u32be(3, flags);
    a.u32be(4, key_type).u32be(5, key_len);
    if d.verdict_map {
        a.u32be(6, 0xffff_ff00).u32be(7, 0);
    }
    a.u32be(10, id);
    if let Some(ms) = d.timeout_ms {
        a.u64be(11, ms);
    }
    // nft's set userdata: key byte order (big endian for a lone address, none
    // for a concatenation), then for concatenations a `typeof` stub that nft
    // itself writes for declared types.
    let mut u = Vec::new();
    udata(&mut u, 0, &(if concat { 0u32 } else { 2u32 }).to_ne_bytes());
    if d.verdict_map {
        udata(&mut u, 1, &0u32.to_ne_bytes());
    }
    if concat {
        let mut nest = Vec::new();
        udata(&mut nest, 0, &13u32.to_ne_bytes());
        udata(&mut nest, 1, &[]);
        udata(&mut u, 3, &nest);
    }
    if d.verdict_map {
        udata(&mut u, 6, &0u32.to_ne_bytes());
    }
    a.attr(13, &u);
    a
}

/// An element key: address, protocol name or port, joined by ` . `; each
/// field of a concatenation padded to 4 bytes.
fn parse_key(c: &mut Cur, fam: Family) -> Result<Vec<u8>, String> {
    let mut parts: Vec<Vec<u8>> = Vec::new();
    loop {
        let w = c.word("an element key")?;
        parts.push(key_part(w, fam)?);
        if !c.eat_word(".") {
            break;
        }
    }
    if parts.len() == 1 {
        return Ok(parts.pop().unwrap_or_default());
    }
    let mut out = Vec::new();
    for mut p in parts {
        while p.len() % 4 != 0 {
            p.push(0);
        }
        out.extend_from_slice(&p);
    }
    Ok(out)
}

fn key_part(w: &str, fam: Family) -> Result<Vec<u8>, String> {
    if let Some(h) = w.strip_prefix("0x") {
        // A slot of a numgen-keyed map: numgen writes host-endian integers.
        let v = u32::from_str_radix(h, 16).map_err(|_| format!("bad slot `{w}`"))?;
        return Ok(v.to_ne_bytes().to_vec());
    }
    if let Some(p) = expr::proto_number(w) {
        return Ok(vec![p]);
    }
    if let Ok(port) = w.parse::<u16>() {
        return Ok(port.to_be_bytes().to_vec());
    }
    match w.parse::<IpAddr>() {
        Ok(ip) => expr::addr_bytes(ip, fam),
        Err(_) => Err(format!(
            "element key part `{w}` is not an address, protocol or port"
        )),
    }
}
