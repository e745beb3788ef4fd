//! Kafka sink on librdkafka (`rdkafka::producer::ThreadedProducer`).
//!
//! # Semantics of the layer underneath
//! * `send` only enqueues into librdkafka's local queue; it never blocks. `QueueFull` is
//!   backpressure (wait for delivery reports to drain the queue), not a failure.
//! * Every enqueued message gets exactly one delivery report, from librdkafka's poll thread,
//!   via [`ProducerContext::delivery`]. We forward it unchanged into a tokio channel, with the
//!   caller's token, so the pipeline sees reports in the order librdkafka emits them.
//! * With `enable.idempotence=true` and `acks=all`, librdkafka retries internally without
//!   duplicates or reordering within a partition, for as long as `message.timeout.ms`; a
//!   report that still fails then carries the persistence status that tells whether the
//!   broker may have the message.
//! * A *success* report is evidence only with a real position: librdkafka's implicit ack
//!   reports success at offset -1001 for a message the broker may never have stored. Such a
//!   report is forwarded as a possibly persisted failure, never as `Persisted`
//!   ([`outbox_core::receipt::position_proof`]).

use std::borrow::Cow;
use std::time::Duration;

use outbox_core::OutboxEvent;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{
    BaseRecord, DeliveryResult, Partitioner, Producer, ProducerContext, ThreadedProducer,
};
use rdkafka::{ClientContext, Message, Timestamp};
use tokio::sync::mpsc::UnboundedSender;

pub use crate::headers::Headers;
use crate::{
    Delivery, DeliveryOutcome, FailureClass, Lookup, Persistence, Sink, SinkError, UnknownLookup,
};

/// The delivery-report token of a transactional batch record (`kafka_txn`): its report is not
/// forwarded (the commit is its answer). The relay's tokens count up from 0 and never reach
/// it.
pub const BATCH_RECORD_TOKEN: u64 = u64::MAX;

/// Sink settings. `properties` are passed to librdkafka verbatim (after ours, so they win,
/// except `enable.idempotence` and `acks`, which the relay's guarantees depend on).
/// Its `Debug` hides secret property values (see [`crate::redact`]).
#[derive(Clone)]
pub struct KafkaSinkConfig {
    pub bootstrap_servers: String,
    /// The broker cluster identity this relay publishes to; must equal each event's frozen
    /// `dest_cluster`.
    pub cluster_name: String,
    pub partitioner: String,
    pub message_timeout: Duration,
    pub linger: Duration,
    /// While fewer messages than this are outstanding (sent, not yet reported), a message goes
    /// through a second producer with no linger, the *express lane*; 0 disables it. See
    /// [`KafkaSink::send`] for why.
    pub express_max_in_flight: u32,
    /// How many events of one aggregate may be in flight at once (1: the next version waits
    /// for the broker's report on the one before). Above 1 the producer is made to keep what
    /// it took in order on the broker or deliver nothing after the first it lost
    /// (`enable.gapless.guarantee`, no message timeout) and the express lane is off, so that
    /// an aggregate's versions in flight share one producer and one partition
    /// ([`KafkaSink::aggregate_depth`]; docs/ordering.md, "Hot aggregates").
    pub in_flight_per_aggregate: u8,
    pub properties: Vec<(String, String)>,
    /// Optional header families (CloudEvents), see [`crate::headers`].
    pub headers: crate::HeaderOptions,
}

impl Default for KafkaSinkConfig {
    fn default() -> Self {
        KafkaSinkConfig {
            bootstrap_servers: "localhost:9092".into(),
            cluster_name: "default".into(),
            partitioner: "murmur2_random".into(),
            message_timeout: Duration::from_secs(30),
            linger: Duration::from_millis(2),
            express_max_in_flight: 32,
            in_flight_per_aggregate: 1,
            properties: Vec::new(),
            headers: crate::HeaderOptions::default(),
        }
    }
}

/// outboxd's producers: every one has the same context type, whether or not it places keys
/// itself ([`Placer`]).
pub(crate) type KafkaProducer = ThreadedProducer<SinkContext, Placer>;

pub(crate) struct SinkContext {
    tx: UnboundedSender<Delivery>,
    errors: std::sync::Mutex<RepeatGate>,
    /// Where the last transactional batch record was stored (`kafka_txn`), from its report.
    pub(crate) record_position: std::sync::Mutex<Option<(i32, i64)>>,
    /// Set where several versions of an aggregate are in flight: the producer's partitioner.
    place: Option<Placer>,
}

impl SinkContext {
    /// A context whose delivery reports go to `tx`; librdkafka's own partitioner places keys.
    pub(crate) fn new(tx: UnboundedSender<Delivery>) -> SinkContext {
        SinkContext {
            tx,
            errors: std::sync::Mutex::new(RepeatGate::default()),
            record_position: std::sync::Mutex::new(None),
            place: None,
        }
    }
}

/// librdkafka's key partitioners that place a key the same way whatever else is sent: the
/// ones a deeper gate can pin ([`Placer`]). `random` is not one; the `_random` variants
/// differ from their base only for a message without a key, and every outboxd message has
/// one (an empty key is placed as the base places it, never at random).
const PLACEABLE: [&str; 6] = [
    "murmur2_random",
    "murmur2",
    "consistent_random",
    "consistent",
    "fnv1a_random",
    "fnv1a",
];

/// Whether a deeper gate can place keys for `partitioner` ([`Placer`]).
pub fn placeable_partitioner(partitioner: &str) -> bool {
    builtin(partitioner).is_some()
}

/// The signature of librdkafka's built-in partitioners.
type Builtin = unsafe extern "C" fn(
    *const rdkafka::bindings::rd_kafka_topic_t,
    *const std::ffi::c_void,
    usize,
    i32,
    *mut std::ffi::c_void,
    *mut std::ffi::c_void,
) -> i32;

