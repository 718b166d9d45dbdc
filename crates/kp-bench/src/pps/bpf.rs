//! The two BPF programs `kp-bench pps --in-place` loads itself, as a few
//! instructions through bpf(2) (no object file, nothing to build):
//!
//! * [`NetRxClock`]: raw tracepoints on softirq_entry and softirq_exit that
//!   sum, per CPU, the nanoseconds between the two for vec == NET_RX_SOFTIRQ
//!   (and count the passes): the node's receive processing time, exactly,
//!   instead of /proc/stat's tick samples. Attached only while it lives; the
//!   links are file descriptors, so the programs go when it drops or the
//!   process dies.
//! * [`NullTc`]: a tc program that returns TC_ACT_OK at once, attached with
//!   tcx links (as aya attaches ours on this kernel) to the ingress of every
//!   interface of a node namespace but lo: what a tc hook costs at all,
//!   apart from what our programs do in it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use anyhow::{bail, Context, Result};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_RAW_TRACEPOINT_OPEN: libc::c_long = 17;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_PROG_TYPE_RAW_TRACEPOINT: u32 = 17;
const BPF_TCX_INGRESS: u32 = 46;
/// include/linux/interrupt.h: NET_RX_SOFTIRQ.
pub const NET_RX_SOFTIRQ: i32 = 3;
const HELPER_MAP_LOOKUP_ELEM: i32 = 1;
const HELPER_KTIME_GET_NS: i32 = 5;

/// The per-CPU value: [start ns of the pass under way, ns summed, passes].
const VALUE: usize = 24;

fn sys_bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a #[repr(C)] bpf_attr prefix of its full size; the
    // pointers inside it point at buffers alive for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            (attr as *mut T).cast::<libc::c_void>(),
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn fd_of(rc: libc::c_long) -> OwnedFd {
    // SAFETY: bpf(2) returned a new descriptor that nothing else owns.
    unsafe { OwnedFd::from_raw_fd(rc as RawFd) }
}

/// One instruction: opcode, dst and src registers, offset, immediate.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    u64::from(code)
        | u64::from((src << 4) | (dst & 0xf)) << 8
        | u64::from(off as u16) << 16
        | u64::from(imm as u32) << 32
}

#[repr(C)]
#[derive(Default)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
}

fn load(prog_type: u32, name: &str, insns: &[u64]) -> Result<OwnedFd> {
    let license = c"GPL";
    let mut log = vec![0u8; 64 * 1024];
    let mut attr = ProgLoad {
        prog_type,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: log.len() as u32,
        log_buf: log.as_mut_ptr() as u64,
        ..Default::default()
    };
    for (d, s) in attr.prog_name.iter_mut().zip(name.bytes().take(15)) {
        *d = s;
    }
    match sys_bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => Ok(fd_of(fd)),
        Err(e) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            bail!(
                "loading the BPF program {name}: {e}; verifier: {}",
                String::from_utf8_lossy(&log[..end]).trim()
            )
        }
    }
}

/// The number of possible CPUs (a per-CPU map's value has one slot each).
fn possible_cpus() -> Result<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .context("reading /sys/devices/system/cpu/possible")?;
    let last = text
        .trim()
        .split(',')
        .filter_map(|r| r.rsplit('-').next()?.parse::<usize>().ok())
        .max()
        .context("parsing /sys/devices/system/cpu/possible")?;
    Ok(last + 1)
}

/// NET_RX time per CPU from the softirq tracepoints, while this lives.
pub struct NetRxClock {
    map: OwnedFd,
    cpus: usize,
    // Dropping the links detaches the programs.
    _links: Vec<OwnedFd>,
    _progs: Vec<OwnedFd>,
}

/// NET_RX nanoseconds and passes per CPU so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NetRx {
    pub ns: Vec<u64>,
    pub passes: Vec<u64>,
}

impl NetRx {
    /// `later - self`, per CPU.
    pub fn until(&self, later: &NetRx) -> NetRx {
        NetRx {
            ns: super::parts::deltas(&self.ns, &later.ns),
            passes: super::parts::deltas(&self.passes, &later.passes),
        }
    }
}

