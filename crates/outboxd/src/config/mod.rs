//! Configuration: command-line flags > `OUTBOXD_*` environment variables > TOML config file >
//! defaults. The file is strict (`deny_unknown_fields`): a misspelt key is an error naming the
//! key, not a silently ignored setting. [`RelayConfig::validate`] names the field and the
//! constraint it breaks. The database URL may hold a password: it is kept in a [`Secret`]
//! that never prints.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use outbox_sink::{JetStreamSinkConfig, KafkaSinkConfig};
use serde::Deserialize;

use crate::values::SinkKind;

pub mod resolve;

/// A string that must never reach a log line or an error message.
#[derive(Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Renders a connection string (a PostgreSQL URL or key=value string; a NATS or webhook URL)
/// without its secrets, for messages: everything of a URL's user info but the user name, every
/// query parameter whose name (percent-decoded, as the connection's parser reads it) holds
/// `password`, `secret` or `token`, and a `password=` key of the key=value form are dropped.
///
/// The URL is read as tokio-postgres reads it, not as a browser would: its user info runs to
/// an `@` whatever comes before it, so a password may hold a raw `?`, `/`, `#` or `:` (a
/// WHATWG parser, the `url` crate's, ends the authority of `postgres://qq:Leak?Me99@h/db` at
/// the `?` and refuses the port `Leak`, though tokio-postgres connects with it; splitting at
/// the `?` first printed the password). A password holding a raw `@` moves tokio-postgres's
/// host into it, so the user info is taken to run to the *last* `@`. What cannot be told
/// apart from a password is not printed.
pub fn redact_url(url: &str) -> String {
    let scheme_end = url.find("://").filter(|&i| {
        let scheme = &url[..i];
        scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))
    });
    let Some(scheme_end) = scheme_end else {
        // key=value form: drop the password pair (quoted or not).
        let mut out = String::new();
        let mut rest = url;
        while let Some(i) = rest.find("password") {
            let (before, after) = rest.split_at(i);
            out.push_str(before);
            let after_key = after["password".len()..].trim_start();
            let at_word_start = before.is_empty() || before.ends_with(char::is_whitespace);
            match after_key.strip_prefix('=') {
                Some(v) if at_word_start => {
                    let v = v.trim_start();
                    let end = if let Some(q) = v.strip_prefix('\'') {
                        let mut esc = false;
                        q.char_indices()
                            .find(|&(_, c)| {
                                let end = c == '\'' && !esc;
                                esc = c == '\\' && !esc;
                                end
                            })
                            .map(|(j, _)| j + 2)
                            .unwrap_or(v.len())
                    } else {
                        v.find(char::is_whitespace).unwrap_or(v.len())
                    };
                    out.push_str("password=***");
                    rest = &v[end..];
                }
                _ => {
                    out.push_str("password");
                    rest = &after["password".len()..];
                }
            }
        }
        out.push_str(rest);
        return out;
    };
    let (scheme, rest) = (&url[..scheme_end], &url[scheme_end + 3..]);
    let (user, after) = match rest.rfind('@') {
        Some(at) => {
            let user = rest[..at].split(':').next().unwrap_or("");
            // A "user name" holding URL syntax is no user name: the '@' was a query's.
            let user = if user.contains(['/', '?', '#', '&', '=']) {
                "***"
            } else {
                user
            };
            (Some(user), &rest[at + 1..])
        }
        None => (None, rest),
    };
    let (base, query) = match after.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (after, None),
    };
    let mut out = format!("{scheme}://");
    if let Some(user) = user {
        out.push_str(user);
        out.push('@');
    }
    out.push_str(base);
    if let Some(q) = query {
        let kept: Vec<&str> = q
            .split('&')
            .filter(|pair| !secret_parameter(pair))
            .collect();
        if !kept.is_empty() {
            out.push('?');
            out.push_str(&kept.join("&"));
        }
    }
    out
}

/// Whether a `name=value` query pair names a secret: its name, percent-decoded (and `+` as a
/// space, as `url`'s form parser reads it), holds `password`, `secret` or `token`.
fn secret_parameter(pair: &str) -> bool {
    let name = pair.split('=').next().unwrap_or("");
    let decoded: String = url::form_urlencoded::parse(name.as_bytes())
        .map(|(k, _)| k.to_ascii_lowercase())
        .collect();
    // A name that does not decode (a lone '%') is read as written, lower-cased.
    let name = name.to_ascii_lowercase();
    ["password", "secret", "token"]
        .iter()
        .any(|s| decoded.contains(s) || name.contains(s))
}

/// The config file (`--config FILE`). Every key is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// PostgreSQL URL of the database holding the outbox (needs the REPLICATION attribute).
    pub database_url: Option<Secret>,
    /// Logical replication slot name. Default `outboxd`.
    pub slot: Option<String>,
    /// Publication on the outbox table. Default `outbox_pub`.
    pub publication: Option<String>,
    /// The outbox table, `schema.table`. Default `outbox.events`.
    pub table: Option<String>,
    /// The broker: `kafka` (default) or `nats` (JetStream).
    pub sink: Option<SinkKind>,
    #[serde(default)]
    pub kafka: KafkaFile,
    #[serde(default)]
    pub nats: NatsFile,
    #[serde(default)]
    pub http: HttpFile,
    #[serde(default)]
    pub relay: RelayFile,
    /// `text` (default) or `json` (one JSON object per line, with the span fields slot, db,
    /// generation). `--log-format` wins.
    pub log_format: Option<crate::values::LogFormat>,
    #[serde(default)]
    pub admin: AdminFile,
    #[serde(default)]
    pub reconcile: ReconcileFile,
    #[serde(default)]
    pub retention: RetentionFile,
    /// `[[databases]]`: several databases relayed by one process, each with its own slot,
    /// ledger and lease; everything else (broker, `[relay]`) is shared. Instead of
    /// `database_url` (and `--database-url`).
    #[serde(default)]
    pub databases: Vec<DatabaseFile>,
}

