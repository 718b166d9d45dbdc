#!/bin/bash
# e2e/cluster-dns.sh RUN: the lab's cluster DNS (e2e/dns.py) in the lab
# namespace, behind the kube-dns Service (kube-system, $KUBE_DNS_IP) that
# kubelet's clusterDNS points at: a Service without selector plus an
# EndpointSlice naming the lab address, so the proxy under test carries the
# pods' DNS traffic like any other Service's.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
RUN=$1
awk -F, '$2=="admin" {print $1}' "$RUN/pki/tokens.csv" > "$RUN/pki/admin.token"
LISTEN="--listen $LAB_IP"; has_v6 && LISTEN="$LISTEN --listen $LAB_IP6"
# the kube-dns Service in the cluster's primary family, as kubeadm makes it
DNS_FAMILY=IPv4 DNS_AT=$LAB_IP
[ $IP_FAMILY = ipv6 ] && DNS_FAMILY=IPv6 DNS_AT=$LAB_IP6
nsenter --net=/run/netns/$LAB_NS -- setsid python3 "$E2E/dns.py" $LISTEN --api $API --token-file "$RUN/pki/admin.token" \
  --ca "$RUN/pki/ca.crt" > "$RUN/logs/dns.log" 2>&1 < /dev/null &
echo $! > "$RUN/pids/dns"
kc apply -f - >/dev/null <<EOT
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns, kubernetes.io/name: CoreDNS}
spec:
  clusterIP: $DNS_IP
  ipFamilies: [$DNS_FAMILY]
  ports:
  - {name: dns, port: 53, protocol: UDP, targetPort: 53}
  - {name: dns-tcp, port: 53, protocol: TCP, targetPort: 53}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kube-dns-lab
  namespace: kube-system
  labels: {kubernetes.io/service-name: kube-dns, endpointslice.kubernetes.io/managed-by: kpe2e}
addressType: $DNS_FAMILY
endpoints:
- addresses: ["$DNS_AT"]
  conditions: {ready: true}
ports:
- {name: dns, port: 53, protocol: UDP}
- {name: dns-tcp, port: 53, protocol: TCP}
EOT
# one A (AAAA in an IPv6 cluster) query for kubernetes.default (the host has no dig)
dns_ok() {
  inlab python3 -c 'import socket,sys
s=socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET,socket.SOCK_DGRAM); s.settimeout(1)
q=b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"+b"".join(bytes([len(x)])+x.encode() for x in "kubernetes.default.svc.cluster.local".split("."))+b"\x00"+(b"\x00\x1c" if ":" in sys.argv[1] else b"\x00\x01")+b"\x00\x01"
s.sendto(q,(sys.argv[1],53)); r=s.recv(512); sys.exit(0 if r[3]&15==0 and r[7]>0 else 1)' $DNS_AT
}
wait_for 20 dns_ok || die "lab DNS does not answer ($RUN/logs/dns.log)"
log "cluster DNS: kube-dns $DNS_IP -> $DNS_AT port 53 (e2e/dns.py)"
