//! The lab of `kp-bench compare`, `soak` and `pps`: one real control plane (kp-testkit:
//! etcd + kube-apiserver v1.36 in a namespace of its own), two node
//! namespaces, kp-bench's synthetic cluster written through the API, and a
//! proxy binary run in a node namespace and observed only through what
//! every kube-proxy exports (/metrics, /proc, the kernel's ruleset).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use base64::Engine;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::jiff::Timestamp;
use kp_netlab::{Cluster, ClusterOpts, ProcGuard};
use kp_testkit::{ControlPlane, ControlPlaneOpts, K8sBinaries};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

/// The namespace the synthetic Services live in.
pub const NS: &str = "bench";
/// Endpoints per Service.
pub const ENDPOINTS: u32 = 10;

/// Whether `text` holds address `ip` as a whole (10.1.0.7 is not in 10.1.0.73).
pub fn has_ip(text: &str, ip: &str) -> bool {
    text.match_indices(ip).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + ip.len()..].chars().next();
        !before.is_some_and(|c| c.is_ascii_digit() || c == '.')
            && !after.is_some_and(|c| c.is_ascii_digit())
    })
}

pub fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// The `p` quantile of `v` (zero when empty), sorting a copy.
pub fn pct(v: &[Duration], p: f64) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    quantile(&v, p)
}

/// The `p` quantile of samples already sorted (zero when there are none):
/// the nearest rank, as every kp-bench table reports it.
pub fn quantile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

pub fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The lab's node `i` as the kubelet would register it.
pub fn node(cluster: &Cluster, i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": format!("node{i}"), "labels": {"kubernetes.io/hostname": format!("node{i}")}},
        "spec": {"podCIDRs": [cluster.pod_cidr(i).to_string()]},
        "status": {"addresses": [{"type": "InternalIP", "address": cluster.node_ip(i).to_string()}]}})
}

/// kp-bench's Service, with the NodePorts left to the API server (it
/// refuses kp-bench's repeating ones) and the namespace of this run.
pub fn api_service(mut s: Value) -> (Value, Option<Value>) {
    let status = s.as_object_mut().and_then(|o| o.remove("status"));
    if let Some(ports) = s["spec"]["ports"].as_array_mut() {
        for p in ports {
            if let Some(p) = p.as_object_mut() {
                p.remove("nodePort");
            }
        }
    }
    if let Some(spec) = s["spec"].as_object_mut() {
        spec.remove("healthCheckNodePort");
    }
    let lb = status.filter(|st| st["loadBalancer"]["ingress"].is_array());
    (s, lb)
}

/// Objects [`Lab::populate_etcd`] puts in one etcd transaction: etcd's
/// default `--max-txn-ops`.
pub const ETCD_TXN_OPS: usize = 128;

