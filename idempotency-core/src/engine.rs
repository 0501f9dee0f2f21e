//! The engine: claim, run the work once, store and replay its outcome.

use crate::observe::{emit, loggable_key, Event};
use crate::{
    decide, Cas, Claim, ClaimRequest, Decision, Error, ErrorOutcomes, Failure, FencingToken,
    Fingerprint, IdempotencyKey, IdempotencyStore, InFlight, Operation, Policy, Reclaim, Record,
    RecordId, RecordStatus, Scope, Timestamp,
};
use futures::FutureExt;
use serde::{de::DeserializeOwned, Serialize};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// How many claim/reclaim rounds one call makes before reporting the key as in progress.
/// Each lost round means another caller won the key, so more rounds rarely help.
const MAX_ROUNDS: usize = 8;

/// An outcome, and whether it was produced now or replayed from the store.
#[derive(Clone, PartialEq, Eq, Debug)]
#[must_use = "an outcome says whether the work ran or was replayed, and carries its result"]
pub enum Outcome<T> {
    /// The work ran in this call.
    Fresh(T),
    /// The work ran earlier; this is its stored outcome.
    Replayed(T),
}

impl<T> Outcome<T> {
    /// The outcome, fresh or replayed.
    pub fn into_inner(self) -> T {
        match self {
            Self::Fresh(t) | Self::Replayed(t) => t,
        }
    }
    /// A reference to the outcome.
    pub fn get(&self) -> &T {
        match self {
            Self::Fresh(t) | Self::Replayed(t) => t,
        }
    }
    /// Whether the outcome was replayed.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Self::Replayed(_))
    }
}

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
pub struct WorkContext {
    /// The record being worked on.
    pub id: RecordId,
    /// The holder's fencing token.
    pub token: FencingToken,
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
    /// The key was already used with a different request fingerprint.
    Mismatch,
    /// Another attempt holds a live lease on the key (and the policy did not wait, or waited
    /// as long as it allows).
    InProgress {
        /// How long until that attempt's lease passes.
        retry_after: Duration,
    },
    /// The last attempt with this key and fingerprint failed permanently; the work is not
    /// run again while the record is kept.
    FailedPermanently {
        /// The failure's message, for operators (not meant for clients).
        message: String,
    },
}

/// The answers of [`Begin`] that let the caller go on, from [`Begin::proceed`].
#[derive(Debug)]
pub enum Proceed {
    /// The caller holds the key and must run the work, then settle the lease.
    Execute(Lease),
    /// The work already ran; here is its stored outcome.
    Replay(Record),
}

impl Begin {
    /// [`Begin::Execute`] and [`Begin::Replay`] as `Ok`, and the refusals as the [`Error`]
    /// that [`Idempotency::run`] returns for them ([`Error::Mismatch`],
    /// [`Error::InProgress`], [`Error::FailedPermanently`]), for callers that use `?`.
    pub fn proceed(self) -> Result<Proceed, Error> {
        match self {
            Begin::Execute(lease) => Ok(Proceed::Execute(lease)),
            Begin::Replay(record) => Ok(Proceed::Replay(record)),
            Begin::Mismatch => Err(Error::Mismatch),
            Begin::InProgress { retry_after } => Err(Error::InProgress { retry_after }),
            Begin::FailedPermanently { message } => Err(Error::FailedPermanently { message }),
        }
    }
}

/// The idempotency engine: wraps a unit of work so that it runs once per `(scope, key)` and
/// every retry gets the first outcome.
///
/// ```
/// # use idempotency_core::*;
/// # async fn example(store: std::sync::Arc<dyn IdempotencyStore>) -> Result<(), Error> {
/// let engine = Idempotency::new(store, Policy::default())?;
/// let key = IdempotencyKey::new("charge-123")?;
/// let scope = Scope::from_parts(["tenant-1", "charge"])?;
/// let fp = Fingerprint::from_json(&serde_json::json!({"amount": 500}));
/// let outcome = engine
///     .run(&key, &scope, &fp, |_ctx| async { Ok::<_, String>("receipt-1".to_string()) })
///     .await?;
/// println!("replayed: {}, receipt: {:?}", outcome.is_replayed(), outcome.get());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Idempotency {
    store: Arc<dyn IdempotencyStore>,
    policy: Arc<Policy>,
}

impl Idempotency {
    /// An engine over `store` with `policy` (checked with [`Policy::validate`]).
    pub fn new(store: Arc<dyn IdempotencyStore>, policy: Policy) -> Result<Self, Error> {
        policy.validate()?;
        Ok(Self {
            store,
            policy: Arc::new(policy),
        })
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn IdempotencyStore> {
        &self.store
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Runs `work` once for `(scope, key)`.
    ///
    /// `Ok` outcomes are stored and replayed; `Err` outcomes follow [`Policy::errors`]: by
    /// default they release the key for a retry and are returned as `Fresh(Err(e))`.
    /// A duplicate while the first attempt runs gets [`Error::InProgress`] (or waits, per
    /// [`Policy::in_flight`]); a different fingerprint gets [`Error::Mismatch`].
    pub async fn run<T, E, F, Fut>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        work: F,
    ) -> Result<Outcome<Result<T, E>>, Error>
    where
        T: Serialize + DeserializeOwned + Send,
        E: Serialize + DeserializeOwned + std::fmt::Display + Send,
        F: FnOnce(WorkContext) -> Fut + Send,
        Fut: Future<Output = Result<T, E>> + Send,
    {
        let errors = self.policy.errors;
        self.run_with(
            key,
            scope,
            fingerprint,
            move |r: &Result<T, E>| match (r, errors) {
                (Ok(_), _) | (Err(_), ErrorOutcomes::Store) => Disposition::Store,
                (Err(e), ErrorOutcomes::RecordFailure) => {
                    Disposition::Release(Failure::retryable(e.to_string()))
                }
            },
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
    ) -> Result<Outcome<R>, Error>
    where
        R: Serialize + DeserializeOwned + Send,
        C: FnOnce(&R) -> Disposition + Send,
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
                self.claim_request(RecordId::new(scope.clone(), key.clone()), fingerprint);
            let lease = match self.begin_request(request).await?.proceed()? {
                Proceed::Replay(record) => return decode_replay(&record).map(Outcome::Replayed),
                Proceed::Execute(lease) => lease,
            };
            let ctx = lease.context();
            let result = match lease
                .with_heartbeat(AssertUnwindSafe(work(ctx)).catch_unwind())
                .await
            {
                Ok(r) => r,
                Err(panic) => {
                    // Release the key before the panic goes on, so a retry need not wait for
                    // the lease to pass.
                    lease.release_after_panic().await;
                    std::panic::resume_unwind(panic);
                }
            };
            match classify(&result) {
                Disposition::Store => {
                    let bytes =
                        serde_json::to_vec(&result).map_err(|source| Error::Codec { source });
                    match bytes {
                        Ok(bytes) => lease.complete(&bytes).await?,
                        Err(e) => {
                            let _ = lease.fail(Failure::permanent(e.to_string())).await;
                            return Err(e);
                        }
                    }
                }
                Disposition::Release(failure) => lease.fail(failure).await?,
            }
            Ok(Outcome::Fresh(result))
        }
        .instrument(span)
        .await
    }

