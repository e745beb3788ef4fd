//! Shared helpers: a per-test environment, the relay child process, topic reads, and the
//! invariant-5 sampler (confirmed LSN never passes an unaccepted event).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_testkit::kafka::TestKafka;
use outbox_testkit::postgres::TestPostgres;
use outbox_testkit::wait::wait_for;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use tokio_postgres::{Client, NoTls};

pub const LONG: Duration = Duration::from_secs(90);

static SEQ: AtomicU64 = AtomicU64::new(0);

/// One test's world: its own database, slot, aggregate type (hence topic) and broker.
pub struct TestEnv {
    pub url: String,
    pub slot: String,
    pub aggregate_type: String,
    pub topic: String,
    pub kafka: TestKafka,
    pub db: Client,
    pub dir: tempfile::TempDir,
    /// Every relay this environment started (pid, log), so that a wait for a relay to stream
    /// fails at once, with the log, when none of them is alive any more.
    relays: std::sync::Mutex<Vec<(u32, PathBuf)>>,
}

/// Whether process `pid` is running (not exited, reaped or not): its `/proc/<pid>/stat` state.
fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // "pid (comm) S ...": the state follows the last ')'.
            let state = s.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(!matches!(state, 'Z' | 'X'))
        })
        .unwrap_or(false)
}

pub async fn connect(url: &str) -> Client {
    let (c, conn) = tokio_postgres::connect(url, NoTls).await.expect("connect");
    tokio::spawn(conn);
    c
}

impl TestEnv {
    /// A fresh database (migrated), the test's topic (3 partitions) on real Apache Kafka (the
    /// process's shared node, or `OUTBOXD_TEST_KAFKA`), unique names.
    pub async fn new(name: &str) -> TestEnv {
        TestEnv::new_on(TestPostgres::shared(), name).await
    }

    /// [`TestEnv::new`] on librdkafka's mock cluster, for a fault only the mock can inject;
    /// `why` names it (printed, so the output says which tests did not run on Kafka).
    pub async fn new_mock(name: &str, why: &str) -> TestEnv {
        println!("{name}: on librdkafka's mock cluster: {why}");
        let kafka = TestKafka::mock(1).expect("mock cluster");
        TestEnv::with_kafka(TestPostgres::shared(), name, kafka).await
    }

    /// [`TestEnv::new`] on another server (e.g. one with TLS).
    pub async fn new_on(pg: &TestPostgres, name: &str) -> TestEnv {
        let kafka =
            TestKafka::for_test().unwrap_or_else(|e| panic!("Apache Kafka for the tests: {e}"));
        TestEnv::with_kafka(pg, name, kafka).await
    }

    /// [`TestEnv::new`] on the given brokers (a cluster the test starts, pauses and kills).
    pub async fn with_kafka(pg: &TestPostgres, name: &str, kafka: TestKafka) -> TestEnv {
        // A copy of one database `outboxd migrate` made, once per test process.
        let url = pg
            .create_database_from_template(name, |url| async move {
                let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
                    .args(["migrate", "--database-url", &url])
                    .output()
                    .expect("run outboxd migrate");
                assert!(
                    out.status.success(),
                    "outboxd migrate failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                Ok(())
            })
            .await
            .expect("create test database");
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let suffix = format!("{}_{}_{}", name, std::process::id(), n);
        let aggregate_type = format!("agg_{suffix}");
        let topic = format!("outbox.event.{aggregate_type}");
        kafka.create_topic(&topic, 3).expect("create topic");
        TestEnv {
            db: connect(&url).await,
            url,
            slot: format!("slot_{suffix}"),
            aggregate_type,
            topic,
            kafka,
            dir: tempfile::tempdir().expect("tempdir"),
            relays: Default::default(),
        }
    }

    /// Enqueues one event in its own committed transaction.
    pub async fn enqueue(&self, aggregate_id: &str, payload: serde_json::Value) -> uuid::Uuid {
        self.db
            .query_one(
                "SELECT outbox.enqueue($1, $2, 'test.happened', $3)",
                &[&self.aggregate_type, &aggregate_id, &payload],
            )
            .await
            .expect("enqueue")
            .get(0)
    }

    /// Enqueues events in one committed transaction: a relay sees them together (CDC mode in
    /// one transaction, poll mode in one round's read), so an event refused at the broker has
    /// the next ones queued behind it whatever the timing.
    pub async fn enqueue_together(&self, events: &[(&str, serde_json::Value)]) -> Vec<uuid::Uuid> {
        self.db.batch_execute("BEGIN").await.expect("begin");
        let mut ids = Vec::new();
        for (aggregate_id, payload) in events {
            ids.push(self.enqueue(aggregate_id, payload.clone()).await);
        }
        self.db.batch_execute("COMMIT").await.expect("commit");
        ids
    }

    /// Inserts a copy of `of`'s row into `outbox.events` around `outbox.enqueue`, as version
    /// `version` of its aggregate under a new event id (with a payload digest that does not
    /// match if `corrupt`). Returns the new id, or the database's refusal.
    pub async fn insert_copy(
        &self,
        of: uuid::Uuid,
        version: i64,
        corrupt: bool,
    ) -> Result<uuid::Uuid, tokio_postgres::Error> {
        self.db
            .query_one(
                "INSERT INTO outbox.events (event_id, aggregate_type, aggregate_id, aggregate_version,
                     event_type, payload, payload_digest, dest_kind, dest_cluster, dest_topic, dest_key,
                     dest_partitioner, dest_route_generation, dest_serializer, dest_acks, destination_digest)
                 SELECT gen_random_uuid(), aggregate_type, aggregate_id, $2, event_type, payload,
                     CASE WHEN $3 THEN 'sha256:' || repeat('0', 64) ELSE payload_digest END,
                     dest_kind, dest_cluster, dest_topic, dest_key, dest_partitioner,
                     dest_route_generation, dest_serializer, dest_acks, destination_digest
                 FROM outbox.events_frozen WHERE event_id = $1 RETURNING event_id",
                &[&of, &version, &corrupt],
            )
            .await
            .map(|r| r.get(0))
    }

