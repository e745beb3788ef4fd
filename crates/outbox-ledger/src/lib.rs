//! The ledger: everything outboxd writes to PostgreSQL with ordinary SQL.
//!
//! * [`migrate`] — the versioned, idempotent SQL migrations from `migrations/`.
//! * [`producer`] — the thin Rust helper over `outbox.enqueue(...)`.
//! * [`accept`] — the single acceptance point: a batch of broker receipts (and quarantine
//!   records) plus the checkpoint that covers them, in one transaction.
//! * [`attempts`] — DISPATCH_UNKNOWN attempts and their reconciliation.
//! * [`destination`] — explicit destination migration (new envelope generation, with proof).
//! * [`checkpoint`] — the per-slot checkpoint row: the only LSN the relay may confirm.
//! * [`numbering`] — the versions the relay gave rows written without one, kept with the
//!   checkpoint.
//! * [`lease`] — relay leases and generations (one active relay per slot, fenced).
//! * [`sessions`] — a run's sessions, named by slot and generation; an earlier holder's
//!   ended by the next, under the lease.
//! * [`holds`] — held aggregates: loading them, operator release/skip, republishing.
//! * [`status`] — read-only views for `outboxd status`.
//! * [`consumers`] — the consumer registry (mandatory/optional) and what consumers applied.
//! * [`audit`] — the ledger side of `outboxd reconcile` (aged PENDING/UNKNOWN, conflicts).
//! * [`retention`] — PUBLISHED -> RETAINED -> PURGED (`outboxd purge`).
//!
//! Why a ledger in PostgreSQL at all: the slot's confirmed LSN is a single number that can
//! only say "everything before here is done". The ledger is where "done" is proven per event
//! (which partition/offset, which attempt), so that a replay after a crash is recognised as a
//! duplicate instead of becoming a second publish slot.

pub mod accept;
pub mod attempts;
pub mod audit;
pub mod checkpoint;
pub mod consumers;
pub mod destination;
pub mod holds;
pub mod hooks;
pub mod lease;
pub mod migrate;
pub mod numbering;
pub mod privileges;
pub mod producer;
pub mod retention;
pub mod sessions;
pub mod status;

pub use accept::{
    AcceptOutcome, HeldRecord, HoldRecord, LedgerItem, QuarantineRecord, ReceiptRecord,
};
pub use checkpoint::Checkpoint;

use outbox_core::policy::{self, recovery, Channel};

/// A ledger operation failed. Says which operation; the source carries PostgreSQL's message.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("{context}: {}", describe_db_error(source))]
    Db {
        context: String,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("migration {version} ({name}) was changed after it was applied (checksum {applied} in the database, {file} in this binary); never edit an applied migration, add a new one")]
    MigrationChanged {
        version: i32,
        name: String,
        applied: String,
        file: String,
    },
    #[error("the database has migration {version} applied, which this outboxd does not know; upgrade outboxd")]
    MigrationFromFuture { version: i32 },
    #[error("{0}")]
    Invalid(String),
    #[error("relay generation {generation} no longer holds the lease of slot {slot}: another relay took over; receipts of requests already sent were recorded, the checkpoint was not moved")]
    LeaseLost { slot: String, generation: i64 },
    #[error("the checkpoint of slot {slot} moved to {checkpoint} after this run planned to stream from {start} (a relay that lost the lease committed a last acceptance); the run starts again from the checkpoint")]
    CheckpointMoved {
        slot: String,
        start: outbox_core::Lsn,
        checkpoint: outbox_core::Lsn,
    },
}

impl LedgerError {
    /// Whether reconnecting and replaying can fix it: a lost lease (another relay goes on), a
    /// database error the policy in [`outbox_core::policy`] retries. A missing privilege or
    /// object, a changed migration, invalid data: no.
    pub fn is_transient(&self) -> bool {
        match self {
            LedgerError::Db { source, .. } => {
                recovery(source.code().map(|c| c.code()), Channel::Sql).is_retry()
            }
            LedgerError::LeaseLost { .. } | LedgerError::CheckpointMoved { .. } => true,
            _ => false,
        }
    }

    /// Whether a plain insert of receipt entries met an event that already has its primary
    /// receipt (the unique violation of `receipt_entries_pkey`): the optimistic acceptance
    /// then accepts the batch again with duplicates classified ([`accept`]).
    pub(crate) fn is_taken_publish_slot(&self) -> bool {
        match self {
            LedgerError::Db { source, .. } => source.as_db_error().is_some_and(|db| {
                *db.code() == tokio_postgres::error::SqlState::UNIQUE_VIOLATION
                    && db.constraint() == Some("receipt_entries_pkey")
            }),
            _ => false,
        }
    }
}

/// Attaches `context` to a tokio-postgres error.
pub(crate) trait Context<T> {
    fn ctx(self, context: impl Into<String>) -> Result<T, LedgerError>;
}

impl<T> Context<T> for Result<T, tokio_postgres::Error> {
    fn ctx(self, context: impl Into<String>) -> Result<T, LedgerError> {
        self.map_err(|source| LedgerError::Db {
            context: context.into(),
            source,
        })
    }
}

/// Renders a tokio-postgres error with the server's message, detail and hint, which its
/// `Display` alone omits.
pub fn describe_db_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let mut s = format!("{} (SQLSTATE {})", db.message(), db.code().code());
            if let Some(fix) = policy::fix(db.code().code(), Channel::Sql) {
                s.push_str("; ");
                s.push_str(fix);
            }
            if let Some(d) = db.detail() {
                s.push_str(&format!("; detail: {d}"));
            }
            if let Some(h) = db.hint() {
                s.push_str(&format!("; hint: {h}"));
            }
            s
        }
        None => {
            let mut s = e.to_string();
            let mut src = std::error::Error::source(e);
            while let Some(inner) = src {
                s.push_str(&format!(": {inner}"));
                src = inner.source();
            }
            s
        }
    }
}
