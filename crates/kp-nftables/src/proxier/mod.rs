//! The nftables proxier: remembers what it programmed, sends the difference.
//!
//! Its rooms: `full` and `partial` build a sync's transaction with `tx`'s
//! builder; `programmed` is what the proxier believes the kernel holds,
//! `slots` where endpoints sit in the shared maps, `affinity` what keeps
//! session-affinity clients on their endpoints across syncs.
//! Here: the proxier itself and the sync that applies a transaction.

mod adopt;
mod affinity;
mod cidrs;
mod full;
mod partial;
mod programmed;
mod slots;
mod tx;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use kp_model::{
    Dataplane, DataplaneError, Known, ProxierConfig, ProxyState, ServicePortName, Start, SyncReport,
};

use crate::backend::NftBackend;
use crate::names::{NAT_PREROUTING, TABLE_NAME};
use crate::render::{ElemKey, Element, MapName, Skeleton};
use crate::types::{Object, Transaction, Verb};
pub use adopt::Adoption;
use affinity::Rekey;
use programmed::{name_owners, Programmed};
use tx::{element_ops, Tx};

pub struct NftablesProxier {
    cfg: ProxierConfig,
    skeleton: Skeleton,
    /// The Service ranges `skeleton`'s `cluster-ips-check` drops: the
    /// configured ones and the cluster's ServiceCIDRs (`cidrs.rs`).
    check_cidrs: Vec<ipnet::IpNet>,
    backend: Box<dyn NftBackend>,
    table: String,
    /// What the last successful sync programmed (nothing before the first,
    /// and after a failed one: the next sync is then a full one).
    known: Known<Programmed>,
    /// Until the first sync: whether it reads back a table a previous run
    /// left and sends only the difference (else it replaces the table).
    adopt: bool,
    last_adoption: Option<adopt::Adoption>,
}

impl NftablesProxier {
    pub fn new(cfg: ProxierConfig, backend: Box<dyn NftBackend>) -> Self {
        let skeleton = Skeleton::new(&cfg);
        let check_cidrs = cidrs::effective(&cfg, &[]);
        NftablesProxier {
            cfg,
            skeleton,
            check_cidrs,
            backend,
            table: TABLE_NAME.to_string(),
            known: Known::default(),
            adopt: true,
            last_adoption: None,
        }
    }

    /// What the first sync kept and rewrote of the table a previous run
    /// left, if it adopted one.
    pub fn adoption(&self) -> Option<Adoption> {
        self.last_adoption
    }

    /// Whether the first sync adopts a table it finds (default) or
    /// replaces it whole.
    pub fn with_adoption(mut self, adopt: bool) -> Self {
        self.adopt = adopt;
        self
    }

    /// The first sync over a table a previous run left: reads it back and
    /// sends only what differs from `state`. None when there is no table
    /// to adopt or it could not be (logged): the caller replaces it.
    fn adopt_table(&mut self, state: &ProxyState, t0: Instant) -> Option<SyncReport> {
        let skip = |name: &str| name.starts_with("affinity-");
        let read = match self.backend.read_table(self.cfg.family, &self.table, &skip) {
            Ok(Some(kt)) => kt,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "could not read back the table a previous run left; replacing it");
                return None;
            }
        };
        if read.comment() != Some(full::TABLE_COMMENT) {
            tracing::info!(
                comment = read.comment().unwrap_or(""),
                "the table a previous run left was made by another layout; replacing it"
            );
            return None;
        }
        let read_in = t0.elapsed();
        let (mut tx, prog, mut st) = self.adopt_tx(state, read.as_ref());
        st.read = read_in;
        drop(read);
        let rekey = std::mem::take(&mut tx.rekey);
        let (txn, ops) = tx.finish(self.cfg.family, &self.table);
        let render = t0.elapsed();
        let t1 = Instant::now();
        let bytes = if txn.is_empty() {
            0
        } else {
            match self.backend.apply(&txn) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(error = %e, "the kernel refused the difference to the table a previous run left; replacing it");
                    return None;
                }
            }
        };
        if !rekey.is_empty() {
            self.rekey_clients(&rekey);
        }
        let mut report = SyncReport {
            full: true,
            ops,
            render,
            bytes,
            apply: t1.elapsed(),
            ..Default::default()
        };
        report.no_local_endpoints = prog.no_local_endpoints();
        tracing::info!(
            family = ?self.cfg.family,
            read_ms = read_in.as_millis() as u64,
            rules_read = st.rules_read,
            elements_read = st.elements_read,
            chains_kept = st.chains_kept,
            chains_rewritten = st.chains_rewritten,
            chains_added = st.chains_added,
            chains_deleted = st.chains_deleted,
            sets_kept = st.sets_kept,
            sets_changed = st.sets_changed,
            elements_changed = st.elements_changed,
            sets_rewritten = st.sets_rewritten,
            slot_ranges_kept = st.pools_kept,
            slot_ranges_moved = st.pools_moved,
            operations_sent = ops,
            "adopted the table a previous run left"
        );
        self.last_adoption = Some(st);
        self.known.done(prog);
        Some(report)
    }

    /// The transaction a full sync of `state` would send to a kernel without
    /// our table: what --dry-run prints (as nft text), and what the tests
    /// hand to the encoders.
    pub fn full_transaction(&self, state: &ProxyState) -> Transaction {
        let (tx, _) = self.full_tx(state, None);
        tx.finish(self.cfg.family, &self.table).0
    }

    /// Brings the session-affinity records in line with what the sync
    /// did to the endpoints' indexes: the clients of an endpoint that went
    /// are forgotten, as upstream's deleting an endpoint's own set forgets
    /// them (a client of a removed endpoint must not end up on whatever
    /// takes its place); those of an endpoint that moved follow it. Lists
    /// the records after the transaction applied, then deletes and re-adds
    /// in a second one (a moved record gets the full timeout again). A
    /// failure is logged and leaves the records to expire with their
    /// timeout; one retry covers a record that expired between the listing
    /// and the deletion.
    fn rekey_clients(&mut self, rekeys: &[Rekey]) {
        let mut by_set: BTreeMap<u32, HashMap<(u32, u32), Option<u32>>> = BTreeMap::new();
        for r in rekeys {
            by_set
                .entry(r.timeout)
                .or_default()
                .insert((r.id, r.from), r.to);
        }
        for (timeout, moves) in by_set {
            let set = MapName::Affinity(timeout);
            let mut result = Ok(0);
            for _attempt in 0..2 {
                let records = match self.backend.affinity_records(
                    self.cfg.family,
                    &self.table,
                    &set.to_string(),
                ) {
                    Ok(r) => r,
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                };
                let element = |key| Element {
                    map: set,
                    key,
                    value: None,
                };
                let mut gone = Vec::new();
                let mut moved = Vec::new();
                for key in records {
                    let ElemKey::Affinity { client, id, index } = key else {
                        continue;
                    };
                    if let Some(to) = moves.get(&(id, index)) {
                        gone.push(element(key));
                        if let Some(to) = to {
                            moved.push(element(ElemKey::Affinity {
                                client,
                                id,
                                index: *to,
                            }));
                        }
                    }
                }
                if gone.is_empty() {
                    result = Ok(0);
                    break;
                }
                let n = gone.len();
                let mut tx = Tx::default();
                element_ops(&mut tx.del_elements, Verb::Delete, gone);
                element_ops(&mut tx.add_elements, Verb::Add, moved);
                let (txn, _) = tx.finish(self.cfg.family, &self.table);
                result = self.backend.apply(&txn).map(|_| n);
                if result.is_ok() {
                    break;
                }
            }
            match result {
                Ok(0) => {}
                Ok(n) => {
                    tracing::debug!(set = %set, records = n, "affinity records of removed or moved endpoints updated")
                }
                Err(e) => tracing::warn!(
                    set = %set, error = %e,
                    "could not update the affinity records of removed or moved endpoints; they expire with the timeout"
                ),
            }
        }
    }
}

