//! Address claims: each Service's claims on its addresses in the index
//! (with the host's listeners), and the ports as programmed once the claims
//! it lost are taken out (see [`crate::claims`]).

use std::collections::{BTreeSet, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use super::ChangeTracker;
use crate::claims::{claims_of, effective_port, AddressKey, Claimant, RefusedClaim};
use crate::types::{ServiceName, ServicePort, ServicePortName};

impl ChangeTracker {
    /// Sets the node addresses and ports that host processes listen on:
    /// externalIPs and LoadBalancer IPs there are refused (see
    /// [`crate::claims`]). The caller finds them (this crate does no I/O);
    /// the Services whose claims this changes are recomputed at the next
    /// [`Self::take_changes`].
    pub fn set_host_reserved(&mut self, reserved: BTreeSet<AddressKey>) {
        if reserved == self.reserved {
            return;
        }
        for k in self.reserved.symmetric_difference(&reserved) {
            self.touched.insert(*k);
        }
        for k in self.reserved.difference(&reserved) {
            self.claims.remove(k, &Claimant::host());
        }
        for k in reserved.difference(&self.reserved) {
            self.claims.add(*k, Claimant::host());
        }
        self.reserved = reserved;
    }

    /// Every externalIP and LoadBalancer IP some Service claims: what a
    /// caller needs to check against the host's listeners.
    pub fn claimed_external_ips(&self) -> BTreeSet<IpAddr> {
        self.services
            .values()
            .flatten()
            .flat_map(|p| p.external_ips.iter().chain(p.load_balancer_ips.iter()))
            .copied()
            .collect()
    }

    /// Re-indexes the claims of the Services whose object changed and returns
    /// every Service whose programmed ports may differ: those and all other
    /// claimants of the addresses they (or the reserved set) touched.
    pub(super) fn update_claims(&mut self, changed: Vec<ServiceName>) -> HashSet<ServiceName> {
        let mut touched = std::mem::take(&mut self.touched);
        for svc in &changed {
            let old = self.service_claims.remove(svc).unwrap_or_default();
            let created = self.created.get(svc).copied().unwrap_or_default();
            let mut new: Vec<(AddressKey, Claimant)> = self
                .services
                .get(svc)
                .into_iter()
                .flatten()
                .flat_map(|p| claims_of(p, created))
                .collect();
            if new == old {
                // Its ports changed, not its addresses: no other
                // claimant's standing moved (at 100k Services, re-checking
                // the Services sharing a contested address on every
                // change was a 3 ms p99).
                if !old.is_empty() {
                    self.service_claims.insert(svc.clone(), old);
                }
                continue;
            }
            for (k, c) in old {
                self.claims.remove(&k, &c);
                touched.insert(k);
            }
            // Kept as long as the Service: collecting made room for four.
            new.shrink_to_fit();
            for (k, c) in &new {
                self.claims.add(*k, c.clone());
                touched.insert(*k);
            }
            if !new.is_empty() {
                self.service_claims.insert(svc.clone(), new);
            }
        }
        let mut todo: HashSet<ServiceName> = changed.into_iter().collect();
        for k in &touched {
            for c in self.claims.claimants(k) {
                if let Some(o) = &c.owner {
                    todo.insert(o.service.clone());
                }
            }
        }
        todo
    }

    /// `svc`'s ports as programmed (addresses it lost removed), and the
    /// claims that started losing since the last time.
    pub(super) fn effective_ports(
        &mut self,
        svc: &ServiceName,
        refused: &mut Vec<RefusedClaim>,
    ) -> Vec<Arc<ServicePort>> {
        let declared = self.services.get(svc).cloned().unwrap_or_default();
        let created = self.created.get(svc).copied().unwrap_or_default();
        let mut out = Vec::with_capacity(declared.len());
        for p in &declared {
            let lost: BTreeSet<AddressKey> = claims_of(p, created)
                .into_iter()
                .map(|(k, _)| k)
                .filter(|k| !self.claims.owns(k, &p.name))
                .collect();
            let before = self.refused.get(&p.name);
            for k in &lost {
                if before.is_none_or(|b| !b.contains(k)) {
                    refused.push(RefusedClaim {
                        service: p.name.clone(),
                        address: *k,
                        holder: self.claims.winner(k).and_then(|c| c.owner.clone()),
                    });
                }
            }
            if lost.is_empty() {
                self.refused.remove(&p.name);
                out.push(Arc::clone(p));
                continue;
            }
            self.refused.insert(p.name.clone(), lost);
            if let Some(e) = effective_port(p, &self.claims) {
                out.push(Arc::new(e));
            }
        }
        // Ports that went away take their refusals with them.
        let names: BTreeSet<&ServicePortName> = declared.iter().map(|p| &p.name).collect();
        let gone: Vec<ServicePortName> = self
            .refused
            .range(ServicePortName::first_of(svc)..)
            .take_while(|(k, _)| k.service == *svc)
            .filter(|(k, _)| !names.contains(k))
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.refused.remove(&k);
        }
        out
    }
}
