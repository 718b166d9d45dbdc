//! EndpointSelection: which endpoint set serves internal and external
//! traffic, the "no local endpoints" flags, and drop-or-reject, for every
//! combination of internal and external traffic policy; and which traffic
//! is masqueraded.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use kp_model::{
    ClusterIpMasquerading, Endpoint, EndpointSelection, EndpointSet, ExternalMasquerading,
    IpFamily, LocalDetector, NoEndpoints, NodeInfo, ProxierConfig, ServicePort,
};

/// iTP x eTP, externally accessible or not.
fn svc(itp_local: bool, etp_local: bool, node_port: u16) -> ServicePort {
    let mut b = ServicePort::builder("ns", "svc")
        .cluster_ip("10.96.0.10")
        .node_port(node_port);
    if itp_local {
        b = b.local_internal();
    }
    if etp_local {
        b = b.local_external();
    }
    b.build()
}

fn addrs(eps: &[&Endpoint]) -> Vec<String> {
    eps.iter().map(|e| e.addr_string()).collect()
}

fn node() -> NodeInfo {
    NodeInfo::named("node1")
}

const L: &str = "10.0.0.1:80";
const R: &str = "10.0.0.2:80";

/// One local and one remote ready endpoint.
fn both() -> Vec<Endpoint> {
    vec![Endpoint::at(L).local(), Endpoint::at(R)]
}

use EndpointSet::{Cluster, Local};

/// iTP Local, eTP Local -> the set serving internal and external traffic,
/// and the no-local flags when this node has no endpoint.
type Policy = (bool, bool, EndpointSet, EndpointSet, (bool, bool));

#[rustfmt::skip]
const POLICIES: [Policy; 4] = [
    (false, false, Cluster, Cluster, (false, false)),
    (false, true,  Cluster, Local,   (false, true)),
    (true,  false, Local,   Cluster, (true,  false)),
    (true,  true,  Local,   Local,   (true,  true)),
];

#[test]
fn policy_table() {
    // A local and a remote endpoint; then only the remote one.
    let cases: [(Vec<Endpoint>, &[&str], &[&str]); 2] =
        [(both(), &[L, R], &[L]), (vec![Endpoint::at(R)], &[R], &[])];
    for (eps, cluster, local) in cases {
        for (itp, etp, internal, external, no_local_without) in POLICIES {
            let name = format!("iTP Local {itp}, eTP Local {etp}, local endpoints {local:?}");
            let sp = svc(itp, etp, 30080);
            let s = EndpointSelection::new(&sp, &eps, &node());
            let of = |set| if set == Local { local } else { cluster };
            assert_eq!(s.internal, internal, "{name}: internal set");
            assert_eq!(s.external, external, "{name}: external set");
            assert_eq!(addrs(s.internal_endpoints()), of(internal), "{name}");
            assert_eq!(addrs(s.external_endpoints()), of(external), "{name}");
            assert_eq!(s.has_internal(), !of(internal).is_empty(), "{name}");
            assert_eq!(s.has_external(), !of(external).is_empty(), "{name}");
            assert!(s.externally_accessible, "{name}");
            let want = if local.is_empty() {
                no_local_without
            } else {
                (false, false)
            };
            assert_eq!(s.no_local(), want, "{name}: no_local");
            // Endpoints exist (somewhere): traffic a Local policy leaves
            // without any is dropped, not rejected.
            assert!(s.has_any, "{name}");
            assert_eq!(s.no_endpoints(), NoEndpoints::Drop, "{name}");
        }
    }
}

#[test]
fn not_externally_accessible_has_no_external_traffic() {
    // eTP Local on a ClusterIP-only port (convert_service never sets it, a
    // hand-built port may): ignored, nothing counts as lacking local
    // endpoints for external traffic.
    for itp in [false, true] {
        let sp = svc(itp, true, 0);
        let remote = vec![Endpoint::at(R)];
        let s = EndpointSelection::new(&sp, &remote, &node());
        assert_eq!(s.external, Cluster, "itp {itp}");
        assert!(s.external_endpoints().is_empty(), "itp {itp}");
        assert!(!s.has_external(), "itp {itp}");
        assert_eq!(s.no_local(), (itp, false), "itp {itp}");
        assert_eq!(s.internal, if itp { Local } else { Cluster });
        // Only iTP Local uses the local set; only iTP Cluster the cluster set.
        let eps = both();
        let s = EndpointSelection::new(&sp, &eps, &node());
        assert_eq!(addrs(&s.local), if itp { vec![L] } else { vec![] });
        assert_eq!(s.has_local(), itp);
        assert_eq!(s.has_cluster(), !itp);
    }
}

