//! HTTP sink: webhooks, one request per event, with the event id as the idempotency key.
//!
//! # Semantics of the layer underneath
//! An HTTP endpoint is not a log: nothing can be scanned afterwards to learn whether it applied
//! a request. So the receipt is the answer itself, and the key is what makes a second request
//! harmless:
//! * Every request carries the event id in the idempotency header (`Idempotency-Key` by
//!   default), the envelope as `Outbox-*` headers (`Outbox-Id`, `Outbox-Aggregate-Type`, ...),
//!   and the frozen payload as its body. The URL is the frozen destination's topic.
//! * **2xx** is the receipt: the status, the response id header if the endpoint names one, and
//!   the sha256 of the body ([`HttpReceipt`]).
//! * **408, 429, 503**: the endpoint says it did not process the request. The sink waits
//!   (`Retry-After` if given, else a growing pause) and asks again with the same key, inside
//!   the send's deadline (the ACK timeout); past it the event is *not persisted*, and the relay
//!   replays.
//! * **Any other 4xx** is a refusal: the frozen request will never succeed. The event is
//!   quarantined and its aggregate held, as for a poison event on a broker. **410 Gone**
//!   also disables the endpoint for the rest of the run: later events are refused (and held)
//!   without a request (`HttpSink::exchange_unless_gone`).
//! * **3xx** is a refusal too, with the redirect's target in its reason: the sink follows no
//!   redirect. Following one would send the payload and the configured headers (`x-api-key`,
//!   anything but `Authorization`, which reqwest drops) wherever the endpoint, or whoever
//!   answers in its place, points. Set the route to the final URL instead.
//! * **500, 502, 504 and other 5xx**, a **timeout** or a **connection lost** after the request
//!   may have been written: nobody knows whether the endpoint applied it. The outcome is
//!   *possibly persisted*: DISPATCH_UNKNOWN.
//! * A connection refused (nothing written) is not persisted; it is tried again while the
//!   deadline allows.
//!
//! # Resolving an UNKNOWN attempt ([`Sink::lookup`])
//! There is nothing to scan. As seed 000 prescribes, the attempt is resolved by a retry to the
//! same frozen endpoint with the same key: its 2xx is the receipt
//! ([`Lookup::StoredByProbe`]). An endpoint that declares how long it keeps idempotency keys
//! (`idempotency_window`) makes that retry a proof that the event was applied once; without a
//! declaration, or past the window, it is the best that can be done, and the sink says so in
//! the log (the endpoint must deduplicate by key).
//!
//! Order: the relay's ordering gate keeps one event per aggregate in flight, so an endpoint sees
//! an aggregate's events one after the other, each acknowledged before the next is sent.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use outbox_core::OutboxEvent;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::Semaphore;

use crate::{
    Delivery, DeliveryOutcome, FailureClass, Lookup, Persistence, Served, Sink, SinkError,
    UnknownLookup,
};

/// Sink settings.
#[derive(Clone)]
pub struct HttpSinkConfig {
    /// The endpoint's identity: must equal each event's frozen `dest_cluster` (the name the
    /// route policy gives the endpoint).
    pub endpoint: String,
    /// `POST` (default) or `PUT`.
    pub method: String,
    /// The header carrying the event id. Default `Idempotency-Key`.
    pub idempotency_header: String,
    /// Headers added to every request (e.g. `Authorization`). Their values never print.
    pub headers: Vec<(String, String)>,
    /// A header of the endpoint's answer that names what it created (recorded in the receipt).
    pub response_id_header: Option<String>,
    /// How long one request may take before its outcome is unknown.
    pub request_timeout: Duration,
    /// How long a send may keep asking again after 408/429/503 (and a refused connection)
    /// before it reports the event not persisted.
    pub deadline: Duration,
    /// Requests in flight at once (each aggregate has at most one).
    pub max_concurrency: usize,
    /// How long the endpoint declares it keeps idempotency keys (a retry with the same key
    /// inside it is answered without being applied again). `None`: not declared.
    pub idempotency_window: Option<Duration>,
    /// A PEM file of CA certificates trusted for `https://` endpoints, besides the system's.
    pub ca_file: Option<std::path::PathBuf>,
    /// Standard Webhooks signing secrets: `whsec_` and base64 of at least 24 random bytes
    /// (a `v1,` HMAC-SHA256 signature) or `whsk_` and base64 of an ed25519 secret key (a
    /// `v1a,` signature the receiver verifies with the `whpk_` public key, which `outboxd
    /// check` prints). Each request carries `webhook-id`, `webhook-timestamp` and a
    /// `webhook-signature` with one signature per secret, so a secret is rotated by signing
    /// with the old and the new one for a while. Empty: requests are not signed. Never printed.
    pub signing_secrets: Vec<String>,
}

