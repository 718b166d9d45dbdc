//! The ipsets of IPVS mode (upstream's names), their `ipset restore` input,
//! and reading them back from `ipset save`.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};

use ipnet::IpNet;
use kp_model::{DataplaneError, IpFamily};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetKind {
    HashIpPort,
    HashIpPortIp,
    HashIpPortNet,
    HashIp,
    BitmapPort,
}

impl SetKind {
    pub fn type_name(self) -> &'static str {
        match self {
            SetKind::HashIpPort => "hash:ip,port",
            SetKind::HashIpPortIp => "hash:ip,port,ip",
            SetKind::HashIpPortNet => "hash:ip,port,net",
            SetKind::HashIp => "hash:ip",
            SetKind::BitmapPort => "bitmap:port",
        }
    }
}

pub struct SetDef {
    pub name: &'static str,
    pub kind: SetKind,
    pub comment: &'static str,
}

const fn def(name: &'static str, kind: SetKind, comment: &'static str) -> SetDef {
    SetDef {
        name,
        kind,
        comment,
    }
}

/// Every set, with upstream's names and purposes.
pub const SETS: &[SetDef] = &[
    def(
        "KUBE-LOOP-BACK",
        SetKind::HashIpPortIp,
        "endpoint ip:port and source ip, for hairpin masquerade",
    ),
    def(
        "KUBE-CLUSTER-IP",
        SetKind::HashIpPort,
        "service cluster ip + port, for masquerade",
    ),
    def(
        "KUBE-EXTERNAL-IP",
        SetKind::HashIpPort,
        "service external ip + port, for masquerade and filter",
    ),
    def(
        "KUBE-EXTERNAL-IP-LOCAL",
        SetKind::HashIpPort,
        "service external ip + port with externalTrafficPolicy=Local",
    ),
    def(
        "KUBE-LOAD-BALANCER",
        SetKind::HashIpPort,
        "service load balancer ip + port",
    ),
    def(
        "KUBE-LOAD-BALANCER-LOCAL",
        SetKind::HashIpPort,
        "load balancer ip + port with externalTrafficPolicy=Local",
    ),
    def(
        "KUBE-LOAD-BALANCER-FW",
        SetKind::HashIpPort,
        "load balancer ip + port with loadBalancerSourceRanges",
    ),
    def(
        "KUBE-LOAD-BALANCER-SOURCE-CIDR",
        SetKind::HashIpPortNet,
        "load balancer ip + port + allowed source cidr",
    ),
    def("KUBE-NODE-PORT-TCP", SetKind::BitmapPort, "TCP nodeports"),
    def(
        "KUBE-NODE-PORT-LOCAL-TCP",
        SetKind::BitmapPort,
        "TCP nodeports with externalTrafficPolicy=Local",
    ),
    def("KUBE-NODE-PORT-UDP", SetKind::BitmapPort, "UDP nodeports"),
    def(
        "KUBE-NODE-PORT-LOCAL-UDP",
        SetKind::BitmapPort,
        "UDP nodeports with externalTrafficPolicy=Local",
    ),
    def(
        "KUBE-NODE-PORT-SCTP-HASH",
        SetKind::HashIpPort,
        "SCTP node ip + nodeport",
    ),
    def(
        "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
        SetKind::HashIpPort,
        "SCTP node ip + nodeport with externalTrafficPolicy=Local",
    ),
    def(
        "KUBE-HEALTH-CHECK-NODE-PORT",
        SetKind::BitmapPort,
        "health check node ports",
    ),
    def(
        "KUBE-IPVS-IPS",
        SetKind::HashIp,
        "every service ip bound to kube-ipvs0",
    ),
];

/// The set's name for a family: IPv6 sets are `KUBE-6-...`. ipset names are
/// at most 31 characters: the two IPv6 names that would be longer are
/// shortened (SOURCE -> SRC, no -HASH suffix).
pub fn name(base: &str, family: IpFamily) -> String {
    match family {
        IpFamily::V4 => base.to_string(),
        IpFamily::V6 => {
            let n = format!("KUBE-6-{}", base.trim_start_matches("KUBE-"));
            if n.len() <= 31 {
                n
            } else {
                n.replace("-SOURCE-", "-SRC-")
                    .trim_end_matches("-HASH")
                    .to_string()
            }
        }
    }
}

pub fn def_of(set: &str, family: IpFamily) -> Option<&'static SetDef> {
    SETS.iter().find(|d| name(d.name, family) == set)
}

/// A CIDR as ipset prints it (a host prefix without its length).
pub fn net_entry(c: &IpNet) -> String {
    if c.prefix_len() == c.max_prefix_len() {
        c.addr().to_string()
    } else {
        c.trunc().to_string()
    }
}

