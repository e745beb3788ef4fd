//! The Kafka protocol for tests: real Apache Kafka by default, librdkafka's in-process mock
//! cluster only where a fault can be injected no other way.
//!
//! * [`TestKafka::for_test`] — the broker most tests run against: the process's shared
//!   single-node Apache Kafka ([`crate::apache_kafka::shared`]), or the external broker named
//!   by `OUTBOXD_TEST_KAFKA`.
//! * [`TestKafka::mock`] — librdkafka's mock cluster, for tests that inject faults only it can
//!   (a specific error code on the next Produce request, an exact round-trip time). It is not
//!   Kafka: it checks idempotent sequence numbers only for transactional producers and keeps
//!   one log per partition whoever leads. Such a test says why it needs the mock, and runs on
//!   it whatever `OUTBOXD_TEST_KAFKA` says (so nothing is skipped).
//!
//! The mock cluster listens on real TCP ports, so a relay running as a separate process (or
//! kcat) can talk to it while the test injects faults.

use std::time::Duration;

use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;

use crate::HarnessError;

/// A Kafka-protocol endpoint for one test (or for `outbox-embedded dev-broker` / `demo`).
pub struct TestKafka {
    bootstrap: String,
    mock: Option<SendMock>,
    /// The shared Apache Kafka node (`None`: the mock, or an external broker).
    apache: Option<&'static crate::apache_kafka::KafkaCluster>,
}

impl std::fmt::Debug for TestKafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestKafka")
            .field("bootstrap", &self.bootstrap)
            .field("mock", &self.mock.is_some())
            .field("apache", &self.apache.is_some())
            .finish()
    }
}

struct SendMock(MockCluster<'static, DefaultProducerContext>);

// SAFETY: librdkafka's mock cluster runs its own thread; every rd_kafka_mock_* entry point
// used through MockCluster takes the cluster's lock or posts an op to that thread, so the
// handle may be used and dropped from any thread. Only the handle pointer moves.
unsafe impl Send for SendMock {}
// SAFETY: see above; no method mutates Rust-side state.
unsafe impl Sync for SendMock {}

impl TestKafka {
    /// `OUTBOXD_TEST_KAFKA` (bootstrap servers of a real broker) if set, else the shared
    /// single-node Apache Kafka of this test process (started on first use).
    pub fn for_test() -> Result<TestKafka, HarnessError> {
        match std::env::var("OUTBOXD_TEST_KAFKA") {
            Ok(b) if !b.is_empty() => Ok(TestKafka {
                bootstrap: b,
                mock: None,
                apache: None,
            }),
            _ => {
                let cluster = crate::apache_kafka::shared()?;
                Ok(TestKafka {
                    bootstrap: cluster.bootstrap_servers(),
                    mock: None,
                    apache: Some(cluster),
                })
            }
        }
    }

    /// Brokers this test started itself (e.g. a [`crate::apache_kafka::KafkaCluster`] it
    /// pauses or kills), by their bootstrap servers.
    pub fn external(bootstrap: impl Into<String>) -> TestKafka {
        TestKafka {
            bootstrap: bootstrap.into(),
            mock: None,
            apache: None,
        }
    }

    /// librdkafka's mock cluster with `brokers` brokers: only for faults nothing else can
    /// inject (say why at the call site).
    pub fn mock(brokers: i32) -> Result<TestKafka, HarnessError> {
        let m = MockCluster::new(brokers).map_err(|e| HarnessError::Kafka(e.to_string()))?;
        Ok(TestKafka {
            bootstrap: m.bootstrap_servers(),
            mock: Some(SendMock(m)),
            apache: None,
        })
    }

    /// Whether this is the mock cluster (not Kafka).
    pub fn is_mock(&self) -> bool {
        self.mock.is_some()
    }

    pub fn bootstrap_servers(&self) -> &str {
        &self.bootstrap
    }

    /// The mock cluster, for fault injection; `None` against a real broker.
    pub fn mock_cluster(&self) -> Option<&MockCluster<'static, DefaultProducerContext>> {
        self.mock.as_ref().map(|m| &m.0)
    }

    /// Creates a topic with `partitions` partitions (replication factor 1) and waits until
    /// every partition has a leader. An existing topic is left as it is.
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Result<(), HarnessError> {
        self.create_topic_with(topic, partitions, &[])
    }

    /// [`Self::create_topic`] with topic configs (e.g. `max.message.bytes`); the mock ignores
    /// them.
    pub fn create_topic_with(
        &self,
        topic: &str,
        partitions: i32,
        configs: &[(&str, &str)],
    ) -> Result<(), HarnessError> {
        if let Some(m) = self.mock_cluster() {
            return m
                .create_topic(topic, partitions, 1)
                .map_err(|e| HarnessError::Kafka(format!("creating topic {topic}: {e}")));
        }
        crate::apache_kafka::create_topic_at(&self.bootstrap, topic, partitions, 1, configs)
    }

    /// Raises `topic`'s partition count to `total` (Apache Kafka only: the mock cannot).
    pub fn add_partitions(&self, topic: &str, total: i32) -> Result<(), HarnessError> {
        if self.mock_cluster().is_some() {
            return Err(HarnessError::Kafka(
                "librdkafka's mock cluster cannot raise a topic's partitions".into(),
            ));
        }
        crate::apache_kafka::add_partitions_at(&self.bootstrap, topic, total)
    }

    /// The shared Apache Kafka node behind this endpoint (`None` on the mock or an external
    /// broker): for tests that pause or kill it, start their own cluster instead.
    pub fn apache(&self) -> Option<&'static crate::apache_kafka::KafkaCluster> {
        self.apache
    }

    /// Round-trip delay on every broker of the mock (ACKs arrive late or not in time).
    pub fn set_round_trip(&self, brokers: i32, delay: Duration) -> Result<(), HarnessError> {
        if let Some(m) = self.mock_cluster() {
            for b in 1..=brokers {
                m.broker_round_trip_time(b, delay)
                    .map_err(|e| HarnessError::Kafka(e.to_string()))?;
            }
        }
        Ok(())
    }
}
