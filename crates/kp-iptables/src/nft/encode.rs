//! A typed rule as the nf_tables expressions iptables-nft 1.8 writes for it,
//! so that `iptables-save` (nft) reads our rules back as its own and prints
//! upstream's text. Learnt from iptables' nft-ipv4.c, nft-ipv6.c,
//! nft-shared.c and nft.c, and pinned by tests/nft_roundtrip.rs, which
//! compares what this writes with what `iptables-nft-restore` installs.
//!
//! - The fixed fields (`-i`, `-p`, `-s`, `-d`, wherever the rule's text puts
//!   them) become native expressions first, in iptables' order: input
//!   interface, protocol, source, destination.
//! - Matches follow in their order. `tcp`/`udp` with a port and `mark` are
//!   native (payload or meta, bitwise, cmp); the others are x_tables matches
//!   run by nft_compat (`match` with the extension's own structure).
//! - A counter, then the verdict: native for ACCEPT/DROP/RETURN and chains,
//!   an x_tables target (`target`) for DNAT, MASQUERADE, MARK and REJECT.

use std::net::{IpAddr, SocketAddr};
use std::sync::OnceLock;

use ipnet::IpNet;
use kp_model::Protocol;
use kp_netlink::nftables::expr::{
    bitwise_in, cmp_in, counter_in, immediate_verdict_in, meta_load_in, payload_in, xt_in,
    META_IIFNAME, META_L4PROTO, META_MARK, PAYLOAD_NETWORK, PAYLOAD_TRANSPORT, REG_1,
    VERDICT_ACCEPT, VERDICT_DROP, VERDICT_JUMP, VERDICT_RETURN,
};
use kp_netlink::Attrs;

use crate::types::{probability, Addr, Iface, Match, Recent, Rule, Target};

/// A rule iptables-nft could not hold as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("address {0} is not of the table's family")]
    Family(IpAddr),
    #[error("`! -s/-d` of a /0 matches nothing")]
    NegatedAny,
    #[error("{0} given twice in one rule")]
    Twice(&'static str),
    #[error("comment longer than 255 bytes")]
    Comment,
    #[error("recent list name {0:?} longer than 199 bytes")]
    RecentName(String),
    #[error("nfacct name {0:?} is not 1-31 bytes")]
    NfacctName(String),
}

/// xt_recent's check_set bits.
const RECENT_CHECK: u8 = 1;
const RECENT_SET: u8 = 2;
const RECENT_REAP: u8 = 32;
/// `RTN_LOCAL` as an xt_addrtype bit.
const ADDRTYPE_LOCAL: u16 = 1 << 2;

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
fn addr_bytes(ip: IpAddr, fam: Family) -> Result<([u8; 16], usize), EncodeError> {
    let mut v = [0; 16];
    match (ip, fam) {
        (IpAddr::V4(a), Family::V4) => v[..4].copy_from_slice(&a.octets()),
        (IpAddr::V6(a), Family::V6) => v = a.octets(),
        _ => return Err(EncodeError::Family(ip)),
    }
    Ok((v, fam.addr_len()))
}

/// iptables' add_addr: a whole-byte prefix loads just its bytes; any other
/// mask loads the address and masks it. Host bits are cleared, as iptables
/// stores the address.
fn address(out: &mut Attrs, fam: Family, offset: u32, a: &Addr) -> Result<(), EncodeError> {
    let net = a.net.trunc();
    let plen = net.prefix_len() as usize;
    if plen == 0 {
        if a.negate {
            return Err(EncodeError::NegatedAny);
        }
        // iptables leaves 0.0.0.0/0 out altogether.
        return Ok(());
    }
    let (buf, len) = addr_bytes(net.addr(), fam)?;
    let bytes = &buf[..len];
    if plen.is_multiple_of(8) {
        let n = plen / 8;
        payload_in(out, PAYLOAD_NETWORK, offset, n as u32, REG_1);
        cmp_in(out, REG_1, a.negate, &bytes[..n]);
    } else {
        let mask = match net {
            IpNet::V4(n) => n.netmask().octets().to_vec(),
            IpNet::V6(n) => n.netmask().octets().to_vec(),
        };
        payload_in(out, PAYLOAD_NETWORK, offset, len as u32, REG_1);
        bitwise_in(out, REG_1, &mask, &[0; 16][..len]);
        cmp_in(out, REG_1, a.negate, bytes);
    }
    Ok(())
}

