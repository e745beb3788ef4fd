//! The console's front door: what a client may make the relay hold before it has logged in.
//!
//! `pgwire`'s codec (0.30) buffers a message of whatever length it declares: a startup packet
//! declaring 0x7fffffff bytes, on two connections, took the relay from 26 MB to 641 MB RSS
//! without authenticating (issue 33, finding 3). `pgwire::tokio::process_socket` takes only a
//! `TcpStream`, and neither it nor its codec has a size limit or a way to wrap the stream.
//!
//! # Design: a framing-aware proxy in front of pgwire
//! Each accepted connection gets a loopback TCP pair (a listener on `127.0.0.1:0`, bound for
//! this one connection, connected to and accepted at once; the accepted peer must be our own
//! connecting socket, anything else that raced us there is dropped, then the listener is
//! closed). pgwire serves one end, unchanged; a proxy task copies between the client and the
//! other end, and reads the client's bytes as PostgreSQL frames them ([`Framing`]) *before*
//! forwarding them:
//!
//! * the startup packet, and the `SSLRequest`/`GSSENCRequest`/`CancelRequest` that share its
//!   format (length + code), at most [`MAX_STARTUP_PACKET`] bytes (PostgreSQL's own limit,
//!   `MAX_STARTUP_PACKET_LENGTH`); every later message at most [`MAX_MESSAGE`] bytes (console
//!   commands are one short line). A declared length over the limit closes the connection
//!   before its body is read, so nothing larger than one read buffer (8 KiB) is held for it;
//! * at most `max_connections` connections at once; one more is answered with PostgreSQL's
//!   `53300 too many connections` and closed, and a log line says so;
//! * a login timeout (authentication not finished in time: the connection is closed, as by
//!   PostgreSQL's `authentication_timeout`) and an idle timeout (no byte from the client).
//!
//! Why a proxy and not our own message loop over pgwire's public codec: the loop in
//! `process_socket` (SSL negotiation, startup, error recovery, extended-query sync) stays
//! pgwire's, so the console speaks exactly the protocol it did, and the guard is a small
//! byte-level state machine that is tested on its own. Memory per connection is bounded by the
//! limits above: the proxy holds one 8 KiB buffer per direction, pgwire at most one message.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

/// PostgreSQL's `MAX_STARTUP_PACKET_LENGTH`: the startup packet (and the requests in its
/// format) may not be longer.
pub const MAX_STARTUP_PACKET: u32 = 10_000;
/// Any message after the startup packet (a password, a query): console commands are tiny.
pub const MAX_MESSAGE: u32 = 64 * 1024;

/// `SSLRequest`, `GSSENCRequest`: another startup-format packet follows.
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

/// The limits of the console's connections (`[admin]` settings).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub login_timeout: Duration,
    pub idle_timeout: Duration,
}

/// Reads a client's byte stream as PostgreSQL frames it, and refuses a frame over its limit
/// as soon as its length is known.
#[derive(Debug, Default)]
pub struct Framing {
    /// Past the startup packet: messages are `type byte + int32 length`.
    typed: bool,
    /// The header read so far (8 bytes for startup format, 5 for a typed message).
    header: [u8; 8],
    header_len: usize,
    /// Body bytes of the current frame still to come.
    body_left: u64,
}

impl Framing {
    /// Feeds bytes read from the client, in order. `Err` says which frame broke which limit;
    /// the connection must then be closed without forwarding these bytes.
    pub fn feed(&mut self, mut buf: &[u8]) -> Result<(), String> {
        while !buf.is_empty() {
            if self.body_left > 0 {
                let n = (self.body_left).min(buf.len() as u64) as usize;
                self.body_left -= n as u64;
                buf = &buf[n..];
                continue;
            }
            let want = if self.typed { 5 } else { 8 };
            let n = (want - self.header_len).min(buf.len());
            self.header[self.header_len..self.header_len + n].copy_from_slice(&buf[..n]);
            self.header_len += n;
            buf = &buf[n..];
            if self.header_len < want {
                break;
            }
            self.header_len = 0;
            let h = self.header;
            if self.typed {
                let len = u32::from_be_bytes([h[1], h[2], h[3], h[4]]);
                if !(4..=MAX_MESSAGE).contains(&len) {
                    return Err(format!(
                        "a message (type {:?}) declaring {len} bytes (the limit is {MAX_MESSAGE})",
                        h[0] as char
                    ));
                }
                self.body_left = u64::from(len - 4);
            } else {
                let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
                if !(8..=MAX_STARTUP_PACKET).contains(&len) {
                    return Err(format!(
                        "a startup packet declaring {len} bytes (the limit is {MAX_STARTUP_PACKET}, as PostgreSQL's)"
                    ));
                }
                let code = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
                self.body_left = u64::from(len - 8);
                // After SSLRequest/GSSENCRequest (refused by the console) the client sends a
                // startup packet; after the startup packet, typed messages.
                self.typed = code != SSL_REQUEST && code != GSSENC_REQUEST;
            }
        }
        Ok(())
    }
}