/// One `[[databases]]` entry.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseFile {
    /// The `database` label of its metrics and the name in its log lines. Default: the URL's
    /// database name.
    pub name: Option<String>,
    /// PostgreSQL URL of the database (needs the REPLICATION attribute).
    pub database_url: Option<Secret>,
    /// Its slot (the lease's name in poll mode). Default: the top-level `slot`, else `outboxd`.
    pub slot: Option<String>,
    /// Its publication. Default: the top-level `publication`, else `outbox_pub`.
    pub publication: Option<String>,
    /// Its outbox table. Default: the top-level `table`, else `outbox.events`.
    pub table: Option<String>,
}

/// `[admin]` section: the HTTP endpoints (`/metrics`, `/healthz`, `/readyz`) and the
/// read-only admin console (PostgreSQL wire protocol). Both are off unless an address is set.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminFile {
    /// HTTP address, `HOST:PORT` (or a bare port, bound on 127.0.0.1).
    pub addr: Option<String>,
    /// Admin console address, `HOST:PORT` (or a bare port, bound on 127.0.0.1).
    pub console_addr: Option<String>,
    /// The user name the console accepts. Default `outboxd`.
    pub console_user: Option<String>,
    /// The console password (md5 authentication); without one the console trusts every
    /// local connection. Required when the console listens on a non-loopback address.
    pub console_password: Option<Secret>,
    /// Console connections open at once; one more is refused (`too many connections`).
    /// Default 16.
    pub console_max_connections: Option<usize>,
    /// A console connection not authenticated within this is closed, ms. Default 10000.
    pub console_login_timeout_ms: Option<u64>,
    /// A console connection that sends nothing for this long is closed, ms. Default 600000.
    pub console_idle_timeout_ms: Option<u64>,
    /// How often the gauges read from PostgreSQL (lag, pending, UNKNOWN, holds) and the broker
    /// probe behind `/readyz` are refreshed, ms. Default 5000.
    pub sample_interval_ms: Option<u64>,
}

/// `[nats]` section (used with `sink = "nats"`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsFile {
    /// Server URL(s), e.g. `nats://nats-1:4222`.
    pub url: Option<String>,
    /// Cluster identity this relay serves: the server's cluster name (its server name when
    /// unclustered), and the `dest_cluster` events are frozen with. Default `default`.
    pub cluster_name: Option<String>,
    /// The JetStream stream capturing the frozen subjects. Default `OUTBOX`.
    pub stream: Option<String>,
    /// Create the stream at start when missing. Default false (a missing stream is an error).
    pub create_stream: Option<bool>,
    /// Subjects of a stream the relay creates. Default `["outbox.>"]`.
    pub stream_subjects: Option<Vec<String>>,
    /// Duplicate window of a stream the relay creates, ms. Default 120000.
    pub duplicate_window_ms: Option<u64>,
    /// How long a publish waits for its PubAck before the outcome is UNKNOWN, ms. Default 5000.
    pub ack_timeout_ms: Option<u64>,
    /// User name for a server that requires user/password (with `password`).
    pub user: Option<String>,
    /// Password of `user` (or `OUTBOXD_NATS_PASSWORD`). Never printed.
    pub password: Option<Secret>,
    /// Token for a server that requires one (or `OUTBOXD_NATS_TOKEN`). Never printed.
    pub token: Option<Secret>,
    /// File holding a user NKey seed (`SU...`, as `nk -gen user` or `nsc` write it), for a
    /// server whose authorization block lists the user's public NKey. Keep it readable by
    /// the service user only; the seed is never printed.
    pub nkey_seed_file: Option<std::path::PathBuf>,
    /// PEM file of CA certificates verifying the server's TLS certificate (implies
    /// `require_tls`).
    pub ca_file: Option<std::path::PathBuf>,
    /// Refuse a server that does not offer TLS. Default false.
    pub require_tls: Option<bool>,
}

/// The NATS credentials and TLS settings: flags and environment > `[nats]` > none. Checked:
/// a password needs a user, a user needs a password, user/password and token exclude each
/// other, and the URL must not hold credentials (async-nats would not use them, and they
/// would be printed with it); each error names the setting to use.
/// The user NKey seed in `path`: its first non-empty line, which must be a user seed (`SU`).
/// Errors name the file, never its content.
fn read_nkey_seed(path: &std::path::Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!(
            "nats.nkey_seed_file (--nats-nkey-seed-file) {}: {e}",
            path.display()
        )
    })?;
    let seed = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or_default();
    if !seed.starts_with("SU") {
        bail!(
            "nats.nkey_seed_file (--nats-nkey-seed-file) {} does not hold a user NKey seed (a line starting with SU, as `nk -gen user` writes it)",
            path.display()
        );
    }
    Ok(seed.to_string())
}

