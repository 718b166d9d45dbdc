//! The API server's side of a scenario: its own /metrics (requests, etcd
//! calls, response and watch-event bytes of the resources a proxy reads)
//! and its process from /proc (CPU seconds, peak RSS), read before and after,
//! as deltas.

use anyhow::{Context, Result};

use crate::lab::{status_mib, Lab};

/// What a proxy reads from the API server.
pub const RESOURCES: &[&str] = &["services", "endpointslices", "nodes", "servicecidrs"];

/// The sum of every sample of `name` whose labels hold all of `with` and
/// none of `without`.
pub fn metric(text: &str, name: &str, with: &[&str], without: &[&str]) -> f64 {
    kp_testkit::prom::samples(text, name)
        .filter(|(l, _)| {
            with.iter().all(|w| l.contains(w)) && !without.iter().any(|w| l.contains(w))
        })
        .map(|(_, v)| v)
        .sum()
}

/// [`metric`] summed over [`RESOURCES`].
fn by_resource(text: &str, name: &str, with: &[&str]) -> f64 {
    RESOURCES
        .iter()
        .map(|r| {
            let res = format!("resource=\"{r}\"");
            let mut w = vec![res.as_str()];
            w.extend(with);
            // The API server's own loops (ClusterIP repair, ...) are not a proxy's.
            metric(text, name, &w, &["system_client=\"kube-apiserver\""])
        })
        .sum()
}

/// CPU seconds (user + system) of process `pid`, 0 when it is gone.
pub fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime, the 14th and 15th fields, in USER_HZ (100).
    (get(11) + get(12)) / 100.0
}

/// One reading of the control plane.
pub struct Reading {
    metrics: String,
    api_cpu: f64,
    etcd_cpu: f64,
}

/// The API server's and etcd's figures over a window.
#[derive(Clone, Debug, Default)]
pub struct ServerFigures {
    pub api_cpu: f64,
    pub etcd_cpu: f64,
    /// kube-apiserver's VmHWM since [`reset_peak`].
    pub api_peak_mib: f64,
    pub list_requests: f64,
    pub list_slices: f64,
    /// Watches open (apiserver_longrunning_requests, a gauge) after -
    /// before: a WATCH is counted in apiserver_request_total only once it ends.
    pub watches_open: f64,
    /// etcd list calls of every resource (the server's own included).
    pub etcd_lists: f64,
    pub etcd_lists_services: f64,
    pub etcd_lists_slices: f64,
    pub list_bytes: f64,
    pub watch_bytes: f64,
}

/// The API server's /metrics, through the lab's admin client.
pub fn scrape(lab: &Lab) -> Result<String> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .context("building GET /metrics")?;
    lab.rt
        .block_on(lab.client.request_text(req))
        .context("reading kube-apiserver's /metrics")
}

pub fn read(lab: &Lab) -> Result<Reading> {
    let (etcd, api) = lab.cp.pids();
    Ok(Reading {
        metrics: scrape(lab)?,
        api_cpu: api.map_or(0.0, cpu_secs),
        etcd_cpu: etcd.map_or(0.0, cpu_secs),
    })
}

/// Starts kube-apiserver's peak RSS (VmHWM) over from its current RSS.
pub fn reset_peak(lab: &Lab) -> Result<()> {
    if let (_, Some(pid)) = lab.cp.pids() {
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
            .with_context(|| format!("resetting VmHWM of kube-apiserver (pid {pid})"))?;
    }
    Ok(())
}

fn figures(m: &str) -> [f64; 8] {
    let etcd_list = |res: Option<&str>| {
        let r = res.map(|r| format!("resource=\"{r}\""));
        let mut with = vec!["operation=\"list\""];
        with.extend(r.as_deref());
        metric(m, "etcd_requests_total", &with, &[])
    };
    [
        by_resource(m, "apiserver_request_total", &["verb=\"LIST\""]),
        metric(
            m,
            "apiserver_request_total",
            &["verb=\"LIST\"", "resource=\"endpointslices\""],
            &["system_client=\"kube-apiserver\""],
        ),
        by_resource(m, "apiserver_longrunning_requests", &["verb=\"WATCH\""]),
        etcd_list(None),
        etcd_list(Some("services")),
        etcd_list(Some("endpointslices")),
        by_resource(m, "apiserver_response_sizes_sum", &["verb=\"LIST\""]),
        by_resource(m, "apiserver_watch_events_sizes_sum", &[]),
    ]
}

