//! `kp-bench pps --in-place` run tiny (1 Service per row, two rounds of
//! short steps, ours-tc, null-tc and floor) against the real control plane:
//! its table has every row measured and the paired differences, the NET_RX
//! time is not zero, and it comes from the softirq tracepoints (the passes
//! the bench's programs counted are the NET_RX softirqs the kernel counted
//! in /proc/softirqs); a statistics round names each row's packet
//! programs with their runs per request and time per run; the programs are
//! gone afterwards.

use std::process::Command;

use kp_testkit::K8sBinaries;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_kp-bench");

fn bench_programs() -> Vec<String> {
    let out = Command::new("bpftool")
        .args(["prog", "show"])
        .output()
        .expect("bpftool prog show");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("kpb_sirq") || l.contains("kpb_null_tc"))
        .map(str::to_string)
        .collect()
}

/// The cells of the table row that starts with `| name |`.
fn row<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("| {name} |")))
        .unwrap_or_else(|| panic!("no row {name}:\n{text}"));
    line.trim_matches('|').split('|').map(str::trim).collect()
}

#[test]
fn a_tiny_in_place_run_times_net_rx_from_the_tracepoints() {
    if K8sBinaries::for_test("pps --in-place").is_none() {
        return;
    }
    let Some(ours) = common::ours("pps --in-place test") else {
        return;
    };
    assert!(
        bench_programs().is_empty(),
        "bench programs loaded before the run"
    );
    let out = Command::new(BIN)
        .args([
            "pps",
            "--in-place",
            "--services",
            "1",
            "--proxies",
            "ours-tc,null-tc,floor",
            "--rounds",
            "2",
            "--stats-rounds",
            "1",
            "--duration",
            "1",
            "--fixed-rate",
            "5000",
            "--flows",
            "8",
            "--pods",
            "2",
            "--first-sync-within",
            "120",
            "--binary",
        ])
        .arg(&ours)
        .output()
        .expect("running kp-bench pps --in-place");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{text}\n{err}", out.status);
    let mut medians = 0;
    for name in ["ours-tc", "null-tc", "floor"] {
        let cells = row(&text, name);
        assert!(
            !cells[1].starts_with("not "),
            "{name} not measured: {cells:?}"
        );
        // steps kept / run: two rounds ran.
        let run: u32 = cells[1]
            .split(" / ")
            .nth(1)
            .and_then(|x| x.split_whitespace().next())
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("{name}: steps cell {:?}", cells[1]));
        assert_eq!(run, 2, "{name}: {cells:?}");
        // passes per request over every step: the tracepoints' /
        // /proc/softirqs'.
        let (tp, raised) = cells[5]
            .split_once(" / ")
            .unwrap_or_else(|| panic!("{name}: passes cell {:?}", cells[5]));
        let (tp, raised): (f64, f64) =
            (tp.parse().expect("passes"), raised.parse().expect("raised"));
        assert!(
            tp > 0.0,
            "{name}: the tracepoints counted no pass: {cells:?}"
        );
        assert!(
            (tp - raised).abs() <= 0.1 * raised + 0.002,
            "{name}: the tracepoints' passes {tp} are not /proc/softirqs' {raised}"
        );
        if cells[3] == "-" {
            // Both steps dropped (steal, backlog or a starved sender on a
            // shared machine): counted, no median to check.
            continue;
        }
        let median: f64 = cells[3]
            .split_whitespace()
            .next()
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("{name}: NET_RX cell {:?}", cells[3]));
        assert!(median > 0.0, "{name}: no NET_RX time: {cells:?}");
        medians += 1;
    }
    assert!(
        medians > 0,
        "every step of every row dropped:\n{text}\n{err}"
    );
    assert!(text.contains("Paired differences"), "{text}");
    assert!(
        text.contains("− null-tc |") && text.contains("− floor |"),
        "{text}"
    );
    // The statistics round: each row's packet programs, by name, with
    // their runs per request (ours: one on the way in, one for the echo;
    // the null program: both, on eth0 and on the pod's veth) and a time.
    let prog_row = |row: &str, prog: &str| -> (f64, String) {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("| {row} | {prog} |")))
            .unwrap_or_else(|| panic!("no program row {row} {prog}:\n{text}"));
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        (
            cells[3]
                .parse()
                .unwrap_or_else(|_| panic!("runs per request in {line}")),
            cells[4].to_string(),
        )
    };
    for (row_name, prog, runs) in [
        ("ours-tc", "kp_np_external", 1.0),
        ("ours-tc", "kp_np_from_pod", 1.0),
        ("null-tc", "kpb_null_tc", 2.0),
    ] {
        let (per_req, ns) = prog_row(row_name, prog);
        if ns == "-" {
            continue; // its one step dropped (steal, a starved sender)
        }
        assert!(
            (per_req - runs).abs() < 0.2,
            "{row_name} {prog}: {per_req} runs per request, not {runs}"
        );
        let ns: f64 = ns
            .split_whitespace()
            .next()
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("{row_name} {prog}: ns cell {ns:?}"));
        assert!(ns > 0.0, "{row_name} {prog}: no run time");
    }
    let programs = text
        .split("Programs in place")
        .nth(1)
        .unwrap_or_else(|| panic!("no programs table:\n{text}"));
    let programs = programs.split("\n\n*").next().unwrap_or(programs);
    assert!(
        !programs.contains("| floor |"),
        "the floor has no program and no statistics row:\n{programs}"
    );
    assert!(
        text.contains("null tc program on eth0"),
        "the null tc program's interfaces: {text}"
    );
    assert!(
        bench_programs().is_empty(),
        "the bench's programs are still loaded: {:?}",
        bench_programs()
    );
}
