//! Loading of the captured fixtures in `tests/fixtures/` (see the header of
//! each `.hex` file and `capture.sql` for how they were produced).

#![allow(dead_code)] // each test binary uses a different subset

use bytes::Bytes;

/// One row of `pg_logical_slot_peek_binary_changes` output.
#[derive(Debug, Clone)]
pub struct Captured {
    /// The row's `lsn` column.
    pub lsn: u64,
    /// The row's `xid` column (0 for non-transactional messages).
    pub xid: u32,
    /// The `data` column: one pgoutput message.
    pub data: Bytes,
}

pub const PROTO1_TEXT: &str = include_str!("../fixtures/pg15_proto1_text.hex");
pub const PROTO1_BINARY: &str = include_str!("../fixtures/pg15_proto1_binary.hex");
pub const PROTO1_ORIGIN: &str = include_str!("../fixtures/pg15_proto1_origin.hex");
pub const PROTO2_STREAM: &str = include_str!("../fixtures/pg15_proto2_stream.hex");

/// Every proto_version 1 message captured (the stream fixture is excluded:
/// those messages are meant to be rejected).
pub fn all_proto1() -> &'static [Captured] {
    static ALL: std::sync::OnceLock<Vec<Captured>> = std::sync::OnceLock::new();
    ALL.get_or_init(|| {
        [PROTO1_TEXT, PROTO1_BINARY, PROTO1_ORIGIN]
            .iter()
            .flat_map(|f| parse_fixture(f))
            .collect()
    })
}

pub fn parse_fixture(text: &str) -> Vec<Captured> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|line| {
            let mut fields = line.split_whitespace();
            let (Some(lsn), Some(xid), Some(hex), None) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                panic!("malformed fixture line: {line}");
            };
            Captured {
                lsn: parse_lsn(lsn),
                xid: xid.parse().expect("xid"),
                data: Bytes::from(unhex(hex)),
            }
        })
        .collect()
}

/// Parses PostgreSQL's `XXXXXXXX/XXXXXXXX` LSN notation.
pub fn parse_lsn(s: &str) -> u64 {
    let (hi, lo) = s.split_once('/').expect("LSN has a '/'");
    (u64::from_str_radix(hi, 16).expect("LSN high") << 32)
        | u64::from_str_radix(lo, 16).expect("LSN low")
}

pub fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len() % 2 == 0, "odd-length hex");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
}
