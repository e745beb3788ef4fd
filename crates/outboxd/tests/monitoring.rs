//! The shipped alert rules and Grafana dashboard (`docs/monitoring/`) against Prometheus's own
//! checker and against the metrics outboxd exports: a rule or panel that names a metric the
//! relay does not export, an expression Prometheus cannot parse, or an alert that does not
//! fire on the series it is written for fails here.
//!
//! Needs `promtool` (Debian's `prometheus` package; `.ci/run` installs it): without it the
//! tests fail and say so.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/monitoring")
}

fn promtool(args: &[&str], cwd: &std::path::Path) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap_or_else(|e| {
            panic!("promtool could not be run ({e}): install Debian's `prometheus` package (apt-get install --no-install-recommends prometheus; .ci/run does)")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

/// Every `outboxd_*` metric family the relay exports (every labelled family given a series).
fn exported_families() -> BTreeSet<String> {
    let m = outboxd::metrics::get();
    let _relay = m.give_every_family_a_series("d", "s");
    m.render()
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap().to_string())
        .collect()
}

/// The `outboxd_*` names in `text`, histogram series suffixes stripped.
fn named_metrics(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("outboxd_") {
        let name: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[i + name.len()..];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name);
        out.insert(family.to_string());
    }
    out
}

fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string(dir().join("outboxd-dashboard.json")).unwrap();
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

fn dashboard_exprs() -> Vec<String> {
    let d = dashboard();
    d["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| {
            t["expr"]
                .as_str()
                .expect("every target has an expr")
                .to_string()
        })
        .collect()
}

#[test]
fn the_alert_rules_parse_and_each_alert_fires_only_when_it_should() {
    let out = promtool(&["check", "rules", "outboxd.rules.yml"], &dir());
    assert!(out.contains("SUCCESS"), "{out}");
    let out = promtool(&["test", "rules", "outboxd.rules.test.yml"], &dir());
    assert!(out.contains("SUCCESS"), "{out}");
    // Every alert has a case where it fires and one where it does not.
    let rules = std::fs::read_to_string(dir().join("outboxd.rules.yml")).unwrap();
    let tests = std::fs::read_to_string(dir().join("outboxd.rules.test.yml")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 11, "{alerts:?}");
    for a in alerts {
        let cases = tests.matches(&format!("alertname: {a}")).count();
        assert!(
            cases >= 2,
            "{a}: {cases} test case(s), want a firing and a silent one"
        );
    }
}

#[test]
fn rules_and_panels_name_only_exported_metrics() {
    let exported = exported_families();
    let rules = std::fs::read_to_string(dir().join("outboxd.rules.yml")).unwrap();
    let mut named = named_metrics(&rules);
    for e in dashboard_exprs() {
        named.extend(named_metrics(&e));
    }
    let unknown: Vec<_> = named.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "named but not exported: {unknown:?}; exported: {exported:?}"
    );
    // What an operator must see: lag, retained WAL, pending age, UNKNOWN, quarantine, churn.
    for must in [
        "outboxd_replication_lag_bytes",
        "outboxd_slot_retained_wal_bytes",
        "outboxd_oldest_pending_age_seconds",
        "outboxd_unknown_attempts",
        "outboxd_quarantined_events",
        "outboxd_lease_generation",
    ] {
        assert!(named.contains(must), "{must} is in no rule or panel");
    }
}

#[test]
fn every_dashboard_query_is_valid_promql() {
    // Each panel query as a recording rule: promtool parses it as Prometheus would.
    let tmp = tempfile::tempdir().unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let exprs = dashboard_exprs();
    assert!(exprs.len() >= 12, "{exprs:?}");
    for (i, e) in exprs.iter().enumerate() {
        rules.push_str(&format!(
            "      - record: outboxd_dashboard_query_{i}\n        expr: {}\n",
            serde_json::to_string(e).unwrap()
        ));
    }
    std::fs::write(tmp.path().join("dashboard.rules.yml"), rules).unwrap();
    let out = promtool(&["check", "rules", "dashboard.rules.yml"], tmp.path());
    assert!(
        out.contains(&format!("{} rules found", exprs.len())),
        "{out}"
    );
    let d = dashboard();
    assert_eq!(d["uid"], "outboxd");
    assert!(d["__inputs"][0]["name"] == "DS_PROMETHEUS");
}
