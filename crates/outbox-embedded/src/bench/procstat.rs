//! What the kernel knows about a process: resident memory (`/proc/<pid>/status`) and CPU time
//! (`/proc/<pid>/stat`). The bench runs the relay as a child process so these numbers are the
//! relay's own, and sums PostgreSQL's CPU over every process of the throwaway cluster
//! (postmaster and its children: backends, walsenders, background workers).

use std::collections::HashMap;

/// Kernel clock ticks per second (`utime`/`stime` unit).
fn ticks_per_sec() -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// `(ppid, utime + stime in ticks)` of `pid`, or `None` if it is gone.
fn stat(pid: i32) -> Option<(i32, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: fields start after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ppid = f.get(1)?.parse().ok()?;
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some((ppid, utime + stime))
}

/// CPU seconds (user + system) `pid` has used so far.
pub fn cpu_secs(pid: i32) -> Option<f64> {
    stat(pid).map(|(_, t)| t as f64 / ticks_per_sec())
}

/// `(VmRSS, VmHWM)` of `pid` in bytes: resident now, and the peak since it started.
pub fn rss(pid: i32) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = s.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// The 1-minute load average of the machine: on a shared machine, how much else was running.
pub fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// CPU used by a PostgreSQL cluster over an interval. Processes come and go (a walsender per
/// replication connection, autovacuum workers), so every sample records each process's
/// cumulative ticks; a process first seen after the start counts from zero. A process that
/// starts and exits between two samples is missed: sample often (the bench does every 100 ms).
#[derive(Debug)]
pub struct ClusterCpu {
    postmaster: i32,
    /// pid -> (ticks at the start or 0, ticks at the last sample, what the process is)
    seen: HashMap<i32, (u64, u64, &'static str)>,
}

/// What a PostgreSQL process is, from the title it sets (`postgres: walsender ...`,
/// `postgres: autovacuum worker ...`; a client's backend shows its user and database).
fn role(pid: i32, postmaster: i32) -> &'static str {
    if pid == postmaster {
        return "postmaster";
    }
    let title = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let title = String::from_utf8_lossy(&title);
    let title = title.trim_start_matches("postgres: ");
    for (prefix, role) in [
        ("walsender", "walsender"),
        ("autovacuum", "autovacuum"),
        ("checkpointer", "checkpointer"),
        ("background writer", "background writer"),
        ("walwriter", "walwriter"),
        ("logical replication", "logical replication workers"),
    ] {
        if title.starts_with(prefix) {
            return role;
        }
    }
    CLIENT
}

const CLIENT: &str = "client backends";

impl ClusterCpu {
    /// Starts measuring now.
    pub fn start(postmaster: i32) -> Self {
        let mut c = ClusterCpu {
            postmaster,
            seen: HashMap::new(),
        };
        for (pid, t) in c.processes() {
            c.seen.insert(pid, (t, t, role(pid, postmaster)));
        }
        c
    }

    fn processes(&self) -> Vec<(i32, u64)> {
        let mut out = Vec::new();
        if let Some((_, t)) = stat(self.postmaster) {
            out.push((self.postmaster, t));
        }
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return out;
        };
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            if let Some((ppid, t)) = stat(pid) {
                if ppid == self.postmaster {
                    out.push((pid, t));
                }
            }
        }
        out
    }

    pub fn sample(&mut self) {
        for (pid, t) in self.processes() {
            let postmaster = self.postmaster;
            self.seen
                .entry(pid)
                .and_modify(|e| {
                    e.1 = e.1.max(t);
                    // A process seen right after its fork still has the postmaster's title
                    // or its start-up one: a relay's walsender was counted as a client
                    // backend for a whole drain. Titles only become more specific.
                    if e.2 == CLIENT {
                        e.2 = role(pid, postmaster);
                    }
                })
                .or_insert_with(|| (0, t, role(pid, postmaster)));
        }
    }

    /// [`Self::secs`] by what the processes are, largest first.
    pub fn secs_by_role(&self) -> Vec<(&'static str, f64)> {
        let mut by: HashMap<&'static str, u64> = HashMap::new();
        for (a, b, role) in self.seen.values() {
            *by.entry(role).or_default() += b.saturating_sub(*a);
        }
        let mut out: Vec<_> = by
            .into_iter()
            .map(|(r, t)| (r, t as f64 / ticks_per_sec()))
            .collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
        out
    }

    /// CPU seconds the cluster used since [`Self::start`], as of the last sample.
    pub fn secs(&self) -> f64 {
        let ticks: u64 = self
            .seen
            .values()
            .map(|(a, b, _)| b.saturating_sub(*a))
            .sum();
        ticks as f64 / ticks_per_sec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_process() {
        let me = std::process::id() as i32;
        let (rss, hwm) = rss(me).expect("own status");
        assert!(rss > 0 && hwm >= rss);
        assert!(cpu_secs(me).is_some());
        assert!(stat(me).is_some_and(|(ppid, _)| ppid > 0));
    }
}
