//! `kube-proxy-rs explain` and `kube-proxy-rs status`: operator tools in the
//! same binary. Upstream kube-proxy has no subcommands, so main.rs
//! dispatches here only when the first argument is one of these words, and
//! every upstream flag keeps working unchanged.
//!
//! Both ask a running proxy's metrics server (`/debug/explain`,
//! `/debug/services`); `explain --manifests DIR` instead reads the manifests
//! and explains offline, with the same flags the proxy would be started
//! with, and no kernel.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, ValueEnum};
use kp_model::explain::{explain, Explanation, Packet};
use kp_model::{ProxierConfig, ProxyState};

use crate::config;
use crate::modes::{self, FAMILIES};
use crate::render::explain_text;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

/// The decision path of one packet on a node: which Service port matched,
/// every endpoint and why it is used or not, masquerading, the verdict, and
/// (from a running proxy in nftables/iptables mode) the chains of the
/// installed ruleset it traverses.
#[derive(Debug, Parser)]
#[command(
    name = "kube-proxy-rs explain",
    after_help = "Examples:\n  kube-proxy-rs explain 10.244.1.5 10.96.0.10:80\n  kube-proxy-rs explain 203.0.113.9 192.168.1.10:30080 tcp -o json\n  kube-proxy-rs explain --manifests examples/ --hostname-override node1 --cluster-cidr 10.244.0.0/16 10.244.1.5 10.96.0.10:80"
)]
pub struct ExplainArgs {
    /// Source address of the packet.
    pub src: IpAddr,
    /// Destination address and port: `10.96.0.10:80`, `[fd00::10]:80`.
    pub dst: SocketAddr,
    /// tcp, udp or sctp.
    #[arg(default_value = "tcp")]
    pub protocol: String,
    /// The node the packet enters (a running proxy answers for its own node
    /// only; offline, the node whose view is explained).
    #[arg(long)]
    pub node: Option<String>,
    #[arg(short = 'o', long, value_enum, default_value = "text")]
    pub output: Output,
    /// The running proxy's --metrics-bind-address.
    #[arg(long, default_value = "127.0.0.1:10249")]
    pub metrics_address: String,
    /// Offline: explain from this manifest directory instead of a running
    /// proxy (the flags below as the proxy would get them).
    #[arg(long)]
    pub manifests: Option<PathBuf>,
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long)]
    pub hostname_override: Option<String>,
    #[arg(long)]
    pub proxy_mode: Option<String>,
    #[arg(long)]
    pub cluster_cidr: Option<String>,
    #[arg(long)]
    pub detect_local_mode: Option<String>,
    #[arg(long)]
    pub pod_bridge_interface: Option<String>,
    #[arg(long)]
    pub pod_interface_name_prefix: Option<String>,
    #[arg(long)]
    pub nodeport_addresses: Option<String>,
    #[arg(long)]
    pub masquerade_all: bool,
    /// Offline: this node's addresses (comma-separated), for NodePorts and
    /// "from this node"; default: its Node manifest's addresses, else none
    /// known (any address counts as a NodePort address).
    #[arg(long, value_delimiter = ',')]
    pub node_ip: Vec<IpAddr>,
}

/// The programmed state per Service port and family, endpoints with their
/// conditions, last sync time and kind, from a running proxy.
#[derive(Debug, Parser)]
#[command(name = "kube-proxy-rs status")]
pub struct StatusArgs {
    /// Only Service ports whose `namespace/name:port` starts with this.
    pub service: Option<String>,
    #[arg(short = 'o', long, value_enum, default_value = "text")]
    pub output: Output,
    /// The running proxy's --metrics-bind-address.
    #[arg(long, default_value = "127.0.0.1:10249")]
    pub metrics_address: String,
}

/// Runs a subcommand when `args[1]` names one; None otherwise (the normal
/// proxy start). The exit code comes back.
pub fn dispatch(args: &[OsString]) -> Option<i32> {
    let sub = args.get(1)?.to_str()?;
    let rest = || {
        std::iter::once(OsString::from(format!("kube-proxy-rs {sub}")))
            .chain(args.iter().skip(2).cloned())
    };
    let res = match sub {
        "explain" => match ExplainArgs::try_parse_from(rest()) {
            Ok(a) => run_explain(&a),
            Err(e) => e.exit(),
        },
        "status" => match StatusArgs::try_parse_from(rest()) {
            Ok(a) => run_status(&a),
            Err(e) => e.exit(),
        },
        _ => return None,
    };
    Some(match res {
        Ok(out) => {
            print!("{out}");
            0
        }
        Err(e) => {
            eprintln!("kube-proxy-rs {sub}: {e:#}");
            1
        }
    })
}

/// The subcommand's output, explain.
pub fn run_explain(a: &ExplainArgs) -> Result<String> {
    let protocol = crate::http::debug::parse_protocol(Some(&a.protocol))
        .ok_or_else(|| anyhow!("protocol {:?}: expected tcp, udp or sctp", a.protocol))?;
    let pkt = Packet {
        src: a.src,
        dst: a.dst.ip(),
        port: a.dst.port(),
        protocol,
    };
    if let Some(dir) = &a.manifests {
        let ex = explain_offline(a, dir, &pkt)?;
        return Ok(match a.output {
            Output::Text => explain_text(&ex),
            Output::Json => serde_json::to_string_pretty(&ex)? + "\n",
        });
    }
    let mut path = format!(
        "/debug/explain?src={}&dst={}&port={}&protocol={}",
        pkt.src, pkt.dst, pkt.port, pkt.protocol
    );
    if let Some(n) = &a.node {
        path.push_str(&format!("&node={n}"));
    }
    if a.output == Output::Text {
        path.push_str("&format=text");
    }
    http_get(&a.metrics_address, &path)
}

