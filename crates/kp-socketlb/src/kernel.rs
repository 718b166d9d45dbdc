//! Loading, attaching, pinning and adopting the programs and maps.
//!
//! Everything lives under one bpffs directory (`--bpf-pin-path`): the maps by
//! name, and one BPF link per program under `links/`. A link pinned there
//! keeps its program attached after the proxy exits, so a restarted proxy
//! finds both, adopts them and goes on updating the same maps: at no point
//! is a Service without its translation. `--cleanup` removes the pins, which
//! detaches the programs and frees the maps.

use std::fs::File;
use std::path::{Path, PathBuf};

use aya::maps::{HashMap, Map, MapData};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::{CgroupAttachMode, CgroupSockAddr};
use aya::EbpfLoader;

use crate::maps::{
    BackendKey, BackendVal, MemberKey, SvcKey, SvcVal, ALL_MAPS, BACKENDS, MEMBERS, SERVICES,
};
use crate::SocketLbError;

/// The BPF object compiled from bpf/socketlb.c by build.rs (empty when the
/// build had no clang).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/socketlb.o"));

/// The programs, by the names they have in the object.
pub const PROGRAMS: [&str; 8] = [
    "kp_connect4",
    "kp_sendmsg4",
    "kp_recvmsg4",
    "kp_getpeername4",
    "kp_connect6",
    "kp_sendmsg6",
    "kp_recvmsg6",
    "kp_getpeername6",
];

const BPF_FS_MAGIC: i64 = 0xcafe4a11;
const CGROUP2_SUPER_MAGIC: i64 = 0x63677270;

/// Where the programs attach and where their pins live.
#[derive(Clone, Debug)]
pub struct Placement {
    /// A cgroup v2 directory: the programs see the sockets of every process
    /// in it and below.
    pub cgroup: PathBuf,
    /// A directory on a bpf filesystem (created if missing).
    pub pin_dir: PathBuf,
}

/// Map capacities. Hash maps are created without preallocation, so an
/// unused capacity costs no kernel memory; the LRU maps (affinity, reply
/// translation) are preallocated by the kernel and sized smaller.
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    pub services: u32,
    pub backends: u32,
}

impl Default for Capacity {
    fn default() -> Self {
        // 50k Services x 3 addresses and 1M endpoints with room to grow.
        Capacity {
            services: 262_144,
            backends: 2_097_152,
        }
    }
}

/// What [`install`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Installed {
    /// Programs attached and maps created now.
    Fresh,
    /// A previous run's pinned links and maps, taken over as they are;
    /// `upgraded` programs differed from this binary's and were swapped in
    /// place (one atomic link update each: no moment without a program).
    Adopted { upgraded: usize },
}

/// Attaches the programs to `p.cgroup` and pins them and their maps, or
/// adopts what a previous run left pinned there.
pub fn install(p: &Placement, cap: Capacity) -> Result<Installed, SocketLbError> {
    install_object(p, cap, OBJECT)
}

/// bpf/socketlb.c built with KP_TEST_VARIANT (connect and sendmsg translate
/// nothing): a "previous version" for the upgrade test. Not for production.
#[doc(hidden)]
pub static TEST_VARIANT_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/socketlb-variant.o"));

#[doc(hidden)]
pub fn install_object(
    p: &Placement,
    cap: Capacity,
    object: &[u8],
) -> Result<Installed, SocketLbError> {
    if object.is_empty() {
        return Err(SocketLbError::Unsupported(
            "this binary was built without clang, so it has no BPF programs (apt-get install clang, then rebuild)".into(),
        ));
    }
    check_host(p)?;
    let links = links_dir(&p.pin_dir);
    std::fs::create_dir_all(&links).map_err(io(format!("creating {}", links.display())))?;
    let adopt = PROGRAMS
        .iter()
        .all(|n| PinnedLink::from_pin(links.join(n)).is_ok())
        && ALL_MAPS.iter().all(|m| p.pin_dir.join(m).exists());
    if !adopt {
        // Half an installation (a crash while installing): its links go, so
        // no program is attached twice; pinned maps are reused by name.
        for n in PROGRAMS {
            let _ = std::fs::remove_file(links.join(n));
        }
    }
    // Loaded either way: pinned maps are reused by name, and an adopted
    // link whose program differs from ours gets ours.
    let mut obj = EbpfLoader::new()
        .default_map_pin_directory(&p.pin_dir)
        .map_max_entries(SERVICES, cap.services)
        .map_max_entries(BACKENDS, cap.backends)
        .map_max_entries(MEMBERS, cap.backends)
        .load(object)
        .map_err(|e| bpf("loading the BPF object")(boxed(e)))?;
    let cgroup = File::open(&p.cgroup).map_err(io(format!("opening {}", p.cgroup.display())))?;
    let mut upgraded = 0;
    for name in PROGRAMS {
        let prog: &mut CgroupSockAddr = obj
            .program_mut(name)
            .ok_or_else(|| SocketLbError::Bpf {
                what: format!("program {name}"),
                message: "missing from the BPF object".into(),
            })?
            .try_into()
            .map_err(|e| bpf(format!("program {name}"))(boxed(e)))?;
        prog.load()
            .map_err(|e| bpf(format!("verifying program {name}"))(boxed(e)))?;
        if adopt {
            if replace_if_different(prog, &links.join(name))
                .map_err(|e| bpf(format!("updating {name}'s link"))(e))?
            {
                upgraded += 1;
            }
            continue;
        }
        // Through a BPF link (kernels >= 5.7), which the kernel always
        // attaches as one of many: other programs on the cgroup (systemd's, a
        // CNI's) keep running. The link API takes no flags, hence "Single".
        let id = prog
            .attach(&cgroup, CgroupAttachMode::Single)
            .map_err(|e| bpf(format!("attaching {name} to {}", p.cgroup.display()))(boxed(e)))?;
        let link: FdLink = prog
            .take_link(id)
            .map_err(|e| bpf(format!("link of {name}"))(boxed(e)))?
            .try_into()
            .map_err(|e| bpf(format!("link of {name}"))(boxed(e)))?;
        link.pin(links.join(name))
            .map_err(|e| bpf(format!("pinning {name}'s link"))(boxed(e)))?;
    }
    Ok(if adopt {
        Installed::Adopted { upgraded }
    } else {
        Installed::Fresh
    })
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn statfs_magic(path: &Path) -> Result<i64, std::io::Error> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid C string, st a valid out pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_type as i64)
}

