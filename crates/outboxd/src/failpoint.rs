//! Named failpoints: deterministic crash points for tests.
//!
//! `OUTBOXD_FAILPOINTS="after-broker-ack=abort@3;before-send=abort"` makes the process abort
//! (like `kill -9`: no cleanup, no flush) the 3rd time it passes `after-broker-ack`, or the
//! first time it passes `before-send`. Unset, every failpoint is a single relaxed atomic load.
//!
//! Points: `before-send` (an event is about to be handed to the producer),
//! `after-broker-ack` (a delivery report said persisted; nothing recorded yet),
//! `after-accept` (a receipt batch committed in the ledger; the slot not yet told),
//! `after-snapshot-send` (an initial-snapshot event was handed to the producer),
//! `txn-after-commit` (exactly-once mode: the broker committed a batch's transaction; the
//! ledger has not accepted it).
//!
//! `=hang` instead of `=abort` makes the task that reaches an async point ([`hang`]) wait
//! forever instead (the process goes on): `before-stop-drain` (a relay told to stop, before it
//! drains; what a fleet member must abort after `STOP_GRACE`).
//!
//! `=pause:MS` makes the task that reaches an async point ([`pause`]) wait MS milliseconds the
//! first time, saying so on stderr, so that a test can act in that window:
//! `before-start-replication` (the start-up plan has read or created the slot; the relay is
//! about to stream from it), `accept-before-commit` (an acceptance transaction wrote its
//! receipts, and locked the checkpoint row if it moves it; armed in the ledger by
//! [`arm_ledger_hooks`]).
//!
//! `OUTBOXD_NUMBERING_FOLD_ROWS=N` makes a run fold its numbering log after every N rows it
//! logged instead of every 20,000 ([`numbering_fold_rows`]), so that a test sees folds
//! during a run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

struct Point {
    abort_at: u64,
    /// `=hang`: [`hang`] never returns.
    hang: bool,
    /// `=pause:MS`: [`pause`] waits this long, once.
    pause_ms: Option<u64>,
    hits: AtomicU64,
}

fn points() -> &'static HashMap<String, Point> {
    static POINTS: OnceLock<HashMap<String, Point>> = OnceLock::new();
    POINTS.get_or_init(|| {
        let mut m = HashMap::new();
        if let Ok(spec) = std::env::var("OUTBOXD_FAILPOINTS") {
            for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
                let (name, action) = item.split_once('=').unwrap_or((item, "abort"));
                let abort_at = match action.split_once('@') {
                    Some(("abort", n)) => n.parse().unwrap_or(1),
                    _ => 1,
                };
                m.insert(
                    name.to_string(),
                    Point {
                        abort_at,
                        hang: action == "hang",
                        pause_ms: action.strip_prefix("pause:").and_then(|ms| ms.parse().ok()),
                        hits: AtomicU64::new(0),
                    },
                );
            }
        }
        m
    })
}

/// Passes the named point; aborts the process if it is armed and its count is reached.
pub fn hit(name: &str) {
    let p = points();
    if p.is_empty() {
        return;
    }
    if let Some(point) = p.get(name) {
        let n = point.hits.fetch_add(1, Ordering::SeqCst) + 1;
        if n == point.abort_at {
            eprintln!("outboxd: failpoint {name} reached (hit {n}): aborting");
            std::process::abort();
        }
    }
}

/// Passes the named async point: if it is armed with `=hang`, the calling task waits forever
/// (it can only be aborted), and the process says so on stderr.
pub async fn hang(name: &str) {
    let p = points();
    if p.is_empty() {
        return;
    }
    if let Some(point) = p.get(name).filter(|p| p.hang) {
        let n = point.hits.fetch_add(1, Ordering::SeqCst) + 1;
        eprintln!("outboxd: failpoint {name} reached (hit {n}): hanging");
        std::future::pending::<()>().await;
    }
}

/// Passes the named async point: if it is armed with `=pause:MS`, the calling task waits MS
/// milliseconds the first time it passes (saying so on stderr), then goes on.
pub async fn pause(name: &str) {
    let p = points();
    if p.is_empty() {
        return;
    }
    if let Some((point, ms)) = p.get(name).and_then(|p| p.pause_ms.map(|ms| (p, ms))) {
        let n = point.hits.fetch_add(1, Ordering::SeqCst) + 1;
        if n == 1 {
            eprintln!("outboxd: failpoint {name} reached (hit {n}): pausing {ms} ms");
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
    }
}

/// Arms the ledger's own point (`outbox_ledger::hooks`) when `accept-before-commit` is set:
/// an acceptance transaction waits there before its commit (`=pause:MS`, once).
pub fn arm_ledger_hooks() {
    if points().contains_key("accept-before-commit") {
        outbox_ledger::hooks::set_before_accept_commit(|| Box::pin(pause("accept-before-commit")));
    }
}

/// `OUTBOXD_NUMBERING_FOLD_ROWS`, when set to a number.
pub fn numbering_fold_rows() -> Option<u64> {
    std::env::var("OUTBOXD_NUMBERING_FOLD_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
}
