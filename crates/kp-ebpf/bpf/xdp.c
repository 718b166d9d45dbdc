// kp_np_xdp (kube-proxy-rs --bpf-lb-acceleration, docs/ebpf.md): the
// translation of tc.c at XDP, over the same maps (lib/maps.h).

#define KP_NODEPORT
#include "lib/route.h"

// --bpf-lb-acceleration: the same translation at XDP, before the kernel
// makes an skb, for the packets the node sends back out of the interface
// they came in by: requests to an endpoint on another node, and those
// endpoints' replies to the client. Everything else is passed on to tc's
// kp_np_external, which finds the same flow tables: a redirect from XDP
// into a pod's veth needs XDP (or GRO) on the pod's end of it, which is
// the CNI's, not ours. DSR flows (the option needs room in the packet) and
// ICMP errors are tc's too.

// A TCP or UDP checksum after the changes the entry's differences
// describe (flow_deltas: computed once per flow), RFC 1624's incremental
// update, so the payload is never read. It takes the frame's checksum to be
// complete, as a NIC delivers it; a veth may carry only its sender's
// offloaded pseudo-header sum there, so on veth the senders turn checksum
// offload off (docs/ebpf.md).
static __always_inline void apply_deltas(__u16 *sum, const struct nat *n)
{
	__u64 s = (__u16)~*sum;
	s += n->csum_addr;
	s += n->csum_port;
	s = (s & 0xffffffff) + (s >> 32);
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	*sum = ~s;
}

// Rewrites the packet from `f` to `n` in place (the checksums, one off the
// TTL) and addresses it to the next hop (`dmac`, from `smac`).
static __always_inline int xdp_rewrite(struct xdp_md *ctx, const struct flow *f,
				       const struct nat *n, const __u8 *dmac, const __u8 *smac)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return 0;
	int tcp = f->proto == IPPROTO_TCP;
	__u32 new_ports;
	__builtin_memcpy(&new_ports, &n->sport, 4);
	if (f->family == 4) {
		struct iphdr *ip = (void *)(eth + 1);
		__u8 *l4 = (void *)(ip + 1);
		__u16 *sum = l4_csum_field(l4, end, tcp);
		if (!sum)
			return 0;
		// IPv4's UDP without a checksum (0) stays without; one that
		// comes out 0 is sent as 0xffff.
		if (tcp || *sum) {
			apply_deltas(sum, n);
			if (!tcp && !*sum)
				*sum = 0xffff;
		}
		ip->saddr = n->saddr[0];
		ip->daddr = n->daddr[0];
		__builtin_memcpy(l4, &new_ports, 4);
		ip->ttl--;
		ip->check = 0;
		ip->check = ip_csum((void *)ip, 10);
	} else {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		__u8 *l4 = (void *)(ip6 + 1);
		__u16 *sum = l4_csum_field(l4, end, tcp);
		if (!sum)
			return 0;
		apply_deltas(sum, n);
		if (!tcp && !*sum)
			*sum = 0xffff;
		__builtin_memcpy(&ip6->saddr, n->saddr, 16);
		__builtin_memcpy(&ip6->daddr, n->daddr, 16);
		__builtin_memcpy(l4, &new_ports, 4);
		ip6->hop_limit--;
	}
	__builtin_memcpy(eth->h_dest, dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, smac, ETH_ALEN);
	count(KP_STAT_XDP);
	return 1;
}

// The frame's length as its IP header says (pointer minus pointer, which
// data_end - data would be, is refused without CAP_PERFMON): what the
// route cache's MTU check compares; 0xffff (no cached route is used) when
// the header is not there.
static __always_inline __u32 frame_len(struct xdp_md *ctx, int v4)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	if (v4) {
		struct iphdr *ip = data + IP_OFF;
		if ((void *)(ip + 1) > end)
			return 0xffff;
		return IP_OFF + __builtin_bswap16(ip->tot_len);
	}
	struct ipv6hdr *ip6 = data + IP_OFF;
	if ((void *)(ip6 + 1) > end)
		return 0xffff;
	return IP_OFF + 40 + __builtin_bswap16(ip6->payload_len);
}

