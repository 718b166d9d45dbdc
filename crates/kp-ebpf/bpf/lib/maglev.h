// Maglev consistent hashing for the tc programs (kube-proxy-rs, issue 54).
//
// The tables are built in user space (crates/kp-ebpf/src/maglev.rs);
// a program only hashes the packet's flow and reads one slot:
//
//   idx   = maglev_flow_hash(saddr, daddr, sport, dport, proto) % M
//   key   = { svc_id, idx / MAGLEV_CHUNK }           (map kp_maglev)
//   slot  = val->slot[idx % MAGLEV_CHUNK]            (key of kp_backends)
//
// where M is the Service's table size. maglev_flow_hash must give the same
// value as flow_hash in maglev.rs for the same input (a test compiles this
// file on the host and compares), so that every node, and the table built
// in user space, agree on which slot a flow lands in.
//
// Only kernel UAPI types: this header is included by BPF programs and by
// the host test program alike.

#ifndef KP_MAGLEV_H
#define KP_MAGLEV_H

#include <linux/types.h>

#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif

// Table slots per kp_maglev entry (MAGLEV_CHUNK in maps.rs).
#define MAGLEV_CHUNK 64

struct maglev_key {
	__u32 svc_id;
	__u32 chunk; // slots chunk * MAGLEV_CHUNK ..
};

// The kp_backends slot of each Maglev slot's endpoint; slots past the
// table's size (the tail of its last chunk) are 0 and never read.
struct maglev_val {
	__u32 slot[MAGLEV_CHUNK];
};

static __always_inline __u32 maglev_rotl32(__u32 x, int r)
{
	return (x << r) | (x >> (32 - r));
}

// One word into the running hash (MurmurHash3's x86_32 block step).
static __always_inline __u32 maglev_mix(__u32 h, __u32 k)
{
	k *= 0xcc9e2d51;
	k = maglev_rotl32(k, 15);
	k *= 0x1b873593;
	h ^= k;
	h = maglev_rotl32(h, 13);
	return h * 5 + 0xe6546b64;
}

// The flow's hash: ten 32-bit words, fixed, no loop and no table, so it
// costs the verifier nothing. Addresses are four words each as the packet
// carries them (an IPv4 address in word 0, the others 0); ports as they
// are in the header (network byte order), read as host integers; the
// words are read in host order on little- and big-endian hosts alike, so
// nodes of one byte order agree with each other.
static __always_inline __u32 maglev_flow_hash(const __u32 *saddr, const __u32 *daddr,
					      __u16 sport, __u16 dport, __u8 proto)
{
	__u32 h = 0x6b706d67; // seed: "kpmg"

	h = maglev_mix(h, saddr[0]);
	h = maglev_mix(h, saddr[1]);
	h = maglev_mix(h, saddr[2]);
	h = maglev_mix(h, saddr[3]);
	h = maglev_mix(h, daddr[0]);
	h = maglev_mix(h, daddr[1]);
	h = maglev_mix(h, daddr[2]);
	h = maglev_mix(h, daddr[3]);
	h = maglev_mix(h, (__u32)sport | ((__u32)dport << 16));
	h = maglev_mix(h, proto);
	// Final avalanche, so that the low bits (which % M mostly reads)
	// depend on every input bit.
	h ^= 40; // bytes hashed
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

#endif
