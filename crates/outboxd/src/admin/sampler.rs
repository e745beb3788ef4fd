//! Background samplers: the gauges that PostgreSQL and the broker know, refreshed every
//! `--sample-interval-ms`, so that the relay's hot path carries none of them.
//!
//! A failed sample keeps the gauges' last values, counts `outboxd_sampler_errors_total`, and
//! sets `outboxd_database_reachable` / `outboxd_broker_reachable` to 0; it logs once when
//! sampling starts failing and once when it recovers, not on every tick.

use std::time::Duration;

use outbox_ledger::status;
use outbox_sink::KafkaSinkConfig;
use outbox_source::shard::Shard;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, DeliveryResult, Producer, ProducerContext};
use rdkafka::{ClientConfig, ClientContext};
use tokio_postgres::Client;

use crate::metrics;

/// Refreshes the ledger and slot gauges of `relay`'s database forever: its slot, or a fleet
/// member's shard slots (`<slot>_shard<I>of<N>`). One sampler per database, each with its
/// own connection: a database that is away only stops its own gauges.
pub(super) async fn ledger(relay: crate::config::RelayConfig, every: Duration) {
    let m = metrics::get();
    let url = relay.database_url.expose().to_string();
    let (database, slot) = (relay.database.clone(), relay.slot.clone());
    let reachable = m.database_reachable.with_label_values(&[&database]);
    let mut client: Option<Client> = None;
    let mut failing = false;
    loop {
        if client.as_ref().map(|c| c.is_closed()).unwrap_or(true) {
            client = None;
        }
        let result = match &client {
            Some(c) => sample(c, &database, &slot).await,
            None => match crate::connect(&url).await {
                Ok(c) => {
                    let r = sample(&c, &database, &slot).await;
                    client = Some(c);
                    r
                }
                Err(e) => Err(e),
            },
        };
        match result {
            Ok(()) => {
                reachable.set(1);
                if failing {
                    tracing::info!(%database, "ledger sampling recovered");
                }
                failing = false;
            }
            Err(e) => {
                reachable.set(0);
                m.sampler_errors.inc();
                if !failing {
                    tracing::warn!(%database, error = %crate::one_line(&e), "sampling ledger gauges failed; gauges keep their last values");
                }
                failing = true;
            }
        }
        tokio::time::sleep(every).await;
    }
}

