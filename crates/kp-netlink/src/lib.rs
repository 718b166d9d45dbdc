//! Netlink sockets and message framing shared by the dataplanes, and the
//! `/proc/sys` helper their host setup uses.
//!
//! - [`Attrs`] builds attributes (nests included) and [`message`] /
//!   [`push_message`] frame them: netlink header, the protocol's fixed header
//!   (nfgenmsg, genlmsghdr, ifaddrmsg, ...), attributes, padding.
//! - [`ParsedAttrs`] reads one level of attributes back; [`messages`] splits a
//!   datagram from the kernel into [`Message`]s; [`Answer`] tells what each
//!   message is to one request's answer (another request's, data, the end:
//!   acknowledgement or NLMSG_DONE, or the kernel's error). All three are
//!   pure, so they are tested without a socket.
//! - [`ifaddr`]: rtnetlink interface addresses (header, attributes, parsing).
//! - [`sysctl`]: kernel settings under `/proc/sys`, read before written.
//! - [`Socket`] is one netlink socket of a [`Protocol`] chosen at open, with
//!   the options callers need (NETLINK_CAP_ACK, forced buffer sizes, a
//!   receive timeout), sending and receive loops.
//!
//! The socket itself is netlink-sys's (the rust-netlink project's, which
//! rtnetlink uses): it opens, binds, sends and receives; the options it has no
//! method for (SO_SNDBUFFORCE, SO_RCVBUFFORCE, SO_RCVTIMEO) are set on its
//! file descriptor here. Message contents stay with each caller: nf_tables,
//! IPVS and rtnetlink messages are hand-encoded with [`Attrs`] (their bytes
//! are pinned by tests), conntrack's with netlink-packet-netfilter.

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod build;
pub mod ifaddr;
pub mod nftables;
mod parse;
mod socket;
pub mod sysctl;

pub use build::{message, push_message, Attrs, Nest};
pub use parse::{messages, Answer, Message, ParsedAttrs, Reply, Step, Until};
pub use socket::{Error, Protocol, Socket, Wait};
pub use sysctl::{Sysctl, SysctlError};

/// Length of struct nlmsghdr.
pub const NLMSG_HDRLEN: usize = 16;

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
/// Types below this are netlink's own control messages.
pub const NLMSG_MIN_TYPE: u16 = 0x10;

pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
/// NLM_F_ROOT | NLM_F_MATCH.
pub const NLM_F_DUMP: u16 = 0x300;
pub const NLM_F_REPLACE: u16 = 0x100;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_APPEND: u16 = 0x800;

pub const NLA_F_NESTED: u16 = 0x8000;
pub const NLA_F_NET_BYTEORDER: u16 = 0x4000;
/// The attribute type without the two flag bits.
pub const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

/// Netlink's alignment: messages and attributes start at multiples of 4.
pub fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// `first` on this thread and `second` on one of its own, at the same time
/// (a large batch encoded in two halves). `first`'s error is returned before
/// `second`'s; `panicked()` if `second` panics.
pub fn side_by_side<A, B: Send, E: Send>(
    first: impl FnOnce() -> Result<A, E>,
    second: impl FnOnce() -> Result<B, E> + Send,
    panicked: impl FnOnce() -> E,
) -> Result<(A, B), E> {
    let (a, b) = std::thread::scope(|s| {
        let h = s.spawn(second);
        (first(), h.join())
    });
    let a = a?;
    match b {
        Ok(b) => Ok((a, b?)),
        Err(_) => Err(panicked()),
    }
}

/// `f` for every item, on up to 4 threads (no more than the machine has
/// cores, nor one per fewer than `per_thread` items), each with its own
/// state from `new` (a socket: one dump at a time per socket), items dealt
/// round-robin; the results in no particular order. A thread starts in the
/// network namespace of the one that spawns it. Reading many small dumps
/// back this way overlaps their round trips.
pub fn on_threads<K: Send, T: Send, S, E: Send>(
    items: Vec<K>,
    per_thread: usize,
    new: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, K) -> Result<T, E> + Sync,
    panicked: impl Fn() -> E,
) -> Result<Vec<T>, E> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4)
        .min(items.len().div_ceil(per_thread.max(1)).max(1));
    let mut parts: Vec<Vec<K>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, k) in items.into_iter().enumerate() {
        parts[i % threads].push(k);
    }
    let (new, f) = (&new, &f);
    std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .into_iter()
            .map(|part| {
                s.spawn(move || {
                    let mut state = new();
                    part.into_iter()
                        .map(|k| f(&mut state, k))
                        .collect::<Result<Vec<T>, E>>()
                })
            })
            .collect();
        let mut out = Vec::new();
        for h in handles {
            match h.join() {
                Ok(part) => out.extend(part?),
                Err(_) => return Err(panicked()),
            }
        }
        Ok(out)
    })
}
