//! End-to-end tests: the real `outboxd` binary as a child process (so it can be SIGKILLed),
//! real PostgreSQL with `wal_level=logical` (one throwaway cluster per test run, one database
//! per test, each a copy of one database `outboxd migrate` made for the run), and real Apache Kafka (one single-node broker per test run, started by the
//! harness from jars resolved with Maven; or the broker named by `OUTBOXD_TEST_KAFKA`). Tests
//! that inject faults into Kafka start their own brokers (`real_kafka`); librdkafka's mock
//! cluster serves only the tests that need a fault only it can inject, and each says why
//! (`TestEnv::new_mock`, printed in the output).
//!
//! Crash points are reached with named failpoints (`OUTBOXD_FAILPOINTS`) or by waiting for a
//! ledger state, never by sleeping and hoping. Invariants are asserted as counts that must be 0.

/// This target runs every relay in CDC mode (`e2e_poll` is the same suite in poll mode).
pub(crate) const POLL_MODE: bool = false;

/// A test of what only CDC mode has; the literal (`"CDC only: ..."`) is the reason `e2e_poll`
/// reports it ignored with. Here it runs as written.
macro_rules! cdc_only {
    ($why:literal; $($test:item)*) => { $($test)* };
}

/// A test that runs once, in this target: it pins its relay mode, starts no relay, or starts
/// its own Kafka cluster. `e2e_poll` does not compile it.
macro_rules! e2e_only {
    ($($test:item)*) => { $($test)* };
}

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
pub(crate) mod exactly_once;
pub(crate) mod ha;
pub(crate) mod http;
pub(crate) mod inbox;
pub(crate) mod jetstream;
pub(crate) mod migration;
pub(crate) mod nats_nkey;
pub(crate) mod observability;
pub(crate) mod ordering;
pub(crate) mod plain_insert;
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

/// `e2e_poll` compiles every module of this suite but these (each test in them pins its relay
/// mode (exactly-once mode is CDC only), starts no relay through the harness (bad_input runs
/// `outboxd` on bad settings itself), starts its own Apache Kafka cluster, or tests a client
/// of the relay whose mode does not matter to it — another language's consumer, a webhook
/// receiver, NATS authentication: they run once, here).
#[cfg(test)]
const E2E_ONLY_MODULES: &[&str] = &[
    "bad_input",
    "chaos",
    "consumer_recipe",
    "exactly_once",
    "nats_nkey",
    "poll_mode",
    "real_kafka",
    "shards",
    "webhook_signatures",
];

/// A module added here and forgotten in `e2e_poll.rs` would never run in poll mode.
#[test]
fn the_poll_target_compiles_every_module_but_the_e2e_only_ones() {
    let declared = |root: &str| {
        root.lines()
            .filter_map(|l| l.trim().strip_prefix("pub(crate) mod "))
            .map(|m| m.trim_end_matches(';').to_string())
            .collect::<std::collections::BTreeSet<String>>()
    };
    let here = declared(include_str!("main.rs"));
    let poll = declared(include_str!("../e2e_poll.rs"));
    let expected: std::collections::BTreeSet<String> = here
        .iter()
        .filter(|m| !E2E_ONLY_MODULES.contains(&m.as_str()))
        .cloned()
        .collect();
    assert_eq!(
        poll, expected,
        "tests/e2e_poll.rs must declare every module of tests/e2e/main.rs but {E2E_ONLY_MODULES:?}"
    );
}
