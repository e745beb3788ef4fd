//! `outbox-kafka`: real Apache Kafka brokers (KRaft) on loopback, for trying the relay by hand
//! or pointing an external test at them. See `outbox_testkit::apache_kafka`.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use outbox_testkit::apache_kafka::{KafkaCluster, KAFKA_VERSION};

/// Starts N Apache Kafka brokers on 127.0.0.1 and keeps them running until SIGTERM or SIGINT.
///
/// Prints `bootstrap.servers=127.0.0.1:PORT,...` on one line, then `node=ID pid=PID port=PORT`
/// per node, on stdout. Each node is a combined KRaft broker+controller; with 3 nodes the
/// controller quorum has 3 voters and topics default to replication factor 3 with
/// min.insync.replicas 2. The broker's jars come from Maven Central the first time (needs a
/// JDK 17+ and Maven) and from a cache after that ($OUTBOXD_KAFKA_CACHE, default
/// ~/.cache/outboxd).
#[derive(Debug, Parser)]
#[command(name = "outbox-kafka", version = KAFKA_VERSION)]
struct Args {
    /// How many nodes (1 for a single broker, 3 for a replicated cluster).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=9))]
    nodes: u16,
    /// Keep the cluster's files (properties, data, node-ID/node.log) in DIR, which is kept at
    /// exit; without it they live in a temporary directory removed at exit.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Signal handlers first, so a SIGTERM during start still stops the brokers cleanly.
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outbox-kafka: error: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let signals = rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        Ok::<_, std::io::Error>((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        ))
    });
    let (mut term, mut int) = match signals {
        Ok(s) => s,
        Err(e) => {
            eprintln!("outbox-kafka: error: installing signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    };

    let cluster = match KafkaCluster::start_in(usize::from(args.nodes), args.dir.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("outbox-kafka: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut out = String::new();
    out.push_str(&format!(
        "bootstrap.servers={}\n",
        cluster.bootstrap_servers()
    ));
    for id in cluster.node_ids() {
        out.push_str(&format!(
            "node={id} pid={} port={}\n",
            cluster.pid(id).unwrap_or(0),
            cluster.port(id)
        ));
    }
    let mut stdout = std::io::stdout().lock();
    if stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
        .is_err()
    {
        // Nobody reads what we print: stop rather than run unobserved.
        return ExitCode::FAILURE;
    }
    drop(stdout);
    eprintln!(
        "outbox-kafka: Kafka {KAFKA_VERSION}, {} node(s) in {}; SIGTERM or SIGINT stops them",
        args.nodes,
        cluster.dir().display()
    );

    let which = rt.block_on(async {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    });
    eprintln!("outbox-kafka: {which}: stopping");
    drop(cluster);
    ExitCode::SUCCESS
}
