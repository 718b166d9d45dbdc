//! When the sync loop syncs, and which kind of sync: upstream's
//! BoundedFrequencyRunner pacing (at most one sync per minSyncPeriod with a
//! burst of 2), a periodic sync every syncPeriod, a full rebuild on that
//! period in small clusters and hourly in large ones, and a backoff after
//! failures. A pure state machine fed with instants, so every decision is
//! unit-tested without a clock, a channel or a dataplane; `SyncLoop::run`
//! only waits, applies events and runs what [`Schedule::next`] plans.

use std::time::{Duration, Instant};

/// Upstream's BoundedFrequencyRunner burst: two syncs may run back to back,
/// then one per minSyncPeriod.
pub const BURST: u32 = 2;

/// The longest backoff after failed syncs (2 s, 4 s, ... 64 s), before the
/// cap at the sync period.
const MAX_BACKOFF_SHIFT: u32 = 6;

/// Token bucket of upstream's BoundedFrequencyRunner.
pub struct Pacer {
    min_interval: Duration,
    burst: u32,
    tokens: f64,
    last: Instant,
}

impl Pacer {
    /// A full bucket at `now`.
    pub fn new(min_interval: Duration, burst: u32, now: Instant) -> Self {
        Pacer {
            min_interval,
            burst: burst.max(1),
            tokens: burst.max(1) as f64,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        if self.min_interval.is_zero() {
            self.tokens = self.burst as f64;
        } else {
            let add = now.duration_since(self.last).as_secs_f64() / self.min_interval.as_secs_f64();
            self.tokens = (self.tokens + add).min(self.burst as f64);
        }
        self.last = now;
    }

    /// When a sync may run (now or later).
    pub fn ready_at(&mut self, now: Instant) -> Instant {
        self.refill(now);
        if self.tokens >= 1.0 {
            now
        } else {
            now + self.min_interval.mul_f64(1.0 - self.tokens)
        }
    }

    /// Takes a token for a sync that runs now.
    pub fn take(&mut self, now: Instant) {
        self.refill(now);
        self.tokens = (self.tokens - 1.0).max(0.0);
    }
}

/// A sync [`Schedule::next`] decided to run now; handed back to
/// [`Schedule::finished`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    /// Rebuild everything (the periodic full sync), not only what changed.
    pub rebuild: bool,
    periodic: bool,
}

/// The sync loop's schedule.
pub struct Schedule {
    pacer: Pacer,
    sync_period: Duration,
    /// The sources have sent `Synced`: syncs may run.
    sources_synced: bool,
    /// Changes wait for a sync.
    dirty: bool,
    /// The periodic sync (canary check, pending changes).
    next_periodic: Instant,
    /// The periodic full rebuild: with the periodic sync in small clusters,
    /// hourly in large ones.
    next_rebuild: Instant,
    /// After a failure: no sync (but a periodic one) before this.
    retry_at: Option<Instant>,
    failures: u32,
    succeeded_once: bool,
}

impl Schedule {
    pub fn new(min_sync_period: Duration, sync_period: Duration, now: Instant) -> Self {
        Schedule {
            pacer: Pacer::new(min_sync_period, BURST, now),
            sync_period,
            sources_synced: false,
            dirty: false,
            next_periodic: now + sync_period,
            next_rebuild: now + sync_period,
            retry_at: None,
            failures: 0,
            succeeded_once: false,
        }
    }

    /// Events were applied: `changed` when they changed what is programmed,
    /// `sources_synced` when one was the sources' `Synced`. Returns true the
    /// first time the sources are synced (the first sync is then due).
    pub fn events(&mut self, changed: bool, sources_synced: bool) -> bool {
        self.dirty |= changed;
        if sources_synced && !self.sources_synced {
            self.sources_synced = true;
            self.dirty = true;
            return true;
        }
        false
    }

    /// Until when the loop may wait for events before [`Self::next`] has
    /// something to run.
    pub fn deadline(&mut self, now: Instant) -> Instant {
        let mut deadline = self.next_periodic;
        if self.sources_synced && (self.dirty || self.retry_at.is_some()) {
            let mut at = self.pacer.ready_at(now);
            if let Some(r) = self.retry_at {
                at = at.max(r);
            }
            deadline = deadline.min(at);
        }
        deadline
    }