    /// Claims `id` for a request with `fingerprint`: either the caller now holds the key and
    /// gets a [`Lease`] to run the work under, or the work already ran and its record is
    /// returned for replay, or the request is refused (a mismatch, a duplicate in flight, a
    /// permanent failure), all as [`Begin`] values; `Err` means that something broke.
    ///
    /// This is the low-level entry point for callers that store their own outcome format (the
    /// HTTP layer) or complete inside their own database transaction.
    pub async fn begin(&self, id: &RecordId, fingerprint: &Fingerprint) -> Result<Begin, Error> {
        self.begin_request(self.claim_request(id.clone(), fingerprint))
            .await
    }

    fn claim_request(&self, id: RecordId, fingerprint: &Fingerprint) -> ClaimRequest {
        ClaimRequest {
            id,
            fingerprint: *fingerprint,
            lease: self.policy.lease,
            ttl: self.policy.ttl,
            count_hit: self.policy.count_hits,
        }
    }

    /// [`Idempotency::begin`] on a prepared request, whose address moves into the lease.
    ///
    /// One request counts one hit: it claims once, and every later look (after a lost
    /// reclaim, while waiting) is a `get`, decided against the store's `now` from that claim
    /// plus the time elapsed since. That estimate only steers the next step: a reclaim is
    /// still decided by the store's clock, and a record the estimate thinks expired is
    /// claimed again, which the store decides.
    async fn begin_request(&self, request: ClaimRequest) -> Result<Begin, Error> {
        let started = Instant::now();
        // Store calls go to the `dyn` store itself (here and in `Lease`): method lookup on the
        // `Arc` would pick the forwarding `impl IdempotencyStore for Arc<T>`, one more boxed
        // future and virtual call per operation.
        let store = self.store.as_ref();
        let (id, fingerprint) = (&request.id, &request.fingerprint);
        let mut backoff = match self.policy.in_flight {
            InFlight::Wait {
                initial_backoff, ..
            } => initial_backoff,
            InFlight::Reject => Duration::ZERO,
        };
        let mut last_retry_after = self.policy.lease;
        // The store's clock at the last claim, and when that was on ours.
        let mut store_clock: Option<(Timestamp, Instant)> = None;
        let mut reread = false;
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
                None => match store
                    .claim(&request)
                    .await
                    .map_err(|e| e.during(Operation::Claim, self.loggable(id)))?
                {
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
            match decide(
                Some(&record),
                fingerprint,
                now,
                self.policy.decision_options(),
            ) {
                Decision::Claim => reread = false,
                Decision::Replay => {
                    emit(Event::Replay);
                    return Ok(Begin::Replay(record));
                }
                Decision::Mismatch => {
                    emit(Event::Mismatch);
                    return Ok(Begin::Mismatch);
                }
                Decision::FailedPermanently => {
                    emit(Event::FailedPermanently);
                    return Ok(Begin::FailedPermanently {
                        message: record.failure.map(|f| f.message).unwrap_or_default(),
                    });
                }
                Decision::Reclaim { expected } => {
                    match store
                        .reclaim(
                            id,
                            expected,
                            fingerprint,
                            self.policy.lease,
                            self.policy.ttl,
                        )
                        .await
                        .map_err(|e| e.during(Operation::Reclaim, self.loggable(id)))?
                    {
                        Reclaim::Reclaimed { token, .. } => {
                            emit(Event::Reclaim);
                            return Ok(Begin::Execute(self.lease(request.id, token)));
                        }
                        // Someone else moved the record on: look again (a `get`).
                        Reclaim::Lost => {}
                    }
                }
                Decision::InProgress { retry_after } => {
                    last_retry_after = retry_after;
                    let InFlight::Wait {
                        max_wait,
                        max_backoff,
                        ..
                    } = self.policy.in_flight
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
                            return Ok(Begin::InProgress { retry_after });
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
                }
            }
        }
        emit(Event::InProgress);
        Ok(Begin::InProgress {
            retry_after: last_retry_after,
        })
    }

    /// `id` as logs and errors show it: the key hashed when the policy says so.
    fn loggable(&self, id: &RecordId) -> String {
        loggable_record(id, &self.policy)
    }

    fn lease(&self, id: RecordId, token: FencingToken) -> Lease {
        Lease::new(self.store.clone(), self.policy.clone(), id, token)
    }
}

/// `id` as logs and errors show it: `scope#key`, the key hashed when the policy says so.
fn loggable_record(id: &RecordId, policy: &Policy) -> String {
    format!(
        "{}#{}",
        id.scope,
        loggable_key(&id.key, policy.hash_keys_in_logs)
    )
}

