//! Flags, the KubeProxyConfiguration file, and how they combine.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;
use kp_model::{IpFamily, LocalDetector};
use kp_netlab::ScratchDir;
use kube_proxy_rs::config::{
    format_go_duration, load, parse_go_duration, ConfigError, DetectLocalMode, ProxyConfig,
    ProxyMode,
};

fn args(list: &[&str]) -> Vec<OsString> {
    std::iter::once("kube-proxy")
        .chain(list.iter().copied())
        .map(OsString::from)
        .collect()
}

/// A temp dir removed on drop, unique per test.
struct TempDir(ScratchDir);

impl TempDir {
    fn new(tag: &str) -> Self {
        TempDir(ScratchDir::unique(&format!("kpr-config-{tag}")).unwrap())
    }
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

fn load_file(tag: &str, yaml: &str, extra: &[&str]) -> Result<ProxyConfig, ConfigError> {
    let dir = TempDir::new(tag);
    let path = dir.write("config.yaml", yaml);
    let mut a = vec!["--config", path.to_str().unwrap()];
    a.extend_from_slice(extra);
    load(args(&a))
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

/// What `kubeadm init` puts in the kube-proxy ConfigMap (config.conf).
const KUBEADM_CONFIG: &str = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

#[test]
fn defaults_match_upstream() {
    let c = load(args(&["--hostname-override", "Node-A "])).unwrap();
    // Upstream's default on Linux.
    assert_eq!(c.mode, ProxyMode::Iptables);
    assert_eq!(c.hostname, "node-a");
    assert_eq!(c.bind_address, "0.0.0.0".parse::<IpAddr>().unwrap());
    assert_eq!(
        c.healthz_bind_address,
        Some("0.0.0.0:10256".parse::<SocketAddr>().unwrap())
    );
    assert_eq!(
        c.metrics_bind_address,
        Some("127.0.0.1:10249".parse::<SocketAddr>().unwrap())
    );
    assert!(c.cluster_cidrs.is_empty());
    assert_eq!(c.detect_local_mode, DetectLocalMode::ClusterCidr);
    assert!(c.nodeport_addresses.is_empty());
    assert!(
        !c.nodeport_primary,
        "iptables mode: every local IP when unset"
    );
    assert!(c.load_warnings.is_empty());
    assert!(!c.masquerade_all);
    assert_eq!(c.masquerade_bit, 14);
    assert_eq!(c.sync_period, Duration::from_secs(30));
    assert_eq!(c.min_sync_period, Duration::from_secs(1));
    assert!(c.localhost_nodeports);
    assert_eq!(c.config_sync_period, Duration::from_secs(900));
    assert_eq!(c.kubeconfig, None);
    assert_eq!(c.master, None);
    assert_eq!(c.conntrack.max_per_core, 32768);
    assert_eq!(c.conntrack.min, 131072);
    assert_eq!(
        c.conntrack.tcp_established_timeout,
        Duration::from_secs(86400)
    );
    assert_eq!(
        c.conntrack.tcp_close_wait_timeout,
        Duration::from_secs(3600)
    );
    assert_eq!(c.ipvs.sync_period, Duration::from_secs(30));
    assert_eq!(c.ipvs.min_sync_period, Duration::ZERO);
    assert_eq!(c.oom_score_adj, -999);
    assert_eq!(c.client.qps, 5.0);
    assert_eq!(c.client.burst, 10);
    assert_eq!(c.verbosity, 0);
    assert!(!c.log_json && !c.dry_run && !c.cleanup);
    assert_eq!(c.service_proxy_name, None);
    assert_eq!(c.local_detector(IpFamily::V4), LocalDetector::None);
}

#[test]
fn hostname_defaults_to_the_machines() {
    let c = load(args(&[])).unwrap();
    let expect = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_lowercase();
    assert_eq!(c.hostname, expect);
}

#[test]
fn iptables_mode_serves_nodeports_on_all_addresses() {
    let c = load(args(&[
        "--proxy-mode",
        "iptables",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    assert_eq!(c.mode, ProxyMode::Iptables);
    assert_eq!(c.mode.as_str(), "iptables");
    assert!(!c.nodeport_primary);
    assert!(c.nodeport_addresses.is_empty());
    for m in ["ipvs", "userspace", "nftables"] {
        let c = load(args(&["--proxy-mode", m, "--hostname-override", "n"])).unwrap();
        assert_eq!(c.mode.as_str(), m);
    }
    let err = load(args(&["--proxy-mode", "kernelspace"])).unwrap_err();
    assert!(matches!(err, ConfigError::Cli(_)), "{err}");
}

#[test]
fn kubeadm_configmap_loads() {
    let c = load_file("kubeadm", KUBEADM_CONFIG, &["--hostname-override", "n1"]).unwrap();
    // `mode: ""` is upstream's platform default: iptables.
    assert_eq!(c.mode, ProxyMode::Iptables);
    assert!(!c.nodeport_primary);
    assert!(c.load_warnings.is_empty(), "{:?}", c.load_warnings);
    assert_eq!(
        c.kubeconfig,
        Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf"))
    );
    assert_eq!(
        c.cluster_cidrs,
        vec![net("10.244.0.0/16"), net("fd00:10:244::/56")]
    );
    // Zero values in the file take upstream's defaults.
    assert_eq!(c.sync_period, Duration::from_secs(30));
    assert_eq!(c.min_sync_period, Duration::from_secs(1));
    assert_eq!(c.config_sync_period, Duration::from_secs(900));
    assert_eq!(c.masquerade_bit, 14);
    assert_eq!(
        c.healthz_bind_address,
        Some("0.0.0.0:10256".parse::<SocketAddr>().unwrap())
    );
    assert_eq!(
        c.metrics_bind_address,
        Some("127.0.0.1:10249".parse::<SocketAddr>().unwrap())
    );
    assert_eq!(c.conntrack.max_per_core, 32768);
    assert_eq!(c.client.content_type, "application/vnd.kubernetes.protobuf");
    assert_eq!(
        c.local_detector(IpFamily::V4),
        LocalDetector::Cidrs(vec![net("10.244.0.0/16")])
    );
    assert_eq!(
        c.local_detector(IpFamily::V6),
        LocalDetector::Cidrs(vec![net("fd00:10:244::/56")])
    );
}

#[test]
fn file_values_are_used_and_flags_override_only_when_given() {
    let yaml = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: 10.1.0.0/16
metricsBindAddress: 0.0.0.0:10249
hostnameOverride: from-file
iptables:
  masqueradeBit: 12
  masqueradeAll: true
  syncPeriod: 10s
  minSyncPeriod: 2s
  localhostNodePorts: false
nodePortAddresses: [192.0.2.0/24]
configSyncPeriod: 5m
logging:
  format: json
  verbosity: 3
featureGates:
  SomeGate: true
"#;
    // No flags: the file wins over flag defaults.
    let c = load_file("nogiven", yaml, &[]).unwrap();
    assert_eq!(c.mode, ProxyMode::Iptables);
    assert_eq!(c.hostname, "from-file");
    assert_eq!(c.cluster_cidrs, vec![net("10.1.0.0/16")]);
    assert_eq!(
        c.metrics_bind_address,
        Some("0.0.0.0:10249".parse::<SocketAddr>().unwrap())
    );
    assert_eq!(c.masquerade_bit, 12);
    assert!(c.masquerade_all);
    assert_eq!(c.sync_period, Duration::from_secs(10));
    assert_eq!(c.min_sync_period, Duration::from_secs(2));
    assert!(!c.localhost_nodeports);
    assert_eq!(c.nodeport_addresses, vec![net("192.0.2.0/24")]);
    assert!(!c.nodeport_primary);
    assert_eq!(c.config_sync_period, Duration::from_secs(300));
    assert!(c.log_json);
    assert_eq!(c.verbosity, 3);
    assert_eq!(c.feature_gates.get("SomeGate"), Some(&true));

    // With --config, upstream takes everything from the file but its logging
    // flags and --hostname-override: the other flags given are ignored, and
    // named in a warning.
    let c = load_file(
        "given",
        yaml,
        &[
            "--cluster-cidr",
            "10.2.0.0/16",
            "--iptables-masquerade-bit=5",
            "--masquerade-all=false",
            "--proxy-mode",
            "nftables",
            "-v",
            "5",
            "--log-format",
            "text",
            "--iptables-min-sync-period",
            "500ms",
            "--hostname-override",
            "From-Flag",
            "--feature-gates",
            "SomeGate=false",
            "--metrics-bind-address",
            "",
        ],
    )
    .unwrap();
    assert_eq!(c.mode, ProxyMode::Iptables);
    assert_eq!(c.cluster_cidrs, vec![net("10.1.0.0/16")]);
    assert_eq!(c.masquerade_bit, 12);
    assert!(c.masquerade_all);
    assert_eq!(c.min_sync_period, Duration::from_secs(2));
    assert_eq!(c.sync_period, Duration::from_secs(10));
    assert_eq!(c.feature_gates.get("SomeGate"), Some(&true));
    assert_eq!(
        c.metrics_bind_address,
        Some("0.0.0.0:10249".parse::<SocketAddr>().unwrap()),
        "an empty --metrics-bind-address does not disable the file's"
    );
    // These apply over the file.
    assert_eq!(c.verbosity, 5);
    assert!(!c.log_json);
    assert_eq!(c.hostname, "from-flag");
    assert_eq!(c.load_warnings.len(), 1, "{:?}", c.load_warnings);
    // The list after the explanation.
    let w = c.load_warnings[0].rsplit(": ").next().unwrap();
    for ignored in [
        "--cluster-cidr",
        "--iptables-masquerade-bit",
        "--masquerade-all",
        "--proxy-mode",
        "--iptables-min-sync-period",
        "--feature-gates",
        "--metrics-bind-address",
    ] {
        assert!(w.contains(ignored), "{ignored} missing from {w:?}");
    }
    for applied in ["--hostname-override", "--log-format", "--verbosity"] {
        assert!(!w.contains(applied), "{applied} named in {w:?}");
    }
}

/// Upstream's deprecated --healthz-port and --metrics-port, without a file:
/// 0 disables the server, another port only completes an address that has
/// none.
#[test]
fn deprecated_port_flags() {
    let c = load(args(&["--hostname-override", "n", "--healthz-port", "0"])).unwrap();
    assert_eq!(c.healthz_bind_address, None);
    assert!(c.metrics_bind_address.is_some());
    let c = load(args(&["--hostname-override", "n", "--metrics-port=0"])).unwrap();
    assert_eq!(c.metrics_bind_address, None);
    let c = load(args(&[
        "--hostname-override",
        "n",
        "--healthz-port=12345",
        "--metrics-bind-address=127.0.0.1",
        "--metrics-port=23456",
    ]))
    .unwrap();
    assert_eq!(
        c.healthz_bind_address,
        Some("0.0.0.0:10256".parse::<SocketAddr>().unwrap()),
        "the default address has a port already"
    );
    assert_eq!(
        c.metrics_bind_address,
        Some("127.0.0.1:23456".parse::<SocketAddr>().unwrap())
    );
    // The other flags upstream accepts for its logging are taken.
    load(args(&[
        "--hostname-override",
        "n",
        "--log-text-split-stream",
        "--log-json-split-stream=false",
        "--log-text-info-buffer-size=1Mi",
        "--log-json-info-buffer-size=0",
        "--boot-id-file=/proc/sys/kernel/random/boot_id",
        "--machine-id-file=/etc/machine-id",
        "--log-flush-frequency=5s",
    ]))
    .unwrap();
}

fn expect_invalid(tag: &str, yaml_body: &str, needles: &[&str]) {
    let yaml = format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{yaml_body}"
    );
    let err = load_file(tag, &yaml, &["--hostname-override", "n"]).unwrap_err();
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} should contain {n:?}");
    }
}

/// As upstream (strict, then lenient decoding): unknown fields are left out
/// and named in a warning; the rest of the file applies.
#[test]
fn unknown_fields_are_left_out_with_a_warning_naming_them() {
    let yaml = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                bogusField: 1\nmode: nftables\niptables:\n  fooBar: true\n  masqueradeBit: 9\n\
                conntrack:\n  maxPerCore: 1\n  tcpTimeout: 1s\n";
    let c = load_file("unk", yaml, &["--hostname-override", "n"]).unwrap();
    assert_eq!(c.mode, ProxyMode::Nftables);
    assert_eq!(c.masquerade_bit, 9);
    assert_eq!(c.conntrack.max_per_core, 1);
    let all = c.load_warnings.join("\n");
    for f in ["bogusField", "iptables.fooBar", "conntrack.tcpTimeout"] {
        assert!(all.contains(f), "{f} not named in {all:?}");
    }
    assert_eq!(c.load_warnings.len(), 3, "{all}");
    // A value of the wrong type is still an error, naming its field.
    expect_invalid(
        "unk4",
        "bogusField: 1\niptables:\n  masqueradeBit: lots\n",
        &["iptables.masqueradeBit"],
    );
}

#[test]
fn bad_values_are_errors_naming_the_field() {
    expect_invalid(
        "bit",
        "iptables:\n  masqueradeBit: 40\n",
        &["iptables.masqueradeBit: 40 is not in 0..=31"],
    );
    expect_invalid(
        "nftbit",
        "nftables:\n  masqueradeBit: -1\n",
        &["nftables.masqueradeBit: -1 is not in 0..=31"],
    );
    expect_invalid(
        "bittype",
        "iptables:\n  masqueradeBit: lots\n",
        &["iptables.masqueradeBit"],
    );
    expect_invalid(
        "cidr",
        "clusterCIDR: 10.0.0.0/33\n",
        &["clusterCIDR", "10.0.0.0/33"],
    );
    expect_invalid(
        "cidr2",
        "clusterCIDR: 10.0.0.0/16,10.1.0.0/16\n",
        &["clusterCIDR", "one CIDR per IP family"],
    );
    expect_invalid(
        "npa",
        "nodePortAddresses: [10.0.0.0/8, nonsense]\n",
        &["nodePortAddresses[1]", "nonsense"],
    );
    expect_invalid(
        "dur",
        "iptables:\n  syncPeriod: 5 minutes\n",
        &["iptables.syncPeriod"],
    );
    expect_invalid("dur2", "configSyncPeriod: 10\n", &["configSyncPeriod"]);
    expect_invalid("mode", "mode: kernelspace\n", &["mode", "kernelspace"]);
    expect_invalid(
        "detect",
        "detectLocalMode: BridgeInterface\n",
        &["detectLocal.bridgeInterface"],
    );
    expect_invalid("bind", "bindAddress: not-an-ip\n", &["bindAddress"]);
    expect_invalid(
        "healthz",
        "healthzBindAddress: localhost:x\n",
        &["healthzBindAddress"],
    );
    expect_invalid("oom", "oomScoreAdj: 5000\n", &["oomScoreAdj"]);

    let err = load_file(
        "kind",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
        &[],
    )
    .unwrap_err();
    assert!(err.to_string().contains("kind"), "{err}");
    let err = load_file("apiv", "kind: KubeProxyConfiguration\n", &[]).unwrap_err();
    assert!(err.to_string().contains("apiVersion"), "{err}");
}

#[test]
fn bad_flags_are_errors() {
    for bad in [
        vec!["--iptables-sync-period", "5 minutes"],
        vec!["--bind-address", "nope"],
        vec!["--no-such-flag"],
    ] {
        let err = load(args(&bad)).unwrap_err();
        assert!(matches!(err, ConfigError::Cli(_)), "{bad:?}: {err}");
    }
    let err = load(args(&[
        "--iptables-masquerade-bit",
        "32",
        "--hostname-override",
        "n",
    ]))
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("masqueradeBit: 32 is not in 0..=31"),
        "{err}"
    );
    let err = load(args(&[
        "--cluster-cidr",
        "10.0.0.0/8,garbage",
        "--hostname-override",
        "n",
    ]))
    .unwrap_err();
    assert!(err.to_string().contains("clusterCIDR"), "{err}");
    // The name goes into the API label selector: a ',' would add a term.
    let err = load(args(&[
        "--service-proxy-name",
        "mine,!other",
        "--hostname-override",
        "n",
    ]))
    .unwrap_err();
    assert!(err.to_string().contains("--service-proxy-name"), "{err}");
    match load(args(&["--help"])).unwrap_err() {
        ConfigError::Cli(e) => assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp),
        other => panic!("{other}"),
    }
}

