//! NATS JetStream sink on async-nats.
//!
//! # Semantics of the layer underneath
//! * A JetStream publish is a request: the server stores the message in the stream whose
//!   subjects capture the subject and answers with a PubAck `{stream, seq, duplicate}`. No
//!   stream for the subject answers "no responders" (not stored). A lost answer (server paused,
//!   connection broken) leaves the outcome unknown: the server may have stored it.
//! * Every message carries `Nats-Msg-Id` = event id. Within the stream's *duplicate window*
//!   (a stream setting, default 2 minutes) the server stores a given id at most once and
//!   answers a repeat with `duplicate: true` and the **original** sequence. That is the
//!   broker-side idempotence Kafka's producer id/sequence only gives one producer session.
//! * Receipt mapping: topic = subject, partition = 0, offset = stream sequence. A duplicate
//!   PubAck is reported as such; the ledger keeps it as a duplicate transport receipt when the
//!   event already has a primary one (the publish slot is the event id), and as the proof of
//!   the original copy when it has none.
//! * Order: the relay's ordering gate keeps one event per aggregate in flight, so per subject
//!   (the default subject is `outbox.<aggregate_type>.<aggregate_id>`) the stream holds the
//!   events of an aggregate in version order.
//!
//! # Resolving an UNKNOWN attempt ([`Sink::lookup`])
//! * sent less than the duplicate window ago (minus [`WINDOW_MARGIN`]): re-publish the frozen
//!   message with the same `Nats-Msg-Id`. `duplicate: true` proves the original is stored, at
//!   the returned sequence; `duplicate: false` proves it was not (and the probe is now the one
//!   copy). Either way the stream holds exactly one copy.
//! * older: read the stream by subject from the scan's lower bound to the last sequence at the
//!   start of the read, comparing `Nats-Msg-Id`. Absent over the whole range is proof only if
//!   the stream's retention has not removed part of that range; otherwise the lookup refuses to
//!   guess.

use std::str::FromStr;
use std::time::Duration;

use async_nats::header::{HeaderName, NATS_MESSAGE_ID};
use async_nats::jetstream::context::{ContextBuilder, GetStreamErrorKind, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::{Config as StreamConfig, RawMessageErrorKind, StorageType};
use async_nats::jetstream::Context;
use async_nats::jetstream::ErrorCode;
use async_nats::HeaderMap;
use bytes::Bytes;
use outbox_core::OutboxEvent;
use tokio::sync::mpsc::UnboundedSender;

use crate::{
    event_headers, Delivery, DeliveryOutcome, FailureClass, Lookup, Persistence, Served, Sink,
    SinkError, UnknownLookup,
};

/// A probe re-publish is trusted only when the attempt was sent at least this long before the
/// duplicate window ends (clock skew between relay, database and server; the probe's own
/// round trip).
pub const WINDOW_MARGIN: Duration = Duration::from_secs(10);

/// Timeout of JetStream API requests (not publishes).
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// How the relay authenticates to the NATS server, and whether it must use TLS. Secrets are
/// printed as `***` by `Debug`.
#[derive(Clone, Default)]
pub struct NatsAuth {
    /// User name (with `password`): the server's `authorization { user, password }`.
    pub user: Option<String>,
    pub password: Option<String>,
    /// A token: the server's `authorization { token }` (`--auth`).
    pub token: Option<String>,
    /// A user NKey seed (`SU...`): the server's `authorization { users = [{ nkey: U... }] }`.
    /// The client signs the server's nonce with it; the seed never leaves the process.
    pub nkey_seed: Option<String>,
    /// A PEM file of CA certificates to verify the server's TLS certificate (besides the
    /// system's); setting it implies TLS.
    pub ca_file: Option<std::path::PathBuf>,
    /// Refuse a server that does not offer TLS (`tls://` URLs require it as well).
    pub require_tls: bool,
}

impl std::fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |v: &Option<String>| v.as_ref().map(|_| "***");
        f.debug_struct("NatsAuth")
            .field("user", &self.user)
            .field("password", &hidden(&self.password))
            .field("token", &hidden(&self.token))
            .field("nkey_seed", &hidden(&self.nkey_seed))
            .field("ca_file", &self.ca_file)
            .field("require_tls", &self.require_tls)
            .finish()
    }
}

