//! The socket layer: connect, startup + authentication, the simple query loop, and the
//! CopyBoth stream. Everything protocol-shaped is delegated to `frame` and `auth`.
//!
//! Invariants:
//! * Reads go through [`Conn::read_message`], which only awaits inside `read_buf` into the
//!   connection's own `BytesMut` and only removes whole frames from it; dropping the future
//!   at any await point therefore loses no bytes (cancel safety).
//! * Writes are encoded into the connection's write buffer and drained by
//!   [`Conn::flush_out`] with `write_buf`, so a cancelled write leaves the unsent tail in the
//!   buffer (sent before anything else next time) instead of a half-written frame.
//! * `in_flight` is set when a request is sent and cleared when its ReadyForQuery arrives.
//!   A request started while it is still set (the previous one was cancelled or failed in a
//!   way that desynchronised the stream) is refused rather than misreading stale replies.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::BytesMut;
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
#[cfg(unix)]
use tokio::net::UnixStream;
use tokio_postgres::config::{ChannelBinding, Host, SslMode};

use super::auth::{Authenticator, Step};
use super::frame::{self, BackendMessage};
use super::{
    format_lsn, parse_lsn, Config, CreatedSlot, ReplicationMessage, SimpleRow, SystemIdentity,
    TransportError,
};
use crate::tls::TlsSettings;

/// Sent as `application_name` when the config does not set one.
const DEFAULT_APPLICATION_NAME: &str = "outboxd";

/// Minimum free space in the read buffer before each read; larger reads mean fewer syscalls
/// while a busy stream is being drained.
const READ_CHUNK: usize = 64 * 1024;

/// A connected socket, TCP (plain or TLS) or Unix.
#[derive(Debug)]
enum Socket {
    Tcp(TcpStream),
    Tls(Box<tokio_openssl::SslStream<TcpStream>>),
    #[cfg(unix)]
    Unix(UnixStream),
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Socket::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Socket::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_flush(cx),
            Socket::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Socket::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Where to connect, resolved from the first host of the config.
#[derive(Debug, Clone)]
enum Target {
    /// A host name or address to resolve, plus port.
    Tcp { host: String, port: u16 },
    /// The socket file `<dir>/.s.PGSQL.<port>`.
    #[cfg(unix)]
    Unix { path: std::path::PathBuf },
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // Bracket IPv6 literals so the port stays readable.
            Target::Tcp { host, port } if host.contains(':') => write!(f, "[{host}]:{port}"),
            Target::Tcp { host, port } => write!(f, "{host}:{port}"),
            #[cfg(unix)]
            Target::Unix { path } => write!(f, "{}", path.display()),
        }
    }
}

