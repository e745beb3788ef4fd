//! The slot and the publication, and the start-up decision.
//!
//! # Why the relay refuses to start on some slots
//! The slot's `confirmed_flush_lsn` is the resume point: PostgreSQL will never again send a
//! transaction that committed before it. The ledger's checkpoint is the highest LSN the relay
//! has *proven* (every event before it has an accepted receipt). The relay only ever confirms
//! what the ledger has stored, so for a healthy slot `slot <= checkpoint` always holds. If the
//! slot is ahead of the checkpoint, somebody else moved it, or it was dropped and recreated
//! (a new slot starts at the current WAL position): events between the two positions may
//! never be streamed. Continuing would be a silent skip, so the relay stops and says how to
//! recover (re-snapshot: publish every outbox row without a receipt).
//!
//! The decision is a pure function, [`plan`], so every case is unit-tested.

use outbox_core::policy::{self, recovery, Channel};
use outbox_core::route::{RouteVersion, ROUTE_VERSION_COLUMNS};
use outbox_core::{Lsn, RouteVersions};
use tokio_postgres::Client;

use crate::transport::TransportError;

/// Everything that can stop the source. Definite errors (slot missing, recreated, invalidated,
/// wrong server) need an operator; transient ones (connection lost) are retried.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("wal_level is '{actual}', but logical replication needs 'logical': run `ALTER SYSTEM SET wal_level = logical` and restart PostgreSQL")]
    WalLevel { actual: String },
    #[error("replication slot \"{slot}\" is missing, but the ledger has a checkpoint for it at {checkpoint}: it was dropped behind outboxd's back, and events committed since may be in no slot. Recover with `outboxd run --resnapshot` (creates the slot again and publishes every outbox row without a receipt)")]
    SlotMissing { slot: String, checkpoint: Lsn },
    #[error("replication slot \"{slot}\" was dropped behind outboxd's back after the relay planned to stream from it at {start}: events committed since may be in no slot. Recover with `outboxd run --resnapshot` (creates the slot again and publishes every outbox row without a receipt)")]
    SlotDropped { slot: String, start: Lsn },
    #[error("replication slot \"{slot}\" is at {slot_lsn}, ahead of the ledger checkpoint {checkpoint}: the slot was recreated or advanced behind outboxd's back, and events between the two positions would be skipped. Recover with `outboxd run --resnapshot` (recreates the slot and publishes every outbox row without a receipt)")]
    SlotAhead {
        slot: String,
        slot_lsn: Lsn,
        checkpoint: Lsn,
    },
    #[error("replication slot \"{slot}\" has no confirmed position yet: another session is still creating it (a relay that lost this slot's lease while it created the slot, or a CREATE_REPLICATION_SLOT of your own). The relay that holds the slot's lease ends the creating session (pg_stat_activity.pid = the slot's active_pid) and creates the slot itself; if this persists, end that session and start the relay again")]
    SlotInCreation { slot: String },
    #[error("replication slot \"{slot}\" is invalidated (wal_status = {wal_status}): PostgreSQL removed WAL it still needed (see max_slot_wal_keep_size). Recover with `outboxd run --resnapshot`")]
    SlotInvalidated { slot: String, wal_status: String },
    #[error("replication slot \"{slot}\" uses output plugin '{plugin}' on database '{database}'; outboxd needs a pgoutput slot on '{expected_db}'. Choose another --slot name")]
    SlotForeign {
        slot: String,
        plugin: String,
        database: String,
        expected_db: String,
    },
    #[error("the ledger's checkpoint for slot \"{slot}\" was written on PostgreSQL system {ledger}, but this server is system {server}: the database was restored or replaced. Recover with `outboxd run --resnapshot`")]
    SystemChanged {
        slot: String,
        ledger: String,
        server: String,
    },
    #[error("role \"{user}\" may not start logical replication ({message}): grant it with `ALTER ROLE {user} REPLICATION` (or connect as a superuser)")]
    NoReplicationPrivilege { user: String, message: String },
    #[error("publication \"{publication}\": {problem}")]
    Publication {
        publication: String,
        problem: String,
    },
    #[error("replication connection: {0}")]
    Transport(#[from] TransportError),
    #[error("{context}: {message}")]
    Db {
        context: String,
        message: String,
        /// The server's SQLSTATE, when it named one (what [`outbox_core::policy`] decides on).
        code: Option<String>,
    },
    #[error("pgoutput stream: {0}")]
    Decode(#[from] outbox_pgoutput::DecodeError),
    #[error("replication protocol: {0}")]
    Protocol(String),
    /// An outbox row read again by id (a release, a reconciliation) that the relay cannot
    /// publish as it is: an operator quarantines or fixes it (docs/operations.md).
    #[error("event {event} of {table} cannot be read again: {problem}")]
    UnreadableRow {
        table: String,
        event: String,
        problem: outbox_core::RowError,
    },
}

impl SourceError {
    /// Errors that a reconnect can fix. Everything else needs an operator.
    pub fn is_transient(&self) -> bool {
        match self {
            SourceError::Transport(t) => {
                !matches!(t, TransportError::Auth(_))
                    && recovery(t.sqlstate(), Channel::Replication).is_retry()
            }
            SourceError::Db { code, .. } => recovery(code.as_deref(), Channel::Sql).is_retry(),
            SourceError::SlotInCreation { .. } => true,
            _ => false,
        }
    }
}

impl SourceError {
    /// What `START_REPLICATION` failing means. The start-up plan has just read the slot (or
    /// created it), so a slot the server no longer knows (SQLSTATE 42704) was dropped in
    /// between by somebody else: say so and how to recover, not only what the server said.
    pub fn at_start_replication(slot: &str, start: Lsn, e: TransportError) -> SourceError {
        if e.sqlstate() == Some("42704") {
            SourceError::SlotDropped {
                slot: slot.to_string(),
                start,
            }
        } else {
            SourceError::Transport(e)
        }
    }
}

pub(crate) fn db_err(context: impl Into<String>, e: tokio_postgres::Error) -> SourceError {
    let code = e.code().map(|c| c.code().to_string());
    let message = match e.as_db_error() {
        Some(d) => {
            let mut m = format!("{} (SQLSTATE {})", d.message(), d.code().code());
            if let Some(fix) = policy::fix(d.code().code(), Channel::Sql) {
                m.push_str("; ");
                m.push_str(fix);
            }
            m
        }
        None => e.to_string(),
    };
    SourceError::Db {
        context: context.into(),
        message,
        code,
    }
}

/// A slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    pub plugin: String,
    pub database: String,
    pub active_pid: Option<i32>,
    pub wal_status: Option<String>,
    pub confirmed_flush: Option<Lsn>,
}

