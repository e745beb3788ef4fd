//! `outbox-embedded bench` in a tiny configuration: it proves the tool runs every phase and prints
//! its summary line with parseable numbers. Nothing here asserts anything about speed.

use std::process::Command;

#[test]
fn bench_tiny_configuration_prints_a_parseable_summary_json_and_svg() {
    tiny_bench(&[], "embedded");
}

/// The same phases on real Apache Kafka: a node the bench starts itself (`--broker apache`),
/// and the Debezium phase, which runs by default on a real Kafka (its Java main is built with
/// Maven into ~/.cache/outboxd the first time).
#[test]
fn bench_tiny_configuration_runs_every_phase_on_apache_kafka() {
    tiny_bench(&["--broker", "apache"], "apache");
}

fn tiny_bench(extra: &[&str], broker: &str) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let svg = dir.path().join("bench.svg");
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-embedded"))
        .args(["bench", "--events", "2000", "--aggregates", "500"])
        .args(["--steady-secs", "1", "--rate", "1000", "--crash-secs", "1"])
        .args(["--variants", "1024x50", "--variant-events", "500"])
        .args(["--producer-secs", "1"])
        // Two restarts prove the loop (each must move the checkpoint); the default six cost
        // the suite 8 s more.
        .args(["--kill-restarts", "2"])
        // The warm-up's default (500,000 messages) would be most of the apache run.
        .args(["--broker-warmup-events", "20000"])
        .args(extra)
        .arg("--json")
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .env_remove("OUTBOXD_DATABASE_URL")
        .env_remove("OUTBOXD_BOOTSTRAP_SERVERS")
        .output()
        .expect("run outbox-embedded bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "outbox-embedded bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    let keys = [
        "broker",
        "decode_ratio",
        "drain_events_per_s",
        "p99_ms",
        "rss_mib",
        "poll_ratio",
        "producer_ratio",
        "debezium_ratio",
    ];
    let fields: Vec<(&str, &str)> = last
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .collect();
    assert_eq!(
        fields.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
        keys,
        "last line: {last}"
    );
    assert_eq!(fields[0].1, broker, "last line: {last}");
    let unparseable: Vec<_> = fields[1..]
        .iter()
        .filter(|(_, v)| !v.parse::<f64>().is_ok_and(f64::is_finite))
        .collect();
    assert!(unparseable.is_empty(), "last line: {last}");
    let debezium_ratio: f64 = fields
        .iter()
        .find(|(k, _)| *k == "debezium_ratio")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(f64::NAN);
    // Every event of the tiny backlog was drained and measured.
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(
        v["broker"].as_str().unwrap_or_default().starts_with(broker),
        "{}",
        v["broker"]
    );
    assert_eq!(v["drain"]["events"], 2000);
    // A JVM broker is warmed before anything is measured on it; the embedded one is not a JVM.
    if broker == "apache" {
        assert_eq!(
            v["broker_warmup"]["messages"], 20000,
            "{}",
            v["broker_warmup"]
        );
    } else {
        assert!(v["broker_warmup"].is_null(), "{}", v["broker_warmup"]);
    }
    assert_eq!(
        v["kill_loop"]["checkpoint_advance_bytes_per_run"]
            .as_array()
            .map(|a| a.len()),
        Some(2),
        "kill loop: {}",
        v["kill_loop"]
    );
    assert_eq!(v["variants"].as_array().map(|a| a.len()), Some(1));
    assert!(v["steady"]["latency"]["count"].as_u64().unwrap_or(0) > 0);
    // The producer phase ran its sides and measured PostgreSQL's CPU for each.
    for key in [
        "enqueue_tps",
        "plain_insert_tps",
        "enqueue_by_relay_tps",
        "enqueue_pg_cpu_us_per_event",
        "plain_insert_pg_cpu_us_per_event",
        "enqueue_by_relay_pg_cpu_us_per_event",
    ] {
        assert!(
            v["producer"][key].as_f64().unwrap_or(0.0) > 0.0,
            "producer.{key}: {}",
            v["producer"]
        );
    }
    // Debezium ran beside outboxd on a real Kafka, every event of its backlog and of its
    // steady phase measured; on the embedded broker it says why it did not run.
    let dbz = &v["debezium"];
    if broker == "apache" {
        assert_eq!(dbz["ran"], true, "debezium: {dbz}");
        assert_eq!(dbz["drain"]["events"], 2000, "debezium: {dbz}");
        assert_eq!(dbz["drain_duplicates"], 0, "debezium: {dbz}");
        let steady = dbz["steady"]["phase"]["events"].as_u64().unwrap_or(0);
        assert!(steady > 0, "debezium: {dbz}");
        assert_eq!(
            dbz["steady"]["latency"]["count"].as_u64(),
            Some(steady),
            "debezium: {dbz}"
        );
        assert!(
            dbz["latency_measured_as"]
                .as_str()
                .is_some_and(|s| s.starts_with("commit -> LogAppendTime")),
            "debezium: {dbz}"
        );
        assert!(dbz["rss_peak_mib"].as_f64().unwrap_or(0.0) > 0.0, "{dbz}");
        assert!(debezium_ratio > 0.0, "last line: {last}");
    } else {
        assert_eq!(dbz["ran"], false, "debezium: {dbz}");
        assert!(
            dbz["not_run"]
                .as_str()
                .is_some_and(|s| s.contains("--broker apache")),
            "debezium: {dbz}"
        );
        assert_eq!(debezium_ratio, 0.0, "last line: {last}");
        assert!(stdout.contains("Debezium: not run"), "{stdout}");
    }
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(
        chart.starts_with("<svg") && chart.contains("polyline"),
        "{chart:.200}"
    );
}
