//! deploy/ and the Dockerfile are checked against the code: every manifest is
//! a valid Kubernetes object (k8s-openapi types, no unknown fields), they
//! refer to each other correctly, the RBAC rules are exactly the requests the
//! binary makes, the image's build context has what the build needs and the
//! entrypoint the DaemonSet runs; and the binary, run with the DaemonSet's
//! exact command, args and mounted ConfigMap, becomes healthy against the API
//! test server and posts its start Event.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kp_netlab::{ScratchDir, ScratchNs};
use kp_testkit::NetnsApiServer;
use serde_json::{json, Value};

mod scratch;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

fn yaml(rel: &str) -> Value {
    serde_saphyr::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Parses `rel` as `T` and requires that nothing was dropped on the way: the
/// typed object serializes back to the same document (catches misspelt or
/// misplaced fields, which k8s-openapi would otherwise ignore).
fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(rel: &str) -> T {
    let v = yaml(rel);
    let t: T = serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{rel}: {e}"));
    let back = serde_json::to_value(&t).unwrap();
    assert_eq!(
        back, v,
        "{rel}: fields were lost parsing it as a Kubernetes object"
    );
    t
}

fn daemonset() -> DaemonSet {
    typed("deploy/daemonset.yaml")
}

fn container(ds: &DaemonSet) -> Container {
    let spec = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(spec.containers.len(), 1);
    spec.containers[0].clone()
}

fn configmap() -> BTreeMap<String, String> {
    typed::<ConfigMap>("deploy/configmap.yaml").data.unwrap()
}

/// (API group, resource, verb) triples a ClusterRole allows.
fn allowed(role: &ClusterRole) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for r in role.rules.as_deref().unwrap_or_default() {
        for g in r.api_groups.as_deref().unwrap_or_default() {
            for res in r.resources.as_deref().unwrap_or_default() {
                for v in &r.verbs {
                    assert_ne!(v, "*", "no wildcard verbs");
                    assert_ne!(res, "*", "no wildcard resources");
                    out.insert((g.clone(), res.clone(), v.clone()));
                }
            }
        }
    }
    out
}

/// The requests the code may make that a short run does not show: kube's
/// event recorder patches an Event that repeats (src/events.rs).
fn not_exercised() -> BTreeSet<(String, String, String)> {
    [("events.k8s.io", "events", "patch")]
        .iter()
        .map(|(g, r, v)| (g.to_string(), r.to_string(), v.to_string()))
        .collect()
}

