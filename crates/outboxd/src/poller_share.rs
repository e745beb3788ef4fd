//! `outboxd share`: who dispatches each aggregate type of an attached poller table, and the
//! two switches between the team's poller and outboxd (migration 0014, docs/migrating.md). A
//! share is a whole type, or some of its 16 hash buckets of aggregates (migration 0017).
//!
//! A switch is never a flag day and never leaves an event with two owners or none:
//! * **take** (poller -> outboxd): the type goes to `handover` (new rows are parked: nobody
//!   publishes them yet); once every producer transaction that could still capture a row for
//!   the poller has ended and the poller has published every row it owns of the type, the type
//!   goes to `outboxd` and the parked rows are enqueued in insertion order. The aggregate's
//!   order holds: the poller's rows reach the broker before outboxd's.
//! * **give-back** (outboxd -> poller): the type goes to `handback` (new rows are the poller's
//!   but not claimable yet); once every producer transaction that could still enqueue for
//!   outboxd has ended, it goes to `poller`. Events outboxd captured stay outboxd's and are
//!   published by the relay; `outbox.poller_may_claim` holds an aggregate back from the poller
//!   until its newest outboxd event has a receipt.
//!
//! Before either switch changes an owner, a canary row proves that the poller's claim goes
//! through `outbox.poller_may_claim` (migration 0025): a poller that claims it would publish
//! outboxd's rows too, and the switch is refused with the fix.
//!
//! A switch waits for in-flight producer transactions by their xids, never by locking
//! producers out, so producers never stall. Interrupted at any point, a switch loses nothing:
//! the state it left is one of the four, each with a defined owner; run it again.

use std::time::{Duration, Instant};

use anyhow::Context;
use tokio_postgres::Client;

use crate::connect;

/// What a share command applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One aggregate type: the whole type and every bucket of it with a share of its own.
    Type(String),
    /// Some hash buckets (0..15) of one aggregate type's aggregates.
    Buckets(String, Vec<i32>),
    /// Every aggregate type: the `*` share and every type with a share of its own.
    All,
}

/// How a switch waits, and whether it first proves the poller respects ownership.
#[derive(Debug, Clone)]
pub struct SwitchOptions {
    /// For the poller to publish the rows it owns, and for open producer transactions.
    pub wait: Duration,
    /// For the poller's claim to ask `outbox.poller_may_claim` about the canary.
    pub canary_wait: Duration,
    /// No canary: the poller is stopped (and starts again only with the predicate).
    pub poller_stopped: bool,
}