/// Refuses, with the reason, where the kernel or the host cannot run the mode.
fn check_host(p: &Placement) -> Result<(), SocketLbError> {
    match statfs_magic(&p.cgroup) {
        Ok(CGROUP2_SUPER_MAGIC) => {}
        Ok(_) => {
            return Err(SocketLbError::Unsupported(format!(
            "--cgroup-path {} is not a cgroup v2 directory (socket load balancing needs cgroup v2)",
            p.cgroup.display()
        )))
        }
        Err(e) => {
            return Err(SocketLbError::Unsupported(format!(
                "--cgroup-path {}: {e}",
                p.cgroup.display()
            )))
        }
    }
    let fs_dir = p
        .pin_dir
        .ancestors()
        .find(|a| a.exists())
        .unwrap_or(Path::new("/"));
    if statfs_magic(fs_dir).ok() != Some(BPF_FS_MAGIC) {
        return Err(SocketLbError::Unsupported(format!(
            "--bpf-pin-path {} is not on a bpf filesystem (mount -t bpf bpf {})",
            p.pin_dir.display(),
            fs_dir.display()
        )));
    }
    Ok(())
}

fn links_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("links")
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> SocketLbError {
    move |source| SocketLbError::Io { what, source }
}

fn bpf(
    what: impl Into<String>,
) -> impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> SocketLbError {
    let what = what.into();
    move |e| {
        // aya's errors keep the errno in their source chain.
        let mut message = e.to_string();
        let mut src = e.source();
        while let Some(s) = src {
            message.push_str(": ");
            message.push_str(&s.to_string());
            src = s.source();
        }
        SocketLbError::Bpf { what, message }
    }
}

fn boxed<E: std::error::Error + Send + Sync + 'static>(e: E) -> BoxError {
    Box::new(e)
}

/// Points the link pinned at `pin` at `prog` when the program it runs now
/// is a different one (the kernel's tag is a hash of the instructions, the
/// same for the same program loaded twice). True when it was updated.
fn replace_if_different(prog: &CgroupSockAddr, pin: &Path) -> Result<bool, BoxError> {
    let ours = prog.info().map_err(boxed)?.tag();
    let link: FdLink = PinnedLink::from_pin(pin).map_err(boxed)?.into();
    let current_id = link.info().map_err(boxed)?.program_id();
    let current = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .find(|info| info.id() == current_id)
        .map(|info| info.tag());
    if current == Some(ours) {
        return Ok(false);
    }
    let link_fd = obj_get(pin)?;
    let prog_fd = prog.fd().map_err(boxed)?;
    link_update(&link_fd, prog_fd)?;
    Ok(true)
}

/// bpf(2) with `attr` as the command's attribute (aya keeps a link's own
/// descriptor and its link update private, so these two are made here).
fn bpf_call<T>(cmd: libc::c_long, attr: &T) -> Result<libc::c_long, BoxError> {
    // SAFETY: `attr` is a #[repr(C)] prefix of the kernel's union bpf_attr
    // for `cmd`, valid for the size given; the kernel zero-extends it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *const T,
            std::mem::size_of::<T>(),
        )
    };
    if rc < 0 {
        return Err(Box::new(std::io::Error::last_os_error()));
    }
    Ok(rc)
}

/// BPF_OBJ_GET: a file descriptor for a pinned object.
fn obj_get(path: &Path) -> Result<std::os::fd::OwnedFd, BoxError> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    #[repr(C)]
    struct ObjAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let attr = ObjAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    let fd = bpf_call(7, &attr)?; // BPF_OBJ_GET; `c` outlives the call
    let fd = i32::try_from(fd)?;
    // SAFETY: the kernel just returned this descriptor to us.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// BPF_LINK_UPDATE: the link runs `prog` from now on, atomically.
