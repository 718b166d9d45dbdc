//! The iptables-restore text, pinned: every restore input the proxier
//! writes for a scripted cluster (every Service kind, both families, every
//! local-traffic detector, NodePort address and host setting; a first sync,
//! endpoint changes, Service deletions, a forced full sync, a dry run and a
//! cleanup) against tests/golden/restore_text.txt, made by the renderer that
//! wrote the text with `format!` before the rules were typed. The legacy
//! backend, `--iptables-nft-restore`, dry runs and the docs all show this
//! text; a byte changed here changes what they get.
//!
//! `KP_GOLDEN_WRITE=1` writes the file anew: only for a change meant to
//! change the text. The file holds each line once: a line seen before is
//! `@@ N`, the number of the line it repeats (the text is ~1 MB whole, most
//! of it the same rules under each configuration).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::collections::BTreeSet;
use std::fmt::Write;
use std::sync::{Arc, Mutex};

use kp_iptables::{IptablesBackend, IptablesProxier};
use kp_model::{Dataplane, DataplaneError, Endpoint, IpFamily, ProxyState, ServicePortName};

mod common;
use common::{configs, every_kind, host_rules, service, state};

/// Records every restore input; lists `chains` as the table's chains and
/// holds no jump, so that full syncs ensure every jump (`-I` lines) and a
/// cleanup deletes the chains.
#[derive(Clone, Default)]
struct Recorder {
    restores: Arc<Mutex<Vec<String>>>,
    chains: Arc<Mutex<Vec<(String, String)>>>,
}

impl IptablesBackend for Recorder {
    fn restore(&mut self, input: &str) -> Result<(), DataplaneError> {
        self.restores.lock().unwrap().push(input.to_string());
        Ok(())
    }
    fn chains(&mut self, table: &str) -> Result<Vec<String>, DataplaneError> {
        let chains = self.chains.lock().unwrap();
        Ok(chains
            .iter()
            .filter(|(t, _)| t == table)
            .map(|(_, c)| c.clone())
            .collect())
    }
    fn chain_exists(&mut self, _: &str, _: &str) -> Result<bool, DataplaneError> {
        Ok(true)
    }
    fn rule_exists(&mut self, _: &str, _: &str, _: &[String]) -> Result<bool, DataplaneError> {
        Ok(false)
    }
    fn delete_rule(&mut self, _: &str, _: &str, _: &[String]) -> Result<(), DataplaneError> {
        Ok(())
    }
}

fn changed(names: &[&ServicePortName]) -> BTreeSet<ServicePortName> {
    names.iter().map(|n| (*n).clone()).collect()
}

/// A Service with `n` endpoints (session affinity on every other), so that
/// selection rules carry the probabilities of 1/2 to 1/n.
fn wide(family: IpFamily, i: u8, n: u8) -> (kp_model::ServicePort, Vec<Endpoint>) {
    let v6 = family == IpFamily::V6;
    let cip = if v6 {
        format!("fd00:96::1:{i}")
    } else {
        format!("10.96.1.{i}")
    };
    let mut s = service(&format!("wide{i}"), &cip).node_port(31000 + i as u16);
    if i.is_multiple_of(2) {
        s = s.affinity(10800);
    }
    let eps = (1..=n)
        .map(|k| {
            Endpoint::at(&if v6 {
                format!("[fd00:244:{i}::{k}]:80")
            } else {
                format!("10.245.{i}.{k}:80")
            })
        })
        .collect();
    (s.build(), eps)
}

