//! The sync logic against maps in memory: every intermediate state a client
//! could meet is usable, a partial sync ends where a full one does, and a
//! full sync over maps a previous run left takes them over.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use kp_ebpf::{MemMaps, SocketLbProxier};
use kp_model::{Dataplane, Endpoint, IpFamily, NodeInfo, ProxyState, ServicePort};

fn state(family: IpFamily, services: &[(&str, &str, &[&str], Option<u32>)]) -> ProxyState {
    let mut st = ProxyState::new(family, NodeInfo::named("node1"));
    for (name, vip, eps, aff) in services {
        let mut b = ServicePort::builder("ns", name).cluster_ip(vip);
        if let Some(t) = aff {
            b = b.affinity(*t);
        }
        add(&mut st, b.build(), eps);
    }
    st
}

/// `sp` with `eps` (ready, port 8080) into `st`.
fn add(st: &mut ProxyState, sp: ServicePort, eps: &[&str]) {
    let list: Vec<Endpoint> = eps
        .iter()
        .map(|e| Endpoint::ready(e.parse::<IpAddr>().unwrap(), 8080, false))
        .collect();
    st.endpoints.insert(sp.name.clone(), Arc::new(list));
    st.services.insert(sp.name.clone(), Arc::new(sp));
}

/// UDP Service port `name` (the programs read its members).
fn udp_port(name: &str, vip: &str) -> ServicePort {
    ServicePort::builder("ns", name)
        .protocol(kp_model::Protocol::Udp)
        .cluster_ip(vip)
        .build()
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
        // One endpoint replaced, one Service added with affinity (left to
        // nftables: no entry).
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
    // (1 address + 1 slot; TCP has no members); the IPv6
    // entries untouched.
    assert_eq!(report.ops, 2);
    assert_eq!(c.services.len(), 2);
    assert!(c.services.values().all(|v| ids_before.contains(&v.id)));
    assert_eq!(c.backends.len(), 3);
}

#[test]
fn external_addresses_get_the_cluster_endpoints_and_source_ranges_stay_with_nftables() {
    use kp_ebpf::{wanted, Scope};
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
    use kp_ebpf::maps::{BackendKey, BackendVal, MemberKey};
    use kp_ebpf::Maps;
    // UDP: its members matter.
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::named("node1"));
    add(
        &mut st,
        udp_port("a", "10.96.0.1"),
        &["10.244.1.1", "10.244.1.2", "10.244.1.3"],
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

/// `n` Services `svc-i` with `m` endpoints each (generation `g` changes every
/// endpoint's last octet), every 5th UDP.
fn many(n: u32, m: u32, g: u32) -> ProxyState {
    use kp_model::Protocol;
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::named("node1"));
    for i in 0..n {
        let proto = if i % 5 == 0 {
            Protocol::Udp
        } else {
            Protocol::Tcp
        };
        let b = ServicePort::builder("ns", &format!("svc-{i}"))
            .protocol(proto)
            .cluster_ip(&format!("10.96.{}.{}", i / 250, i % 250 + 1));
        let sp = b.build();
        let list: Vec<Endpoint> = (0..m)
            .map(|j| {
                let ip: IpAddr = format!(
                    "10.{}.{}.{}",
                    128 + i / 60_000,
                    (i / 250) % 240,
                    (j + g) % 250 + 1
                )
                .parse()
                .unwrap();
                Endpoint::ready(ip, 8080 + (i % 250) as u16, false)
            })
            .collect();
        st.endpoints.insert(sp.name.clone(), Arc::new(list));
        st.services.insert(sp.name.clone(), Arc::new(sp));
    }
    st
}

/// What each address reaches (ids and slots may differ between runs).
fn reach(
    c: &kp_ebpf::MemContent,
) -> Vec<(kp_ebpf::maps::SvcKey, BTreeSet<kp_ebpf::maps::BackendVal>)> {
    c.services
        .iter()
        .map(|(k, v)| {
            let eps: BTreeSet<_> = (0..v.count)
                .map(|s| {
                    c.backends[&kp_ebpf::maps::BackendKey {
                        svc_id: v.id,
                        slot: s,
                    }]
                })
                .collect();
            (*k, eps)
        })
        .collect()
}

fn fresh(st: &ProxyState) -> kp_ebpf::MemContent {
    let maps = MemMaps::new(false);
    SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()))
        .sync(st, &BTreeSet::new(), true)
        .unwrap();
    maps.content()
}

const PHASES: [&str; 6] = [
    "set_members",
    "set_backends",
    "set_services",
    "del_services",
    "del_backends",
    "del_members",
];

