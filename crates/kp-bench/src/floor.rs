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

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_model::{ChangeTracker, Dataplane, DataplaneError, IpFamily, LocalDetector, ProxierConfig};
use kp_nftables::types::ElemKey;
use kp_nftables::{NftBackend, NftNetlink, NftablesProxier, Transaction};

use super::{enter_netns_file, ms, p50_p99, replacement, tracker, Netns, Opts};

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

fn config() -> ProxierConfig {
    let mut pc = ProxierConfig::new(IpFamily::V4);
    pc.local_detector = LocalDetector::Cidrs(vec!["10.128.0.0/9".parse().expect("cidr")]);
    pc
}

/// kp-bench's cluster in a fresh tracker.
fn cluster(n: u32, m: u32, affinity: bool) -> Result<ChangeTracker> {
    let syn = kp_bench::cluster_with(n, m, affinity);
    let mut tr = tracker();
    let now = SystemTime::now();
    for s in syn.services {
        let s: Service = serde_json::from_value(s)?;
        let _ = tr.update_service(&s, now);
    }
    for s in syn.slices {
        let s: EndpointSlice = serde_json::from_value(s)?;
        let _ = tr.update_endpoint_slice(&s, now);
    }
    tr.take_changes();
    Ok(tr)
}

/// Runs `f` inside a fresh namespace named after `tag`, then comes home.
fn in_namespace<T>(tag: &str, home: &std::fs::File, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let ns = format!("kpfloor{}{tag}", std::process::id());
    if !std::process::Command::new("ip")
        .args(["netns", "add", &ns])
        .status()?
        .success()
    {
        bail!("ip netns add {ns} failed (run as root)");
    }
    let guard = Netns(ns.clone());
    let file = std::fs::File::open(format!("/run/netns/{ns}"))?;
    enter_netns_file(&file).with_context(|| format!("entering {ns}"))?;
    let r = f();
    enter_netns_file(home)?;
    drop(guard);
    r
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
    let mut dp = NftablesProxier::new(config(), backend);
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
    let (our_full, mut our_lat) = in_namespace("o", home, || {
        ours(o, n, m, affinity, Box::new(NftNetlink::new()))
    })?;
    let kept = Arc::new(Mutex::new(Vec::new()));
    in_namespace("k", home, || {
        let keep = Keep {
            inner: NftNetlink::new(),
            kept: kept.clone(),
        };
        ours(o, n, m, affinity, Box::new(keep)).map(|_| ())
    })?;
    let txs = std::mem::take(&mut *kept.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
    // Encoded before anything is timed: the floor is the socket and the kernel.
    let batches = txs
        .iter()
        .map(NftNetlink::encode)
        .collect::<Result<Vec<_>, _>>()?;
    drop(txs);
    let times = in_namespace("f", home, || {
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
    let p50 = |v: &mut Vec<Duration>| -> Duration {
        v.sort();
        v.get(v.len() / 2).copied().unwrap_or_default()
    };
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
    let (ours_p50, floor_p50) = (p50(&mut our_lat), p50(&mut floor_lat));
    Ok(format!(
        "| {n} | {} ms | {} ms | {:.2} | {} ms | {} ms | {:.2} |",
        ms(our_full),
        ms(*floor_full),
        ratio(our_full, *floor_full),
        p50_p99(&mut our_lat),
        p50_p99(&mut floor_lat),
        ratio(ours_p50, floor_p50),
    ))
}
