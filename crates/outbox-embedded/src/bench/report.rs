//! The bench's output: a table, a JSON file, an SVG chart (latency distribution and
//! throughput over time, drawn with `plotters`), and one last line for scripts:
//! `broker=embedded|apache|external decode_ratio=X drain_events_per_s=Y p99_ms=Z rss_mib=W poll_ratio=V
//! producer_ratio=U debezium_ratio=T` (T: outboxd's drain rate over Debezium's, 0.00 when the
//! Debezium phase did not run).

use std::path::Path;

use anyhow::Context;
use serde_json::json;

use super::{Crash, Latency, Phase, Scenario, Steady};
use crate::cli::{BenchArgs, BenchBroker};

#[derive(Debug, Clone)]
pub(crate) struct VariantResult {
    pub scenario: Scenario,
    pub decode: Phase,
    pub drain: Phase,
    pub rss_peak_mib: f64,
}

/// Everything one run measured.
#[derive(Debug, Clone, Default)]
pub(crate) struct Report {
    pub scenario: Option<Scenario>,
    /// The broker's warm-up before the first measured phase: (messages, seconds), if it ran.
    pub broker_warmup: Option<(u64, f64)>,
    /// Which Kafka the run published to (`--broker` / `--bootstrap-servers`).
    pub broker: String,
    pub rate: f64,
    pub writers: u64,
    pub events_per_txn: u64,
    pub enqueue_events_per_s: f64,
    pub wal_backlog_mib: f64,
    pub decode: Phase,
    pub drain: Phase,
    pub drain_series: Vec<(f64, f64)>,
    /// `--pg-statements`: the drain's statements by execution time (JSON array), else null.
    pub drain_statements: serde_json::Value,
    /// After the drain: (WAL the slot still retained, MiB; seconds until confirmed past it).
    pub catchup: (f64, f64),
    pub steady: Steady,
    pub rss_peak_mib: f64,
    pub crash: Option<Crash>,
    pub kill_loop: Option<super::kill_loop::KillLoop>,
    pub poll_drain: Option<Phase>,
    pub poll_steady: Option<Steady>,
    pub poll_series: Vec<(f64, f64)>,
    pub variants: Vec<VariantResult>,
    /// 1-minute load average sampled at each phase boundary (name, load).
    pub load: Vec<(String, f64)>,
    /// `outbox.enqueue` against a plain outbox INSERT, under pgbench.
    pub producer: Option<super::producer::Producer>,
    /// outboxd's writers wrote plain INSERTs into `outbox.events` (`--writer plain`).
    pub plain_writers: bool,
    /// Debezium on the same workload, or why it did not run.
    pub debezium: Option<super::debezium::Outcome>,
    /// `--fanout`: (kind, N, the N decoders at once): `slots_on_one_database` or `databases`.
    pub fanout: Vec<(String, usize, Phase)>,
    /// `--shard-drain`: (N, the backlog drained by N shard relays).
    pub shard_drain: Vec<(u16, Phase)>,
}

fn phase_json(p: &Phase) -> serde_json::Value {
    json!({
        "events": p.events, "seconds": p.secs, "events_per_s": p.rate,
        "relay_cpu_s": p.relay_cpu_s, "pg_cpu_s": p.pg_cpu_s,
        "relay_cpu_us_per_event": p.relay_us_per_event(),
        "pg_cpu_us_per_event": p.pg_us_per_event(),
        "pg_cpu_us_per_event_by_process": p.pg_cpu_by_role.iter()
            .map(|(r, s)| (r.to_string(), json!(1e6 * s / p.events.max(1) as f64)))
            .collect::<serde_json::Map<_, _>>(),
        "bench_cpu_s": p.bench_cpu_s,
        "bench_cpu_us_per_event": p.bench_us_per_event(),
        "wal_retained_peak_mib": p.wal_retained_peak_mib,
        "autovacuumed_tables": p.autovacuumed,
    })
}

fn latency_json(l: &Latency) -> serde_json::Value {
    json!({
        "count": l.count, "p50_ms": l.p50, "p99_ms": l.p99, "p999_ms": l.p999, "max_ms": l.max,
        "worst_ms_by_commit_time_250ms": l.worst_by_commit_time,
    })
}

