//! The read-only admin console: a PostgreSQL wire-protocol server (the `pgwire` crate) that
//! answers a handful of `SHOW` commands from the ledger and the relay's metrics, so an
//! operator can ask with the psql already in their hands:
//!
//! ```text
//! psql -h 127.0.0.1 -p 6433 -U outboxd -c 'SHOW STATUS'
//! ```
//!
//! Commands: `SHOW STATUS`, `SHOW LAG`, `SHOW UNKNOWN`, `SHOW QUARANTINE`,
//! `SHOW RECEIPT '<event id>'`, `SHOW HELP`. Nothing else is accepted: the console cannot
//! change anything (releases and skips stay with `outboxd quarantine`, which records who).
//!
//! Authentication: `trust`, or md5 with the configured user and password (a fresh salt per
//! connection). The listener is on 127.0.0.1 unless configured otherwise, and a non-loopback
//! address is refused without a password (`AdminConfig::validate`). Without a password every
//! local user can read the console.
//!
//! Before pgwire sees a byte, [`super::guard`] caps the startup packet (10,000 bytes) and every
//! later message (64 KiB), the number of connections, the time to log in and idle time. URLs
//! in the output (an HTTP event's topic is its webhook URL) go through [`redact_url`].

use std::fmt::Debug;
use std::sync::Arc;

use async_trait::async_trait;
use futures::{stream, Sink, SinkExt};
use outbox_ledger::{holds, status};
use pgwire::api::auth::md5pass::hash_md5_password;
use pgwire::api::auth::{
    finish_authentication, save_startup_parameters_to_metadata, DefaultServerParameterProvider,
    LoginInfo, StartupHandler,
};
use pgwire::api::copy::NoopCopyHandler;
use pgwire::api::query::{PlaceholderExtendedQueryHandler, SimpleQueryHandler};
use pgwire::api::results::{DataRowEncoder, FieldFormat, FieldInfo, QueryResponse, Response};
use pgwire::api::{
    ClientInfo, ClientPortalStore, NoopErrorHandler, PgWireConnectionState, PgWireServerHandlers,
    Type,
};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::startup::Authentication;
use pgwire::messages::{PgWireBackendMessage, PgWireFrontendMessage};
use tokio::net::TcpListener;
use tokio::sync::Mutex;
use tokio_postgres::Client;

use super::guard::{Gate, Limits};
use crate::config::{redact_url, AdminConfig, RelayConfig, Secret};
use crate::metrics;

/// What every console connection shares: the ledger connection and the relay's identity.
pub(super) struct Console {
    url: Secret,
    /// The database's `database` label (the first `[[databases]]` entry's, when several).
    database: String,
    slot: String,
    relay_id: String,
    user: String,
    password: Option<Secret>,
    /// One ledger connection for all console sessions (queries are rare and short);
    /// reconnected when it breaks.
    db: Mutex<Option<Client>>,
}

impl Console {
    pub fn new(admin: &AdminConfig, relay: &RelayConfig) -> Arc<Console> {
        Arc::new(Console {
            url: relay.database_url.clone(),
            database: relay.database.clone(),
            slot: relay.slot.clone(),
            relay_id: relay.relay_id.clone(),
            user: admin.console_user.clone(),
            password: admin.console_password.clone(),
            db: Mutex::new(None),
        })
    }
}

