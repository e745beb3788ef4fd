//! The decode stage: pgoutput bytes in, outbox events and transaction boundaries out.
//!
//! Pure (no I/O): it keeps the relation cache that pgoutput requires (an Insert only names a
//! relation id; the columns were announced by an earlier Relation message) and maps the
//! outbox table's columns by *name*, so a column added to the table later does not shift
//! anything. A row that cannot be read as an envelope is reported, not dropped, so the
//! pipeline can quarantine it with the reason.

use std::collections::HashMap;

use bytes::Bytes;
use outbox_core::{Lsn, OutboxEvent, RowError};
use outbox_pgoutput::{ColumnValue, LogicalMessage, Relation};

use crate::slot::SourceError;

/// What one pgoutput message means to the relay.
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded {
    /// A transaction starts; `commit_lsn` is the LSN of its commit record (pgoutput sends it
    /// up front as `final_lsn`).
    Begin {
        commit_lsn: Lsn,
        xid: u32,
        /// Commit timestamp, microseconds since 2000-01-01 UTC (the PostgreSQL epoch).
        commit_time: i64,
    },
    /// An insert into the outbox table; `Err` when the row is not a readable envelope.
    Event(Box<Result<OutboxEvent, RowError>>),
    /// The transaction ended; `end_lsn` is the position to confirm once all its events are
    /// resolved.
    Commit { commit_lsn: Lsn, end_lsn: Lsn },
    /// Anything the relay has no use for (relation/type announcements, other tables,
    /// logical messages such as our own heartbeats).
    Nothing,
}

/// Stateful pgoutput decoder for one replication stream.
#[derive(Debug)]
pub struct Decoder {
    schema: String,
    table: String,
    relations: HashMap<u32, Relation>,
    /// Column name -> index, for the outbox table's current relation id.
    outbox_columns: HashMap<u32, HashMap<String, usize>>,
}

impl Decoder {
    /// Decodes inserts into `schema.table`.
    pub fn new(schema: &str, table: &str) -> Self {
        Decoder {
            schema: schema.to_string(),
            table: table.to_string(),
            relations: HashMap::new(),
            outbox_columns: HashMap::new(),
        }
    }

    /// Decodes one XLogData payload.
    pub fn decode(&mut self, data: Bytes) -> Result<Decoded, SourceError> {
        let msg = outbox_pgoutput::decode(data).map_err(SourceError::Decode)?;
        Ok(match msg {
            LogicalMessage::Begin(b) => Decoded::Begin {
                commit_lsn: Lsn(b.final_lsn),
                xid: b.xid,
                commit_time: b.commit_time,
            },
            LogicalMessage::Commit(c) => Decoded::Commit {
                commit_lsn: Lsn(c.commit_lsn),
                end_lsn: Lsn(c.end_lsn),
            },
            LogicalMessage::Relation(r) => {
                if r.namespace == self.schema && r.name == self.table {
                    let cols = r
                        .columns
                        .iter()
                        .enumerate()
                        .map(|(i, c)| (c.name.clone(), i))
                        .collect();
                    self.outbox_columns.insert(r.id, cols);
                } else {
                    self.outbox_columns.remove(&r.id);
                }
                self.relations.insert(r.id, r);
                Decoded::Nothing
            }
            LogicalMessage::Insert(ins) => {
                let Some(cols) = self.outbox_columns.get(&ins.relation_id) else {
                    if !self.relations.contains_key(&ins.relation_id) {
                        return Err(SourceError::Protocol(format!(
                            "Insert for relation id {} that was never announced by a Relation message",
                            ins.relation_id
                        )));
                    }
                    return Ok(Decoded::Nothing);
                };
                let values = &ins.new.columns;
                let get = |name: &str| -> Result<Option<&str>, RowError> {
                    let idx = cols.get(name).ok_or_else(|| RowError {
                        column: name.to_string(),
                        problem: "is not a column of the outbox table (migrations not applied?)"
                            .into(),
                    })?;
                    match values.get(*idx) {
                        None | Some(ColumnValue::Null) => Ok(None),
                        Some(ColumnValue::Text(_)) => {
                            values[*idx].as_text().map(Some).ok_or_else(|| RowError {
                                column: name.to_string(),
                                problem: "is not valid UTF-8".into(),
                            })
                        }
                        Some(ColumnValue::UnchangedToast) => Err(RowError {
                            column: name.to_string(),
                            problem:
                                "arrived as an unchanged TOAST pointer, which an insert never has"
                                    .into(),
                        }),
                        Some(ColumnValue::Binary(_)) => Err(RowError {
                            column: name.to_string(),
                            problem: "arrived in binary format; the relay requests text".into(),
                        }),
                    }
                };
                // The payload is handed on as a zero-copy slice of the received buffer.
                let payload = cols.get("payload").and_then(|i| match values.get(*i) {
                    Some(ColumnValue::Text(b)) => Some(b.clone()),
                    _ => None,
                });
                Decoded::Event(Box::new(OutboxEvent::from_text_columns(get, payload)))
            }
            LogicalMessage::Origin(_)
            | LogicalMessage::Type(_)
            | LogicalMessage::Update(_)
            | LogicalMessage::Delete(_)
            | LogicalMessage::Truncate(_)
            | LogicalMessage::Message(_) => Decoded::Nothing,
        })
    }
}
