//! The manifest source: Services, EndpointSlices, Nodes and ServiceCIDRs read from a
//! directory of YAML and JSON files, re-read when the directory changes.
//!
//! Accepted layouts, mixed freely: multi-document YAML (`---`), `kind: List`
//! with `items` (what `kubectl get svc,endpointslices -A -o yaml` writes), and
//! single objects. Objects of other kinds (or other API groups, such as a
//! Knative `Service`) are ignored. A broken document or object is reported as
//! [`SourceEvent::Invalid`] and skipped; the rest of the file still loads.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use tokio::sync::mpsc::Sender;
use tracing::{debug, info, warn};

use crate::{SourceError, SourceEvent};

/// Namespace and name of a namespaced object.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub namespace: String,
    pub name: String,
}

/// Everything one read of the manifest directory produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Loaded {
    pub services: BTreeMap<ObjectKey, Service>,
    pub slices: BTreeMap<ObjectKey, EndpointSlice>,
    /// Nodes by name (every Node found; the consumer picks its own).
    pub nodes: BTreeMap<String, Node>,
    /// ServiceCIDRs (networking.k8s.io/v1) by name: the Service ranges.
    pub service_cidrs: BTreeMap<String, ServiceCIDR>,
    /// One message per skipped document or object, naming file, document and error.
    pub invalid: Vec<String>,
}

fn is_manifest_file(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    let ext_ok = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml" | "json")
    );
    !hidden && ext_ok
}

/// Manifest files of `dir` in sorted order (editor temporaries and other
/// extensions are skipped; subdirectories are not descended into).
fn manifest_files(dir: &Path) -> Result<Vec<PathBuf>, SourceError> {
    let rd = std::fs::read_dir(dir).map_err(|source| SourceError::ReadDir {
        path: dir.to_owned(),
        source,
    })?;
    let mut files = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|source| SourceError::ReadDir {
            path: dir.to_owned(),
            source,
        })?;
        let path = entry.path();
        // Follows symlinks, so a ConfigMap-style `..data` link layout works.
        if path.is_file() && is_manifest_file(&path) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Reads every manifest file of `dir` (sorted by name; a later duplicate of the
/// same kind/namespace/name wins). Fails only when the directory or a file
/// cannot be read; parse problems land in [`Loaded::invalid`].
pub fn load_dir(dir: &Path) -> Result<Loaded, SourceError> {
    let mut out = Loaded::default();
    for path in manifest_files(dir)? {
        load_file(path, &mut out)?;
    }
    Ok(out)
}

/// Adds one manifest file's objects to `out`.
fn load_file(path: PathBuf, out: &mut Loaded) -> Result<(), SourceError> {
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            load_text(&path, &text, out);
            Ok(())
        }
        // Removed between listing and reading: it is simply gone.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(SourceError::ReadFile { path, source }),
    }
}

fn load_text(path: &Path, text: &str, out: &mut Loaded) {
    let file = path.display().to_string();
    let is_json = path.extension().and_then(|e| e.to_str()) == Some("json");
    if is_json {
        match serde_json::from_str::<Value>(text) {
            Ok(v) => load_value(v, &format!("{file} document 1"), out),
            Err(e) => out.invalid.push(format!("{file} document 1: {e}")),
        }
        return;
    }
    for (i, (first_line, doc)) in split_yaml_documents(text).iter().enumerate() {
        let origin = format!("{file} document {}", i + 1);
        match serde_saphyr::from_str::<Value>(doc) {
            // A document of only comments.
            Ok(Value::Null) => {}
            Ok(v) => load_value(v, &origin, out),
            // Positions in the parser's message count from the document's start.
            Err(e) => out.invalid.push(format!(
                "{origin} (starting at line {first_line}): {}",
                e.without_snippet()
            )),
        }
    }
}

