//! Scratch network namespaces of the benches that program a kernel of their
//! own (the tables, idle, reconcile, userspace-relay): made with `ip netns
//! add`, deleted when the guard drops, whatever the bench returned, and the
//! thread moved in and back out by `setns`.

use std::fs::File;

use anyhow::{bail, Context, Result};
pub use kp_netlab::ScratchNs;

/// A network namespace of the bench's own (kp-netlab's guard: lo up,
/// deleted on drop). The name should hold the bench's pid so runs side by
/// side do not meet.
pub fn add(name: &str) -> Result<ScratchNs> {
    ScratchNs::create(name).with_context(|| format!("making namespace {name} (run as root)"))
}

/// The namespace's file under /run/netns, for [`enter`].
pub fn file(ns: &ScratchNs) -> Result<File> {
    let path = format!("/run/netns/{}", ns.name());
    File::open(&path).with_context(|| format!("opening {path}"))
}

/// This thread's own network namespace, to come back to after [`enter`].
pub fn home() -> Result<File> {
    File::open("/proc/self/ns/net").context("opening our network namespace")
}

/// Moves this thread into the network namespace of `f`, so the netlink
/// sockets and the programs it starts act there.
pub fn enter(f: &File) -> Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: setns on a namespace file descriptor we own; affects this thread only.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("setns: {}", std::io::Error::last_os_error());
    }
    Ok(())
}
