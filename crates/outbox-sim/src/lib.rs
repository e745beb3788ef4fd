//! Deterministic simulation of outboxd: one seeded, single-threaded world per trace, with
//! simulated time and no I/O, driving the project's **real** protocol logic through faults at
//! every durable boundary, and counting invariant violations.
//!
//! # What is real and what is modelled
//! Real code from `outbox-core` decides everything the product decides: the ack tracker
//! ([`outbox_core::AckTracker`]) computes every LSN the simulated relay may confirm; the
//! ordering gate ([`outbox_core::OrderingGate`]) decides what is sent, queued or held; envelope
//! and destination digests are computed and verified by [`outbox_core::OutboxEvent::verify`];
//! the acceptance point classifies each receipt with [`outbox_core::receipt::classify`];
//! DISPATCH_UNKNOWN attempts are resolved with [`outbox_core::receipt::resolve_unknown`];
//! destination migrations are allowed or refused by
//! [`outbox_core::receipt::migration_precheck`]; every relay start runs
//! `outbox_source::slot::plan`; and every pipeline decision of a relay run (admit, route check,
//! gate, what a delivery report means, the batch and the checkpoint it justifies) is made by
//! the daemon's own [`outbox_relay::PipelineCore`]. The world around them — PostgreSQL's WAL
//! and slot, the ledger tables, the broker, producers, consumers with an inbox, the operator —
//! is modelled, and the rest of the relay's loop (start, flush timing, standby status,
//! releases, salvage, the I/O of UNKNOWN reconciliation, whose decisions are
//! `outbox_relay::unknown`) is mirrored step for step.
//!
//! # Reproducing
//! Trace `i` of seed `s` draws every choice from [`rng::SplitMix64`] seeded with `(s, i)`, so
//! any trace replays alone: `outbox-sim --seed S --trace I` prints its event log.

pub mod rng;
mod world;

pub use world::{run_trace, Counts, Mutant, TraceResult};

/// Runs traces `range` of `seed` and sums their counts. `on_violation` is called with the trace
/// number of every trace that violated an invariant.
pub fn run_range(
    seed: u64,
    range: std::ops::Range<u64>,
    mutant: Option<Mutant>,
    mut on_violation: impl FnMut(u64, &Counts),
) -> Counts {
    let mut total = Counts::default();
    for i in range {
        let r = run_trace(seed, i, mutant, false);
        if r.counts.violations() > 0 {
            on_violation(i, &r.counts);
        }
        total.add(&r.counts);
    }
    total
}