/// librdkafka's hash for the keys of `partitioner`, if it is one of [`PLACEABLE`].
fn builtin(partitioner: &str) -> Option<Builtin> {
    use rdkafka::bindings as b;
    match partitioner {
        "murmur2_random" | "murmur2" => Some(b::rd_kafka_msg_partitioner_murmur2),
        "consistent_random" | "consistent" => Some(b::rd_kafka_msg_partitioner_consistent),
        "fnv1a_random" | "fnv1a" => Some(b::rd_kafka_msg_partitioner_fnv1a),
        _ => None,
    }
}

/// The partitioner of a producer that has several versions of an aggregate in flight: the
/// configured librdkafka partitioner, by the partition count
/// [`outbox_core::placement::Placement`] pins (docs/ordering.md, "Hot aggregates"), so that
/// a partition count raised while versions are in flight never splits them across two
/// partitions. The hash is librdkafka's own function, so a key lands where librdkafka's
/// partitioner would place it by that count (and where consumers expect it).
#[derive(Debug)]
pub struct Placer {
    placement: std::sync::Mutex<outbox_core::placement::Placement>,
    builtin: Builtin,
    origin: std::time::Instant,
}

impl Placer {
    fn new(partitioner: &str) -> Option<Placer> {
        Some(Placer {
            placement: std::sync::Mutex::new(Default::default()),
            builtin: builtin(partitioner)?,
            origin: std::time::Instant::now(),
        })
    }

    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn placement(&self) -> std::sync::MutexGuard<'_, outbox_core::placement::Placement> {
        // A panic while holding it cannot leave the pins half-written (each call is one
        // map operation): carry on with them.
        self.placement
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Where `key` goes on a topic of `count` partitions.
    fn place(&self, key: &[u8], count: i32) -> i32 {
        // SAFETY: the base partitioners (murmur2, consistent, fnv1a) only hash `key[..len]`
        // and take it modulo `count`; they never read the topic handle or the opaques
        // (librdkafka's rdkafka_msg.c), so null pointers are never dereferenced. `key` is a
        // valid slice for the call; `count` is at least 1.
        unsafe {
            (self.builtin)(
                std::ptr::null(),
                key.as_ptr().cast(),
                key.len(),
                count.max(1),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        }
    }
}

impl Partitioner for Placer {
    fn partition(
        &self,
        topic_name: &str,
        key: Option<&[u8]>,
        partition_cnt: i32,
        _is_partition_available: impl Fn(i32) -> bool,
    ) -> i32 {
        let now = self.now();
        let count = self
            .placement()
            .count(topic_name, partition_cnt.max(1) as u32, now);
        self.place(key.unwrap_or_default(), count as i32)
    }
}

/// Which of librdkafka's repeated global errors reach the log. While a broker is down,
/// librdkafka reports `AllBrokersDown` (and its transport errors) every few tens of
/// milliseconds: 422 lines a minute in a newcomer's first hour (issue 34), which buried
/// everything else. The first of a kind is logged at once, then at most one per
/// [`RepeatGate::WINDOW`] with the count of those not logged in between. Pure: the caller
/// passes the time.
#[derive(Debug, Default)]
pub struct RepeatGate {
    seen: std::collections::HashMap<String, (std::time::Instant, u64)>,
}

impl RepeatGate {
    pub const WINDOW: Duration = Duration::from_secs(30);

    /// `Some(n)`: log this one, `n` of its kind were not logged since the last; `None`: count
    /// it and stay quiet.
    pub fn admit(&mut self, kind: &str, now: std::time::Instant) -> Option<u64> {
        match self.seen.get_mut(kind) {
            None => {
                self.seen.insert(kind.to_string(), (now, 0));
                Some(0)
            }
            Some((last, quiet)) if now.saturating_duration_since(*last) >= Self::WINDOW => {
                let n = *quiet;
                *last = now;
                *quiet = 0;
                Some(n)
            }
            Some((_, quiet)) => {
                *quiet += 1;
                None
            }
        }
    }
}

/// What the delivery callback needs of the send: the caller's token and the topic it was sent
/// to (a success report is checked against it).
pub(crate) struct Sent {
    pub(crate) token: u64,
    pub(crate) topic: String,
}

impl ClientContext for SinkContext {
    fn error(&self, error: KafkaError, reason: &str) {
        let kind = match error.rdkafka_error_code() {
            Some(code) => format!("{code:?}"),
            None => error.to_string(),
        };
        let admitted = match self.errors.lock() {
            Ok(mut gate) => gate.admit(&kind, std::time::Instant::now()),
            Err(_) => Some(0),
        };
        match admitted {
            Some(0) => tracing::error!(target: "librdkafka", "librdkafka: {error}: {reason}"),
            Some(n) => tracing::error!(
                target: "librdkafka",
                repeated = n,
                "librdkafka: {error}: {reason} ({n} more like it since the last such line)"
            ),
            None => {}
        }
    }
}

impl ProducerContext<Placer> for SinkContext {
    type DeliveryOpaque = Box<Sent>;

    fn get_custom_partitioner(&self) -> Option<&Placer> {
        self.place.as_ref()
    }

