#!/bin/bash
# e2e/control-plane.sh RUN: the lab network namespace (bridge br0, $LAB_IP),
# PKI, etcd, kube-apiserver, kube-controller-manager, kube-scheduler, all in
# $LAB_NS. Writes RUN/admin.kubeconfig and RUN/pids/*.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
RUN=$1; P=$RUN/pki
mkdir -p "$P" "$RUN/logs" "$RUN/pids"

# --- network: a namespace of our own holding the lab bridge; nothing in the root namespace
ip netns add $LAB_NS
ip -n $LAB_NS link set lo up
ip -n $LAB_NS link add br0 type bridge
ip -n $LAB_NS addr add $LAB_IP/24 dev br0
ip -n $LAB_NS link set br0 up
inlab sysctl -qw net.ipv4.ip_forward=1
# LoadBalancer traffic is spread over the nodes by flow (e2e/lb.py's multipath routes)
inlab sysctl -qw net.ipv4.fib_multipath_hash_policy=1
if has_v6; then
  ip -n $LAB_NS addr add $LAB_IP6/64 dev br0 nodad
  inlab sysctl -qw net.ipv6.conf.all.forwarding=1 net.ipv6.fib_multipath_hash_policy=1
fi

# --- PKI (lab-only, generated per run)
cd "$P"
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj /CN=kpe2e-ca 2>/dev/null
cat > apiserver.ext <<EOT
subjectAltName=IP:$LAB_IP,IP:$LAB_IP6,IP:127.0.0.1,IP:${SERVICE_CIDR%.0/*}.1,IP:${SERVICE_CIDR6%/*}1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOT
openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj /CN=kube-apiserver 2>/dev/null
openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 2 -extfile apiserver.ext 2>/dev/null
openssl genrsa -out sa.key 2048 2>/dev/null; openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
tok() { head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
{
  echo "$(tok),admin,admin,\"system:masters\""
  echo "$(tok),system:kube-controller-manager,kcm,\"\""
  echo "$(tok),system:kube-scheduler,scheduler,\"\""
  for i in $(seq 1 ${NODES:-3}); do echo "$(tok),system:node:$(node_name $i),node$i,\"system:nodes\""; done
} > tokens.csv
kubeconfig() { # USER OUT
  local t; t=$(awk -F, -v u="$1" '$2==u {print $1}' tokens.csv)
  cat > "$2" <<EOT
apiVersion: v1
kind: Config
clusters: [{name: lab, cluster: {server: "$API", certificate-authority: "$P/ca.crt"}}]
users: [{name: u, user: {token: "$t"}}]
contexts: [{name: lab, context: {cluster: lab, user: u}}]
current-context: lab
EOT
  chmod 600 "$2"
}
kubeconfig admin "$RUN/admin.kubeconfig"
kubeconfig system:kube-controller-manager "$RUN/kcm.kubeconfig"
kubeconfig system:kube-scheduler "$RUN/scheduler.kubeconfig"
for i in $(seq 1 ${NODES:-3}); do kubeconfig system:node:$(node_name $i) "$RUN/node$i.kubeconfig"; done
cd - >/dev/null

start() { # NAME CMD... : a daemon in the lab namespace, its own session
  local n=$1; shift
  nsenter --net=/run/netns/$LAB_NS -- setsid "$@" > "$RUN/logs/$n.log" 2>&1 < /dev/null &
  echo $! > "$RUN/pids/$n"
}

# --- etcd (loopback of the lab namespace)
start etcd env ETCD_UNSUPPORTED_ARCH= etcd --name kpe2e --data-dir "$RUN/etcd" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster kpe2e=http://127.0.0.1:2380 --listen-metrics-urls http://127.0.0.1:2381 \
  --unsafe-no-fsync
wait_for 30 inlab curl -sf http://127.0.0.1:2379/health || die "etcd not healthy"

start kube-apiserver "$BIN/kube-apiserver" \
  --bind-address=$API_HOST --advertise-address=$API_HOST --secure-port=$API_PORT \
  --etcd-servers=http://127.0.0.1:2379 \
  --tls-cert-file=$P/apiserver.crt --tls-private-key-file=$P/apiserver.key \
  --client-ca-file=$P/ca.crt --token-auth-file=$P/tokens.csv \
  --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file=$P/sa.pub --service-account-signing-key-file=$P/sa.key \
  --service-cluster-ip-range=$SERVICE_CIDRS --service-node-port-range=30000-32767 \
  --allow-privileged=true --kubelet-preferred-address-types=InternalIP,Hostname \
  --cert-dir=$RUN/apiserver-certs --v=1
wait_for 90 inlab curl -gsfk $API/readyz || die "kube-apiserver not ready (logs: $RUN/logs/kube-apiserver.log)"

case $IP_FAMILY in
  ipv4) MASKS=--node-cidr-mask-size=24 ;; ipv6) MASKS=--node-cidr-mask-size=64 ;;
  dual) MASKS="--node-cidr-mask-size-ipv4=24 --node-cidr-mask-size-ipv6=64" ;;
esac
start kube-controller-manager "$BIN/kube-controller-manager" \
  --kubeconfig=$RUN/kcm.kubeconfig --authentication-kubeconfig=$RUN/kcm.kubeconfig \
  --authorization-kubeconfig=$RUN/kcm.kubeconfig --leader-elect=false \
  --bind-address=127.0.0.1 --secure-port=10257 \
  --service-account-private-key-file=$P/sa.key --root-ca-file=$P/ca.crt \
  --use-service-account-credentials=true \
  --allocate-node-cidrs=true --cluster-cidr=$CLUSTER_CIDRS $MASKS \
  --service-cluster-ip-range=$SERVICE_CIDRS \
  --cluster-signing-cert-file=$P/ca.crt --cluster-signing-key-file=$P/ca.key \
  --node-monitor-grace-period=40s --v=1
start kube-scheduler "$BIN/kube-scheduler" \
  --kubeconfig=$RUN/scheduler.kubeconfig --authentication-kubeconfig=$RUN/scheduler.kubeconfig \
  --authorization-kubeconfig=$RUN/scheduler.kubeconfig --leader-elect=false \
  --bind-address=127.0.0.1 --secure-port=10259 --v=1
wait_for 60 inlab curl -sfk https://127.0.0.1:10257/healthz || die "kube-controller-manager not healthy"
wait_for 60 inlab curl -sfk https://127.0.0.1:10259/healthz || die "kube-scheduler not healthy"
# the default ServiceAccount exists once the serviceaccount controller runs
wait_for 60 kc get sa default -n default || die "no default ServiceAccount"
log "control plane up ($API in $LAB_NS)"
