//! Userspace mode: its flags, its metrics (into the process registry),
//! building one proxier per IP family, and its leftovers (Service IPs on lo).
//! The proxy itself is kp-userspace.

use std::sync::Arc;

use anyhow::{Context, Result};
use kp_model::{Dataplane, ProxierConfig};
use kp_userspace::{Algorithm, Direction, UserspaceConfig, UserspaceProxier, VipMode};

use super::{Outcome, Scope};
use crate::config::{ProxyConfig, ProxyMode, UserspaceFlags};
use crate::metrics::Metrics;

impl kp_userspace::MetricsSink for Metrics {
    fn connection_opened(&self, service: &str) {
        self.userspace_connection_opened(service);
    }
    fn connection_closed(&self, service: &str) {
        self.userspace_connection_closed(service);
    }
    fn bytes(&self, service: &str, direction: Direction, n: u64) {
        self.add_userspace_bytes(service, direction.as_str(), n);
    }
    fn error(&self, service: &str) {
        self.inc_userspace_error(service);
    }
    fn service_gone(&self, service: &str) {
        self.remove_userspace_service(service);
    }
}

/// The userspace proxier for one family.
pub fn make_dataplane(
    flags: &UserspaceFlags,
    pc: &ProxierConfig,
    metrics: &Metrics,
) -> Result<Box<dyn Dataplane>> {
    let mut c = UserspaceConfig::from_proxier_config(pc);
    c.algorithm = flags
        .userspace_balancer
        .parse::<Algorithm>()
        .map_err(anyhow::Error::msg)?;
    c.vip_mode = match flags.userspace_vip_mode.as_str() {
        "loopback" => VipMode::Loopback,
        "none" => VipMode::None,
        _ if kp_userspace::has_net_admin() => VipMode::Loopback,
        _ => VipMode::None,
    };
    c.connect_timeout = flags.userspace_connect_timeout;
    c.tcp_idle_timeout = flags.userspace_tcp_idle_timeout;
    c.udp_idle_timeout = flags.userspace_udp_idle_timeout;
    c.grace_period = flags.userspace_grace_period;
    c.splice = flags.userspace_splice;
    tracing::info!(family = %pc.family, balancer = %c.algorithm, vip_mode = ?c.vip_mode,
        "userspace proxy: Service IPs are {}",
        if c.vip_mode == VipMode::Loopback { "added to lo" } else { "not taken over (NodePorts and local IPs only)" });
    let rt = kp_userspace::runtime().context("userspace proxy runtime")?;
    let p = UserspaceProxier::new(c, Arc::new(metrics.clone()), rt)
        .context("starting the userspace proxy")?;
    Ok(Box::new(p))
}

/// Removes the Service IPs userspace mode put on lo (both families, only
/// the ones carrying its mark): for `--cleanup`, and when another mode
/// starts (they would keep answering locally for Service IPs).
pub fn remove_leftovers(scope: Scope, _cfg: &ProxyConfig, out: &mut Outcome) {
    if scope.starting_in(ProxyMode::Userspace) {
        return;
    }
    let mut rtnl = match kp_userspace::netlink::Rtnl::open() {
        Ok(r) => r,
        Err(e) => {
            out.skipped.push(format!("userspace addresses on lo: {e}"));
            return;
        }
    };
    let ours = match rtnl.list_ours() {
        Ok(v) => v,
        Err(e) => {
            out.skipped.push(format!("userspace addresses on lo: {e}"));
            return;
        }
    };
    for ip in ours {
        match rtnl.del(&ip) {
            Ok(()) => out.removed.push(format!("userspace address {ip} on lo")),
            Err(e) => out
                .failed
                .push(format!("userspace address {ip} on lo: {e}")),
        }
    }
}
