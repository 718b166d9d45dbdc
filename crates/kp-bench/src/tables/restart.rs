//! `kp-bench nftables --restart`: a restart's first sync over the table the killed
//! process left, adopted (read back, only the difference sent), against
//! replacing the table whole (what every restart did before). Each is
//! timed from the new proxier's creation to its first sync done, with the
//! cluster already in the tracker (the source synced), in one namespace
//! that keeps the table between them. nftables, or iptables-nft over
//! netlink (`kp-bench iptables --restart`: the chains read back and adopted).

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Result};
use kp_iptables::{IptablesNetlink, IptablesProxier};
use kp_model::{Dataplane, IpFamily};
use kp_nftables::{NftNetlink, NftablesProxier};

use super::floor::cluster;
use super::{in_namespace, ms, pct, proxier_config, replacement};

/// Restarts timed per kind.
const RUNS: usize = 3;

pub fn tables(
    iptables: bool,
    sizes: &[u32],
    m: u32,
    affinity: bool,
    home: &std::fs::File,
) -> Result<()> {
    println!("| Services | first full sync | restart, nothing changed: adopted p50 / max (of which reading the table back; operations sent) | restart, 1% of the Services' endpoints changed while down: adopted (operations sent) | restart replacing the table p50 / max |");
    println!("|---|---|---|---|---|");
    for &n in sizes {
        println!("{}", run(iptables, n, m, affinity, home)?);
    }
    Ok(())
}

/// A new proxier, as a restarted process makes it.
enum Proxy {
    Nft(Box<NftablesProxier>),
    Ipt(Box<IptablesProxier>),
}

impl Proxy {
    fn new(iptables: bool, adopt: bool) -> Proxy {
        if iptables {
            Proxy::Ipt(Box::new(
                IptablesProxier::new(
                    proxier_config(),
                    Box::new(IptablesNetlink::new(IpFamily::V4)),
                )
                .with_route_localnet(false)
                .with_adoption(adopt),
            ))
        } else {
            Proxy::Nft(Box::new(
                NftablesProxier::new(proxier_config(), Box::new(NftNetlink::new()))
                    .with_adoption(adopt),
            ))
        }
    }

    fn dp(&mut self) -> &mut dyn Dataplane {
        match self {
            Proxy::Nft(p) => p.as_mut(),
            Proxy::Ipt(p) => p.as_mut(),
        }
    }

    /// How long its first sync read back what it adopted.
    fn adopted_read(&self) -> Option<Duration> {
        match self {
            Proxy::Nft(p) => p.adoption().map(|a| a.read),
            Proxy::Ipt(p) => p.adoption().filter(|a| a.found_previous()).map(|a| a.read),
        }
    }
}

fn run(iptables: bool, n: u32, m: u32, affinity: bool, home: &std::fs::File) -> Result<String> {
    let ns = format!("kprestart{}", std::process::id());
    let proxier = |adopt| Proxy::new(iptables, adopt);
    in_namespace(&ns, home, |_| {
        let none = BTreeSet::new();
        let mut tr = cluster(n, m, affinity)?;
        let t = Instant::now();
        proxier(true).dp().sync(tr.state(), &none, true)?;
        let full = t.elapsed();
        // Nothing changed: each restart finds the table as the last left it.
        let (mut adopted, mut read, mut sent) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..RUNS {
            let t = Instant::now();
            let mut dp = proxier(true);
            let r = dp.dp().sync(tr.state(), &none, true)?;
            adopted.push(t.elapsed());
            let Some(a) = dp.adopted_read() else {
                bail!("the restart did not adopt the table");
            };
            read.push(a);
            sent.push(r.ops);
        }
        // Changed while down: one endpoint replaced in 1% of the Services.
        let now = SystemTime::now();
        for g in 1..=(n / 100).max(1) {
            let _ = tr.update_endpoint_slice(&replacement(n, m, 100_000 + g)?.1, now);
        }
        tr.take_changes();
        let t = Instant::now();
        let r = proxier(true).dp().sync(tr.state(), &none, true)?;
        let changed = format!("{} ms ({})", ms(t.elapsed()), r.ops);
        let mut replaced = Vec::new();
        for _ in 0..RUNS {
            let t = Instant::now();
            proxier(false).dp().sync(tr.state(), &none, true)?;
            replaced.push(t.elapsed());
        }
        let max = |v: &[Duration]| v.iter().max().copied().map_or_else(String::new, ms);
        sent.sort();
        Ok(format!(
            "| {n} | {} ms | {} / {} ms ({} ms; {}) | {changed} | {} / {} ms |",
            ms(full),
            ms(pct(&mut adopted.clone(), 0.5)),
            max(&adopted),
            ms(pct(&mut read, 0.5)),
            sent.iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            ms(pct(&mut replaced.clone(), 0.5)),
            max(&replaced),
        ))
    })
}
