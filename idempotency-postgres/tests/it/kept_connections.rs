//! The connections a store keeps between operations (`keep_connections(true)`, on its own
//! pool or on one passed in): they never starve the pool's other users, never hold up
//! `pool.close()`, and a connection that was cancelled mid-statement or lost its backend is
//! never used again.
#![allow(clippy::unwrap_used)]

use crate::common;
use idempotency_core::Idempotency;

use futures::future::join_all;
use idempotency_core::store::{Claim, ClaimRequest, RecordStatus};
use idempotency_core::{Fingerprint, IdempotencyKey, IdempotencyStore, RecordId, Scope};
use idempotency_postgres::sqlx::{self, Connection};
use idempotency_postgres::PostgresStore;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn request(key: &IdempotencyKey, fingerprint: &[u8]) -> ClaimRequest {
    ClaimRequest::new(
        RecordId::new(key.clone(), Scope::new("kept").unwrap()),
        Fingerprint::from_bytes(fingerprint),
        Duration::from_secs(60),
        Duration::from_secs(3600),
    )
}

/// A name of this test's own, to find (and kill) only its sessions in `pg_stat_activity`.
fn app_name(what: &str) -> String {
    format!("idem_kept_{what}_{}", uuid::Uuid::new_v4().simple())
}

/// A completed record for a fresh key.
async fn completed(store: &PostgresStore) -> ClaimRequest {
    let req = request(&IdempotencyKey::random(), b"done");
    let Claim::Claimed { token, .. } = store.claim(&req).await.unwrap() else {
        panic!("a fresh key is claimed")
    };
    store
        .complete(&req.id, token, b"outcome", req.ttl)
        .await
        .unwrap();
    req
}

/// `n` concurrent replays of `req`, all of which must succeed.
async fn burst(store: &PostgresStore, req: &ClaimRequest, n: usize) {
    let all = join_all((0..n).map(|_| store.claim(req))).await;
    for got in all {
        assert!(matches!(got.unwrap(), Claim::Existing { .. }));
    }
}

/// The sessions of `application_name`, as the server sees them.
async fn sessions(application_name: &str) -> Vec<i32> {
    let mut admin = common::admin().await;
    sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
        .bind(application_name)
        .fetch_all(&mut admin)
        .await
        .unwrap()
}

/// After a burst, a pool of two can hand both its connections to someone else at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_leaves_the_pool_to_its_other_users() {
    let (store, _guard) = common::own_store(2, Duration::from_secs(2), &app_name("idle")).await;
    let req = completed(&store).await;
    // 200 operations queued on two connections: each connection a kept one is handed to the
    // next operation at once (were it parked until reaped, this would take 10 s).
    let started = Instant::now();
    burst(&store, &req, 200).await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "the burst took {took:?}");
    let started = Instant::now();
    let a = store.pool().acquire().await.expect("first connection");
    let b = store
        .pool()
        .acquire()
        .await
        .expect("second connection, both held");
    let waited = started.elapsed();
    drop((a, b));
    assert!(waited < Duration::from_secs(2), "waited {waited:?}");
    // And the store still works afterwards.
    burst(&store, &req, 8).await;
}

