//! Route versions: what a narrow outbox row's destination is frozen to (migration 0031).
//!
//! `outbox.enqueue` no longer writes the rendered destination into every row (eight columns
//! the producer computed and the walsender decoded again for each event). It writes the id of
//! the immutable route version in force (`outbox.route_versions`, never updated or deleted),
//! and the destination is a pure function of that version and the row's aggregate type and
//! id. So what an event is frozen to still cannot change after its commit.
//!
//! [`render_destination`] is the Rust twin of `outbox.render_destination` (migration 0022):
//! the relay renders the topic of every narrow row it decodes, and the ledger's agreement test
//! holds the two to the same output. Enqueue (and, for rows written around it, the trigger
//! `events_row_around_enqueue`) already refused in the producer's transaction whatever the SQL
//! function refuses, so a refusal here means the two disagree, and the row is quarantined with
//! the reason, never published somewhere else.
//!
//! Pure: no I/O. The versions a relay knows come from a query at start and from the inserts
//! into `outbox.route_versions` its publication streams before any row that references them.

use std::collections::HashMap;
use std::fmt::Write;

use crate::destination::Destination;

/// One immutable route version (a row of `outbox.route_versions`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteVersion {
    pub kind: String,
    pub cluster: String,
    /// The topic, subject or URL as the route wrote it, with `{aggregate_type}` and
    /// `{aggregate_id}` placeholders.
    pub topic_template: String,
    pub partitioner: String,
    pub route_generation: i64,
    pub serializer: String,
    pub acks: String,
}

/// Route versions by id, as one relay knows them.
pub type RouteVersions = HashMap<i64, RouteVersion>;

/// Columns of `outbox.route_versions`, in the order the relay's start-up query selects them.
pub const ROUTE_VERSION_COLUMNS: &[&str] = &[
    "version_id",
    "kind",
    "cluster",
    "topic_template",
    "partitioner",
    "route_generation",
    "serializer",
    "acks",
];

/// The route without a policy row (`outbox.route_template`'s fallback): version 0.
pub fn default_route_version() -> RouteVersion {
    RouteVersion {
        kind: "kafka".into(),
        cluster: "default".into(),
        topic_template: "outbox.event.{aggregate_type}".into(),
        partitioner: "murmur2_random".into(),
        route_generation: 0,
        serializer: "json".into(),
        acks: "all".into(),
    }
}

impl RouteVersion {
    /// The destination an event of this aggregate is frozen to under this version: the
    /// template rendered, the key the aggregate id.
    pub fn destination(
        &self,
        aggregate_type: &str,
        aggregate_id: &str,
    ) -> Result<Destination, String> {
        Ok(Destination {
            kind: self.kind.clone(),
            cluster: self.cluster.clone(),
            topic: render_destination(
                &self.kind,
                &self.topic_template,
                aggregate_type,
                aggregate_id,
            )?,
            key: aggregate_id.to_string(),
            partitioner: self.partitioner.clone(),
            route_generation: self.route_generation,
            serializer: self.serializer.clone(),
            acks: self.acks.clone(),
        })
    }
}

const AGGREGATE_TYPE: &str = "{aggregate_type}";
const AGGREGATE_ID: &str = "{aggregate_id}";

fn kafka_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

/// White space or a control character in the ASCII range: what splits a NATS subject on the
/// wire. PostgreSQL's `[[:space:][:cntrl:]]` may also match characters beyond ASCII, depending
/// on the database's locale; enqueue refused those already, so accepting them here can only
/// accept what enqueue accepted, never render it differently (a NATS value is used verbatim).
fn space_or_control(c: char) -> bool {
    c == ' ' || c.is_ascii_control()
}

/// Whether a NATS subject has an empty token or a `*`/`>` token (SQL:
/// `(^|\.)[*>]?(\.|$)`).
fn nats_bad_token(subject: &str) -> bool {
    subject
        .split('.')
        .any(|t| t.is_empty() || t == "*" || t == ">")
}

/// `outbox.route_template_problem` for the kinds `outbox.render_destination` asks it about
/// (HTTP, and NATS with a placeholder): why the template is unusable, or `None`. A Kafka
/// template is judged by its rendered topic instead, as in SQL.
fn template_problem(kind: &str, template: &str) -> Option<String> {
    if template.is_empty() {
        return Some("the template is empty".into());
    }
    match kind {
        "http" => {
            // ^[A-Za-z][A-Za-z0-9+.-]*:(?://[^/?#]*)?
            let bytes = template.as_bytes();
            let scheme_end = bytes
                .iter()
                .skip(1)
                .position(|b| !(b.is_ascii_alphanumeric() || matches!(b, b'+' | b'.' | b'-')))
                .map(|p| p + 1);
            let colon = match scheme_end {
                Some(i) if bytes[0].is_ascii_alphabetic() && bytes[i] == b':' => i,
                _ => return Some("it is not an absolute http:// or https:// URL".into()),
            };
            let rest = &template[colon + 1..];
            let authority = match rest.strip_prefix("//") {
                Some(after) => {
                    let end = after.find(['/', '?', '#']).unwrap_or(after.len());
                    &template[..colon + 3 + end]
                }
                None => &template[..colon + 1],
            };
            if authority.contains(AGGREGATE_TYPE) || authority.contains(AGGREGATE_ID) {
                return Some(format!(
                    "a placeholder in the scheme, host, port or user info ({authority}) would let a value choose where the request goes; put {{aggregate_type}} and {{aggregate_id}} in the path, query or fragment only"
                ));
            }
            None
        }
        "nats" => {
            let sample = template
                .replace(AGGREGATE_TYPE, "x")
                .replace(AGGREGATE_ID, "x");
            if sample.chars().any(space_or_control) {
                return Some(
                    "a NATS subject must contain no white space or control character".into(),
                );
            }
            if nats_bad_token(&sample) {
                return Some(
                    "a NATS subject to publish to must have no empty token and no \"*\" or \">\" wildcard token".into(),
                );
            }
            None
        }
        _ => None,
    }
}