impl Target {
    /// The first host of the config (hostaddr wins over host for TCP, as in libpq) and its
    /// port (the first port if only one is given for several hosts; 5432 by default).
    fn from_config(cfg: &Config) -> Result<Target, TransportError> {
        let port = cfg.get_ports().first().copied().unwrap_or(5432);
        if let Some(addr) = cfg.get_hostaddrs().first() {
            return Ok(Target::Tcp {
                host: addr.to_string(),
                port,
            });
        }
        match cfg.get_hosts().first() {
            Some(Host::Tcp(host)) => Ok(Target::Tcp {
                host: host.clone(),
                port,
            }),
            #[cfg(unix)]
            Some(Host::Unix(dir)) => Ok(Target::Unix {
                path: dir.join(format!(".s.PGSQL.{port}")),
            }),
            None => Err(TransportError::Protocol(
                "the connection config names no host (set host or hostaddr)".into(),
            )),
        }
    }
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> TransportError {
    let context = context.into();
    move |source| TransportError::Io { context, source }
}

async fn connect_socket(target: &Target, cfg: &Config) -> Result<Socket, TransportError> {
    let context = || format!("connecting to {target}");
    match target {
        Target::Tcp { host, port } => {
            let addrs: Vec<_> = tokio::net::lookup_host((host.as_str(), *port))
                .await
                .map_err(io_err(format!("resolving {host}")))?
                .collect();
            // Try every address the name resolves to (e.g. ::1 then 127.0.0.1 for
            // localhost); report the last failure.
            let mut last = io::Error::new(
                io::ErrorKind::NotFound,
                "the host name resolved to no address",
            );
            for addr in addrs {
                match TcpStream::connect(addr).await {
                    Ok(stream) => {
                        configure_tcp(&stream, cfg).map_err(io_err(context()))?;
                        tracing::debug!(%addr, "TCP connection established");
                        return Ok(Socket::Tcp(stream));
                    }
                    Err(e) => {
                        tracing::debug!(%addr, error = %e, "TCP connect failed");
                        last = e;
                    }
                }
            }
            Err(io_err(context())(last))
        }
        #[cfg(unix)]
        Target::Unix { path } => {
            let stream = UnixStream::connect(path).await.map_err(io_err(context()))?;
            Ok(Socket::Unix(stream))
        }
    }
}

/// The SSLRequest exchange and the TLS handshake (see
/// [`ReplicationConnection::connect_with_tls`]). The server's one-byte answer is read before
/// anything else is sent, so no plain-text byte can be mistaken for TLS or the reverse.
async fn negotiate_tls(
    socket: Socket,
    target: &Target,
    tls: &TlsSettings,
) -> Result<Socket, TransportError> {
    let Socket::Tcp(mut tcp) = socket else {
        return Ok(socket);
    };
    let Target::Tcp { host, .. } = target else {
        return Ok(Socket::Tcp(tcp));
    };
    if tls.mode == crate::tls::SslMode::Disable {
        return Ok(Socket::Tcp(tcp));
    }
    let tls_err = |what: String| TransportError::Tls(format!("{target}: {what}"));
    // Build the context first: a bad sslrootcert is a configuration error, whatever the server.
    let connector = tls.connector().map_err(|e| tls_err(e.to_string()))?;
    let mut req = BytesMut::new();
    frontend::ssl_request(&mut req);
    tcp.write_all(&req)
        .await
        .map_err(io_err(format!("writing to {target}")))?;
    let answer = tcp
        .read_u8()
        .await
        .map_err(io_err(format!("reading from {target}")))?;
    match answer {
        b'S' => {}
        b'N' if tls.mode.requires_tls() => {
            return Err(tls_err(format!(
                "the server does not accept TLS connections but sslmode={} requires TLS; \
                 enable ssl on the server or lower sslmode",
                tls.mode.as_str()
            )))
        }
        b'N' => return Ok(Socket::Tcp(tcp)),
        other => {
            return Err(TransportError::Protocol(format!(
                "unexpected answer {other:#04x} to SSLRequest from {target}"
            )))
        }
    }
    let ssl = connector
        .configure()
        .and_then(|mut c| {
            c.set_verify_hostname(tls.verify_hostname());
            c.into_ssl(host)
        })
        .map_err(|e| tls_err(format!("setting up TLS: {e}")))?;
    let mut stream = tokio_openssl::SslStream::new(ssl, tcp)
        .map_err(|e| tls_err(format!("setting up TLS: {e}")))?;
    Pin::new(&mut stream).connect().await.map_err(|e| {
        let verify = stream.ssl().verify_result();
        let why = if verify == openssl::x509::X509VerifyResult::OK {
            e.to_string()
        } else {
            format!("certificate verify failed: {}", verify.error_string())
        };
        tls_err(format!(
            "TLS handshake failed (sslmode={}): {why}; check sslrootcert and that the server's certificate names this host",
            tls.mode.as_str()
        ))
    })?;
    tracing::debug!(peer = %target, sslmode = tls.mode.as_str(), "TLS established");
    Ok(Socket::Tls(Box::new(stream)))
}

/// TCP_NODELAY (standby status updates are tiny and latency-sensitive) plus the keepalive
/// and user-timeout settings of the config, so a silently dead peer is eventually noticed
/// even while we only read.
fn configure_tcp(stream: &TcpStream, cfg: &Config) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let sock = socket2::SockRef::from(stream);
    if cfg.get_keepalives() {
        let mut ka = socket2::TcpKeepalive::new().with_time(cfg.get_keepalives_idle());
        if let Some(interval) = cfg.get_keepalives_interval() {
            ka = ka.with_interval(interval);
        }
        if let Some(retries) = cfg.get_keepalives_retries() {
            ka = ka.with_retries(retries);
        }
        sock.set_tcp_keepalive(&ka)?;
    }
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Some(timeout) = cfg.get_tcp_user_timeout() {
        sock.set_tcp_user_timeout(Some(*timeout))?;
    }
    Ok(())
}

