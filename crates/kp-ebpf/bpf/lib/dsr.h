// Direct server return: the carrier of the Service address (an IPv4
// option, an IPv6 destination options header), added by the first node,
// stripped by the endpoint's; the ICMP answer when the carrier makes a
// request too big for its route.
#ifndef KP_LIB_DSR_H
#define KP_LIB_DSR_H

#include "route.h"

// The IPv4 option a DSR request carries to the endpoint's node: the
// Service address and port its reply must come from. Type 0x9e: copied,
// number 30 (RFC 4727's experimental option), length 8.
#define KP_DSR_OPT_TYPE 0x9e
#define KP_DSR_OPT_LEN 8

// IPv6's carrier: a destination options header (next header 60) right
// after the fixed header, with one option: type 0x1e (RFC 4727's
// experimental type whose high bits say "skip if unknown, not changed on
// the way"), 20 bytes of Service address, port and 2 zero bytes; 24 bytes
// in all (header length 2: in 8-byte units after the first 8). Only
// the endpoint's node, the destination, reads it.
#define IPPROTO_DSTOPTS 60
#define KP_DSR6_OPT_TYPE 0x1e
struct dsr_opt6 {
	__u8 nexthdr;
	__u8 hdrlen;
	__u8 type;
	__u8 len;
	__u32 addr[4];
	__u16 port;
	__u16 pad;
};
#define KP_DSR6_LEN 24
_Static_assert(sizeof(struct dsr_opt6) == KP_DSR6_LEN, "dsr_opt6 is 24 bytes");

// Inserts the DSR option after the (option-less) IPv4 header: the room
// goes in after the header's first 20 bytes (BPF_ADJ_ROOM_NET), then the
// header is written anew (ihl 7, tot_len + 8, its checksum).
static __always_inline int add_dsr_opt(struct __sk_buff *skb, __u32 svc_addr, __u16 svc_port)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + IP_OFF;
	if ((void *)(ip + 1) > end)
		return 0;
	__u16 h[14];
	__builtin_memcpy(h, ip, 20);
	struct iphdr *nh = (void *)h;
	nh->ihl = 7;
	nh->tot_len = __builtin_bswap16(__builtin_bswap16(ip->tot_len) + KP_DSR_OPT_LEN);
	nh->check = 0;
	__u8 *opt = (__u8 *)&h[10];
	opt[0] = KP_DSR_OPT_TYPE;
	opt[1] = KP_DSR_OPT_LEN;
	__builtin_memcpy(&h[11], &svc_port, 2);
	__builtin_memcpy(&h[12], &svc_addr, 4);
	nh->check = ip_csum(h, 14);
	if (bpf_skb_adjust_room(skb, KP_DSR_OPT_LEN, BPF_ADJ_ROOM_NET, 0))
		return 0;
	return bpf_skb_store_bytes(skb, IP_OFF, h, 28, 0) == 0;
}

// Inserts the DSR destination options header after the (extension-less)
// IPv6 header: room after the fixed 40 bytes (BPF_ADJ_ROOM_NET), the
// header there, then next header 60 and the payload 24 bytes longer. The
// TCP or UDP checksum stays: its pseudo-header names the upper layer's
// length and protocol, which do not change.
static __always_inline int add_dsr_opt6(struct __sk_buff *skb, const __u32 *svc_addr,
					__u16 svc_port)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ipv6hdr *ip6 = data + IP_OFF;
	if ((void *)(ip6 + 1) > end)
		return 0;
	struct dsr_opt6 o = { .nexthdr = ip6->nexthdr, .hdrlen = KP_DSR6_LEN / 8 - 1,
			      .type = KP_DSR6_OPT_TYPE, .len = KP_DSR6_LEN - 4, .port = svc_port };
	copy(o.addr, svc_addr);
	__u16 plen = __builtin_bswap16(__builtin_bswap16(ip6->payload_len) + KP_DSR6_LEN);
	__u8 next = IPPROTO_DSTOPTS;
	if (bpf_skb_adjust_room(skb, KP_DSR6_LEN, BPF_ADJ_ROOM_NET, 0))
		return 0;
	return bpf_skb_store_bytes(skb, L4_OFF6, &o, KP_DSR6_LEN, 0) == 0 &&
	       bpf_skb_store_bytes(skb, IP_OFF + 4, &plen, 2, 0) == 0 &&
	       bpf_skb_store_bytes(skb, IP_OFF + 6, &next, 1, 0) == 0;
}

