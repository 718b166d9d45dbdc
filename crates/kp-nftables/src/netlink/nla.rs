//! nfnetlink framing and the nf_tables specifics of attribute encoding; the
//! attributes themselves are kp-netlink's.

use kp_netlink::Attrs;

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
    kp_netlink::push_message(out, ty, flags, seq, &[family, 0, r0, r1], attrs);
}

/// nft's userdata TLV: one byte type, one byte length, value.
pub fn udata(out: &mut Vec<u8>, ty: u8, value: &[u8]) {
    out.push(ty);
    out.push(value.len() as u8);
    out.extend_from_slice(value);
}
