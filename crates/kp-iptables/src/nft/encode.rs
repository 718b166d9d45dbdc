//! A parsed rule as the nf_tables expressions iptables-nft 1.8 writes for it,
//! so that `iptables-save` (nft) reads our rules back as its own and prints
//! upstream's text. Learnt from iptables' nft-ipv4.c, nft-ipv6.c,
//! nft-shared.c and nft.c, and pinned by tests/nft_roundtrip.rs, which
//! compares what this writes with what `iptables-nft-restore` installs.
//!
//! - The fixed fields become native expressions, in iptables' order: input
//!   and output interface, protocol, source, destination.
//! - Matches follow in their order. `tcp`/`udp` with a port and `mark` are
//!   native (payload or meta, bitwise, cmp); the others are x_tables matches
//!   run by nft_compat (`match` with the extension's own structure).
//! - A counter, then the verdict: native for ACCEPT/DROP/RETURN and chains,
//!   an x_tables target (`target`) for DNAT, MASQUERADE, MARK and REJECT.

use std::net::IpAddr;

use ipnet::IpNet;
use kp_netlink::nftables::expr::{
    bitwise_in, cmp_in, counter_in, immediate_verdict_in, meta_load_in, payload_in, xt_in,
    META_IIFNAME, META_L4PROTO, META_MARK, META_OIFNAME, PAYLOAD_NETWORK, PAYLOAD_TRANSPORT, REG_1,
    VERDICT_ACCEPT, VERDICT_DROP, VERDICT_JUMP, VERDICT_RETURN,
};
use kp_netlink::Attrs;

use super::rule::{Addr, Iface, Match, Recent, Rule, Target, IPPROTO_SCTP};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn addr_len(self) -> usize {
        match self {
            Family::V4 => 4,
            Family::V6 => 16,
        }
    }

    /// Offsets of the source and destination address in the IP header.
    fn addr_offsets(self) -> (u32, u32) {
        match self {
            Family::V4 => (12, 16),
            Family::V6 => (8, 24),
        }
    }
}

/// x_tables structures are padded to 8 bytes (XT_ALIGN on x86-64).
fn xt_align(mut v: Vec<u8>) -> Vec<u8> {
    v.resize(v.len().div_ceil(8) * 8, 0);
    v
}

fn iface(out: &mut Attrs, key: u32, i: &Iface) {
    meta_load_in(out, key, REG_1);
    // A `+` prefix compares the name's bytes only; a full name includes
    // the NUL, so that "eth0" does not match "eth01".
    let mut bytes = i.name.as_bytes().to_vec();
    if !i.prefix {
        bytes.push(0);
    }
    cmp_in(out, REG_1, i.negate, &bytes);
}

/// The address's bytes: the first 4 (IPv4) or all 16 of the result.
fn addr_bytes(ip: IpAddr, fam: Family) -> Result<([u8; 16], usize), String> {
    let mut v = [0; 16];
    match (ip, fam) {
        (IpAddr::V4(a), Family::V4) => v[..4].copy_from_slice(&a.octets()),
        (IpAddr::V6(a), Family::V6) => v = a.octets(),
        _ => return Err(format!("address {ip} is not of the table's family")),
    }
    Ok((v, fam.addr_len()))
}

/// iptables' add_addr: a whole-byte prefix loads just its bytes; any other
/// mask loads the address and masks it.
fn address(out: &mut Attrs, fam: Family, offset: u32, a: &Addr) -> Result<(), String> {
    let plen = a.net.prefix_len() as usize;
    if plen == 0 {
        if a.negate {
            return Err("`! -s/-d` of a /0 matches nothing".into());
        }
        // iptables leaves 0.0.0.0/0 out altogether.
        return Ok(());
    }
    let (buf, len) = addr_bytes(a.net.addr(), fam)?;
    let bytes = &buf[..len];
    if plen.is_multiple_of(8) {
        let n = plen / 8;
        payload_in(out, PAYLOAD_NETWORK, offset, n as u32, REG_1);
        cmp_in(out, REG_1, a.negate, &bytes[..n]);
    } else {
        let mask = match a.net {
            IpNet::V4(n) => n.netmask().octets().to_vec(),
            IpNet::V6(n) => n.netmask().octets().to_vec(),
        };
        payload_in(out, PAYLOAD_NETWORK, offset, len as u32, REG_1);
        bitwise_in(out, REG_1, &mask, &[0; 16][..len]);
        cmp_in(out, REG_1, a.negate, bytes);
    }
    Ok(())
}

