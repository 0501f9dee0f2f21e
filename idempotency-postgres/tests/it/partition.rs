//! A network partition between the store and PostgreSQL, made on demand by a proxy in front
//! of the real server: no call hangs past the store's response timeout, each ends in a
//! defined outcome (a write whose answer did not come is an unknown outcome, a read a
//! retryable error), the connection it was stuck on is closed rather than reused, and once
//! the partition heals the store works again and shows what really happened
//! (`idempotency-testing`'s `PartitionCase`).
#![allow(clippy::unwrap_used)]

use crate::common;
use idempotency_core::Idempotency;

use common::SchemaGuard;
use idempotency_core::store::RecordStatus;
use idempotency_core::{Error, Fingerprint, IdempotencyKey, Policy, Scope};
use idempotency_postgres::sqlx;
use idempotency_postgres::{PostgresError, PostgresStore};
use idempotency_testing::partition::PartitionProxy;
use idempotency_testing::partition_case::{an_idle_connection, CommitCase, PartitionCase};
use std::time::Duration;

// Generous: a statement on a loaded machine, not partitioned, must never take as long.
const TIMEOUT: Duration = Duration::from_secs(3);

fn no_answer(e: &Error) -> bool {
    matches!(PostgresError::find(e), Some(PostgresError::NoAnswer { .. }))
}

/// No answer to the statement, or no connection to send it on (a new connection's handshake
/// is cut too, and the pool gives up after its acquire timeout).
fn nothing_answered(e: &Error) -> bool {
    no_answer(e)
        || e.find_source::<idempotency_postgres::sqlx::Error>()
            .is_some_and(|e| matches!(e, idempotency_postgres::sqlx::Error::PoolTimedOut))
}

/// A migrated store in a fresh schema, reaching the server through a partitionable proxy.
async fn store_behind_a_proxy() -> (PostgresStore, PartitionProxy, SchemaGuard) {
    let proxy = PartitionProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let guard = SchemaGuard::new();
    // In plain text, so that the proxy can see the COMMIT.
    let url = common::url_with(Some(proxy.addr().port()), "sslmode=disable");
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .max_connections(4)
        .response_timeout(TIMEOUT)
        .acquire_timeout(TIMEOUT)
        .connect(&url)
        .await
        .unwrap();
    store.migrate().await.unwrap();
    (store, proxy, guard)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_ends_every_call_in_a_defined_outcome() {
    let (store, proxy, _guard) = store_behind_a_proxy().await;

    PartitionCase {
        store: &store,
        proxy: &proxy,
        timeout: TIMEOUT,
        settle: &|| Box::pin(an_idle_connection(|| store.pool().num_idle())),
        no_answer,
        read_failed: nothing_answered,
        claim_unknown: false,
    }
    .run()
    .await;
}

/// The exactly-once path cut at its `COMMIT` (then healed, or severed so that the server rolls
/// back) or with the `COMMIT`'s answer held: an unknown outcome after the response timeout, the
/// order and the completion committed together or not at all, and one order in the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_at_the_commit_keeps_the_order_and_the_completion_together() {
    let (store, proxy, guard) = store_behind_a_proxy().await;
    let orders = format!(r#""{}".orders"#, guard.schema);
    let records = format!(r#""{}".records"#, guard.schema);
    common::exec(&format!(
        "CREATE TABLE {orders} (id bigserial PRIMARY KEY, ref text NOT NULL)"
    ))
    .await;
    let lease = Duration::from_secs(1);
    let engine = Idempotency::builder(store)
        .policy(Policy::default().lease(lease))
        .build()
        .unwrap();
    let scope = Scope::new("partition|POST /orders").unwrap();
    let fingerprint = Fingerprint::from_bytes(b"order");

    CommitCase {
        proxy: &proxy,
        timeout: TIMEOUT,
        lease,
        run: &|key: IdempotencyKey| {
            let (engine, orders, scope, fingerprint) =
                (engine.clone(), orders.clone(), scope.clone(), fingerprint);
            Box::pin(async move {
                let k = key.clone();
                engine
                    .run_in_transaction(&key, &scope, &fingerprint, move |tx, ctx| {
                        let (orders, k) = (orders.clone(), k.clone());
                        Box::pin(async move {
                            Ok(async move {
                                sqlx::query(&format!("INSERT INTO {orders} (ref) VALUES ($1)"))
                                    .bind(k.as_str())
                                    .execute(&mut *tx)
                                    .await
                                    .map_err(|e| e.to_string())?;
                                Ok::<u64, String>(ctx.token.0)
                            }
                            .await)
                        })
                    })
                    .await
            })
        },
        snapshot: &|key: IdempotencyKey| {
            let (orders, records) = (orders.clone(), records.clone());
            Box::pin(async move {
                // One statement, one snapshot.
                let (status, rows): (Option<String>, i64) = sqlx::query_as(&format!(
                    "SELECT (SELECT status FROM {records} WHERE key = $1), \
                     (SELECT count(*) FROM {orders} WHERE ref = $1)"
                ))
                .bind(key.as_str())
                .fetch_one(&mut common::admin().await)
                .await
                .expect("snapshot");
                let status = status.map(|s| match s.as_str() {
                    "completed" => RecordStatus::Completed,
                    "failed" => RecordStatus::Failed,
                    _ => RecordStatus::Pending,
                });
                (status, usize::try_from(rows).expect("a count"))
            })
        },
        no_answer,
    }
    .run()
    .await;
}