impl NetRxClock {
    pub fn attach() -> Result<NetRxClock> {
        #[repr(C)]
        #[derive(Default)]
        struct MapCreate {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            map_flags: u32,
            inner_map_fd: u32,
            numa_node: u32,
            map_name: [u8; 16],
        }
        let mut attr = MapCreate {
            map_type: BPF_MAP_TYPE_PERCPU_ARRAY,
            key_size: 4,
            value_size: VALUE as u32,
            max_entries: 1,
            ..Default::default()
        };
        for (d, s) in attr.map_name.iter_mut().zip(b"kpb_net_rx") {
            *d = *s;
        }
        let map =
            fd_of(sys_bpf(BPF_MAP_CREATE, &mut attr).context("creating the NET_RX per-CPU map")?);
        let m = map.as_raw_fd();
        // r2 = ctx->args[0] (vec); not NET_RX: out. r6 = now; r0 = the CPU's
        // slot (key 0 on the stack).
        let head = |out: i16| {
            vec![
                insn(0x79, 2, 1, 0, 0),
                insn(0x55, 2, 0, out, NET_RX_SOFTIRQ),
                insn(0x85, 0, 0, 0, HELPER_KTIME_GET_NS),
                insn(0xbf, 6, 0, 0, 0),
                insn(0x62, 10, 0, -4, 0),
                insn(0xbf, 2, 10, 0, 0),
                insn(0x07, 2, 0, 0, -4),
                insn(0x18, 1, 1, 0, m), // ld_imm64 r1 = map (BPF_PSEUDO_MAP_FD)
                insn(0, 0, 0, 0, 0),
                insn(0x85, 0, 0, 0, HELPER_MAP_LOOKUP_ELEM),
            ]
        };
        let tail = [insn(0xb7, 0, 0, 0, 0), insn(0x95, 0, 0, 0, 0)];
        // softirq_entry: slot.start = now.
        let mut entry = head(10);
        entry.extend([insn(0x15, 0, 0, 1, 0), insn(0x7b, 0, 6, 0, 0)]);
        entry.extend(tail);
        // softirq_exit: if slot.start: sum += now - start, passes += 1,
        // start = 0 (a pass begun before the attach is not counted).
        let mut exit = head(20);
        exit.extend([
            insn(0x15, 0, 0, 11, 0),
            insn(0x79, 1, 0, 0, 0),
            insn(0x15, 1, 0, 9, 0),
            insn(0x1f, 6, 1, 0, 0),
            insn(0x79, 2, 0, 8, 0),
            insn(0x0f, 2, 6, 0, 0),
            insn(0x7b, 0, 2, 8, 0),
            insn(0x79, 2, 0, 16, 0),
            insn(0x07, 2, 0, 0, 1),
            insn(0x7b, 0, 2, 16, 0),
            insn(0xb7, 1, 0, 0, 0),
            insn(0x7b, 0, 1, 0, 0),
        ]);
        exit.extend(tail);
        let mut progs = Vec::new();
        let mut links = Vec::new();
        // The exit first: an entry seen without its exit program leaves a
        // start that the first exit closes.
        for (tp, name, insns) in [
            (c"softirq_exit", "kpb_sirq_exit", &exit),
            (c"softirq_entry", "kpb_sirq_entry", &entry),
        ] {
            let prog = load(BPF_PROG_TYPE_RAW_TRACEPOINT, name, insns)?;
            #[repr(C)]
            struct RawTp {
                name: u64,
                prog_fd: u32,
                pad: u32,
            }
            let mut attr = RawTp {
                name: tp.as_ptr() as u64,
                prog_fd: prog.as_raw_fd() as u32,
                pad: 0,
            };
            let link = sys_bpf(BPF_RAW_TRACEPOINT_OPEN, &mut attr)
                .with_context(|| format!("attaching {name} to the {tp:?} tracepoint"))?;
            links.push(fd_of(link));
            progs.push(prog);
        }
        Ok(NetRxClock {
            map,
            cpus: possible_cpus()?,
            _links: links,
            _progs: progs,
        })
    }

