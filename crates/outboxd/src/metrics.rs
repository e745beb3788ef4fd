//! Every metric outboxd exports, defined in one place (names prefixed `outboxd_`, served in
//! the Prometheus text format at `/metrics` on `--admin-addr`).
//!
//! The values come from two places, on purpose:
//! * **counted by the relay as it works** — events accepted, duplicate transport receipts,
//!   quarantines, reconnects, in-flight events, commit → receipt latency. The relay calls its
//!   [`RelayMetrics`] handle, bound once to its `database` and `slot` labels (one line at each
//!   point); each call is a few atomic operations, cheap enough for the hot path.
//! * **read from PostgreSQL by the admin sampler** (`admin::sampler`) every few seconds —
//!   slot lag, WAL retained by the slot, pending events and the oldest one's age, UNKNOWN
//!   attempts, quarantined events and holds. These are facts of the database, true whichever
//!   relay (or none) is running, so they are queried rather than threaded through the relay.
//!
//! Readiness (`/readyz`) is derived from what is kept here: every database this process relays
//! has a relay streaming from a slot, and the broker answered the sampler's last metadata
//! request.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{LazyLock, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use outbox_core::Lsn;
use outbox_ledger::{AcceptOutcome, LedgerItem};
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
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

/// The registry and every metric in it. Every family but the broker's is labelled with the
/// `database` it is about (the name given in the config's `[[databases]]`, or the URL's
/// database name), and the relay's own and the slot's with the `slot` (a shard's slot, for a
/// fleet member), so that one process relaying several databases, or several shards, keeps
/// their figures apart.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub accepted: IntCounterVec,
    pub duplicates: IntCounterVec,
    pub quarantined_total: IntCounterVec,
    pub reconnects: IntCounterVec,
    pub commit_to_receipt: HistogramVec,
    pub in_flight: IntGaugeVec,
    pub unclear: IntGaugeVec,
    pub waiting_on_unclear: IntGaugeVec,
    pub streaming: IntGaugeVec,
    pub broker_reachable: IntGauge,
    pub database_reachable: IntGaugeVec,
    pub checkpoint_lsn: IntGaugeVec,
    pub lag_bytes: IntGaugeVec,
    pub retained_wal_bytes: IntGaugeVec,
    pub safe_wal_size_bytes: IntGaugeVec,
    pub slot_active: IntGaugeVec,
    pub lease_generation: IntGaugeVec,
    pub pending: IntGaugeVec,
    pub oldest_pending_age: GaugeVec,
    pub unknown: IntGaugeVec,
    pub oldest_unknown_age: GaugeVec,
    pub quarantined: IntGaugeVec,
    pub held_aggregates: IntGaugeVec,
    pub held_events: IntGaugeVec,
    pub sampler_errors: IntCounter,
}

