//! The control-plane tables of the nftables, iptables, userspace and
//! socketlb subcommands: model, render and apply timings of one dataplane at
//! 1k-50k Services, applied to the real kernel inside a throwaway network
//! namespace per size (never the host's ruleset). `--floor` (floor.rs),
//! `--encode` (encode.rs) and `--restart` (restart.rs) are variants of the
//! table; the flags are documented on the argument structs below
//! (`kp-bench nftables --help`).

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_iptables::{
    IptablesNetlink, IptablesProxier, Line, Match, Restore, Rule, Target, Variant, Writer,
};
use kp_model::{ChangeTracker, Dataplane, IpFamily, LocalDetector, ProxierConfig};
use kp_nftables::{NftBackend, NftCli, NftNetlink, NftablesProxier};
use kp_userspace::{UserspaceConfig, UserspaceProxier, VipMode};
use std::sync::Arc;

use crate::netns;
// The cluster as API objects and in a tracker, as floor.rs, encode.rs and
// restart.rs take them from here.
use crate::{parsed_cluster, tracked, tracker};

mod encode;
mod floor;
mod restart;

/// What every table subcommand takes: the sizes, the changes timed, and
/// whether the rules reach a kernel at all.
#[derive(clap::Args, Debug, Clone)]
pub struct TableArgs {
    /// Services per row of the table, comma-separated; each size is
    /// programmed into a fresh network namespace.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    pub sizes: Vec<u32>,
    /// Endpoints of each Service.
    #[arg(long, default_value_t = 10)]
    pub endpoints: u32,
    /// How many of each timed change (an endpoint replaced, an endpoint
    /// added, a Service added and deleted): the p50 / p99 columns.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub changes: u64,
    /// Endpoint changes arriving evenly within 1 s for the burst column, a
    /// sync whenever the previous one is done (0: no burst).
    #[arg(long, default_value_t = 1000)]
    pub burst: usize,
    /// One more row after the table: a single Service with this many
    /// endpoints (0: none).
    #[arg(long, default_value_t = 0)]
    pub big: u32,
    /// No Service with session affinity (by default every 20th has it).
    #[arg(long)]
    pub no_affinity: bool,
    /// Model and render only, nothing applied: no root needed, the sync and
    /// change columns are "-".
    #[arg(long)]
    pub no_apply: bool,
    /// Measures one Service with this many ports (and its partial syncs)
    /// instead of the table.
    #[arg(long, value_name = "N")]
    pub ports: Option<u32>,
    /// Milliseconds to wait before each timed endpoint change (and iptables
    /// probe), so that what the kernel defers from one batch (x_tables
    /// destructors after an RCU grace period) is not paid by the next.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub pause: u64,
}

/// How the nftables proxier reaches the kernel.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NftWay {
    /// nf_tables netlink batches, as the product sends them.
    Netlink,
    /// The `nft` program fed the rendered script (cannot program session
    /// affinity with nft 1.0.6: add --no-affinity).
    Nft,
}

/// `kp-bench nftables`.
#[derive(clap::Args, Debug, Clone)]
pub struct NftablesArgs {
    #[command(flatten)]
    pub table: TableArgs,
    /// How the rules reach the kernel.
    #[arg(long, value_enum, default_value_t = NftWay::Netlink)]
    pub backend: NftWay,
    /// Compares the full sync and the changes (an endpoint replaced, an
    /// endpoint added, a Service added) with the kernel alone replaying the
    /// same batches on a bare nf_tables socket (netlink only).
    #[arg(long, conflicts_with = "restart")]
    pub floor: bool,
    /// Times a restart's first sync over the table left behind, adopted and
    /// replaced (netlink only).
    #[arg(long)]
    pub restart: bool,
}

/// How the iptables proxier reaches the kernel.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum IptWay {
    /// iptables-nft's rules as nf_tables netlink batches, as the product
    /// writes them (iptables-legacy always goes through its restore program).
    Netlink,
    /// The iptables-restore program.
    Restore,
}

/// Which iptables the iptables subcommand programs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum IptVariant {
    /// Detected, as the binary does.
    Auto,
    /// iptables-nft.
    Nft,
    /// iptables-legacy.
    Legacy,
}

/// `kp-bench iptables`.
#[derive(clap::Args, Debug, Clone)]
pub struct IptablesArgs {
    #[command(flatten)]
    pub table: TableArgs,
    /// How the rules reach the kernel.
    #[arg(long, value_enum, default_value_t = IptWay::Netlink)]
    pub backend: IptWay,
    /// Which iptables to program.
    #[arg(long, value_enum, default_value_t = IptVariant::Auto)]
    pub iptables_backend: IptVariant,
    /// Times render and encoding alone, no kernel in the figures: a full
    /// sync and one endpoint replaced.
    #[arg(long, conflicts_with = "restart")]
    pub encode: bool,
    /// Times a restart's first sync over the chains left behind, adopted and
    /// replaced (iptables-nft over netlink).
    #[arg(long)]
    pub restart: bool,
}

