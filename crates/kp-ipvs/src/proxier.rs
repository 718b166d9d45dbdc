//! The IPVS proxier: computes the layout, diffs it against what the kernel
//! holds (read back on full syncs, remembered between them), applies the
//! difference, and drains removed TCP real servers before deleting them.

use std::collections::BTreeSet;
use std::fmt::Write;
use std::net::IpAddr;
use std::time::Instant;

use kp_model::{
    Dataplane, DataplaneError, IpFamily, Known, ProxyState, ServicePortName, Start, SyncReport,
};
use kp_netlink::Sysctl;
use kp_xtables::{IptablesBackend, IptablesCli};

use crate::ipset::{self, IpsetBackend, IpsetCli};
use crate::ipvs::{IpvsClient, VsKey};
use crate::kernel::ConnReuseMode;
use crate::plan::{self, apply_to, diff, IpvsConfig, Layout, Op, VirtualServer};
use crate::rtnl::Rtnl;
use crate::rules;

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default()
}

/// The sysctls IPVS mode needs for `cfg`'s family (paths under /proc/sys and
/// values), given the kernel release: upstream's NewProxier.
pub fn host_sysctls(cfg: &IpvsConfig, kernel_release: &str) -> Vec<(&'static str, i64)> {
    // IPVS connections must go through conntrack for the iptables
    // masquerade rules to see them; connections to deleted real servers
    // expire at once so that clients move to the remaining ones.
    let mut out = vec![("net/ipv4/vs/conntrack", 1)];
    // Kernels 4.1 to 5.8 drop a SYN that reuses a remembered client port
    // unless conn_reuse_mode is 0 (upstream's rule, kernel.rs).
    match crate::kernel::conn_reuse_mode(kernel_release) {
        Some(ConnReuseMode::Disable) => out.push(("net/ipv4/vs/conn_reuse_mode", 0)),
        Some(ConnReuseMode::LeaveAsIs) => {}
        mode => tracing::debug!(
            release = kernel_release.trim(),
            ?mode,
            "net.ipv4.vs.conn_reuse_mode left alone"
        ),
    }
    out.push(("net/ipv4/vs/expire_nodest_conn", 1));
    out.push(("net/ipv4/vs/expire_quiescent_template", 1));
    match cfg.proxier.family {
        IpFamily::V4 => {
            out.push(("net/ipv4/ip_forward", 1));
            if cfg.strict_arp {
                out.push(("net/ipv4/conf/all/arp_ignore", 1));
                out.push(("net/ipv4/conf/all/arp_announce", 2));
            }
        }
        IpFamily::V6 => out.push(("net/ipv6/conf/all/forwarding", 1)),
    }
    out
}

/// The host settings IPVS mode needs, what `--init-only` applies for it: the
/// [`host_sysctls`] (an error is fatal there, as upstream) and the IPVS
/// connection timeouts when set (a failure is only logged, as upstream).
/// Values already in place are not written. Returns the sysctls written.
pub fn init_host(cfg: &IpvsConfig) -> Result<Vec<(&'static str, i64)>, DataplaneError> {
    let sysctl = Sysctl::new();
    let mut written = Vec::new();
    for (name, value) in host_sysctls(cfg, &kernel_release()) {
        let changed = sysctl.ensure(name, value).map_err(|e| DataplaneError::Io {
            what: e.what,
            source: e.source,
        })?;
        if changed {
            written.push((name, value));
        }
    }
    let (t, f, u) = (cfg.tcp_timeout, cfg.tcp_fin_timeout, cfg.udp_timeout);
    // The timeouts are global to IPVS: set once, with the IPv4 proxier.
    if (t, f, u) != (0, 0, 0) && cfg.proxier.family == IpFamily::V4 {
        let set = IpvsClient::open().and_then(|mut c| c.set_timeouts(t, f, u));
        if let Err(e) = set {
            tracing::error!(error = %e, "cannot set the IPVS timeouts");
        }
    }
    Ok(written)
}

