//! Engine behaviour that needs real time: the lease heartbeat.
#![allow(clippy::unwrap_used)]

use idempotency_core::{Error, Fingerprint, Idempotency, IdempotencyKey, Policy, Scope};
use idempotency_memory::MemoryStore;
use std::sync::Arc;
use std::time::Duration;

fn engine(heartbeat: Option<f64>) -> Idempotency {
    let policy = Policy::default()
        .lease(Duration::from_millis(300))
        .heartbeat(heartbeat);
    Idempotency::new(Arc::new(MemoryStore::new()), policy).unwrap()
}

async fn slow_then_duplicate(engine: Idempotency) -> (Result<bool, Error>, Result<bool, Error>) {
    let key = IdempotencyKey::random();
    let scope = Scope::new("t|op").unwrap();
    let fp = Fingerprint::from_bytes(b"x");
    let (e, k, s) = (engine.clone(), key.clone(), scope.clone());
    let slow = tokio::spawn(async move {
        e.run(&k, &s, &fp, |_| async {
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            Ok::<_, String>(1)
        })
        .await
        .map(|o| o.is_replayed())
    });
    // Well past the 300 ms lease: only the heartbeat keeps the first holder in place.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let dup = engine
        .run(&key, &scope, &fp, |_| async { Ok::<_, String>(2) })
        .await
        .map(|o| o.is_replayed());
    (slow.await.unwrap(), dup)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_keeps_a_long_work_in_place() {
    let (first, dup) = slow_then_duplicate(engine(Some(0.3))).await;
    assert!(
        matches!(first, Ok(false)),
        "first run completes fresh: {first:?}"
    );
    assert!(
        matches!(dup, Err(Error::InProgress { .. })),
        "duplicate is told to retry: {dup:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_heartbeat_the_stalled_holder_is_fenced() {
    let (first, dup) = slow_then_duplicate(engine(None)).await;
    assert!(
        matches!(dup, Ok(false)),
        "duplicate reclaims and runs: {dup:?}"
    );
    assert!(
        matches!(first, Err(Error::LeaseLost { .. })),
        "stalled holder's completion is refused: {first:?}"
    );
}

/// Extreme wait settings saturate instead of overflowing: a backoff of half of
/// `Duration::MAX` doubles without a panic, and the caller still gives up at `max_wait`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_wait_backoffs_do_not_overflow() {
    let huge = Duration::MAX / 2 + Duration::from_secs(1);
    let policy = Policy::default()
        .lease(Duration::from_secs(3600))
        .in_flight(idempotency_core::InFlight::Wait {
            max_wait: Duration::from_millis(300),
            initial_backoff: huge,
            max_backoff: Duration::MAX,
        });
    let engine = Idempotency::new(Arc::new(MemoryStore::new()), policy).unwrap();
    let key = IdempotencyKey::random();
    let scope = Scope::new("t|wait").unwrap();
    let fp = Fingerprint::from_bytes(b"x");
    let id = idempotency_core::RecordId::new(scope.clone(), key.clone());
    let idempotency_core::Begin::Execute(_held) = engine.begin(&id, &fp).await.unwrap() else {
        panic!("a fresh key replayed");
    };
    let started = std::time::Instant::now();
    let waited = engine
        .run(&key, &scope, &fp, |_| async { Ok::<_, String>(1) })
        .await;
    assert!(
        matches!(waited, Err(Error::InProgress { .. })),
        "the waiter got {waited:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
}
