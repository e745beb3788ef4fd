//! Decoder for PostgreSQL's `pgoutput` logical replication messages
//! (protocol version 1).
//!
//! # Why this crate exists
//!
//! outboxd's replication client (in `outbox-source`) speaks the streaming
//! replication protocol and receives `XLogData` frames. The payload of each
//! frame is exactly one `pgoutput` message; the client hands that payload to
//! [`decode`] and gets back a [`LogicalMessage`].
//!
//! Keeping the decoder separate from the client makes it *pure*: no sockets,
//! no async runtime, no state carried between calls. That is what lets it be
//! unit-tested against byte strings captured from a real server, property
//! tested, and fuzzed (see `fuzz/`). The contract the fuzzer checks is that
//! [`decode`] never panics: every malformed input becomes a [`DecodeError`]
//! naming the message, the field and the byte offset where decoding failed.
//!
//! # Scope
//!
//! * Only protocol version 1 is decoded, because the relay requests
//!   `proto_version '1'`. The tags that only exist in later versions (streamed
//!   transactions in v2, two-phase commit in v3) are recognised and rejected
//!   with [`DecodeError::Unsupported`], so a misconfigured slot fails loudly
//!   instead of being misparsed as something else.
//! * The decoder is stateless. It does not know relation schemas, so it does
//!   not check that a tuple's column count matches the last [`Relation`]
//!   message for that relation id; the caller keeps that cache.
//! * Column values are never copied: [`ColumnValue::Text`] and
//!   [`ColumnValue::Binary`] (and [`LogicalDecodingMessage::content`]) are
//!   [`Bytes::slice`]s of the buffer passed to [`decode`], so they keep that
//!   buffer alive. Names (relations, columns, types, prefixes) are small and
//!   are copied into `String`s after UTF-8 validation.

use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;

/// Decodes one `pgoutput` message: the payload of one `XLogData` frame.
///
/// The whole buffer must be consumed by the message; bytes left over after a
/// complete message are reported as [`DecodeError::TrailingBytes`], because
/// they mean the caller framed the payload wrongly.
///
/// Never panics, whatever the input.
pub fn decode(buf: Bytes) -> Result<LogicalMessage, DecodeError> {
    let Some(&tag) = buf.first() else {
        return Err(DecodeError::Empty);
    };
    let message = match tag {
        b'B' => "Begin",
        b'C' => "Commit",
        b'O' => "Origin",
        b'R' => "Relation",
        b'Y' => "Type",
        b'I' => "Insert",
        b'U' => "Update",
        b'D' => "Delete",
        b'T' => "Truncate",
        b'M' => "Message",
        _ if later_protocol_message(tag).is_some() => {
            return Err(DecodeError::Unsupported { tag });
        }
        _ => return Err(DecodeError::UnknownTag { tag }),
    };
    let mut r = Reader {
        buf,
        pos: 1,
        message,
    };
    let decoded = match tag {
        b'B' => LogicalMessage::Begin(r.begin()?),
        b'C' => LogicalMessage::Commit(r.commit()?),
        b'O' => LogicalMessage::Origin(r.origin()?),
        b'R' => LogicalMessage::Relation(r.relation()?),
        b'Y' => LogicalMessage::Type(r.type_message()?),
        b'I' => LogicalMessage::Insert(r.insert()?),
        b'U' => LogicalMessage::Update(r.update()?),
        b'D' => LogicalMessage::Delete(r.delete()?),
        b'T' => LogicalMessage::Truncate(r.truncate()?),
        // Only 'M' is left: every other tag returned above.
        _ => LogicalMessage::Message(r.logical_message()?),
    };
    r.finish()?;
    Ok(decoded)
}

/// One decoded `pgoutput` message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogicalMessage {
    /// `B`: start of a transaction. Everything up to the matching
    /// [`LogicalMessage::Commit`] belongs to it.
    Begin(Begin),
    /// `C`: end of a transaction.
    Commit(Commit),
    /// `O`: the transaction was replayed from another replication origin.
    /// Sent right after `Begin`.
    Origin(Origin),
    /// `R`: schema of a relation. Sent before the first change to the
    /// relation in a session and again whenever its definition (or its
    /// relcache entry) changes; later messages refer to it by id.
    Relation(Relation),
    /// `Y`: name of a non-built-in data type used by a relation's column.
    Type(TypeMessage),
    /// `I`: a row was inserted.
    Insert(Insert),
    /// `U`: a row was updated.
    Update(Update),
    /// `D`: a row was deleted.
    Delete(Delete),
    /// `T`: one or more relations were truncated.
    Truncate(Truncate),
    /// `M`: a message written by `pg_logical_emit_message` (only sent when the
    /// slot is read with `messages 'true'`).
    Message(LogicalDecodingMessage),
}

