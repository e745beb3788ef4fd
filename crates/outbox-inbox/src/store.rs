//! The PostgreSQL side: one transaction per message, in the consumer's own database.
//!
//! [`process`] is the whole recipe (docs/consumers.md has it as plain SQL): insert the inbox
//! row with `ON CONFLICT DO NOTHING RETURNING`; no row means duplicate, so return the
//! original receipt and do not run the handler; otherwise check the aggregate sequence, run
//! the handler's effect through the same transaction, move both watermarks, commit. The
//! caller commits the Kafka offset only after this returns.

use std::time::Duration;

use tokio_postgres::{Client, Transaction};

use crate::gap::{self, Action, Dedup, GapPolicy};
use crate::{ConsumeReceipt, Context, Handler, IdempotencyKey, InboxError, InboxMessage, Outcome};

/// The inbox tables (`outbox.inbox`, `outbox.consumer_watermarks`,
/// `outbox.consumer_aggregate_heads`, `outbox.consumer_gaps`) and the recipe's functions
/// (`outbox.inbox_receive`, `outbox.publish_watermark`: migration 0024), idempotent. The same
/// text is shipped as docs/consumer_inbox.sql for consumers in other languages (a test keeps
/// the two equal).
pub const INBOX_SQL: &str = concat!(
    include_str!("inbox.sql"),
    "\n",
    include_str!("../../../migrations/0024_consumer_recipe.sql")
);

/// Creates the inbox tables in a consumer's database if they are missing. Not needed when
/// the consumer shares the outbox's database (`outboxd migrate` creates them there).
pub async fn install(client: &Client) -> Result<(), InboxError> {
    client
        .batch_execute(INBOX_SQL)
        .await
        .ctx("installing the inbox tables (schema outbox)")
}

