//! Wire format: pure functions over `bytes`, no I/O.
//!
//! Every backend message is `tag: u8, len: i32 (big-endian, counts itself but not the tag),
//! body`. [`parse_frame`] cuts one whole message off the front of the read buffer, or
//! returns `Ok(None)` and leaves the buffer untouched (apart from reserving capacity) when
//! the message is not complete yet. That "all or nothing" property is what makes the socket
//! layer's reads cancel-safe: bytes only ever leave the buffer as whole frames.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{ReplicationMessage, TransportError};

/// Tag byte + length field.
pub(crate) const HEADER_LEN: usize = 5;

/// Largest length field we accept. The backend assembles each message in a `StringInfo`,
/// which is capped at `MaxAllocSize` (1 GiB - 1), and the length field adds 4; anything
/// bigger means the stream is out of sync (or not PostgreSQL), and trusting it would make us
/// reserve gigabytes.
pub(crate) const MAX_LEN_FIELD: usize = (1 << 30) + 4;

/// One backend message, undecoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Frame {
    pub tag: u8,
    pub body: Bytes,
}

/// Takes one complete message off the front of `buf`; `Ok(None)` if `buf` does not hold a
/// whole message yet (then `buf`'s contents are unchanged).
pub(crate) fn parse_frame(buf: &mut BytesMut) -> Result<Option<Frame>, TransportError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let tag = buf[0];
    let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    let len = usize::try_from(len).unwrap_or(0);
    if !(4..=MAX_LEN_FIELD).contains(&len) {
        return Err(TransportError::Protocol(format!(
            "invalid length {} in backend message header (tag {})",
            i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]),
            show_tag(tag)
        )));
    }
    let total = 1 + len;
    if buf.len() < total {
        // Make room for the rest in one go instead of growing piecemeal.
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let mut frame = buf.split_to(total);
    frame.advance(HEADER_LEN);
    Ok(Some(Frame {
        tag,
        body: frame.freeze(),
    }))
}

pub(crate) fn show_tag(tag: u8) -> String {
    if tag.is_ascii_graphic() {
        format!("'{}'", tag as char)
    } else {
        format!("0x{tag:02x}")
    }
}

/// An authentication request (`'R'`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AuthRequest {
    Ok,
    CleartextPassword,
    Md5Password {
        salt: [u8; 4],
    },
    Sasl {
        mechanisms: Vec<String>,
    },
    SaslContinue(Bytes),
    SaslFinal(Bytes),
    /// Any method we do not implement (Kerberos, GSSAPI, SSPI, ...), by its code.
    Other(i32),
}

/// The fields of an ErrorResponse / NoticeResponse that we keep.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct ErrorFields {
    /// Non-localized severity (`V`) if present, else the localized one (`S`).
    pub severity: String,
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl From<ErrorFields> for TransportError {
    fn from(f: ErrorFields) -> Self {
        TransportError::Server {
            code: f.code,
            message: f.message,
            detail: f.detail,
            hint: f.hint,
        }
    }
}

/// A decoded backend message. Only what this client uses is decoded in detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BackendMessage {
    Authentication(AuthRequest),
    BackendKeyData {
        process_id: i32,
        secret_key: i32,
    },
    ParameterStatus {
        name: String,
        value: String,
    },
    NegotiateProtocolVersion,
    ReadyForQuery {
        status: u8,
    },
    RowDescription {
        columns: Vec<String>,
    },
    DataRow {
        values: Vec<Option<String>>,
    },
    CommandComplete {
        tag: String,
    },
    EmptyQueryResponse,
    ErrorResponse(ErrorFields),
    NoticeResponse(ErrorFields),
    NotificationResponse,
    CopyInResponse,
    CopyOutResponse,
    CopyBothResponse,
    CopyData(Bytes),
    CopyDone,
    /// A tag this client has no use for; reported as unexpected by whoever receives it.
    Other {
        tag: u8,
    },
}

