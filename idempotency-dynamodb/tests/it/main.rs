//! The integration tests of `idempotency-dynamodb`, one binary: each module was a test binary of its own,
//! and in one binary their tests run side by side (`cargo test -p idempotency-dynamodb --test it MODULE`
//! runs one module).

mod support;

mod conformance;
mod exactly_once;
mod stand_in;
mod store;
