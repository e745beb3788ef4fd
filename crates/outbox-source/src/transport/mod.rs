//! A small PostgreSQL logical-replication client.
//!
//! # Why this exists
//!
//! `tokio-postgres` cannot speak the streaming replication protocol (it has no
//! `replication=database` mode and no CopyBoth support), no maintained fork does, and the
//! young crates that do keep breaking their APIs. What the relay needs is small, so it is
//! written here by hand on top of `postgres-protocol` 0.6 (startup message, SCRAM, md5) and
//! tokio:
//!
//! * [`ReplicationConnection::connect`] opens a walsender connection (`replication=database`)
//!   over TCP or a Unix socket and authenticates (trust, cleartext, md5, SCRAM-SHA-256
//!   without channel binding), with TLS as libpq's `sslmode` says (see [`crate::tls`]).
//! * [`ReplicationConnection::simple_query`] runs SQL and replication commands with the
//!   simple query protocol; [`identify_system`](ReplicationConnection::identify_system) and
//!   [`create_logical_slot`](ReplicationConnection::create_logical_slot) are typed wrappers.
//! * [`ReplicationConnection::start_logical_replication`] switches the connection into
//!   CopyBoth mode and returns a [`ReplicationStream`] that yields XLogData / keepalive
//!   messages and sends standby status updates.
//!
//! # Layout
//!
//! * `frame` — pure functions over `bytes`: backend message framing and decoding
//!   (`Ok(None)` on incomplete input), CopyData payload parsing, frontend encoders that
//!   `postgres-protocol` lacks (standby status update).
//! * `auth` — the authentication exchange as a pure state machine (request in, response
//!   bytes out).
//! * `connection` — the thin socket layer: connect, startup, query loops, the stream.
//!
//! All backend messages are framed by our own parser (1-byte tag + big-endian i32 length),
//! because `postgres_protocol::message::backend::Message::parse` has no CopyBothResponse
//! (`'W'`) tag; one parser for everything keeps the buffer handling in one place.

mod auth;
mod connection;
mod frame;

use std::sync::Arc;

pub use connection::{ReplicationConnection, ReplicationStream};
pub use tokio_postgres::Config;

/// Everything that can go wrong on a replication connection.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A socket operation failed; `context` says which one and with whom
    /// (e.g. `connecting to 127.0.0.1:5432`).
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    /// The server sent an ErrorResponse.
    #[error("{}", display_server_error(message, code, detail.as_deref(), hint.as_deref()))]
    Server {
        /// SQLSTATE, e.g. `42704` for an unknown replication slot.
        code: String,
        message: String,
        detail: Option<String>,
        hint: Option<String>,
    },
    /// Authentication could not be carried out on our side: unsupported method, no
    /// password configured, SCRAM verification failure. (A wrong password is reported by the
    /// server, i.e. as [`TransportError::Server`] with SQLSTATE `28P01`.)
    #[error("authentication failed: {0}")]
    Auth(String),
    /// The server sent something we did not expect at this point, or a malformed message;
    /// also used for configurations this client cannot honour.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// TLS could not be negotiated or verified (server without TLS under `sslmode=require`,
    /// untrusted certificate, wrong host name, unreadable `sslrootcert`).
    #[error("TLS: {0}")]
    Tls(String),
    /// The server closed the connection (EOF on the socket).
    #[error("the server closed the connection")]
    Closed,
}

fn display_server_error(
    message: &str,
    code: &str,
    detail: Option<&str>,
    hint: Option<&str>,
) -> String {
    let mut s = format!("{message} (SQLSTATE {code})");
    if let Some(detail) = detail {
        s.push_str("; detail: ");
        s.push_str(detail);
    }
    if let Some(hint) = hint {
        s.push_str("; hint: ");
        s.push_str(hint);
    }
    s
}

impl TransportError {
    /// The SQLSTATE of a [`TransportError::Server`] error, `None` for every other kind.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            TransportError::Server { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// One row of a simple-query result; every value is in text format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimpleRow {
    /// Column names of the result set, shared by all rows of that set.
    pub columns: Arc<Vec<String>>,
    /// One entry per column; `None` is SQL NULL.
    pub values: Vec<Option<String>>,
}

impl SimpleRow {
    /// The value of the first column called `name`; `None` if there is no such column or
    /// the value is NULL.
    pub fn get(&self, name: &str) -> Option<&str> {
        let idx = self.columns.iter().position(|c| c == name)?;
        self.values.get(idx)?.as_deref()
    }
}

/// The answer to `IDENTIFY_SYSTEM`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemIdentity {
    /// The cluster's system identifier (a u64 printed in decimal).
    pub system_id: String,
    pub timeline: u32,
    /// Current WAL flush location.
    pub xlogpos: u64,
    /// The database connected to (`None` for physical replication connections).
    pub dbname: Option<String>,
}