/// Decodes a Completed record's outcome as JSON into `R`.
pub fn decode_replay<R: DeserializeOwned>(record: &Record) -> Result<R, Error> {
    let bytes = record
        .outcome
        .as_deref()
        .ok_or_else(|| Error::corrupt(format!("completed record {} has no outcome", record.id)))?;
    serde_json::from_slice(bytes).map_err(|source| Error::Codec { source })
}

/// The right to run the work for a key, held until it is settled.
///
/// Settle it with [`Lease::complete`] or [`Lease::fail`], or with
/// [`Lease::settled_externally`] after committing the completion inside your own transaction.
/// Run the work inside [`Lease::with_heartbeat`] to extend the lease while it runs (per
/// [`Policy::heartbeat`], for at most [`Policy::max_work_time`]); [`Idempotency::run`] does
/// this for you.
///
/// # When the key is released
///
/// The key is released at once (the record becomes Failed and a retry runs) only when the
/// work is known not to have acted, or the policy says its failure is to be retried: the
/// work returned an outcome the policy releases, or it panicked ([`Idempotency::run`] calls
/// [`Lease::fail`] for both). Everything else holds the key until the lease passes, because
/// the work may have acted:
/// - a lease dropped unsettled (the work's future was cancelled by a timeout, an abort or a
///   client that went away, or a caller of [`Idempotency::begin`] returned early): nothing
///   is written, the heartbeat stops with the future, and a retry is told
///   [`Error::InProgress`] until the lease passes, then takes the key over;
/// - a completion the store refused with errors through every try of
///   [`Policy::settle_retry`]: the caller gets [`Error::OutcomeUnknown`] and the record stays
///   Pending until the lease passes.
///
/// Call [`Lease::fail`] yourself to release a key whose work you know did nothing.
#[derive(Debug)]
#[must_use = "a lease holds the key: complete it, fail it or hold it; dropped, it holds the key \
              until the lease passes"]
pub struct Lease {
    store: Arc<dyn IdempotencyStore>,
    policy: Arc<Policy>,
    id: RecordId,
    token: FencingToken,
    claimed_at: Instant,
    lost: AtomicBool,
    settled: bool,
}

impl Lease {
    fn new(
        store: Arc<dyn IdempotencyStore>,
        policy: Arc<Policy>,
        id: RecordId,
        token: FencingToken,
    ) -> Self {
        Self {
            store,
            policy,
            id,
            token,
            claimed_at: Instant::now(),
            lost: AtomicBool::new(false),
            settled: false,
        }
    }

    /// The record being worked on.
    pub fn id(&self) -> &RecordId {
        &self.id
    }

    /// The holder's fencing token.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// The id and token, for the work.
    pub fn context(&self) -> WorkContext {
        WorkContext {
            id: self.id.clone(),
            token: self.token,
        }
    }

    /// Whether the heartbeat found the lease taken over.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// The retention the policy gives settled records.
    pub fn ttl(&self) -> Duration {
        self.policy.ttl
    }

    /// When the heartbeat stops extending this lease: the claim plus
    /// [`Policy::max_work_time`]. A caller that keeps the lease alive by other means (the SQL
    /// stores' exactly-once paths) stops there too.
    pub fn work_deadline(&self) -> Instant {
        self.claimed_at
            .checked_add(self.policy.max_work_time)
            .unwrap_or_else(|| self.claimed_at + Duration::from_secs(100 * 366 * 24 * 3600))
    }

    /// Runs `work` to completion while extending the lease every `fraction × lease` (per
    /// [`Policy::heartbeat`]), until [`Policy::max_work_time`] after the claim: a work that
    /// hangs then stops being extended, its lease passes, and a retry may take the key over
    /// (this work's completion is then fenced). The heartbeat is polled in the caller's
    /// task, so nothing is spawned and short work costs no more than a timer; dropping the
    /// returned future stops it. If an extension is fenced the record is read back: when the
    /// work's own transaction has settled it (this holder's token, no longer Pending) the
    /// heartbeat just stops; otherwise the lease is marked lost ([`Lease::is_lost`]) and the
    /// work still runs to its end; its completion will then be refused with
    /// [`Error::LeaseLost`].
    pub async fn with_heartbeat<F: Future>(&self, work: F) -> F::Output {
        let Some(fraction) = self.policy.heartbeat else {
            return work.await;
        };
        let every = self
            .policy
            .lease
            .mul_f64(fraction)
            .max(Duration::from_millis(1));
        let beat = async {
            loop {
                tokio::time::sleep(every).await;
                let worked = self.claimed_at.elapsed();
                if worked >= self.policy.max_work_time {
                    tracing::warn!(
                        record = %loggable_record(&self.id, &self.policy),
                        worked = ?worked,
                        "the work outlived max_work_time; its lease is no longer extended"
                    );
                    return;
                }
                // Never extend past the end of the maximum work time.
                let lease = self
                    .policy
                    .lease
                    .min(self.policy.max_work_time - worked)
                    .max(Duration::from_millis(1));
                match self
                    .store
                    .as_ref()
                    .extend(&self.id, self.token, lease)
                    .await
                {
                    Ok(Cas::Applied) => {}
                    Ok(Cas::Fenced) => {
                        // Read back, as for every fence: the work's own transaction may have
                        // settled the record (a handler that committed its completion and is
                        // still answering). Then there is nothing left to extend, and nothing
                        // was lost.
                        let settled_by_us = match self.store.as_ref().get(&self.id).await {
                            Ok(Some(r)) => {
                                r.token == self.token && r.status != RecordStatus::Pending
                            }
                            _ => false,
                        };
                        if !settled_by_us {
                            self.lost.store(true, Ordering::SeqCst);
                            emit(Event::LeaseLost);
                        }
                        return;
                    }
                    // A failed extension is retried at the next beat; the lease may pass
                    // meanwhile, and then the CAS reports it.
                    Err(e) => tracing::warn!(
                        error = %e.during(
                            Operation::Extend,
                            loggable_record(&self.id, &self.policy)
                        ),
                        "lease heartbeat failed"
                    ),
                }
            }
        };
        let work = std::pin::pin!(work);
        let beat = std::pin::pin!(beat);
        match futures::future::select(work, beat).await {
            futures::future::Either::Left((out, _)) => out,
            futures::future::Either::Right(((), work)) => work.await,
        }
    }

