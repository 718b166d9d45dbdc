//! The pure part of IPVS mode: the model -> what the kernel should hold
//! ([`plan`]), and what to change to get there ([`diff`]). No I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use kp_model::{
    EndpointSelection, ExternalMasquerading, Protocol, ProxierConfig, ProxyState, ServicePort,
};

use crate::ipset;
use crate::ipvs::{RealServer, VsKey, VsSpec, SCHEDULERS};

/// IPVS-mode settings on top of the shared proxier settings.
#[derive(Clone, Debug)]
pub struct IpvsConfig {
    pub proxier: ProxierConfig,
    /// --ipvs-scheduler (empty means rr).
    pub scheduler: String,
    /// --ipvs-exclude-cidrs: virtual servers there are never deleted.
    pub exclude_cidrs: Vec<IpNet>,
    pub strict_arp: bool,
    /// Seconds; 0 leaves the kernel's value.
    pub tcp_timeout: u32,
    pub tcp_fin_timeout: u32,
    pub udp_timeout: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("unknown IPVS scheduler {0:?} (expected one of {list})", list = SCHEDULERS.join(", "))]
    Scheduler(String),
}

impl IpvsConfig {
    pub fn new(proxier: ProxierConfig) -> Self {
        IpvsConfig {
            proxier,
            scheduler: "rr".into(),
            exclude_cidrs: Vec::new(),
            strict_arp: false,
            tcp_timeout: 0,
            tcp_fin_timeout: 0,
            udp_timeout: 0,
        }
    }

    /// Checks the scheduler name (empty becomes rr, as upstream).
    pub fn validate(&mut self) -> Result<(), ConfigError> {
        if self.scheduler.is_empty() {
            self.scheduler = "rr".into();
        }
        if !SCHEDULERS.contains(&self.scheduler.as_str()) {
            return Err(ConfigError::Scheduler(self.scheduler.clone()));
        }
        Ok(())
    }

    pub fn excluded(&self, ip: &IpAddr) -> bool {
        self.exclude_cidrs.iter().any(|c| c.contains(ip))
    }
}

/// One virtual server as wanted (or as found in the kernel).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VirtualServer {
    pub spec: VsSpec,
    pub dests: BTreeMap<RealServer, u32>,
    /// The service port it belongs to (`ns/name:port`), for logs and dry-run.
    pub owner: String,
}

/// What the kernel holds for one family: virtual servers, addresses on
/// kube-ipvs0, ipset entries (set -> entry -> comment).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    pub services: BTreeMap<VsKey, VirtualServer>,
    pub bound: BTreeSet<IpAddr>,
    pub sets: BTreeMap<String, BTreeMap<String, String>>,
}

impl Layout {
    fn set_add(&mut self, set: &str, entry: String, comment: &str) {
        self.sets
            .entry(set.to_string())
            .or_default()
            .insert(entry, comment.to_string());
    }
}

fn proto_entry(p: Protocol, port: u16) -> String {
    format!("{}:{port}", p.as_lower())
}

fn ip_port(ip: &IpAddr, p: Protocol, port: u16) -> String {
    format!("{ip},{}", proto_entry(p, port))
}

/// The layout a sync of `state` should leave. `local_ips`: this node's
/// addresses (not those on kube-ipvs0), for NodePort virtual servers.
pub fn plan(state: &ProxyState, cfg: &IpvsConfig, local_ips: &[IpAddr]) -> Layout {
    let fam = cfg.proxier.family;
    let mut out = Layout::default();
    // Every set exists even when empty: the iptables rules refer to them all.
    for s in ipset::SETS {
        out.sets.entry(ipset::name(s.name, fam)).or_default();
    }
    let nodeport_ips: Vec<IpAddr> = local_ips
        .iter()
        .filter(|ip| fam.matches(ip) && cfg.proxier.serves_nodeports(ip))
        .copied()
        .collect();
    for (name, sp) in &state.services {
        plan_service(
            &mut out,
            sp,
            state.endpoints_of(name),
            state,
            cfg,
            &nodeport_ips,
        );
    }
    let ips = ipset::name("KUBE-IPVS-IPS", fam);
    let bound: Vec<IpAddr> = out.bound.iter().copied().collect();
    for ip in bound {
        out.set_add(&ips, ip.to_string(), "");
    }
    out
}

