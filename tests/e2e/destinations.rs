//! Issue 31: a row's values are data, never destination syntax. `outbox.enqueue` replaces
//! `{aggregate_type}` / `{aggregate_id}` in a route's template with each value encoded for
//! its place (migration 0022): a URL path segment percent-encoded, a NATS subject token that
//! cannot add tokens or wildcards, a Kafka topic checked against Kafka's rules; what cannot be
//! encoded is refused in the producer's transaction with an error naming the value and rule.
//!
//! * `rendered_destinations_keep_their_shape_for_any_value`: generated values (proptest,
//!   arbitrary Unicode, separators, dots, percent signs) rendered by the database and parsed
//!   as the HTTP sink parses a URL (the `url` crate, reqwest's);
//! * `aggregate_ids_reach_only_their_own_url_path`: the four aggregate ids, through
//!   the relay, to a real HTTP endpoint that records every path;
//! * `nats_values_cannot_add_subject_tokens_or_wildcards`: through the relay to nats-server.

use outbox_testkit::http_target::{HttpTarget, TargetSettings};
use outbox_testkit::nats::{read_stream, TestNats};
use serde_json::json;

use crate::harness::TestEnv;

/// `s` with every `%XX` decoded (as bytes, then UTF-8).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap();
            out.push(u8::from_str_radix(hex, 16).unwrap());
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

fn unreserved(c: char) -> bool {
    c.is_ascii_alphanumeric() || "-._~".contains(c)
}

/// RFC 3986: unreserved characters kept, every other UTF-8 byte as `%XX` (upper case).
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if unreserved(b as char) && b.is_ascii() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

