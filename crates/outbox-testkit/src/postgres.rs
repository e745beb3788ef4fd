//! A throwaway PostgreSQL cluster with `wal_level=logical`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::HarnessError;

/// A running cluster (owned) or an external server named by a URL (borrowed).
#[derive(Debug)]
pub struct TestPostgres {
    /// `postgres://user@host:port` without a database name.
    base_url: String,
    /// Database used for administrative statements (CREATE DATABASE).
    admin_db: String,
    owned: Option<OwnedCluster>,
    /// The database [`TestPostgres::create_database_from_template`] copies, made once per
    /// process.
    template: tokio::sync::OnceCell<String>,
}

#[derive(Debug)]
struct OwnedCluster {
    bin: PathBuf,
    data: PathBuf,
    /// Keeps the directory alive; removed on drop.
    _dir: Option<tempfile::TempDir>,
    run_as: Option<(u32, u32)>,
}

static SHARED: OnceLock<TestPostgres> = OnceLock::new();
/// (bin dir, data dir, run-as uid/gid, temporary root to delete) of clusters to stop at
/// process exit. The shared cluster lives in a static that is never dropped, so its temporary
/// directory is removed here, or every test process would leave a cluster's files behind.
type Registered = (PathBuf, PathBuf, Option<(u32, u32)>, Option<PathBuf>);
static TO_STOP: Mutex<Vec<Registered>> = Mutex::new(Vec::new());
static DB_COUNTER: AtomicU64 = AtomicU64::new(0);

extern "C" fn stop_registered_clusters() {
    if let Ok(list) = TO_STOP.lock() {
        for (bin, data, run_as, temp_root) in list.iter() {
            let _ = pg_ctl_stop(bin, data, *run_as);
            if let Some(root) = temp_root {
                let _ = std::fs::remove_dir_all(root);
            }
        }
    }
}

fn pg_ctl_stop(bin: &Path, data: &Path, run_as: Option<(u32, u32)>) -> std::io::Result<()> {
    let mut cmd = Command::new(bin.join("pg_ctl"));
    cmd.args(["-D"])
        .arg(data)
        .args(["-m", "immediate", "-w", "stop"]);
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    if let Some((uid, gid)) = run_as {
        cmd.uid(uid).gid(gid);
    }
    cmd.status().map(|_| ())
}

