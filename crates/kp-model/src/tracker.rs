//! Change tracking: objects come in one at a time, a sync takes one [`ChangeSet`].

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use crate::claims::{
    claims_of, effective_port, AddressKey, ClaimIndex, Claimant, Created, RefusedClaim,
};
use crate::convert::{
    convert_endpoint_slice_shared, convert_node, convert_service, convert_service_cidr,
    ConvertError, SliceEndpoints,
};
use crate::rfc3339::parse_rfc3339;
use crate::topology::categorize_endpoints;
use crate::types::*;

/// Set by the EndpointSlice controller: when the change that produced this slice
/// happened. Used for kubeproxy_network_programming_duration_seconds.
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

#[derive(Clone, Debug)]
pub struct TrackerConfig {
    pub family: IpFamily,
    /// This node's name (--hostname-override or the host name).
    pub node_name: String,
    /// None: the Services without a service.kubernetes.io/service-proxy-name
    /// label are ours; Some(NAME): only those labelled NAME.
    pub service_proxy_name: Option<String>,
}

/// What the dataplanes program: every service port of one family and its endpoints.
#[derive(Clone, Debug)]
pub struct ProxyState {
    pub family: IpFamily,
    pub node: NodeInfo,
    pub services: BTreeMap<ServicePortName, Arc<ServicePort>>,
    /// All endpoints from the slices, merged and de-duplicated; use
    /// [`categorize_endpoints`] to pick the ones traffic goes to.
    pub endpoints: HashMap<ServicePortName, Arc<Vec<Endpoint>>>,
    /// This family's Service ranges, from the cluster's ServiceCIDR objects
    /// (sorted, each once): traffic to an address there that no Service
    /// holds is dropped by the nftables dataplane, as upstream's.
    pub service_cidrs: Vec<ipnet::IpNet>,
}

impl ProxyState {
    pub fn new(family: IpFamily, node: NodeInfo) -> Self {
        ProxyState {
            family,
            node,
            services: BTreeMap::new(),
            endpoints: HashMap::new(),
            service_cidrs: Vec::new(),
        }
    }
    pub fn endpoints_of(&self, name: &ServicePortName) -> &[Endpoint] {
        self.endpoints
            .get(name)
            .map(|v| v.as_slice())
            .unwrap_or(&[])
    }
}

/// A filter for UDP conntrack entries that would keep sending packets to where
/// they no longer belong. Every set field must match.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StaleConntrack {
    pub protocol: Protocol,
    /// Original destination IP (a service IP); None for NodePorts (any node IP).
    pub orig_dst: Option<IpAddr>,
    pub orig_dport: u16,
    /// Reply source (the endpoint the entry was DNATed to); None for all.
    pub reply_src: Option<IpAddr>,
}

/// The result of one [`ChangeTracker::take_changes`].
#[derive(Clone, Debug, Default)]
pub struct ChangeSet {
    /// Service ports whose service or endpoints changed, including deleted ones.
    pub changed: BTreeSet<ServicePortName>,
    /// Conntrack entries to delete once the new rules are in place.
    pub stale: BTreeSet<StaleConntrack>,
    /// When the changes in this set happened (trigger-time annotation, or when
    /// we saw the object): sync end minus these is the programming latency.
    pub trigger_times: Vec<SystemTime>,
    pub service_changes: u64,
    pub endpoint_changes: u64,
    /// Claims that lost an address in this set (to another Service or to a
    /// host process, see [`crate::claims`]); each is reported once, when it
    /// starts losing.
    pub refused: Vec<RefusedClaim>,
}

/// An object that was skipped: the error names it and the field.
#[derive(Clone, Debug)]
pub struct Rejected(pub ConvertError);

/// One Service's converted slices, sorted by slice name (so merging is
/// deterministic). Most Services have one slice: a sorted Vec holds it in
/// ~80 bytes where a BTreeMap's first node took ~800.
#[derive(Default)]
struct Slices(Vec<(String, SliceEndpoints)>);

