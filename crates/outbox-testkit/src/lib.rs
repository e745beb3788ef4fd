//! Test harness: real PostgreSQL with `wal_level=logical` and the Kafka protocol, no fakes.
//!
//! * [`postgres`] starts a throwaway cluster from the installed server binaries on a free
//!   port (as root, the server runs as the `postgres` user, since initdb refuses root), once
//!   per process, unless `OUTBOXD_TEST_DATABASE_URL` names a server to use instead. Each test
//!   gets its own database.
//! * [`kafka`] gives each test the process's shared Apache Kafka node (or the broker that
//!   `OUTBOXD_TEST_KAFKA` names), or librdkafka's in-process mock cluster for a test that
//!   injects a fault only the mock can (it says which).
//! * [`apache_kafka`] runs real Apache Kafka brokers (KRaft, 1 or 3 nodes) resolved from
//!   Maven Central, with per-node pause / kill / restart; also the `outbox-kafka` binary.
//! * [`nats`] starts a throwaway `nats-server -js` (own port, store and name) for a test that
//!   injects broker faults: pause (SIGSTOP), resume, kill and restart on the same store.
//! * [`ports`] picks server ports below the ephemeral range, so no test's outgoing
//!   connection takes a port between its pick and the server's bind.
//! * [`wait`] polls a condition until a deadline — tests wait for states, never for sleeps.
//!
//! `outbox-embedded` (demo, bench, dev-broker) uses the same code to run the embedded default;
//! the daemon, `outboxd`, does not link this crate.

pub mod apache_kafka;
pub mod http_target;
pub mod kafka;
pub mod nats;
pub mod ports;
pub mod postgres;
pub mod tls;
pub mod wait;

/// Why the harness could not provide a component. The message says what to install or set.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("PostgreSQL server binaries not found (looked in $OUTBOXD_PG_BIN, `pg_config --bindir`, /usr/lib/postgresql/*/bin): install postgresql (e.g. `apt-get install postgresql`) or set OUTBOXD_PG_BIN")]
    NoPostgresBinaries,
    #[error("running as root, but there is no `postgres` user to run the server as (initdb refuses root): create one with `useradd -r postgres`")]
    NoPostgresUser,
    #[error("`{command}` failed: {detail}")]
    Command { command: String, detail: String },
    #[error("I/O error while {context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("database error while {context}: {source}")]
    Db {
        context: String,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("Kafka mock cluster: {0}")]
    Kafka(String),
    #[error("`{tool}` is missing ({detail}): the Apache Kafka test brokers need a JDK 17+ and Maven (the broker's jars are resolved from Maven Central once, then cached): install them, e.g. `apt-get install openjdk-17-jre-headless maven`")]
    NoJavaOrMaven { tool: String, detail: String },
    #[error("Apache Kafka broker: {0}")]
    ApacheKafka(String),
}
