//! Hostile and malformed input, property-tested: arbitrary Services,
//! EndpointSlices and Nodes (as JSON and YAML manifests, through the real
//! manifest reader) and arbitrary YAML text go through the model and both
//! renderers without a panic, and every ruleset rendered from them is
//! accepted by the kernel tools in check mode (`nft -c -f`,
//! `iptables-restore --test`, and the nf_tables netlink encoder), run inside
//! a throwaway network namespace.
//!
//! Case counts: PROPTEST_CASES overrides (CI runs the defaults below).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::net::IpAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::SystemTime;

use kp_model::{
    ChangeTracker, Dataplane, DataplaneError, IpFamily, LocalDetector, ProxierConfig, ProxyState,
    TrackerConfig,
};
use kp_netlab::ScratchNs;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------

/// Strings that have broken proxies: rule-language syntax, quotes,
/// newlines, shell, very long, empty, non-ASCII.
fn nasty() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => "[a-z][a-z0-9-]{0,12}",
        1 => Just(String::new()),
        1 => Just("a\"b".to_string()),
        1 => Just("x\ny".to_string()),
        1 => Just("}; flush ruleset; table ip x {".to_string()),
        1 => Just("-j ACCEPT".to_string()),
        1 => Just("COMMIT\n*filter".to_string()),
        1 => Just("a'b;$(reboot)`id`".to_string()),
        1 => Just("a".repeat(253)),
        1 => Just("b".repeat(64)),
        1 => Just("ünïcødé".to_string()),
        1 => Just("web".to_string()),
        1 => Just("default".to_string()),
        1 => Just("http".to_string()),
        1 => Just("# comment".to_string()),
        1 => Just("a\\".to_string()),
        1 => any::<String>(),
    ]
}

fn ip4() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u8..4, 0u8..=255).prop_map(|(a, b)| format!("10.96.{a}.{b}")),
        (1u8..3, 2u8..20).prop_map(|(n, p)| format!("10.244.{n}.{p}")),
        Just("10.96.0.300".to_string()),
        Just("010.096.000.010".to_string()),
        Just("0.0.0.0".to_string()),
        Just("255.255.255.255".to_string()),
        Just("127.0.0.1".to_string()),
        Just("224.0.0.1".to_string()),
    ]
}

fn ip6() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u16..0xffff).prop_map(|a| format!("fd00:96::{a:x}")),
        (0u16..0xffff).prop_map(|a| format!("fd00:244:1::{a:x}")),
        Just("::".to_string()),
        Just("::1".to_string()),
        Just("::ffff:10.96.0.1".to_string()),
        Just("fe80::1%eth0".to_string()),
    ]
}

fn any_ip() -> impl Strategy<Value = String> {
    prop_oneof![4 => ip4(), 2 => ip6(), 1 => nasty()]
}

fn cidr() -> impl Strategy<Value = String> {
    prop_oneof![
        (any_ip(), 0u8..140).prop_map(|(ip, len)| format!("{ip}/{len}")),
        Just("0.0.0.0/0".to_string()),
        Just("::/0".to_string()),
        Just("10.100.0.0/24".to_string()),
        nasty(),
    ]
}

fn port_number() -> impl Strategy<Value = i64> {
    prop_oneof![
        4 => 1i64..65536,
        1 => Just(0i64),
        1 => Just(65535i64),
        1 => Just(65536i64),
        1 => Just(-1i64),
        1 => Just(i64::from(i32::MAX)),
    ]
}

fn protocol() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => Just(json!("TCP")),
        3 => Just(json!("UDP")),
        1 => Just(json!("SCTP")),
        1 => Just(json!("tcp")),
        1 => Just(json!("ICMP")),
        1 => Just(Value::Null),
        1 => nasty().prop_map(Value::from),
    ]
}

fn port_name() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => Just(json!("http")),
        2 => Just(json!("dns")),
        1 => Just(Value::Null),
        1 => nasty().prop_map(Value::from),
    ]
}

fn service_port() -> impl Strategy<Value = Value> {
    (
        port_name(),
        port_number(),
        protocol(),
        proptest::option::of(port_number()),
        prop_oneof![
            port_number().prop_map(Value::from),
            nasty().prop_map(Value::from),
        ],
    )
        .prop_map(|(name, port, proto, node_port, target)| {
            let mut p = json!({"port": port, "targetPort": target});
            if !name.is_null() {
                p["name"] = name;
            }
            if !proto.is_null() {
                p["protocol"] = proto;
            }
            if let Some(np) = node_port {
                p["nodePort"] = json!(np);
            }
            p
        })
}

