//! Exactly-once effects with a real business table: the completion CAS commits in the same
//! transaction as the `orders` insert, so whatever happens to the holder (it stalls past its
//! lease, its transaction is dropped, its connection is killed), the key ends with exactly one
//! order, never two and never none. Every scenario runs many times over, concurrently, at each
//! isolation level.
#![allow(clippy::unwrap_used)]

use crate::common;
use idempotency_core::Idempotency;

use common::{Isolation, SchemaGuard};
use idempotency_core::protocol::Begin;
use idempotency_core::store::{Claim, ClaimRequest, Reclaim, RecordStatus};
use idempotency_core::{
    Answer, Error, FencingToken, Fingerprint, IdempotencyKey, IdempotencyStore, InFlight, Policy,
    RecordId, Refusal, Scope,
};
use idempotency_postgres::sqlx::{self, Connection, PgConnection};
use idempotency_postgres::{PostgresIdempotency, PostgresStore};
use rand::Rng;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

/// The store, its schema guard and the schema-qualified `orders` table beside it.
pub(crate) async fn setup(
    level: Isolation,
    pool_size: u32,
) -> (PostgresStore, SchemaGuard, Arc<str>) {
    let (store, guard) = common::store_with(level, pool_size).await;
    let orders = format!(r#""{}".orders"#, guard.schema);
    common::exec(&format!(
        "CREATE TABLE {orders} (id bigserial PRIMARY KEY, ref text NOT NULL, placed_by text NOT NULL)"
    ))
    .await;
    (store, guard, orders.into())
}

async fn insert_order(
    conn: &mut PgConnection,
    orders: &str,
    key: &IdempotencyKey,
    placed_by: &str,
) -> Result<(), String> {
    sqlx::query(&format!(
        "INSERT INTO {orders} (ref, placed_by) VALUES ($1, $2)"
    ))
    .bind(key.as_str())
    .bind(placed_by)
    .execute(conn)
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// The committed orders for `key`, by who placed them.
/// Read on a connection of its own at READ COMMITTED: an observer that never fails to
/// serialize, whatever level the store's sessions run at.
pub(crate) async fn orders_for(orders: &str, key: &IdempotencyKey) -> Vec<String> {
    let mut conn = common::admin().await;
    sqlx::query_scalar(&format!(
        "SELECT placed_by FROM {orders} WHERE ref = $1 ORDER BY id"
    ))
    .bind(key.as_str())
    .fetch_all(&mut conn)
    .await
    .expect("count orders")
}

pub(crate) fn scope() -> Scope {
    Scope::new("tenant-1|POST /orders").unwrap()
}

pub(crate) fn fingerprint() -> Fingerprint {
    Fingerprint::from_json(&serde_json::json!({"sku": "A1", "qty": 2}))
}

// ---------------------------------------------------------------------------------------------
// Lease takeover: the holder stalls past its lease inside its transaction, a retry reclaims the
// key and commits its order; the stale holder's completion matches nothing and its transaction
// (with its order) rolls back.

const TAKEOVER_PAIRS: usize = 6;
const TAKEOVER_ROUNDS: usize = 2;

async fn lease_takeover(level: Isolation) {
    // Each stalled holder keeps a connection busy; the pool must have room for the retries.
    let (store, _guard, orders) = setup(level, 2 * TAKEOVER_PAIRS as u32 + 2).await;
    let policy = Policy::default()
        .lease(Duration::from_millis(300))
        .heartbeat(None);
    let engine = Idempotency::builder(store.clone())
        .policy(policy.clone())
        .build()
        .unwrap();
    // The retry waits while the key is in progress (a loaded machine may still be rolling the
    // stalled holder back when the retry comes), then takes it over. Its own lease is long: a
    // loaded machine between its takeover and its transaction's lock must not fence it.
    let retry_policy = policy
        .lease(Duration::from_secs(5))
        .in_flight(InFlight::wait(Duration::from_secs(30)));
    let retry = Idempotency::builder(store.clone())
        .policy(retry_policy)
        .build()
        .unwrap();
    for _ in 0..TAKEOVER_ROUNDS {
        let pairs: Vec<_> = (0..TAKEOVER_PAIRS)
            .map(|_| tokio::spawn(takeover_pair(engine.clone(), retry.clone(), orders.clone())))
            .collect();
        for pair in pairs {
            pair.await.expect("pair");
        }
    }
}

async fn takeover_pair(engine: PostgresIdempotency, retry: PostgresIdempotency, orders: Arc<str>) {
    // A loaded machine can be so slow that the holder's lease passes before its transaction
    // begins (at REPEATABLE READ and SERIALIZABLE it is then refused, `LeaseLost`, and its
    // work never starts): then the pair starts again on a new key, up to 20 times.
    let mut tries = 0;
    let (key, stale, stale_token, retry_started) = loop {
        tries += 1;
        let key = IdempotencyKey::random();
        let started = Arc::new(Notify::new());
        let retry_started = Arc::new(Notify::new());
        let stale_token = Arc::new(AtomicU64::new(0));
        let mut stale = {
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
                                let _ =
                                    tokio::time::timeout(Duration::from_secs(30), taken_over).await;
                                Ok::<u64, String>(ctx.token.0)
                            }
                            .await)
                        })
                    })
                    .await
            })
        };
        tokio::select! {
            () = started.notified() => {
                break (key, stale, FencingToken(stale_token.load(Ordering::SeqCst)), retry_started);
            }
            ended = &mut stale => {
                let ended = ended.expect("task");
                assert!(
                    matches!(ended, Err(Error::LeaseLost { .. })) && tries < 20,
                    "the holder's work never started ({tries} tries): {ended:?}"
                );
            }
        }
    };
    tokio::time::sleep(Duration::from_millis(450)).await;
    let k = key.clone();
    let o = orders.clone();
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
// Dropped transaction: the holder's future is cancelled mid-transaction (after its insert, or
// after its completion CAS but before the commit). Nothing commits; the retry runs once.

const DROPPED: usize = 8;

