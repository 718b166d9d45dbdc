//! Fault tests in nftables mode: rules flushed behind our back are repaired, and
//! a failing rule apply keeps the previous rules, is counted and retried.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

mod conformance;
mod faults;

use std::time::{Duration, Instant};

use conformance::{ready, replace_arg, sa, service, slice, Cond, Env, T};
use faults::{assert_no_failures, healthz, normalized, plain, unix_secs, Load};
use kp_netlab::{tcp_hello, wait_until};
use kp_testkit::prom;
use serde_json::json;

/// `nft flush ruleset` by someone else: the canary, checked every
/// syncPeriod, notices, the full sync it makes due puts everything back, and
/// kubeproxy_rs_rules_lost_total counts it.
#[test]
fn flushed_rules_are_repaired() {
    let mut env = Env::new("repair", "nftables");
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    env.put("svc", &service("fix", &["10.96.1.10"], json!({})));
    env.put("eps", &slice("fix", "1", "IPv4", &ready(&[&a])));
    env.start(1, &[]);
    let vip = sa("10.96.1.10", 80);
    env.wait_tcp(client.ns(), vip);
    env.cluster
        .exec_ok(env.cluster.node_ns(1), &["nft", "flush", "ruleset"])
        .unwrap();
    assert!(
        tcp_hello(client.ns(), vip, T).is_err(),
        "still answering without rules"
    );
    // The test proxies run with a 10 s sync period.
    env.wait_tcp(client.ns(), vip);
    env.wait("the canary metric", || {
        prom::total(&env.metrics(1), "kubeproxy_rs_rules_lost_total", &[]) >= 1.0
    });
}

/// `nft flush table` keeps our table but empties every chain: the canary
/// (nat-prerouting must hold its rule) sees it, counts it and rebuilds, also
/// in large clusters where periodic rebuilds are hourly.
#[test]
fn emptied_table_is_detected_and_repaired() {
    let mut env = Env::new("emptied", "nftables");
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    env.put("svc", &service("emp", &["10.96.1.11"], json!({})));
    env.put("eps", &slice("emp", "1", "IPv4", &ready(&[&a])));
    env.start(1, &[]);
    let vip = sa("10.96.1.11", 80);
    env.wait_tcp(client.ns(), vip);
    env.cluster
        .exec_ok(
            env.cluster.node_ns(1),
            &["nft", "flush", "table", "ip", "kube-proxy-rs"],
        )
        .unwrap();
    assert!(
        tcp_hello(client.ns(), vip, T).is_err(),
        "still answering without rules"
    );
    env.wait_tcp(client.ns(), vip);
    env.wait("the canary metric", || {
        prom::total(&env.metrics(1), "kubeproxy_rs_rules_lost_total", &[]) >= 1.0
    });
}

/// The apply fails (a wrapper `nft` that refuses scripts while a flag file
/// exists): traffic keeps using the previous rules, the failure is counted in
/// the upstream metric, and once `nft` works again the change lands.
#[test]
fn failed_apply_keeps_previous_rules() {
    let mut env = Env::new("applyfail", "nftables");
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    let bin = env.logs.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let flag = env.logs.join("fail-nft");
    let real = ["/usr/sbin/nft", "/sbin/nft", "/usr/bin/nft"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("nft installed");
    let wrapper = bin.join("nft");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nif [ \"$1\" = \"-f\" ] && [ -e {} ]; then cat >/dev/null; echo 'injected failure' >&2; exit 1; fi\nexec {real} \"$@\"\n",
            flag.display()
        ),
    )
    .unwrap();
    std::process::Command::new("chmod")
        .arg("+x")
        .arg(&wrapper)
        .status()
        .unwrap();

    env.put("svc", &service("f", &["10.96.1.20"], json!({})));
    env.put("eps", &slice("f", "1", "IPv4", &ready(&[&a])));
    let mut args = vec![
        format!("PATH={}:/usr/sbin:/usr/bin:/sbin:/bin", bin.display()),
        // The failure is injected through the `nft` program backend; the sync
        // loop's handling is the same for the netlink one.
        "KUBE_PROXY_RS_NFT_BACKEND=nft".to_string(),
        Env::binary().display().to_string(),
    ];
    args.extend(env.proxy_args(1, &[]));
    let _proxy = env.spawn(1, std::path::Path::new("/usr/bin/env"), &args, "node1.log");
    let vip = sa("10.96.1.20", 80);
    let r = env.wait_tcp(client.ns(), vip);
    assert_eq!(r.server, "a");

    std::fs::write(&flag, "").unwrap();
    env.put("eps", &slice("f", "1", "IPv4", &ready(&[&c])));
    env.wait("the failure to be counted", || {
        prom::total(
            &env.metrics(1),
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
            &[],
        ) >= 1.0
    });
    // Previous rules in force: still the old endpoint.
    let r = tcp_hello(client.ns(), vip, T).expect("service broken by a failed apply");
    assert_eq!(r.server, "a");
    std::fs::remove_file(&flag).unwrap();
    env.wait("the retried sync to land", || {
        tcp_hello(client.ns(), vip, T).is_ok_and(|r| r.server == "c")
    });
    assert!(env.log(1).contains("sync failed"));
}

// ---------------------------------------------------------------------------
// SIGKILL under load, both modes
// ---------------------------------------------------------------------------