/// The labels of the relay's own figures.
const RELAY_LABELS: &[&str] = &["database", "slot"];
/// The labels of the figures the sampler reads from a database.
const DATABASE_LABELS: &[&str] = &["database"];

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
                IntCounterVec::new(Opts::new(name, help), RELAY_LABELS).expect("valid metric name"),
            )
        };
        let relay_gauge = |name: &str, help: &str| {
            reg(
                &registry,
                IntGaugeVec::new(Opts::new(name, help), RELAY_LABELS).expect("valid metric name"),
            )
        };
        let db_gauge = |name: &str, help: &str| {
            reg(
                &registry,
                IntGaugeVec::new(Opts::new(name, help), DATABASE_LABELS)
                    .expect("valid metric name"),
            )
        };
        let db_fgauge = |name: &str, help: &str| {
            reg(
                &registry,
                GaugeVec::new(Opts::new(name, help), DATABASE_LABELS).expect("valid metric name"),
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
                HistogramVec::new(
                    HistogramOpts::new(
                        "outboxd_commit_to_receipt_seconds",
                        "From the producing transaction's commit (WAL commit timestamp) to the ledger accepting the broker receipt.",
                    )
                    .buckets(LATENCY_BUCKETS.to_vec()),
                    RELAY_LABELS,
                )
                .expect("valid histogram"),
            ),
            in_flight: relay_gauge(
                "outboxd_in_flight_events",
                "Events read from the slot whose receipt is not yet accepted (sent, or waiting behind their aggregate).",
            ),
            unclear: relay_gauge(
                "outboxd_unclear_events",
                "Events whose last send or look-up ended without a clear answer (timeout, dropped connection, 5xx, possibly persisted): each holds only its aggregate while the relay looks it up or sends it again.",
            ),
            waiting_on_unclear: relay_gauge(
                "outboxd_waiting_on_unclear_events",
                "Events waiting on unclear outcomes: parked, sent and unanswered for 5 s, or behind one of those in their aggregate. Not counted against max_in_flight; at unclear_max_waiting the relay stops reading the slot. Sampled once per status interval.",
            ),
            streaming: relay_gauge(
                "outboxd_streaming",
                "1 while the relay streams from its replication slot (or polls), else 0.",
            ),
            broker_reachable: reg(
                &registry,
                IntGauge::new(
                    "outboxd_broker_reachable",
                    "1 if the broker answered the last metadata request, else 0.",
                )
                .expect("valid metric name"),
            ),
            database_reachable: db_gauge(
                "outboxd_database_reachable",
                "1 if the last ledger sample of the database succeeded, else 0.",
            ),
            checkpoint_lsn: relay_gauge(
                "outboxd_checkpoint_lsn",
                "The ledger checkpoint this relay last committed (an LSN as a number).",
            ),
            lag_bytes: relay_gauge(
                "outboxd_replication_lag_bytes",
                "WAL written since the slot's confirmed_flush_lsn: what the relay has not yet confirmed.",
            ),
            retained_wal_bytes: relay_gauge(
                "outboxd_slot_retained_wal_bytes",
                "WAL the server keeps for the slot (current WAL position minus the slot's restart_lsn).",
            ),
            safe_wal_size_bytes: relay_gauge(
                "outboxd_slot_safe_wal_size_bytes",
                "WAL that can still be written before max_slot_wal_keep_size invalidates the slot (absent when unlimited).",
            ),
            slot_active: relay_gauge(
                "outboxd_slot_active",
                "1 if a walsender holds the slot, 0 if not; -1 if the slot is missing.",
            ),
            lease_generation: relay_gauge(
                "outboxd_lease_generation",
                "Generation of the slot's lease: it grows by one at every takeover (lease churn).",
            ),
            pending: db_gauge(
                "outboxd_pending_events",
                "Outbox rows with no primary receipt and no open quarantine record.",
            ),
            oldest_pending_age: db_fgauge(
                "outboxd_oldest_pending_age_seconds",
                "Age of the oldest pending outbox row (0 when none is pending).",
            ),
            unknown: db_gauge(
                "outboxd_unknown_attempts",
                "Send attempts whose outcome is DISPATCH_UNKNOWN (awaiting reconciliation).",
            ),
            oldest_unknown_age: db_fgauge(
                "outboxd_oldest_unknown_age_seconds",
                "Age of the oldest DISPATCH_UNKNOWN attempt (0 when there is none).",
            ),
            quarantined: db_gauge(
                "outboxd_quarantined_events",
                "Open quarantine records (see `outboxd quarantine list`).",
            ),
            held_aggregates: db_gauge(
                "outboxd_held_aggregates",
                "Aggregates held by a quarantined event or a version gap.",
            ),
            held_events: db_gauge(
                "outboxd_held_events",
                "Events waiting behind a held aggregate.",
            ),
            sampler_errors: reg(
                &registry,
                IntCounter::new(
                    "outboxd_sampler_errors_total",
                    "Ledger or broker samples that failed (the gauges keep their last value).",
                )
                .expect("valid metric name"),
            ),
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

    /// Registers a database this process relays: its `outboxd_database_reachable` series
    /// exists (at zero) before its first sample, and readiness waits for a slot of it to
    /// stream.
    pub fn expect_database(&self, database: &str) {
        self.database_reachable.with_label_values(&[database]);
    }

    /// The databases this process relays: those [`Metrics::expect_database`] registered.
    fn databases(&self) -> BTreeSet<String> {
        prometheus::core::Collector::collect(&self.database_reachable)
            .iter()
            .flat_map(|f| f.get_metric())
            .flat_map(|m| m.get_label())
            .filter(|l| l.get_name() == "database")
            .map(|l| l.get_value().to_string())
            .collect()
    }

    /// Ready means: every database this process relays streams from a slot (or polls), and
    /// the broker answers. Otherwise, why not, naming the databases.
    pub fn readiness(&self) -> Result<(), String> {
        let mut why = Vec::new();
        let databases = self.databases();
        // A database streams while one of its relays' `outboxd_streaming` series is 1.
        let idle: Vec<&str> = databases
            .iter()
            .filter(|db| self.total(&self.streaming, db) < 1.0)
            .map(String::as_str)
            .collect();
        match (idle.len(), databases.len()) {
            (0, _) => {}
            (_, 1) => why.push("not streaming from the replication slot".to_string()),
            _ => why.push(format!(
                "not streaming from a replication slot of database {}",
                idle.join(", ")
            )),
        }
        if self.broker_reachable.get() != 1 {
            why.push("broker not reachable".into());
        }
        if why.is_empty() {
            Ok(())
        } else {
            Err(why.join("; "))
        }
    }

    /// The figures of the relay of `slot` in `database`: what it counts as it works.
    pub fn relay(&self, database: &str, slot: &str) -> RelayMetrics {
        self.expect_database(database);
        let l = [database, slot];
        RelayMetrics {
            database: database.to_string(),
            slot: slot.to_string(),
            accepted: self.accepted.with_label_values(&l),
            duplicates: self.duplicates.with_label_values(&l),
            quarantined_total: self.quarantined_total.with_label_values(&l),
            reconnects: self.reconnects.with_label_values(&l),
            commit_to_receipt: self.commit_to_receipt.with_label_values(&l),
            in_flight: self.in_flight.with_label_values(&l),
            unclear: self.unclear.with_label_values(&l),
            waiting_on_unclear: self.waiting_on_unclear.with_label_values(&l),
            streaming: self.streaming.with_label_values(&l),
            checkpoint_lsn: self.checkpoint_lsn.with_label_values(&l),
            commit_times: Mutex::new(BTreeMap::new()),
        }
    }

    /// Gives every labelled family a series of `database`/`slot` (as a running relay and its
    /// sampler would), so that the exposition lists every family: for the tests that check it
    /// against the docs, the alert rules and the dashboard. Returns the relay's handle.
    #[doc(hidden)]
    pub fn give_every_family_a_series(&self, database: &str, slot: &str) -> RelayMetrics {
        let r = self.relay(database, slot);
        r.streaming(false);
        r.in_flight(0);
        r.unclear(0);
        r.waiting_on_unclear(0);
        r.checkpoint(Lsn(1));
        r.accepted(&AcceptOutcome::default());
        r.reconnect();
        r.commit_to_receipt.observe(0.0);
        for g in [
            &self.lag_bytes,
            &self.retained_wal_bytes,
            &self.safe_wal_size_bytes,
            &self.slot_active,
            &self.lease_generation,
        ] {
            g.with_label_values(&[database, slot]).set(1);
        }
        for g in [
            &self.pending,
            &self.unknown,
            &self.quarantined,
            &self.held_aggregates,
            &self.held_events,
        ] {
            g.with_label_values(&[database]).set(1);
        }
        self.oldest_pending_age
            .with_label_values(&[database])
            .set(1.0);
        self.oldest_unknown_age
            .with_label_values(&[database])
            .set(1.0);
        r
    }

    /// The sum of a family's series about `database` (all its slots: a fleet member's shards).
    pub fn total(&self, family: &impl prometheus::core::Collector, database: &str) -> f64 {
        family
            .collect()
            .iter()
            .flat_map(|f| f.get_metric())
            .filter(|m| {
                m.get_label()
                    .iter()
                    .any(|l| l.get_name() == "database" && l.get_value() == database)
            })
            // A counter's gauge part reads 0 and the other way round.
            .map(|m| m.get_counter().get_value() + m.get_gauge().get_value())
            .sum()
    }
}