impl TestPostgres {
    /// The cluster shared by every test of this process: started on first use, stopped when
    /// the process exits. `OUTBOXD_TEST_DATABASE_URL` (a server with `wal_level=logical`)
    /// replaces it.
    pub fn shared() -> &'static TestPostgres {
        SHARED.get_or_init(|| {
            if let Ok(url) = std::env::var("OUTBOXD_TEST_DATABASE_URL") {
                return TestPostgres::external(&url);
            }
            TestPostgres::start_throwaway(None)
                .unwrap_or_else(|e| panic!("cannot start test PostgreSQL: {e}"))
        })
    }

    /// Uses an existing server. `url` may include a database; it is used for admin statements.
    pub fn external(url: &str) -> TestPostgres {
        let (base, db) = match url.rsplit_once('/') {
            Some((base, db)) if base.contains("//") && !db.is_empty() => (
                base.to_string(),
                db.split('?').next().unwrap_or("postgres").to_string(),
            ),
            _ => (
                url.trim_end_matches('/').to_string(),
                "postgres".to_string(),
            ),
        };
        TestPostgres {
            base_url: base,
            admin_db: db,
            owned: None,
            template: Default::default(),
        }
    }

    /// Starts a new cluster. With `dir = None` it lives in a temporary directory removed on
    /// drop; the cluster is registered to be stopped at process exit as well.
    pub fn start_throwaway(dir: Option<&Path>) -> Result<TestPostgres, HarnessError> {
        Self::start_throwaway_with(dir, None, "")
    }

    /// A separate throwaway cluster with `ssl = on`, serving the given PEM certificate
    /// (chain) and key; plain-text connections stay allowed, so `sslmode` decides. The
    /// shared cluster never has TLS.
    pub fn start_throwaway_tls(cert: &Path, key: &Path) -> Result<TestPostgres, HarnessError> {
        Self::start_throwaway_with(None, Some((cert, key)), "")
    }

    /// A separate throwaway cluster with `settings` (postgresql.conf lines) after the
    /// harness's own, which they override: e.g. `wal_level = replica` for a test of the
    /// relay's refusal. Stopped at process exit like the others.
    pub fn start_throwaway_configured(settings: &str) -> Result<TestPostgres, HarnessError> {
        Self::start_throwaway_with(None, None, settings)
    }

    fn start_throwaway_with(
        dir: Option<&Path>,
        tls: Option<(&Path, &Path)>,
        settings: &str,
    ) -> Result<TestPostgres, HarnessError> {
        let bin = find_bindir()?;
        let run_as = if unsafe_geteuid() == 0 {
            Some(postgres_ids()?)
        } else {
            None
        };
        let (tmp, root) = match dir {
            Some(d) => (None, d.to_path_buf()),
            None => {
                let t = tempfile::Builder::new()
                    .prefix("outboxd-pg-")
                    .tempdir()
                    .map_err(|e| io("creating a temporary directory", e))?;
                let p = t.path().to_path_buf();
                (Some(t), p)
            }
        };
        std::fs::create_dir_all(&root).map_err(|e| io("creating the cluster directory", e))?;
        if let Some((uid, gid)) = run_as {
            chown(&root, uid, gid)?;
        }
        let data = root.join("data");
        let port = crate::ports::free_port()?;

        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"])
            .arg("--locale=C");
        run(&mut initdb, run_as, "initdb")?;

        // Slots: every test has its own and none is dropped (a shard layout makes several, a
        // fleet test 8), so one test process creates more than a hundred: at 100, a CI run
        // that added a test refused a later test's slot ("all replication slots are in use").
        let conf = format!(
            "\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\n\
             wal_level = logical\nmax_replication_slots = 400\nmax_wal_senders = 100\n\
             max_connections = 300\nfsync = off\nfull_page_writes = off\nsynchronous_commit = off\n\
             shared_buffers = 128MB\nwal_sender_timeout = 60s\nlog_min_messages = warning\n",
            root.display()
        );
        // Password-authenticated roles for the transport tests (first matching line wins).
        let hba_path = data.join("pg_hba.conf");
        let hba = std::fs::read_to_string(&hba_path).map_err(|e| io("reading pg_hba.conf", e))?;
        std::fs::write(
            &hba_path,
            format!(
                "host all outboxd_test_md5   127.0.0.1/32 md5\n\
                 host all outboxd_test_scram 127.0.0.1/32 scram-sha-256\n{hba}"
            ),
        )
        .map_err(|e| io("writing pg_hba.conf", e))?;
        let mut conf = conf;
        if let Some((cert, key)) = tls {
            // The server refuses a key readable by others or owned by another user.
            for (src, name, mode) in [(cert, "server.crt", 0o644), (key, "server.key", 0o600)] {
                let dst = data.join(name);
                std::fs::copy(src, &dst).map_err(|e| io("copying the TLS certificate", e))?;
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(mode))
                    .map_err(|e| io("setting TLS file permissions", e))?;
                if let Some((uid, gid)) = run_as {
                    chown(&dst, uid, gid)?;
                }
            }
            conf.push_str("ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
        }
        conf.push_str(settings);
        conf.push('\n');
        let conf_path = data.join("postgresql.conf");
        let mut existing =
            std::fs::read_to_string(&conf_path).map_err(|e| io("reading postgresql.conf", e))?;
        existing.push_str(&conf);
        std::fs::write(&conf_path, existing).map_err(|e| io("writing postgresql.conf", e))?;

        let mut start = Command::new(bin.join("pg_ctl"));
        start
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(root.join("server.log"))
            .args(["-w", "-t", "60", "start"]);
        run(&mut start, run_as, "pg_ctl start")?;
        if let Ok(mut l) = TO_STOP.lock() {
            let temp_root = tmp.as_ref().map(|t| t.path().to_path_buf());
            l.push((bin.clone(), data.clone(), run_as, temp_root));
        }
        // Whatever happens to this process (a failed test, a demo that errors out), the
        // cluster is stopped when it exits.
        static AT_EXIT: std::sync::Once = std::sync::Once::new();
        AT_EXIT.call_once(|| {
            // SAFETY: registering a plain `extern "C" fn()` with no captured state.
            unsafe {
                libc::atexit(stop_registered_clusters);
            }
        });

        Ok(TestPostgres {
            base_url: format!("postgres://postgres@127.0.0.1:{port}"),
            admin_db: "postgres".into(),
            template: Default::default(),
            owned: Some(OwnedCluster {
                bin,
                data,
                _dir: tmp,
                run_as,
            }),
        })
    }

    /// URL of database `db` on this server.
    pub fn url(&self, db: &str) -> String {
        format!("{}/{}", self.base_url, db)
    }

    /// Creates a fresh, uniquely named database and returns its URL.
    pub async fn create_database(&self, prefix: &str) -> Result<String, HarnessError> {
        self.create_database_like(prefix, None).await
    }

    /// Creates a fresh, uniquely named database as a copy of this server's template and
    /// returns its URL. The first call makes the template (a database of its own, handed to
    /// `build` by URL, e.g. to migrate it); every call of the process copies that one, so
    /// `build` runs once. A copy takes about 0.1 s where migrating a database takes 0.5 s, and
    /// an end-to-end suite makes one per test. Nothing may connect to the template after
    /// `build` returns (PostgreSQL refuses to copy a database in use).
    pub async fn create_database_from_template<F, Fut>(
        &self,
        prefix: &str,
        build: F,
    ) -> Result<String, HarnessError>
    where
        F: FnOnce(String) -> Fut,
        Fut: std::future::Future<Output = Result<(), HarnessError>>,
    {
        let template = self
            .template
            .get_or_try_init(|| async {
                let url = self.create_database_like("template", None).await?;
                build(url.clone()).await?;
                Ok::<_, HarnessError>(url.rsplit('/').next().unwrap_or_default().to_string())
            })
            .await?;
        self.create_database_like(prefix, Some(template)).await
    }

    async fn create_database_like(
        &self,
        prefix: &str,
        template: Option<&str>,
    ) -> Result<String, HarnessError> {
        let n = DB_COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}_{}_{}", sanitize(prefix), std::process::id(), n);
        let (client, conn) =
            tokio_postgres::connect(&self.url(&self.admin_db), tokio_postgres::NoTls)
                .await
                .map_err(|e| {
                    db(
                        &format!("connecting to the admin database{}", self.diagnosis()),
                        e,
                    )
                })?;
        tokio::spawn(conn);
        let copy = template
            .map(|t| format!(" TEMPLATE \"{t}\""))
            .unwrap_or_default();
        client
            .batch_execute(&format!("CREATE DATABASE \"{name}\"{copy}"))
            .await
            .map_err(|e| db(&format!("creating a test database{}", self.diagnosis()), e))?;
        Ok(self.url(&name))
    }

    /// What can be said of a cluster this process started when it does not answer: whether
    /// its postmaster still runs, the free space where its data lives, and the last lines of
    /// its log that say why it stopped. Without it, a disk that filled mid-run ended the shared
    /// cluster and failed every later test with a bare connection error. Empty for a cluster
    /// the harness did not start.
    pub fn diagnosis(&self) -> String {
        let Some(o) = &self.owned else {
            return String::new();
        };
        let pid = std::fs::read_to_string(o.data.join("postmaster.pid"))
            .ok()
            .and_then(|s| s.lines().next()?.trim().parse::<libc::pid_t>().ok());
        // SAFETY: signal 0 only asks whether the process exists.
        let running = pid.is_some_and(|pid| unsafe { libc::kill(pid, 0) } == 0);
        let log = o.data.parent().map(|root| root.join("server.log"));
        let why: Vec<String> = log
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map(|text| {
                let mut lines: Vec<String> = text
                    .lines()
                    .filter(|l| {
                        ["PANIC", "FATAL", "No space left", "could not"]
                            .iter()
                            .any(|w| l.contains(w))
                    })
                    .map(str::to_string)
                    .collect();
                lines.drain(..lines.len().saturating_sub(3));
                lines
            })
            .unwrap_or_default();
        format!(
            " (the test cluster in {}: its postmaster is {}; {} free on its disk{}{})",
            o.data.display(),
            if running { "running" } else { "not running" },
            free_space(&o.data),
            log.map(|p| format!("; its log {}", p.display()))
                .unwrap_or_default(),
            if why.is_empty() {
                String::new()
            } else {
                format!(" ends with: {}", why.join(" | "))
            }
        )
    }

    /// Stops an owned cluster now (also happens at drop / process exit): `pg_ctl stop -m
    /// immediate`, as a crash would.
    pub fn stop(&self) {
        if let Some(o) = &self.owned {
            let _ = pg_ctl_stop(&o.bin, &o.data, o.run_as);
        }
    }

    /// Starts a stopped owned cluster again, on the same port and data (crash recovery runs
    /// first). An external server cannot be started: that is an error naming it.
    pub fn start_again(&self) -> Result<(), HarnessError> {
        let Some(o) = &self.owned else {
            return Err(HarnessError::Command {
                command: "pg_ctl start".into(),
                detail: format!(
                    "{} is an external server, not one the harness started",
                    self.base_url
                ),
            });
        };
        let log = o.data.with_file_name("server.log");
        let mut start = Command::new(o.bin.join("pg_ctl"));
        start
            .arg("-D")
            .arg(&o.data)
            .arg("-l")
            .arg(log)
            .args(["-w", "-t", "60", "start"]);
        run(&mut start, o.run_as, "pg_ctl start")
    }
}

