//! `kp-bench maglev`: the Maglev tables of `--bpf-lb-algorithm
//! maglev` (kp_ebpf::maglev) alone, no kernel and no root: the time to
//! build one Service's table, the share of flows that change endpoint when
//! one endpoint leaves, the share two nodes agree on, and the map memory
//! of 100k Services. Pseudo-random inputs from a fixed seed, so two runs
//! compute on the same flows and endpoints; measured, not asserted (the
//! crate's unit tests assert the bounds).

use std::time::{Duration, Instant};

use anyhow::Result;
use kp_ebpf::maglev;
use kp_ebpf::maps::{addr_words, port_net, MaglevKey, MaglevVal, MAGLEV_CHUNK};

use crate::tables::{ms, pct};

/// splitmix64: deterministic, and enough for picking flows and endpoints.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const SEED: u64 = 54;
const SERVICES: u64 = 100_000;
const FLOWS: usize = 100_000;

/// Endpoint identities as the proxier would give them: a pod address in
/// 10.128.0.0/9 (16 bytes, as kp_backends stores it) and the port.
fn endpoints(rng: &mut Rng, n: usize) -> Vec<Vec<u8>> {
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let ip = 0x0a80_0000 | (rng.next() as u32 & 0x007f_ffff);
        if !seen.insert(ip) {
            continue;
        }
        let words = addr_words(std::net::Ipv4Addr::from(ip).into());
        let mut id: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        id.extend_from_slice(&port_net(8080).to_ne_bytes());
        out.push(id);
    }
    out
}

/// Hashes of `FLOWS` TCP flows from random clients and ports to one
/// Service address (what the tc program hashes).
fn flows(rng: &mut Rng) -> Vec<u32> {
    let svc = addr_words(std::net::Ipv4Addr::new(203, 0, 113, 10).into());
    (0..FLOWS)
        .map(|_| {
            let client = addr_words(std::net::Ipv4Addr::from(rng.next() as u32).into());
            maglev::flow_hash(client, svc, port_net(rng.next() as u16), port_net(443), 6)
        })
        .collect()
}

/// The smallest prime >= n (trial division: n is at most a few 100k).
fn next_prime(n: u32) -> u32 {
    let prime = |k: u32| {
        k >= 2
            && (2..)
                .take_while(|d| d * d <= k)
                .all(|d| !k.is_multiple_of(d))
    };
    (n..).find(|&k| prime(k)).unwrap_or(n)
}

/// Each flow's endpoint identity under `table` (built over `eps`).
fn picks<'a>(table: &[u32], eps: &'a [Vec<u8>], hashes: &[u32]) -> Vec<&'a [u8]> {
    hashes
        .iter()
        .map(|&h| {
            maglev::pick(table, h)
                .and_then(|i| eps.get(i as usize))
                .map_or(&[][..], |e| e.as_slice())
        })
        .collect()
}

fn share_differing(a: &[&[u8]], b: &[&[u8]]) -> f64 {
    a.iter().zip(b).filter(|(x, y)| x != y).count() as f64 / a.len().max(1) as f64
}

fn pct_str(v: f64) -> String {
    format!("{:.2}%", v * 100.0)
}

/// (median, min, max) of `v`.
fn spread(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let mid = v.get(v.len() / 2).copied().unwrap_or(0.0);
    (
        mid,
        v.first().copied().unwrap_or(0.0),
        v.last().copied().unwrap_or(0.0),
    )
}

fn build_times() {
    println!("### Table build, one Service (median of the builds)");
    println!();
    println!("| endpoints | M (table_size) | map entries | builds | table() p50 | table() + chunks() p50 |");
    println!("|---|---|---|---|---|---|");
    let mut rng = Rng(SEED);
    for n in [1usize, 10, 100, 1000] {
        let eps = endpoints(&mut rng, n);
        let m = maglev::table_size(n);
        let runs = if n >= 1000 { 9 } else { 31 };
        let (mut table_t, mut both_t): (Vec<Duration>, Vec<Duration>) = (Vec::new(), Vec::new());
        let mut sink = 0usize;
        for _ in 0..runs {
            let t = Instant::now();
            let table = maglev::table(&eps, m);
            table_t.push(t.elapsed());
            let entries = maglev::chunks(7, &table, |i| i);
            both_t.push(t.elapsed());
            sink = sink.wrapping_add(entries.len());
        }
        println!(
            "| {n} | {m} | {} | {runs} | {} ms | {} ms |",
            sink / runs,
            ms(pct(&mut table_t, 0.5)),
            ms(pct(&mut both_t, 0.5)),
        );
    }
    println!();
}

