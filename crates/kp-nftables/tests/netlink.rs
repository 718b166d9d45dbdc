//! The netlink backend against the kernel, in throwaway network namespaces:
//! every object and statement the proxier sends must list exactly as it does
//! when the same transaction goes to `nft -f` as text.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

mod common;

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

use common::*;
use ipnet::IpNet;
use kp_model::{Dataplane, IpFamily, LocalDetector, Protocol, ProxierConfig};
use kp_nftables::types::{
    Addr, AddrValue, BaseChain, Chain, ChainType, CtState, DType, DnatTarget, ElemKey, ElemValue,
    Expr, Hook, KeyField, MapName, MarkOp, NumgenValue, Object, Rule, Set, SetType, Slots,
    Transaction, Verb,
};
use kp_nftables::{NftBackend, NftCli, NftNetlink, NftablesProxier, Verdict};
use serde_json::json;

impl Ns {
    fn nft_tx(&self, tx: &Transaction) -> Result<(), String> {
        let script = tx.to_string();
        let path = format!("/tmp/{}-{}.nft", self.0, script.len());
        std::fs::write(&path, &script).unwrap();
        let r = self.nft(&["-f", &path]).map(|_| ());
        let _ = std::fs::remove_file(&path);
        r
    }

    fn netlink(&self, tx: &Transaction) -> Result<usize, kp_model::DataplaneError> {
        self.run(|| NftNetlink::new().apply(tx))
    }
}

/// Applies each transaction in turn through netlink in one namespace and as
/// text through `nft -f` in another; after each the two rulesets must list
/// identically.
fn same_as_nft(tag: &str, txs: &[Transaction]) {
    let a = Ns::new(&format!("{tag}a"));
    let b = Ns::new(&format!("{tag}b"));
    for (i, tx) in txs.iter().enumerate() {
        b.nft_tx(tx)
            .unwrap_or_else(|e| panic!("nft refused transaction {i}: {e}\n{tx}"));
        a.netlink(tx)
            .unwrap_or_else(|e| panic!("netlink refused transaction {i}: {e}"));
        let (la, lb) = (a.ruleset(), b.ruleset());
        assert_eq!(la, lb, "transaction {i} lists differently via netlink");
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}
fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}
fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}
fn goto(c: &str) -> Verdict {
    Verdict::Goto(c.into())
}
fn jump(c: &str) -> Verdict {
    Verdict::Jump(c.into())
}
fn v(v: Verdict) -> Expr {
    Expr::Verdict(v)
}
fn addr(field: Addr, neg: bool, value: AddrValue) -> Expr {
    Expr::AddrMatch { field, neg, value }
}
fn r(exprs: Vec<Expr>) -> Rule {
    Rule::new(exprs)
}
fn table(comment: Option<&'static str>) -> Object {
    Object::Table {
        comment: comment.map(Cow::Borrowed),
    }
}
fn chain(name: &str) -> Object {
    Object::Chain(Chain::regular(name))
}
fn base(name: &str, ty: ChainType, hook: Hook, priority: i32) -> Object {
    Object::Chain(Chain {
        name: name.into(),
        base: Some(BaseChain { ty, hook, priority }),
    })
}
fn typed(name: &str, key: Vec<DType>, verdict_map: bool, timeout: Option<u32>) -> Object {
    Object::Set(Set {
        name: name.into(),
        ty: SetType::Typed {
            key,
            verdict_map,
            timeout,
        },
    })
}
fn numgen_map(name: &str, value: NumgenValue) -> Object {
    Object::Set(Set {
        name: name.into(),
        ty: SetType::Numgen(value),
    })
}
fn elems(set: &'static &'static str, e: Vec<(ElemKey, Option<ElemValue>)>) -> Object {
    Object::Elements {
        set: MapName::Fixed(set),
        elems: e,
    }
}
fn slots(map: &'static &'static str, offset: u32) -> Slots {
    Slots {
        pool: 0,
        map: MapName::Fixed(map),
        offset,
    }
}
fn key3() -> Vec<KeyField> {
    vec![
        KeyField::Addr(Addr::Daddr),
        KeyField::L4Proto,
        KeyField::ThDport,
    ]
}
fn goto_v(c: &str) -> Option<ElemValue> {
    Some(ElemValue::Verdict(goto(c)))
}

const SVC: &str = "service-AAAA-default/svc/tcp/http";
const EP: &str = "endpoint-AAAA-default/svc/tcp/http__10.244.1.2/8080";