#[test]
fn every_manifest_is_a_kubernetes_object_and_they_fit_together() {
    // The kustomization lists exactly the manifests there are.
    let k = yaml("deploy/kustomization.yaml");
    assert_eq!(k["kind"], "Kustomization");
    assert_eq!(k["namespace"], "kube-system");
    let listed: BTreeSet<String> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let present: BTreeSet<String> = std::fs::read_dir(root().join("deploy"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    assert_eq!(listed, present);

    let sa: ServiceAccount = typed("deploy/serviceaccount.yaml");
    let role: ClusterRole = typed("deploy/clusterrole.yaml");
    let binding: ClusterRoleBinding = typed("deploy/clusterrolebinding.yaml");
    let cm: ConfigMap = typed("deploy/configmap.yaml");
    let ds = daemonset();
    let sa_name = sa.metadata.name.clone().unwrap();

    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let subj = &binding.subjects.as_ref().unwrap()[0];
    assert_eq!(subj.kind, "ServiceAccount");
    assert_eq!(subj.name, sa_name);
    assert_eq!(subj.namespace.as_deref(), Some("kube-system"));

    let spec = ds.spec.as_ref().unwrap();
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some(sa_name.as_str()));
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tol = pod.tolerations.as_ref().unwrap();
    assert!(
        tol.iter()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()),
        "must tolerate every taint, as upstream's DaemonSet: {tol:?}"
    );
    // The pods carry upstream's label (what monitoring and Kubernetes' e2e
    // specs find a node's proxy by); the selector must not select upstream's
    // pods, or the two DaemonSets would count each other's during a migration.
    let selector = spec.selector.match_labels.clone().unwrap_or_default();
    let pod_labels = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    assert!(!selector.is_empty());
    for (k, v) in &selector {
        assert_eq!(
            pod_labels.get(k),
            Some(v),
            "selector {k}={v} not on the pods"
        );
    }
    assert_eq!(
        pod_labels.get("k8s-app").map(String::as_str),
        Some("kube-proxy"),
        "pods must carry upstream's k8s-app=kube-proxy: {pod_labels:?}"
    );
    assert!(
        !selector.contains_key("k8s-app"),
        "selector {selector:?} would also select upstream kube-proxy's pods"
    );
    let c = container(&ds);
    // Least privilege, as conformance_caps_* runs the proxy.
    let sc = c.security_context.as_ref().unwrap();
    let caps = sc.capabilities.as_ref().unwrap();
    assert_eq!(caps.drop.clone().unwrap(), vec!["ALL"]);
    assert_eq!(caps.add.clone().unwrap(), vec!["NET_ADMIN"]);
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        sc.seccomp_profile.as_ref().map(|p| p.type_.as_str()),
        Some("RuntimeDefault")
    );
    // The privileged setup is the init container's: the same binary and
    // config with --init-only.
    let init = pod.init_containers.as_ref().unwrap();
    assert_eq!(init.len(), 1);
    let args = init[0].args.clone().unwrap();
    assert!(args.iter().any(|a| a == "--init-only"), "{args:?}");
    assert_eq!(init[0].command, c.command);
    assert_eq!(init[0].image, c.image);
    assert!(
        args.iter().any(|a| c
            .args
            .as_ref()
            .unwrap()
            .iter()
            .any(|m| m == a && a.starts_with("--config="))),
        "the init container reads the main container's config: {args:?}"
    );
    assert_eq!(
        init[0].security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );

    // The config volume is the ConfigMap, mounted where --config points.
    let cm_name = cm.metadata.name.clone().unwrap();
    let vol = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.config_map.as_ref().map(|c| &c.name) == Some(&cm_name))
        .expect("a volume from the ConfigMap");
    let mount = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == vol.name)
        .expect("the ConfigMap volume is mounted");
    let args = c.args.clone().unwrap();
    let config_arg = args
        .iter()
        .find_map(|a| a.strip_prefix("--config="))
        .expect("--config in args");
    let file = config_arg
        .strip_prefix(&format!("{}/", mount.mount_path))
        .expect("--config is inside the ConfigMap mount");
    let data = cm.data.clone().unwrap();
    let conf = data.get(file).expect("the ConfigMap has the config file");
    let parsed = kube_proxy_rs::config::KubeProxyConfiguration::from_yaml(conf, Path::new(file))
        .expect("config.conf is a valid KubeProxyConfiguration");
    let kc = parsed.client_connection.kubeconfig.clone();
    let kc_file = kc
        .strip_prefix(&format!("{}/", mount.mount_path))
        .expect("the kubeconfig is inside the ConfigMap mount");
    assert!(data.contains_key(kc_file), "ConfigMap lacks {kc_file}");

    // Probes: /livez and /healthz on the healthz port of the config.
    let port = parsed
        .healthz_bind_address
        .rsplit(':')
        .next()
        .unwrap()
        .parse::<i32>()
        .unwrap();
    let probe = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let h = p.as_ref().unwrap().http_get.clone().unwrap();
        (
            h.path.unwrap(),
            match h.port {
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i) => i,
                other => panic!("{other:?}"),
            },
        )
    };
    assert_eq!(probe(&c.liveness_probe), ("/livez".to_string(), port));
    assert_eq!(probe(&c.readiness_probe), ("/healthz".to_string(), port));

    // The RBAC rules are the ones the binary needs (the run-time check of the
    // real requests is `daemonset_runs_against_the_api_server`).
    let rules = allowed(&role);
    for (g, r) in [
        ("", "services"),
        ("", "nodes"),
        ("discovery.k8s.io", "endpointslices"),
    ] {
        for v in ["list", "watch"] {
            assert!(
                rules.contains(&(g.into(), r.into(), v.into())),
                "{g}/{r} {v}"
            );
        }
    }
    assert!(rules.is_superset(&not_exercised()));
}

/// `$(VAR)` expansion of container args, as kubelet does, from the
/// container's env (literal values and the spec.nodeName field).
fn expand(arg: &str, c: &Container, node: &str) -> String {
    let mut out = arg.to_string();
    for e in c.env.as_deref().unwrap_or_default() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), _) => v.clone(),
            (None, Some(from)) => {
                let f = from.field_ref.as_ref().expect("only fieldRef env is used");
                assert_eq!(f.field_path, "spec.nodeName");
                node.to_string()
            }
            _ => String::new(),
        };
        out = out.replace(&format!("$({})", e.name), &value);
    }
    assert!(!out.contains("$("), "unexpanded variable in {arg}");
    out
}

