//! `outboxEnvelope.v1` and `destination.v1`: what an event *is*, frozen at enqueue.
//!
//! The relay computes both digests here from the row it decoded, before it sends anything,
//! and the receipt carries them (a digest is the proof that what reaches the broker is what
//! the business transaction committed). Since migration 0027 `outbox.enqueue` stores none:
//! the row is immutable (UPDATE refused), so the committed row the relay decoded is the row in
//! the table. A row that does store digests (written by `outbox.enqueue_set`, a capture
//! trigger, an earlier version, or by hand) must match them: a mismatch means the row was
//! written wrong, and the event is quarantined with the reason instead of being published.
//!
//! The canonical form of `destination.v1` is a fixed, line-oriented text so that SQL
//! (`outbox.destination_digest(...)` in `migrations/`) and Rust produce byte-identical input
//! to SHA-256. Changing it is a new envelope generation, never an edit.

use bytes::Bytes;
use uuid::Uuid;

pub use crate::destination::{sha256_digest, Destination, DIGEST_PREFIX};
use crate::route::RouteVersions;

/// The prefix every digest carries, so the algorithm is part of the value.
/// The envelope generation `outbox.enqueue` writes. Each explicit destination migration makes
/// a new generation of the same event (same id, payload and digest; new destination).
pub const ENVELOPE_GENERATION: i32 = 1;

/// How the ledger stores a digest (`outbox.digest_bytes`, migration 0030): `sha256:<64
/// lowercase hex>` as its 32 bytes; any other text as 0x00, its UTF-8 bytes, and one more 0x00
/// where that would make 32 bytes, so 32 bytes always mean sha256 and
/// `outbox.digest_text` gives the text back unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDigest<'a> {
    Sha256([u8; 32]),
    Other(&'a str),
}

impl<'a> StoredDigest<'a> {
    pub fn of(digest: &'a str) -> Self {
        if let Some(raw) = digest
            .strip_prefix(DIGEST_PREFIX)
            .and_then(lowercase_sha256_hex)
        {
            return StoredDigest::Sha256(raw);
        }
        StoredDigest::Other(digest)
    }

    /// Appends the stored bytes to `out` (no allocation of its own).
    pub fn write(&self, out: &mut impl Extend<u8>) {
        match self {
            StoredDigest::Sha256(raw) => out.extend(raw.iter().copied()),
            StoredDigest::Other(text) => {
                out.extend([0u8]);
                out.extend(text.bytes());
                if text.len() + 1 == 32 {
                    out.extend([0u8]);
                }
            }
        }
    }
}

/// The 32 bytes of exactly 64 lowercase hex digits (what `sha256_digest` writes), in one pass:
/// every receipt decodes two of them, and a check pass before `hex::decode_to_slice` made that
/// 2.5 % of the relay's CPU in a drain.
fn lowercase_sha256_hex(digits: &str) -> Option<[u8; 32]> {
    fn nibble(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            _ => None,
        }
    }
    let digits = digits.as_bytes();
    if digits.len() != 64 {
        return None;
    }
    let mut raw = [0u8; 32];
    for (byte, pair) in raw.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(raw)
}

/// [`StoredDigest`] as bytes.
pub fn digest_bytes(digest: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(digest.len().max(32) + 2);
    StoredDigest::of(digest).write(&mut out);
    out
}

/// One outbox row as the relay sees it: `outboxEnvelope.v1` plus its frozen destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    pub event_id: Uuid,
    pub envelope_generation: i32,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// Per-aggregate sequence, allocated under the aggregate's lock in the producing transaction.
    pub aggregate_version: i64,
    pub event_type: String,
    pub payload_schema: Option<String>,
    /// The payload exactly as committed (jsonb text form); published byte for byte.
    pub payload: Bytes,
    pub payload_digest: String,
    pub tenant: Option<String>,
    /// Extra headers (a JSON object of string values), e.g. W3C `traceparent`.
    pub headers: Option<String>,
    pub occurred_at: String,
    pub created_xid: Option<String>,
    pub destination: Destination,
    pub destination_digest: String,
    /// Set when this event is one member of a delivery set (one event, several destinations,
    /// declared at enqueue).
    pub delivery_set_id: Option<Uuid>,
    /// Both digests are known to be those of this payload and this destination: computed from
    /// them (by the decoder, for a row that stores none, or by [`OutboxEvent::frozen`]), or
    /// stored by the row and found equal when it was decoded. [`OutboxEvent::verify`] then
    /// does not hash again, which was a twentieth of the relay's CPU per event. Whoever
    /// replaces the payload, the destination or a digest afterwards computes the digest again
    /// or clears this.
    pub digests_checked: bool,
    /// The row was written without an aggregate version (the writer's plain INSERT,
    /// docs/versions_by_relay.md): `aggregate_version` is 0 as decoded, and the relay core
    /// gives it its aggregate's next version in commit order before anything else reads it.
    pub version_by_relay: bool,
    /// The route version its destination was rendered from (a narrow row's, or the one the
    /// relay chose for a row written without a route); `None` for a row that stores its
    /// destination whole. Kept so that an unclear attempt of a row written without a route
    /// records the route its look-up must use (the row itself has none).
    pub route_version: Option<i64>,
}

