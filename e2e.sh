#!/bin/bash
# Kubernetes' own [sig-network] e2e specs on a real cluster made of network
# namespaces on this machine, with the proxy deployed as a DaemonSet from its
# own image. See docs/e2e.md.
#
#   ./e2e.sh [--proxy ours|upstream] [--mode nftables|iptables|socketlb|bpf]
#                 [--deploy deploy|kubeadm] [--ip-family ipv4|ipv6|dual]
#                 [--focus REGEX] [--skip REGEX] [--nodes N] [--procs P]
#                 [--report DIR] [--keep] [--docs] [--binary PATH]
#                 [--proxy-arg ARG]...
#   ./e2e.sh --serial ...: the [Serial] and [Disruptive] specs of the focus, one at a time
#   ./e2e.sh --migrate [--mode nftables|iptables] [--deploy deploy|kubeadm]   (e2e/migrate.sh)
#   --deploy kubeadm: ours as the operator swaps it, kubeadm's DaemonSet and
#   ConfigMap (e2e/upstream/kube-proxy.yaml) with only the image changed
#   (default: deploy/, ours' least-privilege DaemonSet).
#   --ip-family: the cluster's family (default ipv4); dual is IPv4-primary
#   dual-stack and adds the [Feature:IPv6DualStack] specs.
#   --proxy-arg: one more flag for ours (deploy/ only), added to the
#   DaemonSet's args as a user's kustomize patch would (repeatable; e.g.
#   --mode bpf --proxy-arg --bpf-lb-algorithm=maglev).
#
# Last line printed: "N passed, M failed, K skipped". Exit status 0 when
# nothing failed and the machine-wide settings are unchanged.
set -euo pipefail
REPO=$(cd "$(dirname "$0")" && pwd)
. "$REPO/e2e/lib.sh"
if [ "$(id -u)" != 0 ]; then
  # As demo.sh and test.sh: a user with sudo gets the same run as root.
  command -v sudo >/dev/null 2>&1 || die "run as root (network namespaces, containerd, kubelet); sudo is not available"
  exec sudo -E env "PATH=$PATH" bash "$0" "$@"
fi

IP_FAMILY=ipv4 PROXY=ours MODE=nftables NODES=3 PROCS=3 KEEP=0 REPORT="" DOCS=0 BINARY="" MIGRATE=0 SERIAL=0 DEPLOY=deploy
FOCUS='\[sig-network\]'
SKIP='\[Serial\]|\[Disruptive\]|\[Flaky\]'
EXTRA_SKIP="" PROXY_ARGS=()
while [ $# -gt 0 ]; do
  case $1 in
    --proxy) PROXY=$2; shift 2 ;;
    --mode) MODE=$2; shift 2 ;;
    --deploy) DEPLOY=$2; shift 2 ;;
    --ip-family) IP_FAMILY=$2; shift 2 ;;
    --focus) FOCUS=$2; shift 2 ;;
    --skip) EXTRA_SKIP=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --procs) PROCS=$2; shift 2 ;;
    --binary) BINARY=$2; shift 2 ;;
    --proxy-arg) PROXY_ARGS+=("$2"); shift 2 ;;
    --migrate) MIGRATE=1; PROXY=upstream; shift ;;
    --serial) SERIAL=1; PROCS=1; shift ;;
    --report) REPORT=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --docs) DOCS=1; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
case $PROXY in ours|upstream) ;; *) die "--proxy ours|upstream" ;; esac
case $IP_FAMILY in ipv4|ipv6|dual) ;; *) die "--ip-family ipv4|ipv6|dual" ;; esac
[ $MIGRATE = 1 ] && [ $IP_FAMILY != ipv4 ] && die "--migrate drives its traffic over the nodes' IPv4 addresses: --ip-family ipv4 only"
export IP_FAMILY
. "$E2E/lib.sh"  # again: the addresses and ranges of the family
case $DEPLOY in deploy) ;; kubeadm) case $MODE in socketlb|bpf) die "--deploy kubeadm runs kubeadm's DaemonSet unchanged: no --socket-lb" ;; esac ;;
  *) die "--deploy deploy|kubeadm" ;; esac
export DEPLOY
if [ ${#PROXY_ARGS[@]} -gt 0 ]; then
  [ $PROXY = ours ] && [ $DEPLOY = deploy ] || die "--proxy-arg adds flags to ours as deployed from deploy/ (--proxy ours --deploy deploy)"
  for a in "${PROXY_ARGS[@]}"; do
    case $a in --[a-z]*) ;; *) die "--proxy-arg takes one flag as the binary reads it (--name=value), got '$a'" ;; esac
    case $a in *[[:space:]]*) die "--proxy-arg '$a': one flag without spaces (--name=value)" ;; esac
  done
