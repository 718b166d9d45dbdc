//! convert_service against upstream's newBaseServiceInfo / serviceToServiceMap
//! (pkg/proxy/serviceport.go, servicechangetracker.go, pkg/proxy/util).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Service;
use kp_model::{
    convert_service, ConvertError, IpFamily, Protocol, ServicePort, ServicePortName,
    TrafficDistribution, DEFAULT_LABEL_SELECTOR, HEADLESS_LABEL, SERVICE_PROXY_NAME_LABEL,
};
use serde_json::{json, Value};

fn svc(v: Value) -> Service {
    serde_json::from_value(v).unwrap()
}

/// ns1/svc1 with the given spec (and optional status).
fn svc_spec(spec: Value) -> Service {
    svc(json!({"metadata": {"namespace": "ns1", "name": "svc1"}, "spec": spec}))
}

fn conv(s: &Service, family: IpFamily) -> Result<Vec<ServicePort>, ConvertError> {
    let mut w = Vec::new();
    convert_service(s, family, None, &mut w)
}

fn conv_ok(s: &Service, family: IpFamily) -> Vec<ServicePort> {
    conv(s, family).unwrap()
}

fn one(s: &Service, family: IpFamily) -> ServicePort {
    let mut v = conv_ok(s, family);
    assert_eq!(v.len(), 1, "{v:?}");
    v.remove(0)
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn p80() -> Value {
    json!([{"name": "p80", "port": 80, "protocol": "TCP", "targetPort": 80}])
}

fn reason(r: Result<Vec<ServicePort>, ConvertError>) -> String {
    let e = r.expect_err("expected the Service to be rejected");
    assert_eq!(e.kind, "Service");
    e.to_string()
}

#[test]
fn cluster_ip_service() {
    let s = svc_spec(json!({
        "type": "ClusterIP", "clusterIP": "172.30.0.41", "clusterIPs": ["172.30.0.41"],
        "ports": p80(),
    }));
    let sp = one(&s, IpFamily::V4);
    assert_eq!(
        sp.name,
        ServicePortName::new("ns1", "svc1", "p80", Protocol::Tcp)
    );
    assert_eq!(sp.name.to_string(), "ns1/svc1:p80");
    assert_eq!(sp.name.key(), "ns1/svc1:p80/TCP");
    assert_eq!(sp.cluster_ip, ip("172.30.0.41"));
    assert_eq!(sp.port, 80);
    assert_eq!(sp.protocol, Protocol::Tcp);
    assert_eq!(sp.node_port, 0);
    assert!(sp.external_ips.is_empty());
    assert!(sp.load_balancer_ips.is_empty());
    assert!(sp.load_balancer_source_ranges.is_empty());
    assert_eq!(sp.session_affinity_timeout, None);
    assert!(!sp.external_policy_local);
    assert!(!sp.internal_policy_local);
    assert_eq!(sp.health_check_node_port, 0);
    assert_eq!(sp.traffic_distribution, None);
    assert!(!sp.externally_accessible());
    assert!(sp.uses_cluster_endpoints());
    assert!(!sp.uses_local_endpoints());
    assert_eq!(
        sp.all_ips().copied().collect::<Vec<_>>(),
        vec![ip("172.30.0.41")]
    );
    // Only clusterIP set (old objects / version skew): still used.
    let s = svc_spec(json!({"clusterIP": "172.30.0.41", "ports": p80()}));
    assert_eq!(one(&s, IpFamily::V4).cluster_ip, ip("172.30.0.41"));
}

#[test]
fn unnamed_port_and_default_protocol() {
    let s = svc_spec(json!({"clusterIP": "172.30.0.41", "ports": [{"port": 53}]}));
    let sp = one(&s, IpFamily::V4);
    assert_eq!(sp.protocol, Protocol::Tcp);
    assert_eq!(&*sp.name.port, "");
    assert_eq!(sp.name.to_string(), "ns1/svc1");
    // Missing namespace is "default".
    let s = svc(
        json!({"metadata": {"name": "svc1"}, "spec": {"clusterIP": "172.30.0.41", "ports": p80()}}),
    );
    assert_eq!(&*one(&s, IpFamily::V4).name.service.namespace, "default");
}

#[test]
fn several_ports_and_protocols() {
    let s = svc_spec(json!({
        "clusterIP": "172.30.0.10",
        "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
            {"name": "sctp", "port": 9999, "protocol": "SCTP"},
        ],
    }));
    let v = conv_ok(&s, IpFamily::V4);
    let got: Vec<(String, Protocol, u16)> = v
        .iter()
        .map(|p| (p.name.port.to_string(), p.protocol, p.port))
        .collect();
    assert_eq!(
        got,
        vec![
            ("dns".into(), Protocol::Udp, 53),
            ("dns-tcp".into(), Protocol::Tcp, 53),
            ("sctp".into(), Protocol::Sctp, 9999),
        ]
    );
    // The same name is fine with another protocol (upstream keys on name+protocol).
    let s = svc_spec(json!({
        "clusterIP": "172.30.0.10",
        "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns", "port": 53, "protocol": "TCP"},
        ],
    }));
    assert_eq!(conv_ok(&s, IpFamily::V4).len(), 2);
}