fn v4_shapes() -> Transaction {
    use DType::*;
    use Protocol::*;
    let mut t = Transaction::new(IpFamily::V4, "t");
    t.add(table(Some("rules for kube-proxy-rs")))
        .add(typed("cluster-ips", vec![Ipv4], false, None))
        .add(typed("nodeport-ips", vec![Ipv4], false, None))
        .add(typed("hairpin", vec![Ipv4, Ipv4], false, None))
        .add(typed(
            "service-ips",
            vec![Ipv4, InetProto, InetService],
            true,
            None,
        ))
        .add(typed(
            "service-nodeports",
            vec![InetProto, InetService],
            true,
            None,
        ))
        .add(typed("affinity-10800-x", vec![Ipv4], false, Some(10800)))
        .create(typed("created", vec![Ipv4], false, None))
        .add(numgen_map("endpoints-tcp", NumgenValue::AddrPort(Tcp)))
        .add(numgen_map("endpoints-udp", NumgenValue::AddrPort(Udp)))
        .add(numgen_map("endpoints-sctp", NumgenValue::AddrPort(Sctp)))
        .add(base("filter-input", ChainType::Filter, Hook::Input, -110))
        .add(base(
            "filter-forward",
            ChainType::Filter,
            Hook::Forward,
            -110,
        ))
        .add(base(
            "filter-output-post-dnat",
            ChainType::Filter,
            Hook::Output,
            -90,
        ))
        .add(base(
            "nat-prerouting",
            ChainType::Nat,
            Hook::Prerouting,
            -100,
        ))
        .add(base(
            "nat-postrouting",
            ChainType::Nat,
            Hook::Postrouting,
            100,
        ))
        .add(chain("mark-for-masquerade"))
        .add(chain("masquerading"))
        .add(chain("services"))
        .add(chain("reject-chain"))
        .add(chain("cluster-ips-check"))
        .add(chain(SVC))
        .add(chain(EP))
        .create(chain("ext"))
        .add(chain("fw"));
    let ct = |s| Expr::Ct(s);
    let masq = v(jump("mark-for-masquerade"));
    let cips = Expr::Lookup {
        key: vec![KeyField::Addr(Addr::Daddr)],
        set: "cluster-ips".into(),
    };
    let rules: Vec<(&str, Rule)> = vec![
        (
            "filter-input",
            r(vec![ct(CtState::New), v(jump("cluster-ips-check"))]),
        ),
        (
            "filter-forward",
            r(vec![ct(CtState::Invalid), v(Verdict::Drop)]),
        ),
        (
            "filter-output-post-dnat",
            r(vec![ct(CtState::New), v(jump("cluster-ips-check"))]),
        ),
        ("nat-prerouting", r(vec![v(jump("services"))])),
        ("nat-postrouting", r(vec![v(jump("masquerading"))])),
        (
            "mark-for-masquerade",
            r(vec![Expr::MarkSet(MarkOp::Or, 0x4000)]),
        ),
        (
            "masquerading",
            r(vec![
                Expr::Lookup {
                    key: vec![KeyField::Addr(Addr::Saddr), KeyField::Addr(Addr::Daddr)],
                    set: "hairpin".into(),
                },
                Expr::Masquerade { fully_random: true },
            ])
            .comment("hairpin: a pod reached itself through a Service"),
        ),
        (
            "masquerading",
            r(vec![
                Expr::MarkMatch {
                    mask: 0x4000,
                    neg: false,
                    value: 0,
                },
                v(Verdict::Return),
            ]),
        ),
        (
            "masquerading",
            r(vec![
                Expr::MarkMatch {
                    mask: 0x4000,
                    neg: true,
                    value: 0,
                },
                v(Verdict::Drop),
            ]),
        ),
        ("masquerading", r(vec![Expr::MarkSet(MarkOp::Xor, 0x4000)])),
        (
            "masquerading",
            r(vec![Expr::Masquerade { fully_random: true }]),
        ),
        (
            "masquerading",
            r(vec![Expr::Masquerade {
                fully_random: false,
            }]),
        ),
        (
            "services",
            r(vec![Expr::Vmap {
                key: key3(),
                map: "service-ips".into(),
            }]),
        ),
        (
            "services",
            r(vec![
                Expr::FibLocal(Addr::Daddr),
                addr(Addr::Daddr, true, AddrValue::Net(net("127.0.0.0/8"))),
                Expr::Vmap {
                    key: vec![KeyField::L4Proto, KeyField::ThDport],
                    map: "service-nodeports".into(),
                },
            ]),
        ),
        (
            "services",
            r(vec![
                Expr::Lookup {
                    key: vec![KeyField::Addr(Addr::Daddr)],
                    set: "nodeport-ips".into(),
                },
                Expr::Vmap {
                    key: vec![KeyField::L4Proto, KeyField::ThDport],
                    map: "service-nodeports".into(),
                },
            ]),
        ),
        ("reject-chain", r(vec![Expr::Reject])),
        (
            "cluster-ips-check",
            r(vec![
                Expr::Lookup {
                    key: vec![KeyField::Addr(Addr::Daddr)],
                    set: "cluster-ips".into(),
                },
                Expr::Reject,
            ])
            .comment("reject traffic to invalid ports of ClusterIPs"),
        ),
        (
            "cluster-ips-check",
            r(vec![
                addr(Addr::Daddr, false, AddrValue::Net(net("10.96.0.0/12"))),
                v(Verdict::Drop),
            ])
            .comment("drop traffic to unallocated ClusterIPs"),
        ),
        (
            "services",
            r(vec![
                cips.clone(),
                addr(Addr::Saddr, true, AddrValue::Net(net("10.244.0.0/16"))),
                masq.clone(),
            ]),
        ),
        (
            "services",
            r(vec![
                cips.clone(),
                addr(
                    Addr::Saddr,
                    true,
                    AddrValue::Set(vec![net("10.244.0.0/16"), net("10.245.0.0/16")]),
                ),
                masq.clone(),
            ]),
        ),
        (
            "services",
            r(vec![
                cips.clone(),
                Expr::Iifname {
                    neg: true,
                    name: "cbr0".into(),
                    wildcard: false,
                },
                masq.clone(),
            ]),
        ),
        (
            "services",
            r(vec![
                cips.clone(),
                Expr::Iifname {
                    neg: true,
                    name: "veth".into(),
                    wildcard: true,
                },
                masq.clone(),
            ]),
        ),
        ("services", r(vec![cips.clone(), masq.clone()])),
        (
            SVC,
            r(vec![
                Expr::Lookup {
                    key: vec![KeyField::Addr(Addr::Saddr)],
                    set: "affinity-10800-x".into(),
                },
                v(goto(EP)),
            ]),
        ),
        (
            SVC,
            r(vec![
                Expr::L4Proto(Tcp),
                Expr::NumgenDnat {
                    count: 3,
                    slots: slots(&"endpoints-tcp", 0),
                },
            ]),
        ),
        (
            SVC,
            r(vec![
                Expr::L4Proto(Udp),
                Expr::NumgenDnat {
                    count: 2,
                    slots: slots(&"endpoints-udp", 4),
                },
            ]),
        ),
        (
            EP,
            r(vec![Expr::L4Proto(Udp), Expr::Dnat(sa("10.244.1.2:8080"))]),
        ),
        ("ext", r(vec![masq.clone()])),
        (
            "ext",
            r(vec![
                addr(Addr::Saddr, false, AddrValue::Net(net("10.244.0.0/16"))),
                v(goto(SVC)),
            ])
            .comment("short-circuit pod traffic"),
        ),
        (
            "ext",
            r(vec![
                addr(
                    Addr::Saddr,
                    false,
                    AddrValue::Set(vec![net("10.244.0.0/16"), net("10.250.0.0/15")]),
                ),
                v(goto(SVC)),
            ])
            .comment("short-circuit pod traffic"),
        ),
        (
            "ext",
            r(vec![
                Expr::Iifname {
                    neg: false,
                    name: "cbr0".into(),
                    wildcard: false,
                },
                v(goto(SVC)),
            ]),
        ),
        (
            "ext",
            r(vec![
                Expr::Iifname {
                    neg: false,
                    name: "veth".into(),
                    wildcard: true,
                },
                v(goto(SVC)),
            ]),
        ),
        (
            "ext",
            r(vec![Expr::FibLocal(Addr::Saddr), masq.clone()]).comment("masquerade local traffic"),
        ),
        (
            "ext",
            r(vec![Expr::FibLocal(Addr::Saddr), v(goto(SVC))])
                .comment("short-circuit local traffic"),
        ),
        ("ext", r(vec![v(goto(SVC))]).comment("cluster endpoints")),
        (
            "fw",
            r(vec![
                addr(
                    Addr::Saddr,
                    true,
                    AddrValue::Set(vec![net("203.0.113.0/24")]),
                ),
                v(Verdict::Drop),
            ])
            .comment("source not in loadBalancerSourceRanges"),
        ),
        (
            "fw",
            r(vec![
                addr(
                    Addr::Saddr,
                    true,
                    AddrValue::Set(vec![
                        net("203.0.113.0/24"),
                        net("198.51.100.0/25"),
                        net("198.51.100.128/25"),
                        net("0.0.0.0/8"),
                        net("203.0.113.7/32"),
                    ]),
                ),
                v(Verdict::Drop),
            ])
            .comment("source not in loadBalancerSourceRanges"),
        ),
        (
            "fw",
            r(vec![
                addr(Addr::Saddr, false, AddrValue::Net(net("10.0.0.0/9"))),
                v(Verdict::Return),
            ])
            .comment("x"),
        ),
        ("fw", r(vec![v(Verdict::Drop)]).comment("y")),
        // loadBalancerSourceRanges: [0.0.0.0/0], alone and with others.
        (
            "fw",
            r(vec![
                addr(Addr::Saddr, true, AddrValue::Set(vec![net("0.0.0.0/0")])),
                v(Verdict::Drop),
            ]),
        ),
        (
            "fw",
            r(vec![
                addr(
                    Addr::Saddr,
                    true,
                    AddrValue::Set(vec![net("203.0.113.0/24"), net("0.0.0.0/0")]),
                ),
                v(Verdict::Drop),
            ]),
        ),
    ];
    for (c, rule) in rules {
        t.add_rule(c, rule);
    }
    let ipp = |a: &str, p, port| ElemKey::IpProtoPort(ip(a), p, port);
    t.add(elems(
        &"service-ips",
        vec![
            (ipp("10.96.0.10", Tcp, 80), goto_v(SVC)),
            (
                ipp("10.96.0.11", Udp, 53),
                Some(ElemValue::Verdict(Verdict::Drop)),
            ),
            (ipp("10.96.0.12", Sctp, 9), goto_v("reject-chain")),
            (
                ipp("10.96.0.13", Tcp, 443),
                Some(ElemValue::Verdict(jump("fw"))),
            ),
        ],
    ))
    .add(elems(
        &"service-nodeports",
        vec![(ElemKey::ProtoPort(Tcp, 30080), goto_v("ext"))],
    ))
    .add(elems(
        &"hairpin",
        vec![(ElemKey::IpPair(ip("10.244.1.2")), None)],
    ))
    .add(elems(
        &"cluster-ips",
        vec![
            (ElemKey::Ip(ip("10.96.0.10")), None),
            (ElemKey::Ip(ip("10.96.0.11")), None),
        ],
    ))
    .create(elems(
        &"nodeport-ips",
        vec![(ElemKey::Ip(ip("203.0.113.9")), None)],
    ))
    .add(elems(
        &"endpoints-tcp",
        vec![
            (
                ElemKey::Slot(0),
                Some(ElemValue::Endpoint(sa("10.244.1.2:8080").into())),
            ),
            (
                ElemKey::Slot(1),
                Some(ElemValue::Endpoint(sa("10.244.2.2:8080").into())),
            ),
            (
                ElemKey::Slot(2),
                Some(ElemValue::Endpoint(sa("10.244.3.2:8081").into())),
            ),
        ],
    ))
    .add(elems(
        &"endpoints-udp",
        vec![
            (
                ElemKey::Slot(4),
                Some(ElemValue::Endpoint(sa("10.244.3.2:53").into())),
            ),
            (
                ElemKey::Slot(5),
                Some(ElemValue::Endpoint(sa("10.244.1.2:53").into())),
            ),
        ],
    ));
    t
}

