//! `outboxd run` with `[[databases]]` in its config file: one process relays several
//! databases. Each has its own relay (or fleet member), hence its own slot, ledger, lease and
//! connections; only the process, the broker settings and the admin endpoints are shared.
//!
//! Why a supervisor: a relay returns an error it does not retry itself (a database that is
//! down when the relay starts, a setting only an operator can fix). With one database that
//! error ends the process, and the restart policy of its orchestrator takes over. With
//! several, it must not stop the others: the failed database's relay is started again here,
//! with the same backoff as a relay's own reconnects, while the others keep streaming.
//! `/readyz` names the databases that do not stream, and every metric carries the
//! `database` label.

use std::sync::Arc;
use std::time::Duration;

use outbox_relay::lifecycle::Restarts;
use tokio::sync::watch;

use super::{fleet, Progress};
use crate::config::RelayConfig;

/// Runs one relay per database until `shutdown`; `fleet` makes each a fleet member.
pub async fn run(cfgs: Vec<RelayConfig>, fleet: bool, shutdown: watch::Receiver<bool>) {
    let tasks: Vec<_> = cfgs
        .into_iter()
        .map(|cfg| tokio::spawn(supervise(cfg, fleet, shutdown.clone())))
        .collect();
    for t in tasks {
        let _ = t.await;
    }
}

/// Runs the relay of one database, and runs it again after any error, until `shutdown`.
async fn supervise(cfg: RelayConfig, fleet: bool, mut shutdown: watch::Receiver<bool>) {
    let progress = Arc::new(Progress::new(&cfg));
    let mut restarts = Restarts::new(Duration::from_millis(500), crate::config::MAX_BACKOFF);
    loop {
        let result = if fleet {
            fleet::run(cfg.clone(), shutdown.clone()).await
        } else {
            super::run(cfg.clone(), progress.clone(), shutdown.clone()).await
        };
        if *shutdown.borrow() {
            return;
        }
        let e = match result {
            Ok(()) => return,
            Err(e) => e,
        };
        // Whatever the error, the other databases go on and this one is tried again: an
        // operator's fix (or the database's return) is picked up without a restart.
        let streamed_for = progress
            .streaming_since()
            .map_or(Duration::ZERO, |since| since.elapsed());
        // Not `after_error`: that stops a process whose relay never streamed, and here a
        // database that was never reached (down when the process started) is retried like
        // any other, with the same growing pause.
        let after = restarts.backoff(streamed_for);
        tracing::error!(database = %cfg.database, slot = %cfg.slot, error = %e,
            retry_in_ms = after.as_millis() as u64,
            "this database's relay stopped; the other databases go on; starting it again");
        tokio::select! {
            _ = tokio::time::sleep(after) => {}
            _ = shutdown.changed() => return,
        }
    }
}
