//! Ports for the servers tests start (PostgreSQL, Kafka nodes, nats-server, consoles).
//!
//! Why not `bind(0)`: the kernel hands out a port from the *ephemeral* range
//! (`net.ipv4.ip_local_port_range`, 32768-60999 by default), the same range every outgoing
//! connection's local port comes from. A port picked that way is released before the server
//! binds it (a Kafka node binds seconds later, after its JVM starts), and in the meantime any
//! client connection of a test running in parallel may take it as its local port: the server
//! then fails with "Address already in use" (seen in CI: a 3-node Kafka cluster's node 3). A
//! killed broker restarted on its port has the same window, for as long as it is down.
//!
//! So the ports come from just below the ephemeral range, where no outgoing connection ever
//! lands; each is checked free by binding it, and this process never hands the same port out
//! twice (a stopped server's port stays its own for a restart). Processes pick at random
//! offsets, so two test binaries running at once rarely try the same port, and a port another
//! process holds fails the bind check and is skipped.

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::{Mutex, OnceLock};

use crate::HarnessError;

/// How many ports below the ephemeral range the harness picks from.
const SPAN: u16 = 12_000;

fn io(e: std::io::Error) -> HarnessError {
    HarnessError::Io {
        context: "finding a free port on 127.0.0.1".into(),
        source: e,
    }
}

/// The lowest ephemeral port (`/proc/sys/net/ipv4/ip_local_port_range`), 32768 when unknown.
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

struct Picker {
    issued: HashSet<u16>,
    next: u32,
}

fn picker() -> &'static Mutex<Picker> {
    static P: OnceLock<Mutex<Picker>> = OnceLock::new();
    P.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        Mutex::new(Picker {
            issued: HashSet::new(),
            next: nanos ^ std::process::id().wrapping_mul(2_654_435_761),
        })
    })
}

/// `n` distinct ports on 127.0.0.1, free when checked, outside the ephemeral range, never
/// handed out before by this process.
pub fn free_ports(n: usize) -> Result<Vec<u16>, HarnessError> {
    let low = ephemeral_low();
    if low < SPAN + 1024 {
        // An unusual range with no room below it: fall back to the kernel's pick.
        return (0..n)
            .map(|_| {
                let l = TcpListener::bind("127.0.0.1:0").map_err(io)?;
                l.local_addr().map(|a| a.port()).map_err(io)
            })
            .collect();
    }
    let base = low - SPAN;
    let mut p = picker().lock().unwrap_or_else(|e| e.into_inner());
    let mut out = Vec::with_capacity(n);
    // Listeners are held until all `n` are picked, so no two of them are the same port.
    let mut held = Vec::with_capacity(n);
    for _ in 0..SPAN {
        if out.len() == n {
            break;
        }
        // A stride coprime with SPAN visits every port of the span once.
        p.next = p.next.wrapping_add(7_919);
        let port = base + (p.next % u32::from(SPAN)) as u16;
        if p.issued.contains(&port) {
            continue;
        }
        if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
            p.issued.insert(port);
            out.push(port);
            held.push(l);
        }
    }
    if out.len() < n {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!(
                "no free port left in {base}..{low} (below the ephemeral range) after {} handed out",
                p.issued.len()
            ),
        )));
    }
    Ok(out)
}

/// One port, as [`free_ports`].
pub fn free_port() -> Result<u16, HarnessError> {
    Ok(free_ports(1)?[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_below_the_ephemeral_range_and_never_reissued() {
        let low = ephemeral_low();
        let a = free_ports(50).unwrap();
        let b = free_ports(50).unwrap();
        let all: HashSet<u16> = a.iter().chain(&b).copied().collect();
        assert_eq!(all.len(), 100, "a port was handed out twice: {a:?} {b:?}");
        for p in &all {
            assert!(*p < low && *p >= low - SPAN, "port {p} outside the span");
        }
    }
}
