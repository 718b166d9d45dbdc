//! The conntrack reconciler's decision: given the Services and endpoints a
//! sync programmed and the UDP flows the kernel holds, which flows are
//! stale. No I/O: the sync loop lists the flows and deletes the verdict
//! ([`crate::conntrack`]).
//!
//! As upstream's CleanStaleEntries (pkg/proxy/conntrack/cleanup.go, 1.32+):
//! a UDP flow whose original destination is a UDP Service port's frontend
//! (ClusterIP, external IP or load-balancer IP with the port, or the
//! NodePort on any address) is stale when its reply source (address and
//! port) is not one of that port's serving endpoints. Traffic policies,
//! topology and terminating state are not looked at, so an established
//! flow outlives such changes as a TCP connection does.
//!
//! One difference: upstream leaves the flows of a port without serving
//! endpoints alone; here they are stale too (a flow DNATed to an endpoint
//! that went while the proxy was down would otherwise keep blackholing its
//! client instead of meeting the port's reject rule).
//!
//! The event filters of the change tracker ([`StaleConntrack`]) are applied
//! in the same pass, so one dump per family serves both.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use kp_model::{Protocol, ProxyState, StaleConntrack};

use crate::conntrack::{matches, Flow};

const UDP: u8 = 17;

/// The serving endpoints (address, port) of one UDP Service port.
type Serving = Arc<HashSet<(IpAddr, u16)>>;

/// Every UDP frontend of a state and the endpoints its flows may go to.
#[derive(Debug, Default)]
pub struct Frontends {
    by_addr: HashMap<(IpAddr, u16), Serving>,
    by_node_port: HashMap<u16, Serving>,
    /// The proxy answers on the frontends itself (userspace mode): a flow
    /// that was not NATed is one of its own, not stale.
    serves_locally: bool,
}

impl Frontends {
    /// The UDP frontends of `state`, indexed for [`Frontends::is_stale`].
    pub fn of(state: &ProxyState) -> Self {
        let mut f = Frontends::default();
        for (name, sp) in &state.services {
            if sp.protocol != Protocol::Udp {
                continue;
            }
            let serving: Serving = Arc::new(
                state
                    .endpoints_of(name)
                    .iter()
                    .filter(|e| e.serving)
                    .map(|e| (e.ip, e.port))
                    .collect(),
            );
            for ip in sp.all_ips() {
                f.by_addr.insert((*ip, sp.port), Arc::clone(&serving));
            }
            if sp.node_port != 0 {
                f.by_node_port.insert(sp.node_port, serving);
            }
        }
        f
    }

    /// Whether `flow` goes to one of these frontends but not to one of its
    /// serving endpoints.
    pub fn is_stale(&self, flow: &Flow) -> bool {
        self.verdict(flow) == Some(true)
    }

    /// None when `flow` goes to none of these frontends; else whether it
    /// is stale.
    fn verdict(&self, flow: &Flow) -> Option<bool> {
        if flow.proto != UDP {
            return None;
        }
        let stale = |serving: &Serving| match (flow.reply_src, flow.reply_sport) {
            (Some(ip), Some(port))
                if self.serves_locally && ip == flow.orig_dst && port == flow.orig_dport =>
            {
                false
            }
            (Some(ip), Some(port)) => !serving.contains(&(ip, port)),
            // No reply tuple: nothing says where it goes; leave it.
            _ => false,
        };
        // A Service address decides alone: another Service's NodePort
        // equal to this port must not condemn its flows (upstream checks
        // both).
        if let Some(s) = self.by_addr.get(&(flow.orig_dst, flow.orig_dport)) {
            return Some(stale(s));
        }
        self.by_node_port.get(&flow.orig_dport).map(stale)
    }
}

