//! categorize_endpoints against upstream's TestCategorizeEndpoints
//! (pkg/proxy/topology_test.go), plus PreferSameNode node-hint cases.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeSet;

use kp_model::{categorize_endpoints, Endpoint, NodeInfo, ServicePort};

#[derive(Clone, Copy, Default)]
struct Svc {
    itp_local: bool,
    etp_local: bool,
    node_port: u16,
}

fn service_port(s: Svc) -> ServicePort {
    let mut b = ServicePort::builder("ns1", "svc1")
        .port_name("p80")
        .cluster_ip("172.30.0.41")
        .node_port(s.node_port);
    if s.etp_local {
        b = b.local_external();
    }
    if s.itp_local {
        b = b.local_internal();
    }
    b.build()
}

#[derive(Clone, Default)]
struct Ep {
    addr: &'static str,
    ready: bool,
    serving: bool,
    terminating: bool,
    local: bool,
    zones: &'static [&'static str],
    nodes: &'static [&'static str],
}

fn endpoint(e: &Ep) -> Endpoint {
    let mut ep = Endpoint::at(e.addr)
        .with_zone_hints(e.zones)
        .with_node_hints(e.nodes);
    ep.is_local = e.local;
    ep.ready = e.ready;
    // Upstream's test endpoints are "serving" whenever they are ready.
    ep.serving = e.serving || e.ready;
    ep.terminating = e.terminating;
    ep
}

fn ready(addr: &'static str, zones: &'static [&'static str]) -> Ep {
    Ep {
        addr,
        ready: true,
        zones,
        ..Default::default()
    }
}

fn ready_local(addr: &'static str, local: bool) -> Ep {
    Ep {
        addr,
        ready: true,
        local,
        ..Default::default()
    }
}

fn serving_terminating(addr: &'static str, local: bool) -> Ep {
    Ep {
        addr,
        serving: true,
        terminating: true,
        local,
        ..Default::default()
    }
}

struct Case {
    name: &'static str,
    zone: Option<&'static str>,
    svc: Svc,
    endpoints: Vec<Ep>,
    cluster: &'static [&'static str],
    local: &'static [&'static str],
    /// None: the union of cluster and local.
    all: Option<&'static [&'static str]>,
    /// hasAnyEndpoints although nothing is reachable from this node.
    only_remote: bool,
}

