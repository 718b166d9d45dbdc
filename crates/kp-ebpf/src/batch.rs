//! The kernel's batch map commands, made by hand: `BPF_MAP_UPDATE_BATCH`,
//! `BPF_MAP_DELETE_BATCH` and `BPF_MAP_LOOKUP_BATCH` (Linux 5.6, hash and
//! array maps).
//!
//! Why by hand: aya 0.14 has no batch operations, and a full sync at 100k
//! Services x 10 endpoints writes well over a million map entries; one
//! bpf(2) call each made it take seconds, most of them spent entering and
//! leaving the kernel. One
//! call here writes up to [`CHUNK`] entries (the kernel still takes them one
//! at a time: a batch is not atomic, a program may run between two of its
//! entries, which is why the proxier sends each phase of a sync as its own
//! batch, in order).
//!
//! Where the kernel or the map type has no such command, the call answers
//! `EINVAL` (unknown command, kernels before 5.6) or `ENOTSUPP`/`EOPNOTSUPP`
//! (no batch operation for the map type) without touching the entry count:
//! [`BatchError::Unsupported`], and the caller writes the entries one by one.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// The commands, as numbered in `enum bpf_cmd` (linux/bpf.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Commands {
    pub lookup: u32,
    pub update: u32,
    pub delete: u32,
}

impl Commands {
    pub const KERNEL: Commands = Commands {
        lookup: 24, // BPF_MAP_LOOKUP_BATCH
        update: 26, // BPF_MAP_UPDATE_BATCH
        delete: 27, // BPF_MAP_DELETE_BATCH
    };
    /// Command numbers no kernel knows: it answers them as a kernel before
    /// 5.6 answers the batch commands (`EINVAL`, nothing done). For testing
    /// the fallback on a kernel that has them.
    pub const UNKNOWN: Commands = Commands {
        lookup: 0xfff0,
        update: 0xfff1,
        delete: 0xfff2,
    };
}

/// Entries per call: large enough that the call's own cost vanishes, small
/// enough that one call does not hold the CPU for long (the kernel
/// reschedules between entries anyway).
pub(crate) const CHUNK: usize = 1 << 16;

/// The kernel's `ENOTSUPP` (not in libc: kernel-internal, but bpf(2) returns
/// it for a map type without the operation).
const ENOTSUPP: i32 = 524;

/// `union bpf_attr`'s member `batch`, field for field (all `__aligned_u64`
/// but `count` and `map_fd`): 56 bytes.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

#[derive(Debug)]
pub(crate) enum BatchError {
    /// The kernel has no such command for this map: nothing was done.
    Unsupported(io::Error),
    /// The entries before `index` are done; the one at `index` was refused
    /// (`whole`: the call was refused before any entry was looked at, and
    /// the entries from `index` on are not done).
    Refused {
        index: usize,
        whole: bool,
        error: io::Error,
    },
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) | Some(ENOTSUPP)
    )
}

