//! `--socket-lb`: nftables mode plus socket-level load balancing
//! (kp-ebpf, docs/ebpf.md). Connections from this node's processes to a
//! ClusterIP are sent to an endpoint by cgroup BPF programs inside
//! connect()/sendmsg(); nftables stays in charge of everything else
//! (traffic from outside, NodePorts, masquerading, rejects, and sockets the
//! programs did not translate). One dataplane per family runs both.
//! `--bpf-nodeport` adds tc programs for traffic from outside the node
//! (NodePorts, LoadBalancer IPs, external IPs): the IPv4 dataplane loads
//! them and keeps them attached to the node's interfaces; each family's
//! writes their entries into the same maps.

use std::collections::BTreeSet;
use std::path::PathBuf;

use anyhow::{Context, Result};
use kp_ebpf::{Capacity, Installed, KernelMaps, MemMaps, NodePort, Placement, SocketLbProxier};
use kp_model::{Dataplane, DataplaneError, ProxyState, ServicePortName, SyncReport};

use super::{Outcome, Scope};
use crate::config::{ProxyConfig, ProxyMode, SocketLbFlags};

/// Where cgroup v2 is mounted (/sys/fs/cgroup, or .../unified on hybrid hosts).
fn cgroup2_root() -> Result<PathBuf> {
    let info =
        std::fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    info.lines()
        .filter_map(|l| l.split_once(" - "))
        .find(|(_, right)| right.split_whitespace().next() == Some("cgroup2"))
        .and_then(|(left, _)| left.split_whitespace().nth(4))
        .map(PathBuf::from)
        .context("--socket-lb: no cgroup v2 hierarchy is mounted (the programs need one)")
}

/// Where the programs attach and pin, from the flags.
pub fn placement(flags: &SocketLbFlags) -> Result<Placement> {
    let cgroup = if flags.cgroup_path.is_empty() {
        cgroup2_root()?
    } else {
        PathBuf::from(&flags.cgroup_path)
    };
    Ok(Placement {
        cgroup,
        pin_dir: flags.bpf_pin_path.clone(),
    })
}

/// Attaches (or adopts) the programs once; each family's dataplane then
/// opens the pinned maps. Not for --dry-run, which touches no kernel.
pub fn install(flags: &SocketLbFlags) -> Result<()> {
    let p = placement(flags)?;
    let how = kp_ebpf::install(&p, Capacity::default()).context("--socket-lb")?;
    let (adopted, upgraded) = match how {
        Installed::Fresh => (false, 0),
        Installed::Adopted { upgraded } => (true, upgraded),
    };
    tracing::info!(cgroup = %p.cgroup.display(), pins = %p.pin_dir.display(),
        adopted, upgraded, "socket load balancing attached");
    if !flags.bpf_nodeport
        && kp_ebpf::remove_nodeport(&p.pin_dir).context("removing the tc programs' pins")?
    {
        // A previous run's --bpf-nodeport: its links would go on running.
        tracing::info!("tc programs of a previous --bpf-nodeport run detached");
    }
    Ok(())
}

/// This node's addresses whose NodePorts nftables answers
/// (--nodeport-addresses; all of them when it is empty), loopback excepted
/// as in nftables mode: local connections to them are balanced too.
pub fn nodeport_ips(pc: &kp_model::ProxierConfig) -> Vec<std::net::IpAddr> {
    pc.node_ips
        .iter()
        .filter(|ip| !ip.is_loopback() && pc.serves_nodeports(ip))
        .copied()
        .collect()
}

/// nftables and the socket load balancer for one family.
pub struct WithSocketLb {
    nft: Box<dyn Dataplane>,
    lb: SocketLbProxier,
    pin_dir: PathBuf,
}

