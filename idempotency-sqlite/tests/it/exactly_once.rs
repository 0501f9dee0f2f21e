//! Exactly-once effects with a real business table: the `orders` row and the completion
//! commit in one transaction, so a stale holder or a crashed one can never leave a second
//! order behind.
#![allow(clippy::unwrap_used)]

use crate::common;

use async_trait::async_trait;
use idempotency_core::protocol::Begin;
use idempotency_core::store::{
    Cas, Claim, ClaimRequest, Failure, ManualClock, Reclaim, Record, RecordStatus,
};
use idempotency_core::{
    Answer, Error, FencingToken, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore,
    Policy, RecordId, Refusal, Scope,
};
use idempotency_sqlite::rusqlite::{self, params, TransactionBehavior};
use idempotency_sqlite::{ConnectionMode, SqliteStore};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, Semaphore};

const LEASE: Duration = Duration::from_secs(10);

async fn shop(mode: ConnectionMode) -> (SqliteStore, ManualClock, tempfile::TempDir) {
    let (store, clock, dir) = common::manual_store(mode).await;
    store
        .call(|c| {
            // No unique constraint on the key: a duplicate order would be counted, not refused.
            c.execute_batch(
                "CREATE TABLE orders (
                     id        INTEGER PRIMARY KEY,
                     order_key TEXT NOT NULL,
                     placed_by TEXT NOT NULL,
                     amount    INTEGER NOT NULL
                 )",
            )
        })
        .await
        .unwrap()
        .unwrap();
    (store, clock, dir)
}

fn policy() -> Policy {
    // No heartbeat: the stalled holder must not keep its lease alive.
    Policy::default().lease(LEASE).heartbeat(None)
}

fn place_order(tx: &rusqlite::Transaction<'_>, key: &str, by: &str) -> Result<i64, String> {
    tx.execute(
        "INSERT INTO orders (order_key, placed_by, amount) VALUES (?1, ?2, 1999)",
        params![key, by],
    )
    .map_err(|e| e.to_string())?;
    Ok(tx.last_insert_rowid())
}

async fn orders_for(store: &SqliteStore, key: &str) -> Vec<(i64, String)> {
    let key = key.to_owned();
    store
        .call(move |c| {
            let mut s = c.prepare("SELECT id, placed_by FROM orders WHERE order_key = ?1")?;
            let rows = s.query_map([key], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })
        .await
        .unwrap()
        .unwrap()
}

fn scope() -> Scope {
    Scope::from_parts(["shop", "POST /orders"]).unwrap()
}

/// A store that stops after a successful claim until released: the holder's process stalls
/// (a GC pause, a swapped-out VM) right after taking the key.
#[derive(Debug)]
struct StallAfterClaim {
    inner: SqliteStore,
    claimed: Arc<Semaphore>,
    release: Arc<Notify>,
}

#[async_trait]
impl IdempotencyStore for StallAfterClaim {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        let claim = self.inner.claim(request).await?;
        if matches!(claim, Claim::Claimed { .. }) {
            // Register for the wake-up before announcing the claim, so it cannot be missed.
            let mut wake = std::pin::pin!(self.release.notified());
            wake.as_mut().enable();
            self.claimed.add_permits(1);
            wake.await;
        }
        Ok(claim)
    }
    async fn complete(
        &self,
        id: &RecordId,
        t: FencingToken,
        o: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        self.inner.complete(id, t, o, ttl).await
    }
    async fn fail(
        &self,
        id: &RecordId,
        t: FencingToken,
        f: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        self.inner.fail(id, t, f, ttl).await
    }
    async fn extend(&self, id: &RecordId, t: FencingToken, l: Duration) -> Result<Cas, Error> {
        self.inner.extend(id, t, l).await
    }
    async fn reclaim(
        &self,
        id: &RecordId,
        e: FencingToken,
        fp: &Fingerprint,
        l: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        self.inner.reclaim(id, e, fp, l, ttl).await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        self.inner.get(id).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        self.inner.purge_expired(batch).await
    }
}

