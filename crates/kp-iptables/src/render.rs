//! Model -> typed iptables rules, per service port. Pure: no I/O.
//!
//! Follows upstream's pkg/proxy/iptables/proxier.go syncProxyRules: the same
//! chain names (so tools and people that know kube-proxy find their way), the
//! same rule order and comments; each rule's text ([`Rule`]'s `Display`) is
//! upstream's, option for option.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::IpNet;
use kp_model::{
    chain_hash, ClusterIpMasquerading, Endpoint, EndpointSelection, EndpointSet,
    ExternalMasquerading, IpFamily, LocalDetector, NoEndpoints, NodeInfo, ProxierConfig,
    ServicePort,
};
use kp_xtables::Jump;

use crate::types::{
    Addr, Iface, Match, Recent, Rule, Target, CT_DNAT, CT_ESTABLISHED, CT_INVALID, CT_RELATED,
};

pub const SERVICES_CHAIN: &str = "KUBE-SERVICES";
pub const EXTERNAL_CHAIN: &str = "KUBE-EXTERNAL-SERVICES";
pub const NODEPORTS_CHAIN: &str = "KUBE-NODEPORTS";
pub const POSTROUTING_CHAIN: &str = "KUBE-POSTROUTING";
pub const MARK_MASQ_CHAIN: &str = "KUBE-MARK-MASQ";
pub const FORWARD_CHAIN: &str = "KUBE-FORWARD";
pub const FIREWALL_CHAIN: &str = "KUBE-PROXY-FIREWALL";
pub const CANARY_CHAIN: &str = "KUBE-PROXY-CANARY";

/// Prefixes of the per-service and per-endpoint chains (all in nat).
pub const SERVICE_CHAIN_PREFIXES: [&str; 5] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
];

/// Our fixed chains per table; the per-service ones are recognised by prefix.
pub const NAT_CHAINS: [&str; 4] = [
    SERVICES_CHAIN,
    NODEPORTS_CHAIN,
    POSTROUTING_CHAIN,
    MARK_MASQ_CHAIN,
];
pub const FILTER_CHAINS: [&str; 5] = [
    SERVICES_CHAIN,
    EXTERNAL_CHAIN,
    FORWARD_CHAIN,
    NODEPORTS_CHAIN,
    FIREWALL_CHAIN,
];
pub const MANGLE_CHAINS: [&str; 1] = [CANARY_CHAIN];

/// True for a chain this dataplane creates in `table` (and so may delete).
pub fn is_our_chain(table: &str, chain: &str) -> bool {
    match table {
        "nat" => {
            NAT_CHAINS.contains(&chain)
                || SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
        }
        "filter" => FILTER_CHAINS.contains(&chain),
        "mangle" => MANGLE_CHAINS.contains(&chain),
        _ => false,
    }
}

fn jump(
    table: &'static str,
    from: &'static str,
    to: &'static str,
    comment: &'static str,
    new_only: bool,
) -> Jump {
    Jump {
        table,
        from,
        to,
        comment,
        new_only,
    }
}

/// Every jump we install, in upstream's order.
pub fn jumps() -> Vec<Jump> {
    let ext = "kubernetes externally-visible service portals";
    let portals = "kubernetes service portals";
    let fw = "kubernetes load balancer firewall";
    vec![
        jump("filter", "INPUT", EXTERNAL_CHAIN, ext, true),
        jump("filter", "FORWARD", EXTERNAL_CHAIN, ext, true),
        jump(
            "filter",
            "INPUT",
            NODEPORTS_CHAIN,
            "kubernetes health check service ports",
            false,
        ),
        jump("filter", "FORWARD", SERVICES_CHAIN, portals, true),
        jump("filter", "OUTPUT", SERVICES_CHAIN, portals, true),
        jump(
            "filter",
            "FORWARD",
            FORWARD_CHAIN,
            "kubernetes forwarding rules",
            false,
        ),
        jump("filter", "INPUT", FIREWALL_CHAIN, fw, true),
        jump("filter", "OUTPUT", FIREWALL_CHAIN, fw, true),
        jump("filter", "FORWARD", FIREWALL_CHAIN, fw, true),
        jump("nat", "OUTPUT", SERVICES_CHAIN, portals, false),
        jump("nat", "PREROUTING", SERVICES_CHAIN, portals, false),
        jump(
            "nat",
            "POSTROUTING",
            POSTROUTING_CHAIN,
            "kubernetes postrouting rules",
            false,
        ),
    ]
}

