//! Loading, attaching, pinning and adopting the programs and maps.
//!
//! Everything lives under one bpffs directory (`--bpf-pin-path`): the maps by
//! name, and one BPF link per program under `links/`. A link pinned there
//! keeps its program attached after the proxy exits, so a restarted proxy
//! finds both, adopts them and goes on updating the same maps: at no point
//! is a Service without its translation. `--cleanup` removes the pins, which
//! detaches the programs and frees the maps.

use std::cell::Cell;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};

use aya::maps::{HashMap, IterableMap, Map, MapData};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::{CgroupAttachMode, CgroupSockAddr};
use aya::EbpfLoader;

use crate::batch::{self, BatchError, Commands};
use crate::maps::{
    BackendKey, BackendVal, MaglevKey, MaglevVal, MemberKey, SvcKey, SvcVal, ALL_MAPS, BACKENDS,
    MAGLEV, MEMBERS, RETIRED_MAPS, SERVICES,
};
use crate::proxier::{value, Refused};
use crate::SocketLbError;

/// The BPF object compiled from bpf/sock.c by build.rs (empty when the
/// build had no clang).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/sock.o"));

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

pub(crate) const BPF_FS_MAGIC: i64 = 0xcafe4a11;
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
/// unused capacity costs no kernel memory; the LRU maps (reply translation,
/// UDP flows) are preallocated by the kernel and sized smaller.
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

