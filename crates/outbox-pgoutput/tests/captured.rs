//! Decoding of pgoutput messages captured from a real PostgreSQL 15 server.
//!
//! The fixtures were produced by `tests/fixtures/capture.sql` on a throwaway
//! cluster (`wal_level=logical`) and read back with
//! `pg_logical_slot_peek_binary_changes`; each `.hex` file's header gives the
//! exact options. Row order in the fixtures is the order the walsender sends.

mod common;

use bytes::Bytes;
use common::{
    all_proto1, parse_fixture, Captured, PROTO1_BINARY, PROTO1_ORIGIN, PROTO1_TEXT, PROTO2_STREAM,
};
use outbox_pgoutput::{
    decode, Begin, ColumnValue, Commit, DecodeError, Delete, Insert, LogicalDecodingMessage,
    LogicalMessage, Relation, Truncate, TupleData, Update,
};

const OUTBOX_OID: u32 = 16389;
const AUDIT_OID: u32 = 16397;
const STATUS_ENUM_OID: u32 = 16385;

fn decode_all(fixture: &str) -> Vec<(Captured, LogicalMessage)> {
    parse_fixture(fixture)
        .into_iter()
        .map(|c| {
            let m = decode(c.data.clone())
                .unwrap_or_else(|e| panic!("captured message at {:#x} failed: {e}", c.lsn));
            (c, m)
        })
        .collect()
}

fn text(v: &ColumnValue) -> &str {
    v.as_text()
        .unwrap_or_else(|| panic!("expected a text value, got {v:?}"))
}

fn texts(t: &TupleData) -> Vec<Option<&str>> {
    t.columns
        .iter()
        .map(|c| match c {
            ColumnValue::Null => None,
            other => Some(text(other)),
        })
        .collect()
}

fn begin(m: &LogicalMessage) -> &Begin {
    match m {
        LogicalMessage::Begin(b) => b,
        other => panic!("expected Begin, got {other:?}"),
    }
}
fn commit(m: &LogicalMessage) -> &Commit {
    match m {
        LogicalMessage::Commit(c) => c,
        other => panic!("expected Commit, got {other:?}"),
    }
}
fn relation(m: &LogicalMessage) -> &Relation {
    match m {
        LogicalMessage::Relation(r) => r,
        other => panic!("expected Relation, got {other:?}"),
    }
}
fn insert(m: &LogicalMessage) -> &Insert {
    match m {
        LogicalMessage::Insert(i) => i,
        other => panic!("expected Insert, got {other:?}"),
    }
}
fn update(m: &LogicalMessage) -> &Update {
    match m {
        LogicalMessage::Update(u) => u,
        other => panic!("expected Update, got {other:?}"),
    }
}
fn delete(m: &LogicalMessage) -> &Delete {
    match m {
        LogicalMessage::Delete(d) => d,
        other => panic!("expected Delete, got {other:?}"),
    }
}
fn truncate(m: &LogicalMessage) -> &Truncate {
    match m {
        LogicalMessage::Truncate(t) => t,
        other => panic!("expected Truncate, got {other:?}"),
    }
}
fn message(m: &LogicalMessage) -> &LogicalDecodingMessage {
    match m {
        LogicalMessage::Message(x) => x,
        other => panic!("expected Message, got {other:?}"),
    }
}

/// Transaction framing holds for every captured stream: Begin/Commit pair up,
/// the Begin announces the Commit's LSN, end_lsn lies past commit_lsn, and
/// transactions arrive in LSN order.
fn check_transaction_framing(rows: &[(Captured, LogicalMessage)]) -> usize {
    let mut open: Option<&Begin> = None;
    let mut last_end = 0u64;
    let mut transactions = 0;
    for (row, m) in rows {
        match m {
            LogicalMessage::Begin(b) => {
                assert!(open.is_none(), "nested Begin at {:#x}", row.lsn);
                assert_eq!(b.xid, row.xid, "Begin xid matches the slot's xid column");
                assert!(b.final_lsn > last_end, "transactions arrive in LSN order");
                open = Some(b);
            }
            LogicalMessage::Commit(c) => {
                let b = open.take().expect("Commit without Begin");
                assert_eq!(c.flags, 0);
                assert_eq!(
                    c.commit_lsn, b.final_lsn,
                    "Begin.final_lsn is the commit LSN"
                );
                assert!(c.end_lsn > c.commit_lsn);
                assert_eq!(
                    c.end_lsn, row.lsn,
                    "the slot reports a commit at its end LSN"
                );
                assert_eq!(c.commit_time, b.commit_time);
                last_end = c.end_lsn;
                transactions += 1;
            }
            LogicalMessage::Message(msg) if !msg.transactional => {
                assert!(
                    open.is_none(),
                    "non-transactional message inside a transaction"
                );
                assert_eq!(row.xid, 0);
            }
            _ => {
                let b = open.expect("change outside a transaction");
                assert_eq!(row.xid, b.xid);
            }
        }
    }
    assert!(open.is_none(), "unterminated transaction");
    transactions
}

