//! The conformance suite in IPVS mode.
//!
//! The cases need a kernel with IPVS. Where the running kernel has it (a real
//! node, or inside the test VM) they run directly. Where it has not (the
//! development and CI machines: CONFIG_IP_VS is off), each case prints why it
//! skips, and `vm_ipvs_conformance` boots Debian's packaged kernel (which has
//! ip_vs) under qemu with this host's root filesystem mounted read-only over
//! 9p, and runs this same test binary inside it. Without qemu the VM test
//! skips with a printed reason. docs/ipvs.md says how to run the cases on a
//! real node.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

#[macro_use]
mod conformance;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Set inside the VM: a missing IPVS is then a failure, not a skip.
const REQUIRE_ENV: &str = "KP_IPVS_REQUIRE";
/// Upper bound for the whole VM run (boot + 16 cases).
const VM_TIMEOUT: Duration = Duration::from_secs(25 * 60);

/// Whether this kernel has IPVS (loading ip_vs if it can).
fn kernel_has_ipvs() -> bool {
    if Path::new("/proc/net/ip_vs").exists() {
        return true;
    }
    let _ = Command::new("modprobe")
        .args(["-q", "ip_vs"])
        .stderr(Stdio::null())
        .status();
    Path::new("/proc/net/ip_vs").exists()
}

fn ipvs_guard() -> bool {
    if kernel_has_ipvs() {
        return true;
    }
    assert!(
        std::env::var_os(REQUIRE_ENV).is_none(),
        "{REQUIRE_ENV} is set but this kernel has no IPVS"
    );
    eprintln!(
        "skipped: this kernel has no IPVS (CONFIG_IP_VS off); vm_ipvs_conformance runs \
         this case in a VM"
    );
    false
}

conformance_suite!("ipvs", ipvs_guard);

/// Without IPVS in the kernel, --proxy-mode=ipvs refuses to start and says why.
#[test]
fn refuses_to_start_without_ipvs() {
    if kernel_has_ipvs() {
        eprintln!("skipped: this kernel has IPVS; the refusal needs a kernel without it");
        return;
    }
    let dir = std::env::temp_dir().join(format!("kp-ipvs-refuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // In a namespace of its own, with the machine-wide conntrack table left
    // alone: a start must never reach the host's settings.
    let out = Command::new("unshare")
        .arg("-n")
        .arg(env!("CARGO_BIN_EXE_kube-proxy-rs"))
        .args([
            "--proxy-mode=ipvs",
            "--conntrack-max-per-core=0",
            &format!("--manifests={}", dir.display()),
            "--hostname-override=node1",
            "--healthz-bind-address=",
            "--metrics-bind-address=",
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started without IPVS: {err}");
    assert!(
        err.contains("needs the ip_vs kernel module") && err.contains("--proxy-mode=nftables"),
        "unclear refusal: {err}"
    );
}

/// The newest Debian kernel installed under /boot whose modules include ip_vs.
fn debian_kernel() -> Option<(PathBuf, String)> {
    let mut found: Vec<(PathBuf, String)> = std::fs::read_dir("/boot")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let ver = name.strip_prefix("vmlinuz-")?.to_string();
            let ipvs = format!("/lib/modules/{ver}/kernel/net/netfilter/ipvs/ip_vs.ko");
            Path::new(&ipvs).exists().then(|| (e.path(), ver))
        })
        .collect();
    found.sort();
    found.pop()
}

fn modinfo(ver: &str, field: &str, module: &str) -> String {
    let out = Command::new("modinfo")
        .args(["-k", ver, "-F", field, module])
        .output()
        .expect("running modinfo (package kmod)");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `modules` and their dependencies, dependencies first.
fn module_closure(ver: &str, modules: &[&str]) -> Vec<(String, PathBuf)> {
    fn visit(ver: &str, m: &str, out: &mut Vec<(String, PathBuf)>) {
        let m = m.replace('-', "_");
        if out.iter().any(|(n, _)| *n == m) {
            return;
        }
        let file = modinfo(ver, "filename", &m);
        if file.is_empty() || file == "(builtin)" {
            return;
        }
        for d in modinfo(ver, "depends", &m)
            .split(',')
            .filter(|d| !d.is_empty())
        {
            visit(ver, d, out);
        }
        out.push((m, PathBuf::from(file)));
    }
    let mut out = Vec::new();
    for m in modules {
        visit(ver, m, &mut out);
    }
    out
}

/// Writes the initramfs (newc cpio): busybox, the modules 9p needs, an init
/// that mounts the host root over 9p read-only and runs `script` chrooted
/// into it, and a modprobe that loads further modules from the host's tree.
fn build_initramfs(dir: &Path, ver: &str, script: &str, keep: &[PathBuf]) -> PathBuf {
    let root = dir.join("root");
    for d in ["bin", "sbin", "proc", "sys", "dev", "host", "mods"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox"))
        .expect("/bin/busybox missing (package busybox-static)");
    let mods = module_closure(ver, &["virtio_pci", "9pnet_virtio", "9p"]);
    let mut order = String::new();
    for (name, file) in &mods {
        std::fs::copy(file, root.join("mods").join(format!("{name}.ko"))).unwrap();
        order.push_str(name);
        order.push('\n');
    }
    std::fs::write(root.join("mods/order"), order).unwrap();
    let init = format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /mods/order); do insmod /mods/$m.ko || echo "KP-VM: insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /host || echo "KP-VM: 9p mount failed"
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev
mount -t tmpfs run /host/run
mkdir -p /host/run/kp-hosttmp
mount -o bind /host/tmp /host/run/kp-hosttmp
mount -t tmpfs tmp /host/tmp
{keep_tmp}mount -t tmpfs vartmp /host/var/tmp
# Modules the kernel asks for are loaded from the host's tree.
printf '#!/bin/sh\nexec /bin/chroot /host /sbin/modprobe "$@"\n' > /sbin/modprobe
chmod 755 /sbin/modprobe
echo /sbin/modprobe > /proc/sys/kernel/modprobe
chroot /host /bin/sh -c 'ip link set lo up; {script}'
echo "KP-VM-RESULT rc=$?"
sync
poweroff -f
"#,
        keep_tmp = keep_tmp_lines(keep)
    );
    let init_path = root.join("init");
    std::fs::write(&init_path, init).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&init_path, std::fs::Permissions::from_mode(0o755)).unwrap();
    let img = dir.join("initramfs.cpio");
    let st = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cd {} && find . | cpio -o -H newc --quiet > {}",
            root.display(),
            img.display()
        ))
        .status()
        .unwrap();
    assert!(st.success(), "building the initramfs (cpio)");
    img
}

