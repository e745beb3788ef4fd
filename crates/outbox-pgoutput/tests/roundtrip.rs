//! Property tests: an independent encoder (written from the protocol
//! description, not from the decoder) round-trips through `decode`, and
//! `decode` survives arbitrary, truncated and mutated input.

mod common;

use bytes::{BufMut, Bytes, BytesMut};
use outbox_pgoutput::{
    decode, Begin, ColumnValue, Commit, DecodeError, Delete, Insert, LogicalDecodingMessage,
    LogicalMessage, Origin, Relation, RelationColumn, Truncate, TupleData, TypeMessage, Update,
};
use proptest::prelude::*;

// ---------------------------------------------------------------- encoder

fn put_cstr(out: &mut BytesMut, s: &str) {
    out.put_slice(s.as_bytes());
    out.put_u8(0);
}

fn put_tuple(out: &mut BytesMut, t: &TupleData) {
    out.put_u16(t.columns.len().try_into().unwrap());
    for c in &t.columns {
        match c {
            ColumnValue::Null => out.put_u8(b'n'),
            ColumnValue::UnchangedToast => out.put_u8(b'u'),
            ColumnValue::Text(b) | ColumnValue::Binary(b) => {
                out.put_u8(if matches!(c, ColumnValue::Text(_)) {
                    b't'
                } else {
                    b'b'
                });
                out.put_i32(b.len().try_into().unwrap());
                out.put_slice(b);
            }
        }
    }
}

fn encode(m: &LogicalMessage) -> Bytes {
    let mut out = BytesMut::new();
    match m {
        LogicalMessage::Begin(b) => {
            out.put_u8(b'B');
            out.put_u64(b.final_lsn);
            out.put_i64(b.commit_time);
            out.put_u32(b.xid);
        }
        LogicalMessage::Commit(c) => {
            out.put_u8(b'C');
            out.put_u8(c.flags);
            out.put_u64(c.commit_lsn);
            out.put_u64(c.end_lsn);
            out.put_i64(c.commit_time);
        }
        LogicalMessage::Origin(o) => {
            out.put_u8(b'O');
            out.put_u64(o.commit_lsn);
            put_cstr(&mut out, &o.name);
        }
        LogicalMessage::Relation(r) => {
            out.put_u8(b'R');
            out.put_u32(r.id);
            put_cstr(&mut out, &r.namespace);
            put_cstr(&mut out, &r.name);
            out.put_u8(r.replica_identity);
            out.put_u16(r.columns.len().try_into().unwrap());
            for c in &r.columns {
                out.put_u8(c.flags);
                put_cstr(&mut out, &c.name);
                out.put_u32(c.type_oid);
                out.put_i32(c.type_modifier);
            }
        }
        LogicalMessage::Type(t) => {
            out.put_u8(b'Y');
            out.put_u32(t.id);
            put_cstr(&mut out, &t.namespace);
            put_cstr(&mut out, &t.name);
        }
        LogicalMessage::Insert(i) => {
            out.put_u8(b'I');
            out.put_u32(i.relation_id);
            out.put_u8(b'N');
            put_tuple(&mut out, &i.new);
        }
        LogicalMessage::Update(u) => {
            out.put_u8(b'U');
            out.put_u32(u.relation_id);
            if let Some(k) = &u.key {
                out.put_u8(b'K');
                put_tuple(&mut out, k);
            }
            if let Some(o) = &u.old {
                out.put_u8(b'O');
                put_tuple(&mut out, o);
            }
            out.put_u8(b'N');
            put_tuple(&mut out, &u.new);
        }
        LogicalMessage::Delete(d) => {
            out.put_u8(b'D');
            out.put_u32(d.relation_id);
            if let Some(k) = &d.key {
                out.put_u8(b'K');
                put_tuple(&mut out, k);
            }
            if let Some(o) = &d.old {
                out.put_u8(b'O');
                put_tuple(&mut out, o);
            }
        }
        LogicalMessage::Truncate(t) => {
            out.put_u8(b'T');
            out.put_u32(t.relation_ids.len().try_into().unwrap());
            out.put_u8(t.options);
            for id in &t.relation_ids {
                out.put_u32(*id);
            }
        }
        LogicalMessage::Message(m) => {
            out.put_u8(b'M');
            out.put_u8(u8::from(m.transactional));
            out.put_u64(m.lsn);
            put_cstr(&mut out, &m.prefix);
            out.put_i32(m.content.len().try_into().unwrap());
            out.put_slice(&m.content);
        }
    }
    out.freeze()
}

// ------------------------------------------------------------- strategies

/// Protocol strings: any UTF-8 without NUL (the terminator).
fn name() -> impl Strategy<Value = String> {
    "[^\\x00]{0,12}"
}

fn bytes(max: usize) -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

fn column_value() -> impl Strategy<Value = ColumnValue> {
    prop_oneof![
        Just(ColumnValue::Null),
        Just(ColumnValue::UnchangedToast),
        bytes(24).prop_map(ColumnValue::Text),
        bytes(24).prop_map(ColumnValue::Binary),
    ]
}

fn tuple() -> impl Strategy<Value = TupleData> {
    prop::collection::vec(column_value(), 0..8).prop_map(|columns| TupleData { columns })
}

fn begin() -> impl Strategy<Value = LogicalMessage> {
    (any::<u64>(), any::<i64>(), any::<u32>()).prop_map(|(final_lsn, commit_time, xid)| {
        LogicalMessage::Begin(Begin {
            final_lsn,
            commit_time,
            xid,
        })
    })
}

