//! The end-to-end suite (`tests/e2e`) again, with every relay the harness starts in poll mode
//! (`outboxd run --mode poll`): `harness::poll_mode` knows this target by its name. Part of the
//! README's `cargo test --workspace`, so both modes pass the same tests in CI.

#[path = "e2e/main.rs"]
mod e2e;
// The suite's modules name each other from the crate root (`crate::harness`).
#[allow(unused_imports)]
use e2e::*;
