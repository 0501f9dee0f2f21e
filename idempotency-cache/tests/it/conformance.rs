//! The conformance kit through the replay cache, in front of the memory store: on a manual
//! clock the cache shares (time jumps, as a store's clock may), and on the system clock.

use idempotency_cache::ReplayCache;
use idempotency_conformance::{process_clock, TestStore};
use idempotency_core::store::ManualClock;
use idempotency_memory::MemoryStore;
use std::sync::Arc;

mod manual_clock {
    use super::*;

    async fn factory() -> TestStore {
        let clock = ManualClock::new();
        let store = MemoryStore::builder()
            .clock(Arc::new(clock.clone()))
            .build();
        let cached = ReplayCache::builder()
            .clock(Arc::new(clock.clone()))
            .build(store);
        TestStore::manual_time(Arc::new(cached), clock)
    }

    idempotency_conformance::conformance_tests!(factory);
}

mod system_clock {
    use super::*;

    async fn factory() -> TestStore {
        TestStore::real_time(Arc::new(ReplayCache::new(MemoryStore::new())))
            .with_server_clock(process_clock())
    }

    idempotency_conformance::conformance_tests!(factory);
}