/// kube-proxy-rs is SIGKILLed three times and restarted while a client
/// opens a new connection to a ClusterIP every 10 ms: no connection fails
/// while it is down or while it comes back, and after the restart the
/// ruleset is exactly what it was (nothing missing, nothing doubled). In
/// nftables and iptables (nft) modes each restart adopts what the previous
/// process left and sends nothing.
fn sigkill_under_load(mode: &str) {
    let mut env = Env::new("sigkill", mode);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    env.put("svc", &service("load", &["10.96.3.10"], json!({})));
    env.put("eps", &slice("load", "1", "IPv4", &ready(&[&a, &c])));
    env.start_all();
    let vip = sa("10.96.3.10", 80);
    env.wait_tcp(client.ns(), vip);
    env.wait("both endpoints in use", || {
        let r = kp_netlab::tcp_hello_many(client.ns(), vip, 20, T);
        let names: std::collections::BTreeSet<_> =
            r.iter().flatten().map(|r| r.server.clone()).collect();
        names.len() == 2
    });
    // Both families' first syncs done (IPv6 syncs after IPv4).
    let synced = |env: &Env| {
        let log = plain(&env.log(1));
        log.lines()
            .filter(|l| l.contains("synced rules") && l.contains("family=IPv6"))
            .count()
    };
    env.wait("the IPv6 sync", || synced(&env) >= 1);
    let before = normalized(&env.ruleset(1));
    assert!(!before.is_empty());

    let load = Load::start(client.ns(), vip, Duration::from_millis(10));
    for round in 0..3 {
        std::thread::sleep(Duration::from_millis(300));
        let syncs = synced(&env);
        env.kill(1);
        // Down for a while: the kernel keeps forwarding with the rules in place.
        std::thread::sleep(Duration::from_millis(700));
        env.start(1, &[]);
        // Both families resynced (the IPv6 line comes second).
        env.wait(&format!("restart {round} to sync"), || synced(&env) > syncs);
    }
    std::thread::sleep(Duration::from_millis(500));
    let results = load.finish();
    // nftables and iptables-nft adopt what the killed process left: each
    // restart's first sync (per family) read it back and sent nothing.
    let adoption = match mode {
        m if m.starts_with("nftables") => Some("adopted the table a previous run left"),
        "iptables" => Some("adopted the rules a previous run left"),
        _ => None,
    };
    if let Some(line) = adoption {
        let log = plain(&env.log(1));
        let adopted: Vec<&str> = log.lines().filter(|l| l.contains(line)).collect();
        assert_eq!(adopted.len(), 6, "3 restarts x 2 families:\n{log}");
        for l in adopted {
            assert!(
                l.contains("operations_sent=0") && l.contains("chains_rewritten=0"),
                "a restart onto an unchanged cluster sent something: {l}"
            );
        }
    }
    assert!(results.len() >= 150, "only {} attempts", results.len());
    assert_no_failures("connections during kill/restart", &results);
    let servers: std::collections::BTreeSet<_> = results
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .collect();
    assert_eq!(servers.len(), 2, "{servers:?}");

    let after = normalized(&env.ruleset(1));
    if before != after {
        let count = |v: &[String], l: &String| v.iter().filter(|x| *x == l).count();
        let missing: Vec<_> = before
            .iter()
            .filter(|l| count(&after, l) < count(&before, l))
            .collect();
        let extra: Vec<_> = after
            .iter()
            .filter(|l| count(&after, l) > count(&before, l))
            .collect();
        panic!(
            "ruleset changed across restarts\nmissing: {missing:#?}\nextra: {extra:#?}\ncounts before/after: {}/{}\n{}",
            before.len(),
            after.len(),
            env.ruleset(1)
        );
    }
}

#[test]
fn sigkill_under_load_nftables() {
    sigkill_under_load("nftables");
}

#[test]
fn sigkill_under_load_iptables() {
    sigkill_under_load("iptables");
}

/// With socket load balancing the pinned programs and maps balance while
/// no proxy runs, and each restart adopts them.
#[test]
fn sigkill_under_load_nftables_socketlb() {
    sigkill_under_load("nftables-socketlb");
}

// ---------------------------------------------------------------------------
// Someone else flushes the iptables nat table (iptables mode)
// ---------------------------------------------------------------------------

/// `iptables -t nat -F` empties every nat chain (ours and the builtin jumps
/// to them) but deletes none: the canary (checked every syncPeriod, 10 s
/// here) still notices, the full sync it makes due repairs it, and
/// kubeproxy_rs_rules_lost_total counts it.
#[test]
fn iptables_nat_flush_is_repaired() {
    nat_flush_is_repaired("iptables", "iptables");
}

/// The same with the legacy backend (`--iptables-backend=legacy`), flushed
/// with iptables-legacy: the canary is checked in the backend we program.
#[test]
fn iptables_legacy_nat_flush_is_repaired() {
    nat_flush_is_repaired("iptables-legacy", "iptables-legacy");
}

fn nat_flush_is_repaired(mode: &str, flush_prog: &str) {
    let mut env = Env::new("natflush", mode);
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    env.put("svc", &service("nf", &["10.96.3.20"], json!({})));
    env.put("eps", &slice("nf", "1", "IPv4", &ready(&[&a])));
    env.start(1, &[]);
    let vip = sa("10.96.3.20", 80);
    env.wait_tcp(client.ns(), vip);
    assert_eq!(
        prom::total(&env.metrics(1), "kubeproxy_rs_rules_lost_total", &[]),
        0.0
    );
    env.cluster
        .exec_ok(env.cluster.node_ns(1), &[flush_prog, "-t", "nat", "-F"])
        .unwrap();
    assert!(
        tcp_hello(client.ns(), vip, T).is_err(),
        "still answering without nat rules"
    );
    let t0 = Instant::now();
    env.wait_tcp(client.ns(), vip);
    // One sync period (10 s here) plus the sync itself on a loaded machine.
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "repair took {:?}, more than one sync period",
        t0.elapsed()
    );
    env.wait("the canary metric", || {
        prom::total(&env.metrics(1), "kubeproxy_rs_rules_lost_total", &[]) >= 1.0
    });
    assert!(env.log(1).contains("removed behind our back"));
}

// ---------------------------------------------------------------------------
// API server outage of 60 s, watches cut mid-stream, 410 relist (cases 1, 2)
// ---------------------------------------------------------------------------

/// The API test server in namespace `ns` (listening on its 127.0.0.1).
struct Api(kp_testkit::NetnsApiServer);

