//! Where iptables mode's typed rules go: [`Writer`].

use kp_model::DataplaneError;
use kp_xtables::{Adopted, IptablesBackend, Jump};

use crate::types::Restore;

/// What the proxier needs of an iptables writer. [`crate::IptablesNetlink`]
/// encodes the typed rules; anything that takes iptables-restore text (the
/// iptables programs, a test's recorder) is one through its `Display`.
pub trait Writer: Send {
    /// Applies `input` as `iptables-restore --noflush` would: every table in
    /// it is committed, or nothing is. Returns the bytes handed to the
    /// kernel or the program.
    fn restore(&mut self, input: &Restore<'_>) -> Result<usize, DataplaneError>;
    /// `restore`, keeping the chains the kernel already holds exactly as
    /// `input` declares them ([`IptablesBackend::restore_adopting`]): the
    /// bytes handed over, and what was found (None from a writer that
    /// cannot read rules back: it restored the whole input).
    fn restore_adopting(
        &mut self,
        input: &Restore<'_>,
    ) -> Result<(usize, Option<Adopted>), DataplaneError>;
    /// Names of the chains in `table`.
    fn chains(&mut self, table: &str) -> Result<Vec<String>, DataplaneError>;
    /// The chains of `table` and which of `jumps` are missing there.
    fn survey(
        &mut self,
        table: &str,
        jumps: &[Jump],
    ) -> Result<(Vec<String>, Vec<Jump>), DataplaneError>;
    /// Which of `jumps` (those of `table`) are missing.
    fn missing_jumps(&mut self, table: &str, jumps: &[Jump]) -> Result<Vec<Jump>, DataplaneError>;
    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, DataplaneError>;
    fn jump_exists(&mut self, jump: &Jump) -> Result<bool, DataplaneError>;
    /// Deletes the first rule that is `jump`.
    fn delete_jump(&mut self, jump: &Jump) -> Result<(), DataplaneError>;
}

/// The iptables programs, and anything else that takes restore text.
impl<T: IptablesBackend> Writer for T {
    fn restore(&mut self, input: &Restore<'_>) -> Result<usize, DataplaneError> {
        let text = input.text();
        IptablesBackend::restore(self, &text)?;
        Ok(text.len())
    }
    fn restore_adopting(
        &mut self,
        input: &Restore<'_>,
    ) -> Result<(usize, Option<Adopted>), DataplaneError> {
        let text = input.text();
        let found = IptablesBackend::restore_adopting(self, &text)?;
        Ok((text.len(), found))
    }
    fn chains(&mut self, table: &str) -> Result<Vec<String>, DataplaneError> {
        IptablesBackend::chains(self, table)
    }
    fn survey(
        &mut self,
        table: &str,
        jumps: &[Jump],
    ) -> Result<(Vec<String>, Vec<Jump>), DataplaneError> {
        IptablesBackend::survey(self, table, jumps)
    }
    fn missing_jumps(&mut self, table: &str, jumps: &[Jump]) -> Result<Vec<Jump>, DataplaneError> {
        IptablesBackend::missing_jumps(self, table, jumps)
    }
    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, DataplaneError> {
        IptablesBackend::chain_exists(self, table, chain)
    }
    fn jump_exists(&mut self, j: &Jump) -> Result<bool, DataplaneError> {
        self.rule_exists(j.table, j.from, &j.args())
    }
    fn delete_jump(&mut self, j: &Jump) -> Result<(), DataplaneError> {
        self.delete_rule(j.table, j.from, &j.args())
    }
}
