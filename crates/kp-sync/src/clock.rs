//! Where the proxy's time comes from: the sync loop's (pacing, deadlines,
//! trigger times, and how it waits for events) and the health state's
//! (the binary's `HealthState`, which reads [`Clock::system_now`]).
//!
//! [`SystemClock`] is the real one. [`ManualClock`] is a virtual clock for
//! tests: time moves only when the loop waits, jumping straight to the next
//! scheduled event or to the loop's deadline, so a test of an hour of pacing
//! runs in microseconds (as kube-runtime's scheduler tests do with tokio's
//! paused clock).

use std::collections::BTreeMap;
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use kp_source::SourceEvent;

use crate::queue::{EventSender, Events, EVENT_QUEUE};

/// The proxy's view of time. Sync, so one clock can be shared (`Arc`)
/// between the sync loop's thread and the HTTP servers' health state.
pub trait Clock: Send + Sync {
    /// Monotonic time: pacing, deadlines and durations.
    fn now(&self) -> Instant;
    /// Wall-clock time: change trigger times and programming latency.
    fn system_now(&self) -> SystemTime;
    /// Waits for the next event on `rx` until `deadline` (returns at once if
    /// one is queued or the deadline has passed).
    fn recv_until(
        &self,
        rx: &mut Events,
        deadline: Instant,
    ) -> Result<SourceEvent, RecvTimeoutError>;
}

/// The real clock: `Instant::now`, `SystemTime::now`, a blocking wait.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn system_now(&self) -> SystemTime {
        SystemTime::now()
    }
    fn recv_until(
        &self,
        rx: &mut Events,
        deadline: Instant,
    ) -> Result<SourceEvent, RecvTimeoutError> {
        rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
    }
}

struct Manual {
    start: Instant,
    now: Instant,
    system_start: SystemTime,
    /// Events to deliver, by (time, order of scheduling).
    schedule: BTreeMap<(Instant, u64), SourceEvent>,
    seq: u64,
    tx: Option<EventSender>,
    /// Once nothing is scheduled, a wait whose deadline reaches this closes
    /// the channel (the loop then returns).
    end: Option<Instant>,
}

/// A virtual clock for tests. Cheap to clone (shared): give one clone to the
/// loop and keep another to schedule events and read the time.
///
/// A wait returns a queued event at once; otherwise time jumps to the
/// earliest scheduled event (if it is due by the deadline), which is then
/// sent on the channel together with every other event scheduled for the
/// same instant, or else to the deadline (a timeout). When nothing is
/// scheduled any more and the deadline reaches [`ManualClock::end_at`], the
/// channel closes.
#[derive(Clone)]
pub struct ManualClock {
    inner: Arc<Mutex<Manual>>,
}

impl std::fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManualClock")
            .field("elapsed", &self.elapsed())
            .finish()
    }
}

impl ManualClock {
    /// A clock at its start, and the receiver the loop reads (the clock
    /// holds the sender).
    pub fn new() -> (Self, Events) {
        let (tx, rx) = tokio::sync::mpsc::channel(EVENT_QUEUE);
        let start = Instant::now();
        let clock = ManualClock {
            inner: Arc::new(Mutex::new(Manual {
                start,
                now: start,
                system_start: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
                schedule: BTreeMap::new(),
                seq: 0,
                tx: Some(tx),
                // A safety net: a test that forgets end_at still ends.
                end: Some(start + Duration::from_secs(30 * 86_400)),
            })),
        };
        (clock, Events::untimed(rx))
    }

    fn lock(&self) -> MutexGuard<'_, Manual> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The instant the clock started at.
    pub fn start(&self) -> Instant {
        self.lock().start
    }

    /// Time since the start.
    pub fn elapsed(&self) -> Duration {
        let g = self.lock();
        g.now - g.start
    }

    /// Moves time forward (e.g. a fake dataplane whose sync takes a while).
    pub fn advance(&self, d: Duration) {
        self.lock().now += d;
    }

    /// Delivers `ev` at `offset` after the start (at once if that has passed).
    pub fn at(&self, offset: Duration, ev: SourceEvent) {
        let mut g = self.lock();
        let t = g.start + offset;
        g.seq += 1;
        let seq = g.seq;
        g.schedule.insert((t, seq), ev);
    }

    /// A sender on the loop's queue, for a test's own producer thread (a
    /// flood, with `blocking_send`); the queue stays open until it is
    /// dropped too.
    pub fn sender(&self) -> Option<EventSender> {
        self.lock().tx.clone()
    }

    /// Closes the channel once nothing is scheduled and the loop waits past
    /// `offset` after the start.
    pub fn end_at(&self, offset: Duration) {
        let mut g = self.lock();
        g.end = Some(g.start + offset);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.lock().now
    }

    fn system_now(&self) -> SystemTime {
        let g = self.lock();
        g.system_start + (g.now - g.start)
    }

    fn recv_until(
        &self,
        rx: &mut Events,
        deadline: Instant,
    ) -> Result<SourceEvent, RecvTimeoutError> {
        if let Ok(ev) = rx.try_recv() {
            return Ok(ev);
        }
        let mut g = self.lock();
        let next = g.schedule.keys().next().map(|(t, _)| *t);
        match next {
            Some(t) if t <= deadline => {
                g.now = g.now.max(t);
                let now = g.now;
                while let Some(entry) = g.schedule.first_entry() {
                    if entry.key().0 > now {
                        break;
                    }
                    let (key, ev) = entry.remove_entry();
                    let Some(tx) = &g.tx else { break };
                    // A full queue keeps the rest scheduled: they go once
                    // the loop has read some.
                    if let Err(tokio::sync::mpsc::error::TrySendError::Full(ev)) = tx.try_send(ev) {
                        g.schedule.insert(key, ev);
                        break;
                    }
                }
                drop(g);
                rx.try_recv().map_err(|_| RecvTimeoutError::Disconnected)
            }
            _ => {
                if next.is_none() && g.end.is_some_and(|end| deadline >= end) {
                    g.now = g.now.max(g.end.unwrap_or(deadline));
                    g.tx = None;
                    return Err(RecvTimeoutError::Disconnected);
                }
                g.now = g.now.max(deadline);
                Err(RecvTimeoutError::Timeout)
            }
        }
    }
}
