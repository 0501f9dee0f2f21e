//! The store author's API: the storage contract every backend implements
//! ([`IdempotencyStore`]), the records it keeps and the answers it gives, exactly-once
//! completion inside a database transaction ([`TransactionalStore`]), recovery points for
//! multi-step operations ([`RecoveryPoints`]), the clocks, and the engine's decision function.
//! STORES.md in the repository walks through writing one, and `idempotency-conformance`
//! proves it.

pub use crate::decision::{decide, Decision, DecisionOptions};
pub use crate::error::{BoxError, StoreCall};
pub use crate::phases::{phase_key, Abandoned, AbandonedQuery, RecoveryPoint, RecoveryPoints};
pub use crate::record::{
    claim_retention, Cas, Claim, ClaimRequest, Failure, FencingToken, Reclaim, Record, RecordId,
    RecordStatus,
};
pub use crate::time::{duration_millis, Clock, ManualClock, SystemClock, Timestamp, MAX_DURATION};
pub use crate::transaction::{Begun, CommitError, TransactionalStore, MAX_TRANSACTION_ATTEMPTS};
/// Re-exported so store implementations use the same `async_trait` as the trait.
pub use async_trait::async_trait;

use crate::{Error, Fingerprint};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

/// Atomic storage primitives for idempotency records.
///
/// Each method is **one atomic step** (one statement or script, one round trip on networked
/// stores). The store's own clock decides leases and expiry; `now` below means that clock. A
/// record whose `expires_at` is at or before `now` is *expired*: every method treats it as
/// absent.
///
/// Stores hold no policy: whether to replay, refuse or reclaim is decided by
/// [`crate::store::decide`] in the engine. Implement this trait for your own database and prove it
/// with the `idempotency-conformance` kit.
///
/// The trait is object-safe: `Arc<dyn IdempotencyStore>` works, and `Arc<T>`/`Box<T>` forward.
///
/// # A complete store
///
/// The smallest store that keeps the whole contract, to read before writing one for a
/// database: every record in one map behind one lock. Each method is one atomic step (the
/// lock held once); an expired record is treated as absent everywhere; a fresh record's token
/// comes from [`FencingToken::fresh`], so a key's tokens keep growing after a purge; and the
/// three settling writes share one compare-and-swap. It passes the whole conformance kit
/// (`idempotency-conformance`'s own tests run it: `tests/toy_store.rs`), which is how you
/// prove yours: a factory that builds one isolated store per case (a fresh schema, key prefix
/// or file) and `idempotency_conformance::conformance_tests!(factory)`, one test per case.
///
/// A database store makes each method one statement or script instead (claim-or-observe is
/// one `INSERT … ON CONFLICT … RETURNING`, each compare-and-swap one conditional `UPDATE`),
/// takes `now` from the server's clock, and, if its database has transactions, completes
/// inside the caller's transaction through [`crate::transaction`].
///
#[doc = concat!("```\n", include_str!("toy_store.rs"), "```")]
#[async_trait]
pub trait IdempotencyStore: Send + Sync + Debug + 'static {
    /// Claim-or-observe.
    ///
    /// # Behavior
    /// - No record, or an expired one: atomically writes a `Pending` record with the request's
    ///   fingerprint, `attempts = 1`, `hits = 0`, `lease_until = now + lease`,
    ///   `expires_at = now + max(lease, ttl)`, and a token greater than any token the key
    ///   has ever had in this store, even if its record was purged, evicted or lost (see
    ///   [`FencingToken`]; [`FencingToken::fresh`] derives one from the store's clock), and
    ///   returns [`Claim::Claimed`].
    /// - A live record: increments its `hits` in the same atomic step and returns
    ///   [`Claim::Existing`] with the record as it stands after the increment and the store's
    ///   `now`. Nothing else changes: a live record is never overwritten, whatever its status.
    ///   When [`ClaimRequest::count_hit`] is `false`, a claim that finds the record live
    ///   writes nothing at all (a pure read) and returns it unchanged; only a claim that
    ///   raced with the record's own claim may still count its hit.
    /// - Exactly one of any number of concurrent claims of an absent key gets `Claimed`.
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error>;

    /// Stores the outcome of the holder of `token`.
    ///
    /// # Behavior
    /// Compare-and-swap: applies only if the record is live, `Pending`, and holds `token`;
    /// then sets `Completed`, stores `outcome` byte-for-byte, clears the lease and sets
    /// `expires_at = now + ttl`. Otherwise changes nothing and returns [`Cas::Fenced`].
    async fn complete(
        &self,
        id: &RecordId,
        token: FencingToken,
        outcome: &[u8],
        ttl: Duration,
    ) -> Result<Cas, Error>;

    /// Records that the holder of `token` failed, releasing the key for a reclaim.
    ///
    /// # Behavior
    /// Compare-and-swap as [`IdempotencyStore::complete`]; on success sets `Failed`, stores
    /// `failure`, clears the lease and sets `expires_at = now + ttl`.
    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error>;

    /// Extends the lease of the holder of `token` (the heartbeat).
    ///
    /// # Behavior
    /// Compare-and-swap as [`IdempotencyStore::complete`]; on success sets
    /// `lease_until = now + lease` and moves `expires_at` to at least `lease_until`.
    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error>;

    /// Takes over a record from a failed or stalled holder.
    ///
    /// # Behavior
    /// Compare-and-swap: applies only if the record is live, still holds `expected` (the token
    /// the caller read), and is either `Pending` with `lease_until <= now`, or `Failed` with a
    /// retryable failure, or `Failed` with a permanent failure and a fingerprint other than
    /// `fingerprint` (a permanent failure is final for the request that failed: its work may
    /// have acted, and the engine records one when a work's outcome could not be stored; a
    /// holder may write it after the caller read the record Pending). Then
    /// sets `Pending`, a new token `expected + 1`, the given fingerprint, `attempts + 1`,
    /// `lease_until = now + lease`, `expires_at = now + max(lease, ttl)`, and clears any stored
    /// outcome and the previous attempt's failure, returning [`Reclaim::Reclaimed`]. A stale snapshot (the holder completed after
    /// the caller read it) never overwrites the record: the result is [`Reclaim::Lost`].
    async fn reclaim(
        &self,
        id: &RecordId,
        expected: FencingToken,
        fingerprint: &Fingerprint,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Reclaim, Error>;

    /// Reads a record without counting a hit.
    ///
    /// # Behavior
    /// Returns the live record, or `None` when it is absent or expired.
    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error>;

    /// Deletes up to `batch` expired records, returning how many were deleted.
    ///
    /// # Behavior
    /// Never deletes a live record. Stores whose records expire on their own (Redis TTLs) may
    /// return 0.
    async fn purge_expired(&self, batch: usize) -> Result<u64, Error>;

    /// Claim-or-observe for a batch of requests (a queue consumer's batch of messages): one
    /// answer per request, in order.
    ///
    /// # Behavior
    /// Each answer is what [`IdempotencyStore::claim`] of that request would have answered had
    /// the requests been made one after another in the batch's order: a key named twice is
    /// claimed by its first request at most, and the later ones find that record (and count
    /// their hits). Concurrent batches that share keys still give each key one winner. Each
    /// answer stands alone: an error for one request says nothing about the others, and an
    /// error the whole call met (a lost connection) is given to every request it may have
    /// touched, as [`Error::OutcomeUnknown`] where the request may have been applied.
    ///
    /// The default claims one request after another. A store that can sends the batch in one
    /// round trip.
    async fn claim_many(&self, requests: &[ClaimRequest]) -> Vec<Result<Claim, Error>> {
        let mut out = Vec::with_capacity(requests.len());
        for request in requests {
            out.push(self.claim(request).await);
        }
        out
    }

    /// Settles a batch of claimed keys, each with its outcome or its failure: one answer per
    /// settlement, in order.
    ///
    /// # Behavior
    /// Each answer is what [`IdempotencyStore::complete`] (for [`Settle::Complete`]) or
    /// [`IdempotencyStore::fail`] (for [`Settle::Fail`]) of that settlement would have
    /// answered, made one after another in the batch's order, so a second settlement of one
    /// key is [`Cas::Fenced`]. Errors as for [`IdempotencyStore::claim_many`].
    ///
    /// The default settles one after another. A store that can sends the batch in one round
    /// trip.
    async fn settle_many(&self, settlements: &[Settlement]) -> Vec<Result<Cas, Error>> {
        let mut out = Vec::with_capacity(settlements.len());
        for s in settlements {
            out.push(match &s.settle {
                Settle::Complete(outcome) => self.complete(&s.id, s.token, outcome, s.ttl).await,
                Settle::Fail(failure) => self.fail(&s.id, s.token, failure, s.ttl).await,
            });
        }
        out
    }
}