    /// Stores the outcome. [`Error::LeaseLost`] if another holder took the key over.
    ///
    /// A store error is retried per [`Policy::settle_retry`] (the write is a compare-and-swap
    /// on the token). Every refusal is read back: a write that was applied although its
    /// answer was lost (or that a client resent after it applied) shows as this holder's
    /// Completed record, and is a success. If every try fails the key is **not** released:
    /// the record stays Pending until its lease passes and the result is
    /// [`Error::OutcomeUnknown`]. It is `OutcomeUnknown` too when a try is refused and the
    /// record is gone (purged, evicted, or lost by a store that restarted without its data),
    /// or replaced although an earlier try may have applied and its record since expired (a
    /// retention shorter than the retries).
    pub async fn complete(mut self, outcome: &[u8]) -> Result<(), Error> {
        let this = &self;
        let cas = this
            .settle_with_retries(RecordStatus::Completed, || {
                this.store
                    .as_ref()
                    .complete(&this.id, this.token, outcome, this.policy.ttl)
            })
            .await;
        match cas {
            Err(e) => {
                // The work ran: never release the key because its outcome could not be stored.
                self.settled = true;
                emit(Event::OutcomeNotStored);
                tracing::error!(
                    record = %loggable_record(&self.id, &self.policy),
                    error = %e,
                    "the outcome could not be stored; the key stays pending until its lease passes"
                );
                Err(match e {
                    e @ Error::OutcomeUnknown { .. } => e,
                    e => Error::OutcomeUnknown {
                        source: Box::new(e),
                    },
                })
            }
            cas => self.settle(cas),
        }
    }

    /// Records a failure and releases the key. [`Error::LeaseLost`] if the token was fenced.
    ///
    /// A store error is retried per [`Policy::settle_retry`]; if every try fails, the error
    /// is returned and the key stays Pending until its lease passes.
    pub async fn fail(mut self, failure: Failure) -> Result<(), Error> {
        let this = &self;
        let cas = this
            .settle_with_retries(RecordStatus::Failed, || {
                this.store
                    .as_ref()
                    .fail(&this.id, this.token, &failure, this.policy.ttl)
            })
            .await;
        if cas.is_err() {
            // Nothing is released; the lease passes on its own.
            self.settled = true;
        }
        self.settle(cas)
    }

    /// Tries `write` per the settle policy. Every `Fenced` answer is checked with a read of
    /// the record, because a fence is not always another holder:
    /// - the record is in `status` with this token: a try was applied and only its answer
    ///   was lost (a failed try, or a client that resent a write which had already applied);
    /// - the record still holds this token in another state: another writer settled it;
    /// - the record is gone (a purge, an eviction, a store that lost its data): no other
    ///   holder fenced this one. A completion's outcome is then [`Error::OutcomeUnknown`] (an
    ///   applied try's record may have expired, or been lost with the data), never
    ///   `LeaseLost`; a release has nothing left to release, so it counts as applied;
    /// - another token holds the record: fenced, unless an earlier try failed and may have
    ///   applied before its record expired and was replaced (a retention shorter than the
    ///   retries, plus a margin): then [`Error::OutcomeUnknown`]. Within the retention an
    ///   applied try would still show, so `Fenced` is certain.
    async fn settle_with_retries<'a, W, Fut>(
        &self,
        status: RecordStatus,
        write: W,
    ) -> Result<Cas, Error>
    where
        W: Fn() -> Fut,
        Fut: Future<Output = Result<Cas, Error>> + 'a,
    {
        let operation = match status {
            RecordStatus::Failed => Operation::Fail,
            _ => Operation::Complete,
        };
        self.settle_tries(status, write)
            .await
            .map_err(|e| e.during(operation, loggable_record(&self.id, &self.policy)))
    }

    async fn settle_tries<'a, W, Fut>(&self, status: RecordStatus, write: W) -> Result<Cas, Error>
    where
        W: Fn() -> Fut,
        Fut: Future<Output = Result<Cas, Error>> + 'a,
    {
        let retry = self.policy.settle_retry;
        let mut backoff = retry.initial_backoff;
        let mut failed_before = false;
        let mut attempt = 1;
        // No try applied before this, so an applied try's record lives until at least this
        // plus the retention.
        let first_try = Instant::now();
        loop {
            match write().await {
                Ok(Cas::Applied) => return Ok(Cas::Applied),
                Ok(Cas::Fenced) => {
                    let window = failed_before.then(|| first_try.elapsed());
                    return self.check_fence(status, window).await;
                }
                Err(e) if attempt >= retry.attempts => return Err(e),
                Err(e) => {
                    tracing::warn!(
                        record = %loggable_record(&self.id, &self.policy),
                        error = %e,
                        attempt,
                        "settling the lease failed; trying again"
                    );
                    failed_before = true;
                    attempt += 1;
                    tokio::time::sleep(backoff).await;
                    backoff = backoff.saturating_mul(2).min(retry.max_backoff);
                }
            }
        }
    }

    /// What a `Fenced` answer to a write that settles the record in `status` means, read
    /// back from the record (see [`Lease::settle_with_retries`]). `since_failed_try` is how
    /// long ago the first try was sent when an earlier try failed (and may have applied).
    async fn check_fence(
        &self,
        status: RecordStatus,
        since_failed_try: Option<Duration>,
    ) -> Result<Cas, Error> {
        /// Room for the store's clock (millisecond timestamps, another host's rate).
        const RETENTION_MARGIN: Duration = Duration::from_secs(1);
        let record = self.store.as_ref().get(&self.id).await?;
        match record {
            Some(r) if r.token == self.token && r.status == status => Ok(Cas::Applied),
            // Still this holder's token in another state: another writer settled it, and no
            // try of ours applied.
            Some(r) if r.token == self.token => Ok(Cas::Fenced),
            // Gone: nobody took the key over. A release has nothing left to release.
            None if status == RecordStatus::Failed => Ok(Cas::Applied),
            None => Err(Error::OutcomeUnknown {
                source: "the completion was refused and the record is gone (purged, evicted \
                         or lost by the store): whether the outcome was stored is unknown"
                    .into(),
            }),
            Some(_)
                if since_failed_try.is_some_and(|elapsed| {
                    elapsed.saturating_add(RETENTION_MARGIN) >= self.policy.ttl
                }) =>
            {
                Err(Error::OutcomeUnknown {
                    source: "an earlier try may have applied, and its record has since expired"
                        .into(),
                })
            }
            Some(_) => Ok(Cas::Fenced),
        }
    }

    /// Marks the lease settled without writing: the caller committed the completion CAS in
    /// its own transaction (the SQL stores' exactly-once path).
    pub fn settled_externally(mut self) {
        self.settled = true;
    }

    /// Releases the key after the work panicked (a panic counts as a failed attempt, and a
    /// retry need not wait for the lease to pass): a retryable failure is recorded. The
    /// engine, the SQL exactly-once paths and the HTTP layer all release through this. A
    /// failure to release is logged; the lease then passes on its own.
    pub async fn release_after_panic(self) {
        let record = loggable_record(&self.id, &self.policy);
        match self.fail(Failure::retryable("the work panicked")).await {
            Ok(()) => {}
            Err(e @ Error::LeaseLost { .. }) => {
                tracing::warn!(record = %record, error = %e, "the key was taken over before it could be released after a panic");
            }
            Err(e) => {
                tracing::warn!(record = %record, error = %e, "could not release the key after a panic; its lease will pass");
            }
        }
    }

    /// The policy the lease runs under.
    pub(crate) fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Holds the key without writing anything: the record stays Pending until its lease
    /// passes (a retry is told [`Error::InProgress`] until then, and takes the key over
    /// after). For work that may have acted but whose outcome is not stored, so that a
    /// retry does not run it again at once. Dropping a lease unsettled does the same, but
    /// counts as abandoned work; this says it was meant.
    pub fn hold(mut self) {
        self.settled = true;
        tracing::debug!(
            record = %loggable_record(&self.id, &self.policy),
            token = %self.token,
            "the key is held until its lease passes"
        );
    }

    fn settle(&mut self, cas: Result<Cas, Error>) -> Result<(), Error> {
        match cas {
            Ok(Cas::Applied) => {
                self.settled = true;
                Ok(())
            }
            Ok(Cas::Fenced) => {
                // The record belongs to someone else now: nothing to release on drop.
                self.settled = true;
                emit(Event::LeaseLost);
                Err(Error::LeaseLost { token: self.token })
            }
            Err(e) => Err(e),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // The work may have acted before it was dropped: writing a failure would let a retry
        // run it again at once. Leave the record Pending; its lease passes on its own.
        emit(Event::Abandoned);
        tracing::warn!(
            record = %loggable_record(&self.id, &self.policy),
            token = %self.token,
            "a lease was dropped unsettled; the key stays pending until its lease passes"
        );
    }
}