/// The `outboxd share list` lines.
pub async fn list(url: &str, json: bool) -> anyhow::Result<()> {
    let client = connect(url).await?;
    let rows = client
        .query(
            // The parked rows each share decides: the most specific share that exists.
            "SELECT s.aggregate_type, s.owner, s.changed_at::text,
                    (SELECT count(*) FROM outbox.parked_events p
                     WHERE CASE
                       WHEN EXISTS (SELECT 1 FROM outbox.dispatch_shares d
                                    WHERE d.aggregate_type = p.aggregate_type
                                      AND d.bucket = outbox.share_bucket(p.aggregate_id))
                         THEN s.aggregate_type = p.aggregate_type
                              AND s.bucket = outbox.share_bucket(p.aggregate_id)
                       WHEN EXISTS (SELECT 1 FROM outbox.dispatch_shares d
                                    WHERE d.aggregate_type = p.aggregate_type AND d.bucket = -1)
                         THEN s.aggregate_type = p.aggregate_type AND s.bucket = -1
                       ELSE s.aggregate_type = '*' END),
                    s.bucket
             FROM outbox.dispatch_shares s
             ORDER BY s.aggregate_type = '*' DESC, s.aggregate_type, s.bucket",
            &[],
        )
        .await
        .map_err(db("reading outbox.dispatch_shares"))?;
    let tables = client
        .query(
            "SELECT source_table::text, unpublished_when, mark_published FROM outbox.poller_tables ORDER BY 1",
            &[],
        )
        .await
        .map_err(db("reading outbox.poller_tables"))?;
    if json {
        let shares: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "aggregate_type": r.get::<_, String>(0),
                    "bucket": bucket_text(r.get(4)),
                    "owner": r.get::<_, String>(1),
                    "changed_at": r.get::<_, String>(2),
                    "parked": r.get::<_, i64>(3),
                })
            })
            .collect();
        let tables: Vec<_> = tables
            .iter()
            .map(|r| {
                serde_json::json!({
                    "table": r.get::<_, String>(0),
                    "unpublished_when": r.get::<_, String>(1),
                    "mark_published": r.get::<_, Option<String>>(2),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"shares": shares, "poller_tables": tables})
            )?
        );
        return Ok(());
    }
    if tables.is_empty() {
        println!("no poller table attached (outboxd migrate --poller-table SCHEMA.TABLE --published-column COLUMN)");
    }
    for t in &tables {
        println!(
            "poller table {} (unpublished when {}; rows outboxd takes {})",
            t.get::<_, String>(0),
            t.get::<_, String>(1),
            match t.get::<_, Option<String>>(2) {
                Some(m) => format!("marked with SET {m}"),
                None => "left unpublished: the poller's claim checks each of them".into(),
            }
        );
    }
    println!(
        "{:<32} {:<7} {:<10} {:>8}  CHANGED",
        "AGGREGATE TYPE", "BUCKET", "OWNER", "PARKED"
    );
    for r in &rows {
        println!(
            "{:<32} {:<7} {:<10} {:>8}  {}",
            r.get::<_, String>(0),
            bucket_text(r.get(4)),
            r.get::<_, String>(1),
            r.get::<_, i64>(3),
            r.get::<_, String>(2)
        );
    }
    Ok(())
}

/// Hands `target` from the poller to outboxd. Waits up to `wait` for the poller to publish
/// the rows it owns; on time-out the share stays in `handover` (nothing lost: new rows are
/// parked) and the error says how to go on or back.
pub async fn take(url: &str, target: &Target, opts: &SwitchOptions) -> anyhow::Result<()> {
    let client = connect(url).await?;
    let shares = shares_of(&client, target).await?;
    if !opts.poller_stopped {
        canary(&client, target, opts.canary_wait, "take").await?;
    }
    let wait = opts.wait;
    let deadline = Instant::now() + wait;
    let snap = switch(&client, &shares, "handover", &["outboxd"]).await?;
    settle(&client, &snap, deadline, "take").await?;
    let mut last_print = Instant::now();
    loop {
        let n: i64 = client
            .query_one("SELECT outbox.legacy_unpublished('handover')", &[])
            .await
            .map_err(db("counting the poller's unpublished rows"))?
            .get(0);
        if n == 0 {
            break;
        }
        if Instant::now() >= deadline {
            anyhow::bail!(
                "the poller has not published {n} row(s) it owns of {} within {}s; the share stays in handover (new rows are parked for outboxd, nothing is lost). Check that the poller runs and that its claim query has `AND outbox.poller_may_claim(id)`; then run `outboxd share take` again to go on waiting, or `outboxd share give-back` to cancel",
                describe(target),
                wait.as_secs()
            );
        }
        if last_print.elapsed() >= Duration::from_secs(5) {
            println!("waiting for the poller to publish {n} row(s) it owns");
            last_print = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let snap = switch(&client, &shares, "outboxd", &[]).await?;
    settle(&client, &snap, deadline + wait, "take").await?;
    let moved: i64 = client
        .query_one("SELECT outbox.enqueue_all_parked()", &[])
        .await
        .map_err(db("enqueueing the parked rows"))?
        .get(0);
    println!(
        "outboxd owns {}: {moved} parked row(s) enqueued; new rows are enqueued in the producer's transaction",
        describe(target)
    );
    Ok(())
}

/// Hands `target` from outboxd back to the poller.
pub async fn give_back(url: &str, target: &Target, opts: &SwitchOptions) -> anyhow::Result<()> {
    let client = connect(url).await?;
    let shares = shares_of(&client, target).await?;
    if !opts.poller_stopped {
        canary(&client, target, opts.canary_wait, "give-back").await?;
    }
    let deadline = Instant::now() + opts.wait;
    let snap = switch(&client, &shares, "handback", &["poller"]).await?;
    settle(&client, &snap, deadline, "give-back").await?;
    switch(&client, &shares, "poller", &[]).await?;
    let pending: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox.events e
             WHERE outbox.dispatch_owner(e.aggregate_type, e.aggregate_id) = 'poller'
               AND NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)",
            &[],
        )
        .await
        .map_err(db("counting outboxd's pending events"))?
        .get(0);
    println!(
        "the poller owns {}: new rows are its own; {pending} event(s) outboxd captured are still pending and stay outboxd's (the poller's claim waits for their aggregates until they have receipts)",
        describe(target)
    );
    Ok(())
}

