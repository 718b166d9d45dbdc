// Translation: a new flow's endpoint and source, the entries its packets
// and replies find, and rewriting a packet as an entry says.
#ifndef KP_LIB_NAT_H
#define KP_LIB_NAT_H

#include "csum.h"

// nat.backend.pad of a flow entry: the flow is DSR (its UDP packets carry
// the option). The member check clears it.
#define KP_NAT_DSR 1
// nat.backend.pad: a flow whose endpoint is this node itself (a hostNetwork
// endpoint): left to the stack, where nftables DNATs it and conntrack
// translates the replies of the local process (which leave by no pod
// interface, so kp_np_from_pod would never see them).
#define KP_NAT_PASS 2
// nat.backend.pad: a reply entry (endpoint -> node or client), translated
// back to Service -> client.
#define KP_NAT_REPLY 4

// How long a flow's cached route is trusted without asking the FIB again,
// whatever the generation says (a neighbour's new MAC, a route the proxy
// was not told of): Cilium's CT entries keep theirs no longer than this.
#define ROUTE_TTL_NS 1000000000ULL

static __always_inline struct gen *generation(void)
{
	__u32 z = 0;
	return bpf_map_lookup_elem(&kp_np_gen, &z);
}

// An entry of kp_np_scratch, zeroed.
static __always_inline struct nat *scratch(__u32 i)
{
	struct nat *n = bpf_map_lookup_elem(&kp_np_scratch, &i);
	if (n)
		__builtin_memset(n, 0, sizeof(*n));
	return n;
}

// The checksum differences of packets arriving as `f` rewritten to `n`,
// computed once when the entry is made.
static __always_inline void flow_deltas(struct nat *n, const struct flow *f)
{
	n->csum_addr = 0;
	n->csum_port = 0;
	if (f->family == 4) {
		__u32 from[2] = { f->saddr[0], f->daddr[0] }, to[2] = { n->saddr[0], n->daddr[0] };
		if (from[0] != to[0] || from[1] != to[1])
			n->csum_addr = bpf_csum_diff(from, 8, to, 8, 0);
	} else if (!same(f->saddr, n->saddr) || !same(f->daddr, n->daddr)) {
		__u32 from[8], to[8];
		__builtin_memcpy(from, f->saddr, 32);
		__builtin_memcpy(to, n->saddr, 32);
		n->csum_addr = bpf_csum_diff(from, 32, to, 32, 0);
	}
	__u32 pf, pt;
	__builtin_memcpy(&pf, &f->sport, 4);
	__builtin_memcpy(&pt, &n->sport, 4);
	if (pf != pt)
		n->csum_port = bpf_csum_diff(&pf, 4, &pt, 4, 0);
}

// Source ports the node's SNAT takes when the client's own is taken.
#define SNAT_PORT_MIN 32768
#define SNAT_PORT_SPAN 28232 // up to 60999, the kernel's default range
#define SNAT_TRIES 8

// rewrite() for IPv4 in five helper calls instead of up to ten: the new
// header (addresses, TTL, its checksum computed afresh) and ports written
// in one store, and the TCP/UDP checksum changed by recsum_l4's two
// differences.
static __always_inline int rewrite4(struct __sk_buff *skb, const struct flow *f,
				    const struct nat *n, __u32 csum, __u64 l4)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + IP_OFF;
	if ((void *)ip + 24 > end)
		return 0;
	__u32 h[6];
	__builtin_memcpy(h, ip, 20);
	struct iphdr *nh = (void *)h;
	nh->saddr = n->saddr[0];
	nh->daddr = n->daddr[0];
	nh->ttl -= 1;
	nh->check = 0;
	nh->check = ip_csum((void *)h, 10);
	__builtin_memcpy(&h[5], &n->sport, 4); // sport, dport: as on the wire
	if (csum) {
		__u32 from[2] = { f->saddr[0], f->daddr[0] }, to[2] = { n->saddr[0], n->daddr[0] };
		int moved = from[0] != to[0] || from[1] != to[1];
		if (!recsum_l4(skb, csum, l4, from, to, moved ? 8 : 0, f, n))
			return 0;
	}
	return bpf_skb_store_bytes(skb, IP_OFF, h, 24, 0) == 0;
}

