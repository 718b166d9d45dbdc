//! `kp-bench prog`: the eBPF datapath's programs alone, timed by
//! the kernel with `BPF_PROG_TEST_RUN` on crafted frames (issue 64, 3a).
//!
//! Each run hands the kernel one frame (`repeat` 1): the programs rewrite
//! the frame they are given, so a frame run again would no longer be the
//! packet being timed (its TTL, then its addresses, change). The kernel
//! times the program alone (its `duration`); the syscall around it is not
//! in the figures. A round is `--repeats / --rounds` runs; a figure is the
//! median over the rounds of each round's mean.
//!
//! Cases: a flow's first packet (a fresh client port every run), an
//! established flow's request and its reply, for TCP and UDP, IPv4 and
//! IPv6, with the maps filled as at each of `--services` Service ports
//! (`--endpoints` each, and as many other flows in the flow tables up to
//! their size), and a calibration row (an ARP frame, which the program
//! leaves at its first check: the floor of a run).
//!
//! `--xdp` times XDP's `kp_np_xdp` (xdp.o) the same way instead, with
//! eth0 running an XDP program that passes everything (the test run gives
//! an XDP program its ingress interface only where the queue's XDP info is
//! registered).
//!
//! `--against DIR` loads a second build's objects (DIR/tc.o, or xdp.o) beside this
//! binary's own, each over maps of its own, and alternates the two round
//! by round (A B, then B A), so both see the same machine; the table
//! compares their medians. `--least-privilege` drops every capability but
//! CAP_NET_ADMIN and CAP_BPF (deploy/'s, with --socket-lb) before loading:
//! without CAP_PERFMON the verifier adds its Spectre hardening.
//!
//! Everything runs in a network namespace and a mount namespace of the
//! process's own (unshared at start), with a bpffs mounted there: nothing
//! is left behind, whatever happens.

mod frames;
mod kernel;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use frames::{Frame, Proto};
use kernel::{Build, Lab};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Runs per case and build (split over the rounds).
    #[arg(long, default_value_t = 1_000_000)]
    pub repeats: u64,
    /// Rounds per case and build (alternated with --against's).
    #[arg(long, default_value_t = 10)]
    pub rounds: u32,
    /// Service ports the maps hold, one table per value.
    #[arg(long, value_delimiter = ',', default_value = "1,100000")]
    pub services: Vec<u32>,
    /// Endpoints per Service port.
    #[arg(long, default_value_t = 10)]
    pub endpoints: u32,
    /// Another build's BPF objects (a directory with tc.o) to compare with.
    #[arg(long)]
    pub against: Option<PathBuf>,
    /// This build's objects from a directory instead of the ones built in.
    #[arg(long)]
    pub objects: Option<PathBuf>,
    /// Load with deploy/'s capabilities only (CAP_NET_ADMIN, CAP_BPF).
    #[arg(long)]
    pub least_privilege: bool,
    /// Time kp_np_xdp (xdp.o; --against's DIR/xdp.o) instead of tc's
    /// kp_np_external.
    #[arg(long)]
    pub xdp: bool,
    /// Only the cases whose name contains this.
    #[arg(long)]
    pub only: Option<String>,
}

/// What a case sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    First,
    Request,
    Reply,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::First => "first packet",
            Kind::Request => "established request",
            Kind::Reply => "established reply",
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    v6: bool,
    proto: Proto,
    kind: Kind,
}

impl Case {
    fn name(&self) -> String {
        format!(
            "{} {} {}",
            if self.v6 { "IPv6" } else { "IPv4" },
            self.proto.name(),
            self.kind.name()
        )
    }
}

/// The node's address on its external interface, and the client's.
pub(crate) const NODE4: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
pub(crate) const NODE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 1);
const CLIENT4: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x51, 0, 0, 0, 0, 0, 7);

