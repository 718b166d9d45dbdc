//! The component-base series every Kubernetes component exports:
//! `kubernetes_build_info` and `kubernetes_feature_enabled`.
//!
//! build_info: `major`/`minor` and the start of `git_version` name the
//! Kubernetes release whose kube-proxy this one replaces (kubernetes-mixin's
//! KubeVersionMismatch alert compares `git_version` cut to "vMAJOR.MINOR"
//! across components, so a drop-in must say v1.36 there); the rest of
//! `git_version` says honestly that it is kube-proxy-rs and which version.
//! The proxy dashboard filters by job and instance only.

use std::collections::BTreeMap;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The upstream release this proxy is a drop-in for.
pub const KUBERNETES_VERSION: &str = "1.36.2";

type GaugeVec = Family<Vec<(&'static str, String)>, Gauge>;

/// `git_version`: "v1.36.2-kube-proxy-rs-0.1.0".
pub fn git_version() -> String {
    format!(
        "v{KUBERNETES_VERSION}-kube-proxy-rs-{}",
        env!("CARGO_PKG_VERSION")
    )
}

/// Go's GOOS/GOARCH spelling of the platform, as upstream labels it.
pub fn platform() -> String {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    };
    format!("{}/{arch}", std::env::consts::OS)
}

/// Every feature gate kube-proxy v1.36.2 knows (its /metrics lists them
/// all, most of them other components'): name, stage ("" once GA, locked),
/// default.
pub const FEATURE_GATES: &[(&str, &str, bool)] = &[
    ("APIResponseCompression", "BETA", true),
    ("APIServerIdentity", "BETA", true),
    ("APIServerTracing", "", true),
    ("APIServingWithRoutine", "ALPHA", false),
    ("AggregatedDiscoveryRemoveBetaType", "DEPRECATED", true),
    ("AllAlpha", "ALPHA", false),
    ("AllBeta", "BETA", false),
    ("AllowDNSOnlyNodeCSR", "DEPRECATED", false),
    (
        "AllowInsecureKubeletCertificateSigningRequests",
        "DEPRECATED",
        false,
    ),
    (
        "AllowOverwriteTerminationGracePeriodSeconds",
        "DEPRECATED",
        false,
    ),
    ("AllowParsingUserUIDFromCertAuth", "BETA", true),
    ("AllowServiceExternalIPs", "", true),
    ("AllowUnsafeMalformedObjectDeletion", "ALPHA", false),
    ("AnonymousAuthConfigurableEndpoints", "", true),
    ("AnyVolumeDataSource", "", true),
    ("AtomicFIFO", "BETA", true),
    ("AuthorizeNodeWithSelectors", "", true),
    ("AuthorizePodWebsocketUpgradeCreatePermission", "BETA", true),
    ("AuthorizeWithSelectors", "", true),
    ("BtreeWatchCache", "", true),
    ("CBORServingAndStorage", "ALPHA", false),
    ("CPUManagerPolicyAlphaOptions", "ALPHA", false),
    ("CPUManagerPolicyBetaOptions", "BETA", true),
    ("CPUManagerPolicyOptions", "", true),
    ("CRDObservedGenerationTracking", "BETA", true),
    ("CRDValidationRatcheting", "", true),
    ("CRIListStreaming", "ALPHA", false),
    ("CSIServiceAccountTokenSecrets", "", true),
    ("CSIVolumeHealth", "ALPHA", false),
    ("ChangeContainerStatusOnKubeletRestart", "DEPRECATED", false),
    ("ClearingNominatedNodeNameAfterBinding", "BETA", true),
    ("ClientsAllowCARotation", "BETA", true),
    ("ClientsAllowCBOR", "ALPHA", false),
    ("ClientsAllowTLSCacheGC", "BETA", true),
    ("ClientsPreferCBOR", "ALPHA", false),
    (
        "CloudControllerManagerWatchBasedRoutesReconciliation",
        "ALPHA",
        false,
    ),
    ("CloudControllerManagerWebhook", "ALPHA", false),
    ("ClusterTrustBundle", "BETA", false),
    ("ClusterTrustBundleProjection", "BETA", false),
    ("ComponentFlagz", "BETA", true),
    ("ComponentStatusz", "BETA", true),
    ("ConcurrentWatchObjectDecode", "BETA", false),
    ("ConsistentListFromCache", "", true),
    ("ConstrainedImpersonation", "BETA", true),
    ("ContainerCheckpoint", "BETA", true),
    ("ContainerRestartRules", "BETA", true),
    ("ContainerStopSignals", "ALPHA", false),
    ("ContextualLogging", "BETA", true),
    (
        "ControllerManagerReleaseLeaderElectionLockOnExit",
        "ALPHA",
        false,
    ),
    ("CoordinatedLeaderElection", "BETA", false),
    ("CrossNamespaceVolumeDataSource", "ALPHA", false),
    ("CustomCPUCFSQuotaPeriod", "", true),
    ("CustomResourceFieldSelectors", "", true),
    ("DRAAdminAccess", "", true),
    ("DRAConsumableCapacity", "BETA", true),
    ("DRADeviceBindingConditions", "BETA", true),
    ("DRADeviceTaintRules", "BETA", false),
    ("DRADeviceTaints", "BETA", true),
    ("DRAExtendedResource", "BETA", true),
    ("DRAListTypeAttributes", "ALPHA", false),
    ("DRANodeAllocatableResources", "ALPHA", false),
    ("DRAPartitionableDevices", "BETA", true),
    ("DRAPrioritizedList", "", true),
    ("DRAResourceClaimDeviceStatus", "BETA", true),
    ("DRAResourceClaimGranularStatusAuthorization", "BETA", true),
    ("DRAResourcePoolStatus", "ALPHA", false),
    ("DRASchedulerFilterTimeout", "BETA", true),
    ("DRAWorkloadResourceClaims", "ALPHA", false),
    ("DeclarativeValidation", "", true),
    ("DeclarativeValidationBeta", "BETA", true),
    ("DeclarativeValidationTakeover", "DEPRECATED", false),
    ("DeploymentReplicaSetTerminatingReplicas", "BETA", true),
    ("DetectCacheInconsistency", "BETA", true),
    ("DisableAllocatorDualWrite", "", true),
    ("DisableCPUQuotaWithExclusiveCPUs", "DEPRECATED", true),
    ("DisableNodeKubeProxyVersion", "DEPRECATED", true),
    ("DynamicResourceAllocation", "", true),
    ("EnvFiles", "BETA", true),
    ("EventedPLEG", "ALPHA", false),
    ("ExecProbeTimeout", "", true),
    ("ExtendWebSocketsToKubelet", "BETA", true),
    ("ExternalServiceAccountTokenSigner", "", true),
    ("GangScheduling", "ALPHA", false),
    ("GenericWorkload", "ALPHA", false),
    ("GitRepoVolumeDriver", "DEPRECATED", false),
    ("GracefulNodeShutdown", "BETA", true),
    ("GracefulNodeShutdownBasedOnPodPriority", "BETA", true),
    ("HPAConfigurableTolerance", "BETA", true),
    ("HPAScaleToZero", "ALPHA", false),
    ("HostnameOverride", "BETA", true),
    ("ImageMaximumGCAge", "", true),
    ("ImageVolume", "", true),
    ("ImageVolumeWithDigest", "ALPHA", false),
    ("InOrderInformers", "", true),
    ("InOrderInformersBatchProcess", "BETA", true),
    ("InPlacePodLevelResourcesVerticalScaling", "BETA", true),
    ("InPlacePodVerticalScaling", "", true),
    ("InPlacePodVerticalScalingExclusiveCPUs", "ALPHA", false),
    ("InPlacePodVerticalScalingExclusiveMemory", "ALPHA", false),
    ("InPlacePodVerticalScalingInitContainers", "BETA", true),
    ("InformerResourceVersion", "", true),
    ("JobBackoffLimitPerIndex", "", true),
    ("JobManagedBy", "", true),
    ("JobPodReplacementPolicy", "", true),
    ("JobSuccessPolicy", "", true),
    ("KMSv1", "DEPRECATED", false),
    ("KubeletCgroupDriverFromCRI", "", true),
    ("KubeletCrashLoopBackOffMax", "BETA", true),
    ("KubeletEnsureSecretPulledImages", "BETA", true),
    ("KubeletFineGrainedAuthz", "", true),
    ("KubeletInUserNamespace", "ALPHA", false),
    ("KubeletPSI", "", true),
    ("KubeletPodResourcesDynamicResources", "", true),
    ("KubeletPodResourcesGet", "", true),
    ("KubeletPodResourcesListUseActivePods", "DEPRECATED", true),
    ("KubeletRegistrationGetOnExistsOnly", "DEPRECATED", false),
    ("KubeletSeparateDiskGC", "BETA", true),
    (
        "KubeletServiceAccountTokenForCredentialProviders",
        "BETA",
        true,
    ),
    ("KubeletTracing", "", true),
    ("ListFromCacheSnapshot", "BETA", true),
    (
        "LocalStorageCapacityIsolationFSQuotaMonitoring",
        "BETA",
        false,
    ),
    ("LogarithmicScaleDown", "", true),
    ("LoggingAlphaOptions", "ALPHA", false),
    ("LoggingBetaOptions", "BETA", true),
    ("ManifestBasedAdmissionControlConfig", "ALPHA", false),
    ("MatchLabelKeysInPodAffinity", "", true),
    ("MatchLabelKeysInPodTopologySpread", "BETA", true),
    (
        "MatchLabelKeysInPodTopologySpreadSelectorMerge",
        "BETA",
        true,
    ),
    ("MaxUnavailableStatefulSet", "BETA", false),
    ("MemoryQoS", "ALPHA", false),
    ("MinimumKubeletVersion", "ALPHA", false),
    ("MultiCIDRServiceAllocator", "", true),
    ("MutableCSINodeAllocatableCount", "", true),
    ("MutablePVNodeAffinity", "ALPHA", false),
    ("MutablePodResourcesForSuspendedJobs", "BETA", true),
    ("MutableSchedulingDirectivesForSuspendedJobs", "BETA", true),
    ("MutatingAdmissionPolicy", "", true),
    ("NFTablesProxyMode", "", true),
    ("NativeHistograms", "ALPHA", false),
    ("NodeDeclaredFeatures", "BETA", true),
    ("NodeInclusionPolicyInPodTopologySpread", "", true),
    ("NodeLogQuery", "", true),
    ("NodeSwap", "", true),
    ("NominatedNodeNameForExpectation", "BETA", true),
    ("OpenAPIEnums", "BETA", true),
    ("OpportunisticBatching", "BETA", true),
    ("OrderedNamespaceDeletion", "", true),
    ("PLEGOnDemandRelist", "BETA", true),
    ("PersistentVolumeClaimUnusedSinceTime", "ALPHA", false),
    ("PodAndContainerStatsFromCRI", "ALPHA", false),
    ("PodCertificateRequest", "BETA", false),
    ("PodDeletionCost", "BETA", true),
    ("PodLevelResourceManagers", "ALPHA", false),
    ("PodLevelResources", "BETA", true),
    ("PodLifecycleSleepAction", "", true),
    ("PodLifecycleSleepActionAllowZero", "", true),
    ("PodLogsQuerySplitStreams", "ALPHA", false),
    ("PodObservedGenerationTracking", "", true),
    ("PodReadyToStartContainersCondition", "BETA", true),
    ("PodSchedulingReadiness", "", true),
    ("PodTopologyLabelsAdmission", "BETA", true),
    ("PodsAPI", "ALPHA", false),
    ("PortForwardWebsockets", "BETA", true),
    ("PreferSameTrafficDistribution", "", true),
    ("PreventStaticPodAPIReferences", "BETA", true),
    ("ProcMountType", "", true),
    ("QOSReserved", "ALPHA", false),
    ("RecoverVolumeExpansionFailure", "", true),
    ("RecursiveReadOnlyMounts", "", true),
    ("ReduceDefaultCrashLoopBackOffDecay", "ALPHA", false),
    ("RelaxedDNSSearchValidation", "", true),
    ("RelaxedEnvironmentVariableValidation", "", true),
    ("RelaxedServiceNameValidation", "BETA", true),
    ("ReloadKubeletClientCAFile", "BETA", true),
    ("ReloadKubeletServerCertificateFile", "BETA", true),
    ("RemoteRequestHeaderUID", "BETA", true),
    ("ResilientWatchCacheInitialization", "", true),
    ("ResourceHealthStatus", "BETA", true),
    ("ResourceHealthStatusMessage", "BETA", true),
    ("RestartAllContainersOnContainerExits", "BETA", true),
    ("RetryGenerateName", "", true),
    ("RotateKubeletServerCertificate", "BETA", true),
    ("RouteExternalCertificate", "ALPHA", false),
    ("RuntimeClassInImageCriApi", "ALPHA", false),
    ("SELinuxChangePolicy", "", true),
    ("SELinuxMount", "BETA", false),
    ("SELinuxMountReadWriteOncePod", "", true),
    ("SchedulerAsyncAPICalls", "BETA", false),
    ("SchedulerAsyncPreemption", "BETA", true),
    ("SchedulerPopFromBackoffQ", "BETA", true),
    ("SchedulerQueueingHints", "", true),
    ("SeparateCacheWatchRPC", "DEPRECATED", false),
    ("SeparateTaintEvictionController", "", true),
    ("ServiceAccountNodeAudienceRestriction", "BETA", true),
    ("ServiceAccountTokenJTI", "", true),
    ("ServiceAccountTokenNodeBinding", "", true),
    ("ServiceAccountTokenNodeBindingValidation", "", true),
    ("ServiceAccountTokenPodNodeInfo", "", true),
    ("ServiceCIDRStatusFieldWiping", "DEPRECATED", true),
    ("ShardedListAndWatch", "ALPHA", false),
    ("SidecarContainers", "", true),
    ("SizeBasedListCostEstimate", "BETA", true),
    ("StaleControllerConsistencyDaemonSet", "BETA", true),
    ("StaleControllerConsistencyJob", "BETA", true),
    ("StaleControllerConsistencyReplicaSet", "BETA", true),
    ("StaleControllerConsistencyStatefulSet", "BETA", true),
    ("StatefulSetSemanticRevisionComparison", "BETA", true),
    ("StorageCapacityScoring", "ALPHA", false),
    ("StorageNamespaceIndex", "DEPRECATED", true),
    ("StoragePerformantSecurityPolicy", "ALPHA", false),
    ("StorageVersionAPI", "ALPHA", false),
    ("StorageVersionHash", "BETA", true),
    ("StorageVersionMigrator", "BETA", false),
    ("StreamingCollectionEncodingToJSON", "", true),
    ("StreamingCollectionEncodingToProtobuf", "", true),
    ("StrictIPCIDRValidation", "BETA", true),
    ("StructuredAuthenticationConfiguration", "", true),
    (
        "StructuredAuthenticationConfigurationEgressSelector",
        "BETA",
        true,
    ),
    (
        "StructuredAuthenticationConfigurationJWKSMetrics",
        "BETA",
        true,
    ),
    ("SupplementalGroupsPolicy", "", true),
    ("SystemdWatchdog", "", true),
    ("TaintTolerationComparisonOperators", "ALPHA", false),
    ("TokenRequestServiceAccountUIDValidation", "BETA", true),
    ("TopologyAwareWorkloadScheduling", "ALPHA", false),
    ("TopologyManagerPolicyAlphaOptions", "ALPHA", false),
    ("TopologyManagerPolicyBetaOptions", "BETA", true),
    ("TopologyManagerPolicyOptions", "", true),
    ("TranslateStreamCloseWebsocketRequests", "BETA", true),
    ("UnauthenticatedHTTP2DOSMitigation", "BETA", true),
    ("UnknownVersionInteroperabilityProxy", "BETA", true),
    ("UnlockWhileProcessingFIFO", "BETA", true),
    ("UserNamespacesHostNetworkSupport", "ALPHA", false),
    ("UserNamespacesSupport", "", true),
    ("VolumeAttributesClass", "", true),
    ("VolumeLimitScaling", "ALPHA", false),
    ("WatchCacheInitializationPostStartHook", "BETA", true),
    ("WatchList", "BETA", true),
    ("WatchListClient", "BETA", true),
    ("WinDSR", "", true),
    ("WinOverlay", "", true),
    ("WindowsCPUAndMemoryAffinity", "ALPHA", false),
    ("WindowsGracefulNodeShutdown", "BETA", true),
    ("WindowsHostNetwork", "DEPRECATED", false),
    ("WorkloadAwarePreemption", "ALPHA", false),
    ("WorkloadWithJob", "ALPHA", false),
];

