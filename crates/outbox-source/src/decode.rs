//! The decode stage: pgoutput bytes in, outbox events and transaction boundaries out.
//!
//! Pure (no I/O): it keeps the relation cache that pgoutput requires (an Insert only names a
//! relation id; the columns were announced by an earlier Relation message) and maps the
//! outbox table's columns by *name*, so a column added to the table later does not shift
//! anything. A row that cannot be read as an envelope is reported, not dropped, so the
//! pipeline can quarantine it with the reason.
//!
//! It also keeps the route versions (migration 0031): a narrow row names the immutable route
//! version its destination is frozen to. The relay seeds the decoder with every version at
//! start ([`Decoder::know_route_versions`]); the publication carries `outbox.route_versions`,
//! so a version made later arrives in the stream before any row that references it (earlier
//! in WAL order, or earlier in the same transaction).

use std::collections::HashMap;

use bytes::Bytes;
use outbox_core::route::{policy_rules_from_json, PolicyGeneration, RouteVersion};
#[cfg(test)]
use outbox_core::{route::ROUTE_VERSION_COLUMNS, EVENT_COLUMNS};
use outbox_core::{Lsn, OutboxEvent, RouteVersions, RowError};
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
    /// A route policy generation (migration 0038): the decoder routes the rows after it that
    /// were written without a route by it; the relay core keeps it with its checkpoint.
    PolicyGeneration(i64),
    /// Anything the relay has no use for (relation/type announcements, other tables,
    /// logical messages such as our own heartbeats).
    Nothing,
}

/// A relation's column positions by name, looked up for every column of every row.
type Columns = HashMap<String, usize, foldhash::fast::RandomState>;

/// Stateful pgoutput decoder for one replication stream.
#[derive(Debug)]
pub struct Decoder {
    schema: String,
    table: String,
    relations: HashMap<u32, Relation>,
    /// Column name -> index, for the outbox table's current relation id.
    outbox_columns: HashMap<u32, Columns>,
    /// Column name -> index, for `outbox.route_versions`' current relation id.
    version_columns: HashMap<u32, Columns>,
    versions: RouteVersions,
    /// Column name -> index, for `outbox.policy_generations`' current relation id.
    policy_columns: HashMap<u32, Columns>,
    /// The route policy generation in force at the stream's position: seeded at start
    /// ([`Decoder::know_policy`]), then each one the stream delivers.
    policy: Option<PolicyGeneration>,
}

/// The table whose inserts are route versions.
const ROUTE_VERSIONS: (&str, &str) = ("outbox", "route_versions");

/// The table whose inserts are route policy generations.
const POLICY_GENERATIONS: (&str, &str) = ("outbox", "policy_generations");

impl Decoder {
    /// Decodes inserts into `schema.table`.
    pub fn new(schema: &str, table: &str) -> Self {
        Decoder {
            schema: schema.to_string(),
            table: table.to_string(),
            relations: HashMap::new(),
            outbox_columns: HashMap::new(),
            version_columns: HashMap::new(),
            versions: RouteVersions::new(),
            policy_columns: HashMap::new(),
            policy: None,
        }
    }

    /// The route policy generation in force where the stream starts (the one kept with the
    /// checkpoint, or the newest): rows written without a route are routed by it until the
    /// stream delivers the next.
    pub fn know_policy(&mut self, generation: PolicyGeneration) {
        self.policy = Some(generation);
    }

    /// The route policy generation in force at the position decoded last.
    pub fn policy(&self) -> Option<&PolicyGeneration> {
        self.policy.as_ref()
    }

    /// Adds route versions read from `outbox.route_versions` (at start, before streaming).
    pub fn know_route_versions(&mut self, versions: RouteVersions) {
        self.versions.extend(versions);
    }

