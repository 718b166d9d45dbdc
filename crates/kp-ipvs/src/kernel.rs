//! The startup check: IPVS mode refuses to start without IPVS (upstream
//! silently falls back to another mode; we tell the operator instead).

use std::process::Command;

use crate::ipvs::IpvsClient;

fn modprobe(module: &str) -> bool {
    Command::new("modprobe")
        .args(["-q", module])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn module_present(module: &str) -> bool {
    let loaded = std::fs::read_to_string("/proc/modules").unwrap_or_default();
    if loaded.lines().any(|l| l.split(' ').next() == Some(module)) {
        return true;
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let builtin =
        std::fs::read_to_string(format!("/lib/modules/{}/modules.builtin", release.trim()))
            .unwrap_or_default();
    builtin
        .lines()
        .any(|l| l.ends_with(&format!("/{module}.ko")))
}

/// Checks that the kernel has IPVS (loading ip_vs if needed), the scheduler
/// module, and that the `ipset` program is there. The error says what is
/// missing and what to do.
pub fn check_kernel(scheduler: &str) -> Result<(), String> {
    let scheduler = if scheduler.is_empty() {
        "rr"
    } else {
        scheduler
    };
    if IpvsClient::open().is_err() {
        modprobe("ip_vs");
    }
    if let Err(e) = IpvsClient::open() {
        return Err(format!(
            "IPVS proxy mode needs the ip_vs kernel module, and this kernel does not \
             provide it ({e}; `modprobe ip_vs` failed or the kernel was built without \
             CONFIG_IP_VS). Load ip_vs, ip_vs_{scheduler} and nf_conntrack, or run \
             with --proxy-mode=nftables or --proxy-mode=iptables"
        ));
    }
    let sched = format!("ip_vs_{scheduler}");
    if !module_present(&sched) && !modprobe(&sched) {
        return Err(format!(
            "IPVS scheduler {scheduler:?} needs the {sched} kernel module, which is not \
             loaded and could not be loaded (`modprobe {sched}`); pick another \
             --ipvs-scheduler or install the module"
        ));
    }
    match Command::new("ipset").arg("version").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err(
            "IPVS proxy mode needs the `ipset` program (package ipset); it is \
                  missing or does not run"
                .into(),
        ),
    }
}

/// What IPVS mode does with `net.ipv4.vs.conn_reuse_mode` on a kernel,
/// upstream's rule (pkg/proxy/ipvs NewProxier).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnReuseMode {
    /// Before 4.1 the sysctl does not exist.
    Unsupported,
    /// 4.1 to 5.8: set to 0. With the kernel's default (1) and
    /// `net.ipv4.vs.conntrack=1`, a SYN that reuses the client port of a
    /// connection IPVS still remembers (TIME_WAIT) is dropped, so the client
    /// waits a one-second SYN retransmission (kubernetes#81775).
    Disable,
    /// 5.9 and later: left as it is; the kernel no longer drops those SYNs
    /// (kubernetes#93297).
    LeaveAsIs,
}

/// The first two numbers of a kernel release ("6.1.0-56-amd64" -> (6, 1)).
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(str::parse::<u32>);
    let major = parts.next()?.ok()?;
    let minor = parts.next()?.ok()?;
    Some((major, minor))
}

/// [`ConnReuseMode`] for a kernel release string (`uname -r`,
/// /proc/sys/kernel/osrelease); None when it cannot be parsed (the sysctl
/// is then left alone).
pub fn conn_reuse_mode(release: &str) -> Option<ConnReuseMode> {
    let v = kernel_version(release)?;
    Some(if v < (4, 1) {
        ConnReuseMode::Unsupported
    } else if v < (5, 9) {
        ConnReuseMode::Disable
    } else {
        ConnReuseMode::LeaveAsIs
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_parse() {
        assert_eq!(kernel_version("6.1.0-56-amd64"), Some((6, 1)));
        assert_eq!(kernel_version("5.4.0-150-generic\n"), Some((5, 4)));
        assert_eq!(kernel_version("4.19.325"), Some((4, 19)));
        assert_eq!(kernel_version("5.10"), Some((5, 10)));
        assert_eq!(kernel_version("6"), None);
        assert_eq!(kernel_version(""), None);
        assert_eq!(kernel_version("linux"), None);
    }

    #[test]
    fn conn_reuse_mode_follows_upstream() {
        use ConnReuseMode::*;
        assert_eq!(conn_reuse_mode("3.10.0-1160.el7.x86_64"), Some(Unsupported));
        assert_eq!(conn_reuse_mode("4.0.9"), Some(Unsupported));
        assert_eq!(conn_reuse_mode("4.1.0"), Some(Disable));
        assert_eq!(conn_reuse_mode("4.19.0-27-amd64"), Some(Disable));
        assert_eq!(conn_reuse_mode("5.4.0-150-generic"), Some(Disable));
        assert_eq!(conn_reuse_mode("5.8.18"), Some(Disable));
        // 5.9 fixed the dropped SYN; 5.10 sorts after 5.9 (not as text).
        assert_eq!(conn_reuse_mode("5.9.0"), Some(LeaveAsIs));
        assert_eq!(conn_reuse_mode("5.10.0-30-amd64"), Some(LeaveAsIs));
        assert_eq!(conn_reuse_mode("6.1.0-56-amd64"), Some(LeaveAsIs));
        assert_eq!(conn_reuse_mode("garbage"), None);
    }
}
