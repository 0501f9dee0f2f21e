//! What the replay cache answers from memory and what it leaves to the store: replays of
//! Completed records only, never past their expiry on the store's clock (whatever the offset
//! between the clocks), never longer than `max_age`, within its bounds.
#![allow(clippy::unwrap_used)]

use idempotency_cache::ReplayCache;
use idempotency_core::store::{
    async_trait, Cas, Claim, ClaimRequest, Clock, Failure, ManualClock, Reclaim, Record,
    RecordStatus, Settle, Settlement,
};
use idempotency_core::{
    Answer, Error, FencingToken, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore,
    Policy, RecordId, Refusal, Scope,
};
use idempotency_memory::MemoryStore;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(60);

/// Counts the claims that reach the store.
#[derive(Debug)]
struct Counting {
    inner: MemoryStore,
    claims: Arc<AtomicUsize>,
    /// Calls of `claim_many` and `settle_many` that reached the store.
    batches: Arc<AtomicUsize>,
}

#[async_trait]
impl IdempotencyStore for Counting {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(request).await
    }
    async fn claim_many(&self, requests: &[ClaimRequest]) -> Vec<Result<Claim, Error>> {
        self.batches.fetch_add(1, Ordering::SeqCst);
        self.claims.fetch_add(requests.len(), Ordering::SeqCst);
        self.inner.claim_many(requests).await
    }
    async fn settle_many(&self, settlements: &[Settlement]) -> Vec<Result<Cas, Error>> {
        self.batches.fetch_add(1, Ordering::SeqCst);
        self.inner.settle_many(settlements).await
    }
    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
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

/// A cache on `cache_clock` in front of a counting memory store on `store_clock`, and the
/// count of claims that reach the store.
fn cached(
    store_clock: &ManualClock,
    cache_clock: &ManualClock,
    configure: impl FnOnce(
        idempotency_cache::ReplayCacheBuilder,
    ) -> idempotency_cache::ReplayCacheBuilder,
) -> (ReplayCache<Counting>, Arc<AtomicUsize>) {
    let claims = Arc::new(AtomicUsize::new(0));
    let store = Counting {
        inner: MemoryStore::builder()
            .clock(Arc::new(store_clock.clone()))
            .build(),
        claims: claims.clone(),
        batches: Arc::default(),
    };
    let builder = ReplayCache::builder().clock(Arc::new(cache_clock.clone()));
    (configure(builder).build(store), claims)
}

fn id() -> RecordId {
    RecordId::new(IdempotencyKey::random(), Scope::new("cache").unwrap())
}

fn replay(id: &RecordId) -> ClaimRequest {
    ClaimRequest::new(id.clone(), Fingerprint::from_bytes(b"p"), LEASE, TTL).with_count_hit(false)
}

/// Claims and completes `id` with `outcome`, `ttl` of retention.
async fn completed(store: &impl IdempotencyStore, id: &RecordId, outcome: &[u8], ttl: Duration) {
    let token = match store.claim(&replay(id)).await.unwrap() {
        Claim::Claimed { token, .. } => token,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        store.complete(id, token, outcome, ttl).await.unwrap(),
        Cas::Applied
    );
}

fn existing(claim: Claim) -> Record {
    match claim {
        Claim::Existing { record, .. } => record,
        other => panic!("expected the record, got {other:?}"),
    }
}

#[tokio::test]
async fn replays_of_a_completed_record_are_answered_from_memory() {
    let clock = ManualClock::new();
    let (cache, claims) = cached(&clock, &clock, |b| b);
    let key = id();
    completed(&cache, &key, b"done", TTL).await;
    let first = existing(cache.claim(&replay(&key)).await.unwrap());
    let sent = claims.load(Ordering::SeqCst);
    for _ in 0..100 {
        let again = existing(cache.claim(&replay(&key)).await.unwrap());
        assert_eq!(again, first, "the cached record is the store's");
    }
    assert_eq!(
        claims.load(Ordering::SeqCst),
        sent,
        "replays reached the store"
    );
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.fills), (100, 1), "{stats:?}");

    // Another fingerprint gets the same record: the engine refuses it (422), not the cache.
    let other = ClaimRequest::new(key.clone(), Fingerprint::from_bytes(b"q"), LEASE, TTL)
        .with_count_hit(false);
    assert_eq!(
        existing(cache.claim(&other).await.unwrap()).fingerprint,
        first.fingerprint
    );

    // Counted claims, `get` and writes go to the store.
    let counted = existing(
        cache
            .claim(&replay(&key).with_count_hit(true))
            .await
            .unwrap(),
    );
    assert_eq!(counted.hits, first.hits + 1);
    assert_eq!(claims.load(Ordering::SeqCst), sent + 1);
    assert_eq!(cache.get(&key).await.unwrap().unwrap().hits, counted.hits);
}

