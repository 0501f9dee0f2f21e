//! The suite again on the system clock, the way server-backed stores run it: time passes by
//! sleeping. Keeps the cases honest about real-clock timing.

use idempotency_conformance::TestStore;
use idempotency_memory::MemoryStore;
use std::sync::Arc;

async fn factory() -> TestStore {
    TestStore::real_time(Arc::new(MemoryStore::new()))
}

idempotency_conformance::conformance_tests!(factory);
