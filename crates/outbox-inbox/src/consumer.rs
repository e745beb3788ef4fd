//! [`InboxConsumer`]: an rdkafka `StreamConsumer` whose offsets move only after the inbox
//! transaction committed.
//!
//! The two durable steps are separate methods on purpose, so the boundary between them is
//! visible (and testable): [`InboxConsumer::next`] receives a message and commits its inbox
//! transaction; [`InboxConsumer::commit`] then commits the Kafka offset. A process that dies
//! between the two gets the message again and the inbox recognises it. [`InboxConsumer::run`]
//! is the loop that calls both.
//!
//! Offsets are committed synchronously (`CommitMode::Sync`), auto-commit and auto offset store
//! are off, and a new consumer group starts from the earliest offset. With gap policy
//! `buffer`, a held message keeps its partition's commit position (and the consumer's
//! partition watermark) from passing it.

use std::collections::BTreeSet;

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio::sync::watch;
use tokio_postgres::Client;

use crate::gap::{GapBuffer, GapPolicy, OffsetTracker};
use crate::{store, Handler, InboxError, InboxMessage, Outcome};

/// How an [`InboxConsumer`] runs.
#[derive(Debug, Clone)]
pub struct InboxConfig {
    /// The consumer's identity in its inbox and watermarks (stable across restarts and
    /// instances; register it in the outbox with `outbox.register_consumer`).
    pub consumer_id: String,
    pub bootstrap_servers: String,
    /// Kafka consumer group. Default: the consumer id.
    pub group_id: Option<String>,
    pub topics: Vec<String>,
    pub gap_policy: GapPolicy,
    /// Most events held by gap policy `buffer` before the consumer stops.
    pub max_buffered: usize,
    /// librdkafka properties passed through (security, timeouts). `enable.auto.commit` and
    /// `enable.auto.offset.store` are always false.
    pub properties: Vec<(String, String)>,
}

impl InboxConfig {
    pub fn new(consumer_id: &str, bootstrap_servers: &str, topics: &[&str]) -> Self {
        InboxConfig {
            consumer_id: consumer_id.to_string(),
            bootstrap_servers: bootstrap_servers.to_string(),
            group_id: None,
            topics: topics.iter().map(|t| t.to_string()).collect(),
            gap_policy: GapPolicy::Reject,
            max_buffered: 10_000,
            properties: Vec::new(),
        }
    }
}

/// What one [`InboxConsumer::next`] did: the outcomes of the received message and of any
/// buffered messages it released, and the offsets that may now be committed.
#[derive(Debug, Default)]
pub struct Processed {
    pub outcomes: Vec<Outcome>,
    /// `(topic, partition, next offset to read)`: safe to commit, the inbox has everything
    /// below it.
    pub commit: Vec<(String, i32, i64)>,
}

/// A Kafka consumer that applies each outbox event once through the inbox.
pub struct InboxConsumer {
    consumer: StreamConsumer,
    db: Client,
    cfg: InboxConfig,
    offsets: OffsetTracker<(String, i32)>,
    buffer: GapBuffer<(String, String), InboxMessage>,
}

impl std::fmt::Debug for InboxConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxConsumer")
            .field("consumer_id", &self.cfg.consumer_id)
            .field("topics", &self.cfg.topics)
            .field("buffered", &self.buffer.len())
            .finish()
    }
}