#[test]
fn text_fixture_transaction_framing() {
    let rows = decode_all(PROTO1_TEXT);
    assert_eq!(rows.len(), 30);
    assert_eq!(check_transaction_framing(&rows), 7);
}

#[test]
fn text_fixture_type_relation_and_insert_with_null_and_enum() {
    let rows = decode_all(PROTO1_TEXT);
    let m: Vec<&LogicalMessage> = rows.iter().map(|(_, m)| m).collect();

    // The enum's Type message precedes the Relation that uses it.
    let LogicalMessage::Type(ty) = m[1] else {
        panic!("expected Type, got {:?}", m[1]);
    };
    assert_eq!(ty.id, STATUS_ENUM_OID);
    assert_eq!(ty.namespace, "public");
    assert_eq!(ty.name, "outbox_status");

    let rel = relation(m[2]);
    assert_eq!(rel.id, OUTBOX_OID);
    assert_eq!(
        (rel.namespace.as_str(), rel.name.as_str()),
        ("public", "outbox")
    );
    assert_eq!(rel.replica_identity, b'd');
    let cols: Vec<(&str, u32, bool)> = rel
        .columns
        .iter()
        .map(|c| (c.name.as_str(), c.type_oid, c.is_key()))
        .collect();
    assert_eq!(
        cols,
        [
            ("id", 20, true), // int8, the primary key
            ("aggregate", 25, false),
            ("payload", 3802, false), // jsonb
            ("note", 25, false),
            ("status", STATUS_ENUM_OID, false),
            ("big", 25, false),
        ]
    );
    assert!(rel.columns.iter().all(|c| c.type_modifier == -1));
    assert_eq!(rel.column_index("status"), Some(4));
    assert_eq!(rel.column_index("missing"), None);

    let ins = insert(m[3]);
    assert_eq!(ins.relation_id, rel.id);
    assert_eq!(
        texts(&ins.new),
        [
            Some("1"),
            Some("order"),
            Some("{\"a\": 1}"),
            None,
            Some("pending"),
            None
        ]
    );
}

#[test]
fn text_fixture_replica_identity_full_uses_old_tuples() {
    let rows = decode_all(PROTO1_TEXT);
    let m: Vec<&LogicalMessage> = rows.iter().map(|(_, m)| m).collect();

    let rel = relation(m[6]);
    assert_eq!((rel.id, rel.name.as_str()), (AUDIT_OID, "audit"));
    assert_eq!(rel.replica_identity, b'f');
    // With REPLICA IDENTITY FULL every column is flagged as part of the key.
    assert!(rel.columns.iter().all(|c| c.is_key()));
    assert_eq!(rel.columns[1].name, "v");
    assert_eq!(rel.columns[1].type_oid, 1043); // varchar
    assert_eq!(rel.columns[1].type_modifier, 20 + 4); // varchar(20): n + VARHDRSZ

    assert_eq!(texts(&insert(m[7]).new), [Some("7"), Some("seven")]);

    let up = update(m[8]);
    assert_eq!(up.relation_id, AUDIT_OID);
    assert!(up.key.is_none());
    assert_eq!(texts(up.old.as_ref().unwrap()), [Some("7"), Some("seven")]);
    assert_eq!(texts(&up.new), [Some("7"), Some("SEVEN")]);

    let del = delete(m[9]);
    assert!(del.key.is_none());
    assert_eq!(texts(del.old.as_ref().unwrap()), [Some("7"), Some("SEVEN")]);
}

