//! The socket load balancer's side of a sync: which Service addresses map to
//! which endpoints, written into the maps as differences.
//!
//! One proxier per IP family; both share the maps (keys carry the family,
//! Service port ids are even for IPv4 and odd for IPv6). Every step leaves
//! each Service port usable: endpoints are written before the count that
//! makes them reachable, and removed only after it shrank, so a client never
//! meets a slot without an endpoint. A sync plans all its writes first and
//! sends them phase by phase, each phase as one batch for every Service port
//! ([`Plan`]). A full sync reads the maps back first and takes over what is
//! there (after a restart too), re-creating nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::time::Instant;

use kp_model::{
    Dataplane, DataplaneError, EndpointSelection, ExternalMasquerading, IpFamily, Known, Protocol,
    ProxyState, ServicePort, ServicePortName, SyncReport,
};

use crate::maglev;
use crate::maps::{
    BackendKey, BackendVal, MaglevKey, MaglevVal, MemberKey, SvcKey, SvcVal, FLAG_DSR, FLAG_LOCAL,
    FLAG_MAGLEV,
};
use crate::slots;

/// Programs a dataplane keeps attached to the node's interfaces, put on
/// them at every sync before its map writes.
pub trait Attach: Send {
    fn attach(&mut self) -> Result<(), DataplaneError>;
}

/// The map operations a sync needs (the kernel's, or memory's in tests).
///
/// The plural forms write many entries of one map at once (the kernel's
/// batch commands): the entries of one call do not depend on each other,
/// and each may become visible before the next is written (a batch is not
/// atomic). By default they write one entry after the other.
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

    /// `keys[i] -> vals[i]` for every i (the two are as long).
    fn set_services(&mut self, keys: &[SvcKey], vals: &[SvcVal]) -> Result<(), Refused> {
        each(keys, |i, k| self.set_service(k, value(vals, i)?))
    }
    fn del_services(&mut self, keys: &[SvcKey]) -> Result<(), Refused> {
        each(keys, |_, k| self.del_service(k))
    }
    fn set_backends(&mut self, keys: &[BackendKey], vals: &[BackendVal]) -> Result<(), Refused> {
        each(keys, |i, k| self.set_backend(k, value(vals, i)?))
    }
    fn del_backends(&mut self, keys: &[BackendKey]) -> Result<(), Refused> {
        each(keys, |_, k| self.del_backend(k))
    }
    fn set_members(&mut self, keys: &[MemberKey], slots: &[u32]) -> Result<(), Refused> {
        each(keys, |i, k| self.set_member(k, *value(slots, i)?))
    }
    fn del_members(&mut self, keys: &[MemberKey]) -> Result<(), Refused> {
        each(keys, |_, k| self.del_member(k))
    }
    /// Maglev table chunks (`kp_maglev`, only where the tc programs run).
    fn set_maglev(&mut self, keys: &[MaglevKey], vals: &[MaglevVal]) -> Result<(), Refused>;
    fn del_maglev(&mut self, keys: &[MaglevKey]) -> Result<(), Refused>;
}

/// A write of many entries stopped: those before `index` are done, the one
/// at `index` was refused (and those after it not written).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    pub index: usize,
    pub message: String,
}

/// The value for key `i`.
pub(crate) fn value<V>(vals: &[V], i: usize) -> Result<&V, String> {
    vals.get(i)
        .ok_or_else(|| format!("no value for key {i} of a write of {}", vals.len()))
}

/// One write after the other (`write(i, item)`), stopping at the first
/// refused.
pub(crate) fn each<T>(
    items: &[T],
    mut write: impl FnMut(usize, &T) -> Result<(), String>,
) -> Result<(), Refused> {
    for (index, it) in items.iter().enumerate() {
        write(index, it).map_err(|message| Refused { index, message })?;
    }
    Ok(())
}

/// The content of the three maps the proxy writes.
#[derive(Clone, Debug, Default)]
pub struct Dump {
    pub services: Vec<(SvcKey, SvcVal)>,
    pub backends: Vec<(BackendKey, BackendVal)>,
    pub members: Vec<MemberKey>,
    /// The Maglev chunks there are (their content is rewritten anyway).
    pub maglev: Vec<MaglevKey>,
}

/// What one Service port looks like in the maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Written {
    id: u32,
    keys: BTreeSet<SvcKey>,
    val: SvcVal,
    slots: Vec<BackendVal>,
    members: Members,
    /// Its Maglev table's chunks as written (None: found by a full sync,
    /// content unknown).
    maglev: Vec<Option<MaglevVal>>,
}

/// Which of a Service port's slot endpoints are in `kp_members`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Members {
    /// None: its addresses need none (see [`reads_members`]).
    #[default]
    None,
    /// Every one.
    All,
    /// Some, maybe (found so by a full sync after an interrupted one).
    Some,
}