/// A Standard Webhooks signing key: symmetric (`whsec_`, signatures `v1,`) or asymmetric
/// (`whsk_`, ed25519, signatures `v1a,`).
#[derive(Clone)]
pub enum SigningKey {
    Hmac(Vec<u8>),
    Ed25519(Box<ed25519_dalek::SigningKey>),
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SigningKey::Hmac(_) => f.write_str("SigningKey::Hmac(***)"),
            SigningKey::Ed25519(k) => write!(f, "SigningKey::Ed25519({})", public_key(k)),
        }
    }
}

impl SigningKey {
    /// What a receiver verifies with: `whpk_` and the base64 of the ed25519 public key, for
    /// an asymmetric key; nothing to print for a symmetric one (the receiver holds the
    /// secret itself).
    pub fn public(&self) -> Option<String> {
        match self {
            SigningKey::Hmac(_) => None,
            SigningKey::Ed25519(k) => Some(public_key(k)),
        }
    }

    /// `v1,` or `v1a,` and the base64 signature of `content`.
    fn sign(&self, content: &[u8]) -> String {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        match self {
            SigningKey::Hmac(key) => {
                use hmac::Mac as _;
                // HMAC takes a key of any length.
                let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key)
                    .expect("HMAC-SHA256 accepts any key length");
                mac.update(content);
                format!("v1,{}", b64.encode(mac.finalize().into_bytes()))
            }
            SigningKey::Ed25519(k) => {
                use ed25519_dalek::Signer as _;
                format!("v1a,{}", b64.encode(k.sign(content).to_bytes()))
            }
        }
    }
}

fn public_key(k: &ed25519_dalek::SigningKey) -> String {
    use base64::Engine as _;
    format!(
        "whpk_{}",
        base64::engine::general_purpose::STANDARD.encode(k.verifying_key().to_bytes())
    )
}

/// Standard Webhooks (<https://www.standardwebhooks.com>) signature headers of one request:
/// `webhook-id` (the event id: the same on every retry), `webhook-timestamp` (Unix seconds of
/// this attempt) and `webhook-signature`: under each key, `v1,` and the base64 HMAC-SHA256
/// of `id.timestamp.body`, or `v1a,` and its base64 ed25519 signature, space-separated. Pure:
/// the caller passes the time.
pub fn standard_webhook_headers(
    keys: &[SigningKey],
    id: &str,
    timestamp: u64,
    body: &[u8],
) -> [(&'static str, String); 3] {
    let mut content = Vec::with_capacity(id.len() + body.len() + 24);
    content.extend_from_slice(id.as_bytes());
    content.push(b'.');
    content.extend_from_slice(timestamp.to_string().as_bytes());
    content.push(b'.');
    content.extend_from_slice(body);
    let signatures: Vec<String> = keys.iter().map(|k| k.sign(&content)).collect();
    [
        ("webhook-id", id.to_string()),
        ("webhook-timestamp", timestamp.to_string()),
        ("webhook-signature", signatures.join(" ")),
    ]
}

/// The key of a Standard Webhooks secret: `whsec_` and the base64 of at least 24 random
/// bytes, or `whsk_` and the base64 of an ed25519 secret key (its 32-byte seed, or the
/// 64-byte seed-and-public-key form libsodium and most tools print). The error names the
/// secret's position, never its value.
pub fn signing_key(secret: &str, position: usize) -> Result<SigningKey, String> {
    use base64::Engine as _;
    let secret = secret.trim();
    let (prefix, b64) = if let Some(b64) = secret.strip_prefix("whsec_") {
        ("whsec_", b64)
    } else if let Some(b64) = secret.strip_prefix("whsk_") {
        ("whsk_", b64)
    } else {
        return Err(format!(
            "http signing secret #{position} starts with neither whsec_ nor whsk_ (a Standard Webhooks secret is whsec_ and the base64 of at least 24 random bytes, or whsk_ and the base64 of an ed25519 secret key)"
        ));
    };
    let key = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| {
            format!("http signing secret #{position}: the part after {prefix} is not base64: {e}")
        })?;
    if prefix == "whsec_" {
        if key.len() < 24 {
            return Err(format!(
                "http signing secret #{position} holds {} bytes; use at least 24 random bytes",
                key.len()
            ));
        }
        return Ok(SigningKey::Hmac(key));
    }
    let seed: [u8; 32] = match key.len() {
        32 | 64 => key[..32].try_into().expect("32 bytes"),
        n => {
            return Err(format!(
                "http signing secret #{position} (whsk_) holds {n} bytes; an ed25519 secret key is its 32-byte seed or 64 bytes of seed and public key"
            ))
        }
    };
    let k = ed25519_dalek::SigningKey::from_bytes(&seed);
    if key.len() == 64 && key[32..] != k.verifying_key().to_bytes() {
        return Err(format!(
            "http signing secret #{position} (whsk_): its last 32 bytes are not the public key of its first 32; the secret key is damaged"
        ));
    }
    Ok(SigningKey::Ed25519(Box::new(k)))
}

