//! Held aggregates (invariant 7: a gap or a poisoned event blocks its own aggregate, never
//! the others, and nothing of it is skipped).
//!
//! The relay records holds and held events through [`crate::accept`]; this module is the
//! rest of their life: loading them at start, the operator's `release` / `skip`, and the
//! relay's republish of a released aggregate in version order.

use outbox_core::Lsn;
use serde::Serialize;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::{Context, LedgerError};

/// `(aggregate_type, aggregate_id)`.
pub type AggKey = (String, String);

/// Every held aggregate (HELD or RELEASING).
pub async fn load_held(client: &Client) -> Result<Vec<AggKey>, LedgerError> {
    let rows = client
        .query("SELECT aggregate_type, aggregate_id FROM outbox.holds", &[])
        .await
        .ctx("loading held aggregates")?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// The events operators skipped (`outboxd quarantine skip`: their quarantine closed as
/// skipped), never to be published: a run that meets one in the stream again drops it
/// (`outbox_relay::PipelineCore::skipped_by_operator`).
pub async fn skipped_events(client: &Client) -> Result<Vec<uuid::Uuid>, LedgerError> {
    let rows = client
        .query(
            "SELECT event_id FROM outbox.quarantine WHERE resolution = 'skipped' AND event_id IS NOT NULL",
            &[],
        )
        .await
        .ctx("loading skipped events")?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Whether aggregate `key` is held in the ledger now (a hold row, released or not).
pub async fn is_held(client: &Client, key: &AggKey) -> Result<bool, LedgerError> {
    Ok(client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM outbox.holds WHERE aggregate_type = $1 AND aggregate_id = $2)",
            &[&key.0, &key.1],
        )
        .await
        .ctx("reading an aggregate's hold")?
        .get(0))
}

/// Folds what is left of the head journal (rows a relay before migration 0026 wrote; this
/// version's acceptances write none) into `outbox.aggregate_heads`: every row committed when
/// it starts, in transactions of at most about [`FOLD_CHUNK_PAIRS`] pairs. Returns how many
/// journal rows it folded. Deletes exactly the rows it folds, so it may run beside another
/// fold. A relay folds once when it starts, before it reads any head.
///
/// `paced`: after each chunk, pause as long as it took, so the fold uses at most about half of
/// one PostgreSQL backend and never takes the CPU the stream needs in a burst.
pub async fn fold_heads(client: &Client, paced: bool) -> Result<u64, LedgerError> {
    let Some(up_to) = journal_end(client).await? else {
        return Ok(0);
    };
    let mut folded = 0;
    loop {
        let began = std::time::Instant::now();
        match fold_chunk(client, up_to).await? {
            0 => return Ok(folded),
            n => folded += n,
        }
        if paced {
            tokio::time::sleep(began.elapsed()).await;
        }
    }
}

/// The newest journal row's id (`None`: the journal is empty): what a fold started now covers.
async fn journal_end(client: &Client) -> Result<Option<i64>, LedgerError> {
    Ok(client
        .query_one("SELECT max(id) FROM outbox.head_journal", &[])
        .await
        .ctx("reading the head journal")?
        .get(0))
}

/// One fold transaction: the oldest journal rows with id <= `up_to`, about
/// [`FOLD_CHUNK_PAIRS`] pairs. Returns how many rows it folded (0: none left up to `up_to`).
async fn fold_chunk(client: &Client, up_to: i64) -> Result<u64, LedgerError> {
    let n: i64 = client
        .query_one(
            "SELECT outbox.fold_heads($1, $2)",
            &[&FOLD_CHUNK_PAIRS, &up_to],
        )
        .await
        .ctx("folding the head journal into outbox.aggregate_heads")?
        .get(0);
    Ok(n as u64)
}

/// Pairs per fold transaction: small enough that the relay's walsender decodes one fold's WAL
/// in milliseconds between outbox commits (one fold of a 500,000-event drain's journal in one
/// transaction stalled the steady phase's commits for ~0.9 s).
pub const FOLD_CHUNK_PAIRS: i64 = 5_000;