fn comment(text: &str) -> Result<[u8; 256], String> {
    // struct xt_comment_info { char comment[256]; }
    if text.len() > 255 {
        return Err("comment longer than 255 bytes".into());
    }
    let mut v = [0; 256];
    v[..text.len()].copy_from_slice(text.as_bytes());
    Ok(v)
}

/// struct xt_tcp (12 bytes: ports, option, flags, invflags) or xt_udp (10:
/// ports, invflags) with every port: what `-m tcp` alone holds, padded.
fn any_ports() -> [u8; 16] {
    let mut v = [0; 16];
    for (i, x) in [0u16, 0xffff, 0, 0xffff].into_iter().enumerate() {
        v[2 * i..2 * i + 2].copy_from_slice(&x.to_ne_bytes());
    }
    v
}

/// struct xt_sctp_info with `--dport`, as libxt_sctp leaves it: ports not
/// given unset (zero, unused without XT_SCTP_SRC_PORTS) and the four flag
/// slots' chunk types 0xff.
fn sctp(dport: Option<u16>) -> Vec<u8> {
    let mut v = Vec::with_capacity(296);
    let p = dport.unwrap_or(0);
    for x in [p, p, 0, 0] {
        v.extend_from_slice(&x.to_ne_bytes());
    }
    // chunkmap[64], chunk_match_type.
    v.resize(8 + 256 + 4, 0);
    // flag_info[4]: chunktype, flag, flag_mask.
    for _ in 0..4 {
        v.extend_from_slice(&[0xff, 0, 0]);
    }
    v.extend_from_slice(&0i32.to_ne_bytes()); // flag_count
                                              // flags: XT_SCTP_DEST_PORTS; invflags 0.
    let flags: u32 = if dport.is_some() { 0x02 } else { 0 };
    v.extend_from_slice(&flags.to_ne_bytes());
    v.extend_from_slice(&0u32.to_ne_bytes());
    xt_align(v)
}

/// struct xt_statistic_info in random mode: mode and flags (u16 each,
/// XT_STATISTIC_MODE_RANDOM and 0), the union `u` (the probability, in the
/// place of u.nth.every; packet; count), then the kernel's `master`
/// pointer, left zero.
fn statistic(probability: u32) -> [u8; 24] {
    let mut v = [0; 24];
    v[4..8].copy_from_slice(&probability.to_ne_bytes());
    // libxt_statistic sets u.nth.count = every - packet whatever the mode;
    // in random mode `every` is the probability's place.
    v[12..16].copy_from_slice(&probability.to_ne_bytes());
    v
}

/// struct xt_recent_mtinfo_v1: seconds, hit_count, check_set, invert,
/// name[200], side, then the address mask (all ones: whole addresses).
fn recent(r: &Recent) -> Result<Vec<u8>, String> {
    if r.name.len() >= 200 {
        return Err("recent list name longer than 199 bytes".into());
    }
    let mut v = Vec::with_capacity(232);
    v.extend_from_slice(&r.seconds.to_ne_bytes());
    v.extend_from_slice(&0u32.to_ne_bytes());
    v.push(r.flags);
    v.push(0);
    let mut name = r.name.as_bytes().to_vec();
    name.resize(200, 0);
    v.extend_from_slice(&name);
    v.push(0); // XT_RECENT_SOURCE
    v.push(0); // padding before the mask
               // libxt_recent sets the whole union to ones, for IPv4 too.
    v.extend_from_slice(&[0xff; 16]);
    Ok(xt_align(v))
}

/// struct xt_addrtype_info_v1.
fn addrtype(src: Option<(bool, u16)>, dst: Option<(bool, u16)>) -> Vec<u8> {
    let mut flags = 0u32;
    if src.is_some_and(|(n, _)| n) {
        flags |= 0x1;
    }
    if dst.is_some_and(|(n, _)| n) {
        flags |= 0x2;
    }
    let mut v = Vec::with_capacity(8);
    v.extend_from_slice(&src.map_or(0, |(_, t)| t).to_ne_bytes());
    v.extend_from_slice(&dst.map_or(0, |(_, t)| t).to_ne_bytes());
    v.extend_from_slice(&flags.to_ne_bytes());
    v
}