/// Everything one service port contributes to the ruleset.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceRules {
    /// nat chains this service port owns (KUBE-SVC/SVL/EXT/FW/SEP), with rules.
    pub nat_chains: Vec<(String, Vec<Rule>)>,
    /// Its rules in nat KUBE-SERVICES.
    pub nat_services: Vec<Rule>,
    /// Its rules in nat KUBE-NODEPORTS.
    pub nat_nodeports: Vec<Rule>,
    /// filter KUBE-SERVICES (no endpoints for the cluster IP).
    pub filter_services: Vec<Rule>,
    /// filter KUBE-EXTERNAL-SERVICES (no endpoints for external traffic).
    pub filter_external: Vec<Rule>,
    /// filter KUBE-PROXY-FIREWALL (loadBalancerSourceRanges).
    pub filter_firewall: Vec<Rule>,
    /// filter KUBE-NODEPORTS (health check node port accepted).
    pub filter_nodeports: Vec<Rule>,
    /// eTP/iTP Local with no local endpoint (internal, external).
    pub no_local: (bool, bool),
}

impl ServiceRules {
    pub fn chain_names(&self) -> impl Iterator<Item = &str> {
        self.nat_chains.iter().map(|(c, _)| c.as_str())
    }

    /// Whether both put the same rules into the top-level chains (those
    /// every Service shares: KUBE-SERVICES, KUBE-NODEPORTS, ...).
    pub fn same_top_level(&self, other: &ServiceRules) -> bool {
        self.nat_services == other.nat_services
            && self.nat_nodeports == other.nat_nodeports
            && self.filter_services == other.filter_services
            && self.filter_external == other.filter_external
            && self.filter_firewall == other.filter_firewall
            && self.filter_nodeports == other.filter_nodeports
    }
}

/// `KUBE-SVC-` + upstream's hash of `servicePortName + protocol`.
pub fn svc_chain(sp: &ServicePort) -> String {
    format!("KUBE-SVC-{}", port_hash(sp))
}

fn port_hash(sp: &ServicePort) -> String {
    chain_hash(&port_key(sp))
}

/// `KUBE-SEP-` + upstream's hash of `servicePortName + protocol + endpoint`.
pub fn sep_chain(sp: &ServicePort, ep: &Endpoint) -> String {
    sep_chain_of(&port_key(sp), &ep.addr_string())
}

/// `servicePortName + protocol`: what upstream hashes for KUBE-SVC and the
/// other per-port chains, and what each KUBE-SEP hash starts with.
fn port_key(sp: &ServicePort) -> String {
    format!("{}{}", sp.name, sp.protocol.as_lower())
}

fn sep_chain_of(prefix: &str, addr: &str) -> String {
    let mut input = String::with_capacity(prefix.len() + addr.len());
    input.push_str(prefix);
    input.push_str(addr);
    format!("KUBE-SEP-{}", chain_hash(&input))
}

fn same_family(fam: IpFamily, n: &IpNet) -> bool {
    matches!(
        (fam, n),
        (IpFamily::V4, IpNet::V4(_)) | (IpFamily::V6, IpNet::V6(_))
    )
}

/// The match for "from inside the cluster" (`negate`: from outside); None when
/// the detector knows nothing. iptables cannot OR CIDRs in one `-s`, so like
/// upstream only the first CIDR of the family counts.
pub fn local_match(fam: IpFamily, d: &LocalDetector, negate: bool) -> Option<Match> {
    let iface = |name: &str, prefix| {
        Match::In(Iface {
            negate,
            name: name.to_string(),
            prefix,
        })
    };
    match d {
        LocalDetector::None => None,
        LocalDetector::Cidrs(c) => c
            .iter()
            .find(|n| same_family(fam, n))
            .map(|n| Match::Src(Addr::new(negate, *n))),
        LocalDetector::BridgeInterface(i) => Some(iface(i, false)),
        LocalDetector::InterfaceNamePrefix(p) => Some(iface(p, true)),
    }
}