/// The last accepted version of each aggregate of `keys` (0 for one without any): the highest
/// version with a primary receipt, purged or not, or higher where an operator skipped one
/// (`outbox.aggregate_heads_of`, migration 0026). The relay asks once per aggregate and run,
/// when it first meets the aggregate, for many at once. With `below` (one per key: the version
/// met first in the stream, which every later version follows), it is the highest version
/// below it that exists, purged or not (migration 0028): every such version is resolved by
/// then (the checkpoint passes only resolved events, and an aggregate's versions commit in
/// order), so no receipt is read, and the look-up does not walk down past the stream's
/// unpublished versions. Without `below` (a snapshot, a release), unpublished rows exist and
/// the receipts decide.
pub async fn heads_of(
    client: &Client,
    keys: &[AggKey],
    below: Option<&[i64]>,
) -> Result<Vec<(AggKey, i64)>, LedgerError> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let (types, ids): (Vec<&str>, Vec<&str>) =
        keys.iter().map(|(t, i)| (t.as_str(), i.as_str())).unzip();
    let rows = client
        .query(
            "SELECT aggregate_type, aggregate_id, last_version
             FROM outbox.aggregate_heads_of($1::text[], $2::text[], $3::int8[])",
            &[&types, &ids, &below],
        )
        .await
        .ctx(format!("reading the heads of {} aggregates", keys.len()))?;
    Ok(rows
        .iter()
        .map(|r| ((r.get(0), r.get(1)), r.get(2)))
        .collect())
}

/// The last version of `key` with an accepted primary receipt (0 if none; see [`heads_of`]).
pub async fn head(client: &Client, key: &AggKey) -> Result<i64, LedgerError> {
    Ok(heads_of(client, std::slice::from_ref(key), None)
        .await?
        .first()
        .map_or(0, |(_, v)| *v))
}

/// A hold an operator released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub key: AggKey,
    pub blocking_event_id: Option<Uuid>,
    pub blocking_version: Option<i64>,
    pub publish_blocking: bool,
    /// For a blocking row written without a version: the route version the relay routed it
    /// by (migration 0042), which publishing it needs.
    pub blocking_route_version: Option<i64>,
}

/// Holds an operator has released and the relay has not finished republishing.
///
/// `of_shard`: a condition on `aggregate_id` (`outbox_source::shard::Shard::filter_sql`) that
/// keeps only the aggregates of one shard: the relay of a shard releases only its own.
pub async fn releasing(
    client: &Client,
    of_shard: Option<&str>,
) -> Result<Vec<Release>, LedgerError> {
    let of_shard = of_shard.map(|f| format!("AND {f}")).unwrap_or_default();
    let rows = client
        .query(
            &format!(
                "SELECT aggregate_type, aggregate_id, blocking_event_id, blocking_version, publish_blocking,
                        blocking_route_version
                 FROM outbox.holds WHERE state = 'RELEASING' {of_shard} ORDER BY release_requested_at"
            ),
            &[],
        )
        .await
        .ctx("reading released holds")?;
    Ok(rows
        .iter()
        .map(|r| Release {
            key: (r.get(0), r.get(1)),
            blocking_event_id: r.get(2),
            blocking_version: r.get(3),
            publish_blocking: r.get(4),
            blocking_route_version: r.get(5),
        })
        .collect())
}

/// One event a release publishes ([`republish_set`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Republish {
    pub event_id: Uuid,
    pub version: i64,
    pub commit_lsn: Option<Lsn>,
    /// For a row written without a version (docs/versions_by_relay.md): `version` is the
    /// relay's numbering, and this is the route version the relay routed it by when the row
    /// names none and stores no destination, as its held record kept them. `None`: the row
    /// has its own version.
    pub by_relay: Option<Option<i64>>,
}

