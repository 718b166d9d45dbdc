// Routing a translated packet: the FIB lookup, and sending it past the
// stack where the route allows.
#ifndef KP_LIB_ROUTE_H
#define KP_LIB_ROUTE_H

#include "nat.h"
#include <linux/pkt_cls.h>

static __always_inline void count(__u32 what)
{
	__u64 *c = bpf_map_lookup_elem(&kp_np_stats, &what);
	if (c)
		*c += 1;
}


// The route from `src` to `dst` for this packet (its length for the MTU
// check). With BPF_FIB_LOOKUP_SRC (Linux 6.7) the kernel also names the
// source address the route prefers, which is what masquerade would take.
// `ctx`: the tc or XDP context (`data`, `end` its packet, `ifindex` the
// interface it came in by).
static __always_inline long route_ctx(void *ctx, void *data, void *end, __u32 ifindex,
				      struct bpf_fib_lookup *fib, __u8 family, const __u32 *src,
				      const __u32 *dst, __u8 proto, __u16 sport, __u16 dport,
				      __u32 flags, __u16 extra)
{
	fib->l4_protocol = proto;
	fib->sport = sport;
	fib->dport = dport;
	fib->ifindex = ifindex;
	if (family == 4) {
		struct iphdr *ip = data + IP_OFF;
		if ((void *)(ip + 1) > end)
			return -1;
		fib->family = 2; // AF_INET
		fib->tot_len = __builtin_bswap16(ip->tot_len) + extra;
		fib->ipv4_src = src[0];
		fib->ipv4_dst = dst[0];
	} else {
		struct ipv6hdr *ip6 = data + IP_OFF;
		if ((void *)(ip6 + 1) > end)
			return -1;
		fib->family = 10; // AF_INET6
		fib->tot_len = __builtin_bswap16(ip6->payload_len) + 40 + extra;
		copy(fib->ipv6_src, src);
		copy(fib->ipv6_dst, dst);
	}
	return bpf_fib_lookup(ctx, fib, sizeof(*fib), flags);
}

static __always_inline long route(struct __sk_buff *skb, struct bpf_fib_lookup *fib, __u8 family,
				  const __u32 *src, const __u32 *dst, __u8 proto, __u16 sport,
				  __u16 dport, __u32 flags, __u16 extra)
{
	return route_ctx(skb, (void *)(long)skb->data, (void *)(long)skb->data_end,
			 skb->ingress_ifindex, fib, family, src, dst, proto, sport, dport, flags,
			 extra);
}

// Sends a translated packet where its route (`rc`, `fib`) says, past the
// stack; where the route needs what only the stack does (no forwarding on
// this interface, an unreachable destination, fragmentation), the stack
// takes the translated packet.
static __always_inline int send(struct __sk_buff *skb, long rc, struct bpf_fib_lookup *fib)
{
	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		void *data = (void *)(long)skb->data;
		void *end = (void *)(long)skb->data_end;
		struct ethhdr *eth = data;
		if ((void *)(eth + 1) > end)
			return TC_ACT_OK;
		__builtin_memcpy(eth->h_dest, fib->dmac, ETH_ALEN);
		__builtin_memcpy(eth->h_source, fib->smac, ETH_ALEN);
		count(KP_STAT_TC);
		return bpf_redirect(fib->ifindex, 0);
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		count(KP_STAT_TC);
		return bpf_redirect_neigh(fib->ifindex, 0, 0, 0);
	}
	return TC_ACT_OK;
}

// A packet of a known flow: translated as its entry says, then sent.
static __always_inline int forward(struct __sk_buff *skb, const struct flow *f, const struct nat *n)
{
	if (!rewrite(skb, f, n))
		return TC_ACT_SHOT;
	struct bpf_fib_lookup fib = {};
	long rc = route(skb, &fib, f->family, n->saddr, n->daddr, f->proto, n->sport, n->dport, 0, 0);
	return send(skb, rc, &fib);
}

// Whether the route an entry holds may be used for a frame of `len` bytes:
// asked in the current generation, less than ROUTE_TTL_NS ago, for a frame
// at least as long (the FIB's MTU check).
static __always_inline int route_fresh(const struct nat *n, const struct gen *g, __u64 now,
				       __u32 len)
{
	return n->ifindex && g && n->route_gen == g->route && now - n->route_at < ROUTE_TTL_NS &&
	       len <= n->route_len;
}

// Keeps the FIB's answer (a success) in the entry, for the flow's next
// packets.
static __always_inline void remember_route(struct nat *n, const struct gen *g,
					   const struct bpf_fib_lookup *fib, __u64 now, __u32 len)
{
	if (!g)
		return;
	__u16 l = len > 0xffff ? 0xffff : len;
	int kept = n->ifindex == fib->ifindex && n->route_gen == g->route &&
		   now - n->route_at < ROUTE_TTL_NS;
	if (!kept || l > n->route_len)
		n->route_len = l;
	__builtin_memcpy(n->dmac, fib->dmac, ETH_ALEN);
	__builtin_memcpy(n->smac, fib->smac, ETH_ALEN);
	n->ifindex = fib->ifindex;
	n->route_gen = g->route;
	n->route_at = now;
}

// A packet of an established flow (`n` its entry in kp_np_flows): the
// checksum differences and the route the entry holds; the FIB is asked
// only when the route is stale, and its answer kept.
static __always_inline int forward_known(struct __sk_buff *skb, const struct flow *f,
					 struct nat *n, const struct gen *g)
{
	if (!rewrite_known(skb, f, n))
		return TC_ACT_SHOT;
	__u64 now = bpf_ktime_get_coarse_ns();
	if (route_fresh(n, g, now, skb->len)) {
		void *data = (void *)(long)skb->data;
		void *end = (void *)(long)skb->data_end;
		struct ethhdr *eth = data;
		if ((void *)(eth + 1) > end)
			return TC_ACT_OK;
		__builtin_memcpy(eth->h_dest, n->dmac, ETH_ALEN);
		__builtin_memcpy(eth->h_source, n->smac, ETH_ALEN);
		count(KP_STAT_TC);
		return bpf_redirect(n->ifindex, 0);
	}
	struct bpf_fib_lookup fib = {};
	long rc = route(skb, &fib, f->family, n->saddr, n->daddr, f->proto, n->sport, n->dport, 0, 0);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS)
		remember_route(n, g, &fib, now, skb->len);
	return send(skb, rc, &fib);
}

#endif