fn v4_update() -> Transaction {
    use Protocol::*;
    let ipp = |a: &str, p, port| ElemKey::IpProtoPort(ip(a), p, port);
    let mut t = Transaction::new(IpFamily::V4, "t");
    t.add(table(Some("rules for kube-proxy-rs")))
        .flush(chain(SVC))
        .add_rule(
            SVC,
            r(vec![Expr::L4Proto(Tcp), Expr::Dnat(sa("10.244.9.9:9090"))]),
        )
        .delete(elems(
            &"service-ips",
            vec![
                (
                    ipp("10.96.0.11", Udp, 53),
                    Some(ElemValue::Verdict(Verdict::Drop)),
                ),
                (
                    ipp("10.96.0.13", Tcp, 443),
                    Some(ElemValue::Verdict(jump("fw"))),
                ),
            ],
        ))
        .delete(elems(
            &"cluster-ips",
            vec![(ElemKey::Ip(ip("10.96.0.11")), None)],
        ))
        .delete(elems(
            &"hairpin",
            vec![(ElemKey::IpPair(ip("10.244.1.2")), None)],
        ))
        .delete(elems(
            &"endpoints-tcp",
            vec![(
                ElemKey::Slot(1),
                Some(ElemValue::Endpoint(sa("10.244.2.2:8080").into())),
            )],
        ))
        .add(elems(
            &"endpoints-tcp",
            vec![(
                ElemKey::Slot(1),
                Some(ElemValue::Endpoint(sa("10.244.9.9:9090").into())),
            )],
        ))
        .add(elems(
            &"service-ips",
            vec![(ipp("10.96.0.11", Udp, 53), goto_v("ext"))],
        ))
        .flush(chain("fw"))
        .delete(chain("fw"))
        .flush(chain(EP))
        .delete(chain(EP))
        .delete(typed(
            "affinity-10800-x",
            vec![DType::Ipv4],
            false,
            Some(10800),
        ))
        .flush(typed(
            "service-nodeports",
            vec![DType::InetProto, DType::InetService],
            true,
            None,
        ))
        .flush(typed("nodeport-ips", vec![DType::Ipv4], false, None));
    t
}

fn v4_resync() -> Transaction {
    let mut t = Transaction::new(IpFamily::V4, "t");
    let sips = || {
        typed(
            "service-ips",
            vec![DType::Ipv4, DType::InetProto, DType::InetService],
            true,
            None,
        )
    };
    t.add(table(Some("rules for kube-proxy-rs")))
        .flush(table(None))
        .add(sips())
        .flush(sips())
        .add(numgen_map(
            "endpoints-tcp",
            NumgenValue::AddrPort(Protocol::Tcp),
        ))
        .flush(numgen_map(
            "endpoints-tcp",
            NumgenValue::AddrPort(Protocol::Tcp),
        ))
        .add(chain("services"))
        .add_rule(
            "services",
            r(vec![Expr::Vmap {
                key: key3(),
                map: "service-ips".into(),
            }]),
        )
        .add(elems(
            &"service-ips",
            vec![(
                ElemKey::IpProtoPort(ip("10.96.0.11"), Protocol::Udp, 53),
                goto_v("ext"),
            )],
        ));
    t
}

fn cleanup_tx(family: IpFamily) -> Transaction {
    let mut t = Transaction::new(family, "t");
    t.add(table(None)).delete(table(None));
    t
}

#[test]
fn v4_shapes_list_as_nft_writes_them() {
    same_as_nft(
        "v4",
        &[
            v4_shapes(),
            v4_update(),
            v4_resync(),
            cleanup_tx(IpFamily::V4),
        ],
    );
}

fn v6_shapes() -> Transaction {
    use DType::*;
    use Protocol::*;
    let mut t = Transaction::new(IpFamily::V6, "t");
    t.add(table(Some("rules for kube-proxy-rs")))
        .add(typed("cluster-ips", vec![Ipv6], false, None))
        .add(typed("hairpin", vec![Ipv6, Ipv6], false, None))
        .add(typed(
            "service-ips",
            vec![Ipv6, InetProto, InetService],
            true,
            None,
        ))
        .add(typed(
            "service-nodeports",
            vec![InetProto, InetService],
            true,
            None,
        ))
        .add(typed("aff", vec![Ipv6], false, Some(60)))
        .add(numgen_map("endpoints-tcp", NumgenValue::AddrPort(Tcp)))
        .add(numgen_map("endpoints-udp", NumgenValue::AddrPort(Udp)))
        .add(base("nat-output", ChainType::Nat, Hook::Output, -100))
        .add(base(
            "filter-forward",
            ChainType::Filter,
            Hook::Forward,
            -110,
        ))
        .add(chain("x"))
        .add(chain("y"))
        .add(chain("reject-chain"));
    let rules: Vec<(&str, Rule)> = vec![
        (
            "filter-forward",
            r(vec![Expr::Ct(CtState::Invalid), v(Verdict::Drop)]),
        ),
        (
            "nat-output",
            r(vec![Expr::L4Proto(Tcp), Expr::Dnat(sa("[fd00::1]:8080"))]),
        ),
        ("reject-chain", r(vec![Expr::Reject])),
        (
            "x",
            r(vec![
                addr(
                    Addr::Saddr,
                    true,
                    AddrValue::Set(vec![net("2001:db8::/64"), net("2001:db8:1::/48")]),
                ),
                v(Verdict::Drop),
            ]),
        ),
        (
            "x",
            r(vec![
                Expr::FibLocal(Addr::Daddr),
                addr(Addr::Daddr, true, AddrValue::Ip(ip("::1"))),
                Expr::Vmap {
                    key: vec![KeyField::L4Proto, KeyField::ThDport],
                    map: "service-nodeports".into(),
                },
            ]),
        ),
        (
            "x",
            r(vec![Expr::Vmap {
                key: key3(),
                map: "service-ips".into(),
            }]),
        ),
        (
            "x",
            r(vec![
                Expr::Lookup {
                    key: vec![KeyField::Addr(Addr::Saddr), KeyField::Addr(Addr::Daddr)],
                    set: "hairpin".into(),
                },
                Expr::Masquerade { fully_random: true },
            ]),
        ),
        (
            "x",
            r(vec![
                addr(Addr::Saddr, false, AddrValue::Net(net("fd00::/60"))),
                v(goto("y")),
            ]),
        ),
        (
            "x",
            r(vec![
                addr(Addr::Saddr, false, AddrValue::Net(net("fd00::/61"))),
                v(goto("y")),
            ]),
        ),
        (
            "x",
            r(vec![
                addr(Addr::Daddr, false, AddrValue::Ip(ip("fd00::1"))),
                Expr::L4Proto(Sctp),
                addr(Addr::Saddr, true, AddrValue::Set(vec![net("fd00::/64")])),
                addr(Addr::Saddr, true, AddrValue::Set(vec![net("::/0")])),
                v(jump("y")),
            ]),
        ),
        (
            "x",
            r(vec![
                Expr::Lookup {
                    key: vec![KeyField::Addr(Addr::Daddr)],
                    set: "cluster-ips".into(),
                },
                Expr::Reject,
            ]),
        ),
        (
            "x",
            r(vec![
                Expr::Lookup {
                    key: vec![KeyField::Addr(Addr::Saddr)],
                    set: "aff".into(),
                },
                v(goto("y")),
            ]),
        ),
        (
            "x",
            r(vec![
                Expr::L4Proto(Tcp),
                Expr::NumgenDnat {
                    count: 2,
                    slots: slots(&"endpoints-tcp", 8),
                },
            ]),
        ),
        (
            "y",
            r(vec![
                Expr::Iifname {
                    neg: true,
                    name: "eth".into(),
                    wildcard: true,
                },
                v(Verdict::Return),
            ]),
        ),
    ];
    for (c, rule) in rules {
        t.add_rule(c, rule);
    }
    let ipp = |a: &str, p, port| ElemKey::IpProtoPort(ip(a), p, port);
    t.add(elems(
        &"service-ips",
        vec![
            (ipp("fd00::1", Tcp, 80), goto_v("x")),
            (
                ipp("fd00::2", Udp, 53),
                Some(ElemValue::Verdict(Verdict::Drop)),
            ),
        ],
    ))
    .add(elems(
        &"service-nodeports",
        vec![(ElemKey::ProtoPort(Sctp, 30000), goto_v("reject-chain"))],
    ))
    .add(elems(
        &"hairpin",
        vec![(ElemKey::IpPair(ip("fd00::1")), None)],
    ))
    .add(elems(
        &"cluster-ips",
        vec![
            (ElemKey::Ip(ip("fd00::10")), None),
            (ElemKey::Ip(ip("fd00::11")), None),
        ],
    ))
    .add(elems(
        &"endpoints-tcp",
        vec![
            (
                ElemKey::Slot(8),
                Some(ElemValue::Endpoint(sa("[fd00::1]:8080").into())),
            ),
            (
                ElemKey::Slot(9),
                Some(ElemValue::Endpoint(sa("[fd00::2]:443").into())),
            ),
        ],
    ))
    .add(elems(
        &"endpoints-udp",
        vec![(
            ElemKey::Slot(0),
            Some(ElemValue::Endpoint(sa("[fd00::1]:53").into())),
        )],
    ));
    t
}

