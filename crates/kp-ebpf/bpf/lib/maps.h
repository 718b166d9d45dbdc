// The maps: the Service and endpoint maps the proxy writes, shared by the
// socket programs (sock.c) and the tc/XDP programs (tc.c, xdp.c), and with
// KP_NODEPORT defined the latter's own flow tables.
//
// The Rust side (crates/kp-ebpf/src/maps.rs) mirrors these structs byte
// for byte; their layout is checked by tests/kernel.rs.
#ifndef KP_LIB_MAPS_H
#define KP_LIB_MAPS_H

#include "helpers.h"
#include "maglev.h"

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


#ifdef KP_NODEPORT
// The tc and XDP programs' own maps (sock.c has none of them).

#define KP_F_LOCAL 1 // svc_val.flags: externalTrafficPolicy Local (no SNAT)
#define KP_F_MAGLEV 2 // svc_val.flags: the endpoint from the Maglev table
#define KP_F_DSR 4 // svc_val.flags: direct server return (--bpf-lb-mode dsr, hybrid)

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

// A flow table entry, keyed by the tuple a packet arrives with: what the
// packet is (backend.pad: KP_NAT_REPLY, KP_NAT_DSR, KP_NAT_PASS) and what
// to rewrite it to. `svc_id` and `backend` name the Service port and
// endpoint a request flow went to (0 in reply entries). The rest is what
// an established flow's packets need and would otherwise recompute:
// the checksum differences, the endpoint's membership as of a generation,
// the route.
struct nat {
	__u32 saddr[4];
	__u32 daddr[4];
	__u16 sport;
	__u16 dport;
	__u32 svc_id;
	struct backend_val backend;
	// The TCP/UDP checksum's differences from the arriving tuple to this
	// one: its addresses (pseudo-header) and its ports (flow_deltas).
	__u32 csum_addr;
	__u32 csum_port;
	// UDP: the endpoint was a member at kp_np_gen's `members` generation.
	__u32 member_gen;
	// The route (0: none yet): out of `ifindex` with these MACs, asked at
	// `route_at` (coarse clock) in kp_np_gen's `route` generation, good for
	// frames up to `route_len` bytes (the MTU check).
	__u32 ifindex;
	__u32 route_gen;
	__u16 route_len;
	__u8 dmac[6];
	__u8 smac[6];
	__u16 pad2;
	__u64 route_at;
};

// Generations the proxy bumps (kp_np_gen[0]): `route` when the node's
// interfaces change, `members` when an endpoint leaves a Service port.
// An entry made in another generation asks again once.
struct gen {
	__u32 route;
	__u32 members;
};

// The node's own addresses, for SNAT where the kernel names none: [0]
// IPv4, [1] IPv6 (written by the proxy at start).
struct node_addr {
	__u32 addr[4];
};

// Every flow the programs translate, both ways, keyed by the tuple its
// packets arrive with: client -> Service requests and endpoint -> node (or
// client) replies (KP_NAT_REPLY), so a packet costs one lookup, as a
// Cilium CT entry or a conntrack tuple does.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct flow);
	__type(value, struct nat);
	__uint(pinning, PIN_BY_NAME);
} kp_np_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gen);
	__uint(pinning, PIN_BY_NAME);
} kp_np_gen SEC(".maps");

// Room for the entries a new flow makes (each program's own, per CPU):
// two of them would not fit the verifier's 512 bytes of stack.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct nat);
} kp_np_scratch SEC(".maps");

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
#endif // KP_NODEPORT

#endif
