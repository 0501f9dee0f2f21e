//! The conformance kit against the real server, once per isolation level of the sessions the
//! store's pool hands out. Each case gets a table of its own, dropped afterwards.

use crate::common;

use common::Isolation;
use idempotency_conformance::TestStore;
use idempotency_core::store::Timestamp;
use std::sync::Arc;

async fn factory(level: Isolation) -> TestStore {
    let (store, guard) = common::store(level).await;
    // The server's clock is the store's clock: the kit cannot move it, so time passes by
    // sleeping (real time), and it reads the clock to check every deadline against it.
    TestStore::real_time(Arc::new(store))
        .with_server_clock(Arc::new(|| {
            Box::pin(async { Timestamp::from_millis(common::server_now_millis().await) })
        }))
        .with_guard(guard)
}

mod read_committed {
    async fn factory() -> idempotency_conformance::TestStore {
        super::factory(super::Isolation::ReadCommitted).await
    }
    idempotency_conformance::conformance_tests!(factory);
}

mod repeatable_read {
    async fn factory() -> idempotency_conformance::TestStore {
        super::factory(super::Isolation::RepeatableRead).await
    }
    idempotency_conformance::conformance_tests!(factory);
}

mod serializable {
    async fn factory() -> idempotency_conformance::TestStore {
        super::factory(super::Isolation::Serializable).await
    }
    idempotency_conformance::conformance_tests!(factory);
}

/// The suite again with the replay cache in front.
mod replay_cache {
    async fn factory() -> idempotency_conformance::TestStore {
        let mut t = super::factory(super::Isolation::RepeatableRead).await;
        t.store = std::sync::Arc::new(idempotency_cache::ReplayCache::new(t.store));
        t
    }
    idempotency_conformance::conformance_tests!(factory);
}