#[test]
fn v6_shapes_list_as_nft_writes_them() {
    let mut del = Transaction::new(IpFamily::V6, "t");
    del.delete(elems(
        &"cluster-ips",
        vec![(ElemKey::Ip(ip("fd00::10")), None)],
    ))
    .flush(table(None));
    same_as_nft("v6", &[v6_shapes(), del, cleanup_tx(IpFamily::V6)]);
}

/// Objects the encoder cannot send are refused before anything reaches the
/// kernel, naming the operation's line and text.
#[test]
fn unencodable_objects_are_refused_with_their_line() {
    let bad: Vec<(Verb, Object, &str)> = vec![
        (
            Verb::Add,
            Object::Rule {
                chain: "x".into(),
                rule: r(vec![
                    addr(Addr::Saddr, false, AddrValue::Ip(ip("::1"))),
                    v(Verdict::Drop),
                ]),
            },
            "not of the table's family",
        ),
        (
            Verb::Add,
            elems(&"s", vec![(ElemKey::Ip(ip("fd00::1")), None)]),
            "not of the table's family",
        ),
        (
            Verb::Add,
            Object::Rule {
                chain: "x".into(),
                rule: r(vec![Expr::Iifname {
                    neg: false,
                    name: "a-very-long-interface".into(),
                    wildcard: false,
                }]),
            },
            "too long",
        ),
        (
            Verb::Delete,
            Object::Rule {
                chain: "x".into(),
                rule: r(vec![v(Verdict::Drop)]),
            },
            "rules can only be added",
        ),
        (
            Verb::Flush,
            elems(&"s", vec![(ElemKey::Ip(ip("10.0.0.1")), None)]),
            "cannot be flushed",
        ),
        (
            Verb::Add,
            Object::Rule {
                chain: "x".into(),
                rule: r(vec![]),
            },
            "empty rule",
        ),
    ];
    for (verb, obj, why) in bad {
        let mut t = Transaction::new(IpFamily::V4, "t");
        t.add(table(None)).push(verb, obj);
        let text = t.op_text(1);
        let e = NftNetlink::check(&t).unwrap_err().to_string();
        assert!(
            e.contains("line 2") && e.contains(&text) && e.contains(why),
            "{text}: {e}"
        );
    }
    assert!(NftNetlink::check(&v4_shapes()).is_ok());
    assert!(NftNetlink::check(&v6_shapes()).is_ok());
}

#[test]
fn failing_transaction_names_the_line_and_changes_nothing() {
    let ns = Ns::new("fail");
    ns.netlink(&v4_shapes()).unwrap();
    let before = ns.ruleset();
    let mut bad = Transaction::new(IpFamily::V4, "t");
    bad.add(chain("brand-new"))
        .add(elems(
            &"cluster-ips",
            vec![(ElemKey::Ip(ip("10.96.9.9")), None)],
        ))
        .flush(chain("services"))
        .delete(chain("no-such-chain"))
        .add_rule("services", r(vec![v(Verdict::Drop)]));
    let e = ns.netlink(&bad).unwrap_err().to_string();
    assert!(e.contains("line 4"), "{e}");
    assert!(e.contains("delete chain ip t no-such-chain"), "{e}");
    assert_eq!(
        ns.ruleset(),
        before,
        "a failed transaction must change nothing"
    );
    // A rule jumping to a missing chain fails too, at its own line.
    let mut bad = Transaction::new(IpFamily::V4, "t");
    bad.add_rule("services", r(vec![v(jump("nowhere"))]));
    let e = ns.netlink(&bad).unwrap_err().to_string();
    assert!(e.contains("line 1") && e.contains("jump nowhere"), "{e}");
    assert_eq!(ns.ruleset(), before);
    // `create` of something that exists fails; `add` does not.
    let mut again = Transaction::new(IpFamily::V4, "t");
    again.create(chain("services"));
    let e = ns.netlink(&again).unwrap_err().to_string();
    assert!(e.contains("File exists"), "{e}");
    assert!(ns.nft_tx(&again).is_err());
    again.ops[0].verb = Verb::Add;
    ns.netlink(&again).unwrap();
    assert_eq!(ns.ruleset(), before);
}

#[test]
fn table_exists_follows_the_kernel() {
    let ns = Ns::new("tex");
    ns.run(|| {
        let mut b = NftNetlink::new();
        assert!(!b.table_exists(IpFamily::V4, "t").unwrap());
        let mut t = Transaction::new(IpFamily::V4, "t");
        t.add(table(None));
        b.apply(&t).unwrap();
        assert!(b.table_exists(IpFamily::V4, "t").unwrap());
        assert!(!b.table_exists(IpFamily::V6, "t").unwrap());
        let mut t = Transaction::new(IpFamily::V4, "t");
        t.delete(table(None));
        b.apply(&t).unwrap();
        assert!(!b.table_exists(IpFamily::V4, "t").unwrap());
    });
}

/// The canary chain check sees a missing table, a missing chain and an emptied
/// table (`nft flush table`), through netlink and through the `nft` program.
#[test]
fn canary_chain_check_sees_flushed_and_missing_rules() {
    let ns = Ns::new("cny");
    ns.run(|| {
        let mut backends: Vec<Box<dyn NftBackend>> =
            vec![Box::new(NftNetlink::new()), Box::new(NftCli::default())];
        let tx = |f: &dyn Fn(&mut Transaction)| {
            let mut t = Transaction::new(IpFamily::V4, "t");
            f(&mut t);
            t
        };
        for b in backends.iter_mut() {
            assert!(!b.chain_has_rules(IpFamily::V4, "t", "nat").unwrap());
            b.apply(&tx(&|t| {
                t.add(table(None)).add(chain("nat")).add(chain("services"));
            }))
            .unwrap();
            assert!(!b.chain_has_rules(IpFamily::V4, "t", "nat").unwrap());
            b.apply(&tx(&|t| {
                t.add_rule("nat", r(vec![v(jump("services"))]));
            }))
            .unwrap();
            assert!(b.chain_has_rules(IpFamily::V4, "t", "nat").unwrap());
            assert!(!b.chain_has_rules(IpFamily::V4, "t", "other").unwrap());
            assert!(!b.chain_has_rules(IpFamily::V6, "t", "nat").unwrap());
            b.apply(&tx(&|t| {
                t.flush(table(None));
            }))
            .unwrap();
            assert!(!b.chain_has_rules(IpFamily::V4, "t", "nat").unwrap());
            b.apply(&tx(&|t| {
                t.delete(table(None));
            }))
            .unwrap();
        }
    });
}

/// `nft list ruleset`'s output of one namespace, loaded with `nft -f` into
/// a fresh one, lists the same: what an operator saves, restores or edits
/// and reloads is what was installed. `tag` names the fresh namespace.
fn loads_back(listing: &str, tag: &str) {
    let c = Ns::new(tag);
    let path = std::env::temp_dir().join(format!("kp-nft-loadback-{}.nft", c.0));
    std::fs::write(&path, listing).unwrap();
    let loaded = c.nft(&["-f", path.to_str().unwrap_or_default()]);
    let _ = std::fs::remove_file(&path);
    if let Err(e) = loaded {
        panic!("{tag}: nft -f refused the listing: {e}\n{listing}");
    }
    assert_eq!(
        c.ruleset(),
        listing,
        "{tag}: the listing loads back differently"
    );
}

/// The `nft` program backend, as `KUBE_PROXY_RS_NFT_BACKEND=nft` selects.
fn nft_cli() -> Box<dyn NftBackend> {
    Box::new(NftCli::default())
}

fn cfg(family: IpFamily) -> ProxierConfig {
    let mut c = ProxierConfig::new(family);
    c.local_detector = match family {
        IpFamily::V4 => LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().unwrap()]),
        IpFamily::V6 => LocalDetector::Cidrs(vec!["fd00:244::/64".parse().unwrap()]),
    };
    c.service_cidrs = vec![
        "10.96.0.0/12".parse().unwrap(),
        "fd00:96::/108".parse().unwrap(),
    ];
    c
}

