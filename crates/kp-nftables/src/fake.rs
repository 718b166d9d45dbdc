//! An nftables kernel in memory, for tests (after sigs.k8s.io/knftables'
//! `Fake`): it applies [`Transaction`]s with the kernel's semantics for the
//! verbs and objects this crate sends, all of a transaction or none of it,
//! and shows what it holds as canonical text, so that tests can drive the
//! proxier and compare states without a kernel, root or a namespace. No I/O.
//!
//! What it checks, as nf_tables does: `create` of an object that exists and
//! `delete` or `flush` of one that does not fail; every operation needs its
//! table; a rule needs its chain and every chain and set it names; a map
//! element's verdict needs its chain; adding a map key that holds another
//! value fails; a chain or set still named by a rule (or, for a chain, by a
//! map element's verdict) cannot be deleted (EBUSY); deleting a chain
//! deletes its rules with it, deleting the table everything in it.
//! Refusals name the operation's line and the object, as the netlink
//! backend's do.

use std::collections::BTreeMap;
use std::fmt::{self, Display, Formatter};
use std::sync::{Arc, Mutex, MutexGuard};

use kp_model::{DataplaneError, IpFamily, RefusedOp};
use kp_netlink::nftables::errno_text;

use crate::backend::{shorten, NftBackend};
use crate::types::{
    BaseChain, Chain, ElemKey, ElemValue, Expr, Object, Op, Rule, Set, Transaction, Verb, Verdict,
};

const TOOL: &str = "nftables fake";

/// The in-memory kernel. Clones share one state: hand one to the proxier
/// (`Box::new(fake.clone())`) and look at the state through another.
#[derive(Clone, Debug, Default)]
pub struct Fake {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    state: FakeState,
    applied: usize,
}

/// Every table the fake holds, by family and name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FakeState {
    pub tables: BTreeMap<(IpFamily, String), FakeTable>,
}

/// One table: its chains and sets by name (nothing in the kernel's
/// behaviour depends on the order they were made in).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FakeTable {
    pub comment: Option<String>,
    pub chains: BTreeMap<String, FakeChain>,
    pub sets: BTreeMap<String, FakeSet>,
}

/// A chain: its hook if it is a base chain, its rules in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeChain {
    pub base: Option<BaseChain>,
    pub rules: Vec<Rule>,
}

/// A set or map: its declaration and its elements (value None in a set).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeSet {
    pub decl: Set,
    pub elements: BTreeMap<ElemKey, Option<ElemValue>>,
}

impl Fake {
    pub fn new() -> Fake {
        Fake::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A test that panicked while holding the lock left a whole state
        // behind (states are replaced whole): keep using it.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of everything the fake holds.
    pub fn state(&self) -> FakeState {
        self.lock().state.clone()
    }

    /// A copy of one table, if it exists.
    pub fn table(&self, family: IpFamily, name: &str) -> Option<FakeTable> {
        self.lock()
            .state
            .tables
            .get(&(family, name.to_string()))
            .cloned()
    }

    /// The whole state as canonical text (see [`FakeState`]'s `Display`).
    pub fn dump(&self) -> String {
        self.lock().state.to_string()
    }

    /// How many transactions applied (refused ones not counted).
    pub fn applied(&self) -> usize {
        self.lock().applied
    }
}

impl NftBackend for Fake {
    fn apply(&mut self, tx: &Transaction) -> Result<usize, DataplaneError> {
        let mut inner = self.lock();
        // Applied to a copy, which replaces the state only when every
        // operation went through: all or nothing, as one nf_tables batch.
        let mut next = inner.state.clone();
        for (i, op) in tx.ops.iter().enumerate() {
            if let Err(reason) = next.apply_op(tx.family, &tx.table, op) {
                return Err(DataplaneError::Refused {
                    tool: TOOL.into(),
                    refused: vec![RefusedOp {
                        line: i + 1,
                        reason,
                        owner: None,
                        text: Some(shorten(&tx.op_text(i))),
                    }],
                });
            }
        }
        inner.state = next;
        inner.applied += 1;
        Ok(tx.to_string().len())
    }

    fn table_exists(&mut self, family: IpFamily, table: &str) -> Result<bool, DataplaneError> {
        Ok(self
            .lock()
            .state
            .tables
            .contains_key(&(family, table.to_string())))
    }

    fn chain_has_rules(
        &mut self,
        family: IpFamily,
        table: &str,
        chain: &str,
    ) -> Result<bool, DataplaneError> {
        Ok(self
            .lock()
            .state
            .tables
            .get(&(family, table.to_string()))
            .and_then(|t| t.chains.get(chain))
            .is_some_and(|c| !c.rules.is_empty()))
    }

