//! Prometheus metrics under upstream kube-proxy's names, labels and buckets
//! (kubeproxy_*), plus our own (kubeproxy_rs_*).
//!
//! Per-family metrics carry upstream's `ip_family` label ("IPv4"/"IPv6").
//! prometheus-client appends `_total` to counters itself, so counters are
//! registered without it; [`Metrics::encode`] converts its OpenMetrics output to
//! the Prometheus text format upstream serves, where the HELP/TYPE lines name
//! the counter with its `_total`.

pub mod client;
pub mod component;
pub mod process;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kp_model::{IpFamily, ProxyMode, SyncReport};
use prometheus_client::encoding::text::encode_registry;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, linear_buckets, Histogram};
use prometheus_client::registry::Registry;

/// What upstream's /metrics answers with.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, String)>;
type CounterVec = Family<Labels, Counter>;
type GaugeVec = Family<Labels, Gauge>;
type FloatGaugeVec = Family<Labels, Gauge<f64, AtomicU64>>;
type HistogramVec = Family<Labels, Histogram, fn() -> Histogram>;

fn sync_histogram() -> Histogram {
    // Upstream: ExponentialBuckets(0.001, 2, 15).
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

fn programming_histogram() -> Histogram {
    // Upstream: MergeBuckets(0, 0.25..0.5, 1..59, 60..115 by 5, 120..300 by 30).
    let buckets = std::iter::once(0.0)
        .chain(linear_buckets(0.25, 0.25, 2))
        .chain(linear_buckets(1.0, 1.0, 59))
        .chain(linear_buckets(60.0, 5.0, 12))
        .chain(linear_buckets(120.0, 30.0, 7));
    Histogram::new(buckets)
}

fn fam(family: IpFamily) -> Labels {
    vec![("ip_family", family.to_string())]
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

struct Inner {
    registry: Registry,
    sync_duration: HistogramVec,
    sync_full_duration: HistogramVec,
    sync_partial_duration: HistogramVec,
    network_programming: HistogramVec,
    last_timestamp: FloatGaugeVec,
    last_queued_timestamp: FloatGaugeVec,
    service_changes: Counter,
    service_changes_pending: Gauge,
    endpoint_changes: Counter,
    endpoint_changes_pending: Gauge,
    no_local_endpoints: GaugeVec,
    iptables_rules: crate::modes::iptables::metrics::IptablesRules,
    iptables_restore_failures: CounterVec,
    iptables_partial_restore_failures: CounterVec,
    nftables_sync_failures: CounterVec,
    conntrack_deleted: CounterVec,
    conntrack_duration: HistogramVec,
    healthz: CounterVec,
    livez: CounterVec,
    invalid_objects: CounterVec,
    invalid_fields: CounterVec,
    rules_lost: CounterVec,
    refused_claims: CounterVec,
    sync_bytes: GaugeVec,
    sync_retries: CounterVec,
    userspace_active: GaugeVec,
    userspace_bytes: CounterVec,
    userspace_errors: CounterVec,
    source_connected: Gauge,
    server_restarts: CounterVec,
    feature_enabled: GaugeVec,
}

/// All metrics of one process. Cheap to clone (shared).
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registry::default();
        let hist = |f: fn() -> Histogram| HistogramVec::new_with_constructor(f);

        let sync_duration = hist(sync_histogram);
        r.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            sync_duration.clone(),
        );
        let sync_full_duration = hist(sync_histogram);
        r.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            sync_full_duration.clone(),
        );
        let sync_partial_duration = hist(sync_histogram);
        r.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            sync_partial_duration.clone(),
        );
        let network_programming = hist(programming_histogram);
        r.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            network_programming.clone(),
        );
        let last_timestamp = FloatGaugeVec::default();
        r.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            last_timestamp.clone(),
        );
        let last_queued_timestamp = FloatGaugeVec::default();
        r.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            last_queued_timestamp.clone(),
        );
        let service_changes = Counter::default();
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            service_changes.clone(),
        );
        let service_changes_pending = Gauge::default();
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            service_changes_pending.clone(),
        );
        let endpoint_changes = Counter::default();
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            endpoint_changes.clone(),
        );
        let endpoint_changes_pending = Gauge::default();
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            endpoint_changes_pending.clone(),
        );
        // A gauge whose upstream name ends in _total: registered as is.
        let iptables_rules = crate::modes::iptables::metrics::IptablesRules::register(&mut r);
        let no_local_endpoints = GaugeVec::default();
        r.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            no_local_endpoints.clone(),
        );
        let iptables_restore_failures = CounterVec::default();
        r.register(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures",
            "Cumulative proxy iptables restore failures",
            iptables_restore_failures.clone(),
        );
        let iptables_partial_restore_failures = CounterVec::default();
        r.register(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
            "Cumulative proxy iptables partial restore failures",
            iptables_partial_restore_failures.clone(),
        );
        let nftables_sync_failures = CounterVec::default();
        r.register(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "Cumulative proxy nftables sync failures",
            nftables_sync_failures.clone(),
        );
        let conntrack_deleted = CounterVec::default();
        r.register(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            conntrack_deleted.clone(),
        );
        let conntrack_duration = hist(sync_histogram);
        r.register(
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds",
            conntrack_duration.clone(),
        );
        let healthz = CounterVec::default();
        r.register(
            "kubeproxy_proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            healthz.clone(),
        );
        let livez = CounterVec::default();
        r.register(
            "kubeproxy_proxy_livez",
            "Cumulative proxy livez HTTP status",
            livez.clone(),
        );

        let invalid_objects = CounterVec::default();
        r.register(
            "kubeproxy_rs_invalid_objects",
            "Objects skipped because a field was invalid, by kind",
            invalid_objects.clone(),
        );
        let invalid_fields = CounterVec::default();
        r.register(
            "kubeproxy_rs_invalid_fields",
            "Values ignored in otherwise valid objects (a bad or wrong-family IP, an out-of-range port), by kind",
            invalid_fields.clone(),
        );
        let rules_lost = CounterVec::default();
        r.register(
            "kubeproxy_rs_rules_lost",
            "Times our rules were found missing or flushed by someone else",
            rules_lost.clone(),
        );
        let refused_claims = CounterVec::default();
        r.register(
            "kubeproxy_rs_refused_claims",
            "Service address claims refused, by holder: a host process listening on the node address and port (host), or an older or higher-precedence Service (service)",
            refused_claims.clone(),
        );
        let sync_bytes = GaugeVec::default();
        r.register(
            "kubeproxy_rs_sync_bytes",
            "Size in bytes of the last rules transaction",
            sync_bytes.clone(),
        );
        let sync_retries = CounterVec::default();
        r.register(
            "kubeproxy_rs_sync_retries",
            "Syncs retried after a failure",
            sync_retries.clone(),
        );
        let userspace_active = GaugeVec::default();
        r.register(
            "kubeproxy_rs_userspace_active_connections",
            "Open proxied connections in userspace mode, by service",
            userspace_active.clone(),
        );
        let userspace_bytes = CounterVec::default();
        r.register(
            "kubeproxy_rs_userspace_bytes",
            "Bytes proxied in userspace mode, by service and direction",
            userspace_bytes.clone(),
        );
        let userspace_errors = CounterVec::default();
        r.register(
            "kubeproxy_rs_userspace_errors",
            "Userspace-mode connection errors, by service",
            userspace_errors.clone(),
        );
        let source_connected = Gauge::default();
        // Connected until the source says otherwise, as /healthz's
        // sourceConnected.
        source_connected.set(1);
        r.register(
            "kubeproxy_rs_source_connected",
            "Whether the API source is connected (1) or has lost the API server (0)",
            source_connected.clone(),
        );
        let server_restarts = CounterVec::default();
        r.register(
            "kubeproxy_rs_server_restarts",
            "Times the healthz or metrics server stopped or panicked and was started again, by server",
            server_restarts.clone(),
        );
        let build_info = GaugeVec::default();
        build_info
            .get_or_create(&vec![("version", env!("CARGO_PKG_VERSION").to_string())])
            .set(1);
        r.register(
            "kubeproxy_rs_build_info",
            "A constant 1, labelled with the kube-proxy-rs version",
            build_info,
        );
        r.register_collector(Box::new(crate::metrics::process::ProcessCollector));
        // component-base's kubernetes_* and client-go's rest_client_*.
        let feature_enabled = crate::metrics::component::register(&mut r);
        crate::metrics::client::register(&mut r);

        Metrics {
            inner: Arc::new(Inner {
                registry: r,
                sync_duration,
                sync_full_duration,
                sync_partial_duration,
                network_programming,
                last_timestamp,
                last_queued_timestamp,
                service_changes,
                service_changes_pending,
                endpoint_changes,
                endpoint_changes_pending,
                no_local_endpoints,
                iptables_rules,
                iptables_restore_failures,
                iptables_partial_restore_failures,
                nftables_sync_failures,
                conntrack_deleted,
                conntrack_duration,
                healthz,
                livez,
                invalid_objects,
                invalid_fields,
                rules_lost,
                refused_claims,
                sync_bytes,
                sync_retries,
                userspace_active,
                userspace_bytes,
                userspace_errors,
                source_connected,
                server_restarts,
                feature_enabled,
            }),
        }
    }

    /// A successful sync of `family` that took `secs`: the duration histograms
    /// (overall, and full or partial) and the last-sync timestamp.
    pub fn observe_sync(&self, family: IpFamily, full: bool, secs: f64) {
        let l = fam(family);
        let i = &self.inner;
        i.sync_duration.get_or_create(&l).observe(secs);
        if full {
            i.sync_full_duration.get_or_create(&l).observe(secs);
        } else {
            i.sync_partial_duration.get_or_create(&l).observe(secs);
        }
        i.last_timestamp.get_or_create(&l).set(now_secs());
    }

    /// [`Metrics::observe_sync`] plus what the dataplane reported: transaction
    /// size and Local-policy services without local endpoints.
    pub fn observe_sync_report(&self, family: IpFamily, report: &SyncReport, secs: f64) {
        self.observe_sync(family, report.full, secs);
        self.set_sync_bytes(family, report.bytes as u64);
        self.set_no_local_endpoints(
            family,
            report.no_local_endpoints.0,
            report.no_local_endpoints.1,
        );
        self.inner.iptables_rules.observe(family, report);
    }

    /// A failed sync: counts under the mode's upstream failure counter
    /// (iptables and ipvs: iptables_restore_failures; nftables:
    /// nftables_sync_failures, `--socket-lb` too). Userspace mode has no
    /// upstream counter.
    pub fn inc_sync_failure(&self, family: IpFamily, mode: ProxyMode) {
        let l = fam(family);
        // Upstream's counters: iptables-restore's (iptables, and ipvs mode's
        // iptables rules) and nftables'. Userspace mode has none upstream
        // (kubeproxy_rs_sync_retries_total counts every mode).
        match mode {
            ProxyMode::Iptables | ProxyMode::Ipvs => {
                self.inner.iptables_restore_failures.get_or_create(&l).inc();
            }
            ProxyMode::Nftables => {
                self.inner.nftables_sync_failures.get_or_create(&l).inc();
            }
            ProxyMode::Userspace => {}
        }
    }

    /// iptables mode: a partial restore failed and a full one follows.
    pub fn inc_partial_restore_failure(&self, family: IpFamily) {
        self.inner
            .iptables_partial_restore_failures
            .get_or_create(&fam(family))
            .inc();
    }

    /// A sync was requested now (kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds).
    pub fn set_queued(&self, family: IpFamily) {
        self.inner
            .last_queued_timestamp
            .get_or_create(&fam(family))
            .set(now_secs());
    }

    /// Changes seen but not yet programmed.
    pub fn set_pending(&self, services: u64, endpoints: u64) {
        self.inner.service_changes_pending.set(to_i64(services));
        self.inner.endpoint_changes_pending.set(to_i64(endpoints));
    }

    /// Adds to the cumulative change counters.
    pub fn add_changes(&self, services: u64, endpoints: u64) {
        self.inner.service_changes.inc_by(services);
        self.inner.endpoint_changes.inc_by(endpoints);
    }

    /// Time from a change (trigger time) to its rules being in place.
    pub fn observe_programming_latency(&self, family: IpFamily, secs: f64) {
        self.inner
            .network_programming
            .get_or_create(&fam(family))
            .observe(secs);
    }

    /// Services with an internal / external Local traffic policy and no local
    /// endpoint.
    pub fn set_no_local_endpoints(&self, family: IpFamily, internal: u64, external: u64) {
        let f = family.to_string();
        let g = &self.inner.no_local_endpoints;
        g.get_or_create(&vec![
            ("ip_family", f.clone()),
            ("traffic_policy", "internal".to_string()),
        ])
        .set(to_i64(internal));
        g.get_or_create(&vec![
            ("ip_family", f),
            ("traffic_policy", "external".to_string()),
        ])
        .set(to_i64(external));
    }

    /// One conntrack cleanup pass: how long it took and what it deleted.
    pub fn observe_conntrack_reconcile(&self, family: IpFamily, secs: f64, deleted: u64) {
        let l = fam(family);
        self.inner
            .conntrack_duration
            .get_or_create(&l)
            .observe(secs);
        self.inner
            .conntrack_deleted
            .get_or_create(&l)
            .inc_by(deleted);
    }

    /// /healthz answered with `code`.
    pub fn inc_healthz(&self, code: u16) {
        self.inner
            .healthz
            .get_or_create(&vec![("code", code.to_string())])
            .inc();
    }

    /// /livez answered with `code`.
    pub fn inc_livez(&self, code: u16) {
        self.inner
            .livez
            .get_or_create(&vec![("code", code.to_string())])
            .inc();
    }

    /// An object of `kind` ("Service", "EndpointSlice", ...) was skipped.
    pub fn inc_invalid(&self, kind: &str) {
        self.inner
            .invalid_objects
            .get_or_create(&vec![("kind", kind.to_string())])
            .inc();
    }

    /// A value in an object of `kind` was ignored (the rest of it is used).
    pub fn inc_invalid_field(&self, kind: &str) {
        self.inner
            .invalid_fields
            .get_or_create(&vec![("kind", kind.to_string())])
            .inc();
    }

    /// The canary found our rules gone.
    pub fn inc_rules_lost(&self, family: IpFamily) {
        self.inner.rules_lost.get_or_create(&fam(family)).inc();
    }

    pub fn set_sync_bytes(&self, family: IpFamily, bytes: u64) {
        self.inner
            .sync_bytes
            .get_or_create(&fam(family))
            .set(to_i64(bytes));
    }

    pub fn inc_sync_retry(&self, family: IpFamily) {
        self.inner.sync_retries.get_or_create(&fam(family)).inc();
    }

    /// Userspace mode: a proxied connection opened for `service` ("ns/name:port").
    pub fn userspace_connection_opened(&self, service: &str) {
        self.inner
            .userspace_active
            .get_or_create(&vec![("service", service.to_string())])
            .inc();
    }

    pub fn userspace_connection_closed(&self, service: &str) {
        self.inner
            .userspace_active
            .get_or_create(&vec![("service", service.to_string())])
            .dec();
    }

    /// `direction` is "in" (client to endpoint) or "out".
    pub fn add_userspace_bytes(&self, service: &str, direction: &str, bytes: u64) {
        self.inner
            .userspace_bytes
            .get_or_create(&vec![
                ("service", service.to_string()),
                ("direction", direction.to_string()),
            ])
            .inc_by(bytes);
    }

    pub fn inc_userspace_error(&self, service: &str) {
        self.inner
            .userspace_errors
            .get_or_create(&vec![("service", service.to_string())])
            .inc();
    }

    /// Forgets a removed service's userspace series.
    pub fn remove_userspace_service(&self, service: &str) {
        let s = service.to_string();
        let i = &self.inner;
        i.userspace_active.remove(&vec![("service", s.clone())]);
        i.userspace_errors.remove(&vec![("service", s.clone())]);
        for dir in ["in", "out"] {
            i.userspace_bytes.remove(&vec![
                ("service", s.clone()),
                ("direction", dir.to_string()),
            ]);
        }
    }

    /// Creates the labelled series the alert rules and dashboard read, at 0,
    /// for the families that run: a family with no series is not exported at
    /// all, and `increase()` over a counter that appears at 1 misses its first
    /// event.
    pub fn init_series(&self, families: &[IpFamily]) {
        let i = &self.inner;
        for &f in families {
            let l = fam(f);
            drop(i.rules_lost.get_or_create(&l));
            drop(i.sync_retries.get_or_create(&l));
            drop(i.nftables_sync_failures.get_or_create(&l));
            drop(i.iptables_restore_failures.get_or_create(&l));
            drop(i.iptables_partial_restore_failures.get_or_create(&l));
            drop(i.conntrack_deleted.get_or_create(&l));
            drop(i.sync_full_duration.get_or_create(&l));
            drop(i.sync_partial_duration.get_or_create(&l));
        }
        for kind in ["Service", "EndpointSlice"] {
            drop(
                i.invalid_objects
                    .get_or_create(&vec![("kind", kind.to_string())]),
            );
        }
        for code in ["200", "503"] {
            drop(i.healthz.get_or_create(&vec![("code", code.to_string())]));
            drop(i.livez.get_or_create(&vec![("code", code.to_string())]));
        }
    }

    /// The `server` ("healthz", "metrics") stopped and is started again.
    pub fn inc_server_restart(&self, server: &str) {
        self.inner
            .server_restarts
            .get_or_create(&vec![("server", server.to_string())])
            .inc();
    }

    /// The API source lost (false) or regained (true) the API server.
    pub fn set_source_connected(&self, connected: bool) {
        self.inner.source_connected.set(i64::from(connected));
    }

    /// kubernetes_feature_enabled from the effective `featureGates`.
    pub fn set_feature_gates(&self, gates: &std::collections::BTreeMap<String, bool>) {
        crate::metrics::component::set_feature_gates(&self.inner.feature_enabled, gates);
    }

    /// Whether feature gate `gate` is on (see [`Metrics::set_feature_gates`]).
    pub fn feature_enabled(&self, gate: &str) -> bool {
        crate::metrics::component::is_enabled(&self.inner.feature_enabled, gate)
    }

    /// OpenMetrics text, `# EOF` included.
    pub fn encode_openmetrics(&self) -> String {
        let mut out = String::new();
        if let Err(e) = encode_registry(&mut out, &self.inner.registry) {
            tracing::error!(error = %e, "encoding metrics failed");
        }
        out.push_str("# EOF\n");
        // prometheus-client writes Rust's "inf"; both formats spell it +Inf
        // (rest_client_exec_plugin_ttl_seconds is one). A label value
        // cannot hold a raw newline, so only sample values match.
        if out.contains("inf\n") {
            out = out
                .replace(" inf\n", " +Inf\n")
                .replace(" -inf\n", " -Inf\n");
        }
        out
    }

    /// Prometheus text format 0.0.4, as upstream serves on /metrics.
    pub fn encode(&self) -> String {
        openmetrics_to_prometheus(&self.encode_openmetrics())
    }
}