#[test]
fn node_port_service() {
    let s = svc_spec(json!({
        "type": "NodePort", "clusterIP": "172.30.0.42",
        "ports": [{"name": "p80", "port": 80, "nodePort": 3001}],
    }));
    let sp = one(&s, IpFamily::V4);
    assert_eq!(sp.node_port, 3001);
    assert!(sp.externally_accessible());
    assert!(sp.uses_cluster_endpoints());
    // A nodePort left on a ClusterIP Service is not opened.
    let s = svc_spec(json!({
        "type": "ClusterIP", "clusterIP": "172.30.0.42",
        "ports": [{"name": "p80", "port": 80, "nodePort": 3001}],
    }));
    assert_eq!(one(&s, IpFamily::V4).node_port, 0);
}

fn lb_service(extra_spec: Value, ingress: Value) -> Service {
    let mut spec = json!({
        "type": "LoadBalancer",
        "clusterIP": "172.30.0.43", "clusterIPs": ["172.30.0.43", "fd00:30::43"],
        "ipFamilies": ["IPv4", "IPv6"],
        "ports": [{"name": "p80", "port": 80, "nodePort": 3003}],
    });
    for (k, v) in extra_spec.as_object().unwrap() {
        spec[k] = v.clone();
    }
    svc(json!({
        "metadata": {"namespace": "ns1", "name": "svc1"},
        "spec": spec,
        "status": {"loadBalancer": {"ingress": ingress}},
    }))
}

#[test]
fn load_balancer_ingress_family_and_ip_mode() {
    let s = lb_service(
        json!({}),
        json!([
            {"ip": "1.2.3.4"},
            {"ip": "fd00:1::4"},
            {"ip": "5.6.7.8", "ipMode": "Proxy"},
            {"ip": "fd00:1::8", "ipMode": "Proxy"},
            {"ip": "9.9.9.9", "ipMode": "VIP"},
            {"hostname": "lb.example.com"},
            {"ip": ""},
        ]),
    );
    let v4 = one(&s, IpFamily::V4);
    assert_eq!(v4.node_port, 3003);
    assert_eq!(v4.load_balancer_ips, vec![ip("1.2.3.4"), ip("9.9.9.9")]);
    assert!(v4.externally_accessible());
    let v6 = one(&s, IpFamily::V6);
    assert_eq!(v6.cluster_ip, ip("fd00:30::43"));
    assert_eq!(v6.load_balancer_ips, vec![ip("fd00:1::4")]);
    assert_eq!(
        v6.all_ips().copied().collect::<Vec<_>>(),
        vec![ip("fd00:30::43"), ip("fd00:1::4")]
    );
}