    pub async fn count(&self, sql: &str) -> i64 {
        self.db
            .query_one(sql, &[])
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .get(0)
    }

    /// Waits until `total` events have receipts, and asserts that no event is without one.
    pub async fn every_event_published(&self, total: i64) {
        self.wait_count(
            "every event published",
            "SELECT count(*) FROM outbox.receipts",
            total,
        )
        .await;
        assert_eq!(
            self.count("SELECT count(*) FROM outbox.events e WHERE NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = e.event_id)")
                .await,
            0,
            "lost events"
        );
    }

    /// Waits until `sql` (a count) reaches at least `n`.
    pub async fn wait_count(&self, what: &str, sql: &str, n: i64) {
        wait_for(what, LONG, || async {
            let c = self.count(sql).await;
            if c >= n {
                Ok(())
            } else {
                Err(format!("{c} < {n}"))
            }
        })
        .await
    }

    /// The state of event `id`'s one DISPATCH_UNKNOWN attempt (`FOUND`, `ABSENT`, ...).
    pub async fn attempt_state(&self, id: uuid::Uuid) -> String {
        self.db
            .query_one(
                "SELECT state FROM outbox.attempts WHERE event_id = $1",
                &[&id],
            )
            .await
            .expect("event has exactly one attempt")
            .get(0)
    }

    /// Waits until at least `n` events have their primary receipt.
    pub async fn wait_receipts(&self, what: &str, n: usize) {
        self.wait_count(what, "SELECT count(*) FROM outbox.receipts", n as i64)
            .await
    }

    /// Waits until `sql` (a count) is 0.
    pub async fn wait_zero(&self, what: &str, sql: &str) {
        wait_for(what, LONG, || async {
            match self.count(sql).await {
                0 => Ok(()),
                c => Err(format!("{c} left")),
            }
        })
        .await
    }

