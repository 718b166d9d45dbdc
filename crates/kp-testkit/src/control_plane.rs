//! A real Kubernetes control plane for tests: etcd and kube-apiserver v1.36
//! (the static binaries in `../shared/k8s`, etcd from Debian's
//! `etcd-server`), with TLS, token authentication, `Node,RBAC`
//! authorization and a dual-stack service CIDR, as a cluster runs them.
//!
//! Why not only the in-process [`crate::ApiServer`]: it answers the
//! requests we know we make. The real server also validates objects,
//! allocates ClusterIPs and NodePorts, enforces RBAC (a verb missing from
//! deploy/clusterrole.yaml fails a test), speaks protobuf and bookmarks, and
//! is what upstream kube-proxy runs against in the differential tests.
//!
//! Each [`ControlPlane`] is private to one test: its own directory, its own
//! etcd (data on tmpfs when /dev/shm exists: etcd fsyncs every write), and,
//! when given a network namespace, addresses and ports inside it, so tests
//! run in parallel. Everything is killed and removed on drop, also when the
//! test panics (the logs are kept then, and their path printed).

use std::io::Write;
use std::net::IpAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// Set (to 1) by CI: a test that needs the binaries fails instead of skipping.
pub const REQUIRE_ENV: &str = "KP_REQUIRE_REAL_APISERVER";

/// What went wrong starting or driving the control plane.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    #[error("{what} not found: {why}")]
    Missing { what: &'static str, why: String },
    #[error("could not run `{cmd}`: {source}")]
    Spawn {
        cmd: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Command {
        cmd: String,
        status: String,
        stderr: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} not ready after {after:?}; log tail:\n{log}")]
    NotReady {
        what: &'static str,
        after: Duration,
        log: String,
    },
    #[error("{0}")]
    Object(String),
}

type Result<T> = std::result::Result<T, ControlPlaneError>;

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ControlPlaneError {
    let what = what.into();
    move |source| ControlPlaneError::Io { what, source }
}

/// The programs a control plane (and the differential tests) run.
#[derive(Debug, Clone)]
pub struct K8sBinaries {
    pub kube_apiserver: PathBuf,
    pub kubectl: PathBuf,
    pub etcd: PathBuf,
    /// Upstream kube-proxy, for differential runs and benchmarks.
    pub kube_proxy: Option<PathBuf>,
}

/// The checkout's root (two levels above this crate).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `../shared/k8s` beside the checkout, or `KP_SHARED_K8S_DIR`.
fn shared_dir() -> PathBuf {
    std::env::var_os("KP_SHARED_K8S_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared/k8s"))
}

fn executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| executable(p))
    })
}

impl K8sBinaries {
    /// Finds the binaries: `KUBE_APISERVER_BIN`, `KUBECTL_BIN`,
    /// `UPSTREAM_KUBE_PROXY_BIN` and `ETCD_BIN` when set; otherwise the
    /// Kubernetes ones are unpacked from `../shared/k8s` (its install.sh,
    /// into target/k8s-bin, once) and etcd is looked up on PATH.
    pub fn find() -> Result<K8sBinaries> {
        let from_env = |var: &str| std::env::var_os(var).map(PathBuf::from);
        let (apiserver, kubectl, proxy) =
            match (from_env("KUBE_APISERVER_BIN"), from_env("KUBECTL_BIN")) {
                (Some(a), Some(k)) => (a, k, from_env("UPSTREAM_KUBE_PROXY_BIN")),
                _ => {
                    let dir = unpack_shared()?;
                    (
                        dir.join("kube-apiserver"),
                        dir.join("kubectl"),
                        from_env("UPSTREAM_KUBE_PROXY_BIN").or(Some(dir.join("kube-proxy"))),
                    )
                }
            };
        for (what, p) in [("kube-apiserver", &apiserver), ("kubectl", &kubectl)] {
            if !executable(p) {
                return Err(ControlPlaneError::Missing {
                    what,
                    why: format!("{} is not an executable file", p.display()),
                });
            }
        }
        let etcd = from_env("ETCD_BIN")
            .or_else(|| on_path("etcd"))
            .filter(|p| executable(p))
            .ok_or_else(|| ControlPlaneError::Missing {
                what: "etcd",
                why: "not on PATH and ETCD_BIN unset (Debian: apt-get install etcd-server)".into(),
            })?;
        Ok(K8sBinaries {
            kube_apiserver: apiserver,
            kubectl,
            etcd,
            kube_proxy: proxy.filter(|p| executable(p)),
        })
    }

