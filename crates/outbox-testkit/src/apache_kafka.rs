//! Real Apache Kafka brokers (KRaft) for tests, resolved from Maven Central.
//!
//! Why: librdkafka's mock cluster ([`crate::kafka`]) speaks the protocol but is not Kafka:
//! it has no controller quorum, no ISR, no fencing, no leader election after a crash, and its
//! idempotence and transaction state is a model. Whether the relay keeps its guarantees when
//! the partition leader is SIGKILLed, a follower is paused, or the controller moves can only
//! be shown against the real broker. Docker is not assumed; a JDK and Maven are.
//!
//! How:
//! * The broker's jars (`org.apache.kafka:kafka_2.13` [`KAFKA_VERSION`] and a log4j2 backend)
//!   are copied by `mvn dependency:copy-dependencies` into a cache directory,
//!   `$OUTBOXD_KAFKA_CACHE/kafka-<version>/` (default `$XDG_CACHE_HOME/outboxd` or
//!   `~/.cache/outboxd`). The first resolution needs Maven Central; later runs only read the
//!   cache (no `mvn`, no network). Concurrent resolutions serialise on a lock file and
//!   publish the directory by an atomic rename, so a reader never sees half a cache.
//! * [`KafkaCluster::start`] runs N combined `broker,controller` nodes on free loopback ports
//!   with a static N-voter controller quorum, waits until every broker answers metadata,
//!   and offers per-node fault injection: pause (SIGSTOP), resume, kill (SIGKILL), restart on
//!   the same ports and log directories.
//! * JVMs never outlive the process: they are spawned with `PR_SET_PDEATHSIG = SIGKILL` from
//!   a thread that lives as long as the process, [`Drop`] kills them, and the cluster of
//!   [`shared`] is stopped (and its directory removed) at process exit.
//!
//! A missing or too old `java`, or a missing `mvn` when the cache is cold, is an error that
//! says what to install — never a silent skip.

use std::fmt::Write as _;
use std::io::Write as _;
use std::os::unix::io::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::metadata::Metadata;
use rdkafka::ClientConfig;

use crate::HarnessError;

/// The pinned broker version (`org.apache.kafka:kafka_2.13`). Kafka 4 needs Java 17.
pub const KAFKA_VERSION: &str = "4.1.0";
/// log4j2 backend: Kafka 4 logs through slf4j 1.7 and ships no binding in its POM.
const LOG4J_VERSION: &str = "2.24.3";
/// Pinned so that the plugin, too, comes from the cache once resolved.
const DEPENDENCY_PLUGIN: &str = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1";

/// How long a start or restart may take before it is an error.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// Broker liveness towards the controller: a killed or paused broker is fenced (and loses its
/// leaderships) this long after its last heartbeat, and a restarted one can re-register only
/// then. Short, so that failover tests take seconds.
const BROKER_SESSION_TIMEOUT_MS: u32 = 4000;
const BROKER_HEARTBEAT_MS: u32 = 500;

fn io(context: impl Into<String>, source: std::io::Error) -> HarnessError {
    HarnessError::Io {
        context: context.into(),
        source,
    }
}

fn kafka_err(msg: impl Into<String>) -> HarnessError {
    HarnessError::ApacheKafka(msg.into())
}

// ---------------------------------------------------------------------------------------------
// Tools and the jar cache
// ---------------------------------------------------------------------------------------------

/// `$JAVA_HOME/bin/java` if it exists, else `java` on the PATH.
fn java_binary() -> PathBuf {
    if let Some(home) = std::env::var_os("JAVA_HOME") {
        let p = PathBuf::from(home).join("bin/java");
        if p.exists() {
            return p;
        }
    }
    PathBuf::from("java")
}

/// Checks once per process that `java` runs and is at least 17.
fn check_java() -> Result<PathBuf, HarnessError> {
    static CHECKED: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let checked = CHECKED.get_or_init(|| {
        let java = java_binary();
        let out = Command::new(&java)
            .arg("-version")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("java: `{} -version`: {e}", java.display()))?;
        let text = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        let major = java_major(&text);
        match major {
            Some(m) if m >= 17 => Ok(java),
            _ => Err(format!(
                "java 17+: `{} -version` says {:?}; Kafka {KAFKA_VERSION} needs Java 17 or later",
                java.display(),
                text.lines().next().unwrap_or("")
            )),
        }
    });
    checked.clone().map_err(|detail| {
        let (tool, detail) = detail.split_once(": ").unwrap_or(("java", &detail));
        HarnessError::NoJavaOrMaven {
            tool: tool.to_string(),
            detail: detail.to_string(),
        }
    })
}

