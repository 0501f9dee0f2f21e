//! A store wrapper that injects the faults real stores have: writes that fail, and writes that
//! apply but whose answer is lost.

use idempotency_core::store::{
    async_trait, Cas, Claim, ClaimRequest, Failure, Reclaim, Record, Settlement,
};
use idempotency_core::{Error, FencingToken, Fingerprint, IdempotencyStore, RecordId};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The operations [`FlakyStore`] can break.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum FlakyOp {
    /// [`IdempotencyStore::complete`].
    Complete,
    /// [`IdempotencyStore::fail`].
    Fail,
    /// [`IdempotencyStore::extend`].
    Extend,
    /// [`IdempotencyStore::settle_many`], the whole batch at once: every settlement of it
    /// gets the fault (a lost answer applies the whole batch first).
    SettleMany,
}

/// How an injected fault looks to the caller.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Fault {
    /// The call is not sent: a retryable [`Error::Backend`], nothing written.
    Refused,
    /// The write is applied, then the answer is lost: [`Error::OutcomeUnknown`].
    AckLost,
    /// The write is applied at once and its answer arrives this much later: a stalled machine
    /// or network, whose caller resumes after time it did not count on has passed.
    LateAnswer(std::time::Duration),
}

#[derive(Debug, Default)]
struct Budget {
    complete: AtomicU64,
    fail: AtomicU64,
    extend: AtomicU64,
    settle_many: AtomicU64,
}

impl Budget {
    fn counter(&self, op: FlakyOp) -> &AtomicU64 {
        match op {
            FlakyOp::Complete => &self.complete,
            FlakyOp::Fail => &self.fail,
            FlakyOp::Extend => &self.extend,
            FlakyOp::SettleMany => &self.settle_many,
        }
    }

    /// Takes one fault from the budget of `op`, if any is left.
    fn take(&self, op: FlakyOp) -> bool {
        self.counter(op)
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

/// Wraps a store and makes the next `n` calls of an operation fail with a [`Fault`]; every
/// other call goes to the store unchanged. Used by the engine cases and the reliability soak
/// to check that a failed completion never lets the work run twice.
///
/// ```
/// use idempotency_conformance::{Fault, FlakyOp, FlakyStore};
/// use idempotency_memory::MemoryStore;
/// use std::sync::Arc;
///
/// let flaky = FlakyStore::new(Arc::new(MemoryStore::new()), Fault::Refused);
/// flaky.inject(FlakyOp::Complete, 2); // the next two completions fail
/// assert_eq!(flaky.injected(), 0);
/// ```
#[derive(Clone, Debug)]
pub struct FlakyStore {
    inner: Arc<dyn IdempotencyStore>,
    fault: Fault,
    budget: Arc<Budget>,
    injected: Arc<AtomicU64>,
}

impl FlakyStore {
    /// A wrapper of `inner` whose injected faults look like `fault`.
    pub fn new(inner: Arc<dyn IdempotencyStore>, fault: Fault) -> Self {
        Self {
            inner,
            fault,
            budget: Arc::default(),
            injected: Arc::default(),
        }
    }

    /// Makes the next `n` calls of `op` fail (adds to what is left).
    pub fn inject(&self, op: FlakyOp, n: u64) {
        self.budget.counter(op).fetch_add(n, Ordering::SeqCst);
    }

    /// Stops injecting into `op`.
    pub fn heal(&self, op: FlakyOp) {
        self.budget.counter(op).store(0, Ordering::SeqCst);
    }

    /// How many faults were injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }

    /// Runs `write` unless a fault is due; applies it first when the fault is a lost answer.
    async fn faulty<T: Send>(
        &self,
        op: FlakyOp,
        write: impl std::future::Future<Output = Result<T, Error>> + Send,
    ) -> Result<T, Error> {
        if !self.budget.take(op) {
            return write.await;
        }
        self.injected.fetch_add(1, Ordering::SeqCst);
        let what = format!("injected fault on {op:?}");
        match self.fault {
            Fault::Refused => Err(Error::backend(true, what)),
            Fault::AckLost => {
                let _ = write.await?;
                Err(Error::OutcomeUnknown {
                    source: what.into(),
                })
            }
            Fault::LateAnswer(pause) => {
                let answer = write.await;
                tokio::time::sleep(pause).await;
                answer
            }
        }
    }
}

#[async_trait]
impl IdempotencyStore for FlakyStore {
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
        self.faulty(
            FlakyOp::Complete,
            self.inner.complete(id, token, outcome, ttl),
        )
        .await
    }

    async fn fail(
        &self,
        id: &RecordId,
        token: FencingToken,
        failure: &Failure,
        ttl: Duration,
    ) -> Result<Cas, Error> {
        self.faulty(FlakyOp::Fail, self.inner.fail(id, token, failure, ttl))
            .await
    }

    async fn extend(
        &self,
        id: &RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<Cas, Error> {
        self.faulty(FlakyOp::Extend, self.inner.extend(id, token, lease))
            .await
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

    /// The inner store's own batch (one round trip where it has one).
    async fn claim_many(&self, requests: &[ClaimRequest]) -> Vec<Result<Claim, Error>> {
        self.inner.claim_many(requests).await
    }

    /// The inner store's own batch, unless a [`FlakyOp::SettleMany`] fault is due.
    async fn settle_many(&self, settlements: &[Settlement]) -> Vec<Result<Cas, Error>> {
        let n = settlements.len();
        match self
            .faulty(FlakyOp::SettleMany, async {
                Ok(self.inner.settle_many(settlements).await)
            })
            .await
        {
            Ok(answers) => answers,
            Err(e) => e.for_each_of(n).into_iter().map(Err).collect(),
        }
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        self.inner.purge_expired(batch).await
    }
}