/// What the ledger knows about the slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerView {
    pub checkpoint: Lsn,
    pub snapshot_done: bool,
    pub system_identifier: Option<String>,
}

/// How to start: the core's type ([`outbox_relay::lifecycle::StartPlan`]), which
/// [`plan`] decides and a run's start executes in the core's order.
pub use outbox_relay::lifecycle::StartPlan;

/// The start-up decision. Pure.
pub fn plan(
    slot_name: &str,
    database: &str,
    server_system_id: &str,
    slot: Option<&SlotInfo>,
    ledger: Option<&LedgerView>,
    resnapshot: bool,
) -> Result<StartPlan, SourceError> {
    if let Some(s) = slot {
        if s.plugin != "pgoutput" || s.database != database {
            return Err(SourceError::SlotForeign {
                slot: slot_name.into(),
                plugin: s.plugin.clone(),
                database: s.database.clone(),
                expected_db: database.into(),
            });
        }
    }
    if resnapshot {
        return Ok(StartPlan::Recreate {
            drop_existing: slot.is_some(),
        });
    }
    match (slot, ledger) {
        (None, None) => Ok(StartPlan::Create),
        (None, Some(l)) => Err(SourceError::SlotMissing {
            slot: slot_name.into(),
            checkpoint: l.checkpoint,
        }),
        (Some(s), ledger) => {
            if let Some(ws) = &s.wal_status {
                if ws == "lost" {
                    return Err(SourceError::SlotInvalidated {
                        slot: slot_name.into(),
                        wal_status: ws.clone(),
                    });
                }
            }
            // A logical slot has a confirmed position from the end of its creation on; without
            // one it is still being created by another session, and its position is not known:
            // adopting it at 0/0 recorded a checkpoint that its creator's end then orphaned (the
            // slot is dropped with the session that was creating it), and every later start
            // was refused as a slot dropped behind outboxd's back.
            let Some(slot_lsn) = s.confirmed_flush else {
                return Err(SourceError::SlotInCreation {
                    slot: slot_name.into(),
                });
            };
            match ledger {
                // A slot with no ledger row: we crashed between creating the slot and
                // recording it, or an operator pre-created it. Adopt it and publish a
                // snapshot first, which covers everything the slot will not stream.
                None => Ok(StartPlan::Resume {
                    start: slot_lsn,
                    backfill: true,
                    adopt: true,
                }),
                Some(l) => {
                    if let Some(sys) = &l.system_identifier {
                        if sys != server_system_id {
                            return Err(SourceError::SystemChanged {
                                slot: slot_name.into(),
                                ledger: sys.clone(),
                                server: server_system_id.into(),
                            });
                        }
                    }
                    if slot_lsn > l.checkpoint {
                        return Err(SourceError::SlotAhead {
                            slot: slot_name.into(),
                            slot_lsn,
                            checkpoint: l.checkpoint,
                        });
                    }
                    // Start from the ledger checkpoint: it is proven (every event before it
                    // is durably resolved), and PostgreSQL streams from the later of the
                    // requested position and the slot's own, so what the slot had not been
                    // told yet is not sent again. The slot catches up with the first status
                    // update.
                    Ok(StartPlan::Resume {
                        start: slot_lsn.max(l.checkpoint),
                        backfill: !l.snapshot_done,
                        adopt: false,
                    })
                }
            }
        }
    }
}

