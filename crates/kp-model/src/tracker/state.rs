//! What the dataplanes program.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::types::{Endpoint, IpFamily, NodeInfo, ServicePort, ServicePortName};

/// What the dataplanes program: every service port of one family and its endpoints.
#[derive(Clone, Debug)]
pub struct ProxyState {
    pub family: IpFamily,
    pub node: NodeInfo,
    pub services: BTreeMap<ServicePortName, Arc<ServicePort>>,
    /// All endpoints from the slices, merged and de-duplicated; use
    /// [`crate::categorize_endpoints`] to pick the ones traffic goes to.
    pub endpoints: HashMap<ServicePortName, Arc<Vec<Endpoint>>>,
    /// This family's Service ranges, from the cluster's ServiceCIDR objects
    /// (sorted, each once): traffic to an address there that no Service
    /// holds is dropped by the nftables dataplane, as upstream's.
    pub service_cidrs: Vec<ipnet::IpNet>,
}

impl ProxyState {
    pub fn new(family: IpFamily, node: NodeInfo) -> Self {
        ProxyState {
            family,
            node,
            services: BTreeMap::new(),
            endpoints: HashMap::new(),
            service_cidrs: Vec::new(),
        }
    }
    pub fn endpoints_of(&self, name: &ServicePortName) -> &[Endpoint] {
        self.endpoints
            .get(name)
            .map(|v| v.as_slice())
            .unwrap_or(&[])
    }
}
