//! Where each Service's endpoints sit in the shared endpoint maps: slot
//! ranges handed out per map shard, reused when freed, and the selection
//! rules pointed at them.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::render::{MapName, Pool, PoolKind, ServiceObjects};
use crate::types::Expr;

/// Pools (selection rules) one endpoint-map shard serves. The kernel checks
/// each new element against every rule bound to its map, so this bounds the
/// cost of an element; more shards cost a little on set-name lookups.
const POOLS_PER_SHARD: u32 = 64;

#[derive(Default)]
pub(super) struct Shard {
    next: u32,
    /// Freed ranges by size.
    free: HashMap<u32, Vec<u32>>,
    pools: u32,
    /// Ranges taken over from the kernel at a restart: base -> size.
    adopted: BTreeMap<u32, u32>,
}

/// Hands out slot ranges of the shared endpoint maps. Ranges are powers of
/// two, so a freed range fits the next Service of that size class and the
/// maps stay dense without moving anyone.
#[derive(Default)]
pub(super) struct Slots {
    pub(super) shards: HashMap<MapName, Shard>,
    /// Shard numbers per kind that can take another pool.
    room: HashMap<PoolKind, BTreeSet<u32>>,
    /// Shards made so far per kind.
    count: HashMap<PoolKind, u32>,
    /// Shard maps declared in the kernel (they stay until the table goes).
    pub(super) declared: BTreeSet<MapName>,
}

impl Slots {
    pub(super) fn alloc(&mut self, kind: PoolKind, cap: u32) -> (MapName, u32) {
        let room = self.room.entry(kind).or_default();
        let k = match room.first() {
            Some(k) => *k,
            None => {
                let c = self.count.entry(kind).or_default();
                let k = *c;
                *c += 1;
                room.insert(k);
                k
            }
        };
        let map = kind.shard(k);
        let sh = self.shards.entry(map).or_default();
        sh.pools += 1;
        if sh.pools >= POOLS_PER_SHARD {
            room.remove(&k);
        }
        if let Some(base) = sh.free.get_mut(&cap).and_then(Vec::pop) {
            return (map, base);
        }
        // Aligned to the size. The affinity rules needed it while they
        // added the base to an index with XOR; they now add it in the hash
        // (offset), so the alignment only keeps the layout as it was.
        let base = sh.next.div_ceil(cap).saturating_mul(cap);
        sh.next = base.saturating_add(cap);
        (map, base)
    }

    pub(super) fn release(&mut self, p: &Pool) {
        if let Some(sh) = self.shards.get_mut(&p.map) {
            sh.free.entry(p.cap).or_default().push(p.base);
            sh.pools = sh.pools.saturating_sub(1);
            if let MapName::Endpoints(_, k) = p.map {
                self.room.entry(p.kind).or_default().insert(k);
            }
        }
    }

    /// Gives `new`'s pools their slots (keeping `old`'s range when the size
    /// still fits, so an endpoint change is only element updates) and fills in
    /// the selection rules' maps and offsets.
    pub(super) fn assign(&mut self, new: &mut ServiceObjects, old: Option<&ServiceObjects>) {
        let old_pools = old.map(|o| o.pools.as_slice()).unwrap_or_default();
        let mut kept = vec![false; old_pools.len()];
        for (i, pool) in new.pools.iter_mut().enumerate() {
            let n = pool.values.len() as u32;
            let want = n.next_power_of_two();
            match old_pools.get(i) {
                Some(op) if op.kind == pool.kind && n <= op.cap && op.cap <= want * 4 => {
                    kept[i] = true;
                    pool.map = op.map;
                    pool.base = op.base;
                    pool.cap = op.cap;
                }
                _ => {
                    (pool.map, pool.base) = self.alloc(pool.kind, want);
                    pool.cap = want;
                }
            }
        }
        point_rules(new);
        for (op, k) in old_pools.iter().zip(kept) {
            if !k {
                self.release(op);
            }
        }
    }

    /// Takes over a range a previous run gave out (read back from the
    /// kernel): the allocator goes on behind it. False when it overlaps
    /// one taken over before (the kernel's table is then not one we
    /// wrote, and the Service gets a new range).
    pub(super) fn adopt(&mut self, kind: PoolKind, k: u32, base: u32, cap: u32) -> bool {
        let map = kind.shard(k);
        let Some(end) = base.checked_add(cap) else {
            return false;
        };
        let sh = self.shards.entry(map).or_default();
        if sh
            .adopted
            .range(..end)
            .next_back()
            .is_some_and(|(b, c)| b + c > base)
        {
            return false;
        }
        sh.adopted.insert(base, cap);
        sh.next = sh.next.max(end);
        sh.pools += 1;
        let c = self.count.entry(kind).or_default();
        *c = (*c).max(k + 1);
        true
    }

    /// After [`Self::adopt`]: which shards can take another pool, and the
    /// taken-over ranges forgotten (they were only for the overlap check).
    pub(super) fn adopted(&mut self) {
        for (kind, count) in &self.count {
            let room = self.room.entry(*kind).or_default();
            for k in 0..*count {
                let sh = self.shards.entry(kind.shard(k)).or_default();
                sh.adopted = BTreeMap::new();
                if sh.pools < POOLS_PER_SHARD {
                    room.insert(k);
                } else {
                    room.remove(&k);
                }
            }
        }
    }

    /// Gives `new`'s pools the ranges a previous run gave them where they
    /// still fit (`taken[i]` for pool i, already [`Self::adopt`]ed), new
    /// ones elsewhere, and points the selection rules at them.
    pub(super) fn assign_adopted(
        &mut self,
        new: &mut ServiceObjects,
        taken: &[Option<(MapName, u32, u32)>],
    ) {
        for (i, pool) in new.pools.iter_mut().enumerate() {
            let n = pool.values.len() as u32;
            let want = n.next_power_of_two();
            match taken.get(i).copied().flatten() {
                Some((map, base, cap)) if n <= cap && cap <= want * 4 => {
                    (pool.map, pool.base, pool.cap) = (map, base, cap);
                }
                other => {
                    if let Some((map, base, cap)) = other {
                        let gone = Pool {
                            kind: pool.kind,
                            values: Vec::new(),
                            map,
                            base,
                            cap,
                            affinity: None,
                        };
                        self.release(&gone);
                    }
                    (pool.map, pool.base) = self.alloc(pool.kind, want);
                    pool.cap = want;
                }
            }
        }
        point_rules(new);
    }
}

/// Points the selection rules at their pools' maps and offsets.
fn point_rules(new: &mut ServiceObjects) {
    for (_, rules) in new.chains.iter_mut() {
        for e in rules.iter_mut().flat_map(|r| r.exprs.iter_mut()) {
            if let Expr::NumgenDnat { slots, .. }
            | Expr::AffinityHit { slots, .. }
            | Expr::HashDnat { slots, .. } = e
            {
                if let Some(p) = new.pools.get(slots.pool) {
                    slots.map = p.map;
                    slots.offset = p.base;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kp_model::Protocol;

    /// Pools start at a multiple of their size (the layout the affinity
    /// rules' former XOR needed; kept as it was).
    #[test]
    fn slot_ranges_are_aligned_to_their_size() {
        let mut s = Slots::default();
        let kind = PoolKind::Endpoints(Protocol::Tcp);
        for cap in [1, 4, 2, 8, 1, 16, 4] {
            let (_, base) = s.alloc(kind, cap);
            assert_eq!(base % cap, 0, "cap {cap} at {base}");
        }
    }
}