#[tokio::test]
async fn only_completed_records_are_kept() {
    let clock = ManualClock::new();
    let (cache, claims) = cached(&clock, &clock, |b| b);
    let pending = id();
    let token = match cache.claim(&replay(&pending)).await.unwrap() {
        Claim::Claimed { token, .. } => token,
        other => panic!("{other:?}"),
    };
    let failed = id();
    let failed_token = match cache.claim(&replay(&failed)).await.unwrap() {
        Claim::Claimed { token, .. } => token,
        other => panic!("{other:?}"),
    };
    cache
        .fail(&failed, failed_token, &Failure::default(), TTL)
        .await
        .unwrap();
    for key in [&pending, &failed] {
        for _ in 0..3 {
            cache.claim(&replay(key)).await.unwrap();
        }
    }
    assert_eq!(
        claims.load(Ordering::SeqCst),
        2 + 6,
        "every claim reached the store"
    );
    assert!(cache.is_empty());
    // The pending one completes: from then on its replays come from memory.
    assert_eq!(
        cache.complete(&pending, token, b"late", TTL).await.unwrap(),
        Cas::Applied
    );
    let record = existing(cache.claim(&replay(&pending)).await.unwrap());
    assert_eq!(record.status, RecordStatus::Completed);
    existing(cache.claim(&replay(&pending)).await.unwrap());
    assert_eq!(claims.load(Ordering::SeqCst), 9);
}

/// The store's clock ahead of the cache's, behind it, or with it: a record is never served
/// once the store's clock has reached its expiry.
#[tokio::test]
async fn never_served_past_expiry_whatever_the_clock_offset() {
    for offset_secs in [-20i64, 0, 20] {
        let cache_clock = ManualClock::new();
        let store_clock = ManualClock::new();
        store_clock.set(idempotency_core::store::Timestamp::from_millis(
            cache_clock.now().as_millis() + offset_secs * 1000,
        ));
        let (cache, claims) = cached(&store_clock, &cache_clock, |b| {
            b.max_age(Duration::from_secs(3600))
        });
        let key = id();
        completed(&cache, &key, b"done", TTL).await;
        let record = existing(cache.claim(&replay(&key)).await.unwrap());
        let advance = |d: Duration| {
            store_clock.advance(d);
            cache_clock.advance(d);
        };
        // Up to just before the expiry on the store's clock: served from memory.
        let live = record
            .expires_at
            .saturating_duration_since(store_clock.now());
        advance(live - Duration::from_millis(1));
        let before = claims.load(Ordering::SeqCst);
        existing(cache.claim(&replay(&key)).await.unwrap());
        assert_eq!(
            claims.load(Ordering::SeqCst),
            before,
            "offset {offset_secs} s: served"
        );
        // At the expiry: not served; the store takes the key afresh.
        advance(Duration::from_millis(1));
        match cache.claim(&replay(&key)).await.unwrap() {
            Claim::Claimed { .. } => {}
            other => panic!("offset {offset_secs} s: served past expiry: {other:?}"),
        }
        assert_eq!(cache.stats().expired, 1);
    }
}

