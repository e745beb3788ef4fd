//! A real HTTP/1.1 server for the HTTP sink's tests: a webhook endpoint that stores what it
//! applies by idempotency key, and misbehaves on demand, as endpoints do.
//!
//! It is a server on a TCP socket, not a mock of the client: the sink's requests cross the
//! loopback and are parsed here. What it can do, per request, in the order the test queues
//! [`Behavior`]s (then [`Behavior::Normal`]):
//! * apply and answer 201 (`X-Response-Id`, a JSON body);
//! * apply, then answer late (after the client's timeout);
//! * read the request and drop the connection, applied or not;
//! * answer a status (429, 503, 500, ...) with an optional `Retry-After`, without applying;
//! * apply, then answer a status (a 500 after the work was done);
//! * answer a redirect (307, ...) to another URL, without applying;
//! * misbehave at random on a share of requests ([`Misbehave`]), as real receivers do;
//! * refuse one poison payload with 400, always;
//! * answer 503 to every request whose body contains a given text, until told otherwise
//!   ([`HttpTarget::unavailable_for`]: one tenant's or aggregate's handler that is down);
//! * serve HTTPS with a given certificate ([`TargetSettings::tls`]).
//!
//! With `dedupe` on (an endpoint that keeps idempotency keys), a request whose key was applied
//! before is answered 200 with the first answer's response id and is not applied again.
//!
//! It records every request with the answer it got, and every application. What a test
//! asserts of a relay's run ([`HttpTarget::assert_at_most_once`],
//! [`HttpTarget::assert_applied_within`], [`HttpTarget::assert_body_digest`]) is counted by
//! event id (the `Outbox-Id` header), not by key, and does not rely on the key store: a key
//! sent again after a clear answer is a second application even where `dedupe` hid it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::path::PathBuf;
use std::pin::Pin;

use openssl::ssl::{SslAcceptor, SslFiletype, SslMethod};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the server does with the next request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Behavior {
    /// Apply (unless it is a duplicate key with `dedupe` on) and answer 201.
    Normal,
    /// Apply, then answer after this delay.
    Late(Duration),
    /// Read the request and close the connection without answering; apply it first if `true`.
    Drop { applied: bool },
    /// Answer `status` without applying, with `Retry-After: retry_after` if given.
    Status {
        status: u16,
        retry_after: Option<String>,
    },
    /// Apply, then answer `status` (an endpoint that failed after doing the work).
    FailAfterApplying { status: u16 },
    /// Answer a redirect (`status`, e.g. 307) to `location` without applying.
    Redirect { status: u16, location: String },
}

impl Behavior {
    /// Whether the request is applied (unless its key was applied before, with `dedupe` on).
    pub fn applies(&self) -> bool {
        matches!(
            self,
            Behavior::Normal
                | Behavior::Late(_)
                | Behavior::Drop { applied: true }
                | Behavior::FailAfterApplying { .. }
        )
    }

    /// Whether the client cannot tell from the answer whether it was applied: no answer in
    /// time, no answer at all, or a 5xx other than 503.
    pub fn is_ambiguous(&self) -> bool {
        matches!(
            self,
            Behavior::Late(_)
                | Behavior::Drop { .. }
                | Behavior::FailAfterApplying { .. }
                | Behavior::Status { status: 500, .. }
        )
    }
}

/// Misbehaving at random: one request in `one_in` (when nothing is queued) meets one of the
/// faults real webhook receivers show — an answer after `late` (applied), a connection dropped
/// after or before applying, a 500 after applying, a 503 with `Retry-After: 1`, a 429 — chosen
/// by a generator seeded with `seed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Misbehave {
    pub one_in: u32,
    pub late: Duration,
    pub seed: u64,
}