/// Every restore input of the script, for one family and configuration.
fn script(family: IpFamily, name: &str, config: kp_model::ProxierConfig) -> String {
    let rec = Recorder::default();
    let mut p = IptablesProxier::new(config, Box::new(rec.clone()))
        .with_route_localnet(false)
        .with_host_rules(host_rules(name));
    let mut services = every_kind(family);
    services.extend([wide(family, 1, 2), wide(family, 2, 7)]);
    let mut out = String::new();
    let mut step = |p: &mut IptablesProxier,
                    what: &str,
                    st: &ProxyState,
                    changed: &BTreeSet<ServicePortName>,
                    full: bool| {
        p.sync(st, changed, full).unwrap();
        let _ = writeln!(out, "### {family:?} {name}: {what}");
        for r in rec.restores.lock().unwrap().drain(..) {
            out.push_str(&r);
            out.push_str("### end of input\n");
        }
    };
    let st = state(family, &services);
    step(&mut p, "first sync", &st, &BTreeSet::new(), false);
    let web = services[0].0.name.clone();
    let aff = services[7].0.name.clone();
    services[0].1[2] = Endpoint::at(if family == IpFamily::V6 {
        "[fd00:244::9]:8080"
    } else {
        "10.244.1.9:8080"
    });
    services[7].1.clear();
    let (st, ch) = (state(family, &services), changed(&[&web, &aff]));
    step(&mut p, "endpoint changes", &st, &ch, false);
    let np = services[1].0.name.clone();
    let lb = services[2].0.name.clone();
    services.retain(|(s, _)| s.name != np && s.name != lb);
    let (st, ch) = (state(family, &services), changed(&[&np, &lb]));
    step(&mut p, "service deletions", &st, &ch, false);
    step(&mut p, "forced full sync", &st, &BTreeSet::new(), true);
    let _ = writeln!(out, "### {family:?} {name}: dry run");
    out.push_str(&p.render(&st));
    *rec.chains.lock().unwrap() = [
        ("mangle", "KUBE-PROXY-CANARY"),
        ("filter", "KUBE-FORWARD"),
        ("filter", "INPUT"),
        ("nat", "KUBE-SERVICES"),
        ("nat", "KUBE-SEP-AAAA"),
        ("nat", "USER-CHAIN"),
    ]
    .map(|(t, c)| (t.to_string(), c.to_string()))
    .to_vec();
    p.cleanup().unwrap();
    let _ = writeln!(out, "### {family:?} {name}: cleanup");
    for r in rec.restores.lock().unwrap().drain(..) {
        out.push_str(&r);
    }
    out
}

#[test]
fn the_restore_text_is_what_the_format_renderer_wrote() {
    let mut got = String::new();
    for family in [IpFamily::V4, IpFamily::V6] {
        for (name, config) in configs(family) {
            got.push_str(&script(family, name, config));
        }
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/restore_text.txt");
    if std::env::var_os("KP_GOLDEN_WRITE").is_some() {
        std::fs::write(path, pack(&got)).unwrap();
    }
    let want = unpack(&std::fs::read_to_string(path).expect("tests/golden/restore_text.txt"));
    let (g, w): (Vec<&str>, Vec<&str>) = (got.lines().collect(), want.lines().collect());
    let Some(at) = (0..g.len().max(w.len())).find(|&i| g.get(i) != w.get(i)) else {
        return;
    };
    let section = w[..at.min(w.len())]
        .iter()
        .rev()
        .find(|l| l.starts_with("### "))
        .unwrap_or(&"");
    panic!(
        "line {} differs ({section}):\n  got:  {:?}\n  want: {:?}\n({} lines against {})",
        at + 1,
        g.get(at),
        w.get(at),
        g.len(),
        w.len()
    );
}

/// `text` with every line seen before replaced by `@@ N`, N the number
/// (from 1) of its first occurrence.
fn pack(text: &str) -> String {
    let mut first = std::collections::HashMap::new();
    let mut out = String::new();
    for (i, l) in text.lines().enumerate() {
        match first.get(l) {
            Some(n) => writeln!(out, "@@ {n}").unwrap(),
            None => {
                first.insert(l, i + 1);
                writeln!(out, "{l}").unwrap();
            }
        }
    }
    out
}

/// [`pack`] undone.
fn unpack(packed: &str) -> String {
    let mut lines: Vec<&str> = Vec::new();
    for l in packed.lines() {
        let line = match l.strip_prefix("@@ ") {
            Some(n) => lines[n.parse::<usize>().unwrap() - 1],
            None => l,
        };
        lines.push(line);
    }
    lines.iter().map(|l| format!("{l}\n")).collect()
}
