//! Shared by kp-bench's tests that run real proxies.

use std::path::PathBuf;

use kp_testkit::REQUIRE_ENV;

/// kube-proxy-rs: `KUBE_PROXY_RS_BIN`, else the workspace's release or
/// debug build. Without one the test `what` is skipped loudly, or fails
/// under `KP_REQUIRE_REAL_APISERVER=1`.
pub fn ours(what: &str) -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let found = std::env::var_os("KUBE_PROXY_RS_BIN")
        .map(PathBuf::from)
        .into_iter()
        .chain(["release", "debug"].map(|p| root.join("target").join(p).join("kube-proxy-rs")))
        .find(|p| p.is_file());
    if found.is_none() {
        let why = "no kube-proxy-rs binary (KUBE_PROXY_RS_BIN, target/release or target/debug): \
                   cargo build -p kube-proxy-rs";
        assert!(
            std::env::var(REQUIRE_ENV).as_deref() != Ok("1"),
            "{what}: {REQUIRE_ENV}=1 and {why}"
        );
        eprintln!("\n!!! SKIPPED the {what}: {why}\n");
    }
    found
}