    /// Records the state a lost ACK leaves: an attempt of `event_id` at the frozen topic,
    /// partition 0, whose outcome is DISPATCH_UNKNOWN (sent by relay generation 0).
    pub async fn record_unknown_attempt(&self, event_id: uuid::Uuid) {
        self.db
            .execute(
                "INSERT INTO outbox.attempts (event_id, relay_generation, attempt_generation, slot_name,
                                              topic, partition, sent_at, error)
                 VALUES ($1, 0, 1, $2, $3, 0, clock_timestamp(), 'Local: Message timed out')",
                &[&event_id, &self.slot, &self.topic],
            )
            .await
            .expect("record an UNKNOWN attempt");
    }

    /// Starts a relay without failpoints and waits for `n` primary receipts.
    pub async fn restart_until_receipts(&self, n: i64) -> RelayProcess {
        let relay = self.relay(&[], &[]);
        self.wait_count(
            "the receipts after restart",
            "SELECT count(*) FROM outbox.receipts",
            n,
        )
        .await;
        relay
    }

    /// Waits until the relay streams from the slot (the slot exists and a walsender holds it),
    /// i.e. the initial snapshot is behind it and new commits arrive through the WAL. Under
    /// In poll mode (the e2e_poll target): until the relay has begun a poll round.
    pub async fn wait_streaming(&self) {
        if poll_mode() {
            let sql = format!(
                "SELECT count(*) FROM outbox.poll_rounds WHERE slot_name = '{}'",
                self.slot
            );
            return self
                .wait_count_while_a_relay_runs("the relay to poll", &sql)
                .await;
        }
        self.wait_slot_streaming().await
    }

    /// [`TestEnv::wait_streaming`] for a relay in CDC mode, whatever the target: its
    /// walsender has begun `START_REPLICATION` (state `catchup` or `streaming`). A slot's
    /// `active_pid` alone is set already while `CREATE_REPLICATION_SLOT` runs, before the
    /// relay's initial snapshot.
    async fn wait_slot_streaming(&self) {
        let sql = format!(
            "SELECT count(*) FROM pg_replication_slots s
             JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = '{}' AND r.state IN ('catchup', 'streaming')",
            self.slot
        );
        self.wait_count_while_a_relay_runs("the relay to stream from its slot", &sql)
            .await;
    }

    /// Waits until `sql` counts at least 1, and fails at once, with the last relay's log, when
    /// every relay this environment started has exited (a configuration error, a failpoint):
    /// waiting out the deadline then only hides the reason.
    async fn wait_count_while_a_relay_runs(&self, what: &str, sql: &str) {
        wait_for(what, LONG, || async {
            let c = self.count(sql).await;
            if c >= 1 {
                return Ok(());
            }
            if let Some(last) = self.every_relay_exited() {
                panic!(
                    "waiting for {what}: every relay of this test has exited; the last one's log:\n{}",
                    std::fs::read_to_string(&last).unwrap_or_default()
                );
            }
            Err(format!("{c} < 1"))
        })
        .await
    }

    /// The log of the last relay started, when there was one and no relay started here is
    /// alive (exited, whether reaped or not).
    fn every_relay_exited(&self) -> Option<PathBuf> {
        let relays = self.relays.lock().unwrap_or_else(|e| e.into_inner());
        match relays.last() {
            Some((_, log)) if !relays.iter().any(|(pid, _)| process_alive(*pid)) => {
                Some(log.clone())
            }
            _ => None,
        }
    }

    /// Waits until `relay` publishes new commits: streaming from its slot, or (poll mode)
    /// polling.
    pub async fn wait_ready(&self, relay: &RelayProcess) {
        if !relay.poll {
            return self.wait_slot_streaming().await;
        }
        wait_for("the relay to poll", LONG, || async {
            if relay.log_text().contains("polling") {
                Ok(())
            } else if !process_alive(relay.pid()) {
                panic!(
                    "waiting for the relay to poll: it has exited; its log:\n{}",
                    relay.log_text()
                )
            } else {
                Err("no `polling` line in its log yet".to_string())
            }
        })
        .await
    }

    /// Writes `text` as this test's `outboxd.toml`; its path, for `--config`.
    pub fn write_config(&self, text: impl AsRef<str>) -> String {
        let path = self.dir.path().join("outboxd.toml");
        std::fs::write(&path, text.as_ref()).expect("write outboxd.toml");
        path.to_str().expect("a UTF-8 temporary path").to_string()
    }

    /// Starts the relay with extra environment (failpoints) and arguments.
    pub fn relay(&self, envs: &[(&str, &str)], args: &[&str]) -> RelayProcess {
        self.relay_at(&self.url, envs, args)
    }

    /// [`TestEnv::relay`] with another database URL (e.g. one naming an application, so a
    /// test can find the relay's own backends).
    pub fn relay_at(&self, url: &str, envs: &[(&str, &str)], args: &[&str]) -> RelayProcess {
        self.relay_from(
            &[
                "--database-url",
                url,
                "--bootstrap-servers",
                self.kafka.bootstrap_servers(),
                "--slot",
                &self.slot,
            ],
            envs,
            args,
        )
    }

    /// `outboxd run --config FILE` with `args`: the databases, slots and brokers are the
    /// file's (e.g. `[[databases]]`), the test defaults and the suite's mode are added.
    pub fn relay_with_config(&self, config: &std::path::Path, args: &[&str]) -> RelayProcess {
        self.relay_from(
            &["--config", config.to_str().expect("utf-8 path")],
            &[],
            args,
        )
    }

    fn relay_from(&self, head: &[&str], envs: &[(&str, &str)], args: &[&str]) -> RelayProcess {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let log = self.dir.path().join(format!("relay-{n}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_outboxd"));
        cmd.arg("run").args(head);
        // The whole suite in poll mode: the e2e_poll target.
        if poll_mode() && !args.contains(&"--mode") {
            cmd.args(["--mode", "poll", "--poll-interval-ms", "20"]);
        }
        // Test defaults, unless the test sets the flag itself.
        for (flag, value) in [
            ("--status-interval-ms", "100"),
            ("--heartbeat-interval-ms", "300"),
            ("--message-timeout-ms", "10000"),
            ("--lease-ttl-ms", "3000"),
        ] {
            if !args.contains(&flag) {
                cmd.args([flag, value]);
            }
        }
        cmd.args(args)
            .env_remove("OUTBOXD_FAILPOINTS")
            .env("OUTBOXD_LOG", "info,outboxd=debug,tokio_postgres=warn")
            .stdout(Stdio::null())
            .stderr(file);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn outboxd");
        self.relays
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((child.id(), log.clone()));
        RelayProcess {
            child,
            log,
            poll: args.windows(2).any(|w| w == ["--mode", "poll"])
                || (poll_mode() && !args.contains(&"--mode")),
        }
    }

    /// Every message currently in the test topic, after checking every Kafka receipt of the
    /// ledger against the broker ([`TestEnv::verify_receipts`]).
    pub async fn read_topic(&self) -> Vec<TopicMessage> {
        self.read_topic_of(&self.topic.clone()).await
    }

    /// Every message currently in `topic`, after checking every Kafka receipt of the ledger
    /// (primary and duplicate, of any topic) against the broker: the suite's one topic reader.
    pub async fn read_topic_of(&self, topic: &str) -> Vec<TopicMessage> {
        self.verify_receipts(&[topic]).await.messages
    }

    /// Starts sampling (slot confirmed LSN, server time) every 20 ms for invariant 5.
    pub fn start_sampler(&self) -> Sampler {
        let url = self.url.clone();
        let slot = self.slot.clone();
        let samples = Arc::new(std::sync::Mutex::new(Vec::new()));
        let s2 = samples.clone();
        let handle = tokio::spawn(async move {
            let c = connect(&url).await;
            loop {
                if let Ok(Some(row)) = c
                    .query_opt(
                        "SELECT confirmed_flush_lsn::text, clock_timestamp()::text
                         FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot],
                    )
                    .await
                {
                    let lsn: Option<String> = row.get(0);
                    if let Some(lsn) = lsn {
                        s2.lock().unwrap().push((lsn, row.get::<_, String>(1)));
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        Sampler { samples, handle }
    }
}

impl TestEnv {
    /// Called right after a fault struck (a SIGKILL, a broker killed): the events with a
    /// primary receipt so far, which must be fewer than `total` (what the test commits in
    /// all). A fault that lands after every event was published met no traffic and proves
    /// nothing: the test fails, naming it.
    pub async fn assert_fault_met_traffic(&self, fault: &str, total: i64) -> i64 {
        let n = self.count("SELECT count(*) FROM outbox.receipts").await;
        assert!(
            n < total,
            "{fault} struck when all {total} events already had receipts: it met no traffic (strike earlier, or commit more behind it)"
        );
        n
    }
}

pub struct Sampler {
    samples: Arc<std::sync::Mutex<Vec<(String, String)>>>,
    handle: tokio::task::JoinHandle<()>,
}

impl Sampler {
    /// Invariant 5 as a count: for every sample (confirmed LSN C at server time t), the number
    /// of events whose transaction committed before C but whose receipt was accepted after t.
    /// Must be 0. Also returns how many samples were taken (a test with none proves nothing).
    pub async fn violations(self, env: &TestEnv) -> (i64, usize) {
        self.handle.abort();
        let samples = self.samples.lock().unwrap().clone();
        let mut total = 0;
        for (lsn, at) in &samples {
            let row = env
                .db
                .query_one(
                    "SELECT count(*) FROM outbox.receipts
                     WHERE commit_lsn < $1::text::pg_lsn AND accepted_at > $2::text::timestamptz",
                    &[lsn, at],
                )
                .await
                .expect("invariant query");
            total += row.get::<_, i64>(0);
        }
        (total, samples.len())
    }

    /// Invariant 5, asserted: no sample saw the slot confirmed past an event whose receipt was
    /// not accepted, and there were samples (a sampler that saw nothing proves nothing). In
    /// poll mode there is no slot to confirm anything: that is asserted (no slot, no sample),
    /// not passed with nothing sampled. Returns the number of samples.
    pub async fn assert_never_confirmed_past_unaccepted(self, env: &TestEnv) -> usize {
        let slots = env
            .count(&format!(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
                env.slot
            ))
            .await;
        let (violations, samples) = self.violations(env).await;
        if poll_mode() {
            assert_eq!(
                (slots, samples),
                (0, 0),
                "poll mode: slot {} exists or was sampled",
                env.slot
            );
        } else {
            assert!(
                samples > 0,
                "the sampler took no sample of slot {}: invariant 5 was not checked",
                env.slot
            );
        }
        assert_eq!(
            violations, 0,
            "slot confirmed past an event whose receipt was not accepted ({samples} samples)"
        );
        samples
    }
}

pub struct RelayProcess {
    child: Child,
    pub log: PathBuf,
    /// Started with `--mode poll`.
    pub poll: bool,
}

impl RelayProcess {
    /// Starts `cmd` with stderr to `log` (a relay, or another process a test SIGKILLs).
    pub fn spawn(mut cmd: Command, log: PathBuf) -> RelayProcess {
        let file = std::fs::File::create(&log).expect("log file");
        cmd.stdout(Stdio::null()).stderr(file);
        RelayProcess {
            child: cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}")),
            log,
            poll: false,
        }
    }

    /// The relay's process id (e.g. to read its `/proc/<pid>/status`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    pub fn kill9(&mut self) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }

    /// Waits for the process to exit by itself (a failpoint, an error).
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s;
            }
            if Instant::now() > deadline {
                self.kill9();
                panic!(
                    "relay did not exit within {timeout:?}; log:\n{}",
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn assert_running(&mut self) {
        if let Some(s) = self.child.try_wait().expect("try_wait") {
            panic!("relay exited unexpectedly ({s}); log:\n{}", self.log_text());
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log_text();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- relay log (last 40 lines) ---");
            for l in tail.into_iter().rev() {
                eprintln!("{l}");
            }
        }
        if self.child.try_wait().ok().flatten().is_none() {
            self.kill9();
        }
    }
}

#[derive(Debug, Clone)]
pub struct TopicMessage {
    pub key: Option<String>,
    pub headers: HashMap<String, String>,
    pub payload: Option<String>,
    /// sha256 of the payload bytes, as `outbox.enqueue` computes `payload_digest`.
    pub payload_digest: String,
    pub partition: i32,
    pub offset: i64,
}

impl TopicMessage {
    pub fn id(&self) -> &str {
        self.headers.get("id").map(String::as_str).unwrap_or("")
    }
}

/// Reads every partition of `topic` from its low watermark to its high watermark (both read
/// before the first fetch), with each partition's watermarks. Honest about what it read: it
/// fails if a partition's offsets are not contiguous (nothing here writes transactions or
/// compacts, so every offset between the watermarks is a message), and it prints every message
/// without an `id` header, one by one. Tests read through [`TestEnv::read_topic_of`], which
/// checks the ledger's receipts against what this reads.
fn read_topic_bounds(
    bootstrap: &str,
    topic: &str,
) -> (Vec<TopicMessage>, HashMap<i32, (i64, i64)>) {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("reader-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("consumer");
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let partitions: Vec<i32> = md.topics()[0].partitions().iter().map(|p| p.id()).collect();
    assert!(!partitions.is_empty(), "topic {topic} has no partitions");
    let mut tpl = TopicPartitionList::new();
    let mut bounds = HashMap::new();
    for p in &partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, *p, Duration::from_secs(10))
            .expect("watermarks");
        bounds.insert(*p, (low, high));
        tpl.add_partition_offset(topic, *p, Offset::Offset(low))
            .expect("tpl");
    }
    consumer.assign(&tpl).expect("assign");
    let mut out = Vec::new();
    let mut next: HashMap<i32, i64> = bounds.iter().map(|(p, (low, _))| (*p, *low)).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while partitions.iter().any(|p| next[p] < bounds[p].1) {
        assert!(
            Instant::now() < deadline,
            "reading {topic} timed out at {next:?} (low/high watermarks {bounds:?})"
        );
        if let Some(r) = consumer.poll(Duration::from_millis(100)) {
            let m = r.expect("consume");
            let expected = next[&m.partition()];
            assert_eq!(
                m.offset(),
                expected,
                "{topic}/{}: read offset {} where {expected} was next: the partition is not contiguous (watermarks {:?})",
                m.partition(),
                m.offset(),
                bounds[&m.partition()]
            );
            let mut headers = HashMap::new();
            if let Some(h) = m.headers() {
                for hd in h.iter() {
                    headers.insert(
                        hd.key.to_string(),
                        String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned(),
                    );
                }
            }
            if !headers.contains_key("id") {
                println!(
                    "{topic}/{}@{}: message without an `id` header",
                    m.partition(),
                    m.offset()
                );
            }
            next.insert(m.partition(), m.offset() + 1);
            out.push(TopicMessage {
                key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                headers,
                payload: m.payload().map(|p| String::from_utf8_lossy(p).into_owned()),
                payload_digest: outbox_core::envelope::sha256_digest(
                    m.payload().unwrap_or_default(),
                ),
                partition: m.partition(),
                offset: m.offset(),
            });
        }
    }
    (out, bounds)
}

/// A partition's (low, high) watermarks now, for a diagnostic.
fn read_topic_bounds_now(bootstrap: &str, topic: &str, partition: i32) -> Option<(i64, i64)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .ok()?;
    consumer
        .fetch_watermarks(topic, partition, Duration::from_secs(10))
        .ok()
}

/// What [`TestEnv::verify_receipts`] compared.
#[derive(Debug)]
pub struct ReceiptCheck {
    /// Primary and duplicate Kafka receipts, every one in the ledger, each checked against its
    /// message.
    pub checked: usize,
    /// Receipts of sinks the broker check cannot audit (NATS, HTTP), by kind: counted, named
    /// here, not checked against Kafka (their own tests check them against their server).
    pub not_auditable: Vec<(String, i64)>,
    /// Messages read from the topics asked for.
    pub messages: Vec<TopicMessage>,
}

impl TestEnv {
    /// Routes every event of the test's aggregate type to `topic` (a route-policy change, as an
    /// operator makes it: events already enqueued keep their frozen destination).
    pub async fn route_to(&self, topic: &str) {
        self.db
            .query_one(
                "SELECT outbox.set_route($1, NULL, $2)",
                &[&self.aggregate_type, &topic],
            )
            .await
            .unwrap_or_else(|e| panic!("routing {} to {topic}: {e}", self.aggregate_type));
    }

    /// Routes the test's aggregate type to the NATS cluster (or server) `cluster`.
    pub async fn route_to_nats(&self, cluster: &str) {
        self.db
            .execute(
                "SELECT outbox.set_nats_route($1, NULL, $2)",
                &[&self.aggregate_type, &cluster],
            )
            .await
            .expect("route the test's aggregate type to NATS");
    }

    /// Publishes one event of aggregate `agg` and waits for its receipt (the first receipt of
    /// the test): the relay streams and its producer has a session with the broker.
    pub async fn warm_up(&self, agg: &str) -> uuid::Uuid {
        let id = self.enqueue(agg, serde_json::json!({"warm": true})).await;
        self.wait_count(
            "the warm-up receipt",
            "SELECT count(*) FROM outbox.receipts",
            1,
        )
        .await;
        id
    }

    /// Checks every Kafka receipt in the ledger, primary and duplicate, against the broker:
    /// the message at (topic, partition, offset) exists, carries header `id` = the event id,
    /// and its payload (and `payload_digest` header) matches the frozen row's digest. Also:
    /// every event id and every key sits in one partition only. Every topic a receipt names
    /// is read, whether asked for or not: no receipt goes unchecked, and the count checked is
    /// asserted against the ledger's. Panics with every problem found; returns the messages of
    /// `topics`.
    pub async fn verify_receipts(&self, topics: &[&str]) -> ReceiptCheck {
        self.check_receipts(topics, true).await
    }

    /// [`TestEnv::verify_receipts`] for topics whose partition count was raised while the
    /// relay ran: a key may sit in two partitions (its placement by the old count and by the
    /// new), an event id still in one.
    pub async fn verify_receipts_after_repartition(&self, topics: &[&str]) -> ReceiptCheck {
        self.check_receipts(topics, false).await
    }

    async fn check_receipts(&self, topics: &[&str], keys_fixed: bool) -> ReceiptCheck {
        // Receipts first, then the topic: a relay still running accepts duplicate receipts
        // as it goes, and every receipt taken here was accepted after its broker ACK, so its
        // message is below the high watermark the read below sees (acks=all).
        let rows = self
            .db
            .query(
                "SELECT 'primary', r.event_id::text, r.topic, r.partition, r.\"offset\", r.attempt,
                        r.relay_generation, outbox.payload_digest_of(e.payload, e.payload_digest)
                 FROM outbox.receipts r LEFT JOIN outbox.events_current e USING (event_id)
                 WHERE r.broker_kind = 'kafka'
                 UNION ALL
                 SELECT 'duplicate', d.event_id::text, d.topic, d.partition, d.\"offset\", d.attempt,
                        d.relay_generation, outbox.payload_digest_of(e.payload, e.payload_digest)
                 FROM outbox.duplicate_receipts d LEFT JOIN outbox.events_current e USING (event_id)
                 WHERE d.broker_kind = 'kafka'",
                &[],
            )
            .await
            .expect("read receipts");
        let not_auditable: Vec<(String, i64)> = self
            .db
            .query(
                "SELECT broker_kind, count(*) FROM (
                     SELECT broker_kind FROM outbox.receipts WHERE broker_kind <> 'kafka'
                     UNION ALL
                     SELECT broker_kind FROM outbox.duplicate_receipts WHERE broker_kind <> 'kafka'
                 ) k GROUP BY 1 ORDER BY 1",
                &[],
            )
            .await
            .expect("count the receipts of other sinks")
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let mut to_read: Vec<String> = topics.iter().map(|t| t.to_string()).collect();
        for r in &rows {
            let t: String = r.get(2);
            if !to_read.contains(&t) {
                to_read.push(t);
            }
        }
        let mut messages = Vec::new();
        let mut bounds = HashMap::new();
        for t in &to_read {
            let (read, b) = read_topic_bounds(self.kafka.bootstrap_servers(), t);
            for (p, lh) in b {
                bounds.insert((t.to_string(), p), lh);
            }
            messages.extend(read.into_iter().map(|m| (t.to_string(), m)));
        }
        let at: HashMap<(&str, i32, i64), &TopicMessage> = messages
            .iter()
            .map(|(t, m)| ((t.as_str(), m.partition, m.offset), m))
            .collect();
        let mut problems = Vec::new();
        let mut checked = 0;
        for r in &rows {
            let (kind, id, topic): (&str, &str, &str) = (r.get(0), r.get(1), r.get(2));
            let (partition, offset, attempt, generation): (i32, i64, i32, i64) =
                (r.get(3), r.get(4), r.get(5), r.get(6));
            let digest: Option<&str> = r.get(7);
            let what = format!(
                "{kind} receipt of {id} at {topic}/{partition}@{offset} (attempt {attempt}, relay generation {generation})"
            );
            checked += 1;
            let Some(m) = at.get(&(topic, partition, offset)) else {
                let now = read_topic_bounds_now(self.kafka.bootstrap_servers(), topic, partition);
                problems.push(format!(
                    "{what}: the broker has no message there (watermarks when read: {:?}, now: {now:?})",
                    bounds.get(&(topic.to_string(), partition))
                ));
                continue;
            };
            if m.id() != id {
                problems.push(format!("{what}: the message there has id {:?}", m.id()));
            }
            match digest {
                None => problems.push(format!("{what}: no outbox row")),
                Some(d) => {
                    if m.payload_digest != d {
                        problems.push(format!(
                            "{what}: payload digest {} there, frozen {d}",
                            m.payload_digest
                        ));
                    }
                    if m.headers.get("payload_digest").map(String::as_str) != Some(d) {
                        problems.push(format!(
                            "{what}: header payload_digest {:?}, frozen {d}",
                            m.headers.get("payload_digest")
                        ));
                    }
                }
            }
        }
        // Every id only in its key's partition.
        let mut key_partitions: HashMap<(&str, Option<&str>), std::collections::BTreeSet<i32>> =
            HashMap::new();
        let mut id_partitions: HashMap<(&str, &str), std::collections::BTreeSet<i32>> =
            HashMap::new();
        for (t, m) in &messages {
            key_partitions
                .entry((t.as_str(), m.key.as_deref()))
                .or_default()
                .insert(m.partition);
            if !m.id().is_empty() {
                id_partitions
                    .entry((t.as_str(), m.id()))
                    .or_default()
                    .insert(m.partition);
            }
        }
        for ((t, key), ps) in &key_partitions {
            if keys_fixed && ps.len() > 1 {
                problems.push(format!("{t}: key {key:?} is in partitions {ps:?}"));
            }
        }
        for ((t, id), ps) in &id_partitions {
            if ps.len() > 1 {
                problems.push(format!("{t}: event {id} is in partitions {ps:?}"));
            }
        }
        assert!(
            problems.is_empty(),
            "{} of {} receipts or messages do not match the broker:\n{}",
            problems.len(),
            rows.len(),
            problems.join("\n")
        );
        assert_eq!(
            checked,
            rows.len(),
            "checked {checked} of the ledger's {} Kafka receipts",
            rows.len()
        );
        ReceiptCheck {
            checked,
            not_auditable,
            messages: messages
                .into_iter()
                .filter(|(t, _)| topics.contains(&t.as_str()))
                .map(|(_, m)| m)
                .collect(),
        }
    }
}

