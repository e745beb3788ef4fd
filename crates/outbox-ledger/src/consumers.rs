//! The consumer registry and what consumers have applied.
//!
//! The relay can prove that the broker has an event; only a consumer can prove it applied it.
//! Consumers using the inbox library write their inbox row and watermarks in the transaction
//! of their effect (`outbox.inbox`, `outbox.consumer_watermarks`). A consumer is *mandatory*
//! when retention must wait for it and the reconciler must report events it never consumed;
//! an *optional* consumer is listed but gates nothing.

use serde::Serialize;
use tokio_postgres::Client;

use crate::{Context, LedgerError};

/// One registered consumer with a summary of its progress.
#[derive(Debug, Clone, Serialize)]
pub struct ConsumerInfo {
    pub consumer_id: String,
    pub mandatory: bool,
    /// Topics it reads; `None` = every topic.
    pub topics: Option<Vec<String>>,
    pub description: Option<String>,
    /// Partitions with a watermark.
    pub partitions: i64,
    /// Inbox rows in this database (a consumer with its own database has none here).
    pub inbox_rows: i64,
    /// Seconds since its last watermark move, if it ever moved one.
    pub idle_seconds: Option<f64>,
}

/// Declares (or re-declares) a consumer. `topics = None` means every topic.
pub async fn register(
    client: &Client,
    consumer_id: &str,
    mandatory: bool,
    topics: Option<&[String]>,
    description: Option<&str>,
) -> Result<(), LedgerError> {
    if consumer_id.trim().is_empty() {
        return Err(LedgerError::Invalid(
            "consumer id must not be empty".to_string(),
        ));
    }
    let topics: Option<Vec<String>> = topics.map(<[String]>::to_vec);
    client
        .execute(
            "SELECT outbox.register_consumer($1, $2, $3, $4)",
            &[&consumer_id, &mandatory, &topics, &description],
        )
        .await
        .ctx(format!("registering consumer {consumer_id}"))?;
    Ok(())
}

/// Every registered consumer, mandatory first.
pub async fn list(client: &Client) -> Result<Vec<ConsumerInfo>, LedgerError> {
    let rows = client
        .query(
            "SELECT c.consumer_id, c.mandatory, c.topics, c.description,
                    (SELECT count(*) FROM outbox.consumer_watermarks w WHERE w.consumer_id = c.consumer_id),
                    (SELECT count(*) FROM outbox.inbox i WHERE i.consumer_id = c.consumer_id),
                    (SELECT extract(epoch FROM clock_timestamp() - max(w.updated_at))::float8
                     FROM outbox.consumer_watermarks w WHERE w.consumer_id = c.consumer_id)
             FROM outbox.consumers c
             ORDER BY c.mandatory DESC, c.consumer_id",
            &[],
        )
        .await
        .ctx("reading outbox.consumers")?;
    Ok(rows
        .iter()
        .map(|r| ConsumerInfo {
            consumer_id: r.get(0),
            mandatory: r.get(1),
            topics: r.get(2),
            description: r.get(3),
            partitions: r.get(4),
            inbox_rows: r.get(5),
            idle_seconds: r.get(6),
        })
        .collect())
}

/// A published event that a mandatory consumer has not applied.
#[derive(Debug, Clone, Serialize)]
pub struct Unconsumed {
    pub consumer_id: String,
    pub event_id: uuid::Uuid,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// Seconds since the receipt was accepted.
    pub published_age_seconds: f64,
}

/// Events published more than `older_than_secs` ago that some mandatory consumer reading their
/// topic has neither in its inbox nor below its partition watermark: at most `limit` of them,
/// and how many there are in all.
pub async fn unconsumed(
    client: &Client,
    older_than_secs: f64,
    limit: i64,
) -> Result<(Vec<Unconsumed>, i64), LedgerError> {
    let rows = client
        .query(
            "SELECT c.consumer_id, r.event_id, r.topic, r.partition, r.\"offset\",
                    extract(epoch FROM clock_timestamp() - r.accepted_at)::float8,
                    count(*) OVER ()
             FROM outbox.receipts r
             JOIN outbox.consumers c
               ON c.mandatory AND (c.topics IS NULL OR r.topic = ANY (c.topics))
             WHERE r.accepted_at < clock_timestamp() - make_interval(secs => $1)
               AND NOT EXISTS (SELECT 1 FROM outbox.consumer_watermarks w
                               WHERE w.consumer_id = c.consumer_id AND w.topic = r.topic
                                 AND w.partition = r.partition AND w.next_offset > r.\"offset\")
               AND NOT EXISTS (SELECT 1 FROM outbox.inbox i
                               WHERE i.consumer_id = c.consumer_id AND i.event_id = r.event_id)
             ORDER BY r.accepted_at, c.consumer_id
             LIMIT $2",
            &[&older_than_secs, &limit],
        )
        .await
        .ctx("finding published events no mandatory consumer applied")?;
    let total = rows.first().map(|r| r.get::<_, i64>(6)).unwrap_or(0);
    let list = rows
        .iter()
        .map(|r| Unconsumed {
            consumer_id: r.get(0),
            event_id: r.get(1),
            topic: r.get(2),
            partition: r.get(3),
            offset: r.get(4),
            published_age_seconds: r.get(5),
        })
        .collect();
    Ok((list, total))
}
