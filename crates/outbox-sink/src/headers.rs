//! Optional message headers beyond the envelope's own (see [`crate::event_headers`]): the
//! CloudEvents Kafka binary binding. Pure functions, so any sink can use them.
//!
//! # CloudEvents binary mode
//!
//! With the option on, every message carries the CloudEvents 1.0 attributes as `ce_`
//! headers and the payload stays the message value, unchanged:
//!
//! | header | value |
//! | --- | --- |
//! | `ce_specversion` | `1.0` |
//! | `ce_id` | the event id (the same as header `id`) |
//! | `ce_type` | the event type |
//! | `ce_source` | the configured source with `{aggregate_type}` replaced, default `/outboxd/{aggregate_type}` |
//! | `ce_time` | `occurred_at` in RFC 3339 |
//! | `ce_subject` | the aggregate id |
//! | `content-type` | `application/json` (the payload is jsonb) |
//!
//! W3C trace context needs nothing here: `traceparent` and `tracestate` in the outbox row's
//! `headers` object are copied to the Kafka headers under the same names, like every other
//! row header.

use std::borrow::Cow;

use outbox_core::OutboxEvent;

/// Message headers as (name, value): the envelope's names are static and most values borrow
/// from the event, so building them for every message allocates little.
pub type Headers<'a> = Vec<(Cow<'static, str>, Cow<'a, [u8]>)>;

/// Which optional header families to add.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderOptions {
    /// `Some(source template)` turns on the CloudEvents binary binding.
    pub cloudevents: Option<String>,
}

/// The default CloudEvents `source`.
pub const DEFAULT_CLOUDEVENTS_SOURCE: &str = "/outboxd/{aggregate_type}";

/// Appends the optional headers of `opts` to `headers` (the envelope headers of `ev`). A
/// header already present (e.g. a producer's own `ce_type` row header) is replaced, so each
/// name appears once and the CloudEvents attributes always describe the outbox event.
pub fn add_optional_headers(headers: &mut Headers<'_>, ev: &OutboxEvent, opts: &HeaderOptions) {
    if let Some(source) = &opts.cloudevents {
        for (k, v) in cloudevents_headers(ev, source) {
            headers.retain(|(name, _)| *name != k);
            headers.push((k.into(), v.into()));
        }
    }
}

/// The CloudEvents 1.0 Kafka binary-mode headers of `ev`.
pub fn cloudevents_headers(ev: &OutboxEvent, source: &str) -> Vec<(String, Vec<u8>)> {
    let source = source.replace("{aggregate_type}", &ev.aggregate_type);
    vec![
        ("ce_specversion".into(), b"1.0".to_vec()),
        ("ce_id".into(), ev.event_id.to_string().into_bytes()),
        ("ce_type".into(), ev.event_type.clone().into_bytes()),
        ("ce_source".into(), source.into_bytes()),
        ("ce_time".into(), rfc3339(&ev.occurred_at).into_bytes()),
        ("ce_subject".into(), ev.aggregate_id.clone().into_bytes()),
        ("content-type".into(), b"application/json".to_vec()),
    ]
}