/// While the store is kept busy on a pool of two, someone else still gets both connections:
/// the store hands back what it keeps when others hold connections, or every 100 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_store_does_not_starve_the_pools_other_users() {
    let (store, _guard) = common::own_store(2, Duration::from_secs(5), &app_name("busy")).await;
    let req = completed(&store).await;
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let load: Vec<_> = (0..4)
        .map(|_| {
            let (store, req, stop, done) = (store.clone(), req.clone(), stop.clone(), done.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    assert!(matches!(
                        store.claim(&req).await.unwrap(),
                        Claim::Existing { .. }
                    ));
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Let the store take both connections.
    while done.load(Ordering::Relaxed) < 200 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for round in 0..5 {
        let started = Instant::now();
        let both = tokio::time::timeout(Duration::from_secs(2), async {
            let a = store.pool().acquire().await.unwrap();
            let b = store.pool().acquire().await.unwrap();
            (a, b)
        })
        .await;
        let waited = started.elapsed();
        let both = both.unwrap_or_else(|_| panic!("round {round}: starved for 2 s"));
        // Hold them a little while the store's operations wait, then give them back.
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(both);
        eprintln!("round {round}: both connections after {waited:?}");
        let before = done.load(Ordering::Relaxed);
        while done.load(Ordering::Relaxed) < before + 100 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.unwrap();
    }
}

/// `pool.close()` right after a burst does not wait for the connections the store keeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_pool_after_a_burst_returns_at_once() {
    let (store, _guard) = common::own_store(4, Duration::from_secs(2), &app_name("close")).await;
    let req = completed(&store).await;
    // A burst leaves connections kept (the store's `Debug` shows how many), so the close
    // below has something to wait for. The store hands a connection back once it has been
    // unused for 100 ms: a machine stalled that long between the burst and the look finds
    // none kept, so burst again until one is (at most 20 bursts).
    let mut bursts = 0;
    let shown = loop {
        burst(&store, &req, 64).await;
        bursts += 1;
        let shown = format!("{store:?}");
        let kept = shown.contains("Kept { kept: ") && !shown.contains("Kept { kept: 0");
        if kept || bursts == 20 {
            break shown;
        }
    };
    assert!(
        shown.contains("Kept { kept: ") && !shown.contains("Kept { kept: 0"),
        "nothing kept after {bursts} bursts: {shown}"
    );
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(2), store.pool().close())
        .await
        .expect("pool.close() returns");
    let took = started.elapsed();
    eprintln!("pool.close() took {took:?}");
    // The store hands its connections back at once (not only after 100 ms unused).
    assert!(
        took < Duration::from_millis(80),
        "pool.close() took {took:?}"
    );
    let after = tokio::time::timeout(Duration::from_secs(2), store.get(&req.id))
        .await
        .expect("an operation on a closed pool fails at once");
    assert!(after.is_err(), "{after:?}");
}

/// Operations cancelled while their statement waits on a row lock leave nothing behind: the
/// store keeps answering each key with its own record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_operations_leave_no_half_used_connection() {
    let (store, _guard) = common::own_store(4, Duration::from_secs(5), &app_name("cancel")).await;
    let locked = completed(&store).await;
    let table = store.table_name().qualified();

    // The lock a store statement takes for a moment (a holder's `FOR UPDATE` is not waited
    // for at all).
    let lock_sql = format!("SELECT 1 FROM {table} WHERE scope = $1 AND key = $2 FOR NO KEY UPDATE");
    let mut locker = common::admin().await;
    let mut cancelled = 0;
    for i in 0..60u64 {
        // Another session locks the record, so a counted replay (an UPDATE of that row)
        // waits; the lock is released after each cancellation, or the pool's release ping of
        // the cancelled statement's connection (which waits for its answer) would hold every
        // connection of the pool.
        let mut lock = locker.begin().await.unwrap();
        sqlx::query(&lock_sql)
            .bind(locked.id.scope.as_str())
            .bind(locked.id.key.as_str())
            .fetch_one(&mut *lock)
            .await
            .unwrap();
        // Deadlines from 0 to 3 ms: dropped before sending, while waiting for the lock…
        let deadline = Duration::from_micros((i % 7) * 500);
        let timed_out = tokio::time::timeout(deadline, store.claim(&locked))
            .await
            .is_err();
        cancelled += usize::from(timed_out);
        lock.rollback().await.unwrap();
        // …interleaved with operations that complete, so connections get kept.
        let other = request(&IdempotencyKey::random(), format!("fp-{i}").as_bytes());
        let Claim::Claimed { .. } = store.claim(&other).await.unwrap() else {
            panic!("a fresh key is claimed")
        };
    }
    assert_eq!(
        cancelled, 60,
        "every operation on the locked row was cancelled"
    );

    // Every answer is the asked key's own: a connection left mid-statement would hand an
    // operation the previous statement's row (another fingerprint, another status).
    let answers = join_all((0..200).map(|i| {
        let store = store.clone();
        let locked = locked.clone();
        async move {
            if i % 2 == 0 {
                let got = store.claim(&locked).await.unwrap();
                let Claim::Existing { record, .. } = got else {
                    panic!("the completed key replays: {got:?}")
                };
                assert_eq!(record.status, RecordStatus::Completed);
                assert_eq!(record.fingerprint, locked.fingerprint);
                assert_eq!(record.outcome.as_deref(), Some(&b"outcome"[..]));
            } else {
                let fp = format!("fresh-{i}");
                let fresh = request(&IdempotencyKey::random(), fp.as_bytes());
                let Claim::Claimed { token, .. } = store.claim(&fresh).await.unwrap() else {
                    panic!("a fresh key is claimed")
                };
                let record = store.get(&fresh.id).await.unwrap().expect("just claimed");
                assert_eq!(record.fingerprint, fresh.fingerprint);
                assert_eq!(record.token, token);
                assert_eq!(record.status, RecordStatus::Pending);
            }
        }
    }))
    .await;
    assert_eq!(answers.len(), 200);
}

