//! Filesystems the lab mounts under /tmp for a test (a bpf filesystem, a
//! view of the cgroup v2 hierarchy), and the leftovers of killed test
//! processes, found by the pid in their names.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::LabError;

fn c_path(p: &Path) -> Result<CString, LabError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|e| LabError::Options(e.to_string()))
}

/// Creates `dir` and mounts a fresh `fstype` filesystem on it; on failure
/// the directory goes again.
pub(crate) fn mount_at(fstype: &str, dir: &Path) -> Result<(), LabError> {
    std::fs::create_dir_all(dir).map_err(|source| LabError::Io {
        what: format!("creating {}", dir.display()),
        source,
    })?;
    let (target, fs) = (c_path(dir)?, c_path(Path::new(fstype))?);
    // SAFETY: valid C strings; no data argument.
    let rc = unsafe {
        libc::mount(
            fs.as_ptr(),
            target.as_ptr(),
            fs.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let source = std::io::Error::last_os_error();
        let _ = std::fs::remove_dir(dir);
        return Err(LabError::Io {
            what: format!("mounting {fstype} on {}", dir.display()),
            source,
        });
    }
    Ok(())
}

/// Unmounts `dir` lazily (a process still holding a descriptor in there
/// does not keep the mount point alive) and removes the directory.
pub(crate) fn unmount(dir: &Path) {
    if let Ok(target) = c_path(dir) {
        // SAFETY: valid C string.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
    let _ = std::fs::remove_dir(dir);
}

/// Entries of `dir` named `<prefix><pid>` or `<prefix><pid>-...` whose
/// process is gone.
pub(crate) fn stale(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix(prefix)
                .and_then(|rest| rest.split('-').next())
                .is_some_and(|pid| !Path::new("/proc").join(pid).exists())
        })
        .map(|e| e.path())
        .collect()
}
