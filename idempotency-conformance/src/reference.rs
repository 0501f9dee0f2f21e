//! A reference model of the store contract: a pure, synchronous store that answers every
//! primitive the way [`IdempotencyStore`](idempotency_core::IdempotencyStore) says a store
//! must.
//!
//! It is the single statement of the contract's transitions that the kit's randomized
//! model-based case compares real stores against, and that the protocol model checker
//! (`idempotency-model-check`) explores every interleaving of. It keeps only what the
//! contract fixes (no `created_at` or `updated_at`), takes the store's clock as an argument
//! instead of reading one, and issues tokens by the same rule as the real stores
//! ([`FencingToken::fresh`]).
//!
//! ```
//! use idempotency_conformance::reference::{RefClaim, ReferenceStore};
//! use idempotency_core::Fingerprint;
//! use idempotency_core::store::{Cas, Timestamp};
//! use std::time::Duration;
//!
//! let mut store = ReferenceStore::new();
//! let fp = Fingerprint::from_bytes(b"body");
//! let now = Timestamp::from_millis(1_000);
//! let (secs, day) = (Duration::from_secs(30), Duration::from_secs(86_400));
//! let RefClaim::Claimed { token, .. } = store.claim(&"key", &fp, secs, day, now) else {
//!     unreachable!("an absent key is claimed");
//! };
//! assert_eq!(store.complete(&"key", token, b"done", day, now), Cas::Applied);
//! // A completed record is final: a second completion is fenced.
//! assert_eq!(store.complete(&"key", token, b"again", day, now), Cas::Fenced);
//! ```

use idempotency_core::store::{
    claim_retention, Cas, Failure, Reclaim, Record, RecordStatus, Timestamp,
};
use idempotency_core::{FencingToken, Fingerprint, RecordId};
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::time::Duration;

/// What the contract says one key's record is.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct RefRecord {
    /// Fingerprint of the request that claimed or last reclaimed the key.
    pub fingerprint: Fingerprint,
    /// Where the record is in its life.
    pub status: RecordStatus,
    /// The current fencing token.
    pub token: FencingToken,
    /// While Pending: when the holder's lease passes.
    pub lease_until: Option<Timestamp>,
    /// While Completed: the stored outcome.
    pub outcome: Option<Vec<u8>>,
    /// How many times the work was started under the key.
    pub attempts: u32,
    /// While Failed: the last failure.
    pub failure: Option<Failure>,
    /// How many later claims observed the record.
    pub hits: u64,
    /// When the record expires (it is absent from then on).
    pub expires_at: Timestamp,
}

// `Failure` is not `Hash`; the model checker needs the record hashable to tell states apart.
impl Hash for RefRecord {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.fingerprint.hash(state);
        self.status.hash(state);
        self.token.hash(state);
        self.lease_until.hash(state);
        self.outcome.hash(state);
        self.attempts.hash(state);
        self.failure
            .as_ref()
            .map(|f| (f.retryable, f.message.as_str()))
            .hash(state);
        self.hits.hash(state);
        self.expires_at.hash(state);
    }
}

impl RefRecord {
    /// Whether the record is live (not expired) at `now`.
    pub fn is_live(&self, now: Timestamp) -> bool {
        now < self.expires_at
    }

    /// Whether a complete, fail or extend by the holder of `token` applies at `now`.
    pub fn is_pending_with(&self, now: Timestamp, token: FencingToken) -> bool {
        self.is_live(now) && self.status == RecordStatus::Pending && self.token == token
    }

    /// Whether a reclaim with `fingerprint` may take the record over at `now` (token aside):
    /// it is Pending with a passed lease, or Failed (a permanent failure only by another
    /// fingerprint).
    pub fn is_takeable(&self, now: Timestamp, fingerprint: &Fingerprint) -> bool {
        match self.status {
            RecordStatus::Failed => {
                self.failure.as_ref().is_none_or(|f| f.retryable)
                    || self.fingerprint != *fingerprint
            }
            RecordStatus::Pending => self.lease_until.is_none_or(|l| l <= now),
            RecordStatus::Completed => false,
        }
    }