    /// The binaries for a test, or `None` after saying loudly on stderr that
    /// `test` is skipped and why. With `KP_REQUIRE_REAL_APISERVER=1` (CI) a
    /// missing binary fails the test instead.
    pub fn for_test(test: &str) -> Option<K8sBinaries> {
        match K8sBinaries::find() {
            Ok(b) => Some(b),
            Err(e) => {
                skip_or_fail(test, &e.to_string());
                None
            }
        }
    }

    /// etcd's version as (major, minor), from `etcd --version`. v1.36's
    /// streaming lists need progress notifications, which etcd has from 3.5
    /// (Debian bookworm's etcd-server is 3.4; test.sh fetches trixie's 3.5).
    pub fn etcd_version(&self) -> Option<(u32, u32)> {
        let out = std::process::Command::new(&self.etcd)
            .arg("--version")
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let v = text
            .lines()
            .find_map(|l| l.strip_prefix("etcd Version:"))?
            .trim()
            .to_string();
        let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
        Some((parts.next()??, parts.next()??))
    }

    /// As [`K8sBinaries::for_test`], also requiring upstream kube-proxy.
    pub fn for_test_with_upstream(test: &str) -> Option<K8sBinaries> {
        let b = K8sBinaries::for_test(test)?;
        if b.kube_proxy.is_none() {
            skip_or_fail(
                test,
                "upstream kube-proxy not found (UPSTREAM_KUBE_PROXY_BIN or ../shared/k8s)",
            );
            return None;
        }
        Some(b)
    }
}

fn skip_or_fail(test: &str, why: &str) {
    if std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1") {
        panic!("{test}: needs a real kube-apiserver, and {REQUIRE_ENV}=1: {why}");
    }
    eprintln!(
        "\n!!! SKIPPED {test}: no real Kubernetes control plane: {why}.\n!!! Put ../shared/k8s beside the checkout or set KUBE_APISERVER_BIN, KUBECTL_BIN \
         (and UPSTREAM_KUBE_PROXY_BIN, ETCD_BIN); {REQUIRE_ENV}=1 turns this skip into a failure.\n"
    );
}

