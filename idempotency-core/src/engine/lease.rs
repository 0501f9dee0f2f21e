//! The lease: the right to run the work for a key, its heartbeat, and how it is settled.

use super::loggable_record;
use crate::observe::{emit, Event};
use crate::{
    Cas, Error, Failure, FencingToken, IdempotencyStore, Operation, Policy, RecordId, RecordStatus,
    WorkContext,
};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The right to run the work for a key, held until it is settled.
///
/// Settle it with [`Lease::complete`] or [`Lease::fail`], or with
/// [`Lease::settled_externally`] after committing the completion inside your own transaction.
/// Run the work inside [`Lease::with_heartbeat`] to extend the lease while it runs (per
/// [`Policy::heartbeat`], for at most [`Policy::max_work_time`]); [`Idempotency::run`](crate::Idempotency::run) does
/// this for you.
///
/// # When the key is released
///
/// The key is released at once (the record becomes Failed and a retry runs) only when the
/// work is known not to have acted, or the policy says its failure is to be retried: the
/// work returned an outcome the policy releases ([`Idempotency::run`](crate::Idempotency::run)
/// calls [`Lease::fail`]). A work that panicked may have acted: its key is settled for good
/// ([`Lease::settle_after_panic`]). Everything else holds the key until the lease passes,
/// because the work may have acted:
/// - a lease dropped unsettled (the work's future was cancelled by a timeout, an abort or a
///   client that went away, or a caller of [`Idempotency::begin`](crate::Idempotency::begin) returned early): nothing
///   is written, the heartbeat stops with the future, and a retry is told
///   [`Refusal::InProgress`](crate::Refusal::InProgress) until the lease passes, then takes the key over;
/// - a completion the store refused with errors through every try of
///   [`Policy::settle_retry`] (an outcome over a store's item limit, a store that went away):
///   the caller gets [`Error::OutcomeUnknown`], and the lease records a permanent failure in
///   the outcome's place ([`Failure::outcome_not_stored`]), so a retry is told
///   [`Refusal::OutcomeLost`](crate::Refusal::OutcomeLost), another payload
///   [`Refusal::KeyReused`](crate::Refusal::KeyReused), and none runs the work
///   again. Only if the store refuses that write too does the record stay Pending
///   until the lease passes (a retry may then run the work again: keep the work's effects
///   and the completion in one transaction where that must never happen).
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
    pub(super) claimed_at: Instant,
    lost: AtomicBool,
    settled: bool,
}

impl Lease {
    /// A second handle on this claim that never settles it (its drop writes nothing and
    /// logs nothing): for work that runs elsewhere under the holder's lease.
    pub(crate) fn companion(&self) -> Self {
        Self {
            store: self.store.clone(),
            policy: self.policy.clone(),
            id: self.id.clone(),
            token: self.token,
            claimed_at: self.claimed_at,
            lost: AtomicBool::new(self.is_lost()),
            settled: true,
        }
    }