/// The dummy interface holding the Service IPs (upstream's name).
pub const DUMMY_DEV: &str = "kube-ipvs0";

pub struct IpvsProxier {
    cfg: IpvsConfig,
    ipset: Box<dyn IpsetBackend>,
    iptables: Box<dyn IptablesBackend>,
    ipvs: Option<IpvsClient>,
    /// What the kernel holds after the last successful sync; nothing known
    /// forces a full sync that reads the kernel back.
    known: Known<Layout>,
    /// This node's addresses (not kube-ipvs0's), refreshed on full syncs.
    local_ips: Vec<IpAddr>,
}

fn io(what: impl Into<String>, e: std::io::Error) -> DataplaneError {
    DataplaneError::Io {
        what: what.into(),
        source: e,
    }
}

fn usable_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v) => !v.is_loopback() && !v.is_unspecified(),
        IpAddr::V6(v) => {
            !v.is_loopback() && !v.is_unspecified() && (v.segments()[0] & 0xffc0) != 0xfe80
        }
    }
}

impl IpvsProxier {
    pub fn new(cfg: IpvsConfig) -> Self {
        let family = cfg.proxier.family;
        let local_ips = cfg.proxier.node_ips.clone();
        IpvsProxier {
            cfg,
            ipset: Box::new(IpsetCli),
            iptables: Box::new(IptablesCli::auto(family)),
            ipvs: None,
            known: Known::default(),
            local_ips,
        }
    }

    fn family(&self) -> IpFamily {
        self.cfg.proxier.family
    }

    fn client(&mut self) -> Result<&mut IpvsClient, DataplaneError> {
        if self.ipvs.is_none() {
            self.ipvs = Some(IpvsClient::open().map_err(|e| io("opening IPVS", e))?);
        }
        self.ipvs
            .as_mut()
            .ok_or_else(|| DataplaneError::Unsupported("IPVS client".into()))
    }

