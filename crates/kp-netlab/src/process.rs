//! Programs spawned inside a namespace, killed when their guard (or the
//! owning cluster) goes away.

use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::netns::check_ns_name;
use crate::LabError;

/// Shared handle so both the guard and the cluster can reap/kill the child.
pub(crate) type SharedChild = Arc<Mutex<Child>>;

fn lock(child: &SharedChild) -> MutexGuard<'_, Child> {
    // A poisoned lock only means another thread panicked while holding it;
    // the Child inside is still usable for kill/wait.
    child.lock().unwrap_or_else(|p| p.into_inner())
}

/// SIGKILLs the child's whole process group (it is its own group leader, so
/// helpers it started die too) and reaps it. Safe to call repeatedly.
pub(crate) fn kill_and_reap(child: &SharedChild) {
    let mut c = lock(child);
    if matches!(c.try_wait(), Ok(None)) {
        if let Ok(pid) = libc::pid_t::try_from(c.id()) {
            // SAFETY: plain kill(2); the child is not reaped yet (try_wait
            // said so), so its pid/pgid cannot have been recycled.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A running program started by [`crate::Cluster::spawn`]. Dropping it
/// SIGKILLs the program (and its process group).
#[derive(Debug)]
pub struct ProcGuard {
    child: SharedChild,
    pid: u32,
    ns: String,
    log: PathBuf,
}

impl ProcGuard {
    pub(crate) fn spawn(
        ns: &str,
        program: &Path,
        args: &[String],
        log: &Path,
    ) -> Result<(ProcGuard, SharedChild), LabError> {
        check_ns_name(ns)?;
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|source| LabError::Io {
                what: format!("opening log file {}", log.display()),
                source,
            })?;
        let file2 = file.try_clone().map_err(|source| LabError::Io {
            what: format!("duplicating log file {}", log.display()),
            source,
        })?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns])
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(file2)
            .process_group(0);
        let desc = format!(
            "ip netns exec {ns} {} {}",
            program.display(),
            args.join(" ")
        );
        // `ip netns exec` execs the program in place, so the child pid is the
        // program's own pid.
        let child = cmd.spawn().map_err(|source| LabError::Spawn {
            cmd: desc.clone(),
            source,
        })?;
        let pid = child.id();
        tracing::debug!(cmd = %desc, pid, log = %log.display(), "spawned");
        let shared = Arc::new(Mutex::new(child));
        Ok((
            ProcGuard {
                child: shared.clone(),
                pid,
                ns: ns.to_string(),
                log: log.to_path_buf(),
            },
            shared,
        ))
    }

    /// Starts `program` with `args` in network namespace `ns` (`ip netns
    /// exec`), its output appended to `log`, without a [`crate::Cluster`]:
    /// for a namespace of the caller's own (kp-bench idle's).
    pub fn start(
        ns: &str,
        program: &Path,
        args: &[String],
        log: &Path,
    ) -> Result<ProcGuard, LabError> {
        Ok(ProcGuard::spawn(ns, program, args, log)?.0)
    }

    /// Process id of the program.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Namespace the program runs in.
    pub fn ns(&self) -> &str {
        &self.ns
    }

    /// Log file receiving its stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Current log contents (handy in assertion messages); empty if unreadable.
    pub fn log_contents(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the program has not exited yet.
    pub fn is_running(&self) -> bool {
        matches!(lock(&self.child).try_wait(), Ok(None))
    }

    /// The exit status if it has exited.
    pub fn try_wait(&self) -> Option<ExitStatus> {
        lock(&self.child).try_wait().ok().flatten()
    }

    /// SIGKILLs the program (simulating a crash: it gets no chance to clean
    /// up) and waits for it to be gone.
    pub fn kill_hard(&self) {
        kill_and_reap(&self.child);
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`) to the program itself only.
    pub fn signal(&self, signal: libc::c_int) -> Result<(), LabError> {
        let mut c = lock(&self.child);
        if !matches!(c.try_wait(), Ok(None)) {
            return Ok(());
        }
        let pid = libc::pid_t::try_from(self.pid).map_err(|_| LabError::Io {
            what: format!("pid {} out of range", self.pid),
            source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        })?;
        // SAFETY: plain kill(2) on our unreaped child (we hold the lock, so
        // nobody reaps it concurrently).
        if unsafe { libc::kill(pid, signal) } != 0 {
            return Err(LabError::Io {
                what: format!("sending signal {signal} to pid {pid}"),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Sends SIGTERM and waits up to `grace` for a clean exit; returns the
    /// exit status, or `None` if it had to be SIGKILLed.
    pub fn terminate(&self, grace: Duration) -> Result<Option<ExitStatus>, LabError> {
        self.signal(libc::SIGTERM)?;
        match self.wait_exit(grace) {
            Some(st) => Ok(Some(st)),
            None => {
                self.kill_hard();
                Ok(None)
            }
        }
    }

    /// Waits up to `timeout` for the program to exit by itself.
    pub fn wait_exit(&self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.try_wait() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ProcGuard {
    fn drop(&mut self) {
        kill_and_reap(&self.child);
    }
}