/// Start of a transaction (`B`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Begin {
    /// LSN of the transaction's commit record; equal to the matching
    /// [`Commit::commit_lsn`].
    pub final_lsn: u64,
    /// Commit timestamp, in microseconds since 2000-01-01 00:00:00 UTC (the
    /// PostgreSQL epoch). For a transaction replayed under a replication
    /// origin this is the origin's timestamp.
    pub commit_time: i64,
    /// Transaction id.
    pub xid: u32,
}

/// End of a transaction (`C`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// Flags; unused by PostgreSQL so far (always 0), kept as received.
    pub flags: u8,
    /// LSN of the commit record.
    pub commit_lsn: u64,
    /// LSN just past the commit record: the position to report as flushed
    /// once the transaction is durably handled. Always greater than
    /// `commit_lsn`.
    pub end_lsn: u64,
    /// Commit timestamp, microseconds since 2000-01-01 00:00:00 UTC.
    pub commit_time: i64,
}

/// Replication origin of the current transaction (`O`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The commit LSN *on the origin server* (as given to
    /// `pg_replication_origin_xact_setup`), not a local LSN.
    pub commit_lsn: u64,
    /// Name of the replication origin.
    pub name: String,
}

/// Schema of a relation (`R`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Relation OID; [`Insert::relation_id`] and friends refer to it.
    pub id: u32,
    /// Schema name. PostgreSQL sends an empty string for `pg_catalog`.
    pub namespace: String,
    /// Relation name.
    pub name: String,
    /// Replica identity setting, as in `pg_class.relreplident`:
    /// `b'd'` default (primary key), `b'n'` nothing, `b'f'` full,
    /// `b'i'` index.
    pub replica_identity: u8,
    /// Published columns, in the order tuple data lists them.
    pub columns: Vec<RelationColumn>,
}

impl Relation {
    /// Position of the column called `name` (exact, case-sensitive match), which is
    /// also its position in every [`TupleData`] for this relation.
    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.name == name)
    }
}

/// One column of a [`Relation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    /// Column flags: [`RelationColumn::FLAG_KEY`] marks a column that is part
    /// of the replica identity key. No other bits are defined.
    pub flags: u8,
    /// Column name.
    pub name: String,
    /// OID of the column's data type.
    pub type_oid: u32,
    /// Type modifier (`atttypmod`), -1 when the type has none.
    pub type_modifier: i32,
}

impl RelationColumn {
    /// Bit of [`RelationColumn::flags`] set for replica identity key columns.
    pub const FLAG_KEY: u8 = 1;

    /// Whether the column is part of the replica identity key.
    pub fn is_key(&self) -> bool {
        self.flags & Self::FLAG_KEY != 0
    }
}

/// Name of a data type (`Y`). Sent for types that are not built in (OIDs
/// outside the initial catalog), such as enums and domains, before the
/// [`Relation`] that uses them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeMessage {
    /// Type OID, as found in [`RelationColumn::type_oid`].
    pub id: u32,
    /// Schema name; empty for `pg_catalog`.
    pub namespace: String,
    /// Type name.
    pub name: String,
}

/// An inserted row (`I`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    /// OID of the relation, described by an earlier [`Relation`] message.
    pub relation_id: u32,
    /// The new row.
    pub new: TupleData,
}

/// An updated row (`U`).
///
/// At most one of `key` and `old` is present: `key` when the replica identity
/// is the primary key or an index and a key column changed (only the key
/// columns are non-null), `old` when the relation has `REPLICA IDENTITY FULL`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    /// OID of the relation.
    pub relation_id: u32,
    /// Old key values (`K`).
    pub key: Option<TupleData>,
    /// Whole old row (`O`).
    pub old: Option<TupleData>,
    /// The new row. Columns stored out of line and not changed by the update
    /// are [`ColumnValue::UnchangedToast`].
    pub new: TupleData,
}

