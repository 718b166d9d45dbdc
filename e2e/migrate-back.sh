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
delete_our_nft_tables kube-proxy-rs:0.1.1
