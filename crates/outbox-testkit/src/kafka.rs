//! The Kafka protocol for tests: librdkafka's in-process mock cluster, or a real broker.
//!
//! The mock cluster listens on real TCP ports, so a relay running as a separate process (or
//! kcat) can talk to it while the test injects faults: request errors, broker down/up and
//! round-trip delays.

use std::time::Duration;

use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;

use crate::HarnessError;

/// A Kafka-protocol endpoint for one test (or for `outboxd dev-broker` / `demo`).
pub struct TestKafka {
    bootstrap: String,
    mock: Option<SendMock>,
}

impl std::fmt::Debug for TestKafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestKafka")
            .field("bootstrap", &self.bootstrap)
            .field("mock", &self.mock.is_some())
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
    /// `OUTBOXD_TEST_KAFKA` (bootstrap servers of a real broker) if set, else a mock cluster
    /// with `brokers` brokers.
    pub fn for_test(brokers: i32) -> Result<TestKafka, HarnessError> {
        match std::env::var("OUTBOXD_TEST_KAFKA") {
            Ok(b) if !b.is_empty() => Ok(TestKafka {
                bootstrap: b,
                mock: None,
            }),
            _ => TestKafka::mock(brokers),
        }
    }

    /// Always a mock cluster.
    pub fn mock(brokers: i32) -> Result<TestKafka, HarnessError> {
        let m = MockCluster::new(brokers).map_err(|e| HarnessError::Kafka(e.to_string()))?;
        Ok(TestKafka {
            bootstrap: m.bootstrap_servers(),
            mock: Some(SendMock(m)),
        })
    }

    pub fn bootstrap_servers(&self) -> &str {
        &self.bootstrap
    }

    /// The mock cluster, for fault injection; `None` against a real broker (tests that need
    /// faults skip themselves there and say so).
    pub fn mock_cluster(&self) -> Option<&MockCluster<'static, DefaultProducerContext>> {
        self.mock.as_ref().map(|m| &m.0)
    }

    /// Creates a topic on the mock (a real broker is expected to auto-create or have it).
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Result<(), HarnessError> {
        if let Some(m) = self.mock_cluster() {
            m.create_topic(topic, partitions, 1)
                .map_err(|e| HarnessError::Kafka(format!("creating topic {topic}: {e}")))?;
        }
        Ok(())
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
