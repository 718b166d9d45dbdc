//! The iptables proxier: remembers what it programmed, rewrites only the chains
//! of changed services (upstream's MinimizeIPTablesRestore).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Instant;

use kp_model::{
    Dataplane, DataplaneError, IpFamily, Known, ProxierConfig, ProxyState, ServicePort,
    ServicePortName, Start, SyncReport,
};

use kp_netlink::{Sysctl, SysctlError};

use kp_xtables::{with_jumps, Jump};
use kp_xtables::{Adopted, IptablesBackend};

use crate::render::{
    is_our_chain, jumps, render_service_with, HostRules, ServiceRules, Skeleton, CANARY_CHAIN,
    EXTERNAL_CHAIN, FIREWALL_CHAIN, FORWARD_CHAIN, MANGLE_CHAINS, MARK_MASQ_CHAIN, NAT_CHAINS,
    NODEPORTS_CHAIN, POSTROUTING_CHAIN, SERVICES_CHAIN,
};

const ROUTE_LOCALNET: &str = "net/ipv4/conf/all/route_localnet";
const TCP_BE_LIBERAL: &str = "net/netfilter/nf_conntrack_tcp_be_liberal";

impl HostRules {
    /// Reads the calling thread's network namespace as upstream does at
    /// start: the INVALID drop unless nf_conntrack_tcp_be_liberal is set
    /// (also when it cannot be read), and the nfacct counters, created here.
    pub fn probe() -> HostRules {
        let liberal = Sysctl::new()
            .get(TCP_BE_LIBERAL)
            .ok()
            .is_some_and(|v| v != 0);
        if liberal {
            tracing::info!(
                "nf_conntrack_tcp_be_liberal set, not installing DROP rules for INVALID packets"
            );
        }
        HostRules {
            invalid_drop: !liberal,
            nfacct: crate::nfacct::ensure_all(),
        }
    }
}

/// The host settings iptables mode needs, what `--init-only` applies for it:
/// route_localnet=1 when NodePorts answer on localhost (IPv4), so that the
/// kernel routes 127.0.0.1 traffic to the DNAT rules. Read first, written only
/// when different. Returns whether something was written.
pub fn init_host(cfg: &ProxierConfig, sysctl: &Sysctl) -> Result<bool, SysctlError> {
    if !(cfg.localhost_nodeports && cfg.family == IpFamily::V4) {
        return Ok(false);
    }
    if sysctl.get(ROUTE_LOCALNET).ok() == Some(1) {
        return Ok(false);
    }
    tracing::info!(
        "setting route_localnet=1 to allow NodePorts on localhost; disable \
         --iptables-localhost-nodeports or set --nodeport-addresses to avoid it"
    );
    sysctl.ensure(ROUTE_LOCALNET, 1)
}

/// What a successful sync programmed: each Service's rules, and the
/// top-level chains' hashes as written.
struct Programmed {
    services: BTreeMap<ServicePortName, ServiceRules>,
    top: TopLevel,
}

pub struct IptablesProxier {
    cfg: ProxierConfig,
    skeleton: Skeleton,
    /// The skeleton's fixed rules of nat and filter KUBE-FORWARD, made once
    /// (KUBE-FORWARD again when the host was probed).
    nat_static: Vec<String>,
    forward: Vec<String>,
    /// What the node decides (be_liberal, nfacct); [`HostRules::probe`]d at
    /// the first sync when `probe_host`.
    host: HostRules,
    probe_host: bool,
    /// Rules of the top-level chains as last worked out: (filter, nat).
    top_rules: (u64, u64),
    backend: Box<dyn IptablesBackend>,
    /// What the last successful sync programmed (nothing before the first,
    /// and after a failed one: the next sync is then a full one).
    known: Known<Programmed>,
    /// Set route_localnet when localhost NodePorts are on (upstream does it at
    /// start; off for proxiers in tests that must not touch sysctls).
    manage_route_localnet: bool,
    /// Until a sync succeeded: full syncs keep the chains a previous run
    /// left that are already right (a restart sends only the difference).
    adopt: bool,
    last_adoption: Option<Adopted>,
}

/// Hashes of the top-level chains' rules, by (table, chain).
type TopLevel = BTreeMap<(&'static str, &'static str), u64>;

