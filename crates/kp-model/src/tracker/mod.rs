//! Change tracking: objects come in one at a time, a sync takes one
//! [`ChangeSet`]. [`ChangeTracker`] is here with what a sync takes; each
//! kind of object it follows has a file of its own: `services.rs`,
//! `slices.rs` (and the trigger-time annotation), `cidrs.rs`
//! (ServiceCIDRs), with `addresses.rs` (the address claims between
//! Services and with the host), `stale.rs` (stale UDP conntrack) and
//! `state.rs` ([`ProxyState`], what the dataplanes program).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Node;

use crate::claims::{AddressKey, ClaimIndex, Claimant, Created, RefusedClaim};
use crate::convert::{convert_node, ConvertError};
use crate::topology::categorize_endpoints;
use crate::types::{
    IpFamily, NodeInfo, Placements, Protocol, ServiceName, ServicePort, ServicePortName,
};

mod addresses;
mod cidrs;
mod services;
mod slices;
mod stale;
mod state;

use slices::Slices;
pub use stale::StaleConntrack;
use stale::{push_all_ips, stale_for_changed_port, stale_for_endpoints, stale_for_removed_port};
pub use state::ProxyState;

#[derive(Clone, Debug)]
pub struct TrackerConfig {
    pub family: IpFamily,
    /// This node's name (--hostname-override or the host name).
    pub node_name: String,
    /// None: the Services without a service.kubernetes.io/service-proxy-name
    /// label are ours; Some(NAME): only those labelled NAME.
    pub service_proxy_name: Option<String>,
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