impl Misbehave {
    /// The behaviour for the next request, advancing the generator in `state`.
    fn pick(&self, state: &mut u64) -> Behavior {
        // xorshift64*: deterministic for a seed, good enough to spread faults.
        let mut next = || {
            *state ^= *state >> 12;
            *state ^= *state << 25;
            *state ^= *state >> 27;
            state.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        if next() % u64::from(self.one_in.max(1)) != 0 {
            return Behavior::Normal;
        }
        match next() % 6 {
            0 => Behavior::Late(self.late),
            1 => Behavior::Drop { applied: true },
            2 => Behavior::Drop { applied: false },
            3 => Behavior::FailAfterApplying { status: 500 },
            4 => Behavior::Status {
                status: 503,
                retry_after: Some("1".into()),
            },
            _ => Behavior::Status {
                status: 429,
                retry_after: None,
            },
        }
    }
}

/// One request as the server read it.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// Header names lower-cased.
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
    pub at: Instant,
    pub behavior: Behavior,
    /// The status and body it was answered (`None`: the connection was dropped).
    pub answer: Option<(u16, String)>,
}

/// A header a test configures on each relay process it starts (`[http] headers`), a
/// different value per process: [`HttpTarget::at_most_once_problems`] then tells the runs of
/// the client apart by it instead of by [`HttpTarget::client_restarted`]'s mark, which a
/// request the killed process wrote just before it died can still be read after.
pub const CLIENT_RUN_HEADER: &str = "X-Test-Client-Run";

impl Request {
    /// The run of the client that sent it ([`CLIENT_RUN_HEADER`]), if the test marks them.
    pub fn client_run(&self) -> Option<&str> {
        self.headers
            .get(&CLIENT_RUN_HEADER.to_ascii_lowercase())
            .map(String::as_str)
    }

    /// The event it carries: its `Outbox-Id` header, or its idempotency key without one.
    fn event_id(&self, key_header: &str) -> String {
        self.headers
            .get("outbox-id")
            .or_else(|| self.headers.get(key_header))
            .cloned()
            .unwrap_or_default()
    }

    /// Whether the client got an answer that settles the request: a 2xx in time, or a 4xx
    /// other than 408/429 (a refusal). Sending the same key again after one is a second
    /// delivery nothing called for.
    fn clearly_answered(&self) -> bool {
        !self.behavior.is_ambiguous()
            && self.answer.as_ref().is_some_and(|(status, _)| {
                (200..300).contains(status)
                    || ((400..500).contains(status) && ![408, 429].contains(status))
            })
    }
}

/// One application of a request: the work the endpoint did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Application {
    /// The idempotency key it was applied under.
    pub key: String,
    /// The event it carried ([`Request`]'s `Outbox-Id` header, or the key without one).
    pub event_id: String,
    /// The response id this application created.
    pub response_id: String,
}

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<Behavior>,
    requests: Vec<Request>,
    /// key → how many times it was applied, and the response id of its first application.
    applied: HashMap<String, (u32, String)>,
    /// Keys in the order they were first applied.
    order: Vec<String>,
    /// Every application, in order (with `dedupe` off, a key's repeats too).
    applications: Vec<Application>,
    /// How many requests had been read when the test said the client restarted.
    restarts: Vec<usize>,
    next_id: u64,
    misbehave: Option<Misbehave>,
    rng: u64,
    /// Bodies containing this are answered 503 without applying ([`HttpTarget::unavailable_for`]).
    unavailable_for: Option<String>,
}

