//! Logging: upstream's `-v` levels mapped to tracing levels, text or JSON
//! (`--logging-format=json`, as upstream's), to stderr.

use tracing_subscriber::EnvFilter;

/// The tracing level for upstream's klog verbosity. klog's 0-2 are the
/// everyday levels (kube-proxy logs its startup and sync summaries there; many
/// deployments run `--v=2`), 3-4 add per-change detail (debug), 5 and up are
/// for tracing a problem (trace).
pub fn level_for_verbosity(v: u8) -> tracing::Level {
    match v {
        0..=2 => tracing::Level::INFO,
        3..=4 => tracing::Level::DEBUG,
        _ => tracing::Level::TRACE,
    }
}

/// The filter directive for `-v=N`: our level, with the chatty HTTP and
/// client libraries held at warn until trace (`-v=6`+ lets them through too).
/// `RUST_LOG` replaces it entirely when set.
pub fn filter_directive(v: u8) -> String {
    let level = level_for_verbosity(v).to_string().to_lowercase();
    if v >= 6 {
        return level;
    }
    format!(
        "{level},kube_client=warn,kube_runtime=warn,hyper=warn,hyper_util=warn,tower=warn,rustls=warn,aya=warn,aya_obj=warn"
    )
}

/// Installs the global subscriber. Colours only on a terminal.
pub fn init(verbosity: u8, json: bool) {
    use std::io::IsTerminal;
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(filter_directive(verbosity)));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        b.json().with_current_span(false).init();
    } else {
        b.with_ansi(std::io::stderr().is_terminal()).init();
    }
}
