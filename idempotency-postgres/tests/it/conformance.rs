//! The conformance suite against the real server, once per isolation level of the sessions the
//! store's pool hands out. Each case gets its own schema, dropped afterwards.

use crate::common;

use common::Isolation;
use idempotency_conformance::TestStore;
use idempotency_core::store::Timestamp;
use std::sync::Arc;

async fn factory(level: Isolation) -> TestStore {
    let (store, guard) = common::store(level).await;
    TestStore::real_time(Arc::new(store))
        // The kit reads the database's own clock to check every deadline against it.
        .with_server_clock(Arc::new(|| {
            Box::pin(async {
                Timestamp::from_millis(idempotency_testing::postgres::server_now_millis().await)
            })
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

/// The same suite on stores that keep connections between operations
/// (`keep_connections(true)`), at the lowest and the highest
/// level.
async fn kept_factory(level: Isolation) -> TestStore {
    let (store, guard) = common::kept_store(level, 8).await;
    TestStore::real_time(Arc::new(store))
        .with_server_clock(Arc::new(|| {
            Box::pin(async {
                Timestamp::from_millis(idempotency_testing::postgres::server_now_millis().await)
            })
        }))
        .with_guard(guard)
}

mod read_committed_kept_connections {
    async fn factory() -> idempotency_conformance::TestStore {
        super::kept_factory(super::Isolation::ReadCommitted).await
    }
    idempotency_conformance::conformance_tests!(factory);
}

mod serializable_kept_connections {
    async fn factory() -> idempotency_conformance::TestStore {
        super::kept_factory(super::Isolation::Serializable).await
    }
    idempotency_conformance::conformance_tests!(factory);
}

/// The suite again with the replay cache in front.
mod replay_cache {
    async fn factory() -> idempotency_conformance::TestStore {
        let mut t = super::factory(super::Isolation::ReadCommitted).await;
        t.store = std::sync::Arc::new(idempotency_cache::ReplayCache::new(t.store));
        t
    }
    idempotency_conformance::conformance_tests!(factory);
}
