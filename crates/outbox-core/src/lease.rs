//! Who may take a slot's lease, and when: the rule that keeps two relay generations from
//! sending at once.
//!
//! A lease (`outbox.relay_leases`) names its holder, a generation and a deadline. The ledger
//! takes it in one statement (`outbox_ledger::lease::try_acquire`, migration 0018), which is
//! this rule in SQL; `a_lease_is_taken_as_the_rule_says` (outbox-ledger's tests) checks every
//! combination of [`LeaseFacts`] against that statement, and the simulator decides its
//! takeovers with this rule (its mutant `early-takeover-of-live-holder` plants
//! [`TakeoverRule::without_proof`], counted by `stale_sends`).
//!
//! Before its deadline a lease is taken only with proof that its holder is gone: the holder
//! took the lease's session advisory lock when it took the lease (`holder_locks`), the taker
//! now holds that lock (so the holder's session ended: a SIGKILLed process's does, a paused
//! one's does not), and no walsender streams the slot. A paused holder that resumes before its
//! deadline may still send; taking its lease early would let two generations send at once.

/// What the taker knows about a slot's lease when it tries to take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseFacts {
    /// There is no lease row yet.
    pub free: bool,
    /// Its deadline has passed.
    pub expired: bool,
    /// It names the taker as its owner (a new run of the same relay).
    pub ours: bool,
    /// The taker holds the lease's session advisory lock.
    pub taker_locked: bool,
    /// The holder took that lock when it took the lease.
    pub holder_locks: bool,
    /// A walsender streams the slot.
    pub slot_active: bool,
}

/// Whether the lease may be taken, and whether before its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Taken: free, expired or ours (`early` false), or from a holder proven gone (`early`).
    Taken { early: bool },
    /// Held by a holder that may be alive: wait for its deadline.
    Held,
}

rule_with_mutant! {
    /// The takeover rule, with the simulator's product mutant: `WITHOUT_PROOF` takes a live lease
    /// from a holder that took the session lock, whether or not that holder is gone (the lock and
    /// the walsender ignored). The ledger and the daemon use [`TakeoverRule::default`] (`false`)
    /// in every build.
    pub struct TakeoverRule<const WITHOUT_PROOF>;
    /// The simulator's mutant `early-takeover-of-live-holder`.
    pub fn without_proof;
}

impl<const WITHOUT_PROOF: bool> TakeoverRule<WITHOUT_PROOF> {
    /// See the module documentation.
    pub fn take(&self, f: LeaseFacts) -> Take {
        if f.free || f.expired || f.ours {
            return Take::Taken { early: false };
        }
        let gone = f.holder_locks && (WITHOUT_PROOF || (f.taker_locked && !f.slot_active));
        if gone {
            Take::Taken { early: true }
        } else {
            Take::Held
        }
    }
}

/// [`TakeoverRule::default`]'s decision.
pub fn take(f: LeaseFacts) -> Take {
    TakeoverRule::default().take(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIVE: LeaseFacts = LeaseFacts {
        free: false,
        expired: false,
        ours: false,
        taker_locked: false,
        holder_locks: true,
        slot_active: false,
    };

    #[test]
    fn a_live_lease_is_taken_early_only_with_proof_that_its_holder_is_gone() {
        assert_eq!(take(LIVE), Take::Held, "the holder's session lives");
        let gone = LeaseFacts {
            taker_locked: true,
            ..LIVE
        };
        assert_eq!(take(gone), Take::Taken { early: true });
        for not_proof in [
            LeaseFacts {
                slot_active: true,
                ..gone
            },
            LeaseFacts {
                holder_locks: false,
                ..gone
            },
        ] {
            assert_eq!(take(not_proof), Take::Held, "{not_proof:?}");
        }
        for f in [
            LeaseFacts { free: true, ..LIVE },
            LeaseFacts {
                expired: true,
                ..LIVE
            },
            LeaseFacts { ours: true, ..LIVE },
        ] {
            assert_eq!(take(f), Take::Taken { early: false }, "{f:?}");
        }
        // The mutant takes a live holder's lease without the proof.
        assert_eq!(
            TakeoverRule::without_proof().take(LIVE),
            Take::Taken { early: true }
        );
    }
}