e2e_only! {
    use outbox_testkit::postgres::TestPostgres;
    use proptest::strategy::{Strategy, ValueTree};
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    use tokio_postgres::Client;

    use crate::harness::{connect, outboxd};

    /// A fresh migrated database of the shared cluster (no broker: nothing is published).
    async fn migrated(name: &str) -> (String, Client) {
        let url = TestPostgres::shared()
            .create_database(name)
            .await
            .expect("create database");
        let (ok, out) = outboxd(&["migrate", "--database-url", &url]);
        assert!(ok, "migrate: {out}");
        let db = connect(&url).await;
        (url, db)
    }

    /// `v` as PostgreSQL's `quote_literal` prints it in an error.
    fn pg_quote(v: &str) -> String {
        let q = v.replace('\'', "''");
        if v.contains('\\') {
            format!("E'{}'", q.replace('\\', "\\\\"))
        } else {
            format!("'{q}'")
        }
    }

    /// Values the generator below might miss, and the issue's.
    const EDGES: &[&str] = &[
        "",
        ".",
        "..",
        "...",
        "%",
        "%2e",
        "%2e%2e",
        "%2E%2E",
        "../../admin/delete",
        "%2e%2e/%2e%2e/metrics",
        "x?token=steal#frag",
        "a/b",
        "a\\b",
        "@evil.example",
        ":8080",
        "{aggregate_id}",
        "{aggregate_type}",
        "é",
        "\u{1F600}",
        " ",
        "\t",
        "a\nb",
        "*",
        ">",
        "a.b",
        "o-1",
    ];

    /// Edge values, then `n` generated: short strings over separators, dots, percent signs,
    /// braces and any printable Unicode; and long legal topic names around Kafka's 249.
    fn values(n: usize) -> Vec<String> {
        let mut runner = TestRunner::new_with_rng(
            Config::default(),
            TestRng::deterministic_rng(RngAlgorithm::ChaCha),
        );
        let short = proptest::collection::vec(
            proptest::prop_oneof![
                3 => "[./%?#*>@:{}\\\\ \t~_a-z0-9-]",
                1 => "\\PC",
                1 => "%[0-9a-fA-F]{2}",
            ],
            0..10,
        )
        .prop_map(|v| v.concat());
        let long = "[a-z._-]{225,245}";
        let mut out: Vec<String> = EDGES.iter().map(|s| s.to_string()).collect();
        for i in 0..n {
            let v = if i % 10 == 0 {
                long.new_tree(&mut runner).unwrap().current()
            } else {
                short.new_tree(&mut runner).unwrap().current()
            };
            out.push(v);
        }
        out
    }

    /// Renders `template` for each (type, id) pair in the database: `Ok(destination)` or
    /// `Err(the refusal's message)`.
    async fn render(
        db: &Client,
        kind: &str,
        template: &str,
        pairs: &[(String, String)],
    ) -> Vec<Result<String, String>> {
        let (types, ids): (Vec<&str>, Vec<&str>) =
            pairs.iter().map(|(t, i)| (t.as_str(), i.as_str())).unzip();
        db.query(
            "SELECT pg_temp.try_render($1, $2, t, i) FROM unnest($3::text[], $4::text[]) WITH ORDINALITY AS u(t, i, n) ORDER BY n",
            &[&kind, &template, &types, &ids],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            let v: String = r.get(0);
            match v.strip_prefix("ERR:") {
                Some(e) => Err(e.to_string()),
                None => Ok(v.strip_prefix("OK:").unwrap().to_string()),
            }
        })
        .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rendered_destinations_keep_their_shape_for_any_value() {
        let (url, db) = migrated("destinations").await;
        db.batch_execute(
            "CREATE FUNCTION pg_temp.try_render(k text, t text, a text, i text) RETURNS text
             LANGUAGE plpgsql AS $$
             BEGIN
                 RETURN 'OK:' || outbox.render_destination(k, t, a, i);
             EXCEPTION WHEN invalid_parameter_value THEN
                 RETURN 'ERR:' || SQLERRM;
             END $$",
        )
        .await
        .unwrap();
        let vals = values(400);
        // Each value as the aggregate id (type fixed), and as the type (id fixed).
        let mut pairs: Vec<(String, String)> = vals
            .iter()
            .map(|v| ("order".to_string(), v.clone()))
            .collect();
        pairs.extend(vals.iter().map(|v| (v.clone(), "o-1".to_string())));
        let mut problems = Vec::new();

        // HTTP: the template's scheme, host, port, path prefix and suffix stay; the path gains
        // exactly the two segments, each decoding to its value; refused only for '', '.', '..'.
        let template = "https://hooks.example:8443/base/{aggregate_type}/{aggregate_id}/tail";
        for ((t, i), r) in pairs
            .iter()
            .zip(render(&db, "http", template, &pairs).await)
        {
            let dots = |v: &str| v.is_empty() || v == "." || v == "..";
            match r {
                Err(e) => {
                    let bad = if dots(t) { t } else { i };
                    if !(dots(t) || dots(i)) || !e.contains(&pg_quote(bad)) {
                        problems.push(format!("http ({t:?}, {i:?}): refused: {e}"));
                    }
                }
                Ok(rendered) => {
                    let u = match url::Url::parse(&rendered) {
                        Ok(u) => u,
                        Err(e) => {
                            problems.push(format!("http ({t:?}, {i:?}): {rendered}: {e}"));
                            continue;
                        }
                    };
                    let segments: Vec<&str> = u.path_segments().map(|s| s.collect()).unwrap();
                    let ok = !dots(t)
                        && !dots(i)
                        && u.scheme() == "https"
                        && u.host_str() == Some("hooks.example")
                        && u.port() == Some(8443)
                        && u.username().is_empty()
                        && u.query().is_none()
                        && u.fragment().is_none()
                        && segments.len() == 4
                        && segments[0] == "base"
                        && segments[3] == "tail"
                        && percent_decode(segments[1]) == *t
                        && percent_decode(segments[2]) == *i
                        && segments[1] == percent_encode(t)
                        && segments[2] == percent_encode(i);
                    if !ok {
                        problems.push(format!("http ({t:?}, {i:?}): {rendered} parsed as {u}"));
                    }
                }
            }
        }

        // NATS: three tokens, the values themselves; refused only for a value that would add a
        // token or a wildcard (or is empty).
        let breaks_token = |v: &str| {
            v.is_empty()
                || v.chars()
                    .any(|c| ".*>".contains(c) || c.is_whitespace() || c.is_control())
        };
        for ((t, i), r) in pairs.iter().zip(
            render(
                &db,
                "nats",
                "outbox.{aggregate_type}.{aggregate_id}",
                &pairs,
            )
            .await,
        ) {
            match r {
                Err(e) => {
                    let bad = if breaks_token(t) { t } else { i };
                    if !(breaks_token(t) || breaks_token(i)) || !e.contains(&pg_quote(bad)) {
                        problems.push(format!("nats ({t:?}, {i:?}): refused: {e}"));
                    }
                }
                Ok(subject) => {
                    let tokens: Vec<&str> = subject.split('.').collect();
                    if tokens != ["outbox", t.as_str(), i.as_str()]
                        || breaks_token(t)
                        || breaks_token(i)
                    {
                        problems.push(format!("nats ({t:?}, {i:?}): subject {subject:?}"));
                    }
                }
            }
        }

        // Kafka: a legal topic (the template with the type in it) or refused.
        let legal = |topic: &str| {
            (1..=249).contains(&topic.len())
                && topic != "."
                && topic != ".."
                && topic
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        };
        for ((t, i), r) in pairs
            .iter()
            .zip(render(&db, "kafka", "outbox.event.{aggregate_type}", &pairs).await)
        {
            let expected = format!("outbox.event.{t}");
            match r {
                Err(e) => {
                    if (legal(&expected) && !t.is_empty()) || !e.contains(&pg_quote(t)) {
                        problems.push(format!("kafka ({t:?}, {i:?}): refused: {e}"));
                    }
                }
                Ok(topic) => {
                    if topic != expected || !legal(&topic) {
                        problems.push(format!("kafka ({t:?}, {i:?}): topic {topic:?}"));
                    }
                }
            }
        }
        assert!(
            problems.is_empty(),
            "{} of {} renderings broke a rule:\n{}",
            problems.len(),
            pairs.len() * 3,
            problems.join("\n")
        );

        // The routes refuse templates no value can make safe, naming the rule.
        for (sql, says) in [
            (
                "SELECT outbox.set_http_route('order', NULL, 'hook', 'http://{aggregate_id}.example/x')",
                "host, port or user info",
            ),
            (
                "SELECT outbox.set_http_route('order', NULL, 'hook', 'http://example:{aggregate_id}/x')",
                "host, port or user info",
            ),
            (
                "SELECT outbox.set_http_route('order', NULL, 'hook', 'http://{aggregate_type}@example/x')",
                "host, port or user info",
            ),
            (
                "SELECT outbox.set_route('order', NULL, '{aggregate_type}://example/x', 'hook', 'http')",
                "not an absolute",
            ),
            (
                "SELECT outbox.set_nats_route('order', NULL, 'nats', 'outbox.*.{aggregate_id}')",
                "wildcard",
            ),
            (
                "SELECT outbox.set_nats_route('order', NULL, 'nats', 'outbox..{aggregate_id}')",
                "empty",
            ),
            (
                "SELECT outbox.set_route('order', NULL, 'orders/{aggregate_type}')",
                "Kafka topic name may contain only",
            ),
        ] {
            let e = db.batch_execute(sql).await.expect_err(sql);
            let db_err = e.as_db_error().unwrap();
            assert!(
                db_err.code().code() == "22023" && db_err.message().contains(says),
                "{sql}: {db_err:?}"
            );
        }
        // ... and take the safe ones.
        db.batch_execute(
            "SELECT outbox.set_http_route('order', NULL, 'hook', 'http://example/h/{aggregate_id}?t={aggregate_type}#{aggregate_id}');
             SELECT outbox.set_nats_route('invoice', NULL, 'nats');",
        )
        .await
        .unwrap();

        // Kafka, as the issue found it: an aggregate type that cannot name a topic is refused by
        // outbox.enqueue in the producer's transaction (no version taken, no event), not
        // quarantined by the broker later.
        for (agg, says) in [
            (
                "bad type/x".to_string(),
                "'bad type/x' cannot be part of the Kafka topic".to_string(),
            ),
            (
                "t".repeat(300),
                "is not a legal topic name: 1 to 249".to_string(),
            ),
        ] {
            let e = db
                .query_one(
                    "SELECT outbox.enqueue($1, 'a-1', 'happened', '{}'::jsonb)",
                    &[&agg],
                )
                .await
                .expect_err("an illegal topic enqueued");
            let db_err = e.as_db_error().unwrap();
            assert!(
                db_err.code().code() == "22023" && db_err.message().contains(&says),
                "{agg}: {db_err:?}"
            );
        }
        // A row captured from a Debezium-style table goes through outbox.enqueue: the producer's
        // INSERT is refused the same way, naming the value.
        db.batch_execute(
            "CREATE TABLE public.app_outbox (id uuid, aggregatetype text, aggregateid text,
                                             type text, payload jsonb);
             SELECT outbox.install_debezium_capture('public.app_outbox');",
        )
        .await
        .unwrap();
        let e = db
            .batch_execute(
                "INSERT INTO public.app_outbox VALUES (gen_random_uuid(), 'bad type/x', 'a-1', 'happened', '{}')",
            )
            .await
            .expect_err("a captured row with an illegal topic");
        let db_err = e.as_db_error().unwrap();
        assert!(
            db_err.code().code() == "22023"
                && db_err
                    .message()
                    .contains("'bad type/x' cannot be part of the Kafka topic"),
            "{db_err:?}"
        );
        assert_eq!(
            db.query_one(
                "SELECT (SELECT count(*) FROM outbox.events) + (SELECT count(*) FROM outbox.aggregate_versions)",
                &[]
            )
            .await
            .unwrap()
            .get::<_, i64>(0),
            0
        );

        // Events frozen before the fix (written here as the old outbox.enqueue froze them, the id
        // pasted in): `outboxd check` names each, with the destination the rules give, or why
        // they refuse it.
        let frozen: Vec<(uuid::Uuid, &str)> = ["../../admin/delete", ".."]
            .into_iter()
            .map(|id| (uuid::Uuid::new_v4(), id))
            .collect();
        for (event, id) in &frozen {
            db.execute(
                "INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_version,
                     event_type, payload, payload_digest, dest_kind, dest_cluster, dest_topic, dest_key,
                     dest_partitioner, dest_route_generation, dest_serializer, dest_acks,
                     destination_digest)
                 SELECT $1, 'order', $2, 1, 'order.created', '{}', 'sha256:x', 'http', 'hook',
                        'http://example/h/' || $2 || '?t=order#' || $2, $2, 'none', rp.generation,
                        'json', 'all', 'sha256:x'
                 FROM outbox.route_policy rp WHERE rp.active AND rp.aggregate_type = 'order'",
                &[event, id],
            )
            .await
            .unwrap();
        }
        let config = std::env::temp_dir().join(format!("destinations-{}.toml", std::process::id()));
        std::fs::write(&config, "sink = \"http\"\n[http]\nendpoint = \"hook\"\n").unwrap();
        let (_, out) = outboxd(&[
            "check",
            "--database-url",
            &url,
            "--config",
            config.to_str().unwrap(),
        ]);
        let _ = std::fs::remove_file(&config);
        let line = out
            .lines()
            .find(|l| l.contains("frozen destinations"))
            .unwrap_or_else(|| panic!("check names no frozen destination:\n{out}"));
        assert!(
            line.starts_with("WARN")
                && line.contains("2 unpublished event(s)")
                && line.contains(&format!(
                    "{} frozen for http://example/h/../../admin/delete?t=order#../../admin/delete (the rules give http://example/h/..%2F..%2Fadmin%2Fdelete?t=order#..%2F..%2Fadmin%2Fdelete)",
                    frozen[0].0
                ))
                && line.contains(&format!("{} frozen for", frozen[1].0))
                && line.contains("aggregate_id '..' cannot be placed in the URL")
                && line.contains("outboxd migrate-destination"),
            "{line}"
        );
        // `outboxd reconcile` counts them as findings (non-zero exit) and lists each.
        let (ok, out) = outboxd(&["reconcile", "--database-url", &url, "--no-broker", "--json"]);
        assert!(!ok, "reconcile found nothing: {out}");
        let report: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("reconcile --json: {e}: {out}"));
        let bad = &report["bad_destination"];
        assert_eq!(bad["total"], 2, "{report:#}");
        let listed: std::collections::BTreeMap<String, (serde_json::Value, serde_json::Value)> = bad
            ["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                (
                    i["event_id"].as_str().unwrap().to_string(),
                    (i["rendered"].clone(), i["reason"].clone()),
                )
            })
            .collect();
        assert_eq!(
            listed[&frozen[0].0.to_string()].0,
            json!("http://example/h/..%2F..%2Fadmin%2Fdelete?t=order#..%2F..%2Fadmin%2Fdelete"),
            "{report:#}"
        );
        assert!(
            listed[&frozen[1].0.to_string()].0.is_null()
                && listed[&frozen[1].0.to_string()]
                    .1
                    .as_str()
                    .is_some_and(|r| r.contains("aggregate_id '..'")),
            "{report:#}"
        );
        // An event an operator moved (a destination migration recorded, as migrate-destination
        // records it) is theirs: no longer named.
        db.execute(
            "INSERT INTO outbox.destination_migrations (event_id, envelope_generation,
                 from_destination_digest, dest_kind, dest_cluster, dest_topic, dest_key,
                 dest_partitioner, dest_route_generation, dest_serializer, dest_acks,
                 destination_digest, proof, reason, migrated_by)
             SELECT event_id, 2, destination_digest, 'http', 'hook', 'http://example/moved', dest_key,
                    'none', dest_route_generation, 'json', 'all', 'sha256:y', 'test', 'test', 'test'
             FROM outbox.events WHERE event_id = $1",
            &[&frozen[0].0],
        )
        .await
        .unwrap();
        let (_, out) = outboxd(&["reconcile", "--database-url", &url, "--no-broker", "--json"]);
        let report: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(report["bad_destination"]["total"], 1, "{report:#}");
        assert_eq!(
            report["bad_destination"]["items"][0]["event_id"],
            json!(frozen[1].0.to_string())
        );
    }
}

