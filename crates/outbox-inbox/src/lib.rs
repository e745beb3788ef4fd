//! Consumer-side inbox for outboxd events: apply each event's effect once.
//!
//! The relay delivers at least once; the broker may hand a consumer the same event again
//! (after a consumer crash, a rebalance, a relay replay, an offset reset). This crate makes the
//! *effect* happen once, with one rule: **the inbox row and the effect commit in one database
//! transaction, and the Kafka offset is committed only after it.**
//!
//! ```text
//! recv message ─► BEGIN
//!                 INSERT INTO outbox.inbox (consumer_id, event_id, ...) ON CONFLICT DO NOTHING RETURNING
//!                   ├─ no row: duplicate ─► return the original receipt (handler not run)
//!                   └─ row: sequence check (gap policy) ─► handler(tx, event, idempotency key)
//!                 move watermarks (aggregate version, partition offset)
//!                 COMMIT ─► commit the Kafka offset
//! ```
//!
//! A crash between COMMIT and the offset commit redelivers the message; the insert then
//! returns no row and the handler does not run again. A crash before COMMIT rolls back the
//! inbox row and the effect together, so the redelivery applies it (once).
//!
//! The inbox covers only effects inside that transaction. A call to a payment or e-mail
//! service cannot join it: pass it the [`IdempotencyKey`] (derived from the event id, the same
//! on every redelivery), so the remote side deduplicates. See `docs/consumers.md`.
//!
//! * [`gap`] — pure decisions (dedup, sequence, buffer, offset watermark), unit-tested; the
//!   chaos suite's consumer runs them through [`store::process`].
//! * [`store`] — the PostgreSQL transaction for one message; schema install; inbox purge.
//! * [`consumer`] — [`InboxConsumer`], the rdkafka consumer loop around it.

use std::fmt;

use futures::future::BoxFuture;
use serde::Serialize;

pub mod consumer;
pub mod gap;
pub mod store;

pub use consumer::{InboxConfig, InboxConsumer, Processed};
pub use gap::{Action, Dedup, GapPolicy};

/// Something the inbox could not do. Says which message, what failed, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum InboxError {
    #[error("{context}: {source}")]
    Db {
        context: String,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("Kafka: {context}: {source}")]
    Kafka {
        context: String,
        #[source]
        source: rdkafka::error::KafkaError,
    },
    #[error("message {topic}/{partition}@{offset} is not an outbox event: {reason}; it was not applied and its offset was not committed (fix or skip it on the broker side)")]
    NotAnEvent {
        topic: String,
        partition: i32,
        offset: i64,
        reason: String,
    },
    #[error("consumer {consumer_id}: version gap on aggregate {aggregate}: expected version {expected}, got {got} (event {event_id}); gap policy is reject, so nothing was committed; find the missing event (outboxd status / quarantine list) or run with gap policy buffer or report")]
    Gap {
        consumer_id: String,
        aggregate: String,
        expected: i64,
        got: i64,
        event_id: uuid::Uuid,
    },
    #[error("consumer {consumer_id}: the gap buffer is full ({limit} events held waiting for missing versions); the oldest gap is not closing: check the producer's quarantine and holds, or raise max_buffered")]
    BufferFull { consumer_id: String, limit: usize },
    #[error("consumer {consumer_id}: handler failed on event {event_id} ({topic}/{partition}@{offset}): {source}; the transaction was rolled back and the offset not committed, so the event will be delivered again")]
    Handler {
        consumer_id: String,
        event_id: uuid::Uuid,
        topic: String,
        partition: i32,
        offset: i64,
        #[source]
        source: HandlerError,
    },
    #[error("{0}")]
    Invalid(String),
}

pub(crate) trait Context<T> {
    fn ctx(self, context: impl Into<String>) -> Result<T, InboxError>;
}

impl<T> Context<T> for Result<T, tokio_postgres::Error> {
    fn ctx(self, context: impl Into<String>) -> Result<T, InboxError> {
        self.map_err(|source| InboxError::Db {
            context: context.into(),
            source,
        })
    }
}

/// The error a handler returns; the transaction is rolled back and the event redelivered.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// What a handler's future resolves to: an optional result, stored in the consume receipt and
/// returned unchanged for every duplicate.
pub type HandlerFuture<'a> = BoxFuture<'a, Result<Option<serde_json::Value>, HandlerError>>;

/// Applies one event inside the consumer's transaction. Do every database effect through `tx`;
/// give `key` to every external call.
///
/// Any `Fn(&Transaction, &InboxMessage, &IdempotencyKey) -> HandlerFuture` closure is a
/// handler: `handler_fn(|tx, ev, key| Box::pin(async move { ...; Ok(None) }))`.
pub trait Handler: Send + Sync {
    fn handle<'a>(
        &'a self,
        tx: &'a tokio_postgres::Transaction<'a>,
        event: &'a InboxMessage,
        key: &'a IdempotencyKey,
    ) -> HandlerFuture<'a>;
}

impl<F> Handler for F
where
    F: for<'a> Fn(
            &'a tokio_postgres::Transaction<'a>,
            &'a InboxMessage,
            &'a IdempotencyKey,
        ) -> HandlerFuture<'a>
        + Send
        + Sync,
{
    fn handle<'a>(
        &'a self,
        tx: &'a tokio_postgres::Transaction<'a>,
        event: &'a InboxMessage,
        key: &'a IdempotencyKey,
    ) -> HandlerFuture<'a> {
        self(tx, event, key)
    }
}

