//! Who owns an address: the one rule every dataplane follows when two
//! Services (or a Service and a host process) claim the same IP, protocol
//! and port, or the same NodePort.
//!
//! The rule (docs/reliability.md, "Address ownership"):
//!
//! 1. A host process listening on a node address and port keeps it: a
//!    Service's externalIP or LoadBalancer IP on it is refused (the
//!    CVE-2020-8554 shape: a Service hijacking the node's SSH or kubelet).
//! 2. A ClusterIP beats an externalIP or LoadBalancer IP.
//! 3. Then the oldest Service (creationTimestamp; unknown counts as newest).
//! 4. Then namespace/name and port name, in order.
//!
//! The winner depends only on the claims, never on the order in which they
//! arrived, so restarts, full rebuilds and partial syncs in any order all
//! program the same owner, and when the owner goes, the next claimant gets
//! the address in the same sync. Pure: the host's listeners are an input.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;

use crate::types::{Protocol, ServicePort, ServicePortName};

/// An address as the dataplanes key it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AddressKey {
    /// ClusterIP, externalIP or LoadBalancer IP, protocol and port.
    Ip(IpAddr, Protocol, u16),
    /// A NodePort (any node address).
    NodePort(Protocol, u16),
}

impl fmt::Display for AddressKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AddressKey::Ip(ip, p, port) => {
                write!(f, "{}/{p}", std::net::SocketAddr::new(*ip, *port))
            }
            AddressKey::NodePort(p, port) => write!(f, "nodePort {port}/{p}"),
        }
    }
}

/// How a claim was made; the variant order is the precedence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ClaimKind {
    /// A process on the node listens there.
    Host,
    ClusterIp,
    /// An externalIP or a LoadBalancer ingress IP.
    External,
    NodePort,
}

/// When a Service was created, for the "oldest wins" step: seconds and
/// nanoseconds since the epoch; None (a manifest without the field) sorts
/// after every known time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Created(pub Option<(i64, i32)>);

impl Created {
    fn sort_key(self) -> (bool, i64, i32) {
        match self.0 {
            Some((s, n)) => (false, s, n),
            None => (true, 0, 0),
        }
    }
}

/// One claim on one address. Ordered by precedence: the smallest wins.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Claimant {
    pub kind: ClaimKind,
    pub created: Created,
    /// None for a host process.
    pub owner: Option<ServicePortName>,
}

impl Claimant {
    pub fn host() -> Self {
        Claimant {
            kind: ClaimKind::Host,
            created: Created::default(),
            owner: None,
        }
    }
}

impl Ord for Claimant {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.kind, self.created.sort_key(), &self.owner).cmp(&(
            other.kind,
            other.created.sort_key(),
            &other.owner,
        ))
    }
}

impl PartialOrd for Claimant {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// Every address `sp` answers on, with the kind of each claim. An
/// externalIP equal to the port's own ClusterIP, or listed both as
/// externalIP and LoadBalancer IP, is one claim.
pub fn claims_of(sp: &ServicePort, created: Created) -> Vec<(AddressKey, Claimant)> {
    let claim = |kind| Claimant {
        kind,
        created,
        owner: Some(sp.name.clone()),
    };
    let mut out = vec![(
        AddressKey::Ip(sp.cluster_ip, sp.protocol, sp.port),
        claim(ClaimKind::ClusterIp),
    )];
    let mut seen = BTreeSet::new();
    for ip in sp.external_ips.iter().chain(sp.load_balancer_ips.iter()) {
        if *ip != sp.cluster_ip && seen.insert(*ip) {
            out.push((
                AddressKey::Ip(*ip, sp.protocol, sp.port),
                claim(ClaimKind::External),
            ));
        }
    }
    if sp.node_port != 0 {
        out.push((
            AddressKey::NodePort(sp.protocol, sp.node_port),
            claim(ClaimKind::NodePort),
        ));
    }
    out
}

/// The claims on every address, for finding each one's winner. Each
/// address's claims are a sorted Vec, winner first: nearly every address has
/// one claimant, and a BTreeSet's first node would hold room for eleven
/// (22 MB of the 104 MB live heap at 10k Services).
#[derive(Clone, Debug, Default)]
pub struct ClaimIndex {
    by_key: HashMap<AddressKey, Vec<Claimant>>,
}

impl ClaimIndex {
    pub fn add(&mut self, key: AddressKey, c: Claimant) {
        let v = self.by_key.entry(key).or_default();
        if let Err(i) = v.binary_search(&c) {
            // A Vec's first push makes room for four; nearly every address
            // keeps one claimant (36 MB of spare room at 100k Services).
            if v.is_empty() {
                v.reserve_exact(1);
            }
            v.insert(i, c);
        }
    }

