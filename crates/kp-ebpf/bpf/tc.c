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
	// Map values are read in place: a copy would cost stack.
	struct nat *r = bpf_map_lookup_elem(&kp_np_replies, &f);
	if (r)
		return forward(skb, &f, r);
	struct nat *known = bpf_map_lookup_elem(&kp_np_flows, &f);
	if (known && (known->backend.pad & KP_NAT_PASS))
		return TC_ACT_OK;
	if (known && !syn) {
		if (keeps_endpoint(&f, known))
			return known->backend.pad & KP_NAT_DSR ? dsr_send(skb, &f, known, 0)
							       : forward(skb, &f, known);
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
	struct backend_val *b = pick(&f, &sv);
	if (!b)
		return TC_ACT_OK;
	struct backend_val be = *b;
	// The route to the endpoint first: it names the interface, and the
	// address masquerade would take on it.
	struct bpf_fib_lookup fib = {};
	long rc = route(skb, &fib, f.family, f.saddr, be.addr, f.proto, f.sport, be.port,
			BPF_FIB_LOOKUP_SRC, 0);
	if (rc == BPF_FIB_LKUP_RET_NOT_FWDED) {
		struct nat pass = { .svc_id = sv.id, .backend = be };
		pass.backend.pad = KP_NAT_PASS;
		bpf_map_update_elem(&kp_np_flows, &f, &pass, BPF_ANY);
		return TC_ACT_OK;
	}
	__u32 snat[4] = {};
	if (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		if (f.family == 4)
			snat[0] = fib.ipv4_src;
		else
			copy(snat, fib.ipv6_src);
	}
	struct nat n = {};
	// DSR: an endpoint the route sends back out of the interface the
	// request came in by is on another node; it gets the client's own
	// address and the option, and its node sends the reply.
	if ((sv.flags & KP_F_DSR) && !(sv.flags & KP_F_LOCAL) &&
	    (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH) &&
	    fib.ifindex == skb->ingress_ifindex) {
		copy(n.saddr, f.saddr);
		copy(n.daddr, be.addr);
		n.sport = f.sport;
		n.dport = be.port;
		n.svc_id = sv.id;
		n.backend = be;
		n.backend.pad = KP_NAT_DSR;
		bpf_map_update_elem(&kp_np_flows, &f, &n, BPF_ANY);
		return dsr_send(skb, &f, &n, 1);
	}
	if (!translate(&f, &sv, &be, snat, &n))
		return TC_ACT_OK;
	bpf_map_update_elem(&kp_np_flows, &f, &n, BPF_ANY);
	if (!rewrite(skb, &f, &n))
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
	struct nat *r = bpf_map_lookup_elem(&kp_np_replies, &f);
	if (!r)
		return TC_ACT_OK;
	return forward(skb, &f, r);
}

SEC("classifier") int kp_np_external(struct __sk_buff *skb)
{
	int e = dsr_in(skb);
	if (e >= 0)
		return e;
	e = icmp_error(skb);
	return e >= 0 ? e : outside(skb);
}

SEC("classifier") int kp_np_from_pod(struct __sk_buff *skb)
{
	int e = icmp_error(skb);
	return e >= 0 ? e : pod(skb);
}

char _license[] SEC("license") = "Dual MIT/GPL";
