//! The relay's decisions as a deterministic state machine: no I/O, no clock of its own.
//!
//! The daemon (`crates/outboxd/src/relay`) owns the connections, the tasks and the `select!`;
//! it feeds what happened into this crate (an event decoded, a delivery report, the sink
//! refusing a message, an acceptance transaction that failed) and executes what comes back
//! (send this event with this token, record this attempt as DISPATCH_UNKNOWN, accept this
//! batch with this checkpoint). The time and the lease's validity are inputs ([`Now`]), so
//! the same code runs under unit tests, property tests and a simulator with the same result
//! for the same inputs — the style of quinn-proto and TigerBeetle's replica.
//!
//! * [`route`] — may this relay publish this event (frozen destination vs what it serves)?
//! * [`pipeline`] — route → ordering gate → send → delivery report → ledger batch, and the
//!   checkpoint a batch justifies.
//! * [`lifecycle`] — the lease's timing, and whether a run that ended with an error reconnects
//!   (after which backoff) or stops the process.
//! * [`release`] — republishing an aggregate an operator released: version order, one event
//!   at a time, when to close the hold.
//! * [`stage`] — which decoded messages wait until their aggregates' heads are read.
//! * [`stream`] — transaction framing (Begin, row, Commit, keepalive), the positions received
//!   and committed, and the standby status.
//! * [`schedule`] — when the loop reads the slot (backpressure), accepts a batch, writes an
//!   idle checkpoint, polls releases and sends a standby status; and what the standby status
//!   confirms ([`schedule::standby_status`], the safety argument).
//!
//! * [`pace`] — how a read outside the stream (the initial snapshot, a poll round) keeps within
//!   the relay's bounds: when it waits, accepts a batch, goes on or is over.
//! * [`poll`] — which rows of a poll-mode round are admitted, and the head each raises.
//! * [`fleet`] — a fleet member's share of the shards: which to take, hand over or give up.
//! * [`unknown`] — which DISPATCH_UNKNOWN attempts to look up now, and what a look-up means
//!   for the relay.
//! * [`txn`] — exactly-once into Kafka: a slot's events in broker transactions, one per
//!   batch; what a restart accepts from the broker's records instead of sending again.
//!
//! Three leaves every module above reads, and which read none of them (no module of this
//! crate reaches itself through its imports: `outbox-testkit`'s `module_cycles` test):
//! [`contract`] (what the core and its drivers exchange), [`plant`] (the planted mutants) and
//! [`parked`] (an unclear outcome's parked event and its retry policy).
//!
//! The start-up plan is `outbox_source::slot::plan` (pure as well).

pub mod contract;
pub mod fleet;
pub mod lifecycle;
pub mod pace;
pub mod parked;
pub mod pipeline;
pub mod plant;
pub mod poll;
pub mod read;
pub mod release;
pub mod route;
pub mod schedule;
pub mod stage;
pub mod stream;
pub mod txn;
pub mod unknown;

#[cfg(test)]
pub(crate) mod testing;

pub use contract::{
    AggKey, Command, CoreError, DeliveryFailure, Now, Pending, Reported, UnknownAttempt,
    MAX_IN_FLIGHT_BYTES, MAX_WAITING_BYTES,
};
pub use parked::{
    LookupOutcome, Policy as UnclearPolicy, Schedule as UnclearSchedule, UnclearStep,
    UNANSWERED_AFTER,
};
pub use pipeline::unclear::{LookupFor, OpenAttempt, ParkedInput, ParkedLookup, ParkedStep};
pub use pipeline::{Acceptance, AcceptanceEnd, PipelineCore};
pub use route::Refusal;

pub use plant::{CurrentRoute, Mutant, Plant, Planted, Shipped};
