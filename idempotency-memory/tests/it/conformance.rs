//! The conformance kit on the memory store, on a manual clock.
use idempotency_conformance::TestStore;
use idempotency_core::store::ManualClock;
use idempotency_memory::MemoryStore;
use std::sync::Arc;

async fn factory() -> TestStore {
    let clock = ManualClock::new();
    TestStore::manual_time(
        Arc::new(
            MemoryStore::builder()
                .clock(Arc::new(clock.clone()))
                .build(),
        ),
        clock,
    )
}

idempotency_conformance::conformance_tests!(factory);
