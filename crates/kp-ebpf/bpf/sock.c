// Socket-level load balancing for Service addresses (kube-proxy-rs, issue 21).
//
// cgroup/connect{4,6} and cgroup/sendmsg{4,6} rewrite a Service address to
// one of its endpoints before the socket ever sends a packet, so east-west
// traffic needs no per-packet NAT and no conntrack entry for the Service.
// cgroup/recvmsg{4,6} and cgroup/getpeername{4,6} put the Service address
// back where the application can see it (UDP reply sources, getpeername).
//
// Services with ClientIP session affinity are not in these maps: their
// clients go on to nftables, which keeps the only record of who went where
// (a connect() made before the Service's first sync has its SYN retransmit
// DNATed by nftables; a second store here would send the next one elsewhere).
//
// Only the UAPI context (struct bpf_sock_addr) is read, which the verifier
// rewrites for the running kernel: no kernel structure, so no CO-RE needed.
// Helpers are declared here by number to need nothing but linux/bpf.h.
//
// The shared maps and layouts are in lib/maps.h.

#include "lib/maps.h"

// What a socket was sent to instead of the Service: keyed by the socket and
// the endpoint, so that replies and getpeername name the Service again.
// Keys have no implicit padding: the hash covers every byte, and padding
// left uninitialised on the stack would make equal keys differ.
struct revnat_key {
	__u64 cookie;
	struct backend_val backend;
	__u32 pad;
};

// An unconnected UDP socket's flow to a Service: its datagrams keep going
// to one endpoint while that endpoint is a member, as a conntrack entry
// would keep them (and move on once it is gone, with no flush needed).
struct flow_key {
	__u64 cookie;
	struct svc_key svc;
	__u32 pad;
};

struct revnat_val {
	__u32 addr[4];
	__u16 port;
	__u16 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct flow_key);
	__type(value, struct backend_val);
	__uint(pinning, PIN_BY_NAME);
} kp_udp_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct revnat_key);
	__type(value, struct revnat_val);
	__uint(pinning, PIN_BY_NAME);
} kp_revnat SEC(".maps");

// Picks the endpoint for a connection to `key` into `out`; 0 leaves the
// address alone (no entry: not a Service address, or no endpoints).
static __always_inline int pick(void *ctx, const struct svc_key *key, struct backend_val *out,
				int udp_flow)
{
	struct svc_val *svc = bpf_map_lookup_elem(&kp_services, key);
	if (!svc || svc->count == 0)
		return 0;
	struct flow_key fk = {};
	if (udp_flow) {
		fk.cookie = bpf_get_socket_cookie(ctx);
		fk.svc = *key;
		struct backend_val *fb = bpf_map_lookup_elem(&kp_udp_flows, &fk);
		if (fb) {
			struct member_key mk = { .svc_id = svc->id, .backend = *fb };
			if (bpf_map_lookup_elem(&kp_members, &mk)) {
				*out = *fb;
				return 1;
			}
		}
	}
	struct backend_key bk = { .svc_id = svc->id, .slot = bpf_get_prandom_u32() % svc->count };
	struct backend_val *b = bpf_map_lookup_elem(&kp_backends, &bk);
	if (!b)
		return 0;
	*out = *b;
	if (udp_flow)
		bpf_map_update_elem(&kp_udp_flows, &fk, out, BPF_ANY);
	return 1;
}

static __always_inline void remember(void *ctx, const struct backend_val *b,
				     const struct svc_key *key)
{
	struct revnat_key rk = { .cookie = bpf_get_socket_cookie(ctx), .backend = *b };
	struct revnat_val rv = { .port = key->port };
	rv.addr[0] = key->addr[0];
	rv.addr[1] = key->addr[1];
	rv.addr[2] = key->addr[2];
	rv.addr[3] = key->addr[3];
	bpf_map_update_elem(&kp_revnat, &rk, &rv, BPF_ANY);
}

static __always_inline struct revnat_val *recall(void *ctx, const struct backend_val *b)
{
	struct revnat_key rk = { .cookie = bpf_get_socket_cookie(ctx), .backend = *b };
	return bpf_map_lookup_elem(&kp_revnat, &rk);
}

static __always_inline int v4_mapped(const struct bpf_sock_addr *ctx)
{
	return ctx->user_ip6[0] == 0 && ctx->user_ip6[1] == 0 &&
	       ctx->user_ip6[2] == __builtin_bswap32(0xffff);
}