/// What a release publishes, in version order: the blocking event (unless skipped) and every
/// held event without a receipt, an open quarantine or a skip (an event held behind another
/// one, later refused itself and skipped, keeps its held record: found by outbox-sim, it was
/// sent again at every release).
pub async fn republish_set(client: &Client, r: &Release) -> Result<Vec<Republish>, LedgerError> {
    let rows = client
        .query(
            // A row written without a version (docs/versions_by_relay.md) has the one the
            // relay gave it, and its route, in its held record (migration 0042); the
            // blocking event, which has none, the hold's blocking version.
            "SELECT e.event_id,
                    coalesce(e.aggregate_version, he.aggregate_version,
                             CASE WHEN e.event_id = $3 THEN $5::int8 END, 0),
                    he.commit_lsn::text, e.aggregate_version IS NULL,
                    CASE WHEN e.event_id = $3 THEN $6::int8 ELSE he.relay_route_version END
             FROM outbox.events e
             LEFT JOIN outbox.held_events he ON he.event_id = e.event_id
             WHERE e.aggregate_type = $1 AND e.aggregate_id = $2
               AND NOT EXISTS (SELECT 1 FROM outbox.receipt_of(e.event_id))
               AND NOT EXISTS (SELECT 1 FROM outbox.quarantine q
                               WHERE q.event_id = e.event_id
                                 AND (q.released_at IS NULL OR q.resolution = 'skipped'))
               AND ((he.event_id IS NOT NULL AND he.released_at IS NULL)
                    OR ($4 AND e.event_id = $3))
             ORDER BY 2",
            &[
                &r.key.0,
                &r.key.1,
                &r.blocking_event_id,
                &r.publish_blocking,
                &r.blocking_version,
                &r.blocking_route_version,
            ],
        )
        .await
        .ctx(format!(
            "listing the held events of {}/{}",
            r.key.0, r.key.1
        ))?;
    rows.iter()
        .map(|row| {
            let lsn: Option<String> = row.get(2);
            let commit_lsn = lsn
                .map(|l| l.parse::<Lsn>())
                .transpose()
                .map_err(|e| LedgerError::Invalid(e.to_string()))?;
            let plain: bool = row.get(3);
            Ok(Republish {
                event_id: row.get(0),
                version: row.get(1),
                commit_lsn,
                by_relay: plain.then(|| row.get(4)),
            })
        })
        .collect()
}

/// Ends the hold of `key` if nothing of it is still held, and moves the aggregate's head to
/// `last` (a skipped event's version counts as passed). Returns whether it ended.
pub async fn close(client: &Client, key: &AggKey, last: Option<i64>) -> Result<bool, LedgerError> {
    if let Some(v) = last {
        client
            .execute(
                "INSERT INTO outbox.aggregate_heads AS h (aggregate_type, aggregate_id, last_version)
                 VALUES ($1, $2, $3)
                 ON CONFLICT (aggregate_type, aggregate_id)
                 DO UPDATE SET last_version = GREATEST(h.last_version, EXCLUDED.last_version)",
                &[&key.0, &key.1, &v],
            )
            .await
            .ctx(format!("moving the head of {}/{}", key.0, key.1))?;
    }
    // Held rows of events that are published anyway (a replay recorded them), or that an
    // operator skipped, are done.
    client
        .execute(
            "UPDATE outbox.held_events he SET released_at = clock_timestamp()
             WHERE he.aggregate_type = $1 AND he.aggregate_id = $2 AND he.released_at IS NULL
               AND (EXISTS (SELECT 1 FROM outbox.receipt_of(he.event_id))
                    OR EXISTS (SELECT 1 FROM outbox.quarantine q
                               WHERE q.event_id = he.event_id AND q.resolution = 'skipped'))",
            &[&key.0, &key.1],
        )
        .await
        .ctx(format!("settling the held events of {}/{}", key.0, key.1))?;
    let n = client
        .execute(
            "DELETE FROM outbox.holds h
             WHERE h.aggregate_type = $1 AND h.aggregate_id = $2 AND h.state = 'RELEASING'
               AND NOT EXISTS (SELECT 1 FROM outbox.held_events he
                               WHERE he.aggregate_type = h.aggregate_type
                                 AND he.aggregate_id = h.aggregate_id
                                 AND he.released_at IS NULL)",
            &[&key.0, &key.1],
        )
        .await
        .ctx(format!("closing the hold of {}/{}", key.0, key.1))?;
    Ok(n == 1)
}

