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

#include "common.h"

// The UAPI headers make this a mere hint; inlined for real, the whole
// program is one frame whose stack the compiler can share between paths
// (the verifier's limit, 512 bytes, counts every frame of a call chain).
#undef __always_inline
#define __always_inline inline __attribute__((always_inline))

#include "maglev.h"
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>


static long (*bpf_skb_store_bytes)(struct __sk_buff *skb, __u32 offset, const void *from,
				   __u32 len, __u64 flags) = (void *)9;
static long (*bpf_l3_csum_replace)(struct __sk_buff *skb, __u32 offset, __u64 from, __u64 to,
				   __u64 size) = (void *)10;
static long (*bpf_l4_csum_replace)(struct __sk_buff *skb, __u32 offset, __u64 from, __u64 to,
				   __u64 flags) = (void *)11;
static long (*bpf_redirect)(__u32 ifindex, __u64 flags) = (void *)23;
static long (*bpf_skb_change_tail)(struct __sk_buff *skb, __u32 len, __u64 flags) = (void *)38;
static long (*bpf_fib_lookup)(void *ctx, struct bpf_fib_lookup *params, int plen,
			      __u32 flags) = (void *)69;
static long (*bpf_redirect_neigh)(__u32 ifindex, void *params, int plen,
				  __u64 flags) = (void *)152;
static long (*bpf_skb_adjust_room)(struct __sk_buff *skb, __s32 len_diff, __u32 mode,
				   __u64 flags) = (void *)50;
static __s64 (*bpf_csum_diff)(__u32 *from, __u32 from_size, __u32 *to, __u32 to_size,
			      __u32 seed) = (void *)28;

#define KP_F_LOCAL 1 // svc_val.flags: externalTrafficPolicy Local (no SNAT)
#define KP_F_MAGLEV 2 // svc_val.flags: the endpoint from the Maglev table
#define KP_F_DSR 4 // svc_val.flags: direct server return (--bpf-lb-mode dsr, hybrid)

// nat.backend.pad of a flow entry: the flow is DSR (its UDP packets carry
// the option). The member check clears it.
#define KP_NAT_DSR 1
// nat.backend.pad: a flow whose endpoint is this node itself (a hostNetwork
// endpoint): left to the stack, where nftables DNATs it and conntrack
// translates the replies of the local process (which leave by no pod
// interface, so kp_np_from_pod would never see them).
#define KP_NAT_PASS 2

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

#define IP_OFF 14 // after the Ethernet header
#define IP_CSUM_OFF (IP_OFF + 10)
#define IP_SRC_OFF (IP_OFF + 12)
#define IP_DST_OFF (IP_OFF + 16)
#define L4_OFF4 (IP_OFF + 20) // no IP options: those go to the stack
#define IP6_HOP_OFF (IP_OFF + 7)
#define IP6_SRC_OFF (IP_OFF + 8)
#define IP6_DST_OFF (IP_OFF + 24)
#define L4_OFF6 (IP_OFF + 40) // no extension headers: those go to the stack

// Source ports the node's SNAT takes when the client's own is taken.
#define SNAT_PORT_MIN 32768
#define SNAT_PORT_SPAN 28232 // up to 60999, the kernel's default range
#define SNAT_TRIES 8

// A packet's addresses and ports as it arrives (network order). Laid out
// without implicit padding: the hash covers every byte.
struct flow {
	__u32 saddr[4];
	__u32 daddr[4];
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 family;
	__u16 pad;
};

// What to rewrite a packet of a flow to. `svc_id` and `backend` name the
// Service port and endpoint a request flow went to (0 in reply entries).
struct nat {
	__u32 saddr[4];
	__u32 daddr[4];
	__u16 sport;
	__u16 dport;
	__u32 svc_id;
	struct backend_val backend;
};

// The node's own addresses, for SNAT where the kernel names none: [0]
// IPv4, [1] IPv6 (written by the proxy at start).
struct node_addr {
	__u32 addr[4];
};