/// Processes one message in one transaction. `next_offset` is the partition watermark to
/// record if this message finishes (normally `offset + 1`; lower while an earlier message of
/// the partition is buffered).
pub async fn process(
    client: &mut Client,
    consumer_id: &str,
    policy: GapPolicy,
    msg: &InboxMessage,
    next_offset: i64,
    handler: &dyn Handler,
) -> Result<Outcome, InboxError> {
    let tx = client
        .transaction()
        .await
        .ctx("beginning the inbox transaction")?;
    let inserted = tx
        .query_opt(
            "INSERT INTO outbox.inbox (consumer_id, event_id, aggregate_type, aggregate_id,
                                       aggregate_version, event_type, topic, partition, \"offset\")
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
             ON CONFLICT (consumer_id, event_id) DO NOTHING
             RETURNING 1",
            &[
                &consumer_id,
                &msg.event_id,
                &msg.aggregate_type,
                &msg.aggregate_id,
                &msg.aggregate_version,
                &msg.event_type,
                &msg.topic,
                &msg.partition,
                &msg.offset,
            ],
        )
        .await
        .ctx(format!("recording event {} in the inbox", msg.event_id))?;
    let dedup = Dedup::from_inserted(inserted.is_some());
    let last = match dedup {
        Dedup::Duplicate => None,
        Dedup::First => tx
            .query_opt(
                "SELECT last_version FROM outbox.consumer_aggregate_heads
                 WHERE consumer_id = $1 AND aggregate_type = $2 AND aggregate_id = $3
                 FOR UPDATE",
                &[&consumer_id, &msg.aggregate_type, &msg.aggregate_id],
            )
            .await
            .ctx("reading the aggregate watermark")?
            .map(|r| r.get::<_, i64>(0)),
    };
    let outcome = match gap::decide(dedup, policy, last, msg.aggregate_version) {
        Action::Duplicate => {
            advance_partition(&tx, consumer_id, msg, next_offset).await?;
            Outcome::Duplicate(receipt(&tx, consumer_id, msg.event_id).await?)
        }
        Action::Stale { last } => {
            tracing::warn!(consumer_id, event_id = %msg.event_id, aggregate = %msg.aggregate(), last,
                "event is behind the aggregate watermark under a new id; recorded as STALE, not applied");
            set_outcome(&tx, consumer_id, msg, "STALE", None).await?;
            advance_partition(&tx, consumer_id, msg, next_offset).await?;
            Outcome::Stale(receipt(&tx, consumer_id, msg.event_id).await?)
        }
        Action::Buffer { expected } => {
            tx.rollback()
                .await
                .ctx("rolling back a buffered event's transaction")?;
            return Ok(Outcome::Buffered {
                event_id: msg.event_id,
                expected,
            });
        }
        Action::Reject { expected } => {
            tx.rollback()
                .await
                .ctx("rolling back a rejected event's transaction")?;
            return Err(InboxError::Gap {
                consumer_id: consumer_id.to_string(),
                aggregate: format!("{}/{}", msg.aggregate_type, msg.aggregate_id),
                expected,
                got: msg.aggregate_version,
                event_id: msg.event_id,
            });
        }
        action @ (Action::Apply | Action::ApplyReportingGap { .. }) => {
            let gap = match action {
                Action::ApplyReportingGap { expected } => Some(expected),
                _ => None,
            };
            if let Some(expected) = gap {
                tracing::warn!(consumer_id, event_id = %msg.event_id, aggregate = %msg.aggregate(), expected,
                    "version gap: applying anyway (gap policy report)");
                tx.execute(
                    "INSERT INTO outbox.consumer_gaps (consumer_id, aggregate_type, aggregate_id,
                                                       expected_version, got_version, event_id)
                     VALUES ($1, $2, $3, $4, $5, $6)",
                    &[
                        &consumer_id,
                        &msg.aggregate_type,
                        &msg.aggregate_id,
                        &expected,
                        &msg.aggregate_version,
                        &msg.event_id,
                    ],
                )
                .await
                .ctx("recording a version gap")?;
            }
            let key = IdempotencyKey::new(consumer_id, msg.event_id);
            // A handler error drops `tx`: the inbox row and the effect roll back together.
            let result =
                handler
                    .handle(&tx, msg, &key)
                    .await
                    .map_err(|source| InboxError::Handler {
                        consumer_id: consumer_id.to_string(),
                        event_id: msg.event_id,
                        topic: msg.topic.clone(),
                        partition: msg.partition,
                        offset: msg.offset,
                        source,
                    })?;
            let label = if gap.is_some() {
                "GAP_REPORTED"
            } else {
                "APPLIED"
            };
            set_outcome(&tx, consumer_id, msg, label, result.as_ref()).await?;
            tx.execute(
                "INSERT INTO outbox.consumer_aggregate_heads AS h
                     (consumer_id, aggregate_type, aggregate_id, last_version)
                 VALUES ($1, $2, $3, $4)
                 ON CONFLICT (consumer_id, aggregate_type, aggregate_id) DO UPDATE
                 SET last_version = greatest(h.last_version, EXCLUDED.last_version),
                     updated_at = clock_timestamp()",
                &[
                    &consumer_id,
                    &msg.aggregate_type,
                    &msg.aggregate_id,
                    &msg.aggregate_version,
                ],
            )
            .await
            .ctx("moving the aggregate watermark")?;
            advance_partition(&tx, consumer_id, msg, next_offset).await?;
            let r = receipt(&tx, consumer_id, msg.event_id).await?;
            match gap {
                Some(expected) => Outcome::AppliedWithGap {
                    receipt: r,
                    expected,
                },
                None => Outcome::Applied(r),
            }
        }
    };
    tx.commit().await.ctx(format!(
        "committing event {} with its inbox receipt",
        msg.event_id
    ))?;
    Ok(outcome)
}

async fn set_outcome(
    tx: &Transaction<'_>,
    consumer_id: &str,
    msg: &InboxMessage,
    outcome: &str,
    result: Option<&serde_json::Value>,
) -> Result<(), InboxError> {
    tx.execute(
        "UPDATE outbox.inbox SET outcome = $3, result = $4
         WHERE consumer_id = $1 AND event_id = $2",
        &[&consumer_id, &msg.event_id, &outcome, &result],
    )
    .await
    .ctx("recording the consume receipt")?;
    Ok(())
}

async fn advance_partition(
    tx: &Transaction<'_>,
    consumer_id: &str,
    msg: &InboxMessage,
    next_offset: i64,
) -> Result<(), InboxError> {
    tx.execute(
        "INSERT INTO outbox.consumer_watermarks AS w (consumer_id, topic, partition, next_offset)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (consumer_id, topic, partition) DO UPDATE
         SET next_offset = greatest(w.next_offset, EXCLUDED.next_offset),
             updated_at = clock_timestamp()",
        &[&consumer_id, &msg.topic, &msg.partition, &next_offset],
    )
    .await
    .ctx("moving the partition watermark")?;
    Ok(())
}

