//! `kp-bench nftables --floor`: what the kernel alone costs for our rulesets.
//!
//! The same cluster is synced three times, each in a fresh namespace: by our
//! proxier (timed: what an operator gets), by our proxier again keeping every
//! transaction it sends, and then by nothing but a netlink socket replaying
//! those transactions' batches, encoded beforehand (timed: the kernel's
//! floor for exactly these chains, rules, sets and elements). The ratio is
//! what the model, render and encoding add on top of the kernel. The
//! changes are main.rs's: endpoints replaced, endpoints added, Services
//! added. Then, on the table the replay left, transactions of our own show
//! what a Service added costs the kernel by its parts ([`probes`]).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{anyhow, bail, Result};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_model::{ChangeTracker, Dataplane, DataplaneError, IpFamily};
use kp_netlink::nftables::{Batch, NftSocket};
use kp_nftables::types::{Chain, ElemKey, ElemValue, Object, Verb};
use kp_nftables::{NftBackend, NftNetlink, NftablesProxier, Transaction, Verdict};

use super::{
    additions, growth, in_namespace, ms, p50_p99, parsed_cluster, pct, proxier_config, replacement,
    tracked, Opts,
};

/// Netlink, keeping a copy of every transaction it applies.
struct Keep {
    inner: NftNetlink,
    kept: Arc<Mutex<Vec<Transaction>>>,
}

impl NftBackend for Keep {
    fn apply(&mut self, tx: &Transaction) -> Result<usize, DataplaneError> {
        if let Ok(mut k) = self.kept.lock() {
            k.push(tx.clone());
        }
        self.inner.apply(tx)
    }
    fn table_exists(&mut self, family: IpFamily, table: &str) -> Result<bool, DataplaneError> {
        self.inner.table_exists(family, table)
    }
    fn chain_has_rules(
        &mut self,
        family: IpFamily,
        table: &str,
        chain: &str,
    ) -> Result<bool, DataplaneError> {
        self.inner.chain_has_rules(family, table, chain)
    }
    fn affinity_records(
        &mut self,
        family: IpFamily,
        table: &str,
        set: &str,
    ) -> Result<Vec<ElemKey>, DataplaneError> {
        self.inner.affinity_records(family, table, set)
    }
}

/// kp-bench's cluster in a fresh tracker.
pub(super) fn cluster(n: u32, m: u32, affinity: bool) -> Result<ChangeTracker> {
    let (svcs, slices) = parsed_cluster(n, m, affinity)?;
    Ok(tracked(&svcs, &slices))
}

/// One change given to the tracker, then synced: the time until it is in
/// the kernel.
fn change(
    tr: &mut ChangeTracker,
    dp: &mut NftablesProxier,
    svc: Option<&Service>,
    slice: &EndpointSlice,
) -> Result<Duration> {
    let t = Instant::now();
    if let Some(s) = svc {
        let _ = tr.update_service(s, SystemTime::now());
    }
    let _ = tr.update_endpoint_slice(slice, SystemTime::now());
    let cs = tr.take_changes();
    dp.sync(tr.state(), &cs.changed, false)?;
    Ok(t.elapsed())
}

/// Our proxier: the full sync, then `changes` endpoints replaced, endpoints
/// added and Services added (main.rs's, in its order), each timed until in
/// the kernel; `synced` is called after every sync.
fn ours(
    o: &Opts,
    n: u32,
    m: u32,
    affinity: bool,
    backend: Box<dyn NftBackend>,
    synced: &mut dyn FnMut(),
) -> Result<(Duration, [Vec<Duration>; 3])> {
    let mut tr = cluster(n, m, affinity)?;
    let mut dp = NftablesProxier::new(proxier_config(), backend);
    let t = Instant::now();
    dp.sync(tr.state(), &BTreeSet::new(), true)?;
    let full = t.elapsed();
    synced();
    let mut lat: [Vec<Duration>; 3] = Default::default();
    for g in 1..=o.changes as u32 {
        lat[0].push(change(&mut tr, &mut dp, None, &replacement(n, m, g)?.1)?);
        synced();
    }
    for g in 1..=o.changes as u32 {
        lat[1].push(change(&mut tr, &mut dp, None, &growth(n, m, g)?)?);
        synced();
    }
    for (s, sl) in &additions(n, m, affinity, o.changes)? {
        lat[2].push(change(&mut tr, &mut dp, Some(s), sl)?);
        synced();
    }
    Ok((full, lat))
}

