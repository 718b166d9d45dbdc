//! Upstream kube-proxy's command-line flags and KubeProxyConfiguration file.
//!
//! [`load`] parses the flags, or reads `--config` when given (then, as
//! upstream, only the logging flags and --hostname-override apply over the
//! file; unknown fields are left out with a warning), writes the flags given
//! into the file schema they are bound to (`flags.rs`), applies upstream's
//! defaults and validates everything into one [`ProxyConfig`], with the
//! flags that have no file field.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches};

mod bind;
pub mod duration;
mod field;
mod file;
mod flags;
mod resolve;
mod settings;
pub mod watch;

pub use duration::{format_go_duration, parse_go_duration, DurationError, GoDuration};
pub use file::*;
pub use flags::{Cli, DetectLocalMode, SocketLbFlags, UserspaceFlags};
pub use kp_model::ProxyMode;
pub use settings::ProxyConfig;

use bind::Given;
use resolve::resolve;

/// `--version` prints "kube-proxy-rs VERSION"; the long form says what it
/// is compatible with.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "\nflags and config: upstream kube-proxy 1.3x, kubeproxy.config.k8s.io/v1alpha1",
    "\nmodes: iptables (default; nft and legacy backends), nftables, ipvs, userspace"
);

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Bad flags, or `--help` / `--version`: call `err.exit()` to print and exit
    /// with clap's status.
    #[error(transparent)]
    Cli(#[from] clap::Error),
    #[error("reading config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// YAML syntax errors and type errors; `message` names the field path.
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// A value that parsed but is not acceptable; `field` is the
    /// KubeProxyConfiguration path (e.g. `iptables.masqueradeBit`).
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    #[error("writing config to {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("serializing the configuration: {0}")]
    Serialize(String),
    #[error("cannot determine this machine's hostname: {0}")]
    Hostname(String),
}

fn invalid(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        message: message.into(),
    }
}

/// Parses flags (`args[0]` is the program name), reads `--config` (see the
/// module doc for which flags still apply), applies upstream's defaults and
/// validates. `--write-config-to` is left to the caller (see
/// [`ProxyConfig::write_config`]) so that it can exit afterwards.
pub fn load(cli_args: impl IntoIterator<Item = OsString>) -> Result<ProxyConfig, ConfigError> {
    let matches = Cli::command().try_get_matches_from(cli_args)?;
    let cli = Cli::from_arg_matches(&matches)?;
    let mut load_warnings = Vec::new();
    let mut config_file_digest = None;
    let mut raw = match &cli.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.clone(),
                source,
            })?;
            config_file_digest = Some(crate::config::watch::digest(&text));
            let (raw, unknown) = KubeProxyConfiguration::from_yaml_lenient(&text, path)?;
            for field in unknown {
                load_warnings.push(format!(
                    "config file {}: ignoring unknown field {field} (read leniently, as upstream does)",
                    path.display()
                ));
            }
            raw
        }
        None => KubeProxyConfiguration::default(),
    };
    let from_file = cli.config.is_some();
    let mut given = Given::new(&mut raw, cli.write_config_to.is_some());
    let ignored = cli.bind_given(&mut given, &matches, from_file)?;
    let (healthz_off, metrics_off) = (given.healthz_off, given.metrics_off);
    if !ignored.is_empty() {
        load_warnings.push(format!(
            "--config is given, so these flags are ignored as upstream ignores them (the file \
             decides; only the logging flags and --hostname-override apply over it): {}",
            ignored.join(" ")
        ));
    }
    let defaults = Cli::defaults()?;
    let mut pc = resolve(raw, &cli, &defaults)?;
    pc.load_warnings = load_warnings;
    pc.config_file_digest = config_file_digest;
    if healthz_off {
        pc.healthz_bind_address = None;
    }
    if metrics_off {
        pc.metrics_bind_address = None;
    }
    if pc.init_only && pc.dry_run {
        // --dry-run promises that nothing touches the kernel.
        return Err(invalid("--init-only", "cannot be combined with --dry-run"));
    }
    // Refused here rather than by the API server on every list (it becomes
    // part of the label selector).
    kp_source::label_selector(pc.service_proxy_name.as_deref())
        .map_err(|e| invalid("--service-proxy-name", e.to_string()))?;
    if pc.socket_lb.socket_lb && pc.mode != ProxyMode::Nftables {
        return Err(invalid(
            "--socket-lb",
            format!("works with --proxy-mode nftables, not {}", pc.mode.as_str()),
        ));
    }
    if pc.socket_lb.bpf_nodeport && !pc.socket_lb.socket_lb {
        return Err(invalid(
            "--bpf-nodeport",
            "needs --socket-lb (the tc programs read its maps)".to_string(),
        ));
    }
    // The flags that change --bpf-nodeport's programs, at their defaults
    // without them.
    let (sl, d) = (&pc.socket_lb, &defaults.socket_lb);
    for (flag, value, default) in [
        (
            "--bpf-lb-algorithm",
            &sl.bpf_lb_algorithm,
            &d.bpf_lb_algorithm,
        ),
        ("--bpf-lb-mode", &sl.bpf_lb_mode, &d.bpf_lb_mode),
        (
            "--bpf-lb-acceleration",
            &sl.bpf_lb_acceleration,
            &d.bpf_lb_acceleration,
        ),
    ] {
        if value != default && !sl.bpf_nodeport {
            return Err(invalid(
                flag,
                "applies to --bpf-nodeport's programs, which are off".to_string(),
            ));
        }
    }
    Ok(pc)
}