async fn dropped_transaction(level: Isolation) {
    let (store, _guard, orders) = setup(level, 2 * DROPPED as u32 + 2).await;
    let policy = Policy::default()
        .lease(Duration::from_secs(5))
        .in_flight(InFlight::wait(Duration::from_secs(20)));
    let engine = Idempotency::builder(store.clone())
        .policy(policy)
        .build()
        .unwrap();
    let cases: Vec<_> = (0..DROPPED)
        .map(|i| {
            let (engine, orders) = (engine.clone(), orders.clone());
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
async fn dropped_during_work(engine: PostgresIdempotency, orders: Arc<str>) {
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
async fn dropped_after_completion(engine: PostgresIdempotency, orders: Arc<str>) {
    let key = IdempotencyKey::random();
    let id = RecordId::new(key.clone(), scope());
    let Begin::Execute(lease) = engine.begin(&id, &fingerprint()).await.unwrap() else {
        panic!("a fresh key is executed");
    };
    // At SERIALIZABLE the other cases' concurrent transactions can make SSI cancel this one
    // (40001, reported as retryable); like any caller, run the whole transaction again.
    let mut attempt = 0;
    let tx = loop {
        attempt += 1;
        let mut tx = engine.store().pool().begin().await.unwrap();
        let applied = match insert_order(&mut tx, &orders, &key, "dropped").await {
            Ok(()) => {
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
            }
            Err(e) => Err(idempotency_core::Error::backend(e.contains("40001"), e)),
        };
        match applied {
            Ok(()) => break tx,
            Err(e) if e.is_retryable() && attempt < 20 => drop(tx),
            Err(e) => panic!("the holder's completion applies inside its transaction: {e:?}"),
        }
    };
    let token = lease.token();
    drop(tx);
    drop(lease);
    retry_runs_once(&engine, &orders, &key, token).await;
}

/// A retry of `key`, released or left by the holder of `first`, reclaims it with the next
/// token and commits the one order.
async fn retry_runs_once(
    engine: &PostgresIdempotency,
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
        "exactly one order: the dropped transaction committed nothing"
    );
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
// Killed connection: `pg_terminate_backend` hits the connection at a random moment of the
// transaction holding the business write and the completion (before the insert, between the
// insert and the CAS, between the CAS and the commit, during or after the commit). The holder
// is treated as crashed (no release). Afterwards the record is either Completed with one
// order, or Pending with zero orders, not reclaimable while its lease is live, and reclaimable
// once it passes — after which the retry leaves one order. Never two, never lost.

const KILLS_PER_LEVEL: usize = 16;
const KILL_LEASE: Duration = Duration::from_secs(3);

#[derive(Default)]
struct Tally {
    completed: AtomicUsize,
    pending: AtomicUsize,
}

async fn killed_connection(level: Isolation, tally: &Tally) {
    let (store, _guard, orders) = setup(level, 8).await;
    let cases: Vec<_> = (0..KILLS_PER_LEVEL)
        .map(|_| tokio::spawn(kill_once(store.clone(), orders.clone(), level)))
        .collect();
    for case in cases {
        match case.await.expect("case") {
            RecordStatus::Completed => tally.completed.fetch_add(1, Ordering::SeqCst),
            RecordStatus::Pending => tally.pending.fetch_add(1, Ordering::SeqCst),
            RecordStatus::Failed => unreachable!("checked in kill_once"),
        };
    }
}

/// The holder's transaction on a connection of its own: insert, completion CAS, commit, with
/// random pauses so the kill lands anywhere. Returns whether the commit reported success.
async fn holder_transaction(
    store: &PostgresStore,
    orders: &str,
    id: &RecordId,
    token: FencingToken,
    level: Isolation,
    pid_tx: Option<tokio::sync::oneshot::Sender<i32>>,
) -> Result<(), String> {
    let mut conn = common::admin().await;
    sqlx::query(&format!(
        "SET default_transaction_isolation = '{}'",
        level.sql()
    ))
    .execute(&mut conn)
    .await
    .map_err(|e| e.to_string())?;
    let mut tx = conn.begin().await.map_err(|e| e.to_string())?;
    holder_statements(&mut tx, store, orders, id, token, pid_tx).await?;
    tx.commit().await.map_err(|e| e.to_string())
}

async fn holder_statements(
    tx: &mut PgConnection,
    store: &PostgresStore,
    orders: &str,
    id: &RecordId,
    token: FencingToken,
    pid_tx: Option<tokio::sync::oneshot::Sender<i32>>,
) -> Result<(), String> {
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    if let Some(pid_tx) = pid_tx {
        let _ = pid_tx.send(pid);
    }
    let (p1, p2) = {
        let mut rng = rand::thread_rng();
        (rng.gen_range(0..60), rng.gen_range(0..60))
    };
    let pause = |ms: u32| format!("SELECT pg_sleep({})", f64::from(ms) / 1000.0);
    sqlx::query(&pause(p1))
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    insert_order(tx, orders, &id.key, "holder").await?;
    store
        .complete_in(tx, id, token, b"{\"Ok\":1}", Duration::from_secs(3600))
        .await
        .map_err(|e| e.to_string())?;
    sqlx::query(&pause(p2))
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

async fn kill_once(store: PostgresStore, orders: Arc<str>, level: Isolation) -> RecordStatus {
    let key = IdempotencyKey::random();
    let id = RecordId::new(key.clone(), scope());
    let request = ClaimRequest::new(
        id.clone(),
        fingerprint(),
        KILL_LEASE,
        Duration::from_secs(3600),
    );
    let Claim::Claimed { token, .. } = store.claim(&request).await.unwrap() else {
        panic!("a fresh key is claimed");
    };
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let holder = {
        let (store, orders, id) = (store.clone(), orders.clone(), id.clone());
        tokio::spawn(async move {
            holder_transaction(&store, &orders, &id, token, level, Some(pid_tx)).await
        })
    };
    let pid = pid_rx.await.expect("the holder reports its backend");
    let delay = rand::thread_rng().gen_range(0..150);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let mut admin = common::admin().await;
    let _: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut admin)
        .await
        .unwrap();
    let committed = holder.await.expect("holder task").is_ok();

    let record = store
        .get(&id)
        .await
        .unwrap()
        .expect("the record is never lost");
    let placed = orders_for(&orders, &key).await;
    match record.status {
        RecordStatus::Completed => {
            assert_eq!(
                placed,
                vec!["holder".to_owned()],
                "completed: exactly one order"
            );
            assert_eq!(record.token, token);
            RecordStatus::Completed
        }
        RecordStatus::Pending => {
            assert!(
                !committed,
                "the commit reported success but nothing is stored"
            );
            assert!(
                placed.is_empty(),
                "pending: the order must not exist, found {placed:?}"
            );
            assert_eq!(record.token, token, "nobody else took the key");
            // Not reclaimable while the lease is live (checked only when the lease has more
            // than a second left on the database clock, so a slow machine cannot race it).
            let now_ms: i64 = sqlx::query_scalar(
                "SELECT (extract(epoch from statement_timestamp()) * 1000)::int8",
            )
            .fetch_one(&mut admin)
            .await
            .unwrap();
            let lease_until = record.lease_until.expect("pending has a lease").as_millis();
            if lease_until - now_ms > 1000 {
                assert_eq!(
                    store
                        .reclaim(
                            &id,
                            token,
                            &fingerprint(),
                            KILL_LEASE,
                            Duration::from_secs(3600)
                        )
                        .await
                        .unwrap(),
                    Reclaim::Lost,
                    "a live lease must not be reclaimed"
                );
            }
            // Once the lease passes, a retry reclaims the key and commits its order.
            tokio::time::sleep(Duration::from_millis(
                u64::try_from(lease_until - now_ms).unwrap_or(0) + 50,
            ))
            .await;
            let mut reclaimed = None;
            for _ in 0..50 {
                match store
                    .reclaim(
                        &id,
                        token,
                        &fingerprint(),
                        KILL_LEASE,
                        Duration::from_secs(3600),
                    )
                    .await
                    .unwrap()
                {
                    Reclaim::Reclaimed { token, .. } => {
                        reclaimed = Some(token);
                        break;
                    }
                    Reclaim::Lost => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
            let new_token = reclaimed.expect("reclaimable once the lease passed");
            assert_eq!(new_token, token.next());
            // At SERIALIZABLE the retry's transaction may fail to serialize against the
            // other cases running beside it; like any serializable client, run it again.
            let mut attempts = 0;
            while let Err(e) =
                holder_transaction(&store, &orders, &id, new_token, level, None).await
            {
                attempts += 1;
                assert!(
                    attempts < 20 && (e.contains("could not serialize") || e.contains("deadlock")),
                    "the retry must commit: {e}"
                );
            }
            assert_eq!(
                orders_for(&orders, &key).await,
                vec!["holder".to_owned()],
                "after the retry: exactly one order"
            );
            let done = store.get(&id).await.unwrap().unwrap();
            assert_eq!(done.status, RecordStatus::Completed);
            assert_eq!(done.token, new_token);
            RecordStatus::Pending
        }
        RecordStatus::Failed => panic!("nothing records a failure in this scenario: {record:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_connection_never_two_never_lost() {
    let tally = Tally::default();
    for level in Isolation::ALL {
        killed_connection(level, &tally).await;
    }
    let (completed, pending) = (
        tally.completed.load(Ordering::SeqCst),
        tally.pending.load(Ordering::SeqCst),
    );
    eprintln!(
        "killed connection: {completed} kills left Completed + 1 order, \
         {pending} left Pending + 0 orders (then reclaimed: 1 order)"
    );
    // Both outcomes must have been exercised, or the kill timing missed the window.
    assert!(
        completed > 0 && pending > 0,
        "completed {completed}, pending {pending}"
    );
}

// Kill with the engine helper: the work's pooled connection is terminated mid-transaction;
// the work's next statement fails, its database error (the outer `Err`, through `?`) releases
// the key and is the call's error, and a retry through the engine leaves exactly one order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_connection_through_engine_helper() {
    let (store, _guard, orders) = setup(Isolation::ReadCommitted, 8).await;
    let policy = Policy::default()
        .lease(Duration::from_secs(2))
        .in_flight(InFlight::wait(Duration::from_secs(10)));
    let engine = Idempotency::builder(store.clone())
        .policy(policy)
        .build()
        .unwrap();
    for _ in 0..6 {
        let key = IdempotencyKey::random();
        let (o, k) = (orders.clone(), key.clone());
        let first = engine
            .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, _ctx| {
                let (orders, key) = (o.clone(), k.clone());
                Box::pin(async move {
                    let insert =
                        format!("INSERT INTO {orders} (ref, placed_by) VALUES ($1, 'killed')");
                    sqlx::query(&insert)
                        .bind(key.as_str())
                        .execute(&mut *tx)
                        .await?;
                    // Kill our own backend from a second connection while the transaction
                    // holds the insert.
                    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                        .fetch_one(&mut *tx)
                        .await?;
                    let mut admin = common::admin().await;
                    let _: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
                        .bind(pid)
                        .fetch_one(&mut admin)
                        .await?;
                    sqlx::query(&insert)
                        .bind(key.as_str())
                        .execute(&mut *tx)
                        .await?;
                    Ok(Ok::<u64, String>(0))
                })
            })
            .await;
        // The work saw its connection die: the driver's error, the key released for a retry.
        match &first {
            Err(e @ Error::Backend { .. }) if e.find_source::<sqlx::Error>().is_some() => {}
            other => panic!("expected the work's database error, got {other:?}"),
        }
        assert!(orders_for(&orders, &key).await.is_empty());
        let record = store
            .get(&RecordId::new(key.clone(), scope()))
            .await
            .unwrap()
            .expect("the released record");
        assert_eq!(record.status, RecordStatus::Failed, "released: {record:?}");
        let token = record.token;
        retry_runs_once(&engine, &orders, &key, token).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Long work: the work takes several heartbeat intervals (lease 300 ms, heartbeat every 100 ms,
// work 1.2 s) with its transaction open. It must commit on its first run at every isolation
// level, while a reclaimer and a duplicate request that arrive long after the claim's own lease
// would have passed never take the key.

const LONG_LEASE: Duration = Duration::from_millis(300);
const LONG_WORK: Duration = Duration::from_millis(1200);

async fn long_work(level: Isolation) {
    let (store, _guard, orders) = setup(level, 8).await;
    let policy = Policy::default().lease(LONG_LEASE);
    let engine = Idempotency::builder(store.clone())
        .policy(policy)
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let id = RecordId::new(key.clone(), scope());
    let runs = Arc::new(AtomicUsize::new(0));
    let token = Arc::new(AtomicU64::new(0));
    let inserted = Arc::new(Notify::new());
    let holder = {
        let (engine, orders, key, runs, token, inserted) = (
            engine.clone(),
            orders.clone(),
            key.clone(),
            runs.clone(),
            token.clone(),
            inserted.clone(),
        );
        tokio::spawn(async move {
            let k = key.clone();
            engine
                .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
                    let (orders, key, runs, token, inserted) = (
                        orders.clone(),
                        k.clone(),
                        runs.clone(),
                        token.clone(),
                        inserted.clone(),
                    );
                    Box::pin(async move {
                        Ok(async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            insert_order(tx, &orders, &key, "long").await?;
                            token.store(ctx.token.0, Ordering::SeqCst);
                            inserted.notify_one();
                            tokio::time::sleep(LONG_WORK).await;
                            Ok::<u64, String>(ctx.token.0)
                        }
                        .await)
                    })
                })
                .await
        })
    };
    inserted.notified().await;
    let token = FencingToken(token.load(Ordering::SeqCst));
    // More than two leases into the work.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let reclaim = {
        let (store, id) = (store.clone(), id.clone());
        tokio::spawn(async move {
            store
                .reclaim(
                    &id,
                    token,
                    &fingerprint(),
                    LONG_LEASE,
                    Duration::from_secs(3600),
                )
                .await
        })
    };
    let duplicate = {
        let (engine, key, runs) = (engine.clone(), key.clone(), runs.clone());
        tokio::spawn(async move {
            engine
                .run_in_transaction(&key, &scope(), &fingerprint(), move |_tx, _ctx| {
                    let runs = runs.clone();
                    Box::pin(async move {
                        Ok(async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            Ok::<u64, String>(0)
                        }
                        .await)
                    })
                })
                .await
        })
    };
    let out = holder.await.expect("holder task");
    let reclaim = reclaim.await.expect("reclaim task");
    let duplicate = duplicate.await.expect("duplicate task");
    let placed = orders_for(&orders, &key).await;
    let record = store.get(&id).await.unwrap().expect("the record");
    let runs = runs.load(Ordering::SeqCst);
    assert!(
        matches!(&out, Ok(Answer::Executed(Ok(t))) if *t == token.0)
            && runs == 1
            && placed == vec!["long".to_owned()]
            && record.status == RecordStatus::Completed
            && record.token == token,
        "{level:?}: long work must commit on its first run: result {out:?}, work runs {runs}, \
         orders {placed:?}, record {record:?}"
    );
    assert!(
        matches!(reclaim, Ok(Reclaim::Lost)),
        "{level:?}: a reclaim while the holder works must not take the key: {reclaim:?}"
    );
    // At every level the duplicate is told at once that the key is in progress: at READ
    // COMMITTED the heartbeat keeps the lease alive, at the snapshot levels the holder's row
    // lock says it is alive (the lease column has passed).
    assert!(
        matches!(&duplicate, Ok(Answer::Refused(Refusal::InProgress { .. }))),
        "{level:?}: a duplicate while the holder works is in progress: {duplicate:?}"
    );
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

/// Work that outlives both its lease and its retention (a short TTL, as queue deduplication
/// uses): lease 1 s, TTL 1 s, work of 3 s that inserts a row. At the snapshot levels the
/// lease is kept in the process while the row is locked, and nothing moves the record's own
/// expiry: the completion must still apply, once, with one row.
async fn long_work_short_ttl(level: Isolation) {
    let (store, _guard, orders) = setup(level, 8).await;
    let policy = Policy::default()
        .lease(Duration::from_secs(1))
        .retention(Duration::from_secs(1));
    let engine = Idempotency::builder(store.clone())
        .policy(policy)
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let runs = Arc::new(AtomicUsize::new(0));
    let out = {
        let (orders, k, runs) = (orders.clone(), key.clone(), runs.clone());
        engine
            .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, _ctx| {
                let (orders, key, runs) = (orders.clone(), k.clone(), runs.clone());
                Box::pin(async move {
                    Ok(async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        insert_order(tx, &orders, &key, "slow").await?;
                        Ok::<u8, String>(7)
                    }
                    .await)
                })
            })
            .await
    };
    let placed = orders_for(&orders, &key).await;
    assert!(
        matches!(out, Ok(Answer::Executed(Ok(7)))) && placed == vec!["slow".to_owned()],
        "{level:?}: 3 s of work with a 1 s lease and TTL got {out:?}, orders {placed:?}, \
         work runs {}",
        runs.load(Ordering::SeqCst)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_work_short_ttl_read_committed() {
    long_work_short_ttl(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_work_short_ttl_repeatable_read() {
    long_work_short_ttl(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_work_short_ttl_serializable() {
    long_work_short_ttl(Isolation::Serializable).await;
}

// ---------------------------------------------------------------------------------------------
// A duplicate of a held key is answered at once at every isolation level. At the snapshot levels
// the holder keeps the record row locked for its whole transaction and renews its lease only in
// its process, so the record's lease passes in the database while the holder is alive: a
// duplicate's claim, its reclaim and the store calls behind them must not wait for that lock
// (they answered only when the holder committed, or at the response timeout), and duplicates
// whose callers give up must not leave the small pool's connections behind blocked statements.

async fn duplicates_of_a_held_key(level: Isolation) {
    // The holder keeps its lease in its process, renewed every third of it: a stall of the
    // holder's task for a whole lease (a loaded machine) would end its transaction, and a
    // duplicate would then rightly take the key over. 1.5 s keeps that out of the scenario.
    const LONG_LEASE: Duration = Duration::from_millis(1500);
    const POOL: u32 = 3;
    let (store, _guard, orders) = setup(level, POOL).await;
    let policy = Policy::default().lease(LONG_LEASE);
    let engine = Idempotency::builder(store.clone())
        .policy(policy.clone())
        .build()
        .unwrap();
    let plain =
        idempotency_core::Idempotency::new(Arc::new(store.clone()), policy.clone()).unwrap();
    // A duplicate whose claim counts a hit writes the record row (the others only read it).
    let counting =
        idempotency_core::Idempotency::new(Arc::new(store.clone()), policy.count_hits(true))
            .unwrap();
    let key = IdempotencyKey::random();
    let id = RecordId::new(key.clone(), scope());
    // Runs of the duplicates' work: none may run. (The holder's transaction may run again
    // after a serialization failure at SERIALIZABLE, its first run rolled back: the orders
    // table counts what committed.)
    let runs = Arc::new(AtomicUsize::new(0));
    let token = Arc::new(AtomicU64::new(0));
    let inserted = Arc::new(Notify::new());
    let finish = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let holder = {
        let (engine, orders, key, token, inserted, finish) = (
            engine.clone(),
            orders.clone(),
            key.clone(),
            token.clone(),
            inserted.clone(),
            finish.clone(),
        );
        tokio::spawn(async move {
            let k = key.clone();
            engine
                .run_in_transaction(&key, &scope(), &fingerprint(), move |tx, ctx| {
                    let (orders, key, token, inserted, finish) = (
                        orders.clone(),
                        k.clone(),
                        token.clone(),
                        inserted.clone(),
                        finish.clone(),
                    );
                    Box::pin(async move {
                        Ok(async move {
                            insert_order(tx, &orders, &key, "holder").await?;
                            token.store(ctx.token.0, Ordering::SeqCst);
                            inserted.notify_one();
                            // Works until the duplicates have all been answered.
                            for _ in 0..6_000 {
                                if finish.load(Ordering::SeqCst) {
                                    break;
                                }
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            Ok::<u64, String>(ctx.token.0)
                        }
                        .await)
                    })
                })
                .await
        })
    };
    inserted.notified().await;
    let token = FencingToken(token.load(Ordering::SeqCst));
    // Every duplicate must be answered while the holder still works: none may wait for it.
    const ANSWER_WITHIN: Duration = Duration::from_secs(20);
    let duplicate = || {
        let (engine, runs) = (engine.clone(), runs.clone());
        let key = key.clone();
        async move {
            tokio::time::timeout(
                ANSWER_WITHIN,
                engine.run_in_transaction(&key, &scope(), &fingerprint(), move |_tx, _ctx| {
                    let runs = runs.clone();
                    Box::pin(async move {
                        Ok(async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            Ok::<u64, String>(0)
                        }
                        .await)
                    })
                }),
            )
            .await
        }
    };
    let through_engine = |counts_hits: bool| {
        let plain = if counts_hits {
            counting.clone()
        } else {
            plain.clone()
        };
        let runs = runs.clone();
        let key = key.clone();
        async move {
            tokio::time::timeout(
                ANSWER_WITHIN,
                plain.run(&key, &scope(), &fingerprint(), move |_ctx| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<u64, String>(0)
                }),
            )
            .await
        }
    };
    // Within the lease, then past it (in the database; the holder keeps it in its process).
    for phase in ["within the lease", "past the lease"] {
        if phase == "past the lease" {
            tokio::time::sleep(LONG_LEASE * 2).await;
        }
        let answer = duplicate().await;
        assert!(
            matches!(answer, Ok(Ok(Answer::Refused(Refusal::InProgress { .. })))),
            "{level:?}, {phase}: a duplicate through run_in_transaction is told the key is in \
             progress at once: {answer:?}"
        );
        for counts_hits in [false, true] {
            let answer = through_engine(counts_hits).await;
            assert!(
                matches!(answer, Ok(Ok(Answer::Refused(Refusal::InProgress { .. })))),
                "{level:?}, {phase}: a duplicate through the engine (counting hits: \
                 {counts_hits}) is told the key is in progress at once: {answer:?}"
            );
        }
        // A batch's claim (a queue consumer's), counting its hit.
        let request = ClaimRequest::new(
            id.clone(),
            fingerprint(),
            LONG_LEASE,
            Duration::from_secs(3600),
        )
        .with_count_hit(true);
        let batch = tokio::time::timeout(ANSWER_WITHIN, store.claim_many(&[request])).await;
        assert!(
            matches!(batch.as_deref(), Ok([Ok(Claim::Existing { record, .. })]) if record.token == token),
            "{level:?}, {phase}: a batch's claim of the held key is answered at once: {batch:?}"
        );
        let reclaim = tokio::time::timeout(
            ANSWER_WITHIN,
            store.reclaim(
                &id,
                token,
                &fingerprint(),
                LONG_LEASE,
                Duration::from_secs(3600),
            ),
        )
        .await;
        assert!(
            matches!(reclaim, Ok(Ok(Reclaim::Lost))),
            "{level:?}, {phase}: a reclaim of the held key is lost at once: {reclaim:?}"
        );
    }
    // Duplicates whose callers give up at once, many more than the pool holds.
    for _ in 0..(4 * POOL) {
        let _ = tokio::time::timeout(Duration::from_millis(1), duplicate()).await;
        let _ = tokio::time::timeout(Duration::from_millis(1), through_engine(false)).await;
        let _ = tokio::time::timeout(Duration::from_millis(1), through_engine(true)).await;
    }
    // The pool still serves: a new key runs (the test pool waits 60 s for a connection).
    let other = tokio::time::timeout(
        ANSWER_WITHIN,
        plain.run(
            &IdempotencyKey::random(),
            &scope(),
            &fingerprint(),
            |_ctx| async { Ok::<u64, String>(1) },
        ),
    )
    .await;
    assert!(
        matches!(other, Ok(Ok(Answer::Executed(Ok(1))))),
        "{level:?}: after cancelled duplicates a new key runs on the pool: {other:?}"
    );
    finish.store(true, Ordering::SeqCst);
    let out = holder.await.expect("holder task");
    assert!(
        matches!(&out, Ok(Answer::Executed(Ok(_)))),
        "{level:?}: the holder commits: {out:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "{level:?}: no duplicate ran the work"
    );
    assert_eq!(
        orders_for(&orders, &key).await,
        vec!["holder".to_owned()],
        "{level:?}: one order"
    );
    let replay = duplicate().await;
    assert!(
        matches!((&out, &replay), (Ok(Answer::Executed(Ok(t))), Ok(Ok(Answer::Replayed(Ok(r))))) if t == r),
        "{level:?}: after the commit a duplicate replays: {replay:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_of_a_held_key_read_committed() {
    duplicates_of_a_held_key(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_of_a_held_key_repeatable_read() {
    duplicates_of_a_held_key(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_of_a_held_key_serializable() {
    duplicates_of_a_held_key(Isolation::Serializable).await;
}

// ---------------------------------------------------------------------------------------------
// The connection is lost at the business transaction's COMMIT: a loopback proxy between the
// pool and the server either forwards the COMMIT, lets the server apply it and then cuts the
// connection before the answer (the commit applied, the client cannot know), or cuts the
// connection instead of forwarding it (nothing applied). Either way the caller gets
// `OutcomeUnknown`; the key is released only if the writes did not commit (the release is a
// CAS on the Pending record, which a committed completion has already replaced), so a retry
// replays the committed outcome or runs the work once more, and there is exactly one order.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CommitCut {
    /// Forward the COMMIT, wait for the server to apply it, then cut before its answer.
    AfterCommit,
    /// Cut instead of forwarding the COMMIT.
    InsteadOfCommit,
}

/// A loopback proxy that cuts one connection at its next `COMMIT` once armed.
#[derive(Clone)]
struct CutProxy {
    port: u16,
    armed: Arc<std::sync::Mutex<Option<CommitCut>>>,
    cuts: Arc<AtomicUsize>,
}

impl CutProxy {
    async fn start(upstream: String) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = CutProxy {
            port: listener.local_addr().unwrap().port(),
            armed: Arc::default(),
            cuts: Arc::default(),
        };
        let p = proxy.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (mut client_rd, client_wr) = client.into_split();
                let (mut server_rd, mut server_wr) = server.into_split();
                // The client's write half is shared: the cutter drops it to close the socket.
                let client_wr = Arc::new(tokio::sync::Mutex::new(Some(client_wr)));
                let silenced = Arc::new(std::sync::atomic::AtomicBool::new(false));
                {
                    let (client_wr, silenced) = (client_wr.clone(), silenced.clone());
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 16384];
                        loop {
                            let n = match server_rd.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if silenced.load(Ordering::SeqCst) {
                                break;
                            }
                            let mut w = client_wr.lock().await;
                            let Some(w) = w.as_mut() else { break };
                            if w.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        client_wr.lock().await.take();
                    });
                }
                let p = p.clone();
                tokio::spawn(async move {
                    // Startup: untyped messages (SSL/GSS requests, then the startup message).
                    loop {
                        let Ok(len) = client_rd.read_u32().await else {
                            return;
                        };
                        let mut body = vec![0; (len as usize).saturating_sub(4)];
                        if client_rd.read_exact(&mut body).await.is_err() {
                            return;
                        }
                        let _ = server_wr.write_all(&len.to_be_bytes()).await;
                        let _ = server_wr.write_all(&body).await;
                        let code = body
                            .get(..4)
                            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                            .unwrap_or(0);
                        if code != 80_877_103 && code != 80_877_104 {
                            break;
                        }
                    }
                    while let Ok(kind) = client_rd.read_u8().await {
                        let Ok(len) = client_rd.read_u32().await else {
                            break;
                        };
                        let mut body = vec![0; (len as usize).saturating_sub(4)];
                        if client_rd.read_exact(&mut body).await.is_err() {
                            break;
                        }
                        let cut = if kind == b'Q' && body.starts_with(b"COMMIT") {
                            p.armed.lock().unwrap().take()
                        } else {
                            None
                        };
                        if cut.is_some() {
                            silenced.store(true, Ordering::SeqCst);
                            p.cuts.fetch_add(1, Ordering::SeqCst);
                        }
                        if cut != Some(CommitCut::InsteadOfCommit) {
                            let mut msg = vec![kind];
                            msg.extend_from_slice(&len.to_be_bytes());
                            msg.extend_from_slice(&body);
                            if server_wr.write_all(&msg).await.is_err() {
                                break;
                            }
                        }
                        if cut.is_some() {
                            if cut == Some(CommitCut::AfterCommit) {
                                // Let the server apply the commit before the cut.
                                tokio::time::sleep(Duration::from_millis(300)).await;
                            }
                            break;
                        }
                    }
                    // Close both sides: the client sees its connection die, the server ends
                    // the session (rolling back whatever it had not committed).
                    client_wr.lock().await.take();
                    let _ = server_wr.shutdown().await;
                });
            }
        });
        proxy
    }

    fn arm(&self, cut: CommitCut) {
        *self.armed.lock().unwrap() = Some(cut);
    }
}

async fn commit_cut(level: Isolation, cut: CommitCut) {
    use idempotency_postgres::sqlx::postgres::{PgConnectOptions, PgSslMode};
    use std::str::FromStr;
    let options = PgConnectOptions::from_str(&common::url()).unwrap();
    let proxy = CutProxy::start(format!("{}:{}", options.get_host(), options.get_port())).await;
    let options = options
        .host("127.0.0.1")
        .port(proxy.port)
        .ssl_mode(PgSslMode::Disable);
    let pool = idempotency_testing::postgres::pool_with(options, level, 4).await;
    let guard = SchemaGuard::new();
    let store = PostgresStore::builder()
        .schema(&guard.schema)
        .table("records")
        .build(pool)
        .unwrap();
    store.migrate().await.unwrap();
    let orders = format!(r#""{}".orders"#, guard.schema);
    common::exec(&format!(
        "CREATE TABLE {orders} (id bigserial PRIMARY KEY, ref text NOT NULL, placed_by text NOT NULL)"
    ))
    .await;
    let policy = Policy::default()
        .lease(Duration::from_secs(5))
        .in_flight(InFlight::wait(Duration::from_secs(20)));
    let engine = Idempotency::builder(store.clone())
        .policy(policy)
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let id = RecordId::new(key.clone(), scope());
    let runs = Arc::new(AtomicUsize::new(0));
    let orders: Arc<str> = orders.into();
    let work = |placed_by| counted_insert(orders.clone(), key.clone(), runs.clone(), placed_by);

    proxy.arm(cut);
    let first = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), work("first"))
        .await;
    assert_eq!(proxy.cuts.load(Ordering::SeqCst), 1, "the COMMIT was cut");
    assert!(
        matches!(first, Err(Error::OutcomeUnknown { .. })),
        "{level:?} {cut:?}: a connection lost at COMMIT is an unknown outcome: {first:?}"
    );
    let holder = store.get(&id).await.unwrap().expect("the record").token;
    // The dropped lease writes nothing (the key is held until its lease passes). A COMMIT
    // that reached the server may still be applying when the client hears of the cut: the
    // record may only ever be Pending, then Completed, so wait for a Completed one when the
    // commit was sent (a commit that never arrived can never complete it, early or late).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let record = loop {
        let record = store
            .get(&id)
            .await
            .unwrap()
            .expect("the record is never lost");
        let applying = cut == CommitCut::AfterCommit && record.status == RecordStatus::Pending;
        if !applying || std::time::Instant::now() >= deadline {
            break record;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let placed = orders_for(&orders, &key).await;
    match cut {
        CommitCut::AfterCommit => assert!(
            record.status == RecordStatus::Completed && placed == vec!["first".to_owned()],
            "{level:?}: the commit applied: Completed with one order, never released; \
             record {record:?}, orders {placed:?}"
        ),
        CommitCut::InsteadOfCommit => assert!(
            record.status != RecordStatus::Completed && placed.is_empty(),
            "{level:?}: the commit never reached the server: nothing written, not \
             Completed; record {record:?}, orders {placed:?}"
        ),
    }
    assert_eq!(record.token, holder, "nobody else took the key");

    let retry = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), work("retry"))
        .await
        .expect("the retry");
    let placed = orders_for(&orders, &key).await;
    let runs = runs.load(Ordering::SeqCst);
    match cut {
        CommitCut::AfterCommit => {
            assert_eq!(retry, Answer::Replayed(Ok(holder.0)));
            assert_eq!((runs, placed), (1, vec!["first".to_owned()]));
        }
        CommitCut::InsteadOfCommit => {
            assert_eq!(retry, Answer::Executed(Ok(holder.next().0)));
            assert_eq!((runs, placed), (2, vec!["retry".to_owned()]));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_lost_at_commit() {
    // Each level and cut on its own proxy, schema and pool, side by side.
    let cuts = Isolation::ALL.into_iter().flat_map(|level| {
        [CommitCut::AfterCommit, CommitCut::InsteadOfCommit].map(move |cut| (level, cut))
    });
    common::side_by_side(cuts, |(level, cut)| commit_cut(level, cut)).await;
}

/// Work that counts its runs and inserts one order, returning its token.
fn counted_insert(
    orders: Arc<str>,
    key: IdempotencyKey,
    runs: Arc<AtomicUsize>,
    placed_by: &'static str,
) -> impl for<'c> FnMut(
    &'c mut PgConnection,
    idempotency_core::WorkContext,
) -> futures::future::BoxFuture<'c, Result<Result<u64, String>, sqlx::Error>>
       + Send {
    move |tx, ctx| {
        let (orders, key, runs) = (orders.clone(), key.clone(), runs.clone());
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(async move {
                insert_order(tx, &orders, &key, placed_by).await?;
                Ok::<u64, String>(ctx.token.0)
            }
            .await)
        })
    }
}

// ---------------------------------------------------------------------------------------------
// A constraint checked at COMMIT (a deferred unique key) refuses the commit: a definite
// rollback, so nothing of the work took effect and the key is released at once, the error
// returned; never "outcome unknown" with the key held until its lease passes.

/// A work that inserts `value` into `refs`.
fn insert_ref(
    refs: Arc<str>,
    value: &'static str,
) -> impl for<'c> FnMut(
    &'c mut PgConnection,
    idempotency_core::WorkContext,
) -> futures::future::BoxFuture<'c, Result<Result<(), String>, sqlx::Error>>
       + Send {
    move |tx, _ctx| {
        let refs = refs.clone();
        Box::pin(async move {
            sqlx::query(&format!("INSERT INTO {refs} (ref) VALUES ($1)"))
                .bind(value)
                .execute(tx)
                .await?;
            Ok(Ok(()))
        })
    }
}

async fn deferred_violation_at_commit(level: Isolation) {
    let (store, guard, _orders) = setup(level, 4).await;
    let refs = format!(r#""{}".refs"#, guard.schema);
    common::exec(&format!(
        "CREATE TABLE {refs} (ref text UNIQUE DEFERRABLE INITIALLY DEFERRED)"
    ))
    .await;
    common::exec(&format!("INSERT INTO {refs} (ref) VALUES ('taken')")).await;
    let engine = Idempotency::builder(store.clone())
        .policy(Policy::default())
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let refs: Arc<str> = refs.into();
    let insert = |value: &'static str| insert_ref(refs.clone(), value);
    let refused = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), insert("taken"))
        .await;
    match &refused {
        Err(e) if !matches!(e, Error::OutcomeUnknown { .. }) => {}
        other => panic!("{level:?}: a commit refused by a deferred constraint got {other:?}"),
    }
    let record = store
        .get(&RecordId::new(key.clone(), scope()))
        .await
        .unwrap()
        .expect("the record");
    assert_eq!(
        record.status,
        RecordStatus::Failed,
        "{level:?}: the key was not released after a definite rollback: {record:?}"
    );
    let retried = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), insert("free"))
        .await
        .expect("the retry runs");
    assert_eq!(retried, Answer::Executed(Ok(())), "{level:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_constraint_at_commit_releases_the_key() {
    for level in [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ] {
        deferred_violation_at_commit(level).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The work's own serialization failure (its UPDATE of a row a concurrent transaction changed
// after the transaction's snapshot) runs the whole transaction again, as a conflict in the
// completion or the commit does: it is never returned as the work's answer, and the effect
// lands once, computed from what the second run read.

/// A work that reads account 1's balance and writes it back less 10, returning the new
/// balance. On each of its first `conflicting` runs it says it has `read` and waits until
/// told it was `paid`.
fn pay_ten(
    accounts: Arc<str>,
    runs: Arc<AtomicUsize>,
    conflicting: usize,
    read: Arc<Notify>,
    paid: Arc<Notify>,
) -> impl for<'c> FnMut(
    &'c mut PgConnection,
    idempotency_core::WorkContext,
) -> futures::future::BoxFuture<'c, Result<Result<i64, String>, sqlx::Error>>
       + Send {
    move |tx, _ctx| {
        let (accounts, runs) = (accounts.clone(), runs.clone());
        let (read, paid) = (read.clone(), paid.clone());
        Box::pin(async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let select = format!("SELECT balance FROM {accounts} WHERE id = 1");
            let row = sqlx::query(&select).fetch_one(&mut *tx).await?;
            let balance: i64 = sqlx::Row::try_get(&row, 0)?;
            if run <= conflicting {
                // A concurrent payment commits between the work's read and its write.
                read.notify_one();
                paid.notified().await;
            }
            let write = format!("UPDATE {accounts} SET balance = $1 WHERE id = 1");
            sqlx::query(&write)
                .bind(balance - 10)
                .execute(&mut *tx)
                .await?;
            Ok(Ok(balance - 10))
        })
    }
}

/// A concurrent payment of 1 that commits between the work's read and its write, `times`
/// times: each time the work says it has `read`, the payer pays and says it was `paid`.
struct Payer {
    read: Arc<Notify>,
    paid: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

fn concurrent_payer(accounts: Arc<str>, times: usize) -> Payer {
    let (read, paid) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let task = {
        let (read, paid) = (read.clone(), paid.clone());
        tokio::spawn(async move {
            let mut conn = common::admin().await;
            let pay = format!("UPDATE {accounts} SET balance = balance - 1 WHERE id = 1");
            for _ in 0..times {
                read.notified().await;
                sqlx::query(&pay).execute(&mut conn).await.unwrap();
                paid.notify_one();
            }
        })
    };
    Payer { read, paid, task }
}

/// A table `accounts` in the store's schema, holding account 1 with a balance of 100.
async fn accounts(schema: &str) -> Arc<str> {
    let accounts: Arc<str> = format!(r#""{schema}".accounts"#).into();
    common::exec(&format!(
        "CREATE TABLE {accounts} (id int PRIMARY KEY, balance bigint NOT NULL)"
    ))
    .await;
    common::exec(&format!("INSERT INTO {accounts} VALUES (1, 100)")).await;
    accounts
}

async fn the_works_own_conflict(level: Isolation) {
    let (store, guard, _orders) = setup(level, 4).await;
    let accounts = accounts(&guard.schema).await;
    let engine = Idempotency::builder(store.clone())
        .policy(Policy::default())
        .build()
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let key = IdempotencyKey::random();
    let payer = concurrent_payer(accounts.clone(), 1);
    let work = pay_ten(accounts.clone(), runs.clone(), 1, payer.read, payer.paid);
    let outcome = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), work)
        .await
        .expect("the work's conflict is not an error of the call");
    payer.task.await.unwrap();
    assert_eq!(
        outcome,
        Answer::Executed(Ok(89)),
        "{level:?}: the work's serialization failure was not run again"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "{level:?}: runs of the work"
    );
    let mut conn = common::admin().await;
    let balance: i64 = sqlx::query_scalar(&format!("SELECT balance FROM {accounts} WHERE id = 1"))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(balance, 89, "{level:?}: both payments land, once each");
    let replay = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), |_tx, _ctx| {
            Box::pin(async { Ok(async move { Ok::<i64, String>(0) }.await) })
        })
        .await
        .unwrap();
    assert_eq!(replay, Answer::Replayed(Ok(89)), "{level:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_works_own_serialization_failure_runs_the_transaction_again() {
    // At READ COMMITTED the write reads the committed row and nothing fails to serialize.
    for level in [Isolation::RepeatableRead, Isolation::Serializable] {
        the_works_own_conflict(level).await;
    }
}