pub(super) async fn serve(listener: TcpListener, console: Arc<Console>, limits: Limits) {
    let gate = Arc::new(Gate::new(limits));
    loop {
        match listener.accept().await {
            Ok((sock, peer)) => {
                // Refused at once (and answered `too many connections`) when all slots are
                // taken; the slot is held until the connection's task ends.
                let Some(slot) = gate.admit(&sock, peer) else {
                    continue;
                };
                let (login_tx, login_rx) = tokio::sync::oneshot::channel();
                // A startup handler per connection: it holds that connection's md5 salt.
                let handlers = Handlers {
                    query: Arc::new(Queries(console.clone())),
                    startup: Arc::new(Startup {
                        console: console.clone(),
                        expected: std::sync::Mutex::new(None),
                        logged_in: std::sync::Mutex::new(Some(login_tx)),
                    }),
                };
                let gate = gate.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    gate.run(sock, peer, login_rx, |inner| async move {
                        if let Err(e) = pgwire::tokio::process_socket(inner, None, handlers).await {
                            tracing::debug!(error = %e, "admin console connection ended");
                        }
                    })
                    .await;
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "admin console accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

struct Handlers {
    query: Arc<Queries>,
    startup: Arc<Startup>,
}

impl PgWireServerHandlers for Handlers {
    type StartupHandler = Startup;
    type SimpleQueryHandler = Queries;
    type ExtendedQueryHandler = PlaceholderExtendedQueryHandler;
    type CopyHandler = NoopCopyHandler;
    type ErrorHandler = NoopErrorHandler;

    fn simple_query_handler(&self) -> Arc<Queries> {
        self.query.clone()
    }
    fn extended_query_handler(&self) -> Arc<PlaceholderExtendedQueryHandler> {
        Arc::new(PlaceholderExtendedQueryHandler)
    }
    fn startup_handler(&self) -> Arc<Startup> {
        self.startup.clone()
    }
    fn copy_handler(&self) -> Arc<NoopCopyHandler> {
        Arc::new(NoopCopyHandler)
    }
    fn error_handler(&self) -> Arc<NoopErrorHandler> {
        Arc::new(NoopErrorHandler)
    }
}

/// Trust, or md5 against the configured user and password.
struct Startup {
    console: Arc<Console>,
    /// The md5 answer this connection must send (depends on its salt).
    expected: std::sync::Mutex<Option<String>>,
    /// Told when authentication has finished (ends the guard's login timeout).
    logged_in: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl Startup {
    fn note_logged_in(&self) {
        if let Some(tx) = self.logged_in.lock().ok().and_then(|mut t| t.take()) {
            let _ = tx.send(());
        }
    }
}

#[async_trait]
impl StartupHandler for Startup {
    async fn on_startup<C>(
        &self,
        client: &mut C,
        message: PgWireFrontendMessage,
    ) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let params = DefaultServerParameterProvider::default();
        match message {
            PgWireFrontendMessage::Startup(ref startup) => {
                save_startup_parameters_to_metadata(client, startup);
                let Some(password) = &self.console.password else {
                    finish_authentication(client, &params).await?;
                    self.note_logged_in();
                    return Ok(());
                };
                client.set_state(PgWireConnectionState::AuthenticationInProgress);
                let salt: [u8; 4] = rand::random();
                let user = LoginInfo::from_client_info(client)
                    .user()
                    .unwrap_or_default()
                    .to_string();
                // A wrong user is refused after the password, like PostgreSQL does, so the
                // answer does not tell which of the two was wrong.
                let expected = (user == self.console.user)
                    .then(|| hash_md5_password(&user, password.expose(), &salt));
                if let Ok(mut e) = self.expected.lock() {
                    *e = expected;
                }
                client
                    .send(PgWireBackendMessage::Authentication(
                        Authentication::MD5Password(salt.to_vec()),
                    ))
                    .await?;
            }
            PgWireFrontendMessage::PasswordMessageFamily(pwd) => {
                let given = pwd.into_password()?.password;
                let ok = self
                    .expected
                    .lock()
                    .map(|e| e.as_deref() == Some(given.as_str()))
                    .unwrap_or(false);
                if !ok {
                    let user = LoginInfo::from_client_info(client)
                        .user()
                        .unwrap_or_default()
                        .to_string();
                    tracing::warn!(%user, "admin console: authentication failed");
                    return Err(PgWireError::InvalidPassword(user));
                }
                finish_authentication(client, &params).await?;
                self.note_logged_in();
            }
            _ => {}
        }
        Ok(())
    }
}

struct Queries(Arc<Console>);

#[async_trait]
impl SimpleQueryHandler for Queries {
    async fn do_query<'a, C>(&self, _client: &mut C, query: &str) -> PgWireResult<Vec<Response<'a>>>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let command = Command::parse(query).map_err(|m| user_error("42601", m))?;
        let table = self
            .0
            .answer(&command)
            .await
            .map_err(|e| user_error("58000", shown(crate::one_line(&e))))?;
        Ok(vec![table.into_response()])
    }
}

fn user_error(code: &str, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "ERROR".into(),
        code.into(),
        message,
    )))
}

/// A parsed console command.
#[derive(Debug, PartialEq)]
pub(super) enum Command {
    Status,
    Lag,
    Unknown,
    Quarantine,
    Receipt(uuid::Uuid),
    Help,
}

const USAGE: &str = "the admin console is read-only and answers: SHOW STATUS | SHOW LAG | SHOW UNKNOWN | SHOW QUARANTINE | SHOW RECEIPT '<event id>' | SHOW HELP";