    pub fn remove(&mut self, key: &AddressKey, c: &Claimant) {
        if let Some(v) = self.by_key.get_mut(key) {
            if let Ok(i) = v.binary_search(c) {
                v.remove(i);
            }
            if v.is_empty() {
                self.by_key.remove(key);
            }
        }
    }

    /// The claim that owns `key`.
    pub fn winner(&self, key: &AddressKey) -> Option<&Claimant> {
        self.by_key.get(key).and_then(|v| v.first())
    }

    /// Every claim on `key`, winner first.
    pub fn claimants(&self, key: &AddressKey) -> impl Iterator<Item = &Claimant> {
        self.by_key.get(key).into_iter().flatten()
    }

    /// True when `name` owns `key`.
    pub fn owns(&self, key: &AddressKey, name: &ServicePortName) -> bool {
        self.winner(key).and_then(|c| c.owner.as_ref()) == Some(name)
    }
}

/// A claim that lost: the address stays with `holder` (None: a host process).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RefusedClaim {
    pub service: ServicePortName,
    pub address: AddressKey,
    pub holder: Option<ServicePortName>,
}

impl fmt::Display for RefusedClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.holder {
            Some(h) => write!(
                f,
                "{} claims {}, which belongs to {h}",
                self.service, self.address
            ),
            None => write!(
                f,
                "{} claims {}, where a process on this node listens",
                self.service, self.address
            ),
        }
    }
}

/// `sp` as programmed: the externalIPs, LoadBalancer IPs and NodePort it
/// does not own removed; None when it does not own its ClusterIP (it then
/// has no address of its own to answer on).
pub fn effective_port(sp: &ServicePort, index: &ClaimIndex) -> Option<ServicePort> {
    let owns = |key: AddressKey| index.owns(&key, &sp.name);
    if !owns(AddressKey::Ip(sp.cluster_ip, sp.protocol, sp.port)) {
        return None;
    }
    let mut out = sp.clone();
    let keep =
        |ip: &IpAddr| *ip == sp.cluster_ip || owns(AddressKey::Ip(*ip, sp.protocol, sp.port));
    out.external_ips.retain(keep);
    out.load_balancer_ips.retain(keep);
    if sp.node_port != 0 && !owns(AddressKey::NodePort(sp.protocol, sp.node_port)) {
        out.node_port = 0;
    }
    // eTP=Local only means something while the port is reachable from
    // outside (as convert_service sets it).
    out.external_policy_local = sp.external_policy_local && out.externally_accessible();
    Some(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a panic is its failure
    use super::*;

    /// An address with one claimant, as nearly all are, holds room for one:
    /// the index is kept for every address of every Service.
    #[test]
    fn one_claimant_takes_room_for_one() {
        let mut idx = ClaimIndex::default();
        let key = AddressKey::NodePort(Protocol::Tcp, 30000);
        let name = |svc: &str| Some(ServicePortName::new("ns", svc, "p", Protocol::Tcp));
        let claim = |owner| Claimant {
            kind: ClaimKind::NodePort,
            created: Created::default(),
            owner,
        };
        idx.add(key, claim(name("b")));
        assert_eq!(idx.by_key[&key].capacity(), 1);
        idx.add(key, claim(name("a")));
        assert_eq!(idx.winner(&key).unwrap().owner, name("a"));
        idx.remove(&key, &claim(name("a")));
        idx.remove(&key, &claim(name("b")));
        assert!(idx.winner(&key).is_none());
    }
}
