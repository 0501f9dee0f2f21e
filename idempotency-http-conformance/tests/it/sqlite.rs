//! The HTTP suite against the SQLite store: a fresh database file per case, in both connection
//! modes.

use idempotency_conformance::TestStore;
use idempotency_sqlite::{ConnectionMode, SqliteStore};
use std::sync::Arc;

async fn store_in_temp_dir(mode: ConnectionMode) -> TestStore {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::builder(dir.path().join("records.db"))
        .mode(mode)
        .open()
        .await
        .expect("open the database");
    store.migrate().await.expect("migrate");
    // The guard removes the directory, database and WAL files included, after the case.
    TestStore::real_time(Arc::new(store)).with_guard(dir)
}

mod dedicated_thread {
    use super::*;

    async fn factory() -> TestStore {
        store_in_temp_dir(ConnectionMode::DedicatedThread).await
    }

    idempotency_http_conformance::http_conformance_tests!(factory);
}

mod blocking_pool {
    use super::*;

    async fn factory() -> TestStore {
        store_in_temp_dir(ConnectionMode::BlockingPool { connections: 4 }).await
    }

    idempotency_http_conformance::http_conformance_tests!(factory);
}
