//! The socket load balancer's side of a sync: which Service addresses map to
//! which endpoints, written into the maps as differences.
//!
//! One proxier per IP family; both share the maps (keys carry the family,
//! Service port ids are even for IPv4 and odd for IPv6). Every step leaves
//! each Service port usable: endpoints are written before the count that
//! makes them reachable, and removed only after it shrank, so a client never
//! meets a slot without an endpoint. A full sync reads the maps back first
//! and takes over what is there (after a restart too), re-creating nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::time::Instant;

use kp_model::{
    categorize_endpoints, Dataplane, DataplaneError, IpFamily, ProxyState, ServicePort,
    ServicePortName, SyncReport,
};

use crate::maps::{BackendKey, BackendVal, MemberKey, SvcKey, SvcVal};
use crate::slots;

/// The map operations a sync needs (the kernel's, or memory's in tests).
pub trait Maps: Send {
    fn set_service(&mut self, k: &SvcKey, v: &SvcVal) -> Result<(), String>;
    /// Deletes succeed when the key is already gone (a full sync repairing
    /// an interrupted one meets such holes).
    fn del_service(&mut self, k: &SvcKey) -> Result<(), String>;
    fn set_backend(&mut self, k: &BackendKey, v: &BackendVal) -> Result<(), String>;
    fn del_backend(&mut self, k: &BackendKey) -> Result<(), String>;
    fn set_member(&mut self, k: &MemberKey, slot: u32) -> Result<(), String>;
    fn del_member(&mut self, k: &MemberKey) -> Result<(), String>;
    /// Everything the proxy writes, as it is in the maps now.
    fn dump(&self) -> Result<Dump, String>;
}

/// The content of the three maps the proxy writes.
#[derive(Clone, Debug, Default)]
pub struct Dump {
    pub services: Vec<(SvcKey, SvcVal)>,
    pub backends: Vec<(BackendKey, BackendVal)>,
    pub members: Vec<MemberKey>,
}

/// What one Service port looks like in the maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Written {
    id: u32,
    keys: BTreeSet<SvcKey>,
    val: SvcVal,
    slots: Vec<BackendVal>,
}

/// What a Service port should look like: its addresses, endpoints, affinity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    pub keys: BTreeSet<SvcKey>,
    pub backends: BTreeSet<BackendVal>,
    pub affinity_timeout_s: u32,
}

/// Which of a Service port's addresses an entry holds: they may need
/// different endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// The ClusterIP: internalTrafficPolicy decides.
    Internal,
    /// externalIPs, LoadBalancer IPs and this node's NodePorts, reached
    /// from this node: the cluster endpoints whatever the
    /// externalTrafficPolicy, as upstream short-circuits traffic from
    /// local pods and from the node itself to them.
    External,
}