#[test]
fn load_balancer_source_ranges_per_family() {
    let ranges = json!({"loadBalancerSourceRanges": [
        " 192.168.0.0/24 ", "10.1.2.3/16", "fd00:aa::/64", "not-a-cidr",
    ]});
    // LB IPs of both families: each family keeps its own ranges, host bits cleared.
    let s = lb_service(
        ranges.clone(),
        json!([{"ip": "1.2.3.4"}, {"ip": "fd00:1::4"}]),
    );
    let mut w = Vec::new();
    let v4 = convert_service(&s, IpFamily::V4, None, &mut w).unwrap();
    assert_eq!(
        v4[0].load_balancer_source_ranges,
        vec![net("192.168.0.0/24"), net("10.1.0.0/16")]
    );
    assert!(
        w.iter()
            .any(|w| w.contains("loadBalancerSourceRanges") && w.contains("not-a-cidr")),
        "{w:?}"
    );
    let v6 = one(&s, IpFamily::V6);
    assert_eq!(v6.load_balancer_source_ranges, vec![net("fd00:aa::/64")]);

    // No IPv6 LB IP: the IPv6 ranges guard nothing and are dropped.
    let s = lb_service(ranges.clone(), json!([{"ip": "1.2.3.4"}]));
    assert_eq!(one(&s, IpFamily::V4).load_balancer_source_ranges.len(), 2);
    assert!(one(&s, IpFamily::V6).load_balancer_source_ranges.is_empty());
    // LB still pending (no ingress at all).
    let s = lb_service(ranges, json!([]));
    assert!(one(&s, IpFamily::V4).load_balancer_source_ranges.is_empty());
}

#[test]
fn external_name_headless_and_no_cluster_ip_are_ignored() {
    let cases = [
        json!({"type": "ExternalName", "externalName": "foo.example.com", "ports": p80()}),
        // Even with a cluster IP, ExternalName is never proxied.
        json!({"type": "ExternalName", "externalName": "foo.example.com",
               "clusterIP": "172.30.0.44", "ports": p80()}),
        json!({"clusterIP": "None", "clusterIPs": ["None"], "ports": p80()}),
        json!({"clusterIP": "", "ports": p80()}),
        json!({"ports": p80()}),
    ];
    for spec in cases {
        let s = svc_spec(spec.clone());
        assert_eq!(conv(&s, IpFamily::V4), Ok(vec![]), "{spec}");
        assert_eq!(conv(&s, IpFamily::V6), Ok(vec![]), "{spec}");
    }
    // No spec at all.
    let s = svc(json!({"metadata": {"namespace": "ns1", "name": "svc1"}}));
    assert_eq!(conv(&s, IpFamily::V4), Ok(vec![]));
}

#[test]
fn dual_stack_picks_cluster_ip_per_family() {
    for (ips, v4, v6) in [
        (
            json!(["10.96.0.10", "fd00:96::10"]),
            "10.96.0.10",
            "fd00:96::10",
        ),
        // IPv6-primary dual-stack.
        (
            json!(["fd00:96::10", "10.96.0.10"]),
            "10.96.0.10",
            "fd00:96::10",
        ),
    ] {
        let s = svc_spec(json!({
            "clusterIP": ips[0], "clusterIPs": ips, "ports": p80(),
        }));
        assert_eq!(one(&s, IpFamily::V4).cluster_ip, ip(v4));
        assert_eq!(one(&s, IpFamily::V6).cluster_ip, ip(v6));
    }
    // Single-stack Services are ignored by the proxier of the other family.
    let s =
        svc_spec(json!({"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"], "ports": p80()}));
    assert_eq!(conv(&s, IpFamily::V6), Ok(vec![]));
    let s = svc_spec(
        json!({"clusterIP": "fd00:96::10", "clusterIPs": ["fd00:96::10"], "ports": p80()}),
    );
    assert_eq!(conv(&s, IpFamily::V4), Ok(vec![]));
    assert_eq!(one(&s, IpFamily::V6).cluster_ip, ip("fd00:96::10"));
}

#[test]
fn external_ips_filtered_by_family_with_warning_for_garbage() {
    let s = svc_spec(json!({
        "clusterIP": "172.30.0.41", "clusterIPs": ["172.30.0.41", "fd00:30::41"],
        "externalIPs": ["1.1.1.1", "2001:db8::1", " 3.3.3.3 ", "bogus", "1.1.1.1"],
        "ports": p80(),
    }));
    let mut w = Vec::new();
    let v4 = convert_service(&s, IpFamily::V4, None, &mut w).unwrap();
    assert_eq!(v4[0].external_ips, vec![ip("1.1.1.1"), ip("3.3.3.3")]);
    assert!(v4[0].externally_accessible());
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains("spec.externalIPs") && w[0].contains("bogus"),
        "{w:?}"
    );
    assert!(w[0].contains("ns1/svc1"), "{w:?}");
    let v6 = one(&s, IpFamily::V6);
    assert_eq!(v6.external_ips, vec![ip("2001:db8::1")]);
}

