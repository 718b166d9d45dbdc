//! iptables-nft without `iptables-restore`: the proxier's restore input
//! (typed: [`Restore`]) written as one nf_tables netlink batch, the rules
//! encoded as iptables-nft encodes them (encode.rs), so `iptables-save`
//! lists them as its own.
//!
//! Why: `iptables-nft-restore` reads the whole table from the kernel, and
//! rebuilds its cache of it, before every change, however small: at 1,000
//! Services one endpoint change took 107 ms for upstream and for us, and at
//! 10k a first sync takes hours. Here a change costs what it says, the
//! chains it rewrites, plus what the kernel itself spends validating the
//! nat table at commit (34 ms at 1k Services, ~350 ms at 10k: the floor of
//! this layout, docs/iptables.md); nothing is read back but the chain names
//! at a full sync and the few rules of the builtin chains our jumps live in.
//!
//! Every table in one input is committed in one transaction (iptables-restore
//! commits per table). Rules of other owners are never touched: we create
//! and flush only the chains the input declares, and rules go into builtin
//! chains only as the input's `-I` jumps.

mod adopt;
mod encode;

use std::collections::{BTreeSet, HashSet};

use kp_model::{DataplaneError, IpFamily};
use kp_netlink::nftables::{
    errno_text, msg, next_seq, nft_attrs, nft_type, refusals, Batch, ExchangeError, NftSocket,
    Refusal, NFPROTO_IPV4, NFPROTO_IPV6,
};
use kp_netlink::{
    Attrs, ParsedAttrs, Until, NLA_F_NESTED, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_DUMP,
};

pub use encode::{EncodeError, Family};
use kp_xtables::{Adopted, Jump};

use crate::types::{Line, Restore, Rule};
use crate::writer::Writer;

const TOOL: &str = "iptables-nft over netlink";

/// A rule of a chain as read back: (handle, expression list).
type ChainRule = (u64, Vec<u8>);

/// Inputs of at least this many lines are encoded on two threads.
const SPLIT_AT_LINES: usize = 20_000;