/// One line of `outboxd quarantine list`.
#[derive(Debug, Clone, Serialize)]
pub struct HoldEntry {
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub state: String,
    pub reason_code: String,
    pub reason: String,
    pub blocking_event_id: Option<Uuid>,
    pub blocking_version: Option<i64>,
    pub held_events: i64,
    pub held_at: String,
}

/// One open quarantine record.
#[derive(Debug, Clone, Serialize)]
pub struct QuarantineEntry {
    pub event_id: Option<Uuid>,
    pub quarantine_key: String,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub aggregate_version: Option<i64>,
    pub reason_code: String,
    pub reason: String,
    pub quarantined_at: String,
}

/// Open quarantine records and holds.
pub async fn list(client: &Client) -> Result<(Vec<QuarantineEntry>, Vec<HoldEntry>), LedgerError> {
    let q = client
        .query(
            "SELECT event_id, quarantine_key, aggregate_type, aggregate_id, aggregate_version,
                    reason_code, reason, quarantined_at::text
             FROM outbox.quarantine WHERE released_at IS NULL ORDER BY id",
            &[],
        )
        .await
        .ctx("listing quarantine (is the database migrated? run `outboxd migrate`)")?;
    let h = client
        .query(
            "SELECT h.aggregate_type, h.aggregate_id, h.state, h.reason_code, h.reason,
                    h.blocking_event_id, h.blocking_version,
                    (SELECT count(*) FROM outbox.held_events he
                     WHERE he.aggregate_type = h.aggregate_type AND he.aggregate_id = h.aggregate_id
                       AND he.released_at IS NULL),
                    h.held_at::text
             FROM outbox.holds h ORDER BY h.held_at",
            &[],
        )
        .await
        .ctx("listing holds")?;
    Ok((
        q.iter()
            .map(|r| QuarantineEntry {
                event_id: r.get(0),
                quarantine_key: r.get(1),
                aggregate_type: r.get(2),
                aggregate_id: r.get(3),
                aggregate_version: r.get(4),
                reason_code: r.get(5),
                reason: r.get(6),
                quarantined_at: r.get(7),
            })
            .collect(),
        h.iter()
            .map(|r| HoldEntry {
                aggregate_type: r.get(0),
                aggregate_id: r.get(1),
                state: r.get(2),
                reason_code: r.get(3),
                reason: r.get(4),
                blocking_event_id: r.get(5),
                blocking_version: r.get(6),
                held_events: r.get(7),
                held_at: r.get(8),
            })
            .collect(),
    ))
}

/// How an operator resolves a quarantined / blocking event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// Publish it (after the cause was fixed), then the held events, in version order.
    Release,
    /// Never publish it; publish the held events behind it. Needs a reason.
    Skip,
}

impl Resolution {
    /// The quarantine record's `resolution`, and whether the running relay publishes the
    /// blocking event before the held ones.
    fn recorded(self) -> (&'static str, bool) {
        match self {
            Resolution::Release => ("released", true),
            Resolution::Skip => ("skipped", false),
        }
    }
}