fn plan_service(
    out: &mut Layout,
    sp: &ServicePort,
    endpoints: &[kp_model::Endpoint],
    state: &ProxyState,
    cfg: &IpvsConfig,
    nodeport_ips: &[IpAddr],
) {
    let fam = cfg.proxier.family;
    let owner = sp.name.to_string();
    let sel = EndpointSelection::new(sp, endpoints, &state.node);
    let to_dests = |eps: &[&kp_model::Endpoint]| -> BTreeMap<RealServer, u32> {
        eps.iter()
            .map(|e| {
                (
                    RealServer {
                        addr: e.ip,
                        port: e.port,
                    },
                    1,
                )
            })
            .collect()
    };
    let internal = &to_dests(sel.internal_endpoints());
    let external = &to_dests(sel.external_endpoints());
    // The -LOCAL- sets exempt external traffic from the masquerade rules
    // (rules.rs): all but what kp-model masquerades whole.
    let external_local = sel.external_masquerading() != ExternalMasquerading::All;
    let spec = VsSpec {
        scheduler: cfg.scheduler.clone(),
        persistence: sp.session_affinity_timeout,
    };
    let add_vs = |out: &mut Layout, addr: IpAddr, port: u16, dests: &BTreeMap<RealServer, u32>| {
        out.services.insert(
            VsKey {
                addr,
                protocol: sp.protocol,
                port,
            },
            VirtualServer {
                spec: spec.clone(),
                dests: dests.clone(),
                owner: owner.clone(),
            },
        );
    };
    let n = |s: &str| ipset::name(s, fam);
    let pp = |ip: &IpAddr| ip_port(ip, sp.protocol, sp.port);

    // ClusterIP.
    add_vs(out, sp.cluster_ip, sp.port, internal);
    out.bound.insert(sp.cluster_ip);
    out.set_add(&n("KUBE-CLUSTER-IP"), pp(&sp.cluster_ip), &owner);

    for ip in &sp.external_ips {
        add_vs(out, *ip, sp.port, external);
        out.bound.insert(*ip);
        let set = if external_local {
            "KUBE-EXTERNAL-IP-LOCAL"
        } else {
            "KUBE-EXTERNAL-IP"
        };
        out.set_add(&n(set), pp(ip), &owner);
    }
    for ip in &sp.load_balancer_ips {
        add_vs(out, *ip, sp.port, external);
        out.bound.insert(*ip);
        out.set_add(&n("KUBE-LOAD-BALANCER"), pp(ip), &owner);
        if external_local {
            out.set_add(&n("KUBE-LOAD-BALANCER-LOCAL"), pp(ip), &owner);
        }
        if !sp.load_balancer_source_ranges.is_empty() {
            out.set_add(&n("KUBE-LOAD-BALANCER-FW"), pp(ip), &owner);
            for cidr in &sp.load_balancer_source_ranges {
                if fam.matches(&cidr.addr()) {
                    out.set_add(
                        &n("KUBE-LOAD-BALANCER-SOURCE-CIDR"),
                        format!("{},{}", pp(ip), ipset::net_entry(cidr)),
                        &owner,
                    );
                }
            }
        }
    }
    if sp.node_port != 0 {
        for ip in nodeport_ips {
            add_vs(out, *ip, sp.node_port, external);
        }
        let port = sp.node_port.to_string();
        match sp.protocol {
            Protocol::Tcp | Protocol::Udp => {
                let up = sp.protocol.as_k8s();
                out.set_add(&n(&format!("KUBE-NODE-PORT-{up}")), port.clone(), &owner);
                if external_local {
                    out.set_add(&n(&format!("KUBE-NODE-PORT-LOCAL-{up}")), port, &owner);
                }
            }
            Protocol::Sctp => {
                for ip in nodeport_ips {
                    let e = ip_port(ip, sp.protocol, sp.node_port);
                    out.set_add(&n("KUBE-NODE-PORT-SCTP-HASH"), e.clone(), &owner);
                    if external_local {
                        out.set_add(&n("KUBE-NODE-PORT-LOCAL-SCTP-HASH"), e, &owner);
                    }
                }
            }
        }
    }
    if sp.health_check_node_port != 0 {
        out.set_add(
            &n("KUBE-HEALTH-CHECK-NODE-PORT"),
            sp.health_check_node_port.to_string(),
            &owner,
        );
    }
    // Hairpin: a local endpoint reaching itself through the Service is
    // masqueraded (KUBE-LOOP-BACK in POSTROUTING).
    for e in sel.hairpin() {
        out.set_add(
            &n("KUBE-LOOP-BACK"),
            format!("{},{},{}", e.ip, proto_entry(sp.protocol, e.port), e.ip),
            &owner,
        );
    }
}