fn kinds() -> Vec<serde_json::Value> {
    let mut v = vec![
        service("plain", "10.96.0.10", json!({})),
        endpoints(
            "plain",
            &[ready("10.244.1.2", "node1"), ready("10.244.2.2", "node2")],
        ),
        service("noeps", "10.96.0.11", json!({})),
        service(
            "np",
            "10.96.0.12",
            json!({"type": "NodePort", "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}]}),
        ),
        endpoints("np", &[ready("10.244.2.3", "node2")]),
        service(
            "local",
            "10.96.0.13",
            json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 32000,
            "loadBalancerSourceRanges": ["203.0.113.0/24", "198.51.100.0/25"],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30081}]}),
        ),
        endpoints(
            "local",
            &[ready("10.244.1.4", "node1"), ready("10.244.2.4", "node2")],
        ),
        service(
            "aff",
            "10.96.0.14",
            json!({"sessionAffinity": "ClientIP", "externalIPs": ["198.51.100.7"]}),
        ),
        endpoints(
            "aff",
            &[ready("10.244.1.5", "node1"), ready("10.244.2.5", "node2")],
        ),
        service(
            "itp",
            "10.96.0.15",
            json!({"internalTrafficPolicy": "Local"}),
        ),
        endpoints("itp", &[ready("10.244.2.6", "node2")]),
    ];
    v[5]["status"] = json!({"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}});
    v
}

/// The proxier's own transactions (full, partial, deletion, forced full
/// resync) through netlink and through `nft` list the same after each step.
#[test]
fn proxier_syncs_through_netlink_as_through_nft() {
    let a = Ns::new("pxa");
    let b = Ns::new("pxb");
    let mut t = tracker(IpFamily::V4);
    apply(&mut t, &kinds());
    let mut pa = NftablesProxier::new(cfg(IpFamily::V4), Box::new(NftNetlink::new()));
    let mut pb = NftablesProxier::new(cfg(IpFamily::V4), nft_cli());
    let mut step = |name: &str, st: &kp_model::ProxyState, changed: &BTreeSet<_>, full: bool| {
        let rb = b
            .run(|| pb.sync(st, changed, full))
            .unwrap_or_else(|e| panic!("{name}: nft: {e}"));
        let ra = a
            .run(|| pa.sync(st, changed, full))
            .unwrap_or_else(|e| panic!("{name}: netlink: {e}"));
        assert_eq!(ra.full, rb.full);
        let (la, lb) = (a.ruleset(), b.ruleset());
        assert!(la.contains("table ip kube-proxy-rs"), "{name}: {la}");
        assert_eq!(la, lb, "{name}: netlink and nft rulesets differ");
        loads_back(&la, "pxc");
        la
    };
    let st = t.state().clone();
    let first = step("first full sync", &st, &BTreeSet::new(), false);
    assert!(first.contains("numgen random mod 2 offset"), "{first}");
    // The kernel lists sets in the order they were made, which is the
    // order it walks them to find the one a rule names: the affinity set,
    // named twice by each affinity rule, comes before the endpoint maps.
    let at = |what: &str| {
        first
            .find(what)
            .unwrap_or_else(|| panic!("no {what}: {first}"))
    };
    assert!(
        at("set affinity-10800 ") < at("map endpoints-tcp-0 "),
        "affinity set after the endpoint maps: {first}"
    );

    let cs = apply(
        &mut t,
        &[endpoints(
            "plain",
            &[ready("10.244.1.2", "node1"), ready("10.244.2.9", "node2")],
        )],
    );
    let st = t.state().clone();
    let l = step("endpoint change", &st, &cs.changed, false);
    assert!(l.contains("10.244.2.9 . 8080"), "{l}");

    // Deleting a Service without an external chain (one with an external chain
    // trips a proxier ordering bug that `nft -f` rejects as well).
    t.delete_service("default", "plain", std::time::SystemTime::now());
    let cs = t.take_changes();
    let st = t.state().clone();
    let l = step("service deletion", &st, &cs.changed, false);
    assert!(!l.contains("10.96.0.10"), "{l}");

    let st = t.state().clone();
    step("forced full resync", &st, &BTreeSet::new(), true);

    a.run(|| pa.cleanup()).unwrap();
    assert!(!a.ruleset().contains("kube-proxy-rs"));
}

#[test]
fn v6_proxier_syncs_through_netlink_as_through_nft() {
    let a = Ns::new("p6a");
    let b = Ns::new("p6b");
    let mut t = tracker(IpFamily::V6);
    apply(
        &mut t,
        &[
            service(
                "plain",
                "fd00:96::10",
                json!({"sessionAffinity": "ClientIP", "ipFamilies": ["IPv6"]}),
            ),
            endpoints(
                "plain",
                &[ready("fd00:244::2", "node1"), ready("fd00:245::2", "node2")],
            ),
            service(
                "lb",
                "fd00:96::11",
                json!({"type": "LoadBalancer", "ipFamilies": ["IPv6"], "loadBalancerSourceRanges": ["2001:db8::/64"],
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30081}]}),
            ),
            endpoints(
                "lb",
                &[ready("fd00:244::3", "node1"), ready("fd00:245::3", "node2")],
            ),
        ],
    );
    let st = t.state().clone();
    let mut pa = NftablesProxier::new(cfg(IpFamily::V6), Box::new(NftNetlink::new()));
    let mut pb = NftablesProxier::new(cfg(IpFamily::V6), nft_cli());
    a.run(|| pa.sync(&st, &BTreeSet::new(), false)).unwrap();
    b.run(|| pb.sync(&st, &BTreeSet::new(), false)).unwrap();
    let (la, lb) = (a.ruleset(), b.ruleset());
    // Two endpoints: a rule per index and the pick.
    assert_eq!(la.matches("update @affinity-10800 ").count(), 3, "{la}");
    assert!(la.contains("table ip6 kube-proxy-rs"), "{la}");
    assert!(la.contains("fd00:244::2"), "{la}");
    assert_eq!(la, lb);
    loads_back(&la, "p6c");
}

/// Services that between them make the renderer emit every rule shape, set,
/// map and element kind: ClusterIP with one and several endpoints, no
/// endpoints (reject), NodePort, LoadBalancer with one and several source
/// ranges and eTP=Local, externalIPs, session affinity with one and several
/// endpoints, iTP=Local, UDP and SCTP.
fn every_kind(family: IpFamily) -> Vec<serde_json::Value> {
    type Cip = fn(u32) -> String;
    type Eip = fn(u32, u32) -> String;
    let (c, e, lb, ext, fam): (Cip, Eip, _, _, _) = match family {
        IpFamily::V4 => (
            |i: u32| format!("10.96.0.{i}"),
            |n: u32, i: u32| format!("10.244.{n}.{i}"),
            ["198.51.100.1", "198.51.100.2"],
            "198.51.100.7",
            "IPv4",
        ),
        IpFamily::V6 => (
            |i: u32| format!("fd00:96::{i:x}"),
            |n: u32, i: u32| format!("fd00:244:0:{n}::{i:x}"),
            ["2001:db8:100::1", "2001:db8:100::2"],
            "2001:db8:100::7",
            "IPv6",
        ),
    };
    let ranges_one = match family {
        IpFamily::V4 => json!(["203.0.113.0/24"]),
        IpFamily::V6 => json!(["2001:db8:1::/48"]),
    };
    let ranges_many = match family {
        IpFamily::V4 => json!(["203.0.113.0/24", "198.51.100.0/25", "192.0.2.7/32"]),
        IpFamily::V6 => json!(["2001:db8:1::/48", "2001:db8:2::/64", "2001:db8:3::7/128"]),
    };
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let ep = |n: u32, i: u32, node: &'static str| ready(leak(e(n, i)), node);
    let base = json!({"ipFamilies": [fam]});
    let with = |extra: serde_json::Value| {
        let mut b = base.clone();
        if let (Some(b), Some(x)) = (b.as_object_mut(), extra.as_object()) {
            for (k, v) in x {
                b.insert(k.clone(), v.clone());
            }
        }
        b
    };
    let port = |np: u32| json!([{"name": "http", "port": 80, "protocol": "TCP", "nodePort": np}]);
    let mut v = vec![
        service("plain", &c(10), with(json!({}))),
        endpoints("plain", &[ep(1, 2, "node1"), ep(2, 2, "node2")]),
        service("one", &c(9), with(json!({}))),
        endpoints("one", &[ep(2, 9, "node2")]),
        service("noeps", &c(11), with(json!({}))),
        service(
            "np",
            &c(12),
            with(json!({"type": "NodePort", "ports": port(30080)})),
        ),
        endpoints("np", &[ep(2, 3, "node2")]),
        service(
            "local",
            &c(13),
            with(
                json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 32000,
                "loadBalancerSourceRanges": ranges_many, "ports": port(30081)}),
            ),
        ),
        endpoints("local", &[ep(1, 4, "node1"), ep(2, 4, "node2")]),
        service(
            "lb1",
            &c(17),
            with(
                json!({"type": "LoadBalancer", "loadBalancerSourceRanges": ranges_one, "ports": port(30082)}),
            ),
        ),
        endpoints("lb1", &[ep(1, 7, "node1"), ep(2, 7, "node2")]),
        service(
            "nolocal",
            &c(18),
            with(
                json!({"type": "NodePort", "externalTrafficPolicy": "Local", "ports": port(30083)}),
            ),
        ),
        endpoints("nolocal", &[ep(2, 8, "node2")]),
        service(
            "aff",
            &c(14),
            with(json!({"sessionAffinity": "ClientIP", "externalIPs": [ext]})),
        ),
        endpoints("aff", &[ep(1, 5, "node1"), ep(2, 5, "node2")]),
        service(
            "aff1",
            &c(19),
            with(
                json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}}),
            ),
        ),
        endpoints("aff1", &[ep(1, 6, "node1")]),
        service(
            "itp",
            &c(15),
            with(json!({"internalTrafficPolicy": "Local"})),
        ),
        endpoints("itp", &[ep(2, 6, "node2")]),
        service(
            "udp",
            &c(16),
            with(
                json!({"type": "NodePort", "ports": [{"name": "http", "port": 53, "protocol": "UDP", "nodePort": 30053}]}),
            ),
        ),
    ];
    v[7]["status"] = json!({"loadBalancer": {"ingress": [{"ip": lb[0]}]}});
    v[9]["status"] = json!({"loadBalancer": {"ingress": [{"ip": lb[1]}]}});
    let mut udp = endpoints("udp", &[ep(1, 10, "node1"), ep(2, 10, "node2")]);
    udp["ports"] = json!([{"name": "http", "port": 53, "protocol": "UDP"}]);
    v.push(udp);
    let mut sctp = service(
        "sctp",
        &c(20),
        with(
            json!({"type": "NodePort", "ports": [{"name": "http", "port": 9000, "protocol": "SCTP", "nodePort": 30900}]}),
        ),
    );
    sctp["metadata"]["name"] = json!("sctp");
    v.push(sctp);
    let mut s = endpoints("sctp", &[ep(1, 11, "node1"), ep(2, 11, "node2")]);
    s["ports"] = json!([{"name": "http", "port": 9000, "protocol": "SCTP"}]);
    v.push(s);
    // Reached at their ClusterIP only: picked in the shared chains.
    for (name, ip, proto, port, n) in [
        ("dns", 21, "UDP", 5353, 12),
        ("assoc", 22, "SCTP", 9001, 13),
    ] {
        let ports = json!([{"name": "http", "port": port, "protocol": proto}]);
        v.push(service(name, &c(ip), with(json!({"ports": ports}))));
        let mut s = endpoints(name, &[ep(1, n, "node1"), ep(2, n, "node2")]);
        s["ports"] = ports;
        v.push(s);
    }
    v
}

