//! Named hostile objects, fed to the real binary next to
//! well-formed ones: each is rejected (or its bad value ignored, or its text
//! kept out of the rules), logged with the object's name and counted, and
//! the rest of the cluster still syncs and answers. Both modes.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

mod conformance;

use conformance::{ready, sa, service, slice, Env};
use kp_testkit::prom;
use serde_json::{json, Value};

fn svc(name: &str, ip: &str, ports: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "default", "name": name},
        "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip], "ports": ports}
    })
}

fn hostile(mode: &str) {
    let mut env = Env::new("hostile", mode);
    let a = env.pod(1, "a");
    let b = env.pod(1, "b");
    let client = env.pod(1, "client");
    let p80 = json!([{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]);

    // Well-formed: must keep working.
    env.put("good-svc", &service("good", &["10.96.9.10"], json!({})));
    let mut good_slice = slice("good", "1", "IPv4", &ready(&[&a]));
    // Out-of-family and invalid addresses inside an otherwise good slice.
    good_slice["endpoints"].as_array_mut().unwrap().extend([
        json!({"addresses": ["fd00:244:1::99"], "conditions": {"ready": true}}),
        json!({"addresses": ["10.244.1.300"], "conditions": {"ready": true}}),
    ]);
    env.put("good-eps", &good_slice);

    // Labels and annotations full of quotes, newlines and rule syntax on a
    // valid Service: accepted, and none of that text reaches the rules.
    let evil_text = "x\"; flush ruleset; -j ACCEPT\nCOMMIT\n*filter 'q' `id`";
    let mut labelled = service("labelled", &["10.96.9.11"], json!({}));
    labelled["metadata"]["labels"] = json!({"app": "ok", "note": "a\"b"});
    labelled["metadata"]["annotations"] = json!({"evil": evil_text, "also\"evil": "}{"});
    env.put("labelled-svc", &labelled);
    env.put(
        "labelled-eps",
        &slice("labelled", "1", "IPv4", &ready(&[&b])),
    );

    // 10,000 distinct ports: large but valid for the API server, so
    // accepted and programmed (it used to be rejected as hostile).
    env.put(
        "many-ports",
        &svc(
            "many-ports",
            "10.96.8.24",
            Value::Array(
                (1..=10_000)
                    .map(|p| json!({"name": format!("p{p}"), "port": p, "protocol": "TCP"}))
                    .collect(),
            ),
        ),
    );

    // Rejected objects, each with a name the log must show.
    let long = "n".repeat(253);
    let rejected: Vec<(&str, Value)> = vec![
        ("bad-ip", svc("bad-ip", "10.96.9.300", p80.clone())),
        (
            "port-zero",
            svc(
                "port-zero",
                "10.96.9.20",
                json!([{"name": "p", "port": 0, "protocol": "TCP"}]),
            ),
        ),
        (
            "port-big",
            svc(
                "port-big",
                "10.96.9.21",
                json!([{"name": "p", "port": 65536, "protocol": "TCP"}]),
            ),
        ),
        (
            "dup-ports",
            svc(
                "dup-ports",
                "10.96.9.22",
                json!([{"name": "a", "port": 80, "protocol": "TCP"}, {"name": "b", "port": 80, "protocol": "TCP"}]),
            ),
        ),
        (long.as_str(), svc(&long, "10.96.9.23", p80.clone())),
        (
            "evil\\\"; flush ruleset",
            svc(
                "evil\"; flush ruleset;\n-j ACCEPT",
                "10.96.9.25",
                p80.clone(),
            ),
        ),
        (
            "port-name",
            svc(
                "port-name",
                "10.96.9.26",
                json!([{"name": "h\"ttp; drop", "port": 80, "protocol": "TCP"}]),
            ),
        ),
    ];
    for (i, (_, obj)) in rejected.iter().enumerate() {
        env.put(&format!("bad-{i}"), obj);
    }
    // 100,000 endpoints in one slice.
    let huge = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": "default", "name": "huge-slice",
                     "labels": {"kubernetes.io/service-name": "good"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": (0..100_000u32)
            .map(|i| json!({"addresses": [format!("10.{}.{}.{}", 200 + (i >> 16), (i >> 8) & 255, i & 255)]}))
            .collect::<Vec<_>>()
    });
    env.put("huge", &huge);
    // A file that is not a manifest at all.
    std::fs::write(
        env.dir.join("broken.yaml"),
        "kind: Service\nmetadata: {name: [\n",
    )
    .unwrap();

    env.start(1, &[]);
    let r = env.wait_tcp(client.ns(), sa("10.96.9.10", 80));
    assert_eq!(r.server, "a");
    assert_eq!(env.wait_tcp(client.ns(), sa("10.96.9.11", 80)).server, "b");

    let log = env.log(1);
    for (name, _) in &rejected {
        assert!(
            log.contains(name),
            "the log never names rejected object {name:?}"
        );
    }
    for name in [
        "huge-slice",
        "broken.yaml",
        "fd00:244:1::99",
        "10.244.1.300",
    ] {
        assert!(log.contains(name), "the log never mentions {name:?}");
    }
    let m = env.metrics(1);
    // Every rejected Service, the huge slice and the broken file, each once
    // whatever the number of families (kp-sync's pacing tests check "once").
    let invalid = prom::total(&m, "kubeproxy_rs_invalid_objects_total", &[]);
    assert!(
        invalid >= (rejected.len() + 2) as f64,
        "kubeproxy_rs_invalid_objects_total = {invalid}\n{m}"
    );
    assert!(
        prom::total(&m, "kubeproxy_rs_invalid_fields_total", &[]) >= 2.0,
        "{m}"
    );

    let rules = env.ruleset(1);
    for bad in ["flush ruleset", "*filter 'q'", "`id`", "also", "10.96.9.2"] {
        assert!(
            !rules.contains(bad),
            "hostile text {bad:?} reached the rules:\n{rules}"
        );
    }
    assert!(!rules.contains("fd00:244:1::99") && !rules.contains("10.200."));
    assert!(
        rules.contains("10.96.8.24"),
        "the 10,000-port Service is not programmed"
    );
    // Still healthy, still syncing: a later change lands.
    env.put("good-eps", &slice("good", "1", "IPv4", &ready(&[&b])));
    env.wait("a change after the hostile objects", || {
        kp_netlab::tcp_hello(client.ns(), sa("10.96.9.10", 80), conformance::T)
            .is_ok_and(|r| r.server == "b")
    });
}

#[test]
fn hostile_objects_nftables() {
    hostile("nftables");
}

#[test]
fn hostile_objects_iptables() {
    hostile("iptables");
}
