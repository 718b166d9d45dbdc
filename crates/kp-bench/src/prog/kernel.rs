//! The namespace the programs run in, loading a build over maps of its
//! own, filling them, and BPF_PROG_TEST_RUN.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use aya::programs::SchedClassifier;
use aya::EbpfLoader;
use kp_ebpf::maps::{BackendKey, BackendVal, MemberKey, SvcKey, SvcVal};
use kp_model::Protocol;

use super::frames::{Frame, Out, NODE_MAC, PEER_MAC};
use super::{NODE4, NODE6};

/// A Service port's address: 10.200.0.0/16 (then 10.201...), and
/// fd00:200::/64.
pub fn service_addr4(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0ac8_0000u32 + i)
}
pub fn service_addr6(i: u32) -> Ipv6Addr {
    Ipv6Addr::from(0xfd00_0200_0000_0000_0000_0000_0000_0000u128 + u128::from(i))
}
fn endpoint4(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0af4_0000u32 + (i & 0xffff))
}
fn endpoint6(i: u32) -> Ipv6Addr {
    Ipv6Addr::from(0xfd00_0244_0000_0000_0000_0000_0000_0000u128 + u128::from(i))
}

/// The process's own network and mount namespaces (unshared: they go
/// with the process, and with them the interfaces and the bpffs), an
/// external interface with routes to the endpoints, and a bpffs for the
/// pins.
pub struct Lab {
    pub ifindex: u32,
    bpffs: PathBuf,
}