fn comment(text: &str) -> Result<[u8; 256], EncodeError> {
    // struct xt_comment_info { char comment[256]; }
    if text.len() > 255 {
        return Err(EncodeError::Comment);
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

/// The statistic match's probability for upstream's text of 1/`one_in`
/// (`%0.10f`), as libxt_statistic makes it of that text: lround(2^31 * p).
/// Worked out once for the endpoint counts Services have (a format and a
/// parse each), so that the kernel holds what iptables-restore would.
fn random_bits(one_in: u32) -> u32 {
    const CACHED: u32 = 1024;
    static SMALL: OnceLock<Vec<u32>> = OnceLock::new();
    let of = |n: u32| {
        let p: f64 = probability(n as usize).parse().unwrap_or(0.0);
        (p * 2_147_483_648.0).round() as u32
    };
    match SMALL
        .get_or_init(|| (0..CACHED).map(of).collect())
        .get(one_in as usize)
    {
        Some(bits) => *bits,
        None => of(one_in),
    }
}

/// struct xt_recent_mtinfo_v1: seconds, hit_count, check_set, invert,
/// name[200], side, then the address mask (all ones: whole addresses).
fn recent(r: &Recent) -> Result<Vec<u8>, EncodeError> {
    let (name, seconds, flags) = match r {
        Recent::Set { name } => (name, 0, RECENT_SET),
        Recent::Check { name, seconds } => (name, *seconds, RECENT_CHECK | RECENT_REAP),
    };
    if name.len() >= 200 {
        return Err(EncodeError::RecentName(name.clone()));
    }
    let mut v = Vec::with_capacity(232);
    v.extend_from_slice(&seconds.to_ne_bytes());
    v.extend_from_slice(&0u32.to_ne_bytes());
    v.push(flags);
    v.push(0);
    let mut name = name.as_bytes().to_vec();
    name.resize(200, 0);
    v.extend_from_slice(&name);
    v.push(0); // XT_RECENT_SOURCE
    v.push(0); // padding before the mask
               // libxt_recent sets the whole union to ones, for IPv4 too.
    v.extend_from_slice(&[0xff; 16]);
    Ok(xt_align(v))
}

/// struct xt_addrtype_info_v1 with LOCAL as the source's (`src`) or the
/// destination's type: source and destination type masks, then flags
/// (no inversion).
fn addrtype_local(src: bool) -> [u8; 8] {
    let (s, d) = if src {
        (ADDRTYPE_LOCAL, 0)
    } else {
        (0, ADDRTYPE_LOCAL)
    };
    let mut v = [0; 8];
    v[0..2].copy_from_slice(&s.to_ne_bytes());
    v[2..4].copy_from_slice(&d.to_ne_bytes());
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
fn nfacct(name: &str) -> Result<[u8; 40], EncodeError> {
    if name.is_empty() || name.len() >= 32 {
        return Err(EncodeError::NfacctName(name.to_string()));
    }
    let mut v = [0; 40];
    v[..name.len()].copy_from_slice(name.as_bytes());
    Ok(v)
}

/// struct nf_nat_range2 for DNAT (revision 2): flags, min and max address
/// (16 bytes each), min and max port, base_proto, padded to 48.
fn dnat(to: SocketAddr, fam: Family) -> Result<[u8; 48], EncodeError> {
    // NF_NAT_RANGE_MAP_IPS | NF_NAT_RANGE_PROTO_SPECIFIED.
    let flags: u32 = 1 | 2;
    // Unused bytes of an IPv4 address stay zero, as in the union.
    let (a, _) = addr_bytes(to.ip(), fam)?;
    let p = to.port().to_be_bytes();
    let mut v = [0; 48];
    v[0..4].copy_from_slice(&flags.to_ne_bytes());
    v[4..20].copy_from_slice(&a);
    v[20..36].copy_from_slice(&a);
    v[36..38].copy_from_slice(&p);
    v[38..40].copy_from_slice(&p);
    Ok(v)
}

/// MASQUERADE --random-fully, revision 0: IPv4's
/// nf_nat_ipv4_multi_range_compat (one range), IPv6's nf_nat_range.
fn masquerade(fam: Family) -> Vec<u8> {
    // NF_NAT_RANGE_PROTO_RANDOM_FULLY
    let flags: u32 = 1 << 4;
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
pub fn encode(r: &Rule, fam: Family) -> Result<Attrs, EncodeError> {
    // Room for the rules render.rs writes (a comment's structure alone is
    // 256 bytes): one allocation for most.
    let mut exprs = Attrs::with_capacity(768);
    encode_into(&mut exprs, r, fam)?;
    Ok(exprs)
}

/// Puts `v` in `slot`, which must be empty (iptables takes `-s` etc. once).
fn once<'a, T>(slot: &mut Option<&'a T>, v: &'a T, what: &'static str) -> Result<(), EncodeError> {
    match slot.replace(v) {
        Some(_) => Err(EncodeError::Twice(what)),
        None => Ok(()),
    }
}

/// [`encode`]'s expressions written at the end of `out` (the expression
/// list of a rule message being built).
pub fn encode_into(out: &mut Attrs, r: &Rule, fam: Family) -> Result<(), EncodeError> {
    let (mut in_iface, mut proto, mut src, mut dst) = (None, None, None, None);
    for m in &r.matches {
        match m {
            Match::In(i) => once(&mut in_iface, i, "-i")?,
            Match::Src(a) => once(&mut src, a, "-s")?,
            Match::Dst(a) => once(&mut dst, a, "-d")?,
            Match::Ports {
                proto: p, dst: d, ..
            } => {
                once(&mut proto, p, "-p")?;
                if let Some(a) = d {
                    once(&mut dst, a, "-d")?;
                }
            }
            _ => {}
        }
    }
    if let Some(i) = in_iface {
        iface(out, META_IIFNAME, i);
    }
    if let Some(p) = proto {
        meta_load_in(out, META_L4PROTO, REG_1);
        cmp_in(out, REG_1, false, &[p.number()]);
    }
    let (src_off, dst_off) = fam.addr_offsets();
    if let Some(a) = src {
        address(out, fam, src_off, a)?;
    }
    if let Some(a) = dst {
        address(out, fam, dst_off, a)?;
    }
    for m in &r.matches {
        match m {
            Match::Src(_) | Match::Dst(_) | Match::In(_) => {}
            Match::Comment(c) => {
                xt_in(out, "match", "comment", 0, &comment(c)?);
            }
            Match::Ports {
                proto: Protocol::Sctp,
                dport,
                ..
            } => {
                xt_in(out, "match", "sctp", 0, &sctp(*dport));
            }
            Match::Ports { dport: Some(p), .. } => {
                payload_in(out, PAYLOAD_TRANSPORT, 2, 2, REG_1);
                cmp_in(out, REG_1, false, &p.to_be_bytes());
            }
            Match::Ports {
                proto, dport: None, ..
            } => {
                xt_in(out, "match", proto.as_lower(), 0, &any_ports());
            }
            Match::Random { one_in } => {
                xt_in(
                    out,
                    "match",
                    "statistic",
                    0,
                    &statistic(random_bits(*one_in)),
                );
            }
            Match::Recent(rc) => {
                xt_in(out, "match", "recent", 1, &recent(rc)?);
            }
            Match::Local { src } => {
                xt_in(out, "match", "addrtype", 1, &addrtype_local(*src));
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
    // xt_MARK's (mark, mask): the new mark is (old & !mask) ^ mark.
    let mark = |out: &mut Attrs, mark: u32, mask: u32| {
        let mut v = mark.to_ne_bytes().to_vec();
        v.extend_from_slice(&mask.to_ne_bytes());
        xt_in(out, "target", "MARK", 2, &v);
    };
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
        Target::Dnat(to) => {
            xt_in(out, "target", "DNAT", 2, &dnat(*to, fam)?);
        }
        Target::MasqueradeRandomFully => {
            xt_in(out, "target", "MASQUERADE", 0, &masquerade(fam));
        }
        Target::MarkOr(m) => mark(out, *m, *m),
        Target::MarkXor(m) => mark(out, *m, 0),
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
        let r = Recent::Check {
            name: "KUBE-SEP-X".into(),
            seconds: 10800,
        };
        assert_eq!(recent(&r).unwrap().len(), 232);
        assert_eq!(conntrack(false, 8).len(), 168);
        assert_eq!(
            dnat("10.0.0.1:80".parse().unwrap(), Family::V4)
                .unwrap()
                .len(),
            48
        );
        assert_eq!(masquerade(Family::V4).len(), 24);
        assert_eq!(masquerade(Family::V6).len(), 40);
        assert_eq!(reject(Family::V4).len(), 8);
        assert_eq!(nfacct("ct_state_invalid_dropped_pkts").unwrap().len(), 40);
        assert!(nfacct(&"x".repeat(32)).is_err());
    }

    #[test]
    fn probabilities_are_what_libxt_statistic_makes_of_the_text() {
        // The text's value, parsed and scaled as libxt_statistic does
        // (lround(0x80000000 * p)), for every count the cache holds and
        // past it.
        for n in (2..5000).chain([65_535, 1 << 20]) {
            let p: f64 = probability(n as usize).parse().unwrap();
            assert_eq!(
                random_bits(n),
                (p * 2_147_483_648.0).round() as u32,
                "1/{n}"
            );
        }
        assert_eq!(random_bits(3), 715_827_883);
        assert_eq!(random_bits(2), 1 << 30);
    }

    #[test]
    fn a_rule_holds_each_fixed_field_once() {
        let a = Addr::new(false, "10.0.0.1/32".parse().unwrap());
        let r = Rule::new(
            vec![
                Match::Dst(a),
                Match::Ports {
                    proto: Protocol::Tcp,
                    dst: Some(a),
                    dport: Some(80),
                },
            ],
            Target::Accept,
        );
        assert_eq!(
            encode(&r, Family::V4).unwrap_err(),
            EncodeError::Twice("-d")
        );
        let v6 = Rule::new(
            vec![Match::src_host("fd00::1".parse().unwrap())],
            Target::Drop,
        );
        assert!(matches!(
            encode(&v6, Family::V4),
            Err(EncodeError::Family(_))
        ));
    }

    #[test]
    fn conntrack_state_bits_land_in_their_fields() {
        let v = conntrack(true, 0x86);
        assert_eq!(&v[146..152], &[1, 0, 1, 0, 0x86, 0]);
    }
}
