//! The end-to-end suite (`tests/e2e`) again, with every relay the harness starts in poll mode
//! (`outboxd run --mode poll`). Part of the README's `cargo test --workspace`, so both modes
//! pass the same tests in CI. A test of what only CDC mode has is reported ignored, with its
//! reason (`cdc_only!`); a test that would do here what it does in `e2e` (it pins its relay
//! mode, starts no relay, or starts its own Kafka cluster) is not compiled here (`e2e_only!`).

/// Every relay the harness starts runs `--mode poll` ([`harness::poll_mode`]).
pub(crate) const POLL_MODE: bool = true;

/// A test of what only CDC mode has: the runner reports it ignored, with `$why`.
macro_rules! cdc_only {
    ($why:literal; $($test:item)*) => { $(#[ignore = $why] $test)* };
}

/// A test that runs once, in the `e2e` target: not compiled here.
macro_rules! e2e_only {
    ($($test:item)*) => {};
}

// The modules of `e2e/main.rs`, less those whose every test runs once, in `e2e` (chaos,
// poll_mode and shards pin their relay modes; bad_input starts no relay through the harness;
// real_kafka starts its own Kafka clusters): `E2E_ONLY_MODULES` in e2e/main.rs.
#[path = "e2e/cli.rs"]
pub(crate) mod cli;
#[path = "e2e/cloudevents.rs"]
pub(crate) mod cloudevents;
#[path = "e2e/console.rs"]
pub(crate) mod console;
#[path = "e2e/crash.rs"]
pub(crate) mod crash;
#[path = "e2e/databases.rs"]
pub(crate) mod databases;
#[path = "e2e/debezium.rs"]
pub(crate) mod debezium;
#[path = "e2e/delivery.rs"]
pub(crate) mod delivery;
#[path = "e2e/delivery_sets.rs"]
pub(crate) mod delivery_sets;
#[path = "e2e/destinations.rs"]
pub(crate) mod destinations;
#[path = "e2e/ha.rs"]
pub(crate) mod ha;
#[path = "e2e/harness.rs"]
pub(crate) mod harness;
#[path = "e2e/http.rs"]
pub(crate) mod http;
#[path = "e2e/inbox.rs"]
pub(crate) mod inbox;
#[path = "e2e/jetstream.rs"]
pub(crate) mod jetstream;
#[path = "e2e/migration.rs"]
pub(crate) mod migration;
#[path = "e2e/observability.rs"]
pub(crate) mod observability;
#[path = "e2e/ordering.rs"]
pub(crate) mod ordering;
#[path = "e2e/plain_insert.rs"]
pub(crate) mod plain_insert;
#[path = "e2e/purge.rs"]
pub(crate) mod purge;
#[path = "e2e/receipts.rs"]
pub(crate) mod receipts;
#[path = "e2e/reconcile.rs"]
pub(crate) mod reconcile;
#[path = "e2e/roles.rs"]
pub(crate) mod roles;
#[path = "e2e/security.rs"]
pub(crate) mod security;
#[path = "e2e/sim_regressions.rs"]
pub(crate) mod sim_regressions;
#[path = "e2e/slot_safety.rs"]
pub(crate) mod slot_safety;
#[path = "e2e/takeover.rs"]
pub(crate) mod takeover;
#[path = "e2e/tls.rs"]
pub(crate) mod tls;
#[path = "e2e/unclear.rs"]
pub(crate) mod unclear;
#[path = "e2e/unknown.rs"]
pub(crate) mod unknown;