fn string_map() -> impl Strategy<Value = Value> {
    proptest::collection::btree_map(nasty(), nasty(), 0..3).prop_map(|m| json!(m))
}

fn service() -> impl Strategy<Value = Value> {
    (
        (nasty(), prop_oneof![3 => Just("default".to_string()), 1 => nasty()]),
        proptest::collection::vec(any_ip(), 0..3),
        prop_oneof![
            Just("ClusterIP"),
            Just("NodePort"),
            Just("LoadBalancer"),
            Just("ExternalName"),
            Just("Bogus"),
        ],
        proptest::collection::vec(service_port(), 0..5),
        proptest::collection::vec(any_ip(), 0..3),
        proptest::collection::vec(cidr(), 0..3),
        proptest::collection::vec(any_ip(), 0..3),
        (
            prop_oneof![Just("Cluster"), Just("Local"), Just("Other")],
            prop_oneof![Just("None"), Just("ClientIP"), Just("Sticky")],
            -5i64..100_000,
            port_number(),
        ),
        (string_map(), string_map()),
    )
        .prop_map(
            |((name, ns), ips, ty, ports, ext, ranges, ingress, (etp, aff, timeout, hc), (labels, ann))| {
                json!({
                    "apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": name, "namespace": ns, "labels": labels, "annotations": ann},
                    "spec": {
                        "type": ty,
                        "clusterIP": ips.first().cloned().unwrap_or_default(),
                        "clusterIPs": ips,
                        "ports": ports,
                        "externalIPs": ext,
                        "loadBalancerSourceRanges": ranges,
                        "externalTrafficPolicy": etp,
                        "internalTrafficPolicy": etp,
                        "sessionAffinity": aff,
                        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": timeout}},
                        "healthCheckNodePort": hc,
                    },
                    "status": {"loadBalancer": {"ingress": ingress.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}}
                })
            },
        )
}

fn endpoint() -> impl Strategy<Value = Value> {
    (
        proptest::collection::vec(any_ip(), 0..3),
        any::<(bool, bool, bool)>(),
        prop_oneof![
            Just("node1".to_string()),
            Just("node2".to_string()),
            nasty()
        ],
        prop_oneof![Just("zone-a".to_string()), nasty()],
    )
        .prop_map(|(addrs, (r, s, t), node, zone)| {
            json!({
                "addresses": addrs,
                "conditions": {"ready": r, "serving": s, "terminating": t},
                "nodeName": node,
                "zone": zone,
                "hints": {"forZones": [{"name": zone}], "forNodes": [{"name": node}]}
            })
        })
}

fn slice() -> impl Strategy<Value = Value> {
    (
        nasty(),
        prop_oneof![3 => Just("web".to_string()), 1 => nasty()],
        prop_oneof![Just("IPv4"), Just("IPv6"), Just("FQDN"), Just("Bogus")],
        proptest::collection::vec(
            (port_name(), port_number(), protocol())
                .prop_map(|(n, p, pr)| json!({"name": n, "port": p, "protocol": pr})),
            0..4,
        ),
        proptest::collection::vec(endpoint(), 0..6),
        string_map(),
    )
        .prop_map(|(name, svc, at, ports, eps, ann)| {
            json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": name, "namespace": "default",
                             "labels": {"kubernetes.io/service-name": svc}, "annotations": ann},
                "addressType": at,
                "ports": ports,
                "endpoints": eps
            })
        })
}

fn node() -> impl Strategy<Value = Value> {
    (
        prop_oneof![Just("node1".to_string()), nasty()],
        nasty(),
        any::<bool>(),
    )
        .prop_map(|(name, zone, taint)| {
            let taints = if taint {
                json!([{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}])
            } else {
                json!([])
            };
            json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
                "spec": {"taints": taints}
            })
        })
}

/// A small cluster: always one well-formed Service "keep-me-0" with a
/// slice, plus random objects (slices of which often point at "web", a name
/// the random Services also use).
fn cluster() -> impl Strategy<Value = Vec<Value>> {
    (
        proptest::collection::vec(service(), 0..4),
        proptest::collection::vec(slice(), 0..4),
        proptest::collection::vec(node(), 0..2),
    )
        .prop_map(|(s, e, n)| {
            let mut objs = vec![
                json!({"apiVersion": "v1", "kind": "Service",
                       "metadata": {"name": "keep-me-0", "namespace": "default"},
                       "spec": {"type": "NodePort", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00:96::10"],
                                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30080}]}}),
                json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                       "metadata": {"name": "keep-me-0-slice", "namespace": "default", "labels": {"kubernetes.io/service-name": "keep-me-0"}},
                       "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                       "endpoints": [{"addresses": ["10.244.1.2"], "conditions": {"ready": true}, "nodeName": "node1"}]}),
            ];
            objs.extend(s);
            objs.extend(e);
            objs.extend(n);
            objs
        })
}