/// Connections whose backends were terminated while the store kept them are dropped on their
/// first error, never kept again: after at most one failure per connection, every operation
/// succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_backend_was_killed_is_not_used_again() {
    let name = app_name("kill");
    let (store, _guard) = common::own_store(4, Duration::from_secs(5), &name).await;
    let req = completed(&store).await;
    for round in 0..3 {
        burst(&store, &req, 32).await;
        let pids = sessions(&name).await;
        assert!(!pids.is_empty(), "the store's sessions are visible");
        let mut admin = common::admin().await;
        let killed: Vec<bool> =
            sqlx::query_scalar("SELECT pg_terminate_backend(pid) FROM unnest($1::int4[]) pid")
                .bind(&pids)
                .fetch_all(&mut admin)
                .await
                .unwrap();
        assert!(killed.iter().any(|k| *k), "{killed:?}");
        // At most one failure per killed connection, then only successes.
        let mut failures = 0;
        let mut streak = 0;
        for _ in 0..(pids.len() + 20) {
            match store.get(&req.id).await {
                Ok(Some(record)) => {
                    assert_eq!(record.status, RecordStatus::Completed);
                    streak += 1;
                }
                Ok(None) => panic!("the record is there"),
                Err(e) => {
                    failures += 1;
                    streak = 0;
                    eprintln!("round {round}: {e}");
                }
            }
        }
        assert!(
            failures <= pids.len(),
            "round {round}: {failures} failures for {} killed connections",
            pids.len()
        );
        assert!(
            streak >= 20,
            "round {round}: only {streak} successes in a row"
        );
        // Concurrent operations spread over every connection succeed too.
        burst(&store, &req, 32).await;
    }
}

/// `PostgresIdempotency` on a store that keeps connections, with a pool of two and more concurrent
/// transactions than connections: each claim's kept connection is handed to a waiting
/// `BEGIN` instead of holding it up until the store gives it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_get_connections_the_store_keeps() {
    use idempotency_core::Policy;
    let (store, guard) = common::own_store(2, Duration::from_secs(2), &app_name("tx")).await;
    let orders = format!(r#""{}".orders"#, guard.schema);
    common::exec(&format!("CREATE TABLE {orders} (id bigserial PRIMARY KEY)")).await;
    let insert: Arc<str> = format!("INSERT INTO {orders} DEFAULT VALUES").into();
    let engine = Idempotency::builder(store.clone())
        .policy(Policy::default().heartbeat(None))
        .build()
        .unwrap();
    let scope = Scope::new("kept").unwrap();
    let fp = Fingerprint::from_bytes(b"tx");
    // A BEGIN left waiting for a kept connection until the store hands it back unused (100 ms)
    // shows in every round; without, a round takes some 20 ms, but a loaded machine can slow
    // any few rounds past 90 ms: rounds go on (at least 5, at most 60) until one is fast.
    let mut fastest = Duration::MAX;
    let mut round = 0;
    while round < 5 || (fastest >= Duration::from_millis(90) && round < 60) {
        round += 1;
        let started = Instant::now();
        let runs = join_all((0..16).map(|_| {
            let (engine, insert, scope, fp) = (&engine, insert.clone(), &scope, &fp);
            async move {
                let key = IdempotencyKey::random();
                engine
                    .run_in_transaction(&key, scope, fp, move |tx, _ctx| {
                        let insert = insert.clone();
                        Box::pin(async move {
                            Ok(async move {
                                sqlx::query(&insert)
                                    .execute(&mut *tx)
                                    .await
                                    .map_err(|e| e.to_string())?;
                                Ok::<_, String>(1)
                            }
                            .await)
                        })
                    })
                    .await
            }
        }))
        .await;
        let took = started.elapsed();
        for run in runs {
            assert!(matches!(run.unwrap().into_result().unwrap(), Ok(1)));
        }
        eprintln!("round {round}: 16 transactions on 2 connections in {took:?}");
        fastest = fastest.min(took);
    }
    assert!(
        fastest < Duration::from_millis(90),
        "the fastest of {round} rounds took {fastest:?}"
    );
    let placed: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {orders}"))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(placed, 16 * i64::from(round), "one order per transaction");
}
