#!/bin/bash
# Builds the lab's images as OCI layout tars (no registry, no Docker):
#   e2e/images.sh ours|upstream|both   -> prints "NAME=TAR" lines (one per image)
# Cached under target/e2e-images/ keyed by content (package list, binaries,
# image config), so a re-run reuses them.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
PROXY=${1:-ours}
mkdir -p "$IMAGES"

# One Debian rootfs serves agnhost (what the specs exec: curl, wget, nc, ip,
# ping, ps, dig, bash, conntrack, and iperf 2 as the real image has it; the
# real agnhost is Alpine, whose busybox gives wget, ping and ps) and both
# proxies (the Dockerfile's runtime packages).
SUITE=bookworm
PKGS=bash,curl,wget,netcat-openbsd,iproute2,iputils-ping,procps,dnsutils,conntrack,iptables,nftables,ipset,ipvsadm,ca-certificates,iperf
base_rootfs() {
  local key out
  key=$(echo "mmdebstrap minbase $SUITE $PKGS" | sha256sum | cut -c1-16)
  out=$IMAGES/debian-$key.tar
  if [ ! -s "$out" ]; then
    log "building the Debian rootfs ($PKGS) with mmdebstrap"
    # (mmdebstrap picks the output format from the name: keep it ending in .tar)
    mmdebstrap --quiet --variant=minbase --include=$PKGS $SUITE "${out%.tar}.tmp.tar" http://deb.debian.org/debian >&2
    mv "${out%.tar}.tmp.tar" "$out"
    prune debian "$out"
  fi
  echo "$out"
}

# prune SHORT KEEP: drop the older builds of one image (SHORT-<16 hex>.tar)
prune() {
  find "$IMAGES" -maxdepth 1 -regextype egrep -regex ".*/$1-[0-9a-f]{16}\.tar" ! -path "$2" -delete
}

# layer_from_dir DIR OUT: a reproducible layer tar of DIR's content.
layer_from_dir() {
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$1" -cf "$2" .
}

# oci NAME OUT ENTRYPOINT_JSON CMD_JSON LAYER...: an OCI layout tar whose index
# names the image (io.containerd.image.name) for `ctr images import`.
oci() {
  local name=$1 out=$2 ep=$3 cmd=$4; shift 4
  local d diffs="" l sum
  d=$(mktemp -d "$IMAGES/.oci.XXXXXX")
  mkdir -p "$d/blobs/sha256"
  local layers="[]"
  for l in "$@"; do
    sum=$(sha256sum "$l" | cut -d' ' -f1)
    ln "$l" "$d/blobs/sha256/$sum" 2>/dev/null || cp "$l" "$d/blobs/sha256/$sum"
    diffs="$diffs \"sha256:$sum\""
    layers=$(jq -c --arg s "sha256:$sum" --argjson n "$(stat -c %s "$l")" \
      '. + [{mediaType: "application/vnd.oci.image.layer.v1.tar", digest: $s, size: $n}]' <<<"$layers")
  done
  local cfg man idx
  cfg=$(jq -nc --argjson ep "$ep" --argjson cmd "$cmd" --argjson diffs "[$(echo $diffs | tr ' ' ',')]" \
    '{architecture: "amd64", os: "linux",
      config: ({Entrypoint: $ep, Env: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}
               + (if $cmd == null then {} else {Cmd: $cmd} end)),
      rootfs: {type: "layers", diff_ids: $diffs}}')
  printf '%s' "$cfg" > "$d/cfg"; sum=$(sha256sum "$d/cfg" | cut -d' ' -f1); mv "$d/cfg" "$d/blobs/sha256/$sum"
  man=$(jq -nc --arg c "sha256:$sum" --argjson cs "${#cfg}" --argjson layers "$layers" \
    '{schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
      config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $c, size: $cs}, layers: $layers}')
  printf '%s' "$man" > "$d/man"; sum=$(sha256sum "$d/man" | cut -d' ' -f1); mv "$d/man" "$d/blobs/sha256/$sum"
  jq -nc --arg m "sha256:$sum" --argjson ms "${#man}" --arg name "$name" --arg tag "${name##*:}" \
    '{schemaVersion: 2, manifests: [{mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $m, size: $ms,
      platform: {architecture: "amd64", os: "linux"},
      annotations: {"io.containerd.image.name": $name, "org.opencontainers.image.ref.name": $tag}}]}' > "$d/index.json"
  echo '{"imageLayoutVersion":"1.0.0"}' > "$d/oci-layout"
  tar -C "$d" -cf "$out.tmp" oci-layout index.json blobs && mv "$out.tmp" "$out"
  rm -rf "$d"
}

