//! Session affinity across syncs: endpoints keep their index in a
//! selection's slots while they stay (client records name indexes), and
//! what a change does to the records is said as [`Rekey`]s.

use std::collections::{HashMap, HashSet};

use crate::render::ServiceObjects;
use crate::types::DnatTarget;

/// What a sync does to the client records of one index of one
/// session-affinity selection: the endpoint there went (`to` None: its
/// clients are forgotten, as upstream deletes an endpoint's set), or moved
/// to index `to` (its clients follow it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Rekey {
    pub(super) timeout: u32,
    pub(super) id: u32,
    pub(super) from: u32,
    pub(super) to: Option<u32>,
}

/// Keeps every endpoint of `new`'s session-affinity pools at the index it
/// had in `old` (records name indexes), fills the free indexes with the
/// endpoints that are new or must move down (the count shrank), and says
/// what that does to the records.
pub(super) fn keep_affinity_places(
    new: &mut ServiceObjects,
    old: Option<&ServiceObjects>,
    out: &mut Vec<Rekey>,
) {
    let Some(old) = old else {
        return;
    };
    for op in old.pools.iter() {
        let Some(aff) = op.affinity else {
            continue;
        };
        let np = new.pools.iter_mut().find(|p| p.affinity == Some(aff));
        let Some(np) = np else {
            // The selection went, or its affinity did: forget its records.
            out.extend((0..op.values.len() as u32).map(|from| Rekey {
                timeout: aff.timeout,
                id: aff.id,
                from,
                to: None,
            }));
            continue;
        };
        let n = np.values.len();
        let wanted: HashSet<&DnatTarget> = np.values.iter().collect();
        let mut placed: Vec<Option<DnatTarget>> = vec![None; n];
        for (j, v) in op.values.iter().enumerate().take(n) {
            if wanted.contains(v) {
                placed[j] = Some(*v);
            }
        }
        let taken: HashSet<DnatTarget> = placed.iter().flatten().copied().collect();
        let mut rest = np.values.iter().filter(|v| !taken.contains(*v)).copied();
        let values: Vec<DnatTarget> = placed
            .into_iter()
            .map(|p| p.or_else(|| rest.next()))
            .collect::<Option<Vec<_>>>()
            .unwrap_or_else(|| np.values.clone());
        let at: HashMap<&DnatTarget, u32> = values
            .iter()
            .enumerate()
            .map(|(k, v)| (v, k as u32))
            .collect();
        for (j, v) in op.values.iter().enumerate() {
            let j = j as u32;
            let to = at.get(v).copied();
            if to != Some(j) {
                out.push(Rekey {
                    timeout: aff.timeout,
                    id: aff.id,
                    from: j,
                    to,
                });
            }
        }
        np.values = values;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::{Pool, PoolAffinity, PoolKind};
    use kp_model::Protocol;

    const AFF: PoolAffinity = PoolAffinity { timeout: 60, id: 7 };

    fn objs(eps: &[&str]) -> ServiceObjects {
        let kind = PoolKind::Endpoints(Protocol::Tcp);
        ServiceObjects {
            pools: vec![Pool {
                kind,
                values: eps
                    .iter()
                    .map(|e| e.parse::<std::net::SocketAddr>().unwrap().into())
                    .collect(),
                map: kind.shard(0),
                base: 0,
                cap: 0,
                affinity: Some(AFF),
            }],
            ..Default::default()
        }
    }

    fn order(o: &ServiceObjects) -> Vec<String> {
        o.pools[0].values.iter().map(|v| v.to_string()).collect()
    }

    fn rekey(from: u32, to: Option<u32>) -> Rekey {
        Rekey {
            timeout: AFF.timeout,
            id: AFF.id,
            from,
            to,
        }
    }

    /// Endpoints keep their index while they stay: a replaced one's
    /// successor takes its index (its clients are forgotten), one that must
    /// move down when the count shrinks takes a freed index (its clients
    /// follow), a new one takes a free index.
    #[test]
    fn affinity_endpoints_keep_their_index() {
        let old = objs(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        // The model sorts: the replacement would land elsewhere.
        let mut new = objs(&["10.0.0.1:80", "10.0.0.3:80", "10.0.0.9:80"]);
        let mut out = Vec::new();
        keep_affinity_places(&mut new, Some(&old), &mut out);
        assert_eq!(
            order(&new),
            ["10.0.0.1 . 80", "10.0.0.9 . 80", "10.0.0.3 . 80"]
        );
        assert_eq!(out, [rekey(1, None)]);

        let mut fewer = objs(&["10.0.0.3:80", "10.0.0.9:80"]);
        let mut out = Vec::new();
        keep_affinity_places(&mut fewer, Some(&new), &mut out);
        assert_eq!(order(&fewer), ["10.0.0.3 . 80", "10.0.0.9 . 80"]);
        assert_eq!(out, [rekey(0, None), rekey(2, Some(0))]);

        let mut more = objs(&["10.0.0.3:80", "10.0.0.4:80", "10.0.0.9:80"]);
        let mut out = Vec::new();
        keep_affinity_places(&mut more, Some(&fewer), &mut out);
        assert_eq!(
            order(&more),
            ["10.0.0.3 . 80", "10.0.0.9 . 80", "10.0.0.4 . 80"]
        );
        assert!(out.is_empty(), "{out:?}");

        // The selection goes (no endpoints, or affinity turned off).
        let mut out = Vec::new();
        keep_affinity_places(&mut ServiceObjects::default(), Some(&more), &mut out);
        assert_eq!(out, [rekey(0, None), rekey(1, None), rekey(2, None)]);
    }
}