/// The time the claim that filled the cache took is counted against the record: the deadline
/// is taken from when the claim was sent, so a slow answer makes it earlier, never later.
#[tokio::test]
async fn a_slow_fill_shortens_the_deadline() {
    #[derive(Debug)]
    struct Slow {
        inner: MemoryStore,
        cache_clock: ManualClock,
    }
    #[async_trait]
    impl IdempotencyStore for Slow {
        async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
            let claim = self.inner.claim(request).await;
            // The answer takes 10 s to come back (on the cache's clock).
            self.cache_clock.advance(Duration::from_secs(10));
            claim
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
            f: &Fingerprint,
            l: Duration,
            ttl: Duration,
        ) -> Result<Reclaim, Error> {
            self.inner.reclaim(id, e, f, l, ttl).await
        }
        async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
            self.inner.get(id).await
        }
        async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
            self.inner.purge_expired(batch).await
        }
    }
    let cache_clock = ManualClock::new();
    let store_clock = ManualClock::new();
    let cache = ReplayCache::builder()
        .clock(Arc::new(cache_clock.clone()))
        .max_age(Duration::from_secs(3600))
        .build(Slow {
            inner: MemoryStore::builder()
                .clock(Arc::new(store_clock.clone()))
                .build(),
            cache_clock: cache_clock.clone(),
        });
    let key = id();
    completed(&cache, &key, b"done", TTL).await;
    // The store read its clock at the start of the 10 s: the record lives TTL from then.
    existing(cache.claim(&replay(&key)).await.unwrap());
    assert_eq!(cache.stats().fills, 1);
    // The fill was sent at some T on the cache's clock and answered at T + 10 s; the store
    // read its clock (where the record had TTL left) in between, so the record is served
    // until T + TTL at the latest: the cache's clock is at T + 10 s now.
    cache_clock.advance(TTL - Duration::from_secs(10));
    let hits = cache.stats().hits;
    let _ = cache.claim(&replay(&key)).await.unwrap();
    assert_eq!(
        cache.stats().hits,
        hits,
        "served past the deadline a slow fill leaves"
    );
}

#[tokio::test]
async fn max_age_bounds_how_long_an_entry_is_served() {
    let clock = ManualClock::new();
    let (cache, claims) = cached(&clock, &clock, |b| b.max_age(Duration::from_secs(5)));
    let key = id();
    completed(&cache, &key, b"done", Duration::from_secs(3600)).await;
    existing(cache.claim(&replay(&key)).await.unwrap());
    let sent = claims.load(Ordering::SeqCst);
    clock.advance(Duration::from_millis(4_999));
    existing(cache.claim(&replay(&key)).await.unwrap());
    assert_eq!(claims.load(Ordering::SeqCst), sent);
    clock.advance(Duration::from_millis(1));
    existing(cache.claim(&replay(&key)).await.unwrap());
    assert_eq!(
        claims.load(Ordering::SeqCst),
        sent + 1,
        "served past max_age"
    );
}

#[tokio::test]
async fn entries_and_bytes_are_bounded() {
    let clock = ManualClock::new();
    let (by_count, _) = cached(&clock, &clock, |b| b.max_entries(50).max_bytes(1 << 30));
    let (by_bytes, _) = cached(&clock, &clock, |b| {
        b.max_entries(1_000_000).max_bytes(100 * 1024)
    });
    for _ in 0..500 {
        let key = id();
        for cache in [&by_count, &by_bytes] {
            completed(cache, &key, &[7u8; 1024], TTL).await;
            existing(cache.claim(&replay(&key)).await.unwrap());
        }
    }
    assert!(by_count.len() <= 50, "{} entries", by_count.len());
    // 1 KiB outcomes plus the entry's overhead: fewer than 100 fit in 100 KiB.
    assert!(by_bytes.len() < 100, "{} entries", by_bytes.len());
    assert!(!by_count.is_empty() && !by_bytes.is_empty());
}

/// Through the engine: the first call runs the work, every later one replays its outcome
/// from memory.
#[tokio::test]
async fn engine_replays_from_memory() {
    let clock = ManualClock::new();
    let (cache, claims) = cached(&clock, &clock, |b| b);
    let engine = Idempotency::new(Arc::new(cache), Policy::default()).unwrap();
    let (key, scope, fp) = (
        IdempotencyKey::random(),
        Scope::new("cache").unwrap(),
        Fingerprint::from_bytes(b"body"),
    );
    let runs = Arc::new(AtomicUsize::new(0));
    for i in 0..20 {
        let runs = runs.clone();
        let outcome = engine
            .run(&key, &scope, &fp, move |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<u64, String>(42)
            })
            .await
            .unwrap();
        assert_eq!(outcome.is_replayed(), i > 0);
        assert_eq!(outcome.into_result().unwrap(), Ok(42));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The first call's claim, and the first replay's, which filled the cache.
    assert_eq!(claims.load(Ordering::SeqCst), 2);
    // A different body is still refused.
    let err = engine
        .run(
            &key,
            &scope,
            &Fingerprint::from_bytes(b"other"),
            |_| async { Ok::<u64, String>(0) },
        )
        .await
        .unwrap();
    assert!(
        matches!(err, Answer::Refused(Refusal::KeyReused)),
        "{err:?}"
    );
}

