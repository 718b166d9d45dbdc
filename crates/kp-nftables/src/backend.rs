//! How a transaction reaches the kernel.

use std::io::Write;
use std::process::{Command, Stdio};

use kp_model::{DataplaneError, IpFamily};

use crate::types::{family_kw, ElemKey, Transaction};

/// Applies one nft transaction atomically: the netlink backend encodes the
/// typed objects, the `nft` program gets them as nft text.
pub trait NftBackend: Send {
    /// Applies the transaction: all of it or none of it. Returns the bytes
    /// handed to the kernel or the tool (netlink batch, script).
    fn apply(&mut self, tx: &Transaction) -> Result<usize, DataplaneError>;

    /// [`Self::apply`], taking the transaction: a backend may free each
    /// operation once it has encoded it, so that a full sync's typed
    /// operations and its encoded batch are not both whole in memory (at
    /// 50k Services ~115 MB and ~60 MB). A refusal by the kernel then names
    /// the failing lines without their text.
    fn apply_owned(&mut self, tx: Transaction) -> Result<usize, DataplaneError> {
        self.apply(&tx)
    }
    /// Whether our table exists (canary: `nft flush ruleset` removes it).
    fn table_exists(&mut self, family: IpFamily, table: &str) -> Result<bool, DataplaneError>;
    /// Whether `chain` of our table exists and holds at least one rule (canary:
    /// `nft flush table` keeps the table but empties every chain).
    fn chain_has_rules(
        &mut self,
        family: IpFamily,
        table: &str,
        _chain: &str,
    ) -> Result<bool, DataplaneError> {
        self.table_exists(family, table)
    }
    /// The client records (`ElemKey::Affinity`) in affinity set `set`, to
    /// forget the clients of a removed endpoint. A backend that cannot list
    /// elements returns none: the records then only expire with their
    /// timeout.
    fn affinity_records(
        &mut self,
        _family: IpFamily,
        _table: &str,
        _set: &str,
    ) -> Result<Vec<ElemKey>, DataplaneError> {
        Ok(Vec::new())
    }
}

/// Runs `nft -f -`.
#[derive(Clone, Debug)]
pub struct NftCli {
    pub program: String,
}

impl Default for NftCli {
    fn default() -> Self {
        NftCli {
            program: "nft".into(),
        }
    }
}

impl NftBackend for NftCli {
    fn apply(&mut self, tx: &Transaction) -> Result<usize, DataplaneError> {
        let script = tx.to_string();
        let mut child = Command::new(&self.program)
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| DataplaneError::Io {
                what: format!("starting {}", self.program),
                source: e,
            })?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(script.as_bytes())
                .map_err(|e| DataplaneError::Io {
                    what: format!("writing the ruleset to {}", self.program),
                    source: e,
                })?;
        }
        let out = child.wait_with_output().map_err(|e| DataplaneError::Io {
            what: format!("waiting for {}", self.program),
            source: e,
        })?;
        if out.status.success() {
            Ok(script.len())
        } else {
            let stderr = String::from_utf8_lossy(&out.stderr);
            // nft repeats every failing line; the first few say what went wrong.
            let msg: Vec<&str> = stderr.lines().take(6).collect();
            Err(DataplaneError::Apply {
                tool: format!("{} -f", self.program),
                message: format!("{} ({})", msg.join(" | "), out.status),
            })
        }
    }

    /// `nft list set`, its elements read back from the listing.
    fn affinity_records(
        &mut self,
        family: IpFamily,
        table: &str,
        set: &str,
    ) -> Result<Vec<ElemKey>, DataplaneError> {
        let fam = family_kw(family);
        let out = Command::new(&self.program)
            .args(["list", "set", fam, table, set])
            .output()
            .map_err(|e| DataplaneError::Io {
                what: format!("running {} list set", self.program),
                source: e,
            })?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            // A set that is not there holds no records.
            if stderr.contains("No such file or directory") {
                return Ok(Vec::new());
            }
            return Err(DataplaneError::Apply {
                tool: format!("{} list set", self.program),
                message: format!("listing set {set}: {}", stderr.trim()),
            });
        }
        Ok(parse_affinity_records(&String::from_utf8_lossy(
            &out.stdout,
        )))
    }

    fn table_exists(&mut self, family: IpFamily, table: &str) -> Result<bool, DataplaneError> {
        let fam = family_kw(family);
        let out = Command::new(&self.program)
            .args(["list", "tables", fam])
            .output()
            .map_err(|e| DataplaneError::Io {
                what: format!("running {} list tables", self.program),
                source: e,
            })?;
        if !out.status.success() {
            return Err(DataplaneError::Apply {
                tool: format!("{} list tables", self.program),
                message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        let want = format!("table {fam} {table}");
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.trim() == want))
    }

    fn chain_has_rules(
        &mut self,
        family: IpFamily,
        table: &str,
        chain: &str,
    ) -> Result<bool, DataplaneError> {
        let fam = family_kw(family);
        let out = Command::new(&self.program)
            .args(["list", "chain", fam, table, chain])
            .output()
            .map_err(|e| DataplaneError::Io {
                what: format!("running {} list chain", self.program),
                source: e,
            })?;
        // A missing table or chain is an error exit: the rules are gone.
        Ok(out.status.success()
            && String::from_utf8_lossy(&out.stdout)
                .lines()
                .any(|l| l.contains("jump ") || l.contains("goto ")))
    }
}

/// The records of an affinity set's listing (`elements = { CLIENT . ID .
/// INDEX expires …, … }`); an element that does not read as one is skipped.
pub fn parse_affinity_records(listing: &str) -> Vec<ElemKey> {
    let Some((_, rest)) = listing.split_once("elements = {") else {
        return Vec::new();
    };
    let body = rest.split('}').next().unwrap_or_default();
    body.split(',')
        .filter_map(|e| {
            let mut w = e.split_whitespace();
            let client = w.next()?.parse().ok()?;
            (w.next()? == ".").then_some(())?;
            let id = w.next()?.parse().ok()?;
            (w.next()? == ".").then_some(())?;
            let index = w.next()?.parse().ok()?;
            Some(ElemKey::Affinity { client, id, index })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affinity_records_read_back_from_a_listing() {
        let listing = "table ip t {
\tset affinity-600 {
\t\ttypeof ip saddr . numgen random mod 1 . numgen random mod 1
\t\tsize 1048576
\t\tflags dynamic,timeout
\t\ttimeout 10m
\t\telements = { 10.1.2.4 . 5 . 0 expires 9m59s992ms,
\t\t\t     10.1.2.3 . 3456789012 . 2 expires 9m59s992ms, fd00::1 . 7 . 1 }
\t}
}
";
        let ip = |s: &str| s.parse().unwrap();
        assert_eq!(
            parse_affinity_records(listing),
            vec![
                ElemKey::Affinity {
                    client: ip("10.1.2.4"),
                    id: 5,
                    index: 0
                },
                ElemKey::Affinity {
                    client: ip("10.1.2.3"),
                    id: 3456789012,
                    index: 2
                },
                ElemKey::Affinity {
                    client: ip("fd00::1"),
                    id: 7,
                    index: 1
                },
            ]
        );
        assert!(parse_affinity_records("table ip t {\n\tset affinity-600 {\n\t}\n}\n").is_empty());
        // Not a record: skipped, not misread.
        assert!(parse_affinity_records("elements = { 10.1.2.4 . 0x5 . 0 }").is_empty());
    }
}
