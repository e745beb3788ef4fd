//! The pure core of outboxd: the vocabulary every other crate speaks, with no I/O.
//!
//! Nothing here touches a socket, a file or a clock, so every rule in this crate can be
//! unit-tested, property-tested against a model and driven by a deterministic simulator:
//!
//! * [`Lsn`] — a PostgreSQL WAL position.
//! * [`envelope`] — `outboxEnvelope.v1` and `destination.v1`, frozen at enqueue, and the
//!   digests that let the relay prove a row was not altered after it was frozen.
//! * [`state`] — the event life cycle (PENDING → SENDING → PUBLISHED …).
//! * [`ack`] — the ack tracker: the contiguous low-watermark of accepted receipts, which is
//!   the only LSN the relay may ever confirm to the slot (invariant 5).
//! * [`numbering`] — versions from commit order for rows written without one, and what a
//!   checkpoint must write so that a restart numbers them again the same way.
//! * [`ordering`] — the ordering gate: one in-flight event per aggregate, gaps hold the
//!   aggregate (invariant 7).
//! * [`placement`] — which partition count a producer with several versions of an aggregate
//!   in flight places keys by (a raised count is adopted only when nothing is in flight).
//! * [`receipt`] — the acceptance decisions: primary / duplicate / conflicting receipt, the
//!   DISPATCH_UNKNOWN resolution rule, and when a destination migration is allowed.
//! * [`delivery`] — what a broker said about one send (the sinks' delivery reports), and
//!   what a sink serves.
//! * [`lease`] — who may take a slot's lease, and when (two generations never send at once).
//! * [`records`] — what the relay records durably (receipts, quarantine, holds).
//! * [`policy`] — which PostgreSQL failures a retry can fix and which stop the relay with a fix.

/// A product rule with one simulator mutant as a const-generic flag: `$name` (the flag
/// `false`, what the product runs) is built by `default()`, `$name<true>` only by the
/// mutant's constructor `$ctor`, which only the simulator calls. No crate feature changes the
/// product's code, so the binary tested is the one shipped. The rule's methods are written
/// once, generic over the flag.
macro_rules! rule_with_mutant {
    (
        $(#[$attr:meta])*
        pub struct $name:ident<const $flag:ident>;
        $(#[$ctor_attr:meta])*
        pub fn $ctor:ident;
    ) => {
        $(#[$attr])*
        #[derive(Debug, Clone, Copy)]
        pub struct $name<const $flag: bool = false> {
            /// Built with `default()` (the product) or the mutant's constructor only.
            _private: (),
        }

        impl Default for $name {
            fn default() -> Self {
                $name { _private: () }
            }
        }

        impl $name<true> {
            $(#[$ctor_attr])*
            pub fn $ctor() -> Self {
                $name { _private: () }
            }
        }
    };
}

pub mod ack;
pub mod delivery;
pub mod destination;
pub mod envelope;
pub mod lease;
pub mod lsn;
pub mod numbering;
pub mod ordering;
pub mod placement;
pub mod policy;
pub mod receipt;
pub mod records;
pub mod route;
pub mod state;

pub use ack::{AckTracker, EventToken, TxnSeq};
pub use envelope::{Destination, EnvelopeError, OutboxEvent, RowError, EVENT_COLUMNS};
pub use lsn::Lsn;
pub use ordering::{Admit, HoldReason, OrderingGate};
pub use route::{RouteVersion, RouteVersions};
pub use state::EventState;
