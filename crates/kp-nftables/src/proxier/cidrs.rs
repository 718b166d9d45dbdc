//! The Service ranges `cluster-ips-check` drops traffic to (upstream's
//! "drop traffic to unallocated ClusterIPs", #122692): the configured
//! ones (`ProxierConfig::service_cidrs`) and the cluster's ServiceCIDR
//! objects, which the model keeps in `ProxyState::service_cidrs` and which
//! change at run time. A change rebuilds the skeleton, and the next sync
//! rewrites the chain: a full or adopting sync with the rest of the
//! skeleton, a partial one on its own.

use ipnet::IpNet;
use kp_model::{IpFamily, ProxierConfig, ProxyState};

use super::programmed::Programmed;
use super::tx::{chain, op, Tx};
use super::NftablesProxier;
use crate::names::CLUSTER_IPS_CHECK;
use crate::render::Skeleton;
use crate::types::Verb;

/// The configured ranges and `dynamic`, of the proxier's family, sorted,
/// each once.
pub(super) fn effective(cfg: &ProxierConfig, dynamic: &[IpNet]) -> Vec<IpNet> {
    let mut all: Vec<IpNet> = cfg
        .service_cidrs
        .iter()
        .chain(dynamic)
        .filter(|n| match cfg.family {
            IpFamily::V4 => matches!(n, IpNet::V4(_)),
            IpFamily::V6 => matches!(n, IpNet::V6(_)),
        })
        .map(IpNet::trunc)
        .collect();
    all.sort();
    all.dedup();
    all
}

impl NftablesProxier {
    /// The skeleton for `ranges`.
    fn skeleton_with(&self, ranges: &[IpNet]) -> Skeleton {
        let mut cfg = self.cfg.clone();
        cfg.service_cidrs = ranges.to_vec();
        Skeleton::new(&cfg)
    }

    /// Brings the skeleton to `state`'s Service ranges (before a sync).
    pub(super) fn follow_service_cidrs(&mut self, state: &ProxyState) {
        let want = effective(&self.cfg, &state.service_cidrs);
        if want != self.check_cidrs {
            tracing::info!(family = ?self.cfg.family, ranges = ?want, "Service ranges changed; traffic to their unallocated addresses is dropped");
            self.skeleton = self.skeleton_with(&want);
            self.check_cidrs = want;
        }
    }

    /// A skeleton for `state` when the proxier's is not (a render without a
    /// sync: --dry-run), and the ranges either drops.
    pub(super) fn skeleton_for(&self, state: &ProxyState) -> (Option<Skeleton>, Vec<IpNet>) {
        let want = effective(&self.cfg, &state.service_cidrs);
        if want == self.check_cidrs {
            (None, want)
        } else {
            (Some(self.skeleton_with(&want)), want)
        }
    }

    /// In a partial sync: rewrites `cluster-ips-check` when the kernel's
    /// (`prog`) drops other ranges than the skeleton's.
    pub(super) fn rewrite_cluster_ips_check(&self, tx: &mut Tx, prog: &mut Programmed) {
        if prog.check_cidrs == self.check_cidrs {
            return;
        }
        let Some((_, _, rules)) = self
            .skeleton
            .chains
            .iter()
            .find(|(name, _, _)| *name == CLUSTER_IPS_CHECK)
        else {
            return;
        };
        tx.rules.push(op(Verb::Flush, chain(CLUSTER_IPS_CHECK)));
        tx.ops += 1;
        tx.add_rules(CLUSTER_IPS_CHECK, rules.clone());
        prog.check_cidrs.clone_from(&self.check_cidrs);
    }
}
