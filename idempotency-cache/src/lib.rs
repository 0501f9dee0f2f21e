#![doc = include_str!("../README.md")]

use async_trait::async_trait;
use idempotency_core::store::{
    Cas, Claim, ClaimRequest, Clock, Failure, Reclaim, Record, RecordStatus, Settlement,
    SystemClock, Timestamp,
};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What an entry costs besides its bytes: the key, the record's fixed fields and the cache's
/// own bookkeeping, roughly.
const ENTRY_OVERHEAD: u64 = 256;

/// A store wrapper that answers replays of completed records from memory.
///
/// A claim that does not count its hit ([`ClaimRequest::count_hit`] `false`, the engine's
/// default) and finds a Completed record the cache holds is answered from the cache, without
/// a round trip. Everything else goes to the store: counted claims, claims of keys the cache
/// does not hold, `get`, and every write. The cache is filled only from what the store
/// returned: a claim that found a Completed record.
///
/// A cached record is served only while it is certainly live on the store's clock: for as
/// long as the store said it had left to live, counted from when the claim that filled it was
/// sent (so the time the answer took is counted against it), and never longer than
/// [`ReplayCacheBuilder::max_age`] after the fill, which bounds what a jump of the store's
/// clock can do. That time is measured on a monotonic clock ([`Clock::monotonic`]): a step
/// of this host's wall clock (NTP, an operator) neither extends nor shortens an entry; the
/// store's clock gives only how long the record has left.
///
/// Batches keep the inner store's batches: [`IdempotencyStore::claim_many`] answers the
/// replays the cache holds and sends the rest in one `claim_many`, and
/// [`IdempotencyStore::settle_many`] goes to the store as one call.
///
/// ```
/// # async fn f() -> Result<(), idempotency_core::Error> {
/// use idempotency_cache::ReplayCache;
/// use idempotency_core::{Idempotency, Policy};
/// use idempotency_memory::MemoryStore;
/// use std::time::Duration;
///
/// let store = ReplayCache::builder()
///     .max_entries(100_000)
///     .max_bytes(256 << 20)
///     .max_age(Duration::from_secs(300))
///     .build(MemoryStore::new());
/// let engine = Idempotency::new(std::sync::Arc::new(store), Policy::default())?;
/// # let _ = engine;
/// # Ok(()) }
/// ```
pub struct ReplayCache<S> {
    inner: S,
    entries: quick_cache::sync::Cache<RecordId, Arc<Entry>, EntryWeighter>,
    clock: Arc<dyn Clock>,
    max_age: Duration,
    stats: Arc<Counters>,
}

impl<S: fmt::Debug> fmt::Debug for ReplayCache<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayCache")
            .field("inner", &self.inner)
            .field("entries", &self.entries.len())
            .field("weight", &self.entries.weight())
            .field("max_age", &self.max_age)
            .field("stats", &self.stats())
            .finish()
    }
}

/// One cached Completed record.
#[derive(Debug)]
struct Entry {
    record: Record,
    /// The cache's monotonic reading when the claim that filled it was sent.
    sent: Duration,
    /// The monotonic reading past which the record is no longer served.
    deadline: Duration,
    /// The store's clock when it read the record.
    store_now: Timestamp,
    /// What it weighs.
    weight: u64,
}

/// Weighs an entry by its bytes, and at least `floor`, so that `max_bytes` also bounds the
/// number of entries.
#[derive(Clone, Debug)]
struct EntryWeighter {
    floor: u64,
}

impl quick_cache::Weighter<RecordId, Arc<Entry>> for EntryWeighter {
    fn weight(&self, _key: &RecordId, entry: &Arc<Entry>) -> u64 {
        entry.weight.max(self.floor)
    }
}

/// Counters of a [`ReplayCache`], from [`ReplayCache::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Claims answered from the cache.
    pub hits: u64,
    /// Uncounted claims the cache could not answer (not held, or no longer certainly live),
    /// sent to the store.
    pub misses: u64,
    /// Records put in the cache.
    pub fills: u64,
    /// Entries found past their deadline and dropped.
    pub expired: u64,
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    fills: AtomicU64,
    expired: AtomicU64,
}

/// Builds a [`ReplayCache`].
#[derive(Debug)]
pub struct ReplayCacheBuilder {
    max_entries: usize,
    max_bytes: u64,
    max_age: Duration,
    clock: Arc<dyn Clock>,
}

impl Default for ReplayCacheBuilder {
    fn default() -> Self {
        Self {
            max_entries: 10_000,
            max_bytes: 64 << 20,
            max_age: Duration::from_secs(60),
            clock: Arc::new(SystemClock),
        }
    }
}

impl ReplayCacheBuilder {
    /// At most this many records (default 10,000; at least 1).
    pub fn max_entries(mut self, n: usize) -> Self {
        self.max_entries = n.max(1);
        self
    }