    fn delivery(&self, result: &DeliveryResult<'_>, sent: Box<Sent>) {
        // A transactional batch record's answer is its transaction's commit, not a report
        // (`kafka_txn`): the pipeline only ever hears of its own events. Its position is kept
        // for the commit to return.
        if sent.token == BATCH_RECORD_TOKEN {
            if let (Ok(m), Ok(mut slot)) = (result, self.record_position.lock()) {
                *slot = Some((m.partition(), m.offset()));
            }
            return;
        }
        let outcome = match result {
            Ok(m) => success_outcome(
                &sent.topic,
                m.topic(),
                m.partition(),
                m.offset(),
                match m.timestamp() {
                    Timestamp::NotAvailable => None,
                    Timestamp::CreateTime(t) | Timestamp::LogAppendTime(t) => Some(t),
                },
            ),
            Err((err, m)) => {
                // SAFETY: `m` is the message librdkafka passed to the delivery callback; its
                // pointer is valid for the duration of this call and status only reads it.
                let status = unsafe { rdkafka::bindings::rd_kafka_message_status(m.ptr()) };
                use rdkafka::bindings::rd_kafka_msg_status_t as S;
                let persistence = match status {
                    S::RD_KAFKA_MSG_STATUS_NOT_PERSISTED => Persistence::NotPersisted,
                    S::RD_KAFKA_MSG_STATUS_POSSIBLY_PERSISTED => Persistence::PossiblyPersisted,
                    S::RD_KAFKA_MSG_STATUS_PERSISTED => Persistence::Persisted,
                };
                DeliveryOutcome::Failed {
                    error: err.to_string(),
                    persistence,
                    class: classify(err),
                    partition: m.partition(),
                }
            }
        };
        // A closed channel means the pipeline is gone; the event is unresolved and will be
        // replayed from the checkpoint, so dropping the report is safe.
        let _ = self.tx.send(Delivery {
            token: sent.token,
            outcome,
        });
    }
}

/// A success report from librdkafka, as evidence. librdkafka reports success without a stored
/// message in at least one case: when a batch fails with a retriable error and a *later* batch
/// of the same partition succeeds, the idempotent producer "implicitly acks" the failed one
/// with offset -1001 (`rd_kafka_dr_implicit_ack`; upstream confluent-kafka-go#921). The broker
/// may not hold that message at all. Such a report is not `Persisted`: it becomes a possibly
/// persisted failure (DISPATCH_UNKNOWN), which the relay resolves by scanning the partition.
fn success_outcome(
    sent_topic: &str,
    topic: &str,
    partition: i32,
    offset: i64,
    timestamp_ms: Option<i64>,
) -> DeliveryOutcome {
    match outbox_core::receipt::position_proof(sent_topic, topic, partition, offset) {
        Ok(()) => DeliveryOutcome::Persisted {
            topic: topic.to_string(),
            partition,
            offset,
            timestamp_ms,
            // The idempotent producer never reports a broker-side duplicate as such.
            duplicate: false,
            evidence: None,
        },
        Err(why) => {
            tracing::warn!(topic = %sent_topic, partition, offset, reason = %why,
                "librdkafka reported success without a position: treated as DISPATCH_UNKNOWN");
            DeliveryOutcome::Failed {
                error: format!("success report is no proof of publication: {why}"),
                persistence: Persistence::PossiblyPersisted,
                class: FailureClass::Transient,
                partition,
            }
        }
    }
}

/// Permanent = retrying the same frozen message to the same frozen destination can never work.
pub fn classify(err: &KafkaError) -> FailureClass {
    use RDKafkaErrorCode as C;
    match err.rdkafka_error_code() {
        Some(
            C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::InvalidTopic
            | C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::InvalidRecord
            | C::PolicyViolation
            | C::InvalidRequiredAcks,
        ) => FailureClass::Permanent,
        _ => FailureClass::Transient,
    }
}

/// The Kafka headers of an event: `id` (Debezium outbox-router compatible) and the envelope
/// metadata, then the producer's own headers (a JSON object of strings; non-string values
/// are sent as their JSON text). Envelope headers cannot be overridden by row headers.
pub fn event_headers(ev: &OutboxEvent) -> Headers<'_> {
    fn b(s: &str) -> Cow<'_, [u8]> {
        Cow::Borrowed(s.as_bytes())
    }
    fn o(s: String) -> Cow<'static, [u8]> {
        Cow::Owned(s.into_bytes())
    }
    // Numbers and the id written without the formatting machinery (one event each).
    fn number(n: impl itoa::Integer) -> Cow<'static, [u8]> {
        Cow::Owned(itoa::Buffer::new().format(n).as_bytes().to_vec())
    }
    let mut id = [0u8; 36];
    let id = ev.event_id.hyphenated().encode_lower(&mut id);
    let mut h: Headers<'_> = Vec::with_capacity(12);
    h.push(("id".into(), Cow::Owned(id.as_bytes().to_vec())));
    h.push(("aggregate_type".into(), b(&ev.aggregate_type)));
    h.push(("aggregate_id".into(), b(&ev.aggregate_id)));
    h.push(("aggregate_version".into(), number(ev.aggregate_version)));
    h.push(("event_type".into(), b(&ev.event_type)));
    h.push(("envelope_generation".into(), number(ev.envelope_generation)));
    h.push(("payload_digest".into(), b(&ev.payload_digest)));
    h.push(("occurred_at".into(), b(&ev.occurred_at)));
    if let Some(s) = &ev.payload_schema {
        h.push(("payload_schema".into(), b(s)));
    }
    if let Some(t) = &ev.tenant {
        h.push(("tenant".into(), b(t)));
    }
    if let Some(s) = &ev.delivery_set_id {
        h.push(("delivery_set_id".into(), o(s.to_string())));
    }
    if let Some(extra) = ev.headers.as_deref() {
        if let Ok(serde_json::Value::Object(map)) = serde_json::from_str(extra) {
            for (k, v) in map {
                if h.iter().any(|(name, _)| *name == k) {
                    continue;
                }
                let bytes = match v {
                    serde_json::Value::String(s) => s.into_bytes(),
                    other => other.to_string().into_bytes(),
                };
                h.push((Cow::Owned(k), Cow::Owned(bytes)));
            }
        }
    }
    h
}