/// The calls are batches, at most one per phase, in the phases' order.
fn assert_phased(calls: &[(&'static str, usize)]) {
    let mut at = 0;
    for (op, n) in calls {
        let Some(p) = PHASES.iter().position(|x| x == op) else {
            panic!("{op} ({n} entries) is not a batch: {calls:?}");
        };
        assert!(p >= at, "{op} after a later phase: {calls:?}");
        assert!(*n > 0, "an empty batch: {calls:?}");
        at = p + 1;
    }
}

#[test]
fn a_sync_writes_each_phase_as_one_batch_in_order() {
    let maps = MemMaps::new(true);
    let mut px = SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()));
    let st = many(300, 4, 0);
    px.sync(&st, &BTreeSet::new(), true).unwrap();
    let calls = maps.calls();
    assert_phased(&calls);
    // 300 addresses, 1200 slots, members for the UDP ones.
    let readers = (0..300).filter(|i| i % 5 == 0).count();
    assert_eq!(
        calls,
        vec![
            ("set_members", readers * 4),
            ("set_backends", 1200),
            ("set_services", 300)
        ]
    );
    // Many changes in one partial sync: every endpoint replaced in half of
    // the Services, a tenth of them deleted.
    let mut next = many(300, 4, 0);
    let changed: BTreeSet<_> = next.services.keys().take(150).cloned().collect();
    let replaced = many(300, 4, 1);
    for n in &changed {
        next.endpoints
            .insert(n.clone(), replaced.endpoints[n].clone());
    }
    let gone: Vec<_> = next
        .services
        .keys()
        .skip(150)
        .step_by(10)
        .cloned()
        .collect();
    for n in &gone {
        next.services.remove(n);
    }
    // And 20 new ones.
    let more = many(320, 4, 0);
    let added: Vec<_> = more
        .services
        .keys()
        .filter(|n| !st.services.contains_key(*n))
        .cloned()
        .collect();
    for n in &added {
        next.services.insert(n.clone(), more.services[n].clone());
        next.endpoints.insert(n.clone(), more.endpoints[n].clone());
    }
    let before = maps.calls().len();
    let all: BTreeSet<_> = changed.iter().chain(&gone).chain(&added).cloned().collect();
    px.sync(&next, &all, false).unwrap();
    let calls = maps.calls()[before..].to_vec();
    assert_phased(&calls);
    assert_eq!(calls.len(), 6, "{calls:?}");
    assert_eq!(reach(&maps.content()), reach(&fresh(&next)));
    // One endpoint replaced in a TCP Service: one slot.
    let mut one = next.clone();
    let name = one.services.keys().nth(1).cloned().unwrap();
    let mut eps = (*one.endpoints[&name]).clone();
    eps[0] = Endpoint::ready("10.200.0.1".parse().unwrap(), 8080, false);
    one.endpoints.insert(name.clone(), Arc::new(eps));
    let before = maps.calls().len();
    let r = px.sync(&one, &[name].into(), false).unwrap();
    assert_eq!(r.ops, 1);
    assert_eq!(maps.calls()[before..].to_vec(), vec![("set_backends", 1)]);
}

#[test]
fn members_are_written_where_the_programs_read_them_and_before_they_do() {
    let maps = MemMaps::new(true);
    let mut px = SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()));
    let eps = ["10.244.1.1", "10.244.1.2"];
    let plain = state(IpFamily::V4, &[("a", "10.96.0.1", &eps, None)]);
    px.sync(&plain, &BTreeSet::new(), true).unwrap();
    assert!(maps.content().members.is_empty(), "TCP");
    // A UDP port: every endpoint becomes a member before its address is
    // written (MemMaps checks after each write).
    let mut both = plain.clone();
    add(&mut both, udp_port("u", "10.96.0.2"), &eps);
    let names: BTreeSet<_> = both.services.keys().cloned().collect();
    px.sync(&both, &names, false).unwrap();
    assert_eq!(maps.content().members.len(), 2);
    // One replaced: the newcomer is a member, the one that left is not.
    let mut moved = plain.clone();
    add(
        &mut moved,
        udp_port("u", "10.96.0.2"),
        &["10.244.1.1", "10.244.1.9"],
    );
    px.sync(&moved, &names, false).unwrap();
    let c = maps.content();
    let members: BTreeSet<String> = c
        .members
        .keys()
        .map(|m| m.backend.ip(true).to_string())
        .collect();
    assert_eq!(
        members,
        ["10.244.1.1", "10.244.1.9"].map(String::from).into()
    );
    // The UDP port goes: its members go, after its address.
    px.sync(&plain, &names, false).unwrap();
    let c = maps.content();
    assert!(c.members.is_empty(), "{:?}", c.members);
    assert_eq!(c.missing_deletes, 0);
    assert_eq!(reach(&c), reach(&fresh(&plain)));
    // Session affinity: the port leaves the maps (nftables keeps the
    // records), and comes back without it.
    let sticky = state(IpFamily::V4, &[("a", "10.96.0.1", &eps, Some(30))]);
    px.sync(&sticky, &names, false).unwrap();
    let c = maps.content();
    assert!(c.services.is_empty() && c.backends.is_empty(), "{c:?}");
    px.sync(&plain, &names, false).unwrap();
    assert_eq!(reach(&maps.content()), reach(&fresh(&plain)));
    // A full sync of a new process over maps with members everywhere (an
    // older version wrote them for every Service port) removes the unread
    // ones and keeps the rest.
    use kp_ebpf::maps::{BackendVal, MemberKey};
    use kp_ebpf::Maps;
    let mut old = MemMaps::new(true);
    SocketLbProxier::new(IpFamily::V4, Box::new(old.clone()))
        .sync(&plain, &BTreeSet::new(), true)
        .unwrap();
    let id = old.content().services.values().next().unwrap().id;
    for (slot, e) in eps.iter().enumerate() {
        let key = MemberKey {
            svc_id: id,
            backend: BackendVal::new(e.parse().unwrap(), 8080),
        };
        old.set_member(&key, slot as u32).unwrap();
    }
    let r = SocketLbProxier::new(IpFamily::V4, Box::new(old.clone()))
        .sync(&plain, &BTreeSet::new(), true)
        .unwrap();
    assert_eq!(r.ops, 2, "two members removed, nothing else");
    assert!(old.content().members.is_empty());
}