/// Turns a closure into a [`Handler`], so that the compiler infers the higher-ranked
/// lifetimes (a closure stored in a `let` first does not get them):
///
/// ```ignore
/// let h = handler_fn(|tx, ev, key| Box::pin(async move {
///     tx.execute("UPDATE accounts SET balance = balance - 10 WHERE id = $1", &[&ev.aggregate_id]).await?;
///     Ok(None)
/// }));
/// ```
pub fn handler_fn<F>(f: F) -> F
where
    F: for<'a> Fn(
            &'a tokio_postgres::Transaction<'a>,
            &'a InboxMessage,
            &'a IdempotencyKey,
        ) -> HandlerFuture<'a>
        + Send
        + Sync,
{
    f
}

/// One outbox event as it arrived from the broker (header `id` and the envelope headers).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InboxMessage {
    pub event_id: uuid::Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub aggregate_version: i64,
    pub event_type: String,
    pub payload: Vec<u8>,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

impl InboxMessage {
    /// Reads the envelope headers outboxd sets (`id`, `aggregate_type`, `aggregate_id`,
    /// `aggregate_version`, `event_type`).
    pub fn from_kafka<M: rdkafka::Message>(m: &M) -> Result<InboxMessage, InboxError> {
        use rdkafka::message::Headers;
        let not_event = |reason: String| InboxError::NotAnEvent {
            topic: m.topic().to_string(),
            partition: m.partition(),
            offset: m.offset(),
            reason,
        };
        let header = |name: &str| -> Result<String, InboxError> {
            m.headers()
                .and_then(|h| {
                    h.iter()
                        .find(|hd| hd.key == name)
                        .and_then(|hd| hd.value)
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                })
                .ok_or_else(|| not_event(format!("header {name:?} is missing")))
        };
        let id = header("id")?;
        let event_id = id
            .parse()
            .map_err(|_| not_event(format!("header id {id:?} is not a UUID")))?;
        let version = header("aggregate_version")?;
        let aggregate_version = version.parse().map_err(|_| {
            not_event(format!(
                "header aggregate_version {version:?} is not an integer"
            ))
        })?;
        Ok(InboxMessage {
            event_id,
            aggregate_type: header("aggregate_type")?,
            aggregate_id: header("aggregate_id")?,
            aggregate_version,
            event_type: header("event_type")?,
            payload: m.payload().unwrap_or_default().to_vec(),
            topic: m.topic().to_string(),
            partition: m.partition(),
            offset: m.offset(),
        })
    }

    /// The payload as JSON (outboxd's default serializer).
    pub fn json(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }

    /// `type/id@version`, for messages.
    pub fn aggregate(&self) -> String {
        format!(
            "{}/{}@{}",
            self.aggregate_type, self.aggregate_id, self.aggregate_version
        )
    }
}

/// The key to give an external system (payment provider, mail service) so that *it*
/// deduplicates: derived from the event id only, so every redelivery of the event, to any
/// instance of this consumer, after any crash, presents the same key. Never derive it from
/// the attempt, the time or the offset: an unknown outcome must be retried with the same key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    consumer_id: String,
    event_id: uuid::Uuid,
}

impl IdempotencyKey {
    pub fn new(consumer_id: &str, event_id: uuid::Uuid) -> Self {
        IdempotencyKey {
            consumer_id: consumer_id.to_string(),
            event_id,
        }
    }

    pub fn event_id(&self) -> uuid::Uuid {
        self.event_id
    }

    /// `consumer_id:event_id` — the key for this consumer's one external effect of the event
    /// (two consumers calling the same provider for the same event get different keys).
    pub fn as_key(&self) -> String {
        format!("{}:{}", self.consumer_id, self.event_id)
    }

    /// `consumer_id:event_id:effect` — when one event causes several external calls
    /// (e.g. `charge`, `receipt-mail`), one stable key per call.
    pub fn for_effect(&self, effect: &str) -> String {
        format!("{}:{}:{}", self.consumer_id, self.event_id, effect)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.consumer_id, self.event_id)
    }
}

/// The consumer's receipt of one event (its inbox row), returned for the first delivery and,
/// unchanged, for every duplicate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumeReceipt {
    pub consumer_id: String,
    pub event_id: uuid::Uuid,
    /// Where it was first consumed from.
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// `APPLIED`, `STALE` (not applied: version behind the aggregate watermark) or
    /// `GAP_REPORTED` (applied across a reported gap).
    pub outcome: String,
    /// What the handler returned.
    pub result: Option<serde_json::Value>,
    pub consumed_at: String,
}

/// What happened to one message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Outcome {
    /// First delivery: the handler ran and committed with the receipt.
    Applied(ConsumeReceipt),
    /// Seen before: the original receipt; the handler did not run.
    Duplicate(ConsumeReceipt),
    /// A new id at or below the aggregate's applied version: recorded, handler not run.
    Stale(ConsumeReceipt),
    /// Applied across a version gap (policy report); the gap is in `outbox.consumer_gaps`.
    AppliedWithGap {
        receipt: ConsumeReceipt,
        expected: i64,
    },
    /// Held until the missing versions arrive (policy buffer); nothing committed.
    Buffered { event_id: uuid::Uuid, expected: i64 },
}

impl Outcome {
    /// The receipt, unless the message was only buffered.
    pub fn receipt(&self) -> Option<&ConsumeReceipt> {
        match self {
            Outcome::Applied(r) | Outcome::Duplicate(r) | Outcome::Stale(r) => Some(r),
            Outcome::AppliedWithGap { receipt, .. } => Some(receipt),
            Outcome::Buffered { .. } => None,
        }
    }

    /// Whether the handler ran for this delivery.
    pub fn ran_handler(&self) -> bool {
        matches!(self, Outcome::Applied(_) | Outcome::AppliedWithGap { .. })
    }
}