/// An idempotent, `acks=all` Kafka producer whose delivery reports go to a channel, and its
/// express lane (the same settings without linger) for a relay that has little in flight.
pub struct KafkaSink {
    producer: KafkaProducer,
    express: Option<KafkaProducer>,
    /// The relay's last word on whether it is bound by round trips ([`KafkaSink::pace`]).
    round_trip_bound: std::sync::atomic::AtomicBool,
    config: KafkaSinkConfig,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("bootstrap_servers", &self.config.bootstrap_servers)
            .field("cluster_name", &self.config.cluster_name)
            .finish()
    }
}

impl KafkaSink {
    /// Builds the producer. Delivery reports are sent to `reports`.
    pub fn new(
        config: KafkaSinkConfig,
        reports: UnboundedSender<Delivery>,
    ) -> Result<Self, SinkError> {
        let producer = Self::producer(&config, reports.clone(), None)?;
        // One producer where versions of an aggregate pipeline: two could deliver them out of
        // order.
        let express = match config.express_max_in_flight {
            _ if config.in_flight_per_aggregate > 1 => None,
            0 => None,
            _ => Some(Self::producer(&config, reports, Some(Duration::ZERO))?),
        };
        Ok(KafkaSink {
            producer,
            express,
            round_trip_bound: std::sync::atomic::AtomicBool::new(false),
            config,
        })
    }

    /// One producer with the sink's settings; `linger` overrides the configured one (and any
    /// `linger.ms` property) for the express lane.
    fn producer(
        config: &KafkaSinkConfig,
        reports: UnboundedSender<Delivery>,
        linger: Option<Duration>,
    ) -> Result<KafkaProducer, SinkError> {
        let client_id = if linger.is_some() {
            "outboxd-express"
        } else {
            "outboxd"
        };
        let mut cc = producer_config(config, client_id);
        if let Some(l) = linger {
            cc.set("linger.ms", (l.as_secs_f64() * 1000.0).to_string());
        }
        // The relay's guarantees rest on these two; they are not overridable.
        cc.set("enable.idempotence", "true").set("acks", "all");
        if config.in_flight_per_aggregate > 1 {
            // Several versions of an aggregate in flight are in order on the broker only if
            // the producer never lets a later one through after an earlier one failed: a
            // failure that could leave a gap is its fatal error (the run ends, the next opens
            // a new producer and looks up what was outstanding), and no message fails by
            // timeout, which that guarantee does not cover (librdkafka's CONFIGURATION.md).
            // An unanswered send waits for its answer or for the producer's end.
            cc.set("enable.gapless.guarantee", "true")
                .set("message.timeout.ms", "0");
        }
        let mut context = SinkContext::new(reports);
        if config.in_flight_per_aggregate > 1 {
            // And it places keys itself, by pinned partition counts ([`Placer`]).
            context.place = Some(Placer::new(&config.partitioner).ok_or_else(|| {
                SinkError::Config(Box::new(KafkaError::ClientCreation(format!(
                    "kafka.in_flight_per_aggregate = {} needs a key partitioner ({}); \
                     partitioner = \"{}\" places keys at random",
                    config.in_flight_per_aggregate,
                    PLACEABLE.join(", "),
                    config.partitioner
                ))))
            })?);
        }
        cc.create_with_context(context)
            .map_err(|e| SinkError::Config(Box::new(e)))
    }

    /// How many events of one aggregate the relay may have in flight through this sink
    /// (`KafkaSinkConfig::in_flight_per_aggregate`, at least 1).
    pub fn aggregate_depth(&self) -> u8 {
        self.config.in_flight_per_aggregate.max(1)
    }

    /// Tells the sink whether the relay is bound by round trips: more events wait behind their
    /// aggregates' in-flight events than are at the broker (the core decides:
    /// `PipelineCore::round_trip_bound`).
    pub fn pace(&self, round_trip_bound: bool) {
        self.round_trip_bound
            .store(round_trip_bound, std::sync::atomic::Ordering::Relaxed);
    }

    /// The producer for the next message. A relay bound by round trips rather than by volume
    /// (a backlog of a few hot aggregates: each sends its next version only when the broker
    /// has reported on the one before, docs/ordering.md) has little outstanding, and every
    /// millisecond of linger is a millisecond per event: measured on Apache Kafka, 10
    /// aggregates drained about 3x faster without linger. Everywhere else linger builds the
    /// batches that carry a wide backlog or a steady 10,000 events/s: without linger for
    /// every message, or whenever little was outstanding, the steady p50 went from 10-13 ms
    /// to 63-1,800 ms on 2 cores (many small requests cost the broker more than it had). So
    /// the express lane carries a message only while the relay is round-trip bound *and* has
    /// few messages outstanding. Which lane carries a message changes nothing the relay
    /// relies on: the gate orders an aggregate's versions by reports whichever producer sent
    /// them, both are idempotent with `acks=all`, and a look-up scans the partition, not a
    /// producer's session.
    fn lane(&self) -> &KafkaProducer {
        match &self.express {
            Some(x)
                if self
                    .round_trip_bound
                    .load(std::sync::atomic::Ordering::Relaxed)
                    && (self.in_flight().max(0) as u32) < self.config.express_max_in_flight =>
            {
                x
            }
            _ => &self.producer,
        }
    }

    pub fn config(&self) -> &KafkaSinkConfig {
        &self.config
    }

    /// Fetches cluster metadata to prove the brokers answer (used at start and by `check`).
    /// Blocking. A failed request is asked again until `timeout`: with one of several brokers
    /// down (a rolling restart), librdkafka can fail a request it had sent to that broker at
    /// once (for example DestroyBroker when it retires a bootstrap connection) although the
    /// others answer; only a cluster that does not answer for the whole timeout is unreachable.
    pub fn check_reachable(&self, timeout: Duration) -> Result<usize, SinkError> {
        let deadline = std::time::Instant::now() + timeout;
        ask_until(deadline, "metadata", |left| {
            self.producer.client().fetch_metadata(None, left)
        })
        .map(|m| m.brokers().len())
        .map_err(|source| SinkError::Unreachable {
            bootstrap: self.config.bootstrap_servers.clone(),
            source: Box::new(source),
        })
    }

