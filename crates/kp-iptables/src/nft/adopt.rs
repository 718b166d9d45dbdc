//! Restarts that rewrite nothing: before a process's first restore, every
//! chain the input declares is read back from the kernel, and those that
//! already hold exactly the input's rules are taken out of the input (not
//! flushed, not written). A restart onto an unchanged cluster then sends
//! nothing, and the kernel never validates the nat table for it (a commit
//! costs ~350 ms at 10k Services).
//!
//! Rules are compared as fingerprints in one canonical form, never decoded:
//! what the kernel lists and what our encoder would send are both reduced
//! the same way. The kernel lists attributes in its own order, adds
//! zero-valued defaults we do not send, drops counters' values from
//! identity and lists an x_tables match's data only up to its user-visible
//! size (`statistic` keeps a kernel pointer after it): the reduction sorts
//! attributes, leaves out counter expressions and trailing zero bytes of
//! plain attributes, and compares values and verdicts byte for byte.
//! Whatever it cannot tell apart is rewritten, never assumed alike.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::Hasher;
use std::time::Instant;

use kp_model::DataplaneError;
use kp_netlink::nftables::fingerprint::{self, bytes};
use kp_netlink::nftables::{nft_attrs, NftSocket};
use kp_netlink::ParsedAttrs;
use kp_xtables::Adopted;

use super::{apply_err, dump_chain, encode, nfproto, IptablesNetlink};
use crate::types::{Line, Restore};

/// A chain of the input: (table, chain).
type ChainKey = (String, String);

/// The nested `NFTA_DATA_*` attributes (values and verdicts) of the
/// expressions iptables-nft writes, compared byte for byte.
fn data_attrs(name: &[u8]) -> &'static [u16] {
    match name {
        b"cmp\0" => &[3],
        b"immediate\0" => &[2],
        // NFTA_BITWISE_MASK, _XOR
        b"bitwise\0" => &[4, 5],
        // NFTA_RANGE_FROM_DATA, _TO_DATA
        b"range\0" => &[4, 5],
        _ => &[],
    }
}

/// One rule: its expression list (`NFTA_RULE_EXPRESSIONS` contents) and
/// user data (`NFTA_RULE_USERDATA`; ours have none).
pub(super) fn rule_fp(exprs: &[u8], udata: Option<&[u8]>) -> u64 {
    let mut h = DefaultHasher::new();
    for (_, elem) in ParsedAttrs::parse(exprs).iter() {
        let e = ParsedAttrs::parse(elem);
        let name = e.get(1).unwrap_or_default();
        if name == b"counter\0" {
            continue;
        }
        bytes(&mut h, name);
        let nested = data_attrs(name);
        let items: Vec<(u16, &[u8])> = ParsedAttrs::parse(e.get(2).unwrap_or_default())
            .iter()
            .map(|(t, p)| {
                if nested.contains(&t) {
                    (t, p)
                } else {
                    // A number's zero default, or a match's data past
                    // what the kernel lists: fixed-size fields, so two
                    // that differ still differ after this.
                    let end = p.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
                    (t, &p[..end])
                }
            })
            .filter(|(t, p)| nested.contains(t) || !p.is_empty())
            .collect();
        fingerprint::attrs(&mut h, items, nested);
    }
    match udata {
        None => h.write_u8(0),
        Some(u) => {
            h.write_u8(1);
            bytes(&mut h, u);
        }
    }
    h.finish()
}

/// The fingerprints of the rules of one chain, in order (empty also when
/// the chain is not there: the kernel lists nothing for it).
fn chain_fps(
    sock: &mut NftSocket,
    proto: u8,
    table: &str,
    chain: &str,
) -> Result<Vec<u64>, DataplaneError> {
    Ok(dump_chain(sock, proto, table, chain)?
        .iter()
        .map(|r| {
            let at = ParsedAttrs::parse(nft_attrs(&r.bytes));
            rule_fp(at.get(4).unwrap_or_default(), at.get(7))
        })
        .collect())
}

