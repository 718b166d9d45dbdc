//! Helpers the fault tests share (reliability.rs against the in-process API
//! test server and manifests, reliability_real_api.rs against a real
//! kube-apiserver): a client load that records every connection, the
//! /healthz reader, log and ruleset normalisation.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::conformance::{http_get, sa, Env, T};

/// When an attempt started and which server answered (or the error).
pub type Attempt = (Instant, Result<String, String>);

/// A client that opens a fresh TCP connection to `addr` every `period`
/// until stopped; every attempt's result is kept.
pub struct Load {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<Attempt>>>,
}

impl Load {
    pub fn start(ns: &str, addr: SocketAddr, period: Duration) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let ns = ns.to_string();
        let thread = std::thread::spawn(move || {
            // One thread inside the namespace for the whole run.
            kp_netlab::in_netns(&ns, move || {
                let mut out = Vec::new();
                while !s.load(Ordering::SeqCst) {
                    let t = Instant::now();
                    let r = hello(addr, T);
                    out.push((t, r));
                    std::thread::sleep(period.saturating_sub(t.elapsed()));
                }
                out
            })
            .unwrap()
        });
        Load {
            stop,
            thread: Some(thread),
        }
    }

    pub fn finish(mut self) -> Vec<Attempt> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// One TCP hello from the current thread's namespace: the name of the
/// server that greeted ("<name> <peer ip> <peer port>"), or what went wrong.
pub fn hello(addr: SocketAddr, timeout: Duration) -> Result<String, String> {
    use std::io::{BufRead, BufReader};
    let s = std::net::TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| format!("timeout: {e}"))?;
    let mut line = String::new();
    BufReader::new(s)
        .read_line(&mut line)
        .map_err(|e| format!("greeting: {e}"))?;
    line.split_whitespace()
        .next()
        .map(str::to_string)
        .ok_or_else(|| format!("empty greeting {line:?}"))
}

/// Fails the test with the first few failed attempts if any attempt failed.
pub fn assert_no_failures(what: &str, results: &[Attempt]) {
    let failed: Vec<_> = results.iter().filter(|(_, r)| r.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{what}: {} of {} connections failed, e.g. {:?}",
        failed.len(),
        results.len(),
        failed.iter().take(5).map(|(_, r)| r).collect::<Vec<_>>()
    );
}

/// A ruleset listing with counters and comments that vary between runs
/// removed, lines sorted: two equal values mean the same rules, none
/// missing and none doubled.
pub fn normalized(ruleset: &str) -> Vec<String> {
    let mut v: Vec<String> = ruleset
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let mut l = l.trim().to_string();
            // iptables-save chain counters "[12:720]".
            if let (Some(a), Some(b)) = (l.rfind(" ["), l.rfind(']')) {
                if b > a && l[a + 2..b].split(':').all(|n| n.parse::<u64>().is_ok()) {
                    l.truncate(a);
                }
            }
            l
        })
        .filter(|l| !l.is_empty())
        .collect();
    v.sort();
    v
}

/// Node `node`'s /healthz: status and JSON body (the body is Null when it
/// is not JSON).
pub fn healthz(env: &Env, node: usize) -> (u16, serde_json::Value) {
    let (code, body) = http_get(
        env.cluster.node_ns(node),
        sa("127.0.0.1", 10256),
        "/healthz",
    )
    .expect("/healthz answers");
    (code, serde_json::from_str(&body).unwrap_or_default())
}

/// A log with its ANSI colour codes removed.
pub fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(ch);
        }
    }
    out
}

/// Seconds since the epoch of an RFC 3339 UTC timestamp as the logs print
/// it ("2026-11-22T03:55:45.817156Z").
pub fn unix_secs(ts: &str) -> Option<f64> {
    let (date, time) = ts.trim_end_matches('Z').split_once('T')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (hh, mm) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    let ss = t.next()?.parse::<f64>().ok()?;
    // Days from civil (proleptic Gregorian).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + hh * 3600.0 + mm * 60.0 + ss)
}