    /// Whether a sync is due right after a batch of events (the loop goes on
    /// waiting otherwise): the periodic one, or changes the pacer and the
    /// backoff let through.
    pub fn due(&mut self, now: Instant) -> bool {
        let paced = self.pacer.ready_at(now) <= now && self.retry_at.is_none_or(|r| now >= r);
        self.sources_synced && (now >= self.next_periodic || (self.dirty && paced))
    }

    /// The sync to run now, if any (taking the pacer's token for it). Before
    /// the sources are synced nothing runs, and the periodic timers restart.
    pub fn next(&mut self, now: Instant) -> Option<Planned> {
        if !self.sources_synced {
            self.next_periodic = now + self.sync_period;
            self.next_rebuild = self.next_periodic;
            return None;
        }
        let periodic = now >= self.next_periodic;
        if !(periodic || self.dirty || self.retry_at.is_some_and(|r| now >= r)) {
            return None;
        }
        let rebuild = periodic && now >= self.next_rebuild;
        self.pacer.take(now);
        Some(Planned { rebuild, periodic })
    }

    /// The planned sync ran, `ok` or not, and finished at `now`.
    /// `rebuild_after` is the full-rebuild period for the cluster's size now.
    pub fn finished(&mut self, sync: Planned, ok: bool, now: Instant, rebuild_after: Duration) {
        if ok {
            if !self.succeeded_once {
                // The first sync was a full one: count the rebuild period
                // from it, as upstream counts from its last full sync.
                self.succeeded_once = true;
                self.next_rebuild = now + rebuild_after;
            }
            self.failures = 0;
            self.retry_at = None;
        } else {
            self.failures += 1;
            let backoff = Duration::from_secs(1u64 << self.failures.min(MAX_BACKOFF_SHIFT))
                .min(self.sync_period);
            self.retry_at = Some(now + backoff);
        }
        self.dirty = false;
        if sync.periodic {
            self.next_periodic = now + self.sync_period;
        }
        if sync.rebuild {
            self.next_rebuild = now + rebuild_after;
        } else if sync.periodic {
            // A cluster that shrank below the threshold rebuilds on schedule again.
            self.next_rebuild = self.next_rebuild.min(now + rebuild_after);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(1);
    const PERIOD: Duration = Duration::from_secs(30);
    const HOUR: Duration = Duration::from_secs(3600);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn pacer_allows_a_burst_of_two_then_one_per_interval() {
        let t0 = Instant::now();
        let mut p = Pacer::new(Duration::from_secs(1), BURST, t0);
        assert_eq!(p.ready_at(t0), t0);
        p.take(t0);
        assert_eq!(p.ready_at(t0), t0);
        p.take(t0);
        // Bucket empty: the next sync waits one full interval.
        let next = p.ready_at(t0);
        assert!(next >= t0 + Duration::from_millis(990), "{:?}", next - t0);
        // Half an interval later, half a token: wait the other half.
        let half = t0 + Duration::from_millis(500);
        let at = p.ready_at(half);
        assert!(at > half && at <= t0 + Duration::from_millis(1010));
        // Long idle refills to the burst, not beyond.
        let later = t0 + Duration::from_secs(10);
        p.take(later);
        p.take(later);
        assert!(p.ready_at(later) > later);
    }

    #[test]
    fn zero_interval_never_waits() {
        let t0 = Instant::now();
        let mut p = Pacer::new(Duration::ZERO, BURST, t0);
        for _ in 0..5 {
            p.take(t0);
            assert_eq!(p.ready_at(t0), t0);
        }
    }

    /// Runs what the schedule plans at `now`, with `ok` as its outcome.
    fn run(s: &mut Schedule, now: Instant, ok: bool) -> Option<Planned> {
        let p = s.next(now)?;
        s.finished(p, ok, now, PERIOD);
        Some(p)
    }

    #[test]
    fn nothing_runs_before_the_sources_are_synced() {
        let t0 = Instant::now();
        let mut s = Schedule::new(MIN, PERIOD, t0);
        s.events(true, false);
        assert!(!s.due(t0));
        assert_eq!(s.deadline(t0), t0 + PERIOD);
        // The periodic deadline passes unsynced: nothing runs, it restarts.
        assert_eq!(s.next(t0 + PERIOD), None);
        assert_eq!(s.deadline(t0 + PERIOD), t0 + PERIOD + PERIOD);
        // Synced: the first sync is due at once, changes or not.
        let t1 = t0 + secs(40);
        assert!(s.events(false, true));
        assert!(!s.events(false, true), "only the first Synced counts");
        assert!(s.due(t1));
        assert_eq!(s.deadline(t1), t1);
        let p = run(&mut s, t1, true).unwrap();
        assert!(!p.rebuild, "the dataplane makes its first sync full itself");
        assert_eq!(s.next(t1), None, "nothing left to do");
    }

    #[test]
    fn a_burst_of_two_then_one_sync_per_min_sync_period() {
        let t0 = Instant::now();
        let mut s = Schedule::new(MIN, PERIOD, t0);
        s.events(false, true);
        assert!(run(&mut s, t0, true).is_some());
        s.events(true, false);
        assert!(s.due(t0), "the second of the burst runs at once");
        assert!(run(&mut s, t0, true).is_some());
        s.events(true, false);
        assert!(!s.due(t0), "the bucket is empty");
        let at = s.deadline(t0);
        assert!(
            at >= t0 + Duration::from_millis(990) && at <= t0 + MIN,
            "{:?}",
            at - t0
        );
        assert!(s.due(t0 + MIN));
        assert!(run(&mut s, t0 + MIN, true).is_some());
        // Events that change nothing never make a sync due.
        s.events(false, false);
        assert!(!s.due(t0 + secs(5)));
        assert_eq!(s.next(t0 + secs(5)), None);
    }

    #[test]
    fn failures_back_off_doubling_up_to_the_sync_period() {
        let t0 = Instant::now();
        let period = secs(20);
        let mut s = Schedule::new(Duration::ZERO, period, t0);
        s.events(false, true);
        let mut now = t0;
        let mut waits = Vec::new();
        for _ in 0..6 {
            let p = s.next(now).unwrap();
            s.finished(p, false, now, period);
            s.events(true, false);
            assert!(!s.due(now), "a change does not skip the backoff");
            let at = s.deadline(now);
            waits.push((at - now).as_secs());
            now = at;
        }
        // 2, 4, 8 s; then the periodic sync, due at 20 s, runs in spite of
        // the backoff; from then on the backoff (16, 32 s) is capped at the
        // sync period.
        assert_eq!(waits, [2, 4, 8, 6, 20, 20]);
        // A success resets the backoff.
        let p = s.next(now).unwrap();
        s.finished(p, true, now, period);
        s.events(true, false);
        assert!(s.due(now));
    }

    #[test]
    fn the_periodic_sync_rebuilds_on_the_sync_period_or_hourly() {
        let t0 = Instant::now();
        let mut s = Schedule::new(MIN, PERIOD, t0);
        s.events(false, true);
        let p = s.next(t0).unwrap();
        s.finished(p, true, t0, HOUR); // a large cluster: hourly rebuilds
        assert_eq!(
            s.deadline(t0),
            t0 + PERIOD,
            "idle: wake for the periodic sync"
        );
        let p = s.next(t0 + PERIOD).unwrap();
        assert!(!p.rebuild, "periodic but not a rebuild before the hour");
        s.finished(p, true, t0 + PERIOD, HOUR);
        let t_hour = t0 + HOUR;
        let p = s.next(t_hour).unwrap();
        assert!(p.rebuild, "an hour after the first sync");
        s.finished(p, true, t_hour, HOUR);
        // The cluster shrinks: the next periodic sync brings the rebuild
        // back to the sync period.
        let t = t_hour + PERIOD;
        let p = s.next(t).unwrap();
        assert!(!p.rebuild);
        s.finished(p, true, t, PERIOD);
        let p = s.next(t + PERIOD).unwrap();
        assert!(p.rebuild);
    }
}
