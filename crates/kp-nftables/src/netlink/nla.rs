//! Netlink message and attribute encoding (nfnetlink framing).

pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_APPEND: u16 = 0x800;
const NLA_F_NESTED: u16 = 0x8000;

pub const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub const NFNL_MSG_BATCH_BEGIN: u16 = 16;
pub const NFNL_MSG_BATCH_END: u16 = 17;

/// nf_tables message types (low byte; the subsystem goes in the high byte).
pub mod msg {
    pub const NEWTABLE: u16 = 0;
    pub const GETTABLE: u16 = 1;
    pub const DELTABLE: u16 = 2;
    pub const NEWCHAIN: u16 = 3;
    pub const DELCHAIN: u16 = 5;
    pub const NEWRULE: u16 = 6;
    pub const GETRULE: u16 = 7;
    pub const DELRULE: u16 = 8;
    pub const NEWSET: u16 = 9;
    pub const DELSET: u16 = 11;
    pub const NEWSETELEM: u16 = 12;
    pub const DELSETELEM: u16 = 14;
}

/// A buffer of netlink attributes; nests are opened and closed in place.
#[derive(Default, Debug, Clone)]
pub struct Attrs {
    pub buf: Vec<u8>,
}

impl Attrs {
    pub fn bytes(&mut self, ty: u16, data: &[u8]) -> &mut Self {
        let len = 4 + data.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.pad();
        self
    }
    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }
    pub fn u32be(&mut self, ty: u16, v: u32) -> &mut Self {
        self.bytes(ty, &v.to_be_bytes())
    }
    pub fn u64be(&mut self, ty: u16, v: u64) -> &mut Self {
        self.bytes(ty, &v.to_be_bytes())
    }
    pub fn u8(&mut self, ty: u16, v: u8) -> &mut Self {
        self.bytes(ty, &[v])
    }
    /// NUL-terminated string, as the kernel's NLA_STRING policies expect.
    pub fn str(&mut self, ty: u16, s: &str) -> &mut Self {
        let mut d = Vec::with_capacity(s.len() + 1);
        d.extend_from_slice(s.as_bytes());
        d.push(0);
        self.bytes(ty, &d)
    }
    /// Opens a nested attribute; close it with [`Attrs::end`].
    pub fn begin(&mut self, ty: u16) -> usize {
        let at = self.buf.len();
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        at
    }
    pub fn end(&mut self, at: usize) {
        let len = (self.buf.len() - at) as u16;
        self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }
    /// A nest holding one `NFTA_DATA_VALUE`.
    pub fn data_value(&mut self, ty: u16, value: &[u8]) -> &mut Self {
        let n = self.begin(ty);
        self.bytes(1, value);
        self.end(n);
        self
    }
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
    let len = 16 + 4 + attrs.len();
    out.extend_from_slice(&(len as u32).to_ne_bytes());
    out.extend_from_slice(&ty.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.push(family);
    out.push(0);
    out.extend_from_slice(&res_id.to_be_bytes());
    out.extend_from_slice(attrs);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

/// nft's userdata TLV: one byte type, one byte length, value.
pub fn udata(out: &mut Vec<u8>, ty: u8, value: &[u8]) {
    out.push(ty);
    out.push(value.len() as u8);
    out.extend_from_slice(value);
}
