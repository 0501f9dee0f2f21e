//! The engine: claim, run the work once, store and replay its outcome.

use crate::observe::{emit, loggable_key, Event};
use crate::{
    decide, Cas, Claim, ClaimRequest, Decision, Error, ErrorOutcomes, Failure, FencingToken,
    Fingerprint, IdempotencyKey, IdempotencyStore, InFlight, Policy, Reclaim, Record, RecordId,
    RecordStatus, Scope,
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

/// What [`Idempotency::begin`] decided.
#[derive(Debug)]
pub enum Begin {
    /// The caller holds the key and must run the work, then settle the lease.
    Execute(Lease),
    /// The work already ran; here is its stored outcome.
    Replay(Record),
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
            let lease = match self.begin_request(request).await? {
                Begin::Replay(record) => return decode_replay(&record).map(Outcome::Replayed),
                Begin::Execute(lease) => lease,
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
                    let _ = lease.fail(Failure::retryable("the work panicked")).await;
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
    /// returned for replay. Mismatches and in-flight duplicates are errors.
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
        }
    }

    /// [`Idempotency::begin`] on a prepared request, whose address moves into the lease.
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
        let mut rounds = 0;
        while rounds < MAX_ROUNDS {
            rounds += 1;
            let (record, now) = match store.claim(&request).await? {
                Claim::Claimed { token, .. } => {
                    emit(Event::Claim);
                    return Ok(Begin::Execute(self.lease(request.id, token)));
                }
                Claim::Existing { record, now } => (record, now),
            };
            match decide(
                Some(&record),
                fingerprint,
                now,
                self.policy.decision_options(),
            ) {
                Decision::Claim => continue,
                Decision::Replay => {
                    emit(Event::Replay);
                    return Ok(Begin::Replay(record));
                }
                Decision::Mismatch => {
                    emit(Event::Mismatch);
                    return Err(Error::Mismatch);
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
                        .await?
                    {
                        Reclaim::Reclaimed { token, .. } => {
                            emit(Event::Reclaim);
                            return Ok(Begin::Execute(self.lease(request.id, token)));
                        }
                        Reclaim::Lost => continue,
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
                    // Poll with `get` (no hit counted) until the holder settles, or until its
                    // lease may have passed; then claim again, which decides on the store's
                    // clock.
                    let wait_started = Instant::now();
                    loop {
                        let waited = started.elapsed();
                        if waited >= max_wait {
                            emit(Event::InProgress);
                            return Err(Error::InProgress { retry_after });
                        }
                        tokio::time::sleep(backoff.min(max_wait - waited)).await;
                        backoff = (backoff * 2).min(max_backoff);
                        match store.get(id).await? {
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
        Err(Error::InProgress {
            retry_after: last_retry_after,
        })
    }

    fn lease(&self, id: RecordId, token: FencingToken) -> Lease {
        Lease::new(self.store.clone(), self.policy.clone(), id, token)
    }
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
/// [`Policy::heartbeat`]); [`Idempotency::run`] does this for you. Dropping a lease unsettled
/// (the work panicked or its future was cancelled) records a retryable failure in the
/// background, so the key is released at once; if that write cannot be made, the lease simply
/// passes and a retry reclaims the key.
#[derive(Debug)]
pub struct Lease {
    store: Arc<dyn IdempotencyStore>,
    policy: Arc<Policy>,
    id: RecordId,
    token: FencingToken,
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

    /// Runs `work` to completion while extending the lease every `fraction × lease` (per
    /// [`Policy::heartbeat`]). The heartbeat is polled in the caller's task, so nothing is
    /// spawned and short work costs no more than a timer. If an extension is fenced the lease
    /// is marked lost ([`Lease::is_lost`]) and the work still runs to its end; its completion
    /// will then be refused with [`Error::LeaseLost`].
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
                match self
                    .store
                    .as_ref()
                    .extend(&self.id, self.token, self.policy.lease)
                    .await
                {
                    Ok(Cas::Applied) => {}
                    Ok(Cas::Fenced) => {
                        self.lost.store(true, Ordering::SeqCst);
                        emit(Event::LeaseLost);
                        return;
                    }
                    // A failed extension is retried at the next beat; the lease may pass
                    // meanwhile, and then the CAS reports it.
                    Err(e) => tracing::warn!(error = %e, "lease heartbeat failed"),
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

    /// Stores the outcome. [`Error::LeaseLost`] if the token was fenced.
    pub async fn complete(mut self, outcome: &[u8]) -> Result<(), Error> {
        let cas = self
            .store
            .as_ref()
            .complete(&self.id, self.token, outcome, self.policy.ttl)
            .await;
        self.settle(cas)
    }

    /// Records a failure and releases the key. [`Error::LeaseLost`] if the token was fenced.
    pub async fn fail(mut self, failure: Failure) -> Result<(), Error> {
        let cas = self
            .store
            .as_ref()
            .fail(&self.id, self.token, &failure, self.policy.ttl)
            .await;
        self.settle(cas)
    }

    /// Marks the lease settled without writing: the caller committed the completion CAS in
    /// its own transaction (the SQL stores' exactly-once path).
    pub fn settled_externally(mut self) {
        self.settled = true;
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
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let (store, id, token, ttl) = (
                self.store.clone(),
                self.id.clone(),
                self.token,
                self.policy.ttl,
            );
            handle.spawn(async move {
                let failure = Failure::retryable("abandoned: the work was cancelled or panicked");
                if let Err(e) = store.as_ref().fail(&id, token, &failure, ttl).await {
                    tracing::warn!(error = %e, "could not release an abandoned key; its lease will pass");
                }
            });
        }
    }
}