impl std::ops::Deref for Api {
    type Target = kp_testkit::NetnsApiServer;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Api {
    fn start(ns: &str) -> Api {
        Api(kp_testkit::NetnsApiServer::start(ns).unwrap())
    }

    fn apply(&self, obj: &serde_json::Value) {
        self.0.apply(obj).unwrap();
    }
}

/// Starts the in-process test API server on node1 with Service "web"
/// (`vip`, port 80) served by `pod`, and kube-proxy-rs on node1 reading it.
fn proxy_on_test_api(env: &Env, vip: &str, pod: &kp_netlab::Pod) -> (Api, kp_netlab::ProcGuard) {
    let api = Api::start(env.cluster.node_ns(1));
    // As kubelet registers it: nftables mode's NodePorts wait for its IP.
    api.apply(&conformance::node_object(&env.cluster, 1, &[]));
    api.apply(&service("web", &[vip], json!({})));
    api.apply(&slice("web", "1", "IPv4", &ready(&[pod])));
    let kubeconfig = env.logs.join("kubeconfig");
    api.srv.write_kubeconfig(&kubeconfig).unwrap();
    let args = replace_arg(
        env.proxy_args(1, &[]),
        "--manifests=",
        &format!("--kubeconfig={}", kubeconfig.display()),
    );
    let proxy = env.spawn(1, &Env::binary(), &args, "node1.log");
    (api, proxy)
}

/// Case 1 and 2: the API server is unreachable for 60 s. Traffic keeps
/// flowing on the rules in place (a client connects every 50 ms throughout,
/// and no sync rewrites them), /healthz stays 200 and
/// says the source is disconnected, and a change made during the outage is
/// programmed as soon as the watch is back (kube-runtime's backoff is capped
/// at 30 s, so within 30 s plus one sync). Then watches that end in the middle
/// of an event, and a relist after 410 Gone, keep the rules too.
#[test]
fn api_outage_60s_and_broken_watches() {
    api_outage_60s_and_broken_watches_in("nftables");
}

/// The same with socket load balancing: its maps keep balancing through the
/// outage, and the change made meanwhile reaches them too.
#[test]
fn api_outage_60s_and_broken_watches_socketlb() {
    api_outage_60s_and_broken_watches_in("nftables-socketlb");
}

fn api_outage_60s_and_broken_watches_in(mode: &str) {
    let mut env = Env::new("outage", mode);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    let (api, _proxy) = proxy_on_test_api(&env, "10.96.4.10", &a);
    let vip = sa("10.96.4.10", 80);
    let late = sa("10.96.4.11", 80);
    assert_eq!(env.wait_tcp(client.ns(), vip).server, "a");
    assert_eq!(healthz(&env, 1).1["sourceConnected"], true);

    // --- 60 s outage ---
    let load = Load::start(client.ns(), vip, Duration::from_millis(50));
    let down_at = Instant::now();
    let synced_before = plain(&env.log(1)).matches("synced rules").count();
    api.srv.set_down(true);
    env.wait("/healthz to report the lost source", || {
        healthz(&env, 1).1["sourceConnected"] == false
    });
    std::thread::sleep(Duration::from_secs(20));
    // Changes made while the proxy cannot see them.
    api.apply(&slice("web", "1", "IPv4", &ready(&[&c])));
    api.apply(&service("late", &["10.96.4.11"], json!({})));
    api.apply(&slice("late", "1", "IPv4", &ready(&[&c])));
    while down_at.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_secs(5));
        let (code, body) = healthz(&env, 1);
        assert_eq!(code, 200, "/healthz failed during the outage: {body}");
        assert_eq!(body["sourceConnected"], false, "{body}");
        assert!(body["sourceDisconnectedSince"].is_string(), "{body}");
    }
    let during = load.finish();
    assert!(during.len() > 600, "only {} attempts", during.len());
    assert_no_failures("connections during the outage", &during);
    assert!(
        during.iter().all(|(_, r)| r.as_deref() == Ok("a")),
        "the rules changed while the API server was away"
    );
    // Nothing rewrote the rules meanwhile: as upstream v1.36.2, with nothing
    // seen to change no sync runs within the hour (the canary is checked
    // every syncPeriod).
    assert_eq!(
        plain(&env.log(1)).matches("synced rules").count(),
        synced_before,
        "a sync ran while the API server was away\n{}",
        env.log(1)
    );

    // --- back ---
    let load = Load::start(client.ns(), vip, Duration::from_millis(50));
    api.srv.set_down(false);
    let up_at = Instant::now();
    assert!(
        wait_until(Duration::from_secs(45), Duration::from_millis(100), || {
            // Short timeouts: the moment it works is what is measured.
            let t = Duration::from_millis(500);
            tcp_hello(client.ns(), late, t).is_ok_and(|r| r.server == "c")
                && tcp_hello(client.ns(), vip, t).is_ok_and(|r| r.server == "c")
        }),
        "changes made during the outage were not programmed\n{}",
        env.log(1)
    );
    let caught_up = up_at.elapsed();
    let seen = std::time::SystemTime::now();
    eprintln!("outage changes programmed {caught_up:?} after the API server came back");
    assert!(caught_up < Duration::from_secs(40), "{caught_up:?}");
    // "Within one sync after reconnection": from the moment the source sees
    // the API server again to the changes answering.
    let log = plain(&env.log(1));
    let back = log
        .lines()
        .find(|l| l.contains("source reconnected"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(unix_secs)
        .expect("the sync loop logs the reconnection");
    let since = seen
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        - back;
    eprintln!("programmed {since:.2} s after the source reconnected");
    assert!(
        since < 5.0,
        "changes took {since:.2} s after the source reconnected (more than one sync)"
    );
    // Probe interval (at most 4.8 s once backed off) + relist + sync, with
    // slack for a loaded CI box.
    assert!(caught_up < Duration::from_secs(12), "{caught_up:?}");
    env.wait("/healthz to report the source back", || {
        healthz(&env, 1).1["sourceConnected"] == true
    });

    // --- a watch that ends in the middle of an event ---
    api.srv.truncate_watches();
    std::thread::sleep(Duration::from_millis(500));
    api.apply(&slice("web", "1", "IPv4", &ready(&[&a, &c])));
    env.wait("a change after a truncated watch", || {
        env.ruleset(1).contains(&a.ip().to_string())
    });
    // --- history compacted and watches dropped: 410, relist, no flush ---
    api.srv.compact();
    api.srv.drop_watches();
    std::thread::sleep(Duration::from_secs(1));
    api.apply(&slice("late", "1", "IPv4", &ready(&[&a])));
    env.wait("a change after the relist", || {
        tcp_hello(client.ns(), late, T).is_ok_and(|r| r.server == "a")
    });
    let after = load.finish();
    assert_no_failures(
        "connections across reconnect, truncation and relist",
        &after,
    );
}

/// A misbehaving API server: after the history is
/// compacted, every EndpointSlice list answers 500 for 2 minutes, so the
/// proxy cannot relist. The rules stay exactly as they were and traffic
/// flows, /healthz says the source is disconnected, and the lists it sends
/// meanwhile stay few (the probe backs off to one every ~4 s with jitter;
/// it used to list once a second in lockstep). When lists work again the
/// change made meanwhile is programmed.
#[test]
fn endpointslice_lists_failing_for_2_minutes() {
    let mut env = Env::new("list500", "nftables");
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    let (api, _proxy) = proxy_on_test_api(&env, "10.96.4.20", &a);
    let vip = sa("10.96.4.20", 80);
    assert_eq!(env.wait_tcp(client.ns(), vip).server, "a");
    let before = env.ruleset(1);

    let load = Load::start(client.ns(), vip, Duration::from_millis(100));
    api.srv.set_list_error("endpointslices", Some(500));
    let fault_at = Instant::now();
    // Watches resume from their resourceVersion unless it is gone: compact
    // and drop them, so that the proxy must relist.
    api.srv.compact();
    api.srv.drop_watches();
    env.wait("/healthz to report the lost source", || {
        healthz(&env, 1).1["sourceConnected"] == false
    });
    // A change the proxy cannot see while lists fail.
    api.apply(&slice("web", "1", "IPv4", &ready(&[&c])));
    while fault_at.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_secs(5));
        let (code, body) = healthz(&env, 1);
        assert_eq!(code, 200, "/healthz failed while lists fail: {body}");
        assert_eq!(body["sourceConnected"], false, "{body}");
        assert_eq!(
            env.ruleset(1),
            before,
            "the rules changed while lists failed"
        );
    }
    let lists: Vec<Instant> = api
        .srv
        .lists("endpointslices")
        .into_iter()
        .filter(|t| *t >= fault_at)
        .collect();
    api.srv.set_list_error("endpointslices", None);
    let healed = Instant::now();
    let during = load.finish();
    assert_no_failures("connections while lists failed", &during);
    assert!(during.iter().all(|(_, r)| r.as_deref() == Ok("a")));

    // Bounded: the probe's (~32 in 2 minutes at most 4.8 s apart, jittered)
    // and kube-runtime's own relists (backoff to 30 s). A probe a second
    // would be 120 and more.
    let gaps: Vec<f64> = lists
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    eprintln!(
        "{} EndpointSlice lists in 120 s of 500s; gaps {:?}",
        lists.len(),
        gaps.iter().map(|g| format!("{g:.2}")).collect::<Vec<_>>()
    );
    assert!(
        (10..=60).contains(&lists.len()),
        "{} EndpointSlice lists in 2 minutes",
        lists.len()
    );
    // No bursts: the watcher's retries and the probe's are independent and
    // may meet by chance, but Service lists that still work once made every
    // watch restart at once, over and over (44 gaps under 10 ms in a row).
    let bursts = gaps.iter().filter(|g| **g < 0.05).count();
    assert!(bursts <= 4, "{bursts} lists right after another: {gaps:?}");
    // Jittered: the waits between the probe's lists (the long ones) differ.
    let long: Vec<f64> = gaps.iter().copied().filter(|g| *g > 2.5).collect();
    let spread = long.iter().cloned().fold(f64::MIN, f64::max)
        - long.iter().cloned().fold(f64::MAX, f64::min);
    assert!(long.len() >= 5 && spread > 0.2, "no jitter: {gaps:?}");

    // Back: the change made meanwhile is programmed.
    assert!(
        wait_until(Duration::from_secs(30), Duration::from_millis(100), || {
            tcp_hello(client.ns(), vip, Duration::from_millis(500)).is_ok_and(|r| r.server == "c")
        }),
        "the change made while lists failed was not programmed\n{}",
        env.log(1)
    );
    eprintln!("programmed {:?} after lists worked again", healed.elapsed());
    env.wait("/healthz to report the source back", || {
        healthz(&env, 1).1["sourceConnected"] == true
    });
}