/// Open quarantine records by reason code, most first: what [`resolve_by_reason`] could
/// release or skip, and what an operator asks for after fixing one cause.
pub async fn open_reasons(client: &Client) -> Result<Vec<(String, i64)>, LedgerError> {
    let rows = client
        .query(
            "SELECT reason_code, count(*) FROM outbox.quarantine WHERE released_at IS NULL
             GROUP BY reason_code ORDER BY count(*) DESC, reason_code",
            &[],
        )
        .await
        .ctx("counting open quarantine records by reason (is the database migrated? run `outboxd migrate`)")?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Releases or skips every open quarantine record with reason code `code`, as [`resolve`]
/// does one (its record closed, the hold it blocks RELEASING, the running relay publishes
/// what it must), in one transaction: for one cause fixed that refused many events (a broker
/// limit raised, a topic's ACL granted, the relay for a destination started), or one kind of
/// event an operator decided to drop (a skip records `note`, its reason). Returns the event
/// ids (records without an event id, such as unreadable rows, are not resolvable this way and
/// stay open) and how many holds were marked. With `dry_run`, changes nothing and returns
/// what it would do.
pub async fn resolve_by_reason(
    client: &mut Client,
    code: &str,
    resolution: Resolution,
    by: &str,
    note: Option<&str>,
    dry_run: bool,
) -> Result<(Vec<Uuid>, u64), LedgerError> {
    let (word, publish) = resolution.recorded();
    let tx = client.transaction().await.ctx("beginning the release")?;
    let ids: Vec<Uuid> = tx
        .query(
            "UPDATE outbox.quarantine SET released_at = clock_timestamp(), released_by = $2,
                    release_note = $3, resolution = $4
             WHERE reason_code = $1 AND released_at IS NULL AND event_id IS NOT NULL
             RETURNING event_id",
            &[&code, &by, &note, &word],
        )
        .await
        .ctx(format!(
            "closing the quarantine records of reason {code} ({word})"
        ))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let holds = mark_releasing(&tx, &ids, by, publish).await.ctx(format!(
        "releasing the holds blocked by events of reason {code}"
    ))?;
    if dry_run {
        tx.rollback().await.ctx("rolling back the dry run")?;
    } else {
        tx.commit().await.ctx("committing the release")?;
    }
    Ok((ids, holds))
}

/// Marks the holds that `events` block RELEASING for the running relay (`publish`: it sends the
/// blocking event first; a skip does not), by `by`: one release or skip, or a release by
/// reason. Returns how many it marked.
async fn mark_releasing(
    tx: &tokio_postgres::Transaction<'_>,
    events: &[Uuid],
    by: &str,
    publish: bool,
) -> Result<u64, tokio_postgres::Error> {
    tx.execute(
        "UPDATE outbox.holds SET state = 'RELEASING', release_requested_at = clock_timestamp(),
                released_by = $2, publish_blocking = $3
         WHERE blocking_event_id = ANY($1)",
        &[&events, &by, &publish],
    )
    .await
}

/// Releases or skips `event_id`: closes its open quarantine record and marks the hold it
/// blocks as RELEASING (the running relay republishes). Errors if the event neither is
/// quarantined nor blocks a hold.
pub async fn resolve(
    client: &mut Client,
    event_id: Uuid,
    resolution: Resolution,
    by: &str,
    note: Option<&str>,
) -> Result<(u64, u64), LedgerError> {
    let (word, publish) = resolution.recorded();
    let tx = client.transaction().await.ctx("beginning the release")?;
    let q = tx
        .execute(
            "UPDATE outbox.quarantine SET released_at = clock_timestamp(), released_by = $2,
                    release_note = $3, resolution = $4
             WHERE event_id = $1 AND released_at IS NULL",
            &[&event_id, &by, &note, &word],
        )
        .await
        .ctx(format!("releasing quarantine of event {event_id}"))?;
    let h = mark_releasing(&tx, &[event_id], by, publish)
        .await
        .ctx(format!("releasing the hold blocked by event {event_id}"))?;
    if q == 0 && h == 0 {
        return Err(LedgerError::Invalid(format!(
            "event {event_id} is neither quarantined nor blocking an aggregate; see `outboxd quarantine list`"
        )));
    }
    tx.commit().await.ctx("committing the release")?;
    Ok((q, h))
}