/// Encodes `lines` (the input's from line `offset + 1`; `table`: the table
/// in force before them) into `b`. The tables and builtin chains they use
/// were added beforehand.
fn encode_lines(
    b: &mut Batch,
    proto: u8,
    fam: Family,
    lines: &[Line<'_>],
    offset: usize,
    table: &str,
) -> Result<(), DataplaneError> {
    let mut table = table;
    // Each rule's message is built here, in one buffer for them all.
    let mut msg_buf = Attrs::with_capacity(1024);
    for (i, line) in lines.iter().enumerate() {
        let n = offset + i + 1;
        let need_table = || {
            if table.is_empty() {
                Err(apply_err(format!("line {n}: outside a table (`*table`)")))
            } else {
                Ok(())
            }
        };
        match *line {
            Line::Table(t) => table = t,
            Line::Commit => table = "",
            Line::Chain(c) => {
                need_table()?;
                if builtin(table, c).is_some() {
                    return Err(apply_err(format!(
                        "line {n}: builtin chain {c} cannot be declared (it would be flushed)"
                    )));
                }
                let mut a = Attrs::new();
                a.str(1, table).str(3, c);
                b.push(n, proto, msg::NEWCHAIN, NLM_F_CREATE, &a);
                let mut a = Attrs::new();
                a.str(1, table).str(2, c);
                b.push(n, proto, msg::DELRULE, 0, &a);
            }
            Line::DeleteChain(c) => {
                need_table()?;
                let mut a = Attrs::new();
                a.str(1, table).str(3, c);
                b.push(n, proto, msg::DELCHAIN, 0, &a);
            }
            Line::Append(c, r) | Line::Insert(c, r) => {
                need_table()?;
                let append = matches!(line, Line::Append(..));
                push_rule(b, &mut msg_buf, (proto, fam), n, (table, c), r, append)
                    .map_err(|e| apply_err(format!("line {n}: {e}: `{line}`")))?;
            }
        }
    }
    Ok(())
}

/// Adds rule `r` to (table, chain) as operation `n`: appended, or first in
/// the chain (`-I 1`). Its message is built in `a`, whatever `a` held.
fn push_rule(
    b: &mut Batch,
    a: &mut Attrs,
    (proto, fam): (u8, Family),
    n: usize,
    (table, chain): (&str, &str),
    r: &Rule,
    append: bool,
) -> Result<(), EncodeError> {
    a.clear();
    a.str(1, table).str(2, chain);
    let exprs = a.begin_nest(4);
    encode::encode_into(a, r, fam)?;
    a.end_nest(exprs);
    if let Some(p) = r.proto() {
        // NFTA_RULE_COMPAT: what nft_compat checks x_tables matches against
        // (`-m tcp` is only valid with `-p tcp`), as iptables-nft sends it.
        let c = a.begin_nest(5);
        a.u32be(1, p.number() as u32).u32be(2, 0);
        a.end_nest(c);
    }
    let flags = if append {
        NLM_F_CREATE | NLM_F_APPEND
    } else {
        // Without NLM_F_APPEND or a position the rule goes first.
        NLM_F_CREATE
    };
    b.push(n, proto, msg::NEWRULE, flags, a);
    Ok(())
}

/// The base chains iptables-nft creates for a builtin chain: (type, hook,
/// priority), from iptables' nft.c tables.
fn builtin(table: &str, chain: &str) -> Option<(&'static str, u32, i32)> {
    Some(match (table, chain) {
        ("filter", "INPUT") => ("filter", 1, 0),
        ("filter", "FORWARD") => ("filter", 2, 0),
        ("filter", "OUTPUT") => ("filter", 3, 0),
        ("nat", "PREROUTING") => ("nat", 0, -100),
        ("nat", "INPUT") => ("nat", 1, 100),
        ("nat", "OUTPUT") => ("nat", 3, -100),
        ("nat", "POSTROUTING") => ("nat", 4, 100),
        ("mangle", "PREROUTING") => ("filter", 0, -150),
        ("mangle", "INPUT") => ("filter", 1, -150),
        ("mangle", "FORWARD") => ("filter", 2, -150),
        ("mangle", "OUTPUT") => ("route", 3, -150),
        ("mangle", "POSTROUTING") => ("filter", 4, -150),
        _ => return None,
    })
}

/// Writes iptables rules over nf_tables netlink (the [`Writer`] of
/// iptables-nft, unless `--iptables-nft-restore` asks for the programs).
pub struct IptablesNetlink {
    family: IpFamily,
    sock: NftSocket,
    /// Tables and builtin chains seen or created; forgotten after a failed
    /// batch, so that a table deleted behind our back is made again.
    known: BTreeSet<(String, String)>,
    /// Every (table, chain) of the family as the last chain listing found
    /// them, until the next write: a full sync lists the chains and then
    /// restores, and adopting needs to know which chains exist (reading
    /// the rules of one that does not costs as much as of one that does).
    listing: Option<HashSet<(String, String)>>,
}

fn nfproto(f: IpFamily) -> u8 {
    match f {
        IpFamily::V4 => NFPROTO_IPV4,
        IpFamily::V6 => NFPROTO_IPV6,
    }
}

fn apply_err(message: String) -> DataplaneError {
    DataplaneError::Apply {
        tool: TOOL.into(),
        message,
    }
}

fn io_err(e: ExchangeError, what: &str) -> DataplaneError {
    DataplaneError::Io {
        what: format!("{what}: {}", e.step),
        source: e.source,
    }
}

/// A netlink string attribute without its NUL.
fn attr_str(b: &[u8]) -> String {
    String::from_utf8_lossy(b.strip_suffix(&[0]).unwrap_or(b)).into_owned()
}

/// `attrs` with NLA_F_NESTED cleared at every level: the kernel dumps
/// nests without the flag that we send.
fn without_nest_flags(attrs: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(attrs.len());
    let mut b = attrs;
    while b.len() >= 4 {
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let ty = u16::from_ne_bytes([b[2], b[3]]);
        if len < 4 || len > b.len() {
            break;
        }
        out.extend_from_slice(&b[..2]);
        out.extend_from_slice(&(ty & !NLA_F_NESTED).to_ne_bytes());
        if ty & NLA_F_NESTED != 0 {
            out.extend_from_slice(&without_nest_flags(&b[4..len]));
        } else {
            out.extend_from_slice(&b[4..len]);
        }
        let next = kp_netlink::align4(len).min(b.len());
        out.resize(out.len() + (next - len), 0);
        b = &b[next..];
    }
    out
}

/// The expressions of a rule's list, counters left out (their values are the
/// kernel's), each as its encoded bytes without nest flags: two rules are the
/// same rule when these are equal.
fn rule_identity(list: &[u8]) -> Vec<Vec<u8>> {
    ParsedAttrs::parse(list)
        .iter()
        .map(|(_, e)| e)
        .filter(|e| ParsedAttrs::parse(e).get(1) != Some(b"counter\0".as_slice()))
        .map(without_nest_flags)
        .collect()
}

impl IptablesNetlink {
    pub fn new(family: IpFamily) -> Self {
        IptablesNetlink {
            family,
            sock: NftSocket::new(),
            known: BTreeSet::new(),
            listing: None,
        }
    }

    fn fam(&self) -> Family {
        match self.family {
            IpFamily::V4 => Family::V4,
            IpFamily::V6 => Family::V6,
        }
    }

    fn query(
        &mut self,
        ty: u16,
        flags: u16,
        attrs: &Attrs,
        what: &str,
        until: Until,
    ) -> Result<Result<Vec<kp_netlink::Reply>, i32>, DataplaneError> {
        self.sock
            .query(nfproto(self.family), ty, flags, attrs, until)
            .map_err(|e| io_err(e, &format!("asking the kernel for {what}")))
    }

    /// Whether a table (`chain` empty) or chain exists, by one GET request.
    fn exists(&mut self, table: &str, chain: &str) -> Result<bool, DataplaneError> {
        let mut a = Attrs::new();
        a.str(1, table);
        let (ty, what) = if chain.is_empty() {
            (msg::GETTABLE, format!("table {table}"))
        } else {
            a.str(3, chain);
            (msg::GETCHAIN, format!("chain {chain} of table {table}"))
        };
        match self.query(ty, NLM_F_ACK, &a, &what, Until::Ack)? {
            Ok(_) => Ok(true),
            Err(libc::ENOENT) => Ok(false),
            Err(errno) => Err(apply_err(format!("getting {what}: {}", errno_text(errno)))),
        }
    }

    /// Adds the table (`chain` empty) or builtin chain to `batch` unless it
    /// is known to exist. Existing ones are never re-sent: an update could
    /// change another owner's policy or flags.
    fn ensure(
        &mut self,
        batch: &mut Batch,
        op: usize,
        table: &str,
        chain: &str,
    ) -> Result<(), DataplaneError> {
        let key = (table.to_string(), chain.to_string());
        if self.known.contains(&key) {
            return Ok(());
        }
        if !self.exists(table, chain)? {
            let mut a = Attrs::new();
            a.str(1, table);
            if chain.is_empty() {
                batch.push(op, nfproto(self.family), msg::NEWTABLE, NLM_F_CREATE, &a);
            } else if let Some((ty, hook, prio)) = builtin(table, chain) {
                // As iptables-nft makes it: policy accept.
                a.str(3, chain).str(7, ty).u32be(5, 1);
                let h = a.begin_nest(4);
                a.u32be(1, hook).u32be(2, prio as u32);
                a.end_nest(h);
                batch.push(op, nfproto(self.family), msg::NEWCHAIN, NLM_F_CREATE, &a);
            }
        }
        self.known.insert(key);
        Ok(())
    }

    /// The input as one batch: first the tables and builtin chains it
    /// needs and the kernel lacks, then its lines in order, a large input
    /// in two halves on two threads (the kernel waits for the batch).
    fn encode(&mut self, input: &Restore<'_>) -> Result<Batch, DataplaneError> {
        self.encode_split(input, SPLIT_AT_LINES)
    }

    /// [`Self::encode`], in halves from `split_at` lines.
    fn encode_split(
        &mut self,
        input: &Restore<'_>,
        split_at: usize,
    ) -> Result<Batch, DataplaneError> {
        let lines = &input.lines;
        let is_rule = |l: &Line<'_>| matches!(l, Line::Append(..) | Line::Insert(..));
        // Which tables and builtin chains the input uses; and where a second
        // half would start, by rules rather than lines (the chain
        // declarations come first and cost a fraction of a rule each), with
        // the table in force there.
        let mut needed: Vec<(usize, &str, &str)> = Vec::new();
        let mut seen: HashSet<(&str, &str)> = HashSet::new();
        let mut table = "";
        let (mut left, mut mid) = (lines.iter().filter(|l| is_rule(l)).count() / 2, None);
        for (i, line) in lines.iter().enumerate() {
            let want = match *line {
                Line::Table(t) => {
                    table = t;
                    Some((t, ""))
                }
                Line::Commit => {
                    table = "";
                    None
                }
                Line::Append(c, _) | Line::Insert(c, _) => {
                    left = left.saturating_sub(1);
                    (!table.is_empty() && builtin(table, c).is_some()).then_some((table, c))
                }
                Line::Chain(_) | Line::DeleteChain(_) => None,
            };
            if let Some(w) = want.filter(|w| seen.insert(*w)) {
                needed.push((i + 1, w.0, w.1));
            }
            if left == 0 && mid.is_none() {
                mid = Some((i + 1, table));
            }
        }
        // Every line is at most two messages.
        let seq0 = next_seq(lines.len() * 2 + needed.len() + 32);
        let mut head = Batch::new(seq0, lines.len() * 512 + 64);
        for (n, t, c) in needed {
            self.ensure(&mut head, n, t, c)?;
        }
        let (proto, fam) = (nfproto(self.family), self.fam());
        let two = lines.len() >= split_at
            && std::thread::available_parallelism().is_ok_and(|c| c.get() > 1);
        let Some((mid, table_at_mid)) = mid.filter(|_| two) else {
            encode_lines(&mut head, proto, fam, lines, 0, "")?;
            return Ok(head.finish());
        };
        // The second half's messages are numbered after every number the
        // first half can use.
        let seq1 = head.last_seq().wrapping_add((mid * 2) as u32);
        let rest = &lines[mid..];
        let ((), second) = kp_netlink::side_by_side(
            || encode_lines(&mut head, proto, fam, &lines[..mid], 0, ""),
            move || {
                let mut b = Batch::continuation(seq1, rest.len() * 512);
                encode_lines(&mut b, proto, fam, rest, mid, table_at_mid).map(|_| b)
            },
            // Encoding returns an error for bad input and does not panic;
            // should it, say where rather than take the process down.
            || {
                apply_err(format!(
                    "line {}: the encoder panicked on this half of the input",
                    mid + 1
                ))
            },
        )?;
        head.append(second);
        Ok(head.finish())
    }

    /// `input` encoded as one batch, for [`Self::send_encoded`] (the
    /// restore in two steps: benchmarks time the kernel's part alone).
    pub fn encode_input(&mut self, input: &Restore<'_>) -> Result<Batch, DataplaneError> {
        self.listing = None;
        self.encode(input).inspect_err(|_| self.known.clear())
    }

    /// Sends a batch [`Self::encode_input`] made of `input` (named in the
    /// errors): committed whole, or nothing is.
    pub fn send_encoded(
        &mut self,
        batch: &Batch,
        input: &Restore<'_>,
    ) -> Result<(), DataplaneError> {
        self.listing = None;
        if batch.is_empty() {
            return Ok(());
        }
        let answers = self.sock.send_batch(batch).map_err(|e| {
            self.known.clear();
            io_err(e, TOOL)
        })?;
        let line = |n: usize| {
            n.checked_sub(1)
                .and_then(|i| input.lines.get(i))
                .map(Line::to_string)
                .unwrap_or_default()
        };
        let mut errors: Vec<String> = refusals(batch, &answers)
            .into_iter()
            .map(|r| match r {
                Refusal::Commit(errno) => format!("commit failed: {}", errno_text(errno)),
                Refusal::Op(n, errno) => {
                    format!("line {n}: {}: `{}`", errno_text(errno), line(n))
                }
                Refusal::Foreign(seq, errno) => {
                    format!("message {seq} (not ours): {}", errno_text(errno))
                }
                Refusal::Unacknowledged { sent } => {
                    format!("the last of {sent} messages was not acknowledged; state unknown")
                }
            })
            .collect();
        if errors.is_empty() {
            tracing::debug!(
                messages = batch.len(),
                bytes = batch.bytes(),
                "iptables-nft batch applied"
            );
            return Ok(());
        }
        self.known.clear();
        errors.truncate(6);
        Err(apply_err(errors.join(" | ")))
    }

    /// The rules of one chain: (handle, expression list).
    fn chain_rules(&mut self, table: &str, chain: &str) -> Result<Vec<ChainRule>, DataplaneError> {
        Ok(
            dump_chain(&mut self.sock, nfproto(self.family), table, chain)?
                .iter()
                .filter_map(|r| {
                    let at = ParsedAttrs::parse(nft_attrs(&r.bytes));
                    let handle = u64::from_be_bytes(at.get(3)?.get(..8)?.try_into().ok()?);
                    Some((handle, at.get(4).unwrap_or(&[]).to_vec()))
                })
                .collect(),
        )
    }

    /// Every (table, chain) of the family: one dump (the kernel does not
    /// filter chains by table), names only.
    fn all_chains(&mut self) -> Result<HashSet<(String, String)>, DataplaneError> {
        let what = "the chains";
        let replies =
            match self.query(msg::GETCHAIN, NLM_F_DUMP, &Attrs::new(), what, Until::Done)? {
                Ok(r) => r,
                Err(libc::ENOENT) => return Ok(HashSet::new()),
                Err(errno) => {
                    return Err(apply_err(format!("listing {what}: {}", errno_text(errno))))
                }
            };
        let newchain = nft_type(msg::NEWCHAIN);
        Ok(replies
            .iter()
            .filter(|r| r.ty == newchain)
            .filter_map(|r| {
                let at = ParsedAttrs::parse(nft_attrs(&r.bytes));
                Some((attr_str(at.get(1)?), attr_str(at.get(3)?)))
            })
            .collect())
    }

    /// The rules of `chain` in order, each as its expressions without the
    /// counter: a read-back of exactly what the kernel holds, which tests
    /// compare with what `iptables-nft-restore` installs.
    pub fn rule_expressions(
        &mut self,
        table: &str,
        chain: &str,
    ) -> Result<Vec<Vec<Vec<u8>>>, DataplaneError> {
        Ok(self
            .chain_rules(table, chain)?
            .iter()
            .map(|(_, list)| rule_identity(list))
            .collect())
    }

    /// Handles of the rules of its chain that are `jump`.
    fn find_jump(&mut self, jump: &Jump) -> Result<Vec<u64>, DataplaneError> {
        let rules = self.chain_rules(jump.table, jump.from)?;
        self.matching(&rules, jump)
    }

    /// Handles of the rules among `rules` (a chain's, as read) that are `jump`.
    fn matching(&self, rules: &[ChainRule], jump: &Jump) -> Result<Vec<u64>, DataplaneError> {
        let enc = encode::encode(&Rule::jump(jump), self.fam())
            .map_err(|e| apply_err(format!("the jump to {}: {e}", jump.to)))?;
        let want = rule_identity(enc.as_bytes());
        Ok(rules
            .iter()
            .filter(|(_, list)| rule_identity(list) == want)
            .map(|(h, _)| *h)
            .collect())
    }
}

/// The rule messages of one chain (none when it is not there). One dump
/// per chain: the kernel finds the chain by its hash and walks only its
/// rules (a builtin chain holds a few); a dump of the whole table walks it
/// again for every 32 KiB of answer.
fn dump_chain(
    sock: &mut NftSocket,
    proto: u8,
    table: &str,
    chain: &str,
) -> Result<Vec<kp_netlink::Reply>, DataplaneError> {
    let mut a = Attrs::new();
    a.str(1, table).str(2, chain);
    let what = format!("the rules of {table} {chain}");
    let replies = match sock
        .query(proto, msg::GETRULE, NLM_F_DUMP, &a, Until::Done)
        .map_err(|e| io_err(e, &format!("asking the kernel for {what}")))?
    {
        Ok(r) => r,
        Err(libc::ENOENT) => return Ok(Vec::new()),
        Err(errno) => return Err(apply_err(format!("listing {what}: {}", errno_text(errno)))),
    };
    let newrule = nft_type(msg::NEWRULE);
    Ok(replies.into_iter().filter(|r| r.ty == newrule).collect())
}

impl Writer for IptablesNetlink {
    fn restore(&mut self, input: &Restore<'_>) -> Result<usize, DataplaneError> {
        let batch = self.encode_input(input)?;
        self.send_encoded(&batch, input)?;
        // Nothing is sent for an input without operations.
        Ok(if batch.is_empty() { 0 } else { batch.bytes() })
    }

    fn restore_adopting(
        &mut self,
        input: &Restore<'_>,
    ) -> Result<(usize, Option<Adopted>), DataplaneError> {
        let (rest, mut adopted) = self.adopt(input)?;
        adopted.bytes_sent = self.restore(&rest)?;
        Ok((adopted.bytes_sent, Some(adopted)))
    }

    fn chains(&mut self, table: &str) -> Result<Vec<String>, DataplaneError> {
        let all = self.all_chains()?;
        let names = all
            .iter()
            .filter(|(t, _)| t == table)
            .map(|(_, c)| c.clone())
            .collect();
        self.listing = Some(all);
        Ok(names)
    }

    fn survey(
        &mut self,
        table: &str,
        jumps: &[Jump],
    ) -> Result<(Vec<String>, Vec<Jump>), DataplaneError> {
        let chains = self.chains(table)?;
        Ok((chains, self.missing_jumps(table, jumps)?))
    }

    fn missing_jumps(&mut self, table: &str, jumps: &[Jump]) -> Result<Vec<Jump>, DataplaneError> {
        // Only the builtin chains the jumps live in are read, never the
        // chain list: a dump of every chain walks them all again for each
        // 32 KiB of answer (0.6 s at 10k Services); and each once, though
        // several jumps live in it (a dump costs ~7 ms at 10k Services).
        let mut read: Vec<(&str, Vec<ChainRule>)> = Vec::new();
        let mut missing = Vec::new();
        for j in jumps.iter().filter(|j| j.table == table) {
            let at = match read.iter().position(|(c, _)| *c == j.from) {
                Some(i) => i,
                None => {
                    read.push((j.from, self.chain_rules(table, j.from)?));
                    read.len() - 1
                }
            };
            if self.matching(&read[at].1, j)?.is_empty() {
                missing.push(j.clone());
            }
        }
        Ok(missing)
    }

    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, DataplaneError> {
        self.exists(table, chain)
    }

    fn jump_exists(&mut self, jump: &Jump) -> Result<bool, DataplaneError> {
        Ok(!self.find_jump(jump)?.is_empty())
    }

    fn delete_jump(&mut self, jump: &Jump) -> Result<(), DataplaneError> {
        self.listing = None;
        let (table, chain) = (jump.table, jump.from);
        // `iptables -D` deletes the first rule that is the jump.
        let Some(handle) = self.find_jump(jump)?.first().copied() else {
            return Err(apply_err(format!(
                "no jump to {} in chain {chain} of table {table}",
                jump.to
            )));
        };
        let mut b = Batch::new(next_seq(1), 256);
        let mut a = Attrs::new();
        a.str(1, table).str(2, chain).u64be(3, handle);
        b.push(1, nfproto(self.family), msg::DELRULE, 0, &a);
        let b = b.finish();
        let answers = self.sock.send_batch(&b).map_err(|e| io_err(e, TOOL))?;
        match refusals(&b, &answers).first() {
            None => Ok(()),
            Some(r) => Err(apply_err(format!(
                "deleting rule {handle} of {table} {chain}: {r:?}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a panic is its failure
    use super::*;

    /// A proxier the kernel is never asked about: its tables and builtin
    /// chains are taken as existing.
    fn offline() -> IptablesNetlink {
        let mut nl = IptablesNetlink::new(IpFamily::V4);
        for (t, c) in [
            ("filter", ""),
            ("nat", ""),
            ("filter", "INPUT"),
            ("nat", "PREROUTING"),
            ("nat", "OUTPUT"),
        ] {
            nl.known.insert((t.into(), c.into()));
        }
        nl
    }

    /// The chains and rules of [`input`]: `services` Service chains, each
    /// with a rule in KUBE-SERVICES and one of its own.
    fn rules(services: usize) -> (Vec<String>, Vec<Rule>) {
        use crate::types::{Addr, Match, Target, CT_INVALID};
        let names: Vec<String> = (0..services).map(|i| format!("KUBE-SVC-{i:06}")).collect();
        let to = |c: &str| Target::Jump(c.to_string());
        let mut rules = vec![
            Rule::new(
                vec![Match::CtState {
                    negate: false,
                    states: CT_INVALID,
                }],
                Target::Drop,
            ),
            Rule::new(Vec::new(), to("KUBE-FIREWALL")),
            Rule::new(Vec::new(), to("KUBE-SERVICES")),
        ];
        for (i, name) in names.iter().enumerate() {
            let ip = std::net::Ipv4Addr::from(0x0a60_0000u32 + i as u32);
            let port = |dst: Option<Addr>, dport| Match::Ports {
                proto: kp_model::Protocol::Tcp,
                dst,
                dport,
            };
            let dst = Addr::new(false, std::net::IpAddr::V4(ip).into());
            rules.push(Rule::new(vec![port(Some(dst), Some(80))], to(name)));
            rules.push(Rule::new(
                vec![port(None, None)],
                Target::Dnat("10.1.0.1:8080".parse().unwrap()),
            ));
        }
        (names, rules)
    }

    /// Two tables; the nat one's Service chains take most lines, so the
    /// halves meet inside it.
    fn input<'a>(names: &'a [String], rules: &'a [Rule]) -> Restore<'a> {
        let mut r = Restore::default();
        for l in [
            Line::Table("filter"),
            Line::Chain("KUBE-FIREWALL"),
            Line::Append("KUBE-FIREWALL", &rules[0]),
            Line::Insert("INPUT", &rules[1]),
            Line::Commit,
            Line::Table("nat"),
            Line::Chain("KUBE-SERVICES"),
        ] {
            r.push(l);
        }
        for n in names {
            r.push(Line::Chain(n));
        }
        r.push(Line::Insert("PREROUTING", &rules[2]));
        r.push(Line::Insert("OUTPUT", &rules[2]));
        for (n, pair) in names.iter().zip(rules[3..].chunks(2)) {
            r.push(Line::Append("KUBE-SERVICES", &pair[0]));
            r.push(Line::Append(n, &pair[1]));
        }
        r.push(Line::Commit);
        r
    }

    /// Every message with its sequence number zeroed, and the line of each.
    fn messages(b: &Batch) -> (Vec<u8>, Vec<usize>) {
        let mut out = Vec::new();
        for piece in b.pieces() {
            let mut p = piece.as_slice();
            while p.len() >= 16 {
                let len = u32::from_ne_bytes([p[0], p[1], p[2], p[3]]) as usize;
                let mut m = p[..len].to_vec();
                m[8..12].fill(0);
                out.extend(m);
                p = &p[kp_netlink::align4(len).min(p.len())..];
            }
        }
        (out, b.ops.iter().map(|(_, line)| *line).collect())
    }

    #[test]
    fn halves_encode_what_one_pass_does() {
        let (names, rules) = rules(300);
        let input = input(&names, &rules);
        let one = offline().encode_split(&input, usize::MAX).unwrap();
        let two = offline().encode_split(&input, 0).unwrap();
        assert!(one.len() > 900);
        assert_eq!(messages(&one), messages(&two));
        // Numbers rise through the batch: the kernel's answers are told
        // apart by them.
        let seqs: Vec<u32> = two.ops.iter().map(|(s, _)| *s).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
        assert!(seqs.last().unwrap() < &two.last_seq());
    }

    #[test]
    fn an_error_in_either_half_names_its_line() {
        let (names, rules) = rules(300);
        let input = input(&names, &rules);
        // An IPv6 source in an IPv4 table: refused by the encoder.
        let v6 = Rule::new(
            vec![crate::types::Match::src_host("fd00::1".parse().unwrap())],
            crate::types::Target::Drop,
        );
        let n = input.lines.len();
        for bad in [5, n / 2 + 1, n - 3] {
            let mut broken = input.clone();
            broken.lines[bad - 1] = Line::Append("KUBE-SERVICES", &v6);
            let e = match offline().encode_split(&broken, 0) {
                Ok(_) => panic!("line {bad} was accepted"),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(&format!("line {bad}:")), "{e}");
            assert!(e.contains("fd00::1/128"), "{e}");
        }
    }
}