// ---------------------------------------------------------------------------
// The pipeline under test
// ---------------------------------------------------------------------------

struct NoNft;
impl kp_nftables::NftBackend for NoNft {
    fn apply(&mut self, _: &kp_nftables::Transaction) -> Result<usize, DataplaneError> {
        Ok(0)
    }
    fn table_exists(&mut self, _: IpFamily, _: &str) -> Result<bool, DataplaneError> {
        Ok(true)
    }
}

struct NoIpt;
impl kp_iptables::IptablesBackend for NoIpt {
    fn restore(&mut self, _: &str) -> Result<(), DataplaneError> {
        Ok(())
    }
    fn chains(&mut self, _: &str) -> Result<Vec<String>, DataplaneError> {
        Ok(Vec::new())
    }
    fn chain_exists(&mut self, _: &str, _: &str) -> Result<bool, DataplaneError> {
        Ok(true)
    }
    fn rule_exists(&mut self, _: &str, _: &str, _: &[String]) -> Result<bool, DataplaneError> {
        Ok(true)
    }
    fn delete_rule(&mut self, _: &str, _: &str, _: &[String]) -> Result<(), DataplaneError> {
        Ok(())
    }
}

fn proxier_config(family: IpFamily) -> ProxierConfig {
    let mut pc = ProxierConfig::new(family);
    let (node, pods, svcs): (IpAddr, &str, &str) = match family {
        IpFamily::V4 => (
            "10.100.0.11".parse().unwrap(),
            "10.244.0.0/16",
            "10.96.0.0/16",
        ),
        IpFamily::V6 => (
            "fd00:100::11".parse().unwrap(),
            "fd00:244::/48",
            "fd00:96::/108",
        ),
    };
    pc.node_ips = vec![node];
    pc.local_detector = LocalDetector::Cidrs(vec![pods.parse().unwrap()]);
    pc.service_cidrs = vec![svcs.parse().unwrap()];
    pc
}

/// Both families' states after loading `dir` through the manifest reader.
fn load(dir: &Path) -> (Vec<ProxyState>, usize) {
    let loaded = kp_source::manifest::load_dir(dir).expect("reading the directory");
    let now = SystemTime::now();
    let mut states = Vec::new();
    let mut rejected = loaded.invalid.len();
    for family in [IpFamily::V4, IpFamily::V6] {
        let mut t = ChangeTracker::new(TrackerConfig {
            family,
            node_name: "node1".into(),
            service_proxy_name: None,
        });
        for n in loaded.nodes.values() {
            t.update_node(n);
        }
        for s in loaded.services.values() {
            if t.update_service(s, now).is_err() {
                rejected += 1;
            }
        }
        for s in loaded.slices.values() {
            if t.update_endpoint_slice(s, now).is_err() {
                rejected += 1;
            }
        }
        t.take_changes();
        states.push(t.state().clone());
    }
    (states, rejected)
}

/// (nft transaction, iptables-restore input) per family.
fn render(states: &[ProxyState]) -> Vec<(IpFamily, kp_nftables::Transaction, String)> {
    [IpFamily::V4, IpFamily::V6]
        .into_iter()
        .zip(states)
        .map(|(family, st)| {
            let nft = kp_nftables::NftablesProxier::new(proxier_config(family), Box::new(NoNft));
            let ipt = kp_iptables::IptablesProxier::new(proxier_config(family), Box::new(NoIpt))
                .with_route_localnet(false);
            (family, nft.full_transaction(st), ipt.render(st))
        })
        .collect()
}

