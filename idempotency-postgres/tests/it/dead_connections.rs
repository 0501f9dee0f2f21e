//! After a server restart or failover every idle connection of the store's pool is dead. A
//! write that meets one must not use up the engine's retries on them: the store tries the
//! statement again on another connection until a live one answers. Here every backend of the
//! store's pool is terminated (`pg_terminate_backend`) while its connections sit idle, as a
//! restart leaves them.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{url_with, SchemaGuard};
use idempotency_core::protocol::Begin;
use idempotency_core::store::RecordStatus;
use idempotency_core::{
    Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId, Scope,
};
use idempotency_postgres::sqlx;
use idempotency_postgres::PostgresStore;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// More connections than the engine's settle retries (5 by default).
const POOL: u32 = 10;

/// A migrated store with its own pool of [`POOL`] connections, whose sessions carry a unique
/// `application_name`.
async fn store(keep: bool) -> (PostgresStore, SchemaGuard, String) {
    let guard = SchemaGuard::new();
    let app = format!("dead-{}", uuid::Uuid::new_v4().simple());
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .max_connections(POOL)
        .keep_connections(keep)
        .connect(&url_with(None, &format!("application_name={app}")))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    (store, guard, app)
}

/// Opens every connection of the pool at once, then lets them all go back idle.
async fn fill_pool(store: &PostgresStore) {
    let mut held = Vec::new();
    for _ in 0..POOL {
        held.push(store.pool().acquire().await.expect("a connection"));
    }
    drop(held);
    let started = Instant::now();
    while store.pool().num_idle() < POOL as usize {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the pool's connections never came back idle ({} idle)",
            store.pool().num_idle()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Terminates every backend of the pool (`application_name = app`) and waits until the
/// server has none left; returns how many it terminated.
async fn kill_backends(app: &str) -> i64 {
    let mut admin = common::admin().await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                               WHERE application_name = $1) t",
    )
    .bind(app)
    .fetch_one(&mut admin)
    .await
    .expect("terminate");
    let started = Instant::now();
    loop {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(app)
                .fetch_one(&mut admin)
                .await
                .expect("count");
        if left == 0 {
            return killed;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{left} backends outlived pg_terminate_backend"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn id() -> RecordId {
    RecordId::new(
        IdempotencyKey::random(),
        Scope::new("dead-connections").unwrap(),
    )
}

async fn completion_after_restart(keep: bool) {
    let (store, _guard, app) = store(keep).await;
    let engine = Idempotency::new(Arc::new(store.clone()), Policy::default()).unwrap();
    fill_pool(&store).await;
    let id = id();
    let lease = match engine.begin(&id, &Fingerprint::from_bytes(b"x")).await {
        Ok(Begin::Execute(lease)) => lease,
        other => panic!("a fresh key must be claimed: {other:?}"),
    };
    fill_pool(&store).await;
    assert!(kill_backends(&app).await >= i64::from(POOL));
    let completed = lease.complete(b"outcome").await;
    assert!(
        completed.is_ok(),
        "keep {keep}: the completion after every idle connection died got {completed:?}"
    );
    let record = store.get(&id).await.unwrap().expect("the record");
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(record.outcome.as_deref(), Some(&b"outcome"[..]));
}

async fn claim_after_restart(keep: bool) {
    let (store, _guard, app) = store(keep).await;
    let engine = Idempotency::new(Arc::new(store.clone()), Policy::default()).unwrap();
    fill_pool(&store).await;
    assert!(kill_backends(&app).await >= i64::from(POOL));
    let id = id();
    match engine.begin(&id, &Fingerprint::from_bytes(b"x")).await {
        Ok(Begin::Execute(lease)) => lease.complete(b"done").await.unwrap(),
        other => panic!("keep {keep}: the claim after every idle connection died got {other:?}"),
    }
}

/// `complete` after a restart succeeds: the dead connections do not use up its retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_succeeds_after_every_idle_connection_died() {
    completion_after_restart(false).await;
}

/// The same with connections kept between operations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_succeeds_after_every_kept_connection_died() {
    completion_after_restart(true).await;
}

