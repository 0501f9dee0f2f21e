//! The integration tests of `idempotency-redis`, one binary: each module was a test binary of its own,
//! and in one binary their tests run side by side (`cargo test -p idempotency-redis --test it MODULE`
//! runs one module).

mod support;

mod cluster;
mod partition;
mod replicas;
mod sentinel;
mod server_lifecycle;
mod standalone;
