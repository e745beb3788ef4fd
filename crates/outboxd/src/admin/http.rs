//! A deliberately small HTTP/1.1 responder: three GET endpoints, one request per connection
//! (`Connection: close`), bounded request size and time. A full HTTP stack would cost more to
//! build than everything it would serve here.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::metrics;

/// Longest request head we read; anything larger is refused.
const MAX_HEAD: usize = 16 * 1024;
/// A connection that has not sent its request and read the answer by then is dropped.
const CONNECTION_DEADLINE: Duration = Duration::from_secs(10);

pub(super) async fn serve(listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((sock, _)) => {
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(CONNECTION_DEADLINE, handle(sock)).await;
                });
            }
            Err(e) => {
                // Out of file descriptors and the like: say so, and do not spin.
                tracing::warn!(error = %e, "admin HTTP accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn handle(mut sock: TcpStream) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&chunk[..n]);
        if head.len() > MAX_HEAD {
            break;
        }
    }
    let reply = if head.len() > MAX_HEAD {
        Reply::text(
            431,
            "Request Header Fields Too Large",
            "request head too large\n",
        )
    } else {
        let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
        let line = String::from_utf8_lossy(line);
        let mut parts = line.split_whitespace();
        route(parts.next().unwrap_or(""), parts.next().unwrap_or(""))
    };
    sock.write_all(&reply.encode()).await?;
    sock.shutdown().await
}

/// One response.
#[derive(Debug, PartialEq)]
pub(super) struct Reply {
    pub status: u16,
    pub reason: &'static str,
    pub content_type: &'static str,
    pub body: String,
    pub head_only: bool,
}

impl Reply {
    fn text(status: u16, reason: &'static str, body: impl Into<String>) -> Reply {
        Reply {
            status,
            reason,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
            head_only: false,
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
            self.status,
            self.reason,
            self.content_type,
            self.body.len()
        )
        .into_bytes();
        if !self.head_only {
            out.extend_from_slice(self.body.as_bytes());
        }
        out
    }
}

/// Maps a request line to its reply.
pub(super) fn route(method: &str, target: &str) -> Reply {
    let path = target.split('?').next().unwrap_or("");
    if method != "GET" && method != "HEAD" {
        return Reply::text(405, "Method Not Allowed", "only GET and HEAD\n");
    }
    let mut reply = match path {
        "/metrics" => Reply {
            content_type: "text/plain; version=0.0.4; charset=utf-8",
            ..Reply::text(200, "OK", metrics::get().render())
        },
        "/healthz" => Reply::text(200, "OK", "ok\n"),
        "/readyz" => match metrics::get().readiness() {
            Ok(()) => Reply::text(200, "OK", "ready\n"),
            Err(why) => Reply::text(503, "Service Unavailable", format!("not ready: {why}\n")),
        },
        _ => Reply::text(
            404,
            "Not Found",
            "not found; try /metrics, /healthz or /readyz\n",
        ),
    };
    reply.head_only = method == "HEAD";
    reply
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(route("GET", "/healthz").status, 200);
        assert_eq!(route("POST", "/healthz").status, 405);
        assert_eq!(route("GET", "/nope").status, 404);
        // A relay's series exist once it has its handle.
        let _relay = crate::metrics::get().relay("routes", "s");
        let m = route("GET", "/metrics?x=1");
        assert_eq!(m.status, 200);
        assert!(m.body.contains("outboxd_events_accepted_total"));
        let h = route("HEAD", "/metrics");
        assert!(!String::from_utf8(h.encode()).unwrap().contains("# TYPE"));
        // Nothing streams in a unit test: not ready, and the reason says why.
        let r = route("GET", "/readyz");
        assert_eq!(r.status, 503);
        assert!(r.body.contains("not streaming"), "{}", r.body);
    }
}
