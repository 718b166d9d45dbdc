//! `--bpf-lb-algorithm maglev` in the sync, against maps in memory: the
//! entries for traffic from outside carry their table's size, its chunks
//! name filled slots, two nodes that reached the same endpoints by
//! different histories send every table slot to the same endpoint, one
//! endpoint leaving moves only a few slots, and removal takes the chunks.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use kp_ebpf::maglev;
use kp_ebpf::maps::MAGLEV_CHUNK;
use kp_ebpf::maps::{BackendKey, BackendVal, FLAG_MAGLEV};
use kp_ebpf::{MemContent, MemMaps, SocketLbProxier};
use kp_model::{Dataplane, Endpoint, IpFamily, NodeInfo, ProxyState, ServicePort};

fn lb_port() -> ServicePort {
    ServicePort::builder("ns", "lb")
        .cluster_ip("10.96.0.7")
        .load_balancer_ips(&["192.0.2.77"])
        .node_port(30007)
        .build()
}

fn state(eps: &[String]) -> ProxyState {
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::named("node1"));
    let sp = lb_port();
    let list: Vec<Endpoint> = eps
        .iter()
        .map(|e| Endpoint::ready(e.parse::<IpAddr>().unwrap(), 8080, false))
        .collect();
    st.endpoints.insert(sp.name.clone(), Arc::new(list));
    st.services.insert(sp.name.clone(), Arc::new(sp));
    st
}

fn eps(range: std::ops::Range<u32>) -> Vec<String> {
    range
        .map(|i| format!("10.244.{}.{}", i / 200, i % 200 + 2))
        .collect()
}

fn proxier(maps: &MemMaps) -> SocketLbProxier {
    SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()))
        .with_nodeport_ips(vec!["10.100.0.11".parse().unwrap()])
        .with_outside(true)
        .with_maglev(true)
}

/// For the LoadBalancer IP's entry: the endpoint of every table slot, as
/// the program would read it (slot -> kp_backends).
fn endpoints_by_slot(c: &MemContent) -> Vec<BackendVal> {
    let (_, v) = c
        .services
        .iter()
        .find(|(k, _)| k.is_outside() && k.ip() == "192.0.2.77".parse::<IpAddr>().unwrap())
        .expect("an entry for the LoadBalancer IP from outside");
    assert_ne!(v.flags & FLAG_MAGLEV, 0);
    assert_eq!(v.maglev_size, maglev::table_size(v.count as usize));
    (0..v.maglev_size)
        .map(|i| {
            let chunk = c
                .maglev
                .iter()
                .find(|(k, _)| k.svc_id == v.id && k.chunk == i / MAGLEV_CHUNK as u32)
                .map(|(_, val)| *val)
                .unwrap_or_else(|| panic!("no chunk for slot {i}"));
            let slot = chunk.slot[(i % MAGLEV_CHUNK as u32) as usize];
            assert!(slot < v.count, "slot {slot} beyond the count {}", v.count);
            *c.backends
                .get(&BackendKey { svc_id: v.id, slot })
                .expect("a filled slot")
        })
        .collect()
}

#[test]
fn two_nodes_with_different_histories_agree_and_one_leaving_moves_few() {
    let all = eps(0..10);
    // node A: the ten at once; node B: five, then seven others, then the
    // ten (its slots hold them in another order).
    let a = MemMaps::new(false);
    let mut pa = proxier(&a);
    pa.sync(&state(&all), &BTreeSet::new(), true).unwrap();
    let b = MemMaps::new(false);
    let mut pb = proxier(&b);
    let names: BTreeSet<_> = state(&all).services.keys().cloned().collect();
    pb.sync(&state(&eps(5..10)), &BTreeSet::new(), true)
        .unwrap();
    pb.sync(&state(&eps(3..12)), &names, false).unwrap();
    pb.sync(&state(&all), &names, false).unwrap();
    let (ta, tb) = (
        endpoints_by_slot(&a.content()),
        endpoints_by_slot(&b.content()),
    );
    assert_eq!(ta, tb, "two nodes send a table slot to different endpoints");
    // Each endpoint has its share of the table.
    let mut n = std::collections::BTreeMap::<BackendVal, usize>::new();
    for e in &ta {
        *n.entry(*e).or_default() += 1;
    }
    assert_eq!(n.len(), 10);
    assert!(
        n.values().max().unwrap() - n.values().min().unwrap() <= 1,
        "{n:?}"
    );
    // One leaves: its slots move, and few others.
    let nine: Vec<String> = all.iter().skip(1).cloned().collect();
    pa.sync(&state(&nine), &names, false).unwrap();
    let after = endpoints_by_slot(&a.content());
    let gone = BackendVal::new(all[0].parse().unwrap(), 8080);
    let moved = ta.iter().zip(&after).filter(|(x, y)| x != y).count();
    let own = ta.iter().filter(|e| **e == gone).count();
    assert!(after.iter().all(|e| *e != gone));
    // Maglev at 100 slots per endpoint: the measured share is about 1.25/N
    // at N = 10 (BENCHMARKS.md, "Maglev tables"); 2/N bounds it.
    assert!(
        moved >= own && moved * 10 <= ta.len() * 2,
        "{moved} of {} slots moved ({own} of them the leaver's)",
        ta.len()
    );
    // A full sync over the same maps (a restart) leaves them as they are.
    let before = a.content();
    let mut restarted = proxier(&a);
    restarted
        .sync(&state(&nine), &BTreeSet::new(), true)
        .unwrap();
    assert_eq!(endpoints_by_slot(&a.content()), endpoints_by_slot(&before));
    assert_eq!(a.content().maglev, before.maglev);
}

#[test]
fn removal_and_random_take_the_chunks_away() {
    let maps = MemMaps::new(false);
    let mut p = proxier(&maps);
    let st = state(&eps(0..100));
    p.sync(&st, &BTreeSet::new(), true).unwrap();
    let c = maps.content();
    let m = maglev::table_size(100);
    // Only the outside entries have tables: one per Service port scope.
    let chunks = maglev::chunk_count(m) as usize;
    assert_eq!(c.maglev.len(), chunks, "one table of {m} slots");
    endpoints_by_slot(&c);
    // Turned off (a restart with --bpf-lb-algorithm random): no chunk left.
    let mut random = SocketLbProxier::new(IpFamily::V4, Box::new(maps.clone()))
        .with_nodeport_ips(vec!["10.100.0.11".parse().unwrap()])
        .with_outside(true);
    random.sync(&st, &BTreeSet::new(), true).unwrap();
    let c = maps.content();
    assert!(c.maglev.is_empty(), "{} chunks left", c.maglev.len());
    assert!(c
        .services
        .values()
        .all(|v| v.flags & FLAG_MAGLEV == 0 && v.maglev_size == 0));
    // The Service gone: nothing of it.
    let mut p = proxier(&maps);
    p.sync(&st, &BTreeSet::new(), true).unwrap();
    assert!(!maps.content().maglev.is_empty());
    let empty = ProxyState::new(IpFamily::V4, NodeInfo::named("node1"));
    let names: BTreeSet<_> = st.services.keys().cloned().collect();
    p.sync(&empty, &names, false).unwrap();
    let c = maps.content();
    assert!(c.maglev.is_empty() && c.services.is_empty() && c.backends.is_empty());
}