#[test]
fn dockerfile_build_context_has_what_the_build_needs() {
    let df = read("Dockerfile");
    let ignore = read(".dockerignore");
    let ignored: Vec<&str> = ignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let lines: Vec<&str> = df.lines().map(str::trim).collect();

    // Build stage: every COPY source from the context exists and is not
    // excluded, and together they hold the whole workspace.
    let mut copied = Vec::new();
    for l in lines
        .iter()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from"))
    {
        let words: Vec<&str> = l.split_whitespace().skip(1).collect();
        for src in &words[..words.len() - 1] {
            assert!(
                root().join(src).exists(),
                "COPY {src}: not in the repository"
            );
            assert!(
                !ignored.contains(src),
                "COPY {src}: excluded by .dockerignore"
            );
            copied.push(src.to_string());
        }
    }
    for needed in ["Cargo.toml", "Cargo.lock", "crates"] {
        assert!(copied.iter().any(|c| c == needed), "{needed} is not copied");
    }
    // Nothing in the crates reads files outside crates/ at compile time.
    fn scan(dir: &Path) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n != "target") {
                    scan(&p);
                }
            } else if p.extension().is_some_and(|x| x == "rs")
                && p.to_string_lossy().contains("/src/")
            {
                let text = std::fs::read_to_string(&p).unwrap();
                for m in ["include_str!(", "include_bytes!("] {
                    assert!(
                        !text.contains(&format!("{m}\"../../..")),
                        "{} includes a file outside crates/",
                        p.display()
                    );
                }
            }
        }
    }
    scan(&root().join("crates"));

    // The toolchain image is at least the workspace's rust-version.
    let ws = read("Cargo.toml");
    let want = ws
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .unwrap()
        .trim_matches('"')
        .to_string();
    let from = lines
        .iter()
        .find(|l| l.starts_with("FROM ") && l.contains("rust:"))
        .expect("a rust build stage");
    let tag = from
        .split("rust:")
        .nth(1)
        .unwrap()
        .split('-')
        .next()
        .unwrap();
    let v = |s: &str| -> Vec<u32> { s.split('.').map(|x| x.parse().unwrap()).collect() };
    assert!(
        v(tag) >= v(&want),
        "rust:{tag} is older than rust-version {want}"
    );

    // The binaries the build stage builds exist as bins of the package.
    let build = lines
        .iter()
        .find(|l| l.contains("cargo build"))
        .expect("a cargo build step");
    let bins: Vec<&str> = build
        .split("--bin ")
        .skip(1)
        .map(|s| s.split_whitespace().next().unwrap())
        .collect();
    for b in &bins {
        let main = if *b == "kube-proxy-rs" {
            root().join("crates/kube-proxy-rs/src/main.rs")
        } else {
            root().join(format!("crates/kube-proxy-rs/src/bin/{b}.rs"))
        };
        assert!(main.exists(), "--bin {b}: no {}", main.display());
    }
    // Files copied from the build stage were produced there.
    let mut installed = BTreeMap::new();
    for l in lines.iter().filter(|l| l.starts_with("COPY --from=build ")) {
        let w: Vec<&str> = l.split_whitespace().collect();
        let (src, dst) = (w[2], w[3]);
        let produced = match src.strip_prefix("/src/target/release/") {
            Some(b) => bins.contains(&b),
            None => lines.iter().any(|x| x.contains(&format!("> {src}"))),
        };
        assert!(
            produced,
            "COPY --from=build {src}: not produced by the build stage"
        );
        installed.insert(dst.to_string(), src.to_string());
    }
    // The entrypoint is the installed binary, and it is what the DaemonSet runs.
    let ep = lines
        .iter()
        .find_map(|l| l.strip_prefix("ENTRYPOINT "))
        .expect("an ENTRYPOINT");
    let ep: Vec<String> = serde_json::from_str(ep).expect("exec-form ENTRYPOINT");
    assert_eq!(
        installed.get(&ep[0]).map(String::as_str),
        Some("/src/target/release/kube-proxy-rs")
    );
    let c = container(&daemonset());
    assert_eq!(
        c.command.as_deref(),
        Some(&ep[..]),
        "DaemonSet command != ENTRYPOINT"
    );
    // The image name the DaemonSet and kustomization use is the one built.
    let image = c.image.unwrap();
    let name = image.split(':').next().unwrap();
    assert!(
        df.contains(&format!("-t {image}")),
        "Dockerfile's build command does not tag {image}"
    );
    assert_eq!(yaml("deploy/kustomization.yaml")["images"][0]["name"], name);
}