/// The major version in `java -version` output: `"17.0.15"` → 17, `"1.8.0_392"` → 8.
fn java_major(version_output: &str) -> Option<u32> {
    let start = version_output.find("version \"")? + "version \"".len();
    let v = &version_output[start..];
    let v = &v[..v.find('"')?];
    let mut parts = v.split(['.', '-', '+', '_']);
    let first: u32 = parts.next()?.parse().ok()?;
    if first == 1 {
        parts.next()?.parse().ok()
    } else {
        Some(first)
    }
}

/// The root of the jar cache: `$OUTBOXD_KAFKA_CACHE`, else `$XDG_CACHE_HOME/outboxd`, else
/// `~/.cache/outboxd`, else a directory under the system temporary directory.
pub fn cache_root() -> PathBuf {
    if let Some(p) = std::env::var_os("OUTBOXD_KAFKA_CACHE").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME").filter(|p| !p.is_empty()) {
        return PathBuf::from(p).join("outboxd");
    }
    if let Some(p) = std::env::var_os("HOME").filter(|p| !p.is_empty()) {
        return PathBuf::from(p).join(".cache/outboxd");
    }
    std::env::temp_dir().join("outboxd-cache")
}

/// The jars of a complete cache directory, from its `classpath` file (one jar file name per
/// line, under `libs/`); `None` if the file is missing or names a jar that is not there.
fn cached_jars(dir: &Path) -> Option<Vec<PathBuf>> {
    let list = std::fs::read_to_string(dir.join("classpath")).ok()?;
    let jars: Vec<PathBuf> = list
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| dir.join("libs").join(l.trim()))
        .collect();
    (!jars.is_empty() && jars.iter().all(|j| j.is_file())).then_some(jars)
}

fn pom_xml() -> String {
    format!(
        r#"<?xml version="1.0" encoding="UTF-8"?>
<!-- Written by outbox-testkit: the jars of an Apache Kafka broker, for tests. -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>outboxd.testkit</groupId>
  <artifactId>kafka-broker-classpath</artifactId>
  <version>{KAFKA_VERSION}</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>{KAFKA_VERSION}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>{LOG4J_VERSION}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId>
      <version>{LOG4J_VERSION}</version>
    </dependency>
  </dependencies>
</project>
"#
    )
}

/// An exclusive `flock` on a file, released when dropped (the file is closed).
struct FileLock {
    _file: std::fs::File,
}

impl FileLock {
    fn acquire(path: &Path) -> Result<FileLock, HarnessError> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| io(format!("opening the lock file {}", path.display()), e))?;
        loop {
            // SAFETY: flock on a file descriptor that `f` owns and keeps open.
            let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(FileLock { _file: f });
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(io(format!("locking {}", path.display()), e));
            }
        }
    }
}

/// The broker's classpath (jar paths), resolving it with Maven into the cache first if the
/// cache is cold. Safe to call from several processes at once.
pub fn resolve_classpath() -> Result<Vec<PathBuf>, HarnessError> {
    let root = cache_root();
    let name = format!("kafka-{KAFKA_VERSION}");
    let dir = root.join(&name);
    if let Some(jars) = cached_jars(&dir) {
        return Ok(jars);
    }
    std::fs::create_dir_all(&root).map_err(|e| {
        io(
            format!("creating the Kafka jar cache {}", root.display()),
            e,
        )
    })?;
    let _lock = FileLock::acquire(&root.join(format!("{name}.lock")))?;
    // Another process may have finished while this one waited for the lock.
    if let Some(jars) = cached_jars(&dir) {
        return Ok(jars);
    }

    // Under the lock no other resolver runs: a partial directory is left over from one that
    // was killed.
    let partial = format!("{name}.partial-");
    if let Ok(entries) = std::fs::read_dir(&root) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&partial) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let staging = root.join(format!("{partial}{}", std::process::id()));
    std::fs::create_dir_all(&staging)
        .map_err(|e| io(format!("creating {}", staging.display()), e))?;
    std::fs::write(staging.join("pom.xml"), pom_xml())
        .map_err(|e| io("writing the Kafka pom.xml", e))?;
    let libs = staging.join("libs");
    let mut mvn = Command::new("mvn");
    mvn.current_dir(&staging)
        .args(["-B", "-q", "-Dstyle.color=never", "-f", "pom.xml"])
        .arg(format!("{DEPENDENCY_PLUGIN}:copy-dependencies"))
        .arg(format!("-DoutputDirectory={}", libs.display()))
        .arg("-DincludeScope=runtime")
        .stdin(Stdio::null());
    let described = format!(
        "mvn dependency:copy-dependencies (org.apache.kafka:kafka_2.13:{KAFKA_VERSION}) in {}",
        staging.display()
    );
    let out = mvn.output().map_err(|e| {
        let _ = std::fs::remove_dir_all(&staging);
        if e.kind() == std::io::ErrorKind::NotFound {
            HarnessError::NoJavaOrMaven {
                tool: "mvn".into(),
                detail: "not on the PATH; it fetches the Kafka broker from Maven Central once"
                    .into(),
            }
        } else {
            io(format!("running {described}"), e)
        }
    })?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(HarnessError::Command {
            command: described,
            detail: format!(
                "{}; output:\n{}{}\n(the first run needs Maven Central; set OUTBOXD_KAFKA_CACHE \
                 to a directory that holds a resolved kafka-{KAFKA_VERSION}/ to run offline)",
                out.status,
                tail(&String::from_utf8_lossy(&out.stdout), 40),
                tail(&String::from_utf8_lossy(&out.stderr), 40),
            ),
        });
    }
    let mut jars: Vec<String> = std::fs::read_dir(&libs)
        .map_err(|e| io(format!("listing {}", libs.display()), e))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".jar"))
        .collect();
    jars.sort();
    if !jars.iter().any(|j| j.starts_with("kafka_2.13-")) {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(kafka_err(format!(
            "{described} succeeded but copied no kafka_2.13 jar"
        )));
    }
    std::fs::write(staging.join("classpath"), jars.join("\n") + "\n")
        .map_err(|e| io("writing the cached classpath", e))?;
    // A directory without a complete classpath (interrupted by hand, older layout) is replaced.
    if dir.exists() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    std::fs::rename(&staging, &dir)
        .map_err(|e| io(format!("publishing the jar cache {}", dir.display()), e))?;
    cached_jars(&dir).ok_or_else(|| kafka_err(format!("{} is incomplete", dir.display())))
}

