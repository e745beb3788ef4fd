//! The broker's warm-up: before the first measured phase, messages like the relay's go to a
//! topic of their own, so that every contender publishes to a broker whose produce path the
//! JVM has compiled already.
//!
//! Why: a fresh Apache Kafka JIT-compiles its request path during whatever publishes first,
//! and in this bench that is the relay's drain; Debezium's runs later, on a warm broker. The
//! same build drained 41,840 events/s on a fresh broker and 59,043-69,733 on one warmed by
//! earlier runs (docs/benchmarks.md, "A warm broker for both"), and the broker's C2 compiler
//! thread alone took a fifth of the machine in a short phase. A production broker is warm.

use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

/// The topic the warm-up writes to (created by the caller).
pub(crate) const TOPIC: &str = "bench.broker-warmup";

/// Produces `messages` records to [`TOPIC`] at `bootstrap` as the relay's producer would send
/// events of 100,000 aggregates (idempotent, `acks=all`, keyed, the envelope's headers, a
/// payload of `payload` bytes) and waits until every one is acknowledged. Returns the seconds
/// it took. Blocking.
pub(crate) fn run(bootstrap: &str, messages: u64, payload: usize) -> anyhow::Result<f64> {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "2")
        .set("client.id", "outbox-bench-warmup")
        .create()
        .context("creating the broker warm-up producer")?;
    let body = vec![b'x'; payload];
    let digest = format!("sha256:{}", "0".repeat(64));
    let t = Instant::now();
    for i in 0..messages {
        let id = uuid::Uuid::now_v7().to_string();
        let key = format!("a-{}", i % 100_000);
        let version = (i / 100_000 + 1).to_string();
        let headers = [
            ("id", id.as_str()),
            ("aggregate_type", "bench_warmup"),
            ("aggregate_id", key.as_str()),
            ("aggregate_version", version.as_str()),
            ("event_type", "bench.tick"),
            ("envelope_generation", "1"),
            ("payload_digest", digest.as_str()),
        ]
        .into_iter()
        .fold(OwnedHeaders::new_with_capacity(7), |h, (k, v)| {
            h.insert(Header {
                key: k,
                value: Some(v),
            })
        });
        let mut record = BaseRecord::<str, [u8]>::to(TOPIC)
            .key(key.as_str())
            .payload(&body[..])
            .headers(headers);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    producer.poll(Duration::from_millis(10));
                }
                Err((e, _)) => return Err(e).context("producing the broker warm-up"),
            }
        }
        producer.poll(Duration::ZERO);
    }
    producer
        .flush(Duration::from_secs(120))
        .context("waiting for the broker warm-up's acknowledgements")?;
    round_trips(bootstrap, (messages / 100).min(ROUNDS), &body)?;
    Ok(t.elapsed().as_secs_f64())
}

/// Rounds of the hot-aggregate pattern at most (`--variants 100x10`): ten keys, one message
/// each in flight, the next round once all ten are acknowledged.
const ROUNDS: u64 = 2_000;

/// `rounds` rounds of ten keyed messages, each round's reports served before the next: the
/// broker's path for many small produce requests, which a wide warm-up (large batches) never
/// takes and a ten-aggregate variant takes all the time. Without it, the variant measured the broker's
/// JIT compiling that path (its C2 thread a fifth of the machine in a profile of the variant;
/// six runs of one variant in a row gave 5,177-12,000 events/s: docs/benchmarks.md, "Where a
/// hot aggregate's round trip goes").
fn round_trips(bootstrap: &str, rounds: u64, body: &[u8]) -> anyhow::Result<()> {
    // Without linger, as the relay's express lane sends while little is outstanding.
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "0")
        .set("client.id", "outbox-bench-warmup-round-trips")
        .create()
        .context("creating the broker warm-up's round-trip producer")?;
    let keys: Vec<String> = (0..10).map(|k| format!("hot-{k}")).collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    for _ in 0..rounds {
        for key in &keys {
            producer
                .send(
                    BaseRecord::<str, [u8]>::to(TOPIC)
                        .key(key.as_str())
                        .payload(body),
                )
                .map_err(|(e, _)| e)
                .context("producing the broker warm-up's round trips")?;
        }
        // Every report of the round served before the next (`flush` waits in steps of
        // 100 ms: 2,000 rounds took 204 s).
        while producer.in_flight_count() > 0 {
            producer.poll(Duration::from_millis(5));
            if Instant::now() > deadline {
                anyhow::bail!("the broker warm-up's round trips took over 120 s");
            }
        }
    }
    Ok(())
}
