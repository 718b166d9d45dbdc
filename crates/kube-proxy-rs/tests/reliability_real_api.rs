//! The API-outage fault tests against a real control plane (etcd and
//! kube-apiserver v1.36 in a LAN host namespace of the lab, see
//! kp_testkit::control_plane): the kube-apiserver process is SIGKILLed for
//! 60 s and started again, etcd is killed under a running API server and
//! started again on the same data, and the network between node1 and the
//! API server drops everything for 60 s. Throughout, a client pod connects
//! to a ClusterIP every 50 ms and no connection may fail; the rules stay
//! exactly as they were; a change written as soon as the server is back
//! (or during the partition) is programmed, and how long that took is
//! printed (docs/reliability.md records it).
//!
//! reliability.rs runs the same outage against the in-process API test
//! server, plus what a real server cannot be made to do on demand (watches
//! cut mid-event, 410 relists). Needs root; skips loudly without the
//! Kubernetes binaries (fails instead under KP_REQUIRE_REAL_APISERVER=1).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

mod conformance;
mod faults;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use conformance::{ready, sa, service, slice, Env};
use faults::{assert_no_failures, healthz, normalized, plain, unix_secs, Attempt, Load};
use kp_netlab::{tcp_hello, wait_until, Pod};
use serde_json::{json, Value};

const MODE: &str = "api/nftables";
const WEB: &str = "10.96.5.10";
const LATE: &str = "10.96.5.11";
const LOAD_PERIOD: Duration = Duration::from_millis(50);

/// The lab both tests share: pods a (node1) and c (node2), a client pod on
/// node1, Service web -> a, kube-proxy-rs on node1 answering it.
struct Lab {
    env: Env,
    c: Pod,
    client: Pod,
    /// Node1's ruleset once both families were synced, normalised.
    rules: Vec<String>,
}

impl Lab {
    fn new(test: &str) -> Lab {
        let mut env = Env::new(test, MODE);
        let a = env.pod(1, "a");
        let c = env.pod(2, "c");
        let client = env.pod(1, "client");
        env.put("svc", &service("web", &[WEB], json!({})));
        env.put("eps", &slice("web", "1", "IPv4", &ready(&[&a])));
        env.start(1, &[]);
        env.wait_synced(1);
        assert_eq!(env.wait_tcp(client.ns(), sa(WEB, 80)).server, "a");
        // IPv6 syncs after IPv4: the reference ruleset must have both.
        env.wait("node1's IPv6 sync", || {
            synced_lines(&env, &["family=IPv6"]) >= 1
        });
        let (code, body) = healthz(&env, 1);
        assert_eq!(code, 200, "{body}");
        assert_eq!(body["sourceConnected"], true, "{body}");
        let rules = normalized(&env.ruleset(1));
        assert!(
            rules.iter().any(|l| l.contains(&a.ip().to_string())),
            "endpoint a is not in node1's rules:\n{}",
            env.ruleset(1)
        );
        Lab {
            env,
            c,
            client,
            rules,
        }
    }

    /// Fails the test unless node1's rules are exactly the reference ones.
    fn assert_rules_kept(&self, when: &str) {
        let now = normalized(&self.env.ruleset(1));
        assert!(
            now == self.rules,
            "node1's rules changed {when}\nmissing: {:#?}\nextra: {:#?}",
            self.rules
                .iter()
                .filter(|l| !now.contains(l))
                .collect::<Vec<_>>(),
            now.iter()
                .filter(|l| !self.rules.contains(l))
                .collect::<Vec<_>>()
        );
    }

    /// Writes the change (web's endpoint a -> c, and a new Service "late"
    /// with endpoint c) as soon as the API server accepts writes, then waits
    /// until both are programmed.
    fn change_and_wait(&self) -> Catchup {
        let started = Instant::now();
        let refused = self.write_change();
        let written = Instant::now();
        Catchup {
            started,
            written,
            programmed: self.wait_change(),
            refused,
        }
    }

    /// Writes the change, retrying while the API server refuses; the
    /// refusals.
    fn write_change(&self) -> Vec<String> {
        let cp = &self.env.api().cp;
        let mut refused = Vec::new();
        for obj in [
            slice("web", "1", "IPv4", &ready(&[&self.c])),
            service("late", &[LATE], json!({})),
            slice("late", "1", "IPv4", &ready(&[&self.c])),
        ] {
            refused.extend(apply_when_possible(cp, &obj));
        }
        refused
    }

