#!/bin/bash
# e2e/proxy.sh RUN ours|upstream MODE [deploy|kubeadm]: deploys the proxy as
# a DaemonSet and waits until it runs on every node.
#  upstream: e2e/upstream/kube-proxy.yaml (kubeadm's shape).
#  ours kubeadm: the same file, only the image ours (as an operator swaps it).
#  ours:     `kubectl apply -k` of an overlay on deploy/ that does what
#            docs/migrate-from-kube-proxy.md asks of a user: the API server
#            address in kubeconfig.conf, the mode, the cluster's pod CIDRs
#            (both, comma-separated, in a dual-stack lab), and (the lab's one
#            addition) conntrack maxPerCore/min 0: leave the machine-wide
#            conntrack table size alone.
#            MODE socketlb: nftables plus docs/ebpf.md's kustomize patch for
#            --socket-lb, taken from the doc as written; the lab changes one
#            thing, the host-cgroup hostPath: the node's own cgroup v2
#            directory (e2e/node.sh), as the nodes share one machine.
#            MODE bpf: the same, plus docs/ebpf.md's patch for --bpf-nodeport.
#            PROXY_ARGS_LINES (e2e.sh --proxy-arg, one flag a line): added
#            to the container's args by one more patch, as that page shows.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
RUN=$1 PROXY=$2 MODE=$3 DEPLOY=${4:-deploy}
IMAGE=registry.k8s.io/kube-proxy:v1.36.2
if [ $PROXY = ours ] && [ $DEPLOY = kubeadm ]; then
  PROXY=upstream IMAGE=docker.io/library/kube-proxy-rs:0.1.0
fi
case $PROXY in
upstream)
  # kubeadm's bindAddress follows the API server's advertise address: "::" for IPv6
  BIND=0.0.0.0; [ $IP_FAMILY = ipv6 ] && BIND="'::'"
  sed -e "s#@API@#$API#" -e "s#@MODE@#$MODE#" -e "s#@CLUSTER_CIDR@#$CLUSTER_CIDRS#" -e "s#@BIND@#$BIND#" \
      -e "s#@IMAGE@#$IMAGE#" "$E2E/upstream/kube-proxy.yaml" > "$RUN/kube-proxy.yaml"
  kc apply -f "$RUN/kube-proxy.yaml" >/dev/null
  # ours carry k8s-app=kube-proxy too (deploy/daemonset.yaml)
  DS=kube-proxy SEL='k8s-app=kube-proxy,!app.kubernetes.io/name' ;;
ours)
  O=$RUN/deploy-ours; rm -rf "$O"; mkdir -p "$O"
  cp -r "$REPO/deploy" "$O/base"
  # config.conf and kubeconfig.conf from deploy/configmap.yaml, edited as the doc says
  kc create --dry-run=client -o json -f "$O/base/configmap.yaml" > "$O/cm.json"
  CONF_MODE=$MODE; case $MODE in socketlb|bpf) CONF_MODE=nftables ;; esac
  grep -q '^    clusterCIDR: ' "$O/base/configmap.yaml" || die "deploy/configmap.yaml has no clusterCIDR: adjust e2e/proxy.sh"
  jq -r '.data["config.conf"]' "$O/cm.json" | sed -e "s/^mode: .*/mode: $CONF_MODE/" \
    -e "s#^clusterCIDR: .*#clusterCIDR: $CLUSTER_CIDRS#" > "$O/config.conf"
  grep -q '^conntrack:' "$O/config.conf" && die "deploy/configmap.yaml sets conntrack: adjust e2e/proxy.sh"
  printf 'conntrack:\n  maxPerCore: 0\n  min: 0\n' >> "$O/config.conf"
  jq -r '.data["kubeconfig.conf"]' "$O/cm.json" | sed -e "s#https://CONTROL-PLANE-ENDPOINT:6443#$API#" > "$O/kubeconfig.conf"
  cat > "$O/kustomization.yaml" <<EOT
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - base
configMapGenerator:
  - name: kube-proxy-rs
    namespace: kube-system
    behavior: replace
    files:
      - config.conf
      - kubeconfig.conf
generatorOptions:
  disableNameSuffixHash: true
EOT
  if [ $MODE = socketlb ] || [ $MODE = bpf ]; then
    # the YAML block after "# kustomize patch for deploy/" in docs/ebpf.md
    awk '/^# kustomize patch for deploy\//{on=1; next} on && /^```/{exit} on' "$REPO/docs/ebpf.md" > "$O/socketlb-doc.yaml"
    grep -q -- '--socket-lb' "$O/socketlb-doc.yaml" || die "no --socket-lb patch found in docs/ebpf.md"
    grep -q 'hostPath: {path: /sys/fs/cgroup, type: Directory}' "$O/socketlb-doc.yaml" \
      || die "docs/ebpf.md's patch changed its host-cgroup volume: adjust e2e/proxy.sh"
    sed -e 's#hostPath: {path: /sys/fs/cgroup, type: Directory}#hostPath: {path: /run/kpe2e-cgroup2, type: Directory}#' \
      "$O/socketlb-doc.yaml" > "$O/socketlb.yaml"
    if [ $MODE = bpf ]; then
      # ... and the block after "# kustomize patch for deploy/, --bpf-nodeport"
      awk '/^# kustomize patch for deploy\/, --bpf-nodeport/{on=1; next} on && /^```/{exit} on' "$REPO/docs/ebpf.md" > "$O/bpf-doc.yaml"
      grep -q -- '--bpf-nodeport' "$O/bpf-doc.yaml" || die "no --bpf-nodeport patch found in docs/ebpf.md"
      cat "$O/bpf-doc.yaml" >> "$O/socketlb.yaml"
    fi
    cat >> "$O/kustomization.yaml" <<EOT
patches:
  - path: socketlb.yaml
    target: {kind: DaemonSet, name: kube-proxy-rs}
EOT
  fi
  args=()
  while IFS= read -r a; do [ -n "$a" ] && args+=("$a"); done <<< "${PROXY_ARGS_LINES:-}"
  if [ ${#args[@]} -gt 0 ]; then
    # the same JSON patch shape as docs/ebpf.md's, one op per flag
    for a in "${args[@]}"; do
      printf -- '- op: add\n  path: /spec/template/spec/containers/0/args/-\n  value: %s\n' "$(jq -n --arg a "$a" '$a')"
    done > "$O/args.yaml"
    grep -q '^patches:' "$O/kustomization.yaml" || echo 'patches:' >> "$O/kustomization.yaml"
    cat >> "$O/kustomization.yaml" <<EOT
  - path: args.yaml
    target: {kind: DaemonSet, name: kube-proxy-rs}
EOT
  fi
  kc apply -k "$O" >/dev/null
  DS=kube-proxy-rs SEL=app.kubernetes.io/name=kube-proxy-rs ;;
esac
kc -n kube-system rollout status ds/$DS --timeout=180s >/dev/null || {
  kc -n kube-system get pods -o wide >&2; die "DaemonSet $DS did not become ready"; }
log "$2 proxy ($MODE, $DEPLOY) running on every node: $(kc -n kube-system get pods -l $SEL -o jsonpath='{range .items[*]}{.spec.nodeName} {end}')"
