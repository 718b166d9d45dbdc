//! `kp-bench --floor`: what the kernel alone costs for our rulesets.
//!
//! The same cluster is synced three times, each in a fresh namespace: by our
//! proxier (timed: what an operator gets), by our proxier again keeping every
//! transaction it sends, and then by nothing but a netlink socket replaying
//! those transactions' batches, encoded beforehand (timed: the kernel's
//! floor for exactly these chains, rules, sets and elements). The ratio is
//! what the model, render and encoding add on top of the kernel.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Result};
use kp_model::{ChangeTracker, Dataplane, DataplaneError, IpFamily};
use kp_nftables::types::ElemKey;
use kp_nftables::{NftBackend, NftNetlink, NftablesProxier, Transaction};

use super::{
    in_namespace, ms, p50_p99, parsed_cluster, pct, proxier_config, replacement, tracker, Opts,
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
fn cluster(n: u32, m: u32, affinity: bool) -> Result<ChangeTracker> {
    let (svcs, slices) = parsed_cluster(n, m, affinity)?;
    let mut tr = tracker();
    let now = SystemTime::now();
    for s in &svcs {
        let _ = tr.update_service(s, now);
    }
    for s in &slices {
        let _ = tr.update_endpoint_slice(s, now);
    }
    tr.take_changes();
    Ok(tr)
}

/// Our proxier: the full sync, then `changes` endpoint replacements (the
/// same ones as the main table's column), each timed until in the kernel.
fn ours(
    o: &Opts,
    n: u32,
    m: u32,
    affinity: bool,
    backend: Box<dyn NftBackend>,
) -> Result<(Duration, Vec<Duration>)> {
    let mut tr = cluster(n, m, affinity)?;
    let mut dp = NftablesProxier::new(proxier_config(), backend);
    let t = Instant::now();
    dp.sync(tr.state(), &BTreeSet::new(), true)?;
    let full = t.elapsed();
    let mut lat = Vec::new();
    for g in 1..=o.changes as u32 {
        let (_, s) = replacement(n, m, g)?;
        let t = Instant::now();
        let _ = tr.update_endpoint_slice(&s, SystemTime::now());
        let cs = tr.take_changes();
        dp.sync(tr.state(), &cs.changed, false)?;
        lat.push(t.elapsed());
    }
    Ok((full, lat))
}

/// One row: ours and the floor for `n` Services.
pub fn run(o: &Opts, n: u32, m: u32, affinity: bool, home: &std::fs::File) -> Result<String> {
    let ns = |tag: &str| format!("kpfloor{}{tag}", std::process::id());
    let (our_full, mut our_lat) = in_namespace(&ns("o"), home, |_| {
        ours(o, n, m, affinity, Box::new(NftNetlink::new()))
    })?;
    let kept = Arc::new(Mutex::new(Vec::new()));
    in_namespace(&ns("k"), home, |_| {
        let keep = Keep {
            inner: NftNetlink::new(),
            kept: kept.clone(),
        };
        ours(o, n, m, affinity, Box::new(keep)).map(|_| ())
    })?;
    let txs = std::mem::take(&mut *kept.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
    // Encoded before anything is timed: the floor is the socket and the
    // kernel. The full sync's encoding is timed on its own: it is part of
    // what ours adds.
    let t = Instant::now();
    let first = txs.first().map(NftNetlink::encode).transpose()?;
    let encode_full = t.elapsed();
    let batches = first
        .into_iter()
        .map(Ok)
        .chain(txs.iter().skip(1).map(NftNetlink::encode))
        .collect::<Result<Vec<_>, _>>()?;
    drop(txs);
    let times = in_namespace(&ns("f"), home, |_| {
        let mut sock = kp_netlink::nftables::NftSocket::new();
        let mut times = Vec::new();
        for (i, b) in batches.iter().enumerate() {
            let t = Instant::now();
            let acks = sock
                .send_batch(b)
                .map_err(|e| anyhow::anyhow!("batch {i}: {}: {}", e.step, e.source))?;
            times.push(t.elapsed());
            if let Some(a) = acks.iter().find(|a| a.errno != 0) {
                bail!("batch {i} refused: errno {}", a.errno);
            }
        }
        Ok(times)
    })?;
    let Some((floor_full, rest)) = times.split_first() else {
        bail!("no batch was kept");
    };
    // A change may take more than one transaction (an affinity endpoint's
    // records are forgotten in a second one); the bench sends none then, as
    // nothing has recorded a client.
    let mut floor_lat = rest.to_vec();
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
    let (ours_p50, floor_p50) = (pct(&mut our_lat, 0.5), pct(&mut floor_lat, 0.5));
    Ok(format!(
        "| {n} | {} ms | {} ms | {} ms | {:.2} | {} ms | {} ms | {:.2} |",
        ms(our_full),
        ms(encode_full),
        ms(*floor_full),
        ratio(our_full, *floor_full),
        p50_p99(&mut our_lat),
        p50_p99(&mut floor_lat),
        ratio(ours_p50, floor_p50),
    ))
}