// ---------------------------------------------------------------------------
// The DaemonSet's command against the API test server
// ---------------------------------------------------------------------------

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn http_get(ns: &str, addr: SocketAddr, path: &str) -> Option<(u16, String)> {
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
fn daemonset_runs_against_the_api_server() {
    let ds = daemonset();
    let c = container(&ds);
    let data = configmap();
    let node = "node1";

    let ns = format!("kpdeploy{}", std::process::id());
    let _ns = ScratchNs::create(&ns).unwrap();

    let server = NetnsApiServer::start(&ns).unwrap();
    let srv = &server.srv;
    srv.apply_node(
        serde_json::from_value(
            // As the kubelet registers it: nftables mode's NodePorts wait for
            // its primary IP, as upstream's do.
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node},
                   "status": {"addresses": [{"type": "InternalIP", "address": "10.100.0.11"}]}}),
        )
        .unwrap(),
    );
    srv.apply_service(
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "default", "name": "web"},
            "spec": {"clusterIP": "10.96.8.8", "clusterIPs": ["10.96.8.8"], "type": "ClusterIP",
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}
        }))
        .unwrap(),
    );
    srv.apply_endpoint_slice(
        serde_json::from_value(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "default", "name": "web-1",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.244.1.2"], "conditions": {"ready": true}}]
        }))
        .unwrap(),
    );

    // The ConfigMap volume: config.conf exactly as shipped; kubeconfig.conf is
    // the file the operator edits (the control plane's address), here
    // pointing at the test server.
    let dir = ScratchDir::at(std::env::temp_dir().join(format!("{ns}-config"))).unwrap();
    std::fs::write(dir.join("config.conf"), &data["config.conf"]).unwrap();
    assert!(data["kubeconfig.conf"].contains("server: https://CONTROL-PLANE-ENDPOINT:6443"));
    srv.write_kubeconfig(&dir.join("kubeconfig.conf")).unwrap();

    // Run the container's command and args (with $(NODE_NAME) expanded as
    // kubelet does) in a private mount namespace where the ConfigMap is at
    // its mountPath and the binary at the image's path.
    let mount_path = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == "config")
        .unwrap()
        .mount_path
        .clone();
    let cmd = c.command.clone().unwrap();
    let args: Vec<String> = c
        .args
        .clone()
        .unwrap()
        .iter()
        .map(|a| expand(a, &c, node))
        .collect();
    let parent = |p: &str| Path::new(p).parent().unwrap().display().to_string();
    let script = r#"set -e
mount -t tmpfs kp "$(dirname "$1")"; mkdir -p "$1"; mount --bind "$2" "$1"
mount -t tmpfs kp "$(dirname "$3")"; touch "$3"; mount --bind "$4" "$3"
shift 4; exec "$@""#;
    assert_ne!(parent(&mount_path), parent(&cmd[0]));
    let log = dir.join("stderr.log");
    let child = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns,
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
        ])
        .args(["sh", "-c", script, "sh"])
        .arg(&mount_path)
        .arg(dir.path())
        .arg(&cmd[0])
        .arg(env!("CARGO_BIN_EXE_kube-proxy-rs"))
        .args(&cmd)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let _proc = Proc(child);
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    let wait = |what: &str, f: &mut dyn FnMut() -> bool| {
        assert!(
            kp_netlab::wait_until(Duration::from_secs(30), Duration::from_millis(100), f),
            "timed out waiting for {what}\n{}",
            logs()
        );
    };

    // Ready and live on the probes' paths and port.
    let probe = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let h = p.as_ref().unwrap().http_get.clone().unwrap();
        let port = match h.port {
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i) => i as u16,
            other => panic!("{other:?}"),
        };
        (h.path.unwrap(), SocketAddr::from(([127, 0, 0, 1], port)))
    };
    let (ready_path, ready_addr) = probe(&c.readiness_probe);
    let (live_path, live_addr) = probe(&c.liveness_probe);
    wait("the readiness probe to pass", &mut || {
        http_get(&ns, ready_addr, &ready_path).is_some_and(|(s, _)| s == 200)
    });
    let (code, body) = http_get(&ns, live_addr, &live_path).unwrap();
    assert_eq!(code, 200, "{body}");
    // The mode from the ConfigMap (nftables) programmed the Service. Waited
    // for: /healthz, the readiness probe, answers 200 before the first sync
    // as upstream's does (nothing queued is late yet).
    wait("the Service's rules in nftables", &mut || {
        scratch::ruleset(&ns).contains("10.96.8.8")
    });

    // The start Event, on our Node, as upstream's.
    wait("the Starting event", &mut || !srv.events().is_empty());
    let ev = &srv.events()[0];
    assert_eq!(ev["apiVersion"], "events.k8s.io/v1", "{ev}");
    assert_eq!(ev["reason"], "Starting");
    assert_eq!(ev["action"], "StartKubeProxy");
    assert_eq!(ev["note"], "Starting kube-proxy-rs");
    assert_eq!(ev["type"], "Normal");
    assert_eq!(ev["regarding"]["kind"], "Node");
    assert_eq!(ev["regarding"]["name"], node);
    assert_eq!(ev["reportingController"], "kube-proxy-rs");
    assert_eq!(ev["reportingInstance"], node);
    assert_eq!(srv.events().len(), 1, "one start, one Event");

    // RBAC: every request made is allowed, and every rule is used (patch on
    // events only when an Event repeats).
    let role: ClusterRole = typed("deploy/clusterrole.yaml");
    let rules = allowed(&role);
    // Services, EndpointSlices, the Node and ServiceCIDRs.
    let expected_watches = 4;
    wait("the four watches", &mut || {
        srv.api_calls().iter().filter(|c| c.verb == "watch").count() >= expected_watches
    });
    let made: BTreeSet<(String, String, String)> = srv
        .api_calls()
        .into_iter()
        .map(|c| (c.group, c.resource, c.verb))
        .collect();
    let denied: Vec<_> = made.difference(&rules).collect();
    assert!(
        denied.is_empty(),
        "requests the ClusterRole does not allow: {denied:?}"
    );
    let unused: BTreeSet<_> = rules.difference(&made).cloned().collect();
    assert_eq!(
        unused,
        not_exercised(),
        "ClusterRole rules the code never uses"
    );

    // logging.format: json in the ConfigMap: every log line is a JSON object.
    let text = logs();
    assert!(text.lines().count() > 2, "{text}");
    for l in text.lines() {
        let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{l}");
    }
}

