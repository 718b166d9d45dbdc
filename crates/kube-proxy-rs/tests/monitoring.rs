//! deploy/monitoring/: the alert rules pass `promtool check rules` and their
//! unit tests (`promtool test rules`), the PrometheusRule manifest holds
//! exactly the rules file's groups, and every metric the dashboard and the
//! rules use is one the real binary exports, read from its live /metrics
//! (run in a throwaway network namespace, as root).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use kp_netlab::{in_netns, wait_until};

mod scratch;
use scratch::{http_get, Ns, Proc, TempFile};

fn monitoring_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/monitoring")
}

fn read(name: &str) -> String {
    let p = monitoring_dir().join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(monitoring_dir())
        .output()
        .unwrap_or_else(|e| {
            panic!("promtool: {e} (Debian's prometheus package has it; test.sh installs it)")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

#[test]
fn alert_rules_are_valid_and_their_unit_tests_pass() {
    let out = promtool(&["check", "rules", "alerts.rules.yml"]);
    assert!(out.contains("SUCCESS"), "{out}");
    promtool(&["test", "rules", "alerts.test.yml"]);
}

#[test]
fn prometheus_rule_manifest_holds_the_rules_file() {
    let file: serde_json::Value = serde_saphyr::from_str(&read("alerts.rules.yml")).unwrap();
    let manifest: serde_json::Value = serde_saphyr::from_str(&read("prometheusrule.yaml")).unwrap();
    assert_eq!(manifest["kind"], "PrometheusRule");
    assert_eq!(manifest["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(manifest["spec"]["groups"], file["groups"]);
    assert!(file["groups"][0]["rules"].as_array().unwrap().len() >= 6);
}

/// Metric names (`kubeproxy_*`, `process_*`) in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        // rest_client_* exist only with an API client, and this run reads
        // manifests: tests/zpages_metrics.rs checks those against a real
        // API server.
        .filter(|t| {
            ["kubeproxy_", "process_", "kubernetes_"]
                .iter()
                .any(|p| t.starts_with(p))
        })
        .map(str::to_string)
        .collect()
}

/// Every expression of the dashboard (panel targets and template queries).
fn dashboard_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "definition" | "query", serde_json::Value::String(s)) => {
                        out.push(s.clone())
                    }
                    _ => dashboard_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| dashboard_exprs(v, out)),
        _ => {}
    }
}

/// `# TYPE` lines of a Prometheus text exposition: family name -> type.
fn declared(metrics: &str) -> BTreeMap<String, String> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, t)| (n.to_string(), t.to_string()))
        .collect()
}

/// Whether `name` is a series name of a declared family (a histogram's
/// `_bucket`, `_sum` and `_count` included).
fn exported(name: &str, families: &BTreeMap<String, String>) -> bool {
    families.contains_key(name)
        || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
            name.strip_suffix(suffix)
                .is_some_and(|base| families.get(base).is_some_and(|t| t == "histogram"))
        })
}

const MANIFEST: &str = r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: web, namespace: default}
  spec:
    type: ClusterIP
    clusterIP: 10.96.0.10
    ports: [{name: http, port: 80, protocol: TCP}]
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: web-1
    namespace: default
    labels: {kubernetes.io/service-name: web}
  addressType: IPv4
  ports: [{name: http, port: 8080, protocol: TCP}]
  endpoints:
  - {addresses: [10.244.1.2], nodeName: node1, conditions: {ready: true}}
"#;

#[test]
fn dashboard_and_rules_use_only_exported_metrics() {
    let ns = format!("kpmon{}", std::process::id());
    let _ns = Ns::create(&ns);
    let dir = std::env::temp_dir().join(format!("{ns}-manifests"));
    std::fs::create_dir_all(&dir).unwrap();
    let manifest = TempFile(dir.join("web.yaml"));
    std::fs::write(&manifest.0, MANIFEST).unwrap();
    let log = TempFile(std::env::temp_dir().join(format!("{ns}.log")));
    let child = Command::new("ip")
        .args(["netns", "exec", &ns, env!("CARGO_BIN_EXE_kube-proxy-rs")])
        .arg(format!("--manifests={}", dir.display()))
        .args([
            "--hostname-override=node1",
            "--healthz-bind-address=",
            "--metrics-bind-address=127.0.0.1:10249",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log.0).unwrap())
        .spawn()
        .unwrap();
    let _proc = Proc(child);
    let scrape = || {
        in_netns(&ns, || {
            http_get("127.0.0.1:10249", "/metrics").map(|(_, body)| body)
        })
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default()
    };
    let mut metrics = String::new();
    // After the first sync every family the dashboard uses is declared.
    assert!(
        wait_until(Duration::from_secs(30), Duration::from_millis(200), || {
            metrics = scrape();
            metrics.contains("kubeproxy_sync_proxy_rules_duration_seconds_count")
        }),
        "no sync seen on /metrics:\n{metrics}\nlog:\n{}",
        std::fs::read_to_string(&log.0).unwrap_or_default()
    );
    let _ = std::fs::remove_dir_all(&dir);
    let families = declared(&metrics);

    let mut exprs = Vec::new();
    let dashboard: serde_json::Value = serde_json::from_str(&read("dashboard.json")).unwrap();
    dashboard_exprs(&dashboard, &mut exprs);
    let rules: serde_json::Value = serde_saphyr::from_str(&read("alerts.rules.yml")).unwrap();
    for g in rules["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            exprs.push(r["expr"].as_str().unwrap().to_string());
        }
    }
    let used: std::collections::BTreeSet<String> =
        exprs.iter().flat_map(|e| metric_names(e)).collect();
    assert!(used.len() >= 20, "too few metrics found in {exprs:?}");
    let missing: Vec<&String> = used.iter().filter(|n| !exported(n, &families)).collect();
    assert!(
        missing.is_empty(),
        "used by deploy/monitoring but not exported: {missing:?}\n/metrics:\n{metrics}"
    );

    // The standard process metrics and the build info carry values.
    for name in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(
            metrics.lines().any(|l| l.starts_with(&format!("{name} "))),
            "{name} missing:\n{metrics}"
        );
    }
    let version = format!(
        "kubeproxy_rs_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    assert!(metrics.contains(&version), "{metrics}");
    assert!(
        metrics.contains("kubeproxy_rs_source_connected 1"),
        "{metrics}"
    );
}