    /// The record as a store returns it, for [`idempotency_core::store::decide`]. The timestamps
    /// the contract leaves open (`created_at`, `updated_at`) are set to `now`.
    pub fn to_record(&self, id: RecordId, now: Timestamp) -> Record {
        Record {
            id,
            fingerprint: self.fingerprint,
            status: self.status,
            token: self.token,
            lease_until: self.lease_until,
            outcome: self.outcome.clone(),
            attempts: self.attempts,
            failure: self.failure.clone(),
            hits: self.hits,
            created_at: now,
            updated_at: now,
            expires_at: self.expires_at,
        }
    }
}

/// What [`ReferenceStore::claim`] answers: [`idempotency_core::store::Claim`] without the parts the
/// contract does not fix.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum RefClaim {
    /// No live record existed: a Pending record was written with this token and lease.
    Claimed {
        /// The new holder's token.
        token: FencingToken,
        /// When its lease passes.
        lease_until: Timestamp,
    },
    /// A live record exists; its `hits` include this observation.
    Existing(RefRecord),
}

/// A deliberate departure from the contract, for proving that a checker notices one. The
/// [`ReferenceStore`] follows the contract unless it is given a flaw.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub enum Flaw {
    /// No flaw: the contract.
    #[default]
    None,
    /// A fresh record's token restarts from a per-record counter (1 for an absent key)
    /// instead of following the clock, so a key whose record was purged reissues old tokens.
    TokenRestartsAfterPurge,
    /// A reclaim checks the record's status and lease but not that it still holds the
    /// expected token; the new token is still `expected + 1`.
    ReclaimIgnoresExpectedToken,
    /// A reclaim keeps the record's old fingerprint instead of the reclaimer's.
    ReclaimKeepsFingerprint,
    /// A reclaim takes over any Failed record, a permanent failure too, with the failed
    /// request's own fingerprint (the store contract before permanent failures were final).
    ReclaimTakesPermanentFailure,
}

/// The reference store: one [`RefRecord`] per key, answering the contract's primitives on a
/// clock the caller passes in.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct ReferenceStore<K: Ord = usize> {
    records: BTreeMap<K, RefRecord>,
    flaw: Flaw,
}

impl<K: Ord> Default for ReferenceStore<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Ord> ReferenceStore<K> {
    /// An empty store that follows the contract.
    pub fn new() -> Self {
        Self::with_flaw(Flaw::None)
    }

    /// An empty store with a deliberate flaw.
    pub fn with_flaw(flaw: Flaw) -> Self {
        Self {
            records: BTreeMap::new(),
            flaw,
        }
    }

    /// The flaw the store was built with.
    pub fn flaw(&self) -> Flaw {
        self.flaw
    }

    /// The record kept for `key`, expired or not (a real store may still hold an expired
    /// record until it is purged or replaced).
    pub fn stored(&self, key: &K) -> Option<&RefRecord> {
        self.records.get(key)
    }

    /// Claim-or-observe, as [`IdempotencyStore::claim`](idempotency_core::IdempotencyStore::claim).
    pub fn claim(
        &mut self,
        key: &K,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
        now: Timestamp,
    ) -> RefClaim
    where
        K: Clone,
    {
        let replaced = match self.records.get_mut(key) {
            Some(live) if live.is_live(now) => {
                live.hits += 1;
                return RefClaim::Existing(live.clone());
            }
            Some(expired) => Some(expired.token),
            None => None,
        };
        let token = match self.flaw {
            Flaw::TokenRestartsAfterPurge => replaced.map_or(FencingToken(1), FencingToken::next),
            _ => FencingToken::fresh(now, replaced),
        };
        let lease_until = now.saturating_add(lease);
        self.records.insert(
            key.clone(),
            RefRecord {
                fingerprint: *fingerprint,
                status: RecordStatus::Pending,
                token,
                lease_until: Some(lease_until),
                outcome: None,
                attempts: 1,
                failure: None,
                hits: 0,
                expires_at: now.saturating_add(claim_retention(lease, ttl)),
            },
        );
        RefClaim::Claimed { token, lease_until }
    }

    /// Replaces the token of `key`'s record with the one a real store issued (the kit's model
    /// case checks a store's claimed token against the key's history, then adopts it: a
    /// store's clock need not be the caller's).
    pub fn adopt_token(&mut self, key: &K, token: FencingToken) {
        if let Some(r) = self.records.get_mut(key) {
            r.token = token;
        }
    }