/// Case 1, lease takeover, through `SqliteIdempotency::run_in_transaction`: 24 holders claim their keys and stall;
/// their leases pass; a second caller (another store on the same file, as another process
/// would be) reclaims and places each order; then the stalled holders wake up, write their
/// order in their transaction, and the completion CAS fails. Their transactions roll back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn case1_lease_takeover_rolls_back_the_stale_holder() {
    const KEYS: usize = 24;
    for mode in [
        ConnectionMode::DedicatedThread,
        ConnectionMode::BlockingPool { connections: 3 },
    ] {
        let (store_a, clock, dir) = shop(mode).await;
        let store_b = SqliteStore::builder(store_a.path())
            .clock(Arc::new(clock.clone()))
            .mode(mode)
            .open()
            .await
            .unwrap();
        let claimed = Arc::new(Semaphore::new(0));
        let release = Arc::new(Notify::new());
        let stalling = StallAfterClaim {
            inner: store_a.clone(),
            claimed: claimed.clone(),
            release: release.clone(),
        };
        let engine_a = Idempotency::new(Arc::new(stalling), policy()).unwrap();
        let engine_b = Idempotency::builder(store_b.clone())
            .policy(policy())
            .build()
            .unwrap();
        let keys: Vec<IdempotencyKey> = (0..KEYS).map(|_| IdempotencyKey::random()).collect();
        let fp = Fingerprint::from_json(&serde_json::json!({"sku": "A1", "qty": 1}));
        // Every holder claims before the clock moves: its token comes from this reading.
        let first = FencingToken::fresh(idempotency_core::store::Clock::now(&clock), None);

        let holders: Vec<_> = keys
            .iter()
            .cloned()
            .map(|key| {
                let (store, engine) = (store_a.clone(), engine_a.clone());
                tokio::spawn(async move {
                    let k = key.to_string();
                    // The engine's record calls go through the stalling decorator; its
                    // transactions are the store's own.
                    engine
                        .with_transactions(store.clone())
                        .run_in_transaction(&key, &scope(), &fp, move |tx, _ctx| {
                            let k = k.clone();
                            Box::pin(tx.run(move |tx| place_order(tx, &k, "stale holder")))
                        })
                        .await
                })
            })
            .collect();
        let all_claimed = claimed.acquire_many(KEYS as u32).await.unwrap();
        all_claimed.forget();
        // While the holders' leases are live, a retry is told to come back later.
        let err = engine_b
            .begin(&RecordId::new(keys[0].clone(), scope()), &fp)
            .await;
        assert!(
            matches!(err, Ok(Begin::Refused(Refusal::InProgress { .. }))),
            "{err:?}"
        );

        clock.advance(LEASE + Duration::from_millis(1));
        let takeovers: Vec<_> = keys
            .iter()
            .cloned()
            .map(|key| {
                let engine = engine_b.clone();
                tokio::spawn(async move {
                    let k = key.to_string();
                    engine
                        .run_in_transaction(&key, &scope(), &fp, move |tx, ctx| {
                            let k = k.clone();
                            Box::pin(tx.run(move |tx| {
                                assert_eq!(ctx.token, first.next(), "the takeover reclaims");
                                place_order(tx, &k, "new holder")
                            }))
                        })
                        .await
                })
            })
            .collect();
        let mut new_ids = Vec::new();
        for t in takeovers {
            match t.await.unwrap().unwrap() {
                Answer::Executed(Ok(id)) => new_ids.push(id),
                other => panic!("the takeover must run the work: {other:?}"),
            }
        }
        release.notify_waiters();
        for h in holders {
            let r = h.await.unwrap();
            assert!(
                matches!(
                    r,
                    Err(Error::LeaseLost { token }) if token == first
                ),
                "the stale holder must get LeaseLost: {r:?}"
            );
        }
        for (key, new_id) in keys.iter().zip(&new_ids) {
            let orders = orders_for(&store_a, key.as_str()).await;
            assert_eq!(
                orders,
                vec![(*new_id, "new holder".to_string())],
                "key {key}"
            );
            let rec = store_a
                .get(&RecordId::new(key.clone(), scope()))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(rec.status, RecordStatus::Completed);
            assert_eq!(rec.token, first.next());
            // A later retry replays the new holder's order id.
            let again = engine_b
                .run_in_transaction(key, &scope(), &fp, move |tx, _| {
                    Box::pin(tx.run(move |_| -> Result<i64, String> {
                        panic!("a completed key must not run again")
                    }))
                })
                .await
                .unwrap();
            assert_eq!(again, Answer::Replayed(Ok(*new_id)));
        }
        drop(dir);
    }
}

