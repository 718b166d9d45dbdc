//! Entering named network namespaces from a thread, and running commands.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::process::{Command, Output};

use crate::LabError;

/// Where `ip netns` keeps its namespace handles.
pub const NETNS_DIR: &str = "/run/netns";

pub(crate) fn check_ns_name(ns: &str) -> Result<(), LabError> {
    if ns.is_empty() || ns.contains('/') || ns == "." || ns == ".." {
        return Err(LabError::InvalidName {
            kind: "namespace",
            name: ns.to_string(),
            why: "must be a non-empty name without '/'",
        });
    }
    Ok(())
}

/// Runs `f` on a fresh thread that has first joined network namespace `ns`
/// (a name from `ip netns`). Sockets created inside `f` belong to `ns` for
/// their whole life, so they may be returned and used from any thread.
///
/// Only the helper thread changes namespace; the caller's thread and the
/// rest of the process are untouched. A panic inside `f` is propagated.
pub fn in_netns<T, F>(ns: &str, f: F) -> Result<T, LabError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    // A socket-LB test's lab: its client threads are in the test's cgroup,
    // where the programs under test see their sockets.
    in_netns_and_cgroup(ns, crate::cgroup::cgroup_for_namespace(ns), f)
}

impl crate::cgroup::TestCgroup {
    /// Runs `f` on a thread inside this cgroup and network namespace `ns`,
    /// whichever cgroup [`in_netns`] would put a thread of `ns` in (a
    /// process the test's programs do not see, in a lab namespace). Here,
    /// not in cgroup.rs: the namespace side uses the cgroups, not the
    /// other way round.
    pub fn run_in_netns<T: Send, F: FnOnce() -> T + Send>(
        &self,
        ns: &str,
        f: F,
    ) -> Result<T, LabError> {
        in_netns_and_cgroup(ns, Some(self.path().to_path_buf()), f)
    }
}

/// [`in_netns`] with the thread in `cgroup` (a threaded one) when given.
pub(crate) fn in_netns_and_cgroup<T, F>(
    ns: &str,
    cgroup: Option<std::path::PathBuf>,
    f: F,
) -> Result<T, LabError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    check_ns_name(ns)?;
    let path = format!("{NETNS_DIR}/{ns}");
    let handle = File::open(&path).map_err(|source| LabError::Netns {
        ns: ns.to_string(),
        what: "opening the namespace handle",
        source,
    })?;
    let joined = std::thread::scope(|s| {
        s.spawn(move || {
            // SAFETY: setns on a valid fd; it only affects this thread.
            if unsafe { libc::setns(handle.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            drop(handle);
            if let Some(cg) = &cgroup {
                crate::cgroup::join_thread(cg).map_err(|e| io::Error::other(e.to_string()))?;
            }
            Ok(f())
        })
        .join()
    });
    match joined {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(LabError::Netns {
            ns: ns.to_string(),
            what: "setns",
            source,
        }),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn describe(program: &OsStr, args: &[&OsStr]) -> String {
    let mut s = program.to_string_lossy().into_owned();
    for a in args {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs a command to completion and returns its output, whatever its status.
pub(crate) fn run_output(program: &OsStr, args: &[&OsStr]) -> Result<Output, LabError> {
    let cmd = describe(program, args);
    tracing::trace!(%cmd, "running");
    Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|source| LabError::Spawn { cmd, source })
}

/// Turns a finished command into its stdout, or an error carrying stderr.
pub(crate) fn require_success(cmd: String, out: Output) -> Result<String, LabError> {
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(LabError::Command {
            cmd,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Runs `ip ARGS...` and requires success.
pub(crate) fn ip(args: &[&str]) -> Result<String, LabError> {
    let os: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
    let out = run_output(OsStr::new("ip"), &os)?;
    require_success(describe(OsStr::new("ip"), &os), out)
}

/// Runs `ip -n NS ARGS...` and requires success.
pub(crate) fn ip_in(ns: &str, args: &[&str]) -> Result<String, LabError> {
    let mut all = vec!["-n", ns];
    all.extend_from_slice(args);
    ip(&all)
}

/// Runs `ip -n NS -batch -` with `lines` (ip commands without the `ip`) on
/// its standard input and requires success: one process for many routes.
pub(crate) fn ip_batch_in(ns: &str, lines: &[String]) -> Result<(), LabError> {
    use std::io::Write;
    check_ns_name(ns)?;
    let cmd = format!("ip -n {ns} -batch - ({} commands)", lines.len());
    tracing::trace!(%cmd, "running");
    let mut child = Command::new("ip")
        .args(["-n", ns, "-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|source| LabError::Spawn {
            cmd: cmd.clone(),
            source,
        })?;
    let mut text = lines.join("\n");
    text.push('\n');
    if let Some(mut stdin) = child.stdin.take() {
        // A write error shows as ip's own failure below.
        let _ = stdin.write_all(text.as_bytes());
    }
    let out = child.wait_with_output().map_err(|source| LabError::Spawn {
        cmd: cmd.clone(),
        source,
    })?;
    require_success(cmd, out).map(|_| ())
}

/// Runs a program inside `ns` via `ip netns exec`.
pub(crate) fn exec_in<S: AsRef<OsStr>>(ns: &str, argv: &[S]) -> Result<Output, LabError> {
    check_ns_name(ns)?;
    let mut all: Vec<&OsStr> = vec![OsStr::new("netns"), OsStr::new("exec"), OsStr::new(ns)];
    all.extend(argv.iter().map(AsRef::as_ref));
    run_output(OsStr::new("ip"), &all)
}

/// Like [`exec_in`] but requires success and returns stdout.
pub(crate) fn exec_ok_in<S: AsRef<OsStr>>(ns: &str, argv: &[S]) -> Result<String, LabError> {
    let out = exec_in(ns, argv)?;
    let os: Vec<&OsStr> = argv.iter().map(AsRef::as_ref).collect();
    let cmd = format!(
        "ip netns exec {ns} {}",
        describe(OsStr::new(""), &os).trim_start()
    );
    require_success(cmd, out)
}

/// Sets sysctls inside `ns` (`ip netns exec NS sysctl -q -w k=v ...`).
pub(crate) fn sysctl_in(ns: &str, settings: &[(&str, &str)]) -> Result<(), LabError> {
    let mut argv = vec!["sysctl".to_string(), "-q".to_string(), "-w".to_string()];
    argv.extend(settings.iter().map(|(k, v)| format!("{k}={v}")));
    exec_ok_in(ns, &argv).map(|_| ())
}

/// Whether a namespace named `ns` currently exists.
pub fn netns_exists(ns: &str) -> bool {
    check_ns_name(ns).is_ok() && std::path::Path::new(NETNS_DIR).join(ns).exists()
}