/// What a restore input does with the top-level chains.
#[derive(Clone, Copy)]
enum Top<'a> {
    /// Work them out from every Service; write those whose hash differs
    /// from this (all without one).
    Compare(Option<&'a TopLevel>),
    /// They are as last written, with these hashes: nothing to write.
    AsLast(&'a TopLevel),
}

/// One iptables-restore input being built.
struct Restore {
    text: String,
    lines: usize,
    /// Rules appended per table: (filter, nat).
    rules: (u64, u64),
    /// The top-level chains' rules per table, when worked out.
    top_rules: (Option<u64>, Option<u64>),
}

impl Restore {
    fn line(&mut self, l: &str) {
        self.text.push_str(l);
        self.text.push('\n');
        self.lines += 1;
    }

    /// `:CHAIN - [0:0]`: the chain created, or flushed when it exists.
    fn declare(&mut self, chain: &str) {
        self.text.push(':');
        self.text.push_str(chain);
        self.text.push_str(" - [0:0]\n");
        self.lines += 1;
    }
}

/// Services from which a full sync renders them on two threads.
const RENDER_SPLIT_AT: usize = 500;

impl IptablesProxier {
    pub fn new(cfg: ProxierConfig, backend: Box<dyn IptablesBackend>) -> Self {
        let skeleton = Skeleton::new(&cfg);
        let (nat_static, forward) = (skeleton.nat_static(), skeleton.forward_rules());
        let manage_route_localnet = cfg.localhost_nodeports && cfg.family == IpFamily::V4;
        IptablesProxier {
            cfg,
            skeleton,
            nat_static,
            forward,
            host: HostRules::default(),
            probe_host: false,
            top_rules: (0, 0),
            backend,
            known: Known::default(),
            manage_route_localnet,
            adopt: true,
            last_adoption: None,
        }
    }

    /// Rules for a node with `host`'s settings (no probing).
    pub fn with_host_rules(mut self, host: HostRules) -> Self {
        self.forward = self.skeleton.forward_rules_for(&host);
        self.host = host;
        self.probe_host = false;
        self
    }

    /// Probe the node at the first sync, in the namespace the sync runs in
    /// ([`HostRules::probe`]: nf_conntrack_tcp_be_liberal, nfacct counters
    /// created), as upstream does at start. Off by default: a proxier in a
    /// test may sync from outside the namespace its rules go to.
    pub fn probing_host(mut self) -> Self {
        self.probe_host = true;
        self
    }

    /// The node settings the rules follow.
    pub fn host_rules(&self) -> HostRules {
        self.host
    }

    /// Whether full syncs adopt what a previous run left until one sync
    /// succeeded (on by default; off, each rewrites every chain).
    pub fn with_adoption(mut self, adopt: bool) -> Self {
        self.adopt = adopt;
        self
    }

    /// What this process's first sync found of the rules a previous run
    /// left, when the backend could read them back.
    pub fn adoption(&self) -> Option<&Adopted> {
        self.last_adoption.as_ref()
    }

    /// Restores `text` keeping the chains a previous run left that are
    /// already right; (lines, bytes) sent. If the kernel refuses the
    /// difference, the whole input is restored in the same call.
    fn restore_adopting(&mut self, text: &str) -> Result<(usize, usize), DataplaneError> {
        let t0 = Instant::now();
        match self.backend.restore_adopting(text) {
            Ok(Some(a)) => {
                if !a.found_previous() {
                    tracing::debug!(
                        family = ?self.cfg.family,
                        read_ms = a.read.as_millis() as u64,
                        "no chains of a previous run to adopt"
                    );
                } else {
                    tracing::info!(
                        family = ?self.cfg.family,
                        read_ms = a.read.as_millis() as u64,
                        rules_read = a.rules_read,
                        chains_kept = a.chains_kept,
                        chains_rewritten = a.chains_rewritten,
                        chains_added = a.chains_added,
                        operations_sent = a.lines_sent,
                        ms = t0.elapsed().as_millis() as u64,
                        "adopted the rules a previous run left"
                    );
                }
                let sent = (a.lines_sent, a.bytes_sent);
                self.last_adoption = Some(a);
                Ok(sent)
            }
            Ok(None) => Ok((text.lines().count(), text.len())),
            Err(e) => {
                tracing::warn!(error = %e, "could not adopt the rules a previous run left; rewriting every chain");
                self.backend.restore(text)?;
                Ok((text.lines().count(), text.len()))
            }
        }
    }

    /// Whether to set net.ipv4.conf.all.route_localnet=1 (in the network
    /// namespace we run in) when localhost NodePorts are enabled. On by default
    /// then, as upstream.
    pub fn with_route_localnet(mut self, manage: bool) -> Self {
        self.manage_route_localnet = manage;
        self
    }

    /// Every Service rendered; from [`RENDER_SPLIT_AT`] Services, in two
    /// halves on two threads (0.4-0.6 s on one at 10k Services, while the
    /// kernel waits for the batch).
    fn render_all(&self, state: &ProxyState) -> BTreeMap<ServicePortName, ServiceRules> {
        let (cfg, host) = (&self.cfg, &self.host);
        let render = |(name, sp): (&ServicePortName, &Arc<ServicePort>)| {
            (
                name.clone(),
                render_service_with(sp, state.endpoints_of(name), cfg, &state.node, host),
            )
        };
        let n = state.services.len();
        let two =
            n >= RENDER_SPLIT_AT && std::thread::available_parallelism().is_ok_and(|c| c.get() > 1);
        if !two {
            return state.services.iter().map(render).collect();
        }
        let (first, second) = std::thread::scope(|s| {
            let h = s.spawn(|| {
                state
                    .services
                    .iter()
                    .skip(n / 2)
                    .map(render)
                    .collect::<Vec<_>>()
            });
            let first: Vec<_> = state.services.iter().take(n / 2).map(render).collect();
            (first, h.join())
        });
        // Rendering does not panic on any input; should it, the half is
        // rendered again here rather than lost.
        let second =
            second.unwrap_or_else(|_| state.services.iter().skip(n / 2).map(render).collect());
        // Collecting sorts by key; the halves come in key order already.
        first.into_iter().chain(second).collect()
    }

    /// The lines of `all` that append to `chain`.
    fn chain_lines<'a>(&self, all: &'a [String], chain: &str) -> Vec<&'a str> {
        all.iter()
            .map(String::as_str)
            .filter(|l| l.strip_prefix("-A ").and_then(|r| r.split(' ').next()) == Some(chain))
            .collect()
    }

    /// The top-level chains of `table` with their lines, in the order
    /// they are written.
    fn top_level<'a>(
        &'a self,
        services: &'a BTreeMap<ServicePortName, ServiceRules>,
        table: &str,
    ) -> Vec<(&'static str, Vec<&'a str>)> {
        let all = || services.values();
        let lines = |f: fn(&ServiceRules) -> &Vec<String>| -> Vec<&'a str> {
            all().flat_map(f).map(String::as_str).collect()
        };
        let sk = &self.skeleton;
        match table {
            "filter" => vec![
                (SERVICES_CHAIN, lines(|s| &s.filter_services)),
                (EXTERNAL_CHAIN, lines(|s| &s.filter_external)),
                (
                    FORWARD_CHAIN,
                    self.forward.iter().map(String::as_str).collect(),
                ),
                (NODEPORTS_CHAIN, lines(|s| &s.filter_nodeports)),
                (
                    FIREWALL_CHAIN,
                    sk.firewall_head
                        .iter()
                        .map(String::as_str)
                        .chain(all().flat_map(|s| &s.filter_firewall).map(String::as_str))
                        .collect(),
                ),
            ],
            _ => vec![
                (
                    POSTROUTING_CHAIN,
                    self.chain_lines(&self.nat_static, POSTROUTING_CHAIN),
                ),
                (
                    MARK_MASQ_CHAIN,
                    self.chain_lines(&self.nat_static, MARK_MASQ_CHAIN),
                ),
                (
                    SERVICES_CHAIN,
                    lines(|s| &s.nat_services)
                        .into_iter()
                        .chain(sk.nodeport_jumps.iter().map(String::as_str))
                        .collect(),
                ),
                (NODEPORTS_CHAIN, lines(|s| &s.nat_nodeports)),
            ],
        }
    }

    /// The restore input. Of the top-level chains those whose rules differ
    /// from `last` (all when `last` is None) are rewritten, none when
    /// `Top::AsLast` says they are as last written; of the per-service
    /// chains those in `own`; `delete` are removed. Also returns the
    /// top-level chains' hashes as written.
    fn script(
        &self,
        services: &BTreeMap<ServicePortName, ServiceRules>,
        own: &[&(String, Vec<String>)],
        delete: &BTreeSet<String>,
        with_canary: bool,
        top: Top<'_>,
    ) -> (Restore, TopLevel) {
        let mut r = Restore {
            text: String::new(),
            lines: 0,
            rules: (0, 0),
            top_rules: (None, None),
        };
        let (last, mut hashes) = match top {
            Top::Compare(last) => (last, TopLevel::new()),
            Top::AsLast(last) => (None, last.clone()),
        };
        if with_canary {
            r.line("*mangle");
            for c in MANGLE_CHAINS {
                r.line(&format!(":{c} - [0:0]"));
            }
            r.line("COMMIT");
        }
        for table in ["filter", "nat"] {
            // Listing and hashing every Service's top-level lines is most of
            // a one-endpoint change's render at 10k Services (~10 ms): skipped
            // when the changed Services' lines are the ones last written.
            let mut chains = match top {
                Top::AsLast(_) => Vec::new(),
                Top::Compare(_) => self.top_level(services, table),
            };
            let nat = table == "nat";
            if let Top::Compare(_) = top {
                let n = chains.iter().map(|(_, l)| l.len() as u64).sum();
                if nat {
                    r.top_rules.1 = Some(n);
                } else {
                    r.top_rules.0 = Some(n);
                }
            }
            // A top-level chain whose rules did not change is left as it is
            // in the kernel: one endpoint change then rewrites only its
            // Service's chains, not KUBE-SERVICES with a line per Service.
            chains.retain(|(c, lines)| {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                lines.hash(&mut h);
                let h = h.finish();
                hashes.insert((table, c), h);
                last.and_then(|l| l.get(&(table, c))) != Some(&h)
            });
            let own: &[&(String, Vec<String>)] = if nat { own } else { &[] };
            let written = chains.iter().map(|(_, l)| l.len() as u64).sum::<u64>()
                + own.iter().map(|(_, l)| l.len() as u64).sum::<u64>();
            if nat {
                r.rules.1 = written;
            } else {
                r.rules.0 = written;
            }
            if chains.is_empty() && own.is_empty() && (!nat || delete.is_empty()) {
                continue;
            }
            // The table's part in one allocation: at 10k Services 50 MB
            // grown by doubling took 0.2-0.4 s, most of it the kernel
            // zeroing fresh pages for each larger copy.
            fn lines<S: AsRef<str>>(v: &[S]) -> usize {
                v.iter().map(|l| l.as_ref().len() + 1).sum()
            }
            let bytes = chains
                .iter()
                .map(|(c, l)| c.len() + 10 + lines(l))
                .sum::<usize>()
                + own
                    .iter()
                    .map(|(c, rules)| c.len() + 10 + lines(rules))
                    .sum::<usize>()
                + if nat {
                    delete.iter().map(|c| 2 * c.len() + 14).sum::<usize>()
                } else {
                    0
                };
            r.text.reserve(bytes + 16);
            r.line(&format!("*{table}"));
            for (c, _) in &chains {
                r.declare(c);
            }
            for (c, _) in own {
                r.declare(c);
            }
            if nat {
                // Declaring a chain flushes it; a stale chain must be empty to go.
                for c in delete {
                    r.declare(c);
                }
            }
            for (_, lines) in &chains {
                for l in lines {
                    r.line(l);
                }
            }
            for (_, rules) in own {
                for l in rules {
                    r.line(l);
                }
            }
            if nat {
                for c in delete {
                    r.line(&format!("-X {c}"));
                }
            }
            r.line("COMMIT");
        }
        (r, hashes)
    }

    fn ensure_route_localnet(&self) {
        if !self.manage_route_localnet {
            return;
        }
        // Not fatal here: without a writable /proc/sys (and no --init-only
        // before) only NodePorts on 127.0.0.1 fail.
        if let Err(e) = init_host(&self.cfg, &Sysctl::new()) {
            tracing::warn!(error = %e, "cannot enable localhost NodePorts");
        }
    }

    /// Everything written again. `last` is what the previous sync of this
    /// process programmed, when it succeeded.
    fn full_sync(
        &mut self,
        state: &ProxyState,
        last: Option<&BTreeMap<ServicePortName, ServiceRules>>,
    ) -> Result<(BTreeMap<ServicePortName, ServiceRules>, Restore, TopLevel), DataplaneError> {
        let services = self.render_all(state);
        let write: BTreeSet<&str> = services.values().flat_map(|s| s.chain_names()).collect();
        let jumps = jumps();
        let (delete, mut missing): (BTreeSet<String>, Vec<Jump>) = match last {
            // Which per-service chains are stale is known when every sync
            // since the first succeeded: those last written and no longer
            // rendered. A listing of every chain costs 0.6 s at 10k Services.
            Some(last) => (
                last.values()
                    .flat_map(|s| s.chain_names())
                    .filter(|c| !write.contains(c))
                    .map(String::from)
                    .collect(),
                self.backend.missing_jumps("nat", &jumps)?,
            ),
            // Otherwise (a start, a failed sync, rules lost) nat's listing
            // tells both which are left over from a previous run or from a
            // sync whose partial write failed, as upstream finds them, and
            // which jumps from the builtin chains are missing.
            None => {
                let (nat_chains, missing) = self.backend.survey("nat", &jumps)?;
                let delete = nat_chains
                    .iter()
                    .filter(|c| is_our_chain("nat", c) && !NAT_CHAINS.contains(&c.as_str()))
                    .filter(|c| !write.contains(c.as_str()))
                    .cloned()
                    .collect();
                (delete, missing)
            }
        };
        // Of filter (no per-service chains) only the jumps are checked.
        missing.extend(self.backend.missing_jumps("filter", &jumps)?);
        let own: Vec<&(String, Vec<String>)> =
            services.values().flat_map(|s| &s.nat_chains).collect();
        let (mut r, hashes) = self.script(&services, &own, &delete, true, Top::Compare(None));
        if !missing.is_empty() {
            // In the same restore as the chains they lead to: a separate
            // `iptables -C`/`-I` against a large table costs as much as the
            // restore itself.
            r.lines += missing.len();
            let missing: Vec<&Jump> = missing.iter().collect();
            r.text = with_jumps(&r.text, &missing);
        }
        Ok((services, r, hashes))
    }

    fn partial_sync(
        &self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        mut services: BTreeMap<ServicePortName, ServiceRules>,
        written: &TopLevel,
    ) -> (BTreeMap<ServicePortName, ServiceRules>, Restore, TopLevel) {
        let mut write_owned: BTreeSet<String> = BTreeSet::new();
        let mut delete: BTreeSet<String> = BTreeSet::new();
        let mut top_as_last = true;
        for name in changed {
            let new = state.services.get(name).map(|sp| {
                render_service_with(
                    sp,
                    state.endpoints_of(name),
                    &self.cfg,
                    &state.node,
                    &self.host,
                )
            });
            let old = match &new {
                Some(n) => services.insert(name.clone(), n.clone()),
                None => services.remove(name),
            };
            let empty = ServiceRules::default();
            let o = old.as_ref().unwrap_or(&empty);
            let n = new.as_ref().unwrap_or(&empty);
            top_as_last &= o.same_top_level(n);
            for (c, rules) in &n.nat_chains {
                if o.nat_chains.iter().find(|(oc, _)| oc == c).map(|(_, r)| r) != Some(rules) {
                    write_owned.insert(c.clone());
                }
            }
            for (c, _) in &o.nat_chains {
                if !n.nat_chains.iter().any(|(nc, _)| nc == c) {
                    delete.insert(c.clone());
                }
            }
        }
        // Each chain to write, in the order of the Services and of their chains.
        let own: Vec<&(String, Vec<String>)> = changed
            .iter()
            .filter_map(|name| services.get(name))
            .flat_map(|s| &s.nat_chains)
            .filter(|(c, _)| write_owned.contains(c))
            .collect();
        let top = if top_as_last {
            Top::AsLast(written)
        } else {
            Top::Compare(Some(written))
        };
        let (r, hashes) = self.script(&services, &own, &delete, false, top);
        (services, r, hashes)
    }
}

