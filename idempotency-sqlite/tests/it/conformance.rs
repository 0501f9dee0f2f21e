//! The conformance kit against a fresh database file per case, on a manual clock, in both
//! connection modes.

use idempotency_conformance::TestStore;
use idempotency_core::store::ManualClock;
use idempotency_sqlite::{ConnectionMode, SqliteStore};
use std::sync::Arc;

async fn store_in_temp_dir(mode: ConnectionMode) -> TestStore {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = ManualClock::new();
    let store = SqliteStore::builder(dir.path().join("records.db"))
        .clock(Arc::new(clock.clone()))
        .mode(mode)
        .open()
        .await
        .expect("open the database");
    store.migrate().await.expect("migrate");
    // The guard removes the directory, database and WAL files included, after the case.
    TestStore::manual_time(Arc::new(store), clock).with_guard(dir)
}

mod dedicated_thread {
    use super::*;

    async fn factory() -> TestStore {
        store_in_temp_dir(ConnectionMode::DedicatedThread).await
    }

    idempotency_conformance::conformance_tests!(factory);
}

mod blocking_pool {
    use super::*;

    async fn factory() -> TestStore {
        store_in_temp_dir(ConnectionMode::BlockingPool { connections: 4 }).await
    }

    idempotency_conformance::conformance_tests!(factory);
}

mod real_clock {
    use super::*;

    async fn factory() -> TestStore {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(dir.path().join("records.db"))
            .await
            .expect("open the database");
        store.migrate().await.expect("migrate");
        TestStore::real_time(Arc::new(store))
            .with_server_clock(idempotency_conformance::process_clock())
            .with_guard(dir)
    }

    idempotency_conformance::conformance_tests!(factory);
}

/// The suite again with the replay cache in front, on the store's clock.
mod replay_cache {
    use super::*;

    async fn factory() -> TestStore {
        let mut t = store_in_temp_dir(ConnectionMode::DedicatedThread).await;
        let idempotency_conformance::TimeControl::Manual(clock) = t.time.clone() else {
            unreachable!("a manual clock")
        };
        t.store = Arc::new(
            idempotency_cache::ReplayCache::builder()
                .clock(Arc::new(clock))
                .build(t.store),
        );
        t
    }

    idempotency_conformance::conformance_tests!(factory);
}
