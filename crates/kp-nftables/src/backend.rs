//! How a transaction reaches the kernel.

use std::io::Write;
use std::process::{Command, Stdio};

use kp_model::{DataplaneError, IpFamily, RefusedOp};

use crate::types::{family_kw, ElemKey, Transaction};
use crate::view::TableView;

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
    /// What the kernel holds of our table, as fingerprints a restart can
    /// compare its first sync with (elements of the sets `skip_elements`
    /// names are not read). None when the table is not there or the
    /// backend cannot read it back (then the first sync rewrites it all).
    fn read_table(
        &mut self,
        _family: IpFamily,
        _table: &str,
        _skip_elements: &dyn Fn(&str) -> bool,
    ) -> Result<Option<Box<dyn TableView>>, DataplaneError> {
        Ok(None)
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
            let tool = format!("{} -f", self.program);
            let refused = nft_refusals(&stderr, &script);
            if !refused.is_empty() {
                return Err(DataplaneError::Refused { tool, refused });
            }
            // nft repeats every failing line; the first few say what went wrong.
            let msg: Vec<&str> = stderr.lines().take(6).collect();
            Err(DataplaneError::Apply {
                tool,
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

/// An operation's text as an error shows it: an element list of a full
/// sync can be megabytes long.
pub fn shorten(text: &str) -> String {
    const MAX: usize = 300;
    match text.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

/// The lines nft names in its errors (`/dev/stdin:LINE:COLS: Error: WHY`),
/// each with its text from `script`; at most six.
pub fn nft_refusals(stderr: &str, script: &str) -> Vec<RefusedOp> {
    let mut out: Vec<RefusedOp> = Vec::new();
    for l in stderr.lines() {
        let Some(rest) = l.strip_prefix("/dev/stdin:") else {
            continue;
        };
        let mut parts = rest.splitn(3, ':');
        let (Some(line), Some(_cols), Some(why)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let Ok(line) = line.parse::<usize>() else {
            continue;
        };
        if out.iter().any(|r| r.line == line) || out.len() == 6 {
            continue;
        }
        out.push(RefusedOp {
            line,
            reason: why.trim().trim_start_matches("Error: ").to_string(),
            owner: None,
            text: script.lines().nth(line.saturating_sub(1)).map(shorten),
        });
    }
    out
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
    fn nft_errors_name_their_lines() {
        let script = "add table ip t\nadd rule ip t c meta l4proto tcp bogus\nadd chain ip t d\n";
        let stderr = "/dev/stdin:2:36-40: Error: syntax error, unexpected string\n\
                      add rule ip t c meta l4proto tcp bogus\n\
                      \x20                                  ^^^^^\n";
        let r = nft_refusals(stderr, script);
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!(r[0].line, 2);
        assert_eq!(r[0].reason, "syntax error, unexpected string");
        assert_eq!(
            r[0].text.as_deref(),
            Some("add rule ip t c meta l4proto tcp bogus")
        );
        assert!(nft_refusals("nft: something else\n", script).is_empty());
        let long = "x".repeat(1000);
        assert_eq!(shorten(&long).chars().count(), 301);
    }

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
