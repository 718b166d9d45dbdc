//! Scratch resources for tests, each removed on drop, also when the test
//! panics: a network namespace with its loopback up, a directory. Names are
//! made unique per process and per call, so tests running in parallel (and
//! a leftover of a killed run) never share one.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::netns::{check_ns_name, exec_in, ip, ip_in};
use crate::LabError;

static SEQ: AtomicU32 = AtomicU32::new(0);

/// `prefix-<pid>-<n>`, unique in this process; short enough for an
/// interface or namespace name when `prefix` is at most 6 bytes.
pub fn unique_name(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// A network namespace the test created, deleted on drop.
#[derive(Debug)]
pub struct ScratchNs {
    name: String,
}

impl ScratchNs {
    /// Creates namespace `name` (exactly that name) with `lo` up.
    pub fn create(name: &str) -> Result<ScratchNs, LabError> {
        check_ns_name(name)?;
        ip(&["netns", "add", name])?;
        let ns = ScratchNs {
            name: name.to_string(),
        };
        ip_in(name, &["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Creates a namespace named [`unique_name`]`(prefix)`.
    pub fn unique(prefix: &str) -> Result<ScratchNs, LabError> {
        ScratchNs::create(&unique_name(prefix))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `argv` in the namespace and returns its output, whatever its
    /// exit status.
    pub fn exec(&self, argv: &[&str]) -> Result<Output, LabError> {
        exec_in(&self.name, argv)
    }
}

/// The namespace reads as its name, where a test passes it to `ip netns
/// exec` or formats it.
impl std::ops::Deref for ScratchNs {
    type Target = str;
    fn deref(&self) -> &str {
        &self.name
    }
}

impl std::fmt::Display for ScratchNs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

impl Drop for ScratchNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// A directory the test created under the system's temporary directory,
/// removed with what it holds on drop.
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// Creates `$TMPDIR/<unique_name(prefix)>`.
    pub fn unique(prefix: &str) -> std::io::Result<ScratchDir> {
        let path = std::env::temp_dir().join(unique_name(prefix));
        std::fs::create_dir_all(&path)?;
        Ok(ScratchDir { path })
    }

    /// Takes charge of `path` (creating it if needed): it is removed on drop.
    pub fn at(path: impl Into<PathBuf>) -> std::io::Result<ScratchDir> {
        let path = path.into();
        std::fs::create_dir_all(&path)?;
        Ok(ScratchDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.path.join(p)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_dirs_go_on_drop() {
        assert_ne!(unique_name("kpt"), unique_name("kpt"));
        let d = ScratchDir::unique("kp-scratch-test").unwrap();
        let p = d.path().to_path_buf();
        std::fs::write(d.join("f"), "x").unwrap();
        assert!(p.join("f").exists());
        drop(d);
        assert!(!p.exists(), "{} left behind", p.display());
    }

    #[test]
    fn a_bad_namespace_name_is_refused_before_anything_runs() {
        assert!(ScratchNs::create("../etc").is_err());
    }
}
