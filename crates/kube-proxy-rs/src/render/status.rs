//! `status`'s table: kp-model's [`FamilyStatus`] rows drawn like `kubectl
//! get`, for `kube-proxy-rs status` and `/debug/services?format=text`.

use std::fmt::Write;

use kp_model::status::{EndpointStatus, FamilyStatus};

fn or_dash(s: String) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s
    }
}

fn join<T: std::fmt::Display>(v: &[T]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Endpoint conditions in one word list: `ready`, `serving`, `terminating`,
/// `local`, and which traffic uses it.
fn endpoint_cell(s: &EndpointStatus) -> String {
    let e = &s.endpoint;
    let mut flags = Vec::new();
    if e.ready {
        flags.push("ready");
    } else if e.serving {
        flags.push("serving");
    } else {
        flags.push("unready");
    }
    if e.terminating {
        flags.push("terminating");
    }
    if e.local {
        flags.push("local");
    }
    if !s.internal && !s.external {
        flags.push("unused");
    }
    format!("{}({})", e.address, flags.join(","))
}

/// A plain table, one header per family, one row per Service port.
pub fn status_table(families: &[FamilyStatus]) -> String {
    let mut o = String::new();
    for f in families {
        let _ = writeln!(
            o,
            "{}  node {}{}  last sync {}",
            f.family,
            f.node,
            f.zone
                .as_deref()
                .map(|z| format!(" (zone {z})"))
                .unwrap_or_default(),
            match (&f.last_sync, &f.last_sync_kind) {
                (Some(t), Some(k)) => format!("{t} ({k})"),
                (Some(t), None) => t.clone(),
                _ => "never".into(),
            }
        );
        if f.service_ports.is_empty() {
            let _ = writeln!(o, "  no Service ports\n");
            continue;
        }
        let header = [
            "SERVICE",
            "PROTO",
            "CLUSTER-IP",
            "PORT",
            "NODEPORT",
            "EXTERNAL",
            "POLICY",
            "AFFINITY",
            "ENDPOINTS",
        ];
        let rows: Vec<[String; 9]> = f
            .service_ports
            .iter()
            .map(|s| {
                let mut ext: Vec<String> = s.external_ips.iter().map(|i| i.to_string()).collect();
                ext.extend(s.load_balancer_ips.iter().map(|i| format!("lb:{i}")));
                [
                    s.service_port.clone(),
                    s.protocol.clone(),
                    s.cluster_ip.to_string(),
                    s.port.to_string(),
                    if s.node_port == 0 {
                        "-".into()
                    } else {
                        s.node_port.to_string()
                    },
                    or_dash(join(&ext)),
                    format!(
                        "i={},e={}",
                        s.internal_traffic_policy, s.external_traffic_policy
                    ),
                    s.session_affinity_seconds
                        .map(|t| format!("{t}s"))
                        .unwrap_or_else(|| "-".into()),
                    or_dash(
                        s.endpoints
                            .iter()
                            .map(endpoint_cell)
                            .collect::<Vec<_>>()
                            .join(" "),
                    ),
                ]
            })
            .collect();
        let mut width = header.map(str::len);
        for r in &rows {
            for (w, c) in width.iter_mut().zip(r.iter()).take(8) {
                *w = (*w).max(c.len());
            }
        }
        let line = |cells: Vec<&str>| {
            let mut l = String::new();
            for (i, c) in cells.iter().enumerate() {
                if i == 8 {
                    l.push_str(c);
                } else {
                    let _ = write!(l, "{:<w$}  ", c, w = width[i]);
                }
            }
            l.trim_end().to_string()
        };
        let _ = writeln!(o, "{}", line(header.to_vec()));
        for r in &rows {
            let _ = writeln!(o, "{}", line(r.iter().map(String::as_str).collect()));
        }
        o.push('\n');
    }
    o
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kp_model::status::{service_ports, FamilyStatus};
    use kp_model::{Endpoint, IpFamily, NodeInfo, ProxyState, ServicePort};

    use super::status_table;

    #[test]
    fn a_family_header_and_a_row_per_service_port() {
        let web = ServicePort::builder("default", "web")
            .port_name("http")
            .cluster_ip("10.96.0.10")
            .node_port(30080)
            .external_ips(&["203.0.113.7"])
            .load_balancer_ips(&["198.51.100.9"])
            .build();
        let eps = vec![
            Endpoint::at("10.244.1.5:8080").local(),
            Endpoint::at("10.244.2.6:8080").serving_terminating(),
        ];
        let mut s = ProxyState::new(IpFamily::V4, NodeInfo::named("node1"));
        s.endpoints.insert(web.name.clone(), Arc::new(eps));
        s.services.insert(web.name.clone(), Arc::new(web));
        let table = status_table(&[FamilyStatus {
            family: "IPv4".into(),
            node: "node1".into(),
            zone: None,
            last_sync: Some("2024-01-01T00:00:00Z".into()),
            last_sync_kind: Some("full".into()),
            service_ports: service_ports(&s, None),
        }]);
        assert!(
            table.contains("last sync 2024-01-01T00:00:00Z (full)"),
            "{table}"
        );
        assert!(table.contains("SERVICE"), "{table}");
        assert!(table.contains("default/web:http"), "{table}");
        assert!(table.contains("10.244.1.5:8080(ready,local)"), "{table}");
        assert!(
            table.contains("10.244.2.6:8080(serving,terminating,unused)"),
            "{table}"
        );
        assert!(table.contains("203.0.113.7,lb:198.51.100.9"), "{table}");
    }
}