/// A deleted row (`D`).
///
/// Exactly one of `key` and `old` is present when produced by [`decode`]
/// (PostgreSQL always sends one), following the same rule as [`Update`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    /// OID of the relation.
    pub relation_id: u32,
    /// Key of the deleted row (`K`).
    pub key: Option<TupleData>,
    /// Whole deleted row (`O`), with `REPLICA IDENTITY FULL`.
    pub old: Option<TupleData>,
}

/// Truncated relations (`T`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    /// Bit set of [`Truncate::CASCADE`] and [`Truncate::RESTART_IDENTITY`].
    pub options: u8,
    /// OIDs of all relations truncated by the one statement.
    pub relation_ids: Vec<u32>,
}

impl Truncate {
    /// `TRUNCATE ... CASCADE`.
    pub const CASCADE: u8 = 1;
    /// `TRUNCATE ... RESTART IDENTITY`.
    pub const RESTART_IDENTITY: u8 = 2;
}

/// A message emitted with `pg_logical_emit_message` (`M`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalDecodingMessage {
    /// Whether the message was emitted transactionally, in which case it sits
    /// between a `Begin` and a `Commit`; non-transactional messages arrive on
    /// their own.
    pub transactional: bool,
    /// LSN of the message's WAL record.
    pub lsn: u64,
    /// The prefix given by the emitter.
    pub prefix: String,
    /// The content, uninterpreted; a slice of the decoded buffer.
    pub content: Bytes,
}

/// Column values of one row, in [`Relation::columns`] order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TupleData {
    /// One entry per column of the relation.
    pub columns: Vec<ColumnValue>,
}

/// The value of one column in a [`TupleData`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColumnValue {
    /// SQL NULL (`n`).
    Null,
    /// A TOASTed value the change did not touch (`u`); the server does not
    /// resend it, so the consumer must keep the old value or treat it as unknown.
    UnchangedToast,
    /// The value in the type's text output format (`t`); a slice of the
    /// decoded buffer, not validated as UTF-8.
    Text(Bytes),
    /// The value in the type's binary send format (`b`), when the slot is read
    /// with `binary 'true'`; a slice of the decoded buffer.
    Binary(Bytes),
}

impl ColumnValue {
    /// The value as a string, for [`ColumnValue::Text`] holding valid UTF-8;
    /// `None` for every other variant or for invalid UTF-8.
    pub fn as_text(&self) -> Option<&str> {
        match self {
            ColumnValue::Text(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// Whether the value is SQL NULL.
    pub fn is_null(&self) -> bool {
        matches!(self, ColumnValue::Null)
    }
}

/// Why a buffer could not be decoded.
///
/// `message` fields name the message being decoded (`"Insert"`, `"Relation"`,
/// ...); offsets count bytes from the start of the buffer, whose byte 0 is the
/// message tag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The buffer was empty.
    #[error("empty buffer: expected a 1-byte message tag at offset 0")]
    Empty,
    /// The tag at offset 0 is not a `pgoutput` message tag.
    #[error("unknown pgoutput message tag {} at offset 0", TagDisplay(*.tag))]
    UnknownTag {
        /// The byte found.
        tag: u8,
    },
    /// The tag belongs to a message that only exists in a later protocol
    /// version (streaming in v2, two-phase commit in v3). The relay requests
    /// `proto_version '1'`, so receiving one means the slot was read with
    /// other options.
    #[error(
        "pgoutput message tag {} ({}) at offset 0 requires protocol version {} or later; \
         only proto_version 1 is supported",
        TagDisplay(*.tag),
        later_protocol_message(*.tag).map_or("?", |(name, _)| name),
        later_protocol_message(*.tag).map_or(2, |(_, version)| version)
    )]
    Unsupported {
        /// The tag found.
        tag: u8,
    },
    /// The buffer ended before a field.
    #[error("{message} message truncated at offset {offset}: expected {expected}")]
    Truncated {
        /// Message being decoded.
        message: &'static str,
        /// Where the missing field starts.
        offset: usize,
        /// What was expected there, e.g. "4-byte relation id".
        expected: Cow<'static, str>,
    },
    /// A NUL-terminated string field has no terminator before the end of the
    /// buffer.
    #[error("{message} message: string field `{field}` starting at offset {offset} has no NUL terminator")]
    UnterminatedString {
        /// Message being decoded.
        message: &'static str,
        /// Name of the field.
        field: Cow<'static, str>,
        /// Where the string starts.
        offset: usize,
    },
    /// A string field is not valid UTF-8.
    #[error(
        "{message} message: string field `{field}` starting at offset {offset} is not valid \
         UTF-8 (invalid byte at offset {invalid_at})"
    )]
    InvalidUtf8 {
        /// Message being decoded.
        message: &'static str,
        /// Name of the field.
        field: Cow<'static, str>,
        /// Where the string starts.
        offset: usize,
        /// Where the first invalid byte sequence starts.
        invalid_at: usize,
    },
    /// A byte with a fixed set of allowed values (tuple marker, column kind,
    /// flag) has another value.
    #[error("{message} message: unexpected byte {} at offset {offset}: expected {expected}", TagDisplay(*.found))]
    UnexpectedByte {
        /// Message being decoded.
        message: &'static str,
        /// Where the byte is.
        offset: usize,
        /// The byte found.
        found: u8,
        /// What was allowed there.
        expected: Cow<'static, str>,
    },
    /// A length field is negative.
    #[error("{message} message: negative length {length} at offset {offset} for {field}")]
    NegativeLength {
        /// Message being decoded.
        message: &'static str,
        /// Where the length field starts.
        offset: usize,
        /// The value read.
        length: i32,
        /// What the length is for.
        field: Cow<'static, str>,
    },
    /// A complete message was decoded but the buffer goes on.
    #[error("{message} message complete at offset {offset} but {count} trailing byte(s) follow")]
    TrailingBytes {
        /// Message decoded.
        message: &'static str,
        /// Where the message ended and the trailing bytes start.
        offset: usize,
        /// How many bytes are left over.
        count: usize,
    },
}