/// struct xt_conntrack_mtinfo3 with only `--ctstate` set.
fn conntrack(negate: bool, states: u16) -> Vec<u8> {
    // Eight addresses and masks, expires min/max, l4proto, four ports.
    let mut v = vec![0u8; 8 * 16 + 8 + 2 + 8];
    const XT_CONNTRACK_STATE: u16 = 1;
    v.extend_from_slice(&XT_CONNTRACK_STATE.to_ne_bytes()); // match_flags
    v.extend_from_slice(&(if negate { XT_CONNTRACK_STATE } else { 0 }).to_ne_bytes());
    v.extend_from_slice(&states.to_ne_bytes()); // state_mask
    v.resize(164, 0); // status_mask, high ports, padding
    xt_align(v)
}

/// struct xt_nfacct_match_info_v1 (revision 1, what iptables 1.8 picks):
/// name[NFACCT_NAME_MAX = 32], then the kernel's pointer to the object,
/// left zero.
fn nfacct(name: &str) -> Result<[u8; 40], String> {
    if name.is_empty() || name.len() >= 32 {
        return Err(format!("nfacct name {name:?} is not 1-31 bytes"));
    }
    let mut v = [0; 40];
    v[..name.len()].copy_from_slice(name.as_bytes());
    Ok(v)
}

/// struct nf_nat_range2 for DNAT (revision 2): flags, min and max address
/// (16 bytes each), min and max port, base_proto, padded to 48.
fn dnat(addr: IpAddr, port: Option<u16>, fam: Family) -> Result<[u8; 48], String> {
    // NF_NAT_RANGE_MAP_IPS, NF_NAT_RANGE_PROTO_SPECIFIED.
    let flags: u32 = if port.is_some() { 1 | 2 } else { 1 };
    // Unused bytes of an IPv4 address stay zero, as in the union.
    let (a, _) = addr_bytes(addr, fam)?;
    let p = port.unwrap_or(0).to_be_bytes();
    let mut v = [0; 48];
    v[0..4].copy_from_slice(&flags.to_ne_bytes());
    v[4..20].copy_from_slice(&a);
    v[20..36].copy_from_slice(&a);
    v[36..38].copy_from_slice(&p);
    v[38..40].copy_from_slice(&p);
    Ok(v)
}

/// MASQUERADE, revision 0: IPv4's nf_nat_ipv4_multi_range_compat (one
/// range), IPv6's nf_nat_range.
fn masquerade(random_fully: bool, fam: Family) -> Vec<u8> {
    let flags: u32 = if random_fully { 1 << 4 } else { 0 };
    let mut v = Vec::new();
    match fam {
        Family::V4 => {
            v.extend_from_slice(&1u32.to_ne_bytes()); // rangesize
            v.extend_from_slice(&flags.to_ne_bytes());
            v.resize(20, 0);
        }
        Family::V6 => {
            v.extend_from_slice(&flags.to_ne_bytes());
            v.resize(40, 0);
        }
    }
    xt_align(v)
}

/// REJECT's default: ICMP port unreachable (ipt_reject_with 3,
/// ip6t_reject_with 4).
fn reject(fam: Family) -> Vec<u8> {
    let with: u32 = match fam {
        Family::V4 => 3,
        Family::V6 => 4,
    };
    xt_align(with.to_ne_bytes().to_vec())
}

/// The expression list of `r` for a table of family `fam`.
pub fn encode(r: &Rule, fam: Family) -> Result<Attrs, String> {
    // Room for the rules render.rs writes (a comment's structure alone is
    // 256 bytes): one allocation for most.
    let mut exprs = Attrs::with_capacity(768);
    encode_into(&mut exprs, r, fam)?;
    Ok(exprs)
}

