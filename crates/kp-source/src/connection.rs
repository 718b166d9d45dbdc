//! The API source's connection state, as a pure state machine: which watches
//! are failing, whether a probe runs, when the source is synced, and what
//! each watch outcome or probe answer means (`Disconnected`, `Reconnected`,
//! restart the watches, start or stop the probe). `api.rs` does the I/O and
//! follows these decisions; the tests below drive them without a server.
//!
//! The rules, each learnt from an outage (docs/reliability.md):
//! - one `Disconnected` per outage, however many watches fail, and one probe;
//! - only data from a failing watch (or the probe) ends an outage: a server
//!   failing only EndpointSlice lists still answered Service lists, and
//!   taking those for a reconnection restarted every watch again and again;
//! - when the outage ends, the other failing watches may sit in their backoff
//!   (up to 30 s): they are restarted, so they relist at once;
//! - `Synced` once, when Services, EndpointSlices and the Node have each
//!   been listed (topology needs the Node's zone before the first sync).

use std::collections::BTreeSet;

/// One of the three watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Watch {
    Services,
    EndpointSlices,
    Nodes,
}

impl Watch {
    pub fn as_str(self) -> &'static str {
        match self {
            Watch::Services => "services",
            Watch::EndpointSlices => "endpointslices",
            Watch::Nodes => "nodes",
        }
    }
}

/// What to do after a watch delivered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AfterDelivery {
    /// The outage is over: send `Reconnected` (before this delivery's events).
    pub reconnected: bool,
    /// Stop the probe.
    pub stop_probe: bool,
    /// Restart every watch (others were failing too and may sit in backoff).
    pub restart_watches: bool,
    /// Send `Synced` (after this delivery's events).
    pub synced: bool,
}

/// What to do after a watch failed with a disconnection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AfterFailure {
    /// A new outage: send `Disconnected`.
    pub disconnected: bool,
    /// Start the probe (none runs).
    pub start_probe: bool,
}

/// The connection state of one API source.
#[derive(Clone, Debug, Default)]
pub struct Connection {
    /// Watches whose last error was a disconnection and that delivered no
    /// data since; connected while empty.
    failing: BTreeSet<Watch>,
    probing: bool,
    listed: BTreeSet<Watch>,
    synced: bool,
}

impl Connection {
    pub fn new() -> Connection {
        Connection::default()
    }

    /// Connected: no watch is failing.
    pub fn connected(&self) -> bool {
        self.failing.is_empty()
    }

    pub fn probing(&self) -> bool {
        self.probing
    }

    /// `watch` delivered: `data` when it carried objects or ended a list
    /// (not the bare start of a list, which a failing server also sends);
    /// `listed` when a complete list arrived.
    pub fn delivered(&mut self, watch: Watch, data: bool, listed: bool) -> AfterDelivery {
        let mut out = AfterDelivery::default();
        if data && self.failing.remove(&watch) {
            out.reconnected = true;
            out.stop_probe = self.probing;
            self.probing = false;
            // The others that failed get fresh watches; one that fails again
            // is a new outage, ended only by its own data: no restart loop.
            out.restart_watches = !self.failing.is_empty();
            self.failing.clear();
        }
        if listed {
            self.listed.insert(watch);
        }
        if !self.synced && self.listed.len() == 3 {
            self.synced = true;
            out.synced = true;
        }
        out
    }

    /// `watch` failed with a disconnection (not "history expired", after
    /// which the watcher relists by itself and nothing changes here).
    pub fn failed(&mut self, watch: Watch) -> AfterFailure {
        let was_connected = self.failing.is_empty();
        self.failing.insert(watch);
        let mut out = AfterFailure::default();
        if was_connected {
            out.disconnected = true;
            if !self.probing {
                self.probing = true;
                out.start_probe = true;
            }
        }
        out
    }

    /// The probe found the server answering. True: the outage is over, send
    /// `Reconnected` and restart every watch (they may sit in backoff).
    pub fn probe_answered(&mut self) -> bool {
        self.probing = false;
        if self.failing.is_empty() {
            return false;
        }
        self.failing.clear();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Watch::*;

    fn synced_conn() -> Connection {
        let mut c = Connection::new();
        for w in [Services, EndpointSlices, Nodes] {
            c.delivered(w, true, true);
        }
        c
    }

    #[test]
    fn synced_once_after_the_three_lists() {
        let mut c = Connection::new();
        assert!(!c.delivered(Services, true, true).synced);
        assert!(
            !c.delivered(Services, true, true).synced,
            "the same list twice"
        );
        assert!(!c.delivered(EndpointSlices, true, true).synced);
        assert!(
            !c.delivered(Nodes, true, false).synced,
            "an object is not a list"
        );
        assert!(c.delivered(Nodes, true, true).synced);
        assert!(!c.delivered(Nodes, true, true).synced, "only once");
    }

    #[test]
    fn one_disconnected_and_one_probe_per_outage() {
        let mut c = synced_conn();
        let f = c.failed(EndpointSlices);
        assert_eq!(
            f,
            AfterFailure {
                disconnected: true,
                start_probe: true
            }
        );
        assert!(!c.connected() && c.probing());
        assert_eq!(c.failed(Services), AfterFailure::default());
        assert_eq!(c.failed(EndpointSlices), AfterFailure::default());
    }

    #[test]
    fn data_from_a_healthy_watch_does_not_end_the_outage() {
        // The server fails EndpointSlice lists only and answers the others.
        let mut c = synced_conn();
        c.failed(EndpointSlices);
        for _ in 0..5 {
            assert_eq!(c.delivered(Services, true, true), AfterDelivery::default());
            assert_eq!(c.delivered(Nodes, true, false), AfterDelivery::default());
        }
        assert!(!c.connected());
        // A bare list start from the failing one is not data either.
        assert_eq!(
            c.delivered(EndpointSlices, false, false),
            AfterDelivery::default()
        );
        assert!(!c.connected());
        let d = c.delivered(EndpointSlices, true, true);
        assert!(d.reconnected && d.stop_probe && !d.restart_watches);
        assert!(c.connected() && !c.probing());
    }

    #[test]
    fn the_first_failing_watch_to_deliver_restarts_the_others_once() {
        let mut c = synced_conn();
        c.failed(Services);
        c.failed(EndpointSlices);
        let d = c.delivered(Services, true, false);
        assert!(d.reconnected && d.restart_watches);
        assert!(c.connected());
        // The restarted watch's data is an ordinary delivery now.
        assert_eq!(
            c.delivered(EndpointSlices, true, true),
            AfterDelivery::default()
        );
        // Failing again is a new outage, with its own probe.
        assert_eq!(
            c.failed(EndpointSlices),
            AfterFailure {
                disconnected: true,
                start_probe: true
            }
        );
    }

    #[test]
    fn the_probe_ends_an_outage_and_restarts_the_watches() {
        let mut c = synced_conn();
        c.failed(Nodes);
        c.failed(Services);
        assert!(c.probe_answered());
        assert!(c.connected() && !c.probing());
        // A probe answering while nothing fails changes nothing.
        assert!(!c.probe_answered());
        // Data after the restart is ordinary.
        assert_eq!(c.delivered(Nodes, true, true), AfterDelivery::default());
    }

    #[test]
    fn a_failure_before_the_first_lists_still_syncs_later() {
        let mut c = Connection::new();
        assert!(c.failed(Services).disconnected);
        assert!(!c.delivered(EndpointSlices, true, true).synced);
        assert!(!c.delivered(Nodes, true, true).synced);
        let d = c.delivered(Services, true, true);
        assert!(d.reconnected && d.synced);
    }
}
