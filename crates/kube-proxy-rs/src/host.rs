//! The conntrack settings (`--conntrack-*`, `conntrack.*`) as upstream's
//! setupConntrack (cmd/kube-proxy/app/server_linux.go): applied at every
//! start, and by `--init-only` before the modes' own host settings (see
//! docs/migrate-from-kube-proxy.md).

use std::net::IpAddr;
use std::path::Path;

use anyhow::Context;

use kp_netlink::{Sysctl, SysctlError};

use crate::config::{ConntrackSettings, ProxyConfig};

/// The module parameter sizing the conntrack hash table (global: only the
/// initial network namespace may write it).
pub const HASHSIZE: &str = "/sys/module/nf_conntrack/parameters/hashsize";
/// Online CPUs of the node, as upstream counts them (not the process's
/// affinity: nf_conntrack_max is node-wide).
pub const CPUS_ONLINE: &str = "/sys/devices/system/cpu/online";
/// Upstream caps the scaled maximum so that large machines do not reserve
/// memory for millions of entries.
const MAX_LIMIT: u64 = 1_048_576;

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(transparent)]
    Sysctl(#[from] SysctlError),
    #[error("{what} {path}: {source}")]
    Hashsize {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// nf_conntrack_max for `s` on a node with `cpus` CPUs; 0 leaves it alone
/// (`--conntrack-max-per-core=0`).
pub fn conntrack_max(s: &ConntrackSettings, cpus: u64) -> u64 {
    if s.max_per_core <= 0 {
        return 0;
    }
    let scaled = s.max_per_core as u64 * cpus;
    if scaled > MAX_LIMIT {
        return MAX_LIMIT;
    }
    scaled.max(s.min.max(0) as u64)
}

/// The conntrack sysctls besides the maximum (paths under /proc/sys, values);
/// a zero timeout or `tcp_be_liberal: false` leaves the setting alone.
pub fn conntrack_sysctls(s: &ConntrackSettings) -> Vec<(&'static str, i64)> {
    let secs = |d: std::time::Duration| i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
    let mut out = Vec::new();
    for (name, d) in [
        (
            "net/netfilter/nf_conntrack_tcp_timeout_established",
            s.tcp_established_timeout,
        ),
        (
            "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
            s.tcp_close_wait_timeout,
        ),
    ] {
        if secs(d) > 0 {
            out.push((name, secs(d)));
        }
    }
    if s.tcp_be_liberal {
        out.push(("net/netfilter/nf_conntrack_tcp_be_liberal", 1));
    }
    for (name, d) in [
        ("net/netfilter/nf_conntrack_udp_timeout", s.udp_timeout),
        (
            "net/netfilter/nf_conntrack_udp_timeout_stream",
            s.udp_stream_timeout,
        ),
    ] {
        if secs(d) > 0 {
            out.push((name, secs(d)));
        }
    }
    out
}

/// Counts the CPUs in a sysfs CPU list ("0-3,8,10-11").
pub fn count_cpu_list(list: &str) -> Option<u64> {
    let mut n = 0u64;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u64, u64) = (a.parse().ok()?, b.parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => {
                part.parse::<u64>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

/// The node's online CPUs, or the ones this process may use when sysfs does
/// not tell.
pub fn node_cpus() -> u64 {
    std::fs::read_to_string(CPUS_ONLINE)
        .ok()
        .and_then(|t| count_cpu_list(&t))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u64))
}

/// What [`apply_conntrack`] did: the settings it changed ("name=value") and
/// the ones the host refused.
#[derive(Debug, Default)]
pub struct Applied {
    pub changed: Vec<String>,
    pub refused: Vec<HostError>,
}

/// Applies `s` as upstream's setupConntrack does: nf_conntrack_max and the
/// other sysctls set where they differ, the hash table grown to a quarter of
/// the maximum when smaller. A refused setting does not stop the others;
/// every change is logged.
pub fn apply_conntrack(
    s: &ConntrackSettings,
    sysctl: &Sysctl,
    hashsize: &Path,
    cpus: u64,
) -> Applied {
    let mut out = Applied::default();
    let note = |out: &mut Applied, name: &str, value: i64| {
        tracing::info!(sysctl = name, value, "set");
        out.changed.push(format!("{name}={value}"));
    };
    let max = conntrack_max(s, cpus);
    if max > 0 {
        let max = i64::try_from(max).unwrap_or(i64::MAX);
        const MAX: &str = "net/netfilter/nf_conntrack_max";
        match sysctl.ensure(MAX, max) {
            Ok(true) => note(&mut out, MAX, max),
            Ok(false) => {}
            Err(e) => out.refused.push(e.into()),
        }
        match grow_hashsize(hashsize, max / 4) {
            Ok(Some(v)) => note(&mut out, &hashsize.display().to_string(), v),
            Ok(None) => {}
            Err(e) => out.refused.push(e),
        }
    }
    for (name, value) in conntrack_sysctls(s) {
        match sysctl.ensure(name, value) {
            Ok(true) => note(&mut out, name, value),
            Ok(false) => {}
            Err(e) => out.refused.push(e.into()),
        }
    }
    out
}

/// The conntrack hash table raised to `want` buckets when smaller (the
/// module parameter only the initial network namespace may write, so it is
/// written only when needed); the value written, if any.
fn grow_hashsize(hashsize: &Path, want: i64) -> Result<Option<i64>, HostError> {
    let path = hashsize.display().to_string();
    let text = std::fs::read_to_string(hashsize).map_err(|source| HostError::Hashsize {
        what: "reading",
        path: path.clone(),
        source,
    })?;
    let cur: i64 = text.trim().parse().map_err(|_| HostError::Hashsize {
        what: "reading",
        path: path.clone(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{:?} is not an integer", text.trim()),
        ),
    })?;
    if cur >= want {
        return Ok(None);
    }
    std::fs::write(hashsize, want.to_string()).map_err(|source| HostError::Hashsize {
        what: "writing",
        path,
        source,
    })?;
    Ok(Some(want))
}

/// At every start, as upstream's process: the conntrack settings. Where the
/// host refuses one (a read-only /proc/sys in a least-privilege container,
/// whose init container set them; a namespace that may not write the
/// machine-wide maximum), it is said once and the proxy goes on.
pub fn conntrack_at_start(cfg: &ProxyConfig) {
    let sysctl = kp_netlink::Sysctl::new();
    let a = apply_conntrack(&cfg.conntrack, &sysctl, Path::new(HASHSIZE), node_cpus());
    for e in &a.refused {
        tracing::warn!(
            error = %e,
            "could not apply a conntrack setting (--conntrack-*); going on without it"
        );
    }
}

/// --init-only, as upstream: other modes' leftovers go (its Run cleans up
/// before anything else), the conntrack sysctls are set, then the mode's own
/// host settings (iptables: route_localnet; ipvs: its sysctls and timeouts);
/// failures are fatal. Values already in place are not rewritten, so the
/// main container after it needs no writable /proc/sys for them. Unlike
/// upstream, no API access: nothing here needs the Node.
pub fn init_only(cfg: &ProxyConfig) -> anyhow::Result<()> {
    tracing::info!(mode = cfg.mode.as_str(), "--init-only: setting up the host");
    crate::modes::remove_leftovers(crate::modes::Scope::StartingIn(cfg.mode), cfg)
        .log("removing other modes' leftovers");
    let sysctl = kp_netlink::Sysctl::new();
    let applied = apply_conntrack(&cfg.conntrack, &sysctl, Path::new(HASHSIZE), node_cpus());
    if let Some(e) = applied.refused.into_iter().next() {
        return Err(e).context("setting the conntrack sysctls");
    }
    let mut changed = applied.changed;
    changed.extend(crate::modes::init_host(cfg, &sysctl)?);
    tracing::info!(
        changed = ?changed,
        "system initialized and --init-only specified; exiting"
    );
    Ok(())
}

/// This host's addresses (no loopback, no link-local), for NodePorts and
/// health-check ports when the Node object does not tell.
pub fn local_addresses() -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = kp_netlink::ifaddr::interface_addresses()
        .into_iter()
        .map(|(ip, _)| ip)
        .collect();
    out.retain(|ip| match ip {
        IpAddr::V4(v) => !v.is_loopback() && !v.is_link_local() && !v.is_unspecified(),
        IpAddr::V6(v) => {
            !v.is_loopback() && !v.is_unspecified() && (v.segments()[0] & 0xffc0) != 0xfe80
        }
    });
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn settings() -> ConntrackSettings {
        // Upstream's defaults.
        ConntrackSettings {
            max_per_core: 32768,
            min: 131072,
            tcp_established_timeout: Duration::from_secs(86400),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }

    #[test]
    fn max_scales_with_cpus_between_min_and_the_cap() {
        let s = settings();
        assert_eq!(conntrack_max(&s, 2), 131072);
        assert_eq!(conntrack_max(&s, 8), 262144);
        assert_eq!(conntrack_max(&s, 64), 1_048_576);
        let off = ConntrackSettings {
            max_per_core: 0,
            ..settings()
        };
        assert_eq!(conntrack_max(&off, 8), 0);
    }

    #[test]
    fn zero_leaves_a_setting_alone() {
        assert_eq!(
            conntrack_sysctls(&settings()),
            [
                ("net/netfilter/nf_conntrack_tcp_timeout_established", 86400),
                ("net/netfilter/nf_conntrack_tcp_timeout_close_wait", 3600),
            ]
        );
        let all = ConntrackSettings {
            tcp_established_timeout: Duration::ZERO,
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(30),
            udp_stream_timeout: Duration::from_millis(120_500),
            ..settings()
        };
        assert_eq!(
            conntrack_sysctls(&all),
            [
                ("net/netfilter/nf_conntrack_tcp_timeout_close_wait", 3600),
                ("net/netfilter/nf_conntrack_tcp_be_liberal", 1),
                ("net/netfilter/nf_conntrack_udp_timeout", 30),
                ("net/netfilter/nf_conntrack_udp_timeout_stream", 120),
            ]
        );
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(count_cpu_list("0-3\n"), Some(4));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("0-3,8,10-11"), Some(7));
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list("x"), None);
    }

    #[test]
    fn apply_raises_max_and_sets_what_differs() {
        let root = std::env::temp_dir().join(format!("kp-host-{}", std::process::id()));
        let nf = root.join("net/netfilter");
        std::fs::create_dir_all(&nf).unwrap();
        for (f, v) in [
            ("nf_conntrack_max", "65536"),
            ("nf_conntrack_tcp_timeout_established", "432000"),
            ("nf_conntrack_tcp_timeout_close_wait", "3600"),
        ] {
            std::fs::write(nf.join(f), v).unwrap();
        }
        let hashsize = root.join("hashsize");
        std::fs::write(&hashsize, "16384\n").unwrap();
        let sysctl = Sysctl::with_root(&root);
        let got = apply_conntrack(&settings(), &sysctl, &hashsize, 2).changed;
        assert_eq!(
            got,
            [
                "net/netfilter/nf_conntrack_max=131072".to_string(),
                format!("{}=32768", hashsize.display()),
                "net/netfilter/nf_conntrack_tcp_timeout_established=86400".to_string(),
            ]
        );
        assert_eq!(
            sysctl.get("net/netfilter/nf_conntrack_max").unwrap(),
            131072
        );
        // A second run (the main container after --init-only) writes nothing.
        let again = apply_conntrack(&settings(), &sysctl, &hashsize, 2);
        assert!(again.changed.is_empty() && again.refused.is_empty());
        // A different maximum is set as upstream sets it, lower too; the
        // hash table only grows.
        std::fs::write(nf.join("nf_conntrack_max"), "262144").unwrap();
        std::fs::write(&hashsize, "65536\n").unwrap();
        assert_eq!(
            apply_conntrack(&settings(), &sysctl, &hashsize, 2).changed,
            ["net/netfilter/nf_conntrack_max=131072"]
        );
        assert_eq!(
            sysctl.get("net/netfilter/nf_conntrack_max").unwrap(),
            131072
        );
        // Without the hash table parameter the rest still applies, and the
        // refusal is reported.
        std::fs::remove_file(&hashsize).unwrap();
        std::fs::write(nf.join("nf_conntrack_tcp_timeout_close_wait"), "60").unwrap();
        let a = apply_conntrack(&settings(), &sysctl, &hashsize, 2);
        assert!(
            matches!(a.refused[..], [HostError::Hashsize { .. }]),
            "{:?}",
            a.refused
        );
        assert_eq!(
            a.changed,
            ["net/netfilter/nf_conntrack_tcp_timeout_close_wait=3600"]
        );
        let _ = std::fs::remove_dir_all(&root);
    }
}
