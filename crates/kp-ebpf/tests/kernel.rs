//! The programs in the real kernel: a cgroup and a bpf filesystem of the
//! test's own, a lab of network namespaces, no nftables at all, so whatever
//! reaches an endpoint was translated by the socket hooks.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use kp_ebpf::{install, remove, Capacity, Installed, KernelMaps, Placement, SocketLbProxier};
use kp_model::{
    Dataplane, Endpoint, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort, ServicePortName,
};
use kp_netlab::{in_netns, Cluster, ClusterOpts, ServeSpec, TestBpffs, TestCgroup};

const TIMEOUT: Duration = Duration::from_secs(2);

struct Lab {
    cluster: Cluster,
    cg: TestCgroup,
    fs: TestBpffs,
    _servers: Vec<kp_netlab::ServerGuard>,
    pods: Vec<kp_netlab::Pod>,
}

fn lab(name: &str) -> Lab {
    let cluster = Cluster::new(name, ClusterOpts::with_nodes(1)).expect("lab");
    let mut cg = TestCgroup::new().expect("test cgroup");
    cg.adopt_namespaces(cluster.prefix());
    let fs = TestBpffs::new().expect("bpffs");
    let mut servers = Vec::new();
    let mut pods = Vec::new();
    for p in ["a", "b"] {
        let pod = cluster.add_pod(1, p).expect("pod");
        servers.push(
            cluster
                .serve(pod.ns(), p, ServeSpec::both(&[8080]))
                .expect("server"),
        );
        pods.push(pod);
    }
    Lab {
        cluster,
        cg,
        fs,
        _servers: servers,
        pods,
    }
}

impl Lab {
    fn placement(&self) -> Placement {
        Placement {
            cgroup: self.cg.path().to_path_buf(),
            pin_dir: self.fs.path().join("kube-proxy-rs"),
        }
    }
    fn proxier(&self, family: IpFamily) -> SocketLbProxier {
        let maps = KernelMaps::open(&self.placement().pin_dir).expect("maps");
        SocketLbProxier::new(family, Box::new(maps))
    }
}

fn name(proto: Protocol) -> ServicePortName {
    ServicePortName::new("default", "web", "", proto)
}

fn state(family: IpFamily, vip: &str, eps: &[IpAddr], affinity: Option<u32>) -> ProxyState {
    let mut st = ProxyState::new(family, NodeInfo::named("node1"));
    for proto in [Protocol::Tcp, Protocol::Udp] {
        let mut b = ServicePort::builder("default", "web")
            .protocol(proto)
            .cluster_ip(vip)
            .port(80);
        if let Some(t) = affinity {
            b = b.affinity(t);
        }
        let sp = b.build();
        st.services.insert(sp.name.clone(), Arc::new(sp));
        let list: Vec<Endpoint> = eps
            .iter()
            .map(|ip| Endpoint::ready(*ip, 8080, true))
            .collect();
        st.endpoints.insert(name(proto), Arc::new(list));
    }
    st
}

/// Connects from namespace `ns` (in the test cgroup when the lab adopted
/// it); returns the server's name and what getpeername says.
fn tcp(ns: &str, to: SocketAddr) -> Result<(String, SocketAddr), String> {
    let s = in_netns(ns, || TcpStream::connect_timeout(&to, TIMEOUT))
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    let peer = s.peer_addr().map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(&s)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    let server = line.split_whitespace().next().unwrap_or("").to_string();
    Ok((server, peer))
}

/// One datagram to `to` on an unconnected socket: the server's name and the
/// source address the reply came from.
fn udp(ns: &str, to: SocketAddr) -> Result<(String, SocketAddr), String> {
    let any: SocketAddr = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }
        .parse()
        .unwrap();
    let s = in_netns(ns, || UdpSocket::bind(any))
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    s.send_to(b"hi", to).map_err(|e| e.to_string())?;
    let mut buf = [0u8; 256];
    let (n, from) = s.recv_from(&mut buf).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf[..n]).to_string();
    Ok((
        text.split_whitespace().next().unwrap_or("").to_string(),
        from,
    ))
}

