#!/usr/bin/env bash
# Runs every check CI runs: formatting, clippy, and the whole test suite,
# including the real-kernel tests in network namespaces (needs root).
set -euo pipefail
cd "$(dirname "$0")"

if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then exec sudo -E "$0" "$@"; fi
  echo "test.sh: the dataplane tests need root (network namespaces, nftables)" >&2
  exit 1
fi

# Tools the tests drive: nft, iptables(-restore), conntrack, ip, ipset (cleanup tests).
missing=()
command -v nft >/dev/null 2>&1 || missing+=(nftables)
command -v iptables-restore >/dev/null 2>&1 || missing+=(iptables)
command -v conntrack >/dev/null 2>&1 || missing+=(conntrack)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v ipset >/dev/null 2>&1 || missing+=(ipset)
command -v ipvsadm >/dev/null 2>&1 || missing+=(ipvsadm)
# --socket-lb's BPF programs are compiled by clang when the workspace builds
# (crates/kp-ebpf/build.rs); its tests load them into the kernel.
command -v clang >/dev/null 2>&1 || missing+=(clang)
# ... and the tc programs' tests list them where they are attached.
command -v bpftool >/dev/null 2>&1 || missing+=(bpftool)
# ... and the XDP case has the lab's senders send full checksums.
command -v ethtool >/dev/null 2>&1 || missing+=(ethtool)
# The real control plane (kp-testkit's control_plane): etcd, openssl for the
# test certificates, xz to unpack ../shared/k8s.
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v xz >/dev/null 2>&1 || missing+=(xz-utils)
# The IPVS test VM (kube-proxy-rs/tests/conformance_ipvs.rs, docs/ipvs.md):
# qemu, Debian's kernel (it has ip_vs; this host's kernel has not), a static
# busybox and cpio for the initramfs, kmod's modinfo.
vm=()
command -v qemu-system-x86_64 >/dev/null 2>&1 || vm+=(qemu-system-x86)
ls /lib/modules/*-amd64/kernel/net/netfilter/ipvs/ip_vs.ko >/dev/null 2>&1 || vm+=(linux-image-amd64)
dpkg -s busybox-static >/dev/null 2>&1 || vm+=(busybox-static)
command -v cpio >/dev/null 2>&1 || vm+=(cpio)
command -v modinfo >/dev/null 2>&1 || vm+=(kmod)
# promtool checks deploy/monitoring's alert rules (Debian ships it in the
# prometheus package; without recommends, so no exporters come along).
norec=()
command -v promtool >/dev/null 2>&1 || norec+=(prometheus)
if [ ${#missing[@]} -gt 0 ] || [ ${#vm[@]} -gt 0 ] || [ ${#norec[@]} -gt 0 ]; then
  echo "installing ${missing[*]} ${vm[*]}"
  apt-get update -qq
fi
if [ ${#missing[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [ ${#norec[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${norec[@]}" >/dev/null
fi
# The VM's packages are Debian's (linux-image-amd64 is not on Ubuntu): when
# they cannot be installed the rest still runs, and the IPVS VM test says
# loudly why it cannot (and fails where KP_REQUIRE_IPVS_VM=1, as CI sets).
if [ ${#vm[@]} -gt 0 ]; then
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${vm[@]}" >/dev/null; then
    echo "test.sh: could not install ${vm[*]}; the IPVS VM test (conformance_ipvs) cannot run here" >&2
  fi
fi

# kube-apiserver, kubectl and upstream kube-proxy v1.36 (../shared/k8s beside
# the checkout, or the *_BIN variables): unpacked once for every test process.
# Without them the real-API tests skip loudly (fail with
# KP_REQUIRE_REAL_APISERVER=1, as CI sets).
shared_k8s=${KP_SHARED_K8S_DIR:-../shared/k8s}
if [ -z "${KUBE_APISERVER_BIN:-}" ] && [ -f "$shared_k8s/install.sh" ]; then
  bin=$(bash "$shared_k8s/install.sh" "$PWD/target/k8s-bin")
  export KUBE_APISERVER_BIN="$bin/kube-apiserver" KUBECTL_BIN="$bin/kubectl"
  export UPSTREAM_KUBE_PROXY_BIN="${UPSTREAM_KUBE_PROXY_BIN:-$bin/kube-proxy}"
fi

# etcd 3.5 for the real control plane: kube-apiserver v1.36 serves
# streaming lists (client-go's default since 1.35, and ours) only over an
# etcd with progress notifications, which bookworm's etcd-server (3.4.23)
# lacks. Debian trixie's etcd-server package is unpacked into target/ once;
# nothing is installed and the host's apt sources are left as they are.
etcd35="$PWD/target/etcd-3.5/usr/bin/etcd"
if [ -z "${ETCD_BIN:-}" ]; then
  if [ ! -x "$etcd35" ]; then
    apt_dir="$PWD/target/etcd-3.5.apt"
    mkdir -p "$apt_dir/lists/partial"
    echo "deb http://deb.debian.org/debian trixie main" > "$apt_dir/sources.list"
    apt_opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o Dir::Etc::sourceparts=-
              -o "Dir::State::Lists=$apt_dir/lists" -o APT::Get::List-Cleanup=0)
    if apt-get "${apt_opts[@]}" update -qq >/dev/null 2>&1 &&
       (cd "$apt_dir" && apt-get "${apt_opts[@]}" download etcd-server >/dev/null 2>&1); then
      dpkg -x "$apt_dir"/etcd-server_*.deb "$PWD/target/etcd-3.5"
    fi
  fi
  if [ -x "$etcd35" ]; then
    export ETCD_BIN="$etcd35"
  else
    echo "test.sh: could not fetch etcd 3.5 (Debian trixie's etcd-server); the real-API tests use $(command -v etcd), and the streaming-list test fails under KP_REQUIRE_REAL_APISERVER=1" >&2
  fi
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# cargo-nextest (on every machine of this kind; .config/nextest.toml) runs
# the test binaries side by side instead of one after another: most tests
# wait on kernels, API servers and timeouts, so the suite takes about half
# the time. Without it, cargo test runs the same tests.
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast
  cargo test --workspace --doc
else
  cargo test --workspace --no-fail-fast
fi
