//! Maglev consistent hashing (`--bpf-lb-algorithm maglev`, issue 54):
//! one lookup table per Service port, built here, read by the tc programs.
//!
//! A table has M slots (M prime), each naming one endpoint; a packet goes
//! to the endpoint of slot `flow_hash(..) % M`. The population is Maglev's
//! (Eisenbud et al., NSDI 2016): every endpoint has its own permutation of
//! the slots, `offset + j * skip (mod M)`, from two hashes of its identity,
//! and the endpoints take turns claiming the next free slot of their
//! permutation until the table is full. So:
//!
//! * each endpoint gets floor(M/N) or ceil(M/N) slots (the turns are
//!   round-robin and a permutation of a prime M reaches every slot);
//! * the table depends on the set of identities only (they are sorted
//!   first, and the hashes are fixed here, not std's): every node builds
//!   the same table, so any node picks the same endpoint for a flow;
//! * when one endpoint of N leaves, its slots move and a few others do
//!   (the survivors' walks contend for the freed slots, and some take a
//!   slot another survivor had): with [`table_size`]'s tables, 1.02/N of
//!   the flows for 3 endpoints, 1.09/N for 5, 1.24/N for 10, 2.3/N for 100
//!   (medians, the tests say more), where a random pick moves (N-1)/N of
//!   them.
//!
//! Everything here is pure: no I/O, no map access. maps.rs has the map's
//! layout ([`MaglevKey`], [`MaglevVal`]), bpf/lib/maglev.h the program's side.

use crate::maps::{MaglevKey, MaglevVal, MAGLEV_CHUNK};

/// Slots per endpoint that a table aims for at least: with M >= 100 N, a
/// Service's balance is within 1% (floor or ceil of M/N slots each), and
/// the slots that move besides a leaving endpoint's are 1-2.5% of the
/// table (fewer with larger tables, at the cost of map memory).
pub const SLOTS_PER_ENDPOINT: usize = 100;

/// The table sizes: the largest prime below each power of two from 2^10 to
/// 2^17 (Cilium's choice of Maglev sizes too). A table fills its last
/// 64-slot chunk but for at most 19 slots, and the size changes only when the
/// endpoint count crosses a step (about each doubling), not at every
/// endpoint. See [`table_size`].
///
/// Why not from 2^8 (251, 509), which 1 to 5 endpoints would fill at 100
/// slots each: crossing a step moves nearly every flow, and 2 <-> 3 and 5
/// <-> 6 replicas are common scalings (3 -> 2 moved 67% of the flows
/// instead of 33%). From 1,021 every count up to 10 shares one size and
/// gets more slots each, so fewer of the others' slots move too (1.02/N
/// at 3 endpoints, 1.58/N at 4 with 509 slots). The cost: 16 chunks per
/// Service port however few its endpoints, 0.51 GiB for 100k Services
/// (BENCHMARKS.md, "Maglev tables").
pub const SIZES: [u32; 8] = [1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071];

/// The largest table: 512 KiB of slots, 2,048 map entries. Services with
/// more than 1,310 endpoints get it too, with fewer than 100 slots each
/// (coarser balance: at 13,107 endpoints, 10 slots each, so each within
/// 10%); past 131,071 endpoints some get no slot at all.
pub const MAX_SIZE: u32 = SIZES[SIZES.len() - 1];

/// The table size for a Service port with `endpoints` endpoints: the first
/// of [`SIZES`] with at least [`SLOTS_PER_ENDPOINT`] slots per endpoint
/// (so at least 1,021), or [`MAX_SIZE`].
///
/// Why steps and not the smallest prime >= 100 N: the slot a flow lands
/// in is `hash % M`, so a new M moves nearly every flow. If M followed the
/// count exactly, every endpoint added or removed would change it, and
/// losing one endpoint of N would move (N-1)/N of the flows instead of
/// 1/N. With steps M changes about once per doubling of the count, and it
/// is still a function of the count alone, so every node (restarted or
/// not) uses the same M.
pub fn table_size(endpoints: usize) -> u32 {
    let want = endpoints.saturating_mul(SLOTS_PER_ENDPOINT);
    SIZES
        .iter()
        .copied()
        .find(|&m| m as usize >= want)
        .unwrap_or(MAX_SIZE)
}

/// Map entries ([`MaglevVal`] chunks) a table of `m` slots takes.
pub fn chunk_count(m: u32) -> u32 {
    m.div_ceil(MAGLEV_CHUNK as u32)
}

