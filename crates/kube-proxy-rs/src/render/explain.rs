//! `explain`'s text: kp-model's [`Explanation`] as a person reads it, for
//! `kube-proxy-rs explain` and `/debug/explain?format=text`.

use std::fmt::Write;

use kp_model::explain::Explanation;

/// The explanation as a person reads it, one step a line.
pub fn explain_text(ex: &Explanation) -> String {
    let mut o = String::new();
    let p = &ex.packet;
    let _ = writeln!(
        o,
        "packet   {} -> {}:{}/{} ({}) entering node {}{}",
        p.src,
        p.dst,
        p.port,
        p.protocol,
        ex.family,
        if ex.node.is_empty() { "?" } else { &ex.node },
        ex.node_zone
            .as_deref()
            .map(|z| format!(" (zone {z})"))
            .unwrap_or_default()
    );
    let _ = writeln!(o, "source   {}", ex.local_detection);
    if ex.source_is_node {
        let _ = writeln!(o, "         the source is one of this node's addresses");
    }
    match &ex.matched {
        None => {
            let _ = writeln!(o, "service  none matched");
        }
        Some(m) => {
            let _ = writeln!(
                o,
                "service  {} matched as {:?} (cluster IP {}:{}{}; iTP {}, eTP {})",
                m.service_port,
                m.kind,
                m.cluster_ip,
                m.port,
                if m.node_port != 0 {
                    format!(", NodePort {}", m.node_port)
                } else {
                    String::new()
                },
                m.internal_traffic_policy,
                m.external_traffic_policy
            );
        }
    }
    if let Some(s) = &ex.endpoint_set {
        let _ = writeln!(o, "set      {s}");
    }
    if let Some(t) = &ex.topology {
        let _ = writeln!(o, "topology {t}");
    }
    if let Some(f) = &ex.fallback {
        let _ = writeln!(o, "fallback {f}");
    }
    if ex.matched.is_some() {
        if ex.endpoints.is_empty() {
            let _ = writeln!(o, "endpoints none");
        } else {
            let _ = writeln!(o, "endpoints");
        }
    }
    for c in &ex.endpoints {
        let (kept, why) = (c.kept, &c.why);
        let c = &c.endpoint;
        let _ = writeln!(
            o,
            "  {} {:<22} {}{}{}: {}",
            if kept { "+" } else { "-" },
            c.address,
            if c.local { "local" } else { "remote" },
            c.node
                .as_deref()
                .map(|n| format!(" node {n}"))
                .unwrap_or_default(),
            c.zone
                .as_deref()
                .map(|z| format!(" zone {z}"))
                .unwrap_or_default(),
            why
        );
    }
    if let Some(t) = ex.session_affinity_seconds {
        let _ = writeln!(o, "affinity ClientIP, {t}s");
    } else if ex.matched.is_some() {
        let _ = writeln!(o, "affinity none");
    }
    if let Some(m) = &ex.masquerade {
        let _ = writeln!(
            o,
            "masquerade {}: {}",
            if m.masquerade { "yes" } else { "no" },
            m.why
        );
    }
    let _ = writeln!(o, "verdict  {:?}: {}", ex.verdict.action, ex.verdict.why);
    if let Some(d) = &ex.dataplane {
        let _ = writeln!(o, "ruleset  ({} mode, read from the kernel)", d.mode);
        for c in &d.chains {
            let state = match c.present {
                Some(true) => "present",
                Some(false) => "MISSING",
                None => "unknown",
            };
            let _ = writeln!(o, "  {:<8} {} {}", state, c.table, c.chain);
        }
        if let Some(e) = &d.error {
            let _ = writeln!(o, "  kernel not read: {e}");
        }
        if d.drift.is_empty() {
            if d.error.is_none() {
                let _ = writeln!(o, "drift    none: the kernel holds what the model says");
            }
        } else {
            for d in &d.drift {
                let _ = writeln!(o, "DRIFT    {d}");
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kp_model::explain::{explain, Packet};
    use kp_model::{
        Endpoint, IpFamily, LocalDetector, NodeInfo, Protocol, ProxierConfig, ProxyState,
        ServicePort,
    };

    use super::explain_text;

    /// `port` with `endpoints` on `node`, explained for a TCP packet
    /// `src` -> `dst:port`, as text.
    fn text(
        node: NodeInfo,
        port: ServicePort,
        endpoints: Vec<Endpoint>,
        src: &str,
        dst: &str,
        dport: u16,
    ) -> String {
        let mut state = ProxyState::new(IpFamily::V4, node);
        state
            .endpoints
            .insert(port.name.clone(), Arc::new(endpoints));
        state.services.insert(port.name.clone(), Arc::new(port));
        let mut cfg = ProxierConfig::new(IpFamily::V4);
        cfg.local_detector = LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().unwrap()]);
        cfg.node_ips = vec!["192.168.0.1".parse().unwrap()];
        let pkt = Packet {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            port: dport,
            protocol: Protocol::Tcp,
        };
        explain_text(&explain(&[&state], &[&cfg], &pkt))
    }

    fn web() -> ServicePort {
        ServicePort::builder("default", "web")
            .port_name("http")
            .cluster_ip("10.96.0.10")
            .node_port(30080)
            .build()
    }

    fn two() -> Vec<Endpoint> {
        vec![
            Endpoint::at("10.244.1.5:8080").local(),
            Endpoint::at("10.244.2.6:8080"),
        ]
    }

    #[test]
    fn a_match_its_masquerade_and_no_match() {
        let node = || NodeInfo::named("node1");
        let t = text(node(), web(), two(), "10.244.1.9", "10.96.0.10", 80);
        assert!(t.contains("default/web:http matched as ClusterIP"), "{t}");
        assert!(t.contains("masquerade no"), "{t}");
        let t = text(node(), web(), two(), "10.244.1.9", "8.8.8.8", 53);
        assert!(t.contains("service  none matched"), "{t}");
    }

    #[test]
    fn zone_and_affinity() {
        let eps = vec![
            Endpoint::at("10.244.1.5:8080").with_zone_hints(&["zone-a"]),
            Endpoint::at("10.244.2.6:8080").with_zone_hints(&["zone-b"]),
        ];
        let node = NodeInfo::named("node1").in_zone("zone-a");
        let t = text(node, web(), eps, "10.244.1.9", "10.96.0.10", 80);
        assert!(t.contains("(zone zone-a)"), "{t}");
        let sticky = ServicePort::builder("default", "sticky")
            .cluster_ip("10.96.0.14")
            .affinity(600)
            .build();
        let t = text(
            NodeInfo::named("node1"),
            sticky,
            two(),
            "10.244.1.9",
            "10.96.0.14",
            80,
        );
        assert!(t.contains("affinity ClientIP, 600s"), "{t}");
    }
}