    /// Enqueues one event; its delivery report arrives later with `token`. Waits (async)
    /// while librdkafka's queue is full.
    pub async fn send(&self, ev: &OutboxEvent, token: u64) -> Result<(), SinkError> {
        if let Some(placer) = &self.producer.context().place {
            self.admit(placer).await;
        }
        enqueue(|| self.lane(), ev, token, &self.config.headers).await
    }

    /// Before a send by a producer that places keys itself: adopts a raised partition count
    /// when nothing is in flight, and, if none came for [`Placement::DRAIN_AFTER`], waits up
    /// to [`DRAIN_WAIT`] for the producer to drain (`outbox_core::placement`).
    ///
    /// [`Placement::DRAIN_AFTER`]: outbox_core::placement::Placement::DRAIN_AFTER
    async fn admit(&self, placer: &Placer) {
        use outbox_core::placement::Admit;
        let in_flight = || self.in_flight().max(0) as usize;
        loop {
            let admit = placer.placement().admit(in_flight(), placer.now());
            match admit {
                Admit::Send => return,
                Admit::Repinned(c) => {
                    tracing::info!(
                        topic = %c.topic,
                        from = c.from,
                        to = c.to,
                        "the topic's partition count changed from {} to {}; adopted with \
                         nothing in flight, so no aggregate's versions are split across the \
                         two placements",
                        c.from,
                        c.to
                    );
                    return;
                }
                Admit::DrainFirst(c) => {
                    let deadline = tokio::time::Instant::now() + DRAIN_WAIT;
                    while in_flight() > 0 && tokio::time::Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    if in_flight() > 0 {
                        placer.placement().drain_gave_up(placer.now());
                        tracing::warn!(
                            topic = %c.topic,
                            from = c.from,
                            to = c.to,
                            in_flight = in_flight(),
                            "the topic's partition count changed from {} to {}, and the \
                             producer did not drain within {} ms to adopt it (an unanswered \
                             send: a partition without a leader?); keys stay placed by {} \
                             and it is tried again later",
                            c.from,
                            c.to,
                            DRAIN_WAIT.as_millis(),
                            c.from
                        );
                        return;
                    }
                }
            }
        }
    }

    /// The fatal error librdkafka raised on either producer, if it did
    /// ([`SinkError::ProducerFailed`]). An idempotent producer raises one when it can no longer
    /// vouch for order or once-ness (e.g. a head-of-line request answered
    /// `OUT_OF_ORDER_SEQUENCE_NUMBER`: the broker lost the producer's sequence state); it then
    /// purges its queue and refuses every message, so the producer must be replaced.
    pub fn failed(&self) -> Option<SinkError> {
        std::iter::once(&self.producer)
            .chain(self.express.as_ref())
            .find_map(fatal_error)
    }

    /// Messages enqueued and not yet reported.
    pub fn in_flight(&self) -> i32 {
        self.producer.in_flight_count() + self.express.as_ref().map_or(0, |x| x.in_flight_count())
    }

    /// Waits for outstanding deliveries (used at shutdown).
    pub fn flush(&self, timeout: Duration) {
        let deadline = std::time::Instant::now() + timeout;
        let _ = self.producer.flush(timeout);
        if let Some(x) = &self.express {
            let _ = x.flush(deadline.saturating_duration_since(std::time::Instant::now()));
        }
    }
}

/// How long a send waits for the producer to drain so that a raised partition count can be
/// adopted ([`KafkaSink::admit`]), once it waited for a natural moment in vain.
const DRAIN_WAIT: Duration = Duration::from_secs(2);

/// librdkafka's `socket.timeout.ms` for outboxd's producers (its default is 60 s): how long a
/// request to a broker that stopped answering (SIGSTOP, a hung JVM: the connection stays
/// open) waits. The idempotent producer stops producing to *every* partition while it drains
/// its in-flight requests after a message timed out, and that drain waited on such a request
/// (a metadata request sent to the stalled broker) for the full 60 s: every aggregate held,
/// not only the stalled broker's (e2e `unclear::a_stalled_partition_leader_holds_only_its_
/// aggregates_and_the_others_flow`: 67 s in 1 run of 4, 10.7 s with 10 s, 0.5-0.8 s when the
/// request went to a live broker). An operator's `kafka.socket.timeout.ms` wins.
const SOCKET_TIMEOUT_MS: &str = "10000";

/// The librdkafka settings every producer of outboxd starts from: the sink's own, then the
/// operator's `kafka.*` properties (which win over these, not over what the caller sets
/// after).
pub(crate) fn producer_config(config: &KafkaSinkConfig, client_id: &str) -> ClientConfig {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &config.bootstrap_servers)
        .set("partitioner", &config.partitioner)
        .set(
            "message.timeout.ms",
            config.message_timeout.as_millis().to_string(),
        )
        .set(
            "linger.ms",
            (config.linger.as_secs_f64() * 1000.0).to_string(),
        )
        .set("queue.buffering.max.messages", "200000")
        .set("socket.timeout.ms", SOCKET_TIMEOUT_MS)
        .set("client.id", client_id);
    for (k, v) in &config.properties {
        cc.set(k, v);
    }
    cc
}

/// An event's headers as it is sent: the envelope's, the producer's own, the optional families.
fn message_headers<'a>(ev: &'a OutboxEvent, options: &crate::HeaderOptions) -> Headers<'a> {
    let mut headers = event_headers(ev);
    crate::headers::add_optional_headers(&mut headers, ev, options);
    headers
}

