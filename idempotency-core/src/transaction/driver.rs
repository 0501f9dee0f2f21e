//! Core's side of the exactly-once path: every step in order, around a [`TransactionalStore`].

use super::MAX_TRANSACTION_ATTEMPTS;
use super::{encode_outcome, Begun, CommitError, TransactionEnd, TransactionalStore};
use crate::engine::decode_stored;
use crate::{
    Answer, Begin, Cas, Error, ErrorOutcomes, Fingerprint, Idempotency, IdempotencyKey, Lease,
    Policy, RecordId, Scope, WorkContext,
};
use futures::future::BoxFuture;
use futures::FutureExt;
use serde::{de::DeserializeOwned, Serialize};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

impl<S: TransactionalStore, M> Idempotency<S, M> {
    /// Runs `work` once for `(scope, key)` with its writes and the record's completion in
    /// **one transaction** of the engine's store, so they commit together or not at all.
    ///
    /// The key is claimed as by [`Idempotency::begin`] (a replay, a key reused with another
    /// request and a key in progress behave as in [`Idempotency::run`]). Then the store
    /// begins a transaction and `work` runs in it with the transaction's connection
    /// ([`TransactionalStore::Connection`]: a `PgConnection` on Postgres). When it returns
    /// `Ok(Ok(value))` the completion runs in the same transaction, which then commits.
    ///
    /// `work` returns `Ok(result)`, the work's own answer (`Ok(Err(e))` is a refusal of
    /// yours, a declined payment: the transaction rolls back and `e` is released, or stored
    /// by an engine that stores errors: [`ErrorOutcomes`]), or `Err(database_error)`, what `?` on a
    /// failed statement returns: the transaction rolls back, and a conflict with a concurrent
    /// transaction (a serialization failure, a deadlock:
    /// [`TransactionalStore::is_conflict`]) runs it again, `work` included, at most
    /// [`MAX_TRANSACTION_ATTEMPTS`](crate::store::MAX_TRANSACTION_ATTEMPTS) times; any other
    /// database error releases the key (nothing committed) and is returned. So `work` acts
    /// only through the connection it is given, never commits, and returns the database
    /// errors it meets rather than swallowing them.
    ///
    /// | the transaction… | the key | you get |
    /// |---|---|---|
    /// | committed | completed: retries replay `value` | `Ok(Answer::Executed(Ok(value)))` |
    /// | rolled back on the work's `Ok(Err(e))` | released (stored by an engine that stores errors) | `Ok(Answer::Executed(Err(e)))` |
    /// | rolled back on a database error, after the last conflict, or a refused commit | released | `Err(error)` |
    /// | was fenced: its lease passed and another holder took the key over | the other holder's | `Err(Error::LeaseLost)` |
    /// | sent its commit and lost the answer | held until its lease passes; a retry then replays or runs it | `Err(Error::OutcomeUnknown)` |
    /// | panicked | released | the panic, resumed |
    ///
    /// How the lease is kept while the work runs depends on the store and its isolation
    /// level (the heartbeat, or the record row locked by the transaction): each store's
    /// crate says how.
    ///
    /// The [`TransactionalStore`] documentation has a complete program, on a toy store.
    pub async fn run_in_transaction<T, E, F>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        mut work: F,
    ) -> Result<Answer<Result<T, E>>, Error>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        M: ErrorOutcomes<E>,
        F: for<'c> FnMut(
                &'c mut S::Connection,
                WorkContext,
            ) -> BoxFuture<'c, Result<Result<T, E>, S::WorkError>>
            + Send,
    {
        self.run_in_transaction_on(&**self.store(), key, scope, fingerprint, |tx, ctx| {
            work(S::connection(tx), ctx)
                .map(|ran| ran.map_err(S::work_error))
                .boxed()
        })
        .await
    }
}

impl<St: ?Sized, M> Idempotency<St, M> {
    /// [`Idempotency::run_in_transaction`] on `store`, which must reach the same records as
    /// this engine's store, with `work` on the store's transaction itself.
    pub(crate) async fn run_in_transaction_on<S, T, E, F>(
        &self,
        store: &S,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
        mut work: F,
    ) -> Result<Answer<Result<T, E>>, Error>
    where
        S: TransactionalStore,
        T: Serialize + DeserializeOwned + Send,
        E: Send,
        M: ErrorOutcomes<E>,
        F: for<'t> FnMut(
                &'t mut S::Transaction,
                WorkContext,
            ) -> BoxFuture<'t, Result<Result<T, E>, Error>>
            + Send,
    {
        let id = RecordId::new(key.clone(), scope.clone());
        let lease = match self.begin(&id, fingerprint).await? {
            Begin::Replay(record) => {
                return decode_stored(&record, M::replayed).map(Answer::Replayed)
            }
            Begin::Refused(refusal) => return Ok(Answer::Refused(refusal)),
            Begin::Execute(lease) => lease,
        };
        let end = AssertUnwindSafe(transaction(store, &lease, &mut work, &Complete, &mut false))
            .catch_unwind()
            .await;
        lease.settle_transaction::<M, _, _>(end).await
    }
}

