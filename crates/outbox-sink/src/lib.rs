//! The sink: hands events to a broker and reports what the broker said.
//!
//! The relay never trusts "I called send". It trusts a delivery report, and a delivery report
//! carries the broker's *message persistence status*, because that is what decides the next
//! state of the event:
//!
//! * `Persisted` with a position (Kafka: partition/offset; JetStream: stream sequence) — a
//!   transport receipt, ready for the ledger. A broker that recognised the message as one it
//!   already stored (JetStream's `duplicate: true`) says so, with the *original* position.
//! * `NotPersisted` — the broker certainly does not have it; safe to send again.
//! * `PossiblyPersisted` — e.g. the request timed out in flight. The broker may or may not
//!   have appended it. This is DISPATCH_UNKNOWN: it must be reconciled, never guessed.
//!
//! Failures are also classified [`FailureClass::Permanent`] (will never succeed: message too
//! large, invalid or unauthorised topic) or [`FailureClass::Transient`]; the pipeline
//! quarantines the former and replays the latter.
//!
//! # One abstraction, three targets
//! The pipeline, the ledger, ordering and UNKNOWN reconciliation talk to a [`Sink`]; they do
//! not know which broker is behind it. [`KafkaSink`] (librdkafka), [`JetStreamSink`]
//! (async-nats) and [`HttpEndpoints`] (webhooks, one [`HttpSink`] per endpoint) implement it;
//! [`AnySink`] is the relay's choice between them at start. A
//! sink names what it serves (broker kind, cluster identity, partitioner) so that the route
//! stage can refuse events frozen for another destination, sends events with their metadata
//! headers, and resolves an UNKNOWN attempt with [`Sink::lookup`] — by a partition scan on
//! Kafka; by an idempotent re-publish (same `Nats-Msg-Id`) inside the stream's duplicate
//! window, or a subject scan outside it, on JetStream.

use std::future::Future;
use std::time::Duration;

use outbox_core::OutboxEvent;
use rdkafka::error::KafkaError;

pub mod headers;
pub mod http;
pub mod http_endpoints;
pub mod jetstream;
pub mod kafka;
pub mod kafka_txn;
pub mod redact;

pub use headers::HeaderOptions;
pub use http::{HttpReceipt, HttpSink, HttpSinkConfig};
pub use http_endpoints::HttpEndpoints;

pub use jetstream::{JetStreamSink, JetStreamSinkConfig, NatsAuth, StreamCheck};
pub use kafka::{
    event_headers, probe_read, scan_for_event, topic_partitions, KafkaSink, KafkaSinkConfig,
    ScanResult,
};

pub use outbox_core::delivery::{Delivery, DeliveryOutcome, FailureClass, Persistence, Served};

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("invalid Kafka producer configuration: {0}; check --bootstrap-servers and kafka.* properties")]
    Config(#[source] Box<KafkaError>),
    #[error("cannot reach Kafka at {bootstrap}: {source}; check --bootstrap-servers / OUTBOXD_BOOTSTRAP_SERVERS and that the broker is up")]
    Unreachable {
        bootstrap: String,
        #[source]
        source: Box<KafkaError>,
    },
    #[error("the relay may not read {topic}/{partition} at {bootstrap}: {source}; an UNKNOWN outcome is resolved by reading its partition, so grant the relay's principal READ and DESCRIBE on topic {topic} (e.g. kafka-acls.sh --add --allow-principal User:<relay> --operation Read --operation Describe --topic {topic}); until then its attempts stay UNKNOWN and their aggregates wait")]
    LookupDenied {
        bootstrap: String,
        topic: String,
        partition: i32,
        #[source]
        source: Box<KafkaError>,
    },
    #[error("librdkafka refused to enqueue event {event_id} for topic {topic}: {source}")]
    Enqueue {
        event_id: String,
        topic: String,
        class: FailureClass,
        #[source]
        source: Box<KafkaError>,
    },
    #[error("NATS at {url}: {what}: {message}; check --nats-url / OUTBOXD_NATS_URL and that nats-server runs with JetStream enabled (-js)")]
    Nats {
        url: String,
        what: String,
        message: String,
    },
    #[error("JetStream stream {stream} does not exist at {url}: create it (e.g. `nats stream add {stream} --subjects 'outbox.>' --dupe-window 2m`) or start the relay with --nats-create-stream")]
    StreamMissing { stream: String, url: String },
    #[error("the NATS server at {url} identifies as {server:?} but this relay serves cluster {configured:?}: events frozen for {configured:?} must not go to another cluster; pass --cluster-name {server} if this is the cluster the route policy names")]
    WrongCluster {
        url: String,
        server: String,
        configured: String,
    },
    #[error("the NATS client refused event {event_id} for subject {subject:?}: {message}")]
    Publish {
        event_id: String,
        subject: String,
        class: FailureClass,
        message: String,
    },
    #[error("cannot prove whether event {event_id} is in stream {stream}: {reason}; reconcile it by hand (`outboxd status --event {event_id}`), the relay will not guess")]
    Unprovable {
        event_id: String,
        stream: String,
        reason: String,
    },
    #[error("HTTP endpoint {endpoint} did not answer the retry of UNKNOWN event {event_id} with 2xx ({reason}); the attempt stays UNKNOWN and is retried after the reconnect backoff")]
    HttpUnanswered {
        endpoint: String,
        event_id: String,
        reason: String,
    },
    #[error("HTTP endpoint {endpoint}: {what}: {message}")]
    Http {
        endpoint: String,
        what: String,
        message: String,
    },
    #[error("Kafka transactions of {transactional_id}: {step} failed ({failure:?}): {source}; {}", failure.what_to_do())]
    Transaction {
        step: &'static str,
        transactional_id: String,
        failure: kafka_txn::TxnFailure,
        #[source]
        source: Box<KafkaError>,
    },
    #[error("cannot read the committed batches in Kafka topic {topic}: {reason}; check that the topic exists and the relay may read it")]
    PositionsUnread { topic: String, reason: String },
    /// librdkafka raised a fatal error on an idempotent producer: it can no longer vouch for
    /// order or once-ness, and refuses every message from then on.
    #[error("the Kafka producer failed fatally ({reason}): librdkafka refuses every message after such an error, so this run ends and the next starts a new producer; what was in flight is recorded UNKNOWN and looked up in its partition before anything is sent again")]
    ProducerFailed { reason: String },
    #[error("the delivery channel is closed (pipeline shutting down)")]
    Closed,
}