impl BackendMessage {
    /// Short name for "unexpected message" errors and logs.
    pub(crate) fn name(&self) -> String {
        match self {
            BackendMessage::Authentication(_) => "Authentication".into(),
            BackendMessage::BackendKeyData { .. } => "BackendKeyData".into(),
            BackendMessage::ParameterStatus { .. } => "ParameterStatus".into(),
            BackendMessage::NegotiateProtocolVersion => "NegotiateProtocolVersion".into(),
            BackendMessage::ReadyForQuery { .. } => "ReadyForQuery".into(),
            BackendMessage::RowDescription { .. } => "RowDescription".into(),
            BackendMessage::DataRow { .. } => "DataRow".into(),
            BackendMessage::CommandComplete { .. } => "CommandComplete".into(),
            BackendMessage::EmptyQueryResponse => "EmptyQueryResponse".into(),
            BackendMessage::ErrorResponse(_) => "ErrorResponse".into(),
            BackendMessage::NoticeResponse(_) => "NoticeResponse".into(),
            BackendMessage::NotificationResponse => "NotificationResponse".into(),
            BackendMessage::CopyInResponse => "CopyInResponse".into(),
            BackendMessage::CopyOutResponse => "CopyOutResponse".into(),
            BackendMessage::CopyBothResponse => "CopyBothResponse".into(),
            BackendMessage::CopyData(_) => "CopyData".into(),
            BackendMessage::CopyDone => "CopyDone".into(),
            BackendMessage::Other { tag } => format!("message with tag {}", show_tag(*tag)),
        }
    }
}

/// A bounds-checked reader over a message body; every short read is a protocol error
/// naming the message being decoded.
struct Reader<'a> {
    buf: Bytes,
    what: &'a str,
}

impl<'a> Reader<'a> {
    fn new(buf: Bytes, what: &'a str) -> Self {
        Reader { buf, what }
    }

    fn truncated(&self) -> TransportError {
        TransportError::Protocol(format!("truncated {} message", self.what))
    }

    fn need(&self, n: usize) -> Result<(), TransportError> {
        if self.buf.remaining() < n {
            Err(self.truncated())
        } else {
            Ok(())
        }
    }

    fn u8(&mut self) -> Result<u8, TransportError> {
        self.need(1)?;
        Ok(self.buf.get_u8())
    }

    fn i16(&mut self) -> Result<i16, TransportError> {
        self.need(2)?;
        Ok(self.buf.get_i16())
    }

    fn i32(&mut self) -> Result<i32, TransportError> {
        self.need(4)?;
        Ok(self.buf.get_i32())
    }

    fn u64(&mut self) -> Result<u64, TransportError> {
        self.need(8)?;
        Ok(self.buf.get_u64())
    }

    fn i64(&mut self) -> Result<i64, TransportError> {
        self.need(8)?;
        Ok(self.buf.get_i64())
    }

    fn bytes(&mut self, n: usize) -> Result<Bytes, TransportError> {
        self.need(n)?;
        Ok(self.buf.split_to(n))
    }

    fn rest(&mut self) -> Bytes {
        self.buf.split_off(0)
    }

    fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// A NUL-terminated string, decoded as UTF-8 (we ask for `client_encoding=UTF8`).
    fn cstr(&mut self) -> Result<String, TransportError> {
        let nul = self
            .buf
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.truncated())?;
        let s = self.utf8(&self.buf[..nul])?;
        self.buf.advance(nul + 1);
        Ok(s)
    }

    fn utf8(&self, b: &[u8]) -> Result<String, TransportError> {
        String::from_utf8(b.to_vec()).map_err(|_| {
            TransportError::Protocol(format!("invalid UTF-8 in {} message", self.what))
        })
    }
}

