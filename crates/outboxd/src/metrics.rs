//! Every metric outboxd exports, defined in one place (names prefixed `outboxd_`, served in
//! the Prometheus text format at `/metrics` on `--admin-addr`).
//!
//! The values come from two places, on purpose:
//! * **counted by the relay as it works** — events accepted, duplicate transport receipts,
//!   quarantines, reconnects, in-flight events, commit → receipt latency. The relay calls the
//!   small functions at the bottom of this module (one line at each point); each is a few
//!   atomic operations, cheap enough for the hot path.
//! * **read from PostgreSQL by the admin sampler** (`admin::sampler`) every few seconds —
//!   slot lag, WAL retained by the slot, pending events and the oldest one's age, UNKNOWN
//!   attempts, quarantined events and holds. These are facts of the database, true whichever
//!   relay (or none) is running, so they are queried rather than threaded through the relay.
//!
//! Readiness (`/readyz`) is derived from two gauges here: the relay is streaming from its slot
//! and the broker answered the sampler's last metadata request.

use std::collections::BTreeMap;
use std::sync::{LazyLock, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use outbox_core::Lsn;
use outbox_ledger::{AcceptOutcome, LedgerItem};
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Upper bounds of the commit → receipt latency buckets, seconds. The design target is a p99
/// of 20 ms at 10k events/s; the long tail covers broker outages and replays.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Transactions whose commit time is remembered for the latency histogram, at most. Entries
/// are dropped when the checkpoint passes them; the cap only matters if it never does.
const MAX_COMMIT_TIMES: usize = 1_000_000;

/// Microseconds between the Unix epoch and the PostgreSQL epoch (2000-01-01 UTC).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// The registry and every metric in it.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub accepted: IntCounter,
    pub duplicates: IntCounter,
    pub quarantined_total: IntCounter,
    pub reconnects: IntCounter,
    pub commit_to_receipt: Histogram,
    pub in_flight: IntGauge,
    pub streaming: IntGauge,
    pub broker_reachable: IntGauge,
    pub database_reachable: IntGauge,
    pub checkpoint_lsn: IntGauge,
    pub lag_bytes: IntGaugeVec,
    pub retained_wal_bytes: IntGaugeVec,
    pub safe_wal_size_bytes: IntGaugeVec,
    pub slot_active: IntGaugeVec,
    pub lease_generation: IntGaugeVec,
    pub pending: IntGauge,
    pub oldest_pending_age: Gauge,
    pub unknown: IntGauge,
    pub oldest_unknown_age: Gauge,
    pub quarantined: IntGauge,
    pub held_aggregates: IntGauge,
    pub held_events: IntGauge,
    pub sampler_errors: IntCounter,
    /// Commit LSN → commit time (µs since the PostgreSQL epoch) of transactions streamed and
    /// not yet passed by the checkpoint.
    commit_times: Mutex<BTreeMap<u64, i64>>,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// The process-wide metrics.
pub fn get() -> &'static Metrics {
    &METRICS
}

