//! A private bpf filesystem for one test: the programs and maps a test pins
//! live there, and unmounting it on drop releases them all (links detach,
//! maps go) even when the test failed halfway. The host's /sys/fs/bpf is
//! never used.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::mounts::{mount_at, unmount};
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
        mount_at("bpf", &dir)?;
        Ok(TestBpffs { dir })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for TestBpffs {
    fn drop(&mut self) {
        unmount(&self.dir);
    }
}