/// Proxier configurations covering each local-detector kind, masquerade-all
/// and --nodeport-addresses, per family.
fn every_config(family: IpFamily) -> Vec<(&'static str, ProxierConfig)> {
    let base = cfg(family);
    let mut out = vec![("cidr", base.clone())];
    let mut c = base.clone();
    c.local_detector = LocalDetector::Cidrs(match family {
        IpFamily::V4 => vec![net("10.244.0.0/16"), net("10.250.0.0/15")],
        IpFamily::V6 => vec![net("fd00:244::/64"), net("fd00:245::/64")],
    });
    c.nodeport_addresses = vec![match family {
        IpFamily::V4 => net("192.168.1.0/24"),
        IpFamily::V6 => net("2001:db8:9::/64"),
    }];
    c.node_ips = vec![match family {
        IpFamily::V4 => ip("192.168.1.5"),
        IpFamily::V6 => ip("2001:db8:9::5"),
    }];
    out.push(("cidrs", c));
    let mut c = base.clone();
    c.local_detector = LocalDetector::BridgeInterface("cbr0".into());
    c.masquerade_all = true;
    out.push(("bridge", c));
    let mut c = base.clone();
    c.local_detector = LocalDetector::InterfaceNamePrefix("veth".into());
    out.push(("prefix", c));
    let mut c = base;
    c.local_detector = LocalDetector::None;
    out.push(("none", c));
    out
}

/// Every kind of object in `tx`, by name.
fn kinds_in(tx: &Transaction, seen: &mut HashSet<String>) {
    for op in &tx.ops {
        match &op.object {
            Object::Rule { rule, .. } => {
                for e in &rule.exprs {
                    seen.insert(format!("expr {}", e.kind()));
                }
                if rule.comment.is_some() {
                    seen.insert("comment".into());
                }
            }
            Object::Set(s) => {
                seen.insert(
                    format!("{:?}", s.ty)
                        .split([' ', '('])
                        .next()
                        .unwrap_or("")
                        .to_string(),
                );
                if let SetType::Typed {
                    key,
                    verdict_map,
                    timeout,
                } = &s.ty
                {
                    seen.insert(format!(
                        "set key {} map {verdict_map} timeout {}",
                        key.len(),
                        timeout.is_some()
                    ));
                }
                if let SetType::Numgen(v) = &s.ty {
                    seen.insert(format!("numgen map {v:?}"));
                }
                if let SetType::Select(p) = &s.ty {
                    seen.insert(format!("select map {p:?}"));
                }
            }
            Object::Chain(c) => {
                seen.insert(format!("chain base {}", c.base.is_some()));
            }
            Object::Elements { elems, .. } => {
                for (k, v) in elems {
                    let k = format!("{k:?}");
                    let v = match v {
                        None => "none".to_string(),
                        Some(ElemValue::Endpoint(_)) => "endpoint".to_string(),
                        Some(ElemValue::Verdict(v)) => {
                            format!("{v:?}").split('(').next().unwrap_or("").to_string()
                        }
                    };
                    let k = k.split(['(', ' ']).next().unwrap_or("");
                    seen.insert(format!("elem {k} -> {v}"));
                }
            }
            Object::Table { .. } => {}
        }
    }
}

