//! nf_tables over nfnetlink, the parts every writer of nf_tables shares: the
//! framing, a batch of messages between BATCH_BEGIN and BATCH_END, one socket
//! that sends a batch and collects the kernel's answer to every message, and
//! the expressions both the nftables and the iptables(-nft) dataplanes emit.
//! What the messages say (nft's objects, iptables-nft's rules) stays with each
//! dataplane.

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::{Attrs, Error, Protocol, Reply, Socket, Until, Wait, NLMSG_DONE, NLM_F_ACK};
use crate::{NLMSG_HDRLEN, NLM_F_REQUEST};

pub const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub const NFNL_MSG_BATCH_BEGIN: u16 = 16;
pub const NFNL_MSG_BATCH_END: u16 = 17;

/// nfgenmsg families.
pub const NFPROTO_IPV4: u8 = 2;
pub const NFPROTO_IPV6: u8 = 10;

/// nf_tables message types (low byte; the subsystem goes in the high byte).
pub mod msg {
    pub const NEWTABLE: u16 = 0;
    pub const GETTABLE: u16 = 1;
    pub const DELTABLE: u16 = 2;
    pub const NEWCHAIN: u16 = 3;
    pub const GETCHAIN: u16 = 4;
    pub const DELCHAIN: u16 = 5;
    pub const NEWRULE: u16 = 6;
    pub const GETRULE: u16 = 7;
    pub const DELRULE: u16 = 8;
    pub const NEWSET: u16 = 9;
    pub const GETSET: u16 = 10;
    pub const DELSET: u16 = 11;
    pub const NEWSETELEM: u16 = 12;
    pub const GETSETELEM: u16 = 13;
    pub const DELSETELEM: u16 = 14;
}

/// The full message type of nf_tables message `ty`.
pub const fn nft_type(ty: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | ty
}

/// Appends one nfnetlink message (header, nfgenmsg, attributes) to `out`.
pub fn put_msg(
    out: &mut Vec<u8>,
    ty: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
    attrs: &[u8],
) {
    // struct nfgenmsg: family, version 0, resource id (big-endian).
    let [r0, r1] = res_id.to_be_bytes();
    crate::push_message(out, ty, flags, seq, &[family, 0, r0, r1], attrs);
}

/// The attributes of an nf_tables message from the kernel (after nfgenmsg).
pub fn nft_attrs(reply: &[u8]) -> &[u8] {
    reply.get(NLMSG_HDRLEN + 4..).unwrap_or(&[])
}

/// nft's userdata TLV: one byte type, one byte length, value.
pub fn udata(out: &mut Vec<u8>, ty: u8, value: &[u8]) {
    out.push(ty);
    out.push(value.len() as u8);
    out.extend_from_slice(value);
}

pub trait NftAttrs {
    /// A nest holding one `NFTA_DATA_VALUE`.
    fn data_value(&mut self, ty: u16, value: &[u8]) -> &mut Self;
}

impl NftAttrs for Attrs {
    fn data_value(&mut self, ty: u16, value: &[u8]) -> &mut Self {
        let n = self.begin_nest(ty);
        self.attr(1, value);
        self.end_nest(n)
    }
}

/// Sequence numbers unique within the process, so that answers from a batch
/// can never be mistaken for another's: reserves `n` plus BEGIN and END.
pub fn next_seq(n: usize) -> u32 {
    static SEQ: AtomicU32 = AtomicU32::new(1);
    SEQ.fetch_add(n as u32 + 2, Ordering::Relaxed)
}

/// Bytes per piece of a [`Batch`]: 1024 pieces (the kernel's IOV_MAX)
/// hold 4 GiB, and a piece's unused tail is at most a message.
pub const BATCH_PIECE: usize = 4 << 20;