fn addrs(lab: &Lab, family: IpFamily) -> Vec<IpAddr> {
    lab.pods
        .iter()
        .map(|p| {
            if family == IpFamily::V4 {
                p.ip()
            } else {
                p.ip6()
            }
        })
        .collect()
}

fn check_family(family: IpFamily, vip: &str) {
    let lab = lab(&format!("socketlb-{family}"));
    assert_eq!(
        install(&lab.placement(), Capacity::default()).expect("install"),
        Installed::Fresh
    );
    let mut px = lab.proxier(family);
    let st = state(family, vip, &addrs(&lab, family), None);
    let report = px.sync(&st, &BTreeSet::new(), true).expect("sync");
    assert!(report.ops > 0);
    let svc = SocketAddr::new(vip.parse().unwrap(), 80);
    let node = lab.cluster.node_ns(1).to_string();
    let mut seen = BTreeMap::new();
    for _ in 0..40 {
        let (server, peer) = tcp(&node, svc).expect("TCP through the Service");
        // getpeername names the Service, not the endpoint.
        assert_eq!(peer, svc);
        *seen.entry(server).or_insert(0) += 1;
    }
    assert_eq!(
        seen.keys().cloned().collect::<Vec<_>>(),
        vec!["a", "b"],
        "{seen:?}"
    );
    let (server, from) = udp(&node, svc).expect("UDP through the Service");
    assert!(server == "a" || server == "b");
    // The reply's source is the Service address (recvmsg restored it).
    assert_eq!(from, svc);

    // A thread outside the cgroup is not translated: with no nftables here
    // nothing answers the Service address.
    let other = TestCgroup::new().expect("second cgroup");
    let untranslated = other
        .run_in_netns(&node, || {
            TcpStream::connect_timeout(&svc, Duration::from_millis(500))
        })
        .expect("thread in the other cgroup");
    assert!(
        untranslated.is_err(),
        "a socket outside the cgroup reached {svc}"
    );

    // Endpoints removed: the address is left alone (nftables' to reject).
    let empty = state(family, vip, &[], None);
    px.sync(
        &empty,
        &[name(Protocol::Tcp), name(Protocol::Udp)].into(),
        false,
    )
    .expect("sync without endpoints");
    assert!(tcp(&node, svc).is_err(), "no endpoints, still translated");
}

#[test]
fn ipv4_connect_and_udp_go_straight_to_an_endpoint() {
    check_family(IpFamily::V4, "10.96.0.10");
}

#[test]
fn ipv6_connect_and_udp_go_straight_to_an_endpoint() {
    check_family(IpFamily::V6, "fd00:96::10");
}

/// ClientIP session affinity is nftables' alone (one record per client, as
/// upstream keeps it): such a Service's addresses leave the maps, so its
/// clients go on to the rules (none in this lab: the connect fails), and
/// come back when the Service drops affinity.
#[test]
fn a_service_with_session_affinity_is_left_to_nftables() {
    let lab = lab("socketlb-aff");
    install(&lab.placement(), Capacity::default()).expect("install");
    let mut px = lab.proxier(IpFamily::V4);
    let eps = addrs(&lab, IpFamily::V4);
    let svc: SocketAddr = "10.96.0.11:80".parse().unwrap();
    let node = lab.cluster.node_ns(1).to_string();
    let both =
        || -> BTreeSet<ServicePortName> { [name(Protocol::Tcp), name(Protocol::Udp)].into() };
    let in_maps = || {
        let maps = KernelMaps::open(&lab.placement().pin_dir).expect("maps");
        let dump = kp_ebpf::Maps::dump(&maps).expect("dump");
        dump.services.len()
    };
    px.sync(
        &state(IpFamily::V4, "10.96.0.11", &eps, None),
        &BTreeSet::new(),
        true,
    )
    .expect("sync");
    assert_eq!(in_maps(), 2, "TCP and UDP without affinity");
    tcp(&node, svc).expect("balanced by the programs");
    px.sync(
        &state(IpFamily::V4, "10.96.0.11", &eps, Some(600)),
        &both(),
        false,
    )
    .expect("sync");
    assert_eq!(in_maps(), 0, "with affinity");
    assert!(tcp(&node, svc).is_err(), "still translated with affinity");
    // A full sync (a restart) agrees.
    px.sync(
        &state(IpFamily::V4, "10.96.0.11", &eps, Some(600)),
        &BTreeSet::new(),
        true,
    )
    .expect("sync");
    assert_eq!(in_maps(), 0, "with affinity, after a full sync");
    px.sync(
        &state(IpFamily::V4, "10.96.0.11", &eps, None),
        &both(),
        false,
    )
    .expect("sync");
    assert_eq!(in_maps(), 2, "affinity dropped");
    tcp(&node, svc).expect("balanced again");
}