    fn cas_pending(
        &mut self,
        key: &K,
        token: FencingToken,
        now: Timestamp,
        apply: impl FnOnce(&mut RefRecord),
    ) -> Cas {
        match self.records.get_mut(key) {
            Some(r) if r.is_pending_with(now, token) => {
                apply(r);
                Cas::Applied
            }
            _ => Cas::Fenced,
        }
    }

    /// As [`IdempotencyStore::complete`](idempotency_core::IdempotencyStore::complete).
    pub fn complete(
        &mut self,
        key: &K,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
        now: Timestamp,
    ) -> Cas {
        self.cas_pending(key, token, now, |r| {
            r.status = RecordStatus::Completed;
            r.outcome = Some(outcome.to_vec());
            r.lease_until = None;
            r.expires_at = now.saturating_add(ttl);
        })
    }

    /// Completes `key`'s record without the compare-and-swap, if it is live: the write half
    /// of a store whose `complete` reads the record, checks it, then writes it in a second
    /// step. Not part of the contract; it exists so a checker can prove it catches that race.
    pub fn complete_unchecked(
        &mut self,
        key: &K,
        outcome: &[u8],
        ttl: Duration,
        now: Timestamp,
    ) -> Cas {
        match self.records.get_mut(key) {
            Some(r) if r.is_live(now) => {
                r.status = RecordStatus::Completed;
                r.outcome = Some(outcome.to_vec());
                r.lease_until = None;
                r.failure = None;
                r.expires_at = now.saturating_add(ttl);
                Cas::Applied
            }
            _ => Cas::Fenced,
        }
    }

    /// As [`IdempotencyStore::fail`](idempotency_core::IdempotencyStore::fail).
    pub fn fail(
        &mut self,
        key: &K,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
        now: Timestamp,
    ) -> Cas {
        self.cas_pending(key, token, now, |r| {
            r.status = RecordStatus::Failed;
            r.failure = Some(failure.clone());
            r.lease_until = None;
            r.expires_at = now.saturating_add(ttl);
        })
    }

    /// As [`IdempotencyStore::extend`](idempotency_core::IdempotencyStore::extend).
    pub fn extend(&mut self, key: &K, token: FencingToken, lease: Duration, now: Timestamp) -> Cas {
        self.cas_pending(key, token, now, |r| {
            let until = now.saturating_add(lease);
            r.lease_until = Some(until);
            r.expires_at = r.expires_at.max(until);
        })
    }

    /// As [`IdempotencyStore::reclaim`](idempotency_core::IdempotencyStore::reclaim).
    pub fn reclaim(
        &mut self,
        key: &K,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
        now: Timestamp,
    ) -> Reclaim {
        let flaw = self.flaw;
        let Some(r) = self.records.get_mut(key) else {
            return Reclaim::Lost;
        };
        let holds_expected = r.token == expected || flaw == Flaw::ReclaimIgnoresExpectedToken;
        if !r.is_live(now)
            || !holds_expected
            || !(r.is_takeable(now, fingerprint)
                || (flaw == Flaw::ReclaimTakesPermanentFailure && r.status == RecordStatus::Failed))
        {
            return Reclaim::Lost;
        }
        let token = expected.next();
        let lease_until = now.saturating_add(lease);
        r.status = RecordStatus::Pending;
        r.token = token;
        if flaw != Flaw::ReclaimKeepsFingerprint {
            r.fingerprint = *fingerprint;
        }
        r.attempts = r.attempts.saturating_add(1);
        r.lease_until = Some(lease_until);
        r.outcome = None;
        r.failure = None;
        r.expires_at = now.saturating_add(claim_retention(lease, ttl));
        Reclaim::Reclaimed { token, lease_until }
    }

    /// As [`IdempotencyStore::get`](idempotency_core::IdempotencyStore::get): the live record,
    /// without counting a hit.
    pub fn get(&self, key: &K, now: Timestamp) -> Option<&RefRecord> {
        self.records.get(key).filter(|r| r.is_live(now))
    }

    /// As [`IdempotencyStore::purge_expired`](idempotency_core::IdempotencyStore::purge_expired)
    /// with an unbounded batch: deletes every expired record, returning how many.
    pub fn purge_expired(&mut self, now: Timestamp) -> u64 {
        let before = self.records.len();
        self.records.retain(|_, r| r.is_live(now));
        (before - self.records.len()) as u64
    }
}