/// What a transaction writes to the record with the work's value, before its commit: the
/// completion, or (for a phase of a multi-step operation) a recovery point.
pub(crate) trait Seal<S: TransactionalStore, T>: Sync {
    /// The bytes written for `value`.
    fn encode(&self, value: &T) -> Result<Vec<u8>, Error>;

    /// Writes them inside `transaction`, fenced by `lease`'s token ([`Error::LeaseLost`]
    /// when the record is no longer the holder's). By default the record's completion.
    fn seal<'t>(
        &'t self,
        store: &'t S,
        transaction: &'t mut S::Transaction,
        lease: &'t Lease,
        bytes: Vec<u8>,
    ) -> BoxFuture<'t, Result<(), Error>> {
        Box::pin(async move { store.complete_in(transaction, lease, &bytes).await })
    }
}

/// The record's completion, with the work's value stored as `Ok(value)` of a `Result<T, E>`,
/// as the plain engine stores it.
pub(crate) struct Complete;

impl<S: TransactionalStore, T: Serialize> Seal<S, T> for Complete {
    fn encode(&self, value: &T) -> Result<Vec<u8>, Error> {
        encode_outcome(&Ok::<&T, ()>(value))
    }
}

/// Runs the work's transaction under `lease` until it ends (again after each conflict),
/// keeping the lease as [`Begun`] says, and seals it with `seal` before the commit. What
/// then becomes of the key is [`Lease::settle_transaction`]'s to decide.
///
/// `kept_in_process` says whether the last transaction under `lease` kept the lease in the
/// process (its record's own lease may have passed meanwhile): the record's lease is then
/// renewed before this one begins. It is left saying the same of this one, for the next.
pub(crate) async fn transaction<S, T, E, F, Z>(
    store: &S,
    lease: &Lease,
    work: &mut F,
    seal: &Z,
    kept_in_process: &mut bool,
) -> TransactionEnd<T, E>
where
    S: TransactionalStore,
    T: Send,
    E: Send,
    Z: Seal<S, T>,
    F: for<'t> FnMut(
            &'t mut S::Transaction,
            WorkContext,
        ) -> BoxFuture<'t, Result<Result<T, E>, Error>>
        + Send,
{
    let policy = lease.policy();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let again = attempt < MAX_TRANSACTION_ATTEMPTS;
        if let Err(end) = renew_kept(lease, kept_in_process).await {
            return end;
        }
        let (mut tx, until) = match store.begin(lease).await {
            Ok(Begun::Open(tx)) => (tx, None),
            Ok(Begun::Locked {
                transaction,
                lease_left,
            }) => (transaction, Some(later(Instant::now(), lease_left))),
            Err(Error::LeaseLost { .. }) => return TransactionEnd::LeaseLost,
            Err(e) if again && store.is_conflict(&e) => {
                back_off(attempt).await;
                continue;
            }
            // Nothing of this attempt ran, and no earlier attempt committed.
            Err(e) => return TransactionEnd::RolledBack(e),
        };
        *kept_in_process = until.is_some();
        let ran = {
            let running = AssertUnwindSafe(work(&mut tx, lease.context())).catch_unwind();
            match until {
                None => Some(lease.with_heartbeat(running).await),
                Some(until) => keep_alive(policy, until, lease.work_deadline(), running).await,
            }
        };
        let value = match ran {
            Some(Ok(Ok(Ok(value)))) => value,
            Some(Ok(Ok(Err(e)))) => {
                store.rollback(tx).await;
                return TransactionEnd::WorkFailed(e);
            }
            Some(Ok(Err(e))) => {
                store.rollback(tx).await;
                // The work's own statement conflicted with a concurrent transaction (a
                // serialization failure, a deadlock): run it all again, as for the completion.
                if again && store.is_conflict(&e) {
                    back_off(attempt).await;
                    continue;
                }
                return TransactionEnd::RolledBack(e);
            }
            Some(Err(panic)) => {
                // Roll back before the panic goes on (the key is then released).
                store.rollback(tx).await;
                std::panic::resume_unwind(panic);
            }
            None => {
                // The lease passed without a renewal while the record was locked: the work
                // was cancelled; roll back (nothing it did commits) and leave the record,
                // whose lease has passed, to whoever reclaims it.
                store.rollback(tx).await;
                return TransactionEnd::LeaseLost;
            }
        };
        let completed = match seal.encode(&value) {
            Ok(bytes) => seal.seal(store, &mut tx, lease, bytes).await,
            Err(e) => Err(e),
        };
        if let Err(e) = completed {
            store.rollback(tx).await;
            return match e {
                Error::LeaseLost { .. } => TransactionEnd::LeaseLost,
                e if again && store.is_conflict(&e) => {
                    back_off(attempt).await;
                    continue;
                }
                // Nothing committed (the transaction never got to its commit).
                e => TransactionEnd::RolledBack(e),
            };
        }
        match store.commit(tx).await {
            Ok(()) => return TransactionEnd::Committed(value),
            // A store that runs the completion with its commit reports it fenced here.
            Err(CommitError::NotCommitted(Error::LeaseLost { .. })) => {
                return TransactionEnd::LeaseLost
            }
            Err(CommitError::NotCommitted(e)) if again && store.is_conflict(&e) => {
                back_off(attempt).await;
                continue;
            }
            Err(CommitError::NotCommitted(e)) => return TransactionEnd::RolledBack(e),
            // The commit may have applied: the key holds until its lease passes; a retry
            // then finds the Completed record (and replays it) or, if nothing committed,
            // takes the key over and runs the work once.
            Err(CommitError::Unknown(e)) => return TransactionEnd::Unknown(e),
        }
    }
}

