//! The engine: claim, run the work once, store and replay its outcome.

mod batch;
mod builder;
mod lease;
#[cfg(test)]
mod tests;

pub use batch::{BatchMessage, BatchReport, MessageOutcome, MessageReport};
pub use builder::IdempotencyBuilder;
pub(crate) use lease::Acted;
pub use lease::Lease;

use crate::observe::{emit, loggable_key, Event};
use crate::{
    decide, Answer, Claim, ClaimRequest, Decision, Error, ErrorMode, ErrorOutcomes, Failure,
    FencingToken, Fingerprint, IdempotencyKey, IdempotencyStore, InFlight, Operation, Policy,
    Reclaim, Record, RecordId, RecordStatus, Refusal, ReleaseErrors, Scope, Settling, StoreErrors,
    Timestamp,
};
use futures::FutureExt;
use serde::{de::DeserializeOwned, Serialize};
use std::future::Future;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// How many claim/reclaim rounds one call makes before reporting the key as in progress.
/// Each lost round means another caller won the key, so more rounds rarely help.
const MAX_ROUNDS: usize = 8;

/// Whether an outcome is stored for replay or recorded as a failure that releases the key.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Disposition {
    /// Store the outcome; later requests with the key replay it.
    Store,
    /// Do not store it: record a failure and release the key for a retry.
    Release(Failure),
}

/// What the work is told about its claim: the record and its fencing token, for writing the
/// completion inside the caller's own transaction or fencing writes elsewhere.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct WorkContext {
    /// The record being worked on.
    pub id: RecordId,
    /// The holder's fencing token.
    pub token: FencingToken,
}

impl WorkContext {
    /// The context of the holder of `token` on `id`.
    pub fn new(id: RecordId, token: FencingToken) -> Self {
        Self { id, token }
    }
}

/// What [`Idempotency::begin`] decided. Every expected answer is a value: `Err` from
/// `begin` means that something broke (the store failed, a record was corrupt).
#[derive(Debug)]
#[must_use = "a Begin says whether to run the work (holding the key's lease) or what to answer"]
pub enum Begin {
    /// The caller holds the key and must run the work, then settle the lease.
    Execute(Lease),
    /// The work already ran; here is its stored outcome.
    Replay(Record),
    /// The work is not run, and there is nothing to replay.
    Refused(Refusal),
}

/// The idempotency engine: wraps a unit of work so that it runs once per `(scope, key)` and
/// every retry gets the first outcome.
///
/// An engine owns its store: build it with [`Idempotency::builder`] from the store itself.
/// `S` is that store's type, and on a store that completes records inside its own
/// transactions (the SQL stores, DynamoDB: a [`TransactionalStore`](crate::TransactionalStore))
/// the engine also runs work in a transaction ([`Idempotency::run_in_transaction`]) and
/// multi-step operations ([`Idempotency::run_phases`]) on it, with nothing passed twice.
/// `Idempotency` without a parameter is an engine over any store (`dyn IdempotencyStore`),
/// what the HTTP layer and other generic code take: every typed engine converts into one
/// (`engine.into()`), and does everything it does.
///
/// `M` is what a work's `Err` does to its key: by default ([`ReleaseErrors`]) it is recorded
/// as a retryable failure that releases the key, and the error type needs only `Display`;
/// an engine built with [`IdempotencyBuilder::store_errors`] ([`StoreErrors`]) stores it and
/// replays it to every retry, and the error type is `Serialize + DeserializeOwned`.
///
/// ```
/// # use idempotency_core::*;
/// # async fn example(store: impl IdempotencyStore + 'static) -> Result<(), Error> {
/// let engine = Idempotency::builder(store).build()?;
/// let key = IdempotencyKey::new("charge-123")?;
/// let scope = Scope::from_parts(["tenant-1", "charge"])?;
/// let fp = Fingerprint::from_json(&serde_json::json!({"amount": 500}));
/// match engine
///     .run(&key, &scope, &fp, |_ctx| async { Ok::<_, String>("receipt-1".to_string()) })
///     .await?
/// {
///     Answer::Executed(receipt) => println!("ran now: {receipt:?}"),
///     Answer::Replayed(receipt) => println!("ran before: {receipt:?}"),
///     Answer::Refused(refusal) => println!("not run: {refusal}"),
/// }
/// # Ok(()) }
/// ```
pub struct Idempotency<S: ?Sized = dyn IdempotencyStore, M = ReleaseErrors> {
    /// The store the engine owns, as its own type (for the transactional paths).
    owned: Arc<S>,
    /// The same store (or a decorator of it, see [`Idempotency::with_transactions`]), which
    /// every record call goes through.
    store: Arc<dyn IdempotencyStore>,
    policy: Arc<Policy>,
    errors: PhantomData<M>,
}

