//! Which endpoint sits in which slot. Slots stay put across changes, so one
//! endpoint replaced is one slot rewritten, not the whole list: an endpoint
//! that stays keeps its slot, a new one takes the first free slot, and when
//! the list shrinks the endpoints beyond the new end move into the holes.

use std::collections::BTreeSet;

/// The new slot list for `wanted` given the `old` one.
pub fn assign<T: Ord + Copy>(old: &[T], wanted: &BTreeSet<T>) -> Vec<T> {
    // The common cases first: nothing before (a new Service port), and the
    // same endpoints as before (a full sync over what is already there).
    if old.is_empty() {
        return wanted.iter().copied().collect();
    }
    if old.len() == wanted.len() && old.iter().all(|b| wanted.contains(b)) {
        let mut seen: Vec<T> = old.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() == old.len() {
            return old.to_vec();
        }
    }
    let mut slots: Vec<Option<T>> = old
        .iter()
        .map(|b| wanted.contains(b).then_some(*b))
        .collect();
    let kept: BTreeSet<T> = slots.iter().flatten().copied().collect();
    let mut fresh = wanted.iter().filter(|b| !kept.contains(b)).copied();
    for slot in slots.iter_mut() {
        if slot.is_none() {
            *slot = fresh.next();
        }
    }
    slots.extend(fresh.map(Some));
    // Exactly as many endpoints sit at or beyond the new end as there are
    // holes before it: move them in, last first.
    let n = wanted.len();
    let mut movers: Vec<T> = slots.drain(n.min(slots.len())..).flatten().collect();
    for slot in slots.iter_mut() {
        if slot.is_none() {
            *slot = movers.pop();
        }
    }
    slots.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[u32]) -> BTreeSet<u32> {
        v.iter().copied().collect()
    }

    #[test]
    fn a_replaced_endpoint_takes_the_freed_slot() {
        assert_eq!(assign(&[1, 2, 3], &set(&[1, 3, 9])), vec![1, 9, 3]);
    }

    #[test]
    fn new_endpoints_append() {
        assert_eq!(assign(&[5, 1], &set(&[1, 5, 7, 8])), vec![5, 1, 7, 8]);
        assert_eq!(assign(&[], &set(&[3, 1])), vec![1, 3]);
    }

    #[test]
    fn a_shrinking_list_fills_its_holes_from_the_end() {
        assert_eq!(assign(&[1, 2, 3, 4, 5], &set(&[1, 4, 5])), vec![1, 5, 4]);
        assert_eq!(assign(&[1, 2, 3], &set(&[3])), vec![3]);
        assert_eq!(assign(&[1, 2, 3], &set(&[])), Vec::<u32>::new());
    }

    #[test]
    fn every_wanted_endpoint_appears_once_and_kept_ones_below_the_end_stay() {
        // Exhaustive over small cases: the result is a permutation of
        // `wanted`, and an endpoint kept at a slot below the new length does
        // not move (its UDP flows and slot writes are untouched).
        let universe = [1u32, 2, 3, 4, 5];
        for old_mask in 0u32..32 {
            let old: Vec<u32> = universe
                .iter()
                .enumerate()
                .filter(|(i, _)| old_mask & (1 << i) != 0)
                .map(|(_, v)| *v)
                .rev()
                .collect();
            for new_mask in 0u32..32 {
                let wanted: BTreeSet<u32> = universe
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| new_mask & (1 << i) != 0)
                    .map(|(_, v)| *v)
                    .collect();
                let got = assign(&old, &wanted);
                assert_eq!(got.iter().copied().collect::<BTreeSet<_>>(), wanted);
                assert_eq!(got.len(), wanted.len());
                for (i, b) in old.iter().enumerate() {
                    if i < wanted.len() && wanted.contains(b) {
                        assert_eq!(got[i], *b, "old {old:?} wanted {wanted:?}");
                    }
                }
            }
        }
    }
}
