//! The flags given, bound into the KubeProxyConfiguration file schema, as
//! upstream's `AddFlags` binds each flag to a field of its configuration
//! (`fs.BoolVar(&o.config.Conntrack.TCPBeLiberal,
//! "conntrack-tcp-be-liberal", ...)`). A flag whose value goes into one
//! file field as it is is bound on that field's line in `file.rs`
//! (`= flag conntrack_tcp_be_liberal`, [`super::field`]); a flag with more
//! to it (several fields, a conversion, `--config`'s exceptions) is a
//! closure here (`bindings!`). [`Cli::bind_given`] runs both kinds in the
//! flags' order, and with `--config` applies only what upstream does.

use std::collections::BTreeMap;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory};

use super::file::KubeProxyConfiguration;
use super::flags::Cli;
use super::{invalid, ConfigError};
use crate::config::duration::GoDuration;
use kp_model::ProxyMode;

/// True when the flag was set by the user (not clap's default).
fn given(m: &ArgMatches, id: &str) -> bool {
    matches!(
        m.value_source(id),
        Some(ValueSource::CommandLine) | Some(ValueSource::EnvVariable)
    )
}

/// What a binding returns: nothing, or a refusal of the value.
trait Bound {
    fn into_result(self) -> Result<(), ConfigError>;
}

impl Bound for () {
    fn into_result(self) -> Result<(), ConfigError> {
        Ok(())
    }
}

impl Bound for Result<(), ConfigError> {
    fn into_result(self) -> Result<(), ConfigError> {
        self
    }
}

/// Runs one flag's binding (the closure gets its argument types from here).
fn bind<T, R: Bound>(
    file: &mut Given,
    value: &T,
    binding: impl FnOnce(&mut Given, &T) -> R,
) -> Result<(), ConfigError> {
    binding(file, value).into_result()
}

/// What the flags given do: the file schema they are written into (a
/// binding reads and writes it as `f.field`), and what the file cannot say.
pub(super) struct Given<'a> {
    file: &'a mut KubeProxyConfiguration,
    /// --write-config-to is given: the deprecated ports stay out of the
    /// file it writes.
    writing_config: bool,
    /// The health and metrics servers a flag turned off (upstream: an empty
    /// address; here an empty address in the file takes the default).
    pub healthz_off: bool,
    pub metrics_off: bool,
}

impl<'a> Given<'a> {
    pub(super) fn new(file: &'a mut KubeProxyConfiguration, writing_config: bool) -> Self {
        Given {
            file,
            writing_config,
            healthz_off: false,
            metrics_off: false,
        }
    }

    /// Upstream's deprecated --healthz-port (`healthz`) or --metrics-port:
    /// 0 turns the server off, another port completes an address that has
    /// none.
    fn deprecated_port(&mut self, healthz: bool, port: Option<i32>) {
        if self.writing_config {
            return;
        }
        let (addr, off) = if healthz {
            (&mut self.file.healthz_bind_address, &mut self.healthz_off)
        } else {
            (&mut self.file.metrics_bind_address, &mut self.metrics_off)
        };
        match port {
            Some(0) => *off = true,
            Some(p) if addr_without_port(addr) => *addr = format!("{}:{p}", addr.trim()),
            _ => {}
        }
    }
}

impl std::ops::Deref for Given<'_> {
    type Target = KubeProxyConfiguration;
    fn deref(&self) -> &KubeProxyConfiguration {
        self.file
    }
}

impl std::ops::DerefMut for Given<'_> {
    fn deref_mut(&mut self) -> &mut KubeProxyConfiguration {
        self.file
    }
}

/// "0.0.0.0" or "[::]" (a bind address that names no port).
fn addr_without_port(addr: &str) -> bool {
    let a = addr.trim();
    !a.is_empty()
        && a.trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok()
}

