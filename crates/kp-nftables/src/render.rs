//! Model -> nftables objects, per service port. Pure: no I/O.

use std::collections::BTreeSet;
use std::net::IpAddr;

use kp_model::{
    chain_hash, ClusterIpMasquerading, Endpoint, EndpointSelection, EndpointSet,
    ExternalMasquerading, IpFamily, NoEndpoints, NodeInfo, Protocol, ProxierConfig, ServicePort,
};

use crate::names::{
    affinity_set_name, ServiceChains, CLUSTER_IPS_CHECK, FILTER_FORWARD, FILTER_INPUT,
    FILTER_OUTPUT, FILTER_OUTPUT_POST_DNAT, FILTER_PREROUTING, FIREWALL_CHECK, MAP_FIREWALL_IPS,
    MAP_NO_EP_NODEPORTS, MAP_NO_EP_SERVICES, MAP_SERVICE_IPS, MAP_SERVICE_NODEPORTS,
    MARK_MASQ_CHAIN, MASQUERADING, NAT_OUTPUT, NAT_POSTROUTING, NAT_PREROUTING,
    NODEPORT_ENDPOINTS_CHECK, REJECT_CHAIN, SERVICES, SERVICE_ENDPOINTS_CHECK, SET_CLUSTER_IPS,
    SET_HAIRPIN, SET_NODEPORT_IPS,
};
use crate::rule;
use crate::types::{
    Addr, AddrValue, BaseChain, ChainType, CtState, DType, DnatTarget, Expr, Hook, KeyField,
    MarkOp, NumgenValue, PickKey, Rule, Set, SetType, Slots, Verdict,
};
pub use crate::types::{ElemKey, ElemValue, MapName};

/// Which shared endpoint maps a [`Pool`] lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    Endpoints(Protocol),
}

impl PoolKind {
    pub fn shard(self, k: u32) -> MapName {
        match self {
            PoolKind::Endpoints(p) => MapName::Endpoints(p, k),
        }
    }
}

/// One element of one of the table's global sets or maps.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Element {
    pub map: MapName,
    pub key: ElemKey,
    /// None for set elements.
    pub value: Option<ElemValue>,
}

impl Element {
    pub fn text(&self) -> String {
        match &self.value {
            Some(v) => format!("{} : {v}", self.key),
            None => self.key.to_string(),
        }
    }
}

/// A run of slots in a shared endpoint map that one rule picks from. The
/// renderer fills `kind` and `values`; the proxier picks the map shard, `base`
/// and `cap` (a power of two, so freed ranges are easy to reuse) and writes
/// the elements.
///
/// Why shards: the kernel checks every new map element against every rule
/// bound to the map, so one map shared by all Services makes a full sync
/// quadratic (elements x rules). A shard serves a bounded number of rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    pub kind: PoolKind,
    /// The DNAT targets, in slot order.
    pub values: Vec<DnatTarget>,
    pub map: MapName,
    pub base: u32,
    pub cap: u32,
    /// A session-affinity selection's: clients are recorded by index in
    /// `values`, so the proxier keeps each endpoint at its index while it
    /// stays (see [`PoolAffinity`]).
    pub affinity: Option<PoolAffinity>,
}

/// Whose records index into a pool: the records' timeout (their set's
/// name) and the selection's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolAffinity {
    pub timeout: u32,
    pub id: u32,
}

/// A Service port picked in a shared `pick-PROTO-N-S` chain: its endpoints
/// at indexes 0..N under its ClusterIP and port in `select-PROTO-K-S`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pick {
    pub protocol: Protocol,
    pub ip: IpAddr,
    pub port: u16,
    /// The DNAT targets, in index order (N = their count).
    pub values: Vec<DnatTarget>,
}

impl Pick {
    pub fn count(&self) -> u32 {
        self.values.len() as u32
    }

    /// The shared chain it is picked in.
    pub fn key(&self) -> PickKey {
        PickKey::of(self.protocol, self.count(), self.ip, self.port)
    }