/// What the clients on this node of `sp` should be sent to, per [`Scope`]:
/// a client here is internal traffic to the ClusterIP (internalTraffic-
/// Policy decides; topology and the terminating fallback as the model
/// computed them), and goes to the cluster endpoints for the external
/// addresses. A scope without endpoints is absent: its addresses are left to
/// nftables, which rejects or drops. `nodeport_ips`: this node's addresses
/// that answer NodePorts.
pub fn wanted(
    sp: &ServicePort,
    state: &ProxyState,
    nodeport_ips: &[IpAddr],
) -> Vec<(Scope, Wanted)> {
    let eps = state.endpoints_of(&sp.name);
    let cat = categorize_endpoints(eps, sp, &state.node);
    let affinity_timeout_s = sp.session_affinity_timeout.unwrap_or(0);
    let set = |v: &[&kp_model::Endpoint]| -> BTreeSet<BackendVal> {
        v.iter().map(|e| BackendVal::new(e.ip, e.port)).collect()
    };
    let internal_eps = if sp.internal_policy_local {
        &cat.local
    } else {
        &cat.cluster
    };
    let mut internal: BTreeSet<SvcKey> = BTreeSet::new();
    if !sp.cluster_ip.is_unspecified() {
        internal.insert(SvcKey::new(sp.cluster_ip, sp.port, sp.protocol));
    }
    // LoadBalancer IPs restricted by loadBalancerSourceRanges stay with
    // nftables, which checks the client's address (a socket hook would let
    // every local client through).
    let lb_ips: &[IpAddr] = if sp.load_balancer_source_ranges.is_empty() {
        &sp.load_balancer_ips
    } else {
        &[]
    };
    let mut external: BTreeSet<SvcKey> = sp
        .external_ips
        .iter()
        .chain(lb_ips)
        .map(|ip| SvcKey::new(*ip, sp.port, sp.protocol))
        .collect();
    if sp.node_port != 0 {
        external.extend(
            nodeport_ips
                .iter()
                .map(|ip| SvcKey::new(*ip, sp.node_port, sp.protocol)),
        );
    }
    let mut out = Vec::new();
    let (ib, eb) = (set(internal_eps), set(&cat.cluster));
    if !internal.is_empty() && !ib.is_empty() {
        if ib == eb {
            // One entry for both when the endpoints are the same.
            internal.append(&mut external);
        }
        out.push((
            Scope::Internal,
            Wanted {
                keys: internal,
                backends: ib,
                affinity_timeout_s,
            },
        ));
    }
    if !external.is_empty() && !eb.is_empty() {
        out.push((
            Scope::External,
            Wanted {
                keys: external,
                backends: eb,
                affinity_timeout_s,
            },
        ));
    }
    out
}

pub struct SocketLbProxier {
    family: IpFamily,
    maps: Box<dyn Maps>,
    written: HashMap<(ServicePortName, Scope), Written>,
    /// This node's addresses that answer NodePorts (this family's).
    nodeport_ips: Vec<IpAddr>,
    /// Found in the maps by a full sync and not yet matched to a Service
    /// port, by id.
    orphans: BTreeMap<u32, Written>,
    free_ids: Vec<u32>,
    next_id: u32,
    synced_once: bool,
}

fn err(what: String) -> impl FnOnce(String) -> DataplaneError {
    move |message| DataplaneError::Apply {
        tool: "bpf maps".into(),
        message: format!("{what}: {message}"),
    }
}

impl SocketLbProxier {
    pub fn new(family: IpFamily, maps: Box<dyn Maps>) -> Self {
        SocketLbProxier {
            family,
            maps,
            written: HashMap::new(),
            nodeport_ips: Vec::new(),
            orphans: BTreeMap::new(),
            free_ids: Vec::new(),
            next_id: Self::first_id(family),
            synced_once: false,
        }
    }

    /// Local connections to these addresses' NodePorts are balanced too.
    pub fn with_nodeport_ips(mut self, ips: Vec<IpAddr>) -> Self {
        self.nodeport_ips = ips;
        self
    }

    fn first_id(family: IpFamily) -> u32 {
        match family {
            IpFamily::V4 => 2,
            IpFamily::V6 => 1,
        }
    }

    fn ours(&self, id: u32) -> bool {
        id % 2 == Self::first_id(self.family) % 2
    }

    fn family_byte(&self) -> u8 {
        match self.family {
            IpFamily::V4 => 4,
            IpFamily::V6 => 6,
        }
    }

    fn alloc_id(&mut self) -> u32 {
        if let Some(id) = self.free_ids.pop() {
            return id;
        }
        let id = self.next_id;
        self.next_id += 2;
        id
    }

