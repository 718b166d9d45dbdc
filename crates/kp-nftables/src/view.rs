//! Our table as the kernel holds it, seen through a backend that can read
//! it back (netlink: `netlink/readback.rs`), for a restart to adopt what is
//! already right. Its own room so that the proxier and the backends meet
//! here without importing each other.

use crate::types::{ElemKey, ElemValue, Rule};

/// Where one selection rule of a chain points into the endpoint maps, as
/// the kernel holds it: the map, and the offset and modulus of the numgen
/// or hash just before the lookup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotRef {
    pub map: String,
    pub offset: u32,
    pub modulus: u32,
}

/// How a chain the proxier wants compares with the kernel's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainState {
    /// No such chain in the kernel.
    Missing,
    /// The kernel's rules are the ones we would write.
    Same,
    /// The chain exists with other rules (or ones we cannot compare).
    Differs,
}

/// The changes that make a set hold what we want ([`TableView::set_changes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SetChanges {
    /// Indexes of the wanted elements to add.
    pub add: Vec<usize>,
    /// Indexes of the wanted elements whose key is held with another
    /// value: deleted, then added.
    pub replace: Vec<usize>,
    /// Keys held that we do not want.
    pub delete: Vec<ElemKey>,
}

impl SetChanges {
    pub fn is_empty(&self) -> bool {
        self.add.is_empty() && self.replace.is_empty() && self.delete.is_empty()
    }
}

/// Our table as read back: what a restart compares its first sync with.
pub trait TableView {
    /// The table's comment, which names the layout that made it.
    fn comment(&self) -> Option<&str>;
    fn chain_names(&self) -> Vec<&str>;
    /// Named sets and maps (not the rules' anonymous ones).
    fn set_names(&self) -> Vec<&str>;
    fn has_set(&self, name: &str) -> bool;
    /// Rules and elements read.
    fn counts(&self) -> (usize, usize);
    /// Where chain `name`'s rules point into the endpoint maps, in order.
    fn slot_refs(&self, name: &str) -> &[SlotRef];
    /// Whether the kernel's chain `name` holds exactly `rules`.
    fn chain_state(&self, name: &str, rules: &[Rule]) -> ChainState;
    /// What makes set `name` hold exactly `elems`; None when the set was
    /// not read or holds a key that cannot be named (then it is flushed
    /// and refilled).
    fn set_changes(
        &self,
        name: &str,
        elems: &mut dyn Iterator<Item = (&ElemKey, Option<&ElemValue>)>,
    ) -> Option<SetChanges>;
    /// Whether set `name` holds element `key` with `value`.
    fn has_element(&self, name: &str, key: &ElemKey, value: Option<&ElemValue>) -> bool;
}
