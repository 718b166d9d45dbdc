# Shared settings and helpers of the e2e lab (sourced by e2e.sh and e2e/*.sh).
# Every name the lab creates starts with kpe2e- (network namespaces, cgroups);
# every address lives inside those network namespaces.

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
E2E=$REPO/e2e
BIN=${BIN:-$REPO/target/e2e-bin}          # install.sh DIR all
IMAGES=${IMAGES:-$REPO/target/e2e-images} # content-keyed image tars
# ../shared/k8s beside the checkout (as CI has it)
K8S_SHARED=${K8S_SHARED:-$(cd "$REPO/../shared/k8s" 2>/dev/null && pwd || echo /work/shared/k8s)}

PREFIX=${KP_E2E_PREFIX:-kpe2e}  # another prefix: a second lab beside the first
LAB_NS=$PREFIX-lab                 # control plane, e2e.test, the lab DNS
LAB_IP=172.30.0.1                  # on the lab bridge br0 (inside $LAB_NS only)
LAB_NET=172.30.0.0/24
NODE_IP_BASE=172.30.0.1            # node i: ${NODE_IP_BASE}$i  (172.30.0.11, .12, ...)
CLUSTER_CIDR=10.244.0.0/16         # = deploy/configmap.yaml clusterCIDR
SERVICE_CIDR=10.96.0.0/16
KUBE_DNS_IP=10.96.0.10
# IPv6 (--ip-family ipv6|dual): the same shape in ULA space, as kind's
LAB_IP6=fd00:30::1
NODE_IP6_BASE=fd00:30::1           # node i: ${NODE_IP6_BASE}$i  (fd00:30::11, ...)
CLUSTER_CIDR6=fd00:10:244::/56     # a /64 per node
SERVICE_CIDR6=fd00:10:96::/112
KUBE_DNS_IP6=fd00:10:96::a
# LoadBalancer addresses handed out by e2e/lb.py, routed by the lab to nodes
LB_POOL4=172.30.1.0/24
LB_POOL6=fd00:30:1::/112
# the lab namespace's client address for LoadBalancer traffic: outside the
# nodes' /16 and /64, as a client of a cloud LB is
LB_CLIENT4=172.31.0.1
LB_CLIENT6=fd00:31::1
API_PORT=6443

# --ip-family (e2e.sh exports IP_FAMILY): ipv4 (default), ipv6, or dual
# (IPv4 primary, as kind's dual-stack clusters). The links carry both
# families whenever IPv6 is in use; what the family decides is the cluster's
# ranges, the nodes' InternalIPs and the API server's address.
IP_FAMILY=${IP_FAMILY:-ipv4}
case $IP_FAMILY in
  ipv4) API_HOST=$LAB_IP; CLUSTER_CIDRS=$CLUSTER_CIDR; SERVICE_CIDRS=$SERVICE_CIDR; DNS_IP=$KUBE_DNS_IP; API=https://$LAB_IP:$API_PORT ;;
  ipv6) API_HOST=$LAB_IP6; CLUSTER_CIDRS=$CLUSTER_CIDR6; SERVICE_CIDRS=$SERVICE_CIDR6; DNS_IP=$KUBE_DNS_IP6; API="https://[$LAB_IP6]:$API_PORT" ;;
  dual) API_HOST=$LAB_IP; CLUSTER_CIDRS=$CLUSTER_CIDR,$CLUSTER_CIDR6; SERVICE_CIDRS=$SERVICE_CIDR,$SERVICE_CIDR6; DNS_IP=$KUBE_DNS_IP; API=https://$LAB_IP:$API_PORT ;;
  *) echo "IP_FAMILY must be ipv4, ipv6 or dual (got $IP_FAMILY)" >&2; exit 1 ;;
esac
# the links have IPv6 addresses (and the namespaces forward it)
has_v6() { [ "$IP_FAMILY" != ipv4 ]; }

# The machine-wide settings kubelet (and a proxy) could write; recorded before
# a run, checked after it.
MACHINE_SYSCTLS="kernel/panic kernel/panic_on_oops vm/overcommit_memory vm/panic_on_oom
kernel/keys/root_maxkeys kernel/keys/root_maxbytes kernel/keys/maxkeys kernel/keys/maxbytes
net/netfilter/nf_conntrack_max"

