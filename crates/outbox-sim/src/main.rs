//! `outbox-sim`: runs seeded fault traces through outboxd's real protocol logic and prints the
//! invariant counts. Exit status 1 when any invariant was violated (with the seed and trace
//! numbers that reproduce it), 2 on bad arguments.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use outbox_sim::{run_range, run_trace, Counts, Mutant};

/// Deterministic simulation of outboxd: producers, WAL and slot, relay incarnations with
/// leases, a faulty broker, consumers with an inbox, the reconciler and purge, and fleets of
/// relays over several shards that join, die and pause — driving the real outbox-core logic
/// (ack tracker, ordering gate, digests, receipt acceptance, UNKNOWN resolution, migration
/// rule), the relay's pipeline core, the fleet plan and the real slot start-up plan.
///
/// The last line printed is the release-gate summary:
/// `traces=N lost=0 second_ids=0 cross_destination_retries=0 duplicate_effects=0
/// late_ack_convergence=100.00% unknown_untraced=0 stalls=0 unclear_restarts=0
/// fleet_unserved=0 fleet_share_not_returned=0
/// resent_after_proof=0`.
#[derive(Debug, Parser)]
#[command(name = "outbox-sim", version)]
struct Args {
    /// Number of traces to run (the release gate is 1,000,000).
    #[arg(long, default_value_t = 10_000)]
    traces: u64,
    /// Seed of the run; trace i's generator derives from (seed, i) alone.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Replay only this trace, printing its event log.
    #[arg(long)]
    trace: Option<u64>,
    /// Run a deliberately broken variant, to see the simulator catch it. One of:
    /// confirm-before-accept, skip-dedup, retry-reresolves-route, no-settle, last-ack-wins,
    /// migrate-while-unknown, purge-early, producer-new-id, second-in-flight,
    /// deep-without-gapless, deep-before-hand-over,
    /// ok-without-offset-is-proof, poll-offers-skipped, early-takeover-of-live-holder,
    /// lease-from-answer, idle-checkpoint-never-due, held-slot-unchecked,
    /// unclear-never-due, route-ignores-cluster, numbering-not-kept; or the product as it was before a bug the simulator found was fixed:
    /// bug-poison-before-gate, bug-unknown-only-at-start, bug-stale-quarantine,
    /// bug-migrate-replayable, bug-proof-after-migration, bug-snapshot-gap, poll-above-head,
    /// poll-migrate-held, poll-stale-head, poll-purge-held, bug-republish-skipped,
    /// bug-end-run-on-unclear, bug-superseded-refusal, bug-numbering-log-not-folded
    /// (docs/simulation.md).
    #[arg(long)]
    mutant: Option<String>,
    /// Worker threads; each trace runs single-threaded and alone, so the counts do not depend
    /// on this.
    #[arg(long, default_value_t = 2)]
    threads: u64,
}

fn print_counts(c: &Counts) {
    for (name, value) in c.lines() {
        println!("{name:<32} {value}");
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mutant = match args.mutant.as_deref() {
        None => None,
        Some(name) => match Mutant::parse(name) {
            Some(m) => Some(m),
            None => {
                let names: Vec<&str> = Mutant::ALL.iter().map(|(n, _)| *n).collect();
                eprintln!(
                    "unknown --mutant {name:?}; choose one of: {}",
                    names.join(", ")
                );
                return ExitCode::from(2);
            }
        },
    };

    if let Some(k) = args.trace {
        let r = run_trace(args.seed, k, mutant, true);
        for line in &r.log {
            println!("{line}");
        }
        println!();
        print_counts(&r.counts);
        println!("{}", r.counts.summary());
        return if r.counts.violations() > 0 {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        };
    }

    let started = Instant::now();
    let threads = args.threads.clamp(1, 64);
    let chunk = args.traces.div_ceil(threads);
    let results: Vec<(Counts, Vec<(u64, Counts)>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let from = (t * chunk).min(args.traces);
                let to = ((t + 1) * chunk).min(args.traces);
                s.spawn(move || {
                    let mut bad = Vec::new();
                    let total = run_range(args.seed, from..to, mutant, |i, c| {
                        if bad.len() < 20 {
                            bad.push((i, c.clone()));
                        }
                    });
                    (total, bad)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("simulation thread panicked"))
            .collect()
    });
    let mut total = Counts::default();
    let mut bad = Vec::new();
    for (c, b) in results {
        total.add(&c);
        bad.extend(b);
    }
    bad.sort_by_key(|(i, _)| *i);
    print_counts(&total);
    println!(
        "{:<32} {:.1} s ({} threads)",
        "wall_time",
        started.elapsed().as_secs_f64(),
        threads
    );
    let failed = total.violations() > 0;
    if failed {
        for (i, c) in bad.iter().take(10) {
            println!(
                "VIOLATION seed={} trace={i}: {} — replay: outbox-sim --seed {} --trace {i}{}",
                args.seed,
                c.summary(),
                args.seed,
                args.mutant
                    .as_deref()
                    .map(|m| format!(" --mutant {m}"))
                    .unwrap_or_default()
            );
        }
    }
    println!("{}", total.summary());
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