impl SinkError {
    /// The client refused the message in a way no retry can fix (too large, invalid topic or
    /// subject): the reason, for the quarantine record.
    pub fn permanent_refusal(&self) -> Option<String> {
        match self {
            SinkError::Enqueue {
                class: FailureClass::Permanent,
                source,
                ..
            } => Some(source.to_string()),
            SinkError::Publish {
                class: FailureClass::Permanent,
                message,
                ..
            } => Some(message.clone()),
            _ => None,
        }
    }

    /// Whether reconnecting and replaying can fix it.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            SinkError::Unreachable { .. }
                // An ACL granted later lets the next look-up through.
                | SinkError::LookupDenied { .. }
                | SinkError::Enqueue { .. }
                | SinkError::Nats { .. }
                | SinkError::HttpUnanswered { .. }
                | SinkError::Publish {
                    class: FailureClass::Transient,
                    ..
                }
                | SinkError::PositionsUnread { .. }
                // A new run starts a new producer.
                | SinkError::ProducerFailed { .. }
                // Fenced: another relay holds the slot now; this run ends and waits as a
                // standby, as after a lost lease.
                | SinkError::Transaction {
                    failure: kafka_txn::TxnFailure::Fenced
                        | kafka_txn::TxnFailure::Abortable
                        | kafka_txn::TxnFailure::Retriable,
                    ..
                }
        )
    }
}

/// An attempt whose outcome is unknown, as the ledger recorded it.
#[derive(Debug, Clone, Copy)]
pub struct UnknownLookup<'a> {
    /// The event exactly as frozen (a JetStream probe re-publishes it byte for byte).
    pub event: &'a OutboxEvent,
    /// Frozen topic / subject and the partition the attempt went to.
    pub topic: &'a str,
    pub partition: i32,
    /// First position that may hold the attempt's copy (everything before it was accepted
    /// long before the attempt was sent).
    pub from: i64,
    /// How long ago the attempt was sent.
    pub sent_ago: Duration,
}

/// What [`Sink::lookup`] proved about an UNKNOWN attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The broker has the attempt's copy at this position: it becomes the primary receipt of
    /// the attempt that sent it; nothing is sent again.
    Found {
        partition: i32,
        offset: i64,
        timestamp_ms: Option<i64>,
        scanned_from: i64,
        scanned_to: i64,
    },
    /// The whole range that could hold it was read and it is not there (with the sending
    /// session closed): a retry to the same frozen destination is allowed.
    Absent { scanned_from: i64, scanned_to: i64 },
    /// The broker proved it did not have the attempt's copy *by storing the probe*: an
    /// idempotent re-publish (same `Nats-Msg-Id`, inside the duplicate window) was not a
    /// duplicate. The probe is the retry; this is its receipt.
    StoredByProbe {
        partition: i32,
        offset: i64,
        timestamp_ms: Option<i64>,
        /// The probe's answer, as JSON, where the position proves nothing (HTTP).
        evidence: Option<String>,
    },
}