impl Metrics {
    fn new() -> Metrics {
        let registry = Registry::new();
        // Names and help texts are constants; registering them cannot fail except by a
        // duplicate name, which the unit test below would catch.
        fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
            r.register(Box::new(c.clone()))
                .expect("metric names are unique");
            c
        }
        let counter = |name: &str, help: &str| {
            reg(
                &registry,
                IntCounter::new(name, help).expect("valid metric name"),
            )
        };
        let gauge = |name: &str, help: &str| {
            reg(
                &registry,
                IntGauge::new(name, help).expect("valid metric name"),
            )
        };
        let fgauge = |name: &str, help: &str| {
            reg(
                &registry,
                Gauge::new(name, help).expect("valid metric name"),
            )
        };
        let slot_gauge = |name: &str, help: &str| {
            reg(
                &registry,
                IntGaugeVec::new(Opts::new(name, help), &["slot"]).expect("valid metric name"),
            )
        };
        Metrics {
            accepted: counter(
                "outboxd_events_accepted_total",
                "Events whose primary broker receipt was accepted into the ledger (rate() of it is events/s).",
            ),
            duplicates: counter(
                "outboxd_duplicate_receipts_total",
                "Broker ACKs recorded as duplicate transport receipts (replays after a crash, late ACKs of old attempts).",
            ),
            quarantined_total: counter(
                "outboxd_events_quarantined_total",
                "Events quarantined by this process (unreadable, wrong destination, rejected by the broker, digest conflicts).",
            ),
            reconnects: counter(
                "outboxd_reconnects_total",
                "Times the relay dropped its in-memory state and resumed from the ledger checkpoint after a transient failure.",
            ),
            commit_to_receipt: reg(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "outboxd_commit_to_receipt_seconds",
                        "From the producing transaction's commit (WAL commit timestamp) to the ledger accepting the broker receipt.",
                    )
                    .buckets(LATENCY_BUCKETS.to_vec()),
                )
                .expect("valid histogram"),
            ),
            in_flight: gauge(
                "outboxd_in_flight_events",
                "Events read from the slot whose receipt is not yet accepted (sent, or waiting behind their aggregate).",
            ),
            streaming: gauge(
                "outboxd_streaming",
                "1 while the relay streams from its replication slot, else 0.",
            ),
            broker_reachable: gauge(
                "outboxd_broker_reachable",
                "1 if the broker answered the last metadata request, else 0.",
            ),
            database_reachable: gauge(
                "outboxd_database_reachable",
                "1 if the last ledger sample succeeded, else 0.",
            ),
            checkpoint_lsn: gauge(
                "outboxd_checkpoint_lsn",
                "The ledger checkpoint this relay last committed (an LSN as a number).",
            ),
            lag_bytes: slot_gauge(
                "outboxd_replication_lag_bytes",
                "WAL written since the slot's confirmed_flush_lsn: what the relay has not yet confirmed.",
            ),
            retained_wal_bytes: slot_gauge(
                "outboxd_slot_retained_wal_bytes",
                "WAL the server keeps for the slot (current WAL position minus the slot's restart_lsn).",
            ),
            safe_wal_size_bytes: slot_gauge(
                "outboxd_slot_safe_wal_size_bytes",
                "WAL that can still be written before max_slot_wal_keep_size invalidates the slot (absent when unlimited).",
            ),
            slot_active: slot_gauge(
                "outboxd_slot_active",
                "1 if a walsender holds the slot, 0 if not; -1 if the slot is missing.",
            ),
            lease_generation: slot_gauge(
                "outboxd_lease_generation",
                "Generation of the slot's lease: it grows by one at every takeover (lease churn).",
            ),
            pending: gauge(
                "outboxd_pending_events",
                "Outbox rows with no primary receipt and no open quarantine record.",
            ),
            oldest_pending_age: fgauge(
                "outboxd_oldest_pending_age_seconds",
                "Age of the oldest pending outbox row (0 when none is pending).",
            ),
            unknown: gauge(
                "outboxd_unknown_attempts",
                "Send attempts whose outcome is DISPATCH_UNKNOWN (awaiting reconciliation).",
            ),
            oldest_unknown_age: fgauge(
                "outboxd_oldest_unknown_age_seconds",
                "Age of the oldest DISPATCH_UNKNOWN attempt (0 when there is none).",
            ),
            quarantined: gauge(
                "outboxd_quarantined_events",
                "Open quarantine records (see `outboxd quarantine list`).",
            ),
            held_aggregates: gauge(
                "outboxd_held_aggregates",
                "Aggregates held by a quarantined event or a version gap.",
            ),
            held_events: gauge(
                "outboxd_held_events",
                "Events waiting behind a held aggregate.",
            ),
            sampler_errors: counter(
                "outboxd_sampler_errors_total",
                "Ledger or broker samples that failed (the gauges keep their last value).",
            ),
            commit_times: Mutex::new(BTreeMap::new()),
            registry,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            return format!("# encoding metrics failed: {e}\n");
        }
        String::from_utf8(buf).unwrap_or_default()
    }

    /// Ready means: streaming from the slot, and the broker answers. Otherwise, why not.
    pub fn readiness(&self) -> Result<(), String> {
        let mut why = Vec::new();
        if self.streaming.get() != 1 {
            why.push("not streaming from the replication slot");
        }
        if self.broker_reachable.get() != 1 {
            why.push("broker not reachable");
        }
        if why.is_empty() {
            Ok(())
        } else {
            Err(why.join("; "))
        }
    }
}

// ---- One-line calls from the relay -------------------------------------------------------

/// A ledger batch committed with this outcome.
pub fn accepted(o: &AcceptOutcome) {
    let m = get();
    m.accepted.inc_by(o.primary);
    m.duplicates.inc_by(o.duplicates);
    m.quarantined_total.inc_by(o.quarantined + o.conflicts);
}

/// The relay lost its stream or broker and resumes from the checkpoint.
pub fn reconnect() {
    get().reconnects.inc();
}

/// The relay started (true) or stopped (false) streaming from its slot. A run that ended
/// dropped its in-memory state, so nothing is in flight any more.
pub fn streaming(on: bool) {
    let m = get();
    m.streaming.set(i64::from(on));
    if !on {
        m.in_flight.set(0);
    }
}