/// Where a command's `DbArgs` resolve: here with the rest of the configuration's resolution.
impl crate::cli::DbArgs {
    /// The URL: the flag or its variable, else the config file's `database_url`.
    pub fn url(&self) -> anyhow::Result<String> {
        if let Some(url) = &self.database_url {
            return Ok(url.clone());
        }
        if let Some(path) = &self.config {
            let file = FileConfig::load(path)?;
            if let Some(url) = &file.database_url {
                return Ok(url.expose().to_string());
            }
            anyhow::bail!(
                "database URL is missing: {} has no database_url; pass --database-url or set OUTBOXD_DATABASE_URL",
                path.display()
            );
        }
        anyhow::bail!(
            "database URL is missing: pass --database-url, set OUTBOXD_DATABASE_URL, or --config FILE (OUTBOXD_CONFIG) with database_url"
        )
    }
}

pub fn resolve_nats_auth(
    a: &crate::cli::NatsAuthArgs,
    file: &NatsFile,
    url: &str,
) -> anyhow::Result<outbox_sink::NatsAuth> {
    if outbox_sink::jetstream::url_has_credentials(url) {
        bail!(
            "the NATS URL {} holds credentials, which are not used from a URL: remove them from it and set nats.user + nats.password (--nats-user, OUTBOXD_NATS_PASSWORD) or nats.token (OUTBOXD_NATS_TOKEN)",
            url.split(',').map(redact_url).collect::<Vec<_>>().join(",")
        );
    }
    let auth = outbox_sink::NatsAuth {
        user: a.nats_user.clone().or(file.user.clone()),
        password: a
            .nats_password
            .clone()
            .or(file.password.as_ref().map(|p| p.expose().to_string())),
        token: a
            .nats_token
            .clone()
            .or(file.token.as_ref().map(|t| t.expose().to_string())),
        nkey_seed: match a
            .nats_nkey_seed_file
            .as_ref()
            .or(file.nkey_seed_file.as_ref())
        {
            None => None,
            Some(path) => Some(read_nkey_seed(path)?),
        },
        ca_file: a.nats_ca_file.clone().or(file.ca_file.clone()),
        require_tls: a.nats_require_tls || file.require_tls.unwrap_or(false),
    };
    match (&auth.user, &auth.password, &auth.token) {
        (Some(_), None, _) => bail!("nats.user (--nats-user) is set but no password: set OUTBOXD_NATS_PASSWORD (or nats.password)"),
        (None, Some(_), _) => bail!("a NATS password is set (OUTBOXD_NATS_PASSWORD / nats.password) but no user: set nats.user (--nats-user)"),
        _ => {}
    }
    let methods = [
        auth.user.is_some(),
        auth.token.is_some(),
        auth.nkey_seed.is_some(),
    ];
    if methods.iter().filter(|m| **m).count() > 1 {
        bail!("more than one NATS authentication is set (user/password, token, NKey seed file): a server takes one of them; keep the one its authorization block names");
    }
    if let Some(ca) = &auth.ca_file {
        if !ca.is_file() {
            bail!(
                "nats.ca_file (--nats-ca-file) {} is not a readable file",
                ca.display()
            );
        }
    }
    Ok(auth)
}

/// `[http]` section (used with `sink = "http"`): the HTTP endpoint (webhooks), or with
/// `[[http.endpoints]]` the settings every endpoint shares unless its entry sets its own.
///
/// ```toml
/// [http]
/// max_concurrency = 16             # shared by both endpoints below
/// [[http.endpoints]]
/// endpoint = "partner-a"           # the name its routes give it
/// signing_secrets = ["whsec_..."]
/// [[http.endpoints]]
/// endpoint = "partner-b"
/// headers = { Authorization = "Bearer ..." }
/// ```
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpFile {
    /// The endpoint's name in its routes (`outbox.set_http_route`). Default `default`. In a
    /// `[[http.endpoints]]` entry: that endpoint's name (required).
    pub endpoint: Option<String>,
    /// Several endpoints served by one relay, each an `[[http.endpoints]]` entry with its own
    /// `endpoint` name and any of the keys above; a key an entry does not set is taken from
    /// `[http]`, then the default (headers: `[http]`'s, then the entry's over them).
    #[serde(default)]
    pub endpoints: Vec<HttpFile>,
    /// `POST` (default) or `PUT`.
    pub method: Option<String>,
    /// The header carrying the event id. Default `Idempotency-Key`.
    pub idempotency_header: Option<String>,
    /// A header of the endpoint's answer naming what it created (logged with the receipt).
    pub response_id_header: Option<String>,
    /// How long one request may take before its outcome is unknown, ms. Default 10000.
    pub request_timeout_ms: Option<u64>,
    /// How long one send may keep asking again after 408/429/503 before the event is replayed,
    /// ms (`--message-timeout-ms`). Default 30000.
    pub deadline_ms: Option<u64>,
    /// Requests in flight at once. Default 64.
    pub max_concurrency: Option<usize>,
    /// How long the endpoint keeps idempotency keys, ms, if it declares it: a retry of an
    /// UNKNOWN send with the same key inside it proves the event applied once.
    pub idempotency_window_ms: Option<u64>,
    /// Headers added to every request, e.g. `Authorization = "Bearer ..."`. Never logged.
    #[serde(default)]
    pub headers: BTreeMap<String, Secret>,
    /// A PEM file of CA certificates trusted for `https://` endpoints, besides the system's.
    pub ca_file: Option<std::path::PathBuf>,
    /// Standard Webhooks signing secrets (`whsec_...` HMAC, `whsk_...` ed25519): each request
    /// is signed with each.
    /// Never printed.
    #[serde(default)]
    pub signing_secrets: Vec<Secret>,
    /// This endpoint's retry schedule for unclear answers, ms (as `[relay]
    /// unclear_schedule_ms`, which applies where an endpoint sets none): the waits after the
    /// first, second, ... unclear answer, the last repeating; past its steps the relay says so.
    pub unclear_schedule_ms: Option<Vec<u64>>,
}

