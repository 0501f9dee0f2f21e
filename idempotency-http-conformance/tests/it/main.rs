//! The integration tests of `idempotency-http-conformance`, one binary: each module was a test binary of its own,
//! and in one binary their tests run side by side (`cargo test -p idempotency-http-conformance --test it MODULE`
//! runs one module).

mod dynamodb;
mod memory;
mod mysql;
mod postgres;
mod redis;
mod sqlite;