/// bpf(2) with a batch attribute. The kernel writes `count` (entries done)
/// and, for lookups, `out_batch` back into `attr`.
///
/// # Safety
///
/// `attr.keys` (and `attr.values` where the command reads or writes values)
/// must point to `attr.count` entries of the map's key (value) size,
/// writable for lookups; `in_batch`, when not 0, and `out_batch` to buffers
/// of at least the map's key size and 4 bytes.
unsafe fn call(cmd: u32, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid, writable #[repr(C)] copy of the kernel's
    // `batch` attribute for the size given (the kernel zero-extends it);
    // the buffers it points to are valid as the caller guarantees.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            libc::c_long::from(cmd),
            attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Entries a thread takes at least before a write is split over threads.
const PER_THREAD: usize = 1 << 15;

/// How many threads to use for work that `parts` threads could share: at
/// most 4, and no more than the CPUs this process may use. (Asked only for
/// large work: finding out reads the cgroup's CPU limit, tens of µs.)
pub(crate) fn threads(parts: usize) -> usize {
    if parts < 2 {
        return 1;
    }
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(4)
        .min(parts)
}

/// Runs `write` over `0..len`, split over a few threads when there is
/// enough to do: most of a large write is the kernel's own work per entry
/// (a hash bucket, an allocation), which runs in parallel (the hash maps
/// lock bucket by bucket). The entries of one write are independent of each
/// other, so their order does not matter. `write` gets a range and answers
/// with indexes relative to its start; on errors, the one with the lowest
/// index (the other threads may have written entries past it).
pub(crate) fn split<T: Send>(
    len: usize,
    write: impl Fn(std::ops::Range<usize>) -> Result<T, BatchError> + Sync,
    mut add: impl FnMut(T),
) -> Result<(), BatchError> {
    let threads = threads(len / PER_THREAD);
    if threads == 1 {
        return write(0..len).map(add);
    }
    let per = len.div_ceil(threads);
    let ranges: Vec<_> = (0..threads)
        .map(|t| t * per..((t + 1) * per).min(len))
        .collect();
    let results: Vec<Result<T, BatchError>> = std::thread::scope(|s| {
        let write = &write;
        let handles: Vec<_> = ranges[1..]
            .iter()
            .map(|r| {
                let r = r.clone();
                s.spawn(move || write(r))
            })
            .collect();
        let mut out = vec![write(ranges[0].clone())];
        for h in handles {
            out.push(h.join().unwrap_or_else(|_| {
                Err(BatchError::Refused {
                    index: 0,
                    whole: true,
                    error: io::Error::other("a map writing thread panicked"),
                })
            }));
        }
        out
    });
    let mut first: Option<BatchError> = None;
    for (r, range) in results.into_iter().zip(&ranges) {
        match r {
            Ok(t) => add(t),
            Err(e) => {
                let e = shift(e, range.start);
                let earlier = match (&first, &e) {
                    (None, _) => true,
                    (Some(BatchError::Unsupported(_)), _) => false,
                    (_, BatchError::Unsupported(_)) => true,
                    (
                        Some(BatchError::Refused { index: a, .. }),
                        BatchError::Refused { index: b, .. },
                    ) => b < a,
                };
                if earlier {
                    first = Some(e);
                }
            }
        }
    }
    // ("No such command" from any thread is the kernel's answer for all.)
    first.map_or(Ok(()), Err)
}

fn shift(e: BatchError, by: usize) -> BatchError {
    match e {
        BatchError::Refused {
            index,
            whole,
            error,
        } => BatchError::Refused {
            index: index + by,
            whole,
            error,
        },
        e => e,
    }
}

/// Writes `keys[i] -> values[i]` for every i (`BPF_ANY`: insert or
/// overwrite). `K` and `V` must be the map's key and value types (aya
/// checked their sizes when it opened the map).
pub(crate) fn update<K: aya::Pod, V: aya::Pod>(
    cmd: u32,
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), BatchError> {
    if keys.len() != values.len() {
        return Err(BatchError::Refused {
            index: 0,
            whole: true,
            error: io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} keys for {} values", keys.len(), values.len()),
            ),
        });
    }
    let mut done = 0;
    while done < keys.len() {
        let n = (keys.len() - done).min(CHUNK);
        let (k, v) = (&keys[done..done + n], &values[done..done + n]);
        let mut attr = BatchAttr {
            keys: k.as_ptr() as u64,
            values: v.as_ptr() as u64,
            count: n as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        // SAFETY: keys and values point to `n` entries each of the map's key
        // and value types (aya::Pod: plain bytes, no padding), which the
        // kernel only reads; both slices outlive the call.
        let r = unsafe { call(cmd, &mut attr) };
        match r {
            Ok(()) => done += n,
            Err(e) => return Err(failed(e, done, n, attr.count as usize)),
        }
    }
    Ok(())
}

/// The error for a call that failed on the chunk starting at `done` with
/// `n` entries, of which the kernel says `count` are done.
fn failed(error: io::Error, done: usize, n: usize, count: usize) -> BatchError {
    if count >= n {
        // Untouched: the command itself was refused.
        if done == 0 && unsupported(&error) {
            return BatchError::Unsupported(error);
        }
        return BatchError::Refused {
            index: done,
            whole: true,
            error,
        };
    }
    BatchError::Refused {
        index: done + count,
        whole: false,
        error,
    }
}

/// Deletes every key of `keys`; a key that is not there is skipped (a
/// repair meets such holes). Returns how many were missing.
pub(crate) fn delete<K: aya::Pod>(
    cmd: u32,
    fd: BorrowedFd<'_>,
    keys: &[K],
) -> Result<usize, BatchError> {
    let mut done = 0;
    let mut missing = 0;
    while done < keys.len() {
        let n = (keys.len() - done).min(CHUNK);
        let k = &keys[done..done + n];
        let mut attr = BatchAttr {
            keys: k.as_ptr() as u64,
            count: n as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        // SAFETY: keys points to `n` keys of the map's key type, which the
        // kernel only reads; the slice outlives the call. No values.
        let r = unsafe { call(cmd, &mut attr) };
        let count = attr.count as usize;
        match r {
            Ok(()) => done += n,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) && count < n => {
                // Entry `count` was not there: done as far as we care.
                done += count + 1;
                missing += 1;
            }
            Err(e) => return Err(failed(e, done, n, count)),
        }
    }
    Ok(missing)
}

