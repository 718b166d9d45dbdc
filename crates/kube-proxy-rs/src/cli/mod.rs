//! What the binary does besides proxying: the operator subcommands
//! (`explain`, `status`), `--dry-run`, and the completions and man page
//! generated from the flags.

pub mod docgen;
pub mod dryrun;
pub mod subcommands;
