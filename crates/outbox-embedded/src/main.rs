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
            Command::DemoRelay(a) => demo::relay_child(a).await,
            Command::Bench(a) => bench::run(*a).await,
            Command::DevBroker(a) => dev_broker(a.brokers, a.port).await,
        }
    });
    if let Err(e) = result {
        eprintln!("outbox-embedded: error: {}", outboxd::one_line(&e));
        std::process::exit(1);
    }
}

/// Serves librdkafka's mock cluster until SIGINT/SIGTERM; its first line of output is
/// `bootstrap.servers=HOST:PORT` (with `port`, 127.0.0.1:port, forwarded to the mock).
async fn dev_broker(brokers: i32, port: Option<u16>) -> anyhow::Result<()> {
    let kafka = outbox_testkit::kafka::TestKafka::mock(brokers)
        .map_err(|e| anyhow::anyhow!("starting the embedded broker: {e}"))?;
    match port {
        None => println!("bootstrap.servers={}", kafka.bootstrap_servers()),
        Some(port) => {
            let target = kafka
                .bootstrap_servers()
                .split(',')
                .next()
                .unwrap_or_default()
                .to_string();
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .map_err(|e| anyhow::anyhow!("dev-broker --port {port}: cannot listen on 127.0.0.1:{port}: {e}; choose a free port, or omit --port"))?;
            tokio::spawn(async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    let target = target.clone();
                    tokio::spawn(async move {
                        if let Ok(mut broker) = tokio::net::TcpStream::connect(&target).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut broker).await;
                        }
                    });
                }
            });
            println!("bootstrap.servers=127.0.0.1:{port}");
        }
    }
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