/// `chain_fps` of every chain, on up to 4 threads with a socket each
/// (none spawned for a few hundred chains).
fn read_chains(
    proto: u8,
    chains: Vec<ChainKey>,
) -> Result<HashMap<ChainKey, Vec<u64>>, DataplaneError> {
    let read = kp_netlink::on_threads(
        chains,
        256,
        NftSocket::new,
        |sock, (t, c)| chain_fps(sock, proto, &t, &c).map(|f| ((t, c), f)),
        || apply_err("a thread reading rules back panicked".into()),
    )?;
    Ok(read.into_iter().collect())
}

/// What the input declares of one chain.
#[derive(Default)]
struct Declared {
    /// Input lines (1-based) of the declaration and of its rules.
    lines: Vec<usize>,
    /// Its rules' fingerprints, made only when the kernel has the chain.
    fps: Vec<u64>,
    /// Deleted (`-X`) or declared twice: always written as the input says.
    not_adoptable: bool,
}

impl IptablesNetlink {
    /// `input` without the chains the kernel already holds exactly as
    /// `input` declares them (and without tables left with nothing to
    /// do), and what was found.
    pub(super) fn adopt<'a>(
        &mut self,
        input: &Restore<'a>,
    ) -> Result<(Restore<'a>, Adopted), DataplaneError> {
        let t0 = Instant::now();
        let fam = self.fam();
        // Which chains exist: the listing of the full sync that made the
        // input, or one of our own. Only those are read back and only
        // their rules encoded to compare (on a node without our chains,
        // nothing is).
        let existing = match self.listing.take() {
            Some(l) => l,
            None => self.all_chains()?,
        };
        let mut declared: HashMap<ChainKey, Declared> = HashMap::new();
        let mut table = "";
        for (i, line) in input.lines.iter().enumerate() {
            let n = i + 1;
            let key = |c: &str| (table.to_string(), c.to_string());
            match *line {
                Line::Table(t) => table = t,
                Line::Commit => table = "",
                Line::Chain(c) => {
                    let d = declared.entry(key(c)).or_default();
                    d.not_adoptable |= !d.lines.is_empty();
                    d.lines.push(n);
                }
                Line::DeleteChain(c) => {
                    declared.entry(key(c)).or_default().not_adoptable = true;
                }
                Line::Append(c, r) => {
                    let key = key(c);
                    let exists = existing.contains(&key);
                    let d = declared.entry(key).or_default();
                    if d.lines.is_empty() {
                        // Before any declaration (a builtin chain, or one
                        // declared later): this line stays, and so does
                        // the chain's declaration.
                        d.not_adoptable = true;
                    } else {
                        if exists {
                            let enc = encode::encode(r, fam)
                                .map_err(|e| apply_err(format!("line {n}: {e}: `{line}`")))?;
                            d.fps.push(rule_fp(enc.as_bytes(), None));
                        }
                        d.lines.push(n);
                    }
                }
                Line::Insert(..) => {}
            }
        }
        let mut st = Adopted::default();
        let mut wanted: Vec<ChainKey> = Vec::new();
        for (key, d) in &declared {
            if d.not_adoptable || d.lines.is_empty() {
                continue;
            }
            if existing.contains(key) {
                wanted.push(key.clone());
            } else {
                st.chains_added += 1;
            }
        }
        let kernel = read_chains(nfproto(self.family), wanted)?;
        st.rules_read = kernel.values().map(Vec::len).sum();
        let mut skip: HashSet<usize> = HashSet::new();
        for (key, fps) in &kernel {
            let Some(d) = declared.get(key) else {
                continue;
            };
            if *fps == d.fps {
                st.chains_kept += 1;
                skip.extend(&d.lines);
            } else {
                st.chains_rewritten += 1;
            }
        }
        st.read = t0.elapsed();
        let out = without_lines(input, &skip);
        st.lines_sent = out.lines.len();
        Ok((out, st))
    }
}

/// `input` without the lines numbered in `skip` (1-based) and without the
/// table sections that are then only `*table` and `COMMIT`.
fn without_lines<'a>(input: &Restore<'a>, skip: &HashSet<usize>) -> Restore<'a> {
    let mut out = Restore::default();
    let mut section: Vec<Line<'a>> = Vec::new();
    for (i, l) in input.lines.iter().enumerate() {
        if skip.contains(&(i + 1)) {
            continue;
        }
        match l {
            Line::Table(_) => section = vec![*l],
            // The table's line and COMMIT alone: nothing to send.
            Line::Commit if section.len() == 1 => section.clear(),
            Line::Commit if !section.is_empty() => {
                out.lines.append(&mut section);
                out.push(*l);
            }
            _ if !section.is_empty() => section.push(*l),
            _ => out.push(*l),
        }
    }
    // A section without COMMIT: as it was (restore reports it).
    out.lines.append(&mut section);
    out
}