/// Decodes one frame. Unknown tags become [`BackendMessage::Other`] (not an error: whether
/// they matter depends on the caller's state).
pub(crate) fn decode(frame: Frame) -> Result<BackendMessage, TransportError> {
    let Frame { tag, body } = frame;
    Ok(match tag {
        b'R' => BackendMessage::Authentication(decode_auth(body)?),
        b'K' => {
            let mut r = Reader::new(body, "BackendKeyData");
            BackendMessage::BackendKeyData {
                process_id: r.i32()?,
                secret_key: r.i32()?,
            }
        }
        b'S' => {
            let mut r = Reader::new(body, "ParameterStatus");
            BackendMessage::ParameterStatus {
                name: r.cstr()?,
                value: r.cstr()?,
            }
        }
        b'v' => BackendMessage::NegotiateProtocolVersion,
        b'Z' => {
            let mut r = Reader::new(body, "ReadyForQuery");
            BackendMessage::ReadyForQuery { status: r.u8()? }
        }
        b'T' => {
            let mut r = Reader::new(body, "RowDescription");
            let n = r.i16()?;
            let n = usize::try_from(n).map_err(|_| r.truncated())?;
            let mut columns = Vec::with_capacity(n);
            for _ in 0..n {
                columns.push(r.cstr()?);
                // table oid i32, attnum i16, type oid i32, typlen i16, typmod i32, format i16
                r.bytes(18)?;
            }
            BackendMessage::RowDescription { columns }
        }
        b'D' => {
            let mut r = Reader::new(body, "DataRow");
            let n = r.i16()?;
            let n = usize::try_from(n).map_err(|_| r.truncated())?;
            let mut values = Vec::with_capacity(n);
            for _ in 0..n {
                let len = r.i32()?;
                if len < 0 {
                    values.push(None);
                } else {
                    let b = r.bytes(len as usize)?;
                    values.push(Some(r.utf8(&b)?));
                }
            }
            BackendMessage::DataRow { values }
        }
        b'C' => {
            let mut r = Reader::new(body, "CommandComplete");
            BackendMessage::CommandComplete { tag: r.cstr()? }
        }
        b'I' => BackendMessage::EmptyQueryResponse,
        b'E' => BackendMessage::ErrorResponse(decode_error_fields(body, "ErrorResponse")?),
        b'N' => BackendMessage::NoticeResponse(decode_error_fields(body, "NoticeResponse")?),
        b'A' => BackendMessage::NotificationResponse,
        b'G' => BackendMessage::CopyInResponse,
        b'H' => BackendMessage::CopyOutResponse,
        b'W' => BackendMessage::CopyBothResponse,
        b'd' => BackendMessage::CopyData(body),
        b'c' => BackendMessage::CopyDone,
        tag => BackendMessage::Other { tag },
    })
}

fn decode_auth(body: Bytes) -> Result<AuthRequest, TransportError> {
    let mut r = Reader::new(body, "Authentication");
    Ok(match r.i32()? {
        0 => AuthRequest::Ok,
        3 => AuthRequest::CleartextPassword,
        5 => {
            let salt = r.bytes(4)?;
            AuthRequest::Md5Password {
                salt: [salt[0], salt[1], salt[2], salt[3]],
            }
        }
        10 => {
            let mut mechanisms = Vec::new();
            loop {
                let m = r.cstr()?;
                // The list ends with an empty string.
                if m.is_empty() {
                    break;
                }
                mechanisms.push(m);
            }
            AuthRequest::Sasl { mechanisms }
        }
        11 => AuthRequest::SaslContinue(r.rest()),
        12 => AuthRequest::SaslFinal(r.rest()),
        code => AuthRequest::Other(code),
    })
}

/// Decodes the `(field type byte, cstring)*` list of ErrorResponse / NoticeResponse.
pub(crate) fn decode_error_fields(body: Bytes, what: &str) -> Result<ErrorFields, TransportError> {
    let mut r = Reader::new(body, what);
    let mut f = ErrorFields::default();
    let mut localized_severity = String::new();
    loop {
        let kind = r.u8()?;
        if kind == 0 {
            break;
        }
        // Be lenient about the encoding of free text (a server whose lc_messages does not
        // match UTF-8 may send anything before client_encoding is in effect).
        let nul = r
            .buf
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| r.truncated())?;
        let value = String::from_utf8_lossy(&r.buf[..nul]).into_owned();
        r.buf.advance(nul + 1);
        match kind {
            b'S' => localized_severity = value,
            b'V' => f.severity = value,
            b'C' => f.code = value,
            b'M' => f.message = value,
            b'D' => f.detail = Some(value),
            b'H' => f.hint = Some(value),
            _ => {}
        }
    }
    if f.severity.is_empty() {
        f.severity = localized_severity;
    }
    Ok(f)
}

