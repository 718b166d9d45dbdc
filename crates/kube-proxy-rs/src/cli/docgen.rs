//! Shell completions and the man page, generated from the clap flag
//! definitions (config/flags.rs) so they always list exactly the flags the binary
//! takes. `kp-docgen` writes them; the Dockerfile installs them in the image.

use std::io::Write;

use clap::CommandFactory;
use clap_complete::Shell;

use crate::config::Cli;

/// The installed program's name (the clap command keeps upstream's
/// `kube-proxy` in its help header).
pub const BIN: &str = "kube-proxy-rs";

fn command() -> clap::Command {
    Cli::command().name(BIN).bin_name(BIN)
}

/// Writes the completion script for `shell` (bash, zsh, fish, elvish, powershell).
pub fn completions(shell: Shell, out: &mut dyn Write) {
    let mut cmd = command();
    clap_complete::generate(shell, &mut cmd, BIN, out);
}

/// Writes the man page (roff, section 8: system administration).
pub fn man_page(out: &mut dyn Write) -> std::io::Result<()> {
    clap_mangen::Man::new(command())
        .section("8")
        .manual("kube-proxy-rs")
        .render(out)
}

/// The long flag names the generators document (for tests).
pub fn long_flags() -> Vec<String> {
    command()
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .filter_map(|a| a.get_long().map(String::from))
        .collect()
}
