//! `--detect-local-mode=NodeCIDR`: this node's podCIDRs, waited for before
//! the dataplanes are built and watched afterwards, as upstream's NodeManager
//! (pkg/proxy/node.go): it polls its Node every second for up to five
//! minutes, fails when no podCIDRs came, and exits when they change later so
//! that the restarted proxy (the DaemonSet restarts it) uses the new ones.

use std::future::Future;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kp_model::{convert_node, PodCidrs};
use tokio::time::Instant;

/// How long upstream waits for the allocator to assign podCIDRs.
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(5 * 60);
/// Upstream's poll interval.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// One look at the Node may take this long (an unanswered API request would
/// otherwise hold the wait for the client's read timeout, minutes).
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// The wait repeats its log line this often, so a stuck start says why.
const LOG_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum NodeCidrError {
    #[error("{why}: gave up after {waited:?} waiting for Node {node}'s {what}: {reason}")]
    Timeout {
        /// The setting that needs it ("--detect-local-mode=NodeCIDR").
        why: &'static str,
        node: String,
        /// What was waited for ("podCIDRs").
        what: &'static str,
        waited: Duration,
        reason: String,
    },
    #[error(
        "--detect-local-mode=NodeCIDR: Node {node}'s podCIDRs changed from {old:?} to {new:?}; \
         exiting so that the restarted proxy detects local traffic with the new ones"
    )]
    Changed {
        node: String,
        old: Vec<String>,
        new: Vec<String>,
    },
    #[error(
        "nodePortAddresses primary: Node {node}'s IPs changed from {old:?} to {new:?}; \
         exiting so that the restarted proxy accepts NodePorts on the new ones"
    )]
    IpsChanged {
        node: String,
        old: Vec<IpAddr>,
        new: Vec<IpAddr>,
    },
}

/// What [`wait_for_node`] waits for: which setting needs it, what it is,
/// the Node field that lacks it, and how to take it from a Node (None:
/// not there yet).
pub struct Wanted<T> {
    pub why: &'static str,
    pub what: &'static str,
    pub missing: &'static str,
    pub take: fn(&Node) -> Option<T>,
}

/// spec.podCIDRs, for NodeCIDR mode. Upstream accepts any non-empty
/// spec.podCIDRs; entries that do not parse only lose local-traffic
/// detection for their family.
pub const POD_CIDRS: Wanted<PodCidrs> = Wanted {
    why: "--detect-local-mode=NodeCIDR",
    what: "podCIDRs",
    missing: "spec.podCIDRs",
    take: |n| Some(convert_node(n).pod_cidrs).filter(|c| !c.raw.is_empty()),
};

/// The primary IPs (upstream's GetNodeHostIPs), for `nodePortAddresses:
/// primary`.
pub const HOST_IPS: Wanted<Vec<IpAddr>> = Wanted {
    why: "nodePortAddresses primary",
    what: "IPs",
    missing: "InternalIP or ExternalIP address",
    take: |n| Some(convert_node(n).host_ips()).filter(|ips| !ips.is_empty()),
};

/// Calls `fetch` (this node's Node: `Ok(None)` when it does not exist, `Err`
/// with a reason when it could not be read) every `poll` until the Node has
/// what `want` takes, logging why it waits; fails after `timeout`.
pub async fn wait_for<F, Fut, T>(
    node: &str,
    want: &Wanted<T>,
    mut fetch: F,
    poll: Duration,
    timeout: Duration,
) -> Result<T, NodeCidrError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<Node>, String>>,
{
    let start = Instant::now();
    let mut logged: Option<Instant> = None;
    loop {
        let reason = match tokio::time::timeout(FETCH_TIMEOUT, fetch()).await {
            Ok(Ok(Some(n))) => match (want.take)(&n) {
                Some(got) => return Ok(got),
                None => format!("Node {node} has no {} yet", want.missing),
            },
            Ok(Ok(None)) => format!("Node {node} does not exist"),
            Ok(Err(e)) => e,
            Err(_) => format!("no answer within {FETCH_TIMEOUT:?}"),
        };
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(NodeCidrError::Timeout {
                why: want.why,
                node: node.to_string(),
                what: want.what,
                waited,
                reason,
            });
        }
        if logged.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
            tracing::info!(
                node,
                %reason,
                waited_s = waited.as_secs(),
                "waiting for this node's {} ({})", want.what, want.why
            );
            logged = Some(Instant::now());
        }
        tokio::time::sleep(poll).await;
    }
}

/// [`wait_for`] podCIDRs.
pub async fn wait_for_pod_cidrs<F, Fut>(
    node: &str,
    fetch: F,
    poll: Duration,
    timeout: Duration,
) -> Result<PodCidrs, NodeCidrError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<Node>, String>>,
{
    wait_for(node, &POD_CIDRS, fetch, poll, timeout).await
}

