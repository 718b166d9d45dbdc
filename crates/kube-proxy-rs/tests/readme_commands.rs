//! The README's first code block is what a new user types on a fresh machine:
//! every command there must run as written from a root shell that has no
//! `sudo` (many containers and VMs), and the scripts must still serve a user
//! who is not root.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the crate sits two levels under the workspace")
        .to_path_buf()
}

/// The lines of the README's first fenced code block, comments and blanks left out.
fn first_block_commands(readme: &str) -> Vec<String> {
    let mut lines = readme
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("```"));
    lines.next();
    lines
        .take_while(|l| !l.trim_start().starts_with("```"))
        .map(|l| l.split('#').next().unwrap_or("").trim().to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

#[test]
fn first_block_is_found_and_comments_dropped() {
    let text = "# t\n\n```sh\n./a.sh   # one\n\n# only a comment\nb --x\n```\n```sh\nc\n```\n";
    assert_eq!(first_block_commands(text), vec!["./a.sh", "b --x"]);
}

fn readme_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(workspace().join("README.md")).expect("README.md");
    let commands = first_block_commands(&readme);
    assert_eq!(
        commands.len(),
        2,
        "the README's first code block gives exactly two commands (the demo and the tests), found {commands:?}"
    );
    commands
}

#[test]
fn readme_commands_exist_and_are_executable_without_sudo() {
    for line in readme_commands() {
        let program = line.split_whitespace().next().unwrap_or_default();
        assert_ne!(
            program, "sudo",
            "`{line}`: a root shell without sudo cannot run it as written"
        );
        assert!(
            program.contains('/'),
            "`{line}`: expected a script of the checkout, run by its path"
        );
        let path = workspace().join(program);
        let meta = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("`{line}`: {} does not exist: {e}", path.display()));
        assert!(meta.is_file(), "`{line}`: {} is not a file", path.display());
        assert!(
            meta.permissions().mode() & 0o111 != 0,
            "`{line}`: {} is not executable (mode {:o})",
            path.display(),
            meta.permissions().mode()
        );
        let text = std::fs::read_to_string(&path).expect("script text");
        let shebang = text.lines().next().unwrap_or_default();
        let interpreter = shebang
            .strip_prefix("#!")
            .unwrap_or_else(|| panic!("`{line}`: {} has no #! line", path.display()));
        let mut words = interpreter.split_whitespace();
        let first = words.next().unwrap_or_default();
        // `#!/usr/bin/env bash` names the program env looks up.
        let wanted = if first.ends_with("/env") {
            words.next().unwrap_or_default()
        } else {
            first
        };
        let found = if wanted.contains('/') {
            Path::new(wanted).is_file()
        } else {
            Command::new("sh")
                .args(["-c", &format!("command -v {wanted}")])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        };
        assert!(
            found,
            "`{line}`: its interpreter `{interpreter}` is not on this machine"
        );
        let syntax = Command::new("bash")
            .arg("-n")
            .arg(&path)
            .output()
            .expect("bash -n");
        assert!(
            syntax.status.success(),
            "`{line}`: bash -n: {}",
            String::from_utf8_lossy(&syntax.stderr)
        );
    }
}

/// The README says each script re-runs itself with sudo when it is not root;
/// where there is no sudo either, it says so and stops before doing anything.
/// Run as `nobody` with a PATH that has no sudo on it.
#[test]
fn readme_scripts_stop_with_a_reason_when_not_root_and_no_sudo() {
    if effective_uid() != 0 {
        panic!("this test runs as root (the README's commands are for a root shell); run the suite through ./test.sh");
    }
    let bin = std::env::temp_dir().join(format!("kp-readme-path-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&bin);
    std::fs::create_dir_all(&bin).expect("scratch PATH");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    struct Gone(PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _gone = Gone(bin.clone());
    for tool in ["bash", "env", "id", "dirname"] {
        std::os::unix::fs::symlink(which(tool), bin.join(tool)).expect("symlink");
    }
    // Found on the test's PATH: the child's PATH is the scratch one.
    let setpriv = which("setpriv");
    let as_nobody = |path: &Path| {
        Command::new(&setpriv)
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(path)
            .env_clear()
            .env("PATH", &bin)
            .current_dir("/")
            .output()
            .expect("setpriv")
    };
    for line in readme_commands() {
        let program = line.split_whitespace().next().unwrap_or_default();
        let path = workspace().join(program);
        let out = as_nobody(&path);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "`{line}` as a user without sudo: expected exit 1, got {:?}; stderr: {stderr}",
            out.status
        );
        assert!(
            stderr.contains("root"),
            "`{line}` as a user without sudo must say it needs root; stderr: {stderr}"
        );
    }
    // With a sudo on the PATH (one that only prints what it was asked to
    // run), each script hands itself to it instead of running as the user.
    let bash = std::fs::read_link(bin.join("bash")).expect("bash link");
    let sudo = bin.join("sudo");
    std::fs::write(
        &sudo,
        format!("#!{}\necho \"sudo $*\"\nexit 0\n", bash.display()),
    )
    .expect("fake sudo");
    std::fs::set_permissions(&sudo, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    for line in readme_commands() {
        let program = line.split_whitespace().next().unwrap_or_default();
        let path = workspace().join(program);
        let out = as_nobody(&path);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.starts_with("sudo ") && stdout.contains(&*path.to_string_lossy()),
            "`{line}` as a user with sudo must re-run itself with sudo; status {:?}, stdout: {stdout}, stderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn effective_uid() -> u32 {
    // /proc/self/status's Uid line: real, effective, saved, filesystem.
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|u| u.parse().ok())
        .expect("Uid line")
}

fn which(tool: &str) -> PathBuf {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .expect("command -v");
    let at = String::from_utf8_lossy(&found.stdout).trim().to_string();
    assert!(!at.is_empty(), "{tool} is not on this machine");
    PathBuf::from(at)
}