/// etcd keys and values of kp-bench's cluster of `n` Services as
/// kube-apiserver stores them, in JSON (which it reads beside its default
/// protobuf): each Service with the fields the API server defaults on create
/// and NodePorts (health-check ports too) numbered upwards from 30000 (the API
/// server refuses kp-bench's repeating ones), its EndpointSlice, and the
/// IPAddress object holding its ClusterIP, as the allocator writes it
/// (without one, the API server's repair loop would create them all while
/// the proxy is measured). Needs `compare --only-ours`'s ranges: ClusterIPs
/// in 10.96.0.0/15 past 65k Services, NodePorts 30000-59999.
pub fn etcd_objects(n: u32, created: Timestamp) -> Result<Vec<(String, String)>> {
    let syn = crate::cluster(n, ENDPOINTS);
    let created = Timestamp::from_second(created.as_second())?.to_string();
    let mut next_port: u32 = 30000;
    let mut port = || {
        next_port += 1;
        if next_port > 60000 {
            bail!("NodePorts 30000-59999 are all taken");
        }
        Ok(next_port - 1)
    };
    let mut out = Vec::with_capacity(3 * n as usize);
    for (i, (mut svc, mut slice)) in syn.services.into_iter().zip(syn.slices).enumerate() {
        let i = i as u64;
        let uid = |k: u64| format!("00000000-0000-4000-8000-{:012x}", k * u64::from(n) + i);
        let name = svc["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let meta = |uid: String| json!({"uid": uid, "creationTimestamp": created});
        merge(&mut svc["metadata"], meta(uid(0)));
        let spec = &mut svc["spec"];
        let kind = spec["type"].as_str().unwrap_or("ClusterIP").to_string();
        merge(
            spec,
            json!({"ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
                   "internalTrafficPolicy": "Cluster"}),
        );
        if spec["sessionAffinity"] == "ClientIP" {
            spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": 10800}});
        } else {
            spec["sessionAffinity"] = json!("None");
        }
        if kind != "ClusterIP" {
            spec["ports"][0]["nodePort"] = json!(port()?);
            if spec["externalTrafficPolicy"].is_null() {
                spec["externalTrafficPolicy"] = json!("Cluster");
            }
        }
        if kind == "LoadBalancer" {
            spec["healthCheckNodePort"] = json!(port()?);
            spec["allocateLoadBalancerNodePorts"] = json!(true);
        }
        if svc["status"]["loadBalancer"].is_null() {
            svc["status"] = json!({"loadBalancer": {}});
        }
        let ip = svc["spec"]["clusterIP"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        merge(&mut slice["metadata"], meta(uid(1)));
        let address = json!({"apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
            "metadata": {"name": ip, "uid": uid(2), "creationTimestamp": created,
                "labels": {"ipaddress.kubernetes.io/ip-family": "IPv4",
                           "ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io"}},
            "spec": {"parentRef": {"group": "", "resource": "services", "namespace": NS, "name": name}}});
        out.push((
            format!("/registry/services/specs/{NS}/{name}"),
            svc.to_string(),
        ));
        out.push((
            format!("/registry/endpointslices/{NS}/{name}-x"),
            slice.to_string(),
        ));
        out.push((format!("/registry/ipaddresses/{ip}"), address.to_string()));
    }
    // The NodePort allocator's bitmap, as it snapshots it (a big integer's
    // bytes, big-endian, bit k for port 30000 + k): without it the API
    // server's repair loop logs every port at its start and writes it.
    let taken = (next_port - 30000) as usize;
    let mut bitmap = vec![0xffu8; taken.div_ceil(8)];
    if let Some(first) = bitmap.first_mut().filter(|_| !taken.is_multiple_of(8)) {
        *first = (1u8 << (taken % 8)) - 1;
    }
    let ranges = json!({"apiVersion": "v1", "kind": "RangeAllocation",
        "metadata": {"creationTimestamp": created}, "range": "30000-59999",
        "data": base64::engine::general_purpose::STANDARD.encode(&bitmap)});
    out.push((
        "/registry/ranges/servicenodeports".into(),
        ranges.to_string(),
    ));
    Ok(out)
}

/// `extra`'s fields set in the object `into`.
fn merge(into: &mut Value, extra: Value) {
    if let (Some(o), Value::Object(e)) = (into.as_object_mut(), extra) {
        o.extend(e);
    }
}

/// Requests [`Lab::populate`] keeps in flight.
pub const IN_FLIGHT: usize = 32;

/// What the API server answered while [`Lab::populate`] wrote.
#[derive(Default)]
pub struct Populated {
    /// What was written: requests through the API (creates and status
    /// patches), objects through etcd (`Lab::populate_etcd`).
    pub ok: AtomicU64,
    /// 429s (the server's flow control), each retried after a second.
    pub throttled: AtomicU64,
    /// 5xx answers and timeouts, each retried (up to 5 times a request).
    pub failed: AtomicU64,
}

impl Populated {
    /// `req` until it succeeds, again after a 429 (as client-go does) or a
    /// server error (etcd slow under the load), counting each; a success
    /// counts `objects` (what the request wrote). A create retried after an
    /// error may find its object made: 409 is success then, with no answer.
    async fn retry<T, F: std::future::Future<Output = kube::Result<T>>>(
        &self,
        objects: u64,
        req: impl Fn() -> F,
    ) -> Result<Option<T>> {
        let mut errors = 0;
        loop {
            let e = match req().await {
                Ok(t) => {
                    self.ok.fetch_add(objects, Ordering::Relaxed);
                    return Ok(Some(t));
                }
                Err(e) => e,
            };
            let code = match &e {
                kube::Error::Api(s) => s.code,
                _ => 0,
            };
            if code == 409 && errors > 0 {
                self.ok.fetch_add(objects, Ordering::Relaxed);
                return Ok(None);
            }
            if code == 429 {
                self.throttled.fetch_add(1, Ordering::Relaxed);
            } else if code >= 500
                || matches!(e, kube::Error::HyperError(_) | kube::Error::Service(_))
            {
                self.failed.fetch_add(1, Ordering::Relaxed);
                errors += 1;
                if errors > 5 {
                    return Err(e.into());
                }
            } else {
                return Err(e.into());
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

pub struct Lab {
    pub cluster: Cluster,
    pub cp: ControlPlane,
    pub bins: K8sBinaries,
    pub client: kube::Client,
    pub rt: tokio::runtime::Runtime,
    pub ours_kubeconfig: PathBuf,
    pub upstream_kubeconfig: PathBuf,
}

impl Lab {
    /// `name` names the lab's namespaces; `upstream`: upstream kube-proxy
    /// must be found too.
    pub fn new(name: &str, upstream: bool) -> Result<Lab> {
        Lab::start(name, upstream, |_| {})
    }

    /// [`Lab::new`], with the control plane's options changed by `tune`.
    pub fn start(
        name: &str,
        upstream: bool,
        tune: impl FnOnce(&mut ControlPlaneOpts),
    ) -> Result<Lab> {
        Lab::start_nodes(name, upstream, 2, tune)
    }

    /// [`Lab::start`] with `nodes` node namespaces (each registered as a
    /// Node), for benches that give every proxy a node of its own.
    pub fn start_nodes(
        name: &str,
        upstream: bool,
        nodes: usize,
        tune: impl FnOnce(&mut ControlPlaneOpts),
    ) -> Result<Lab> {
        let bins = K8sBinaries::find().context("finding the Kubernetes binaries")?;
        if upstream && bins.kube_proxy.is_none() {
            bail!("upstream kube-proxy not found (UPSTREAM_KUBE_PROXY_BIN or ../shared/k8s)");
        }
        let cluster = Cluster::new(name, ClusterOpts::with_nodes(nodes))?;
        let host = cluster.add_host("cp", 5)?;
        let mut opts = ControlPlaneOpts::in_netns(name, &host.ns, host.ip);
        tune(&mut opts);
        let cp = ControlPlane::start(&bins, opts)?;
        for i in 1..=nodes {
            cp.apply(&node(&cluster, i))?;
        }
        let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
        for f in [
            "serviceaccount.yaml",
            "clusterrole.yaml",
            "clusterrolebinding.yaml",
        ] {
            cp.apply_file(&deploy.join(f))?;
        }
        cp.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"namespace": "kube-system", "name": "kube-proxy"}}))?;
        cp.apply(&json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "kubeadm:node-proxier"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node-proxier"},
            "subjects": [{"kind": "ServiceAccount", "namespace": "kube-system", "name": "kube-proxy"}]}))?;
        let ours_kubeconfig = cp.dir().join("ours.kubeconfig");
        let upstream_kubeconfig = cp.dir().join("upstream.kubeconfig");
        cp.service_account_kubeconfig("kube-system", "kube-proxy-rs", &ours_kubeconfig)?;
        cp.service_account_kubeconfig("kube-system", "kube-proxy", &upstream_kubeconfig)?;
        // The API server listens inside the control plane's namespace: this
        // (single) thread moves there, so the client's sockets and the
        // runtime (current-thread) live where the server is reachable.
        let f = std::fs::File::open(format!("/run/netns/{}", host.ns))?;
        crate::netns::enter(&f).with_context(|| format!("entering {}", host.ns))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let client = rt.block_on(async {
            let kc = kube::config::Kubeconfig::read_from(cp.admin_kubeconfig())?;
            let c = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
            anyhow::Ok(kube::Client::try_from(c)?)
        })?;
        rt.block_on(Api::<Namespace>::all(client.clone()).create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}}))?,
        ))?;
        Ok(Lab {
            cluster,
            cp,
            bins,
            client,
            rt,
            ours_kubeconfig,
            upstream_kubeconfig,
        })
    }

    pub fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), NS)
    }

    pub fn slices(&self) -> Api<EndpointSlice> {
        Api::namespaced(self.client.clone(), NS)
    }

    /// Creates Services and slices, [`IN_FLIGHT`] requests at a time and no
    /// rate limit of the client's own; what the API server answered.
    pub fn populate(&self, n: u32) -> Result<Populated> {
        let tally = Populated::default();
        self.populate_within(n, Duration::MAX, &tally)?;
        Ok(tally)
    }

    /// [`Lab::populate`] into `tally`, giving up after `limit`, and saying
    /// every minute how far it got: kube-apiserver 1.36 counts every
    /// ClusterIP it holds after each allocation (its allocator's metrics),
    /// so each create costs more than the one before.
    pub fn populate_within(&self, n: u32, limit: Duration, tally: &Populated) -> Result<()> {
        let syn = crate::cluster(n, ENDPOINTS);
        let (svcs, slices) = (self.services(), self.slices());
        let t0 = Instant::now();
        let progress = async {
            loop {
                tokio::time::sleep(Duration::from_secs(60)).await;
                let ok = tally.ok.load(Ordering::Relaxed);
                eprintln!("  {ok} requests after {:.0} s", t0.elapsed().as_secs_f64());
            }
        };
        let work = async {
            futures::stream::iter(syn.services.into_iter().map(|s| {
                let svcs = svcs.clone();
                async move {
                    let (s, lb) = api_service(s);
                    let name = s["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    let s: Service = serde_json::from_value(s)?;
                    let post = PostParams::default();
                    tally.retry(1, || svcs.create(&post, &s)).await?;
                    if let Some(lb) = lb {
                        let (patch, pp) =
                            (Patch::Merge(json!({"status": lb})), PatchParams::default());
                        tally
                            .retry(1, || svcs.patch_status(&name, &pp, &patch))
                            .await?;
                    }
                    anyhow::Ok(())
                }
            }))
            .buffer_unordered(IN_FLIGHT)
            .try_collect::<Vec<()>>()
            .await?;
            futures::stream::iter(syn.slices.into_iter().map(|s| {
                let slices = slices.clone();
                async move {
                    let (s, post): (EndpointSlice, _) =
                        (serde_json::from_value(s)?, PostParams::default());
                    tally.retry(1, || slices.create(&post, &s)).await?;
                    anyhow::Ok(())
                }
            }))
            .buffer_unordered(IN_FLIGHT)
            .try_collect::<Vec<()>>()
            .await
        };
        self.rt.block_on(async {
            tokio::select! {
                r = tokio::time::timeout(limit, work) => match r {
                    Ok(r) => r.map(drop),
                    Err(_) => Err(anyhow::anyhow!(
                        "populating stopped after {:.0} s: {} requests done",
                        t0.elapsed().as_secs_f64(),
                        tally.ok.load(Ordering::Relaxed)
                    )),
                },
                () = progress => Ok(()),
            }
        })
    }

    /// Writes kp-bench's cluster of `n` Services straight into the lab's
    /// etcd ([`etcd_objects`]), [`ETCD_TXN_OPS`] objects a transaction, with
    /// the API server stopped, starts it again and waits until it lists them
    /// all: what the proxy reads then comes through kube-apiserver as from
    /// objects created through it. For sizes the API's create path cannot
    /// reach in useful time (see [`Lab::populate_within`]). Stopped, because
    /// a running API server's ClusterIP repair loop sees a Service and its
    /// IPAddress arrive apart, takes the address for leaked or missing, and
    /// deletes and writes addresses for a minute afterwards (seen at 20k).
    pub fn populate_etcd(&mut self, n: u32, tally: &Populated) -> Result<()> {
        self.cp.stop_apiserver();
        let objects = etcd_objects(n, Timestamp::now())?;
        let url = self.cp.etcd_url().parse().context("etcd's URL")?;
        // The client spawns its connection task: built inside the runtime.
        let etcd = self
            .rt
            .block_on(async { kube::Client::try_from(kube::Config::new(url)) })?;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let txns: Vec<(u64, Vec<u8>)> = objects
            .chunks(ETCD_TXN_OPS)
            .map(|chunk| {
                let puts: Vec<Value> = chunk
                    .iter()
                    .map(|(k, v)| json!({"requestPut": {"key": b64(k), "value": b64(v)}}))
                    .collect();
                serde_json::to_vec(&json!({ "success": puts })).map(|b| (chunk.len() as u64, b))
            })
            .collect::<Result<_, _>>()?;
        self.rt.block_on(async {
            futures::stream::iter(txns.into_iter().map(|(puts, body)| {
                let etcd = etcd.clone();
                async move {
                    let bytes = body.len();
                    let answer = tally
                        .retry(puts, || {
                            let (etcd, body) = (etcd.clone(), body.clone());
                            async move {
                                let req = http::Request::post("/v3/kv/txn")
                                    .header("content-type", "application/json")
                                    .body(body)
                                    .map_err(kube::Error::HttpError)?;
                                etcd.request_text(req).await
                            }
                        })
                        .await
                        .context("writing to etcd")?
                        .unwrap_or_default();
                    if !answer.contains("\"succeeded\":true") {
                        bail!("etcd refused a transaction ({bytes} bytes): {answer}");
                    }
                    anyhow::Ok(())
                }
            }))
            .buffer_unordered(4)
            .try_collect::<Vec<()>>()
            .await
        })?;
        self.cp
            .start_apiserver()
            .context("starting the API server on the written etcd")?;
        // Ready is not yet every object in its watch cache: list until both
        // kinds are all there, each decoded.
        let t0 = Instant::now();
        loop {
            let (svcs, slices) = self.rt.block_on(async {
                let lp = kube::api::ListParams::default();
                anyhow::Ok((
                    self.services().list(&lp).await?.items.len(),
                    self.slices().list(&lp).await?.items.len(),
                ))
            })?;
            if svcs == n as usize && slices == n as usize {
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(600) {
                bail!("after writing {n} Services into etcd the API server lists {svcs} Services and {slices} slices");
            }
            std::thread::sleep(Duration::from_secs(2));
        }
    }

    /// Replaces the last endpoint of Service `i` (generation `g`) through the
    /// API; the new address.
    pub async fn patch_endpoints(&self, i: u32, g: u32) -> Result<String> {
        let s = crate::slice(i, ENDPOINTS, g, i % 10 == 3);
        self.slices()
            .patch(
                &format!("svc-{i}-x"),
                &PatchParams::default(),
                &Patch::Merge(json!({"endpoints": s["endpoints"]})),
            )
            .await?;
        Ok(crate::moved_address(&s))
    }

    /// [`Lab::patch_endpoints`], waited for.
    pub fn change(&self, i: u32, g: u32) -> Result<String> {
        self.rt.block_on(self.patch_endpoints(i, g))
    }

    /// Creates a Service, then its EndpointSlice (both in [`NS`]).
    pub fn create_service(&self, service: Value, slice: Value) -> Result<()> {
        self.rt.block_on(async {
            self.services()
                .create(&PostParams::default(), &serde_json::from_value(service)?)
                .await?;
            self.slices()
                .create(&PostParams::default(), &serde_json::from_value(slice)?)
                .await?;
            anyhow::Ok(())
        })
    }

    /// Starts a proxy in node `node`'s namespace with [`proxy_args`]:
    /// upstream kube-proxy, or `ours`; its log is `LABEL.log` in the control
    /// plane's directory.
    pub fn spawn_proxy(
        &self,
        node: usize,
        mode: &str,
        upstream: bool,
        ours: &Path,
        label: &str,
    ) -> Result<Proxy<'_>> {
        let cmd = ProxyCommand {
            mode,
            upstream,
            ours,
            extra: &[],
            env: &[],
        };
        self.spawn_proxy_with(node, &cmd, label)
    }

    /// [`Lab::spawn_proxy`] with flags after [`proxy_args`] and variables
    /// set in the proxy's environment (`ip netns exec` runs `env`, which
    /// execs the proxy in place: the guard's pid is still the proxy's).
    pub fn spawn_proxy_with(
        &self,
        node: usize,
        cmd: &ProxyCommand<'_>,
        label: &str,
    ) -> Result<Proxy<'_>> {
        let ProxyCommand {
            mode,
            upstream,
            ours,
            extra,
            env,
        } = *cmd;
        let (bin, kc) = if upstream {
            (
                self.bins
                    .kube_proxy
                    .clone()
                    .context("upstream kube-proxy")?,
                &self.upstream_kubeconfig,
            )
        } else {
            (ours.to_path_buf(), &self.ours_kubeconfig)
        };
        let log = self.cp.dir().join(format!("{label}.log"));
        let mut args = proxy_args(mode, kc, node);
        args.extend(extra.iter().cloned());
        let (program, args) = if env.is_empty() {
            (bin, args)
        } else {
            let mut wrapped = env.to_vec();
            wrapped.push(bin.display().to_string());
            wrapped.extend(args);
            (PathBuf::from("/usr/bin/env"), wrapped)
        };
        let guard = self
            .cluster
            .spawn(self.cluster.node_ns(node), &program, &args, &log)?;
        Ok(Proxy {
            cluster: &self.cluster,
            node,
            guard,
            mode: mode.to_string(),
        })
    }
}