// A packet of a known flow, translated as `n` says and sent back out
// where the route leaves by the interface it came in by; passed on
// otherwise.
static __attribute__((noinline)) int xdp_forward(struct xdp_md *ctx, const struct flow *f,
						 struct nat *n, const struct gen *g)
{
	__u64 now = bpf_ktime_get_coarse_ns();
	__u32 len = frame_len(ctx, f->family == 4);
	if (route_fresh(n, g, now, len)) {
		if (n->ifindex != ctx->ingress_ifindex)
			return XDP_PASS;
		return xdp_rewrite(ctx, f, n, n->dmac, n->smac) ? XDP_TX : XDP_PASS;
	}
	struct bpf_fib_lookup fib = {};
	long rc = route_ctx(ctx, (void *)(long)ctx->data, (void *)(long)ctx->data_end,
			    ctx->ingress_ifindex, &fib, f->family, n->saddr, n->daddr, f->proto,
			    n->sport, n->dport, 0, 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return XDP_PASS;
	remember_route(n, g, &fib, now, len);
	if (fib.ifindex != ctx->ingress_ifindex)
		return XDP_PASS;
	return xdp_rewrite(ctx, f, n, fib.dmac, fib.smac) ? XDP_TX : XDP_PASS;
}

// A new flow: its endpoint, and if that is on another node the
// translation (the entries tc would make) and the packet sent on.
static __attribute__((noinline)) int xdp_new(struct xdp_md *ctx, const struct flow *f)
{
	struct svc_key k = { .port = f->dport, .proto = f->proto, .family = KP_OUTSIDE | f->family };
	copy(k.addr, f->daddr);
	struct svc_val *svc = bpf_map_lookup_elem(&kp_services, &k);
	if (!svc || svc->count == 0 || (svc->flags & KP_F_DSR))
		return XDP_PASS;
	// The entries read in place (XDP's frames and tc's share 512 bytes of
	// stack); a sync rewriting them meanwhile gives this flow the old or
	// the new endpoint, both serving.
	struct gen *g = generation();
	__u32 members = g ? g->members : 0;
	struct backend_val *b = pick(f, svc);
	if (!b)
		return XDP_PASS;
	struct bpf_fib_lookup fib = {};
	long rc = route_ctx(ctx, (void *)(long)ctx->data, (void *)(long)ctx->data_end,
			    ctx->ingress_ifindex, &fib, f->family, f->saddr, b->addr, f->proto,
			    f->sport, b->port, BPF_FIB_LOOKUP_SRC, 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS || fib.ifindex != ctx->ingress_ifindex)
		return XDP_PASS;
	__u32 snat[4] = {};
	if (f->family == 4)
		snat[0] = fib.ipv4_src;
	else
		copy(snat, fib.ipv6_src);
	struct nat *n = scratch(0);
	if (!n || !translate(f, svc, b, snat, n))
		return XDP_PASS;
	n->member_gen = members;
	flow_deltas(n, f);
	// The route was asked with the client's source: the SNAT source takes
	// the same one (the endpoint is not on this node's own link otherwise).
	__u32 len = frame_len(ctx, f->family == 4);
	remember_route(n, g, &fib, bpf_ktime_get_coarse_ns(), len);
	bpf_map_update_elem(&kp_np_flows, f, n, BPF_ANY);
	return xdp_rewrite(ctx, f, n, fib.dmac, fib.smac) ? XDP_TX : XDP_PASS;
}

SEC("xdp") int kp_np_xdp(struct xdp_md *ctx)
{
	struct flow f = {};
	__u8 ttl, syn;
	if (!parse((void *)(long)ctx->data, (void *)(long)ctx->data_end, &f, &ttl, &syn) ||
	    ttl <= 1)
		return XDP_PASS;
	struct gen *g = generation();
	struct nat *known = bpf_map_lookup_elem(&kp_np_flows, &f);
	if (known) {
		if (known->backend.pad & KP_NAT_REPLY)
			return xdp_forward(ctx, &f, known, g);
		if (syn || (known->backend.pad & (KP_NAT_PASS | KP_NAT_DSR)) ||
		    !keeps_endpoint(&f, known, g))
			return XDP_PASS;
		return xdp_forward(ctx, &f, known, g);
	}
	if (f.proto == IPPROTO_TCP && !syn)
		return XDP_PASS;
	return xdp_new(ctx, &f);
}

char _license[] SEC("license") = "Dual MIT/GPL";
