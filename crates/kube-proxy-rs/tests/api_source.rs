//! The binary against the in-process API test server: first sync after the
//! initial list, changes programmed, rules kept through an API outage and a
//! 410 relist, and the HTTP servers' answers. Runs in a throwaway network
//! namespace (the API server listens inside it too).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_netlab::wait_until;
use kp_testkit::{objects, ApiServer, NetnsApiServer};
use serde_json::json;

mod scratch;
use scratch::{ruleset, Ns, Proc, TempFile};

fn service(ip: &str) -> Service {
    objects::service("default", "web")
        .cluster_ips(&[ip])
        .spec(json!({"type": "ClusterIP"}))
        .port("http", 80, "TCP")
        .build()
}

fn slice(ips: &[&str]) -> EndpointSlice {
    ips.iter()
        .fold(objects::slice("default", "web-1", "web"), |b, ip| {
            b.endpoint(ip)
        })
        .port("http", 8080, "TCP")
        .build()
}

fn http_get(ns: &str, addr: &str, path: &str) -> Option<(u16, String)> {
    let addr: SocketAddr = addr.parse().unwrap();
    let path = path.to_string();
    kp_netlab::in_netns(ns, move || -> Option<(u16, String)> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\n\r\n").ok()?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).ok()?;
        let status = buf.split_whitespace().nth(1)?.parse().ok()?;
        Some((
            status,
            buf.split("\r\n\r\n").nth(1).unwrap_or("").to_string(),
        ))
    })
    .ok()
    .flatten()
}

#[test]
fn binary_follows_the_api_server() {
    let ns = format!("kpapi{}", std::process::id());
    let _ns = Ns::create(&ns);

    // The API server runs on a runtime whose threads live in the namespace.
    let server = NetnsApiServer::start(&ns).unwrap();
    let srv = &server.srv;
    srv.apply_service(service("10.96.7.7"));
    srv.apply_endpoint_slice(slice(&["10.244.1.2"]));
    // nftables mode's NodePorts wait for this node's primary IP, as upstream's.
    srv.apply_node(objects::node("node1").internal_ip("10.100.0.11").build());
    let kubeconfig: PathBuf = std::env::temp_dir().join(format!("{ns}-kubeconfig"));
    srv.write_kubeconfig(&kubeconfig).unwrap();
    let log = std::env::temp_dir().join(format!("{ns}.log"));
    let child = Command::new("ip")
        .args(["netns", "exec", &ns, env!("CARGO_BIN_EXE_kube-proxy-rs")])
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args([
            "--proxy-mode=nftables",
            "--hostname-override=node1",
            "--iptables-min-sync-period=100ms",
            "--healthz-bind-address=127.0.0.1:10256",
            "--metrics-bind-address=127.0.0.1:10249",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let _proc = Proc(child);
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    let wait = |what: &str, f: &mut dyn FnMut() -> bool| {
        assert!(
            wait_until(Duration::from_secs(30), Duration::from_millis(100), f),
            "timed out waiting for {what}\n{}",
            logs()
        );
    };

    wait("the first sync", &mut || {
        ruleset(&ns).contains("10.244.1.2")
    });
    assert!(ruleset(&ns).contains("10.96.7.7 . tcp . 80"));

    // Servers.
    let (code, body) = http_get(&ns, "127.0.0.1:10256", "/healthz").unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("lastUpdated"), "{body}");
    assert_eq!(
        http_get(&ns, "127.0.0.1:10249", "/proxyMode")
            .unwrap()
            .1
            .trim(),
        "nftables"
    );
    let metrics = http_get(&ns, "127.0.0.1:10249", "/metrics").unwrap().1;
    assert!(
        metrics.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kubeproxy_sync_proxy_rules_endpoint_changes_total"),
        "{metrics}"
    );

    // A change is programmed.
    srv.apply_endpoint_slice(slice(&["10.244.1.2", "10.244.2.9"]));
    wait("the new endpoint", &mut || {
        ruleset(&ns).contains("10.244.2.9")
    });

    // The API server goes away: rules stay; a change made meanwhile lands after.
    srv.set_down(true);
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        ruleset(&ns).contains("10.244.2.9"),
        "rules were flushed during the outage"
    );
    srv.apply_endpoint_slice(slice(&["10.244.3.3"]));
    srv.set_down(false);
    wait("the change made during the outage", &mut || {
        let r = ruleset(&ns);
        r.contains("10.244.3.3") && !r.contains("10.244.2.9")
    });

    // History compacted and watches dropped: relist (410), no flush, changes still flow.
    srv.compact();
    srv.drop_watches();
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        ruleset(&ns).contains("10.244.3.3"),
        "rules were flushed by the relist"
    );
    srv.delete_service("default", "web");
    wait("the deleted service to go", &mut || {
        !ruleset(&ns).contains("10.96.7.7")
    });

    let _ = std::fs::remove_file(&kubeconfig);
    let _ = std::fs::remove_file(&log);
}

