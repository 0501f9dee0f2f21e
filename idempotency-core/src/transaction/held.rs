//! A transaction you hold: [`Idempotency::begin_transaction`] claims the key and opens the
//! store's transaction, and the caller writes through it inline, then commits it together
//! with the completion.

use super::driver::{back_off, later, renew_kept, Deadline};
use super::MAX_TRANSACTION_ATTEMPTS;
use super::{encode_outcome, Begun, CommitError, TransactionEnd, TransactionalStore};
use crate::engine::decode_stored;
use crate::{
    Begin, Error, ErrorOutcomes, Failure, Fingerprint, Idempotency, IdempotencyKey, Lease,
    RecordId, Refusal, ReleaseErrors, Scope, WorkContext,
};
use serde::{de::DeserializeOwned, Serialize};
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// What [`Idempotency::begin_transaction`] found: a transaction to write in, the stored
/// outcome of an earlier run, or a refusal.
#[derive(Debug)]
#[must_use = "a Begun transaction must be committed, or it rolls back when dropped"]
pub enum Started<S: TransactionalStore + 'static, T, E, M = ReleaseErrors> {
    /// The key is yours and a transaction is open: write through it, then
    /// [`commit`](HeldTransaction::commit) it.
    Begun(HeldTransaction<S, T, E, M>),
    /// The work ran before: its stored outcome (`Err` is a refusal of yours, stored by an
    /// engine that stores errors).
    Replayed(Result<T, E>),
    /// Nothing runs, and there is nothing to replay: the key is in progress elsewhere, was
    /// used with another request, failed for good or lost its outcome.
    Refused(Refusal),
}

/// A transaction of the engine's store, held by the caller, under the key's lease: it derefs
/// to the store's connection ([`TransactionalStore::Connection`]: a `PgConnection` on
/// Postgres, so `&mut *tx` runs statements; a `SqliteTransaction` on SQLite, whose `run`
/// executes on the connection's thread), and [`commit`](HeldTransaction::commit) writes the
/// key's completion in it and commits, so the writes and the stored outcome commit together
/// or not at all.
///
/// While it is held the lease is kept as the store says: by the heartbeat from another
/// connection, or, where the transaction locked the record (Postgres at REPEATABLE READ and
/// SERIALIZABLE), in the process, renewed for at most the policy's maximum work time. A
/// commit is fenced ([`Error::LeaseLost`], everything rolled back) when the lease passed and
/// another request took the key over, or when the lease kept in the process passed. A
/// locked record stays locked for as long as you hold the guard, and duplicates are told the
/// key is in progress meanwhile: end it promptly.
///
/// Dropped without a commit (an early return, a `?` on a failed statement, a panic), it
/// rolls back and then releases the key, from a task of the runtime it began on: a caller
/// that starts over at once may still be told the key is in progress. To start over after an
/// error, [`rollback`](HeldTransaction::rollback) it first, which releases before it returns.
///
/// The rules of the closure path apply: never `COMMIT` or `ROLLBACK` through the connection
/// (end it through the guard); after a statement whose future you cancelled (a timeout), roll
/// back rather than commit, since the statement may have run; on SQLite, make no other call to
/// the store while you hold it (the transaction holds the database's write lock, and the call
/// would wait for it).
///
/// Unlike [`Idempotency::run_in_transaction`], nothing here runs your statements again after
/// a conflict with a concurrent transaction (a serialization failure, a deadlock): the commit
/// returns the error and the key is released; [`Idempotency::is_conflict`] tells it, and you
/// start over, or use `run_in_transaction`, which does it for you.
pub struct HeldTransaction<S: TransactionalStore + 'static, T, E, M = ReleaseErrors> {
    held: Option<Held<S>>,
    _outcome: PhantomData<fn() -> (T, E)>,
    _errors: PhantomData<M>,
}

struct Held<S: TransactionalStore + 'static> {
    store: Arc<S>,
    lease: Lease,
    transaction: S::Transaction,
    keeper: Keeper,
    /// The runtime the transaction began on: a drop rolls back there, from any thread.
    runtime: tokio::runtime::Handle,
}