/// One change to the kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    AddService(VsKey, VsSpec),
    UpdateService(VsKey, VsSpec),
    DelService(VsKey),
    AddDest(VsKey, RealServer, u32),
    /// Weight change; weight 0 starts a graceful removal.
    SetWeight(VsKey, RealServer, u32),
    DelDest(VsKey, RealServer),
    Bind(IpAddr),
    Unbind(IpAddr),
    SetAdd(String, String, String),
    SetDel(String, String),
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn spec(s: &VsSpec) -> String {
            match s.persistence {
                Some(t) => format!("{} persistent {t}", s.scheduler),
                None => s.scheduler.clone(),
            }
        }
        match self {
            Op::AddService(k, s) => write!(f, "add-service {k} {}", spec(s)),
            Op::UpdateService(k, s) => write!(f, "update-service {k} {}", spec(s)),
            Op::DelService(k) => write!(f, "del-service {k}"),
            Op::AddDest(k, r, w) => write!(f, "add-dest {k} -> {r} weight {w}"),
            Op::SetWeight(k, r, w) => write!(f, "set-weight {k} -> {r} weight {w}"),
            Op::DelDest(k, r) => write!(f, "del-dest {k} -> {r}"),
            Op::Bind(ip) => write!(f, "bind {ip}"),
            Op::Unbind(ip) => write!(f, "unbind {ip}"),
            Op::SetAdd(s, e, _) => write!(f, "ipset add {s} {e}"),
            Op::SetDel(s, e) => write!(f, "ipset del {s} {e}"),
        }
    }
}

/// Whether removing a real server of this protocol is graceful (weight 0
/// until its connections end) or immediate. UDP and SCTP have no connection
/// end to wait for: deleted at once, as upstream does.
pub fn graceful(p: Protocol) -> bool {
    p == Protocol::Tcp
}