/// A broker the relay publishes to. Delivery reports go to the channel given at construction,
/// one per successful [`Sink::send`], with the caller's token.
pub trait Sink {
    /// What this sink serves (the route stage compares it with each frozen destination).
    fn served(&self) -> Served;

    /// Hands one event to the broker; its delivery report arrives later with `token`. Waits
    /// (async) under backpressure. An error means nothing was handed over.
    fn send(
        &self,
        ev: &OutboxEvent,
        token: u64,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;

    /// How long a send may wait for the broker's acknowledgement before its outcome is
    /// reported as failed (possibly persisted).
    fn ack_timeout(&self) -> Duration;

    /// Resolves an UNKNOWN attempt. Found and Absent are proofs; anything short of a proof is
    /// an error (the attempt stays UNKNOWN).
    fn lookup(
        &self,
        q: UnknownLookup<'_>,
    ) -> impl Future<Output = Result<Lookup, SinkError>> + Send;

    /// Whether looking up an attempt sent `sent_ago` sends the event again under its key (an
    /// HTTP retry with the same idempotency key; a JetStream re-publish with its `Nats-Msg-Id`
    /// inside the duplicate window) rather than reading what the broker holds. Such a look-up, once
    /// answered, answers every attempt of the event whose look-up would be the same re-send
    /// (`outbox_relay::unknown::answered_already`): asking again would send the event again
    /// after a clear answer.
    fn lookup_resends(&self, sent_ago: Duration) -> bool;
}

/// The relay's sink, chosen at start (`--sink kafka|nats|http`).
#[derive(Debug)]
pub enum AnySink {
    Kafka(KafkaSink),
    /// Boxed: the JetStream client state is much larger than the Kafka handle.
    JetStream(Box<JetStreamSink>),
    /// One or several webhook endpoints.
    Http(HttpEndpoints),
}

impl AnySink {
    /// Whether the relay is bound by round trips (see `KafkaSink::pace`); only Kafka batches
    /// by time, so only Kafka uses it.
    pub fn pace(&self, round_trip_bound: bool) {
        if let AnySink::Kafka(k) = self {
            k.pace(round_trip_bound);
        }
    }

    /// How many events of one aggregate may be in flight at once: a Kafka sink's setting
    /// (`KafkaSinkConfig::in_flight_per_aggregate`); 1 for JetStream and webhooks, whose
    /// outcomes are independent per message.
    pub fn aggregate_depth(&self) -> u8 {
        match self {
            AnySink::Kafka(k) => k.aggregate_depth(),
            AnySink::JetStream(_) | AnySink::Http(_) => 1,
        }
    }

    /// Whether the sink's client failed for good ([`SinkError::ProducerFailed`]): only a
    /// Kafka producer does (librdkafka's fatal errors); asked after a failed delivery.
    pub fn failed(&self) -> Option<SinkError> {
        match self {
            AnySink::Kafka(k) => k.failed(),
            AnySink::JetStream(_) | AnySink::Http(_) => None,
        }
    }
}

impl Sink for AnySink {
    fn served(&self) -> Served {
        match self {
            AnySink::Kafka(s) => s.served(),
            AnySink::JetStream(s) => s.served(),
            AnySink::Http(s) => s.served(),
        }
    }

    async fn send(&self, ev: &OutboxEvent, token: u64) -> Result<(), SinkError> {
        match self {
            AnySink::Kafka(s) => s.send(ev, token).await,
            AnySink::JetStream(s) => s.send(ev, token).await,
            AnySink::Http(s) => s.send(ev, token).await,
        }
    }

    fn ack_timeout(&self) -> Duration {
        match self {
            AnySink::Kafka(s) => s.ack_timeout(),
            AnySink::JetStream(s) => s.ack_timeout(),
            AnySink::Http(s) => s.ack_timeout(),
        }
    }

    async fn lookup(&self, q: UnknownLookup<'_>) -> Result<Lookup, SinkError> {
        match self {
            AnySink::Kafka(s) => s.lookup(q).await,
            AnySink::JetStream(s) => s.lookup(q).await,
            AnySink::Http(s) => s.lookup(q).await,
        }
    }

    fn lookup_resends(&self, sent_ago: Duration) -> bool {
        match self {
            AnySink::Kafka(s) => s.lookup_resends(sent_ago),
            AnySink::JetStream(s) => s.lookup_resends(sent_ago),
            AnySink::Http(s) => s.lookup_resends(sent_ago),
        }
    }
}
