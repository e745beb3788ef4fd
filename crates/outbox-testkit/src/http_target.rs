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
//! * serve HTTPS with a given certificate ([`TargetSettings::tls`]).
//!
//! With `dedupe` on (an endpoint that keeps idempotency keys), a request whose key was applied
//! before is answered 200 with the first answer's response id and is not applied again.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::path::PathBuf;
use std::pin::Pin;

use openssl::ssl::{SslAcceptor, SslFiletype, SslMethod};
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
}

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<Behavior>,
    requests: Vec<Request>,
    /// key → how many times it was applied, and the response id of its first application.
    applied: HashMap<String, (u32, String)>,
    /// Keys in the order they were first applied.
    order: Vec<String>,
    next_id: u64,
    misbehave: Option<Misbehave>,
    rng: u64,
}

/// The running server; dropping it stops it.
#[derive(Debug)]
pub struct HttpTarget {
    addr: std::net::SocketAddr,
    https: bool,
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

    /// Misbehaves at random from now on (`None`: behaves again).
    pub fn misbehave(&self, m: Option<Misbehave>) {
        let mut st = self.state.lock().unwrap();
        st.rng = m.map_or(1, |m| m.seed | 1);
        st.misbehave = m;
    }

    /// Every request read so far.
    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
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
        let (behavior, answer) = {
            let mut st = state.lock().unwrap();
            let behavior = if poison {
                Behavior::Status {
                    status: 400,
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
                        let e = st.applied.entry(key.clone()).or_insert((0, id));
                        e.0 += 1;
                        if e.0 == 1 {
                            st.order.push(key.clone());
                        }
                        answer = Some((201, e.1.clone()));
                    }
                }
            }
            st.requests.push(Request {
                behavior: behavior.clone(),
                ..req
            });
            (behavior, answer)
        };
        let reply = match (&behavior, answer) {
            (Behavior::Drop { .. }, _) => return,
            (Behavior::FailAfterApplying { status }, _) => {
                response(*status, "", &format!("{{\"status\":{status}}}"))
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
                response(*status, &extra, &format!("{{\"status\":{status}}}"))
            }
            (Behavior::Redirect { status, location }, _) => {
                response(*status, &format!("Location: {location}\r\n"), "{}")
            }
            (_, Some((status, id))) => response(
                status,
                &format!("X-Response-Id: {id}\r\n"),
                &format!("{{\"id\":\"{id}\"}}"),
            ),
            (_, None) => response(500, "", "{}"),
        };
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
    })
}