#[test]
fn no_endpoints_anywhere_is_rejected() {
    for (itp, etp) in [(false, false), (false, true), (true, false), (true, true)] {
        let sp = svc(itp, etp, 30080);
        let eps = vec![
            Endpoint::at(L).local().unready(),
            Endpoint::at(R).terminated(),
        ];
        let s = EndpointSelection::new(&sp, &eps, &node());
        assert!(!s.has_any);
        assert!(!s.has_internal() && !s.has_external());
        assert!(s.all_reachable.is_empty());
        assert_eq!(s.no_endpoints(), NoEndpoints::Reject, "{itp} {etp}");
        assert_eq!(s.no_local(), (itp, etp));
    }
}

#[test]
fn terminating_fallback_per_set() {
    // Cluster: no ready endpoint anywhere, so serving-terminating ones are
    // used. Local: a ready remote endpoint does not stop the fallback to a
    // local terminating one.
    let eps = vec![
        Endpoint::at(L).local().serving_terminating(),
        Endpoint::at(R).serving_terminating(),
    ];
    let s = EndpointSelection::new(&svc(false, true, 30080), &eps, &node());
    assert_eq!(addrs(s.internal_endpoints()), [L, R]);
    assert_eq!(addrs(s.external_endpoints()), [L]);
    assert_eq!(s.no_local(), (false, false));

    let eps = vec![
        Endpoint::at(L).local().serving_terminating(),
        Endpoint::at(R),
    ];
    let s = EndpointSelection::new(&svc(true, true, 30080), &eps, &node());
    assert_eq!(addrs(&s.cluster), [R], "ready wins over terminating");
    assert_eq!(addrs(s.internal_endpoints()), [L]);
    assert_eq!(addrs(s.external_endpoints()), [L]);
    assert_eq!(addrs(&s.all_reachable), [R, L]);
    assert_eq!(s.no_local(), (false, false));

    // Terminating and not serving: never a fallback.
    let eps = vec![Endpoint::at(L).local().terminated(), Endpoint::at(R)];
    let s = EndpointSelection::new(&svc(true, false, 0), &eps, &node());
    assert!(!s.has_internal());
    assert_eq!(s.no_local(), (true, false));
    assert_eq!(s.no_endpoints(), NoEndpoints::Drop);
}

#[test]
fn topology_filters_cluster_set_only() {
    let node = NodeInfo::named("node1").in_zone("zone-a");
    let eps = vec![
        Endpoint::at(L).local().with_zone_hints(&["zone-b"]),
        Endpoint::at(R).with_zone_hints(&["zone-a"]),
        Endpoint::at("10.0.0.3:80").with_zone_hints(&["zone-b"]),
    ];
    let s = EndpointSelection::new(&svc(false, true, 30080), &eps, &node);
    // Internal (Cluster) traffic stays in the zone; external (Local) uses
    // this node's endpoint whatever its hints say.
    assert_eq!(addrs(s.internal_endpoints()), [R]);
    assert_eq!(addrs(s.external_endpoints()), [L]);
    assert_eq!(addrs(&s.all_reachable), [R, L]);

    // Node hints (PreferSameNode) win over zone hints.
    let eps = vec![
        Endpoint::at(L)
            .local()
            .with_node_hints(&["node1"])
            .with_zone_hints(&["zone-a"]),
        Endpoint::at(R)
            .with_node_hints(&["node2"])
            .with_zone_hints(&["zone-a"]),
    ];
    let s = EndpointSelection::new(&svc(false, false, 0), &eps, &node);
    assert_eq!(addrs(s.internal_endpoints()), [L]);
}