async fn sample(c: &Client, database: &str, slot: &str) -> anyhow::Result<()> {
    let m = metrics::get();
    let s = status::sample(c).await?;
    let db = [database];
    m.pending.with_label_values(&db).set(s.pending);
    m.oldest_pending_age
        .with_label_values(&db)
        .set(s.oldest_pending_age_seconds.unwrap_or(0.0));
    m.quarantined.with_label_values(&db).set(s.quarantined);
    m.held_aggregates
        .with_label_values(&db)
        .set(s.held_aggregates);
    m.held_events.with_label_values(&db).set(s.held_events);
    m.unknown.with_label_values(&db).set(s.unknown_attempts);
    m.oldest_unknown_age
        .with_label_values(&db)
        .set(s.oldest_unknown_age_seconds.unwrap_or(0.0));
    let lag = status::lag(c).await?;
    // The relay's slot, and the shard slots of a sharded outbox (a fleet member relays any).
    let ours = |name: &str| name == slot || Shard::from_name(name, slot).is_some();
    let mut slots: Vec<&str> = lag
        .iter()
        .map(|l| l.slot_name.as_str())
        .filter(|n| ours(n))
        .collect();
    if slots.is_empty() {
        slots.push(slot);
    }
    for name in slots {
        let labels = [database, name];
        match lag.iter().find(|l| l.slot_name == name) {
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
    }
    for r in c
        .query(
            "SELECT slot_name, generation FROM outbox.relay_leases
             WHERE slot_name = $1 OR starts_with(slot_name, $1 || '_shard')",
            &[&slot],
        )
        .await?
    {
        let name: String = r.get(0);
        if ours(&name) {
            m.lease_generation
                .with_label_values(&[database, &name])
                .set(r.get::<_, i64>(1));
        }
    }
    Ok(())
}

/// Asks the broker for metadata on a client of its own (the relay's producer may be busy or
/// between sessions), with the relay's connection properties (TLS, SASL). For JetStream: the
/// account info request, which only a server with JetStream up answers.
pub(super) enum BrokerProbe {
    Kafka(std::sync::Arc<BaseProducer<Quiet>>),
    Nats {
        url: String,
        auth: Box<outbox_sink::NatsAuth>,
        client: Option<async_nats::Client>,
    },
    /// An HTTP endpoint has no metadata to ask for: its answers to the relay's requests are
    /// the only test (a refused connection or a 503 shows as a relay that replays).
    Http,
}

/// The probe's own librdkafka logs and errors are dropped: while the broker is away the
/// relay's producer already logs it, and the probe reports its result once, above.
pub(super) struct Quiet;

impl ClientContext for Quiet {
    fn log(&self, _level: RDKafkaLogLevel, _fac: &str, _log_message: &str) {}
    fn error(&self, _error: KafkaError, _reason: &str) {}
}

impl ProducerContext for Quiet {
    type DeliveryOpaque = ();
    fn delivery(&self, _result: &DeliveryResult<'_>, _opaque: ()) {}
}

impl BrokerProbe {
    /// The probe for the relay's sink.
    pub fn for_relay(relay: &crate::config::RelayConfig) -> anyhow::Result<BrokerProbe> {
        if !relay.http.is_empty() {
            return Ok(BrokerProbe::Http);
        }
        match &relay.nats {
            Some(n) => Ok(BrokerProbe::Nats {
                url: n.url.clone(),
                auth: Box::new(n.auth.clone()),
                client: None,
            }),
            None => BrokerProbe::new(&relay.sink),
        }
    }

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
        Ok(BrokerProbe::Kafka(std::sync::Arc::new(client)))
    }

    /// One probe: the number of brokers that answered, or why none did.
    async fn probe(&mut self, timeout: Duration) -> Result<usize, String> {
        match self {
            BrokerProbe::Kafka(client) => {
                let client = client.clone();
                match tokio::task::spawn_blocking(move || {
                    client
                        .client()
                        .fetch_metadata(None, timeout)
                        .map(|md| md.brokers().len())
                })
                .await
                {
                    Ok(Ok(0)) => Err("no brokers in the metadata".into()),
                    Ok(Ok(n)) => Ok(n),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            }
            BrokerProbe::Http => Ok(1),
            BrokerProbe::Nats { url, auth, client } => {
                if client.is_none() {
                    let c = outbox_sink::jetstream::connect_client(
                        url,
                        auth,
                        "outboxd-admin-probe",
                        timeout,
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                    *client = Some(c);
                }
                let Some(c) = client.as_ref() else {
                    return Err("not connected".into());
                };
                let mut js = async_nats::jetstream::new(c.clone());
                js.set_timeout(timeout);
                js.query_account()
                    .await
                    .map(|_| 1)
                    .map_err(|e| format!("JetStream: {e}"))
            }
        }
    }

    pub async fn run(mut self, every: Duration) {
        let m = metrics::get();
        let timeout = every.clamp(Duration::from_millis(500), Duration::from_secs(5));
        let mut failing = false;
        loop {
            let result = self.probe(timeout).await;
            match result {
                Ok(n) => {
                    m.broker_reachable.set(1);
                    if failing {
                        tracing::info!(brokers = n, "broker reachable again");
                    }
                    failing = false;
                }
                Err(why) => {
                    m.broker_reachable.set(0);
                    m.sampler_errors.inc();
                    if !failing {
                        tracing::warn!(error = %why, "broker probe failed; /readyz reports not ready");
                    }
                    failing = true;
                }
            }
            tokio::time::sleep(every).await;
        }
    }
}
