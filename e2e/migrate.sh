#!/bin/bash
# e2e/migrate.sh RUN MODE REPORT [deploy|kubeadm]: docs/migrate-from-kube-proxy.md
# followed on the live lab, under load (e2e.sh --migrate runs it on a cluster
# whose proxy is upstream kube-proxy in MODE). kubeadm: the image of kubeadm's
# DaemonSet swapped in place (kubectl set image), a pod deleted, and the
# image set back.
#
# One client pod per node calls a ClusterIP Service and, on the next node's
# address, its NodePort, each about 20 times a second (curl, 1 s timeout).
# Steps: upstream alone; replace it with kube-proxy-rs (delete its DaemonSet,
# apply deploy/); roll kube-proxy-rs to a new image; delete one of its pods;
# go back to upstream. Each request is counted in the step it was sent in;
# after each change, the kernel of every node is checked for what the proxy
# that left must not have left. Writes REPORT/migration.json and
# REPORT/migration.md; last line "N passed, M failed, 0 skipped" (a step
# passes with no failed request and nothing left behind).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
RUN=$1 MODE=$2 REPORT=$3 DEPLOY=${4:-deploy}
NS=kpe2e-migrate
STEPS=$REPORT/migration-steps
: > "$STEPS"
SETTLE=${MIGRATE_SETTLE:-15}

# nft tables / iptables chains of a node (its network namespace)
node_tables() { ip netns exec $(node_ns $1) nft list tables 2>/dev/null | sort | tr '\n' ' '; }
node_kube_chains() {
  ip netns exec $(node_ns $1) iptables-save 2>/dev/null | grep -c '^:KUBE-' || true
}
left=""  # what a step found left behind, appended by check_gone
check_gone() { # WHAT TABLE-REGEX: no node has a table matching
  local i t
  for i in $(seq 1 $NODES); do
    t=$(node_tables $i)
    if grep -Eq "$2" <<<"$t"; then left="$left $(node_name $i): $1 ($t);"; fi
  done
}
mark() { echo "$1 $(date +%s.%N)" >> "$STEPS"; log "migration step: $1"; }

# --- the Service and its clients
kc create namespace $NS >/dev/null
kc -n $NS create deployment web --image=registry.k8s.io/e2e-test-images/agnhost:2.63.0 --replicas=2 \
  --port=8080 -- /agnhost netexec --http-port=8080 >/dev/null
