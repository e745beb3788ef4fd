//! What a broker said about one send, as values: the delivery report the sink produces and
//! the relay core decides on, and what a sink serves (the route stage's yardstick). No client
//! types: the Kafka and JetStream sinks translate their clients' reports into these.

/// What the broker has, as far as the client knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persistence {
    NotPersisted,
    PossiblyPersisted,
    Persisted,
}

/// Whether retrying can ever help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// Will never succeed as frozen (too large, invalid/unauthorised topic): quarantine.
    Permanent,
    /// May succeed later: replay.
    Transient,
}

/// The result of one send, reported once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryOutcome {
    Persisted {
        /// Kafka topic, or JetStream subject.
        topic: String,
        /// Kafka partition; 0 on JetStream (a stream has one sequence).
        partition: i32,
        /// Kafka offset, or JetStream stream sequence.
        offset: i64,
        /// Broker (or create) timestamp, milliseconds since the Unix epoch.
        timestamp_ms: Option<i64>,
        /// The broker said it already had this message (JetStream `duplicate: true`, by
        /// `Nats-Msg-Id`) and answered with the original position: nothing new was stored.
        duplicate: bool,
        /// What proves it beyond a position, as JSON: an HTTP endpoint's answer (status,
        /// response id, body digest). `None` for brokers, whose position is the proof.
        evidence: Option<String>,
    },
    Failed {
        error: String,
        persistence: Persistence,
        class: FailureClass,
        /// The partition the client chose (-1 if none yet): where an UNKNOWN outcome is looked
        /// up. Always 0 on JetStream.
        partition: i32,
    },
}

/// A delivery report with the caller's token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub token: u64,
    pub outcome: DeliveryOutcome,
}

/// What a sink serves: events whose frozen destination differs are refused by the route stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// `destination.v1` kind: `kafka`, `nats` or `http`.
    pub kind: &'static str,
    /// Broker cluster identities (the names the route policy uses): one for a broker, one per
    /// endpoint for an HTTP sink serving several endpoints.
    pub clusters: Vec<String>,
    /// The partitioner the frozen destination must name; `None` where the broker has no
    /// partitions (JetStream: one sequence per stream, order per subject).
    pub partitioner: Option<String>,
}

/// Where the broker stores a batch's transaction record (exactly-once into Kafka,
/// docs/exactly_once.md): the positions topic's partition and offset. The ledger keeps the
/// last one a slot accepted; a restart reads the batches committed after it
/// (`outbox_sink::kafka_txn::committed_batches`) and accepts them from their records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RecordPosition {
    pub partition: i32,
    pub offset: i64,
}