/// PostgreSQL's ISO `timestamptz` text (`2026-11-30 08:01:05.123456+00`, `...+05:30`) as
/// RFC 3339 (`2026-11-30T08:01:05.123456+00:00`). Text of any other shape is returned as it
/// is (it is still the event's time, just not reformatted).
pub fn rfc3339(pg: &str) -> String {
    let b = pg.as_bytes();
    let iso_date = b.len() >= 19
        && b[4] == b'-'
        && b[7] == b'-'
        && (b[10] == b' ' || b[10] == b'T')
        && b[13] == b':'
        && b[16] == b':';
    if !iso_date {
        return pg.to_string();
    }
    let mut s = format!("{}T{}", &pg[..10], &pg[11..]);
    // The zone is the last '+' or '-' after the time; PostgreSQL prints +HH, +HH:MM or
    // +HH:MM:SS.
    if let Some(z) = s[19..].rfind(['+', '-']).map(|i| i + 19) {
        let zone = &s[z + 1..];
        let fixed = match zone.len() {
            2 => Some(format!("{zone}:00")),
            5 => None,
            8 => Some(zone[..5].to_string()),
            _ => None,
        };
        if let Some(f) = fixed {
            s.truncate(z + 1);
            s.push_str(&f);
        }
    } else if s.ends_with('Z') {
        // Already RFC 3339.
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pg_timestamps_become_rfc3339() {
        assert_eq!(
            rfc3339("2026-11-30 08:01:05.123456+00"),
            "2026-11-30T08:01:05.123456+00:00"
        );
        assert_eq!(
            rfc3339("2026-11-30 08:01:05+05:30"),
            "2026-11-30T08:01:05+05:30"
        );
        assert_eq!(
            rfc3339("2026-11-30 08:01:05-03"),
            "2026-11-30T08:01:05-03:00"
        );
        assert_eq!(rfc3339("2026-11-30T08:01:05Z"), "2026-11-30T08:01:05Z");
        assert_eq!(rfc3339("yesterday"), "yesterday");
    }

    fn event() -> OutboxEvent {
        let destination = outbox_core::Destination {
            kind: "kafka".into(),
            cluster: "default".into(),
            topic: "outbox.event.order".into(),
            key: "o-42".into(),
            partitioner: "murmur2_random".into(),
            route_generation: 0,
            serializer: "json".into(),
            acks: "all".into(),
        };
        let payload = br#"{"total": 10}"#.to_vec();
        OutboxEvent {
headers: Some(
                r#"{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","ce_type":"spoofed"}"#
                    .into(),
            ),
..OutboxEvent::frozen(
"0193a1b2-0000-7000-8000-000000000001".parse().unwrap(),
("order", "o-42", 1),
"order.created",
payload.into(),
destination,
)
}
    }

    /// The envelope's id and numbers are sent as their text (`Display`), whatever their value.
    #[test]
    fn the_envelope_headers_carry_the_id_and_numbers_as_text() {
        for (version, generation) in [(1, 1), (0, 0), (i64::MAX, i32::MAX), (-3, -1)] {
            let mut ev = event();
            ev.aggregate_version = version;
            ev.envelope_generation = generation;
            let h = crate::event_headers(&ev);
            let get = |k: &str| {
                let (_, v) = h.iter().find(|(n, _)| n == k).expect(k);
                String::from_utf8(v.to_vec()).unwrap()
            };
            assert_eq!(get("id"), ev.event_id.to_string());
            assert_eq!(get("aggregate_version"), version.to_string());
            assert_eq!(get("envelope_generation"), generation.to_string());
        }
    }

    #[test]
    fn cloudevents_replace_row_headers_of_the_same_name() {
        let ev = event();
        let mut h = crate::event_headers(&ev);
        add_optional_headers(
            &mut h,
            &ev,
            &HeaderOptions {
                cloudevents: Some(DEFAULT_CLOUDEVENTS_SOURCE.into()),
            },
        );
        let get = |k: &str| {
            let v: Vec<&[u8]> = h
                .iter()
                .filter(|(n, _)| n == k)
                .map(|(_, v)| &v[..])
                .collect();
            assert_eq!(v.len(), 1, "header {k} appears {} times", v.len());
            String::from_utf8(v[0].to_vec()).unwrap()
        };
        assert_eq!(get("ce_specversion"), "1.0");
        assert_eq!(get("ce_id"), ev.event_id.to_string());
        assert_eq!(get("ce_type"), ev.event_type);
        assert_eq!(get("ce_source"), format!("/outboxd/{}", ev.aggregate_type));
        assert_eq!(get("ce_subject"), ev.aggregate_id);
        assert!(get("ce_time").contains('T'));
        assert_eq!(
            get("traceparent"),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        // Off: nothing added.
        let mut plain = crate::event_headers(&ev);
        let n = plain.len();
        add_optional_headers(&mut plain, &ev, &HeaderOptions::default());
        assert_eq!(plain.len(), n);
        assert!(!plain.iter().any(|(k, _)| k == "ce_specversion"));
    }
}
