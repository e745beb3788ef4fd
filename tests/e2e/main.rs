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

mod harness;

mod bad_input;
mod chaos;
mod cli;
mod cloudevents;
mod console;
mod crash;
mod debezium;
mod delivery;
mod delivery_sets;
mod ha;
mod inbox;
mod jetstream;
mod migration;
mod observability;
mod ordering;
mod poll_mode;
mod purge;
mod real_kafka;
mod receipts;
mod reconcile;
mod security;
mod sim_regressions;
mod slot_safety;
mod takeover;
mod tls;
mod unknown;