/// Enqueues `ev` on the producer `lane` gives (asked again after each wait); its delivery
/// report arrives later with `token`. Waits (async) while librdkafka's queue is full.
pub(crate) async fn enqueue<'p>(
    lane: impl Fn() -> &'p KafkaProducer,
    ev: &OutboxEvent,
    token: u64,
    options: &crate::HeaderOptions,
) -> Result<(), SinkError> {
    let headers = message_headers(ev, options);
    loop {
        match lane().send(event_record(ev, token, &headers)) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // The producer is gone for good: not this event's refusal (nothing to park).
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::Fatal), _)) => {
                return Err(fatal_error(lane()).unwrap_or(SinkError::ProducerFailed {
                    reason: "librdkafka refused the message as fatal".into(),
                }))
            }
            Err((source, _)) => {
                return Err(SinkError::Enqueue {
                    event_id: ev.event_id.to_string(),
                    topic: ev.destination.topic.clone(),
                    class: classify(&source),
                    source: Box::new(source),
                })
            }
        }
    }
}

/// `producer`'s fatal error as a [`SinkError::ProducerFailed`], if librdkafka raised one.
fn fatal_error(producer: &KafkaProducer) -> Option<SinkError> {
    producer
        .client()
        .fatal_error()
        .map(|(code, reason)| SinkError::ProducerFailed {
            reason: format!("{code:?}: {reason}"),
        })
}

/// The record of `ev` for its frozen topic and key; its delivery report carries `token`.
fn event_record<'a>(
    ev: &'a OutboxEvent,
    token: u64,
    headers: &Headers<'_>,
) -> BaseRecord<'a, [u8], [u8], Box<Sent>> {
    let mut oh = OwnedHeaders::new_with_capacity(headers.len());
    for (k, v) in headers {
        oh = oh.insert(Header {
            key: k,
            value: Some(&v[..]),
        });
    }
    let sent = Box::new(Sent {
        token,
        topic: ev.destination.topic.clone(),
    });
    BaseRecord::with_opaque_to(&ev.destination.topic, sent)
        .key(ev.destination.key.as_bytes())
        .payload(&ev.payload[..])
        .headers(oh)
}

impl Sink for KafkaSink {
    fn served(&self) -> crate::Served {
        crate::Served {
            kind: "kafka",
            clusters: vec![self.config.cluster_name.clone()],
            partitioner: Some(self.config.partitioner.clone()),
        }
    }

    fn send(
        &self,
        ev: &OutboxEvent,
        token: u64,
    ) -> impl std::future::Future<Output = Result<(), SinkError>> + Send {
        // The inherent method (it takes precedence over this trait method).
        KafkaSink::send(self, ev, token)
    }

    fn ack_timeout(&self) -> Duration {
        self.config.message_timeout
    }

    /// A Kafka look-up only reads the partition.
    fn lookup_resends(&self, _sent_ago: Duration) -> bool {
        false
    }

    /// Scans the frozen partition for header `id` = event id (on a blocking thread).
    async fn lookup(&self, q: UnknownLookup<'_>) -> Result<Lookup, SinkError> {
        let config = self.config.clone();
        let (topic, partition, from, id) = (
            q.topic.to_string(),
            q.partition,
            q.from,
            q.event.event_id.to_string(),
        );
        let scan = tokio::task::spawn_blocking(move || {
            scan_for_event(
                &config,
                &topic,
                partition,
                from,
                &id,
                Duration::from_secs(30),
            )
        })
        .await
        .map_err(|_| SinkError::Closed)??;
        Ok(match scan.found {
            Some((offset, timestamp_ms)) => Lookup::Found {
                partition: q.partition,
                offset,
                timestamp_ms,
                scanned_from: scan.scanned_from,
                scanned_to: scan.scanned_to,
            },
            None => Lookup::Absent {
                scanned_from: scan.scanned_from,
                scanned_to: scan.scanned_to,
            },
        })
    }
}

