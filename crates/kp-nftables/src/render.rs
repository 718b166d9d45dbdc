//! Model -> nftables objects, per service port. Pure: no I/O.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use kp_model::{
    chain_hash, Endpoint, EndpointSelection, EndpointSet, IpFamily, NoEndpoints, NodeInfo,
    Protocol, ProxierConfig, ServicePort,
};

use crate::rule::{quote, Rule, Verdict, MARK_MASQ_CHAIN};

/// Our table, one per family (`ip` and `ip6`). Not upstream's `kube-proxy`, so
/// that the two never fight over one table during a migration.
pub const TABLE_NAME: &str = "kube-proxy-rs";

pub const REJECT_CHAIN: &str = "reject-chain";
pub const MAP_SERVICE_IPS: &str = "service-ips";
pub const MAP_SERVICE_NODEPORTS: &str = "service-nodeports";
pub const MAP_NO_EP_SERVICES: &str = "no-endpoint-services";
pub const MAP_NO_EP_NODEPORTS: &str = "no-endpoint-nodeports";
pub const MAP_FIREWALL_IPS: &str = "firewall-ips";
pub const SET_CLUSTER_IPS: &str = "cluster-ips";
pub const SET_NODEPORT_IPS: &str = "nodeport-ips";
pub const SET_HAIRPIN: &str = "hairpin";
/// Name of one of the table's sets or maps: a fixed one of the skeleton, or a
/// shard of the shared endpoint maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MapName {
    Fixed(&'static str),
    /// `endpoints-PROTO-N`: slot -> `address . port`, DNAT targets.
    Endpoints(Protocol, u32),
    /// `endpoint-chains-N`: slot -> `goto endpoint-…` (session affinity).
    EndpointChains(u32),
}

impl std::fmt::Display for MapName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MapName::Fixed(n) => f.write_str(n),
            MapName::Endpoints(p, k) => write!(f, "endpoints-{}-{k}", p.as_lower()),
            MapName::EndpointChains(k) => write!(f, "endpoint-chains-{k}"),
        }
    }
}

impl MapName {
    pub fn is_map(&self) -> bool {
        match self {
            MapName::Fixed(n) => Skeleton::is_map(n),
            _ => true,
        }
    }
}

/// Which shared endpoint maps a [`Pool`] lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    Endpoints(Protocol),
    EndpointChains,
}

impl PoolKind {
    pub fn shard(self, k: u32) -> MapName {
        match self {
            PoolKind::Endpoints(p) => MapName::Endpoints(p, k),
            PoolKind::EndpointChains => MapName::EndpointChains(k),
        }
    }
}

/// Key of a map or set element.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ElemKey {
    IpProtoPort(IpAddr, Protocol, u16),
    ProtoPort(Protocol, u16),
    Ip(IpAddr),
    /// `saddr . daddr` of the hairpin set: both the endpoint's IP.
    IpPair(IpAddr),
    /// A slot of the shared endpoint maps (written in hex, which marks a
    /// 32-bit integer key in our script grammar).
    Slot(u32),
}

impl ElemKey {
    pub fn text(&self) -> String {
        match self {
            ElemKey::IpProtoPort(ip, p, port) => format!("{ip} . {} . {port}", p.as_lower()),
            ElemKey::ProtoPort(p, port) => format!("{} . {port}", p.as_lower()),
            ElemKey::Ip(ip) => ip.to_string(),
            ElemKey::IpPair(ip) => format!("{ip} . {ip}"),
            ElemKey::Slot(n) => format!("0x{n:x}"),
        }
    }
}

/// What a map element maps its key to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ElemValue {
    Verdict(Verdict),
    /// DNAT target in the endpoint map.
    Endpoint(SocketAddr),
}

impl ElemValue {
    pub fn text(&self) -> String {
        match self {
            ElemValue::Verdict(v) => v.text(),
            ElemValue::Endpoint(a) => format!("{} . {}", a.ip(), a.port()),
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
            Some(v) => format!("{} : {}", self.key.text(), v.text()),
            None => self.key.text(),
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
    pub values: Vec<ElemValue>,
    pub map: MapName,
    pub base: u32,
    pub cap: u32,
}

/// Everything one service port owns in the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceObjects {
    /// Chain name -> its rules, in order.
    pub chains: Vec<(String, Vec<Rule>)>,
    /// Affinity sets (name, timeout seconds).
    pub affinity_sets: Vec<(String, u32)>,
    pub elements: Vec<Element>,
    /// Endpoint-map slot ranges the selection rules index into.
    pub pools: Vec<Pool>,
    /// eTP/iTP Local with no local endpoint (internal, external).
    pub no_local: (bool, bool),
}

fn proto_name(p: Protocol) -> &'static str {
    p.as_lower()
}