/// `[kafka]` section.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaFile {
    pub bootstrap_servers: Option<String>,
    /// Broker cluster identity this relay serves; events frozen for another cluster are
    /// quarantined, never sent here. Default `default`.
    pub cluster_name: Option<String>,
    /// librdkafka partitioner; must match the events' frozen `dest_partitioner`.
    /// Default `murmur2_random` (Java-client compatible).
    pub partitioner: Option<String>,
    pub message_timeout_ms: Option<u64>,
    /// librdkafka `linger.ms` of the main producer. Default 2.
    pub linger_ms: Option<u64>,
    /// While fewer messages than this are outstanding, send through the express lane (a
    /// second producer without linger): a backlog of a few hot aggregates is bound by the
    /// broker round trip per event, not by volume (used only while more events wait behind
    /// their aggregates than are in flight). 0 disables it. Default 32.
    pub express_max_in_flight: Option<u32>,
    /// How many events of one aggregate may be in flight at once (1-64; `--in-flight-per-aggregate`).
    /// Default 1.
    pub in_flight_per_aggregate: Option<u8>,
    /// CloudEvents 1.0 binary-mode headers on every message. Default false.
    pub cloudevents: Option<bool>,
    /// CloudEvents `source`; `{aggregate_type}` is replaced. Default
    /// `/outboxd/{aggregate_type}`. Setting it turns CloudEvents on.
    pub cloudevents_source: Option<String>,
    /// `at-least-once` (the default) or `exactly-once` (docs/exactly_once.md).
    pub delivery: Option<crate::values::Delivery>,
    /// Exactly-once mode: the topic that holds each committed batch's record. Default
    /// `outboxd.positions`; created at start when the brokers lack it (one partition).
    pub positions_topic: Option<String>,
    /// librdkafka properties passed through verbatim (e.g. `"security.protocol" = "SSL"`).
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

/// `[relay]` section.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayFile {
    pub max_in_flight: Option<u64>,
    pub batch_size: Option<usize>,
    pub batch_linger_ms: Option<u64>,
    pub status_interval_ms: Option<u64>,
    pub heartbeat_interval_ms: Option<u64>,
    pub lease_ttl_ms: Option<u64>,
    /// `--fleet-stop-grace-ms`.
    pub fleet_stop_grace_ms: Option<u64>,
    pub relay_id: Option<String>,
    pub unknown_settle_ms: Option<u64>,
    pub unclear_budget: Option<u32>,
    /// Events waiting on unclear outcomes before the slot is not read (`--unclear-max-waiting`).
    pub unclear_max_waiting: Option<u64>,
    /// Waits after each unclear outcome of one event, ms (the last repeats), instead of the
    /// doubling from 200 ms to 10 s; e.g. `[0, 5000, 300000, 1800000, 7200000]`.
    pub unclear_schedule_ms: Option<Vec<u64>>,
    pub mode: Option<crate::values::RunMode>,
    pub poll_interval_ms: Option<u64>,
}

/// `[reconcile]` section (`outboxd reconcile`). Durations are text: `30s`, `5m`, `12h`, `7d`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcileFile {
    /// PENDING older than this is reported. Default `5m`.
    pub pending_after: Option<String>,
    /// DISPATCH_UNKNOWN older than this is reported. Default `15m`.
    pub unknown_after: Option<String>,
    /// Published but not applied by a mandatory consumer after this is reported. Default `1h`.
    pub unconsumed_after: Option<String>,
    /// Extra topics to scan for bypass publishes (the outbox's own topics are always scanned).
    #[serde(default)]
    pub topics: Vec<String>,
    /// Receipts audited against the broker: `all`, `none`, `sample=N`, `last=DURATION`.
    /// Default `last=24h`.
    pub audit_receipts: Option<String>,
}

/// `[retention]` section (`outboxd purge`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionFile {
    /// Events published within this window are kept. Default `7d`.
    pub replay_window: Option<String>,
    /// Inbox rows consumed within this window are kept; at least the replay window, and
    /// should cover the broker's retention of the topics. Default: the replay window.
    pub inbox_retention: Option<String>,
    /// Rows per delete transaction. Default 1000.
    pub batch_size: Option<i64>,
    /// When set, `outboxd run` purges with these settings on this schedule (e.g. `1h`).
    /// Default: no background purge (run `outboxd purge` from cron instead).
    pub purge_interval: Option<String>,
}

impl FileConfig {
    pub fn load(path: &Path) -> anyhow::Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        toml::from_str(&text).map_err(|e| {
            let line = e
                .span()
                .map(|s| text[..s.start.min(text.len())].lines().count().max(1));
            anyhow::anyhow!(
                "config file {}{}: {}",
                path.display(),
                line.map(|l| format!(" line {l}")).unwrap_or_default(),
                e.message().trim().replace('\n', " ")
            )
        })
    }
}

