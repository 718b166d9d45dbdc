//! Kernel settings under `/proc/sys` (the `net.*` ones belong to the network
//! namespace of the process), shared by the modes' and the binary's host
//! setup.
//!
//! [`Sysctl::ensure`] reads before it writes, as upstream's EnsureSysctl: a
//! value already in place (set by `--init-only` in a privileged init
//! container, say) needs no write, so a later start without a writable
//! `/proc/sys` finds nothing to do.

use std::io;
use std::path::PathBuf;

/// A sysctl that could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct SysctlError {
    /// What was attempted, naming the sysctl.
    pub what: String,
    #[source]
    pub source: io::Error,
}

/// Reads and writes sysctls by path under a root (`/proc/sys`; tests use a
/// directory of their own). Names are paths: `net/ipv4/conf/all/route_localnet`.
#[derive(Clone, Debug)]
pub struct Sysctl {
    root: PathBuf,
}

impl Default for Sysctl {
    fn default() -> Self {
        Sysctl::with_root("/proc/sys")
    }
}

impl Sysctl {
    /// The process's own `/proc/sys`.
    pub fn new() -> Self {
        Sysctl::default()
    }

    /// Sysctls as files under `root`.
    pub fn with_root(root: impl Into<PathBuf>) -> Self {
        Sysctl { root: root.into() }
    }

    /// The integer value of `name`.
    pub fn get(&self, name: &str) -> Result<i64, SysctlError> {
        let text = std::fs::read_to_string(self.root.join(name)).map_err(|source| SysctlError {
            what: format!("reading sysctl {name}"),
            source,
        })?;
        text.trim().parse().map_err(|_| SysctlError {
            what: format!("reading sysctl {name}"),
            source: io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{:?} is not an integer", text.trim()),
            ),
        })
    }

    /// Writes `value` to `name`.
    pub fn set(&self, name: &str, value: i64) -> Result<(), SysctlError> {
        std::fs::write(self.root.join(name), value.to_string()).map_err(|source| SysctlError {
            what: format!("setting sysctl {name} to {value}"),
            source,
        })
    }

    /// Sets `name` to `value` unless it already has it (an unreadable value
    /// counts as different). `Ok(true)` when it was written.
    pub fn ensure(&self, name: &str, value: i64) -> Result<bool, SysctlError> {
        if self.get(name).ok() == Some(value) {
            return Ok(false);
        }
        self.set(name, value)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ensure_writes_only_what_differs() {
        let root = std::env::temp_dir().join(format!("kp-sysctl-{}", std::process::id()));
        let dir = root.join("net/ipv4/conf/all");
        std::fs::create_dir_all(&dir).unwrap();
        let s = Sysctl::with_root(&root);
        let name = "net/ipv4/conf/all/route_localnet";
        std::fs::write(dir.join("route_localnet"), "0\n").unwrap();
        assert_eq!(s.get(name).unwrap(), 0);
        assert!(s.ensure(name, 1).unwrap());
        assert_eq!(s.get(name).unwrap(), 1);
        // Already in place: not written.
        assert!(!s.ensure(name, 1).unwrap());
        // Missing: the write fails, naming the sysctl.
        let err = s.ensure("nope/x", 1).unwrap_err();
        assert!(
            err.to_string().contains("setting sysctl nope/x to 1"),
            "{err}"
        );
        std::fs::write(root.join("net/text"), "abc").unwrap();
        assert!(s.get("net/text").is_err());
        let _ = std::fs::remove_dir_all(&root);
    }
}