/// What [`Lab::spawn_proxy_with`] runs: upstream's binary or `ours`, in
/// `mode`, with `extra` flags and `env` (`VAR=VALUE`) settings.
#[derive(Clone, Copy)]
pub struct ProxyCommand<'a> {
    pub mode: &'a str,
    pub upstream: bool,
    pub ours: &'a Path,
    pub extra: &'a [String],
    pub env: &'a [String],
}

/// A running proxy in a node namespace.
pub struct Proxy<'a> {
    pub cluster: &'a Cluster,
    pub node: usize,
    pub guard: ProcGuard,
    pub mode: String,
}

impl Proxy<'_> {
    pub fn metrics(&self) -> String {
        scrape(self.cluster.node_ns(self.node), "/metrics").unwrap_or_default()
    }

    /// Samples of `name` over all label sets.
    pub fn samples(&self, name: &str) -> Vec<f64> {
        samples(&self.metrics(), name)
    }

    pub fn ruleset(&self) -> String {
        let ns = self.cluster.node_ns(self.node);
        let argv: &[&str] = if self.mode == "nftables" {
            &["nft", "list", "ruleset"]
        } else {
            &["iptables-save", "-t", "nat"]
        };
        self.cluster
            .exec(ns, argv)
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// Waits for a sync that finished after `t0` (unix seconds) and after
    /// which `holds(ruleset)`; the time from `t0` to that sync's end.
    pub fn programmed(&self, t0: f64, holds: impl Fn(&str) -> bool) -> Result<Duration> {
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut checked = t0;
        let last_sync = || {
            self.samples("kubeproxy_sync_proxy_rules_last_timestamp_seconds")
                .into_iter()
                .fold(0.0, f64::max)
        };
        while Instant::now() < deadline {
            let last = last_sync();
            if last > checked {
                let holds = holds(&self.ruleset());
                // Reading the ruleset back takes seconds at 10k: a sync that
                // ended meanwhile may be the one it shows (a Service added is
                // two syncs, the Service's and its slice's). Only a read with
                // no sync ended during it names its sync.
                if last_sync() != last {
                    // Said, so that a slow change can be told from a
                    // read that a later sync overtook.
                    eprintln!(
                        "    a sync ended during the ruleset read ({:.2} s after the change): reading again",
                        last_sync() - t0
                    );
                    continue;
                }
                if holds {
                    return Ok(Duration::from_secs_f64((last - t0).max(0.0)));
                }
                checked = last;
            }
            // Every poll costs the proxy a /metrics render: 10 ms keeps that
            // under 1% of a core while resolving 8 ms changes.
            std::thread::sleep(Duration::from_millis(10));
        }
        bail!("not programmed within 600 s")
    }

    pub fn cpu_secs(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.guard.pid())).unwrap_or_default();
        // Fields after the parenthesised name: utime, stime, cutime, cstime
        // are the 14th to 17th. Children count: upstream runs `nft` (and
        // both proxies `iptables-restore`) as programs it waits for.
        let rest = stat.rsplit(')').next().unwrap_or("");
        let f: Vec<&str> = rest.split_whitespace().collect();
        let tick = 100.0; // USER_HZ on Linux
        let get = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (get(11) + get(12) + get(13) + get(14)) / tick
    }

    /// Waits until the proxy has synced once and the last of `n` Services'
    /// ClusterIP is in the kernel (at most `limit`); the time since `since`
    /// to the poll that saw the sync (reading the ruleset back takes seconds
    /// at 100k Services: not counted). Polls every 20 ms, then every
    /// thousandth of the time waited (at most 1 s), so the answer stays
    /// within 0.1%: each poll is a /metrics scrape the proxy pays for, and
    /// a first sync can take 95 minutes (upstream, iptables mode, 10k).
    pub fn wait_first_sync(&self, n: u32, since: Instant, limit: Duration) -> Result<Duration> {
        let last_ip = crate::cluster_ip(n - 1);
        loop {
            if !self.guard.is_running() {
                // The log's directory goes with the lab: quote its end here.
                let path = self.guard.log_path();
                let log = std::fs::read_to_string(path).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                let tail = lines[lines.len().saturating_sub(15)..].join("\n");
                bail!("the proxy exited; the end of {}:\n{tail}", path.display());
            }
            let synced = self
                .samples("kubeproxy_sync_proxy_rules_duration_seconds_count")
                .iter()
                .sum::<f64>()
                >= 1.0;
            let seen = since.elapsed();
            if synced && has_ip(&self.ruleset(), &last_ip) {
                return Ok(seen);
            }
            if since.elapsed() > limit {
                bail!("no first sync within {limit:?}");
            }
            let poll =
                (since.elapsed() / 1000).clamp(Duration::from_millis(20), Duration::from_secs(1));
            std::thread::sleep(poll);
        }
    }

    /// Open file descriptors of the process.
    pub fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.guard.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    pub fn status_mib(&self, field: &str) -> f64 {
        status_mib(&self.guard.pid().to_string(), field)
    }
}