/// Case 1 with the low-level `complete_in`, in the caller's own transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case1_complete_in_refuses_a_stale_token_and_the_caller_rolls_back() {
    let (store, clock, _dir) = shop(ConnectionMode::DedicatedThread).await;
    let engine = Idempotency::builder(store.clone())
        .policy(policy())
        .build()
        .unwrap();
    for _ in 0..10 {
        let key = IdempotencyKey::random();
        let id = RecordId::new(key.clone(), scope());
        let fp = Fingerprint::from_bytes(b"order");
        let Begin::Execute(stale) = engine.begin(&id, &fp).await.unwrap() else {
            panic!("fresh key");
        };
        clock.advance(LEASE);
        let k = key.to_string();
        let fresh = engine
            .run_in_transaction(&key, &scope(), &fp, move |tx, _| {
                let k = k.clone();
                Box::pin(tx.run(move |tx| place_order(tx, &k, "new holder")))
            })
            .await
            .unwrap();
        assert!(matches!(fresh, Answer::Executed(Ok(_))));

        let (s, ctx, ttl, k) = (
            store.clone(),
            stale.context(),
            stale.retention(),
            key.to_string(),
        );
        let result = store
            .call(move |conn| -> Result<(), Error> {
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .unwrap();
                place_order(&tx, &k, "stale holder").unwrap();
                s.complete_in(&tx, &ctx.id, ctx.token, b"\"stale\"", ttl)?;
                tx.commit().unwrap();
                Ok(())
            })
            .await
            .unwrap();
        assert!(
            matches!(result, Err(Error::LeaseLost { token }) if token == stale.token()),
            "{result:?}"
        );
        stale.settled_externally();
        let orders = orders_for(&store, key.as_str()).await;
        assert_eq!(orders.len(), 1, "{orders:?}");
        assert_eq!(orders[0].1, "new holder");
    }
}

/// Case 2, crash before commit: the holder writes its order, then its transaction is dropped
/// without a commit and the holder vanishes without releasing the key (its lease is leaked,
/// as a crashed process would leave it). The retry is refused while the lease lives, then
/// reclaims and runs: exactly one order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case2_crash_before_commit_lets_the_retry_run_once() {
    for mode in [
        ConnectionMode::DedicatedThread,
        ConnectionMode::BlockingPool { connections: 2 },
    ] {
        let (store, clock, _dir) = shop(mode).await;
        let engine = Idempotency::builder(store.clone())
            .policy(policy())
            .build()
            .unwrap();
        for _ in 0..10 {
            let key = IdempotencyKey::random();
            let id = RecordId::new(key.clone(), scope());
            let fp = Fingerprint::from_bytes(b"order");
            let Begin::Execute(lease) = engine.begin(&id, &fp).await.unwrap() else {
                panic!("fresh key");
            };
            let first = lease.token();
            let k = key.to_string();
            let wrote = store
                .call(move |conn| {
                    let tx = conn
                        .transaction_with_behavior(TransactionBehavior::Immediate)
                        .unwrap();
                    let id = place_order(&tx, &k, "crashed holder").unwrap();
                    drop(tx); // the crash: no commit
                    id
                })
                .await
                .unwrap();
            assert!(wrote > 0);
            std::mem::forget(lease); // the crashed holder never settles or releases

            assert!(orders_for(&store, key.as_str()).await.is_empty());
            let early =
                engine
                    .run_in_transaction(&key, &scope(), &fp, move |tx, _| {
                        Box::pin(tx.run(move |_| -> Result<i64, String> {
                            panic!("the lease is still live")
                        }))
                    })
                    .await;
            assert!(
                matches!(early, Ok(Answer::Refused(Refusal::InProgress { .. }))),
                "{early:?}"
            );

            clock.advance(LEASE);
            let k = key.to_string();
            let retry = engine
                .run_in_transaction(&key, &scope(), &fp, move |tx, ctx| {
                    let k = k.clone();
                    Box::pin(tx.run(move |tx| {
                        assert_eq!(ctx.token, first.next());
                        place_order(tx, &k, "retry")
                    }))
                })
                .await
                .unwrap();
            let Answer::Executed(Ok(order_id)) = retry else {
                panic!("the retry must run: {retry:?}");
            };
            assert_eq!(
                orders_for(&store, key.as_str()).await,
                vec![(order_id, "retry".to_string())]
            );
            let rec = store.get(&id).await.unwrap().unwrap();
            assert_eq!((rec.status, rec.attempts), (RecordStatus::Completed, 2));
        }
    }
}