/// One batch being built: BEGIN, then one message per [`Batch::push`], then
/// END from [`Batch::finish`]. Each message remembers which of the caller's
/// operations (`op`, any index the caller understands) it came from, so that
/// an error answer can name it.
pub struct Batch {
    /// The messages, whole, in pieces of about [`BATCH_PIECE`] bytes: sent
    /// as one datagram through an iovec, so a growing batch is never copied
    /// into a larger buffer (a 60 MB batch at 50k Services grew by doubling,
    /// briefly holding two copies).
    pieces: Vec<Vec<u8>>,
    /// (sequence number, operation) of every message between BEGIN and END.
    pub ops: Vec<(u32, usize)>,
    pub begin_seq: u32,
    seq: u32,
    /// Where the last message of an operation starts in the last piece:
    /// [`Batch::finish`] asks for its acknowledgement.
    last_op_at: Option<usize>,
}

impl Batch {
    /// A batch holding BEGIN; `capacity`: the bytes expected (a hint).
    pub fn new(seq0: u32, capacity: usize) -> Batch {
        let mut b = Batch::continuation(seq0, capacity);
        put_msg(
            b.room(0),
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            seq0,
            0,
            NFNL_SUBSYS_NFTABLES,
            &[],
        );
        b
    }

    /// Appends nf_tables message `ty` (low byte) for operation `op`. Only
    /// the last message of a batch asks for an acknowledgement
    /// ([`Batch::finish`]): the kernel answers every message that fails
    /// anyway, and an acknowledgement per message cost ~0.7 s of a 10k
    /// Services iptables sync (600k answers queued, then read).
    pub fn push(&mut self, op: usize, family: u8, ty: u16, flags: u16, attrs: &Attrs) {
        self.seq = self.seq.wrapping_add(1);
        let (len, seq) = (NLMSG_HDRLEN + 4 + attrs.len(), self.seq);
        let piece = self.room(len);
        let at = piece.len();
        put_msg(
            piece,
            nft_type(ty),
            NLM_F_REQUEST | flags,
            seq,
            family,
            0,
            attrs.as_bytes(),
        );
        self.last_op_at = Some(at);
        self.ops.push((self.seq, op));
    }

    /// The rest of a batch whose earlier part is encoded elsewhere (no
    /// BEGIN): its messages take sequence numbers from `seq0 + 1`. See
    /// [`Batch::append`].
    pub fn continuation(seq0: u32, capacity: usize) -> Batch {
        Batch {
            pieces: vec![Vec::with_capacity(capacity.clamp(4096, BATCH_PIECE))],
            ops: Vec::new(),
            begin_seq: seq0,
            seq: seq0,
            last_op_at: None,
        }
    }

    /// Appends a continuation's messages (their sequence numbers are its
    /// own, so it must have started after this batch's last one).
    pub fn append(&mut self, mut rest: Batch) {
        // Empty pieces dropped, so that the last piece holds the last
        // message (`last_op_at`).
        self.pieces.retain(|p| !p.is_empty());
        self.pieces
            .extend(rest.pieces.into_iter().filter(|p| !p.is_empty()));
        self.ops.append(&mut rest.ops);
        self.seq = rest.seq;
        if rest.last_op_at.is_some() {
            self.last_op_at = rest.last_op_at;
        }
    }

    /// The sequence number of the last message (END once finished); every
    /// message of the batch is numbered from `begin_seq` to this.
    pub fn last_seq(&self) -> u32 {
        self.seq
    }

    /// The piece the next message of `len` bytes goes into.
    fn room(&mut self, len: usize) -> &mut Vec<u8> {
        let full = self
            .pieces
            .last()
            .is_none_or(|p| !p.is_empty() && p.len() + len > BATCH_PIECE);
        if full {
            self.pieces
                .push(Vec::with_capacity(BATCH_PIECE.max(len + 16)));
        }
        let last = self.pieces.len() - 1;
        &mut self.pieces[last]
    }

    /// The encoded batch, in pieces to be sent back to back.
    pub fn pieces(&self) -> &[Vec<u8>] {
        &self.pieces
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(Vec::len).sum()
    }

    /// Closes the batch with END. Its last message asks for an
    /// acknowledgement: the kernel sends the answers of a batch once it is
    /// committed or aborted, so that acknowledgement with no error beside
    /// it says the whole batch applied.
    pub fn finish(mut self) -> Batch {
        // nlmsg_flags: bytes 6-7 of the message header.
        let last = self.pieces.last_mut().zip(self.last_op_at);
        if let Some(flags) = last.and_then(|(p, at)| p.get_mut(at + 6..at + 8)) {
            let f = u16::from_ne_bytes([flags[0], flags[1]]) | NLM_F_ACK;
            flags.copy_from_slice(&f.to_ne_bytes());
        }
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        put_msg(
            self.room(NLMSG_HDRLEN + 4),
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            seq,
            0,
            NFNL_SUBSYS_NFTABLES,
            &[],
        );
        self
    }