    /// Re-reads this family's entries from the maps into `orphans`.
    fn adopt(&mut self) -> Result<(), DataplaneError> {
        let Dump {
            services,
            backends,
            members,
        } = self.maps.dump().map_err(err("reading the maps".into()))?;
        let fam = self.family_byte();
        let mut found: BTreeMap<u32, Written> = BTreeMap::new();
        for (k, v) in services {
            if k.family != fam || !self.ours(v.id) {
                continue;
            }
            let w = found.entry(v.id).or_default();
            w.id = v.id;
            w.val = v;
            w.keys.insert(k);
        }
        let mut slots: BTreeMap<u32, BTreeMap<u32, BackendVal>> = BTreeMap::new();
        for (k, v) in backends {
            if self.ours(k.svc_id) {
                slots.entry(k.svc_id).or_default().insert(k.slot, v);
            }
        }
        for (id, by_slot) in slots {
            let w = found.entry(id).or_insert_with(|| Written {
                id,
                ..Written::default()
            });
            // Slots beyond the count are leftovers of an interrupted sync;
            // kept in the list so that the next write removes them.
            let max = by_slot.keys().max().copied().unwrap_or(0);
            w.slots = (0..=max)
                .map(|s| by_slot.get(&s).copied().unwrap_or_default())
                .collect();
        }
        // A member without a slot (a sync interrupted between the two
        // writes) would keep affinity entries to it alive: gone now.
        for m in &members {
            let in_slot = found
                .get(&m.svc_id)
                .is_some_and(|w| w.slots.contains(&m.backend));
            if self.ours(m.svc_id) && !in_slot {
                self.maps
                    .del_member(m)
                    .map_err(err("removing a stale member".into()))?;
            }
        }
        self.written.clear();
        self.free_ids.clear();
        let top = found.keys().max().copied();
        self.next_id = match top {
            Some(t) => (t + 2).max(Self::first_id(self.family)),
            None => Self::first_id(self.family),
        };
        self.orphans = found;
        Ok(())
    }

    /// The previous state of a Service port: what we wrote, or an adopted
    /// entry one of whose addresses it wants.
    fn take_old(
        &mut self,
        name: &(ServicePortName, Scope),
        want: Option<&Wanted>,
    ) -> Option<Written> {
        if let Some(w) = self.written.remove(name) {
            return Some(w);
        }
        let want = want?;
        let id = self
            .orphans
            .values()
            .find(|w| w.keys.iter().any(|k| want.keys.contains(k)))
            .map(|w| w.id)?;
        self.orphans.remove(&id)
    }

    fn sync_one(
        &mut self,
        name: &(ServicePortName, Scope),
        want: Option<Wanted>,
    ) -> Result<usize, DataplaneError> {
        let old = self.take_old(name, want.as_ref());
        let Some(want) = want else {
            return match old {
                Some(o) => self.remove(&o),
                None => Ok(0),
            };
        };
        let mut ops = 0;
        let id = match &old {
            Some(o) => o.id,
            None => self.alloc_id(),
        };
        let old = old.unwrap_or(Written {
            id,
            ..Written::default()
        });
        let slots = slots::assign(&old.slots, &want.backends);
        let what = || format!("service port {} ({:?} addresses)", name.0, name.1);
        // 1. Endpoints in their slots, members for the new ones.
        for (i, b) in slots.iter().enumerate() {
            let slot = i as u32;
            if old.slots.get(i) != Some(b) {
                // Member first: a slot's endpoint is always a member.
                self.maps
                    .set_member(
                        &MemberKey {
                            svc_id: id,
                            backend: *b,
                        },
                        slot,
                    )
                    .map_err(err(what()))?;
                let k = BackendKey { svc_id: id, slot };
                self.maps.set_backend(&k, b).map_err(err(what()))?;
                ops += 2;
            }
        }
        // 2. The addresses, now that every slot below the count is filled.
        let val = SvcVal {
            id,
            count: slots.len() as u32,
            affinity_timeout_s: want.affinity_timeout_s,
            flags: 0,
        };
        for k in &want.keys {
            if old.val != val || !old.keys.contains(k) {
                self.maps.set_service(k, &val).map_err(err(what()))?;
                ops += 1;
            }
        }
        for k in old.keys.difference(&want.keys) {
            self.maps.del_service(k).map_err(err(what()))?;
            ops += 1;
        }
        // 3. What no address reaches any more.
        for slot in slots.len()..old.slots.len() {
            let k = BackendKey {
                svc_id: id,
                slot: slot as u32,
            };
            self.maps.del_backend(&k).map_err(err(what()))?;
            ops += 1;
        }
        for b in old.slots.iter().filter(|b| !want.backends.contains(b)) {
            self.maps
                .del_member(&MemberKey {
                    svc_id: id,
                    backend: *b,
                })
                .map_err(err(what()))?;
            ops += 1;
        }
        self.written.insert(
            name.clone(),
            Written {
                id,
                keys: want.keys,
                val,
                slots,
            },
        );
        Ok(ops)
    }