#[test]
fn a_restarted_proxy_adopts_the_programs_and_maps_and_cleanup_removes_them() {
    let lab = lab("socketlb-adopt");
    install(&lab.placement(), Capacity::default()).expect("install");
    let eps = addrs(&lab, IpFamily::V4);
    let st = state(IpFamily::V4, "10.96.0.12", &eps, None);
    let mut px = lab.proxier(IpFamily::V4);
    px.sync(&st, &BTreeSet::new(), true).expect("sync");
    drop(px);
    let svc: SocketAddr = "10.96.0.12:80".parse().unwrap();
    let node = lab.cluster.node_ns(1).to_string();
    // The proxy is gone; the pinned links and maps keep translating.
    tcp(&node, svc).expect("translated with no proxy running");
    // An earlier version's session affinity map, which this one retired.
    let retired = lab.placement().pin_dir.join("kp_affinity");
    let made = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(&retired)
        .args([
            "type", "lru_hash", "key", "16", "value", "32", "entries", "16",
        ])
        .args(["name", "kp_affinity"])
        .status()
        .expect("running bpftool");
    assert!(
        made.success() && retired.exists(),
        "pinning {}",
        retired.display()
    );
    assert_eq!(
        install(&lab.placement(), Capacity::default()).expect("again"),
        Installed::Adopted { upgraded: 0 }
    );
    assert!(!retired.exists(), "the retired map's pin is still there");
    let mut px = lab.proxier(IpFamily::V4);
    let report = px
        .sync(&st, &BTreeSet::new(), true)
        .expect("full sync after restart");
    assert_eq!(report.ops, 0, "the adopted maps were rewritten");
    tcp(&node, svc).expect("still translated");
    drop(px);
    // Deleting what is not there is done, not an error (a repair meets it).
    {
        use kp_ebpf::maps::{BackendKey, BackendVal, MemberKey};
        use kp_ebpf::Maps;
        let mut maps = KernelMaps::open(&lab.placement().pin_dir).expect("maps");
        let nowhere = BackendKey {
            svc_id: 999_998,
            slot: 3,
        };
        maps.del_backend(&nowhere)
            .expect("delete of a missing slot");
        let m = MemberKey {
            svc_id: 999_998,
            backend: BackendVal::default(),
        };
        maps.del_member(&m).expect("delete of a missing member");
    }
    assert!(remove(&lab.placement().pin_dir).expect("cleanup"));
    // The kernel frees an unpinned link (and detaches its program) from a
    // work queue: give it a moment when the machine is busy.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while tcp(&node, svc).is_ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "translated 5 s after cleanup"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!lab.placement().pin_dir.exists());
    assert!(!remove(&lab.placement().pin_dir).expect("cleanup again"));
}

