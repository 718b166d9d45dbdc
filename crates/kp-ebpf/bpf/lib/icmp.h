// ICMP errors about translated flows, translated back.
#ifndef KP_LIB_ICMP_H
#define KP_LIB_ICMP_H

#include "route.h"

// ICMP errors about a request the programs translated (an endpoint's
// "port unreachable", a router's "fragmentation needed" on the way to it)
// travel to the request's translated source. They go back to the client as
// conntrack would send them: the quoted packet as the client sent it
// (client -> Service), the outer destination the client, and the outer
// source the Service address where the endpoint itself wrote the error.
// ICMP errors about a reply the programs translated (the client's "port
// unreachable", a router's "packet too big" on the way to the client)
// travel to the Service address; they go on to the endpoint as conntrack
// would send them: the quote as the endpoint sent the reply, the outer
// destination the endpoint.
// Returns -1 for a packet that is no such error.
// Addresses and ports (a struct nat without the rest: stack is short).
struct tuple {
	__u32 saddr[4];
	__u32 daddr[4];
	__u16 sport;
	__u16 dport;
};

#define ICMP4_OFF L4_OFF4
#define IN4_OFF (ICMP4_OFF + 8)
#define IN4_L4_OFF (IN4_OFF + 20)
#define ICMP6_OFF L4_OFF6
#define IN6_OFF (ICMP6_OFF + 8)
#define IN6_L4_OFF (IN6_OFF + 40)

// A port of the quoted packet, with the ICMP checksum (the quote is part of
// the message it covers).
static __always_inline int requote_port(struct __sk_buff *skb, __u32 csum, __u32 off, __u16 from,
					__u16 to)
{
	if (from == to)
		return 1;
	bpf_l4_csum_replace(skb, csum, from, to, 2);
	return bpf_skb_store_bytes(skb, off, &to, 2, 0) == 0;
}


