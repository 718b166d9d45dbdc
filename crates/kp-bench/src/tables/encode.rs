//! `kp-bench iptables --encode`: what iptables mode (iptables-nft
//! over netlink) spends before a batch can leave, with no kernel in the
//! figures: a sync's render and the encoding of its rules into one nf_tables
//! batch, for a full sync and for one endpoint replaced. The proxier writes
//! into a writer that encodes what it is given and sends nothing; it lists
//! no chain and finds every jump in place, so the reads a sync makes of the
//! kernel are not in the figures either. Each size runs in a fresh network
//! namespace (encoding asks the kernel once which tables exist).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Result;
use kp_iptables::{Adopted, IptablesNetlink, IptablesProxier, Jump, Restore, Writer};
use kp_model::{Dataplane, DataplaneError, IpFamily};

use super::floor::cluster;
use super::{in_namespace, ms, pct, proxier_config, replacement, rss_mib};

/// Full syncs timed per size.
const FULL_RUNS: usize = 5;

/// The last input's encoding: (time, batch bytes).
type Encoded = Arc<Mutex<Option<(Duration, usize)>>>;

/// Encodes every restore input as [`IptablesNetlink`] would before sending
/// it, and sends nothing.
struct EncodeOnly {
    nl: IptablesNetlink,
    last: Encoded,
}

impl Writer for EncodeOnly {
    fn restore(&mut self, input: &Restore<'_>) -> Result<usize, DataplaneError> {
        let t = Instant::now();
        let batch = self.nl.encode_input(input)?;
        let took = t.elapsed();
        if let Ok(mut l) = self.last.lock() {
            *l = Some((took, batch.bytes()));
        }
        Ok(batch.bytes())
    }
    fn restore_adopting(
        &mut self,
        input: &Restore<'_>,
    ) -> Result<(usize, Option<Adopted>), DataplaneError> {
        self.restore(input).map(|bytes| (bytes, None))
    }
    fn chains(&mut self, _: &str) -> Result<Vec<String>, DataplaneError> {
        Ok(Vec::new())
    }
    fn survey(&mut self, _: &str, _: &[Jump]) -> Result<(Vec<String>, Vec<Jump>), DataplaneError> {
        Ok((Vec::new(), Vec::new()))
    }
    fn missing_jumps(&mut self, _: &str, _: &[Jump]) -> Result<Vec<Jump>, DataplaneError> {
        Ok(Vec::new())
    }
    fn chain_exists(&mut self, _: &str, _: &str) -> Result<bool, DataplaneError> {
        Ok(true)
    }
    fn jump_exists(&mut self, _: &Jump) -> Result<bool, DataplaneError> {
        Ok(true)
    }
    fn delete_jump(&mut self, _: &Jump) -> Result<(), DataplaneError> {
        Ok(())
    }
}

/// One sync: (render, encoding, batch bytes); no encoding when nothing was
/// written.
fn sync(
    dp: &mut IptablesProxier,
    last: &Encoded,
    tr: &kp_model::ChangeTracker,
    changed: &BTreeSet<kp_model::ServicePortName>,
    full: bool,
) -> Result<(Duration, Duration, usize)> {
    if let Ok(mut l) = last.lock() {
        *l = None;
    }
    let r = dp.sync(tr.state(), changed, full)?;
    let (encode, bytes) = last.lock().ok().and_then(|l| *l).unwrap_or_default();
    Ok((r.render, encode, bytes))
}

fn row(o: &super::Opts, n: u32, m: u32, affinity: bool) -> Result<String> {
    let mut tr = cluster(n, m, affinity)?;
    let last = Encoded::default();
    let writer = EncodeOnly {
        nl: IptablesNetlink::new(IpFamily::V4),
        last: last.clone(),
    };
    let mut dp = IptablesProxier::new(proxier_config(), Box::new(writer))
        .with_route_localnet(false)
        .with_adoption(false);
    let (mut total, mut render, mut encode) = (Vec::new(), Vec::new(), Vec::new());
    let mut batch = 0;
    for _ in 0..FULL_RUNS {
        let (r, e, b) = sync(&mut dp, &last, &tr, &BTreeSet::new(), true)?;
        total.push(r + e);
        render.push(r);
        encode.push(e);
        batch = b;
    }
    let (mut ch, mut ch_render, mut ch_encode) = (Vec::new(), Vec::new(), Vec::new());
    for g in 1..=o.changes as u32 {
        let (_, s) = replacement(n, m, g)?;
        let _ = tr.update_endpoint_slice(&s, SystemTime::now());
        let cs = tr.take_changes();
        let (r, e, _) = sync(&mut dp, &last, &tr, &cs.changed, false)?;
        ch.push(r + e);
        ch_render.push(r);
        ch_encode.push(e);
    }
    let p50 = |v: &mut Vec<Duration>| ms(pct(v, 0.5));
    Ok(format!(
        "| {n} | {} ms ({} + {}) | {}-{} ms | {:.1} MiB | {} / {} ms ({} + {}) | {:.0} / {:.0} MiB |",
        p50(&mut total),
        p50(&mut render),
        p50(&mut encode),
        ms(pct(&mut total, 0.0)),
        ms(pct(&mut total, 1.0)),
        batch as f64 / 1048576.0,
        p50(&mut ch),
        ms(pct(&mut ch, 0.99)),
        p50(&mut ch_render),
        p50(&mut ch_encode),
        rss_mib("VmRSS:"),
        rss_mib("VmHWM:"),
    ))
}

/// `kp-bench iptables --encode`: one row per size.
pub fn tables(
    o: &super::Opts,
    sizes: &[u32],
    m: u32,
    affinity: bool,
    home: &std::fs::File,
) -> Result<()> {
    println!("| Services | full sync: render + encode p50 (render + encode) | min-max of {FULL_RUNS} | batch | 1 endpoint replaced: render + encode p50 / p99 (render + encode p50) | bench RSS at the end / peak |");
    println!("|---|---|---|---|---|---|");
    for &n in sizes {
        let ns = format!("kpencode{}x{n}", std::process::id());
        println!("{}", in_namespace(&ns, home, |_| row(o, n, m, affinity))?);
    }
    Ok(())
}
