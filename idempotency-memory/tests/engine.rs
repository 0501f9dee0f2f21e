//! Engine behaviour against a real store: the lease heartbeat (in real time), and what
//! happens to a key whose outcome the store refuses.
#![allow(clippy::unwrap_used)]

use idempotency_core::{
    Cas, Claim, ClaimRequest, Error, Failure, FencingToken, Fingerprint, Idempotency,
    IdempotencyKey, IdempotencyStore, ManualClock, Policy, Reclaim, Record, RecordId, Scope,
    SettleRetry,
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

/// The memory store, but refusing to keep an outcome over `limit` bytes, as a store with an
/// item limit does (DynamoDB's 400 KB): a definite refusal, nothing written.
#[derive(Debug)]
struct RefusesLargeOutcomes {
    inner: MemoryStore,
    limit: usize,
}

#[async_trait::async_trait]
impl IdempotencyStore for RefusesLargeOutcomes {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        self.inner.claim(request).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        if outcome.len() > self.limit {
            return Err(Error::Backend {
                retryable: false,
                source: format!("an outcome of {} bytes is over the limit", outcome.len()).into(),
            });
        }
        self.inner.complete(id, token, outcome, ttl).await
    }
    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        self.inner.fail(id, token, failure, ttl).await
    }
    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        self.inner.extend(id, token, lease).await
    }
    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        self.inner
            .reclaim(id, expected, fingerprint, lease, ttl)
            .await
    }
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        self.inner.get(id).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        self.inner.purge_expired(batch).await
    }
}

/// The work ran and the store refused its outcome for good: a retry after the lease has
/// passed must not run the work a second time. It is told the first attempt failed
/// permanently (the record says why), every time, until the record expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_the_store_refuses_is_never_run_again() {
    let clock = ManualClock::new();
    let store = RefusesLargeOutcomes {
        inner: MemoryStore::builder()
            .clock(Arc::new(clock.clone()))
            .build(),
        limit: 1_000,
    };
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
            matches!(retry, Err(Error::FailedPermanently { .. })),
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
    assert!(matches!(other, Err(Error::Mismatch)), "{other:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
