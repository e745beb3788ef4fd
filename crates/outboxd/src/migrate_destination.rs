//! `outboxd migrate-destination`: move unpublished events to another destination, explicitly.
//!
//! Refused while the old target's outcome is DISPATCH_UNKNOWN, refused for a published event,
//! and done only with a proof that the old target did not accept the event: it was quarantined
//! before anything was sent, the old target rejected it, or a scan of the whole old topic did
//! not find it. The migration is a new envelope generation with its own frozen destination; the
//! event's quarantine / hold is then released so the running relay publishes it there.

use std::time::Duration;

use outbox_core::receipt::{self, MigrationProof};
use outbox_ledger::destination;
use outbox_ledger::holds::{self, Resolution};
use outbox_sink::KafkaSinkConfig;
use uuid::Uuid;

use crate::cli::MigrateDestinationArgs;

pub async fn run(a: MigrateDestinationArgs) -> anyhow::Result<()> {
    if a.reason.trim().is_empty() {
        anyhow::bail!("--reason must say why the destination changes; it is recorded in the migration receipt");
    }
    let by = crate::operator::operator_name(a.by.clone());
    let mut client = crate::connect(&a.db.url()?).await?;
    let mut refused = 0;
    for id in &a.event {
        match migrate_one(&mut client, &a, *id, &by).await {
            Ok(line) => println!("{line}"),
            Err(e) => {
                refused += 1;
                println!("refused {id}: {e:#}");
            }
        }
    }
    if refused > 0 {
        anyhow::bail!("{refused} event(s) not migrated; see the lines above");
    }
    Ok(())
}

async fn migrate_one(
    client: &mut tokio_postgres::Client,
    a: &MigrateDestinationArgs,
    id: Uuid,
    by: &str,
) -> anyhow::Result<String> {
    let Some(f) = destination::facts(client, id).await? else {
        anyhow::bail!("not in the outbox");
    };
    if let Some(at) = &f.published {
        anyhow::bail!(
            "already published at {at}; a second destination is a delivery set, not a migration"
        );
    }
    // The rule is outbox_core::receipt::migration_precheck (driven by outbox-sim).
    let facts = receipt::MigrationFacts {
        published: false,
        unknown_open: f.unknown_open,
        quarantine_code: f.quarantine.as_ref().map(|(c, _)| c.as_str()),
        attempts: f.attempts,
        migrated: f.envelope_generation > 1,
        replayable: f.replayable,
    };
    let reason = f.quarantine.as_ref().map(|(_, r)| r.as_str()).unwrap_or("");
    let proof = match receipt::migration_precheck(facts) {
        Err(refusal) => anyhow::bail!(
            "{refusal} (destination {}/{})",
            f.dest_cluster,
            f.dest_topic
        ),
        Ok(Some(MigrationProof::NeverSent)) => format!(
            "never sent: quarantined before sending ({}: {reason})",
            facts.quarantine_code.unwrap_or("")
        ),
        Ok(Some(MigrationProof::RejectedByOldTarget)) => {
            format!("the old target rejected it: {reason}")
        }
        // A Kafka scan proves nothing about another broker: a subject that is not a Kafka topic
        // would read as "absent" and the event could then be published twice.
        Ok(Some(MigrationProof::AbsentFromOldTarget) | None) if f.dest_kind != "kafka" => anyhow::bail!(
            "cannot prove that {kind} {}/{} did not accept it: this command scans Kafka topics only; \
             check the old target yourself (for JetStream: the stream that captures the subject, by Nats-Msg-Id), \
             or let the relay resolve it against that broker",
            f.dest_cluster,
            f.dest_topic,
            kind = f.dest_kind
        ),
        Ok(Some(MigrationProof::AbsentFromOldTarget) | None) => {
            let Some(bootstrap) = &a.old_bootstrap_servers else {
                anyhow::bail!(
                    "cannot prove that {}/{} did not accept it: pass --old-bootstrap-servers of that cluster so its topic can be scanned",
                    f.dest_cluster, f.dest_topic
                );
            };
            scan_old_target(bootstrap, &f.dest_topic, id).await?
        }
    };
    let generation = destination::record(
        client, id, &a.kind, &a.cluster, &a.topic, &proof, &a.reason, by,
    )
    .await?;
    // Let the relay publish it: release its quarantine and the hold it blocks, if any.
    let released = holds::resolve(client, id, Resolution::Release, by, Some(&a.reason))
        .await
        .is_ok();
    Ok(format!(
        "migrated {id}: {}/{} -> {}/{} (envelope generation {generation}); proof: {proof}{}",
        f.dest_cluster,
        f.dest_topic,
        a.cluster,
        a.topic,
        if released {
            "; released for publishing"
        } else {
            "; published when its aggregate's hold is released"
        }
    ))
}

async fn scan_old_target(bootstrap: &str, topic: &str, id: Uuid) -> anyhow::Result<String> {
    let cfg = KafkaSinkConfig {
        bootstrap_servers: bootstrap.to_string(),
        ..KafkaSinkConfig::default()
    };
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || -> anyhow::Result<String> {
        let partitions = outbox_sink::topic_partitions(&cfg, &topic, Duration::from_secs(10))
            .map_err(|e| anyhow::anyhow!("cannot query the old target: {e}"))?;
        let mut ranges = Vec::new();
        for p in partitions {
            let r = outbox_sink::scan_for_event(&cfg, &topic, p, 0, &id.to_string(), Duration::from_secs(60))
                .map_err(|e| anyhow::anyhow!("cannot query the old target: {e}"))?;
            if let Some((offset, _)) = r.found {
                anyhow::bail!("the old target has it at {topic}/{p}@{offset}: it is published there; let the relay record that receipt");
            }
            ranges.push(format!("{p}:[{},{})", r.scanned_from, r.scanned_to));
        }
        Ok(format!("absent from {topic} (scanned partitions {})", ranges.join(" ")))
    })
    .await?
}