// ---------------------------------------------------------------------------
// The netlink apply fails (default nftables backend)
// ---------------------------------------------------------------------------

/// The kernel rejects a netlink batch: someone added a chain to our table
/// that jumps to a Service's chain, so deleting that Service's chain fails
/// with EBUSY and the whole batch is refused. The previous rules stay in
/// force (the deleted Service still answers), the failure is counted in
/// kubeproxy_sync_proxy_rules_nftables_sync_failures_total, the retry waits
/// for the backoff and is a full sync (which rebuilds the table from scratch,
/// dropping the foreign chain), and then the deletion lands.
#[test]
fn netlink_apply_failure_keeps_rules_and_retries_full() {
    let mut env = Env::new("nlfail", "nftables");
    let a = env.pod(1, "a");
    let client = env.pod(1, "client");
    // Session affinity: a chain of its own (a ClusterIP-only Service
    // without it is picked in a shared chain, which others still use).
    env.put(
        "svc",
        &service(
            "gone",
            &["10.96.5.10"],
            json!({"sessionAffinity": "ClientIP"}),
        ),
    );
    env.put("eps", &slice("gone", "1", "IPv4", &ready(&[&a])));
    env.put("svc2", &service("stay", &["10.96.5.11"], json!({})));
    env.put("eps2", &slice("stay", "1", "IPv4", &ready(&[&a])));
    env.start(1, &[]);
    let vip = sa("10.96.5.10", 80);
    env.wait_tcp(client.ns(), vip);
    let rules = env.on_node(1, &["nft", "list", "table", "ip", "kube-proxy-rs"]);
    let chain = rules
        .lines()
        .map(str::trim)
        .find_map(|l| {
            l.strip_prefix("chain service-")
                .filter(|r| r.contains("default/gone/tcp/http"))
                .map(|r| format!("service-{}", r.trim_end_matches(" {")))
        })
        .unwrap_or_else(|| panic!("no service chain for default/gone:\n{rules}"));
    env.cluster
        .exec_ok(
            env.cluster.node_ns(1),
            &[
                "nft",
                &format!(
                    "add chain ip kube-proxy-rs foreign-hold; add rule ip kube-proxy-rs foreign-hold jump {chain}"
                ),
            ],
        )
        .unwrap();
    let failures = |env: &Env| {
        prom::total(
            &env.metrics(1),
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
            &[],
        )
    };
    assert_eq!(failures(&env), 0.0);
    env.remove("svc");
    env.remove("eps");
    env.wait("the failed apply to be counted", || failures(&env) >= 1.0);
    // One transaction: nothing of it applied, the Service still answers.
    assert_eq!(tcp_hello(client.ns(), vip, T).unwrap().server, "a");
    env.wait("the full retry to delete the Service", || {
        tcp_hello(client.ns(), vip, T).is_err()
    });
    assert!(tcp_hello(client.ns(), sa("10.96.5.11", 80), T).is_ok());
    env.wait("the retry to be logged", || {
        let log = plain(&env.log(1));
        log.lines()
            .skip_while(|l| !l.contains("sync failed"))
            .any(|l| l.contains("synced rules") && l.contains("family=IPv4"))
    });
    let log = plain(&env.log(1));
    let fail_at = log
        .lines()
        .position(|l| l.contains("sync failed"))
        .expect("the failure is logged");
    let retry = log
        .lines()
        .skip(fail_at)
        .find(|l| l.contains("synced rules") && l.contains("family=IPv4"))
        .expect("a successful retry");
    assert!(retry.contains("full=true"), "retry was not full: {retry}");
    // The retry waited for the backoff (2 s after the first failure).
    let ts = |l: &str| -> f64 {
        let t = l.split_whitespace().next().unwrap_or("");
        let hms = t.split('T').nth(1).unwrap_or("").trim_end_matches('Z');
        hms.split(':')
            .map(|x| x.parse::<f64>().unwrap_or(0.0))
            .fold(0.0, |acc, x| acc * 60.0 + x)
    };
    let fail_line = log.lines().nth(fail_at).unwrap();
    let gap = ts(retry) - ts(fail_line);
    assert!(gap >= 1.9, "retried after {gap:.2} s, before the backoff");
    assert!(
        !env.ruleset(1).contains("foreign-hold"),
        "the full resync kept a foreign chain in our table"
    );
}