/// Each gate's state given `--feature-gates` / `featureGates` overrides:
/// a GA gate is locked to its default (upstream refuses to change it),
/// `AllAlpha`/`AllBeta` set every alpha/beta gate not named explicitly.
/// Names kube-proxy does not know are left out, as upstream lists only its own.
pub fn feature_states(
    overrides: &BTreeMap<String, bool>,
) -> Vec<(&'static str, &'static str, bool)> {
    let all = |gate: &str| overrides.get(gate).copied();
    FEATURE_GATES
        .iter()
        .map(|&(name, stage, default)| {
            let enabled = if stage.is_empty() {
                default
            } else if let Some(v) = overrides.get(name) {
                *v
            } else {
                match stage {
                    "ALPHA" if name != "AllAlpha" => all("AllAlpha").unwrap_or(default),
                    "BETA" if name != "AllBeta" => all("AllBeta").unwrap_or(default),
                    _ => default,
                }
            };
            (name, stage, enabled)
        })
        .collect()
}

/// Registers both series; the returned family is what
/// [`set_feature_gates`] updates.
pub fn register(r: &mut Registry) -> GaugeVec {
    let build_info = GaugeVec::default();
    build_info
        .get_or_create(&vec![
            ("build_date", String::new()),
            ("compiler", "rustc".to_string()),
            ("git_commit", String::new()),
            ("git_tree_state", String::new()),
            ("git_version", git_version()),
            ("go_version", String::new()),
            ("major", major_minor().0),
            ("minor", major_minor().1),
            ("platform", platform()),
        ])
        .set(1);
    r.register(
        "kubernetes_build_info",
        "[BETA] A metric with a constant '1' value labeled by major, minor, git version, git commit, git tree state, build date, Go version, and compiler from which Kubernetes was built, and platform on which it is running.",
        build_info,
    );
    let features = GaugeVec::default();
    set_feature_gates(&features, &BTreeMap::new());
    r.register(
        "kubernetes_feature_enabled",
        "[BETA] This metric records the data about the stage and enablement of a k8s feature.",
        features.clone(),
    );
    features
}