/// The share of `hashes` whose endpoint differs from `before` once
/// `eps[gone]` leaves and the rest build a table of `m` slots.
fn moved_by_leaving(eps: &[Vec<u8>], before: &[&[u8]], gone: usize, m: u32, hashes: &[u32]) -> f64 {
    let rest: Vec<Vec<u8>> = (0..eps.len())
        .filter(|&i| i != gone)
        .map(|i| eps[i].clone())
        .collect();
    share_differing(before, &picks(&maglev::table(&rest, m), &rest, hashes))
}

fn disruption() {
    let n = 100usize;
    let leavers = 10;
    println!("### One endpoint of {n} leaves: share of {FLOWS} flows whose endpoint changes");
    println!();
    println!("Median (min-max) over {leavers} runs, each with a different endpoint leaving. The leaver's own flows (about 1/N) must move whatever the algorithm.");
    println!();
    println!("| pick | M before -> after | flows moved | of which the leaver's own |");
    println!("|---|---|---|---|");
    let mut rng = Rng(SEED + 1);
    let eps = endpoints(&mut rng, n);
    let hashes = flows(&mut rng);
    let rows: [(&str, u32, u32); 2] = [
        (
            "Maglev, M = table_size(N) (a step)",
            maglev::table_size(n),
            maglev::table_size(n - 1),
        ),
        (
            "Maglev, M = smallest prime >= 100 N (not used)",
            next_prime(100 * n as u32),
            next_prime(100 * (n as u32 - 1)),
        ),
    ];
    let mut own_shares = Vec::new();
    for (what, m0, m1) in rows {
        let before_table = maglev::table(&eps, m0);
        let before = picks(&before_table, &eps, &hashes);
        let (mut moved, mut own) = (Vec::new(), Vec::new());
        for k in 0..leavers {
            let gone = (k * n) / leavers;
            moved.push(moved_by_leaving(&eps, &before, gone, m1, &hashes));
            let mine = before
                .iter()
                .filter(|&&e| e == eps[gone].as_slice())
                .count();
            own.push(mine as f64 / hashes.len() as f64);
        }
        let (a, lo, hi) = spread(&mut moved);
        let (o, olo, ohi) = spread(&mut own);
        own_shares.push(o);
        println!(
            "| {what} | {m0} -> {m1} | {} ({}-{}) | {} ({}-{}) |",
            pct_str(a),
            pct_str(lo),
            pct_str(hi),
            pct_str(o),
            pct_str(olo),
            pct_str(ohi)
        );
    }
    // A random pick without a connection table: a new connection of the
    // same tuple draws again, uniformly, before and after.
    let mut moved = Vec::new();
    for k in 0..leavers {
        let gone = (k * n) / leavers;
        let rest: Vec<usize> = (0..n).filter(|&i| i != gone).collect();
        let changed = (0..FLOWS)
            .filter(|_| {
                let before = rng.below(n);
                let after = rest[rng.below(rest.len())];
                before != after
            })
            .count();
        moved.push(changed as f64 / FLOWS as f64);
    }
    let (a, lo, hi) = spread(&mut moved);
    println!(
        "| random, drawn again per connection | - | {} ({}-{}) | {} (expected) |",
        pct_str(a),
        pct_str(lo),
        pct_str(hi),
        pct_str(1.0 / n as f64)
    );
    println!();
}