/// Events read and not yet resolved.
pub fn in_flight(n: u64) {
    get().in_flight.set(i64::try_from(n).unwrap_or(i64::MAX));
}

/// A transaction began in the stream: remember its commit time for the latency histogram.
pub fn txn_begin(commit_lsn: Lsn, commit_time_pg_micros: i64) {
    if let Ok(mut t) = get().commit_times.lock() {
        if t.len() >= MAX_COMMIT_TIMES {
            t.pop_first();
        }
        t.insert(commit_lsn.0, commit_time_pg_micros);
    }
}

/// A ledger batch committed: observe commit → receipt latency for every receipt in it whose
/// transaction came through the stream (snapshot rows have no commit time).
pub fn receipts_accepted(batch: &[LedgerItem]) {
    let m = get();
    let Ok(t) = m.commit_times.lock() else {
        return;
    };
    if t.is_empty() {
        return;
    }
    let now = pg_now_micros();
    for item in batch {
        if let LedgerItem::Receipt(r) = item {
            if let Some(commit) = r.commit_lsn.and_then(|l| t.get(&l.0)) {
                m.commit_to_receipt
                    .observe((now - commit).max(0) as f64 / 1e6);
            }
        }
    }
}

/// The ledger checkpoint moved to `lsn`: every transaction that committed before it is fully
/// resolved, so its commit time is no longer needed.
pub fn checkpoint(lsn: Lsn) {
    let m = get();
    m.checkpoint_lsn
        .set(i64::try_from(lsn.0).unwrap_or(i64::MAX));
    if let Ok(mut t) = m.commit_times.lock() {
        *t = t.split_off(&lsn.0);
    }
}

fn pg_now_micros() -> i64 {
    let unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0);
    unix - PG_EPOCH_OFFSET_MICROS
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The families docs/operations.md documents and the e2e test checks.
    const REQUIRED_FAMILIES: &[&str] = &[
        "outboxd_replication_lag_bytes",
        "outboxd_slot_retained_wal_bytes",
        "outboxd_oldest_pending_age_seconds",
        "outboxd_events_accepted_total",
        "outboxd_commit_to_receipt_seconds",
        "outboxd_in_flight_events",
        "outboxd_unknown_attempts",
        "outboxd_oldest_unknown_age_seconds",
        "outboxd_quarantined_events",
        "outboxd_held_aggregates",
        "outboxd_held_events",
        "outboxd_duplicate_receipts_total",
        "outboxd_reconnects_total",
    ];

    #[test]
    fn every_family_renders_with_the_prefix() {
        let m = get();
        m.lag_bytes.with_label_values(&["s"]).set(1);
        m.retained_wal_bytes.with_label_values(&["s"]).set(1);
        m.safe_wal_size_bytes.with_label_values(&["s"]).set(1);
        m.slot_active.with_label_values(&["s"]).set(1);
        m.lease_generation.with_label_values(&["s"]).set(1);
        let text = m.render();
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| l.split(' ').next().unwrap())
            .collect();
        assert_eq!(families.len(), 23, "{text}");
        assert!(families.iter().all(|f| f.starts_with("outboxd_")));
        // The families the operations guide promises (docs/operations.md).
        for f in REQUIRED_FAMILIES {
            assert!(families.contains(f), "{f} missing");
        }
    }

    #[test]
    fn latency_is_observed_once_per_streamed_receipt_and_forgotten_at_the_checkpoint() {
        let before = get().commit_to_receipt.get_sample_count();
        let lsn = Lsn(0xdead_0000);
        txn_begin(lsn, pg_now_micros() - 5_000);
        let receipt = |commit_lsn| {
            LedgerItem::Receipt(outbox_ledger::ReceiptRecord {
                event_id: uuid::Uuid::nil(),
                payload_digest: String::new(),
                destination_digest: String::new(),
                broker_kind: "kafka".into(),
                broker_cluster: "c".into(),
                topic: "t".into(),
                partition: 0,
                offset: 0,
                timestamp_ms: None,
                attempt: 1,
                relay_generation: 1,
                commit_lsn,
            })
        };
        receipts_accepted(&[receipt(Some(lsn)), receipt(None)]);
        // Other tests in this process may observe too; ours added at least one.
        assert!(get().commit_to_receipt.get_sample_count() > before);
        checkpoint(Lsn(lsn.0 + 1));
        assert!(!get().commit_times.lock().unwrap().contains_key(&lsn.0));
    }
}
