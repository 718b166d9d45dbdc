//! What a removal of leftovers did (every mode's sweep in `modes/` reports
//! into one).

/// What a cleanup did.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Objects removed, e.g. `nftables ip kube-proxy`, `iptables-legacy IPv4 nat/KUBE-SERVICES`.
    pub removed: Vec<String>,
    /// Removals that failed (the object is still there).
    pub failed: Vec<String>,
    /// Things not looked at, and why (a backend or tool missing).
    pub skipped: Vec<String>,
}

impl Outcome {
    /// Logs what was removed (info), skipped (debug) and failed (warn).
    pub fn log(&self, context: &str) {
        for r in &self.removed {
            tracing::info!(object = %r, "{context}: removed");
        }
        for s in &self.skipped {
            tracing::debug!(reason = %s, "{context}: skipped");
        }
        for f in &self.failed {
            tracing::warn!(error = %f, "{context}: could not remove");
        }
    }
}