/// When the last transaction under `lease` kept the lease in the process while it held the
/// record (`kept_in_process`), the record's own lease may have passed: renews it, fenced if
/// someone took the key over meanwhile. Nothing is committed by a renewal; one whose outcome
/// is not known holds the key until its lease passes, as a dropped lease holds it.
pub(crate) async fn renew_kept<T, E>(
    lease: &Lease,
    kept_in_process: &mut bool,
) -> Result<(), TransactionEnd<T, E>> {
    if !*kept_in_process {
        return Ok(());
    }
    match lease.extend_once().await {
        Ok(Cas::Applied) => {
            *kept_in_process = false;
            Ok(())
        }
        Ok(Cas::Fenced) => Err(TransactionEnd::LeaseLost),
        Err(e) => Err(TransactionEnd::Unknown(e)),
    }
}

/// A short random pause before a transaction runs again after its `attempt`th run
/// conflicted: up to 2^attempt ms (at most 128 ms), so that transactions that conflicted with
/// each other do not meet again at once.
pub(crate) async fn back_off(attempt: u32) {
    let ceiling_micros = 1_000u64 << attempt.min(7);
    // Any randomness will do: a v4 UUID's bits.
    let random = uuid::Uuid::new_v4().as_u64_pair().0;
    tokio::time::sleep(Duration::from_micros(random % (ceiling_micros + 1))).await;
}

/// `now + d`, saturating far in the future instead of overflowing.
pub(crate) fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 366 * 24 * 3600))
}

/// Runs `work` while the transaction holds the record locked, keeping the lease in the
/// process ([`Deadline::keep`]). Returns `None`, dropping (cancelling) the work, once the
/// lease passes without a renewal: the heartbeat is off and the work outlived the lease, or
/// the task was not polled for a whole lease (the process stalled). A work that ends after
/// its lease passed also gets `None`.
async fn keep_alive<F: Future>(
    policy: &Policy,
    until: Instant,
    work_deadline: Instant,
    work: F,
) -> Option<F::Output> {
    let deadline = Deadline::new(until);
    let work = std::pin::pin!(work);
    let beat = std::pin::pin!(deadline.keep(policy, work_deadline));
    match futures::future::select(work, beat).await {
        futures::future::Either::Left((out, _)) => (!deadline.passed()).then_some(out),
        futures::future::Either::Right(((), _work)) => None,
    }
}

/// A lease kept in the process while a transaction holds its record locked: the instant it
/// passes, renewed by [`Deadline::keep`].
#[derive(Debug)]
pub(crate) struct Deadline {
    base: Instant,
    /// Microseconds after `base` (an atomic, so that futures holding it stay `Send`).
    micros: AtomicU64,
}

impl Deadline {
    pub(crate) fn new(until: Instant) -> Self {
        let deadline = Self {
            base: Instant::now(),
            micros: AtomicU64::new(u64::MAX),
        };
        deadline.set(until);
        deadline
    }

    fn set(&self, t: Instant) {
        let micros = u64::try_from(t.saturating_duration_since(self.base).as_micros());
        self.micros
            .store(micros.unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    fn at(&self) -> Instant {
        self.base
            .checked_add(Duration::from_micros(self.micros.load(Ordering::Relaxed)))
            .unwrap_or_else(|| later(self.base, Duration::MAX))
    }

    /// Whether the lease has passed.
    pub(crate) fn passed(&self) -> bool {
        Instant::now() >= self.at()
    }

    /// Renews the lease for a lease's length every heartbeat interval (per
    /// [`Policy::heartbeat`]; never with the heartbeat off), up to `work_deadline`
    /// ([`Lease::work_deadline`]) and never past it, so a hung work loses its lease then.
    /// Returns once the lease has passed without a renewal.
    pub(crate) async fn keep(&self, policy: &Policy, work_deadline: Instant) {
        let every = policy
            .heartbeat
            .map(|fraction| policy.lease.mul_f64(fraction).max(Duration::from_millis(1)));
        loop {
            let next = match every {
                Some(every) => later(Instant::now(), every).min(self.at()),
                None => self.at(),
            };
            tokio::time::sleep_until(next.into()).await;
            let now = Instant::now();
            if now >= self.at() {
                return;
            }
            if every.is_some() && now < work_deadline {
                self.set(later(now, policy.lease).min(work_deadline));
            }
        }
    }
}
