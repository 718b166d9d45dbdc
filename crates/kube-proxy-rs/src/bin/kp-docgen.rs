//! Writes kube-proxy-rs's shell completions and man page, generated from its
//! flag definitions:
//!
//! ```sh
//! kp-docgen completions bash > /usr/share/bash-completion/completions/kube-proxy-rs
//! kp-docgen completions zsh  > /usr/share/zsh/vendor-completions/_kube-proxy-rs
//! kp-docgen completions fish > /usr/share/fish/vendor_completions.d/kube-proxy-rs.fish
//! kp-docgen man              > /usr/share/man/man8/kube-proxy-rs.8
//! ```

// Data from outside (API objects, files, the kernel) must never panic the
// proxy: no unwrap/expect outside tests.
#![deny(clippy::unwrap_used, clippy::expect_used)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

use std::io::Write;
use std::str::FromStr;

use clap_complete::Shell;
use kube_proxy_rs::cli::docgen;

fn usage() -> ! {
    eprintln!("usage: kp-docgen completions <bash|zsh|fish|elvish|powershell> | kp-docgen man");
    std::process::exit(2);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut out = std::io::stdout().lock();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["completions", shell] => {
            let Ok(sh) = Shell::from_str(shell) else {
                eprintln!("kp-docgen: unknown shell {shell:?}");
                usage()
            };
            docgen::completions(sh, &mut out);
        }
        ["man"] => {
            if let Err(e) = docgen::man_page(&mut out) {
                eprintln!("kp-docgen: {e}");
                std::process::exit(1);
            }
        }
        _ => usage(),
    }
    let _ = out.flush();
}