/// Case 2 when the work itself dies mid-transaction (a panic after the business write): the
/// transaction unwinds and rolls back, the lease is released at once, and the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case2_panic_after_the_business_write_rolls_back_and_releases_the_key() {
    let (store, _clock, _dir) = shop(ConnectionMode::DedicatedThread).await;
    let engine = Idempotency::builder(store.clone())
        .policy(policy())
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let fp = Fingerprint::from_bytes(b"order");
    let (e, k) = (engine.clone(), key.clone());
    let crashed = tokio::spawn(async move {
        let kk = k.to_string();
        e.run_in_transaction(&k, &scope(), &fp, move |tx, _| {
            let kk = kk.clone();
            Box::pin(tx.run(move |tx| -> Result<i64, String> {
                place_order(tx, &kk, "panicking holder").unwrap();
                panic!("the holder dies after its business write");
            }))
        })
        .await
    })
    .await;
    assert!(crashed.unwrap_err().is_panic());
    assert!(orders_for(&store, key.as_str()).await.is_empty());
    // The panic was caught, the transaction rolled back, and the key released.
    let id = RecordId::new(key.clone(), scope());
    let mut released = false;
    for _ in 0..200 {
        if store.get(&id).await.unwrap().unwrap().status == RecordStatus::Failed {
            released = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(released, "the abandoned key must be released");
    let k = key.to_string();
    let retry = engine
        .run_in_transaction(&key, &scope(), &fp, move |tx, _| {
            let k = k.clone();
            Box::pin(tx.run(move |tx| place_order(tx, &k, "retry")))
        })
        .await
        .unwrap();
    assert!(matches!(retry, Answer::Executed(Ok(_))));
    assert_eq!(orders_for(&store, key.as_str()).await.len(), 1);
}

/// A work error rolls back its writes and releases the key (the default policy); the next
/// attempt runs and its order is the only one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_error_rolls_back_and_releases_the_key() {
    let (store, _clock, _dir) = shop(ConnectionMode::DedicatedThread).await;
    let engine = Idempotency::builder(store.clone())
        .policy(policy())
        .build()
        .unwrap();
    let key = IdempotencyKey::random();
    let fp = Fingerprint::from_bytes(b"order");
    let k = key.to_string();
    let first = engine
        .run_in_transaction(&key, &scope(), &fp, move |tx, _| {
            let k = k.clone();
            Box::pin(tx.run(move |tx| -> Result<i64, String> {
                place_order(tx, &k, "declined").unwrap();
                Err("card declined".to_string())
            }))
        })
        .await
        .unwrap();
    assert_eq!(first, Answer::Executed(Err("card declined".to_string())));
    assert!(orders_for(&store, key.as_str()).await.is_empty());
    let rec = store
        .get(&RecordId::new(key.clone(), scope()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.status, RecordStatus::Failed);
    let k = key.to_string();
    let second = engine
        .run_in_transaction(&key, &scope(), &fp, move |tx, _| {
            let k = k.clone();
            Box::pin(tx.run(move |tx| place_order(tx, &k, "accepted")))
        })
        .await
        .unwrap();
    assert!(matches!(second, Answer::Executed(Ok(_))));
    assert_eq!(orders_for(&store, key.as_str()).await.len(), 1);
}

/// A caller cancelled while its work runs (a timeout, a client gone): the transaction the
/// work wrote in rolls back once the work returns, the connection is free for every other
/// caller (on the dedicated thread and in the blocking pool alike), the key is held until its
/// lease passes (the work may have acted), and then a retry places the only order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_rolls_back_and_frees_the_connection() {
    for mode in [
        ConnectionMode::DedicatedThread,
        ConnectionMode::BlockingPool { connections: 2 },
    ] {
        let (store, clock, _dir) = shop(mode).await;
        let engine = Idempotency::builder(store.clone())
            .policy(policy())
            .build()
            .unwrap();
        let exactly_once = engine;
        let key = IdempotencyKey::random();
        let fp = Fingerprint::from_bytes(b"order");
        let (wrote, written) = std::sync::mpsc::channel::<()>();
        let (go_on, may_go_on) = std::sync::mpsc::channel::<()>();
        let call = {
            let (exactly_once, key, fp, k) =
                (exactly_once.clone(), key.clone(), fp, key.to_string());
            tokio::spawn(async move {
                let mut once = Some((k, wrote, may_go_on));
                exactly_once
                    .run_in_transaction(&key, &scope(), &fp, move |tx, _| {
                        let (k, wrote, may_go_on) = once.take().expect("SQLite runs the work once");
                        Box::pin(tx.run(move |tx| {
                            let id = place_order(tx, &k, "cancelled");
                            wrote.send(()).unwrap();
                            // Returns only once its caller is gone.
                            let _ = may_go_on.recv_timeout(Duration::from_secs(30));
                            id
                        }))
                    })
                    .await
            })
        };
        tokio::task::spawn_blocking(move || written.recv_timeout(Duration::from_secs(30)))
            .await
            .unwrap()
            .expect("the work ran");
        call.abort();
        assert!(call.await.unwrap_err().is_cancelled());
        go_on.send(()).unwrap();
        // The connection is free again and nothing of the cancelled work committed.
        let other = IdempotencyKey::random();
        let o = other.to_string();
        let placed = tokio::time::timeout(
            Duration::from_secs(30),
            exactly_once.run_in_transaction(&other, &scope(), &fp, move |tx, _| {
                let o = o.clone();
                Box::pin(tx.run(move |tx| place_order(tx, &o, "other")))
            }),
        )
        .await
        .expect("the connection must not stay with the cancelled transaction")
        .unwrap();
        assert!(matches!(placed, Answer::Executed(Ok(_))), "{placed:?}");
        assert!(orders_for(&store, key.as_str()).await.is_empty());
        // Held until the lease passes, then run once.
        let k = key.to_string();
        let early = exactly_once
            .run_in_transaction(&key, &scope(), &fp, move |tx, _| {
                let k = k.clone();
                Box::pin(tx.run(move |tx| place_order(tx, &k, "early")))
            })
            .await;
        assert!(
            matches!(early, Ok(Answer::Refused(Refusal::InProgress { .. }))),
            "{early:?}"
        );
        clock.advance(LEASE + Duration::from_millis(1));
        let k = key.to_string();
        let retry = exactly_once
            .run_in_transaction(&key, &scope(), &fp, move |tx, _| {
                let k = k.clone();
                Box::pin(tx.run(move |tx| place_order(tx, &k, "retry")))
            })
            .await
            .unwrap();
        assert!(matches!(retry, Answer::Executed(Ok(_))), "{retry:?}");
        let orders = orders_for(&store, key.as_str()).await;
        assert_eq!(orders.len(), 1, "{orders:?}");
        assert_eq!(orders[0].1, "retry");
    }
}