/// Runs the binary with `args` to completion (it must exit within 30 s) and
/// returns its stdout; panics with its stderr if it fails.
fn run_to_exit(args: &[String]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kube-proxy-rs"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{args:?} did not exit\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A Service (and its slice) claimed with the service.kubernetes.io/service-proxy-name
/// label arrives from the API only with `--service-proxy-name` set to that name,
/// and then the unlabelled ones are not ours. `--dry-run` prints what would be
/// programmed, so no namespace is needed.
#[test]
fn service_proxy_name_selects_the_services_from_the_api() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let srv = rt.block_on(ApiServer::start());
    const CLAIM: &str = "service.kubernetes.io/service-proxy-name";
    let svc = |name: &str, ip: &str, labels: serde_json::Value| -> Service {
        objects::service("default", name)
            .cluster_ips(&[ip])
            .spec(json!({"type": "ClusterIP"}))
            .port("http", 80, "TCP")
            .labels(labels)
            .build()
    };
    let slice = |svc: &str, ip: &str, labels: serde_json::Value| -> EndpointSlice {
        objects::slice("default", &format!("{svc}-1"), svc)
            .labels(labels)
            .endpoint(ip)
            .port("http", 8080, "TCP")
            .build()
    };
    srv.apply_service(svc("plain", "10.96.9.9", json!({})));
    srv.apply_endpoint_slice(slice("plain", "10.244.9.9", json!({})));
    // The EndpointSlice controller copies the Service's labels to its slices.
    srv.apply_service(svc("claimed", "10.96.8.8", json!({CLAIM: "my-proxy"})));
    srv.apply_endpoint_slice(slice("claimed", "10.244.8.8", json!({CLAIM: "my-proxy"})));
    srv.apply_service(svc("other", "10.96.7.7", json!({CLAIM: "other-proxy"})));
    srv.apply_endpoint_slice(slice("other", "10.244.7.7", json!({CLAIM: "other-proxy"})));

    let kubeconfig =
        TempFile(std::env::temp_dir().join(format!("kpapi-spn{}-kubeconfig", std::process::id())));
    srv.write_kubeconfig(&kubeconfig.0).unwrap();
    let base = vec![
        format!("--kubeconfig={}", kubeconfig.0.display()),
        "--hostname-override=node1".to_string(),
        "--dry-run".to_string(),
    ];

    let default = run_to_exit(&base);
    assert!(
        default.contains("10.96.9.9") && default.contains("10.244.9.9"),
        "{default}"
    );
    assert!(
        !default.contains("10.96.8.8"),
        "claimed Service handled without the flag\n{default}"
    );
    assert!(!default.contains("10.96.7.7"), "{default}");

    let mut named = base.clone();
    named.push("--service-proxy-name=my-proxy".to_string());
    let named = run_to_exit(&named);
    assert!(
        named.contains("10.96.8.8") && named.contains("10.244.8.8"),
        "the Service claimed by --service-proxy-name was not programmed\n{named}"
    );
    assert!(!named.contains("10.96.9.9"), "{named}");
    assert!(!named.contains("10.96.7.7"), "{named}");

    srv.shutdown();
}

/// `--detect-local-mode=NodeCIDR` with an API server: the podCIDRs come from
/// this node's Node, read with a list (the ClusterRole allows list and watch
/// on Nodes, not get).
#[test]
fn node_cidr_pod_cidrs_come_from_the_api() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let srv = rt.block_on(ApiServer::start());
    srv.apply_service(service("10.96.7.7"));
    srv.apply_endpoint_slice(slice(&["10.244.1.2"]));
    srv.apply_node(
        serde_json::from_value(json!({
            "metadata": {"name": "node1"},
            "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
            "status": {"addresses": [{"type": "InternalIP", "address": "10.100.0.11"}]}
        }))
        .unwrap(),
    );
    let kubeconfig = TempFile(
        std::env::temp_dir().join(format!("kpapi-ncidr{}-kubeconfig", std::process::id())),
    );
    srv.write_kubeconfig(&kubeconfig.0).unwrap();
    let out = run_to_exit(&[
        format!("--kubeconfig={}", kubeconfig.0.display()),
        "--proxy-mode=nftables".to_string(),
        "--hostname-override=node1".to_string(),
        "--detect-local-mode=NodeCIDR".to_string(),
        "--dry-run".to_string(),
    ]);
    assert!(
        out.contains("ip daddr @cluster-ips ip saddr != 10.244.1.0/24 jump mark-for-masquerade")
            && out.contains("10.96.7.7 . tcp . 80 : goto pick-tcp-1-"),
        "{out}"
    );
    let calls = srv.api_calls();
    assert!(
        calls
            .iter()
            .filter(|c| c.resource == "nodes")
            .all(|c| c.verb == "list" || c.verb == "watch"),
        "{calls:?}"
    );
    srv.shutdown();
}