#[cfg(test)]
mod tests {
    use kp_netlink::Attrs;

    use super::*;

    fn expr(name: &str, data: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut a = Attrs::new();
        let e = a.begin_nest(1);
        a.str(1, name);
        let d = a.begin_nest(2);
        for (t, p) in data {
            a.attr(*t, p);
        }
        a.end_nest(d);
        a.end_nest(e);
        a.as_bytes().to_vec()
    }

    #[test]
    fn the_reduction_ignores_order_counters_and_trailing_zeros_only() {
        let stat = |info: Vec<u8>| {
            expr(
                "match",
                &[(1, b"statistic\0".to_vec()), (2, vec![0; 4]), (3, info)],
            )
        };
        let mut ours = stat([vec![1, 0, 0, 0, 0x55, 0x55, 0x55, 0x15], vec![0; 16]].concat());
        ours.extend(expr("counter", &[(1, vec![0; 8]), (2, vec![0; 8])]));
        // As the kernel lists it: the data up to the user-visible size,
        // the revision left out (zero), a counter with values.
        let mut kernel = expr("counter", &[(1, vec![9; 8]), (2, vec![7; 8])]);
        kernel.extend(expr(
            "match",
            &[
                (
                    3,
                    [vec![1, 0, 0, 0, 0x55, 0x55, 0x55, 0x15], vec![0; 8]].concat(),
                ),
                (1, b"statistic\0".to_vec()),
            ],
        ));
        assert_eq!(rule_fp(&ours, None), rule_fp(&kernel, None));
        // Another probability, another rule.
        let other = stat([vec![1, 0, 0, 0, 0x55, 0x55, 0x55, 0x25], vec![0; 16]].concat());
        assert_ne!(rule_fp(&ours, None), rule_fp(&other, None));
        // A value compared byte for byte: a shorter compare is another rule.
        let cmp = |v: Vec<u8>| {
            let mut d = Attrs::new();
            d.attr(1, &v);
            expr("cmp", &[(1, vec![0, 0, 0, 1]), (3, d.as_bytes().to_vec())])
        };
        assert_ne!(
            rule_fp(&cmp(vec![10, 0, 0, 0]), None),
            rule_fp(&cmp(vec![10]), None)
        );
        // User data (a comment another writer keeps there) is another rule.
        assert_ne!(rule_fp(&ours, None), rule_fp(&ours, Some(b"x")));
    }

    #[test]
    fn kept_chains_and_empty_tables_leave_the_input() {
        use crate::types::{Rule, Target};
        let (a, b) = (
            Rule::new(Vec::new(), Target::Jump("KUBE-SVC-A".into())),
            Rule::new(Vec::new(), Target::Jump("KUBE-SEP-B".into())),
        );
        let input = Restore {
            lines: vec![
                Line::Table("mangle"),
                Line::Chain("KUBE-PROXY-CANARY"),
                Line::Commit,
                Line::Table("nat"),
                Line::Chain("KUBE-SERVICES"),
                Line::Chain("KUBE-SVC-A"),
                Line::Append("KUBE-SERVICES", &a),
                Line::Append("KUBE-SVC-A", &b),
                Line::DeleteChain("KUBE-SEP-OLD"),
                Line::Commit,
            ],
        };
        let skip: HashSet<usize> = [2, 5, 7].into_iter().collect();
        assert_eq!(
            without_lines(&input, &skip).to_string(),
            "*nat\n:KUBE-SVC-A - [0:0]\n-A KUBE-SVC-A -j KUBE-SEP-B\n-X KUBE-SEP-OLD\nCOMMIT\n"
        );
        let all: HashSet<usize> = (1..=10).filter(|n| ![1, 3, 4, 10].contains(n)).collect();
        assert_eq!(without_lines(&input, &all), Restore::default());
    }
}
