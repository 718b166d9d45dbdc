//! Our table as the kernel holds it, read back over netlink so that a
//! restart can adopt what is already right instead of rewriting it.
//!
//! Nothing is decoded into rules: every rule and element the kernel lists
//! is reduced to a fingerprint in one canonical form, and what the proxier
//! wants goes through our own encoder and the same reduction. Two agree
//! only when they would program the same; anything the reduction cannot
//! tell apart is rewritten, never assumed. The kernel lists attributes in
//! its own order and adds zero-valued defaults we do not send (a lookup's
//! flags, a numgen's offset): the reduction sorts each expression's
//! attributes and drops its zero-valued numbers, and compares data (values,
//! verdicts) byte for byte.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::Hasher;

use kp_model::{DataplaneError, IpFamily};
use kp_netlink::nftables::fingerprint::{self, bytes};
use kp_netlink::nftables::{msg, nft_type};
use kp_netlink::{Attrs, ParsedAttrs};

use super::batch::key_bytes;
use super::expr::{encode_rule, put_elem_value, Family};
use super::{NftNetlink, TOOL};
use crate::types::{ElemKey, ElemValue, Rule};
use crate::view::{ChainState, SetChanges, SlotRef, TableView};

#[derive(Default)]
struct SeenChain {
    /// Fingerprint of each rule, in order.
    rules: Vec<u64>,
    /// A rule that names an anonymous set: its contents are not read, so
    /// the chain never counts as the same.
    opaque: bool,
    slots: Vec<SlotRef>,
}

/// What the kernel holds of our table in one family, as fingerprints.
pub struct KernelTable {
    comment: Option<String>,
    fam: Family,
    table: String,
    chains: HashMap<String, SeenChain>,
    /// Named sets -> their elements: key bytes -> fingerprint of the rest
    /// (value, flags). Not read for the sets `skip_elements` named:
    /// affinity records are data, not rules.
    sets: HashMap<String, HashMap<Box<[u8]>, u64>>,
    rules: usize,
    elements: usize,
}

impl TableView for KernelTable {
    fn comment(&self) -> Option<&str> {
        self.comment.as_deref()
    }

    fn chain_names(&self) -> Vec<&str> {
        self.chains.keys().map(String::as_str).collect()
    }

    fn set_names(&self) -> Vec<&str> {
        self.sets.keys().map(String::as_str).collect()
    }

    fn has_set(&self, name: &str) -> bool {
        self.sets.contains_key(name)
    }

    /// Rules and elements read.
    fn counts(&self) -> (usize, usize) {
        (self.rules, self.elements)
    }

    /// Where chain `name`'s rules point into the endpoint maps, in order.
    fn slot_refs(&self, name: &str) -> &[SlotRef] {
        self.chains.get(name).map_or(&[], |c| c.slots.as_slice())
    }

    /// Whether the kernel's chain `name` holds exactly `rules`.
    fn chain_state(&self, name: &str, rules: &[Rule]) -> ChainState {
        let Some(seen) = self.chains.get(name) else {
            return ChainState::Missing;
        };
        if seen.opaque || seen.rules.len() != rules.len() {
            return ChainState::Differs;
        }
        for (r, fp) in rules.iter().zip(&seen.rules) {
            match self.rule_fingerprint(r) {
                Some(ours) if ours == *fp => {}
                _ => return ChainState::Differs,
            }
        }
        ChainState::Same
    }

    /// What it takes to make set `name` hold exactly `elems`: which to
    /// add (indexes into `elems`), which to replace (a key held with
    /// another value: deleted, then added), and the keys to delete. None
    /// when the set was not read or holds a key we cannot name (then it is
    /// flushed and refilled).
    fn set_changes(
        &self,
        name: &str,
        elems: &mut dyn Iterator<Item = (&ElemKey, Option<&ElemValue>)>,
    ) -> Option<SetChanges> {
        let seen = self.sets.get(name)?;
        let mut ch = SetChanges::default();
        let mut wanted: HashSet<&[u8]> = HashSet::new();
        for (i, (k, v)) in elems.enumerate() {
            let key = key_bytes(k, self.fam).ok()?;
            match seen.get_key_value(key.as_slice()) {
                Some((held, fp)) => {
                    wanted.insert(held);
                    if Some(*fp) != self.value_fingerprint(v) {
                        ch.replace.push(i);
                    }
                }
                None => ch.add.push(i),
            }
        }
        for key in seen.keys().filter(|k| !wanted.contains(&k[..])) {
            ch.delete.push(decode_key(name, key, self.fam)?);
        }
        Some(ch)
    }

