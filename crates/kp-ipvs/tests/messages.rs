//! Byte-level expectations for every netlink message kp-ipvs sends (IPVS
//! generic netlink and rtnetlink), written out from the uapi layouts
//! (include/uapi/linux/ip_vs.h, rtnetlink.h, if_addr.h), and the decoding of
//! the kernel's dump answers. Little-endian hosts (netlink is host order).
#![cfg(target_endian = "little")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::net::IpAddr;

use kp_ipvs::internals::{parse_addr, parse_dest, parse_service};
use kp_ipvs::{ipvs_msg, rtnl_msg, RealServer, VsKey, VsSpec};
use kp_model::Protocol;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Test family id for IPVS (the kernel assigns it at module load).
const FAM: u16 = 0x20;

fn vs() -> VsKey {
    VsKey {
        addr: "10.96.0.10".parse().unwrap(),
        protocol: Protocol::Tcp,
        port: 80,
    }
}

fn rs() -> RealServer {
    RealServer {
        addr: "10.244.1.2".parse().unwrap(),
        port: 8080,
    }
}

fn affinity() -> VsSpec {
    VsSpec {
        scheduler: "rr".into(),
        persistence: Some(600),
    }
}

#[test]
fn resolve_family() {
    // nlmsghdr(len 32, GENL_ID_CTRL, REQUEST|ACK, seq 1) genlmsghdr(GETFAMILY v1)
    // CTRL_ATTR_FAMILY_NAME "IPVS\0"
    assert_eq!(hex(&ipvs_msg::resolve_family(1)), RESOLVE);
}
const RESOLVE: &str = "2000000010000500010000000000000003010000090002004950565300000000";

#[test]
fn new_service_with_persistence() {
    // SERVICE nest: AF=2, PROTOCOL=6, ADDR (16 bytes), PORT 80 big-endian,
    // SCHED_NAME "rr", FLAGS {PERSISTENT, mask ~0}, TIMEOUT 600, NETMASK ~0.
    assert_eq!(
        hex(&ipvs_msg::new_service(FAM, 2, &vs(), &affinity())),
        NEW_SERVICE
    );
}
const NEW_SERVICE: &str = concat!(
    "6800000020000500020000000000000001010000540001800600010002000000",
    "0600020006000000140003000a60000a00000000000000000000000006000400",
    "0050000007000600727200000c00070001000000ffffffff0800080058020000",
    "08000900ffffffff"
);

#[test]
fn set_service() {
    assert_eq!(
        hex(&ipvs_msg::set_service(FAM, 3, &vs(), &affinity())),
        SET_SERVICE
    );
}
const SET_SERVICE: &str = concat!(
    "6800000020000500030000000000000002010000540001800600010002000000",
    "0600020006000000140003000a60000a00000000000000000000000006000400",
    "0050000007000600727200000c00070001000000ffffffff0800080058020000",
    "08000900ffffffff"
);

#[test]
fn new_service_ipv6_udp_without_persistence() {
    let k = VsKey {
        addr: "fd00:96::10".parse().unwrap(),
        protocol: Protocol::Udp,
        port: 53,
    };
    let spec = VsSpec {
        scheduler: "rr".into(),
        persistence: None,
    };
    // AF=10, PROTOCOL=17, NETMASK is a prefix length (128) for IPv6.
    assert_eq!(
        hex(&ipvs_msg::new_service(FAM, 11, &k, &spec)),
        NEW_SERVICE_V6
    );
}
const NEW_SERVICE_V6: &str = concat!(
    "68000000200005000b000000000000000101000054000180060001000a000000",
    "060002001100000014000300fd00009600000000000000000000001006000400",
    "0035000007000600727200000c00070000000000ffffffff0800080000000000",
    "0800090080000000"
);

#[test]
fn del_service() {
    // Identity only: AF, PROTOCOL, ADDR, PORT.
    assert_eq!(hex(&ipvs_msg::del_service(FAM, 4, &vs())), DEL_SERVICE);
}
const DEL_SERVICE: &str = concat!(
    "4400000020000500040000000000000003010000300001800600010002000000",
    "0600020006000000140003000a60000a00000000000000000000000006000400",
    "00500000"
);

#[test]
fn get_services_dump() {
    // REQUEST|DUMP (0x301), no attributes.
    assert_eq!(hex(&ipvs_msg::get_services(FAM, 5)), GET_SERVICES);
}
const GET_SERVICES: &str = "1400000020000103050000000000000004010000";

