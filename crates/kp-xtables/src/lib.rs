//! The iptables programs as a rules writer: `iptables-restore` / `-save`
//! run for one family and variant (nft or legacy), the choice between them,
//! and the jumps from builtin chains that a restore ensures. Shared by
//! iptables mode (kp-iptables) and IPVS mode (kp-ipvs), below both, so that
//! neither dataplane depends on the other.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

use std::io::Write;
use std::process::{Command, Stdio};

use kp_model::{DataplaneError, IpFamily};

/// What the proxier needs from iptables. The CLI is the implementation; tests
/// may record calls instead.
pub trait IptablesBackend: Send {
    /// `iptables-restore --noflush --wait` with `input` on stdin: every table
    /// in it is committed, or (per table) nothing is.
    fn restore(&mut self, input: &str) -> Result<(), DataplaneError>;
    /// `restore`, except that a chain `input` declares which the kernel
    /// already holds with exactly the rules `input` gives it is left as it
    /// is instead of flushed and written again: how a restart adopts what
    /// a previous run left. None from a backend that cannot read rules
    /// back (the default): it restored the whole input.
    fn restore_adopting(&mut self, input: &str) -> Result<Option<Adopted>, DataplaneError> {
        self.restore(input).map(|()| None)
    }
    /// Names of the chains in `table` (from `iptables-save -t TABLE`).
    fn chains(&mut self, table: &str) -> Result<Vec<String>, DataplaneError>;
    /// One table's `iptables-save -t TABLE` text (chains and rules). The
    /// default lists only the chains, for backends that only record calls.
    fn save_table(&mut self, table: &str) -> Result<String, DataplaneError> {
        Ok(self
            .chains(table)?
            .iter()
            .map(|c| format!(":{c} - [0:0]\n"))
            .collect())
    }
    /// What a full sync needs to know of `table`: its chains, and which of
    /// `jumps` (those of this table) are missing. One `iptables-save` here;
    /// backends that can ask more cheaply do.
    fn survey(
        &mut self,
        table: &str,
        jumps: &[Jump],
    ) -> Result<(Vec<String>, Vec<Jump>), DataplaneError> {
        let saved = self.save_table(table)?;
        Ok((
            chain_names(&saved).map(String::from).collect(),
            missing_jumps(jumps, table, &saved)
                .into_iter()
                .cloned()
                .collect(),
        ))
    }
    /// Which of `jumps` (those of `table`) are missing: `survey` without
    /// the chains, for backends that can check rules without listing them.
    fn missing_jumps(&mut self, table: &str, jumps: &[Jump]) -> Result<Vec<Jump>, DataplaneError> {
        self.survey(table, jumps).map(|(_, missing)| missing)
    }
    /// Whether `chain` exists in `table` (`iptables -S CHAIN`; cheap).
    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, DataplaneError>;
    /// `iptables -C`: whether the rule is in `chain`.
    fn rule_exists(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, DataplaneError>;
    /// `iptables -D`.
    fn delete_rule(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<(), DataplaneError>;
}

/// What [`IptablesBackend::restore_adopting`] found and sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Adopted {
    /// Reading the declared chains back.
    pub read: std::time::Duration,
    pub rules_read: usize,
    /// Declared chains the kernel held exactly as declared: not written.
    pub chains_kept: usize,
    /// Declared chains the kernel held with other rules: flushed and written.
    pub chains_rewritten: usize,
    /// Declared chains the kernel did not hold.
    pub chains_added: usize,
    /// Lines of the input left to restore (0: nothing was sent).
    pub lines_sent: usize,
    pub bytes_sent: usize,
}

impl Adopted {
    /// Whether the kernel held any declared chain: something of a previous
    /// run was there to adopt.
    pub fn found_previous(&self) -> bool {
        self.chains_kept + self.chains_rewritten > 0
    }
}

/// Which iptables implementation the programs talk to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// iptables-nft: iptables syntax, nf_tables in the kernel.
    Nft,
    /// iptables-legacy: the x_tables kernel API.
    Legacy,
}

impl Variant {
    pub fn as_str(self) -> &'static str {
        match self {
            Variant::Nft => "nft",
            Variant::Legacy => "legacy",
        }
    }

    /// `Some(variant)` for "nft" / "legacy", `None` for "auto" (detect).
    pub fn parse_choice(s: &str) -> Result<Option<Variant>, String> {
        match s.trim() {
            "" | "auto" => Ok(None),
            "nft" => Ok(Some(Variant::Nft)),
            "legacy" => Ok(Some(Variant::Legacy)),
            other => Err(format!(
                "unknown iptables backend {other:?} (expected auto, nft or legacy)"
            )),
        }
    }

    /// Whether this variant's `iptables-save` can run here (the program is
    /// installed and the kernel side answers).
    pub fn available(self, family: IpFamily) -> bool {
        count_rules(&format!("{}-{}-save", base(family), self.as_str())).is_some()
    }
}

