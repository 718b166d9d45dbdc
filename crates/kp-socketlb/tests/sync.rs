//! The sync logic against maps in memory: every intermediate state a client
//! could meet is usable, a partial sync ends where a full one does, and a
//! full sync over maps a previous run left takes them over.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use kp_model::{Dataplane, Endpoint, IpFamily, NodeInfo, ProxyState, ServicePort};
use kp_socketlb::{MemMaps, SocketLbProxier};

fn state(family: IpFamily, services: &[(&str, &str, &[&str], Option<u32>)]) -> ProxyState {
    let mut st = ProxyState::new(family, NodeInfo::named("node1"));
    for (name, vip, eps, aff) in services {
        let mut b = ServicePort::builder("ns", name).cluster_ip(vip);
        if let Some(t) = aff {
            b = b.affinity(*t);
        }
        let sp = b.build();
        let list: Vec<Endpoint> = eps
            .iter()
            .map(|e| Endpoint::ready(e.parse::<IpAddr>().unwrap(), 8080, false))
            .collect();
        st.endpoints.insert(sp.name.clone(), Arc::new(list));
        st.services.insert(sp.name.clone(), Arc::new(sp));
    }
    st
}

fn all(st: &ProxyState, other: &ProxyState) -> BTreeSet<kp_model::ServicePortName> {
    st.services
        .keys()
        .chain(other.services.keys())
        .cloned()
        .collect()
}

#[test]
fn every_step_of_a_change_leaves_each_address_usable_and_partial_equals_full() {
    let steps = [
        state(
            IpFamily::V4,
            &[(
                "a",
                "10.96.0.1",
                &["10.244.1.1", "10.244.1.2", "10.244.1.3"],
                None,
            )],
        ),
        // One endpoint replaced, one Service added with affinity.
        state(
            IpFamily::V4,
            &[
                (
                    "a",
                    "10.96.0.1",
                    &["10.244.1.1", "10.244.1.9", "10.244.1.3"],
                    None,
                ),
                ("b", "10.96.0.2", &["10.244.2.1"], Some(30)),
            ],
        ),
        // Shrink to one, ClusterIP of b changed, affinity changed.
        state(
            IpFamily::V4,
            &[
                ("a", "10.96.0.1", &["10.244.1.3"], None),
                ("b", "10.96.0.3", &["10.244.2.1", "10.244.2.2"], Some(60)),
            ],
        ),
        // a loses its endpoints, b goes.
        state(IpFamily::V4, &[("a", "10.96.0.1", &[], None)]),
        state(IpFamily::V4, &[("a", "10.96.0.1", &["10.244.1.1"], None)]),
    ];
    let maps = MemMaps::new(true);
    let mut px = SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()));
    let mut prev = ProxyState::new(IpFamily::V4, NodeInfo::named("node1"));
    for (i, st) in steps.iter().enumerate() {
        px.sync(st, &all(st, &prev), i == 0)
            .unwrap_or_else(|e| panic!("step {i}: {e}"));
        let fresh = MemMaps::new(false);
        let mut other = SocketLbProxier::new(IpFamily::V4, Box::new(fresh.clone()));
        other.sync(st, &BTreeSet::new(), true).unwrap();
        let (a, b) = (maps.content(), fresh.content());
        // Ids and slots may differ; what each address reaches may not.
        let reach = |c: &kp_socketlb::MemContent| {
            c.services
                .iter()
                .map(|(k, v)| {
                    let eps: BTreeSet<_> = (0..v.count)
                        .map(|s| {
                            c.backends[&kp_socketlb::maps::BackendKey {
                                svc_id: v.id,
                                slot: s,
                            }]
                        })
                        .collect();
                    (*k, eps, v.affinity_timeout_s)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(reach(&a), reach(&b), "step {i}");
        assert_eq!(a.backends.len(), b.backends.len(), "step {i}: stale slots");
        assert_eq!(a.members.len(), b.members.len(), "step {i}: stale members");
        assert_eq!(a.missing_deletes, 0, "step {i}: deleted what was not there");
        prev = st.clone();
    }
}

#[test]
fn a_full_sync_takes_over_what_a_previous_run_left_and_removes_the_rest() {
    let maps = MemMaps::new(true);
    let before = state(
        IpFamily::V4,
        &[
            ("a", "10.96.0.1", &["10.244.1.1", "10.244.1.2"], None),
            ("gone", "10.96.0.9", &["10.244.9.9"], None),
        ],
    );
    SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()))
        .sync(&before, &BTreeSet::new(), true)
        .unwrap();
    let v6 = state(IpFamily::V6, &[("a", "fd00:96::1", &["fd00:244::1"], None)]);
    SocketLbProxier::new(IpFamily::V6, Box::new(maps.clone()))
        .sync(&v6, &BTreeSet::new(), true)
        .unwrap();
    let ids_before: Vec<u32> = maps.content().services.values().map(|v| v.id).collect();

    // A new process: same Service a, "gone" deleted meanwhile.
    let after = state(
        IpFamily::V4,
        &[("a", "10.96.0.1", &["10.244.1.1", "10.244.1.2"], None)],
    );
    let mut px = SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()));
    let report = px.sync(&after, &BTreeSet::new(), true).unwrap();
    let c = maps.content();
    // a kept its id and slots (nothing written for it); gone removed
    // (1 address + 1 slot + 1 member); the IPv6 entries untouched.
    assert_eq!(report.ops, 3);
    assert_eq!(c.services.len(), 2);
    assert!(c.services.values().all(|v| ids_before.contains(&v.id)));
    assert_eq!(c.backends.len(), 3);
}

