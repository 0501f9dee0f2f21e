//! The integration tests of `idempotency-postgres`, one binary: each module was a test binary of its own,
//! and in one binary their tests run side by side (`cargo test -p idempotency-postgres --test it MODULE`
//! runs one module).

mod common;

mod bad_input;
mod behavior;
mod conformance;
mod dead_connections;
mod exactly_once;
mod held;
mod kept_connections;
mod partition;
mod phases;
mod round_trips;
mod tokens;
