//! A throwaway NATS server with JetStream, one per test that needs it.
//!
//! `nats-server -js` on a free loopback port with its own store directory and server name, so
//! that a test can inject faults into *its* broker only: pause it (`SIGSTOP`: connections stay
//! open, nothing is answered — a lost ACK), resume it, or kill and restart it on the same port
//! and store (what JetStream persisted survives, including its duplicate-detection state).
//!
//! The binary is `$OUTBOXD_NATS_SERVER`, else `/usr/sbin/nats-server`, else `nats-server` on
//! the PATH.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::HarnessError;

/// A running `nats-server -js`, killed on drop.
#[derive(Debug)]
pub struct TestNats {
    child: Option<Child>,
    bin: PathBuf,
    port: u16,
    name: String,
    dir: tempfile::TempDir,
    starts: u32,
    /// Authentication flags (`--user/--pass`, `--auth`), kept for restarts.
    auth: Vec<String>,
    /// A config file those flags name, kept for restarts and removed with the server (it was
    /// left in the temporary directory, one per run of the NKey test).
    conf: Option<tempfile::TempPath>,
}

fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("OUTBOXD_NATS_SERVER") {
        return PathBuf::from(p);
    }
    let sbin = PathBuf::from("/usr/sbin/nats-server");
    if sbin.exists() {
        return sbin;
    }
    PathBuf::from("nats-server")
}

impl TestNats {
    /// Starts a server named `name` (its identity: the relay's `--cluster-name`).
    pub fn start(name: &str) -> Result<TestNats, HarnessError> {
        Self::start_with_auth(name, &[])
    }

    /// A server that accepts only `user` with `password` (`--user`, `--pass`).
    pub fn start_with_user(
        name: &str,
        user: &str,
        password: &str,
    ) -> Result<TestNats, HarnessError> {
        Self::start_with_auth(name, &["--user", user, "--pass", password])
    }

    /// A server that accepts only clients presenting `token` (`--auth`).
    pub fn start_with_token(name: &str, token: &str) -> Result<TestNats, HarnessError> {
        Self::start_with_auth(name, &["--auth", token])
    }

    /// A server that accepts only the holder of a user NKey it generates (an `authorization`
    /// block listing the user's public key, in a config file: nats-server has no flag for
    /// it). Returns the server and the user's seed (`SU...`).
    pub fn start_with_nkey(name: &str) -> Result<(TestNats, String), HarnessError> {
        let user = nkeys::KeyPair::new_user();
        let seed = user.seed().map_err(|e| HarnessError::Command {
            command: "nkeys::KeyPair::new_user".into(),
            detail: e.to_string(),
        })?;
        let io = |source| HarnessError::Io {
            context: "writing the nats-server NKey config".into(),
            source,
        };
        let mut file = tempfile::Builder::new()
            .prefix("outboxd-nats-nkey-")
            .suffix(".conf")
            .tempfile()
            .map_err(io)?;
        std::io::Write::write_all(
            &mut file,
            format!(
                "authorization {{\n  users = [ {{ nkey: {} }} ]\n}}\n",
                user.public_key()
            )
            .as_bytes(),
        )
        .map_err(io)?;
        let conf = file.into_temp_path();
        let mut server = Self::start_with_auth(name, &["-c", &conf.display().to_string()])?;
        server.conf = Some(conf);
        Ok((server, seed))
    }

    /// A server that requires TLS (`--tls`) with this certificate and key (e.g. from
    /// [`crate::tls::make_ca_and_server_cert`]).
    pub fn start_with_tls(
        name: &str,
        cert: &std::path::Path,
        key: &std::path::Path,
    ) -> Result<TestNats, HarnessError> {
        let (cert, key) = (cert.display().to_string(), key.display().to_string());
        Self::start_with_auth(name, &["--tls", "--tlscert", &cert, "--tlskey", &key])
    }

    fn start_with_auth(name: &str, auth: &[&str]) -> Result<TestNats, HarnessError> {
        let dir = tempfile::tempdir().map_err(|source| HarnessError::Io {
            context: "creating the nats-server store directory".into(),
            source,
        })?;
        let mut n = TestNats {
            child: None,
            bin: binary(),
            port: crate::ports::free_port()?,
            name: name.to_string(),
            dir,
            starts: 0,
            auth: auth.iter().map(|a| a.to_string()).collect(),
            conf: None,
        };
        n.spawn()?;
        Ok(n)
    }