/// Where the proxies the benches start serve /metrics, inside their own
/// network namespace ([`proxy_args`], and `kp-bench idle`'s).
pub const METRICS_ADDR: &str = "127.0.0.1:10249";

/// GET `path` (e.g. `/metrics`) from [`METRICS_ADDR`] inside network
/// namespace `ns`: the whole response, headers included.
pub fn scrape(ns: &str, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let addr: std::net::SocketAddr = METRICS_ADDR.parse()?;
    let mut s = kp_netlab::in_netns(ns, || {
        std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))
    })?
    .with_context(|| format!("connecting to {METRICS_ADDR} in {ns}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)
        .with_context(|| format!("reading {path} from {METRICS_ADDR} in {ns}"))?;
    Ok(out)
}

/// The samples of metric `name` in a Prometheus text, over all its label
/// sets.
pub fn samples(text: &str, name: &str) -> Vec<f64> {
    kp_testkit::prom::samples(text, name)
        .map(|(_, v)| v)
        .collect()
}

/// A kB field of /proc/`pid`/status (`pid` may be "self") in MiB; 0 when
/// unreadable.
pub fn status_mib(pid: &str, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

/// The kube-proxy-rs beside the running kp-bench (where `cargo build
/// --release -p kube-proxy-rs -p kp-bench` puts both): the `--ours` default.
pub fn beside_bench() -> PathBuf {
    std::env::current_exe()
        .map(|e| e.with_file_name("kube-proxy-rs"))
        .unwrap_or_else(|_| PathBuf::from("kube-proxy-rs"))
}

/// The proxy binary a benchmark runs, checked before a lab is built.
pub fn check_binary(path: &Path) -> Result<()> {
    if !path.is_file() {
        bail!(
            "{} not found: build it (cargo build --release -p kube-proxy-rs) or pass --ours",
            path.display()
        );
    }
    Ok(())
}

/// The flags both proxies run with in the lab (defaults otherwise, as
/// operators run them); conntrack sysctls off, the namespaces share them.
pub fn proxy_args(mode: &str, kubeconfig: &Path, node: usize) -> Vec<String> {
    vec![
        format!("--proxy-mode={mode}"),
        format!("--kubeconfig={}", kubeconfig.display()),
        format!("--hostname-override=node{node}"),
        "--cluster-cidr=10.244.0.0/16".into(),
        format!("--metrics-bind-address={METRICS_ADDR}"),
        "--conntrack-max-per-core=0".into(),
        "--conntrack-tcp-timeout-established=0".into(),
        "--conntrack-tcp-timeout-close-wait=0".into(),
    ]
}

/// Replaces the text between `<!-- MARKER begin -->` and `<!-- MARKER end -->`
/// in `path` (appending the section when it is missing).
pub fn write_into(path: &Path, marker: &str, text: &str) -> Result<()> {
    let begin = format!("<!-- {marker} begin -->");
    let end = format!("<!-- {marker} end -->");
    let doc =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let block = format!("{begin}\n{text}{end}");
    let new = match (doc.find(&begin), doc.find(&end)) {
        (Some(a), Some(b)) if b > a => format!("{}{block}{}", &doc[..a], &doc[b + end.len()..]),
        _ => format!("{doc}\n{block}\n"),
    };
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

/// `date -u`, as the tables print it.
pub fn date_utc() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The 1, 5 and 15 minute load averages.
pub fn load_average() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    load.split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn etcd_objects_hold_what_the_api_server_would_have_written() {
        let n = 400;
        let objects = etcd_objects(n, Timestamp::now()).expect("objects");
        assert_eq!(objects.len(), 3 * n as usize + 1);
        let keys: HashSet<&str> = objects.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys.len(), objects.len(), "a key written twice");
        let (mut ports, mut uids) = (HashSet::new(), HashSet::new());
        let mut kinds = HashSet::new();
        for (key, value) in &objects {
            let v: Value = serde_json::from_str(value).expect("JSON");
            assert!(
                v["metadata"]["resourceVersion"].is_null(),
                "{key}: etcd's revision is the version"
            );
            assert!(
                uids.insert(v["metadata"]["uid"].to_string()),
                "{key}: uid reused"
            );
            assert!(v["metadata"]["creationTimestamp"]
                .as_str()
                .is_some_and(|t| t.ends_with('Z')));
            if !key.starts_with("/registry/services/specs/bench/") {
                continue;
            }
            let spec = &v["spec"];
            let kind = spec["type"].as_str().expect("type");
            kinds.insert(kind.to_string());
            for f in ["ipFamilyPolicy", "internalTrafficPolicy", "sessionAffinity"] {
                assert!(spec[f].is_string(), "{key}: {f} not defaulted");
            }
            let mut taken = vec![&spec["ports"][0]["nodePort"]];
            match kind {
                "ClusterIP" => assert!(taken[0].is_null(), "{key}: a ClusterIP with a NodePort"),
                "LoadBalancer" => taken.push(&spec["healthCheckNodePort"]),
                _ => {}
            }
            for p in taken.into_iter().filter(|_| kind != "ClusterIP") {
                let p = p.as_u64().expect("a NodePort");
                assert!((30000..60000).contains(&p), "{key}: NodePort {p}");
                assert!(ports.insert(p), "{key}: NodePort {p} given twice");
            }
            if spec["sessionAffinity"] == "ClientIP" {
                assert_eq!(
                    spec["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"],
                    10800
                );
            }
            let ip = spec["clusterIP"].as_str().expect("clusterIP");
            let name = v["metadata"]["name"].as_str().expect("name");
            let (_, addr) = objects
                .iter()
                .find(|(k, _)| *k == format!("/registry/ipaddresses/{ip}"))
                .expect("an IPAddress for each ClusterIP");
            let addr: Value = serde_json::from_str(addr).expect("JSON");
            assert_eq!(addr["spec"]["parentRef"]["name"], name);
            assert_eq!(addr["spec"]["parentRef"]["resource"], "services");
            assert!(keys.contains(format!("/registry/endpointslices/bench/{name}-x").as_str()));
        }
        assert_eq!(kinds.len(), 3, "the mix's three types: {kinds:?}");
        let (_, ranges) = objects
            .iter()
            .find(|(k, _)| k == "/registry/ranges/servicenodeports")
            .expect("the NodePort bitmap");
        let ranges: Value = serde_json::from_str(ranges).expect("JSON");
        let bitmap = base64::engine::general_purpose::STANDARD
            .decode(ranges["data"].as_str().expect("data"))
            .expect("base64");
        let ones: u32 = bitmap.iter().map(|b| b.count_ones()).sum();
        assert_eq!(ones as usize, ports.len(), "a bit per NodePort given");
        let highest = ports.iter().max().expect("ports") - 30000;
        assert_eq!(
            bitmap.len() as u64,
            highest / 8 + 1,
            "big-endian, no leading zero byte"
        );
    }
}
