//! Exactly-once effects with a real business table: the completion CAS commits in the same
//! transaction as the `orders` insert, so whatever happens to the holder (it stalls past its
//! lease, its transaction is dropped, it panics or fails, it deadlocks, it runs longer than its
//! lease), the key ends with exactly one order, never two and never none. Every scenario runs
//! at each isolation level, many at once.
#![allow(clippy::unwrap_used)]

use crate::common;
use idempotency_core::Idempotency;

use common::{Isolation, TableGuard};
use idempotency_core::protocol::Begin;
use idempotency_core::store::RecordStatus;
use idempotency_core::{
    Answer, Error, FencingToken, Fingerprint, IdempotencyKey, IdempotencyStore, InFlight, Policy,
    RecordId, Refusal, Scope,
};
use idempotency_mysql::sqlx::{self, Connection, Executor, MySqlConnection};
use idempotency_mysql::{MySqlError, MySqlIdempotency, MySqlStore};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// A store, its guards and the `orders` table beside it.
struct Rig {
    store: MySqlStore,
    orders: Arc<str>,
    _guards: (TableGuard, TableGuard),
}

async fn setup(level: Isolation, pool_size: u32) -> Rig {
    let (store, records) = common::store_with(level, pool_size).await;
    let orders_guard = TableGuard::new();
    let orders = format!("`{}`", orders_guard.table);
    common::exec(&format!(
        "CREATE TABLE {orders} (id BIGINT AUTO_INCREMENT PRIMARY KEY, ref VARCHAR(255) NOT NULL,
             placed_by VARCHAR(64) NOT NULL) ENGINE = InnoDB"
    ))
    .await;
    Rig {
        store,
        orders: orders.into(),
        _guards: (records, orders_guard),
    }
}