    /// Its elements in the select map.
    pub fn elements(&self) -> impl Iterator<Item = Element> + '_ {
        let map = self.key().map();
        self.values.iter().enumerate().map(move |(j, v)| Element {
            map,
            key: ElemKey::Select {
                ip: self.ip,
                port: self.port,
                index: j as u32,
            },
            value: Some(ElemValue::Endpoint(*v)),
        })
    }
}

/// Everything one service port owns in the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceObjects {
    /// Chain name -> its rules, in order.
    pub chains: Vec<(String, Vec<Rule>)>,
    /// The timeouts (seconds) of the shared affinity sets this service port
    /// uses (a set's name is derived from its timeout).
    pub affinity_sets: Vec<u32>,
    pub elements: Vec<Element>,
    /// Endpoint-map slot ranges the selection rules index into.
    pub pools: Vec<Pool>,
    /// Selections made in a shared chain (at most one: the ClusterIP's).
    pub picks: Vec<Pick>,
    /// eTP/iTP Local with no local endpoint (internal, external).
    pub no_local: (bool, bool),
}

/// The id of the selection made in `chain` (a service port's `service-…` or
/// `local-…` chain) in affinity records: 32 bits of the SHA-256 behind
/// chain names, so stable across restarts and versions. Two selections
/// whose ids collide share records by index, which can only make a client
/// stick to an endpoint of the selection it is in (each rule checks its own
/// indexes).
fn affinity_id(chain: &str) -> u32 {
    let h = chain_hash(chain);
    h.bytes().take(7).fold(0u32, |acc, c| {
        let digit = match c {
            b'A'..=b'Z' => c - b'A',
            b'2'..=b'7' => c - b'2' + 26,
            _ => 0,
        };
        (acc << 5) | u32::from(digit)
    })
}

/// Rules that pick an endpoint among `eps` in chain `chain` and DNAT to it.
fn selection(
    sp: &ServicePort,
    chain: &str,
    eps: &[&Endpoint],
    sets: &mut Vec<u32>,
    pools: &mut Vec<Pool>,
) -> Vec<Rule> {
    if eps.len() == 1 && sp.session_affinity_timeout.is_none() {
        return vec![rule::dnat(sp.protocol, eps[0].socket_addr())];
    }
    let kind = PoolKind::Endpoints(sp.protocol);
    let affinity = sp.session_affinity_timeout.map(|timeout| PoolAffinity {
        timeout,
        id: affinity_id(chain),
    });
    pools.push(Pool {
        kind,
        values: eps.iter().map(|e| e.socket_addr().into()).collect(),
        map: kind.shard(0),
        base: 0,
        cap: 0,
        affinity,
    });
    let slots = Slots {
        pool: pools.len() - 1,
        map: kind.shard(0),
        offset: 0,
    };
    let count = eps.len() as u32;
    let Some(PoolAffinity { timeout, id }) = affinity else {
        return vec![rule::numgen_dnat(sp.protocol, count, slots)];
    };
    // Session affinity without a chain per endpoint (upstream has one, and
    // a set per endpoint): one record set per timeout for every Service,
    // keyed by client, selection and the endpoint's index in the slots, and
    // one rule per index. Rules name indexes, not endpoints, so replacing
    // an endpoint is element updates only (with a rule per endpoint it
    // added a rule, and every added rule makes the kernel validate the
    // whole table: 0.4 s at 50k Services). The kernel finds a set by
    // walking the table's sets by name, so a set per endpoint also made a
    // full sync quadratic (81 s at 50k Services with 5% affinity).
    if !sets.contains(&timeout) {
        sets.push(timeout);
    }
    let records = MapName::Affinity(timeout);
    let mut rules: Vec<Rule> = (0..count)
        .map(|index| rule::affinity_hit(sp.protocol, records, id, index, slots))
        .collect();
    // A new client: its index recorded, then (a rule of its own, so that
    // a full set, where the record fails, still serves it, as upstream's
    // separate update and DNAT rules do) the DNAT to that index.
    rules.push(rule::affinity_record(sp.protocol, records, id, count));
    rules.push(rule::hash_dnat(sp.protocol, id, count, slots));
    rules
}