/// What the node, not the configuration, decides about the rules; upstream
/// reads both at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRules {
    /// Drop `ctstate INVALID` in KUBE-FORWARD: only while
    /// nf_conntrack_tcp_be_liberal is 0 (with it set conntrack stops
    /// marking out-of-window packets INVALID, kubernetes#120412).
    pub invalid_drop: bool,
    /// The nfacct counters exist: the INVALID drop and localhost NodePort
    /// rules count into them (`-m nfacct`).
    pub nfacct: bool,
}

impl Default for HostRules {
    /// be_liberal 0 and no nfacct: the drop without a counter.
    fn default() -> Self {
        HostRules {
            invalid_drop: true,
            nfacct: false,
        }
    }
}

/// Renders one service port, as upstream's syncProxyRules loop body, with
/// [`HostRules::default`].
pub fn render_service(
    sp: &ServicePort,
    endpoints: &[Endpoint],
    cfg: &ProxierConfig,
    node: &NodeInfo,
) -> ServiceRules {
    render_service_with(sp, endpoints, cfg, node, &HostRules::default())
}

/// A rule whose first match is the comment `text`, then `rest`.
fn commented(
    text: impl Into<String>,
    rest: impl IntoIterator<Item = Match>,
    target: Target,
) -> Rule {
    let mut matches = vec![Match::comment(text)];
    matches.extend(rest);
    Rule::new(matches, target)
}

