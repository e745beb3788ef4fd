//! `outbox-embedded`: the tools that run the outboxd relay against servers they start and
//! throw away. `demo` (a throwaway PostgreSQL cluster, librdkafka's mock broker and an order
//! workload), `bench` (the benchmark of docs/benchmarks.md, which runs the `outboxd` binary as
//! its relay) and `dev-broker` (the mock broker alone, for development).
//!
//! Why a crate of its own: these tools need the test harness (`outbox-testkit`: throwaway
//! PostgreSQL, mock and Apache Kafka) and a plotting library (`plotters`, the bench's SVG
//! chart). The daemon, `outboxd`, must link neither: what runs in production carries no test
//! harness. This crate uses the daemon as a library (`outboxd::relay`, `outboxd::config`).

mod bench;
mod cli;
mod demo;

use clap::Parser;

use cli::{Cli, Command};

fn main() {
    let cli = Cli::parse();
    outboxd::init_logging(cli.log_format, false);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outbox-embedded: error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Demo(a) => demo::run(a).await,
            Command::Bench(a) => bench::run(*a).await,
            Command::DevBroker(a) => dev_broker(a.brokers).await,
        }
    });
    if let Err(e) = result {
        eprintln!("outbox-embedded: error: {}", outboxd::one_line(&e));
        std::process::exit(1);
    }
}

/// Serves librdkafka's mock cluster until SIGINT/SIGTERM; its first line of output is
/// `bootstrap.servers=HOST:PORT`.
async fn dev_broker(brokers: i32) -> anyhow::Result<()> {
    let kafka = outbox_testkit::kafka::TestKafka::mock(brokers)
        .map_err(|e| anyhow::anyhow!("starting the embedded broker: {e}"))?;
    println!("bootstrap.servers={}", kafka.bootstrap_servers());
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    drop(kafka);
    Ok(())
}
