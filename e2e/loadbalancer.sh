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