    fn affinity_records(
        &mut self,
        family: IpFamily,
        table: &str,
        set: &str,
    ) -> Result<Vec<ElemKey>, DataplaneError> {
        let inner = self.lock();
        let set = inner
            .state
            .tables
            .get(&(family, table.to_string()))
            .and_then(|t| t.sets.get(set));
        Ok(set
            .map(|s| {
                s.elements
                    .keys()
                    .filter(|k| matches!(k, ElemKey::Affinity { .. }))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default())
    }
}

/// Why an operation was refused: the errno's text, as the netlink backend
/// reports it, and the object.
fn refusal(errno: i32, what: impl Display) -> String {
    format!("{}: {what}", errno_text(errno))
}

/// The chain a verdict sends packets to, if any.
fn verdict_chain(v: &Verdict) -> Option<&str> {
    match v {
        Verdict::Goto(c) | Verdict::Jump(c) => Some(c),
        Verdict::Drop | Verdict::Return => None,
    }
}

/// The chains `rule` jumps or goes to.
fn rule_chains(rule: &Rule) -> impl Iterator<Item = &str> {
    rule.exprs.iter().filter_map(|e| match e {
        Expr::Verdict(v) => verdict_chain(v),
        _ => None,
    })
}

/// The named sets and maps `rule` uses (anonymous `{ a, b }` sets belong to
/// the rule). Every kind of expression is listed, so that a new one must
/// say what it names.
fn rule_sets(rule: &Rule) -> Vec<String> {
    let mut out = Vec::new();
    for e in &rule.exprs {
        match e {
            Expr::Lookup { set, .. } => out.push(set.clone()),
            Expr::Vmap { map, .. } => out.push(map.clone()),
            Expr::AffinityHit { records, slots, .. } => {
                out.push(records.to_string());
                out.push(slots.map.to_string());
            }
            Expr::AffinityRecord { records, .. } => out.push(records.to_string()),
            Expr::HashDnat { slots, .. } | Expr::NumgenDnat { slots, .. } => {
                out.push(slots.map.to_string())
            }
            Expr::PickDnat { map, .. } => out.push(map.to_string()),
            Expr::Ct(_)
            | Expr::AddrMatch { .. }
            | Expr::L4Proto(_)
            | Expr::Iifname { .. }
            | Expr::FibLocal(_)
            | Expr::MarkMatch { .. }
            | Expr::MarkSet(..)
            | Expr::Dnat(_)
            | Expr::Masquerade { .. }
            | Expr::Reject
            | Expr::Verdict(_) => {}
        }
    }
    out
}

impl FakeTable {
    /// Who still names chain `name`: a rule of another chain, or an
    /// element of a verdict map.
    fn chain_user(&self, name: &str) -> Option<String> {
        for (c, chain) in &self.chains {
            if c != name
                && chain
                    .rules
                    .iter()
                    .any(|r| rule_chains(r).any(|t| t == name))
            {
                return Some(format!("a rule of chain {c}"));
            }
        }
        for (s, set) in &self.sets {
            let named = set.elements.values().flatten().any(|v| match v {
                ElemValue::Verdict(v) => verdict_chain(v) == Some(name),
                ElemValue::Endpoint(_) => false,
            });
            if named {
                return Some(format!("an element of map {s}"));
            }
        }
        None
    }

    /// Which chain's rule still names set `name`.
    fn set_user(&self, name: &str) -> Option<&str> {
        self.chains
            .iter()
            .find(|(_, c)| {
                c.rules
                    .iter()
                    .any(|r| rule_sets(r).iter().any(|s| s == name))
            })
            .map(|(c, _)| c.as_str())
    }

    /// Checks that a jump or goto to `target` can be made.
    fn check_target(&self, target: &str, by: &str) -> Result<(), String> {
        match self.chains.get(target) {
            None => Err(refusal(
                libc::ENOENT,
                format_args!("chain {target} ({by} sends packets there)"),
            )),
            Some(c) if c.base.is_some() => Err(refusal(
                libc::EOPNOTSUPP,
                format_args!("chain {target} is a base chain ({by} sends packets there)"),
            )),
            Some(_) => Ok(()),
        }
    }

    fn add_chain(&mut self, c: &Chain, verb: Verb) -> Result<(), String> {
        match self.chains.get(&c.name) {
            Some(_) if verb == Verb::Create => {
                Err(refusal(libc::EEXIST, format_args!("chain {}", c.name)))
            }
            // `add` of an existing chain keeps it; a hook it does not have
            // cannot be given to it.
            Some(old) if c.base.is_some() && old.base != c.base => Err(refusal(
                libc::EEXIST,
                format_args!("chain {} exists with another hook", c.name),
            )),
            Some(_) => Ok(()),
            None => {
                self.chains.insert(
                    c.name.clone(),
                    FakeChain {
                        base: c.base,
                        rules: Vec::new(),
                    },
                );
                Ok(())
            }
        }
    }

    fn add_rule(&mut self, chain: &str, rule: &Rule) -> Result<(), String> {
        if !self.chains.contains_key(chain) {
            return Err(refusal(libc::ENOENT, format_args!("chain {chain}")));
        }
        let by = format!("a rule of chain {chain}");
        for target in rule_chains(rule) {
            self.check_target(target, &by)?;
        }
        for set in rule_sets(rule) {
            if !self.sets.contains_key(&set) {
                return Err(refusal(
                    libc::ENOENT,
                    format_args!("set {set} (named by {by})"),
                ));
            }
        }
        if let Some(c) = self.chains.get_mut(chain) {
            c.rules.push(rule.clone());
        }
        Ok(())
    }

    fn add_set(&mut self, s: &Set, verb: Verb) -> Result<(), String> {
        match self.sets.get(&s.name) {
            Some(_) if verb == Verb::Create => {
                Err(refusal(libc::EEXIST, format_args!("set {}", s.name)))
            }
            Some(old) if old.decl != *s => Err(refusal(
                libc::EEXIST,
                format_args!("set {} exists with another declaration", s.name),
            )),
            Some(_) => Ok(()),
            None => {
                self.sets.insert(
                    s.name.clone(),
                    FakeSet {
                        decl: s.clone(),
                        elements: BTreeMap::new(),
                    },
                );
                Ok(())
            }
        }
    }

    fn elements(
        &mut self,
        set: &str,
        elems: &[(ElemKey, Option<ElemValue>)],
        verb: Verb,
    ) -> Result<(), String> {
        if elems.is_empty() {
            return Err(refusal(
                libc::EINVAL,
                format_args!("no elements for set {set}"),
            ));
        }
        if verb == Verb::Flush {
            return Err(refusal(
                libc::EINVAL,
                format_args!("elements of {set} cannot be flushed (the set is)"),
            ));
        }
        let Some(s) = self.sets.get(set) else {
            return Err(refusal(libc::ENOENT, format_args!("set {set}")));
        };
        if verb != Verb::Delete {
            let is_map = s.decl.is_map();
            for (k, v) in elems {
                if v.is_some() != is_map {
                    let what = if is_map { "map" } else { "set" };
                    return Err(refusal(
                        libc::EINVAL,
                        format_args!("element {k} does not fit {what} {set}"),
                    ));
                }
                if let Some(ElemValue::Verdict(v)) = v {
                    if let Some(target) = verdict_chain(v) {
                        self.check_target(target, &format!("element {k} of map {set}"))?;
                    }
                }
            }
        }
        let Some(s) = self.sets.get_mut(set) else {
            return Err(refusal(libc::ENOENT, format_args!("set {set}")));
        };
        for (k, v) in elems {
            match verb {
                Verb::Delete => {
                    if s.elements.remove(k).is_none() {
                        return Err(refusal(
                            libc::ENOENT,
                            format_args!("element {k} of set {set}"),
                        ));
                    }
                }
                _ => match s.elements.get(k) {
                    Some(_) if verb == Verb::Create => {
                        return Err(refusal(
                            libc::EEXIST,
                            format_args!("element {k} of set {set}"),
                        ))
                    }
                    Some(old) if old != v => {
                        let old = old.as_ref().map(|o| o.to_string()).unwrap_or_default();
                        return Err(refusal(
                            libc::EEXIST,
                            format_args!("element {k} of map {set} maps to {old}"),
                        ));
                    }
                    Some(_) => {}
                    None => {
                        s.elements.insert(k.clone(), v.clone());
                    }
                },
            }
        }
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        let verb = op.verb;
        match (&op.object, verb) {
            (Object::Table { .. }, _) => Err(refusal(
                libc::EINVAL,
                "a table operation reached its table's objects",
            )),
            (Object::Chain(c), Verb::Add | Verb::Create) => self.add_chain(c, verb),
            (Object::Chain(c), Verb::Delete) => {
                if !self.chains.contains_key(&c.name) {
                    return Err(refusal(libc::ENOENT, format_args!("chain {}", c.name)));
                }
                if let Some(user) = self.chain_user(&c.name) {
                    return Err(refusal(
                        libc::EBUSY,
                        format_args!("chain {} is still used by {user}", c.name),
                    ));
                }
                self.chains.remove(&c.name);
                Ok(())
            }
            (Object::Chain(c), Verb::Flush) => match self.chains.get_mut(&c.name) {
                Some(chain) => {
                    chain.rules.clear();
                    Ok(())
                }
                None => Err(refusal(libc::ENOENT, format_args!("chain {}", c.name))),
            },
            (Object::Rule { chain, rule }, Verb::Add | Verb::Create) => self.add_rule(chain, rule),
            (Object::Rule { chain, .. }, Verb::Delete | Verb::Flush) => Err(refusal(
                libc::EINVAL,
                format_args!("a rule of chain {chain} can only be added (the chain is flushed)"),
            )),
            (Object::Set(s), Verb::Add | Verb::Create) => self.add_set(s, verb),
            (Object::Set(s), Verb::Delete) => {
                if !self.sets.contains_key(&s.name) {
                    return Err(refusal(libc::ENOENT, format_args!("set {}", s.name)));
                }
                if let Some(user) = self.set_user(&s.name) {
                    return Err(refusal(
                        libc::EBUSY,
                        format_args!("set {} is still used by a rule of chain {user}", s.name),
                    ));
                }
                self.sets.remove(&s.name);
                Ok(())
            }
            (Object::Set(s), Verb::Flush) => match self.sets.get_mut(&s.name) {
                Some(set) => {
                    set.elements.clear();
                    Ok(())
                }
                None => Err(refusal(libc::ENOENT, format_args!("set {}", s.name))),
            },
            (Object::Elements { set, elems }, _) => self.elements(&set.to_string(), elems, verb),
        }
    }
}

impl FakeState {
    fn apply_op(&mut self, family: IpFamily, table: &str, op: &Op) -> Result<(), String> {
        let key = (family, table.to_string());
        let name = || format!("table {} {table}", crate::types::family_kw(family));
        match (&op.object, op.verb) {
            (Object::Table { comment }, Verb::Add | Verb::Create) => {
                match self.tables.get(&key) {
                    Some(_) if op.verb == Verb::Create => Err(refusal(libc::EEXIST, name())),
                    // `add` of an existing table keeps it as it is.
                    Some(_) => Ok(()),
                    None => {
                        let t = FakeTable {
                            comment: comment.as_ref().map(|c| c.to_string()),
                            ..FakeTable::default()
                        };
                        self.tables.insert(key, t);
                        Ok(())
                    }
                }
            }
            (Object::Table { .. }, Verb::Delete) => match self.tables.remove(&key) {
                Some(_) => Ok(()),
                None => Err(refusal(libc::ENOENT, name())),
            },
            // Every rule of every chain; chains and sets stay.
            (Object::Table { .. }, Verb::Flush) => match self.tables.get_mut(&key) {
                Some(t) => {
                    t.chains.values_mut().for_each(|c| c.rules.clear());
                    Ok(())
                }
                None => Err(refusal(libc::ENOENT, name())),
            },
            _ => match self.tables.get_mut(&key) {
                Some(t) => t.apply(op),
                None => Err(refusal(libc::ENOENT, name())),
            },
        }
    }
}

/// The declaration of `object` as nft writes it (`chain ip t c { … }`).
fn declaration(family: IpFamily, table: &str, object: Object) -> String {
    let mut tx = Transaction::new(family, table);
    tx.add(object);
    let text = tx.op_text(0);
    text.strip_prefix("add ").unwrap_or(&text).to_string()
}

/// Canonical text of the whole state, one fact a line: tables, chains and
/// sets by name, each chain's rules in their order (which matters), each
/// set's elements sorted (their order does not). Two states that hold the
/// same show the same text, whatever order they were built in.
impl Display for FakeState {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        for ((family, name), t) in &self.tables {
            let comment = t.comment.clone().map(Into::into);
            writeln!(
                f,
                "{}",
                declaration(*family, name, Object::Table { comment })
            )?;
            for (c, chain) in &t.chains {
                let decl = Object::Chain(Chain {
                    name: c.clone(),
                    base: chain.base,
                });
                writeln!(f, "{}", declaration(*family, name, decl))?;
                for (k, r) in chain.rules.iter().enumerate() {
                    writeln!(f, "\t{c} #{k}: {}", r.display(*family))?;
                }
            }
            for (s, set) in &t.sets {
                writeln!(
                    f,
                    "{}",
                    declaration(*family, name, Object::Set(set.decl.clone()))
                )?;
                for (k, v) in &set.elements {
                    match v {
                        Some(v) => writeln!(f, "\t{s} element {k} : {v}")?,
                        None => writeln!(f, "\t{s} element {k}")?,
                    }
                }
            }
        }
        Ok(())
    }
}
