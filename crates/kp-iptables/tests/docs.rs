//! docs/iptables.md is the layout's specification: every "Each kind of
//! Service" example must be exactly what the renderer produces for that
//! Service, and every kind the renderer distinguishes has an example.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::net::IpAddr;

use kp_iptables::{
    render_service, ServiceRules, EXTERNAL_CHAIN, FIREWALL_CHAIN, NODEPORTS_CHAIN, SERVICES_CHAIN,
};
use kp_model::testing::ServicePortBuilder;
use kp_model::{Endpoint, IpFamily, LocalDetector, NodeInfo, Protocol, ProxierConfig, ServicePort};

mod common;
use common::text;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn sp(name: &str, cip: &str) -> ServicePortBuilder {
    ServicePort::builder("default", name)
        .port_name("http")
        .cluster_ip(cip)
}

fn ep(addr: &str, local: bool) -> Endpoint {
    Endpoint::ready(ip(addr), 8080, local)
}

/// The two endpoints most examples use: one on node1 (this node), one on node2.
fn two() -> Vec<Endpoint> {
    vec![ep("10.244.1.5", true), ep("10.244.2.6", false)]
}

/// The Services behind the doc's examples (the doc's `--dry-run` setup:
/// node1, `--cluster-cidr 10.244.0.0/16`, plus fd00:244::/48 for IPv6).
fn example(title: &str) -> Option<(ServicePort, Vec<Endpoint>)> {
    let (s, eps) = match title {
        "ClusterIP with two endpoints" => (sp("web", "10.96.0.10"), two()),
        "No endpoints" => (sp("empty", "10.96.0.11"), vec![]),
        "NodePort" => (sp("np", "10.96.0.12").node_port(30080), two()),
        "LoadBalancer with externalIPs and loadBalancerSourceRanges" => (
            sp("lb", "10.96.0.13")
                .node_port(30081)
                .external_ips(&["203.0.113.10"])
                .load_balancer_ips(&["203.0.113.20"])
                .source_ranges(&["198.51.100.0/24"]),
            two(),
        ),
        "externalTrafficPolicy: Local" => (
            sp("local", "10.96.0.14")
                .node_port(30082)
                .load_balancer_ips(&["203.0.113.21"])
                .local_external()
                .health_check_node_port(32100),
            two(),
        ),
        "externalTrafficPolicy: Local without a local endpoint" => (
            sp("remote", "10.96.0.18")
                .node_port(30083)
                .load_balancer_ips(&["203.0.113.22"])
                .local_external()
                .health_check_node_port(32101),
            vec![ep("10.244.2.6", false)],
        ),
        "internalTrafficPolicy: Local" => (sp("itp", "10.96.0.15").local_internal(), two()),
        "sessionAffinity: ClientIP" => (sp("sticky", "10.96.0.16").affinity(600), two()),
        "Terminating fallback" => (
            sp("term", "10.96.0.17"),
            vec![
                ep("10.244.1.7", true).serving_terminating(),
                ep("10.244.2.8", false),
            ],
        ),
        "UDP" => (
            sp("dns", "10.96.0.19")
                .port_name("dns")
                .protocol(Protocol::Udp)
                .port(53),
            vec![ep("10.244.1.5", true)],
        ),
        "IPv6" => (
            sp("web6", "fd00:96::10"),
            vec![ep("fd00:244:1::5", true), ep("fd00:244:2::6", false)],
        ),
        _ => return None,
    };
    Some((s.build(), eps))
}

fn cfg(family: IpFamily) -> ProxierConfig {
    let mut c = ProxierConfig::new(family);
    c.local_detector = LocalDetector::Cidrs(vec![match family {
        IpFamily::V4 => "10.244.0.0/16".parse().unwrap(),
        IpFamily::V6 => "fd00:244::/48".parse().unwrap(),
    }]);
    c
}

/// The example's lines as the doc shows them: filter chains then nat, each in
/// the order of the restore input.
fn shown(r: &ServiceRules) -> Vec<String> {
    let mut out = Vec::new();
    let filter: Vec<String> = [
        (SERVICES_CHAIN, &r.filter_services),
        (EXTERNAL_CHAIN, &r.filter_external),
        (NODEPORTS_CHAIN, &r.filter_nodeports),
        (FIREWALL_CHAIN, &r.filter_firewall),
    ]
    .into_iter()
    .flat_map(|(c, rules)| text(c, rules))
    .collect();
    if !filter.is_empty() {
        out.push("# table filter".to_string());
        out.extend(filter);
    }
    let nat: Vec<String> = [
        (SERVICES_CHAIN, &r.nat_services),
        (NODEPORTS_CHAIN, &r.nat_nodeports),
    ]
    .into_iter()
    .chain(r.nat_chains.iter().map(|(c, rules)| (c.as_str(), rules)))
    .flat_map(|(c, rules)| text(c, rules))
    .collect();
    if !nat.is_empty() {
        out.push("# table nat".to_string());
        out.extend(nat);
    }
    out
}

/// (title, code block lines) of each `###` section under "## Each kind of
/// Service".
fn doc_examples() -> Vec<(String, Vec<String>)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/iptables.md");
    let text = std::fs::read_to_string(path).expect("reading docs/iptables.md");
    let start = text
        .find("## Each kind of Service")
        .expect("docs/iptables.md has an \"Each kind of Service\" section");
    let rest = &text[start + 3..];
    let end = rest.find("\n## ").unwrap_or(rest.len());
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    let mut in_block = false;
    for line in rest[..end].lines() {
        if let Some(t) = line.strip_prefix("### ") {
            out.push((t.trim().to_string(), Vec::new()));
        } else if line.starts_with("```") {
            in_block = !in_block;
        } else if in_block {
            if let Some((_, lines)) = out.last_mut() {
                lines.push(line.to_string());
            }
        }
    }
    out
}

#[test]
fn every_example_in_the_doc_is_what_we_render() {
    let examples = doc_examples();
    assert!(examples.len() >= 10, "{examples:?}");
    for (title, lines) in &examples {
        let (s, eps) = example(title)
            .unwrap_or_else(|| panic!("docs/iptables.md: no test case for example {title:?}"));
        let family = if s.cluster_ip.is_ipv6() {
            IpFamily::V6
        } else {
            IpFamily::V4
        };
        let node = NodeInfo::named("node1");
        let got = shown(&render_service(&s, &eps, &cfg(family), &node));
        assert_eq!(
            lines,
            &got,
            "docs/iptables.md example {title:?} differs from the renderer; rendered:\n{}",
            got.join("\n")
        );
    }
}

/// Every kind the renderer treats differently has an example in the doc.
#[test]
fn the_doc_has_an_example_for_every_kind() {
    let titles: Vec<String> = doc_examples().into_iter().map(|(t, _)| t).collect();
    for kind in [
        "ClusterIP with two endpoints",
        "No endpoints",
        "NodePort",
        "LoadBalancer with externalIPs and loadBalancerSourceRanges",
        "externalTrafficPolicy: Local",
        "externalTrafficPolicy: Local without a local endpoint",
        "internalTrafficPolicy: Local",
        "sessionAffinity: ClientIP",
        "Terminating fallback",
        "UDP",
        "IPv6",
    ] {
        assert!(
            titles.iter().any(|t| t == kind),
            "docs/iptables.md lacks an example for {kind:?} (has {titles:?})"
        );
    }
}
