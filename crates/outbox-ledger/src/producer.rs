//! The producer-side Rust helper: one call to `outbox.enqueue(...)` inside the caller's
//! transaction. The SQL function does all the work (version allocation under the
//! aggregate's lock, digests, route freezing), so producers in any language get the same
//! guarantees; this is only a typed wrapper.

use tokio_postgres::error::SqlState;
use tokio_postgres::GenericClient;
use uuid::Uuid;

use crate::{Context, LedgerError};

/// Optional envelope fields; all default to NULL.
#[derive(Debug, Clone, Default)]
pub struct EnqueueOptions {
    pub tenant: Option<String>,
    /// A JSON object of string values, copied to Kafka headers (e.g. `traceparent`).
    pub headers: Option<serde_json::Value>,
    pub payload_schema: Option<String>,
    /// Use this event id instead of a new UUIDv7 (e.g. the id of the business command).
    pub event_id: Option<Uuid>,
}

/// Enqueues one event in the caller's transaction (pass a `Transaction` to make it atomic with
/// the business change). Returns the event id.
pub async fn enqueue<C: GenericClient>(
    client: &C,
    aggregate_type: &str,
    aggregate_id: &str,
    event_type: &str,
    payload: &serde_json::Value,
    options: &EnqueueOptions,
) -> Result<Uuid, LedgerError> {
    let row = client
        .query_one(
            "SELECT outbox.enqueue($1, $2, $3, $4, $5, $6, $7, $8)",
            &[
                &aggregate_type,
                &aggregate_id,
                &event_type,
                payload,
                &options.tenant,
                &options.headers,
                &options.payload_schema,
                &options.event_id,
            ],
        )
        .await
        .ctx(format!(
            "enqueueing {event_type} for {aggregate_type}/{aggregate_id}"
        ))?;
    Ok(row.get(0))
}

/// Gives `outbox.aggregate_versions` back every row it lost, from the rows and the purged
/// events' tombstones, and marks it intact; nothing while it is intact. The table is unlogged
/// (migration 0032): a crash of the server, a promoted standby or a restored base backup
/// empties it. Writers stay correct meanwhile (they read the rows while the table is not
/// intact), but poll mode finds pending events through it, and a writer of a new aggregate
/// pays a look-up until the mark is back. A relay calls this when a run starts: a crash ends
/// every run, so a restart follows each loss. Returns the rows restored.
///
/// The restore gives way to writers (it waits for no lock longer than 100 ms, so a producer's
/// transaction never loses a deadlock to it); it is tried again every 50 ms, for at most 30 s.
pub async fn restore_aggregate_versions<C: GenericClient>(client: &C) -> Result<i64, LedgerError> {
    let mut tries = 0;
    loop {
        match client
            .query_one("SELECT outbox.restore_aggregate_versions()", &[])
            .await
        {
            Ok(row) => return Ok(row.get(0)),
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) && tries < 600 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => {
                return Err(e)
                    .ctx("restoring outbox.aggregate_versions from the rows (migration 0032)")
            }
        }
    }
}