impl Slices {
    fn find(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(n, _)| n.as_str().cmp(name))
    }
    fn get(&self, name: &str) -> Option<&SliceEndpoints> {
        self.find(name).ok().map(|i| &self.0[i].1)
    }
    fn insert(&mut self, name: String, slice: SliceEndpoints) {
        match self.find(&name) {
            Ok(i) => self.0[i].1 = slice,
            Err(i) => {
                self.0.reserve_exact(1);
                self.0.insert(i, (name, slice));
            }
        }
    }
    fn remove(&mut self, name: &str) {
        if let Ok(i) = self.find(name) {
            self.0.remove(i);
        }
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn values(&self) -> impl Iterator<Item = &SliceEndpoints> {
        self.0.iter().map(|(_, s)| s)
    }
}

/// Collects object updates and turns them into one [`ChangeSet`] per sync.
pub struct ChangeTracker {
    cfg: TrackerConfig,
    services: HashMap<ServiceName, Vec<Arc<ServicePort>>>,
    /// Service -> slice name -> converted slice.
    slices: HashMap<ServiceName, Slices>,
    /// (namespace, slice name) -> the service it belongs to.
    slice_owner: HashMap<(String, String), ServiceName>,
    dirty: HashSet<ServiceName>,
    /// The dirty Services whose object changed (added, updated, deleted),
    /// not only their endpoints: only these can move a claim or a port, so
    /// only these (and the other claimants of what they touch) have their
    /// ports worked out again; the rest keep the ports they have.
    spec_dirty: HashSet<ServiceName>,
    /// This node's zone changed: topology may pick other endpoints for every
    /// service, so the next sync reports all of them even if unchanged.
    node_changed: bool,
    triggers: Vec<SystemTime>,
    service_changes: u64,
    endpoint_changes: u64,
    state: ProxyState,
    /// Each Service's creationTimestamp (who is older wins an address).
    created: HashMap<ServiceName, Created>,
    /// Every claim of every Service, and the host's reserved addresses.
    claims: ClaimIndex,
    /// What each Service has in `claims`.
    service_claims: HashMap<ServiceName, Vec<(AddressKey, Claimant)>>,
    /// Node addresses and ports a host process listens on.
    reserved: BTreeSet<AddressKey>,
    /// Addresses whose claims changed without their Services changing (the
    /// reserved set moved): their claimants are recomputed.
    touched: HashSet<AddressKey>,
    /// Claims each service port lost at the last computation.
    /// Ordered by name, so one Service's ports are one range: a change
    /// looks at its own refusals only (a scan of all of them was 30 ms per
    /// change with thousands of contested NodePorts at 50k Services).
    refused: BTreeMap<ServicePortName, BTreeSet<AddressKey>>,
    /// Endpoints' node, zone and hints, one copy for all slices.
    placements: Placements,
    /// Each ServiceCIDR object's ranges of this family, by object name
    /// (two objects may name the same range: it stays while either does).
    service_cidrs: BTreeMap<String, Vec<ipnet::IpNet>>,
}

fn usable(e: &Endpoint) -> bool {
    e.ready || e.serving
}

impl ChangeTracker {
    pub fn new(cfg: TrackerConfig) -> Self {
        let node = NodeInfo {
            name: cfg.node_name.clone(),
            zone: None,
        };
        let state = ProxyState::new(cfg.family, node);
        ChangeTracker {
            cfg,
            services: HashMap::new(),
            slices: HashMap::new(),
            slice_owner: HashMap::new(),
            dirty: HashSet::new(),
            spec_dirty: HashSet::new(),
            node_changed: false,
            triggers: Vec::new(),
            service_changes: 0,
            endpoint_changes: 0,
            state,
            created: HashMap::new(),
            claims: ClaimIndex::default(),
            service_claims: HashMap::new(),
            reserved: BTreeSet::new(),
            touched: HashSet::new(),
            refused: BTreeMap::new(),
            placements: Placements::default(),
            service_cidrs: BTreeMap::new(),
        }
    }