/// The target (at most 1.2/N of the flows move when one of N endpoints
/// leaves) against N: Maglev at `table_size`'s M, in units of 1/N.
fn disruption_by_count() {
    println!("### One endpoint of N leaves, for several N: Maglev at table_size(N)");
    println!();
    println!("Median (min-max) over up to 10 runs per N, each with a different endpoint leaving; x N: the share in units of 1/N (the leaver's own flows alone are 1). Where N - 1 is below a step of table_size, M changes and nearly every flow moves.");
    println!();
    println!("| N | M | flows moved | x N | at most 1.2/N |");
    println!("|---|---|---|---|---|");
    let mut rng = Rng(SEED + 3);
    let hashes = flows(&mut rng);
    for n in [3usize, 4, 5, 10, 20, 50, 100, 250] {
        let eps = endpoints(&mut rng, n);
        let (m0, m1) = (maglev::table_size(n), maglev::table_size(n - 1));
        let before = picks(&maglev::table(&eps, m0), &eps, &hashes);
        let leavers = n.min(10);
        let mut moved = Vec::new();
        for k in 0..leavers {
            let gone = (k * n) / leavers;
            moved.push(moved_by_leaving(&eps, &before, gone, m1, &hashes));
        }
        let (a, lo, hi) = spread(&mut moved);
        let m = if m0 == m1 {
            m0.to_string()
        } else {
            format!("{m0} -> {m1}")
        };
        println!(
            "| {n} | {m} | {} ({}-{}) | {:.2} | {} |",
            pct_str(a),
            pct_str(lo),
            pct_str(hi),
            a * n as f64,
            if a * n as f64 <= 1.2 {
                "met"
            } else {
                "not met"
            }
        );
    }
    println!();
}

/// The moved share against the table size: for each N, every size of
/// maglev::SIZES from table_size(N) up, the same M before and after (as
/// table_size gives while N - 1 stays on its step). What a rule of more
/// slots per endpoint would buy against 1.2/N, and at what size.
fn disruption_by_size() {
    println!("### One endpoint of N leaves, table sizes from table_size(N) up");
    println!();
    println!("Median over up to 10 runs per cell (a different endpoint leaving each), in units of 1/N; the smallest M that meets 1.2/N in bold.");
    println!();
    let ns = [10usize, 20, 50, 100, 250];
    println!("| M | {} |", ns.map(|n| format!("N = {n}")).join(" | "));
    println!("|---|{}", "---|".repeat(ns.len()));
    let mut rng = Rng(SEED + 4);
    let hashes = flows(&mut rng);
    let sets: Vec<Vec<Vec<u8>>> = ns.iter().map(|&n| endpoints(&mut rng, n)).collect();
    let mut met = vec![false; ns.len()];
    for m in maglev::SIZES {
        let mut row = Vec::new();
        for (k, (&n, eps)) in ns.iter().zip(&sets).enumerate() {
            if m < maglev::table_size(n) {
                row.push("-".to_string());
                continue;
            }
            let before = picks(&maglev::table(eps, m), eps, &hashes);
            let leavers = n.min(10);
            let mut moved: Vec<f64> = (0..leavers)
                .map(|j| moved_by_leaving(eps, &before, (j * n) / leavers, m, &hashes))
                .collect();
            let x = spread(&mut moved).0 * n as f64;
            if x <= 1.2 && !met[k] {
                met[k] = true;
                row.push(format!("**{x:.2}**"));
            } else {
                row.push(format!("{x:.2}"));
            }
        }
        println!("| {m} | {} |", row.join(" | "));
    }
    println!();
}

fn agreement() {
    let n = 100usize;
    println!("### Two nodes, the same {n} endpoints listed in different orders: share of {FLOWS} flows sent to the same endpoint");
    println!();
    println!("| pick | same endpoint on both nodes |");
    println!("|---|---|");
    let mut rng = Rng(SEED + 2);
    let eps = endpoints(&mut rng, n);
    let mut other = eps.clone();
    for i in (1..other.len()).rev() {
        other.swap(i, rng.below(i + 1));
    }
    let hashes = flows(&mut rng);
    let m = maglev::table_size(n);
    let a = picks(&maglev::table(&eps, m), &eps, &hashes);
    let b = picks(&maglev::table(&other, m), &other, &hashes);
    println!(
        "| Maglev, M {m} (tables built from each node's order) | {} |",
        pct_str(1.0 - share_differing(&a, &b))
    );
    let same = (0..FLOWS).filter(|_| rng.below(n) == rng.below(n)).count();
    println!(
        "| random, each node draws | {} |",
        pct_str(same as f64 / FLOWS as f64)
    );
    println!();
}