/// Why a row cannot be published as it stands. Each variant names the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("payload_digest mismatch for event {event_id}: row says {stored}, payload hashes to {computed}")]
    PayloadDigest {
        event_id: Uuid,
        stored: String,
        computed: String,
    },
    #[error("destination_digest mismatch for event {event_id}: row says {stored}, frozen destination hashes to {computed}")]
    DestinationDigest {
        event_id: Uuid,
        stored: String,
        computed: String,
    },
    #[error("invalid envelope_generation {generation} for event {event_id}: generations start at {ENVELOPE_GENERATION}")]
    Generation { event_id: Uuid, generation: i32 },
    #[error(
        "field {field} of event {event_id} is empty; outbox.enqueue never writes an empty {field}"
    )]
    Empty { event_id: Uuid, field: &'static str },
}

impl EnvelopeError {
    /// A short machine-readable reason code stored in the quarantine table.
    pub fn reason_code(&self) -> &'static str {
        match self {
            EnvelopeError::PayloadDigest { .. } => "payload_digest_mismatch",
            EnvelopeError::DestinationDigest { .. } => "destination_digest_mismatch",
            EnvelopeError::Generation { .. } => "unsupported_envelope_generation",
            EnvelopeError::Empty { .. } => "empty_field",
        }
    }
}

impl OutboxEvent {
    /// A first-generation event frozen as `outbox.enqueue` freezes one: both digests computed
    /// from the payload and the destination, optional fields empty (set them with struct
    /// update syntax). For the simulator, tests and fixtures; the relay reads rows instead.
    pub fn frozen(
        event_id: Uuid,
        aggregate: (&str, &str, i64),
        event_type: &str,
        payload: Bytes,
        destination: Destination,
    ) -> Self {
        let (aggregate_type, aggregate_id, aggregate_version) = aggregate;
        OutboxEvent {
            event_id,
            envelope_generation: ENVELOPE_GENERATION,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            aggregate_version,
            event_type: event_type.into(),
            payload_schema: None,
            payload_digest: sha256_digest(&payload),
            payload,
            tenant: None,
            headers: None,
            occurred_at: "2026-11-30 00:00:00+00".into(),
            created_xid: None,
            destination_digest: destination.digest(),
            destination,
            delivery_set_id: None,
            digests_checked: true,
            version_by_relay: false,
            route_version: None,
        }
    }
}

