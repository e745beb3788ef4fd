//! `--pg-statements`: where the drain's PostgreSQL time goes, statement by statement.
//!
//! The per-process CPU split (procstat) says how much the relay's sessions cost the server;
//! this says which of their statements it is, so a change to the acceptance can be aimed
//! before it is built. `pg_stat_statements` measures execution time, not CPU: with `fsync`
//! off the two are close for these statements, and the walsender's decoding is not in it.

use std::path::Path;

use anyhow::Context;
use tokio_postgres::Client;

/// postgresql.conf lines for a cluster that keeps statement statistics.
pub(crate) const SETTINGS: &str = "shared_preload_libraries = 'pg_stat_statements'\n\
     pg_stat_statements.track = all\npg_stat_statements.max = 1000\n";

/// One statement's share of a phase.
#[derive(Debug, Clone)]
pub(crate) struct Statement {
    pub query: String,
    pub calls: i64,
    pub rows: i64,
    pub total_ms: f64,
}

/// Starts counting in `client`'s database (creating the extension there).
pub(crate) async fn reset(client: &Client) -> anyhow::Result<()> {
    client
        .batch_execute(
            "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset()",
        )
        .await
        .context("resetting pg_stat_statements (--pg-statements)")
}

/// The database's statements since [`reset`], most expensive first.
pub(crate) async fn top(client: &Client, limit: i64) -> anyhow::Result<Vec<Statement>> {
    let rows = client
        .query(
            "SELECT query, calls, rows, total_exec_time + total_plan_time
             FROM pg_stat_statements
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
             ORDER BY 4 DESC LIMIT $1",
            &[&limit],
        )
        .await
        .context("reading pg_stat_statements (--pg-statements)")?;
    Ok(rows
        .iter()
        .map(|r| Statement {
            query: r.get(0),
            calls: r.get(1),
            rows: r.get(2),
            total_ms: r.get(3),
        })
        .collect())
}

/// One line per statement: time per drained event, calls, rows, the statement's start.
pub(crate) fn print(phase: &str, stmts: &[Statement], events: u64) {
    let total: f64 = stmts.iter().map(|s| s.total_ms).sum();
    eprintln!(
        "bench: {phase}: statements by execution time ({:.2} us per event in these {}):",
        1e3 * total / events.max(1) as f64,
        stmts.len()
    );
    for s in stmts {
        let q: String = s.query.split_whitespace().collect::<Vec<_>>().join(" ");
        let q: String = q.chars().take(110).collect();
        eprintln!(
            "  {:>7.3} us/event {:>9} calls {:>10} rows  {q}",
            1e3 * s.total_ms / events.max(1) as f64,
            s.calls,
            s.rows
        );
    }
}

pub(crate) fn json(stmts: &[Statement], events: u64) -> serde_json::Value {
    serde_json::Value::Array(
        stmts
            .iter()
            .map(|s| {
                serde_json::json!({
                    "query": s.query, "calls": s.calls, "rows": s.rows, "total_ms": s.total_ms,
                    "us_per_event": 1e3 * s.total_ms / events.max(1) as f64,
                })
            })
            .collect(),
    )
}

/// The server's current WAL insert position.
pub(crate) async fn wal_lsn(client: &Client) -> anyhow::Result<String> {
    Ok(client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .context("reading the WAL position (--pg-statements)")?
        .get(0))
}

/// What the WAL written between `start` and `end` holds, by record type (`pg_waldump
/// --stats=record`), with bytes per drained event: in a drain all of it is the relay's ledger,
/// which the walsender then decodes and drops and the server writes, checksums and zero-fills
/// segments for. Best effort: a failure is printed, not raised.
pub(crate) fn print_wal(bindir: &Path, data: &Path, start: &str, end: &str, events: u64) {
    let out = std::process::Command::new(bindir.join("pg_waldump"))
        .arg("--path")
        .arg(data.join("pg_wal"))
        .args(["--start", start, "--end", end, "--stats=record"])
        .output();
    let out = match out {
        Ok(o) if o.status.success() => o,
        Ok(o) => {
            eprintln!(
                "bench: pg_waldump failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return;
        }
        Err(e) => {
            eprintln!("bench: cannot run pg_waldump: {e}");
            return;
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("bench: drain: WAL written {start} .. {end}, by record type (pg_waldump --stats=record; combined size / {events} events in the last column):");
    let mut rows: Vec<(u64, String)> = Vec::new();
    for line in text.lines() {
        // "Type  N (%)  Record size (%)  FPI size (%)  Combined size (%)", each percentage in
        // parentheses that may hold spaces: drop them, then the fifth column is the size.
        let mut bare = String::new();
        let mut depth = 0;
        for c in line.chars() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                _ if depth == 0 => bare.push(c),
                _ => {}
            }
        }
        let cols: Vec<&str> = bare.split_whitespace().collect();
        let [kind, n, record, fpi, combined] = cols[..] else {
            continue;
        };
        let (Ok(n), Ok(combined)) = (n.parse::<u64>(), combined.parse::<u64>()) else {
            continue;
        };
        rows.push((
            combined,
            format!("{kind}: {n} records, {record} B + {fpi} B of page images"),
        ));
    }
    rows.sort_by_key(|r| std::cmp::Reverse(r.0));
    for (combined, line) in rows.iter().take(20) {
        eprintln!(
            "  {:>7.1} B/event  {line}",
            *combined as f64 / events.max(1) as f64
        );
    }
}