#[cfg(test)]
mod tests {
    //! The engine's own loop, against a scripted store: bounds and call counts that a real
    //! store cannot be made to provoke on demand.
    use super::*;
    use crate::Timestamp;
    use async_trait::async_trait;
    use std::collections::VecDeque;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    /// Answers claims from a script (then repeats the last answer), `get` with a fixed record,
    /// and loses every reclaim; counts the calls.
    #[derive(Debug, Default)]
    struct Scripted {
        claims: Mutex<VecDeque<Claim>>,
        get: Option<Record>,
        claim_delay: Duration,
        extend_fenced: bool,
        complete_fenced: bool,
        fail_fenced: bool,
        /// Answers of the first completions, before `complete_fenced` applies.
        completes: Mutex<VecDeque<Result<Cas, Error>>>,
        extends: Mutex<Vec<Duration>>,
        claimed: AtomicUsize,
        got: AtomicUsize,
        reclaimed: AtomicUsize,
    }

    #[async_trait]
    impl IdempotencyStore for Scripted {
        async fn claim(&self, _: &ClaimRequest) -> Result<Claim, Error> {
            self.claimed.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(self.claim_delay).await;
            let mut claims = self.claims.lock().expect("lock");
            let next = if claims.len() > 1 {
                claims.pop_front()
            } else {
                claims.front().cloned()
            };
            Ok(next.expect("a scripted claim"))
        }
        async fn complete(
            &self,
            _: &RecordId,
            _: FencingToken,
            _: &[u8],
            _: Duration,
        ) -> Result<Cas, Error> {
            if let Some(answer) = self.completes.lock().expect("lock").pop_front() {
                return answer;
            }
            Ok(if self.complete_fenced {
                Cas::Fenced
            } else {
                Cas::Applied
            })
        }
        async fn fail(
            &self,
            _: &RecordId,
            _: FencingToken,
            _: &Failure,
            _: Duration,
        ) -> Result<Cas, Error> {
            Ok(if self.fail_fenced {
                Cas::Fenced
            } else {
                Cas::Applied
            })
        }
        async fn extend(
            &self,
            _: &RecordId,
            _: FencingToken,
            lease: Duration,
        ) -> Result<Cas, Error> {
            self.extends.lock().expect("lock").push(lease);
            Ok(if self.extend_fenced {
                Cas::Fenced
            } else {
                Cas::Applied
            })
        }
        async fn reclaim(
            &self,
            _: &RecordId,
            _: FencingToken,
            _: &Fingerprint,
            _: Duration,
            _: Duration,
        ) -> Result<Reclaim, Error> {
            self.reclaimed.fetch_add(1, Ordering::SeqCst);
            Ok(Reclaim::Lost)
        }
        async fn get(&self, _: &RecordId) -> Result<Option<Record>, Error> {
            self.got.fetch_add(1, Ordering::SeqCst);
            Ok(self.get.clone())
        }
        async fn purge_expired(&self, _: usize) -> Result<u64, Error> {
            Ok(0)
        }
    }