impl DecodeError {
    /// Byte offset in the buffer that the error refers to.
    pub fn offset(&self) -> usize {
        match self {
            DecodeError::Empty
            | DecodeError::UnknownTag { .. }
            | DecodeError::Unsupported { .. } => 0,
            DecodeError::Truncated { offset, .. }
            | DecodeError::UnterminatedString { offset, .. }
            | DecodeError::InvalidUtf8 { offset, .. }
            | DecodeError::UnexpectedByte { offset, .. }
            | DecodeError::NegativeLength { offset, .. }
            | DecodeError::TrailingBytes { offset, .. } => *offset,
        }
    }
}

/// Messages of protocol versions after 1: their name and the version that
/// introduced them.
fn later_protocol_message(tag: u8) -> Option<(&'static str, u8)> {
    Some(match tag {
        b'S' => ("Stream Start", 2),
        b'E' => ("Stream Stop", 2),
        b'c' => ("Stream Commit", 2),
        b'A' => ("Stream Abort", 2),
        b'b' => ("Begin Prepare", 3),
        b'P' => ("Prepare", 3),
        b'K' => ("Commit Prepared", 3),
        b'r' => ("Rollback Prepared", 3),
        b'p' => ("Stream Prepare", 3),
        _ => return None,
    })
}

/// Shows a protocol byte as `'X'` when it is printable ASCII, else as hex.
struct TagDisplay(u8);

impl fmt::Display for TagDisplay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_ascii_graphic() {
            write!(f, "'{}'", char::from(self.0))
        } else {
            write!(f, "0x{:02x}", self.0)
        }
    }
}

/// Cursor over one message.
///
/// Invariant: `pos <= buf.len()`. Every read checks the remaining length
/// before advancing, so a short buffer turns into `DecodeError::Truncated`
/// at the offset of the field that did not fit, never into a panic.
struct Reader {
    buf: Bytes,
    pos: usize,
    message: &'static str,
}

impl Reader {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn truncated(&self, expected: impl Into<Cow<'static, str>>) -> DecodeError {
        DecodeError::Truncated {
            message: self.message,
            offset: self.pos,
            expected: expected.into(),
        }
    }

    fn unexpected(
        &self,
        offset: usize,
        found: u8,
        expected: impl Into<Cow<'static, str>>,
    ) -> DecodeError {
        DecodeError::UnexpectedByte {
            message: self.message,
            offset,
            found,
            expected: expected.into(),
        }
    }

