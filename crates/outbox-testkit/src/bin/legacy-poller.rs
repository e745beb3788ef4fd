//! `legacy-poller`: a polling outbox relay written the way a team writes its own, for the tests
//! of replacing one with outboxd (docs/migrating.md). Plain SQL, one worker: claim unpublished
//! rows with `FOR UPDATE SKIP LOCKED`, publish each to `outbox.event.<aggregatetype>` (key =
//! aggregateid, header `id`, value = payload, the Java client's murmur2 partitioner), wait for
//! every acknowledgement, mark the rows `published_at`, commit. Killed between the publish and
//! the commit, it publishes the claimed rows again after a restart (at least once), as such
//! pollers do.
//!
//! The one line outboxd asks of it is the ownership predicate in the claim
//! (`AND outbox.poller_may_claim(id)`); `--no-ownership-predicate` plants the bug of leaving
//! it out.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;

#[derive(Debug, Parser)]
#[command(name = "legacy-poller")]
struct Args {
    #[arg(long)]
    database_url: String,
    #[arg(long)]
    bootstrap_servers: String,
    /// The team's outbox table: id uuid, seq (insertion order), aggregatetype, aggregateid,
    /// type, payload jsonb, published_at timestamptz.
    #[arg(long, default_value = "app.outbox")]
    table: String,
    /// Rows per claim.
    #[arg(long, default_value_t = 50)]
    batch: i64,
    /// Leave out `AND outbox.poller_may_claim(id)` (a planted bug).
    #[arg(long)]
    no_ownership_predicate: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("legacy-poller: error: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("legacy-poller: error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(a: Args) -> Result<(), Box<dyn std::error::Error>> {
    // Named, so a test can wait for a killed poller's backend (and its row locks) to be gone.
    let sep = if a.database_url.contains('?') {
        '&'
    } else {
        '?'
    };
    let url = format!("{}{sep}application_name=legacy-poller", a.database_url);
    let (mut client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &a.bootstrap_servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("partitioner", "murmur2_random")
        .create()?;
    let predicate = if a.no_ownership_predicate {
        ""
    } else {
        "AND outbox.poller_may_claim(id)"
    };
    let claim = format!(
        "SELECT id::text, aggregatetype, aggregateid, payload::text FROM {} \
         WHERE published_at IS NULL {predicate} ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED",
        a.table
    );
    let mark = format!(
        "UPDATE {} SET published_at = now() WHERE id::text = ANY($1)",
        a.table
    );
    eprintln!("legacy-poller: polling {}", a.table);
    loop {
        let tx = client.transaction().await?;
        let rows = tx.query(claim.as_str(), &[&a.batch]).await?;
        if rows.is_empty() {
            tx.commit().await?;
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let mut sends = Vec::with_capacity(rows.len());
        let mut ids = Vec::with_capacity(rows.len());
        for r in &rows {
            let id: String = r.get(0);
            let aggregate_type: String = r.get(1);
            let aggregate_id: String = r.get(2);
            let payload: String = r.get(3);
            let topic = format!("outbox.event.{aggregate_type}");
            let producer = producer.clone();
            let idc = id.clone();
            sends.push(async move {
                let rec = FutureRecord::to(&topic)
                    .key(&aggregate_id)
                    .payload(&payload)
                    .headers(OwnedHeaders::new().insert(Header {
                        key: "id",
                        value: Some(idc.as_str()),
                    }));
                producer
                    .send(rec, Duration::from_secs(30))
                    .await
                    .map_err(|(e, _)| e)
            });
            ids.push(id);
        }
        // Sent in claim order: one producer keeps an aggregate's messages in that order.
        let results = futures::future::join_all(sends).await;
        if let Some(e) = results.into_iter().find_map(|r| r.err()) {
            eprintln!("legacy-poller: publish failed ({e}); the claim is rolled back");
            drop(tx);
            continue;
        }
        tx.execute(mark.as_str(), &[&ids]).await?;
        tx.commit().await?;
    }
}
