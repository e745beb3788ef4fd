//! Values the command line, the config file and the commands share: the enums a flag or a
//! config key can take and the parsers of `KEY=VALUE` and durations.
//!
//! A leaf module (it imports nothing from the crate), so that `cli` (the flags), `config`
//! (the file and the merged settings) and the commands depend on it, never on each other in a
//! circle.

use std::time::Duration;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Which broker the relay publishes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SinkKind {
    /// Kafka through librdkafka (idempotent producer, acks=all).
    Kafka,
    /// NATS JetStream (Nats-Msg-Id = event id, PubAck = receipt).
    Nats,
    /// HTTP endpoints (webhooks): event id = idempotency key, a 2xx answer = receipt.
    Http,
}

/// Where the relay finds new outbox events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum RunMode {
    /// Logical replication (pgoutput): commit order, milliseconds, no polling load. Needs
    /// wal_level=logical and the REPLICATION privilege.
    #[default]
    Cdc,
    /// Short polling queries for events without a receipt, for databases where logical
    /// replication is not allowed: the same ledger, receipts, ordering and commands; latency
    /// about --poll-interval, plus a query per round that grows with the number of aggregates.
    Poll,
}

/// What a Kafka relay promises about copies (docs/exactly_once.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Delivery {
    /// Every event reaches the broker at least once, in order per aggregate; after a crash
    /// what the broker acknowledged and the ledger had not accepted is sent again (recorded as
    /// duplicate receipts), and consumers deduplicate with the inbox.
    #[default]
    AtLeastOnce,
    /// Kafka only, CDC only: each batch is one Kafka transaction with its record in the
    /// positions topic; a consumer reading with `isolation.level=read_committed` sees every
    /// event once, whatever crashed. Needs the positions topic (`positions_topic`) and
    /// transactions on the brokers; rows must carry their own version. The initial snapshot
    /// is still published at least once.
    ExactlyOnce,
}

/// Parses `KEY=VALUE`.
pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))
}

/// Parses `500ms`, `30s`, `5m`, `12h`, `7d` (a bare number is seconds).
/// Share buckets (`outboxd share --buckets`), sorted, without repeats. One value for clap
/// (a `Vec` would be taken for a repeated option).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buckets(pub Vec<i32>);

/// [`Buckets`] from a comma-separated list of buckets and ranges of 0..15, e.g. `0-3,8`.
pub fn parse_buckets(s: &str) -> Result<Buckets, String> {
    let bucket = |t: &str| -> Result<i32, String> {
        match t.trim().parse::<i32>() {
            Ok(b) if (0..16).contains(&b) => Ok(b),
            _ => Err(format!(
                "{t:?} is not a bucket: buckets are 0 to 15 (e.g. 0-3,8)"
            )),
        }
    };
    let mut out = std::collections::BTreeSet::new();
    for part in s.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (bucket(a)?, bucket(b)?);
                if a > b {
                    return Err(format!(
                        "bucket range {part:?} is empty (write it low-high)"
                    ));
                }
                out.extend(a..=b);
            }
            None => {
                out.insert(bucket(part)?);
            }
        }
    }
    Ok(Buckets(out.into_iter().collect()))
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| {
        format!(
            "{s:?} is not a duration: expected a number and a unit, e.g. 500ms, 30s, 5m, 12h, 7d"
        )
    })?;
    let secs = match unit.trim() {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86_400.0,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?}; use ms, s, m, h or d"
            ))
        }
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("{s:?} is not a non-negative duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Renders a duration the way it is written on the command line.
pub fn show_duration(d: Duration) -> String {
    let s = d.as_secs();
    if d.is_zero() {
        return "0s".into();
    }
    if d.subsec_millis() != 0 {
        return format!("{}ms", d.as_millis());
    }
    for (unit, n) in [("d", 86_400), ("h", 3600), ("m", 60)] {
        if s % n == 0 {
            return format!("{}{unit}", s / n);
        }
    }
    format!("{s}s")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_buckets("0-3,8,2").unwrap().0, vec![0, 1, 2, 3, 8]);
        assert_eq!(parse_buckets("15").unwrap().0, vec![15]);
        assert!(parse_buckets("16").unwrap_err().contains("0 to 15"));
        assert!(parse_buckets("3-1").unwrap_err().contains("low-high"));
        assert!(parse_buckets("a").is_err());
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(604_800));
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("0s").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1.5h").unwrap(), Duration::from_secs(5400));
        assert!(parse_duration("7 weeks").is_err());
        assert!(parse_duration("soon").is_err());
        assert_eq!(show_duration(Duration::from_secs(604_800)), "7d");
        assert_eq!(show_duration(Duration::from_secs(90)), "90s");
        assert_eq!(show_duration(Duration::ZERO), "0s");
        assert_eq!(show_duration(Duration::from_millis(1500)), "1500ms");
    }
}
