//! The tables of a run: one per scenario (upstream | ours), `--fit`'s
//! steps, and a short summary.

use std::fmt::Write;

use super::{Kind, Report, Scenario, ServerFigures, Side};

/// One figure of a repeated start: from the control plane's figures and
/// the slowest node's seconds.
type Reading = dyn Fn(&ServerFigures, f64) -> f64;
use crate::lab::{date_utc, load_average};

fn mib(b: f64) -> String {
    format!("{:.2} MiB", b / 1048576.0)
}

fn ms(s: f64) -> String {
    if s >= 10.0 {
        format!("{s:.1} s")
    } else {
        format!("{:.0} ms", s * 1e3)
    }
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

/// Nearest-rank quantile, as kp-bench's other tables.
pub fn q(v: &[f64], p: f64) -> f64 {
    let v = sorted(v);
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn own(o: (Option<f64>, Option<f64>, f64)) -> String {
    match o {
        (Some(a), Some(b), n) => format!("{} / {} ({n:.0})", ms(a), ms(b)),
        _ => "none".into(),
    }
}

/// The rows of one scenario, `title` before each, into the one table.
fn rows(all: &mut Vec<(String, String, String)>, title: &str, lines: &[(String, String, String)]) {
    for (what, u, o) in lines {
        all.push((format!("{title}: {what}"), u.clone(), o.clone()));
    }
}

/// `f(side)` for both kinds, "-" where the scenario has no figures.
fn both<T>(
    r: &Report,
    get: impl Fn(&Side) -> Option<&T>,
    f: impl Fn(&T) -> String,
) -> (String, String) {
    let one = |s: &Side| get(s).map_or_else(|| "-".to_string(), &f);
    (one(&r.upstream), one(&r.ours))
}

pub fn render(r: &Report) -> String {
    let a = &r.args;
    let mut out = String::new();
    let scenarios: Vec<&str> = a
        .scenarios
        .iter()
        .map(|s| match s {
            Scenario::Start => "start",
            Scenario::Changes => "changes",
            Scenario::Restart => "restart",
        })
        .collect();
    let _ = writeln!(
        out,
        "Measured {} by `kp-bench cluster --nodes {} --services {} --scenarios {} --changes {} \
         --change-every-ms {} --burst {} --down-secs {}{}` ({} cores, load average {} at the end): \
         one kube-apiserver v1.36.2 + etcd 3.5, N Services x 10 endpoints (kp-bench's mix, \
         written in {:.0} s), K node namespaces each running its own proxy (nftables mode), \
         upstream's K first, then ours, on the same control plane; the K proxies and the \
         control plane share the machine's cores.",
        date_utc(),
        a.nodes,
        a.services,
        scenarios.join(","),
        a.changes,
        a.change_every_ms,
        a.burst,
        a.down_secs,
        if a.repeat_start > 0 {
            format!(" --repeat-start {}", a.repeat_start)
        } else {
            String::new()
        } + &if a.fit {
            format!(
                " --fit --fit-steps {}",
                a.fit_steps
                    .iter()
                    .map(|k| k.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            )
        } else {
            String::new()
        },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average(),
        r.populate,
    );
    fn start(s: &Side) -> Option<&super::StartFigures> {
        s.start.as_ref()
    }
    let mut l = Vec::new();
    let mut row = |what: &str, (u, o): (String, String)| l.push((what.to_string(), u, o));
    row(
        "all K served: slowest node (median)",
        both(r, start, |f| {
            format!("{} ({})", ms(q(&f.served, 1.0)), ms(q(&f.served, 0.5)))
        }),
    );
    row(
        "API server CPU (etcd CPU), start -> all served + 5 s; its peak RSS (VmHWM)",
        both(r, start, |f| {
            format!(
                "{:.2} s ({:.2} s); {:.0} MiB",
                f.server.api_cpu, f.server.etcd_cpu, f.server.api_peak_mib
            )
        }),
    );
    row(
        "LIST requests (of which endpointslices), response bytes",
        both(r, start, |f| {
            format!(
                "{:.0} ({:.0}), {}",
                f.server.list_requests,
                f.server.list_slices,
                mib(f.server.list_bytes)
            )
        }),
    );
    row(
        "watches open afterwards (more than before)",
        both(r, start, |f| format!("{:.0}", f.server.watches_open)),
    );
    row(
        "etcd list calls: all (services, endpointslices)",
        both(r, start, |f| {
            format!(
                "{:.0} ({:.0}, {:.0})",
                f.server.etcd_lists, f.server.etcd_lists_services, f.server.etcd_lists_slices
            )
        }),
    );
    row(
        "watch event bytes",
        both(r, start, |f| mib(f.server.watch_bytes)),
    );
    row(
        "per proxy once served: RSS, CPU (median)",
        both(r, start, |f| {
            format!(
                "{:.0} MiB, {:.2} s",
                q(&f.proxy_rss_mib, 0.5),
                q(&f.proxy_cpu, 0.5)
            )
        }),
    );
    let mut all = Vec::new();
    rows(&mut all, "1. start", &l);

    if a.scenarios.contains(&Scenario::Changes) {
        fn ch(s: &Side) -> Option<&super::ChangeFigures> {
            s.changes.as_ref()
        }
        let mut l = Vec::new();
        let mut row = |what: String, (u, o): (String, String)| l.push((what, u, o));
        row(
            format!(
                "stream of {} (one per {} ms): change -> each node's kernel, p50 / p99 (samples)",
                a.changes, a.change_every_ms
            ),
            both(r, ch, |f| {
                format!(
                    "{} / {} ({})",
                    ms(q(&f.steady, 0.5)),
                    ms(q(&f.steady, 0.99)),
                    f.steady.len()
                )
            }),
        );
        row(
            "stream: the proxies' kubeproxy_network_programming_duration_seconds p50 / p99 (count)"
                .into(),
            both(r, ch, |f| own(f.own_steady)),
        );
        let burst = a.burst.min(a.services as usize);
        row(
            format!("burst of {burst}: change -> each node's kernel, p50 / p99 (samples)"),
            both(r, ch, |f| {
                format!(
                    "{} / {} ({})",
                    ms(q(&f.burst, 0.5)),
                    ms(q(&f.burst, 0.99)),
                    f.burst.len()
                )
            }),
        );
        row(
            "burst: the proxies' own histogram p50 / p99 (count)".into(),
            both(r, ch, |f| own(f.own_burst)),
        );
        row(
            "burst: first write -> last change on the last node".into(),
            both(r, ch, |f| ms(f.burst_all)),
        );
        let missed = |s: &Side| s.changes.as_ref().map_or(0, |c| c.missed);
        if missed(&r.upstream) + missed(&r.ours) > 0 {
            row(
                "(change, node) pairs never seen".into(),
                both(r, ch, |f| f.missed.to_string()),
            );
        }
        rows(&mut all, "2. changes", &l);
    }

    if a.scenarios.contains(&Scenario::Restart) {
        fn rs(s: &Side) -> Option<&super::RestartFigures> {
            s.restart.as_ref()
        }
        let mut l = Vec::new();
        let mut row = |what: String, (u, o): (String, String)| l.push((what, u, o));
        row(
            "API server killed -> ready again (window)".into(),
            both(r, rs, |f| format!("{:.1} s ({:.0} s)", f.down, f.window)),
        );
        row(
            "requests through a Service on every node: failed / sent (nodes failing)".into(),
            both(r, rs, |f| {
                format!("{} / {} ({})", f.failed, f.requests, f.failed_nodes)
            }),
        );
        row(
            "nf_tables rules + set elements written in the window: max node (all nodes; transactions)".into(),
            both(r, rs, |f| {
                format!(
                    "{} ({}; {})",
                    f.rule_changes.iter().max().unwrap_or(&0),
                    f.rule_changes.iter().sum::<u64>(),
                    f.commits.iter().sum::<u64>()
                )
            }),
        );
        rows(&mut all, "3. API server restart", &l);
    }
    let _ = writeln!(
        out,
        "\n| K={}, N={} | upstream v1.36.2 | kube-proxy-rs |\n|---|---|---|",
        a.nodes, a.services
    );
    for (what, u, o) in all {
        let _ = writeln!(out, "| {what} | {u} | {o} |");
    }

    if !r.repeats.is_empty() {
        let _ = writeln!(
            out,
            "\n| 1b. start again x{} (alternated, ours first in odd rounds) | upstream v1.36.2 | kube-proxy-rs |\n|---|---|---|",
            a.repeat_start
        );
        let pick = |k: Kind, f: &Reading| -> Vec<f64> {
            r.repeats
                .iter()
                .filter(|(kind, _, _)| *kind == k)
                .map(|(_, s, slowest)| f(s, *slowest))
                .collect()
        };
        let spread = |v: Vec<f64>, unit: &str| -> String {
            let mut v = v;
            v.sort_by(f64::total_cmp);
            let each: Vec<String> = v.iter().map(|x| format!("{x:.2}")).collect();
            format!("median {:.2} {unit} ({})", q(&v, 0.5), each.join(", "))
        };
        let rows: [(&str, &Reading, &str); 4] = [
            ("API server CPU", &|s, _| s.api_cpu, "s"),
            ("etcd CPU", &|s, _| s.etcd_cpu, "s"),
            (
                "watch event bytes",
                &|s, _| s.watch_bytes / 1048576.0,
                "MiB",
            ),
            ("slowest node served", &|_, t| t, "s"),
        ];
        for (what, f, unit) in rows {
            let _ = writeln!(
                out,
                "| {what} | {} | {} |",
                spread(pick(Kind::Upstream, f), unit),
                spread(pick(Kind::Ours, f), unit)
            );
        }
    }

    if !r.fit.is_empty() {
        let _ = writeln!(
            out,
            "\n| 4. --fit: K | who | all served (slowest) | MemAvailable before -> after | K proxies' RSS |\n|---|---|---|---|---|"
        );
        for s in &r.fit {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.0} -> {:.0} MiB | {:.0} MiB |",
                s.k,
                s.kind.label(),
                if s.served {
                    format!("yes ({:.1} s)", s.slowest)
                } else {
                    format!("no: {}", s.note.lines().next().unwrap_or(""))
                },
                s.avail_before,
                s.avail_after,
                s.proxies_rss
            );
        }
    }
    out.push_str(&summary(r));
    out
}

/// The largest K that fitted; each proxy's RSS there; and the K that
/// memory would reach at the ceiling, had the lab more nodes (RSS, not
/// MemAvailable's drop: other work on a shared machine moves that by more).
fn largest_fit(r: &Report, kind: Kind) -> Option<(usize, f64, f64)> {
    r.fit
        .iter()
        .filter(|s| s.kind == kind && s.served && s.avail_after >= r.args.fit_reserve_mib)
        .max_by_key(|s| s.k)
        .map(|s| {
            let per = (s.proxies_rss / s.k as f64).max(1.0);
            let projected = s.k as f64 + (s.avail_after - r.args.fit_reserve_mib) / per;
            (s.k, per, projected)
        })
}

fn summary(r: &Report) -> String {
    let mut out = String::from("\n");
    let ratio = |u: f64, o: f64| {
        if o > 0.0 {
            format!("{:.1}x", u / o)
        } else {
            "-".into()
        }
    };
    if let (Some(u), Some(o)) = (&r.upstream.start, &r.ours.start) {
        let _ = writeln!(
            out,
            "Summary (upstream / ours, ratio): at K={} N={}, all K started at once cost the API \
             server {:.2} / {:.2} CPU s ({}), {} / {} of LIST and watch bytes ({}), etcd list calls \
             {} / {}; all K served after {} / {} ({}).",
            r.args.nodes,
            r.args.services,
            u.server.api_cpu,
            o.server.api_cpu,
            ratio(u.server.api_cpu, o.server.api_cpu),
            mib(u.server.list_bytes + u.server.watch_bytes),
            mib(o.server.list_bytes + o.server.watch_bytes),
            ratio(
                u.server.list_bytes + u.server.watch_bytes,
                o.server.list_bytes + o.server.watch_bytes
            ),
            u.server.etcd_lists,
            o.server.etcd_lists,
            ms(q(&u.served, 1.0)),
            ms(q(&o.served, 1.0)),
            ratio(q(&u.served, 1.0), q(&o.served, 1.0)),
        );
    }
    if let (Some(u), Some(o)) = (&r.upstream.changes, &r.ours.changes) {
        let (mut all_u, mut all_o) = (u.steady.clone(), o.steady.clone());
        all_u.extend(&u.burst);
        all_o.extend(&o.burst);
        let _ = writeln!(
            out,
            "Network programming p99 across the K nodes (stream and burst): upstream {}, ours {} ({}).",
            ms(q(&all_u, 0.99)),
            ms(q(&all_o, 0.99)),
            ratio(q(&all_u, 0.99), q(&all_o, 0.99)),
        );
    }
    if !r.fit.is_empty() {
        let say = |k: Kind| {
            largest_fit(r, k).map_or("none".to_string(), |(k, per, projected)| {
                format!("{k} ({per:.0} MiB RSS per proxy: ~{projected:.0} at the ceiling)")
            })
        };
        let _ = writeln!(
            out,
            "Largest K that fits (all served, MemAvailable >= {:.0} MiB, steps up to {}): upstream {}, ours {}.",
            r.args.fit_reserve_mib,
            r.args.fit_steps.iter().max().unwrap_or(&0),
            say(Kind::Upstream),
            say(Kind::Ours)
        );
    }
    for (k, s) in [(Kind::Upstream, &r.upstream), (Kind::Ours, &r.ours)] {
        for e in &s.errors {
            let _ = writeln!(
                out,
                "{} failed: {}",
                k.label(),
                e.lines().next().unwrap_or("")
            );
        }
    }
    out
}