/// The round trip: services exercising every shape the renderer emits, per
/// family and configuration, synced (full, partial, deletion, forced full)
/// through netlink in one namespace and through `nft -f` in another; after
/// each step the two kernels must list the same ruleset, and that listing,
/// loaded with `nft -f` into a third, must list the same again. A shape the
/// netlink encoder gets wrong lists differently (or is refused); one that
/// nft cannot read back fails the load.
#[test]
fn every_rendered_shape_lists_the_same_through_netlink_and_nft() {
    let mut seen = HashSet::new();
    for family in [IpFamily::V4, IpFamily::V6] {
        for (name, config) in every_config(family) {
            let tag = format!(
                "{}{}",
                if family == IpFamily::V4 { "4" } else { "6" },
                &name[..2]
            );
            let a = Ns::new(&format!("rt{tag}a"));
            let b = Ns::new(&format!("rt{tag}b"));
            let mut t = tracker(family);
            apply(&mut t, &every_kind(family));
            let mut pa = NftablesProxier::new(config.clone(), Box::new(NftNetlink::new()));
            let mut pb = NftablesProxier::new(config.clone(), nft_cli());
            kinds_in(&pa.full_transaction(t.state()), &mut seen);
            let mut step =
                |what: &str, st: &kp_model::ProxyState, changed: &BTreeSet<_>, full: bool| {
                    let ctx = format!("{family:?} {name}: {what}");
                    b.run(|| pb.sync(st, changed, full))
                        .unwrap_or_else(|e| panic!("{ctx}: nft: {e}"));
                    a.run(|| pa.sync(st, changed, full))
                        .unwrap_or_else(|e| panic!("{ctx}: netlink: {e}"));
                    let (la, lb) = (a.ruleset(), b.ruleset());
                    assert!(la.contains("kube-proxy-rs"), "{ctx}: {la}");
                    assert_eq!(la, lb, "{ctx}: netlink and nft rulesets differ");
                    loads_back(&la, &format!("rt{tag}c"));
                };
            let st = t.state().clone();
            step("first sync", &st, &BTreeSet::new(), false);
            let n = |i: u32| match family {
                IpFamily::V4 => format!("10.244.2.{}", 100 + i),
                IpFamily::V6 => format!("fd00:244:0:2::{:x}", 100 + i),
            };
            let (x, y) = (n(1), n(2));
            let mut aff = endpoints(
                "aff",
                &[ready(Box::leak(x.clone().into_boxed_str()), "node2")],
            );
            let mut plain = endpoints(
                "plain",
                &[
                    ready(Box::leak(y.into_boxed_str()), "node2"),
                    ready(Box::leak(x.into_boxed_str()), "node1"),
                    ready(Box::leak(n(3).into_boxed_str()), "node1"),
                ],
            );
            for o in [&mut aff, &mut plain] {
                o["metadata"]["name"] = json!(format!(
                    "{}-abc",
                    o["metadata"]["labels"]["kubernetes.io/service-name"]
                        .as_str()
                        .unwrap_or("")
                ));
            }
            let cs = apply(&mut t, &[aff, plain]);
            let st = t.state().clone();
            step("endpoint changes", &st, &cs.changed, false);
            t.delete_service("default", "local", std::time::SystemTime::now());
            t.delete_service("default", "aff1", std::time::SystemTime::now());
            let cs = t.take_changes();
            let st = t.state().clone();
            step("service deletions", &st, &cs.changed, false);
            step("forced full resync", &st, &BTreeSet::new(), true);
            a.run(|| pa.cleanup()).unwrap();
            assert!(!a.ruleset().contains("kube-proxy-rs"));
        }
    }
    let mut want: Vec<String> = [
        "ct",
        "addr",
        "prefix",
        "set-of-one",
        "interval-set",
        "l4proto",
        "iifname",
        "iifname-wildcard",
        "fib",
        "lookup",
        "vmap",
        "mark-match",
        "mark-set",
        "affinity-hit",
        "affinity-record",
        "hash-dnat",
        "numgen-dnat",
        "pick-dnat",
        "dnat",
        "masquerade",
        "reject",
        "verdict",
    ]
    .iter()
    .map(|k| format!("expr {k}"))
    .collect();
    want.extend(
        [
            "comment",
            "chain base true",
            "chain base false",
            "set key 1 map false timeout false",
            "set key 2 map false timeout false",
            "set key 3 map true timeout false",
            "set key 2 map true timeout false",
            "Records",
            "numgen map AddrPort(Tcp)",
            "numgen map AddrPort(Udp)",
            "numgen map AddrPort(Sctp)",
            "select map Tcp",
            "select map Udp",
            "select map Sctp",
            "elem Select -> endpoint",
            "elem IpProtoPort -> Goto",
            "elem IpProtoPort -> Drop",
            "elem ProtoPort -> Goto",
            "elem Ip -> none",
            "elem IpPair -> none",
            "elem Slot -> endpoint",
        ]
        .map(String::from),
    );
    let missing: Vec<&String> = want.iter().filter(|w| !seen.contains(*w)).collect();
    assert!(
        missing.is_empty(),
        "not exercised: {missing:?}\nseen: {seen:?}"
    );
}

/// Where the proxier put `aff`'s endpoints: (affinity id, index ->
/// endpoint), from the hit rules of its full transaction and the slots
/// they name.
fn affinity_places(tx: &Transaction) -> (u32, BTreeMap<u32, DnatTarget>) {
    let mut slots = HashMap::new();
    let mut hits = Vec::new();
    for op in &tx.ops {
        match &op.object {
            Object::Elements { elems, .. } => {
                for (k, v) in elems {
                    if let (ElemKey::Slot(n), Some(ElemValue::Endpoint(ep))) = (k, v) {
                        slots.insert(*n, *ep);
                    }
                }
            }
            Object::Rule { chain, rule } if chain.contains("/aff/") => {
                for e in &rule.exprs {
                    if let Expr::AffinityHit {
                        id, index, slots, ..
                    } = e
                    {
                        hits.push((*id, *index, slots.offset + index));
                    }
                }
            }
            _ => {}
        }
    }
    let id = hits.first().map(|h| h.0).expect("aff has hit rules");
    let places = hits.iter().map(|&(_, i, slot)| (i, slots[&slot])).collect();
    (id, places)
}

/// The records of the affinity set, read back over netlink, sorted.
fn read_records(ns: &Ns) -> Vec<ElemKey> {
    let mut r = ns
        .run(|| NftNetlink::new().affinity_records(IpFamily::V4, "kube-proxy-rs", "affinity-10800"))
        .unwrap();
    r.sort();
    r
}

/// Session-affinity records name an endpoint's index in its slots, so the
/// proxier keeps their meaning: removing an endpoint forgets exactly its
/// clients (read back over netlink: three clients per endpoint, as packets
/// would have left them) while the clients of an endpoint that moves to
/// the freed index follow it; replacing an endpoint forgets its clients
/// too, and the new one takes its index. Through either backend.
#[test]
fn removing_an_affinity_endpoint_forgets_only_its_clients() {
    forgets_only_its_clients("affgc", Box::new(NftNetlink::new()));
}

#[test]
fn removing_an_affinity_endpoint_forgets_only_its_clients_through_nft() {
    forgets_only_its_clients("affgcn", nft_cli());
}

fn forgets_only_its_clients(tag: &str, backend: Box<dyn NftBackend>) {
    let ns = Ns::new(tag);
    let mut t = tracker(IpFamily::V4);
    apply(&mut t, &kinds());
    let mut p = NftablesProxier::new(cfg(IpFamily::V4), backend);
    let st = t.state().clone();
    ns.run(|| p.sync(&st, &BTreeSet::new(), false)).unwrap();
    let (id, places) = affinity_places(&p.full_transaction(&st));
    assert_eq!(places.len(), 2, "{places:?}");
    let client = |i: u8| ip(&format!("10.244.9.{i}"));
    let record = |i: u8, index: u32| ElemKey::Affinity {
        client: client(i),
        id,
        index,
    };
    // Clients 1-3 on the endpoint that goes, 11-13 on the one that stays.
    // The one that goes is at index 0, so the other moves down to it.
    let (gone, stays) = (places[&0], places[&1]);
    let mut records = Vec::new();
    for i in 1..=3 {
        records.push(record(i, 0));
        records.push(record(10 + i, 1));
    }
    let mut tx = Transaction::new(IpFamily::V4, "kube-proxy-rs");
    tx.ops.push(kp_nftables::types::Op {
        verb: Verb::Add,
        object: Object::Elements {
            set: MapName::Affinity(10800),
            elems: records.iter().map(|k| (k.clone(), None)).collect(),
        },
    });
    ns.netlink(&tx).unwrap();
    let mut want = records.clone();
    want.sort();
    assert_eq!(read_records(&ns), want);

    let stays_ip: &'static str = Box::leak(stays.ip.to_string().into_boxed_str());
    let cs = apply(&mut t, &[endpoints("aff", &[ready(stays_ip, "node2")])]);
    let st = t.state().clone();
    ns.run(|| p.sync(&st, &cs.changed, false)).unwrap();
    let (_, places) = affinity_places(&p.full_transaction(&st));
    assert_eq!(places, BTreeMap::from([(0, stays)]));
    let want: Vec<ElemKey> = (11..=13).map(|i| record(i, 0)).collect();
    assert_eq!(
        read_records(&ns),
        want,
        "the clients of {gone:?} should be forgotten, those of {stays:?} moved to index 0"
    );

    // Replaced in place: a new endpoint at index 0, whose clients are new.
    let cs = apply(
        &mut t,
        &[endpoints("aff", &[ready("10.244.2.77", "node2")])],
    );
    let st = t.state().clone();
    ns.run(|| p.sync(&st, &cs.changed, false)).unwrap();
    let (_, places) = affinity_places(&p.full_transaction(&st));
    assert_eq!(places, BTreeMap::from([(0, sa("10.244.2.77:8080").into())]));
    assert_eq!(read_records(&ns), Vec::<ElemKey>::new());
}

/// A batch larger than one piece of the encoder's buffer (4 MiB) goes to the
/// kernel as one datagram in several pieces and is applied whole: the
/// kernel lists exactly as many elements as were sent.
#[test]
fn a_batch_of_several_pieces_is_one_transaction() {
    let n: u32 = 200_000;
    let mut t = Transaction::new(IpFamily::V4, "t");
    t.add(table(None)).add(typed(
        "big",
        vec![DType::Ipv4, DType::InetProto, DType::InetService],
        false,
        None,
    ));
    let key = |i: u32| {
        let ip = IpAddr::from((0x0a00_0000 + i / 7).to_be_bytes());
        (
            ElemKey::IpProtoPort(ip, Protocol::Tcp, (i % 7) as u16 + 1),
            None,
        )
    };
    let all: Vec<_> = (0..n).map(key).collect();
    for chunk in all.chunks(128) {
        t.add(elems(&"big", chunk.to_vec()));
    }
    let batch = NftNetlink::encode(&t).expect("encoding");
    assert!(
        batch.pieces().len() >= 2,
        "the test needs a batch of several pieces: {} bytes in {}",
        batch.bytes(),
        batch.pieces().len()
    );
    let ns = Ns::new("pieces");
    ns.netlink(&t).expect("the kernel took the batch");
    let listed = ns
        .nft(&["-j", "list", "set", "ip", "t", "big"])
        .expect("listing");
    let v: serde_json::Value = serde_json::from_str(&listed).expect("nft -j output");
    let count = v["nftables"]
        .as_array()
        .and_then(|a| a.iter().find_map(|o| o["set"]["elem"].as_array()))
        .map_or(0, Vec::len);
    assert_eq!(count, n as usize, "elements in the kernel");
}

