//! The integration tests of `idempotency-cache`, one binary: each module was a test binary of its own,
//! and in one binary their tests run side by side (`cargo test -p idempotency-cache --test it MODULE`
//! runs one module).

mod cache;
mod conformance;
