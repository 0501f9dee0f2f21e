#![doc = include_str!("../README.md")]

use async_trait::async_trait;
use foldhash::fast::RandomState;
use hashbrown::hash_table::{Entry, HashTable};
use idempotency_core::store::{
    claim_retention, Cas, Claim, ClaimRequest, Clock, Failure, Reclaim, Record, RecordStatus,
    Settle, Settlement, SystemClock, Timestamp,
};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use parking_lot::Mutex;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

/// An in-process store. Records live in a fixed number of shards, each behind its own mutex,
/// so unrelated keys rarely contend. Time comes from an injectable [`Clock`].
///
/// Nothing survives the process: use it for tests and single-process services. (The reference
/// the conformance kit checks stores against is the kit's `ReferenceStore`.)
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
}

/// One shard: records with their address, found by a hash computed once per call.
type Shard = HashTable<(RecordId, Slot)>;

/// A record without its address (the map key holds that once).
#[derive(Debug, Clone)]
struct Slot {
    fingerprint: Fingerprint,
    status: RecordStatus,
    token: FencingToken,
    lease_until: Option<Timestamp>,
    outcome: Option<Vec<u8>>,
    attempts: u32,
    failure: Option<Failure>,
    hits: u64,
    created_at: Timestamp,
    updated_at: Timestamp,
    expires_at: Timestamp,
}

impl Slot {
    fn to_record(&self, id: &RecordId) -> Record {
        Record {
            id: id.clone(),
            fingerprint: self.fingerprint,
            status: self.status,
            token: self.token,
            lease_until: self.lease_until,
            outcome: self.outcome.clone(),
            attempts: self.attempts,
            failure: self.failure.clone(),
            hits: self.hits,
            created_at: self.created_at,
            updated_at: self.updated_at,
            expires_at: self.expires_at,
        }
    }

    fn is_expired(&self, now: Timestamp) -> bool {
        now >= self.expires_at
    }

    fn lease_passed(&self, now: Timestamp) -> bool {
        self.status == RecordStatus::Pending && self.lease_until.is_none_or(|l| now >= l)
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

/// Configures a [`MemoryStore`]: its clock and how many lock shards it has.
#[derive(Clone, Debug)]
pub struct MemoryStoreBuilder {
    clock: Arc<dyn Clock>,
    shards: usize,
}

impl MemoryStoreBuilder {
    /// The clock that decides leases and expiry (default: the system clock; a
    /// [`idempotency_core::store::ManualClock`] in tests).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// How many lock shards the records are spread over (default 64; rounded up to a power of
    /// two, at least 1).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// Builds the store. Nothing can fail: there is nothing to open or migrate.
    pub fn build(self) -> MemoryStore {
        let n = self.shards.max(1).next_power_of_two();
        let hasher = RandomState::default();
        MemoryStore {
            shards: (0..n).map(|_| Mutex::new(HashTable::new())).collect(),
            hasher,
            clock: self.clock,
        }
    }
}

impl MemoryStore {
    /// Starts configuring a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            clock: Arc::new(SystemClock),
            shards: 64,
        }
    }

    /// A store on the system clock with 64 shards.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// How many records are held, expired ones included.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Whether no records are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The address's hash, computed once per call, and its shard. High bits pick the shard;
    /// the table inside uses the whole hash, so keys that share a shard still spread over its
    /// buckets.
    fn shard(&self, id: &RecordId) -> (u64, &Mutex<Shard>) {
        let h = self.hasher.hash_one(id);
        (
            h,
            &self.shards[(h >> 32) as usize & (self.shards.len() - 1)],
        )
    }