/// bpf/sock.c built with KP_TEST_VARIANT (connect and sendmsg translate
/// nothing): a "previous version" for the upgrade test. Not for production.
#[doc(hidden)]
pub static TEST_VARIANT_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/sock-variant.o"));

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
    for m in RETIRED_MAPS {
        remove_file(&p.pin_dir.join(m))?;
    }
    let cgroup = File::open(&p.cgroup).map_err(io(format!("opening {}", p.cgroup.display())))?;
    let mut upgraded = 0;
    for name in PROGRAMS {
        let prog: &mut CgroupSockAddr = program_as(&mut obj, name)?;
        prog.load()
            .map_err(|e| bpf(format!("verifying program {name}"))(boxed(e)))?;
        if adopt {
            if replace_if_different(&obj, name, &links.join(name), "on the cgroup")? {
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

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub(crate) fn statfs_magic(path: &Path) -> Result<i64, std::io::Error> {
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

pub(crate) fn links_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join("links")
}

pub(crate) fn io(what: String) -> impl FnOnce(std::io::Error) -> SocketLbError {
    move |source| SocketLbError::Io { what, source }
}

pub(crate) fn bpf(
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

pub(crate) fn boxed<E: std::error::Error + Send + Sync + 'static>(e: E) -> BoxError {
    Box::new(e)
}

fn not_in_object(name: &str) -> SocketLbError {
    SocketLbError::Bpf {
        what: format!("program {name}"),
        message: "missing from the BPF object".into(),
    }
}

/// `obj`'s program `name`, as the kind of program it is.
pub(crate) fn program_as<'a, T>(
    obj: &'a mut aya::Ebpf,
    name: &str,
) -> Result<&'a mut T, SocketLbError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    obj.program_mut(name)
        .ok_or_else(|| not_in_object(name))?
        .try_into()
        .map_err(|e| bpf(format!("program {name}"))(boxed(e)))
}

/// Points the link pinned at `pin` (`what`, for errors) at `obj`'s program
/// `name` when the program it runs now is a different one (the kernel's
/// tag is a hash of the instructions, the same for the same program loaded
/// twice). True when it was updated.
pub(crate) fn replace_if_different(
    obj: &aya::Ebpf,
    name: &str,
    pin: &Path,
    what: &str,
) -> Result<bool, SocketLbError> {
    let prog = obj.program(name).ok_or_else(|| not_in_object(name))?;
    let info = prog
        .info()
        .map_err(|e| bpf(format!("program {name}"))(boxed(e)))?;
    let fd = prog
        .fd()
        .map_err(|e| bpf(format!("program {name}"))(boxed(e)))?;
    relink(&info, fd, pin).map_err(|e| bpf(format!("updating {name}'s link {what}"))(e))
}

fn relink(
    info: &aya::programs::ProgramInfo,
    fd: &aya::programs::ProgramFd,
    pin: &Path,
) -> Result<bool, BoxError> {
    let link: FdLink = PinnedLink::from_pin(pin).map_err(boxed)?.into();
    let current_id = link.info().map_err(boxed)?.program_id();
    // Ours already (the tc links are asked at every sync): no need to read
    // the kernel's list of programs, which takes CAP_SYS_ADMIN the
    // DaemonSet has not (without it every link looked different, and was
    // updated at every sync).
    if current_id == info.id() {
        return Ok(false);
    }
    let current = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .find(|i| i.id() == current_id)
        .map(|i| i.tag());
    if current == Some(info.tag()) {
        return Ok(false);
    }
    let link_fd = obj_get(pin)?;
    link_update(&link_fd, fd)?;
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
pub(crate) fn obj_get(path: &Path) -> Result<std::os::fd::OwnedFd, BoxError> {
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
pub(crate) fn link_update(
    link: &std::os::fd::OwnedFd,
    prog: &impl std::os::fd::AsFd,
) -> Result<(), BoxError> {
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

/// Removes the socket programs' pins under `pin_dir` (the tc programs' go
/// first: [`crate::remove`]). Missing pins are fine.
pub(crate) fn remove_socket(pin_dir: &Path) -> Result<bool, SocketLbError> {
    let mut removed = false;
    let links = links_dir(pin_dir);
    for n in PROGRAMS {
        removed |= remove_file(&links.join(n))?;
    }
    for m in ALL_MAPS.iter().chain(&RETIRED_MAPS) {
        removed |= remove_file(&pin_dir.join(m))?;
    }
    for d in [links.as_path(), pin_dir] {
        removed |= remove_empty_dir(d)?;
    }
    Ok(removed)
}

/// Removes directory `d` when it is there and empty; true when it went.
pub(crate) fn remove_empty_dir(d: &Path) -> Result<bool, SocketLbError> {
    if is_missing(d) {
        return Ok(false);
    }
    match std::fs::remove_dir(d) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        // Something else of someone else's in there: left alone.
        Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => Ok(false),
        Err(e) => Err(io(format!("removing {}", d.display()))(e)),
    }
}

/// Nothing at `p`. Asked before unlinking: on a read-only filesystem (a
/// container's /sys without a bpffs) unlink and rmdir answer EROFS even for
/// a name that is not there, and "nothing to remove" must not be an error.
pub(crate) fn is_missing(p: &Path) -> bool {
    matches!(std::fs::symlink_metadata(p), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
}

pub(crate) fn remove_file(p: &Path) -> Result<bool, SocketLbError> {
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
///
/// Many entries at once go through the kernel's batch commands (batch.rs):
/// one bpf(2) call per 65,536 entries instead of one per entry (large writes
/// spread over a few threads).
/// Where the kernel has none (before 5.6), the first batch says so and every
/// write from then on is one entry per call, as before.
pub struct KernelMaps {
    pub services: HashMap<MapData, SvcKey, SvcVal>,
    pub backends: HashMap<MapData, BackendKey, BackendVal>,
    pub members: HashMap<MapData, MemberKey, u32>,
    /// The tc programs' Maglev tables (pinned only when they are loaded).
    pub maglev: Option<HashMap<MapData, MaglevKey, MaglevVal>>,
    /// Where the pins are: a member removed bumps the tc programs'
    /// members generation there.
    pin_dir: std::path::PathBuf,
    cmds: Commands,
    /// Whether the kernel takes the batch commands: unknown until the first
    /// batch.
    batch: Cell<Option<bool>>,
}

/// Bumps one of `kp_np_gen`'s generations (0: route, 1: members) where the
/// tc programs' maps are pinned: their flows then ask the FIB, or
/// kp_members, again once.
pub(crate) fn bump_generation(pin_dir: &Path, which: usize) -> Result<(), SocketLbError> {
    let path = pin_dir.join(crate::maps::NP_GEN);
    if is_missing(&path) {
        return Ok(());
    }
    let what = || format!("map {}", path.display());
    let data = MapData::from_pin(&path).map_err(|e| bpf(what())(boxed(e)))?;
    let mut gen: aya::maps::Array<MapData, [u32; 2]> =
        aya::maps::Array::try_from(Map::Array(data)).map_err(|e| bpf(what())(boxed(e)))?;
    let mut v = gen.get(&0, 0).map_err(|e| bpf(what())(boxed(e)))?;
    v[which] = v[which].wrapping_add(1);
    gen.set(0, v, 0).map_err(|e| bpf(what())(boxed(e)))
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
            maglev: if pin_dir.join(MAGLEV).exists() {
                Some(open_map(pin_dir, MAGLEV)?)
            } else {
                None
            },
            pin_dir: pin_dir.to_path_buf(),
            cmds: Commands::KERNEL,
            batch: Cell::new(None),
        })
    }

    /// A member left: the tc programs' UDP flows check theirs again.
    fn members_changed(&self) -> Result<(), String> {
        bump_generation(&self.pin_dir, 1).map_err(|e| e.to_string())
    }

    /// Whether the kernel took the batch commands (None: none tried yet).
    pub fn batch_ops(&self) -> Option<bool> {
        self.batch.get()
    }

    /// From now on, one entry per call (what the fallback does), without
    /// asking the kernel. For comparing the two ways in tests and benches.
    #[doc(hidden)]
    pub fn one_entry_per_call(self) -> Self {
        self.batch.set(Some(false));
        self
    }

    /// Sends command numbers no kernel knows where the batch commands go: the
    /// kernel answers as one without batch commands does (`EINVAL`, nothing
    /// done), and the fallback must take over. For testing.
    #[doc(hidden)]
    pub fn as_if_the_kernel_had_no_batch_ops(mut self) -> Self {
        self.cmds = Commands::UNKNOWN;
        self.batch.set(None);
        self
    }
}

fn map_err(e: aya::maps::MapError) -> String {
    let mut s = e.to_string();
    let errno = match &e {
        aya::maps::MapError::SyscallError(se) => se.io_error.raw_os_error(),
        _ => None,
    };
    if let Some(src) = std::error::Error::source(&e) {
        s.push_str(&format!(": {src}"));
    }
    s.push_str(hint(errno));
    s
}

/// What an errno means for these maps, where it is not plain.
fn hint(errno: Option<i32>) -> &'static str {
    match errno {
        Some(libc::E2BIG) => " (the map is full: its capacity is fixed when it is created)",
        Some(libc::ENOMEM) => " (the kernel could not allocate the entry)",
        _ => "",
    }
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

/// Writes `items` with `batch` where the kernel takes batches, else one by
/// one with `one`. A single entry goes alone (a batch of one costs as
/// much). The kernel's first "no such command" switches `support` to one
/// by one for good, and the same items are written that way.
pub(crate) fn batched<M, T>(
    support: &Cell<Option<bool>>,
    map: &str,
    m: &mut M,
    items: &[T],
    batch: impl FnOnce(&M, &[T]) -> Result<(), BatchError>,
    mut one: impl FnMut(&mut M, usize, &T) -> Result<(), String>,
) -> Result<(), Refused> {
    if items.len() > 1 && support.get() != Some(false) {
        match batch(m, items) {
            Ok(()) => {
                support.set(Some(true));
                return Ok(());
            }
            Err(BatchError::Unsupported(e)) => {
                tracing::info!(map, error = %e, "the kernel has no batch map commands; writing one entry per call");
                support.set(Some(false));
            }
            Err(BatchError::Refused {
                index,
                whole,
                error,
            }) => {
                let why = hint(error.raw_os_error());
                let message = if whole {
                    format!(
                        "{map}: the kernel refused a batch of {} entries starting with this one: {error}{why}",
                        items.len().saturating_sub(index)
                    )
                } else {
                    format!("{map}: {error}{why}")
                };
                return Err(Refused { index, message });
            }
        }
    }
    crate::proxier::each(items, |i, it| one(m, i, it)).map_err(|r| Refused {
        index: r.index,
        message: format!("{map}: {}", r.message),
    })
}

fn fd<K: aya::Pod, V: aya::Pod>(m: &HashMap<MapData, K, V>) -> BorrowedFd<'_> {
    IterableMap::map(m).fd().as_fd()
}

/// Every entry of `m`: `batched` (what the kernel answered to the batch
/// read, None if not tried), else one lookup per entry (aya's iterator).
fn read_all<K: aya::Pod + Default, V: aya::Pod + Default>(
    support: &Cell<Option<bool>>,
    batched: Option<Result<Vec<(K, V)>, BatchError>>,
    name: &str,
    m: &HashMap<MapData, K, V>,
) -> Result<Vec<(K, V)>, String> {
    match batched {
        Some(Ok(v)) => {
            support.set(Some(true));
            return Ok(v);
        }
        Some(Err(BatchError::Unsupported(e))) => {
            tracing::info!(map = name, error = %e, "the kernel has no batch map commands; reading one entry per call");
            support.set(Some(false));
        }
        Some(Err(BatchError::Refused { error, .. })) => {
            return Err(format!("{name}: reading the entries: {error}"))
        }
        None => {}
    }
    m.iter()
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{name}: {}", map_err(e)))
}

fn panicked<T>(_: Box<dyn std::any::Any + Send>) -> Result<T, BatchError> {
    Err(BatchError::Refused {
        index: 0,
        whole: true,
        error: std::io::Error::other("the thread reading the map panicked"),
    })
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
        gone_ok(self.members.remove(k))?;
        self.members_changed()
    }
    fn dump(&self) -> Result<crate::proxier::Dump, String> {
        let c = self.cmds.lookup;
        // The three maps read side by side, in batches (most of the time is
        // the kernel's, walking the buckets and copying).
        let (s, b, m) = if self.batch.get() == Some(false) {
            (None, None, None)
        } else {
            let (fs, fb, fm) = (fd(&self.services), fd(&self.backends), fd(&self.members));
            std::thread::scope(|sc| {
                let s = sc.spawn(move || batch::lookup_all::<SvcKey, SvcVal>(c, fs));
                let m = sc.spawn(move || batch::lookup_all::<MemberKey, u32>(c, fm));
                let b = batch::lookup_all::<BackendKey, BackendVal>(c, fb);
                (
                    Some(s.join().unwrap_or_else(panicked)),
                    Some(b),
                    Some(m.join().unwrap_or_else(panicked)),
                )
            })
        };
        let services = read_all(&self.batch, s, SERVICES, &self.services)?;
        let backends = read_all(&self.batch, b, BACKENDS, &self.backends)?;
        let members = read_all(&self.batch, m, MEMBERS, &self.members)?
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        let maglev = match &self.maglev {
            Some(m) => {
                let r = (self.batch.get() != Some(false))
                    .then(|| batch::lookup_all::<MaglevKey, MaglevVal>(c, fd(m)));
                read_all(&self.batch, r, MAGLEV, m)?
                    .into_iter()
                    .map(|(k, _)| k)
                    .collect()
            }
            None => Vec::new(),
        };
        Ok(crate::proxier::Dump {
            services,
            backends,
            members,
            maglev,
        })
    }

    fn set_services(&mut self, keys: &[SvcKey], vals: &[SvcVal]) -> Result<(), Refused> {
        let cmd = self.cmds.update;
        batched(
            &self.batch,
            SERVICES,
            &mut self.services,
            keys,
            |map, keys| update(cmd, fd(map), keys, vals),
            |map, i, k| map.insert(k, value(vals, i)?, 0).map_err(map_err),
        )
    }
    fn del_services(&mut self, keys: &[SvcKey]) -> Result<(), Refused> {
        let cmd = self.cmds.delete;
        batched(
            &self.batch,
            SERVICES,
            &mut self.services,
            keys,
            |map, keys| delete(cmd, fd(map), keys),
            |map, _, k| gone_ok(map.remove(k)),
        )
    }
    fn set_backends(&mut self, keys: &[BackendKey], vals: &[BackendVal]) -> Result<(), Refused> {
        let cmd = self.cmds.update;
        batched(
            &self.batch,
            BACKENDS,
            &mut self.backends,
            keys,
            |map, keys| update(cmd, fd(map), keys, vals),
            |map, i, k| map.insert(k, value(vals, i)?, 0).map_err(map_err),
        )
    }
    fn del_backends(&mut self, keys: &[BackendKey]) -> Result<(), Refused> {
        let cmd = self.cmds.delete;
        batched(
            &self.batch,
            BACKENDS,
            &mut self.backends,
            keys,
            |map, keys| delete(cmd, fd(map), keys),
            |map, _, k| gone_ok(map.remove(k)),
        )
    }
    fn set_members(&mut self, keys: &[MemberKey], slots: &[u32]) -> Result<(), Refused> {
        let cmd = self.cmds.update;
        batched(
            &self.batch,
            MEMBERS,
            &mut self.members,
            keys,
            |map, keys| update(cmd, fd(map), keys, slots),
            |map, i, k| map.insert(k, value(slots, i)?, 0).map_err(map_err),
        )
    }
    fn del_members(&mut self, keys: &[MemberKey]) -> Result<(), Refused> {
        let cmd = self.cmds.delete;
        batched(
            &self.batch,
            MEMBERS,
            &mut self.members,
            keys,
            |map, keys| delete(cmd, fd(map), keys),
            |map, _, k| gone_ok(map.remove(k)),
        )?;
        if keys.is_empty() {
            return Ok(());
        }
        self.members_changed().map_err(|message| Refused {
            index: keys.len(),
            message,
        })
    }
    fn set_maglev(&mut self, keys: &[MaglevKey], vals: &[MaglevVal]) -> Result<(), Refused> {
        let cmd = self.cmds.update;
        let Some(map) = &mut self.maglev else {
            return Err(Refused {
                index: 0,
                message: format!("{MAGLEV} is not pinned (the tc programs are not loaded)"),
            });
        };
        batched(
            &self.batch,
            MAGLEV,
            map,
            keys,
            |map, keys| update(cmd, fd(map), keys, vals),
            |map, i, k| map.insert(k, value(vals, i)?, 0).map_err(map_err),
        )
    }
    fn del_maglev(&mut self, keys: &[MaglevKey]) -> Result<(), Refused> {
        let cmd = self.cmds.delete;
        let Some(map) = &mut self.maglev else {
            // Nothing can be there.
            return Ok(());
        };
        batched(
            &self.batch,
            MAGLEV,
            map,
            keys,
            |map, keys| delete(cmd, fd(map), keys),
            |map, _, k| gone_ok(map.remove(k)),
        )
    }
}