    /// Waits until the change answers; when it did.
    fn wait_change(&self) -> Instant {
        let ok = wait_until(Duration::from_secs(90), Duration::from_millis(50), || {
            // Short timeouts: the moment it works is what is measured.
            let t = Duration::from_millis(500);
            tcp_hello(self.client.ns(), sa(WEB, 80), t).is_ok_and(|r| r.server == "c")
                && tcp_hello(self.client.ns(), sa(LATE, 80), t).is_ok_and(|r| r.server == "c")
        });
        assert!(
            ok,
            "the change was not programmed within 90 s\n--- node1 log ---\n{}",
            plain(&self.env.log(1))
        );
        Instant::now()
    }

    /// Drops (`cut`) or lets through again every packet between node1 and
    /// the control plane's host, in both directions, as a partition does:
    /// no FIN, no RST, no ICMP.
    fn partition(&self, cut: bool) {
        let ns = &self.env.api().ns;
        let node = self.env.cluster.node_ip(1).to_string();
        let script = if cut {
            format!(
                "table inet partition {{\n\
                 chain in {{ type filter hook input priority 0; ip saddr {node} drop; }}\n\
                 chain out {{ type filter hook output priority 0; ip daddr {node} drop; }}\n\
                 }}\n"
            )
        } else {
            "delete table inet partition\n".to_string()
        };
        let f = self.env.logs.join("partition.nft");
        std::fs::write(&f, script).unwrap();
        self.env
            .cluster
            .exec_ok(ns, &["nft", "-f", &f.display().to_string()])
            .unwrap();
    }

    /// The proxy's own view of the reconnection: seconds from `since` to
    /// the last "source reconnected" line of node1's log, if there is one.
    fn reconnected_after(&self, since: SystemTime) -> Option<f64> {
        let at = plain(&self.env.log(1))
            .lines()
            .rfind(|l| l.contains("source reconnected"))
            .and_then(|l| l.split_whitespace().next().and_then(unix_secs))?;
        Some(at - since.duration_since(UNIX_EPOCH).unwrap().as_secs_f64())
    }
}

/// "synced rules" lines in node1's log that also contain every one of `with`.
fn synced_lines(env: &Env, with: &[&str]) -> usize {
    plain(&env.log(1))
        .lines()
        .filter(|l| l.contains("synced rules") && with.iter().all(|w| l.contains(w)))
        .count()
}

/// When [`Lab::change_and_wait`] began, when its last write was accepted,
/// when the change answered; and the API server's refusals meanwhile.
struct Catchup {
    started: Instant,
    written: Instant,
    programmed: Instant,
    refused: Vec<String>,
}

/// Applies `obj`, retrying while the API server refuses (its storage may
/// still be coming back); the refusals.
fn apply_when_possible(cp: &kp_testkit::ControlPlane, obj: &Value) -> Vec<String> {
    let mut refused = Vec::new();
    let ok = wait_until(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || match cp.apply(obj) {
            Ok(()) => true,
            Err(e) => {
                refused.push(e.to_string());
                false
            }
        },
    );
    assert!(
        ok,
        "writing {}: {:?}",
        obj["metadata"]["name"],
        refused.last()
    );
    refused
}

/// The load's verdict: every attempt answered, by a until `changed` (the
/// first write of the change) and by c after `programmed`.
fn assert_attempts(attempts: &[Attempt], started: Instant, changed: Instant, programmed: Instant) {
    let expected = started.elapsed().as_millis() / LOAD_PERIOD.as_millis();
    assert!(
        attempts.len() as u128 > expected / 2,
        "only {} connection attempts in {:?}",
        attempts.len(),
        started.elapsed()
    );
    assert_no_failures("connections over the whole run", attempts);
    let wrong_before: Vec<_> = attempts
        .iter()
        .filter(|(t, r)| *t < changed && r.as_deref() != Ok("a"))
        .collect();
    assert!(
        wrong_before.is_empty(),
        "the rules changed before the change was written: {wrong_before:?}"
    );
    let wrong_after: Vec<_> = attempts
        .iter()
        .filter(|(t, r)| *t > programmed && r.as_deref() != Ok("c"))
        .collect();
    assert!(
        wrong_after.is_empty(),
        "connections reached a after the change was programmed: {wrong_after:?}"
    );
}