    /// Removes a Service port: its addresses first (clients then go on to
    /// nftables), then its endpoints.
    fn remove(&mut self, o: &Written) -> Result<usize, DataplaneError> {
        let what = || format!("service port id {}", o.id);
        for k in &o.keys {
            self.maps.del_service(k).map_err(err(what()))?;
        }
        for (slot, b) in o.slots.iter().enumerate() {
            self.maps
                .del_backend(&BackendKey {
                    svc_id: o.id,
                    slot: slot as u32,
                })
                .map_err(err(what()))?;
            self.maps
                .del_member(&MemberKey {
                    svc_id: o.id,
                    backend: *b,
                })
                .map_err(err(what()))?;
        }
        self.free_ids.push(o.id);
        Ok(o.keys.len() + 2 * o.slots.len())
    }
}

impl Dataplane for SocketLbProxier {
    fn mode(&self) -> kp_model::DataplaneKind {
        kp_model::DataplaneKind::SocketLb
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        let start = Instant::now();
        let full = full || !self.synced_once;
        let mut ops = 0;
        let names: Vec<&ServicePortName> = if full {
            state.services.keys().collect()
        } else {
            changed.iter().collect()
        };
        // "render": what each Service port should look like; "apply": the
        // map reads (full sync) and writes.
        let mut wants: Vec<((ServicePortName, Scope), Option<Wanted>)> = Vec::new();
        for n in names {
            let mut got = match state.services.get(n) {
                Some(sp) => wanted(sp, state, &self.nodeport_ips),
                None => Vec::new(),
            };
            for scope in [Scope::Internal, Scope::External] {
                let i = got.iter().position(|(s, _)| *s == scope);
                let want = i.map(|i| got.swap_remove(i).1);
                wants.push(((n.clone(), scope), want));
            }
        }
        let render = start.elapsed();
        if full {
            self.adopt()?;
        }
        for (name, want) in wants {
            ops += self.sync_one(&name, want)?;
        }
        if full {
            for o in std::mem::take(&mut self.orphans).into_values() {
                ops += self.remove(&o)?;
            }
        }
        self.synced_once = true;
        Ok(SyncReport {
            full,
            ops,
            render,
            apply: start.elapsed() - render,
            ..SyncReport::default()
        })
    }

    fn render(&self, state: &ProxyState) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# socket load balancing ({}): service address -> endpoints",
            self.family
        );
        let v4 = self.family == IpFamily::V4;
        for (name, sp) in &state.services {
            for (_, w) in wanted(sp, state, &self.nodeport_ips) {
                for k in &w.keys {
                    let eps: Vec<String> = w
                        .backends
                        .iter()
                        .map(|b| match b.ip(v4) {
                            std::net::IpAddr::V6(ip) => format!("[{ip}]:{}", b.port()),
                            ip => format!("{ip}:{}", b.port()),
                        })
                        .collect();
                    let ip = match k.ip() {
                        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
                        ip => ip.to_string(),
                    };
                    let _ = write!(
                        out,
                        "{ip}:{}/{} ({name}) -> {}",
                        k.port(),
                        sp.protocol,
                        eps.join(" ")
                    );
                    if w.affinity_timeout_s > 0 {
                        let _ = write!(out, " affinity {}s", w.affinity_timeout_s);
                    }
                    out.push('\n');
                }
            }
        }
        out
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        self.adopt()?;
        for o in std::mem::take(&mut self.orphans).into_values() {
            self.remove(&o)?;
        }
        Ok(())
    }
}
