//! `kp-bench connect`: data-plane connect latency with N Services programmed.
//!
//! For each configuration a throwaway kp-netlab cluster (one node, a server
//! pod and a client pod on it) is built and, in the node's namespace, the real
//! proxier programs `N` synthetic Services ([`crate::cluster`]) plus one
//! Service whose endpoint is the server pod. A "floor" configuration has no
//! rules at all and connects straight to the pod IP. Every configuration is
//! set up first, then connects are measured in interleaved rounds (each round
//! runs `connects / rounds` connects against every configuration in turn), so
//! that background load on the machine hits all rows alike.
//!
//! One sample = the time `connect()` takes from the client pod: SYN out,
//! through the node's netfilter hooks (DNAT on a fresh conntrack entry: the
//! source port is new each time), to the pod and back. Needs root.
//! With `--socket-lb` the same nftables rules are installed and the socket
//! load balancer's programs are attached to a cgroup the client pod's
//! connecting thread is in: connect() goes straight to the pod, no DNAT.
//! Every configuration with rules also connects to the pod IP in its own
//! lab, and after the connect rounds each one moves `--bulk-mib` MiB over
//! one connection per round (through the Service and to the pod IP) for a
//! throughput table.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use crate::lab::quantile;
use anyhow::{anyhow, Context, Result};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_iptables::{IptablesCli, IptablesProxier, Variant};
use kp_model::{ChangeTracker, Dataplane, IpFamily, LocalDetector, ProxierConfig, TrackerConfig};
use kp_netlab::{in_netns, Cluster, ClusterOpts, Pod};
use kp_nftables::{NftNetlink, NftablesProxier};
use probe::{bulk, connect_batch, connects, mean, us, Server};
use serde_json::json;

pub mod probe;

/// ClusterIP of the Service that points at the real pod: outside the range
/// the generator uses for up to 60k Services (10.96.0.10 + i).
const REAL_CLUSTER_IP: &str = "10.96.250.1";
/// Sorts after the generator's "bench" namespace: in iptables mode the
/// Service's rule is then the last of KUBE-SERVICES (the worst case; upstream's
/// order is map iteration order, so N/2 on average).
const REAL_NAMESPACE: &str = "zz-real";
const POD_PORT: u16 = 8080;
const SERVICE_PORT: u16 = 80;
/// The bulk-transfer server, and the Service port in front of it.
const BULK_POD_PORT: u16 = 8081;
const BULK_SERVICE_PORT: u16 = 81;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Floor,
    Nftables,
    SocketLb,
    Iptables,
}

impl Mode {
    /// The row's name in both tables.
    fn label(self, variant: Variant) -> &'static str {
        match self {
            Mode::Floor => "none (pod IP)",
            Mode::Nftables => "nftables (netlink)",
            Mode::SocketLb => "nftables + socket-lb",
            Mode::Iptables if variant == Variant::Legacy => "iptables (legacy)",
            Mode::Iptables => "iptables (nft backend)",
        }
    }
}

/// The socket balancer's cgroup and bpffs for one configuration.
struct Lb {
    cgroup: kp_netlab::TestCgroup,
    fs: kp_netlab::TestBpffs,
}

/// One configuration: its lab, its server and the samples taken so far.
struct Setup {
    // Declared first so they drop (and join their threads) before the lab goes.
    _server: Server,
    _sink: Server,
    bulk_target: SocketAddr,
    bulk_pod: SocketAddr,
    /// Bulk transfers through the Service, and to the pod IP in the same lab.
    bulk: Vec<Duration>,
    bulk_direct: Vec<Duration>,
    mode: Mode,
    services: u32,
    sync: Duration,
    lab: Cluster,
    client: Pod,
    target: SocketAddr,
    /// The server pod's address (the floor's target).
    lab_pod: SocketAddr,
    samples: Vec<Duration>,
    failures: usize,
    /// Wall time of the timed batches (connect + RST close, one client).
    wall: Duration,
    /// The server pod's own address, connected to from the same client in
    /// the same lab (its rules loaded, conntrack on): what the Service
    /// costs on top, with everything else equal.
    direct: Vec<Duration>,
    /// Dropped after the lab: the pins go with the bpffs.
    _lb: Option<Lb>,
}

