//! The transactional Kafka producer of `delivery = "exactly-once"` (issue 30;
//! docs/exactly_once.md): the broker side of the mode, proven on real Kafka by
//! `tests/kafka_txn.rs`, executed by the relay's `relay/txn.rs`.
//!
//! What it gives, and what the design relies on:
//! * **One transaction per acceptance batch.** [`TxnSink::begin`], [`TxnSink::send`] for each
//!   event (several of one aggregate may be in flight: a transaction is visible to
//!   `read_committed` consumers all at once or not at all), then [`TxnSink::commit`] with the
//!   batch's [`BatchRecord`]. The delivery reports of the events arrive before the commit
//!   (their offsets are final, the records not yet visible); the batch record, written into the
//!   positions topic inside the same transaction, carries those receipts and the LSN the
//!   checkpoint may move to. So the broker alone knows which batches it has committed.
//! * **Fencing by the transactional id.** [`TxnSink::open`] initialises transactions under an
//!   id stable per slot (`transactional_id`): the broker bumps the id's epoch, aborts whatever
//!   transaction the previous holder left open, and refuses every later request of that
//!   previous producer ([`TxnFailure::Fenced`]). A relay paused past its lease and resumed can
//!   commit nothing.
//! * **Recovery from the broker's record.** [`TxnSink::commit`] returns where the record is
//!   stored; [`committed_batches`] reads the positions topic after such positions as a
//!   `read_committed` consumer up to its last stable offset: every batch committed there
//!   since, with its receipts. A batch committed on the broker whose ledger acceptance a
//!   crash cut off is accepted from this record at the next start, never sent again.
//!
//! An unclear commit (a timeout) is not guessed: [`TxnFailure::Retriable`] says to ask again
//! (librdkafka completes a commit it had started), and a new holder's `open` settles it either
//! way, after which [`committed_batches`] says whether the batch is there.

use std::time::{Duration, Instant};

pub use outbox_core::delivery::RecordPosition;
use outbox_core::{Lsn, OutboxEvent};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, Producer};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use tokio::sync::mpsc::UnboundedSender;

pub use crate::kafka::BATCH_RECORD_TOKEN;
use crate::kafka::{classify, enqueue, producer_config, KafkaProducer, Sent, SinkContext};
use crate::{Delivery, KafkaSinkConfig, SinkError};

/// What a committed batch proves: written into the positions topic inside the batch's own
/// transaction, keyed by slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRecord {
    pub slot: String,
    /// The lease generation of the relay that committed it.
    pub generation: i64,
    /// The batch's number within the slot, increasing.
    pub batch: u64,
    /// The LSN the checkpoint may move to once this batch is accepted.
    pub through: Lsn,
    /// Every event of the batch where the broker stored it.
    pub receipts: Vec<BatchReceipt>,
    /// The events the batch records without sending them (`outbox_relay::txn::Kept`): a start
    /// that accepts the batch from this record keeps them too. Absent in records written
    /// before they were (read as none).
    pub kept: Vec<BatchKept>,
}

/// An event a committed batch recorded without sending it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchKept {
    pub event_id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub version: i64,
    /// Refused for good (quarantined, its aggregate held from it): the reason's code and the
    /// reason; `None`: an event of a held aggregate.
    pub quarantined: Option<(String, String)>,
}

/// One event of a committed batch, at its position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchReceipt {
    pub event_id: String,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

impl BatchRecord {
    /// The record's value: JSON, so that an operator can read the topic with any consumer.
    pub fn encode(&self) -> String {
        let receipts: Vec<_> = self
            .receipts
            .iter()
            .map(|r| serde_json::json!([r.event_id, r.topic, r.partition, r.offset]))
            .collect();
        let kept: Vec<_> = self
            .kept
            .iter()
            .map(|k| {
                serde_json::json!([
                    k.event_id,
                    k.aggregate_type,
                    k.aggregate_id,
                    k.version,
                    k.quarantined.as_ref().map(|q| &q.0),
                    k.quarantined.as_ref().map(|q| &q.1)
                ])
            })
            .collect();
        serde_json::json!({
            "slot": self.slot,
            "generation": self.generation,
            "batch": self.batch,
            "through": self.through.to_string(),
            "receipts": receipts,
            "kept": kept,
        })
        .to_string()
    }