fn set(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn addrs(v: &[&Endpoint]) -> BTreeSet<String> {
    let s: BTreeSet<String> = v.iter().map(|e| e.addr_string()).collect();
    assert_eq!(s.len(), v.len(), "duplicates in {v:?}");
    s
}

fn run(cases: Vec<Case>) {
    for c in cases {
        let node = NodeInfo {
            zone: c.zone.map(String::from),
            ..NodeInfo::named("node1")
        };
        let sp = service_port(c.svc);
        let eps: Vec<Endpoint> = c.endpoints.iter().map(endpoint).collect();
        let got = categorize_endpoints(&eps, &sp, &node);
        assert_eq!(addrs(&got.cluster), set(c.cluster), "{}: cluster", c.name);
        assert_eq!(addrs(&got.local), set(c.local), "{}: local", c.name);
        let want_all = match c.all {
            Some(a) => set(a),
            None => set(c.cluster).union(&set(c.local)).cloned().collect(),
        };
        assert_eq!(addrs(&got.all_reachable), want_all, "{}: all", c.name);
        let want_any = !want_all.is_empty() || c.only_remote;
        assert_eq!(got.has_any, want_any, "{}: has_any", c.name);
        if !sp.uses_cluster_endpoints() {
            assert!(got.cluster.is_empty(), "{}", c.name);
        }
        if !sp.uses_local_endpoints() {
            assert!(got.local.is_empty(), "{}", c.name);
        }
    }
}

const NP: Svc = Svc {
    itp_local: false,
    etp_local: false,
    node_port: 8080,
};

#[test]
fn upstream_zone_hint_cases() {
    let four = || {
        vec![
            ready("10.1.2.3:80", &["zone-a"]),
            ready("10.1.2.4:80", &["zone-b"]),
            ready("10.1.2.5:80", &["zone-c"]),
            ready("10.1.2.6:80", &["zone-a"]),
        ]
    };
    let local_four = || {
        let mut v = four();
        v[0].local = true;
        v[1].local = true;
        v
    };
    run(vec![
        Case {
            name: "all endpoints hinted, node zone has endpoints: topology used",
            zone: Some("zone-a"),
            svc: Svc::default(),
            endpoints: four(),
            cluster: &["10.1.2.3:80", "10.1.2.6:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "eTP Local: topology ignored for local endpoints",
            zone: Some("zone-a"),
            svc: Svc {
                etp_local: true,
                ..NP
            },
            endpoints: local_four(),
            cluster: &["10.1.2.3:80", "10.1.2.6:80"],
            local: &["10.1.2.3:80", "10.1.2.4:80"],
            all: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"]),
            only_remote: false,
        },
        Case {
            name: "iTP Local: topology ignored for local endpoints",
            zone: Some("zone-a"),
            svc: Svc {
                itp_local: true,
                ..NP
            },
            endpoints: local_four(),
            cluster: &["10.1.2.3:80", "10.1.2.6:80"],
            local: &["10.1.2.3:80", "10.1.2.4:80"],
            all: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"]),
            only_remote: false,
        },
        Case {
            name: "no zone label on the node",
            zone: None,
            svc: Svc::default(),
            endpoints: vec![ready("10.1.2.3:80", &["zone-a"])],
            cluster: &["10.1.2.3:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "empty zone label",
            zone: Some(""),
            svc: Svc::default(),
            endpoints: vec![ready("10.1.2.3:80", &["zone-a"])],
            cluster: &["10.1.2.3:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "node in another zone: no hints for our zone, no filtering",
            zone: Some("zone-b"),
            svc: Svc::default(),
            endpoints: vec![ready("10.1.2.3:80", &["zone-a"])],
            cluster: &["10.1.2.3:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "unready endpoint",
            zone: Some("zone-a"),
            svc: Svc::default(),
            endpoints: {
                let mut v = four();
                v[3].ready = false;
                v
            },
            cluster: &["10.1.2.3:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "only unready endpoints in our zone: no filtering",
            zone: Some("zone-a"),
            svc: Svc::default(),
            endpoints: {
                let mut v = four();
                v[0].ready = false;
                v[3].ready = false;
                v
            },
            cluster: &["10.1.2.4:80", "10.1.2.5:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "one endpoint missing hints: hints ignored",
            zone: Some("zone-a"),
            svc: Svc::default(),
            endpoints: {
                let mut v = four();
                v[2].zones = &[];
                v
            },
            cluster: &["10.1.2.3:80", "10.1.2.4:80", "10.1.2.5:80", "10.1.2.6:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "multiple hints per endpoint",
            zone: Some("zone-c"),
            svc: Svc::default(),
            endpoints: vec![
                ready("10.1.2.3:80", &["zone-a", "zone-b", "zone-c"]),
                ready("10.1.2.4:80", &["zone-b", "zone-c"]),
                ready("10.1.2.5:80", &["zone-b", "zone-d"]),
                ready("10.1.2.6:80", &["zone-c"]),
            ],
            cluster: &["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "conflicting topology and localness require merging all",
            zone: Some("zone-a"),
            svc: Svc {
                etp_local: true,
                ..NP
            },
            endpoints: vec![
                Ep {
                    local: true,
                    ..ready("10.0.0.0:80", &["zone-a"])
                },
                Ep {
                    local: true,
                    ..ready("10.0.0.1:80", &["zone-b"])
                },
                ready("10.0.0.2:80", &["zone-a"]),
                ready("10.0.0.3:80", &["zone-b"]),
            ],
            cluster: &["10.0.0.0:80", "10.0.0.2:80"],
            local: &["10.0.0.0:80", "10.0.0.1:80"],
            all: Some(&["10.0.0.0:80", "10.0.0.1:80", "10.0.0.2:80"]),
            only_remote: false,
        },
    ]);
}

#[test]
fn upstream_traffic_policy_cases() {
    let itp = Svc {
        itp_local: true,
        ..Default::default()
    };
    run(vec![
        Case {
            name: "iTP Local, no endpoints",
            zone: None,
            svc: itp,
            endpoints: vec![],
            cluster: &[],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "iTP Local, all endpoints remote",
            zone: None,
            svc: itp,
            endpoints: vec![
                ready_local("10.0.0.0:80", false),
                ready_local("10.0.0.1:80", false),
            ],
            cluster: &[],
            local: &[],
            all: None,
            only_remote: true,
        },
        Case {
            name: "iTP Local, all endpoints local",
            zone: None,
            svc: itp,
            endpoints: vec![
                ready_local("10.0.0.0:80", true),
                ready_local("10.0.0.1:80", true),
            ],
            cluster: &[],
            local: &["10.0.0.0:80", "10.0.0.1:80"],
            all: None,
            only_remote: false,
        },
        Case {
            name: "iTP Local, some endpoints local",
            zone: None,
            svc: itp,
            endpoints: vec![
                ready_local("10.0.0.0:80", true),
                ready_local("10.0.0.1:80", false),
            ],
            cluster: &[],
            local: &["10.0.0.0:80"],
            all: None,
            only_remote: false,
        },
        Case {
            name: "Cluster policy, no endpoint ready",
            zone: None,
            svc: Svc::default(),
            endpoints: vec![
                Ep {
                    addr: "10.0.0.0:80",
                    ..Default::default()
                },
                Ep {
                    addr: "10.0.0.1:80",
                    ..Default::default()
                },
            ],
            cluster: &[],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "Cluster policy, some endpoints ready",
            zone: None,
            svc: Svc::default(),
            endpoints: vec![
                Ep {
                    addr: "10.0.0.0:80",
                    ..Default::default()
                },
                ready_local("10.0.0.1:80", false),
            ],
            cluster: &["10.0.0.1:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "Cluster policy, all endpoints terminating: fall back to serving-terminating",
            zone: None,
            svc: Svc::default(),
            endpoints: vec![
                serving_terminating("10.0.0.0:80", true),
                serving_terminating("10.0.0.1:80", false),
            ],
            cluster: &["10.0.0.0:80", "10.0.0.1:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "iTP Local, eTP Cluster, some endpoints local",
            zone: None,
            svc: Svc {
                itp_local: true,
                ..NP
            },
            endpoints: vec![
                ready_local("10.0.0.0:80", true),
                ready_local("10.0.0.1:80", false),
            ],
            cluster: &["10.0.0.0:80", "10.0.0.1:80"],
            local: &["10.0.0.0:80"],
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            only_remote: false,
        },
        Case {
            name: "iTP Cluster, eTP Local, some endpoints local",
            zone: None,
            svc: Svc {
                etp_local: true,
                ..NP
            },
            endpoints: vec![
                ready_local("10.0.0.0:80", true),
                ready_local("10.0.0.1:80", false),
            ],
            cluster: &["10.0.0.0:80", "10.0.0.1:80"],
            local: &["10.0.0.0:80"],
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            only_remote: false,
        },
        Case {
            name: "iTP Local, eTP Local, some endpoints local",
            zone: None,
            svc: Svc {
                itp_local: true,
                etp_local: true,
                node_port: 8080,
            },
            endpoints: vec![
                ready_local("10.0.0.0:80", true),
                ready_local("10.0.0.1:80", false),
            ],
            cluster: &["10.0.0.0:80", "10.0.0.1:80"],
            local: &["10.0.0.0:80"],
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            only_remote: false,
        },
        Case {
            name: "iTP Local, eTP Local, all endpoints remote",
            zone: None,
            svc: Svc {
                itp_local: true,
                etp_local: true,
                node_port: 8080,
            },
            endpoints: vec![
                ready_local("10.0.0.0:80", false),
                ready_local("10.0.0.1:80", false),
            ],
            cluster: &["10.0.0.0:80", "10.0.0.1:80"],
            local: &[],
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            only_remote: false,
        },
        Case {
            name: "iTP Local, eTP Local, all endpoints remote and terminating",
            zone: None,
            svc: Svc {
                itp_local: true,
                etp_local: true,
                node_port: 8080,
            },
            endpoints: vec![
                serving_terminating("10.0.0.0:80", false),
                serving_terminating("10.0.0.1:80", false),
            ],
            cluster: &["10.0.0.0:80", "10.0.0.1:80"],
            local: &[],
            all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            only_remote: true,
        },
        Case {
            name: "iTP Cluster, eTP Local, local fallback to serving-terminating",
            zone: None,
            svc: Svc {
                etp_local: true,
                ..NP
            },
            endpoints: vec![
                ready_local("10.0.0.0:80", false),
                // Neither ready nor serving: never used.
                Ep {
                    addr: "10.0.0.1:80",
                    local: true,
                    ..Default::default()
                },
                serving_terminating("10.0.0.2:80", true),
                serving_terminating("10.0.0.3:80", false),
            ],
            cluster: &["10.0.0.0:80"],
            local: &["10.0.0.2:80"],
            all: Some(&["10.0.0.0:80", "10.0.0.2:80"]),
            only_remote: false,
        },
        Case {
            name: "eTP Local ignored when not externally accessible",
            zone: None,
            svc: Svc {
                etp_local: true,
                ..Default::default()
            },
            endpoints: vec![
                ready_local("10.0.0.0:80", false),
                ready_local("10.0.0.1:80", true),
            ],
            cluster: &["10.0.0.0:80", "10.0.0.1:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "iTP Local internal-only service has no cluster endpoints",
            zone: None,
            svc: itp,
            endpoints: vec![
                ready_local("10.0.0.0:80", false),
                ready_local("10.0.0.1:80", true),
            ],
            cluster: &[],
            local: &["10.0.0.1:80"],
            all: None,
            only_remote: false,
        },
        Case {
            name: "iTP Local: local ready preferred over local terminating",
            zone: None,
            svc: itp,
            endpoints: vec![
                ready_local("10.0.0.0:80", true),
                serving_terminating("10.0.0.1:80", true),
            ],
            cluster: &[],
            local: &["10.0.0.0:80"],
            all: None,
            only_remote: false,
        },
        Case {
            name: "Cluster policy: not-serving terminating endpoints never used",
            zone: None,
            svc: Svc::default(),
            endpoints: vec![Ep {
                addr: "10.0.0.0:80",
                terminating: true,
                ..Default::default()
            }],
            cluster: &[],
            local: &[],
            all: None,
            only_remote: false,
        },
    ]);
}

fn node_hinted(
    addr: &'static str,
    nodes: &'static [&'static str],
    zones: &'static [&'static str],
) -> Ep {
    Ep {
        addr,
        ready: true,
        nodes,
        zones,
        ..Default::default()
    }
}

#[test]
fn prefer_same_node_hints() {
    run(vec![
        Case {
            name: "all endpoints have node hints, one for us: node topology",
            zone: Some("zone-a"),
            svc: Svc::default(),
            endpoints: vec![
                node_hinted("10.0.0.1:80", &["node1"], &["zone-a"]),
                node_hinted("10.0.0.2:80", &["node2"], &["zone-a"]),
                node_hinted("10.0.0.3:80", &["node3"], &["zone-b"]),
            ],
            cluster: &["10.0.0.1:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "node hints without zone hints still apply",
            zone: None,
            svc: Svc::default(),
            endpoints: vec![
                node_hinted("10.0.0.1:80", &["node1"], &[]),
                node_hinted("10.0.0.2:80", &["node2"], &[]),
            ],
            cluster: &["10.0.0.1:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "no node hint for us: fall back to zone hints",
            zone: Some("zone-a"),
            svc: Svc::default(),
            endpoints: vec![
                node_hinted("10.0.0.2:80", &["node2"], &["zone-a"]),
                node_hinted("10.0.0.3:80", &["node3"], &["zone-b"]),
            ],
            cluster: &["10.0.0.2:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "an endpoint lacks a node hint: fall back to zone hints",
            zone: Some("zone-b"),
            svc: Svc::default(),
            endpoints: vec![
                node_hinted("10.0.0.1:80", &["node1"], &["zone-a"]),
                node_hinted("10.0.0.3:80", &[], &["zone-b"]),
            ],
            cluster: &["10.0.0.3:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "an endpoint lacks both hints: no topology at all",
            zone: Some("zone-a"),
            svc: Svc::default(),
            endpoints: vec![
                node_hinted("10.0.0.1:80", &["node1"], &["zone-a"]),
                node_hinted("10.0.0.3:80", &[], &[]),
            ],
            cluster: &["10.0.0.1:80", "10.0.0.3:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "hints on unready endpoints do not count",
            zone: Some("zone-a"),
            svc: Svc::default(),
            endpoints: vec![
                node_hinted("10.0.0.1:80", &["node2"], &["zone-b"]),
                Ep {
                    ready: false,
                    ..node_hinted("10.0.0.2:80", &["node1"], &["zone-a"])
                },
            ],
            cluster: &["10.0.0.1:80"],
            local: &[],
            all: None,
            only_remote: false,
        },
        Case {
            name: "node topology with eTP Local merges the local endpoints",
            zone: Some("zone-a"),
            svc: Svc {
                etp_local: true,
                ..NP
            },
            endpoints: vec![
                node_hinted("10.0.0.1:80", &["node1"], &["zone-a"]),
                Ep {
                    local: true,
                    ..node_hinted("10.0.0.2:80", &["node2"], &["zone-a"])
                },
            ],
            cluster: &["10.0.0.1:80"],
            local: &["10.0.0.2:80"],
            all: Some(&["10.0.0.1:80", "10.0.0.2:80"]),
            only_remote: false,
        },
    ]);
}

#[test]
fn all_reachable_has_no_duplicates_with_terminating_local_fallback() {
    // Cluster falls back to serving-terminating endpoints; so does Local: the
    // local one is in both lists but must appear once.
    let eps: Vec<Endpoint> = [
        serving_terminating("10.0.0.1:80", true),
        serving_terminating("10.0.0.2:80", false),
    ]
    .iter()
    .map(endpoint)
    .collect();
    let sp = service_port(Svc {
        etp_local: true,
        ..NP
    });
    let node = NodeInfo::named("node1");
    let got = categorize_endpoints(&eps, &sp, &node);
    assert_eq!(addrs(&got.cluster), set(&["10.0.0.1:80", "10.0.0.2:80"]));
    assert_eq!(addrs(&got.local), set(&["10.0.0.1:80"]));
    assert_eq!(
        addrs(&got.all_reachable),
        set(&["10.0.0.1:80", "10.0.0.2:80"])
    );
    assert!(got.has_any);
}
