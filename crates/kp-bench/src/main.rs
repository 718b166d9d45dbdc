//! kp-bench: kube-proxy-rs's benchmarks, one subcommand each. A subcommand
//! is a variant of [`Bench`] (its arguments, documented for `--help`) and an
//! arm of `main`'s match (the module's run); the code is in the library.
//! The commands behind the published figures are in BENCHMARKS.md.

use anyhow::Result;
use clap::{Parser, Subcommand};
use kp_bench::{
    cluster, compare, connect, idle, maglev, pps, prog, reconcile, soak, tables, userspace_relay,
};

// The allocator kube-proxy-rs itself uses (see its main.rs), so the figures
// of what runs in this process (the proxiers the tables drive) are the
// product's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// kube-proxy-rs's benchmarks. Most need root: each builds the network
/// namespaces, cgroups and control planes it measures in, and removes them
/// after. The commands behind the published figures are in BENCHMARKS.md.
#[derive(Parser)]
#[command(name = "kp-bench", version)]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// nftables mode's control plane at scale: model, render, full sync and
    /// timed changes (an endpoint replaced or added, a Service added and
    /// deleted, a burst) of N Services, applied to the kernel in a fresh
    /// network namespace per size.
    Nftables(tables::NftablesArgs),
    /// iptables mode's control plane at scale, the same table as nftables;
    /// over iptables-nft and netlink also the kernel's floor for that
    /// layout, beside the table (stderr).
    Iptables(tables::IptablesArgs),
    /// userspace mode's control plane at scale, the same table: the
    /// proxier's listeners and Service IPs on lo of a fresh namespace,
    /// nothing sent to netfilter.
    Userspace(tables::TableArgs),
    /// The socket load balancer's map writes alone at scale, the same table
    /// (its programs attached to a cgroup of the bench's own, pins on a
    /// private bpffs); the full sync column adds a restarted proxy's.
    Socketlb(tables::SocketLbArgs),
    /// The Maglev tables of `--bpf-lb-algorithm maglev` alone, no kernel
    /// and no root: build time, flows moved when an endpoint leaves,
    /// agreement between nodes, map memory.
    Maglev,
    /// kube-proxy-rs and upstream kube-proxy side by side in one run,
    /// against one real kube-apiserver: first sync, endpoint changes, a
    /// Service added and deleted, a burst, idle CPU and memory, measured
    /// through what both export and the kernel shows (or, with --connect,
    /// connect latency through each one's rules).
    Compare(compare::CompareArgs),
    /// A proxy holding 10k Services under a steady stream of API updates
    /// for 10 minutes: RSS, fds, CPU and sync durations over time, nothing
    /// lost at the end; fails when an update was lost or RSS did not
    /// plateau.
    Soak(soak::SoakArgs),
    /// The real kube-proxy-rs binary's steady state with a big cluster read
    /// from manifests: time and CPU to the first sync, peak RSS, then idle
    /// RSS, CPU and syncs once settled; optionally restarts after SIGKILL.
    Idle(idle::IdleArgs),
    /// Data-plane connect latency from a pod with N Services programmed by
    /// our proxiers (nftables, nftables + socket-lb, iptables) against the
    /// pod IP, in interleaved rounds, and bulk throughput through each.
    Connect(connect::ConnectArgs),
    /// NodePort packet rate, upstream kube-proxy and kube-proxy-rs in one
    /// run: the highest UDP rate forwarded without loss, the node's CPU per
    /// packet, new TCP connections a second and request latency.
    Pps(pps::PpsArgs),
    /// What one conntrack reconcile of the sync loop costs against the real
    /// kernel: the dump, the decision and the deletes of stale UDP flows in
    /// a scratch namespace, then a second reconcile with nothing stale.
    Reconcile(reconcile::ReconcileArgs),
    /// userspace mode's data path on loopback, no privileges: a bulk TCP
    /// transfer and many short connections, each through the proxy and
    /// direct, as ratios, with the CPU each side spends.
    UserspaceRelay(userspace_relay::RelayArgs),
    /// The eBPF datapath's tc (or XDP) program alone under
    /// BPF_PROG_TEST_RUN: ns per run for crafted frames (first packet and
    /// established, request and reply, TCP and UDP, both families) with the
    /// maps as at 1 and 100k Services; two builds alternated with --against.
    Prog(prog::Args),
    /// K node namespaces, each with its own proxy and kernel, against one
    /// real kube-apiserver: upstream kube-proxy and kube-proxy-rs side by
    /// side (all K starting, the API server restarting, a stream and a
    /// burst of changes timed to each node's kernel, --fit for the most
    /// nodes this machine holds).
    Cluster(cluster::ClusterArgs),
}

fn main() -> Result<()> {
    match Cli::parse().bench {
        Bench::Nftables(a) => tables::nftables(a),
        Bench::Iptables(a) => tables::iptables(a),
        Bench::Userspace(a) => tables::userspace(a),
        Bench::Socketlb(a) => tables::socketlb(a),
        Bench::Maglev => maglev::run(),
        Bench::Compare(a) => compare::run(a),
        Bench::Soak(a) => soak::run(a),
        Bench::Idle(a) => idle::run(a),
        Bench::Connect(a) => connect::run(a),
        Bench::Pps(a) => pps::run(a),
        Bench::Reconcile(a) => reconcile::run(a),
        Bench::UserspaceRelay(a) => userspace_relay::run(a),
        Bench::Prog(a) => prog::run(a),
        Bench::Cluster(a) => cluster::run(a),
    }
}