#[test]
fn a_new_version_replaces_the_adopted_programs_in_place() {
    let lab = lab("socketlb-upgrade");
    // The "previous version" translates nothing.
    let old = kp_ebpf::install_object(
        &lab.placement(),
        Capacity::default(),
        kp_ebpf::TEST_VARIANT_OBJECT,
    )
    .expect("install the old version");
    assert_eq!(old, Installed::Fresh);
    let eps = addrs(&lab, IpFamily::V4);
    let mut px = lab.proxier(IpFamily::V4);
    px.sync(
        &state(IpFamily::V4, "10.96.0.13", &eps, None),
        &BTreeSet::new(),
        true,
    )
    .expect("sync");
    let svc: SocketAddr = "10.96.0.13:80".parse().unwrap();
    let node = lab.cluster.node_ns(1).to_string();
    assert!(tcp(&node, svc).is_err(), "the old version translated");
    let link_ids = || -> Vec<u32> {
        kp_ebpf::PROGRAMS
            .iter()
            .map(|n| {
                let l: aya::programs::links::FdLink = aya::programs::links::PinnedLink::from_pin(
                    lab.placement().pin_dir.join("links").join(n),
                )
                .unwrap()
                .into();
                l.info().unwrap().id()
            })
            .collect()
    };
    let before = link_ids();
    // This version: the four translating programs (connect and sendmsg,
    // both families) differ, recvmsg and getpeername do not; each differing
    // link is updated in place (same links, same maps: the entries written
    // above still apply).
    let how = install(&lab.placement(), Capacity::default()).expect("upgrade");
    assert_eq!(how, Installed::Adopted { upgraded: 4 });
    assert_eq!(link_ids(), before, "links were re-created, not updated");
    tcp(&node, svc).expect("the new version translates with the adopted maps");
    // Installing the same version again changes nothing.
    assert_eq!(
        install(&lab.placement(), Capacity::default()).expect("again"),
        Installed::Adopted { upgraded: 0 }
    );
}

