//! The tracker's incremental state equals a replay in one batch.
//!
//! A change set only works out again what can have changed (a Service whose
//! endpoints alone changed keeps its ports; claims are re-indexed only for
//! Services whose object changed, and for the other claimants of what they
//! touched). The kernel property tests compare partial against full syncs of
//! the same tracker's state, so they cannot see a tracker that skipped too
//! much. Here random update sequences (kp_testkit::updates: colliding
//! addresses, creation times, deletions, both families) go into one tracker
//! synced after every step, and after each step its state must equal that of
//! a new tracker given every step so far and synced once.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use kp_model::{IpFamily, ProxyState};
use kp_testkit::updates::{apply, step, tracker, Step};
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// The state as comparable text: ports and their endpoints, in name order.
fn listing(st: &ProxyState) -> String {
    let mut out = String::new();
    for (name, port) in &st.services {
        out += &format!("{port:?}\n  endpoints: {:?}\n", st.endpoints.get(name));
    }
    let mut orphans: Vec<String> = st
        .endpoints
        .keys()
        .filter(|k| !st.services.contains_key(*k))
        .map(|k| format!("endpoints without a port: {k:?}\n"))
        .collect();
    orphans.sort();
    out + &orphans.concat()
}

fn check(family: IpFamily, steps: &[Step]) -> Result<(), TestCaseError> {
    let mut t = tracker(family);
    for (i, s) in steps.iter().enumerate() {
        apply(&mut t, s);
        t.take_changes();
        let mut once = tracker(family);
        for s in &steps[..=i] {
            apply(&mut once, s);
        }
        once.take_changes();
        let (a, b) = (listing(t.state()), listing(once.state()));
        if a != b {
            return Err(TestCaseError::fail(format!(
                "{family:?}, after step {i} ({s:?}):\nsynced after every step:\n{a}\nreplayed in one batch:\n{b}"
            )));
        }
    }
    Ok(())
}

#[test]
fn synced_after_every_step_equals_one_replay() {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let mut runner = TestRunner::new(Config {
        cases,
        ..Config::default()
    });
    let seq = proptest::collection::vec(step(), 1..40);
    for family in [IpFamily::V4, IpFamily::V6] {
        runner
            .run(&seq, |steps| check(family, &steps))
            .unwrap_or_else(|e| panic!("{e}"));
    }
}
