//! The integration tests of `idempotency-tower`, one binary: each module was a test binary of its own,
//! and in one binary their tests run side by side (`cargo test -p idempotency-tower --test it MODULE`
//! runs one module).

mod exactly_once;
mod handler_claims;
mod http_semantics;
mod metrics;
mod observability;
mod plain_hyper;
mod route_part;
mod service_shape;
