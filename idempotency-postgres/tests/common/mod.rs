//! Shared test support: the server URL, isolated schemas that drop themselves, pools at a
//! given isolation level (from `idempotency-testing`), and migrated stores in a fresh schema.
#![allow(dead_code, unused_imports)]

pub use idempotency_testing::postgres::{admin, exec, pool, pool_for, url, Isolation, SchemaGuard};

use idempotency_postgres::PostgresStore;

/// A migrated store in a fresh schema over a pool at `level`.
pub async fn store(level: Isolation) -> (PostgresStore, SchemaGuard) {
    store_with(level, 8).await
}

/// As [`store`], with a pool of `max` connections.
pub async fn store_with(level: Isolation, max: u32) -> (PostgresStore, SchemaGuard) {
    let guard = SchemaGuard::new();
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .build(pool(level, max).await)
        .expect("valid names");
    store.migrate().await.expect("migrate");
    (store, guard)
}
