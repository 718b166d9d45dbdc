//! Ours against upstream kube-proxy v1.36, each against a real API server in
//! the same lab and after the same changes: every `kubeproxy_*`,
//! `rest_client_*` and `kubernetes_*` series name upstream's /metrics has,
//! ours has (with the same label names); /statusz and /flagz answer every
//! Accept header as upstream's do (status, Content-Type, layout, the 406
//! Status body).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

use std::collections::{BTreeMap, BTreeSet};

use conformance::*;
use serde_json::{json, Value};

const PREFIXES: [&str; 3] = ["kubeproxy_", "rest_client_", "kubernetes_"];

/// The Accept headers each z-page is asked with ("curl:" also sends curl's
/// User-Agent, for which upstream pretty-prints).
const ACCEPTS: &[Option<&str>] = &[
    None,
    Some("curl:application/json"),
    Some("*/*"),
    Some("text/plain"),
    Some("text/html, text/plain;q=0.5"),
    Some("text/html"),
    Some("application/json"),
    Some("application/yaml"),
    Some("application/json;as=KIND;v=v1beta1;g=config.k8s.io"),
    Some("application/json;as=KIND;v=v1alpha1;g=config.k8s.io"),
];

/// One HTTP answer: status, headers (lower-case names), body.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).map(String::as_str).unwrap_or("")
    }
}

fn get(ns: &str, path: &str, accept: Option<&str>) -> Answer {
    let (ua, accept) = match accept.and_then(|a| a.strip_prefix("curl:")) {
        Some(a) => ("User-Agent: curl/8.5.0\r\n", Some(a)),
        None => ("", accept),
    };
    let (path, accept) = (path.to_string(), accept.map(str::to_string));
    kp_netlab::in_netns(ns, move || {
        use std::io::{Read, Write};
        let addr = "127.0.0.1:10249".parse().unwrap();
        let mut s = std::net::TcpStream::connect_timeout(&addr, T).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        let accept = accept
            .map(|a| format!("Accept: {a}\r\n"))
            .unwrap_or_default();
        write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n{ua}{accept}\r\n").unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).unwrap();
        let (head, body) = buf.split_once("\r\n\r\n").unwrap();
        let mut lines = head.lines();
        let status = lines.next().unwrap().split_whitespace().nth(1).unwrap();
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        Answer {
            status: status.parse().unwrap(),
            headers,
            body: body.to_string(),
        }
    })
    .unwrap()
}

/// What one proxy showed.
struct Seen {
    /// Sample name -> label names, for the compared prefixes.
    series: BTreeMap<String, BTreeSet<String>>,
    /// (page, accept) -> answer.
    pages: Vec<((String, Option<String>), Answer)>,
    /// The kubernetes_feature_enabled samples.
    feature_lines: BTreeSet<String>,
    /// HELP text by family, for rest_client_* and kubernetes_*.
    help: BTreeMap<String, String>,
}

fn series(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        if !PREFIXES.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let labels = out.entry(name.to_string()).or_default();
        if let Some(rest) = line[name_end..].strip_prefix('{') {
            let inner = &rest[..rest.rfind('}').unwrap()];
            // Label values here hold no '",' sequence.
            for pair in inner.split("\",") {
                if let Some((k, _)) = pair.split_once('=') {
                    labels.insert(k.trim().to_string());
                }
            }
        }
    }
    out
}

/// Runs `mode` ("upstream/nftables", "api/nftables"...) through the same
/// changes and collects what node1's proxy shows.
fn run(mode: &str) -> Seen {
    let mut env = Env::new("zpages", mode);
    let a = env.pod(1, "a");
    let c = env.pod(2, "c");
    let client = env.pod(1, "client");
    env.put("svc", &service("web", &["10.96.0.10"], json!({})));
    env.put("eps", &slice("web", "1", "IPv4", &ready(&[&a, &c])));
    env.start_all();
    env.wait_tcp(client.ns(), sa("10.96.0.10", 80));
    // The same changes for both: a NodePort Service with a Local policy
    // and no local endpoint, then one endpoint goes.
    let before = env.syncs(1);
    env.put(
        "svc2",
        &service(
            "np",
            &["10.96.0.11"],
            json!({"type": "NodePort", "externalTrafficPolicy": "Local"}),
        ),
    );
    env.put("eps2", &slice("np", "1", "IPv4", &ready(&[&c])));
    env.put("eps", &slice("web", "1", "IPv4", &ready(&[&a])));
    env.wait_tcp(client.ns(), sa("10.96.0.11", 80));
    env.wait("a sync after the changes", || env.syncs(1) > before);
    let ns = env.cluster.node_ns(1).to_string();
    // /healthz and /livez once each, so their counters exist.
    for path in ["/healthz", "/livez"] {
        let addr = "127.0.0.1:10256".parse().unwrap();
        http_get(&ns, addr, path).expect("the health server answers");
    }
    let metrics = get(&ns, "/metrics", None);
    assert_eq!(metrics.status, 200, "{mode}: /metrics");
    let mut pages = Vec::new();
    for (page, kind) in [("/statusz", "Statusz"), ("/flagz", "Flagz")] {
        for accept in ACCEPTS {
            let accept = accept.map(|a| a.replace("KIND", kind));
            let answer = get(&ns, page, accept.as_deref());
            pages.push(((page.to_string(), accept), answer));
        }
    }
    Seen {
        series: series(&metrics.body),
        pages,
        feature_lines: metrics
            .body
            .lines()
            .filter(|l| l.starts_with("kubernetes_feature_enabled{"))
            .map(str::to_string)
            .collect(),
        help: metrics
            .body
            .lines()
            .filter_map(|l| l.strip_prefix("# HELP "))
            .filter(|l| l.starts_with("rest_client_") || l.starts_with("kubernetes_"))
            .filter_map(|l| l.split_once(' '))
            .map(|(n, t)| (n.to_string(), t.to_string()))
            .collect(),
    }
}

