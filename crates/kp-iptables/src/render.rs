//! Model -> iptables-restore lines, per service port. Pure: no I/O.
//!
//! Follows upstream's pkg/proxy/iptables/proxier.go syncProxyRules: the same
//! chain names (so tools and people that know kube-proxy find their way), the
//! same rule order and comments.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use kp_model::{
    chain_hash, Endpoint, EndpointSelection, EndpointSet, IpFamily, LocalDetector, NoEndpoints,
    NodeInfo, ProxierConfig, ServicePort,
};
use kp_xtables::Jump;

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

fn jump(table: &'static str, from: &'static str, to: &str, comment: &str, new_only: bool) -> Jump {
    let mut args = Vec::new();
    if new_only {
        args.extend(["-m", "conntrack", "--ctstate", "NEW"].map(String::from));
    }
    args.extend(["-m", "comment", "--comment", comment, "-j", to].map(String::from));
    Jump { table, from, args }
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

/// Everything one service port contributes to the ruleset. Lines are complete
/// iptables-restore rule lines (`-A CHAIN ...`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceRules {
    /// nat chains this service port owns (KUBE-SVC/SVL/EXT/FW/SEP), with rules.
    pub nat_chains: Vec<(String, Vec<String>)>,
    /// Its lines in nat KUBE-SERVICES.
    pub nat_services: Vec<String>,
    /// Its lines in nat KUBE-NODEPORTS.
    pub nat_nodeports: Vec<String>,
    /// filter KUBE-SERVICES (no endpoints for the cluster IP).
    pub filter_services: Vec<String>,
    /// filter KUBE-EXTERNAL-SERVICES (no endpoints for external traffic).
    pub filter_external: Vec<String>,
    /// filter KUBE-PROXY-FIREWALL (loadBalancerSourceRanges).
    pub filter_firewall: Vec<String>,
    /// filter KUBE-NODEPORTS (health check node port accepted).
    pub filter_nodeports: Vec<String>,
    /// eTP/iTP Local with no local endpoint (internal, external).
    pub no_local: (bool, bool),
}

impl ServiceRules {
    pub fn chain_names(&self) -> impl Iterator<Item = &str> {
        self.nat_chains.iter().map(|(c, _)| c.as_str())
    }