// A connected UDP socket is left to nftables: its destination is fixed at
// connect(), so when its endpoint goes only conntrack's flush (upstream's
// behaviour) can move it. TCP connections, like upstream's, stay where
// they are. sendmsg on an unconnected UDP socket picks per flow above.
static __always_inline int translate4(struct bpf_sock_addr *ctx, int sendmsg)
{
#ifdef KP_TEST_VARIANT
	return 1; // an "older version" that translates nothing (upgrade test)
#endif
	if (!sendmsg && ctx->protocol == IPPROTO_UDP)
		return 1;
	struct svc_key key = { .family = 4, .proto = ctx->protocol };
	key.addr[0] = ctx->user_ip4;
	key.port = (__u16)ctx->user_port;
	struct backend_val chosen;
	if (!pick(ctx, &key, &chosen, sendmsg))
		return 1;
	ctx->user_ip4 = chosen.addr[0];
	ctx->user_port = chosen.port;
	remember(ctx, &chosen, &key);
	return 1;
}

static __always_inline int translate6(struct bpf_sock_addr *ctx, int sendmsg)
{
#ifdef KP_TEST_VARIANT
	return 1; // an "older version" that translates nothing (upgrade test)
#endif
	if (!sendmsg && ctx->protocol == IPPROTO_UDP)
		return 1;
	struct svc_key key = { .proto = ctx->protocol };
	int mapped = v4_mapped(ctx);
	if (mapped) {
		key.family = 4;
		key.addr[0] = ctx->user_ip6[3];
	} else {
		key.family = 6;
		key.addr[0] = ctx->user_ip6[0];
		key.addr[1] = ctx->user_ip6[1];
		key.addr[2] = ctx->user_ip6[2];
		key.addr[3] = ctx->user_ip6[3];
	}
	key.port = (__u16)ctx->user_port;
	struct backend_val chosen;
	if (!pick(ctx, &key, &chosen, sendmsg))
		return 1;
	if (mapped) {
		ctx->user_ip6[3] = chosen.addr[0];
	} else {
		ctx->user_ip6[0] = chosen.addr[0];
		ctx->user_ip6[1] = chosen.addr[1];
		ctx->user_ip6[2] = chosen.addr[2];
		ctx->user_ip6[3] = chosen.addr[3];
	}
	ctx->user_port = chosen.port;
	remember(ctx, &chosen, &key);
	return 1;
}

static __always_inline int restore4(struct bpf_sock_addr *ctx)
{
	struct backend_val b = { .port = (__u16)ctx->user_port };
	b.addr[0] = ctx->user_ip4;
	struct revnat_val *rv = recall(ctx, &b);
	if (rv) {
		ctx->user_ip4 = rv->addr[0];
		ctx->user_port = rv->port;
	}
	return 1;
}

static __always_inline int restore6(struct bpf_sock_addr *ctx)
{
	struct backend_val b = { .port = (__u16)ctx->user_port };
	int mapped = v4_mapped(ctx);
	if (mapped) {
		b.addr[0] = ctx->user_ip6[3];
	} else {
		b.addr[0] = ctx->user_ip6[0];
		b.addr[1] = ctx->user_ip6[1];
		b.addr[2] = ctx->user_ip6[2];
		b.addr[3] = ctx->user_ip6[3];
	}
	struct revnat_val *rv = recall(ctx, &b);
	if (!rv)
		return 1;
	struct revnat_val r = *rv;
	if (mapped) {
		ctx->user_ip6[3] = r.addr[0];
	} else {
		ctx->user_ip6[0] = r.addr[0];
		ctx->user_ip6[1] = r.addr[1];
		ctx->user_ip6[2] = r.addr[2];
		ctx->user_ip6[3] = r.addr[3];
	}
	ctx->user_port = r.port;
	return 1;
}

SEC("cgroup/connect4") int kp_connect4(struct bpf_sock_addr *ctx) { return translate4(ctx, 0); }
SEC("cgroup/sendmsg4") int kp_sendmsg4(struct bpf_sock_addr *ctx) { return translate4(ctx, 1); }
SEC("cgroup/recvmsg4") int kp_recvmsg4(struct bpf_sock_addr *ctx) { return restore4(ctx); }
SEC("cgroup/getpeername4") int kp_getpeername4(struct bpf_sock_addr *ctx) { return restore4(ctx); }
SEC("cgroup/connect6") int kp_connect6(struct bpf_sock_addr *ctx) { return translate6(ctx, 0); }
SEC("cgroup/sendmsg6") int kp_sendmsg6(struct bpf_sock_addr *ctx) { return translate6(ctx, 1); }
SEC("cgroup/recvmsg6") int kp_recvmsg6(struct bpf_sock_addr *ctx) { return restore6(ctx); }
SEC("cgroup/getpeername6") int kp_getpeername6(struct bpf_sock_addr *ctx) { return restore6(ctx); }

char _license[] SEC("license") = "Dual MIT/GPL";