// The headers dsr_too_big puts in front of the start of a request: the new
// IP header and the ICMP one. The start of the request as the client sent
// it follows, its IP header and 8 bytes (the ports: what RFC 792 asks, and
// what a stack needs to find the socket).
struct too_big4 {
	struct iphdr ip;
	__u8 type;
	__u8 code;
	__u16 csum;
	__u16 unused;
	__u16 mtu;
};
#define QUOTE4 28

struct too_big6 {
	struct ipv6hdr ip6;
	__u8 type;
	__u8 code;
	__u16 csum;
	__u32 mtu;
};
#define QUOTE6 48

// A DSR request that the carrier would make too big for the route to its
// endpoint's node: it becomes the ICMP error a router would send for it
// ("fragmentation needed", ICMPv6 "packet too big") with the MTU less the
// carrier's length, from the Service address to the client, quoting the
// request as the client sent it, and goes back out of the interface it
// came in by, to the hop it came from. The client's stack then sends
// smaller packets to the Service (or fragments, which the programs leave
// to the stack). Cilium answers the same way (dsr_reply_icmp4). Without
// this the node's stack would forward it and fail it with an error about
// the translated packet, which the client cannot match: a black hole
// for large UDP datagrams (TCP's carrier rides on the SYN only).
// The packet is cut to its quote and the headers go in front of it
// (BPF_ADJ_ROOM_MAC): the quote is never copied to the stack.
static __attribute__((noinline)) int dsr_too_big(struct __sk_buff *skb, int v4, __u32 mtu)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_SHOT;
	// To whoever sent it, from the address it was sent to (swapped in
	// place: the frame's Ethernet header stays through the resizing).
	__u32 src0 = *(__u32 *)eth->h_source;
	__u16 src1 = *(__u16 *)(eth->h_source + 4);
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	*(__u32 *)eth->h_dest = src0;
	*(__u16 *)(eth->h_dest + 4) = src1;
	if (v4) {
		struct iphdr *ip = data + IP_OFF;
		if ((void *)ip + QUOTE4 > end)
			return TC_ACT_SHOT;
		struct too_big4 h = {};
		h.ip.version = 4;
		h.ip.ihl = 5;
		h.ip.tos = ip->tos;
		h.ip.tot_len = __builtin_bswap16(sizeof(h) + QUOTE4);
		h.ip.frag_off = __builtin_bswap16(0x4000); // DF
		h.ip.ttl = 64;
		h.ip.protocol = IPPROTO_ICMP;
		h.ip.saddr = ip->daddr;
		h.ip.daddr = ip->saddr;
		h.ip.check = ip_csum((void *)&h.ip, 10);
		h.type = 3; // destination unreachable
		h.code = 4; // fragmentation needed
		h.mtu = __builtin_bswap16(mtu);
		__u32 sum = add_words((void *)ip, QUOTE4 / 2, 0);
		h.csum = fold(add_words((void *)&h.type, 4, sum));
		if (bpf_skb_change_tail(skb, IP_OFF + QUOTE4, 0) ||
		    bpf_skb_adjust_room(skb, sizeof(h), BPF_ADJ_ROOM_MAC, 0) ||
		    bpf_skb_store_bytes(skb, IP_OFF, &h, sizeof(h), 0))
			return TC_ACT_SHOT;
	} else {
		struct ipv6hdr *ip6 = data + IP_OFF;
		if ((void *)ip6 + QUOTE6 > end)
			return TC_ACT_SHOT;
		struct too_big6 h = {};
		h.ip6.version = 6;
		h.ip6.payload_len = __builtin_bswap16(sizeof(h) - 40 + QUOTE6);
		h.ip6.nexthdr = 58; // ICMPv6
		h.ip6.hop_limit = 64;
		__builtin_memcpy(&h.ip6.saddr, &ip6->daddr, 16);
		__builtin_memcpy(&h.ip6.daddr, &ip6->saddr, 16);
		h.type = 2; // packet too big
		h.mtu = __builtin_bswap32(mtu);
		// The pseudo-header (the addresses, the length, next header 58),
		// the quote, the ICMPv6 header.
		__u32 sum = add_words((void *)&h.ip6.saddr, 16, 0);
		sum += __builtin_bswap16(sizeof(h) - 40 + QUOTE6) + __builtin_bswap16(58);
		sum = add_words((void *)ip6, QUOTE6 / 2, sum);
		h.csum = fold(add_words((void *)&h.type, 4, sum));
		if (bpf_skb_change_tail(skb, IP_OFF + QUOTE6, 0) ||
		    bpf_skb_adjust_room(skb, sizeof(h), BPF_ADJ_ROOM_MAC, 0) ||
		    bpf_skb_store_bytes(skb, IP_OFF, &h, sizeof(h), 0))
			return TC_ACT_SHOT;
	}
	return bpf_redirect(skb->ingress_ifindex, 0);
}

