//! The integration tests of `idempotency-mysql`, one binary: each module was a test binary of its own,
//! and in one binary their tests run side by side (`cargo test -p idempotency-mysql --test it MODULE`
//! runs one module).

mod common;

mod bad_input;
mod behavior;
mod claim_designs;
mod conformance;
mod exactly_once;
mod partition;
mod phases;
mod round_trips;