impl Dataplane for NftablesProxier {
    fn mode(&self) -> kp_model::ProxyMode {
        kp_model::ProxyMode::Nftables
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServicePortName>,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        let t0 = Instant::now();
        self.follow_service_cidrs(state);
        if std::mem::take(&mut self.adopt) && !self.known.is_known() {
            if let Some(report) = self.adopt_table(state, t0) {
                return Ok(report);
            }
        }
        // A failed sync returns early with nothing known: the retry is full.
        let (is_full, last, (mut tx, new_prog)) = match self.known.begin(full) {
            Start::Full { last } => {
                let built = self.full_tx(state, last.as_ref());
                (true, last, built)
            }
            Start::Partial { mut prev } => {
                let tx = self.partial_tx(state, changed, &mut prev);
                (false, None, (tx, prev))
            }
        };
        let rekey = std::mem::take(&mut tx.rekey);
        let (txn, ops) = tx.finish(self.cfg.family, &self.table);
        let render = t0.elapsed();
        let t1 = Instant::now();
        let mut report = SyncReport {
            full: is_full,
            ops,
            render,
            ..Default::default()
        };
        if !txn.is_empty() {
            // A full sync's operations are freed as they are encoded (the
            // largest transient of the process: at 50k Services the typed
            // operations and the batch were ~175 MB together); a kernel
            // refusal then names lines without text, and the retry is a
            // full sync anyway. A partial sync keeps its text for errors.
            let (applied, kept_tx) = if is_full {
                (self.backend.apply_owned(txn), None)
            } else {
                (self.backend.apply(&txn), Some(txn))
            };
            match applied {
                Ok(bytes) => report.bytes = bytes,
                Err(DataplaneError::Refused { tool, mut refused }) => {
                    // Name whose objects were refused; a full sync's text
                    // was freed as it was encoded, so render it again (the
                    // transaction is deterministic).
                    let tx = kept_tx.unwrap_or_else(|| {
                        let (tx, _) = self.full_tx(state, last.as_ref());
                        tx.finish(self.cfg.family, &self.table).0
                    });
                    name_owners(&mut refused, &tx, &new_prog);
                    // Nothing was applied (one transaction), and nothing is
                    // known any more: the retry is a full sync.
                    return Err(DataplaneError::Refused { tool, refused });
                }
                Err(e) => return Err(e),
            }
        }
        if !rekey.is_empty() {
            self.rekey_clients(&rekey);
        }
        report.apply = t1.elapsed();
        report.no_local_endpoints = new_prog.no_local_endpoints();
        self.known.done(new_prog);
        Ok(report)
    }

    fn render(&self, state: &ProxyState) -> String {
        self.full_transaction(state).to_string()
    }

    fn rules_lost(&mut self) -> bool {
        // nat-prerouting always holds `jump services`: an empty or missing
        // chain means someone flushed or deleted our rules.
        let (backend, family, table) = (&mut self.backend, self.cfg.family, &self.table);
        self.known.check_lost("nftables", || {
            backend.chain_has_rules(family, table, NAT_PREROUTING)
        })
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        // `add` first so that deleting a table that is not there is no error.
        let mut tx = Transaction::new(self.cfg.family, &self.table);
        tx.add(Object::Table { comment: None })
            .delete(Object::Table { comment: None });
        self.known.forget();
        self.backend.apply(&tx).map(|_| ())
    }
}
