//! The sink: hands events to the broker and reports what the broker said.
//!
//! The relay never trusts "I called send". It trusts a delivery report, and a delivery report
//! carries the broker's *message persistence status*, because that is what decides the next
//! state of the event:
//!
//! * `Persisted` with partition/offset — a transport receipt, ready for the ledger.
//! * `NotPersisted` — the broker certainly does not have it; safe to send again.
//! * `PossiblyPersisted` — e.g. the request timed out in flight. The broker may or may not
//!   have appended it. This is DISPATCH_UNKNOWN: it must be reconciled, never guessed.
//!
//! Failures are also classified [`FailureClass::Permanent`] (will never succeed: message too
//! large, invalid or unauthorised topic) or [`FailureClass::Transient`]; the pipeline
//! quarantines the former and replays the latter.

pub mod headers;
pub mod kafka;
pub mod redact;

pub use headers::HeaderOptions;

pub use kafka::{
    event_headers, scan_for_event, topic_partitions, Delivery, DeliveryOutcome, FailureClass,
    KafkaSink, KafkaSinkConfig, Persistence, ScanResult, SinkError,
};