/// Whether any of the (comma-separated) NATS URLs holds user info (`user:pass@`, `token@`).
/// A NATS URL is `scheme://host:port`; anything with an `@` is taken for user info.
/// async-nats ignores it (the server then refuses the relay) and it would be printed with the
/// URL: the relay refuses such a URL and takes credentials from [`NatsAuth`] instead.
pub fn url_has_credentials(urls: &str) -> bool {
    // Any '@' counts: a password may hold '/', '?' or '#' before it (issue 33, finding 5),
    // and a NATS URL has no other use for one.
    urls.contains('@')
}

/// Sink settings.
#[derive(Debug, Clone)]
pub struct JetStreamSinkConfig {
    /// NATS server URL(s), e.g. `nats://127.0.0.1:4222` (comma-separated for a cluster).
    /// Without user info ([`url_has_credentials`]): credentials are in `auth`.
    pub url: String,
    /// Credentials and TLS.
    pub auth: NatsAuth,
    /// The cluster identity this relay serves: must equal each event's frozen `dest_cluster`,
    /// and the NATS server's cluster name (or its server name when it is not clustered).
    pub cluster_name: String,
    /// The stream that captures the frozen subjects.
    pub stream: String,
    /// Create the stream at start when it is missing (otherwise that is an error).
    pub create_stream: bool,
    /// Subjects of a stream created by the relay.
    pub stream_subjects: Vec<String>,
    /// Duplicate window of a stream created by the relay.
    pub duplicate_window: Duration,
    /// How long a publish waits for its PubAck before the outcome is UNKNOWN.
    pub ack_timeout: Duration,
    /// Publishes awaiting their PubAck before `send` waits.
    pub max_in_flight: usize,
}

impl Default for JetStreamSinkConfig {
    fn default() -> Self {
        JetStreamSinkConfig {
            url: "nats://127.0.0.1:4222".into(),
            auth: NatsAuth::default(),
            cluster_name: "default".into(),
            stream: "OUTBOX".into(),
            create_stream: false,
            stream_subjects: vec!["outbox.>".into()],
            duplicate_window: Duration::from_secs(120),
            ack_timeout: Duration::from_secs(5),
            max_in_flight: 10_000,
        }
    }
}

/// What `outboxd check` learns about the server and the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamCheck {
    /// The server's cluster name, or its server name when it is not clustered; `None` when the
    /// server has no name (then the relay cannot verify which cluster it talks to).
    pub server_identity: Option<String>,
    pub server_version: String,
    pub jetstream: bool,
    /// `None` when the stream does not exist.
    pub stream: Option<StreamFacts>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamFacts {
    pub subjects: Vec<String>,
    pub duplicate_window: Duration,
    pub messages: u64,
}

/// Publishes to one JetStream stream; PubAcks become delivery reports on a channel.
pub struct JetStreamSink {
    config: JetStreamSinkConfig,
    /// Publishes: its timeout is the ACK timeout.
    js: Context,
    /// JetStream API requests (stream lookup, creation, reads): a longer timeout, so a short ACK
    /// timeout does not make start-up or reconciliation fail on a busy server.
    api: Context,
    reports: UnboundedSender<Delivery>,
    duplicate_window: Duration,
    max_payload: usize,
}

impl std::fmt::Debug for JetStreamSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamSink")
            .field("url", &self.config.url)
            .field("auth", &self.config.auth)
            .field("cluster_name", &self.config.cluster_name)
            .field("stream", &self.config.stream)
            .field("duplicate_window", &self.duplicate_window)
            .finish()
    }
}

fn nats_err(url: &str, what: &str, e: impl std::fmt::Display) -> SinkError {
    SinkError::Nats {
        url: url.to_string(),
        what: what.to_string(),
        message: e.to_string(),
    }
}

async fn connect(url: &str, auth: &NatsAuth) -> Result<async_nats::Client, SinkError> {
    connect_client(url, auth, "outboxd", Duration::from_secs(5)).await
}