#[test]
fn bool_flags_take_go_syntax() {
    let c = load(args(&["--masquerade-all", "--hostname-override", "n"])).unwrap();
    assert!(c.masquerade_all);
    let c = load(args(&["--masquerade-all=true", "--hostname-override", "n"])).unwrap();
    assert!(c.masquerade_all);
    let c = load(args(&[
        "--iptables-localhost-nodeports=false",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    assert!(!c.localhost_nodeports);
    let c = load(args(&[
        "--cleanup",
        "--dry-run",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    assert!(c.cleanup && c.dry_run);
}

#[test]
fn empty_bind_address_flag_disables_the_server() {
    let c = load(args(&[
        "--healthz-bind-address=",
        "--metrics-bind-address",
        "",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    assert_eq!(c.healthz_bind_address, None);
    assert_eq!(c.metrics_bind_address, None);
    // A bare IP takes the default port; IPv6 bindAddress moves the defaults.
    let c = load(args(&[
        "--healthz-bind-address",
        "127.0.0.1",
        "--bind-address",
        "::",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    assert_eq!(
        c.healthz_bind_address,
        Some("127.0.0.1:10256".parse::<SocketAddr>().unwrap())
    );
    assert_eq!(
        c.metrics_bind_address,
        Some("[::1]:10249".parse::<SocketAddr>().unwrap())
    );
}

#[test]
fn our_flags_and_accepted_upstream_flags() {
    let c = load(args(&[
        "--manifests",
        "/srv/manifests",
        "--service-proxy-name",
        "mine",
        "--master",
        "https://127.0.0.1:6443",
        "--kubeconfig",
        "/etc/kp.conf",
        "--oom-score-adj",
        "-500",
        "--feature-gates",
        "A=true,B=false",
        "--conntrack-max-per-core",
        "0",
        "--conntrack-tcp-timeout-established",
        "12h",
        "--ipvs-scheduler",
        "rr",
        "--ipvs-exclude-cidrs",
        "10.0.0.0/8,fd00::/8",
        "--ipvs-strict-arp",
        "--ipvs-tcp-timeout",
        "900s",
        "--config-sync-period",
        "1h2m3s",
        "--logging-format",
        "json",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    assert_eq!(c.manifests, Some(PathBuf::from("/srv/manifests")));
    assert_eq!(c.service_proxy_name.as_deref(), Some("mine"));
    assert_eq!(c.master.as_deref(), Some("https://127.0.0.1:6443"));
    assert_eq!(c.kubeconfig, Some(PathBuf::from("/etc/kp.conf")));
    assert_eq!(c.oom_score_adj, -500);
    assert_eq!(c.feature_gates.get("A"), Some(&true));
    assert_eq!(c.feature_gates.get("B"), Some(&false));
    assert_eq!(c.conntrack.max_per_core, 0);
    assert_eq!(
        c.conntrack.tcp_established_timeout,
        Duration::from_secs(43200)
    );
    assert_eq!(c.ipvs.scheduler, "rr");
    assert_eq!(
        c.ipvs.exclude_cidrs,
        vec![net("10.0.0.0/8"), net("fd00::/8")]
    );
    assert!(c.ipvs.strict_arp);
    assert_eq!(c.ipvs.tcp_timeout, Duration::from_secs(900));
    assert_eq!(c.config_sync_period, Duration::from_secs(3723));
    assert!(c.log_json);
}

#[test]
fn local_detector_modes() {
    let c = load(args(&[
        "--cluster-cidr",
        "10.0.0.0/16",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    assert_eq!(
        c.local_detector(IpFamily::V4),
        LocalDetector::Cidrs(vec![net("10.0.0.0/16")])
    );
    assert_eq!(c.local_detector(IpFamily::V6), LocalDetector::None);

    let c = load(args(&[
        "--detect-local-mode",
        "NodeCIDR",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    let pods = [net("10.0.5.0/24"), net("fd00:5::/64")];
    assert_eq!(
        c.local_detector_with_pod_cidrs(IpFamily::V6, &pods),
        LocalDetector::Cidrs(vec![net("fd00:5::/64")])
    );
    assert_eq!(c.local_detector(IpFamily::V4), LocalDetector::None);

    let c = load(args(&[
        "--detect-local-mode",
        "BridgeInterface",
        "--pod-bridge-interface",
        "cbr0",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    assert_eq!(
        c.local_detector(IpFamily::V4),
        LocalDetector::BridgeInterface("cbr0".into())
    );
    let c = load(args(&[
        "--detect-local-mode",
        "InterfaceNamePrefix",
        "--pod-interface-name-prefix",
        "veth",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    assert_eq!(
        c.local_detector(IpFamily::V6),
        LocalDetector::InterfaceNamePrefix("veth".into())
    );
    let err = load(args(&[
        "--detect-local-mode",
        "InterfaceNamePrefix",
        "--hostname-override",
        "n",
    ]))
    .unwrap_err();
    assert!(err.to_string().contains("interfaceNamePrefix"), "{err}");
}

#[test]
fn nodeport_addresses_per_family() {
    let mut c = load(args(&[
        "--proxy-mode",
        "nftables",
        "--nodeport-addresses",
        "primary,10.0.0.0/8",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    assert!(c.nodeport_primary);
    assert_eq!(c.nodeport_addresses, vec![net("10.0.0.0/8")]);
    // The host's addresses (a bridge, a VIP beside the node's own) are not
    // the Node's primary IPs: only the latter take NodePorts.
    let ips: Vec<IpAddr> = vec![
        "172.16.0.5".parse().unwrap(),
        "172.17.0.1".parse().unwrap(),
        "fd00::5".parse().unwrap(),
    ];
    let pc = c.proxier_config(IpFamily::V4, &ips, &[]);
    assert_eq!(pc.nodeport_addresses, vec![net("10.0.0.0/8")]);
    c.node_primary_ips = vec![ips[0], ips[2]];
    let pc = c.proxier_config(IpFamily::V4, &ips, &[]);
    assert_eq!(
        pc.nodeport_addresses,
        vec![net("10.0.0.0/8"), net("172.16.0.5/32")]
    );
    assert_eq!(pc.node_ips, vec![ips[0], ips[1]]);
    assert_eq!(pc.masquerade_bit, 14);
    assert!(
        !pc.localhost_nodeports,
        "only iptables mode serves localhost"
    );
    let pc6 = c.proxier_config(IpFamily::V6, &ips, &[]);
    assert_eq!(pc6.nodeport_addresses, vec![net("fd00::5/128")]);
    // A loopback primary IP (upstream's fallback when no Node IP is known)
    // is left out: every local address, as upstream.
    c.node_primary_ips = vec!["::1".parse().unwrap()];
    assert!(c.nodeport_addresses_for(IpFamily::V6).is_empty());

    let c = load(args(&[
        "--nodeport-addresses",
        "all",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    assert!(c.nodeport_addresses_for(IpFamily::V4).is_empty());
    let c = load(args(&[
        "--nodeport-addresses",
        "10.0.0.0/8",
        "--proxy-mode",
        "iptables",
        "--hostname-override",
        "n",
    ]))
    .unwrap();
    // No CIDR of the family means every address, as upstream.
    assert!(c.nodeport_addresses_for(IpFamily::V6).is_empty());
    assert!(
        c.proxier_config(IpFamily::V4, &ips, &[])
            .localhost_nodeports
    );
}

#[test]
fn write_config_round_trips() {
    let dir = TempDir::new("roundtrip");
    let out = dir.0.join("written.yaml");
    let first = load(args(&[
        "--proxy-mode",
        "iptables",
        "--cluster-cidr",
        "10.244.0.0/16,fd00:10:244::/56",
        "--hostname-override",
        "node-7",
        "--iptables-sync-period",
        "45s",
        "--iptables-masquerade-bit",
        "9",
        "--nodeport-addresses",
        "primary,192.0.2.0/24",
        "--kubeconfig",
        "/etc/kp/kubeconfig",
        "--conntrack-min",
        "1000",
        "--feature-gates",
        "X=true",
        "-v",
        "4",
        "--log-format",
        "json",
        "--write-config-to",
        out.to_str().unwrap(),
    ]))
    .unwrap();
    assert_eq!(first.write_config_to.as_deref(), Some(out.as_path()));
    first.write_config(&out).unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("kind: KubeProxyConfiguration"), "{text}");
    assert!(text.contains("kubeproxy.config.k8s.io/v1alpha1"), "{text}");
    assert!(text.contains("clusterCIDR"), "{text}");

    let mut second = load(args(&["--config", out.to_str().unwrap()])).unwrap();
    assert_eq!(second.config_file.as_deref(), Some(out.as_path()));
    second.config_file = None;
    assert!(second.config_file_digest.is_some());
    second.config_file_digest = None;
    let mut first = first;
    first.write_config_to = None;
    assert_eq!(first, second);
    assert_eq!(second.sync_period, Duration::from_secs(45));
    assert_eq!(second.masquerade_bit, 9);

    // The JSON form (for /configz) has the same content.
    let json = second.to_configuration_json();
    assert_eq!(json["mode"], "iptables");
    assert_eq!(json["iptables"]["syncPeriod"], "45s");
    assert_eq!(json["clusterCIDR"], "10.244.0.0/16,fd00:10:244::/56");
}

#[test]
fn go_duration_cases() {
    for (s, d) in [
        ("30s", Duration::from_secs(30)),
        ("1m0s", Duration::from_secs(60)),
        ("15m", Duration::from_secs(900)),
        ("500ms", Duration::from_millis(500)),
        ("1h2m3s", Duration::from_secs(3723)),
        ("1.25s", Duration::from_millis(1250)),
        ("0", Duration::ZERO),
    ] {
        assert_eq!(parse_go_duration(s).unwrap(), d, "{s}");
    }
    for bad in ["", "30", "1d", "1m-1s", "-5s", "m"] {
        assert!(parse_go_duration(bad).is_err(), "{bad}");
    }
    assert_eq!(format_go_duration(Duration::from_secs(900)), "15m0s");
    assert_eq!(format_go_duration(Duration::from_secs(30)), "30s");
    assert_eq!(format_go_duration(Duration::from_millis(1500)), "1.5s");
}

#[test]
fn iptables_backend_flag_and_env() {
    use kp_iptables::Variant;
    assert_eq!(load(args(&[])).unwrap().iptables_backend, None);
    let c = load(args(&["--iptables-backend=legacy"])).unwrap();
    assert_eq!(c.iptables_backend, Some(Variant::Legacy));
    let c = load(args(&["--iptables-backend", "nft"])).unwrap();
    assert_eq!(c.iptables_backend, Some(Variant::Nft));
    assert_eq!(
        load(args(&["--iptables-backend=auto"]))
            .unwrap()
            .iptables_backend,
        None
    );
    assert!(matches!(
        load(args(&["--iptables-backend=xtables"])),
        Err(ConfigError::Cli(_))
    ));
    // The environment variable (no other test reads it); a flag wins over it.
    std::env::set_var("KUBE_PROXY_RS_IPTABLES_BACKEND", "legacy");
    let from_env = load(args(&[])).map(|c| c.iptables_backend);
    let flag_wins = load(args(&["--iptables-backend=nft"])).map(|c| c.iptables_backend);
    std::env::remove_var("KUBE_PROXY_RS_IPTABLES_BACKEND");
    assert_eq!(from_env.unwrap(), Some(Variant::Legacy));
    assert_eq!(flag_wins.unwrap(), Some(Variant::Nft));
}

/// The refusals docs/migrate-from-kube-proxy.md names.
#[test]
fn refusals_named_in_the_migration_guide() {
    for bad in [
        vec!["--proxy-port-range=30000-32767"],
        vec!["--proxy-mode=kernelspace"],
        vec!["--iptables-masquerade-bit=40"],
        vec!["--cluster-cidr=10.244.0.0/16,10.245.0.0/16"],
    ] {
        assert!(load(args(&bad)).is_err(), "{bad:?} was accepted");
    }
    // A misspelt field is no refusal (upstream reads leniently) but is named.
    let c = load_file(
        "refusals",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables:\n  masqueradBit: 14\n",
        &[],
    )
    .unwrap();
    assert!(
        c.load_warnings
            .iter()
            .any(|w| w.contains("iptables.masqueradBit")),
        "the warning names the field: {:?}",
        c.load_warnings
    );
}

/// An explicit 0 for the conntrack TCP timeouts means "leave the node's
/// sysctl as it is" (upstream's pointer fields and flags), in the file and
/// on the command line; unset takes upstream's defaults (24 h, 1 h).
/// Found by the e2e lab: the init container wrote 86400 and 3600 over 0s.
#[test]
fn zero_conntrack_tcp_timeouts_are_kept() {
    let yaml = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                conntrack:\n  tcpEstablishedTimeout: 0s\n  tcpCloseWaitTimeout: 0s\n";
    let c = load_file("ct0", yaml, &["--hostname-override", "n1"]).unwrap();
    assert_eq!(c.conntrack.tcp_established_timeout, Duration::ZERO);
    assert_eq!(c.conntrack.tcp_close_wait_timeout, Duration::ZERO);
    let c = load(args(&[
        "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0s",
        "--hostname-override",
        "n1",
    ]))
    .unwrap();
    assert_eq!(c.conntrack.tcp_established_timeout, Duration::ZERO);
    assert_eq!(c.conntrack.tcp_close_wait_timeout, Duration::ZERO);
    let c = load(args(&["--hostname-override", "n1"])).unwrap();
    assert_eq!(
        c.conntrack.tcp_established_timeout,
        Duration::from_secs(24 * 3600)
    );
    assert_eq!(
        c.conntrack.tcp_close_wait_timeout,
        Duration::from_secs(3600)
    );
}

/// The configuration of `--proxy-mode nftables --socket-lb` and `extra`.
fn with_socket_lb(extra: &[&str]) -> Result<ProxyConfig, ConfigError> {
    let mut a = vec![
        "--proxy-mode",
        "nftables",
        "--socket-lb",
        "--hostname-override",
        "n",
    ];
    a.extend_from_slice(extra);
    load(args(&a))
}

/// `--bpf-lb-mode` (DSR): snat by default, one of snat/dsr/hybrid, and only
/// with --bpf-nodeport, whose programs it changes.
#[test]
fn bpf_lb_mode_needs_the_tc_programs() {
    let with = with_socket_lb;
    assert_eq!(with(&[]).unwrap().socket_lb.bpf_lb_mode, "snat");
    for mode in ["dsr", "hybrid"] {
        let flag = format!("--bpf-lb-mode={mode}");
        let c = with(&["--bpf-nodeport", &flag]).unwrap();
        assert_eq!(c.socket_lb.bpf_lb_mode, mode);
        let err = with(&[&flag]).unwrap_err();
        assert!(err.to_string().contains("--bpf-lb-mode"), "{err}");
    }
    let err = with(&["--bpf-nodeport", "--bpf-lb-mode=tunnel"]).unwrap_err();
    assert!(matches!(err, ConfigError::Cli(_)), "{err}");
}

/// `--bpf-lb-acceleration` (XDP): disabled by default, one of disabled /
/// native / best-effort (Cilium's values), and only with --bpf-nodeport,
/// whose programs it adds to.
#[test]
fn bpf_lb_acceleration_needs_the_tc_programs() {
    let with = with_socket_lb;
    assert_eq!(with(&[]).unwrap().socket_lb.bpf_lb_acceleration, "disabled");
    for value in ["native", "best-effort"] {
        let flag = format!("--bpf-lb-acceleration={value}");
        let c = with(&["--bpf-nodeport", &flag]).unwrap();
        assert_eq!(c.socket_lb.bpf_lb_acceleration, value);
        let err = with(&[&flag]).unwrap_err();
        assert!(err.to_string().contains("--bpf-lb-acceleration"), "{err}");
    }
    let err = with(&["--bpf-nodeport", "--bpf-lb-acceleration=generic"]).unwrap_err();
    assert!(matches!(err, ConfigError::Cli(_)), "{err}");
}

/// A default is written once, in the flag: every flag bound into the file,
/// given at its own default, writes the configuration that leaving it out
/// does (the file's unset fields take the flags' defaults). The exceptions
/// are named: the logging fields stay unset in the file until given, and an
/// unset ipvs.minSyncPeriod is 0 while --ipvs-min-sync-period shows 1s.
#[test]
fn a_flag_at_its_default_changes_nothing() {
    use clap::CommandFactory;
    use kube_proxy_rs::config::Cli;

    let base = load(args(&["--hostname-override=n1"]))
        .unwrap()
        .configuration;
    let cmd = Cli::command();
    let mut differ = Vec::new();
    let mut no_default = Vec::new();
    for (id, _) in Cli::bound_flags() {
        let arg = cmd.get_arguments().find(|a| a.get_id() == id).unwrap();
        let long = arg.get_long().unwrap();
        let Some(default) = arg.get_default_values().first() else {
            no_default.push(long);
            continue;
        };
        let flag = format!("--{long}={}", default.to_string_lossy());
        let mut list = vec!["--hostname-override=n1"];
        if id != "hostname_override" {
            list.push(&flag);
        }
        let got = load(args(&list)).unwrap().configuration;
        if got != base {
            differ.push(long);
        }
    }
    assert_eq!(differ, ["ipvs-min-sync-period", "v", "log-format"]);
    assert_eq!(
        no_default,
        ["kubeconfig", "nodeport-addresses", "ipvs-exclude-cidrs"]
    );
}

/// Issue 51's rule over the whole flag table: with `--config`, every flag
/// bound into the file is ignored and named in the warning, but the logging
/// flags and --hostname-override, which apply over the file.
#[test]
fn with_config_every_bound_flag_but_logging_and_hostname_is_named() {
    use clap::CommandFactory;
    use kube_proxy_rs::config::Cli;

    let cmd = Cli::command();
    let mut given = Vec::new();
    let mut want = Vec::new();
    for (id, over) in Cli::bound_flags() {
        let arg = cmd.get_arguments().find(|a| a.get_id() == id).unwrap();
        let long = arg.get_long().unwrap();
        let value = match id {
            "hostname_override" => "From-Flag".to_string(),
            "verbosity" => "4".to_string(),
            "log_format" => "json".to_string(),
            "kubeconfig" => "/nowhere/kubeconfig".to_string(),
            "nodeport_addresses" => "10.9.0.0/16".to_string(),
            "ipvs_exclude_cidrs" => "10.8.0.0/16".to_string(),
            _ => arg.get_default_values()[0].to_string_lossy().into_owned(),
        };
        given.push(format!("--{long}={value}"));
        if !over {
            want.push(format!("--{long}"));
        }
    }
    let yaml = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
    let given: Vec<&str> = given.iter().map(String::as_str).collect();
    let c = load_file("table", yaml, &given).unwrap();
    assert_eq!(c.hostname, "from-flag");
    assert_eq!(c.verbosity, 4);
    assert!(c.log_json);
    assert_eq!(c.kubeconfig, None);
    assert!(c.nodeport_addresses.is_empty());
    assert_eq!(c.load_warnings.len(), 1, "{:?}", c.load_warnings);
    let named: Vec<&str> = c.load_warnings[0]
        .rsplit(": ")
        .next()
        .unwrap()
        .split(' ')
        .collect();
    assert_eq!(named, want);
    assert_eq!(named.len() + 3, Cli::bound_flags().len());
}