    /// Advances over the next `n` bytes and returns their range, or returns
    /// `None` without moving when fewer than `n` are left.
    fn take(&mut self, n: usize) -> Option<std::ops::Range<usize>> {
        let end = self.pos.checked_add(n)?;
        if end > self.buf.len() {
            return None;
        }
        let range = self.pos..end;
        self.pos = end;
        Some(range)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let range = self.take(N)?;
        self.buf.get(range)?.try_into().ok()
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        self.array::<1>()
            .map(|[b]| b)
            .ok_or_else(|| self.truncated(what))
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        self.array()
            .map(u16::from_be_bytes)
            .ok_or_else(|| self.truncated(what))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        self.array()
            .map(u32::from_be_bytes)
            .ok_or_else(|| self.truncated(what))
    }

    fn i32(&mut self, what: impl Into<Cow<'static, str>>) -> Result<i32, DecodeError> {
        match self.array() {
            Some(b) => Ok(i32::from_be_bytes(b)),
            None => Err(self.truncated(what)),
        }
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        self.array()
            .map(u64::from_be_bytes)
            .ok_or_else(|| self.truncated(what))
    }

    fn i64(&mut self, what: &'static str) -> Result<i64, DecodeError> {
        self.array()
            .map(i64::from_be_bytes)
            .ok_or_else(|| self.truncated(what))
    }

    /// A length-prefixed (`Int32`) byte string, returned as a zero-copy slice.
    fn length_prefixed(
        &mut self,
        field: impl Fn() -> Cow<'static, str>,
    ) -> Result<Bytes, DecodeError> {
        let len_at = self.pos;
        let len = match self.array() {
            Some(b) => i32::from_be_bytes(b),
            None => return Err(self.truncated(format!("4-byte length of {}", field()))),
        };
        let len = usize::try_from(len).map_err(|_| DecodeError::NegativeLength {
            message: self.message,
            offset: len_at,
            length: len,
            field: field(),
        })?;
        match self.take(len) {
            Some(range) => Ok(self.buf.slice(range)),
            None => Err(self.truncated(format!("{len} byte(s) of {}", field()))),
        }
    }

    /// A NUL-terminated string, validated as UTF-8 and copied.
    fn cstr(&mut self, field: impl Into<Cow<'static, str>>) -> Result<String, DecodeError> {
        let start = self.pos;
        let rest = self.buf.get(start..).unwrap_or_default();
        let Some(nul) = rest.iter().position(|&b| b == 0) else {
            return Err(DecodeError::UnterminatedString {
                message: self.message,
                field: field.into(),
                offset: start,
            });
        };
        let s = std::str::from_utf8(&rest[..nul]).map_err(|e| DecodeError::InvalidUtf8 {
            message: self.message,
            field: field.into(),
            offset: start,
            invalid_at: start + e.valid_up_to(),
        })?;
        let s = s.to_owned();
        self.pos = start + nul + 1;
        Ok(s)
    }

