//! When each node's kernel shows a change: a netlink socket per node
//! namespace subscribed to nf_tables' notifications (NFNLGRP_NFTABLES, what
//! `nft monitor` reads), each read on its own thread and timestamped as it
//! arrives. The kernel sends them while it commits a transaction, so the
//! arrival of a rule or set element naming an address is when that node's
//! dataplane starts using it, with no polling delay of ours.
//!
//! A watch is an IPv4 address: the first NEWRULE or NEWSETELEM notification
//! holding its four bytes (at an attribute-aligned offset, where nf_tables
//! puts addresses, also inside concatenated keys) marks it seen on that node.
//! Every notification also counts, so a window can tell whether a node's
//! rules were written at all.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result};
use kp_netlink::{Protocol, Socket, Wait, NLMSG_HDRLEN};

use crate::lab::now_unix;

/// nfnetlink's subsystem of nf_tables (the high byte of a message type).
const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// The multicast group nf_tables notifies (linux/netfilter/nfnetlink.h).
const NFNLGRP_NFTABLES: u32 = 7;
/// nf_tables message types (linux/netfilter/nf_tables.h).
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_DELRULE: u16 = 8;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFT_MSG_NEWGEN: u16 = 15;
/// Room for the notifications of a whole first sync queued while the reader
/// is off the CPU (2 cores shared with K proxies and the API server).
const RECV_BUFFER: usize = 256 << 20;

/// What one node's reader has seen.
#[derive(Default)]
struct Node {
    /// Address (as a big-endian u32) -> watch ids waiting for it.
    wanted: Mutex<HashMap<u32, Vec<usize>>>,
    /// Watch id -> unix time its address first arrived.
    seen: Mutex<HashMap<usize, f64>>,
    /// Rules and set elements added or deleted.
    rule_changes: AtomicU64,
    /// Transactions committed (NEWGEN, one per commit).
    commits: AtomicU64,
    /// Times the socket's queue overflowed (ENOBUFS): notifications lost.
    overflows: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Poison only means a reader panicked; the maps stay usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Node {
    fn message(&self, ty: u16, bytes: &[u8], at: f64) {
        if ty >> 8 != NFNL_SUBSYS_NFTABLES {
            return;
        }
        match ty & 0xff {
            NFT_MSG_NEWGEN => {
                self.commits.fetch_add(1, Ordering::Relaxed);
            }
            NFT_MSG_DELRULE | NFT_MSG_DELSETELEM => {
                self.rule_changes.fetch_add(1, Ordering::Relaxed);
            }
            NFT_MSG_NEWRULE | NFT_MSG_NEWSETELEM => {
                self.rule_changes.fetch_add(1, Ordering::Relaxed);
                let mut wanted = lock(&self.wanted);
                if wanted.is_empty() {
                    return;
                }
                let mut off = NLMSG_HDRLEN;
                while off + 4 <= bytes.len() {
                    let word = u32::from_be_bytes([
                        bytes[off],
                        bytes[off + 1],
                        bytes[off + 2],
                        bytes[off + 3],
                    ]);
                    if let Some(ids) = wanted.remove(&word) {
                        let mut seen = lock(&self.seen);
                        for id in ids {
                            seen.entry(id).or_insert(at);
                        }
                    }
                    off += 4;
                }
            }
            _ => {}
        }
    }
}

/// One reader per node namespace; stopped and joined on drop.
pub struct Monitor {
    nodes: Vec<Arc<Node>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    next_id: AtomicU64,
}

/// nf_tables counters of one node at one moment.
#[derive(Clone, Copy, Default, Debug)]
pub struct Counts {
    pub rule_changes: u64,
    pub commits: u64,
    pub overflows: u64,
}

impl Monitor {
    /// Subscribes in each of `namespaces` (node 1 first).
    pub fn start(namespaces: &[String]) -> Result<Monitor> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut m = Monitor {
            nodes: Vec::new(),
            stop: stop.clone(),
            threads: Vec::new(),
            next_id: AtomicU64::new(0),
        };
        for ns in namespaces {
            // The socket belongs to the namespace it was opened in.
            let mut sock = kp_netlab::in_netns(ns, || -> std::io::Result<Socket> {
                let s = Socket::open(Protocol::Netfilter)?;
                s.set_recv_buffer(RECV_BUFFER)?;
                s.join_group(NFNLGRP_NFTABLES)?;
                Ok(s)
            })
            .with_context(|| format!("entering {ns}"))?
            .with_context(|| format!("subscribing to nf_tables notifications in {ns}"))?;
            sock.set_recv_timeout(Duration::from_millis(200))
                .context("SO_RCVTIMEO")?;
            let node = Arc::new(Node::default());
            let (n, stop) = (node.clone(), stop.clone());
            let ns = ns.clone();
            let t = std::thread::Builder::new()
                .name(format!("nft-monitor-{ns}"))
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let r = sock.recv_each(Wait::Block, |msg| {
                            n.message(msg.ty, msg.bytes, now_unix());
                            false
                        });
                        match r {
                            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                                n.overflows.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                            Err(e) => {
                                eprintln!("nf_tables monitor in {ns}: {e}");
                                std::thread::sleep(Duration::from_millis(50));
                            }
                            Ok(_) => {}
                        }
                    }
                })
                .context("starting a monitor thread")?;
            m.nodes.push(node);
            m.threads.push(t);
        }
        Ok(m)
    }

    /// Watches for `ip` on every node; the watch's id.
    pub fn watch(&self, ip: Ipv4Addr) -> usize {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) as usize;
        for n in &self.nodes {
            lock(&n.wanted).entry(u32::from(ip)).or_default().push(id);
        }
        id
    }

    /// When node `node` (1-based) first showed watch `id` (unix seconds).
    pub fn seen(&self, node: usize, id: usize) -> Option<f64> {
        lock(&self.nodes[node - 1].seen).get(&id).copied()
    }

    /// Forgets every watch not seen yet (a scenario gave up on them).
    pub fn clear(&self) {
        for n in &self.nodes {
            lock(&n.wanted).clear();
        }
    }

    pub fn counts(&self, node: usize) -> Counts {
        let n = &self.nodes[node - 1];
        Counts {
            rule_changes: n.rule_changes.load(Ordering::Relaxed),
            commits: n.commits.load(Ordering::Relaxed),
            overflows: n.overflows.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
