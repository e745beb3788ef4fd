//! Integration tests of the replication transport against a real PostgreSQL (15+) with
//! `wal_level=logical`.
//!
//! `OUTBOXD_TEST_DATABASE_URL` may name a superuser URL over TCP, e.g.
//! `postgresql://postgres@127.0.0.1:55998/postgres`; without it the tests use the harness's
//! throwaway cluster (`outbox-testkit`), whose pg_hba.conf already has the lines below.
//!
//! The password tests need pg_hba.conf to require passwords for two roles the tests create
//! themselves (first matching line wins, so put these before any `trust` line):
//!
//! ```text
//! host all outboxd_test_md5   127.0.0.1/32 md5
//! host all outboxd_test_scram 127.0.0.1/32 scram-sha-256
//! ```
//!
//! If a wrong password is accepted (the role is trusted), those tests fail naming the line to
//! add; a server without a local Unix socket fails `unix_socket_connection` the same way. A
//! server that cannot run a test is a failure that says what to change, never a silent pass.
//! Every test uses its own slot/table/publication names, so they can run in parallel.

use std::time::Duration;

use outbox_source::transport::{
    format_lsn, parse_lsn, Config, ReplicationConnection, ReplicationMessage, TransportError,
};
use tokio_postgres::config::Host;
use tokio_postgres::NoTls;

const ENV: &str = "OUTBOXD_TEST_DATABASE_URL";

fn config() -> Config {
    match std::env::var(ENV) {
        Ok(url) if !url.is_empty() => url.parse().expect("OUTBOXD_TEST_DATABASE_URL"),
        // Without the variable, the harness's throwaway cluster (one per test process).
        _ => outbox_testkit::postgres::TestPostgres::shared()
            .url("postgres")
            .parse()
            .expect("harness URL"),
    }
}

/// A plain (non-replication) client for setup and for observing the server.
async fn admin(cfg: &Config) -> tokio_postgres::Client {
    let (client, conn) = cfg.connect(NoTls).await.expect("admin connection");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// A copy of `cfg` with user and database but no hosts, ports or password (`Config` can
/// append hosts and set a password, but not remove them).
fn without_hosts_or_password(cfg: &Config) -> Config {
    let mut c = Config::new();
    if let Some(u) = cfg.get_user() {
        c.user(u);
    }
    if let Some(d) = cfg.get_dbname() {
        c.dbname(d);
    }
    c
}

/// A per-process unique suffix so reruns and parallel tests don't collide.
fn unique(name: &str) -> String {
    format!("outboxd_tr_{name}_{}", std::process::id())
}

async fn drop_slot_if_exists(admin: &tokio_postgres::Client, slot: &str) {
    // The slot may still be active for a moment after its walsender exits.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = admin
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                 WHERE slot_name = $1",
                &[&slot],
            )
            .await;
        match r {
            Ok(_) => return,
            Err(e) if tokio::time::Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("dropping slot {slot}: {e}"),
        }
    }
}

#[tokio::test]
async fn identify_system_and_simple_query() {
    let cfg = config();
    let mut c = ReplicationConnection::connect(&cfg).await.unwrap();
    assert!(c.parameter("server_version").is_some());
    assert!(c.backend_pid().is_some());

    let id = c.identify_system().await.unwrap();
    assert!(!id.system_id.is_empty() && id.system_id.bytes().all(|b| b.is_ascii_digit()));
    assert!(id.timeline >= 1);
    assert!(id.xlogpos > 0);
    assert_eq!(
        id.dbname.as_deref(),
        Some(cfg.get_dbname().or(cfg.get_user()).unwrap())
    );

    // SQL works on a replication=database connection; the last result set is returned.
    let rows = c
        .simple_query("SELECT 0 AS z; SELECT 1 AS a, NULL::text AS b, 'x''y' AS c")
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].get("a"), Some("1"));
    assert_eq!(rows[0].get("b"), None);
    assert_eq!(rows[0].get("c"), Some("x'y"));
    assert_eq!(rows[0].get("z"), None);
    assert!(c.simple_query("").await.unwrap().is_empty());

    // Errors are reported with their SQLSTATE and leave the connection usable.
    let err = c.simple_query("SELECT 1/0").await.unwrap_err();
    assert_eq!(err.sqlstate(), Some("22012"), "{err}");
    assert!(err.to_string().contains("(SQLSTATE 22012)"), "{err}");
    let rows = c.simple_query("SELECT 2 AS n").await.unwrap();
    assert_eq!(rows[0].get("n"), Some("2"));

    // application_name defaults to outboxd.
    let pid = c.backend_pid().unwrap();
    let rows = c
        .simple_query(&format!(
            "SELECT application_name FROM pg_stat_activity WHERE pid = {pid}"
        ))
        .await
        .unwrap();
    assert_eq!(rows[0].get("application_name"), Some("outboxd"));
    c.close().await;
}

