//! Background samplers: the gauges that PostgreSQL and the broker know, refreshed every
//! `--sample-interval-ms`, so that the relay's hot path carries none of them.
//!
//! A failed sample keeps the gauges' last values, counts `outboxd_sampler_errors_total`, and
//! sets `outboxd_database_reachable` / `outboxd_broker_reachable` to 0; it logs once when
//! sampling starts failing and once when it recovers, not on every tick.

use std::time::Duration;

use outbox_ledger::status;
use outbox_sink::KafkaSinkConfig;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, DeliveryResult, Producer, ProducerContext};
use rdkafka::{ClientConfig, ClientContext};
use tokio_postgres::Client;

use crate::metrics;

/// Refreshes the ledger and slot gauges of `slot` forever.
pub(super) async fn ledger(url: String, slot: String, every: Duration) {
    let m = metrics::get();
    let mut client: Option<Client> = None;
    let mut failing = false;
    loop {
        if client.as_ref().map(|c| c.is_closed()).unwrap_or(true) {
            client = None;
        }
        let result = match &client {
            Some(c) => sample(c, &slot).await,
            None => match crate::connect(&url).await {
                Ok(c) => {
                    let r = sample(&c, &slot).await;
                    client = Some(c);
                    r
                }
                Err(e) => Err(e),
            },
        };
        match result {
            Ok(()) => {
                m.database_reachable.set(1);
                if failing {
                    tracing::info!("ledger sampling recovered");
                }
                failing = false;
            }
            Err(e) => {
                m.database_reachable.set(0);
                m.sampler_errors.inc();
                if !failing {
                    tracing::warn!(error = %crate::one_line(&e), "sampling ledger gauges failed; gauges keep their last values");
                }
                failing = true;
            }
        }
        tokio::time::sleep(every).await;
    }
}

async fn sample(c: &Client, slot: &str) -> anyhow::Result<()> {
    let m = metrics::get();
    let s = status::sample(c).await?;
    m.pending.set(s.pending);
    m.oldest_pending_age
        .set(s.oldest_pending_age_seconds.unwrap_or(0.0));
    m.quarantined.set(s.quarantined);
    m.held_aggregates.set(s.held_aggregates);
    m.held_events.set(s.held_events);
    m.unknown.set(s.unknown_attempts);
    m.oldest_unknown_age
        .set(s.oldest_unknown_age_seconds.unwrap_or(0.0));
    let lag = status::lag(c).await?;
    let labels = [slot];
    match lag.iter().find(|l| l.slot_name == slot) {
        Some(l) if l.confirmed_flush_lsn.is_some() => {
            m.slot_active
                .with_label_values(&labels)
                .set(i64::from(l.active.unwrap_or(false)));
            if let Some(b) = l.lag_bytes {
                m.lag_bytes.with_label_values(&labels).set(b);
            }
            if let Some(b) = l.retained_wal_bytes {
                m.retained_wal_bytes.with_label_values(&labels).set(b);
            }
            match l.safe_wal_size_bytes {
                Some(b) => m.safe_wal_size_bytes.with_label_values(&labels).set(b),
                None => {
                    let _ = m.safe_wal_size_bytes.remove_label_values(&labels);
                }
            }
        }
        // Not created yet, or dropped: the relay refuses to guess (see `outboxd run --help`).
        _ => m.slot_active.with_label_values(&labels).set(-1),
    }
    Ok(())
}

/// Asks the broker for metadata on a client of its own (the relay's producer may be busy or
/// between sessions), with the relay's connection properties (TLS, SASL).
pub(super) struct BrokerProbe {
    client: std::sync::Arc<BaseProducer<Quiet>>,
}

/// The probe's own librdkafka logs and errors are dropped: while the broker is away the
/// relay's producer already logs it, and the probe reports its result once, above.
struct Quiet;

impl ClientContext for Quiet {
    fn log(&self, _level: RDKafkaLogLevel, _fac: &str, _log_message: &str) {}
    fn error(&self, _error: KafkaError, _reason: &str) {}
}

impl ProducerContext for Quiet {
    type DeliveryOpaque = ();
    fn delivery(&self, _result: &DeliveryResult<'_>, _opaque: ()) {}
}

impl BrokerProbe {
    pub fn new(sink: &KafkaSinkConfig) -> anyhow::Result<BrokerProbe> {
        let mut cfg = ClientConfig::new();
        cfg.set("bootstrap.servers", &sink.bootstrap_servers)
            .set("client.id", "outboxd-admin-probe")
            // Notice a broker that came back within about a second.
            .set("reconnect.backoff.max.ms", "1000");
        for (k, v) in &sink.properties {
            cfg.set(k, v);
        }
        let client: BaseProducer<Quiet> = cfg.create_with_context(Quiet).map_err(|e| {
            anyhow::anyhow!(
                "creating the broker probe for /readyz ({}): {e}",
                sink.bootstrap_servers
            )
        })?;
        Ok(BrokerProbe {
            client: std::sync::Arc::new(client),
        })
    }

    pub async fn run(self, every: Duration) {
        let m = metrics::get();
        let timeout = every.clamp(Duration::from_millis(500), Duration::from_secs(5));
        let mut failing = false;
        loop {
            let client = self.client.clone();
            let result = tokio::task::spawn_blocking(move || {
                client
                    .client()
                    .fetch_metadata(None, timeout)
                    .map(|md| md.brokers().len())
            })
            .await;
            match result {
                Ok(Ok(n)) if n > 0 => {
                    m.broker_reachable.set(1);
                    if failing {
                        tracing::info!(brokers = n, "broker reachable again");
                    }
                    failing = false;
                }
                other => {
                    m.broker_reachable.set(0);
                    m.sampler_errors.inc();
                    if !failing {
                        let why = match other {
                            Ok(Err(e)) => e.to_string(),
                            Ok(Ok(_)) => "no brokers in the metadata".into(),
                            Err(e) => e.to_string(),
                        };
                        tracing::warn!(error = %why, "broker probe failed; /readyz reports not ready");
                    }
                    failing = true;
                }
            }
            tokio::time::sleep(every).await;
        }
    }
}