/// The connection slots and the rate-limited log line for refusals.
pub struct Gate {
    limits: Limits,
    slots: Arc<Semaphore>,
    refused: AtomicU64,
    last_refusal_log: std::sync::Mutex<Option<Instant>>,
}

impl Gate {
    pub fn new(limits: Limits) -> Gate {
        Gate {
            limits,
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            refused: AtomicU64::new(0),
            last_refusal_log: std::sync::Mutex::new(None),
        }
    }

    /// A slot for a new connection, or `None` (the connection has been answered
    /// `too many connections` and must be dropped).
    pub fn admit(&self, sock: &TcpStream, peer: SocketAddr) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = self.slots.clone().try_acquire_owned() {
            return Some(p);
        }
        // Best effort and never waiting: the kernel's send buffer takes this at once.
        let _ = sock.try_write(&fatal(
            "53300",
            "sorry, too many clients already (the console's connection limit, admin.console_max_connections)",
        ));
        let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let mut last = self
            .last_refusal_log
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if last.map_or(true, |t| t.elapsed() >= Duration::from_secs(10)) {
            *last = Some(Instant::now());
            tracing::warn!(%peer, max_connections = self.limits.max_connections,
                refused_since_start = refused,
                "admin console: connection refused, all connection slots are taken (raise admin.console_max_connections if operators need more)");
        }
        None
    }

    /// Serves one admitted connection: builds the loopback pair, hands one end to `serve`
    /// (pgwire), and proxies the client through [`Framing`] until either side ends, a limit is
    /// broken, or a timeout passes. `logged_in` fires when authentication has finished.
    pub async fn run<F, Fut>(
        &self,
        client: TcpStream,
        peer: SocketAddr,
        logged_in: oneshot::Receiver<()>,
        serve: F,
    ) where
        F: FnOnce(TcpStream) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let (ours, theirs) = match loopback_pair().await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "admin console: cannot set up the connection's loopback pair; connection closed");
                return;
            }
        };
        let server = tokio::spawn(serve(theirs));
        let limits = self.limits;
        let outcome = tokio::select! {
            r = proxy(client, ours, limits.idle_timeout) => r,
            r = login_deadline(logged_in, limits.login_timeout) => r,
        };
        server.abort();
        match outcome {
            Ok(()) => tracing::debug!(%peer, "admin console connection ended"),
            Err(why) => tracing::warn!(%peer, "admin console: connection closed: {why}"),
        }
    }
}

/// Ends (with the reason) when the login has not finished within `timeout`; never ends after
/// it has, nor when the connection ended first (the proxy ends then).
async fn login_deadline(logged_in: oneshot::Receiver<()>, timeout: Duration) -> Result<(), String> {
    match tokio::time::timeout(timeout, logged_in).await {
        Ok(_) => std::future::pending().await,
        Err(_) => Err(format!(
            "not authenticated within {} ms (admin.console_login_timeout_ms)",
            timeout.as_millis()
        )),
    }
}

async fn proxy(client: TcpStream, server: TcpStream, idle: Duration) -> Result<(), String> {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let upstream = async move {
        let mut framing = Framing::default();
        let mut buf = vec![0u8; 8192];
        loop {
            let n = match tokio::time::timeout(idle, cr.read(&mut buf)).await {
                Err(_) => {
                    return Err(format!(
                        "idle for {} s (admin.console_idle_timeout_ms)",
                        idle.as_secs()
                    ))
                }
                Ok(Err(e)) => return Err(format!("reading from the client: {e}")),
                Ok(Ok(0)) => return Ok(()),
                Ok(Ok(n)) => n,
            };
            framing.feed(&buf[..n])?;
            // pgwire stops reading while the client does not read its answers: that is idle
            // too (the connection would otherwise keep its slot for ever).
            match tokio::time::timeout(idle, sw.write_all(&buf[..n])).await {
                Err(_) => {
                    return Err(format!(
                    "not reading the console's answers for {} s (admin.console_idle_timeout_ms)",
                    idle.as_secs()
                ))
                }
                Ok(Err(_)) => return Ok(()), // pgwire ended the connection
                Ok(Ok(())) => {}
            }
        }
    };
    let downstream = async move {
        let _ = tokio::io::copy(&mut sr, &mut cw).await;
        let _ = cw.shutdown().await;
        Ok(())
    };
    tokio::select! {
        r = upstream => r,
        r = downstream => r,
    }
}

