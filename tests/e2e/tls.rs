//! TLS to PostgreSQL: a separate throwaway cluster with `ssl = on` and a certificate signed
//! by a CA made in the test (openssl CLI). The relay must stream over TLS with
//! `sslmode=require` and `sslmode=verify-full` (given the CA), and must refuse a server whose
//! certificate does not chain to the CA it was given — on the SQL and the replication
//! connection alike.

use std::time::Duration;

use outbox_source::tls::PgConnectOptions;
use outbox_source::transport::{ReplicationConnection, TransportError};
use outbox_testkit::postgres::TestPostgres;
use outbox_testkit::tls::make_ca_and_server_cert;
use serde_json::json;

use crate::harness::{outboxd, TestEnv};

cdc_only! {
    "CDC only: TLS of the walsender connection; poll mode opens none";
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn relay_streams_over_tls_and_refuses_an_untrusted_server() {
        let certs = tempfile::tempdir().unwrap();
        let (ca, cert, key) = make_ca_and_server_cert(certs.path(), "test-ca");
        let (wrong_ca, _, _) = make_ca_and_server_cert(certs.path(), "other-ca");
        let pg = TestPostgres::start_throwaway_tls(&cert, &key).expect("start a TLS cluster");
        let mut env = TestEnv::new_on(&pg, "tls").await;
        let plain = env.url.clone();
        let require = format!("{plain}?sslmode=require");
        let verify_full = format!("{plain}?sslmode=verify-full&sslrootcert={}", ca.display());
        let wrong = format!(
            "{plain}?sslmode=verify-full&sslrootcert={}",
            wrong_ca.display()
        );

        // The server really speaks TLS to a verify-full client.
        let c = PgConnectOptions::parse(&verify_full)
            .unwrap()
            .connect_sql()
            .await
            .expect("verify-full SQL connection with the right CA");
        let ssl: bool = c
            .query_one(
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert!(ssl, "the verify-full connection is not encrypted");

        // The relay with sslmode=require, then with verify-full: each publishes, and its
        // walsender connection is encrypted.
        let walsenders_over_tls = format!(
            "SELECT count(*) FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)
             WHERE s.ssl AND r.application_name = 'outboxd'
               AND r.pid = (SELECT active_pid FROM pg_replication_slots WHERE slot_name = '{}')",
            env.slot
        );
        for (n, url) in [(1, &require), (2, &verify_full)] {
            env.url = url.clone();
            let mut relay = env.relay(&[], &[]);
            env.wait_streaming().await;
            env.wait_count(
                "the relay's walsender to be on TLS",
                &walsenders_over_tls,
                1,
            )
            .await;
            env.enqueue(&format!("a-{n}"), json!({"n": n})).await;
            env.wait_count(
                "the receipt over TLS",
                "SELECT count(*) FROM outbox.receipts",
                n,
            )
            .await;
            relay.signal(libc::SIGTERM);
            let status = relay.wait_exit(Duration::from_secs(30)).await;
            assert!(status.success(), "{}", relay.log_text());
        }
        assert_eq!(env.read_topic().await.len(), 2);

        // A CA that did not sign the server's certificate: the relay stops, naming the cause.
        env.url = wrong.clone();
        let mut relay = env.relay(&[], &[]);
        let status = relay.wait_exit(Duration::from_secs(60)).await;
        let log = relay.log_text();
        assert!(
            !status.success(),
            "the relay ran against an untrusted server"
        );
        assert!(
            log.contains("certificate verify failed"),
            "the error does not name the certificate: {log}"
        );
        // check reports how the session is protected.
        let (_, out) = outboxd(&["check", "--database-url", &verify_full]);
        assert!(
            out.contains("ok    database TLS") && out.contains("host name verified"),
            "{out}"
        );
        let (_, out) = outboxd(&["check", "--database-url", &require]);
        assert!(
            out.contains("WARN  database TLS") && out.contains("sslmode=verify-full"),
            "{out}"
        );
        let (ok, out) = outboxd(&["check", "--database-url", &wrong]);
        assert!(!ok, "check passed against an untrusted server: {out}");
        assert!(out.contains("certificate verify failed"), "{out}");

        // The replication client on its own: verify-full with the wrong CA is a TLS error,
        // with the right CA it connects.
        let opts = PgConnectOptions::parse(&wrong).unwrap();
        let err = ReplicationConnection::connect_with_tls(&opts.config, &opts.tls)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, TransportError::Tls(m) if m.contains("certificate verify failed")),
            "{err}"
        );
        let opts = PgConnectOptions::parse(&verify_full).unwrap();
        let c = ReplicationConnection::connect_with_tls(&opts.config, &opts.tls)
            .await
            .expect("replication connection with verify-full");
        c.close().await;

        // The right CA but a name the certificate does not carry: verify-full refuses (host name
        // check), verify-ca accepts (chain only) — on both connection kinds.
        let by_name = verify_full.replacen("127.0.0.1", "localhost", 1);
        let opts = PgConnectOptions::parse(&by_name).unwrap();
        let err = opts.connect_sql().await.unwrap_err().to_string();
        assert!(err.contains("certificate verify failed"), "{err}");
        let err = ReplicationConnection::connect_with_tls(&opts.config, &opts.tls)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, TransportError::Tls(m) if m.contains("hostname mismatch")),
            "{err}"
        );
        let verify_ca = by_name.replacen("sslmode=verify-full", "sslmode=verify-ca", 1);
        let opts = PgConnectOptions::parse(&verify_ca).unwrap();
        opts.connect_sql()
            .await
            .expect("verify-ca ignores the host name");
        ReplicationConnection::connect_with_tls(&opts.config, &opts.tls)
            .await
            .expect("verify-ca ignores the host name (replication)")
            .close()
            .await;
    }
}
