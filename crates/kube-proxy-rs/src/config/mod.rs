//! Upstream kube-proxy's command-line flags and KubeProxyConfiguration file.
//!
//! [`load`] parses the flags, reads `--config` when given, lets flags that were
//! given on the command line override the file (as upstream does), applies
//! upstream's defaults and validates everything into one [`ProxyConfig`].

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches};

mod file;
mod flags;
mod overlay;
mod resolve;
mod settings;

pub use crate::duration::{format_go_duration, parse_go_duration, DurationError, GoDuration};
pub use file::*;
pub use flags::{Cli, DetectLocalMode, ProxyMode};
pub use settings::{ClientSettings, ConntrackSettings, IpvsSettings, ProxyConfig};

use overlay::{given, overlay_flags};
use resolve::resolve;

/// `--version` prints "kube-proxy-rs VERSION"; the long form says what it
/// is compatible with.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "\nflags and config: upstream kube-proxy 1.3x, kubeproxy.config.k8s.io/v1alpha1",
    "\nmodes: nftables (default), iptables (nft and legacy backends), ipvs, userspace"
);

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

const DEFAULT_HEALTHZ_PORT: u16 = 10256;
const DEFAULT_METRICS_PORT: u16 = 10249;

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

/// Parses flags (`args[0]` is the program name), reads `--config`, lets flags
/// given on the command line override it, applies upstream's defaults and
/// validates. `--write-config-to` is left to the caller (see
/// [`ProxyConfig::write_config`]) so that it can exit afterwards.
pub fn load(cli_args: impl IntoIterator<Item = OsString>) -> Result<ProxyConfig, ConfigError> {
    let matches = Cli::command().try_get_matches_from(cli_args)?;
    let cli = Cli::from_arg_matches(&matches)?;
    let mut raw = match &cli.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.clone(),
                source,
            })?;
            KubeProxyConfiguration::from_yaml(&text, path)?
        }
        None => KubeProxyConfiguration::default(),
    };
    overlay_flags(&mut raw, &cli, &matches)?;
    let healthz_disabled =
        given(&matches, "healthz_bind_address") && cli.healthz_bind_address.trim().is_empty();
    let metrics_disabled =
        given(&matches, "metrics_bind_address") && cli.metrics_bind_address.trim().is_empty();
    let mut pc = resolve(raw)?;
    if healthz_disabled {
        pc.healthz_bind_address = None;
    }
    if metrics_disabled {
        pc.metrics_bind_address = None;
    }
    pc.master = cli.master.clone().filter(|m| !m.is_empty());
    pc.manifests = cli.manifests.clone();
    pc.cleanup = cli.cleanup;
    pc.dry_run = cli.dry_run;
    pc.init_only = cli.init_only;
    if pc.init_only && pc.dry_run {
        // --dry-run promises that nothing touches the kernel.
        return Err(invalid("--init-only", "cannot be combined with --dry-run"));
    }
    pc.service_proxy_name = cli.service_proxy_name.clone().filter(|s| !s.is_empty());
    // Refused here rather than by the API server on every list (it becomes
    // part of the label selector).
    kp_source::label_selector(pc.service_proxy_name.as_deref())
        .map_err(|e| invalid("--service-proxy-name", e.to_string()))?;
    pc.iptables_backend = kp_iptables::Variant::parse_choice(&cli.iptables_backend)
        .map_err(|e| invalid("--iptables-backend", e))?;
    pc.iptables_nft_restore = cli.iptables_nft_restore;
    pc.userspace = cli.userspace.clone();
    pc.socket_lb = cli.socket_lb.clone();
    if pc.socket_lb.socket_lb && pc.mode != ProxyMode::Nftables {
        return Err(invalid(
            "--socket-lb",
            format!("works with --proxy-mode nftables, not {}", pc.mode.as_str()),
        ));
    }
    pc.config_file = cli.config.clone();
    pc.write_config_to = cli.write_config_to.clone();
    Ok(pc)
}
