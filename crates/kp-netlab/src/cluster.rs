//! The namespace topology: LAN bridge, nodes, pods and an external client.

use std::collections::hash_map::DefaultHasher;
use std::ffi::OsStr;
use std::hash::{Hash, Hasher};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::process::Output;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::netns::{exec_in, exec_ok_in, ip, ip_batch_in, ip_in, netns_exists, sysctl_in};
use crate::process::{kill_and_reap, ProcGuard, SharedChild};
use crate::server::{serve, ServeSpec, ServerGuard};
use crate::LabError;

/// IPv4 service (ClusterIP) range the lab is laid out for.
pub const SERVICE_CIDR_V4: &str = "10.96.0.0/16";
/// IPv6 service (ClusterIP) range the lab is laid out for.
pub const SERVICE_CIDR_V6: &str = "fd00:96::/108";
/// Name of the LAN interface in every node and in the external client.
pub const LAN_IFACE: &str = "eth0";
/// Prefix of the node-side name of every pod veth (`kpv2`, `kpv3`, ...), for
/// interface-name based local-traffic detection.
pub const POD_VETH_PREFIX: &str = "kpv";
/// Address of the node side of every pod veth: the pods' IPv4 gateway.
pub const POD_GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// Link-local address of the node side of every pod veth: the pods' IPv6 gateway.
pub const POD_GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

/// A Linux bridge holds at most 1,024 ports: the nodes', the client's and
/// a few LAN hosts'.
const MAX_NODES: usize = 1000;
/// Nodes numbered as the first labs were: 10.100.0.(10+i), below the
/// client's .100. A lab of more nodes puts the rest in further /24s of a
/// 10.100.0.0/16 LAN (and, past 255, pod CIDRs beyond 10.244.0.0/16).
const NARROW_NODES: usize = 89;
/// Present when br_netfilter is loaded; its sysctls are per namespace.
const BRIDGE_NF_SYSCTL: &str = "/proc/sys/net/bridge/bridge-nf-call-iptables";
const FIRST_POD_HOST: u8 = 2;
const LAST_POD_HOST: u8 = 254;

/// Options of [`Cluster::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterOpts {
    /// Number of node namespaces (1..=200); default 2.
    pub nodes: usize,
}

impl Default for ClusterOpts {
    fn default() -> Self {
        ClusterOpts { nodes: 2 }
    }
}

impl ClusterOpts {
    /// Default options with `nodes` nodes.
    pub fn with_nodes(nodes: usize) -> ClusterOpts {
        ClusterOpts { nodes }
    }
}

/// A pod: a namespace attached to one node by a veth pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    name: String,
    node: usize,
    ns: String,
    ip: Ipv4Addr,
    ip6: Ipv6Addr,
    host_veth: String,
}

impl Pod {
    /// Pod name given to [`Cluster::add_pod`].
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Node (1-based) the pod runs on.
    pub fn node(&self) -> usize {
        self.node
    }
    /// Namespace of the pod.
    pub fn ns(&self) -> &str {
        &self.ns
    }
    /// IPv4 pod IP (10.244.NODE.x).
    pub fn ip(&self) -> IpAddr {
        IpAddr::V4(self.ip)
    }
    /// IPv6 pod IP (fd00:244:NODE::x).
    pub fn ip6(&self) -> IpAddr {
        IpAddr::V6(self.ip6)
    }
    /// `ip():port`.
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip(), port)
    }
    /// `[ip6()]:port`.
    pub fn addr6(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip6(), port)
    }
    /// Name of the node-side veth interface (starts with [`POD_VETH_PREFIX`]).
    pub fn host_veth(&self) -> &str {
        &self.host_veth
    }
}

#[derive(Default)]
struct State {
    /// Every namespace created so far, in creation order.
    namespaces: Vec<String>,
    pods: Vec<Pod>,
    procs: Vec<SharedChild>,
}

/// A host added with [`Cluster::add_host`]: its namespace and LAN addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LanHost {
    pub ns: String,
    pub ip: IpAddr,
    pub ip6: IpAddr,
}

