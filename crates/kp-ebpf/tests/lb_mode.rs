//! `--bpf-lb-mode`: which entries for traffic from outside the node get the
//! DSR flag the tc programs read (bpf/nodeport.c): every eTP=Cluster port
//! with `dsr`, its TCP ports alone with `hybrid`, none with `snat` nor for
//! eTP=Local (the client's address is kept there anyway).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::net::IpAddr;
use std::sync::Arc;

use kp_ebpf::maps::{FLAG_DSR, FLAG_LOCAL};
use kp_ebpf::{wanted_outside, LbMode};
use kp_model::{Endpoint, IpFamily, NodeInfo, Protocol, ProxyState, ServicePort};

fn port(proto: Protocol, local: bool) -> ServicePort {
    port_at("10.96.0.9", proto, local)
}

fn port_at(cluster_ip: &str, proto: Protocol, local: bool) -> ServicePort {
    let b = ServicePort::builder("ns", "np")
        .protocol(proto)
        .cluster_ip(cluster_ip)
        .node_port(30009);
    if local { b.local_external() } else { b }.build()
}

fn flags(sp: ServicePort, mode: LbMode) -> u32 {
    flags_in(IpFamily::V4, sp, mode)
}

fn flags_in(family: IpFamily, sp: ServicePort, mode: LbMode) -> u32 {
    let mut st = ProxyState::new(family, NodeInfo::named("node1"));
    let (ep, node) = match family {
        IpFamily::V4 => ("10.244.1.2", "10.100.0.11"),
        IpFamily::V6 => ("fd00:244:1::2", "fd00:100::11"),
    };
    let ep = Endpoint::ready(ep.parse().unwrap(), 8080, true);
    st.endpoints.insert(sp.name.clone(), Arc::new(vec![ep]));
    let name = sp.name.clone();
    st.services.insert(name.clone(), Arc::new(sp));
    let sp = st.services.get(&name).unwrap().clone();
    let ips: Vec<IpAddr> = vec![node.parse().unwrap()];
    wanted_outside(&sp, &st, &ips, false, mode)
        .expect("an entry")
        .flags
}

#[test]
fn dsr_flag_follows_the_mode_the_protocol_and_the_policy() {
    use LbMode::*;
    for (mode, proto, local, dsr) in [
        (Snat, Protocol::Tcp, false, false),
        (Snat, Protocol::Udp, false, false),
        (Dsr, Protocol::Tcp, false, true),
        (Dsr, Protocol::Udp, false, true),
        (Hybrid, Protocol::Tcp, false, true),
        (Hybrid, Protocol::Udp, false, false),
        (Dsr, Protocol::Tcp, true, false),
        (Hybrid, Protocol::Tcp, true, false),
    ] {
        let f = flags(port(proto, local), mode);
        assert_eq!(f & FLAG_DSR != 0, dsr, "{mode:?} {proto:?} local={local}");
        assert_eq!(
            f & FLAG_LOCAL != 0,
            local,
            "{mode:?} {proto:?} local={local}"
        );
    }
    // IPv6 too (the carrier a destination options header); eTP=Local not.
    for (local, dsr) in [(false, FLAG_DSR), (true, 0)] {
        assert_eq!(
            flags_in(
                IpFamily::V6,
                port_at("fd00:96::9", Protocol::Tcp, local),
                Dsr
            ) & FLAG_DSR,
            dsr,
            "IPv6, local={local}"
        );
    }
    assert_eq!(LbMode::parse("hybrid"), Some(Hybrid));
    assert_eq!(LbMode::parse("dsr"), Some(Dsr));
    assert_eq!(LbMode::parse("snat"), Some(Snat));
    assert_eq!(LbMode::parse("DSR"), None);
}