/// A throwaway namespace for check-mode runs.
struct Ns(ScratchNs);
impl Ns {
    fn new(tag: &str) -> Ns {
        let name = format!("kphostile{}{tag}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        Ns(ScratchNs::create(&name).unwrap())
    }
    fn feed(&self, argv: &[&str], input: &str) -> Result<(), String> {
        use std::io::Write;
        let mut child = Command::new("ip")
            .args(["netns", "exec", self.0.name()])
            .args(argv)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .map_err(|e| e.to_string())?;
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }
}
fn write_objects(dir: &Path, objs: &[Value], yaml: bool) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    if yaml {
        // One multi-document YAML file (JSON is valid YAML flow syntax, and
        // serde-saphyr must take each document as written).
        let text: String = objs.iter().map(|o| format!("---\n{o}\n")).collect();
        std::fs::write(dir.join("all.yaml"), text).unwrap();
    } else {
        for (i, o) in objs.iter().enumerate() {
            std::fs::write(dir.join(format!("{i:03}.json")), o.to_string()).unwrap();
        }
    }
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// ---------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------

/// Arbitrary clusters: no panic anywhere, the well-formed Service always
/// survives its hostile neighbours, and every rendered ruleset is accepted
/// by `nft -c -f`, the netlink encoder and `iptables-restore --test` /
/// `ip6tables-restore --test`.
#[test]
fn arbitrary_clusters_render_rulesets_the_kernel_accepts() {
    let ns = Ns::new("a");
    let dir = std::env::temp_dir().join(format!("kphostile{}-a", std::process::id()));
    let mut runner = TestRunner::new(Config {
        cases: cases(128),
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&(cluster(), any::<bool>()), |(objs, yaml)| {
        write_objects(&dir, &objs, yaml);
        let (states, _) = load(&dir);
        prop_assert!(
            states[0]
                .services
                .keys()
                .any(|k| &*k.service.name == "keep-me-0" && &*k.service.namespace == "default"),
            "the well-formed Service was lost next to hostile objects"
        );
        for (family, nft, ipt) in render(&states) {
            if let Err(e) = kp_nftables::NftNetlink::check(&nft) {
                return Err(TestCaseError::fail(format!(
                    "netlink encoder ({family}): {e}\n{nft}"
                )));
            }
            let nft = nft.to_string();
            if let Err(e) = ns.feed(&["nft", "-c", "-f", "-"], &nft) {
                return Err(TestCaseError::fail(format!(
                    "nft -c ({family}): {e}\n{nft}"
                )));
            }
            let prog = match family {
                IpFamily::V4 => "iptables-restore",
                IpFamily::V6 => "ip6tables-restore",
            };
            if let Err(e) = ns.feed(&[prog, "--test", "--noflush"], &ipt) {
                return Err(TestCaseError::fail(format!("{prog} --test: {e}\n{ipt}")));
            }
        }
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Arbitrary text as a YAML manifest file (and as JSON): the reader reports
/// it or loads it, never panics, and a valid file beside it still loads.
#[test]
fn arbitrary_yaml_never_panics() {
    let dir = std::env::temp_dir().join(format!("kphostile{}-y", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("0-good.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: ok, namespace: default}\nspec: {clusterIP: 10.96.0.5, ports: [{port: 80}]}\n",
    )
    .unwrap();
    let text = prop_oneof![
        any::<String>(),
        "[-:{}\\[\\]a-z0-9 \n\"'&*!|>%@`#,?]{0,200}",
        Just("--- &a\n- *a\n- *a\n".to_string()),
        Just("a: &x [*x]\n".to_string()),
        Just("kind: Service\nmetadata: {name: [1,2]}\n".to_string()),
        Just("kind: List\nitems: [{kind: Service}, 3, null]\n".to_string()),
        Just("kind: EndpointSlice\nendpoints: {}\n".to_string()),
        Just(format!(
            "kind: Service\nspec: {{ports: [{}]}}\n",
            "{port: 1},".repeat(2000)
        )),
        Just("\u{feff}kind: Node\n".to_string()),
        Just("[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[".repeat(20)),
    ];
    let mut runner = TestRunner::new(Config {
        cases: cases(1000),
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&text, |text| {
        std::fs::write(dir.join("1-fuzz.yaml"), &text).unwrap();
        std::fs::write(dir.join("2-fuzz.json"), &text).unwrap();
        let loaded = kp_source::manifest::load_dir(&dir).unwrap();
        prop_assert!(loaded.services.keys().any(|k| k.name == "ok"));
        let (states, _) = load(&dir);
        let _ = render(&states);
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Many more arbitrary clusters through model and renderers without the
/// kernel (no panic; every accepted Service renders).
#[test]
fn arbitrary_clusters_never_panic() {
    let dir = std::env::temp_dir().join(format!("kphostile{}-p", std::process::id()));
    let mut runner = TestRunner::new(Config {
        cases: cases(600),
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&cluster(), |objs| {
        write_objects(&dir, &objs, false);
        let (states, _) = load(&dir);
        for (family, nft, ipt) in render(&states) {
            if let Err(e) = kp_nftables::NftNetlink::check(&nft) {
                return Err(TestCaseError::fail(format!(
                    "netlink encoder ({family}): {e}\n{nft}"
                )));
            }
            prop_assert!(ipt.contains("COMMIT"));
        }
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = result {
        panic!("{e}");
    }
}