impl<S: ?Sized, M> Clone for Idempotency<S, M> {
    fn clone(&self) -> Self {
        Self {
            owned: self.owned.clone(),
            store: self.store.clone(),
            policy: self.policy.clone(),
            errors: PhantomData,
        }
    }
}

impl<S: ?Sized, M: ErrorMode> std::fmt::Debug for Idempotency<S, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("store", &self.store)
            .field("policy", &self.policy)
            .field("errors", &M::default())
            .finish()
    }
}

/// An engine over a store of a known type is an engine over any store, with the same
/// treatment of errors.
impl<S: IdempotencyStore + 'static, M> From<Idempotency<S, M>>
    for Idempotency<dyn IdempotencyStore, M>
{
    fn from(engine: Idempotency<S, M>) -> Self {
        engine.erased()
    }
}

impl Idempotency {
    /// An engine over `store` with `policy` (checked with [`Policy::validate`]). Prefer
    /// [`Idempotency::builder`], which keeps the store's type.
    pub fn new(store: Arc<dyn IdempotencyStore>, policy: Policy) -> Result<Self, Error> {
        policy.validate()?;
        Ok(Self {
            owned: store.clone(),
            store,
            policy: Arc::new(policy),
            errors: PhantomData,
        })
    }
}

impl<S: ?Sized, M> Idempotency<S, M> {
    /// The store the engine owns.
    pub fn store(&self) -> &Arc<S> {
        &self.owned
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// This engine over `store` for its transactions ([`Idempotency::run_in_transaction`],
    /// [`Idempotency::run_phases`]), while its record calls keep going through the store it
    /// was built with: for an engine built over a decorator of `store` (one that adds
    /// metrics, tracing or injected faults to the calls), whose calls must reach `store`'s
    /// records, or the completion inside a transaction will not find the record it claimed.
    /// An engine built over the store itself needs none of this.
    pub fn with_transactions<T>(&self, store: T) -> Idempotency<T, M> {
        Idempotency {
            owned: Arc::new(store),
            store: self.store.clone(),
            policy: self.policy.clone(),
            errors: PhantomData,
        }
    }

    /// This engine, storing a work's `Err` and replaying it to every retry ([`StoreErrors`]),
    /// over the same store with the same policy: for one path of a service whose errors are
    /// deterministic answers (a declined payment), beside others that release them.
    pub fn storing_errors(&self) -> Idempotency<S, StoreErrors> {
        self.with_errors()
    }

    /// This engine, recording a work's `Err` as a retryable failure that releases the key
    /// ([`ReleaseErrors`], the default), over the same store with the same policy.
    pub fn releasing_errors(&self) -> Idempotency<S, ReleaseErrors> {
        self.with_errors()
    }

    fn with_errors<N>(&self) -> Idempotency<S, N> {
        Idempotency {
            owned: self.owned.clone(),
            store: self.store.clone(),
            policy: self.policy.clone(),
            errors: PhantomData,
        }
    }

    /// The store every record call goes through.
    pub(crate) fn records(&self) -> &Arc<dyn IdempotencyStore> {
        &self.store
    }

    /// This engine as an engine over any store.
    pub(crate) fn erased(&self) -> Idempotency<dyn IdempotencyStore, M> {
        Idempotency {
            owned: self.store.clone(),
            store: self.store.clone(),
            policy: self.policy.clone(),
            errors: PhantomData,
        }
    }

    /// This engine with `policy` instead of its own (checked).
    pub(crate) fn with_policy(&self, policy: Policy) -> Result<Self, Error> {
        policy.validate()?;
        Ok(Self {
            owned: self.owned.clone(),
            store: self.store.clone(),
            policy: Arc::new(policy),
            errors: PhantomData,
        })
    }

    /// Runs `work` once for `(scope, key)`.
    ///
    /// `Ok` outcomes are stored and replayed; `Err` outcomes follow the engine's `M`: by
    /// default ([`ReleaseErrors`]) they release the key for a retry and are returned as
    /// `Executed(Err(e))`; an engine that stores errors ([`StoreErrors`]) replays them.
    /// A duplicate while the first attempt runs is refused with [`Refusal::InProgress`] (or
    /// waits, per [`Policy::in_flight`]); a different fingerprint with
    /// [`Refusal::KeyReused`]. `Err` means that something broke.
    pub async fn run<T, E, F, Fut>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        work: F,
    ) -> Result<Answer<Result<T, E>>, Error>
    where
        T: Serialize + DeserializeOwned + Send,
        E: Send,
        M: ErrorOutcomes<E>,
        F: FnOnce(WorkContext) -> Fut + Send,
        Fut: Future<Output = Result<T, E>> + Send,
    {
        self.run_settled(
            key,
            scope,
            fingerprint,
            M::settling,
            |record| decode_stored(record, M::replayed),
            work,
        )
        .await
    }