/// [`render_service`] for a node with `host`'s settings.
pub fn render_service_with(
    sp: &ServicePort,
    endpoints: &[Endpoint],
    cfg: &ProxierConfig,
    node: &NodeInfo,
    node_rules: &HostRules,
) -> ServiceRules {
    let fam = cfg.family;
    let sel = EndpointSelection::new(sp, endpoints, node);
    let key = port_key(sp);
    let hash = chain_hash(&key);
    let svc = format!("KUBE-SVC-{hash}");
    let svl = format!("KUBE-SVL-{hash}");
    let ext = format!("KUBE-EXT-{hash}");
    let fw = format!("KUBE-FW-{hash}");
    let name = sp.name.to_string();
    // `-m P -p P [-d DST] [--dport N]`
    let ports = |dst: Option<IpNet>, dport: Option<u16>| Match::Ports {
        proto: sp.protocol,
        dst: dst.map(|n| Addr::new(false, n)),
        dport,
    };
    let to = |chain: &str| Target::Jump(chain.to_string());
    let mut out = ServiceRules::default();

    let set_chain = |set: EndpointSet| match set {
        EndpointSet::Cluster => &svc,
        EndpointSet::Local => &svl,
    };
    let internal_chain = set_chain(sel.internal);
    let external_policy_chain = set_chain(sel.external);
    out.no_local = sel.no_local();
    let has_internal = sel.has_internal();
    let has_external = sel.has_external();
    // Traffic that falls through the external chain is dropped by
    // KUBE-EXTERNAL-SERVICES (INPUT, FORWARD).
    let uses_external_chain = sel.uses_external_chain();

    // Per-endpoint chains, for every endpoint either policy may pick. Each
    // endpoint's address text and chain name (a sha256) are worked out once
    // here, by address: the selection rules below look them up.
    let mut seps: Vec<(String, Vec<Rule>)> = Vec::new();
    let mut names: HashMap<SocketAddr, (String, usize)> = HashMap::new();
    for ep in &sel.all_reachable {
        if names.contains_key(&ep.socket_addr()) {
            continue;
        }
        let addr = ep.addr_string();
        let chain = sep_chain_of(&key, &addr);
        let set = sp.session_affinity_timeout.map(|_| {
            Match::Recent(Recent::Set {
                name: chain.clone(),
            })
        });
        let rules = vec![
            commented(&name, [Match::src_host(ep.ip)], to(MARK_MASQ_CHAIN)),
            commented(
                &name,
                set.into_iter().chain([ports(None, None)]),
                Target::Dnat(ep.socket_addr()),
            ),
        ];
        names.insert(ep.socket_addr(), (addr, seps.len()));
        seps.push((chain, rules));
    }
    // An endpoint's (address, KUBE-SEP chain): every endpoint a set holds is
    // one of all_reachable, so the fallback is never taken.
    let named = |ep: &Endpoint| -> (Cow<'_, str>, Cow<'_, str>) {
        match names.get(&ep.socket_addr()) {
            Some((addr, i)) => (
                Cow::Borrowed(addr.as_str()),
                Cow::Borrowed(seps[*i].0.as_str()),
            ),
            None => {
                let addr = ep.addr_string();
                let chain = sep_chain_of(&key, &addr);
                (Cow::Owned(addr), Cow::Owned(chain))
            }
        }
    };

    // The endpoint-selection rules of a SVC or SVL chain.
    let selection = |eps: &[&Endpoint], rules: &mut Vec<Rule>| {
        if let Some(seconds) = sp.session_affinity_timeout {
            for ep in eps {
                let (addr, sep) = named(ep);
                let check = Recent::Check {
                    name: sep.to_string(),
                    seconds,
                };
                let c = format!("{name} -> {addr}");
                rules.push(commented(c, [Match::Recent(check)], to(&sep)));
            }
        }
        let n = eps.len();
        for (i, ep) in eps.iter().enumerate() {
            let (addr, sep) = named(ep);
            let one_in = (n - i) as u32;
            let random = (i + 1 < n).then_some(Match::Random { one_in });
            rules.push(commented(format!("{name} -> {addr}"), random, to(&sep)));
        }
    };

    // `comment`, then the Service's port on `ip`, then `rest`, then `target`.
    let port_on = |comment: String, ip: &IpAddr, rest: Option<Match>, target| {
        let port = ports(Some(IpNet::from(*ip)), Some(sp.port));
        commented(comment, [port].into_iter().chain(rest), target)
    };
    let cluster_ip =
        |rest, target| port_on(format!("{name} cluster IP"), &sp.cluster_ip, rest, target);
    // Cluster IP traffic kp-model says to masquerade (off-cluster sources
    // may have been routed here from outside and leave for another node).
    let masq = match ClusterIpMasquerading::of(cfg) {
        ClusterIpMasquerading::All => Some(cluster_ip(None, to(MARK_MASQ_CHAIN))),
        ClusterIpMasquerading::OffCluster => local_match(fam, &cfg.local_detector, true)
            .map(|m| cluster_ip(Some(m), to(MARK_MASQ_CHAIN))),
        ClusterIpMasquerading::Never => None,
    };

    // The chain of the set serving internal traffic masquerades off-cluster
    // sources.
    for (set, chain) in [(EndpointSet::Cluster, &svc), (EndpointSet::Local, &svl)] {
        let eps = sel.endpoints(set);
        if eps.is_empty() {
            continue;
        }
        let mut rules = Vec::new();
        if sel.internal == set {
            rules.extend(masq.clone());
        }
        selection(eps, &mut rules);
        out.nat_chains.push((chain.clone(), rules));
    }

    if uses_external_chain {
        let mut rules = Vec::new();
        match sel.external_masquerading() {
            ExternalMasquerading::All => rules.push(commented(
                format!("masquerade traffic for {name} external destinations"),
                None,
                to(MARK_MASQ_CHAIN),
            )),
            ExternalMasquerading::FromNode => {
                // Pods reaching an external address of the Service behave as
                // if they went out to the load balancer and back: Cluster
                // policy.
                if let Some(m) = local_match(fam, &cfg.local_detector, false) {
                    rules.push(commented(
                        format!("pod traffic for {name} external destinations"),
                        Some(m),
                        to(&svc),
                    ));
                }
                rules.push(commented(
                    format!("masquerade LOCAL traffic for {name} external destinations"),
                    Some(Match::Local { src: true }),
                    to(MARK_MASQ_CHAIN),
                ));
                rules.push(commented(
                    format!("route LOCAL traffic for {name} external destinations"),
                    Some(Match::Local { src: true }),
                    to(&svc),
                ));
            }
            ExternalMasquerading::Never => {}
        }
        if has_external {
            rules.push(Rule::new(Vec::new(), to(external_policy_chain)));
        }
        out.nat_chains.push((ext.clone(), rules));
    }

    // Where traffic with no usable endpoint goes: REJECT when the service has
    // none anywhere, DROP when it has some but not for this traffic's policy.
    let (no_ep_target, no_ep_text) = match sel.no_endpoints() {
        NoEndpoints::Drop => (Target::Drop, "has no local endpoints"),
        NoEndpoints::Reject => (Target::Reject, "has no endpoints"),
    };
    let no_endpoints = |ip: &IpAddr| {
        port_on(
            format!("{name} {no_ep_text}"),
            ip,
            None,
            no_ep_target.clone(),
        )
    };

    // Cluster IP.
    if has_internal {
        out.nat_services.push(cluster_ip(None, to(internal_chain)));
    } else {
        out.filter_services.push(no_endpoints(&sp.cluster_ip));
    }

    // External IPs.
    let lb_ips: BTreeSet<IpAddr> = sp.load_balancer_ips.iter().copied().collect();
    let ext_ips: BTreeSet<IpAddr> = sp
        .external_ips
        .iter()
        .copied()
        .filter(|ip| *ip != sp.cluster_ip && !lb_ips.contains(ip))
        .collect();
    for ip in &ext_ips {
        if uses_external_chain {
            out.nat_services
                .push(port_on(format!("{name} external IP"), ip, None, to(&ext)));
        }
        if !has_external {
            out.filter_external.push(no_endpoints(ip));
        }
    }

    // Load balancer IPs, through the firewall chain when source ranges are set.
    let ranges: Vec<&IpNet> = sp
        .load_balancer_source_ranges
        .iter()
        .filter(|n| same_family(fam, n))
        .collect();
    let uses_fw = uses_external_chain && !sp.load_balancer_source_ranges.is_empty();
    if uses_fw && !lb_ips.is_empty() {
        let c = format!("{name} loadbalancer IP");
        let from = |n| commented(c.as_str(), [Match::Src(Addr::new(false, n))], to(&ext));
        let mut rules: Vec<Rule> = ranges.iter().map(|n| from(**n)).collect();
        // A node reaching its own LB IP may show up with that IP as source.
        if ranges
            .iter()
            .any(|n| cfg.node_ips.iter().any(|ip| n.contains(ip)))
        {
            rules.extend(lb_ips.iter().map(|ip| from(IpNet::from(*ip))));
        }
        rules.push(commented(
            format!("other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL"),
            None,
            Target::None,
        ));
        out.nat_chains.push((fw.clone(), rules));
    }
    for ip in &lb_ips {
        if uses_external_chain {
            let target = if uses_fw { &fw } else { &ext };
            let c = format!("{name} loadbalancer IP");
            out.nat_services.push(port_on(c, ip, None, to(target)));
            if uses_fw {
                // Anything the FW chain did not DNAT still has the LB IP as
                // destination when it reaches filter: drop it there.
                let c = format!("{name} traffic not accepted by {fw}");
                out.filter_firewall.push(port_on(c, ip, None, Target::Drop));
            }
        }
        if !has_external {
            out.filter_external.push(no_endpoints(ip));
        }
    }

    // NodePort.
    if sp.node_port != 0 {
        if uses_external_chain {
            if node_rules.nfacct && cfg.localhost_nodeports && fam == IpFamily::V4 {
                // The same jump, counting NodePort traffic to 127.0.0.0/8
                // first (kubeproxy_iptables_localhost_nodeports_accepted_packets_total).
                let counted = [
                    ports(Some(LOOPBACK_V4), Some(sp.node_port)),
                    Match::Nfacct(crate::nfacct::LOCALHOST_NODEPORTS_ACCEPTED),
                ];
                out.nat_nodeports.push(commented(&name, counted, to(&ext)));
            }
            let port = ports(None, Some(sp.node_port));
            out.nat_nodeports.push(commented(&name, [port], to(&ext)));
        }
        if !has_external {
            for dst in nodeport_destinations(cfg) {
                let rest = dst.into_iter().chain([ports(None, Some(sp.node_port))]);
                let c = format!("{name} {no_ep_text}");
                out.filter_external
                    .push(commented(c, rest, no_ep_target.clone()));
            }
        }
    }
    if sp.health_check_node_port != 0 {
        out.filter_nodeports.push(commented(
            format!("{name} health check node port"),
            [ports(None, Some(sp.health_check_node_port))],
            Target::Accept,
        ));
    }

    out.nat_chains.extend(seps);
    out
}