// A request of a DSR flow, translated (`f` as it came, `n` what it
// becomes): with the option when it needs one (a TCP SYN, every UDP
// packet: the endpoint's node may have lost the flow), then routed anew
// for the longer packet.
static __always_inline int dsr_send(struct __sk_buff *skb, const struct flow *f,
				    const struct nat *n, int syn)
{
	int v4 = f->family == 4;
	__u16 extra = !(syn || f->proto == IPPROTO_UDP) ? 0 : v4 ? KP_DSR_OPT_LEN : KP_DSR6_LEN;
	// The route first, for the packet as it will leave (with the
	// carrier): one the carrier makes too big for the link is answered
	// here (dsr_too_big), before anything is rewritten.
	struct bpf_fib_lookup fib = {};
	long rc = route(skb, &fib, f->family, n->saddr, n->daddr, f->proto, n->sport, n->dport, 0,
			extra);
	if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED && extra && fib.mtu_result > extra)
		return dsr_too_big(skb, v4, fib.mtu_result - extra);
	if (!rewrite(skb, f, n))
		return TC_ACT_SHOT;
	if (extra) {
		if (v4 ? !add_dsr_opt(skb, f->daddr[0], f->dport)
		       : !add_dsr_opt6(skb, f->daddr, f->dport))
			return TC_ACT_SHOT;
	}
	return send(skb, rc, &fib);
}

// The DSR carrier of an IPv4 request (ihl 7, the option first): its
// Service address and port, and the packet without it. 0 for a packet
// without it, -1 when it cannot be removed.
static __always_inline int dsr_strip4(struct __sk_buff *skb, struct flow *f, __u32 *svc_addr,
				      __u16 *svc_port, __u8 *ttl)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + IP_OFF;
	if ((void *)(ip + 1) > end || ip->ihl != 7 || (ip->frag_off & __builtin_bswap16(0x3fff)))
		return 0;
	__u8 *opt = (void *)(ip + 1);
	struct ports *p = (void *)(opt + KP_DSR_OPT_LEN);
	if ((void *)(p + 1) > end || opt[0] != KP_DSR_OPT_TYPE || opt[1] != KP_DSR_OPT_LEN)
		return 0;
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP)
		return 0;
	f->family = 4;
	f->proto = ip->protocol;
	f->sport = p->source;
	f->dport = p->dest;
	f->saddr[0] = ip->saddr;
	f->daddr[0] = ip->daddr;
	*ttl = ip->ttl;
	__builtin_memcpy(svc_port, opt + 2, 2);
	__builtin_memcpy(svc_addr, opt + 4, 4);
	__u16 h[10];
	__builtin_memcpy(h, ip, 20);
	struct iphdr *nh = (void *)h;
	nh->ihl = 5;
	nh->tot_len = __builtin_bswap16(__builtin_bswap16(ip->tot_len) - KP_DSR_OPT_LEN);
	nh->check = 0;
	nh->check = ip_csum(h, 10);
	if (bpf_skb_adjust_room(skb, -KP_DSR_OPT_LEN, BPF_ADJ_ROOM_NET, 0) ||
	    bpf_skb_store_bytes(skb, IP_OFF, h, 20, 0))
		return -1;
	return 1;
}