/// `outbox.destination_value`: one value made safe for a destination of `kind`, or refused.
fn destination_value(
    kind: &str,
    name: &str,
    value: &str,
    template: &str,
) -> Result<String, String> {
    match kind {
        "http" => {
            if matches!(value, "" | "." | "..") {
                return Err(format!("{name} {value:?} cannot be placed in the URL of route template {template:?}: a value in a URL must not be empty, \".\" or \"..\""));
            }
            let mut out = String::with_capacity(value.len());
            for b in value.bytes() {
                if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                    out.push(b as char);
                } else {
                    let _ = write!(out, "%{b:02X}");
                }
            }
            Ok(out)
        }
        "nats" => {
            if value.is_empty()
                || value
                    .chars()
                    .any(|c| matches!(c, '.' | '*' | '>') || space_or_control(c))
            {
                return Err(format!("{name} {value:?} cannot be a token of the NATS subject of route template {template:?}"));
            }
            Ok(value.to_string())
        }
        "kafka" => {
            if value.is_empty() || !value.chars().all(kafka_char) {
                return Err(format!("{name} {value:?} cannot be part of the Kafka topic of route template {template:?}: a Kafka topic name may contain only ASCII letters, digits, \".\", \"_\" and \"-\""));
            }
            Ok(value.to_string())
        }
        _ => Ok(value.to_string()),
    }
}

/// One row of `outbox.route_policy`, as far as choosing a route reads it; an element of a
/// policy generation's `rules` (migration 0038), whose rules are all active.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct PolicyRule {
    /// The aggregate type it applies to; `None`: every type.
    pub aggregate_type: Option<String>,
    /// The event type it applies to; `None`: every type.
    pub event_type: Option<String>,
    pub priority: i32,
    /// Unique per row (`outbox.route_generation_seq`): the last tie-break.
    pub generation: i64,
    /// A generation holds active rules only: absent there, true.
    #[serde(default = "active")]
    pub active: bool,
    /// The immutable version the row's route is (`outbox.route_versions`).
    pub route_version: i64,
}

fn active() -> bool {
    true
}

/// A route policy generation (`outbox.policy_generations`, migration 0038): the active rules
/// as they stood after one change of the policy. The relay routes a row written without a
/// route by the generation in force at its commit: the last one the stream delivered before
/// it, or the one kept with the checkpoint it started from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyGeneration {
    pub id: i64,
    pub rules: Vec<PolicyRule>,
}

/// The rules of a policy generation (`outbox.policy_generations.rules`, migration 0038), as
/// the stream or a read by id delivers them. An error names what is wrong: a generation the
/// relay cannot read routes nothing (its rows wait), it is never guessed.
pub fn policy_rules_from_json(rules: &str) -> Result<Vec<PolicyRule>, String> {
    serde_json::from_str(rules).map_err(|e| format!("a policy generation's rules: {e}"))
}

/// The route version an event of (`aggregate_type`, `event_type`) is frozen to under `rules`:
/// the choice `outbox.enqueue` and `outbox.route_template` make. Among the active rules that
/// match (a `None` type matches any), the most specific first (an aggregate type named beats
/// an event type named, which beats neither), then the highest priority, then the newest
/// generation; version 0 (the default route) when none matches.
///
/// The relay's half of the writer's plain INSERT (docs/versions_by_relay.md): a row written
/// without a route version gets the one the policy in force at its commit gives. Held to the
/// SQL by the ledger's agreement test, as [`render_destination`] is.
pub fn choose_route_version(rules: &[PolicyRule], aggregate_type: &str, event_type: &str) -> i64 {
    rules
        .iter()
        .filter(|r| {
            r.active
                && r.aggregate_type
                    .as_deref()
                    .map_or(true, |t| t == aggregate_type)
                && r.event_type.as_deref().map_or(true, |t| t == event_type)
        })
        .max_by_key(|r| {
            (
                r.aggregate_type.is_some(),
                r.event_type.is_some(),
                r.priority,
                r.generation,
            )
        })
        .map_or(0, |r| r.route_version)
}

