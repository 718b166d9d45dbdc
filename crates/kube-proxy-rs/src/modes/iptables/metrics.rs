//! iptables mode's own series, as upstream's: the rules per table
//! (kubeproxy_sync_proxy_rules_iptables_total / _last), from each sync's
//! report, and the nfacct counters its rules update, read from the kernel on
//! every scrape (kubeproxy_iptables_ct_state_invalid_dropped_packets_total,
//! kubeproxy_iptables_localhost_nodeports_accepted_packets_total).

use kp_iptables::nfacct;
use kp_model::{IpFamily, SyncReport};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type GaugeVec = Family<Vec<(&'static str, String)>, Gauge>;

/// The rule-count gauges, labelled by ip_family and table.
#[derive(Clone)]
pub struct IptablesRules {
    total: GaugeVec,
    last: GaugeVec,
}

impl IptablesRules {
    /// Registers the gauges and the nfacct collector in `r`.
    pub fn register(r: &mut Registry) -> IptablesRules {
        let total = GaugeVec::default();
        r.register(
            "kubeproxy_sync_proxy_rules_iptables_total",
            "Total number of iptables rules owned by kube-proxy",
            total.clone(),
        );
        let last = GaugeVec::default();
        r.register(
            "kubeproxy_sync_proxy_rules_iptables_last",
            "Number of iptables rules written by kube-proxy in last sync",
            last.clone(),
        );
        r.register_collector(Box::new(NfacctCollector));
        IptablesRules { total, last }
    }

    /// What an iptables sync of `family` reported (nothing in other modes).
    pub fn observe(&self, family: IpFamily, report: &SyncReport) {
        for (table, total, last) in &report.iptables_rules {
            let l = vec![
                ("ip_family", family.to_string()),
                ("table", table.to_string()),
            ];
            let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            self.total.get_or_create(&l).set(n(*total));
            self.last.get_or_create(&l).set(n(*last));
        }
    }
}

/// The nfacct counters, once this process's iptables proxier created them.
#[derive(Debug)]
struct NfacctCollector;

impl Collector for NfacctCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if !nfacct::ensured() {
            return Ok(());
        }
        // prometheus-client appends `_total` to counters.
        let series = [
            (
                "kubeproxy_iptables_ct_state_invalid_dropped_packets",
                "packets dropped by iptables to work around conntrack problems",
                nfacct::CT_STATE_INVALID_DROPPED,
            ),
            (
                "kubeproxy_iptables_localhost_nodeports_accepted_packets",
                "Number of packets accepted on nodeports of loopback interface",
                nfacct::LOCALHOST_NODEPORTS_ACCEPTED,
            ),
        ];
        for (name, help, counter) in series {
            match nfacct::packets(counter) {
                Ok(n) => {
                    let c = ConstCounter::new(n);
                    c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)?;
                }
                // A scrape goes on without it, as upstream's collector.
                Err(e) => tracing::warn!(error = %e, "cannot read the nfacct counter"),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::metrics::Metrics;
    use kp_model::{IpFamily, SyncReport};

    #[test]
    fn rule_counts_are_exported_per_family_and_table() {
        let m = Metrics::new();
        let report = SyncReport {
            iptables_rules: vec![("filter", 3, 3), ("nat", 19, 7)],
            ..Default::default()
        };
        m.observe_sync_report(IpFamily::V4, &report, 0.01);
        let text = m.encode();
        for line in [
            "kubeproxy_sync_proxy_rules_iptables_total{ip_family=\"IPv4\",table=\"filter\"} 3",
            "kubeproxy_sync_proxy_rules_iptables_total{ip_family=\"IPv4\",table=\"nat\"} 19",
            "kubeproxy_sync_proxy_rules_iptables_last{ip_family=\"IPv4\",table=\"nat\"} 7",
            "# TYPE kubeproxy_sync_proxy_rules_iptables_total gauge",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        // No nfacct counters in a process whose proxier made none.
        assert!(!text.contains("kubeproxy_iptables_"), "{text}");
        // Another mode's report leaves the gauges as they were.
        m.observe_sync_report(IpFamily::V4, &SyncReport::default(), 0.01);
        assert!(m.encode().contains("table=\"nat\"} 19"));
    }
}