/// Everything the relay needs, resolved and validated.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// The `database` label of the metrics and the `database` field of the log lines: the
    /// `[[databases]]` entry's name, else the URL's database name.
    pub database: String,
    pub database_url: Secret,
    pub slot: String,
    pub publication: String,
    pub schema: String,
    pub table: String,
    /// Kafka settings (used unless `nats` is set).
    pub sink: KafkaSinkConfig,
    /// JetStream settings: when set, the relay publishes to NATS JetStream instead of Kafka.
    pub nats: Option<JetStreamSinkConfig>,
    /// HTTP settings, one per endpoint: when not empty, the relay sends to these HTTP
    /// endpoints instead of Kafka.
    pub http: Vec<outbox_sink::HttpSinkConfig>,
    /// Events sent and not yet resolved before the relay stops reading the slot.
    pub max_in_flight: u64,
    /// Receipts per ledger transaction.
    pub batch_size: usize,
    /// Longest a receipt waits for its batch to fill.
    pub batch_linger: Duration,
    /// Standby status update period (the slot also hears from us on every checkpoint).
    pub status_interval: Duration,
    /// `pg_logical_emit_message` period, so an idle database does not retain WAL.
    pub heartbeat_interval: Duration,
    /// Recreate the slot and publish every outbox row without a receipt.
    pub resnapshot: bool,
    /// This relay's identity in the lease table (default: host-pid-random).
    pub relay_id: String,
    /// How long a lease lasts without renewal; a standby takes over after it expires.
    pub lease_ttl: Duration,
    /// A fleet member: how long a shard relay told to stop may take before it is aborted.
    pub fleet_stop_grace: Duration,
    /// How long after an attempt became DISPATCH_UNKNOWN (and its producer session was closed)
    /// the partition scan may conclude that the broker does not have it.
    pub unknown_settle: Duration,
    /// Unclear outcomes of one event (sends and look-ups) before the relay logs an error
    /// about it (it keeps asking).
    pub unclear_budget: u32,
    /// Events waiting on unclear outcomes (parked, sent and unanswered for 5 s, or queued
    /// behind either in their aggregate) before the relay stops reading the slot; they do not
    /// count against `max_in_flight`.
    pub unclear_max_waiting: u64,
    /// The operator's retry schedule for unclear outcomes, if any (else the doubling).
    pub unclear_schedule: Option<outbox_relay::UnclearSchedule>,
    /// Webhook endpoints' own retry schedules, by endpoint name (`[[http.endpoints]]
    /// unclear_schedule_ms`), over `unclear_schedule` for the events frozen for them.
    pub endpoint_schedules: BTreeMap<String, outbox_relay::UnclearSchedule>,
    /// CDC (the slot) or poll (queries); in poll mode `slot` names the lease.
    pub mode: crate::values::RunMode,
    /// Poll mode: the pause after a round that found nothing new.
    pub poll_interval: Duration,
    /// The shard this relay publishes, in a sharded outbox (`--shard I/N`); `slot` and
    /// `publication` are then the shard's (`<name>_shard<I>of<N>`).
    pub shard: Option<outbox_source::shard::Shard>,
    /// At least once, or exactly once into Kafka (docs/exactly_once.md).
    pub delivery: crate::values::Delivery,
    /// Exactly-once mode: the topic of the committed batches' records.
    pub positions_topic: String,
}

/// The positions topic's default name (exactly-once mode).
pub const DEFAULT_POSITIONS_TOPIC: &str = "outboxd.positions";

/// The admin endpoints, resolved (flags > environment > `[admin]` in the file > defaults).
#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub http_addr: Option<SocketAddr>,
    pub console_addr: Option<SocketAddr>,
    pub console_user: String,
    pub console_password: Option<Secret>,
    /// Console connections open at once.
    pub console_max_connections: usize,
    /// A console connection must have authenticated within this.
    pub console_login_timeout: Duration,
    /// A console connection silent for this long is closed.
    pub console_idle_timeout: Duration,
    pub sample_interval: Duration,
}

pub const DEFAULT_CONSOLE_USER: &str = "outboxd";
pub const DEFAULT_CONSOLE_MAX_CONNECTIONS: usize = 16;
pub const DEFAULT_CONSOLE_LOGIN_TIMEOUT_MS: u64 = 10_000;
pub const DEFAULT_CONSOLE_IDLE_TIMEOUT_MS: u64 = 600_000;
pub const DEFAULT_SAMPLE_INTERVAL_MS: u64 = 5000;

impl AdminConfig {
    /// Whether anything is served at all.
    pub fn enabled(&self) -> bool {
        self.http_addr.is_some() || self.console_addr.is_some()
    }

    /// Checks the combination; the error names the setting and the fix.
    pub fn validate(&self) -> anyhow::Result<()> {
        if let Some(a) = self.console_addr {
            if !a.ip().is_loopback() && self.console_password.is_none() {
                bail!("admin console address {a} is reachable from other hosts but no console password is set: set OUTBOXD_CONSOLE_PASSWORD (or admin.console_password), or bind the console to 127.0.0.1");
            }
            if Some(a) == self.http_addr && a.port() != 0 {
                bail!("--admin-addr and --console-addr are both {a}: give each its own port");
            }
        }
        if self.console_user.is_empty() {
            bail!("admin.console_user must not be empty");
        }
        if self.console_max_connections == 0 {
            bail!("admin.console_max_connections (--console-max-connections) must be at least 1");
        }
        if self.console_login_timeout < Duration::from_millis(100) {
            bail!(
                "admin.console_login_timeout_ms (--console-login-timeout-ms) must be at least 100"
            );
        }
        if self.console_idle_timeout < Duration::from_secs(1) {
            bail!(
                "admin.console_idle_timeout_ms (--console-idle-timeout-ms) must be at least 1000"
            );
        }
        if self.sample_interval < Duration::from_millis(50) {
            bail!("admin.sample_interval_ms must be at least 50");
        }
        Ok(())
    }
}