impl Command {
    /// Case-insensitive, whitespace-tolerant, an optional trailing `;`.
    pub fn parse(query: &str) -> Result<Command, String> {
        let q = query.trim().trim_end_matches(';').trim();
        let words: Vec<&str> = q.split_whitespace().collect();
        let upper: Vec<String> = words.iter().map(|w| w.to_ascii_uppercase()).collect();
        let u: Vec<&str> = upper.iter().map(String::as_str).collect();
        match u.as_slice() {
            ["SHOW", "STATUS"] => Ok(Command::Status),
            ["SHOW", "LAG"] => Ok(Command::Lag),
            ["SHOW", "UNKNOWN"] => Ok(Command::Unknown),
            ["SHOW", "QUARANTINE"] => Ok(Command::Quarantine),
            ["SHOW", "HELP"] | ["HELP"] => Ok(Command::Help),
            ["SHOW", "RECEIPT", arg] => {
                let raw = words[2].trim_matches('\'').trim_matches('"');
                uuid::Uuid::parse_str(raw)
                    .map(Command::Receipt)
                    .map_err(|_| {
                        format!("SHOW RECEIPT needs an event id (a UUID in quotes), got {arg}")
                    })
            }
            ["SHOW", "RECEIPT"] => {
                Err("SHOW RECEIPT needs an event id: SHOW RECEIPT '<event id>'".into())
            }
            _ => Err(format!("unsupported command {q:?}: {USAGE}")),
        }
    }
}

/// A result set: column names and rows of text (NULL as `None`).
pub(super) struct Table {
    columns: Vec<&'static str>,
    rows: Vec<Vec<Option<String>>>,
}

