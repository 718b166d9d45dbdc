//! ServiceCIDRs: this family's Service ranges, from the cluster's objects.

use std::collections::BTreeSet;

use k8s_openapi::api::networking::v1::ServiceCIDR;

use super::ChangeTracker;
use crate::convert::convert_service_cidr;

impl ChangeTracker {
    /// Adds or replaces a ServiceCIDR object. Returns whether this family's
    /// Service ranges changed (the caller then syncs), and warnings about
    /// ranges that were skipped.
    pub fn update_service_cidr(&mut self, obj: &ServiceCIDR) -> (bool, Vec<String>) {
        let mut warnings = Vec::new();
        let name = obj.metadata.name.clone().unwrap_or_default();
        let fam = self.cfg.family;
        let mine: Vec<ipnet::IpNet> = convert_service_cidr(obj, &mut warnings)
            .into_iter()
            .filter(|n| fam.matches(&n.addr()))
            .collect();
        if mine.is_empty() {
            self.service_cidrs.remove(&name);
        } else {
            self.service_cidrs.insert(name, mine);
        }
        (self.refresh_service_cidrs(), warnings)
    }

    /// Forgets the ServiceCIDR object `name`. Returns whether this family's
    /// Service ranges changed.
    pub fn delete_service_cidr(&mut self, name: &str) -> bool {
        self.service_cidrs.remove(name);
        self.refresh_service_cidrs()
    }

    /// Recomputes the state's ranges from the objects; true if they changed.
    fn refresh_service_cidrs(&mut self) -> bool {
        let all: BTreeSet<ipnet::IpNet> = self.service_cidrs.values().flatten().copied().collect();
        let all: Vec<ipnet::IpNet> = all.into_iter().collect();
        if all == self.state.service_cidrs {
            return false;
        }
        self.state.service_cidrs = all;
        true
    }
}
