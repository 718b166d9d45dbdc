//! What the last successful sync programmed, shared read-only with the
//! debug endpoints (`/debug/services`, `/debug/explain`) of the binary.
//!
//! The sync thread owns the [`ChangeTracker`](kp_model::ChangeTracker)s; the
//! HTTP server must not see a state the kernel does not hold yet (the
//! tracker's state runs ahead of the kernel between `take_changes` and a
//! successful `Dataplane::sync`). So after each successful sync of a family
//! the loop copies into this snapshot only the service ports that sync
//! programmed: Service ports and endpoint lists are `Arc`s, so the cost is
//! one map insert or remove and an `Arc` clone per changed port (a partial
//! sync of one Service in a 50k-Service cluster copies one entry, not 50k),
//! under a write lock held for that long. Readers take the read lock; the
//! server clones the `Arc`s it needs and lets go before serialising.

use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::SystemTime;

use kp_model::{IpFamily, ProxyState, ServicePortName};

/// One family's programmed state and its last successful sync.
#[derive(Clone, Debug)]
pub struct ProgrammedFamily {
    pub state: ProxyState,
    /// When the last successful sync of this family ended.
    pub last_sync: Option<SystemTime>,
    /// Whether that sync rewrote everything.
    pub last_full: bool,
}

/// Every family's programmed state.
#[derive(Clone, Debug, Default)]
pub struct Programmed {
    pub families: Vec<ProgrammedFamily>,
}

impl Programmed {
    pub fn family(&self, family: IpFamily) -> Option<&ProgrammedFamily> {
        self.families.iter().find(|f| f.state.family == family)
    }
}

/// A cheap, clonable handle on the snapshot: the sync loop writes, the
/// servers read.
#[derive(Clone, Debug, Default)]
pub struct ProgrammedState(Arc<RwLock<Programmed>>);

impl ProgrammedState {
    pub fn new() -> Self {
        Self::default()
    }

    /// The snapshot, read-locked. Hold it briefly: the sync loop waits for it.
    pub fn read(&self) -> RwLockReadGuard<'_, Programmed> {
        // A panic while writing leaves at worst some ports of one sync
        // unrecorded; the next sync of them fixes it.
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `state` is now programmed for the ports in `changed`.
    pub fn record(
        &self,
        state: &ProxyState,
        changed: &std::collections::BTreeSet<ServicePortName>,
        full: bool,
        at: SystemTime,
    ) {
        let mut g = self.0.write().unwrap_or_else(|p| p.into_inner());
        let i = match g
            .families
            .iter()
            .position(|f| f.state.family == state.family)
        {
            Some(i) => i,
            None => {
                g.families.push(ProgrammedFamily {
                    state: ProxyState::new(state.family, state.node.clone()),
                    last_sync: None,
                    last_full: false,
                });
                g.families.sort_by_key(|f| f.state.family);
                g.families
                    .iter()
                    .position(|f| f.state.family == state.family)
                    .unwrap_or(0)
            }
        };
        let f = &mut g.families[i];
        f.state.node.clone_from(&state.node);
        for name in changed {
            match state.services.get(name) {
                Some(sp) => {
                    f.state.services.insert(name.clone(), Arc::clone(sp));
                }
                None => {
                    f.state.services.remove(name);
                }
            }
            match state.endpoints.get(name) {
                Some(eps) => {
                    f.state.endpoints.insert(name.clone(), Arc::clone(eps));
                }
                None => {
                    f.state.endpoints.remove(name);
                }
            }
        }
        f.last_sync = Some(at);
        f.last_full = full;
    }
}
