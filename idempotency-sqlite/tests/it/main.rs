//! The integration tests of `idempotency-sqlite`, one binary: each module was a test binary of its own,
//! and in one binary their tests run side by side (`cargo test -p idempotency-sqlite --test it MODULE`
//! runs one module).

mod common;

mod bad_input;
mod conformance;
mod exactly_once;
mod full_disk;
mod phases;
mod store;