#[test]
fn an_address_that_moves_to_another_service_port_is_not_lost() {
    // "b" goes and "a" takes its ClusterIP in the same sync: "a" is planned
    // first, "b"'s removal after; the address must end up "a"'s.
    let maps = MemMaps::new(true);
    let mut px = SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()));
    let before = state(IpFamily::V4, &[("b", "10.96.0.7", &["10.244.2.1"], None)]);
    px.sync(&before, &BTreeSet::new(), true).unwrap();
    let after = state(IpFamily::V4, &[("a", "10.96.0.7", &["10.244.1.1"], None)]);
    px.sync(&after, &all(&after, &before), false).unwrap();
    let c = maps.content();
    assert_eq!(reach(&c), reach(&fresh(&after)));
    assert_eq!(c.backends.len(), 1, "b's slot is gone");
    // The same within one Service: internalTrafficPolicy Local with
    // different endpoints for the ClusterIP and the external address, then
    // Cluster: the external address joins the ClusterIP's entry.
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::named("node1"));
    let sp = ServicePort::builder("ns", "lb")
        .cluster_ip("10.96.0.5")
        .external_ips(&["203.0.113.1"])
        .local_internal()
        .build();
    let eps = vec![
        Endpoint::at("10.244.1.1:8080").local(),
        Endpoint::at("10.244.2.1:8080"),
    ];
    st.endpoints.insert(sp.name.clone(), Arc::new(eps));
    st.services.insert(sp.name.clone(), Arc::new(sp.clone()));
    let maps = MemMaps::new(true);
    let mut px = SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()));
    px.sync(&st, &BTreeSet::new(), true).unwrap();
    assert_eq!(maps.content().services.len(), 2);
    let mut cluster = sp;
    cluster.internal_policy_local = false;
    st.services
        .insert(cluster.name.clone(), Arc::new(cluster.clone()));
    px.sync(&st, &[cluster.name.clone()].into(), false).unwrap();
    let c = maps.content();
    assert_eq!(c.services.len(), 2, "an address was lost: {:?}", c.services);
    assert_eq!(reach(&c), reach(&fresh(&st)));
}

#[test]
fn a_refused_write_fails_cleanly_and_the_next_full_sync_repairs_it() {
    let first = many(60, 3, 0);
    let mut next = many(60, 3, 1);
    // Some Services go, some come.
    let gone: Vec<_> = next.services.keys().step_by(6).cloned().collect();
    for n in &gone {
        next.services.remove(n);
    }
    let extra = many(70, 3, 2);
    for (n, sp) in extra.services.iter().skip(60) {
        next.services.insert(n.clone(), sp.clone());
        next.endpoints.insert(n.clone(), extra.endpoints[n].clone());
    }
    let changed = all(&first, &next);
    let total = {
        let maps = MemMaps::new(false);
        let mut px = SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()));
        px.sync(&first, &BTreeSet::new(), true).unwrap();
        px.sync(&next, &changed, false).unwrap().ops
    };
    // Refused at every point of the partial sync in turn (each write checked
    // as a client would meet it).
    for at in (0..total).step_by(7) {
        let maps = MemMaps::new(true);
        let mut px = SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()));
        px.sync(&first, &BTreeSet::new(), true).unwrap();
        maps.refuse_after(at);
        let e = px
            .sync(&next, &changed, false)
            .expect_err("the refused write fails the sync")
            .to_string();
        assert!(e.contains("refused by the test"), "{e}");
        assert!(
            e.contains("svc-") || e.contains("10.96."),
            "names what: {e}"
        );
        maps.content().consistent().unwrap();
        maps.accept_all();
        // The next sync is a full one even if asked for a partial one.
        let r = px.sync(&next, &BTreeSet::new(), false).unwrap();
        assert!(r.full, "after a failure at {at}");
        let c = maps.content();
        assert_eq!(reach(&c), reach(&fresh(&next)), "refused at {at}");
        let f = fresh(&next);
        assert_eq!(
            c.backends.len(),
            f.backends.len(),
            "refused at {at}: stale slots"
        );
        assert_eq!(
            c.members.len(),
            f.members.len(),
            "refused at {at}: stale members"
        );
    }
}