/// How the lease is kept while the caller holds the transaction.
enum Keeper {
    /// The heartbeat, from another connection, until the sender drops.
    Heartbeat(Option<(oneshot::Sender<()>, JoinHandle<()>)>),
    /// In the process, while the transaction holds the record locked.
    InProcess(Arc<Deadline>, JoinHandle<()>),
}

impl Keeper {
    /// Stops keeping the lease; says whether it is still held (not passed in the process).
    async fn stop(&mut self) -> bool {
        match self {
            Keeper::Heartbeat(running) => {
                if let Some((stop, beating)) = running.take() {
                    drop(stop);
                    let _ = beating.await;
                }
                true
            }
            Keeper::InProcess(deadline, renewing) => {
                renewing.abort();
                !deadline.passed()
            }
        }
    }

    fn in_process(&self) -> bool {
        matches!(self, Keeper::InProcess(..))
    }

    fn abort(&mut self) {
        match self {
            Keeper::Heartbeat(running) => drop(running.take()),
            Keeper::InProcess(_, renewing) => renewing.abort(),
        }
    }
}

impl<S: TransactionalStore + 'static, M> Idempotency<S, M> {
    /// Claims `(scope, key)` and, when the work is yours to run, opens a transaction of the
    /// engine's store for you to write in: a [`Started::Begun`] holding a
    /// [`HeldTransaction`], or the stored outcome of an earlier run
    /// ([`Started::Replayed`]), or a refusal ([`Started::Refused`]), as
    /// [`Idempotency::run`] decides them. `Err` when the store failed, or
    /// ([`Error::LeaseLost`]) when the claim's lease passed before the transaction could lock
    /// the record.
    ///
    /// ```
    /// # use idempotency_core::transaction::{HeldTransaction, Started};
    /// # use idempotency_core::{Error, Fingerprint, Idempotency, IdempotencyKey, Scope, TransactionalStore};
    /// /// One payment per key: its row and its stored answer commit together.
    /// async fn pay<S: TransactionalStore + 'static>(
    ///     engine: &Idempotency<S>,
    ///     key: &IdempotencyKey,
    ///     fingerprint: &Fingerprint,
    /// ) -> Result<Result<u64, String>, Error> {
    ///     let scope = Scope::new("payments")?;
    ///     match engine.begin_transaction::<u64, String>(key, &scope, fingerprint).await? {
    ///         Started::Begun(tx) => {
    ///             // Write through `&mut *tx` (a `PgConnection` on Postgres); a `?` here drops
    ///             // `tx`: everything rolls back and the key is released.
    ///             Ok(Ok(tx.commit(7).await?))
    ///         }
    ///         Started::Replayed(answer) => Ok(answer),
    ///         Started::Refused(refusal) => Err(Error::backend(true, refusal.to_string())),
    ///     }
    /// }
    /// ```
    pub async fn begin_transaction<T, E>(
        &self,
        key: &IdempotencyKey,
        scope: &Scope,
        fingerprint: &Fingerprint,
    ) -> Result<Started<S, T, E, M>, Error>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        M: ErrorOutcomes<E>,
    {
        let id = RecordId::new(key.clone(), scope.clone());
        let lease = match self.begin(&id, fingerprint).await? {
            Begin::Replay(record) => {
                return decode_stored(&record, M::replayed).map(Started::Replayed)
            }
            Begin::Refused(refusal) => return Ok(Started::Refused(refusal)),
            Begin::Execute(lease) => lease,
        };
        let store = self.store().clone();
        let mut attempt = 0;
        let begun = loop {
            attempt += 1;
            match store.begin(&lease).await {
                Ok(begun) => break begun,
                Err(e) if attempt < MAX_TRANSACTION_ATTEMPTS && store.is_conflict(&e) => {
                    back_off(attempt).await;
                }
                Err(Error::LeaseLost { .. }) => {
                    return Err(settle::<M, T, E>(lease, TransactionEnd::LeaseLost).await)
                }
                // Nothing began: the key is released.
                Err(e) => return Err(settle::<M, T, E>(lease, TransactionEnd::RolledBack(e)).await),
            }
        };
        let (transaction, keeper) = match begun {
            Begun::Open(transaction) => {
                let (stop, stopped) = oneshot::channel::<()>();
                let companion = lease.companion();
                let beating = tokio::spawn(async move {
                    let _ = companion.with_heartbeat(stopped).await;
                });
                (transaction, Keeper::Heartbeat(Some((stop, beating))))
            }
            Begun::Locked {
                transaction,
                lease_left,
            } => {
                let deadline = Arc::new(Deadline::new(later(Instant::now(), lease_left)));
                let (kept, policy, work_deadline) = (
                    deadline.clone(),
                    lease.policy().clone(),
                    lease.work_deadline(),
                );
                let renewing = tokio::spawn(async move { kept.keep(&policy, work_deadline).await });
                (transaction, Keeper::InProcess(deadline, renewing))
            }
        };
        Ok(Started::Begun(HeldTransaction {
            held: Some(Held {
                store,
                lease,
                transaction,
                keeper,
                runtime: tokio::runtime::Handle::current(),
            }),
            _outcome: PhantomData,
            _errors: PhantomData,
        }))
    }

    /// Whether `error` is a conflict with a concurrent transaction (a serialization failure,
    /// a deadlock) after which running the transaction again may succeed: the store's
    /// [`TransactionalStore::is_conflict`].
    pub fn is_conflict(&self, error: &Error) -> bool {
        self.store().is_conflict(error)
    }
}

