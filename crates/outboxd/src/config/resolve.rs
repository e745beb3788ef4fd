//! Configuration resolution: from `outboxd run`'s flags (and their `OUTBOXD_*` variables), the
//! TOML file and the defaults to the [`RelayConfig`] of each database and the
//! [`AdminConfig`](super::AdminConfig) of the process. What the file may hold and how each
//! setting is checked is the parent module's; this one decides which source wins.

use std::time::Duration;

use anyhow::Context;
use outbox_sink::{JetStreamSinkConfig, KafkaSinkConfig};

use crate::cli::RunArgs;
use crate::config::{self, FileConfig, RelayConfig, Secret};
use crate::values;

/// The relay configuration of `outboxd run` for one database: flags (and their `OUTBOXD_*`
/// variables), then the config file, then the defaults. A config file with `[[databases]]`
/// is refused here: see [`resolve_runs`].
pub fn resolve_run(a: &RunArgs) -> anyhow::Result<RelayConfig> {
    let mut runs = resolve_runs(a)?;
    match runs.len() {
        1 => Ok(runs.remove(0)),
        n => anyhow::bail!("the config file lists {n} [[databases]]; this command relays one"),
    }
}

/// The relays of `outboxd run`: one per `[[databases]]` entry of the config file (each with
/// its URL, slot, publication and table; the rest shared), else the one database of
/// `--database-url` / `database_url`.
pub fn resolve_runs(a: &RunArgs) -> anyhow::Result<Vec<RelayConfig>> {
    let file = match &a.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let base = build_run(a, &file)?;
    if file.databases.is_empty() {
        return Ok(vec![finish_run(a, base)?]);
    }
    if a.database_url.is_some() || file.database_url.is_some() {
        anyhow::bail!(
            "the config file lists [[databases]], and a database URL is also given (--database-url, OUTBOXD_DATABASE_URL or database_url): give each database's URL in its [[databases]] entry only"
        );
    }
    let mut runs = Vec::new();
    for (i, d) in file.databases.iter().enumerate() {
        let entry = d
            .name
            .clone()
            .unwrap_or_else(|| format!("number {}", i + 1));
        let Some(url) = d.database_url.clone() else {
            anyhow::bail!("[[databases]] entry {entry} has no database_url");
        };
        let mut cfg = base.clone();
        cfg.database = d
            .name
            .clone()
            .unwrap_or_else(|| config::database_name(url.expose()));
        cfg.database_url = url;
        // The entry's own names win over the shared ones (flags, then the top level).
        if let Some(slot) = &d.slot {
            cfg.slot = slot.clone();
        }
        if let Some(p) = &d.publication {
            cfg.publication = p.clone();
        }
        if let Some(t) = &d.table {
            (cfg.schema, cfg.table) = config::split_table(t)?;
        }
        runs.push(finish_run(a, cfg).with_context(|| format!("[[databases]] entry {entry}"))?);
    }
    config::validate_databases(&runs)?;
    Ok(runs)
}

/// The flags of `outboxd run` that override `[http]` (never an `[[http.endpoints]]` entry's
/// own setting).
#[derive(Debug, Default)]
pub struct HttpFlags<'a> {
    /// `--http-endpoint`: the one endpoint's name (refused beside `[[http.endpoints]]`).
    pub endpoint: Option<&'a str>,
    /// `--http-signing-secrets`.
    pub signing_secrets: &'a [String],
    /// `--message-timeout-ms`: the deadline of a send.
    pub deadline_ms: Option<u64>,
}

