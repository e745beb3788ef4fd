//! Versioned, idempotent migrations. The SQL lives in `migrations/` at the repository root and
//! is compiled into the binary, so `outboxd migrate` needs no files at run time.
//!
//! Each migration runs in its own transaction, under an advisory lock so two relays starting
//! at once cannot both apply it; its SHA-256 is recorded, and a migration whose text changed
//! after it was applied is an error, never silently re-run.

use sha2::{Digest, Sha256};
use tokio_postgres::Client;

use crate::{Context, LedgerError};

/// One embedded migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

/// All migrations, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "outbox",
        sql: include_str!("../../../migrations/0001_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "ledger",
        sql: include_str!("../../../migrations/0002_ledger.sql"),
    },
    Migration {
        version: 3,
        name: "ordering",
        sql: include_str!("../../../migrations/0003_ordering.sql"),
    },
    Migration {
        version: 4,
        name: "leases",
        sql: include_str!("../../../migrations/0004_leases.sql"),
    },
    Migration {
        version: 5,
        name: "attempts",
        sql: include_str!("../../../migrations/0005_attempts.sql"),
    },
    Migration {
        version: 6,
        name: "destination_migrations",
        sql: include_str!("../../../migrations/0006_destination_migrations.sql"),
    },
    Migration {
        version: 7,
        name: "delivery_sets",
        sql: include_str!("../../../migrations/0007_delivery_sets.sql"),
    },
    Migration {
        version: 8,
        name: "consumers_retention",
        sql: include_str!("../../../migrations/0008_consumers_retention.sql"),
    },
    Migration {
        version: 9,
        name: "debezium",
        sql: include_str!("../../../migrations/0009_debezium.sql"),
    },
    Migration {
        version: 10,
        name: "nats_routes",
        sql: include_str!("../../../migrations/0010_nats_routes.sql"),
    },
    Migration {
        version: 11,
        name: "receipt_positions",
        sql: include_str!("../../../migrations/0011_receipt_positions.sql"),
    },
    Migration {
        version: 12,
        name: "route_plan_cache",
        sql: include_str!("../../../migrations/0012_route_plan_cache.sql"),
    },
    Migration {
        version: 13,
        name: "head_journal",
        sql: include_str!("../../../migrations/0013_head_journal.sql"),
    },
    Migration {
        version: 14,
        name: "poller_takeover",
        sql: include_str!("../../../migrations/0014_poller_takeover.sql"),
    },
    Migration {
        version: 15,
        name: "poll_positions",
        sql: include_str!("../../../migrations/0015_poll_positions.sql"),
    },
    Migration {
        version: 16,
        name: "rows_around_enqueue",
        sql: include_str!("../../../migrations/0016_rows_around_enqueue.sql"),
    },
    Migration {
        version: 17,
        name: "share_buckets",
        sql: include_str!("../../../migrations/0017_share_buckets.sql"),
    },
    Migration {
        version: 18,
        name: "lease_early_takeover",
        sql: include_str!("../../../migrations/0018_lease_early_takeover.sql"),
    },
    Migration {
        version: 19,
        name: "relay_members",
        sql: include_str!("../../../migrations/0019_relay_members.sql"),
    },
    Migration {
        version: 20,
        name: "http_routes",
        sql: include_str!("../../../migrations/0020_http_routes.sql"),
    },
    Migration {
        version: 21,
        name: "trigger_privileges",
        sql: include_str!("../../../migrations/0021_trigger_privileges.sql"),
    },
    Migration {
        version: 22,
        name: "destination_encoding",
        sql: include_str!("../../../migrations/0022_destination_encoding.sql"),
    },
    Migration {
        version: 23,
        name: "enqueue_cost",
        sql: include_str!("../../../migrations/0023_enqueue_cost.sql"),
    },
    Migration {
        version: 24,
        name: "consumer_recipe",
        sql: include_str!("../../../migrations/0024_consumer_recipe.sql"),
    },
    Migration {
        version: 25,
        name: "takeover_scale",
        sql: include_str!("../../../migrations/0025_takeover_scale.sql"),
    },
    Migration {
        version: 26,
        name: "heads_from_receipts",
        sql: include_str!("../../../migrations/0026_heads_from_receipts.sql"),
    },
    Migration {
        version: 27,
        name: "digests_by_relay",
        sql: include_str!("../../../migrations/0027_digests_by_relay.sql"),
    },
    Migration {
        version: 28,
        name: "stream_heads_by_existence",
        sql: include_str!("../../../migrations/0028_stream_heads_by_existence.sql"),
    },
    Migration {
        version: 29,
        name: "heads_in_two_branches",
        sql: include_str!("../../../migrations/0029_heads_in_two_branches.sql"),
    },
    Migration {
        version: 30,
        name: "receipt_entries",
        sql: include_str!("../../../migrations/0030_receipt_entries.sql"),
    },
    Migration {
        version: 31,
        name: "narrow_row",
        sql: include_str!("../../../migrations/0031_narrow_row.sql"),
    },
    Migration {
        version: 32,
        name: "versions_unlogged",
        sql: include_str!("../../../migrations/0032_versions_unlogged.sql"),
    },
    Migration {
        version: 33,
        name: "receipt_of",
        sql: include_str!("../../../migrations/0033_receipt_of.sql"),
    },
    Migration {
        version: 34,
        name: "accepted_through",
        sql: include_str!("../../../migrations/0034_accepted_through.sql"),
    },
    Migration {
        version: 35,
        name: "heads_below_one",
        sql: include_str!("../../../migrations/0035_heads_below_one.sql"),
    },
    Migration {
        version: 36,
        name: "receipt_versions",
        sql: include_str!("../../../migrations/0036_receipt_versions.sql"),
    },
    Migration {
        version: 37,
        name: "transaction_records",
        sql: include_str!("../../../migrations/0037_transaction_records.sql"),
    },
    Migration {
        version: 38,
        name: "policy_generations",
        sql: include_str!("../../../migrations/0038_policy_generations.sql"),
    },
    Migration {
        version: 39,
        name: "stream_versions",
        sql: include_str!("../../../migrations/0039_stream_versions.sql"),
    },
    Migration {
        version: 40,
        name: "stream_version_log",
        sql: include_str!("../../../migrations/0040_stream_version_log.sql"),
    },
    Migration {
        version: 41,
        name: "event_id_default",
        sql: include_str!("../../../migrations/0041_event_id_default.sql"),
    },
    Migration {
        version: 42,
        name: "held_route_versions",
        sql: include_str!("../../../migrations/0042_held_route_versions.sql"),
    },
    Migration {
        version: 43,
        name: "enqueue_by_relay",
        sql: include_str!("../../../migrations/0043_enqueue_by_relay.sql"),
    },
];