/// `keys[i] -> vals[i]`, in batches spread over a few threads when large.
fn update<K: aya::Pod + Sync, V: aya::Pod + Sync>(
    cmd: u32,
    fd: BorrowedFd<'_>,
    keys: &[K],
    vals: &[V],
) -> Result<(), BatchError> {
    if keys.len() != vals.len() {
        return Err(BatchError::Refused {
            index: 0,
            whole: true,
            error: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{} keys for {} values", keys.len(), vals.len()),
            ),
        });
    }
    batch::split(
        keys.len(),
        |r| batch::update(cmd, fd, &keys[r.clone()], &vals[r]),
        drop,
    )
}

/// Deletes `keys` (missing ones are fine), in batches spread over a few
/// threads when large.
fn delete<K: aya::Pod + Sync>(cmd: u32, fd: BorrowedFd<'_>, keys: &[K]) -> Result<(), BatchError> {
    batch::split(keys.len(), |r| batch::delete(cmd, fd, &keys[r]), drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    fn refused_at(index: usize, errno: i32) -> BatchError {
        BatchError::Refused {
            index,
            whole: false,
            error: io::Error::from_raw_os_error(errno),
        }
    }

    #[test]
    fn no_batch_commands_means_one_entry_per_call_from_then_on() {
        let support = Cell::new(None);
        let mut written = Vec::new();
        let r = batched(
            &support,
            "kp_test",
            &mut (),
            &[1, 2, 3],
            |_, _| {
                Err(BatchError::Unsupported(io::Error::from_raw_os_error(
                    libc::EINVAL,
                )))
            },
            |_, _, x| {
                written.push(*x);
                Ok(())
            },
        );
        assert_eq!(r, Ok(()));
        assert_eq!(written, vec![1, 2, 3], "the same items, one by one");
        assert_eq!(support.get(), Some(false));
        // Known now: the batch is not tried again.
        let r = batched(
            &support,
            "kp_test",
            &mut (),
            &[4, 5],
            |_, _| panic!("batch tried on a kernel without it"),
            |_, _, x| {
                written.push(*x);
                Ok(())
            },
        );
        assert_eq!(r, Ok(()));
        assert_eq!(written, vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_refused_entry_stops_the_write_and_is_named() {
        let support = Cell::new(None);
        let r = batched(
            &support,
            "kp_backends",
            &mut (),
            &[1, 2, 3, 4],
            |_, _| Err(refused_at(2, libc::E2BIG)),
            |_, _, _| panic!("a refused batch must not be retried one by one"),
        );
        let e = r.expect_err("refused");
        assert_eq!(e.index, 2);
        assert!(e.message.starts_with("kp_backends: "), "{}", e.message);
        assert!(e.message.contains("map is full"), "{}", e.message);
        // One by one: the same error shape from the entry that failed.
        let support = Cell::new(Some(false));
        let mut seen = 0;
        let r = batched(
            &support,
            "kp_members",
            &mut (),
            &[1, 2, 3],
            |_, _| panic!("no batch"),
            |_, _, x| {
                seen += 1;
                if *x == 2 {
                    Err("nope".into())
                } else {
                    Ok(())
                }
            },
        );
        assert_eq!(
            r,
            Err(Refused {
                index: 1,
                message: "kp_members: nope".into()
            })
        );
        assert_eq!(seen, 2, "stopped at the refused entry");
    }

    #[test]
    fn one_entry_goes_alone_and_batches_are_used_when_taken() {
        let support = Cell::new(None);
        let mut alone = 0;
        batched(
            &support,
            "m",
            &mut (),
            &[7],
            |_, _| panic!("batch of one"),
            |_, _, _| {
                alone += 1;
                Ok(())
            },
        )
        .unwrap();
        assert_eq!((alone, support.get()), (1, None));
        let mut sent = 0;
        batched(
            &support,
            "m",
            &mut (),
            &[1, 2],
            |_, items| {
                sent += items.len();
                Ok(())
            },
            |_, _, _| panic!("one by one although the batch was taken"),
        )
        .unwrap();
        assert_eq!((sent, support.get()), (2, Some(true)));
    }
}