/// A transaction the caller holds (`begin_transaction`): duplicates in flight queue behind it
/// or are told the key is in progress, then replay its answer; one order per key. Dropped after
/// its insert, it rolls back and the key is released: the next caller places the only order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_transaction_commits_once_and_a_dropped_one_leaves_nothing() {
    use idempotency_core::transaction::Started;
    for mode in [
        ConnectionMode::DedicatedThread,
        ConnectionMode::BlockingPool { connections: 3 },
    ] {
        let (store, _clock, _dir) = shop(mode).await;
        let engine = Idempotency::builder(store.clone())
            .policy(policy())
            .build()
            .unwrap();
        let place = |key: IdempotencyKey, by: String| {
            let engine = engine.clone();
            async move {
                let started = std::time::Instant::now();
                loop {
                    assert!(started.elapsed() < Duration::from_secs(60), "no answer");
                    let fp = Fingerprint::from_bytes(b"order");
                    match engine
                        .begin_transaction::<i64, String>(&key, &scope(), &fp)
                        .await
                        .unwrap()
                    {
                        Started::Begun(mut tx) => {
                            let k = key.to_string();
                            let id = tx.run(move |t| place_order(t, &k, &by)).await.unwrap();
                            return tx.commit(id.unwrap()).await.unwrap();
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
        for _ in 0..4 {
            let key = IdempotencyKey::random();
            let callers: Vec<_> = (0..6)
                .map(|i| tokio::spawn(place(key.clone(), format!("c{i}"))))
                .collect();
            let mut answers = Vec::new();
            for caller in callers {
                answers.push(caller.await.unwrap());
            }
            let placed = orders_for(&store, key.as_str()).await;
            assert_eq!(placed.len(), 1, "{mode:?}: one order per key: {placed:?}");
            assert!(answers.iter().all(|id| *id == placed[0].0), "{answers:?}");
        }

        let key = IdempotencyKey::random();
        let fp = Fingerprint::from_bytes(b"order");
        let Started::Begun(mut tx) = engine
            .begin_transaction::<i64, String>(&key, &scope(), &fp)
            .await
            .unwrap()
        else {
            panic!("a new key begins");
        };
        let k = key.to_string();
        tx.run(move |t| place_order(t, &k, "dropped"))
            .await
            .unwrap()
            .unwrap();
        drop(tx);
        let id = place(key.clone(), "retry".into()).await;
        assert_eq!(
            orders_for(&store, key.as_str()).await,
            [(id, "retry".to_owned())],
            "{mode:?}"
        );
    }
}