fn link_update(link: &std::os::fd::OwnedFd, prog: &impl std::os::fd::AsFd) -> Result<(), BoxError> {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct LinkUpdateAttr {
        link_fd: u32,
        new_prog_fd: u32,
        flags: u32,
        old_prog_fd: u32,
    }
    let attr = LinkUpdateAttr {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: prog.as_fd().as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    bpf_call(29, &attr)?; // BPF_LINK_UPDATE
    Ok(())
}

/// Removes every pin under `pin_dir` this mode made: unpinning a link
/// detaches its program, unpinning a map frees it. Missing pins are fine.
pub fn remove(pin_dir: &Path) -> Result<bool, SocketLbError> {
    let mut removed = false;
    let links = links_dir(pin_dir);
    for n in PROGRAMS {
        removed |= remove_file(&links.join(n))?;
    }
    for m in ALL_MAPS {
        removed |= remove_file(&pin_dir.join(m))?;
    }
    for d in [links.as_path(), pin_dir] {
        if is_missing(d) {
            continue;
        }
        match std::fs::remove_dir(d) {
            Ok(()) => removed = true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            // Something else of someone else's in there: left alone.
            Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => {}
            Err(e) => return Err(io(format!("removing {}", d.display()))(e)),
        }
    }
    Ok(removed)
}

/// Nothing at `p`. Asked before unlinking: on a read-only filesystem (a
/// container's /sys without a bpffs) unlink and rmdir answer EROFS even for
/// a name that is not there, and "nothing to remove" must not be an error.
fn is_missing(p: &Path) -> bool {
    matches!(std::fs::symlink_metadata(p), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
}

fn remove_file(p: &Path) -> Result<bool, SocketLbError> {
    if is_missing(p) {
        return Ok(false);
    }
    match std::fs::remove_file(p) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io(format!("removing {}", p.display()))(e)),
    }
}

/// The three maps the proxy writes, opened from their pins.
pub struct KernelMaps {
    pub services: HashMap<MapData, SvcKey, SvcVal>,
    pub backends: HashMap<MapData, BackendKey, BackendVal>,
    pub members: HashMap<MapData, MemberKey, u32>,
}

fn open_map<K: aya::Pod, V: aya::Pod>(
    pin_dir: &Path,
    name: &str,
) -> Result<HashMap<MapData, K, V>, SocketLbError> {
    let path = pin_dir.join(name);
    let data = MapData::from_pin(&path)
        .map_err(|e| bpf(format!("opening map {}", path.display()))(boxed(e)))?;
    HashMap::try_from(Map::HashMap(data))
        .map_err(|e| bpf(format!("map {}", path.display()))(boxed(e)))
}

impl KernelMaps {
    pub fn open(pin_dir: &Path) -> Result<Self, SocketLbError> {
        Ok(KernelMaps {
            services: open_map(pin_dir, SERVICES)?,
            backends: open_map(pin_dir, BACKENDS)?,
            members: open_map(pin_dir, MEMBERS)?,
        })
    }
}

fn map_err(e: aya::maps::MapError) -> String {
    let mut s = e.to_string();
    if let Some(src) = std::error::Error::source(&e) {
        s.push_str(&format!(": {src}"));
    }
    s
}

/// A delete whose key is already gone is done.
fn gone_ok(r: Result<(), aya::maps::MapError>) -> Result<(), String> {
    match r {
        Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        r => r.map_err(map_err),
    }
}

impl crate::proxier::Maps for KernelMaps {
    fn set_service(&mut self, k: &SvcKey, v: &SvcVal) -> Result<(), String> {
        self.services.insert(k, v, 0).map_err(map_err)
    }
    fn del_service(&mut self, k: &SvcKey) -> Result<(), String> {
        gone_ok(self.services.remove(k))
    }
    fn set_backend(&mut self, k: &BackendKey, v: &BackendVal) -> Result<(), String> {
        self.backends.insert(k, v, 0).map_err(map_err)
    }
    fn del_backend(&mut self, k: &BackendKey) -> Result<(), String> {
        gone_ok(self.backends.remove(k))
    }
    fn set_member(&mut self, k: &MemberKey, slot: u32) -> Result<(), String> {
        self.members.insert(k, slot, 0).map_err(map_err)
    }
    fn del_member(&mut self, k: &MemberKey) -> Result<(), String> {
        gone_ok(self.members.remove(k))
    }
    fn dump(&self) -> Result<crate::proxier::Dump, String> {
        let services = self
            .services
            .iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(map_err)?;
        let backends = self
            .backends
            .iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(map_err)?;
        let members = self
            .members
            .keys()
            .collect::<Result<Vec<_>, _>>()
            .map_err(map_err)?;
        Ok(crate::proxier::Dump {
            services,
            backends,
            members,
        })
    }
}
