//! Timestamps as Kubernetes writes them (RFC 3339, UTC), in one place: the
//! tracker reads the EndpointSlice trigger-time annotation with
//! [`parse_rfc3339`], the binary writes /healthz, /statusz and the debug
//! pages with [`format_rfc3339`]. The calendar is jiff's, the crate
//! k8s-openapi's `Time` wraps (re-exported as `k8s_openapi::jiff`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::jiff::Timestamp;

/// `t` as a jiff timestamp: a time before 1970 as 1970, one past jiff's
/// range (the year 9999) as its end.
pub fn timestamp(t: SystemTime) -> Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    i64::try_from(d.as_secs())
        .ok()
        .and_then(|secs| Timestamp::new(secs, d.subsec_nanos().try_into().ok()?).ok())
        .unwrap_or(Timestamp::MAX)
}

/// RFC 3339 in UTC with the fraction trimmed ("2024-05-01T12:00:00.5Z").
pub fn format_rfc3339(t: SystemTime) -> String {
    timestamp(t).to_string()
}

/// Parses the RFC 3339 timestamps Kubernetes writes (`2024-01-02T03:04:05Z`,
/// optionally with fractional seconds, cut to nanoseconds, and a `±hh:mm`
/// offset). Anything else, and a time before 1970, is None.
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    // jiff reads ISO 8601 as Temporal does, which allows more than RFC 3339
    // (a space for the `T`, `+0100`, no seconds): the shape is checked here,
    // the calendar there.
    let b = s.as_bytes();
    let digits =
        |r: std::ops::Range<usize>| b.get(r).is_some_and(|d| d.iter().all(u8::is_ascii_digit));
    let at = |i: usize, c: u8| b.get(i) == Some(&c);
    let shaped = digits(0..4)
        && at(4, b'-')
        && digits(5..7)
        && at(7, b'-')
        && digits(8..10)
        && at(10, b'T')
        && digits(11..13)
        && at(13, b':')
        && digits(14..16)
        && at(16, b':')
        && digits(17..19);
    if !shaped {
        return None;
    }
    // The first 19 bytes are ASCII: 19 is a character boundary.
    let (date_time, rest) = s.split_at(19);
    let (fraction, offset) = match rest.strip_prefix('.') {
        Some(f) => f.split_at(f.bytes().take_while(u8::is_ascii_digit).count()),
        None => ("", rest),
    };
    let o = offset.as_bytes();
    let numeric = o.len() == 6
        && matches!(o[0], b'+' | b'-')
        && o[1..3].iter().all(u8::is_ascii_digit)
        && o[3] == b':'
        && o[4..6].iter().all(u8::is_ascii_digit);
    if !(numeric || offset == "Z" || offset == "z") {
        return None;
    }
    let fraction = &fraction[..fraction.len().min(9)];
    let text = if fraction.is_empty() {
        format!("{date_time}{offset}")
    } else {
        format!("{date_time}.{fraction}{offset}")
    };
    let t: Timestamp = text.parse().ok()?;
    let secs = u64::try_from(t.as_second()).ok()?;
    let nanos = u32::try_from(t.subsec_nanosecond()).ok()?;
    Some(UNIX_EPOCH + Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_with_the_fraction_trimmed() {
        assert_eq!(format_rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::new(1_709_210_096, 500_000_000);
        assert_eq!(format_rfc3339(t), "2024-02-29T12:34:56.5Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(format_rfc3339(t), "2000-02-29T00:00:00Z");
        let before = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(format_rfc3339(before), "1970-01-01T00:00:00Z");
    }

    #[test]
    fn what_it_formats_it_parses() {
        for t in [
            UNIX_EPOCH,
            UNIX_EPOCH + Duration::new(1_709_210_096, 500_000_000),
            UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789),
        ] {
            assert_eq!(parse_rfc3339(&format_rfc3339(t)), Some(t));
        }
    }
}
