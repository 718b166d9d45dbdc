// Reading a frame: where its headers are, and its flow.
#ifndef KP_LIB_PARSE_H
#define KP_LIB_PARSE_H

#include "maps.h"
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>

#define IP_OFF 14 // after the Ethernet header
#define IP_CSUM_OFF (IP_OFF + 10)
#define IP_SRC_OFF (IP_OFF + 12)
#define IP_DST_OFF (IP_OFF + 16)
#define L4_OFF4 (IP_OFF + 20) // no IP options: those go to the stack
#define IP6_HOP_OFF (IP_OFF + 7)
#define IP6_SRC_OFF (IP_OFF + 8)
#define IP6_DST_OFF (IP_OFF + 24)
#define L4_OFF6 (IP_OFF + 40) // no extension headers: those go to the stack

struct ports {
	__u16 source;
	__u16 dest;
};

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


#endif