/// The consume receipt of `event_id` for `consumer_id`, if it has one.
pub async fn find_receipt(
    client: &impl tokio_postgres::GenericClient,
    consumer_id: &str,
    event_id: uuid::Uuid,
) -> Result<Option<ConsumeReceipt>, InboxError> {
    let row = client
        .query_opt(
            "SELECT topic, partition, \"offset\", outcome, result, consumed_at::text
             FROM outbox.inbox WHERE consumer_id = $1 AND event_id = $2",
            &[&consumer_id, &event_id],
        )
        .await
        .ctx("reading the consume receipt")?;
    Ok(row.map(|r| ConsumeReceipt {
        consumer_id: consumer_id.to_string(),
        event_id,
        topic: r.get(0),
        partition: r.get(1),
        offset: r.get(2),
        outcome: r.get(3),
        result: r.get(4),
        consumed_at: r.get(5),
    }))
}

async fn receipt(
    tx: &Transaction<'_>,
    consumer_id: &str,
    event_id: uuid::Uuid,
) -> Result<ConsumeReceipt, InboxError> {
    find_receipt(tx, consumer_id, event_id).await?.ok_or_else(|| {
        InboxError::Invalid(format!(
            "the inbox row of event {event_id} for consumer {consumer_id} vanished inside its own transaction"
        ))
    })
}

/// Copies this consumer's partition watermarks from its own database to the outbox's, where
/// the reconciler and purge read them (only for consumers whose database is not the
/// outbox's). Watermarks only move forward; a late copy under-reports, never over-reports.
pub async fn publish_watermarks(
    local: &Client,
    outbox: &Client,
    consumer_id: &str,
) -> Result<u64, InboxError> {
    let rows = local
        .query(
            "SELECT topic, partition, next_offset FROM outbox.consumer_watermarks
             WHERE consumer_id = $1",
            &[&consumer_id],
        )
        .await
        .ctx("reading local watermarks")?;
    let mut n = 0;
    for r in rows {
        let (topic, partition, next): (String, i32, i64) = (r.get(0), r.get(1), r.get(2));
        n += outbox
            .execute(
                "INSERT INTO outbox.consumer_watermarks AS w (consumer_id, topic, partition, next_offset)
                 VALUES ($1, $2, $3, $4)
                 ON CONFLICT (consumer_id, topic, partition) DO UPDATE
                 SET next_offset = greatest(w.next_offset, EXCLUDED.next_offset),
                     updated_at = clock_timestamp()
                 WHERE w.next_offset < EXCLUDED.next_offset",
                &[&consumer_id, &topic, &partition, &next],
            )
            .await
            .ctx("publishing a watermark to the outbox database")?;
    }
    Ok(n)
}

/// Deletes inbox rows consumed more than `older_than` ago, `batch` rows per transaction (for a
/// consumer with its own database; `outboxd purge` does this for the outbox's). Keep
/// `older_than` longer than the broker's retention of the topic: a replay from the broker is
/// deduplicated only while the row exists (after that, the aggregate watermark still refuses
/// versions already applied, as STALE).
pub async fn purge_inbox(
    client: &Client,
    consumer_id: &str,
    older_than: Duration,
    batch: i64,
) -> Result<u64, InboxError> {
    if batch < 1 {
        return Err(InboxError::Invalid(
            "inbox purge batch must be at least 1".into(),
        ));
    }
    let mut total = 0;
    loop {
        let n = client
            .execute(
                "DELETE FROM outbox.inbox i USING (
                     SELECT event_id FROM outbox.inbox
                     WHERE consumer_id = $1
                       AND consumed_at < clock_timestamp() - make_interval(secs => $2)
                     LIMIT $3) v
                 WHERE i.consumer_id = $1 AND i.event_id = v.event_id",
                &[&consumer_id, &older_than.as_secs_f64(), &batch],
            )
            .await
            .ctx("purging inbox rows")?;
        total += n;
        if (n as i64) < batch {
            return Ok(total);
        }
    }
}