impl Default for HttpSinkConfig {
    fn default() -> Self {
        HttpSinkConfig {
            endpoint: "default".into(),
            method: "POST".into(),
            idempotency_header: "Idempotency-Key".into(),
            headers: Vec::new(),
            response_id_header: None,
            request_timeout: Duration::from_secs(10),
            deadline: Duration::from_secs(30),
            max_concurrency: 64,
            idempotency_window: None,
            ca_file: None,
            signing_secrets: Vec::new(),
        }
    }
}

impl fmt::Debug for HttpSinkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let headers: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(k, _)| (k.as_str(), "***"))
            .collect();
        f.debug_struct("HttpSinkConfig")
            .field("endpoint", &self.endpoint)
            .field("method", &self.method)
            .field("idempotency_header", &self.idempotency_header)
            .field("headers", &headers)
            .field("response_id_header", &self.response_id_header)
            .field("request_timeout", &self.request_timeout)
            .field("deadline", &self.deadline)
            .field("max_concurrency", &self.max_concurrency)
            .field("idempotency_window", &self.idempotency_window)
            .field("ca_file", &self.ca_file)
            .field("signing_secrets", &vec!["***"; self.signing_secrets.len()])
            .finish()
    }
}

/// What a 2xx answer proves: the endpoint took the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpReceipt {
    pub status: u16,
    /// The value of the configured response id header, if the endpoint sent it.
    pub response_id: Option<String>,
    /// sha256 of the response body, hex.
    pub body_digest: String,
}

impl HttpReceipt {
    /// The receipt as the ledger keeps it (`outbox.receipts.evidence`), JSON.
    pub fn evidence(&self) -> String {
        serde_json::json!({
            "status": self.status,
            "response_id": self.response_id,
            "body_sha256": self.body_digest,
        })
        .to_string()
    }
}

/// What one answer means (pure: [`classify`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// 2xx: applied.
    Applied { status: u16 },
    /// 408, 429, 503: not processed; ask again after `after` (from `Retry-After`), if given.
    NotNow {
        status: u16,
        after: Option<Duration>,
    },
    /// Another 4xx, or a 3xx (no redirect is followed): the frozen request will never succeed.
    Refused { status: u16 },
    /// Another 5xx (or 1xx, which a webhook never answers): it may have been applied.
    Ambiguous { status: u16 },
}

/// Classifies an answer's status; `retry_after` is its `Retry-After` header (seconds, or an
/// HTTP date compared with `now`).
pub fn classify(status: u16, retry_after: Option<&str>, now: SystemTime) -> Answer {
    match status {
        200..=299 => Answer::Applied { status },
        408 | 429 | 503 => Answer::NotNow {
            status,
            after: retry_after.and_then(|v| parse_retry_after(v, now)),
        },
        // 3xx: no redirect is followed; 4xx: the request is refused.
        300..=499 => Answer::Refused { status },
        _ => Answer::Ambiguous { status },
    }
}