/// `remove` on a read-only filesystem without our pins (a container's /sys
/// with no bpffs, where every other mode sweeps socket-lb's leftovers at
/// start): nothing there, nothing removed, no error. unlink and rmdir answer
/// EROFS there even for a missing name. (Root: a read-only tmpfs of the
/// test's own, unmounted after.)
#[test]
fn removing_from_a_read_only_place_without_pins_is_no_error() {
    let dir = std::env::temp_dir().join(format!("kp-slb-ro-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "ro,size=64k", "kp-slb-ro"])
        .arg(&dir)
        .status()
        .is_ok_and(|s| s.success());
    let _guard = Unmount(dir.clone());
    assert!(ok, "mounting a read-only tmpfs on {}", dir.display());
    let pins = dir.join("kube-proxy-rs");
    // The filesystem really is read-only.
    assert!(std::fs::create_dir(&pins).is_err());
    assert!(!kp_ebpf::remove(&pins).unwrap());
}

/// `n` Services `svc-i` of `m` endpoints (generation `g` moves every
/// endpoint), every 5th UDP. No lab: these tests
/// look at the maps, nothing connects.
fn cluster(n: u32, m: u32, g: u32) -> ProxyState {
    let mut st = ProxyState::new(IpFamily::V4, NodeInfo::named("node1"));
    for i in 0..n {
        let proto = if i % 5 == 0 {
            Protocol::Udp
        } else {
            Protocol::Tcp
        };
        let b = ServicePort::builder("bench", &format!("svc-{i}"))
            .protocol(proto)
            .cluster_ip(&format!("10.96.{}.{}", i / 250, i % 250 + 1))
            .port(80);
        let sp = b.build();
        let eps: Vec<Endpoint> = (0..m)
            .map(|j| {
                let ip: IpAddr = format!("10.{}.{}.{}", 128 + i / 250, (j + g) % 250, i % 250 + 1)
                    .parse()
                    .unwrap();
                Endpoint::ready(ip, 8080, false)
            })
            .collect();
        st.endpoints.insert(sp.name.clone(), Arc::new(eps));
        st.services.insert(sp.name.clone(), Arc::new(sp));
    }
    st
}

/// A set of programs and maps of the test's own under `dir` of its bpffs,
/// attached to its own cgroup.
fn place(cg: &TestCgroup, fs: &TestBpffs, dir: &str) -> Placement {
    Placement {
        cgroup: cg.path().to_path_buf(),
        pin_dir: fs.path().join(dir),
    }
}

/// The maps' content, in a fixed order, read one entry per call (aya's
/// iterator) or in batches.
fn content(pin_dir: &std::path::Path, batched: bool) -> (Vec<String>, Vec<String>, Vec<String>) {
    use kp_ebpf::Maps;
    let mut maps = KernelMaps::open(pin_dir).expect("maps");
    if !batched {
        maps = maps.one_entry_per_call();
    }
    let d = maps.dump().expect("dump");
    assert_eq!(maps.batch_ops(), Some(batched));
    let mut s: Vec<String> = d.services.iter().map(|e| format!("{e:?}")).collect();
    let mut b: Vec<String> = d.backends.iter().map(|e| format!("{e:?}")).collect();
    let mut m: Vec<String> = d.members.iter().map(|e| format!("{e:?}")).collect();
    s.sort();
    b.sort();
    m.sort();
    (s, b, m)
}

#[test]
fn batch_writes_leave_the_maps_as_one_entry_per_call_does_and_the_fallback_takes_over() {
    let cg = TestCgroup::new().expect("test cgroup");
    let fs = TestBpffs::new().expect("bpffs");
    // Three sets of maps: batches, one entry per call, and batches on a
    // "kernel without batch commands" (the fallback must notice and write
    // one entry per call).
    let ways = ["batch", "single", "fallback"];
    for w in ways {
        install(&place(&cg, &fs, w), Capacity::default()).expect("install");
    }
    let mut pxs: Vec<SocketLbProxier> = ways
        .iter()
        .map(|w| {
            let maps = KernelMaps::open(&place(&cg, &fs, w).pin_dir).expect("maps");
            let maps = match *w {
                "single" => maps.one_entry_per_call(),
                "fallback" => maps.as_if_the_kernel_had_no_batch_ops(),
                _ => maps,
            };
            SocketLbProxier::new(IpFamily::V4, Box::new(maps))
        })
        .collect();
    // 7,000 Services x 10: 70,000 slots, more than one batch call takes
    // and enough to be split over threads.
    let first = cluster(7000, 10, 0);
    for px in &mut pxs {
        px.sync(&first, &BTreeSet::new(), true).expect("full sync");
    }
    let same = |when: &str| {
        let want = content(&place(&cg, &fs, "batch").pin_dir, true);
        assert!(want.1.len() > 60_000, "{when}: {} slots", want.1.len());
        // Read back in batches and one by one: the same.
        assert_eq!(
            content(&place(&cg, &fs, "batch").pin_dir, false),
            want,
            "{when}: reading"
        );
        for w in &ways[1..] {
            let got = content(&place(&cg, &fs, w).pin_dir, true);
            assert!(got == want, "{when}: {w} differs from batch");
        }
    };
    same("first");
    // Changes in one partial sync: every endpoint of a third replaced, a
    // tenth deleted, 500 new.
    let mut next = cluster(7500, 10, 0);
    let moved = cluster(7500, 10, 3);
    let names: Vec<ServicePortName> = next.services.keys().cloned().collect();
    for n in names.iter().step_by(3) {
        next.endpoints.insert(n.clone(), moved.endpoints[n].clone());
    }
    for n in names.iter().skip(1).step_by(10) {
        next.services.remove(n);
    }
    let changed: BTreeSet<ServicePortName> = names.into_iter().collect();
    for px in &mut pxs {
        px.sync(&next, &changed, false).expect("partial sync");
    }
    same("after the changes");
    // The fallback wrote one entry per call: the kernel refused its batch.
    {
        use kp_ebpf::maps::{BackendKey, BackendVal};
        use kp_ebpf::Maps;
        let probe_keys = [
            BackendKey {
                svc_id: 999_998,
                slot: 0,
            },
            BackendKey {
                svc_id: 999_998,
                slot: 1,
            },
        ];
        let vals = [BackendVal::default(); 2];
        let mut real = KernelMaps::open(&place(&cg, &fs, "batch").pin_dir).expect("maps");
        real.set_backends(&probe_keys, &vals).expect("batch");
        assert_eq!(real.batch_ops(), Some(true));
        real.del_backends(&probe_keys).expect("batch delete");
        // Deleting what is not there is done, in a batch too.
        real.del_backends(&probe_keys)
            .expect("batch delete of missing keys");
        // More than one call's worth per thread: 140,000 slots of a
        // Service port id nobody uses, written and deleted in batches.
        let many: Vec<BackendKey> = (0..140_000)
            .map(|slot| BackendKey {
                svc_id: 999_996,
                slot,
            })
            .collect();
        let many_vals: Vec<BackendVal> = (0..140_000u32)
            .map(|i| BackendVal {
                addr: [i, 0, 0, 0],
                port: 1,
                pad: 0,
            })
            .collect();
        real.set_backends(&many, &many_vals).expect("140,000 slots");
        let d = real.dump().expect("dump");
        let ours: BTreeMap<u32, u32> = d
            .backends
            .iter()
            .filter(|(k, _)| k.svc_id == 999_996)
            .map(|(k, v)| (k.slot, v.addr[0]))
            .collect();
        assert_eq!(ours.len(), 140_000);
        assert!(ours.iter().all(|(slot, a)| slot == a));
        real.del_backends(&many).expect("140,000 deletes");
        let d = real.dump().expect("dump");
        assert!(!d.backends.iter().any(|(k, _)| k.svc_id == 999_996));
        let mut without = KernelMaps::open(&place(&cg, &fs, "fallback").pin_dir)
            .expect("maps")
            .as_if_the_kernel_had_no_batch_ops();
        without
            .set_backends(&probe_keys, &vals)
            .expect("one by one");
        assert_eq!(without.batch_ops(), Some(false), "fell back");
        without.del_backends(&probe_keys).expect("one by one");
        without
            .del_backends(&probe_keys)
            .expect("missing keys, one by one");
    }
    same("after the probes");
    // A restarted proxy reads everything back (in batches) and writes nothing.
    let again = KernelMaps::open(&place(&cg, &fs, "batch").pin_dir).expect("maps");
    let r = SocketLbProxier::new(IpFamily::V4, Box::new(again))
        .sync(&next, &BTreeSet::new(), true)
        .expect("full sync after a restart");
    assert_eq!(r.ops, 0);
}

#[test]
fn a_write_the_kernel_refuses_fails_cleanly_and_a_full_sync_repairs_it() {
    let cg = TestCgroup::new().expect("test cgroup");
    let fs = TestBpffs::new().expect("bpffs");
    // Room for 2,000 slots: 100 Services x 10 fit, 220 do not.
    let cap = Capacity {
        services: 4096,
        backends: 2000,
    };
    let small = cluster(100, 10, 0);
    let big = cluster(220, 10, 0);
    let grown: BTreeSet<ServicePortName> = big.services.keys().cloned().collect();
    for (w, per_entry) in [("batch", false), ("single", true)] {
        let p = place(&cg, &fs, w);
        install(&p, cap).expect("install");
        let mut maps = KernelMaps::open(&p.pin_dir).expect("maps");
        if per_entry {
            maps = maps.one_entry_per_call();
        }
        let mut px = SocketLbProxier::new(IpFamily::V4, Box::new(maps));
        px.sync(&small, &BTreeSet::new(), true).expect("fits");
        let before = content(&p.pin_dir, true);
        let e = px
            .sync(&big, &grown, false)
            .expect_err("the map is full")
            .to_string();
        assert!(e.contains("filling slots"), "{w}: {e}");
        assert!(e.contains("kp_backends"), "{w}: {e}");
        assert!(e.contains("the map is full"), "{w}: {e}");
        assert!(e.contains("bench/svc-"), "{w}: names the Service port: {e}");
        // Back to what fits: the next (full) sync removes the slots written
        // for Services that never got their addresses.
        let r = px.sync(&small, &BTreeSet::new(), false).expect("repair");
        assert!(r.full, "{w}");
        assert_eq!(content(&p.pin_dir, true), before, "{w}: repaired");
    }
}

/// The tc programs on a node's interfaces: attached once (a link pinned per
/// interface, each running its role's program), left alone by the next
/// pass (nothing re-attached or "upgraded"), a link whose interface is gone
/// unpinned, and everything gone with `remove`.
#[test]
fn tc_links_are_attached_once_and_follow_the_interfaces() {
    let lab = lab("kp-tclinks");
    let pin_dir = lab.fs.path().join("kube-proxy-rs");
    let node = lab.cluster.node_ns(1).to_string();
    let pod_veth = lab.pods[0].host_veth().to_string();
    let out = in_netns(&node, || {
        let mut np = kp_ebpf::NodePort::install(&pin_dir, Capacity::default(), None, None).unwrap();
        let ifaces = kp_ebpf::interfaces(&["eth0".to_string()]).unwrap();
        let first = np.attach(&ifaces).unwrap();
        let second = np.attach(&ifaces).unwrap();
        (ifaces, first, second)
    })
    .unwrap();
    let (ifaces, first, second) = out;
    let roles: BTreeMap<String, kp_ebpf::Role> =
        ifaces.iter().map(|i| (i.name.clone(), i.role)).collect();
    assert_eq!(roles.get("eth0"), Some(&kp_ebpf::Role::External));
    assert_eq!(roles.get(&pod_veth), Some(&kp_ebpf::Role::FromPod));
    assert!(!roles.contains_key("lo"));
    assert_eq!(first.added.len(), ifaces.len(), "{first:?}");
    assert_eq!(
        second,
        kp_ebpf::Attached::default(),
        "a second pass changed links"
    );
    let links = pin_dir.join("links/tc");
    let pins: BTreeSet<String> = std::fs::read_dir(&links)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(pins.len(), ifaces.len(), "{pins:?}");
    // The pod's interface goes: its link is unpinned by the next pass.
    lab.cluster
        .exec_ok(&node, &["ip", "link", "del", &pod_veth])
        .unwrap();
    let third = in_netns(&node, || {
        let mut np = kp_ebpf::NodePort::install(&pin_dir, Capacity::default(), None, None).unwrap();
        let ifaces = kp_ebpf::interfaces(&["eth0".to_string()]).unwrap();
        np.attach(&ifaces).unwrap()
    })
    .unwrap();
    assert_eq!(third.removed.len(), 1, "{third:?}");
    assert!(third.removed[0].starts_with(&format!("pod-{pod_veth}@")));
    assert!(
        third.added.is_empty() && third.upgraded.is_empty(),
        "{third:?}"
    );
    assert!(remove(&pin_dir).unwrap());
    assert!(!links.exists());
}

/// The generations the tc programs' flow entries carry: links coming or
/// going bump the route one (the flows' cached routes are asked again), a
/// pass that changes nothing leaves it, and an endpoint leaving a Service
/// port bumps the members one (its UDP flows check their endpoint again).
#[test]
fn changed_links_and_removed_members_bump_the_flow_generations() {
    use kp_ebpf::maps::{BackendVal, MemberKey, NP_GEN};
    let lab = lab("kp-gens");
    let pin_dir = lab.fs.path().join("kube-proxy-rs");
    let node = lab.cluster.node_ns(1).to_string();
    let gens = |dir: &std::path::Path| -> [u32; 2] {
        let data = aya::maps::MapData::from_pin(dir.join(NP_GEN)).unwrap();
        let a: aya::maps::Array<aya::maps::MapData, [u32; 2]> =
            aya::maps::Array::try_from(aya::maps::Map::Array(data)).unwrap();
        a.get(&0, 0).unwrap()
    };
    let (fresh, attached, again, removed) = in_netns(&node, || {
        let mut np = kp_ebpf::NodePort::install(&pin_dir, Capacity::default(), None, None).unwrap();
        np.set_devices(vec!["eth0".to_string()]);
        let fresh = gens(&pin_dir);
        kp_ebpf::Attach::attach(&mut np).unwrap();
        let attached = gens(&pin_dir);
        kp_ebpf::Attach::attach(&mut np).unwrap();
        let again = gens(&pin_dir);
        let mut maps = KernelMaps::open(&pin_dir).unwrap();
        let gone = MemberKey {
            svc_id: 1,
            backend: BackendVal::new("10.0.0.9".parse().unwrap(), 80),
        };
        kp_ebpf::Maps::del_members(&mut maps, &[gone]).unwrap();
        (fresh, attached, again, gens(&pin_dir))
    })
    .unwrap();
    assert_eq!(fresh, [0, 0]);
    assert_eq!(attached, [1, 0], "links added: the route generation moves");
    assert_eq!(again, attached, "nothing changed: no generation moves");
    assert_eq!(
        removed,
        [1, 1],
        "a member removed: the members generation moves"
    );
    assert!(remove(&pin_dir).unwrap());
}