/// A connected loopback TCP pair whose accepted end is certainly our own connecting socket.
async fn loopback_pair() -> std::io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let ours = TcpStream::connect(listener.local_addr()?).await?;
    let me = ours.local_addr()?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (theirs, from) = tokio::time::timeout_at(deadline, listener.accept())
            .await
            .map_err(|_| {
                std::io::Error::other("the loopback connection was not accepted within 5 s")
            })??;
        if from == me {
            return Ok((ours, theirs));
        }
        tracing::warn!(peer = %from, "admin console: a stranger connected to a connection's private loopback port; dropped");
    }
}

/// A PostgreSQL `ErrorResponse` with severity FATAL.
fn fatal(code: &str, message: &str) -> Vec<u8> {
    let mut body = Vec::new();
    for (k, v) in [
        (b'S', "FATAL"),
        (b'V', "FATAL"),
        (b'C', code),
        (b'M', message),
    ] {
        body.push(k);
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    body.push(0);
    let mut out = vec![b'E'];
    out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn startup(len: u32, code: u32) -> Vec<u8> {
        let mut v = len.to_be_bytes().to_vec();
        v.extend_from_slice(&code.to_be_bytes());
        v.resize(len.max(8) as usize, 0);
        v
    }

    fn typed(t: u8, len: u32) -> Vec<u8> {
        let mut v = vec![t];
        v.extend_from_slice(&len.to_be_bytes());
        v.resize(len as usize + 1, b'x');
        v
    }

    #[test]
    fn a_startup_packet_over_postgres_limit_is_refused_from_its_header() {
        let mut f = Framing::default();
        let e = f.feed(&0x7fff_ffffu32.to_be_bytes()).map(|_| ());
        assert_eq!(e, Ok(()), "four bytes are not a header yet");
        let e = f.feed(&196_608u32.to_be_bytes()).unwrap_err();
        assert!(e.contains("2147483647") && e.contains("10000"), "{e}");
        // Exactly the limit passes; one more does not; shorter than a header does not.
        assert!(Framing::default().feed(&startup(10_000, 196_608)).is_ok());
        assert!(Framing::default().feed(&startup(10_001, 196_608)).is_err());
        assert!(Framing::default().feed(&startup(7, 196_608)).is_err());
    }

    #[test]
    fn messages_after_startup_are_capped_even_fed_byte_by_byte() {
        let mut stream = Vec::new();
        stream.extend(startup(8, SSL_REQUEST)); // psql's SSLRequest, then the startup packet
        stream.extend(startup(40, 196_608));
        stream.extend(typed(b'p', 40)); // md5 password
        stream.extend(typed(b'Q', MAX_MESSAGE)); // a query at the limit
        stream.extend(typed(b'X', 4)); // Terminate
        let mut f = Framing::default();
        for b in &stream {
            f.feed(std::slice::from_ref(b)).unwrap();
        }
        let mut big = typed(b'Q', MAX_MESSAGE + 1);
        big.truncate(5);
        let e = f.feed(&big).unwrap_err();
        assert!(e.contains("65537") && e.contains("'Q'"), "{e}");
        // A declared length below the header's own size is refused too (negative as i32).
        let mut f = Framing::default();
        f.feed(&startup(8, 196_608)).unwrap();
        assert!(f.feed(&[b'Q', 0xff, 0xff, 0xff, 0xff]).is_err());
    }

    #[tokio::test]
    async fn the_loopback_pair_is_connected_end_to_end() {
        let (mut a, mut b) = loopback_pair().await.unwrap();
        a.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        assert_eq!(a.local_addr().unwrap(), b.peer_addr().unwrap());
    }

    #[test]
    fn the_refusal_is_a_well_formed_fatal_error() {
        let m = fatal("53300", "too many");
        assert_eq!(m[0], b'E');
        assert_eq!(
            u32::from_be_bytes([m[1], m[2], m[3], m[4]]) as usize,
            m.len() - 1
        );
        assert!(m.windows(6).any(|w| w == b"C53300"));
    }
}