/// `create` lines for every set of the family (with -exist: no-ops when
/// they exist).
pub fn create_lines(family: IpFamily) -> String {
    let mut out = String::new();
    let fam = match family {
        IpFamily::V4 => "inet",
        IpFamily::V6 => "inet6",
    };
    for d in SETS {
        let n = name(d.name, family);
        let opts = match d.kind {
            SetKind::BitmapPort => "range 0-65535".to_string(),
            _ => format!("family {fam} hashsize 1024 maxelem 65536"),
        };
        out.push_str(&format!(
            "create {n} {} {opts} comment\n",
            d.kind.type_name()
        ));
    }
    out
}

pub fn add_line(set: &str, entry: &str, comment: &str) -> String {
    if comment.is_empty() {
        format!("add {set} {entry}\n")
    } else {
        format!("add {set} {entry} comment \"{comment}\"\n")
    }
}

pub fn del_line(set: &str, entry: &str) -> String {
    format!("del {set} {entry}\n")
}

/// Our sets' entries in `ipset save` output (set -> entry -> comment).
pub fn parse_save(text: &str, family: IpFamily) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for l in text.lines() {
        let mut it = l.splitn(3, ' ');
        match (it.next(), it.next(), it.next()) {
            (Some("create"), Some(set), _) if def_of(set, family).is_some() => {
                out.entry(set.to_string()).or_default();
            }
            (Some("add"), Some(set), Some(rest)) if def_of(set, family).is_some() => {
                let (entry, comment) = match rest.split_once(" comment ") {
                    Some((e, c)) => (e, c.trim_matches('"')),
                    None => (rest.split(' ').next().unwrap_or(rest), ""),
                };
                out.entry(set.to_string())
                    .or_default()
                    .insert(entry.to_string(), comment.to_string());
            }
            _ => {}
        }
    }
    out
}

/// Runs the `ipset` program.
pub trait IpsetBackend: Send {
    /// `ipset restore -exist` with `input` on stdin.
    fn restore(&mut self, input: &str) -> Result<(), DataplaneError>;
    /// `ipset save` output.
    fn save(&mut self) -> Result<String, DataplaneError>;
    /// `ipset destroy NAME`; a missing set is fine.
    fn destroy(&mut self, set: &str) -> Result<(), DataplaneError>;
}

#[derive(Clone, Debug, Default)]
pub struct IpsetCli;

fn io(what: &str, e: std::io::Error) -> DataplaneError {
    DataplaneError::Io {
        what: what.to_string(),
        source: e,
    }
}

fn fail(tool: &str, out: &std::process::Output) -> DataplaneError {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let msg: Vec<&str> = stderr.lines().take(6).collect();
    DataplaneError::Apply {
        tool: tool.to_string(),
        message: format!("{} ({})", msg.join(" | "), out.status),
    }
}

impl IpsetBackend for IpsetCli {
    fn restore(&mut self, input: &str) -> Result<(), DataplaneError> {
        let mut child = Command::new("ipset")
            .args(["restore", "-exist"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| io("starting ipset restore", e))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(input.as_bytes())
                .map_err(|e| io("writing to ipset restore", e))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| io("waiting for ipset restore", e))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(fail("ipset restore", &out))
        }
    }

    fn save(&mut self) -> Result<String, DataplaneError> {
        let out = Command::new("ipset")
            .arg("save")
            .output()
            .map_err(|e| io("running ipset save", e))?;
        if !out.status.success() {
            return Err(fail("ipset save", &out));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn destroy(&mut self, set: &str) -> Result<(), DataplaneError> {
        let out = Command::new("ipset")
            .args(["destroy", set])
            .output()
            .map_err(|e| io("running ipset destroy", e))?;
        let err = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || err.contains("does not exist") {
            Ok(())
        } else {
            Err(fail("ipset destroy", &out))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_names_fit_ipset_limit_and_are_distinct() {
        let mut all = std::collections::BTreeSet::new();
        for f in [IpFamily::V4, IpFamily::V6] {
            for d in SETS {
                let n = name(d.name, f);
                assert!(n.len() <= 31, "{n} is longer than 31 characters");
                assert!(all.insert(n.clone()), "{n} twice");
                assert_eq!(def_of(&n, f).map(|x| x.name), Some(d.name));
            }
        }
        assert_eq!(name("KUBE-CLUSTER-IP", IpFamily::V6), "KUBE-6-CLUSTER-IP");
    }

    #[test]
    fn parses_ipset_save_output() {
        let text =
            "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536 comment\n\
                    add KUBE-CLUSTER-IP 10.96.0.10,tcp:80 comment \"default/web:http\"\n\
                    create OTHER hash:ip family inet\n\
                    add OTHER 1.2.3.4\n\
                    create KUBE-NODE-PORT-TCP bitmap:port range 0-65535 comment\n\
                    add KUBE-NODE-PORT-TCP 30080\n";
        let m = parse_save(text, IpFamily::V4);
        assert_eq!(m.len(), 2, "{m:?}");
        assert_eq!(
            m["KUBE-CLUSTER-IP"]
                .get("10.96.0.10,tcp:80")
                .map(|s| s.as_str()),
            Some("default/web:http")
        );
        assert!(m["KUBE-NODE-PORT-TCP"].contains_key("30080"));
    }
}
