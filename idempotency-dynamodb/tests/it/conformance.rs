//! The conformance kit on DynamoDB (the local stand-in), once on a manual clock (the store
//! decides time on the application's clock, which the kit then moves) and once on the
//! system clock. Each case's keys are spread over a table on every stand-in (each serves one
//! request at a time), every key on one of them.

/// Records hold outcomes up to the item limit. DynamoDB counts a binary value by its bytes;
/// the stand-in counts its base64 text (4/3 as long) against 405,000 bytes, so the largest
/// outcome it holds is about 300,000 bytes, below the store's `MAX_OUTCOME_BYTES`.
fn capabilities() -> idempotency_conformance::Capabilities {
    const STAND_IN_MAX_OUTCOME_BYTES: usize = 300_000;
    idempotency_conformance::Capabilities::default()
        .max_outcome_bytes(STAND_IN_MAX_OUTCOME_BYTES.min(idempotency_dynamodb::MAX_OUTCOME_BYTES))
}

mod manual_clock {
    use idempotency_conformance::TestStore;
    use idempotency_core::store::ManualClock;
    use std::sync::Arc;

    async fn factory() -> TestStore {
        let clock = ManualClock::new();
        let (store, guard) = idempotency_testing::dynamodb::sharded_store(Arc::new(clock.clone()))
            .await
            .expect("a table on each DynamoDB stand-in");
        TestStore::manual_time(Arc::new(store), clock)
            .with_capabilities(super::capabilities())
            .with_guard(guard)
    }

    idempotency_conformance::conformance_tests!(factory);
}

mod system_clock {
    use idempotency_conformance::{process_clock, TestStore};
    use idempotency_core::store::SystemClock;
    use std::sync::Arc;

    async fn factory() -> TestStore {
        let (store, guard) = idempotency_testing::dynamodb::sharded_store(Arc::new(SystemClock))
            .await
            .expect("a table on each DynamoDB stand-in");
        TestStore::real_time(Arc::new(store))
            .with_capabilities(super::capabilities())
            .with_server_clock(process_clock())
            .with_guard(guard)
    }

    idempotency_conformance::conformance_tests!(factory);
}
