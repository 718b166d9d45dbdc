#!/bin/bash
# e2e/down.sh RUN: stops everything a run started (nodes, their pods,
# containerd, kubelet, the control plane, the lab DNS), removes its cgroups
# and network namespaces. Safe to run twice, or on a half-started run.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
RUN=${1:?usage: e2e/down.sh RUN}
for d in "$RUN"/node*/; do
  [ -d "$d" ] || continue
  i=${d%/}; i=${i##*/node}
  "$E2E/node.sh" down "$RUN" "$i" &
done
wait
pids=""
for n in lb dns kube-scheduler kube-controller-manager kube-apiserver etcd; do
  p=$(cat "$RUN/pids/$n" 2>/dev/null) && kill "$p" 2>/dev/null && pids="$pids $p"
done
for _ in $(seq 40); do
  alive=""; for p in $pids; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
  [ -z "$alive" ] && break; sleep 0.25
done
for p in $pids; do kill -9 "$p" 2>/dev/null; done
# anything still in a lab network namespace (ginkgo, e2e.test, kubectl) is ours
for ns in /run/netns/$PREFIX-*; do
  [ -e "$ns" ] || continue
  ino=$(stat -L -c %i "$ns")
  for p in $(procs_in net "net:\[$ino\]"); do kill -9 "$p" 2>/dev/null; done
  sleep 0.2
  ip netns del "${ns##*/}" 2>/dev/null || log "WARNING: cannot delete netns ${ns##*/}"
done
left=""
for h in /sys/fs/cgroup/*; do ls -d "$h"/$PREFIX-* 2>/dev/null && left=1; done
[ -n "$left" ] && log "WARNING: cgroups left (above)"
ls /run/netns/ 2>/dev/null | grep "^$PREFIX-" && { log "WARNING: netns left"; left=1; }
if [ -z "$left" ]; then
  rm -rf "$RUN"/etcd "$RUN"/node*/containerd "$RUN"/node*/kubelet "$RUN"/node*/varlib
  log "lab down: no namespace, cgroup or process left"
fi
[ -z "$left" ]