/// A lab cluster of network namespaces; everything is torn down on drop.
/// See the crate documentation for the topology.
pub struct Cluster {
    test_name: String,
    prefix: String,
    lan_ns: String,
    client_ns: String,
    node_ns: Vec<String>,
    state: Mutex<State>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("test_name", &self.test_name)
            .field("prefix", &self.prefix)
            .field("nodes", &self.node_ns.len())
            .finish()
    }
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn new_prefix() -> String {
    let mut h = DefaultHasher::new();
    std::process::id().hash(&mut h);
    COUNTER.fetch_add(1, Ordering::SeqCst).hash(&mut h);
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default()
        .hash(&mut h);
    std::thread::current().id().hash(&mut h);
    format!("kp{:06x}", h.finish() & 0xff_ffff)
}

fn node_ip_v4(i: usize) -> Ipv4Addr {
    if i <= NARROW_NODES {
        return Ipv4Addr::new(10, 100, 0, (10 + i) as u8);
    }
    // 10.100.1.1 .. 10.100.1.254, 10.100.2.1 ...: never .0 or .255.
    let j = i - NARROW_NODES - 1;
    Ipv4Addr::new(10, 100, (1 + j / 254) as u8, (1 + j % 254) as u8)
}

fn node_ip_v6(i: usize) -> Ipv6Addr {
    if i <= NARROW_NODES {
        // fd00:100::11 for node 1: same digits as 10.100.0.11.
        return Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, 0x10 + i as u16);
    }
    // Apart from the hosts' fd00:100::(2..254 as digits).
    Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 1, i as u16)
}

/// A wide lab's LAN MAC for `v4`: locally administered, its last four
/// bytes the address (02:6b:0a:64:x:y for 10.100.x.y).
fn lan_mac(v4: Ipv4Addr) -> String {
    let o = v4.octets();
    format!("02:6b:{:02x}:{:02x}:{:02x}:{:02x}", o[0], o[1], o[2], o[3])
}

/// The /24 of node `i`'s IPv4 pods: 10.244.i.0 up to node 255, then
/// 10.245.(i-256).0 and so on.
fn pod_net_v4(i: usize) -> (u8, u8) {
    ((244 + i / 256) as u8, (i % 256) as u8)
}

/// Parses decimal digits as if they were hex, so that IPv6 addresses read
/// like their IPv4 twins (node 12 -> group `12`, i.e. 0x12).
fn dec_as_hex(n: usize) -> u16 {
    u16::from_str_radix(&n.to_string(), 16).unwrap_or(0)
}

fn pod_ip_v4(node: usize, host: u8) -> Ipv4Addr {
    let (b, c) = pod_net_v4(node);
    Ipv4Addr::new(10, b, c, host)
}

fn pod_ip_v6(node: usize, host: u8) -> Ipv6Addr {
    Ipv6Addr::new(
        0xfd00,
        0x244,
        dec_as_hex(node),
        0,
        0,
        0,
        0,
        dec_as_hex(host.into()),
    )
}

const CLIENT_V4: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 100);
const CLIENT_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, 0x100);

fn check_pod_name(name: &str) -> Result<(), LabError> {
    let ok = !name.is_empty()
        && name.len() <= 40
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
    if ok {
        Ok(())
    } else {
        Err(LabError::InvalidName {
            kind: "pod",
            name: name.to_string(),
            why: "use 1-40 characters from [A-Za-z0-9._-]",
        })
    }
}