/// `kp-bench socketlb`.
#[derive(clap::Args, Debug, Clone)]
pub struct SocketLbArgs {
    #[command(flatten)]
    pub table: TableArgs,
    /// Writes the maps one entry per call, without the kernel's batch
    /// commands (what the fallback does on kernels before 5.6).
    #[arg(long)]
    pub one_entry_per_call: bool,
}

fn rss_mib(field: &str) -> f64 {
    crate::lab::status_mib("self", field)
}

pub(crate) fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    crate::lab::quantile(v, p)
}

/// Milliseconds; below 1 ms with three decimals, so that the socket
/// balancer's map updates (tens of µs) do not all read "0.0".
pub(crate) fn ms(d: Duration) -> String {
    let v = d.as_secs_f64() * 1000.0;
    if v < 1.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.1}")
    }
}

fn median(v: &mut [usize]) -> usize {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// One timed endpoint change: (total, Service index, bytes sent, render,
/// apply, tracker update, take_changes).
type ChangeParts = (Duration, u32, usize, Duration, Duration, Duration, Duration);

fn p50_p99(v: &mut [Duration]) -> String {
    format!("{} / {}", ms(pct(v, 0.5)), ms(pct(v, 0.99)))
}

struct Opts {
    mode: String,
    netlink: bool,
    apply: bool,
    changes: usize,
    /// Before each timed endpoint change (and iptables probe): the kernel
    /// finishes what the previous batch left to do in the background.
    pause: Duration,
    burst: usize,
    /// iptables mode's backend (None: detected, as the binary does).
    iptables_backend: Option<Variant>,
    /// socketlb mode: where its programs attach and pin.
    socketlb: Option<SocketLbBench>,
}

impl Opts {
    /// iptables mode writing iptables-nft over netlink: the kernel's floor
    /// can be probed with the same encoder (not with the legacy tables).
    fn iptables_nft_netlink(&self) -> bool {
        self.mode == "iptables" && self.netlink && self.iptables_backend != Some(Variant::Legacy)
    }
}

struct SocketLbBench {
    cgroup: kp_netlab::TestCgroup,
    fs: kp_netlab::TestBpffs,
    runs: std::cell::Cell<u32>,
    /// `--one-entry-per-call`: no batch commands (the fallback's way).
    per_entry: bool,
}

impl SocketLbBench {
    /// A fresh set of programs and maps (the previous run's are removed
    /// first, so sizes do not add up in kernel memory).
    fn dataplane(&self) -> Result<Box<dyn Dataplane>> {
        let run = self.runs.get();
        if run > 0 {
            kp_ebpf::remove(&self.fs.path().join(format!("run{}", run - 1)))?;
        }
        self.runs.set(run + 1);
        let p = kp_ebpf::Placement {
            cgroup: self.cgroup.path().to_path_buf(),
            pin_dir: self.fs.path().join(format!("run{run}")),
        };
        kp_ebpf::install(&p, kp_ebpf::Capacity::default())?;
        self.open(&p.pin_dir)
    }

    /// A second proxier over the current run's maps: what a restarted proxy
    /// finds (its first full sync adopts everything and rewrites nothing).
    fn restarted(&self) -> Result<Box<dyn Dataplane>> {
        let run = self.runs.get().saturating_sub(1);
        self.open(&self.fs.path().join(format!("run{run}")))
    }

    fn open(&self, pin_dir: &std::path::Path) -> Result<Box<dyn Dataplane>> {
        let mut maps = kp_ebpf::KernelMaps::open(pin_dir)?;
        if self.per_entry {
            maps = maps.one_entry_per_call();
        }
        Ok(Box::new(kp_ebpf::SocketLbProxier::new(
            IpFamily::V4,
            Box::new(maps),
        )))
    }
}

/// The proxier configuration of every kp-bench table: IPv4, pods in
/// 10.128.0.0/9 (where kp_bench puts the endpoints).
fn proxier_config() -> ProxierConfig {
    let mut pc = ProxierConfig::new(IpFamily::V4);
    pc.local_detector = LocalDetector::Cidrs(vec!["10.128.0.0/9".parse().expect("cidr")]);
    pc
}

fn dataplane(o: &Opts, wrapper: &str) -> Result<Box<dyn Dataplane>> {
    let pc = proxier_config();
    if let Some(lb) = &o.socketlb {
        return lb.dataplane();
    }
    if o.mode == "userspace" {
        // Called inside the bench's namespace: the proxier's rtnetlink socket
        // (Service IPs on lo) and its listeners are created on this thread,
        // so everything lands there.
        let mut c = UserspaceConfig::from_proxier_config(&pc);
        c.vip_mode = VipMode::Loopback;
        let rt = kp_userspace::runtime()?;
        return Ok(Box::new(UserspaceProxier::new(
            c,
            Arc::new(kp_userspace::NoMetrics),
            rt,
        )?));
    }
    if o.mode == "iptables" {
        return Ok(Box::new(
            IptablesProxier::new(
                pc,
                kp_iptables::select(IpFamily::V4, o.iptables_backend, !o.netlink),
            )
            .with_route_localnet(false),
        ));
    }
    let backend: Box<dyn NftBackend> = if o.netlink {
        Box::new(NftNetlink::new())
    } else {
        Box::new(NftCli {
            program: wrapper.to_string(),
        })
    };
    Ok(Box::new(NftablesProxier::new(pc, backend)))
}

fn run_size(o: &Opts, n: u32, m: u32, affinity: bool, home: &std::fs::File) -> Result<String> {
    let (svcs, slices) = parsed_cluster(n, m, affinity)?;
    let t0 = Instant::now();
    let mut tr = tracked(&svcs, &slices);
    let model = t0.elapsed();
    drop(svcs);
    drop(slices);

    let ns = format!("kpbench{}x{n}x{m}", std::process::id());
    if o.apply {
        in_namespace(&ns, home, |wrapper| {
            measure(o, n, m, affinity, &mut tr, wrapper, model)
        })
    } else {
        measure(o, n, m, affinity, &mut tr, "nft", model)
    }
}

/// Runs `f` with this process inside a fresh network namespace `ns`, then
/// brings it back to `home`; the namespace goes afterwards, whatever `f`
/// returned. `f` gets the path of an `nft` wrapper that runs in `ns` (for
/// the nft-program backend), removed with the namespace.
fn in_namespace<T>(ns: &str, home: &std::fs::File, f: impl FnOnce(&str) -> Result<T>) -> Result<T> {
    let scratch = netns::add(ns)?;
    let wrapper = NftWrapper(format!("/tmp/{ns}-nft"));
    std::fs::write(
        &wrapper.0,
        format!("#!/bin/sh\nexec ip netns exec {ns} nft \"$@\"\n"),
    )?;
    std::process::Command::new("chmod")
        .args(["+x", &wrapper.0])
        .status()?;
    netns::enter(&netns::file(&scratch)?).with_context(|| format!("entering {ns}"))?;
    let result = f(&wrapper.0);
    netns::enter(home)?;
    drop(scratch);
    result
}

/// The `nft` wrapper of [`in_namespace`], removed with its namespace.
struct NftWrapper(String);

impl Drop for NftWrapper {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One Service with `ports` ports and `m` endpoints:
/// model, render, full syncs and the partial syncs that touch it.
fn run_ports(o: &Opts, ports: u32, m: u32, home: &std::fs::File) -> Result<()> {
    let parse = crate::Synthetic::parsed;
    let (svcs, slices) = parse(crate::many_ports(ports, m, 0))?;
    let t0 = Instant::now();
    let mut tr = tracker();
    let now = SystemTime::now();
    for s in &svcs {
        tr.update_service(s, now)
            .map_err(|e| anyhow::anyhow!("{}", e.0))?;
    }
    for s in &slices {
        tr.update_endpoint_slice(s, now)
            .map_err(|e| anyhow::anyhow!("{}", e.0))?;
    }
    tr.take_changes();
    let model = t0.elapsed();
    let programmed = tr.state().services.len();

    let ns = format!("kpbench{}p{ports}", std::process::id());
    let result = in_namespace(&ns, home, |wrapper| -> Result<String> {
        let mut dp = dataplane(o, wrapper)?;
        let t1 = Instant::now();
        let script = dp.render(tr.state());
        let render = t1.elapsed();
        let t = Instant::now();
        dp.sync(tr.state(), &BTreeSet::new(), true)?;
        let full_fresh = t.elapsed();
        let t = Instant::now();
        dp.sync(tr.state(), &BTreeSet::new(), true)?;
        let full_again = t.elapsed();
        // One endpoint replaced: every port of the first slice (100) changes.
        let mut ep = Vec::new();
        for g in 1..=o.changes.min(20) as u32 {
            let (_, sl) = parse(crate::many_ports(ports, m, g))?;
            let t = Instant::now();
            let _ = tr.update_endpoint_slice(&sl[0], SystemTime::now());
            let cs = tr.take_changes();
            dp.sync(tr.state(), &cs.changed, false)?;
            ep.push(t.elapsed());
        }
        // One port more, then one fewer: the Service object changes.
        let (more, _) = parse(crate::many_ports(ports + 1, m, 0))?;
        let t = Instant::now();
        let _ = tr.update_service(&more[0], SystemTime::now());
        let cs = tr.take_changes();
        dp.sync(tr.state(), &cs.changed, false)?;
        let add_port = t.elapsed();
        let t = Instant::now();
        let _ = tr.update_service(&svcs[0], SystemTime::now());
        let cs = tr.take_changes();
        dp.sync(tr.state(), &cs.changed, false)?;
        let del_port = t.elapsed();
        Ok(format!(
            "| {ports} | {programmed} | {m} | {} ms | {} ms ({:.1} MiB) | {} ms | {} ms | {} ms | {} ms | {} ms |",
            ms(model),
            ms(render),
            script.len() as f64 / 1048576.0,
            ms(full_fresh),
            ms(full_again),
            p50_p99(&mut ep),
            ms(add_port),
            ms(del_port),
        ))
    });
    println!("mode: {}", o.mode);
    println!("| ports | service ports programmed | endpoints | model (convert+track) | render full | full sync (empty kernel) | full sync (again) | 1 endpoint replaced p50 / p99 | 1 port added | 1 port removed |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    println!("{}", result?);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
/// The `g`th "one endpoint replaced" change of a table of `n` Services with
/// `m` endpoints: which Service, and its new slice.
fn replacement(n: u32, m: u32, g: u32) -> Result<(u32, EndpointSlice)> {
    let i = (g * 7919) % n;
    let multi = n > 1 && i % 10 == 3;
    Ok((i, serde_json::from_value(crate::slice(i, m, g, multi))?))
}

/// The `g`th "one endpoint added" change: one endpoint more in a Service's
/// slice (the count changes: its selection rule is rewritten).
fn growth(n: u32, m: u32, g: u32) -> Result<EndpointSlice> {
    let i = (g * 7919 + 1) % n;
    let multi = n > 1 && i % 10 == 3;
    Ok(serde_json::from_value(crate::slice(i, m + 1, 0, multi))?)
}

/// The "add 1 Service" changes of a table of `n`: the cluster's next
/// `changes` Services (the same mix) with their slices.
fn additions(
    n: u32,
    m: u32,
    affinity: bool,
    changes: usize,
) -> Result<Vec<(Service, EndpointSlice)>> {
    let extra = crate::cluster_range(n..n + changes as u32, m, affinity);
    extra
        .services
        .into_iter()
        .zip(extra.slices)
        .map(|(s, sl)| Ok((serde_json::from_value(s)?, serde_json::from_value(sl)?)))
        .collect()
}

fn measure(
    o: &Opts,
    n: u32,
    m: u32,
    affinity: bool,
    tr: &mut ChangeTracker,
    wrapper: &str,
    model: Duration,
) -> Result<String> {
    let mut dp = dataplane(o, wrapper)?;
    let t1 = Instant::now();
    let script = dp.render(tr.state());
    let render = t1.elapsed();
    let size = format!(
        "{:.1} MiB, {} lines",
        script.len() as f64 / 1048576.0,
        script.lines().count()
    );
    drop(script);
    if !o.apply {
        return Ok(format!(
            "| {n} | {m} | {} ms | {} ms | {size} | - | - | - | - | - | - | {:.0} MiB |",
            ms(model),
            ms(render),
            rss_mib("VmHWM:")
        ));
    }
    let t2 = Instant::now();
    let r = dp.sync(tr.state(), &BTreeSet::new(), true)?;
    let mut full = format!(
        "{} ms (render {}, apply {})",
        ms(t2.elapsed()),
        ms(r.render),
        ms(r.apply)
    );

    if o.iptables_nft_netlink() {
        iptables_floor(n, o.changes, o.pause)?;
        iptables_full_floor(n, dp.as_mut(), tr)?;
    }

    // One endpoint replaced in one Service, `changes` times.
    let mut lat = Vec::new();
    let mut bytes = Vec::new();
    let mut slowest = Vec::new();
    let multi = |i: u32| n > 1 && i % 10 == 3;
    // iptables over netlink: each change is followed by the kernel's floor,
    // one rule with a verdict into nat, so that the two are compared pair
    // by pair rather than across minutes in which the kernel's time drifts.
    let mut floor = o
        .iptables_nft_netlink()
        .then(|| IptablesNetlink::new(IpFamily::V4));
    let mut floor_lat = Vec::new();
    let floor_probe = [Rule::new(Vec::new(), Target::Return)];
    for g in 1..=o.changes as u32 {
        let (i, s) = replacement(n, m, g)?;
        std::thread::sleep(o.pause);
        let t = Instant::now();
        let _ = tr.update_endpoint_slice(&s, SystemTime::now());
        let updated = t.elapsed();
        let cs = tr.take_changes();
        let taken = t.elapsed();
        let r = dp.sync(tr.state(), &cs.changed, false)?;
        lat.push(t.elapsed());
        bytes.push(r.bytes);
        slowest.push((
            t.elapsed(),
            i,
            r.bytes,
            r.render,
            r.apply,
            updated,
            taken - updated,
        ));
        if let Some(nl) = floor.as_mut() {
            std::thread::sleep(o.pause);
            let t = Instant::now();
            nl.restore(&floor_input(&floor_probe))?;
            floor_lat.push(t.elapsed());
        }
    }
    if let Some(nl) = floor.as_mut() {
        nl.restore(&floor_cleanup())?;
        let mut diff: Vec<f64> = lat
            .iter()
            .zip(&floor_lat)
            .map(|(c, f)| (c.as_secs_f64() - f.as_secs_f64()) * 1e3)
            .collect();
        diff.sort_by(f64::total_cmp);
        let q = |p: f64| diff[((diff.len() - 1) as f64 * p).round() as usize];
        eprintln!(
            "  {n} Services: one endpoint change, each followed by the floor (one rule with a verdict into nat): change p50 / p99 {} ms, floor {} ms; change - floor, pair by pair: p10 {:+.1}, p50 {:+.1}, p90 {:+.1} ms",
            p50_p99(&mut lat.clone()),
            p50_p99(&mut floor_lat),
            q(0.1),
            q(0.5),
            q(0.9)
        );
    }
    // What the tail is made of (on stderr, beside the table): which Service,
    // how much was sent, and where the time went.
    // And each part's own percentiles: a tail can be one part's or spread.
    let part = |f: fn(&ChangeParts) -> Duration| {
        let mut v: Vec<Duration> = slowest.iter().map(f).collect();
        p50_p99(&mut v)
    };
    eprintln!(
        "  {n} Services: endpoint change parts p50 / p99 ms: tracker update {}, take_changes {}, \
         render {}, apply {}",
        part(|s| s.5),
        part(|s| s.6),
        part(|s| s.3),
        part(|s| s.4)
    );
    slowest.sort_by_key(|s| std::cmp::Reverse(s.0));
    for (d, i, b, render, apply, update, take) in slowest.iter().take(3) {
        eprintln!(
            "  {n} Services: slow endpoint change: svc-{i} {} ms ({b} B; tracker update {} ms, \
             take_changes {} ms, render {} ms, apply {} ms)",
            ms(*d),
            ms(*update),
            ms(*take),
            ms(*render),
            ms(*apply)
        );
    }
    let change = if o.socketlb.is_some() {
        // Nothing is "sent": the map writes are the apply time.
        let mut writes: Vec<Duration> = slowest.iter().map(|s| s.4).collect();
        format!(
            "{} ms (map writes {} ms)",
            p50_p99(&mut lat),
            p50_p99(&mut writes)
        )
    } else {
        format!("{} ms ({} B)", p50_p99(&mut lat), median(&mut bytes))
    };

    // One endpoint added to a Service (the count changes: its selection rule
    // is rewritten, which costs the kernel a validation of the whole table).
    let mut grow = Vec::new();
    for g in 1..=o.changes as u32 {
        let s = growth(n, m, g)?;
        let t = Instant::now();
        let _ = tr.update_endpoint_slice(&s, SystemTime::now());
        let cs = tr.take_changes();
        dp.sync(tr.state(), &cs.changed, false)?;
        grow.push(t.elapsed());
    }

    // New Services next to the existing ones, then their deletion.
    // The same mix as the cluster (with or without affinity Services).
    let (mut add, mut del) = (Vec::new(), Vec::new());
    let (mut add_bytes, mut del_bytes) = (Vec::new(), Vec::new());
    for (s, sl) in &additions(n, m, affinity, o.changes)? {
        let t = Instant::now();
        let _ = tr.update_service(s, SystemTime::now());
        let _ = tr.update_endpoint_slice(sl, SystemTime::now());
        let cs = tr.take_changes();
        let r = dp.sync(tr.state(), &cs.changed, false)?;
        add.push(t.elapsed());
        add_bytes.push(r.bytes);
    }
    for k in n..n + o.changes as u32 {
        let t = Instant::now();
        tr.delete_service("bench", &format!("svc-{k}"), SystemTime::now());
        let cs = tr.take_changes();
        let r = dp.sync(tr.state(), &cs.changed, false)?;
        del.push(t.elapsed());
        del_bytes.push(r.bytes);
    }

    // A burst: `burst` endpoint changes arriving evenly within 1 s; a sync runs
    // whenever the previous one is done, with everything that arrived meanwhile.
    let burst = if o.burst > 0 {
        let slices: Vec<EndpointSlice> = (0..o.burst as u32)
            .map(|b| {
                let i = (b * 104_729 + 13) % n;
                serde_json::from_value(crate::slice(i, m, 1000 + b, multi(i)))
            })
            .collect::<Result<_, _>>()?;
        let gap = Duration::from_secs(1) / o.burst as u32;
        let t = Instant::now();
        let mut next = 0usize;
        let mut syncs = 0usize;
        while next < slices.len() {
            let due =
                ((t.elapsed().as_nanos() / gap.as_nanos().max(1)) as usize + 1).min(slices.len());
            if due <= next {
                std::thread::sleep(gap / 4);
                continue;
            }
            for s in &slices[next..due] {
                let _ = tr.update_endpoint_slice(s, SystemTime::now());
            }
            next = due;
            let cs = tr.take_changes();
            dp.sync(tr.state(), &cs.changed, false)?;
            syncs += 1;
        }
        format!("{} ms ({syncs} syncs)", ms(t.elapsed()))
    } else {
        "-".into()
    };
    if let Some(lb) = &o.socketlb {
        // The full sync of a restarted proxy (timed last, so that its
        // memory coming and going does not fall into the figures above):
        // the maps hold everything already; it reads them back and writes
        // nothing.
        let mut again = lb.restarted()?;
        let t = Instant::now();
        let r = again.sync(tr.state(), &BTreeSet::new(), true)?;
        full.push_str(&format!(
            "; after a restart {} ms ({} writes)",
            ms(t.elapsed()),
            r.ops
        ));
    }
    Ok(format!(
        "| {n} | {m} | {} ms | {} ms | {size} | {full} | {change} | {} ms | {} ms ({} B) | {} ms ({} B) | {burst} | {:.0} MiB |",
        ms(model),
        ms(render),
        p50_p99(&mut grow),
        p50_p99(&mut add),
        median(&mut add_bytes),
        p50_p99(&mut del),
        median(&mut del_bytes),
        rss_mib("VmHWM:")
    ))
}

/// The chain of the kernel's floor probes in nat with `rules` (declaring
/// it flushes it first). One rule with a verdict is the floor for
/// upstream's layout: it has nf_tables validate the whole table at commit.
fn floor_input(rules: &[Rule]) -> Restore<'_> {
    let mut input = Restore::default();
    input.push(Line::Table("nat"));
    input.push(Line::Chain("KUBE-FLOOR"));
    for r in rules {
        input.push(Line::Append("KUBE-FLOOR", r));
    }
    input.push(Line::Commit);
    input
}

/// The probes' chain flushed and deleted: how each set of probes ends.
fn floor_cleanup() -> Restore<'static> {
    Restore {
        lines: vec![
            Line::Table("nat"),
            Line::Chain("KUBE-FLOOR"),
            Line::DeleteChain("KUBE-FLOOR"),
            Line::Commit,
        ],
    }
}

/// What the kernel alone costs iptables-nft at this size, whatever writes
/// the rules: one batch adding one rule with a verdict (`-j RETURN`) to an
/// empty chain of `nat` makes nf_tables validate every chain reachable from
/// the table's base chains at commit; the same rule without a verdict does
/// not. Then probes that take one endpoint change apart: the rules of a
/// Service's chain (x_tables matches and a verdict each) written into an
/// empty chain, the same chain flushed and written again, and a chain
/// flushed and deleted. Printed beside the table (stderr).
fn iptables_floor(n: u32, times: usize, pause: Duration) -> Result<()> {
    let mut nl = IptablesNetlink::new(IpFamily::V4);
    // A Service's selection rules: a comment, a probability, a verdict.
    let rules = |k: u32| -> Vec<Rule> {
        (0..k)
            .map(|i| {
                let c = Match::comment(format!("ns/svc:p -> 10.128.0.{i}:80"));
                Rule::new(vec![c, Match::Random { one_in: 10 + i }], Target::Return)
            })
            .collect()
    };
    let verdict = [Rule::new(Vec::new(), Target::Return)];
    let without = [Rule::new(
        vec![Match::src_host([192, 0, 2, 1].into())],
        Target::None,
    )];
    let (one, two, eleven) = (rules(1), rules(2), rules(11));
    // (what, set up before each, timed)
    let probes: Vec<(&str, Option<Restore>, Restore)> = vec![
        ("one rule with a verdict", None, floor_input(&verdict)),
        ("one rule without", None, floor_input(&without)),
        (
            "one rule with matches and a verdict",
            None,
            floor_input(&one),
        ),
        (
            "11 such rules into an empty chain",
            Some(floor_input(&[])),
            floor_input(&eleven),
        ),
        (
            "11 such rules flushed and written again",
            Some(floor_input(&eleven)),
            floor_input(&eleven),
        ),
        (
            "a chain of 2 such rules flushed and deleted",
            Some(floor_input(&two)),
            floor_cleanup(),
        ),
    ];
    let mut row = Vec::new();
    for (what, setup, timed) in probes {
        let mut lat = Vec::new();
        for _ in 0..times.clamp(3, 20) {
            if let Some(setup) = &setup {
                nl.restore(setup)?;
            }
            std::thread::sleep(pause);
            let t = Instant::now();
            nl.restore(&timed)?;
            lat.push(t.elapsed());
        }
        row.push(format!("{what} {} ms", p50_p99(&mut lat)));
    }
    nl.restore(&floor_cleanup())?;
    eprintln!(
        "  {n} Services: kernel floor and probes, each one batch into nat (p50 / p99): {}",
        row.join("; ")
    );
    Ok(())
}

/// How many times each side of [`iptables_full_floor`] runs: the kernel's
/// time for the same batch moves from one run to the next by as much as
/// ours adds to it, so the median needs more than a few.
const FULL_FLOOR_RUNS: usize = 7;

/// A full sync over the table against the kernel alone writing the same
/// rules: ours (render, the jumps checked, encoding, the batch) and the
/// batch of the same restore input encoded beforehand, sent over the same
/// table (every chain flushed and written again), alternately,
/// [`FULL_FLOOR_RUNS`] times each. Printed beside the table (stderr).
///
/// Each timed step starts after a pause as long as the step before it
/// (0.2-5 s): the kernel frees the rules a commit replaced afterwards, on
/// a worker, and without the pause that work ran into the next step.
fn iptables_full_floor(n: u32, dp: &mut dyn Dataplane, tr: &ChangeTracker) -> Result<()> {
    // The full sync's restore input, as `dp` (no host probed) writes it.
    let writes = IptablesProxier::new(
        proxier_config(),
        kp_iptables::select(IpFamily::V4, Some(Variant::Nft), false),
    );
    let mut nl = IptablesNetlink::new(IpFamily::V4);
    let (mut ours, mut kernel, mut encoding) = (Vec::new(), Vec::new(), Vec::new());
    // What ours does before its batch leaves: its render (the jumps checked
    // and the restore input built included) and the encoding of that input.
    let mut beside = Vec::new();
    let settle = |after: Duration| {
        std::thread::sleep(after.clamp(Duration::from_millis(200), Duration::from_secs(5)))
    };
    writes.with_full_input(tr.state(), |input| -> Result<()> {
        let mut last = Duration::ZERO;
        for _ in 0..FULL_FLOOR_RUNS {
            settle(last);
            let t = Instant::now();
            let r = dp.sync(tr.state(), &BTreeSet::new(), true)?;
            ours.push(t.elapsed());
            settle(ours[ours.len() - 1]);
            let t = Instant::now();
            let batch = nl.encode_input(input)?;
            encoding.push(t.elapsed());
            beside.push(r.render + t.elapsed());
            settle(Duration::ZERO);
            let t = Instant::now();
            nl.send_encoded(&batch, input)?;
            last = t.elapsed();
            kernel.push(last);
        }
        Ok(())
    })?;
    // Each of ours against the kernel alone right after it: the kernel's
    // time drifts over a run, and a pair shares the drift.
    let mut pairs: Vec<f64> = ours
        .iter()
        .zip(&kernel)
        .map(|(o, k)| o.as_secs_f64() / k.as_secs_f64().max(1e-9))
        .collect();
    pairs.sort_by(f64::total_cmp);
    let (a, b) = (pct(&mut ours, 0.5), pct(&mut kernel, 0.5));
    eprintln!(
        "  {n} Services: full sync over the table, p50 of {FULL_FLOOR_RUNS}: ours {} ms, the kernel alone (the same rules, encoded beforehand) {} ms: {:.2}x; pair by pair {:.2}x ({:.2}-{:.2}x) (ours {}-{} ms, kernel alone {}-{} ms); encoding them {} ms",
        ms(a),
        ms(b),
        a.as_secs_f64() / b.as_secs_f64().max(1e-9),
        pairs[pairs.len() / 2],
        pairs[0],
        pairs[pairs.len() - 1],
        ms(pct(&mut ours, 0.0)),
        ms(pct(&mut ours, 1.0)),
        ms(pct(&mut kernel, 0.0)),
        ms(pct(&mut kernel, 1.0)),
        ms(pct(&mut encoding, 0.5))
    );
    let c = pct(&mut beside, 0.5);
    eprintln!(
        "  {n} Services: what ours does before its batch leaves (render + encoding), p50 {} ms ({}-{} ms): the kernel alone's p50 plus that is {:.2}x it",
        ms(c),
        ms(pct(&mut beside, 0.0)),
        ms(pct(&mut beside, 1.0)),
        (b + c).as_secs_f64() / b.as_secs_f64().max(1e-9)
    );
    Ok(())
}

/// Which table a subcommand prints.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    Table,
    Floor,
    Encode,
    Restart,
}

/// `kp-bench nftables`.
pub fn nftables(a: NftablesArgs) -> Result<()> {
    let netlink = a.backend == NftWay::Netlink;
    let variant = match (a.floor, a.restart) {
        (true, _) => Shape::Floor,
        (_, true) => Shape::Restart,
        _ => Shape::Table,
    };
    run(&a.table, "nftables", netlink, None, None, variant)
}

/// `kp-bench iptables`.
pub fn iptables(a: IptablesArgs) -> Result<()> {
    let backend = match a.iptables_backend {
        IptVariant::Auto => None,
        IptVariant::Nft => Some(Variant::Nft),
        IptVariant::Legacy => Some(Variant::Legacy),
    };
    let variant = match (a.encode, a.restart) {
        (true, _) => Shape::Encode,
        (_, true) => Shape::Restart,
        _ => Shape::Table,
    };
    let netlink = a.backend == IptWay::Netlink;
    run(&a.table, "iptables", netlink, backend, None, variant)
}

/// `kp-bench userspace`.
pub fn userspace(a: TableArgs) -> Result<()> {
    run(&a, "userspace", true, None, None, Shape::Table)
}

/// `kp-bench socketlb`.
pub fn socketlb(a: SocketLbArgs) -> Result<()> {
    let lb = SocketLbBench {
        cgroup: kp_netlab::TestCgroup::new()?,
        fs: kp_netlab::TestBpffs::new()?,
        runs: std::cell::Cell::new(0),
        per_entry: a.one_entry_per_call,
    };
    run(&a.table, "socketlb", true, None, Some(lb), Shape::Table)
}

fn run(
    t: &TableArgs,
    mode: &str,
    netlink: bool,
    iptables_backend: Option<Variant>,
    socketlb: Option<SocketLbBench>,
    variant: Shape,
) -> Result<()> {
    let (sizes, m, big) = (&t.sizes, t.endpoints, t.big);
    let o = Opts {
        mode: mode.to_string(),
        netlink,
        apply: !t.no_apply,
        changes: t.changes as usize,
        pause: Duration::from_millis(t.pause),
        burst: t.burst,
        iptables_backend,
        socketlb,
    };
    let affinity = !t.no_affinity;
    if affinity && o.mode == "nftables" && !o.netlink {
        // nft 1.0.6 cannot parse the affinity check (a lookup whose key holds
        // constants); the product only talks netlink.
        bail!("--backend nft cannot program session affinity: add --no-affinity");
    }
    if let Some(p) = t.ports {
        return run_ports(&o, p, m, &netns::home()?);
    }
    println!(
        "mode: {}{}; Services with session affinity: {}",
        o.mode,
        match (o.mode.as_str(), o.netlink) {
            ("nftables", true) => " (netlink)",
            ("nftables", false) => " (nft program)",
            ("userspace", _) => " (listeners and Service IPs on lo; nothing sent to netfilter)",
            ("socketlb", _) => " (the socket load balancer's BPF maps alone)",
            (_, netlink) => match o.iptables_backend {
                Some(Variant::Legacy) => " (iptables-legacy-restore)",
                Some(Variant::Nft) if netlink => " (iptables-nft over netlink)",
                Some(Variant::Nft) => " (iptables-nft-restore)",
                None if netlink => " (backend detected; iptables-nft over netlink)",
                None => " (iptables-restore, backend detected)",
            },
        },
        if affinity { "every 20th" } else { "none" }
    );
    // Where to come back to after each size's namespace.
    let home = netns::home()?;

    match variant {
        Shape::Restart => {
            if !o.netlink {
                bail!("--restart measures nftables, or iptables-nft, over netlink");
            }
            return restart::tables(o.mode == "iptables", sizes, m, affinity, &home);
        }
        Shape::Encode => return encode::tables(&o, sizes, m, affinity, &home),
        Shape::Floor => {
            if !o.netlink {
                bail!("--floor measures nftables over netlink");
            }
            return floor::tables(&o, sizes, m, affinity, &home);
        }
        Shape::Table => {}
    }

    println!("| Services | endpoints each | model (convert+track) | render full | ruleset | full sync | 1 endpoint replaced p50 / p99 (bytes sent) | 1 endpoint added p50 / p99 | add 1 Service p50 / p99 (bytes sent) | delete 1 Service p50 / p99 (bytes sent) | burst of {} changes in 1 s | bench peak RSS |", o.burst);
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &n in sizes {
        println!("{}", run_size(&o, n, m, affinity, &home)?);
    }
    if big > 0 {
        let o1 = Opts { burst: 0, ..o };
        println!("{}", run_size(&o1, 1, big, false, &home)?);
    }
    Ok(())
}