#[test]
fn new_dest() {
    // SERVICE identity + DEST nest: ADDR, PORT 8080 big-endian, FWD_METHOD
    // masquerade (0), WEIGHT 1, U_THRESH 0, L_THRESH 0, ADDR_FAMILY 2.
    assert_eq!(hex(&ipvs_msg::new_dest(FAM, 6, &vs(), &rs(), 1)), NEW_DEST);
}
const NEW_DEST: &str = concat!(
    "8c00000020000500060000000000000005010000300001800600010002000000",
    "0600020006000000140003000a60000a00000000000000000000000006000400",
    "0050000048000280140001000af4010200000000000000000000000006000200",
    "1f90000008000300000000000800040001000000080005000000000008000600",
    "0000000006000b0002000000"
);

#[test]
fn set_dest_weight_zero_for_draining() {
    assert_eq!(hex(&ipvs_msg::set_dest(FAM, 7, &vs(), &rs(), 0)), SET_DEST);
}
const SET_DEST: &str = concat!(
    "8c00000020000500070000000000000006010000300001800600010002000000",
    "0600020006000000140003000a60000a00000000000000000000000006000400",
    "0050000048000280140001000af4010200000000000000000000000006000200",
    "1f90000008000300000000000800040000000000080005000000000008000600",
    "0000000006000b0002000000"
);

#[test]
fn del_dest() {
    assert_eq!(hex(&ipvs_msg::del_dest(FAM, 8, &vs(), &rs())), DEL_DEST);
}
const DEL_DEST: &str = concat!(
    "6c00000020000500080000000000000007010000300001800600010002000000",
    "0600020006000000140003000a60000a00000000000000000000000006000400",
    "0050000028000280140001000af4010200000000000000000000000006000200",
    "1f90000006000b0002000000"
);

#[test]
fn get_dests_dump() {
    assert_eq!(hex(&ipvs_msg::get_dests(FAM, 9, &vs())), GET_DESTS);
}
const GET_DESTS: &str = concat!(
    "4400000020000103090000000000000008010000300001800600010002000000",
    "0600020006000000140003000a60000a00000000000000000000000006000400",
    "00500000"
);

#[test]
fn set_timeouts() {
    // SET_CONFIG with TIMEOUT_TCP 900, TIMEOUT_TCP_FIN 120, TIMEOUT_UDP 300.
    assert_eq!(
        hex(&ipvs_msg::set_timeouts(FAM, 10, 900, 120, 300)),
        SET_TIMEOUTS
    );
}
const SET_TIMEOUTS: &str = concat!(
    "2c000000200005000a000000000000000c010000080004008403000008000500",
    "78000000080006002c010000"
);

#[test]
fn rtnetlink_link_messages() {
    // RTM_NEWLINK REQUEST|ACK|EXCL|CREATE, ifinfomsg flags/change IFF_UP,
    // IFLA_IFNAME "kube-ipvs0", IFLA_LINKINFO { IFLA_INFO_KIND "dummy" }.
    assert_eq!(hex(&rtnl_msg::new_dummy(1, "kube-ipvs0")), NEW_DUMMY);
    assert_eq!(hex(&rtnl_msg::link_up(2, 7)), LINK_UP);
    assert_eq!(hex(&rtnl_msg::get_link(3, "kube-ipvs0")), GET_LINK);
    assert_eq!(hex(&rtnl_msg::del_link(4, 7)), DEL_LINK);
}
const NEW_DUMMY: &str = concat!(
    "4000000010000506010000000000000000000000000000000100000001000000",
    "0f0003006b7562652d69707673300000100012800900010064756d6d79000000"
);
const LINK_UP: &str = "2000000010000500020000000000000000000000070000000100000001000000";
const GET_LINK: &str = concat!(
    "3000000012000500030000000000000000000000000000000000000000000000",
    "0f0003006b7562652d69707673300000"
);
const DEL_LINK: &str = "2000000011000500040000000000000000000000070000000000000000000000";

#[test]
fn rtnetlink_address_messages() {
    let v4: IpAddr = "10.96.0.10".parse().unwrap();
    let v6: IpAddr = "fd00:96::10".parse().unwrap();
    // ifaddrmsg(family, prefix 32/128, scope host, index 7), IFA_LOCAL,
    // IFA_ADDRESS, IFA_FLAGS NODAD.
    assert_eq!(hex(&rtnl_msg::add_addr(5, 7, &v4)), ADD_ADDR);
    assert_eq!(hex(&rtnl_msg::add_addr(6, 7, &v6)), ADD_ADDR_V6);
    assert_eq!(hex(&rtnl_msg::del_addr(7, 7, &v4)), DEL_ADDR);
    assert_eq!(hex(&rtnl_msg::get_addrs(8, 2)), GET_ADDRS);
}
const ADD_ADDR: &str = concat!(
    "30000000140005060500000000000000022000fe07000000080002000a60000a",
    "080001000a60000a0800080002000000"
);
const ADD_ADDR_V6: &str = concat!(
    "480000001400050606000000000000000a8000fe0700000014000200fd000096",
    "00000000000000000000001014000100fd000096000000000000000000000010",
    "0800080002000000"
);
const DEL_ADDR: &str = concat!(
    "280000001500050007000000000000000220000007000000080002000a60000a",
    "080001000a60000a"
);
const GET_ADDRS: &str = "180000001600010308000000000000000200000000000000";