/// Reads the slot, if it exists.
pub async fn inspect(client: &Client, slot: &str) -> Result<Option<SlotInfo>, SourceError> {
    let row = client
        .query_opt(
            "SELECT coalesce(plugin, ''), coalesce(database, ''), active_pid, wal_status,
                    confirmed_flush_lsn::text
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| db_err(format!("reading replication slot {slot}"), e))?;
    row.map(|r| {
        let lsn: Option<String> = r.get(4);
        Ok(SlotInfo {
            plugin: r.get(0),
            database: r.get(1),
            active_pid: r.get(2),
            wal_status: r.get(3),
            confirmed_flush: lsn
                .map(|l| {
                    l.parse::<Lsn>()
                        .map_err(|e| SourceError::Protocol(e.to_string()))
                })
                .transpose()?,
        })
    })
    .transpose()
}

/// Fails unless `wal_level = logical`.
pub async fn check_wal_level(client: &Client) -> Result<(), SourceError> {
    let row = client
        .query_one("SHOW wal_level", &[])
        .await
        .map_err(|e| db_err("reading wal_level", e))?;
    let actual: String = row.get(0);
    if actual != "logical" {
        return Err(SourceError::WalLevel { actual });
    }
    Ok(())
}

/// Fails unless the connected role may start logical replication (REPLICATION or superuser).
pub async fn check_replication_privilege(client: &Client) -> Result<(), SourceError> {
    let row = client
        .query_one(
            "SELECT current_user::text, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
        .map_err(|e| db_err("reading the role's privileges", e))?;
    if !row.get::<_, bool>(1) {
        return Err(SourceError::NoReplicationPrivilege {
            user: row.get(0),
            message: "the role has neither REPLICATION nor SUPERUSER".into(),
        });
    }
    Ok(())
}

/// Creates the publication (inserts only) if it does not exist; otherwise verifies that it
/// includes `schema.table` and publishes inserts.
pub async fn ensure_publication(
    client: &Client,
    publication: &str,
    schema: &str,
    table: &str,
) -> Result<(), SourceError> {
    ensure_shard_publication(client, publication, schema, table, None).await
}

/// [`ensure_publication`] for one shard of a sharded outbox: the publication carries only the
/// shard's aggregates (a row filter, PostgreSQL 15+), and an existing one must have that filter.
/// The shard count of the layout `outboxd migrate --shards N` made, from the shards'
/// publications (`<publication>_shard<I>of<N>`): what a fleet member shares. None, or
/// publications of several layouts, is an error naming the fix.
pub async fn shard_layout(client: &Client, publication: &str) -> Result<u16, SourceError> {
    let rows = client
        .query(
            "SELECT pubname FROM pg_publication WHERE starts_with(pubname, $1)",
            &[&format!("{publication}_shard")],
        )
        .await
        .map_err(|e| db_err("reading the shards' publications", e))?;
    let mut counts: Vec<u16> = rows
        .iter()
        .filter_map(|r| Some(crate::shard::Shard::from_name(r.get(0), publication)?.count))
        .collect();
    counts.sort_unstable();
    counts.dedup();
    let problem = |problem: String| SourceError::Publication {
        publication: format!("{publication}_shard*"),
        problem,
    };
    match counts.as_slice() {
        [n] => Ok(*n),
        [] => Err(problem(
            "no shard publications: run `outboxd migrate --shards N` first (docs/scaling.md)".into(),
        )),
        many => Err(problem(format!(
            "publications of several shard layouts exist ({many:?} shards): run `outboxd migrate --shards N` for the one you want"
        ))),
    }
}

/// Emits the relay's heartbeat: a non-transactional logical message, so that an idle database
/// still moves WAL through the slot and the relay can confirm past it.
pub async fn emit_heartbeat(client: &Client) -> Result<(), SourceError> {
    client
        .execute(
            "SELECT pg_logical_emit_message(false, 'outboxd.heartbeat', '')",
            &[],
        )
        .await
        .map_err(|e| db_err("emitting the heartbeat message", e))?;
    Ok(())
}

pub async fn ensure_shard_publication(
    client: &Client,
    publication: &str,
    schema: &str,
    table: &str,
    shard: Option<crate::shard::Shard>,
) -> Result<(), SourceError> {
    let pub_err = |problem: String| SourceError::Publication {
        publication: publication.into(),
        problem,
    };
    let row = client
        .query_opt(
            "SELECT pubinsert, puballtables FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map_err(|e| db_err(format!("reading publication {publication}"), e))?;
    match row {
        None => {
            let filter = shard
                .map(|s| format!(" WHERE {}", s.filter_sql("aggregate_id")))
                .unwrap_or_default();
            let sql = format!(
                "CREATE PUBLICATION {} FOR TABLE {}.{}{filter} WITH (publish = 'insert')",
                quote_ident(publication),
                quote_ident(schema),
                quote_ident(table)
            );
            client.batch_execute(&sql).await.map_err(|e| {
                db_err(
                    format!("creating publication {publication} (needs ownership of {schema}.{table}, or create it as a superuser: {sql})"),
                    e,
                )
            })?;
            publish_route_versions(client, publication).await
        }
        Some(r) => {
            let inserts: bool = r.get(0);
            let all: bool = r.get(1);
            if !inserts {
                return Err(pub_err(
                    "does not publish inserts; recreate it WITH (publish = 'insert')".into(),
                ));
            }
            if !all {
                let has = client
                    .query_one(
                        "SELECT count(*) FROM pg_publication_tables
                         WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                        &[&publication, &schema, &table],
                    )
                    .await
                    .map_err(|e| db_err("reading publication tables", e))?;
                if has.get::<_, i64>(0) == 0 {
                    return Err(pub_err(format!(
                        "does not include {schema}.{table}; run ALTER PUBLICATION {publication} ADD TABLE {schema}.{table}"
                    )));
                }
            }
            if let Some(s) = shard {
                let filter: Option<String> = client
                    .query_opt(
                        "SELECT rowfilter FROM pg_publication_tables
                         WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                        &[&publication, &schema, &table],
                    )
                    .await
                    .map_err(|e| db_err("reading the publication's row filter", e))?
                    .and_then(|r| r.get(0));
                let want = format!("% {}) = {})", s.count, s.index);
                let ok = filter
                    .as_deref()
                    .is_some_and(|f| f.contains("md5(aggregate_id)") && f.ends_with(&want));
                if !ok {
                    return Err(pub_err(format!(
                        "is not the publication of shard {s}: its row filter is {filter:?}; run `outboxd migrate --shards {}`",
                        s.count
                    )));
                }
            }
            if all {
                return Ok(());
            }
            publish_route_versions(client, publication).await
        }
    }
}

/// Adds `outbox.route_versions` (migration 0031) and `outbox.policy_generations` (0038) to
/// the publication when they are missing: a narrow row names the route version its
/// destination is frozen to, a row written without a route is routed by the policy
/// generation in force at its commit, and the relay learns both from the stream after its
/// start. Nothing to do for a table the database predates.
async fn publish_route_versions(client: &Client, publication: &str) -> Result<(), SourceError> {
    for (table, why) in [
        (
            "route_versions",
            "the relay learns new route versions from it",
        ),
        (
            "policy_generations",
            "the relay routes rows written without a route by the policy in force at their commit",
        ),
    ] {
        let row = client
            .query_one(
                "SELECT to_regclass('outbox.' || $2) IS NOT NULL,
                        EXISTS (SELECT 1 FROM pg_publication_tables
                                WHERE pubname = $1 AND schemaname = 'outbox'
                                  AND tablename = $2)",
                &[&publication, &table],
            )
            .await
            .map_err(|e| {
                db_err(
                    format!("reading whether the publication carries outbox.{table}"),
                    e,
                )
            })?;
        let (exists, published): (bool, bool) = (row.get(0), row.get(1));
        if !exists || published {
            continue;
        }
        let sql = format!(
            "ALTER PUBLICATION {} ADD TABLE outbox.{table}",
            quote_ident(publication)
        );
        client.batch_execute(&sql).await.map_err(|e| {
            db_err(
                format!("adding outbox.{table} to publication {publication} ({why}; run as the publication's owner: {sql})"),
                e,
            )
        })?;
    }
    Ok(())
}

/// The route policy generation `id` (migration 0038), or the newest when `id` is `None`;
/// `None` on a database that predates the table.
pub async fn policy_generation(
    client: &impl tokio_postgres::GenericClient,
    id: Option<i64>,
) -> Result<Option<outbox_core::route::PolicyGeneration>, SourceError> {
    let row = client
        .query_opt(
            "SELECT generation_id, rules::text FROM outbox.policy_generations
             WHERE $1::int8 IS NULL OR generation_id = $1
             ORDER BY generation_id DESC LIMIT 1",
            &[&id],
        )
        .await;
    let row = match row {
        Ok(row) => row,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
            return Ok(None)
        }
        Err(e) => return Err(db_err("reading outbox.policy_generations", e)),
    };
    let Some(row) = row else {
        return match id {
            Some(id) => Err(SourceError::Protocol(format!(
                "policy generation {id}, kept with the checkpoint, is not in outbox.policy_generations (its rows are never deleted: was the table restored from elsewhere?)"
            ))),
            None => Ok(None),
        };
    };
    let id: i64 = row.get(0);
    let rules = outbox_core::route::policy_rules_from_json(row.get(1))
        .map_err(|e| SourceError::Protocol(format!("outbox.policy_generations row {id}: {e}")))?;
    Ok(Some(outbox_core::route::PolicyGeneration { id, rules }))
}

/// Every route version (`outbox.route_versions`, migration 0031), read once at start; the
/// stream brings the ones made later. Empty on a database that predates the table.
pub async fn route_versions(
    client: &impl tokio_postgres::GenericClient,
) -> Result<RouteVersions, SourceError> {
    // Read by position below, in the order of ROUTE_VERSION_COLUMNS.
    let sql = format!(
        "SELECT {} FROM outbox.route_versions",
        ROUTE_VERSION_COLUMNS.join(", ")
    );
    let rows = client.query(&sql, &[]).await;
    let rows = match rows {
        Ok(rows) => rows,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
            return Ok(RouteVersions::new())
        }
        Err(e) => return Err(db_err("reading outbox.route_versions", e)),
    };
    Ok(rows
        .iter()
        .map(|r| {
            (
                r.get(0),
                RouteVersion {
                    kind: r.get(1),
                    cluster: r.get(2),
                    topic_template: r.get(3),
                    partitioner: r.get(4),
                    route_generation: r.get(5),
                    serializer: r.get(6),
                    acks: r.get(7),
                },
            )
        })
        .collect())
}