/// Canaries older than this are an interrupted share command's and are removed.
const CANARY_LEFTOVER: &str = "1 hour";

/// Proves, before any owner changes, that the poller's claim goes through
/// `outbox.poller_may_claim`: a canary row (owned by nobody, the predicate is false for it) is
/// inserted into each attached table, and the switch goes on once a claim has asked the
/// predicate about it and left it. A poller that claims it (marks it, or holds its row lock)
/// lacks the predicate: after the switch both relays would publish the same rows, so the
/// switch is refused, with the fix. The canaries are deleted either way.
async fn canary(client: &Client, target: &Target, wait: Duration, cmd: &str) -> anyhow::Result<()> {
    client
        .execute(
            &format!(
                "SELECT outbox.poller_canary_end(event_id) FROM outbox.poller_canaries
                 WHERE created_at < now() - interval '{CANARY_LEFTOVER}'"
            ),
            &[],
        )
        .await
        .map_err(db("removing canaries of interrupted share commands"))?;
    // One canary per attached table, of the type being switched (a poller per type sees
    // it), for --all the type of the table's newest row.
    let rows = client
        .query(
            "SELECT t.source_table::text,
                    outbox.poller_canary_start(t.source_table, coalesce($1,
                        (SELECT l.aggregate_type FROM outbox.legacy_events l
                         WHERE l.source_table = t.source_table
                         ORDER BY l.captured_at DESC LIMIT 1),
                        'outboxd_canary'))
             FROM outbox.poller_tables t ORDER BY 1",
            &[&target_type(target)],
        )
        .await
        .map_err(db("inserting the ownership canary into the poller's table"))?;
    let canaries: Vec<(String, uuid::Uuid)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let verdict = watch_canaries(client, &canaries, wait).await;
    let mut cleanup = Vec::new();
    for (table, id) in &canaries {
        if let Err(e) = client
            .execute("SELECT outbox.poller_canary_end($1)", &[id])
            .await
        {
            cleanup.push(format!(
                "canary {id} in {table} could not be removed ({}); the next share command removes it after {CANARY_LEFTOVER}, or DELETE it",
                outbox_ledger::describe_db_error(&e)
            ));
        }
    }
    let note = if cleanup.is_empty() {
        String::new()
    } else {
        format!(" ({})", cleanup.join("; "))
    };
    match verdict? {
        Canary::Respected => Ok(()),
        Canary::Claimed(table, id) => anyhow::bail!(
            "refused: the poller claimed the ownership canary {id} in {table}, a row `outbox.poller_may_claim` is false for, so its claim does not go through that predicate, and after the switch both relays would publish the same rows. Nothing was switched: {} keeps its owner. Fix: add `AND outbox.poller_may_claim(id)` to the poller's claim query (docs/migrating.md, step 2), deploy it, then run `outboxd share {cmd}` again. The poller may have published the canary (event type outboxd.ownership_canary, aggregate id outboxd-canary-{id}): consumers can skip it{note}",
            describe(target)
        ),
        Canary::Silent(table, id) => anyhow::bail!(
            "refused: no claim of the poller asked `outbox.poller_may_claim` about the ownership canary {id} in {table} within {}s: the poller is not running, is further behind than that, or its claim lacks the predicate. Nothing was switched: {} keeps its owner. Start the poller with `AND outbox.poller_may_claim(id)` in its claim (docs/migrating.md, step 2) and run `outboxd share {cmd}` again (with a longer --canary-wait for a long poll interval), or pass --poller-stopped if the poller is stopped and starts again only with the predicate{note}",
            wait.as_secs(),
            describe(target)
        ),
    }
}