#[tokio::test]
async fn unix_socket_connection() {
    let cfg = config();
    let admin = admin(&cfg).await;
    let dirs: String = admin
        .query_one("SHOW unix_socket_directories", &[])
        .await
        .unwrap()
        .get(0);
    let port: String = admin.query_one("SHOW port", &[]).await.unwrap().get(0);
    let Some(dir) = dirs
        .split(',')
        .map(str::trim)
        .find(|d| !d.is_empty() && !d.starts_with('@') && std::path::Path::new(d).is_dir())
    else {
        panic!(
            "the server's unix_socket_directories ({dirs:?}) name no directory on this machine, so \
             the Unix-socket transport cannot be tested: point {ENV} at a local server, or unset \
             it to use the harness's throwaway cluster"
        );
    };
    // A fresh config: `host_path` on a clone would append, leaving TCP as the first host.
    let mut ucfg = without_hosts_or_password(&cfg);
    ucfg.host_path(dir)
        .port(port.parse().unwrap())
        .application_name("outboxd-unix-test");
    if let Some(p) = cfg.get_password() {
        ucfg.password(p);
    }
    let mut c = ReplicationConnection::connect(&ucfg).await.unwrap();
    let id = c.identify_system().await.unwrap();
    assert!(id.xlogpos > 0);
    let pid = c.backend_pid().unwrap();
    let rows = c
        .simple_query(&format!(
            "SELECT application_name, client_port FROM pg_stat_activity WHERE pid = {pid}"
        ))
        .await
        .unwrap();
    assert_eq!(rows[0].get("application_name"), Some("outboxd-unix-test"));
    // client_port is -1 for Unix sockets.
    assert_eq!(rows[0].get("client_port"), Some("-1"));
    c.close().await;
}

#[tokio::test]
async fn missing_slot_is_42704() {
    let cfg = config();
    let c = ReplicationConnection::connect(&cfg).await.unwrap();
    let err = c
        .start_logical_replication(&unique("no_such_slot"), 0, &[])
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Server { .. }), "{err}");
    assert_eq!(err.sqlstate(), Some("42704"), "{err}");
}

/// Parses the end LSN out of a pgoutput Commit message:
/// 'C', flags u8, commit LSN u64, end LSN u64, timestamp i64.
fn commit_end_lsn(data: &[u8]) -> u64 {
    assert_eq!(data[0], b'C');
    u64::from_be_bytes(data[10..18].try_into().unwrap())
}