/// `Retry-After`: delay-seconds, or an IMF-fixdate (`Wed, 21 Oct 2015 07:28:00 GMT`).
pub fn parse_retry_after(v: &str, now: SystemTime) -> Option<Duration> {
    let v = v.trim();
    if let Ok(s) = v.parse::<u64>() {
        return Some(Duration::from_secs(s));
    }
    let at = parse_http_date(v)?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// An IMF-fixdate, the only form a sender may generate (RFC 9110, 5.6.7).
fn parse_http_date(v: &str) -> Option<SystemTime> {
    let rest = v.split_once(", ")?.1;
    let mut parts = rest.split(' ');
    let day: u64 = parts.next()?.parse().ok()?;
    let month = match parts.next()? {
        "Jan" => 1,
        "Feb" => 2,
        "Mar" => 3,
        "Apr" => 4,
        "May" => 5,
        "Jun" => 6,
        "Jul" => 7,
        "Aug" => 8,
        "Sep" => 9,
        "Oct" => 10,
        "Nov" => 11,
        "Dec" => 12,
        _ => return None,
    };
    let year: i64 = parts.next()?.parse().ok()?;
    let mut hms = parts.next()?.split(':').map(|x| x.parse::<u64>().ok());
    let (h, m, s) = (hms.next()??, hms.next()??, hms.next()??);
    if parts.next()? != "GMT" || !(1..=31).contains(&day) || h > 23 || m > 59 || s > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let (y, mo) = if month <= 2 {
        (year - 1, month + 9)
    } else {
        (year, month - 3)
    };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * mo as i64 + 2) / 5 + day as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = u64::try_from(days).ok()? * 86_400 + h * 3600 + m * 60 + s;
    Some(UNIX_EPOCH + Duration::from_secs(secs))
}

/// The longest pause between two tries of one send, when the endpoint gives no `Retry-After`
/// (and the longest `Retry-After` obeyed: the deadline bounds the whole send anyway).
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// The pause before try `n` (1-based) without a `Retry-After`: 100 ms, doubling.
fn pause(n: u32) -> Duration {
    Duration::from_millis(100)
        .saturating_mul(2u32.saturating_pow(n.saturating_sub(1)))
        .min(MAX_PAUSE)
}

/// How one send (all its tries) ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exchange {
    Receipt(HttpReceipt),
    /// No try may have been applied (refused connections, 408/429/503): safe to send again.
    NotPersisted(String),
    /// The endpoint refused the request (another 4xx).
    Refused {
        status: u16,
        body: String,
    },
    /// A try may have been applied: DISPATCH_UNKNOWN.
    Unknown(String),
}

/// Publishes to one HTTP endpoint. A clone shares the client, the configuration and the
/// concurrency bound.
#[derive(Clone)]
pub struct HttpSink {
    config: Arc<HttpSinkConfig>,
    client: reqwest::Client,
    method: reqwest::Method,
    reports: UnboundedSender<Delivery>,
    permits: Arc<Semaphore>,
    /// Standard Webhooks keys (from `signing_secrets`); empty: unsigned.
    signing_keys: Arc<Vec<SigningKey>>,
    /// Set by the first `410 Gone`: the endpoint is disabled for the rest of this run.
    gone: Arc<std::sync::OnceLock<String>>,
}