/// What a Service added costs the kernel, by its parts: transactions of
/// one operation or two, each sent `times` times on the table as the replay
/// left it and undone (untimed) before the next. Made from `added`, a
/// Service added's transactions: its element in the Service map (a fresh
/// address, 198.51.100.1) sending to its chain, which exists by then; the
/// same element sending to a new empty chain, added in the transaction;
/// that chain alone; an element in the ClusterIP set (a plain set: no
/// verdict, no chain, what any transaction costs the kernel at this size).
/// Each pair is (timed, undo), encoded beforehand.
fn probes(added: &[Transaction], times: usize) -> Result<[Vec<(Batch, Batch)>; 4]> {
    let found = added.iter().find_map(|tx| {
        tx.ops.iter().find_map(|op| match &op.object {
            Object::Elements { set, elems } => elems.iter().find_map(|e| match e {
                (
                    ElemKey::IpProtoPort(_, p, port),
                    Some(ElemValue::Verdict(v @ Verdict::Goto(_))),
                ) => Some((
                    tx,
                    *set,
                    ElemKey::IpProtoPort(PROBE_IP, *p, *port),
                    v.clone(),
                )),
                _ => None,
            }),
            _ => None,
        })
    });
    let Some((tx, set, key, existing)) = found else {
        bail!("no Service map element in a Service added");
    };
    let plain = added.iter().find_map(|tx| {
        tx.ops.iter().find_map(|op| match &op.object {
            Object::Elements { set, elems } => elems
                .iter()
                .any(|e| matches!(e, (ElemKey::Ip(_), None)))
                .then_some(*set),
            _ => None,
        })
    });
    let Some(plain) = plain else {
        bail!("no ClusterIP set element in a Service added");
    };
    let plain_elem = || Object::Elements {
        set: plain,
        elems: vec![(ElemKey::Ip(PROBE_IP), None)],
    };
    let chain = || Object::Chain(Chain::regular("kp-floor-probe"));
    let elem = |v: Option<Verdict>| Object::Elements {
        set,
        elems: vec![(key.clone(), v.map(ElemValue::Verdict))],
    };
    let new = Some(Verdict::Goto("kp-floor-probe".into()));
    let tx = || Transaction::new(tx.family, tx.table.clone());
    let (mut to_existing, mut to_new, mut chain_alone, mut in_set) = (tx(), tx(), tx(), tx());
    to_existing.add(elem(Some(existing)));
    to_new.add(chain()).add(elem(new));
    chain_alone.add(chain());
    in_set.add(plain_elem());
    let (mut undo_elem, mut undo_both, mut undo_chain, mut undo_set) = (tx(), tx(), tx(), tx());
    undo_elem.delete(elem(None));
    undo_both.delete(elem(None)).delete(chain());
    undo_chain.delete(chain());
    undo_set.delete(plain_elem());
    let pairs = [
        (to_existing, undo_elem),
        (to_new, undo_both),
        (chain_alone, undo_chain),
        (in_set, undo_set),
    ];
    let mut out: [Vec<(Batch, Batch)>; 4] = Default::default();
    for (o, (t, u)) in out.iter_mut().zip(&pairs) {
        for _ in 0..times {
            o.push((NftNetlink::encode(t)?, NftNetlink::encode(u)?));
        }
    }
    Ok(out)
}

const PROBE_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1));

/// `b` sent; how long until the kernel acknowledged it.
fn send(sock: &mut NftSocket, b: &Batch, what: &str) -> Result<Duration> {
    let t = Instant::now();
    let acks = sock
        .send_batch(b)
        .map_err(|e| anyhow!("{what}: {}: {}", e.step, e.source))?;
    let d = t.elapsed();
    if let Some(a) = acks.iter().find(|a| a.errno != 0) {
        bail!("{what} refused: errno {}", a.errno);
    }
    Ok(d)
}