const LOOPBACK_V4: IpNet = IpNet::new_assert(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 0)), 8);

fn loopback(fam: IpFamily) -> IpNet {
    match fam {
        IpFamily::V4 => LOOPBACK_V4,
        IpFamily::V6 => IpNet::new_assert(IpAddr::V6(Ipv6Addr::LOCALHOST), 128),
    }
}

/// The destination matches of "a NodePort address of this node".
fn nodeport_destinations(cfg: &ProxierConfig) -> Vec<[Match; 2]> {
    let lo = loopback(cfg.family);
    let localhost = cfg.localhost_nodeports && cfg.family == IpFamily::V4;
    let cidrs: Vec<&IpNet> = cfg
        .nodeport_addresses
        .iter()
        .filter(|n| same_family(cfg.family, n))
        .collect();
    let src = |negate, n| Match::Src(Addr::new(negate, n));
    let dst = |negate, n| Match::Dst(Addr::new(negate, n));
    let local = Match::Local { src: false };
    // 0.0.0.0/0 or ::/0 means every local address, as an empty list does.
    if cidrs.is_empty() || cidrs.iter().any(|n| n.prefix_len() == 0) {
        let mut v = vec![[local, dst(true, lo)]];
        if localhost {
            // Only the node itself may use 127.0.0.1 (remote packets to it are
            // also dropped in KUBE-PROXY-FIREWALL, CVE-2020-8558).
            v.push([src(false, lo), dst(false, lo)]);
        }
        v
    } else {
        cidrs
            .into_iter()
            .filter_map(|n| {
                if n.network().is_loopback() {
                    localhost.then(|| [src(false, lo), dst(false, *n)])
                } else {
                    Some([dst(false, *n), local.clone()])
                }
            })
            .collect()
    }
}

