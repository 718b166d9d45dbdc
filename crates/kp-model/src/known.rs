//! The protocol every dataplane's sync follows around what it knows it has
//! programmed, written once:
//!
//! * a sync is full when the loop asks for one or when nothing is known to
//!   be programmed (the first sync, after a failure, after the canary);
//! * the known state is taken out for the sync, so any error (an early
//!   return) leaves nothing known and the retry is full;
//! * a sync that succeeded hands back what is now in force.
//!
//! Each dataplane supplies only its own full and partial sync, by matching
//! on [`Start`].

/// How a sync starts.
#[derive(Debug)]
pub enum Start<T> {
    /// Rewrite everything; `last` is what the previous sync of this
    /// process programmed, when there was one that succeeded (a full sync
    /// may use it to change only what differs).
    Full { last: Option<T> },
    /// Send only the difference from `prev`.
    Partial { prev: T },
}

impl<T> Start<T> {
    pub fn is_full(&self) -> bool {
        matches!(self, Start::Full { .. })
    }
}

/// What a dataplane knows it has programmed (`T`: its own record).
#[derive(Debug)]
pub struct Known<T> {
    inner: Option<T>,
}

impl<T> Default for Known<T> {
    fn default() -> Self {
        Known { inner: None }
    }
}

impl<T> Known<T> {
    /// Starts a sync (see the module's protocol).
    pub fn begin(&mut self, full: bool) -> Start<T> {
        match self.inner.take() {
            Some(prev) if !full => Start::Partial { prev },
            last => Start::Full { last },
        }
    }

    /// The sync succeeded: `now` is in force.
    pub fn done(&mut self, now: T) {
        self.inner = Some(now);
    }

    /// Nothing is known any more: the next sync is full.
    pub fn forget(&mut self) {
        self.inner = None;
    }

    pub fn is_known(&self) -> bool {
        self.inner.is_some()
    }

    pub fn get(&self) -> Option<&T> {
        self.inner.as_ref()
    }

    /// The canary: when something is known, asks `present` whether our
    /// rules are still there. When they are gone, forgets (the next sync is
    /// full) and answers true. A check that fails is logged and counts as
    /// present: a canary that cannot be read must not rewrite every rule at
    /// every sync.
    pub fn check_lost<E: std::fmt::Display>(
        &mut self,
        canary: &str,
        present: impl FnOnce() -> Result<bool, E>,
    ) -> bool {
        if self.inner.is_none() {
            return false;
        }
        match present() {
            Ok(true) => false,
            Ok(false) => {
                self.inner = None;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "{canary} canary check failed");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_when_asked_or_nothing_is_known_and_an_error_forgets() {
        let mut k: Known<u32> = Known::default();
        assert!(matches!(k.begin(false), Start::Full { last: None }));
        k.done(1);
        assert!(matches!(k.begin(false), Start::Partial { prev: 1 }));
        // The partial sync above returned early (an error): nothing known.
        assert!(!k.is_known());
        assert!(matches!(k.begin(false), Start::Full { last: None }));
        k.done(2);
        assert!(matches!(k.begin(true), Start::Full { last: Some(2) }));
        k.done(3);
        assert_eq!(k.get(), Some(&3));
    }

    #[test]
    fn the_canary_forgets_only_when_the_rules_are_gone() {
        let mut k: Known<u32> = Known::default();
        let mut asked = false;
        assert!(!k.check_lost("test", || {
            asked = true;
            Ok::<_, String>(false)
        }));
        assert!(!asked, "nothing known: nothing to check");
        k.done(1);
        assert!(!k.check_lost("test", || Ok::<_, String>(true)));
        assert!(!k.check_lost("test", || Err("cannot read".to_string())));
        assert!(k.is_known());
        assert!(k.check_lost("test", || Ok::<_, String>(false)));
        assert!(!k.is_known());
    }
}