// Any other database error of the work's own statements (a unique key it breaks) ends the
// transaction without running it again: nothing committed, so the key is released, and the
// caller gets the driver's error as the source of `Error::Backend`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_works_own_database_error_releases_the_key_and_is_returned() {
    let (store, guard, _orders) = setup(Isolation::ReadCommitted, 4).await;
    let refs = format!(r#""{}".refs"#, guard.schema);
    common::exec(&format!("CREATE TABLE {refs} (ref text UNIQUE)")).await;
    common::exec(&format!("INSERT INTO {refs} (ref) VALUES ('taken')")).await;
    let engine = Idempotency::builder(store.clone())
        .policy(Policy::default())
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let refs: Arc<str> = refs.into();
    let error = engine
        .run_in_transaction(
            &key,
            &scope(),
            &fingerprint(),
            insert_ref(refs.clone(), "taken"),
        )
        .await
        .expect_err("a unique violation in the work is the call's error");
    let source = error.find_source::<sqlx::Error>();
    assert!(
        matches!(source, Some(sqlx::Error::Database(db)) if db.code().as_deref() == Some("23505")),
        "{error:?}"
    );
    let record = store
        .get(&RecordId::new(key.clone(), scope()))
        .await
        .unwrap()
        .expect("the record");
    assert_eq!(record.status, RecordStatus::Failed, "released: {record:?}");
    let retried = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), insert_ref(refs, "free"))
        .await
        .expect("the retry runs");
    assert_eq!(retried, Answer::Executed(Ok(())));
}

