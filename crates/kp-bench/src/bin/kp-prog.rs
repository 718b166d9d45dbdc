//! `kp-prog`: the eBPF datapath's programs alone under BPF_PROG_TEST_RUN
//! (kp_bench::prog; `kp-bench prog` runs the same).

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "kp-prog",
    about = "Times the eBPF datapath's tc program with BPF_PROG_TEST_RUN"
)]
struct Cli {
    #[command(flatten)]
    args: kp_bench::prog::Args,
}

fn main() -> anyhow::Result<()> {
    kp_bench::prog::run(Cli::parse().args)
}