#[tokio::test]
async fn slot_snapshot_stream_and_feedback() {
    let cfg = config();
    let admin = admin(&cfg).await;
    let table = unique("t");
    let publication = unique("pub");
    let slot = unique("slot");
    drop_slot_if_exists(&admin, &slot).await;
    admin
        .batch_execute(&format!(
            "DROP PUBLICATION IF EXISTS {publication};
             DROP TABLE IF EXISTS {table};
             CREATE TABLE {table} (id bigint PRIMARY KEY, body text);
             INSERT INTO {table} VALUES (1, 'before the slot');
             CREATE PUBLICATION {publication} FOR TABLE {table};"
        ))
        .await
        .unwrap();

    let mut c = ReplicationConnection::connect(&cfg).await.unwrap();
    let created = c.create_logical_slot(&slot, true).await.unwrap();
    assert_eq!(created.slot_name, slot);
    assert!(created.consistent_point > 0);
    assert_eq!(created.output_plugin.as_deref(), Some("pgoutput"));
    let snapshot = created.snapshot_name.clone().expect("exported snapshot");

    // Rows written after the slot exists must not be visible in the exported snapshot,
    // and must come through the stream instead.
    admin
        .batch_execute(&format!(
            "BEGIN; INSERT INTO {table} VALUES (2, 'after'), (3, 'after'); COMMIT;"
        ))
        .await
        .unwrap();
    {
        let (mut reader, conn) = cfg.connect(NoTls).await.unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let tx = reader
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .start()
            .await
            .unwrap();
        tx.batch_execute(&format!("SET TRANSACTION SNAPSHOT '{snapshot}'"))
            .await
            .unwrap();
        let n: i64 = tx
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            n, 1,
            "the exported snapshot sees only rows from before the slot"
        );
        tx.rollback().await.unwrap();
    }

    let mut stream = c
        .start_logical_replication(
            &slot,
            0,
            &[("proto_version", "1"), ("publication_names", &publication)],
        )
        .await
        .unwrap();

    // Expect Begin, Relation, Insert, Insert, Commit (keepalives may be interleaved).
    let mut kinds = Vec::new();
    let mut commit_end = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while commit_end.is_none() {
        let msg = tokio::time::timeout_at(deadline, stream.next_message())
            .await
            .expect("timed out waiting for the transaction")
            .unwrap()
            .expect("stream ended early");
        match msg {
            ReplicationMessage::XLogData {
                wal_start,
                wal_end,
                data,
                ..
            } => {
                assert!(wal_end >= wal_start);
                kinds.push(data[0]);
                if data[0] == b'C' {
                    commit_end = Some(commit_end_lsn(&data));
                }
            }
            ReplicationMessage::Keepalive {
                wal_end,
                reply_requested,
                ..
            } => {
                if reply_requested {
                    stream
                        .send_standby_status(wal_end, 0, 0, false)
                        .await
                        .unwrap();
                }
            }
        }
    }
    assert_eq!(kinds, b"BRIIC", "{:?}", String::from_utf8_lossy(&kinds));
    let commit_end = commit_end.unwrap();
    assert!(commit_end > created.consistent_point);

    // Confirm the commit; confirmed_flush_lsn must move up to it.
    stream
        .send_standby_status(commit_end, commit_end, commit_end, false)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let confirmed: Option<String> = admin
            .query_one(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .unwrap()
            .get(0);
        let confirmed = confirmed.as_deref().and_then(parse_lsn).unwrap_or(0);
        if confirmed >= commit_end {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "confirmed_flush_lsn stuck at {} (want {})",
            format_lsn(confirmed),
            format_lsn(commit_end)
        );
        // Keep the stream read so the walsender is never blocked on a full socket.
        let _ = tokio::time::timeout(Duration::from_millis(50), stream.next_message()).await;
    }

    // reply_requested = true: the walsender answers at once with a keepalive.
    stream
        .send_standby_status(commit_end, commit_end, commit_end, true)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let msg = tokio::time::timeout_at(deadline, stream.next_message())
            .await
            .expect("no keepalive in answer to reply_requested")
            .unwrap()
            .expect("stream ended early");
        if let ReplicationMessage::Keepalive { wal_end, .. } = msg {
            assert!(wal_end >= commit_end);
            break;
        }
    }

    // Ending the copy returns a usable command connection; drop the slot through it.
    let mut c = stream.finish().await.unwrap();
    c.simple_query(&format!("DROP_REPLICATION_SLOT \"{slot}\" WAIT"))
        .await
        .unwrap();
    c.close().await;
    admin
        .batch_execute(&format!(
            "DROP PUBLICATION {publication}; DROP TABLE {table};"
        ))
        .await
        .unwrap();
}

#[tokio::test]
async fn create_slot_without_snapshot_and_duplicate() {
    let cfg = config();
    let admin = admin(&cfg).await;
    let slot = unique("nosnap");
    drop_slot_if_exists(&admin, &slot).await;
    let mut c = ReplicationConnection::connect(&cfg).await.unwrap();
    let created = c.create_logical_slot(&slot, false).await.unwrap();
    assert_eq!(created.snapshot_name, None);
    // A second slot of the same name: duplicate_object, connection still usable.
    let err = c.create_logical_slot(&slot, false).await.unwrap_err();
    assert_eq!(err.sqlstate(), Some("42710"), "{err}");
    c.identify_system().await.unwrap();
    // A name the server rejects (slot names are [a-z0-9_]) is quoted, not injected.
    let err = c
        .create_logical_slot("Bad\" LOGICAL x; --", false)
        .await
        .unwrap_err();
    // PostgreSQL refuses it as an invalid name (42602) or, in releases whose replication
    // command scanner reads a doubled quote as the end of the identifier, as a syntax error
    // (42601, seen on 15.18). Either way nothing after the quote ran: no slot was created and
    // the connection still answers.
    assert!(
        matches!(err.sqlstate(), Some("42602" | "42601")),
        "{err} ({:?})",
        err.sqlstate()
    );
    let injected: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name <> $1 AND slot_name ~ '(?i)bad|^x$'",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(injected, 0, "a slot was created from the hostile name");
    c.identify_system().await.unwrap();
    c.close().await;
    drop_slot_if_exists(&admin, &slot).await;
}

