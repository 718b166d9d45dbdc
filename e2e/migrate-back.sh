#!/bin/bash
# e2e/migrate-back.sh RUN MODE: from kube-proxy-rs back to upstream
# kube-proxy, as docs/migrate-from-kube-proxy.md says (e2e/migrate.sh's last
# step): delete kube-proxy-rs's DaemonSet (its rules stay and keep serving),
# deploy upstream's, and once it is ready remove what upstream does not take
# over: in nftables mode our `kube-proxy-rs` tables (upstream writes its own
# `kube-proxy` table), with `kubectl debug node` as an operator would. In
# iptables mode upstream rewrites the same chains in place: nothing to remove.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
RUN=$1 MODE=$2
kc -n kube-system delete daemonset kube-proxy-rs >/dev/null
"$E2E/proxy.sh" "$RUN" upstream $MODE
[ $MODE = iptables ] && exit 0
for i in $(seq 1 $NODES); do
  out=$(kc debug node/$(node_name $i) --profile=sysadmin --image=kube-proxy-rs:0.1.1 -- \
    sh -c 'nft delete table ip kube-proxy-rs; nft delete table ip6 kube-proxy-rs; nft list tables' 2>&1)
  pod=$(sed -n 's/^Creating debugging pod \([^ ]*\) .*/\1/p' <<<"$out")
  [ -n "$pod" ] || die "kubectl debug node/$(node_name $i): $out"
  kc wait --for=jsonpath='{.status.phase}'=Succeeded pod/$pod --timeout=60s >/dev/null \
    || die "$pod: $(kc logs $pod 2>&1)"
  kc delete pod $pod --wait=false >/dev/null
done
