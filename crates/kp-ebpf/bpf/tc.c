// NodePorts, LoadBalancer IPs and external IPs for traffic from outside the
// node, at tc (kube-proxy-rs --bpf-nodeport, docs/ebpf.md).
//
// kp_np_external runs at tc ingress of the node's external interfaces (those
// holding its addresses): a packet to a Service address with an entry of
// family KP_OUTSIDE|4 or KP_OUTSIDE|6 in kp_services gets an endpoint and is translated
// (the client's source kept for externalTrafficPolicy Local, the node's
// address and a port of its own for Cluster, as upstream masquerades), then
// sent straight to the interface the route to the endpoint names: neither
// netfilter nor conntrack sees it. Its replies come back translated from the
// program's own flow tables: kp_np_external takes those of endpoints on
// other nodes, kp_np_from_pod (tc ingress of every other interface: the
// pods' veths, a CNI bridge) those of endpoints on this node.
//
// With --bpf-lb-mode dsr (or hybrid, for TCP) an eTP=Cluster flow to an
// endpoint on another node keeps the client's source and carries the
// Service address to that node in an IPv4 option or an IPv6 destination
// options header; that node's kp_np_external (dsr_in) strips it and
// remembers it, so its kp_np_from_pod sends the reply to the client
// directly.
//
// Whatever has no entry goes on to the stack unchanged, where nftables
// handles it as before: Services without endpoints (reject), session
// affinity, loadBalancerSourceRanges, eTP=Local without a local endpoint
// (drop), IPv4 options, IPv6 extension headers, fragments, SCTP, ICMP but
// the errors about translated flows (icmp_error).

#define KP_NODEPORT
#include "lib/dsr.h"
#include "lib/icmp.h"

static __attribute__((noinline)) int outside(struct __sk_buff *skb)
{
	struct flow f = {};
	__u8 ttl, syn;
	if (!parse((void *)(long)skb->data, (void *)(long)skb->data_end, &f, &ttl, &syn) ||
	    ttl <= 1)
		return TC_ACT_OK;
	struct gen *g = generation();
	// One lookup: the entry says what the packet is. Map values are read
	// (and their route kept) in place.
	struct nat *known = bpf_map_lookup_elem(&kp_np_flows, &f);
	if (known) {
		__u16 kind = known->backend.pad;
		if (kind & KP_NAT_REPLY)
			return forward_known(skb, &f, known, g);
		if (kind & KP_NAT_PASS)
			return TC_ACT_OK;
		if (!syn && keeps_endpoint(&f, known, g)) {
			// A DSR flow's UDP packets each carry the option (the
			// endpoint's node may have lost the flow): routed anew for
			// the longer packet, with the MTU answer.
			if ((kind & KP_NAT_DSR) && f.proto == IPPROTO_UDP)
				return dsr_send(skb, &f, known, 0);
			return forward_known(skb, &f, known, g);
		}
	}
	// A TCP packet of a connection the programs did not start (one that
	// began before they were attached, when nftables and conntrack took
	// it) stays theirs: only a SYN starts a translation here.
	if (f.proto == IPPROTO_TCP && !syn)
		return TC_ACT_OK;
	struct svc_key k = { .port = f.dport, .proto = f.proto, .family = KP_OUTSIDE | f.family };
	copy(k.addr, f.daddr);
	struct svc_val *svc = bpf_map_lookup_elem(&kp_services, &k);
	if (!svc || svc->count == 0)
		return TC_ACT_OK;
	struct svc_val sv = *svc;
	// Read before the endpoint is picked: a removal after it is seen by
	// the flow's next packet.
	__u32 members = g ? g->members : 0;
	struct backend_val *b = pick(&f, &sv);
	if (!b)
		return TC_ACT_OK;
	struct backend_val be = *b;
	// The route to the endpoint first: it names the interface, and the
	// address masquerade would take on it.
	struct bpf_fib_lookup fib = {};
	long rc = route(skb, &fib, f.family, f.saddr, be.addr, f.proto, f.sport, be.port,
			BPF_FIB_LOOKUP_SRC, 0);
	struct nat *n = scratch(0);
	if (!n)
		return TC_ACT_OK;
	if (rc == BPF_FIB_LKUP_RET_NOT_FWDED) {
		n->svc_id = sv.id;
		n->backend = be;
		n->backend.pad = KP_NAT_PASS;
		bpf_map_update_elem(&kp_np_flows, &f, n, BPF_ANY);
		return TC_ACT_OK;
	}
	__u32 snat[4] = {};
	if (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		if (f.family == 4)
			snat[0] = fib.ipv4_src;
		else
			copy(snat, fib.ipv6_src);
	}
	// DSR: an endpoint the route sends back out of the interface the
	// request came in by is on another node; it gets the client's own
	// address and the option, and its node sends the reply.
	if ((sv.flags & KP_F_DSR) && !(sv.flags & KP_F_LOCAL) &&
	    (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH) &&
	    fib.ifindex == skb->ingress_ifindex) {
		copy(n->saddr, f.saddr);
		copy(n->daddr, be.addr);
		n->sport = f.sport;
		n->dport = be.port;
		n->svc_id = sv.id;
		n->backend = be;
		n->backend.pad = KP_NAT_DSR;
		n->member_gen = members;
		flow_deltas(n, &f);
		bpf_map_update_elem(&kp_np_flows, &f, n, BPF_ANY);
		return dsr_send(skb, &f, n, 1);
	}
	if (!translate(&f, &sv, &be, snat, n))
		return TC_ACT_OK;
	n->member_gen = members;
	flow_deltas(n, &f);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS)
		remember_route(n, g, &fib, bpf_ktime_get_coarse_ns(), skb->len);
	bpf_map_update_elem(&kp_np_flows, &f, n, BPF_ANY);
	if (!rewrite_known(skb, &f, n))
		return TC_ACT_SHOT;
	return send(skb, rc, &fib);
}

