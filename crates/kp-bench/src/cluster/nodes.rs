//! K proxies of one kind, one per node namespace: started at once, each
//! with its own kubeconfig and `--hostname-override`, waited for until its
//! kernel serves the last Service, and stopped with its rules flushed so
//! that the other kind starts on clean nodes.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::monitor::Monitor;
use super::{interrupted, Kind};
use crate::lab::{has_ip, now_unix, proxy_args, Lab, Proxy};

/// The running proxies of one kind (node `i` is `proxies[i - 1]`); killed
/// on drop (their guards), the nodes' rules flushed by [`Fleet::stop`].
pub struct Fleet<'a> {
    pub proxies: Vec<Proxy<'a>>,
    /// Unix time each proxy was started.
    pub started: Vec<f64>,
    pub kind: Kind,
}

/// A kubeconfig of the node's own (a copy of the kind's, with the same
/// ServiceAccount's token, as a DaemonSet's pods each mount one).
fn node_kubeconfig(lab: &Lab, kind: Kind, node: usize) -> Result<PathBuf> {
    let src = match kind {
        Kind::Upstream => &lab.upstream_kubeconfig,
        Kind::Ours => &lab.ours_kubeconfig,
    };
    let dst = lab
        .cp
        .dir()
        .join(format!("node{node}-{}.kubeconfig", kind.label()));
    std::fs::copy(src, &dst)
        .with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
    Ok(dst)
}

fn binary(lab: &Lab, kind: Kind, ours: &Path) -> Result<PathBuf> {
    match kind {
        Kind::Upstream => lab
            .bins
            .kube_proxy
            .clone()
            .context("upstream kube-proxy (UPSTREAM_KUBE_PROXY_BIN)"),
        Kind::Ours => Ok(ours.to_path_buf()),
    }
}

impl<'a> Fleet<'a> {
    /// Starts `k` proxies of `kind` on nodes 1..=k, back to back (nftables
    /// mode, the lab's flags).
    pub fn start(
        cluster: &'a kp_netlab::Cluster,
        lab: &Lab,
        kind: Kind,
        ours: &Path,
        k: usize,
        label: &str,
    ) -> Result<Fleet<'a>> {
        let bin = binary(lab, kind, ours)?;
        let kcs: Vec<PathBuf> = (1..=k)
            .map(|i| node_kubeconfig(lab, kind, i))
            .collect::<Result<_>>()?;
        let mut fleet = Fleet {
            proxies: Vec::with_capacity(k),
            started: Vec::with_capacity(k),
            kind,
        };
        for (i, kc) in (1..=k).zip(&kcs) {
            let log = lab
                .cp
                .dir()
                .join(format!("{label}-{}-node{i}.log", kind.label()));
            let args = proxy_args("nftables", kc, i);
            fleet.started.push(now_unix());
            let guard = cluster
                .spawn(cluster.node_ns(i), &bin, &args, &log)
                .with_context(|| format!("starting {} on node{i}", kind.label()))?;
            fleet.proxies.push(Proxy {
                cluster,
                node: i,
                guard,
                mode: "nftables".into(),
            });
        }
        Ok(fleet)
    }

    /// Fails with the end of its log if a proxy exited.
    pub fn check_running(&self) -> Result<()> {
        for p in &self.proxies {
            if !p.guard.is_running() {
                let log = p.guard.log_contents();
                let lines: Vec<&str> = log.lines().collect();
                let tail = lines[lines.len().saturating_sub(15)..].join("\n");
                bail!(
                    "{} on node{} exited; the end of {}:\n{tail}",
                    self.kind.label(),
                    p.node,
                    p.guard.log_path().display()
                );
            }
        }
        Ok(())
    }

    /// Waits until every node's kernel has shown `last_ip` (the last Service's
    /// ClusterIP; watched before the start), at most `limit`; per node the
    /// seconds from its proxy's start. A node whose monitor lost
    /// notifications is read back (`nft list ruleset`) instead, each second.
    /// Gives up when MemAvailable falls below `floor_mib` (0: never), before
    /// the kernel's OOM killer would pick some process of the machine.
    pub fn wait_served(
        &self,
        mon: &Monitor,
        watch: usize,
        last_ip: Ipv4Addr,
        limit: Duration,
        floor_mib: f64,
    ) -> Result<Vec<f64>> {
        let t0 = Instant::now();
        let ip = last_ip.to_string();
        let mut served: Vec<Option<f64>> = vec![None; self.proxies.len()];
        let mut next_readback = Instant::now();
        loop {
            if interrupted() {
                bail!("interrupted");
            }
            let readback = Instant::now() >= next_readback;
            if readback {
                next_readback = Instant::now() + Duration::from_secs(1);
            }
            for (p, s) in self.proxies.iter().zip(served.iter_mut()) {
                if s.is_some() {
                    continue;
                }
                let started = self.started[p.node - 1];
                if let Some(at) = mon.seen(p.node, watch) {
                    *s = Some(at - started);
                } else if readback && mon.counts(p.node).overflows > 0 && has_ip(&p.ruleset(), &ip)
                {
                    *s = Some(now_unix() - started);
                }
            }
            if served.iter().all(Option::is_some) {
                return Ok(served.into_iter().flatten().collect());
            }
            self.check_running()?;
            let avail = if floor_mib > 0.0 {
                super::scenarios::mem_available()
            } else {
                f64::INFINITY
            };
            if avail < floor_mib {
                let done = served.iter().filter(|s| s.is_some()).count();
                bail!(
                    "MemAvailable fell to {avail:.0} MiB (floor {floor_mib:.0}) with {done} of {} served",
                    served.len()
                );
            }
            if t0.elapsed() > limit {
                let missing: Vec<usize> = (1..=served.len())
                    .filter(|i| served[i - 1].is_none())
                    .collect();
                bail!(
                    "{} did not serve {ip} within {limit:?} on nodes {missing:?}",
                    self.kind.label()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Each proxy's /metrics, node 1 first.
    pub fn metrics(&self) -> Vec<String> {
        self.proxies.iter().map(Proxy::metrics).collect()
    }

    /// Kills every proxy and flushes each node's ruleset.
    pub fn stop(self) -> Result<()> {
        for p in &self.proxies {
            p.guard.kill_hard();
        }
        for p in &self.proxies {
            let ns = p.cluster.node_ns(p.node);
            p.cluster
                .exec_ok(ns, &["nft", "flush", "ruleset"])
                .with_context(|| format!("flushing the ruleset of {ns}"))?;
        }
        Ok(())
    }
}

/// The kube-proxy-rs beside this binary (target/release), else `--ours`.
pub fn default_ours() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this binary")?;
    Ok(exe.with_file_name("kube-proxy-rs"))
}

/// The binary must exist before a lab of minutes is built.
pub fn check_ours(p: &Path) -> Result<()> {
    crate::lab::check_binary(p)
}