/// Parses a listen address: `HOST:PORT`, `[v6]:PORT`, or a bare `PORT` (bound on 127.0.0.1,
/// so nothing is exposed beyond the host unless asked for).
pub fn parse_listen_addr(what: &str, s: &str) -> anyhow::Result<SocketAddr> {
    let s = s.trim();
    if let Ok(port) = s.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.to_socket_addrs()
        .ok()
        .and_then(|mut it| it.next())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{what} {s:?} is invalid: expected HOST:PORT (e.g. 127.0.0.1:9187) or a port"
            )
        })
}

pub const DEFAULT_SLOT: &str = "outboxd";
pub const DEFAULT_PUBLICATION: &str = "outbox_pub";
pub const DEFAULT_TABLE: &str = "outbox.events";
/// `relay.max_in_flight` when unset (docs/benchmarks.md, "Thin LTO and 3,000 in flight").
pub const DEFAULT_MAX_IN_FLIGHT: u64 = 3_000;
/// `relay.unclear_max_waiting` when unset: about 24 MiB plus the payloads of events kept
/// while their aggregates wait (measured 1.2 KiB each with a 50-byte payload), a bound that
/// only an outage of a busy destination reaches.
pub const DEFAULT_UNCLEAR_MAX_WAITING: u64 = 20_000;

impl RelayConfig {
    /// Checks every field; the error names the field and the rule.
    pub fn validate(&self) -> anyhow::Result<()> {
        let url = self.database_url.expose();
        if url.is_empty() {
            bail!("database URL is missing: pass --database-url, set OUTBOXD_DATABASE_URL, or set database_url in the config file");
        }
        outbox_source::tls::PgConnectOptions::parse(url)
            .map_err(|e| anyhow::anyhow!("database URL {} is invalid: {e}", redact_url(url)))?;
        if self.database.is_empty()
            || !self
                .database
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        {
            bail!(
                "database name {:?} is invalid: 1 or more characters of a-z, A-Z, 0-9, '_', '-' and '.' (it labels the metrics)",
                self.database
            );
        }
        let ident_ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 63
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        };
        if !ident_ok(&self.slot) {
            bail!(
                "slot {:?} is invalid: PostgreSQL slot names are 1-63 characters of a-z, 0-9 and _",
                self.slot
            );
        }
        if self.publication.is_empty() || self.publication.len() > 63 {
            bail!(
                "publication {:?} is invalid: 1-63 characters",
                self.publication
            );
        }
        if !self.http.is_empty() {
            let mut names = std::collections::BTreeSet::new();
            for h in &self.http {
                validate_http(h)?;
                if !names.insert(h.endpoint.as_str()) {
                    bail!("http endpoint {:?} is configured twice: each [[http.endpoints]] entry needs its own endpoint name", h.endpoint);
                }
            }
        } else if let Some(n) = &self.nats {
            if n.url.trim().is_empty() {
                bail!("NATS URL is missing: pass --nats-url, set OUTBOXD_NATS_URL, or nats.url in the config file");
            }
            if n.stream.is_empty()
                || n.stream
                    .chars()
                    .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
            {
                bail!(
                    "nats.stream {:?} is invalid: a JetStream stream name has no spaces, '.', '*', '>', '/' or '\\'",
                    n.stream
                );
            }
            if n.duplicate_window < Duration::from_secs(1) {
                bail!("nats.duplicate_window_ms must be at least 1000");
            }
            if n.ack_timeout < Duration::from_millis(100) {
                bail!("the NATS ack timeout (--message-timeout-ms / nats.ack_timeout_ms) must be at least 100 ms");
            }
        } else if self.sink.bootstrap_servers.trim().is_empty() {
            bail!("Kafka bootstrap servers are missing: pass --bootstrap-servers, set OUTBOXD_BOOTSTRAP_SERVERS, or kafka.bootstrap_servers in the config file (or choose --sink nats)");
        }
        if let Some(s) = self.shard {
            if self.mode == crate::values::RunMode::Poll {
                bail!("--shard {s} needs --mode cdc: a poll-mode relay reads every aggregate");
            }
            if (self.schema.as_str(), self.table.as_str()) != ("outbox", "events") {
                bail!(
                    "--shard {s}: a sharded outbox is outbox.events, not {}.{}",
                    self.schema,
                    self.table
                );
            }
        }
        if self.max_in_flight == 0 {
            bail!("relay.max_in_flight must be at least 1");
        }
        if self.unclear_max_waiting == 0 {
            bail!("relay.unclear_max_waiting must be at least 1");
        }
        if self.batch_size == 0 {
            bail!("relay.batch_size must be at least 1");
        }
        if self.status_interval < Duration::from_millis(10) {
            bail!("relay.status_interval_ms must be at least 10");
        }
        if self.fleet_stop_grace < Duration::from_millis(1000) {
            bail!("relay.fleet_stop_grace_ms (--fleet-stop-grace-ms) must be at least 1000: a shard relay's graceful stop drains its sends for up to 10 s, and one aborted sooner leaves them to be sent again");
        }
        if self.lease_ttl < Duration::from_millis(300) {
            bail!("relay.lease_ttl_ms must be at least 300");
        }
        if self.relay_id.is_empty() {
            bail!("relay.relay_id must not be empty");
        }
        if self.heartbeat_interval < Duration::from_millis(100) {
            bail!("relay.heartbeat_interval_ms must be at least 100");
        }
        for (k, _) in &self.sink.properties {
            if k == "enable.idempotence" || k == "acks" {
                bail!("kafka property {k:?} cannot be set: outboxd always uses enable.idempotence=true and acks=all (its delivery guarantees depend on them)");
            }
        }
        Ok(())
    }
}