impl Table {
    fn new(columns: &[&'static str]) -> Table {
        Table {
            columns: columns.to_vec(),
            rows: Vec::new(),
        }
    }

    fn push(&mut self, row: Vec<Option<String>>) {
        debug_assert_eq!(row.len(), self.columns.len());
        self.rows.push(row);
    }

    fn kv(&mut self, name: &str, value: impl ToString) {
        self.push(vec![Some(name.to_string()), Some(value.to_string())]);
    }

    fn into_response<'a>(self) -> Response<'a> {
        let schema = Arc::new(
            self.columns
                .iter()
                .map(|c| FieldInfo::new((*c).into(), None, None, Type::TEXT, FieldFormat::Text))
                .collect::<Vec<_>>(),
        );
        let rows: Vec<PgWireResult<_>> = self
            .rows
            .into_iter()
            .map(|row| {
                let mut enc = DataRowEncoder::new(schema.clone());
                for v in &row {
                    enc.encode_field(v)?;
                }
                enc.finish()
            })
            .collect();
        Response::Query(QueryResponse::new(schema, stream::iter(rows)))
    }
}

fn s<T: ToString>(v: Option<T>) -> Option<String> {
    v.map(|v| v.to_string())
}

/// A destination or a message as the console shows it: every URL in it (a webhook's topic is
/// its URL, which may hold `user:password@` or a `token=` parameter; an error may quote one)
/// through [`redact_url`]. Text without `://` is shown as it is.
fn shown(text: String) -> String {
    if !text.contains("://") {
        return text;
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(i) = rest.find("://") {
        // The URL starts after the white space, quote or bracket before its scheme and runs to
        // the next white space or closing quote/bracket.
        let start = rest[..i]
            .rfind(|c: char| c.is_whitespace() || "\"'<([{=,;".contains(c))
            .map(|j| j + rest[j..].chars().next().map_or(1, char::len_utf8))
            .unwrap_or(0);
        let end = rest[i..]
            .find(|c: char| c.is_whitespace() || "\"'>)]},;".contains(c))
            .map(|j| i + j)
            .unwrap_or(rest.len());
        out.push_str(&rest[..start]);
        out.push_str(&redact_url(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

impl Console {
    async fn client(&self) -> anyhow::Result<tokio::sync::MutexGuard<'_, Option<Client>>> {
        let mut db = self.db.lock().await;
        if db.as_ref().map(|c| c.is_closed()).unwrap_or(true) {
            *db = Some(crate::connect(self.url.expose()).await?);
        }
        Ok(db)
    }

    async fn answer(&self, command: &Command) -> anyhow::Result<Table> {
        let guard = self.client().await?;
        let Some(c) = guard.as_ref() else {
            anyhow::bail!("no ledger connection");
        };
        let m = metrics::get();
        Ok(match command {
            Command::Help => {
                let mut t = Table::new(&["command", "answers"]);
                for (cmd, what) in [
                    ("SHOW STATUS", "this relay (streaming, broker, in flight, counters) and the ledger's counts"),
                    ("SHOW LAG", "every slot the ledger knows: checkpoint, confirmed LSN, lag and retained WAL"),
                    ("SHOW UNKNOWN", "send attempts whose outcome is DISPATCH_UNKNOWN, oldest first"),
                    ("SHOW QUARANTINE", "open quarantine records and held aggregates"),
                    ("SHOW RECEIPT '<event id>'", "the event's state, primary receipt and duplicate receipts"),
                ] {
                    t.kv(cmd, what);
                }
                t
            }
            Command::Status => {
                let st = status::read(c).await?;
                let sm = status::sample(c).await?;
                let mut t = Table::new(&["name", "value"]);
                t.kv("relay_id", &self.relay_id);
                t.kv("database", &self.database);
                t.kv("slot", &self.slot);
                t.kv(
                    "ready",
                    match m.readiness() {
                        Ok(()) => "yes".to_string(),
                        Err(why) => format!("no: {why}"),
                    },
                );
                let db = self.database.as_str();
                t.kv("streaming", m.total(&m.streaming, db) >= 1.0);
                t.kv("broker_reachable", m.broker_reachable.get() == 1);
                t.kv("in_flight", m.total(&m.in_flight, db));
                t.kv("accepted_since_start", m.total(&m.accepted, db));
                t.kv("duplicate_receipts_since_start", m.total(&m.duplicates, db));
                t.kv("reconnects_since_start", m.total(&m.reconnects, db));
                t.kv("events", st.events);
                t.kv("published", st.published);
                t.kv("pending", st.pending);
                t.push(vec![
                    Some("oldest_pending_age_seconds".into()),
                    st.oldest_pending_age_seconds.map(|a| format!("{a:.3}")),
                ]);
                t.kv("duplicate_receipts", st.duplicate_receipts);
                t.kv("quarantined", st.quarantined);
                t.kv("held_aggregates", sm.held_aggregates);
                t.kv("held_events", sm.held_events);
                t.kv("unknown_attempts", sm.unknown_attempts);
                t.push(vec![
                    Some("oldest_unknown_age_seconds".into()),
                    sm.oldest_unknown_age_seconds.map(|a| format!("{a:.3}")),
                ]);
                if let Some(sl) = st.slots.iter().find(|sl| sl.slot_name == self.slot) {
                    t.kv("checkpoint_lsn", &sl.checkpoint_lsn);
                    t.push(vec![
                        Some("slot_confirmed_lsn".into()),
                        sl.slot_confirmed_lsn.clone(),
                    ]);
                    t.push(vec![Some("wal_status".into()), sl.wal_status.clone()]);
                    t.push(vec![Some("lag_bytes".into()), s(sl.lag_bytes)]);
                    t.push(vec![
                        Some("retained_wal_bytes".into()),
                        s(sl.retained_wal_bytes),
                    ]);
                }
                t
            }
            Command::Lag => {
                let mut t = Table::new(&[
                    "slot",
                    "checkpoint_lsn",
                    "confirmed_flush_lsn",
                    "current_wal_lsn",
                    "lag_bytes",
                    "retained_wal_bytes",
                    "safe_wal_size_bytes",
                    "wal_status",
                    "active",
                ]);
                for l in status::lag(c).await? {
                    t.push(vec![
                        Some(l.slot_name),
                        Some(l.checkpoint_lsn),
                        Some(l.confirmed_flush_lsn.unwrap_or_else(|| "MISSING".into())),
                        Some(l.current_wal_lsn),
                        s(l.lag_bytes),
                        s(l.retained_wal_bytes),
                        s(l.safe_wal_size_bytes),
                        l.wal_status,
                        s(l.active),
                    ]);
                }
                t
            }
            Command::Unknown => {
                let mut t = Table::new(&[
                    "event_id",
                    "slot",
                    "relay_generation",
                    "attempt",
                    "topic",
                    "partition",
                    "sent_at",
                    "unknown_at",
                    "age_seconds",
                    "error",
                ]);
                for a in status::unknown_attempts(c).await? {
                    t.push(vec![
                        Some(a.event_id.to_string()),
                        Some(a.slot_name),
                        Some(a.relay_generation.to_string()),
                        Some(a.attempt_generation.to_string()),
                        Some(shown(a.topic)),
                        Some(a.partition.to_string()),
                        Some(a.sent_at),
                        Some(a.unknown_at),
                        Some(format!("{:.3}", a.age_seconds)),
                        Some(shown(a.error)),
                    ]);
                }
                t
            }
            Command::Quarantine => {
                let (q, h) = holds::list(c).await?;
                let mut t = Table::new(&[
                    "kind",
                    "event_id",
                    "aggregate",
                    "version",
                    "reason_code",
                    "reason",
                    "since",
                    "held_events",
                ]);
                for e in q {
                    t.push(vec![
                        Some("quarantined".into()),
                        Some(s(e.event_id).unwrap_or(e.quarantine_key)),
                        Some(format!(
                            "{}/{}",
                            e.aggregate_type.as_deref().unwrap_or("?"),
                            e.aggregate_id.as_deref().unwrap_or("?")
                        )),
                        s(e.aggregate_version),
                        Some(e.reason_code),
                        Some(shown(e.reason)),
                        Some(e.quarantined_at),
                        None,
                    ]);
                }
                for e in h {
                    t.push(vec![
                        Some(format!("held ({})", e.state)),
                        s(e.blocking_event_id),
                        Some(format!("{}/{}", e.aggregate_type, e.aggregate_id)),
                        s(e.blocking_version),
                        Some(e.reason_code),
                        Some(shown(e.reason)),
                        Some(e.held_at),
                        Some(e.held_events.to_string()),
                    ]);
                }
                t
            }
            Command::Receipt(id) => {
                let Some((state, receipts)) = status::receipts(c, *id).await? else {
                    anyhow::bail!("event {id} is not in the outbox (never committed, or purged)");
                };
                let mut t = Table::new(&[
                    "event_id",
                    "state",
                    "receipt",
                    "cluster",
                    "topic",
                    "partition",
                    "offset",
                    "attempt",
                    "relay_generation",
                    "commit_lsn",
                    "at",
                ]);
                if receipts.is_empty() {
                    let mut row = vec![
                        Some(id.to_string()),
                        Some(state.clone()),
                        Some("none".into()),
                    ];
                    row.resize(11, None);
                    t.push(row);
                }
                for r in receipts {
                    t.push(vec![
                        Some(id.to_string()),
                        Some(state.clone()),
                        Some(r.kind),
                        Some(r.broker_cluster),
                        Some(shown(r.topic)),
                        Some(r.partition.to_string()),
                        Some(r.offset.to_string()),
                        Some(r.attempt.to_string()),
                        Some(r.relay_generation.to_string()),
                        r.commit_lsn,
                        Some(r.at),
                    ]);
                }
                t
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_parse_and_everything_else_is_refused() {
        assert_eq!(Command::parse("show status;"), Ok(Command::Status));
        assert_eq!(Command::parse("  SHOW   LAG "), Ok(Command::Lag));
        let id = uuid::Uuid::now_v7();
        assert_eq!(
            Command::parse(&format!("SHOW RECEIPT '{id}'")),
            Ok(Command::Receipt(id))
        );
        assert!(Command::parse("SHOW RECEIPT 'x'").is_err());
        let e = Command::parse("DELETE FROM outbox.receipts").unwrap_err();
        assert!(e.contains("read-only"), "{e}");
    }

    #[test]
    fn urls_in_console_output_lose_their_credentials() {
        assert_eq!(
            shown("https://hook:Hunter2@hooks.internal/x?token=abc&v=1".into()),
            "https://hook@hooks.internal/x?v=1"
        );
        let e = shown("POST \"https://u:p4ss@h/x\": 500 (retry)".into());
        assert_eq!(e, "POST \"https://u@h/x\": 500 (retry)");
        let e = shown("a=https://u:p4ss@h/x, then nats://n:pw2@nats:4222".into());
        assert!(!e.contains("p4ss") && !e.contains("pw2"), "{e}");
        assert!(
            e.contains("https://u@h/x") && e.contains("nats://n@nats:4222"),
            "{e}"
        );
        // A Kafka topic or NATS subject is shown as it is.
        assert_eq!(shown("outbox.order".into()), "outbox.order");
        assert_eq!(shown(String::new()), "");
    }
}
