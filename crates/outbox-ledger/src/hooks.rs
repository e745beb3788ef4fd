//! A point a test can hold the relay's acceptance transaction at: after everything is
//! written (the checkpoint row locked, when the acceptance moves the checkpoint), before the
//! commit. The daemon arms it from its
//! failpoints (`OUTBOXD_FAILPOINTS=accept-before-commit=pause:MS`), so that an end-to-end
//! test can stop a relay while its transaction holds the slot's locks (the e2e test
//! `ha::a_relay_stopped_inside_its_acceptance_does_not_hold_the_next_holder`). Unarmed it is
//! one atomic load.

use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;

/// What runs at the point: a future the acceptance awaits.
pub type Hook = fn() -> Pin<Box<dyn Future<Output = ()> + Send>>;

static BEFORE_ACCEPT_COMMIT: OnceLock<Hook> = OnceLock::new();

/// Arms the point before the acceptance's commit (once per process; later calls are ignored).
pub fn set_before_accept_commit(hook: Hook) {
    let _ = BEFORE_ACCEPT_COMMIT.set(hook);
}

pub(crate) async fn before_accept_commit() {
    if let Some(hook) = BEFORE_ACCEPT_COMMIT.get() {
        hook().await;
    }
}