/// One HTTP endpoint's settings; each error names the endpoint.
pub fn validate_http(h: &outbox_sink::HttpSinkConfig) -> anyhow::Result<()> {
    if h.endpoint.trim().is_empty() {
        bail!("http.endpoint must name the endpoint (the name its routes give it; in [[http.endpoints]] every entry needs one)");
    }
    let at = format!("endpoint {:?}", h.endpoint);
    if !matches!(h.method.to_ascii_uppercase().as_str(), "POST" | "PUT") {
        bail!(
            "{at}: http.method {:?} is not supported: use POST or PUT",
            h.method
        );
    }
    if h.request_timeout < Duration::from_millis(100) {
        bail!("{at}: http.request_timeout_ms must be at least 100");
    }
    if h.deadline < h.request_timeout {
        bail!("{at}: the HTTP deadline (--message-timeout-ms / http.deadline_ms) must be at least http.request_timeout_ms");
    }
    if h.max_concurrency == 0 {
        bail!("{at}: http.max_concurrency must be at least 1");
    }
    let token = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c))
    };
    for name in h
        .headers
        .iter()
        .map(|(k, _)| k)
        .chain([&h.idempotency_header])
    {
        if !token(name) {
            bail!("{at}: HTTP header name {name:?} is invalid (http.headers / http.idempotency_header)");
        }
    }
    Ok(())
}

/// The database name of a PostgreSQL URL (either form), for the `database` label: the
/// `dbname`, else the user's name (PostgreSQL's own default), else `postgres`.
pub fn database_name(url: &str) -> String {
    let parsed: Option<tokio_postgres::Config> = url.parse().ok();
    parsed
        .and_then(|c| c.get_dbname().or(c.get_user()).map(|s| s.to_string()))
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "postgres".into())
}

/// Checks a process's list of relays (several `[[databases]]`): names and (URL, slot) pairs
/// are unique, so no two relays of the process take the same lease and no two share labels.
pub fn validate_databases(cfgs: &[RelayConfig]) -> anyhow::Result<()> {
    let mut names = std::collections::BTreeSet::new();
    let mut slots = std::collections::BTreeSet::new();
    for c in cfgs {
        if !names.insert(c.database.as_str()) {
            bail!(
                "two [[databases]] entries are named {:?}: give each a unique name (it labels the metrics)",
                c.database
            );
        }
        if !slots.insert((c.database_url.expose(), c.slot.as_str())) {
            bail!(
                "two [[databases]] entries use slot {:?} of {}: one relay per slot; give one of them another slot",
                c.slot,
                redact_url(c.database_url.expose())
            );
        }
    }
    Ok(())
}

/// The longest a relay may keep re-sending one event with the same id in ordinary operation:
/// an ACK timeout, the UNKNOWN settle time, a lease handover to a standby, and the longest
/// reconnect backoff. A JetStream stream whose duplicate window is shorter cannot deduplicate
/// all of those re-sends on the broker (the ledger still does).
pub fn retry_budget(
    ack_timeout: Duration,
    unknown_settle: Duration,
    lease_ttl: Duration,
) -> Duration {
    ack_timeout + unknown_settle + lease_ttl + MAX_BACKOFF
}

pub use outbox_relay::fleet::STOP_GRACE as FLEET_STOP_GRACE;
pub use outbox_relay::lifecycle::MAX_BACKOFF;

impl RelayConfig {
    /// [`retry_budget`] with this relay's settings.
    pub fn retry_budget(&self, ack_timeout: Duration) -> Duration {
        retry_budget(ack_timeout, self.unknown_settle, self.lease_ttl)
    }
}

/// Splits `schema.table`.
pub fn split_table(t: &str) -> anyhow::Result<(String, String)> {
    match t.split_once('.') {
        Some((s, n)) if !s.is_empty() && !n.is_empty() && !n.contains('.') => {
            Ok((s.to_string(), n.to_string()))
        }
        _ => bail!("table {t:?} is invalid: expected schema.table, e.g. outbox.events"),
    }
}

