//! Shared test support: the helpers of `idempotency-testing`'s `mysql` module, and migrated
//! stores on a fresh table.
#![allow(dead_code, unused_imports, clippy::unwrap_used)]

pub(crate) use idempotency_testing::mysql::{
    admin, exec, options, pool, pool_with, server_now_millis, url, Isolation, TableGuard,
};
pub(crate) use idempotency_testing::mysql_wire as proxy;

use idempotency_mysql::MySqlStore;

/// A migrated store on a fresh table over a pool of 8 at `level`.
pub(crate) async fn store(level: Isolation) -> (MySqlStore, TableGuard) {
    store_with(level, 8).await
}

/// As [`store`], with a pool of `max` connections.
pub(crate) async fn store_with(level: Isolation, max: u32) -> (MySqlStore, TableGuard) {
    let guard = TableGuard::new();
    let store = MySqlStore::builder()
        .table(&guard.table)
        .build(pool(level, max).await)
        .expect("valid name");
    store.migrate().await.expect("migrate");
    (store, guard)
}