impl OutboxEvent {
    /// Proves the row is the one `outbox.enqueue` froze: generation known, required fields
    /// present, both digests recomputed and equal.
    pub fn verify(&self) -> Result<(), EnvelopeError> {
        let event_id = self.event_id;
        if self.envelope_generation < ENVELOPE_GENERATION {
            return Err(EnvelopeError::Generation {
                event_id,
                generation: self.envelope_generation,
            });
        }
        for (field, value) in [
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("event_type", &self.event_type),
            ("dest_topic", &self.destination.topic),
        ] {
            if value.is_empty() {
                return Err(EnvelopeError::Empty { event_id, field });
            }
        }
        if self.digests_checked {
            return Ok(());
        }
        let computed = sha256_digest(&self.payload);
        if computed != self.payload_digest {
            return Err(EnvelopeError::PayloadDigest {
                event_id,
                stored: self.payload_digest.clone(),
                computed,
            });
        }
        let computed = self.destination.digest();
        if computed != self.destination_digest {
            return Err(EnvelopeError::DestinationDigest {
                event_id,
                stored: self.destination_digest.clone(),
                computed,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn sample() -> OutboxEvent {
        let destination = Destination {
            kind: "kafka".into(),
            cluster: "default".into(),
            topic: "outbox.event.order".into(),
            key: "o-42".into(),
            partitioner: "murmur2_random".into(),
            route_generation: 0,
            serializer: "json".into(),
            acks: "all".into(),
        };
        let payload = Bytes::from_static(br#"{"total": 10}"#);
        OutboxEvent::frozen(
            Uuid::now_v7(),
            ("order", "o-42", 1),
            "order.created",
            payload,
            destination,
        )
    }

    #[test]
    fn digests_are_stored_as_their_bytes_and_other_text_unambiguously() {
        use sha2::{Digest, Sha256};
        let d = sha256_digest(b"x");
        assert_eq!(digest_bytes(&d), Sha256::digest(b"x").to_vec());
        // Not sha256 hex: never 32 bytes, always a leading 0x00.
        for other in [
            "weird",
            "",
            "sha256:ABCD",
            &"y".repeat(31),
            &"z".repeat(32),
            &d.to_uppercase(),
            &d[..d.len() - 1],
            &format!("{d}0"),
            &format!("{}g", &d[..d.len() - 1]),
        ] {
            let b = digest_bytes(other);
            assert_ne!(b.len(), 32, "{other:?}");
            assert_eq!(b[0], 0, "{other:?}");
        }
    }

    #[test]
    fn digest_is_sha256_hex() {
        // sha256("") is a well-known constant.
        assert_eq!(
            sha256_digest(b""),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn verify_accepts_a_frozen_row_and_names_the_field_of_a_tampered_one() {
        let ev = sample();
        assert_eq!(ev.verify(), Ok(()));

        let mut tampered = ev.clone();
        tampered.payload = Bytes::from_static(br#"{"total": 11}"#);
        assert_eq!(
            tampered.verify(),
            Ok(()),
            "digests once checked are not hashed again"
        );
        tampered.digests_checked = false;
        let err = tampered.verify().unwrap_err();
        assert_eq!(err.reason_code(), "payload_digest_mismatch");
        assert!(err.to_string().contains("payload_digest"));

        let mut moved = ev.clone();
        moved.destination.topic = "elsewhere".into();
        moved.digests_checked = false;
        assert_eq!(
            moved.verify().unwrap_err().reason_code(),
            "destination_digest_mismatch"
        );

        let mut invalid = ev;
        invalid.envelope_generation = 0;
        assert_eq!(
            invalid.verify().unwrap_err().reason_code(),
            "unsupported_envelope_generation"
        );
    }
}

/// A row of `outbox.events` could not be read as an envelope (a column is missing, NULL where
/// it must not be, or not parseable). Names the column.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("outbox row column {column}: {problem}")]
pub struct RowError {
    pub column: String,
    pub problem: String,
}

/// Columns of `outbox.events`, in the order the snapshot query selects them.
pub const EVENT_COLUMNS: &[&str] = &[
    "event_id",
    "envelope_generation",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "event_type",
    "payload_schema",
    "payload",
    "payload_digest",
    "tenant",
    "headers",
    "occurred_at",
    "created_xid",
    "dest_kind",
    "dest_cluster",
    "dest_topic",
    "dest_key",
    "dest_partitioner",
    "dest_route_generation",
    "dest_serializer",
    "dest_acks",
    "destination_digest",
    "delivery_set_id",
];

impl OutboxEvent {
    /// Builds an event from the text form of its columns (as pgoutput and a text-mode query
    /// both deliver them). `get(name)` returns `Ok(None)` for SQL NULL, `Err` if the column
    /// is absent. `payload` is taken as raw bytes so it can be a zero-copy slice.
    ///
    /// A narrow row (migration 0031: `dest_kind` NULL, `route_version` set) gets its
    /// destination from `versions`; a version the caller does not know is an error naming
    /// it, never a guess. A row read through `outbox.events_current` arrives rendered.
    ///
    /// A row written plainly (docs/versions_by_relay.md) may have neither a destination nor a
    /// route version: it gets the route version `policy`, the route policy generation in
    /// force at its commit, chooses ([`crate::route::choose_route_version`]); without a policy
    /// (a read outside the stream) that is an error naming the column. Without an aggregate
    /// version it is marked [`OutboxEvent::version_by_relay`].
    pub fn from_text_columns<'a>(
        get: impl Fn(&str) -> Result<Option<&'a str>, RowError>,
        payload: Option<Bytes>,
        versions: &RouteVersions,
        policy: Option<&crate::route::PolicyGeneration>,
    ) -> Result<OutboxEvent, RowError> {
        let required = |name: &str| -> Result<&'a str, RowError> {
            get(name)?.ok_or_else(|| RowError {
                column: name.to_string(),
                problem: "is NULL".into(),
            })
        };
        let parse_i64 = |name: &str| -> Result<i64, RowError> {
            let v = required(name)?;
            v.parse::<i64>().map_err(|_| RowError {
                column: name.to_string(),
                problem: format!("{v:?} is not an integer"),
            })
        };
        let optional =
            |name: &str| -> Result<Option<String>, RowError> { Ok(get(name)?.map(str::to_string)) };
        let id_text = required("event_id")?;
        let event_id = Uuid::parse_str(id_text).map_err(|e| RowError {
            column: "event_id".into(),
            problem: format!("{id_text:?} is not a UUID: {e}"),
        })?;
        let payload = match payload {
            Some(p) => p,
            None => Bytes::copy_from_slice(required("payload")?.as_bytes()),
        };
        let generation = parse_i64("envelope_generation")?;
        // The route version a row without a whole destination renders from: its own, or, for
        // the writer's plain INSERT (neither), the one the policy in force chooses.
        let route_version = match get("dest_kind")? {
            Some(_) => None,
            None => match get("route_version") {
                Ok(Some(v)) => Some(v.parse::<i64>().map_err(|_| RowError {
                    column: "route_version".into(),
                    problem: format!("{v:?} is not an integer"),
                })?),
                Ok(None) => {
                    let policy = policy.ok_or_else(|| RowError {
                        column: "route_version".into(),
                        problem: "is NULL and so is dest_kind: a row written without a route is routed by the relay from the stream (docs/versions_by_relay.md), not when read by a query".into(),
                    })?;
                    Some(crate::route::choose_route_version(
                        &policy.rules,
                        required("aggregate_type")?,
                        required("event_type")?,
                    ))
                }
                // Absent before migration 0031.
                Err(_) => None,
            },
        };
        let destination = match route_version {
            None => Destination {
                kind: required("dest_kind")?.to_string(),
                cluster: required("dest_cluster")?.to_string(),
                topic: required("dest_topic")?.to_string(),
                key: required("dest_key")?.to_string(),
                partitioner: required("dest_partitioner")?.to_string(),
                route_generation: parse_i64("dest_route_generation")?,
                serializer: required("dest_serializer")?.to_string(),
                acks: required("dest_acks")?.to_string(),
            },
            Some(id) => {
                let version = versions.get(&id).ok_or_else(|| RowError {
                    column: "route_version".into(),
                    problem: format!(
                        "names route version {id}, which this relay has not read (is outbox.route_versions in its publication?); the event is not published anywhere before that version is known"
                    ),
                })?;
                version
                    .destination(required("aggregate_type")?, required("aggregate_id")?)
                    .map_err(|problem| RowError {
                        column: "dest_topic".into(),
                        problem: format!("rendered from route version {id}: {problem}"),
                    })?
            }
        };
        // A digest the row does not store (migration 0027) is the relay's to compute: the row
        // is immutable, so what was decoded is what was committed. One it stores is compared
        // with the computed one here; a mismatch is kept for `verify` to report.
        let mut digests_checked = true;
        let mut digest = |column: &str, computed: String| -> Result<String, RowError> {
            Ok(match get(column)? {
                Some(stored) => {
                    digests_checked &= stored == computed;
                    stored.to_string()
                }
                None => computed,
            })
        };
        let version_by_relay = get("aggregate_version")?.is_none();
        let payload_digest = digest("payload_digest", sha256_digest(&payload))?;
        let destination_digest = digest("destination_digest", destination.digest())?;
        Ok(OutboxEvent {
            event_id,
            envelope_generation: i32::try_from(generation).map_err(|_| RowError {
                column: "envelope_generation".into(),
                problem: format!("{generation} out of range"),
            })?,
            aggregate_type: required("aggregate_type")?.to_string(),
            aggregate_id: required("aggregate_id")?.to_string(),
            aggregate_version: if version_by_relay {
                0
            } else {
                parse_i64("aggregate_version")?
            },
            event_type: required("event_type")?.to_string(),
            payload_schema: optional("payload_schema")?,
            payload,
            payload_digest,
            tenant: optional("tenant")?,
            headers: optional("headers")?,
            occurred_at: required("occurred_at")?.to_string(),
            created_xid: optional("created_xid")?,
            destination,
            destination_digest,
            // Absent before migration 0007; NULL for ordinary events.
            delivery_set_id: match get("delivery_set_id").ok().flatten() {
                None => None,
                Some(t) => Some(Uuid::parse_str(t).map_err(|e| RowError {
                    column: "delivery_set_id".into(),
                    problem: format!("{t:?} is not a UUID: {e}"),
                })?),
            },
            digests_checked,
            version_by_relay,
            route_version,
        })
    }
}

#[cfg(test)]
mod row_tests {
    use super::*;
    use std::collections::HashMap;

    fn cols(ev: &OutboxEvent) -> HashMap<&'static str, Option<String>> {
        let d = &ev.destination;
        HashMap::from([
            ("event_id", Some(ev.event_id.to_string())),
            ("envelope_generation", Some("1".to_string())),
            ("aggregate_type", Some(ev.aggregate_type.clone())),
            ("aggregate_id", Some(ev.aggregate_id.clone())),
            ("aggregate_version", Some("1".to_string())),
            ("event_type", Some(ev.event_type.clone())),
            ("payload_schema", None),
            (
                "payload",
                Some(String::from_utf8(ev.payload.to_vec()).unwrap()),
            ),
            ("payload_digest", Some(ev.payload_digest.clone())),
            ("tenant", None),
            ("headers", None),
            ("occurred_at", Some(ev.occurred_at.clone())),
            ("created_xid", None),
            ("dest_kind", Some(d.kind.clone())),
            ("dest_cluster", Some(d.cluster.clone())),
            ("dest_topic", Some(d.topic.clone())),
            ("dest_key", Some(d.key.clone())),
            ("dest_partitioner", Some(d.partitioner.clone())),
            (
                "dest_route_generation",
                Some(d.route_generation.to_string()),
            ),
            ("dest_serializer", Some(d.serializer.clone())),
            ("dest_acks", Some(d.acks.clone())),
            ("destination_digest", Some(ev.destination_digest.clone())),
            ("delivery_set_id", None),
        ])
    }

    fn getter<'a>(
        m: &'a HashMap<&'static str, Option<String>>,
    ) -> impl Fn(&str) -> Result<Option<&'a str>, RowError> {
        move |name| {
            m.get(name).map(|v| v.as_deref()).ok_or_else(|| RowError {
                column: name.into(),
                problem: "missing".into(),
            })
        }
    }

    #[test]
    fn round_trips_and_names_the_bad_column() {
        let ev = tests::sample();
        let m = cols(&ev);
        assert_eq!(
            OutboxEvent::from_text_columns(getter(&m), None, &RouteVersions::new(), None).unwrap(),
            ev
        );
        assert_eq!(EVENT_COLUMNS.len(), m.len());

        let mut bad = m.clone();
        bad.insert("aggregate_version", Some("seven".into()));
        let err = OutboxEvent::from_text_columns(getter(&bad), None, &RouteVersions::new(), None)
            .unwrap_err();
        assert_eq!(err.column, "aggregate_version");

        let mut null = m;
        null.insert("dest_topic", None);
        let err = OutboxEvent::from_text_columns(getter(&null), None, &RouteVersions::new(), None)
            .unwrap_err();
        assert_eq!(err.to_string(), "outbox row column dest_topic: is NULL");
    }

    /// Migration 0027: `outbox.enqueue` stores no digests; the relay computes them from the
    /// decoded row (the same values `outbox.enqueue` stored before), and a stored digest is
    /// still checked.
    #[test]
    fn a_row_without_digests_gets_the_relays_and_a_stored_one_is_still_checked() {
        let ev = tests::sample();
        let mut m = cols(&ev);
        m.insert("payload_digest", None);
        m.insert("destination_digest", None);
        let decoded =
            OutboxEvent::from_text_columns(getter(&m), None, &RouteVersions::new(), None).unwrap();
        assert_eq!(
            decoded, ev,
            "the computed digests are the ones enqueue stored"
        );
        decoded.verify().unwrap();

        m.insert(
            "payload_digest",
            Some(format!("{DIGEST_PREFIX}{}", "0".repeat(64))),
        );
        let wrong =
            OutboxEvent::from_text_columns(getter(&m), None, &RouteVersions::new(), None).unwrap();
        assert_eq!(
            wrong.verify().unwrap_err().reason_code(),
            "payload_digest_mismatch"
        );
    }
}