impl fmt::Debug for HttpSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpSink")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl HttpSink {
    /// Builds the client. Delivery reports are sent to `reports`.
    pub fn new(
        config: HttpSinkConfig,
        reports: UnboundedSender<Delivery>,
    ) -> Result<HttpSink, SinkError> {
        let fail = |message: String| SinkError::Http {
            endpoint: config.endpoint.clone(),
            what: "building the HTTP client".into(),
            message,
        };
        let method = match config.method.to_ascii_uppercase().as_str() {
            "POST" => reqwest::Method::POST,
            "PUT" => reqwest::Method::PUT,
            other => {
                return Err(fail(format!(
                    "method {other:?} is not supported: use POST or PUT"
                )))
            }
        };
        let mut builder = reqwest::Client::builder()
            // A 3xx is answered to the sink, never followed (see the module's documentation).
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(config.request_timeout)
            .user_agent(concat!("outboxd/", env!("CARGO_PKG_VERSION")));
        if let Some(path) = &config.ca_file {
            let pem = std::fs::read(path)
                .map_err(|e| fail(format!("reading http.ca_file {}: {e}", path.display())))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                fail(format!(
                    "http.ca_file {} holds no PEM certificate: {e}",
                    path.display()
                ))
            })?;
            for c in certs {
                builder = builder.add_root_certificate(c);
            }
        }
        let client = builder.build().map_err(|e| fail(e.to_string()))?;
        let permits = Arc::new(Semaphore::new(config.max_concurrency.max(1)));
        let signing_keys = config
            .signing_secrets
            .iter()
            .enumerate()
            .map(|(i, s)| signing_key(s, i + 1))
            .collect::<Result<Vec<_>, _>>()
            .map_err(fail)?;
        Ok(HttpSink {
            config: Arc::new(config),
            client,
            method,
            reports,
            permits,
            signing_keys: Arc::new(signing_keys),
            gone: Arc::new(std::sync::OnceLock::new()),
        })
    }

    pub fn config(&self) -> &HttpSinkConfig {
        &self.config
    }

    /// Why the endpoint is disabled, if it answered `410 Gone` in this run.
    pub fn gone(&self) -> Option<&str> {
        self.gone.get().map(String::as_str)
    }

    /// One exchange, unless the endpoint is disabled. `410 Gone` is the endpoint saying it
    /// wants nothing more from this sender (the Standard Webhooks convention: disable the
    /// endpoint, stop sending). The first one disables the endpoint for the rest of the run:
    /// every later event is refused without a request (quarantined, its aggregate held, like
    /// the 410 itself), so the endpoint is not asked once per aggregate, and nothing is lost:
    /// the held events wait for the operator's release after the endpoint or the route is
    /// fixed and the relay started again.
    async fn exchange_unless_gone(&self, ev: &OutboxEvent) -> Exchange {
        if let Some(why) = self.gone.get() {
            return Exchange::Refused {
                status: 410,
                body: format!("not sent: {why}"),
            };
        }
        let x = exchange(self, ev).await;
        if let Exchange::Refused { status: 410, .. } = &x {
            let why = format!(
                "endpoint {} answered 410 Gone to event {} and is disabled for this run",
                self.config.endpoint, ev.event_id
            );
            if self.gone.set(why.clone()).is_ok() {
                tracing::error!(endpoint = %self.config.endpoint, event_id = %ev.event_id,
                    "{why}: every further event is held without a request (see `outboxd quarantine list`); fix the endpoint or the route, start the relay again, then release the held aggregates");
            }
        }
        x
    }

    /// The `whpk_` public keys receivers verify `v1a,` signatures with, one per `whsk_` secret.
    pub fn public_keys(&self) -> Vec<String> {
        self.signing_keys
            .iter()
            .filter_map(SigningKey::public)
            .collect()
    }

    /// One request of `ev`, with its headers.
    fn request(&self, ev: &OutboxEvent, timeout: Duration) -> reqwest::RequestBuilder {
        let c = &self.config;
        let mut r = self
            .client
            .request(self.method.clone(), &ev.destination.topic)
            .timeout(timeout)
            .header(c.idempotency_header.as_str(), ev.event_id.to_string())
            .header(reqwest::header::CONTENT_TYPE, "application/json");
        for (k, v) in crate::event_headers(ev) {
            r = r.header(http_header_name(&k), v.into_owned());
        }
        for (k, v) in &c.headers {
            r = r.header(k.as_str(), v.as_str());
        }
        if !self.signing_keys.is_empty() {
            // A fresh timestamp and signature on every attempt; the id stays the event's.
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let id = ev.event_id.to_string();
            for (k, v) in standard_webhook_headers(&self.signing_keys, &id, now, &ev.payload) {
                r = r.header(k, v);
            }
        }
        r.body(ev.payload.clone())
    }

    /// Sends `ev` until an answer settles it or the deadline passes.
    pub async fn exchange(&self, ev: &OutboxEvent) -> Exchange {
        exchange(self, ev).await
    }
}

/// `aggregate_type` → `Outbox-Aggregate-Type`.
fn http_header_name(key: &str) -> String {
    let mut out = String::from("Outbox-");
    for (i, word) in key.split('_').enumerate() {
        if i > 0 {
            out.push('-');
        }
        let mut cs = word.chars();
        if let Some(f) = cs.next() {
            out.extend(f.to_uppercase());
            out.extend(cs);
        }
    }
    out
}

