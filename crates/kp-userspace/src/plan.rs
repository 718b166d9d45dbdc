//! Pure: which sockets the proxy listens on for a given state: all at once
//! ([`plan`]) or kept up to date one service port at a time ([`PlanIndex`]).

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use kp_model::{serves_nodeports, IpFamily, Protocol, ProxyState, ServicePort, ServicePortName};

/// Whether a listener serves in-cluster traffic (the ClusterIP: internal
/// traffic policy) or traffic from outside (NodePort, externalIP,
/// LoadBalancer IP: external traffic policy).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Cluster,
    External,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ListenKey {
    pub addr: SocketAddr,
    pub protocol: Protocol,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenSpec {
    pub service: ServicePortName,
    pub kind: Kind,
    /// loadBalancerSourceRanges (LoadBalancer IPs only); empty allows all.
    pub source_ranges: Vec<IpNet>,
}

/// Inputs beyond the state.
#[derive(Clone, Debug, Default)]
pub struct PlanOpts {
    /// Service IPs that are not local addresses are added to lo (root).
    pub take_over_vips: bool,
    /// --nodeport-addresses of this family; empty means every non-loopback
    /// local address.
    pub nodeport_addresses: Vec<IpNet>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub listeners: BTreeMap<ListenKey, ListenSpec>,
    /// Service IPs to hold on lo.
    pub vips: BTreeSet<IpAddr>,
    /// Address/port pairs two service ports both claim (the first, in name
    /// order, wins), and service ports this mode cannot serve.
    pub skipped: Vec<String>,
}

fn link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v) => v.is_link_local(),
        IpAddr::V6(v) => (v.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// This node's side of a plan: the local addresses that may be listened on
/// as they are and the NodePort addresses. Computed from the local addresses
/// once (per full sync, for [`PlanIndex`]), shared by every service port.
///
/// It stays what a fresh computation would give while only we add or remove
/// Service IPs: ours are left out of both sets whether or not they are on lo
/// yet, and an address we add was never foreign (it would not be a VIP).
#[derive(Clone, Debug)]
pub struct PlanCtx {
    family: IpFamily,
    take_over_vips: bool,
    /// Addresses someone else configured: usable as they are, never ours to add.
    foreign: HashSet<IpAddr>,
    nodeport_ips: Vec<IpAddr>,
}

impl PlanCtx {
    /// `local`: this host's addresses (address, on a loopback interface);
    /// `ours`: the ones we added to lo ourselves.
    pub fn new(
        family: IpFamily,
        opts: &PlanOpts,
        local: &[(IpAddr, bool)],
        ours: &BTreeSet<IpAddr>,
    ) -> PlanCtx {
        let foreign = local
            .iter()
            .map(|(ip, _)| *ip)
            .filter(|ip| !ours.contains(ip))
            .collect();
        let nodeport_ips = local
            .iter()
            .filter(|(ip, lo)| {
                // Without CIDRs, every address on the lo interface is left
                // out, not only loopback ones.
                family.matches(ip)
                    && !ours.contains(ip)
                    && !link_local(ip)
                    && !ip.is_unspecified()
                    && serves_nodeports(&opts.nodeport_addresses, ip)
                    && (!opts.nodeport_addresses.is_empty() || !*lo)
            })
            .map(|(ip, _)| *ip)
            .collect();
        PlanCtx {
            family,
            take_over_vips: opts.take_over_vips,
            foreign,
            nodeport_ips,
        }
    }
}

/// What one service port asks for, whatever the others ask.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claims {
    /// Its listeners in the order [`plan`] adds them. A key may come twice
    /// (an address listed twice): its first spec is the one that counts.
    pub listeners: Vec<(ListenKey, ListenSpec)>,
    /// Service IPs it needs on lo (may repeat).
    pub vips: Vec<IpAddr>,
    /// Why this mode does not serve it at all (SCTP); it then claims nothing.
    pub unsupported: Option<String>,
}

