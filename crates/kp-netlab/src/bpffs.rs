//! A private bpf filesystem for one test: the programs and maps a test pins
//! live there, and unmounting it on drop releases them all (links detach,
//! maps go) even when the test failed halfway. The host's /sys/fs/bpf is
//! never used.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::LabError;

static NEXT: AtomicU64 = AtomicU64::new(0);

pub struct TestBpffs {
    dir: PathBuf,
}

impl TestBpffs {
    pub fn new() -> Result<TestBpffs, LabError> {
        let dir = std::env::temp_dir().join(format!(
            "kp-bpffs-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).map_err(|source| LabError::Io {
            what: format!("creating {}", dir.display()),
            source,
        })?;
        let c = |s: &[u8]| CString::new(s).map_err(|e| LabError::Options(e.to_string()));
        let target = c(dir.as_os_str().as_bytes())?;
        let fstype = c(b"bpf")?;
        // SAFETY: valid C strings; no data argument.
        let rc = unsafe {
            libc::mount(
                fstype.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            let source = std::io::Error::last_os_error();
            let _ = std::fs::remove_dir(&dir);
            return Err(LabError::Io {
                what: format!("mounting a bpf filesystem on {}", dir.display()),
                source,
            });
        }
        Ok(TestBpffs { dir })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for TestBpffs {
    fn drop(&mut self) {
        if let Ok(target) = CString::new(self.dir.as_os_str().as_bytes()) {
            // SAFETY: valid C string. Lazy: a proxy still holding an fd
            // in there does not keep the mount point alive.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
