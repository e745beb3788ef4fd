//! The replication source: everything that talks to PostgreSQL's walsender, and the decode
//! stage that turns its bytes into outbox events.
//!
//! * [`transport`] — a small logical-replication client on `postgres-protocol` + tokio
//!   (startup with `replication=database`, authentication, replication commands, CopyBoth
//!   framing, standby status updates).
//! * [`slot`] — the slot and publication: inspection, creation, and the pure start-up
//!   decision that refuses to run on a slot that is missing, recreated, moved or invalidated.
//! * [`decode`] — pgoutput messages (from `outbox-pgoutput`) to [`outbox_core::OutboxEvent`]s,
//!   with transaction boundaries and commit LSNs.
//! * [`tls`] — libpq's `sslmode` / `sslrootcert` for both the SQL and the replication
//!   connections.
//! * [`snapshot`] — the initial snapshot: outbox rows committed before the slot existed.
//! * [`shard`] — a sharded outbox: which aggregates a shard's publication and relay carry.
//! * [`poll`] — poll mode's source: the next events without a receipt, by aggregate, for
//!   databases where logical replication is not allowed.

pub mod decode;
pub mod poll;
pub mod shard;
pub mod slot;
pub mod snapshot;
pub mod tls;
pub mod transport;

pub use decode::{Decoded, Decoder};
pub use slot::{SlotInfo, SourceError, StartPlan};
