//! One nftables transaction as typed objects (after sigs.k8s.io/knftables'
//! types.go and transaction.go): what the renderer builds, what the netlink
//! backend encodes directly and what `nft -f` / --dry-run get as text through
//! [`Transaction`]'s `Display`. Nothing on the sync path writes nft syntax
//! only to parse it back.
//!
//! The vocabulary is the proxier's, not all of nftables: every statement here
//! is one the layout in docs/nftables.md uses, with the spelling `nft -f`
//! accepts and `nft list` prints back.
//!
//! In four rooms, each using only the ones before it: `elem` what sets and
//! maps hold, `expr` rules, `object` what an operation acts on,
//! `transaction` the operations and their script; `text` is the spelling
//! they share. Everything is re-exported here, the path the rest of the
//! crate and other crates use.

mod elem;
mod expr;
mod object;
mod text;
mod transaction;

pub use elem::{DnatTarget, ElemKey, ElemValue, MapName, PickKey, Verdict, PICK_SHARDS};
pub use expr::{Addr, AddrValue, CtState, Expr, KeyField, MarkOp, Rule, Slots};
pub use object::{
    BaseChain, Chain, ChainType, DType, Hook, NumgenValue, Object, Set, SetType, DYNAMIC_SET_SIZE,
};
pub use text::{clean, family_kw, quote};
pub use transaction::{Op, Transaction, Verb};