/// Readable, unique, nft-safe chain suffix, upstream style:
/// `HASH8-namespace/name/proto/port`.
fn chain_base(sp: &ServicePort) -> String {
    let h = chain_hash(&format!("{}{}", sp.name, proto_name(sp.protocol)));
    format!(
        "{}-{}/{}/{}/{}",
        &h[..8],
        sp.name.service.namespace,
        sp.name.service.name,
        proto_name(sp.protocol),
        sp.name.port
    )
}

/// The endpoint chain's name after `endpoint-` (upstream's shape: 8 hash
/// characters, the service port, the endpoint), and the whole 16-character
/// hash.
fn endpoint_chain_base(sp: &ServicePort, ep: &Endpoint) -> (String, String) {
    let epstr = ep.addr_string();
    let h = chain_hash(&format!("{}{}{}", sp.name, proto_name(sp.protocol), epstr));
    let ipname = ep.ip.to_string().replace(':', ".");
    let base = format!(
        "{}-{}/{}/{}/{}__{}/{}",
        &h[..8],
        sp.name.service.namespace,
        sp.name.service.name,
        proto_name(sp.protocol),
        sp.name.port,
        ipname,
        ep.port
    );
    (base, h)
}

/// Rules that pick an endpoint among `eps` and DNAT to it.
fn selection(
    sp: &ServicePort,
    eps: &[&Endpoint],
    chains: &mut Vec<(String, Vec<Rule>)>,
    sets: &mut Vec<(String, u32)>,
    pools: &mut Vec<Pool>,
) -> Vec<Rule> {
    let mut pool = |kind: PoolKind, values: Vec<ElemValue>| {
        pools.push(Pool {
            kind,
            values,
            map: kind.shard(0),
            base: 0,
            cap: 0,
        });
        pools.len() - 1
    };
    match sp.session_affinity_timeout {
        None if eps.len() == 1 => vec![Rule::Dnat {
            protocol: sp.protocol,
            endpoint: eps[0].socket_addr(),
        }],
        None => {
            let values = eps
                .iter()
                .map(|e| ElemValue::Endpoint(e.socket_addr()))
                .collect();
            let kind = PoolKind::Endpoints(sp.protocol);
            vec![Rule::NumgenDnat {
                protocol: sp.protocol,
                count: eps.len() as u32,
                pool: pool(kind, values),
                map: kind.shard(0),
                offset: 0,
            }]
        }
        Some(timeout) => {
            // Affinity needs to know which endpoint a client got: one chain and one
            // timeout set per endpoint, as upstream.
            let mut rules = Vec::new();
            let mut targets = Vec::new();
            // Endpoint chains are shared by the cluster and local selections.
            let mut made: std::collections::HashSet<String> =
                chains.iter().map(|(c, _)| c.clone()).collect();
            for ep in eps {
                let (base, hash) = endpoint_chain_base(sp, ep);
                let chain = format!("endpoint-{base}");
                // The timeout is part of the name: a set cannot change its timeout in
                // place, and a new name lets one transaction swap it. The name is
                // short on purpose: the kernel finds a set by walking the table's
                // sets and comparing names (strlen of each), so at 25k affinity
                // sets long names were a large part of a full sync. The hash's
                // first 8 characters are those of the endpoint chain's name.
                let set = format!("affinity-{timeout}-{hash}");
                if made.insert(chain.clone()) {
                    chains.push((
                        chain.clone(),
                        vec![
                            Rule::AffinityUpdate { set: set.clone() },
                            Rule::Dnat {
                                protocol: sp.protocol,
                                endpoint: SocketAddr::new(ep.ip, ep.port),
                            },
                        ],
                    ));
                    sets.push((set.clone(), timeout));
                }
                rules.push(Rule::AffinityCheck {
                    set,
                    target: chain.clone(),
                });
                targets.push(chain);
            }
            if targets.len() == 1 {
                rules.push(Rule::Verdict {
                    verdict: Verdict::Goto(targets.remove(0)),
                    comment: "one endpoint".into(),
                });
            } else {
                let count = targets.len() as u32;
                let values = targets
                    .into_iter()
                    .map(|t| ElemValue::Verdict(Verdict::Goto(t)))
                    .collect();
                rules.push(Rule::NumgenGoto {
                    count,
                    pool: pool(PoolKind::EndpointChains, values),
                    map: PoolKind::EndpointChains.shard(0),
                    offset: 0,
                });
            }
            rules
        }
    }
}