/// How a claimed key ends, in [`IdempotencyStore::settle_many`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settle {
    /// Completed with this outcome, stored byte for byte (as [`IdempotencyStore::complete`]).
    Complete(Vec<u8>),
    /// Failed (as [`IdempotencyStore::fail`]).
    Fail(Failure),
}

/// One claimed key to settle in [`IdempotencyStore::settle_many`]: the key, the token its
/// holder got, how it ends, and how long its record is kept from now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settlement {
    /// The record's address.
    pub id: RecordId,
    /// The token the holder got from its claim or reclaim.
    pub token: FencingToken,
    /// The outcome or the failure.
    pub settle: Settle,
    /// `expires_at` becomes now plus this.
    pub ttl: Duration,
}

impl Settlement {
    /// Completes `id` with `outcome`.
    pub fn complete(id: RecordId, token: FencingToken, outcome: Vec<u8>, ttl: Duration) -> Self {
        Self {
            id,
            token,
            settle: Settle::Complete(outcome),
            ttl,
        }
    }

    /// Fails `id` with `failure`.
    pub fn fail(id: RecordId, token: FencingToken, failure: Failure, ttl: Duration) -> Self {
        Self {
            id,
            token,
            settle: Settle::Fail(failure),
            ttl,
        }
    }
}