    /// Runs `work` once for `(scope, key)`, with `classify` deciding whether its outcome is
    /// stored or released. Outcomes are stored as JSON.
    pub async fn run_with<R, C, F, Fut>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        classify: C,
        work: F,
    ) -> Result<Answer<R>, Error>
    where
        R: Serialize + DeserializeOwned + Send,
        C: FnOnce(&R) -> Disposition + Send,
        F: FnOnce(WorkContext) -> Fut + Send,
        Fut: Future<Output = R> + Send,
    {
        self.run_settled(
            key,
            scope,
            fingerprint,
            |result: &R| match classify(result) {
                Disposition::Store => Settling::stored(result),
                Disposition::Release(failure) => Settling::Release(failure),
            },
            decode_replay,
            work,
        )
        .await
    }

    /// Runs `work` once for `(scope, key)`: `settling` says what is done with its outcome,
    /// `replayed` reads a stored one back.
    async fn run_settled<R, C, D, F, Fut>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        settling: C,
        replayed: D,
        work: F,
    ) -> Result<Answer<R>, Error>
    where
        R: Send,
        C: FnOnce(&R) -> Settling + Send,
        D: FnOnce(&Record) -> Result<R, Error> + Send,
        F: FnOnce(WorkContext) -> Fut + Send,
        Fut: Future<Output = R> + Send,
    {
        let span = tracing::info_span!(
            "idempotency.run",
            scope = %scope,
            key = %loggable_key(key, self.policy.hash_keys_in_logs),
            decision = tracing::field::Empty,
        );
        async move {
            // The request owns the record's address, which then moves into the lease: one
            // copy of the scope and key per call.
            let request =
                self.claim_request(RecordId::new(key.clone(), scope.clone()), fingerprint);
            let lease = match self.begin_request(request).await? {
                Begin::Replay(record) => return replayed(&record).map(Answer::Replayed),
                Begin::Refused(refusal) => return Ok(Answer::Refused(refusal)),
                Begin::Execute(lease) => lease,
            };
            let ctx = lease.context();
            let result = match lease
                .with_heartbeat(AssertUnwindSafe(work(ctx)).catch_unwind())
                .await
            {
                Ok(r) => r,
                Err(panic) => {
                    // The work may have acted before it panicked: settle the key for good
                    // before the panic goes on, so no retry runs it again.
                    lease.settle_after_panic().await;
                    std::panic::resume_unwind(panic);
                }
            };
            match settling(&result) {
                Settling::Store(bytes) => lease.complete(&bytes).await?,
                Settling::Unencodable(e) => {
                    // The work ran: its outcome is lost, final for every payload.
                    let _ = lease.fail(Failure::outcome_not_stored(&e)).await;
                    return Err(e);
                }
                Settling::Release(failure) => lease.fail(failure).await?,
            }
            Ok(Answer::Executed(result))
        }
        .instrument(span)
        .await
    }

    /// Claims `id` for a request with `fingerprint`: either the caller now holds the key and
    /// gets a [`Lease`] to run the work under, or the work already ran and its record is
    /// returned for replay, or the request is refused (a key reused, a duplicate in flight, a
    /// permanent failure, a lost outcome), all as [`Begin`] values; `Err` means that something broke.
    ///
    /// This is the low-level entry point for callers that store their own outcome format (the
    /// HTTP layer) or complete inside their own database transaction.
    pub async fn begin(&self, id: &RecordId, fingerprint: &Fingerprint) -> Result<Begin, Error> {
        self.begin_request(self.claim_request(id.clone(), fingerprint))
            .await
    }

    fn claim_request(&self, id: RecordId, fingerprint: &Fingerprint) -> ClaimRequest {
        ClaimRequest::new(id, *fingerprint, self.policy.lease, self.policy.retention)
            .with_count_hit(self.policy.count_hits)
    }

    /// [`Idempotency::begin`] on a prepared request, whose address moves into the lease.
    ///
    /// One request counts one hit: it claims once, and every later look (after a lost
    /// reclaim, while waiting) is a `get`, decided against the store's `now` from that claim
    /// plus the time elapsed since. That estimate only steers the next step: a reclaim is
    /// still decided by the store's clock, and a record the estimate thinks expired is
    /// claimed again, which the store decides.
    async fn begin_request(&self, request: ClaimRequest) -> Result<Begin, Error> {
        self.begin_with(request, self.policy.in_flight, None).await
    }

    /// [`Idempotency::begin_request`] for a claim already made (one answer of a batch's
    /// `claim_many`), never waiting for a holder in flight: the same decision as if this
    /// call had made the claim itself.
    pub(crate) async fn begin_after_claim(
        &self,
        request: ClaimRequest,
        claim: Claim,
    ) -> Result<Begin, Error> {
        self.begin_with(request, InFlight::Reject, Some(claim))
            .await
    }

    /// [`Idempotency::begin_request`], waiting for a holder in flight as `in_flight` says;
    /// `first`: the answer to the first claim, when the caller already made it.
    async fn begin_with(
        &self,
        request: ClaimRequest,
        in_flight: InFlight,
        mut first: Option<Claim>,
    ) -> Result<Begin, Error> {
        let started = Instant::now();
        // Store calls go to the `dyn` store itself (here and in `Lease`): method lookup on the
        // `Arc` would pick the forwarding `impl IdempotencyStore for Arc<T>`, one more boxed
        // future and virtual call per operation.
        let store = self.store.as_ref();
        let (id, fingerprint) = (&request.id, &request.fingerprint);
        let mut backoff = match in_flight {
            InFlight::Wait {
                initial_backoff, ..
            } => initial_backoff,
            InFlight::Reject => Duration::ZERO,
        };
        let mut last_retry_after = self.policy.lease;
        // The store's clock at the last claim, and when that was on ours.
        let mut store_clock: Option<(Timestamp, Instant)> = None;
        let mut reread = false;
        // The token whose reclaim was lost last, while nothing was seen to change since.
        let mut lost: Option<FencingToken> = None;
        let mut rounds = 0;
        while rounds < MAX_ROUNDS {
            rounds += 1;
            let observed = match store_clock {
                Some((then, at)) if reread => store
                    .get(id)
                    .await
                    .map_err(|e| e.during(Operation::Get, self.loggable(id)))?
                    .map(|record| (record, then.saturating_add(at.elapsed()))),
                _ => None,
            };
            let (record, now) = match observed {
                Some(seen) => seen,
                None => match match first.take() {
                    Some(claim) => claim,
                    None => store
                        .claim(&request)
                        .await
                        .map_err(|e| e.during(Operation::Claim, self.loggable(id)))?,
                } {
                    Claim::Claimed { token, .. } => {
                        emit(Event::Claim);
                        return Ok(Begin::Execute(self.lease(request.id, token)));
                    }
                    Claim::Existing { record, now } => {
                        store_clock = Some((now, Instant::now()));
                        (record, now)
                    }
                },
            };
            reread = true;
            let decision = match decide(
                Some(&record),
                fingerprint,
                now,
                self.policy.decision_options(),
            ) {
                // The store refused to reclaim this very record a moment ago, and it has not
                // changed since: its holder is alive as far as the store knows (a holder's
                // transaction that locked the row and keeps the lease in its process), or
                // the store's clock has not reached the lease's end. The key is in progress;
                // reclaiming it again would only be lost again.
                Decision::Reclaim { expected }
                    if lost == Some(expected) && record.status == RecordStatus::Pending =>
                {
                    Decision::InProgress {
                        retry_after: self.policy.lease,
                    }
                }
                decision => decision,
            };
            match decision {
                Decision::Claim => reread = false,
                Decision::Replay => {
                    emit(Event::Replay);
                    return Ok(Begin::Replay(record));
                }
                Decision::KeyReused => {
                    emit(Event::KeyReused);
                    return Ok(Begin::Refused(Refusal::KeyReused));
                }
                Decision::FailedPermanently => {
                    emit(Event::FailedPermanently);
                    return Ok(Begin::Refused(Refusal::failed(record.failure)));
                }
                Decision::Reclaim { expected } => {
                    match store
                        .reclaim(
                            id,
                            expected,
                            fingerprint,
                            self.policy.lease,
                            self.policy.retention,
                        )
                        .await
                        .map_err(|e| e.during(Operation::Reclaim, self.loggable(id)))?
                    {
                        Reclaim::Reclaimed { token, .. } => {
                            emit(Event::Reclaim);
                            return Ok(Begin::Execute(self.lease(request.id, token)));
                        }
                        // Someone else moved the record on, or the store holds it for a
                        // live holder: look again (a `get`).
                        Reclaim::Lost => lost = Some(expected),
                    }
                }
                Decision::InProgress { retry_after } => {
                    last_retry_after = retry_after;
                    let InFlight::Wait {
                        max_wait,
                        max_backoff,
                        ..
                    } = in_flight
                    else {
                        break;
                    };
                    // Waiting is bounded by `max_wait`, not by rounds.
                    rounds = 0;
                    // Poll with `get` until the holder settles, or until its lease may have
                    // passed; then decide again.
                    let wait_started = Instant::now();
                    loop {
                        let waited = started.elapsed();
                        if waited >= max_wait {
                            emit(Event::InProgress);
                            return Ok(Begin::Refused(Refusal::InProgress { retry_after }));
                        }
                        tokio::time::sleep(backoff.min(max_wait - waited)).await;
                        backoff = backoff.saturating_mul(2).min(max_backoff);
                        match store
                            .get(id)
                            .await
                            .map_err(|e| e.during(Operation::Get, self.loggable(id)))?
                        {
                            Some(r)
                                if r.status == RecordStatus::Pending
                                    && r.token == record.token
                                    && wait_started.elapsed() < retry_after => {}
                            _ => break,
                        }
                    }
                    // Decide afresh: a record unchanged after a whole lease of waiting may be
                    // reclaimed again.
                    lost = None;
                }
            }
        }
        emit(Event::InProgress);
        Ok(Begin::Refused(Refusal::InProgress {
            retry_after: last_retry_after,
        }))
    }

    /// `id` as logs and errors show it: the key hashed when the policy says so.
    fn loggable(&self, id: &RecordId) -> String {
        loggable_record(id, &self.policy)
    }

    pub(crate) fn lease(&self, id: RecordId, token: FencingToken) -> Lease {
        Lease::new(self.store.clone(), self.policy.clone(), id, token)
    }
}

