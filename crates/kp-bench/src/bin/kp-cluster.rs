//! kp-cluster: K proxies against one API server, upstream's and ours side
//! by side (see `kp_bench::cluster`).

use clap::Parser;
use kp_bench::cluster::{run, ClusterArgs};

#[derive(Parser)]
#[command(
    name = "kp-cluster",
    about = "K node namespaces, each with its own proxy, against one real kube-apiserver: upstream kube-proxy and kube-proxy-rs side by side"
)]
struct Cli {
    #[command(flatten)]
    args: ClusterArgs,
}

fn main() -> anyhow::Result<()> {
    run(Cli::parse().args)
}