/// A NATS connection with the relay's credentials and TLS settings (also used by the
/// `/readyz` probe); a URL holding credentials is refused without printing it.
pub async fn connect_client(
    url: &str,
    auth: &NatsAuth,
    name: &str,
    timeout: Duration,
) -> Result<async_nats::Client, SinkError> {
    if url_has_credentials(url) {
        // Never printed: the URL holds a secret.
        return Err(SinkError::Nats {
            url: "(a URL holding credentials, not printed)".into(),
            what: "connecting".into(),
            message: "the NATS URL holds user info (user:password@ or token@), which the client would not use: remove it from the URL and set nats.user + nats.password (OUTBOXD_NATS_USER, OUTBOXD_NATS_PASSWORD) or nats.token (OUTBOXD_NATS_TOKEN)".into(),
        });
    }
    let mut options = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(timeout);
    if let (Some(user), Some(password)) = (&auth.user, &auth.password) {
        options = options.user_and_password(user.clone(), password.clone());
    }
    if let Some(token) = &auth.token {
        options = options.token(token.clone());
    }
    if let Some(seed) = &auth.nkey_seed {
        options = options.nkey(seed.clone());
    }
    if let Some(ca) = &auth.ca_file {
        options = options.add_root_certificates(ca.clone());
    }
    if auth.require_tls || auth.ca_file.is_some() {
        options = options.require_tls(true);
    }
    options
        .connect(url)
        .await
        .map_err(|e| nats_err(url, "connecting", connect_advice(&e, auth)))
}

/// A connection error with what to do about it (never a secret: async-nats's errors name the
/// server's answer, not the credentials).
fn connect_advice(e: &async_nats::ConnectError, auth: &NatsAuth) -> String {
    use async_nats::ConnectErrorKind as K;
    let given = match (&auth.user, &auth.token, &auth.nkey_seed) {
        (Some(u), _, _) => format!("user {u:?} with nats.password (OUTBOXD_NATS_PASSWORD)"),
        (None, Some(_), _) => "nats.token (OUTBOXD_NATS_TOKEN)".to_string(),
        (None, None, Some(_)) => {
            "the NKey seed of nats.nkey_seed_file (--nats-nkey-seed-file)".to_string()
        }
        (None, None, None) => String::new(),
    };
    match e.kind() {
        K::AuthorizationViolation | K::Authentication if given.is_empty() => format!(
            "{e}: the server requires authentication; set nats.user + nats.password (OUTBOXD_NATS_USER, OUTBOXD_NATS_PASSWORD), nats.token (OUTBOXD_NATS_TOKEN) or nats.nkey_seed_file (--nats-nkey-seed-file)"
        ),
        K::AuthorizationViolation | K::Authentication => format!(
            "{e}: the server refused {given}; check those settings against the server's authorization block"
        ),
        // rustls's verification failures arrive as IO errors ("invalid peer certificate").
        K::Tls | K::Io if e.to_string().contains("certificate") || e.kind() == K::Tls => format!(
            "{e}: check nats.ca_file (the CA that signed the server's certificate) and that the server offers TLS (nats.require_tls)"
        ),
        _ => e.to_string(),
    }
}

/// The identity a server reports: its cluster name, or its server name when unclustered;
/// `None` for an unnamed server (its "name" is then its random per-start server id).
fn server_identity(info: &async_nats::ServerInfo) -> Option<String> {
    match &info.cluster {
        Some(c) if !c.is_empty() => Some(c.clone()),
        _ if info.server_name.is_empty() || info.server_name == info.server_id => None,
        _ => Some(info.server_name.clone()),
    }
}

/// Reads the server identity and the stream's settings (for `outboxd check`).
pub async fn inspect(url: &str, auth: &NatsAuth, stream: &str) -> Result<StreamCheck, SinkError> {
    let client = connect(url, auth).await?;
    let info = client.server_info();
    let js = async_nats::jetstream::new(client);
    let facts = match js.get_stream(stream).await {
        Ok(mut s) => {
            let i = s
                .info()
                .await
                .map_err(|e| nats_err(url, &format!("reading stream {stream}"), e))?;
            Some(StreamFacts {
                subjects: i.config.subjects.clone(),
                duplicate_window: i.config.duplicate_window,
                messages: i.state.messages,
            })
        }
        Err(e) if is_stream_not_found(&e.kind()) => None,
        Err(e) => return Err(nats_err(url, &format!("looking up stream {stream}"), e)),
    };
    Ok(StreamCheck {
        server_identity: server_identity(&info),
        server_version: info.version.clone(),
        jetstream: info.jetstream,
        stream: facts,
    })
}