fn major_minor() -> (String, String) {
    let mut parts = KUBERNETES_VERSION.split('.');
    let major = parts.next().unwrap_or_default().to_string();
    let minor = parts.next().unwrap_or_default().to_string();
    (major, minor)
}

/// Sets every gate's series from the effective overrides.
pub fn set_feature_gates(family: &GaugeVec, overrides: &BTreeMap<String, bool>) {
    for (name, stage, enabled) in feature_states(overrides) {
        family
            .get_or_create(&vec![
                ("name", name.to_string()),
                ("stage", stage.to_string()),
            ])
            .set(i64::from(enabled));
    }
}

/// Whether `gate` is on, as [`set_feature_gates`] last set it (false for
/// a gate kube-proxy does not know).
pub fn is_enabled(family: &GaugeVec, gate: &str) -> bool {
    FEATURE_GATES
        .iter()
        .find(|(name, _, _)| *name == gate)
        .is_some_and(|(name, stage, _)| {
            family
                .get_or_create(&vec![
                    ("name", name.to_string()),
                    ("stage", stage.to_string()),
                ])
                .get()
                == 1
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(overrides: &[(&str, bool)], gate: &str) -> bool {
        let o = overrides.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        feature_states(&o)
            .into_iter()
            .find(|(n, _, _)| *n == gate)
            .map(|(_, _, e)| e)
            .unwrap_or_else(|| panic!("no gate {gate}"))
    }

    #[test]
    fn overrides_apply_except_to_locked_gates() {
        // Beta, on by default.
        assert!(state(&[], "ComponentFlagz"));
        assert!(!state(&[("ComponentFlagz", false)], "ComponentFlagz"));
        // GA: locked.
        assert!(state(&[("NFTablesProxyMode", false)], "NFTablesProxyMode"));
        // Alpha, off by default; AllAlpha turns it on unless named.
        assert!(!state(&[], "NativeHistograms"));
        assert!(state(&[("AllAlpha", true)], "NativeHistograms"));
        assert!(!state(
            &[("AllAlpha", true), ("NativeHistograms", false)],
            "NativeHistograms"
        ));
        // AllBeta=false turns off a default-on beta gate.
        assert!(!state(&[("AllBeta", false)], "WatchListClient"));
    }

    #[test]
    fn build_info_names_the_release_it_replaces() {
        assert!(git_version().starts_with("v1.36."));
        assert_eq!(major_minor(), ("1".to_string(), "36".to_string()));
        assert!(platform().starts_with("linux/"));
    }
}
