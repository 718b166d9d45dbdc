// What the socket programs (socketlb.c) and the tc programs (nodeport.c)
// share: the Service and endpoint maps the proxy writes, their layouts, and
// the helpers both call (declared by number, to need only linux/bpf.h).
//
// The Rust side (crates/kp-socketlb/src/maps.rs) mirrors these structs
// byte for byte; their layout is checked by tests/kernel.rs.

#ifndef KP_COMMON_H
#define KP_COMMON_H

#include <linux/bpf.h>
#include <linux/in.h>

#define SEC(name) __attribute__((section(name), used))
#define __uint(name, val) int(*name)[val]
#define __type(name, val) typeof(val) *name
#define PIN_BY_NAME 1

static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)1;
static long (*bpf_map_update_elem)(void *map, const void *key, const void *value,
                                   __u64 flags) = (void *)2;
static __u32 (*bpf_get_prandom_u32)(void) = (void *)7;

// A Service address: IPv4 in addr[0] with family 4, IPv6 in all four.
// port in network byte order.
struct svc_key {
	__u32 addr[4];
	__u16 port;
	__u8 proto;
	__u8 family;
};

// family: 4 or 6 for the socket programs; with KP_OUTSIDE set, an entry
// for traffic from outside the node (nodeport.c), whose endpoints follow
// the externalTrafficPolicy.
#define KP_OUTSIDE 0x80

// count == 0 never appears: a Service port without endpoints has no entry,
// so its traffic goes on to nftables (which rejects or drops it).
struct svc_val {
	__u32 id;
	__u32 count;
	__u32 maglev_size; // the Maglev table's size (KP_F_MAGLEV), else 0
	// (was session affinity: pinned maps keep their layout)
	__u32 flags;
};

struct backend_key {
	__u32 svc_id;
	__u32 slot;
};

struct backend_val {
	__u32 addr[4];
	__u16 port; // network byte order
	__u16 pad;
};

// Which endpoints a Service port has now, whatever their slots: an
// unconnected UDP socket's flow is honoured only while its endpoint is still
// a member, so removing an endpoint moves only its own flows.
struct member_key {
	__u32 svc_id;
	struct backend_val backend;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct svc_key);
	__type(value, struct svc_val);
	__uint(pinning, PIN_BY_NAME);
} kp_services SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct backend_key);
	__type(value, struct backend_val);
	__uint(pinning, PIN_BY_NAME);
} kp_backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct member_key);
	__type(value, __u32); // the endpoint's slot
	__uint(pinning, PIN_BY_NAME);
} kp_members SEC(".maps");

#endif
