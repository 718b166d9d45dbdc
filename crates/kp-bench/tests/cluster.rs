//! `kp-bench cluster` run tiny (K=2, N=20, the start and the changes) against the
//! real control plane, both proxies: its figures are what a run measured,
//! not zeros, and the latency of every change was seen on every node.

use clap::Parser;
use kp_bench::cluster::{measure, ClusterArgs, Side};
use kp_testkit::K8sBinaries;

mod common;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: ClusterArgs,
}

fn check_side(who: &str, s: &Side, k: usize, changes: usize, burst: usize) {
    assert!(s.errors.is_empty(), "{who}: {:?}", s.errors);
    let st = s.start.as_ref().expect("start figures");
    assert_eq!(st.served.len(), k, "{who}: served on every node");
    assert!(
        st.served.iter().all(|&t| t > 0.0 && t < 600.0),
        "{who}: served {:?}",
        st.served
    );
    let srv = &st.server;
    assert!(srv.api_cpu > 0.0, "{who}: API server CPU {srv:?}");
    assert!(srv.api_peak_mib > 50.0, "{who}: API server peak {srv:?}");
    // Each proxy watches Services and EndpointSlices at least (after a LIST
    // or a streaming list), their contents sent as LIST or watch bytes.
    assert!(srv.watches_open >= (2 * k) as f64, "{who}: watches {srv:?}");
    assert!(
        srv.list_bytes + srv.watch_bytes > 20.0 * 500.0,
        "{who}: bytes {srv:?}"
    );
    assert!(st.proxy_rss_mib.iter().all(|&m| m > 1.0), "{who}: {st:?}");
    let ch = s.changes.as_ref().expect("change figures");
    assert_eq!(ch.missed, 0, "{who}: changes never seen in a kernel");
    assert_eq!(
        ch.per_node,
        vec![changes + burst; k],
        "{who}: every change measured on every node"
    );
    assert_eq!(ch.steady.len(), changes * k);
    assert_eq!(ch.burst.len(), burst * k);
    for l in ch.steady.iter().chain(&ch.burst) {
        assert!(*l > 0.0 && *l < 60.0, "{who}: latency {l}");
    }
    // Both proxies' own histograms measured from the trigger-time annotation.
    for (what, (p50, p99, n)) in [("stream", ch.own_steady), ("burst", ch.own_burst)] {
        assert!(
            n >= 1.0,
            "{who}: no {what} sample in the proxies' histogram"
        );
        assert!(p50.is_some() && p99.is_some(), "{who}: {what}");
    }
}

#[test]
fn a_tiny_cluster_bench_measures_both_proxies_on_every_node() {
    if K8sBinaries::for_test_with_upstream("cluster bench").is_none() {
        return;
    }
    let Some(ours) = common::ours("cluster bench test") else {
        return;
    };
    let (k, changes, burst) = (2, 5, 10);
    let cli = Cli::parse_from([
        "kp-cluster",
        "--nodes",
        &k.to_string(),
        "--services",
        "20",
        "--scenarios",
        "start,changes",
        "--changes",
        &changes.to_string(),
        "--change-every-ms",
        "500",
        "--burst",
        &burst.to_string(),
        "--start-within",
        "300",
        "--ours",
        &ours.display().to_string(),
    ]);
    let report = measure(cli.args).expect("the bench runs");
    check_side("upstream", &report.upstream, k, changes, burst);
    check_side("ours", &report.ours, k, changes, burst);
    assert!(report.ours.restart.is_none(), "restart was not asked for");
}