#[test]
fn external_addresses_get_the_cluster_endpoints_and_source_ranges_stay_with_nftables() {
    use kp_socketlb::{wanted, Scope};
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::named("node1"));
    let sp = ServicePort::builder("ns", "lb")
        .cluster_ip("10.96.0.5")
        .node_port(30005)
        .external_ips(&["203.0.113.1"])
        .load_balancer_ips(&["203.0.113.2"])
        .local_internal()
        .build();
    let eps = vec![
        Endpoint::at("10.244.1.1:8080").local(),
        Endpoint::at("10.244.2.1:8080"),
    ];
    st.endpoints.insert(sp.name.clone(), Arc::new(eps));
    let node: IpAddr = "10.100.0.11".parse().unwrap();
    let got = wanted(&sp, &st, &[node]);
    // iTP=Local: the ClusterIP gets the local endpoint only; the external
    // addresses (and the NodePort on this node) get both.
    assert_eq!(got.len(), 2, "{got:?}");
    let (s0, w0) = &got[0];
    let (s1, w1) = &got[1];
    assert_eq!(
        (*s0, w0.keys.len(), w0.backends.len()),
        (Scope::Internal, 1, 1)
    );
    assert_eq!(
        (*s1, w1.keys.len(), w1.backends.len()),
        (Scope::External, 3, 2)
    );
    let ports: BTreeSet<u16> = w1.keys.iter().map(|k| k.port()).collect();
    assert_eq!(ports, [80, 30005].into());

    // The same endpoints for both: one entry. Source ranges: the LB IP is
    // left out.
    let mut sp2 = sp.clone();
    sp2.internal_policy_local = false;
    sp2.load_balancer_source_ranges = vec!["10.0.0.0/8".parse().unwrap()];
    let got = wanted(&sp2, &st, &[node]);
    assert_eq!(got.len(), 1, "{got:?}");
    let ips: BTreeSet<String> = got[0].1.keys.iter().map(|k| k.ip().to_string()).collect();
    assert_eq!(
        ips,
        ["10.96.0.5", "203.0.113.1", "10.100.0.11"]
            .map(String::from)
            .into()
    );
}

#[test]
fn a_full_sync_repairs_what_an_interrupted_one_left() {
    use kp_socketlb::maps::{BackendKey, BackendVal, MemberKey};
    use kp_socketlb::Maps;
    let st = state(
        IpFamily::V4,
        &[(
            "a",
            "10.96.0.1",
            &["10.244.1.1", "10.244.1.2", "10.244.1.3"],
            None,
        )],
    );
    let mut maps = MemMaps::new(false);
    SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()))
        .sync(&st, &BTreeSet::new(), true)
        .unwrap();
    let id = maps.content().services.values().next().unwrap().id;
    // The kind of state a crash between two writes leaves: a slot below
    // the count without its endpoint, a slot beyond the count, and a member
    // that no slot holds.
    maps.del_backend(&BackendKey {
        svc_id: id,
        slot: 1,
    })
    .unwrap();
    let stray = BackendVal::new("10.244.9.9".parse().unwrap(), 8080);
    maps.set_backend(
        &BackendKey {
            svc_id: id,
            slot: 7,
        },
        &stray,
    )
    .unwrap();
    let ghost = BackendVal::new("10.244.8.8".parse().unwrap(), 8080);
    maps.set_member(
        &MemberKey {
            svc_id: id,
            backend: ghost,
        },
        9,
    )
    .unwrap();

    let mut px = SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()));
    px.sync(&st, &BTreeSet::new(), true).expect("the repair");
    let c = maps.content();
    c.consistent().expect("consistent after the repair");
    assert_eq!(c.backends.len(), 3, "{:?}", c.backends);
    assert_eq!(c.members.len(), 3, "{:?}", c.members);
    assert!(!c
        .members
        .keys()
        .any(|m| m.backend == ghost || m.backend == stray));
}