/// The answer to `CREATE_REPLICATION_SLOT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreatedSlot {
    pub slot_name: String,
    /// The LSN at which the slot became consistent: streaming from the slot yields exactly the
    /// transactions that commit after this point, i.e. those not in the exported snapshot.
    pub consistent_point: u64,
    /// The exported snapshot (`SNAPSHOT 'export'`), usable with `SET TRANSACTION SNAPSHOT`
    /// until the next command is issued on the creating connection or it is closed.
    pub snapshot_name: Option<String>,
    pub output_plugin: Option<String>,
}

/// A parsed CopyData payload of a logical replication stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationMessage {
    /// `'w'`: one output-plugin message (for pgoutput: Begin, Relation, Insert, Commit, ...).
    ///
    /// `data` is a zero-copy slice of the connection's read buffer; holding on to it keeps
    /// that buffer chunk alive, so copy it if it is retained for long.
    XLogData {
        wal_start: u64,
        wal_end: u64,
        /// Server clock, microseconds since 2000-01-01 00:00 UTC.
        server_time: i64,
        data: bytes::Bytes,
    },
    /// `'k'`: primary keepalive. If `reply_requested`, answer soon with
    /// [`ReplicationStream::send_standby_status`] or the server may time the connection out.
    Keepalive {
        wal_end: u64,
        server_time: i64,
        reply_requested: bool,
    },
}

/// Formats an LSN the way PostgreSQL does: two upper-case hex halves, e.g. `16/B374D848`.
pub fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

/// Parses `X/Y` (each half 1-8 hex digits, either case), as `pg_lsn` input does.
/// Anything else — signs, whitespace, empty halves, overlong halves — is `None`.
pub fn parse_lsn(s: &str) -> Option<u64> {
    let (hi, lo) = s.split_once('/')?;
    fn half(h: &str) -> Option<u64> {
        // from_str_radix alone would accept a leading '+'.
        if h.is_empty() || h.len() > 8 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u32::from_str_radix(h, 16).ok().map(u64::from)
    }
    Some((half(hi)? << 32) | half(lo)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lsn_known_values() {
        assert_eq!(format_lsn(0x16_B374_D848), "16/B374D848");
        assert_eq!(format_lsn(0), "0/0");
        assert_eq!(format_lsn(u64::MAX), "FFFFFFFF/FFFFFFFF");
        assert_eq!(parse_lsn("16/B374D848"), Some(0x16_B374_D848));
        assert_eq!(parse_lsn("16/b374d848"), Some(0x16_B374_D848));
        assert_eq!(parse_lsn("0/0"), Some(0));
        assert_eq!(parse_lsn("00000001/00000002"), Some((1 << 32) | 2));
    }

    #[test]
    fn lsn_rejects_garbage() {
        for bad in [
            "",
            "/",
            "1/",
            "/1",
            "1",
            "+1/1",
            "1/+1",
            "-1/1",
            " 1/1",
            "1/1 ",
            "1/1/1",
            "123456789/0",
            "0/123456789",
            "g/0",
            "0x1/0",
        ] {
            assert_eq!(parse_lsn(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn server_error_display() {
        let e = TransportError::Server {
            code: "42704".into(),
            message: "replication slot \"x\" does not exist".into(),
            detail: Some("d".into()),
            hint: Some("h".into()),
        };
        assert_eq!(
            e.to_string(),
            "replication slot \"x\" does not exist (SQLSTATE 42704); detail: d; hint: h"
        );
        assert_eq!(e.sqlstate(), Some("42704"));
        assert_eq!(TransportError::Closed.sqlstate(), None);
        let io = TransportError::Io {
            context: "connecting to 127.0.0.1:5432".into(),
            source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        };
        assert!(io.to_string().starts_with("connecting to 127.0.0.1:5432: "));
    }

    #[test]
    fn simple_row_get() {
        let row = SimpleRow {
            columns: Arc::new(vec!["a".into(), "b".into()]),
            values: vec![Some("1".into()), None],
        };
        assert_eq!(row.get("a"), Some("1"));
        assert_eq!(row.get("b"), None);
        assert_eq!(row.get("c"), None);
    }

    proptest! {
        #[test]
        fn lsn_round_trip(lsn in any::<u64>()) {
            prop_assert_eq!(parse_lsn(&format_lsn(lsn)), Some(lsn));
            prop_assert_eq!(parse_lsn(&format_lsn(lsn).to_lowercase()), Some(lsn));
        }

        #[test]
        fn lsn_zero_padded_round_trip(hi in any::<u32>(), lo in any::<u32>()) {
            let s = format!("{hi:08X}/{lo:08x}");
            prop_assert_eq!(parse_lsn(&s), Some((u64::from(hi) << 32) | u64::from(lo)));
        }

        #[test]
        fn lsn_parse_never_panics(s in ".{0,24}") {
            let _ = parse_lsn(&s);
        }
    }
}