#[test]
fn session_affinity() {
    let base = |extra: Value| {
        let mut spec = json!({"clusterIP": "172.30.0.41", "ports": p80()});
        for (k, v) in extra.as_object().unwrap() {
            spec[k] = v.clone();
        }
        svc_spec(spec)
    };
    assert_eq!(
        one(&base(json!({})), IpFamily::V4).session_affinity_timeout,
        None
    );
    assert_eq!(
        one(&base(json!({"sessionAffinity": "None"})), IpFamily::V4).session_affinity_timeout,
        None
    );
    // ClientIP without config: the API default, 3 hours.
    assert_eq!(
        one(&base(json!({"sessionAffinity": "ClientIP"})), IpFamily::V4).session_affinity_timeout,
        Some(10800)
    );
    let custom = base(json!({
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
    }));
    assert_eq!(
        one(&custom, IpFamily::V4).session_affinity_timeout,
        Some(60)
    );
    // Config without ClientIP affinity is ignored.
    let off = base(json!({
        "sessionAffinity": "None",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
    }));
    assert_eq!(one(&off, IpFamily::V4).session_affinity_timeout, None);
    for bad in [0, 86401, -5] {
        let s = base(json!({
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": bad}},
        }));
        let r = reason(conv(&s, IpFamily::V4));
        assert!(r.contains("timeoutSeconds"), "{r}");
    }
}

#[test]
fn external_traffic_policy_local_only_when_externally_accessible() {
    // ClusterIP-only: eTP has no meaning.
    let s = svc_spec(json!({
        "clusterIP": "172.30.0.41", "externalTrafficPolicy": "Local", "ports": p80(),
    }));
    let sp = one(&s, IpFamily::V4);
    assert!(!sp.external_policy_local);
    assert!(!sp.uses_local_endpoints());
    // NodePort: Local, but no health check (that is for LoadBalancers).
    let s = svc_spec(json!({
        "type": "NodePort", "clusterIP": "172.30.0.41", "externalTrafficPolicy": "Local",
        "healthCheckNodePort": 30100,
        "ports": [{"name": "p80", "port": 80, "nodePort": 3001}],
    }));
    let sp = one(&s, IpFamily::V4);
    assert!(sp.external_policy_local);
    assert!(sp.uses_local_endpoints());
    assert!(sp.uses_cluster_endpoints());
    assert_eq!(sp.health_check_node_port, 0);
    // ClusterIP with externalIPs: Local applies to the externalIPs.
    let s = svc_spec(json!({
        "clusterIP": "172.30.0.41", "externalTrafficPolicy": "Local",
        "externalIPs": ["203.0.113.7"], "ports": p80(),
    }));
    assert!(one(&s, IpFamily::V4).external_policy_local);
    // ... but not for the family that has no externalIP.
    let s = svc_spec(json!({
        "clusterIP": "172.30.0.41", "clusterIPs": ["172.30.0.41", "fd00:30::41"],
        "externalTrafficPolicy": "Local", "externalIPs": ["203.0.113.7"], "ports": p80(),
    }));
    assert!(!one(&s, IpFamily::V6).external_policy_local);
}

#[test]
fn health_check_node_port_only_for_load_balancer_with_local_policy() {
    let s = lb_service(
        json!({"externalTrafficPolicy": "Local", "healthCheckNodePort": 30100}),
        json!([{"ip": "1.2.3.4"}]),
    );
    let sp = one(&s, IpFamily::V4);
    assert!(sp.external_policy_local);
    assert_eq!(sp.health_check_node_port, 30100);
    // eTP Cluster: no health check even if the field is (wrongly) set.
    let s = lb_service(
        json!({"externalTrafficPolicy": "Cluster", "healthCheckNodePort": 30100}),
        json!([{"ip": "1.2.3.4"}]),
    );
    let sp = one(&s, IpFamily::V4);
    assert!(!sp.external_policy_local);
    assert_eq!(sp.health_check_node_port, 0);
    // Upstream NeedsHealthCheck: LB + eTP Local, whether or not the LB has an IP
    // or NodePorts yet (the cloud probes nodes while provisioning).
    let s = lb_service(
        json!({
            "externalTrafficPolicy": "Local", "healthCheckNodePort": 30100,
            "allocateLoadBalancerNodePorts": false,
            "ports": [{"name": "p80", "port": 80}],
        }),
        json!([]),
    );
    assert_eq!(one(&s, IpFamily::V4).health_check_node_port, 30100);
    let s = lb_service(
        json!({"externalTrafficPolicy": "Local", "healthCheckNodePort": 70000}),
        json!([]),
    );
    assert!(reason(conv(&s, IpFamily::V4)).contains("healthCheckNodePort"));
}