/// Drops the slot (terminating its walsender if one holds it). Only for `--resnapshot`.
pub async fn drop_slot(client: &Client, slot: &str) -> Result<(), SourceError> {
    client
        .execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
             WHERE slot_name = $1 AND active_pid IS NOT NULL",
            &[&slot],
        )
        .await
        .map_err(|e| db_err("terminating the slot's walsender", e))?;
    for _ in 0..100 {
        let r = client
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                 WHERE slot_name = $1",
                &[&slot],
            )
            .await;
        match r {
            Ok(_) => return Ok(()),
            Err(e) if e.code().map(|c| c.code()) == Some("55006") => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => return Err(db_err(format!("dropping slot {slot}"), e)),
        }
    }
    Err(SourceError::Db {
        context: format!("dropping slot {slot}"),
        message: "the slot stayed active for 5 s; is another outboxd running on it?".into(),
        code: None,
    })
}

/// Quotes an SQL identifier.
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server_err(code: &str) -> TransportError {
        TransportError::Server {
            code: code.into(),
            message: "m".into(),
            detail: None,
            hint: None,
        }
    }

    fn server(code: &str) -> SourceError {
        SourceError::Transport(server_err(code))
    }

    fn sql(code: Option<&str>) -> SourceError {
        SourceError::Db {
            context: "c".into(),
            message: "m".into(),
            code: code.map(str::to_string),
        }
    }

    #[test]
    fn errors_are_classified_by_sqlstate_and_connection() {
        // The walsender going away is retried; an unknown walsender error, a missing slot, or
        // a missing privilege is not.
        assert!(server("57P01").is_transient());
        assert!(server("55006").is_transient());
        assert!(!server("42704").is_transient());
        assert!(!server("42501").is_transient());
        // A slot gone between the plan and START_REPLICATION is named as dropped, with the fix.
        let gone = SourceError::at_start_replication("s", Lsn(7), server_err("42704"));
        assert!(matches!(gone, SourceError::SlotDropped { .. }), "{gone}");
        assert!(!gone.is_transient());
        let msg = gone.to_string();
        assert!(
            msg.contains("behind outboxd's back") && msg.contains("--resnapshot"),
            "{msg}"
        );
        assert!(matches!(
            SourceError::at_start_replication("s", Lsn(7), server_err("57P01")),
            SourceError::Transport(_)
        ));
        // On the SQL connection a broken connection and an unknown code are retried, a
        // missing privilege or table is not.
        assert!(sql(None).is_transient());
        assert!(sql(Some("40001")).is_transient());
        assert!(!sql(Some("42501")).is_transient());
        assert!(!sql(Some("42P01")).is_transient());
    }

    fn slot(lsn: u64) -> SlotInfo {
        SlotInfo {
            plugin: "pgoutput".into(),
            database: "app".into(),
            active_pid: None,
            wal_status: Some("reserved".into()),
            confirmed_flush: Some(Lsn(lsn)),
        }
    }

    fn ledger(lsn: u64, done: bool) -> LedgerView {
        LedgerView {
            checkpoint: Lsn(lsn),
            snapshot_done: done,
            system_identifier: Some("42".into()),
        }
    }

    #[test]
    fn fresh_database_creates() {
        assert_eq!(
            plan("s", "app", "42", None, None, false).unwrap(),
            StartPlan::Create
        );
    }

    #[test]
    fn healthy_slot_resumes_from_the_proven_checkpoint() {
        let p = plan(
            "s",
            "app",
            "42",
            Some(&slot(100)),
            Some(&ledger(150, true)),
            false,
        );
        assert_eq!(
            p.unwrap(),
            StartPlan::Resume {
                start: Lsn(150),
                backfill: false,
                adopt: false
            }
        );
    }

    #[test]
    fn unfinished_snapshot_is_redone() {
        let p = plan(
            "s",
            "app",
            "42",
            Some(&slot(100)),
            Some(&ledger(100, false)),
            false,
        );
        assert_eq!(
            p.unwrap(),
            StartPlan::Resume {
                start: Lsn(100),
                backfill: true,
                adopt: false
            }
        );
    }

    #[test]
    fn slot_ahead_of_ledger_is_refused() {
        let e = plan(
            "s",
            "app",
            "42",
            Some(&slot(200)),
            Some(&ledger(150, true)),
            false,
        )
        .unwrap_err();
        assert!(matches!(e, SourceError::SlotAhead { .. }));
        assert!(e.to_string().contains("recreated"), "{e}");
        assert!(e.to_string().contains("--resnapshot"), "{e}");
    }

    #[test]
    fn missing_slot_with_history_is_refused() {
        let e = plan("s", "app", "42", None, Some(&ledger(150, true)), false).unwrap_err();
        assert!(matches!(e, SourceError::SlotMissing { .. }), "{e}");
    }

    #[test]
    fn invalidated_slot_is_refused() {
        let mut s = slot(100);
        s.wal_status = Some("lost".into());
        let e = plan("s", "app", "42", Some(&s), Some(&ledger(150, true)), false).unwrap_err();
        assert!(matches!(e, SourceError::SlotInvalidated { .. }), "{e}");
    }

    #[test]
    fn other_server_is_refused_and_foreign_slot_is_refused() {
        let e = plan(
            "s",
            "app",
            "7",
            Some(&slot(100)),
            Some(&ledger(150, true)),
            false,
        )
        .unwrap_err();
        assert!(matches!(e, SourceError::SystemChanged { .. }), "{e}");
        let mut s = slot(100);
        s.plugin = "test_decoding".into();
        let e = plan("s", "app", "42", Some(&s), None, true).unwrap_err();
        assert!(matches!(e, SourceError::SlotForeign { .. }), "{e}");
    }

    #[test]
    fn slot_without_ledger_row_is_adopted_with_backfill() {
        assert_eq!(
            plan("s", "app", "42", Some(&slot(100)), None, false).unwrap(),
            StartPlan::Resume {
                start: Lsn(100),
                backfill: true,
                adopt: true
            }
        );
        assert_eq!(
            plan(
                "s",
                "app",
                "42",
                Some(&slot(300)),
                Some(&ledger(150, true)),
                true
            )
            .unwrap(),
            StartPlan::Recreate {
                drop_existing: true
            }
        );
        assert_eq!(
            plan("s", "app", "42", None, Some(&ledger(150, true)), true).unwrap(),
            StartPlan::Recreate {
                drop_existing: false
            }
        );
    }

    /// A slot another session is still creating has no confirmed position: it is neither
    /// adopted at 0/0 nor streamed from, and the error is retried (seen in the fleet e2e
    /// tests: a member handed a shard over while its relay was creating the slot).
    #[test]
    fn a_slot_still_being_created_is_not_adopted_and_the_start_is_retried() {
        let creating = SlotInfo {
            active_pid: Some(7),
            confirmed_flush: None,
            ..slot(0)
        };
        for ledger in [None, Some(ledger(150, true))] {
            let e = plan("s", "app", "42", Some(&creating), ledger.as_ref(), false).unwrap_err();
            assert!(matches!(e, SourceError::SlotInCreation { .. }), "{e}");
            assert!(e.is_transient(), "{e}");
        }
        // --resnapshot drops whatever is there.
        assert_eq!(
            plan("s", "app", "42", Some(&creating), None, true).unwrap(),
            StartPlan::Recreate {
                drop_existing: true
            }
        );
    }
}
