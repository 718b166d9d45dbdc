//! The binary re-executes itself once with mimalloc's arena eager commit and
//! purge delay off (main.rs says why; BENCHMARKS.md "Steady state" has the
//! figures), keeps its process name, and leaves an operator's own mimalloc
//! options alone, and runs on two threads. Runs the proxy in a fresh network
//! namespace (root needed) and reads /proc/PID/environ, comm and task.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure
#![cfg(feature = "mimalloc")]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A network namespace and a directory, removed on drop even when the test
/// fails; the proxy is killed first.
struct Lab {
    ns: String,
    dir: std::path::PathBuf,
    proxy: Option<Child>,
}

impl Lab {
    fn new(tag: &str) -> Lab {
        let ns = format!("kpalloc{tag}{}", std::process::id());
        assert!(Command::new("ip")
            .args(["netns", "add", &ns])
            .status()
            .unwrap()
            .success());
        let dir = std::env::temp_dir().join(format!("{ns}-manifests"));
        std::fs::create_dir_all(&dir).unwrap();
        Lab {
            ns,
            dir,
            proxy: None,
        }
    }

    /// Starts the proxy (nftables mode, no Services) with `env` added; its pid.
    fn start(&mut self, env: &[(&str, &str)]) -> u32 {
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns",
            "exec",
            &self.ns,
            env!("CARGO_BIN_EXE_kube-proxy-rs"),
            "--proxy-mode=nftables",
            "--hostname-override=node1",
            "--conntrack-max-per-core=0",
            "--metrics-bind-address=127.0.0.1:10249",
            "--healthz-bind-address=127.0.0.1:10256",
        ])
        .arg(format!("--manifests={}", self.dir.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        for v in ["MIMALLOC_ARENA_EAGER_COMMIT", "MIMALLOC_PURGE_DELAY"] {
            cmd.env_remove(v);
        }
        cmd.envs(env.iter().copied());
        let child = cmd.spawn().unwrap();
        let pid = child.id();
        self.proxy = Some(child);
        pid
    }

    /// The process's environment once it runs kube-proxy-rs with its
    /// metrics up (past `ip netns exec` and any re-exec).
    fn environ(&mut self, pid: u32) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let up = Command::new("ip")
                .args(["netns", "exec", &self.ns, "ss", "-Htln", "sport = :10249"])
                .output()
                .map(|o| !o.stdout.is_empty())
                .unwrap_or(false);
            if comm.trim() == "kube-proxy-rs" && up {
                let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
                return raw
                    .split(|b| *b == 0)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .filter(|v| v.starts_with("MIMALLOC_"))
                    .collect();
            }
            if let Some(st) = self.proxy.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!("the proxy exited: {st}");
            }
            assert!(
                Instant::now() < deadline,
                "pid {pid} never ran kube-proxy-rs with its metrics up (comm {comm:?})"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.proxy.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.stop();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn the_proxy_runs_with_mimalloc_tuned_unless_the_operator_chose() {
    let mut lab = Lab::new("a");
    let pid = lab.start(&[]);
    let mut env = lab.environ(pid);
    env.sort();
    assert_eq!(
        env,
        ["MIMALLOC_ARENA_EAGER_COMMIT=0", "MIMALLOC_PURGE_DELAY=200"],
        "the proxy did not re-execute itself with the allocator options"
    );
    lab.stop();

    // An operator's own option wins, and no other is added.
    let pid = lab.start(&[("MIMALLOC_PURGE_DELAY", "7")]);
    assert_eq!(lab.environ(pid), ["MIMALLOC_PURGE_DELAY=7"]);
}

/// Two threads once running: the async runtime's (main.rs says why there is
/// only one) and the sync loop's. Each thread that allocates keeps its own
/// partly used allocator pages, so a thread more is RSS more.
#[test]
fn the_proxy_runs_on_two_threads() {
    let mut lab = Lab::new("t");
    let pid = lab.start(&[]);
    // The metrics listener is a task on the runtime thread, which first
    // runs after main has started the sync thread: once it listens, both
    // threads exist.
    lab.environ(pid);
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .map(|t| {
            let t = t.unwrap().path().join("comm");
            std::fs::read_to_string(t).unwrap().trim().to_string()
        })
        .collect();
    names.sort();
    assert_eq!(names, ["kube-proxy-rs", "sync"], "threads of pid {pid}");
}