/// Declares the flags bound by a closure: `bind_closure` runs flag `id`'s,
/// and `CLOSURES` lists them. `@over_config` marks the flags upstream still
/// honours when `--config` is given: its logging flags (copied over the
/// file's `logging`) and --hostname-override. `@deprecated` marks
/// upstream's deprecated flags that change what the file cannot say
/// (--healthz-port 0 turns the server off): bound and ignored with
/// `--config` like the others, but not among the file's flags
/// ([`Cli::bound_flags`]).
macro_rules! bindings {
    ($( $name:ident => $(@$mark:ident)? $binding:expr; )*) => {
        /// Runs flag `id`'s closure, if it has one.
        fn bind_closure(cli: &Cli, file: &mut Given, id: &str) -> Result<bool, ConfigError> {
            $(
                if id == stringify!($name) {
                    bind(file, &cli.$name, $binding)?;
                    return Ok(true);
                }
            )*
            Ok(false)
        }

        /// The flags with a closure, whether each applies over `--config`,
        /// and whether it is one of the file's flags.
        const CLOSURES: &[(&str, bool, bool)] = &[
            $( bindings!(@entry $name $(@$mark)?), )*
        ];
    };
    (@entry $name:ident @over_config) => {
        (stringify!($name), true, true)
    };
    (@entry $name:ident @deprecated) => {
        (stringify!($name), false, false)
    };
    (@entry $name:ident) => {
        (stringify!($name), false, true)
    };
}