/// Microseconds with one decimal (means and medians sit 1-2 µs apart).
fn us1(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

fn real_service(pod: &Pod) -> Result<(Service, EndpointSlice)> {
    let svc = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": REAL_NAMESPACE, "name": "real"},
        "spec": {"clusterIP": REAL_CLUSTER_IP, "clusterIPs": [REAL_CLUSTER_IP], "type": "ClusterIP",
                 "ports": [{"name": "http", "port": SERVICE_PORT, "protocol": "TCP", "targetPort": POD_PORT},
                           {"name": "bulk", "port": BULK_SERVICE_PORT, "protocol": "TCP", "targetPort": BULK_POD_PORT}]}});
    let slice = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"namespace": REAL_NAMESPACE, "name": "real-x",
                     "labels": {"kubernetes.io/service-name": "real"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": POD_PORT, "protocol": "TCP"},
                  {"name": "bulk", "port": BULK_POD_PORT, "protocol": "TCP"}],
        "endpoints": [{"addresses": [pod.ip().to_string()], "nodeName": "node1",
                       "conditions": {"ready": true}}]});
    Ok((serde_json::from_value(svc)?, serde_json::from_value(slice)?))
}

/// Programs `n` synthetic Services plus the real one in node 1's namespace;
/// returns the time of the full sync (render + apply).
fn program(
    lab: &Cluster,
    server: &Pod,
    mode: Mode,
    n: u32,
    m: u32,
    variant: Variant,
    lb: Option<&Lb>,
) -> Result<Duration> {
    let mut tr = ChangeTracker::new(TrackerConfig {
        family: IpFamily::V4,
        node_name: "node1".into(),
        service_proxy_name: None,
    });
    let now = SystemTime::now();
    let syn = crate::cluster(n, m);
    for v in syn.services {
        let s: Service = serde_json::from_value(v)?;
        let _ = tr.update_service(&s, now);
    }
    for v in syn.slices {
        let s: EndpointSlice = serde_json::from_value(v)?;
        let _ = tr.update_endpoint_slice(&s, now);
    }
    let (svc, slice) = real_service(server)?;
    let _ = tr.update_service(&svc, now);
    let _ = tr.update_endpoint_slice(&slice, now);
    tr.take_changes();

    let mut pc = ProxierConfig::new(IpFamily::V4);
    pc.local_detector = LocalDetector::Cidrs(vec![lab.cluster_cidr()]);
    pc.node_ips = vec![lab.node_ip(1)];
    let state = tr.state();
    // The proxier is built and used on a thread inside the node's namespace:
    // the netlink socket and the iptables-restore children belong to it.
    let maps = match lb {
        Some(lb) => {
            let p = kp_ebpf::Placement {
                cgroup: lb.cgroup.path().to_path_buf(),
                pin_dir: lb.fs.path().join("kp"),
            };
            kp_ebpf::install(&p, kp_ebpf::Capacity::default())?;
            Some(kp_ebpf::KernelMaps::open(&p.pin_dir)?)
        }
        None => None,
    };
    in_netns(lab.node_ns(1), move || -> Result<Duration> {
        let mut dp: Box<dyn Dataplane> = match mode {
            Mode::Nftables => Box::new(NftablesProxier::new(pc, Box::new(NftNetlink::new()))),
            Mode::SocketLb => {
                // nftables for everything else, as the binary runs them;
                // the time reported is the socket balancer's maps.
                let mut nft = NftablesProxier::new(pc, Box::new(NftNetlink::new()));
                nft.sync(state, &BTreeSet::new(), true)
                    .map_err(|e| anyhow!("nftables full sync: {e}"))?;
                let maps = maps.ok_or_else(|| anyhow!("socket-lb without maps"))?;
                Box::new(kp_ebpf::SocketLbProxier::new(IpFamily::V4, Box::new(maps)))
            }
            Mode::Iptables => Box::new(
                IptablesProxier::new(pc, Box::new(IptablesCli::variant(IpFamily::V4, variant)))
                    .with_route_localnet(false),
            ),
            Mode::Floor => return Ok(Duration::ZERO),
        };
        let t = Instant::now();
        dp.sync(state, &BTreeSet::new(), true)
            .map_err(|e| anyhow!("full sync: {e}"))?;
        Ok(t.elapsed())
    })?
}

