//! One declaration per setting: [`section!`] declares a KubeProxyConfiguration
//! section field for field, and a field's line says everything about it
//! that is a plain value (upstream's AddFlags, SetDefaults and Validate for
//! it): the flag bound into it, what "unset" means (its default is then the
//! flag's own clap default, read through `Cli::defaults`), its check, and
//! the type the proxy reads it as.
//!
//! ```text
//! /// doc
//! #[serde(...)]                       the file field's attributes, as written
//! name [as "fileName"]: FileType      "fileName" when not name in camelCase
//!     [= flag FLAG | = unset FLAG | = zero FLAG]
//!     [, check FN] [, into TYPE = FN];
//! ```
//!
//! `= flag FLAG` binds the Cli field FLAG into this field when given on the
//! command line (not with `--config`, see `flags.rs`); `= unset FLAG` also
//! takes FLAG's default when the field is unset, `= zero FLAG` also when it
//! is zero or empty (upstream's `if x == 0 { x = default }`). The default is
//! written back, so --write-config-to and /configz show it. `check FN`
//! validates the defaulted value (`FN(path, &value)`), `into TYPE = FN`
//! converts it for the proxy (`FN(path, value) -> TYPE`). With
//! `=> pub struct Settings` the section also gets the struct the proxy reads:
//! each field defaulted and converted, of `FileField::Value`'s type.
//! Settings with logic of their own (the nftables section falling back to
//! iptables', the sync periods, addresses following bindAddress's family)
//! are bound by closures in `flags.rs` and resolved in `resolve.rs`.

use std::fmt::Display;
use std::time::Duration;

use ipnet::IpNet;

use super::{invalid, ConfigError};
use crate::config::duration::GoDuration;

/// A file field's value as the proxy reads it, and "unset" for it.
pub trait FileField {
    type Value: Default;
    /// The value; None when unset (or, with `zero_too`, zero or empty).
    fn get(&self, zero_too: bool) -> Option<Self::Value>;
    /// Writes a (defaulted) value back.
    fn put(&mut self, value: Self::Value);
}

/// A flag's value written into the file field it is bound to.
pub trait Bind<F> {
    fn bind(&mut self, flag: &F);
}

macro_rules! plain_field {
    ($($t:ty),*) => {$(
        impl FileField for $t {
            type Value = $t;
            fn get(&self, zero_too: bool) -> Option<$t> {
                (!zero_too || *self != <$t>::default()).then(|| self.clone())
            }
            fn put(&mut self, value: $t) {
                *self = value;
            }
        }
        impl Bind<$t> for $t {
            fn bind(&mut self, flag: &$t) {
                *self = flag.clone();
            }
        }
    )*};
}

plain_field!(bool, i32, f32, String);

macro_rules! optional_field {
    ($($t:ty),*) => {$(
        impl FileField for Option<$t> {
            type Value = $t;
            fn get(&self, zero_too: bool) -> Option<$t> {
                self.filter(|v| !zero_too || *v != <$t>::default())
            }
            fn put(&mut self, value: $t) {
                *self = Some(value);
            }
        }
        impl Bind<$t> for Option<$t> {
            fn bind(&mut self, flag: &$t) {
                *self = Some(*flag);
            }
        }
    )*};
}

optional_field!(bool, i32);

impl FileField for Option<GoDuration> {
    type Value = Duration;
    fn get(&self, zero_too: bool) -> Option<Duration> {
        self.map(|g| g.0).filter(|d| !zero_too || !d.is_zero())
    }
    fn put(&mut self, value: Duration) {
        *self = Some(GoDuration(value));
    }
}

impl Bind<Duration> for Option<GoDuration> {
    fn bind(&mut self, flag: &Duration) {
        *self = Some(GoDuration(*flag));
    }
}

/// A list: unset and empty are alike (upstream tests the length).
impl FileField for Option<Vec<String>> {
    type Value = Vec<String>;
    fn get(&self, zero_too: bool) -> Option<Vec<String>> {
        self.clone().filter(|l| !zero_too || !l.is_empty())
    }
    fn put(&mut self, value: Vec<String>) {
        *self = Some(value);
    }
}

/// A list flag's items, trimmed, the empty ones left out.
impl Bind<Vec<String>> for Option<Vec<String>> {
    fn bind(&mut self, flag: &Vec<String>) {
        *self = Some(list(flag));
    }
}

