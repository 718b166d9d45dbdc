//! EndpointSlices: each Service's converted slices, and the endpoints of a
//! service port merged across them.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::{ChangeTracker, Rejected};
use crate::convert::{convert_endpoint_slice_shared, SliceEndpoints};
use crate::rfc3339::parse_rfc3339;
use crate::types::{Endpoint, ServiceName, ServicePortName};

/// Set by the EndpointSlice controller: when the change that produced this slice
/// happened. Used for kubeproxy_network_programming_duration_seconds.
const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// One Service's converted slices, sorted by slice name (so merging is
/// deterministic). Most Services have one slice: a sorted Vec holds it in
/// ~80 bytes where a BTreeMap's first node took ~800.
#[derive(Default)]
pub(super) struct Slices(Vec<(String, SliceEndpoints)>);

impl Slices {
    fn find(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(n, _)| n.as_str().cmp(name))
    }
    fn get(&self, name: &str) -> Option<&SliceEndpoints> {
        self.find(name).ok().map(|i| &self.0[i].1)
    }
    fn insert(&mut self, name: String, slice: SliceEndpoints) {
        match self.find(&name) {
            Ok(i) => self.0[i].1 = slice,
            Err(i) => {
                self.0.reserve_exact(1);
                self.0.insert(i, (name, slice));
            }
        }
    }
    fn remove(&mut self, name: &str) {
        if let Ok(i) = self.find(name) {
            self.0.remove(i);
        }
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn values(&self) -> impl Iterator<Item = &SliceEndpoints> {
        self.0.iter().map(|(_, s)| s)
    }
}

impl ChangeTracker {
    /// Adds or replaces an EndpointSlice. On error the previous version stays.
    pub fn update_endpoint_slice(
        &mut self,
        slice: &EndpointSlice,
        now: SystemTime,
    ) -> Result<Vec<String>, Rejected> {
        let mut warnings = Vec::new();
        let conv = convert_endpoint_slice_shared(
            slice,
            self.cfg.family,
            &self.cfg.node_name,
            &mut warnings,
            &mut self.placements,
        )
        .map_err(Rejected)?;
        let ns = slice
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let sname = slice.metadata.name.clone().unwrap_or_default();
        let key = (ns, sname.clone());
        let trigger = slice
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(TRIGGER_TIME_ANNOTATION))
            .and_then(|t| parse_rfc3339(t))
            .unwrap_or(now);
        // A slice may have moved to another service (label change): drop it there.
        if let Some(old_owner) = self.slice_owner.get(&key).cloned() {
            if Some(&old_owner) != conv.service.as_ref() {
                self.remove_slice(&key, &old_owner);
                self.triggers.push(trigger);
            }
        }
        let Some(svc) = conv.service.clone() else {
            return Ok(warnings);
        };
        let entry = self.slices.entry(svc.clone()).or_default();
        if entry.get(&sname) != Some(&conv) {
            entry.insert(sname, conv);
            self.slice_owner.insert(key, svc.clone());
            self.endpoint_changes += 1;
            self.triggers.push(trigger);
            self.dirty.insert(svc);
        }
        Ok(warnings)
    }

    pub fn delete_endpoint_slice(&mut self, namespace: &str, name: &str, now: SystemTime) {
        let key = (namespace.to_string(), name.to_string());
        if let Some(owner) = self.slice_owner.get(&key).cloned() {
            self.remove_slice(&key, &owner);
            self.triggers.push(now);
        }
    }

    fn remove_slice(&mut self, key: &(String, String), owner: &ServiceName) {
        self.slice_owner.remove(key);
        if let Some(m) = self.slices.get_mut(owner) {
            m.remove(&key.1);
            if m.is_empty() {
                self.slices.remove(owner);
            }
        }
        self.endpoint_changes += 1;
        self.dirty.insert(owner.clone());
    }

    /// Merged endpoints of one service port across all slices of its service.
    pub(super) fn merged_endpoints(&self, spn: &ServicePortName) -> Arc<Vec<Endpoint>> {
        let lists: Vec<&Arc<Vec<Endpoint>>> = self
            .slices
            .get(&spn.service)
            .into_iter()
            .flat_map(|slices| slices.values())
            .flat_map(|slice| slice.ports.iter())
            .filter(|((pname, proto), _)| **pname == *spn.port && *proto == spn.protocol)
            .map(|(_, eps)| eps)
            .collect();
        // One slice without duplicates: share its list rather than copy it.
        if let [only] = lists.as_slice() {
            let mut seen = HashSet::with_capacity(only.len());
            if only.iter().all(|ep| seen.insert((ep.ip, ep.port))) {
                return Arc::clone(only);
            }
        }
        let mut out: Vec<Endpoint> = Vec::new();
        let mut index: HashMap<(IpAddr, u16), usize> = HashMap::new();
        for ep in lists.into_iter().flat_map(|eps| eps.iter()) {
            match index.get(&(ep.ip, ep.port)) {
                // Two slices disagree: favour a non-terminating copy
                // (an IP reused by a new pod while the old one
                // terminates, as upstream), then the local copy.
                Some(&i) => {
                    let cur = &out[i];
                    let better = (cur.terminating && !ep.terminating)
                        || (cur.terminating == ep.terminating && ep.is_local && !cur.is_local);
                    if better {
                        out[i] = ep.clone();
                    }
                }
                None => {
                    index.insert((ep.ip, ep.port), out.len());
                    out.push(ep.clone());
                }
            }
        }
        Arc::new(out)
    }
}