// Client -> Service flows and their translation.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 131072);
	__type(key, struct flow);
	__type(value, struct nat);
	__uint(pinning, PIN_BY_NAME);
} kp_np_flows SEC(".maps");

// Endpoint -> node (or client) flows, the replies, and their translation
// back to Service -> client.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 131072);
	__type(key, struct flow);
	__type(value, struct nat);
	__uint(pinning, PIN_BY_NAME);
} kp_np_replies SEC(".maps");

// Each Service port's Maglev table (--bpf-lb-algorithm maglev), in chunks
// of MAGLEV_CHUNK slots (maglev.h): 100k Services of 10 endpoints are 1.6M
// chunks.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4194304);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct maglev_key);
	__type(value, struct maglev_val);
	__uint(pinning, PIN_BY_NAME);
} kp_maglev SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct node_addr);
	__uint(pinning, PIN_BY_NAME);
} kp_np_node SEC(".maps");

// What the programs did, per CPU (bpftool map dump pinned .../kp_np_stats):
// packets translated and sent on by tc, and by XDP.
#define KP_STAT_TC 0
#define KP_STAT_XDP 1
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, PIN_BY_NAME);
} kp_np_stats SEC(".maps");

static __always_inline void count(__u32 what)
{
	__u64 *c = bpf_map_lookup_elem(&kp_np_stats, &what);
	if (c)
		*c += 1;
}

struct ports {
	__u16 source;
	__u16 dest;
};