    /// Whether both put the same lines into the top-level chains (those
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

/// `-m comment --comment "..."`. Names reaching here are validated DNS labels;
/// anything that could end the quoted string or the line is dropped anyway.
pub fn comment(text: &str) -> String {
    let clean: String = text
        .chars()
        .filter(|c| (c.is_ascii_graphic() || *c == ' ') && !matches!(c, '"' | '\\'))
        .take(240)
        .collect();
    format!("-m comment --comment \"{clean}\"")
}

fn host(ip: &IpAddr) -> String {
    match ip {
        IpAddr::V4(_) => format!("{ip}/32"),
        IpAddr::V6(_) => format!("{ip}/128"),
    }
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
pub fn local_match(fam: IpFamily, d: &LocalDetector, negate: bool) -> Option<String> {
    let not = if negate { "! " } else { "" };
    match d {
        LocalDetector::None => None,
        LocalDetector::Cidrs(c) => c
            .iter()
            .find(|n| same_family(fam, n))
            .map(|n| format!("{not}-s {n}")),
        LocalDetector::BridgeInterface(i) => Some(format!("{not}-i {i}")),
        LocalDetector::InterfaceNamePrefix(p) => Some(format!("{not}-i {p}+")),
    }
}

/// Upstream's probability formatting (`%0.10f` of 1/n).
pub fn probability(n: usize) -> String {
    format!("{:.10}", 1.0 / n as f64)
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
    let proto = sp.protocol.as_lower();
    let pmatch = format!("-m {proto} -p {proto}");
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
    let mut seps: Vec<(String, Vec<String>)> = Vec::new();
    let mut names: HashMap<SocketAddr, (String, usize)> = HashMap::new();
    for ep in &sel.all_reachable {
        if names.contains_key(&ep.socket_addr()) {
            continue;
        }
        let addr = ep.addr_string();
        let chain = sep_chain_of(&key, &addr);
        let c = comment(&name);
        let mut rules = vec![format!(
            "-A {chain} {c} -s {} -j {MARK_MASQ_CHAIN}",
            host(&ep.ip)
        )];
        let affinity = if sp.session_affinity_timeout.is_some() {
            format!(" -m recent --name {chain} --set")
        } else {
            String::new()
        };
        rules.push(format!(
            "-A {chain} {c}{affinity} {pmatch} -j DNAT --to-destination {addr}"
        ));
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
    let selection = |chain: &str, eps: &[&Endpoint], rules: &mut Vec<String>| {
        if let Some(timeout) = sp.session_affinity_timeout {
            for ep in eps {
                let (addr, sep) = named(ep);
                rules.push(format!(
                    "-A {chain} {} -m recent --name {sep} --rcheck --seconds {timeout} --reap -j {sep}",
                    comment(&format!("{name} -> {addr}"))
                ));
            }
        }
        let n = eps.len();
        for (i, ep) in eps.iter().enumerate() {
            let (addr, sep) = named(ep);
            let mut r = format!("-A {chain} {}", comment(&format!("{name} -> {addr}")));
            if i + 1 < n {
                let _ = write!(
                    r,
                    " -m statistic --mode random --probability {}",
                    probability(n - i)
                );
            }
            let _ = write!(r, " -j {sep}");
            rules.push(r);
        }
    };

    let cluster_args = format!(
        "{} {pmatch} -d {} --dport {}",
        comment(&format!("{name} cluster IP")),
        host(&sp.cluster_ip),
        sp.port
    );
    // Masquerade off-cluster traffic to the cluster IP: it may have been routed
    // here from outside and leave for another node.
    let masq = if cfg.masquerade_all {
        Some(format!("{cluster_args} -j {MARK_MASQ_CHAIN}"))
    } else {
        local_match(fam, &cfg.local_detector, true)
            .map(|m| format!("{cluster_args} {m} -j {MARK_MASQ_CHAIN}"))
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
            if let Some(m) = &masq {
                rules.push(format!("-A {chain} {m}"));
            }
        }
        selection(chain, eps, &mut rules);
        out.nat_chains.push((chain.clone(), rules));
    }

    if uses_external_chain {
        let mut rules = Vec::new();
        if !sel.external.is_local() {
            rules.push(format!(
                "-A {ext} {} -j {MARK_MASQ_CHAIN}",
                comment(&format!(
                    "masquerade traffic for {name} external destinations"
                ))
            ));
        } else if sel.has_cluster() {
            // Pods reaching an external address of the Service behave as if
            // they went out to the load balancer and back: Cluster policy.
            if let Some(m) = local_match(fam, &cfg.local_detector, false) {
                rules.push(format!(
                    "-A {ext} {} {m} -j {svc}",
                    comment(&format!("pod traffic for {name} external destinations"))
                ));
            }
            // The node itself picks the external address as source: masquerade.
            rules.push(format!(
                "-A {ext} {} -m addrtype --src-type LOCAL -j {MARK_MASQ_CHAIN}",
                comment(&format!(
                    "masquerade LOCAL traffic for {name} external destinations"
                ))
            ));
            rules.push(format!(
                "-A {ext} {} -m addrtype --src-type LOCAL -j {svc}",
                comment(&format!(
                    "route LOCAL traffic for {name} external destinations"
                ))
            ));
        }
        if has_external {
            rules.push(format!("-A {ext} -j {external_policy_chain}"));
        }
        out.nat_chains.push((ext.clone(), rules));
    }

    // Where traffic with no usable endpoint goes: REJECT when the service has
    // none anywhere, DROP when it has some but not for this traffic's policy.
    let (no_ep_target, no_ep_text) = match sel.no_endpoints() {
        NoEndpoints::Drop => ("DROP", "has no local endpoints"),
        NoEndpoints::Reject => ("REJECT", "has no endpoints"),
    };

    // Cluster IP.
    if has_internal {
        out.nat_services.push(format!(
            "-A {SERVICES_CHAIN} {cluster_args} -j {internal_chain}"
        ));
    } else {
        out.filter_services.push(format!(
            "-A {SERVICES_CHAIN} {} {pmatch} -d {} --dport {} -j {no_ep_target}",
            comment(&format!("{name} {no_ep_text}")),
            host(&sp.cluster_ip),
            sp.port
        ));
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
            out.nat_services.push(format!(
                "-A {SERVICES_CHAIN} {} {pmatch} -d {} --dport {} -j {ext}",
                comment(&format!("{name} external IP")),
                host(ip),
                sp.port
            ));
        }
        if !has_external {
            out.filter_external.push(format!(
                "-A {EXTERNAL_CHAIN} {} {pmatch} -d {} --dport {} -j {no_ep_target}",
                comment(&format!("{name} {no_ep_text}")),
                host(ip),
                sp.port
            ));
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
        let c = comment(&format!("{name} loadbalancer IP"));
        let mut rules: Vec<String> = ranges
            .iter()
            .map(|n| format!("-A {fw} {c} -s {n} -j {ext}"))
            .collect();
        // A node reaching its own LB IP may show up with that IP as source.
        if ranges
            .iter()
            .any(|n| cfg.node_ips.iter().any(|ip| n.contains(ip)))
        {
            for ip in &lb_ips {
                rules.push(format!("-A {fw} {c} -s {} -j {ext}", host(ip)));
            }
        }
        rules.push(format!(
            "-A {fw} {}",
            comment(&format!(
                "other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL"
            ))
        ));
        out.nat_chains.push((fw.clone(), rules));
    }
    for ip in &lb_ips {
        if uses_external_chain {
            let target = if uses_fw { &fw } else { &ext };
            out.nat_services.push(format!(
                "-A {SERVICES_CHAIN} {} {pmatch} -d {} --dport {} -j {target}",
                comment(&format!("{name} loadbalancer IP")),
                host(ip),
                sp.port
            ));
            if uses_fw {
                // Anything the FW chain did not DNAT still has the LB IP as
                // destination when it reaches filter: drop it there.
                out.filter_firewall.push(format!(
                    "-A {FIREWALL_CHAIN} {} {pmatch} -d {} --dport {} -j DROP",
                    comment(&format!("{name} traffic not accepted by {fw}")),
                    host(ip),
                    sp.port
                ));
            }
        }
        if !has_external {
            out.filter_external.push(format!(
                "-A {EXTERNAL_CHAIN} {} {pmatch} -d {} --dport {} -j {no_ep_target}",
                comment(&format!("{name} {no_ep_text}")),
                host(ip),
                sp.port
            ));
        }
    }

    // NodePort.
    if sp.node_port != 0 {
        if uses_external_chain {
            if node_rules.nfacct && cfg.localhost_nodeports && fam == IpFamily::V4 {
                // The same jump, counting NodePort traffic to 127.0.0.0/8
                // first (kubeproxy_iptables_localhost_nodeports_accepted_packets_total).
                out.nat_nodeports.push(format!(
                    "-A {NODEPORTS_CHAIN} {} {pmatch} -d 127.0.0.0/8 --dport {} -m nfacct --nfacct-name {} -j {ext}",
                    comment(&name),
                    sp.node_port,
                    crate::nfacct::LOCALHOST_NODEPORTS_ACCEPTED
                ));
            }
            out.nat_nodeports.push(format!(
                "-A {NODEPORTS_CHAIN} {} {pmatch} --dport {} -j {ext}",
                comment(&name),
                sp.node_port
            ));
        }
        if !has_external {
            for dst in nodeport_destinations(cfg) {
                out.filter_external.push(format!(
                    "-A {EXTERNAL_CHAIN} {} {dst} {pmatch} --dport {} -j {no_ep_target}",
                    comment(&format!("{name} {no_ep_text}")),
                    sp.node_port
                ));
            }
        }
    }
    if sp.health_check_node_port != 0 {
        out.filter_nodeports.push(format!(
            "-A {NODEPORTS_CHAIN} {} {pmatch} --dport {} -j ACCEPT",
            comment(&format!("{name} health check node port")),
            sp.health_check_node_port
        ));
    }

    out.nat_chains.extend(seps);
    out
}

/// The destination matches of "a NodePort address of this node".
fn nodeport_destinations(cfg: &ProxierConfig) -> Vec<String> {
    let lo = loopback(cfg.family);
    let localhost = cfg.localhost_nodeports && cfg.family == IpFamily::V4;
    let cidrs: Vec<&IpNet> = cfg
        .nodeport_addresses
        .iter()
        .filter(|n| same_family(cfg.family, n))
        .collect();
    // 0.0.0.0/0 or ::/0 means every local address, as an empty list does.
    if cidrs.is_empty() || cidrs.iter().any(|n| n.prefix_len() == 0) {
        let mut v = vec![format!("-m addrtype --dst-type LOCAL ! -d {lo}")];
        if localhost {
            // Only the node itself may use 127.0.0.1 (remote packets to it are
            // also dropped in KUBE-PROXY-FIREWALL, CVE-2020-8558).
            v.push(format!("-s {lo} -d {lo}"));
        }
        v
    } else {
        cidrs
            .into_iter()
            .filter_map(|n| {
                if n.network().is_loopback() {
                    localhost.then(|| format!("-s {lo} -d {n}"))
                } else {
                    Some(format!("-d {n} -m addrtype --dst-type LOCAL"))
                }
            })
            .collect()
    }
}

fn loopback(fam: IpFamily) -> &'static str {
    match fam {
        IpFamily::V4 => "127.0.0.0/8",
        IpFamily::V6 => "::1/128",
    }
}

/// The fixed rules of the top-level chains, around the services' lines.
#[derive(Clone, Debug)]
pub struct Skeleton {
    pub mark: String,
    pub nodeport_jumps: Vec<String>,
    pub firewall_head: Vec<String>,
}

impl Skeleton {
    pub fn new(cfg: &ProxierConfig) -> Skeleton {
        let nodeport_jumps = nodeport_destinations(cfg)
            .into_iter()
            .map(|d| {
                format!(
                    "-A {SERVICES_CHAIN} {} {d} -j {NODEPORTS_CHAIN}",
                    comment(
                        "kubernetes service nodeports; NOTE: this must be the last rule in this chain"
                    )
                )
            })
            .collect();
        let mut firewall_head = Vec::new();
        if cfg.localhost_nodeports && cfg.family == IpFamily::V4 {
            // route_localnet lets remote hosts reach 127.0.0.1 services; block
            // that, as kubelet's KUBE-FIREWALL does (CVE-2020-8558).
            firewall_head.push(format!(
                "-A {FIREWALL_CHAIN} {} -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
                comment("block incoming localnet connections")
            ));
        }
        Skeleton {
            mark: format!("0x{:x}", cfg.masquerade_mark()),
            nodeport_jumps,
            firewall_head,
        }
    }

