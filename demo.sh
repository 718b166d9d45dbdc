#!/usr/bin/env bash
# kube-proxy-rs demo: builds the binaries and runs kp-demo, which makes a
# two-node cluster out of network namespaces, runs kube-proxy-rs (nftables
# mode) on node1 and sends traffic through a ClusterIP. Nothing outside the
# namespaces it creates is touched; they are removed when it ends.
set -euo pipefail

cd "$(dirname "$0")"

if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        echo "demo.sh: network namespaces need root; re-running with sudo" >&2
        exec sudo -E env "PATH=$PATH" bash "$0" "$@"
    fi
    echo "demo.sh: must run as root (it creates network namespaces) and sudo is not available; run it as root" >&2
    exit 1
fi

missing=()
command -v nft >/dev/null 2>&1 || missing+=(nftables)
command -v conntrack >/dev/null 2>&1 || missing+=(conntrack)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
if [ "${#missing[@]}" -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "demo.sh: missing packages (${missing[*]}) and no apt-get to install them; install nftables, iptables, conntrack and iproute2" >&2
        exit 1
    fi
    echo "demo.sh: installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables iptables conntrack iproute2
fi

if ! command -v cargo >/dev/null 2>&1; then
    echo "demo.sh: cargo not found on PATH; install Rust (https://rustup.rs) or run with a PATH that has it" >&2
    exit 1
fi

echo "demo.sh: building (release; the first build takes a few minutes)" >&2
# Both binaries by name: `--bin kube-proxy-rs` alone would also filter
# kp-demo's binary out of `-p kp-demo`.
cargo build --release -p kube-proxy-rs -p kp-demo --bin kube-proxy-rs --bin kp-demo

# Where cargo put it (CARGO_TARGET_DIR may move the target directory).
exec "${CARGO_TARGET_DIR:-target}/release/kp-demo"