fn commit() -> impl Strategy<Value = LogicalMessage> {
    (any::<u8>(), any::<u64>(), any::<u64>(), any::<i64>()).prop_map(
        |(flags, commit_lsn, end_lsn, commit_time)| {
            LogicalMessage::Commit(Commit {
                flags,
                commit_lsn,
                end_lsn,
                commit_time,
            })
        },
    )
}

fn relation() -> impl Strategy<Value = LogicalMessage> {
    let column = (any::<u8>(), name(), any::<u32>(), any::<i32>()).prop_map(
        |(flags, name, type_oid, type_modifier)| RelationColumn {
            flags,
            name,
            type_oid,
            type_modifier,
        },
    );
    (
        any::<u32>(),
        name(),
        name(),
        prop::sample::select(b"dnfi".to_vec()),
        prop::collection::vec(column, 0..8),
    )
        .prop_map(|(id, namespace, name, replica_identity, columns)| {
            LogicalMessage::Relation(Relation {
                id,
                namespace,
                name,
                replica_identity,
                columns,
            })
        })
}

/// Old-row image of an Update: none, a key, or a full old row (never both,
/// as PostgreSQL never sends both).
fn old_image() -> impl Strategy<Value = (Option<TupleData>, Option<TupleData>)> {
    prop_oneof![
        Just((None, None)),
        tuple().prop_map(|t| (Some(t), None)),
        tuple().prop_map(|t| (None, Some(t))),
    ]
}

fn logical_message() -> impl Strategy<Value = LogicalMessage> {
    prop_oneof![
        begin(),
        commit(),
        (any::<u64>(), name())
            .prop_map(|(commit_lsn, name)| LogicalMessage::Origin(Origin { commit_lsn, name })),
        relation(),
        (any::<u32>(), name(), name()).prop_map(|(id, namespace, name)| {
            LogicalMessage::Type(TypeMessage {
                id,
                namespace,
                name,
            })
        }),
        (any::<u32>(), tuple())
            .prop_map(|(relation_id, new)| LogicalMessage::Insert(Insert { relation_id, new })),
        (any::<u32>(), old_image(), tuple()).prop_map(|(relation_id, (key, old), new)| {
            LogicalMessage::Update(Update {
                relation_id,
                key,
                old,
                new,
            })
        }),
        (
            any::<u32>(),
            old_image().prop_filter("Delete carries K or O", |(k, o)| {
                k.is_some() || o.is_some()
            })
        )
            .prop_map(|(relation_id, (key, old))| {
                LogicalMessage::Delete(Delete {
                    relation_id,
                    key,
                    old,
                })
            }),
        (any::<u8>(), prop::collection::vec(any::<u32>(), 0..8)).prop_map(
            |(options, relation_ids)| LogicalMessage::Truncate(Truncate {
                options,
                relation_ids
            })
        ),
        (any::<bool>(), any::<u64>(), name(), bytes(64)).prop_map(
            |(transactional, lsn, prefix, content)| {
                LogicalMessage::Message(LogicalDecodingMessage {
                    transactional,
                    lsn,
                    prefix,
                    content,
                })
            }
        ),
    ]
}

/// Tags of every message kind the decoder knows, plus the rejected v2/v3 ones,
/// so that random bodies reach the per-message parsers.
const TAGS: &[u8] = b"BCORYIUDTMSEcAbPKrp";

// ---------------------------------------------------------------- properties

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn encoded_messages_round_trip(m in logical_message()) {
        prop_assert_eq!(decode(encode(&m)), Ok(m));
    }

    #[test]
    fn strict_prefixes_of_encoded_messages_fail(m in logical_message(), cut in any::<prop::sample::Index>()) {
        let buf = encode(&m);
        let n = cut.index(buf.len());
        prop_assert!(decode(buf.slice(..n)).is_err());
    }

    #[test]
    fn trailing_bytes_fail(m in logical_message(), extra in prop::collection::vec(any::<u8>(), 1..8)) {
        let mut buf = encode(&m).to_vec();
        let len = buf.len();
        buf.extend_from_slice(&extra);
        let err = decode(Bytes::from(buf)).unwrap_err();
        prop_assert!(
            matches!(err, DecodeError::TrailingBytes { offset, count, .. } if offset == len && count == extra.len()),
            "{}", err
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic(buf in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode(Bytes::from(buf));
    }

    #[test]
    fn arbitrary_bodies_after_known_tags_never_panic(
        tag in prop::sample::select(TAGS),
        body in prop::collection::vec(any::<u8>(), 0..128),
    ) {
        let mut buf = vec![tag];
        buf.extend_from_slice(&body);
        if let Err(e) = decode(Bytes::from(buf.clone())) {
            // Errors point inside (or just past the end of) the input.
            prop_assert!(e.offset() <= buf.len(), "{}", e);
            prop_assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn mutated_captured_messages_never_panic(
        which in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        let rows = common::all_proto1();
        let mut buf = rows[which.index(rows.len())].data.to_vec();
        for (at, byte) in edits {
            let i = at.index(buf.len());
            buf[i] = byte;
        }
        let _ = decode(Bytes::from(buf));
    }

    #[test]
    fn strict_prefixes_of_captured_messages_fail(
        which in any::<prop::sample::Index>(),
        cut in any::<prop::sample::Index>(),
    ) {
        let rows = common::all_proto1();
        let data = &rows[which.index(rows.len())].data;
        let n = cut.index(data.len());
        prop_assert!(decode(data.slice(..n)).is_err());
    }
}

#[test]
fn encoder_matches_captured_bytes() {
    // The encoder is only trustworthy as an oracle if it reproduces what a
    // real server sends.
    for row in common::all_proto1() {
        let m = decode(row.data.clone()).unwrap();
        assert_eq!(encode(&m), row.data, "{m:?}");
    }
}