/// `nft` plus the socket load balancer; with `kernel` false (--dry-run,
/// --cleanup) its maps are in memory and nothing is attached.
pub fn wrap(
    nft: Box<dyn Dataplane>,
    flags: &SocketLbFlags,
    family: kp_model::IpFamily,
    kernel: bool,
    nodeport_ips: Vec<std::net::IpAddr>,
) -> Result<Box<dyn Dataplane>> {
    // The IPv4 dataplane (made first) loads the tc programs, which serve
    // both families; the IPv6 one records its address for them.
    let outside = flags.bpf_nodeport;
    let nodeport = match family {
        _ if !outside || !kernel => None,
        kp_model::IpFamily::V4 => {
            let node_v4 = nodeport_ips.iter().find_map(|ip| match ip {
                std::net::IpAddr::V4(v4) => Some(*v4),
                std::net::IpAddr::V6(_) => None,
            });
            let mut np = NodePort::install(&flags.bpf_pin_path, Capacity::default(), node_v4, None)
                .context("--bpf-nodeport")?;
            np.set_acceleration(
                kp_ebpf::Acceleration::parse(&flags.bpf_lb_acceleration).unwrap_or_default(),
            )
            .context("--bpf-lb-acceleration")?;
            tracing::info!(
                algorithm = %flags.bpf_lb_algorithm,
                lb_mode = %flags.bpf_lb_mode,
                acceleration = %flags.bpf_lb_acceleration,
                "tc programs for traffic from outside the node loaded"
            );
            Some((np, flags.bpf_nodeport_devices.clone()))
        }
        kp_model::IpFamily::V6 => {
            let node_v6 = nodeport_ips.iter().find_map(|ip| match ip {
                std::net::IpAddr::V6(v6) => Some(*v6),
                std::net::IpAddr::V4(_) => None,
            });
            if let Some(ip) = node_v6 {
                kp_ebpf::set_node_v6(&flags.bpf_pin_path, ip).context("--bpf-nodeport")?;
            }
            None
        }
    };
    // After the tc programs' object: it pins kp_maglev, which the maps open.
    let maps: Box<dyn kp_ebpf::Maps> = if kernel {
        Box::new(KernelMaps::open(&flags.bpf_pin_path).context("--socket-lb")?)
    } else {
        Box::new(MemMaps::new(false))
    };
    let mut lb = SocketLbProxier::new(family, maps)
        .with_nodeport_ips(nodeport_ips)
        .with_outside(outside)
        .with_maglev(outside && flags.bpf_lb_algorithm == "maglev")
        .with_lb_mode(if outside {
            kp_ebpf::LbMode::parse(&flags.bpf_lb_mode).unwrap_or_default()
        } else {
            kp_ebpf::LbMode::Snat
        });
    if let Some((mut np, devices)) = nodeport {
        np.set_devices(devices);
        lb = lb.with_nodeport(Box::new(np));
    }
    Ok(Box::new(WithSocketLb {
        nft,
        lb,
        pin_dir: flags.bpf_pin_path.clone(),
    }))
}

impl Dataplane for WithSocketLb {
    fn mode(&self) -> kp_model::ProxyMode {
        kp_model::ProxyMode::Nftables
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        // nftables first: a Service's rules are in place before its sockets
        // are balanced, and still there (for other cgroups) when they stop.
        let mut report = self.nft.sync(state, changed, full)?;
        // The eBPF dataplane attaches its own tc programs first.
        let lb = self.lb.sync(state, changed, full)?;
        report.ops += lb.ops;
        report.apply += lb.apply;
        Ok(report)
    }

    fn render(&self, state: &ProxyState) -> String {
        let mut out = self.nft.render(state);
        out.push('\n');
        out.push_str(&self.lb.render(state));
        out
    }

    fn rules_lost(&mut self) -> bool {
        self.nft.rules_lost()
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        self.nft.cleanup()?;
        kp_ebpf::remove(&self.pin_dir)
            .map(|_| ())
            .map_err(|e| DataplaneError::Apply {
                tool: "bpffs".into(),
                message: e.to_string(),
            })
    }
}

/// Socket load balancing's pins under --bpf-pin-path (unpinning detaches
/// the programs and frees the maps): for `--cleanup`, and when the proxy
/// starts without `--socket-lb` (they would keep balancing); starting with
/// it, they stay and are adopted.
pub fn remove_leftovers(scope: Scope, cfg: &ProxyConfig, out: &mut Outcome) {
    if cfg.socket_lb.socket_lb && scope.starting_in(ProxyMode::Nftables) {
        return;
    }
    let dir = &cfg.socket_lb.bpf_pin_path;
    match kp_ebpf::remove(dir) {
        Ok(true) => out
            .removed
            .push(format!("socket load balancing pins in {}", dir.display())),
        Ok(false) => {}
        Err(e) => out.failed.push(format!("socket load balancing: {e}")),
    }
}
