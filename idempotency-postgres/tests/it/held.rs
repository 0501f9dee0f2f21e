//! A transaction the caller holds (`Idempotency::begin_transaction`): its rows and the key's
//! completion commit together, at every isolation level; duplicates run nothing twice;
//! dropped, refused or past its lease, nothing of it stays and the key is a retry's.
#![allow(clippy::unwrap_used)]

use crate::common::Isolation;
use crate::exactly_once::{fingerprint, orders_for, scope, setup};
use idempotency_core::transaction::Started;
use idempotency_core::{Error, Idempotency, IdempotencyKey, Refusal};
use idempotency_postgres::sqlx::{self, PgConnection};
use idempotency_postgres::PostgresIdempotency;
use std::time::{Duration, Instant};

async fn insert(
    conn: &mut PgConnection,
    orders: &str,
    key: &IdempotencyKey,
    by: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO {orders} (ref, placed_by) VALUES ($1, $2)"
    ))
    .bind(key.as_str())
    .bind(by)
    .execute(conn)
    .await
    .map(|_| ())
}

/// One caller: begins until it gets an answer (a key in progress is asked again, within a
/// generous bound), writes its order and commits; what it was answered.
async fn place(
    engine: &PostgresIdempotency,
    orders: &str,
    key: &IdempotencyKey,
    by: &str,
) -> Result<String, String> {
    let started = Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no answer in 60 s"
        );
        match engine
            .begin_transaction::<String, String>(key, &scope(), &fingerprint())
            .await
        {
            Ok(Started::Begun(mut tx)) => {
                if let Err(e) = insert(&mut tx, orders, key, by).await {
                    // A serialization failure: roll back (releasing the key) and start over.
                    tx.rollback().await;
                    assert!(engine.is_conflict(&idempotency_postgres::database_error(e)));
                    continue;
                }
                match tx.commit(by.to_owned()).await {
                    Ok(by) => return Ok(by),
                    Err(e) if engine.is_conflict(&e) => continue,
                    Err(e) => panic!("commit: {e}"),
                }
            }
            Ok(Started::Replayed(answer)) => return answer,
            Ok(Started::Refused(Refusal::InProgress { .. })) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(Started::Refused(other)) => panic!("refused: {other}"),
            Err(e) => panic!("begin: {e}"),
        }
    }
}