impl Cluster {
    /// Builds the lab. `test_name` only labels logs; namespace names use a
    /// fresh random prefix, so parallel tests never collide. On error every
    /// namespace created so far is removed again.
    pub fn new(test_name: &str, opts: ClusterOpts) -> Result<Cluster, LabError> {
        if opts.nodes == 0 || opts.nodes > MAX_NODES {
            return Err(LabError::Options(format!(
                "nodes must be within 1..={MAX_NODES}, got {}",
                opts.nodes
            )));
        }
        let mut prefix = new_prefix();
        // Another process may hold the same prefix; 24 random bits make a
        // repeat collision practically impossible.
        for _ in 0..8 {
            if !netns_exists(&format!("{prefix}-lan")) {
                break;
            }
            prefix = new_prefix();
        }
        let cluster = Cluster {
            test_name: test_name.to_string(),
            lan_ns: format!("{prefix}-lan"),
            client_ns: format!("{prefix}-client"),
            node_ns: (1..=opts.nodes)
                .map(|i| format!("{prefix}-node{i}"))
                .collect(),
            prefix,
            state: Mutex::new(State::default()),
        };
        tracing::info!(test = test_name, prefix = %cluster.prefix, nodes = opts.nodes, "building netlab cluster");
        // On error, dropping `cluster` removes whatever was built.
        cluster.build()?;
        Ok(cluster)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Poison only means a panic elsewhere; the bookkeeping stays valid.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add_netns(&self, ns: &str, sysctls: &[(&str, &str)]) -> Result<(), LabError> {
        ip(&["netns", "add", ns])?;
        self.state().namespaces.push(ns.to_string());
        // Settings that must precede interface creation: `default.*` is
        // copied into every interface created later in this namespace.
        let mut all: Vec<(&str, &str)> = vec![
            ("net.ipv6.conf.all.accept_dad", "0"),
            ("net.ipv6.conf.default.accept_dad", "0"),
            // No ICMP error rate limiting: tests that expect a reject must
            // not see a timeout because an earlier test step used the budget.
            ("net.ipv4.icmp_ratelimit", "0"),
            ("net.ipv6.icmp.ratelimit", "0"),
        ];
        all.extend_from_slice(sysctls);
        sysctl_in(ns, &all)?;
        // Nor the namespace's overall ICMP budget (1,000/s, bursts of 50),
        // which parallel tests flooding rejects ran dry. Best effort: older
        // kernels (the IPVS VM's 6.1) keep it host-wide, outside any
        // namespace's reach.
        let _ = sysctl_in(
            ns,
            &[
                ("net.ipv4.icmp_msgs_per_sec", "1000000"),
                ("net.ipv4.icmp_msgs_burst", "100000"),
            ],
        );
        ip_in(ns, &["link", "set", "lo", "up"])?;
        Ok(())
    }

    /// Attaches namespace `ns` to the LAN bridge as `eth0` with the given addresses.
    fn attach_to_lan(
        &self,
        ns: &str,
        lan_port: &str,
        v4: Ipv4Addr,
        v6: Ipv6Addr,
    ) -> Result<(), LabError> {
        let lan = self.lan_ns.as_str();
        ip_in(
            lan,
            &[
                "link", "add", lan_port, "type", "veth", "peer", "name", LAN_IFACE, "netns", ns,
            ],
        )?;
        ip_in(lan, &["link", "set", lan_port, "master", "br0", "up"])?;
        let len = self.lan_cidr().prefix_len();
        ip_in(
            ns,
            &["addr", "add", &format!("{v4}/{len}"), "dev", LAN_IFACE],
        )?;
        ip_in(
            ns,
            &[
                "addr",
                "add",
                &format!("{v6}/64"),
                "dev",
                LAN_IFACE,
                "nodad",
            ],
        )?;
        if self.is_wide() {
            let mac = lan_mac(v4);
            ip_in(ns, &["link", "set", LAN_IFACE, "address", &mac])?;
        }
        ip_in(ns, &["link", "set", LAN_IFACE, "up"])?;
        Ok(())
    }

    /// More nodes than the first LAN /24 holds (see [`NARROW_NODES`]).
    fn is_wide(&self) -> bool {
        self.node_ns.len() > NARROW_NODES
    }

    /// In a wide lab, a LAN host and every node know each other's MAC
    /// as permanent neighbours. The kernel's neighbour table holds 1,024
    /// entries machine-wide (gc_thresh3, a sysctl of the root namespace
    /// only) and a control plane talking to hundreds of nodes would
    /// overflow it; permanent entries are not counted.
    fn pin_neighbours(&self, host_ns: &str, host_v4: Ipv4Addr) -> Result<(), LabError> {
        let nodes: Vec<String> = (1..=self.node_ns.len())
            .map(|i| {
                let ip = node_ip_v4(i);
                format!(
                    "neigh replace {ip} lladdr {} dev {LAN_IFACE} nud permanent",
                    lan_mac(ip)
                )
            })
            .collect();
        ip_batch_in(host_ns, &nodes)?;
        let host = format!(
            "neigh replace {host_v4} lladdr {} dev {LAN_IFACE} nud permanent",
            lan_mac(host_v4)
        );
        for ns in &self.node_ns {
            ip_batch_in(ns, std::slice::from_ref(&host))?;
        }
        Ok(())
    }

    fn build(&self) -> Result<(), LabError> {
        let lan = self.lan_ns.clone();
        // The LAN is a pure L2 switch: no addresses, no forwarding, and (if
        // br_netfilter is loaded) no netfilter on bridged frames.
        let bridge_nf: &[(&str, &str)] = if Path::new(BRIDGE_NF_SYSCTL).exists() {
            &[
                ("net.bridge.bridge-nf-call-iptables", "0"),
                ("net.bridge.bridge-nf-call-ip6tables", "0"),
                ("net.bridge.bridge-nf-call-arptables", "0"),
            ]
        } else {
            &[]
        };
        self.add_netns(&lan, bridge_nf)?;
        ip_in(
            &lan,
            &[
                "link",
                "add",
                "br0",
                "type",
                "bridge",
                "mcast_snooping",
                "0",
            ],
        )?;
        ip_in(&lan, &["link", "set", "br0", "up"])?;

        let forwarding = [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
        ];
        for i in 1..=self.node_ns.len() {
            let ns = self.node_ns[i - 1].clone();
            self.add_netns(&ns, &forwarding)?;
            self.attach_to_lan(&ns, &format!("n{i}"), node_ip_v4(i), node_ip_v6(i))?;
            // Default routes out of eth0 make every destination (ClusterIPs,
            // external IPs) routable from the node, so locally generated
            // packets reach the netfilter OUTPUT hooks and then get DNATed.
            ip_in(&ns, &["route", "add", "default", "dev", LAN_IFACE])?;
            ip_in(&ns, &["-6", "route", "add", "default", "dev", LAN_IFACE])?;
        }
        // Every other node's pods through that node: K-1 routes a family in
        // each node, one `ip -batch` a node (K² processes took minutes at
        // a few hundred nodes).
        for i in 1..=self.node_ns.len() {
            let routes: Vec<String> = (1..=self.node_ns.len())
                .filter(|&j| j != i)
                .flat_map(|j| {
                    [
                        format!("route add {} via {}", self.pod_cidr(j), node_ip_v4(j)),
                        format!("route add {} via {}", self.pod_cidr6(j), node_ip_v6(j)),
                    ]
                })
                .collect();
            if !routes.is_empty() {
                ip_batch_in(&self.node_ns[i - 1], &routes)?;
            }
        }

        let client = self.client_ns.clone();
        self.add_netns(&client, &[])?;
        self.attach_to_lan(&client, "c0", CLIENT_V4, CLIENT_V6)?;
        Ok(())
    }

    /// Adds pod `name` on node `node` (1-based): a namespace whose `eth0`
    /// is a veth to the node, pod IPs 10.244.NODE.x/32 and fd00:244:NODE::x/128
    /// (x = 2, 3, ... in creation order), default routes via the node.
    pub fn add_pod(&self, node: usize, name: &str) -> Result<Pod, LabError> {
        self.check_node(node)?;
        check_pod_name(name)?;
        let ns = format!("{}-pod-{name}", self.prefix);
        let host = {
            let st = self.state();
            if st.pods.iter().any(|p| p.name == name) {
                return Err(LabError::InvalidName {
                    kind: "pod",
                    name: name.to_string(),
                    why: "a pod with this name already exists in the cluster",
                });
            }
            let used = st.pods.iter().filter(|p| p.node == node).count();
            u8::try_from(usize::from(FIRST_POD_HOST) + used)
                .ok()
                .filter(|h| *h <= LAST_POD_HOST)
                .ok_or(LabError::PodsExhausted { node })?
        };
        let pod = Pod {
            name: name.to_string(),
            node,
            ns: ns.clone(),
            ip: pod_ip_v4(node, host),
            ip6: pod_ip_v6(node, host),
            host_veth: format!("{POD_VETH_PREFIX}{host}"),
        };
        // Reserve the address before the slow part; a failed pod keeps its
        // slot, which is harmless.
        self.state().pods.push(pod.clone());

        let node_ns = self.node_ns[node - 1].as_str();
        let veth = pod.host_veth.as_str();
        self.add_netns(&ns, &[])?;
        ip_in(
            node_ns,
            &[
                "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ],
        )?;
        // Link scope keeps 169.254.1.1 out of source-address selection
        // (notably MASQUERADE), so the node's LAN IP is used instead.
        ip_in(
            node_ns,
            &[
                "addr",
                "add",
                &format!("{POD_GATEWAY_V4}/32"),
                "dev",
                veth,
                "scope",
                "link",
            ],
        )?;
        ip_in(
            node_ns,
            &[
                "-6",
                "addr",
                "add",
                &format!("{POD_GATEWAY_V6}/64"),
                "dev",
                veth,
                "nodad",
            ],
        )?;
        ip_in(node_ns, &["link", "set", veth, "up"])?;
        let (nv4, nv6) = (node_ip_v4(node).to_string(), node_ip_v6(node).to_string());
        ip_in(
            node_ns,
            &[
                "route",
                "add",
                &format!("{}/32", pod.ip),
                "dev",
                veth,
                "src",
                &nv4,
            ],
        )?;
        ip_in(
            node_ns,
            &[
                "-6",
                "route",
                "add",
                &format!("{}/128", pod.ip6),
                "dev",
                veth,
                "src",
                &nv6,
            ],
        )?;

        ip_in(
            &ns,
            &["addr", "add", &format!("{}/32", pod.ip), "dev", "eth0"],
        )?;
        ip_in(
            &ns,
            &[
                "addr",
                "add",
                &format!("{}/128", pod.ip6),
                "dev",
                "eth0",
                "nodad",
            ],
        )?;
        ip_in(&ns, &["link", "set", "eth0", "up"])?;
        let gw4 = POD_GATEWAY_V4.to_string();
        let gw6 = POD_GATEWAY_V6.to_string();
        ip_in(
            &ns,
            &[
                "route", "add", "default", "via", &gw4, "dev", "eth0", "onlink",
            ],
        )?;
        ip_in(
            &ns,
            &["-6", "route", "add", "default", "via", &gw6, "dev", "eth0"],
        )?;
        tracing::debug!(pod = name, node, ns = %ns, ip = %pod.ip, ip6 = %pod.ip6, "pod added");
        Ok(pod)
    }

    /// Adds a plain host on the LAN: namespace `PREFIX-NAME` with `eth0` at
    /// 10.100.0.`host` / fd00:100::`host` (same digits) and no other routes.
    /// For a control plane the nodes reach over the LAN, like a real one.
    /// `host` must be outside the nodes' (11..) and the client's (100)
    /// addresses: 2..=9 or 101..=254.
    pub fn add_host(&self, name: &str, host: u8) -> Result<LanHost, LabError> {
        check_pod_name(name)?;
        if !(2..=9).contains(&host) && !(101..=254).contains(&host) {
            return Err(LabError::Options(format!(
                "LAN host address .{host} is taken or reserved (use 2..=9 or 101..=254)"
            )));
        }
        let ns = format!("{}-{name}", self.prefix);
        self.add_netns(&ns, &[])?;
        let v4 = Ipv4Addr::new(10, 100, 0, host);
        let v6 = Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, dec_as_hex(host as usize));
        self.attach_to_lan(&ns, &format!("h{host}"), v4, v6)?;
        if self.is_wide() {
            self.pin_neighbours(&ns, v4)?;
        }
        Ok(LanHost {
            ns,
            ip: IpAddr::V4(v4),
            ip6: IpAddr::V6(v6),
        })
    }

    /// Attaches `object`'s XDP program (section "xdp"; one that passes
    /// every frame) in the driver of every port of the LAN bridge: the far
    /// ends of the nodes' and the client's eth0. A node's XDP_TX frames go
    /// back through its veth into that end, which veth wakes for them only
    /// while it runs an XDP program; a NIC's wire needs nothing of the
    /// kind. The program goes with the LAN's namespace.
    pub fn xdp_on_lan_ports(&self, object: &[u8]) -> Result<(), LabError> {
        let path = std::env::temp_dir().join(format!("{}-xdp-pass.o", self.prefix));
        std::fs::write(&path, object).map_err(|e| LabError::Io {
            what: format!("writing {}", path.display()),
            source: e,
        })?;
        let file = path.to_string_lossy().into_owned();
        let ports = (1..=self.node_ns.len())
            .map(|i| format!("n{i}"))
            .chain(std::iter::once("c0".to_string()));
        let mut out = Ok(());
        for port in ports {
            // Through `ip netns exec`, whose mount namespace is its own:
            // iproute2's object loader may mount a bpffs on /sys/fs/bpf (for
            // an object's pinned maps), which `ip -n` would leave on the host.
            out = out.and(
                exec_ok_in(
                    &self.lan_ns,
                    &[
                        "ip", "link", "set", "dev", &port, "xdpdrv", "obj", &file, "sec", "xdp",
                    ],
                )
                .map(|_| ()),
            );
        }
        let _ = std::fs::remove_file(&path);
        out
    }

    /// Turns checksum offload off on `eth0` of namespace `ns` (a pod, the
    /// client): what it sends then carries its full TCP and UDP checksums,
    /// as frames from a NIC's wire do, instead of the pseudo-header sum a
    /// veth passes on for the receiver's stack to trust. XDP programs read
    /// frames before any stack does (`ethtool`).
    pub fn full_checksums(&self, ns: &str) -> Result<(), LabError> {
        exec_ok_in(ns, &["ethtool", "-K", LAN_IFACE, "tx", "off"]).map(|_| ())
    }

    /// Adds a route in the external client towards `dest` (an external IP,
    /// a LoadBalancer IP, a service CIDR...) via node `node`'s LAN address.
    pub fn client_route_via(&self, dest: IpNet, node: usize) -> Result<(), LabError> {
        self.check_node(node)?;
        let via = match dest {
            IpNet::V4(_) => node_ip_v4(node).to_string(),
            IpNet::V6(_) => node_ip_v6(node).to_string(),
        };
        ip_in(
            &self.client_ns,
            &["route", "replace", &dest.to_string(), "via", &via],
        )?;
        Ok(())
    }

    /// Starts `program args...` inside `ns`, stdout and stderr appended to
    /// `log`. The program is SIGKILLed when the guard or the cluster drops.
    pub fn spawn(
        &self,
        ns: &str,
        program: &Path,
        args: &[String],
        log: &Path,
    ) -> Result<ProcGuard, LabError> {
        let (guard, shared) = ProcGuard::spawn(ns, program, args, log)?;
        let mut st = self.state();
        // Forget children that are already gone so long tests do not pile up handles.
        st.procs
            .retain(|c| matches!(c.lock().map(|mut c| c.try_wait()), Ok(Ok(None))));
        st.procs.push(shared);
        Ok(guard)
    }

    /// Runs a command inside `ns` (`ip netns exec`) and returns its output
    /// whatever the exit status.
    pub fn exec<S: AsRef<OsStr>>(&self, ns: &str, argv: &[S]) -> Result<Output, LabError> {
        exec_in(ns, argv)
    }

    /// Runs a command inside `ns`; its stdout on success, else an error
    /// carrying the command line, status and stderr.
    pub fn exec_ok<S: AsRef<OsStr>>(&self, ns: &str, argv: &[S]) -> Result<String, LabError> {
        exec_ok_in(ns, argv)
    }

    /// Starts an echo server in `ns`; see [`ServeSpec`].
    pub fn serve(&self, ns: &str, name: &str, spec: ServeSpec) -> Result<ServerGuard, LabError> {
        serve(ns, name, spec)
    }

    fn check_node(&self, node: usize) -> Result<(), LabError> {
        if node == 0 || node > self.node_ns.len() {
            return Err(LabError::NoSuchNode {
                node,
                nodes: self.node_ns.len(),
            });
        }
        Ok(())
    }

    fn node_index(&self, node: usize) -> usize {
        assert!(
            node >= 1 && node <= self.node_ns.len(),
            "node {node} does not exist (the cluster has nodes 1..={})",
            self.node_ns.len()
        );
        node - 1
    }

    /// Label given to [`Cluster::new`].
    pub fn test_name(&self) -> &str {
        &self.test_name
    }
    /// The unique prefix of every namespace of this cluster.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.node_ns.len()
    }
    /// Namespace of node `i` (1-based). Panics if there is no such node.
    pub fn node_ns(&self, i: usize) -> &str {
        &self.node_ns[self.node_index(i)]
    }
    /// LAN IPv4 of node `i`: 10.100.0.(10+i) for the first 89, then
    /// 10.100.1.1, 10.100.1.2 ... Panics if there is no such node.
    pub fn node_ip(&self, i: usize) -> IpAddr {
        IpAddr::V4(node_ip_v4(self.node_index(i) + 1))
    }
    /// LAN IPv6 of node `i`: fd00:100::(0x10+i) for the first 89, then
    /// fd00:100::1:i. Panics if there is no such node.
    pub fn node_ip6(&self, i: usize) -> IpAddr {
        IpAddr::V6(node_ip_v6(self.node_index(i) + 1))
    }
    /// Namespace of the external client.
    pub fn client_ns(&self) -> &str {
        &self.client_ns
    }
    /// Namespace holding the LAN bridge `br0`.
    pub fn lan_ns(&self) -> &str {
        &self.lan_ns
    }
    /// External client IPv4: 10.100.0.100.
    pub fn client_ip(&self) -> IpAddr {
        IpAddr::V4(CLIENT_V4)
    }
    /// External client IPv6: fd00:100::100.
    pub fn client_ip6(&self) -> IpAddr {
        IpAddr::V6(CLIENT_V6)
    }
    /// IPv4 pod CIDR of node `i`: 10.244.i.0/24 (past node 255,
    /// 10.245.(i-256).0/24 ...). Panics if there is no such node.
    pub fn pod_cidr(&self, i: usize) -> IpNet {
        let i = self.node_index(i) + 1;
        let (b, c) = pod_net_v4(i);
        IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(10, b, c, 0), 24))
    }
    /// IPv6 pod CIDR of node `i`: fd00:244:i::/64. Panics if there is no such node.
    pub fn pod_cidr6(&self, i: usize) -> IpNet {
        let i = self.node_index(i) + 1;
        let net = Ipv6Addr::new(0xfd00, 0x244, dec_as_hex(i), 0, 0, 0, 0, 0);
        IpNet::V6(Ipv6Net::new_assert(net, 64))
    }
    /// Whole IPv4 cluster (pod) CIDR: 10.244.0.0/16 (/14 past 255 nodes).
    pub fn cluster_cidr(&self) -> IpNet {
        let len = if self.node_ns.len() < 256 { 16 } else { 14 };
        IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(10, 244, 0, 0), len))
    }
    /// Whole IPv6 cluster (pod) CIDR: fd00:244::/48.
    pub fn cluster_cidr6(&self) -> IpNet {
        let net = Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 0);
        IpNet::V6(Ipv6Net::new_assert(net, 48))
    }
    /// IPv4 LAN: 10.100.0.0/24 (/16 past 89 nodes).
    pub fn lan_cidr(&self) -> IpNet {
        let len = if self.node_ns.len() <= NARROW_NODES {
            24
        } else {
            16
        };
        IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(10, 100, 0, 0), len))
    }
    /// IPv6 LAN: fd00:100::/64.
    pub fn lan_cidr6(&self) -> IpNet {
        let net = Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, 0);
        IpNet::V6(Ipv6Net::new_assert(net, 64))
    }
    /// Pods added so far.
    pub fn pods(&self) -> Vec<Pod> {
        self.state().pods.clone()
    }
    /// Every namespace this cluster created (LAN, nodes, client, pods).
    pub fn all_namespaces(&self) -> Vec<String> {
        self.state().namespaces.clone()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let st = std::mem::take(&mut *self.state());
        // Processes first: they may hold sockets that keep namespaces alive.
        for child in &st.procs {
            kill_and_reap(child);
        }
        // Reverse order: pods, then the client and nodes, the LAN last.
        for ns in st.namespaces.iter().rev() {
            if let Err(e) = ip(&["netns", "del", ns]) {
                tracing::warn!(ns = %ns, error = %e, "could not delete lab namespace");
            }
        }
        tracing::debug!(test = %self.test_name, prefix = %self.prefix, "netlab cluster removed");
    }
}
