//! Go's `time.Duration` text ("30s", "1m0s", "1.5h"), as upstream's flags and
//! KubeProxyConfiguration spell durations. [`GoDuration`] carries a parsed
//! value through the config file schema so a duration is parsed once, where it
//! is read, and stays a `Duration` from there to the pacer.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("empty duration")]
    Empty,
    #[error("invalid duration {0:?}")]
    Syntax(String),
    #[error("missing unit in duration {0:?}")]
    MissingUnit(String),
    #[error("unknown unit {unit:?} in duration {input:?}")]
    UnknownUnit { unit: String, input: String },
    #[error("duration {0:?} is negative")]
    Negative(String),
    #[error("duration {0:?} is too large")]
    Overflow(String),
}

/// Parses Go's `time.ParseDuration` syntax ("30s", "1m0s", "1.5h", "500ms",
/// "1h2m3s", "0"). Negative durations are rejected: nothing here can use one.
pub fn parse_go_duration(input: &str) -> Result<Duration, DurationError> {
    let mut s = input;
    let mut negative = false;
    if let Some(rest) = s.strip_prefix('-') {
        negative = true;
        s = rest;
    } else if let Some(rest) = s.strip_prefix('+') {
        s = rest;
    }
    if s.is_empty() {
        return Err(if input.is_empty() {
            DurationError::Empty
        } else {
            DurationError::Syntax(input.to_string())
        });
    }
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    // Go's limit is i64 nanoseconds.
    const MAX: u128 = i64::MAX as u128;
    let mut total: u128 = 0;
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        let int_part = &s[start..i];
        let mut frac_part = "";
        if i < bytes.len() && bytes[i] == b'.' {
            i += 1;
            let fstart = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            frac_part = &s[fstart..i];
        }
        if int_part.is_empty() && frac_part.is_empty() {
            return Err(DurationError::Syntax(input.to_string()));
        }
        let ustart = i;
        while i < bytes.len() && !bytes[i].is_ascii_digit() && bytes[i] != b'.' {
            i += 1;
        }
        let unit = &s[ustart..i];
        if unit.is_empty() {
            return Err(DurationError::MissingUnit(input.to_string()));
        }
        let scale: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => {
                return Err(DurationError::UnknownUnit {
                    unit: unit.to_string(),
                    input: input.to_string(),
                })
            }
        };
        let overflow = || DurationError::Overflow(input.to_string());
        let int_val: u128 = if int_part.is_empty() {
            0
        } else {
            int_part.parse::<u128>().map_err(|_| overflow())?
        };
        let mut value = int_val.checked_mul(scale).ok_or_else(overflow)?;
        // Digits past nanosecond precision cannot change the result.
        let mut frac_scale = scale;
        for d in frac_part.bytes() {
            frac_scale /= 10;
            if frac_scale == 0 {
                break;
            }
            value += u128::from(d - b'0') * frac_scale;
        }
        total = total.checked_add(value).ok_or_else(overflow)?;
        if total > MAX {
            return Err(overflow());
        }
    }
    if negative && total != 0 {
        return Err(DurationError::Negative(input.to_string()));
    }
    let secs = (total / 1_000_000_000) as u64;
    let nanos = (total % 1_000_000_000) as u32;
    Ok(Duration::new(secs, nanos))
}

fn frac_string(mut frac: u128, mut digits: usize) -> String {
    // `digits` decimal places, trailing zeros dropped.
    while digits > 0 && frac.is_multiple_of(10) {
        frac /= 10;
        digits -= 1;
    }
    if digits == 0 {
        String::new()
    } else {
        format!(".{frac:0digits$}")
    }
}