/// Settles `lease` after an end that is not a commit, and returns the caller's error.
async fn settle<M, T, E>(lease: Lease, end: TransactionEnd<T, E>) -> Error
where
    M: ErrorOutcomes<E>,
    T: Serialize,
{
    match lease.settle_transaction::<M, T, E>(Ok(end)).await {
        Err(e) => e,
        // Only a work's own refusal settles as an answer, and it is not settled here.
        Ok(_) => Error::backend(false, "the transaction ended without a commit"),
    }
}

impl<S, T, E, M> HeldTransaction<S, T, E, M>
where
    S: TransactionalStore + 'static,
    T: Serialize + DeserializeOwned + Send + 'static,
    E: Send + 'static,
    M: ErrorOutcomes<E>,
{
    /// The claim's context (record and fencing token).
    pub fn context(&self) -> Option<WorkContext> {
        self.held.as_ref().map(|held| held.lease.context())
    }

    /// Writes the key's completion with `value` (stored as `Ok(value)`, what every retry of
    /// the key gets back) inside the transaction, and commits: your writes and the completion
    /// commit together. Then:
    ///
    /// - committed: `Ok(value)`;
    /// - the lease passed and another request took the key over (the completion was fenced),
    ///   or the lease kept in the process passed: everything rolled back,
    ///   [`Error::LeaseLost`], and the key is the other request's, or the next one's to take
    ///   over;
    /// - refused (a database error, a conflict: [`Idempotency::is_conflict`]): everything
    ///   rolled back, the key is released, the error is returned;
    /// - the commit was sent and its answer lost: [`Error::OutcomeUnknown`] or the store's
    ///   error, and the key is held until its lease passes (a retry then replays the
    ///   outcome, or runs it if nothing committed).
    pub async fn commit(mut self, value: T) -> Result<T, Error> {
        let Some(held) = self.held.take() else {
            return Err(Error::backend(false, "the transaction already ended"));
        };
        match finish::<S, T, E>(held, value).await {
            (lease, TransactionEnd::Committed(value)) => {
                lease.settled_externally();
                Ok(value)
            }
            (lease, end) => Err(settle::<M, T, E>(lease, end).await),
        }
    }

    /// Rolls everything back and answers the work's own refusal `error` (a declined payment,
    /// an invalid request): by default the key is released for a retry; an engine that
    /// stores errors ([`StoreErrors`](crate::StoreErrors)) stores it, so that retries get it
    /// back. Returns
    /// `error`, or the store's error when it could not be recorded.
    pub async fn refuse(mut self, error: E) -> Result<E, Error> {
        let Some(mut held) = self.held.take() else {
            return Err(Error::backend(false, "the transaction already ended"));
        };
        held.keeper.stop().await;
        held.store.rollback(held.transaction).await;
        // A lease kept in the process was never written: renew the record's before the
        // refusal is recorded (fenced if someone took the key over meanwhile).
        let mut kept = held.keeper.in_process();
        if let Err(end) = renew_kept::<T, E>(&held.lease, &mut kept).await {
            return Err(settle::<M, T, E>(held.lease, end).await);
        }
        match held
            .lease
            .settle_transaction::<M, T, E>(Ok(TransactionEnd::WorkFailed(error)))
            .await?
        {
            crate::Answer::Executed(Err(error)) => Ok(error),
            _ => Err(Error::backend(false, "a refusal settled as something else")),
        }
    }

    /// Rolls everything back and releases the key before it returns, for a retry to run the
    /// work: what a drop does, awaited. (Should the store refuse the release, the key is held
    /// until its lease passes.)
    pub async fn rollback(mut self) {
        if let Some(mut held) = self.held.take() {
            held.keeper.stop().await;
            held.store.rollback(held.transaction).await;
            release(held.lease).await;
        }
    }
}