    fn finish(self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            count => Err(DecodeError::TrailingBytes {
                message: self.message,
                offset: self.pos,
                count,
            }),
        }
    }

    fn begin(&mut self) -> Result<Begin, DecodeError> {
        let final_lsn = self.u64("8-byte final LSN")?;
        let commit_time = self.i64("8-byte commit timestamp")?;
        let xid = self.u32("4-byte transaction id")?;
        Ok(Begin {
            final_lsn,
            commit_time,
            xid,
        })
    }

    fn commit(&mut self) -> Result<Commit, DecodeError> {
        let flags = self.u8("1-byte flags")?;
        let commit_lsn = self.u64("8-byte commit LSN")?;
        let end_lsn = self.u64("8-byte end LSN")?;
        let commit_time = self.i64("8-byte commit timestamp")?;
        Ok(Commit {
            flags,
            commit_lsn,
            end_lsn,
            commit_time,
        })
    }

    fn origin(&mut self) -> Result<Origin, DecodeError> {
        let commit_lsn = self.u64("8-byte origin commit LSN")?;
        let name = self.cstr("origin name")?;
        Ok(Origin { commit_lsn, name })
    }

    fn relation(&mut self) -> Result<Relation, DecodeError> {
        let id = self.u32("4-byte relation id")?;
        let namespace = self.cstr("namespace")?;
        let name = self.cstr("relation name")?;
        let replica_identity = self.u8("1-byte replica identity")?;
        let ncols = self.u16("2-byte column count")?;
        // Each column takes at least 10 bytes (flags, NUL, OID, typmod), so a
        // forged count cannot make us reserve more than the input justifies.
        let mut columns = Vec::with_capacity(usize::from(ncols).min(self.remaining() / 10));
        for i in 0..ncols {
            let flags = match self.array::<1>() {
                Some([b]) => b,
                None => return Err(self.truncated(format!("1-byte flags of column {i}"))),
            };
            let name = self.cstr(format!("name of column {i}"))?;
            let type_oid = match self.array() {
                Some(b) => u32::from_be_bytes(b),
                None => return Err(self.truncated(format!("4-byte type OID of column {i}"))),
            };
            let type_modifier = self.i32(format!("4-byte type modifier of column {i}"))?;
            columns.push(RelationColumn {
                flags,
                name,
                type_oid,
                type_modifier,
            });
        }
        Ok(Relation {
            id,
            namespace,
            name,
            replica_identity,
            columns,
        })
    }

    fn type_message(&mut self) -> Result<TypeMessage, DecodeError> {
        let id = self.u32("4-byte type OID")?;
        let namespace = self.cstr("namespace")?;
        let name = self.cstr("type name")?;
        Ok(TypeMessage {
            id,
            namespace,
            name,
        })
    }

    fn insert(&mut self) -> Result<Insert, DecodeError> {
        let relation_id = self.u32("4-byte relation id")?;
        self.marker(b'N', "1-byte new tuple marker 'N'")?;
        let new = self.tuple()?;
        Ok(Insert { relation_id, new })
    }

    fn update(&mut self) -> Result<Update, DecodeError> {
        let relation_id = self.u32("4-byte relation id")?;
        let at = self.pos;
        let (key, old) = match self.u8("1-byte tuple marker ('K', 'O' or 'N')")? {
            b'K' => (Some(self.tuple()?), None),
            b'O' => (None, Some(self.tuple()?)),
            b'N' => (None, None),
            other => return Err(self.unexpected(at, other, "tuple marker 'K', 'O' or 'N'")),
        };
        // Without an old tuple, the 'N' marker was consumed above.
        if key.is_some() || old.is_some() {
            self.marker(b'N', "1-byte new tuple marker 'N'")?;
        }
        let new = self.tuple()?;
        Ok(Update {
            relation_id,
            key,
            old,
            new,
        })
    }

    fn delete(&mut self) -> Result<Delete, DecodeError> {
        let relation_id = self.u32("4-byte relation id")?;
        let at = self.pos;
        let (key, old) = match self.u8("1-byte tuple marker ('K' or 'O')")? {
            b'K' => (Some(self.tuple()?), None),
            b'O' => (None, Some(self.tuple()?)),
            other => return Err(self.unexpected(at, other, "tuple marker 'K' or 'O'")),
        };
        Ok(Delete {
            relation_id,
            key,
            old,
        })
    }

    fn truncate(&mut self) -> Result<Truncate, DecodeError> {
        // The count is an Int32 on the wire; reading it unsigned makes a
        // negative count simply run out of input at the first missing id.
        let nrels = self.u32("4-byte relation count")?;
        let options = self.u8("1-byte options")?;
        let cap = usize::try_from(nrels)
            .unwrap_or(usize::MAX)
            .min(self.remaining() / 4);
        let mut relation_ids = Vec::with_capacity(cap);
        for i in 0..nrels {
            match self.array() {
                Some(b) => relation_ids.push(u32::from_be_bytes(b)),
                None => return Err(self.truncated(format!("4-byte relation id {i} of {nrels}"))),
            }
        }
        Ok(Truncate {
            options,
            relation_ids,
        })
    }

    fn logical_message(&mut self) -> Result<LogicalDecodingMessage, DecodeError> {
        let at = self.pos;
        let transactional = match self.u8("1-byte flags")? {
            0 => false,
            1 => true,
            other => return Err(self.unexpected(at, other, "flags 0 or 1 (transactional)")),
        };
        let lsn = self.u64("8-byte message LSN")?;
        let prefix = self.cstr("prefix")?;
        let content = self.length_prefixed(|| "content".into())?;
        Ok(LogicalDecodingMessage {
            transactional,
            lsn,
            prefix,
            content,
        })
    }

    fn marker(&mut self, want: u8, what: &'static str) -> Result<(), DecodeError> {
        let at = self.pos;
        match self.u8(what)? {
            b if b == want => Ok(()),
            other => Err(self.unexpected(at, other, what)),
        }
    }

    fn tuple(&mut self) -> Result<TupleData, DecodeError> {
        let ncols = self.u16("2-byte tuple column count")?;
        // Every column takes at least its 1-byte kind.
        let mut columns = Vec::with_capacity(usize::from(ncols).min(self.remaining()));
        for i in 0..ncols {
            let at = self.pos;
            let kind = match self.array::<1>() {
                Some([b]) => b,
                None => return Err(self.truncated(format!("1-byte kind of column {i}"))),
            };
            let value = match kind {
                b'n' => ColumnValue::Null,
                b'u' => ColumnValue::UnchangedToast,
                b't' => {
                    ColumnValue::Text(self.length_prefixed(|| format!("column {i} value").into())?)
                }
                b'b' => ColumnValue::Binary(
                    self.length_prefixed(|| format!("column {i} value").into())?,
                ),
                other => {
                    return Err(self.unexpected(
                        at,
                        other,
                        format!("kind of column {i}: 'n', 'u', 't' or 'b'"),
                    ))
                }
            };
            columns.push(value);
        }
        Ok(TupleData { columns })
    }
}

