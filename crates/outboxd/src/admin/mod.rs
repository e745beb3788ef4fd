//! The admin surface of `outboxd run`, for the operator at 3 a.m. and the orchestrator that
//! restarts things:
//!
//! * [`http`] — `/metrics` (Prometheus text), `/healthz` (the process answers), `/readyz`
//!   (streaming from the slot and the broker reachable) on `--admin-addr`;
//! * [`console`] — a read-only console over the PostgreSQL wire protocol on `--console-addr`,
//!   so `psql -c 'SHOW STATUS'` works with the tool operators already have;
//! * [`sampler`] — the background tasks that refresh the gauges PostgreSQL and the broker
//!   know (slot lag, retained WAL, pending, UNKNOWN, holds; broker reachability).
//!
//! Everything here only reads: the ledger, `pg_replication_slots`, the metrics. Nothing is
//! served unless an address is configured, and a bare port binds 127.0.0.1.

mod console;
mod guard;
mod http;
mod sampler;

use anyhow::Context;
use tokio::net::TcpListener;

use crate::config::{AdminConfig, RelayConfig};

/// The running admin tasks; dropping it stops them.
#[derive(Debug)]
pub struct Admin {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Admin {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Binds the configured addresses (failing fast, with the address, when one is taken) and
/// starts serving. Returns an empty [`Admin`] when nothing is configured.
/// `relays` are the process's relays, one per database (the console answers for the first).
pub async fn start(admin: &AdminConfig, relays: &[RelayConfig]) -> anyhow::Result<Admin> {
    let relay = relays
        .first()
        .ok_or_else(|| anyhow::anyhow!("no database to relay"))?;
    for r in relays {
        crate::metrics::get().expect_database(&r.database);
    }
    let mut tasks = Vec::new();
    if !admin.enabled() {
        return Ok(Admin { tasks });
    }
    if let Some(addr) = admin.http_addr {
        let listener = bind(addr, "--admin-addr").await?;
        tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
        tasks.push(tokio::spawn(http::serve(listener)));
    }
    if let Some(addr) = admin.console_addr {
        let listener = bind(addr, "--console-addr").await?;
        tracing::info!(addr = %listener.local_addr()?, user = %admin.console_user,
            auth = if admin.console_password.is_some() { "md5" } else { "trust" },
            "admin console listening (psql; read-only)");
        let console = console::Console::new(admin, relay);
        let limits = guard::Limits {
            max_connections: admin.console_max_connections,
            login_timeout: admin.console_login_timeout,
            idle_timeout: admin.console_idle_timeout,
        };
        tasks.push(tokio::spawn(console::serve(listener, console, limits)));
    }
    for r in relays {
        tasks.push(tokio::spawn(sampler::ledger(
            r.clone(),
            admin.sample_interval,
        )));
    }
    let probe = sampler::BrokerProbe::for_relay(relay)?;
    tasks.push(tokio::spawn(probe.run(admin.sample_interval)));
    Ok(Admin { tasks })
}

async fn bind(addr: std::net::SocketAddr, flag: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| {
        format!(
            "cannot listen on {addr} ({flag}): is another process using it? choose another port"
        )
    })
}