    /// Messages in the batch, BEGIN and END excluded.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

/// An acknowledgement (errno 0) or error answer to one message of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    pub seq: u32,
    pub errno: i32,
}

/// What went wrong with a sent batch, per message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The kernel refused the whole transaction at commit.
    Commit(i32),
    /// The message of this operation was refused.
    Op(usize, i32),
    /// An error answer with a sequence number of the batch's range but no
    /// message of ours.
    Foreign(u32, i32),
    /// No error, and no acknowledgement of the last message either: whether
    /// the batch applied is unknown.
    Unacknowledged { sent: usize },
}

/// The refusals among `answers` to `batch`; empty when none of its messages
/// failed and the last was acknowledged.
pub fn refusals(batch: &Batch, answers: &[Ack]) -> Vec<Refusal> {
    let mut out = Vec::new();
    let last = batch.ops.last().map(|(s, _)| *s);
    let mut confirmed = false;
    for a in answers {
        if a.errno == 0 {
            confirmed |= Some(a.seq) == last;
        } else if a.seq == batch.begin_seq {
            out.push(Refusal::Commit(a.errno));
        } else {
            match batch.ops.iter().find(|(s, _)| *s == a.seq) {
                Some((_, op)) => out.push(Refusal::Op(*op, a.errno)),
                None => out.push(Refusal::Foreign(a.seq, a.errno)),
            }
        }
    }
    if out.is_empty() && last.is_some() && !confirmed {
        out.push(Refusal::Unacknowledged { sent: batch.len() });
    }
    out
}

/// `strerror` of a kernel errno.
pub fn errno_text(errno: i32) -> String {
    io::Error::from_raw_os_error(errno).to_string()
}

/// A socket-level failure of a batch or request, and at which step.
#[derive(Debug, thiserror::Error)]
#[error("{step}: {source}")]
pub struct ExchangeError {
    pub step: &'static str,
    #[source]
    pub source: io::Error,
}

/// One netfilter netlink socket for nf_tables batches and requests.
///
/// The socket is kept between batches: closing a netfilter netlink socket
/// waits for an RCU grace period (8-16 ms here), which would otherwise be most
/// of a small partial sync. It is opened in the network namespace of the
/// thread that first uses it, and dropped after any socket error.
#[derive(Debug, Default)]
pub struct NftSocket {
    sock: Option<Socket>,
    rcvbuf: usize,
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

impl NftSocket {
    pub fn new() -> NftSocket {
        NftSocket::default()
    }

    fn socket(&mut self) -> Result<&mut Socket, ExchangeError> {
        if self.sock.is_none() {
            let s = Socket::open(Protocol::Netfilter).map_err(|source| ExchangeError {
                step: "opening a netfilter netlink socket",
                source,
            })?;
            // Without it (kernels before 4.2) error answers just carry the
            // whole failed message: larger, still read.
            let _ = s.set_cap_ack();
            self.sock = Some(s);
            self.rcvbuf = 0;
        }
        self.sock.as_mut().ok_or_else(|| ExchangeError {
            step: "opening a netfilter netlink socket",
            source: io::ErrorKind::NotConnected.into(),
        })
    }

    /// Sends one batch and returns the kernel's answers to it. The socket is
    /// dropped after an error.
    pub fn send_batch(&mut self, batch: &Batch) -> Result<Vec<Ack>, ExchangeError> {
        let r = self.exchange(batch);
        if r.is_err() {
            self.sock = None;
        }
        r
    }

