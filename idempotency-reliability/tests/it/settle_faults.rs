//! Regression tests for what the soak found in the engine's settle retries: a completion
//! whose answer was lost, retried after its record had expired, was reported as
//! `LeaseLost` ("fenced, nothing stored") although its outcome had been stored and replayed.

use idempotency_conformance::{Fault, FlakyOp, FlakyStore};
use idempotency_core::protocol::Begin;
use idempotency_core::store::{Failure, Reclaim, RecordStatus};
use idempotency_core::{
    Error, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore, Policy, RecordId, Scope,
    SettleRetry,
};
use idempotency_memory::MemoryStore;
use std::sync::Arc;
use std::time::Duration;

fn address(label: &str) -> (IdempotencyKey, Scope, RecordId) {
    let key = IdempotencyKey::random();
    let scope = Scope::from_parts(["settle-faults", label]).expect("valid scope");
    let id = RecordId::new(key.clone(), scope.clone());
    (key, scope, id)
}

/// Tries at 0, 60 and 180 ms.
fn retries() -> SettleRetry {
    SettleRetry::new(3, Duration::from_millis(60), Duration::from_millis(120))
}

/// Found by `soak_memory` (seed 18224346700441746688, a short-retention key): the first try
/// of the completion applied but its answer was lost, the second was lost too, and by the
/// third the record (100 ms retention) had expired, so the third try was fenced and the read
/// found nothing. The caller was told `LeaseLost` while three other calls had replayed its
/// outcome. Nothing tells whether an earlier try applied: the answer is `OutcomeUnknown`.
#[tokio::test]
async fn a_lost_answer_then_an_expired_record_is_outcome_unknown() {
    let inner: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    let flaky = FlakyStore::new(inner.clone(), Fault::AckLost);
    let engine = Idempotency::new(
        Arc::new(flaky.clone()),
        Policy::default()
            .lease(Duration::from_secs(10))
            .retention(Duration::from_millis(100))
            .settle_retry(retries()),
    )
    .expect("policy");
    let (key, scope, id) = address("expired");
    flaky.inject(FlakyOp::Complete, 2);
    let run = {
        let (engine, key, scope) = (engine.clone(), key.clone(), scope.clone());
        tokio::spawn(async move {
            engine
                .run(&key, &scope, &Fingerprint::from_bytes(b"f"), |_| async {
                    Ok::<_, String>("paid".to_string())
                })
                .await
        })
    };
    // Between the first try (applied) and the second, the outcome is stored and replayed.
    tokio::time::sleep(Duration::from_millis(30)).await;
    let record = inner.get(&id).await.expect("get").expect("a record");
    assert_eq!(record.status, RecordStatus::Completed, "{record:?}");
    let got = run.await.expect("the run panicked");
    assert!(
        matches!(got, Err(Error::OutcomeUnknown { .. })),
        "a completion that applied, then expired, was reported as {got:?}"
    );
    assert_eq!(flaky.injected(), 2);
}

/// The certain case keeps its answer: a try refused (nothing written), then the key taken
/// over while the engine waited to try again. With a retention far longer than the retries,
/// an applied earlier try would still show, so the record moving on means it did not apply:
/// `LeaseLost`, and the new holder's record is untouched.
#[tokio::test]
async fn a_refused_try_then_a_takeover_is_lease_lost() {
    let inner: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    let flaky = FlakyStore::new(inner.clone(), Fault::Refused);
    let long = Duration::from_secs(3600);
    let engine = Idempotency::new(
        Arc::new(flaky.clone()),
        Policy::default()
            .lease(long)
            .retention(long)
            .settle_retry(retries()),
    )
    .expect("policy");
    let (_, _, id) = address("taken-over");
    let fp = Fingerprint::from_bytes(b"f");
    let Begin::Execute(lease) = engine.begin(&id, &fp).await.expect("begin") else {
        panic!("a fresh key replayed");
    };
    let old = lease.token();
    flaky.inject(FlakyOp::Complete, 1);
    let completing = tokio::spawn(async move { lease.complete(b"\"stale\"").await });
    // During the backoff, an operator fails the holder and a retry reclaims the key.
    tokio::time::sleep(Duration::from_millis(20)).await;
    inner
        .fail(&id, old, &Failure::retryable("taken over"), long)
        .await
        .expect("fail");
    let Reclaim::Reclaimed { token: new, .. } = inner
        .reclaim(&id, old, &fp, long, long)
        .await
        .expect("reclaim")
    else {
        panic!("the takeover's reclaim was lost");
    };
    let got = completing.await.expect("the completion panicked");
    assert!(
        matches!(got, Err(Error::LeaseLost { token }) if token == old),
        "a fenced completion after a refused try was reported as {got:?}"
    );
    let record = inner.get(&id).await.expect("get").expect("a record");
    assert_eq!(record.token, new, "{record:?}");
    assert_eq!(record.status, RecordStatus::Pending, "{record:?}");
    assert_eq!(record.outcome, None, "{record:?}");
}