macro_rules! forward_store {
    ($($ty:ty),*) => {$(
        #[async_trait]
        impl<T: IdempotencyStore + ?Sized> IdempotencyStore for $ty {
            async fn claim(&self, request: &ClaimRequest) -> Result<Claim, Error> {
                (**self).claim(request).await
            }
            async fn complete(&self, id: &RecordId, token: FencingToken, outcome: &[u8], ttl: Duration) -> Result<Cas, Error> {
                (**self).complete(id, token, outcome, ttl).await
            }
            async fn fail(&self, id: &RecordId, token: FencingToken, failure: &Failure, ttl: Duration) -> Result<Cas, Error> {
                (**self).fail(id, token, failure, ttl).await
            }
            async fn extend(&self, id: &RecordId, token: FencingToken, lease: Duration) -> Result<Cas, Error> {
                (**self).extend(id, token, lease).await
            }
            async fn reclaim(&self, id: &RecordId, expected: FencingToken, fingerprint: &Fingerprint, lease: Duration, ttl: Duration) -> Result<Reclaim, Error> {
                (**self).reclaim(id, expected, fingerprint, lease, ttl).await
            }
            async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
                (**self).get(id).await
            }
            async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
                (**self).purge_expired(batch).await
            }
            async fn claim_many(&self, requests: &[ClaimRequest]) -> Vec<Result<Claim, Error>> {
                (**self).claim_many(requests).await
            }
            async fn settle_many(&self, settlements: &[Settlement]) -> Vec<Result<Cas, Error>> {
                (**self).settle_many(settlements).await
            }
        }
    )*};
}

forward_store!(Arc<T>, Box<T>);