/// A claim after a restart is not answered with an error while live connections can be had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_succeeds_after_every_idle_connection_died() {
    claim_after_restart(false).await;
}

/// The same with connections kept between operations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_succeeds_after_every_kept_connection_died() {
    claim_after_restart(true).await;
}

async fn transaction_after_restart(keep: bool) {
    let (store, guard, app) = store(keep).await;
    let orders = format!(r#""{}".orders"#, guard.schema);
    common::exec(&format!(
        "CREATE TABLE {orders} (id bigserial PRIMARY KEY, ref text NOT NULL)"
    ))
    .await;
    // The server "restarts" between the claim and the transaction's BEGIN.
    let restarting = Arc::new(RestartAfterClaim {
        inner: store.clone(),
        app: app.clone(),
    });
    let engine = Idempotency::new(restarting, Policy::default())
        .unwrap()
        .with_transactions(store.clone());
    let key = IdempotencyKey::random();
    let scope = Scope::new("dead-connections").unwrap();
    let insert = format!("INSERT INTO {orders} (ref) VALUES ($1)");
    let out = engine
        .run_in_transaction(&key, &scope, &Fingerprint::from_bytes(b"x"), |tx, _ctx| {
            let (insert, key) = (insert.clone(), key.clone());
            Box::pin(async move {
                Ok(async move {
                    sqlx::query(&insert)
                        .bind(key.as_str())
                        .execute(&mut *tx)
                        .await
                        .map(|_| 1u8)
                        .map_err(|e| e.to_string())
                }
                .await)
            })
        })
        .await;
    assert!(
        matches!(out, Ok(idempotency_core::Answer::Executed(Ok(1)))),
        "keep {keep}: the exactly-once run after every idle connection died got {out:?}"
    );
    let mut admin = common::admin().await;
    let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {orders}"))
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert_eq!(n, 1);
}

/// The exactly-once path after a restart: its transaction begins on a live connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_succeeds_after_every_idle_connection_died() {
    transaction_after_restart(false).await;
}

/// The same with connections kept between operations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_succeeds_after_every_kept_connection_died() {
    transaction_after_restart(true).await;
}

/// The store, except that every idle connection of its pool dies right after each claim.
#[derive(Debug)]
struct RestartAfterClaim {
    inner: PostgresStore,
    app: String,
}

#[async_trait::async_trait]
impl IdempotencyStore for RestartAfterClaim {
    async fn claim(
        &self,
        request: &idempotency_core::store::ClaimRequest,
    ) -> Result<idempotency_core::store::Claim, idempotency_core::Error> {
        let claimed = self.inner.claim(request).await;
        fill_pool(&self.inner).await;
        assert!(kill_backends(&self.app).await >= i64::from(POOL));
        claimed
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: idempotency_core::FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        self.inner.complete(id, token, outcome, ttl).await
    }
    async fn fail(
        &self,
        id: &RecordId,
        token: idempotency_core::FencingToken,
        failure: &idempotency_core::store::Failure,
        ttl: Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        self.inner.fail(id, token, failure, ttl).await
    }
    async fn extend(
        &self,
        id: &RecordId,
        token: idempotency_core::FencingToken,
        lease: Duration,
    ) -> Result<idempotency_core::store::Cas, idempotency_core::Error> {
        self.inner.extend(id, token, lease).await
    }
    async fn reclaim(
        &self,
        id: &RecordId,
        expected: idempotency_core::FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<idempotency_core::store::Reclaim, idempotency_core::Error> {
        self.inner
            .reclaim(id, expected, fingerprint, lease, ttl)
            .await
    }
    async fn get(
        &self,
        id: &RecordId,
    ) -> Result<Option<idempotency_core::store::Record>, idempotency_core::Error> {
        self.inner.get(id).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, idempotency_core::Error> {
        self.inner.purge_expired(batch).await
    }
}
