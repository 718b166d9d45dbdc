//! The UDP flow table: client address -> flow, with idle expiry. Pure: the
//! caller passes `now` and says which flows are still usable.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// What [`FlowTable::lookup`] found for a client.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup<V> {
    /// A live flow (its idle clock restarted).
    Hit(V),
    /// No flow.
    Miss,
    /// There was a flow, but it idled out or its endpoint is gone: it was
    /// removed and is handed back so the caller can tear it down.
    Stale(V),
}

#[derive(Debug)]
struct Entry<V> {
    value: V,
    last_seen: Instant,
}

/// Flows keyed by the client's address and port, so replies go back to the
/// client that sent the request.
#[derive(Debug)]
pub struct FlowTable<V> {
    idle: Duration,
    map: HashMap<SocketAddr, Entry<V>>,
}

impl<V: Clone> FlowTable<V> {
    pub fn new(idle: Duration) -> Self {
        FlowTable {
            idle,
            map: HashMap::new(),
        }
    }

    /// The flow of `client`, if it is younger than the idle timeout and
    /// `usable` (its endpoint still serves the Service).
    pub fn lookup(
        &mut self,
        client: SocketAddr,
        now: Instant,
        usable: impl Fn(&V) -> bool,
    ) -> Lookup<V> {
        let Some(e) = self.map.get_mut(&client) else {
            return Lookup::Miss;
        };
        if now.saturating_duration_since(e.last_seen) >= self.idle || !usable(&e.value) {
            return match self.map.remove(&client) {
                Some(e) => Lookup::Stale(e.value),
                None => Lookup::Miss,
            };
        }
        e.last_seen = now;
        Lookup::Hit(e.value.clone())
    }

    /// Adds a flow; returns the one it replaced, if any.
    pub fn insert(&mut self, client: SocketAddr, value: V, now: Instant) -> Option<V> {
        self.map
            .insert(
                client,
                Entry {
                    value,
                    last_seen: now,
                },
            )
            .map(|e| e.value)
    }

    /// Traffic in either direction keeps a flow alive.
    pub fn touch(&mut self, client: SocketAddr, now: Instant) {
        if let Some(e) = self.map.get_mut(&client) {
            e.last_seen = now;
        }
    }

    /// Removes `client`'s flow if `pred` holds for it.
    pub fn remove_if(&mut self, client: SocketAddr, pred: impl Fn(&V) -> bool) -> Option<V> {
        if self.map.get(&client).is_some_and(|e| pred(&e.value)) {
            return self.map.remove(&client).map(|e| e.value);
        }
        None
    }

    /// When `max` flows are open, removes and returns the least recently
    /// used one, to make room for a new client: every flow holds a socket,
    /// and a client spraying source ports must not exhaust the process's
    /// file descriptors. O(flows), only when full.
    pub fn make_room(&mut self, max: usize) -> Option<V> {
        if self.map.len() < max.max(1) {
            return None;
        }
        let oldest = self
            .map
            .iter()
            .min_by_key(|(_, e)| e.last_seen)
            .map(|(k, _)| *k)?;
        self.map.remove(&oldest).map(|e| e.value)
    }

    /// Removes and returns the flows idle for the timeout or longer.
    pub fn expire(&mut self, now: Instant) -> Vec<(SocketAddr, V)> {
        let idle = self.idle;
        let old: Vec<SocketAddr> = self
            .map
            .iter()
            .filter(|(_, e)| now.saturating_duration_since(e.last_seen) >= idle)
            .map(|(k, _)| *k)
            .collect();
        old.into_iter()
            .filter_map(|k| self.map.remove(&k).map(|e| (k, e.value)))
            .collect()
    }

    /// Removes every flow (the listener closes).
    pub fn drain(&mut self) -> Vec<V> {
        self.map.drain().map(|(_, e)| e.value).collect()
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

    fn client(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 244, 1, 9], port))
    }

    #[test]
    fn a_full_table_gives_up_its_least_recent_flow() {
        let t0 = Instant::now();
        let mut t = FlowTable::new(Duration::from_secs(30));
        for p in 0..4 {
            t.insert(client(1000 + p), p, t0 + Duration::from_millis(p as u64));
        }
        // Traffic on the oldest makes the second-oldest the least recent.
        t.touch(client(1000), t0 + Duration::from_secs(1));
        assert_eq!(t.make_room(5), None);
        assert_eq!(t.make_room(4), Some(1));
        assert_eq!(t.len(), 3);
        assert_eq!(t.make_room(4), None);
    }

    #[test]
    fn replies_route_by_client_address_and_port() {
        let t0 = Instant::now();
        let mut t = FlowTable::new(Duration::from_secs(30));
        t.insert(client(1000), "a", t0);
        t.insert(client(1001), "b", t0);
        assert_eq!(t.lookup(client(1000), t0, |_| true), Lookup::Hit("a"));
        assert_eq!(t.lookup(client(1001), t0, |_| true), Lookup::Hit("b"));
        assert_eq!(t.lookup(client(1002), t0, |_| true), Lookup::Miss);
    }

    #[test]
    fn idle_flows_expire_and_traffic_keeps_them() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut t = FlowTable::new(10 * s);
        t.insert(client(1), "a", t0);
        t.insert(client(2), "b", t0);
        // Client 1 asks at 5 s, a reply for client 2 arrives at 8 s.
        assert_eq!(t.lookup(client(1), t0 + 5 * s, |_| true), Lookup::Hit("a"));
        t.touch(client(2), t0 + 8 * s);
        assert!(t.expire(t0 + 12 * s).is_empty());
        let gone = t.expire(t0 + 15 * s);
        assert_eq!(gone, vec![(client(1), "a")]);
        assert_eq!(t.len(), 1);
        // A lookup after the timeout hands the stale flow back.
        assert_eq!(
            t.lookup(client(2), t0 + 18 * s, |_| true),
            Lookup::Stale("b")
        );
        assert!(t.is_empty());
    }

    #[test]
    fn flows_move_when_their_endpoint_goes() {
        let t0 = Instant::now();
        let mut t = FlowTable::new(Duration::from_secs(30));
        t.insert(client(1), "a", t0);
        t.insert(client(2), "c", t0);
        // Endpoint "a" was removed: its flow is stale, the other stays.
        let alive = |v: &&str| *v != "a";
        assert_eq!(t.lookup(client(1), t0, alive), Lookup::Stale("a"));
        assert_eq!(t.lookup(client(2), t0, alive), Lookup::Hit("c"));
        assert_eq!(t.insert(client(1), "c", t0), None);
        assert_eq!(t.lookup(client(1), t0, alive), Lookup::Hit("c"));
        assert_eq!(t.remove_if(client(1), |v| *v == "x"), None);
        assert_eq!(t.remove_if(client(1), |v| *v == "c"), Some("c"));
        assert_eq!(t.drain(), vec!["c"]);
    }
}