/// The kube-apiserver process is SIGKILLed and stays away for 60 s while a
/// client pod connects to the ClusterIP every 50 ms: every connection is
/// answered by the endpoint programmed before (the rules are exactly as
/// they were, and no sync rewrites them: as upstream v1.36.2's, with nothing
/// seen to change none runs within the hour), /healthz stays
/// 200 and says the source is disconnected. The server is started again and
/// a change written at once (endpoint a -> c, and a new Service): the time
/// until both answer from c is measured from /readyz answering again.
#[test]
fn real_apiserver_outage_60s() {
    if !conformance::binaries_for(MODE) {
        return;
    }
    let mut lab = Lab::new("realoutage");
    let load = Load::start(lab.client.ns(), sa(WEB, 80), LOAD_PERIOD);
    let started = Instant::now();

    // --- 60 s outage ---
    let syncs_before = synced_lines(&lab.env, &["family=IPv4"]);
    lab.env.control_plane().stop_apiserver();
    let down_at = Instant::now();
    lab.env.wait("/healthz to report the lost source", || {
        healthz(&lab.env, 1).1["sourceConnected"] == false
    });
    let noticed = down_at.elapsed();
    while down_at.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_secs(2));
        let (code, body) = healthz(&lab.env, 1);
        assert_eq!(code, 200, "/healthz failed during the outage: {body}");
        assert_eq!(body["sourceConnected"], false, "{body}");
        assert!(body["sourceDisconnectedSince"].is_string(), "{body}");
    }
    // The test proxies' sync period is 10 s: six canary checks in 60 s,
    // and no sync.
    let syncs = synced_lines(&lab.env, &["family=IPv4"]) - syncs_before;
    assert_eq!(
        syncs,
        0,
        "IPv4 syncs ran during the outage, with nothing seen to change:\n{}",
        plain(&lab.env.log(1))
    );
    lab.assert_rules_kept("during the API server outage");

    // --- back ---
    let restart_at = Instant::now();
    lab.env
        .control_plane()
        .start_apiserver()
        .unwrap_or_else(|e| panic!("restarting kube-apiserver: {e}"));
    let (ready_at, ready_wall) = (Instant::now(), SystemTime::now());
    let c = lab.change_and_wait();
    let catch_up = c.programmed - ready_at;
    eprintln!(
        "real kube-apiserver outage: /healthz reported the lost source {noticed:?} after the kill; \
         {syncs} IPv4 syncs during the 60 s; /readyz again {:?} after the start; \
         change written {:?} after /readyz ({} refusals); programmed {catch_up:?} after /readyz \
         ({:?} after the last write); the proxy logged the reconnection {:?} s after /readyz",
        ready_at - restart_at,
        c.written - ready_at,
        c.refused.len(),
        c.programmed - c.written,
        lab.reconnected_after(ready_wall),
    );
    lab.env.wait("/healthz to report the source back", || {
        healthz(&lab.env, 1).1["sourceConnected"] == true
    });
    std::thread::sleep(Duration::from_secs(1));
    let attempts = load.finish();
    assert_attempts(&attempts, started, c.started, c.programmed);
    // The source probes every ~1-4 s while disconnected and restarts its
    // watches as soon as the server answers (not after kube-runtime's
    // backoff, up to 30 s): one probe, a relist and a sync, with slack for
    // a loaded 2-core machine.
    assert!(
        catch_up < Duration::from_secs(15),
        "the change took {catch_up:?} after /readyz to be programmed\n{}",
        plain(&lab.env.log(1))
    );
}

