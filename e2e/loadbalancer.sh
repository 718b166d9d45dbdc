#!/bin/bash
# e2e/loadbalancer.sh RUN: the lab's load balancer (e2e/lb.py) in the lab
# namespace, once the nodes are up: LoadBalancer Services get an address from
# the lab's pool of each family in use, routed to the nodes.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
RUN=$1
args=()
case $IP_FAMILY in ipv4) args+=(--pool $LB_POOL4 --src $LB_CLIENT4) ;; ipv6) args+=(--pool $LB_POOL6 --src $LB_CLIENT6) ;;
  dual) args+=(--pool $LB_POOL4 --pool $LB_POOL6 --src $LB_CLIENT4 --src $LB_CLIENT6) ;; esac
ip -n $LAB_NS addr add $LB_CLIENT4/32 dev lo
has_v6 && ip -n $LAB_NS addr add $LB_CLIENT6/128 dev lo nodad
# An address no Service holds goes nowhere, as a cloud's released address
# does: the pools route out of a veth whose peer (in this namespace too)
# drops the frames, addressed to a MAC that is not its own. A client then
# times out ("not reachable" to the specs) instead of failing to send
# (ENETUNREACH, which the UDP specs count as neither). lb.py's routes for
# the addresses in use are more specific. (No dummy device: the kernel
# here has no dummy module.)
ip -n $LAB_NS link add lbsink type veth peer name lbsink-peer
ip -n $LAB_NS link set lbsink up
ip -n $LAB_NS link set lbsink-peer up
ip -n $LAB_NS neigh add 169.254.99.2 lladdr 02:00:00:00:00:01 dev lbsink nud permanent
ip -n $LAB_NS route add $LB_POOL4 via 169.254.99.2 dev lbsink onlink
if has_v6; then
  ip -n $LAB_NS -6 neigh add fe80::99:2 lladdr 02:00:00:00:00:01 dev lbsink nud permanent
  ip -n $LAB_NS -6 route add $LB_POOL6 via fe80::99:2 dev lbsink
fi
for i in $(seq 1 $NODES); do
  ips=$(node_ip $i); has_v6 && ips="$ips,$(node_ip6 $i)"
  args+=(--node "$(node_name $i)=$ips")
done
nsenter --net=/run/netns/$LAB_NS -- setsid python3 "$E2E/lb.py" --api $API --token-file "$RUN/pki/admin.token" \
  --ca "$RUN/pki/ca.crt" "${args[@]}" > "$RUN/logs/lb.log" 2>&1 < /dev/null &
echo $! > "$RUN/pids/lb"
sleep 1
kill -0 "$(cat "$RUN/pids/lb")" 2>/dev/null || die "the lab's load balancer did not start ($RUN/logs/lb.log)"
log "load balancer: e2e/lb.py, addresses from the pool of each family in use ($RUN/logs/lb.log)"