/// A relay identity that is unique enough for the lease table: host, pid and a random suffix.
pub fn default_relay_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    format!(
        "{host}-{}-{:04x}",
        std::process::id(),
        rand::random::<u16>()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_are_named() {
        let e = toml::from_str::<FileConfig>("slot = \"a\"\nbootstrap = \"x\"\n").unwrap_err();
        assert!(e.to_string().contains("bootstrap"), "{e}");
        let e = toml::from_str::<FileConfig>("[kafka]\nservers = \"x\"\n").unwrap_err();
        assert!(e.to_string().contains("servers"), "{e}");
    }

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("postgres://u:hunter2@h/db");
        assert!(!format!("{s:?}").contains("hunter2"));
        assert_eq!(
            redact_url("postgres://u:hunter2@h:5/db"),
            "postgres://u@h:5/db"
        );
        assert_eq!(redact_url("postgres://h/db"), "postgres://h/db");
        assert_eq!(
            redact_url("postgres://u@h/db?password=hunter2&sslmode=require"),
            "postgres://u@h/db?sslmode=require"
        );
        assert_eq!(
            redact_url("host=h password=hunter2 dbname=d"),
            "host=h password=*** dbname=d"
        );
        assert_eq!(
            redact_url("host=h password='hun ter\\'2' user=u"),
            "host=h password=*** user=u"
        );
        assert_eq!(
            redact_url("host=h password=a://b@c user=u"),
            "host=h password=*** user=u"
        );
    }

    /// Issue 33, finding 5: a password holding `?` printed. Over passwords holding each URL
    /// delimiter and percent-escapes, raw and percent-encoded, in the user info and as
    /// parameters: neither form of the password, nor what tokio-postgres (the parser that
    /// connects) reads as the password, is in the redacted text, and the user, host, port,
    /// database and other parameters are.
    #[test]
    fn passwords_holding_url_delimiters_never_print() {
        let enc =
            |p: &str| -> String { url::form_urlencoded::byte_serialize(p.as_bytes()).collect() };
        let passwords = [
            "Leak?Me99",
            "Le@k@Me99",
            "Leak/Me/99",
            "Leak#Me99",
            "Leak%41Me%2599",
            "Le:ak?M/e#9@9%40",
            "p?a=1&password=x",
            "Leak Me99",
        ];
        for p in passwords {
            let urls = [
                format!("postgres://qq:{p}@db.internal:5433/app?sslmode=require"),
                format!(
                    "postgresql://qq:{}@db.internal:5433/app?sslmode=require",
                    enc(p)
                ),
                format!(
                    "postgres://qq@db.internal:5433/app?password={}&sslmode=require",
                    enc(p)
                ),
                format!(
                    "postgres://qq@db.internal:5433/app?sslmode=require&pass%77ord={}",
                    enc(p)
                ),
                format!(
                    "postgres://qq@db.internal:5433/app?sslmode=require&sslpassword={}",
                    enc(p)
                ),
                format!("nats://qq:{p}@db.internal:5433/app?sslmode=require"),
            ];
            for u in &urls {
                let out = redact_url(u);
                for secret in [p.to_string(), enc(p)] {
                    assert!(!out.contains(&secret), "{u} printed as {out}");
                }
                // What the connecting parser takes for the password does not print either.
                if let Ok(c) = u.parse::<tokio_postgres::Config>() {
                    if let Some(pw) = c.get_password() {
                        let pw = String::from_utf8_lossy(pw);
                        assert!(pw.len() < 3 || !out.contains(pw.as_ref()), "{u}: {out}");
                    }
                }
                assert!(
                    out.contains("qq@db.internal:5433/app") && out.contains("sslmode=require"),
                    "{u}: the rest of the URL is lost: {out}"
                );
            }
        }
        // An '@' in a parameter, without user info: nothing before it is taken for a user.
        let out = redact_url("postgres://h/db?password=S3cret&application_name=a@b");
        assert!(!out.contains("S3cret"), "{out}");
        assert_eq!(
            redact_url("postgres://h:5/db?application_name=me&sslmode=require"),
            "postgres://h:5/db?application_name=me&sslmode=require"
        );
    }

    #[test]
    fn nats_section_parses() {
        let f = toml::from_str::<FileConfig>(
            "sink = \"nats\"\n[nats]\nurl = \"nats://h:4222\"\nstream = \"S\"\nduplicate_window_ms = 60000\n",
        )
        .unwrap();
        assert_eq!(f.sink, Some(SinkKind::Nats));
        assert_eq!(f.nats.duplicate_window_ms, Some(60000));
        let e = toml::from_str::<FileConfig>("[nats]\nwindow = 1\n").unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
        assert_eq!(
            retry_budget(
                Duration::from_secs(5),
                Duration::from_secs(5),
                Duration::from_secs(10)
            ),
            Duration::from_secs(25)
        );
    }

    #[test]
    fn listen_addresses_default_to_loopback() {
        assert_eq!(
            parse_listen_addr("x", "9187").unwrap(),
            "127.0.0.1:9187".parse().unwrap()
        );
        assert_eq!(
            parse_listen_addr("x", "0.0.0.0:1").unwrap(),
            "0.0.0.0:1".parse().unwrap()
        );
        assert!(parse_listen_addr("x", "nope").is_err());
        let open = AdminConfig {
            http_addr: None,
            console_addr: Some("0.0.0.0:6433".parse().unwrap()),
            console_user: DEFAULT_CONSOLE_USER.into(),
            console_password: None,
            console_max_connections: DEFAULT_CONSOLE_MAX_CONNECTIONS,
            console_login_timeout: Duration::from_millis(DEFAULT_CONSOLE_LOGIN_TIMEOUT_MS),
            console_idle_timeout: Duration::from_millis(DEFAULT_CONSOLE_IDLE_TIMEOUT_MS),
            sample_interval: Duration::from_secs(5),
        };
        let e = open.validate().unwrap_err().to_string();
        assert!(e.contains("OUTBOXD_CONSOLE_PASSWORD"), "{e}");
        let toml = "log_format = \"json\"\n[admin]\naddr = \"9187\"\nconsole_password = \"pw\"\n";
        let f: FileConfig = toml::from_str(toml).unwrap();
        assert_eq!(f.admin.addr.as_deref(), Some("9187"));
        assert!(!format!("{f:?}").contains("pw\""));
        assert!(toml::from_str::<FileConfig>("[admin]\nport = 1\n").is_err());
    }

    #[test]
    fn table_must_be_qualified() {
        assert_eq!(
            split_table("outbox.events").unwrap(),
            ("outbox".into(), "events".into())
        );
        assert!(split_table("events").is_err());
    }
}