fn is_stream_not_found(kind: &GetStreamErrorKind) -> bool {
    matches!(kind, GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

/// A subject the server accepts for a publish: dot-separated non-empty tokens, no wildcard
/// token, no whitespace or control characters.
pub fn valid_subject(s: &str) -> bool {
    !s.is_empty()
        && !s.chars().any(|c| c.is_whitespace() || c.is_control())
        && s.split('.').all(|t| !t.is_empty() && t != "*" && t != ">")
}

impl JetStreamSink {
    /// Connects, checks the server's identity against `cluster_name`, and verifies (or, when
    /// allowed, creates) the stream. Delivery reports are sent to `reports`.
    pub async fn connect(
        config: JetStreamSinkConfig,
        reports: UnboundedSender<Delivery>,
    ) -> Result<Self, SinkError> {
        let url = config.url.clone();
        let client = connect(&url, &config.auth).await?;
        let info = client.server_info();
        let identity = server_identity(&info);
        match &identity {
            Some(name) if *name != config.cluster_name => {
                return Err(SinkError::WrongCluster {
                    url,
                    server: name.clone(),
                    configured: config.cluster_name.clone(),
                })
            }
            Some(_) => {}
            None => tracing::warn!(%url, cluster = %config.cluster_name,
                "the NATS server has no name (server_name / -n) and no cluster name, so the relay cannot verify that it is cluster {}; name it", config.cluster_name),
        }
        if !info.jetstream {
            return Err(nats_err(
                &url,
                "checking JetStream",
                "the server has JetStream disabled",
            ));
        }
        let js = ContextBuilder::new()
            .timeout(config.ack_timeout)
            .max_ack_inflight(config.max_in_flight.max(1))
            .backpressure_on_inflight(true)
            .build(client.clone());
        let mut api = async_nats::jetstream::new(client);
        api.set_timeout(API_TIMEOUT.max(config.ack_timeout));
        let mut stream = match api.get_stream(&config.stream).await {
            Ok(s) => s,
            Err(e) if is_stream_not_found(&e.kind()) => {
                if !config.create_stream {
                    return Err(SinkError::StreamMissing {
                        stream: config.stream.clone(),
                        url,
                    });
                }
                tracing::info!(stream = %config.stream, subjects = ?config.stream_subjects,
                    duplicate_window_ms = config.duplicate_window.as_millis() as u64, "creating JetStream stream");
                api.create_stream(StreamConfig {
                    name: config.stream.clone(),
                    subjects: config.stream_subjects.clone(),
                    duplicate_window: config.duplicate_window,
                    storage: StorageType::File,
                    ..Default::default()
                })
                .await
                .map_err(|e| nats_err(&url, &format!("creating stream {}", config.stream), e))?
            }
            Err(e) => {
                return Err(nats_err(
                    &url,
                    &format!("looking up stream {}", config.stream),
                    e,
                ))
            }
        };
        let duplicate_window = stream
            .info()
            .await
            .map_err(|e| nats_err(&url, &format!("reading stream {}", config.stream), e))?
            .config
            .duplicate_window;
        tracing::info!(%url, server = ?identity, stream = %config.stream,
            duplicate_window_ms = duplicate_window.as_millis() as u64, "JetStream sink ready");
        Ok(JetStreamSink {
            max_payload: info.max_payload,
            config,
            js,
            api,
            reports,
            duplicate_window,
        })
    }

    pub fn config(&self) -> &JetStreamSinkConfig {
        &self.config
    }

    /// The stream's duplicate window, as the server reported it at start.
    pub fn duplicate_window(&self) -> Duration {
        self.duplicate_window
    }

    /// The frozen message: subject, headers (`Nats-Msg-Id` + the envelope metadata headers
    /// Kafka carries), payload. A message the server can never take is a permanent refusal.
    fn message(&self, ev: &OutboxEvent) -> Result<(String, HeaderMap, Bytes), SinkError> {
        let subject = ev.destination.topic.clone();
        let refuse = |message: String| SinkError::Publish {
            event_id: ev.event_id.to_string(),
            subject: subject.clone(),
            class: FailureClass::Permanent,
            message,
        };
        if !valid_subject(&subject) {
            return Err(refuse(format!(
                "{subject:?} is not a valid NATS subject (dot-separated tokens, no spaces, no * or > tokens); fix the route policy's subject template"
            )));
        }
        let mut headers = HeaderMap::new();
        headers.insert(NATS_MESSAGE_ID, ev.event_id.to_string().as_str());
        for (k, v) in event_headers(ev) {
            let Ok(name) = HeaderName::from_str(&k) else {
                return Err(refuse(format!(
                    "header name {k:?} cannot be carried by NATS (printable ASCII without ':')"
                )));
            };
            let value = String::from_utf8_lossy(&v).into_owned();
            if value.contains(['\r', '\n']) {
                return Err(refuse(format!(
                    "header {k:?} contains a line break, which NATS headers cannot carry"
                )));
            }
            headers.insert(name, value);
        }
        let payload = Bytes::copy_from_slice(&ev.payload[..]);
        if payload.len() > self.max_payload {
            return Err(refuse(format!(
                "payload of {} bytes exceeds the server's max_payload of {} bytes",
                payload.len(),
                self.max_payload
            )));
        }
        Ok((subject, headers, payload))
    }

    /// Publishes and returns the PubAck future.
    async fn publish(
        &self,
        ev: &OutboxEvent,
    ) -> Result<(String, async_nats::jetstream::context::PublishAckFuture), SinkError> {
        let (subject, headers, payload) = self.message(ev)?;
        let fut = self
            .js
            .send_publish(
                subject.clone(),
                PublishMessage::build().payload(payload).headers(headers),
            )
            .await
            .map_err(|e| SinkError::Publish {
                event_id: ev.event_id.to_string(),
                subject: subject.clone(),
                class: FailureClass::Transient,
                message: e.to_string(),
            })?;
        Ok((subject, fut))
    }

    /// Whole-range read by subject (outside the duplicate window).
    async fn scan(&self, q: &UnknownLookup<'_>) -> Result<Lookup, SinkError> {
        let url = &self.config.url;
        let id = q.event.event_id.to_string();
        // The subject determines the stream (one stream captures a subject); read the one that
        // captures it now, not only the configured one.
        let name = &self
            .api
            .stream_by_subject(q.topic.to_string())
            .await
            .map_err(|e| {
                nats_err(
                    url,
                    &format!("finding the stream of subject {}", q.topic),
                    e,
                )
            })?;
        let mut stream = self
            .api
            .get_stream(name)
            .await
            .map_err(|e| nats_err(url, &format!("looking up stream {name}"), e))?;
        let state = stream
            .info()
            .await
            .map_err(|e| nats_err(url, &format!("reading stream {name}"), e))?
            .state
            .clone();
        let from = u64::try_from(q.from.max(1)).unwrap_or(1);
        let last = state.last_sequence;
        if state.messages > 0 && state.first_sequence > from {
            return Err(SinkError::Unprovable {
                event_id: id,
                stream: name.clone(),
                reason: format!(
                    "the attempt may be at sequence {from} or later, but retention already removed sequences below {}",
                    state.first_sequence
                ),
            });
        }
        let mut next = from;
        while next <= last {
            let got = stream
                .raw_message_builder()
                .sequence(next)
                .next_by_subject(q.topic.to_string())
                .send()
                .await;
            match got {
                Ok(m) if m.sequence > last => break,
                Ok(m) => {
                    if m.headers.get(NATS_MESSAGE_ID).map(|v| v.as_str()) == Some(id.as_str()) {
                        return Ok(Lookup::Found {
                            partition: 0,
                            offset: m.sequence as i64,
                            timestamp_ms: Some((m.time.unix_timestamp_nanos() / 1_000_000) as i64),
                            scanned_from: from as i64,
                            scanned_to: m.sequence as i64 + 1,
                        });
                    }
                    next = m.sequence + 1;
                }
                Err(e) if matches!(e.kind(), RawMessageErrorKind::NoMessageFound) => break,
                Err(e) => {
                    return Err(nats_err(
                        url,
                        &format!("reading stream {name} by subject {}", q.topic),
                        e,
                    ))
                }
            }
        }
        Ok(Lookup::Absent {
            scanned_from: from as i64,
            scanned_to: last as i64 + 1,
        })
    }
}

/// Maps a failed PubAck to a delivery outcome.
fn failed(e: &async_nats::jetstream::context::PublishError) -> DeliveryOutcome {
    let (persistence, class) = match e.kind() {
        // The request may have reached the server and been stored; the answer did not come.
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe | PublishErrorKind::Other => {
            (Persistence::PossiblyPersisted, FailureClass::Transient)
        }
        // "No responders": no stream (or no JetStream yet, e.g. a server starting up) took it.
        PublishErrorKind::StreamNotFound => (Persistence::NotPersisted, FailureClass::Transient),
        // Expectation headers we never send; the server refused it as such.
        PublishErrorKind::WrongLastMessageId
        | PublishErrorKind::WrongLastSequence
        | PublishErrorKind::MaxAckPending => (Persistence::NotPersisted, FailureClass::Transient),
    };
    DeliveryOutcome::Failed {
        error: e.to_string(),
        persistence,
        class,
        partition: 0,
    }
}

/// "No responders": nothing took the publish. If JetStream answers that no stream captures the
/// subject, no retry can ever succeed (the route names a subject outside every stream): a
/// permanent refusal, so the event is quarantined with the fix instead of replayed forever.
/// Anything else (JetStream not ready after a restart) is transient.
async fn no_stream(
    api: &Context,
    subject: &str,
    e: &async_nats::jetstream::context::PublishError,
) -> DeliveryOutcome {
    use async_nats::jetstream::context::GetStreamByNameErrorKind as K;
    match api.stream_by_subject(subject.to_string()).await {
        Err(lookup) if matches!(lookup.kind(), K::NotFound) => DeliveryOutcome::Failed {
            error: format!(
                "no JetStream stream captures subject {subject:?}: add it to the stream's subjects (or fix the route policy), then release the event"
            ),
            persistence: Persistence::NotPersisted,
            class: FailureClass::Permanent,
            partition: 0,
        },
        _ => failed(e),
    }
}

/// A PubAck, as evidence: only a sequence in the configured stream proves the stream holds the
/// message. A PubAck from another stream (the subject is captured by a stream other than
/// `--nats-stream`) or without a sequence is a possibly persisted failure (DISPATCH_UNKNOWN),
/// never a receipt: the relay cannot read the copy back where it looks for it.
fn pub_ack_outcome(
    stream: &str,
    subject: String,
    acked_stream: &str,
    sequence: u64,
    duplicate: bool,
) -> DeliveryOutcome {
    let offset = i64::try_from(sequence).unwrap_or(-1);
    // A stream sequence starts at 1: 0 is "no sequence".
    let offset = if offset == 0 { -1 } else { offset };
    match outbox_core::receipt::position_proof(stream, acked_stream, 0, offset) {
        Ok(()) => DeliveryOutcome::Persisted {
            topic: subject,
            partition: 0,
            offset,
            timestamp_ms: None,
            duplicate,
            evidence: None,
        },
        Err(why) => {
            tracing::warn!(%subject, stream = %acked_stream, configured = %stream, sequence, reason = %why,
                "PubAck is no proof of publication: treated as DISPATCH_UNKNOWN");
            DeliveryOutcome::Failed {
                error: format!("PubAck is no proof of publication in stream {stream}: {why}"),
                persistence: Persistence::PossiblyPersisted,
                class: FailureClass::Transient,
                partition: 0,
            }
        }
    }
}

impl Sink for JetStreamSink {
    fn served(&self) -> Served {
        Served {
            kind: "nats",
            clusters: vec![self.config.cluster_name.clone()],
            partitioner: None,
        }
    }

    async fn send(&self, ev: &OutboxEvent, token: u64) -> Result<(), SinkError> {
        let (subject, fut) = self.publish(ev).await?;
        let tx = self.reports.clone();
        let expected = self.config.stream.clone();
        let api = self.api.clone();
        tokio::spawn(async move {
            let outcome = match fut.await {
                Ok(ack) => {
                    if ack.duplicate {
                        tracing::debug!(%subject, sequence = ack.sequence, "PubAck duplicate: the broker already had this Nats-Msg-Id");
                    }
                    pub_ack_outcome(&expected, subject, &ack.stream, ack.sequence, ack.duplicate)
                }
                Err(e) if matches!(e.kind(), PublishErrorKind::StreamNotFound) => {
                    no_stream(&api, &subject, &e).await
                }
                Err(e) => failed(&e),
            };
            // A closed channel means the pipeline is gone; the event is unresolved and will be
            // replayed from the checkpoint, so dropping the report is safe.
            let _ = tx.send(Delivery { token, outcome });
        });
        Ok(())
    }

    fn ack_timeout(&self) -> Duration {
        self.config.ack_timeout
    }

    /// Inside the duplicate window the look-up is a re-publish with the same `Nats-Msg-Id`;
    /// outside it, a read of the stream by subject.
    fn lookup_resends(&self, sent_ago: Duration) -> bool {
        sent_ago + WINDOW_MARGIN < self.duplicate_window
    }

    async fn lookup(&self, q: UnknownLookup<'_>) -> Result<Lookup, SinkError> {
        if self.lookup_resends(q.sent_ago) {
            let (_, fut) = self.publish(q.event).await?;
            let ack = fut.await.map_err(|e| {
                nats_err(
                    &self.config.url,
                    &format!(
                        "re-publishing event {} with its Nats-Msg-Id",
                        q.event.event_id
                    ),
                    e,
                )
            })?;
            if let Err(why) = outbox_core::receipt::position_proof(
                &self.config.stream,
                &ack.stream,
                0,
                if ack.sequence == 0 {
                    -1
                } else {
                    ack.sequence as i64
                },
            ) {
                return Err(SinkError::Unprovable {
                    event_id: q.event.event_id.to_string(),
                    stream: self.config.stream.clone(),
                    reason: format!("the probe's PubAck is no proof: {why}"),
                });
            }
            let offset = ack.sequence as i64;
            return Ok(if ack.duplicate {
                Lookup::Found {
                    partition: 0,
                    offset,
                    timestamp_ms: None,
                    scanned_from: offset,
                    scanned_to: offset + 1,
                }
            } else {
                Lookup::StoredByProbe {
                    partition: 0,
                    offset,
                    timestamp_ms: None,
                    evidence: None,
                }
            });
        }
        self.scan(&q).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_a_url_are_found_and_secrets_never_debug_print() {
        assert!(url_has_credentials("nats://u:p@h:4222"));
        assert!(url_has_credentials("nats://u:p?x/y#z@h:4222"));
        assert!(url_has_credentials("nats://a:4222,nats://tok@b:4222"));
        assert!(!url_has_credentials("nats://h:4222,tls://h2:4222"));
        let auth = NatsAuth {
            user: Some("outboxd".into()),
            password: Some("pw-s3cret".into()),
            token: Some("tok-s3cret".into()),
            ..Default::default()
        };
        let cfg = JetStreamSinkConfig {
            auth,
            ..Default::default()
        };
        let d = format!("{cfg:?}");
        assert!(d.contains("outboxd") && d.contains("***"), "{d}");
        assert!(!d.contains("s3cret"), "{d}");
    }

    #[test]
    fn a_pub_ack_is_a_receipt_only_with_a_sequence_in_the_configured_stream() {
        let ok = pub_ack_outcome("S", "outbox.a".into(), "S", 7, false);
        assert!(
            matches!(ok, DeliveryOutcome::Persisted { offset: 7, .. }),
            "{ok:?}"
        );
        for (stream, seq) in [("OTHER", 7), ("S", 0)] {
            let out = pub_ack_outcome("S", "outbox.a".into(), stream, seq, false);
            assert!(
                matches!(
                    out,
                    DeliveryOutcome::Failed {
                        persistence: Persistence::PossiblyPersisted,
                        class: FailureClass::Transient,
                        ..
                    }
                ),
                "{stream}/{seq}: {out:?}"
            );
        }
    }

    #[test]
    fn subjects() {
        assert!(valid_subject("outbox.order.o-42"));
        assert!(!valid_subject(""));
        assert!(!valid_subject("outbox..x"));
        assert!(!valid_subject("outbox.order.a b"));
        assert!(!valid_subject("outbox.*.x"));
        assert!(!valid_subject("outbox.>"));
        assert!(valid_subject("outbox.a*b"));
    }
}