/// Seeds of the two identity hashes (any fixed pair of distinct values).
const SEED_OFFSET: u64 = 0x6b70_2d6d_6167_6c31;
const SEED_SKIP: u64 = 0x6b70_2d6d_6167_6c32;

/// MurmurHash3's 64-bit finaliser: a bijection whose every output bit
/// depends on every input bit.
fn mix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^= x >> 33;
    x
}

/// A 64-bit hash of an endpoint's identity, the same on every node, build
/// and architecture (std's hashers promise none of that): the length, then
/// each 8 bytes little-endian (the last zero-padded), each through
/// [`mix64`]. Not meant to resist chosen inputs: identities are endpoint
/// addresses, which the cluster assigns.
fn identity_hash(bytes: &[u8], seed: u64) -> u64 {
    let mut h = mix64(seed ^ bytes.len() as u64);
    for part in bytes.chunks(8) {
        let mut word = [0u8; 8];
        word[..part.len()].copy_from_slice(part);
        h = mix64(h ^ u64::from_le_bytes(word)).wrapping_add(0x9e37_79b9_7f4a_7c15);
    }
    mix64(h)
}

/// One endpoint's walk along its permutation while the table fills.
struct Walk {
    /// The endpoint's index in the caller's slice.
    index: u32,
    /// The next slot to try.
    pos: u64,
    skip: u64,
    /// Slots tried so far.
    tried: u64,
}

/// A slot no endpoint has claimed yet (no index reaches it: see [`table`]).
const FREE: u32 = u32::MAX;

/// The Maglev table of `m` slots for `endpoints`, each given by its
/// identity (the bytes every node sees alike, e.g. address and port): for
/// each slot, the index in `endpoints` of the endpoint it sends to.
///
/// The order of `endpoints` does not matter: nodes that list the same
/// endpoints differently build tables that name the same identity in every
/// slot. Two equal identities count as one endpoint with twice the slots.
/// Empty `endpoints` or `m` 0 give an empty table; with more endpoints
/// than slots, the first `m` by identity get one slot each.
///
/// `m` should be prime (a [`table_size`]): then each permutation reaches
/// every slot. Any other `m` still gives a full table (an endpoint whose
/// permutation is used up goes on one slot at a time), with the same
/// balance but not Maglev's low disruption.
pub fn table<E: AsRef<[u8]>>(endpoints: &[E], m: u32) -> Vec<u32> {
    if endpoints.is_empty() || m == 0 {
        return Vec::new();
    }
    let size = u64::from(m);
    // Identity order, so that the turns (which decide contested slots) are
    // the same on every node. Indexes from FREE on cannot be stored (a
    // slice that long does not fit in memory anyway).
    let mut order: Vec<usize> = (0..endpoints.len().min(FREE as usize)).collect();
    order.sort_by(|&a, &b| endpoints[a].as_ref().cmp(endpoints[b].as_ref()));
    let mut walks: Vec<Walk> = order
        .into_iter()
        .map(|i| {
            let id = endpoints[i].as_ref();
            Walk {
                index: i as u32,
                pos: identity_hash(id, SEED_OFFSET) % size,
                // 1..m-1: coprime to a prime m, so the walk reaches every
                // slot within m steps.
                skip: identity_hash(id, SEED_SKIP) % size.saturating_sub(1).max(1) + 1,
                tried: 0,
            }
        })
        .collect();
    let mut slots = vec![FREE; m as usize];
    let mut free = slots.len();
    'fill: loop {
        for w in walks.iter_mut() {
            // Ends within 2 m steps: the first m follow the permutation,
            // the next m go one slot at a time, and some slot is free.
            loop {
                let pos = w.pos;
                w.tried += 1;
                let step = if w.tried < size { w.skip } else { 1 };
                // pos and step are below size: one subtraction wraps it
                // (a division per probe was half the build time).
                w.pos += step;
                if w.pos >= size {
                    w.pos -= size;
                }
                if let Some(slot) = slots.get_mut(pos as usize) {
                    if *slot == FREE {
                        *slot = w.index;
                        free -= 1;
                        break;
                    }
                }
            }
            if free == 0 {
                break 'fill;
            }
        }
    }
    slots
}

/// The endpoint a flow of hash `hash` goes to: what the program does with
/// the table ([`table`]'s entry at `hash % M`). None for an empty table.
pub fn pick(table: &[u32], hash: u32) -> Option<u32> {
    table.get(hash as usize % table.len().max(1)).copied()
}

