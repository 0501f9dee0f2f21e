//! The toy store of the store author's guide (the `IdempotencyStore` docs in
//! `idempotency-core`, which compile it as a doctest) passes the whole kit, on the system clock.

include!("../../../idempotency-core/src/toy_store.rs");

use idempotency_conformance::{process_clock, TestStore};
use std::sync::Arc;

async fn factory() -> TestStore {
    // The toy store reads the process clock, which the kit can read too.
    TestStore::real_time(Arc::new(ToyStore::default())).with_server_clock(process_clock())
}

idempotency_conformance::conformance_tests!(factory);