# image NAME ENTRYPOINT_JSON CMD_JSON BASE|- FILE:PATH... -> cached tar path
image() {
  local name=$1 ep=$2 cmd=$3 base=$4; shift 4
  local key f
  key=$( { echo "$name $ep $cmd"; [ "$base" = - ] || basename "$base"
           for f in "$@"; do echo "${f#*:}"; sha256sum "${f%%:*}" | cut -d' ' -f1; done; } | sha256sum | cut -c1-16)
  local short=${name##*/}; short=${short%%:*}
  local out=$IMAGES/$short-$key.tar
  if [ ! -s "$out" ]; then
    log "building image $name"
    local t; t=$(mktemp -d "$IMAGES/.layer.XXXXXX")
    mkdir -p "$t/root/etc" "$t/root/tmp"; chmod 1777 "$t/root/tmp"
    for f in "$@"; do
      local dst=$t/root/${f#*:}
      mkdir -p "$(dirname "$dst")"; cp -a "${f%%:*}" "$dst"
    done
    if [ -n "${BUSYBOX_APPLETS:-}" ]; then
      local a; for a in $("$t/root/bin/busybox" --list); do [ -e "$t/root/bin/$a" ] || ln -s busybox "$t/root/bin/$a"; done
      printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$t/root/etc/passwd"
      printf 'root:x:0:\nnogroup:x:65534:\n' > "$t/root/etc/group"
    fi
    layer_from_dir "$t/root" "$t/layer.tar"
    if [ "$base" = - ]; then oci "$name" "$out" "$ep" "$cmd" "$t/layer.tar"
    else oci "$name" "$out" "$ep" "$cmd" "$base" "$t/layer.tar"; fi
    rm -rf "$t"
    prune "$short" "$out"
  fi
  echo "$name=$out"
}

BASE=$(base_rootfs)
# agnhost porter serves TLS with ./localhost.crt and ./localhost.key (the
# image's own test pair, SANs 127.0.0.1 and ::1): a self-signed pair made
# once here and kept, so the image's cache key stays the same.
CERT=$IMAGES/agnhost-localhost
if [ ! -s $CERT.crt ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -days 20000 -subj /CN=localhost \
    -addext "subjectAltName=IP:127.0.0.1,IP:::1" -keyout $CERT.key -out $CERT.crt 2>/dev/null
fi
image registry.k8s.io/pause:3.10.2 '["/pause"]' null - "$BIN/pause:/pause"
image registry.k8s.io/e2e-test-images/agnhost:2.63.0 '["/agnhost"]' '["pause"]' "$BASE" "$BIN/agnhost:/agnhost" \
  "$CERT.crt:/localhost.crt" "$CERT.key:/localhost.key"
# kube_proxy.go's CLOSE_WAIT spec runs `conntrack -L` in a hostNetwork pod of
# this image (upstream: Debian's iptables and conntrack on distroless)
image registry.k8s.io/build-image/distroless-iptables:v0.9.3 null null "$BASE"
BUSYBOX_APPLETS=1 image registry.k8s.io/e2e-test-images/busybox:1.37.0-1 null '["sh"]' - /bin/busybox:/bin/busybox
upstream_image() {
  image registry.k8s.io/kube-proxy:v1.36.2 '["/usr/local/bin/kube-proxy"]' null "$BASE" "$BIN/kube-proxy:/usr/local/bin/kube-proxy"
}
ours_image() {
  KP_BINARY=${KP_BINARY:-$REPO/target/release/kube-proxy-rs}
  [ -x "$KP_BINARY" ] || die "$KP_BINARY missing"
  # deploy/ names the image kube-proxy-rs:0.1.0 (containerd: docker.io/library/...)
  # /usr/local/bin/kube-proxy too, as the Dockerfile links it: kubeadm's
  # DaemonSet (e2e.sh --deploy kubeadm) runs that path.
  image docker.io/library/kube-proxy-rs:0.1.0 '["/usr/local/bin/kube-proxy-rs"]' null "$BASE" \
    "$KP_BINARY:/usr/local/bin/kube-proxy-rs" "$KP_BINARY:/usr/local/bin/kube-proxy"
}
case $PROXY in
upstream) upstream_image ;;
ours) ours_image ;;
both) upstream_image; ours_image ;;   # e2e.sh --migrate
*) die "unknown proxy $PROXY" ;;
esac