    pub fn family(&self) -> IpFamily {
        self.cfg.family
    }

    /// The state as of the last [`Self::take_changes`].
    pub fn state(&self) -> &ProxyState {
        &self.state
    }

    /// Changes not yet taken.
    pub fn pending(&self) -> usize {
        self.dirty.len()
    }

    /// (Service, EndpointSlice) updates not yet taken: what the next
    /// [`ChangeSet`] will count in `service_changes` / `endpoint_changes`.
    pub fn pending_changes(&self) -> (u64, u64) {
        (self.service_changes, self.endpoint_changes)
    }

    /// Adds or replaces a Service. On error the previous version (if any) stays.
    /// Returns warnings about fields that were dropped.
    pub fn update_service(
        &mut self,
        svc: &Service,
        now: SystemTime,
    ) -> Result<Vec<String>, Rejected> {
        let mut warnings = Vec::new();
        let ports = convert_service(
            svc,
            self.cfg.family,
            self.cfg.service_proxy_name.as_deref(),
            &mut warnings,
        )
        .map_err(Rejected)?;
        let name = ServiceName::new(
            svc.metadata.namespace.as_deref().unwrap_or("default"),
            svc.metadata.name.as_deref().unwrap_or(""),
        );
        let ports: Vec<Arc<ServicePort>> = ports.into_iter().map(Arc::new).collect();
        let created = Created(
            svc.metadata
                .creation_timestamp
                .as_ref()
                .map(|t| (t.0.as_second(), t.0.subsec_nanosecond())),
        );
        let created_changed = self.created.get(&name).is_some_and(|c| *c != created);
        let changed = match self.services.get(&name) {
            Some(old) => *old != ports || created_changed,
            None => !ports.is_empty(),
        };
        if ports.is_empty() {
            self.created.remove(&name);
        } else {
            self.created.insert(name.clone(), created);
        }
        if ports.is_empty() {
            self.services.remove(&name);
        } else {
            self.services.insert(name.clone(), ports);
        }
        if changed {
            self.service_changes += 1;
            self.triggers.push(now);
            self.spec_dirty.insert(name.clone());
            self.dirty.insert(name);
        }
        Ok(warnings)
    }

    pub fn delete_service(&mut self, namespace: &str, name: &str, now: SystemTime) {
        let key = ServiceName::new(namespace, name);
        self.created.remove(&key);
        if self.services.remove(&key).is_some() {
            self.service_changes += 1;
            self.triggers.push(now);
            self.spec_dirty.insert(key.clone());
            self.dirty.insert(key);
        }
    }

