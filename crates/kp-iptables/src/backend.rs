//! Which [`Writer`] a family gets: iptables-nft over netlink, or the
//! iptables programs (kp-xtables) given the rules' text.

use kp_model::{DataplaneError, IpFamily};
use kp_xtables::{detect_variant, Adopted, IptablesCli, Jump, Variant};

use crate::types::Restore;
use crate::writer::Writer;

/// The writer for `--iptables-backend` (`None`: detect, on first use so
/// that --dry-run runs nothing): iptables-nft is written over netlink
/// ([`crate::IptablesNetlink`]) unless `nft_restore` asks for
/// `iptables-nft-restore`; iptables-legacy always goes through its programs.
pub fn select(family: IpFamily, choice: Option<Variant>, nft_restore: bool) -> Box<dyn Writer> {
    Box::new(Selected {
        family,
        choice,
        nft_restore,
        inner: None,
    })
}

struct Selected {
    family: IpFamily,
    choice: Option<Variant>,
    nft_restore: bool,
    inner: Option<Box<dyn Writer>>,
}

impl Selected {
    fn inner(&mut self) -> &mut dyn Writer {
        let (family, choice, nft_restore) = (self.family, self.choice, self.nft_restore);
        self.inner
            .get_or_insert_with(|| {
                let v = choice.unwrap_or_else(|| detect_variant(family));
                let how = if v == Variant::Nft && !nft_restore {
                    "netlink"
                } else {
                    "restore"
                };
                tracing::info!(
                    family = %family,
                    variant = v.as_str(),
                    detected = choice.is_none(),
                    writer = how,
                    "using iptables backend"
                );
                if how == "netlink" {
                    Box::new(crate::IptablesNetlink::new(family))
                } else {
                    Box::new(IptablesCli::variant(family, v))
                }
            })
            .as_mut()
    }
}

impl Writer for Selected {
    fn restore(&mut self, input: &Restore<'_>) -> Result<usize, DataplaneError> {
        self.inner().restore(input)
    }
    fn restore_adopting(
        &mut self,
        input: &Restore<'_>,
    ) -> Result<(usize, Option<Adopted>), DataplaneError> {
        self.inner().restore_adopting(input)
    }
    fn chains(&mut self, table: &str) -> Result<Vec<String>, DataplaneError> {
        self.inner().chains(table)
    }
    fn survey(
        &mut self,
        table: &str,
        jumps: &[Jump],
    ) -> Result<(Vec<String>, Vec<Jump>), DataplaneError> {
        self.inner().survey(table, jumps)
    }
    fn missing_jumps(&mut self, table: &str, jumps: &[Jump]) -> Result<Vec<Jump>, DataplaneError> {
        self.inner().missing_jumps(table, jumps)
    }
    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, DataplaneError> {
        self.inner().chain_exists(table, chain)
    }
    fn jump_exists(&mut self, j: &Jump) -> Result<bool, DataplaneError> {
        self.inner().jump_exists(j)
    }
    fn delete_jump(&mut self, j: &Jump) -> Result<(), DataplaneError> {
        self.inner().delete_jump(j)
    }
}