/// The HTTP endpoints of `--sink http`: `[http]` alone is one endpoint; with
/// `[[http.endpoints]]` each entry is one, a key it does not set taken from `[http]` (flags
/// override `[http]`, never an entry's own setting), then the default.
pub fn http_endpoints(
    a: &HttpFlags<'_>,
    h: &config::HttpFile,
) -> anyhow::Result<Vec<outbox_sink::HttpSinkConfig>> {
    let d = outbox_sink::HttpSinkConfig::default();
    let ms = Duration::from_millis;
    let secrets = |v: &[config::Secret]| -> Vec<String> {
        v.iter().map(|s| s.expose().to_string()).collect()
    };
    let shared_secrets = if a.signing_secrets.is_empty() {
        secrets(&h.signing_secrets)
    } else {
        a.signing_secrets.to_vec()
    };
    let shared_deadline = a.deadline_ms.or(h.deadline_ms);
    let one = |e: &config::HttpFile, name: String| {
        let mut headers: Vec<(String, String)> = h
            .headers
            .iter()
            .filter(|(k, _)| !e.headers.keys().any(|o| o.eq_ignore_ascii_case(k)))
            .chain(e.headers.iter())
            .map(|(k, v)| (k.clone(), v.expose().to_string()))
            .collect();
        headers.sort();
        outbox_sink::HttpSinkConfig {
            endpoint: name,
            method: e
                .method
                .clone()
                .or(h.method.clone())
                .unwrap_or(d.method.clone()),
            idempotency_header: e
                .idempotency_header
                .clone()
                .or(h.idempotency_header.clone())
                .unwrap_or(d.idempotency_header.clone()),
            headers,
            response_id_header: e
                .response_id_header
                .clone()
                .or(h.response_id_header.clone()),
            request_timeout: e
                .request_timeout_ms
                .or(h.request_timeout_ms)
                .map(ms)
                .unwrap_or(d.request_timeout),
            deadline: e
                .deadline_ms
                .or(shared_deadline)
                .map(ms)
                .unwrap_or(d.deadline),
            max_concurrency: e
                .max_concurrency
                .or(h.max_concurrency)
                .unwrap_or(d.max_concurrency),
            idempotency_window: e.idempotency_window_ms.or(h.idempotency_window_ms).map(ms),
            ca_file: e.ca_file.clone().or(h.ca_file.clone()),
            signing_secrets: if e.signing_secrets.is_empty() {
                shared_secrets.clone()
            } else {
                secrets(&e.signing_secrets)
            },
        }
    };
    let shared = config::HttpFile::default();
    Ok(endpoint_entries(a, h)?
        .into_iter()
        .map(|(name, e)| one(e.unwrap_or(&shared), name))
        .collect())
}

/// Each endpoint's name and its `[[http.endpoints]]` entry (`None`: `[http]` alone is the one
/// endpoint): the one walk that names the endpoints, for their sink settings and their
/// schedules alike. Refuses a name given by a flag or by `[http]` beside the list, a nested
/// list and an entry without a name.
fn endpoint_entries<'h>(
    a: &HttpFlags<'_>,
    h: &'h config::HttpFile,
) -> anyhow::Result<Vec<(String, Option<&'h config::HttpFile>)>> {
    if h.endpoints.is_empty() {
        let name = a
            .endpoint
            .map(str::to_string)
            .or(h.endpoint.clone())
            .unwrap_or(outbox_sink::HttpSinkConfig::default().endpoint);
        return Ok(vec![(name, None)]);
    }
    if let Some(flag) = a.endpoint {
        anyhow::bail!("--http-endpoint {flag:?} names one endpoint, but the config file lists [[http.endpoints]]: name each endpoint in its entry and drop the flag");
    }
    if let Some(top) = &h.endpoint {
        anyhow::bail!("http.endpoint {top:?} is set beside [[http.endpoints]]: name each endpoint in its own entry (endpoint = \"...\") and remove http.endpoint");
    }
    h.endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| {
            if !e.endpoints.is_empty() {
                anyhow::bail!("[[http.endpoints]] entry {} lists endpoints of its own: entries do not nest", i + 1);
            }
            let name = e.endpoint.clone().ok_or_else(|| {
                anyhow::anyhow!("[[http.endpoints]] entry {} has no endpoint name: add endpoint = \"<the name its routes give it>\"", i + 1)
            })?;
            Ok((name, Some(e)))
        })
        .collect()
}

/// The endpoints' own retry schedules (`unclear_schedule_ms` of an entry, else of `[http]`),
/// by endpoint name; an endpoint with none is absent.
fn endpoint_schedules(
    a: &HttpFlags<'_>,
    h: &config::HttpFile,
) -> anyhow::Result<std::collections::BTreeMap<String, outbox_relay::UnclearSchedule>> {
    let mut out = std::collections::BTreeMap::new();
    for (name, e) in endpoint_entries(a, h)? {
        let ms = e
            .and_then(|e| e.unclear_schedule_ms.as_deref())
            .or(h.unclear_schedule_ms.as_deref())
            .unwrap_or_default();
        if let Some(s) = schedule(ms, &format!("endpoint {name:?}: http.unclear_schedule_ms"))? {
            out.insert(name, s);
        }
    }
    Ok(out)
}