/// [`encode`]'s expressions written at the end of `out` (the expression
/// list of a rule message being built).
pub fn encode_into(out: &mut Attrs, r: &Rule, fam: Family) -> Result<(), String> {
    if let Some(i) = &r.in_iface {
        iface(out, META_IIFNAME, i);
    }
    if let Some(i) = &r.out_iface {
        iface(out, META_OIFNAME, i);
    }
    if let Some(p) = r.proto {
        meta_load_in(out, META_L4PROTO, REG_1);
        cmp_in(out, REG_1, false, &[p]);
    }
    let (src_off, dst_off) = fam.addr_offsets();
    if let Some(a) = &r.src {
        address(out, fam, src_off, a)?;
    }
    if let Some(a) = &r.dst {
        address(out, fam, dst_off, a)?;
    }
    for m in &r.matches {
        match m {
            Match::Comment(c) => {
                xt_in(out, "match", "comment", 0, &comment(c)?);
            }
            Match::Ports { proto, dport } => {
                if *proto == IPPROTO_SCTP {
                    xt_in(out, "match", "sctp", 0, &sctp(*dport));
                } else {
                    if r.proto != Some(*proto) {
                        return Err("a port match needs its `-p`".into());
                    }
                    match dport {
                        Some(p) => {
                            payload_in(out, PAYLOAD_TRANSPORT, 2, 2, REG_1);
                            cmp_in(out, REG_1, false, &p.to_be_bytes());
                        }
                        None => {
                            let name = if *proto == super::rule::IPPROTO_TCP {
                                "tcp"
                            } else {
                                "udp"
                            };
                            xt_in(out, "match", name, 0, &any_ports());
                        }
                    }
                }
            }
            Match::Random { probability } => {
                xt_in(out, "match", "statistic", 0, &statistic(*probability));
            }
            Match::Recent(rc) => {
                xt_in(out, "match", "recent", 1, &recent(rc)?);
            }
            Match::AddrType { src, dst } => {
                xt_in(out, "match", "addrtype", 1, &addrtype(*src, *dst));
            }
            Match::CtState { negate, states } => {
                xt_in(out, "match", "conntrack", 3, &conntrack(*negate, *states));
            }
            Match::Mark {
                negate,
                value,
                mask,
            } => {
                meta_load_in(out, META_MARK, REG_1);
                if *mask != u32::MAX {
                    bitwise_in(out, REG_1, &mask.to_ne_bytes(), &[0; 4]);
                }
                cmp_in(out, REG_1, *negate, &value.to_ne_bytes());
            }
            Match::Nfacct(name) => {
                xt_in(out, "match", "nfacct", 1, &nfacct(name)?);
            }
        }
    }
    counter_in(out);
    match &r.target {
        Target::None => {}
        Target::Accept => {
            immediate_verdict_in(out, VERDICT_ACCEPT, None);
        }
        Target::Drop => {
            immediate_verdict_in(out, VERDICT_DROP, None);
        }
        Target::Return => {
            immediate_verdict_in(out, VERDICT_RETURN, None);
        }
        Target::Jump(c) => {
            immediate_verdict_in(out, VERDICT_JUMP, Some(c));
        }
        Target::Reject => {
            xt_in(out, "target", "REJECT", 0, &reject(fam));
        }
        Target::Dnat { addr, port } => {
            xt_in(out, "target", "DNAT", 2, &dnat(*addr, *port, fam)?);
        }
        Target::Masquerade { random_fully } => {
            xt_in(
                out,
                "target",
                "MASQUERADE",
                0,
                &masquerade(*random_fully, fam),
            );
        }
        Target::Mark { mark, mask } => {
            let mut v = mark.to_ne_bytes().to_vec();
            v.extend_from_slice(&mask.to_ne_bytes());
            xt_in(out, "target", "MARK", 2, &v);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structures_have_the_kernels_sizes() {
        // XT_ALIGN(sizeof(...)) on x86-64, as nft_compat checks them.
        assert_eq!(comment("x").unwrap().len(), 256);
        assert_eq!(any_ports().len(), 16);
        assert_eq!(sctp(Some(80)).len(), 296);
        assert_eq!(statistic(1).len(), 24);
        let r = Recent {
            name: "KUBE-SEP-X".into(),
            flags: 1,
            seconds: 10800,
        };
        assert_eq!(recent(&r).unwrap().len(), 232);
        assert_eq!(addrtype(None, Some((false, 4))).len(), 8);
        assert_eq!(conntrack(false, 8).len(), 168);
        assert_eq!(
            dnat("10.0.0.1".parse().unwrap(), Some(80), Family::V4)
                .unwrap()
                .len(),
            48
        );
        assert_eq!(masquerade(true, Family::V4).len(), 24);
        assert_eq!(masquerade(true, Family::V6).len(), 40);
        assert_eq!(reject(Family::V4).len(), 8);
        assert_eq!(nfacct("ct_state_invalid_dropped_pkts").unwrap().len(), 40);
        assert!(nfacct(&"x".repeat(32)).is_err());
    }

    #[test]
    fn conntrack_state_bits_land_in_their_fields() {
        let v = conntrack(true, 0x86);
        assert_eq!(&v[146..152], &[1, 0, 1, 0, 0x86, 0]);
    }
}