    /// Whether set `name` holds element `key` (with `value`).
    fn has_element(&self, name: &str, key: &ElemKey, value: Option<&ElemValue>) -> bool {
        let (Some(seen), Ok(k)) = (self.sets.get(name), key_bytes(key, self.fam)) else {
            return false;
        };
        seen.get(k.as_slice())
            .is_some_and(|fp| Some(*fp) == self.value_fingerprint(value))
    }
}

impl KernelTable {
    fn rule_fingerprint(&self, rule: &Rule) -> Option<u64> {
        let enc = encode_rule(rule, self.fam, &self.table, &mut || 0).ok()?;
        if !enc.anon.is_empty() {
            return None;
        }
        let mut exprs = Attrs::new();
        for e in &enc.exprs {
            exprs.extend(e);
        }
        let udata = match &rule.comment {
            Some(c) => super::batch::comment_udata(c).ok()?,
            None => Vec::new(),
        };
        Some(rule_fp(exprs.as_bytes(), &udata))
    }

    fn value_fingerprint(&self, v: Option<&ElemValue>) -> Option<u64> {
        let mut a = Attrs::new();
        if let Some(v) = v {
            let d = a.begin_nest(2);
            put_elem_value(&mut a, v, self.fam).ok()?;
            a.end_nest(d);
        }
        Some(elem_fp(a.as_bytes()))
    }
}

/// The typed key of set `set` whose bytes are `b` (the layout `key_bytes`
/// writes, checked by writing it again).
fn decode_key(set: &str, b: &[u8], fam: Family) -> Option<ElemKey> {
    use crate::names::*;
    let n = fam.addr_len();
    let ip = |b: &[u8]| -> Option<std::net::IpAddr> {
        Some(match n {
            4 => std::net::IpAddr::from(<[u8; 4]>::try_from(b.get(..4)?).ok()?),
            _ => std::net::IpAddr::from(<[u8; 16]>::try_from(b.get(..16)?).ok()?),
        })
    };
    let proto = |p: u8| {
        [
            kp_model::Protocol::Tcp,
            kp_model::Protocol::Udp,
            kp_model::Protocol::Sctp,
        ]
        .into_iter()
        .find(|x| super::expr::proto_number(*x) == p)
    };
    let port = |b: &[u8]| Some(u16::from_be_bytes(b.get(..2)?.try_into().ok()?));
    let key = if set.starts_with("endpoints-") {
        ElemKey::Slot(u32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
    } else if set.starts_with("select-") {
        ElemKey::Select {
            ip: ip(b)?,
            port: port(b.get(n..)?)?,
            index: u32::from_ne_bytes(b.get(n + 4..n + 8)?.try_into().ok()?),
        }
    } else if set == MAP_SERVICE_NODEPORTS || set == MAP_NO_EP_NODEPORTS {
        ElemKey::ProtoPort(proto(*b.first()?)?, port(b.get(4..)?)?)
    } else if set == SET_CLUSTER_IPS || set == SET_NODEPORT_IPS {
        ElemKey::Ip(ip(b)?)
    } else if set == SET_HAIRPIN {
        ElemKey::IpPair(ip(b)?)
    } else if set == MAP_SERVICE_IPS || set == MAP_NO_EP_SERVICES || set == MAP_FIREWALL_IPS {
        ElemKey::IpProtoPort(ip(b)?, proto(*b.get(n)?)?, port(b.get(n + 4..)?)?)
    } else {
        return None;
    };
    (key_bytes(&key, fam).ok()? == b).then_some(key)
}

/// One level of attributes: (type, payload), flags dropped.
fn attrs(b: &[u8]) -> Vec<(u16, &[u8])> {
    ParsedAttrs::parse(b).iter().collect()
}

/// The data attributes (nested `NFTA_DATA_*`) of the expressions we write.
fn data_attrs(name: &[u8]) -> &'static [u16] {
    match name {
        b"cmp\0" => &[3],
        b"immediate\0" => &[2],
        // NFTA_BITWISE_MASK, _XOR, _DATA (6 is the operation, a number)
        b"bitwise\0" => &[4, 5, 7],
        _ => &[],
    }
}

/// A nat expression's upper registers and flags as the kernel completes
/// them: a range's end defaults to its start, and giving an address or a
/// port sets `NF_NAT_RANGE_MAP_IPS` / `_PROTO_SPECIFIED`.
fn nat_defaults(items: &[(u16, &[u8])]) -> Vec<(u16, [u8; 4])> {
    let get = |ty: u16| {
        items
            .iter()
            .find(|(t, _)| *t == ty)
            .and_then(|(_, p)| be32(p))
    };
    let mut flags = get(7).unwrap_or(0);
    let mut out = Vec::new();
    if let Some(min) = get(3) {
        out.push((4, get(4).unwrap_or(min).to_be_bytes()));
        flags |= 1;
    }
    if let Some(min) = get(5) {
        out.push((6, get(6).unwrap_or(min).to_be_bytes()));
        flags |= 2;
    }
    out.push((7, flags.to_be_bytes()));
    out
}