/// The settings every database of the process shares, and the top-level database, unchecked.
fn build_run(a: &RunArgs, file: &FileConfig) -> anyhow::Result<RelayConfig> {
    let table = a
        .table
        .clone()
        .or(file.table.clone())
        .unwrap_or_else(|| config::DEFAULT_TABLE.into());
    let (schema, table) = config::split_table(&table)?;
    let mut properties: Vec<(String, String)> = file.kafka.properties.clone().into_iter().collect();
    properties.extend(a.kafka_properties.iter().cloned());
    let defaults = KafkaSinkConfig::default();
    let cluster_name = a.cluster_name.clone();
    let kind = a.sink.or(file.sink).unwrap_or(values::SinkKind::Kafka);
    let http_flags = HttpFlags {
        endpoint: a.http_endpoint.as_deref(),
        signing_secrets: &a.http_signing_secrets,
        deadline_ms: a.message_timeout_ms,
    };
    let (http, endpoint_schedules) = if kind == values::SinkKind::Http {
        (
            http_endpoints(&http_flags, &file.http)?,
            endpoint_schedules(&http_flags, &file.http)?,
        )
    } else {
        Default::default()
    };
    let nats = match kind {
        values::SinkKind::Kafka | values::SinkKind::Http => None,
        values::SinkKind::Nats => {
            let d = JetStreamSinkConfig::default();
            let n = &file.nats;
            let url = a.nats_url.clone().or(n.url.clone()).unwrap_or_default();
            Some(JetStreamSinkConfig {
                auth: config::resolve_nats_auth(&a.nats_auth, n, &url)?,
                url,
                cluster_name: cluster_name
                    .clone()
                    .or(n.cluster_name.clone())
                    .unwrap_or(d.cluster_name),
                stream: a
                    .nats_stream
                    .clone()
                    .or(n.stream.clone())
                    .unwrap_or(d.stream),
                create_stream: a.nats_create_stream || n.create_stream.unwrap_or(false),
                stream_subjects: if a.nats_stream_subjects.is_empty() {
                    n.stream_subjects.clone().unwrap_or(d.stream_subjects)
                } else {
                    a.nats_stream_subjects.clone()
                },
                duplicate_window: a
                    .nats_duplicate_window_ms
                    .or(n.duplicate_window_ms)
                    .map(Duration::from_millis)
                    .unwrap_or(d.duplicate_window),
                ack_timeout: a
                    .message_timeout_ms
                    .or(n.ack_timeout_ms)
                    .map(Duration::from_millis)
                    .unwrap_or(d.ack_timeout),
                max_in_flight: a
                    .max_in_flight
                    .or(file.relay.max_in_flight)
                    .map(|m| usize::try_from(m).unwrap_or(usize::MAX))
                    .unwrap_or(d.max_in_flight),
            })
        }
    };
    let database_url = a
        .database_url
        .clone()
        .map(Secret::new)
        .or(file.database_url.clone())
        .unwrap_or_default();
    let schedule_ms = match (&a.unclear_schedule_ms[..], &file.relay.unclear_schedule_ms) {
        ([], Some(f)) => f.clone(),
        (flag, _) => flag.to_vec(),
    };
    let unclear_schedule = schedule(
        &schedule_ms,
        "--unclear-schedule-ms (relay.unclear_schedule_ms)",
    )?;
    Ok(RelayConfig {
        database: config::database_name(database_url.expose()),
        database_url,
        slot: a
            .slot
            .clone()
            .or(file.slot.clone())
            .unwrap_or_else(|| config::DEFAULT_SLOT.into()),
        publication: a
            .publication
            .clone()
            .or(file.publication.clone())
            .unwrap_or_else(|| config::DEFAULT_PUBLICATION.into()),
        schema,
        table,
        sink: KafkaSinkConfig {
            bootstrap_servers: a
                .bootstrap_servers
                .clone()
                .or(file.kafka.bootstrap_servers.clone())
                .unwrap_or_default(),
            cluster_name: a
                .cluster_name
                .clone()
                .or(file.kafka.cluster_name.clone())
                .unwrap_or(defaults.cluster_name),
            partitioner: file
                .kafka
                .partitioner
                .clone()
                .unwrap_or(defaults.partitioner),
            message_timeout: a
                .message_timeout_ms
                .or(file.kafka.message_timeout_ms)
                .map(Duration::from_millis)
                .unwrap_or(defaults.message_timeout),
            linger: file
                .kafka
                .linger_ms
                .map(Duration::from_millis)
                .unwrap_or(defaults.linger),
            express_max_in_flight: file
                .kafka
                .express_max_in_flight
                .unwrap_or(defaults.express_max_in_flight),
            in_flight_per_aggregate: a
                .in_flight_per_aggregate
                .or(file.kafka.in_flight_per_aggregate)
                .unwrap_or(defaults.in_flight_per_aggregate),
            properties,
            headers: outbox_sink::HeaderOptions {
                cloudevents: cloudevents_source(a, file),
            },
        },
        nats,
        http,
        max_in_flight: a
            .max_in_flight
            .or(file.relay.max_in_flight)
            .unwrap_or(config::DEFAULT_MAX_IN_FLIGHT),
        batch_size: a.batch_size.or(file.relay.batch_size).unwrap_or(1000),
        batch_linger: Duration::from_millis(
            a.batch_linger_ms
                .or(file.relay.batch_linger_ms)
                .unwrap_or(1),
        ),
        status_interval: Duration::from_millis(
            a.status_interval_ms
                .or(file.relay.status_interval_ms)
                .unwrap_or(1000),
        ),
        heartbeat_interval: Duration::from_millis(
            a.heartbeat_interval_ms
                .or(file.relay.heartbeat_interval_ms)
                .unwrap_or(10_000),
        ),
        resnapshot: a.resnapshot,
        mode: a.mode.or(file.relay.mode).unwrap_or_default(),
        poll_interval: Duration::from_millis(
            a.poll_interval_ms
                .or(file.relay.poll_interval_ms)
                .unwrap_or(100),
        ),
        shard: a.shard,
        delivery: a.delivery.or(file.kafka.delivery).unwrap_or_default(),
        positions_topic: a
            .positions_topic
            .clone()
            .or(file.kafka.positions_topic.clone())
            .unwrap_or_else(|| config::DEFAULT_POSITIONS_TOPIC.into()),
        relay_id: a
            .relay_id
            .clone()
            .or(file.relay.relay_id.clone())
            .unwrap_or_else(config::default_relay_id),
        lease_ttl: Duration::from_millis(
            a.lease_ttl_ms.or(file.relay.lease_ttl_ms).unwrap_or(10_000),
        ),
        fleet_stop_grace: a
            .fleet_stop_grace_ms
            .or(file.relay.fleet_stop_grace_ms)
            .map_or(config::FLEET_STOP_GRACE, Duration::from_millis),
        unknown_settle: Duration::from_millis(
            a.unknown_settle_ms
                .or(file.relay.unknown_settle_ms)
                .unwrap_or(5_000),
        ),
        unclear_budget: a
            .unclear_budget
            .or(file.relay.unclear_budget)
            .or(unclear_schedule.map(|s| s.budget()))
            .unwrap_or(outbox_relay::UnclearPolicy::default().budget),
        unclear_max_waiting: a
            .unclear_max_waiting
            .or(file.relay.unclear_max_waiting)
            .unwrap_or(config::DEFAULT_UNCLEAR_MAX_WAITING),
        unclear_schedule,
        endpoint_schedules,
    })
}