#[cfg(test)]
mod tests {
    //! Hand-built messages for cases a server does not produce on demand
    //! (Origin, malformed input). Captured-bytes tests live in `tests/`.

    use super::*;

    fn err(bytes: &[u8]) -> DecodeError {
        decode(Bytes::copy_from_slice(bytes)).unwrap_err()
    }

    #[test]
    fn origin() {
        let mut buf = vec![b'O'];
        buf.extend_from_slice(&0x0000_0001_0000_00ffu64.to_be_bytes());
        buf.extend_from_slice(b"node_a\0");
        assert_eq!(
            decode(Bytes::from(buf)),
            Ok(LogicalMessage::Origin(Origin {
                commit_lsn: 0x0000_0001_0000_00ff,
                name: "node_a".into()
            }))
        );
    }

    #[test]
    fn truncated_message_names_field_and_offset() {
        let e = err(b"I\0\0");
        assert_eq!(
            e.to_string(),
            "Insert message truncated at offset 1: expected 4-byte relation id"
        );
        assert_eq!(e.offset(), 1);

        // Insert, relation 1, 'N', 1 column, text of length 5 with 2 bytes.
        let e = err(b"I\0\0\0\x01N\0\x01t\0\0\0\x05ab");
        assert_eq!(
            e.to_string(),
            "Insert message truncated at offset 13: expected 5 byte(s) of column 0 value"
        );
        let e = err(b"I\0\0\0\x01N\0\x02n");
        assert_eq!(
            e.to_string(),
            "Insert message truncated at offset 9: expected 1-byte kind of column 1"
        );
    }

    #[test]
    fn empty_unknown_and_unsupported_tags() {
        assert_eq!(err(b""), DecodeError::Empty);
        assert_eq!(
            err(b"Z").to_string(),
            "unknown pgoutput message tag 'Z' at offset 0"
        );
        assert_eq!(
            err(b"\0").to_string(),
            "unknown pgoutput message tag 0x00 at offset 0"
        );
        for tag in *b"SEcA" {
            assert_eq!(err(&[tag]), DecodeError::Unsupported { tag });
        }
        assert_eq!(
            err(b"K").to_string(),
            "pgoutput message tag 'K' (Commit Prepared) at offset 0 requires protocol \
             version 3 or later; only proto_version 1 is supported"
        );
    }

    #[test]
    fn invalid_utf8_names_the_field() {
        let e = err(b"R\0\0\0\x01public\0bad\xffname\0d\0\0");
        assert_eq!(
            e,
            DecodeError::InvalidUtf8 {
                message: "Relation",
                field: "relation name".into(),
                offset: 12,
                invalid_at: 15,
            }
        );
        assert_eq!(
            e.to_string(),
            "Relation message: string field `relation name` starting at offset 12 is not \
             valid UTF-8 (invalid byte at offset 15)"
        );
        let e = err(b"R\0\0\0\x01public\0t\0d\0\x01\x01c\xc3\0\0\0\0\x19\xff\xff\xff\xff");
        assert!(
            matches!(&e, DecodeError::InvalidUtf8 { field, offset: 18, invalid_at: 19, .. } if field == "name of column 0"),
            "{e:?}"
        );
    }