async fn exchange(sink: &HttpSink, ev: &OutboxEvent) -> Exchange {
    let c = &sink.config;
    let started = Instant::now();
    let mut tries = 0u32;
    loop {
        tries += 1;
        let left = c.deadline.saturating_sub(started.elapsed());
        let timeout = c.request_timeout.min(left.max(Duration::from_millis(1)));
        let wait = match sink.request(ev, timeout).send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let header = |name: &str| {
                    resp.headers()
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string)
                };
                let retry_after = header("retry-after");
                let location = header("location");
                let response_id = c.response_id_header.as_deref().and_then(header);
                let answer = classify(status, retry_after.as_deref(), SystemTime::now());
                // The body is read for every answer: an error reading it after a 2xx leaves
                // the outcome unknown (the endpoint answered; the receipt is incomplete).
                let body = match resp.bytes().await {
                    Ok(b) => b,
                    Err(e) if matches!(answer, Answer::Applied { .. }) => {
                        return Exchange::Unknown(format!(
                            "{status} answered, but its body could not be read: {e}"
                        ))
                    }
                    Err(_) => Default::default(),
                };
                match answer {
                    Answer::Applied { status } => {
                        return Exchange::Receipt(HttpReceipt {
                            status,
                            response_id,
                            body_digest: hex::encode(Sha256::digest(&body)),
                        })
                    }
                    Answer::Refused { status } if (300..400).contains(&status) => {
                        // The target without its query or fragment, which may carry tokens.
                        let to = location
                            .as_deref()
                            .map(|l| l.split(['?', '#']).next().unwrap_or(""))
                            .unwrap_or("nowhere (no Location header)");
                        return Exchange::Refused {
                            status,
                            body: format!(
                                "a redirect to {to}, not followed: outboxd never follows redirects (they would carry the payload and the [http.headers] elsewhere); route the events to the final URL (outbox.set_http_route)"
                            ),
                        };
                    }
                    Answer::Refused { status } => {
                        return Exchange::Refused {
                            status,
                            body: String::from_utf8_lossy(&body[..body.len().min(500)])
                                .into_owned(),
                        }
                    }
                    Answer::Ambiguous { status } => {
                        return Exchange::Unknown(format!(
                            "the endpoint answered {status}: it may have applied the request"
                        ))
                    }
                    Answer::NotNow { status, after } => (
                        format!("{status}"),
                        after.unwrap_or(pause(tries)).min(MAX_PAUSE),
                    ),
                }
            }
            // Nothing was written: the connection was never made.
            Err(e) if e.is_connect() && !e.is_timeout() => {
                (format!("connection failed: {e}"), pause(tries))
            }
            Err(e) => {
                return Exchange::Unknown(format!(
                    "no answer ({}): the request may have been applied",
                    describe(&e)
                ))
            }
        };
        let (why, after) = wait;
        if started.elapsed() + after >= c.deadline {
            return Exchange::NotPersisted(format!(
                "{why} after {tries} tries in {:?}; the endpoint did not take it before the deadline",
                started.elapsed()
            ));
        }
        tracing::debug!(event_id = %ev.event_id, %why, retry_in_ms = after.as_millis() as u64, "endpoint asks to try again");
        tokio::time::sleep(after).await;
    }
}

/// A transport error in one phrase, with its cause.
fn describe(e: &reqwest::Error) -> String {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connecting"
    } else if e.is_body() || e.is_request() {
        "connection lost"
    } else {
        "error"
    };
    let mut out = what.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// An HTTP receipt's time: when the answer arrived, in Unix milliseconds (an endpoint's answer
/// carries no broker timestamp).
pub fn answered_at_ms() -> Option<i64> {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()
        .map(|d| d.as_millis() as i64)
}

/// The delivery report of an exchange. An HTTP receipt has no broker position: partition 0,
/// offset 0 (what proves it is the answer, [`HttpReceipt`]).
fn outcome(ev: &OutboxEvent, x: Exchange) -> DeliveryOutcome {
    let failed = |error: String, persistence, class| DeliveryOutcome::Failed {
        error,
        persistence,
        class,
        partition: 0,
    };
    match x {
        Exchange::Receipt(r) => {
            tracing::debug!(event_id = %ev.event_id, status = r.status, response_id = ?r.response_id, body_digest = %r.body_digest, "endpoint applied the event");
            DeliveryOutcome::Persisted {
                topic: ev.destination.topic.clone(),
                partition: 0,
                offset: 0,
                timestamp_ms: answered_at_ms(),
                duplicate: false,
                evidence: Some(r.evidence()),
            }
        }
        Exchange::NotPersisted(why) => {
            failed(why, Persistence::NotPersisted, FailureClass::Transient)
        }
        Exchange::Refused { status, body } => failed(
            format!("the endpoint refused the request with {status}: {body}"),
            Persistence::NotPersisted,
            FailureClass::Permanent,
        ),
        Exchange::Unknown(why) => {
            failed(why, Persistence::PossiblyPersisted, FailureClass::Transient)
        }
    }
}