#[tokio::test]
async fn terminated_walsender_is_a_server_error() {
    let cfg = config();
    let admin = admin(&cfg).await;
    let slot = unique("killed");
    drop_slot_if_exists(&admin, &slot).await;
    let mut c = ReplicationConnection::connect(&cfg).await.unwrap();
    c.create_logical_slot(&slot, false).await.unwrap();
    let pid = c.backend_pid().unwrap();
    let publication = unique("killed_pub");
    admin
        .batch_execute(&format!(
            "DROP PUBLICATION IF EXISTS {publication}; CREATE PUBLICATION {publication};"
        ))
        .await
        .unwrap();
    let mut stream = c
        .start_logical_replication(
            &slot,
            0,
            &[("proto_version", "1"), ("publication_names", &publication)],
        )
        .await
        .unwrap();
    let terminated: bool = admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap()
        .get(0);
    assert!(terminated);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let err = loop {
        match tokio::time::timeout_at(deadline, stream.next_message())
            .await
            .expect("the stream should fail after pg_terminate_backend")
        {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("terminated walsender ended the copy cleanly"),
            Err(e) => break e,
        }
    };
    // 57P01 admin_shutdown ("terminating connection due to administrator command").
    assert_eq!(err.sqlstate(), Some("57P01"), "{err}");
    // Afterwards the socket is at EOF.
    assert!(matches!(
        stream.next_message().await,
        Err(TransportError::Closed)
    ));
    drop_slot_if_exists(&admin, &slot).await;
    admin
        .batch_execute(&format!("DROP PUBLICATION {publication};"))
        .await
        .unwrap();
}

/// Creates (or resets) a LOGIN REPLICATION role whose password is stored with `encryption`.
async fn password_role(
    admin: &tokio_postgres::Client,
    role: &str,
    password: &str,
    encryption: &str,
) {
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN
               IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
                 CREATE ROLE {role} LOGIN REPLICATION;
               END IF;
             END $$;
             SET password_encryption = '{encryption}';
             ALTER ROLE {role} LOGIN REPLICATION PASSWORD '{password}';
             RESET password_encryption;"
        ))
        .await
        .unwrap();
}

async fn password_login(role: &str, encryption: &str) {
    let cfg = config();
    let admin = admin(&cfg).await;
    let password = format!("pw-{encryption}-ü");
    password_role(&admin, role, &password, encryption).await;
    let stored: String = admin
        .query_one(
            "SELECT rolpassword FROM pg_authid WHERE rolname = $1",
            &[&role],
        )
        .await
        .unwrap()
        .get(0);
    let prefix = if encryption == "md5" {
        "md5"
    } else {
        "SCRAM-SHA-256$"
    };
    assert!(stored.starts_with(prefix), "{stored}");

    let mut rcfg = cfg.clone();
    rcfg.user(role).password("definitely wrong");
    let err = match ReplicationConnection::connect(&rcfg).await {
        Ok(c) => {
            c.close().await;
            panic!(
                "the server accepted a wrong password for {role}: its pg_hba.conf does not \
                 require one, so {encryption} authentication cannot be tested. Add \
                 `host all {role} 127.0.0.1/32 {encryption}` before any `trust` line, or unset \
                 {ENV} to use the harness's throwaway cluster"
            );
        }
        Err(e) => e,
    };
    assert!(
        matches!(err, TransportError::Server { .. } | TransportError::Auth(_)),
        "{err}"
    );
    assert!(err.to_string().contains(role), "{err}");
    assert_eq!(err.sqlstate(), Some("28P01"), "{err}");

    // No password at all: refused locally, naming the user.
    let mut nocfg = without_hosts_or_password(&cfg);
    for h in cfg.get_hosts() {
        match h {
            Host::Tcp(h) => nocfg.host(h),
            Host::Unix(p) => nocfg.host_path(p),
        };
    }
    for p in cfg.get_ports() {
        nocfg.port(*p);
    }
    nocfg.user(role);
    let err = ReplicationConnection::connect(&nocfg).await.unwrap_err();
    assert!(matches!(err, TransportError::Auth(_)), "{err}");
    assert!(err.to_string().contains(role), "{err}");

    rcfg.password(password.as_str());
    let mut c = ReplicationConnection::connect(&rcfg).await.unwrap();
    let id = c.identify_system().await.unwrap();
    assert!(id.xlogpos > 0);
    let rows = c.simple_query("SELECT current_user AS u").await.unwrap();
    assert_eq!(rows[0].get("u"), Some(role));
    c.close().await;
}

#[tokio::test]
async fn md5_login() {
    password_login("outboxd_test_md5", "md5").await;
}

#[tokio::test]
async fn scram_login() {
    password_login("outboxd_test_scram", "scram-sha-256").await;
}