/// Init lines that put the host's `/tmp/TOP` directories holding `paths`
/// back over the VM's fresh (writable) /tmp: a checkout and its test binaries
/// under /tmp (a CI clone, say) stay visible, read-only, at the same paths.
fn keep_tmp_lines(paths: &[PathBuf]) -> String {
    let tops: std::collections::BTreeSet<String> = paths
        .iter()
        .filter_map(|p| p.strip_prefix("/tmp").ok())
        .filter_map(|rest| rest.components().next())
        .filter_map(|c| c.as_os_str().to_str().map(str::to_string))
        .collect();
    tops.iter()
        .map(|t| format!("mkdir -p '/host/tmp/{t}'\nmount -o bind '/host/run/kp-hosttmp/{t}' '/host/tmp/{t}'\n"))
        .collect()
}

#[test]
fn keeps_tmp_checkouts_visible_in_the_vm() {
    let lines = keep_tmp_lines(&[
        PathBuf::from("/tmp/ci/main"),
        PathBuf::from("/tmp/ci/main/target/debug/deps/conformance_ipvs-1"),
        PathBuf::from("/work/main"),
    ]);
    assert_eq!(
        lines,
        "mkdir -p '/host/tmp/ci'\nmount -o bind '/host/run/kp-hosttmp/ci' '/host/tmp/ci'\n"
    );
    assert_eq!(keep_tmp_lines(&[PathBuf::from("/work/main")]), "");
}

/// Set by CI (.ci/run): the VM must run, so a missing part is a failure.
const REQUIRE_VM_ENV: &str = "KP_REQUIRE_IPVS_VM";

/// The VM cannot run here: fail under KP_REQUIRE_IPVS_VM, else say so loudly.
fn vm_unavailable(why: &str) {
    assert!(
        std::env::var_os(REQUIRE_VM_ENV).is_none(),
        "{REQUIRE_VM_ENV} is set but the IPVS test VM cannot run: {why}"
    );
    eprintln!(
        "\n==================== SKIPPED: IPVS conformance VM ====================\n\
         {why}.\nThe 16 IPVS-mode cases did NOT run on this machine; they need a kernel \
         with ip_vs (docs/ipvs.md).\n=====================================================================\n"
    );
}