/// A retry schedule from its steps in ms (`None` when there are none); errors name `what`.
fn schedule(ms: &[u64], what: &str) -> anyhow::Result<Option<outbox_relay::UnclearSchedule>> {
    if ms.is_empty() {
        return Ok(None);
    }
    let steps: Vec<Duration> = ms.iter().map(|m| Duration::from_millis(*m)).collect();
    outbox_relay::UnclearSchedule::new(&steps)
        .map(Some)
        .map_err(|e| anyhow::anyhow!("{what}: {e}"))
}

/// Checks one relay's settings, after naming a shard's slot and publication.
fn finish_run(a: &RunArgs, mut cfg: RelayConfig) -> anyhow::Result<RelayConfig> {
    if a.fleet && cfg.mode == crate::values::RunMode::Poll {
        anyhow::bail!("--fleet needs --mode cdc: a poll-mode relay reads every aggregate");
    }
    if cfg.delivery == crate::values::Delivery::ExactlyOnce {
        if cfg.nats.is_some() || !cfg.http.is_empty() {
            anyhow::bail!("delivery = exactly-once is for Kafka only: NATS JetStream and HTTP endpoints have no transactions (their look-ups and idempotency keys keep copies out instead; docs/exactly_once.md)");
        }
        if cfg.mode == crate::values::RunMode::Poll {
            anyhow::bail!("delivery = exactly-once needs --mode cdc (a poll round is not a stream position a batch record can name)");
        }
    }
    let depth = cfg.sink.in_flight_per_aggregate;
    if !(1..=64).contains(&depth) {
        anyhow::bail!("kafka.in_flight_per_aggregate = {depth}: give 1 to 64 events of one aggregate in flight (1, the default, waits for each version's report)");
    }
    if depth > 1 {
        if cfg.nats.is_some() || !cfg.http.is_empty() {
            anyhow::bail!("--in-flight-per-aggregate {depth} is for Kafka only: a JetStream or webhook send of one version can fail while the next one succeeds, so their versions go one at a time");
        }
        if cfg.mode == crate::values::RunMode::Poll {
            anyhow::bail!("--in-flight-per-aggregate {depth} needs --mode cdc: poll mode sends one version of an aggregate at a time");
        }
        if !outbox_sink::kafka::placeable_partitioner(&cfg.sink.partitioner) {
            anyhow::bail!("--in-flight-per-aggregate {depth} needs a key partitioner (kafka.partitioner = murmur2_random, the default, or murmur2, consistent, fnv1a and their _random forms): the relay places each key itself so that a partition count raised mid-run never splits an aggregate's versions in flight; partitioner = \"{}\" places keys at random", cfg.sink.partitioner);
        }
        if cfg.delivery == crate::values::Delivery::ExactlyOnce {
            anyhow::bail!("--in-flight-per-aggregate {depth} is for the default delivery: exactly-once mode already puts several versions of an aggregate into one transaction (docs/exactly_once.md)");
        }
    }
    if let Some(s) = cfg.shard {
        cfg.slot = s.name(&cfg.slot);
        cfg.publication = s.name(&cfg.publication);
    }
    cfg.validate()?;
    Ok(cfg)
}