/// Whether the programs look this Service port's endpoints up in
/// `kp_members`: for UDP (an unconnected socket keeps its endpoint while it
/// is a member). TCP and SCTP never look, so their members are not written:
/// half the entries of a full sync. (If bpf/sock.c ever reads
/// kp_members elsewhere, this must follow.)
fn reads_members(keys: &BTreeSet<SvcKey>) -> bool {
    keys.iter().any(|k| i32::from(k.proto) == libc::IPPROTO_UDP)
}

/// What a Service port should look like: its addresses and endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    pub keys: BTreeSet<SvcKey>,
    pub backends: BTreeSet<BackendVal>,
    /// `SvcVal::flags` (FLAG_LOCAL for [`Scope::Outside`] entries of an
    /// externalTrafficPolicy Local Service).
    pub flags: u32,
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
    /// The same external addresses reached from outside the node, for the
    /// tc programs (`--bpf-nodeport`): externalTrafficPolicy decides, as
    /// it does for nftables' external traffic.
    Outside,
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
    // ClientIP affinity stays with nftables, which keeps one record per
    // client: a connect() made before the Service's first sync gets its SYN
    // retransmit DNATed there, and records of our own would send that
    // client's next connection elsewhere (e2e's Granular Checks).
    if sp.session_affinity_timeout.is_some() {
        return Vec::new();
    }
    // The model's selection, as every dataplane reads it: internal
    // traffic's set, and the cluster set for this node's clients of the
    // external addresses (upstream's short-circuit).
    let sel = EndpointSelection::new(sp, state.endpoints_of(&sp.name), &state.node);
    let set = |v: &[&kp_model::Endpoint]| -> BTreeSet<BackendVal> {
        v.iter().map(|e| BackendVal::new(e.ip, e.port)).collect()
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
    let eb = set(&sel.cluster);
    let ib = if sel.internal.is_local() {
        set(sel.internal_endpoints())
    } else {
        eb.clone()
    };
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
                flags: 0,
            },
        ));
    }
    if !external.is_empty() && !eb.is_empty() {
        out.push((
            Scope::External,
            Wanted {
                keys: external,
                backends: eb,
                flags: 0,
            },
        ));
    }
    out
}

/// `--bpf-lb-mode` (Cilium's): how the tc programs send externalTraffic-
/// Policy Cluster traffic to an endpoint on another node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LbMode {
    /// The request's source becomes the node's address; the reply comes
    /// back through this node.
    #[default]
    Snat,
    /// Direct server return: the client's address is kept, the endpoint's
    /// node replies to the client itself (IPv4; IPv6 stays SNAT).
    Dsr,
    /// DSR for TCP, SNAT for UDP.
    Hybrid,
}

impl LbMode {
    /// The flag name's value (`snat`, `dsr`, `hybrid`).
    pub fn parse(s: &str) -> Option<LbMode> {
        match s {
            "snat" => Some(LbMode::Snat),
            "dsr" => Some(LbMode::Dsr),
            "hybrid" => Some(LbMode::Hybrid),
            _ => None,
        }
    }

    /// Whether a Service port of `proto` gets [`FLAG_DSR`].
    fn dsr_for(self, proto: Protocol) -> bool {
        match self {
            LbMode::Snat => false,
            LbMode::Dsr => true,
            LbMode::Hybrid => proto == Protocol::Tcp,
        }
    }
}

/// What traffic from outside the node to `sp`'s external addresses should
/// be sent to by the tc programs: the cluster endpoints (the programs
/// SNAT), or for externalTrafficPolicy Local this node's (the client's
/// address kept). None where nftables keeps it: no such endpoint (its
/// reject, or eTP=Local's drop), session affinity (nftables' records), a
/// LoadBalancer IP with source ranges (nftables checks them).
pub fn wanted_outside(
    sp: &ServicePort,
    state: &ProxyState,
    nodeport_ips: &[IpAddr],
    maglev: bool,
    mode: LbMode,
) -> Option<Wanted> {
    if sp.session_affinity_timeout.is_some() {
        return None;
    }
    let sel = EndpointSelection::new(sp, state.endpoints_of(&sp.name), &state.node);
    let backends: BTreeSet<BackendVal> = sel
        .external_endpoints()
        .iter()
        .map(|e| BackendVal::new(e.ip, e.port))
        .collect();
    if backends.is_empty() {
        return None;
    }
    let lb_ips: &[IpAddr] = if sp.load_balancer_source_ranges.is_empty() {
        &sp.load_balancer_ips
    } else {
        &[]
    };
    let mut keys: BTreeSet<SvcKey> = sp
        .external_ips
        .iter()
        .chain(lb_ips)
        .map(|ip| SvcKey::new(*ip, sp.port, sp.protocol).outside())
        .collect();
    if sp.node_port != 0 {
        keys.extend(
            nodeport_ips
                .iter()
                .map(|ip| SvcKey::new(*ip, sp.node_port, sp.protocol).outside()),
        );
    }
    if keys.is_empty() {
        return None;
    }
    // The model's masquerade decision for traffic from outside the node:
    // masqueraded (the programs SNAT, or with DSR keep the client's address
    // and have the endpoint's node reply), or the client's address kept
    // (FLAG_LOCAL; from outside, FromNode keeps it too).
    let snat = sel.external_masquerading() == ExternalMasquerading::All;
    Some(Wanted {
        keys,
        backends,
        flags: if snat { 0 } else { FLAG_LOCAL }
            | if maglev { FLAG_MAGLEV } else { 0 }
            | if snat && mode.dsr_for(sp.protocol) {
                FLAG_DSR
            } else {
                0
            },
    })
}

