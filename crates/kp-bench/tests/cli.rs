//! The kp-bench binary: every subcommand is listed by `--help` with what it
//! measures, every subcommand's options say what they are, and the smallest
//! real run of `kp-bench nftables` still prints its table (and leaves no
//! namespace behind).

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_kp-bench");

/// The benches the binary must offer (BENCHMARKS.md's commands use them).
const SUBCOMMANDS: &[&str] = &[
    "nftables",
    "iptables",
    "userspace",
    "socketlb",
    "maglev",
    "compare",
    "soak",
    "idle",
    "connect",
    "pps",
    "reconcile",
    "userspace-relay",
];

fn run(args: &[&str]) -> Output {
    let out = Command::new(BIN)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {BIN} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "kp-bench {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("UTF-8 help");
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The subcommands `kp-bench --help` lists, with their descriptions.
fn listed() -> Vec<(String, String)> {
    let help = stdout(&run(&["--help"]));
    let commands = help
        .split("Commands:\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no Commands section in:\n{help}"));
    commands
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| {
            let l = l.trim();
            let (name, what) = l.split_once(' ')?;
            Some((name.to_string(), what.trim().to_string()))
        })
        .filter(|(name, _)| name != "help")
        .collect()
}

#[test]
fn help_lists_every_subcommand_with_what_it_measures() {
    let listed = listed();
    for want in SUBCOMMANDS {
        let found = listed.iter().find(|(name, _)| name == want);
        let (_, what) =
            found.unwrap_or_else(|| panic!("`{want}` not in kp-bench --help: {listed:?}"));
        assert!(
            what.split_whitespace().count() >= 5,
            "`{want}`: its description says little: {what:?}"
        );
    }
}

/// Each subcommand's `--help` (the long form: every option's doc, whole)
/// starts with what it measures, and every option has a description.
#[test]
fn each_subcommand_explains_itself_and_its_options() {
    for (name, _) in listed() {
        let help = stdout(&run(&[&name, "--help"]));
        let first = help.lines().next().unwrap_or_default();
        assert!(
            !first.starts_with("Usage") && first.split_whitespace().count() >= 5,
            "kp-bench {name} --help starts without a description:\n{help}"
        );
        // Long help: an option's line, then its description indented below
        // (or on the same line when the help is short).
        let options = help.split("Options:\n").nth(1).unwrap_or_default();
        let lines: Vec<&str> = options.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            // `--flag` or `-h, --help`; not a possible value's `- name: ...`.
            let flag = t.starts_with("--")
                || (t.starts_with('-')
                    && t.chars().nth(1).is_some_and(|c| c.is_ascii_alphabetic()));
            if !flag {
                continue;
            }
            let same_line = t.split("  ").skip(1).any(|s| !s.trim().is_empty());
            let below = lines
                .get(i + 1)
                .is_some_and(|n| n.starts_with("          ") && !n.trim().is_empty());
            assert!(
                same_line || below,
                "kp-bench {name}: option without a description: {t:?}\n{help}"
            );
        }
    }
}

/// The smallest table: model and render alone (no kernel), then the same
/// size applied into the scratch namespace the bench makes and removes.
#[test]
fn a_tiny_nftables_run_prints_its_table() {
    let model = stdout(&run(&[
        "nftables",
        "--sizes",
        "20",
        "--changes",
        "2",
        "--burst",
        "0",
        "--no-apply",
    ]));
    let row = model
        .lines()
        .find(|l| l.starts_with("| 20 | 10 |"))
        .unwrap_or_else(|| panic!("no row for 20 Services:\n{model}"));
    assert!(row.ends_with("MiB |"), "{row}");
    assert!(row.contains("| - |"), "--no-apply applies nothing: {row}");

    let child = Command::new(BIN)
        .args([
            "nftables",
            "--sizes",
            "20",
            "--changes",
            "3",
            "--burst",
            "10",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawning kp-bench");
    let ns = format!("kpbench{}x20x10", child.id());
    let out = child.wait_with_output().expect("kp-bench nftables");
    let text = stdout(&out);
    assert!(
        out.status.success(),
        "{}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.starts_with("mode: nftables (netlink)"), "{text}");
    let row = text
        .lines()
        .find(|l| l.starts_with("| 20 | 10 |"))
        .unwrap_or_else(|| panic!("no row for 20 Services:\n{text}"));
    // Applied: the full sync column holds its render and apply times, the
    // burst its syncs.
    assert!(row.contains("(render "), "{row}");
    assert!(row.contains("syncs) |"), "{row}");
    let left = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    assert!(
        !String::from_utf8_lossy(&left.stdout).contains(&ns),
        "{ns} left behind"
    );
}