/// Parses the payload of a CopyData message received during logical replication.
pub(crate) fn parse_replication_message(
    payload: Bytes,
) -> Result<ReplicationMessage, TransportError> {
    let mut r = Reader::new(payload, "replication CopyData");
    match r.u8()? {
        b'w' => Ok(ReplicationMessage::XLogData {
            wal_start: r.u64()?,
            wal_end: r.u64()?,
            server_time: r.i64()?,
            data: r.rest(),
        }),
        b'k' => {
            let msg = ReplicationMessage::Keepalive {
                wal_end: r.u64()?,
                server_time: r.i64()?,
                reply_requested: r.u8()? != 0,
            };
            if !r.is_empty() {
                return Err(TransportError::Protocol(
                    "trailing bytes in primary keepalive message".into(),
                ));
            }
            Ok(msg)
        }
        other => Err(TransportError::Protocol(format!(
            "unknown replication message type {} in CopyData",
            show_tag(other)
        ))),
    }
}

/// Length of the standby status update payload: tag + 3 LSNs + clock + reply flag.
pub(crate) const STANDBY_STATUS_PAYLOAD_LEN: usize = 1 + 8 + 8 + 8 + 8 + 1;

/// Appends a CopyData message carrying a standby status update (`'r'`) to `buf`.
///
/// `clock` is the client's time in microseconds since 2000-01-01 00:00 UTC. The server only
/// uses it for `pg_stat_replication` lag columns; correctness never depends on it.
pub(crate) fn encode_standby_status(
    buf: &mut BytesMut,
    write: u64,
    flush: u64,
    apply: u64,
    clock: i64,
    reply_requested: bool,
) {
    buf.reserve(HEADER_LEN + STANDBY_STATUS_PAYLOAD_LEN);
    buf.put_u8(b'd');
    buf.put_i32((4 + STANDBY_STATUS_PAYLOAD_LEN) as i32);
    buf.put_u8(b'r');
    buf.put_u64(write);
    buf.put_u64(flush);
    buf.put_u64(apply);
    buf.put_i64(clock);
    buf.put_u8(u8::from(reply_requested));
}

/// Microseconds between the Unix epoch and the PostgreSQL epoch (2000-01-01 00:00 UTC).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// Converts a system time to PostgreSQL's timestamp representation (microseconds since
/// 2000-01-01 UTC); times before the Unix epoch are clamped to it.
pub(crate) fn pg_timestamp(t: std::time::SystemTime) -> i64 {
    let unix_micros = t
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    unix_micros.saturating_sub(PG_EPOCH_OFFSET_MICROS)
}

/// Quotes an identifier for a replication command (`"..."`, embedded quotes doubled).
pub(crate) fn quote_ident(s: &str) -> Result<String, TransportError> {
    if s.contains('\0') {
        return Err(TransportError::Protocol(format!(
            "identifier {s:?} contains a NUL byte"
        )));
    }
    Ok(format!("\"{}\"", s.replace('"', "\"\"")))
}

