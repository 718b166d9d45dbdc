//! kube-proxy-rs's benchmarks, one module per `kp-bench` subcommand (its
//! arguments as a clap struct and a `run`), and what they share: synthetic
//! clusters (below), the API lab and proxy processes (lab), scratch network
//! namespaces (netns).

pub mod cluster;
pub mod compare;
pub mod connect;
pub mod idle;
pub mod lab;
pub mod maglev;
pub mod netns;
pub mod pps;
pub mod prog;
pub mod reconcile;
pub mod soak;
pub mod tables;
pub mod userspace_relay;

use std::time::SystemTime;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_model::{ChangeTracker, IpFamily, TrackerConfig};
use serde_json::{json, Value};

/// One Service and its EndpointSlice, in the shape of the API objects.
pub struct Synthetic {
    pub services: Vec<Value>,
    pub slices: Vec<Value>,
}

impl Synthetic {
    /// The objects parsed as the API's types.
    pub fn parsed(self) -> anyhow::Result<(Vec<Service>, Vec<EndpointSlice>)> {
        let svcs = self
            .services
            .into_iter()
            .map(serde_json::from_value)
            .collect::<Result<_, _>>()?;
        let slices = self
            .slices
            .into_iter()
            .map(serde_json::from_value)
            .collect::<Result<_, _>>()?;
        Ok((svcs, slices))
    }
}

fn ip4(base: u32, i: u32) -> String {
    let v = base + i;
    format!(
        "{}.{}.{}.{}",
        v >> 24,
        (v >> 16) & 255,
        (v >> 8) & 255,
        v & 255
    )
}

/// `n` Services with `m` endpoints each: mostly ClusterIP; every 10th a
/// NodePort, every 20th a LoadBalancer with eTP=Local, every 20th with session
/// affinity, every 10th with a second (UDP) port. Endpoints are spread over
/// node1..node4.
pub fn cluster(n: u32, m: u32) -> Synthetic {
    cluster_with(n, m, true)
}

/// [`cluster`], with or without the session-affinity Services.
pub fn cluster_with(n: u32, m: u32, affinity: bool) -> Synthetic {
    cluster_range(0..n, m, affinity)
}