impl Claims {
    /// Each listen key once, with its first spec.
    fn unique_listeners(&self) -> impl Iterator<Item = (&ListenKey, &ListenSpec)> {
        self.listeners
            .iter()
            .enumerate()
            .filter(|(i, (k, _))| !self.listeners[..*i].iter().any(|(p, _)| p == k))
            .map(|(_, (k, s))| (k, s))
    }

    fn unique_vips(&self) -> BTreeSet<IpAddr> {
        self.vips.iter().copied().collect()
    }
}

/// The claims of service port `name` (`sp`), on their own.
pub fn claims(ctx: &PlanCtx, name: &ServicePortName, sp: &ServicePort) -> Claims {
    let mut out = Claims::default();
    if sp.protocol == Protocol::Sctp {
        out.unsupported = Some(format!("{name}: SCTP is not proxied in userspace mode"));
        return out;
    }
    let add = |out: &mut Claims, ip: IpAddr, port: u16, kind: Kind, ranges: &[IpNet]| {
        out.listeners.push((
            ListenKey {
                addr: SocketAddr::new(ip, port),
                protocol: sp.protocol,
            },
            ListenSpec {
                service: name.clone(),
                kind,
                source_ranges: ranges.to_vec(),
            },
        ));
    };
    let vip = |out: &mut Claims, ip: IpAddr, kind: Kind, ranges: &[IpNet]| {
        if !ctx.family.matches(&ip) {
            return;
        }
        // Loopback addresses (all of 127/8) are always local.
        if ctx.foreign.contains(&ip) || ip.is_loopback() {
            add(out, ip, sp.port, kind, ranges);
        } else if ctx.take_over_vips {
            out.vips.push(ip);
            add(out, ip, sp.port, kind, ranges);
        }
        // Otherwise the address is not ours to answer on (no privileges):
        // only NodePorts reach this Service.
    };
    vip(&mut out, sp.cluster_ip, Kind::Cluster, &[]);
    for ip in &sp.external_ips {
        vip(&mut out, *ip, Kind::External, &[]);
    }
    for ip in &sp.load_balancer_ips {
        vip(
            &mut out,
            *ip,
            Kind::External,
            &sp.load_balancer_source_ranges,
        );
    }
    if sp.node_port != 0 {
        for ip in &ctx.nodeport_ips {
            add(&mut out, *ip, sp.node_port, Kind::External, &[]);
        }
    }
    out
}

/// The message for `name` losing `key` to `winner`.
fn conflict(name: &ServicePortName, key: &ListenKey, winner: &ServicePortName) -> String {
    format!(
        "{name}: {}/{} is already served for {winner}",
        key.addr, key.protocol
    )
}

/// `local`: this host's addresses (address, on a loopback interface);
/// `ours`: the ones we added to lo ourselves.
pub fn plan(
    state: &ProxyState,
    opts: &PlanOpts,
    local: &[(IpAddr, bool)],
    ours: &BTreeSet<IpAddr>,
) -> Plan {
    let ctx = PlanCtx::new(state.family, opts, local, ours);
    let mut out = Plan::default();
    for (name, sp) in &state.services {
        let c = claims(&ctx, name, sp);
        if let Some(s) = c.unsupported {
            out.skipped.push(s);
            continue;
        }
        out.vips.extend(c.vips);
        for (key, spec) in c.listeners {
            match out.listeners.entry(key) {
                Entry::Occupied(prev) => {
                    if prev.get().service != *name {
                        out.skipped.push(conflict(name, &key, &prev.get().service));
                    }
                }
                Entry::Vacant(v) => {
                    v.insert(spec);
                }
            }
        }
    }
    out
}

/// What one [`PlanIndex`] update changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Listen keys whose winning spec changed: appeared, went, or now
    /// belongs to another service port or has another kind or ranges.
    pub listeners: BTreeSet<ListenKey>,
    /// Service IPs now needed that were not before.
    pub vips_added: BTreeSet<IpAddr>,
    /// Service IPs no longer needed.
    pub vips_removed: BTreeSet<IpAddr>,
}