#[test]
fn internal_traffic_policy_local() {
    let s = svc_spec(json!({
        "clusterIP": "172.30.0.41", "internalTrafficPolicy": "Local", "ports": p80(),
    }));
    let sp = one(&s, IpFamily::V4);
    assert!(sp.internal_policy_local);
    assert!(sp.uses_local_endpoints());
    // Internal-only: cluster endpoints are never used.
    assert!(!sp.uses_cluster_endpoints());
    let s = svc_spec(json!({
        "type": "NodePort", "clusterIP": "172.30.0.41", "internalTrafficPolicy": "Local",
        "ports": [{"name": "p80", "port": 80, "nodePort": 3001}],
    }));
    let sp = one(&s, IpFamily::V4);
    assert!(sp.internal_policy_local);
    assert!(!sp.external_policy_local);
    assert!(sp.uses_cluster_endpoints());
    assert!(sp.uses_local_endpoints());
}

#[test]
fn traffic_distribution_values() {
    for (v, want) in [
        (json!("PreferClose"), Some(TrafficDistribution::PreferClose)),
        (
            json!("PreferSameZone"),
            Some(TrafficDistribution::PreferSameZone),
        ),
        (
            json!("PreferSameNode"),
            Some(TrafficDistribution::PreferSameNode),
        ),
        (json!("preferclose"), None),
        (json!("SomethingNew"), None),
        (Value::Null, None),
    ] {
        let s = svc_spec(json!({
            "clusterIP": "172.30.0.41", "trafficDistribution": v, "ports": p80(),
        }));
        assert_eq!(one(&s, IpFamily::V4).traffic_distribution, want, "{v}");
    }
}

#[test]
fn service_proxy_name_label() {
    let s = svc(json!({
        "metadata": {"namespace": "ns1", "name": "svc1",
                     "labels": {"service.kubernetes.io/service-proxy-name": "other-proxy"}},
        "spec": {"clusterIP": "172.30.0.41", "ports": p80()},
    }));
    let mut w = Vec::new();
    assert_eq!(convert_service(&s, IpFamily::V4, None, &mut w), Ok(vec![]));
    assert_eq!(
        convert_service(&s, IpFamily::V4, Some("mine"), &mut w),
        Ok(vec![])
    );
    assert_eq!(
        convert_service(&s, IpFamily::V4, Some("other-proxy"), &mut w)
            .unwrap()
            .len(),
        1
    );
    // Unlabelled Services are ours only without a name: with one, like the
    // API source's selector, only Services labelled with it.
    let s = svc_spec(json!({"clusterIP": "172.30.0.41", "ports": p80()}));
    assert_eq!(
        convert_service(&s, IpFamily::V4, None, &mut w)
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        convert_service(&s, IpFamily::V4, Some("mine"), &mut w),
        Ok(vec![])
    );
    assert!(w.is_empty());
}

#[test]
fn label_names_and_selector_are_upstreams() {
    assert_eq!(
        SERVICE_PROXY_NAME_LABEL,
        "service.kubernetes.io/service-proxy-name"
    );
    assert_eq!(HEADLESS_LABEL, "service.kubernetes.io/headless");
    assert_eq!(
        DEFAULT_LABEL_SELECTOR,
        "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
    );
}

#[test]
fn invalid_cluster_ip_rejected() {
    for spec in [
        json!({"clusterIP": "300.1.1.1", "ports": p80()}),
        json!({"clusterIP": "not-an-ip", "ports": p80()}),
        json!({"clusterIP": "10.0.0.1", "clusterIPs": ["10.0.0.1", "garbage"], "ports": p80()}),
    ] {
        let r = reason(conv(&svc_spec(spec.clone()), IpFamily::V4));
        assert!(r.contains("clusterIP"), "{spec}: {r}");
        assert!(r.contains("ns1/svc1"), "{r}");
    }
}

