//! The transactional producer of the exactly-once mode (issue 30, docs/exactly_once.md) on a
//! real Apache Kafka node: what the mode relies on, proven before the relay uses it.
//!
//! * A batch's events and its batch record become visible to `read_committed` consumers
//!   together, at commit; every receipt in the record is checked against the topic.
//! * An aborted batch never becomes visible, although its events reached the broker (a
//!   `read_uncommitted` consumer sees them: the abort had something to hide).
//! * A second producer of the same transactional id fences the first: the first's commit
//!   fails as fenced and nothing of its open batch becomes visible.
//!
//! Needs a JDK 17+ and Maven (or a warm jar cache): a missing tool fails with the install hint.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use outbox_core::{Destination, Lsn, OutboxEvent};
use outbox_sink::kafka_txn::{
    committed_batches, BatchReceipt, BatchRecord, RecordPosition, TxnFailure, TxnSink,
    BATCH_RECORD_TOKEN,
};
use outbox_sink::{Delivery, DeliveryOutcome, KafkaSinkConfig, SinkError};
use outbox_testkit::apache_kafka;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::task::block_in_place;

const WAIT: Duration = Duration::from_secs(30);

fn event(topic: &str, aggregate_id: &str, version: i64) -> OutboxEvent {
    OutboxEvent::frozen(
        uuid::Uuid::now_v7(),
        ("order", aggregate_id, version),
        "order.changed",
        Bytes::from(format!("{{\"v\": {version}}}")),
        Destination::kafka("default", topic, aggregate_id),
    )
}

/// Unique names for one test: transactional id, events topic, positions topic.
fn names(test: &str) -> (String, String, String) {
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
    (
        format!("outboxd-{test}-{tag}"),
        format!("txn-events-{test}-{tag}"),
        format!("txn-positions-{test}-{tag}"),
    )
}

fn config(bootstrap: &str) -> KafkaSinkConfig {
    KafkaSinkConfig {
        bootstrap_servers: bootstrap.to_string(),
        message_timeout: Duration::from_secs(20),
        ..KafkaSinkConfig::default()
    }
}

fn open(bootstrap: &str, id: &str, positions: &str) -> (TxnSink, UnboundedReceiver<Delivery>) {
    let (tx, rx) = unbounded_channel();
    let sink = block_in_place(|| TxnSink::open(config(bootstrap), id, positions, tx, WAIT))
        .unwrap_or_else(|e| panic!("opening the transactional producer {id}: {e}"));
    (sink, rx)
}

/// Sends `events` into the open transaction and returns each one's receipt, from its report.
async fn send_all(
    sink: &TxnSink,
    rx: &mut UnboundedReceiver<Delivery>,
    events: &[OutboxEvent],
) -> Vec<BatchReceipt> {
    for (token, ev) in events.iter().enumerate() {
        sink.send(ev, token as u64).await.expect("enqueue");
    }
    let mut receipts: Vec<Option<BatchReceipt>> = vec![None; events.len()];
    for _ in events {
        let d = tokio::time::timeout(WAIT, rx.recv())
            .await
            .expect("a delivery report within 30 s")
            .expect("channel open");
        assert_ne!(
            d.token, BATCH_RECORD_TOKEN,
            "a batch record's report reached the pipeline"
        );
        let DeliveryOutcome::Persisted {
            topic,
            partition,
            offset,
            ..
        } = d.outcome
        else {
            panic!("event {} not persisted: {:?}", d.token, d.outcome)
        };
        receipts[d.token as usize] = Some(BatchReceipt {
            event_id: events[d.token as usize].event_id.to_string(),
            topic,
            partition,
            offset,
        });
    }
    receipts
        .into_iter()
        .map(|r| r.expect("a report per event"))
        .collect()
}

