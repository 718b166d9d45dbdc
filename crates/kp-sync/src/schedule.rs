//! When the sync loop syncs, and which kind of sync: upstream's
//! BoundedFrequencyRunner pacing (at most one sync per minSyncPeriod with a
//! burst of 2, at least one per maxInterval), a canary check every
//! syncPeriod, a full rebuild when the mode's rebuild period has passed, and
//! a backoff after failures. A pure state machine fed with instants, so every decision is
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
    /// Run because the longest interval between syncs passed.
    pub periodic: bool,
}

/// What [`Schedule::next`] wants done now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    /// Check that our rules are still in place (the canary, every
    /// syncPeriod); report with [`Schedule::checked`].
    Check,
    /// Sync; report with [`Schedule::finished`].
    Sync(Planned),
}

/// The sync loop's schedule.
///
/// As upstream's proxiers: a sync runs for changes (paced), after a failure
/// (backed off) and when `max_interval` passed since the last one (the
/// BoundedFrequencyRunner's maxInterval: an hour in iptables and nftables
/// mode, syncPeriod in IPVS mode); a sync is a full rebuild when the
/// rebuild period (given by the caller after each sync: the mode's and
/// cluster size's) passed since the last full one. Every syncPeriod in
/// between the rules are only checked (iptables mode's canary monitor).
pub struct Schedule {
    pacer: Pacer,
    sync_period: Duration,
    max_interval: Duration,
    /// The sources have sent `Synced`: syncs may run.
    sources_synced: bool,
    /// Changes wait for a sync.
    dirty: bool,
    /// The next canary check.
    next_check: Instant,
    /// The sync that runs when nothing else did before it.
    next_periodic: Instant,
    /// When the last full sync finished (the first sync is full).
    last_full: Option<Instant>,
    /// How long after a full sync the next sync is full again; None: never
    /// (upstream's iptables mode in a large cluster).
    rebuild_after: Option<Duration>,
    /// After a failure: no sync (but a periodic one) before this.
    retry_at: Option<Instant>,
    failures: u32,
    succeeded_once: bool,
}