    #[test]
    fn unterminated_string() {
        assert_eq!(
            err(b"Y\0\0\0\x01public\0enu").to_string(),
            "Type message: string field `type name` starting at offset 12 has no NUL terminator"
        );
    }

    #[test]
    fn negative_lengths_are_rejected() {
        let e = err(b"I\0\0\0\x01N\0\x01t\xff\xff\xff\xfe");
        assert_eq!(
            e.to_string(),
            "Insert message: negative length -2 at offset 9 for column 0 value"
        );
        let e = err(b"M\x01\0\0\0\0\0\0\0\x01p\0\x80\0\0\0");
        assert!(
            matches!(e, DecodeError::NegativeLength { offset: 12, .. }),
            "{e:?}"
        );
    }

    #[test]
    fn unexpected_bytes() {
        assert_eq!(
            err(b"I\0\0\0\x01N\0\x01x").to_string(),
            "Insert message: unexpected byte 'x' at offset 8: expected kind of column 0: \
             'n', 'u', 't' or 'b'"
        );
        assert_eq!(
            err(b"I\0\0\0\x01K\0\0").offset(),
            5,
            "Insert carries only a new tuple"
        );
        // Delete must carry a key or an old row.
        assert!(matches!(
            err(b"D\0\0\0\x01N\0\0"),
            DecodeError::UnexpectedByte {
                offset: 5,
                found: b'N',
                ..
            }
        ));
        // An old-row image must be followed by the new row.
        assert!(matches!(
            err(b"U\0\0\0\x01K\0\0O\0\0"),
            DecodeError::UnexpectedByte {
                offset: 8,
                found: b'O',
                ..
            }
        ));
        assert!(matches!(
            err(b"M\x02\0\0\0\0\0\0\0\x01p\0\0\0\0\0"),
            DecodeError::UnexpectedByte {
                offset: 1,
                found: 2,
                ..
            }
        ));
    }

    #[test]
    fn forged_counts_fail_without_huge_allocations() {
        // 2^32-1 relations announced, two present.
        let e = err(b"T\xff\xff\xff\xff\0\0\0\0\x01\0\0\0\x02");
        assert_eq!(
            e.to_string(),
            "Truncate message truncated at offset 14: expected 4-byte relation id 2 of 4294967295"
        );
        let e = err(b"I\0\0\0\x01N\xff\xffn");
        assert!(
            matches!(e, DecodeError::Truncated { offset: 9, .. }),
            "{e:?}"
        );
    }

    #[test]
    fn update_without_old_image() {
        let m = decode(Bytes::from_static(b"U\0\0\0\x07N\0\x02t\0\0\0\x02hiu")).unwrap();
        assert_eq!(
            m,
            LogicalMessage::Update(Update {
                relation_id: 7,
                key: None,
                old: None,
                new: TupleData {
                    columns: vec![
                        ColumnValue::Text(Bytes::from_static(b"hi")),
                        ColumnValue::UnchangedToast
                    ]
                },
            })
        );
    }

    #[test]
    fn column_value_helpers() {
        assert_eq!(
            ColumnValue::Text(Bytes::from_static(b"ok")).as_text(),
            Some("ok")
        );
        assert_eq!(
            ColumnValue::Text(Bytes::from_static(b"\xff")).as_text(),
            None
        );
        assert_eq!(
            ColumnValue::Binary(Bytes::from_static(b"ok")).as_text(),
            None
        );
        assert_eq!(ColumnValue::Null.as_text(), None);
        assert!(ColumnValue::Null.is_null());
        assert!(!ColumnValue::UnchangedToast.is_null());
    }

    #[test]
    fn relation_helpers() {
        let col = |flags, name: &str| RelationColumn {
            flags,
            name: name.into(),
            type_oid: 25,
            type_modifier: -1,
        };
        let rel = Relation {
            id: 1,
            namespace: String::new(),
            name: "t".into(),
            replica_identity: b'd',
            columns: vec![col(1, "id"), col(0, "Body"), col(0, "body")],
        };
        assert_eq!(rel.column_index("id"), Some(0));
        assert_eq!(rel.column_index("body"), Some(2));
        assert_eq!(rel.column_index("BODY"), None);
        assert!(rel.columns[0].is_key());
        assert!(!rel.columns[1].is_key());
    }
}
