//! --version, log verbosity and format, and the generated completions and man
//! page.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::process::Command;

use kube_proxy_rs::cli::docgen;
use kube_proxy_rs::logging::{filter_directive, level_for_verbosity};
use tracing::Level;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kube-proxy-rs"))
}

#[test]
fn version_names_the_program() {
    let out = bin().arg("--version").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with(&format!("kube-proxy-rs {}\n", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    assert!(text.contains("kubeproxy.config.k8s.io/v1alpha1"), "{text}");
    let short = bin().arg("-V").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&short.stdout),
        format!("kube-proxy-rs {}\n", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn upstream_verbosity_levels_map_to_tracing_levels() {
    for (v, l) in [
        (0, Level::INFO),
        (2, Level::INFO),
        (3, Level::DEBUG),
        (4, Level::DEBUG),
        (5, Level::TRACE),
        (10, Level::TRACE),
    ] {
        assert_eq!(level_for_verbosity(v), l, "-v={v}");
    }
    assert!(filter_directive(2).starts_with("info,"));
    assert!(filter_directive(2).contains("hyper=warn"));
    // -v=6 and up: the libraries' own trace logs too.
    assert_eq!(filter_directive(6), "trace");
}

/// Runs `--cleanup` (harmless, fast, logs at info and debug) in a throwaway
/// namespace with the given flags; its stderr.
fn cleanup_logs(tag: &str, flags: &[&str]) -> String {
    let ns = format!("kpcli-{}-{tag}", std::process::id());
    assert!(Command::new("ip")
        .args(["netns", "add", &ns])
        .status()
        .unwrap()
        .success());
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns,
            env!("CARGO_BIN_EXE_kube-proxy-rs"),
            "--cleanup",
        ])
        .args(flags)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let _ = Command::new("ip").args(["netns", "del", &ns]).status();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn json_logs_and_verbosity() {
    let text = cleanup_logs("json4", &["--logging-format=json", "-v=4"]);
    let mut levels = std::collections::BTreeSet::new();
    for l in text.lines() {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        levels.insert(v["level"].as_str().unwrap().to_string());
        assert!(
            v["timestamp"].is_string() && v["fields"]["message"].is_string(),
            "{l}"
        );
    }
    assert!(
        levels.contains("DEBUG") && levels.contains("INFO"),
        "{levels:?}\n{text}"
    );
    // -v=2: no debug lines; text format, no colour codes when not a terminal.
    let text = cleanup_logs("text2", &["--v=2"]);
    assert!(text.contains(" INFO "), "{text}");
    assert!(!text.contains("DEBUG"), "{text}");
    assert!(!text.contains('\u{1b}'), "ANSI codes in a file: {text}");
}

#[test]
fn completions_and_man_page_list_every_flag() {
    let flags = docgen::long_flags();
    assert!(flags.len() > 50, "{flags:?}");
    for shell in [
        clap_complete::Shell::Bash,
        clap_complete::Shell::Zsh,
        clap_complete::Shell::Fish,
    ] {
        let mut out = Vec::new();
        docgen::completions(shell, &mut out);
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("kube-proxy-rs"), "{shell}");
        for f in &flags {
            assert!(text.contains(f.as_str()), "{shell} completion lacks --{f}");
        }
    }
    let mut man = Vec::new();
    docgen::man_page(&mut man).unwrap();
    let man = String::from_utf8(man).unwrap();
    assert!(
        man.starts_with(".ie") || man.contains(".TH kube-proxy-rs 8"),
        "{man}"
    );
    assert!(man.contains(".TH kube-proxy-rs 8"));
    for f in &flags {
        // roff escapes '-' as '\-'.
        let escaped = format!("\\-\\-{}", f.replace('-', "\\-"));
        assert!(man.contains(&escaped), "man page lacks --{f}");
    }
    // The kp-docgen program writes the same.
    let out = Command::new(env!("CARGO_BIN_EXE_kp-docgen"))
        .arg("man")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), man);
    let bad = Command::new(env!("CARGO_BIN_EXE_kp-docgen"))
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
}
