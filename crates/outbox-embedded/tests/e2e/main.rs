//! End-to-end tests of the `outbox-embedded` binary as a child process: each command starts
//! its own throwaway PostgreSQL cluster and broker (PostgreSQL server binaries must be
//! installed; as root the cluster runs as the `postgres` user).
//!
//! `bench` runs the `outboxd` binary beside `outbox-embedded` as its relay: `cargo test
//! --workspace` builds it; after `cargo test -p outbox-embedded` alone, build it first with
//! `cargo build -p outboxd` (the bench fails naming that fix when it is missing).

mod bench;
mod cli;