/// A transaction long enough to be encoded on two threads (30k operations)
/// is one batch all the same: every chain and rule of both halves is in the
/// kernel, anonymous sets of both halves keep their own elements, and an
/// error in the second half names its own line.
#[test]
fn a_transaction_encoded_in_two_halves_applies_whole() {
    let n = 15_000;
    // An anonymous set in every 500th rule (each one walks the table's
    // sets when created; all 15k would take the kernel a minute).
    let src = |i: u32| {
        let ip = format!("10.1.{}.{}", i / 250, i % 250 + 1);
        if i % 500 == 499 {
            AddrValue::Set(vec![net(&format!("{ip}/32")), net("10.200.0.0/16")])
        } else {
            AddrValue::Ip(self::ip(&ip))
        }
    };
    let mut t = Transaction::new(IpFamily::V4, "t");
    t.add(table(None));
    for i in 0..n {
        let c = format!("c{i}");
        t.add(chain(&c));
        t.add_rule(
            c,
            r(vec![addr(Addr::Saddr, false, src(i)), v(Verdict::Drop)]),
        );
    }
    assert!(t.ops.len() >= 30_000);
    let ns = Ns::new("halves");
    ns.netlink(&t).expect("the kernel took the batch");
    let chains = ns.nft(&["list", "chains", "ip"]).expect("listing chains");
    assert_eq!(chains.matches("chain c").count(), n as usize);
    for i in [0, 499, n / 2 - 1, n / 2, n / 2 + 499, n - 1] {
        let listed = ns
            .nft(&["list", "chain", "ip", "t", &format!("c{i}")])
            .expect("listing a chain");
        let ip = format!("10.1.{}.{}", i / 250, i % 250 + 1);
        let want = if i % 500 == 499 {
            format!("ip saddr {{ {ip}, 10.200.0.0/16 }} drop")
        } else {
            format!("ip saddr {ip} drop")
        };
        assert!(
            listed.contains(&want),
            "chain c{i}: want `{want}` in\n{listed}"
        );
    }
    // The same transaction handed over (what a full sync does): each
    // operation is freed once encoded, and the kernel gets the same.
    let owned = Ns::new("halveso");
    owned
        .run(|| NftNetlink::new().apply_owned(t.clone()))
        .expect("the kernel took the batch");
    assert_eq!(owned.ruleset(), ns.ruleset());
    // A kernel refusal of a handed-over transaction names the line; its
    // text is gone (the proxier renders it again to name the owner).
    let mut refused = Transaction::new(IpFamily::V4, "t");
    refused.add(chain("c-new")).delete(chain("no-such-chain"));
    let e = owned
        .run(|| NftNetlink::new().apply_owned(refused))
        .unwrap_err();
    match &e {
        kp_model::DataplaneError::Refused { refused, .. } => {
            assert_eq!(refused.len(), 1, "{e}");
            assert_eq!(refused[0].line, 2, "{e}");
            assert_eq!(refused[0].text, None, "{e}");
        }
        _ => panic!("not a refusal: {e}"),
    }
    // An operation the encoder refuses, late in the second half.
    let bad_line = t.ops.len() - 3;
    t.ops[bad_line].object = Object::Rule {
        chain: "c1".into(),
        rule: r(vec![
            addr(Addr::Saddr, false, AddrValue::Ip(ip("::1"))),
            v(Verdict::Drop),
        ]),
    };
    let e = NftNetlink::check(&t).unwrap_err();
    assert_eq!(e.line, bad_line + 1, "{e}");
    // Handed over, the refused operation still has its text.
    let e = owned
        .run(|| NftNetlink::new().apply_owned(t))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("line {}", bad_line + 1)) && e.contains("::1"),
        "{e}"
    );
}

/// A backend that, while armed, spoils the first rule of a chain whose name
/// contains `part` (a jump to a chain that does not exist, at the same
/// line) before handing the transaction on: the kernel, or nft, refuses
/// that line.
struct Spoiler {
    inner: Box<dyn NftBackend>,
    part: &'static str,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Spoiler {
    fn spoil(&self, mut tx: Transaction) -> Transaction {
        if self.armed.load(std::sync::atomic::Ordering::SeqCst) {
            if let Some(rule) = tx.ops.iter_mut().find_map(|op| match &mut op.object {
                Object::Rule { chain, rule } if chain.contains(self.part) => Some(rule),
                _ => None,
            }) {
                *rule = r(vec![v(jump("nowhere"))]);
            }
        }
        tx
    }
}

impl NftBackend for Spoiler {
    fn apply(&mut self, tx: &Transaction) -> Result<usize, kp_model::DataplaneError> {
        let tx = self.spoil(tx.clone());
        self.inner.apply(&tx)
    }
    fn apply_owned(&mut self, tx: Transaction) -> Result<usize, kp_model::DataplaneError> {
        let tx = self.spoil(tx);
        self.inner.apply_owned(tx)
    }
    fn table_exists(
        &mut self,
        family: IpFamily,
        table: &str,
    ) -> Result<bool, kp_model::DataplaneError> {
        self.inner.table_exists(family, table)
    }
}

/// A refused transaction names the Service port whose rule was refused and
/// the rule, for a full sync (whose text the netlink backend frees as it
/// encodes) and a partial one, through either backend; nothing of it is
/// applied and the next sync goes through.
#[test]
fn a_refused_rule_names_its_service() {
    use std::sync::atomic::Ordering::SeqCst;
    for (tag, backend) in [
        ("refnl", Box::new(NftNetlink::new()) as Box<dyn NftBackend>),
        ("refnft", nft_cli()),
    ] {
        let ns = Ns::new(tag);
        let mut t = tracker(IpFamily::V4);
        apply(&mut t, &kinds());
        let armed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let spoiler = Spoiler {
            inner: backend,
            part: "-default/aff/tcp/",
            armed: armed.clone(),
        };
        let mut p = NftablesProxier::new(cfg(IpFamily::V4), Box::new(spoiler));
        let refused = |p: &mut NftablesProxier,
                       st: &kp_model::ProxyState,
                       changed: &BTreeSet<kp_model::ServicePortName>,
                       what: &str| {
            let before = ns.ruleset();
            let e = ns
                .run(|| p.sync(st, changed, false))
                .expect_err("the spoiled transaction was accepted");
            let text = e.to_string();
            assert!(
                matches!(e, kp_model::DataplaneError::Refused { .. }),
                "{tag} {what}: {text}"
            );
            assert!(
                text.contains("(Service port default/aff:http, chain service-")
                    && text.contains("-default/aff/tcp/http)"),
                "{tag} {what}: the error does not name the Service: {text}"
            );
            // The rule's text: as sent where the backend kept it, else as
            // the proxier renders it.
            assert!(
                text.contains(": `add rule ip kube-proxy-rs service-"),
                "{tag} {what}: {text}"
            );
            assert_eq!(
                ns.ruleset(),
                before,
                "{tag} {what}: a refused sync changed the kernel"
            );
        };
        let st = t.state().clone();
        refused(&mut p, &st, &BTreeSet::new(), "full sync");
        armed.store(false, SeqCst);
        ns.run(|| p.sync(&st, &BTreeSet::new(), false)).unwrap();
        assert!(ns.ruleset().contains("-default/aff/tcp/http"));
        // A third endpoint rewrites `aff`'s rules: a partial sync.
        let cs = apply(
            &mut t,
            &[endpoints(
                "aff",
                &[
                    ready("10.244.1.5", "node1"),
                    ready("10.244.2.5", "node2"),
                    ready("10.244.2.6", "node2"),
                ],
            )],
        );
        let st = t.state().clone();
        armed.store(true, SeqCst);
        refused(&mut p, &st, &cs.changed, "partial sync");
        armed.store(false, SeqCst);
        let r = ns.run(|| p.sync(&st, &cs.changed, false)).unwrap();
        assert!(r.full, "the sync after a refused one is a full sync");
        assert!(ns.ruleset().contains("10.244.2.6 . 8080"));
    }
}