    /// Reads a record's value back; an error names what is missing or malformed.
    pub fn decode(value: &[u8]) -> Result<BatchRecord, String> {
        let v: serde_json::Value =
            serde_json::from_slice(value).map_err(|e| format!("not JSON: {e}"))?;
        let field = |name: &str| v.get(name).ok_or_else(|| format!("no field {name:?}"));
        let int = |name: &str| -> Result<i64, String> {
            field(name)?
                .as_i64()
                .ok_or_else(|| format!("{name:?} is not an integer"))
        };
        let text = |name: &str| -> Result<String, String> {
            field(name)?
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("{name:?} is not a string"))
        };
        let through = text("through")?;
        let mut receipts = Vec::new();
        for r in field("receipts")?
            .as_array()
            .ok_or("\"receipts\" is not an array")?
        {
            let bad = || format!("receipt {r} is not [event_id, topic, partition, offset]");
            let part = |i: usize| r.get(i).ok_or_else(bad);
            receipts.push(BatchReceipt {
                event_id: part(0)?.as_str().ok_or_else(bad)?.to_string(),
                topic: part(1)?.as_str().ok_or_else(bad)?.to_string(),
                partition: part(2)?
                    .as_i64()
                    .and_then(|p| i32::try_from(p).ok())
                    .ok_or_else(bad)?,
                offset: part(3)?.as_i64().ok_or_else(bad)?,
            });
        }
        let mut kept = Vec::new();
        for k in v
            .get("kept")
            .and_then(|k| k.as_array())
            .into_iter()
            .flatten()
        {
            let bad = || {
                format!("kept {k} is not [event_id, aggregate_type, aggregate_id, version, code or null, reason or null]")
            };
            let part = |i: usize| k.get(i).ok_or_else(bad);
            let text = |i: usize| -> Result<String, String> {
                Ok(part(i)?.as_str().ok_or_else(bad)?.to_string())
            };
            let quarantined = match (part(4)?, part(5)?) {
                (serde_json::Value::Null, _) => None,
                (code, reason) => Some((
                    code.as_str().ok_or_else(bad)?.to_string(),
                    reason.as_str().ok_or_else(bad)?.to_string(),
                )),
            };
            kept.push(BatchKept {
                event_id: text(0)?,
                aggregate_type: text(1)?,
                aggregate_id: text(2)?,
                version: part(3)?.as_i64().ok_or_else(bad)?,
                quarantined,
            });
        }
        Ok(BatchRecord {
            slot: text("slot")?,
            generation: int("generation")?,
            batch: u64::try_from(int("batch")?).map_err(|_| "\"batch\" is negative")?,
            through: through
                .parse()
                .map_err(|_| format!("\"through\" {through:?} is not an LSN"))?,
            receipts,
            kept,
        })
    }
}

/// How a transactional step failed, as the relay must act on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnFailure {
    /// Another producer initialised the same transactional id: this one lost the slot and
    /// must stop; nothing of its open transaction becomes visible.
    Fenced,
    /// The transaction cannot commit (a send failed): abort it; nothing of it is visible.
    Abortable,
    /// The outcome is not known yet (e.g. a timeout): ask again; never send the batch anew
    /// before the broker said it is not committed.
    Retriable,
    /// The producer cannot go on (misconfiguration, an unsupported broker).
    Fatal,
}