/// Splits a YAML stream at document markers, so one broken document does not
/// take the others down (the parser's multi-document API is all or nothing).
/// A line starting with `---` or `...` at column 0 is always a marker: it ends
/// even a block scalar. Returns each non-empty document with the 1-based file
/// line its text starts on.
fn split_yaml_documents(text: &str) -> Vec<(usize, String)> {
    let mut docs = Vec::new();
    let mut cur = String::new();
    let mut start = 1;
    let mut has_content = false;
    let mut flush = |cur: &mut String, start: usize, has_content: &mut bool| {
        if *has_content {
            docs.push((start, std::mem::take(cur)));
        } else {
            cur.clear();
        }
        *has_content = false;
    };
    for (idx, line) in text.split_inclusive('\n').enumerate() {
        let lineno = idx + 1;
        if cur.is_empty() {
            start = lineno;
        }
        let bare = line.trim_end_matches(['\n', '\r']);
        let is_marker = |m: &str| {
            bare.strip_prefix(m)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t']))
        };
        if is_marker("---") {
            flush(&mut cur, start, &mut has_content);
            start = lineno;
            // `--- value` puts content on the marker line.
            let rest = bare[3..].trim();
            if !rest.is_empty() && !rest.starts_with('#') {
                cur.push_str(rest);
                cur.push('\n');
                has_content = true;
            }
        } else if is_marker("...") {
            flush(&mut cur, start, &mut has_content);
        } else if cur.is_empty() && !has_content && bare.starts_with('%') {
            // A directive (%YAML, %TAG) before the document marker.
        } else {
            let t = bare.trim_start();
            if !t.is_empty() && !t.starts_with('#') {
                has_content = true;
            }
            cur.push_str(line);
        }
    }
    flush(&mut cur, start, &mut has_content);
    docs
}

fn load_value(mut v: Value, origin: &str, out: &mut Loaded) {
    let Some(obj) = v.as_object_mut() else {
        out.invalid
            .push(format!("{origin}: not a Kubernetes object (not a mapping)"));
        return;
    };
    let kind = obj
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let api_version = obj
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let kind = kind.as_str();
    if kind.is_empty() {
        out.invalid
            .push(format!("{origin}: not a Kubernetes object (no kind)"));
        return;
    }
    match (api_version.as_str(), kind) {
        ("v1", "List" | "ServiceList" | "NodeList")
        | ("discovery.k8s.io/v1", "EndpointSliceList")
        | ("networking.k8s.io/v1", "ServiceCIDRList") => {
            match obj.remove("items") {
                Some(Value::Array(items)) => {
                    for (i, item) in items.into_iter().enumerate() {
                        load_value(item, &format!("{origin} item {}", i + 1), out);
                    }
                }
                // `items: null` or missing is an empty list.
                None | Some(Value::Null) => {}
                Some(_) => out
                    .invalid
                    .push(format!("{origin}: {kind} items is not a sequence")),
            }
        }
        ("v1", "Service") => {
            // As the API source reads it (service.rs): what the proxy does
            // not read cannot make the Service invalid.
            if let Some(mut svc) =
                decode::<crate::service::ProxiedService>(v, origin, kind, out).map(Service::from)
            {
                if let Some(key) = namespaced_key(&mut svc.metadata, origin, kind, out) {
                    out.services.insert(key, svc);
                }
            }
        }
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            if let Some(mut slice) = decode::<EndpointSlice>(v, origin, kind, out) {
                if let Some(key) = namespaced_key(&mut slice.metadata, origin, kind, out) {
                    out.slices.insert(key, slice);
                }
            }
        }
        ("v1", "Node") => {
            if let Some(mut node) = decode::<Node>(v, origin, kind, out) {
                node.metadata.namespace = None;
                match node.metadata.name.clone().filter(|n| !n.is_empty()) {
                    Some(name) => {
                        out.nodes.insert(name, node);
                    }
                    None => out
                        .invalid
                        .push(format!("{origin}: Node has no metadata.name")),
                }
            }
        }
        ("networking.k8s.io/v1", "ServiceCIDR") => {
            if let Some(mut cidr) = decode::<ServiceCIDR>(v, origin, kind, out) {
                // Cluster-scoped, as a Node.
                cidr.metadata.namespace = None;
                match cidr.metadata.name.clone().filter(|n| !n.is_empty()) {
                    Some(name) => {
                        out.service_cidrs.insert(name, cidr);
                    }
                    None => out
                        .invalid
                        .push(format!("{origin}: ServiceCIDR has no metadata.name")),
                }
            }
        }
        ("", "Service" | "EndpointSlice" | "Node" | "ServiceCIDR") => {
            out.invalid
                .push(format!("{origin}: {kind} without apiVersion"));
        }
        _ => debug!(%origin, api_version, kind, "ignoring manifest object of another kind"),
    }
}