/// A framed connection: socket + read buffer + write buffer.
struct Conn {
    socket: Socket,
    peer: String,
    rbuf: BytesMut,
    wbuf: BytesMut,
    /// ParameterStatus values reported by the server (server_version, ...).
    params: HashMap<String, String>,
    backend_pid: Option<i32>,
    in_flight: bool,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("peer", &self.peer)
            .field("backend_pid", &self.backend_pid)
            .field("buffered_in", &self.rbuf.len())
            .field("buffered_out", &self.wbuf.len())
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl Conn {
    fn new(socket: Socket, peer: String) -> Self {
        Conn {
            socket,
            peer,
            rbuf: BytesMut::with_capacity(READ_CHUNK),
            wbuf: BytesMut::new(),
            params: HashMap::new(),
            backend_pid: None,
            in_flight: false,
        }
    }

    /// Next complete frame. Cancel-safe: the only await is `read_buf` into `rbuf`.
    async fn read_frame(&mut self) -> Result<frame::Frame, TransportError> {
        loop {
            if let Some(f) = frame::parse_frame(&mut self.rbuf)? {
                return Ok(f);
            }
            if self.rbuf.capacity() - self.rbuf.len() < READ_CHUNK / 4 {
                self.rbuf.reserve(READ_CHUNK);
            }
            let n = self
                .socket
                .read_buf(&mut self.rbuf)
                .await
                .map_err(io_err(format!("reading from {}", self.peer)))?;
            if n == 0 {
                if !self.rbuf.is_empty() {
                    tracing::debug!(
                        peer = %self.peer,
                        bytes = self.rbuf.len(),
                        "connection closed in the middle of a message"
                    );
                }
                return Err(TransportError::Closed);
            }
        }
    }

    /// Next message that matters to the caller: NoticeResponse, ParameterStatus and
    /// NotificationResponse can arrive at any time and are consumed here. Cancel-safe (see
    /// `read_frame`; everything after it is synchronous).
    async fn read_message(&mut self) -> Result<BackendMessage, TransportError> {
        loop {
            let f = self.read_frame().await?;
            match frame::decode(f)? {
                BackendMessage::NoticeResponse(n) => {
                    tracing::debug!(
                        peer = %self.peer,
                        severity = %n.severity,
                        code = %n.code,
                        message = %n.message,
                        detail = n.detail.as_deref().unwrap_or(""),
                        "server notice"
                    );
                }
                BackendMessage::ParameterStatus { name, value } => {
                    tracing::debug!(peer = %self.peer, %name, %value, "server parameter");
                    self.params.insert(name, value);
                }
                BackendMessage::NotificationResponse => {}
                m => return Ok(m),
            }
        }
    }

    /// Writes out everything in `wbuf` and flushes the socket.
    async fn flush_out(&mut self) -> Result<(), TransportError> {
        while !self.wbuf.is_empty() {
            let n = self
                .socket
                .write_buf(&mut self.wbuf)
                .await
                .map_err(io_err(format!("writing to {}", self.peer)))?;
            if n == 0 {
                return Err(TransportError::Io {
                    context: format!("writing to {}", self.peer),
                    source: io::ErrorKind::WriteZero.into(),
                });
            }
        }
        self.socket
            .flush()
            .await
            .map_err(io_err(format!("writing to {}", self.peer)))
    }

    /// Queues a simple Query message and sends it.
    async fn send_query(&mut self, sql: &str) -> Result<(), TransportError> {
        if self.in_flight {
            return Err(TransportError::Protocol(
                "the connection is out of sync: an earlier request was cancelled or failed \
                 before the server finished answering it; reconnect"
                    .into(),
            ));
        }
        frontend::query(sql, &mut self.wbuf)
            .map_err(|e| TransportError::Protocol(format!("cannot send query: {e}")))?;
        self.in_flight = true;
        tracing::debug!(peer = %self.peer, sql, "simple query");
        self.flush_out().await
    }

    /// Best-effort Terminate; errors are irrelevant since we are leaving anyway.
    async fn terminate(mut self) {
        frontend::terminate(&mut self.wbuf);
        let _ = self.flush_out().await;
        let _ = self.socket.shutdown().await;
    }

    fn unexpected(&self, m: &BackendMessage, during: &str) -> TransportError {
        TransportError::Protocol(format!("unexpected {} {during}", m.name()))
    }
}

/// A walsender connection (`replication=database`) in its command phase.
#[derive(Debug)]
pub struct ReplicationConnection {
    conn: Conn,
}

impl ReplicationConnection {
    /// Connects with `replication=database` to the first host of `cfg` (TCP `host:port`,
    /// or a Unix socket directory -> `<dir>/.s.PGSQL.<port>`), authenticates (trust,
    /// cleartext password, md5, SCRAM-SHA-256 without channel binding) and waits for
    /// ReadyForQuery. `application_name` comes from `cfg`, else `"outboxd"`.
    /// `connect_timeout` from `cfg` bounds the whole attempt. TLS follows `cfg`'s
    /// `ssl_mode` without certificate checks (`prefer` tries TLS, `require` insists); use
    /// [`ReplicationConnection::connect_with_tls`] for `verify-ca` / `verify-full`.
    pub async fn connect(cfg: &Config) -> Result<Self, TransportError> {
        let tls = TlsSettings {
            mode: match cfg.get_ssl_mode() {
                SslMode::Disable => crate::tls::SslMode::Disable,
                SslMode::Require => crate::tls::SslMode::Require,
                _ => crate::tls::SslMode::Prefer,
            },
            root_cert: None,
        };
        Self::connect_with_tls(cfg, &tls).await
    }

    /// [`ReplicationConnection::connect`] with libpq's TLS modes (see [`crate::tls`]): over
    /// TCP, unless the mode is `disable`, the client sends SSLRequest first and upgrades the
    /// socket to TLS when the server answers `S`; a server that answers `N` is refused for
    /// `require` and stronger, used in plain text for `prefer`. Unix sockets never use TLS
    /// (as in libpq).
    pub async fn connect_with_tls(cfg: &Config, tls: &TlsSettings) -> Result<Self, TransportError> {
        let user = cfg
            .get_user()
            .ok_or_else(|| TransportError::Auth("the connection config names no user".into()))?;
        let target = Target::from_config(cfg)?;
        let attempt = async {
            let socket = connect_socket(&target, cfg).await?;
            let socket = negotiate_tls(socket, &target, tls).await?;
            let mut conn = Conn::new(socket, target.to_string());
            startup(&mut conn, cfg, user).await?;
            Ok::<_, TransportError>(conn)
        };
        let conn = match cfg.get_connect_timeout() {
            Some(timeout) => tokio::time::timeout(*timeout, attempt)
                .await
                .map_err(|_| TransportError::Io {
                    context: format!("connecting to {target}"),
                    source: io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no connection within {timeout:?}"),
                    ),
                })??,
            None => attempt.await?,
        };
        tracing::debug!(
            peer = %conn.peer,
            user,
            server_version = conn.params.get("server_version").map(String::as_str).unwrap_or("?"),
            backend_pid = conn.backend_pid,
            "replication connection established"
        );
        Ok(ReplicationConnection { conn })
    }

    /// A run-time parameter the server reported (ParameterStatus), e.g. `server_version`.
    pub fn parameter(&self, name: &str) -> Option<&str> {
        self.conn.params.get(name).map(String::as_str)
    }

    /// The walsender's process id (from BackendKeyData), e.g. to find it in
    /// `pg_stat_replication` or `pg_replication_slots.active_pid`.
    pub fn backend_pid(&self) -> Option<i32> {
        self.conn.backend_pid
    }