/// [`plan`] kept up to date one service port at a time: a change costs
/// O(that service port's claims), not O(all Services). Each listen key keeps
/// all its claimants in name order, so when the winner goes the next one
/// takes over, exactly as a fresh [`plan`] would decide.
#[derive(Clone, Debug)]
pub struct PlanIndex {
    ctx: PlanCtx,
    ports: BTreeMap<ServicePortName, Claims>,
    /// Per listen key, each claimant's first spec, sorted by service port
    /// name: the first one wins.
    keys: HashMap<ListenKey, Vec<ListenSpec>>,
    /// Per Service IP, how many service ports need it.
    vips: HashMap<IpAddr, usize>,
}

impl PlanIndex {
    pub fn new(ctx: PlanCtx) -> PlanIndex {
        PlanIndex {
            ctx,
            ports: BTreeMap::new(),
            keys: HashMap::new(),
            vips: HashMap::new(),
        }
    }

    /// The index of every service port of `state`.
    pub fn build(ctx: PlanCtx, state: &ProxyState) -> PlanIndex {
        let mut ix = PlanIndex::new(ctx);
        // In name order, so pushing keeps each key's claimants sorted.
        for (name, sp) in &state.services {
            let c = claims(&ix.ctx, name, sp);
            for (key, spec) in c.unique_listeners() {
                ix.keys.entry(*key).or_default().push(spec.clone());
            }
            for ip in c.unique_vips() {
                *ix.vips.entry(ip).or_default() += 1;
            }
            ix.ports.insert(name.clone(), c);
        }
        ix
    }

    /// Service port `name` is now `sp` (new or changed).
    pub fn update(&mut self, name: &ServicePortName, sp: &ServicePort) -> Delta {
        let c = claims(&self.ctx, name, sp);
        self.replace(name, Some(c))
    }

    /// Service port `name` is gone.
    pub fn remove(&mut self, name: &ServicePortName) -> Delta {
        self.replace(name, None)
    }

    fn replace(&mut self, name: &ServicePortName, new: Option<Claims>) -> Delta {
        let mut d = Delta::default();
        let old = match &new {
            Some(c) => self.ports.insert(name.clone(), c.clone()),
            None => self.ports.remove(name),
        };
        // Most changes are endpoint changes: the claims stay as they were.
        if old == new {
            return d;
        }
        let empty = Claims::default();
        let old = old.unwrap_or_default();
        let new = new.as_ref().unwrap_or(&empty);

        let mut touched: Vec<(ListenKey, Option<ListenSpec>)> = Vec::new();
        for (key, _) in old.unique_listeners().chain(new.unique_listeners()) {
            if !touched.iter().any(|(k, _)| k == key) {
                touched.push((*key, self.winner(key).cloned()));
            }
        }
        for (key, _) in old.unique_listeners() {
            if let Some(v) = self.keys.get_mut(key) {
                if let Ok(i) = v.binary_search_by(|s| s.service.cmp(name)) {
                    v.remove(i);
                }
                if v.is_empty() {
                    self.keys.remove(key);
                }
            }
        }
        for (key, spec) in new.unique_listeners() {
            let v = self.keys.entry(*key).or_default();
            match v.binary_search_by(|s| s.service.cmp(name)) {
                Ok(i) => v[i] = spec.clone(),
                Err(i) => v.insert(i, spec.clone()),
            }
        }
        for (key, before) in touched {
            if self.winner(&key) != before.as_ref() {
                d.listeners.insert(key);
            }
        }

        let (was, now) = (old.unique_vips(), new.unique_vips());
        for ip in was.difference(&now) {
            if let Some(n) = self.vips.get_mut(ip) {
                *n -= 1;
                if *n == 0 {
                    self.vips.remove(ip);
                    d.vips_removed.insert(*ip);
                }
            }
        }
        for ip in now.difference(&was) {
            let n = self.vips.entry(*ip).or_default();
            *n += 1;
            if *n == 1 {
                d.vips_added.insert(*ip);
            }
        }
        d
    }

