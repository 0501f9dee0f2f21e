//! A network partition between the store and MariaDB, made on demand by a proxy in front of
//! the real server: no call hangs past the store's response timeout, each ends in a defined
//! outcome (a compare-and-swap whose answer did not come is an unknown outcome, a read or a
//! claim a retryable error, the commit of an exactly-once transaction an unknown outcome that
//! holds the key), the connection it was stuck on is closed rather than reused, and once the
//! partition heals the store works again and shows what really happened.
#![allow(clippy::unwrap_used)]

use crate::common;
use idempotency_core::Idempotency;

use common::TableGuard;
use idempotency_core::store::RecordStatus;
use idempotency_core::{
    Error, Fingerprint, IdempotencyKey, IdempotencyStore, Policy, RecordId, Scope,
};
use idempotency_mysql::sqlx::mysql::{MySqlConnectOptions, MySqlSslMode};
use idempotency_mysql::sqlx::{self, Connection};
use idempotency_mysql::{MySqlError, MySqlStore};
use idempotency_testing::partition::PartitionProxy;
use idempotency_testing::partition_case::{an_idle_connection, CommitCase, PartitionCase};
use std::str::FromStr;
use std::time::{Duration, Instant};

// Generous: a statement on a loaded machine, not partitioned, must never take as long.
const TIMEOUT: Duration = Duration::from_secs(3);
const LEASE: Duration = Duration::from_secs(60);

fn no_answer(e: &Error) -> bool {
    matches!(MySqlError::find(e), Some(MySqlError::NoAnswer { .. }))
}

/// No answer to the statement, or no connection to send it on (a new connection's handshake
/// is cut too, and the pool gives up after its acquire timeout).
fn nothing_answered(e: &Error) -> bool {
    no_answer(e)
        || e.find_source::<idempotency_mysql::sqlx::Error>()
            .is_some_and(|e| matches!(e, idempotency_mysql::sqlx::Error::PoolTimedOut))
}

async fn partitioned_store(proxy: &PartitionProxy, guard: &TableGuard) -> MySqlStore {
    let options = MySqlConnectOptions::from_str(&common::url())
        .unwrap()
        .host("127.0.0.1")
        .port(proxy.addr().port())
        .ssl_mode(MySqlSslMode::Disabled);
    let pool = idempotency_mysql::sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(TIMEOUT)
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .unwrap();
    let store = MySqlStore::builder()
        .table(&guard.table)
        .response_timeout(TIMEOUT)
        .build(pool)
        .unwrap();
    store.migrate().await.unwrap();
    store
}

async fn proxy() -> PartitionProxy {
    let options = MySqlConnectOptions::from_str(&common::url()).unwrap();
    let target = format!("{}:{}", options.get_host(), options.get_port());
    PartitionProxy::start(target.parse().unwrap()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_ends_every_call_in_a_defined_outcome() {
    let proxy = proxy().await;
    let guard = TableGuard::new();
    let store = partitioned_store(&proxy, &guard).await;
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

/// The exactly-once transaction: the answers are held from inside the work, so the completion
/// in the transaction, the rollback and the release of the key get none. Nothing hangs: each
/// statement waits out the response timeout, the call ends with a retryable `NoAnswer`, and
/// once healed the key is not completed (nothing of the transaction committed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_during_an_exactly_once_transaction_hangs_nothing() {
    let proxy = std::sync::Arc::new(proxy().await);
    let guard = TableGuard::new();
    let store = partitioned_store(&proxy, &guard).await;
    let engine = Idempotency::builder(store.clone())
        .policy(Policy::default().lease(LEASE))
        .build()
        .unwrap();
    let scope = Scope::new("partition").unwrap();
    let fp = Fingerprint::from_bytes(b"p");

    // Replies held from inside the work: the completion's statement, in the transaction,
    // gets no answer. Nothing commits.
    let key = IdempotencyKey::random();
    let cutter = proxy.clone();
    // Each statement the engine sends meanwhile waits out the response timeout: the
    // completion in the transaction, the rollback, then the release of the key (each try of
    // the settle retry).
    let statements = Policy::default().settle_retry.attempts + 2;
    let limit = TIMEOUT * statements + Duration::from_secs(10);
    let started = Instant::now();
    let out = tokio::time::timeout(
        limit,
        engine.run_in_transaction(&key, &scope, &fp, move |_tx, _ctx| {
            let cutter = cutter.clone();
            Box::pin(async move {
                Ok(async move {
                    cutter.hold_replies();
                    Ok::<_, String>(7u32)
                }
                .await)
            })
        }),
    )
    .await
    .expect("run_in_transaction hung through the partition");
    eprintln!(
        "run_in_transaction ended after {:?}: {out:?}",
        started.elapsed()
    );
    let e = out.unwrap_err();
    assert!(no_answer(&e), "{e:?}");
    proxy.heal();
    let record = store
        .get(&RecordId::new(key.clone(), scope.clone()))
        .await
        .unwrap()
        .unwrap();
    assert_ne!(
        record.status,
        RecordStatus::Completed,
        "a transaction whose statements got no answer committed"
    );
}

/// The exactly-once path cut at its `COMMIT` (then healed, or severed so that the server rolls
/// back) or with the `COMMIT`'s answer held: an unknown outcome after the response timeout, the
/// order and the completion committed together or not at all, and one order in the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_at_the_commit_keeps_the_order_and_the_completion_together() {
    let proxy = proxy().await;
    let guard = TableGuard::new();
    let store = partitioned_store(&proxy, &guard).await;
    let orders_guard = TableGuard::new();
    let orders = format!("`{}`", orders_guard.table);
    let records = format!("`{}`", guard.table);
    common::exec(&format!(
        "CREATE TABLE {orders} (id BIGINT AUTO_INCREMENT PRIMARY KEY, ref VARCHAR(255) NOT NULL) \
         ENGINE = InnoDB"
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
                                sqlx::query(&format!("INSERT INTO {orders} (ref) VALUES (?)"))
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
                let mut admin = common::admin().await;
                // One statement, one snapshot.
                let (status, rows): (Option<String>, i64) = sqlx::query_as(&format!(
                    "SELECT CAST((SELECT status FROM {records} WHERE idem_key = ?) AS CHAR), \
                     (SELECT COUNT(*) FROM {orders} WHERE ref = ?)"
                ))
                .bind(key.as_str())
                .bind(key.as_str())
                .fetch_one(&mut admin)
                .await
                .expect("snapshot");
                let _ = admin.close().await;
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
