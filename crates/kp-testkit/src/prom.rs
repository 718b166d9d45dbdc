//! Reading a Prometheus text exposition (/metrics) the way tests and benches
//! ask it: a sample's value by name, by exact label set, or summed over the
//! series whose labels include some pairs. A name matches exactly: the
//! `_bucket`, `_sum` and `_count` series of a histogram are names of their own.

/// The samples named `name`: each series' label text (`{a="b"}`, or empty)
/// and value. Comments and unparsable values are left out.
pub fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines().filter_map(move |l| {
        let rest = l.strip_prefix(name)?;
        let (labels, value) = if rest.starts_with('{') {
            let end = rest.rfind('}')?;
            (&rest[..=end], &rest[end + 1..])
        } else if rest.starts_with(' ') {
            ("", rest)
        } else {
            return None;
        };
        // A sample may carry a timestamp after its value.
        let v = value.split_whitespace().next()?.parse().ok()?;
        Some((labels, v))
    })
}

/// The sum of `name` over the series whose labels contain every one of
/// `labels` (as `key="value"` text); `None` when no series matches.
pub fn sum(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = None;
    for (l, v) in samples(text, name) {
        if labels.iter().all(|want| l.contains(want)) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// [`sum`], with 0 for a counter that has no series yet.
pub fn total(text: &str, name: &str, labels: &[&str]) -> f64 {
    sum(text, name, labels).unwrap_or(0.0)
}

/// The value of the one series `name{labels}` (`labels` as exposed,
/// e.g. `{table="nat"}`, or empty for an unlabelled sample).
pub fn value(text: &str, name: &str, labels: &str) -> Option<f64> {
    samples(text, name).find_map(|(l, v)| (l == labels).then_some(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# HELP x_total a counter
# TYPE x_total counter
x_total{ip_family=\"IPv4\"} 3
x_total{ip_family=\"IPv6\"} 4
x_total_other 100
h_seconds_bucket{le=\"1\"} 7
h_seconds_sum 2.5
h_seconds_count 9
g 1.5 1700000000000
";

    #[test]
    fn names_match_exactly_and_labels_filter() {
        assert_eq!(sum(TEXT, "x_total", &[]), Some(7.0));
        assert_eq!(sum(TEXT, "x_total", &["ip_family=\"IPv6\""]), Some(4.0));
        assert_eq!(sum(TEXT, "x_total", &["ip_family=\"none\""]), None);
        assert_eq!(sum(TEXT, "h_seconds", &[]), None);
        assert_eq!(sum(TEXT, "h_seconds_count", &[]), Some(9.0));
        assert_eq!(value(TEXT, "x_total", "{ip_family=\"IPv4\"}"), Some(3.0));
        assert_eq!(value(TEXT, "g", ""), Some(1.5));
        assert_eq!(value(TEXT, "absent", ""), None);
        assert_eq!(total(TEXT, "absent", &[]), 0.0);
    }
}