    /// Runs `sql` with the simple query protocol and returns the rows of the last result set
    /// (empty if no statement returned rows). A server error is returned as
    /// [`TransportError::Server`] after the reply has been read up to ReadyForQuery, so the
    /// connection stays usable. COPY is not supported here.
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<SimpleRow>, TransportError> {
        self.conn.send_query(sql).await?;
        let mut columns: Option<Arc<Vec<String>>> = None;
        let mut rows = Vec::new();
        let mut error: Option<TransportError> = None;
        loop {
            match self.conn.read_message().await? {
                BackendMessage::RowDescription { columns: c } => {
                    // A new result set replaces the previous one: we return the last.
                    columns = Some(Arc::new(c));
                    rows.clear();
                }
                BackendMessage::DataRow { values } => {
                    let Some(columns) = &columns else {
                        return Err(TransportError::Protocol(
                            "DataRow without RowDescription".into(),
                        ));
                    };
                    if values.len() != columns.len() {
                        return Err(TransportError::Protocol(format!(
                            "DataRow has {} values for {} columns",
                            values.len(),
                            columns.len()
                        )));
                    }
                    rows.push(SimpleRow {
                        columns: Arc::clone(columns),
                        values,
                    });
                }
                BackendMessage::CommandComplete { .. } | BackendMessage::EmptyQueryResponse => {}
                BackendMessage::ErrorResponse(e) => {
                    // Keep reading: ReadyForQuery follows and must be consumed.
                    error.get_or_insert(e.into());
                }
                BackendMessage::CopyInResponse => {
                    // Refuse; the server answers with an ErrorResponse + ReadyForQuery.
                    frontend::copy_fail(
                        "COPY FROM STDIN is not supported here",
                        &mut self.conn.wbuf,
                    )
                    .map_err(|e| TransportError::Protocol(e.to_string()))?;
                    self.conn.flush_out().await?;
                }
                BackendMessage::CopyOutResponse => {
                    error.get_or_insert(TransportError::Protocol(
                        "simple_query does not support COPY TO STDOUT".into(),
                    ));
                }
                // Only reachable after CopyOutResponse; discarded.
                BackendMessage::CopyData(_) | BackendMessage::CopyDone => {}
                BackendMessage::ReadyForQuery { .. } => {
                    self.conn.in_flight = false;
                    return match error {
                        Some(e) => Err(e),
                        None => Ok(rows),
                    };
                }
                // CopyBothResponse (someone ran START_REPLICATION here) and anything else
                // leave the connection in a state we cannot recover from; in_flight stays
                // set so further use fails loudly.
                m => return Err(self.conn.unexpected(&m, "in reply to a simple query")),
            }
        }
    }

    /// `IDENTIFY_SYSTEM`.
    pub async fn identify_system(&mut self) -> Result<SystemIdentity, TransportError> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let row = single_row(&rows, "IDENTIFY_SYSTEM")?;
        let timeline = required(row, "timeline", "IDENTIFY_SYSTEM")?;
        let xlogpos = required(row, "xlogpos", "IDENTIFY_SYSTEM")?;
        Ok(SystemIdentity {
            system_id: required(row, "systemid", "IDENTIFY_SYSTEM")?.to_owned(),
            timeline: timeline.parse().map_err(|_| {
                TransportError::Protocol(format!("IDENTIFY_SYSTEM: bad timeline {timeline:?}"))
            })?,
            xlogpos: parse_lsn(xlogpos).ok_or_else(|| {
                TransportError::Protocol(format!("IDENTIFY_SYSTEM: bad xlogpos {xlogpos:?}"))
            })?,
            dbname: row.get("dbname").map(str::to_owned),
        })
    }

    /// `CREATE_REPLICATION_SLOT "<slot>" LOGICAL pgoutput (SNAPSHOT 'export' | 'nothing')`
    /// (PostgreSQL 15 syntax). With `export_snapshot`, the returned snapshot stays valid
    /// until the next command on this connection.
    pub async fn create_logical_slot(
        &mut self,
        slot: &str,
        export_snapshot: bool,
    ) -> Result<CreatedSlot, TransportError> {
        let sql = format!(
            "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput (SNAPSHOT '{}')",
            frame::quote_ident(slot)?,
            if export_snapshot { "export" } else { "nothing" }
        );
        let rows = self.simple_query(&sql).await?;
        let what = "CREATE_REPLICATION_SLOT";
        let row = single_row(&rows, what)?;
        let point = required(row, "consistent_point", what)?;
        Ok(CreatedSlot {
            slot_name: required(row, "slot_name", what)?.to_owned(),
            consistent_point: parse_lsn(point).ok_or_else(|| {
                TransportError::Protocol(format!("{what}: bad consistent_point {point:?}"))
            })?,
            snapshot_name: row.get("snapshot_name").map(str::to_owned),
            output_plugin: row.get("output_plugin").map(str::to_owned),
        })
    }

    /// `START_REPLICATION SLOT "<slot>" LOGICAL X/Y ("opt" 'val', ...)`; waits for
    /// CopyBothResponse. `start_lsn` 0 means "from the slot's confirmed_flush_lsn".
    /// Option names are quoted identifiers (so case is kept: pass them lower-case, as output
    /// plugins expect), values string literals.
    pub async fn start_logical_replication(
        mut self,
        slot: &str,
        start_lsn: u64,
        options: &[(&str, &str)],
    ) -> Result<ReplicationStream, TransportError> {
        let mut sql = format!(
            "START_REPLICATION SLOT {} LOGICAL {}",
            frame::quote_ident(slot)?,
            format_lsn(start_lsn)
        );
        if !options.is_empty() {
            let opts = options
                .iter()
                .map(|(k, v)| {
                    Ok(format!(
                        "{} {}",
                        frame::quote_ident(k)?,
                        frame::quote_literal(v)?
                    ))
                })
                .collect::<Result<Vec<_>, TransportError>>()?;
            sql.push_str(" (");
            sql.push_str(&opts.join(", "));
            sql.push(')');
        }
        self.conn.send_query(&sql).await?;
        match self.conn.read_message().await? {
            BackendMessage::CopyBothResponse => {
                // From here on the request only ends with the copy; in_flight stays set
                // until ReplicationStream::finish has read ReadyForQuery.
                tracing::debug!(
                    peer = %self.conn.peer,
                    slot,
                    lsn = %format_lsn(start_lsn),
                    "replication started"
                );
                Ok(ReplicationStream {
                    conn: self.conn,
                    ended: false,
                })
            }
            BackendMessage::ErrorResponse(e) => {
                // ReadyForQuery follows; read it so we can say goodbye properly.
                let err = TransportError::from(e);
                loop {
                    match self.conn.read_message().await {
                        Ok(BackendMessage::ReadyForQuery { .. }) => break,
                        Ok(_) => {}
                        Err(_) => return Err(err),
                    }
                }
                self.conn.terminate().await;
                Err(err)
            }
            m => Err(self.conn.unexpected(&m, "in reply to START_REPLICATION")),
        }
    }

    /// Sends Terminate and closes the socket.
    pub async fn close(self) {
        self.conn.terminate().await;
    }
}