#[test]
fn invalid_ports_rejected() {
    let cases: Vec<(Value, &str)> = vec![
        (json!([{"name": "a", "port": 0}]), "spec.ports[0].port"),
        (json!([{"name": "a", "port": 65536}]), "spec.ports[0].port"),
        (json!([{"name": "a", "port": -1}]), "spec.ports[0].port"),
        (
            json!([{"name": "a", "port": 80}, {"name": "b", "port": 81, "nodePort": 65536}]),
            "spec.ports[1].nodePort",
        ),
        (
            json!([{"name": "a", "port": 80, "nodePort": -3}]),
            "nodePort",
        ),
        (
            json!([{"name": "a", "port": 80}, {"name": "a", "port": 81}]),
            "duplicate port name",
        ),
        (
            json!([{"name": "a", "port": 80, "protocol": "UDP"},
                   {"name": "a", "port": 81, "protocol": "UDP"}]),
            "duplicate port name",
        ),
        (
            json!([{"name": "a", "port": 80, "protocol": "ICMP"}]),
            "protocol",
        ),
        (
            json!([{"name": "a", "port": 80, "protocol": "tcp"}]),
            "protocol",
        ),
        (
            json!([{"name": "a", "port": 80}, {"name": "b", "port": 80}]),
            "spec.ports[1]: duplicate port 80 for TCP",
        ),
        (
            json!([{"name": "a", "port": 80, "nodePort": 30000},
                   {"name": "b", "port": 81, "nodePort": 30000}]),
            "spec.ports[1]: duplicate nodePort 30000",
        ),
        (json!([{"name": "HTTP", "port": 80}]), "spec.ports[0].name"),
        (json!([{"name": "a b", "port": 80}]), "spec.ports[0].name"),
        (
            json!([{"name": "a\"; drop", "port": 80}]),
            "spec.ports[0].name",
        ),
    ];
    for (ports, want) in cases {
        let s = svc_spec(json!({"type": "NodePort", "clusterIP": "172.30.0.41", "ports": ports}));
        let r = reason(conv(&s, IpFamily::V4));
        assert!(r.contains(want), "{ports}: {r}");
    }
}

#[test]
fn invalid_names_rejected() {
    let long = "a".repeat(253);
    let bad_names = [
        long.as_str(),
        &"a".repeat(64),
        "Web",
        "web\"x",
        "web\nx",
        "web;x",
        "web } drop {",
        "a.b",
        "-web",
        "web-",
        "",
        "web\u{0}",
        "wéb",
    ];
    for bad in bad_names {
        let s = svc(json!({
            "metadata": {"namespace": "ns1", "name": bad},
            "spec": {"clusterIP": "172.30.0.41", "ports": p80()},
        }));
        let r = reason(conv(&s, IpFamily::V4));
        assert!(r.contains("name"), "{bad:?}: {r}");
        let s = svc(json!({
            "metadata": {"namespace": bad, "name": "svc1"},
            "spec": {"clusterIP": "172.30.0.41", "ports": p80()},
        }));
        let r = reason(conv(&s, IpFamily::V4));
        assert!(r.contains("namespace"), "{bad:?}: {r}");
    }
    // The longest valid label is fine.
    let ok = "a".repeat(63);
    let s = svc(json!({
        "metadata": {"namespace": ok, "name": ok},
        "spec": {"clusterIP": "172.30.0.41", "ports": p80()},
    }));
    assert_eq!(conv_ok(&s, IpFamily::V4).len(), 1);
}

#[test]
fn many_ports_accepted_as_the_api_server_does() {
    // The API server has no port count limit: 10,000 distinct ports convert.
    let ports: Vec<Value> = (0..10_000)
        .map(|i| json!({"name": format!("p{i}"), "port": i + 1}))
        .collect();
    let s = svc_spec(json!({"clusterIP": "172.30.0.41", "ports": ports}));
    let v = conv_ok(&s, IpFamily::V4);
    assert_eq!(v.len(), 10_000);
    assert_eq!(v[9_999].port, 10_000);
}