    /// Adds or replaces an EndpointSlice. On error the previous version stays.
    pub fn update_endpoint_slice(
        &mut self,
        slice: &EndpointSlice,
        now: SystemTime,
    ) -> Result<Vec<String>, Rejected> {
        let mut warnings = Vec::new();
        let conv = convert_endpoint_slice_shared(
            slice,
            self.cfg.family,
            &self.cfg.node_name,
            &mut warnings,
            &mut self.placements,
        )
        .map_err(Rejected)?;
        let ns = slice
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let sname = slice.metadata.name.clone().unwrap_or_default();
        let key = (ns, sname.clone());
        let trigger = slice
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(TRIGGER_TIME_ANNOTATION))
            .and_then(|t| parse_rfc3339(t))
            .unwrap_or(now);
        // A slice may have moved to another service (label change): drop it there.
        if let Some(old_owner) = self.slice_owner.get(&key).cloned() {
            if Some(&old_owner) != conv.service.as_ref() {
                self.remove_slice(&key, &old_owner);
                self.triggers.push(trigger);
            }
        }
        let Some(svc) = conv.service.clone() else {
            return Ok(warnings);
        };
        let entry = self.slices.entry(svc.clone()).or_default();
        if entry.get(&sname) != Some(&conv) {
            entry.insert(sname, conv);
            self.slice_owner.insert(key, svc.clone());
            self.endpoint_changes += 1;
            self.triggers.push(trigger);
            self.dirty.insert(svc);
        }
        Ok(warnings)
    }

    pub fn delete_endpoint_slice(&mut self, namespace: &str, name: &str, now: SystemTime) {
        let key = (namespace.to_string(), name.to_string());
        if let Some(owner) = self.slice_owner.get(&key).cloned() {
            self.remove_slice(&key, &owner);
            self.triggers.push(now);
        }
    }

    fn remove_slice(&mut self, key: &(String, String), owner: &ServiceName) {
        self.slice_owner.remove(key);
        if let Some(m) = self.slices.get_mut(owner) {
            m.remove(&key.1);
            if m.is_empty() {
                self.slices.remove(owner);
            }
        }
        self.endpoint_changes += 1;
        self.dirty.insert(owner.clone());
    }

    /// Records this node's labels. A zone change re-evaluates every service
    /// (topology hints depend on it).
    pub fn update_node(&mut self, node: &Node) {
        if node.metadata.name.as_deref() != Some(self.cfg.node_name.as_str()) {
            return;
        }
        let zone = convert_node(node).zone;
        if zone != self.state.node.zone {
            self.state.node.zone = zone;
            self.node_changed = true;
            let all: Vec<ServiceName> = self.services.keys().cloned().collect();
            self.dirty.extend(all);
        }
    }

    /// Adds or replaces a ServiceCIDR object. Returns whether this family's
    /// Service ranges changed (the caller then syncs), and warnings about
    /// ranges that were skipped.
    pub fn update_service_cidr(&mut self, obj: &ServiceCIDR) -> (bool, Vec<String>) {
        let mut warnings = Vec::new();
        let name = obj.metadata.name.clone().unwrap_or_default();
        let fam = self.cfg.family;
        let mine: Vec<ipnet::IpNet> = convert_service_cidr(obj, &mut warnings)
            .into_iter()
            .filter(|n| fam.matches(&n.addr()))
            .collect();
        if mine.is_empty() {
            self.service_cidrs.remove(&name);
        } else {
            self.service_cidrs.insert(name, mine);
        }
        (self.refresh_service_cidrs(), warnings)
    }

    /// Forgets the ServiceCIDR object `name`. Returns whether this family's
    /// Service ranges changed.
    pub fn delete_service_cidr(&mut self, name: &str) -> bool {
        self.service_cidrs.remove(name);
        self.refresh_service_cidrs()
    }

    /// Recomputes the state's ranges from the objects; true if they changed.
    fn refresh_service_cidrs(&mut self) -> bool {
        let all: BTreeSet<ipnet::IpNet> = self.service_cidrs.values().flatten().copied().collect();
        let all: Vec<ipnet::IpNet> = all.into_iter().collect();
        if all == self.state.service_cidrs {
            return false;
        }
        self.state.service_cidrs = all;
        true
    }

    /// Sets the node addresses and ports that host processes listen on:
    /// externalIPs and LoadBalancer IPs there are refused (see
    /// [`crate::claims`]). The caller finds them (this crate does no I/O);
    /// the Services whose claims this changes are recomputed at the next
    /// [`Self::take_changes`].
    pub fn set_host_reserved(&mut self, reserved: BTreeSet<AddressKey>) {
        if reserved == self.reserved {
            return;
        }
        for k in self.reserved.symmetric_difference(&reserved) {
            self.touched.insert(*k);
        }
        for k in self.reserved.difference(&reserved) {
            self.claims.remove(k, &Claimant::host());
        }
        for k in reserved.difference(&self.reserved) {
            self.claims.add(*k, Claimant::host());
        }
        self.reserved = reserved;
    }

    /// Every externalIP and LoadBalancer IP some Service claims: what a
    /// caller needs to check against the host's listeners.
    pub fn claimed_external_ips(&self) -> BTreeSet<IpAddr> {
        self.services
            .values()
            .flatten()
            .flat_map(|p| p.external_ips.iter().chain(p.load_balancer_ips.iter()))
            .copied()
            .collect()
    }

    /// Re-indexes the claims of the Services whose object changed and returns
    /// every Service whose programmed ports may differ: those and all other
    /// claimants of the addresses they (or the reserved set) touched.
    fn update_claims(&mut self, changed: Vec<ServiceName>) -> HashSet<ServiceName> {
        let mut touched = std::mem::take(&mut self.touched);
        for svc in &changed {
            let old = self.service_claims.remove(svc).unwrap_or_default();
            let created = self.created.get(svc).copied().unwrap_or_default();
            let mut new: Vec<(AddressKey, Claimant)> = self
                .services
                .get(svc)
                .into_iter()
                .flatten()
                .flat_map(|p| claims_of(p, created))
                .collect();
            if new == old {
                // Its ports changed, not its addresses: no other
                // claimant's standing moved (at 100k Services, re-checking
                // the Services sharing a contested address on every
                // change was a 3 ms p99).
                if !old.is_empty() {
                    self.service_claims.insert(svc.clone(), old);
                }
                continue;
            }
            for (k, c) in old {
                self.claims.remove(&k, &c);
                touched.insert(k);
            }
            // Kept as long as the Service: collecting made room for four.
            new.shrink_to_fit();
            for (k, c) in &new {
                self.claims.add(*k, c.clone());
                touched.insert(*k);
            }
            if !new.is_empty() {
                self.service_claims.insert(svc.clone(), new);
            }
        }
        let mut todo: HashSet<ServiceName> = changed.into_iter().collect();
        for k in &touched {
            for c in self.claims.claimants(k) {
                if let Some(o) = &c.owner {
                    todo.insert(o.service.clone());
                }
            }
        }
        todo
    }

    /// `svc`'s ports as programmed (addresses it lost removed), and the
    /// claims that started losing since the last time.
    fn effective_ports(
        &mut self,
        svc: &ServiceName,
        refused: &mut Vec<RefusedClaim>,
    ) -> Vec<Arc<ServicePort>> {
        let declared = self.services.get(svc).cloned().unwrap_or_default();
        let created = self.created.get(svc).copied().unwrap_or_default();
        let mut out = Vec::with_capacity(declared.len());
        for p in &declared {
            let lost: BTreeSet<AddressKey> = claims_of(p, created)
                .into_iter()
                .map(|(k, _)| k)
                .filter(|k| !self.claims.owns(k, &p.name))
                .collect();
            let before = self.refused.get(&p.name);
            for k in &lost {
                if before.is_none_or(|b| !b.contains(k)) {
                    refused.push(RefusedClaim {
                        service: p.name.clone(),
                        address: *k,
                        holder: self.claims.winner(k).and_then(|c| c.owner.clone()),
                    });
                }
            }
            if lost.is_empty() {
                self.refused.remove(&p.name);
                out.push(Arc::clone(p));
                continue;
            }
            self.refused.insert(p.name.clone(), lost);
            if let Some(e) = effective_port(p, &self.claims) {
                out.push(Arc::new(e));
            }
        }
        // Ports that went away take their refusals with them.
        let names: BTreeSet<&ServicePortName> = declared.iter().map(|p| &p.name).collect();
        let gone: Vec<ServicePortName> = self
            .refused
            .range(ServicePortName::first_of(svc)..)
            .take_while(|(k, _)| k.service == *svc)
            .filter(|(k, _)| !names.contains(k))
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.refused.remove(&k);
        }
        out
    }

    /// Merged endpoints of one service port across all slices of its service.
    fn merged_endpoints(&self, spn: &ServicePortName) -> Arc<Vec<Endpoint>> {
        let lists: Vec<&Arc<Vec<Endpoint>>> = self
            .slices
            .get(&spn.service)
            .into_iter()
            .flat_map(|slices| slices.values())
            .flat_map(|slice| slice.ports.iter())
            .filter(|((pname, proto), _)| **pname == *spn.port && *proto == spn.protocol)
            .map(|(_, eps)| eps)
            .collect();
        // One slice without duplicates: share its list rather than copy it.
        if let [only] = lists.as_slice() {
            let mut seen = HashSet::with_capacity(only.len());
            if only.iter().all(|ep| seen.insert((ep.ip, ep.port))) {
                return Arc::clone(only);
            }
        }
        let mut out: Vec<Endpoint> = Vec::new();
        let mut index: HashMap<(IpAddr, u16), usize> = HashMap::new();
        for ep in lists.into_iter().flat_map(|eps| eps.iter()) {
            match index.get(&(ep.ip, ep.port)) {
                // Two slices disagree: favour a non-terminating copy
                // (an IP reused by a new pod while the old one
                // terminates, as upstream), then the local copy.
                Some(&i) => {
                    let cur = &out[i];
                    let better = (cur.terminating && !ep.terminating)
                        || (cur.terminating == ep.terminating && ep.is_local && !cur.is_local);
                    if better {
                        out[i] = ep.clone();
                    }
                }
                None => {
                    index.insert((ep.ip, ep.port), out.len());
                    out.push(ep.clone());
                }
            }
        }
        Arc::new(out)
    }

    /// Applies everything since the last call to the state and reports it.
    pub fn take_changes(&mut self) -> ChangeSet {
        let mut cs = ChangeSet {
            trigger_times: std::mem::take(&mut self.triggers),
            service_changes: std::mem::take(&mut self.service_changes),
            endpoint_changes: std::mem::take(&mut self.endpoint_changes),
            ..Default::default()
        };
        let node_changed = std::mem::take(&mut self.node_changed);
        // Taken, not drained: a drain keeps the set's room, and after the
        // first sync (every Service dirty) each later one scanned 100k
        // empty slots at 100k Services (up to 40 us per endpoint change).
        let spec: Vec<ServiceName> = std::mem::take(&mut self.spec_dirty).into_iter().collect();
        let recheck = self.update_claims(spec);
        let mut todo: BTreeSet<ServiceName> = std::mem::take(&mut self.dirty).into_iter().collect();
        todo.extend(recheck.iter().cloned());
        for svc in todo {
            let new_ports = if recheck.contains(&svc) {
                self.recheck_ports(&svc, &mut cs)
            } else {
                // Only its endpoints (or the node's zone) changed: its
                // ports are the ones it has (working them out again was
                // half of an endpoint change's cost at 100k Services).
                self.state
                    .services
                    .range(ServicePortName::first_of(&svc)..)
                    .take_while(|(k, _)| k.service == svc)
                    .map(|(_, p)| Arc::clone(p))
                    .collect()
            };
            for port in new_ports {
                let eps = self.merged_endpoints(&port.name);
                let old_port = self.state.services.get(&port.name).cloned();
                let old_eps = self.state.endpoints.get(&port.name).cloned();
                let port_changed = old_port.as_ref() != Some(&port);
                let eps_changed = old_eps.as_deref().map(|v| v.as_slice()) != Some(&eps[..])
                    && !(old_eps.is_none() && eps.is_empty());
                if !port_changed && !eps_changed && !node_changed {
                    continue;
                }
                if port.protocol == Protocol::Udp {
                    if let Some(op) = &old_port {
                        if port_changed {
                            stale_for_changed_port(op, &port, &mut cs.stale);
                        }
                        let old_slice = old_eps.as_deref().map(|v| v.as_slice()).unwrap_or(&[]);
                        stale_for_endpoints(
                            op,
                            &port,
                            old_slice,
                            &eps,
                            &self.state.node,
                            &mut cs.stale,
                        );
                    } else if !categorize_endpoints(&eps, &port, &self.state.node)
                        .all_reachable
                        .is_empty()
                    {
                        // A new port that has endpoints at once: packets sent to
                        // its IPs before it existed may have left conntrack
                        // entries that bypass the new DNAT (upstream flushes
                        // "newly active" UDP services too).
                        push_all_ips(&port, None, &mut cs.stale);
                    }
                }
                cs.changed.insert(port.name.clone());
                if eps.is_empty() {
                    self.state.endpoints.remove(&port.name);
                } else {
                    self.state.endpoints.insert(port.name.clone(), eps);
                }
                if port_changed {
                    self.state.services.insert(port.name.clone(), port);
                }
            }
        }
        cs
    }

    /// `svc`'s ports worked out again from its object and the claims; the
    /// ports it no longer has are removed from the state and reported.
    fn recheck_ports(&mut self, svc: &ServiceName, cs: &mut ChangeSet) -> Vec<Arc<ServicePort>> {
        let old_names: Vec<ServicePortName> = self
            .state
            .services
            .range(ServicePortName::first_of(svc)..)
            .take_while(|(k, _)| k.service == *svc)
            .map(|(k, _)| k.clone())
            .collect();
        let new_ports = self.effective_ports(svc, &mut cs.refused);
        let new_names: BTreeSet<&ServicePortName> = new_ports.iter().map(|p| &p.name).collect();
        for old in &old_names {
            if !new_names.contains(old) {
                self.state.endpoints.remove(old);
                if let Some(op) = self.state.services.remove(old) {
                    stale_for_removed_port(&op, &mut cs.stale);
                }
                cs.changed.insert(old.clone());
            }
        }
        new_ports
    }
}