/// The last `lines` lines of `text` (a child's output, for an error message).
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ---------------------------------------------------------------------------------------------
// Spawning JVMs that die with this process
// ---------------------------------------------------------------------------------------------

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns `cmd` (a JVM: a Kafka broker here, the bench's Debezium relay) so that it dies with
/// this process, even when this process is SIGKILLed.
///
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked exits, not the process: a JVM
/// spawned from a test's thread would be killed when that test ends, though the shared
/// cluster lives on. So every JVM is spawned by this one thread, which lives (blocked on its
/// channel) until the process exits.
pub fn spawn_jvm(mut cmd: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let tx = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("jvm-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawning the jvm-spawner thread");
        Mutex::new(tx)
    });
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (prctl, getppid), allocating nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent died between fork and prctl: nothing would kill this JVM later.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("parent exited before exec"));
            }
            Ok(())
        });
    }
    let (reply_tx, reply_rx) = mpsc::channel();
    tx.lock()
        .map_err(|_| std::io::Error::other("spawner lock poisoned"))?
        .send((cmd, reply_tx))
        .map_err(|_| std::io::Error::other("the JVM spawner thread is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| std::io::Error::other("the JVM spawner thread is gone"))?
}

// ---------------------------------------------------------------------------------------------
// The cluster
// ---------------------------------------------------------------------------------------------

/// One combined broker+controller node.
#[derive(Debug)]
struct Node {
    id: i32,
    port: u16,
    controller_port: u16,
    dir: PathBuf,
    child: Mutex<Option<Child>>,
    starts: Mutex<u32>,
}

impl Node {
    fn log_path(&self) -> PathBuf {
        self.dir.join("node.log")
    }

    fn pid(&self) -> Option<u32> {
        self.child.lock().ok()?.as_ref().map(Child::id)
    }

    fn signal(&self, sig: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) on the pid of our own child, which is not reaped while we hold
            // its `Child` (so the pid cannot have been reused).
            unsafe {
                libc::kill(pid as i32, sig);
            }
        }
    }

    /// SIGCONT (a stopped process would otherwise keep its state), SIGKILL, reap.
    fn kill(&self) {
        let child = self.child.lock().ok().and_then(|mut c| c.take());
        if let Some(mut c) = child {
            // SAFETY: as in `signal`: our unreaped child.
            unsafe {
                libc::kill(c.id() as i32, libc::SIGCONT);
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        tail(&text, lines)
    }
}

/// N real Kafka brokers (combined KRaft broker+controller nodes) on loopback, killed on drop.
#[derive(Debug)]
pub struct KafkaCluster {
    nodes: Vec<Node>,
    java: PathBuf,
    classpath: String,
    root: PathBuf,
    /// A temporary root, removed on drop; `None` for a directory the caller chose.
    _temp: Option<tempfile::TempDir>,
}

/// A KRaft cluster id: 16 random bytes, base64url without padding (22 characters), never
/// starting with `-`: `kafka-storage format -t -Xy…` reads such an id as an option and fails
/// ("argument --cluster-id: expected one argument"), 1 start in 64 (seen in CI). Kafka's own
/// `Uuid.randomUuid` avoids it the same way.
fn cluster_id() -> String {
    let mut bytes = [0u8; 16];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .is_ok();
    if !ok {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
            ^ u128::from(std::process::id());
        bytes = seed.to_le_bytes();
    }
    // The first character is the top 6 bits of the first byte: below 32, a letter.
    bytes[0] &= 0x7f;
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(22);
    let mut acc: u32 = 0;
    let mut bits = 0;
    for b in bytes {
        acc = (acc << 8) | u32::from(b);
        bits += 8;
        while bits >= 6 {
            bits -= 6;
            out.push(ALPHABET[((acc >> bits) & 63) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((acc << (6 - bits)) & 63) as usize] as char);
    }
    out
}

const LOG4J2_PROPERTIES: &str = "\
# Written by outbox-testkit: everything to stdout, which goes to node.log.
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
# The full configuration dump at every start drowns the log.
logger.config.name = org.apache.kafka.common.config.AbstractConfig
logger.config.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
";

impl KafkaCluster {
    /// Starts `nodes` (1 or more; 1 and 3 are the tested shapes) combined broker+controller
    /// nodes in a temporary directory and waits until all of them are in the metadata.
    pub fn start(nodes: usize) -> Result<KafkaCluster, HarnessError> {
        Self::start_in(nodes, None)
    }

    /// Like [`Self::start`], in `dir` (created; kept after drop) instead of a temporary
    /// directory. `dir` must not hold a previous cluster.
    pub fn start_in(nodes: usize, dir: Option<&Path>) -> Result<KafkaCluster, HarnessError> {
        if nodes == 0 {
            return Err(kafka_err("a cluster needs at least one node"));
        }
        let java = check_java()?;
        let jars = resolve_classpath()?;
        let classpath = jars
            .iter()
            .map(|j| j.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(":");
        let (temp, root) = match dir {
            Some(d) => {
                if d.join("node-1").exists() {
                    return Err(kafka_err(format!(
                        "{} already holds a cluster (node-1/): remove it or choose another --dir",
                        d.display()
                    )));
                }
                std::fs::create_dir_all(d)
                    .map_err(|e| io(format!("creating {}", d.display()), e))?;
                (None, d.to_path_buf())
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("outboxd-kafka-")
                    .tempdir()
                    .map_err(|e| io("creating a temporary directory for Kafka", e))?;
                let p = t.path().to_path_buf();
                (Some(t), p)
            }
        };
        std::fs::write(root.join("log4j2.properties"), LOG4J2_PROPERTIES)
            .map_err(|e| io("writing log4j2.properties", e))?;

        let ports = crate::ports::free_ports(2 * nodes)?;
        let cluster = KafkaCluster {
            nodes: (0..nodes)
                .map(|i| Node {
                    id: i as i32 + 1,
                    port: ports[2 * i],
                    controller_port: ports[2 * i + 1],
                    dir: root.join(format!("node-{}", i + 1)),
                    child: Mutex::new(None),
                    starts: Mutex::new(0),
                })
                .collect(),
            java,
            classpath,
            root,
            _temp: temp,
        };
        let voters = cluster
            .nodes
            .iter()
            .map(|n| format!("{}@127.0.0.1:{}", n.id, n.controller_port))
            .collect::<Vec<_>>()
            .join(",");
        let id = cluster_id();
        for node in &cluster.nodes {
            std::fs::create_dir_all(&node.dir)
                .map_err(|e| io(format!("creating {}", node.dir.display()), e))?;
            let props = server_properties(node, nodes, &voters);
            std::fs::write(node.dir.join("server.properties"), props)
                .map_err(|e| io("writing server.properties", e))?;
        }
        cluster.format_all(&id)?;
        // All JVMs start together (the quorum needs a majority up), then each is awaited.
        for node in &cluster.nodes {
            cluster.spawn(node)?;
        }
        let deadline = Instant::now() + START_TIMEOUT;
        for node in &cluster.nodes {
            cluster.wait_serving(node, deadline)?;
        }
        let want: Vec<i32> = cluster.nodes.iter().map(|n| n.id).collect();
        cluster.wait_for(deadline, "all brokers in the metadata", |c| {
            let md = match c.metadata(None, &c.bootstrap_servers()) {
                Ok(md) => md,
                Err(e) => return Ok(Err(e)),
            };
            let mut ids: Vec<i32> = md.brokers().iter().map(|b| b.id()).collect();
            ids.sort();
            if ids == want {
                Ok(Ok(()))
            } else {
                Ok(Err(format!("brokers {ids:?}")))
            }
        })?;
        Ok(cluster)
    }

    /// `kafka.tools.StorageTool format` of every node, in parallel. The quorum is static
    /// (`controller.quorum.voters`), so no `--standalone` / `--initial-controllers` (those
    /// are for dynamic quorums, `controller.quorum.bootstrap.servers`).
    fn format_all(&self, cluster_id: &str) -> Result<(), HarnessError> {
        let mut running = Vec::new();
        for node in &self.nodes {
            let mut cmd = Command::new(&self.java);
            cmd.arg("-cp")
                .arg(&self.classpath)
                .arg(format!(
                    "-Dlog4j2.configurationFile={}",
                    self.root.join("log4j2.properties").display()
                ))
                .args(["-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"])
                .args(["kafka.tools.StorageTool", "format", "-t", cluster_id, "-c"])
                .arg(node.dir.join("server.properties"))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let child = cmd.spawn().map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    HarnessError::NoJavaOrMaven {
                        tool: "java".into(),
                        detail: format!("{}: {e}", self.java.display()),
                    }
                } else {
                    io(
                        format!(
                            "running kafka.tools.StorageTool with {}",
                            self.java.display()
                        ),
                        e,
                    )
                }
            })?;
            running.push((node.id, child));
        }
        let mut failures = String::new();
        for (id, child) in running {
            let out = child
                .wait_with_output()
                .map_err(|e| io("waiting for kafka.tools.StorageTool", e))?;
            if !out.status.success() {
                let _ = write!(
                    failures,
                    "\nnode {id}: {}; output:\n{}{}",
                    out.status,
                    tail(&String::from_utf8_lossy(&out.stdout), 30),
                    tail(&String::from_utf8_lossy(&out.stderr), 30)
                );
            }
        }
        if !failures.is_empty() {
            return Err(HarnessError::Command {
                command: "kafka.tools.StorageTool format".into(),
                detail: failures,
            });
        }
        Ok(())
    }

    fn spawn(&self, node: &Node) -> Result<(), HarnessError> {
        let starts = {
            let mut s = node.starts.lock().map_err(|_| kafka_err("lock poisoned"))?;
            *s += 1;
            *s
        };
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(node.log_path())
            .map_err(|e| io("opening the node log", e))?;
        if starts > 1 {
            let _ = writeln!(log, "\n--- outbox-testkit: start #{starts} ---\n");
        }
        let log_err = log.try_clone().map_err(|e| io("opening the node log", e))?;
        let mut cmd = Command::new(&self.java);
        cmd.args(["-Xmx512m", "-Xms128m", "-XX:+UseSerialGC"])
            .arg("-Djava.awt.headless=true")
            .arg(format!(
                "-Dlog4j2.configurationFile={}",
                self.root.join("log4j2.properties").display()
            ))
            .arg("-cp")
            .arg(&self.classpath)
            .arg("kafka.Kafka")
            .arg(node.dir.join("server.properties"))
            .current_dir(&node.dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let child = spawn_jvm(cmd).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                HarnessError::NoJavaOrMaven {
                    tool: "java".into(),
                    detail: format!("{}: {e}", self.java.display()),
                }
            } else {
                io(format!("starting Kafka node {}", node.id), e)
            }
        })?;
        *node.child.lock().map_err(|_| kafka_err("lock poisoned"))? = Some(child);
        Ok(())
    }

    /// Until the node's listener accepts TCP and the broker itself answers a metadata
    /// request listing itself (the acceptor queues connections before the broker serves).
    fn wait_serving(&self, node: &Node, deadline: Instant) -> Result<(), HarnessError> {
        let own = format!("127.0.0.1:{}", node.port);
        self.wait_for(deadline, &format!("node {} to serve", node.id), |c| {
            c.check_alive(node)?;
            if std::net::TcpStream::connect_timeout(
                &([127, 0, 0, 1], node.port).into(),
                Duration::from_millis(500),
            )
            .is_err()
            {
                return Ok(Err(format!("port {} refuses connections", node.port)));
            }
            let md = match c.metadata(None, &own) {
                Ok(md) => md,
                Err(e) => return Ok(Err(e)),
            };
            if md.brokers().iter().any(|b| b.id() == node.id) {
                Ok(Ok(()))
            } else {
                Ok(Err(format!("node {} not in its own metadata", node.id)))
            }
        })
    }

    /// An early exit of a node is an error with its log.
    fn check_alive(&self, node: &Node) -> Result<(), HarnessError> {
        let mut guard = node.child.lock().map_err(|_| kafka_err("lock poisoned"))?;
        if let Some(c) = guard.as_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                guard.take();
                return Err(kafka_err(format!(
                    "node {} exited with {status}; its log ({}) ends with:\n{}",
                    node.id,
                    node.log_path().display(),
                    node.log_tail(60)
                )));
            }
        }
        Ok(())
    }

    /// Polls `check` every 100 ms until it returns `Ok(Ok(v))`; `Ok(Err(observation))` means
    /// "not yet", `Err` is fatal. The deadline is an error with the last observation and the
    /// tail of every node's log.
    fn wait_for<T>(
        &self,
        deadline: Instant,
        what: &str,
        mut check: impl FnMut(&Self) -> Result<Result<T, String>, HarnessError>,
    ) -> Result<T, HarnessError> {
        loop {
            let last = match check(self)? {
                Ok(v) => return Ok(v),
                Err(observed) => observed,
            };
            if Instant::now() > deadline {
                let mut msg = format!("timed out waiting for {what} (last: {last})");
                for n in &self.nodes {
                    let _ = write!(
                        msg,
                        "\n--- node {} log ({}), last lines:\n{}",
                        n.id,
                        n.log_path().display(),
                        n.log_tail(25)
                    );
                }
                return Err(kafka_err(msg));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// One metadata request through a fresh client (no cached connection state); the error
    /// is an observation to poll on, not a failure.
    fn metadata(&self, topic: Option<&str>, bootstrap: &str) -> Result<Metadata, String> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("socket.connection.setup.timeout.ms", "1000")
            .set("reconnect.backoff.max.ms", "200")
            .set("allow.auto.create.topics", "false")
            .set("log_level", "0")
            .create()
            .map_err(|e| format!("metadata client: {e}"))?;
        consumer
            .fetch_metadata(topic, Duration::from_secs(2))
            .map_err(|e| format!("metadata: {e}"))
    }

    fn node(&self, id: i32) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .unwrap_or_else(|| panic!("no Kafka node {id} (nodes are 1..={})", self.nodes.len()))
    }

    /// `127.0.0.1:PORT,...` of every node (including stopped ones).
    pub fn bootstrap_servers(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Node ids, `1..=N`.
    pub fn node_ids(&self) -> Vec<i32> {
        self.nodes.iter().map(|n| n.id).collect()
    }

    /// The PLAINTEXT (client) port of node `id`. Panics on an unknown id, as do the other
    /// per-node methods.
    pub fn port(&self, id: i32) -> u16 {
        self.node(id).port
    }

    /// The JVM's pid, `None` while the node is killed.
    pub fn pid(&self, id: i32) -> Option<u32> {
        self.node(id).pid()
    }

    /// The directory of the cluster (`node-ID/` per node: properties, data, `node.log`).
    pub fn dir(&self) -> &Path {
        &self.root
    }

    /// The log of node `id` (all its starts).
    pub fn log_path(&self, id: i32) -> PathBuf {
        self.node(id).log_path()
    }

    /// SIGSTOP: sockets stay open, nothing is answered; the controller fences the broker
    /// after the session timeout (4 s).
    pub fn pause(&self, id: i32) {
        self.node(id).signal(libc::SIGSTOP);
    }

    /// SIGCONT.
    pub fn resume(&self, id: i32) {
        self.node(id).signal(libc::SIGCONT);
    }

    /// SIGKILL and reap; the node stays down until [`Self::restart`].
    pub fn kill(&self, id: i32) {
        self.node(id).kill();
    }

    /// Starts node `id` again (killing it first if it runs) on the same ports and log
    /// directories, and waits until it serves and is in the cluster's metadata.
    pub fn restart(&self, id: i32) -> Result<(), HarnessError> {
        let node = self.node(id);
        node.kill();
        self.spawn(node)?;
        let deadline = Instant::now() + START_TIMEOUT;
        self.wait_serving(node, deadline)?;
        self.wait_for(deadline, &format!("node {id} in the metadata"), |c| {
            let md = match c.metadata(None, &c.bootstrap_servers()) {
                Ok(md) => md,
                Err(e) => return Ok(Err(e)),
            };
            let ids: Vec<i32> = md.brokers().iter().map(|b| b.id()).collect();
            if ids.contains(&id) {
                Ok(Ok(()))
            } else {
                Ok(Err(format!("brokers {ids:?}")))
            }
        })
    }

    /// The leader of `topic`/`partition` in the metadata of any live broker, `None` if the
    /// topic or partition is unknown or has no leader.
    pub fn leader_of(&self, topic: &str, partition: i32) -> Option<i32> {
        let md = self.metadata(Some(topic), &self.bootstrap_servers()).ok()?;
        let t = md.topics().iter().find(|t| t.name() == topic)?;
        if t.error().is_some() {
            return None;
        }
        let p = t.partitions().iter().find(|p| p.id() == partition)?;
        (p.error().is_none() && p.leader() >= 0).then_some(p.leader())
    }

    /// The in-sync replicas of `topic`/`partition` (empty if unknown).
    pub fn isr_of(&self, topic: &str, partition: i32) -> Vec<i32> {
        self.metadata(Some(topic), &self.bootstrap_servers())
            .ok()
            .and_then(|md| {
                let t = md.topics().iter().find(|t| t.name() == topic)?;
                let p = t.partitions().iter().find(|p| p.id() == partition)?;
                Some(p.isr().to_vec())
            })
            .unwrap_or_default()
    }

    /// Creates `topic` with the AdminClient and waits until every partition has a leader
    /// ([`create_topic_at`] on this cluster).
    pub fn create_topic(
        &self,
        topic: &str,
        partitions: i32,
        replication: i32,
        configs: &[(&str, &str)],
    ) -> Result<(), HarnessError> {
        create_topic_at(
            &self.bootstrap_servers(),
            topic,
            partitions,
            replication,
            configs,
        )
    }

    /// Kills every JVM and reaps it (resuming paused ones first). Also done on drop.
    pub fn stop(&self) {
        for n in &self.nodes {
            n.kill();
        }
    }
}

impl Drop for KafkaCluster {
    fn drop(&mut self) {
        self.stop();
        // The temporary root (if any) is removed by its TempDir, after the JVMs are gone.
    }
}

fn server_properties(node: &Node, nodes: usize, voters: &str) -> String {
    let (rf, isr) = if nodes >= 3 { (3, 2) } else { (nodes, 1) };
    let data = node.dir.join("data");
    format!(
        "# Written by outbox-testkit.\n\
         process.roles=broker,controller\n\
         node.id={id}\n\
         controller.quorum.voters={voters}\n\
         listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}\n\
         advertised.listeners=PLAINTEXT://127.0.0.1:{port}\n\
         controller.listener.names=CONTROLLER\n\
         inter.broker.listener.name=PLAINTEXT\n\
         listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT\n\
         log.dirs={data}\n\
         auto.create.topics.enable=true\n\
         num.partitions=1\n\
         default.replication.factor={rf}\n\
         min.insync.replicas={isr}\n\
         offsets.topic.replication.factor={rf}\n\
         offsets.topic.num.partitions=4\n\
         transaction.state.log.replication.factor={rf}\n\
         transaction.state.log.min.isr={isr}\n\
         transaction.state.log.num.partitions=4\n\
         share.coordinator.state.topic.replication.factor={rf}\n\
         share.coordinator.state.topic.min.isr={isr}\n\
         group.initial.rebalance.delay.ms=0\n\
         broker.session.timeout.ms={session}\n\
         broker.heartbeat.interval.ms={heartbeat}\n\
         replica.lag.time.max.ms=10000\n\
         unclean.leader.election.enable=false\n\
         log.segment.bytes=16777216\n\
         log.retention.check.interval.ms=60000\n\
         num.network.threads=2\n\
         num.io.threads=2\n\
         background.threads=2\n\
         num.recovery.threads.per.data.dir=1\n\
         log.cleaner.dedupe.buffer.size=4194304\n",
        id = node.id,
        port = node.port,
        cport = node.controller_port,
        data = data.display(),
        session = BROKER_SESSION_TIMEOUT_MS,
        heartbeat = BROKER_HEARTBEAT_MS,
    )
}

// ---------------------------------------------------------------------------------------------
// The cluster shared by a test process
// ---------------------------------------------------------------------------------------------

static SHARED: OnceLock<KafkaCluster> = OnceLock::new();
static SHARED_INIT: Mutex<Option<String>> = Mutex::new(None);

extern "C" fn stop_shared_cluster() {
    if let Some(c) = SHARED.get() {
        c.stop();
        let _ = std::fs::remove_dir_all(&c.root);
    }
}

/// A single-node cluster shared by every test of this process: started on first use, stopped
/// (and its directory removed) when the process exits. A failed start is remembered: later
/// calls return the same error at once.
pub fn shared() -> Result<&'static KafkaCluster, HarnessError> {
    if let Some(c) = SHARED.get() {
        return Ok(c);
    }
    let mut failed = SHARED_INIT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(c) = SHARED.get() {
        return Ok(c);
    }
    if let Some(msg) = failed.as_ref() {
        return Err(kafka_err(format!(
            "the shared cluster failed to start earlier: {msg}"
        )));
    }
    match KafkaCluster::start(1) {
        Ok(c) => {
            // The static is never dropped: stop the JVM and remove the directory at exit
            // (the JVM would die with the process anyway, through PR_SET_PDEATHSIG).
            static AT_EXIT: std::sync::Once = std::sync::Once::new();
            AT_EXIT.call_once(|| {
                // SAFETY: registering a plain `extern "C" fn()` with no captured state.
                unsafe {
                    libc::atexit(stop_shared_cluster);
                }
            });
            Ok(SHARED.get_or_init(|| c))
        }
        Err(e) => {
            *failed = Some(e.to_string());
            Err(e)
        }
    }
}