/// One size: ours and the floor for `n` Services; the row of the first
/// table (full sync, endpoint replaced) and of the second (the other
/// changes, the probes).
fn run(o: &Opts, n: u32, m: u32, affinity: bool, home: &std::fs::File) -> Result<[String; 2]> {
    let ns = |tag: &str| format!("kpfloor{}{tag}", std::process::id());
    let (our_full, mut our_lat) = in_namespace(&ns("o"), home, |_| {
        ours(o, n, m, affinity, Box::new(NftNetlink::new()), &mut || {})
    })?;
    let kept = Arc::new(Mutex::new(Vec::new()));
    // After each sync, how many transactions were kept so far: sync `i`'s
    // are `marks[i - 1]..marks[i]`.
    let mut marks = vec![0];
    in_namespace(&ns("k"), home, |_| {
        let keep = Keep {
            inner: NftNetlink::new(),
            kept: kept.clone(),
        };
        let mut mark = || marks.push(kept.lock().map_or(0, |k| k.len()));
        ours(o, n, m, affinity, Box::new(keep), &mut mark).map(|_| ())
    })?;
    let txs = std::mem::take(&mut *kept.lock().map_err(|_| anyhow!("poisoned"))?);
    let syncs: Vec<_> = marks.windows(2).map(|w| w[0]..w[1]).collect();
    let Some(full_txs) = syncs.first().cloned() else {
        bail!("no sync was kept");
    };
    // Encoded before anything is timed: the floor is the socket and the
    // kernel. The full sync's encoding is timed on its own: it is part of
    // what ours adds.
    let t = Instant::now();
    let mut batches = txs[full_txs.clone()]
        .iter()
        .map(NftNetlink::encode)
        .collect::<Result<Vec<_>, _>>()?;
    let encode_full = t.elapsed();
    for tx in &txs[full_txs.end..] {
        batches.push(NftNetlink::encode(tx)?);
    }
    let added = syncs.get(1 + 2 * o.changes).cloned().unwrap_or_default();
    let probes = probes(&txs[added], o.changes)?;
    // Every commit walks every chain of the namespace's tables (the kernel's
    // nf_tables_commit, making the new rules visible): what the set element
    // probe costs should follow this.
    let chains = txs[full_txs.clone()]
        .iter()
        .flat_map(|t| &t.ops)
        .filter(|op| {
            matches!(op.object, Object::Chain(_)) && matches!(op.verb, Verb::Add | Verb::Create)
        })
        .count();
    drop(txs);
    let (times, probed) = in_namespace(&ns("f"), home, |_| {
        let mut sock = NftSocket::new();
        let times = batches
            .iter()
            .enumerate()
            .map(|(i, b)| send(&mut sock, b, &format!("batch {i}")))
            .collect::<Result<Vec<_>>>()?;
        let mut probed: [Vec<Duration>; 4] = Default::default();
        for (p, batches) in probed.iter_mut().zip(&probes) {
            for (t, u) in batches {
                p.push(send(&mut sock, t, "probe")?);
                send(&mut sock, u, "probe undone")?;
            }
        }
        Ok((times, probed))
    })?;
    // A change's floor: its transactions (one, or none when ours sent
    // nothing; an affinity endpoint's records are forgotten in a second
    // one, which the bench never sends as no client was recorded).
    let sum = |r: &std::ops::Range<usize>| times[r.clone()].iter().sum::<Duration>();
    let floor_full = sum(&full_txs);
    let mut floor_lat: Vec<Vec<Duration>> = syncs[1..]
        .chunks(o.changes)
        .map(|c| c.iter().map(sum).collect())
        .collect();
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
    let mut pair = |k: usize| {
        let (ours, floor) = (&mut our_lat[k], &mut floor_lat[k]);
        let r = ratio(pct(ours, 0.5), pct(floor, 0.5));
        format!("{} ms | {} ms | {r:.2}", p50_p99(ours), p50_p99(floor))
    };
    let (replaced, grown, added) = (pair(0), pair(1), pair(2));
    let [mut to_existing, mut to_new, mut chain_alone, mut in_set] = probed;
    Ok([
        format!(
            "| {n} | {} ms | {} ms | {} ms | {:.2} | {replaced} |",
            ms(our_full),
            ms(encode_full),
            ms(floor_full),
            ratio(our_full, floor_full),
        ),
        format!(
            "| {n} | {grown} | {added} | {} ms | {} ms | {} ms | {} ms | {chains} |",
            p50_p99(&mut to_existing),
            p50_p99(&mut to_new),
            p50_p99(&mut chain_alone),
            p50_p99(&mut in_set),
        ),
    ])
}

/// `kp-bench nftables --floor`: both tables, the first's rows as each size is done.
pub fn tables(o: &Opts, sizes: &[u32], m: u32, affinity: bool, home: &std::fs::File) -> Result<()> {
    println!("| Services | full sync: ours | of which encoding the batch | kernel floor | ours / floor | 1 endpoint replaced p50 / p99: ours | kernel floor | ours / floor (p50) |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut second = Vec::new();
    for &n in sizes {
        let [first, other] = run(o, n, m, affinity, home)?;
        println!("{first}");
        second.push(other);
    }
    println!();
    println!("| Services | 1 endpoint added p50 / p99: ours | kernel floor | ours / floor (p50) | a Service added p50 / p99: ours | kernel floor | ours / floor (p50) | kernel alone: 1 Service map element, to an existing chain | a new chain and 1 element to it | a new chain alone | 1 ClusterIP set element (no verdict, no chain) | chains in the table |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for row in second {
        println!("{row}");
    }
    Ok(())
}
