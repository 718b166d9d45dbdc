//! Building messages: attributes with nests, and the framing around them.

use crate::{align4, NLA_F_NESTED, NLMSG_HDRLEN};

/// Netlink attributes (struct nlattr: length, type, payload padded to 4),
/// host byte order unless a method says big-endian.
#[derive(Default, Debug, Clone, PartialEq, Eq)]
pub struct Attrs {
    buf: Vec<u8>,
}

/// An open nested attribute: where its header is. Close it with
/// [`Attrs::end_nest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a nest must be closed with Attrs::end_nest"]
pub struct Nest(usize);

impl Attrs {
    pub const fn new() -> Attrs {
        Attrs { buf: Vec::new() }
    }

    /// Empty, with room for `bytes`: a buffer grown from nothing is
    /// reallocated several times, and a full sync at 10k Services builds
    /// ~10 expressions for each of 480k rules.
    pub fn with_capacity(bytes: usize) -> Attrs {
        Attrs {
            buf: Vec::with_capacity(bytes),
        }
    }

    /// Emptied, its room kept: one buffer serves message after message.
    pub fn clear(&mut self) {
        self.buf.clear();
    }

    /// The encoded attributes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    fn pad(&mut self) {
        self.buf.resize(align4(self.buf.len()), 0);
    }

    /// One attribute with `data` as its payload.
    pub fn attr(&mut self, ty: u16, data: &[u8]) -> &mut Self {
        self.header(ty, data.len());
        self.buf.extend_from_slice(data);
        self.pad();
        self
    }

    /// struct nlattr for a payload of `len` bytes that follows.
    fn header(&mut self, ty: u16, len: usize) {
        self.buf
            .extend_from_slice(&((4 + len) as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
    }

    pub fn u8(&mut self, ty: u16, v: u8) -> &mut Self {
        self.attr(ty, &[v])
    }
    pub fn u16(&mut self, ty: u16, v: u16) -> &mut Self {
        self.attr(ty, &v.to_ne_bytes())
    }
    pub fn u32(&mut self, ty: u16, v: u32) -> &mut Self {
        self.attr(ty, &v.to_ne_bytes())
    }
    pub fn u32be(&mut self, ty: u16, v: u32) -> &mut Self {
        self.attr(ty, &v.to_be_bytes())
    }
    pub fn u64be(&mut self, ty: u16, v: u64) -> &mut Self {
        self.attr(ty, &v.to_be_bytes())
    }
    /// NUL-terminated string, as the kernel's NLA_STRING / NLA_NUL_STRING
    /// policies expect.
    pub fn str(&mut self, ty: u16, s: &str) -> &mut Self {
        // Written in place, NUL and all: no copy of the string first.
        self.header(ty, s.len() + 1);
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
        self.pad();
        self
    }

    /// Opens a nested attribute (type flagged NLA_F_NESTED); everything added
    /// until [`Attrs::end_nest`] goes inside it.
    pub fn begin_nest(&mut self, ty: u16) -> Nest {
        let at = self.buf.len();
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        Nest(at)
    }

    /// Closes `nest`: its length becomes everything written since it opened.
    /// Netlink lengths are 16 bits: callers keep a nest under 64 KiB
    /// (nftables writes at most 128 elements per message); a longer one
    /// would be malformed, which the kernel refuses (the whole transaction
    /// fails, nothing half-applied), so it is caught here in debug builds.
    pub fn end_nest(&mut self, nest: Nest) -> &mut Self {
        debug_assert!(
            self.buf.len() - nest.0 <= u16::MAX as usize,
            "netlink nest of {} bytes",
            self.buf.len() - nest.0
        );
        let len = (self.buf.len() - nest.0) as u16;
        self.buf[nest.0..nest.0 + 2].copy_from_slice(&len.to_ne_bytes());
        self
    }

    /// A nested attribute whose contents `f` adds.
    pub fn nest(&mut self, ty: u16, f: impl FnOnce(&mut Attrs)) -> &mut Self {
        let n = self.begin_nest(ty);
        f(self);
        self.end_nest(n)
    }

    /// Appends attributes built separately (at this level, or inside an open
    /// nest).
    pub fn extend(&mut self, other: &Attrs) -> &mut Self {
        self.buf.extend_from_slice(&other.buf);
        self
    }
}

/// Appends one message to `out` (a batch, or an empty buffer): the netlink
/// header (pid 0: the kernel fills it in), `fixed` (the protocol's own header,
/// padded to 4) and `attrs`, then pads to 4 for the next message.
pub fn push_message(out: &mut Vec<u8>, ty: u16, flags: u16, seq: u32, fixed: &[u8], attrs: &[u8]) {
    let len = NLMSG_HDRLEN + align4(fixed.len()) + attrs.len();
    out.reserve(align4(len));
    out.extend_from_slice(&(len as u32).to_ne_bytes());
    out.extend_from_slice(&ty.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(fixed);
    out.resize(align4(out.len()), 0);
    out.extend_from_slice(attrs);
    out.resize(align4(out.len()), 0);
}

/// One complete message; see [`push_message`].
pub fn message(ty: u16, flags: u16, seq: u32, fixed: &[u8], attrs: &Attrs) -> Vec<u8> {
    let mut out = Vec::new();
    push_message(&mut out, ty, flags, seq, fixed, attrs.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ParsedAttrs, NLM_F_ACK, NLM_F_REQUEST};

    #[test]
    fn nested_attributes_are_framed_and_padded() {
        let mut a = Attrs::new();
        a.nest(1, |a| {
            a.u16(1, 2).str(6, "rr");
        });
        let b = message(0x10, NLM_F_REQUEST | NLM_F_ACK, 7, &[3, 1, 0, 0], &a);
        let want: Vec<u8> = [
            &40u32.to_ne_bytes()[..],
            &0x10u16.to_ne_bytes(),
            &5u16.to_ne_bytes(),
            &7u32.to_ne_bytes(),
            &0u32.to_ne_bytes(),
            &[3, 1, 0, 0],
            // nest: len 20, type 1|NESTED
            &20u16.to_ne_bytes(),
            &0x8001u16.to_ne_bytes(),
            &6u16.to_ne_bytes(),
            &1u16.to_ne_bytes(),
            &2u16.to_ne_bytes(),
            &[0, 0],
            &7u16.to_ne_bytes(),
            &6u16.to_ne_bytes(),
            b"rr\0",
            &[0],
        ]
        .concat();
        assert_eq!(b, want);
        let top = ParsedAttrs::parse(&b[20..]);
        assert_eq!(top.len(), 1);
        let inner = top.nested(1).expect("the nest parses");
        assert_eq!(inner.u16(1), Some(2));
        assert_eq!(inner.get(6), Some(&b"rr\0"[..]));
    }

    #[test]
    fn nests_nest_and_tokens_close_the_right_one() {
        let mut a = Attrs::new();
        let outer = a.begin_nest(3);
        let inner = a.begin_nest(1);
        a.u32be(3, 1).u8(2, 9);
        a.end_nest(inner);
        a.u64be(4, 0x0102_0304_0506_0708);
        a.end_nest(outer);
        let b = a.as_bytes();
        // outer: 4 + inner (4 + 8 + 8) + 12
        assert_eq!(b.len(), 36);
        assert_eq!(&b[0..4], &[36, 0, 3, 0x80]);
        assert_eq!(&b[4..8], &[20, 0, 1, 0x80]);
        assert_eq!(&b[8..16], &[8, 0, 3, 0, 0, 0, 0, 1]);
        // A one-byte payload: length 5, padded to 8.
        assert_eq!(&b[16..24], &[5, 0, 2, 0, 9, 0, 0, 0]);
        assert_eq!(&b[24..36], &[12, 0, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
        let top = ParsedAttrs::parse(b);
        let outer = top.nested(3).expect("outer");
        assert_eq!(outer.get(4), Some(&[1, 2, 3, 4, 5, 6, 7, 8][..]));
        let inner = outer.nested(1).expect("inner");
        assert_eq!(inner.u8(2), Some(9));
        assert_eq!(inner.get(3), Some(&[0, 0, 0, 1][..]));
    }

    #[test]
    fn message_lengths_and_padding() {
        // No fixed header, no attributes: the bare header.
        let b = message(3, 0, 1, &[], &Attrs::new());
        assert_eq!(b.len(), 16);
        assert_eq!(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]), 16);
        // A 3-byte fixed header is padded before the attributes and counts
        // padded in the length.
        let mut a = Attrs::new();
        a.u8(1, 7);
        let b = message(3, 0, 1, &[1, 2, 3], &a);
        assert_eq!(b.len(), 16 + 4 + 8);
        assert_eq!(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]), 28);
        assert_eq!(&b[16..20], &[1, 2, 3, 0]);
        // Unaligned raw attribute bytes (nft userdata style): the length
        // leaves the trailing padding out, the buffer still ends aligned.
        let mut batch = Vec::new();
        push_message(&mut batch, 16, 1, 5, &[0, 0, 0, 10], &[1, 2, 3]);
        assert_eq!(
            u32::from_ne_bytes([batch[0], batch[1], batch[2], batch[3]]),
            23
        );
        assert_eq!(batch.len(), 24);
        push_message(&mut batch, 17, 1, 6, &[0, 0, 0, 10], &[]);
        assert_eq!(batch.len(), 44);
        assert_eq!(u16::from_ne_bytes([batch[28], batch[29]]), 17);
        // extend appends another buffer's attributes as they are.
        let mut x = Attrs::new();
        x.str(1, "t");
        let mut y = Attrs::new();
        y.extend(&x).extend(&x);
        assert_eq!(y.len(), 16);
        assert_eq!(ParsedAttrs::parse(y.as_bytes()).len(), 2);
    }
}
