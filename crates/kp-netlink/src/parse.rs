//! Reading what the kernel sends: attributes, the messages of a datagram,
//! and the answer to one request. Never panics on malformed input.

use std::io;

use crate::{align4, NLA_TYPE_MASK, NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN, NLMSG_MIN_TYPE};

/// The attributes of one level, in order: (type without flag bits, payload).
/// Parsing stops at the first attribute whose length does not fit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedAttrs<'a> {
    items: Vec<(u16, &'a [u8])>,
}

impl<'a> ParsedAttrs<'a> {
    pub fn parse(mut b: &'a [u8]) -> ParsedAttrs<'a> {
        let mut items = Vec::new();
        while b.len() >= 4 {
            let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
            let ty = u16::from_ne_bytes([b[2], b[3]]) & NLA_TYPE_MASK;
            if len < 4 || len > b.len() {
                break;
            }
            items.push((ty, &b[4..len]));
            b = &b[align4(len).min(b.len())..];
        }
        ParsedAttrs { items }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u16, &'a [u8])> + '_ {
        self.items.iter().copied()
    }

    /// The payload of the first attribute of type `ty`.
    pub fn get(&self, ty: u16) -> Option<&'a [u8]> {
        self.items.iter().find(|(t, _)| *t == ty).map(|(_, d)| *d)
    }

    pub fn u8(&self, ty: u16) -> Option<u8> {
        self.get(ty)?.first().copied()
    }

    pub fn u16(&self, ty: u16) -> Option<u16> {
        Some(u16::from_ne_bytes(self.get(ty)?.get(..2)?.try_into().ok()?))
    }

    pub fn u32(&self, ty: u16) -> Option<u32> {
        Some(u32::from_ne_bytes(self.get(ty)?.get(..4)?.try_into().ok()?))
    }

    /// The attributes inside nested attribute `ty`.
    pub fn nested(&self, ty: u16) -> Option<ParsedAttrs<'a>> {
        self.get(ty).map(ParsedAttrs::parse)
    }
}

/// One message of a datagram from the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    pub ty: u16,
    pub flags: u16,
    pub seq: u32,
    /// The whole message, header included (what netlink-packet-* decode).
    pub bytes: &'a [u8],
}

impl<'a> Message<'a> {
    /// What follows the netlink header.
    pub fn payload(&self) -> &'a [u8] {
        &self.bytes[NLMSG_HDRLEN..]
    }

    /// For NLMSG_ERROR: the errno (positive), 0 for an acknowledgement.
    pub fn error(&self) -> Option<i32> {
        if self.ty != NLMSG_ERROR {
            return None;
        }
        // `messages` only yields NLMSG_ERROR with the 4-byte code present.
        let code = self.payload().get(..4)?;
        let code = i32::from_ne_bytes([code[0], code[1], code[2], code[3]]);
        Some(code.saturating_neg())
    }
}

/// The messages of one datagram, in order. A header whose length does not fit
/// what is left (or an NLMSG_ERROR too short for its error code) is an error:
/// the datagram cannot be trusted past it. Fewer than 16 trailing bytes are
/// padding.
pub fn messages(buf: &[u8]) -> impl Iterator<Item = io::Result<Message<'_>>> + '_ {
    let mut off = 0usize;
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed || off + NLMSG_HDRLEN > buf.len() {
            return None;
        }
        let h = &buf[off..off + NLMSG_HDRLEN];
        let len = u32::from_ne_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let ty = u16::from_ne_bytes([h[4], h[5]]);
        let flags = u16::from_ne_bytes([h[6], h[7]]);
        let seq = u32::from_ne_bytes([h[8], h[9], h[10], h[11]]);
        let short_error = ty == NLMSG_ERROR && len < NLMSG_HDRLEN + 4;
        if len < NLMSG_HDRLEN || len > buf.len() - off || short_error {
            failed = true;
            return Some(Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "malformed netlink message from the kernel: type {ty}, length {len}, {} bytes left in the datagram",
                    buf.len() - off
                ),
            )));
        }
        let m = Message {
            ty,
            flags,
            seq,
            bytes: &buf[off..off + len],
        };
        off += align4(len);
        Some(Ok(m))
    })
}

