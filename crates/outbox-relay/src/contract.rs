//! What the relay core and its drivers (the daemon, the simulator) exchange: the aggregate
//! key, what the driver tells the core ([`Now`]), what the core asks ([`Command`]) and
//! answers ([`Reported`]), and how the contract can be broken ([`CoreError`]). A leaf of the
//! crate: the decision modules all read it, and it reads none of them.

use std::sync::Arc;
use std::time::SystemTime;

use outbox_core::ack::AckError;
use outbox_core::delivery::Persistence;
use outbox_core::{EventToken, Lsn, OutboxEvent};
use uuid::Uuid;

/// An aggregate: (aggregate type, aggregate id).
pub type AggKey = (String, String);

/// Payload bytes sent and not yet reported on, beyond which the relay stops reading the slot
/// (with `max_in_flight`): the producer holds a copy of each, so large payloads would
/// otherwise grow the relay's memory with `max_in_flight` × payload size.
pub const MAX_IN_FLIGHT_BYTES: usize = 16 * 1024 * 1024;

/// Payload bytes of the events waiting on unclear outcomes beyond which the relay stops
/// reading the slot (with `unclear_max_waiting` events): the count alone would let large
/// payloads grow the relay's memory with the count × payload size while a destination is
/// down.
pub const MAX_WAITING_BYTES: u64 = 64 * 1024 * 1024;

/// What the driver knows that the core may not find out by itself.
#[derive(Debug, Clone, Copy)]
pub struct Now {
    /// Wall-clock time: stamped on sends (the UNKNOWN record's `sent_at`).
    pub wall: SystemTime,
    /// Whether this relay's lease is certainly still held: without it, nothing is sent.
    pub lease_valid: bool,
}

/// An event waiting for, or in, its send.
#[derive(Debug, Clone)]
pub struct Pending {
    pub ev: OutboxEvent,
    /// `None` for events published from the initial snapshot or an operator's release.
    pub commit_lsn: Option<Lsn>,
    /// The LSN of the row's change record when it was read from the stream (with
    /// `commit_lsn` its stream position, which the receipt carries); `None` otherwise.
    pub change_lsn: Option<Lsn>,
    /// The ack tracker's token: resolving it lets the checkpoint pass the event.
    pub ack: Option<EventToken>,
}

/// What the driver must do.
#[derive(Debug, Clone)]
pub enum Command {
    /// Hand `event` to the sink with `token`. A refusal goes back through
    /// [`crate::PipelineCore::send_refused`]; otherwise one delivery report follows.
    Send {
        token: u64,
        attempt: i32,
        /// Shared with the core's in-flight record (one copy of the event per send).
        event: Arc<OutboxEvent>,
    },
}

/// A delivery report without a receipt and without a refusal: the event holds its aggregate
/// until a look-up or a resend resolves it (module `unclear`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryFailure {
    pub event_id: Uuid,
    pub error: String,
    pub persistence: Persistence,
    /// The broker may have the message: record this before anything else happens to the
    /// event, so that the next start reconciles it (scan the partition) instead of assuming.
    pub unknown: Option<UnknownAttempt>,
}

/// An attempt whose outcome is DISPATCH_UNKNOWN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownAttempt {
    pub event_id: Uuid,
    pub attempt: i32,
    pub topic: String,
    pub partition: i32,
    pub sent_at: SystemTime,
    pub error: String,
    /// For a row written without a version: the version and route version the relay gave it
    /// (read from SQL the row has neither, and a look-up must publish as the relay did).
    pub by_relay: Option<(i64, Option<i64>)>,
}

/// What a delivery report led to.
#[derive(Debug, Clone)]
pub enum Reported {
    /// Recorded; the commands send the aggregate's next event, if it has one.
    Continue(Vec<Command>),
    /// The outcome is unclear (or the broker certainly did not store it): only its aggregate
    /// waits. Record the [`DeliveryFailure::unknown`] attempt, if any, before anything else
    /// happens to the event; the core asks for its look-up or resend when due.
    Unclear(DeliveryFailure),
}

/// A broken contract between the driver and the core: never transient.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("ack tracker: {0}")]
    Ack(#[from] AckError),
    #[error("a delivery report or refusal for token {0}, which is not in flight")]
    UnknownToken(u64),
    #[error("the ordering gate asked for the head of an aggregate it was given")]
    NeedHead,
    #[error("replication protocol: {0}")]
    Protocol(&'static str),
    /// Only with the planted [`crate::Mutant::EndsRunOnUnclear`]: the shipped core parks the event.
    #[error("an unclear delivery report ended the run (planted mutant): {0}")]
    UnclearEndsRun(String),
}

pub(crate) fn key_of(ev: &OutboxEvent) -> AggKey {
    (ev.aggregate_type.clone(), ev.aggregate_id.clone())
}

/// An aggregate as the numbering keeps it: its type and id in one allocation, a NUL between
/// them (PostgreSQL text cannot hold one, so the split is exact). The numbering holds an
/// entry for every aggregate a run numbered: as a pair of `String`s, 100,000 aggregates cost
/// the relay 10 MiB more RSS than a run that numbered nothing (58.8 against 49.2 MiB peak,
/// embedded broker, 1,000,000 events).
pub(crate) type NumKey = Box<str>;

pub(crate) fn num_key(aggregate_type: &str, aggregate_id: &str) -> NumKey {
    let mut k = String::with_capacity(aggregate_type.len() + 1 + aggregate_id.len());
    k.push_str(aggregate_type);
    k.push('\0');
    k.push_str(aggregate_id);
    k.into_boxed_str()
}

/// The aggregate `k` ([`num_key`]) names.
pub(crate) fn agg_of_num_key(k: &str) -> AggKey {
    let (t, i) = k.split_once('\0').expect("a numbering key holds a NUL");
    (t.to_string(), i.to_string())
}

/// Events waiting on unclear outcomes (`PipelineCore::waiting_on_unclear`), or a bound of them
/// (`crate::schedule::Bounds`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Waiting {
    pub events: u64,
    /// Their payloads' bytes.
    pub bytes: u64,
}
