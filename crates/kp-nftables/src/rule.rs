//! The handful of rule shapes the nftables layout uses. Kept structured (not
//! text) so that a netlink encoder can emit the same rules without parsing nft
//! syntax; [`Rule::text`] gives the nft spelling used by `nft -f` and --dry-run.

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use kp_model::{IpFamily, LocalDetector, Protocol};

use crate::render::MapName;

/// Where a rule or map element sends a packet.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Verdict {
    Goto(String),
    Jump(String),
    Drop,
    Return,
}

impl Verdict {
    pub fn text(&self) -> String {
        match self {
            Verdict::Goto(c) => format!("goto {c}"),
            Verdict::Jump(c) => format!("jump {c}"),
            Verdict::Drop => "drop".into(),
            Verdict::Return => "return".into(),
        }
    }
}

pub const MARK_MASQ_CHAIN: &str = "mark-for-masquerade";

/// One rule in a per-service chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rule {
    /// `jump mark-for-masquerade` (traffic that must be SNATed).
    MarkMasq,
    /// Traffic to `ip:port` not coming from the cluster gets the masquerade mark
    /// (`--cluster-cidr`/detect-local-mode); with `masquerade_all` every packet.
    MarkMasqUnlessLocal {
        ip: IpAddr,
        protocol: Protocol,
        port: u16,
        detector: LocalDetector,
        masquerade_all: bool,
    },
    /// Pod traffic (per the local detector) short-circuits to `target`.
    GotoIfFromCluster {
        detector: LocalDetector,
        target: String,
    },
    /// Traffic from this node itself is masqueraded and sent to `target`
    /// (two rules in nft: mark, then goto).
    NodeLocalToCluster { target: String },
    /// `ip saddr @set goto chain`: a client already bound to an endpoint.
    AffinityCheck { set: String, target: String },
    /// `update @set { ip saddr }`: remember the client for this endpoint.
    AffinityUpdate { set: String },
    /// Random choice among chains (affinity services: one chain per endpoint),
    /// through slots `offset..offset+count` of an `endpoint-chains-N` map.
    /// `pool` indexes the service's [`crate::render::Pool`]s.
    NumgenGoto {
        count: u32,
        pool: usize,
        map: MapName,
        offset: u32,
    },
    /// Random choice among endpoints, DNAT in one rule (no per-endpoint chain),
    /// through slots `offset..offset+count` of an `endpoints-PROTO-N` map.
    NumgenDnat {
        protocol: Protocol,
        count: u32,
        pool: usize,
        map: MapName,
        offset: u32,
    },
    /// DNAT to one endpoint.
    Dnat {
        protocol: Protocol,
        endpoint: SocketAddr,
    },
    /// Drop sources outside `ranges` (loadBalancerSourceRanges).
    DropUnlessSource { ranges: Vec<IpNet> },
    /// Plain verdict with a comment saying why.
    Verdict { verdict: Verdict, comment: String },
}

fn ipkw(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

fn endpoint_text(a: &SocketAddr) -> String {
    match a {
        SocketAddr::V4(v) => format!("{}:{}", v.ip(), v.port()),
        SocketAddr::V6(v) => format!("[{}]:{}", v.ip(), v.port()),
    }
}

/// Quoted nft string with anything that could break the script removed. Names
/// reaching here are validated DNS labels; this is defence in depth.
pub fn quote(s: &str) -> String {
    let clean: String = s
        .chars()
        .filter(|c| c.is_ascii_graphic() || *c == ' ')
        .filter(|c| !matches!(c, '"' | '\\' | ';' | '#' | '{' | '}'))
        .take(120)
        .collect();
    format!("\"{clean}\"")
}

/// The nft match for "from inside the cluster" (None when nothing is local).
pub fn local_match(fam: IpFamily, d: &LocalDetector, negate: bool) -> Option<String> {
    let op = if negate { "!= " } else { "" };
    match d {
        LocalDetector::None => None,
        LocalDetector::Cidrs(c) => {
            let nets: Vec<String> = c
                .iter()
                .filter(|n| {
                    matches!(
                        (fam, n),
                        (IpFamily::V4, IpNet::V4(_)) | (IpFamily::V6, IpNet::V6(_))
                    )
                })
                .map(|n| n.to_string())
                .collect();
            match nets.len() {
                0 => None,
                1 => Some(format!("{} saddr {op}{}", ipkw(fam), nets[0])),
                _ => Some(format!("{} saddr {op}{{ {} }}", ipkw(fam), nets.join(", "))),
            }
        }
        LocalDetector::BridgeInterface(i) => Some(format!("iifname {op}{}", quote(i))),
        LocalDetector::InterfaceNamePrefix(p) => {
            let q = quote(p);
            Some(format!("iifname {op}{}*\"", &q[..q.len() - 1]))
        }
    }
}

impl Rule {
    /// The rule body (what follows `add rule <family> <table> <chain> `). A
    /// shape may expand to more than one nft rule: each line is one rule.
    pub fn text(&self, fam: IpFamily) -> Vec<String> {
        let ip = ipkw(fam);
        match self {
            Rule::MarkMasq => vec![format!("jump {MARK_MASQ_CHAIN}")],
            Rule::MarkMasqUnlessLocal {
                ip: addr,
                protocol,
                port,
                detector,
                masquerade_all,
            } => {
                let base = format!("{ip} daddr {addr} {} dport {port}", protocol.as_lower());
                if *masquerade_all {
                    vec![format!("{base} jump {MARK_MASQ_CHAIN}")]
                } else if let Some(m) = local_match(fam, detector, true) {
                    vec![format!("{base} {m} jump {MARK_MASQ_CHAIN}")]
                } else {
                    vec![]
                }
            }
            Rule::GotoIfFromCluster { detector, target } => match local_match(fam, detector, false) {
                Some(m) => vec![format!(
                    "{m} goto {target} comment \"short-circuit pod traffic\""
                )],
                None => vec![],
            },
            Rule::NodeLocalToCluster { target } => vec![
                format!("fib saddr type local jump {MARK_MASQ_CHAIN} comment \"masquerade local traffic\""),
                format!("fib saddr type local goto {target} comment \"short-circuit local traffic\""),
            ],
            Rule::AffinityCheck { set, target } => {
                vec![format!("{ip} saddr @{set} goto {target}")]
            }
            Rule::AffinityUpdate { set } => vec![format!("update @{set} {{ {ip} saddr }}")],
            Rule::NumgenGoto {
                count, map, offset, ..
            } => vec![format!(
                "numgen random mod {count} offset {offset} vmap @{map}"
            )],
            Rule::NumgenDnat {
                protocol,
                count,
                map,
                offset,
                ..
            } => vec![format!(
                "meta l4proto {} dnat {ip} addr . port to numgen random mod {count} offset {offset} map @{map}",
                protocol.as_lower(),
            )],
            Rule::Dnat { protocol, endpoint } => vec![format!(
                "meta l4proto {} dnat {ip} to {}",
                protocol.as_lower(),
                endpoint_text(endpoint)
            )],
            Rule::DropUnlessSource { ranges } => {
                let r: Vec<String> = ranges.iter().map(|n| n.to_string()).collect();
                vec![format!(
                    "{ip} saddr != {{ {} }} drop comment \"source not in loadBalancerSourceRanges\"",
                    r.join(", ")
                )]
            }
            Rule::Verdict { verdict, comment } => {
                vec![format!("{} comment {}", verdict.text(), quote(comment))]
            }
        }
    }
}
