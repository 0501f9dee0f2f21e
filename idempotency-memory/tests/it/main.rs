//! The integration tests of `idempotency-memory`, one binary: each module was a test binary of its own,
//! and in one binary their tests run side by side (`cargo test -p idempotency-memory --test it MODULE`
//! runs one module).

mod conformance;
mod conformance_real_clock;
mod engine;