/// The fixed rules of the top-level chains, around the services' rules.
#[derive(Clone, Debug)]
pub struct Skeleton {
    pub mark: u32,
    /// The last rules of nat KUBE-SERVICES.
    pub nodeport_jumps: Vec<Rule>,
    /// The first rules of filter KUBE-PROXY-FIREWALL.
    pub firewall_head: Vec<Rule>,
}

impl Skeleton {
    pub fn new(cfg: &ProxierConfig) -> Skeleton {
        let nodeport_jumps = nodeport_destinations(cfg)
            .into_iter()
            .map(|d| {
                commented(
                    "kubernetes service nodeports; NOTE: this must be the last rule in this chain",
                    d,
                    Target::Jump(NODEPORTS_CHAIN.into()),
                )
            })
            .collect();
        let mut firewall_head = Vec::new();
        if cfg.localhost_nodeports && cfg.family == IpFamily::V4 {
            // route_localnet lets remote hosts reach 127.0.0.1 services; block
            // that, as kubelet's KUBE-FIREWALL does (CVE-2020-8558).
            firewall_head.push(commented(
                "block incoming localnet connections",
                [
                    Match::Dst(Addr::new(false, LOOPBACK_V4)),
                    Match::Src(Addr::new(true, LOOPBACK_V4)),
                    Match::CtState {
                        negate: true,
                        states: CT_RELATED | CT_ESTABLISHED | CT_DNAT,
                    },
                ],
                Target::Drop,
            ));
        }
        Skeleton {
            mark: cfg.masquerade_mark(),
            nodeport_jumps,
            firewall_head,
        }
    }

