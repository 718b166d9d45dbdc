//! The real control plane harness itself: it starts inside a lab namespace,
//! serves TLS on the LAN address, validates and allocates like a cluster,
//! enforces RBAC for a ServiceAccount token, survives an API server and an
//! etcd restart with its data, and leaves nothing behind. Needs root (lab
//! namespaces) and the Kubernetes binaries (skips loudly without them,
//! fails with KP_REQUIRE_REAL_APISERVER=1).

use kp_netlab::{Cluster, ClusterOpts};
use kp_testkit::{objects, ControlPlane, ControlPlaneOpts, K8sBinaries};
use serde_json::json;

fn service(name: &str) -> serde_json::Value {
    objects::service("default", name)
        .spec(json!({"type": "NodePort"}))
        .port_json(json!({"port": 80, "protocol": "TCP", "targetPort": 8080}))
        .json()
}

#[test]
fn real_control_plane_in_a_namespace() {
    let Some(bins) = K8sBinaries::for_test("real_control_plane_in_a_namespace") else {
        return;
    };
    let cluster = Cluster::new("cp-harness", ClusterOpts::with_nodes(1)).expect("lab");
    let host = cluster.add_host("cp", 5).expect("control plane host");
    let mut cp = ControlPlane::start(
        &bins,
        ControlPlaneOpts::in_netns("harness", &host.ns, host.ip),
    )
    .expect("starting etcd and kube-apiserver");
    let dir = cp.dir().to_path_buf();
    assert!(cp.url().starts_with("https://10.100.0.5:"), "{}", cp.url());

    // The server allocates a ClusterIP from the dual-stack range and a NodePort.
    cp.apply(&service("alloc")).unwrap();
    let got: serde_json::Value =
        serde_json::from_str(&cp.kubectl(&["get", "svc", "alloc", "-o", "json"]).unwrap()).unwrap();
    let ip = got["spec"]["clusterIP"].as_str().unwrap();
    assert!(
        ip.starts_with("10.96."),
        "ClusterIP {ip} outside 10.96.0.0/16"
    );
    let np = got["spec"]["ports"][0]["nodePort"].as_u64().unwrap();
    assert!((30000..=32767).contains(&np), "nodePort {np}");

    // It validates: a ClusterIP outside the range is refused.
    let mut bad = service("bad");
    bad["spec"]["clusterIP"] = json!("192.168.77.1");
    let err = cp.apply(&bad).unwrap_err().to_string();
    assert!(err.contains("Invalid") || err.contains("invalid"), "{err}");

    // RBAC: a ServiceAccount bound to deploy/'s ClusterRole may list
    // Services but not create them.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    for f in [
        "serviceaccount.yaml",
        "clusterrole.yaml",
        "clusterrolebinding.yaml",
    ] {
        cp.apply_file(&root.join(f)).unwrap();
    }
    let kc = dir.join("sa.kubeconfig");
    cp.service_account_kubeconfig("kube-system", "kube-proxy-rs", &kc)
        .unwrap();
    let can = |verb: &str, res: &str| {
        cp.kubectl(&[
            "auth",
            "can-i",
            verb,
            res,
            "--all-namespaces",
            "--as=system:serviceaccount:kube-system:kube-proxy-rs",
        ])
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|e| e.to_string())
    };
    assert_eq!(can("list", "services"), "yes");
    // `can-i` answers "no" with exit status 1.
    let create = can("create", "services");
    assert!(create.contains("exit status: 1"), "{create}");
    assert!(std::fs::read_to_string(&kc).unwrap().contains("token: ey"));

    // The API server and etcd restart on the same data.
    cp.stop_apiserver();
    assert!(cp.kubectl(&["get", "svc", "alloc"]).is_err());
    cp.restart_etcd().unwrap();
    cp.start_apiserver().unwrap();
    assert!(cp.kubectl(&["get", "svc", "alloc"]).is_ok());

    drop(cp);
    assert!(!dir.exists(), "{} left behind", dir.display());
}