fn push_all_ips(sp: &ServicePort, reply_src: Option<IpAddr>, out: &mut BTreeSet<StaleConntrack>) {
    for ip in sp.all_ips() {
        out.insert(StaleConntrack {
            protocol: sp.protocol,
            orig_dst: Some(*ip),
            orig_dport: sp.port,
            reply_src,
        });
    }
    if sp.node_port != 0 {
        out.insert(StaleConntrack {
            protocol: sp.protocol,
            orig_dst: None,
            orig_dport: sp.node_port,
            reply_src,
        });
    }
}

fn stale_for_removed_port(sp: &ServicePort, out: &mut BTreeSet<StaleConntrack>) {
    if sp.protocol == Protocol::Udp {
        push_all_ips(sp, None, out);
    }
}

/// A UDP port whose addresses changed: entries to addresses it no longer has are stale.
fn stale_for_changed_port(
    old: &ServicePort,
    new: &ServicePort,
    out: &mut BTreeSet<StaleConntrack>,
) {
    let new_ips: HashSet<(IpAddr, u16)> = new.all_ips().map(|ip| (*ip, new.port)).collect();
    for ip in old.all_ips() {
        if !new_ips.contains(&(*ip, old.port)) {
            out.insert(StaleConntrack {
                protocol: old.protocol,
                orig_dst: Some(*ip),
                orig_dport: old.port,
                reply_src: None,
            });
        }
    }
    if old.node_port != 0 && old.node_port != new.node_port {
        out.insert(StaleConntrack {
            protocol: old.protocol,
            orig_dst: None,
            orig_dport: old.node_port,
            reply_src: None,
        });
    }
}

/// Endpoints that were usable and are no longer: flows DNATed to them are stale.
/// A port that goes from no usable endpoint to some: flows that were not NATed
/// (sent while it had none) are stale.
fn stale_for_endpoints(
    old: &ServicePort,
    new: &ServicePort,
    old_eps: &[Endpoint],
    new_eps: &[Endpoint],
    node: &NodeInfo,
    out: &mut BTreeSet<StaleConntrack>,
) {
    let old_reach: Vec<&Endpoint> = categorize_endpoints(old_eps, old, node).all_reachable;
    let new_reach: Vec<&Endpoint> = categorize_endpoints(new_eps, new, node).all_reachable;
    let new_set: HashSet<(IpAddr, u16)> = new_reach
        .iter()
        .filter(|e| usable(e))
        .map(|e| (e.ip, e.port))
        .collect();
    for ep in old_reach.iter().filter(|e| usable(e)) {
        if !new_set.contains(&(ep.ip, ep.port)) {
            push_all_ips(old, Some(ep.ip), out);
        }
    }
    if old_reach.is_empty() && !new_reach.is_empty() {
        push_all_ips(new, None, out);
    }
}