    /// The static rules of our nat chains (not KUBE-SERVICES / KUBE-NODEPORTS).
    pub fn nat_static(&self) -> Vec<(&'static str, Vec<Rule>)> {
        let m = self.mark;
        vec![
            (
                POSTROUTING_CHAIN,
                vec![
                    Rule::new(
                        vec![Match::Mark {
                            negate: true,
                            value: m,
                            mask: m,
                        }],
                        Target::Return,
                    ),
                    // Clear the mark so that a packet re-traversing the stack
                    // (e.g. via an IPsec tunnel) is not masqueraded twice.
                    Rule::new(Vec::new(), Target::MarkXor(m)),
                    commented(
                        "kubernetes service traffic requiring SNAT",
                        None,
                        Target::MasqueradeRandomFully,
                    ),
                ],
            ),
            (
                MARK_MASQ_CHAIN,
                vec![Rule::new(Vec::new(), Target::MarkOr(m))],
            ),
        ]
    }

    /// KUBE-FORWARD with [`HostRules::default`].
    pub fn forward_rules(&self) -> Vec<Rule> {
        self.forward_rules_for(&HostRules::default())
    }

    pub fn forward_rules_for(&self, host: &HostRules) -> Vec<Rule> {
        let m = self.mark;
        let mut v = Vec::with_capacity(3);
        if host.invalid_drop {
            // Out-of-window packets marked INVALID would be forwarded
            // un-NATed and reset the connection (kubernetes#74839).
            let mut invalid = vec![Match::CtState {
                negate: false,
                states: CT_INVALID,
            }];
            if host.nfacct {
                invalid.push(Match::Nfacct(crate::nfacct::CT_STATE_INVALID_DROPPED));
            }
            v.push(Rule::new(invalid, Target::Drop));
        }
        let mark = Match::Mark {
            negate: false,
            value: m,
            mask: m,
        };
        let established = Match::CtState {
            negate: false,
            states: CT_RELATED | CT_ESTABLISHED,
        };
        v.extend([
            commented("kubernetes forwarding rules", [mark], Target::Accept),
            commented(
                "kubernetes forwarding conntrack rule",
                [established],
                Target::Accept,
            ),
        ]);
        v
    }
}

/// The (table, chain) pairs a packet on `route` traverses, in order, for
/// `kube-proxy-rs explain` to look up in the kernel. Per-service names come
/// from [`render_service`] itself, so they are the ones a sync installs.
pub fn packet_chains(
    sp: &ServicePort,
    endpoints: &[Endpoint],
    cfg: &ProxierConfig,
    node: &NodeInfo,
    route: &kp_model::explain::Route,
) -> Vec<(String, String)> {
    use kp_model::explain::{Action, MatchKind};
    let rules = render_service(sp, endpoints, cfg, node);
    let hash = port_hash(sp);
    let nat = |c: String| ("nat".to_string(), c);
    let own = |c: String| {
        rules
            .nat_chains
            .iter()
            .any(|(n, _)| *n == c)
            .then(|| nat(c))
    };
    let fw_used =
        route.kind == MatchKind::LoadBalancerIngress && !sp.load_balancer_source_ranges.is_empty();
    let mut out = Vec::new();
    match route.action {
        Action::Dnat => {
            out.push(nat(SERVICES_CHAIN.into()));
            if route.kind == MatchKind::NodePort {
                out.push(nat(NODEPORTS_CHAIN.into()));
            }
            if fw_used {
                out.extend(own(format!("KUBE-FW-{hash}")));
            }
            if route.kind.is_external() {
                out.extend(own(format!("KUBE-EXT-{hash}")));
            }
            out.extend(own(match route.set {
                EndpointSet::Cluster => format!("KUBE-SVC-{hash}"),
                EndpointSet::Local => format!("KUBE-SVL-{hash}"),
            }));
            for ep in route.endpoints_in(endpoints) {
                out.extend(own(sep_chain(sp, ep)));
            }
        }
        Action::Drop if route.source_ranges_drop => {
            out.push(nat(SERVICES_CHAIN.into()));
            out.extend(own(format!("KUBE-FW-{hash}")));
            out.push(("filter".into(), FIREWALL_CHAIN.into()));
        }
        Action::Drop | Action::Reject => {
            let chain = if route.kind.is_external() {
                EXTERNAL_CHAIN
            } else {
                SERVICES_CHAIN
            };
            out.push(("filter".into(), chain.into()));
        }
        Action::Untouched => {}
    }
    out
}
