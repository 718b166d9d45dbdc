//! Services: each one's ports as converted, and when it was created (the
//! older Service wins a contested address).

use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Service;

use super::{ChangeTracker, Rejected};
use crate::claims::Created;
use crate::convert::convert_service;
use crate::types::{ServiceName, ServicePort};

impl ChangeTracker {
    /// Adds or replaces a Service. On error the previous version (if any) stays.
    /// Returns warnings about fields that were dropped.
    pub fn update_service(
        &mut self,
        svc: &Service,
        now: SystemTime,
    ) -> Result<Vec<String>, Rejected> {
        let mut warnings = Vec::new();
        let ports = convert_service(
            svc,
            self.cfg.family,
            self.cfg.service_proxy_name.as_deref(),
            &mut warnings,
        )
        .map_err(Rejected)?;
        let name = ServiceName::new(
            svc.metadata.namespace.as_deref().unwrap_or("default"),
            svc.metadata.name.as_deref().unwrap_or(""),
        );
        let ports: Vec<Arc<ServicePort>> = ports.into_iter().map(Arc::new).collect();
        let created = Created(
            svc.metadata
                .creation_timestamp
                .as_ref()
                .map(|t| (t.0.as_second(), t.0.subsec_nanosecond())),
        );
        let created_changed = self.created.get(&name).is_some_and(|c| *c != created);
        let changed = match self.services.get(&name) {
            Some(old) => *old != ports || created_changed,
            None => !ports.is_empty(),
        };
        if ports.is_empty() {
            self.created.remove(&name);
        } else {
            self.created.insert(name.clone(), created);
        }
        if ports.is_empty() {
            self.services.remove(&name);
        } else {
            self.services.insert(name.clone(), ports);
        }
        if changed {
            self.service_changes += 1;
            self.triggers.push(now);
            self.spec_dirty.insert(name.clone());
            self.dirty.insert(name);
        }
        Ok(warnings)
    }

    pub fn delete_service(&mut self, namespace: &str, name: &str, now: SystemTime) {
        let key = ServiceName::new(namespace, name);
        self.created.remove(&key);
        if self.services.remove(&key).is_some() {
            self.service_changes += 1;
            self.triggers.push(now);
            self.spec_dirty.insert(key.clone());
            self.dirty.insert(key);
        }
    }
}
