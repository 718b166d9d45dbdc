//! Pure endpoint choice: round robin, least connections, ClientIP affinity.
//! No I/O and no clock reads: callers pass `now`.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::time::{Duration, Instant};

/// How a new connection picks among a Service's endpoints
/// (`--userspace-balancer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// Each endpoint in turn.
    #[default]
    RoundRobin,
    /// The endpoint with the fewest open connections (ties in turn).
    LeastConnections,
}

impl Algorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::RoundRobin => "round-robin",
            Algorithm::LeastConnections => "least-connections",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "round-robin" | "rr" => Ok(Algorithm::RoundRobin),
            "least-connections" | "lc" => Ok(Algorithm::LeastConnections),
            other => Err(format!(
                "unknown balancer {other:?} (expected round-robin or least-connections)"
            )),
        }
    }
}

/// Picks one of `n` endpoints. `cursor` is a counter the caller advances on
/// every pick (round robin position, and the tie-breaker for least
/// connections); `active(i)` is endpoint i's open connection count and
/// `excluded(i)` skips endpoints already tried for this connection.
pub fn pick(
    n: usize,
    cursor: usize,
    algo: Algorithm,
    active: impl Fn(usize) -> usize,
    excluded: impl Fn(usize) -> bool,
) -> Option<usize> {
    if n == 0 {
        return None;
    }
    let order = (0..n).map(|k| (cursor.wrapping_add(k)) % n);
    match algo {
        Algorithm::RoundRobin => order.into_iter().find(|&i| !excluded(i)),
        Algorithm::LeastConnections => {
            let mut best: Option<(usize, usize)> = None;
            for i in order {
                if excluded(i) {
                    continue;
                }
                let a = active(i);
                if best.is_none_or(|(_, b)| a < b) {
                    best = Some((i, a));
                }
            }
            best.map(|(i, _)| i)
        }
    }
}

/// sessionAffinity ClientIP: the endpoint each client IP last used, kept for
/// `timeout` after its last connection (upstream's `recent --rcheck --seconds`
/// refreshed by every connection).
#[derive(Debug)]
pub struct AffinityTable {
    timeout: Duration,
    map: HashMap<IpAddr, (SocketAddr, Instant)>,
    last_gc: Option<Instant>,
}

impl AffinityTable {
    pub fn new(timeout: Duration) -> Self {
        AffinityTable {
            timeout,
            map: HashMap::new(),
            last_gc: None,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The endpoint `client` is stuck to, unless the entry expired.
    pub fn lookup(&mut self, client: IpAddr, now: Instant) -> Option<SocketAddr> {
        match self.map.get(&client) {
            Some((ep, t)) if now.saturating_duration_since(*t) < self.timeout => Some(*ep),
            Some(_) => {
                self.map.remove(&client);
                None
            }
            None => None,
        }
    }

    /// Records (or refreshes) `client -> endpoint`. Expired entries are swept
    /// at most once per timeout, so the table stays bounded by the clients of
    /// one timeout window.
    pub fn record(&mut self, client: IpAddr, endpoint: SocketAddr, now: Instant) {
        self.map.insert(client, (endpoint, now));
        let due = self
            .last_gc
            .is_none_or(|g| now.saturating_duration_since(g) >= self.timeout);
        if due {
            let timeout = self.timeout;
            self.map
                .retain(|_, (_, t)| now.saturating_duration_since(*t) < timeout);
            self.last_gc = Some(now);
        }
    }

    /// Drops every client stuck to `endpoint` (it went away).
    pub fn forget_endpoint(&mut self, endpoint: SocketAddr) {
        self.map.retain(|_, (ep, _)| *ep != endpoint);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(i: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, i], 80))
    }

    #[test]
    fn round_robin_cycles_and_skips_excluded() {
        let picks: Vec<usize> = (0..6)
            .map(|c| pick(3, c, Algorithm::RoundRobin, |_| 0, |_| false).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        // Endpoint 1 refused: the retry goes to the next one.
        assert_eq!(
            pick(3, 1, Algorithm::RoundRobin, |_| 0, |i| i == 1),
            Some(2)
        );
        assert_eq!(pick(3, 0, Algorithm::RoundRobin, |_| 0, |_| true), None);
        assert_eq!(pick(0, 0, Algorithm::RoundRobin, |_| 0, |_| false), None);
    }

    #[test]
    fn least_connections_prefers_idle_and_rotates_ties() {
        let active = [5usize, 1, 3];
        assert_eq!(
            pick(3, 0, Algorithm::LeastConnections, |i| active[i], |_| false),
            Some(1)
        );
        assert_eq!(
            pick(3, 0, Algorithm::LeastConnections, |i| active[i], |i| i == 1),
            Some(2)
        );
        // All equal: the cursor decides, so ties spread in turn.
        let picks: Vec<usize> = (0..3)
            .map(|c| pick(3, c, Algorithm::LeastConnections, |_| 2, |_| false).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2]);
        // A huge cursor does not overflow.
        assert!(pick(3, usize::MAX, Algorithm::LeastConnections, |_| 0, |_| false).is_some());
    }

    #[test]
    fn algorithm_parses_flag_values() {
        assert_eq!("round-robin".parse(), Ok(Algorithm::RoundRobin));
        assert_eq!("lc".parse(), Ok(Algorithm::LeastConnections));
        assert!("random".parse::<Algorithm>().is_err());
        assert_eq!(Algorithm::LeastConnections.to_string(), "least-connections");
    }

    #[test]
    fn affinity_sticks_until_timeout_after_last_use() {
        let t0 = Instant::now();
        let mut t = AffinityTable::new(Duration::from_secs(10));
        let c: IpAddr = "10.244.1.5".parse().unwrap();
        assert_eq!(t.lookup(c, t0), None);
        t.record(c, ep(1), t0);
        assert_eq!(t.lookup(c, t0 + Duration::from_secs(9)), Some(ep(1)));
        // Used again at 9 s: stays until 19 s.
        t.record(c, ep(1), t0 + Duration::from_secs(9));
        assert_eq!(t.lookup(c, t0 + Duration::from_secs(18)), Some(ep(1)));
        assert_eq!(t.lookup(c, t0 + Duration::from_secs(19)), None);
        assert!(t.is_empty(), "expired entry not removed");
    }

    #[test]
    fn affinity_forgets_removed_endpoints_and_sweeps_old_clients() {
        let t0 = Instant::now();
        let mut t = AffinityTable::new(Duration::from_secs(1));
        for i in 0..100u8 {
            t.record(IpAddr::from([10, 1, 0, i]), ep(i % 2), t0);
        }
        t.forget_endpoint(ep(0));
        assert_eq!(t.len(), 50);
        // A record two timeouts later sweeps every stale client.
        t.record(
            "10.2.0.1".parse().unwrap(),
            ep(9),
            t0 + Duration::from_secs(2),
        );
        assert_eq!(t.len(), 1);
    }
}
