#!/bin/bash
# e2e/migrate-back.sh RUN MODE: from kube-proxy-rs back to upstream
# kube-proxy, as docs/migrate-from-kube-proxy.md says (e2e/migrate.sh's last
# step). iptables mode: delete kube-proxy-rs's DaemonSet (its rules stay and
# keep serving), deploy upstream's, which rewrites the same chains in place.
# nftables mode: deploy upstream's while ours still runs (each writes its own
# table), then delete ours, then remove our `kube-proxy-rs` tables with
# `kubectl debug node` as an operator would.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
RUN=$1 MODE=$2
if [ $MODE = iptables ]; then
  # the same chains: one proxy at a time
  kc -n kube-system delete daemonset kube-proxy-rs >/dev/null
  "$E2E/proxy.sh" "$RUN" upstream $MODE
  exit 0
fi
# nftables: each proxy writes its own table, so upstream may start while
# ours still runs; ours goes once upstream is ready everywhere
"$E2E/proxy.sh" "$RUN" upstream $MODE
kc -n kube-system delete daemonset kube-proxy-rs --wait=true >/dev/null
kc -n kube-system wait --for=delete pod -l app.kubernetes.io/name=kube-proxy-rs --timeout=60s >/dev/null 2>&1 || true
for i in $(seq 1 $NODES); do
  out=$(kc debug node/$(node_name $i) --profile=sysadmin --image=kube-proxy-rs:0.1.1 -- \
    sh -c 'nft delete table ip kube-proxy-rs; nft delete table ip6 kube-proxy-rs; nft list tables' 2>&1)
  pod=$(sed -n 's/^Creating debugging pod \([^ ]*\) .*/\1/p' <<<"$out")
  [ -n "$pod" ] || die "kubectl debug node/$(node_name $i): $out"
  kc wait --for=jsonpath='{.status.phase}'=Succeeded pod/$pod --timeout=60s >/dev/null \
    || die "$pod: $(kc logs $pod 2>&1)"
  kc delete pod $pod --wait=false >/dev/null
done