    fn spawn(&mut self) -> Result<(), HarnessError> {
        self.starts += 1;
        let log = self.dir.path().join(format!("server-{}.log", self.starts));
        let store = self.dir.path().join("store");
        let command = format!(
            "{} -js -a 127.0.0.1 -p {} -sd {} -n {}{}",
            self.bin.display(),
            self.port,
            store.display(),
            self.name,
            if self.auth.is_empty() {
                ""
            } else {
                " (with authentication flags)"
            }
        );
        let child = Command::new(&self.bin)
            .args(["-js", "-a", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .arg("-sd")
            .arg(&store)
            .arg("-n")
            .arg(&self.name)
            .arg("-l")
            .arg(&log)
            .args(&self.auth)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| HarnessError::Command {
                command: command.clone(),
                detail: format!("{e}; install nats-server (apt-get install nats-server) or set OUTBOXD_NATS_SERVER"),
            })?;
        self.child = Some(child);
        // Ready = the log says so (JetStream recovered its store) and the port answers.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("Server is ready")
                && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    return Err(HarnessError::Command {
                        command,
                        detail: format!("exited with {status}; log:\n{text}"),
                    });
                }
            }
            if Instant::now() > deadline {
                return Err(HarnessError::Command {
                    command,
                    detail: format!("not ready within 30 s; log:\n{text}"),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server name: what the relay must serve as `--cluster-name`.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe {
                libc::kill(c.id() as i32, sig);
            }
        }
    }

    /// SIGSTOP: the server keeps its sockets but answers nothing until [`Self::resume`].
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// SIGKILL, then start again on the same port with the same store.
    pub fn restart(&mut self) -> Result<(), HarnessError> {
        self.kill();
        self.spawn()
    }

    /// SIGKILL and wait (the server is down until [`Self::restart`]).
    pub fn kill(&mut self) {
        // No SIGCONT first: a paused server must die without reading what sits in its sockets
        // (SIGKILL ends a stopped process too).
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The server's log (all starts), for failure messages.
    pub fn log_text(&self) -> String {
        (1..=self.starts)
            .map(|i| {
                std::fs::read_to_string(self.dir.path().join(format!("server-{i}.log")))
                    .unwrap_or_default()
            })
            .collect::<Vec<_>>()
            .join("\n--- restart ---\n")
    }
}

impl Drop for TestNats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One stored message, as a test reads it back.
#[derive(Debug, Clone)]
pub struct StoredMessage {
    pub sequence: u64,
    pub subject: String,
    pub headers: HashMap<String, String>,
    pub payload: String,
}

impl StoredMessage {
    /// `Nats-Msg-Id` (the event id).
    pub fn msg_id(&self) -> &str {
        self.headers
            .get("Nats-Msg-Id")
            .map(String::as_str)
            .unwrap_or("")
    }
}

/// Every message of `stream`, in sequence order.
pub async fn read_stream(url: &str, stream: &str) -> Result<Vec<StoredMessage>, HarnessError> {
    let err = |what: &str, e: &dyn std::fmt::Display| HarnessError::Command {
        command: format!("reading JetStream stream {stream} at {url}"),
        detail: format!("{what}: {e}"),
    };
    let client = async_nats::connect(url)
        .await
        .map_err(|e| err("connect", &e))?;
    let js = async_nats::jetstream::new(client);
    let mut s = js
        .get_stream(stream)
        .await
        .map_err(|e| err("get stream", &e))?;
    let state = s
        .info()
        .await
        .map_err(|e| err("stream info", &e))?
        .state
        .clone();
    let mut out = Vec::new();
    if state.messages == 0 {
        return Ok(out);
    }
    for seq in state.first_sequence..=state.last_sequence {
        match s.get_raw_message(seq).await {
            Ok(m) => {
                let headers = m
                    .headers
                    .iter()
                    .filter_map(|(k, v)| v.first().map(|v| (k.to_string(), v.as_str().to_string())))
                    .collect();
                out.push(StoredMessage {
                    sequence: m.sequence,
                    subject: m.subject.to_string(),
                    headers,
                    payload: String::from_utf8_lossy(&m.payload).into_owned(),
                });
            }
            Err(e)
                if matches!(
                    e.kind(),
                    async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound
                ) => {}
            Err(e) => return Err(err(&format!("message {seq}"), &e)),
        }
    }
    Ok(out)
}

/// Creates `stream` (file storage) capturing `subjects`, with the given duplicate window.
pub async fn create_stream(
    url: &str,
    stream: &str,
    subjects: &[&str],
    duplicate_window: Duration,
) -> Result<(), HarnessError> {
    let err = |e: &dyn std::fmt::Display| HarnessError::Command {
        command: format!("creating JetStream stream {stream} at {url}"),
        detail: e.to_string(),
    };
    let client = async_nats::connect(url).await.map_err(|e| err(&e))?;
    async_nats::jetstream::new(client)
        .create_stream(async_nats::jetstream::stream::Config {
            name: stream.to_string(),
            subjects: subjects.iter().map(|s| s.to_string()).collect(),
            duplicate_window,
            ..Default::default()
        })
        .await
        .map_err(|e| err(&e))?;
    Ok(())
}

/// Publishes one message with `Nats-Msg-Id` = `msg_id` and header `id` = `msg_id` (what an
/// earlier relay generation would have stored); returns its stream sequence.
pub async fn publish(
    url: &str,
    subject: &str,
    msg_id: &str,
    payload: &str,
) -> Result<u64, HarnessError> {
    let err = |e: &dyn std::fmt::Display| HarnessError::Command {
        command: format!("publishing to {subject} at {url}"),
        detail: e.to_string(),
    };
    let client = async_nats::connect(url).await.map_err(|e| err(&e))?;
    let js = async_nats::jetstream::new(client);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, msg_id);
    headers.insert("id", msg_id);
    let ack = js
        .publish_with_headers(
            subject.to_string(),
            headers,
            payload.to_string().into_bytes().into(),
        )
        .await
        .map_err(|e| err(&e))?
        .await
        .map_err(|e| err(&e))?;
    Ok(ack.sequence)
}