// ---- The relay's handle: one line at each point of the hot path ---------------------------

/// What one relay (one slot of one database) counts as it works, bound to its labels once.
#[derive(Debug)]
pub struct RelayMetrics {
    database: String,
    slot: String,
    accepted: IntCounter,
    duplicates: IntCounter,
    quarantined_total: IntCounter,
    reconnects: IntCounter,
    commit_to_receipt: Histogram,
    in_flight: IntGauge,
    unclear: IntGauge,
    waiting_on_unclear: IntGauge,
    streaming: IntGauge,
    checkpoint_lsn: IntGauge,
    /// Commit LSN → commit time (µs since the PostgreSQL epoch) of transactions streamed and
    /// not yet passed by the checkpoint (LSNs are per database: one map per relay).
    commit_times: Mutex<BTreeMap<u64, i64>>,
}

impl RelayMetrics {
    /// A ledger batch committed with this outcome.
    pub fn accepted(&self, o: &AcceptOutcome) {
        self.accepted.inc_by(o.primary);
        self.duplicates.inc_by(o.duplicates);
        self.quarantined_total.inc_by(o.quarantined + o.conflicts);
    }

    /// The relay lost its stream or broker and resumes from the checkpoint.
    pub fn reconnect(&self) {
        self.reconnects.inc();
    }

    /// The relay started (true) or stopped (false) streaming from its slot. A run that ended
    /// dropped its in-memory state, so nothing is in flight any more.
    pub fn streaming(&self, on: bool) {
        self.streaming.set(i64::from(on));
        if !on {
            self.in_flight.set(0);
            self.unclear.set(0);
            self.waiting_on_unclear.set(0);
        }
    }

