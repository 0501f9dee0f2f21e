//! The integration tests of `idempotency-model-check`, one binary: each module was a test binary of its own,
//! and in one binary their tests run side by side (`cargo test -p idempotency-model-check --test it MODULE`
//! runs one module).

mod model_check;
mod phases;
