// Checksums: sums and folds, incremental updates at tc (helpers) and at
// XDP (in place).
#ifndef KP_LIB_CSUM_H
#define KP_LIB_CSUM_H

#include "parse.h"

// An IPv6 address at `off`, with the checksum at `csum` (`pseudo`: the
// address is in its pseudo-header; an ICMPv6 error quotes others as data).
static __always_inline int readdress6(struct __sk_buff *skb, __u32 csum, __u32 off, __u64 pseudo,
				      const __u32 *from, const __u32 *to)
{
	for (int i = 0; i < 4; i++)
		if (from[i] != to[i])
			bpf_l4_csum_replace(skb, csum, from[i], to[i], pseudo | 4);
	return bpf_skb_store_bytes(skb, off, to, 16, 0) == 0;
}

// One off the TTL or hop limit, as forwarding does (IPv4's TTL shares a
// 16-bit word of the header checksum with the protocol).
static __always_inline int take_ttl(struct __sk_buff *skb, int v4)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	if (!v4) {
		struct ipv6hdr *ip6 = data + IP_OFF;
		if ((void *)(ip6 + 1) > end)
			return 0;
		__u8 hop = ip6->hop_limit - 1;
		return bpf_skb_store_bytes(skb, IP6_HOP_OFF, &hop, 1, 0) == 0;
	}
	struct iphdr *ip = data + IP_OFF;
	if ((void *)(ip + 1) > end)
		return 0;
	__u16 old = *(__u16 *)&ip->ttl;
	__u8 ttl = ip->ttl - 1;
	__u16 new = old;
	*(__u8 *)&new = ttl;
	bpf_l3_csum_replace(skb, IP_CSUM_OFF, old, new, 2);
	return bpf_skb_store_bytes(skb, IP_OFF + 8, &ttl, 1, 0) == 0;
}

// The one's complement sum of `words` 16-bit words added to `sum`, and
// folded into a checksum.
static __always_inline __u32 add_words(const __u16 *h, int words, __u32 sum)
{
	for (int i = 0; i < words; i++)
		sum += h[i];
	return sum;
}

static __always_inline __u16 fold(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return ~sum;
}

// The IPv4 header's checksum over `words` 16-bit words (with its checksum
// field 0).
static __always_inline __u16 ip_csum(const __u16 *h, int words)
{
	return fold(add_words(h, words, 0));
}

// The TCP/UDP checksum at `csum` after the addresses (`bytes` of them from
// `from` to `to`: its pseudo-header; 0 when they stay) and the ports
// change from `f`'s to `n`'s: two differences applied by
// bpf_l4_csum_replace, the addresses' with the pseudo-header flag (the
// helper also updates a CHECKSUM_PARTIAL packet's field), the ports'
// without (that field covers the pseudo-header only).
static __always_inline int recsum_l4(struct __sk_buff *skb, __u32 csum, __u64 l4, __u32 *from,
				     __u32 *to, __u32 bytes, const struct flow *f,
				     const struct nat *n)
{
	if (bytes) {
		__s64 d = bpf_csum_diff(from, bytes, to, bytes, 0);
		if (d < 0 || bpf_l4_csum_replace(skb, csum, 0, d, l4 | BPF_F_PSEUDO_HDR))
			return 0;
	}
	__u32 pf, pt;
	__builtin_memcpy(&pf, &f->sport, 4);
	__builtin_memcpy(&pt, &n->sport, 4);
	if (pf != pt) {
		__s64 d = bpf_csum_diff(&pf, 4, &pt, 4, 0);
		if (d < 0 || bpf_l4_csum_replace(skb, csum, 0, d, l4))
			return 0;
	}
	return 1;
}


// Where the TCP or UDP checksum is, its header checked to be in the frame
// (a short datagram's frame ends after UDP's 8 bytes); 0 if it is not.
// Each branch adds a constant to the pointer: the verifier of a proxy
// without CAP_PERFMON refuses packet pointer plus register, which a
// select between the two offsets would make.
static __always_inline __u16 *l4_csum_field(__u8 *l4, void *end, int tcp)
{
	if (tcp) {
		if ((void *)(l4 + 20) > end)
			return 0;
		return (void *)(l4 + 16);
	}
	if ((void *)(l4 + 8) > end)
		return 0;
	return (void *)(l4 + 6);
}


#endif