fn single_row<'r>(rows: &'r [SimpleRow], what: &str) -> Result<&'r SimpleRow, TransportError> {
    match rows {
        [row] => Ok(row),
        _ => Err(TransportError::Protocol(format!(
            "{what} returned {} rows, expected 1",
            rows.len()
        ))),
    }
}

fn required<'r>(row: &'r SimpleRow, col: &str, what: &str) -> Result<&'r str, TransportError> {
    row.get(col)
        .ok_or_else(|| TransportError::Protocol(format!("{what}: column {col} missing or NULL")))
}

/// Startup message, authentication, then everything up to the first ReadyForQuery.
async fn startup(conn: &mut Conn, cfg: &Config, user: &str) -> Result<(), TransportError> {
    let application_name = cfg
        .get_application_name()
        .unwrap_or(DEFAULT_APPLICATION_NAME);
    let mut params: Vec<(&str, &str)> = vec![
        ("user", user),
        ("replication", "database"),
        ("application_name", application_name),
        // Text results are returned as String; make the server send UTF-8.
        ("client_encoding", "UTF8"),
    ];
    if let Some(db) = cfg.get_dbname() {
        params.push(("database", db));
    }
    if let Some(options) = cfg.get_options() {
        params.push(("options", options));
    }
    frontend::startup_message(params, &mut conn.wbuf)
        .map_err(|e| TransportError::Protocol(format!("cannot encode startup message: {e}")))?;
    conn.flush_out().await?;

    let mut auth = Authenticator::new(
        user,
        cfg.get_password(),
        cfg.get_channel_binding() == ChannelBinding::Require,
    );
    let mut authenticated = false;
    loop {
        match conn.read_message().await? {
            BackendMessage::Authentication(req) if !authenticated => {
                if auth.handle(req, &mut conn.wbuf)? == Step::Done {
                    authenticated = true;
                } else {
                    conn.flush_out().await?;
                }
            }
            BackendMessage::BackendKeyData { process_id, .. } if authenticated => {
                conn.backend_pid = Some(process_id);
            }
            BackendMessage::ReadyForQuery { .. } if authenticated => return Ok(()),
            // During startup an error is final: the server closes the connection after it.
            BackendMessage::ErrorResponse(e) => return Err(e.into()),
            m => return Err(conn.unexpected(&m, "during connection startup")),
        }
    }
}

/// A connection in logical-replication CopyBoth mode.
#[derive(Debug)]
pub struct ReplicationStream {
    conn: Conn,
    /// The server ended the copy (CopyDone or CommandComplete seen).
    ended: bool,
}

impl ReplicationStream {
    /// The next CopyData payload, parsed. `Ok(None)` once the server has ended the copy
    /// (CopyDone / CommandComplete), and on every call after that. An ErrorResponse (slot
    /// dropped, walsender terminated, ...) is `Err(Server)`.
    ///
    /// Cancel-safe: bytes are read into the stream's own buffer and only whole frames are
    /// taken out of it, so dropping this future (e.g. when a `tokio::select!` timer branch
    /// wins) loses nothing.
    pub async fn next_message(&mut self) -> Result<Option<ReplicationMessage>, TransportError> {
        if self.ended {
            return Ok(None);
        }
        match self.conn.read_message().await? {
            BackendMessage::CopyData(payload) => {
                frame::parse_replication_message(payload).map(Some)
            }
            BackendMessage::CopyDone | BackendMessage::CommandComplete { .. } => {
                tracing::debug!(peer = %self.conn.peer, "server ended the replication stream");
                self.ended = true;
                Ok(None)
            }
            BackendMessage::ErrorResponse(e) => Err(e.into()),
            m => Err(self.conn.unexpected(&m, "during replication")),
        }
    }