impl TxnFailure {
    /// What the operator reads after the error.
    pub fn what_to_do(&self) -> &'static str {
        match self {
            TxnFailure::Fenced => "another relay opened the same transactional id and holds the slot now; this one sends nothing more",
            TxnFailure::Abortable => "the batch is aborted (nothing of it is visible) and sent again in a new transaction",
            TxnFailure::Retriable => "the outcome is not known yet: ask again, or let the next holder's start settle it; the batch is not sent anew before the broker says it is not committed",
            TxnFailure::Fatal => "this producer cannot go on: a running relay opens a new one under the same id and settles the batch from the broker's records; if opening fails too, the broker must support transactions (Kafka 2.5+, transaction.state.log.replication.factor and transaction.state.log.min.isr at most the brokers up) and let this principal use the transactional id (docs/exactly_once.md)",
        }
    }
}

/// Sorts a transactional error the way [`TxnFailure`] says to act on it.
fn failure_of(e: &KafkaError) -> TxnFailure {
    use RDKafkaErrorCode as C;
    let KafkaError::Transaction(t) = e else {
        return TxnFailure::Fatal;
    };
    match t.code() {
        C::ProducerFenced | C::InvalidProducerEpoch | C::Fenced => TxnFailure::Fenced,
        _ if t.txn_requires_abort() => TxnFailure::Abortable,
        _ if t.is_retriable() => TxnFailure::Retriable,
        _ => TxnFailure::Fatal,
    }
}

/// A transactional, idempotent, `acks=all` producer for one slot.
pub struct TxnSink {
    producer: KafkaProducer,
    config: KafkaSinkConfig,
    transactional_id: String,
    positions_topic: String,
}

impl std::fmt::Debug for TxnSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxnSink")
            .field("bootstrap_servers", &self.config.bootstrap_servers)
            .field("transactional_id", &self.transactional_id)
            .field("positions_topic", &self.positions_topic)
            .finish()
    }
}

impl TxnSink {
    /// Builds the producer and initialises transactions under `transactional_id`, fencing
    /// any earlier producer of that id (its open transaction is aborted by the broker).
    /// Blocking for up to `timeout`: call it from a blocking thread.
    pub fn open(
        config: KafkaSinkConfig,
        transactional_id: &str,
        positions_topic: &str,
        reports: UnboundedSender<Delivery>,
        timeout: Duration,
    ) -> Result<TxnSink, SinkError> {
        let mut cc = producer_config(&config, "outboxd-txn");
        // A dead holder's open transaction holds `read_committed` readers back until the
        // next holder opens, or until this timeout: the lease TTL's default, or the message
        // timeout if longer (librdkafka refuses a message timeout past it).
        if !config
            .properties
            .iter()
            .any(|(k, _)| k == "transaction.timeout.ms")
        {
            let ms = config.message_timeout.as_millis().max(10_000);
            cc.set("transaction.timeout.ms", ms.to_string());
        }
        cc.set("transactional.id", transactional_id)
            .set("enable.idempotence", "true")
            .set("acks", "all");
        let producer: KafkaProducer = cc
            .create_with_context(SinkContext::new(reports))
            .map_err(|e| SinkError::Config(Box::new(e)))?;
        producer
            .init_transactions(timeout)
            .map_err(|e| txn_error("initialising transactions", transactional_id, e))?;
        Ok(TxnSink {
            producer,
            config,
            transactional_id: transactional_id.to_string(),
            positions_topic: positions_topic.to_string(),
        })
    }

    /// Starts the next batch's transaction.
    pub fn begin(&self) -> Result<(), SinkError> {
        self.producer
            .begin_transaction()
            .map_err(|e| txn_error("beginning a transaction", &self.transactional_id, e))
    }

    /// Enqueues one event into the open transaction; its delivery report (final offset, not
    /// yet visible to `read_committed` consumers) arrives with `token`.
    pub async fn send(&self, ev: &OutboxEvent, token: u64) -> Result<(), SinkError> {
        enqueue(|| &self.producer, ev, token, &self.config.headers).await
    }