    /// The slot of `id` in `shard`, if any.
    fn slot<'s>(shard: &'s mut Shard, hash: u64, id: &RecordId) -> Option<&'s mut Slot> {
        shard.find_mut(hash, |(k, _)| k == id).map(|(_, slot)| slot)
    }

    /// Applies `f` to the live Pending record held by `token`, if there is one.
    fn cas_pending(
        &self,
        id: &RecordId,
        token: FencingToken,
        f: impl FnOnce(&mut Slot, Timestamp),
    ) -> Cas {
        let now = self.clock.now();
        let (hash, shard) = self.shard(id);
        let mut shard = shard.lock();
        match Self::slot(&mut shard, hash, id) {
            Some(r)
                if !r.is_expired(now) && r.status == RecordStatus::Pending && r.token == token =>
            {
                f(r, now);
                r.updated_at = now;
                Cas::Applied
            }
            _ => Cas::Fenced,
        }
    }

    /// A claim, answered under its shard's lock (no `await`: a batch makes them one after
    /// another without a future per key).
    fn claim_now(&self, request: &ClaimRequest) -> Claim {
        let now = self.clock.now();
        let lease_until = now.saturating_add(request.lease);
        let fresh = |token: FencingToken| Slot {
            fingerprint: request.fingerprint,
            status: RecordStatus::Pending,
            token,
            lease_until: Some(lease_until),
            outcome: None,
            attempts: 1,
            failure: None,
            hits: 0,
            created_at: now,
            updated_at: now,
            expires_at: request.expires_at(now),
        };
        let (hash, shard) = self.shard(&request.id);
        let mut shard = shard.lock();
        let entry = shard.entry(
            hash,
            |(k, _)| *k == request.id,
            |(k, _)| self.hasher.hash_one(k),
        );
        let token = match entry {
            Entry::Occupied(mut e) if !e.get().1.is_expired(now) => {
                let slot = &mut e.get_mut().1;
                if request.count_hit {
                    slot.hits = slot.hits.saturating_add(1);
                }
                return Claim::Existing {
                    record: slot.to_record(&request.id),
                    now,
                };
            }
            Entry::Occupied(mut e) => {
                let expired = &mut e.get_mut().1;
                let token = FencingToken::fresh(now, Some(expired.token));
                *expired = fresh(token);
                token
            }
            Entry::Vacant(e) => {
                // Derived from the clock, so a key whose record was purged never gets a
                // token back that an old holder may still have.
                let token = FencingToken::fresh(now, None);
                e.insert((request.id.clone(), fresh(token)));
                token
            }
        };
        Claim::Claimed { token, lease_until }
    }

    /// A completion compare-and-swap, as [`IdempotencyStore::complete`].
    fn complete_now(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Cas {
        self.cas_pending(id, token, |r, now| {
            r.status = RecordStatus::Completed;
            r.outcome = Some(outcome.to_vec());
            r.lease_until = None;
            r.failure = None;
            r.expires_at = now.saturating_add(ttl);
        })
    }

    /// A failure compare-and-swap, as [`IdempotencyStore::fail`].
    fn fail_now(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Cas {
        self.cas_pending(id, token, |r, now| {
            r.status = RecordStatus::Failed;
            r.failure = Some(failure.clone());
            r.lease_until = None;
            r.expires_at = now.saturating_add(ttl);
        })
    }
}

#[async_trait]
impl IdempotencyStore for MemoryStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
        Ok(self.claim_now(request))
    }

    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error> {
        Ok(self.complete_now(id, token, outcome, ttl))
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        Ok(self.fail_now(id, token, failure, ttl))
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        Ok(self.cas_pending(id, token, |r, now| {
            let until = now.saturating_add(lease);
            r.lease_until = Some(until);
            r.expires_at = r.expires_at.max(until);
        }))
    }

    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error> {
        let now = self.clock.now();
        let (hash, shard) = self.shard(id);
        let mut shard = shard.lock();
        let Some(r) = Self::slot(&mut shard, hash, id) else {
            return Ok(Reclaim::Lost);
        };
        let takeable = match r.status {
            // A permanent failure is final for the request that failed (its work may have
            // acted): only a request with another fingerprint takes it over.
            RecordStatus::Failed => {
                r.failure.as_ref().is_none_or(|f| f.retryable) || r.fingerprint != *fingerprint
            }
            RecordStatus::Pending => r.lease_passed(now),
            RecordStatus::Completed => false,
        };
        if r.is_expired(now) || r.token != expected || !takeable {
            return Ok(Reclaim::Lost);
        }
        let token = expected.next();
        let lease_until = now.saturating_add(lease);
        r.status = RecordStatus::Pending;
        r.token = token;
        r.fingerprint = *fingerprint;
        r.attempts = r.attempts.saturating_add(1);
        r.lease_until = Some(lease_until);
        r.outcome = None;
        r.failure = None;
        r.updated_at = now;
        r.expires_at = now.saturating_add(claim_retention(lease, ttl));
        Ok(Reclaim::Reclaimed { token, lease_until })
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        let now = self.clock.now();
        let (hash, shard) = self.shard(id);
        let shard = shard.lock();
        Ok(shard
            .find(hash, |(k, _)| k == id)
            .filter(|(_, r)| !r.is_expired(now))
            .map(|(_, r)| r.to_record(id)))
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        let now = self.clock.now();
        let mut removed = 0usize;
        for shard in self.shards.iter() {
            if removed >= batch {
                break;
            }
            let mut shard = shard.lock();
            let room = batch - removed;
            let mut taken = 0;
            shard.retain(|(_, r)| {
                let drop = taken < room && r.is_expired(now);
                taken += usize::from(drop);
                !drop
            });
            removed += taken;
        }
        Ok(removed as u64)
    }

    /// One claim after another under each key's shard lock, with no future per key: each
    /// answer is what the same claim made alone would have answered.
    async fn claim_many(&self, requests: &[ClaimRequest]) -> Vec<Result<Claim, Error>> {
        requests.iter().map(|r| Ok(self.claim_now(r))).collect()
    }

    /// One settlement after another, as `claim_many`.
    async fn settle_many(&self, settlements: &[Settlement]) -> Vec<Result<Cas, Error>> {
        settlements
            .iter()
            .map(|s| {
                Ok(match &s.settle {
                    Settle::Complete(outcome) => self.complete_now(&s.id, s.token, outcome, s.ttl),
                    Settle::Fail(failure) => self.fail_now(&s.id, s.token, failure, s.ttl),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency_core::store::ManualClock;
    use idempotency_core::{IdempotencyKey, Scope};

    fn request(i: usize, ttl: Duration) -> ClaimRequest {
        ClaimRequest::new(
            RecordId::new(
                IdempotencyKey::new(format!("key-{i}")).expect("key"),
                Scope::new("memory-tests").expect("scope"),
            ),
            Fingerprint::from_bytes(b"f"),
            ttl,
            ttl,
        )
    }

    async fn fill(store: &MemoryStore, n: usize, ttl: Duration) {
        for i in 0..n {
            let claim = store.claim(&request(i, ttl)).await.expect("claim");
            assert!(matches!(claim, Claim::Claimed { .. }), "{claim:?}");
        }
    }

    /// `len` counts every record held, expired ones included, until a purge removes them.
    #[tokio::test]
    async fn len_counts_held_records() {
        let clock = ManualClock::new();
        let store = MemoryStore::builder()
            .clock(Arc::new(clock.clone()))
            .build();
        assert!(store.is_empty());
        assert_eq!(store.len(), 0);
        fill(&store, 5, Duration::from_secs(1)).await;
        assert_eq!(store.len(), 5);
        assert!(!store.is_empty());
        clock.advance(Duration::from_secs(2));
        assert_eq!(store.len(), 5, "expired records are held until purged");
        assert_eq!(store.purge_expired(100).await.expect("purge"), 5);
        assert!(store.is_empty());
    }

    /// Keys spread over the shards (a shard function that sends every key to one shard
    /// serialises the whole store behind one mutex).
    #[tokio::test]
    async fn keys_spread_over_shards() {
        let store = MemoryStore::builder()
            .clock(Arc::new(ManualClock::new()))
            .shards(16)
            .build();
        fill(&store, 256, Duration::from_secs(60)).await;
        let used = store.shards.iter().filter(|s| !s.lock().is_empty()).count();
        assert!(used >= 12, "256 keys landed in only {used} of 16 shards");
    }

    /// A purge never deletes more than its batch, however the expired records are spread
    /// over the shards.
    #[tokio::test]
    async fn purge_honours_its_batch_across_shards() {
        for _ in 0..20 {
            let clock = ManualClock::new();
            let store = MemoryStore::builder()
                .clock(Arc::new(clock.clone()))
                .shards(8)
                .build();
            fill(&store, 16, Duration::from_secs(1)).await;
            clock.advance(Duration::from_secs(2));
            let mut total = 0;
            loop {
                let n = store.purge_expired(3).await.expect("purge");
                assert!(n <= 3, "purge(3) deleted {n} records");
                if n == 0 {
                    break;
                }
                total += n;
            }
            assert_eq!(total, 16);
        }
    }
}