/// Asks `request` (a blocking client request, given the time left) again every 200 ms until it
/// answers; its last error once less than 250 ms are left before `deadline`. A cluster with a
/// node down fails some requests that the next one, routed elsewhere, answers.
fn ask_until<T>(
    deadline: std::time::Instant,
    what: &str,
    mut request: impl FnMut(Duration) -> Result<T, KafkaError>,
) -> Result<T, KafkaError> {
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match request(left) {
            Ok(v) => return Ok(v),
            // Refused by the broker's ACLs: asking again changes nothing until a grant.
            Err(e) if left < Duration::from_millis(250) || denied(&e) => return Err(e),
            Err(e) => {
                tracing::debug!(error = %e, what, "request failed; asking again");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// What a partition scan proved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanResult {
    /// Offset and timestamp of the first message whose header `id` is the event id.
    pub found: Option<(i64, Option<i64>)>,
    pub scanned_from: i64,
    /// Exclusive: the high watermark when the scan started.
    pub scanned_to: i64,
}

/// Reads `topic`/`partition` from `from` up to the high watermark (read at the start) looking
/// for header `id` = `event_id`. Blocking; run it on a blocking thread. Used to resolve
/// DISPATCH_UNKNOWN: found means the broker has the event; not found over the whole range,
/// with the sending producer session closed, means it does not.
pub fn scan_for_event(
    config: &KafkaSinkConfig,
    topic: &str,
    partition: i32,
    from: i64,
    event_id: &str,
    timeout: Duration,
) -> Result<ScanResult, SinkError> {
    scan(config, topic, partition, Some(from), event_id, timeout)
}

/// Whether the relay may read `topic`/`partition` as a look-up does (`outboxd check`): its
/// offsets, then its last message. `Ok(true)`: a message was read; `Ok(false)`: the partition
/// is empty, so only its offsets could be read; [`SinkError::LookupDenied`]: the broker's ACLs
/// refuse it. Blocking.
pub fn probe_read(
    config: &KafkaSinkConfig,
    topic: &str,
    partition: i32,
    timeout: Duration,
) -> Result<bool, SinkError> {
    scan(config, topic, partition, None, "outboxd-check", timeout)
        .map(|r| r.scanned_to > r.scanned_from)
}

/// [`scan_for_event`] from `from`, or (`None`) over the partition's last message only.
fn scan(
    config: &KafkaSinkConfig,
    topic: &str,
    partition: i32,
    from: Option<i64>,
    event_id: &str,
    timeout: Duration,
) -> Result<ScanResult, SinkError> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Headers;
    use rdkafka::{Offset, TopicPartitionList};

    let failed = |source: KafkaError| scan_error(config, topic, partition, source);
    let mut cc = ClientConfig::new();
    for (k, v) in &config.properties {
        // Producer-only settings would make the consumer refuse to start.
        if !k.starts_with("security.") && !k.starts_with("sasl.") && !k.starts_with("ssl.") {
            continue;
        }
        cc.set(k, v);
    }
    let consumer: BaseConsumer = cc
        .set("bootstrap.servers", &config.bootstrap_servers)
        .set("group.id", format!("outboxd-reconcile-{event_id}"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .map_err(|e| SinkError::Config(Box::new(e)))?;
    // One broker of a cluster being down (a restart, a failover) is not a reason to give up:
    // librdkafka reconnects and re-routes by itself, so errors are asked again until the
    // deadline, and only the last one is reported.
    let deadline = std::time::Instant::now() + timeout;
    let (low, high) = ask_until(deadline, "watermark", |left| {
        consumer.fetch_watermarks(topic, partition, left)
    })
    .map_err(failed)?;
    let start = from.unwrap_or(high - 1).max(low);
    let mut result = ScanResult {
        found: None,
        scanned_from: start,
        scanned_to: high,
    };
    if start >= high {
        return Ok(result);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(start))
        .map_err(failed)?;
    consumer.assign(&tpl).map_err(failed)?;
    let mut next = start;
    let mut last_error = None;
    while next < high {
        if std::time::Instant::now() > deadline {
            return Err(failed(last_error.unwrap_or(
                KafkaError::MessageConsumption(RDKafkaErrorCode::OperationTimedOut),
            )));
        }
        let Some(m) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        // A consumer error here is informational (a broker connection failed, the leader
        // moved): librdkafka goes on fetching by itself. The deadline bounds the wait; a scan
        // that cannot finish proves nothing and leaves the attempt UNKNOWN.
        let m = match m {
            Ok(m) => m,
            // Refused, not failed: asking again until the deadline would only delay the fix.
            Err(e) if denied(&e) => return Err(failed(e)),
            Err(e) => {
                tracing::debug!(error = %e, topic, partition, "partition scan: consumer error; still reading");
                last_error = Some(e);
                continue;
            }
        };
        next = m.offset() + 1;
        let is_it = m.headers().is_some_and(|h| {
            h.iter()
                .any(|hd| hd.key == "id" && hd.value == Some(event_id.as_bytes()))
        });
        if is_it {
            let ts = match m.timestamp() {
                Timestamp::NotAvailable => None,
                Timestamp::CreateTime(t) | Timestamp::LogAppendTime(t) => Some(t),
            };
            result.found = Some((m.offset(), ts));
            return Ok(result);
        }
    }
    Ok(result)
}

/// Whether the broker refused a read by its ACLs (rather than failing it).
fn denied(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::TopicAuthorizationFailed | RDKafkaErrorCode::GroupAuthorizationFailed
        )
    )
}

/// What a partition scan's failure says: the relay may not read the topic (its ACLs; the fix
/// is a grant), or it could not reach the cluster.
fn scan_error(
    config: &KafkaSinkConfig,
    topic: &str,
    partition: i32,
    source: KafkaError,
) -> SinkError {
    if denied(&source) {
        return SinkError::LookupDenied {
            bootstrap: config.bootstrap_servers.clone(),
            topic: topic.to_string(),
            partition,
            source: Box::new(source),
        };
    }
    SinkError::Unreachable {
        bootstrap: config.bootstrap_servers.clone(),
        source: Box::new(source),
    }
}

/// The partition ids of `topic` (for scanning a whole topic).
pub fn topic_partitions(
    config: &KafkaSinkConfig,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<i32>, SinkError> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &config.bootstrap_servers)
        .create()
        .map_err(|e| SinkError::Config(Box::new(e)))?;
    let md = consumer
        .fetch_metadata(Some(topic), timeout)
        .map_err(|source| SinkError::Unreachable {
            bootstrap: config.bootstrap_servers.clone(),
            source: Box::new(source),
        })?;
    Ok(md
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect())
}

#[cfg(test)]
mod lane_tests {
    use super::*;

    fn sink(express_max_in_flight: u32) -> KafkaSink {
        // Creating a producer connects to nothing yet.
        let config = KafkaSinkConfig {
            bootstrap_servers: "127.0.0.1:1".into(),
            express_max_in_flight,
            ..KafkaSinkConfig::default()
        };
        KafkaSink::new(config, tokio::sync::mpsc::unbounded_channel().0).expect("sink")
    }

    #[test]
    fn the_express_lane_carries_messages_only_while_the_relay_is_round_trip_bound() {
        let s = sink(32);
        let main = &s.producer as *const _;
        assert!(
            std::ptr::eq(s.lane(), main),
            "by default: the batching producer"
        );
        s.pace(true);
        assert!(
            !std::ptr::eq(s.lane(), main),
            "round-trip bound: the express lane"
        );
        s.pace(false);
        assert!(std::ptr::eq(s.lane(), main));
        let off = sink(0);
        off.pace(true);
        assert!(off.express.is_none() && std::ptr::eq(off.lane(), &off.producer));
    }