/// The changes from `cur` to `want`, in a safe order: new virtual servers and
/// real servers before the ipset entries and addresses that let traffic in;
/// addresses and entries removed before the virtual servers behind them.
/// Virtual servers outside `want` are deleted unless `keep` says otherwise
/// (--ipvs-exclude-cidrs). A real server that left `want` is drained (weight
/// 0) when [`graceful`], and deleted otherwise; a drained one is left alone.
pub fn diff(cur: &Layout, want: &Layout, keep: &dyn Fn(&VsKey) -> bool) -> Vec<Op> {
    let mut add = Vec::new();
    let mut dests = Vec::new();
    let mut sets_add = Vec::new();
    let mut binds = Vec::new();
    let mut unbinds = Vec::new();
    let mut sets_del = Vec::new();
    let mut dels = Vec::new();
    let mut svc_dels = Vec::new();
    for (k, w) in &want.services {
        match cur.services.get(k) {
            None => {
                add.push(Op::AddService(k.clone(), w.spec.clone()));
                for (rs, wt) in &w.dests {
                    dests.push(Op::AddDest(k.clone(), *rs, *wt));
                }
            }
            Some(c) => {
                if c.spec != w.spec {
                    add.push(Op::UpdateService(k.clone(), w.spec.clone()));
                }
                for (rs, wt) in &w.dests {
                    match c.dests.get(rs) {
                        None => dests.push(Op::AddDest(k.clone(), *rs, *wt)),
                        Some(cw) if cw != wt => dests.push(Op::SetWeight(k.clone(), *rs, *wt)),
                        Some(_) => {}
                    }
                }
                for (rs, cw) in &c.dests {
                    if w.dests.contains_key(rs) {
                        continue;
                    }
                    if !graceful(k.protocol) {
                        dels.push(Op::DelDest(k.clone(), *rs));
                    } else if *cw != 0 {
                        dests.push(Op::SetWeight(k.clone(), *rs, 0));
                    }
                }
            }
        }
    }
    for k in cur.services.keys() {
        if !want.services.contains_key(k) && !keep(k) {
            svc_dels.push(Op::DelService(k.clone()));
        }
    }
    for ip in want.bound.difference(&cur.bound) {
        binds.push(Op::Bind(*ip));
    }
    for ip in cur.bound.difference(&want.bound) {
        unbinds.push(Op::Unbind(*ip));
    }
    let empty = BTreeMap::new();
    for (set, entries) in &want.sets {
        let have = cur.sets.get(set).unwrap_or(&empty);
        for (e, c) in entries {
            if !have.contains_key(e) {
                sets_add.push(Op::SetAdd(set.clone(), e.clone(), c.clone()));
            }
        }
    }
    for (set, entries) in &cur.sets {
        let wanted = want.sets.get(set).unwrap_or(&empty);
        for e in entries.keys() {
            if !wanted.contains_key(e) {
                sets_del.push(Op::SetDel(set.clone(), e.clone()));
            }
        }
    }
    let mut out = add;
    out.extend(dests);
    out.extend(sets_add);
    out.extend(binds);
    out.extend(unbinds);
    out.extend(sets_del);
    out.extend(dels);
    out.extend(svc_dels);
    out
}

/// Applies `ops` to a remembered layout (what the kernel holds after they
/// succeeded).
pub fn apply_to(layout: &mut Layout, ops: &[Op], want: &Layout) {
    for op in ops {
        match op {
            Op::AddService(k, s) | Op::UpdateService(k, s) => {
                let owner = want
                    .services
                    .get(k)
                    .map(|v| v.owner.clone())
                    .unwrap_or_default();
                let e = layout.services.entry(k.clone()).or_insert(VirtualServer {
                    spec: s.clone(),
                    dests: BTreeMap::new(),
                    owner,
                });
                e.spec = s.clone();
            }
            Op::DelService(k) => {
                layout.services.remove(k);
            }
            Op::AddDest(k, r, w) | Op::SetWeight(k, r, w) => {
                if let Some(v) = layout.services.get_mut(k) {
                    v.dests.insert(*r, *w);
                }
            }
            Op::DelDest(k, r) => {
                if let Some(v) = layout.services.get_mut(k) {
                    v.dests.remove(r);
                }
            }
            Op::Bind(ip) => {
                layout.bound.insert(*ip);
            }
            Op::Unbind(ip) => {
                layout.bound.remove(ip);
            }
            Op::SetAdd(s, e, c) => {
                layout
                    .sets
                    .entry(s.clone())
                    .or_default()
                    .insert(e.clone(), c.clone());
            }
            Op::SetDel(s, e) => {
                if let Some(m) = layout.sets.get_mut(s) {
                    m.remove(e);
                }
            }
        }
    }
}
