//! Cgroups for the tests of socket load balancing: programs attached to a
//! cgroup see only the sockets its threads create, so each test gets a
//! cgroup of its own and its lab's client threads join it, while the other
//! tests running in parallel in the same process stay outside.
//!
//! A thread alone can only change cgroup inside a *threaded* subtree: on the
//! first [`TestCgroup::new`] the process moves into a cgroup of its own
//! (`kp-lab-<pid>`, which becomes the subtree's root), and each test cgroup
//! is a threaded child of it. When the last one is dropped the process moves
//! back and the root is removed; roots left by killed test processes are
//! swept on the next start. Nothing else on the machine is touched; the
//! machine's root cgroup never gets a program.
//!
//! The hierarchy is reached through a cgroup2 mount of the process's own
//! under /tmp (`kp-cgroup2-<pid>`): `ip netns exec`, which starts the
//! proxies under test, mounts a fresh /sys and so hides /sys/fs/cgroup, but
//! keeps /tmp's mounts, so the paths handed to a proxy work there too.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::mounts::{mount_at, stale, unmount};
use crate::LabError;

struct Root {
    /// Our own mount of the cgroup2 hierarchy.
    mount: PathBuf,
    dir: PathBuf,
    /// Where the process was before (relative to the mount), to go back.
    home: PathBuf,
    live: usize,
}

static ROOT: Mutex<Option<Root>> = Mutex::new(None);
/// (namespace name, whether it is a prefix) -> the cgroup whose threads
/// [`crate::in_netns`] joins for it.
static BY_NAME: Mutex<BTreeMap<(String, bool), PathBuf>> = Mutex::new(BTreeMap::new());
static NEXT: AtomicU64 = AtomicU64::new(0);

fn err(what: String) -> impl FnOnce(io::Error) -> LabError {
    move |source| LabError::Io { what, source }
}

/// Where cgroup v2 is mounted (/sys/fs/cgroup, or .../unified on hybrid hosts).
fn cgroup2_mount() -> Result<PathBuf, LabError> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(err("reading /proc/self/mountinfo".into()))?;
    for line in info.lines() {
        // "... mount-point options - fstype source super-options"
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        if right.split_whitespace().next() == Some("cgroup2") {
            if let Some(mp) = left.split_whitespace().nth(4) {
                return Ok(PathBuf::from(mp));
            }
        }
    }
    Err(LabError::Options(
        "no cgroup v2 hierarchy is mounted (socket load balancing needs one)".into(),
    ))
}

fn own_cgroup() -> Result<PathBuf, LabError> {
    let text = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(err("reading /proc/self/cgroup".into()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| PathBuf::from(p.trim_start_matches('/')))
        .ok_or_else(|| LabError::Options("this process has no cgroup v2 entry".into()))
}

fn write(path: &Path, value: &str) -> Result<(), LabError> {
    std::fs::write(path, value).map_err(err(format!("writing {value:?} to {}", path.display())))
}

/// rmdir, retried while exiting threads still count as members.
fn remove_dir(dir: &Path) {
    for _ in 0..50 {
        match std::fs::remove_dir(dir) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            _ => return,
        }
    }
}

/// Test cgroups (and their children) of killed test processes.
fn sweep_stale(mount: &Path) {
    for dir in stale(mount, "kp-lab-") {
        if let Ok(children) = std::fs::read_dir(&dir) {
            for c in children.flatten() {
                if c.path().is_dir() {
                    remove_dir(&c.path());
                }
            }
        }
        remove_dir(&dir);
    }
}

/// A threaded cgroup for one test; removed on drop.
pub struct TestCgroup {
    path: PathBuf,
    names: Vec<(String, bool)>,
}

impl TestCgroup {
    pub fn new() -> Result<TestCgroup, LabError> {
        let mut root = ROOT.lock().unwrap_or_else(|p| p.into_inner());
        if root.is_none() {
            sweep_stale_mounts();
            let mount = mount_cgroup2()?;
            sweep_stale(&mount);
            let home = own_cgroup()?;
            let dir = mount.join(format!("kp-lab-{}", std::process::id()));
            match std::fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(err(format!("creating {}", dir.display()))(e)),
            }
            write(&dir.join("cgroup.procs"), &std::process::id().to_string())?;
            *root = Some(Root {
                mount: mount.clone(),
                dir,
                home: mount.join(home),
                live: 0,
            });
        }
        let r = root
            .as_mut()
            .ok_or_else(|| LabError::Options("no cgroup root".into()))?;
        let path = r
            .dir
            .join(format!("t{}", NEXT.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir(&path).map_err(err(format!("creating {}", path.display())))?;
        if let Err(e) = write(&path.join("cgroup.type"), "threaded") {
            remove_dir(&path);
            return Err(e);
        }
        r.live += 1;
        Ok(TestCgroup {
            path,
            names: Vec::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// From now on, threads that [`crate::in_netns`] starts for a namespace
    /// whose name starts with `prefix` (a lab's) join this cgroup first.
    pub fn adopt_namespaces(&mut self, prefix: &str) {
        self.register(prefix, true);
    }

    /// The same for the one namespace `name` (a node's, a pod's); an exact
    /// name wins over a prefix.
    pub fn adopt_namespace(&mut self, name: &str) {
        self.register(name, false);
    }

    fn register(&mut self, name: &str, prefix: bool) {
        let key = (name.to_string(), prefix);
        BY_NAME
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.clone(), self.path.clone());
        self.names.push(key);
    }
}

/// Moves the calling thread into `cgroup` (a threaded one).
pub(crate) fn join_thread(cgroup: &Path) -> Result<(), LabError> {
    // SAFETY: gettid has no arguments and cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    write(&cgroup.join("cgroup.threads"), &tid.to_string())
}

/// The cgroup registered for namespace `ns`, if any.
pub(crate) fn cgroup_for_namespace(ns: &str) -> Option<PathBuf> {
    let map = BY_NAME.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = map.get(&(ns.to_string(), false)) {
        return Some(p.clone());
    }
    map.iter()
        .find(|((name, prefix), _)| *prefix && ns.starts_with(name.as_str()))
        .map(|(_, p)| p.clone())
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        {
            let mut map = BY_NAME.lock().unwrap_or_else(|p| p.into_inner());
            for k in &self.names {
                map.remove(k);
            }
        }
        remove_dir(&self.path);
        let mut root = ROOT.lock().unwrap_or_else(|p| p.into_inner());
        let last = match root.as_mut() {
            Some(r) => {
                r.live -= 1;
                r.live == 0
            }
            None => false,
        };
        if last {
            if let Some(r) = root.take() {
                let _ = std::fs::write(r.home.join("cgroup.procs"), std::process::id().to_string());
                remove_dir(&r.dir);
                unmount(&r.mount);
            }
        }
    }
}

/// Mounts the cgroup2 hierarchy at /tmp/kp-cgroup2-<pid>.
fn mount_cgroup2() -> Result<PathBuf, LabError> {
    // Fails early, with the reason, where there is no cgroup v2 at all.
    cgroup2_mount()?;
    let dir = std::env::temp_dir().join(format!("kp-cgroup2-{}", std::process::id()));
    mount_at("cgroup2", &dir)?;
    Ok(dir)
}

/// Mounts left by killed test processes: their cgroups are swept through
/// them, then they go.
fn sweep_stale_mounts() {
    for dir in stale(&std::env::temp_dir(), "kp-cgroup2-") {
        sweep_stale(&dir);
        unmount(&dir);
    }
}