/// A rule: its expressions (`NFTA_RULE_EXPRESSIONS` contents) and comment.
fn rule_fp(exprs: &[u8], udata: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    for (_, elem) in attrs(exprs) {
        let e = attrs(elem);
        let name = e.iter().find(|(t, _)| *t == 1).map_or(&[][..], |(_, p)| p);
        bytes(&mut h, name);
        let data = e.iter().find(|(t, _)| *t == 2).map_or(&[][..], |(_, p)| p);
        let nested = data_attrs(name);
        let mut items = attrs(data);
        let nat_extra;
        if name == b"nat\0" {
            nat_extra = nat_defaults(&items);
            items.retain(|(t, _)| !matches!(t, 4 | 6 | 7));
            items.extend(nat_extra.iter().map(|(t, v)| (*t, &v[..])));
        }
        let items: Vec<(u16, &[u8])> = items
            .into_iter()
            // Zero numbers are the kernel's defaults (or ours, alike).
            .filter(|(t, p)| nested.contains(t) || p.is_empty() || p.iter().any(|b| *b != 0))
            .collect();
        fingerprint::attrs(&mut h, items, nested);
    }
    h.write_u8(0xff);
    bytes(&mut h, udata);
    h.finish()
}

/// A set element but its key: value and flags
/// (`NFTA_SET_ELEM_{DATA,FLAGS}`); timeouts and expirations are the
/// kernel's bookkeeping.
fn elem_fp(b: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    let mut items: Vec<(u16, &[u8])> = attrs(b)
        .into_iter()
        .filter(|(t, p)| match t {
            2 | 10 => true,
            3 => p.iter().any(|b| *b != 0),
            _ => false,
        })
        .collect();
    items.sort_by_key(|(t, _)| *t);
    for (t, p) in items {
        h.write_u16(t);
        match t {
            3 => bytes(&mut h, p),
            _ => fingerprint::data(&mut h, p),
        }
    }
    h.finish()
}

fn be32(p: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(p.get(..4)?.try_into().ok()?))
}

fn cstr(p: &[u8]) -> &[u8] {
    p.split(|b| *b == 0).next().unwrap_or_default()
}

/// The endpoint-map references of one rule's expressions: each lookup of
/// a map named `endpoints-…`, with the offset and modulus of the numgen or
/// hash before it. Also whether the rule names an anonymous set.
fn scan_rule(exprs: &[u8], out: &mut Vec<SlotRef>) -> bool {
    let mut opaque = false;
    let mut last: Option<(u32, u32)> = None;
    for (_, elem) in attrs(exprs) {
        let e = attrs(elem);
        let name = e.iter().find(|(t, _)| *t == 1).map_or(&[][..], |(_, p)| p);
        let data = attrs(e.iter().find(|(t, _)| *t == 2).map_or(&[][..], |(_, p)| p));
        let get = |ty: u16| data.iter().find(|(t, _)| *t == ty).map(|(_, p)| *p);
        match cstr(name) {
            // NFTA_NG_MODULUS 2, NFTA_NG_OFFSET 4
            b"numgen" => {
                last = Some((
                    get(4).and_then(be32).unwrap_or(0),
                    get(2).and_then(be32).unwrap_or(0),
                ))
            }
            // NFTA_HASH_MODULUS 4, NFTA_HASH_OFFSET 6
            b"hash" => {
                last = Some((
                    get(6).and_then(be32).unwrap_or(0),
                    get(4).and_then(be32).unwrap_or(0),
                ))
            }
            b"lookup" => {
                let set = get(1).map(cstr).unwrap_or_default();
                if set.starts_with(b"__") {
                    opaque = true;
                } else if set.starts_with(b"endpoints-") {
                    if let Some((offset, modulus)) = last {
                        out.push(SlotRef {
                            map: String::from_utf8_lossy(set).into_owned(),
                            offset,
                            modulus,
                        });
                    }
                }
            }
            _ => {}
        }
    }
    opaque
}