// A frame of its own (as the translation's path below): inlined into one,
// the two would pass the verifier's 512 bytes of stack together.
static __attribute__((noinline)) int icmp_error(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return -1;
	struct flow q = {}; // the quoted packet: as translated, towards the endpoint
	__u32 outer_src[4] = {}, outer_dst[4] = {};
	__u8 ttl;
	struct ports *p;
	if (eth->h_proto == __builtin_bswap16(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end || ip->ihl != 5 || ip->protocol != IPPROTO_ICMP ||
		    (ip->frag_off & __builtin_bswap16(0x3fff)))
			return -1;
		__u8 *type = (void *)(ip + 1);
		struct iphdr *in = (void *)(type + 8);
		if ((void *)(in + 1) > end || in->ihl != 5)
			return -1;
		if (*type != 3 && *type != 11 && *type != 12) // unreachable, time, parameter
			return -1;
		q.family = 4;
		q.proto = in->protocol;
		q.saddr[0] = in->saddr;
		q.daddr[0] = in->daddr;
		outer_src[0] = ip->saddr;
		outer_dst[0] = ip->daddr;
		ttl = ip->ttl;
		p = (void *)(in + 1);
	} else if (eth->h_proto == __builtin_bswap16(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end || ip6->nexthdr != 58) // IPPROTO_ICMPV6
			return -1;
		__u8 *type = (void *)(ip6 + 1);
		struct ipv6hdr *in = (void *)(type + 8);
		if ((void *)(in + 1) > end)
			return -1;
		if (*type < 1 || *type > 4) // unreachable, too big, time, parameter
			return -1;
		q.family = 6;
		q.proto = in->nexthdr;
		__builtin_memcpy(q.saddr, &in->saddr, 16);
		__builtin_memcpy(q.daddr, &in->daddr, 16);
		__builtin_memcpy(outer_src, &ip6->saddr, 16);
		__builtin_memcpy(outer_dst, &ip6->daddr, 16);
		ttl = ip6->hop_limit;
		p = (void *)(in + 1);
	} else {
		return -1;
	}
	if ((q.proto != IPPROTO_TCP && q.proto != IPPROTO_UDP) || (void *)(p + 1) > end)
		return -1;
	q.sport = p->source;
	q.dport = p->dest;
	// The quoted packet's reverse: the reply of a translated request, or
	// the request of a translated reply.
	struct flow r = { .family = q.family, .proto = q.proto, .sport = q.dport, .dport = q.sport };
	copy(r.saddr, q.daddr);
	copy(r.daddr, q.saddr);
	// `t`, the translation of r: about a request (node -> endpoint), the
	// reply's (Service -> client); about a reply (Service -> client: from
	// the client, or a router on the way to it saying the reply is too
	// big), the client's request's (node -> endpoint). Either way the
	// quote becomes t's reverse (client -> Service, or the reply as the
	// endpoint sent it), for the one t sends to.
	struct nat *t = bpf_map_lookup_elem(&kp_np_flows, &r);
	if (!t)
		return -1;
	int about_reply = !(t->backend.pad & KP_NAT_REPLY);
	if (about_reply && (t->backend.pad & KP_NAT_PASS))
		return -1;
	// What the quote becomes (its source, destination and ports), and the
	// outer header's new source and destination: from whoever wrote the
	// error, but the Service address where an endpoint wrote one about a
	// request.
	struct tuple quote = { .sport = t->dport, .dport = t->sport }, n = {};
	copy(quote.saddr, t->daddr);
	copy(quote.daddr, t->saddr);
	copy(n.daddr, t->daddr);
	copy(n.saddr, !about_reply && same(outer_src, q.daddr) ? t->saddr : outer_src);
	if (ttl <= 1)
		return TC_ACT_OK;
	int v4 = q.family == 4;
	if (v4) {
		__u32 csum = ICMP4_OFF + 2;
		// Quoted addresses with the quoted header's checksum: the quote
		// then sums as before, so the ICMP checksum stays.
		bpf_l3_csum_replace(skb, IN4_OFF + 10, q.saddr[0], quote.saddr[0], 4);
		bpf_l3_csum_replace(skb, IN4_OFF + 10, q.daddr[0], quote.daddr[0], 4);
		if (bpf_skb_store_bytes(skb, IN4_OFF + 12, &quote.saddr[0], 4, 0) ||
		    bpf_skb_store_bytes(skb, IN4_OFF + 16, &quote.daddr[0], 4, 0))
			return TC_ACT_SHOT;
		if (!requote_port(skb, csum, IN4_L4_OFF, q.sport, quote.sport) ||
		    !requote_port(skb, csum, IN4_L4_OFF + 2, q.dport, quote.dport))
			return TC_ACT_SHOT;
		// The outer header: no pseudo-header in ICMPv4's checksum.
		if (n.saddr[0] != outer_src[0]) {
			bpf_l3_csum_replace(skb, IP_CSUM_OFF, outer_src[0], n.saddr[0], 4);
			if (bpf_skb_store_bytes(skb, IP_SRC_OFF, &n.saddr[0], 4, 0))
				return TC_ACT_SHOT;
		}
		bpf_l3_csum_replace(skb, IP_CSUM_OFF, outer_dst[0], n.daddr[0], 4);
		if (bpf_skb_store_bytes(skb, IP_DST_OFF, &n.daddr[0], 4, 0))
			return TC_ACT_SHOT;
	} else {
		__u32 csum = ICMP6_OFF + 2;
		if (!readdress6(skb, csum, IN6_OFF + 8, 0, q.saddr, quote.saddr) ||
		    !readdress6(skb, csum, IN6_OFF + 24, 0, q.daddr, quote.daddr) ||
		    !requote_port(skb, csum, IN6_L4_OFF, q.sport, quote.sport) ||
		    !requote_port(skb, csum, IN6_L4_OFF + 2, q.dport, quote.dport))
			return TC_ACT_SHOT;
		if (!same(n.saddr, outer_src) &&
		    !readdress6(skb, csum, IP6_SRC_OFF, BPF_F_PSEUDO_HDR, outer_src, n.saddr))
			return TC_ACT_SHOT;
		if (!readdress6(skb, csum, IP6_DST_OFF, BPF_F_PSEUDO_HDR, outer_dst, n.daddr))
			return TC_ACT_SHOT;
	}
	if (!take_ttl(skb, v4))
		return TC_ACT_SHOT;
	struct bpf_fib_lookup fib = {};
	long rc = route(skb, &fib, q.family, n.saddr, n.daddr, v4 ? IPPROTO_ICMP : 58, 0, 0, 0, 0);
	return send(skb, rc, &fib);
}


#endif