/// Completes inside `held`'s transaction with `value` and commits; the lease, and how it
/// ended (rolled back on every end but a commit).
async fn finish<S, T, E>(held: Held<S>, value: T) -> (Lease, TransactionEnd<T, E>)
where
    S: TransactionalStore + 'static,
    T: Serialize,
{
    let Held {
        store,
        lease,
        mut transaction,
        mut keeper,
        ..
    } = held;
    let failed = if !keeper.stop().await {
        // The lease kept in the process passed: the record may be someone else's by now.
        TransactionEnd::LeaseLost
    } else {
        match encode_outcome(&Ok::<&T, ()>(&value)) {
            Err(e) => TransactionEnd::RolledBack(e),
            Ok(bytes) => match store.complete_in(&mut transaction, &lease, &bytes).await {
                Ok(()) => {
                    let end = match store.commit(transaction).await {
                        Ok(()) => TransactionEnd::Committed(value),
                        Err(CommitError::NotCommitted(Error::LeaseLost { .. })) => {
                            TransactionEnd::LeaseLost
                        }
                        Err(CommitError::NotCommitted(e)) => TransactionEnd::RolledBack(e),
                        Err(CommitError::Unknown(e)) => TransactionEnd::Unknown(e),
                    };
                    return (lease, end);
                }
                Err(Error::LeaseLost { .. }) => TransactionEnd::LeaseLost,
                Err(e) => TransactionEnd::RolledBack(e),
            },
        }
    };
    store.rollback(transaction).await;
    (lease, failed)
}

/// Releases the key of a transaction that rolled back: nothing of it took effect.
async fn release(lease: Lease) {
    let _ = lease
        .fail(Failure::retryable(
            "the transaction was rolled back before its commit",
        ))
        .await;
}

impl<S: TransactionalStore + 'static, T, E, M> Deref for HeldTransaction<S, T, E, M> {
    type Target = S::Connection;

    fn deref(&self) -> &S::Connection {
        match &self.held {
            Some(held) => S::connection_ref(&held.transaction),
            None => unreachable_connection(),
        }
    }
}

impl<S: TransactionalStore + 'static, T, E, M> DerefMut for HeldTransaction<S, T, E, M> {
    fn deref_mut(&mut self) -> &mut S::Connection {
        match &mut self.held {
            Some(held) => S::connection(&mut held.transaction),
            None => unreachable_connection(),
        }
    }
}

/// `held` is only taken by the methods that consume the transaction.
fn unreachable_connection() -> ! {
    panic!("a HeldTransaction is used after it ended")
}

impl<S: TransactionalStore + 'static, T, E, M> Drop for HeldTransaction<S, T, E, M> {
    fn drop(&mut self) {
        let Some(mut held) = self.held.take() else {
            return;
        };
        held.keeper.abort();
        let Held {
            store,
            lease,
            transaction,
            runtime,
            ..
        } = held;
        // On the runtime the transaction began on, whatever thread drops it (a driver's
        // connection needs one to close); rolled back first, the key released only once
        // nothing of it can commit. A runtime that has shut down runs nothing: the
        // transaction is dropped with it (its database rolls it back when the connection
        // closes) and the key is held until its lease passes.
        let _entered = runtime.enter();
        runtime.spawn(async move {
            store.rollback(transaction).await;
            release(lease).await;
        });
    }
}

impl<S: TransactionalStore + 'static, T, E, M> fmt::Debug for HeldTransaction<S, T, E, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldTransaction")
            .field("lease", &self.held.as_ref().map(|held| &held.lease))
            .finish_non_exhaustive()
    }
}
