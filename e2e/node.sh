#!/bin/bash
# e2e/node.sh up RUN I      node I: network namespace kpe2e-nodeI (veth into the
#                           lab bridge), cgroup root /kpe2e-nodeI, containerd +
#                           kubelet inside a private mount + UTS namespace
# e2e/node.sh net RUN N     once nodes 1..N registered: their pod CIDRs (from
#                           kube-controller-manager) -> CNI config + routes
# e2e/node.sh down RUN I    stop everything of node I, remove its cgroups and netns
set -euo pipefail
. "$(dirname "$0")/lib.sh"
CMD=$1; RUN=$2; I=$3
N=$(node_name $I); NS=$(node_ns $I); IP=$(node_ip $I); D=$RUN/node$I
CGROUPS="cpu cpuacct cpuset memory devices freezer blkio pids systemd"

up() {
  mkdir -p $D/{containerd,cni/net.d,cni/ipam,kubelet,pod-logs,varlib,varlog,sysctl,pids}
  ip netns add $NS
  ip -n $LAB_NS link add n$I type veth peer name eth0 netns $NS
  ip -n $LAB_NS link set n$I master br0 up
  ip -n $NS link set lo up
  ip -n $NS addr add $IP/24 dev eth0
  ip -n $NS link set eth0 up
  ip -n $NS route add default via $LAB_IP
  if has_v6; then
    ip -n $NS addr add $(node_ip6 $I)/64 dev eth0 nodad
    ip -n $NS -6 route add default via $LAB_IP6
    # the CNI bridge forwards the pods' IPv6 too (a setting of this namespace)
    ip netns exec $NS sysctl -qw net.ipv6.conf.all.forwarding=1
  fi
  # kubelet's cgroupRoot must exist in every v1 hierarchy (cpuset: cpus/mems)
  local c
  for c in $CGROUPS; do mkdir -p /sys/fs/cgroup/$c/$N; done
  # the node's own cgroup v2 directory (runc puts the pods below it): where
  # --socket-lb attaches on this node, never the machine's root cgroup
  mkdir -p /sys/fs/cgroup/unified/$N
  cat /sys/fs/cgroup/cpuset/cpuset.cpus > /sys/fs/cgroup/cpuset/$N/cpuset.cpus
  cat /sys/fs/cgroup/cpuset/cpuset.mems > /sys/fs/cgroup/cpuset/$N/cpuset.mems
  # what kubelet writes to machine-wide sysctls lands in these files instead
  # (bind-mounted over /proc/sys/... in the node's mount namespace)
  echo 10 > $D/sysctl/kernel.panic; echo 1 > $D/sysctl/kernel.panic_on_oops
  echo 1 > $D/sysctl/vm.overcommit_memory; echo 0 > $D/sysctl/vm.panic_on_oom
  echo 1000000 > $D/sysctl/kernel.keys.root_maxkeys; echo 25000000 > $D/sysctl/kernel.keys.root_maxbytes
  echo "# kpe2e node: no upstream resolver (the lab has no network beyond itself)" > $D/resolv.conf
  cat > $D/containerd/config.toml <<EOT
version = 2
root = "$D/containerd/root"
state = "$D/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "$D/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10.2"
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$D/cni/net.d"
    max_conf_num = 1
EOT
  # kubelet's server on every address of the node once IPv6 is in use
  local KUBELET_ADDRESS=$IP; has_v6 && KUBELET_ADDRESS="::"
  cat > $D/kubelet-config.yaml <<EOT
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupRoot: /$N
containerRuntimeEndpoint: unix://$D/containerd/containerd.sock
podLogsDir: $D/pod-logs
volumePluginDir: $D/volume-plugins
address: "$KUBELET_ADDRESS"
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
clusterDomain: cluster.local
clusterDNS: ["$DNS_IP"]
resolvConf: $D/resolv.conf
protectKernelDefaults: false
makeIPTablesUtilChains: false
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
EOT
  nsenter --net=/run/netns/$NS unshare --mount --uts --propagation private -- \
    setsid bash "$E2E/node.sh" inner "$RUN" $I > $D/inner.log 2>&1 < /dev/null &
  echo $! > $D/pids/inner
}