/// Every entry of the map. `K` and `V` must be the map's key and value
/// types.
pub(crate) fn lookup_all<K: aya::Pod + Default, V: aya::Pod + Default>(
    cmd: u32,
    fd: BorrowedFd<'_>,
) -> Result<Vec<(K, V)>, BatchError> {
    // The position tokens: a bucket number (u32) for hash maps, a key for
    // the generic implementation (array maps).
    const TOKEN: usize = 64;
    if std::mem::size_of::<K>() > TOKEN {
        return Err(BatchError::Unsupported(io::Error::new(
            io::ErrorKind::InvalidInput,
            "key larger than the batch token",
        )));
    }
    let mut tokens = [[0u64; TOKEN / 8]; 2];
    let mut out: Vec<(K, V)> = Vec::new();
    let mut n = 4096usize;
    let mut keys = vec![K::default(); n];
    let mut values = vec![V::default(); n];
    let mut first = true;
    loop {
        let [ref in_tok, ref mut out_tok] = tokens;
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { in_tok.as_ptr() as u64 },
            out_batch: out_tok.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: n as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        // SAFETY: keys and values are `n` writable entries of the map's key
        // and value types (aya::Pod: any bytes are a valid value); the two
        // tokens are 64-byte buffers, at least a key and a u32; all outlive
        // the call.
        let r = unsafe { call(cmd, &mut attr) };
        let got = (attr.count as usize).min(n);
        let take = |out: &mut Vec<(K, V)>| {
            out.extend(
                keys[..got]
                    .iter()
                    .copied()
                    .zip(values[..got].iter().copied()),
            )
        };
        match r {
            Ok(()) => {
                take(&mut out);
                tokens[0] = tokens[1];
                first = false;
            }
            // The end: the last entries come with it.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                take(&mut out);
                return Ok(out);
            }
            // One bucket holds more than `n` entries: a larger buffer.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && got == 0 && n < (1 << 20) => {
                n *= 4;
                keys.resize(n, K::default());
                values.resize(n, V::default());
            }
            Err(e) if first && attr.count as usize == n && unsupported(&e) => {
                return Err(BatchError::Unsupported(e))
            }
            Err(error) => {
                return Err(BatchError::Refused {
                    index: out.len(),
                    whole: true,
                    error,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attribute_has_the_kernels_layout() {
        // union bpf_attr's `batch`: six 64-bit fields and two u32 (count,
        // map_fd) between values and elem_flags.
        assert_eq!(std::mem::size_of::<BatchAttr>(), 56);
        assert_eq!(std::mem::align_of::<BatchAttr>(), 8);
        let a = BatchAttr::default();
        let base = &a as *const BatchAttr as usize;
        assert_eq!(&a.count as *const u32 as usize - base, 32);
        assert_eq!(&a.map_fd as *const u32 as usize - base, 36);
        assert_eq!(&a.elem_flags as *const u64 as usize - base, 40);
    }

    #[test]
    fn a_split_write_covers_every_entry_once_and_names_the_first_refused() {
        use std::sync::Mutex;
        let len = 5 * PER_THREAD + 17;
        let seen = Mutex::new(vec![0u8; len]);
        let mut calls = 0;
        split(
            len,
            |r| {
                let mut s = seen.lock().unwrap();
                for i in r.clone() {
                    s[i] += 1;
                }
                Ok(r.len())
            },
            |n| calls += n,
        )
        .unwrap();
        assert_eq!(calls, len);
        assert!(seen.into_inner().unwrap().iter().all(|n| *n == 1));
        // Refused at two places (whichever threads they fall in): the
        // lower one, as an index into the whole write.
        let bad = [len - 3, 2 * PER_THREAD + 5];
        let r = split(
            len,
            |r| match bad.iter().filter(|b| r.contains(b)).min() {
                Some(b) => Err(BatchError::Refused {
                    index: b - r.start,
                    whole: false,
                    error: io::Error::from_raw_os_error(libc::E2BIG),
                }),
                None => Ok(()),
            },
            drop,
        );
        assert!(
            matches!(r, Err(BatchError::Refused { index, .. }) if index == 2 * PER_THREAD + 5),
            "{r:?}"
        );
    }

    #[test]
    fn errors_are_told_apart_by_what_the_kernel_did() {
        let e = |n| io::Error::from_raw_os_error(n);
        // Count untouched, first chunk, "no such command": fall back.
        assert!(matches!(
            failed(e(libc::EINVAL), 0, 10, 10),
            BatchError::Unsupported(_)
        ));
        assert!(matches!(
            failed(e(ENOTSUPP), 0, 10, 10),
            BatchError::Unsupported(_)
        ));
        // An entry refused: the ones before it are done.
        assert!(matches!(
            failed(e(libc::E2BIG), 100, 10, 3),
            BatchError::Refused {
                index: 103,
                whole: false,
                ..
            }
        ));
        // EINVAL for one entry is that entry's, not a missing command.
        assert!(matches!(
            failed(e(libc::EINVAL), 0, 10, 0),
            BatchError::Refused {
                index: 0,
                whole: false,
                ..
            }
        ));
        // Refused as a whole (no permission, a later chunk): an error.
        assert!(matches!(
            failed(e(libc::EPERM), 0, 10, 10),
            BatchError::Refused {
                index: 0,
                whole: true,
                ..
            }
        ));
        assert!(matches!(
            failed(e(libc::EINVAL), CHUNK, 10, 10),
            BatchError::Refused { whole: true, .. }
        ));
    }
}