/// Quotes a string literal for a replication command (`'...'`, embedded quotes doubled;
/// the replication command scanner has no backslash escapes).
pub(crate) fn quote_literal(s: &str) -> Result<String, TransportError> {
    if s.contains('\0') {
        return Err(TransportError::Protocol(format!(
            "string {s:?} contains a NUL byte"
        )));
    }
    Ok(format!("'{}'", s.replace('\'', "''")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&((body.len() + 4) as i32).to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    fn xlogdata_payload(start: u64, end: u64, time: i64, data: &[u8]) -> Vec<u8> {
        let mut p = vec![b'w'];
        p.extend_from_slice(&start.to_be_bytes());
        p.extend_from_slice(&end.to_be_bytes());
        p.extend_from_slice(&time.to_be_bytes());
        p.extend_from_slice(data);
        p
    }

    #[test]
    fn incomplete_input_is_none_and_untouched() {
        let whole = frame(b'Z', b"I");
        for cut in 0..whole.len() {
            let mut buf = BytesMut::from(&whole[..cut]);
            assert_eq!(parse_frame(&mut buf).unwrap(), None, "cut at {cut}");
            assert_eq!(&buf[..], &whole[..cut]);
        }
        let mut buf = BytesMut::from(&whole[..]);
        let f = parse_frame(&mut buf).unwrap().unwrap();
        assert_eq!(f.tag, b'Z');
        assert_eq!(&f.body[..], b"I");
        assert!(buf.is_empty());
        assert_eq!(
            decode(f).unwrap(),
            BackendMessage::ReadyForQuery { status: b'I' }
        );
    }

    #[test]
    fn two_frames_back_to_back() {
        let mut bytes = frame(b'c', b"");
        bytes.extend(frame(b'C', b"COPY 0\0"));
        bytes.extend_from_slice(&[b'Z', 0, 0]); // start of a third
        let mut buf = BytesMut::from(&bytes[..]);
        let a = decode(parse_frame(&mut buf).unwrap().unwrap()).unwrap();
        let b = decode(parse_frame(&mut buf).unwrap().unwrap()).unwrap();
        assert_eq!(a, BackendMessage::CopyDone);
        assert_eq!(
            b,
            BackendMessage::CommandComplete {
                tag: "COPY 0".into()
            }
        );
        assert_eq!(parse_frame(&mut buf).unwrap(), None);
        assert_eq!(buf.len(), 3);
    }

    #[test]
    fn bad_length_is_protocol_error() {
        for len in [-1i32, 0, 3, i32::MAX] {
            let mut v = vec![b'd'];
            v.extend_from_slice(&len.to_be_bytes());
            let mut buf = BytesMut::from(&v[..]);
            assert!(matches!(
                parse_frame(&mut buf),
                Err(TransportError::Protocol(_))
            ));
        }
    }

    #[test]
    fn copydata_xlogdata() {
        let payload = xlogdata_payload(0x1_0000_0010, 0x1_0000_0020, 42, b"B\x01\x02");
        let mut buf = BytesMut::from(&frame(b'd', &payload)[..]);
        let msg = decode(parse_frame(&mut buf).unwrap().unwrap()).unwrap();
        let BackendMessage::CopyData(p) = msg else {
            panic!("{msg:?}")
        };
        assert_eq!(
            parse_replication_message(p).unwrap(),
            ReplicationMessage::XLogData {
                wal_start: 0x1_0000_0010,
                wal_end: 0x1_0000_0020,
                server_time: 42,
                data: Bytes::from_static(b"B\x01\x02"),
            }
        );
    }

    #[test]
    fn copydata_keepalive() {
        let mut p = vec![b'k'];
        p.extend_from_slice(&0xABCD_u64.to_be_bytes());
        p.extend_from_slice(&(-5i64).to_be_bytes());
        p.push(1);
        assert_eq!(
            parse_replication_message(Bytes::from(p.clone())).unwrap(),
            ReplicationMessage::Keepalive {
                wal_end: 0xABCD,
                server_time: -5,
                reply_requested: true
            }
        );
        p[17] = 0;
        assert!(matches!(
            parse_replication_message(Bytes::from(p.clone())).unwrap(),
            ReplicationMessage::Keepalive {
                reply_requested: false,
                ..
            }
        ));
        // Truncated / trailing garbage / unknown type.
        assert!(parse_replication_message(Bytes::from(p[..17].to_vec())).is_err());
        let mut long = p.clone();
        long.push(0);
        assert!(parse_replication_message(Bytes::from(long)).is_err());
        assert!(parse_replication_message(Bytes::from_static(b"w\0\0")).is_err());
        assert!(parse_replication_message(Bytes::from_static(b"z")).is_err());
        assert!(parse_replication_message(Bytes::new()).is_err());
    }

    #[test]
    fn error_response_fields() {
        let body = b"SERROR\0VERROR\0C42704\0Mreplication slot \"x\" does not exist\0\
Dsome detail\0Hsome hint\0Fslot.c\0L123\0\0";
        let mut buf = BytesMut::from(&frame(b'E', body)[..]);
        let msg = decode(parse_frame(&mut buf).unwrap().unwrap()).unwrap();
        let BackendMessage::ErrorResponse(f) = msg else {
            panic!("{msg:?}")
        };
        assert_eq!(f.severity, "ERROR");
        assert_eq!(f.code, "42704");
        assert_eq!(f.message, "replication slot \"x\" does not exist");
        assert_eq!(f.detail.as_deref(), Some("some detail"));
        assert_eq!(f.hint.as_deref(), Some("some hint"));
        let e = TransportError::from(f);
        assert_eq!(e.sqlstate(), Some("42704"));
        assert!(e.to_string().contains("(SQLSTATE 42704)"));

        // Localized severity only; no detail/hint.
        let f = decode_error_fields(Bytes::from_static(b"SFATAL\0C28P01\0Mbad\0\0"), "E").unwrap();
        assert_eq!(f.severity, "FATAL");
        assert_eq!(f.detail, None);
        // Missing terminator.
        assert!(decode_error_fields(Bytes::from_static(b"SFATAL\0C28P01"), "E").is_err());
    }

    #[test]
    fn row_description_and_data_row() {
        let mut t = 2i16.to_be_bytes().to_vec();
        for name in ["slot_name", "consistent_point"] {
            t.extend_from_slice(name.as_bytes());
            t.push(0);
            t.extend_from_slice(&[0; 18]);
        }
        let mut buf = BytesMut::from(&frame(b'T', &t)[..]);
        assert_eq!(
            decode(parse_frame(&mut buf).unwrap().unwrap()).unwrap(),
            BackendMessage::RowDescription {
                columns: vec!["slot_name".into(), "consistent_point".into()]
            }
        );
        let mut d = 2i16.to_be_bytes().to_vec();
        d.extend_from_slice(&3i32.to_be_bytes());
        d.extend_from_slice(b"abc");
        d.extend_from_slice(&(-1i32).to_be_bytes());
        let mut buf = BytesMut::from(&frame(b'D', &d)[..]);
        assert_eq!(
            decode(parse_frame(&mut buf).unwrap().unwrap()).unwrap(),
            BackendMessage::DataRow {
                values: vec![Some("abc".into()), None]
            }
        );
        // A value length running past the body.
        let mut d = 1i16.to_be_bytes().to_vec();
        d.extend_from_slice(&10i32.to_be_bytes());
        d.extend_from_slice(b"abc");
        let mut buf = BytesMut::from(&frame(b'D', &d)[..]);
        assert!(decode(parse_frame(&mut buf).unwrap().unwrap()).is_err());
    }

    #[test]
    fn auth_requests() {
        let dec = |body: &[u8]| {
            let mut buf = BytesMut::from(&frame(b'R', body)[..]);
            decode(parse_frame(&mut buf).unwrap().unwrap()).unwrap()
        };
        assert_eq!(
            dec(&0i32.to_be_bytes()),
            BackendMessage::Authentication(AuthRequest::Ok)
        );
        let mut md5 = 5i32.to_be_bytes().to_vec();
        md5.extend_from_slice(&[1, 2, 3, 4]);
        assert_eq!(
            dec(&md5),
            BackendMessage::Authentication(AuthRequest::Md5Password { salt: [1, 2, 3, 4] })
        );
        let mut sasl = 10i32.to_be_bytes().to_vec();
        sasl.extend_from_slice(b"SCRAM-SHA-256-PLUS\0SCRAM-SHA-256\0\0");
        assert_eq!(
            dec(&sasl),
            BackendMessage::Authentication(AuthRequest::Sasl {
                mechanisms: vec!["SCRAM-SHA-256-PLUS".into(), "SCRAM-SHA-256".into()]
            })
        );
        let mut cont = 11i32.to_be_bytes().to_vec();
        cont.extend_from_slice(b"r=abc");
        assert_eq!(
            dec(&cont),
            BackendMessage::Authentication(AuthRequest::SaslContinue(Bytes::from_static(b"r=abc")))
        );
        assert_eq!(
            dec(&7i32.to_be_bytes()),
            BackendMessage::Authentication(AuthRequest::Other(7))
        );
    }

    #[test]
    fn copy_both_response_is_framed() {
        // CopyBothResponse: overall format i8, column count i16 (0 for logical replication).
        let mut buf = BytesMut::from(&frame(b'W', &[0, 0, 0])[..]);
        assert_eq!(
            decode(parse_frame(&mut buf).unwrap().unwrap()).unwrap(),
            BackendMessage::CopyBothResponse
        );
    }

    #[test]
    fn standby_status_layout() {
        let mut buf = BytesMut::new();
        encode_standby_status(
            &mut buf,
            0x0102_0304_0506_0708,
            0x1112_1314_1516_1718,
            0x2122_2324_2526_2728,
            0x3132_3334_3536_3738,
            true,
        );
        let expected: Vec<u8> = [
            &[b'd', 0, 0, 0, 38, b'r'][..],
            &[1, 2, 3, 4, 5, 6, 7, 8],
            &[0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18],
            &[0x21, 0x22, 0x23, 0x24, 0x25, 0x26, 0x27, 0x28],
            &[0x31, 0x32, 0x33, 0x34, 0x35, 0x36, 0x37, 0x38],
            &[1],
        ]
        .concat();
        assert_eq!(&buf[..], &expected[..]);
        assert_eq!(buf.len(), 39);

        let mut buf = BytesMut::new();
        encode_standby_status(&mut buf, 1, 2, 3, 4, false);
        assert_eq!(buf[buf.len() - 1], 0);
        // Same layout as postgres-protocol's generic CopyData framing.
        let mut generic = BytesMut::new();
        postgres_protocol::message::frontend::CopyData::new(&buf[HEADER_LEN..])
            .unwrap()
            .write(&mut generic);
        assert_eq!(generic, buf);
    }

    #[test]
    fn pg_epoch() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(946_684_800);
        assert_eq!(pg_timestamp(t), 0);
        let t = t + std::time::Duration::from_micros(1_500_000);
        assert_eq!(pg_timestamp(t), 1_500_000);
    }

    #[test]
    fn quoting() {
        assert_eq!(quote_ident("slot").unwrap(), "\"slot\"");
        assert_eq!(quote_ident("a\"b").unwrap(), "\"a\"\"b\"");
        assert!(quote_ident("a\0b").is_err());
        assert_eq!(quote_literal("pub").unwrap(), "'pub'");
        assert_eq!(quote_literal("it's").unwrap(), "'it''s'");
        assert_eq!(quote_literal("a\\b").unwrap(), "'a\\b'");
        assert!(quote_literal("\0").is_err());
    }

    proptest! {
        /// Feeding a stream of frames in arbitrary chunks yields exactly the frames, in order.
        #[test]
        fn chunked_stream_reassembles(
            bodies in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..12),
            chunk in 1usize..17,
        ) {
            let mut wire = Vec::new();
            for b in &bodies {
                wire.extend(frame(b'd', b));
            }
            let mut buf = BytesMut::new();
            let mut got = Vec::new();
            for piece in wire.chunks(chunk) {
                buf.extend_from_slice(piece);
                while let Some(f) = parse_frame(&mut buf).unwrap() {
                    prop_assert_eq!(f.tag, b'd');
                    got.push(f.body.to_vec());
                }
            }
            prop_assert!(buf.is_empty());
            prop_assert_eq!(got, bodies);
        }

        /// Arbitrary bytes never panic the decoders.
        #[test]
        fn decoders_never_panic(tag in any::<u8>(), body in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(Frame { tag, body: Bytes::from(body.clone()) });
            let _ = parse_replication_message(Bytes::from(body));
        }
    }
}