    /// Writes `record` into the positions topic and commits the transaction: the batch's
    /// events and its record become visible together. Returns where the record is stored
    /// (`None` only if librdkafka did not report it before the commit returned; reading from
    /// the previous record's position still finds it). Blocking for up to `timeout`.
    pub fn commit(
        &self,
        record: &BatchRecord,
        timeout: Duration,
    ) -> Result<Option<RecordPosition>, SinkError> {
        let value = record.encode();
        let sent = Box::new(Sent {
            token: BATCH_RECORD_TOKEN,
            topic: self.positions_topic.clone(),
        });
        let row = BaseRecord::with_opaque_to(&self.positions_topic, sent)
            .key(record.slot.as_bytes())
            .payload(value.as_bytes());
        let position = &self.producer.context().record_position;
        if let Ok(mut p) = position.lock() {
            *p = None;
        }
        self.producer
            .send(row)
            .map_err(|(source, _)| SinkError::Enqueue {
                event_id: format!("batch {} of slot {}", record.batch, record.slot),
                topic: self.positions_topic.clone(),
                class: classify(&source),
                source: Box::new(source),
            })?;
        // The commit flushes every message of the transaction: the record's report (and its
        // position) has been served when it returns. rust-rdkafka's flush polls the event
        // queue in steps of 100 ms while anything is in flight, and this producer's own
        // thread serves that queue: a commit whose record was still in flight took 100 ms
        // whatever it held (measured: 102-103 ms every batch on a local node). Waiting here
        // until nothing is in flight (the record's report served by that thread) lets the
        // flush return at once; past the deadline the commit reports the timeout itself.
        let deadline = Instant::now() + timeout;
        while self.producer.in_flight_count() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        self.producer
            .commit_transaction(timeout)
            .map_err(|e| txn_error("committing a batch", &self.transactional_id, e))?;
        Ok(position
            .lock()
            .ok()
            .and_then(|p| *p)
            .map(|(partition, offset)| RecordPosition { partition, offset }))
    }

    /// Aborts the open transaction: nothing sent in it becomes visible. Blocking.
    pub fn abort(&self, timeout: Duration) -> Result<(), SinkError> {
        self.producer
            .abort_transaction(timeout)
            .map_err(|e| txn_error("aborting a batch", &self.transactional_id, e))
    }
}

fn txn_error(step: &'static str, transactional_id: &str, e: KafkaError) -> SinkError {
    SinkError::Transaction {
        step,
        transactional_id: transactional_id.to_string(),
        failure: failure_of(&e),
        source: Box::new(e),
    }
}