impl Dataplane for IptablesProxier {
    fn mode(&self) -> kp_model::ProxyMode {
        kp_model::ProxyMode::Iptables
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        let t0 = Instant::now();
        if self.probe_host {
            // Once, in the namespace the rules go to; the Services are then
            // rendered for it.
            let host = HostRules::probe();
            self.forward = self.skeleton.forward_rules_for(&host);
            self.host = host;
            self.probe_host = false;
            self.known.forget();
        }
        let start = self.known.begin(full);
        let is_full = start.is_full();
        let (services, restore, hashes) = match start {
            Start::Partial { prev } => self.partial_sync(state, changed, prev.services, &prev.top),
            Start::Full { last } => self.full_sync(state, last.as_ref().map(|l| &l.services))?,
        };
        let render = t0.elapsed();
        let t1 = Instant::now();
        if is_full {
            self.ensure_route_localnet();
        }
        let (mut ops, mut bytes) = (restore.lines, restore.text.len());
        if !restore.text.is_empty() {
            if is_full && self.adopt {
                (ops, bytes) = self.restore_adopting(&restore.text)?;
            } else {
                self.backend.restore(&restore.text)?;
            }
        }
        self.adopt = false;
        let mut report = SyncReport {
            full: is_full,
            bytes,
            ops,
            render,
            apply: t1.elapsed(),
            ..Default::default()
        };
        let mut chain_rules = 0u64;
        for s in services.values() {
            report.no_local_endpoints.0 += s.no_local.0 as u64;
            report.no_local_endpoints.1 += s.no_local.1 as u64;
            chain_rules += s
                .nat_chains
                .iter()
                .map(|(_, r)| r.len() as u64)
                .sum::<u64>();
        }
        if let Some(n) = restore.top_rules.0 {
            self.top_rules.0 = n;
        }
        if let Some(n) = restore.top_rules.1 {
            self.top_rules.1 = n;
        }
        report.iptables_rules = vec![
            ("filter", self.top_rules.0, restore.rules.0),
            ("nat", self.top_rules.1 + chain_rules, restore.rules.1),
        ];
        self.known.done(Programmed {
            services,
            top: hashes,
        });
        Ok(report)
    }