    pub(super) fn new(
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
    pub fn retention(&self) -> Duration {
        self.policy.retention
    }

    /// How long one renewal of the lease holds the key (the policy's lease): what a store
    /// that renews the lease with a write of the holder's (a recovery point) renews it for.
    pub fn lease(&self) -> Duration {
        self.policy.lease
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
    /// the result is [`Error::OutcomeUnknown`], and a permanent failure is recorded in the
    /// outcome's place (with the same compare-and-swap, so a try that did apply is kept), so
    /// retries are told [`Refusal::OutcomeLost`](crate::Refusal::OutcomeLost) rather than running the work again; if
    /// that write fails too, the record stays Pending until its lease passes. It is
    /// `OutcomeUnknown` too when a try is refused and the
    /// record is gone (purged, evicted, or lost by a store that restarted without its data),
    /// or replaced although an earlier try may have applied and its record since expired (a
    /// retention shorter than the retries).
    pub async fn complete(self, outcome: &[u8]) -> Result<(), Error> {
        self.complete_after(None, outcome, Acted::Maybe).await
    }

    /// [`Lease::complete`] of an outcome whose work is known to have had no effect (its
    /// transaction rolled back): if the outcome cannot be stored, nothing stands in for it,
    /// and the key is held until the lease passes (a retry may then run the work, safely).
    pub(crate) async fn complete_without_effects(self, outcome: &[u8]) -> Result<(), Error> {
        self.complete_after(None, outcome, Acted::No).await
    }

    /// [`Lease::complete`], whose first try was already made (by a batch's `settle_many`,
    /// sent at the `Instant`) and answered so; `acted`: whether the work may have had an
    /// effect.
    pub(crate) async fn complete_after(
        mut self,
        first: Option<(Result<Cas, Error>, Instant)>,
        outcome: &[u8],
        acted: Acted,
    ) -> Result<(), Error> {
        let this = &self;
        let cas = this
            .settle_with_retries(RecordStatus::Completed, first, || {
                this.store
                    .as_ref()
                    .complete(&this.id, this.token, outcome, this.policy.retention)
            })
            .await;
        let e = match cas {
            Err(e) => e,
            cas => return self.settle(cas),
        };
        // The work ran: never release the key because its outcome could not be stored.
        self.settled = true;
        let stand_in = match acted {
            Acted::Maybe => self.record_outcome_not_stored(&e).await,
            Acted::No => StandIn::NotRecorded,
        };
        let record = loggable_record(&self.id, &self.policy);
        match stand_in {
            StandIn::OutcomeStored => {
                // A try applied after all (its answer was lost, and the later tries failed).
                return Ok(());
            }
            StandIn::Recorded => tracing::error!(
                record = %record,
                error = %e,
                "the outcome could not be stored; a permanent failure is recorded in its \
                 place, so no retry runs the work again"
            ),
            StandIn::NotRecorded => tracing::error!(
                record = %record,
                error = %e,
                "the outcome could not be stored; the key stays pending until its lease passes"
            ),
        }
        emit(Event::OutcomeNotStored);
        Err(match e {
            e @ Error::OutcomeUnknown { .. } => e,
            e => Error::OutcomeUnknown {
                source: Box::new(e),
            },
        })
    }

    /// After every try to store the outcome failed (`error`): records
    /// [`Failure::outcome_not_stored`] in its place, so that a retry is told the work failed
    /// for good instead of taking the key over once the lease passes and running the work a
    /// second time. The write is the same compare-and-swap on this holder's token as any
    /// settlement, so a try of the completion that did apply stays; the record is read back
    /// to tell what it holds.
    async fn record_outcome_not_stored(&self, error: &Error) -> StandIn {
        self.record_stand_in(Failure::outcome_not_stored(error))
            .await
    }

    /// Writes `failure` (a [`Failure::outcome_not_stored`]) in the outcome's place and reads
    /// the record back, as [`Lease::record_outcome_not_stored`] says.
    async fn record_stand_in(&self, mut failure: Failure) -> StandIn {
        /// Room for the store's error in the failure message: enough to say what went wrong,
        /// small enough for any store that refused a large outcome.
        const MAX_MESSAGE: usize = 512;
        if failure.message.len() > MAX_MESSAGE {
            let mut end = MAX_MESSAGE;
            while !failure.message.is_char_boundary(end) {
                end -= 1;
            }
            failure.message.truncate(end);
        }
        let cas = self
            .settle_tries(RecordStatus::Failed, None, || {
                self.store
                    .as_ref()
                    .fail(&self.id, self.token, &failure, self.policy.retention)
            })
            .await;
        if let Err(e) = &cas {
            tracing::warn!(
                record = %loggable_record(&self.id, &self.policy),
                error = %e,
                "could not record that the outcome was not stored"
            );
            return StandIn::NotRecorded;
        }
        // `Applied` also answers a write to a record that is gone (nothing to release), and
        // `Fenced` a record this holder completed after all: only the record tells.
        match self.store.as_ref().get(&self.id).await {
            Ok(Some(r)) if r.token == self.token && r.status == RecordStatus::Completed => {
                StandIn::OutcomeStored
            }
            Ok(Some(r))
                if r.token == self.token
                    && r.status == RecordStatus::Failed
                    && r.failure
                        .as_ref()
                        .is_some_and(Failure::is_outcome_not_stored) =>
            {
                StandIn::Recorded
            }
            Ok(_) => StandIn::NotRecorded,
            // Unread: trust the write's answer.
            Err(_) if cas.is_ok_and(|c| c == Cas::Applied) => StandIn::Recorded,
            Err(_) => StandIn::NotRecorded,
        }
    }

    /// Records a failure and releases the key. [`Error::LeaseLost`] if the token was fenced,
    /// unless an earlier try may have applied and the key has moved on since (a retry
    /// reclaimed what that try freed): the release did its job, and this answers `Ok`.
    ///
    /// A store error is retried per [`Policy::settle_retry`]; if every try fails, the error
    /// is returned and the key stays Pending until its lease passes.
    pub async fn fail(self, failure: Failure) -> Result<(), Error> {
        self.fail_after(None, failure).await
    }

    /// [`Lease::fail`], whose first try was already made (see [`Lease::complete_after`]).
    pub(crate) async fn fail_after(
        mut self,
        first: Option<(Result<Cas, Error>, Instant)>,
        failure: Failure,
    ) -> Result<(), Error> {
        let failure = failure.bounded();
        let this = &self;
        let cas = this
            .settle_with_retries(RecordStatus::Failed, first, || {
                this.store
                    .as_ref()
                    .fail(&this.id, this.token, &failure, this.policy.retention)
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
    ///   applied try would still show, so `Fenced` is certain. A release whose earlier try
    ///   ended [`Error::OutcomeUnknown`], by a holder whose lease was not found lost, counts as
    ///   applied: the key it freed was then reclaimed.
    async fn settle_with_retries<'a, W, Fut>(
        &self,
        status: RecordStatus,
        first: Option<(Result<Cas, Error>, Instant)>,
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
        self.settle_tries(status, first, write)
            .await
            .map_err(|e| e.during(operation, loggable_record(&self.id, &self.policy)))
    }

    async fn settle_tries<'a, W, Fut>(
        &self,
        status: RecordStatus,
        mut first: Option<(Result<Cas, Error>, Instant)>,
        write: W,
    ) -> Result<Cas, Error>
    where
        W: Fn() -> Fut,
        Fut: Future<Output = Result<Cas, Error>> + 'a,
    {
        let retry = self.policy.settle_retry;
        let mut backoff = retry.initial_backoff;
        let mut failed_before = false;
        // Whether a failed try may have applied (the store said its outcome is unknown).
        let mut unknown_before = false;
        let mut attempt = 1;
        // No try applied before this, so an applied try's record lives until at least this
        // plus the retention.
        let first_try = first.as_ref().map_or_else(Instant::now, |(_, sent)| *sent);
        loop {
            let answer = match first.take() {
                Some((answer, _)) => answer,
                None => write().await,
            };
            match answer {
                Ok(Cas::Applied) => return Ok(Cas::Applied),
                Ok(Cas::Fenced) => {
                    let window = failed_before.then(|| first_try.elapsed());
                    return self.check_fence(status, window, unknown_before).await;
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
                    unknown_before |= matches!(e, Error::OutcomeUnknown { .. });
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
        unknown_before: bool,
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
            // A release of ours whose outcome the store could not tell may have applied, and a
            // retry of the request then reclaimed the freed key: the release did its job.
            // (Without such a try, or once the heartbeat found the lease lost, the record
            // moved on before this holder released it: its lease was lost.)
            Some(r)
                if status == RecordStatus::Failed
                    && unknown_before
                    && !self.is_lost()
                    && r.token > self.token =>
            {
                Ok(Cas::Applied)
            }
            Some(_)
                if since_failed_try.is_some_and(|elapsed| {
                    elapsed.saturating_add(RETENTION_MARGIN) >= self.policy.retention
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

    /// Settles the key after the work panicked. A panic says nothing about whether the work
    /// acted (it may have charged, then panicked building its answer), so it is settled as
    /// an answer that cannot be replayed: [`Failure::outcome_not_stored`] ("the work
    /// panicked") is recorded in the outcome's place, and while the record is kept a retry is
    /// told [`Refusal::OutcomeLost`](crate::Refusal::OutcomeLost), another payload
    ///   [`Refusal::KeyReused`](crate::Refusal::KeyReused), and none runs
    /// the work again. [`Idempotency::run`](crate::Idempotency::run), a batch and the HTTP
    /// layer settle a panic through this. If the store refuses the write, the record stays
    /// Pending until its lease passes (logged).
    pub async fn settle_after_panic(self) {
        // Whether it settled is logged; a panic has nobody else to tell.
        let _ = self.settle_without_outcome("the work panicked").await;
    }

    /// Settles the key for good after work that may have acted ended without an outcome to
    /// store (it panicked, or a service returned an error instead of an answer): `why` is
    /// recorded as [`Failure::outcome_not_stored`], and while the record is kept a retry is
    /// told [`Refusal::OutcomeLost`](crate::Refusal::OutcomeLost), another payload
    ///   [`Refusal::KeyReused`](crate::Refusal::KeyReused), and none runs
    /// the work again. If the store refuses the write, the record stays Pending until its
    /// lease passes (logged).
    ///
    /// Returns whether the key is settled: `false` when the store refused the write and the
    /// key is only held until its lease passes.
    pub async fn settle_without_outcome(mut self, why: &str) -> bool {
        self.settled = true;
        let record = loggable_record(&self.id, &self.policy);
        match self.record_stand_in(Failure::outcome_not_stored(why)).await {
            StandIn::Recorded => {
                tracing::warn!(
                    record = %record,
                    why,
                    "the work ended without an outcome; its key is settled for good (no retry \
                     runs it again)"
                );
                true
            }
            StandIn::OutcomeStored => true,
            StandIn::NotRecorded => {
                tracing::warn!(
                    record = %record,
                    why,
                    "the work ended without an outcome and its key could not be settled; it \
                     stays pending until its lease passes"
                );
                false
            }
        }
    }

    /// Releases the key after a work that is known to have done nothing panicked (its
    /// transaction rolled back: the SQL exactly-once paths and phases): a retryable failure
    /// is recorded, so a retry runs at once. A work that may have acted is settled with
    /// [`Lease::settle_after_panic`] instead. A failure to release is logged; the lease then
    /// passes on its own.
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

    /// Extends the lease once by the policy's lease, without the heartbeat's read-back: for
    /// the exactly-once driver, which renews a lease it kept in the process.
    pub(crate) async fn extend_once(&self) -> Result<Cas, Error> {
        self.store
            .as_ref()
            .extend(&self.id, self.token, self.policy.lease)
            .await
    }

    /// Holds the key without writing anything: the record stays Pending until its lease
    /// passes (a retry is told [`Refusal::InProgress`](crate::Refusal::InProgress) until then, and takes the key over
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

/// Whether a work may have had an effect, for what stands in for an outcome that could not be
/// stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Acted {
    /// It may have (it ran, and nothing says it did nothing).
    Maybe,
    /// It did not (its transaction rolled back).
    No,
}

/// What the record holds once an outcome could not be stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StandIn {
    /// [`Failure::outcome_not_stored`], written by this holder.
    Recorded,
    /// This holder's outcome: a try applied after all.
    OutcomeStored,
    /// Neither: Pending until the lease passes, gone, or another holder's.
    NotRecorded,
}
