//! The Service as the proxy reads it: metadata, spec and the load balancer's
//! status, nothing else. k8s-openapi's `Service` also types
//! `status.conditions`, whose `lastTransitionTime` it requires; the API
//! server accepts a condition without one (written as `null`, as e2e's
//! "should complete a service status lifecycle" does), and one such Service
//! made every Service list and watch event fail to decode: the whole
//! Service watch failed while it existed. The proxy never reads conditions.

use std::borrow::Cow;

use k8s_openapi::api::core::v1::{LoadBalancerStatus, Service, ServiceSpec, ServiceStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::NamespaceResourceScope;
use serde::Deserialize;

/// A Service with only the parts the proxy reads (unknown fields ignored).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ProxiedService {
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: Option<ServiceSpec>,
    pub status: Option<ProxiedServiceStatus>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxiedServiceStatus {
    pub load_balancer: Option<LoadBalancerStatus>,
}

impl kube::Resource for ProxiedService {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Service".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "services".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl From<ProxiedService> for Service {
    fn from(s: ProxiedService) -> Service {
        Service {
            metadata: s.metadata,
            spec: s.spec,
            status: s.status.map(|st| ServiceStatus {
                load_balancer: st.load_balancer,
                conditions: None,
            }),
        }
    }
}

/// `v` read as a Service the way the API source reads one.
pub fn service_from_value(v: serde_json::Value) -> Result<Service, serde_json::Error> {
    serde_json::from_value::<ProxiedService>(v).map(Service::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What the API server serves after e2e's status update: a condition
    /// without lastTransitionTime.
    #[test]
    fn a_condition_without_its_time_does_not_stop_the_service() {
        let v = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": "ns", "name": "web", "resourceVersion": "7"},
            "spec": {"clusterIP": "10.96.0.9", "ports": [{"port": 80}]},
            "status": {
                "loadBalancer": {"ingress": [{"ip": "203.0.113.1"}]},
                "conditions": [{"type": "StatusUpdate", "status": "True", "reason": "E2E",
                                "message": "Set from e2e test", "lastTransitionTime": null}]
            }
        });
        assert!(serde_json::from_value::<Service>(v.clone()).is_err());
        let s = service_from_value(v).unwrap();
        assert_eq!(s.metadata.name.as_deref(), Some("web"));
        assert_eq!(
            s.spec.and_then(|sp| sp.cluster_ip).as_deref(),
            Some("10.96.0.9")
        );
        let ingress = s
            .status
            .and_then(|st| st.load_balancer)
            .and_then(|lb| lb.ingress)
            .unwrap_or_default();
        assert_eq!(ingress[0].ip.as_deref(), Some("203.0.113.1"));
    }
}