fn steady_json(s: &Steady) -> serde_json::Value {
    json!({
        "target_events_per_s": s.target_rate, "achieved_events_per_s": s.achieved_rate,
        "phase": phase_json(&s.phase), "latency": latency_json(&s.latency),
        "rss_steady_mib": s.rss_steady_mib,
        "walsender_unsent_mib_median": s.walsender_unsent_mib.0,
        "walsender_unsent_mib_max": s.walsender_unsent_mib.1,
        "autovacuum_running_s": s.autovacuum_s,
        "checkpoints": s.checkpoints,
    })
}

impl Report {
    pub fn new(main: &Scenario, a: &BenchArgs) -> Report {
        Report {
            scenario: Some(main.clone()),
            broker: broker_label(a),
            rate: a.rate as f64,
            writers: a.writers,
            events_per_txn: a.events_per_txn,
            plain_writers: a.writer == crate::cli::BenchWriter::Plain,
            ..Report::default()
        }
    }

    pub fn decode_ratio(&self) -> f64 {
        self.drain.rate / self.decode.rate.max(f64::MIN_POSITIVE)
    }

    pub fn poll_ratio(&self) -> f64 {
        match &self.poll_drain {
            Some(p) => self.drain.rate / p.rate.max(f64::MIN_POSITIVE),
            None => 0.0,
        }
    }

    /// Debezium's results, when the phase ran.
    pub fn debezium_results(&self) -> Option<&super::debezium::Results> {
        match &self.debezium {
            Some(super::debezium::Outcome::Ran(r)) => Some(r),
            _ => None,
        }
    }

    /// outboxd's drain rate over Debezium's (0 when Debezium did not run).
    pub fn debezium_ratio(&self) -> f64 {
        self.debezium_results().map_or(0.0, |d| {
            self.drain.rate / d.drain.rate.max(f64::MIN_POSITIVE)
        })
    }

    pub fn last_line(&self) -> String {
        format!(
            "broker={} decode_ratio={:.2} drain_events_per_s={:.0} p99_ms={:.1} rss_mib={:.1} poll_ratio={:.2} producer_ratio={:.2} debezium_ratio={:.2}",
            self.broker.split(' ').next().unwrap_or(""),
            self.decode_ratio(),
            self.drain.rate,
            self.steady.latency.p99,
            self.rss_peak_mib,
            self.poll_ratio(),
            self.producer.as_ref().map_or(0.0, |p| p.ratio()),
            self.debezium_ratio()
        )
    }

    /// The "Debezium" table: outboxd's and Debezium's figures of this run side by side.
    fn print_debezium(&self) {
        let Some(outcome) = &self.debezium else {
            return;
        };
        println!("{:-<112}", "");
        let r = match outcome {
            super::debezium::Outcome::NotRun(why) => {
                println!("Debezium: {why}");
                return;
            }
            super::debezium::Outcome::Ran(r) => r,
        };
        println!(
            "Debezium {} beside outboxd (embedded engine, pgoutput, outbox EventRouter; same backlog, rate and broker)",
            super::debezium::DEBEZIUM_VERSION
        );
        println!(
            "{:<52} {:>14} {:>14} {:>10}",
            "", "outboxd", "Debezium", "outboxd/D"
        );
        let line = |name: &str, ours: f64, theirs: f64, prec: usize| {
            println!(
                "{:<52} {:>14.prec$} {:>14.prec$} {:>9.2}x",
                name,
                ours,
                theirs,
                ours / theirs.max(f64::MIN_POSITIVE)
            );
        };
        line(
            &format!("drain of {} events, events/s", r.drain.events),
            self.drain.rate,
            r.drain.rate,
            0,
        );
        line(
            "drain: relay CPU µs/event (Debezium: the JVM)",
            self.drain.relay_us_per_event(),
            r.drain.relay_us_per_event(),
            1,
        );
        line(
            "drain: PostgreSQL CPU µs/event",
            self.drain.pg_us_per_event(),
            r.drain.pg_us_per_event(),
            1,
        );
        println!(
            "  by process: outboxd: {}; Debezium: {}",
            self.drain.pg_us_per_event_by_role(),
            r.drain.pg_us_per_event_by_role()
        );
        println!(
            "  autovacuum worked on: outboxd: {}; Debezium: {}",
            self.drain.autovacuumed_tables(),
            r.drain.autovacuumed_tables()
        );
        line(
            "steady: achieved events/s",
            self.steady.achieved_rate,
            r.steady.achieved_rate,
            0,
        );
        line(
            "steady p50, ms (outboxd: accepted; Debezium: broker)",
            self.steady.latency.p50,
            r.steady.latency.p50,
            1,
        );
        line(
            "steady p99, ms (outboxd: accepted; Debezium: broker)",
            self.steady.latency.p99,
            r.steady.latency.p99,
            1,
        );
        line(
            "steady: relay CPU µs/event (Debezium: the JVM)",
            self.steady.phase.relay_us_per_event(),
            r.steady.phase.relay_us_per_event(),
            1,
        );
        line(
            "steady: PostgreSQL CPU µs/event (incl. writers)",
            self.steady.phase.pg_us_per_event(),
            r.steady.phase.pg_us_per_event(),
            1,
        );
        line(
            "RSS peak, MiB (Debezium: the JVM's VmHWM)",
            self.rss_peak_mib,
            r.rss_peak_mib,
            1,
        );
        println!(
            "Debezium: first event on the broker {:.1} s after the JVM was spawned ({:.0} events/s from then on); {} duplicates in the drain; steady latency is {}; {} of {} steady events measured",
            r.startup_s,
            r.drain.events as f64 / (r.drain.secs - r.startup_s).max(f64::MIN_POSITIVE),
            r.drain_duplicates,
            r.latency_source,
            r.steady.latency.count,
            r.steady.phase.events
        );
    }