/// Upstream's detectNodeIPs: a `--bind-address` that is not 0.0.0.0 or ::
/// replaces the Node's IP of its family (and comes first).
pub fn with_bind_address(ips: &[IpAddr], bind: IpAddr) -> Vec<IpAddr> {
    if bind.is_unspecified() {
        return ips.to_vec();
    }
    let mut out: Vec<IpAddr> = ips
        .iter()
        .filter(|ip| ip.is_ipv4() != bind.is_ipv4())
        .copied()
        .collect();
    out.insert(0, bind);
    out
}

/// The primary IPs the dataplanes were built with (`nodePortAddresses:
/// primary`): like upstream's NodeManager, a change exits the proxy so that
/// its restart uses the new ones.
#[derive(Clone, Debug)]
pub struct HostIpsWatch {
    node: String,
    ips: Vec<IpAddr>,
}

impl HostIpsWatch {
    pub fn new(node: &str, started_with: &[IpAddr]) -> Self {
        HostIpsWatch {
            node: node.to_string(),
            ips: started_with.to_vec(),
        }
    }

    /// `Err` when `n` is this node and its primary IPs differ from the ones
    /// we started with; other Nodes are not ours, and a Node that lists no
    /// address at all is not acted on (upstream logs and keeps going).
    pub fn check(&self, n: &Node) -> Result<(), NodeCidrError> {
        if n.metadata.name.as_deref() != Some(self.node.as_str()) {
            return Ok(());
        }
        let now = convert_node(n).host_ips();
        if now.is_empty() || now == self.ips {
            return Ok(());
        }
        Err(NodeCidrError::IpsChanged {
            node: self.node.clone(),
            old: self.ips.clone(),
            new: now,
        })
    }
}

/// The podCIDRs the dataplanes were built with.
#[derive(Clone, Debug)]
pub struct PodCidrWatch {
    node: String,
    raw: Vec<String>,
}

impl PodCidrWatch {
    pub fn new(node: &str, started_with: &PodCidrs) -> Self {
        PodCidrWatch {
            node: node.to_string(),
            raw: started_with.raw.clone(),
        }
    }

    /// `Err` when `n` is this node and its podCIDRs differ from the ones we
    /// started with (compared as written, as upstream does); other Nodes
    /// are not ours.
    pub fn check(&self, n: &Node) -> Result<(), NodeCidrError> {
        if n.metadata.name.as_deref() != Some(self.node.as_str()) {
            return Ok(());
        }
        let now = convert_node(n).pod_cidrs.raw;
        if now == self.raw {
            return Ok(());
        }
        Err(NodeCidrError::Changed {
            node: self.node.clone(),
            old: self.raw.clone(),
            new: now,
        })
    }
}

/// What `want` takes from this node's Node, from the manifest directory or
/// (listed, as the watcher does) from the API server; waited for as
/// upstream's NodeManager waits. With the API server, also the list that
/// answered, for the source's Node watch to start from (one list of the
/// Node per start, as upstream's one Node informer).
pub async fn wait_for_node<T>(
    cfg: &crate::config::ProxyConfig,
    want: &Wanted<T>,
) -> anyhow::Result<(T, Option<kp_source::NodeListed>)> {
    let node = cfg.hostname.clone();
    let (poll, timeout) = (POLL_INTERVAL, WAIT_TIMEOUT);
    Ok(if let Some(dir) = cfg.manifests.clone() {
        let fetch = || {
            let got = kp_source::load_dir(&dir)
                .map(|l| l.nodes.get(&node).cloned())
                .map_err(|e| e.to_string());
            std::future::ready(got)
        };
        (wait_for(&node, want, fetch, poll, timeout).await?, None)
    } else {
        let client = crate::kube::source::kube_client(cfg).await?;
        let encoding =
            kp_source::Encoding::new(&cfg.client.content_type, &cfg.client.accept_content_types);
        let streaming = crate::kube::source::streaming_lists(cfg);
        let last = std::sync::Arc::new(std::sync::Mutex::new(None));
        let fetch = || {
            let (client, node, encoding) = (client.clone(), node.clone(), encoding.clone());
            let last = last.clone();
            async move {
                let listed = kp_source::list_node(&client, &node, &encoding, streaming)
                    .await
                    .map_err(|e| e.to_string())?;
                let found = listed.node.clone();
                if let Ok(mut l) = last.lock() {
                    *l = Some(listed);
                }
                Ok(found)
            }
        };
        let got = wait_for(&node, want, fetch, poll, timeout).await?;
        let listed = last.lock().ok().and_then(|mut l| l.take());
        (got, listed)
    })
}

