//! The standard `process_*` metrics (as every Go component, upstream
//! kube-proxy included, exports through client_golang's process collector),
//! read from /proc/self on each scrape: CPU seconds, resident and virtual
//! memory, open and maximum file descriptors, start time. Dashboards and
//! alerts written for upstream's process metrics work unchanged.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// One reading of /proc/self.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: i64,
    pub virtual_bytes: i64,
    pub open_fds: i64,
    pub max_fds: i64,
    pub start_time_seconds: f64,
}

/// Fields of /proc/self/stat after the command name (which may hold spaces
/// and parentheses, so the line is split at its last ')').
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().collect())
}

/// Parses /proc/self/stat given the clock tick rate, page size and the boot
/// time (`btime` of /proc/stat). Field numbers are proc(5)'s, 1-based; the
/// slice starts at field 3 (state).
pub fn parse_stat(stat: &str, ticks: f64, page: i64, btime: f64) -> Option<ProcessStats> {
    let f = stat_fields(stat)?;
    let field = |n: usize| -> Option<f64> { f.get(n - 3)?.parse::<f64>().ok() };
    let utime = field(14)?;
    let stime = field(15)?;
    let starttime = field(22)?;
    let vsize = field(23)?;
    let rss = field(24)?;
    Some(ProcessStats {
        cpu_seconds: (utime + stime) / ticks,
        resident_bytes: rss as i64 * page,
        virtual_bytes: vsize as i64,
        start_time_seconds: btime + starttime / ticks,
        ..Default::default()
    })
}

fn boot_time() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// Reads this process's figures; None when /proc is not readable.
pub fn read_self() -> Option<ProcessStats> {
    // SAFETY: sysconf and getrlimit only read process-wide settings; the
    // rlimit struct is a plain out-parameter owned here.
    let (ticks, page, max_fds) = unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        let max = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            i64::try_from(lim.rlim_cur).unwrap_or(i64::MAX)
        } else {
            0
        };
        (
            libc::sysconf(libc::_SC_CLK_TCK),
            libc::sysconf(libc::_SC_PAGESIZE),
            max,
        )
    };
    if ticks <= 0 || page <= 0 {
        return None;
    }
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let mut s = parse_stat(&stat, ticks as f64, page, boot_time()?)?;
    s.open_fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as i64)
        .unwrap_or(0);
    s.max_fds = max_fds;
    Some(s)
}

/// Registered with the metrics registry: reads /proc/self on every scrape.
#[derive(Debug, Default)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = read_self() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(enc.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges: [(&str, &str, i64); 4] = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                s.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                s.virtual_bytes,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                s.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                s.max_fds,
            ),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        let start = ConstGauge::new(s.start_time_seconds);
        start.encode(enc.encode_descriptor(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
            None,
            start.metric_type(),
        )?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_stat_with_a_tricky_command_name() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt
        // majflt cmajflt utime stime cutime cstime priority nice threads
        // itrealvalue starttime vsize rss ...
        let line = "42 (kube (proxy) rs) S 1 42 42 0 -1 4194560 100 0 0 0 \
                    250 50 0 0 20 0 8 0 1000 104857600 2560 18446744073709551615";
        let s = parse_stat(line, 100.0, 4096, 1_700_000_000.0).unwrap();
        assert_eq!(s.cpu_seconds, 3.0);
        assert_eq!(s.resident_bytes, 2560 * 4096);
        assert_eq!(s.virtual_bytes, 104_857_600);
        assert_eq!(s.start_time_seconds, 1_700_000_010.0);
        assert!(parse_stat("garbage", 100.0, 4096, 0.0).is_none());
    }

    #[test]
    fn reads_this_process() {
        let s = read_self().expect("/proc/self readable");
        assert!(s.resident_bytes > 0);
        assert!(s.open_fds >= 3, "{s:?}");
        assert!(s.max_fds >= s.open_fds);
        assert!(s.start_time_seconds > 1_600_000_000.0);
    }
}
