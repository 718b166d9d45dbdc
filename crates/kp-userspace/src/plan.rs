//! Pure: which sockets the proxy listens on for a given state.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use kp_model::{Protocol, ProxyState, ServicePortName};

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

/// `local`: this host's addresses (address, on a loopback interface);
/// `ours`: the ones we added to lo ourselves.
pub fn plan(
    state: &ProxyState,
    opts: &PlanOpts,
    local: &[(IpAddr, bool)],
    ours: &BTreeSet<IpAddr>,
) -> Plan {
    let mut out = Plan::default();
    let fam = state.family;
    // Addresses someone else configured: usable as they are, never ours to add.
    let foreign: BTreeSet<IpAddr> = local
        .iter()
        .map(|(ip, _)| *ip)
        .filter(|ip| !ours.contains(ip))
        .collect();
    let nodeport_ips: Vec<IpAddr> = local
        .iter()
        .filter(|(ip, lo)| {
            fam.matches(ip)
                && !ours.contains(ip)
                && !link_local(ip)
                && !ip.is_unspecified()
                && if opts.nodeport_addresses.is_empty() {
                    !lo
                } else {
                    opts.nodeport_addresses.iter().any(|c| c.contains(ip))
                }
        })
        .map(|(ip, _)| *ip)
        .collect();

    for (name, sp) in &state.services {
        if sp.protocol == Protocol::Sctp {
            out.skipped
                .push(format!("{name}: SCTP is not proxied in userspace mode"));
            continue;
        }
        let add = |out: &mut Plan, ip: IpAddr, port: u16, kind: Kind, ranges: &[IpNet]| {
            let key = ListenKey {
                addr: SocketAddr::new(ip, port),
                protocol: sp.protocol,
            };
            if let Some(prev) = out.listeners.get(&key) {
                if prev.service != *name {
                    out.skipped.push(format!(
                        "{name}: {}/{} is already served for {}",
                        key.addr, sp.protocol, prev.service
                    ));
                }
                return;
            }
            out.listeners.insert(
                key,
                ListenSpec {
                    service: name.clone(),
                    kind,
                    source_ranges: ranges.to_vec(),
                },
            );
        };
        let vip = |out: &mut Plan, ip: IpAddr, kind: Kind, ranges: &[IpNet]| {
            if !fam.matches(&ip) {
                return;
            }
            // Loopback addresses (all of 127/8) are always local.
            if foreign.contains(&ip) || ip.is_loopback() {
                add(out, ip, sp.port, kind, ranges);
            } else if opts.take_over_vips {
                out.vips.insert(ip);
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
            for ip in &nodeport_ips {
                add(&mut out, *ip, sp.node_port, Kind::External, &[]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kp_model::{IpFamily, NodeInfo, ServicePort};
    use std::sync::Arc;

    fn sp(name: &str, ip: &str, port: u16, proto: Protocol) -> ServicePort {
        ServicePort {
            name: ServicePortName::new("default", name, "p", proto),
            cluster_ip: ip.parse().unwrap(),
            port,
            protocol: proto,
            node_port: 0,
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            session_affinity_timeout: None,
            external_policy_local: false,
            internal_policy_local: false,
            health_check_node_port: 0,
            traffic_distribution: None,
        }
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
            "a"
        );
        assert_eq!(p.skipped.len(), 2, "{:?}", p.skipped);
        assert!(p.skipped.iter().any(|s| s.contains("SCTP")));
        assert!(!p.vips.contains(&"10.96.0.11".parse::<IpAddr>().unwrap()));
    }
}