/// The swap operators make on kubeadm clusters: kubeadm's DaemonSet (the e2e
/// lab's copy, e2e/upstream/kube-proxy.yaml) with only the image changed.
/// Its command's program is a path the image has, and the binary started
/// under that name with kubeadm's exact arguments and ConfigMap takes them
/// as upstream does (`mode: ""` is iptables).
#[test]
fn kubeadms_daemonset_runs_our_image_unchanged() {
    let text = read("e2e/upstream/kube-proxy.yaml")
        .replace("@API@", "https://192.0.2.1:6443")
        .replace("@MODE@", "\"\"")
        .replace("@CLUSTER_CIDR@", "10.244.0.0/16")
        .replace("@BIND@", "0.0.0.0")
        .replace("@IMAGE@", "kube-proxy-rs:0.1.0");
    let docs: Vec<Value> = text
        .split("\n---")
        .map(|d| serde_saphyr::from_str(d).unwrap())
        .collect();
    let ds = docs.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
    let cm = docs.iter().find(|d| d["kind"] == "ConfigMap").unwrap();
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    let cmd: Vec<String> = c["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert_eq!(cmd[0], "/usr/local/bin/kube-proxy");
    let df = read("Dockerfile");
    assert!(
        df.lines()
            .any(|l| l.trim() == "RUN ln -s kube-proxy-rs /usr/local/bin/kube-proxy"),
        "the image has no {}",
        cmd[0]
    );
    let dir = ScratchDir::unique("kpdeploy-kubeadm").unwrap();
    let conf = dir.join("config.conf");
    std::fs::write(&conf, cm["data"]["config.conf"].as_str().unwrap()).unwrap();
    let exe = dir.join("kube-proxy");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_kube-proxy-rs"), &exe).unwrap();
    let written = dir.join("effective.yaml");
    let args: Vec<String> = cmd[1..]
        .iter()
        .map(|a| {
            a.replace("/var/lib/kube-proxy/config.conf", conf.to_str().unwrap())
                .replace("$(NODE_NAME)", "node-1")
        })
        .collect();
    let out = Command::new(&exe)
        .args(&args)
        .arg(format!("--write-config-to={}", written.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let eff: Value = serde_saphyr::from_str(&std::fs::read_to_string(&written).unwrap()).unwrap();
    assert_eq!(eff["mode"], "iptables");
    assert_eq!(eff["hostnameOverride"], "node-1");
    assert_eq!(eff["clusterCIDR"], "10.244.0.0/16");
    assert_eq!(
        eff["clientConnection"]["kubeconfig"],
        "/var/lib/kube-proxy/kubeconfig.conf"
    );
}
