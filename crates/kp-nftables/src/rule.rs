//! The handful of rule shapes the per-Service chains use, built as typed
//! [`Rule`]s (see types/expr.rs) so that both backends get them without any
//! nft text in between.

use std::net::SocketAddr;

use ipnet::IpNet;
use kp_model::{ClusterIpMasquerading, IpFamily, LocalDetector, Protocol};

use crate::names::MARK_MASQ_CHAIN;
use crate::types::{Addr, AddrValue, Expr, KeyField, MapName, PickKey, Rule, Slots, Verdict};

fn jump_masq() -> Expr {
    Expr::Verdict(Verdict::Jump(MARK_MASQ_CHAIN.into()))
}

fn same_family(fam: IpFamily, n: &IpNet) -> bool {
    matches!(
        (fam, n),
        (IpFamily::V4, IpNet::V4(_)) | (IpFamily::V6, IpNet::V6(_))
    )
}

/// `ip daddr @SET`
pub fn daddr_in(set: &str) -> Expr {
    Expr::Lookup {
        key: vec![KeyField::Addr(Addr::Daddr)],
        set: set.into(),
    }
}

/// The match for "from inside the cluster" (None when nothing is local).
pub fn local_match(fam: IpFamily, d: &LocalDetector, neg: bool) -> Option<Expr> {
    match d {
        LocalDetector::None => None,
        LocalDetector::Cidrs(c) => {
            let mut nets: Vec<IpNet> = c.iter().filter(|n| same_family(fam, n)).copied().collect();
            let value = match nets.len() {
                0 => return None,
                1 => AddrValue::Net(nets.remove(0)),
                _ => AddrValue::Set(nets),
            };
            Some(Expr::AddrMatch {
                field: Addr::Saddr,
                neg,
                value,
            })
        }
        LocalDetector::BridgeInterface(i) => Some(Expr::Iifname {
            neg,
            name: i.clone(),
            wildcard: false,
        }),
        LocalDetector::InterfaceNamePrefix(p) => Some(Expr::Iifname {
            neg,
            name: p.clone(),
            wildcard: true,
        }),
    }
}

/// `jump mark-for-masquerade` (traffic that must be SNATed).
pub fn mark_masq() -> Rule {
    Rule::new(vec![jump_masq()])
}

/// Traffic to any ClusterIP (in set `cluster_ips`) that `masq` masquerades
/// (kp-model decides: all of it, what is not from the cluster per the
/// detector, or none) gets the masquerade mark. None when nothing is.
///
/// Upstream puts this rule, matching one `ip:port`, at the top of every
/// Service's internal chain. One rule before the dispatch marks the same
/// packets that reach a Service: the dispatch only lets ClusterIP traffic
/// into the internal chains, and packets to a ClusterIP that no chain takes
/// (unknown port, no endpoints) are rejected or dropped by the filter chains
/// before they could be masqueraded. At 50k Services it saves ~55k rules of
/// ~10 kernel expressions each, ~1.5-2.5 s of a full sync's kernel time
/// (the kernel costs a type lookup per expression).
pub fn mark_masq_clusterip(
    fam: IpFamily,
    detector: &LocalDetector,
    masq: ClusterIpMasquerading,
    cluster_ips: &str,
) -> Option<Rule> {
    let mut exprs = vec![daddr_in(cluster_ips)];
    match masq {
        ClusterIpMasquerading::All => {}
        ClusterIpMasquerading::OffCluster => exprs.push(local_match(fam, detector, true)?),
        ClusterIpMasquerading::Never => return None,
    }
    exprs.push(jump_masq());
    Some(Rule::new(exprs))
}

/// Pod traffic (per the local detector) short-circuits to `target`.
pub fn goto_if_from_cluster(fam: IpFamily, detector: &LocalDetector, target: &str) -> Option<Rule> {
    let m = local_match(fam, detector, false)?;
    Some(
        Rule::new(vec![m, Expr::Verdict(Verdict::Goto(target.into()))])
            .comment("short-circuit pod traffic"),
    )
}

/// Traffic from this node itself is masqueraded and sent to `target`.
pub fn node_local_to_cluster(target: &str) -> [Rule; 2] {
    [
        Rule::new(vec![Expr::FibLocal(Addr::Saddr), jump_masq()])
            .comment("masquerade local traffic"),
        Rule::new(vec![
            Expr::FibLocal(Addr::Saddr),
            Expr::Verdict(Verdict::Goto(target.into())),
        ])
        .comment("short-circuit local traffic"),
    ]
}

/// Session affinity, a client recorded for the endpoint at `index` (see
/// [`Expr::AffinityHit`]).
pub fn affinity_hit(
    protocol: Protocol,
    records: MapName,
    id: u32,
    index: u32,
    slots: Slots,
) -> Rule {
    Rule::new(vec![
        Expr::L4Proto(protocol),
        Expr::AffinityHit {
            records,
            id,
            index,
            slots,
        },
    ])
}

/// Session affinity, a new client: its index recorded (see
/// [`Expr::AffinityRecord`]); [`hash_dnat`] follows.
pub fn affinity_record(protocol: Protocol, records: MapName, id: u32, count: u32) -> Rule {
    Rule::new(vec![
        Expr::L4Proto(protocol),
        Expr::AffinityRecord { records, id, count },
    ])
}

/// DNAT to the slot a client's hash picks among `count` (see
/// [`Expr::HashDnat`]).
pub fn hash_dnat(protocol: Protocol, seed: u32, count: u32, slots: Slots) -> Rule {
    Rule::new(vec![
        Expr::L4Proto(protocol),
        Expr::HashDnat { seed, count, slots },
    ])
}

/// Random choice among endpoints, DNAT in one rule (no per-endpoint chain),
/// through `count` slots of an `endpoints-PROTO-N` map.
pub fn numgen_dnat(protocol: Protocol, count: u32, slots: Slots) -> Rule {
    Rule::new(vec![
        Expr::L4Proto(protocol),
        Expr::NumgenDnat { count, slots },
    ])
}

/// The rule of a shared `pick-PROTO-N-S` chain: a random index below
/// N, DNAT to the endpoint at that index of the Service the packet asked
/// for (its address and port).
pub fn pick_dnat(key: PickKey) -> Rule {
    Rule::new(vec![
        Expr::L4Proto(key.protocol),
        Expr::PickDnat {
            protocol: key.protocol,
            count: key.count,
            map: key.map(),
        },
    ])
}

/// DNAT to one endpoint.
pub fn dnat(protocol: Protocol, endpoint: SocketAddr) -> Rule {
    Rule::new(vec![Expr::L4Proto(protocol), Expr::Dnat(endpoint)])
}

/// Drop sources outside `ranges` (loadBalancerSourceRanges).
pub fn drop_unless_source(ranges: Vec<IpNet>) -> Rule {
    Rule::new(vec![
        Expr::AddrMatch {
            field: Addr::Saddr,
            neg: true,
            value: AddrValue::Set(ranges),
        },
        Expr::Verdict(Verdict::Drop),
    ])
    .comment("source not in loadBalancerSourceRanges")
}

/// Plain verdict with a comment saying why.
pub fn verdict(verdict: Verdict, comment: &'static str) -> Rule {
    Rule::new(vec![Expr::Verdict(verdict)]).comment(comment)
}