/// The running server; dropping it stops it.
#[derive(Debug)]
pub struct HttpTarget {
    addr: std::net::SocketAddr,
    https: bool,
    key_header: String,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HttpTarget {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How the endpoint behaves throughout.
#[derive(Debug, Clone)]
pub struct TargetSettings {
    /// The idempotency header it reads (lower-case).
    pub key_header: String,
    /// Whether it keeps keys: a repeat is answered without being applied again.
    pub dedupe: bool,
    /// A body containing this is refused with 400, never applied.
    pub poison: Option<String>,
    /// Serve HTTPS with this certificate (PEM chain) and key instead of plain HTTP.
    pub tls: Option<(PathBuf, PathBuf)>,
}

impl Default for TargetSettings {
    fn default() -> Self {
        TargetSettings {
            key_header: "idempotency-key".into(),
            dedupe: true,
            poison: None,
            tls: None,
        }
    }
}

impl HttpTarget {
    /// Listens on 127.0.0.1, on a free port.
    pub async fn start(settings: TargetSettings) -> std::io::Result<HttpTarget> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let acceptor = match &settings.tls {
            None => None,
            Some((cert, key)) => {
                let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls())
                    .map_err(std::io::Error::other)?;
                b.set_certificate_chain_file(cert)
                    .map_err(std::io::Error::other)?;
                b.set_private_key_file(key, SslFiletype::PEM)
                    .map_err(std::io::Error::other)?;
                Some(Arc::new(b.build()))
            }
        };
        let https = settings.tls.is_some();
        let key_header = settings.key_header.clone();
        let settings = Arc::new(settings);
        let s = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (s, settings, acceptor) = (s.clone(), settings.clone(), acceptor.clone());
                tokio::spawn(async move {
                    match acceptor {
                        None => serve(sock, s, settings).await,
                        Some(a) => {
                            let Ok(ssl) = openssl::ssl::Ssl::new(a.context()) else {
                                return;
                            };
                            let Ok(mut tls) = tokio_openssl::SslStream::new(ssl, sock) else {
                                return;
                            };
                            // A client that refuses the certificate ends here.
                            if Pin::new(&mut tls).accept().await.is_ok() {
                                serve(tls, s, settings).await;
                            }
                        }
                    }
                });
            }
        });
        Ok(HttpTarget {
            addr,
            state,
            task,
            https,
            key_header,
        })
    }

    /// `http://127.0.0.1:PORT` + `path` (`https://` when serving TLS).
    pub fn url(&self, path: &str) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}{path}", self.addr)
    }

    /// Connections that completed the TLS handshake or sent a plain request: how many requests
    /// were read (a client that refused the certificate sent none).
    pub fn request_count(&self) -> usize {
        self.state.lock().unwrap().requests.len()
    }

    /// Queues what the next requests meet, in order.
    pub fn then(&self, b: Behavior) {
        self.state.lock().unwrap().queue.push_back(b);
    }

    /// Drops whatever is still queued: the next requests are served normally (an endpoint
    /// that recovers).
    pub fn recover(&self) {
        self.state.lock().unwrap().queue.clear();
    }

    /// Misbehaves at random from now on (`None`: behaves again).
    pub fn misbehave(&self, m: Option<Misbehave>) {
        let mut st = self.state.lock().unwrap();
        st.rng = m.map_or(1, |m| m.seed | 1);
        st.misbehave = m;
    }

    /// From now on, answers 503 (no `Retry-After`, nothing applied) to every request whose body
    /// contains `text` (`None`: serves them again): an endpoint whose handler for one tenant
    /// or aggregate is down while the others work.
    pub fn unavailable_for(&self, text: Option<&str>) {
        self.state.lock().unwrap().unavailable_for = text.map(str::to_string);
    }

    /// Every request read so far.
    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
    }

    /// How many requests carried idempotency key `key` (applied, deduplicated or not).
    pub fn requests_with_key(&self, key: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .requests
            .iter()
            .filter(|r| r.headers.get(&self.key_header).map(String::as_str) == Some(key))
            .count()
    }

    /// How many times the request with idempotency key `key` was applied.
    pub fn applied(&self, key: &str) -> u32 {
        self.state
            .lock()
            .unwrap()
            .applied
            .get(key)
            .map_or(0, |a| a.0)
    }

    /// The response id of the first application of key `key` (every answer to that key names it).
    pub fn response_id(&self, key: &str) -> Option<String> {
        self.state
            .lock()
            .unwrap()
            .applied
            .get(key)
            .map(|a| a.1.clone())
    }

    /// Keys in the order they were first applied.
    pub fn applied_order(&self) -> Vec<String> {
        self.state.lock().unwrap().order.clone()
    }

    /// Every application so far, in order.
    pub fn applications(&self) -> Vec<Application> {
        self.state.lock().unwrap().applications.clone()
    }

    /// Says the client restarted (a relay SIGKILLed and started again): it may send again what
    /// its predecessor was answered but had not recorded, which is at-least-once, not a
    /// second delivery nothing called for ([`HttpTarget::at_most_once_problems`]). A request
    /// the killed process wrote just before it died may still be read after this mark; a test
    /// where that matters marks each run with [`CLIENT_RUN_HEADER`] instead.
    pub fn client_restarted(&self) {
        let mut st = self.state.lock().unwrap();
        let n = st.requests.len();
        st.restarts.push(n);
    }

    /// What contradicts "each event applied at most once": an event id applied more than once
    /// (under one key or several), and a key sent again after a clear answer by the same run
    /// of the client ([`HttpTarget::client_restarted`]): with `dedupe` on, the key store
    /// answered it without applying it, hiding the second application.
    pub fn at_most_once_problems(&self) -> Vec<String> {
        let st = self.state.lock().unwrap();
        let mut problems = Vec::new();
        let mut per_event: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for a in &st.applications {
            per_event.entry(&a.event_id).or_default().push(&a.key);
        }
        for (id, keys) in per_event.iter().filter(|(_, k)| k.len() > 1) {
            problems.push(format!(
                "event {id} applied {} times (keys {keys:?})",
                keys.len()
            ));
        }
        // By the client's run where requests name it, else by the restart marks.
        let mut answered: HashMap<(Option<&str>, String), usize> = HashMap::new();
        for (i, r) in st.requests.iter().enumerate() {
            if st.restarts.contains(&i) {
                answered.retain(|(run, _), _| run.is_some());
            }
            let key = (
                r.client_run(),
                r.headers.get(&self.key_header).cloned().unwrap_or_default(),
            );
            if let Some(first) = answered.get(&key) {
                let (status, _) = st.requests[*first].answer.clone().unwrap_or_default();
                let run = key
                    .0
                    .map(|r| format!(" by client run {r}"))
                    .unwrap_or_default();
                let gap = r.at.saturating_duration_since(st.requests[*first].at);
                problems.push(format!(
                    "event {} sent again{run} (request {i}, {:?}) {} ms after request {first} was answered {status}",
                    r.event_id(&self.key_header),
                    r.behavior,
                    gap.as_millis()
                ));
            } else if r.clearly_answered() {
                answered.insert(key, i);
            }
        }
        problems
    }

    /// Panics naming every event applied more than once ([`HttpTarget::at_most_once_problems`]).
    pub fn assert_at_most_once(&self) {
        let problems = self.at_most_once_problems();
        assert!(
            problems.is_empty(),
            "the endpoint saw {} second application(s):\n{}",
            problems.len(),
            problems.join("\n")
        );
    }

    /// Panics naming every event id the endpoint applied that is not in `committed`.
    pub fn assert_applied_within<'a>(&self, committed: impl IntoIterator<Item = &'a str>) {
        let committed: std::collections::HashSet<&str> = committed.into_iter().collect();
        let strays: Vec<Application> = self
            .applications()
            .into_iter()
            .filter(|a| !committed.contains(a.event_id.as_str()))
            .collect();
        assert!(
            strays.is_empty(),
            "the endpoint applied {} event(s) no committed event has: {strays:?}",
            strays.len()
        );
    }

    /// Panics unless `digest` (hex sha256, as a receipt's evidence keeps it) is the digest of
    /// a 2xx body this endpoint answered to `key`.
    pub fn assert_body_digest(&self, key: &str, digest: &str) {
        let answered: Vec<(u16, String)> = self
            .requests()
            .into_iter()
            .filter(|r| r.headers.get(&self.key_header).map(String::as_str) == Some(key))
            .filter_map(|r| r.answer)
            .filter(|(status, _)| (200..300).contains(status))
            .collect();
        assert!(
            answered
                .iter()
                .any(|(_, body)| hex::encode(Sha256::digest(body.as_bytes())) == digest),
            "{key}: the evidence's body digest {digest} is the sha256 of no 2xx body the endpoint answered it ({answered:?})"
        );
    }
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    mut sock: S,
    state: Arc<Mutex<State>>,
    settings: Arc<TargetSettings>,
) {
    let mut buf = Vec::new();
    loop {
        let Some(req) = read_request(&mut sock, &mut buf).await else {
            return;
        };
        let key = req
            .headers
            .get(&settings.key_header)
            .cloned()
            .unwrap_or_default();
        let poison = settings
            .poison
            .as_ref()
            .is_some_and(|p| String::from_utf8_lossy(&req.body).contains(p.as_str()));
        let (behavior, answer, index) = {
            let mut st = state.lock().unwrap();
            let unavailable = st
                .unavailable_for
                .as_ref()
                .is_some_and(|t| String::from_utf8_lossy(&req.body).contains(t.as_str()));
            let behavior = if poison {
                Behavior::Status {
                    status: 400,
                    retry_after: None,
                }
            } else if unavailable {
                Behavior::Status {
                    status: 503,
                    retry_after: None,
                }
            } else if let Some(b) = st.queue.pop_front() {
                b
            } else if let Some(m) = st.misbehave {
                m.pick(&mut st.rng)
            } else {
                Behavior::Normal
            };
            let apply = behavior.applies();
            let mut answer = None;
            if apply {
                let seen = st.applied.get(&key).cloned();
                match seen {
                    Some((_, id)) if settings.dedupe => answer = Some((200, id)),
                    _ => {
                        st.next_id += 1;
                        let id = format!("r{}", st.next_id);
                        let st = &mut *st;
                        let e = st.applied.entry(key.clone()).or_insert((0, id.clone()));
                        e.0 += 1;
                        if e.0 == 1 {
                            st.order.push(key.clone());
                        }
                        answer = Some((201, e.1.clone()));
                        st.applications.push(Application {
                            key: key.clone(),
                            event_id: req.event_id(&settings.key_header),
                            response_id: id,
                        });
                    }
                }
            }
            st.requests.push(Request {
                behavior: behavior.clone(),
                ..req
            });
            (behavior, answer, st.requests.len() - 1)
        };
        let (status, extra, body) = match (&behavior, answer) {
            (Behavior::Drop { .. }, _) => return,
            (Behavior::FailAfterApplying { status }, _) => {
                (*status, String::new(), format!("{{\"status\":{status}}}"))
            }
            (
                Behavior::Status {
                    status,
                    retry_after,
                },
                _,
            ) => {
                let extra = retry_after
                    .as_ref()
                    .map(|r| format!("Retry-After: {r}\r\n"))
                    .unwrap_or_default();
                (*status, extra, format!("{{\"status\":{status}}}"))
            }
            (Behavior::Redirect { status, location }, _) => (
                *status,
                format!("Location: {location}\r\n"),
                "{}".to_string(),
            ),
            (_, Some((status, id))) => (
                status,
                format!("X-Response-Id: {id}\r\n"),
                format!("{{\"id\":\"{id}\"}}"),
            ),
            (_, None) => (500, String::new(), "{}".to_string()),
        };
        state.lock().unwrap().requests[index].answer = Some((status, body.clone()));
        let reply = response(status, &extra, &body);
        if let Behavior::Late(d) = behavior {
            tokio::time::sleep(d).await;
        }
        if sock.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
}

fn response(status: u16, extra_headers: &str, body: &str) -> String {
    let reason = match status {
        200 => "OK",
        201 => "Created",
        301 => "Moved Permanently",
        302 => "Found",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        408 => "Request Timeout",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    };
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra_headers}\r\n{body}",
        body.len()
    )
}