    fn exchange(&mut self, batch: &Batch) -> Result<Vec<Ack>, ExchangeError> {
        // Every message that fails is answered, and the kernel queues the
        // answers before we read: make room for all of them failing (an
        // answer costs well under 1 KiB).
        let want = (batch.len() * 1024).max(1 << 20);
        let grow = want > self.rcvbuf;
        let sock = self.socket()?;
        // Answers left from an interrupted exchange are not ours.
        let _ = queued_acks(sock);
        // Both sizes are best effort: too small a send buffer fails the send
        // below (named there), too small a receive buffer shows as ENOBUFS or
        // missing acks, both reported.
        if grow {
            let _ = sock.set_recv_buffer(want);
        }
        // The whole batch must be one datagram: nfnetlink processes a batch
        // per skb.
        let _ = sock.set_send_buffer(batch.bytes() + 65536);
        let pieces: Vec<std::io::IoSlice<'_>> = batch
            .pieces()
            .iter()
            .map(|p| std::io::IoSlice::new(p))
            .collect();
        sock.send_vectored(&pieces)
            .map_err(|source| ExchangeError {
                step: "sending the nf_tables batch",
                source,
            })?;
        let answers = queued_acks(sock).map_err(|source| ExchangeError {
            step: "reading the kernel's answers to the nf_tables batch (the transaction may or may not have been applied)",
            source,
        })?;
        if grow {
            self.rcvbuf = want;
        }
        let (first, last) = (batch.begin_seq, batch.last_seq());
        Ok(answers
            .into_iter()
            .filter(|a| a.seq.wrapping_sub(first) <= last.wrapping_sub(first))
            .collect())
    }

    /// Sends one nf_tables request (`ty`, low byte) and returns the data
    /// messages of its answer, or the kernel's errno. The socket is dropped
    /// after a socket error.
    pub fn query(
        &mut self,
        family: u8,
        ty: u16,
        flags: u16,
        attrs: &Attrs,
        until: Until,
    ) -> Result<Result<Vec<Reply>, i32>, ExchangeError> {
        let seq = next_seq(1);
        let mut buf = Vec::new();
        put_msg(
            &mut buf,
            nft_type(ty),
            NLM_F_REQUEST | flags,
            seq,
            family,
            0,
            attrs.as_bytes(),
        );
        // Answers left from an interrupted exchange carry other sequence
        // numbers: the request skips them.
        match self.socket()?.request(&buf, seq, until) {
            Ok(replies) => Ok(Ok(replies)),
            Err(Error::Kernel(errno)) => Ok(Err(errno)),
            Err(Error::Io(source)) => {
                self.sock = None;
                Err(ExchangeError {
                    step: "asking the kernel",
                    source,
                })
            }
        }
    }
}

/// Fingerprints of rules as the kernel lists them back, for the dataplanes
/// that adopt what a previous run left: each reduces what it reads and what
/// it would write the same way, with these parts in common.
pub mod fingerprint {
    use std::hash::Hasher;

    use crate::ParsedAttrs;

    /// A payload with its length.
    pub fn bytes(h: &mut impl Hasher, p: &[u8]) {
        h.write_usize(p.len());
        h.write(p);
    }

    /// `NFTA_DATA_*` (a value, or a verdict's code and chain), in type
    /// order, byte for byte.
    pub fn data(h: &mut impl Hasher, b: &[u8]) {
        let mut items: Vec<(u16, &[u8])> = ParsedAttrs::parse(b).iter().collect();
        items.sort_by_key(|(t, _)| *t);
        for (t, p) in items {
            h.write_u16(t);
            if t == 2 {
                let mut v: Vec<(u16, &[u8])> = ParsedAttrs::parse(p).iter().collect();
                v.sort_by_key(|(t, _)| *t);
                for (t, p) in v {
                    h.write_u16(t);
                    bytes(h, p);
                }
            } else {
                bytes(h, p);
            }
        }
    }

    /// One expression's attributes, already reduced, in type order: those
    /// whose type is in `nested` as data, the others byte for byte.
    pub fn attrs(h: &mut impl Hasher, mut items: Vec<(u16, &[u8])>, nested: &[u16]) {
        items.sort_by_key(|(t, _)| *t);
        h.write_usize(items.len());
        for (t, p) in items {
            h.write_u16(t);
            if nested.contains(&t) {
                data(h, p);
            } else {
                bytes(h, p);
            }
        }
    }
}

/// nf_tables expressions, as `NFTA_LIST_ELEM` entries of a rule's
/// expression list. Registers are given as the caller allocates them.
pub mod expr {
    use crate::Attrs;

