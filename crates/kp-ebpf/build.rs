//! Compiles the BPF programs' entry files, one per attach point as Cilium
//! lays its datapath out (bpf/sock.c for the cgroup socket hooks, bpf/tc.c,
//! bpf/xdp.c; the code by concern under bpf/lib/), to BPF objects with clang
//! (Debian's `clang`, which test.sh and demo.sh install). Without clang the crate still builds,
//! with an empty object: the mode then refuses to start and says why, and
//! every other mode is unaffected.

// A build script's panic is a build error with its message: expect() is the
// way to report one.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=bpf");
    println!("cargo:rerun-if-env-changed=KP_CLANG");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("sock.o");
    let clang = std::env::var("KP_CLANG").unwrap_or_else(|_| "clang".to_string());
    let arch = match std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("x86_64") => "x86_64-linux-gnu",
        Ok("aarch64") => "aarch64-linux-gnu",
        _ => "",
    };
    for (src, file, defines) in [
        ("bpf/sock.c", "sock.o", &[][..]),
        ("bpf/sock.c", "sock-variant.o", &["-DKP_TEST_VARIANT"][..]),
        // Without LLVM's sinking of common code: it merges two branches'
        // constant offsets into packet pointer plus register, which the
        // verifier refuses a proxy without CAP_PERFMON (the DaemonSet's).
        (
            "bpf/tc.c",
            "tc.o",
            &["-mllvm", "-simplifycfg-sink-common=false"][..],
        ),
        (
            "bpf/xdp.c",
            "xdp.o",
            &["-mllvm", "-simplifycfg-sink-common=false"][..],
        ),
        ("bpf/test/xdp_pass.c", "xdp_pass.o", &[][..]),
    ] {
        let out = out.with_file_name(file);
        let mut cmd = Command::new(&clang);
        cmd.args([
            "-O2", "-g", "-Wall", "-Werror", "-target", "bpf", "-c", src, "-o",
        ])
        .arg(&out)
        .args(defines);
        if !arch.is_empty() {
            // linux/bpf.h includes asm/types.h, which Debian keeps per architecture.
            cmd.arg(format!("-I/usr/include/{arch}"));
        }
        match cmd.status() {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("{clang} failed on {src} ({s})"),
            Err(e) => {
                println!("cargo:warning=kp-ebpf: {clang} not found ({e}); --socket-lb will refuse to start (apt-get install clang)");
                std::fs::write(&out, b"").expect("writing the empty BPF object");
            }
        }
    }
}
