//! The replication source: everything that talks to PostgreSQL's walsender.
//!
//! `transport` is a small logical-replication client on `postgres-protocol` + tokio
//! (startup with `replication=database`, authentication, replication commands, CopyBoth
//! framing, standby status updates). `slot` manages the slot and publication and detects
//! a slot that is missing, recreated or invalidated.

pub mod transport;