/// A Service port's table as `kp_maglev` entries: chunk `c` holds slots
/// `c * MAGLEV_CHUNK ..`, each as the `kp_backends` slot that `slot_of`
/// gives for the endpoint index [`table`] put there. The last chunk's tail
/// is 0.
pub fn chunks(
    svc_id: u32,
    table: &[u32],
    slot_of: impl Fn(u32) -> u32,
) -> Vec<(MaglevKey, MaglevVal)> {
    table
        .chunks(MAGLEV_CHUNK)
        .zip(0u32..)
        .map(|(part, chunk)| {
            let mut val = MaglevVal::default();
            for (dst, &endpoint) in val.slot.iter_mut().zip(part) {
                *dst = slot_of(endpoint);
            }
            (MaglevKey { svc_id, chunk }, val)
        })
        .collect()
}

/// One word into the running flow hash (MurmurHash3's x86_32 block step).
fn flow_mix(h: u32, k: u32) -> u32 {
    let k = k
        .wrapping_mul(0xcc9e_2d51)
        .rotate_left(15)
        .wrapping_mul(0x1b87_3593);
    (h ^ k)
        .rotate_left(13)
        .wrapping_mul(5)
        .wrapping_add(0xe654_6b64)
}

/// The per-packet hash the tc program computes to pick a slot
/// (`maglev_flow_hash` in bpf/lib/maglev.h, which must agree bit for bit: a
/// test compiles it and compares). Addresses and ports in the layout the
/// program sees: four words in network order in memory (an IPv4 address in
/// word 0, as [`crate::maps::addr_words`] makes them), ports likewise
/// ([`crate::maps::port_net`]). Ten words through a fixed sequence of
/// multiplies and rotates, then a final avalanche: cheap and loop-free in
/// BPF.
pub fn flow_hash(saddr: [u32; 4], daddr: [u32; 4], sport: u16, dport: u16, proto: u8) -> u32 {
    let mut h = 0x6b70_6d67; // "kpmg"
    for w in saddr.into_iter().chain(daddr) {
        h = flow_mix(h, w);
    }
    h = flow_mix(h, u32::from(sport) | (u32::from(dport) << 16));
    h = flow_mix(h, u32::from(proto));
    h ^= 40; // bytes hashed
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64: the tests' deterministic pseudo-random numbers.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            mix64(self.0)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn shuffle<T>(&mut self, v: &mut [T]) {
            for i in (1..v.len()).rev() {
                v.swap(i, self.below(i + 1));
            }
        }
        /// An endpoint identity as the proxier would give it: a 16-byte
        /// address and a 2-byte port.
        fn identity(&mut self) -> Vec<u8> {
            let mut id: Vec<u8> = (0..3).flat_map(|_| self.next().to_le_bytes()).collect();
            id.truncate(18);
            id
        }
        fn tuple(&mut self) -> ([u32; 4], [u32; 4], u16, u16, u8) {
            let mut w = || self.next() as u32;
            let s = [w(), w(), w(), w()];
            let d = [w(), w(), w(), w()];
            let (sp, dp) = (w() as u16, w() as u16);
            (s, d, sp, dp, w() as u8)
        }
    }

    fn is_prime(n: u32) -> bool {
        n >= 2
            && (2..)
                .take_while(|d| d * d <= n)
                .all(|d| !n.is_multiple_of(d))
    }

    fn identities(rng: &mut Rng, n: usize) -> Vec<Vec<u8>> {
        (0..n).map(|_| rng.identity()).collect()
    }

    /// Each slot's endpoint identity.
    fn named<'a>(eps: &'a [Vec<u8>], table: &[u32]) -> Vec<&'a [u8]> {
        table.iter().map(|&i| eps[i as usize].as_slice()).collect()
    }

    fn moved(a: &[&[u8]], b: &[&[u8]]) -> usize {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).filter(|(x, y)| x != y).count()
    }

    #[test]
    fn table_sizes_are_primes_with_100_slots_per_endpoint() {
        for m in SIZES {
            assert!(is_prime(m), "{m}");
            // The largest prime below its power of two.
            let p = (m + 1).next_power_of_two();
            assert!(((m + 1)..p).all(|k| !is_prime(k)), "{m}");
        }
        let cases = [
            (0, 1021),
            (1, 1021),
            (2, 1021),
            (3, 1021),
            (10, 1021),
            (11, 2039),
            (100, 16381),
            (1000, 131071),
        ];
        for (n, m) in cases {
            assert_eq!(table_size(n), m, "{n} endpoints");
            assert!(is_prime(m) && m >= 1021 && m as usize >= 100 * n);
        }
        for n in 0..=1310 {
            assert!(table_size(n) as usize >= (100 * n).max(1021), "{n}");
        }
        assert_eq!(table_size(1311), MAX_SIZE);
        assert_eq!(table_size(usize::MAX), MAX_SIZE);
    }

    #[test]
    fn table_size_changes_once_per_step_not_per_endpoint() {
        // From 1 to 2,000 endpoints, M changes 7 times (at 11, 21, 41, 82,
        // 164, 328 and 656 endpoints: none from 1 to 10, the common
        // replica counts); everywhere else an endpoint added or removed
        // keeps M, so only Maglev's ~1/N of flows move.
        let changes: Vec<usize> = (2..=2000)
            .filter(|&n| table_size(n) != table_size(n - 1))
            .collect();
        assert_eq!(changes, [11, 21, 41, 82, 164, 328, 656]);
    }

    #[test]
    fn chunks_cover_each_table_with_a_short_tail() {
        for m in SIZES {
            // The steps sit just below powers of two: at most 19 slots of
            // the last chunk unused (32749 = 2^15 - 19).
            let c = chunk_count(m) as usize;
            assert!(c * MAGLEV_CHUNK >= m as usize && c * MAGLEV_CHUNK - (m as usize) < 20);
        }
        let eps = identities(&mut Rng(7), 3);
        let t = table(&eps, 251);
        let entries = chunks(9, &t, |i| 100 + i);
        assert_eq!(entries.len(), 4);
        for (c, (k, v)) in entries.iter().enumerate() {
            assert_eq!(
                *k,
                MaglevKey {
                    svc_id: 9,
                    chunk: c as u32
                }
            );
            for (j, &slot) in v.slot.iter().enumerate() {
                match t.get(c * MAGLEV_CHUNK + j) {
                    Some(&i) => assert_eq!(slot, 100 + i),
                    None => assert_eq!(slot, 0),
                }
            }
        }
    }

    #[test]
    fn empty_and_tiny_tables() {
        assert!(table::<Vec<u8>>(&[], 251).is_empty());
        assert!(table(&[b"a"], 0).is_empty());
        assert_eq!(table(&[b"a"], 1), [0]);
        assert_eq!(table(&[b"a", b"b"], 2).len(), 2);
        assert_eq!(pick(&[], 5), None);
        assert_eq!(pick(&[4, 7, 9], 5), Some(9));
        // More endpoints than slots: the first by identity get one each.
        let t = table(&[b"d", b"c", b"b", b"a"], 3);
        let mut got: Vec<u32> = t.clone();
        got.sort();
        assert_eq!(got, [1, 2, 3]);
    }

    #[test]
    fn every_endpoint_gets_floor_or_ceil_of_m_over_n_slots() {
        // Maglev's turns are round-robin and, for a prime M, each walk
        // reaches every slot: so every endpoint claims one slot per round
        // until the table is full, and counts differ by at most one.
        let mut rng = Rng(1);
        for (n, m) in [
            (1, 251),
            (2, 251),
            (3, 509),
            (7, 1021),
            (10, 1021),
            (99, 16381),
            (250, 32749),
            (1000, 131071),
            (300, 251),
            // Not prime: the fallback walk keeps the same guarantee.
            (7, 1000),
            (12, 4096),
        ] {
            let eps = identities(&mut rng, n);
            let t = table(&eps, m);
            assert_eq!(t.len(), m as usize);
            let mut count = vec![0usize; n];
            for &i in &t {
                count[i as usize] += 1;
            }
            let (lo, hi) = (m as usize / n, (m as usize).div_ceil(n));
            let given = count.iter().filter(|&&c| c > 0).count();
            assert_eq!(given, n.min(m as usize), "{n} endpoints in {m}");
            for c in count.into_iter().filter(|&c| c > 0) {
                assert!((lo..=hi).contains(&c), "{n} endpoints in {m}: {c}");
            }
        }
    }

    #[test]
    fn the_table_does_not_depend_on_the_input_order() {
        let mut rng = Rng(2);
        for n in [1, 2, 5, 10, 100] {
            let m = table_size(n);
            let mut eps = identities(&mut rng, n);
            let a = table(&eps, m);
            let first = named(&eps, &a)
                .into_iter()
                .map(<[u8]>::to_vec)
                .collect::<Vec<_>>();
            for _ in 0..3 {
                rng.shuffle(&mut eps);
                let b = table(&eps, m);
                assert_eq!(named(&eps, &b), first, "{n} endpoints");
            }
        }
    }

    /// Share of the `m` slots whose endpoint changes when `gone` leaves
    /// `eps`, and the share the leaver itself had.
    fn leaving(eps: &[Vec<u8>], gone: usize, m: u32) -> (f64, f64) {
        let before = table(eps, m);
        let rest: Vec<Vec<u8>> = (0..eps.len())
            .filter(|&i| i != gone)
            .map(|i| eps[i].clone())
            .collect();
        let after = table(&rest, m);
        let own = before.iter().filter(|&&i| i as usize == gone).count();
        let share = |n: usize| n as f64 / f64::from(m);
        (
            share(moved(&named(eps, &before), &named(&rest, &after))),
            share(own),
        )
    }

    /// One endpoint leaving a Service of N, or joining one of N-1 (the
    /// same pair of tables read the other way), at the table size of N.
    ///
    /// Maglev does not move only the leaver's 1/N: the survivors' walks
    /// contend for its slots and some take slots another survivor had.
    /// Measured over thousands of random sets at `table_size(N)`, the
    /// share moved, times N, has median 1.02 (N = 3), 1.09 (5), 1.24 (10),
    /// 1.47 (20), 1.76 (50), 2.32 (100), 4.15 (250): about 1-2.5% of the
    /// table on top of the leaver's own share at 100-200 slots per
    /// endpoint. So the issue's 1.2/N holds for a few endpoints only at
    /// these sizes (and for more with far larger tables: next test).
    /// The extra does not shrink in step with N/M at a few endpoints: at 5
    /// endpoints 1.8% of the table with M 509, 1.5% with M 1021.
    /// Asserted, with margin over what was measured: the mean over trials
    /// is at most 1/N + 3 N/M + 1%; no trial exceeds 2.5/N + 3 N/M + 1% (rare sets
    /// whose walks run in step, two endpoints with the same skip, reach
    /// 2.2/N at small M); the leaver's slots all move, and with N = 2
    /// nothing else does.
    #[test]
    fn one_endpoint_leaving_moves_its_slots_and_a_bounded_few_more() {
        let mut rng = Rng(3);
        for (n, sets) in [
            (2, 20),
            (3, 20),
            (5, 20),
            (10, 10),
            (50, 4),
            (100, 3),
            (250, 2),
        ] {
            let m = table_size(n);
            let extra = 3.0 * n as f64 / f64::from(m) + 0.01;
            let (mut sum, mut trials) = (0.0, 0);
            for _ in 0..sets {
                let eps = identities(&mut rng, n);
                // Each endpoint leaving in turn for the small Services.
                let leavers: Vec<usize> = if n <= 10 {
                    (0..n).collect()
                } else {
                    vec![rng.below(n), rng.below(n)]
                };
                for gone in leavers {
                    let (share, own) = leaving(&eps, gone, m);
                    assert!(share >= own);
                    if n == 2 {
                        assert_eq!(share, own, "one endpoint of 2 left: only its slots move");
                    }
                    assert!(
                        share <= 2.5 / n as f64 + extra,
                        "{n} endpoints, M {m}: one leaving moved {share:.4}"
                    );
                    sum += share;
                    trials += 1;
                }
            }
            let mean = sum / f64::from(trials);
            assert!(
                mean <= 1.0 / n as f64 + extra,
                "{n} endpoints, M {m}: one leaving moved {mean:.4} on average"
            );
        }
    }

    /// Where the issue's bound holds: with M at least ~150 N^2, one
    /// endpoint leaving moves at most 1.2/N of the slots (measured: at
    /// most 1.14/N over 500 sets each for these three).
    #[test]
    fn with_tables_of_150_n_squared_one_leaving_moves_at_most_1_2_over_n() {
        let mut rng = Rng(6);
        for (n, m) in [(10, 16381), (20, 65521), (30, 131071)] {
            for _ in 0..3 {
                let eps = identities(&mut rng, n);
                let (share, _) = leaving(&eps, rng.below(n), m);
                assert!(share <= 1.2 / n as f64, "{n} endpoints, M {m}: {share:.4}");
            }
        }
    }

    #[test]
    fn identity_hashes_are_fixed() {
        // Golden values: a change here changes every table, and nodes
        // running different builds would disagree until all are upgraded.
        assert_eq!(identity_hash(b"", SEED_OFFSET), GOLDEN_ID[0]);
        assert_eq!(identity_hash(b"10.128.0.1:8080", SEED_OFFSET), GOLDEN_ID[1]);
        assert_eq!(identity_hash(b"10.128.0.1:8080", SEED_SKIP), GOLDEN_ID[2]);
        assert_eq!(table(&[&b"a"[..], b"b", b"c"], 251)[..8], GOLDEN_TABLE[..]);
        let v4 = crate::maps::addr_words("10.0.0.1".parse().unwrap());
        let svc = crate::maps::addr_words("10.96.0.1".parse().unwrap());
        let p = crate::maps::port_net;
        if cfg!(target_endian = "little") {
            assert_eq!(flow_hash(v4, svc, p(40000), p(80), 6), GOLDEN_FLOW);
        }
    }

    const GOLDEN_ID: [u64; 3] = [
        0x858d_1638_9edc_2bfe,
        0x83f1_3789_3baf_a549,
        0x6eef_61be_c6bb_d095,
    ];
    const GOLDEN_TABLE: [u32; 8] = [1, 0, 2, 1, 1, 1, 2, 1];
    /// On little-endian hosts (the words are the address bytes read in
    /// host order, as the program reads them).
    const GOLDEN_FLOW: u32 = 0x3d43_8581;

    /// The host program that prints bpf/lib/maglev.h's view: its constants and
    /// struct sizes, then one hash per input line.
    const AGREE_C: &str = r#"