enum Canary {
    /// Every canary was asked about and left, on two looks in a row.
    Respected,
    /// A canary was claimed: (table, id).
    Claimed(String, uuid::Uuid),
    /// A canary nobody asked about until the deadline.
    Silent(String, uuid::Uuid),
}

async fn watch_canaries(
    client: &Client,
    canaries: &[(String, uuid::Uuid)],
    wait: Duration,
) -> anyhow::Result<Canary> {
    let deadline = Instant::now() + wait;
    let mut respected_before = false;
    let mut last_print = Instant::now();
    loop {
        let mut all_respected = true;
        let mut silent = None;
        for (table, id) in canaries {
            let state: String = client
                .query_one("SELECT outbox.poller_canary_state($1)", &[id])
                .await
                .map_err(db("reading the ownership canary"))?
                .get(0);
            match state.as_str() {
                "claimed" => return Ok(Canary::Claimed(table.clone(), *id)),
                "respected" => {}
                _ => {
                    all_respected = false;
                    silent.get_or_insert_with(|| (table.clone(), *id));
                }
            }
        }
        // A claim asks the predicate before it locks a row: the second look sees a lock a
        // claim that asked and took the canary anyway would hold.
        if all_respected && respected_before {
            return Ok(Canary::Respected);
        }
        respected_before = all_respected;
        if let Some((table, id)) = silent {
            if Instant::now() >= deadline {
                return Ok(Canary::Silent(table, id));
            }
        }
        if last_print.elapsed() >= Duration::from_secs(5) {
            println!("waiting for the poller's claim to pass the ownership canary");
            last_print = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The aggregate type a target names (None for --all).
fn target_type(target: &Target) -> Option<String> {
    match target {
        Target::Type(t) | Target::Buckets(t, _) => Some(t.clone()),
        Target::All => None,
    }
}

fn describe(target: &Target) -> String {
    match target {
        Target::Type(t) => format!("aggregate type {t}"),
        Target::Buckets(t, b) => format!(
            "aggregate type {t} buckets {} of 16",
            b.iter().map(i32::to_string).collect::<Vec<_>>().join(",")
        ),
        Target::All => "every aggregate type".into(),
    }
}

/// A share's bucket as `share list` shows it.
fn bucket_text(b: i32) -> String {
    if b < 0 {
        "all".into()
    } else {
        b.to_string()
    }
}

/// The shares a target names, as (aggregate type, bucket; -1 the whole type): one type and
/// its buckets with a share of their own, some buckets of a type, or every share (`*` and
/// every type and bucket with a share of its own).
async fn shares_of(client: &Client, target: &Target) -> anyhow::Result<Vec<(String, i32)>> {
    let attached: i64 = client
        .query_one("SELECT count(*) FROM outbox.poller_tables", &[])
        .await
        .map_err(db("reading outbox.poller_tables"))?
        .get(0);
    if attached == 0 {
        anyhow::bail!("no poller table is attached: run `outboxd migrate --poller-table SCHEMA.TABLE --published-column COLUMN` first (docs/migrating.md)");
    }
    Ok(match target {
        Target::Type(t) | Target::Buckets(t, _) if t == "*" || t.is_empty() => {
            anyhow::bail!("--aggregate-type must name a type; use --all for every type")
        }
        Target::Type(t) => {
            let mut shares = vec![(t.clone(), -1)];
            shares.extend(
                client
                    .query(
                        "SELECT aggregate_type, bucket FROM outbox.dispatch_shares
                         WHERE aggregate_type = $1 AND bucket >= 0",
                        &[t],
                    )
                    .await
                    .map_err(db("reading outbox.dispatch_shares"))?
                    .iter()
                    .map(|r| (r.get(0), r.get(1))),
            );
            shares
        }
        Target::Buckets(t, buckets) => buckets.iter().map(|b| (t.clone(), *b)).collect(),
        Target::All => client
            .query(
                "SELECT aggregate_type, bucket FROM outbox.dispatch_shares",
                &[],
            )
            .await
            .map_err(db("reading outbox.dispatch_shares"))?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect(),
    })
}

/// Sets every share to `owner` (those already in `done` stay) in one transaction and returns
/// the snapshot taken after the commit: its in-progress transactions are the producers that
/// may still capture under the previous owner.
async fn switch(
    client: &Client,
    shares: &[(String, i32)],
    owner: &str,
    done: &[&str],
) -> anyhow::Result<String> {
    let (types, buckets): (Vec<&str>, Vec<i32>) =
        shares.iter().map(|(t, b)| (t.as_str(), *b)).unzip();
    client
        .execute(
            "SELECT outbox.set_dispatch_owner(s.t, s.b, $3)
             FROM unnest($1::text[], $2::int[]) s(t, b)
             WHERE outbox.share_owner(s.t, s.b) <> ALL ($4::text[])",
            &[&types, &buckets, &owner, &done],
        )
        .await
        .map_err(db("switching the share owner"))?;
    let snap: String = client
        .query_one("SELECT pg_current_snapshot()::text", &[])
        .await
        .map_err(db("reading the snapshot"))?
        .get(0);
    Ok(snap)
}

/// Waits until every transaction in progress in `snap` has ended.
async fn settle(client: &Client, snap: &str, deadline: Instant, cmd: &str) -> anyhow::Result<()> {
    loop {
        let done: bool = client
            .query_one(
                "SELECT outbox.snapshot_settled($1::text::pg_snapshot)",
                &[&snap],
            )
            .await
            .map_err(db("waiting for in-flight producer transactions"))?
            .get(0);
        if done {
            return Ok(());
        }
        if Instant::now() >= deadline {
            anyhow::bail!(
                "producer transactions that began before the switch are still open (snapshot {snap}; see pg_stat_activity for old xact_start); nothing is lost, run `outboxd share {cmd}` again when they end"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn db(what: &'static str) -> impl Fn(tokio_postgres::Error) -> anyhow::Error {
    move |e| anyhow::anyhow!("{what}: {}", outbox_ledger::describe_db_error(&e))
}

/// Installs the poller-table capture (migration 0014) on `table`.
pub async fn attach(url: &str, a: &crate::cli::PollerTableArgs, table: &str) -> anyhow::Result<()> {
    let (unpublished, default_mark) = match (&a.published_column, &a.unpublished_when) {
        (Some(c), None) => {
            let c = outbox_source::slot::quote_ident(c);
            (format!("{c} IS NULL"), Some(format!("{c} = now()")))
        }
        (None, Some(w)) => (w.clone(), None),
        _ => anyhow::bail!(
            "--poller-table {table} needs exactly one of --published-column COLUMN (the row is unpublished while it is NULL) or --unpublished-when EXPRESSION (e.g. \"status = 'NEW'\")"
        ),
    };
    let mark = if a.no_mark_published {
        None
    } else {
        a.mark_published.clone().or(default_mark)
    };
    let (schema, name) = crate::config::split_table(table)?;
    let qualified = format!(
        "{}.{}",
        outbox_source::slot::quote_ident(&schema),
        outbox_source::slot::quote_ident(&name)
    );
    let client = connect(url).await?;
    let row = client
        .query_one(
            "SELECT outbox.install_poller_capture($1::text::regclass, $2, $3, $4, $5, $6, $7, $8)",
            &[
                &qualified,
                &unpublished,
                &a.id_column,
                &a.aggregatetype_column,
                &a.aggregateid_column,
                &a.type_column,
                &a.payload_column,
                &mark,
            ],
        )
        .await
        .with_context(|| format!("attaching poller table {table}"))
        .map_err(|e| match e.downcast_ref::<tokio_postgres::Error>() {
            Some(pe) => anyhow::anyhow!(
                "attaching poller table {table}: {}",
                outbox_ledger::describe_db_error(pe)
            ),
            None => e,
        })?;
    println!("{}", row.get::<_, String>(0));
    Ok(())
}