#[test]
fn more_ports_than_distinct_pairs_rejected() {
    // 65,535 x 3 + 1 entries must repeat a (port, protocol) pair.
    let protos = ["TCP", "UDP", "SCTP"];
    let ports: Vec<Value> = (0..65_535 * 3 + 1)
        .map(|i| json!({"name": format!("p{i}"), "port": i % 65_535 + 1, "protocol": protos[(i / 65_535) % 3]}))
        .collect();
    let s = svc_spec(json!({"clusterIP": "172.30.0.41", "ports": ports}));
    let r = reason(conv(&s, IpFamily::V4));
    assert!(r.contains("spec.ports") && r.contains("196606"), "{r}");
}

#[test]
fn rejection_is_per_family_independent_of_warnings() {
    // A bad externalIP only drops that IP: the Service still converts.
    let s = svc_spec(json!({
        "clusterIP": "172.30.0.41", "externalIPs": ["1.2.3.999"], "ports": p80(),
    }));
    let mut w = Vec::new();
    let v = convert_service(&s, IpFamily::V4, None, &mut w).unwrap();
    assert!(v[0].external_ips.is_empty());
    assert_eq!(w.len(), 1);
    assert!(w[0].contains("1.2.3.999"));
}

#[test]
fn leading_zero_ipv4_is_read_as_decimal_like_upstream() {
    // Upstream parses with ParseIPSloppy; older API servers store such values.
    let s = lb_service(
        json!({
            "clusterIP": "172.030.000.043", "clusterIPs": ["172.030.000.043"],
            "ipFamilies": ["IPv4"],
            "externalIPs": ["001.002.003.004"],
            "loadBalancerSourceRanges": ["010.001.002.003/16"],
        }),
        json!([{"ip": "005.006.007.008"}]),
    );
    let mut w = Vec::new();
    let sp = convert_service(&s, IpFamily::V4, None, &mut w).unwrap();
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(sp[0].cluster_ip, ip("172.30.0.43"));
    assert_eq!(sp[0].external_ips, vec![ip("1.2.3.4")]);
    assert_eq!(sp[0].load_balancer_ips, vec![ip("5.6.7.8")]);
    assert_eq!(sp[0].load_balancer_source_ranges, vec![net("10.1.0.0/16")]);
    // Not IPs, sloppy or not.
    for bad in [
        "1.2.3.4.5",
        "1.2.3",
        "256.0.0.1",
        "0x10.0.0.1",
        "1..2.3",
        "+1.2.3.4",
        "1.2.3.4/8",
    ] {
        let s = svc_spec(json!({"clusterIP": bad, "ports": p80()}));
        assert!(conv(&s, IpFamily::V4).is_err(), "{bad}");
    }
    for bad in ["010.0.0.0/", "010.0.0.0/+8", "010.0.0.0/33", "010.0.0/8"] {
        let s = lb_service(
            json!({"loadBalancerSourceRanges": [bad]}),
            json!([{"ip": "1.2.3.4"}]),
        );
        let mut w = Vec::new();
        let sp = convert_service(&s, IpFamily::V4, None, &mut w).unwrap();
        assert!(sp[0].load_balancer_source_ranges.is_empty(), "{bad}");
        assert_eq!(w.len(), 1, "{bad}: {w:?}");
    }
}

#[test]
fn same_port_on_two_protocols_is_fine() {
    let s = svc_spec(
        json!({"type": "NodePort", "clusterIP": "172.30.0.41", "ports": [
        {"name": "a", "port": 53, "protocol": "UDP", "nodePort": 30053},
        {"name": "b", "port": 53, "protocol": "TCP", "nodePort": 30053}]}),
    );
    assert_eq!(conv_ok(&s, IpFamily::V4).len(), 2);
}

#[test]
fn rejection_messages_escape_names() {
    let s = svc(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "default", "name": "evil\nWARN forged line"},
        "spec": {"clusterIP": "172.30.0.41", "ports": [{"port": 80}]}
    }));
    let r = reason(conv(&s, IpFamily::V4));
    assert!(!r.contains('\n'), "{r}");
    assert!(r.contains("evil\\nWARN forged line"), "{r}");
}
