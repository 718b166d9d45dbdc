//! nf_tables over netlink: the proxier's typed transactions encoded as one
//! batch of nf_tables messages, without the `nft` program (whose cost grows
//! faster than linearly with the number of chains) and without nft text.

mod batch;
mod expr;
mod nla;

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};

use kp_model::{DataplaneError, IpFamily};
use kp_netlink::{
    Attrs, Protocol, Reply, Socket, Until, Wait, NLMSG_DONE, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST,
};

use crate::backend::NftBackend;
use crate::types::Transaction;

pub use batch::EncodeError;

const TOOL: &str = "nf_tables netlink";

/// Sends nft transactions to the kernel as one nf_tables netlink batch.
///
/// The socket is kept between transactions: closing a netfilter netlink
/// socket waits for an RCU grace period (8-16 ms here), which would otherwise
/// be most of a small partial sync. It is opened in the network namespace of
/// the thread that first applies, and dropped after any socket error.
#[derive(Debug, Default)]
pub struct NftNetlink {
    sock: Option<Socket>,
    rcvbuf: usize,
}

impl NftNetlink {
    pub fn new() -> Self {
        NftNetlink::default()
    }

    /// Checks that every object of `tx` can be encoded (addresses of the
    /// table's family, interface names and comments that fit), without
    /// touching the kernel.
    pub fn check(tx: &Transaction) -> Result<(), EncodeError> {
        batch::encode(tx, 1).map(|_| ())
    }
}

/// Sequence numbers unique within the process, so that answers from a batch
/// can never be mistaken for another's.
fn next_seq(n: usize) -> u32 {
    static SEQ: AtomicU32 = AtomicU32::new(1);
    SEQ.fetch_add(n as u32 + 2, Ordering::Relaxed)
}

fn errno_text(errno: i32) -> String {
    io::Error::from_raw_os_error(errno).to_string()
}

fn io_err(what: &str, e: io::Error) -> DataplaneError {
    DataplaneError::Io {
        what: what.to_string(),
        source: e,
    }
}

/// An acknowledgement (errno 0) or error answer to one message of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ack {
    seq: u32,
    errno: i32,
}

/// Every acknowledgement and error queued on the socket, read without
/// blocking: a batch is processed inside sendmsg, so once `send` returns its
/// answers are all queued.
fn queued_acks(sock: &mut Socket) -> io::Result<Vec<Ack>> {
    let mut out = Vec::new();
    sock.recv_each(Wait::Drain, |m| {
        if let Some(errno) = m.error() {
            out.push(Ack { seq: m.seq, errno });
        }
        m.ty == NLMSG_DONE
    })?;
    Ok(out)
}

impl NftNetlink {
    fn socket(&mut self) -> Result<&mut Socket, DataplaneError> {
        if self.sock.is_none() {
            let s = Socket::open(Protocol::Netfilter)
                .map_err(|e| io_err("opening a netfilter netlink socket", e))?;
            // Without it (kernels before 4.2) error answers just carry the
            // whole failed message: larger, still read.
            let _ = s.set_cap_ack();
            self.sock = Some(s);
            self.rcvbuf = 0;
        }
        self.sock.as_mut().ok_or_else(|| {
            io_err(
                "opening a netfilter netlink socket",
                io::ErrorKind::NotConnected.into(),
            )
        })
    }

    /// Sends one batch and returns the kernel's answers to it.
    fn send_batch(&mut self, batch: &batch::Batch) -> Result<Vec<Ack>, DataplaneError> {
        // Every message asks for an acknowledgement and the kernel queues them all
        // before we read: make room (an ack costs well under 1 KiB of buffer).
        let want = (batch.len() * 1024).max(1 << 20);
        let grow = want > self.rcvbuf;
        let sock = self.socket()?;
        // Answers left from an interrupted exchange are not ours.
        let _ = queued_acks(sock);
        // Both sizes are best effort: too small a send buffer fails the send
        // below (named there), too small a receive buffer shows as ENOBUFS or
        // missing acks, both reported below.
        if grow {
            let _ = sock.set_recv_buffer(want);
        }
        // The whole batch must be one datagram: nfnetlink processes a batch per skb.
        let _ = sock.set_send_buffer(batch.buf.len() + 65536);
        sock.send(&batch.buf)
            .map_err(|e| io_err("sending the nf_tables batch", e))?;
        let answers = queued_acks(sock).map_err(|e| {
            io_err(
                "reading the kernel's answers to the nf_tables batch (the transaction may or may not have been applied)",
                e,
            )
        })?;
        if grow {
            self.rcvbuf = want;
        }
        let (first, last) = (
            batch.begin_seq,
            batch.begin_seq.wrapping_add(batch.len() as u32 + 1),
        );
        Ok(answers
            .into_iter()
            .filter(|a| a.seq.wrapping_sub(first) <= last.wrapping_sub(first))
            .collect())
    }