/// Reads one request (headers and a `Content-Length` body) from `sock`; `None` at the end of
/// the connection or on a request it cannot parse.
async fn read_request<S: AsyncRead + Unpin>(sock: &mut S, buf: &mut Vec<u8>) -> Option<Request> {
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let mut chunk = [0u8; 4096];
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let (method, path) = (first.next()?.to_string(), first.next()?.to_string());
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let start = head_end + 4;
    while buf.len() < start + len {
        let mut chunk = [0u8; 4096];
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf[start..start + len].to_vec();
    buf.drain(..start + len);
    Some(Request {
        method,
        path,
        headers,
        body,
        at: Instant::now(),
        behavior: Behavior::Normal,
        answer: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One request on a new connection: the status, or `None` when the server dropped it.
    async fn post(t: &HttpTarget, key: &str, event_id: &str) -> Option<u16> {
        let mut sock = tokio::net::TcpStream::connect(t.addr).await.unwrap();
        let req = format!(
            "POST /h HTTP/1.1\r\nHost: t\r\nIdempotency-Key: {key}\r\nOutbox-Id: {event_id}\r\nContent-Length: 2\r\n\r\n{{}}"
        );
        sock.write_all(req.as_bytes()).await.unwrap();
        let mut buf = Vec::new();
        read_request_like_head(&mut sock, &mut buf).await
    }

    /// Reads an answer's status line (enough for these tests).
    async fn read_request_like_head(
        sock: &mut tokio::net::TcpStream,
        buf: &mut Vec<u8>,
    ) -> Option<u16> {
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            let mut chunk = [0u8; 1024];
            let n = sock.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        String::from_utf8_lossy(buf).split(' ').nth(1)?.parse().ok()
    }

    async fn target(dedupe: bool) -> HttpTarget {
        HttpTarget::start(TargetSettings {
            dedupe,
            ..TargetSettings::default()
        })
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn a_key_sent_again_after_a_clear_answer_is_a_second_application_the_key_store_hid() {
        let t = target(true).await;
        assert_eq!(post(&t, "k1", "e1").await, Some(201));
        assert_eq!(post(&t, "k1", "e1").await, Some(200));
        // What the tests counted before: once, so "exactly once" held.
        assert_eq!(t.applied("k1"), 1);
        let problems = t.at_most_once_problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("event e1 sent again"), "{problems:?}");
    }

    #[tokio::test]
    async fn without_a_key_store_a_repeat_is_applied_and_counted_by_event() {
        let t = target(false).await;
        assert_eq!(post(&t, "k1", "e1").await, Some(201));
        assert_eq!(post(&t, "k1", "e1").await, Some(201));
        assert_eq!(t.applications().len(), 2);
        let problems = t.at_most_once_problems();
        assert!(
            problems
                .iter()
                .any(|p| p.contains("event e1 applied 2 times")),
            "{problems:?}"
        );
    }

    #[tokio::test]
    async fn one_event_under_two_keys_is_two_applications() {
        let t = target(true).await;
        assert_eq!(post(&t, "k1", "e1").await, Some(201));
        assert_eq!(post(&t, "k2", "e1").await, Some(201));
        // Each key applied once: a count by key saw nothing wrong.
        assert_eq!((t.applied("k1"), t.applied("k2")), (1, 1));
        let problems = t.at_most_once_problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("event e1 applied 2 times"),
            "{problems:?}"
        );
    }

    #[tokio::test]
    async fn a_retry_after_an_ambiguous_answer_is_not_a_second_application() {
        let t = target(true).await;
        t.then(Behavior::Drop { applied: true });
        t.then(Behavior::Status {
            status: 503,
            retry_after: None,
        });
        assert_eq!(post(&t, "k1", "e1").await, None);
        assert_eq!(post(&t, "k1", "e1").await, Some(503));
        assert_eq!(post(&t, "k1", "e1").await, Some(200));
        t.assert_at_most_once();
        t.assert_applied_within(["e1"]);
    }

    #[tokio::test]
    async fn a_restarted_client_may_send_again_what_its_predecessor_was_answered() {
        let t = target(true).await;
        assert_eq!(post(&t, "k1", "e1").await, Some(201));
        t.client_restarted();
        assert_eq!(post(&t, "k1", "e1").await, Some(200));
        t.assert_at_most_once();
        assert_eq!(post(&t, "k1", "e1").await, Some(200));
        assert_eq!(
            t.at_most_once_problems().len(),
            1,
            "the same run sent it twice"
        );
    }

    #[tokio::test]
    #[should_panic(expected = "the endpoint applied 1 event(s) no committed event has")]
    async fn an_application_of_no_committed_event_fails() {
        let t = target(true).await;
        post(&t, "k1", "e1").await;
        post(&t, "k9", "e9").await;
        t.assert_applied_within(["e1"]);
    }

    #[tokio::test]
    async fn the_body_digest_is_checked_against_the_answered_body() {
        let t = target(true).await;
        post(&t, "k1", "e1").await;
        let body = "{\"id\":\"r1\"}";
        t.assert_body_digest("k1", &hex::encode(Sha256::digest(body)));
        let wrong = hex::encode(Sha256::digest("{\"id\":\"r2\"}"));
        let r = std::panic::catch_unwind(|| t.assert_body_digest("k1", &wrong));
        assert!(
            r.is_err(),
            "a digest of another body (64 hex digits too) passed"
        );
    }
}