    /// At most this many bytes of records (outcome, fingerprint, key and a fixed overhead per
    /// entry; default 64 MiB). An entry weighs at least `max_bytes / max_entries`, so neither
    /// bound is passed.
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = bytes.max(1);
        self
    }

    /// How long after its fill an entry may be served at most, whatever its expiry (default
    /// 60 s). It bounds how long a record stays served after the store's clock jumped ahead
    /// of the cache's, or after the record was lost on the store's side.
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = age;
        self
    }

    /// The clock the cache measures time on (default the system clock). Give it the clock a
    /// process-clock store reads (a `ManualClock` in tests).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The cache in front of `inner`.
    pub fn build<S: IdempotencyStore>(self, inner: S) -> ReplayCache<S> {
        let floor = (self.max_bytes / self.max_entries as u64).max(1);
        ReplayCache {
            inner,
            entries: quick_cache::sync::Cache::with_weighter(
                self.max_entries,
                self.max_bytes,
                EntryWeighter { floor },
            ),
            clock: self.clock,
            max_age: self.max_age,
            stats: Arc::default(),
        }
    }
}

impl ReplayCache<()> {
    /// A builder with the defaults: 10,000 entries, 64 MiB, served at most 60 s after the
    /// fill, on the system clock.
    pub fn builder() -> ReplayCacheBuilder {
        ReplayCacheBuilder::default()
    }
}

impl<S> ReplayCache<S> {
    /// The store behind the cache.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// How many records the cache holds now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache holds no record.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The counters since the cache was built.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.stats.hits.load(Ordering::Relaxed),
            misses: self.stats.misses.load(Ordering::Relaxed),
            fills: self.stats.fills.load(Ordering::Relaxed),
            expired: self.stats.expired.load(Ordering::Relaxed),
        }
    }
}

impl<S: IdempotencyStore> ReplayCache<S> {
    /// The cache in front of `inner`, with the defaults of [`ReplayCache::builder`].
    pub fn new(inner: S) -> Self {
        ReplayCacheBuilder::default().build(inner)
    }

    /// The cached answer to an uncounted claim of `id`, if the cache holds its record and it
    /// is certainly live.
    fn cached(&self, id: &RecordId) -> Option<Claim> {
        let entry = self.entries.get(id)?;
        let now = self.clock.monotonic();
        if now >= entry.deadline {
            self.entries.remove(id);
            self.stats.expired.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        // The store's clock, at its most cautious: as if it read the record when the claim
        // was sent, and has run since at the cache's rate.
        Some(Claim::Existing {
            record: entry.record.clone(),
            now: entry
                .store_now
                .saturating_add(now.saturating_sub(entry.sent)),
        })
    }

    /// Keeps `record` if it is Completed and live: `store_now` is the store's clock when it
    /// read it, `sent` the cache's monotonic reading before the claim was sent.
    fn fill(&self, record: &Record, store_now: Timestamp, sent: Duration) {
        if record.status != RecordStatus::Completed || record.expires_at <= store_now {
            return;
        }
        // The store read its clock at some moment after `sent`: assuming it read it at
        // `sent` makes the deadline the earliest the record can expire, measured on the
        // cache's monotonic clock.
        let live_for = record.expires_at.saturating_duration_since(store_now);
        let deadline = sent.saturating_add(live_for.min(self.max_age));
        // The fingerprint (32 bytes) is in the overhead.
        let weight = ENTRY_OVERHEAD
            + record.outcome.as_ref().map_or(0, Vec::len) as u64
            + record.id.scope.as_str().len() as u64
            + record.id.key.as_str().len() as u64;
        let entry = Entry {
            record: record.clone(),
            sent,
            deadline,
            store_now,
            weight,
        };
        self.entries.insert(record.id.clone(), Arc::new(entry));
        self.stats.fills.fetch_add(1, Ordering::Relaxed);
    }
}

#[async_trait]
impl<S: IdempotencyStore> IdempotencyStore for ReplayCache<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        if !request.count_hit {
            if let Some(claim) = self.cached(&request.id) {
                return Ok(claim);
            }
            self.stats.misses.fetch_add(1, Ordering::Relaxed);
        }
        let sent = self.clock.monotonic();
        let claim = self.inner.claim(request).await?;
        if let Claim::Existing { record, now } = &claim {
            self.fill(record, *now, sent);
        }
        Ok(claim)
    }

    async fn claim_many(&self, requests: &[ClaimRequest]) -> Vec<Result<Claim, Error>> {
        // The replays the cache holds are answered here; the rest go in one batch.
        let mut answers: Vec<Option<Result<Claim, Error>>> = requests
            .iter()
            .map(|request| {
                if request.count_hit {
                    return None;
                }
                let cached = self.cached(&request.id);
                if cached.is_none() {
                    self.stats.misses.fetch_add(1, Ordering::Relaxed);
                }
                cached.map(Ok)
            })
            .collect();
        let missed: Vec<ClaimRequest> = requests
            .iter()
            .zip(&answers)
            .filter(|(_, answer)| answer.is_none())
            .map(|(request, _)| request.clone())
            .collect();
        if !missed.is_empty() {
            let sent = self.clock.monotonic();
            let mut fetched = self.inner.claim_many(&missed).await.into_iter();
            for answer in answers.iter_mut().filter(|a| a.is_none()) {
                let claim = fetched.next().unwrap_or_else(|| {
                    Err(Error::backend(
                        false,
                        "the store answered fewer claims than the batch had",
                    ))
                });
                if let Ok(Claim::Existing { record, now }) = &claim {
                    self.fill(record, *now, sent);
                }
                *answer = Some(claim);
            }
        }
        answers.into_iter().flatten().collect()
    }

    async fn settle_many(&self, settlements: &[Settlement]) -> Vec<Result<Cas, Error>> {
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
