//! The life cycle of one event, as the ledger records it.
//!
//! ```text
//! PENDING -> SENDING -> PUBLISHED -> RETAINED -> PURGED
//!               \-> DISPATCH_UNKNOWN -> RECONCILING -> PUBLISHED
//!                                                  \-> RETRY -> SENDING (same frozen destination)
//! any -> QUARANTINED (malformed row, permanent broker error); HELD (behind a quarantined
//! event of the same aggregate)
//! ```
//! UNKNOWN stays unknown until proven: there is deliberately no edge from
//! `DispatchUnknown` to `Published` or `Retry` that skips `Reconciling`.

use std::fmt;

/// Where an event is in its life cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventState {
    Pending,
    Sending,
    Published,
    Retained,
    Purged,
    DispatchUnknown,
    Reconciling,
    Retry,
    Quarantined,
    Held,
}

impl EventState {
    /// The name stored in the ledger and shown to operators.
    pub fn as_str(self) -> &'static str {
        match self {
            EventState::Pending => "PENDING",
            EventState::Sending => "SENDING",
            EventState::Published => "PUBLISHED",
            EventState::Retained => "RETAINED",
            EventState::Purged => "PURGED",
            EventState::DispatchUnknown => "DISPATCH_UNKNOWN",
            EventState::Reconciling => "RECONCILING",
            EventState::Retry => "RETRY",
            EventState::Quarantined => "QUARANTINED",
            EventState::Held => "HELD",
        }
    }

    /// Whether the life cycle allows moving from `self` to `next`.
    pub fn can_move_to(self, next: EventState) -> bool {
        use EventState::*;
        matches!(
            (self, next),
            (Pending, Sending)
                | (Sending, Published)
                | (Sending, DispatchUnknown)
                | (DispatchUnknown, Reconciling)
                | (Reconciling, Published)
                | (Reconciling, Retry)
                | (Reconciling, DispatchUnknown)
                | (Retry, Sending)
                | (Published, Retained)
                | (Retained, Purged)
                | (Pending, Quarantined)
                | (Sending, Quarantined)
                | (Pending, Held)
                | (Held, Pending)
                | (Quarantined, Pending)
        )
    }
}

impl fmt::Display for EventState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::EventState::*;

    #[test]
    fn unknown_is_never_guessed() {
        assert!(!DispatchUnknown.can_move_to(Published));
        assert!(!DispatchUnknown.can_move_to(Retry));
        assert!(!DispatchUnknown.can_move_to(Sending));
        assert!(DispatchUnknown.can_move_to(Reconciling));
    }

    #[test]
    fn published_is_never_resent() {
        assert!(!Published.can_move_to(Sending));
        assert!(!Published.can_move_to(Retry));
        assert_eq!(Published.to_string(), "PUBLISHED");
    }
}
