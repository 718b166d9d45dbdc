// An XDP program that passes every frame: for the far end of a veth that
// a node's XDP sends frames back into (XDP_TX). veth wakes its peer for
// such frames only while the peer runs an XDP program; a NIC's wire needs
// nothing of the kind. Used by the tests and kp-pps on their LAN ports.

#include <linux/bpf.h>

__attribute__((section("xdp"), used)) int kp_xdp_pass(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char _license[] __attribute__((section("license"), used)) = "Dual MIT/GPL";