fn base(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "iptables",
        IpFamily::V6 => "ip6tables",
    }
}

/// (KUBE-* lines, rule lines) in the output of `{prog}-save`, or None when the
/// program is missing or fails.
fn count_rules(prog: &str) -> Option<(usize, usize)> {
    let out = Command::new(prog).stderr(Stdio::null()).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut kube = 0;
    let mut rules = 0;
    for l in text.lines() {
        if l.starts_with("-A ") {
            rules += 1;
        }
        if l.starts_with(":KUBE-") || l.starts_with("-A KUBE-") {
            kube += 1;
        }
    }
    Some((kube, rules))
}

/// Picks the variant like upstream: the one that already holds Kubernetes
/// chains, else the one with more rules, else nft (Debian's default
/// `iptables` is the nft one).
pub fn detect_variant(family: IpFamily) -> Variant {
    let b = base(family);
    let nft = count_rules(&format!("{b}-nft-save"));
    let legacy = count_rules(&format!("{b}-legacy-save"));
    match (nft, legacy) {
        (None, Some(_)) => Variant::Legacy,
        (Some((nk, nr)), Some((lk, lr))) if lk > nk || (lk == nk && lr > nr) => Variant::Legacy,
        _ => Variant::Nft,
    }
}

/// Runs the iptables programs. Names are configurable so that tests can point
/// at wrappers; [`IptablesCli::auto`] picks them on first use.
#[derive(Clone, Debug)]
pub struct IptablesCli {
    family: IpFamily,
    programs: Option<Programs>,
}

#[derive(Clone, Debug)]
struct Programs {
    iptables: String,
    restore: String,
    save: String,
}

/// The chains an `iptables-save` listing declares (its `:NAME POLICY` lines).
pub fn chain_names(saved: &str) -> impl Iterator<Item = &str> {
    saved
        .lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
}

impl IptablesCli {
    /// Detects the variant ([`detect_variant`]) when first needed, so that
    /// --dry-run never runs anything.
    pub fn auto(family: IpFamily) -> Self {
        IptablesCli {
            family,
            programs: None,
        }
    }

    /// The programs of one variant (`iptables-nft`, `iptables-nft-restore`, ...).
    pub fn variant(family: IpFamily, v: Variant) -> Self {
        let b = format!("{}-{}", base(family), v.as_str());
        Self::with_programs(family, &b, &format!("{b}-restore"), &format!("{b}-save"))
    }

    /// The operator's choice: a fixed variant, or `None` to detect.
    pub fn choose(family: IpFamily, choice: Option<Variant>) -> Self {
        match choice {
            Some(v) => {
                tracing::info!(family = %family, variant = v.as_str(), "using iptables backend (configured)");
                Self::variant(family, v)
            }
            None => Self::auto(family),
        }
    }

    /// Explicit program names.
    pub fn with_programs(family: IpFamily, iptables: &str, restore: &str, save: &str) -> Self {
        IptablesCli {
            family,
            programs: Some(Programs {
                iptables: iptables.into(),
                restore: restore.into(),
                save: save.into(),
            }),
        }
    }

    fn programs(&mut self) -> &Programs {
        let family = self.family;
        self.programs.get_or_insert_with(|| {
            let v = detect_variant(family);
            tracing::info!(family = %family, variant = v.as_str(), "using iptables backend (detected)");
            let b = format!("{}-{}", base(family), v.as_str());
            Programs {
                iptables: b.clone(),
                restore: format!("{b}-restore"),
                save: format!("{b}-save"),
            }
        })
    }

    fn run(&mut self, args: &[&str]) -> Result<std::process::Output, DataplaneError> {
        let prog = self.programs().iptables.clone();
        Command::new(&prog)
            .arg("-w")
            .args(args)
            .output()
            .map_err(|e| DataplaneError::Io {
                what: format!("running {prog}"),
                source: e,
            })
    }