    /// Who listens on `key`: the first claimant in name order.
    pub fn winner(&self, key: &ListenKey) -> Option<&ListenSpec> {
        self.keys.get(key).and_then(|v| v.first())
    }

    /// Every listener with its winning spec, in no particular order.
    pub fn listeners(&self) -> impl Iterator<Item = (&ListenKey, &ListenSpec)> {
        self.keys
            .iter()
            .filter_map(|(k, v)| v.first().map(|s| (k, s)))
    }

    /// The service ports that claim `key` but lose it.
    pub fn losers(&self, key: &ListenKey) -> impl Iterator<Item = &ServicePortName> {
        self.keys
            .get(key)
            .into_iter()
            .flat_map(|v| v.iter().skip(1).map(|s| &s.service))
    }

    /// Whether `ip` was, when the index was built, a local address someone
    /// else configured (not one of our Service IPs).
    pub fn is_foreign(&self, ip: &IpAddr) -> bool {
        self.ctx.foreign.contains(ip)
    }

    /// Those addresses.
    pub fn foreign(&self) -> &HashSet<IpAddr> {
        &self.ctx.foreign
    }

    pub fn has_vip(&self, ip: &IpAddr) -> bool {
        self.vips.contains_key(ip)
    }

    /// Every Service IP to hold on lo, in no particular order.
    pub fn vips(&self) -> impl Iterator<Item = &IpAddr> {
        self.vips.keys()
    }

    /// What `name` claims (None when the index does not know it).
    pub fn claims_of(&self, name: &ServicePortName) -> Option<&Claims> {
        self.ports.get(name)
    }

    /// The skip messages of one service port, as [`plan`] words them.
    pub fn skipped_of(&self, name: &ServicePortName) -> Vec<String> {
        let Some(c) = self.ports.get(name) else {
            return Vec::new();
        };
        if let Some(s) = &c.unsupported {
            return vec![s.clone()];
        }
        c.listeners
            .iter()
            .filter_map(|(key, _)| {
                let w = self.winner(key)?;
                (w.service != *name).then(|| conflict(name, key, &w.service))
            })
            .collect()
    }

    /// Every skip message, in [`plan`]'s order (O(all service ports)).
    pub fn skipped(&self) -> Vec<String> {
        self.ports
            .keys()
            .flat_map(|name| self.skipped_of(name))
            .collect()
    }