    /// The sums so far, per CPU.
    pub fn read(&self) -> Result<NetRx> {
        #[repr(C)]
        struct Lookup {
            map_fd: u32,
            pad: u32,
            key: u64,
            value: u64,
            flags: u64,
        }
        let key = 0u32;
        let mut value = vec![0u8; VALUE * self.cpus];
        let mut attr = Lookup {
            map_fd: self.map.as_raw_fd() as u32,
            pad: 0,
            key: (&key as *const u32) as u64,
            value: value.as_mut_ptr() as u64,
            flags: 0,
        };
        sys_bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).context("reading the NET_RX per-CPU map")?;
        let field = |cpu: usize, k: usize| {
            let at = cpu * VALUE + k * 8;
            let mut b = [0u8; 8];
            b.copy_from_slice(&value[at..at + 8]);
            u64::from_ne_bytes(b)
        };
        Ok(NetRx {
            ns: (0..self.cpus).map(|c| field(c, 1)).collect(),
            passes: (0..self.cpus).map(|c| field(c, 2)).collect(),
        })
    }
}

/// The null tc program on the ingress of a node namespace's interfaces,
/// while this lives.
pub struct NullTc {
    pub interfaces: Vec<String>,
    _links: Vec<OwnedFd>,
    _prog: OwnedFd,
}

impl NullTc {
    /// Attaches on every interface of `ns` but lo (ours attaches to the
    /// node's external interface and to every other one, its pods' veths).
    pub fn attach(ns: &str) -> Result<NullTc> {
        let prog = load(
            BPF_PROG_TYPE_SCHED_CLS,
            "kpb_null_tc",
            // r0 = TC_ACT_OK; exit.
            &[insn(0xb7, 0, 0, 0, 0), insn(0x95, 0, 0, 0, 0)],
        )?;
        let pfd = prog.as_raw_fd() as u32;
        let (interfaces, links) =
            kp_netlab::in_netns(ns, || -> Result<(Vec<String>, Vec<OwnedFd>)> {
                // In this thread's namespace: /sys/class/net would show the
                // mount's, so the names come from if_nameindex.
                let mut names = Vec::new();
                // SAFETY: if_nameindex returns an array ended by a zero index,
                // freed with if_freenameindex below.
                unsafe {
                    let list = libc::if_nameindex();
                    if list.is_null() {
                        bail!("if_nameindex in {ns}: {}", io::Error::last_os_error());
                    }
                    let mut p = list;
                    while (*p).if_index != 0 {
                        let name = std::ffi::CStr::from_ptr((*p).if_name)
                            .to_string_lossy()
                            .into_owned();
                        names.push(((*p).if_index, name));
                        p = p.add(1);
                    }
                    libc::if_freenameindex(list);
                }
                let mut links = Vec::new();
                let mut attached = Vec::new();
                for (index, name) in names.into_iter().filter(|(_, n)| n != "lo") {
                    #[repr(C)]
                    struct LinkCreate {
                        prog_fd: u32,
                        target_ifindex: u32,
                        attach_type: u32,
                        flags: u32,
                        relative_fd: u32,
                        pad: u32,
                        expected_revision: u64,
                    }
                    let mut attr = LinkCreate {
                        prog_fd: pfd,
                        target_ifindex: index,
                        attach_type: BPF_TCX_INGRESS,
                        flags: 0,
                        relative_fd: 0,
                        pad: 0,
                        expected_revision: 0,
                    };
                    let link = sys_bpf(BPF_LINK_CREATE, &mut attr).with_context(|| {
                        format!("attaching the null tc program to {name} in {ns}")
                    })?;
                    links.push(fd_of(link));
                    attached.push(name);
                }
                Ok((attached, links))
            })??;
        if interfaces.is_empty() {
            bail!("no interface but lo in {ns} for the null tc program");
        }
        Ok(NullTc {
            interfaces,
            _links: links,
            _prog: prog,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::insn;

    #[test]
    fn instructions_encode_as_the_kernel_reads_them() {
        // r0 = 0; exit; r2 += -4; *(u32 *)(r10 - 4) = 0
        assert_eq!(insn(0xb7, 0, 0, 0, 0), 0xb7);
        assert_eq!(insn(0x95, 0, 0, 0, 0), 0x95);
        assert_eq!(insn(0x07, 2, 0, 0, -4), 0xffff_fffc_0000_0207);
        assert_eq!(insn(0x62, 10, 0, -4, 0), 0x0000_0000_fffc_0a62);
        // r6 = r0: dst in the low nibble, src in the high one.
        assert_eq!(insn(0xbf, 6, 0, 0, 0), 0x06bf);
        assert_eq!(insn(0xbf, 2, 10, 0, 0), 0xa2bf);
    }
}