fn decode<T: serde::de::DeserializeOwned>(
    v: Value,
    origin: &str,
    kind: &str,
    out: &mut Loaded,
) -> Option<T> {
    match serde_json::from_value::<T>(v) {
        Ok(t) => Some(t),
        Err(e) => {
            out.invalid.push(format!("{origin}: invalid {kind}: {e}"));
            None
        }
    }
}

/// The object's key; a missing namespace means "default" and is filled in so
/// consumers see the same namespace as the key.
fn namespaced_key(
    meta: &mut ObjectMeta,
    origin: &str,
    kind: &str,
    out: &mut Loaded,
) -> Option<ObjectKey> {
    let Some(name) = meta.name.clone().filter(|n| !n.is_empty()) else {
        out.invalid
            .push(format!("{origin}: {kind} has no metadata.name"));
        return None;
    };
    let namespace = meta
        .namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "default".to_owned());
    meta.namespace = Some(namespace.clone());
    Some(ObjectKey { namespace, name })
}

/// What identifies a version of the directory's contents without reading it.
type Fingerprint = BTreeMap<PathBuf, (Option<SystemTime>, u64)>;

fn fingerprint(dir: &Path) -> Result<Fingerprint, SourceError> {
    let mut fp = Fingerprint::new();
    for path in manifest_files(dir)? {
        match std::fs::metadata(&path) {
            Ok(md) => {
                fp.insert(path, (md.modified().ok(), md.len()));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(SourceError::ReadFile { path, source }),
        }
    }
    Ok(fp)
}

/// A digest of an object's serialized form: enough to tell a changed object
/// from an unchanged one without keeping it.
type Digest = [u8; 16];

fn digest<T: serde::Serialize>(obj: &T) -> Digest {
    struct Hashing(Sha256);
    impl std::io::Write for Hashing {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.update(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut h = Hashing(Sha256::new());
    // Serializing our own parsed object cannot fail; an error would only
    // make the digest differ, i.e. the object be sent again.
    let _ = serde_json::to_writer(&mut h, obj);
    let full = h.0.finalize();
    let mut d = [0u8; 16];
    d.copy_from_slice(&full[..16]);
    d
}

/// What the consumer has of one kind, as far as the source knows: a digest
/// per object rather than the object. At 10k Services the parsed objects
/// were the process's largest item of memory (~70 MB); the consumer keeps
/// its own model.
struct Known<K> {
    digests: BTreeMap<K, Digest>,
    /// Keys the last complete read found in more than one file: their
    /// objects are held until the read ends and only the last is sent, so
    /// the consumer never sees the earlier one in between.
    dups: BTreeSet<K>,
}

impl<K> Default for Known<K> {
    fn default() -> Self {
        Known {
            digests: BTreeMap::new(),
            dups: BTreeSet::new(),
        }
    }
}

/// What one read has found of one kind so far.
struct Found<K> {
    keys: BTreeSet<K>,
    dups: BTreeSet<K>,
    held: BTreeMap<K, (Digest, SourceEvent)>,
}

impl<K> Default for Found<K> {
    fn default() -> Self {
        Found {
            keys: BTreeSet::new(),
            dups: BTreeSet::new(),
            held: BTreeMap::new(),
        }
    }
}

impl<K: Ord + Clone> Known<K> {
    /// Moves those of `objects` the consumer does not have as they are into
    /// `event`s (or holds them, for a known duplicate).
    fn file<T: serde::Serialize>(
        &mut self,
        found: &mut Found<K>,
        objects: BTreeMap<K, T>,
        event: fn(Box<T>) -> SourceEvent,
        ev: &mut Vec<SourceEvent>,
    ) {
        for (key, obj) in objects {
            let d = digest(&obj);
            if !found.keys.insert(key.clone()) {
                found.dups.insert(key.clone());
            }
            if self.dups.contains(&key) {
                found.held.insert(key, (d, event(Box::new(obj))));
            } else if self.digests.get(&key) != Some(&d) {
                ev.push(event(Box::new(obj)));
                self.digests.insert(key, d);
            }
        }
    }

    /// After a complete read: the held duplicates that changed, then the
    /// keys the read lacks, each turned into an event by `gone` (None: no
    /// event) and forgotten.
    fn finish(
        &mut self,
        found: Found<K>,
        ev: &mut Vec<SourceEvent>,
        gone: impl Fn(&K) -> Option<SourceEvent>,
    ) {
        for (key, (d, e)) in found.held {
            if self.digests.get(&key) != Some(&d) {
                ev.push(e);
                self.digests.insert(key, d);
            }
        }
        self.digests.retain(|key, _| {
            let kept = found.keys.contains(key);
            if !kept {
                ev.extend(gone(key));
            }
            kept
        });
        self.dups = found.dups;
    }
}

/// What the consumer has, as far as the source knows.
#[derive(Default)]
struct Seen {
    services: Known<ObjectKey>,
    slices: Known<ObjectKey>,
    nodes: Known<String>,
    service_cidrs: Known<String>,
    /// The problems the last complete read reported.
    invalid: BTreeSet<String>,
}

/// What one read of the directory has found so far.
#[derive(Default)]
struct Reading {
    services: Found<ObjectKey>,
    slices: Found<ObjectKey>,
    nodes: Found<String>,
    service_cidrs: Found<String>,
    invalid: BTreeSet<String>,
}

impl Seen {
    /// Reads `dir` file by file and sends what changed: each file's objects
    /// are decoded, compared and sent before the next file is read, so the
    /// source holds one file's objects at a time (all of them at once were
    /// the process's peak: ~340 MB of parsed objects for 50k Services,
    /// ~18 MB at 1k). Deletions follow the last file. Problems not reported
    /// by the last complete read go first in each file's events. Returns
    /// `Ok(false)` when the consumer is gone; on a read error what was sent
    /// stays sent and nothing is deleted.
    async fn read(&mut self, dir: &Path, tx: &Sender<SourceEvent>) -> Result<bool, SourceError> {
        let mut r = Reading::default();
        for path in manifest_files(dir)? {
            let mut file = Loaded::default();
            load_file(path, &mut file)?;
            if !send_all(tx, self.file(&mut r, file)).await {
                return Ok(false);
            }
        }
        info!(
            dir = %dir.display(),
            services = r.services.keys.len(),
            endpoint_slices = r.slices.keys.len(),
            nodes = r.nodes.keys.len(),
            service_cidrs = r.service_cidrs.keys.len(),
            invalid = r.invalid.len(),
            "manifests read"
        );
        Ok(send_all(tx, self.finish(r)).await)
    }

    /// The events of one file: Invalid for new problems, Applied for
    /// objects the consumer does not have as they are here.
    fn file(&mut self, r: &mut Reading, new: Loaded) -> Vec<SourceEvent> {
        let mut ev = Vec::new();
        for msg in new.invalid {
            if !self.invalid.contains(&msg) && !r.invalid.contains(&msg) {
                ev.push(SourceEvent::Invalid(msg.clone()));
            }
            r.invalid.insert(msg);
        }
        let (n, svc, sl) = (&mut r.nodes, &mut r.services, &mut r.slices);
        self.nodes
            .file(n, new.nodes, SourceEvent::NodeApplied, &mut ev);
        self.services
            .file(svc, new.services, SourceEvent::ServiceApplied, &mut ev);
        self.slices
            .file(sl, new.slices, SourceEvent::SliceApplied, &mut ev);
        self.service_cidrs.file(
            &mut r.service_cidrs,
            new.service_cidrs,
            SourceEvent::ServiceCidrApplied,
            &mut ev,
        );
        ev
    }

    /// Held duplicates and deletions, once the read `r` is complete.
    fn finish(&mut self, r: Reading) -> Vec<SourceEvent> {
        let mut ev = Vec::new();
        self.nodes.finish(r.nodes, &mut ev, |name| {
            // The sync loop has no use for a Node deletion: it keeps the last labels.
            debug!(node = %name, "Node removed from manifests");
            None
        });
        self.service_cidrs.finish(r.service_cidrs, &mut ev, |name| {
            Some(SourceEvent::ServiceCidrDeleted { name: name.clone() })
        });
        let gone = |k: &ObjectKey| (k.namespace.clone(), k.name.clone());
        self.slices.finish(r.slices, &mut ev, |k| {
            let (namespace, name) = gone(k);
            Some(SourceEvent::SliceDeleted { namespace, name })
        });
        self.services.finish(r.services, &mut ev, |k| {
            let (namespace, name) = gone(k);
            Some(SourceEvent::ServiceDeleted { namespace, name })
        });
        self.invalid = r.invalid;
        ev
    }
}

async fn send_all(tx: &Sender<SourceEvent>, events: Vec<SourceEvent>) -> bool {
    for e in events {
        if tx.send(e).await.is_err() {
            return false;
        }
    }
    true
}

/// Reads `dir`, sends every object as `*Applied` (each file's new `Invalid`
/// problems before its objects), then `Synced`; afterwards checks the
/// directory every `poll` and, when a file's name, mtime or size changed,
/// re-reads it and sends only the difference.
///
/// Fails if the directory cannot be read at start; later read errors are logged
/// and retried at the next poll. Returns `Ok(())` when `tx` is closed.
pub async fn run_manifest_source(
    dir: PathBuf,
    poll: Duration,
    tx: Sender<SourceEvent>,
) -> Result<(), SourceError> {
    // The fingerprint is taken before reading so a write racing the read is
    // seen as a change at the next poll.
    let mut fp = fingerprint(&dir)?;
    let mut seen = Seen::default();
    if !seen.read(&dir, &tx).await? || tx.send(SourceEvent::Synced).await.is_err() {
        return Ok(());
    }
    let mut failing = false;
    loop {
        tokio::select! {
            _ = tx.closed() => return Ok(()),
            _ = tokio::time::sleep(poll) => {}
        }
        let read = match fingerprint(&dir) {
            Ok(f) if f == fp => Ok(true),
            Ok(f) => seen.read(&dir, &tx).await.inspect(|_| {
                fp = f;
                debug!("manifest directory changed");
            }),
            Err(e) => Err(e),
        };
        match read {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => {
                // Keep the last good state: deleting everything because of a
                // transient error would cut traffic.
                if !failing {
                    warn!("manifest re-read failed, keeping the last state: {e}");
                }
                failing = true;
                continue;
            }
        }
        if failing {
            info!(dir = %dir.display(), "manifest directory readable again");
            failing = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_documents_at_markers_only() {
        let text = "# leading comment\n---\na: 1\n---\n# only a comment\n---\nb: |\n  text\n  --- not a marker\n...\n--- {c: 3}\n";
        let docs = split_yaml_documents(text);
        assert_eq!(
            docs,
            vec![
                (3, "a: 1\n".to_owned()),
                (7, "b: |\n  text\n  --- not a marker\n".to_owned()),
                (11, "{c: 3}\n".to_owned()),
            ]
        );
    }

    #[test]
    fn document_without_markers_is_one_document() {
        assert_eq!(
            split_yaml_documents("a: 1\nb: 2"),
            vec![(1, "a: 1\nb: 2".to_owned())]
        );
        assert!(split_yaml_documents("").is_empty());
        assert!(split_yaml_documents("---\n---\n").is_empty());
    }
}