    fn id() -> RecordId {
        RecordId::new(
            Scope::new("engine-tests").expect("scope"),
            IdempotencyKey::new("k").expect("key"),
        )
    }

    fn fp() -> Fingerprint {
        Fingerprint::from_bytes(b"f")
    }

    fn now() -> Timestamp {
        Timestamp::from_millis(1_000_000)
    }

    /// A Pending record whose lease ends `lease_ms` after [`now`], expiring in an hour.
    fn pending(lease_ms: i64) -> Record {
        Record {
            id: id(),
            fingerprint: fp(),
            status: RecordStatus::Pending,
            token: FencingToken(5),
            lease_until: Some(Timestamp::from_millis(now().as_millis() + lease_ms)),
            outcome: None,
            attempts: 1,
            failure: None,
            hits: 1,
            created_at: now(),
            updated_at: now(),
            expires_at: Timestamp::from_millis(now().as_millis() + 3_600_000),
        }
    }

    fn engine(store: Arc<Scripted>, policy: Policy) -> Idempotency {
        Idempotency::new(store, policy).expect("policy")
    }

    #[test]
    fn outcome_helpers() {
        let fresh = Outcome::Fresh(1);
        let replayed = Outcome::Replayed(2);
        assert!(!fresh.is_replayed());
        assert!(replayed.is_replayed());
        assert_eq!((*fresh.get(), *replayed.get()), (1, 2));
        assert_eq!((fresh.into_inner(), replayed.into_inner()), (1, 2));
    }

    #[test]
    fn the_engine_keeps_its_store_and_policy() {
        let store = Arc::new(Scripted::default());
        let e = engine(
            store.clone(),
            Policy::default().lease(Duration::from_secs(7)),
        );
        assert_eq!(e.policy().lease, Duration::from_secs(7));
        let dyn_store: Arc<dyn IdempotencyStore> = store;
        assert!(Arc::ptr_eq(e.store(), &dyn_store));
    }

    /// A key whose reclaims keep being lost (someone else always wins) is reported in
    /// progress after exactly `MAX_ROUNDS` tries, from one claim: every later look is a `get`.
    #[tokio::test]
    async fn lost_reclaims_give_up_after_max_rounds() {
        let passed = pending(-1);
        let store = Arc::new(Scripted {
            claims: Mutex::new(VecDeque::from([Claim::Existing {
                record: passed.clone(),
                now: now(),
            }])),
            get: Some(passed),
            ..Scripted::default()
        });
        let e = engine(store.clone(), Policy::default());
        let got = tokio::time::timeout(Duration::from_secs(5), e.begin(&id(), &fp()))
            .await
            .expect("the engine looped without bound");
        assert!(matches!(got, Ok(Begin::InProgress { .. })), "{got:?}");
        assert_eq!(store.reclaimed.load(Ordering::SeqCst), MAX_ROUNDS);
        assert_eq!(
            store.claimed.load(Ordering::SeqCst),
            1,
            "one claim per request"
        );
    }

    /// When the decision is to claim (the record read had expired), the engine claims again
    /// rather than reading again.
    #[tokio::test]
    async fn a_claim_decision_claims_again() {
        let mut expired = pending(1000);
        expired.expires_at = now();
        let store = Arc::new(Scripted {
            claims: Mutex::new(VecDeque::from([
                Claim::Existing {
                    record: expired.clone(),
                    now: now(),
                },
                Claim::Claimed {
                    token: FencingToken(6),
                    lease_until: now(),
                },
            ])),
            get: Some(expired),
            ..Scripted::default()
        });
        let e = engine(store.clone(), Policy::default());
        match e.begin(&id(), &fp()).await {
            Ok(Begin::Execute(lease)) => {
                assert_eq!(lease.token(), FencingToken(6));
                lease.settled_externally();
            }
            other => panic!("after an expired observation the engine got {other:?}"),
        }
        assert_eq!(store.claimed.load(Ordering::SeqCst), 2);
    }

    /// A waiter never sleeps past `max_wait`, even when a slow store used part of it and the
    /// backoff is longer than what is left.
    #[tokio::test]
    async fn waiting_never_oversleeps_max_wait() {
        let live = pending(3_600_000);
        let store = Arc::new(Scripted {
            claims: Mutex::new(VecDeque::from([Claim::Existing {
                record: live.clone(),
                now: now(),
            }])),
            get: Some(live),
            claim_delay: Duration::from_millis(200),
            ..Scripted::default()
        });
        let max_wait = Duration::from_millis(300);
        let e = engine(
            store,
            Policy::default().in_flight(InFlight::Wait {
                max_wait,
                initial_backoff: Duration::from_secs(10),
                max_backoff: Duration::from_secs(10),
            }),
        );
        let started = Instant::now();
        let got = e.begin(&id(), &fp()).await;
        let waited = started.elapsed();
        assert!(matches!(got, Ok(Begin::InProgress { .. })), "{got:?}");
        assert!(
            waited >= max_wait && waited < max_wait + Duration::from_millis(250),
            "gave up after {waited:?} with max_wait {max_wait:?}"
        );
    }

    /// While the holder's lease is live, a waiter reads the record once per backoff and does
    /// not count hits (no claims).
    #[tokio::test]
    async fn waiting_polls_once_per_backoff() {
        let live = pending(3_600_000);
        let store = Arc::new(Scripted {
            claims: Mutex::new(VecDeque::from([Claim::Existing {
                record: live.clone(),
                now: now(),
            }])),
            get: Some(live),
            ..Scripted::default()
        });
        let backoff = Duration::from_millis(50);
        let e = engine(
            store.clone(),
            Policy::default().in_flight(InFlight::Wait {
                max_wait: Duration::from_millis(500),
                initial_backoff: backoff,
                max_backoff: backoff,
            }),
        );
        let got = e.begin(&id(), &fp()).await;
        assert!(matches!(got, Ok(Begin::InProgress { .. })), "{got:?}");
        let polls = store.got.load(Ordering::SeqCst);
        assert!(
            (1..=11).contains(&polls),
            "{polls} reads in 500 ms of 50 ms backoffs (one per backoff expected)"
        );
        assert_eq!(store.claimed.load(Ordering::SeqCst), 1);
    }