/// A list flag's items, trimmed, the empty ones left out.
fn list(items: &[String]) -> Vec<String> {
    items
        .iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// A field's path in the file ("conntrack.maxPerCore") from its Rust name,
/// for errors: `rename` when the file does not spell it in camelCase.
pub(super) fn path(section: &str, name: &str, rename: Option<&str>) -> String {
    let name = rename.map_or_else(
        || {
            let mut out = String::new();
            let mut upper = false;
            for c in name.chars() {
                if c == '_' {
                    upper = true;
                } else if upper {
                    out.extend(c.to_uppercase());
                    upper = false;
                } else {
                    out.push(c);
                }
            }
            out
        },
        str::to_string,
    );
    if section.is_empty() {
        name
    } else {
        format!("{section}.{name}")
    }
}

/// `check` for counts and rates.
pub(super) fn non_negative<T: PartialOrd + Default + Display>(
    field: &str,
    v: &T,
) -> Result<(), ConfigError> {
    if *v < T::default() {
        return Err(invalid(field, format!("{v} must be >= 0")));
    }
    Ok(())
}

/// `check` for oomScoreAdj.
pub(super) fn oom_score_adj(field: &str, v: &i32) -> Result<(), ConfigError> {
    if !(-1000..=1000).contains(v) {
        return Err(invalid(field, format!("{v} is not in -1000..=1000")));
    }
    Ok(())
}

/// A CIDR, its host bits cleared (upstream accepts a bare IP in a few
/// places; a CIDR is required here).
pub(super) fn cidr(field: &str, s: &str) -> Result<IpNet, ConfigError> {
    let s = s.trim();
    s.parse::<IpNet>()
        .map(|n| n.trunc())
        .map_err(|_| invalid(field, format!("{s:?} is not a valid CIDR")))
}

/// `into` for a list of CIDRs: an error names the item (`field[i]`).
pub(super) fn cidrs(field: &str, list: Vec<String>) -> Result<Vec<IpNet>, ConfigError> {
    list.iter()
        .enumerate()
        .map(|(i, c)| cidr(&format!("{field}[{i}]"), c))
        .collect()
}

/// Declares a section; see the module doc.
macro_rules! section {
    (
        $(#[$smeta:meta])*
        pub struct $file:ident at $at:literal
            $(=> $(#[$setmeta:meta])* pub struct $settings:ident)?
        {
            $(
                $(#[$fmeta:meta])*
                $name:ident $(as $rename:literal)? : $fty:ty
                    $(= $rule:ident $flag:ident)?
                    $(, check $check:path)?
                    $(, into $rty:ty = $conv:path)?
                ;
            )*
        }
    ) => {
        // The lines parsed once, into one bracketed group per part, which
        // the arms below take whole.
        section!(@emit [$(#[$smeta])*] $file $at [$($(#[$setmeta])* $settings)?] {
            $(
                [$(#[$fmeta])*] $name [$($rename)?] [$fty] [$($rule $flag)?] [$($check)?]
                [$($rty, $conv)?]
            )*
        });
    };
    (@emit [$($smeta:tt)*] $file:ident $at:literal [$($settings:tt)*] $fields:tt) => {
        section!(@file [$($smeta)*] $file $at $fields);
        section!(@settings [$($settings)*] $file $at $fields);
    };
    (
        @file [$(#[$smeta:meta])*] $file:ident $at:literal {$(
            [$(#[$fmeta:meta])*] $name:ident [$($rename:literal)?] [$fty:ty]
            [$($rule:ident $flag:ident)?] [$($check:path)?] [$($rty:ty, $conv:path)?]
        )*}
    ) => {
        $(#[$smeta])*
        pub struct $file {
            $(
                $(#[$fmeta])*
                $(#[serde(rename = $rename)])?
                pub $name: $fty,
            )*
        }

        impl $file {
            /// The flags bound into this section's fields, by clap id.
            pub(super) const FLAGS: &'static [&'static str] =
                &[$($(stringify!($flag),)?)*];

            /// Writes `cli`'s flag `id` into the field it is bound to; false
            /// when none of this section's is.
            pub(super) fn bind_flag(&mut self, cli: &Cli, id: &str) -> bool {
                $($(
                    if id == stringify!($flag) {
                        $crate::config::field::Bind::bind(&mut self.$name, &cli.$flag);
                        return true;
                    }
                )?)*
                let _ = (cli, id);
                false
            }

            /// Upstream's defaulting and validation of this section: unset
            /// fields take their flag's default `d` (written back), then each
            /// field's check.
            pub(super) fn apply_defaults(&mut self, d: &Cli) -> Result<(), ConfigError> {
                $(
                    $( section!(@default self, d, $name, $rule $flag); )?
                    section!(@check self, $at, $name, [$($rename)?], $($check)?);
                )*
                let _ = d;
                Ok(())
            }
        }
    };
    (@default $s:ident, $d:ident, $name:ident, flag $flag:ident) => {};
    (@default $s:ident, $d:ident, $name:ident, unset $flag:ident) => {
        section!(@fill $s, $d, $name, $flag, false)
    };
    (@default $s:ident, $d:ident, $name:ident, zero $flag:ident) => {
        section!(@fill $s, $d, $name, $flag, true)
    };
    (@fill $s:ident, $d:ident, $name:ident, $flag:ident, $zero_too:expr) => {{
        use $crate::config::field::FileField;
        let value = $s.$name.get($zero_too).unwrap_or_else(|| $d.$flag.clone());
        $s.$name.put(value);
    }};
    (@check $s:ident, $at:literal, $name:ident, [$($rename:literal)?], ) => {};
    (@check $s:ident, $at:literal, $name:ident, [$($rename:literal)?], $check:path) => {
        $check(
            &section!(@path $at, $name $(, $rename)?),
            &$crate::config::field::FileField::get(&$s.$name, false).unwrap_or_default(),
        )?
    };
    (@path $at:literal, $name:ident) => {
        $crate::config::field::path($at, stringify!($name), None)
    };
    (@path $at:literal, $name:ident, $rename:literal) => {
        $crate::config::field::path($at, stringify!($name), Some($rename))
    };
    (@type $fty:ty) => { <$fty as $crate::config::field::FileField>::Value };
    (@type $fty:ty, $rty:ty) => { $rty };
    (@into $at:literal, $name:ident, $($rename:literal)?; $value:expr) => { $value };
    (@into $at:literal, $name:ident, $($rename:literal)?; $value:expr, $conv:path) => {
        $conv(&section!(@path $at, $name $(, $rename)?), $value)?
    };
    (@settings [] $file:ident $at:literal $fields:tt) => {};
    (
        @settings [$(#[$setmeta:meta])* $settings:ident] $file:ident $at:literal {$(
            [$(#[$fmeta:meta])*] $name:ident [$($rename:literal)?] [$fty:ty]
            [$($rule:ident $flag:ident)?] [$($check:path)?] [$($rty:ty, $conv:path)?]
        )*}
    ) => {
        $(#[$setmeta])*
        #[derive(Clone, Debug, PartialEq)]
        pub struct $settings {
            $(
                #[doc = concat!("The file's `", $at, "` field `", stringify!($name), "`, defaulted.")]
                pub $name: section!(@type $fty $(, $rty)?),
            )*
        }

        impl $file {
            /// The section as the proxy reads it (after
            /// [`Self::apply_defaults`]; an unset field without a default is
            /// its type's zero).
            pub(super) fn settings(&self) -> Result<$settings, ConfigError> {
                Ok($settings {
                    $(
                        $name: section!(
                            @into $at, $name, $($rename)?;
                            $crate::config::field::FileField::get(&self.$name, false)
                                .unwrap_or_default()
                            $(, $conv)?
                        ),
                    )*
                })
            }
        }
    };
}

pub(super) use section;

#[cfg(test)]
mod tests {
    use super::*;

    /// Errors name a field as the file spells it.
    #[test]
    fn paths_are_the_files() {
        assert_eq!(
            path("conntrack", "max_per_core", None),
            "conntrack.maxPerCore"
        );
        assert_eq!(path("", "oom_score_adj", None), "oomScoreAdj");
        assert_eq!(
            path("ipvs", "exclude_cidrs", Some("excludeCIDRs")),
            "ipvs.excludeCIDRs"
        );
    }

    /// The two meanings of unset a line can ask for: `unset` (None only;
    /// an explicit zero is kept, as conntrack's timeouts need) and `zero`
    /// (None or zero, upstream's `if x == 0`).
    #[test]
    fn unset_and_zero() {
        let zero = Some(GoDuration(Duration::ZERO));
        assert_eq!(zero.get(false), Some(Duration::ZERO));
        assert_eq!(zero.get(true), None);
        assert_eq!(None::<GoDuration>.get(false), None);
        assert_eq!(0.0f32.get(false), Some(0.0));
        assert_eq!(0.0f32.get(true), None);
        assert_eq!(String::new().get(true), None);
        assert_eq!(Some(0i32).get(false), Some(0));
        assert_eq!(Some(Vec::<String>::new()).get(true), None);
        let mut f = None::<GoDuration>;
        f.put(Duration::from_secs(3));
        assert_eq!(f, Some(GoDuration(Duration::from_secs(3))));
    }

    /// A list flag's empty items are left out (`--ipvs-exclude-cidrs a,,b`),
    /// and a list's bad item is named by its index.
    #[test]
    fn lists() {
        let mut f = None;
        f.bind(&vec![" 10.0.0.0/8".to_string(), String::new()]);
        assert_eq!(f, Some(vec!["10.0.0.0/8".to_string()]));
        let err = cidrs("ipvs.excludeCIDRs", vec!["10.0.0.0/8".into(), "x".into()])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("ipvs.excludeCIDRs[1]: "), "{err}");
        assert_eq!(
            cidrs("f", vec!["10.1.2.3/8".into()]).unwrap(),
            vec!["10.0.0.0/8".parse::<IpNet>().unwrap()]
        );
    }
}