/// Boots the VM and runs every IPVS conformance case of this test binary
/// inside it.
#[test]
fn vm_ipvs_conformance() {
    if std::env::var_os(REQUIRE_ENV).is_some() {
        return; // Already inside the VM.
    }
    if kernel_has_ipvs() {
        eprintln!("skipped: this kernel has IPVS; the c* cases run directly here");
        return;
    }
    let qemu_ok = Command::new("qemu-system-x86_64")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !qemu_ok {
        vm_unavailable("qemu-system-x86_64 is missing (test.sh installs Debian's qemu-system-x86)");
        return;
    }
    let Some((kernel, ver)) = debian_kernel() else {
        vm_unavailable(
            "no Debian kernel with ip_vs under /boot (test.sh installs linux-image-amd64, \
             which Debian has and Ubuntu has not)",
        );
        return;
    };
    let dir = std::env::temp_dir().join(format!("kp-ipvs-vm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(dir.clone());
    let exe = std::env::current_exe().unwrap();
    let cwd = std::env::current_dir().unwrap();
    // KP_IPVS_VM_FILTER narrows the cases (e.g. "c01"), for debugging.
    let filter = std::env::var("KP_IPVS_VM_FILTER").ok();
    // One case at a time: under emulation two in parallel starve each
    // other past the cases' 2 s connection timeouts.
    let script = format!(
        "cd {cwd} && PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
         {REQUIRE_ENV}=1 KP_CONFORMANCE_SYNC_WAIT=120 RUST_BACKTRACE=1 {exe} --color never --test-threads=1 {filter}",
        // c01 ... c15.
        filter = filter.as_deref().unwrap_or("c0 c1"),
        cwd = cwd.display(),
        exe = exe.display()
    );
    // KP_IPVS_VM_SCRIPT replaces the command run in the VM (debugging).
    let script = std::env::var("KP_IPVS_VM_SCRIPT").unwrap_or(script);
    let initrd = build_initramfs(&dir, &ver, &script, &[cwd.clone(), exe.clone()]);
    // The accelerator: TCG by default. On this project's machines /dev/kvm
    // is nested KVM without EPT, and its shadow paging made the Debian
    // kernel take minutes to boot where TCG takes 20 s (docs/ipvs.md);
    // KP_IPVS_VM_ACCEL=kvm picks KVM where it is fast.
    let accel = match std::env::var("KP_IPVS_VM_ACCEL").as_deref() {
        Ok("kvm") => "kvm",
        _ => "tcg,thread=multi",
    };
    let cpu = if accel == "kvm" { "host" } else { "max" };
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-accel", accel, "-machine", "q35", "-cpu", cpu, "-smp", "2", "-m", "2048",
        ])
        .args([
            "-nographic",
            "-no-reboot",
            "-nic",
            "none",
            "-monitor",
            "none",
        ])
        .args(["-serial", "stdio"])
        .arg("-kernel")
        .arg(&kernel)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-append", "console=ttyS0 panic=-1 quiet rdinit=/init"])
        .args([
            "-virtfs",
            "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting qemu-system-x86_64 (package qemu-system-x86; test.sh installs it)");
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    // Echo as it comes: the run is long and CI logs show progress.
                    eprint!("{}", String::from_utf8_lossy(&buf[..n]));
                    all.extend_from_slice(&buf[..n]);
                }
            }
        }
        String::from_utf8_lossy(&all).into_owned()
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if t0.elapsed() > VM_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let console = reader.join().unwrap();
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    assert!(
        status.is_some(),
        "the IPVS VM did not finish within {VM_TIMEOUT:?}"
    );
    let rc = console
        .lines()
        .find_map(|l| l.trim().strip_prefix("KP-VM-RESULT rc="))
        .unwrap_or_else(|| panic!("the VM gave no result (qemu: {status:?}, {stderr})"));
    assert_eq!(
        rc.trim(),
        "0",
        "IPVS conformance cases failed in the VM (console above)"
    );
    // The cases really ran (not skipped) inside the VM.
    assert!(
        filter.is_some() || console.contains("16 passed; 0 failed"),
        "expected 16 IPVS cases to pass in the VM"
    );
}