/// The admin endpoints of `outboxd run`, resolved like [`resolve_run`].
pub fn resolve_admin(a: &RunArgs) -> anyhow::Result<config::AdminConfig> {
    let file = match &a.config {
        Some(p) => FileConfig::load(p)?.admin,
        None => config::AdminFile::default(),
    };
    let f = &a.admin;
    let addr =
        |what: &str, v: Option<&String>| v.map(|s| config::parse_listen_addr(what, s)).transpose();
    let cfg = config::AdminConfig {
        http_addr: addr(
            "admin address",
            f.admin_addr.as_ref().or(file.addr.as_ref()),
        )?,
        console_addr: addr(
            "console address",
            f.console_addr.as_ref().or(file.console_addr.as_ref()),
        )?,
        console_user: f
            .console_user
            .clone()
            .or(file.console_user)
            .unwrap_or_else(|| config::DEFAULT_CONSOLE_USER.into()),
        console_password: f
            .console_password
            .clone()
            .map(Secret::new)
            .or(file.console_password),
        console_max_connections: f
            .console_max_connections
            .or(file.console_max_connections)
            .unwrap_or(config::DEFAULT_CONSOLE_MAX_CONNECTIONS),
        console_login_timeout: Duration::from_millis(
            f.console_login_timeout_ms
                .or(file.console_login_timeout_ms)
                .unwrap_or(config::DEFAULT_CONSOLE_LOGIN_TIMEOUT_MS),
        ),
        console_idle_timeout: Duration::from_millis(
            f.console_idle_timeout_ms
                .or(file.console_idle_timeout_ms)
                .unwrap_or(config::DEFAULT_CONSOLE_IDLE_TIMEOUT_MS),
        ),
        sample_interval: Duration::from_millis(
            f.sample_interval_ms
                .or(file.sample_interval_ms)
                .unwrap_or(config::DEFAULT_SAMPLE_INTERVAL_MS),
        ),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// `Some(source)` when CloudEvents headers are on (flag, variable or file; a source implies on).
fn cloudevents_source(a: &RunArgs, file: &FileConfig) -> Option<String> {
    let source = a
        .cloudevents_source
        .clone()
        .or(file.kafka.cloudevents_source.clone());
    let on = a.cloudevents || file.kafka.cloudevents.unwrap_or(false) || source.is_some();
    on.then(|| source.unwrap_or_else(|| outbox_sink::headers::DEFAULT_CLOUDEVENTS_SOURCE.into()))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    fn run_args(args: &[&str]) -> RunArgs {
        let mut a = vec!["--database-url", "postgres://h/db"];
        a.extend(args);
        bare_run_args(&a)
    }

    /// Writes `text` to `name` in `dir`; its path.
    fn write_file(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
        let file = dir.path().join(name);
        std::fs::write(&file, text).unwrap();
        file.to_str().unwrap().to_string()
    }

    /// `outboxd run` with `args` only.
    fn bare_run_args(args: &[&str]) -> RunArgs {
        let mut argv = vec!["outboxd", "run"];
        argv.extend(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Run(a) => *a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_nats_sink_comes_from_the_config_file_and_flags_win() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("outboxd.toml");
        std::fs::write(
            &file,
            "sink = \"nats\"\n[nats]\nurl = \"nats://n:4222\"\ncluster_name = \"nats-a\"\nstream = \"EVENTS\"\nack_timeout_ms = 750\n",
        )
        .unwrap();
        let path = file.to_str().unwrap();
        let cfg = resolve_run(&run_args(&["--config", path])).unwrap();
        let n = cfg.nats.expect("sink = nats");
        assert_eq!(
            (n.url.as_str(), n.cluster_name.as_str(), n.stream.as_str()),
            ("nats://n:4222", "nats-a", "EVENTS")
        );
        assert_eq!(n.ack_timeout, Duration::from_millis(750));
        assert!(!n.create_stream);

        let cfg = resolve_run(&run_args(&[
            "--config",
            path,
            "--nats-stream",
            "OTHER",
            "--nats-create-stream",
            "--cluster-name",
            "nats-b",
        ]))
        .unwrap();
        let n = cfg.nats.unwrap();
        assert_eq!(
            (n.stream.as_str(), n.cluster_name.as_str()),
            ("OTHER", "nats-b")
        );
        assert!(n.create_stream);

        // Kafka stays the default and still needs its bootstrap servers.
        let e = resolve_run(&run_args(&[])).unwrap_err();
        assert!(e.to_string().contains("--sink nats"), "{e}");
        let e = resolve_run(&run_args(&["--sink", "nats"])).unwrap_err();
        assert!(e.to_string().contains("--nats-url"), "{e}");
    }

    #[test]
    fn versions_in_flight_per_aggregate_come_from_the_flag_or_the_file_and_are_kafka_cdc_only() {
        let dir = tempfile::tempdir().unwrap();
        let k = ["--bootstrap-servers", "k:9092"];
        let plain = resolve_run(&run_args(&k)).unwrap();
        assert_eq!(plain.sink.in_flight_per_aggregate, 1);
        let path = write_file(&dir, "d.toml", "[kafka]\nin_flight_per_aggregate = 8\n");
        let file = resolve_run(&run_args(&[k[0], k[1], "--config", &path])).unwrap();
        assert_eq!(file.sink.in_flight_per_aggregate, 8);
        let flag = resolve_run(&run_args(&[
            k[0],
            k[1],
            "--config",
            &path,
            "--in-flight-per-aggregate",
            "4",
        ]))
        .unwrap();
        assert_eq!(flag.sink.in_flight_per_aggregate, 4, "the flag wins");
        let too_many = write_file(&dir, "x.toml", "[kafka]\nin_flight_per_aggregate = 65\n");
        let e = resolve_run(&run_args(&[k[0], k[1], "--config", &too_many])).unwrap_err();
        assert!(e.to_string().contains("1 to 64"), "{e}");
        for (args, says) in [
            (vec!["--mode", "poll"], "--mode cdc"),
            (vec!["--delivery", "exactly-once"], "exactly-once mode"),
        ] {
            let mut all = vec![k[0], k[1], "--in-flight-per-aggregate", "4"];
            all.extend(args);
            let e = resolve_run(&run_args(&all)).unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
        }
        let e = resolve_run(&run_args(&[
            "--sink",
            "nats",
            "--nats-url",
            "nats://n:4222",
            "--in-flight-per-aggregate",
            "2",
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("Kafka only"), "{e}");
        let random = write_file(
            &dir,
            "r.toml",
            "[kafka]\nin_flight_per_aggregate = 4\npartitioner = \"random\"\n",
        );
        let e = resolve_run(&run_args(&[k[0], k[1], "--config", &random])).unwrap_err();
        assert!(e.to_string().contains("needs a key partitioner"), "{e}");
    }

    #[test]
    fn exactly_once_comes_from_the_kafka_section_or_the_flag_and_is_refused_where_it_cannot_hold() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| write_file(&dir, name, text);
        let plain = resolve_run(&run_args(&["--bootstrap-servers", "k:9092"])).unwrap();
        assert_eq!(plain.delivery, crate::values::Delivery::AtLeastOnce);
        assert_eq!(plain.positions_topic, "outboxd.positions");
        let path = write(
            "eo.toml",
            "[kafka]\ndelivery = \"exactly-once\"\npositions_topic = \"shop.positions\"\n",
        );
        let cfg = resolve_run(&run_args(&[
            "--bootstrap-servers",
            "k:9092",
            "--config",
            &path,
        ]))
        .unwrap();
        assert_eq!(
            (cfg.delivery, cfg.positions_topic.as_str()),
            (crate::values::Delivery::ExactlyOnce, "shop.positions")
        );
        let flag = resolve_run(&run_args(&[
            "--bootstrap-servers",
            "k:9092",
            "--delivery",
            "exactly-once",
        ]))
        .unwrap();
        assert_eq!(flag.delivery, crate::values::Delivery::ExactlyOnce);
        let poll = resolve_run(&run_args(&[
            "--bootstrap-servers",
            "k:9092",
            "--delivery",
            "exactly-once",
            "--mode",
            "poll",
        ]));
        assert!(
            poll.unwrap_err().to_string().contains("needs --mode cdc"),
            "poll mode accepted"
        );
        let nats = write(
            "nats.toml",
            "sink = \"nats\"\n[nats]\nurl = \"nats://n:4222\"\n[kafka]\ndelivery = \"exactly-once\"\n",
        );
        let err = resolve_run(&run_args(&["--config", &nats])).unwrap_err();
        assert!(err.to_string().contains("Kafka only"), "{err}");
    }

    #[test]
    fn http_endpoints_take_what_they_do_not_set_from_http_and_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| write_file(&dir, name, text);
        let path = write(
            "two.toml",
            "sink = \"http\"\n[http]\nmax_concurrency = 8\nsigning_secrets = [\"whsec_shared\"]\n\
             [http.headers]\nX-Shared = \"s\"\nx-partner = \"shared\"\n\
             [[http.endpoints]]\nendpoint = \"b\"\nheaders = { X-Partner = \"b\" }\n\
             [[http.endpoints]]\nendpoint = \"a\"\nmax_concurrency = 2\nsigning_secrets = [\"whsec_a\"]\n\
             unclear_schedule_ms = [0, 1000]\n",
        );
        let cfg = resolve_run(&run_args(&["--config", &path])).unwrap();
        let schedules: Vec<(&str, usize)> = cfg
            .endpoint_schedules
            .iter()
            .map(|(k, s)| (k.as_str(), s.steps().len()))
            .collect();
        assert_eq!(schedules, vec![("a", 2)], "only a sets its own schedule");
        let got: Vec<_> = cfg
            .http
            .iter()
            .map(|h| {
                (
                    h.endpoint.as_str(),
                    h.max_concurrency,
                    h.signing_secrets.clone(),
                    h.headers.clone(),
                )
            })
            .collect();
        let hdr = |k: &str, v: &str| (k.to_string(), v.to_string());
        assert_eq!(
            got,
            vec![
                (
                    "b",
                    8,
                    vec!["whsec_shared".to_string()],
                    vec![hdr("X-Partner", "b"), hdr("X-Shared", "s")]
                ),
                (
                    "a",
                    2,
                    vec!["whsec_a".to_string()],
                    vec![hdr("X-Shared", "s"), hdr("x-partner", "shared")]
                ),
            ]
        );
        // Refused: a flag naming one endpoint, a top-level name, an entry without a name, a
        // name given twice.
        let e = resolve_run(&run_args(&["--config", &path, "--http-endpoint", "x"])).unwrap_err();
        assert!(format!("{e:#}").contains("--http-endpoint"), "{e:#}");
        for (text, says) in [
            (
                "sink = \"http\"\n[http]\nendpoint = \"top\"\n[[http.endpoints]]\nendpoint = \"a\"\n",
                "http.endpoint \"top\"",
            ),
            (
                "sink = \"http\"\n[[http.endpoints]]\nmethod = \"PUT\"\n",
                "entry 1 has no endpoint name",
            ),
            (
                "sink = \"http\"\n[[http.endpoints]]\nendpoint = \"a\"\n[[http.endpoints]]\nendpoint = \"a\"\n",
                "configured twice",
            ),
            (
                "sink = \"http\"\n[[http.endpoints]]\nendpoint = \"a\"\nmax_concurrency = 0\n",
                "endpoint \"a\": http.max_concurrency",
            ),
            (
                "sink = \"http\"\n[[http.endpoints]]\nendpoint = \"a\"\nunclear_schedule_ms = [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]\n",
                "endpoint \"a\": http.unclear_schedule_ms",
            ),
        ] {
            let path = write("bad.toml", text);
            let e = resolve_run(&run_args(&["--config", &path])).unwrap_err();
            assert!(format!("{e:#}").contains(says), "{text}: {e:#}");
        }
    }

    #[test]
    fn a_fleet_members_stop_grace_comes_from_the_flag_the_file_or_the_default() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(&dir, "grace.toml", "[relay]\nfleet_stop_grace_ms = 4000\n");
        let grace = |args: &[&str]| {
            let mut all = vec!["--bootstrap-servers", "k:9092"];
            all.extend(args);
            resolve_run(&run_args(&all)).map(|c| c.fleet_stop_grace)
        };
        assert_eq!(grace(&[]).unwrap(), config::FLEET_STOP_GRACE);
        assert_eq!(grace(&["--config", &path]).unwrap(), Duration::from_secs(4));
        let flag = ["--config", &path, "--fleet-stop-grace-ms", "2500"];
        assert_eq!(grace(&flag).unwrap(), Duration::from_millis(2500));
        let e = grace(&["--fleet-stop-grace-ms", "500"]).unwrap_err();
        assert!(format!("{e:#}").contains("--fleet-stop-grace-ms"), "{e:#}");
    }

    #[test]
    fn databases_each_get_a_relay_with_their_own_names_and_the_shared_settings() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| write_file(&dir, name, text);
        let path = write(
            "many.toml",
            "slot = \"shared_slot\"\n[kafka]\nbootstrap_servers = \"k:9092\"\n[relay]\nlease_ttl_ms = 4000\n\
             [[databases]]\nname = \"orders\"\ndatabase_url = \"postgres://u:secret@h/orders_prod\"\n\
             [[databases]]\ndatabase_url = \"postgres://u@h/billing\"\nslot = \"billing_slot\"\ntable = \"app.outbox\"\n",
        );
        let runs = resolve_runs(&bare_run_args(&["--config", &path])).unwrap();
        let got: Vec<_> = runs
            .iter()
            .map(|c| {
                (
                    c.database.as_str(),
                    c.slot.as_str(),
                    c.schema.as_str(),
                    c.table.as_str(),
                    c.lease_ttl,
                    c.sink.bootstrap_servers.as_str(),
                )
            })
            .collect();
        let ttl = Duration::from_millis(4000);
        assert_eq!(
            got,
            vec![
                ("orders", "shared_slot", "outbox", "events", ttl, "k:9092"),
                ("billing", "billing_slot", "app", "outbox", ttl, "k:9092"),
            ]
        );
        // One database: `resolve_run` refuses a list.
        let e = resolve_run(&bare_run_args(&["--config", &path])).unwrap_err();
        assert!(e.to_string().contains("2 [[databases]]"), "{e}");
        // The URL's database name labels a single database too.
        let one = resolve_run(&bare_run_args(&[
            "--database-url",
            "postgres://u@h:5432/shop?sslmode=disable",
            "--bootstrap-servers",
            "k:9092",
        ]))
        .unwrap();
        assert_eq!(one.database, "shop");

        let refused = |text: &str, args: &[&str]| {
            let path = write("bad.toml", text);
            let mut all = vec!["--config", path.as_str()];
            all.extend(args);
            crate::one_line(&resolve_runs(&bare_run_args(&all)).unwrap_err())
        };
        let entry = "[kafka]\nbootstrap_servers = \"k\"\n[[databases]]\ndatabase_url = \"postgres://u@h/a\"\n";
        let e = refused(entry, &["--database-url", "postgres://u@h/b"]);
        assert!(e.contains("also given (--database-url"), "{e}");
        let e = refused(&format!("{entry}[[databases]]\nname = \"x\"\n"), &[]);
        assert!(e.contains("entry x has no database_url"), "{e}");
        let e = refused(
            &format!(
                "{entry}[[databases]]\ndatabase_url = \"postgres://u@h2/a\"\nslot = \"other\"\n"
            ),
            &[],
        );
        assert!(
            e.contains("two [[databases]] entries are named \"a\""),
            "{e}"
        );
        let e = refused(
            &format!("{entry}[[databases]]\nname = \"b\"\ndatabase_url = \"postgres://u@h/a\"\n"),
            &[],
        );
        assert!(
            e.contains("use slot \"outboxd\" of postgres://u@h/a"),
            "{e}"
        );
        let e = refused(&format!("{entry}name = \"a b\"\n"), &[]);
        assert!(
            e.contains("entry a b: database name \"a b\" is invalid"),
            "{e}"
        );
        let e = refused(&format!("{entry}slot = \"Bad-Slot\"\n"), &[]);
        assert!(
            e.contains("entry number 1: slot \"Bad-Slot\" is invalid"),
            "{e}"
        );
    }
}