/// etcd is killed under a running API server, stays away 10 s (as a
/// crashed etcd pod being restarted), and comes back on the same data while
/// a client pod connects to the ClusterIP every 50 ms: no connection fails,
/// the rules are exactly as they were, /healthz stays 200, and a change
/// written as soon as the API server accepts writes again is programmed.
#[test]
fn real_etcd_restart() {
    if !conformance::binaries_for(MODE) {
        return;
    }
    let mut lab = Lab::new("realetcd");
    let load = Load::start(lab.client.ns(), sa(WEB, 80), LOAD_PERIOD);
    let started = Instant::now();

    lab.env.control_plane().stop_etcd();
    let down_at = Instant::now();
    // Whether the API server fails readiness or breaks its watches meanwhile
    // is its business (it serves watches from its cache): reported, not
    // asserted. Health must stay 200 either way.
    let (mut unready, mut disconnected) = (false, false);
    while down_at.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(500));
        let (code, body) = healthz(&lab.env, 1);
        assert_eq!(code, 200, "/healthz failed while etcd was down: {body}");
        disconnected |= body["sourceConnected"] == false;
        unready |= !lab
            .env
            .api()
            .cp
            .kubectl(&["get", "--raw", "/readyz"])
            .is_ok_and(|s| s.trim() == "ok");
    }
    lab.assert_rules_kept("while etcd was down");
    lab.env
        .control_plane()
        .start_etcd()
        .unwrap_or_else(|e| panic!("restarting etcd: {e}"));
    let etcd_up = Instant::now();
    lab.env
        .control_plane()
        .wait_ready(Duration::from_secs(90))
        .unwrap_or_else(|e| panic!("kube-apiserver after the etcd restart: {e}"));
    let ready_at = Instant::now();
    lab.assert_rules_kept("across the etcd restart");
    let c = lab.change_and_wait();
    let catch_up = c.programmed - c.written;
    eprintln!(
        "etcd down 10 s: /readyz failed meanwhile: {unready}; the source reported a disconnection: \
         {disconnected}; /readyz ok {:?} after etcd started; writes accepted {:?} after etcd \
         started ({} refusals, last: {:?}); programmed {catch_up:?} after the last write \
         ({:?} after etcd started)",
        ready_at - etcd_up,
        c.written - etcd_up,
        c.refused.len(),
        c.refused.last(),
        c.programmed - etcd_up,
    );
    lab.env.wait("/healthz to report the source connected", || {
        healthz(&lab.env, 1).1["sourceConnected"] == true
    });
    std::thread::sleep(Duration::from_secs(1));
    let attempts = load.finish();
    assert_attempts(&attempts, started, c.started, c.programmed);
    // How long the API server takes to accept writes again is etcd's and
    // its business (bounded by apply_when_possible); from the accepted
    // write on it is ours: a watch event and a sync.
    assert!(
        catch_up < Duration::from_secs(15),
        "the change took {catch_up:?} after it was written to be programmed\n{}",
        plain(&lab.env.log(1))
    );
}

/// The network between node1 and the API server drops every packet, both
/// ways, for 60 s (a partition: no FIN, RST or ICMP tells anyone), and a
/// change is written meanwhile from the control plane's side. Traffic keeps
/// flowing on the old rules, /healthz stays 200 and says within about 30 s
/// (TCP keepalive: apiclient.rs) that the source is disconnected; once the
/// network is back the change is programmed within a few seconds (the
/// probe's fresh connection attempts: kp-source).
#[test]
fn real_network_partition() {
    if !conformance::binaries_for(MODE) {
        return;
    }
    let lab = Lab::new("realpartition");
    let load = Load::start(lab.client.ns(), sa(WEB, 80), LOAD_PERIOD);
    let started = Instant::now();

    lab.partition(true);
    let cut_at = Instant::now();
    lab.write_change();
    lab.env.wait_for(
        "/healthz to report the lost source",
        Duration::from_secs(60),
        || healthz(&lab.env, 1).1["sourceConnected"] == false,
    );
    let noticed = cut_at.elapsed();
    while cut_at.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_secs(2));
        let (code, body) = healthz(&lab.env, 1);
        assert_eq!(code, 200, "/healthz failed during the partition: {body}");
        assert_eq!(body["sourceConnected"], false, "{body}");
    }
    lab.assert_rules_kept("during the partition");

    lab.partition(false);
    let healed = Instant::now();
    let programmed = lab.wait_change();
    let catch_up = programmed - healed;
    eprintln!(
        "network partition of 60 s: /healthz reported the lost source {noticed:?} after the cut; \
         the change written during it programmed {catch_up:?} after the network came back"
    );
    lab.env.wait("/healthz to report the source back", || {
        healthz(&lab.env, 1).1["sourceConnected"] == true
    });
    std::thread::sleep(Duration::from_secs(1));
    let attempts = load.finish();
    assert_attempts(&attempts, started, healed, programmed);
    // A probe every ~1-4 s (at most 4.8 s apart) + at most 5 s each, a fresh
    // connection attempt every time:
    // a few seconds, with slack for a loaded machine.
    assert!(
        catch_up < Duration::from_secs(15),
        "the change took {catch_up:?} after the partition to be programmed\n{}",
        plain(&lab.env.log(1))
    );
}