/// The application host's wall clock stepped back (an NTP step) while the store's did not:
/// the entry's deadline is measured on a monotonic clock, so the step extends nothing, not
/// past the record's expiry on the store, nor past `max_age`.
#[tokio::test]
async fn a_wall_clock_stepped_back_extends_no_entry() {
    for (ttl, max_age) in [
        (TTL, Duration::from_secs(3600)),
        (Duration::from_secs(3600), Duration::from_secs(5)),
    ] {
        let cache_clock = ManualClock::new();
        let store_clock = ManualClock::new();
        let (cache, claims) = cached(&store_clock, &cache_clock, |b| b.max_age(max_age));
        let key = id();
        completed(&cache, &key, b"done", ttl).await;
        existing(cache.claim(&replay(&key)).await.unwrap());
        assert_eq!(cache.stats().fills, 1);
        // The application's wall clock steps back an hour; then time passes on both hosts
        // until the entry's time is up (the record's expiry, or `max_age`).
        cache_clock.set(idempotency_core::store::Timestamp::from_millis(
            cache_clock.now().as_millis() - 3_600_000,
        ));
        let up = ttl.min(max_age);
        store_clock.advance(up);
        cache_clock.advance(up);
        let before = claims.load(Ordering::SeqCst);
        let answer = cache.claim(&replay(&key)).await.unwrap();
        assert_eq!(
            claims.load(Ordering::SeqCst),
            before + 1,
            "ttl {ttl:?}, max_age {max_age:?}: served from memory after a step back of the \
             wall clock: {answer:?}"
        );
        if ttl <= max_age {
            assert!(
                matches!(answer, Claim::Claimed { .. }),
                "the store takes the expired key afresh: {answer:?}"
            );
        }
    }
}

/// A batch through the cache keeps the inner store's batches: one `claim_many` and one
/// `settle_many` reach it, not one call per message; cached replays are answered from memory.
#[tokio::test]
async fn batches_reach_the_store_as_batches() {
    let clock = ManualClock::new();
    let claims = Arc::new(AtomicUsize::new(0));
    let batches = Arc::new(AtomicUsize::new(0));
    let cache = ReplayCache::builder()
        .clock(Arc::new(clock.clone()))
        .build(Counting {
            inner: MemoryStore::builder()
                .clock(Arc::new(clock.clone()))
                .build(),
            claims: claims.clone(),
            batches: batches.clone(),
        });
    let keys: Vec<RecordId> = (0..10).map(|_| id()).collect();
    let requests: Vec<ClaimRequest> = keys.iter().map(replay).collect();
    let answers = cache.claim_many(&requests).await;
    assert_eq!(batches.load(Ordering::SeqCst), 1);
    let settlements: Vec<Settlement> = keys
        .iter()
        .zip(answers)
        .map(|(id, answer)| match answer.unwrap() {
            Claim::Claimed { token, .. } => Settlement {
                id: id.clone(),
                token,
                settle: Settle::Complete(b"done".to_vec()),
                ttl: TTL,
            },
            other => panic!("{other:?}"),
        })
        .collect();
    for cas in cache.settle_many(&settlements).await {
        assert_eq!(cas.unwrap(), Cas::Applied);
    }
    assert_eq!(batches.load(Ordering::SeqCst), 2, "one settle_many");
    // Redelivered: the store answers once and fills the cache; then memory answers.
    for answer in cache.claim_many(&requests).await {
        assert_eq!(existing(answer.unwrap()).status, RecordStatus::Completed);
    }
    assert_eq!(batches.load(Ordering::SeqCst), 3);
    assert_eq!(cache.stats().fills, 10);
    let sent = claims.load(Ordering::SeqCst);
    for answer in cache.claim_many(&requests).await {
        assert_eq!(existing(answer.unwrap()).status, RecordStatus::Completed);
    }
    assert_eq!(
        (
            batches.load(Ordering::SeqCst),
            claims.load(Ordering::SeqCst)
        ),
        (3, sent),
        "cached replays reached the store"
    );
    assert_eq!(cache.stats().hits, 10);
}
