//! Engine behaviour against a real store: the lease heartbeat (in real time), and what
//! happens to a key whose outcome the store refuses.
#![allow(clippy::unwrap_used)]

use idempotency_conformance::{Fault, FlakyOp, FlakyStore};
use idempotency_core::store::ManualClock;
use idempotency_core::{
    Answer, Error, Fingerprint, Idempotency, IdempotencyKey, Policy, Refusal, Scope, SettleRetry,
};
use idempotency_memory::MemoryStore;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn engine(heartbeat: Option<f64>) -> Idempotency {
    let policy = Policy::default()
        .lease(Duration::from_millis(300))
        .heartbeat(heartbeat);
    Idempotency::new(Arc::new(MemoryStore::new()), policy).unwrap()
}

type Ran = Result<Answer<Result<i32, String>>, Error>;

async fn slow_then_duplicate(engine: Idempotency) -> (Ran, Ran) {
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
    });
    // Well past the 300 ms lease: only the heartbeat keeps the first holder in place.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let dup = engine
        .run(&key, &scope, &fp, |_| async { Ok::<_, String>(2) })
        .await;
    (slow.await.unwrap(), dup)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_keeps_a_long_work_in_place() {
    let (first, dup) = slow_then_duplicate(engine(Some(0.3))).await;
    assert!(
        matches!(first, Ok(Answer::Executed(Ok(1)))),
        "first run completes fresh: {first:?}"
    );
    assert!(
        matches!(dup, Ok(Answer::Refused(Refusal::InProgress { .. }))),
        "duplicate is told to retry: {dup:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_heartbeat_the_stalled_holder_is_fenced() {
    let (first, dup) = slow_then_duplicate(engine(None)).await;
    assert!(
        matches!(dup, Ok(Answer::Executed(Ok(2)))),
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
    let id = idempotency_core::RecordId::new(key.clone(), scope.clone());
    let idempotency_core::protocol::Begin::Execute(_held) = engine.begin(&id, &fp).await.unwrap()
    else {
        panic!("a fresh key replayed");
    };
    let started = std::time::Instant::now();
    let waited = engine
        .run(&key, &scope, &fp, |_| async { Ok::<_, String>(1) })
        .await;
    assert!(
        matches!(waited, Ok(Answer::Refused(Refusal::InProgress { .. }))),
        "the waiter got {waited:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
}

/// The work ran and the store refused its outcome for good: a retry after the lease has
/// passed must not run the work a second time. It is told the first attempt failed
/// permanently (the record says why), every time, until the record expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_the_store_refuses_is_never_run_again() {
    let clock = ManualClock::new();
    // Every completion refused, the store otherwise up (as a store whose item limit the
    // outcome passes).
    let store = FlakyStore::new(
        Arc::new(
            MemoryStore::builder()
                .clock(Arc::new(clock.clone()))
                .build(),
        ),
        Fault::Refused,
    );
    store.inject(FlakyOp::Complete, u64::MAX / 2);
    let lease = Duration::from_secs(30);
    let policy = Policy::default()
        .lease(lease)
        .heartbeat(None)
        .settle_retry(SettleRetry::new(
            2,
            Duration::from_millis(1),
            Duration::from_millis(1),
        ));
    let engine = Idempotency::new(Arc::new(store), policy).unwrap();
    let (key, scope, fp) = (
        IdempotencyKey::random(),
        Scope::new("t|large").unwrap(),
        Fingerprint::from_bytes(b"x"),
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let run = || {
        let runs = runs.clone();
        engine.run(&key, &scope, &fp, move |_| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>("x".repeat(5_000))
        })
    };
    let first = run().await;
    assert!(
        matches!(first, Err(Error::OutcomeUnknown { .. })),
        "the first run's outcome was not stored: {first:?}"
    );
    for later in [Duration::ZERO, lease + Duration::from_secs(1), lease * 10] {
        clock.advance(later);
        let retry = run().await;
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "a retry {later:?} later ran the work again ({retry:?})"
        );
        assert!(
            matches!(retry, Ok(Answer::Refused(Refusal::OutcomeLost { .. }))),
            "a retry {later:?} later is told the first attempt failed for good: {retry:?}"
        );
    }
    // Another payload under the key is a mismatch, as against a stored outcome: the work
    // that ran is not followed by another one.
    let other = engine
        .run(&key, &scope, &Fingerprint::from_bytes(b"y"), |_| async {
            Ok::<_, String>("other".to_owned())
        })
        .await;
    assert!(
        matches!(other, Ok(Answer::Refused(Refusal::KeyReused))),
        "{other:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// An outcome that cannot be serialized after the work ran: the work is not run again, and
/// another payload under the key is a mismatch, as for any outcome that could not be stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_that_cannot_be_serialized_is_never_run_again() {
    let engine = Idempotency::new(Arc::new(MemoryStore::new()), Policy::default()).unwrap();
    let (key, scope) = (IdempotencyKey::random(), Scope::new("t|codec").unwrap());
    let runs = Arc::new(AtomicUsize::new(0));
    let run = |body: &'static [u8]| {
        let runs = runs.clone();
        let (engine, key, scope) = (engine.clone(), key.clone(), scope.clone());
        async move {
            engine
                .run(
                    &key,
                    &scope,
                    &Fingerprint::from_bytes(body),
                    move |_| async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        // JSON has no map whose keys are not strings.
                        Ok::<_, String>(std::collections::HashMap::from([((1, 2), 3)]))
                    },
                )
                .await
        }
    };
    let first = run(b"x").await;
    assert!(matches!(first, Err(Error::Codec { .. })), "{first:?}");
    let retry = run(b"x").await;
    assert!(
        matches!(retry, Ok(Answer::Refused(Refusal::OutcomeLost { .. }))),
        "{retry:?}"
    );
    let other = run(b"y").await;
    assert!(
        matches!(other, Ok(Answer::Refused(Refusal::KeyReused))),
        "another payload under the key ran: {other:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran again");
}

/// A stored outcome that no longer fits the caller's type (the type changed in a deploy) is
/// its own error, apart from an outcome that cannot be encoded and from a corrupt record; the
/// work does not run again, and the stored outcome is kept.
#[tokio::test]
async fn a_stored_outcome_of_another_type_is_its_own_error() {
    let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    let (key, scope) = (
        IdempotencyKey::new("typed").unwrap(),
        Scope::new("t|op").unwrap(),
    );
    let fp = Fingerprint::from_bytes(b"x");
    let first = engine
        .run(&key, &scope, &fp, |_| async { Ok::<u64, String>(7) })
        .await
        .unwrap();
    assert_eq!(first, Answer::Executed(Ok(7)));
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let err = engine
        .run(&key, &scope, &fp, move |_| async move {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok::<Vec<String>, String>(vec![])
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::StoredOutcome { .. }), "{err:?}");
    assert!(err.to_string().contains("does not fit"), "{err}");
    assert!(!err.is_retryable());
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the work ran again");
    let again = engine
        .run(&key, &scope, &fp, |_| async { Ok::<u64, String>(8) })
        .await
        .unwrap();
    assert_eq!(again, Answer::Replayed(Ok(7)), "the stored outcome is kept");
}