pub fn run(args: Args) -> Result<()> {
    if args.rounds == 0 || args.repeats < u64::from(args.rounds) {
        bail!("--repeats must be at least --rounds (and --rounds at least 1)");
    }
    let lab = Lab::new(args.xdp).context("setting up the namespace")?;
    let file = if args.xdp { "xdp.o" } else { "tc.o" };
    let ours = match &args.objects {
        Some(dir) => read_obj(dir, file)?,
        None if args.xdp => kp_ebpf::XDP_OBJECT.to_vec(),
        None => kp_ebpf::TC_OBJECT.to_vec(),
    };
    if ours.is_empty() {
        bail!("this binary was built without clang: it has no BPF programs");
    }
    let theirs = match &args.against {
        Some(dir) => Some(read_obj(dir, file)?),
        None => None,
    };
    if args.least_privilege {
        kernel::drop_to_deploy_caps()?;
    }
    let cases: Vec<Case> = [false, true]
        .into_iter()
        .flat_map(|v6| {
            [Proto::Tcp, Proto::Udp].into_iter().flat_map(move |proto| {
                [Kind::First, Kind::Request, Kind::Reply]
                    .into_iter()
                    .map(move |kind| Case { v6, proto, kind })
            })
        })
        .filter(|c| {
            args.only
                .as_ref()
                .is_none_or(|o| c.name().contains(o.as_str()))
        })
        .collect();
    let per_round = args.repeats / u64::from(args.rounds);
    println!(
        "mode: prog (BPF_PROG_TEST_RUN, {}; {} runs per case and build in {} rounds of {per_round}; {} endpoints per Service port{}{})",
        if args.xdp { "kp_np_xdp" } else { "kp_np_external" },
        per_round * u64::from(args.rounds),
        args.rounds,
        args.endpoints,
        if args.least_privilege { "; deploy/'s capabilities: no CAP_PERFMON" } else { "" },
        match &args.against {
            Some(d) => format!("; B = {}", d.display()),
            None => String::new(),
        }
    );
    for &n in &args.services {
        let mut a = Build::load(&lab, "a", &ours, n, args.endpoints, args.xdp)
            .with_context(|| format!("loading this build's tc.o at {n} Services"))?;
        let mut b = match &theirs {
            Some(obj) => Some(
                Build::load(&lab, "b", obj, n, args.endpoints, args.xdp)
                    .with_context(|| format!("loading --against's tc.o at {n} Services"))?,
            ),
            None => None,
        };
        println!();
        println!("{n} Service ports:");
        if b.is_some() {
            println!(
                "| case | A ns/run (median) | B ns/run (median) | B - A | A spread (min-max of rounds) |"
            );
            println!("|---|---|---|---|---|");
        } else {
            println!("| case | ns/run (median of rounds) | min-max of rounds |");
            println!("|---|---|---|");
        }
        // Each row: its name, A's frame, B's frame.
        let mut rows: Vec<(String, Frame, Frame, Option<Kind>)> = Vec::new();
        let arp = (
            "calibration (ARP, left at once)".to_string(),
            Frame::arp(),
            Frame::arp(),
            None,
        );
        rows.push(arp);
        for c in &cases {
            let pick = |(req, rep): (Frame, Option<Frame>)| -> Result<Frame> {
                match c.kind {
                    Kind::Reply => rep.context("a reply frame"),
                    _ => Ok(req),
                }
            };
            let fa = pick(prepare(&mut a, c)?)?;
            let fb = match b.as_mut() {
                Some(b) => pick(prepare(b, c).context("B")?)?,
                None => fa.clone(),
            };
            rows.push((c.name(), fa, fb, Some(c.kind)));
        }
        // First packets last: a million new flows evict the established
        // ones' entries from the LRU.
        rows.sort_by_key(|r| r.3 == Some(Kind::First));
        for (name, frame, frame_b, kind) in rows {
            let fresh = kind == Some(Kind::First);
            let established = matches!(kind, Some(Kind::Request | Kind::Reply));
            let mut ra = Vec::new();
            let mut rb = Vec::new();
            for round in 0..args.rounds {
                // A B, then B A: drift over the run falls on both.
                let b_first = round % 2 == 1;
                if b_first {
                    if let Some(b) = b.as_mut() {
                        rb.push(b.time(&frame_b, per_round, fresh)?);
                    }
                }
                ra.push(a.time(&frame, per_round, fresh)?);
                if !b_first {
                    if let Some(b) = b.as_mut() {
                        rb.push(b.time(&frame_b, per_round, fresh)?);
                    }
                }
                // What was timed was still the established flow's path.
                if established {
                    a.still_translated(&frame)
                        .with_context(|| format!("{name}, A"))?;
                    if let Some(b) = b.as_mut() {
                        b.still_translated(&frame_b)
                            .with_context(|| format!("{name}, B"))?;
                    }
                }
            }
            let (ma, sa) = (median(&mut ra), spread(&ra));
            if b.is_some() {
                let mb = median(&mut rb);
                println!("| {name} | {ma:.0} | {mb:.0} | {:+.0} | {sa} |", mb - ma);
            } else {
                println!("| {name} | {ma:.0} | {sa} |");
            }
        }
    }
    Ok(())
}

/// Runs a case's first packet through a build and returns the frames of
/// its established request and reply (each build picks its own endpoint,
/// so each gets its own reply frame), checked to be translated.
fn prepare(a: &mut Build, c: &Case) -> Result<(Frame, Option<Frame>)> {
    let (client, svc) = if c.v6 {
        (IpAddr::V6(CLIENT6), IpAddr::V6(kernel::service_addr6(0)))
    } else {
        (IpAddr::V4(CLIENT4), IpAddr::V4(kernel::service_addr4(0)))
    };
    let port = match c.proto {
        Proto::Tcp => 80,
        Proto::Udp => 53,
    };
    // A client port of the case's own: each case starts a flow of its own
    // (XDP leaves a SYN on a known tuple to tc).
    let cport = 40_000 + u16::from(c.v6) * 100 + u16::from(c.proto.number()) + c.kind as u16;
    let first = Frame::new(c.proto, client, cport, svc, port, true);
    if c.kind == Kind::First {
        return Ok((first, None));
    }
    let out = a.once(&first).context("the flow's first packet")?;
    let (src, sport, dst, dport) = out.tuple().context("the translated first packet")?;
    if dst == svc {
        bail!(
            "{}: the program did not translate the first packet (retval {}): is the route to the endpoints there?",
            c.name(),
            out.retval
        );
    }
    let req = Frame::new(c.proto, client, cport, svc, port, false);
    let rep = Frame::new(c.proto, dst, dport, src, sport, false);
    // What is timed must be the translation: both are sent on (redirected)
    // rewritten, the reply back to the client from the Service.
    let r = a.once(&req)?;
    if r.retval != a.sent() || r.tuple() != out.tuple() {
        bail!(
            "{}: the established request was not translated as the first packet was (retval {})",
            c.name(),
            r.retval
        );
    }
    let r = a.once(&rep)?;
    if r.retval != a.sent() || r.tuple() != Some((svc, port, client, cport)) {
        bail!(
            "{}: the reply was not translated back (retval {}, {:?})",
            c.name(),
            r.retval,
            r.tuple()
        );
    }
    Ok((req, Some(rep)))
}

fn read_obj(dir: &std::path::Path, file: &str) -> Result<Vec<u8>> {
    let p = dir.join(file);
    std::fs::read(&p).with_context(|| format!("reading {}", p.display()))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn spread(v: &[f64]) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{lo:.0}-{hi:.0}")
}