/// Creates `topic` on the brokers at `bootstrap` with the AdminClient (an existing topic is left
/// as it is) and waits until every partition has a leader. `configs` are topic configs such as
/// `("min.insync.replicas", "2")`. Blocking (it may be called from async tests: the admin future
/// completes on librdkafka's thread).
pub fn create_topic_at(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    replication: i32,
    configs: &[(&str, &str)],
) -> Result<(), HarnessError> {
    use rdkafka::types::RDKafkaErrorCode;
    let (admin, opts) = admin_at(bootstrap)?;
    let mut new = NewTopic::new(topic, partitions, TopicReplication::Fixed(replication));
    for (k, v) in configs {
        new = new.set(k, v);
    }
    let results = futures::executor::block_on(admin.create_topics([&new], &opts))
        .map_err(|e| kafka_err(format!("creating topic {topic} at {bootstrap}: {e}")))?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, code)) => {
                return Err(kafka_err(format!(
                    "creating topic {t} at {bootstrap}: {code}"
                )))
            }
        }
    }
    wait_for_leaders(bootstrap, topic, partitions)
}

/// Raises `topic`'s partition count at `bootstrap` to `total` with the AdminClient and waits
/// until every partition has a leader. Blocking, as [`create_topic_at`].
pub fn add_partitions_at(bootstrap: &str, topic: &str, total: i32) -> Result<(), HarnessError> {
    let (admin, opts) = admin_at(bootstrap)?;
    let new = NewPartitions::new(topic, total as usize);
    let results = futures::executor::block_on(admin.create_partitions([&new], &opts))
        .map_err(|e| kafka_err(format!("raising {topic}'s partitions at {bootstrap}: {e}")))?;
    for r in results {
        if let Err((t, code)) = r {
            return Err(kafka_err(format!(
                "raising {t}'s partitions to {total} at {bootstrap}: {code}"
            )));
        }
    }
    wait_for_leaders(bootstrap, topic, total)
}

