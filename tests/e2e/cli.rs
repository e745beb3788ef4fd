//! The operator-facing commands: status, dev-broker, demo (the README's first command).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::ClientConfig;
use serde_json::json;

use crate::harness::TestEnv;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_counts_and_the_slot_in_json_and_as_a_table() {
    let env = TestEnv::new("status").await;
    let _relay = env.relay(&[], &[]);
    env.wait_streaming().await;
    for i in 0..3 {
        env.enqueue("s-1", json!({"i": i})).await;
    }
    env.wait_count("receipts", "SELECT count(*) FROM outbox.receipts", 3)
        .await;
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["status", "--json", "--database-url", &env.url])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["events"], 3);
    assert_eq!(v["published"], 3);
    assert_eq!(v["pending"], 0);
    let slot = v["slots"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["slot_name"] == env.slot.as_str())
        .expect("our slot is listed");
    assert_eq!(slot["slot_exists"], true);
    assert_eq!(slot["snapshot_done"], true);

    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["status", "--database-url", &env.url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("published") && text.contains(&env.slot),
        "{text}"
    );
}

#[test]
fn dev_broker_prints_its_bootstrap_servers_and_accepts_produce() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .arg("dev-broker")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let bootstrap = line
        .trim()
        .strip_prefix("bootstrap.servers=")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("message.timeout.ms", "10000")
        .create()
        .unwrap();
    producer
        .send(BaseRecord::to("dev.topic").key("k").payload("v"))
        .map_err(|(e, _)| e)
        .unwrap();
    producer.flush(Duration::from_secs(10)).unwrap();
    let msgs = crate::harness::read_topic(&bootstrap, "dev.topic");
    assert_eq!(msgs.len(), 1);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn demo_runs_the_embedded_default_and_publishes_every_committed_event() {
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["demo", "--duration-secs", "3", "--rate", "200"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("bootstrap.servers="), "{stdout}");
    assert!(stdout.contains("kcat -b"), "{stdout}");
    assert!(stdout.contains("events/s="), "live progress: {stdout}");
    let done = stdout
        .lines()
        .find(|l| l.starts_with("done:"))
        .expect("summary line");
    assert!(done.contains("unpublished=0"), "{done}");
}
