//! Scratch resources of the binary-level tests, each removed on drop, also
//! when the test fails: a network namespace, a file or directory, a child
//! process; and our nftables table as a namespace holds it.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

/// A network namespace (created by the test), deleted on drop.
pub struct Ns(pub String);

impl Ns {
    /// Creates namespace `name` with its loopback up.
    pub fn create(name: &str) -> Ns {
        let ok = Command::new("ip")
            .args(["netns", "add", name])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "ip netns add {name} failed");
        let ns = Ns(name.to_string());
        let up = Command::new("ip")
            .args(["-n", name, "link", "set", "lo", "up"])
            .status()
            .is_ok_and(|s| s.success());
        assert!(up, "setting lo up in {name} failed");
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

/// A temporary directory removed with what it holds on drop.
pub struct TempDir(pub PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
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

/// One HTTP/1.0 GET to `addr` (call inside the namespace): status code and body.
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, body.to_string()))
}