/// An endpoint's identity for its Maglev table: its address and port as
/// the maps hold them, the same bytes on every node.
fn identity(b: &BackendVal) -> [u8; 20] {
    let mut out = [0u8; 20];
    for (i, w) in b.addr.iter().enumerate() {
        out[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
    }
    out[16..18].copy_from_slice(&b.port.to_ne_bytes());
    out
}

/// The writes of one sync, by phase. Each phase needs only the phases
/// before it done, for every Service port at once, so a sync sends each
/// phase as one batch, in this order, and every address stays usable in
/// between (and between any two entries of a batch):
///
/// 1. `members`: the endpoints that take a slot become members (a slot's
///    endpoint is a member wherever the programs look: [`reads_members`]);
/// 2. `backends`: they take their slots;
/// 3. `services`: the addresses get their new count, now that every slot
///    below it is filled; `gone_services`: the addresses that go (an address
///    that another Service port takes in the same sync is not deleted: it
///    moves in one write);
/// 4. `gone_backends`: the slots beyond the counts;
/// 5. `gone_members`: the members that left.
///
/// Keys and values are kept apart, as the kernel takes them.
#[derive(Debug, Default)]
struct Plan {
    member_keys: Vec<MemberKey>,
    member_slots: Vec<u32>,
    backend_keys: Vec<BackendKey>,
    backend_vals: Vec<BackendVal>,
    service_keys: Vec<SvcKey>,
    service_vals: Vec<SvcVal>,
    gone_services: Vec<SvcKey>,
    gone_backends: Vec<BackendKey>,
    gone_members: Vec<MemberKey>,
    /// Maglev chunks: written after the slots they name (2b), removed
    /// after the addresses stopped reading them (4b).
    maglev_keys: Vec<MaglevKey>,
    maglev_vals: Vec<MaglevVal>,
    gone_maglev: Vec<MaglevKey>,
    /// The Service ports removed, by id (for naming them in errors).
    removed: Vec<(u32, String)>,
}

impl Plan {
    fn len(&self) -> usize {
        self.member_keys.len()
            + self.backend_keys.len()
            + self.service_keys.len()
            + self.gone_services.len()
            + self.gone_backends.len()
            + self.gone_members.len()
            + self.maglev_keys.len()
            + self.gone_maglev.len()
    }

    fn member(&mut self, svc_id: u32, backend: BackendVal, slot: u32) {
        self.member_keys.push(MemberKey { svc_id, backend });
        self.member_slots.push(slot);
    }

    fn backend(&mut self, svc_id: u32, slot: u32, b: BackendVal) {
        self.backend_keys.push(BackendKey { svc_id, slot });
        self.backend_vals.push(b);
    }

    /// Drops the deletes of addresses that are written in the same plan.
    fn keep_moved_addresses(&mut self) {
        if self.gone_services.is_empty() {
            return;
        }
        let gone: HashSet<SvcKey> = self.gone_services.iter().copied().collect();
        let taken: HashSet<SvcKey> = self
            .service_keys
            .iter()
            .filter(|k| gone.contains(k))
            .copied()
            .collect();
        if !taken.is_empty() {
            self.gone_services.retain(|k| !taken.contains(k));
        }
    }
}

/// Slots above this are no list of ours: a full sync deletes them on sight
/// instead of making a list that long.
const MAX_SLOT: u32 = 1 << 20;

pub struct SocketLbProxier {
    family: IpFamily,
    maps: Box<dyn Maps>,
    /// What we wrote, per Service port and [`Scope`] (`[Internal, External,
    /// Outside]`).
    written: HashMap<ServicePortName, [Option<Written>; 3]>,
    /// Whether the tc programs run (`--bpf-nodeport`): [`Scope::Outside`]
    /// entries are written.
    outside: bool,
    /// `--bpf-lb-algorithm maglev`: [`Scope::Outside`] entries get Maglev
    /// tables.
    maglev: bool,
    /// `--bpf-lb-mode`: which [`Scope::Outside`] entries get [`FLAG_DSR`].
    lb_mode: LbMode,
    /// This node's addresses that answer NodePorts (this family's).
    nodeport_ips: Vec<IpAddr>,
    /// Found in the maps by a full sync and not yet matched to a Service
    /// port, by id; and their addresses' ids.
    orphans: BTreeMap<u32, Written>,
    orphan_keys: HashMap<SvcKey, u32>,
    free_ids: Vec<u32>,
    /// Ids of Service ports removed by the sync running: reusable once its
    /// writes are done (a new Service port must not write into slots that
    /// an old one's addresses still reach).
    freed_now: Vec<u32>,
    next_id: u32,
    /// Whether `written` is known to be what the maps hold: nothing known
    /// before the first sync and after a failed one (the next is full,
    /// and reads the maps back).
    known: Known<()>,
    /// The tc (and XDP) programs this dataplane keeps attached to the
    /// node's interfaces ([`crate::NodePort`]).
    nodeport: Option<Box<dyn Attach>>,
}

fn err(what: String) -> impl FnOnce(String) -> DataplaneError {
    move |message| DataplaneError::Apply {
        tool: "bpf maps".into(),
        message: format!("{what}: {message}"),
    }
}

fn proto_name(p: u8) -> String {
    match i32::from(p) {
        libc::IPPROTO_TCP => "TCP".into(),
        libc::IPPROTO_UDP => "UDP".into(),
        libc::IPPROTO_SCTP => "SCTP".into(),
        n => format!("protocol {n}"),
    }
}

fn endpoint_text(b: &BackendVal, v4: bool) -> String {
    match b.ip(v4) {
        IpAddr::V6(ip) => format!("[{ip}]:{}", b.port()),
        ip => format!("{ip}:{}", b.port()),
    }
}

fn addr_text(k: &SvcKey) -> String {
    match k.ip() {
        IpAddr::V6(ip) => format!("[{ip}]:{}/{}", k.port(), proto_name(k.proto)),
        ip => format!("{ip}:{}/{}", k.port(), proto_name(k.proto)),
    }
}

impl SocketLbProxier {
    pub fn new(family: IpFamily, maps: Box<dyn Maps>) -> Self {
        SocketLbProxier {
            family,
            maps,
            written: HashMap::new(),
            nodeport_ips: Vec::new(),
            outside: false,
            maglev: false,
            lb_mode: LbMode::Snat,
            orphans: BTreeMap::new(),
            orphan_keys: HashMap::new(),
            free_ids: Vec::new(),
            freed_now: Vec::new(),
            next_id: Self::first_id(family),
            known: Known::default(),
            nodeport: None,
        }
    }

    /// Keeps `links` (the tc and XDP programs, [`crate::NodePort`]) on the
    /// node's interfaces: every sync puts them on interfaces that came up
    /// since (a new pod's) before its map writes, so an interface has its
    /// program before any Service sends to it, and takes them off those
    /// gone.
    pub fn with_nodeport(mut self, links: Box<dyn Attach>) -> Self {
        self.nodeport = Some(links);
        self
    }

    /// Puts the tc (and XDP) programs on the node's interfaces as they
    /// are now.
    fn attach_tc(&mut self) -> Result<(), DataplaneError> {
        match &mut self.nodeport {
            Some(links) => links.attach(),
            None => Ok(()),
        }
    }

    /// Writes the entries the tc programs read for traffic from outside
    /// the node ([`Scope::Outside`]).
    pub fn with_outside(mut self, on: bool) -> Self {
        self.outside = on;
        self
    }

    /// Gives the [`Scope::Outside`] entries Maglev tables.
    pub fn with_maglev(mut self, on: bool) -> Self {
        self.maglev = on;
        self
    }

    /// Direct server return for the [`Scope::Outside`] entries
    /// (`--bpf-lb-mode`).
    pub fn with_lb_mode(mut self, mode: LbMode) -> Self {
        self.lb_mode = mode;
        self
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
            mut members,
            maglev: chunks,
        } = self.maps.dump().map_err(err("reading the maps".into()))?;
        let fam = self.family_byte();
        let mut found: BTreeMap<u32, Written> = BTreeMap::new();
        for (k, v) in services {
            if k.family & !crate::maps::OUTSIDE != fam || !self.ours(v.id) {
                continue;
            }
            let w = found.entry(v.id).or_default();
            w.id = v.id;
            w.val = v;
            w.keys.insert(k);
        }
        let mut stray_slots = Vec::new();
        let mut slots: Vec<(u32, u32, BackendVal)> = Vec::with_capacity(backends.len());
        for (k, v) in backends {
            if !self.ours(k.svc_id) {
                continue;
            }
            if k.slot > MAX_SLOT {
                stray_slots.push(k);
            } else {
                slots.push((k.svc_id, k.slot, v));
            }
        }
        slots.sort_unstable_by_key(|(id, slot, _)| (*id, *slot));
        for group in slots.chunk_by(|a, b| a.0 == b.0) {
            let id = group[0].0;
            let w = found.entry(id).or_insert_with(|| Written {
                id,
                ..Written::default()
            });
            // Slots beyond the count are leftovers of an interrupted sync;
            // kept in the list so that the next write removes them.
            let max = group.last().map_or(0, |g| g.1) as usize;
            w.slots = vec![BackendVal::default(); max + 1];
            for (_, slot, b) in group {
                w.slots[*slot as usize] = *b;
            }
        }
        // Maglev chunks: known to be there, not what they say.
        let mut stray_chunks = Vec::new();
        for k in chunks {
            if !self.ours(k.svc_id) {
                continue;
            }
            match found.get_mut(&k.svc_id) {
                Some(w) if k.chunk < maglev::chunk_count(maglev::MAX_SIZE) => {
                    let n = (k.chunk as usize + 1).max(w.maglev.len());
                    w.maglev.resize(n, None);
                }
                _ => stray_chunks.push(k),
            }
        }
        if !stray_chunks.is_empty() {
            self.maps.del_maglev(&stray_chunks).map_err(|r| {
                self.refused("removing stray Maglev chunks", r, &[], &|i| {
                    stray_chunks
                        .get(i)
                        .map(|k| (k.svc_id, format!("chunk {}", k.chunk)))
                })
            })?;
        }
        // A member without a slot (a sync interrupted between the two
        // writes) would keep UDP flows to it alive: gone now. The
        // others tell whether every slot's endpoint is a member.
        members.retain(|m| self.ours(m.svc_id));
        members.sort_unstable_by_key(|m| m.svc_id);
        let mut stale = Vec::new();
        for group in members.chunk_by(|a, b| a.svc_id == b.svc_id) {
            let Some(w) = found.get_mut(&group[0].svc_id) else {
                stale.extend_from_slice(group);
                continue;
            };
            let mut held: Vec<BackendVal> = w
                .slots
                .iter()
                .filter(|b| **b != BackendVal::default())
                .copied()
                .collect();
            held.sort_unstable();
            held.dedup();
            let mut matched = 0;
            for m in group {
                if held.binary_search(&m.backend).is_ok() {
                    matched += 1;
                } else {
                    stale.push(*m);
                }
            }
            w.members = if matched == held.len() {
                Members::All
            } else {
                Members::Some
            };
        }
        let v4 = self.family == IpFamily::V4;
        let r = if stale.is_empty() {
            Ok(())
        } else {
            self.maps.del_members(&stale)
        };
        r.map_err(|r| {
            self.refused("removing stale members", r, &[], &|i| {
                stale
                    .get(i)
                    .map(|m| (m.svc_id, endpoint_text(&m.backend, v4)))
            })
        })?;
        let r = if stray_slots.is_empty() {
            Ok(())
        } else {
            self.maps.del_backends(&stray_slots)
        };
        r.map_err(|r| {
            self.refused("removing stray slots", r, &[], &|i| {
                stray_slots
                    .get(i)
                    .map(|k| (k.svc_id, format!("slot {}", k.slot)))
            })
        })?;
        self.written.clear();
        self.free_ids.clear();
        self.freed_now.clear();
        let top = found.keys().max().copied();
        self.next_id = match top {
            Some(t) => (t + 2).max(Self::first_id(self.family)),
            None => Self::first_id(self.family),
        };
        self.orphan_keys = found
            .values()
            .flat_map(|w| w.keys.iter().map(|k| (*k, w.id)))
            .collect();
        self.orphans = found;
        Ok(())
    }

    /// An adopted entry one of whose addresses `want` has (the lowest id of
    /// those).
    fn take_orphan(&mut self, want: Option<&Wanted>) -> Option<Written> {
        if self.orphans.is_empty() {
            return None;
        }
        let want = want?;
        let id = want
            .keys
            .iter()
            .filter_map(|k| self.orphan_keys.get(k))
            .copied()
            .filter(|id| self.orphans.contains_key(id))
            .min()?;
        let w = self.orphans.remove(&id)?;
        for k in &w.keys {
            self.orphan_keys.remove(k);
        }
        Some(w)
    }

    /// Plans the writes that take one Service port's `scope` from `old`
    /// (what we wrote; None: maybe adopted) to `want`; what it will be.
    fn sync_one(
        &mut self,
        plan: &mut Plan,
        name: &ServicePortName,
        scope: Scope,
        old: Option<Written>,
        want: Option<Wanted>,
    ) -> Option<Written> {
        let old = old.or_else(|| self.take_orphan(want.as_ref()));
        let Some(want) = want else {
            if let Some(o) = old {
                plan.removed
                    .push((o.id, format!("service port {name} ({scope:?} addresses)")));
                self.remove(plan, &o);
            }
            return None;
        };
        let id = match &old {
            Some(o) => o.id,
            None => self.alloc_id(),
        };
        let old = old.unwrap_or(Written {
            id,
            ..Written::default()
        });
        let slots = slots::assign(&old.slots, &want.backends);
        let reads = reads_members(&want.keys);
        // What the addresses in the maps read until phase 3 rewrites them.
        let read_before = reads_members(&old.keys);
        // Members written only for that time (the new value reads none).
        let mut interim = BTreeSet::new();
        // 1. and 2. Endpoints in their slots, members for the new ones
        // (for all of them where the members were not all there).
        for (i, b) in slots.iter().enumerate() {
            let slot = i as u32;
            let moved = old.slots.get(i) != Some(b);
            if reads && (moved || old.members != Members::All) {
                plan.member(id, *b, slot);
            } else if read_before && moved {
                plan.member(id, *b, slot);
                interim.insert(*b);
            }
            if moved {
                plan.backend(id, slot, *b);
            }
        }
        // 2b. The Maglev table, naming slots that are filled now.
        let mut maglev_now = Vec::new();
        let mut maglev_size = 0;
        if want.flags & FLAG_MAGLEV != 0 {
            let eps: Vec<[u8; 20]> = want.backends.iter().map(identity).collect();
            maglev_size = maglev::table_size(eps.len());
            let table = maglev::table(&eps, maglev_size);
            // Each endpoint's slot, once (not a search of the slots for
            // each of the table's up to 131,071 entries).
            let slot_by_ep: HashMap<&BackendVal, u32> = slots.iter().zip(0u32..).collect();
            let order: Vec<u32> = want
                .backends
                .iter()
                .map(|b| slot_by_ep.get(b).copied().unwrap_or(0))
                .collect();
            let slot_of = |e: u32| order.get(e as usize).copied().unwrap_or(0);
            for (k, v) in maglev::chunks(id, &table, slot_of) {
                if old.maglev.get(k.chunk as usize) != Some(&Some(v)) {
                    plan.maglev_keys.push(k);
                    plan.maglev_vals.push(v);
                }
                maglev_now.push(Some(v));
            }
        }
        plan.gone_maglev
            .extend((maglev_now.len()..old.maglev.len()).map(|c| MaglevKey {
                svc_id: id,
                chunk: c as u32,
            }));
        // 3. The addresses, once every slot below the count is filled.
        let val = SvcVal {
            id,
            count: slots.len() as u32,
            maglev_size,
            flags: want.flags,
        };
        for k in &want.keys {
            if old.val != val || !old.keys.contains(k) {
                plan.service_keys.push(*k);
                plan.service_vals.push(val);
            }
        }
        plan.gone_services
            .extend(old.keys.difference(&want.keys).copied());
        // 4. and 5. What no address reaches (or reads) any more.
        plan.gone_backends
            .extend((slots.len()..old.slots.len()).map(|slot| BackendKey {
                svc_id: id,
                slot: slot as u32,
            }));
        if old.members != Members::None {
            for b in &old.slots {
                if !reads || !want.backends.contains(b) {
                    interim.remove(b);
                    plan.gone_members.push(MemberKey {
                        svc_id: id,
                        backend: *b,
                    });
                }
            }
        }
        plan.gone_members
            .extend(interim.into_iter().map(|b| MemberKey {
                svc_id: id,
                backend: b,
            }));
        Some(Written {
            id,
            keys: want.keys,
            val,
            slots,
            members: if reads { Members::All } else { Members::None },
            maglev: maglev_now,
        })
    }

    /// Plans a Service port's removal: its addresses in phase 3 (clients
    /// then go on to nftables), its endpoints after.
    fn remove(&mut self, plan: &mut Plan, o: &Written) {
        plan.gone_services.extend(o.keys.iter().copied());
        plan.gone_maglev
            .extend((0..o.maglev.len()).map(|c| MaglevKey {
                svc_id: o.id,
                chunk: c as u32,
            }));
        for (slot, b) in o.slots.iter().enumerate() {
            plan.gone_backends.push(BackendKey {
                svc_id: o.id,
                slot: slot as u32,
            });
            if o.members != Members::None {
                plan.gone_members.push(MemberKey {
                    svc_id: o.id,
                    backend: *b,
                });
            }
        }
        self.freed_now.push(o.id);
    }

    /// Writes a plan, phase by phase. On an error the maps hold the phases
    /// before the refused write and part of its own (every address still
    /// usable), and the next sync is a full one, which reads them back and
    /// finishes the job.
    fn flush(&mut self, mut plan: Plan) -> Result<usize, DataplaneError> {
        plan.keep_moved_addresses();
        let ops = plan.len();
        match self.write(&plan) {
            Ok(()) => {
                self.free_ids.append(&mut self.freed_now);
                Ok(ops)
            }
            Err(e) => {
                self.freed_now.clear();
                // Also after a failed cleanup: what `written` says is no
                // longer sure.
                self.known.forget();
                Err(e)
            }
        }
    }

    fn write(&mut self, p: &Plan) -> Result<(), DataplaneError> {
        let v4 = self.family == IpFamily::V4;
        let ep = |b: &BackendVal| endpoint_text(b, v4);
        if !p.member_keys.is_empty() {
            let r = self.maps.set_members(&p.member_keys, &p.member_slots);
            r.map_err(|r| {
                self.refused("adding members", r, &p.removed, &|i| {
                    p.member_keys.get(i).map(|k| (k.svc_id, ep(&k.backend)))
                })
            })?;
        }
        if !p.backend_keys.is_empty() {
            let r = self.maps.set_backends(&p.backend_keys, &p.backend_vals);
            r.map_err(|r| {
                self.refused("filling slots", r, &p.removed, &|i| {
                    let (k, b) = (p.backend_keys.get(i)?, p.backend_vals.get(i)?);
                    Some((k.svc_id, format!("slot {} = {}", k.slot, ep(b))))
                })
            })?;
        }
        if !p.maglev_keys.is_empty() {
            let r = self.maps.set_maglev(&p.maglev_keys, &p.maglev_vals);
            r.map_err(|r| {
                self.refused("writing Maglev tables", r, &p.removed, &|i| {
                    let k = p.maglev_keys.get(i)?;
                    Some((k.svc_id, format!("chunk {}", k.chunk)))
                })
            })?;
        }
        if !p.service_keys.is_empty() {
            let r = self.maps.set_services(&p.service_keys, &p.service_vals);
            r.map_err(|r| {
                self.refused("writing Service addresses", r, &p.removed, &|i| {
                    let (k, v) = (p.service_keys.get(i)?, p.service_vals.get(i)?);
                    Some((v.id, format!("{} -> {} endpoints", addr_text(k), v.count)))
                })
            })?;
        }
        if !p.gone_services.is_empty() {
            let r = self.maps.del_services(&p.gone_services);
            r.map_err(|r| {
                self.refused("removing Service addresses", r, &p.removed, &|i| {
                    p.gone_services.get(i).map(|k| (u32::MAX, addr_text(k)))
                })
            })?;
        }
        if !p.gone_backends.is_empty() {
            let r = self.maps.del_backends(&p.gone_backends);
            r.map_err(|r| {
                self.refused("removing slots", r, &p.removed, &|i| {
                    p.gone_backends
                        .get(i)
                        .map(|k| (k.svc_id, format!("slot {}", k.slot)))
                })
            })?;
        }
        if !p.gone_maglev.is_empty() {
            let r = self.maps.del_maglev(&p.gone_maglev);
            r.map_err(|r| {
                self.refused("removing Maglev chunks", r, &p.removed, &|i| {
                    let k = p.gone_maglev.get(i)?;
                    Some((k.svc_id, format!("chunk {}", k.chunk)))
                })
            })?;
        }
        if !p.gone_members.is_empty() {
            let r = self.maps.del_members(&p.gone_members);
            r.map_err(|r| {
                self.refused("removing members", r, &p.removed, &|i| {
                    p.gone_members.get(i).map(|k| (k.svc_id, ep(&k.backend)))
                })
            })?;
        }
        Ok(())
    }

    /// The error for a refused write: the phase, the entry (`entry(i)`:
    /// its Service port id, u32::MAX for none, and what it says) and the
    /// Service port it belongs to.
    fn refused(
        &self,
        phase: &str,
        r: Refused,
        removed: &[(u32, String)],
        entry: &dyn Fn(usize) -> Option<(u32, String)>,
    ) -> DataplaneError {
        let (id, what) = entry(r.index).unwrap_or((u32::MAX, "?".into()));
        let owner = self
            .written
            .iter()
            .flat_map(|(n, ws)| ws.iter().zip(SCOPES).map(move |(w, s)| (n, s, w)))
            .find(|(_, _, w)| w.as_ref().is_some_and(|w| w.id == id))
            .map(|(n, s, _)| format!("service port {n} ({s:?} addresses)"))
            .or_else(|| {
                removed
                    .iter()
                    .find(|(i, _)| *i == id)
                    .map(|(_, n)| format!("{n}, removed"))
            })
            .or_else(|| (id != u32::MAX).then(|| format!("service port id {id}")));
        DataplaneError::Apply {
            tool: "bpf maps".into(),
            message: format!(
                "{phase}: {what}{}: {} (the sync stopped there, every address still usable; the next full sync writes the rest)",
                owner.map(|o| format!(" of {o}")).unwrap_or_default(),
                r.message,
            ),
        }
    }
}

