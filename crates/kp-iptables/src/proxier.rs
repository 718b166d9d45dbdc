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

use kp_xtables::{Adopted, Jump};

use crate::render::{
    is_our_chain, jumps, render_service_with, HostRules, ServiceRules, Skeleton, CANARY_CHAIN,
    EXTERNAL_CHAIN, FIREWALL_CHAIN, FORWARD_CHAIN, MANGLE_CHAINS, NAT_CHAINS, NODEPORTS_CHAIN,
    SERVICES_CHAIN,
};
use crate::types::{Line, Restore, Rule};
use crate::writer::Writer;

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

/// The rules a sync writes besides the Services': the top-level chains'
/// own, and the jumps from builtin chains. Apart from the proxier's other
/// fields: a restore input borrows them while the writer is in use.
struct Fixed {
    skeleton: Skeleton,
    /// The skeleton's fixed rules of nat and filter KUBE-FORWARD, made once
    /// (KUBE-FORWARD again when the host was probed).
    nat_static: Vec<(&'static str, Vec<Rule>)>,
    forward: Vec<Rule>,
    /// Every jump from a builtin chain into ours, with its rule: a full
    /// sync inserts the missing ones.
    jumps: Vec<(Jump, Rule)>,
}

pub struct IptablesProxier {
    cfg: ProxierConfig,
    fixed: Fixed,
    /// What the node decides (be_liberal, nfacct); [`HostRules::probe`]d at
    /// the first sync when `probe_host`.
    host: HostRules,
    probe_host: bool,
    /// Rules of the top-level chains as last worked out: (filter, nat).
    top_rules: (u64, u64),
    backend: Box<dyn Writer>,
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

/// A per-service chain and its rules.
type OwnChain = (String, Vec<Rule>);

/// What a restore input does with the top-level chains.
enum Top {
    /// Work them out from every Service; write those whose hash differs
    /// from this (all without one).
    Compare(Option<TopLevel>),
    /// They are as last written, with these hashes: nothing to write.
    AsLast(TopLevel),
}

/// What a sync writes, worked out before its restore input is built (the
/// input borrows the rules).
struct Plan {
    services: BTreeMap<ServicePortName, ServiceRules>,
    /// The per-service chains to write: every one, or those of the changed
    /// Services named here.
    write: Option<BTreeSet<String>>,
    delete: BTreeSet<String>,
    missing: Vec<Jump>,
    top: Top,
}

/// One restore input, and what it writes.
struct Script<'a> {
    input: Restore<'a>,
    /// Rules appended per table: (filter, nat).
    rules: (u64, u64),
    /// The top-level chains' rules per table, when worked out.
    top_rules: (Option<u64>, Option<u64>),
}

/// Services from which a full sync renders them on two threads.
const RENDER_SPLIT_AT: usize = 500;

impl IptablesProxier {
    pub fn new(cfg: ProxierConfig, backend: Box<dyn Writer>) -> Self {
        let skeleton = Skeleton::new(&cfg);
        let (nat_static, forward) = (skeleton.nat_static(), skeleton.forward_rules());
        let manage_route_localnet = cfg.localhost_nodeports && cfg.family == IpFamily::V4;
        let jumps = jumps()
            .into_iter()
            .map(|j| {
                let r = Rule::jump(&j);
                (j, r)
            })
            .collect();
        IptablesProxier {
            cfg,
            fixed: Fixed {
                skeleton,
                nat_static,
                forward,
                jumps,
            },
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
        self.fixed.forward = self.fixed.skeleton.forward_rules_for(&host);
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

    /// Restores `input` keeping the chains a previous run left that are
    /// already right: (operations, bytes) sent, and what was found when the
    /// writer reads rules back. If the kernel refuses the difference, the whole
    /// input is restored in the same call.
    fn restore_adopting(
        backend: &mut dyn Writer,
        family: IpFamily,
        input: &Restore<'_>,
    ) -> Result<((usize, usize), Option<Adopted>), DataplaneError> {
        let t0 = Instant::now();
        match backend.restore_adopting(input) {
            Ok((bytes, Some(a))) => {
                if !a.found_previous() {
                    tracing::debug!(
                        family = ?family,
                        read_ms = a.read.as_millis() as u64,
                        "no chains of a previous run to adopt"
                    );
                } else {
                    tracing::info!(
                        family = ?family,
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
                Ok(((a.lines_sent, bytes), Some(a)))
            }
            Ok((bytes, None)) => Ok(((input.lines.len(), bytes), None)),
            Err(e) => {
                tracing::warn!(error = %e, "could not adopt the rules a previous run left; rewriting every chain");
                let bytes = backend.restore(input)?;
                Ok(((input.lines.len(), bytes), None))
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
}

impl Fixed {
    /// The top-level chains of `table` with their rules, in the order
    /// they are written.
    fn top_level<'a>(
        &'a self,
        services: &'a BTreeMap<ServicePortName, ServiceRules>,
        table: &str,
    ) -> Vec<(&'static str, Vec<&'a Rule>)> {
        let all = || services.values();
        let rules =
            |f: fn(&ServiceRules) -> &Vec<Rule>| -> Vec<&'a Rule> { all().flat_map(f).collect() };
        let sk = &self.skeleton;
        match table {
            "filter" => vec![
                (SERVICES_CHAIN, rules(|s| &s.filter_services)),
                (EXTERNAL_CHAIN, rules(|s| &s.filter_external)),
                (FORWARD_CHAIN, self.forward.iter().collect()),
                (NODEPORTS_CHAIN, rules(|s| &s.filter_nodeports)),
                (
                    FIREWALL_CHAIN,
                    sk.firewall_head
                        .iter()
                        .chain(all().flat_map(|s| &s.filter_firewall))
                        .collect(),
                ),
            ],
            _ => {
                let mut v: Vec<(&'static str, Vec<&'a Rule>)> = self
                    .nat_static
                    .iter()
                    .map(|(c, rules)| (*c, rules.iter().collect()))
                    .collect();
                v.push((
                    SERVICES_CHAIN,
                    all()
                        .flat_map(|s| &s.nat_services)
                        .chain(&sk.nodeport_jumps)
                        .collect(),
                ));
                v.push((NODEPORTS_CHAIN, rules(|s| &s.nat_nodeports)));
                v
            }
        }
    }

    /// The restore input. Of the top-level chains those whose rules differ
    /// from the last (all without a last) are rewritten, none when `top`
    /// says they are as last written; of the per-service chains those in
    /// `own`; `delete` are removed; the `missing` jumps inserted. Also
    /// returns the top-level chains' hashes as written.
    fn script<'a>(
        &'a self,
        services: &'a BTreeMap<ServicePortName, ServiceRules>,
        own: &[&'a OwnChain],
        delete: &'a BTreeSet<String>,
        missing: &[Jump],
        top: Top,
    ) -> (Script<'a>, TopLevel) {
        let mut r = Script {
            input: Restore::default(),
            rules: (0, 0),
            top_rules: (None, None),
        };
        let (last, mut hashes, compare) = match top {
            Top::Compare(last) => (last, TopLevel::new(), true),
            Top::AsLast(last) => (None, last, false),
        };
        let input = &mut r.input;
        // Everything written (a full sync, a dry run): with the canary.
        if compare && last.is_none() {
            input.push(Line::Table("mangle"));
            for c in MANGLE_CHAINS {
                input.push(Line::Chain(c));
            }
            input.push(Line::Commit);
        }
        for table in ["filter", "nat"] {
            // Listing and hashing every Service's top-level rules is most of
            // a one-endpoint change's render at 10k Services (~10 ms): skipped
            // when the changed Services' rules are the ones last written.
            let mut chains = if compare {
                self.top_level(services, table)
            } else {
                Vec::new()
            };
            let nat = table == "nat";
            if compare {
                let n = Some(chains.iter().map(|(_, l)| l.len() as u64).sum());
                if nat {
                    r.top_rules.1 = n;
                } else {
                    r.top_rules.0 = n;
                }
            }
            // A top-level chain whose rules did not change is left as it is
            // in the kernel: one endpoint change then rewrites only its
            // Service's chains, not KUBE-SERVICES with a rule per Service.
            chains.retain(|(c, rules)| {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                rules.hash(&mut h);
                let h = h.finish();
                hashes.insert((table, c), h);
                last.as_ref().and_then(|l| l.get(&(table, c))) != Some(&h)
            });
            let own: &[&OwnChain] = if nat { own } else { &[] };
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
            input.push(Line::Table(table));
            for (c, _) in &chains {
                input.push(Line::Chain(c));
            }
            for (c, _) in own {
                input.push(Line::Chain(c));
            }
            if nat {
                // Declaring a chain flushes it; a stale chain must be empty to go.
                for c in delete {
                    input.push(Line::Chain(c));
                }
            }
            for (c, rules) in &chains {
                input
                    .lines
                    .extend(rules.iter().map(|rule| Line::Append(c, rule)));
            }
            for (c, rules) in own {
                input
                    .lines
                    .extend(rules.iter().map(|rule| Line::Append(c, rule)));
            }
            if nat {
                input
                    .lines
                    .extend(delete.iter().map(|c| Line::DeleteChain(c)));
            }
            // The jumps in the same restore as the chains they lead to: a
            // separate `iptables -C`/`-I` against a large table costs as much
            // as the restore itself.
            for (j, rule) in self.jumps.iter().filter(|(j, _)| j.table == table) {
                if missing.contains(j) {
                    input.push(Line::Insert(j.from, rule));
                }
            }
            input.push(Line::Commit);
        }
        (r, hashes)
    }
}

impl IptablesProxier {
    /// The restore input of a full sync of `state` (dry runs print it;
    /// benchmarks encode it), given to `f`.
    pub fn with_full_input<R>(&self, state: &ProxyState, f: impl FnOnce(&Restore<'_>) -> R) -> R {
        let services = self.render_all(state);
        let own: Vec<&OwnChain> = services.values().flat_map(|s| &s.nat_chains).collect();
        let none = BTreeSet::new();
        let (script, _) = self
            .fixed
            .script(&services, &own, &none, &[], Top::Compare(None));
        f(&script.input)
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
    ) -> Result<Plan, DataplaneError> {
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
        Ok(Plan {
            services,
            write: None,
            delete,
            missing,
            top: Top::Compare(None),
        })
    }

    fn partial_sync(
        &self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        mut services: BTreeMap<ServicePortName, ServiceRules>,
        written: TopLevel,
    ) -> Plan {
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
        Plan {
            services,
            write: Some(write_owned),
            delete,
            missing: Vec::new(),
            top: if top_as_last {
                Top::AsLast(written)
            } else {
                Top::Compare(Some(written))
            },
        }
    }
}

impl Plan {
    /// The per-service chains to write: every Service's (`write` None), or
    /// the changed Services' named in `write`, in the order of the Services
    /// and of their chains.
    fn own<'a>(&'a self, changed: &BTreeSet<ServicePortName>) -> Vec<&'a OwnChain> {
        match &self.write {
            None => self.services.values().flat_map(|s| &s.nat_chains).collect(),
            Some(write) => changed
                .iter()
                .filter_map(|name| self.services.get(name))
                .flat_map(|s| &s.nat_chains)
                .filter(|(c, _)| write.contains(c))
                .collect(),
        }
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
            self.fixed.forward = self.fixed.skeleton.forward_rules_for(&host);
            self.host = host;
            self.probe_host = false;
            self.known.forget();
        }
        let start = self.known.begin(full);
        let is_full = start.is_full();
        let mut plan = match start {
            Start::Partial { prev } => self.partial_sync(state, changed, prev.services, prev.top),
            Start::Full { last } => self.full_sync(state, last.as_ref().map(|l| &l.services))?,
        };
        let top = std::mem::replace(&mut plan.top, Top::Compare(None));
        let own = plan.own(changed);
        let (script, hashes) =
            self.fixed
                .script(&plan.services, &own, &plan.delete, &plan.missing, top);
        let render = t0.elapsed();
        let t1 = Instant::now();
        if is_full {
            self.ensure_route_localnet();
        }
        let input = &script.input;
        let (mut ops, mut bytes) = (0, 0);
        if !input.is_empty() {
            if is_full && self.adopt {
                let found;
                ((ops, bytes), found) =
                    Self::restore_adopting(self.backend.as_mut(), self.cfg.family, input)?;
                if found.is_some() {
                    self.last_adoption = found;
                }
            } else {
                bytes = self.backend.restore(input)?;
                ops = input.lines.len();
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
        let (rules, top_rules) = (script.rules, script.top_rules);
        drop(own);
        drop(script);
        let mut chain_rules = 0u64;
        for s in plan.services.values() {
            report.no_local_endpoints.0 += s.no_local.0 as u64;
            report.no_local_endpoints.1 += s.no_local.1 as u64;
            chain_rules += s
                .nat_chains
                .iter()
                .map(|(_, r)| r.len() as u64)
                .sum::<u64>();
        }
        if let Some(n) = top_rules.0 {
            self.top_rules.0 = n;
        }
        if let Some(n) = top_rules.1 {
            self.top_rules.1 = n;
        }
        report.iptables_rules = vec![
            ("filter", self.top_rules.0, rules.0),
            ("nat", self.top_rules.1 + chain_rules, rules.1),
        ];
        self.known.done(Programmed {
            services: plan.services,
            top: hashes,
        });
        Ok(report)
    }

    fn render(&self, state: &ProxyState) -> String {
        let mut out = self.with_full_input(state, |input| input.text());
        // Not part of the restore input: what a full sync also ensures.
        out.push_str("# jumps ensured in builtin chains:\n");
        for (j, _) in &self.fixed.jumps {
            let _ = writeln!(out, "# -t {} {}", j.table, j.save_line());
        }
        out
    }

    fn rules_lost(&mut self) -> bool {
        // The mangle canary catches a whole-ruleset flush (upstream's check);
        // `iptables -t nat -F` keeps every chain but empties them, so also
        // check that nat PREROUTING still jumps to KUBE-SERVICES.
        let services_jump = self
            .fixed
            .jumps
            .iter()
            .map(|(j, _)| j)
            .find(|j| j.table == "nat" && j.from == "PREROUTING");
        let backend = &mut self.backend;
        self.known.check_lost("iptables", || {
            backend
                .chain_exists("mangle", CANARY_CHAIN)
                .and_then(|canary| match (canary, services_jump) {
                    (true, Some(j)) => backend.jump_exists(j),
                    (c, _) => Ok(c),
                })
        })
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        self.known.forget();
        // Jumps first: a referenced chain cannot be deleted. A rule may have
        // been added more than once (by hand, or a crashed older version).
        for (j, _) in &self.fixed.jumps {
            for _ in 0..16 {
                match self.backend.jump_exists(j) {
                    Ok(true) => self.backend.delete_jump(j)?,
                    _ => break,
                }
            }
        }
        let mut ours: Vec<(&'static str, Vec<String>)> = Vec::new();
        for table in ["mangle", "filter", "nat"] {
            let chains: Vec<String> = self
                .backend
                .chains(table)?
                .into_iter()
                .filter(|c| is_our_chain(table, c))
                .collect();
            if !chains.is_empty() {
                ours.push((table, chains));
            }
        }
        let mut input = Restore::default();
        for (table, chains) in &ours {
            input.push(Line::Table(table));
            input.lines.extend(chains.iter().map(|c| Line::Chain(c)));
            input
                .lines
                .extend(chains.iter().map(|c| Line::DeleteChain(c)));
            input.push(Line::Commit);
        }
        if input.is_empty() {
            return Ok(());
        }
        self.backend.restore(&input).map(|_| ())
    }
}