bindings! {
    kubeconfig => |f, v| {
        f.client_connection.kubeconfig = v
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    proxy_mode => |f, v| f.mode = v.as_str().to_string();
    hostname_override => @over_config |f, v| f.hostname_override = v.clone();
    bind_address => |f, v| f.bind_address = v.to_string();
    // An empty address turns the server off, which the file cannot say.
    healthz_bind_address => |f, v| {
        f.healthz_bind_address = v.clone();
        f.healthz_off = v.trim().is_empty();
    };
    metrics_bind_address => |f, v| {
        f.metrics_bind_address = v.clone();
        f.metrics_off = v.trim().is_empty();
    };
    detect_local_mode => |f, v| f.detect_local_mode = v.as_str().to_string();
    masquerade_all => |f, v| {
        f.iptables.masquerade_all = *v;
        f.nftables.masquerade_all = *v;
    };
    iptables_masquerade_bit => |f, v| {
        f.iptables.masquerade_bit = Some(*v);
        f.nftables.masquerade_bit = Some(*v);
    };
    iptables_sync_period => |f, v| {
        f.iptables.sync_period = dur(v);
        f.nftables.sync_period = dur(v);
        f.sync_period = None;
    };
    iptables_min_sync_period => |f, v| {
        f.iptables.min_sync_period = dur(v);
        f.nftables.min_sync_period = dur(v);
        f.min_sync_period = None;
    };
    ipvs_sync_period => |f, v| {
        f.ipvs.sync_period = dur(v);
        if f.mode == ProxyMode::Ipvs.as_str() {
            f.sync_period = None;
        }
    };
    ipvs_min_sync_period => |f, v| {
        f.ipvs.min_sync_period = dur(v);
        if f.mode == ProxyMode::Ipvs.as_str() {
            f.min_sync_period = None;
        }
    };
    verbosity => @over_config |f, v| f.logging.verbosity = Some(u32::from(*v));
    feature_gates => |f, v| merge_feature_gates(&mut f.feature_gates, v);
    healthz_port => @deprecated |f, v| f.deprecated_port(true, *v);
    metrics_port => @deprecated |f, v| f.deprecated_port(false, *v);
    log_format => @over_config |f, v| f.logging.format = Some(v.clone());
}

impl Cli {
    /// Writes the flags given on the command line (not clap's defaults)
    /// into `file`, in the flags' order. With a config file (`from_file`)
    /// only the `@over_config` ones apply, as upstream replaces its
    /// flag-built configuration with the file's; the others given are
    /// returned as `--flag` names, for a warning.
    pub(super) fn bind_given(
        &self,
        file: &mut Given,
        m: &ArgMatches,
        from_file: bool,
    ) -> Result<Vec<String>, ConfigError> {
        let mut ignored = Vec::new();
        for (id, over, _) in Self::bindings() {
            if !given(m, id) {
                continue;
            }
            if from_file && !over {
                ignored.push(format!("--{}", id.replace('_', "-")));
            } else if !bind_closure(self, file, id)? {
                let bound = file.file.bind_table_flag(self, id);
                debug_assert!(bound, "{id} is bound nowhere");
            }
        }
        Ok(ignored)
    }

    /// The clap ids of the flags bound into the file (by a closure or a
    /// file field), in the flags' order, and whether each applies over
    /// `--config`.
    pub fn bound_flags() -> Vec<(&'static str, bool)> {
        Self::bindings()
            .into_iter()
            .filter(|(_, _, file)| *file)
            .map(|(id, over, _)| (id, over))
            .collect()
    }

    /// Every flag with a binding, in the flags' order: its clap id,
    /// whether it applies over `--config`, and whether it is one of the
    /// file's flags (not `@deprecated`).
    fn bindings() -> Vec<(&'static str, bool, bool)> {
        let table: Vec<&'static str> = KubeProxyConfiguration::table_flags().collect();
        Cli::command()
            .get_arguments()
            .filter_map(|a| {
                let id = a.get_id().as_str();
                CLOSURES
                    .iter()
                    .find(|(c, _, _)| *c == id)
                    .copied()
                    .or_else(|| table.iter().find(|t| **t == id).map(|t| (*t, false, true)))
            })
            .collect()
    }
}

fn dur(d: &Duration) -> Option<GoDuration> {
    Some(GoDuration(*d))
}

/// --feature-gates "A=true,B=false", merged into the file's gates.
fn merge_feature_gates(gates: &mut BTreeMap<String, bool>, s: &str) -> Result<(), ConfigError> {
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| invalid("featureGates", format!("{item:?} is not key=value")))?;
        let b = match v.trim() {
            "true" | "True" | "TRUE" | "1" | "t" | "T" => true,
            "false" | "False" | "FALSE" | "0" | "f" | "F" => false,
            other => {
                return Err(invalid(
                    &format!("featureGates.{}", k.trim()),
                    format!("{other:?} is not a boolean"),
                ))
            }
        };
        gates.insert(k.trim().to_string(), b);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 51's rule: with `--config`, upstream still honours its logging
    /// flags and --hostname-override, and only those.
    #[test]
    fn only_logging_and_hostname_apply_over_the_file() {
        let over: Vec<&str> = Cli::bound_flags()
            .into_iter()
            .filter(|(_, over)| *over)
            .map(|(id, _)| id)
            .collect();
        assert_eq!(over, ["hostname_override", "verbosity", "log_format"]);
    }

    /// A flag is bound once: by one file field's line or by a closure (the
    /// first found would win, and the other field would silently not be
    /// written).
    #[test]
    fn each_flag_is_bound_in_one_place() {
        let mut seen = std::collections::BTreeSet::new();
        let closures = CLOSURES.iter().map(|(id, _, _)| *id);
        for id in KubeProxyConfiguration::table_flags().chain(closures) {
            assert!(seen.insert(id), "{id} is bound twice");
        }
        assert!(seen.contains("conntrack_tcp_be_liberal") && seen.contains("proxy_mode"));
    }

    /// Every bound flag is a flag with a long name, and none twice.
    #[test]
    fn every_binding_is_a_flag() {
        let cmd = Cli::command();
        let mut seen = std::collections::BTreeSet::new();
        let bound = Cli::bound_flags();
        assert!(bound.len() > 40, "{} bindings", bound.len());
        for (id, _) in bound {
            let arg = cmd.get_arguments().find(|a| a.get_id() == id);
            assert!(arg.and_then(|a| a.get_long()).is_some(), "no flag {id}");
            assert!(seen.insert(id), "{id} twice");
        }
    }
}