/// Services `ids` of [`cluster_with`] and their slices (a Service's objects
/// depend on its index alone): the next ones a bench adds to a cluster.
pub fn cluster_range(ids: std::ops::Range<u32>, m: u32, affinity: bool) -> Synthetic {
    let mut services = Vec::with_capacity(ids.len());
    let mut slices = Vec::with_capacity(ids.len());
    for i in ids {
        let name = format!("svc-{i}");
        let cip = cluster_ip(i);
        let mut ports =
            vec![json!({"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080})];
        let multi = i % 10 == 3;
        if multi {
            ports.push(json!({"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8053}));
        }
        let mut spec =
            json!({"clusterIP": cip, "clusterIPs": [cip], "type": "ClusterIP", "ports": ports});
        let mut status = json!({});
        if i % 10 == 1 {
            spec["type"] = json!("NodePort");
            spec["ports"][0]["nodePort"] = json!(30000 + (i % 2700));
        }
        if i % 20 == 5 {
            spec["type"] = json!("LoadBalancer");
            spec["externalTrafficPolicy"] = json!("Local");
            spec["healthCheckNodePort"] = json!(32700 + (i % 60));
            spec["ports"][0]["nodePort"] = json!(30000 + (i % 2700));
            status = json!({"loadBalancer": {"ingress": [{"ip": ip4(0xcb00_7100, i % 250)}]}});
        }
        if affinity && i % 20 == 7 {
            spec["sessionAffinity"] = json!("ClientIP");
        }
        services.push(json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "bench", "name": name}, "spec": spec, "status": status}));
        slices.push(slice(i, m, 0, multi));
    }
    Synthetic { services, slices }
}

/// [`cluster_with`]'s objects parsed as the API's types.
pub fn parsed_cluster(
    n: u32,
    m: u32,
    affinity: bool,
) -> anyhow::Result<(Vec<Service>, Vec<EndpointSlice>)> {
    cluster_with(n, m, affinity).parsed()
}

/// An empty IPv4 change tracker of node1 (where [`cluster`] puts a
/// quarter of the endpoints).
pub fn tracker() -> ChangeTracker {
    ChangeTracker::new(TrackerConfig {
        family: IpFamily::V4,
        node_name: "node1".into(),
        service_proxy_name: None,
    })
}

/// A fresh [`tracker`] holding `svcs` and `slices`, their changes taken:
/// what the tables' model column and the criterion tracker bench time.
pub fn tracked(svcs: &[Service], slices: &[EndpointSlice]) -> ChangeTracker {
    let mut tr = tracker();
    let now = SystemTime::now();
    for s in svcs {
        let _ = tr.update_service(s, now);
    }
    for s in slices {
        let _ = tr.update_endpoint_slice(s, now);
    }
    tr.take_changes();
    tr
}

/// Service `i`'s ClusterIP in [`cluster`]: 10.96.0.10 + i.
pub fn cluster_ip(i: u32) -> String {
    ip4(0x0a60_0000, i + 10)
}

/// The address a generation of [`slice`] moves: its last endpoint's.
pub fn moved_address(slice: &Value) -> String {
    slice["endpoints"]
        .as_array()
        .and_then(|eps| eps.last())
        .and_then(|e| e["addresses"][0].as_str())
        .unwrap_or_default()
        .to_string()
}

/// The EndpointSlice of Service `i` with `m` endpoints; `generation` shifts
/// the addresses so that each generation replaces one endpoint.
pub fn slice(i: u32, m: u32, generation: u32, multi: bool) -> Value {
    let mut ports = vec![json!({"name": "http", "port": 8080, "protocol": "TCP"})];
    if multi {
        ports.push(json!({"name": "dns", "port": 8053, "protocol": "UDP"}));
    }
    // 10.128.0.0/9: unique per (service, endpoint); the last endpoint moves
    // with each generation within the Service's own block of addresses, over
    // the offsets the others do not use, so a replacement never collides with
    // another endpoint (which would change the count: a different workload).
    let stride = (2 * m).next_power_of_two().max(64);
    let free = stride - (m - 1).min(stride - 1);
    // Generation 0 is the slice as created; later ones cycle over the other
    // free offsets and never come back to it: a "moved" endpoint already in
    // place would be timed as an instant change (compare's burst at 10k,
    // generation 55, did).
    let shift = if generation == 0 || free < 2 {
        0
    } else {
        1 + (generation - 1) % (free - 1)
    };
    let eps: Vec<Value> = (0..m)
        .map(|j| {
            let k = if j + 1 == m { j + shift } else { j };
            json!({"addresses": [ip4(0x0a80_0000, i * stride + (k % stride))],
                   "nodeName": format!("node{}", j % 4 + 1),
                   "conditions": {"ready": true}})
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": "bench", "name": format!("svc-{i}-x"),
                     "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
        "addressType": "IPv4", "ports": ports, "endpoints": eps})
}

/// One Service with `ports` TCP ports (80.. upwards, named `p0`..) and
/// `m` endpoints, as the EndpointSlice controller writes it: slices of at
/// most 100 ports (the API's limit per slice). `generation` moves the last
/// endpoint of the first slice, as [`slice`] does.
pub fn many_ports(ports: u32, m: u32, generation: u32) -> Synthetic {
    let svc_ports: Vec<Value> = (0..ports)
        .map(|p| json!({"name": format!("p{p}"), "port": 80 + p, "protocol": "TCP", "targetPort": 20000 + p}))
        .collect();
    let cip = "10.96.200.1";
    let service = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "bench", "name": "many-ports"},
        "spec": {"clusterIP": cip, "clusterIPs": [cip], "type": "ClusterIP", "ports": svc_ports}});
    let slices = (0..ports.div_ceil(100))
        .map(|k| {
            let sl_ports: Vec<Value> = (k * 100..((k + 1) * 100).min(ports))
                .map(|p| json!({"name": format!("p{p}"), "port": 20000 + p, "protocol": "TCP"}))
                .collect();
            let eps: Vec<Value> = (0..m)
                .map(|j| {
                    let shift = if k == 0 && j + 1 == m { generation } else { 0 };
                    json!({"addresses": [ip4(0x0a80_0000, j + shift * m)],
                           "nodeName": format!("node{}", j % 4 + 1),
                           "conditions": {"ready": true}})
                })
                .collect();
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"namespace": "bench", "name": format!("many-ports-{k}"),
                             "labels": {"kubernetes.io/service-name": "many-ports"}},
                "addressType": "IPv4", "ports": sl_ports, "endpoints": eps})
        })
        .collect();
    Synthetic {
        services: vec![service],
        slices,
    }
}