    fn rule_cmd(
        &mut self,
        op: &str,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<std::process::Output, DataplaneError> {
        let mut argv: Vec<&str> = vec!["-t", table, op, chain];
        if op == "-I" {
            argv.push("1");
        }
        argv.extend(args.iter().map(|s| s.as_str()));
        self.run(&argv)
    }
}

fn failure(tool: String, out: &std::process::Output) -> DataplaneError {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let msg: Vec<&str> = stderr.lines().take(6).collect();
    DataplaneError::Apply {
        tool,
        message: format!("{} ({})", msg.join(" | "), out.status),
    }
}

impl IptablesBackend for IptablesCli {
    fn restore(&mut self, input: &str) -> Result<(), DataplaneError> {
        let prog = self.programs().restore.clone();
        let mut child = Command::new(&prog)
            .args(["--noflush", "--wait"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| DataplaneError::Io {
                what: format!("starting {prog}"),
                source: e,
            })?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(input.as_bytes())
                .map_err(|e| DataplaneError::Io {
                    what: format!("writing the rules to {prog}"),
                    source: e,
                })?;
        }
        let out = child.wait_with_output().map_err(|e| DataplaneError::Io {
            what: format!("waiting for {prog}"),
            source: e,
        })?;
        if out.status.success() {
            Ok(())
        } else {
            Err(failure(format!("{prog} --noflush"), &out))
        }
    }

    fn save_table(&mut self, table: &str) -> Result<String, DataplaneError> {
        let prog = self.programs().save.clone();
        let out = Command::new(&prog)
            .args(["-t", table])
            .output()
            .map_err(|e| DataplaneError::Io {
                what: format!("running {prog} -t {table}"),
                source: e,
            })?;
        if !out.status.success() {
            return Err(failure(format!("{prog} -t {table}"), &out));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn chains(&mut self, table: &str) -> Result<Vec<String>, DataplaneError> {
        let saved = self.save_table(table)?;
        Ok(chain_names(&saved).map(String::from).collect())
    }

    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, DataplaneError> {
        // A missing chain (or table) is exit status 1; anything else is an error.
        let out = self.run(&["-t", table, "-S", chain])?;
        match out.status.code() {
            Some(0) => Ok(true),
            Some(1) => Ok(false),
            _ => Err(failure(format!("iptables -t {table} -S {chain}"), &out)),
        }
    }

    fn rule_exists(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, DataplaneError> {
        let out = self.rule_cmd("-C", table, chain, args)?;
        match out.status.code() {
            Some(0) => Ok(true),
            Some(1) => Ok(false),
            _ => Err(failure(format!("iptables -t {table} -C {chain}"), &out)),
        }
    }

    fn delete_rule(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<(), DataplaneError> {
        let out = self.rule_cmd("-D", table, chain, args)?;
        if out.status.success() {
            Ok(())
        } else {
            Err(failure(format!("iptables -t {table} -D {chain}"), &out))
        }
    }
}

/// A jump from a builtin chain into one of ours (upstream's iptablesJumpChains):
/// `[-m conntrack --ctstate NEW] -m comment --comment COMMENT -j TO`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Jump {
    pub table: &'static str,
    pub from: &'static str,
    pub to: &'static str,
    pub comment: &'static str,
    /// Only packets of new connections (`-m conntrack --ctstate NEW`).
    pub new_only: bool,
}

impl Jump {
    /// The rule's arguments after the chain name, as `iptables -C/-I/-D`
    /// takes them.
    pub fn args(&self) -> Vec<String> {
        let mut args = Vec::with_capacity(10);
        if self.new_only {
            args.extend(["-m", "conntrack", "--ctstate", "NEW"].map(String::from));
        }
        args.extend(["-m", "comment", "--comment", self.comment, "-j", self.to].map(String::from));
        args
    }

    /// The arguments as one line of iptables-restore/-save syntax (comments
    /// with spaces quoted).
    pub fn args_text(&self) -> String {
        self.args()
            .iter()
            .map(|a| {
                if a.contains(' ') {
                    format!("\"{a}\"")
                } else {
                    a.clone()
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The rule as `iptables-save` lists it.
    pub fn save_line(&self) -> String {
        format!("-A {} {}", self.from, self.args_text())
    }
}

/// The jumps of `jumps` in `table` that `listed` (that table's `iptables-save`
/// output) does not hold.
pub fn missing_jumps<'a>(jumps: &'a [Jump], table: &str, listed: &str) -> Vec<&'a Jump> {
    jumps
        .iter()
        .filter(|j| j.table == table)
        .filter(|j| {
            let line = j.save_line();
            !listed.lines().any(|l| l == line)
        })
        .collect()
}

/// `input` with `-I CHAIN 1 ...` lines for the jumps of `missing` added at the
/// end of their table's section: the jumps are ensured in the same
/// `iptables-restore` run as the chains they lead to. With a large table one
/// `iptables -C` or `-I` costs as much as a restore (iptables-legacy reads and
/// writes the whole table, 1-5 s each at 10k Services).
pub fn with_jumps(input: &str, missing: &[&Jump]) -> String {
    let mut out = String::with_capacity(input.len() + missing.len() * 128);
    let mut table = "";
    for line in input.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t;
        }
        if line == "COMMIT" {
            for j in missing.iter().filter(|j| j.table == table) {
                out.push_str(&format!("-I {} 1 {}\n", j.from, j.args_text()));
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}