const LOCK_KEY: i64 = 0x6f75_7462_6f78_6400; // "outboxd\0"

impl Migration {
    pub fn checksum(&self) -> String {
        hex::encode(Sha256::digest(self.sql.as_bytes()))
    }
}

/// The newest migration this build knows (and whose objects its code uses).
pub fn latest() -> i32 {
    MIGRATIONS.iter().map(|m| m.version).max().unwrap_or(0)
}

/// The newest migration applied to the database, or `None` when schema `outbox` has never been
/// migrated (no `outbox.schema_migrations`).
pub async fn applied(client: &Client) -> Result<Option<i32>, LedgerError> {
    let row = client
        .query_one(
            "SELECT to_regclass('outbox.schema_migrations') IS NOT NULL",
            &[],
        )
        .await
        .ctx("looking for outbox.schema_migrations")?;
    if !row.get::<_, bool>(0) {
        return Ok(None);
    }
    let row = client
        .query_one(
            "SELECT coalesce(max(version), 0) FROM outbox.schema_migrations",
            &[],
        )
        .await
        .ctx("reading the newest applied migration (outbox.schema_migrations)")?;
    Ok(Some(row.get(0)))
}

/// Applies every migration not yet applied. Returns the versions applied now (empty when the
/// database was already up to date).
pub async fn run(client: &mut Client) -> Result<Vec<i32>, LedgerError> {
    run_through(client, i32::MAX).await
}

/// [`run`], stopping after migration `last`: a database as an older outboxd left it (the
/// upgrade tests build theirs this way, then [`run`] the rest under their data).
pub async fn run_through(client: &mut Client, last: i32) -> Result<Vec<i32>, LedgerError> {
    client
        .batch_execute(
            "CREATE SCHEMA IF NOT EXISTS outbox;
             CREATE TABLE IF NOT EXISTS outbox.schema_migrations (
                 version    integer PRIMARY KEY,
                 name       text NOT NULL,
                 checksum   text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .ctx("creating outbox.schema_migrations")?;
    client
        .execute("SELECT pg_advisory_lock($1)", &[&LOCK_KEY])
        .await
        .ctx("taking the migration lock")?;
    let result = apply_all(client, last).await;
    client
        .execute("SELECT pg_advisory_unlock($1)", &[&LOCK_KEY])
        .await
        .ctx("releasing the migration lock")?;
    result
}

async fn apply_all(client: &mut Client, last: i32) -> Result<Vec<i32>, LedgerError> {
    let rows = client
        .query(
            "SELECT version, name, checksum FROM outbox.schema_migrations ORDER BY version",
            &[],
        )
        .await
        .ctx("reading applied migrations")?;
    let known_max = latest();
    for row in &rows {
        let version: i32 = row.get(0);
        if version > known_max {
            return Err(LedgerError::MigrationFromFuture { version });
        }
        if let Some(m) = MIGRATIONS.iter().find(|m| m.version == version) {
            let applied: String = row.get(2);
            if applied != m.checksum() {
                return Err(LedgerError::MigrationChanged {
                    version,
                    name: m.name.to_string(),
                    applied,
                    file: m.checksum(),
                });
            }
        }
    }
    let mut done = Vec::new();
    for m in MIGRATIONS.iter().filter(|m| m.version <= last) {
        if rows.iter().any(|r| r.get::<_, i32>(0) == m.version) {
            continue;
        }
        let tx = client
            .transaction()
            .await
            .ctx("beginning a migration transaction")?;
        tx.batch_execute(m.sql)
            .await
            .ctx(format!("applying migration {:04}_{}", m.version, m.name))?;
        tx.execute(
            "INSERT INTO outbox.schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            &[&m.version, &m.name, &m.checksum()],
        )
        .await
        .ctx("recording the migration")?;
        tx.commit()
            .await
            .ctx(format!("committing migration {}", m.version))?;
        done.push(m.version);
    }
    Ok(done)
}