/// Per Service port, what each [`Scope`] should look like (`[Internal,
/// External, Outside]`; None: nothing).
type Wants<'a> = Vec<(&'a ServicePortName, [Option<Wanted>; 3])>;

const SCOPES: [Scope; 3] = [Scope::Internal, Scope::External, Scope::Outside];

/// What each of `names` should look like. Many names are split over a few
/// threads (the order stays that of `names`).
fn render_all<'a>(
    names: &[&'a ServicePortName],
    state: &ProxyState,
    nodeport_ips: &[IpAddr],
    outside: bool,
    maglev: bool,
    mode: LbMode,
) -> Wants<'a> {
    let one = |out: &mut Wants<'a>, n: &'a ServicePortName| {
        let mut all = [None, None, None];
        if let Some(sp) = state.services.get(n) {
            for (scope, w) in wanted(sp, state, nodeport_ips) {
                all[scope as usize] = Some(w);
            }
            if outside {
                all[Scope::Outside as usize] =
                    wanted_outside(sp, state, nodeport_ips, maglev, mode);
            }
        }
        out.push((n, all));
    };
    let threads = crate::batch::threads(names.len() / 4096);
    let part = |names: &[&'a ServicePortName]| {
        let mut out = Vec::with_capacity(names.len());
        for n in names {
            one(&mut out, n);
        }
        out
    };
    if threads == 1 {
        return part(names);
    }
    let chunks: Vec<_> = names.chunks(names.len().div_ceil(threads)).collect();
    std::thread::scope(|s| {
        let part = &part;
        let rest: Vec<_> = chunks[1..]
            .iter()
            .map(|c| s.spawn(move || part(c)))
            .collect();
        let mut all = part(chunks[0]);
        all.reserve(names.len());
        for h in rest {
            match h.join() {
                Ok(v) => all.extend(v),
                // A panic in wanted() is a bug; it is one here too.
                Err(p) => std::panic::resume_unwind(p),
            }
        }
        all
    })
}