    /// This relay stopped for good in this process (a fleet member handed its shard over):
    /// its gauges leave the exposition, so no alert waits for a slot another process streams.
    pub fn retire(&self) {
        let m = get();
        let l = [self.database.as_str(), self.slot.as_str()];
        let _ = m.streaming.remove_label_values(&l);
        let _ = m.in_flight.remove_label_values(&l);
        let _ = m.unclear.remove_label_values(&l);
        let _ = m.waiting_on_unclear.remove_label_values(&l);
        let _ = m.checkpoint_lsn.remove_label_values(&l);
    }

    /// Events read and not yet resolved.
    pub fn in_flight(&self, n: u64) {
        self.in_flight.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Events parked after an unclear outcome, each holding its aggregate.
    pub fn unclear(&self, n: usize) {
        self.unclear.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Events waiting on unclear outcomes (`PipelineCore::waiting_on_unclear`).
    pub fn waiting_on_unclear(&self, n: u64) {
        self.waiting_on_unclear
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A transaction began in the stream: remember its commit time for the latency histogram.
    pub fn txn_begin(&self, commit_lsn: Lsn, commit_time_pg_micros: i64) {
        if let Ok(mut t) = self.commit_times.lock() {
            if t.len() >= MAX_COMMIT_TIMES {
                t.pop_first();
            }
            t.insert(commit_lsn.0, commit_time_pg_micros);
        }
    }

    /// A ledger batch committed: observe commit → receipt latency for every receipt in it
    /// whose transaction came through the stream (snapshot rows have no commit time).
    pub fn receipts_accepted(&self, batch: &[LedgerItem]) {
        let Ok(t) = self.commit_times.lock() else {
            return;
        };
        if t.is_empty() {
            return;
        }
        let now = pg_now_micros();
        for item in batch {
            if let LedgerItem::Receipt(r) = item {
                if let Some(commit) = r.commit_lsn.and_then(|l| t.get(&l.0)) {
                    self.commit_to_receipt
                        .observe((now - commit).max(0) as f64 / 1e6);
                }
            }
        }
    }

    /// The ledger checkpoint moved to `lsn`: every transaction that committed before it is
    /// fully resolved, so its commit time is no longer needed.
    pub fn checkpoint(&self, lsn: Lsn) {
        self.checkpoint_lsn
            .set(i64::try_from(lsn.0).unwrap_or(i64::MAX));
        if let Ok(mut t) = self.commit_times.lock() {
            *t = t.split_off(&lsn.0);
        }
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
        "outboxd_unclear_events",
        "outboxd_waiting_on_unclear_events",
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
        let _relay = m.give_every_family_a_series("d", "s");
        let text = m.render();
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| l.split(' ').next().unwrap())
            .collect();
        assert_eq!(families.len(), 25, "{text}");
        assert!(families.iter().all(|f| f.starts_with("outboxd_")));
        // The families the operations guide promises (docs/operations.md).
        for f in REQUIRED_FAMILIES {
            assert!(families.contains(f), "{f} missing");
        }
        // Every sample but the broker's and the sampler's error count names its database.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            assert!(
                l.contains("database=\"")
                    || l.starts_with("outboxd_broker_reachable")
                    || l.starts_with("outboxd_sampler_errors_total"),
                "{l}"
            );
        }
    }

    #[test]
    fn readiness_names_each_database_without_a_streaming_slot() {
        let m = Metrics::new();
        m.broker_reachable.set(1);
        let orders = m.relay("orders", "s1");
        assert_eq!(
            m.readiness(),
            Err("not streaming from the replication slot".into())
        );
        m.expect_database("billing");
        orders.streaming(true);
        assert_eq!(
            m.readiness(),
            Err("not streaming from a replication slot of database billing".into())
        );
        let billing = m.relay("billing", "s1");
        billing.streaming(true);
        assert_eq!(m.readiness(), Ok(()));
        orders.streaming(false);
        m.broker_reachable.set(0);
        assert_eq!(
            m.readiness(),
            Err(
                "not streaming from a replication slot of database orders; broker not reachable"
                    .into()
            )
        );
    }

    #[test]
    fn latency_is_observed_once_per_streamed_receipt_and_forgotten_at_the_checkpoint() {
        let r = get().relay("latency", "s");
        let lsn = Lsn(0xdead_0000);
        r.txn_begin(lsn, pg_now_micros() - 5_000);
        let receipt = |commit_lsn| {
            LedgerItem::Receipt(outbox_ledger::ReceiptRecord {
                event_id: uuid::Uuid::nil(),
                aggregate_version: 1,
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
                change_lsn: None,
                evidence: None,
            })
        };
        r.receipts_accepted(&[receipt(Some(lsn)), receipt(None)]);
        assert_eq!(r.commit_to_receipt.get_sample_count(), 1);
        r.checkpoint(Lsn(lsn.0 + 1));
        assert!(!r.commit_times.lock().unwrap().contains_key(&lsn.0));
    }
}