    use super::NftAttrs;

    /// `NFT_REG_VERDICT`.
    pub const REG_VERDICT: u32 = 0;
    /// The first 16-byte register (`NFT_REG_1`).
    pub const REG_1: u32 = 1;

    pub const PAYLOAD_NETWORK: u32 = 1;
    pub const PAYLOAD_TRANSPORT: u32 = 2;

    pub const META_MARK: u32 = 3;
    pub const META_IIFNAME: u32 = 6;
    pub const META_OIFNAME: u32 = 7;
    pub const META_L4PROTO: u32 = 16;

    pub const VERDICT_DROP: i32 = 0;
    pub const VERDICT_ACCEPT: i32 = 1;
    pub const VERDICT_JUMP: i32 = -3;
    pub const VERDICT_GOTO: i32 = -4;
    pub const VERDICT_RETURN: i32 = -5;

    /// One list element: the expression's name and its data nest, in a
    /// buffer of its own.
    pub fn ex(name: &str, f: impl FnOnce(&mut Attrs)) -> Attrs {
        own(|a| ex_in(a, name, f))
    }

    /// [`ex`] written at the end of `a`. The `_in` functions below write
    /// so: a rule's expressions go straight into its message, with no
    /// buffer per expression (a full iptables sync encodes hundreds of
    /// thousands of rules); the others return the expression in a buffer
    /// of its own.
    pub fn ex_in(a: &mut Attrs, name: &str, f: impl FnOnce(&mut Attrs)) {
        let elem = a.begin_nest(1);
        a.str(1, name);
        let data = a.begin_nest(2);
        f(a);
        a.end_nest(data);
        a.end_nest(elem);
    }

    /// An expression written by `f` in a buffer of its own, with room for
    /// any but an x_tables extension's structure.
    fn own(f: impl FnOnce(&mut Attrs)) -> Attrs {
        let mut a = Attrs::with_capacity(96);
        f(&mut a);
        a
    }

    pub fn payload(base: u32, offset: u32, len: u32, dreg: u32) -> Attrs {
        own(|a| payload_in(a, base, offset, len, dreg))
    }

    pub fn meta_load(key: u32, dreg: u32) -> Attrs {
        own(|a| meta_load_in(a, key, dreg))
    }

    pub fn cmp(sreg: u32, neq: bool, data: &[u8]) -> Attrs {
        own(|a| cmp_in(a, sreg, neq, data))
    }

    pub fn bitwise(reg: u32, mask: &[u8], xor: &[u8]) -> Attrs {
        own(|a| bitwise_in(a, reg, mask, xor))
    }

    pub fn payload_in(out: &mut Attrs, base: u32, offset: u32, len: u32, dreg: u32) {
        ex_in(out, "payload", |a| {
            a.u32be(1, dreg)
                .u32be(2, base)
                .u32be(3, offset)
                .u32be(4, len);
        })
    }

    pub fn meta_load_in(out: &mut Attrs, key: u32, dreg: u32) {
        ex_in(out, "meta", |a| {
            a.u32be(2, key).u32be(1, dreg);
        })
    }

    pub fn cmp_in(out: &mut Attrs, sreg: u32, neq: bool, data: &[u8]) {
        ex_in(out, "cmp", |a| {
            a.u32be(1, sreg).u32be(2, neq as u32).data_value(3, data);
        })
    }

    /// `reg = (reg & mask) ^ xor`.
    pub fn bitwise_in(out: &mut Attrs, reg: u32, mask: &[u8], xor: &[u8]) {
        ex_in(out, "bitwise", |a| {
            a.u32be(1, reg).u32be(2, reg).u32be(3, mask.len() as u32);
            a.data_value(4, mask).data_value(5, xor);
        })
    }

    /// A verdict in the verdict register: `code`, and the chain of a jump or
    /// goto.
    pub fn immediate_verdict_in(out: &mut Attrs, code: i32, chain: Option<&str>) {
        ex_in(out, "immediate", |a| {
            a.u32be(1, REG_VERDICT);
            let d = a.begin_nest(2);
            let v = a.begin_nest(2);
            a.u32be(1, code as u32);
            if let Some(c) = chain {
                a.str(2, c);
            }
            a.end_nest(v);
            a.end_nest(d);
        })
    }

