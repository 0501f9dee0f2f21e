//! The suite again on the system clock, the way server-backed stores run it: time passes by
//! sleeping. Keeps the cases honest about real-clock timing.

use idempotency_conformance::{process_clock, TestStore};
use idempotency_memory::MemoryStore;
use std::sync::Arc;

async fn factory() -> TestStore {
    // The store reads the system clock, which the kit can read too.
    TestStore::real_time(Arc::new(MemoryStore::new())).with_server_clock(process_clock())
}

idempotency_conformance::conformance_tests!(factory);