/// Creates the positions topic when the brokers do not have it: one partition (a slot's
/// records are keyed by the slot, and read in order), replicated on up to three brokers,
/// `cleanup.policy=delete`. A topic that exists is left as it is. A principal that may not
/// create topics gets an error naming the topic to create. Blocking.
pub fn ensure_positions_topic(
    config: &KafkaSinkConfig,
    positions_topic: &str,
    timeout: Duration,
) -> Result<(), SinkError> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let unread = |reason: String| SinkError::PositionsUnread {
        topic: positions_topic.to_string(),
        reason,
    };
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &config.bootstrap_servers);
    for (k, v) in &config.properties {
        cc.set(k, v);
    }
    let consumer: BaseConsumer = cc
        .clone()
        .set("log_level", "3")
        .create()
        .map_err(|e| SinkError::Config(Box::new(e)))?;
    let metadata = consumer
        .fetch_metadata(None, timeout)
        .map_err(|e| SinkError::Unreachable {
            bootstrap: config.bootstrap_servers.clone(),
            source: Box::new(e),
        })?;
    let exists = metadata
        .topics()
        .iter()
        .any(|t| t.name() == positions_topic && t.error().is_none() && !t.partitions().is_empty());
    if exists {
        return Ok(());
    }
    let brokers = i32::try_from(metadata.brokers().len())
        .unwrap_or(1)
        .clamp(1, 3);
    let admin: AdminClient<DefaultClientContext> =
        cc.create().map_err(|e| SinkError::Config(Box::new(e)))?;
    let topic = NewTopic::new(positions_topic, 1, TopicReplication::Fixed(brokers))
        .set("cleanup.policy", "delete");
    let opts = AdminOptions::new()
        .request_timeout(Some(timeout))
        .operation_timeout(Some(timeout));
    let results =
        futures::executor::block_on(admin.create_topics([&topic], &opts)).map_err(|e| {
            unread(format!(
                "it is missing and creating it failed ({e}); create it (one partition)"
            ))
        })?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((_, code)) => {
                return Err(unread(format!(
                    "it is missing and creating it failed ({code}); create it (one partition), or let the relay's principal create topics"
                )))
            }
        }
    }
    // Until the brokers' metadata shows it (the records are read right after).
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let md = consumer.fetch_metadata(Some(positions_topic), timeout);
        let ready = md.as_ref().is_ok_and(|m| {
            m.topics()
                .iter()
                .any(|t| t.error().is_none() && !t.partitions().is_empty())
        });
        if ready {
            break;
        }
        if std::time::Instant::now() > deadline {
            return Err(unread(format!(
                "created, but not in the brokers' metadata within {timeout:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    tracing::info!(
        topic = positions_topic,
        replication = brokers,
        "created the positions topic"
    );
    Ok(())
}

/// The positions reader's context: the end of a partition is how the read knows it is done,
/// not an error to log (librdkafka reports it as a global error too).
struct PositionsReader;

impl ClientContext for PositionsReader {
    fn error(&self, error: KafkaError, reason: &str) {
        let eof = matches!(
            error,
            KafkaError::PartitionEOF(_) | KafkaError::Global(RDKafkaErrorCode::PartitionEOF)
        );
        if !eof {
            tracing::error!(%error, reason, "reading the positions topic");
        }
    }
}

impl ConsumerContext for PositionsReader {}

/// Every batch of `slot` committed in `positions_topic` after the records at `after` (one per
/// partition at most; a partition not named is read from its beginning), in the order
/// committed: what a `read_committed` consumer sees up to the last stable offset of each
/// partition. A batch still open (or left open by a dead producer that nobody fenced yet) is
/// not there, and nothing after it is read: a new holder's [`TxnSink::open`] settles it
/// first. Each with where it is stored (what the ledger keeps once it accepted it). A
/// positions topic the broker does not know is an error. Blocking.
pub fn committed_batches(
    bootstrap_servers: &str,
    positions_topic: &str,
    slot: &str,
    after: &[RecordPosition],
    timeout: Duration,
) -> Result<Vec<(RecordPosition, BatchRecord)>, SinkError> {
    let unreachable = |e: KafkaError| SinkError::Unreachable {
        bootstrap: bootstrap_servers.to_string(),
        source: Box::new(e),
    };
    let consumer: BaseConsumer<PositionsReader> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers)
        .set("group.id", "outboxd-positions-reader")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .create_with_context(PositionsReader)
        .map_err(|e| SinkError::Config(Box::new(e)))?;
    let deadline = std::time::Instant::now() + timeout;
    let metadata = consumer
        .fetch_metadata(Some(positions_topic), timeout)
        .map_err(unreachable)?;
    // A topic the broker does not know is an error, never "nothing committed": a restart
    // that read no batch would send again what the broker already holds.
    let topic = metadata
        .topics()
        .iter()
        .find(|t| t.name() == positions_topic);
    let partitions: Vec<i32> = topic
        .filter(|t| t.error().is_none())
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    if partitions.is_empty() {
        let answer = topic.and_then(|t| t.error());
        return Err(SinkError::PositionsUnread {
            topic: positions_topic.to_string(),
            reason: format!(
                "the broker lists no partition of it ({answer:?}); create it before the relay starts"
            ),
        });
    }
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        let from = match after.iter().find(|a| a.partition == *p) {
            Some(a) => Offset::Offset(a.offset + 1),
            None => Offset::Beginning,
        };
        tpl.add_partition_offset(positions_topic, *p, from)
            .map_err(unreachable)?;
    }
    consumer.assign(&tpl).map_err(unreachable)?;
    let mut at_end = std::collections::HashSet::new();
    let mut batches = Vec::new();
    while at_end.len() < partitions.len() {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(SinkError::PositionsUnread {
                topic: positions_topic.to_string(),
                reason: format!(
                    "{} of {} partitions read to their last stable offset within {timeout:?}",
                    at_end.len(),
                    partitions.len()
                ),
            });
        }
        match consumer.poll(left.min(Duration::from_millis(200))) {
            None => {}
            Some(Err(KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
            }
            Some(Err(e)) => return Err(unreachable(e)),
            Some(Ok(m)) => {
                at_end.remove(&m.partition());
                if m.key() != Some(slot.as_bytes()) {
                    continue;
                }
                let record =
                    BatchRecord::decode(m.payload().unwrap_or_default()).map_err(|reason| {
                        SinkError::PositionsUnread {
                            topic: positions_topic.to_string(),
                            reason: format!(
                                "the record at partition {} offset {}: {reason}",
                                m.partition(),
                                m.offset()
                            ),
                        }
                    })?;
                let at = RecordPosition {
                    partition: m.partition(),
                    offset: m.offset(),
                };
                batches.push((at, record));
            }
        }
    }
    Ok(batches)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> BatchRecord {
        BatchRecord {
            slot: "orders".into(),
            generation: 7,
            batch: 42,
            through: Lsn(0x16B_3748),
            receipts: vec![
                BatchReceipt {
                    event_id: "0190a1b2-0000-7000-8000-000000000001".into(),
                    topic: "outbox.event.order".into(),
                    partition: 3,
                    offset: 1_000_000_000_007,
                },
                BatchReceipt {
                    event_id: "0190a1b2-0000-7000-8000-000000000002".into(),
                    topic: "outbox.event.order".into(),
                    partition: 0,
                    offset: 0,
                },
            ],
            kept: vec![
                BatchKept {
                    event_id: "0190a1b2-0000-7000-8000-000000000003".into(),
                    aggregate_type: "order".into(),
                    aggregate_id: "o-9".into(),
                    version: 4,
                    quarantined: Some(("broker_rejected".into(), "message too large".into())),
                },
                BatchKept {
                    event_id: "0190a1b2-0000-7000-8000-000000000004".into(),
                    aggregate_type: "order".into(),
                    aggregate_id: "o-9".into(),
                    version: 5,
                    quarantined: None,
                },
            ],
        }
    }

    #[test]
    fn a_batch_record_reads_back_as_written() {
        let r = record();
        assert_eq!(BatchRecord::decode(r.encode().as_bytes()), Ok(r));
    }

    #[test]
    fn a_malformed_batch_record_is_refused_naming_what_is_wrong() {
        let mut v: serde_json::Value = serde_json::from_str(&record().encode()).unwrap();
        v["receipts"][1] = serde_json::json!(["id", "topic", "three", 0]);
        let err = BatchRecord::decode(v.to_string().as_bytes()).unwrap_err();
        assert!(
            err.contains("is not [event_id, topic, partition, offset]"),
            "{err}"
        );
        v["receipts"] = serde_json::json!([]);
        v["through"] = serde_json::json!("not an lsn");
        let err = BatchRecord::decode(v.to_string().as_bytes()).unwrap_err();
        assert!(err.contains("\"through\""), "{err}");
        assert!(BatchRecord::decode(b"{}").unwrap_err().contains("no field"));
        let mut v: serde_json::Value = serde_json::from_str(&record().encode()).unwrap();
        v["kept"][0] = serde_json::json!(["id", "order", "o-9", "four", null, null]);
        let err = BatchRecord::decode(v.to_string().as_bytes()).unwrap_err();
        assert!(err.contains("kept"), "{err}");
    }

    #[test]
    fn a_record_written_before_kept_events_reads_as_keeping_none() {
        let mut v: serde_json::Value = serde_json::from_str(&record().encode()).unwrap();
        v.as_object_mut().unwrap().remove("kept");
        let r = BatchRecord::decode(v.to_string().as_bytes()).unwrap();
        assert!(r.kept.is_empty());
        assert_eq!(r.receipts, record().receipts);
    }
}