    /// librdkafka's own test hook raises the fatal error an idempotent producer raises when it
    /// can no longer vouch for order (e2e `unknown::a_fatal_producer_error_is_survived_by_a_new_producer`
    /// provokes a real one): the sink names it, and a send is refused as the producer's end,
    /// not as one event's transient failure (which the relay would park and retry forever).
    #[tokio::test]
    async fn a_fatal_error_of_either_producer_is_the_sinks_end() {
        for express in [false, true] {
            let s = sink(32);
            assert!(s.failed().is_none(), "a new sink has not failed");
            let p = if express {
                s.express.as_ref().expect("express lane")
            } else {
                &s.producer
            };
            let reason = std::ffi::CString::new("planted by the test").unwrap();
            // SAFETY: the client pointer is the live producer's; the hook only sets its fatal
            // error state (as librdkafka's idempotence code does).
            let raised = unsafe {
                rdkafka::bindings::rd_kafka_test_fatal_error(
                    p.client().native_ptr(),
                    rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER,
                    reason.as_ptr(),
                )
            };
            assert_eq!(
                raised,
                rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
            );
            let failed = s.failed().expect("the fatal error is seen");
            assert!(
                matches!(&failed, SinkError::ProducerFailed { reason } if reason.contains("planted by the test")),
                "{failed}"
            );
            assert!(failed.is_transient(), "a new run starts a new producer");
            // Sent on the failed lane (the express lane carries while round-trip bound).
            s.pace(express);
            let ev = outbox_core::OutboxEvent::frozen(
                uuid::Uuid::nil(),
                ("order", "o-1", 1),
                "order.created",
                b"{}".to_vec().into(),
                outbox_core::Destination::kafka("default", "outbox.event.order", "o-1"),
            );
            match s.send(&ev, 1).await {
                Err(SinkError::ProducerFailed { .. }) => {}
                other => panic!("a send on a failed producer: {other:?}"),
            }
        }
    }
}

#[cfg(test)]
mod config_tests {
    use super::*;

    #[test]
    fn a_stalled_broker_holds_a_request_10_s_unless_the_operator_says_otherwise() {
        let mut config = KafkaSinkConfig::default();
        let cc = producer_config(&config, "outboxd");
        assert_eq!(cc.get("socket.timeout.ms"), Some("10000"));
        config
            .properties
            .push(("socket.timeout.ms".into(), "30000".into()));
        let cc = producer_config(&config, "outboxd");
        assert_eq!(cc.get("socket.timeout.ms"), Some("30000"));
    }
}

#[cfg(test)]
mod placer_tests {
    use super::*;

    /// librdkafka's own test vectors for its Java-compatible murmur2 (rdmurmur2.c).
    const JAVA_MURMUR2: [(&[u8], u32); 3] = [
        (b"kafka", 0xd067cf64),
        (b"giberish123456789", 0x8f552b0c),
        (b"", 0x106e08d9),
    ];

    #[test]
    fn keys_land_where_javas_partitioner_puts_them_by_the_pinned_count() {
        let placer = Placer::new("murmur2_random").expect("a key partitioner");
        for (key, hash) in JAVA_MURMUR2 {
            for count in [1, 3, 6, 7] {
                assert_eq!(
                    placer.place(key, count),
                    ((hash & 0x7fff_ffff) % count as u32) as i32,
                    "{key:?} over {count}"
                );
            }
        }
        // Pinned through the partitioner: the first count seen for the topic places keys
        // until nothing is in flight.
        let key: &[u8] = b"kafka";
        let by_3 = placer.partition("t", Some(key), 3, |_| true);
        let by_7 = placer.place(key, 7);
        assert_ne!(by_3, by_7, "the vector must move between the counts");
        assert_eq!(placer.partition("t", Some(key), 7, |_| true), by_3);
        let now = placer.now();
        assert!(matches!(
            placer.placement().admit(0, now),
            outbox_core::placement::Admit::Repinned(_)
        ));
        assert_eq!(placer.partition("t", Some(key), 7, |_| true), by_7);
    }

    #[test]
    fn a_random_partitioner_cannot_be_pinned_and_a_deeper_gate_refuses_it() {
        assert!(Placer::new("random").is_none());
        assert!(!placeable_partitioner("random"));
        assert!(
            PLACEABLE.iter().all(|p| placeable_partitioner(p)),
            "every name the refusal lists has its hash"
        );
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let config = KafkaSinkConfig {
            bootstrap_servers: "127.0.0.1:1".into(),
            partitioner: "random".into(),
            in_flight_per_aggregate: 4,
            ..KafkaSinkConfig::default()
        };
        let e = KafkaSink::new(config, tx).expect_err("refused");
        assert!(e.to_string().contains("places keys at random"), "{e}");
    }
}

#[cfg(test)]
mod repeat_gate_tests {
    use super::RepeatGate;
    use std::time::{Duration, Instant};

    #[test]
    fn a_repeated_error_is_logged_once_per_window_with_the_count_it_kept_quiet() {
        let mut gate = RepeatGate::default();
        let t0 = Instant::now();
        assert_eq!(gate.admit("AllBrokersDown", t0), Some(0));
        // librdkafka's pace while the broker is down: every 50 ms.
        let mut quiet = 0;
        for i in 1..600u64 {
            let t = t0 + Duration::from_millis(50 * i);
            if t.duration_since(t0) >= RepeatGate::WINDOW {
                break;
            }
            assert_eq!(gate.admit("AllBrokersDown", t), None, "at {i}");
            quiet += 1;
        }
        // Another kind is not held back by the first.
        assert_eq!(
            gate.admit("Transport", t0 + Duration::from_secs(1)),
            Some(0)
        );
        assert_eq!(
            gate.admit("AllBrokersDown", t0 + RepeatGate::WINDOW),
            Some(quiet)
        );
        assert_eq!(
            gate.admit(
                "AllBrokersDown",
                t0 + RepeatGate::WINDOW + Duration::from_millis(50)
            ),
            None
        );
    }
}
