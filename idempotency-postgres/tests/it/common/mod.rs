//! Shared test support: the server URL, isolated schemas that drop themselves, pools at a
//! given isolation level (from `idempotency-testing`), and migrated stores in a fresh schema.
#![allow(dead_code, unused_imports)]

pub(crate) use idempotency_testing::postgres::{
    admin, exec, pool, pool_for, url, Isolation, SchemaGuard,
};

use idempotency_postgres::PostgresStore;

/// A migrated store in a fresh schema over a pool at `level`.
pub(crate) async fn store(level: Isolation) -> (PostgresStore, SchemaGuard) {
    store_with(level, 8).await
}

/// As [`store`], with a pool of `max` connections.
pub(crate) async fn store_with(level: Isolation, max: u32) -> (PostgresStore, SchemaGuard) {
    let guard = SchemaGuard::new();
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .build(pool(level, max).await)
        .expect("valid names");
    store.migrate().await.expect("migrate");
    (store, guard)
}

/// [`url`] with its host and port replaced by `127.0.0.1:port` (a proxy in front of the
/// server), when given, and `params` (`key=value&…`) added to its query string.
pub(crate) fn url_with(port: Option<u16>, params: &str) -> String {
    let url = url();
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    let (auth_host, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    let host_at = auth_host.rfind('@').map_or(0, |i| i + 1);
    let host = match port {
        Some(port) => format!("127.0.0.1:{port}"),
        None => auth_host[host_at..].to_owned(),
    };
    let sep = if tail.contains('?') { '&' } else { '?' };
    let tail = if params.is_empty() {
        tail.to_owned()
    } else {
        format!("{tail}{sep}{params}")
    };
    format!("{scheme}://{}{host}{tail}", &auth_host[..host_at])
}

/// A migrated store in a fresh schema with a pool of its own
/// ([`PostgresStoreBuilder::connect`](idempotency_postgres::PostgresStoreBuilder::connect)) of
/// `max` connections that it keeps between operations (`keep_connections(true)`), whose
/// sessions carry `application_name` (to find them in `pg_stat_activity`).
pub(crate) async fn own_store(
    max: u32,
    acquire_timeout: std::time::Duration,
    application_name: &str,
) -> (PostgresStore, SchemaGuard) {
    let guard = SchemaGuard::new();
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .max_connections(max)
        .acquire_timeout(acquire_timeout)
        .keep_connections(true)
        .connect(&url_with(
            None,
            &format!("application_name={application_name}"),
        ))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    (store, guard)
}

/// As [`store_with`], with the store keeping connections between operations
/// ([`PostgresStoreBuilder::keep_connections`](idempotency_postgres::PostgresStoreBuilder::keep_connections)).
pub(crate) async fn kept_store(level: Isolation, max: u32) -> (PostgresStore, SchemaGuard) {
    let guard = SchemaGuard::new();
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .keep_connections(true)
        .build(pool(level, max).await)
        .expect("valid names");
    store.migrate().await.expect("migrate");
    (store, guard)
}

/// Runs `test` once per item of `each` (isolation levels, cuts), side by side on this task
/// (every run has its own schema and pool). A run's panic is raised again once every run has
/// ended, so one failure never cuts the others off mid-transaction.
pub(crate) async fn side_by_side<T, F, Fut>(each: impl IntoIterator<Item = T>, test: F)
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    use futures::FutureExt;
    let runs = each
        .into_iter()
        .map(|t| std::panic::AssertUnwindSafe(test(t)).catch_unwind());
    let ended = futures::future::join_all(runs).await;
    if let Some(panic) = ended.into_iter().find_map(Result::err) {
        std::panic::resume_unwind(panic);
    }
}