// ---------------------------------------------------------------------------
// Rolling updates and DNS-like UDP, both modes
// ---------------------------------------------------------------------------

/// A pod whose echo server the test can stop (the pod "exits").
fn own_pod(env: &Env, node: usize, name: &str) -> (kp_netlab::Pod, kp_netlab::ServerGuard) {
    let p = env.cluster.add_pod(node, name).unwrap();
    let s = env
        .cluster
        .serve(p.ns(), name, kp_netlab::ServeSpec::both(&[8080]))
        .unwrap();
    (p, s)
}

/// How an endpoint appears in this mode's rule listing.
fn ep_marker(mode: &str, ip: std::net::IpAddr) -> String {
    match mode {
        "iptables" => format!("{ip}:8080"),
        _ => format!("{ip} . 8080"),
    }
}

/// A rollout of a Service with externalTrafficPolicy=Local: the old pod
/// turns terminating (still serving) before its replacement is ready — so
/// for a while only a terminating local endpoint exists and must be used —,
/// then the new pod becomes ready, the old one leaves the slice and finally
/// exits. An external client hits the NodePort and a pod hits the ClusterIP,
/// each every 10 ms: not one request may fail.
fn rolling_update(mode: &str) {
    let mut env = Env::new("rollout", mode);
    let (old, old_srv) = own_pod(&env, 1, "old");
    let (new, _new_srv) = own_pod(&env, 1, "new");
    let (other, _other_srv) = own_pod(&env, 2, "other");
    let client = env.pod(1, "client");
    let svc = service(
        "roll",
        &["10.96.6.10"],
        json!({"type": "NodePort", "externalTrafficPolicy": "Local",
               "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30610}]}),
    );
    env.put("svc", &svc);
    let step = |env: &Env, eps: &[(&kp_netlab::Pod, Cond)]| {
        env.put("eps", &slice("roll", "1", "IPv4", eps));
        // Manifest poll (250 ms) + one sync, with slack.
        std::thread::sleep(Duration::from_millis(1500));
    };
    env.put(
        "eps",
        &slice(
            "roll",
            "1",
            "IPv4",
            &[(&old, Cond::Ready), (&other, Cond::Ready)],
        ),
    );
    env.start(1, &[]);
    let cl = env.cluster.client_ns().to_string();
    let np = sa("10.100.0.11", 30610);
    let vip = sa("10.96.6.10", 80);
    assert_eq!(env.wait_tcp(&cl, np).server, "old");
    env.wait_tcp(client.ns(), vip);

    let ext = Load::start(&cl, np, Duration::from_millis(10));
    let int = Load::start(client.ns(), vip, Duration::from_millis(10));
    std::thread::sleep(Duration::from_millis(500));
    // The new pod exists but is not ready; the old one is terminating.
    step(
        &env,
        &[
            (&old, Cond::Terminating),
            (&new, Cond::NotReady),
            (&other, Cond::Ready),
        ],
    );
    step(
        &env,
        &[
            (&old, Cond::Terminating),
            (&new, Cond::Ready),
            (&other, Cond::Ready),
        ],
    );
    env.put(
        "eps",
        &slice(
            "roll",
            "1",
            "IPv4",
            &[(&new, Cond::Ready), (&other, Cond::Ready)],
        ),
    );
    let gone = ep_marker(mode, old.ip());
    env.wait("the old pod to leave the rules", || {
        !env.ruleset(1).contains(&gone)
    });
    std::thread::sleep(Duration::from_millis(300));
    drop(old_srv); // the old pod exits
    std::thread::sleep(Duration::from_millis(1000));
    let ext = ext.finish();
    let int = int.finish();
    assert!(
        ext.len() > 300 && int.len() > 300,
        "{} / {}",
        ext.len(),
        int.len()
    );
    assert_no_failures("NodePort requests during the rollout", &ext);
    assert_no_failures("ClusterIP requests during the rollout", &int);
    let ext_servers: std::collections::BTreeSet<_> =
        ext.iter().filter_map(|(_, r)| r.as_deref().ok()).collect();
    // eTP=Local: only the node's own pods, the terminating one included.
    assert_eq!(
        ext_servers,
        ["new", "old"].into_iter().collect(),
        "external traffic went to {ext_servers:?}"
    );
    assert_eq!(ext.last().and_then(|(_, r)| r.as_deref().ok()), Some("new"));
}

#[test]
fn rolling_update_etp_local_nftables() {
    rolling_update("nftables");
}

#[test]
fn rolling_update_etp_local_iptables() {
    rolling_update("iptables");
}

#[test]
fn rolling_update_etp_local_nftables_socketlb() {
    rolling_update("nftables-socketlb");
}

/// A DNS-like client keeps one UDP socket and asks every 100 ms. Its server
/// is replaced: the new pod becomes ready, the old one leaves the slice
/// (still answering for a moment, as a terminating pod does) and exits. The
/// client's conntrack entry still points at the old pod, so without the
/// cleanup it would keep asking a pod that is gone; the proxy deletes the
/// entry over netlink after the sync, the next ask creates a fresh one to
/// the new pod, and no ask goes unanswered.
/// kubeproxy_conntrack_reconciler_deleted_entries_total counts the deletion.
fn dns_client_survives_replacement(mode: &str, family: &str) {
    let mut env = Env::new("dnsudp", mode);
    let (old, old_srv) = own_pod(&env, 1, "old");
    let (new, _new_srv) = own_pod(&env, 2, "new");
    let client = env.pod(1, "client");
    env.put(
        "svc",
        &service(
            "dns",
            &["10.96.6.20", "fd00:96::6:20"],
            json!({"ipFamilyPolicy": "PreferDualStack"}),
        ),
    );
    env.put("eps", &slice("dns", "1", family, &ready(&[&old])));
    env.start(1, &[]);
    let dns = if family == "IPv6" {
        sa("fd00:96::6:20", 53)
    } else {
        sa("10.96.6.20", 53)
    };
    env.wait("UDP answers", || {
        kp_netlab::udp_ask(client.ns(), dns, T).is_ok()
    });
    let session = kp_netlab::udp_session(client.ns(), dns).unwrap();
    let deleted = |env: &Env| {
        prom::total(
            &env.metrics(1),
            "kubeproxy_conntrack_reconciler_deleted_entries_total",
            &[],
        )
    };
    let before = deleted(&env);

    let mut answers: Vec<Result<String, String>> = Vec::new();
    let ask = |answers: &mut Vec<Result<String, String>>| {
        let t = Instant::now();
        answers.push(
            session
                .ask(Duration::from_secs(1))
                .map(|r| r.server)
                .map_err(|e| e.to_string()),
        );
        std::thread::sleep(Duration::from_millis(100).saturating_sub(t.elapsed()));
    };
    for _ in 0..10 {
        ask(&mut answers);
    }
    env.put("eps", &slice("dns", "1", family, &ready(&[&old, &new])));
    for _ in 0..10 {
        ask(&mut answers);
    }
    // The old pod leaves the slice; the flow moves once its entry is deleted.
    env.put("eps", &slice("dns", "1", family, &ready(&[&new])));
    let t0 = Instant::now();
    while answers.last().and_then(|r| r.as_deref().ok()) != Some("new") {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the UDP flow never left the removed endpoint: {answers:?}\n{}",
            env.log(1)
        );
        ask(&mut answers);
    }
    drop(old_srv);
    let gone = answers.len();
    for _ in 0..20 {
        ask(&mut answers);
    }
    // Which asks failed, against when the slice changed (ask 10: both
    // endpoints; 20: the old one gone; `gone`: its server stopped), so that
    // a failure says which step lost it.
    let failed: Vec<_> = answers
        .iter()
        .enumerate()
        .filter(|(_, r)| r.is_err())
        .collect();
    assert!(
        failed.is_empty(),
        "unanswered (index, error): {failed:?} of {} (both endpoints from 10, the old one out from 20, its server stopped from {gone}): {answers:?}\n{}",
        answers.len(),
        env.log(1)
    );
    assert!(
        answers
            .iter()
            .rev()
            .take(20)
            .all(|r| r.as_deref() == Ok("new")),
        "{answers:?}"
    );
    env.wait("the deletion to be counted", || {
        deleted(&env) >= before + 1.0
    });
}

#[test]
fn dns_client_survives_replacement_nftables() {
    dns_client_survives_replacement("nftables", "IPv4");
}

#[test]
fn dns_client_survives_replacement_iptables() {
    dns_client_survives_replacement("iptables", "IPv4");
}

#[test]
fn dns_client_survives_replacement_ipv6_nftables() {
    dns_client_survives_replacement("nftables", "IPv6");
}

#[test]
fn dns_client_survives_replacement_ipv6_iptables() {
    dns_client_survives_replacement("iptables", "IPv6");
}

/// A connected UDP socket is left to nftables by the socket balancer, so
/// the conntrack cleanup is what moves it here too.
#[test]
fn dns_client_survives_replacement_nftables_socketlb() {
    dns_client_survives_replacement("nftables-socketlb", "IPv4");
}

// ---------------------------------------------------------------------------
// Out-of-window TCP packets: "invalid conntrack state"
// ---------------------------------------------------------------------------

mod boom {
    //! A server that, on request, sends the client a TCP segment far outside
    //! the connection's window from a raw socket (like upstream's
    //! regression-issue-74839 "boom" server). Conntrack marks it INVALID,
    //! so the proxy's reverse NAT is not applied; if it reached the client,
    //! the client would answer the unknown 4-tuple with a RST whose sequence
    //! number is exactly what the server expects, and the server's side of
    //! the connection would be reset.

    use std::io::{BufRead, BufReader, Write};
    use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    const TCP_REPAIR: libc::c_int = 19;
    const TCP_REPAIR_QUEUE: libc::c_int = 20;
    const TCP_QUEUE_SEQ: libc::c_int = 21;
    const TCP_RECV_QUEUE: libc::c_int = 1;
    const TCP_SEND_QUEUE: libc::c_int = 2;

    fn setopt(fd: i32, opt: libc::c_int, v: libc::c_int) -> std::io::Result<()> {
        // SAFETY: setsockopt with a c_int of the right size.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                opt,
                &v as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn queue_seq(fd: i32, queue: libc::c_int) -> std::io::Result<u32> {
        setopt(fd, TCP_REPAIR_QUEUE, queue)?;
        let mut v: u32 = 0;
        let mut len = std::mem::size_of::<u32>() as libc::socklen_t;
        // SAFETY: getsockopt into a u32 of the given size.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::IPPROTO_TCP,
                TCP_QUEUE_SEQ,
                &mut v as *mut u32 as *mut libc::c_void,
                &mut len,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(v)
    }

    /// (next sequence number to send, next expected from the peer), read
    /// with TCP_REPAIR (root).
    fn seqs(s: &TcpStream) -> std::io::Result<(u32, u32)> {
        let fd = s.as_raw_fd();
        setopt(fd, TCP_REPAIR, 1)?;
        let r = (|| {
            Ok((
                queue_seq(fd, TCP_SEND_QUEUE)?,
                queue_seq(fd, TCP_RECV_QUEUE)?,
            ))
        })();
        // -1: leave repair mode without sending a window probe.
        setopt(fd, TCP_REPAIR, -1)?;
        r
    }

    fn csum(data: &[u8], mut sum: u32) -> u16 {
        for ch in data.chunks(2) {
            let w = if ch.len() == 2 {
                u16::from_be_bytes([ch[0], ch[1]])
            } else {
                u16::from_be_bytes([ch[0], 0])
            };
            sum += u32::from(w);
        }
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    /// Sends one TCP segment src -> dst with ACK|PSH, `seq`, `ack`, payload.
    fn send_segment(
        src: (Ipv4Addr, u16),
        dst: (Ipv4Addr, u16),
        seq: u32,
        ack: u32,
        payload: &[u8],
    ) -> std::io::Result<()> {
        let mut seg = Vec::with_capacity(20 + payload.len());
        seg.extend_from_slice(&src.1.to_be_bytes());
        seg.extend_from_slice(&dst.1.to_be_bytes());
        seg.extend_from_slice(&seq.to_be_bytes());
        seg.extend_from_slice(&ack.to_be_bytes());
        seg.push(5 << 4); // header length 20
        seg.push(0x18); // PSH | ACK
        seg.extend_from_slice(&65535u16.to_be_bytes());
        seg.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent
        seg.extend_from_slice(payload);
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&src.0.octets());
        pseudo.extend_from_slice(&dst.0.octets());
        pseudo.extend_from_slice(&[0, 6]);
        pseudo.extend_from_slice(&(seg.len() as u16).to_be_bytes());
        let mut sum = 0u32;
        for ch in pseudo.chunks(2) {
            sum += u32::from(u16::from_be_bytes([ch[0], ch[1]]));
        }
        let c = csum(&seg, sum);
        seg[16..18].copy_from_slice(&c.to_be_bytes());
        // SAFETY: raw socket(2); checked below, closed at the end.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_TCP) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: sockaddr_in is plain data.
        let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        sa.sin_family = libc::AF_INET as libc::sa_family_t;
        sa.sin_addr.s_addr = u32::from_ne_bytes(dst.0.octets());
        // SAFETY: seg and sa are valid for the given lengths.
        let rc = unsafe {
            libc::sendto(
                fd,
                seg.as_ptr() as *const libc::c_void,
                seg.len(),
                0,
                &sa as *const libc::sockaddr_in as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        let err = std::io::Error::last_os_error();
        // SAFETY: fd is ours.
        unsafe { libc::close(fd) };
        if rc < 0 {
            return Err(err);
        }
        Ok(())
    }

    /// Serves connections on `listener` (in the server pod's namespace):
    /// greets "boom", on the line "boom" sends three out-of-window segments
    /// to the client, waits, says "sent", then echoes lines.
    pub fn serve(listener: TcpListener, me: Ipv4Addr) {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { return };
            std::thread::spawn(move || {
                let Ok(SocketAddr::V4(peer)) = s.peer_addr() else {
                    return;
                };
                let _ = s.write_all(b"boom\n");
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut line = String::new();
                while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                    if line.trim() == "boom" {
                        let Ok((snd, rcv)) = seqs(&s) else { return };
                        for i in 0..3u32 {
                            // 1 GiB ahead: outside any window conntrack allows.
                            let seq = snd.wrapping_add(1 << 30).wrapping_add(i * 100);
                            let _ = send_segment(
                                (me, 8080),
                                (*peer.ip(), peer.port()),
                                seq,
                                rcv,
                                b"out-of-window",
                            );
                        }
                        std::thread::sleep(Duration::from_millis(300));
                        if s.write_all(b"sent\n").is_err() {
                            return;
                        }
                    } else if s
                        .write_all(format!("echo {}\n", line.trim()).as_bytes())
                        .is_err()
                    {
                        return;
                    }
                    line.clear();
                }
            });
        }
    }

    /// The client side, run inside the client pod: connect, ask for the
    /// boom, then check the connection still carries data both ways.
    pub fn probe(addr: SocketAddr) -> Result<(), String> {
        let t = Duration::from_secs(3);
        let s = TcpStream::connect_timeout(&addr, t).map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(t)).map_err(|e| e.to_string())?;
        let mut w = s.try_clone().map_err(|e| e.to_string())?;
        let mut r = BufReader::new(s);
        let mut line = String::new();
        let mut expect = |r: &mut BufReader<TcpStream>, want: &str| -> Result<(), String> {
            line.clear();
            match r.read_line(&mut line) {
                Ok(0) => Err(format!("connection closed waiting for {want:?}")),
                Ok(_) if line.trim() == want => Ok(()),
                Ok(_) => Err(format!("got {line:?}, wanted {want:?}")),
                Err(e) => Err(format!("waiting for {want:?}: {e}")),
            }
        };
        expect(&mut r, "boom")?;
        w.write_all(b"boom\n").map_err(|e| format!("write: {e}"))?;
        expect(&mut r, "sent")?;
        std::thread::sleep(Duration::from_millis(300));
        w.write_all(b"ping\n")
            .map_err(|e| format!("write after the boom: {e}"))?;
        expect(&mut r, "echo ping")
    }
}

/// Upstream's conntrack e2e "invalid state" case: the endpoint sends the
/// client segments far outside the TCP window. In iptables mode conntrack
/// marks them INVALID and our rule drops them; nftables mode has no such
/// rule (as upstream, kubernetes#122663) and relies, as upstream's CI does,
/// on nf_conntrack_tcp_be_liberal=1 (`conntrack.tcpBeLiberal`), with which
/// conntrack accepts them into the connection and NATs them. Either way the
/// connection survives. As a control, the same probe without the remedy
/// (the INVALID-drop rule deleted; be_liberal back to 0) gets its
/// connection reset, which shows the probe really produces the failure.
fn out_of_window_does_not_reset(mode: &str) {
    let mut env = Env::new("oow", mode);
    let liberal = |env: &Env, v: &str| {
        env.cluster
            .exec_ok(
                env.cluster.node_ns(1),
                &[
                    "sysctl",
                    "-w",
                    &format!("net.netfilter.nf_conntrack_tcp_be_liberal={v}"),
                ],
            )
            .unwrap();
    };
    liberal(&env, if mode == "nftables" { "1" } else { "0" });
    let client = env.pod(1, "client");
    let server = env.cluster.add_pod(1, "boom").unwrap();
    let me = match server.ip() {
        std::net::IpAddr::V4(v) => v,
        other => panic!("{other}"),
    };
    let listener = kp_netlab::in_netns(server.ns(), || {
        std::net::TcpListener::bind("0.0.0.0:8080").unwrap()
    })
    .unwrap();
    // The server (and the raw socket it opens per connection) must run in
    // the pod's namespace: threads inherit the namespace of their creator.
    let server_ns = server.ns().to_string();
    std::thread::spawn(move || {
        let _ = kp_netlab::in_netns(&server_ns, move || boom::serve(listener, me));
    });
    env.put("svc", &service("boom", &["10.96.7.10"], json!({})));
    env.put("eps", &slice("boom", "1", "IPv4", &ready(&[&server])));
    env.start(1, &[]);
    let vip = sa("10.96.7.10", 80);
    let probe = |ns: &str| kp_netlab::in_netns(ns, move || boom::probe(vip)).unwrap();
    env.wait("the service", || {
        kp_netlab::in_netns(client.ns(), move || {
            std::net::TcpStream::connect_timeout(&vip, T).is_ok()
        })
        .unwrap()
    });
    // An observer of our own (before the proxy's chains, no verdict): counts
    // the forwarded packets conntrack calls INVALID (iptables mode) or
    // accepts liberally (nftables mode: counted as a control below).
    env.cluster
        .exec_ok(
            env.cluster.node_ns(1),
            &["nft", "add table inet observe; add chain inet observe watch { type filter hook forward priority -200 ; }; add rule inet observe watch ct state invalid counter"],
        )
        .unwrap();
    let stats = |env: &Env| {
        let l = env.on_node(1, &["nft", "list", "chain", "inet", "observe", "watch"]);
        l.split("packets ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let invalid_before = stats(&env);
    for i in 0..3 {
        probe(client.ns()).unwrap_or_else(|e| panic!("probe {i}: connection broken: {e}"));
    }
    assert!(
        mode == "nftables" || stats(&env) >= invalid_before + 3,
        "conntrack saw no INVALID packets: the probe did not send out-of-window segments\n{}",
        env.on_node(1, &["nft", "list", "table", "inet", "observe"])
            + &env.on_node(1, &["conntrack", "-L"])
    );

    // Control: without our INVALID drop the same probe breaks the connection.
    env.kill(1);
    match mode {
        "iptables" => {
            env.cluster
                .exec_ok(
                    env.cluster.node_ns(1),
                    &[
                        "iptables",
                        "-D",
                        "KUBE-FORWARD",
                        "-m",
                        "conntrack",
                        "--ctstate",
                        "INVALID",
                        "-m",
                        "nfacct",
                        "--nfacct-name",
                        "ct_state_invalid_dropped_pkts",
                        "-j",
                        "DROP",
                    ],
                )
                .unwrap();
        }
        _ => {
            let listing = env.on_node(1, &["nft", "list", "table", "ip", "kube-proxy-rs"]);
            assert!(!listing.contains("ct state invalid"), "{listing}");
            liberal(&env, "0");
        }
    }
    let invalid_before = stats(&env);
    let broken = (0..3).filter(|_| probe(client.ns()).is_err()).count();
    // Now conntrack does call the segments INVALID.
    assert!(
        stats(&env) > invalid_before,
        "{}",
        env.on_node(1, &["nft", "list", "table", "inet", "observe"])
    );
    assert!(
        broken > 0,
        "without the INVALID drop the connection survived too: the test proves nothing"
    );
}

#[test]
fn out_of_window_packets_do_not_reset_nftables() {
    out_of_window_does_not_reset("nftables");
}

#[test]
fn out_of_window_packets_do_not_reset_iptables() {
    out_of_window_does_not_reset("iptables");
}

/// iptables mode, case 5: `iptables-restore` exits non-zero (a wrapper that
/// fails while a flag file exists). The previous rules stay in force, the
/// failure is counted in kubeproxy_sync_proxy_rules_iptables_restore_failures_total,
/// and once the program works again the retried full sync lands the change.
#[test]
fn iptables_restore_failure_keeps_previous_rules() {
    let mut env = Env::new("iptfail", "iptables");
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    let bin = env.logs.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let flag = env.logs.join("fail-restore");
    for prog in [
        "iptables-restore",
        "iptables-nft-restore",
        "iptables-legacy-restore",
        "ip6tables-restore",
        "ip6tables-nft-restore",
        "ip6tables-legacy-restore",
    ] {
        let Some(real) = ["/usr/sbin", "/sbin", "/usr/bin"]
            .iter()
            .map(|d| std::path::Path::new(d).join(prog))
            .find(|p| p.exists())
        else {
            continue;
        };
        let wrapper = bin.join(prog);
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nif [ -e {} ]; then cat >/dev/null; echo 'injected failure' >&2; exit 1; fi\nexec {} \"$@\"\n",
                flag.display(),
                real.display()
            ),
        )
        .unwrap();
        std::process::Command::new("chmod")
            .arg("+x")
            .arg(&wrapper)
            .status()
            .unwrap();
    }
    env.put("svc", &service("f", &["10.96.5.20"], json!({})));
    env.put("eps", &slice("f", "1", "IPv4", &ready(&[&a])));
    let mut args = vec![
        format!("PATH={}:/usr/sbin:/usr/bin:/sbin:/bin", bin.display()),
        Env::binary().display().to_string(),
    ];
    // The programs' path (iptables-nft is written over netlink by default;
    // its refused batches are kp-iptables' nft_roundtrip.rs).
    args.extend(env.proxy_args(1, &["--iptables-nft-restore"]));
    let _proxy = env.spawn(1, std::path::Path::new("/usr/bin/env"), &args, "node1.log");
    let vip = sa("10.96.5.20", 80);
    assert_eq!(env.wait_tcp(client.ns(), vip).server, "a");

    std::fs::write(&flag, "").unwrap();
    env.put("eps", &slice("f", "1", "IPv4", &ready(&[&c])));
    env.wait("the failure to be counted", || {
        prom::total(
            &env.metrics(1),
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
            &[],
        ) >= 1.0
    });
    let r = tcp_hello(client.ns(), vip, T).expect("service broken by a failed restore");
    assert_eq!(r.server, "a");
    std::fs::remove_file(&flag).unwrap();
    env.wait("the retried sync to land", || {
        tcp_hello(client.ns(), vip, T).is_ok_and(|r| r.server == "c")
    });
    // The kernel has the rules a moment before the sync loop logs them.
    let retry = || {
        let log = plain(&env.log(1));
        let fail_at = log.lines().position(|l| l.contains("sync failed"))?;
        log.lines()
            .skip(fail_at)
            .find(|l| l.contains("synced rules") && l.contains("family=IPv4"))
            .map(str::to_string)
    };
    env.wait("the retry to be logged", || retry().is_some());
    let retry = retry().unwrap_or_default();
    assert!(
        retry.contains("full=true"),
        "the retry after a failure was not a full sync: {retry}"
    );
}

#[test]
fn unix_secs_reads_log_timestamps() {
    assert_eq!(unix_secs("1970-01-01T00:00:01Z"), Some(1.0));
    assert_eq!(unix_secs("2026-11-22T03:55:45.5Z"), Some(1_795_319_745.5));
}
