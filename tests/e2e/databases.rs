//! One process relays several databases (`[[databases]]` in the config file): each has its
//! own slot, ledger and lease, every metric names its database, and a database that stops
//! stops only its own relay.

use std::collections::HashMap;

use outbox_testkit::ports::free_port;
use outbox_testkit::postgres::TestPostgres;
use outbox_testkit::wait::wait_for;
use serde_json::json;

use crate::harness::{connect, TestEnv, LONG};
use crate::observability::{sample, scrape, wait_ready_with};
use crate::ordering::first_occurrences;

/// Aggregates per database; events go round them, so each has several versions.
const AGGREGATES: usize = 4;

/// Enqueues `n` events round the aggregates, each in its own transaction; records (aggregate,
/// id) in `committed`.
async fn enqueue(env: &TestEnv, n: usize, committed: &mut Vec<(String, uuid::Uuid)>) {
    for _ in 0..n {
        let agg = format!("k{}", committed.len() % AGGREGATES);
        let id = env.enqueue(&agg, json!({"n": committed.len()})).await;
        committed.push((agg, id));
    }
}

/// Every committed event is on the broker where its receipt says (every receipt checked
/// against the topic), and each aggregate's first occurrences are its versions 1, 2, 3, ...
pub(crate) async fn assert_delivered_in_order(env: &TestEnv, committed: &[(String, uuid::Uuid)]) {
    env.wait_count(
        "a receipt for every committed event",
        "SELECT count(*) FROM outbox.receipts",
        committed.len() as i64,
    )
    .await;
    let check = env.verify_receipts(&[&env.topic]).await;
    assert!(check.checked >= committed.len(), "{check:?}");
    let on_broker: std::collections::HashSet<String> =
        check.messages.iter().map(|m| m.id().to_string()).collect();
    let lost: Vec<_> = committed
        .iter()
        .filter(|(_, id)| !on_broker.contains(&id.to_string()))
        .collect();
    assert!(lost.is_empty(), "lost: {lost:?}");
    let order = first_occurrences(&check.messages);
    let mut per_agg: HashMap<&str, i64> = HashMap::new();
    for (agg, _) in committed {
        *per_agg.entry(agg.as_str()).or_default() += 1;
    }
    for (agg, n) in per_agg {
        assert_eq!(
            order[agg],
            (1..=n).collect::<Vec<_>>(),
            "{agg}: out of order"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_relays_two_databases_and_one_stopped_does_not_stop_the_other() {
    let orders = TestEnv::new("many_orders").await;
    // A cluster of its own, so that the test can stop the whole server of one database.
    let billing_pg = TestPostgres::start_throwaway(None)
        .unwrap_or_else(|e| panic!("starting a second PostgreSQL cluster: {e}"));
    let mut billing = TestEnv::new_on(&billing_pg, "many_billing").await;
    let config = orders.dir.path().join("outboxd.toml");
    std::fs::write(
        &config,
        format!(
            "[kafka]\nbootstrap_servers = \"{}\"\n\n\
             [[databases]]\nname = \"orders\"\ndatabase_url = \"{}\"\nslot = \"{}\"\n\n\
             [[databases]]\nname = \"billing\"\ndatabase_url = \"{}\"\nslot = \"{}\"\n",
            orders.kafka.bootstrap_servers(),
            orders.url,
            orders.slot,
            billing.url,
            billing.slot
        ),
    )
    .unwrap();
    let port = free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let (mut sent_orders, mut sent_billing) = (Vec::new(), Vec::new());

    // Billing's server is down when the process starts: orders streams all the same, and
    // /readyz names billing.
    crash(&billing_pg, &billing).await;
    let mut relay = orders.relay_with_config(
        &config,
        &["--admin-addr", &addr, "--sample-interval-ms", "100"],
    );
    enqueue(&orders, 20, &mut sent_orders).await;
    orders
        .wait_count(
            "orders' receipts",
            "SELECT count(*) FROM outbox.receipts",
            20,
        )
        .await;
    wait_ready_with(
        port,
        503,
        "/readyz to name billing, and only billing",
        |body| body.contains("billing") && !body.contains("orders"),
    )
    .await;
    relay.assert_running();

    // Billing's server starts: its relay is started again by the process, which never
    // stopped.
    start_again(&billing_pg, &mut billing).await;
    enqueue(&billing, 20, &mut sent_billing).await;
    billing
        .wait_count(
            "billing's receipts",
            "SELECT count(*) FROM outbox.receipts",
            20,
        )
        .await;
    wait_ready_with(port, 200, "/readyz: both databases stream", |_| true).await;
    let text = scrape(port).await;
    for (db, slot) in [("orders", &orders.slot), ("billing", &billing.slot)] {
        let series = format!("outboxd_events_accepted_total{{database=\"{db}\",slot=\"{slot}\"}}");
        assert_eq!(sample(&text, &series), Some(20.0), "{series}:\n{text}");
        let streaming = format!("outboxd_streaming{{database=\"{db}\"}}");
        assert_eq!(sample(&text, &streaming), Some(1.0), "{streaming}:\n{text}");
    }

    // Billing's server stops while its relay streams (as a crash would): orders goes on.
    crash(&billing_pg, &billing).await;
    enqueue(&orders, 20, &mut sent_orders).await;
    orders
        .wait_count(
            "orders' receipts while billing is down",
            "SELECT count(*) FROM outbox.receipts",
            40,
        )
        .await;
    wait_ready_with(port, 503, "/readyz to name billing again", |body| {
        body.contains("billing") && !body.contains("orders")
    })
    .await;
    wait_for("billing's sampler to see it away", LONG, || async {
        let text = scrape(port).await;
        match (
            sample(&text, "outboxd_database_reachable{database=\"billing\"}"),
            sample(&text, "outboxd_database_reachable{database=\"orders\"}"),
            sample(&text, "outboxd_streaming{database=\"billing\"}"),
        ) {
            (Some(b), Some(o), Some(s)) if b == 0.0 && o == 1.0 && s == 0.0 => Ok(()),
            other => Err(format!(
                "billing reachable, orders reachable, billing streaming: {other:?}"
            )),
        }
    })
    .await;
    relay.assert_running();

    // Billing comes back: its relay resumes from its checkpoint.
    start_again(&billing_pg, &mut billing).await;
    enqueue(&billing, 20, &mut sent_billing).await;
    wait_ready_with(port, 200, "/readyz: both databases stream again", |_| true).await;
    relay.assert_running();

    assert_delivered_in_order(&orders, &sent_orders).await;
    assert_delivered_in_order(&billing, &sent_billing).await;
}

/// Stops the cluster as a crash would (`pg_ctl stop -m immediate`), after a CHECKPOINT: the
/// harness's clusters run with `synchronous_commit = off` for speed, so without it a crash
/// loses the last commits it acknowledged (in CI: the migration that had just run).
async fn crash(pg: &TestPostgres, env: &TestEnv) {
    env.db
        .batch_execute("CHECKPOINT")
        .await
        .expect("CHECKPOINT before the crash");
    pg.stop();
}

/// Starts the stopped cluster again and reconnects the test's client to it.
async fn start_again(pg: &TestPostgres, env: &mut TestEnv) {
    pg.start_again()
        .unwrap_or_else(|e| panic!("starting the billing cluster again: {e}"));
    env.db = connect(&env.url).await;
}