/// An AdminClient for the brokers at `bootstrap`, and the options of its requests (30 s each).
fn admin_at(
    bootstrap: &str,
) -> Result<(AdminClient<DefaultClientContext>, AdminOptions), HarnessError> {
    let admin = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("log_level", "0")
        .create()
        .map_err(|e| kafka_err(format!("admin client: {e}")))?;
    let opts = AdminOptions::new()
        .request_timeout(Some(Duration::from_secs(30)))
        .operation_timeout(Some(Duration::from_secs(30)));
    Ok((admin, opts))
}

/// Waits (30 s at most) until `topic` has `partitions` partitions, each with a leader.
fn wait_for_leaders(bootstrap: &str, topic: &str, partitions: i32) -> Result<(), HarnessError> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("log_level", "0")
        .create()
        .map_err(|e| kafka_err(format!("metadata client: {e}")))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = match consumer.fetch_metadata(Some(topic), Duration::from_secs(5)) {
            Err(e) => format!("metadata: {e}"),
            Ok(md) => match md.topics().iter().find(|t| t.name() == topic) {
                None => "topic not in the metadata".to_string(),
                Some(t)
                    if t.error().is_none()
                        && t.partitions().len() == partitions as usize
                        && t.partitions()
                            .iter()
                            .all(|p| p.error().is_none() && p.leader() >= 0) =>
                {
                    return Ok(())
                }
                Some(t) => format!(
                    "leaders {:?}",
                    t.partitions()
                        .iter()
                        .map(|p| p.leader())
                        .collect::<Vec<_>>()
                ),
            },
        };
        if Instant::now() > deadline {
            return Err(kafka_err(format!(
                "topic {topic} at {bootstrap} has no leader for every partition after 30 s: {state}"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn java_major_versions() {
        assert_eq!(
            java_major("openjdk version \"17.0.15\" 2025-04-15"),
            Some(17)
        );
        assert_eq!(java_major("java version \"1.8.0_392\""), Some(8));
        assert_eq!(java_major("openjdk version \"21\" 2023-09-19"), Some(21));
        assert_eq!(java_major("openjdk version \"25-ea\""), Some(25));
        assert_eq!(java_major("garbage"), None);
    }

    #[test]
    fn cluster_ids_are_22_base64url_chars() {
        let id = cluster_id();
        assert_eq!(id.len(), 22, "{id}");
        assert!(id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'));
        assert_ne!(id, cluster_id());
        for _ in 0..2_000 {
            let id = cluster_id();
            assert!(id.starts_with(|c: char| c.is_ascii_alphabetic()), "{id}");
        }
    }
}