fn setup(mode: Mode, n: u32, m: u32, variant: Variant) -> Result<Setup> {
    let lab = Cluster::new(
        &format!("kp-connect-{mode:?}-{n}"),
        ClusterOpts::with_nodes(1),
    )?;
    let pod = lab.add_pod(1, "srv")?;
    let client = lab.add_pod(1, "cli")?;
    let server = Server::start(&pod, POD_PORT)?;
    let sink = Server::start_sink(&pod, BULK_POD_PORT)?;
    let lb = match mode {
        Mode::SocketLb => {
            let mut cgroup = kp_netlab::TestCgroup::new()?;
            // Every thread kp_netlab starts in the client pod joins it.
            cgroup.adopt_namespace(client.ns());
            Some(Lb {
                cgroup,
                fs: kp_netlab::TestBpffs::new()?,
            })
        }
        _ => None,
    };
    let sync = program(&lab, &pod, mode, n, m, variant, lb.as_ref())?;
    let target = match mode {
        Mode::Floor => pod.addr(POD_PORT),
        _ => SocketAddr::new(REAL_CLUSTER_IP.parse().context("cluster IP")?, SERVICE_PORT),
    };
    let mut s = Setup {
        mode,
        services: n,
        sync,
        lab,
        client,
        target,
        lab_pod: pod.addr(POD_PORT),
        _server: server,
        _sink: sink,
        bulk_target: match mode {
            Mode::Floor => pod.addr(BULK_POD_PORT),
            _ => SocketAddr::new(
                REAL_CLUSTER_IP.parse().context("cluster IP")?,
                BULK_SERVICE_PORT,
            ),
        },
        bulk_pod: pod.addr(BULK_POD_PORT),
        bulk: Vec::new(),
        bulk_direct: Vec::new(),
        samples: Vec::new(),
        failures: 0,
        wall: Duration::ZERO,
        direct: Vec::new(),
        _lb: lb,
    };
    // Warm up (neighbour entries, first conntrack allocations) and check that
    // the Service really answers before measuring.
    let (ok, fail) = connects(&s.client, s.target, 50)?;
    if ok.is_empty() {
        return Err(anyhow!(
            "{mode:?} with {n} Services: no connect to {} succeeded ({fail} failures)",
            s.target
        ));
    }
    s.failures = 0;
    Ok(s)
}

/// Sizes of a row kind, comma-separated; `none` (or nothing) for none.
#[derive(Clone, Debug)]
pub struct Sizes(Vec<u32>);

fn sizes(v: &str) -> Result<Sizes, String> {
    if v.is_empty() || v == "none" {
        return Ok(Sizes(Vec::new()));
    }
    v.split(',')
        .map(|s| s.trim().parse().map_err(|e| format!("{s}: {e}")))
        .collect::<Result<_, _>>()
        .map(Sizes)
}

/// Which iptables `--iptables` rows program.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum IptVariant {
    /// iptables-legacy: the default, since iptables-nft takes minutes to
    /// load 10k Services (the kernel side, not our renderer); the chain walk
    /// is the same in both.
    Legacy,
    /// iptables-nft.
    Nft,
}

/// `kp-bench connect`.
#[derive(clap::Args, Debug, Clone)]
pub struct ConnectArgs {
    /// Rows with nftables rules (netlink), one per size ("none": no such rows).
    #[arg(long, value_name = "SIZES", value_parser = sizes, default_value = "100,10000,50000")]
    nft: Sizes,
    /// Rows with the same nftables rules and the socket load balancer's
    /// programs on the client's cgroup: connect() goes straight to the pod,
    /// no DNAT ("none": no such rows).
    #[arg(long, value_name = "SIZES", value_parser = sizes, default_value = "100,10000,50000")]
    socket_lb: Sizes,
    /// Rows with iptables rules ("none": no such rows).
    #[arg(long, value_name = "SIZES", value_parser = sizes, default_value = "100,10000")]
    iptables: Sizes,
    /// Which iptables the --iptables rows program.
    #[arg(long, value_enum, default_value_t = IptVariant::Legacy)]
    iptables_variant: IptVariant,
    /// Connects per row, over all rounds.
    #[arg(long, default_value_t = 2000)]
    connects: usize,
    /// Rounds: each runs connects / rounds connects against every row in
    /// turn, so background load hits all rows alike.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// Endpoints of each synthetic Service.
    #[arg(long, default_value_t = 10)]
    endpoints: u32,
    /// MiB moved over one connection per row and round, through the Service
    /// and to the pod IP, for the throughput table (0: none).
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    bulk_mib: usize,
}