#include <stdio.h>
#include "maglev.h"

int main(void)
{
	unsigned s[4], d[4], sport, dport, proto;

	printf("%d %zu %zu\n", MAGLEV_CHUNK, sizeof(struct maglev_key),
	       sizeof(struct maglev_val));
	while (scanf("%x %x %x %x %x %x %x %x %x %x %x", &s[0], &s[1], &s[2], &s[3],
		     &d[0], &d[1], &d[2], &d[3], &sport, &dport, &proto) == 11) {
		__u32 sa[4] = { s[0], s[1], s[2], s[3] };
		__u32 da[4] = { d[0], d[1], d[2], d[3] };
		printf("%08x\n", maglev_flow_hash(sa, da, sport, dport, proto));
	}
	return 0;
}
"#;

    /// The header as a BPF program would include it (no libc).
    const AGREE_BPF_C: &str = r#"
#include "maglev.h"

__u32 pick(const __u32 *s, const __u32 *d, __u16 sport, __u16 dport)
{
	return maglev_flow_hash(s, d, sport, dport, 6) % 16381;
}
"#;

    fn clang(args: &[&std::ffi::OsStr]) {
        let clang = std::env::var("KP_CLANG").unwrap_or_else(|_| "clang".to_string());
        let bpf = concat!(env!("CARGO_MANIFEST_DIR"), "/bpf/lib");
        let mut cmd = std::process::Command::new(&clang);
        cmd.args(["-O2", "-Wall", "-Werror", "-I", bpf]).args(args);
        // linux/types.h includes asm/types.h, which Debian keeps per
        // architecture (as build.rs says).
        if cfg!(target_arch = "x86_64") {
            cmd.arg("-I/usr/include/x86_64-linux-gnu");
        } else if cfg!(target_arch = "aarch64") {
            cmd.arg("-I/usr/include/aarch64-linux-gnu");
        }
        let out = cmd.output().unwrap_or_else(|e| {
            panic!(
                "this test compiles bpf/lib/maglev.h with {clang} to check it against maglev.rs, \
                 and {clang} could not run ({e}): apt-get install clang, or set KP_CLANG"
            )
        });
        assert!(
            out.status.success(),
            "{clang} {args:?} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn the_c_header_hashes_as_rust_does() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("kp-maglev-agree-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (src, exe) = (dir.join("agree.c"), dir.join("agree"));
        std::fs::write(&src, AGREE_C).unwrap();
        clang(&[src.as_os_str(), "-o".as_ref(), exe.as_os_str()]);
        let (bpf_src, bpf_obj) = (dir.join("agree-bpf.c"), dir.join("agree-bpf.o"));
        std::fs::write(&bpf_src, AGREE_BPF_C).unwrap();
        clang(&[
            "-target".as_ref(),
            "bpf".as_ref(),
            "-c".as_ref(),
            bpf_src.as_os_str(),
            "-o".as_ref(),
            bpf_obj.as_os_str(),
        ]);

        let mut rng = Rng(5);
        let mut tuples: Vec<_> = (0..400).map(|_| rng.tuple()).collect();
        tuples.push(([0; 4], [0; 4], 0, 0, 0));
        tuples.push(([u32::MAX; 4], [u32::MAX; 4], u16::MAX, u16::MAX, u8::MAX));
        let a = crate::maps::addr_words("10.0.0.1".parse().unwrap());
        let b = crate::maps::addr_words("fd00::10:96".parse().unwrap());
        let p = crate::maps::port_net;
        tuples.push((a, a, p(40000), p(80), 6));
        tuples.push((b, b, p(1), p(53), 17));
        let input: String = tuples
            .iter()
            .map(|(s, d, sp, dp, pr)| {
                format!(
                    "{:x} {:x} {:x} {:x} {:x} {:x} {:x} {:x} {sp:x} {dp:x} {pr:x}\n",
                    s[0], s[1], s[2], s[3], d[0], d[1], d[2], d[3]
                )
            })
            .collect();
        let mut child = std::process::Command::new(&exe)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        let mut lines = text.lines();
        assert_eq!(
            lines.next(),
            Some(
                format!(
                    "{MAGLEV_CHUNK} {} {}",
                    std::mem::size_of::<MaglevKey>(),
                    std::mem::size_of::<MaglevVal>()
                )
                .as_str()
            ),
            "MAGLEV_CHUNK and the struct sizes of bpf/lib/maglev.h against maps.rs"
        );
        let c: Vec<&str> = lines.collect();
        assert_eq!(c.len(), tuples.len());
        for (t, line) in tuples.iter().zip(c) {
            let (s, d, sp, dp, pr) = *t;
            assert_eq!(
                line,
                format!("{:08x}", flow_hash(s, d, sp, dp, pr)),
                "bpf/lib/maglev.h and flow_hash differ for {t:?}"
            );
        }
    }

    #[test]
    fn flow_hashes_spread_over_the_slots() {
        // 100k flows over 251 slots, random and structured (one client, a
        // run of source ports; many clients to one Service): chi-square
        // with 250 degrees of freedom has mean 250 and deviation 22, so
        // 400 fails only a badly skewed hash.
        let buckets = 251usize;
        let mut rng = Rng(4);
        let random: Vec<u32> = (0..100_000)
            .map(|_| {
                let (s, d, sp, dp, pr) = rng.tuple();
                flow_hash(s, d, sp, dp, pr)
            })
            .collect();
        let svc = crate::maps::addr_words("10.96.0.10".parse().unwrap());
        let client = crate::maps::addr_words("192.168.1.20".parse().unwrap());
        let ports: Vec<u32> = (0..100_000u32)
            .map(|i| {
                flow_hash(
                    client,
                    svc,
                    crate::maps::port_net(1024 + (i % 64000) as u16),
                    crate::maps::port_net(443),
                    6 + 11 * (i / 64000) as u8,
                )
            })
            .collect();
        let clients: Vec<u32> = (0..100_000u32)
            .map(|i| {
                let c = crate::maps::addr_words(std::net::Ipv4Addr::from(0x0a00_0000 + i).into());
                flow_hash(
                    c,
                    svc,
                    crate::maps::port_net(40000),
                    crate::maps::port_net(80),
                    6,
                )
            })
            .collect();
        for (what, hashes) in [
            ("random", random),
            ("source ports", ports),
            ("clients", clients),
        ] {
            let mut count = vec![0u32; buckets];
            for h in &hashes {
                count[*h as usize % buckets] += 1;
            }
            let expect = hashes.len() as f64 / buckets as f64;
            let chi2: f64 = count
                .iter()
                .map(|&c| (f64::from(c) - expect).powi(2) / expect)
                .sum();
            let (lo, hi) = (count.iter().min().unwrap(), count.iter().max().unwrap());
            assert!(chi2 < 400.0, "{what}: chi-square {chi2:.1}");
            assert!(
                f64::from(*hi) / f64::from(*lo) < 1.5,
                "{what}: buckets {lo}..{hi}"
            );
        }
    }
}