/// Formats like Go's `time.Duration.String()`: "0s", "500ms", "1.5s", "1m0s",
/// "1h2m3s".
pub fn format_go_duration(d: Duration) -> String {
    let n = d.as_nanos();
    if n == 0 {
        return "0s".to_string();
    }
    if n < 1_000 {
        return format!("{n}ns");
    }
    if n < 1_000_000 {
        return format!("{}{}µs", n / 1_000, frac_string(n % 1_000, 3));
    }
    if n < 1_000_000_000 {
        return format!("{}{}ms", n / 1_000_000, frac_string(n % 1_000_000, 6));
    }
    let total_secs = n / 1_000_000_000;
    let sub = n % 1_000_000_000;
    let h = total_secs / 3600;
    let m = (total_secs / 60) % 60;
    let s = total_secs % 60;
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if h > 0 || m > 0 {
        out.push_str(&format!("{m}m"));
    }
    out.push_str(&format!("{s}{}s", frac_string(sub, 9)));
    out
}

/// A duration in the config file: Go's text on the wire, a `Duration` in
/// memory. Parsing happens once, when the file is read, so a bad value is
/// reported with its field path (serde_path_to_error) and nothing downstream
/// formats and re-parses it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GoDuration(pub Duration);

impl From<Duration> for GoDuration {
    fn from(d: Duration) -> Self {
        GoDuration(d)
    }
}

impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_go_duration(self.0))
    }
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_go_duration(self.0))
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = GoDuration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Go duration such as \"30s\" or \"1m0s\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<GoDuration, E> {
                parse_go_duration(v).map(GoDuration).map_err(E::custom)
            }
        }
        d.deserialize_str(Visitor)
    }
}

pub(crate) fn duration_arg(s: &str) -> Result<Duration, String> {
    parse_go_duration(s).map_err(|e| e.to_string())
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse() {
        let ok = [
            ("0", 0),
            ("0s", 0),
            ("30s", 30_000_000_000),
            ("1m0s", 60_000_000_000),
            ("15m", 900_000_000_000),
            ("500ms", 500_000_000),
            ("1h2m3s", 3_723_000_000_000),
            ("1.5h", 5_400_000_000_000),
            ("2.5s", 2_500_000_000),
            (".5s", 500_000_000),
            ("1us", 1_000),
            ("1µs", 1_000),
            ("7ns", 7),
            ("+5s", 5_000_000_000),
            ("24h0m0s", 86_400_000_000_000),
        ];
        for (s, n) in ok {
            assert_eq!(parse_go_duration(s).unwrap().as_nanos(), n, "{s}");
        }
        for bad in ["", "5", "s", "1x", "1.s5", "-1s", "1h-2m", "abc", "."] {
            assert!(parse_go_duration(bad).is_err(), "{bad} should fail");
        }
        assert!(matches!(
            parse_go_duration("99999999999999h"),
            Err(DurationError::Overflow(_))
        ));
    }

    #[test]
    fn go_durations_format() {
        let cases = [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_secs(60), "1m0s"),
            (Duration::from_secs(900), "15m0s"),
            (Duration::from_secs(3723), "1h2m3s"),
            (Duration::from_millis(500), "500ms"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_micros(1), "1µs"),
            (Duration::from_nanos(1_500), "1.5µs"),
            (Duration::from_secs(86400), "24h0m0s"),
        ];
        for (d, s) in cases {
            assert_eq!(format_go_duration(d), s);
            assert_eq!(parse_go_duration(s).unwrap(), d, "{s} round trip");
        }
    }

    #[test]
    fn go_duration_is_text_on_the_wire() {
        let d: GoDuration = serde_json::from_value(serde_json::json!("1m30s")).unwrap();
        assert_eq!(d, GoDuration(Duration::from_secs(90)));
        assert_eq!(serde_json::to_value(d).unwrap(), serde_json::json!("1m30s"));
        // Go's metav1.Duration is a string: a bare number is refused, as are
        // bad strings, and the message says what was expected.
        let e = serde_json::from_value::<GoDuration>(serde_json::json!(10)).unwrap_err();
        assert!(e.to_string().contains("Go duration"), "{e}");
        assert!(serde_json::from_value::<GoDuration>(serde_json::json!("5 minutes")).is_err());
    }
}