async fn insert_order(
    conn: &mut MySqlConnection,
    orders: &str,
    key: &IdempotencyKey,
    placed_by: &str,
) -> Result<(), String> {
    sqlx::query(&format!(
        "INSERT INTO {orders} (ref, placed_by) VALUES (?, ?)"
    ))
    .bind(key.as_str())
    .bind(placed_by)
    .execute(conn)
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// The committed orders for `key`, by who placed them, read on a connection of its own.
async fn orders_for(orders: &str, key: &IdempotencyKey) -> Vec<String> {
    let mut conn = common::admin().await;
    let placed = sqlx::query_scalar(&format!(
        "SELECT placed_by FROM {orders} WHERE ref = ? ORDER BY id"
    ))
    .bind(key.as_str())
    .fetch_all(&mut conn)
    .await
    .expect("count orders");
    let _ = conn.close().await;
    placed
}

fn scope() -> Scope {
    Scope::new("tenant-1|POST /orders").unwrap()
}

fn fingerprint() -> Fingerprint {
    Fingerprint::from_json(&serde_json::json!({"sku": "A1", "qty": 2}))
}

/// A retry of `key`, released or left by the holder of `first`, reclaims it with the next
/// token and commits the one order.
async fn retry_runs_once(
    engine: &MySqlIdempotency,
    orders: &Arc<str>,
    key: &IdempotencyKey,
    first: FencingToken,
) {
    let (o, k) = (orders.clone(), key.clone());
    let retry = engine
        .run_in_transaction(key, &scope(), &fingerprint(), move |tx, ctx| {
            let (orders, key) = (o.clone(), k.clone());
            Box::pin(async move {
                Ok(async move {
                    insert_order(tx, &orders, &key, "retry").await?;
                    Ok::<u64, String>(ctx.token.0)
                }
                .await)
            })
        })
        .await
        .expect("the retry runs");
    assert_eq!(
        retry,
        Answer::Executed(Ok(first.next().0)),
        "the retry reclaimed the released key"
    );
    assert_eq!(
        orders_for(orders, key).await,
        vec!["retry".to_owned()],
        "exactly one order: the first holder's transaction committed nothing"
    );
}

// ---------------------------------------------------------------------------------------------
// Lease takeover: the holder stalls past its lease inside its transaction (heartbeat off), a
// retry reclaims the key and commits its order; the stale holder's completion matches nothing
// and its transaction (with its order) rolls back.

const TAKEOVER_PAIRS: usize = 6;
const TAKEOVER_ROUNDS: usize = 2;

async fn lease_takeover(level: Isolation) {
    let rig = setup(level, 2 * TAKEOVER_PAIRS as u32 + 2).await;
    let policy = Policy::default()
        .lease(Duration::from_millis(300))
        .heartbeat(None);
    let engine = Idempotency::builder(rig.store.clone())
        .policy(policy.clone())
        .build()
        .unwrap();
    // The retry waits while the key is in progress (a loaded machine may be slow to let the
    // stalled holder's lease pass in the table), then takes it over.
    let retry_policy = policy.in_flight(InFlight::wait(Duration::from_secs(30)));
    let retry = Idempotency::builder(rig.store.clone())
        .policy(retry_policy)
        .build()
        .unwrap();
    for _ in 0..TAKEOVER_ROUNDS {
        let pairs: Vec<_> = (0..TAKEOVER_PAIRS)
            .map(|_| {
                tokio::spawn(takeover_pair(
                    engine.clone(),
                    retry.clone(),
                    rig.orders.clone(),
                ))
            })
            .collect();
        for pair in pairs {
            pair.await.expect("pair");
        }
    }
}

async fn takeover_pair(engine: MySqlIdempotency, retry: MySqlIdempotency, orders: Arc<str>) {
    let key = IdempotencyKey::random();
    let started = Arc::new(Notify::new());
    let retry_started = Arc::new(Notify::new());
    let stale_token = Arc::new(AtomicU64::new(0));
    let stale = {
        let (engine, orders, key, started, stale_token, retry_started) = (
            engine.clone(),
            orders.clone(),
            key.clone(),
            started.clone(),
            stale_token.clone(),
            retry_started.clone(),
        );
        tokio::spawn(async move {
            let k = key.clone();
            engine
                .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
                    let (orders, key, started, stale_token, retry_started) = (
                        orders.clone(),
                        k.clone(),
                        started.clone(),
                        stale_token.clone(),
                        retry_started.clone(),
                    );
                    Box::pin(async move {
                        Ok(async move {
                            insert_order(tx, &orders, &key, "stale").await?;
                            stale_token.store(ctx.token.0, Ordering::SeqCst);
                            started.notify_one();
                            // Stall past the 300 ms lease, transaction open, until the
                            // retry has taken the key over (its work runs only then),
                            // however slow a loaded machine is.
                            let taken_over = retry_started.notified();
                            let _ = tokio::time::timeout(Duration::from_secs(30), taken_over).await;
                            Ok::<u64, String>(ctx.token.0)
                        }
                        .await)
                    })
                })
                .await
        })
    };
    started.notified().await;
    let stale_token = FencingToken(stale_token.load(Ordering::SeqCst));
    tokio::time::sleep(Duration::from_millis(450)).await;
    let (k, o) = (key.clone(), orders.clone());
    let fresh = retry
        .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
            let (orders, key, retry_started) = (o.clone(), k.clone(), retry_started.clone());
            Box::pin(async move {
                retry_started.notify_one();
                Ok(async move {
                    insert_order(tx, &orders, &key, "retry").await?;
                    Ok::<u64, String>(ctx.token.0)
                }
                .await)
            })
        })
        .await
        .expect("the retry runs");
    assert_eq!(
        fresh,
        Answer::Executed(Ok(stale_token.next().0)),
        "the retry reclaimed with the stale holder's token + 1"
    );
    let stale = stale.await.expect("task");
    assert!(
        matches!(stale, Err(Error::LeaseLost { token }) if token == stale_token),
        "the stale holder must be fenced, got {stale:?}"
    );
    assert_eq!(
        orders_for(&orders, &key).await,
        vec!["retry".to_owned()],
        "exactly one order, the retry's: the stale holder's transaction rolled back"
    );
    let record = engine
        .store()
        .get(&RecordId::new(key.clone(), scope()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(record.token, stale_token.next());
    let replay = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), |_tx, _ctx| {
            Box::pin(async {
                Ok(async move { panic!("a completed key must not run again") }.await)
            })
        })
        .await
        .expect("replay");
    assert_eq!(
        replay,
        Answer::<Result<u64, String>>::Replayed(Ok(stale_token.next().0))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_takeover_read_committed() {
    lease_takeover(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_takeover_repeatable_read() {
    lease_takeover(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_takeover_serializable() {
    lease_takeover(Isolation::Serializable).await;
}

// ---------------------------------------------------------------------------------------------
// Dropped transaction (a crash before the commit): the holder's future is cancelled after its
// insert, or its transaction dropped after the completion CAS ran in it but before the commit.
// Nothing commits; the retry runs once.

const DROPPED: usize = 8;

async fn dropped_transaction(level: Isolation) {
    let rig = setup(level, 2 * DROPPED as u32 + 2).await;
    let policy = Policy::default()
        .lease(Duration::from_secs(2))
        .in_flight(InFlight::wait(Duration::from_secs(20)));
    let engine = Idempotency::builder(rig.store.clone())
        .policy(policy)
        .build()
        .unwrap();
    let cases: Vec<_> = (0..DROPPED)
        .map(|i| {
            let (engine, orders) = (engine.clone(), rig.orders.clone());
            tokio::spawn(async move {
                if i % 2 == 0 {
                    dropped_during_work(engine, orders).await;
                } else {
                    dropped_after_completion(engine, orders).await;
                }
            })
        })
        .collect();
    for case in cases {
        case.await.expect("case");
    }
}

/// The work's future is aborted after its insert.
async fn dropped_during_work(engine: MySqlIdempotency, orders: Arc<str>) {
    let key = IdempotencyKey::random();
    let inserted = Arc::new(Notify::new());
    let token = Arc::new(AtomicU64::new(0));
    let first = {
        let (engine, orders, key, inserted, token) = (
            engine.clone(),
            orders.clone(),
            key.clone(),
            inserted.clone(),
            token.clone(),
        );
        tokio::spawn(async move {
            let k = key.clone();
            engine
                .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
                    let (orders, key, inserted, token) =
                        (orders.clone(), k.clone(), inserted.clone(), token.clone());
                    Box::pin(async move {
                        Ok(async move {
                            insert_order(tx, &orders, &key, "dropped").await?;
                            token.store(ctx.token.0, Ordering::SeqCst);
                            inserted.notify_one();
                            std::future::pending::<()>().await;
                            Ok::<u64, String>(0)
                        }
                        .await)
                    })
                })
                .await
        })
    };
    inserted.notified().await;
    first.abort();
    assert!(first.await.expect_err("aborted").is_cancelled());
    let token = FencingToken(token.load(Ordering::SeqCst));
    retry_runs_once(&engine, &orders, &key, token).await;
}

/// The completion CAS ran in the transaction, then the transaction and the lease were dropped
/// without a commit (the process gave up, a panic unwound past them).
async fn dropped_after_completion(engine: MySqlIdempotency, orders: Arc<str>) {
    let key = IdempotencyKey::random();
    let id = RecordId::new(key.clone(), scope());
    let Begin::Execute(lease) = engine.begin(&id, &fingerprint()).await.unwrap() else {
        panic!("a fresh key is executed");
    };
    let mut tx = engine.store().pool().begin().await.unwrap();
    insert_order(&mut tx, &orders, &key, "dropped")
        .await
        .unwrap();
    engine
        .store()
        .complete_in(
            &mut tx,
            lease.id(),
            lease.token(),
            b"{\"Ok\":1}",
            lease.retention(),
        )
        .await
        .expect("the holder's completion applies inside its transaction");
    let token = lease.token();
    drop(tx);
    drop(lease);
    retry_runs_once(&engine, &orders, &key, token).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_transaction_read_committed() {
    dropped_transaction(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_transaction_repeatable_read() {
    dropped_transaction(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_transaction_serializable() {
    dropped_transaction(Isolation::Serializable).await;
}

// ---------------------------------------------------------------------------------------------
// A panicking work and a failing work: the transaction rolls back (the order with it) and the
// key is released at once, so the retry runs once.

async fn panic_and_error(level: Isolation) {
    let rig = setup(level, 6).await;
    let engine = Idempotency::builder(rig.store.clone())
        .policy(Policy::default())
        .build()
        .unwrap();
    // Panic.
    let key = IdempotencyKey::random();
    let token = Arc::new(AtomicU64::new(0));
    let run = {
        let (engine, orders, key, token) = (
            engine.clone(),
            rig.orders.clone(),
            key.clone(),
            token.clone(),
        );
        tokio::spawn(async move {
            let k = key.clone();
            engine
                .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
                    let (orders, key, token) = (orders.clone(), k.clone(), token.clone());
                    Box::pin(async move {
                        Ok(async move {
                            insert_order(tx, &orders, &key, "panicked").await?;
                            token.store(ctx.token.0, Ordering::SeqCst);
                            if ctx.token.0 > 0 {
                                panic!("the work panics after its insert");
                            }
                            Ok::<u64, String>(0)
                        }
                        .await)
                    })
                })
                .await
        })
    };
    assert!(run.await.expect_err("the panic goes on").is_panic());
    let first = FencingToken(token.load(Ordering::SeqCst));
    retry_runs_once(&engine, &rig.orders, &key, first).await;

    // The work's error (released by the default policy).
    let key = IdempotencyKey::random();
    let token = Arc::new(AtomicU64::new(0));
    let (o, k, t) = (rig.orders.clone(), key.clone(), token.clone());
    let failed = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
            let (orders, key, token) = (o.clone(), k.clone(), t.clone());
            Box::pin(async move {
                Ok(async move {
                    insert_order(tx, &orders, &key, "failed").await?;
                    token.store(ctx.token.0, Ordering::SeqCst);
                    Err::<u64, String>("out of stock".to_owned())
                }
                .await)
            })
        })
        .await
        .expect("the work ran");
    assert_eq!(failed, Answer::Executed(Err("out of stock".to_owned())));
    assert!(orders_for(&rig.orders, &key).await.is_empty());
    let first = FencingToken(token.load(Ordering::SeqCst));
    retry_runs_once(&engine, &rig.orders, &key, first).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn panic_and_error_read_committed() {
    panic_and_error(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn panic_and_error_repeatable_read() {
    panic_and_error(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn panic_and_error_serializable() {
    panic_and_error(Isolation::Serializable).await;
}

// ---------------------------------------------------------------------------------------------
// Concurrent duplicates: many tasks run the same key at once, round after round; exactly one
// execution commits one order, every other request is told the key is in progress or replays.

const DUPLICATES: usize = 16;
const DUPLICATE_ROUNDS: usize = 6;

async fn concurrent_duplicates(level: Isolation) {
    let rig = setup(level, 10).await;
    let engine = Idempotency::builder(rig.store.clone())
        .policy(Policy::default())
        .build()
        .unwrap();
    for _ in 0..DUPLICATE_ROUNDS {
        let key = IdempotencyKey::random();
        let executions = Arc::new(AtomicUsize::new(0));
        let start = Arc::new(tokio::sync::Barrier::new(DUPLICATES));
        let tasks: Vec<_> = (0..DUPLICATES)
            .map(|i| {
                let (engine, orders, key, executions, start) = (
                    engine.clone(),
                    rig.orders.clone(),
                    key.clone(),
                    executions.clone(),
                    start.clone(),
                );
                tokio::spawn(async move {
                    start.wait().await;
                    let k = key.clone();
                    engine
                        .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, _ctx| {
                            let (orders, key, executions) =
                                (orders.clone(), k.clone(), executions.clone());
                            Box::pin(async move {
                                Ok(async move {
                                    executions.fetch_add(1, Ordering::SeqCst);
                                    insert_order(tx, &orders, &key, &format!("task-{i}")).await?;
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                    Ok::<usize, String>(i)
                                }
                                .await)
                            })
                        })
                        .await
                })
            })
            .collect();
        let mut fresh = 0;
        for task in tasks {
            match task.await.expect("task") {
                Ok(Answer::Executed(Ok(_))) => fresh += 1,
                Ok(Answer::Replayed(Ok(_))) | Ok(Answer::Refused(Refusal::InProgress { .. })) => {}
                other => panic!("a duplicate got {other:?}"),
            }
        }
        assert_eq!(fresh, 1, "exactly one request executes");
        assert_eq!(executions.load(Ordering::SeqCst), 1, "the work ran once");
        assert_eq!(orders_for(&rig.orders, &key).await.len(), 1, "one order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_read_committed() {
    concurrent_duplicates(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_repeatable_read() {
    concurrent_duplicates(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_serializable() {
    concurrent_duplicates(Isolation::Serializable).await;
}

// ---------------------------------------------------------------------------------------------
// A deadlock: the work updates a stock row, then its completion waits for the record row,
// which another transaction holds locked while it waits for the stock row. InnoDB rolls back
// the lighter transaction (the work's: the other one wrote many rows first) with error 1213;
// the store calls it a conflict and core runs the whole transaction again, once more, and its
// effect lands once.

async fn deadlock_reruns(level: Isolation) {
    let rig = setup(level, 6).await;
    let stock_guard = TableGuard::new();
    let stock = format!("`{}`", stock_guard.table);
    common::exec(&format!(
        "CREATE TABLE {stock} (id INT PRIMARY KEY, sold INT NOT NULL, touched INT NOT NULL,
             pad VARCHAR(64) NULL) ENGINE = InnoDB"
    ))
    .await;
    common::exec(&format!("INSERT INTO {stock} VALUES (1, 0, 0, NULL)")).await;
    let policy = Policy::default()
        .lease(Duration::from_secs(30))
        .heartbeat(None);
    let engine = Idempotency::builder(rig.store.clone())
        .policy(policy)
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let id = RecordId::new(key.clone(), scope());
    let attempts = Arc::new(AtomicUsize::new(0));
    let stock_locked = Arc::new(Notify::new());
    let record_locked = Arc::new(Notify::new());
    let holder = {
        let (engine, orders, key, attempts, stock, stock_locked, record_locked) = (
            engine.clone(),
            rig.orders.clone(),
            key.clone(),
            attempts.clone(),
            stock.clone(),
            stock_locked.clone(),
            record_locked.clone(),
        );
        tokio::spawn(async move {
            let k = key.clone();
            engine
                .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, _ctx| {
                    let (orders, key, attempts, stock, stock_locked, record_locked) = (
                        orders.clone(),
                        k.clone(),
                        attempts.clone(),
                        stock.clone(),
                        stock_locked.clone(),
                        record_locked.clone(),
                    );
                    Box::pin(async move {
                        Ok(async move {
                            let attempt = attempts.fetch_add(1, Ordering::SeqCst) + 1;
                            sqlx::query(&format!(
                                "UPDATE {stock} SET sold = sold + 1 WHERE id = 1"
                            ))
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| e.to_string())?;
                            insert_order(tx, &orders, &key, "holder").await?;
                            if attempt == 1 {
                                stock_locked.notify_one();
                                record_locked.notified().await;
                            }
                            Ok::<usize, String>(attempt)
                        }
                        .await)
                    })
                })
                .await
        })
    };
    stock_locked.notified().await;
    // The other transaction: heavy (200 rows written), then the record row, then the stock.
    let mut other = common::admin().await;
    other
        .execute(format!("SET SESSION TRANSACTION ISOLATION LEVEL {}", level.sql()).as_str())
        .await
        .unwrap();
    let mut tx = other.begin().await.unwrap();
    for i in 0..200 {
        sqlx::query(&format!("INSERT INTO {stock} VALUES (?, 0, 0, 'padding')"))
            .bind(1000 + i)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    let table = rig.store.table_name().quoted();
    sqlx::query(&format!(
        "SELECT token FROM {table} WHERE scope = ? AND idem_key = ? FOR UPDATE"
    ))
    .bind(id.scope.as_str().as_bytes())
    .bind(id.key.as_str().as_bytes())
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    record_locked.notify_one();
    // Waits for the holder's stock lock, until InnoDB breaks the cycle by rolling the holder
    // back (its completion waits for the record row this transaction holds).
    sqlx::query(&format!(
        "UPDATE {stock} SET touched = touched + 1 WHERE id = 1"
    ))
    .execute(&mut *tx)
    .await
    .expect("InnoDB picks the lighter transaction, the holder's, as the victim");
    tx.commit().await.unwrap();
    let _ = other.close().await;
    let outcome = holder
        .await
        .expect("task")
        .expect("the holder's transaction runs again");
    assert_eq!(
        outcome,
        Answer::Executed(Ok(2)),
        "the deadlock ran the transaction again"
    );
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    assert_eq!(
        orders_for(&rig.orders, &key).await,
        vec!["holder".to_owned()]
    );
    let mut conn = common::admin().await;
    let (sold, touched): (i32, i32) =
        sqlx::query_as(&format!("SELECT sold, touched FROM {stock} WHERE id = 1"))
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(
        (sold, touched),
        (1, 1),
        "each transaction's effect landed once"
    );
    let record = rig.store.get(&id).await.unwrap().unwrap();
    assert_eq!(record.status, RecordStatus::Completed);
    drop(stock_guard);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlock_reruns_read_committed() {
    deadlock_reruns(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlock_reruns_repeatable_read() {
    deadlock_reruns(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlock_reruns_serializable() {
    deadlock_reruns(Isolation::Serializable).await;
}

// ---------------------------------------------------------------------------------------------
// Long work: the work runs for several leases with the heartbeat on, its business write and
// completion in one transaction. Duplicates meanwhile are told the key is in progress (never
// a takeover), and the completion inside the transaction finds the record although the
// heartbeat extended it from another connection after the transaction's snapshot.

async fn long_work(level: Isolation) {
    let rig = setup(level, 6).await;
    // A heartbeat every 300 ms for a 1 s lease: 700 ms of slack for an extension's commit on a
    // loaded machine (each is a durable write).
    let lease = Duration::from_secs(1);
    let policy = Policy::default().lease(lease).heartbeat(Some(0.3));
    let engine = Idempotency::builder(rig.store.clone())
        .policy(policy)
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let id = RecordId::new(key.clone(), scope());
    let started = Arc::new(Notify::new());
    let holder = {
        let (engine, orders, key, started) = (
            engine.clone(),
            rig.orders.clone(),
            key.clone(),
            started.clone(),
        );
        tokio::spawn(async move {
            let k = key.clone();
            engine
                .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
                    let (orders, key, started) = (orders.clone(), k.clone(), started.clone());
                    Box::pin(async move {
                        Ok(async move {
                            // Take the snapshot (REPEATABLE READ) before any heartbeat.
                            let _: i64 = sqlx::query_scalar(
                                "SELECT COUNT(*) FROM information_schema.TABLES",
                            )
                            .fetch_one(&mut *tx)
                            .await
                            .map_err(|e| e.to_string())?;
                            insert_order(tx, &orders, &key, "long").await?;
                            started.notify_one();
                            tokio::time::sleep(Duration::from_millis(3500)).await;
                            Ok::<u64, String>(ctx.token.0)
                        }
                        .await)
                    })
                })
                .await
        })
    };
    started.notified().await;
    let first = rig.store.get(&id).await.unwrap().unwrap();
    // Duplicates while the work runs, well past the first lease.
    let until = Instant::now() + Duration::from_millis(3000);
    let mut duplicates = 0;
    while Instant::now() < until {
        let dup = engine
            .run_in_transaction(&key, &scope(), &fingerprint(), |_tx, _ctx| {
                Box::pin(async { Ok(async move { Ok::<u64, String>(0) }.await) })
            })
            .await;
        assert!(
            matches!(dup, Ok(Answer::Refused(Refusal::InProgress { .. }))),
            "a duplicate during the long work must be told it is in progress, got {dup:?}"
        );
        duplicates += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(duplicates >= 5);
    let outcome = holder
        .await
        .expect("task")
        .expect("the long work completes");
    assert_eq!(outcome, Answer::Executed(Ok(first.token.0)));
    let record = rig.store.get(&id).await.unwrap().unwrap();
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(record.token, first.token, "never taken over");
    assert!(record.updated_at > first.updated_at);
    assert_eq!(orders_for(&rig.orders, &key).await, vec!["long".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_work_read_committed() {
    long_work(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_work_repeatable_read() {
    long_work(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_work_serializable() {
    long_work(Isolation::Serializable).await;
}

/// The pool's sessions really run at the level each test asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_run_at_the_level_asked() {
    for level in Isolation::ALL {
        let pool = common::pool(level, 1).await;
        let got: String = sqlx::query_scalar("SELECT CAST(@@tx_isolation AS CHAR)")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(got, level.reported());
    }
}

// ---------------------------------------------------------------------------------------------
// A connection lost at the commit: the caller is told the outcome is unknown, and the key is
// held, never released while the writes may have committed. If the COMMIT reached the server,
// the key is Completed with its one order and a retry replays it; if it did not, nothing was
// written, the key stays Pending until its lease passes, and then a retry runs the work once.

async fn lost_at_commit(level: Isolation, committed: bool) {
    let rig = setup(level, 2).await;
    let options = common::options();
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let proxy = common::proxy::CountingProxy::start(upstream).await.unwrap();
    let proxied = options
        .host("127.0.0.1")
        .port(proxy.port())
        .ssl_mode(idempotency_mysql::sqlx::mysql::MySqlSslMode::Disabled);
    let store = MySqlStore::builder()
        .table(rig.store.table_name().table())
        .build(common::pool_with(proxied, level, 4).await)
        .unwrap();
    let policy = Policy::default().lease(Duration::from_secs(1));
    let engine = Idempotency::builder(store).policy(policy).build().unwrap();
    let key = IdempotencyKey::random();
    let id = RecordId::new(key.clone(), scope());
    proxy.cut_next_commit(committed);
    let (o, k) = (rig.orders.clone(), key.clone());
    let holder = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
            let (orders, key) = (o.clone(), k.clone());
            Box::pin(async move {
                Ok(async move {
                    insert_order(tx, &orders, &key, "holder").await?;
                    Ok::<u64, String>(ctx.token.0)
                }
                .await)
            })
        })
        .await;
    assert!(
        matches!(holder, Err(Error::OutcomeUnknown { .. })),
        "a commit whose answer was lost: expected OutcomeUnknown, got {holder:?}"
    );
    let mut record = rig.store.get(&id).await.unwrap().unwrap();
    let token = record.token;
    if committed {
        // The COMMIT reached the server before the connection was cut, and the client hears
        // of the cut without waiting for it: a loaded server may still be applying it. The
        // record may only ever be Pending, then Completed by the holder's token.
        let deadline = Instant::now() + Duration::from_secs(30);
        while record.status == RecordStatus::Pending && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            record = rig.store.get(&id).await.unwrap().unwrap();
        }
        assert_eq!(record.status, RecordStatus::Completed, "{record:?}");
        assert_eq!(record.token, token, "nobody else took the key");
        assert_eq!(
            orders_for(&rig.orders, &key).await,
            vec!["holder".to_owned()]
        );
        let replay = engine
            .run_in_transaction(&key, &scope(), &fingerprint(), |_tx, _ctx| {
                Box::pin(async {
                    Ok(async move { panic!("a completed key must not run again") }.await)
                })
            })
            .await
            .unwrap();
        assert_eq!(replay, Answer::<Result<u64, String>>::Replayed(Ok(token.0)));
        return;
    }
    // Nothing committed: the key is held, not released.
    assert_eq!(record.status, RecordStatus::Pending, "{record:?}");
    assert!(orders_for(&rig.orders, &key).await.is_empty());
    let (o, k) = (rig.orders.clone(), key.clone());
    let early = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
            let (orders, key) = (o.clone(), k.clone());
            Box::pin(async move {
                Ok(async move {
                    insert_order(tx, &orders, &key, "too early").await?;
                    Ok::<u64, String>(ctx.token.0)
                }
                .await)
            })
        })
        .await;
    assert!(
        matches!(early, Ok(Answer::Refused(Refusal::InProgress { .. }))),
        "the key must be held while the lost commit's lease lives, got {early:?}"
    );
    // Once the lease passes, a retry takes the key over and runs the work once.
    let deadline = Instant::now() + Duration::from_secs(20);
    let retried = loop {
        let (o, k) = (rig.orders.clone(), key.clone());
        match engine
            .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
                let (orders, key) = (o.clone(), k.clone());
                Box::pin(async move {
                    Ok(async move {
                        insert_order(tx, &orders, &key, "retry").await?;
                        Ok::<u64, String>(ctx.token.0)
                    }
                    .await)
                })
            })
            .await
        {
            Ok(Answer::Refused(Refusal::InProgress { .. })) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => break other,
        }
    };
    assert_eq!(retried.unwrap(), Answer::Executed(Ok(token.next().0)));
    assert_eq!(
        orders_for(&rig.orders, &key).await,
        vec!["retry".to_owned()]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_lost_at_commit_read_committed() {
    lost_at_commit(Isolation::ReadCommitted, true).await;
    lost_at_commit(Isolation::ReadCommitted, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_lost_at_commit_repeatable_read() {
    lost_at_commit(Isolation::RepeatableRead, true).await;
    lost_at_commit(Isolation::RepeatableRead, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_lost_at_commit_serializable() {
    lost_at_commit(Isolation::Serializable, true).await;
    lost_at_commit(Isolation::Serializable, false).await;
}

/// The work's own `begin()` on the transaction's connection is a savepoint inside the
/// completion's transaction, never a second `BEGIN` (which MySQL answers by committing the
/// first): rolling the savepoint back undoes only its own writes, and the rest commits with
/// the completion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_begin_in_the_work_is_a_savepoint() {
    let rig = setup(Isolation::RepeatableRead, 2).await;
    let engine = Idempotency::builder(rig.store.clone())
        .policy(Policy::default())
        .build()
        .unwrap();
    let orders = rig.orders.clone();
    let key = IdempotencyKey::random();
    let scope = Scope::new("savepoint").unwrap();
    let out = engine
        .run_in_transaction(
            &key,
            &scope,
            &Fingerprint::from_bytes(b"p"),
            move |tx, _ctx| {
                let orders = orders.clone();
                Box::pin(async move {
                    Ok(async move {
                        let insert =
                            format!("INSERT INTO {orders} (ref, placed_by) VALUES (?, 'w')");
                        sqlx::query(&insert)
                            .bind("kept")
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        let mut inner = tx.begin().await.unwrap();
                        sqlx::query(&insert)
                            .bind("undone")
                            .execute(&mut *inner)
                            .await
                            .unwrap();
                        inner.rollback().await.unwrap();
                        Ok::<u64, String>(1)
                    }
                    .await)
                })
            },
        )
        .await
        .unwrap();
    assert_eq!(out, Answer::Executed(Ok(1)));
    let mut conn = common::admin().await;
    let refs: Vec<String> =
        sqlx::query_scalar(&format!("SELECT ref FROM {} ORDER BY id", rig.orders))
            .fetch_all(&mut conn)
            .await
            .unwrap();
    assert_eq!(refs, vec!["kept".to_owned()]);
    let record = rig
        .store
        .get(&RecordId::new(key, scope))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.status, RecordStatus::Completed);
}

// ---------------------------------------------------------------------------------------------
// A deadlock in the work's own statements: the work locks stock row 1, then waits for row 2,
// which a heavier transaction holds while it waits for row 1. InnoDB rolls the work's
// transaction back (1213); the whole transaction runs again, as after a deadlock in the
// completion, and the error is never returned as the work's answer.

async fn the_works_own_deadlock(level: Isolation) {
    let rig = setup(level, 6).await;
    let stock_guard = TableGuard::new();
    let stock: Arc<str> = format!("`{}`", stock_guard.table).into();
    common::exec(&format!(
        "CREATE TABLE {stock} (id INT PRIMARY KEY, sold INT NOT NULL, touched INT NOT NULL,
             pad VARCHAR(64) NULL) ENGINE = InnoDB"
    ))
    .await;
    common::exec(&format!(
        "INSERT INTO {stock} VALUES (1, 0, 0, NULL), (2, 0, 0, NULL)"
    ))
    .await;
    let policy = Policy::default()
        .lease(Duration::from_secs(30))
        .heartbeat(None);
    let engine = Idempotency::builder(rig.store.clone())
        .policy(policy)
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let attempts = Arc::new(AtomicUsize::new(0));
    let row1_locked = Arc::new(Notify::new());
    let row2_locked = Arc::new(Notify::new());
    let holder = {
        let (engine, key, attempts, stock, row1_locked, row2_locked) = (
            engine.clone(),
            key.clone(),
            attempts.clone(),
            stock.clone(),
            row1_locked.clone(),
            row2_locked.clone(),
        );
        tokio::spawn(async move {
            engine
                .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, _ctx| {
                    let (attempts, stock, row1_locked, row2_locked) = (
                        attempts.clone(),
                        stock.clone(),
                        row1_locked.clone(),
                        row2_locked.clone(),
                    );
                    Box::pin(async move {
                        let attempt = attempts.fetch_add(1, Ordering::SeqCst) + 1;
                        let sell = |row: i32| {
                            format!("UPDATE {stock} SET sold = sold + 1 WHERE id = {row}")
                        };
                        sqlx::query(&sell(1)).execute(&mut *tx).await?;
                        if attempt == 1 {
                            row1_locked.notify_one();
                            row2_locked.notified().await;
                        }
                        sqlx::query(&sell(2)).execute(&mut *tx).await?;
                        Ok(Ok::<usize, String>(attempt))
                    })
                })
                .await
        })
    };
    row1_locked.notified().await;
    // The other transaction: heavy (200 rows written), then row 2, then row 1.
    let mut other = common::admin().await;
    other
        .execute(format!("SET SESSION TRANSACTION ISOLATION LEVEL {}", level.sql()).as_str())
        .await
        .unwrap();
    let mut tx = other.begin().await.unwrap();
    for i in 0..200 {
        sqlx::query(&format!("INSERT INTO {stock} VALUES (?, 0, 0, 'padding')"))
            .bind(1000 + i)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    sqlx::query(&format!(
        "UPDATE {stock} SET touched = touched + 1 WHERE id = 2"
    ))
    .execute(&mut *tx)
    .await
    .unwrap();
    row2_locked.notify_one();
    sqlx::query(&format!(
        "UPDATE {stock} SET touched = touched + 1 WHERE id = 1"
    ))
    .execute(&mut *tx)
    .await
    .expect("InnoDB picks the lighter transaction, the work's, as the victim");
    tx.commit().await.unwrap();
    let _ = other.close().await;
    let outcome = holder
        .await
        .expect("task")
        .expect("the work's deadlock is not an error of the call");
    assert_eq!(
        outcome,
        Answer::Executed(Ok(2)),
        "{level:?}: the work's deadlock ran the transaction again"
    );
    assert_eq!(attempts.load(Ordering::SeqCst), 2, "{level:?}");
    let mut conn = common::admin().await;
    let rows: Vec<(i32, i32)> = sqlx::query_as(&format!(
        "SELECT sold, touched FROM {stock} WHERE id IN (1, 2) ORDER BY id"
    ))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![(1, 1), (1, 1)],
        "{level:?}: each transaction's effect landed once"
    );
    drop(stock_guard);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_works_own_deadlock_runs_the_transaction_again() {
    for level in [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ] {
        the_works_own_deadlock(level).await;
    }
}

// ---------------------------------------------------------------------------------------------
// MariaDB's snapshot isolation (`innodb_snapshot_isolation`, on by default from 11.8): at
// REPEATABLE READ a write to a row another transaction changed after this one's snapshot
// fails with 1020 ("Record has changed since last read").

/// A store whose sessions run at REPEATABLE READ with `innodb_snapshot_isolation` on.
async fn snapshot_store() -> (MySqlStore, TableGuard) {
    let guard = TableGuard::new();
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(6)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    .await?;
                conn.execute("SET SESSION innodb_snapshot_isolation = ON")
                    .await?;
                Ok(())
            })
        })
        .connect_with(common::options())
        .await
        .unwrap();
    let store = MySqlStore::builder()
        .table(&guard.table)
        .build(pool)
        .unwrap();
    store.migrate().await.unwrap();
    (store, guard)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_works_own_snapshot_conflict_runs_the_transaction_again() {
    let (store, _records) = snapshot_store().await;
    let accounts_guard = TableGuard::new();
    let accounts: Arc<str> = format!("`{}`", accounts_guard.table).into();
    common::exec(&format!(
        "CREATE TABLE {accounts} (id INT PRIMARY KEY, balance BIGINT NOT NULL) ENGINE = InnoDB"
    ))
    .await;
    common::exec(&format!("INSERT INTO {accounts} VALUES (1, 100)")).await;
    let engine = Idempotency::builder(store.clone())
        .policy(Policy::default())
        .build()
        .unwrap();
    let (read, paid) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    // A concurrent payment of 1 that commits between the work's first read and its write.
    let payer = {
        let (accounts, read, paid) = (accounts.clone(), read.clone(), paid.clone());
        tokio::spawn(async move {
            read.notified().await;
            let mut conn = common::admin().await;
            let pay = format!("UPDATE {accounts} SET balance = balance - 1 WHERE id = 1");
            sqlx::query(&pay).execute(&mut conn).await.unwrap();
            paid.notify_one();
        })
    };
    let runs = Arc::new(AtomicUsize::new(0));
    let key = IdempotencyKey::random();
    let outcome = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), |tx, _ctx| {
            let (accounts, runs, read, paid) =
                (accounts.clone(), runs.clone(), read.clone(), paid.clone());
            Box::pin(async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let select = format!("SELECT balance FROM {accounts} WHERE id = 1");
                let row = sqlx::query(&select).fetch_one(&mut *tx).await?;
                let balance: i64 = sqlx::Row::try_get(&row, 0)?;
                if run == 1 {
                    read.notify_one();
                    paid.notified().await;
                }
                let write = format!("UPDATE {accounts} SET balance = ? WHERE id = 1");
                sqlx::query(&write)
                    .bind(balance - 10)
                    .execute(&mut *tx)
                    .await?;
                Ok(Ok::<i64, String>(balance - 10))
            })
        })
        .await
        .expect("the work's conflict is not an error of the call");
    payer.await.unwrap();
    assert_eq!(outcome, Answer::Executed(Ok(89)));
    assert_eq!(runs.load(Ordering::SeqCst), 2, "runs of the work");
    let mut conn = common::admin().await;
    let balance: i64 = sqlx::query_scalar(&format!("SELECT balance FROM {accounts} WHERE id = 1"))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(balance, 89, "both payments land, once each");
    drop(accounts_guard);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_work_under_snapshot_isolation_is_refused_with_a_typed_error() {
    let (store, _records) = snapshot_store().await;
    let rig_orders = TableGuard::new();
    let orders: Arc<str> = format!("`{}`", rig_orders.table).into();
    common::exec(&format!(
        "CREATE TABLE {orders} (id BIGINT AUTO_INCREMENT PRIMARY KEY, ref VARCHAR(255) NOT NULL,
             placed_by VARCHAR(64) NOT NULL) ENGINE = InnoDB"
    ))
    .await;
    let policy = Policy::default().lease(Duration::from_millis(400));
    let engine = Idempotency::builder(store.clone())
        .policy(policy)
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let runs = Arc::new(AtomicUsize::new(0));
    let outcome = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), |tx, _ctx| {
            let (orders, key, runs) = (orders.clone(), key.clone(), runs.clone());
            Box::pin(async move {
                runs.fetch_add(1, Ordering::SeqCst);
                // A read first: the transaction's snapshot is taken here.
                let count = format!("SELECT COUNT(*) FROM {orders}");
                sqlx::query(&count).fetch_one(&mut *tx).await?;
                // Work for several leases: the heartbeat extends the record meanwhile.
                tokio::time::sleep(Duration::from_millis(1_500)).await;
                let insert = format!("INSERT INTO {orders} (ref, placed_by) VALUES (?, 'long')");
                sqlx::query(&insert)
                    .bind(key.as_str())
                    .execute(&mut *tx)
                    .await?;
                Ok(Ok::<u32, String>(1))
            })
        })
        .await;
    // The heartbeat extended the record after the work's first read: the completion is
    // refused with a typed error that says what to change, at once (not after running the
    // work again), nothing commits and the key is released for a retry.
    let error = outcome.expect_err("the completion cannot be written under snapshot isolation");
    assert!(
        matches!(
            MySqlError::find(&error),
            Some(MySqlError::SnapshotIsolation { .. })
        ),
        "{error:?}"
    );
    assert!(error.is_retryable(), "the key is released: {error:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "runs of the work");
    assert!(
        orders_for(&orders, &key).await.is_empty(),
        "nothing commits"
    );
    let record = store
        .get(&RecordId::new(key.clone(), scope()))
        .await
        .unwrap()
        .expect("the record");
    assert_eq!(record.status, RecordStatus::Failed, "released: {record:?}");
    drop(rig_orders);
}

// Any other database error of the work's own statements (a unique key it breaks) ends the
// transaction without running it again: nothing committed, so the key is released, and the
// caller gets the driver's error as the source of `Error::Backend`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_works_own_database_error_releases_the_key_and_is_returned() {
    let rig = setup(Isolation::RepeatableRead, 4).await;
    let refs_guard = TableGuard::new();
    let refs: Arc<str> = format!("`{}`", refs_guard.table).into();
    common::exec(&format!(
        "CREATE TABLE {refs} (ref VARCHAR(64) PRIMARY KEY) ENGINE = InnoDB"
    ))
    .await;
    common::exec(&format!("INSERT INTO {refs} VALUES ('taken')")).await;
    let engine = Idempotency::builder(rig.store.clone())
        .policy(Policy::default())
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let runs = Arc::new(AtomicUsize::new(0));
    let insert = |value: &'static str| insert_ref(refs.clone(), runs.clone(), value);
    let error = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), insert("taken"))
        .await
        .expect_err("a duplicate key in the work is the call's error");
    assert!(
        matches!(error.find_source::<sqlx::Error>(), Some(sqlx::Error::Database(db))
            if db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                .is_some_and(|e| e.number() == 1062)),
        "{error:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "not a conflict: run once");
    let record = rig
        .store
        .get(&RecordId::new(key.clone(), scope()))
        .await
        .unwrap()
        .expect("the record");
    assert_eq!(record.status, RecordStatus::Failed, "released: {record:?}");
    let retried = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), insert("free"))
        .await
        .expect("the retry runs");
    assert_eq!(retried, Answer::Executed(Ok(())));
    drop(refs_guard);
}

/// A work that counts its runs and inserts `value` into `refs`.
fn insert_ref(
    refs: Arc<str>,
    runs: Arc<AtomicUsize>,
    value: &'static str,
) -> impl for<'c> FnMut(
    &'c mut MySqlConnection,
    idempotency_core::WorkContext,
) -> futures::future::BoxFuture<'c, Result<Result<(), String>, sqlx::Error>>
       + Send {
    move |tx, _ctx| {
        let (refs, runs) = (refs.clone(), runs.clone());
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let sql = format!("INSERT INTO {refs} VALUES (?)");
            sqlx::query(&sql).bind(value).execute(&mut *tx).await?;
            Ok(Ok(()))
        })
    }
}

/// A transaction the caller holds (`begin_transaction`), at each level: duplicates run
/// nothing twice and replay the one order's answer; dropped after its insert, it rolls back
/// and releases the key, and the next caller places the only order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_transaction_commits_once_and_a_dropped_one_leaves_nothing() {
    use idempotency_core::transaction::Started;
    for level in Isolation::ALL {
        let rig = setup(level, 12).await;
        let engine: MySqlIdempotency = Idempotency::builder(rig.store.clone()).build().unwrap();
        let place = |key: IdempotencyKey, by: String| {
            let (engine, orders) = (engine.clone(), rig.orders.clone());
            async move {
                let started = Instant::now();
                loop {
                    assert!(started.elapsed() < Duration::from_secs(60), "no answer");
                    match engine
                        .begin_transaction::<String, String>(&key, &scope(), &fingerprint())
                        .await
                        .unwrap()
                    {
                        Started::Begun(mut tx) => {
                            insert_order(&mut tx, &orders, &key, &by).await.unwrap();
                            match tx.commit(by.clone()).await {
                                Ok(by) => return by,
                                // A deadlock: everything rolled back, the key released.
                                Err(e) if engine.is_conflict(&e) => continue,
                                Err(e) => panic!("commit: {e}"),
                            }
                        }
                        Started::Replayed(answer) => return answer.unwrap(),
                        Started::Refused(Refusal::InProgress { .. }) => {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        Started::Refused(other) => panic!("refused: {other}"),
                    }
                }
            }
        };
        for _ in 0..3 {
            let key = IdempotencyKey::random();
            let callers: Vec<_> = (0..6)
                .map(|i| tokio::spawn(place(key.clone(), format!("c{i}"))))
                .collect();
            let mut answers = Vec::new();
            for caller in callers {
                answers.push(caller.await.unwrap());
            }
            let placed = orders_for(&rig.orders, &key).await;
            assert_eq!(placed.len(), 1, "{level:?}: one order per key: {placed:?}");
            assert!(answers.iter().all(|a| *a == placed[0]), "{answers:?}");
        }
        let key = IdempotencyKey::random();
        let Started::Begun(mut tx) = engine
            .begin_transaction::<String, String>(&key, &scope(), &fingerprint())
            .await
            .unwrap()
        else {
            panic!("a new key begins");
        };
        insert_order(&mut tx, &rig.orders, &key, "dropped")
            .await
            .unwrap();
        drop(tx);
        assert_eq!(place(key.clone(), "retry".into()).await, "retry");
        assert_eq!(orders_for(&rig.orders, &key).await, ["retry"], "{level:?}");
    }
}