impl Dataplane for SocketLbProxier {
    fn mode(&self) -> kp_model::ProxyMode {
        kp_model::ProxyMode::Nftables
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        self.attach_tc()?;
        let start = Instant::now();
        let full = self.known.begin(full).is_full();
        let names: Vec<&ServicePortName> = if full {
            state.services.keys().collect()
        } else {
            changed.iter().collect()
        };
        // "render": what each Service port should look like; "apply": the
        // map reads (full sync), planning and writes.
        let wants = render_all(
            &names,
            state,
            &self.nodeport_ips,
            self.outside,
            self.maglev,
            self.lb_mode,
        );
        let render = start.elapsed();
        if full {
            self.adopt()?;
        }
        let mut plan = Plan::default();
        if full {
            // Room for writing everything (what a full sync over empty maps
            // does), not grown step by step.
            let (mut keys, mut eps) = (0, 0);
            for w in wants.iter().flat_map(|(_, w)| w.iter().flatten()) {
                keys += w.keys.len();
                eps += w.backends.len();
            }
            plan.backend_keys.reserve(eps);
            plan.backend_vals.reserve(eps);
            plan.service_keys.reserve(keys);
            plan.service_vals.reserve(keys);
            self.written.reserve(wants.len());
        }
        for (name, [internal, external, outside]) in wants {
            let [a, b, c] = self.written.remove(name).unwrap_or_default();
            let now = [
                self.sync_one(&mut plan, name, Scope::Internal, a, internal),
                self.sync_one(&mut plan, name, Scope::External, b, external),
                self.sync_one(&mut plan, name, Scope::Outside, c, outside),
            ];
            if now.iter().any(Option::is_some) {
                self.written.insert(name.clone(), now);
            }
        }
        if full {
            for o in std::mem::take(&mut self.orphans).into_values() {
                plan.removed.push((
                    o.id,
                    format!(
                        "service port id {} (found in the maps, wanted no more)",
                        o.id
                    ),
                ));
                self.remove(&mut plan, &o);
            }
            self.orphan_keys.clear();
        }
        let ops = self.flush(plan)?;
        self.known.done(());
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
            let outside = self
                .outside
                .then(|| wanted_outside(sp, state, &self.nodeport_ips, self.maglev, self.lb_mode))
                .flatten();
            for w in wanted(sp, state, &self.nodeport_ips)
                .into_iter()
                .map(|(_, w)| w)
                .chain(outside)
            {
                let from = if w.keys.iter().any(SvcKey::is_outside) {
                    if w.flags & FLAG_LOCAL != 0 {
                        " from outside, client kept"
                    } else if w.flags & FLAG_DSR != 0 {
                        " from outside, DSR to other nodes, else SNAT"
                    } else {
                        " from outside, SNAT"
                    }
                } else {
                    ""
                };
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
                        "{ip}:{}/{} ({name}{from}) -> {}",
                        k.port(),
                        sp.protocol,
                        eps.join(" ")
                    );
                    out.push('\n');
                }
            }
        }
        out
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        self.adopt()?;
        let mut plan = Plan::default();
        for o in std::mem::take(&mut self.orphans).into_values() {
            self.remove(&mut plan, &o);
        }
        self.orphan_keys.clear();
        self.flush(plan)?;
        Ok(())
    }
}
