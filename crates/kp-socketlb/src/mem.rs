//! Maps in memory, with the kernel's semantics for what a sync does (insert
//! overwrites, delete of a missing key fails): for testing the sync logic
//! without a kernel, and for checking that a client never meets a slot
//! without an endpoint while a sync runs.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::maps::{BackendKey, BackendVal, MemberKey, SvcKey, SvcVal};
use crate::proxier::Maps;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemContent {
    pub services: BTreeMap<SvcKey, SvcVal>,
    pub backends: BTreeMap<BackendKey, BackendVal>,
    pub members: BTreeMap<MemberKey, u32>,
    /// Deletes of keys that were not there (fine for the kernel; a normal
    /// sync makes none, a repair does).
    pub missing_deletes: usize,
}

impl MemContent {
    /// Every address reachable now resolves to a complete slot list whose
    /// endpoints are members: what a client could meet between two writes.
    pub fn consistent(&self) -> Result<(), String> {
        for (k, v) in &self.services {
            if v.count == 0 {
                return Err(format!("{k:?} has no endpoints"));
            }
            for slot in 0..v.count {
                let Some(b) = self.backends.get(&BackendKey { svc_id: v.id, slot }) else {
                    return Err(format!("{k:?}: slot {slot} of {} is empty", v.count));
                };
                if !self.members.contains_key(&MemberKey {
                    svc_id: v.id,
                    backend: *b,
                }) {
                    return Err(format!("{k:?}: slot {slot}'s endpoint is not a member"));
                }
            }
        }
        Ok(())
    }
}

/// Clones share the content (as two families share the kernel's maps).
#[derive(Clone, Default)]
pub struct MemMaps {
    inner: Arc<Mutex<MemContent>>,
    /// Checked after every write when set.
    check_each_step: bool,
}

impl MemMaps {
    pub fn new(check_each_step: bool) -> Self {
        MemMaps {
            inner: Arc::default(),
            check_each_step,
        }
    }
    fn lock(&self) -> MutexGuard<'_, MemContent> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub fn content(&self) -> MemContent {
        self.lock().clone()
    }
    fn after(&self) -> Result<(), String> {
        if self.check_each_step {
            self.lock().consistent()
        } else {
            Ok(())
        }
    }
}

impl Maps for MemMaps {
    fn set_service(&mut self, k: &SvcKey, v: &SvcVal) -> Result<(), String> {
        self.lock().services.insert(*k, *v);
        self.after()
    }
    fn del_service(&mut self, k: &SvcKey) -> Result<(), String> {
        let mut c = self.lock();
        if c.services.remove(k).is_none() {
            c.missing_deletes += 1;
        }
        drop(c);
        self.after()
    }
    fn set_backend(&mut self, k: &BackendKey, v: &BackendVal) -> Result<(), String> {
        self.lock().backends.insert(*k, *v);
        self.after()
    }
    fn del_backend(&mut self, k: &BackendKey) -> Result<(), String> {
        let mut c = self.lock();
        if c.backends.remove(k).is_none() {
            c.missing_deletes += 1;
        }
        drop(c);
        self.after()
    }
    fn set_member(&mut self, k: &MemberKey, slot: u32) -> Result<(), String> {
        self.lock().members.insert(*k, slot);
        self.after()
    }
    fn del_member(&mut self, k: &MemberKey) -> Result<(), String> {
        let mut c = self.lock();
        if c.members.remove(k).is_none() {
            c.missing_deletes += 1;
        }
        drop(c);
        self.after()
    }
    fn dump(&self) -> Result<crate::proxier::Dump, String> {
        let c = self.lock();
        Ok(crate::proxier::Dump {
            services: c.services.iter().map(|(k, v)| (*k, *v)).collect(),
            backends: c.backends.iter().map(|(k, v)| (*k, *v)).collect(),
            members: c.members.keys().copied().collect(),
        })
    }
}