/// Unpacks ../shared/k8s into target/k8s-bin once (install.sh checks the
/// sums). Parallel test processes each unpack into their own directory and
/// rename it into place; the loser's copy is dropped.
fn unpack_shared() -> Result<PathBuf> {
    let shared = shared_dir();
    let install = shared.join("install.sh");
    if !install.is_file() {
        return Err(ControlPlaneError::Missing {
            what: "Kubernetes binaries",
            why: format!("{} does not exist", install.display()),
        });
    }
    let dest = workspace_root().join("target/k8s-bin");
    let complete = |d: &Path| {
        ["kube-apiserver", "kubectl", "kube-proxy"]
            .iter()
            .all(|b| executable(&d.join(b)))
    };
    if complete(&dest) {
        return Ok(dest);
    }
    let tmp = workspace_root().join(format!("target/k8s-bin.tmp{}", std::process::id()));
    let out = Command::new("bash")
        .arg(&install)
        .arg(&tmp)
        .output()
        .map_err(|source| ControlPlaneError::Spawn {
            cmd: format!("bash {}", install.display()),
            source,
        })?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(ControlPlaneError::Missing {
            what: "Kubernetes binaries",
            why: format!(
                "{} failed: {}",
                install.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    if std::fs::rename(&tmp, &dest).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    if complete(&dest) {
        Ok(dest)
    } else {
        Err(ControlPlaneError::Missing {
            what: "Kubernetes binaries",
            why: format!("{} is incomplete after unpacking", dest.display()),
        })
    }
}

/// Where a [`ControlPlane`] runs.
#[derive(Debug, Clone)]
pub struct ControlPlaneOpts {
    /// Network namespace (`ip netns`) to run etcd, the API server and kubectl
    /// in; `None` runs them in the caller's, on free ports. On 127.0.0.1 the
    /// server cannot publish the `kubernetes` Service's endpoint (loopback
    /// is invalid there): it logs that and serves everything else.
    pub netns: Option<String>,
    /// The API server's serving (and advertised) address.
    pub address: IpAddr,
    /// `--service-cluster-ip-range` (dual-stack by default).
    pub service_cidrs: String,
    /// `--service-node-port-range` (the default, 30000-32767).
    pub node_port_range: String,
    /// Label for directories and logs.
    pub name: String,
    /// More kube-apiserver flags (e.g. `--feature-gates=WatchList=false`).
    pub apiserver_args: Vec<String>,
}

impl ControlPlaneOpts {
    /// In namespace `ns`, serving on `address`.
    pub fn in_netns(name: &str, ns: &str, address: IpAddr) -> ControlPlaneOpts {
        ControlPlaneOpts {
            netns: Some(ns.to_string()),
            address,
            service_cidrs: "10.96.0.0/16,fd00:96::/108".into(),
            node_port_range: "30000-32767".into(),
            name: name.to_string(),
            apiserver_args: Vec::new(),
        }
    }

    /// In the caller's namespace, on 127.0.0.1 and free ports.
    pub fn on_loopback(name: &str) -> ControlPlaneOpts {
        ControlPlaneOpts {
            netns: None,
            address: IpAddr::from([127, 0, 0, 1]),
            ..ControlPlaneOpts::in_netns(name, "", IpAddr::from([127, 0, 0, 1]))
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Ports {
    etcd_client: u16,
    etcd_peer: u16,
    etcd_metrics: u16,
    apiserver: u16,
}

/// A running etcd + kube-apiserver; see the module documentation.
pub struct ControlPlane {
    bins: K8sBinaries,
    opts: ControlPlaneOpts,
    dir: PathBuf,
    etcd_dir: PathBuf,
    ports: Ports,
    admin_kubeconfig: PathBuf,
    etcd: Option<Child>,
    apiserver: Option<Child>,
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn unique(name: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "kp-cp-{name}-{}-{}-{nanos:x}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A port nobody listens on in this namespace right now.
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(io_err("finding a free port"))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(io_err("finding a free port"))
}

fn random_hex(bytes: usize) -> Result<String> {
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut buf))
        .map_err(io_err("reading /dev/urandom"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

fn run_ok(cmd: &mut Command) -> Result<Output> {
    let desc = format!("{cmd:?}");
    let out = cmd.output().map_err(|source| ControlPlaneError::Spawn {
        cmd: desc.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(ControlPlaneError::Command {
            cmd: desc,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(out)
}

fn tail(path: &Path, lines: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

fn kill(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Writes a kubeconfig for `server` trusting `ca`, authenticating with `token`.
pub fn write_kubeconfig(path: &Path, server: &str, ca: &Path, token: &str) -> Result<()> {
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: kp-test\n  cluster:\n    server: {server}\n    certificate-authority: {}\nusers:\n- name: kp-test\n  user:\n    token: {token}\ncontexts:\n- name: kp-test\n  context:\n    cluster: kp-test\n    user: kp-test\ncurrent-context: kp-test\n",
        ca.display()
    );
    std::fs::write(path, text).map_err(io_err(format!("writing {}", path.display())))
}

impl ControlPlane {
    /// Generates certificates and tokens, starts etcd and the API server and
    /// waits until `/readyz` answers (RBAC's bootstrap roles are in by then).
    pub fn start(bins: &K8sBinaries, opts: ControlPlaneOpts) -> Result<ControlPlane> {
        let id = unique(&opts.name);
        let dir = std::env::temp_dir().join(&id);
        std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let shm = Path::new("/dev/shm");
        let etcd_dir = if shm.is_dir() {
            shm.join(format!("{id}-etcd"))
        } else {
            dir.join("etcd")
        };
        // A fresh namespace has every port free; on the caller's loopback
        // other tests run too.
        let ports = if opts.netns.is_some() {
            Ports {
                etcd_client: 2379,
                etcd_peer: 2380,
                etcd_metrics: 2381,
                apiserver: 6443,
            }
        } else {
            Ports {
                etcd_client: free_port()?,
                etcd_peer: free_port()?,
                etcd_metrics: free_port()?,
                apiserver: free_port()?,
            }
        };
        let mut cp = ControlPlane {
            bins: bins.clone(),
            admin_kubeconfig: dir.join("admin.kubeconfig"),
            opts,
            dir,
            etcd_dir,
            ports,
            etcd: None,
            apiserver: None,
        };
        cp.make_credentials()?;
        cp.start_etcd()?;
        cp.start_apiserver()?;
        Ok(cp)
    }

    fn make_credentials(&self) -> Result<()> {
        let d = &self.dir;
        let ssl = |args: &[&str]| run_ok(Command::new("openssl").args(args).current_dir(d));
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
        let mut ca = vec!["req", "-x509", "-nodes", "-days", "2"];
        ca.extend(ec);
        ca.extend([
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-subj",
            "/CN=kp-test-ca",
        ]);
        ssl(&ca)?;
        let mut csr = vec!["req", "-new", "-nodes"];
        csr.extend(ec);
        csr.extend([
            "-keyout",
            "apiserver.key",
            "-out",
            "apiserver.csr",
            "-subj",
            "/CN=kube-apiserver",
        ]);
        ssl(&csr)?;
        // rustls (kube-rs) refuses a serving certificate marked CA:TRUE,
        // which `req -x509` would add: sign it as a leaf.
        let ext = format!(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:{},IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\n",
            self.opts.address
        );
        std::fs::write(d.join("apiserver.ext"), ext).map_err(io_err("writing apiserver.ext"))?;
        ssl(&[
            "x509",
            "-req",
            "-in",
            "apiserver.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "apiserver.ext",
            "-out",
            "apiserver.crt",
        ])?;
        // Service account tokens: RS256, what every client expects.
        ssl(&["genrsa", "-out", "sa.key", "2048"])?;
        ssl(&["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
        let admin = random_hex(16)?;
        std::fs::write(
            d.join("tokens.csv"),
            format!("{admin},kp-admin,kp-admin,\"system:masters\"\n"),
        )
        .map_err(io_err("writing tokens.csv"))?;
        write_kubeconfig(&self.admin_kubeconfig, &self.url(), &self.ca(), &admin)
    }

    /// `program args` in our namespace (if any), output to `log`.
    fn command(&self, program: &Path) -> Command {
        match &self.opts.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(program);
                c
            }
            None => Command::new(program),
        }
    }

    fn spawn(&self, program: &Path, args: &[String], log: &str) -> Result<Child> {
        let path = self.dir.join(log);
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io_err(format!("opening {}", path.display())))?;
        let f2 = f.try_clone().map_err(io_err("duplicating a log fd"))?;
        let mut cmd = self.command(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(f)
            .stderr(f2)
            .process_group(0);
        cmd.spawn().map_err(|source| ControlPlaneError::Spawn {
            cmd: format!("{} {}", program.display(), args.join(" ")),
            source,
        })
    }

    /// Starts etcd on its data directory (kept across restarts).
    pub fn start_etcd(&mut self) -> Result<()> {
        kill(&mut self.etcd);
        let p = self.ports;
        let client = format!("http://127.0.0.1:{}", p.etcd_client);
        let peer = format!("http://127.0.0.1:{}", p.etcd_peer);
        let args: Vec<String> = vec![
            format!("--data-dir={}", self.etcd_dir.display()),
            format!("--listen-client-urls={client}"),
            format!("--advertise-client-urls={client}"),
            format!("--listen-peer-urls={peer}"),
            format!("--initial-advertise-peer-urls={peer}"),
            format!("--initial-cluster=default={peer}"),
            format!("--listen-metrics-urls=http://127.0.0.1:{}", p.etcd_metrics),
            "--log-level=warn".into(),
        ];
        let child = self.spawn(&self.bins.etcd.clone(), &args, "etcd.log")?;
        self.etcd = Some(child);
        Ok(())
    }

    /// Kills etcd (as a crash would) and starts it again on the same data.
    pub fn restart_etcd(&mut self) -> Result<()> {
        kill(&mut self.etcd);
        self.start_etcd()
    }

    /// Kills etcd; [`ControlPlane::start_etcd`] brings it back.
    pub fn stop_etcd(&mut self) {
        kill(&mut self.etcd);
    }

    fn apiserver_args(&self) -> Vec<String> {
        let d = &self.dir;
        let a = self.opts.address;
        vec![
            format!("--bind-address={a}"),
            format!("--advertise-address={a}"),
            format!("--secure-port={}", self.ports.apiserver),
            format!("--etcd-servers=http://127.0.0.1:{}", self.ports.etcd_client),
            format!("--tls-cert-file={}", d.join("apiserver.crt").display()),
            format!(
                "--tls-private-key-file={}",
                d.join("apiserver.key").display()
            ),
            format!("--client-ca-file={}", d.join("ca.crt").display()),
            format!("--token-auth-file={}", d.join("tokens.csv").display()),
            "--authorization-mode=Node,RBAC".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", d.join("sa.pub").display()),
            format!(
                "--service-account-signing-key-file={}",
                d.join("sa.key").display()
            ),
            format!("--service-cluster-ip-range={}", self.opts.service_cidrs),
            format!("--service-node-port-range={}", self.opts.node_port_range),
            format!("--cert-dir={}", d.join("certs").display()),
            "--profiling=false".into(),
        ]
        .into_iter()
        .chain(self.opts.apiserver_args.iter().cloned())
        .collect()
    }

    /// Starts the API server and waits for `/readyz`.
    pub fn start_apiserver(&mut self) -> Result<()> {
        kill(&mut self.apiserver);
        let args = self.apiserver_args();
        let child = self.spawn(&self.bins.kube_apiserver.clone(), &args, "apiserver.log")?;
        self.apiserver = Some(child);
        self.wait_ready(Duration::from_secs(90))
    }

    /// Kills the API server (SIGKILL: no graceful shutdown, as a crash).
    pub fn stop_apiserver(&mut self) {
        kill(&mut self.apiserver);
    }

    /// Waits until `/readyz` answers ok.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        loop {
            if let Some(c) = self.apiserver.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    return Err(ControlPlaneError::NotReady {
                        what: "kube-apiserver",
                        after: t0.elapsed(),
                        log: format!(
                            "exited with {st}\n{}",
                            tail(&self.dir.join("apiserver.log"), 30)
                        ),
                    });
                }
            }
            if self
                .kubectl(&["get", "--raw", "/readyz"])
                .is_ok_and(|s| s.trim() == "ok")
            {
                return Ok(());
            }
            if t0.elapsed() > timeout {
                return Err(ControlPlaneError::NotReady {
                    what: "kube-apiserver",
                    after: t0.elapsed(),
                    log: format!(
                        "{}\n--- etcd ---\n{}",
                        tail(&self.dir.join("apiserver.log"), 30),
                        tail(&self.dir.join("etcd.log"), 10)
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// `https://ADDRESS:PORT`.
    pub fn url(&self) -> String {
        let host = match self.opts.address {
            IpAddr::V6(a) => format!("[{a}]"),
            IpAddr::V4(a) => a.to_string(),
        };
        format!("https://{host}:{}", self.ports.apiserver)
    }

    /// The CA that signed the serving certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// An admin (system:masters) kubeconfig.
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// The test's directory (certificates, kubeconfigs, logs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// etcd's client URL (plain HTTP on loopback: reachable from inside the
    /// control plane's namespace, when it has one).
    pub fn etcd_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.etcd_client)
    }

    /// etcd's data directory (`member/snap/db` is its database).
    pub fn etcd_dir(&self) -> &Path {
        &self.etcd_dir
    }

    /// The process ids of etcd and the API server, while they run (`ip
    /// netns exec` execs them: the child is the server itself).
    pub fn pids(&self) -> (Option<u32>, Option<u32>) {
        (
            self.etcd.as_ref().map(Child::id),
            self.apiserver.as_ref().map(Child::id),
        )
    }

    /// The last lines of the API server's log.
    pub fn apiserver_log_tail(&self, lines: usize) -> String {
        tail(&self.dir.join("apiserver.log"), lines)
    }

    /// Runs kubectl as admin (in our namespace); its stdout.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.kubectl_stdin(args, None)
    }

    /// As [`ControlPlane::kubectl`], feeding `stdin`.
    pub fn kubectl_stdin(&self, args: &[&str], stdin: Option<&[u8]>) -> Result<String> {
        let mut cmd = self.command(&self.bins.kubectl);
        cmd.arg(format!("--kubeconfig={}", self.admin_kubeconfig.display()))
            .arg("--request-timeout=20s")
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let desc = format!("kubectl {}", args.join(" "));
        let mut child = cmd.spawn().map_err(|source| ControlPlaneError::Spawn {
            cmd: desc.clone(),
            source,
        })?;
        if let (Some(data), Some(mut w)) = (stdin, child.stdin.take()) {
            w.write_all(data)
                .map_err(io_err(format!("{desc}: stdin")))?;
        }
        let out = child
            .wait_with_output()
            .map_err(io_err(format!("{desc}: waiting")))?;
        if !out.status.success() {
            return Err(ControlPlaneError::Command {
                cmd: desc,
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Creates or updates `obj` (server-side apply, one field manager, so a
    /// field left out of a later version is removed). A `status` in `obj` is
    /// written afterwards through the status subresource, as a controller
    /// (the LB provider, the kubelet) would.
    pub fn apply(&self, obj: &Value) -> Result<()> {
        let mut spec = obj.clone();
        let status = spec.as_object_mut().and_then(|o| o.remove("status"));
        let body =
            serde_json::to_vec(&spec).map_err(|e| ControlPlaneError::Object(e.to_string()))?;
        self.kubectl_stdin(
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=kp-test",
                "-f",
                "-",
            ],
            Some(&body),
        )?;
        if let Some(status) = status {
            let (kind, ns, name) = object_ref(obj)?;
            let patch = serde_json::json!({ "status": status }).to_string();
            let mut args = vec![
                "patch",
                kind.as_str(),
                name.as_str(),
                "--subresource=status",
                "--type=merge",
                "-p",
                patch.as_str(),
            ];
            if let Some(ns) = ns.as_deref() {
                args.extend(["-n", ns]);
            }
            self.kubectl(&args)?;
        }
        Ok(())
    }

    /// Deletes the object `obj` names (kind, namespace, name); absent is fine.
    pub fn delete(&self, obj: &Value) -> Result<()> {
        let (kind, ns, name) = object_ref(obj)?;
        let mut args = vec![
            "delete",
            kind.as_str(),
            name.as_str(),
            "--ignore-not-found",
            "--wait=false",
        ];
        if let Some(ns) = ns.as_deref() {
            args.extend(["-n", ns]);
        }
        self.kubectl(&args).map(|_| ())
    }

    /// Applies every document of a YAML file (e.g. deploy/clusterrole.yaml).
    pub fn apply_file(&self, path: &Path) -> Result<()> {
        self.kubectl(&[
            "apply",
            "--server-side",
            "--field-manager=kp-test",
            "-f",
            &path.display().to_string(),
        ])
        .map(|_| ())
    }

    /// A kubeconfig at `path` with a fresh token of ServiceAccount `ns/sa`
    /// (the TokenRequest API, as the kubelet mounts it into a pod).
    pub fn service_account_kubeconfig(&self, ns: &str, sa: &str, path: &Path) -> Result<()> {
        let token = self.kubectl(&["create", "token", sa, "-n", ns, "--duration=2h"])?;
        write_kubeconfig(path, &self.url(), &self.ca(), token.trim())
    }
}

/// (kubectl resource name, namespace, name) of an object.
fn object_ref(obj: &Value) -> Result<(String, Option<String>, String)> {
    let s = |v: &Value| v.as_str().map(str::to_string);
    let kind =
        s(&obj["kind"]).ok_or_else(|| ControlPlaneError::Object("object has no kind".into()))?;
    let name = s(&obj["metadata"]["name"])
        .ok_or_else(|| ControlPlaneError::Object(format!("{kind} has no metadata.name")))?;
    // kubectl resolves "Kind.group" (EndpointSlice.discovery.k8s.io).
    let group = s(&obj["apiVersion"])
        .and_then(|v| v.split_once('/').map(|(g, _)| g.to_string()))
        .map(|g| format!("{kind}.{g}"))
        .unwrap_or(kind);
    Ok((group, s(&obj["metadata"]["namespace"]), name))
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        kill(&mut self.apiserver);
        kill(&mut self.etcd);
        let _ = std::fs::remove_dir_all(&self.etcd_dir);
        if std::thread::panicking() {
            eprintln!(
                "control plane logs kept in {} (apiserver.log, etcd.log)",
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