#[test]
fn decodes_service_and_dest_answers() {
    // A dump answer carries the same nests as our requests (after the
    // 16-byte netlink header).
    let svc = unhex(NEW_SERVICE);
    let (k, spec) = parse_service(&svc[16..]).unwrap();
    assert_eq!(k, vs());
    assert_eq!(spec, affinity());
    let svc6 = unhex(NEW_SERVICE_V6);
    let (k6, spec6) = parse_service(&svc6[16..]).unwrap();
    assert_eq!(k6.addr, "fd00:96::10".parse::<IpAddr>().unwrap());
    assert_eq!(
        (k6.protocol, k6.port, spec6.persistence),
        (Protocol::Udp, 53, None)
    );
    // genlmsghdr + DEST nest only, as the kernel's GET_DEST answer.
    let d = unhex(NEW_DEST);
    let dest_nest = &d[16 + 4 + 0x30..];
    let mut payload = vec![8, 1, 0, 0];
    payload.extend_from_slice(dest_nest);
    let info = parse_dest(&payload, 2).unwrap();
    assert_eq!(info.rs, rs());
    assert_eq!(info.weight, 1);
    // Garbage never panics.
    assert!(parse_service(&[1, 2, 3]).is_none());
    assert!(parse_dest(&[0; 40], 2).is_none());
}

#[test]
fn decodes_address_answers() {
    let a = unhex(ADD_ADDR);
    let info = parse_addr(&a[16..]).unwrap();
    assert_eq!(info.index, 7);
    assert_eq!(info.net, "10.96.0.10/32".parse().unwrap());
    let a6 = unhex(ADD_ADDR_V6);
    assert_eq!(
        parse_addr(&a6[16..]).unwrap().net,
        "fd00:96::10/128".parse().unwrap()
    );
    assert!(parse_addr(&[2, 32]).is_none());
}

/// ipset over nfnetlink (include/uapi/linux/netfilter/ipset/ip_set.h): the
/// name-only dump and a destroy, as the leftover cleanup sends them.
#[test]
fn ipset_messages() {
    use kp_ipvs::leftovers::msg;
    // len 36, type (NFNL_SUBSYS_IPSET 6 << 8) | IPSET_CMD_LIST 7, flags
    // REQUEST|DUMP, seq 9, pid 0; nfgenmsg AF_INET v0 res 0; PROTOCOL u8 7
    // (padded); FLAGS be32 LIST_SETNAME (1 << 1).
    assert_eq!(
        hex(&msg::list_names(9)),
        "24000000070601030900000000000000\
         02000000\
         0500010007000000\
         0800060000000002"
    );
    // type 0x0603 DESTROY, flags REQUEST|ACK; PROTOCOL 7; SETNAME "KUBE-X\0".
    assert_eq!(
        hex(&msg::destroy(3, "KUBE-X")),
        "28000000030605000300000000000000\
         02000000\
         0500010007000000\
         0b0002004b5542452d580000"
    );
}

#[test]
fn ipvs_mode_set_names() {
    use kp_ipvs::leftovers::is_ipvs_set;
    for n in [
        "KUBE-CLUSTER-IP",
        "KUBE-6-CLUSTER-IP",
        "KUBE-LOAD-BALANCER-SOURCE-IP",
        // upstream cuts IPv6 names at 31 characters; ours shortens them
        "KUBE-6-LOAD-BALANCER-SOURCE-CID",
        "KUBE-6-LOAD-BALANCER-SRC-CIDR",
        "KUBE-6-NODE-PORT-LOCAL-SCTP",
    ] {
        assert!(is_ipvs_set(n), "{n}");
    }
    for n in [
        "KUBE-6-",
        "KUBE-CLUSTER",
        "KUBE-6-KUBE-CLUSTER-IP",
        "USER",
        "",
    ] {
        assert!(!is_ipvs_set(n), "{n}");
    }
}