    /// Sends a standby status update (`'r'`): the `write`, `flush` and `apply` LSNs (the
    /// slot's `confirmed_flush_lsn` follows `flush`), the client clock, and whether the
    /// server should reply immediately with a keepalive. Flushes the socket.
    ///
    /// If this future is cancelled mid-write, the unsent rest stays queued and goes out
    /// first on the next send, so the stream never carries a torn frame.
    pub async fn send_standby_status(
        &mut self,
        write: u64,
        flush: u64,
        apply: u64,
        reply_requested: bool,
    ) -> Result<(), TransportError> {
        let clock = frame::pg_timestamp(SystemTime::now());
        frame::encode_standby_status(
            &mut self.conn.wbuf,
            write,
            flush,
            apply,
            clock,
            reply_requested,
        );
        tracing::trace!(
            write = %format_lsn(write),
            flush = %format_lsn(flush),
            apply = %format_lsn(apply),
            reply_requested,
            "standby status update"
        );
        self.conn.flush_out().await
    }

    /// Ends the copy from our side (CopyDone), discards the messages still in flight, reads
    /// up to ReadyForQuery and returns the connection in command mode (e.g. to run
    /// `DROP_REPLICATION_SLOT`, or just to [`close`](ReplicationConnection::close) it).
    pub async fn finish(mut self) -> Result<ReplicationConnection, TransportError> {
        frontend::copy_done(&mut self.conn.wbuf);
        self.conn.flush_out().await?;
        let mut error = None;
        loop {
            match self.conn.read_message().await? {
                BackendMessage::CopyData(_)
                | BackendMessage::CopyDone
                | BackendMessage::CommandComplete { .. } => {}
                // The reply to a logical START_REPLICATION carries no result set, but skip
                // one rather than fail on it.
                BackendMessage::RowDescription { .. } | BackendMessage::DataRow { .. } => {}
                BackendMessage::ErrorResponse(e) => {
                    error.get_or_insert(TransportError::from(e));
                }
                BackendMessage::ReadyForQuery { .. } => {
                    self.conn.in_flight = false;
                    return match error {
                        Some(e) => Err(e),
                        None => Ok(ReplicationConnection { conn: self.conn }),
                    };
                }
                m => return Err(self.conn.unexpected(&m, "while ending replication")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Socket-level tests against an in-process mock server speaking just enough protocol.
    use super::*;
    use bytes::BufMut;
    use std::time::Duration;
    use tokio::net::TcpListener;

    /// How long tests wait for a mock server; generous for loaded CI machines.
    const TEST_TIMEOUT: Duration = Duration::from_secs(10);

    fn backend(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&((body.len() + 4) as i32).to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    fn auth_ok_and_ready() -> Vec<u8> {
        let mut v = backend(b'R', &0i32.to_be_bytes());
        v.extend(backend(b'S', b"server_version\x0015.0\0"));
        let mut k = 4242i32.to_be_bytes().to_vec();
        k.extend_from_slice(&7i32.to_be_bytes());
        v.extend(backend(b'K', &k));
        v.extend(backend(b'Z', b"I"));
        v
    }

    /// Reads the untagged startup message and returns its parameters.
    async fn read_startup(s: &mut TcpStream) -> HashMap<String, String> {
        let len = s.read_i32().await.unwrap() as usize;
        let mut body = vec![0; len - 4];
        s.read_exact(&mut body).await.unwrap();
        assert_eq!(&body[..4], &0x0003_0000i32.to_be_bytes());
        let parts: Vec<String> = body[4..]
            .split(|&b| b == 0)
            .map(|p| String::from_utf8(p.to_vec()).unwrap())
            .collect();
        parts
            .chunks(2)
            .filter(|c| c.len() == 2 && !c[0].is_empty())
            .map(|c| (c[0].clone(), c[1].clone()))
            .collect()
    }

    /// Reads one tagged frontend message.
    async fn read_frontend(s: &mut TcpStream) -> (u8, Vec<u8>) {
        let tag = s.read_u8().await.unwrap();
        let len = s.read_i32().await.unwrap() as usize;
        let mut body = vec![0; len - 4];
        s.read_exact(&mut body).await.unwrap();
        (tag, body)
    }

    async fn listener() -> (TcpListener, Config) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut cfg = Config::new();
        cfg.host("127.0.0.1")
            .port(l.local_addr().unwrap().port())
            .user("tester")
            .dbname("db")
            .ssl_mode(SslMode::Disable);
        (l, cfg)
    }

    /// A server without TLS answers SSLRequest with `N`: `require` refuses it with a message
    /// that says so, `prefer` carries on in plain text.
    #[tokio::test]
    async fn sslrequest_answered_no() {
        for (mode, ok) in [(SslMode::Require, false), (SslMode::Prefer, true)] {
            let (l, mut cfg) = listener().await;
            cfg.ssl_mode(mode);
            let server = tokio::spawn(async move {
                let (mut s, _) = l.accept().await.unwrap();
                assert_eq!(s.read_i32().await.unwrap(), 8);
                assert_eq!(s.read_i32().await.unwrap(), 80_877_103);
                s.write_all(b"N").await.unwrap();
                if ok {
                    read_startup(&mut s).await;
                    s.write_all(&auth_ok_and_ready()).await.unwrap();
                    let (tag, _) = read_frontend(&mut s).await;
                    assert_eq!(tag, b'X');
                }
            });
            let res = tokio::time::timeout(TEST_TIMEOUT, ReplicationConnection::connect(&cfg))
                .await
                .unwrap();
            match res {
                Ok(c) => {
                    assert!(ok);
                    c.close().await;
                }
                Err(err) => {
                    assert!(!ok, "{err}");
                    assert!(
                        matches!(&err, TransportError::Tls(m) if m.contains("does not accept TLS")),
                        "{err}"
                    );
                }
            }
            tokio::time::timeout(TEST_TIMEOUT, server)
                .await
                .unwrap()
                .unwrap();
        }
    }

    #[tokio::test]
    async fn refused_connection_names_address() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let mut cfg = Config::new();
        cfg.host("127.0.0.1").port(port).user("u");
        let err = ReplicationConnection::connect(&cfg).await.unwrap_err();
        assert!(matches!(err, TransportError::Io { .. }), "{err}");
        assert!(
            err.to_string()
                .starts_with(&format!("connecting to 127.0.0.1:{port}: ")),
            "{err}"
        );
    }

    #[tokio::test]
    async fn startup_md5_and_simple_query() {
        let (l, mut cfg) = listener().await;
        cfg.password("pw");
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let params = read_startup(&mut s).await;
            assert_eq!(params["replication"], "database");
            assert_eq!(params["application_name"], "outboxd");
            assert_eq!(params["user"], "tester");
            assert_eq!(params["database"], "db");
            let mut md5 = 5i32.to_be_bytes().to_vec();
            md5.extend_from_slice(&[9, 8, 7, 6]);
            s.write_all(&backend(b'R', &md5)).await.unwrap();
            let (tag, body) = read_frontend(&mut s).await;
            assert_eq!(tag, b'p');
            let expected =
                postgres_protocol::authentication::md5_hash(b"tester", b"pw", [9, 8, 7, 6]);
            assert_eq!(&body[..body.len() - 1], expected.as_bytes());
            s.write_all(&auth_ok_and_ready()).await.unwrap();

            // A query that fails: error, notice, then ReadyForQuery.
            let (tag, body) = read_frontend(&mut s).await;
            assert_eq!((tag, &body[..]), (b'Q', &b"SELECT bad\0"[..]));
            let mut reply = backend(b'E', b"SERROR\0C42703\0Mcolumn \"bad\" does not exist\0\0");
            reply.extend(backend(b'N', b"SNOTICE\0C00000\0Mhello\0\0"));
            reply.extend(backend(b'Z', b"I"));
            s.write_all(&reply).await.unwrap();

            // Two result sets; the client keeps the last.
            let (tag, _) = read_frontend(&mut s).await;
            assert_eq!(tag, b'Q');
            let rowdesc = |names: &[&str]| {
                let mut t = (names.len() as i16).to_be_bytes().to_vec();
                for n in names {
                    t.extend_from_slice(n.as_bytes());
                    t.push(0);
                    t.extend_from_slice(&[0; 18]);
                }
                backend(b'T', &t)
            };
            let datarow = |vals: &[Option<&str>]| {
                let mut d = (vals.len() as i16).to_be_bytes().to_vec();
                for v in vals {
                    match v {
                        Some(v) => {
                            d.extend_from_slice(&(v.len() as i32).to_be_bytes());
                            d.extend_from_slice(v.as_bytes());
                        }
                        None => d.extend_from_slice(&(-1i32).to_be_bytes()),
                    }
                }
                backend(b'D', &d)
            };
            let mut reply = rowdesc(&["x"]);
            reply.extend(datarow(&[Some("first")]));
            reply.extend(backend(b'C', b"SELECT 1\0"));
            reply.extend(rowdesc(&["a", "b"]));
            reply.extend(datarow(&[Some("1"), None]));
            reply.extend(datarow(&[Some("2"), Some("z")]));
            reply.extend(backend(b'C', b"SELECT 2\0"));
            reply.extend(backend(b'Z', b"I"));
            s.write_all(&reply).await.unwrap();
            let (tag, _) = read_frontend(&mut s).await;
            assert_eq!(tag, b'X');
        });

        let mut c = tokio::time::timeout(TEST_TIMEOUT, ReplicationConnection::connect(&cfg))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.parameter("server_version"), Some("15.0"));
        assert_eq!(c.backend_pid(), Some(4242));
        let err = c.simple_query("SELECT bad").await.unwrap_err();
        assert_eq!(err.sqlstate(), Some("42703"));
        let rows = c.simple_query("SELECT 'first'; SELECT ...").await.unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(*rows[0].columns, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(rows[0].get("a"), Some("1"));
        assert_eq!(rows[0].get("b"), None);
        assert_eq!(rows[1].get("b"), Some("z"));
        c.close().await;
        tokio::time::timeout(TEST_TIMEOUT, server)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn startup_error_is_server_error() {
        let (l, mut cfg) = listener().await;
        cfg.password("wrong");
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            read_startup(&mut s).await;
            s.write_all(&backend(b'R', &3i32.to_be_bytes()))
                .await
                .unwrap();
            let (tag, body) = read_frontend(&mut s).await;
            assert_eq!((tag, &body[..]), (b'p', &b"wrong\0"[..]));
            s.write_all(&backend(
                b'E',
                b"SFATAL\0VFATAL\0C28P01\0Mpassword authentication failed for user \"tester\"\0\0",
            ))
            .await
            .unwrap();
        });
        let err = ReplicationConnection::connect(&cfg).await.unwrap_err();
        assert_eq!(err.sqlstate(), Some("28P01"));
        assert!(err.to_string().contains("\"tester\""), "{err}");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn eof_during_startup_is_closed() {
        let (l, cfg) = listener().await;
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            read_startup(&mut s).await;
            // Half a message, then EOF.
            s.write_all(&[b'R', 0, 0]).await.unwrap();
        });
        let err = ReplicationConnection::connect(&cfg).await.unwrap_err();
        assert!(matches!(err, TransportError::Closed), "{err}");
        server.await.unwrap();
    }

    /// The server dribbles the replication stream out a few bytes at a time while the
    /// client polls `next_message` inside `select!` next to a fast timer, so the read future
    /// is dropped mid-frame over and over. Every message must still arrive intact and in
    /// order, and standby updates sent from the timer branch must arrive as whole frames.
    #[tokio::test]
    async fn next_message_is_cancel_safe() {
        const N: u64 = 40;
        let (l, cfg) = listener().await;
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            read_startup(&mut s).await;
            s.write_all(&auth_ok_and_ready()).await.unwrap();
            let (tag, body) = read_frontend(&mut s).await;
            assert_eq!(tag, b'Q');
            assert_eq!(
                std::str::from_utf8(&body).unwrap(),
                "START_REPLICATION SLOT \"s\" LOGICAL 1/A (\"proto_version\" '1', \"publication_names\" 'p''q')\0"
            );
            s.write_all(&backend(b'W', &[0, 0, 0])).await.unwrap();
            let mut wire = Vec::new();
            for i in 0..N {
                let mut p = BytesMut::new();
                if i % 5 == 4 {
                    p.put_u8(b'k');
                    p.put_u64(i);
                    p.put_i64(-(i as i64));
                    p.put_u8((i % 2) as u8);
                } else {
                    p.put_u8(b'w');
                    p.put_u64(i);
                    p.put_u64(i + 1);
                    p.put_i64(i as i64);
                    p.extend_from_slice(format!("payload-{i}").as_bytes());
                }
                wire.extend(backend(b'd', &p));
            }
            wire.extend(backend(b'c', b""));
            let (mut rd, mut wr) = s.into_split();
            let reader = tokio::spawn(async move {
                // Collect the client's standby status updates until it sends CopyDone.
                let mut updates = Vec::new();
                loop {
                    let tag = rd.read_u8().await.unwrap();
                    let len = rd.read_i32().await.unwrap() as usize;
                    let mut body = vec![0; len - 4];
                    rd.read_exact(&mut body).await.unwrap();
                    match tag {
                        b'd' => {
                            assert_eq!(body.len(), 34);
                            assert_eq!(body[0], b'r');
                            updates.push(u64::from_be_bytes(body[9..17].try_into().unwrap()));
                        }
                        b'c' => return (updates, rd),
                        other => panic!("unexpected frontend message {other}"),
                    }
                }
            });
            for piece in wire.chunks(3) {
                wr.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_micros(300)).await;
            }
            let (updates, _rd) = reader.await.unwrap();
            // Reply to the client's CopyDone.
            let mut end = backend(b'C', b"START_REPLICATION\0");
            end.extend(backend(b'Z', b"I"));
            wr.write_all(&end).await.unwrap();
            updates
        });

        let c = ReplicationConnection::connect(&cfg).await.unwrap();
        let mut stream = c
            .start_logical_replication(
                "s",
                0x1_0000_000A,
                &[("proto_version", "1"), ("publication_names", "p'q")],
            )
            .await
            .unwrap();
        let mut got = Vec::new();
        let mut ticks = 0u64;
        let mut tick = tokio::time::interval(Duration::from_micros(200));
        let deadline = tokio::time::Instant::now() + TEST_TIMEOUT;
        loop {
            assert!(tokio::time::Instant::now() < deadline, "timed out");
            tokio::select! {
                m = stream.next_message() => match m.unwrap() {
                    Some(m) => got.push(m),
                    None => break,
                },
                _ = tick.tick() => {
                    ticks += 1;
                    stream.send_standby_status(ticks, ticks, ticks, false).await.unwrap();
                }
            }
        }
        assert!(
            ticks > 5,
            "the timer should have interrupted reads (ticks={ticks})"
        );
        assert_eq!(got.len() as u64, N);
        for (i, m) in got.iter().enumerate() {
            let i = i as u64;
            match m {
                ReplicationMessage::XLogData {
                    wal_start,
                    wal_end,
                    server_time,
                    data,
                } => {
                    assert_ne!(i % 5, 4);
                    assert_eq!((*wal_start, *wal_end, *server_time), (i, i + 1, i as i64));
                    assert_eq!(&data[..], format!("payload-{i}").as_bytes());
                }
                ReplicationMessage::Keepalive {
                    wal_end,
                    server_time,
                    reply_requested,
                } => {
                    assert_eq!(i % 5, 4);
                    assert_eq!((*wal_end, *server_time), (i, -(i as i64)));
                    assert_eq!(*reply_requested, i % 2 == 1);
                }
            }
        }
        // Ended streams keep saying so.
        assert_eq!(stream.next_message().await.unwrap(), None);
        let c = stream.finish().await.unwrap();
        drop(c);
        let updates = tokio::time::timeout(TEST_TIMEOUT, server)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(updates, (1..=ticks).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn out_of_sync_connection_is_refused() {
        let (l, cfg) = listener().await;
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            read_startup(&mut s).await;
            s.write_all(&auth_ok_and_ready()).await.unwrap();
            let _ = read_frontend(&mut s).await;
            // Never answer; keep the socket open until the client goes away.
            let _ = s.read_u8().await;
        });
        let mut c = ReplicationConnection::connect(&cfg).await.unwrap();
        let r = tokio::time::timeout(Duration::from_millis(50), c.simple_query("SELECT 1")).await;
        assert!(r.is_err(), "the query should time out");
        let err = c.simple_query("SELECT 2").await.unwrap_err();
        assert!(
            matches!(&err, TransportError::Protocol(m) if m.contains("out of sync")),
            "{err}"
        );
        drop(c);
        server.await.unwrap();
    }
}
