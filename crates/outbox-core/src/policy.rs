//! The one place that decides whether a PostgreSQL failure is worth a retry.
//!
//! The relay's answer to a transient failure is always the same: reconnect and replay from the
//! last checkpoint, which is safe (events are deduplicated by id) but only useful when time can
//! fix the cause. A revoked privilege, a table that is not there or a wrong password never go
//! away by themselves; retrying them forever hides the problem behind a growing lag. So every
//! failure the server names with a SQLSTATE is classified here, and the ones that need an
//! operator stop the relay with the fix.
//!
//! The two connections get different defaults for a code this table does not know. On the SQL
//! connection (ledger, snapshot, lease) an unknown code is retried: a replay never skips, and
//! the code is in the log. On the replication connection an unknown code is definite: the
//! walsender reports slot and WAL problems (a removed segment, an invalidated slot) that a
//! retry would only repeat.
//!
//! Pure: a SQLSTATE in, a decision out (PostgreSQL's Appendix A, "Error Codes").

/// Which connection reported the error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// A regular SQL connection: the ledger, the snapshot, the lease, the heartbeat.
    Sql,
    /// The walsender connection that streams the slot.
    Replication,
}

/// What to do about a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// Reconnect and replay from the last checkpoint.
    Retry,
    /// Stop: no retry can fix it. `fix` tells the operator what to do (empty when the server's
    /// own message is all there is to say).
    Fatal { fix: &'static str },
}

impl Recovery {
    pub fn is_retry(self) -> bool {
        self == Recovery::Retry
    }
}

/// The fix for a missing ledger object: the database is not (fully) migrated.
pub const FIX_MIGRATE: &str =
    "is the database migrated? run `outboxd migrate --database-url ...` as the schema owner";
/// The fix for a privilege a role lacks: each of the three roles has its script.
pub const FIX_GRANT: &str = "the role lacks a privilege: the relay's (`outboxd run`) is granted by docs/least_privilege.sql (`outboxd check` prints the missing GRANT statements); operator commands (status, reconcile, purge, consumers, share, migrate-destination, release) need a role granted outboxd_operator (docs/operator_role.sql); producers calling outbox.enqueue need outboxd_producer (docs/producer_role.sql)";

/// Classifies a failure by its SQLSTATE. `None` means the server named no code: the
/// connection broke, timed out or could not be opened, which is always worth a retry.
pub fn recovery(code: Option<&str>, channel: Channel) -> Recovery {
    let Some(code) = code else {
        return Recovery::Retry;
    };
    let fatal = |fix| Recovery::Fatal { fix };
    match code {
        // Privileges and objects: they do not come back by themselves.
        "42501" => fatal(FIX_GRANT),
        // undefined_table, invalid_schema_name, undefined_function, undefined_column
        "42P01" | "3F000" | "42883" | "42703" => fatal(FIX_MIGRATE),
        // invalid_authorization_specification, invalid_password
        "28000" | "28P01" => {
            fatal("check the user and password in --database-url, and pg_hba.conf")
        }
        // invalid_catalog_name: the database does not exist.
        "3D000" => fatal("check the database name in --database-url"),
        // data_corrupted, index_corrupted
        "XX001" | "XX002" => {
            fatal("the server reports corrupted data; repair it before the relay goes on")
        }
        // undefined_file: on the walsender, a WAL segment the slot needs was removed.
        "58P01" => fatal(""),
        // The server going away or coming back: admin/crash shutdown, cannot connect now,
        // connection exceptions, a standby that is not yet promoted (read-only transaction).
        "57P01" | "57P02" | "57P03" | "25006" => Recovery::Retry,
        // Object in use (the slot is briefly held by a walsender that is still exiting),
        // lock not available, statement cancelled by a timeout.
        "55006" | "55P03" | "57014" => Recovery::Retry,
        c if c.starts_with("08") => Recovery::Retry,
        // Serialization failures and deadlocks (class 40), insufficient resources (class 53:
        // disk full, out of memory, too many connections) pass with time.
        c if c.starts_with("40") || c.starts_with("53") => Recovery::Retry,
        _ => match channel {
            Channel::Sql => Recovery::Retry,
            Channel::Replication => fatal(""),
        },
    }
}

/// The fix to name beside an error whose SQLSTATE needs an operator, if there is one to say.
pub fn fix(code: &str, channel: Channel) -> Option<&'static str> {
    match recovery(Some(code), channel) {
        Recovery::Fatal { fix } if !fix.is_empty() => Some(fix),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_connection_is_retried_on_both_channels() {
        for ch in [Channel::Sql, Channel::Replication] {
            assert_eq!(recovery(None, ch), Recovery::Retry);
            assert_eq!(recovery(Some("08006"), ch), Recovery::Retry);
            assert_eq!(recovery(Some("57P01"), ch), Recovery::Retry);
            assert_eq!(recovery(Some("53300"), ch), Recovery::Retry);
        }
    }

    #[test]
    fn a_missing_privilege_or_object_is_fatal_with_its_fix() {
        for ch in [Channel::Sql, Channel::Replication] {
            assert_eq!(
                recovery(Some("42501"), ch),
                Recovery::Fatal { fix: FIX_GRANT }
            );
            for code in ["42P01", "3F000", "42883", "42703"] {
                assert_eq!(
                    recovery(Some(code), ch),
                    Recovery::Fatal { fix: FIX_MIGRATE }
                );
            }
            assert!(!recovery(Some("28P01"), ch).is_retry());
            assert!(!recovery(Some("3D000"), ch).is_retry());
        }
        assert_eq!(fix("42501", Channel::Sql), Some(FIX_GRANT));
        assert_eq!(
            fix("58P01", Channel::Replication),
            None,
            "fatal, nothing to add"
        );
        assert_eq!(fix("40001", Channel::Sql), None, "retried");
    }

    #[test]
    fn transaction_conflicts_are_retried() {
        for code in ["40001", "40P01", "55P03", "55006", "57014", "25006"] {
            assert!(recovery(Some(code), Channel::Sql).is_retry(), "{code}");
        }
    }

    #[test]
    fn an_unknown_code_is_retried_on_sql_and_definite_on_the_walsender() {
        // 23505 (a unique violation) in the ledger: replaying is safe and may resolve a race.
        assert!(recovery(Some("23505"), Channel::Sql).is_retry());
        assert!(recovery(Some("XX000"), Channel::Sql).is_retry());
        assert!(!recovery(Some("XX000"), Channel::Replication).is_retry());
        assert!(!recovery(Some("58P01"), Channel::Replication).is_retry());
    }
}