// The same for IPv6: the destination options header of add_dsr_opt6,
// first after the fixed header.
static __always_inline int dsr_strip6(struct __sk_buff *skb, struct flow *f, __u32 *svc_addr,
				      __u16 *svc_port, __u8 *ttl)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ipv6hdr *ip6 = data + IP_OFF;
	if ((void *)(ip6 + 1) > end || ip6->nexthdr != IPPROTO_DSTOPTS)
		return 0;
	struct dsr_opt6 *o = (void *)(ip6 + 1);
	struct ports *p = (void *)(o + 1);
	if ((void *)(p + 1) > end || o->hdrlen != KP_DSR6_LEN / 8 - 1 ||
	    o->type != KP_DSR6_OPT_TYPE || o->len != KP_DSR6_LEN - 4)
		return 0;
	if (o->nexthdr != IPPROTO_TCP && o->nexthdr != IPPROTO_UDP)
		return 0;
	f->family = 6;
	f->proto = o->nexthdr;
	f->sport = p->source;
	f->dport = p->dest;
	__builtin_memcpy(f->saddr, &ip6->saddr, 16);
	__builtin_memcpy(f->daddr, &ip6->daddr, 16);
	*ttl = ip6->hop_limit;
	copy(svc_addr, o->addr);
	*svc_port = o->port;
	__u16 plen = __builtin_bswap16(__builtin_bswap16(ip6->payload_len) - KP_DSR6_LEN);
	__u8 next = o->nexthdr;
	if (bpf_skb_adjust_room(skb, -KP_DSR6_LEN, BPF_ADJ_ROOM_NET, 0) ||
	    bpf_skb_store_bytes(skb, IP_OFF + 4, &plen, 2, 0) ||
	    bpf_skb_store_bytes(skb, IP_OFF + 6, &next, 1, 0))
		return -1;
	return 1;
}

// A DSR request that another node sent here, with its carrier (an IPv4
// option, an IPv6 destination options header): the carrier goes, its
// Service address becomes the reply's source (kp_np_replies, which
// kp_np_from_pod reads on the endpoint's veth, so the reply leaves this
// node for the client directly), and the packet goes to the endpoint.
// Later packets of a TCP flow, without the carrier, follow the
// kp_np_flows entry made here. Returns -1 for a packet without one.
static __attribute__((noinline)) int dsr_in(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return -1;
	struct flow f = {};
	__u32 svc_addr[4] = {};
	__u16 svc_port = 0;
	__u8 ttl = 0;
	int got;
	if (eth->h_proto == __builtin_bswap16(ETH_P_IP))
		got = dsr_strip4(skb, &f, svc_addr, &svc_port, &ttl);
	else if (eth->h_proto == __builtin_bswap16(ETH_P_IPV6))
		got = dsr_strip6(skb, &f, svc_addr, &svc_port, &ttl);
	else
		return -1;
	if (got == 0)
		return -1;
	if (got < 0)
		return TC_ACT_SHOT;
	// Stripped already: the stack gets a plain packet to expire.
	if (ttl <= 1)
		return TC_ACT_OK;
	// The reply: endpoint -> client becomes Service -> client.
	struct flow r = { .family = f.family, .proto = f.proto, .sport = f.dport, .dport = f.sport };
	copy(r.saddr, f.daddr);
	copy(r.daddr, f.saddr);
	struct nat *had = bpf_map_lookup_elem(&kp_np_flows, &r);
	if (!had || !(had->backend.pad & KP_NAT_REPLY) || !same(had->saddr, svc_addr) ||
	    had->sport != svc_port) {
		struct nat *back = scratch(0);
		if (!back)
			return TC_ACT_SHOT;
		back->sport = svc_port;
		back->dport = f.sport;
		copy(back->saddr, svc_addr);
		copy(back->daddr, f.saddr);
		back->backend.pad = KP_NAT_REPLY;
		flow_deltas(back, &r);
		bpf_map_update_elem(&kp_np_flows, &r, back, BPF_ANY);
	}
	// The request goes on as it is (already translated by the first node).
	struct nat *n = scratch(1);
	if (!n)
		return TC_ACT_SHOT;
	n->sport = f.sport;
	n->dport = f.dport;
	copy(n->saddr, f.saddr);
	copy(n->daddr, f.daddr);
	if (f.proto == IPPROTO_TCP)
		bpf_map_update_elem(&kp_np_flows, &f, n, BPF_ANY);
	return forward(skb, &f, n);
}


#endif
