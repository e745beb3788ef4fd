//! What each role needs, in one place: the relay's (docs/least_privilege.sql), and what the
//! relay's background purge adds (docs/operator_role.sql grants it to operators).
//!
//! `outboxd check` reports what the role it runs as lacks, as the exact GRANT statements, and
//! `outboxd run` refuses to start without it: a relay that streamed, published and only then
//! failed on `permission denied for table receipts` put copies on the broker for nothing
//! (issue 34). The scripts grant what these lists name; an e2e test runs each script and then
//! the commands of its role.

use tokio_postgres::Client;

use crate::{Context, LedgerError};

/// One object and the privileges a role needs on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    /// `outbox.<name>`.
    pub object: &'static str,
    pub kind: Kind,
    pub privileges: &'static [&'static str],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Table,
    Sequence,
}

const READ: &[&str] = &["SELECT"];
const WRITE: &[&str] = &["SELECT", "INSERT", "UPDATE", "DELETE"];
const USAGE: &[&str] = &["USAGE"];

const fn table(object: &'static str, privileges: &'static [&'static str]) -> Need {
    Need {
        object,
        kind: Kind::Table,
        privileges,
    }
}

const fn sequence(object: &'static str) -> Need {
    Need {
        object,
        kind: Kind::Sequence,
        privileges: USAGE,
    }
}

/// The relay's ledger: every table it writes, and the sequences behind their ids.
pub const RELAY_LEDGER: &[Need] = &[
    // Receipts are written to their tables and read through the view (migration 0030).
    table("receipts", READ),
    table("receipt_entries", WRITE),
    table("receipt_batches", WRITE),
    table("receipt_destinations", &["SELECT", "INSERT"]),
    table("duplicate_receipts", WRITE),
    table("quarantine", WRITE),
    table("checkpoints", WRITE),
    table("accepted_positions", WRITE),
    table("stream_versions", WRITE),
    table("stream_version_log", &["SELECT", "INSERT", "DELETE"]),
    table("stream_numbering", READ),
    table("aggregate_heads", WRITE),
    table("head_journal", WRITE),
    table("holds", WRITE),
    table("held_events", WRITE),
    table("relay_leases", WRITE),
    table("attempts", WRITE),
    table("poll_positions", WRITE),
    table("poll_rounds", WRITE),
    table("relay_members", WRITE),
    sequence("duplicate_receipts_id_seq"),
    sequence("quarantine_id_seq"),
    sequence("attempts_id_seq"),
    sequence("head_journal_id_seq"),
];

/// What the relay reads besides its own outbox table (which `check` names with its
/// `--table`): the routes, versions and migrations that describe the events, and the purged
/// events (an aggregate's head counts its purged versions, migration 0026).
pub const RELAY_READS: &[Need] = &[
    table("events_current", READ),
    table("events_frozen", READ),
    table("route_versions", READ),
    table("purged_events", READ),
    table("aggregate_versions", READ),
    table("route_policy", READ),
    table("policy_generations", READ),
    table("destination_migrations", READ),
    table("delivery_sets", READ),
    table("schema_migrations", READ),
];

/// What a purge (`outboxd purge`, or `[retention] purge_interval` in the relay) deletes and
/// records, beyond the relay's ledger.
pub const PURGE: &[Need] = &[
    table("events", &["SELECT", "DELETE"]),
    table("inbox", &["SELECT", "DELETE"]),
    table("destination_migrations", &["SELECT", "DELETE"]),
    table("purged_events", &["SELECT", "INSERT"]),
    table("consumers", READ),
    table("consumer_watermarks", READ),
];

/// The GRANT statements the current role lacks for `needs`, in order; objects that do not
/// exist (a database migrated by an older outboxd) are skipped. Empty: nothing is missing.
pub async fn missing(client: &Client, needs: &[Need]) -> Result<Vec<String>, LedgerError> {
    // One round trip: (object, kind, privilege) rows, asked together.
    let (mut objects, mut kinds, mut privs) = (Vec::new(), Vec::new(), Vec::new());
    for need in needs {
        for privilege in need.privileges {
            objects.push(format!("outbox.{}", need.object));
            kinds.push(match need.kind {
                Kind::Table => "table",
                Kind::Sequence => "sequence",
            });
            privs.push(*privilege);
        }
    }
    let rows = client
        .query(
            "SELECT o, CASE WHEN to_regclass(o) IS NULL THEN false
                            WHEN k = 'table' THEN NOT has_table_privilege(to_regclass(o), p)
                            ELSE NOT has_sequence_privilege(to_regclass(o), p) END,
                    current_user::text
             FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS t(o, k, p, n)
             ORDER BY n",
            &[&objects, &kinds, &privs],
        )
        .await
        .ctx("checking the role's privileges on schema outbox")?;
    let mut grants = Vec::new();
    let mut i = 0;
    for need in needs {
        let mut lacking = Vec::new();
        let mut user = String::new();
        for privilege in need.privileges {
            let row = &rows[i];
            i += 1;
            user = row.get(2);
            if row.get::<_, bool>(1) {
                lacking.push(*privilege);
            }
        }
        if !lacking.is_empty() {
            let name = format!("outbox.{}", need.object);
            let on = match need.kind {
                Kind::Table => name,
                Kind::Sequence => format!("SEQUENCE {name}"),
            };
            grants.push(format!(
                "GRANT {} ON {on} TO {}",
                lacking.join(", "),
                quote_role(&user)
            ));
        }
    }
    Ok(grants)
}

/// A role name as it must appear in a GRANT statement.
fn quote_role(name: &str) -> String {
    if !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
    {
        name.to_string()
    } else {
        format!("\"{}\"", name.replace('"', "\"\""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_role_name_is_quoted_only_when_it_must_be() {
        assert_eq!(quote_role("outboxd_relay"), "outboxd_relay");
        assert_eq!(quote_role("App"), "\"App\"");
        assert_eq!(quote_role("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_role("1x"), "\"1x\"");
    }

    #[test]
    fn every_ledger_sequence_belongs_to_a_ledger_table() {
        for s in RELAY_LEDGER.iter().filter(|n| n.kind == Kind::Sequence) {
            let owner = s.object.trim_end_matches("_id_seq");
            assert!(
                RELAY_LEDGER
                    .iter()
                    .any(|t| t.kind == Kind::Table && t.object == owner),
                "{} has no table {owner} in RELAY_LEDGER",
                s.object
            );
        }
    }
}