/// Every series name (and its label names) upstream shows, ours shows.
fn compare_series(mode: &str, up: &Seen, ours: &Seen) {
    let mut missing = Vec::new();
    let mut label_diffs = Vec::new();
    for (name, labels) in &up.series {
        match ours.series.get(name) {
            None => missing.push(name.clone()),
            Some(ours) if ours != labels => {
                label_diffs.push(format!("{name}: upstream {labels:?}, ours {ours:?}"))
            }
            Some(_) => {}
        }
    }
    // No --feature-gates on either side: the same gates, stages and states.
    let gates = |s: &Seen| s.feature_lines.clone();
    assert_eq!(
        gates(ours),
        gates(up),
        "{mode}: kubernetes_feature_enabled differs"
    );
    // deploy/monitoring's dashboard reads these from a proxy with an API
    // source (tests/monitoring.rs runs one on manifests, without them).
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/monitoring/dashboard.json"
    ))
    .unwrap();
    fn exprs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => m.iter().for_each(|(k, v)| match v {
                Value::String(e) if k == "expr" => out.push(e.clone()),
                _ => exprs(v, out),
            }),
            Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    exprs(&serde_json::from_str(&dashboard).unwrap(), &mut all);
    let used: BTreeSet<&str> = all
        .iter()
        .flat_map(|e| e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')))
        .filter(|t| t.starts_with("rest_client_"))
        .collect();
    assert!(
        !used.is_empty(),
        "the dashboard reads no rest_client_ series"
    );
    for name in used {
        assert!(
            ours.series.contains_key(name),
            "{mode}: the dashboard reads {name}, which ours does not export"
        );
    }
    // client-go's and component-base's help texts, word for word.
    for (family, text) in &up.help {
        assert_eq!(
            ours.help.get(family),
            Some(text),
            "{mode}: HELP of {family}"
        );
    }
    eprintln!("{mode}: {} upstream series compared", up.series.len());
    assert!(
        missing.is_empty() && label_diffs.is_empty(),
        "{mode}: series upstream has and ours lacks: {missing:#?}\nlabel names that differ: {label_diffs:#?}"
    );
}

/// The z-page's key (or flag name) of each `key<delimiter>value` line, with
/// its value; upstream picks the delimiter at random.
fn entries(body: &str, skip: usize) -> BTreeMap<String, String> {
    body.lines()
        .skip(skip)
        .filter(|l| !l.is_empty())
        .map(|l| {
            for key in [
                "Started",
                "Up",
                "Go version",
                "Binary version",
                "Emulation version",
                "Paths",
            ] {
                if let Some(rest) = l.strip_prefix(key) {
                    if rest.starts_with([':', '=', ' ']) {
                        let v = rest.trim_start_matches([':', '=']).trim_start();
                        return (key.to_string(), v.to_string());
                    }
                }
            }
            let end = l
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .unwrap_or(l.len());
            let rest = &l[end..];
            let v = rest
                .strip_prefix(": ")
                .or_else(|| rest.strip_prefix([':', '=', ' ']))
                .unwrap_or(rest);
            (l[..end].to_string(), v.to_string())
        })
        .collect()
}