log() { printf '%s [e2e] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

node_name() { echo "$PREFIX-node$1"; }
node_ip() { echo "${NODE_IP_BASE}$1"; }
node_ip6() { echo "${NODE_IP6_BASE}$1"; }
# kubelet --node-ip: the node's InternalIPs, primary family first
node_ips() {
  case $IP_FAMILY in ipv4) node_ip $1 ;; ipv6) node_ip6 $1 ;; dual) echo "$(node_ip $1),$(node_ip6 $1)" ;; esac
}
node_ns() { echo "$PREFIX-node$1"; }

# Run a command in the lab network namespace (same mount namespace: plain nsenter).
inlab() { nsenter --net=/run/netns/$LAB_NS -- "$@"; }

kc() { inlab "$BIN/kubectl" --kubeconfig "$RUN/admin.kubeconfig" "$@"; }

machine_state() {
  local f
  for f in $MACHINE_SYSCTLS; do echo "$f=$(cat /proc/sys/$f 2>/dev/null)"; done
  echo "nf_conntrack.hashsize=$(cat /sys/module/nf_conntrack/parameters/hashsize 2>/dev/null)"
  # the root network namespace's own settings, addresses and routes (the lab
  # sets forwarding and multipath hashing in its namespaces only)
  for f in net/ipv4/ip_forward net/ipv4/fib_multipath_hash_policy net/ipv6/fib_multipath_hash_policy \
           net/ipv6/conf/all/forwarding net/ipv6/conf/all/disable_ipv6 net/ipv6/conf/default/disable_ipv6; do
    echo "root netns $f=$(cat /proc/sys/$f 2>/dev/null)"
  done
  echo "root netns addresses: $(ip -o addr show 2>/dev/null | awk '{print $2, $4}' | sort | tr '\n' ' ')"
  echo "root netns routes: $(ip route show table all 2>/dev/null | grep -v '^local\|^broadcast' | sort | tr '\n' ';')"
  echo "root netns v6 routes: $(ip -6 route show 2>/dev/null | sort | tr '\n' ';')"
  # BPF programs on the machine's root cgroup (v2): --mode socketlb attaches
  # to each node's own cgroup, never there
  local root
  root=$(findmnt -rn -t cgroup2 -o TARGET | head -1)
  [ -n "$root" ] && echo "root cgroup BPF: $(bpftool -j cgroup show "$root" 2>&1)"
}

# Wait until "$@" succeeds, up to $1 seconds (polls every 0.5 s).
wait_for() {
  local t=$1; shift
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -ge $end ] && return 1
    sleep 0.5
  done
}

# procs_in KIND PATTERN: pids whose /proc/PID/ns/KIND link matches PATTERN
# (a find -lname glob, e.g. 'net:\[4026532\]'); one find, not one readlink per pid.
procs_in() {
  find /proc -mindepth 3 -maxdepth 3 -path "/proc/[0-9]*/ns/$1" -lname "$2" 2>/dev/null | cut -d/ -f3
}

# delete_our_nft_tables IMAGE: remove kube-proxy-rs's nftables tables from
# every node with `kubectl debug node` (an image that has nft), as an
# operator going back to upstream's nftables mode would (upstream does not
# know our table).
delete_our_nft_tables() {
  local i out pod
  for i in $(seq 1 $NODES); do
    out=$(kc debug node/$(node_name $i) --profile=sysadmin --image=$1 -- \
      sh -c 'nft delete table ip kube-proxy-rs; nft delete table ip6 kube-proxy-rs; nft list tables' 2>&1)
    pod=$(sed -n 's/^Creating debugging pod \([^ ]*\) .*/\1/p' <<<"$out")
    [ -n "$pod" ] || die "kubectl debug node/$(node_name $i): $out"
    kc wait --for=jsonpath='{.status.phase}'=Succeeded pod/$pod --timeout=60s >/dev/null \
      || die "$pod: $(kc logs $pod 2>&1)"
    kc delete pod $pod --wait=false >/dev/null
  done
}