/// The four aggregate ids, through the relay, reach `/hooks/order/<the id, encoded>`
/// and nowhere else, each with the configured credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregate_ids_reach_only_their_own_url_path() {
    let env = TestEnv::new("http_paths").await;
    let target = HttpTarget::start(TargetSettings::default())
        .await
        .expect("start the HTTP endpoint");
    env.db
        .query_one(
            "SELECT outbox.set_http_route('order', NULL, 'hooks-api', $1)",
            &[&target.url("/hooks/{aggregate_type}/{aggregate_id}")],
        )
        .await
        .expect("route order events to the endpoint");
    let ids = [
        "o-1",
        "../../admin/delete",
        "%2e%2e/%2e%2e/metrics",
        "x?token=steal#frag",
    ];
    let mut expected = std::collections::BTreeMap::new();
    for id in ids {
        let event: uuid::Uuid = env
            .db
            .query_one(
                "SELECT outbox.enqueue('order', $1, 'order.created', '{}'::jsonb)",
                &[&id],
            )
            .await
            .unwrap_or_else(|e| panic!("enqueue {id:?}: {e}"))
            .get(0);
        expected.insert(
            event.to_string(),
            format!("/hooks/order/{}", percent_encode(id)),
        );
    }
    let config = env.write_config(
        "sink = \"http\"\n[http]\nendpoint = \"hooks-api\"\n\
         [http.headers]\nAuthorization = \"Bearer t0ken\"\n",
    );
    let mut relay = env.relay(&[], &["--config", &config]);
    env.wait_count(
        "a receipt for each of the four events",
        "SELECT count(*) FROM outbox.receipts",
        4,
    )
    .await;
    relay.assert_running();
    let requests = target.requests();
    let mut seen = std::collections::BTreeMap::new();
    for r in &requests {
        let key = r
            .headers
            .get("idempotency-key")
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            Some(&r.path),
            expected.get(&key),
            "event {key} went to {} (all requests: {:?})",
            r.path,
            requests.iter().map(|r| &r.path).collect::<Vec<_>>()
        );
        seen.insert(key, r.path.clone());
    }
    assert_eq!(seen, expected, "not every event reached its path");
    // Each event applied once (no answer here was unclear: nothing called for a second send),
    // only the committed ones, and each receipt keeps the digest of the body it was answered.
    target.assert_at_most_once();
    target.assert_applied_within(expected.keys().map(String::as_str));
    for r in env
        .db
        .query(
            "SELECT event_id::text, evidence ->> 'body_sha256' FROM outbox.receipts",
            &[],
        )
        .await
        .unwrap()
    {
        let digest: Option<String> = r.get(1);
        target.assert_body_digest(r.get(0), digest.as_deref().unwrap_or("(none)"));
    }
    // Each path's last segment decodes to the aggregate id itself.
    let decoded: std::collections::BTreeSet<String> = seen
        .values()
        .map(|p| percent_decode(p.strip_prefix("/hooks/order/").unwrap()))
        .collect();
    assert_eq!(
        decoded,
        ids.iter().map(|s| s.to_string()).collect(),
        "the endpoint cannot read back the ids"
    );
    // What was frozen is the encoded URL.
    for (event, path) in &expected {
        let frozen: String = env
            .db
            .query_one(
                &format!("SELECT dest_topic FROM outbox.events_frozen WHERE event_id = '{event}'"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(frozen, target.url(path));
    }
}

/// NATS: a value that would add subject tokens or wildcards is refused at enqueue, naming the
/// value; the others are published to `outbox.<type>.<id>`, one token each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_values_cannot_add_subject_tokens_or_wildcards() {
    let env = TestEnv::new("nats_tokens").await;
    let nats = TestNats::start("nats_tokens").expect("start nats-server");
    env.route_to_nats(nats.name()).await;
    for bad in ["a.b", "*", ">", "a b", "orders.>"] {
        let e = env
            .db
            .query_one(
                "SELECT outbox.enqueue($1, $2, 'test.happened', '{}'::jsonb)",
                &[&env.aggregate_type, &bad],
            )
            .await
            .expect_err(bad);
        let db_err = e.as_db_error().unwrap();
        assert!(
            db_err.code().code() == "22023"
                && db_err.message().contains(&format!("aggregate_id '{bad}'"))
                && db_err.message().contains("subject token"),
            "{bad}: {db_err:?}"
        );
    }
    assert_eq!(env.count("SELECT count(*) FROM outbox.events").await, 0);
    let good = ["ok-1", "ü-2", "x%2e{y}"];
    for id in good {
        env.enqueue(id, json!({"id": id})).await;
    }
    let url = nats.url();
    let _relay = env.relay(
        &[],
        &[
            "--sink",
            "nats",
            "--nats-url",
            &url,
            "--nats-stream",
            "OUTBOX",
            "--nats-create-stream",
            "--cluster-name",
            nats.name(),
        ],
    );
    env.wait_count(
        "a receipt for each accepted event",
        "SELECT count(*) FROM outbox.receipts",
        good.len() as i64,
    )
    .await;
    let mut subjects: Vec<String> = read_stream(&url, "OUTBOX")
        .await
        .unwrap_or_else(|e| panic!("{e}\nserver log:\n{}", nats.log_text()))
        .into_iter()
        .map(|m| m.subject)
        .collect();
    subjects.sort();
    let mut expected: Vec<String> = good
        .iter()
        .map(|id| format!("outbox.{}.{id}", env.aggregate_type))
        .collect();
    expected.sort();
    assert_eq!(subjects, expected);
}