/// The flows to delete: stale for `state`, or selected by one of the
/// tracker's `filters`. A filter for every flow of an address (a port that
/// just got endpoints) leaves the flows to a current frontend to the
/// reconciler's finer verdict, so a restart does not end the flows that
/// reach a serving endpoint; a filter naming an endpoint (one that stopped
/// being usable) still applies. `serves_locally`: see [`Frontends`].
pub fn stale_flows(
    state: &ProxyState,
    filters: &[StaleConntrack],
    flows: Vec<Flow>,
    serves_locally: bool,
) -> Vec<Flow> {
    let mut frontends = Frontends::of(state);
    frontends.serves_locally = serves_locally;
    flows
        .into_iter()
        .filter(|fl| match frontends.verdict(fl) {
            Some(true) => true,
            Some(false) => filters
                .iter()
                .any(|f| f.reply_src.is_some() && matches(f, fl)),
            None => filters.iter().any(|f| matches(f, fl)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kp_model::{Endpoint, IpFamily, NodeInfo, ServicePort, ServicePortName};

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn flow(dst: &str, dport: u16, reply: &str, rport: u16) -> Flow {
        Flow {
            proto: UDP,
            orig_src: ip("10.244.0.9"),
            orig_dst: ip(dst),
            orig_sport: 40000,
            orig_dport: dport,
            reply_src: Some(ip(reply)),
            reply_sport: Some(rport),
        }
    }

    fn name(svc: &str, port: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName::new("default", svc, port, protocol)
    }

    /// dns: 10.96.0.10:53/UDP, NodePort 30053, external 192.0.2.10, LB
    /// 198.51.100.10, endpoints 10.244.1.5:8053 (serving) and
    /// 10.244.1.6:8053 (not serving); web: the same ClusterIP, port 53/TCP.
    fn state() -> ProxyState {
        let mut st = ProxyState::new(IpFamily::V4, NodeInfo::default());
        let n = name("dns", "dns", Protocol::Udp);
        let mut sp = ServicePort::new(n.clone(), ip("10.96.0.10"), 53);
        sp.node_port = 30053;
        sp.external_ips = vec![ip("192.0.2.10")];
        sp.load_balancer_ips = vec![ip("198.51.100.10")];
        st.services.insert(n.clone(), Arc::new(sp));
        let mut unready = Endpoint::ready(ip("10.244.1.6"), 8053, false);
        unready.ready = false;
        unready.serving = false;
        st.endpoints.insert(
            n,
            Arc::new(vec![
                Endpoint::ready(ip("10.244.1.5"), 8053, false),
                unready,
            ]),
        );
        let t = name("web", "tcp", Protocol::Tcp);
        st.services.insert(
            t.clone(),
            Arc::new(ServicePort::new(t, ip("10.96.0.11"), 53)),
        );
        st
    }

    #[test]
    fn flows_to_a_serving_endpoint_stay() {
        let f = Frontends::of(&state());
        for dst in ["10.96.0.10", "192.0.2.10", "198.51.100.10"] {
            assert!(!f.is_stale(&flow(dst, 53, "10.244.1.5", 8053)), "{dst}");
        }
        // NodePort, on any node address.
        assert!(!f.is_stale(&flow("10.0.0.1", 30053, "10.244.1.5", 8053)));
    }

    #[test]
    fn flows_to_anything_else_go() {
        let f = Frontends::of(&state());
        for dst in ["10.96.0.10", "192.0.2.10", "198.51.100.10"] {
            // A former endpoint, one that is not serving, the right address
            // with another port, and an un-NATed flow (sent before the rules).
            assert!(f.is_stale(&flow(dst, 53, "10.244.1.7", 8053)), "{dst}");
            assert!(f.is_stale(&flow(dst, 53, "10.244.1.6", 8053)), "{dst}");
            assert!(f.is_stale(&flow(dst, 53, "10.244.1.5", 9053)), "{dst}");
            assert!(f.is_stale(&flow(dst, 53, dst, 53)), "{dst}");
        }
        assert!(f.is_stale(&flow("10.0.0.1", 30053, "10.244.1.7", 8053)));
    }

    #[test]
    fn other_flows_are_left_alone() {
        let f = Frontends::of(&state());
        // Another port of the Service IP, another address, a TCP Service.
        assert!(!f.is_stale(&flow("10.96.0.10", 54, "10.244.1.7", 8053)));
        assert!(!f.is_stale(&flow("10.96.0.99", 53, "10.244.1.7", 8053)));
        assert!(!f.is_stale(&flow("10.96.0.11", 53, "10.244.1.7", 8053)));
        // A TCP flow to the UDP frontend.
        let mut tcp = flow("10.96.0.10", 53, "10.244.1.7", 8053);
        tcp.proto = 6;
        assert!(!f.is_stale(&tcp));
        // No reply tuple.
        let mut bare = flow("10.96.0.10", 53, "10.244.1.7", 8053);
        bare.reply_src = None;
        assert!(!f.is_stale(&bare));
    }

    #[test]
    fn a_service_address_is_not_judged_by_an_equal_node_port() {
        let mut st = state();
        let n = name("hi", "hi", Protocol::Udp);
        st.services.insert(
            n.clone(),
            Arc::new(ServicePort::new(n.clone(), ip("10.96.0.12"), 30053)),
        );
        st.endpoints.insert(
            n,
            Arc::new(vec![Endpoint::ready(ip("10.244.3.3"), 9000, false)]),
        );
        let f = Frontends::of(&st);
        assert!(!f.is_stale(&flow("10.96.0.12", 30053, "10.244.3.3", 9000)));
        assert!(f.is_stale(&flow("10.96.0.12", 30053, "10.244.1.5", 8053)));
        // The NodePort of dns on a node address still is dns's.
        assert!(f.is_stale(&flow("10.0.0.1", 30053, "10.244.3.3", 9000)));
    }

    #[test]
    fn a_proxy_serving_locally_keeps_its_own_flows() {
        let flows = vec![
            flow("10.96.0.10", 53, "10.96.0.10", 53),
            flow("10.96.0.10", 53, "10.244.1.7", 8053),
        ];
        assert_eq!(
            stale_flows(&state(), &[], flows.clone(), true),
            flows[1..].to_vec()
        );
        assert_eq!(stale_flows(&state(), &[], flows.clone(), false), flows);
    }

    #[test]
    fn a_port_without_serving_endpoints_keeps_no_flow() {
        let mut st = state();
        let n = name("dns", "dns", Protocol::Udp);
        st.endpoints.remove(&n);
        let f = Frontends::of(&st);
        assert!(f.is_stale(&flow("10.96.0.10", 53, "10.244.1.5", 8053)));
        assert!(f.is_stale(&flow("10.0.0.1", 30053, "10.244.1.5", 8053)));
    }

    #[test]
    fn tracker_filters_apply_in_the_same_pass() {
        let filter = StaleConntrack {
            protocol: Protocol::Udp,
            orig_dst: Some(ip("10.96.0.99")),
            orig_dport: 53,
            reply_src: None,
        };
        let flows = vec![
            flow("10.96.0.99", 53, "10.244.2.2", 8053),
            flow("10.96.0.10", 53, "10.244.1.7", 8053),
            flow("10.96.0.10", 53, "10.244.1.5", 8053),
        ];
        let out = stale_flows(&state(), &[filter], flows.clone(), false);
        assert_eq!(out, flows[..2].to_vec());
        // A flush of a current frontend leaves its good flows alone; a
        // filter naming the endpoint does not.
        let flush = StaleConntrack {
            protocol: Protocol::Udp,
            orig_dst: Some(ip("10.96.0.10")),
            orig_dport: 53,
            reply_src: None,
        };
        let out = stale_flows(&state(), std::slice::from_ref(&flush), flows.clone(), false);
        assert_eq!(out, flows[1..2].to_vec());
        let named = StaleConntrack {
            reply_src: Some(ip("10.244.1.5")),
            ..flush
        };
        let out = stale_flows(&state(), &[named], flows.clone(), false);
        assert_eq!(out, flows[1..].to_vec());
    }
}