/// A data message of an answer, copied out of the receive buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub ty: u16,
    /// The whole message, header included.
    pub bytes: Vec<u8>,
}

impl Reply {
    /// What follows the netlink header.
    pub fn payload(&self) -> &[u8] {
        self.bytes.get(NLMSG_HDRLEN..).unwrap_or_default()
    }
}

/// Where the answer to a request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// At the acknowledgement: the request must carry NLM_F_ACK.
    Ack,
    /// At NLMSG_DONE: a dump (NLM_F_DUMP).
    Done,
}

/// What one message is to the answer of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing for the caller: another request's message (left from an
    /// earlier, interrupted exchange), or an acknowledgement inside a dump.
    Skip,
    /// A data message of the answer.
    Data,
    /// The answer is complete.
    End,
    /// The kernel refused the request with this errno.
    Refused(i32),
}

/// The answer to one request: the messages carrying its sequence number, up
/// to its end (see [`Until`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    pub seq: u32,
    pub until: Until,
}

impl Answer {
    pub fn step(&self, m: &Message<'_>) -> Step {
        if m.seq != self.seq {
            return Step::Skip;
        }
        match m.ty {
            NLMSG_ERROR => match m.error().unwrap_or(0) {
                // An acknowledgement inside a dump (NLM_F_ACK on a dump
                // request) does not end it.
                0 if self.until == Until::Ack => Step::End,
                0 => Step::Skip,
                errno => Step::Refused(errno),
            },
            NLMSG_DONE => Step::End,
            // NLMSG_NOOP, NLMSG_OVERRUN and other reserved control types.
            ty if ty < NLMSG_MIN_TYPE => Step::Skip,
            _ => Step::Data,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(ty: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        crate::push_message(&mut b, ty, 0, seq, &[], payload);
        b
    }

    fn err(seq: u32, code: i32) -> Vec<u8> {
        // struct nlmsgerr: the code, then the failed request's header.
        let mut p = code.to_ne_bytes().to_vec();
        p.extend_from_slice(&[0u8; 16]);
        msg(NLMSG_ERROR, seq, &p)
    }

    /// Follows an answer through a datagram the way `Socket::request`
    /// does: the data payloads, then how it ended (None: not yet).
    fn follow(a: &Answer, buf: &[u8]) -> io::Result<(Vec<Vec<u8>>, Option<Step>)> {
        let mut data = Vec::new();
        for m in messages(buf) {
            let m = m?;
            match a.step(&m) {
                Step::Skip => {}
                Step::Data => data.push(m.payload().to_vec()),
                end => return Ok((data, Some(end))),
            }
        }
        Ok((data, None))
    }

    #[test]
    fn an_ack_ends_a_request_after_its_data() {
        let buf = [
            msg(16, 7, &[1, 2, 3, 4]), // RTM_NEWLINK, ours
            msg(16, 6, &[9, 9, 9, 9]), // an older request's: skipped
            err(7, 0),
            msg(16, 7, &[5, 5, 5, 5]), // after the ack: never read
        ]
        .concat();
        let a = Answer {
            seq: 7,
            until: Until::Ack,
        };
        let (data, end) = follow(&a, &buf).unwrap();
        assert_eq!(end, Some(Step::End));
        assert_eq!(data, vec![vec![1, 2, 3, 4]]);
        let first = messages(&buf).next().unwrap().unwrap();
        assert_eq!((first.ty, first.seq, first.bytes.len()), (16, 7, 20));
    }

    #[test]
    fn an_error_answer_gives_its_errno() {
        let buf = [err(3, -libc::ENOENT), err(4, -libc::EEXIST)].concat();
        let a = Answer {
            seq: 4,
            until: Until::Ack,
        };
        assert_eq!(
            follow(&a, &buf).unwrap().1,
            Some(Step::Refused(libc::EEXIST))
        );
        let m = messages(&buf).next().unwrap().unwrap();
        assert_eq!(m.error(), Some(libc::ENOENT));
        assert_eq!(m.seq, 3);
        // Not an error message: no errno.
        let other = msg(20, 1, &[]);
        assert_eq!(messages(&other).next().unwrap().unwrap().error(), None);
        // A nonsense code cannot overflow.
        let m = err(1, i32::MIN);
        assert_eq!(
            messages(&m).next().unwrap().unwrap().error(),
            Some(i32::MAX)
        );
    }

    #[test]
    fn a_dump_runs_until_done_across_datagrams() {
        let a = Answer {
            seq: 9,
            until: Until::Done,
        };
        let first = [msg(20, 9, &[1; 8]), err(9, 0), msg(20, 9, &[2; 8])].concat();
        let (data, end) = follow(&a, &first).unwrap();
        assert_eq!((data.len(), end), (2, None));
        let done = msg(NLMSG_DONE, 9, &0i32.to_ne_bytes());
        let second = [msg(20, 9, &[3; 8]), done, msg(20, 9, &[4; 8])].concat();
        let (data, end) = follow(&a, &second).unwrap();
        assert_eq!((data, end), (vec![vec![3; 8]], Some(Step::End)));
        // A reserved control type (NLMSG_NOOP) is not data.
        assert_eq!(follow(&a, &msg(1, 9, &[])).unwrap(), (vec![], None));
        // An error at the start of a dump (e.g. ENOENT: no such chain).
        let refused = follow(&a, &err(9, -libc::ENOENT)).unwrap();
        assert_eq!(refused.1, Some(Step::Refused(libc::ENOENT)));
    }

    #[test]
    fn malformed_datagrams_are_errors_never_panics() {
        let good = [msg(20, 1, &[1; 8]), err(1, 0)].concat();
        // Every truncation: some messages, then at most one error, no panic.
        for cut in 0..good.len() {
            let all: Vec<_> = messages(&good[..cut]).collect();
            assert!(all.iter().filter(|m| m.is_err()).count() <= 1);
            let a = Answer {
                seq: 1,
                until: Until::Ack,
            };
            let _ = follow(&a, &good[..cut]);
        }
        // A length past the end, a length below the header, a short error.
        let mut long = msg(20, 1, &[]);
        long[0] = 200;
        assert!(messages(&long).next().unwrap().is_err());
        let mut tiny = msg(20, 1, &[]);
        tiny[0] = 4;
        assert!(messages(&tiny).next().unwrap().is_err());
        let short_err = msg(NLMSG_ERROR, 1, &[0, 0]);
        let e = messages(&short_err).next().unwrap().unwrap_err();
        assert!(e.to_string().contains("malformed netlink message"), "{e}");
        // After an error, nothing more is read.
        let after = [long.clone(), err(1, 0)].concat();
        assert_eq!(messages(&after).count(), 1);
        // Garbage of every length.
        for n in 0..64 {
            let junk = vec![0xa5u8; n];
            let _ = messages(&junk).count();
            let _ = ParsedAttrs::parse(&junk);
        }
    }

    #[test]
    fn truncated_attributes_stop_parsing() {
        // Length field larger than the buffer: ignored, not a panic.
        assert!(ParsedAttrs::parse(&[200u8, 0, 1, 0, 1, 2]).is_empty());
        assert!(ParsedAttrs::parse(&[1, 0]).is_empty());
        // A length below the attribute header stops too.
        assert!(ParsedAttrs::parse(&[2, 0, 1, 0, 8, 0, 1, 0]).is_empty());
        // The attributes before a bad one are kept; the last one's padding
        // may be missing.
        let b = [8u8, 0, 1, 0, 1, 0, 0, 0, 5, 0, 2, 0, 7, 0xff, 0xff];
        let p = ParsedAttrs::parse(&b);
        assert_eq!(p.len(), 2);
        assert_eq!(p.u32(1), Some(1));
        assert_eq!(p.u8(2), Some(7));
        // Too short for the asked width: None, not a panic.
        assert_eq!(p.u16(2), None);
        assert_eq!(p.u32(3), None);
        assert!(p.nested(2).expect("present").is_empty());
        // Flag bits are not part of the type.
        let n = [4u8, 0, 3, 0xc0];
        assert_eq!(ParsedAttrs::parse(&n).iter().next(), Some((3, &[][..])));
    }
}
