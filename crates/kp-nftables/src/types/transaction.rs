//! Operations and the transaction that holds them, and the transaction as
//! the nft script `nft -f` applies and --dry-run prints.

use std::fmt::{self, Display, Formatter};

use kp_model::IpFamily;

use super::expr::Rule;
use super::object::{ChainType, NumgenValue, Object, SetType, DYNAMIC_SET_SIZE};
use super::text::{clean, family_kw};

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
                    SetType::Select(p) => {
                        let p = p.as_lower();
                        write!(
                            f,
                            " {{ typeof {fam} daddr . {p} dport . numgen random mod 1 : {fam} daddr . {p} dport ; }}"
                        )
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
