// What every program includes: the section macros, the kernel helpers
// declared by number (to need only linux/bpf.h), and small address helpers.
#ifndef KP_LIB_HELPERS_H
#define KP_LIB_HELPERS_H


#include <linux/bpf.h>
#include <linux/in.h>

#define SEC(name) __attribute__((section(name), used))
#define __uint(name, val) int(*name)[val]
#define __type(name, val) typeof(val) *name
#define PIN_BY_NAME 1

// The UAPI headers make this a mere hint; inlined for real, the whole
// program is one frame whose stack the compiler can share between paths
// (the verifier's limit, 512 bytes, counts every frame of a call chain).
#undef __always_inline
#define __always_inline inline __attribute__((always_inline))

static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)1;
static long (*bpf_map_update_elem)(void *map, const void *key, const void *value,
                                   __u64 flags) = (void *)2;
static __u32 (*bpf_get_prandom_u32)(void) = (void *)7;
static __u64 (*bpf_get_socket_cookie)(void *ctx) = (void *)46;
static __u64 (*bpf_ktime_get_coarse_ns)(void) = (void *)160;
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

#endif