fi
# newline-separated, for e2e/proxy.sh
PROXY_ARGS_LINES=$(printf '%s\n' "${PROXY_ARGS[@]+"${PROXY_ARGS[@]}"}"); export PROXY_ARGS_LINES
case $MODE in nftables|iptables) ;; socketlb) [ $PROXY = ours ] || die "--mode socketlb is kube-proxy-rs's (nftables with --socket-lb)" ;;
  bpf) [ $PROXY = ours ] || die "--mode bpf is kube-proxy-rs's (nftables with --socket-lb --bpf-nodeport)" ;;
  *) die "--mode nftables|iptables|socketlb|bpf" ;; esac
case $NODES in [1-9]|[1-9][0-9]) ;; *) die "--nodes takes a number of nodes, 1 to 99 (got $NODES)" ;; esac
case $PROCS in [1-9]|[1-9][0-9]) ;; *) die "--procs takes a number of ginkgo processes, 1 to 99 (got $PROCS)" ;; esac
# What the lab runs, from Debian (the README's test command installs its own
# tools the same way): installed when missing.
need=()
for c in containerd:containerd runc:runc /usr/lib/cni/bridge:containernetworking-plugins mmdebstrap:mmdebstrap \
         etcd:etcd-server /bin/busybox:busybox-static jq:jq openssl:openssl python3:python3 nsenter:util-linux \
         conntrack:conntrack nft:nftables bpftool:bpftool; do
  case ${c%%:*} in /*) [ -e "${c%%:*}" ] ;; *) command -v "${c%%:*}" >/dev/null 2>&1 ;; esac || need+=("${c#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
    || die "could not install ${need[*]}"
fi
[ -e /run/netns/$LAB_NS ] && die "$LAB_NS exists: another run is active, or run e2e/down.sh /tmp/kpe2e.* to clean up"
if [ $SERIAL = 1 ]; then
  # only what the default run leaves out for being [Serial] or [Disruptive]
  FOCUS="(?:$FOCUS).*(?:\[Serial\]|\[Disruptive\])"
  SKIP='\[Flaky\]'
fi
# skips.txt: REGEX<TAB>reason[<TAB>WHEN], WHEN as family!=dual or mode=iptables,nftables
while IFS=$'\t' read -r re _ when; do
  case $re in ''|'#'*) continue ;; esac
  if [ -n "$when" ]; then
    key=${when%%[=!]*}; vals=,${when#*=},; neg=0
    case $when in *'!='*) neg=1 ;; esac
    case $key in family) val=$IP_FAMILY ;; mode) val=$MODE ;; proxy) val=$PROXY ;; *) die "skips.txt: unknown condition $when" ;; esac
    hit=0; case $vals in *,$val,*) hit=1 ;; esac
    [ $hit != $neg ] || continue
  fi
  SKIP="$SKIP|$re"
done < "$E2E/skips.txt"
[ -n "$EXTRA_SKIP" ] && SKIP="$SKIP|$EXTRA_SKIP"
export NODES

RUN=$(mktemp -d /tmp/kpe2e.XXXXXX); chmod 755 "$RUN"; export RUN
REPORT=${REPORT:-$RUN/report}; mkdir -p "$REPORT"; REPORT=$(cd "$REPORT" && pwd)
machine_state > "$RUN/machine-before"
log "run directory $RUN; proxy $PROXY ($MODE, $DEPLOY${PROXY_ARGS[*]+ ${PROXY_ARGS[*]}}), $NODES nodes, $IP_FAMILY"

teardown() {
  local rc=$?
  trap - EXIT INT TERM
  if [ $KEEP = 1 ] && [ "${1:-}" != final ]; then
    log "--keep: cluster left running; stop it with: sudo e2e/down.sh $RUN"; return $rc
  fi
  "$E2E/down.sh" "$RUN" || rc=1
  if ! diff <(machine_state) "$RUN/machine-before" >&2; then
    log "ERROR: machine-wide settings changed during the run (above: now vs before)"; rc=1
  fi
  return $rc
}
trap 'teardown; exit 1' INT TERM
trap 'teardown' EXIT

# --- binaries, proxy build, images
for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy e2e.test ginkgo agnhost pause; do
  [ -x "$BIN/$b" ] || { mkdir -p "$BIN"; bash "$K8S_SHARED/install.sh" "$BIN" all >/dev/null; break; }
done
# --migrate starts with upstream and ends with it, with ours in between
OURS=0; { [ $PROXY = ours ] || [ $MIGRATE = 1 ]; } && OURS=1
if [ $OURS = 1 ] && [ -n "$BINARY" ]; then
  # a kube-proxy-rs built before (e.g. one build for a series of runs while
  # the tree changes); KP_E2E_TREE says what it was built from
  [ -x "$BINARY" ] || die "--binary $BINARY is not an executable"
  export KP_BINARY=$(cd "$(dirname "$BINARY")" && pwd)/$(basename "$BINARY")
  TREE=${KP_E2E_TREE:-"prebuilt $BINARY"}
elif [ $OURS = 1 ]; then
  CARGO=$(command -v cargo || echo "${SUDO_USER:+$(getent passwd "$SUDO_USER" | cut -d: -f6)}/.cargo/bin/cargo")
  [ -x "$CARGO" ] || CARGO=$HOME/.cargo/bin/cargo
  log "cargo build --release -p kube-proxy-rs --bin kube-proxy-rs"
  (cd "$REPO" && "$CARGO" build --release -p kube-proxy-rs --bin kube-proxy-rs 2>&1 | tail -2 >&2)
  TREE="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)"
  [ -n "$(git -C "$REPO" status --porcelain -- crates Cargo.toml Cargo.lock 2>/dev/null)" ] && TREE="$TREE + uncommitted changes in crates/"
else
  TREE="kube-proxy v1.36.2"
fi
IMAGES_FOR=$PROXY; [ $MIGRATE = 1 ] && IMAGES_FOR=both
"$E2E/images.sh" $IMAGES_FOR > "$RUN/images.list"

T0=$SECONDS

# --- cluster
"$E2E/control-plane.sh" "$RUN"
"$E2E/cluster-dns.sh" "$RUN"
for i in $(seq 1 $NODES); do "$E2E/node.sh" up "$RUN" $i; done
"$E2E/node.sh" net "$RUN" $NODES
for i in $(seq 1 $NODES); do
  kc wait --for=condition=Ready node/$(node_name $i) --timeout=120s >/dev/null || die "node $(node_name $i) not Ready (see $RUN/node$i)"
done
"$E2E/proxy.sh" "$RUN" $PROXY $MODE $DEPLOY
"$E2E/loadbalancer.sh" "$RUN"
T_UP=$((SECONDS - T0))
log "cluster up in ${T_UP}s"
echo "$T_UP" > "$RUN/cluster-up-seconds"

# --- the suite (or the migration)
T1=$SECONDS
set +e
if [ $MIGRATE = 1 ]; then
  SUMMARY=$("$E2E/migrate.sh" "$RUN" $MODE "$REPORT" $DEPLOY | tail -1)
  GINKGO_RC=$?
  [ -n "$SUMMARY" ] || SUMMARY="0 passed, 0 failed, 0 skipped"
else
inlab "$BIN/ginkgo" --procs=$PROCS --timeout=100m --no-color --silence-skips \
  --focus="$FOCUS" --skip="$SKIP" \
  --junit-report=junit.xml --json-report=report.json --output-dir="$REPORT" \
  "$BIN/e2e.test" -- \
  --provider=skeleton --kubeconfig="$RUN/admin.kubeconfig" --kubectl-path="$BIN/kubectl" \
  --num-nodes=$NODES --disable-log-dump --dump-logs-on-failure=false --minStartupPods=0 \
  > "$REPORT/ginkgo.log" 2>&1
GINKGO_RC=$?
fi
set -e
T_RUN=$((SECONDS - T1))
log "suite finished in ${T_RUN}s (ginkgo exit $GINKGO_RC; log $REPORT/ginkgo.log)"
kc -n kube-system logs -l k8s-app --all-containers --prefix --tail=-1 > "$REPORT/proxy.log" 2>&1 || true
LABEL=$PROXY; [ $PROXY = ours ] && [ $DEPLOY = kubeadm ] && LABEL="ours (kubeadm DaemonSet)"
[ $MIGRATE = 1 ] || SUMMARY=$(python3 "$E2E/report.py" summary "$REPORT/junit.xml" --focus "$FOCUS" --proxy "$LABEL" --mode "$MODE" --family "$IP_FAMILY" \
  --args "${PROXY_ARGS[*]+${PROXY_ARGS[*]}}" --up "$T_UP" --run "$T_RUN" --tree "$TREE" --out "$REPORT/result.json") || SUMMARY="0 passed, 0 failed, 0 skipped"

if [ $DOCS = 1 ]; then
  case $REPORT in
    "$REPO"/target/e2e-reports/*) python3 "$E2E/report.py" docs "$REPO"/target/e2e-reports/*/result.json --out "$REPO/docs/e2e.md" ;;
    *) log "--docs: --report is not under target/e2e-reports/, docs/e2e.md left as is" ;;
  esac
fi
if [ $KEEP = 1 ]; then trap - EXIT; log "--keep: cluster left running; stop it with: sudo e2e/down.sh $RUN"; RC=0
else trap - EXIT; teardown final && RC=0 || RC=$?; fi
case $SUMMARY in *" 0 failed"*) ;; *) RC=1 ;; esac
# A suite that did not run (ginkgo failed, no report, nothing passed) is a failure too.
case $SUMMARY in "0 passed"*) log "ERROR: no spec passed"; RC=1 ;; esac
[ $GINKGO_RC = 0 ] || RC=1
echo "$SUMMARY"
exit $RC