/// `id` as logs and errors show it: `scope#key`, the key hashed when the policy says so.
pub(crate) fn loggable_record(id: &RecordId, policy: &Policy) -> String {
    format!(
        "{}#{}",
        id.scope,
        loggable_key(&id.key, policy.hash_keys_in_logs)
    )
}

/// Decodes a Completed record's outcome as JSON into `R`: [`Error::StoredOutcome`] when it is
/// JSON of another shape, [`Error::CorruptRecord`] when it is not JSON at all.
pub fn decode_replay<R: DeserializeOwned>(record: &Record) -> Result<R, Error> {
    decode_stored(record, |bytes| serde_json::from_slice(bytes))
}

/// Decodes a Completed record's outcome with `decode`, its errors told apart as
/// [`decode_replay`] does.
pub(crate) fn decode_stored<R>(
    record: &Record,
    decode: impl FnOnce(&[u8]) -> Result<R, serde_json::Error>,
) -> Result<R, Error> {
    let bytes = record
        .outcome
        .as_deref()
        .ok_or_else(|| Error::corrupt(format!("completed record {} has no outcome", record.id)))?;
    decode(bytes).map_err(|source| {
        if source.is_data() {
            // JSON, of another shape than the caller's type.
            Error::StoredOutcome { source }
        } else {
            Error::corrupt_with(
                format!("the stored outcome of record {} is not JSON", record.id),
                source,
            )
        }
    })
}
