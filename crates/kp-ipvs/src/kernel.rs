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