impl Sink for HttpSink {
    fn served(&self) -> Served {
        Served {
            kind: "http",
            clusters: vec![self.config.endpoint.clone()],
            partitioner: None,
        }
    }

    async fn send(&self, ev: &OutboxEvent, token: u64) -> Result<(), SinkError> {
        // Backpressure: at most `max_concurrency` requests in flight.
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| SinkError::Closed)?;
        let sink = self.clone();
        let ev = ev.clone();
        tokio::spawn(async move {
            let x = sink.exchange_unless_gone(&ev).await;
            drop(permit);
            // A closed channel means the pipeline is gone; the event is unresolved and will be
            // replayed from the checkpoint, so dropping the report is safe.
            let _ = sink.reports.send(Delivery {
                token,
                outcome: outcome(&ev, x),
            });
        });
        Ok(())
    }

    fn ack_timeout(&self) -> Duration {
        self.config.deadline
    }

    /// An endpoint has nothing to read: its look-up is always the retry with the same key.
    fn lookup_resends(&self, _sent_ago: Duration) -> bool {
        true
    }

    async fn lookup(&self, q: UnknownLookup<'_>) -> Result<Lookup, SinkError> {
        let proof = self
            .config
            .idempotency_window
            .is_some_and(|w| q.sent_ago < w);
        if !proof {
            tracing::warn!(event_id = %q.event.event_id, endpoint = %self.config.endpoint,
                sent_ago_ms = q.sent_ago.as_millis() as u64,
                "retrying an UNKNOWN send with the same idempotency key outside a declared idempotency window: the endpoint must deduplicate by key");
        }
        match self.exchange_unless_gone(q.event).await {
            Exchange::Receipt(r) => {
                tracing::info!(event_id = %q.event.event_id, status = r.status, proof,
                    "the retry with the same key was answered: its answer is the receipt");
                Ok(Lookup::StoredByProbe {
                    partition: 0,
                    offset: 0,
                    timestamp_ms: None,
                    evidence: Some(r.evidence()),
                })
            }
            // The endpoint refuses the very request it may already have applied: an operator
            // decides (`outboxd status --event`, then quarantine tools).
            Exchange::Refused { status, body } => Err(SinkError::Unprovable {
                event_id: q.event.event_id.to_string(),
                stream: self.config.endpoint.clone(),
                reason: format!("the retry with the same key was refused with {status}: {body}"),
            }),
            // No answer, a 5xx, a 429 past the deadline: nothing is proven either way, and a
            // later retry may be answered. Transient: the run restarts after the backoff.
            Exchange::Unknown(reason) | Exchange::NotPersisted(reason) => {
                Err(SinkError::HttpUnanswered {
                    endpoint: self.config.endpoint.clone(),
                    event_id: q.event.event_id.to_string(),
                    reason,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Standard Webhooks specification's own example (its reference libraries test the
    /// same): secret, message id, timestamp and body give this signature.
    #[test]
    fn signatures_match_the_standard_webhooks_example_and_rotate() {
        let key = signing_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", 1).unwrap();
        let body = br#"{"test": 2432232314}"#;
        let [id, ts, sig] = standard_webhook_headers(
            std::slice::from_ref(&key),
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            body,
        );
        assert_eq!(
            id,
            ("webhook-id", "msg_p5jXN8AQM9LWM0D4loKWxJek".to_string())
        );
        assert_eq!(ts, ("webhook-timestamp", "1614265330".to_string()));
        assert_eq!(
            sig,
            (
                "webhook-signature",
                "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=".to_string()
            )
        );
        // Two secrets: one signature each, space-separated, the old one still verifiable.
        let other = SigningKey::Hmac(vec![7u8; 32]);
        let [_, _, two] = standard_webhook_headers(
            &[other, key],
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            body,
        );
        let parts: Vec<&str> = two.1.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[1], "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    /// `v1a,`: an ed25519 signature of `id.timestamp.body` that the `whpk_` key verifies, in
    /// both serialisations of the secret key; a damaged 64-byte key is refused.
    #[test]
    fn asymmetric_signatures_verify_with_the_public_key() {
        use base64::Engine as _;
        use ed25519_dalek::Verifier as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        let seed = [42u8; 32];
        let sk = ed25519_dalek::SigningKey::from_bytes(&seed);
        let pk = sk.verifying_key().to_bytes();
        let mut pair = seed.to_vec();
        pair.extend_from_slice(&pk);
        for secret in [
            format!("whsk_{}", b64.encode(seed)),
            format!("whsk_{}", b64.encode(&pair)),
        ] {
            let key = signing_key(&secret, 1).unwrap();
            assert_eq!(key.public(), Some(format!("whpk_{}", b64.encode(pk))));
            let hmac = signing_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", 2).unwrap();
            let [_, _, sig] = standard_webhook_headers(&[hmac, key], "msg_1", 1614265330, b"{}");
            let parts: Vec<&str> = sig.1.split(' ').collect();
            assert!(parts[0].starts_with("v1,"), "{parts:?}");
            let v1a = parts[1].strip_prefix("v1a,").expect("a v1a signature");
            let signature =
                ed25519_dalek::Signature::from_slice(&b64.decode(v1a).unwrap()).unwrap();
            let vk = ed25519_dalek::VerifyingKey::from_bytes(&pk).unwrap();
            assert!(vk.verify(b"msg_1.1614265330.{}", &signature).is_ok());
            assert!(vk.verify(b"msg_1.1614265330.{ }", &signature).is_err());
        }
        pair[40] ^= 1;
        let e = signing_key(&format!("whsk_{}", b64.encode(&pair)), 3).unwrap_err();
        assert!(e.contains("#3") && e.contains("not the public key"), "{e}");
    }

    #[test]
    fn a_signing_secret_is_checked_without_printing_it() {
        for (secret, says) in [
            (
                "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                "starts with neither whsec_ nor whsk_",
            ),
            ("whsk_c2hvcnQ=", "holds 5 bytes"),
            ("whsec_not*base64", "not base64"),
            ("whsec_c2hvcnQ=", "holds 5 bytes"),
        ] {
            let e = signing_key(secret, 2).unwrap_err();
            assert!(e.contains(says) && e.contains("#2"), "{e}");
            assert!(!e.contains(secret.trim_start_matches("whsec_")), "{e}");
        }
    }

    #[test]
    fn statuses_are_receipts_waits_refusals_or_unknown() {
        let now = UNIX_EPOCH + Duration::from_secs(1_445_412_480);
        assert_eq!(classify(201, None, now), Answer::Applied { status: 201 });
        for s in [408, 429, 503] {
            assert_eq!(
                classify(s, Some("2"), now),
                Answer::NotNow {
                    status: s,
                    after: Some(Duration::from_secs(2))
                }
            );
        }
        for s in [
            400, 401, 403, 404, 409, 410, 413, 422, 301, 302, 303, 307, 308,
        ] {
            assert_eq!(classify(s, None, now), Answer::Refused { status: s });
        }
        for s in [500, 502, 504, 599, 101] {
            assert_eq!(classify(s, None, now), Answer::Ambiguous { status: s });
        }
    }

    #[test]
    fn retry_after_takes_seconds_or_an_http_date() {
        // 2015-10-21T07:28:00Z = 1445412480.
        let now = UNIX_EPOCH + Duration::from_secs(1_445_412_470);
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:27:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(
            parse_retry_after(" 120 ", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(
            parse_retry_after("Wed, 32 Oct 2015 07:28:00 GMT", now),
            None
        );
        assert_eq!(
            parse_http_date("Thu, 01 Jan 1970 00:00:00 GMT"),
            Some(UNIX_EPOCH)
        );
        assert_eq!(
            parse_http_date("Tue, 29 Feb 2000 12:00:00 GMT"),
            Some(UNIX_EPOCH + Duration::from_secs(951_825_600))
        );
    }

    #[test]
    fn pauses_grow_to_a_cap_and_headers_are_named_for_http() {
        assert_eq!(pause(1), Duration::from_millis(100));
        assert_eq!(pause(3), Duration::from_millis(400));
        assert_eq!(pause(40), MAX_PAUSE);
        assert_eq!(http_header_name("aggregate_type"), "Outbox-Aggregate-Type");
        assert_eq!(http_header_name("id"), "Outbox-Id");
    }

    #[test]
    fn auth_header_values_never_print() {
        let c = HttpSinkConfig {
            headers: vec![("Authorization".into(), "Bearer s3cret".into())],
            ..HttpSinkConfig::default()
        };
        let s = format!("{c:?}");
        assert!(s.contains("Authorization") && !s.contains("s3cret"), "{s}");
    }
}