    /// The same as [`plan`] of the state the index was built and updated
    /// with (O(all service ports)).
    pub fn plan(&self) -> Plan {
        Plan {
            listeners: self.listeners().map(|(k, s)| (*k, s.clone())).collect(),
            vips: self.vips().copied().collect(),
            skipped: self.skipped(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kp_model::{IpFamily, NodeInfo, ServicePort};
    use std::sync::Arc;

    fn sp(name: &str, ip: &str, port: u16, proto: Protocol) -> ServicePort {
        ServicePort::builder("default", name)
            .port_name("p")
            .protocol(proto)
            .cluster_ip(ip)
            .port(port)
            .build()
    }

    fn state(ports: Vec<ServicePort>) -> ProxyState {
        let mut s = ProxyState::new(IpFamily::V4, NodeInfo::default());
        for p in ports {
            s.services.insert(p.name.clone(), Arc::new(p));
        }
        s
    }

    fn key(a: &str, proto: Protocol) -> ListenKey {
        ListenKey {
            addr: a.parse().unwrap(),
            protocol: proto,
        }
    }

    fn local() -> Vec<(IpAddr, bool)> {
        vec![
            ("127.0.0.1".parse().unwrap(), true),
            ("10.100.0.11".parse().unwrap(), false),
            ("10.100.0.51".parse().unwrap(), false),
            ("169.254.1.1".parse().unwrap(), false),
            ("fd00::11".parse().unwrap(), false),
        ]
    }

    #[test]
    fn root_takes_over_every_service_ip() {
        let mut web = sp("web", "10.96.0.10", 80, Protocol::Tcp);
        web.node_port = 30080;
        web.external_ips = vec!["203.0.113.10".parse().unwrap()];
        web.load_balancer_ips = vec!["203.0.113.20".parse().unwrap()];
        web.load_balancer_source_ranges = vec!["10.100.0.100/32".parse().unwrap()];
        let dns = sp("dns", "10.96.0.10", 53, Protocol::Udp);
        let st = state(vec![web, dns]);
        let opts = PlanOpts {
            take_over_vips: true,
            nodeport_addresses: vec![],
        };
        let p = plan(&st, &opts, &local(), &BTreeSet::new());
        let keys: Vec<ListenKey> = p.listeners.keys().copied().collect();
        assert_eq!(
            keys,
            vec![
                key("10.96.0.10:53", Protocol::Udp),
                key("10.96.0.10:80", Protocol::Tcp),
                key("10.100.0.11:30080", Protocol::Tcp),
                key("10.100.0.51:30080", Protocol::Tcp),
                key("203.0.113.10:80", Protocol::Tcp),
                key("203.0.113.20:80", Protocol::Tcp),
            ]
        );
        let vips: Vec<String> = p.vips.iter().map(|v| v.to_string()).collect();
        assert_eq!(vips, vec!["10.96.0.10", "203.0.113.10", "203.0.113.20"]);
        let lb = &p.listeners[&key("203.0.113.20:80", Protocol::Tcp)];
        assert_eq!(lb.kind, Kind::External);
        assert_eq!(lb.source_ranges.len(), 1);
        assert!(p.listeners[&key("203.0.113.10:80", Protocol::Tcp)]
            .source_ranges
            .is_empty());
        assert_eq!(
            p.listeners[&key("10.96.0.10:80", Protocol::Tcp)].kind,
            Kind::Cluster
        );
        assert!(p.skipped.is_empty(), "{:?}", p.skipped);
    }

    #[test]
    fn unprivileged_serves_nodeports_and_local_ips_only() {
        let mut web = sp("web", "10.96.0.10", 80, Protocol::Tcp);
        web.node_port = 30080;
        // An externalIP that is this node's own address works without root.
        web.external_ips = vec![
            "10.100.0.11".parse().unwrap(),
            "203.0.113.10".parse().unwrap(),
        ];
        let st = state(vec![web]);
        let opts = PlanOpts {
            take_over_vips: false,
            nodeport_addresses: vec!["10.100.0.11/32".parse().unwrap()],
        };
        let p = plan(&st, &opts, &local(), &BTreeSet::new());
        let keys: Vec<ListenKey> = p.listeners.keys().copied().collect();
        assert_eq!(
            keys,
            vec![
                key("10.100.0.11:80", Protocol::Tcp),
                key("10.100.0.11:30080", Protocol::Tcp)
            ]
        );
        assert!(p.vips.is_empty());
    }

    #[test]
    fn nodeports_skip_loopback_unless_asked_and_never_use_service_ips() {
        let mut web = sp("web", "10.96.0.10", 80, Protocol::Tcp);
        web.node_port = 30080;
        let st = state(vec![web]);
        let mut l = local();
        // Our own VIP on lo shows up among local addresses: not a node address.
        l.push(("10.96.0.10".parse().unwrap(), true));
        let ours: BTreeSet<IpAddr> = ["10.96.0.10".parse().unwrap()].into();
        let opts = PlanOpts {
            take_over_vips: true,
            nodeport_addresses: vec!["127.0.0.0/8".parse().unwrap()],
        };
        let p = plan(&st, &opts, &l, &ours);
        assert!(p
            .listeners
            .contains_key(&key("127.0.0.1:30080", Protocol::Tcp)));
        assert!(!p
            .listeners
            .contains_key(&key("10.100.0.11:30080", Protocol::Tcp)));
        assert!(p.vips.contains(&"10.96.0.10".parse::<IpAddr>().unwrap()));
        let p = plan(
            &st,
            &PlanOpts {
                take_over_vips: true,
                nodeport_addresses: vec![],
            },
            &l,
            &ours,
        );
        assert!(!p.listeners.keys().any(|k| k.addr.ip().is_loopback()));
        assert!(!p
            .listeners
            .contains_key(&key("10.96.0.10:30080", Protocol::Tcp)));
        assert!(!p
            .listeners
            .contains_key(&key("169.254.1.1:30080", Protocol::Tcp)));
    }

    #[test]
    fn conflicts_and_sctp_are_reported() {
        let a = sp("a", "10.96.0.10", 80, Protocol::Tcp);
        let b = sp("b", "10.96.0.10", 80, Protocol::Tcp);
        let c = sp("c", "10.96.0.11", 80, Protocol::Sctp);
        let st = state(vec![a, b, c]);
        let opts = PlanOpts {
            take_over_vips: true,
            nodeport_addresses: vec![],
        };
        let p = plan(&st, &opts, &local(), &BTreeSet::new());
        assert_eq!(p.listeners.len(), 1);
        assert_eq!(
            p.listeners[&key("10.96.0.10:80", Protocol::Tcp)]
                .service
                .service
                .name,
            "a".into()
        );
        assert_eq!(p.skipped.len(), 2, "{:?}", p.skipped);
        assert!(p.skipped.iter().any(|s| s.contains("SCTP")));
        assert!(!p.vips.contains(&"10.96.0.11".parse::<IpAddr>().unwrap()));
    }

    /// A tiny deterministic generator (no dependency needed for this).
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 33
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn pick<T: Copy>(&mut self, from: &[T]) -> T {
            from[self.below(from.len())]
        }
    }

    /// Slot `i`'s name: a few protocols, SCTP among them.
    fn slot_name(i: usize) -> ServicePortName {
        let proto = [Protocol::Tcp, Protocol::Udp, Protocol::Tcp, Protocol::Sctp][i % 4];
        ServicePortName::new("default", &format!("s{i:02}"), "p", proto)
    }

    /// A service port drawn from small pools, so that addresses and ports
    /// collide often (within one port too: an externalIP equal to its
    /// ClusterIP, one listed twice).
    fn random_port(r: &mut Lcg, name: ServicePortName) -> ServicePort {
        let ips: [IpAddr; 8] = [
            "10.96.0.1".parse().unwrap(),
            "10.96.0.2".parse().unwrap(),
            "10.96.0.3".parse().unwrap(),
            "127.0.0.5".parse().unwrap(),
            // A node address (foreign) and one we hold (ours).
            "10.100.0.11".parse().unwrap(),
            "10.96.9.9".parse().unwrap(),
            "203.0.113.7".parse().unwrap(),
            "fd00::11".parse().unwrap(),
        ];
        let ranges: [IpNet; 2] = [
            "10.100.0.0/24".parse().unwrap(),
            "192.0.2.0/24".parse().unwrap(),
        ];
        let mut p = ServicePort::new(name, r.pick(&ips), r.pick(&[53, 80, 443]));
        p.node_port = r.pick(&[0, 0, 30080, 30081]);
        for _ in 0..r.below(3) {
            p.external_ips.push(r.pick(&ips));
        }
        for _ in 0..r.below(2) {
            p.load_balancer_ips.push(r.pick(&ips));
        }
        for _ in 0..r.below(2) {
            p.load_balancer_source_ranges.push(r.pick(&ranges));
        }
        p
    }

    /// What differs between two plans, as a [`Delta`] would say.
    fn diff(a: &Plan, b: &Plan) -> Delta {
        let keys: BTreeSet<ListenKey> = a
            .listeners
            .keys()
            .chain(b.listeners.keys())
            .copied()
            .collect();
        Delta {
            listeners: keys
                .into_iter()
                .filter(|k| a.listeners.get(k) != b.listeners.get(k))
                .collect(),
            vips_added: b.vips.difference(&a.vips).copied().collect(),
            vips_removed: a.vips.difference(&b.vips).copied().collect(),
        }
    }

    #[test]
    fn index_matches_a_fresh_plan_after_every_change() {
        let mut l = local();
        l.push(("10.96.9.9".parse().unwrap(), true));
        let ours: BTreeSet<IpAddr> = ["10.96.9.9".parse().unwrap()].into();
        let optss = [
            PlanOpts {
                take_over_vips: true,
                nodeport_addresses: vec![],
            },
            PlanOpts {
                take_over_vips: false,
                nodeport_addresses: vec!["10.100.0.0/24".parse().unwrap()],
            },
            PlanOpts {
                take_over_vips: true,
                nodeport_addresses: vec!["127.0.0.0/8".parse().unwrap()],
            },
        ];
        for (round, opts) in optss.iter().enumerate() {
            let mut r = Lcg(0x5eed + round as u64);
            let mut st = state(vec![]);
            let ctx = PlanCtx::new(st.family, opts, &l, &ours);
            let mut ix = PlanIndex::new(ctx.clone());
            let mut before = plan(&st, opts, &l, &ours);
            for step in 0..600 {
                let name = slot_name(r.below(36));
                let d = if st.services.contains_key(&name) && r.below(3) == 0 {
                    st.services.remove(&name);
                    ix.remove(&name)
                } else {
                    let p = random_port(&mut r, name.clone());
                    st.services.insert(name.clone(), Arc::new(p.clone()));
                    ix.update(&name, &p)
                };
                let want = plan(&st, opts, &l, &ours);
                assert_eq!(ix.plan(), want, "round {round} step {step} ({name})");
                assert_eq!(
                    d,
                    diff(&before, &want),
                    "round {round} step {step} ({name})"
                );
                if step % 50 == 0 {
                    assert_eq!(PlanIndex::build(ctx.clone(), &st).plan(), want);
                }
                before = want;
            }
            // Every slot filled at some point, and conflicts happened.
            assert!(st.services.len() > 10, "{}", st.services.len());
            assert!(!before.skipped.is_empty());
        }
    }

    #[test]
    fn index_hands_a_contested_key_to_the_next_claimant() {
        let opts = PlanOpts {
            take_over_vips: true,
            nodeport_addresses: vec![],
        };
        let a = sp("a", "10.96.0.10", 80, Protocol::Tcp);
        let b = sp("b", "10.96.0.10", 80, Protocol::Tcp);
        let c = sp("c", "10.96.0.10", 80, Protocol::Tcp);
        let st = state(vec![a.clone(), b.clone(), c.clone()]);
        let ctx = PlanCtx::new(st.family, &opts, &local(), &BTreeSet::new());
        let mut ix = PlanIndex::build(ctx, &st);
        let k = key("10.96.0.10:80", Protocol::Tcp);
        let vip: IpAddr = "10.96.0.10".parse().unwrap();
        assert_eq!(ix.winner(&k).map(|s| &*s.service.service.name), Some("a"));
        assert_eq!(ix.skipped().len(), 2);
        // A loser going changes nothing a listener sees.
        assert_eq!(ix.remove(&b.name), Delta::default());
        assert_eq!(ix.skipped_of(&c.name).len(), 1);
        // The winner going hands the key over; the address stays needed.
        let d = ix.remove(&a.name);
        assert_eq!(d.listeners, BTreeSet::from([k]));
        assert!(d.vips_removed.is_empty());
        assert_eq!(ix.winner(&k).map(|s| &s.service), Some(&c.name));
        assert!(ix.skipped().is_empty());
        // The last one going releases the address.
        let d = ix.remove(&c.name);
        assert_eq!(d.vips_removed, BTreeSet::from([vip]));
        assert_eq!(ix.plan(), Plan::default());
        // An unknown name is a no-op.
        assert_eq!(ix.remove(&a.name), Delta::default());
    }
}