    pub fn print_table(&self) {
        let sc = self.scenario.clone().unwrap_or(Scenario {
            name: String::new(),
            payload: 0,
            aggregates: 0,
            events: 0,
        });
        println!();
        println!(
            "outbox-embedded bench: {} events, payload {} B, {} aggregates; steady {:.0} events/s target ({} writers, {} events per transaction)",
            sc.events, sc.payload, sc.aggregates, self.rate, self.writers, self.events_per_txn
        );
        println!("broker: {}", self.broker);
        println!("{:-<112}", "");
        println!(
            "{:<34} {:>11} {:>8} {:>12} {:>10} {:>12} {:>20}",
            "phase", "events/s", "seconds", "relay µs/ev", "PG µs/ev", "bench+broker", "note"
        );
        let row = |name: &str, p: &Phase, note: String| {
            println!(
                "{:<34} {:>11.0} {:>8.2} {:>12.1} {:>10.1} {:>12.1} {:>20}",
                name,
                p.rate,
                p.secs,
                p.relay_us_per_event(),
                p.pg_us_per_event(),
                p.bench_us_per_event(),
                note
            );
        };
        println!(
            "{:<34} {:>12.0}",
            if self.plain_writers {
                "write backlog (outbox.events INSERT)"
            } else {
                "enqueue backlog (outbox.enqueue)"
            },
            self.enqueue_events_per_s
        );
        if let Some(p) = &self.producer {
            let q = &p.prepared;
            for (what, side, ratio) in [
                ("outbox.enqueue", &p.enqueue, Some(p.ratio())),
                (
                    "outbox.enqueue, relay numbers",
                    &p.enqueue_by_relay,
                    Some(p.by_relay_ratio()),
                ),
                (
                    "outbox.events INSERT",
                    &p.fast_path,
                    Some(p.fast_path_ratio()),
                ),
                ("plain INSERT", &p.plain, None),
                ("outbox.enqueue, prep.", &q.enqueue, Some(q.ratio())),
                (
                    "outbox.enqueue, relay numbers, prep.",
                    &q.enqueue_by_relay,
                    Some(q.by_relay_ratio()),
                ),
                (
                    "outbox.events INSERT, prep.",
                    &q.fast_path,
                    Some(q.fast_path_ratio()),
                ),
                ("plain INSERT, prep.", &q.plain, None),
            ] {
                println!(
                    "{:<34} {:>11.0} {:>8.2} {:>12} {:>10.1} {:>12} {:>20}",
                    format!("producer: {what} ({} cl.)", p.clients),
                    side.tps,
                    p.secs,
                    "-",
                    side.pg_cpu_us_per_event,
                    "-",
                    ratio.map_or(String::new(), |r| format!("{r:.2}x plain INSERT"))
                );
            }
        }
        row("decode limit (pg_recvlogical)", &self.decode, String::new());
        row(
            "relay drain (confirmed LSN)",
            &self.drain,
            format!("{:.2}x decode", self.decode_ratio()),
        );
        if let Some(p) = &self.poll_drain {
            row(
                &format!("polling relay drain ({} events)", p.events),
                p,
                format!("relay {:.2}x", self.poll_ratio()),
            );
        }
        row(
            "relay steady (PG incl. writers)",
            &self.steady.phase,
            format!("{:.0}/s achieved", self.steady.achieved_rate),
        );
        if let Some(s) = &self.poll_steady {
            row(
                "polling steady (PG incl. writers)",
                &s.phase,
                format!("{:.0}/s achieved", s.achieved_rate),
            );
        }
        println!("{:-<112}", "");
        println!(
            "{:<34} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "commit -> accepted latency (ms)", "events", "p50", "p99", "p99.9", "max"
        );
        let lat = |name: &str, l: &Latency| {
            println!(
                "{:<34} {:>10} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                name, l.count, l.p50, l.p99, l.p999, l.max
            );
        };
        lat("relay", &self.steady.latency);
        println!(
            "{:<34} median {:.2} MiB, max {:.2} MiB of WAL written but not yet sent by the relay's walsender",
            "  (PostgreSQL decoding behind by)",
            self.steady.walsender_unsent_mib.0,
            self.steady.walsender_unsent_mib.1
        );
        println!(
            "{:<34} autovacuum ran during {:.1} s of it; {} checkpoint(s) started",
            "  (background work meanwhile)", self.steady.autovacuum_s, self.steady.checkpoints
        );
        if let Some(s) = &self.poll_steady {
            lat("polling relay (published_at)", &s.latency);
        }
        println!("{:-<112}", "");
        println!(
            "relay RSS: peak {:.1} MiB (drain + steady), steady {:.1} MiB;  WAL retained: backlog {:.1} MiB, steady peak {:.1} MiB",
            self.rss_peak_mib,
            self.steady.rss_steady_mib,
            self.wal_backlog_mib,
            self.steady.phase.wal_retained_peak_mib
        );
        println!(
            "at the end of the drain the slot retained {:.0} MiB of WAL; the relay confirmed past the WAL its own ledger wrote meanwhile {:.1} s later",
            self.catchup.0, self.catchup.1
        );
        for (n, p) in &self.shard_drain {
            println!(
                "sharded drain: {n} shard relay(s): {:.0} events/s, {:.1} s, relays' CPU {:.1} s, PostgreSQL CPU {:.1} s",
                p.rate, p.secs, p.relay_cpu_s, p.pg_cpu_s
            );
        }
        for (kind, n, p) in &self.fanout {
            let what = if kind == "databases" {
                format!("{n} databases, one slot each (1/{n} of the backlog each)")
            } else {
                format!("{n} row-filtered slots on one database (each decodes all of its WAL)")
            };
            println!(
                "fan-out: {what}: {:.0} events/s delivered in all, {:.1} s, PostgreSQL CPU {:.1} s ({:.0} us/event)",
                p.rate,
                p.secs,
                p.pg_cpu_s,
                p.pg_us_per_event()
            );
        }
        if let Some(c) = &self.crash {
            println!(
                "SIGKILL under {:.0} events/s: {} of {} events re-published on restart = {:.0} ms of traffic; caught up {:.1} s after the kill",
                c.rate, c.republished, c.produced, c.republished_ms, c.recovery_s
            );
            println!(
                "takeover by a restarted relay (another relay id): lease held {:.0} ms, first receipt {} after the kill",
                c.takeover_ms,
                c.first_receipt_ms.map_or(
                    "- (nothing was left to publish: the kill came after the last event's receipt)".to_string(),
                    |ms| format!("{ms:.0} ms")
                )
            );
        }
        if let Some(k) = &self.kill_loop {
            let moved: Vec<String> = k.advanced.iter().map(|b| format!("{b}")).collect();
            println!(
                "kill loop ({} aggregates, SIGKILL every {:.1} s): {} of {} restarted runs moved the checkpoint (bytes per run: {}); {} extra copies of {} events; caught up {:.1} s after the last kill",
                k.aggregates,
                k.every_s,
                k.moved(),
                k.advanced.len(),
                moved.join(", "),
                k.republished,
                k.produced,
                k.recovery_s
            );
        }
        if !self.load.is_empty() {
            let loads: Vec<String> = self
                .load
                .iter()
                .map(|(phase, l)| format!("{phase} {l:.1}"))
                .collect();
            println!(
                "machine load average (1 min; {} CPUs) at: {}",
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(0),
                loads.join(", ")
            );
        }
        // Where PostgreSQL's CPU went: the walsender decoding, the relay's own sessions (the
        // acceptance), or the background (autovacuum after a large load, the checkpointer).
        println!(
            "PostgreSQL CPU µs/event by process: decode limit: {}; relay drain: {} (autovacuum worked on: {})",
            self.decode.pg_us_per_event_by_role(),
            self.drain.pg_us_per_event_by_role(),
            self.drain.autovacuumed_tables()
        );
        self.print_debezium();
        if !self.variants.is_empty() {
            println!("{:-<112}", "");
            println!(
                "{:<24} {:>9} {:>12} {:>12} {:>8} {:>12} {:>10}",
                "variant", "events", "decode/s", "drain/s", "ratio", "relay µs/ev", "RSS MiB"
            );
            for v in &self.variants {
                println!(
                    "{:<24} {:>9} {:>12.0} {:>12.0} {:>8.2} {:>12.1} {:>10.1}",
                    format!("{} B, {} aggs", v.scenario.payload, v.scenario.aggregates),
                    v.scenario.events,
                    v.decode.rate,
                    v.drain.rate,
                    v.drain.rate / v.decode.rate.max(f64::MIN_POSITIVE),
                    v.drain.relay_us_per_event(),
                    v.rss_peak_mib
                );
            }
        }
        println!();
    }

    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "scenario": self.scenario.as_ref().map(|s| json!({
                "events": s.events, "payload_bytes": s.payload, "aggregates": s.aggregates,
            })),
            "broker": self.broker,
            "broker_warmup": self.broker_warmup.map(|(n, s)| json!({"messages": n, "seconds": s})),
            "machine_cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "enqueue_events_per_s": self.enqueue_events_per_s,
            "writer": if self.plain_writers { "plain INSERT into outbox.events" } else { "outbox.enqueue" },
            "producer": self.producer.as_ref().map(|p| json!({
                "clients": p.clients, "aggregates": p.aggregates, "seconds_per_run": p.secs,
                "enqueue_tps": p.enqueue.tps, "plain_insert_tps": p.plain.tps,
                "enqueue_over_plain": p.ratio(),
                "enqueue_pg_cpu_us_per_event": p.enqueue.pg_cpu_us_per_event,
                "plain_insert_pg_cpu_us_per_event": p.plain.pg_cpu_us_per_event,
                "fast_path_tps": p.fast_path.tps, "fast_path_over_plain": p.fast_path_ratio(),
                "fast_path_pg_cpu_us_per_event": p.fast_path.pg_cpu_us_per_event,
                "enqueue_by_relay_tps": p.enqueue_by_relay.tps,
                "enqueue_by_relay_over_plain": p.by_relay_ratio(),
                "enqueue_by_relay_pg_cpu_us_per_event": p.enqueue_by_relay.pg_cpu_us_per_event,
                "prepared": {
                    "enqueue_tps": p.prepared.enqueue.tps, "plain_insert_tps": p.prepared.plain.tps,
                    "fast_path_tps": p.prepared.fast_path.tps,
                    "enqueue_over_plain": p.prepared.ratio(),
                    "fast_path_over_plain": p.prepared.fast_path_ratio(),
                    "enqueue_pg_cpu_us_per_event": p.prepared.enqueue.pg_cpu_us_per_event,
                    "plain_insert_pg_cpu_us_per_event": p.prepared.plain.pg_cpu_us_per_event,
                    "fast_path_pg_cpu_us_per_event": p.prepared.fast_path.pg_cpu_us_per_event,
                    "enqueue_by_relay_tps": p.prepared.enqueue_by_relay.tps,
                    "enqueue_by_relay_over_plain": p.prepared.by_relay_ratio(),
                    "enqueue_by_relay_pg_cpu_us_per_event": p.prepared.enqueue_by_relay.pg_cpu_us_per_event,
                },
            })),
            "wal_retained_backlog_mib": self.wal_backlog_mib,
            "decode_limit": phase_json(&self.decode),
            "drain": phase_json(&self.drain),
            "drain_series": self.drain_series,
            "drain_statements": self.drain_statements,
            "after_drain_wal_retained_mib": self.catchup.0,
            "after_drain_catch_up_s": self.catchup.1,
            "steady": steady_json(&self.steady),
            "rss_peak_mib": self.rss_peak_mib,
            "shard_drain": self.shard_drain.iter().map(|(n, p)| json!({
                "shards": n, "drain": phase_json(p),
            })).collect::<Vec<_>>(),
            "fanout": self.fanout.iter().map(|(kind, n, p)| json!({
                "kind": kind, "n": n, "decode": phase_json(p),
            })).collect::<Vec<_>>(),
            "crash": self.crash.as_ref().map(|c| json!({
                "events_per_s": c.rate, "produced": c.produced, "republished": c.republished,
                "republished_ms_of_traffic": c.republished_ms, "caught_up_s": c.recovery_s,
                "takeover_ms": c.takeover_ms, "first_receipt_ms": c.first_receipt_ms,
            })),
            "kill_loop": self.kill_loop.as_ref().map(|k| json!({
                "aggregates": k.aggregates, "every_s": k.every_s,
                "checkpoint_advance_bytes_per_run": k.advanced, "runs_that_moved": k.moved(),
                "produced": k.produced, "republished": k.republished, "caught_up_s": k.recovery_s,
            })),
            "polling": self.poll_drain.as_ref().map(|d| json!({
                "drain": phase_json(d),
                "steady": self.poll_steady.as_ref().map(steady_json),
                "drain_series": self.poll_series,
            })),
            "load_average_1m": self.load,
            "variants": self.variants.iter().map(|v| json!({
                "payload_bytes": v.scenario.payload, "aggregates": v.scenario.aggregates,
                "events": v.scenario.events, "decode_limit": phase_json(&v.decode),
                "drain": phase_json(&v.drain), "rss_peak_mib": v.rss_peak_mib,
                "decode_ratio": v.drain.rate / v.decode.rate.max(f64::MIN_POSITIVE),
            })).collect::<Vec<_>>(),
            "debezium": self.debezium.as_ref().map(|o| match o {
                super::debezium::Outcome::NotRun(why) => json!({
                    "ran": false, "not_run": why,
                }),
                super::debezium::Outcome::Ran(r) => json!({
                    "ran": true,
                    "version": super::debezium::DEBEZIUM_VERSION,
                    "drain": phase_json(&r.drain),
                    "startup_s": r.startup_s,
                    "drain_events_per_s_after_startup":
                        r.drain.events as f64 / (r.drain.secs - r.startup_s).max(f64::MIN_POSITIVE),
                    "drain_duplicates": r.drain_duplicates,
                    "steady": steady_json(&r.steady),
                    "latency_measured_as": r.latency_source,
                    "rss_peak_mib": r.rss_peak_mib,
                    "settings": r.settings.iter()
                        .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                        .collect::<serde_json::Map<_, _>>(),
                    "outboxd_over_debezium": {
                        "drain_events_per_s": self.debezium_ratio(),
                        "steady_p99": self.steady.latency.p99 / r.steady.latency.p99.max(f64::MIN_POSITIVE),
                        "drain_pg_cpu_per_event": self.drain.pg_us_per_event() / r.drain.pg_us_per_event().max(f64::MIN_POSITIVE),
                        "rss_peak": self.rss_peak_mib / r.rss_peak_mib.max(f64::MIN_POSITIVE),
                    },
                }),
            }),
            "summary": {
                "decode_ratio": self.decode_ratio(),
                "drain_events_per_s": self.drain.rate,
                "p99_ms": self.steady.latency.p99,
                "rss_mib": self.rss_peak_mib,
                "poll_ratio": self.poll_ratio(),
                "debezium_ratio": self.debezium_ratio(),
            },
        })
    }

    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(&self.to_json())?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }

    /// Two panels: commit -> accepted latency distribution (CDF, log scale) of the relay and
    /// the polling relay; events per second over time while each drains the backlog, with
    /// `pg_recvlogical`'s average rate as a reference line.
    pub fn write_svg(&self, path: &Path) -> anyhow::Result<()> {
        use plotters::prelude::*;
        let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
        let root = SVGBackend::new(path, (1100, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let (left, right) = root.split_horizontally(550);
        let relay_color = RGBColor(31, 119, 180);
        let poll_color = RGBColor(214, 39, 40);
        let decode_color = RGBColor(90, 90, 90);

        let mut series: Vec<(&str, &Latency, RGBColor)> =
            vec![("outboxd (CDC)", &self.steady.latency, relay_color)];
        if let Some(p) = &self.poll_steady {
            series.push(("polling relay", &p.latency, poll_color));
        }
        let max_ms = series
            .iter()
            .map(|s| s.1.max)
            .fold(1.0f64, f64::max)
            .max(1.0)
            * 1.2;
        let min_ms = series
            .iter()
            .filter_map(|s| s.1.cdf.first().map(|p| p.0))
            .fold(max_ms, f64::min)
            .max(0.1);
        let mut chart = ChartBuilder::on(&left)
            .caption(
                format!(
                    "commit -> accepted receipt at {:.0} events/s",
                    self.steady.achieved_rate
                ),
                ("sans-serif", 16),
            )
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d((min_ms * 0.8..max_ms).log_scale(), 0f64..1f64)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("latency (ms, log scale)")
            .y_desc("fraction of events")
            .draw()
            .map_err(|e| err(&e))?;
        for (name, lat, color) in series {
            chart
                .draw_series(LineSeries::new(
                    lat.cdf.iter().map(|&(ms, f)| (ms.max(min_ms * 0.8), f)),
                    color.stroke_width(2),
                ))
                .map_err(|e| err(&e))?
                .label(format!(
                    "{name}: p50 {:.1} / p99 {:.1} / p99.9 {:.1} ms",
                    lat.p50, lat.p99, lat.p999
                ))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;

        let max_t = self
            .drain_series
            .iter()
            .chain(self.poll_series.iter())
            .map(|p| p.0 + 0.5)
            .fold(1.0f64, f64::max);
        let max_rate = self
            .drain_series
            .iter()
            .chain(self.poll_series.iter())
            .map(|p| p.1)
            .fold(self.decode.rate, f64::max)
            * 1.15;
        let mut chart = ChartBuilder::on(&right)
            .caption(
                format!(
                    "draining a backlog of {} events",
                    self.scenario.as_ref().map(|s| s.events).unwrap_or(0)
                ),
                ("sans-serif", 16),
            )
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..max_t, 0f64..max_rate.max(1.0))
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("seconds since start")
            .y_desc("events/s")
            .draw()
            .map_err(|e| err(&e))?;
        let step = |s: &[(f64, f64)]| -> Vec<(f64, f64)> {
            s.iter()
                .flat_map(|&(t, r)| [(t, r), (t + 0.5, r)])
                .collect()
        };
        chart
            .draw_series(LineSeries::new(
                step(&self.drain_series),
                relay_color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(format!("outboxd: {:.0} events/s", self.drain.rate))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], relay_color));
        if let Some(p) = &self.poll_drain {
            chart
                .draw_series(LineSeries::new(
                    step(&self.poll_series),
                    poll_color.stroke_width(2),
                ))
                .map_err(|e| err(&e))?
                .label(format!("polling relay: {:.0} events/s", p.rate))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], poll_color));
        }
        chart
            .draw_series(LineSeries::new(
                [(0.0, self.decode.rate), (max_t, self.decode.rate)],
                decode_color.stroke_width(1),
            ))
            .map_err(|e| err(&e))?
            .label(format!("pg_recvlogical: {:.0} events/s", self.decode.rate))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], decode_color));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
        Ok(())
    }
}

/// What `--broker` / `--bootstrap-servers` chose, for the table, the JSON and the last line
/// (its first word: `embedded`, `apache` or `external`).
fn broker_label(a: &BenchArgs) -> String {
    match (&a.bootstrap_servers, a.broker) {
        (Some(b), _) => format!("external Kafka at {b}"),
        (None, BenchBroker::Embedded) => {
            "embedded (librdkafka's mock cluster in the bench process)".into()
        }
        (None, BenchBroker::Apache) => format!(
            "apache (Apache Kafka {} KRaft, 1 node started by the bench, -Xmx512m)",
            outbox_testkit::apache_kafka::KAFKA_VERSION
        ),
    }
}
