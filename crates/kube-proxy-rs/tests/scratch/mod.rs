//! Scratch resources of the binary-level tests, each removed on drop, also
//! when the test fails: a network namespace, a file or directory, a child
//! process; and our nftables table as a namespace holds it.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use kp_netlab::ScratchNs;

/// A network namespace (created by the test, with its loopback up),
/// deleted on drop: kp-netlab's guard, failing the test when it can't be made.
pub struct Ns(pub ScratchNs);

impl Ns {
    pub fn create(name: &str) -> Ns {
        Ns(ScratchNs::create(name).unwrap_or_else(|e| panic!("namespace {name}: {e}")))
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