    fn ensure_sysctls(&self) {
        // Not fatal here (upstream fails at start, --init-only included):
        // without a writable /proc/sys, and no --init-only before, the
        // settings stay as the node has them.
        let sysctl = Sysctl::new();
        for (name, value) in host_sysctls(&self.cfg, &kernel_release()) {
            match sysctl.ensure(name, value) {
                Ok(true) => tracing::info!(sysctl = name, value, "set sysctl"),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "cannot set sysctl"),
            }
        }
    }

    fn af(&self) -> u8 {
        match self.family() {
            IpFamily::V4 => libc::AF_INET as u8,
            IpFamily::V6 => libc::AF_INET6 as u8,
        }
    }

    /// Reads back what the kernel holds for our family, and this node's
    /// addresses. Creates kube-ipvs0 if missing.
    fn read_kernel(&mut self) -> Result<(Layout, i32), DataplaneError> {
        let fam = self.family();
        let mut rtnl = Rtnl::open().map_err(|e| io("opening rtnetlink", e))?;
        let index = rtnl
            .ensure_dummy(DUMMY_DEV)
            .map_err(|e| io(format!("creating {DUMMY_DEV}"), e))?;
        let addrs = rtnl
            .addrs(self.af())
            .map_err(|e| io("listing addresses", e))?;
        let mut layout = Layout::default();
        let mut local = Vec::new();
        for a in addrs {
            let ip = a.net.addr();
            if !fam.matches(&ip) {
                continue;
            }
            if a.index as i32 == index {
                layout.bound.insert(ip);
            } else if usable_local(&ip) {
                local.push(ip);
            }
        }
        local.sort();
        local.dedup();
        self.local_ips = local;
        let save = self.ipset.save()?;
        layout.sets = ipset::parse_save(&save, fam);
        let client = self.client()?;
        let services = client
            .services()
            .map_err(|e| io("listing IPVS services", e))?;
        for (key, spec) in services {
            if !fam.matches(&key.addr) {
                continue;
            }
            let dests = client
                .dests(&key)
                .map_err(|e| io("listing IPVS real servers", e))?;
            layout.services.insert(
                key,
                VirtualServer {
                    spec,
                    dests: dests.iter().map(|d| (d.rs, d.weight)).collect(),
                    owner: String::new(),
                },
            );
        }
        Ok((layout, index))
    }

    /// The fixed part: sets exist, iptables chains and jumps, timeouts.
    fn ensure_base(&mut self) -> Result<(), DataplaneError> {
        self.ensure_sysctls();
        self.ipset.restore(&ipset::create_lines(self.family()))?;
        // Which jumps are missing, from one listing per table (each program
        // run counts: a full sync should not cost two runs per jump).
        let jumps = rules::jumps();
        let mut missing = Vec::new();
        for table in ["nat", "filter"] {
            let listed = self.iptables.save_table(table)?;
            missing.extend(kp_xtables::missing_jumps(&jumps, table, &listed));
        }
        let input = rules::with_jumps(&rules::restore_input(&self.cfg.proxier), &missing);
        self.iptables.restore(&input)?;
        let (t, f, u) = (
            self.cfg.tcp_timeout,
            self.cfg.tcp_fin_timeout,
            self.cfg.udp_timeout,
        );
        if (t, f, u) != (0, 0, 0) && self.family() == IpFamily::V4 {
            self.client()?
                .set_timeouts(t, f, u)
                .map_err(|e| io("setting IPVS timeouts", e))?;
        }
        Ok(())
    }

    /// Applies `ops` in order; ipset changes go in one `ipset restore` per run
    /// of consecutive set operations. On error, returns how many applied.
    fn apply(&mut self, ops: &[Op], index: i32) -> Result<(), DataplaneError> {
        let mut rtnl: Option<Rtnl> = None;
        let mut i = 0;
        while i < ops.len() {
            if matches!(ops[i], Op::SetAdd(..) | Op::SetDel(..)) {
                let mut input = String::new();
                while i < ops.len() {
                    match &ops[i] {
                        Op::SetAdd(s, e, c) => input.push_str(&ipset::add_line(s, e, c)),
                        Op::SetDel(s, e) => input.push_str(&ipset::del_line(s, e)),
                        _ => break,
                    }
                    i += 1;
                }
                self.ipset.restore(&input)?;
                continue;
            }
            let op = &ops[i];
            i += 1;
            match op {
                Op::Bind(ip) | Op::Unbind(ip) => {
                    if rtnl.is_none() {
                        rtnl = Some(Rtnl::open().map_err(|e| io("opening rtnetlink", e))?);
                    }
                    let r = rtnl
                        .as_mut()
                        .ok_or_else(|| DataplaneError::Unsupported("rtnetlink".into()))?;
                    let res = if matches!(op, Op::Bind(_)) {
                        r.add_addr(index, ip)
                    } else {
                        r.del_addr(index, ip)
                    };
                    res.map_err(|e| io(format!("{op} on {DUMMY_DEV}"), e))?;
                }
                _ => {
                    let c = self.client()?;
                    let res = match op {
                        Op::AddService(k, s) => c.add_service(k, s),
                        Op::UpdateService(k, s) => c.update_service(k, s),
                        Op::DelService(k) => c.del_service(k),
                        Op::AddDest(k, r, w) => c.add_dest(k, r, *w),
                        Op::SetWeight(k, r, w) => c.set_dest(k, r, *w),
                        Op::DelDest(k, r) => c.del_dest(k, r),
                        _ => Ok(()),
                    };
                    res.map_err(|e| DataplaneError::Apply {
                        tool: "IPVS netlink".into(),
                        message: e.to_string(),
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Deletes drained real servers (weight 0, not wanted) once they have no
    /// connections left: upstream's graceful termination.
    fn reap_drained(&mut self, layout: &mut Layout, want: &Layout) {
        let drained: Vec<(VsKey, Vec<crate::ipvs::RealServer>)> = layout
            .services
            .iter()
            .filter_map(|(k, v)| {
                let w = want.services.get(k);
                let rs: Vec<_> = v
                    .dests
                    .iter()
                    .filter(|(r, wt)| **wt == 0 && w.is_none_or(|w| !w.dests.contains_key(r)))
                    .map(|(r, _)| *r)
                    .collect();
                (!rs.is_empty()).then(|| (k.clone(), rs))
            })
            .collect();
        for (key, rss) in drained {
            let Ok(client) = self.client() else { return };
            let Ok(infos) = client.dests(&key) else {
                continue;
            };
            for rs in rss {
                let busy = infos
                    .iter()
                    .find(|d| d.rs == rs)
                    .map(|d| d.active + d.inactive > 0);
                if busy == Some(true) {
                    continue;
                }
                match client.del_dest(&key, &rs) {
                    Ok(()) => {
                        tracing::debug!(vs = %key, rs = %rs, "drained real server deleted");
                        if let Some(v) = layout.services.get_mut(&key) {
                            v.dests.remove(&rs);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(vs = %key, rs = %rs, error = %e, "deleting a drained real server")
                    }
                }
            }
        }
    }

    /// The layout a full sync of `state` would leave, with the addresses
    /// known so far.
    pub fn layout(&self, state: &ProxyState) -> Layout {
        plan::plan(state, &self.cfg, &self.local_ips)
    }

    fn keep(&self) -> impl Fn(&VsKey) -> bool + '_ {
        move |k: &VsKey| self.cfg.excluded(&k.addr) || !self.family().matches(&k.addr)
    }
}

impl Dataplane for IpvsProxier {
    fn mode(&self) -> kp_model::ProxyMode {
        kp_model::ProxyMode::Ipvs
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        _changed: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        let t0 = Instant::now();
        let start = self.known.begin(full);
        let is_full = start.is_full();
        // Partial syncs diff against what we programmed: only the changed
        // virtual and real servers are touched. Full syncs read the kernel
        // back, which also repairs anything changed behind our back.
        let (cur, index) = match start {
            Start::Full { .. } => {
                self.ensure_base()?;
                self.read_kernel()?
            }
            Start::Partial { prev } => {
                let mut rtnl = Rtnl::open().map_err(|e| io("opening rtnetlink", e))?;
                let index = rtnl
                    .link_index(DUMMY_DEV)
                    .map_err(|e| io("finding kube-ipvs0", e))?
                    .ok_or_else(|| DataplaneError::Apply {
                        tool: "rtnetlink".into(),
                        message: format!("{DUMMY_DEV} disappeared"),
                    })?;
                (prev, index)
            }
        };
        let want = self.layout(state);
        let ops = {
            let keep = self.keep();
            diff(&cur, &want, &keep)
        };
        let render = t0.elapsed();
        let t1 = Instant::now();
        self.apply(&ops, index)?;
        let mut layout = cur;
        apply_to(&mut layout, &ops, &want);
        self.reap_drained(&mut layout, &want);
        let mut report = SyncReport {
            full: is_full,
            bytes: 0,
            ops: ops.len(),
            render,
            apply: t1.elapsed(),
            ..Default::default()
        };
        for (name, sp) in &state.services {
            let sel = kp_model::EndpointSelection::new(sp, state.endpoints_of(name), &state.node);
            let (internal, external) = sel.no_local();
            report.no_local_endpoints.0 += u64::from(internal);
            report.no_local_endpoints.1 += u64::from(external);
        }
        tracing::debug!(ops = ops.len(), full = is_full, "ipvs sync applied");
        self.known.done(layout);
        Ok(report)
    }

    fn render(&self, state: &ProxyState) -> String {
        let want = self.layout(state);
        let fam = self.family();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# IPVS virtual servers ({fam}), as `ipvsadm -S -n` lists them"
        );
        for (k, v) in &want.services {
            let flag = match k.protocol {
                kp_model::Protocol::Tcp => "-t",
                kp_model::Protocol::Udp => "-u",
                kp_model::Protocol::Sctp => "--sctp-service",
            };
            let vip = std::net::SocketAddr::new(k.addr, k.port);
            let persist = v
                .spec
                .persistence
                .map(|t| format!(" -p {t}"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "-A {flag} {vip} -s {}{persist}  # {}",
                v.spec.scheduler, v.owner
            );
            for (rs, w) in &v.dests {
                let _ = writeln!(out, "-a {flag} {vip} -r {rs} -m -w {w}");
            }
        }
        let _ = writeln!(out, "# addresses on {DUMMY_DEV}");
        for ip in &want.bound {
            let p = if ip.is_ipv4() { 32 } else { 128 };
            let _ = writeln!(out, "{ip}/{p}");
        }
        let _ = writeln!(out, "# ipset restore -exist input");
        out.push_str(&ipset::create_lines(fam));
        for (set, entries) in &want.sets {
            for (e, c) in entries {
                out.push_str(&ipset::add_line(set, e, c));
            }
        }
        let _ = writeln!(out, "# iptables-restore --noflush input");
        out.push_str(&rules::restore_input(&self.cfg.proxier));
        let _ = writeln!(out, "# jumps ensured in builtin chains:");
        for j in rules::jumps() {
            let _ = writeln!(out, "# -t {} {}", j.table, j.save_line());
        }
        out
    }

    fn rules_lost(&mut self) -> bool {
        // kube-ipvs0 gone (or our filter chain flushed away) means someone
        // removed our state: the next sync must be a full one. What cannot
        // be read counts as there.
        let iptables = &mut self.iptables;
        self.known.check_lost("ipvs", || {
            let dev = Rtnl::open().and_then(|mut r| r.link_index(DUMMY_DEV));
            let chain = iptables.chain_exists("filter", "KUBE-IPVS-FILTER");
            Ok::<_, std::convert::Infallible>(
                !(matches!(dev, Ok(None)) || matches!(chain, Ok(false))),
            )
        })
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        self.known.forget();
        let fam = self.family();
        for j in rules::jumps() {
            for _ in 0..16 {
                match self.iptables.rule_exists(j.table, j.from, &j.args()) {
                    Ok(true) => self.iptables.delete_rule(j.table, j.from, &j.args())?,
                    _ => break,
                }
            }
        }
        let mut input = String::new();
        for table in ["nat", "filter"] {
            let ours: Vec<String> = self
                .iptables
                .chains(table)?
                .into_iter()
                .filter(|c| rules::is_our_chain(table, c))
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
        if !input.is_empty() {
            self.iptables.restore(&input)?;
        }
        for d in ipset::SETS {
            self.ipset.destroy(&ipset::name(d.name, fam))?;
        }
        // Without IPVS in the kernel there is nothing to remove there.
        if let Ok(mut c) = IpvsClient::open() {
            let services = c.services().map_err(|e| io("listing IPVS services", e))?;
            for (k, _) in services {
                if fam.matches(&k.addr) && !self.cfg.excluded(&k.addr) {
                    c.del_service(&k)
                        .map_err(|e| io("deleting a virtual server", e))?;
                }
            }
        }
        let mut rtnl = Rtnl::open().map_err(|e| io("opening rtnetlink", e))?;
        if let Some(i) = rtnl
            .link_index(DUMMY_DEV)
            .map_err(|e| io("finding kube-ipvs0", e))?
        {
            rtnl.delete_link(i)
                .map_err(|e| io("deleting kube-ipvs0", e))?;
        }
        Ok(())
    }
}