impl Schedule {
    pub fn new(
        min_sync_period: Duration,
        sync_period: Duration,
        max_interval: Duration,
        now: Instant,
    ) -> Self {
        Schedule {
            pacer: Pacer::new(min_sync_period, BURST, now),
            sync_period,
            max_interval,
            sources_synced: false,
            dirty: false,
            next_check: now + sync_period,
            next_periodic: now + max_interval,
            last_full: None,
            rebuild_after: None,
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

    /// A change (or a failed sync) may run now: the pacer has a token and
    /// no backoff holds it.
    fn paced(&mut self, now: Instant) -> bool {
        self.pacer.ready_at(now) <= now && self.retry_at.is_none_or(|r| now >= r)
    }

    /// Until when the loop may wait for events before [`Self::next`] has
    /// something to run.
    pub fn deadline(&mut self, now: Instant) -> Instant {
        let mut deadline = self.next_check.min(self.next_periodic);
        if self.sources_synced && (self.dirty || self.retry_at.is_some()) {
            let mut at = self.pacer.ready_at(now);
            if let Some(r) = self.retry_at {
                at = at.max(r);
            }
            deadline = deadline.min(at);
        }
        deadline
    }

    /// Whether something is due right after a batch of events (the loop goes
    /// on waiting otherwise).
    pub fn due(&mut self, now: Instant) -> bool {
        let timers = now >= self.next_check || now >= self.next_periodic;
        self.sources_synced && (timers || (self.dirty && self.paced(now)))
    }

    /// What to do now, if anything (a sync takes the pacer's token). Before
    /// the sources are synced nothing runs, and the timers restart.
    pub fn next(&mut self, now: Instant) -> Option<Due> {
        if !self.sources_synced {
            self.next_check = now + self.sync_period;
            self.next_periodic = now + self.max_interval;
            return None;
        }
        let periodic = now >= self.next_periodic;
        let retry = self.retry_at.is_some_and(|r| now >= r);
        if periodic || ((self.dirty || retry) && self.paced(now)) {
            let rebuild = match (self.last_full, self.rebuild_after) {
                (Some(t), Some(d)) => now >= t + d,
                _ => false,
            };
            self.pacer.take(now);
            return Some(Due::Sync(Planned { rebuild, periodic }));
        }
        (now >= self.next_check).then_some(Due::Check)
    }

    /// The canary check ran at `now`; `lost` when our rules were gone (the
    /// caller marked them for a full sync, which is then due).
    pub fn checked(&mut self, now: Instant, lost: bool) {
        self.next_check = now + self.sync_period;
        self.dirty |= lost;
    }

    /// The planned sync ran, `ok` or not, and finished at `now`.
    /// `rebuild_after` is the full-rebuild period for the mode and the
    /// cluster's size now (None: no periodic rebuild).
    pub fn finished(
        &mut self,
        sync: Planned,
        ok: bool,
        now: Instant,
        rebuild_after: Option<Duration>,
    ) {
        self.rebuild_after = rebuild_after;
        if ok {
            if !self.succeeded_once || sync.rebuild {
                // The first sync is a full one: the rebuild period counts
                // from it, as upstream counts from its last full sync.
                self.succeeded_once = true;
                self.last_full = Some(now);
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
        // Any sync restarts both timers: it checked the canary, and the
        // longest interval counts from the last run (as the runner's).
        self.next_check = now + self.sync_period;
        self.next_periodic = now + self.max_interval;
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

    /// Runs the sync the schedule plans at `now`, with `ok` as its outcome
    /// (None when nothing, or only a check, is due).
    fn run(s: &mut Schedule, now: Instant, ok: bool) -> Option<Planned> {
        let Due::Sync(p) = s.next(now)? else {
            return None;
        };
        s.finished(p, ok, now, Some(HOUR));
        Some(p)
    }

    #[test]
    fn nothing_runs_before_the_sources_are_synced() {
        let t0 = Instant::now();
        let mut s = Schedule::new(MIN, PERIOD, HOUR, t0);
        s.events(true, false);
        assert!(!s.due(t0));
        assert_eq!(s.deadline(t0), t0 + PERIOD);
        // The check's deadline passes unsynced: nothing runs, it restarts.
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
        let mut s = Schedule::new(MIN, PERIOD, HOUR, t0);
        s.events(false, true);
        assert!(run(&mut s, t0, true).is_some());
        s.events(true, false);
        assert!(s.due(t0), "the second of the burst runs at once");
        assert!(run(&mut s, t0, true).is_some());
        s.events(true, false);
        assert!(!s.due(t0), "the bucket is empty");
        assert_eq!(s.next(t0), None, "not before the pacer allows");
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

    /// Waits between failed attempts, each failing, with a change pending.
    fn backoff_waits(max_interval: Duration) -> Vec<u64> {
        let t0 = Instant::now();
        let period = secs(20);
        let mut s = Schedule::new(Duration::ZERO, period, max_interval, t0);
        s.events(false, true);
        let mut now = t0;
        let mut waits = Vec::new();
        while waits.len() < 6 {
            match s.next(now).unwrap() {
                Due::Sync(p) => {
                    s.finished(p, false, now, Some(HOUR));
                    s.events(true, false);
                    assert!(!s.due(now), "a change does not skip the backoff");
                }
                Due::Check => panic!("a check due before the retry: {waits:?}"),
            }
            let at = s.deadline(now);
            waits.push((at - now).as_secs());
            now = at;
        }
        // A success resets the backoff.
        let Some(Due::Sync(p)) = s.next(now) else {
            panic!("no retry at {now:?}")
        };
        s.finished(p, true, now, Some(HOUR));
        s.events(true, false);
        assert!(s.due(now));
        waits
    }

    #[test]
    fn failures_back_off_doubling_up_to_the_sync_period() {
        // 2, 4, 8, 16 s, then capped at the sync period.
        assert_eq!(backoff_waits(HOUR), [2, 4, 8, 16, 20, 20]);
        // The same where the longest interval is the sync period (IPVS
        // mode): it counts from the last attempt, as the runner's.
        assert_eq!(backoff_waits(secs(20)), [2, 4, 8, 16, 20, 20]);
    }

    #[test]
    fn idle_the_rules_are_checked_every_period_and_synced_hourly() {
        let t0 = Instant::now();
        let mut s = Schedule::new(MIN, PERIOD, HOUR, t0);
        s.events(false, true);
        let Some(Due::Sync(p)) = s.next(t0) else {
            panic!("the first sync")
        };
        s.finished(p, true, t0, Some(HOUR));
        assert_eq!(s.deadline(t0), t0 + PERIOD, "idle: wake for the check");
        let mut now = t0;
        let mut checks = 0;
        loop {
            now = s.deadline(now);
            match s.next(now) {
                Some(Due::Check) => {
                    checks += 1;
                    s.checked(now, false);
                }
                Some(Due::Sync(p)) => {
                    assert!(p.periodic && p.rebuild, "{p:?}");
                    assert_eq!(now, t0 + HOUR);
                    break;
                }
                None => panic!("woken for nothing at {:?}", now - t0),
            }
        }
        assert_eq!(checks, HOUR.as_secs() / PERIOD.as_secs() - 1);
    }

    #[test]
    fn the_rebuild_comes_with_the_first_sync_after_its_period() {
        let t0 = Instant::now();
        let mut s = Schedule::new(MIN, PERIOD, HOUR, t0);
        s.events(false, true);
        let p = run(&mut s, t0, true).unwrap();
        assert!(!p.rebuild);
        // A change before the hour: partial.
        s.events(true, false);
        let t = t0 + secs(1800);
        let p = run(&mut s, t, true).unwrap();
        assert!(!p.rebuild && !p.periodic, "{p:?}");
        // A change after the hour since the last full sync: full, as
        // upstream decides at every sync.
        s.events(true, false);
        let t = t0 + HOUR + secs(5);
        let Some(Due::Sync(p)) = s.next(t) else {
            panic!("the change's sync")
        };
        assert!(p.rebuild && !p.periodic, "{p:?}");
        // No rebuild period (a large cluster in iptables mode): the hourly
        // sync is partial.
        s.finished(p, true, t, None);
        let t = t + HOUR;
        let Some(Due::Sync(p)) = s.next(t) else {
            panic!("the hourly sync")
        };
        assert!(p.periodic && !p.rebuild, "{p:?}");
        s.finished(p, true, t, None);
        // The cluster shrinks: the rebuild is due again an hour after the
        // last full sync.
        s.finished(
            Planned {
                rebuild: false,
                periodic: false,
            },
            true,
            t,
            Some(HOUR),
        );
        s.events(true, false);
        let Some(Due::Sync(p)) = s.next(t + secs(1)) else {
            panic!("the change's sync")
        };
        assert!(p.rebuild, "two hours after the last full sync");
    }

    #[test]
    fn lost_rules_found_by_the_check_make_a_sync_due() {
        let t0 = Instant::now();
        let mut s = Schedule::new(MIN, PERIOD, HOUR, t0);
        s.events(false, true);
        run(&mut s, t0, true).unwrap();
        let t = t0 + PERIOD;
        assert_eq!(s.next(t), Some(Due::Check));
        s.checked(t, true);
        assert!(s.due(t));
        let Some(Due::Sync(p)) = s.next(t) else {
            panic!("a sync after the lost canary")
        };
        assert!(!p.periodic);
        s.finished(p, true, t, Some(HOUR));
        assert_eq!(s.deadline(t), t + PERIOD);
    }

    #[test]
    fn with_the_sync_period_as_longest_interval_every_period_syncs() {
        // IPVS mode: upstream's runner syncs every syncPeriod, each sync
        // the whole state.
        let t0 = Instant::now();
        let mut s = Schedule::new(MIN, PERIOD, PERIOD, t0);
        s.events(false, true);
        let Some(Due::Sync(p)) = s.next(t0) else {
            panic!("the first sync")
        };
        s.finished(p, true, t0, Some(PERIOD));
        for i in 1..=3 {
            let t = t0 + PERIOD * i;
            assert_eq!(s.deadline(t0 + PERIOD * (i - 1)), t);
            let Some(Due::Sync(p)) = s.next(t) else {
                panic!("the periodic sync {i}")
            };
            assert!(p.periodic && p.rebuild, "{p:?}");
            s.finished(p, true, t, Some(PERIOD));
        }
    }
}
