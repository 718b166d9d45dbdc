// Shared by the nftables tests: build model state from JSON objects.
#![allow(dead_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::time::SystemTime;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_model::{ChangeSet, ChangeTracker, IpFamily, TrackerConfig};
use kp_netlab::ScratchNs;
use kp_testkit::objects;
use serde_json::{json, Value};

pub fn tracker(family: IpFamily) -> ChangeTracker {
    ChangeTracker::new(TrackerConfig {
        family,
        node_name: "node1".into(),
        service_proxy_name: None,
    })
}

pub fn svc(v: Value) -> Service {
    serde_json::from_value(v).unwrap()
}

pub fn slice(v: Value) -> EndpointSlice {
    serde_json::from_value(v).unwrap()
}

pub fn apply(t: &mut ChangeTracker, objs: &[Value]) -> ChangeSet {
    for o in objs {
        match o["kind"].as_str() {
            Some("Service") => {
                t.update_service(&svc(o.clone()), SystemTime::now())
                    .unwrap();
            }
            Some("EndpointSlice") => {
                t.update_endpoint_slice(&slice(o.clone()), SystemTime::now())
                    .unwrap();
            }
            k => panic!("unexpected kind {k:?}"),
        }
    }
    t.take_changes()
}

/// A Service with one TCP port 80 -> 8080.
pub fn service(name: &str, ip: &str, extra: Value) -> Value {
    objects::service("default", name)
        .cluster_ips(&[ip])
        .spec(json!({"type": "ClusterIP"}))
        .port_json(json!({"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}))
        .spec(extra)
        .json()
}

/// An EndpointSlice for `svc` with (ip, node, ready, serving, terminating).
pub fn endpoints(svc: &str, eps: &[(&str, &str, bool, bool, bool)]) -> Value {
    let family = if eps.first().is_some_and(|e| e.0.contains(':')) {
        "IPv6"
    } else {
        "IPv4"
    };
    eps.iter()
        .fold(
            objects::slice("default", &format!("{svc}-abc"), svc)
                .address_type(family)
                .port("http", 8080, "TCP"),
            |b, (ip, node, r, s, t)| {
                b.endpoint_json(json!({
                    "addresses": [ip], "nodeName": node,
                    "conditions": {"ready": r, "serving": s, "terminating": t}
                }))
            },
        )
        .json()
}

pub fn ready(
    ip: &'static str,
    node: &'static str,
) -> (&'static str, &'static str, bool, bool, bool) {
    (ip, node, true, true, false)
}

/// A network namespace with a unique name, deleted on drop even when the
/// test fails.
pub struct Ns(pub ScratchNs);

impl Ns {
    pub fn new(tag: &str) -> Ns {
        let name = format!("kpnl{tag}{}", std::process::id());
        // A leftover of a killed run with this pid goes first.
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
        Ns(ScratchNs::create(&name).unwrap())
    }

    /// Runs `f` on a thread that has entered the namespace (sockets it opens
    /// and processes it starts live there).
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        use std::os::fd::AsRawFd;
        std::thread::scope(|s| {
            s.spawn(|| {
                let file =
                    std::fs::File::open(format!("/var/run/netns/{}", self.0.name())).unwrap();
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0, "setns {}", self.0.name());
                f()
            })
            .join()
            .unwrap()
        })
    }

    /// `nft ARGS` in the namespace: stdout, or stderr as the error.
    pub fn nft(&self, args: &[&str]) -> Result<String, String> {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", self.0.name(), "nft"])
            .args(args)
            .output()
            .unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).to_string())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).to_string())
        }
    }

    pub fn ruleset(&self) -> String {
        self.nft(&["list", "ruleset"]).unwrap()
    }
}