// The same for IPv6: one store of the fixed header (addresses, hop limit)
// and the ports, and the two differences, where each changed 32-bit word
// of an address took a call of its own.
static __always_inline int rewrite6(struct __sk_buff *skb, const struct flow *f,
				    const struct nat *n, __u32 csum, __u64 l4)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ipv6hdr *ip6 = data + IP_OFF;
	if ((void *)ip6 + 44 > end)
		return 0;
	__u32 h[11];
	__builtin_memcpy(h, ip6, 40);
	struct ipv6hdr *nh = (void *)h;
	nh->hop_limit -= 1;
	__builtin_memcpy(&nh->saddr, n->saddr, 16);
	__builtin_memcpy(&nh->daddr, n->daddr, 16);
	__builtin_memcpy(&h[10], &n->sport, 4);
	if (csum) {
		// saddr and daddr are adjacent in both structs: 32 bytes each.
		int moved = !same(f->saddr, n->saddr) || !same(f->daddr, n->daddr);
		if (!recsum_l4(skb, csum, l4, (__u32 *)f->saddr, (__u32 *)n->saddr, moved ? 32 : 0,
			       f, n))
			return 0;
	}
	return bpf_skb_store_bytes(skb, IP_OFF, h, 44, 0) == 0;
}

// Rewrites a packet's addresses and ports from `f` to `n`, with the
// checksums, and takes one from its TTL or hop limit (it is forwarded).
static __always_inline int rewrite(struct __sk_buff *skb, const struct flow *f,
				   const struct nat *n)
{
	int v4 = f->family == 4;
	__u32 l4off = v4 ? L4_OFF4 : L4_OFF6;
	__u32 csum = l4off + (f->proto == IPPROTO_TCP ? 16 : 6);
	// A UDP checksum of 0 means none: it stays 0 (BPF_F_MARK_MANGLED_0).
	__u64 l4 = f->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
	return v4 ? rewrite4(skb, f, n, csum, l4) : rewrite6(skb, f, n, csum, l4);
}

// rewrite() for a packet of a known flow: the checksum differences the
// entry holds (flow_deltas), no bpf_csum_diff per packet.
static __always_inline int rewrite_known(struct __sk_buff *skb, const struct flow *f,
					 const struct nat *n)
{
	int v4 = f->family == 4;
	__u32 csum = (v4 ? L4_OFF4 : L4_OFF6) + (f->proto == IPPROTO_TCP ? 16 : 6);
	__u64 l4 = f->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
	// The addresses' with the pseudo-header flag (the helper also updates a
	// CHECKSUM_PARTIAL packet's field), the ports' without.
	if (n->csum_addr &&
	    bpf_l4_csum_replace(skb, csum, 0, n->csum_addr, l4 | BPF_F_PSEUDO_HDR))
		return 0;
	if (n->csum_port && bpf_l4_csum_replace(skb, csum, 0, n->csum_port, l4))
		return 0;
	return v4 ? rewrite4(skb, f, n, 0, 0) : rewrite6(skb, f, n, 0, 0);
}