/// `kp-bench connect`.
pub fn run(a: ConnectArgs) -> Result<()> {
    let (nft, slb, ipt) = (a.nft.0, a.socket_lb.0, a.iptables.0);
    let (total, rounds, m, bulk_mib) = (a.connects, a.rounds as usize, a.endpoints, a.bulk_mib);
    let variant = match a.iptables_variant {
        IptVariant::Legacy => Variant::Legacy,
        IptVariant::Nft => Variant::Nft,
    };
    let mut setups = Vec::new();
    let mut plan = vec![(Mode::Floor, 0)];
    plan.extend(nft.iter().map(|&n| (Mode::Nftables, n)));
    plan.extend(slb.iter().map(|&n| (Mode::SocketLb, n)));
    plan.extend(ipt.iter().map(|&n| (Mode::Iptables, n)));
    for (mode, n) in plan {
        let s = setup(mode, n, m, variant)?;
        eprintln!(
            "set up {mode:?} with {n} Services (full sync {:.2} s) in {}",
            s.sync.as_secs_f64(),
            s.lab.prefix()
        );
        setups.push(s);
    }
    let per = total.div_ceil(rounds);
    for r in 0..rounds {
        for s in setups.iter_mut() {
            // The Service and the pod IP alternate in chunks of 50, so that
            // drift on the machine hits both alike.
            let mut left = per;
            while left > 0 {
                let k = left.min(50);
                left -= k;
                let (ok, fail, wall) = connect_batch(&s.client, s.target, k)?;
                s.wall += wall;
                s.samples.extend(ok);
                s.failures += fail;
                if s.mode != Mode::Floor {
                    let (ok, _) = connects(&s.client, s.lab_pod, k)?;
                    s.direct.extend(ok);
                }
            }
        }
        eprintln!("round {}/{rounds} done", r + 1);
    }
    // Bulk transfers after the connects (their load would blur the
    // connect figures), interleaved the same way.
    if bulk_mib > 0 {
        let bytes = bulk_mib << 20;
        for r in 0..rounds {
            for s in setups.iter_mut() {
                s.bulk.push(bulk(&s.client, s.bulk_target, bytes)?);
                if s.mode != Mode::Floor {
                    s.bulk_direct.push(bulk(&s.client, s.bulk_pod, bytes)?);
                }
            }
            eprintln!("bulk round {}/{rounds} done", r + 1);
        }
    }

    let base = |mode: Mode| {
        setups
            .iter()
            .filter(|s| s.mode == mode)
            .min_by_key(|s| s.services)
            .map(|s| {
                let mut v = s.samples.clone();
                v.sort();
                quantile(&v, 0.5)
            })
    };
    let (floor, nft_base, slb_base, ipt_base) = (
        base(Mode::Floor),
        base(Mode::Nftables),
        base(Mode::SocketLb),
        base(Mode::Iptables),
    );
    println!("| mode | Services (x{m} endpoints) | full sync | connects | p50 µs | p99 µs | mean µs | short connections/s (one client) | pod IP in the same lab: p50 / mean µs | vs pod IP: p50 / mean | p50 vs smallest of the mode | p50 vs floor |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for s in setups.iter_mut() {
        s.samples.sort();
        s.direct.sort();
        let direct = (!s.direct.is_empty()).then(|| (quantile(&s.direct, 0.5), mean(&s.direct)));
        let v = &s.samples;
        let mean = mean(v);
        let p50 = quantile(v, 0.5);
        let slow = v.iter().filter(|d| d.as_millis() >= 200).count();
        if slow > 0 && std::env::var_os("KP_CONNECT_DEBUG").is_some() {
            for ns in [
                s.client.ns().to_string(),
                format!("{}-pod-srv", s.lab.prefix()),
                s.lab.node_ns(1).to_string(),
            ] {
                if let Ok(o) = s.lab.exec(&ns, &["nstat", "-az"]) {
                    let t = String::from_utf8_lossy(&o.stdout);
                    let nz: Vec<&str> = t
                        .lines()
                        .filter(|l| {
                            l.split_whitespace().nth(1).is_some_and(|v| v != "0")
                                && (l.contains("Drop")
                                    || l.contains("Overflow")
                                    || l.contains("Retrans")
                                    || l.contains("Timeout")
                                    || l.contains("Reset")
                                    || l.contains("Challenge")
                                    || l.contains("TW"))
                        })
                        .collect();
                    eprintln!("{ns}: {nz:?}");
                }
            }
        }
        if slow > 0 {
            eprintln!(
                "{:?} {}: {slow} connects took >= 200 ms (SYN retransmitted), max {:?}",
                s.mode,
                s.services,
                v.last()
            );
        }
        let rel = |b: Option<Duration>| match b {
            Some(b) if !b.is_zero() => format!(
                "{:+.1}%",
                (p50.as_secs_f64() / b.as_secs_f64() - 1.0) * 100.0
            ),
            _ => "-".into(),
        };
        let name = s.mode.label(variant);
        let vs_mode = match s.mode {
            Mode::Floor => "-".to_string(),
            Mode::Nftables => rel(nft_base),
            Mode::SocketLb => rel(slb_base),
            Mode::Iptables => rel(ipt_base),
        };
        println!(
            "| {name} | {} | {} | {}{} | {} | {} | {} | {:.0} | {} | {} | {vs_mode} | {} |",
            s.services,
            if s.mode == Mode::Floor {
                "-".to_string()
            } else {
                format!("{:.2} s", s.sync.as_secs_f64())
            },
            v.len(),
            if s.failures > 0 {
                format!(" ({} failed)", s.failures)
            } else {
                String::new()
            },
            us1(p50),
            us(quantile(v, 0.99)),
            us1(mean),
            v.len() as f64 / s.wall.as_secs_f64().max(1e-9),
            direct.map_or("-".into(), |(p, m)| format!("{} / {}", us1(p), us1(m))),
            direct.map_or("-".into(), |(p, m)| {
                let pct =
                    |a: Duration, b: Duration| (a.as_secs_f64() / b.as_secs_f64() - 1.0) * 100.0;
                format!("{:+.1}% / {:+.1}%", pct(p50, p), pct(mean, m))
            }),
            rel(floor),
        );
    }
    if bulk_mib > 0 {
        let gbps = |v: &mut Vec<Duration>| -> Option<f64> {
            v.sort();
            (!v.is_empty())
                .then(|| (bulk_mib << 20) as f64 * 8.0 / quantile(v, 0.5).as_secs_f64() / 1e9)
        };
        println!();
        println!("| mode | Services | bulk transfer (one connection, {bulk_mib} MiB, connect to last byte) | transfers | median Gbit/s | pod IP in the same lab: median Gbit/s | vs pod IP |");
        println!("|---|---|---|---|---|---|---|");
        for s in setups.iter_mut() {
            let name = s.mode.label(variant);
            let (g, d) = (gbps(&mut s.bulk), gbps(&mut s.bulk_direct));
            println!(
                "| {name} | {} | {} | {} | {} | {} | {} |",
                s.services,
                s.bulk_target,
                s.bulk.len(),
                g.map_or("-".into(), |g| format!("{g:.2}")),
                d.map_or("-".into(), |d| format!("{d:.2}")),
                match (g, d) {
                    (Some(g), Some(d)) => format!("{:+.1}%", (g / d - 1.0) * 100.0),
                    _ => "-".into(),
                }
            );
        }
    }
    // Labs (and servers) are torn down as `setups` drops.
    drop(setups);
    Ok(())
}