/// The subcommand's output, status.
pub fn run_status(a: &StatusArgs) -> Result<String> {
    let mut path = String::from("/debug/services?");
    if let Some(s) = &a.service {
        path.push_str(&format!("service={s}&"));
    }
    if a.output == Output::Text {
        path.push_str("format=text");
    }
    http_get(&a.metrics_address, &path)
}

/// Reads the manifests once into per-family states, as a first sync would
/// program them, and explains.
fn explain_offline(a: &ExplainArgs, dir: &std::path::Path, pkt: &Packet) -> Result<Explanation> {
    let mut argv: Vec<OsString> = vec!["kube-proxy-rs".into(), "--manifests".into(), dir.into()];
    let mut flag = |name: &str, v: &Option<String>| {
        if let Some(v) = v {
            argv.push(format!("--{name}={v}").into());
        }
    };
    flag(
        "hostname-override",
        &a.node.clone().or(a.hostname_override.clone()),
    );
    flag("proxy-mode", &a.proxy_mode);
    flag("cluster-cidr", &a.cluster_cidr);
    flag("detect-local-mode", &a.detect_local_mode);
    flag("pod-bridge-interface", &a.pod_bridge_interface);
    flag("pod-interface-name-prefix", &a.pod_interface_name_prefix);
    flag("nodeport-addresses", &a.nodeport_addresses);
    if a.masquerade_all {
        argv.push("--masquerade-all".into());
    }
    if let Some(c) = &a.config {
        argv.push("--config".into());
        argv.push(c.into());
    }
    let cfg = config::load(argv).map_err(|e| anyhow!("{e}"))?;
    let loaded =
        kp_source::manifest::load_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    for m in &loaded.invalid {
        eprintln!("warning: skipping {m}");
    }
    let now = SystemTime::now();
    let mut trackers = modes::trackers(&cfg);
    for t in &mut trackers {
        for n in loaded.nodes.values() {
            t.update_node(n);
        }
        for s in loaded.services.values() {
            if let Err(e) = t.update_service(s, now) {
                eprintln!("warning: skipping invalid Service: {}", e.0);
            }
        }
        for s in loaded.slices.values() {
            if let Err(e) = t.update_endpoint_slice(s, now) {
                eprintln!("warning: skipping invalid EndpointSlice: {}", e.0);
            }
        }
        t.take_changes();
    }
    // This node's Node manifest, if any: its podCIDRs (NodeCIDR mode) and
    // its addresses (NodePorts, "from this node") unless --node-ip names them.
    let node = loaded.nodes.get(&cfg.hostname).map(kp_model::convert_node);
    let pod_cidrs: Vec<ipnet::IpNet> = node
        .as_ref()
        .map(|n| n.pod_cidrs.cidrs.clone())
        .unwrap_or_default();
    let node_ips: Vec<IpAddr> = match (&node, a.node_ip.is_empty()) {
        (Some(n), true) => n
            .internal_ips
            .iter()
            .chain(&n.external_ips)
            .copied()
            .collect(),
        _ => a.node_ip.clone(),
    };
    let pcs: Vec<ProxierConfig> = FAMILIES
        .iter()
        .map(|f| cfg.proxier_config(*f, &node_ips, &pod_cidrs))
        .collect();
    let states: Vec<&ProxyState> = trackers.iter().map(|t| t.state()).collect();
    let cfgs: Vec<&ProxierConfig> = pcs.iter().collect();
    Ok(explain(&states, &cfgs, pkt))
}

/// A plain HTTP/1.1 GET to the metrics server (no TLS, loopback by
/// default); the body when the answer is 200, else an error with it.
pub fn http_get(addr: &str, path: &str) -> Result<String> {
    let sock = addr
        .to_socket_addrs()
        .with_context(|| format!("metrics address {addr:?}"))?
        .next()
        .ok_or_else(|| anyhow!("metrics address {addr:?} resolves to nothing"))?;
    let mut s = TcpStream::connect_timeout(&sock, Duration::from_secs(5)).with_context(|| {
        format!("connecting to kube-proxy-rs at {sock} (is it running? --metrics-address)")
    })?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {sock}\r\nConnection: close\r\nUser-Agent: kube-proxy-rs\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .with_context(|| format!("reading the answer from {sock}"))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow!("malformed HTTP answer from {sock}"))?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("malformed HTTP status line from {sock}"))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_string()
    };
    match status {
        200 => Ok(body),
        404 => bail!("{sock}{path}: not found (a kube-proxy-rs without /debug endpoints?)"),
        _ => bail!("{sock} answered {status}: {}", body.trim()),
    }
}

fn dechunk(mut s: &str) -> Result<String> {
    let mut out = String::new();
    loop {
        let (len, rest) = s
            .split_once("\r\n")
            .ok_or_else(|| anyhow!("bad chunked body"))?;
        let n = usize::from_str_radix(len.trim(), 16).context("bad chunk size")?;
        if n == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..n).ok_or_else(|| anyhow!("short chunk"))?);
        s = rest.get(n + 2..).unwrap_or("");
    }
}