/// Renders one service port. Mirrors upstream's nftables syncProxyRules, with
/// endpoints chosen inside one `numgen ... map @endpoints` DNAT rule instead of
/// a chain per endpoint (session affinity: a rule per index of those slots).
/// Pool slots are left for the proxier to assign.
pub fn render_service(
    sp: &ServicePort,
    endpoints: &[Endpoint],
    cfg: &ProxierConfig,
    node: &NodeInfo,
) -> ServiceObjects {
    let cat = EndpointSelection::new(sp, endpoints, node);
    let ServiceChains {
        service: svc_chain,
        local: local_chain,
        external: ext_chain,
        firewall: fw_chain,
    } = ServiceChains::of(sp);
    let mut out = ServiceObjects::default();

    let internal_chain = match cat.internal {
        EndpointSet::Cluster => &svc_chain,
        EndpointSet::Local => &local_chain,
    };
    out.no_local = cat.no_local();

    let has_external = cat.has_external();
    // External traffic that falls through the chain is dropped by the
    // no-endpoint maps.
    let uses_external_chain = cat.uses_external_chain();
    // A Service reached only at its ClusterIP, without session affinity,
    // needs no chain of its own: its ClusterIP goes to the shared chain
    // for its endpoint count, which picks by the address and port the
    // packet asked for. Its changes are then map elements only, and the
    // table holds far fewer chains (every commit walks them all).
    let shared = sp.session_affinity_timeout.is_none() && !uses_external_chain;

    // No per-chain "mark for masquerade unless from the cluster" rule here:
    // one rule before the dispatch does it for every ClusterIP (Skeleton).
    if !shared && !cat.cluster.is_empty() {
        let rules = selection(
            sp,
            &svc_chain,
            &cat.cluster,
            &mut out.affinity_sets,
            &mut out.pools,
        );
        out.chains.push((svc_chain.clone(), rules));
    }
    if !shared && cat.has_local() {
        let rules = selection(
            sp,
            &local_chain,
            &cat.local,
            &mut out.affinity_sets,
            &mut out.pools,
        );
        out.chains.push((local_chain.clone(), rules));
    }

    if uses_external_chain {
        let mut rules = Vec::new();
        match cat.external_masquerading() {
            ExternalMasquerading::All => rules.push(rule::mark_masq()),
            ExternalMasquerading::FromNode => {
                rules.extend(rule::goto_if_from_cluster(
                    cfg.family,
                    &cfg.local_detector,
                    &svc_chain,
                ));
                rules.extend(rule::node_local_to_cluster(&svc_chain));
            }
            ExternalMasquerading::Never => {}
        }
        if has_external {
            rules.push(match cat.external {
                EndpointSet::Cluster => rule::verdict(
                    Verdict::Goto(svc_chain.as_str().into()),
                    "cluster endpoints",
                ),
                EndpointSet::Local => rule::verdict(
                    Verdict::Goto(local_chain.as_str().into()),
                    "local endpoints only",
                ),
            });
        }
        out.chains.push((ext_chain.clone(), rules));
    }

    // Where traffic with no usable endpoint goes: reject when the service has
    // none anywhere, drop when it has some but not for this traffic's policy.
    let no_ep_verdict = match cat.no_endpoints() {
        NoEndpoints::Drop => Verdict::Drop,
        NoEndpoints::Reject => Verdict::Goto(REJECT_CHAIN.into()),
    };
    let key = |ip: IpAddr| ElemKey::IpProtoPort(ip, sp.protocol, sp.port);

    out.elements.push(Element {
        map: MapName::Fixed(&SET_CLUSTER_IPS),
        key: ElemKey::Ip(sp.cluster_ip),
        value: None,
    });
    if !cat.has_internal() {
        out.elements.push(Element {
            map: MapName::Fixed(&MAP_NO_EP_SERVICES),
            key: key(sp.cluster_ip),
            value: Some(ElemValue::Verdict(no_ep_verdict.clone())),
        });
    } else {
        let target = if shared {
            let pick = Pick {
                protocol: sp.protocol,
                ip: sp.cluster_ip,
                port: sp.port,
                values: cat
                    .internal_endpoints()
                    .iter()
                    .map(|e| e.socket_addr().into())
                    .collect(),
            };
            let chain = pick.key().chain();
            out.picks.push(pick);
            chain
        } else {
            internal_chain.clone()
        };
        out.elements.push(Element {
            map: MapName::Fixed(&MAP_SERVICE_IPS),
            key: key(sp.cluster_ip),
            value: Some(ElemValue::Verdict(Verdict::Goto(target.into()))),
        });
    }
    let external_ips: BTreeSet<IpAddr> = sp
        .external_ips
        .iter()
        .chain(sp.load_balancer_ips.iter())
        .copied()
        .filter(|ip| *ip != sp.cluster_ip)
        .collect();
    for ip in &external_ips {
        if uses_external_chain {
            out.elements.push(Element {
                map: MapName::Fixed(&MAP_SERVICE_IPS),
                key: key(*ip),
                value: Some(ElemValue::Verdict(Verdict::Goto(ext_chain.as_str().into()))),
            });
        }
        if !has_external {
            out.elements.push(Element {
                map: MapName::Fixed(&MAP_NO_EP_SERVICES),
                key: key(*ip),
                value: Some(ElemValue::Verdict(no_ep_verdict.clone())),
            });
        }
    }
    if sp.node_port != 0 {
        let k = ElemKey::ProtoPort(sp.protocol, sp.node_port);
        if uses_external_chain {
            out.elements.push(Element {
                map: MapName::Fixed(&MAP_SERVICE_NODEPORTS),
                key: k.clone(),
                value: Some(ElemValue::Verdict(Verdict::Goto(ext_chain.as_str().into()))),
            });
        }
        if !has_external {
            out.elements.push(Element {
                map: MapName::Fixed(&MAP_NO_EP_NODEPORTS),
                key: k,
                value: Some(ElemValue::Verdict(no_ep_verdict.clone())),
            });
        }
    }
    if !sp.load_balancer_source_ranges.is_empty() && !sp.load_balancer_ips.is_empty() {
        out.chains.push((
            fw_chain.clone(),
            vec![rule::drop_unless_source(
                sp.load_balancer_source_ranges.clone(),
            )],
        ));
        for ip in &sp.load_balancer_ips {
            out.elements.push(Element {
                map: MapName::Fixed(&MAP_FIREWALL_IPS),
                key: key(*ip),
                value: Some(ElemValue::Verdict(Verdict::Goto(fw_chain.as_str().into()))),
            });
        }
    }
    let mut hp: Vec<IpAddr> = cat.hairpin().map(|e| e.ip).collect();
    hp.sort();
    hp.dedup();
    out.elements.extend(hp.into_iter().map(|ip| Element {
        map: MapName::Fixed(&SET_HAIRPIN),
        key: ElemKey::IpPair(ip),
        value: None,
    }));
    out
}