kc -n $NS expose deployment web --type=NodePort --port=80 --target-port=8080 >/dev/null
kc -n $NS rollout status deployment/web --timeout=120s >/dev/null
CIP=$(kc -n $NS get svc web -o jsonpath='{.spec.clusterIP}')
NP=$(kc -n $NS get svc web -o jsonpath='{.spec.ports[0].nodePort}')
NODE_IPS=$(for i in $(seq 1 $NODES); do printf '%s ' "$(node_ip $i)"; done)
cat > "$RUN/migrate-clients.yaml" <<EOT
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: client, namespace: $NS}
spec:
  selector: {matchLabels: {app: client}}
  template:
    metadata: {labels: {app: client}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
      - name: client
        image: registry.k8s.io/e2e-test-images/agnhost:2.63.0
        env:
        - {name: NODE_IP, valueFrom: {fieldRef: {fieldPath: status.hostIP}}}
        command: [bash, -c]
        args:
        - |
          # the NodePort of the next node (its proxy answers it)
          ips=($NODE_IPS); n=\${#ips[@]}
          for i in \$(seq 0 \$((n - 1))); do [ "\${ips[\$i]}" = "\$NODE_IP" ] && next=\${ips[\$(( (i + 1) % n ))]}; done
          loop() { # NAME URL
            while :; do
              t=\$(date +%s.%N)
              if curl -s -o /dev/null -m 1 "\$2"; then echo "\$t \$1 ok"; else echo "\$t \$1 FAIL"; fi
              sleep 0.02
            done
          }
          loop clusterip http://$CIP/hostname &
          loop nodeport http://\$next:$NP/hostname &
          wait
EOT
kc apply -f "$RUN/migrate-clients.yaml" >/dev/null
kc -n $NS rollout status ds/client --timeout=120s >/dev/null
log "clients: ClusterIP $CIP:80 and NodePort $NP on every node"

# --- the steps, as the doc says
mark upstream; sleep $SETTLE

if [ $DEPLOY = kubeadm ]; then
  # Only the image changes, as docs/migrate-from-kube-proxy.md's kubeadm
  # section says; the rolling update replaces one node's proxy at a time.
  swap_image() {
    kc -n kube-system set image ds/kube-proxy kube-proxy=$1 >/dev/null
    kc -n kube-system rollout status ds/kube-proxy --timeout=180s >/dev/null
  }
  mark swap
  swap_image docker.io/library/kube-proxy-rs:0.1.0
  sleep $SETTLE
  [ $MODE = nftables ] && check_gone "upstream's nftables table" '(ip|ip6) kube-proxy( |$)'
  echo "left swap $left" >> "$STEPS"; left=""

  mark delete-pod
  P=$(kc -n kube-system get pods -l k8s-app=kube-proxy -o jsonpath='{.items[0].metadata.name}')
  kc -n kube-system delete pod "$P" >/dev/null
  kc -n kube-system rollout status ds/kube-proxy --timeout=180s >/dev/null
  sleep $SETTLE

  mark back
  swap_image registry.k8s.io/kube-proxy:v1.36.2
  [ $MODE = nftables ] && delete_our_nft_tables docker.io/library/kube-proxy-rs:0.1.0
  sleep $SETTLE
  check_gone "kube-proxy-rs's nftables table" 'kube-proxy-rs'
  echo "left back $left" >> "$STEPS"; left=""
  mark end
else

mark replace
kc -n kube-system delete daemonset kube-proxy >/dev/null
"$E2E/proxy.sh" "$RUN" ours $MODE
sleep $SETTLE
[ $MODE = nftables ] && check_gone "upstream's nftables table" '(ip|ip6) kube-proxy( |$)'
echo "left replace $left" >> "$STEPS"; left=""

mark roll
for i in $(seq 1 $NODES); do
  ctr --address $RUN/node$i/containerd/containerd.sock -n k8s.io images tag --force \
    docker.io/library/kube-proxy-rs:0.1.0 docker.io/library/kube-proxy-rs:0.1.1 >/dev/null
done
kc -n kube-system set image ds/kube-proxy-rs init-host=kube-proxy-rs:0.1.1 kube-proxy-rs=kube-proxy-rs:0.1.1 >/dev/null
kc -n kube-system rollout status ds/kube-proxy-rs --timeout=180s >/dev/null
sleep $SETTLE

mark delete-pod
P=$(kc -n kube-system get pods -l app.kubernetes.io/name=kube-proxy-rs -o jsonpath='{.items[0].metadata.name}')
kc -n kube-system delete pod "$P" >/dev/null
kc -n kube-system rollout status ds/kube-proxy-rs --timeout=180s >/dev/null
sleep $SETTLE

mark back
"$E2E/migrate-back.sh" "$RUN" $MODE
sleep $SETTLE
check_gone "kube-proxy-rs's nftables table" 'kube-proxy-rs'
for i in $(seq 1 $NODES); do
  nsenter --net=/run/netns/$(node_ns $i) --mount=/proc/$(cat $RUN/node$i/pids/containerd)/ns/mnt -- \
    test -e /sys/fs/bpf/kube-proxy-rs && left="$left $(node_name $i): socket-lb pins;"
done
echo "left back $left" >> "$STEPS"; left=""
mark end
fi

# --- count
for p in $(kc -n $NS get pods -l app=client -o jsonpath='{.items[*].metadata.name}'); do
  kc -n $NS logs "$p" --tail=-1 | sed "s/^/$p /"
done > "$REPORT/migration-requests.log"
python3 - "$STEPS" "$REPORT/migration-requests.log" "$REPORT" "$MODE" <<'EOF'
import json, sys
steps_file, reqs_file, report, mode = sys.argv[1:]
marks, left = [], {}
for line in open(steps_file):
    parts = line.split()
    if parts[0] == "left":
        left[parts[1]] = " ".join(parts[2:])
    else:
        marks.append((parts[0], float(parts[1])))
bounds = [(marks[i][0], marks[i][1], marks[i + 1][1]) for i in range(len(marks) - 1)]
rows = {name: {"step": name, "seconds": round(b - a, 1), "clusterip": [0, 0], "nodeport": [0, 0], "failures": [],
               "left": left.get(name, "")} for name, a, b in bounds}
for line in open(reqs_file):
    parts = line.split()
    if len(parts) != 4:
        continue
    pod, t, what, res = parts[0], float(parts[1]), parts[2], parts[3]
    for name, a, b in bounds:
        if a <= t < b:
            r = rows[name]
            r[what][0] += 1
            if res != "ok":
                r[what][1] += 1
                r["failures"].append(f"{t:.2f} {pod} {what}")
            break
out = list(rows.values())
json.dump({"mode": mode, "steps": out}, open(f"{report}/migration.json", "w"), indent=1)
md = ["| step | seconds | ClusterIP requests | failed | NodePort requests | failed | left behind |", "|---|---|---|---|---|---|---|"]
for r in out:
    md.append(f"| {r['step']} | {r['seconds']} | {r['clusterip'][0]} | {r['clusterip'][1]} | {r['nodeport'][0]} | {r['nodeport'][1]} | {r['left'].strip() or 'nothing'} |")
open(f"{report}/migration.md", "w").write("\n".join(md) + "\n")
print("\n".join(md), file=sys.stderr)
for r in out:
    for f in r["failures"][:20]:
        print(f"failed in {r['step']}: {f}", file=sys.stderr)
bad = sum(1 for r in out if r["clusterip"][1] or r["nodeport"][1] or r["left"].strip() or not r["clusterip"][0] or not r["nodeport"][0])
print(f"{len(out) - bad} passed, {bad} failed, 0 skipped")
EOF
