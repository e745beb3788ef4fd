//! The commands that start their own servers: dev-broker, and demo (the README's first
//! command).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

#[test]
fn dev_broker_prints_its_bootstrap_servers_and_accepts_produce() {
    dev_broker_serves(&[]);
}

/// `--port`: the printed bootstrap is that port, and a producer and consumer given only it
/// work (the port forwards to the mock; clients learn the brokers from its metadata).
#[test]
fn dev_broker_serves_a_fixed_bootstrap_port() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let bootstrap = dev_broker_serves(&["--port", &port.to_string()]);
    assert_eq!(bootstrap, format!("127.0.0.1:{port}"));
}

/// Starts `dev-broker ARGS`, produces one message to the address it prints and reads it
/// back; returns that address.
fn dev_broker_serves(args: &[&str]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-embedded"))
        .arg("dev-broker")
        .args(args)
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
    let msgs = read_topic(&bootstrap, "dev.topic");
    assert_eq!(msgs.len(), 1);
    assert_eq!(msgs, ["v"]);
    let _ = child.kill();
    let _ = child.wait();
    bootstrap
}

#[test]
fn demo_runs_the_embedded_default_and_publishes_every_committed_event() {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-embedded"))
        .args(["demo", "--duration-secs", "4", "--rate", "200"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("bootstrap.servers="), "{stdout}");
    assert!(stdout.contains("events/s="), "live progress: {stdout}");
    // The point: the relay is SIGKILLed midway and nothing is lost.
    assert!(stdout.contains("SIGKILL the relay (pid "), "{stdout}");
    let done = stdout
        .lines()
        .find(|l| l.starts_with("done:"))
        .expect("summary line");
    assert!(done.contains(" 0 unpublished"), "{done}");
    let topic = stdout
        .lines()
        .find(|l| l.starts_with("topic outbox.event.order:"))
        .expect("the topic read back");
    assert!(topic.contains(" 0 missing"), "{topic}");
    assert!(
        stdout.contains("lost nothing: 0 unpublished, 0 missing"),
        "{stdout}"
    );
}

/// `demo --keep`: after its checks everything stays up, and the commands it prints work at
/// that moment (here the console's `SHOW STATUS` through psql); Ctrl-C ends it cleanly.
#[test]
fn demo_keep_leaves_it_running_with_commands_that_work() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-embedded"))
        .args(["demo", "--duration-secs", "3", "--rate", "100", "--keep"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut show_status = None;
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push(line.clone());
        if line.contains("-c 'SHOW STATUS'") {
            show_status = Some(line);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no SHOW STATUS command within 120 s:\n{}",
            seen.join("\n")
        );
    }
    let show_status = show_status.unwrap_or_else(|| panic!("demo ended:\n{}", seen.join("\n")));
    let port = show_status
        .split("-p ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("the console's port")
        .to_string();
    let psql = Command::new("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "outboxd",
            "-c",
            "SHOW STATUS",
        ])
        .output()
        .expect("psql (the PostgreSQL client, installed with the server binaries)");
    assert!(
        psql.status.success(),
        "{show_status}: {}{}",
        String::from_utf8_lossy(&psql.stdout),
        String::from_utf8_lossy(&psql.stderr)
    );
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGINT);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "demo --keep after Ctrl-C: {status}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "demo --keep did not stop on SIGINT"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The payloads of every partition of `topic`, from its low to its high watermark (both read
/// before the first fetch).
fn read_topic(bootstrap: &str, topic: &str) -> Vec<String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "outbox-embedded-test-reader")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let mut tpl = TopicPartitionList::new();
    let mut expected = 0;
    for p in md.topics()[0].partitions() {
        let (low, high) = consumer
            .fetch_watermarks(topic, p.id(), Duration::from_secs(10))
            .expect("watermarks");
        expected += usize::try_from(high - low).expect("high >= low");
        tpl.add_partition_offset(topic, p.id(), Offset::Offset(low))
            .expect("tpl");
    }
    consumer.assign(&tpl).expect("assign");
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while out.len() < expected {
        assert!(
            Instant::now() < deadline,
            "reading {topic} timed out after {} of {expected} messages",
            out.len()
        );
        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
            let m = m.expect("consume");
            out.push(String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned());
        }
    }
    out
}