/// Renders one service port. Mirrors upstream's nftables syncProxyRules, with
/// endpoints chosen inside one `numgen ... map @endpoints` DNAT rule instead of
/// a chain per endpoint (except for session affinity, which needs per-endpoint
/// state). Pool slots are left for the proxier to assign.
pub fn render_service(
    sp: &ServicePort,
    endpoints: &[Endpoint],
    cfg: &ProxierConfig,
    node: &NodeInfo,
) -> ServiceObjects {
    let cat = EndpointSelection::new(sp, endpoints, node);
    let base = chain_base(sp);
    let svc_chain = format!("service-{base}");
    let local_chain = format!("local-{base}");
    let ext_chain = format!("external-{base}");
    let fw_chain = format!("firewall-{base}");
    let mut out = ServiceObjects::default();
    let mut ep_chains: Vec<(String, Vec<Rule>)> = Vec::new();

    let internal_chain = match cat.internal {
        EndpointSet::Cluster => &svc_chain,
        EndpointSet::Local => &local_chain,
    };
    out.no_local = cat.no_local();

    let masq_rule = Rule::MarkMasqUnlessLocal {
        ip: sp.cluster_ip,
        protocol: sp.protocol,
        port: sp.port,
        detector: cfg.local_detector.clone(),
        masquerade_all: cfg.masquerade_all,
    };
    if !cat.cluster.is_empty() {
        let mut rules = Vec::new();
        if !sp.internal_policy_local {
            rules.push(masq_rule.clone());
        }
        rules.extend(selection(
            sp,
            &cat.cluster,
            &mut ep_chains,
            &mut out.affinity_sets,
            &mut out.pools,
        ));
        out.chains.push((svc_chain.clone(), rules));
    }
    if cat.has_local() {
        let mut rules = Vec::new();
        if sp.internal_policy_local {
            rules.push(masq_rule);
        }
        rules.extend(selection(
            sp,
            &cat.local,
            &mut ep_chains,
            &mut out.affinity_sets,
            &mut out.pools,
        ));
        out.chains.push((local_chain.clone(), rules));
    }

    let has_external = cat.has_external();
    if has_external {
        let mut rules = Vec::new();
        if sp.external_policy_local {
            if !cat.cluster.is_empty() {
                rules.push(Rule::GotoIfFromCluster {
                    detector: cfg.local_detector.clone(),
                    target: svc_chain.clone(),
                });
                rules.push(Rule::NodeLocalToCluster {
                    target: svc_chain.clone(),
                });
            }
            rules.push(Rule::Verdict {
                verdict: Verdict::Goto(local_chain.clone()),
                comment: "local endpoints only".into(),
            });
        } else {
            rules.push(Rule::MarkMasq);
            rules.push(Rule::Verdict {
                verdict: Verdict::Goto(svc_chain.clone()),
                comment: "cluster endpoints".into(),
            });
        }
        out.chains.push((ext_chain.clone(), rules));
    }
    out.chains.extend(ep_chains);

    // Where traffic with no usable endpoint goes: reject when the service has
    // none anywhere, drop when it has some but not for this traffic's policy.
    let no_ep_verdict = match cat.no_endpoints() {
        NoEndpoints::Drop => Verdict::Drop,
        NoEndpoints::Reject => Verdict::Goto(REJECT_CHAIN.into()),
    };
    let key = |ip: IpAddr| ElemKey::IpProtoPort(ip, sp.protocol, sp.port);

    out.elements.push(Element {
        map: MapName::Fixed(SET_CLUSTER_IPS),
        key: ElemKey::Ip(sp.cluster_ip),
        value: None,
    });
    if !cat.has_internal() {
        out.elements.push(Element {
            map: MapName::Fixed(MAP_NO_EP_SERVICES),
            key: key(sp.cluster_ip),
            value: Some(ElemValue::Verdict(no_ep_verdict.clone())),
        });
    } else {
        out.elements.push(Element {
            map: MapName::Fixed(MAP_SERVICE_IPS),
            key: key(sp.cluster_ip),
            value: Some(ElemValue::Verdict(Verdict::Goto(internal_chain.clone()))),
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
        if has_external {
            out.elements.push(Element {
                map: MapName::Fixed(MAP_SERVICE_IPS),
                key: key(*ip),
                value: Some(ElemValue::Verdict(Verdict::Goto(ext_chain.clone()))),
            });
        } else {
            out.elements.push(Element {
                map: MapName::Fixed(MAP_NO_EP_SERVICES),
                key: key(*ip),
                value: Some(ElemValue::Verdict(no_ep_verdict.clone())),
            });
        }
    }
    if sp.node_port != 0 {
        let k = ElemKey::ProtoPort(sp.protocol, sp.node_port);
        if has_external {
            out.elements.push(Element {
                map: MapName::Fixed(MAP_SERVICE_NODEPORTS),
                key: k,
                value: Some(ElemValue::Verdict(Verdict::Goto(ext_chain.clone()))),
            });
        } else {
            out.elements.push(Element {
                map: MapName::Fixed(MAP_NO_EP_NODEPORTS),
                key: k,
                value: Some(ElemValue::Verdict(no_ep_verdict.clone())),
            });
        }
    }
    if !sp.load_balancer_source_ranges.is_empty() && !sp.load_balancer_ips.is_empty() {
        out.chains.push((
            fw_chain.clone(),
            vec![Rule::DropUnlessSource {
                ranges: sp.load_balancer_source_ranges.clone(),
            }],
        ));
        for ip in &sp.load_balancer_ips {
            out.elements.push(Element {
                map: MapName::Fixed(MAP_FIREWALL_IPS),
                key: key(*ip),
                value: Some(ElemValue::Verdict(Verdict::Goto(fw_chain.clone()))),
            });
        }
    }
    let mut hp: Vec<IpAddr> = cat
        .all_reachable
        .iter()
        .filter(|e| e.is_local)
        .map(|e| e.ip)
        .collect();
    hp.sort();
    hp.dedup();
    out.elements.extend(hp.into_iter().map(|ip| Element {
        map: MapName::Fixed(SET_HAIRPIN),
        key: ElemKey::IpPair(ip),
        value: None,
    }));
    out
}

/// The fixed part of the table: base chains hooked into netfilter, helper
/// chains, and the global sets and maps the per-service objects fill.
pub struct Skeleton {
    pub family: IpFamily,
    /// (name, declaration inside `{ }` or empty for a regular chain, rules).
    pub chains: Vec<(&'static str, String, Vec<String>)>,
    /// (name, declaration).
    pub sets: Vec<(&'static str, String)>,
    /// Static elements of `nodeport-ips`.
    pub nodeport_ips: Vec<IpAddr>,
}

impl Skeleton {
    pub fn new(cfg: &ProxierConfig) -> Skeleton {
        let fam = cfg.family;
        let (ip, addr_t, lo) = match fam {
            IpFamily::V4 => ("ip", "ipv4_addr", "127.0.0.0/8"),
            IpFamily::V6 => ("ip6", "ipv6_addr", "::1"),
        };
        let mark = format!("0x{:x}", cfg.masquerade_mark());
        let base = |hook: &str, ty: &str, prio: i32| {
            format!("type {ty} hook {hook} priority {prio} ; policy accept ;")
        };
        let nodeport_match = if cfg.nodeport_addresses.is_empty() {
            format!("fib daddr type local {ip} daddr != {lo}")
        } else {
            format!("{ip} daddr @{SET_NODEPORT_IPS}")
        };
        let nodeport_ips: Vec<IpAddr> = cfg
            .node_ips
            .iter()
            .filter(|a| cfg.nodeport_addresses.iter().any(|n| n.contains(*a)))
            .copied()
            .collect();
        let mut services_rules = vec![format!(
            "{ip} daddr . meta l4proto . th dport vmap @{MAP_SERVICE_IPS}"
        )];
        services_rules.push(format!(
            "{nodeport_match} meta l4proto . th dport vmap @{MAP_SERVICE_NODEPORTS}"
        ));
        let mut cluster_check = vec![format!(
            "{ip} daddr @{SET_CLUSTER_IPS} reject comment \"reject traffic to invalid ports of ClusterIPs\""
        )];
        for cidr in cfg.service_cidrs.iter().filter(|n| {
            matches!(
                (fam, n),
                (IpFamily::V4, ipnet::IpNet::V4(_)) | (IpFamily::V6, ipnet::IpNet::V6(_))
            )
        }) {
            cluster_check.push(format!(
                "{ip} daddr {cidr} drop comment \"drop traffic to unallocated ClusterIPs\""
            ));
        }
        let chains = vec![
            (
                "filter-prerouting",
                base("prerouting", "filter", -110),
                vec!["ct state new jump firewall-check".to_string()],
            ),
            (
                "filter-input",
                base("input", "filter", -110),
                vec![
                    "ct state new jump nodeport-endpoints-check".to_string(),
                    "ct state new jump service-endpoints-check".to_string(),
                ],
            ),
            (
                "filter-forward",
                base("forward", "filter", -110),
                vec![
                    // Out-of-window TCP packets marked INVALID would otherwise be
                    // forwarded un-NATed and reset the connection (upstream's
                    // conntrack e2e "invalid state" case).
                    "ct state invalid drop".to_string(),
                    "ct state new jump service-endpoints-check".to_string(),
                    "ct state new jump cluster-ips-check".to_string(),
                ],
            ),
            (
                "filter-output",
                base("output", "filter", -110),
                vec![
                    "ct state new jump service-endpoints-check".to_string(),
                    "ct state new jump firewall-check".to_string(),
                ],
            ),
            (
                "filter-output-post-dnat",
                base("output", "filter", -90),
                vec!["ct state new jump cluster-ips-check".to_string()],
            ),
            (
                "nat-prerouting",
                base("prerouting", "nat", -100),
                vec!["jump services".to_string()],
            ),
            (
                "nat-output",
                base("output", "nat", -100),
                vec!["jump services".to_string()],
            ),
            (
                "nat-postrouting",
                base("postrouting", "nat", 100),
                vec!["jump masquerading".to_string()],
            ),
            (
                MARK_MASQ_CHAIN,
                String::new(),
                vec![format!("meta mark set meta mark or {mark}")],
            ),
            (
                "masquerading",
                String::new(),
                vec![
                    format!(
                        "{ip} saddr . {ip} daddr @{SET_HAIRPIN} masquerade fully-random comment \"hairpin: a pod reached itself through a Service\""
                    ),
                    format!("meta mark and {mark} == 0 return"),
                    format!("meta mark set meta mark xor {mark}"),
                    "masquerade fully-random".to_string(),
                ],
            ),
            ("services", String::new(), services_rules),
            (
                "firewall-check",
                String::new(),
                vec![format!(
                    "{ip} daddr . meta l4proto . th dport vmap @{MAP_FIREWALL_IPS}"
                )],
            ),
            (REJECT_CHAIN, String::new(), vec!["reject".to_string()]),
            (
                "service-endpoints-check",
                String::new(),
                vec![format!(
                    "{ip} daddr . meta l4proto . th dport vmap @{MAP_NO_EP_SERVICES}"
                )],
            ),
            (
                "nodeport-endpoints-check",
                String::new(),
                vec![format!(
                    "{nodeport_match} meta l4proto . th dport vmap @{MAP_NO_EP_NODEPORTS}"
                )],
            ),
            ("cluster-ips-check", String::new(), cluster_check),
        ];
        let ipp = format!("type {addr_t} . inet_proto . inet_service : verdict ;");
        let sets = vec![
            (SET_CLUSTER_IPS, format!("type {addr_t} ;")),
            (SET_NODEPORT_IPS, format!("type {addr_t} ;")),
            (SET_HAIRPIN, format!("type {addr_t} . {addr_t} ;")),
            (MAP_SERVICE_IPS, ipp.clone()),
            (
                MAP_SERVICE_NODEPORTS,
                "type inet_proto . inet_service : verdict ;".to_string(),
            ),
            (MAP_NO_EP_SERVICES, ipp.clone()),
            (
                MAP_NO_EP_NODEPORTS,
                "type inet_proto . inet_service : verdict ;".to_string(),
            ),
            (MAP_FIREWALL_IPS, ipp),
        ];
        Skeleton {
            family: fam,
            chains,
            sets,
            nodeport_ips,
        }
    }

    pub fn is_map(name: &str) -> bool {
        matches!(
            name,
            MAP_SERVICE_IPS
                | MAP_SERVICE_NODEPORTS
                | MAP_NO_EP_SERVICES
                | MAP_NO_EP_NODEPORTS
                | MAP_FIREWALL_IPS
        )
    }
}

pub(crate) fn family_kw(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

pub(crate) fn comment(s: &str) -> String {
    quote(s)
}