impl Drop for TestPostgres {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Free space on the filesystem of `path`, as a reader wants it ("812 MiB").
fn free_space(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return "unknown space".into();
    };
    // SAFETY: statvfs is a plain C struct of integers, for which all zeroes is a value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid C string and `st` a struct we own for the call to fill.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return "unknown space".into();
    }
    let free = st.f_bavail as u128 * st.f_frsize as u128;
    format!("{} MiB", free / (1024 * 1024))
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(40)
        .collect()
}

fn io(context: &str, source: std::io::Error) -> HarnessError {
    HarnessError::Io {
        context: context.to_string(),
        source,
    }
}

fn db(context: &str, source: tokio_postgres::Error) -> HarnessError {
    HarnessError::Db {
        context: context.to_string(),
        source,
    }
}

fn unsafe_geteuid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn run(cmd: &mut Command, run_as: Option<(u32, u32)>, what: &str) -> Result<(), HarnessError> {
    if let Some((uid, gid)) = run_as {
        cmd.uid(uid).gid(gid);
        cmd.current_dir("/");
    }
    let out = cmd
        .output()
        .map_err(|e| io(&format!("running {what}"), e))?;
    if !out.status.success() {
        return Err(HarnessError::Command {
            command: what.to_string(),
            detail: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    Ok(())
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), HarnessError> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(|e| io("chown to postgres", e))
}

fn postgres_ids() -> Result<(u32, u32), HarnessError> {
    let name = std::ffi::CString::new("postgres").map_err(|_| HarnessError::NoPostgresUser)?;
    // SAFETY: getpwnam takes a valid NUL-terminated string; the returned pointer is either
    // null or points to static storage we read immediately, before any other getpw* call.
    unsafe {
        let pw = libc::getpwnam(name.as_ptr());
        if pw.is_null() {
            return Err(HarnessError::NoPostgresUser);
        }
        Ok(((*pw).pw_uid, (*pw).pw_gid))
    }
}

/// Finds `initdb` / `pg_ctl`: `$OUTBOXD_PG_BIN`, `pg_config --bindir`, newest /usr/lib/postgresql/N/bin.
pub fn find_bindir() -> Result<PathBuf, HarnessError> {
    if let Ok(p) = std::env::var("OUTBOXD_PG_BIN") {
        return Ok(PathBuf::from(p));
    }
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<(u32, PathBuf)> = entries
            .flatten()
            .filter_map(|e| {
                let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
                Some((v, e.path().join("bin")))
            })
            .collect();
        versions.sort();
        candidates.extend(versions.into_iter().rev().map(|(_, p)| p));
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        if out.status.success() {
            candidates.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
    }
    candidates
        .into_iter()
        .find(|p| p.join("initdb").exists() && p.join("pg_ctl").exists())
        .ok_or(HarnessError::NoPostgresBinaries)
}
