# kube-proxy-rs image. Build (from the repository root):
#   docker build -t kube-proxy-rs:0.1.0 .
# (or `podman build`, `buildah bud`). deploy/daemonset.yaml runs it.
# crates/kube-proxy-rs/tests/deploy.rs checks this file against the tree.

FROM docker.io/library/rust:1.89-bookworm AS build
WORKDIR /src
# clang compiles --socket-lb's BPF programs (crates/kp-ebpf/build.rs).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends clang \
 && rm -rf /var/lib/apt/lists/*
COPY Cargo.toml Cargo.lock ./
COPY crates ./crates
RUN cargo build --release --locked -p kube-proxy-rs --bin kube-proxy-rs --bin kp-docgen
RUN mkdir -p /out/bash /out/zsh /out/fish /out/man8 \
 && target/release/kp-docgen completions bash > /out/bash/kube-proxy-rs \
 && target/release/kp-docgen completions zsh > /out/zsh/_kube-proxy-rs \
 && target/release/kp-docgen completions fish > /out/fish/kube-proxy-rs.fish \
 && target/release/kp-docgen man > /out/man8/kube-proxy-rs.8

FROM docker.io/library/debian:bookworm-slim
# The tools each mode drives: nft (nftables fallback backend), iptables
# (nft and legacy), conntrack, ipset and ipvsadm (ipvs mode), ip.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      nftables iptables conntrack ipset ipvsadm iproute2 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/kube-proxy-rs /usr/local/bin/kube-proxy-rs
# kubeadm's DaemonSet runs /usr/local/bin/kube-proxy: swapping only the image
# must start this binary with upstream's command line.
RUN ln -s kube-proxy-rs /usr/local/bin/kube-proxy
COPY --from=build /out/bash/kube-proxy-rs /usr/share/bash-completion/completions/kube-proxy-rs
COPY --from=build /out/zsh/_kube-proxy-rs /usr/share/zsh/vendor-completions/_kube-proxy-rs
COPY --from=build /out/fish/kube-proxy-rs.fish /usr/share/fish/vendor_completions.d/kube-proxy-rs.fish
COPY --from=build /out/man8/kube-proxy-rs.8 /usr/share/man/man8/kube-proxy-rs.8
ENTRYPOINT ["/usr/local/bin/kube-proxy-rs"]
