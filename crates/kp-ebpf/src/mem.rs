//! Maps in memory, with the kernel's semantics for what a sync does (insert
//! overwrites, delete of a missing key fails): for testing the sync logic
//! without a kernel, and for checking that a client never meets a slot
//! without an endpoint while a sync runs.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::maps::{BackendKey, BackendVal, MaglevKey, MaglevVal, MemberKey, SvcKey, SvcVal};
use crate::proxier::{each, value, Maps, Refused};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemContent {
    pub services: BTreeMap<SvcKey, SvcVal>,
    pub backends: BTreeMap<BackendKey, BackendVal>,
    pub members: BTreeMap<MemberKey, u32>,
    pub maglev: BTreeMap<MaglevKey, MaglevVal>,
    /// Deletes of keys that were not there (fine for the kernel; a normal
    /// sync makes none, a repair does).
    pub missing_deletes: usize,
}

impl MemContent {
    /// Every address reachable now resolves to a complete slot list whose
    /// endpoints are members where the programs look (UDP): what a client
    /// could meet between two writes.
    pub fn consistent(&self) -> Result<(), String> {
        for (k, v) in &self.services {
            if v.count == 0 {
                return Err(format!("{k:?} has no endpoints"));
            }
            let read = i32::from(k.proto) == libc::IPPROTO_UDP;
            for slot in 0..v.count {
                let Some(b) = self.backends.get(&BackendKey { svc_id: v.id, slot }) else {
                    return Err(format!("{k:?}: slot {slot} of {} is empty", v.count));
                };
                if read
                    && !self.members.contains_key(&MemberKey {
                        svc_id: v.id,
                        backend: *b,
                    })
                {
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
    log: Arc<Mutex<Log>>,
}

#[derive(Default)]
struct Log {
    calls: Vec<(&'static str, usize)>,
    /// Writes (entries) still let through before one is refused.
    refuse_after: Option<usize>,
}

impl MemMaps {
    pub fn new(check_each_step: bool) -> Self {
        MemMaps {
            inner: Arc::default(),
            check_each_step,
            log: Arc::default(),
        }
    }
    fn lock(&self) -> MutexGuard<'_, MemContent> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn log(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub fn content(&self) -> MemContent {
        self.lock().clone()
    }
    /// The calls made so far, in order: the operation (`set_members`, ...;
    /// the one-entry forms by their own names) and how many entries.
    /// Recorded only by maps that check each step (a test's).
    pub fn calls(&self) -> Vec<(&'static str, usize)> {
        self.log().calls.clone()
    }
    /// Lets `n` more entries be written, then refuses the next one as a
    /// kernel refuses a write to a full map (and every one after it, until
    /// [`MemMaps::accept_all`]).
    pub fn refuse_after(&self, n: usize) {
        self.log().refuse_after = Some(n);
    }
    pub fn accept_all(&self) {
        self.log().refuse_after = None;
    }
    fn call(&self, op: &'static str, n: usize) {
        if self.check_each_step {
            self.log().calls.push((op, n));
        }
    }
    /// Asked before each entry is written.
    fn admit(&self) -> Result<(), String> {
        let mut log = self.log();
        match log.refuse_after {
            Some(0) => Err("Argument list too long (os error 7) (refused by the test)".into()),
            Some(n) => {
                log.refuse_after = Some(n - 1);
                Ok(())
            }
            None => Ok(()),
        }
    }
    fn after(&self) -> Result<(), String> {
        if self.check_each_step {
            self.lock().consistent()
        } else {
            Ok(())
        }
    }
    fn put_service(&self, k: &SvcKey, v: &SvcVal) -> Result<(), String> {
        self.admit()?;
        self.lock().services.insert(*k, *v);
        self.after()
    }
    fn drop_service(&self, k: &SvcKey) -> Result<(), String> {
        self.admit()?;
        let mut c = self.lock();
        if c.services.remove(k).is_none() {
            c.missing_deletes += 1;
        }
        drop(c);
        self.after()
    }
    fn put_backend(&self, k: &BackendKey, v: &BackendVal) -> Result<(), String> {
        self.admit()?;
        self.lock().backends.insert(*k, *v);
        self.after()
    }
    fn drop_backend(&self, k: &BackendKey) -> Result<(), String> {
        self.admit()?;
        let mut c = self.lock();
        if c.backends.remove(k).is_none() {
            c.missing_deletes += 1;
        }
        drop(c);
        self.after()
    }
    fn put_member(&self, k: &MemberKey, slot: u32) -> Result<(), String> {
        self.admit()?;
        self.lock().members.insert(*k, slot);
        self.after()
    }
    fn drop_member(&self, k: &MemberKey) -> Result<(), String> {
        self.admit()?;
        let mut c = self.lock();
        if c.members.remove(k).is_none() {
            c.missing_deletes += 1;
        }
        drop(c);
        self.after()
    }
    fn put_maglev(&self, k: &MaglevKey, v: &MaglevVal) -> Result<(), String> {
        self.admit()?;
        self.lock().maglev.insert(*k, *v);
        self.after()
    }
    fn drop_maglev(&self, k: &MaglevKey) -> Result<(), String> {
        self.admit()?;
        let mut c = self.lock();
        if c.maglev.remove(k).is_none() {
            c.missing_deletes += 1;
        }
        drop(c);
        self.after()
    }
}

/// The plural forms write entry by entry, checking after each one (a
/// kernel batch is not atomic either: a client may meet any prefix of it).
impl Maps for MemMaps {
    fn set_service(&mut self, k: &SvcKey, v: &SvcVal) -> Result<(), String> {
        self.call("set_service", 1);
        self.put_service(k, v)
    }
    fn del_service(&mut self, k: &SvcKey) -> Result<(), String> {
        self.call("del_service", 1);
        self.drop_service(k)
    }
    fn set_backend(&mut self, k: &BackendKey, v: &BackendVal) -> Result<(), String> {
        self.call("set_backend", 1);
        self.put_backend(k, v)
    }
    fn del_backend(&mut self, k: &BackendKey) -> Result<(), String> {
        self.call("del_backend", 1);
        self.drop_backend(k)
    }
    fn set_member(&mut self, k: &MemberKey, slot: u32) -> Result<(), String> {
        self.call("set_member", 1);
        self.put_member(k, slot)
    }
    fn del_member(&mut self, k: &MemberKey) -> Result<(), String> {
        self.call("del_member", 1);
        self.drop_member(k)
    }
    fn dump(&self) -> Result<crate::proxier::Dump, String> {
        let c = self.lock();
        Ok(crate::proxier::Dump {
            services: c.services.iter().map(|(k, v)| (*k, *v)).collect(),
            backends: c.backends.iter().map(|(k, v)| (*k, *v)).collect(),
            members: c.members.keys().copied().collect(),
            maglev: c.maglev.keys().copied().collect(),
        })
    }
    fn set_services(&mut self, keys: &[SvcKey], vals: &[SvcVal]) -> Result<(), Refused> {
        self.call("set_services", keys.len());
        each(keys, |i, k| self.put_service(k, value(vals, i)?))
    }
    fn del_services(&mut self, keys: &[SvcKey]) -> Result<(), Refused> {
        self.call("del_services", keys.len());
        each(keys, |_, k| self.drop_service(k))
    }
    fn set_backends(&mut self, keys: &[BackendKey], vals: &[BackendVal]) -> Result<(), Refused> {
        self.call("set_backends", keys.len());
        each(keys, |i, k| self.put_backend(k, value(vals, i)?))
    }
    fn del_backends(&mut self, keys: &[BackendKey]) -> Result<(), Refused> {
        self.call("del_backends", keys.len());
        each(keys, |_, k| self.drop_backend(k))
    }
    fn set_members(&mut self, keys: &[MemberKey], slots: &[u32]) -> Result<(), Refused> {
        self.call("set_members", keys.len());
        each(keys, |i, k| self.put_member(k, *value(slots, i)?))
    }
    fn del_members(&mut self, keys: &[MemberKey]) -> Result<(), Refused> {
        self.call("del_members", keys.len());
        each(keys, |_, k| self.drop_member(k))
    }
    fn set_maglev(&mut self, keys: &[MaglevKey], vals: &[MaglevVal]) -> Result<(), Refused> {
        self.call("set_maglev", keys.len());
        each(keys, |i, k| self.put_maglev(k, value(vals, i)?))
    }
    fn del_maglev(&mut self, keys: &[MaglevKey]) -> Result<(), Refused> {
        self.call("del_maglev", keys.len());
        each(keys, |_, k| self.drop_maglev(k))
    }
}