fn sh(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Lab {
    /// `xdp`: eth0 also runs an XDP program that passes everything, which
    /// registers its receive queue's XDP info: BPF_PROG_TEST_RUN gives an
    /// XDP program its ingress interface only then.
    pub fn new(xdp: bool) -> Result<Lab> {
        // SAFETY: unshare affects this process only; it is single-threaded
        // here (the harness starts no thread before).
        if unsafe { libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS) } != 0 {
            return Err(std::io::Error::last_os_error())
                .context("unshare(CLONE_NEWNET|CLONE_NEWNS) (run as root)");
        }
        // No mount of ours propagates back to the host's namespace.
        // SAFETY: mount(2) with valid C strings.
        let rc = unsafe {
            libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("making / private");
        }
        // A fresh bpffs over /sys/fs/bpf, seen by this mount namespace
        // alone: no directory of ours on the host to remove afterwards
        // (which a --least-privilege run could not unmount).
        let bpffs = PathBuf::from("/sys/fs/bpf");
        let c = std::ffi::CString::new(bpffs.as_os_str().as_encoded_bytes())?;
        // SAFETY: mount(2) with valid C strings.
        let rc = unsafe {
            libc::mount(
                c"bpf".as_ptr(),
                c.as_ptr(),
                c"bpf".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("mounting a bpffs");
        }
        let mac = |m: [u8; 6]| {
            m.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        };
        let (node_mac, peer_mac) = (mac(NODE_MAC), mac(PEER_MAC));
        for cmd in [
            vec!["ip", "link", "set", "lo", "up"],
            vec![
                "ip", "link", "add", "eth0", "address", &node_mac, "type", "veth", "peer", "name",
                "peer0", "address", &peer_mac,
            ],
            vec!["ip", "link", "set", "eth0", "up"],
            vec!["ip", "link", "set", "peer0", "up"],
            vec!["ip", "addr", "add", "192.168.77.1/24", "dev", "eth0"],
            vec![
                "ip",
                "-6",
                "addr",
                "add",
                "fd00:77::1/64",
                "dev",
                "eth0",
                "nodad",
            ],
            vec![
                "ip",
                "neigh",
                "replace",
                "192.168.77.254",
                "lladdr",
                &peer_mac,
                "dev",
                "eth0",
                "nud",
                "permanent",
            ],
            vec![
                "ip",
                "-6",
                "neigh",
                "replace",
                "fd00:77::fe",
                "lladdr",
                &peer_mac,
                "dev",
                "eth0",
                "nud",
                "permanent",
            ],
            vec![
                "ip",
                "route",
                "add",
                "10.244.0.0/16",
                "via",
                "192.168.77.254",
                "dev",
                "eth0",
            ],
            vec![
                "ip",
                "route",
                "add",
                "198.51.100.0/24",
                "via",
                "192.168.77.254",
                "dev",
                "eth0",
            ],
            vec![
                "ip",
                "-6",
                "route",
                "add",
                "fd00:244::/64",
                "via",
                "fd00:77::fe",
                "dev",
                "eth0",
            ],
            vec![
                "ip",
                "-6",
                "route",
                "add",
                "fd00:51::/64",
                "via",
                "fd00:77::fe",
                "dev",
                "eth0",
            ],
        ] {
            sh(&cmd)?;
        }
        if xdp {
            let obj =
                std::env::temp_dir().join(format!("kp-prog-{}-xdp_pass.o", std::process::id()));
            std::fs::write(&obj, kp_ebpf::XDP_PASS_OBJECT)?;
            let path = obj.to_string_lossy().into_owned();
            let r = sh(&[
                "ip", "link", "set", "dev", "eth0", "xdp", "obj", &path, "sec", "xdp",
            ]);
            let _ = std::fs::remove_file(&obj);
            r?;
        }
        // This namespace's own: the node forwards.
        for p in [
            "/proc/sys/net/ipv4/conf/all/forwarding",
            "/proc/sys/net/ipv4/conf/eth0/forwarding",
            "/proc/sys/net/ipv6/conf/all/forwarding",
            "/proc/sys/net/ipv6/conf/eth0/forwarding",
        ] {
            std::fs::write(p, "1").with_context(|| format!("writing {p}"))?;
        }
        // SAFETY: a valid C string.
        let ifindex = unsafe { libc::if_nametoindex(c"eth0".as_ptr()) };
        if ifindex == 0 {
            bail!("eth0 has no index");
        }
        Ok(Lab { ifindex, bpffs })
    }
}

/// Keeps CAP_NET_ADMIN and CAP_BPF, as deploy/'s DaemonSet with
/// --socket-lb: the verifier then hardens against Spectre (no
/// CAP_PERFMON).
pub fn drop_to_deploy_caps() -> Result<()> {
    const CAP_NET_ADMIN: u32 = 12;
    const CAP_BPF: u32 = 39;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut d = [Data::default(); 2];
    for cap in [CAP_NET_ADMIN, CAP_BPF] {
        let (i, bit) = ((cap / 32) as usize, 1u32 << (cap % 32));
        d[i].effective |= bit;
        d[i].permitted |= bit;
    }
    let h = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    // SAFETY: capset with a valid header and two data structs (version 3).
    let rc = unsafe { libc::syscall(libc::SYS_capset, &h as *const Header, d.as_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("capset");
    }
    Ok(())
}

/// One build's tc program over maps of its own.
pub struct Build {
    fd: RawFd,
    // Keeps the object's maps and program (its fd) alive.
    _obj: aya::Ebpf,
    dir: PathBuf,
    ifindex: u32,
    xdp: bool,
}

#[repr(C)]
#[derive(Default)]
struct TestAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

/// struct __sk_buff's size, and where ingress_ifindex and ifindex are.
const SKB_CTX: usize = 192;
/// struct xdp_md's size.
const XDP_CTX: usize = 24;
const SKB_INGRESS_IFINDEX: usize = 36;
const SKB_IFINDEX: usize = 40;

fn bpf(cmd: libc::c_long, attr: *mut u8, size: usize) -> std::io::Result<()> {
    // SAFETY: the bpf syscall with an attribute block of `size` bytes.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr, size) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn update(fd: RawFd, key: &[u8], value: &[u8]) -> Result<()> {
    #[repr(C)]
    struct Attr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }
    let mut a = Attr {
        map_fd: fd as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value: value.as_ptr() as u64,
        flags: 0,
    };
    bpf(2, (&mut a as *mut Attr).cast(), std::mem::size_of::<Attr>()).context("BPF_MAP_UPDATE_ELEM")
}

fn bytes<T: aya::Pod>(t: &T) -> &[u8] {
    // SAFETY: Pod types are plain bytes without padding.
    unsafe { std::slice::from_raw_parts((t as *const T).cast(), std::mem::size_of::<T>()) }
}

struct PinnedMap {
    fd: aya::maps::MapData,
    key: usize,
    value: usize,
    max: u32,
}

/// Opened by its pin (BPF_OBJ_GET: no CAP_SYS_ADMIN, which opening by id
/// would need).
fn pinned(dir: &Path, name: &str) -> Result<PinnedMap> {
    let data =
        aya::maps::MapData::from_pin(dir.join(name)).with_context(|| format!("map {name}"))?;
    let info = data.info().with_context(|| format!("map {name}"))?;
    Ok(PinnedMap {
        key: info.key_size() as usize,
        value: info.value_size() as usize,
        max: info.max_entries(),
        fd: data,
    })
}

impl Build {
    /// Loads `object` (a tc.o) with its maps pinned under the lab's bpffs
    /// in a directory of its own, and fills them as at `services` Service
    /// ports of `endpoints` endpoints.
    /// With `xdp`, `object` is an xdp.o and kp_np_xdp is timed.
    pub fn load(
        lab: &Lab,
        name: &str,
        object: &[u8],
        services: u32,
        endpoints: u32,
        xdp: bool,
    ) -> Result<Build> {
        let dir = lab.bpffs.join(format!("{name}-{services}"));
        std::fs::create_dir_all(&dir)?;
        let per = services.div_ceil(4).max(1);
        let keys = 4 * per;
        let backends = keys * endpoints;
        let mut obj = EbpfLoader::new()
            .default_map_pin_directory(&dir)
            .map_max_entries("kp_services", (keys * 2).max(1024))
            .map_max_entries("kp_backends", (backends * 2).max(1024))
            .map_max_entries("kp_members", (backends * 2).max(1024))
            .load(object)
            .context("loading the object")?;
        // The object keeps the program (and this fd) alive.
        let prog_fd = if xdp {
            let prog: &mut aya::programs::Xdp = obj
                .program_mut("kp_np_xdp")
                .context("no kp_np_xdp")?
                .try_into()
                .context("kp_np_xdp")?;
            prog.load().context("verifying kp_np_xdp")?;
            prog.fd()?.as_fd().as_raw_fd()
        } else {
            let prog: &mut SchedClassifier = obj
                .program_mut("kp_np_external")
                .context("no kp_np_external")?
                .try_into()
                .context("kp_np_external")?;
            prog.load().context("verifying kp_np_external")?;
            prog.fd()?.as_fd().as_raw_fd()
        };
        let sv = pinned(&dir, "kp_services")?;
        let bk = pinned(&dir, "kp_backends")?;
        let mb = pinned(&dir, "kp_members")?;
        let node = pinned(&dir, "kp_np_node")?;
        let words = |ip: IpAddr| kp_ebpf::maps::addr_words(ip);
        for (i, a) in [
            (0u32, words(IpAddr::V4(NODE4))),
            (1, words(IpAddr::V6(NODE6))),
        ] {
            update(
                node.fd.fd().as_fd().as_raw_fd(),
                &i.to_ne_bytes(),
                bytes(&a),
            )?;
        }
        let mut id = 0u32;
        for k in 0..per {
            for (v6, proto, port) in [
                (false, Protocol::Tcp, 80u16),
                (false, Protocol::Udp, 53),
                (true, Protocol::Tcp, 80),
                (true, Protocol::Udp, 53),
            ] {
                id += 1;
                let addr = if v6 {
                    IpAddr::V6(service_addr6(k))
                } else {
                    IpAddr::V4(service_addr4(k))
                };
                let key = SvcKey::new(addr, port, proto).outside();
                let val = SvcVal {
                    id,
                    count: endpoints,
                    maglev_size: 0,
                    flags: 0,
                };
                for slot in 0..endpoints {
                    let n = id.wrapping_mul(endpoints).wrapping_add(slot);
                    let ep = if v6 {
                        IpAddr::V6(endpoint6(n))
                    } else {
                        IpAddr::V4(endpoint4(n))
                    };
                    let b = BackendVal::new(ep, 8080);
                    update(
                        bk.fd.fd().as_fd().as_raw_fd(),
                        bytes(&BackendKey { svc_id: id, slot }),
                        bytes(&b),
                    )?;
                    if proto == Protocol::Udp {
                        let m = MemberKey {
                            svc_id: id,
                            backend: b,
                        };
                        update(
                            mb.fd.fd().as_fd().as_raw_fd(),
                            bytes(&m),
                            &slot.to_ne_bytes(),
                        )?;
                    }
                }
                update(sv.fd.fd().as_fd().as_raw_fd(), bytes(&key), bytes(&val))?;
            }
        }
        // Other flows in the flow tables, as a busy node has: random
        // tuples that no test frame matches, up to half of each table (an
        // LRU fuller than that evicts, the entries being timed too).
        if services > 1 {
            // Builds with the replies in a table of their own get as many
            // flows in all as those with one table for both.
            let tables: Vec<&str> = ["kp_np_flows", "kp_np_replies"]
                .into_iter()
                .filter(|t| dir.join(t).exists())
                .collect();
            let per_table = services * 2 / tables.len() as u32;
            for table in tables {
                let m = pinned(&dir, table)?;
                let n = per_table.min(m.max / 2);
                let mut seed = 0x9e37_79b9_7f4a_7c15u64;
                let mut key = vec![0u8; m.key];
                let mut val = vec![0u8; m.value];
                for _ in 0..n {
                    for b in key.iter_mut().chain(val.iter_mut()) {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        *b = seed as u8;
                    }
                    update(m.fd.fd().as_fd().as_raw_fd(), &key, &val)?;
                }
            }
        }
        Ok(Build {
            fd: prog_fd,
            _obj: obj,
            dir,
            ifindex: lab.ifindex,
            xdp,
        })
    }

    /// What the program returns for a packet it translated and sent on:
    /// TC_ACT_REDIRECT, or XDP_TX.
    pub fn sent(&self) -> u32 {
        if self.xdp {
            3
        } else {
            7
        }
    }

    fn run(&self, data: &[u8], out: &mut [u8]) -> Result<(u32, u32, usize)> {
        let mut ctx = [0u8; SKB_CTX];
        let ctx_len = if self.xdp {
            // struct xdp_md: data 0, data_end the frame's length, the
            // interface it came in by (queue 0).
            ctx[4..8].copy_from_slice(&(data.len() as u32).to_ne_bytes());
            ctx[12..16].copy_from_slice(&self.ifindex.to_ne_bytes());
            XDP_CTX
        } else {
            ctx[SKB_INGRESS_IFINDEX..SKB_INGRESS_IFINDEX + 4]
                .copy_from_slice(&self.ifindex.to_ne_bytes());
            ctx[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&self.ifindex.to_ne_bytes());
            SKB_CTX
        };
        let fd = self.fd;
        let mut a = TestAttr {
            prog_fd: fd as u32,
            data_size_in: data.len() as u32,
            data_size_out: out.len() as u32,
            data_in: data.as_ptr() as u64,
            data_out: out.as_mut_ptr() as u64,
            repeat: 1,
            ctx_size_in: ctx_len as u32,
            ctx_in: ctx.as_ptr() as u64,
            ..Default::default()
        };
        bpf(
            10,
            (&mut a as *mut TestAttr).cast(),
            std::mem::size_of::<TestAttr>(),
        )
        .context("BPF_PROG_TEST_RUN")?;
        Ok((a.retval, a.duration, a.data_size_out as usize))
    }

    /// One run, and the frame as the program left it.
    pub fn once(&mut self, f: &Frame) -> Result<Out> {
        let mut out = vec![0u8; 512];
        let (retval, _, n) = self.run(&f.bytes, &mut out)?;
        out.truncate(n.min(512));
        Ok(Out { retval, data: out })
    }

    /// Fails unless `f` is still redirected (translated by its flow's
    /// entry): an entry the LRU evicted would make the runs time a miss.
    pub fn still_translated(&mut self, f: &Frame) -> Result<()> {
        let out = self.once(f)?;
        if out.retval != self.sent() {
            bail!(
                "the flow's entry is gone (retval {}): the runs timed a miss",
                out.retval
            );
        }
        Ok(())
    }

    /// `runs` runs of `f` (a new flow each run when `fresh`); the mean ns
    /// a run, as the kernel timed them.
    pub fn time(&mut self, f: &Frame, runs: u64, fresh: bool) -> Result<f64> {
        let mut frame = f.clone();
        let mut out = vec![0u8; 512];
        let mut total: u64 = 0;
        // First packets: each round takes client ports no round took yet
        // in this build (the LRU forgets old ones as a node's would).
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let base = NEXT.fetch_add(runs, std::sync::atomic::Ordering::Relaxed);
        for i in 0..runs {
            if fresh {
                frame.vary(base + i);
            }
            let (_, d, _) = self.run(&frame.bytes, &mut out)?;
            total += u64::from(d);
        }
        Ok(total as f64 / runs as f64)
    }
}

impl Drop for Build {
    fn drop(&mut self) {
        // Unpinning frees the maps once the object goes too.
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