/// `outbox.render_destination`: the destination a route template gives an event, each
/// placeholder replaced by its value encoded for `kind` (or refused), in one pass, then the
/// whole checked. The error says what the SQL function would have refused.
pub fn render_destination(
    kind: &str,
    template: &str,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<String, String> {
    if kind == "http" || (kind == "nats" && template.contains('{')) {
        if let Some(problem) = template_problem(kind, template) {
            return Err(format!(
                "the route template {template:?} ({kind}) cannot be used: {problem}"
            ));
        }
    }
    let mut rest = template;
    let mut out = String::with_capacity(template.len() + aggregate_id.len());
    loop {
        let at_type = rest.find(AGGREGATE_TYPE);
        let at_id = rest.find(AGGREGATE_ID);
        let (at, len, name, value) = match (at_type, at_id) {
            (None, None) => break,
            (Some(t), Some(i)) if i < t => (i, AGGREGATE_ID.len(), "aggregate_id", aggregate_id),
            (Some(t), _) => (t, AGGREGATE_TYPE.len(), "aggregate_type", aggregate_type),
            (None, Some(i)) => (i, AGGREGATE_ID.len(), "aggregate_id", aggregate_id),
        };
        out.push_str(&rest[..at]);
        out.push_str(&destination_value(kind, name, value, template)?);
        rest = &rest[at + len..];
    }
    out.push_str(rest);
    let kafka_illegal = || {
        out.is_empty()
            || !out.chars().all(kafka_char)
            || out.chars().count() > 249
            || out == "."
            || out == ".."
    };
    match kind {
        "kafka" if kafka_illegal() => Err(format!("the Kafka topic {out:?} (route template {template:?}, aggregate type {aggregate_type:?}) is not a legal topic name")),
        "nats" if nats_bad_token(&out) || out.chars().any(space_or_control) => Err(format!("the NATS subject {out:?} (route template {template:?}) has an empty or wildcard token, or white space")),
        _ => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(agg: Option<&str>, ev: Option<&str>, priority: i32, generation: i64) -> PolicyRule {
        PolicyRule {
            aggregate_type: agg.map(Into::into),
            event_type: ev.map(Into::into),
            priority,
            generation,
            active: true,
            route_version: generation * 10,
        }
    }

    #[test]
    fn the_most_specific_active_rule_wins_then_priority_then_the_newest() {
        let rules = vec![
            rule(None, None, 9, 1),
            rule(None, Some("placed"), 0, 2),
            rule(Some("order"), None, 0, 3),
            rule(Some("order"), Some("placed"), 0, 4),
            rule(Some("order"), Some("placed"), 0, 5),
            PolicyRule {
                active: false,
                ..rule(Some("order"), Some("placed"), 99, 6)
            },
            rule(Some("user"), None, 1, 7),
            rule(Some("user"), None, 0, 8),
        ];
        let choose = |a, e| choose_route_version(&rules, a, e);
        assert_eq!(
            choose("order", "placed"),
            50,
            "both named, newest; inactive ignored"
        );
        assert_eq!(
            choose("order", "paid"),
            30,
            "aggregate type named beats event type"
        );
        assert_eq!(
            choose("cart", "placed"),
            20,
            "event type named beats neither"
        );
        assert_eq!(choose("cart", "paid"), 10, "the catch-all");
        assert_eq!(choose("user", "x"), 70, "priority before generation");
        assert_eq!(
            choose_route_version(&[], "order", "placed"),
            0,
            "no rule: the default"
        );
    }

    #[test]
    fn renders_each_kind_and_refuses_what_would_change_the_destination() {
        let r = |k: &str, t: &str, a: &str, i: &str| render_destination(k, t, a, i);
        assert_eq!(
            r("kafka", "outbox.event.{aggregate_type}", "Order", "1").unwrap(),
            "outbox.event.Order"
        );
        assert!(r("kafka", "outbox.event.{aggregate_type}", "Or der", "1").is_err());
        assert_eq!(
            r(
                "http",
                "https://h/x/{aggregate_id}?t={aggregate_type}",
                "T",
                "../../admin"
            )
            .unwrap(),
            "https://h/x/..%2F..%2Fadmin?t=T"
        );
        assert!(r("http", "https://h/x/{aggregate_id}", "T", "..").is_err());
        assert!(r("http", "https://{aggregate_id}/x", "T", "a").is_err());
        assert!(r("nats", "orders.{aggregate_id}", "T", "a.b").is_err());
        assert!(r("nats", "orders.{aggregate_id}", "T", ">").is_err());
        assert_eq!(
            r("nats", "orders.{aggregate_id}", "T", "a-1").unwrap(),
            "orders.a-1"
        );
        // One pass: a value reading like a placeholder stays text.
        assert_eq!(
            r(
                "http",
                "https://h/{aggregate_type}/{aggregate_id}",
                "{aggregate_id}",
                "x"
            )
            .unwrap(),
            "https://h/%7Baggregate_id%7D/x"
        );
    }
}