static __always_inline int same(const __u32 *a, const __u32 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

static __always_inline void copy(__u32 *to, const __u32 *from)
{
	to[0] = from[0];
	to[1] = from[1];
	to[2] = from[2];
	to[3] = from[3];
}

// Reads the packet's flow (and where its ports are); 0 when the programs
// leave it to the stack.
static __always_inline int parse(void *data, void *end, struct flow *f, __u8 *ttl, __u8 *syn)
{
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return 0;
	struct ports *p;
	if (eth->h_proto == __builtin_bswap16(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end || ip->ihl != 5)
			return 0;
		// Fragments: only the first has the ports; the stack reassembles.
		if (ip->frag_off & __builtin_bswap16(0x3fff))
			return 0;
		f->proto = ip->protocol;
		f->family = 4;
		f->saddr[0] = ip->saddr;
		f->daddr[0] = ip->daddr;
		*ttl = ip->ttl;
		p = (void *)(ip + 1);
	} else if (eth->h_proto == __builtin_bswap16(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return 0;
		f->proto = ip6->nexthdr;
		f->family = 6;
		__builtin_memcpy(f->saddr, &ip6->saddr, 16);
		__builtin_memcpy(f->daddr, &ip6->daddr, 16);
		*ttl = ip6->hop_limit;
		p = (void *)(ip6 + 1);
	} else {
		return 0;
	}
	if (f->proto != IPPROTO_TCP && f->proto != IPPROTO_UDP)
		return 0;
	if ((void *)(p + 1) > end)
		return 0;
	*syn = 0;
	if (f->proto == IPPROTO_TCP) {
		__u8 *flags = (__u8 *)p + 13;
		if ((void *)(flags + 1) > end)
			return 0;
		// SYN without ACK: a new connection, even on a tuple seen before.
		*syn = (*flags & 0x12) == 0x02;
	}
	f->sport = p->source;
	f->dport = p->dest;
	return 1;
}

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
	__u32 from[2] = { f->saddr[0], f->daddr[0] }, to[2] = { n->saddr[0], n->daddr[0] };
	int moved = from[0] != to[0] || from[1] != to[1];
	return recsum_l4(skb, csum, l4, from, to, moved ? 8 : 0, f, n) &&
	       bpf_skb_store_bytes(skb, IP_OFF, h, 24, 0) == 0;
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
	// saddr and daddr are adjacent in both structs: 32 bytes each.
	int moved = !same(f->saddr, n->saddr) || !same(f->daddr, n->daddr);
	return recsum_l4(skb, csum, l4, (__u32 *)f->saddr, (__u32 *)n->saddr, moved ? 32 : 0, f,
			 n) &&
	       bpf_skb_store_bytes(skb, IP_OFF, h, 44, 0) == 0;
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
	struct nat back = { .sport = f->dport, .dport = f->sport };
	copy(back.saddr, f->daddr);
	copy(back.daddr, f->saddr);
	// The client's own port first (as masquerade does), another when an
	// other client's flow to the same endpoint holds it.
	for (int i = 0; i < SNAT_TRIES; i++) {
		r.dport = n->sport;
		struct nat *held = bpf_map_lookup_elem(&kp_np_replies, &r);
		if (!held || (same(held->daddr, f->saddr) && held->dport == f->sport)) {
			bpf_map_update_elem(&kp_np_replies, &r, &back, BPF_ANY);
			return 1;
		}
		if (svc->flags & KP_F_LOCAL)
			return 0; // the client's own tuple: cannot be held by another
		__u16 port = SNAT_PORT_MIN + bpf_get_prandom_u32() % SNAT_PORT_SPAN;
		n->sport = __builtin_bswap16(port);
	}
	return 0;
}

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
	struct nat back = { .sport = svc_port, .dport = f.sport };
	copy(back.saddr, svc_addr);
	copy(back.daddr, f.saddr);
	struct nat *had = bpf_map_lookup_elem(&kp_np_replies, &r);
	if (!had || !same(had->saddr, svc_addr) || had->sport != svc_port)
		bpf_map_update_elem(&kp_np_replies, &r, &back, BPF_ANY);
	// The request goes on as it is (already translated by the first node).
	struct nat n = { .sport = f.sport, .dport = f.dport };
	copy(n.saddr, f.saddr);
	copy(n.daddr, f.daddr);
	if (f.proto == IPPROTO_TCP)
		bpf_map_update_elem(&kp_np_flows, &f, &n, BPF_ANY);
	return forward(skb, &f, &n);
}

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
	struct nat *t = bpf_map_lookup_elem(&kp_np_replies, &r);
	int about_reply = !t;
	if (about_reply) {
		t = bpf_map_lookup_elem(&kp_np_flows, &r);
		if (!t || (t->backend.pad & KP_NAT_PASS))
			return -1;
	}
	// What the quote becomes (its source, destination and ports), and the
	// outer header's new source and destination: from whoever wrote the
	// error, but the Service address where an endpoint wrote one about a
	// request.
	struct nat quote = { .sport = t->dport, .dport = t->sport }, n = {};
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
static __always_inline int keeps_endpoint(const struct flow *f, const struct nat *known)
{
	if (f->proto != IPPROTO_UDP)
		return 1;
	struct member_key mk = { .svc_id = known->svc_id, .backend = known->backend };
	mk.backend.pad = 0;
	return bpf_map_lookup_elem(&kp_members, &mk) != 0;
}

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

// --bpf-lb-acceleration: the same translation at XDP, before the kernel
// makes an skb, for the packets the node sends back out of the interface
// they came in by: requests to an endpoint on another node, and those
// endpoints' replies to the client. Everything else is passed on to tc's
// kp_np_external, which finds the same flow tables: a redirect from XDP
// into a pod's veth needs XDP (or GRO) on the pod's end of it, which is
// the CNI's, not ours. DSR flows (the option needs room in the packet) and
// ICMP errors are tc's too.