/// The fixed part of the table: base chains hooked into netfilter, helper
/// chains, and the global sets and maps the per-service objects fill.
pub struct Skeleton {
    pub family: IpFamily,
    /// (name, hook for a base chain, rules).
    pub chains: Vec<(&'static str, Option<BaseChain>, Vec<Rule>)>,
    pub sets: Vec<Set>,
    /// Static elements of `nodeport-ips`.
    pub nodeport_ips: Vec<IpAddr>,
}

fn jump(chain: &str) -> Expr {
    Expr::Verdict(Verdict::Jump(chain.into()))
}

/// `ct state new jump CHAIN`
fn new_jump(chain: &str) -> Rule {
    Rule::new(vec![Expr::Ct(CtState::New), jump(chain)])
}

/// `ip daddr . meta l4proto . th dport vmap @MAP`
fn dispatch(map: &str) -> Expr {
    Expr::Vmap {
        key: vec![
            KeyField::Addr(Addr::Daddr),
            KeyField::L4Proto,
            KeyField::ThDport,
        ],
        map: map.into(),
    }
}

impl Skeleton {
    pub fn new(cfg: &ProxierConfig) -> Skeleton {
        let fam = cfg.family;
        // Loopback: 127.0.0.0/8, ::1.
        let lo_value = match fam {
            IpFamily::V4 => AddrValue::Net(ipnet::IpNet::V4(ipnet::Ipv4Net::new_assert(
                std::net::Ipv4Addr::new(127, 0, 0, 0),
                8,
            ))),
            IpFamily::V6 => AddrValue::Ip(std::net::Ipv6Addr::LOCALHOST.into()),
        };
        let mark = cfg.masquerade_mark();
        let base =
            |hook: Hook, ty: ChainType, priority: i32| Some(BaseChain { ty, hook, priority });
        let nodeport_match: Vec<Expr> = if cfg.nodeport_addresses.is_empty() {
            vec![
                Expr::FibLocal(Addr::Daddr),
                Expr::AddrMatch {
                    field: Addr::Daddr,
                    neg: true,
                    value: lo_value,
                },
            ]
        } else {
            vec![rule::daddr_in(SET_NODEPORT_IPS)]
        };
        let nodeport_dispatch = |map: &str| {
            let mut e = nodeport_match.clone();
            e.push(Expr::Vmap {
                key: vec![KeyField::L4Proto, KeyField::ThDport],
                map: map.into(),
            });
            Rule::new(e)
        };
        // The set is only consulted with a list; without one `fib` decides.
        let nodeport_ips: Vec<IpAddr> = if cfg.nodeport_addresses.is_empty() {
            Vec::new()
        } else {
            cfg.node_ips
                .iter()
                .filter(|a| cfg.serves_nodeports(a))
                .copied()
                .collect()
        };
        let services_rules: Vec<Rule> = rule::mark_masq_clusterip(
            fam,
            &cfg.local_detector,
            ClusterIpMasquerading::of(cfg),
            SET_CLUSTER_IPS,
        )
        .into_iter()
        .chain([
            Rule::new(vec![dispatch(MAP_SERVICE_IPS)]),
            nodeport_dispatch(MAP_SERVICE_NODEPORTS),
        ])
        .collect();
        let mut cluster_check = vec![Rule::new(vec![
            rule::daddr_in(SET_CLUSTER_IPS),
            Expr::Reject,
        ])
        .comment("reject traffic to invalid ports of ClusterIPs")];
        for cidr in cfg.service_cidrs.iter().filter(|n| {
            matches!(
                (fam, n),
                (IpFamily::V4, ipnet::IpNet::V4(_)) | (IpFamily::V6, ipnet::IpNet::V6(_))
            )
        }) {
            cluster_check.push(
                Rule::new(vec![
                    Expr::AddrMatch {
                        field: Addr::Daddr,
                        neg: false,
                        value: AddrValue::Net(*cidr),
                    },
                    Expr::Verdict(Verdict::Drop),
                ])
                .comment("drop traffic to unallocated ClusterIPs"),
            );
        }
        let chains = vec![
            (
                FILTER_PREROUTING,
                base(Hook::Prerouting, ChainType::Filter, -110),
                vec![new_jump(FIREWALL_CHECK)],
            ),
            (
                FILTER_INPUT,
                base(Hook::Input, ChainType::Filter, -110),
                vec![
                    new_jump(NODEPORT_ENDPOINTS_CHECK),
                    new_jump(SERVICE_ENDPOINTS_CHECK),
                ],
            ),
            (
                FILTER_FORWARD,
                base(Hook::Forward, ChainType::Filter, -110),
                // No `ct state invalid drop`: upstream's nftables mode has
                // none (kubernetes#122663); it dropped traffic that
                // multi-homed and asymmetric-routing nodes forward.
                vec![
                    new_jump(SERVICE_ENDPOINTS_CHECK),
                    new_jump(CLUSTER_IPS_CHECK),
                ],
            ),
            (
                FILTER_OUTPUT,
                base(Hook::Output, ChainType::Filter, -110),
                vec![new_jump(SERVICE_ENDPOINTS_CHECK), new_jump(FIREWALL_CHECK)],
            ),
            (
                FILTER_OUTPUT_POST_DNAT,
                base(Hook::Output, ChainType::Filter, -90),
                vec![new_jump(CLUSTER_IPS_CHECK)],
            ),
            (
                NAT_PREROUTING,
                base(Hook::Prerouting, ChainType::Nat, -100),
                vec![Rule::new(vec![jump(SERVICES)])],
            ),
            (
                NAT_OUTPUT,
                base(Hook::Output, ChainType::Nat, -100),
                vec![Rule::new(vec![jump(SERVICES)])],
            ),
            (
                NAT_POSTROUTING,
                base(Hook::Postrouting, ChainType::Nat, 100),
                vec![Rule::new(vec![jump(MASQUERADING)])],
            ),
            (
                MARK_MASQ_CHAIN,
                None,
                vec![Rule::new(vec![Expr::MarkSet(MarkOp::Or, mark)])],
            ),
            (
                MASQUERADING,
                None,
                vec![
                    Rule::new(vec![
                        Expr::Lookup {
                            key: vec![KeyField::Addr(Addr::Saddr), KeyField::Addr(Addr::Daddr)],
                            set: SET_HAIRPIN.into(),
                        },
                        Expr::Masquerade { fully_random: true },
                    ])
                    .comment("hairpin: a pod reached itself through a Service"),
                    Rule::new(vec![
                        Expr::MarkMatch {
                            mask: mark,
                            neg: false,
                            value: 0,
                        },
                        Expr::Verdict(Verdict::Return),
                    ]),
                    Rule::new(vec![Expr::MarkSet(MarkOp::Xor, mark)]),
                    Rule::new(vec![Expr::Masquerade { fully_random: true }]),
                ],
            ),
            (SERVICES, None, services_rules),
            (
                FIREWALL_CHECK,
                None,
                vec![Rule::new(vec![dispatch(MAP_FIREWALL_IPS)])],
            ),
            (REJECT_CHAIN, None, vec![Rule::new(vec![Expr::Reject])]),
            (
                SERVICE_ENDPOINTS_CHECK,
                None,
                vec![Rule::new(vec![dispatch(MAP_NO_EP_SERVICES)])],
            ),
            (
                NODEPORT_ENDPOINTS_CHECK,
                None,
                vec![nodeport_dispatch(MAP_NO_EP_NODEPORTS)],
            ),
            (CLUSTER_IPS_CHECK, None, cluster_check),
        ];
        let addr = DType::addr(fam);
        let set = |name: &str, key: Vec<DType>, verdict_map: bool| Set {
            name: name.into(),
            ty: SetType::Typed {
                key,
                verdict_map,
                timeout: None,
            },
        };
        let ipp = vec![addr, DType::InetProto, DType::InetService];
        let pp = vec![DType::InetProto, DType::InetService];
        let sets = vec![
            set(SET_CLUSTER_IPS, vec![addr], false),
            set(SET_NODEPORT_IPS, vec![addr], false),
            set(SET_HAIRPIN, vec![addr, addr], false),
            set(MAP_SERVICE_IPS, ipp.clone(), true),
            set(MAP_SERVICE_NODEPORTS, pp.clone(), true),
            set(MAP_NO_EP_SERVICES, ipp.clone(), true),
            set(MAP_NO_EP_NODEPORTS, pp, true),
            set(MAP_FIREWALL_IPS, ipp, true),
        ];
        Skeleton {
            family: fam,
            chains,
            sets,
            nodeport_ips,
        }
    }
}

/// The declaration of an endpoint-map shard.
pub fn shard_set(m: MapName) -> Set {
    // Only endpoint maps are sharded; the protocol is in their name.
    let proto = match m {
        MapName::Endpoints(proto, _) => proto,
        _ => Protocol::Tcp,
    };
    Set {
        name: m.to_string(),
        ty: SetType::Numgen(NumgenValue::AddrPort(proto)),
    }
}

/// The declaration of a `select-PROTO-K-S` map.
pub fn select_set(m: MapName) -> Set {
    let proto = match m {
        MapName::Select(proto, ..) => proto,
        _ => Protocol::Tcp,
    };
    Set {
        name: m.to_string(),
        ty: SetType::Select(proto),
    }
}

/// A shared pick chain with its one rule.
pub fn pick_chain_rules(key: PickKey) -> (String, Vec<Rule>) {
    (key.chain(), vec![rule::pick_dnat(key)])
}

/// The declaration of the shared session-affinity set of one timeout.
pub fn affinity_set(timeout: u32) -> Set {
    Set {
        name: affinity_set_name(timeout),
        ty: SetType::Records { timeout },
    }
}

/// The chains of our table a packet on `route` traverses, in order (base
/// chains, then this service port's own), for `kube-proxy-rs explain` to
/// look up in the kernel. Names come from [`render_service`] itself, so they
/// are exactly the ones a sync installs.
pub fn packet_chains(
    sp: &ServicePort,
    endpoints: &[Endpoint],
    cfg: &ProxierConfig,
    node: &NodeInfo,
    route: &kp_model::explain::Route,
) -> Vec<String> {
    use kp_model::explain::{Action, MatchKind};
    let objs = render_service(sp, endpoints, cfg, node);
    let chains = ServiceChains::of(sp);
    let own = |c: String| objs.chains.iter().any(|(n, _)| *n == c).then_some(c);
    let mut out: Vec<String> = Vec::new();
    if route.kind == MatchKind::LoadBalancerIngress && !sp.load_balancer_source_ranges.is_empty() {
        let hook = if route.from_node {
            FILTER_OUTPUT
        } else {
            FILTER_PREROUTING
        };
        out.extend([hook.to_string(), FIREWALL_CHECK.to_string()]);
        out.extend(own(chains.firewall));
    }
    match route.action {
        Action::Dnat => {
            let hook = if route.from_node {
                NAT_OUTPUT
            } else {
                NAT_PREROUTING
            };
            out.extend([hook.to_string(), SERVICES.to_string()]);
            if route.kind.is_external() {
                out.extend(own(chains.external));
            }
            out.extend(own(match route.set {
                EndpointSet::Cluster => chains.service,
                EndpointSet::Local => chains.local,
            }));
            // A Service picked in a shared chain (ClusterIP traffic only).
            if !route.kind.is_external() {
                out.extend(objs.picks.iter().map(|p| p.key().chain()));
            }
        }
        Action::Drop | Action::Reject => {
            // Traffic without endpoints is stopped in the filter chains by
            // the no-endpoint maps (source-range drops stop above).
            if !route.source_ranges_drop {
                let hook = if route.from_node {
                    FILTER_OUTPUT
                } else {
                    FILTER_INPUT
                };
                let check = if route.kind == MatchKind::NodePort {
                    NODEPORT_ENDPOINTS_CHECK
                } else {
                    SERVICE_ENDPOINTS_CHECK
                };
                out.extend([hook.to_string(), check.to_string()]);
                if route.action == Action::Reject {
                    out.push(REJECT_CHAIN.to_string());
                }
            }
        }
        Action::Untouched => {}
    }
    out
}
