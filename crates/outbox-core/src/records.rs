//! What the relay records durably, as values: receipts, quarantine and hold records, and the
//! events recorded as held. The relay core builds them, the ledger's acceptance transaction
//! writes them (`outbox_ledger::accept`), and the simulator's ledger model applies them.

use uuid::Uuid;

use crate::Lsn;

/// A broker receipt to accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiptRecord {
    pub event_id: Uuid,
    pub payload_digest: String,
    pub destination_digest: String,
    pub broker_kind: String,
    pub broker_cluster: String,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub timestamp_ms: Option<i64>,
    pub attempt: i32,
    pub relay_generation: i64,
    /// Commit LSN of the producing transaction; `None` for events published from the
    /// initial snapshot (they predate the slot).
    pub commit_lsn: Option<Lsn>,
}

/// An event the relay refuses to publish, with its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantineRecord {
    /// Event id as text, or `lsn:<commit lsn>:<n>` when the id itself is unreadable.
    pub key: String,
    pub event_id: Option<Uuid>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub aggregate_version: Option<i64>,
    pub reason_code: String,
    pub reason: String,
    pub commit_lsn: Lsn,
}

/// An aggregate that must not publish until an operator releases it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldRecord {
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub reason_code: String,
    pub reason: String,
    pub blocking_event_id: Option<Uuid>,
    pub blocking_version: Option<i64>,
}

/// An event of a held aggregate, recorded instead of published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldRecord {
    pub event_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_version: i64,
    pub commit_lsn: Option<Lsn>,
}

/// One thing to record durably.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerItem {
    Receipt(ReceiptRecord),
    Quarantine(QuarantineRecord),
    Hold(HoldRecord),
    Held(HeldRecord),
}