    /// Sends one nf_tables request and returns the data messages of its
    /// answer, or the kernel's errno. Drops the socket after a socket error.
    fn query(
        &mut self,
        family: IpFamily,
        ty: u16,
        flags: u16,
        attrs: &Attrs,
        what: &str,
        until: Until,
    ) -> Result<Result<Vec<Reply>, i32>, DataplaneError> {
        let fam = expr::Family::from(family);
        let seq = next_seq(1);
        let mut buf = Vec::new();
        nla::put_msg(
            &mut buf,
            (nla::NFNL_SUBSYS_NFTABLES << 8) | ty,
            NLM_F_REQUEST | flags,
            seq,
            fam.nfproto(),
            0,
            attrs.as_bytes(),
        );
        // Answers left from an interrupted exchange carry other sequence
        // numbers: the request skips them.
        match self.socket()?.request(&buf, seq, until) {
            Ok(replies) => Ok(Ok(replies)),
            Err(kp_netlink::Error::Kernel(errno)) => Ok(Err(errno)),
            Err(kp_netlink::Error::Io(e)) => {
                self.sock = None;
                Err(io_err(&format!("asking the kernel for {what}"), e))
            }
        }
    }
}

impl NftBackend for NftNetlink {
    fn apply(&mut self, tx: &Transaction) -> Result<usize, DataplaneError> {
        // A sequence range for every message the batch may hold.
        let seq0 = next_seq(batch::max_messages(tx));
        let batch = batch::encode(tx, seq0).map_err(|e| DataplaneError::Apply {
            tool: TOOL.into(),
            message: e.to_string(),
        })?;
        if batch.is_empty() {
            return Ok(0);
        }
        let answers = match self.send_batch(&batch) {
            Ok(a) => a,
            Err(e) => {
                self.sock = None;
                return Err(e);
            }
        };
        let mut errors = Vec::new();
        let mut acked = 0usize;
        for a in &answers {
            if a.errno == 0 {
                acked += 1;
                continue;
            }
            if a.seq == batch.begin_seq {
                errors.push(format!("commit failed: {}", errno_text(a.errno)));
                continue;
            }
            match batch.lines.iter().find(|(s, _)| *s == a.seq) {
                Some((_, l)) => errors.push(format!(
                    "line {l}: {}: `{}`",
                    errno_text(a.errno),
                    tx.op_text(l - 1)
                )),
                None => errors.push(format!(
                    "message {} (not ours): {}",
                    a.seq,
                    errno_text(a.errno)
                )),
            }
        }
        if !errors.is_empty() {
            errors.truncate(6);
            return Err(DataplaneError::Apply {
                tool: TOOL.into(),
                message: errors.join(" | "),
            });
        }
        if acked != batch.len() {
            // Without every acknowledgement we cannot tell whether it applied.
            return Err(DataplaneError::Apply {
                tool: TOOL.into(),
                message: format!(
                    "{acked} of {} messages acknowledged; state unknown",
                    batch.len()
                ),
            });
        }
        tracing::debug!(
            messages = batch.len(),
            bytes = batch.buf.len(),
            "nf_tables batch applied"
        );
        Ok(batch.buf.len())
    }

    fn chain_has_rules(
        &mut self,
        family: IpFamily,
        table: &str,
        chain: &str,
    ) -> Result<bool, DataplaneError> {
        let mut a = Attrs::new();
        a.str(1, table).str(2, chain);
        let newrule = (nla::NFNL_SUBSYS_NFTABLES << 8) | nla::msg::NEWRULE;
        // GETRULE dump of one chain: a few messages, never the whole table.
        let answer = self.query(
            family,
            nla::msg::GETRULE,
            NLM_F_DUMP,
            &a,
            "our canary chain",
            Until::Done,
        )?;
        match answer {
            Ok(replies) => Ok(replies.iter().any(|r| r.ty == newrule)),
            Err(libc::ENOENT) => Ok(false),
            Err(errno) => Err(DataplaneError::Apply {
                tool: TOOL.into(),
                message: format!("listing chain {chain}: {}", errno_text(errno)),
            }),
        }
    }

    fn table_exists(&mut self, family: IpFamily, table: &str) -> Result<bool, DataplaneError> {
        let mut a = Attrs::new();
        a.str(1, table);
        let answer = self.query(
            family,
            nla::msg::GETTABLE,
            NLM_F_ACK,
            &a,
            "the nftables table",
            Until::Ack,
        )?;
        match answer {
            Ok(_) => Ok(true),
            Err(libc::ENOENT) => Ok(false),
            Err(errno) => Err(DataplaneError::Apply {
                tool: TOOL.into(),
                message: format!("getting table {table}: {}", errno_text(errno)),
            }),
        }
    }
}
