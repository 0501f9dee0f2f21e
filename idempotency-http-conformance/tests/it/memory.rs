//! The HTTP suite against the memory store.

use idempotency_conformance::TestStore;
use idempotency_memory::MemoryStore;
use std::sync::Arc;

async fn factory() -> TestStore {
    TestStore::real_time(Arc::new(MemoryStore::new()))
}

idempotency_http_conformance::http_conformance_tests!(factory);