/// Every combination of endpoint states, localness and zone hints, with
/// every policy: what the dataplanes rely on holds throughout.
#[test]
fn invariants_over_all_small_cases() {
    type State = fn(Endpoint) -> Endpoint;
    let states: [State; 4] = [
        |e| e,
        |e| e.serving_terminating(),
        |e| e.terminated(),
        |e| e.unready(),
    ];
    let hints: [&[&str]; 3] = [&[], &["zone-a"], &["zone-b"]];
    let node = NodeInfo::named("node1").in_zone("zone-a");
    let mut variants = Vec::new();
    for st in states {
        for local in [false, true] {
            for h in hints {
                variants.push((st, local, h));
            }
        }
    }
    let mut checked = 0;
    for a in &variants {
        for b in &variants {
            let eps: Vec<Endpoint> = [("10.0.0.1:80", a), ("10.0.0.2:80", b)]
                .iter()
                .map(|(addr, (st, local, h))| {
                    let e = st(Endpoint::at(addr).with_zone_hints(h));
                    if *local {
                        e.local()
                    } else {
                        e
                    }
                })
                .collect();
            let usable = eps.iter().any(|e| e.ready || (e.serving && e.terminating));
            for (itp, etp, np) in [
                (false, false, 30080),
                (false, true, 30080),
                (true, false, 30080),
                (true, true, 30080),
                (false, false, 0),
                (false, true, 0),
                (true, false, 0),
                (true, true, 0),
            ] {
                let sp = svc(itp, etp, np);
                let s = EndpointSelection::new(&sp, &eps, &node);
                let ctx = format!("{eps:?} itp {itp} etp {etp} np {np}");
                assert_eq!(s.has_any, usable, "{ctx}");
                // With Cluster policy, no endpoint here means none anywhere:
                // one drop-or-reject answer serves both kinds of traffic.
                if s.internal == EndpointSet::Cluster && !s.has_internal() {
                    assert_eq!(s.no_endpoints(), NoEndpoints::Reject, "{ctx}");
                }
                if s.externally_accessible
                    && s.external == EndpointSet::Cluster
                    && !s.has_external()
                {
                    assert_eq!(s.no_endpoints(), NoEndpoints::Reject, "{ctx}");
                }
                // Local endpoints are local and usable.
                assert!(s.local.iter().all(|e| e.is_local), "{ctx}");
                // Everything served is reachable, once.
                for e in s.cluster.iter().chain(s.local.iter()) {
                    assert!(s.all_reachable.contains(e), "{ctx}");
                }
                let mut seen = std::collections::HashSet::new();
                assert!(s.all_reachable.iter().all(|e| seen.insert(e.addr_string())));
                assert_eq!(
                    s.no_local(),
                    (
                        itp && s.local.is_empty(),
                        etp && np != 0 && s.local.is_empty()
                    ),
                    "{ctx}"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 24 * 24 * 8);
}

#[test]
fn cluster_ip_masquerading_follows_masquerade_all_and_the_detector() {
    let with = |all: bool, detector: LocalDetector| {
        let mut c = ProxierConfig::new(IpFamily::V4);
        c.masquerade_all = all;
        c.local_detector = detector;
        ClusterIpMasquerading::of(&c)
    };
    let v4 = || LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().unwrap()]);
    let v6_only = || LocalDetector::Cidrs(vec!["fd00:10::/64".parse().unwrap()]);
    use ClusterIpMasquerading::{All, Never, OffCluster};
    assert_eq!(with(true, LocalDetector::None), All);
    assert_eq!(with(true, v4()), All);
    assert_eq!(with(false, v4()), OffCluster);
    assert_eq!(
        with(false, LocalDetector::InterfaceNamePrefix("veth".into())),
        OffCluster
    );
    assert_eq!(
        with(false, LocalDetector::BridgeInterface("cbr0".into())),
        OffCluster
    );
    assert_eq!(with(false, LocalDetector::None), Never);
    // No CIDR of this family: no source is told apart, none masqueraded
    // (the renderers write no rule then).
    assert_eq!(with(false, v6_only()), Never);
}

#[test]
fn external_masquerading_follows_the_external_policy() {
    let sel = |etp_local: bool, eps: &[Endpoint]| {
        EndpointSelection::new(&svc(false, etp_local, 30080), eps, &node()).external_masquerading()
    };
    use ExternalMasquerading::{All, FromNode, Never};
    assert_eq!(sel(false, &both()), All);
    assert_eq!(sel(true, &both()), FromNode);
    // Local with only a remote endpoint: the node's own traffic is still
    // short-circuited (and masqueraded) to it.
    assert_eq!(sel(true, &[Endpoint::at(R)]), FromNode);
    assert_eq!(sel(true, &[]), Never);
    assert_eq!(sel(false, &[]), All);
}

#[test]
fn hairpin_is_the_reachable_local_endpoints() {
    let eps = vec![
        Endpoint::at(L).local(),
        Endpoint::at(R),
        Endpoint::at("10.0.0.3:80").local().unready(),
    ];
    let s = EndpointSelection::new(&svc(false, false, 0), &eps, &node());
    let hp: Vec<String> = s.hairpin().map(|e| e.addr_string()).collect();
    assert_eq!(hp, [L]);
}
