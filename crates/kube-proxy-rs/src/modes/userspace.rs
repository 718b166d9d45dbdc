//! Userspace mode: its flags, its metrics (into the process registry),
//! building one proxier per IP family, and its leftovers (Service IPs on lo).
//! The proxy itself is kp-userspace.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use kp_model::{Dataplane, ProxierConfig};
use kp_userspace::{Algorithm, Direction, UserspaceConfig, UserspaceProxier, VipMode};

use super::{Outcome, Scope};
use crate::config::{ProxyConfig, ProxyMode};
use crate::duration::parse_go_duration;
use crate::metrics::Metrics;

fn duration(s: &str) -> Result<Duration, String> {
    parse_go_duration(s).map_err(|e| e.to_string())
}

/// Flags of `--proxy-mode=userspace` (ours; upstream removed the mode in 1.26).
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct UserspaceFlags {
    /// Userspace mode: how a new connection picks an endpoint:
    /// round-robin or least-connections.
    #[arg(long, default_value = "round-robin", value_parser = ["round-robin", "least-connections"])]
    pub userspace_balancer: String,
    /// Userspace mode: how Service IPs are taken over: loopback (add them to
    /// lo, needs CAP_NET_ADMIN), none (NodePorts and already-local IPs only),
    /// auto (loopback when permitted).
    #[arg(long, default_value = "auto", value_parser = ["auto", "loopback", "none"])]
    pub userspace_vip_mode: String,
    /// Userspace mode: TCP connect timeout per endpoint before the next is tried.
    #[arg(long, default_value = "1s", value_parser = duration)]
    pub userspace_connect_timeout: Duration,
    /// Userspace mode: close TCP connections idle this long (0: never).
    #[arg(long, default_value = "1h", value_parser = duration)]
    pub userspace_tcp_idle_timeout: Duration,
    /// Userspace mode: forget UDP flows idle this long (upstream's --udp-timeout).
    #[arg(long, alias = "udp-timeout", default_value = "30s", value_parser = duration)]
    pub userspace_udp_idle_timeout: Duration,
    /// Userspace mode: connections to a removed endpoint are closed this long after.
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub userspace_grace_period: Duration,
    /// Userspace mode: copy TCP with splice(2) (zero copy) instead of a buffer.
    #[arg(long, num_args = 0..=1, default_value = "true", default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub userspace_splice: bool,
}

impl Default for UserspaceFlags {
    fn default() -> Self {
        UserspaceFlags {
            userspace_balancer: "round-robin".into(),
            userspace_vip_mode: "auto".into(),
            userspace_connect_timeout: Duration::from_secs(1),
            userspace_tcp_idle_timeout: Duration::from_secs(3600),
            userspace_udp_idle_timeout: Duration::from_secs(30),
            userspace_grace_period: Duration::from_secs(30),
            userspace_splice: true,
        }
    }
}

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