impl InboxConsumer {
    /// Creates the consumer and subscribes. `db` is a connection to the consumer's database,
    /// where the inbox tables exist ([`store::install`] or `outboxd migrate`).
    pub fn new(cfg: InboxConfig, db: Client) -> Result<InboxConsumer, InboxError> {
        if cfg.consumer_id.trim().is_empty() {
            return Err(InboxError::Invalid("consumer_id must not be empty".into()));
        }
        if cfg.topics.is_empty() {
            return Err(InboxError::Invalid(format!(
                "consumer {}: no topics to subscribe to",
                cfg.consumer_id
            )));
        }
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &cfg.bootstrap_servers)
            .set(
                "group.id",
                cfg.group_id.as_deref().unwrap_or(&cfg.consumer_id),
            )
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false");
        for (k, v) in &cfg.properties {
            cc.set(k, v);
        }
        // The offset moves only after the inbox transaction committed.
        cc.set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        let consumer: StreamConsumer = cc.create().map_err(|source| InboxError::Kafka {
            context: format!(
                "creating consumer {} for {}",
                cfg.consumer_id, cfg.bootstrap_servers
            ),
            source,
        })?;
        let topics: Vec<&str> = cfg.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|source| InboxError::Kafka {
                context: format!("subscribing to {topics:?}"),
                source,
            })?;
        let limit = cfg.max_buffered;
        Ok(InboxConsumer {
            consumer,
            db,
            cfg,
            offsets: OffsetTracker::new(),
            buffer: GapBuffer::new(limit),
        })
    }

    pub fn config(&self) -> &InboxConfig {
        &self.cfg
    }

    /// Receives one message and commits its inbox transaction (and those of buffered messages
    /// it unblocks). Does **not** commit the Kafka offset: call [`commit`](Self::commit).
    pub async fn next(&mut self, handler: &dyn Handler) -> Result<Processed, InboxError> {
        let msg = {
            let m = self
                .consumer
                .recv()
                .await
                .map_err(|source| InboxError::Kafka {
                    context: format!("receiving for consumer {}", self.cfg.consumer_id),
                    source,
                })?;
            InboxMessage::from_kafka(&m)?
        };
        let mut processed = Processed::default();
        let mut touched = BTreeSet::new();
        let mut next = Some(msg);
        let mut first = true;
        while let Some(msg) = next.take() {
            let part = (msg.topic.clone(), msg.partition);
            if first {
                self.offsets.begin(part.clone(), msg.offset);
                first = false;
            }
            touched.insert(part.clone());
            let watermark = self.offsets.committable_if_finished(&part, msg.offset);
            let outcome = store::process(
                &mut self.db,
                &self.cfg.consumer_id,
                self.cfg.gap_policy,
                &msg,
                watermark,
                handler,
            )
            .await?;
            let agg = (msg.aggregate_type.clone(), msg.aggregate_id.clone());
            if let Outcome::Buffered { .. } = outcome {
                let version = msg.aggregate_version;
                if self.buffer.push(agg, version, msg).is_err() {
                    return Err(InboxError::BufferFull {
                        consumer_id: self.cfg.consumer_id.clone(),
                        limit: self.cfg.max_buffered,
                    });
                }
                processed.outcomes.push(outcome);
                break;
            }
            self.offsets.finish(&part, msg.offset);
            processed.outcomes.push(outcome);
            // The next version of this aggregate may be waiting in the buffer.
            next = self.buffer.take_next(&agg, msg.aggregate_version);
        }
        processed.commit = touched
            .into_iter()
            .filter_map(|(t, p)| {
                let off = self.offsets.committable(&(t.clone(), p))?;
                Some((t, p, off))
            })
            .collect();
        Ok(processed)
    }

    /// Commits the Kafka offsets `processed` allows (synchronously).
    pub fn commit(&self, processed: &Processed) -> Result<(), InboxError> {
        if processed.commit.is_empty() {
            return Ok(());
        }
        let mut tpl = TopicPartitionList::new();
        for (t, p, off) in &processed.commit {
            tpl.add_partition_offset(t, *p, Offset::Offset(*off))
                .map_err(|source| InboxError::Kafka {
                    context: format!("preparing the offset commit of {t}/{p}@{off}"),
                    source,
                })?;
        }
        self.consumer
            .commit(&tpl, CommitMode::Sync)
            .map_err(|source| InboxError::Kafka {
                context: format!(
                    "committing offsets {:?} for consumer {} (the inbox has the events; they will be recognised as duplicates if delivered again)",
                    processed.commit, self.cfg.consumer_id
                ),
                source,
            })
    }

    /// Processes messages until `shutdown` becomes true or an error stops it.
    pub async fn run(
        &mut self,
        handler: &dyn Handler,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), InboxError> {
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            tokio::select! {
                changed = shutdown.changed() => {
                    if changed.is_err() {
                        return Ok(()); // the sender is gone: nobody can ask us to stop later
                    }
                }
                r = self.next(handler) => {
                    let p = r?;
                    self.commit(&p)?;
                }
            }
        }
    }
}