    pub fn counter_in(out: &mut Attrs) {
        ex_in(out, "counter", |a| {
            a.u64be(1, 0).u64be(2, 0);
        })
    }

    /// An x_tables match (`match`) or target (`target`) run by nft_compat:
    /// its name, revision and the extension's own structure.
    pub fn xt_in(out: &mut Attrs, kind: &str, name: &str, rev: u32, info: &[u8]) {
        ex_in(out, kind, |a| {
            a.str(1, name).u32be(2, rev).attr(3, info);
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a panic is its failure
    use super::*;

    /// (type, flags, seq) of every message of `b`, in order.
    fn headers(b: &Batch) -> Vec<(u16, u16, u32)> {
        let mut out = Vec::new();
        for p in b.pieces() {
            let mut at = 0;
            while at + NLMSG_HDRLEN <= p.len() {
                let h = &p[at..at + NLMSG_HDRLEN];
                let len = u32::from_ne_bytes(h[0..4].try_into().unwrap()) as usize;
                out.push((
                    u16::from_ne_bytes(h[4..6].try_into().unwrap()),
                    u16::from_ne_bytes(h[6..8].try_into().unwrap()),
                    u32::from_ne_bytes(h[8..12].try_into().unwrap()),
                ));
                at += crate::align4(len);
            }
        }
        out
    }

    fn batch(first: usize, second: usize) -> Batch {
        let mut a = Attrs::new();
        a.str(1, "t");
        let mut b = Batch::new(100, 64);
        for op in 0..first {
            b.push(op, NFPROTO_IPV4, msg::NEWCHAIN, 0, &a);
        }
        if second > 0 {
            let mut c = Batch::continuation(b.last_seq(), 64);
            for op in first..first + second {
                c.push(op, NFPROTO_IPV4, msg::NEWCHAIN, 0, &a);
            }
            b.append(c);
        }
        b.finish()
    }

    #[test]
    fn only_the_last_message_asks_for_an_acknowledgement() {
        for (first, second) in [(3, 0), (2, 2), (1, 0)] {
            let b = batch(first, second);
            let h = headers(&b);
            assert_eq!(h.len(), first + second + 2, "BEGIN, the messages, END");
            assert_eq!(h[0].0, NFNL_MSG_BATCH_BEGIN);
            assert_eq!(h[h.len() - 1].0, NFNL_MSG_BATCH_END);
            let acked: Vec<u32> = h
                .iter()
                .filter(|m| m.1 & NLM_F_ACK != 0)
                .map(|m| m.2)
                .collect();
            assert_eq!(acked, vec![b.ops.last().unwrap().0], "{first}+{second}");
        }
        // A batch of nothing asks for nothing.
        let h = headers(&batch(0, 0));
        assert!(h.iter().all(|m| m.1 & NLM_F_ACK == 0));
    }

    #[test]
    fn a_batch_applied_only_with_its_last_message_acknowledged_and_no_error() {
        let b = batch(3, 0);
        let (first, last) = (b.ops[0].0, b.ops[2].0);
        let ack = |seq, errno| Ack { seq, errno };
        assert!(refusals(&b, &[ack(last, 0)]).is_empty());
        assert_eq!(refusals(&b, &[]), vec![Refusal::Unacknowledged { sent: 3 }]);
        // An answer to another message is not the confirmation.
        assert_eq!(
            refusals(&b, &[ack(first, 0)]),
            vec![Refusal::Unacknowledged { sent: 3 }]
        );
        assert_eq!(
            refusals(&b, &[ack(b.ops[1].0, libc::EEXIST), ack(last, 0)]),
            vec![Refusal::Op(1, libc::EEXIST)]
        );
        // The commit refused: the error is on BEGIN, the last message still
        // acknowledged.
        assert_eq!(
            refusals(&b, &[ack(last, 0), ack(b.begin_seq, libc::ELOOP)]),
            vec![Refusal::Commit(libc::ELOOP)]
        );
    }
}
