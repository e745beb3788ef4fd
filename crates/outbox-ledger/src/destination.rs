//! Explicit destination migration (never a retry to another target).
//!
//! The facts a migration needs are gathered here; the proof that the old target did not
//! accept the event is decided by the caller (it may need to scan the old topic).

use tokio_postgres::Client;
use uuid::Uuid;

use crate::{Context, LedgerError};

/// What the ledger knows about an event that someone wants to migrate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationFacts {
    pub envelope_generation: i32,
    /// Broker kind of the current frozen destination (`kafka`, `nats`): which broker a proof
    /// of absence must come from.
    pub dest_kind: String,
    pub dest_cluster: String,
    pub dest_topic: String,
    pub destination_digest: String,
    /// `topic/partition@offset` of its primary receipt, if it has one.
    pub published: Option<String>,
    /// An attempt whose outcome is still unknown.
    pub unknown_open: bool,
    /// Open quarantine `(reason_code, reason)`.
    pub quarantine: Option<(String, String)>,
    /// Dispatch attempts ever recorded for it.
    pub attempts: i64,
    /// Its open quarantine's transaction is not yet behind its slot's checkpoint: a relay may
    /// still replay the WAL row, frozen for the old destination. Or (poll mode) the current
    /// round of a live poll lease read the event without seeing the quarantine, and may still
    /// hold it (migration 0015).
    pub replayable: bool,
}

/// Reason codes of quarantines decided before anything was sent to the broker.
pub use outbox_core::receipt::PRE_SEND_CODES;

pub async fn facts(client: &Client, event_id: Uuid) -> Result<Option<MigrationFacts>, LedgerError> {
    let Some(r) = client
        .query_opt(
            "SELECT c.envelope_generation, c.dest_cluster, c.dest_topic,
                    outbox.destination_digest_of(c),
                    (SELECT topic || '/' || partition || '@' || \"offset\"
                     FROM outbox.receipt_of(c.event_id)),
                    EXISTS (SELECT 1 FROM outbox.attempts a
                            WHERE a.event_id = c.event_id AND a.state = 'DISPATCH_UNKNOWN'),
                    (SELECT q.reason_code FROM outbox.quarantine q
                     WHERE q.event_id = c.event_id AND q.released_at IS NULL ORDER BY q.id DESC LIMIT 1),
                    (SELECT q.reason FROM outbox.quarantine q
                     WHERE q.event_id = c.event_id AND q.released_at IS NULL ORDER BY q.id DESC LIMIT 1),
                    (SELECT count(*) FROM outbox.attempts a WHERE a.event_id = c.event_id),
                    EXISTS (SELECT 1 FROM outbox.quarantine q2
                            JOIN outbox.checkpoints cp ON cp.slot_name = q2.slot_name
                            WHERE q2.event_id = c.event_id AND q2.released_at IS NULL
                              AND q2.commit_lsn IS NOT NULL AND q2.commit_lsn <> '0/0'::pg_lsn
                              AND q2.commit_lsn >= cp.confirmed_lsn)
                    OR EXISTS (SELECT 1 FROM outbox.quarantine q3
                               WHERE q3.event_id = c.event_id AND q3.released_at IS NULL
                                 AND outbox.poll_round_missed(q3.recorded_xact)),
                    c.dest_kind
             FROM outbox.events_current c WHERE c.event_id = $1",
            &[&event_id],
        )
        .await
        .ctx(format!("reading event {event_id}"))?
    else {
        return Ok(None);
    };
    let code: Option<String> = r.get(6);
    let reason: Option<String> = r.get(7);
    Ok(Some(MigrationFacts {
        envelope_generation: r.get(0),
        dest_cluster: r.get(1),
        dest_topic: r.get(2),
        destination_digest: r.get(3),
        published: r.get(4),
        unknown_open: r.get(5),
        quarantine: code.zip(reason),
        attempts: r.get(8),
        replayable: r.get(9),
        dest_kind: r.get(10),
    }))
}

/// Records the migration of `event_id` to `(kind, cluster, topic)`: a new envelope generation
/// whose destination keeps the key, partitioner, serializer and acks of the current one, with
/// its digest computed by the same SQL as at enqueue. Returns the new generation.
#[allow(clippy::too_many_arguments)]
pub async fn record(
    client: &Client,
    event_id: Uuid,
    kind: &str,
    cluster: &str,
    topic: &str,
    proof: &str,
    reason: &str,
    by: &str,
) -> Result<i32, LedgerError> {
    let r = client
        .query_one(
            "INSERT INTO outbox.destination_migrations (
                 event_id, envelope_generation, from_destination_digest, dest_kind, dest_cluster,
                 dest_topic, dest_key, dest_partitioner, dest_route_generation, dest_serializer,
                 dest_acks, destination_digest, proof, reason, migrated_by)
             SELECT c.event_id, c.envelope_generation + 1, outbox.destination_digest_of(c),
                    $2, $3, $4,
                    c.dest_key, c.dest_partitioner, c.dest_route_generation, c.dest_serializer,
                    c.dest_acks,
                    outbox.sha256_text(outbox.destination_canonical($2, $3, $4, c.dest_key,
                        c.dest_partitioner, c.dest_route_generation, c.dest_serializer, c.dest_acks)),
                    $5, $6, $7
             FROM outbox.events_current c WHERE c.event_id = $1
             RETURNING envelope_generation",
            &[&event_id, &kind, &cluster, &topic, &proof, &reason, &by],
        )
        .await
        .ctx(format!("recording the destination migration of {event_id}"))?;
    Ok(r.get(0))
}