    /// The static rules of our nat chains (not KUBE-SERVICES / KUBE-NODEPORTS).
    pub fn nat_static(&self) -> Vec<String> {
        let m = &self.mark;
        vec![
            format!("-A {POSTROUTING_CHAIN} -m mark ! --mark {m}/{m} -j RETURN"),
            // Clear the mark so that a packet re-traversing the stack (e.g. via
            // an IPsec tunnel) is not masqueraded twice.
            format!("-A {POSTROUTING_CHAIN} -j MARK --xor-mark {m}"),
            format!(
                "-A {POSTROUTING_CHAIN} {} -j MASQUERADE --random-fully",
                comment("kubernetes service traffic requiring SNAT")
            ),
            format!("-A {MARK_MASQ_CHAIN} -j MARK --or-mark {m}"),
        ]
    }

    /// KUBE-FORWARD with [`HostRules::default`].
    pub fn forward_rules(&self) -> Vec<String> {
        self.forward_rules_for(&HostRules::default())
    }

    pub fn forward_rules_for(&self, host: &HostRules) -> Vec<String> {
        let m = &self.mark;
        let mut v = Vec::with_capacity(3);
        if host.invalid_drop {
            // Out-of-window packets marked INVALID would be forwarded
            // un-NATed and reset the connection (kubernetes#74839).
            let count = if host.nfacct {
                format!(
                    " -m nfacct --nfacct-name {}",
                    crate::nfacct::CT_STATE_INVALID_DROPPED
                )
            } else {
                String::new()
            };
            v.push(format!(
                "-A {FORWARD_CHAIN} -m conntrack --ctstate INVALID{count} -j DROP"
            ));
        }
        v.extend([
            format!(
                "-A {FORWARD_CHAIN} {} -m mark --mark {m}/{m} -j ACCEPT",
                comment("kubernetes forwarding rules")
            ),
            format!(
                "-A {FORWARD_CHAIN} {} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
                comment("kubernetes forwarding conntrack rule")
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