    /// The route versions this decoder knows.
    pub fn route_versions(&self) -> &RouteVersions {
        &self.versions
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
                let cols = || {
                    r.columns
                        .iter()
                        .enumerate()
                        .map(|(i, c)| (c.name.clone(), i))
                        .collect()
                };
                self.outbox_columns.remove(&r.id);
                self.version_columns.remove(&r.id);
                self.policy_columns.remove(&r.id);
                if r.namespace == self.schema && r.name == self.table {
                    self.outbox_columns.insert(r.id, cols());
                } else if (r.namespace.as_str(), r.name.as_str()) == ROUTE_VERSIONS {
                    self.version_columns.insert(r.id, cols());
                } else if (r.namespace.as_str(), r.name.as_str()) == POLICY_GENERATIONS {
                    self.policy_columns.insert(r.id, cols());
                }
                self.relations.insert(r.id, r);
                Decoded::Nothing
            }
            LogicalMessage::Insert(ins) => {
                if let Some(cols) = self.version_columns.get(&ins.relation_id) {
                    let (id, version) = route_version_of(cols, &ins.new.columns)?;
                    self.versions.insert(id, version);
                    return Ok(Decoded::Nothing);
                }
                if let Some(cols) = self.policy_columns.get(&ins.relation_id) {
                    let generation = policy_generation_of(cols, &ins.new.columns)?;
                    let id = generation.id;
                    self.policy = Some(generation);
                    return Ok(Decoded::PolicyGeneration(id));
                }
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
                Decoded::Event(Box::new(OutboxEvent::from_text_columns(
                    get,
                    payload,
                    &self.versions,
                    self.policy.as_ref(),
                )))
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

/// A streamed row of `outbox.route_versions`. Malformed is a protocol error, not a
/// quarantine: the table's columns are NOT NULL and its rows are written by migration 0031's
/// trigger only, so a row that cannot be read means the stream is not what the relay expects.
fn route_version_of(
    cols: &Columns,
    values: &[ColumnValue],
) -> Result<(i64, RouteVersion), SourceError> {
    let text = |name: &str| -> Result<String, SourceError> {
        cols.get(name)
            .and_then(|i| values.get(*i))
            .and_then(ColumnValue::as_text)
            .map(str::to_string)
            .ok_or_else(|| {
                SourceError::Protocol(format!(
                    "a row of outbox.route_versions without a text {name} column"
                ))
            })
    };
    let int = |name: &str| -> Result<i64, SourceError> {
        let t = text(name)?;
        t.parse().map_err(|_| {
            SourceError::Protocol(format!(
                "outbox.route_versions.{name} {t:?} is not an integer"
            ))
        })
    };
    Ok((
        int("version_id")?,
        RouteVersion {
            kind: text("kind")?,
            cluster: text("cluster")?,
            topic_template: text("topic_template")?,
            partitioner: text("partitioner")?,
            route_generation: int("route_generation")?,
            serializer: text("serializer")?,
            acks: text("acks")?,
        },
    ))
}

/// A streamed row of `outbox.policy_generations`. Malformed is a protocol error, as for a
/// route version: its rows are written by migration 0038's trigger only, and a generation
/// the relay cannot read must not be guessed at.
fn policy_generation_of(
    cols: &Columns,
    values: &[ColumnValue],
) -> Result<PolicyGeneration, SourceError> {
    let text = |name: &str| -> Result<&str, SourceError> {
        cols.get(name)
            .and_then(|i| values.get(*i))
            .and_then(ColumnValue::as_text)
            .ok_or_else(|| {
                SourceError::Protocol(format!(
                    "a row of outbox.policy_generations without a text {name} column"
                ))
            })
    };
    let id = text("generation_id")?;
    let id: i64 = id.parse().map_err(|_| {
        SourceError::Protocol(format!(
            "outbox.policy_generations.generation_id {id:?} is not an integer"
        ))
    })?;
    let rules = policy_rules_from_json(text("rules")?)
        .map_err(|e| SourceError::Protocol(format!("outbox.policy_generations row {id}: {e}")))?;
    Ok(PolicyGeneration { id, rules })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cstr(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }

    /// A pgoutput Relation message (protocol 1) with text columns.
    fn relation(id: u32, namespace: &str, name: &str, cols: &[&str]) -> Bytes {
        let mut m = vec![b'R'];
        m.extend_from_slice(&id.to_be_bytes());
        cstr(&mut m, namespace);
        cstr(&mut m, name);
        m.push(b'd');
        m.extend_from_slice(&(cols.len() as i16).to_be_bytes());
        for c in cols {
            m.push(0);
            cstr(&mut m, c);
            m.extend_from_slice(&25u32.to_be_bytes());
            m.extend_from_slice(&(-1i32).to_be_bytes());
        }
        Bytes::from(m)
    }

    /// A pgoutput Insert message; `None` is SQL NULL.
    fn insert(id: u32, values: &[Option<&str>]) -> Bytes {
        let mut m = vec![b'I'];
        m.extend_from_slice(&id.to_be_bytes());
        m.push(b'N');
        m.extend_from_slice(&(values.len() as i16).to_be_bytes());
        for v in values {
            match v {
                None => m.push(b'n'),
                Some(t) => {
                    m.push(b't');
                    m.extend_from_slice(&(t.len() as i32).to_be_bytes());
                    m.extend_from_slice(t.as_bytes());
                }
            }
        }
        Bytes::from(m)
    }

    fn events_columns() -> Vec<&'static str> {
        EVENT_COLUMNS
            .iter()
            .copied()
            .chain(["route_version"])
            .collect()
    }

    /// A narrow row (migration 0031): the envelope, no dest_* column, a route version.
    fn narrow_row(version: &str) -> Bytes {
        let values: Vec<Option<&str>> = events_columns()
            .iter()
            .map(|c| match *c {
                "event_id" => Some("01a24513-7b9b-710d-9f45-3e95dea81d26"),
                "envelope_generation" | "aggregate_version" => Some("1"),
                "aggregate_type" => Some("Pay"),
                "aggregate_id" => Some("../../admin"),
                "event_type" => Some("Paid"),
                "payload" => Some("{}"),
                "occurred_at" => Some("2026-12-05 07:00:00+00"),
                "route_version" => Some(version),
                _ => None,
            })
            .collect();
        insert(1, &values)
    }

    /// A decoder that has been told the relations of the outbox table (id 1), the route
    /// versions (2) and the policy generations (3).
    fn decoder() -> Decoder {
        let mut d = Decoder::new("outbox", "events");
        for m in [
            relation(1, "outbox", "events", &events_columns()),
            relation(2, "outbox", "route_versions", ROUTE_VERSION_COLUMNS),
            relation(
                3,
                "outbox",
                "policy_generations",
                &["generation_id", "rules", "created_at"],
            ),
        ] {
            assert_eq!(d.decode(m).unwrap(), Decoded::Nothing);
        }
        d
    }

    fn event(d: Decoded) -> Result<OutboxEvent, RowError> {
        match d {
            Decoded::Event(e) => *e,
            other => panic!("expected an event, got {other:?}"),
        }
    }

    #[test]
    fn a_narrow_row_renders_from_a_streamed_version_and_an_unknown_one_is_never_guessed() {
        let mut d = decoder();
        let err = event(d.decode(narrow_row("7")).unwrap()).unwrap_err();
        assert_eq!(err.column, "route_version", "{err}");
        assert!(err.problem.contains("route version 7"), "{err}");

        let version = [
            Some("7"),
            Some("http"),
            Some("hooks"),
            Some("https://h/pay/{aggregate_id}"),
            Some("none"),
            Some("3"),
            Some("json"),
            Some("all"),
        ];
        assert_eq!(d.decode(insert(2, &version)).unwrap(), Decoded::Nothing);
        let ev = event(d.decode(narrow_row("7")).unwrap()).unwrap();
        assert_eq!(ev.destination.topic, "https://h/pay/..%2F..%2Fadmin");
        assert_eq!(ev.destination.key, "../../admin");
        assert_eq!(ev.destination.route_generation, 3);
        assert_eq!(ev.destination_digest, ev.destination.digest());
        assert_eq!(ev.verify(), Ok(()));

        // Seeded at start instead of streamed: the same destination.
        let mut seeded = Decoder::new("outbox", "events");
        seeded.know_route_versions(d.route_versions().clone());
        seeded
            .decode(relation(1, "outbox", "events", &events_columns()))
            .unwrap();
        assert_eq!(event(seeded.decode(narrow_row("7")).unwrap()).unwrap(), ev);
    }

    /// The writer's plain INSERT (docs/versions_by_relay.md): a row without a version or a
    /// route is marked for the relay's numbering and routed by the policy generation in force
    /// at its position: none known is an error naming the column, never a guess; a streamed
    /// generation replaces the seeded one for the rows after it.
    #[test]
    fn a_plain_row_is_routed_by_the_policy_generation_in_force() {
        let plain = || {
            let values: Vec<Option<&str>> = events_columns()
                .iter()
                .map(|c| match *c {
                    "event_id" => Some("01a24513-7b9b-710d-9f45-3e95dea81d26"),
                    "envelope_generation" => Some("1"),
                    "aggregate_type" => Some("order"),
                    "aggregate_id" => Some("o-1"),
                    "event_type" => Some("placed"),
                    "payload" => Some("{}"),
                    "occurred_at" => Some("2026-12-05 07:00:00+00"),
                    _ => None,
                })
                .collect();
            insert(1, &values)
        };
        let version = |id: &'static str, topic: &'static str| {
            insert(
                2,
                &[
                    Some(id),
                    Some("kafka"),
                    Some("default"),
                    Some(topic),
                    Some("murmur2_random"),
                    Some("1"),
                    Some("json"),
                    Some("all"),
                ],
            )
        };
        let mut d = decoder();
        let err = event(d.decode(plain()).unwrap()).unwrap_err();
        assert_eq!(err.column, "route_version", "{err}");

        d.decode(version("0", "outbox.event.{aggregate_type}"))
            .unwrap();
        d.decode(version("5", "orders.{aggregate_id}")).unwrap();
        d.know_policy(PolicyGeneration {
            id: 1,
            rules: Vec::new(),
        });
        let ev = event(d.decode(plain()).unwrap()).unwrap();
        assert_eq!(
            (ev.version_by_relay, ev.aggregate_version),
            (true, 0),
            "numbered by the relay core, not here"
        );
        assert_eq!(
            ev.destination.topic, "outbox.event.order",
            "no rule: the default"
        );

        let rules = r#"[{"aggregate_type": "order", "event_type": null, "priority": 0,
                          "generation": 9, "route_version": 5}]"#;
        assert_eq!(
            d.decode(insert(3, &[Some("2"), Some(rules), Some("2026-12-05")]))
                .unwrap(),
            Decoded::PolicyGeneration(2)
        );
        let ev = event(d.decode(plain()).unwrap()).unwrap();
        assert_eq!(
            ev.destination.topic, "orders.o-1",
            "the streamed generation"
        );
        assert_eq!(ev.destination_digest, ev.destination.digest());
        assert_eq!(d.policy().map(|p| p.id), Some(2));
    }
}