/// Every message of `topic` an `isolation` consumer reads to the end of each partition (for
/// `read_committed`, the last stable offset): its `id` header by (partition, offset).
fn read_all(bootstrap: &str, topic: &str, isolation: &str) -> HashMap<(i32, i64), String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("reader-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("isolation.level", isolation)
        .set("enable.partition.eof", "true")
        .create()
        .expect("consumer");
    let md = consumer
        .fetch_metadata(Some(topic), WAIT)
        .expect("metadata");
    let partitions: Vec<i32> = md.topics()[0].partitions().iter().map(|p| p.id()).collect();
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        tpl.add_partition_offset(topic, *p, Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + WAIT;
    let mut at_end = std::collections::HashSet::new();
    let mut seen = HashMap::new();
    while at_end.len() < partitions.len() {
        assert!(
            Instant::now() < deadline,
            "{topic} ({isolation}) not read to its end within {WAIT:?}: {} of {} partitions",
            at_end.len(),
            partitions.len()
        );
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Err(KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
            }
            Some(Err(e)) => panic!("reading {topic}: {e}"),
            Some(Ok(m)) => {
                at_end.remove(&m.partition());
                let id = m
                    .headers()
                    .and_then(|h| h.iter().find(|h| h.key == "id"))
                    .and_then(|h| h.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default();
                seen.insert((m.partition(), m.offset()), id);
            }
        }
    }
    seen
}

/// Every receipt names the event the topic holds at its position.
fn assert_receipts_hold(receipts: &[BatchReceipt], topic: &HashMap<(i32, i64), String>) {
    for r in receipts {
        assert_eq!(
            topic.get(&(r.partition, r.offset)),
            Some(&r.event_id),
            "receipt of {} at partition {} offset {}: the topic holds something else there",
            r.event_id,
            r.partition,
            r.offset
        );
    }
}

fn ids(topic: &HashMap<(i32, i64), String>) -> Vec<String> {
    let mut v: Vec<String> = topic.values().cloned().collect();
    v.sort();
    v
}

fn batch(slot: &str, generation: i64, n: u64, receipts: Vec<BatchReceipt>) -> BatchRecord {
    BatchRecord {
        slot: slot.to_string(),
        generation,
        batch: n,
        through: Lsn(0x1000 * n),
        receipts,
        kept: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_and_its_record_become_visible_together_and_an_aborted_batch_never() {
    let kafka = apache_kafka::shared().unwrap_or_else(|e| panic!("{e}"));
    let bootstrap = kafka.bootstrap_servers();
    let (id, events_topic, positions) = names("visible");
    kafka.create_topic(&events_topic, 2, 1, &[]).unwrap();
    kafka.create_topic(&positions, 1, 1, &[]).unwrap();
    let (sink, mut rx) = open(&bootstrap, &id, &positions);

    // Batch 1: two versions of one aggregate in flight at once, and another aggregate.
    let first = [
        event(&events_topic, "o-1", 1),
        event(&events_topic, "o-1", 2),
        event(&events_topic, "o-2", 1),
    ];
    sink.begin().expect("begin");
    let receipts = send_all(&sink, &mut rx, &first).await;
    // Reported (final offsets), stored, and still invisible to a committed reader.
    let before = block_in_place(|| read_all(&bootstrap, &events_topic, "read_committed"));
    assert!(before.is_empty(), "visible before the commit: {before:?}");
    let uncommitted = block_in_place(|| read_all(&bootstrap, &events_topic, "read_uncommitted"));
    assert_receipts_hold(&receipts, &uncommitted);
    let record = batch("orders", 3, 1, receipts.clone());
    let at = block_in_place(|| sink.commit(&record, WAIT))
        .expect("commit")
        .expect("the batch record's position");

    let committed = block_in_place(|| read_all(&bootstrap, &events_topic, "read_committed"));
    let mut want: Vec<String> = first.iter().map(|e| e.event_id.to_string()).collect();
    want.sort();
    assert_eq!(
        ids(&committed),
        want,
        "a committed reader sees the batch, once"
    );
    assert_receipts_hold(&receipts, &committed);
    // o-1's two versions, in flight together, stand in version order in their partition.
    assert_eq!(receipts[0].partition, receipts[1].partition, "{receipts:?}");
    assert!(
        receipts[0].offset < receipts[1].offset,
        "o-1 out of order: {receipts:?}"
    );
    let batches = block_in_place(|| committed_batches(&bootstrap, &positions, "orders", &[], WAIT))
        .expect("committed batches");
    assert_eq!(
        batches,
        vec![(at, record.clone())],
        "the broker's record of batch 1, where the commit said it is"
    );
    // Read from where the commit said the record is: it, and after it nothing.
    let before_it = RecordPosition {
        offset: at.offset - 1,
        ..at
    };
    let from_it =
        block_in_place(|| committed_batches(&bootstrap, &positions, "orders", &[before_it], WAIT))
            .expect("committed batches");
    assert_eq!(
        from_it,
        vec![(at, record.clone())],
        "the record is not where the commit said"
    );

    // Batch 2: sent, stored, aborted.
    let second = [
        event(&events_topic, "o-1", 3),
        event(&events_topic, "o-3", 1),
    ];
    sink.begin().expect("begin");
    let aborted = send_all(&sink, &mut rx, &second).await;
    let uncommitted = block_in_place(|| read_all(&bootstrap, &events_topic, "read_uncommitted"));
    assert_receipts_hold(&aborted, &uncommitted);
    block_in_place(|| sink.abort(WAIT)).expect("abort");
    let after = block_in_place(|| read_all(&bootstrap, &events_topic, "read_committed"));
    assert_eq!(ids(&after), want, "an aborted batch became visible");
    let batches = block_in_place(|| committed_batches(&bootstrap, &positions, "orders", &[], WAIT))
        .expect("committed batches");
    assert_eq!(batches, vec![(at, record)], "an aborted batch has a record");
    let after = block_in_place(|| committed_batches(&bootstrap, &positions, "orders", &[at], WAIT))
        .expect("committed batches");
    assert!(after.is_empty(), "committed after batch 1: {after:?}");
    // Another slot's reader finds nothing of this one.
    let other = block_in_place(|| committed_batches(&bootstrap, &positions, "payments", &[], WAIT))
        .expect("committed batches");
    assert!(other.is_empty(), "{other:?}");
    // A positions topic the broker does not know is no "nothing committed".
    let missing = format!("{positions}-missing");
    let err = block_in_place(|| committed_batches(&bootstrap, &missing, "orders", &[], WAIT))
        .expect_err("a missing positions topic read as empty");
    assert!(
        matches!(err, SinkError::PositionsUnread { .. }),
        "not reported as unread: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_holder_of_the_slot_fences_the_first_and_its_open_batch_stays_invisible() {
    let kafka = apache_kafka::shared().unwrap_or_else(|e| panic!("{e}"));
    let bootstrap = kafka.bootstrap_servers();
    let (id, events_topic, positions) = names("fenced");
    kafka.create_topic(&events_topic, 1, 1, &[]).unwrap();
    kafka.create_topic(&positions, 1, 1, &[]).unwrap();

    // The old holder's batch reaches the broker and is left open (a relay paused mid-batch).
    let (old, mut old_rx) = open(&bootstrap, &id, &positions);
    let stale = [event(&events_topic, "o-1", 1)];
    old.begin().expect("begin");
    let stale_receipts = send_all(&old, &mut old_rx, &stale).await;
    let uncommitted = block_in_place(|| read_all(&bootstrap, &events_topic, "read_uncommitted"));
    assert_receipts_hold(&stale_receipts, &uncommitted);

    // The new holder takes the slot: the broker aborts the open batch and fences the old one.
    let (new, mut new_rx) = open(&bootstrap, &id, &positions);
    let err = block_in_place(|| old.commit(&batch("orders", 1, 1, stale_receipts), WAIT))
        .expect_err("a fenced producer committed");
    assert!(
        matches!(
            err,
            SinkError::Transaction {
                failure: TxnFailure::Fenced,
                ..
            }
        ),
        "not reported as fenced: {err}"
    );
    let committed = block_in_place(|| read_all(&bootstrap, &events_topic, "read_committed"));
    assert!(
        committed.is_empty(),
        "the fenced batch became visible: {committed:?}"
    );

    // The new holder publishes as usual.
    let fresh = [event(&events_topic, "o-1", 1)];
    new.begin().expect("begin");
    let receipts = send_all(&new, &mut new_rx, &fresh).await;
    let record = batch("orders", 2, 1, receipts.clone());
    let at = block_in_place(|| new.commit(&record, WAIT))
        .expect("commit")
        .expect("the batch record's position");
    let committed = block_in_place(|| read_all(&bootstrap, &events_topic, "read_committed"));
    assert_eq!(ids(&committed), vec![fresh[0].event_id.to_string()]);
    assert_receipts_hold(&receipts, &committed);
    let after = block_in_place(|| committed_batches(&bootstrap, &positions, "orders", &[at], WAIT))
        .expect("committed batches");
    assert!(
        after.is_empty(),
        "committed after the new holder's batch: {after:?}"
    );
    let batches = block_in_place(|| committed_batches(&bootstrap, &positions, "orders", &[], WAIT))
        .expect("committed batches");
    assert_eq!(
        batches,
        vec![(at, record)],
        "only the new holder's batch is recorded"
    );
}