/// BPF hash map element overhead on 64-bit kernels (kernel/bpf/hashtab.c):
/// struct htab_elem before the key is 48 bytes (hash_node 16, the
/// lru_node / ptr_to_pptr union 24, hash 4, key aligned to 8); elem_size
/// = 48 + round_up(key, 8) + round_up(value, 8).
const HTAB_ELEM: u64 = 48;
/// BPF_F_NO_PREALLOC elements come from bpf_mem_alloc (kernel/bpf/
/// memalloc.c), which adds an 8-byte llist_node in front of each and
/// counts it in the map's memory (htab_map_mem_usage).
const LLIST_NODE: u64 = 8;
/// struct bucket: hlist_nulls_head 8 + raw spinlock 4, padded to 16; one
/// per max_entries rounded up to a power of two.
const BUCKET: u64 = 16;

fn round8(n: u64) -> u64 {
    n.div_ceil(8) * 8
}

/// The kmalloc object an allocation of `n` bytes takes (the generic size
/// classes; bpf_mem_alloc allocates each element with kmalloc_node).
fn kmalloc_class(n: u64) -> u64 {
    [
        8, 16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 8192,
    ]
    .into_iter()
    .find(|&c| c >= n)
    .unwrap_or_else(|| n.next_power_of_two())
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// (entries, kernel-counted bytes, slab bytes) for `SERVICES` Services of
/// `n` endpoints each, with `chunk` slots per entry.
fn footprint(n: usize, chunk: u64) -> (u64, u64, u64) {
    let m = u64::from(maglev::table_size(n));
    let entries = SERVICES * m.div_ceil(chunk);
    let key = std::mem::size_of::<MaglevKey>() as u64;
    let elem = HTAB_ELEM + round8(key) + round8(4 * chunk);
    let buckets = BUCKET * entries.next_power_of_two();
    (
        entries,
        entries * (elem + LLIST_NODE) + buckets,
        entries * kmalloc_class(elem + LLIST_NODE) + buckets,
    )
}

fn memory() {
    let key = std::mem::size_of::<MaglevKey>() as u64;
    let value = std::mem::size_of::<MaglevVal>() as u64;
    let elem = HTAB_ELEM + round8(key) + round8(value);
    println!("### kp_maglev for {SERVICES} Services (BPF_F_NO_PREALLOC hash map, x86_64)");
    println!();
    println!(
        "Per entry: htab_elem {HTAB_ELEM} + key {key} + value {value} (both rounded up to 8) = {elem} B; \
         the kernel counts {} B with bpf_mem_alloc's {LLIST_NODE}-byte list node (what bpftool shows as memlock), \
         which kmalloc serves from a {} B object. Plus the bucket array, {BUCKET} B x max_entries rounded up to a power of two \
         (max_entries = the entries, here). Formula: entries x ({HTAB_ELEM} + round8({key}) + round8({value}) + {LLIST_NODE}) + {BUCKET} x pow2(entries).",
        elem + LLIST_NODE,
        kmalloc_class(elem + LLIST_NODE)
    );
    println!();
    println!("| endpoints each | M | entries per Service | entries | the kernel's count | slab objects + buckets | the slots alone (M x 4 B) |");
    println!("|---|---|---|---|---|---|---|");
    for n in [3usize, 10, 100] {
        let m = maglev::table_size(n);
        let (entries, counted, slab) = footprint(n, MAGLEV_CHUNK as u64);
        println!(
            "| {n} | {m} | {} | {entries} | {} | {} | {} |",
            maglev::chunk_count(m),
            gib(counted),
            gib(slab),
            gib(SERVICES * u64::from(m) * 4),
        );
    }
    println!();
    println!("Other chunk sizes, slab objects + buckets (3 / 10 / 100 endpoints): an element of 48 slots is 256 B with its list node (kmalloc-256 exactly), one of 112 is 512 B.");
    println!();
    println!("| slots per entry | element + list node | 3 endpoints | 10 | 100 |");
    println!("|---|---|---|---|---|");
    for chunk in [48u64, 64, 112] {
        let e = HTAB_ELEM + round8(key) + round8(4 * chunk) + LLIST_NODE;
        let row: Vec<String> = [3usize, 10, 100]
            .into_iter()
            .map(|n| gib(footprint(n, chunk).2))
            .collect();
        println!(
            "| {chunk} | {e} B (kmalloc-{}) | {} |",
            kmalloc_class(e),
            row.join(" | ")
        );
    }
    println!();
}

pub fn run() -> Result<()> {
    println!("mode: maglev (kp_ebpf::maglev alone: no kernel; seed {SEED})");
    println!();
    build_times();
    disruption();
    disruption_by_count();
    disruption_by_size();
    agreement();
    memory();
    Ok(())
}