/// What the sync loop reports, mapped onto the metric families above. A
/// metric the loop should feed is added here and as a method of
/// [`kp_sync::SyncMetrics`] called from kp-sync's `sync.rs`.
impl kp_sync::SyncMetrics for Metrics {
    fn invalid_object(&self, kind: &str) {
        self.inc_invalid(kind);
    }
    fn invalid_field(&self, kind: &str) {
        self.inc_invalid_field(kind);
    }
    fn queued(&self, family: IpFamily) {
        self.set_queued(family);
    }
    fn pending_changes(&self, services: u64, endpoints: u64) {
        self.set_pending(services, endpoints);
    }
    fn changes(&self, services: u64, endpoints: u64) {
        self.add_changes(services, endpoints);
    }
    fn rules_lost(&self, family: IpFamily) {
        self.inc_rules_lost(family);
    }
    fn claims_refused(&self, family: IpFamily, to_host: u64, to_service: u64) {
        for (holder, n) in [("host", to_host), ("service", to_service)] {
            if n > 0 {
                let mut l = fam(family);
                l.push(("holder", holder.to_string()));
                self.inner.refused_claims.get_or_create(&l).inc_by(n);
            }
        }
    }
    fn synced(&self, family: IpFamily, report: &SyncReport, secs: f64) {
        self.observe_sync_report(family, report, secs);
    }
    fn programming_latency(&self, family: IpFamily, secs: f64) {
        self.observe_programming_latency(family, secs);
    }
    fn sync_failed(&self, family: IpFamily, mode: ProxyMode, full: bool) {
        self.inc_sync_failure(family, mode);
        // Upstream's iptables proxier counts a failed partial sync (then
        // syncs in full); its IPVS proxier has no partial syncs.
        if mode == ProxyMode::Iptables && !full {
            self.inc_partial_restore_failure(family);
        }
        self.inc_sync_retry(family);
    }
    fn conntrack_reconciled(&self, family: IpFamily, secs: f64, deleted: u64) {
        self.observe_conntrack_reconcile(family, secs, deleted);
    }
    fn source_connected(&self, connected: bool) {
        self.set_source_connected(connected);
    }
}