/// The deltas from `before` to `after`, and the API server's peak RSS now.
pub fn delta(lab: &Lab, before: &Reading, after: &Reading) -> ServerFigures {
    let (a, b) = (figures(&after.metrics), figures(&before.metrics));
    let d = |i: usize| a[i] - b[i];
    let peak = lab
        .cp
        .pids()
        .1
        .map_or(0.0, |p| status_mib(&p.to_string(), "VmHWM:"));
    ServerFigures {
        api_cpu: after.api_cpu - before.api_cpu,
        etcd_cpu: after.etcd_cpu - before.etcd_cpu,
        api_peak_mib: peak,
        list_requests: d(0),
        list_slices: d(1),
        watches_open: d(2),
        etcd_lists: d(3),
        etcd_lists_services: d(4),
        etcd_lists_slices: d(5),
        list_bytes: d(6),
        watch_bytes: d(7),
    }
}

/// The series of counter `name` that moved from `before` to `after`, by
/// label set, largest first: what the proxies asked of the server.
pub fn moved(before: &Reading, after: &Reading, name: &str) -> Vec<(String, f64)> {
    let was: std::collections::HashMap<&str, f64> =
        kp_testkit::prom::samples(&before.metrics, name).collect();
    let mut out: Vec<(String, f64)> = kp_testkit::prom::samples(&after.metrics, name)
        .map(|(l, v)| (l.to_string(), v - was.get(l).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d > 0.0)
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1));
    out
}

/// The buckets of histogram `name` summed over label sets: (le, cumulative
/// count), ascending.
pub fn buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let bucket = format!("{name}_bucket");
    let mut by_le: std::collections::BTreeMap<u64, (f64, f64)> = Default::default();
    for (labels, v) in kp_testkit::prom::samples(text, &bucket) {
        let Some(le) = labels
            .split("le=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
        else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            match le.parse::<f64>() {
                Ok(v) => v,
                Err(_) => continue,
            }
        };
        by_le.entry(le.to_bits()).or_insert((le, 0.0)).1 += v;
    }
    let mut v: Vec<(f64, f64)> = by_le.into_values().collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// `after` - `before`, bucket by bucket (the same bounds, as one binary's).
pub fn bucket_delta(after: &[(f64, f64)], before: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after
        .iter()
        .map(|&(le, c)| {
            let b = before
                .iter()
                .find(|(l, _)| *l == le)
                .map_or(0.0, |(_, c)| *c);
            (le, c - b)
        })
        .collect()
}

/// The `q` quantile of cumulative buckets, interpolated linearly within the
/// bucket as Prometheus' histogram_quantile does; None without samples.
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, c) in buckets {
        if c >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let within = if c > prev.1 {
                (rank - prev.1) / (c - prev.1)
            } else {
                0.0
            };
            return Some(prev.0 + (le - prev.0) * within);
        }
        prev = (le, c);
    }
    Some(prev.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_interpolate_within_a_bucket() {
        let text = "h_bucket{le=\"0.5\",ip_family=\"IPv4\"} 2\n\
                    h_bucket{le=\"0.5\",ip_family=\"IPv6\"} 0\n\
                    h_bucket{le=\"1\",ip_family=\"IPv4\"} 10\n\
                    h_bucket{le=\"+Inf\",ip_family=\"IPv4\"} 10\n";
        let b = buckets(text, "h");
        assert_eq!(b, vec![(0.5, 2.0), (1.0, 10.0), (f64::INFINITY, 10.0)]);
        assert_eq!(quantile(&b, 0.1), Some(0.25));
        let q = quantile(&b, 0.6).expect("samples");
        assert!((q - 0.75).abs() < 1e-9, "{q}");
        assert_eq!(quantile(&bucket_delta(&b, &b), 0.5), None);
    }

    #[test]
    fn metric_sums_matching_series_only() {
        let text = "a_total{verb=\"LIST\",resource=\"services\",system_client=\"\"} 3\n\
                    a_total{verb=\"LIST\",resource=\"services\",system_client=\"kube-apiserver\"} 5\n\
                    a_total_other{verb=\"LIST\"} 7\n";
        assert_eq!(by_resource(text, "a_total", &["verb=\"LIST\""]), 3.0);
        assert_eq!(metric(text, "a_total", &[], &[]), 8.0);
    }
}