/// NodeCIDR mode: this node's podCIDRs ([`wait_for_node`]), logged.
pub async fn wait_for_node_pod_cidrs(
    cfg: &crate::config::ProxyConfig,
) -> anyhow::Result<(PodCidrs, Option<kp_source::NodeListed>)> {
    let node = cfg.hostname.clone();
    let (cidrs, listed) = wait_for_node(cfg, &POD_CIDRS).await?;
    for bad in &cidrs.invalid {
        tracing::warn!(node = %node, cidr = %bad, "ignoring a podCIDR that is not a CIDR");
    }
    for f in crate::modes::FAMILIES {
        if !cidrs.cidrs.iter().any(|c| f.matches(&c.addr())) {
            tracing::info!(
                node = %node,
                family = ?f,
                "no podCIDR of this family: its local traffic is not detected"
            );
        }
    }
    let shown: Vec<String> = cidrs.cidrs.iter().map(ToString::to_string).collect();
    tracing::info!(node = %node, pod_cidrs = ?shown, "detecting local traffic by this node's podCIDRs");
    Ok((cidrs, listed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, cidrs: &[&str]) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"podCIDRs": cidrs},
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn waits_until_the_node_has_pod_cidrs() {
        let mut answers = vec![
            Err("connection refused".to_string()),
            Ok(None),
            Ok(Some(node("n1", &[]))),
            Ok(Some(node("n1", &["10.244.1.0/24", "fd00::/64"]))),
        ]
        .into_iter();
        let mut calls = 0;
        let got = wait_for_pod_cidrs(
            "n1",
            || {
                calls += 1;
                std::future::ready(answers.next().unwrap())
            },
            Duration::from_millis(1),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        assert_eq!(calls, 4);
        assert_eq!(
            got.cidrs,
            vec![
                "10.244.1.0/24".parse().unwrap(),
                "fd00::/64".parse().unwrap()
            ]
        );
    }

    #[tokio::test]
    async fn gives_up_with_the_reason() {
        let err = wait_for_pod_cidrs(
            "n1",
            || std::future::ready(Ok(Some(node("n1", &[])))),
            Duration::from_millis(5),
            Duration::from_millis(50),
        )
        .await
        .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, NodeCidrError::Timeout { .. }), "{msg}");
        assert!(msg.contains("Node n1 has no spec.podCIDRs"), "{msg}");
    }

    #[test]
    fn bind_address_replaces_the_node_ip_of_its_family() {
        let ips: Vec<IpAddr> = vec!["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()];
        assert_eq!(with_bind_address(&ips, "0.0.0.0".parse().unwrap()), ips);
        assert_eq!(with_bind_address(&ips, "::".parse().unwrap()), ips);
        assert_eq!(
            with_bind_address(&ips, "fd00::9".parse().unwrap()),
            vec!["fd00::9".parse::<IpAddr>().unwrap(), ips[0]]
        );
        assert_eq!(
            with_bind_address(&[], "10.0.0.9".parse().unwrap()),
            vec!["10.0.0.9".parse::<IpAddr>().unwrap()]
        );
    }

    #[test]
    fn a_change_of_our_node_ips_is_an_error() {
        let n = |name: &str, ips: &[&str]| -> Node {
            let addrs: Vec<serde_json::Value> = ips
                .iter()
                .map(|a| json!({"type": "InternalIP", "address": a}))
                .collect();
            serde_json::from_value(
                json!({"metadata": {"name": name}, "status": {"addresses": addrs}}),
            )
            .unwrap()
        };
        let w = HostIpsWatch::new("n1", &["10.0.0.5".parse().unwrap()]);
        assert!(w.check(&n("n1", &["10.0.0.5"])).is_ok());
        assert!(w.check(&n("other", &["10.0.0.6"])).is_ok());
        // A Node that lists no address is not acted on.
        assert!(w.check(&n("n1", &[])).is_ok());
        let err = w.check(&n("n1", &["10.0.0.6"])).unwrap_err();
        assert!(matches!(err, NodeCidrError::IpsChanged { .. }), "{err}");
    }

    #[test]
    fn a_change_of_our_pod_cidrs_is_an_error() {
        let start = convert_node(&node("n1", &["10.244.1.0/24"])).pod_cidrs;
        let w = PodCidrWatch::new("n1", &start);
        assert!(w.check(&node("n1", &["10.244.1.0/24"])).is_ok());
        assert!(w.check(&node("other", &["10.9.0.0/24"])).is_ok());
        let err = w.check(&node("n1", &["10.244.2.0/24"])).unwrap_err();
        assert!(
            matches!(&err, NodeCidrError::Changed { old, new, .. }
                if old == &["10.244.1.0/24"] && new == &["10.244.2.0/24"]),
            "{err}"
        );
        // Losing them is a change too (upstream compares the lists).
        assert!(w.check(&node("n1", &[])).is_err());
    }
}