# Runs inside the node's network namespace and its new mount + UTS namespace.
inner() {
  set -x
  # this mount namespace copied other namespaces' nsfs mounts: drop them (else
  # they pin those network namespaces, including other users' ones)
  local m
  for m in $(findmnt -rn -t nsfs -o TARGET | sort -r); do umount -l "$m" || true; done
  mount -t tmpfs -o mode=755,size=256m tmpfs /run
  mount --bind $D/varlib /var/lib
  mount --bind $D/varlog /var/log
  local s
  for s in kernel.panic kernel.panic_on_oops vm.overcommit_memory vm.panic_on_oom kernel.keys.root_maxkeys kernel.keys.root_maxbytes; do
    mount --bind $D/sysctl/$s /proc/sys/${s//.//}
  done
  # what a node's init system mounts: a bpf filesystem (pins of --socket-lb);
  # and, where a node would have the host's cgroup v2 root, this node's own
  # cgroup v2 directory (e2e/proxy.sh points --socket-lb's hostPath there)
  mount -t bpf bpf /sys/fs/bpf
  # shared, as on a systemd host: a pod may mount it with HostToContainer
  mount --make-shared /sys/fs/bpf
  mkdir -p /run/kpe2e-cgroup2
  mount --bind /sys/fs/cgroup/unified/$N /run/kpe2e-cgroup2
  # no resolver beyond the lab: a pull of an image the lab lacks fails at once
  mount --bind $D/resolv.conf /etc/resolv.conf
  hostname $N
  containerd --config $D/containerd/config.toml > $D/containerd.log 2>&1 < /dev/null &
  echo $! > $D/pids/containerd
  local sock=$D/containerd/containerd.sock
  wait_for 30 ctr --address $sock version || { echo "containerd did not start"; exit 1; }
  local img
  for img in $(cat $RUN/images.list); do ctr --address $sock -n k8s.io images import --no-unpack=false "${img#*=}" >/dev/null; done
  ctr --address $sock -n k8s.io images ls -q
  "$BIN/kubelet" --config $D/kubelet-config.yaml --kubeconfig $RUN/node$I.kubeconfig \
    --root-dir $D/kubelet --hostname-override $N --node-ip $(node_ips $I) \
    --node-labels=topology.kubernetes.io/zone=zone-$I --v=2 > $D/kubelet.log 2>&1 < /dev/null &
  echo $! > $D/pids/kubelet
  echo "node $N started"
}

has_cidr() { [ -n "$(kc get node $1 -o jsonpath='{.spec.podCIDR}' 2>/dev/null)" ]; }

# After registration: CNI config with the node's pod CIDR, routes to every pod CIDR
net() {
  local n=$I j cidr
  for j in $(seq 1 $n); do
    wait_for 180 has_cidr $(node_name $j) || die "node $(node_name $j) got no podCIDR"
  done
  for j in $(seq 1 $n); do
    local cidrs ranges="" routes="" via k
    cidrs=$(kc get node $(node_name $j) -o jsonpath='{.spec.podCIDRs[*]}')
    for cidr in $cidrs; do
      case $cidr in *:*) via=$(node_ip6 $j); routes="$routes, {\"dst\": \"::/0\"}" ;;
                    *) via=$(node_ip $j); routes="$routes, {\"dst\": \"0.0.0.0/0\"}" ;; esac
      ranges="$ranges, [{\"subnet\": \"$cidr\"}]"
      ip -n $LAB_NS route replace $cidr via $via
      for k in $(seq 1 $n); do [ $k = $j ] || ip -n $(node_ns $k) route replace $cidr via $via; done
    done
    cat > $RUN/node$j/cni/net.d/10-kpe2e.conflist <<EOT
{"cniVersion": "0.4.0", "name": "kpe2e-pods", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [${ranges#, }], "routes": [${routes#, }],
            "dataDir": "$RUN/node$j/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOT
    log "$(node_name $j): $(node_ips $j), pods ${cidrs// /,}"
  done
}

down() {
  [ -d $D ] || return 0
  local kp cp mnt p
  kp=$(cat $D/pids/kubelet 2>/dev/null || true); cp=$(cat $D/pids/containerd 2>/dev/null || true)
  mnt=$(readlink /proc/$cp/ns/mnt 2>/dev/null || readlink /proc/$kp/ns/mnt 2>/dev/null || true)
  # (never the machine's own mount namespace: a stale pid could point there)
  [ "$mnt" = "$(readlink /proc/$$/ns/mnt)" ] && mnt=""
  [ -n "$kp" ] && kill $kp 2>/dev/null && stop_wait $kp
  # the pods' processes: everything in the node's cgroup subtree
  for p in $(cat $(find /sys/fs/cgroup/pids/$N -name cgroup.procs 2>/dev/null) /dev/null 2>/dev/null | sort -u); do kill -9 $p 2>/dev/null || true; done
  [ -n "$cp" ] && kill $cp 2>/dev/null && stop_wait $cp
  # whatever else lives in the node's mount or network namespace (shims)
  local netino; netino=$(stat -L -c %i /run/netns/$NS 2>/dev/null || echo none)
  for p in $(procs_in net "net:\[$netino\]") ${mnt:+$(procs_in mnt "${mnt/[/\\[}")}; do kill -9 $p 2>/dev/null || true; done
  sleep 0.5
  local h
  for h in /sys/fs/cgroup/*; do
    [ -d $h/$N ] && find $h/$N -depth -type d -exec rmdir {} \; 2>/dev/null
    [ -d $h/$N ] && log "WARNING: cgroup $h/$N left"
  done
  ip netns del $NS 2>/dev/null || true
  rm -rf $D/containerd/root $D/containerd/state $D/kubelet $D/varlib 2>/dev/null || true
}
stop_wait() { local i; for i in $(seq 40); do kill -0 $1 2>/dev/null || return 0; sleep 0.25; done; kill -9 $1 2>/dev/null || true; }

$CMD