static __attribute__((noinline)) int pod(struct __sk_buff *skb)
{
	struct flow f = {};
	__u8 ttl, syn;
	if (!parse((void *)(long)skb->data, (void *)(long)skb->data_end, &f, &ttl, &syn) ||
	    ttl <= 1)
		return TC_ACT_OK;
	struct nat *r = bpf_map_lookup_elem(&kp_np_flows, &f);
	if (!r || !(r->backend.pad & KP_NAT_REPLY))
		return TC_ACT_OK;
	return forward_known(skb, &f, r, generation());
}

// What a frame is, from its first headers: the DSR carrier and ICMP go
// their own ways; everything else is parsed once, by outside() or pod().
#define KP_PEEK_PLAIN 0
#define KP_PEEK_DSR 1
#define KP_PEEK_ICMP 2
static __always_inline int peek(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return KP_PEEK_PLAIN;
	if (eth->h_proto == __builtin_bswap16(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end)
			return KP_PEEK_PLAIN;
		if (ip->ihl == 7)
			return KP_PEEK_DSR;
		return ip->protocol == IPPROTO_ICMP ? KP_PEEK_ICMP : KP_PEEK_PLAIN;
	}
	if (eth->h_proto == __builtin_bswap16(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return KP_PEEK_PLAIN;
		if (ip6->nexthdr == IPPROTO_DSTOPTS)
			return KP_PEEK_DSR;
		return ip6->nexthdr == 58 ? KP_PEEK_ICMP : KP_PEEK_PLAIN;
	}
	return KP_PEEK_PLAIN;
}

SEC("classifier") int kp_np_external(struct __sk_buff *skb)
{
	int what = peek(skb);
	if (what == KP_PEEK_DSR) {
		int e = dsr_in(skb);
		if (e >= 0)
			return e;
	} else if (what == KP_PEEK_ICMP) {
		int e = icmp_error(skb);
		return e >= 0 ? e : TC_ACT_OK;
	}
	return outside(skb);
}

SEC("classifier") int kp_np_from_pod(struct __sk_buff *skb)
{
	if (peek(skb) == KP_PEEK_ICMP) {
		int e = icmp_error(skb);
		return e >= 0 ? e : TC_ACT_OK;
	}
	return pod(skb);
}

char _license[] SEC("license") = "Dual MIT/GPL";