    fn lease_on(store: Arc<Scripted>, policy: Policy) -> Lease {
        Lease::new(store, Arc::new(policy), id(), FencingToken(5))
    }

    /// The heartbeat marks the lease lost only when an extension is fenced.
    #[tokio::test]
    async fn is_lost_only_after_a_fenced_extension() {
        let policy = Policy::default()
            .lease(Duration::from_millis(30))
            .heartbeat(Some(0.3));
        let work = || tokio::time::sleep(Duration::from_millis(100));
        let kept = lease_on(Arc::new(Scripted::default()), policy.clone());
        kept.with_heartbeat(work()).await;
        assert!(!kept.is_lost(), "applied extensions marked the lease lost");
        kept.settled_externally();
        let store = Arc::new(Scripted {
            extend_fenced: true,
            ..Scripted::default()
        });
        let taken = lease_on(store.clone(), policy);
        taken.with_heartbeat(work()).await;
        assert!(
            taken.is_lost(),
            "a fenced extension did not mark the lease lost"
        );
        assert_eq!(
            store.extends.lock().expect("lock").len(),
            1,
            "beats after the fence"
        );
        taken.settled_externally();
    }

    /// A heartbeat fenced because the work's own transaction completed the record (a handler
    /// that committed its completion and is still building its response) is not a lost
    /// lease: the record, read back, shows this holder's token settled. The heartbeat stops.
    /// Fenced with another holder's token, it is lost.
    #[tokio::test]
    async fn a_heartbeat_fenced_by_our_own_completion_is_not_lost() {
        let policy = Policy::default()
            .lease(Duration::from_millis(30))
            .heartbeat(Some(0.3));
        let ours = Record {
            status: RecordStatus::Completed,
            lease_until: None,
            outcome: Some(b"x".to_vec()),
            ..pending(0)
        };
        let mut theirs = pending(1000);
        theirs.token = FencingToken(6);
        for (record, lost) in [(ours, false), (theirs, true)] {
            let what = format!("{:?} token {}", record.status, record.token);
            let store = Arc::new(Scripted {
                extend_fenced: true,
                get: Some(record),
                ..Scripted::default()
            });
            let lease = lease_on(store.clone(), policy.clone());
            lease
                .with_heartbeat(tokio::time::sleep(Duration::from_millis(100)))
                .await;
            assert_eq!(lease.is_lost(), lost, "{what}");
            assert_eq!(
                store.extends.lock().expect("lock").len(),
                1,
                "{what}: beats after the fence"
            );
            lease.settled_externally();
        }
    }

    /// The heartbeat never extends past the end of the maximum work time, and stops there.
    #[tokio::test]
    async fn extensions_end_with_max_work_time() {
        let store = Arc::new(Scripted::default());
        let policy = Policy::default()
            .lease(Duration::from_millis(300))
            .heartbeat(Some(1.0 / 3.0))
            .max_work_time(Duration::from_millis(450));
        let lease = lease_on(store.clone(), policy);
        lease
            .with_heartbeat(tokio::time::sleep(Duration::from_millis(800)))
            .await;
        let extends = store.extends.lock().expect("lock").clone();
        assert!(
            (2..=4).contains(&extends.len()),
            "extensions after max_work_time: {extends:?}"
        );
        let last = *extends.last().expect("an extension");
        assert!(
            last < Duration::from_millis(200),
            "the last extension ({last:?}) reaches past the maximum work time: {extends:?}"
        );
        lease.settled_externally();
    }

    #[test]
    fn work_deadline_is_claim_plus_max_work_time_and_saturates() {
        let store = Arc::new(Scripted::default());
        let lease = lease_on(
            store.clone(),
            Policy::default().max_work_time(Duration::from_secs(600)),
        );
        let d = lease.work_deadline().duration_since(lease.claimed_at);
        assert_eq!(d, Duration::from_secs(600));
        lease.settled_externally();
        let eternal = lease_on(store, Policy::default().max_work_time(Duration::MAX));
        assert!(
            eternal.work_deadline() > Instant::now() + Duration::from_secs(50 * 365 * 24 * 3600),
            "Duration::MAX does not saturate to the far future"
        );
        eternal.settled_externally();
    }

    /// A completion fenced at its first try, on a record another holder took over, is
    /// `LeaseLost`, also with a retention shorter than the retries (only a try that failed
    /// before can have applied unseen). The fence is checked with one read.
    #[tokio::test]
    async fn a_first_try_fenced_is_lease_lost() {
        let mut theirs = pending(1000);
        theirs.token = FencingToken(6);
        let store = Arc::new(Scripted {
            complete_fenced: true,
            get: Some(theirs),
            ..Scripted::default()
        });
        let lease = lease_on(
            store.clone(),
            Policy::default().ttl(Duration::from_millis(500)),
        );
        match lease.complete(b"x").await {
            Err(Error::LeaseLost { token }) => assert_eq!(token, FencingToken(5)),
            other => panic!("a fenced first try got {other:?}"),
        }
        assert_eq!(
            store.got.load(Ordering::SeqCst),
            1,
            "a fenced first try is read back once"
        );
    }

    /// A client that resends a write which had already applied (a cluster client that
    /// reconnects after a reset and sends the script again) gets `Fenced` for its own
    /// completion: the read-back finds this holder's Completed record, so it is a success.
    #[tokio::test]
    async fn a_fenced_first_try_over_our_own_completion_is_success() {
        let ours = Record {
            status: RecordStatus::Completed,
            lease_until: None,
            outcome: Some(b"x".to_vec()),
            ..pending(0)
        };
        let store = Arc::new(Scripted {
            complete_fenced: true,
            get: Some(ours),
            ..Scripted::default()
        });
        let lease = lease_on(store.clone(), Policy::default());
        let got = lease.complete(b"x").await;
        assert!(
            got.is_ok(),
            "our own stored completion came back as {got:?}"
        );
        assert_eq!(store.got.load(Ordering::SeqCst), 1);
    }