/// The `e2e_poll` target (`tests/e2e_poll.rs`: this suite again): every relay the harness
/// starts runs `--mode poll`, and [`TestEnv::wait_streaming`] waits for its first round. The
/// target's root says so (`POLL_MODE`); it also decides what a test of what only CDC mode has
/// (`cdc_only!`) or one that runs once (`e2e_only!`) becomes there.
pub fn poll_mode() -> bool {
    crate::POLL_MODE
}

/// Waits until `committed()` has grown by `n`, while `writers` (tasks that write until the
/// test tells them to stop) keep running. Fails the test, naming `what`, when a writer ends
/// (with its panic) or when `deadline` passes (with the count it reached): a writer that died
/// would otherwise leave the count where it is and the test waiting for good.
pub async fn wait_for_writers(
    what: &str,
    deadline: Duration,
    writers: &mut [tokio::task::JoinHandle<()>],
    committed: impl Fn() -> usize,
    n: usize,
) {
    let start = Instant::now();
    let target = committed() + n;
    loop {
        let now = committed();
        if now >= target {
            return;
        }
        if let Some(i) = writers.iter().position(|w| w.is_finished()) {
            match (&mut writers[i]).await {
                Err(e) => panic!("writer {i} failed while waiting for {what} ({now} of {target} events committed): {e}"),
                Ok(()) => panic!("writer {i} ended before it was told to stop, while waiting for {what} ({now} of {target} events committed)"),
            }
        }
        if start.elapsed() > deadline {
            panic!(
                "timed out after {deadline:?} waiting for {what}: {now} of {target} events committed, every writer still running"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

e2e_only! {
    #[tokio::test]
    #[should_panic(expected = "writer 1 failed while waiting for 5 more events (0 of 5 events committed): task")]
    async fn a_writer_that_panics_fails_the_wait_for_writers() {
        let mut writers = vec![
            tokio::spawn(std::future::pending::<()>()),
            tokio::spawn(async { panic!("planted: the writer's INSERT failed") }),
        ];
        wait_for_writers("5 more events", LONG, &mut writers, || 0, 5).await;
    }

    #[tokio::test]
    #[should_panic(expected = "timed out after 200ms waiting for 5 more events: 0 of 5 events committed")]
    async fn a_wait_for_writers_that_sees_no_commits_fails_at_its_deadline() {
        let mut writers = vec![tokio::spawn(std::future::pending::<()>())];
        wait_for_writers("5 more events", Duration::from_millis(200), &mut writers, || 0, 5).await;
    }
}

/// A throwaway cluster with `wal_level = replica` (PostgreSQL's default), started once per
/// test process: what the relay meets on a server nobody prepared, and where poll mode runs.
/// Its users (bad_input, poll_mode) are e2e-only modules: `e2e_poll` never starts it.
#[allow(dead_code)]
pub fn replica_only_cluster() -> &'static TestPostgres {
    static PG: std::sync::OnceLock<TestPostgres> = std::sync::OnceLock::new();
    PG.get_or_init(|| {
        TestPostgres::start_throwaway_configured("wal_level = replica")
            .unwrap_or_else(|e| panic!("starting a wal_level=replica cluster: {e}"))
    })
}

/// Runs `outboxd ARGS` without the relay's environment variables; returns success and
/// stdout + stderr.
pub fn outboxd(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(args)
        .env_remove("OUTBOXD_DATABASE_URL")
        .env_remove("OUTBOXD_BOOTSTRAP_SERVERS")
        .output()
        .expect("run outboxd");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// `outboxd migrate-destination ARGS`, run again while it refuses only because the relay has
/// not passed the event yet (its answer says "retry in a moment": the checkpoint, or in poll
/// mode the round that read the event, is older than the quarantine it found), for at most
/// 30 s; returns the last answer, which the test checks.
pub fn migrate_destination(args: &[&str]) -> (bool, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (ok, out) = outboxd(&[&["migrate-destination"], args].concat());
        if !out.contains("retry in a moment") || Instant::now() > deadline {
            return (ok, out);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Publishes one message around the relay (a bypass, a rogue poller): `key`, header `id` when
/// given, `payload`; flushed before it returns.
pub fn produce_raw(bootstrap: &str, topic: &str, key: &str, id: Option<&str>, payload: &str) {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let p: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("producer");
    let mut headers = OwnedHeaders::new();
    if let Some(id) = id {
        headers = headers.insert(Header {
            key: "id",
            value: Some(id),
        });
    }
    p.send(
        BaseRecord::to(topic)
            .key(key)
            .payload(payload)
            .headers(headers),
    )
    .map_err(|(e, _)| e)
    .expect("produce");
    p.flush(Duration::from_secs(10)).expect("flush");
}

/// The Python interpreter (`OUTBOXD_PYTHON`, else `python3`) that can import `modules`
/// (comma-separated, as in `import`), or a failure naming the packages to install. Its users
/// (consumer_recipe, webhook_signatures) are e2e-only modules, not compiled into `e2e_poll`.
#[allow(dead_code)]
pub fn python_with(modules: &str, packages: &str) -> String {
    let python = std::env::var("OUTBOXD_PYTHON").unwrap_or_else(|_| "python3".into());
    match std::process::Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output()
    {
        Ok(out) if out.status.success() => python,
        Ok(out) => panic!(
            "{python} cannot import {modules} ({}): pip install {packages} (.ci/run does), or OUTBOXD_PYTHON=/path/to/python with them",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => panic!(
            "cannot run {python} ({e}): install Python 3 with {packages}, or set OUTBOXD_PYTHON"
        ),
    }
}
