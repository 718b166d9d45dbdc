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
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --no-fail-fast