    /// A record that is simply gone (a store restarted without persistence, an eviction, a
    /// failover) was not fenced by another holder: after a failed try, then `Fenced`, with no
    /// record to read back, the completion's outcome is unknown, never `LeaseLost`. Also at
    /// the first try, and with the default (long) retention.
    #[tokio::test]
    async fn a_fence_with_no_record_is_outcome_unknown() {
        for failed_first in [true, false] {
            let completes = match failed_first {
                true => VecDeque::from([Err(Error::backend(true, "connection reset"))]),
                false => VecDeque::new(),
            };
            let store = Arc::new(Scripted {
                completes: Mutex::new(completes),
                complete_fenced: true,
                get: None,
                ..Scripted::default()
            });
            let lease = lease_on(store, Policy::default());
            match lease.complete(b"x").await {
                Err(Error::OutcomeUnknown { .. }) => {}
                other => panic!(
                    "failed first: {failed_first}; a fence with the record gone got {other:?}"
                ),
            }
        }
    }

    /// A release fenced because the record is gone has released the key all the same: the
    /// failure is not reported as a lost lease.
    #[tokio::test]
    async fn a_fenced_release_with_no_record_is_released() {
        let store = Arc::new(Scripted {
            fail_fenced: true,
            get: None,
            ..Scripted::default()
        });
        let lease = lease_on(store.clone(), Policy::default());
        let got = lease.fail(Failure::retryable("nothing was done")).await;
        assert!(got.is_ok(), "a release of a gone record got {got:?}");
        assert_eq!(store.got.load(Ordering::SeqCst), 1);
    }

    /// A completion that failed, then was fenced on its retry, is an applied one only if the
    /// record shows this holder's token in the Completed state; a record another holder took
    /// over or completed meanwhile means this outcome was not stored.
    #[tokio::test]
    async fn a_fence_after_a_failed_try_is_checked_against_the_record() {
        let mut theirs = pending(1000);
        theirs.token = FencingToken(6);
        let mut their_completed = theirs.clone();
        their_completed.status = RecordStatus::Completed;
        their_completed.outcome = Some(b"theirs".to_vec());
        let mut ours_failed = pending(1000);
        ours_failed.status = RecordStatus::Failed;
        for (record, applied) in [
            (theirs, false),
            (their_completed, false),
            (ours_failed, false),
            (
                Record {
                    status: RecordStatus::Completed,
                    lease_until: None,
                    outcome: Some(b"x".to_vec()),
                    ..pending(0)
                },
                true,
            ),
        ] {
            let what = format!("{:?} token {}", record.status, record.token);
            let store = Arc::new(Scripted {
                completes: Mutex::new(VecDeque::from([Err(Error::backend(true, "flaky"))])),
                complete_fenced: true,
                get: Some(record),
                ..Scripted::default()
            });
            let lease = lease_on(store, Policy::default());
            match (lease.complete(b"x").await, applied) {
                (Ok(()), true) | (Err(Error::LeaseLost { .. }), false) => {}
                (other, _) => panic!("record {what}: the completion got {other:?}"),
            }
        }
    }

    /// A store error says which operation failed on which record, with the key hashed when
    /// the policy hashes keys in logs, and whether a retry is safe.
    #[tokio::test]
    async fn store_errors_name_the_operation_and_the_record() {
        let failing = || {
            Mutex::new(VecDeque::from(
                [(); 8].map(|()| Err(Error::backend(true, "connection reset"))),
            ))
        };
        for hashed in [false, true] {
            let policy = Policy::default().hash_keys_in_logs(hashed);
            let store = Arc::new(Scripted {
                completes: failing(),
                ..Scripted::default()
            });
            let err = lease_on(store, policy.clone())
                .complete(b"x")
                .await
                .expect_err("every try fails");
            assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err:?}");
            let call = err.store_call().expect("the error says where");
            assert_eq!(call.operation, Operation::Complete);
            let key = loggable_key(&id().key, hashed);
            assert_eq!(call.record, format!("engine-tests#{key}"));
            assert_eq!(key.starts_with("sha256:"), hashed);
            let line = err.to_string();
            assert!(line.contains("complete of record engine-tests#"), "{line}");
            assert_eq!(line.contains("#k:"), !hashed, "{line}");
        }
        // Claims too, with the retry hint.
        let err = Error::backend(false, "refused").during(Operation::Claim, "s#sha256:abc");
        assert_eq!(
            err.to_string(),
            "store error (not retryable as is): claim of record s#sha256:abc: refused"
        );
        // Saying where twice keeps the first (innermost) place.
        let again = err.during(Operation::Get, "other");
        assert_eq!(
            again.store_call().map(|c| c.operation),
            Some(Operation::Claim)
        );
    }

    /// With a retention shorter than the retries, a fence after a failed try may hide an
    /// applied try whose record has since expired: a record gone or held by another token is
    /// `OutcomeUnknown`; one that still holds this token in another state is `LeaseLost`.
    #[tokio::test]
    async fn a_fence_after_a_failed_try_with_a_short_retention() {
        let mut theirs = pending(1000);
        theirs.token = FencingToken(6);
        let mut ours_failed = pending(1000);
        ours_failed.status = RecordStatus::Failed;
        for (record, unknown) in [
            (None, true),
            (Some(theirs), true),
            (Some(ours_failed), false),
        ] {
            let what = format!("{record:?}");
            let store = Arc::new(Scripted {
                completes: Mutex::new(VecDeque::from([Err(Error::backend(true, "flaky"))])),
                complete_fenced: true,
                get: record,
                ..Scripted::default()
            });
            let lease = lease_on(store, Policy::default().ttl(Duration::from_millis(500)));
            match (lease.complete(b"x").await, unknown) {
                (Err(Error::OutcomeUnknown { .. }), true)
                | (Err(Error::LeaseLost { .. }), false) => {}
                (other, _) => panic!("record {what}: the completion got {other:?}"),
            }
        }
    }
}