// A new flow's translation and the entry its replies will find; 0 when no
// source port of the node is free for it (the stack takes it then).
// `snat`: the node's address towards the endpoint (all 0: none known).
static __always_inline int translate(const struct flow *f, const struct svc_val *svc,
				     const struct backend_val *b, const __u32 *snat, struct nat *n)
{
	copy(n->daddr, b->addr);
	n->dport = b->port;
	n->svc_id = svc->id;
	n->backend = *b;
	copy(n->saddr, f->saddr);
	n->sport = f->sport;
	if (!(svc->flags & KP_F_LOCAL)) {
		if (snat[0] | snat[1] | snat[2] | snat[3]) {
			copy(n->saddr, snat);
		} else {
			__u32 idx = f->family == 4 ? 0 : 1;
			struct node_addr *na = bpf_map_lookup_elem(&kp_np_node, &idx);
			if (!na || !(na->addr[0] | na->addr[1] | na->addr[2] | na->addr[3]))
				return 0;
			copy(n->saddr, na->addr);
		}
	}
	struct flow r = { .family = f->family, .proto = f->proto };
	copy(r.saddr, n->daddr);
	r.sport = n->dport;
	copy(r.daddr, n->saddr);
	// The client's own port first (as masquerade does), another when an
	// other client's flow to the same endpoint holds it. Unrolled: the
	// verifier of a proxy without CAP_PERFMON explores a loop's every
	// iteration without pruning, and gives up.
	int found = 0;
#pragma unroll
	for (int i = 0; i < SNAT_TRIES; i++) {
		r.dport = n->sport;
		struct nat *held = bpf_map_lookup_elem(&kp_np_flows, &r);
		if (!held || ((held->backend.pad & KP_NAT_REPLY) && same(held->daddr, f->saddr) &&
			      held->dport == f->sport)) {
			found = 1;
			break;
		}
		if (svc->flags & KP_F_LOCAL)
			return 0; // the client's own tuple: cannot be held by another
		__u16 port = SNAT_PORT_MIN + bpf_get_prandom_u32() % SNAT_PORT_SPAN;
		n->sport = __builtin_bswap16(port);
	}
	if (!found)
		return 0;
	struct nat *back = scratch(1);
	if (!back)
		return 0;
	back->sport = f->dport;
	back->dport = f->sport;
	copy(back->saddr, f->daddr);
	copy(back->daddr, f->saddr);
	back->backend.pad = KP_NAT_REPLY;
	flow_deltas(back, &r);
	bpf_map_update_elem(&kp_np_flows, &r, back, BPF_ANY);
	return 1;
}

// A new flow's endpoint.
static __always_inline struct backend_val *pick(const struct flow *f, const struct svc_val *sv)
{
	struct backend_key bk = { .svc_id = sv->id, .slot = bpf_get_prandom_u32() % sv->count };
	if ((sv->flags & KP_F_MAGLEV) && sv->maglev_size) {
		// Every node builds the same table, so a flow (to a LoadBalancer
		// IP, say) gets the same endpoint whichever node it enters.
		__u32 h = maglev_flow_hash(f->saddr, f->daddr, f->sport, f->dport, f->proto);
		__u32 idx = h % sv->maglev_size;
		struct maglev_key mk = { .svc_id = sv->id, .chunk = idx / MAGLEV_CHUNK };
		struct maglev_val *mv = bpf_map_lookup_elem(&kp_maglev, &mk);
		// Without its chunk (a sync writing it now) the random slot stays.
		if (mv)
			bk.slot = mv->slot[idx % MAGLEV_CHUNK];
	}
	return bpf_map_lookup_elem(&kp_backends, &bk);
}

// A UDP flow stays with its endpoint while it is one (as upstream's
// conntrack flush moves it when it goes); TCP stays with it whatever
// happens, as conntrack keeps it.
// The entry says whether it was a member in the generation it names: the
// members are looked up again only when the proxy has removed one since.
static __always_inline int keeps_endpoint(const struct flow *f, struct nat *known,
					  const struct gen *g)
{
	if (f->proto != IPPROTO_UDP)
		return 1;
	if (g && known->member_gen == g->members)
		return 1;
	struct member_key mk = { .svc_id = known->svc_id, .backend = known->backend };
	mk.backend.pad = 0;
	if (!bpf_map_lookup_elem(&kp_members, &mk))
		return 0;
	if (g)
		known->member_gen = g->members;
	return 1;
}


#endif
