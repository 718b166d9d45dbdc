//! Scratch resources of the binary-level tests, each removed on drop, also
//! when the test fails: a network namespace, a file, a child process; and
//! our nftables table as a namespace holds it.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command};

/// A network namespace (created by the test), deleted on drop.
pub struct Ns(pub String);

impl Ns {
    /// Creates namespace `name` with `lo` up.
    pub fn create(name: &str) -> Ns {
        let ok = |args: &[&str]| {
            Command::new("ip")
                .args(args)
                .status()
                .is_ok_and(|s| s.success())
        };
        assert!(ok(&["netns", "add", name]), "ip netns add {name}");
        let ns = Ns(name.to_string());
        assert!(
            ok(&["-n", name, "link", "set", "lo", "up"]),
            "lo up in {name}"
        );
        ns
    }
}
impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// A temporary file removed on drop.
pub struct TempFile(pub PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A child process killed and reaped on drop.
pub struct Proc(pub Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `nft list table ip kube-proxy-rs` in namespace `ns` (empty when absent).
pub fn ruleset(ns: &str) -> String {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "nft",
            "list",
            "table",
            "ip",
            "kube-proxy-rs",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}