// A TCP or UDP checksum at `sum` after `bytes` of what it covers (the
// addresses of its pseudo-header, the ports) change from `from` to `to`:
// RFC 1624's incremental update, so the payload is never read. It takes
// the frame's checksum to be complete, as a NIC delivers it; a veth may
// carry only its sender's offloaded pseudo-header sum there, so on veth
// the senders turn checksum offload off (docs/ebpf.md).
static __always_inline void recsum(__u16 *sum, __u32 *from, __u32 *to, __u32 bytes)
{
	__s64 d = bpf_csum_diff(from, bytes, to, bytes, (__u16)~*sum);
	__u32 s = d;
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	*sum = ~s;
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

// Rewrites the packet from `f` to `n` in place (the checksums, one off the
// TTL) and addresses it to the route's next hop.
static __always_inline int xdp_rewrite(struct xdp_md *ctx, const struct flow *f,
				       const struct nat *n, const struct bpf_fib_lookup *fib)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return 0;
	int tcp = f->proto == IPPROTO_TCP;
	__u32 old_ports, new_ports;
	__builtin_memcpy(&old_ports, &f->sport, 4);
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
			__u32 from[3] = { f->saddr[0], f->daddr[0], old_ports };
			__u32 to[3] = { n->saddr[0], n->daddr[0], new_ports };
			recsum(sum, from, to, sizeof(from));
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
		__u32 from[9], to[9];
		copy(from, f->saddr);
		copy(from + 4, f->daddr);
		from[8] = old_ports;
		copy(to, n->saddr);
		copy(to + 4, n->daddr);
		to[8] = new_ports;
		recsum(sum, from, to, sizeof(from));
		if (!tcp && !*sum)
			*sum = 0xffff;
		__builtin_memcpy(&ip6->saddr, n->saddr, 16);
		__builtin_memcpy(&ip6->daddr, n->daddr, 16);
		__builtin_memcpy(l4, &new_ports, 4);
		ip6->hop_limit--;
	}
	__builtin_memcpy(eth->h_dest, fib->dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, fib->smac, ETH_ALEN);
	count(KP_STAT_XDP);
	return 1;
}

// A packet of a known flow, translated as `n` says and sent back out
// where the route leaves by the interface it came in by; passed on
// otherwise.
static __attribute__((noinline)) int xdp_forward(struct xdp_md *ctx, const struct flow *f,
						 const struct nat *n)
{
	struct bpf_fib_lookup fib = {};
	long rc = route_ctx(ctx, (void *)(long)ctx->data, (void *)(long)ctx->data_end,
			    ctx->ingress_ifindex, &fib, f->family, n->saddr, n->daddr, f->proto,
			    n->sport, n->dport, 0, 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS || fib.ifindex != ctx->ingress_ifindex)
		return XDP_PASS;
	return xdp_rewrite(ctx, f, n, &fib) ? XDP_TX : XDP_PASS;
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
	struct nat n = {};
	if (!translate(f, svc, b, snat, &n))
		return XDP_PASS;
	bpf_map_update_elem(&kp_np_flows, f, &n, BPF_ANY);
	// The route was asked with the client's source: the SNAT source takes
	// the same one (the endpoint is not on this node's own link otherwise).
	return xdp_rewrite(ctx, f, &n, &fib) ? XDP_TX : XDP_PASS;
}

SEC("xdp") int kp_np_xdp(struct xdp_md *ctx)
{
	struct flow f = {};
	__u8 ttl, syn;
	if (!parse((void *)(long)ctx->data, (void *)(long)ctx->data_end, &f, &ttl, &syn) ||
	    ttl <= 1)
		return XDP_PASS;
	struct nat *r = bpf_map_lookup_elem(&kp_np_replies, &f);
	if (r)
		return xdp_forward(ctx, &f, r);
	struct nat *known = bpf_map_lookup_elem(&kp_np_flows, &f);
	if (known) {
		if (syn || (known->backend.pad & (KP_NAT_PASS | KP_NAT_DSR)) ||
		    !keeps_endpoint(&f, known))
			return XDP_PASS;
		return xdp_forward(ctx, &f, known);
	}
	if (f.proto == IPPROTO_TCP && !syn)
		return XDP_PASS;
	return xdp_new(ctx, &f);
}

char _license[] SEC("license") = "Dual MIT/GPL";