#[test]
fn text_fixture_unchanged_toast_and_key_change() {
    let rows = decode_all(PROTO1_TEXT);
    let m: Vec<&LogicalMessage> = rows.iter().map(|(_, m)| m).collect();

    // UPDATE that left the 10 kB out-of-line `big` column alone: no old
    // tuple (key unchanged, default identity) and 'u' for `big`.
    let up = update(m[12]);
    assert_eq!(up.relation_id, OUTBOX_OID);
    assert!(up.key.is_none() && up.old.is_none());
    assert_eq!(up.new.columns.len(), 6);
    assert_eq!(up.new.columns[5], ColumnValue::UnchangedToast);
    assert_eq!(up.new.columns[5].as_text(), None);
    assert_eq!(text(&up.new.columns[0]), "100");
    assert_eq!(text(&up.new.columns[3]), "touched");
    assert_eq!(text(&up.new.columns[4]), "sent");

    // UPDATE of the primary key: the 'K' tuple has every column, only the
    // key ones non-null.
    let up = update(m[15]);
    assert!(up.old.is_none());
    assert_eq!(
        texts(up.key.as_ref().unwrap()),
        [Some("1"), None, None, None, None, None]
    );
    assert_eq!(text(&up.new.columns[0]), "2");

    let del = delete(m[18]);
    assert_eq!(del.relation_id, OUTBOX_OID);
    assert!(del.old.is_none());
    assert_eq!(
        texts(del.key.as_ref().unwrap()),
        [Some("2"), None, None, None, None, None]
    );
}

#[test]
fn text_fixture_logical_messages_and_truncate() {
    let rows = decode_all(PROTO1_TEXT);

    let (row, m) = &rows[21];
    let msg = message(m);
    assert!(msg.transactional);
    assert_eq!(msg.prefix, "p");
    assert_eq!(msg.content, Bytes::from_static(b"hello"));
    // pg_logical_emit_message returned 0/15427D8 for this message.
    assert_eq!(msg.lsn, 0x0154_27D8);
    assert_eq!(msg.lsn, row.lsn);
    let commit_lsn = commit(&rows[22].1).commit_lsn;
    assert!(msg.lsn <= commit_lsn);

    let (row, m) = &rows[23];
    let msg = message(m);
    assert!(!msg.transactional);
    assert_eq!(msg.prefix, "outboxd");
    assert_eq!(msg.content, Bytes::from_static(&[0x00, 0xff]));
    assert_eq!((msg.lsn, row.xid), (0x0154_2848, 0));

    // TRUNCATE invalidates the relcache entries, so Type and both Relations
    // are sent again before the Truncate itself.
    assert!(matches!(rows[25].1, LogicalMessage::Type(_)));
    assert_eq!(relation(&rows[26].1).id, OUTBOX_OID);
    assert_eq!(relation(&rows[27].1).id, AUDIT_OID);
    let t = truncate(&rows[28].1);
    assert_eq!(t.options, Truncate::CASCADE | Truncate::RESTART_IDENTITY);
    assert_eq!(t.relation_ids, [OUTBOX_OID, AUDIT_OID]);
}

#[test]
fn binary_fixture_has_binary_columns() {
    let rows = decode_all(PROTO1_BINARY);
    assert_eq!(check_transaction_framing(&rows), 7);
    let ins = insert(&rows[3].1);
    let c = &ins.new.columns;
    assert_eq!(
        c[0],
        ColumnValue::Binary(Bytes::copy_from_slice(&1i64.to_be_bytes()))
    );
    assert_eq!(c[0].as_text(), None);
    assert_eq!(c[1], ColumnValue::Binary(Bytes::from_static(b"order")));
    // jsonb's binary format is a version byte (1) followed by the text.
    assert_eq!(
        c[2],
        ColumnValue::Binary(Bytes::from_static(b"\x01{\"a\": 1}"))
    );
    assert_eq!(c[3], ColumnValue::Null);
    assert_eq!(c[4], ColumnValue::Binary(Bytes::from_static(b"pending")));

    let up = update(&rows[12].1);
    assert_eq!(up.new.columns[5], ColumnValue::UnchangedToast);
    assert_eq!(
        up.new.columns[0],
        ColumnValue::Binary(Bytes::copy_from_slice(&100i64.to_be_bytes()))
    );
    // Only the tuple encoding changes with `binary 'true'`.
    let text_rows = decode_all(PROTO1_TEXT);
    for (i, ((_, b), (_, t))) in rows.iter().zip(&text_rows).enumerate() {
        let has_tuple = matches!(
            t,
            LogicalMessage::Insert(_) | LogicalMessage::Update(_) | LogicalMessage::Delete(_)
        );
        if !has_tuple {
            assert_eq!(b, t, "row {i}");
        }
    }
}