fn compare_pages(mode: &str, up: &Seen, ours: &Seen) {
    for (((page, accept), u), (_, o)) in up.pages.iter().zip(&ours.pages) {
        let what = format!("{mode} {page} Accept {accept:?}");
        assert_eq!(
            o.status, u.status,
            "{what}: status\nupstream: {u:?}\nours: {o:?}"
        );
        assert_eq!(
            o.header("content-type"),
            u.header("content-type"),
            "{what}: Content-Type"
        );
        assert_eq!(
            o.headers.contains_key("warning"),
            u.headers.contains_key("warning"),
            "{what}: Warning header\nupstream: {u:?}\nours: {o:?}"
        );
        if u.status == 406 {
            assert_eq!(o.body, u.body, "{what}: the Status body");
            continue;
        }
        if u.header("content-type").starts_with("application/json") {
            let (u, o): (Value, Value) = (
                serde_json::from_str(&u.body).unwrap(),
                serde_json::from_str(&o.body).unwrap(),
            );
            for k in ["kind", "apiVersion", "metadata"] {
                assert_eq!(o[k], u[k], "{what}: {k}");
            }
            let keys = |v: &Value| -> BTreeSet<String> {
                v.as_object().unwrap().keys().cloned().collect()
            };
            let mut want = keys(&u);
            // Ours is no Go program.
            want.remove("goVersion");
            assert_eq!(keys(&o), want, "{what}: fields");
            if page == "/statusz" {
                assert_eq!(o["emulationVersion"], u["emulationVersion"], "{what}");
                assert_eq!(o["paths"][0], "/configz", "{what}");
            } else {
                for f in [
                    "proxy-mode",
                    "hostname-override",
                    "metrics-bind-address",
                    "v",
                ] {
                    assert_eq!(o["flags"][f], u["flags"][f], "{what}: flag {f}");
                }
            }
            continue;
        }
        // Text: the same title and warning, then the same keys.
        let head = |b: &str| b.lines().take(3).map(str::to_string).collect::<Vec<_>>();
        assert_eq!(head(&o.body), head(&u.body), "{what}: heading");
        if page == "/statusz" {
            let (ue, oe) = (entries(&u.body, 3), entries(&o.body, 3));
            let mut want: BTreeSet<&String> = ue.keys().collect();
            want.remove(&"Go version".to_string());
            assert_eq!(
                oe.keys().collect::<BTreeSet<_>>(),
                want,
                "{what}: keys\n{}",
                o.body
            );
            assert_eq!(oe["Emulation version"], ue["Emulation version"], "{what}");
            assert!(oe["Up"].ends_with(" sec"), "{what}: {}", o.body);
        } else {
            let (ue, oe) = (entries(&u.body, 3), entries(&o.body, 3));
            for f in [
                "proxy-mode",
                "hostname-override",
                "metrics-bind-address",
                "v",
            ] {
                assert_eq!(oe.get(f), ue.get(f), "{what}: flag {f}\n{}", o.body);
            }
            if accept.is_none() {
                let lacking: Vec<&String> = ue.keys().filter(|k| !oe.contains_key(*k)).collect();
                eprintln!("{what}: upstream flags ours does not have: {lacking:?}");
                let differ: Vec<String> = ue
                    .iter()
                    .filter_map(|(k, v)| {
                        let o = oe.get(k)?;
                        (o != v).then(|| format!("{k}: upstream {v:?}, ours {o:?}"))
                    })
                    .collect();
                eprintln!("{what}: flag values that differ: {differ:#?}");
            }
        }
    }
}

fn compare(mode: &str) {
    let upstream = format!("upstream/{mode}");
    let api = format!("api/{mode}");
    if !binaries_for(&upstream) || !binaries_for(&api) {
        return;
    }
    let up = run(&upstream);
    let ours = run(&api);
    compare_pages(mode, &up, &ours);
    compare_series(mode, &up, &ours);
}

#[test]
fn same_series_and_zpages_as_upstream_nftables() {
    compare("nftables");
}

#[test]
fn same_series_and_zpages_as_upstream_iptables() {
    compare("iptables");
}

/// --feature-gates reaches kubernetes_feature_enabled, and ComponentFlagz
/// off takes /flagz away (and out of /statusz's paths), as upstream.
#[test]
fn feature_gates_are_honoured() {
    let mut env = Env::new("zgates", "nftables");
    env.start(
        1,
        &["--feature-gates=ComponentFlagz=false,NativeHistograms=true"],
    );
    env.wait_synced(1);
    let ns = env.cluster.node_ns(1).to_string();
    let metrics = get(&ns, "/metrics", None).body;
    for want in [
        "kubernetes_feature_enabled{name=\"ComponentFlagz\",stage=\"BETA\"} 0\n",
        "kubernetes_feature_enabled{name=\"ComponentStatusz\",stage=\"BETA\"} 1\n",
        "kubernetes_feature_enabled{name=\"NativeHistograms\",stage=\"ALPHA\"} 1\n",
        "kubernetes_feature_enabled{name=\"NFTablesProxyMode\",stage=\"\"} 1\n",
    ] {
        assert!(metrics.contains(want), "no `{want}` in /metrics");
    }
    assert_eq!(get(&ns, "/flagz", None).status, 404);
    let statusz = get(&ns, "/statusz", None);
    assert_eq!(statusz.status, 200);
    let paths = statusz
        .body
        .lines()
        .find(|l| l.starts_with("Paths"))
        .unwrap();
    assert!(
        paths.contains("/metrics") && !paths.contains("/flagz"),
        "{paths}"
    );
}