async fn duplicates_commit_one_order(level: Isolation) {
    let (store, _guard, orders) = setup(level, 24).await;
    let engine = Idempotency::builder(store).build().unwrap();
    for _ in 0..6 {
        let key = IdempotencyKey::random();
        let callers: Vec<_> = (0..8)
            .map(|i| {
                let (engine, orders, key) = (engine.clone(), orders.clone(), key.clone());
                tokio::spawn(async move { place(&engine, &orders, &key, &format!("c{i}")).await })
            })
            .collect();
        let mut answers = Vec::new();
        for caller in callers {
            answers.push(caller.await.unwrap().unwrap());
        }
        let placed = orders_for(&orders, &key).await;
        assert_eq!(placed.len(), 1, "one order per key: {placed:?}");
        assert!(
            answers.iter().all(|a| *a == placed[0]),
            "every caller gets the committed order's answer: {answers:?} vs {placed:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_duplicates_commit_one_order_read_committed() {
    duplicates_commit_one_order(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_duplicates_commit_one_order_repeatable_read() {
    duplicates_commit_one_order(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_duplicates_commit_one_order_serializable() {
    duplicates_commit_one_order(Isolation::Serializable).await;
}

/// Dropped after its insert (a `?`, an early return), refused, or rolled back: nothing of it
/// stays, the key is released, and the next caller's order is the only one.
async fn ended_without_commit(level: Isolation) {
    let (store, _guard, orders) = setup(level, 24).await;
    let engine = Idempotency::builder(store).build().unwrap();
    for end in ["drop", "refuse", "rollback"] {
        let key = IdempotencyKey::random();
        let Started::Begun(mut tx) = engine
            .begin_transaction::<String, String>(&key, &scope(), &fingerprint())
            .await
            .unwrap()
        else {
            panic!("a new key begins");
        };
        insert(&mut tx, &orders, &key, end).await.unwrap();
        match end {
            "drop" => drop(tx),
            "refuse" => assert_eq!(
                tx.refuse("out of stock".into()).await.unwrap(),
                "out of stock"
            ),
            _ => tx.rollback().await,
        }
        // A drop releases the key from a task of its own: a caller meanwhile is told the key
        // is in progress and asks again.
        assert_eq!(
            place(&engine, &orders, &key, "retry").await.unwrap(),
            "retry"
        );
        assert_eq!(orders_for(&orders, &key).await, ["retry"], "after a {end}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_ended_without_commit_read_committed() {
    ended_without_commit(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_ended_without_commit_repeatable_read() {
    ended_without_commit(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_ended_without_commit_serializable() {
    ended_without_commit(Isolation::Serializable).await;
}

/// Held past its lease with the heartbeat off. At READ COMMITTED nothing holds the record
/// meanwhile: a retry takes the key over and places its order, and the stalled holder's
/// commit is then fenced (`LeaseLost`), its order rolled back. At REPEATABLE READ and
/// SERIALIZABLE the transaction holds the record locked (a retry is told the key is in
/// progress) and keeps the lease in the process: once that passes, the commit is refused
/// (`LeaseLost`), everything rolls back, and a retry then places the order. One order either
/// way, the retry's.
async fn past_its_lease(level: Isolation) {
    let (store, _guard, orders) = setup(level, 24).await;
    let lease = Duration::from_millis(300);
    // The stalled holder's engine; the retries use one with the default lease.
    let stalling = Idempotency::builder(store.clone())
        .lease(lease)
        .heartbeat(None)
        .build()
        .unwrap();
    let engine = Idempotency::builder(store).build().unwrap();
    // A begin that found its claim's lease already passed (the machine stalled between the
    // claim and the transaction's lock) is told so; another key then tries again.
    let started = Instant::now();
    let (key, mut tx) = loop {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no begin in 60 s"
        );
        let key = IdempotencyKey::random();
        match stalling
            .begin_transaction::<String, String>(&key, &scope(), &fingerprint())
            .await
        {
            Ok(Started::Begun(tx)) => break (key, tx),
            Err(Error::LeaseLost { .. }) => continue,
            other => panic!("a new key begins: {other:?}"),
        }
    };
    insert(&mut tx, &orders, &key, "stalled").await.unwrap();
    // No renewal reaches the record or the process: the lease has passed after this, on the
    // server's clock and the process's.
    tokio::time::sleep(lease * 3).await;
    if level == Isolation::ReadCommitted {
        assert_eq!(
            place(&engine, &orders, &key, "retry").await.unwrap(),
            "retry"
        );
    }
    match tx.commit("stalled".into()).await {
        Err(Error::LeaseLost { .. }) => {}
        other => panic!("a commit past its lease is fenced: {other:?}"),
    }
    assert_eq!(
        place(&engine, &orders, &key, "retry").await.unwrap(),
        "retry"
    );
    assert_eq!(orders_for(&orders, &key).await, ["retry"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_past_its_lease_read_committed() {
    past_its_lease(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_past_its_lease_repeatable_read() {
    past_its_lease(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_past_its_lease_serializable() {
    past_its_lease(Isolation::Serializable).await;
}

/// Held for several leases with the heartbeat on: the lease is kept (from another connection,
/// or in the process where the record is locked), a duplicate is told the key is in progress
/// all along, and the commit goes through.
async fn kept_alive(level: Isolation) {
    let (store, _guard, orders) = setup(level, 24).await;
    let lease = Duration::from_millis(900);
    let engine = Idempotency::builder(store).lease(lease).build().unwrap();
    let key = IdempotencyKey::random();
    let Started::Begun(mut tx) = engine
        .begin_transaction::<String, String>(&key, &scope(), &fingerprint())
        .await
        .unwrap()
    else {
        panic!("a new key begins");
    };
    insert(&mut tx, &orders, &key, "holder").await.unwrap();
    let held_since = Instant::now();
    while held_since.elapsed() < lease * 3 {
        tokio::time::sleep(lease / 3).await;
        let duplicate = engine
            .begin_transaction::<String, String>(&key, &scope(), &fingerprint())
            .await
            .unwrap();
        assert!(
            matches!(duplicate, Started::Refused(Refusal::InProgress { .. })),
            "{level:?}: a duplicate of a held key is told it is in progress: {duplicate:?}"
        );
    }
    assert_eq!(tx.commit("holder".into()).await.unwrap(), "holder");
    assert_eq!(orders_for(&orders, &key).await, ["holder"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_kept_alive_read_committed() {
    kept_alive(Isolation::ReadCommitted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_kept_alive_repeatable_read() {
    kept_alive(Isolation::RepeatableRead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_kept_alive_serializable() {
    kept_alive(Isolation::Serializable).await;
}
