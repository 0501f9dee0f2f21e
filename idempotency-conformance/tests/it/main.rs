//! The integration tests of `idempotency-conformance`, one binary: each module was a test binary of its own,
//! and in one binary their tests run side by side (`cargo test -p idempotency-conformance --test it MODULE`
//! runs one module).

mod broken_stores;
// The toy store is included as source, written for a crate root of its own.
#[allow(unreachable_pub)]
mod phases_toy;
// The toy store is included as source, written for a crate root of its own.
#[allow(unreachable_pub)]
mod toy_store;
