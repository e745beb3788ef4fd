//! End-to-end tests: the real `outboxd` binary as a child process (so it can be SIGKILLed),
//! real PostgreSQL with `wal_level=logical` (one throwaway cluster per test run, one database
//! per test), and real Apache Kafka (one single-node broker per test run, started by the
//! harness from jars resolved with Maven; or the broker named by `OUTBOXD_TEST_KAFKA`). Tests
//! that inject faults into Kafka start their own brokers (`real_kafka`); librdkafka's mock
//! cluster serves only the tests that need a fault only it can inject, and each says why
//! (`TestEnv::new_mock`, printed in the output).
//!
//! Crash points are reached with named failpoints (`OUTBOXD_FAILPOINTS`) or by waiting for a
//! ledger state, never by sleeping and hoping. Invariants are asserted as counts that must be 0.

pub(crate) mod harness;

pub(crate) mod bad_input;
pub(crate) mod chaos;
pub(crate) mod cli;
pub(crate) mod cloudevents;
pub(crate) mod console;
pub(crate) mod consumer_recipe;
pub(crate) mod crash;
pub(crate) mod databases;
pub(crate) mod debezium;
pub(crate) mod delivery;
pub(crate) mod delivery_sets;
pub(crate) mod destinations;
pub(crate) mod ha;
pub(crate) mod http;
pub(crate) mod inbox;
pub(crate) mod jetstream;
pub(crate) mod migration;
pub(crate) mod nats_nkey;
pub(crate) mod observability;
pub(crate) mod ordering;
pub(crate) mod poll_mode;
pub(crate) mod purge;
pub(crate) mod real_kafka;
pub(crate) mod receipts;
pub(crate) mod reconcile;
pub(crate) mod roles;
pub(crate) mod security;
pub(crate) mod shards;
pub(crate) mod sim_regressions;
pub(crate) mod slot_safety;
pub(crate) mod takeover;
pub(crate) mod tls;
pub(crate) mod unclear;
pub(crate) mod unknown;
pub(crate) mod webhook_signatures;