// A work that conflicts on every run: the transaction runs `MAX_TRANSACTION_ATTEMPTS` times,
// then the last conflict is the call's error (retryable), nothing of the work committed and
// the key is released for a later retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_that_conflicts_on_every_run_gives_up_and_releases_the_key() {
    let attempts = usize::try_from(idempotency_core::store::MAX_TRANSACTION_ATTEMPTS).unwrap();
    let (store, guard, _orders) = setup(Isolation::RepeatableRead, 4).await;
    let accounts = accounts(&guard.schema).await;
    let engine = Idempotency::builder(store.clone())
        .policy(Policy::default())
        .build()
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let key = IdempotencyKey::random();
    let payer = concurrent_payer(accounts.clone(), attempts);
    let work = pay_ten(
        accounts.clone(),
        runs.clone(),
        attempts,
        payer.read,
        payer.paid,
    );
    let error = engine
        .run_in_transaction(&key, &scope(), &fingerprint(), work)
        .await
        .expect_err("every run conflicted");
    payer.task.await.unwrap();
    assert!(
        matches!(error.find_source::<sqlx::Error>(), Some(sqlx::Error::Database(db))
            if db.code().as_deref() == Some("40001")),
        "{error:?}"
    );
    assert!(error.is_retryable(), "{error:?}");
    assert_eq!(runs.load(Ordering::SeqCst), attempts, "runs of the work");
    let mut conn = common::admin().await;
    let balance: i64 = sqlx::query_scalar(&format!("SELECT balance FROM {accounts} WHERE id = 1"))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let paid_by_others = i64::try_from(attempts).unwrap();
    assert_eq!(
        balance,
        100 - paid_by_others,
        "none of the work's runs committed"
    );
    let record = store
        .get(&RecordId::new(key.clone(), scope()))
        .await
        .unwrap()
        .expect("the record");
    assert_eq!(record.status, RecordStatus::Failed, "released: {record:?}");
}