    fn render(&self, state: &ProxyState) -> String {
        let services = self.render_all(state);
        let own: Vec<&(String, Vec<String>)> =
            services.values().flat_map(|s| &s.nat_chains).collect();
        let mut out = self
            .script(&services, &own, &BTreeSet::new(), true, Top::Compare(None))
            .0
            .text;
        // Not part of the restore input: what a full sync also ensures.
        out.push_str("# jumps ensured in builtin chains:\n");
        for j in jumps() {
            let _ = writeln!(out, "# -t {} {}", j.table, j.save_line());
        }
        out
    }

    fn rules_lost(&mut self) -> bool {
        // The mangle canary catches a whole-ruleset flush (upstream's check);
        // `iptables -t nat -F` keeps every chain but empties them, so also
        // check that nat PREROUTING still jumps to KUBE-SERVICES.
        let services_jump = jumps()
            .into_iter()
            .find(|j| j.table == "nat" && j.from == "PREROUTING");
        let backend = &mut self.backend;
        self.known.check_lost("iptables", || {
            backend
                .chain_exists("mangle", CANARY_CHAIN)
                .and_then(|canary| match (canary, &services_jump) {
                    (true, Some(j)) => backend.rule_exists(j.table, j.from, &j.args),
                    (c, _) => Ok(c),
                })
        })
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        self.known.forget();
        // Jumps first: a referenced chain cannot be deleted. A rule may have
        // been added more than once (by hand, or a crashed older version).
        for j in jumps() {
            for _ in 0..16 {
                match self.backend.rule_exists(j.table, j.from, &j.args) {
                    Ok(true) => self.backend.delete_rule(j.table, j.from, &j.args)?,
                    _ => break,
                }
            }
        }
        let mut input = String::new();
        for table in ["mangle", "filter", "nat"] {
            let ours: Vec<String> = self
                .backend
                .chains(table)?
                .into_iter()
                .filter(|c| is_our_chain(table, c))
                .collect();
            if ours.is_empty() {
                continue;
            }
            let _ = writeln!(input, "*{table}");
            for c in &ours {
                let _ = writeln!(input, ":{c} - [0:0]");
            }
            for c in &ours {
                let _ = writeln!(input, "-X {c}");
            }
            let _ = writeln!(input, "COMMIT");
        }
        if input.is_empty() {
            return Ok(());
        }
        self.backend.restore(&input)
    }
}