/// OpenMetrics names a counter family without `_total` in HELP/TYPE and has
/// UNIT and EOF lines; the Prometheus format names it with `_total` and has
/// neither.
fn openmetrics_to_prometheus(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    let mut help: Option<&str> = None;
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest);
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, typ) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, typ) = match typ {
                "counter" if !name.ends_with("_total") => (format!("{name}_total"), "counter"),
                "counter" => (name.to_string(), "counter"),
                "gauge" | "histogram" | "summary" => (name.to_string(), typ),
                "info" | "stateset" => (name.to_string(), "gauge"),
                _ => (name.to_string(), "untyped"),
            };
            if let Some(h) = help.take() {
                let text = h.split_once(' ').map(|(_, t)| t).unwrap_or("");
                // prometheus-client ends help with a '.'; upstream's has none.
                let text = text.strip_suffix('.').unwrap_or(text);
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {typ}\n"));
            continue;
        }
        if let Some(h) = help.take() {
            out.push_str("# HELP ");
            out.push_str(h);
            out.push('\n');
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_help_and_type_carry_total() {
        let m = Metrics::new();
        m.inc_healthz(200);
        let text = m.encode();
        assert!(text.contains("# TYPE kubeproxy_proxy_healthz_total counter\n"));
        assert!(text.contains(
            "# HELP kubeproxy_proxy_healthz_total Cumulative proxy healthz HTTP status\n"
        ));
        assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 1\n"));
        assert!(!text.contains("# EOF"));
        assert!(!text.contains("_total_total"));
    }

    /// Every mode that programs rules counts its failed syncs in its rules
    /// mode's upstream counter, socket-lb's combination included.
    #[test]
    fn sync_failures_count_in_every_rules_mode() {
        use kp_sync::SyncMetrics;
        let m = Metrics::new();
        m.sync_failed(IpFamily::V4, ProxyMode::Nftables, true);
        m.sync_failed(IpFamily::V4, ProxyMode::Nftables, false);
        m.sync_failed(IpFamily::V6, ProxyMode::Ipvs, true);
        m.sync_failed(IpFamily::V6, ProxyMode::Iptables, false);
        let text = m.encode();
        for want in [
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv4\"} 2\n",
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv6\"} 2\n",
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total{ip_family=\"IPv6\"} 1\n",
            "kubeproxy_rs_sync_retries_total{ip_family=\"IPv4\"} 2\n",
        ] {
            assert!(text.contains(want), "no `{want}` in:\n{text}");
        }
    }
}