#[test]
fn origin_fixture() {
    let rows = decode_all(PROTO1_ORIGIN);
    assert_eq!(check_transaction_framing(&rows), 1);
    let b = begin(&rows[0].1);
    let LogicalMessage::Origin(origin) = &rows[1].1 else {
        panic!("expected Origin right after Begin, got {:?}", rows[1].1);
    };
    assert_eq!(origin.name, "upstream_a");
    // The origin's LSN as passed to pg_replication_origin_xact_setup, not a local one.
    assert_eq!(origin.commit_lsn, 0xABCD_EF01);
    // ... and the origin's timestamp, 2024-01-02 03:04:05 UTC, in microseconds
    // since 2000-01-01, replaces the local commit time.
    let expected_time = ((8767 * 86_400) + 3 * 3600 + 4 * 60 + 5) * 1_000_000i64;
    assert_eq!(b.commit_time, expected_time);
    assert_eq!(commit(&rows[4].1).commit_time, expected_time);
    assert_eq!(
        texts(&insert(&rows[3].1).new),
        [Some("42"), Some("from-origin")]
    );
}

#[test]
fn stream_messages_are_unsupported() {
    let rows = parse_fixture(PROTO2_STREAM);
    let mut tags = Vec::new();
    for row in &rows {
        let tag = row.data[0];
        match decode(row.data.clone()) {
            Err(e @ DecodeError::Unsupported { .. }) => {
                assert_eq!(e, DecodeError::Unsupported { tag });
                assert!(e.to_string().contains("protocol version 2"), "{e}");
                tags.push(tag);
            }
            // In protocol v2 changes inside a streamed transaction carry an
            // xid after the tag, so read as v1 messages they are garbage
            // that must still fail cleanly.
            Err(e) => assert!(matches!(tag, b'R' | b'I'), "{e}"),
            Ok(m) => panic!("streamed message decoded as {m:?}"),
        }
    }
    assert_eq!(tags, b"SEScA");
    let e = decode(rows[0].data.clone()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "pgoutput message tag 'S' (Stream Start) at offset 0 requires protocol version 2 \
         or later; only proto_version 1 is supported"
    );
}

#[test]
fn column_values_are_slices_of_the_input() {
    let rows = parse_fixture(PROTO1_TEXT);
    let data = rows[3].data.clone();
    let range = data.as_ptr_range();
    let ins = match decode(data.clone()).unwrap() {
        LogicalMessage::Insert(i) => i,
        other => panic!("{other:?}"),
    };
    for c in &ins.new.columns {
        if let ColumnValue::Text(b) = c {
            assert!(
                range.contains(&b.as_ptr()),
                "value copied out of the buffer"
            );
        }
    }
}

#[test]
fn every_strict_prefix_of_a_captured_message_is_an_error() {
    let mut checked = 0;
    for row in all_proto1() {
        for n in 0..row.data.len() {
            let err = decode(row.data.slice(..n)).expect_err("prefix decoded");
            assert!(
                matches!(
                    err,
                    DecodeError::Empty
                        | DecodeError::Truncated { .. }
                        | DecodeError::UnterminatedString { .. }
                ),
                "prefix of length {n} of {:?}: {err}",
                row.data
            );
            assert!(err.offset() <= n, "{err} for a {n}-byte prefix");
            checked += 1;
        }
    }
    assert!(checked > 1000);
}

#[test]
fn trailing_bytes_after_a_captured_message_are_an_error() {
    for row in all_proto1() {
        let mut longer = row.data.to_vec();
        longer.push(0);
        assert_eq!(
            decode(Bytes::from(longer)).unwrap_err(),
            DecodeError::TrailingBytes {
                message: match row.data[0] {
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
                    t => panic!("unexpected tag {t}"),
                },
                offset: row.data.len(),
                count: 1,
            }
        );
    }
}
