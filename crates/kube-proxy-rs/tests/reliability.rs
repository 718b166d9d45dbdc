//! Fault tests in nftables mode: rules flushed behind our back are repaired, and
//! a failing rule apply keeps the previous rules, is counted and retried.

mod conformance;

use conformance::{ready, sa, service, slice, Env, T};
use kp_netlab::tcp_hello;
use serde_json::json;

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// `nft flush ruleset` by someone else: the canary notices, the next sync
/// (at the latest the periodic full one) puts everything back, and
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
        metric(&env.metrics(1), "kubeproxy_rs_rules_lost_total") >= 1.0
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
    let log = env.logs.join("node1.log");
    let _proxy = env
        .cluster
        .spawn(
            env.cluster.node_ns(1),
            std::path::Path::new("/usr/bin/env"),
            &args,
            &log,
        )
        .unwrap();
    let vip = sa("10.96.1.20", 80);
    let r = env.wait_tcp(client.ns(), vip);
    assert_eq!(r.server, "a");

    std::fs::write(&flag, "").unwrap();
    env.put("eps", &slice("f", "1", "IPv4", &ready(&[&c])));
    env.wait("the failure to be counted", || {
        metric(
            &env.metrics(1),
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
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