/// `f` for every name, on up to 4 threads with a socket each; the results
/// in no particular order.
fn in_parallel<T: Send>(
    names: Vec<String>,
    f: impl Fn(&mut NftNetlink, &str) -> Result<T, DataplaneError> + Sync,
) -> Result<Vec<(String, T)>, DataplaneError> {
    kp_netlink::on_threads(
        names,
        1,
        NftNetlink::new,
        |nl, n| f(nl, &n).map(|t| (n, t)),
        || DataplaneError::Apply {
            tool: TOOL.into(),
            message: "a thread reading the table back panicked".into(),
        },
    )
}

impl NftNetlink {
    /// Reads `table` of `family` back: every chain and rule, every named
    /// set, and the elements of those not in `skip_elements`. None when
    /// the table is not there.
    pub(super) fn read_back(
        &mut self,
        family: IpFamily,
        table: &str,
        skip_elements: &dyn Fn(&str) -> bool,
        comment: Option<String>,
    ) -> Result<Option<KernelTable>, DataplaneError> {
        let fam = Family::from(family);
        let mut kt = KernelTable {
            comment,
            fam,
            table: table.to_string(),
            chains: HashMap::new(),
            sets: HashMap::new(),
            rules: 0,
            elements: 0,
        };
        let ours = |a: &ParsedAttrs, ty: u16| a.get(ty).map(cstr) == Some(table.as_bytes());
        let mut by_table = Attrs::new();
        by_table.str(1, table);
        // Chains (a chain without rules is in no rule dump).
        let Some(replies) = self.dump(
            family,
            msg::GETCHAIN,
            &by_table,
            "our chains",
            "listing our chains",
        )?
        else {
            return Ok(None);
        };
        for r in replies.iter().filter(|r| r.ty == nft_type(msg::NEWCHAIN)) {
            let a = ParsedAttrs::parse(r.payload().get(4..).unwrap_or_default());
            if !ours(&a, 1) {
                continue;
            }
            if let Some(name) = a.get(3).map(cstr) {
                kt.chains
                    .entry(String::from_utf8_lossy(name).into_owned())
                    .or_default();
            }
        }
        // One dump per chain, over a few sockets at once: one dump of the
        // whole table costs the kernel a walk of every chain before each
        // 32 KiB of answer, quadratic in the table (3-4 s at 50k Services).
        let names: Vec<String> = kt.chains.keys().cloned().collect();
        let read = in_parallel(names, |nl, chain| {
            let mut a = Attrs::new();
            a.str(1, table).str(2, chain);
            let mut seen = SeenChain::default();
            let what = format!("the rules of chain {chain}");
            for r in nl
                .dump(family, msg::GETRULE, &a, &what, &format!("listing {what}"))?
                .unwrap_or_default()
            {
                if r.ty != nft_type(msg::NEWRULE) {
                    continue;
                }
                let a = ParsedAttrs::parse(r.payload().get(4..).unwrap_or_default());
                let exprs = a.get(4).unwrap_or_default();
                let udata = a.get(7).unwrap_or_default();
                seen.opaque |= scan_rule(exprs, &mut seen.slots);
                seen.rules.push(rule_fp(exprs, udata));
            }
            Ok(seen)
        })?;
        for (name, seen) in read {
            kt.rules += seen.rules.len();
            kt.chains.insert(name, seen);
        }
        let Some(replies) = self.dump(
            family,
            msg::GETSET,
            &by_table,
            "our sets",
            "listing our sets",
        )?
        else {
            return Ok(None);
        };
        let mut names = Vec::new();
        for r in replies.iter().filter(|r| r.ty == nft_type(msg::NEWSET)) {
            let a = ParsedAttrs::parse(r.payload().get(4..).unwrap_or_default());
            // NFT_SET_ANONYMOUS: a rule's own set, read with nothing.
            let anonymous = a.get(3).and_then(be32).unwrap_or(0) & 0x1 != 0;
            if !ours(&a, 1) || anonymous {
                continue;
            }
            if let Some(name) = a.get(2).map(cstr) {
                names.push(String::from_utf8_lossy(name).into_owned());
            }
        }
        let (skipped, names): (Vec<String>, Vec<String>) =
            names.into_iter().partition(|n| skip_elements(n));
        for name in skipped {
            kt.sets.insert(name, HashMap::new());
        }
        let read = in_parallel(names, |nl, name| {
            let mut elems = HashMap::new();
            let mut a = Attrs::new();
            a.str(1, table).str(2, name);
            let what = format!("the elements of set {name}");
            for r in nl
                .dump(
                    family,
                    msg::GETSETELEM,
                    &a,
                    &what,
                    &format!("listing {what}"),
                )?
                .unwrap_or_default()
            {
                if r.ty != nft_type(msg::NEWSETELEM) {
                    continue;
                }
                let a = ParsedAttrs::parse(r.payload().get(4..).unwrap_or_default());
                for (_, elem) in a.nested(3).iter().flat_map(|l| l.iter()) {
                    let e = ParsedAttrs::parse(elem);
                    // NFTA_SET_ELEM_KEY { NFTA_DATA_VALUE }
                    let Some(key) = e.nested(1).and_then(|k| k.get(1)) else {
                        continue;
                    };
                    elems.insert(Box::from(key), elem_fp(elem));
                }
            }
            Ok(elems)
        })?;
        for (name, elems) in read {
            kt.elements += elems.len();
            kt.sets.insert(name, elems);
        }
        Ok(Some(kt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kp_netlink::nftables::NftAttrs;

    /// The kernel's listing of an expression differs from what we send by
    /// order and zero defaults only; both reduce alike, and a real
    /// difference does not.
    #[test]
    fn the_reduction_ignores_order_and_zero_defaults_only() {
        use kp_netlink::nftables::expr::ex;
        let ours = ex("lookup", |a| {
            a.u32be(2, 1).str(1, "service-ips");
        });
        let kernels = ex("lookup", |a| {
            a.str(1, "service-ips").u32be(2, 1).u32be(5, 0);
        });
        let inverted = ex("lookup", |a| {
            a.str(1, "service-ips").u32be(2, 1).u32be(5, 1);
        });
        let fp = |e: &Attrs| rule_fp(e.as_bytes(), b"");
        assert_eq!(fp(&ours), fp(&kernels));
        assert_ne!(fp(&ours), fp(&inverted));
        // Data are compared byte for byte: a zero value is not a default.
        let zero = ex("cmp", |a| {
            a.u32be(1, 1).u32be(2, 0).data_value(3, &[0, 0]);
        });
        let zero4 = ex("cmp", |a| {
            a.u32be(1, 1).u32be(2, 0).data_value(3, &[0, 0, 0, 0]);
        });
        assert_ne!(fp(&zero), fp(&zero4));
        assert_ne!(
            rule_fp(ours.as_bytes(), b"a"),
            rule_fp(ours.as_bytes(), b"b")
        );
    }

    #[test]
    fn selection_rules_say_where_they_point() {
        use kp_netlink::nftables::expr::ex;
        let mut exprs = Attrs::new();
        exprs.extend(&ex("numgen", |a| {
            a.u32be(1, 1).u32be(2, 3).u32be(3, 1).u32be(4, 64);
        }));
        exprs.extend(&ex("lookup", |a| {
            a.str(1, "endpoints-tcp-2").u32be(2, 1).u32be(3, 1);
        }));
        let mut refs = Vec::new();
        assert!(!scan_rule(exprs.as_bytes(), &mut refs));
        assert_eq!(
            refs,
            vec![SlotRef {
                map: "endpoints-tcp-2".into(),
                offset: 64,
                modulus: 3
            }]
        );
        let mut anon = Attrs::new();
        anon.extend(&ex("lookup", |a| {
            a.str(1, "__set0").u32be(2, 1);
        }));
        assert!(scan_rule(anon.as_bytes(), &mut refs));
    }

    /// Every key kind reads back from the bytes it is written as, in the
    /// set that holds it; bytes that do not fit are no key.
    #[test]
    fn keys_read_back_from_their_bytes() {
        use crate::names::*;
        use kp_model::Protocol;
        let v4: std::net::IpAddr = "10.96.0.1".parse().unwrap();
        let v6: std::net::IpAddr = "fd00::1".parse().unwrap();
        for (fam, ip) in [(Family::V4, v4), (Family::V6, v6)] {
            for (set, key) in [
                ("endpoints-tcp-3", ElemKey::Slot(77)),
                (
                    MAP_SERVICE_NODEPORTS,
                    ElemKey::ProtoPort(Protocol::Udp, 30001),
                ),
                (SET_CLUSTER_IPS, ElemKey::Ip(ip)),
                (SET_HAIRPIN, ElemKey::IpPair(ip)),
                (
                    MAP_SERVICE_IPS,
                    ElemKey::IpProtoPort(ip, Protocol::Sctp, 443),
                ),
                (
                    "select-udp-1",
                    ElemKey::Select {
                        ip,
                        port: 53,
                        index: 70,
                    },
                ),
            ] {
                let b = key_bytes(&key, fam).unwrap();
                assert_eq!(decode_key(set, &b, fam), Some(key.clone()), "{set}");
                assert_eq!(decode_key(set, &b[1..], fam), None, "{set}");
            }
        }
        assert_eq!(decode_key("no-such-set", &[0; 4], Family::V4), None);
    }
}
